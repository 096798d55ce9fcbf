"""The way docs/security.md names to close the server-answer class, tried on the real nats-server.

docs/security.md "What the reply rule cannot stop" says an agent's reply subject makes nats-server send its
acknowledgement, its refusal or a JetStream API answer there, with the account's rights, so a stream of the
gateway's stores it (the residual the project has not closed). It names one way to close it, which this test
keeps true against the nats-server the suite runs: the parties in an account of their own, with no stream,
that imports what they may call from the stores' account as services. Not the project's configuration today
(the contract keeps every party in the stores' account); what the decision would rest on.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import nats
from nats.js.api import ConsumerConfig

from pgwcore.server import EmbeddedServer
from tests.polling import until

# The stores' account exports the calls an agent makes; the parties' account imports them under the same names.
EXPORTS = ["pgw.agent.*.envelope", "$JS.API.CONSUMER.INFO.PGW_OUTBOUND.*",
           "$JS.API.CONSUMER.MSG.NEXT.PGW_OUTBOUND.*", "$JS.ACK.PGW_OUTBOUND.>"]
AGENT_PUB = ["pgw.agent.a.>", "$JS.API.CONSUMER.INFO.PGW_OUTBOUND.outcome-a",
             "$JS.API.CONSUMER.MSG.NEXT.PGW_OUTBOUND.outcome-a", "$JS.ACK.PGW_OUTBOUND.outcome-a.>"]


def accounts_block() -> str:
    exports = ", ".join(f'{{service: "{s}"}}' for s in EXPORTS)
    imports = ", ".join(f'{{service: {{account: STORES, subject: "{s}"}}}}' for s in EXPORTS)
    allow = ", ".join(f'"{s}"' for s in AGENT_PUB)
    return (
        "accounts {\n"
        f"  STORES {{ jetstream: enabled, users: [{{user: gw, password: gw}}], exports: [{exports}] }}\n"
        f"  PARTIES {{ users: [{{user: a, password: a, permissions: {{publish: {{allow: [{allow}]}}, "
        f'subscribe: {{allow: ["_INBOX.>"]}}}}}}], imports: [{imports}] }}\n'
        "}\n"
    )


async def test_answers_aimed_across_a_service_import_store_nothing(tmp_path: Path) -> None:
    """Agent a, in the parties' account: its own publish is acknowledged and its pull consumer works across the
    import; its acknowledgements, refusals and consumer-info answers aimed at the event log's subject, at its own
    input subject or at another agent's are stored nowhere in the stores' account."""
    server = EmbeddedServer(tmp_path / "srv", port=-1, websocket_port=None, authorization=accounts_block(), lock=False)
    async with server:
        url = server.client_url.replace("nats://", "")
        gw = await nats.connect(f"nats://gw:gw@{url}")
        a = await nats.connect(f"nats://a:a@{url}")
        try:
            js = gw.jetstream()
            await js.add_stream(name="PGW_INBOUND", subjects=["pgw.agent.*.envelope"])
            await js.add_stream(name="PGW_EVENTLOG", subjects=["pgw.log.>"])
            await js.add_stream(name="PGW_OUTBOUND", subjects=["pgw.agent.*.outcome"])
            await js.add_consumer("PGW_OUTBOUND", ConsumerConfig(durable_name="outcome-a",
                                                                 filter_subject="pgw.agent.a.outcome"))
            await js.publish("pgw.agent.a.outcome", b'{"o": 1}')

            ack = await a.jetstream().publish("pgw.agent.a.envelope", b'{"mine": 1}', headers={"Nats-Msg-Id": "a:1"})
            assert (ack.stream, ack.seq) == ("PGW_INBOUND", 1)
            for target in ("pgw.log.IDP_SUBMITTED", "pgw.agent.a.envelope", "pgw.agent.b.envelope"):
                await a.publish("pgw.agent.a.envelope", b"{}", reply=target)  # stored; its answer aimed
                await a.publish("pgw.agent.a.envelope", b"{}", reply=target,
                                headers={"Nats-Expected-Last-Sequence": "999999"})  # refused: nothing stored
                await a.publish("$JS.API.CONSUMER.INFO.PGW_OUTBOUND.outcome-a", b"", reply=target)
            pulled = await a.jetstream().pull_subscribe_bind("outcome-a", stream="PGW_OUTBOUND")
            got = await pulled.fetch(1, timeout=10)
            assert got[0].data == b'{"o": 1}'
            await got[0].ack_sync(timeout=10)
            await a.flush()

            async def settled() -> bool:  # every publish above has reached the server and been answered
                ci = await js.consumer_info("PGW_OUTBOUND", "outcome-a")
                return ci.num_ack_pending == 0 and ci.delivered.stream_seq == 1

            await until(settled, timeout=10, what="the agent's ack across the import")
            # A request after them on the same connection: answered once they have all been processed.
            await a.jetstream().publish("pgw.agent.a.envelope", b'{"last": 1}', headers={"Nats-Msg-Id": "a:2"})
            inbound = await js.stream_info("PGW_INBOUND", subjects_filter=">")
            assert inbound.state.subjects == {"pgw.agent.a.envelope": 5}, inbound.state  # a's 1 + 3 aimed + 1
            log = await js.stream_info("PGW_EVENTLOG")
            assert log.state.messages == 0, log.state
            for seq in range(1, 6):
                body = (await js.get_msg("PGW_INBOUND", seq)).data
                assert b"PGW_INBOUND" not in body and b"io.nats" not in body, body  # no answer of the server's
            assert msgspec.json.decode((await js.get_msg("PGW_INBOUND", 5)).data) == {"last": 1}
        finally:
            await a.close()
            await gw.close()
