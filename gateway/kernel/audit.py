"""Audit Principal queries: the Session Audit Record and one IDP's record (spec 003 §4.2, §9).

``{prefix}.kernel.audit.{auditor}`` (request-reply, queue group of the
gateways) takes an ``AuditRequest``: ``{"kind": "session", "id": SESSION,
"agent": AGENT}`` or ``{"kind": "idp", "id": IDP_ID}``. The auditor is the
subject's last token; with server-enforced permissions only that audit
principal may publish there (``pgw creds``, role ``audit``), so the name is
not the requester's say-so. Agents and principals cannot publish there.

The answer is built from the event log itself (a walk of ``PGW_EVENTLOG``):
every event of the session (or naming the IDP) as signed, with its stream
sequence and digest, so the auditor can check each signature with the
kernel's public key and compare digests with ``pgw log verify``'s chain and
its anchored head.

``audit_accessible: false`` (spec 003 §4.2): such an IDP "is not returned in
response to Audit Principal queries", and "such restrictions MUST be
documented in the Session Audit Record". So:

* in a Session Audit Record, every event about a restricted IDP keeps only
  its structural members (ids, step, sequence numbers, timestamps) and its
  digest; the record's ``restrictions`` lists each restricted IDP, the events
  withheld in part and the members withheld;
* ``kind: idp`` for a restricted IDP is refused (``AUDIT_RESTRICTED``).

Every query, answered or refused, is itself logged first as ``AUDIT_QUERY``
(auditor, what was asked, how many events were returned, which IDPs were
withheld); the record names that event's sequence.
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec

from gateway.kernel.checkpoint import read_anchor_file
from gateway.kernel.eventlog import STREAM, walk_log
from pgwcore.logs import get_logger
from subjects.kernelops import AuditReply, audit_request_decoder
from subjects.util import now_rfc3339, stable_id
from subjects.wire import Refusal

log = get_logger("pgw.kernel.audit")

EVENT = "AUDIT_QUERY"
RECORD_TYPE = "pgw.session_audit_record/1"
RESTRICTION_RULE = "audit_accessible: false (spec 003 §4.2): not returned to Audit Principals"
# What a restricted IDP's events still show: where they are, never what was declared.
_STRUCTURAL = ("idp_id", "so_id", "session_id", "agent", "step_sequence", "idp_submitted_seq",
               "state_transition_seq", "kernel_receipt_ts", "audit_accessible", "session_state")


class AuditError(Exception):
    def __init__(self, code: str, reason: str) -> None:
        self.code, self.reason = code, reason
        super().__init__(f"{code}: {reason}")


def _idp_of(body: dict[str, Any]) -> str | None:
    """The IDP an event names, lower-cased: the kernel keys IDPs case-insensitively
    (``gateway.kernel.state.idp_key``), so a report naming it in capitals is the same IDP here."""
    if isinstance(body.get("idp_id"), str):
        return body["idp_id"].lower()
    rec = body.get("record")
    i = rec.get("idp_id") if isinstance(rec, dict) else None
    return i.lower() if isinstance(i, str) else None


def _restricts(entry: dict[str, Any]) -> bool:
    """Any event carrying an IDP (or part of one) with ``audit_accessible: false`` restricts
    every event of that IDP: not only IDP_SUBMITTED and IDP_RECEIVED, also e.g.
    IDP_MISSION_REF_MISMATCH_REJECTED, the only event of an IDP denied at §5.2(g)."""
    body = entry["event"]["body"]
    idp = body.get("idp")
    return body.get("audit_accessible") is False or (isinstance(idp, dict) and idp.get("audit_accessible") is False)


def _redact(entry: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    body = entry["event"]["body"]
    kept = {k: body[k] for k in _STRUCTURAL if k in body}
    withheld = sorted(k for k in body if k not in kept)
    event = {k: v for k, v in entry["event"].items() if k not in ("body", "sig")}
    return {**entry, "event": {**event, "body": kept}, "restricted": True}, withheld


class AuditService:
    """The kernel's audit endpoint (a kernel part)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.prefix = kernel.subjects.prefix
        self._sub: Any = None
        self.page_bytes = 4096  # set from the server's max payload at start

    async def start(self, queue: str) -> None:
        self.page_bytes = max(self.kernel.nc.max_payload // 2, 4096)
        self._sub = await self.kernel.gw.rnc.subscribe(f"{self.prefix}.kernel.audit.*", queue=queue, cb=self._on_request)

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def _on_request(self, msg: Any) -> None:
        if not self.kernel.responder.admits(msg):
            return
        auditor = msg.subject.rsplit(".", 1)[-1]
        try:
            reply = await self.query(auditor, msg.data)
        except AuditError as e:
            reply = AuditReply(ok=False, refusal=Refusal(code=e.code, reason=e.reason))
        except Exception:
            log.exception("audit query failed", auditor=auditor)
            reply = AuditReply(ok=False, refusal=Refusal(code="KERNEL_UNAVAILABLE", reason="the audit query could not be answered"))
        await self.kernel.responder.answer(msg, msgspec.json.encode(reply))

    async def _events(self, match: Any) -> list[dict[str, Any]]:
        # The log's one walk (eventlog.walk_log): a record the kernel did not write (it does not
        # decode, is not signed by a kernel key or does not chain) is reported, never shown as an event.
        out = []
        el = self.kernel.eventlog
        async with contextlib.aclosing(walk_log(el.js, el.subjects, el.keys, stream=el.stream)) as walk:
            async for rec in walk:
                if rec.problem is not None or rec.event is None:
                    el.report_foreign(rec, "an audit query")
                    continue
                ev = rec.event
                if ev.event_type == EVENT or not match(ev):
                    continue
                out.append({"seq": rec.seq, "digest": ev.digest(), "event": msgspec.to_builtins(ev)})
        return out

    async def _log_query(self, auditor: str, body: dict[str, Any]) -> int:
        # What was asked is kept for good (the event log is never deleted): a secret an auditor typed into a
        # query's id is redacted there (spec 002 SR-1), the rest kept as asked. No IDP or session holding a
        # secret was ever committed (gateway/kernel/validation.py), so such a query matched nothing anyway.
        red = (await self.kernel.gw.stage_state.get()).redactor
        full = red.graph({"auditor": auditor, "asked_at": now_rfc3339(), **body}, show=str)  # each leaf as asked, its secrets aside
        ev = await self.kernel.eventlog.append(EVENT, full, msg_id=stable_id(EVENT, auditor, msgspec.json.encode(full).decode()))
        return ev.seq

    async def query(self, auditor: str, data: bytes) -> AuditReply:
        try:
            req = audit_request_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise AuditError("REQUEST_MALFORMED", f"an audit request is {{kind, id, agent?}}: {e}") from None
        if req.kind == "session":
            if req.agent is None:
                raise AuditError("REQUEST_MALFORMED", "a session query names the agent (sessions are per agent)")
            return await self._session(auditor, req.agent, req.id, req.from_seq)
        return await self._idp(auditor, req.id, req.from_seq)

    def _page(self, events: list[dict[str, Any]], from_seq: int) -> tuple[list[dict[str, Any]], int | None]:
        """The events from ``from_seq`` that fit half the server's max payload; the next seq if cut."""
        budget = self.page_bytes
        out: list[dict[str, Any]] = []
        for e in events:
            if e["seq"] < from_seq:
                continue
            size = len(msgspec.json.encode(e))
            if out and size > budget:
                return out, e["seq"]
            budget -= size
            out.append(e)
        return out, None

    async def _session(self, auditor: str, agent: str, session_id: str, from_seq: int = 0) -> AuditReply:
        idps: set[str] = set()

        def match(ev: Any) -> bool:
            b = ev.body
            if b.get("session_id") == session_id and b.get("agent") == agent:
                if (i := _idp_of(b)) is not None:
                    idps.add(i)
                return True
            return b.get("agent") == agent and _idp_of(b) in idps  # e.g. TRANSITION_REFUSED

        events = await self._events(match)
        restricted = {i for e in events if _restricts(e) and (i := _idp_of(e["event"]["body"])) is not None}
        shown: list[dict[str, Any]] = []
        restrictions: dict[str, dict[str, Any]] = {}
        for e in events:
            i = _idp_of(e["event"]["body"])
            if i in restricted:
                red, withheld = _redact(e)
                shown.append(red)
                r = restrictions.setdefault(i, {"idp_id": i, "rule": RESTRICTION_RULE, "event_seqs": [], "withheld": set()})
                r["event_seqs"].append(e["seq"])
                r["withheld"].update(withheld)
            else:
                shown.append(e)
        restr = [{**r, "withheld": sorted(r["withheld"])} for r in restrictions.values()]
        shown, next_seq = self._page(shown, from_seq)
        seq = await self._log_query(auditor, {"kind": "session", "id": session_id, "agent": agent,
                                              "events_returned": len(shown), "restricted_idp_ids": sorted(restricted)})
        if not events:
            raise AuditError("NOT_FOUND", f"no event of session {session_id!r} of agent {agent!r} in the log")
        sess, _rev = await self.kernel.state.session(agent, session_id)
        record = {
            "record_type": RECORD_TYPE,
            "session_id": session_id,
            "agent": agent,
            "generated_at": now_rfc3339(),
            "kernel_kid": self.kernel.key.kid,
            "session_state": msgspec.to_builtins(sess),
            "idps": self._idps(shown, restricted),
            "verifications": [e["event"]["body"]["record"] for e in shown
                              if e["event"]["event_type"] in ("IDP_COMMITMENT_VERIFIED", "IDP_COMMITMENT_GAP")
                              and not e.get("restricted")],
            "alerts": [{"seq": e["seq"], **e["event"]["body"]["alert"]} for e in shown if "alert" in e["event"]["body"]],
            "events": shown,
            "next_from_seq": next_seq,
            "restrictions": restr,
            "log": await self._log_state(),
            "audit_query_seq": seq,
        }
        return AuditReply(ok=True, record=record)

    def _idps(self, shown: list[dict[str, Any]], restricted: set[str]) -> list[dict[str, Any]]:
        out = []
        for e in shown:
            ev = e["event"]
            if ev["event_type"] not in ("IDP_SUBMITTED", "IDP_RECEIVED"):
                continue
            b = ev["body"]
            row = {"idp_id": b["idp_id"], "event_type": ev["event_type"], "seq": e["seq"],
                   "step_sequence": b.get("step_sequence"), "audit_accessible": b.get("audit_accessible", True)}
            if b["idp_id"] not in restricted:
                row.update({"requested_action": b.get("requested_action"), "profile": b.get("profile"),
                            "mandate_id": b.get("mandate_id")})
            out.append(row)
        return out

    async def _log_state(self) -> dict[str, Any]:
        seq, digest = await self.kernel.eventlog.head()
        anchor = read_anchor_file(self.kernel.config.data_path)
        return {"stream": STREAM, "head_seq": seq, "head_digest": digest,
                "anchored_seq": anchor.seq if anchor else None, "anchored_at": anchor.ts if anchor else None}

    async def _idp(self, auditor: str, idp_id: str, from_seq: int = 0) -> AuditReply:
        want = idp_id.lower()  # as the kernel matches it (_idp_of)
        events = await self._events(lambda ev: _idp_of(ev.body) == want)
        restricted = any(_restricts(e) for e in events)
        seq = await self._log_query(auditor, {"kind": "idp", "id": idp_id, "events_returned": 0 if restricted else len(events),
                                              "restricted_idp_ids": [idp_id] if restricted else []})
        if not events:
            raise AuditError("NOT_FOUND", f"no event names IDP {idp_id!r}")
        if restricted:
            raise AuditError(
                "AUDIT_RESTRICTED",
                f"IDP {idp_id} was submitted with audit_accessible: false: it is available only to the kernel's "
                f"internal audit and Verified External Auditors (spec 003 §4.2); this query is logged at {seq}",
            )
        page, next_seq = self._page(events, from_seq)
        return AuditReply(ok=True, record={"record_type": "pgw.idp_audit_record/1", "idp_id": idp_id,
                                           "generated_at": now_rfc3339(), "kernel_kid": self.kernel.key.kid,
                                           "events": page, "next_from_seq": next_seq,
                                           "log": await self._log_state(), "audit_query_seq": seq})
