"""A principal's free text is kept only until the agent has had it (spec 000 §13).

An answer-space response "SHALL NOT persist beyond what the audit-signal
significance predicate requires": the verdict (and so the capsule) keeps only a
digest; the full text reaches the agent, then after ``gateway.answer_text_keep_s``
it is gone from every stream and bucket on the server.
"""

from __future__ import annotations

import hashlib

from pgwcore.keys import load_or_create_digest_key
from subjects.client import Agent, Surface
from subjects.wire import ClarificationAnswers, DialogueVeto, FreeTextAnswer, ResolutionOutcome
from tests.moments import good_moment
from tests.pipeline_helpers import env, moment_env, running_gateway
from tests.polling import until

SECRET_ANSWER = "Send it to my sister Ingrid at the Oslo flat, not to Harbor"
SECRET_OBJECTION = "Harbor lost my passport copy last year, ask about them first"
SECRET_CLARIFICATION = "My new account number ends in 4471"


async def everything_stored(nc) -> bytes:
    """Every message (body and headers) of every stream, KV buckets included, as one blob."""
    js = nc.jetstream()
    blob = bytearray()
    for name in await js.streams_info():
        stream = name.config.name
        state = name.state
        for seq in range(state.first_seq or 1, (state.last_seq or 0) + 1):
            try:
                m = await js.get_msg(stream, seq)
            except Exception:  # noqa: BLE001 - deleted
                continue
            blob += (m.data or b"") + repr(m.headers).encode()
    return bytes(blob)


async def test_free_text_is_forgotten_everywhere_after_the_window(nats_server, tmp_path, nc):
    """The agent receives the free-text answer, the objection and the clarification answer in full; after
    answer_text_keep_s no stream or bucket holds any of them, the moment query returns the digest marker,
    and the verdicts hold the keyed digest only."""
    async with running_gateway(nats_server, str(tmp_path / "d"), gateway={"answer_text_keep_s": 1.0}):
        agent = Agent(nc, "planner")
        surface = Surface(nc, "alice")
        try:
            e1 = moment_env("alice", good_moment())
            await agent.send(e1)
            o1 = await agent.outcome_for(e1["envelopeId"], timeout=10)
            e2 = moment_env("alice", good_moment(stem="Which records should Dana receive?"))
            e2["payload"]["binding_moment"]["meta"] = {"decision_class": "other"}
            await agent.send(e2)
            o2 = await agent.outcome_for(e2["envelopeId"], timeout=10)
            e3 = env("clarification.request", {"questions": [{"id": "acct", "question": "Which account?"}]})
            await agent.send(e3, principal="alice")
            o3 = await agent.outcome_for(e3["envelopeId"], timeout=10)
            assert await surface.resolve(o1.moment_id, FreeTextAnswer(text=SECRET_ANSWER))
            assert await surface.resolve(o2.moment_id, DialogueVeto(objection=SECRET_OBJECTION))
            assert await surface.resolve(o3.moment_id, ClarificationAnswers(answers={"acct": SECRET_CLARIFICATION}))
            got = [await agent.resolution_for(o.moment_id, principal="alice", timeout=10) for o in (o1, o2, o3)]
            assert [g.resolution for g in got] == [FreeTextAnswer(text=SECRET_ANSWER), DialogueVeto(objection=SECRET_OBJECTION),
                                                    ClarificationAnswers(answers={"acct": SECRET_CLARIFICATION})]
            secrets = [s.encode() for s in (SECRET_ANSWER, SECRET_OBJECTION, SECRET_CLARIFICATION)]

            async def forgotten() -> bool:
                blob = await everything_stored(nc)
                return not any(s in blob for s in secrets)

            await until(forgotten, timeout=20, interval=0.2, what="every free text gone from every stream and bucket")
            later = await agent.moment_state(o1.moment_id, principal="alice")
            final = later.outcome
            assert isinstance(final, ResolutionOutcome)
            digests = load_or_create_digest_key(tmp_path / "d", create=False)
            digest = digests.digest(SECRET_ANSWER)
            assert final.resolution == FreeTextAnswer(text=f"[forgotten (spec 000 §13); {digest}]")
            blob = await everything_stored(nc)
            assert digest.encode() in blob  # the verdict's keyed text_digest: what the audit needs
            # A dictionary of guesses does not reverse it: no plain sha256 of any text is kept.
            assert not any(hashlib.sha256(s).hexdigest().encode() in blob for s in secrets)
        finally:
            await agent.close()
            await surface.close()
