"""Faults on the gate: kill -9 of the gateway during a burst of gated actions (docs/gate.md "Crash safety").

The gateway runs as ``pgw gateway`` in a child process; the executor (the SDK of
``subjects/executor.py``) and the agents run here. While ``PGW_CHAOS_GATE_ACTIONS``
gated actions (default 500, the issue's number) are in flight the gateway is killed with SIGKILL
and started again; every action without an answer is sent again, as an agent
would. Then, from the event log, the verdict stream and the executor's own
count: every action the kernel permitted (``CEDAR_PERMIT_RECORDED``) ran
exactly once at the executor and has exactly one ``STATE_TRANSITIONED`` and
exactly one ``executed`` verdict; then a signer (in this process) signs the
verdict stream and every permitted action has exactly one signed ``executed``
capsule in ``PGW_REGISTRATION``, which verifies with the signer's key and is
graded ``gate_executed``; an action never permitted never ran.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from consumers.signer import Signer
from consumers.verifier import Store, payload_of, verify_many
from pgwcore.server import EmbeddedServer
from subjects.executor import Executor
from subjects.gate import ActDone, act_result_decoder, idempotency_key
from tests.chaos.harness import ServiceProc, chaos_config, env_int, wait_drained, wait_services
from tests.kernel_support import Issuer, idp, policy_dir, read_log, read_verdicts
from tests.polling import until
from tests.test_capsule_signer import signer_keys, stream_items

pytestmark = [pytest.mark.chaos]

ACTIONS = env_int("PGW_CHAOS_GATE_ACTIONS", 500)  # the issue: "during 500 gated actions"
IN_FLIGHT = 8  # actions the executor holds when the gateway is killed (of the 32 sent at a time)
AGENT = "chaos"


async def test_gateway_kill9_during_gated_actions(tmp_path: Path, nats_server: EmbeddedServer, nc: Any,
                                                 make_config: Any) -> None:
    """kill -9 of the gateway mid-burst of gated actions: each permitted action ran exactly once at the executor
    and has exactly one STATE_TRANSITIONED, one executed verdict and one signed, verifying, gate_executed executed
    capsule; nothing unpermitted ran."""
    issuer = Issuer(tmp_path / "issuer")
    pdir = policy_dir(tmp_path, 'permit(principal, action == Action::"WriteNote", resource);\n')
    extra = "\n".join([
        "[kernel]", f'policy_dir = "{pdir}"', "report_deadline_s = 0.0",
        "[kernel.issuers]", f'"{issuer.kid}" = "{issuer.pem_path}"',
        "[kernel.executors.notes]", 'actions = ["WriteNote"]', "timeout_s = 2.0", "follow_up_s = 600.0",
    ])
    gw = ServiceProc("gateway", nats_server.client_url, tmp_path / "gw", chaos_config(tmp_path / "c.toml", extra=extra))
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent=AGENT, so_id=so, principal="alice", actions=["WriteNote"])
    runs: collections.Counter[str] = collections.Counter()
    bodies = []
    for i in range(ACTIONS):
        rec = idp(so_id=so, mandate_id=jti, step=1, action="WriteNote", session=f"s-{i}")
        bodies.append(msgspec.json.encode({"mandate": token, "action": "WriteNote", "idp": rec,
                                           "arguments": {"n": i}}))
    ids = [msgspec.json.decode(b)["idp"]["idp_id"] for b in bodies]
    answered: dict[int, Any] = {}
    errors: list[str] = []
    killed = asyncio.Event()

    async with Executor(nc, "notes") as ex:

        @ex.action("WriteNote")
        async def write(args: dict[str, Any], req: Any) -> Any:
            runs[req.idempotency_key] += 1
            if sum(runs.values()) > ACTIONS // 3:
                await killed.wait()  # in flight at the kill: the gateway dies waiting for these answers
            return {"n": args["n"]}

        async def send(i: int, sem: asyncio.Semaphore) -> None:
            async with sem:
                try:
                    msg = await nc.request(f"pgw.agent.{AGENT}.act", bodies[i], timeout=10)
                except Exception as e:  # noqa: BLE001 - no gateway, or killed mid-request: sent again below
                    errors.append(repr(e))
                    return
                answered[i] = act_result_decoder.decode(msg.data)

        async def serving() -> bool:
            """The kernel answers on act (the services API registration comes before the kernel's parts)."""
            try:
                await nc.request(f"pgw.agent.{AGENT}.act", b"{}", timeout=2)
            except Exception:  # noqa: BLE001 - not yet
                return False
            return True

        try:
            await gw.start()
            await wait_services(nc, "pgw-gateway", 1, [gw])
            await until(serving, timeout=60, interval=0.1, what="the kernel serving agent.*.act")
            sem = asyncio.Semaphore(32)
            burst = asyncio.gather(*(send(i, sem) for i in range(ACTIONS)))

            async def midway() -> bool:  # a third run, and the next IN_FLIGHT waiting at the executor
                return sum(runs.values()) >= ACTIONS // 3 + IN_FLIGHT

            await until(midway, timeout=120, interval=0.01,
                        what=lambda: f"a third of the actions run (answers: {list(answered.values())[:3]}; errors {errors[:3]}; "
                                     f"gateway log: {gw.log_tail()[-1500:]})")
            gw.kill9()
            await gw.wait_dead()
            killed.set()
            killed_at = sum(runs.values())
            await burst
            await gw.start()
            await wait_services(nc, "pgw-gateway", 1, [gw])
            await until(serving, timeout=60, interval=0.1, what="the kernel serving agent.*.act again")
            # An agent without an answer sends its action again (a committed one is IDP_DUPLICATE: the
            # kernel's sweep finishes it).
            await asyncio.gather(*(send(i, sem) for i in range(ACTIONS) if i not in answered))
            js = nc.jetstream()

            async def permitted() -> set[str]:
                return {ev.body["idp_id"] for _s, ev in await read_log(js, "CEDAR_PERMIT_RECORDED")}

            async def settled() -> bool:
                done = {ev.body["idp_id"] for _s, ev in await read_log(js, "STATE_TRANSITIONED")}
                return (await permitted()) <= done

            await until(settled, timeout=180, interval=0.5, what="every permitted action recorded")
            perm = await permitted()
            sts = collections.Counter(ev.body["idp_id"] for _s, ev in await read_log(js, "STATE_TRANSITIONED"))
            executed = collections.Counter(v.idp_id for v in await read_verdicts(js, "executed"))
            keys = {idempotency_key(so, i): i for i in ids}
            assert set(runs) <= set(keys), "the executor ran an action nobody submitted"
            ran = {keys[k] for k in runs}
            assert ran == perm, f"ran but not permitted: {ran - perm}; permitted, never ran: {perm - ran}"
            assert all(runs[idempotency_key(so, i)] == 1 for i in perm), \
                {i: runs[idempotency_key(so, i)] for i in perm if runs[idempotency_key(so, i)] != 1}
            assert all(sts[i] == 1 for i in perm) and set(sts) == perm
            assert all(executed[i] == 1 for i in perm) and set(executed) == perm
            # One signed executed capsule per permitted action: the signer signs the whole verdict stream.
            config = make_config()

            def executed_capsules(items: list[Any]) -> list[tuple[str, bytes, dict[str, Any]]]:
                out = []
                for src, data, _h in items:
                    p = payload_of(data) or {}
                    if "statement_type" not in p and p.get("action_type") != "fyi" and p.get("action_id") in perm \
                            and p.get("disposition", {}).get("verdict_class", "executed") == "executed":
                        out.append((src, data, p))
                return out

            async def all_signed() -> list[tuple[str, bytes, dict[str, Any]]] | None:
                caps = executed_capsules(await stream_items(js, "PGW_REGISTRATION"))
                return caps if {p["action_id"] for *_, p in caps} >= perm else None

            async with Signer(config, nc):
                await until(all_signed, timeout=120, interval=0.5, what="a signed capsule for every permitted action")
                await wait_drained(js, "PGW_VERDICTS", "pgw-signer", timeout=60)
            items = await stream_items(js, "PGW_REGISTRATION")
            caps = executed_capsules(items)
            per_action = collections.Counter(p["action_id"] for *_, p in caps)
            assert set(per_action) == perm and all(n == 1 for n in per_action.values()), \
                {a: n for a, n in per_action.items() if n != 1}
            # Verified with the whole stream as the store (a capsule may chain to an earlier one).
            store = Store(p for p in (payload_of(d) for _s, d, _h in items) if p is not None)
            verified = {r.source: r for r in verify_many([(src, data) for src, data, _p in caps], keys=signer_keys(config),
                                                          store=store)}
            bad = [(src, verified[src].findings) for src, _d, _p in caps
                   if not verified[src].ok or verified[src].effect_grade != "gate_executed"]
            assert not bad, bad[:3]
            # Every answered DONE is what the log recorded (the digest of the response the agent got).
            st = {ev.body["idp_id"]: ev.body for _s, ev in await read_log(js, "STATE_TRANSITIONED")}
            for r in answered.values():
                if isinstance(r, ActDone):
                    assert st[r.idp_id]["effect"]["response_digest"] == r.response_digest
            print(f"gate chaos: {ACTIONS} actions, {len(perm)} permitted, run once and signed once each, "
                  f"{killed_at} run before the kill -9, {sum(isinstance(r, ActDone) for r in answered.values())} "
                  "answered DONE")
        finally:
            await gw.stop()
