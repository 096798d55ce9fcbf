"""Records in the event log that are not the kernel's own (spec 003 §8.2): reported, never trusted, never an outage.

The realistic way such a record lands is an insider or a bug with publish rights on ``pgw.log.>``: here it is
published on an unsecured test server with a plain connection, as the gateway's own credentials could.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from structlog.testing import capture_logs

from gateway.kernel.eventlog import FOREIGN_RECORDS, EventLog
from gateway.kernel.service import KernelService
from pgwcore.keys import SigningKey, kid_of, public_keys
from subjects.idp import Permit
from tests.kernel_support import Issuer, idp, kernel_config, policy_dir, request, running_gateway

AGENT = "bot"
PGW = str(Path(sys.executable).parent / "pgw")


async def _pgw(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(PGW, "--log-format", "json", *args, env=dict(os.environ),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


def _alarms(logs: list[Any]) -> list[Any]:
    return [e for e in logs if e.get("alert_trigger") == "EVENTLOG_FOREIGN_RECORD" and e["log_level"] == "critical"]


async def test_foreign_records_are_reported_verified_and_quarantined(make_config: Any, nc: Any, nats_server: Any,
                                                                      tmp_path: Path) -> None:
    """A non-event published on pgw.log.MANDATE_REVOKED, a MANDATE_REVOKED signed by a key no kernel holds, and a
    non-event left at the head while the gateway is down do not stop the kernel: it goes on answering and anchoring,
    also after a restart, never takes the forged revocation, and logs each record at CRITICAL with its sequence.
    `pgw log verify` names each on a line of its own and exits 1 (no traceback); `pgw log quarantine` refuses a kernel
    event and records each foreign one; verify then exits 0 and lists them, and a restart raises no alarm."""
    issuer = Issuer(tmp_path / "issuer")
    cfg = kernel_config(make_config, issuer, policy_dir(tmp_path), checkpoint_interval_s=0)
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent=AGENT, so_id=so)
    js = nc.jetstream()
    url, data_dir = nats_server.client_url, str(cfg.data_path)
    steps = iter(range(1, 100))
    permits: list[str] = []

    async def permitted() -> bool:
        body = {"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=next(steps), action="CloseBooking")}
        r = await request(nc, AGENT, body)
        assert isinstance(r, Permit), r
        permits.append(r.idp_id)
        return True

    counted = FOREIGN_RECORDS._value.get()
    with capture_logs() as logs:
        async with running_gateway(cfg, nc) as gw:
            kernel = next(p for p in gw.parts if isinstance(p, KernelService))
            assert await permitted()
            junk = await js.publish("pgw.log.MANDATE_REVOKED", json.dumps({"jti": jti}).encode())
            assert await permitted()
            rogue_key = Ed25519PrivateKey.generate()
            rogue = EventLog(nc, cfg.subjects, SigningKey("kernel", kid_of(rogue_key.public_key()), rogue_key),
                             keys={k.kid: k.public for k in public_keys(cfg.data_path, "kernel")})
            forged = await rogue.append("MANDATE_REVOKED", {"jti": jti, "revoked_by": "rogue", "reason": None,
                                                            "token": ""}, msg_id="forged")
            assert await permitted()  # a revocation the kernel did not sign revokes nothing
            anchored = await kernel.checkpoints.anchor()
            assert anchored is not None and anchored.seq > forged.seq
        head = await js.publish("pgw.log.IDP_SUBMITTED", b"not json at all")  # the last record at the restart
        async with running_gateway(cfg, nc) as gw:
            kernel = next(p for p in gw.parts if isinstance(p, KernelService))
            assert jti not in kernel.mandates.live_revoked
            assert await permitted()
            assert (await kernel.checkpoints.anchor()) is not None
            # An audit query walks the same log: the session record holds the kernel's events, not the foreign ones.
            reply = await kernel.audit.query("carol", json.dumps({"kind": "idp", "id": permits[0]}).encode())
            assert reply.ok, reply
            seqs = {e["seq"] for e in json.loads(msgspec.json.encode(reply))["record"]["events"]}
            assert seqs and not seqs & {junk.seq, forged.seq, head.seq}, seqs
    alarms = _alarms(logs)
    assert {e["seq"] for e in alarms} == {junk.seq, forged.seq, head.seq}, alarms
    assert FOREIGN_RECORDS._value.get() - counted == len(alarms)

    rc, out, err = await _pgw("--server", url, "--data-dir", data_dir, "log", "verify")
    assert rc == 1 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("pgw log verify: seq ")]
    assert len(lines) == 3, err
    assert lines[0].startswith(f"pgw log verify: seq {junk.seq} on pgw.log.MANDATE_REVOKED: undecodable"), lines
    assert lines[1] == f"pgw log verify: seq {forged.seq} on pgw.log.MANDATE_REVOKED: signed with unknown kid {rogue.key.kid!r}"
    assert lines[2].startswith(f"pgw log verify: seq {head.seq} on pgw.log.IDP_SUBMITTED: undecodable"), lines
    result = json.loads(out)
    assert not result["ok"] and result["first_break"]["seq"] == junk.seq
    assert [p["seq"] for p in result["problems"]] == [junk.seq, forged.seq, head.seq]

    rc, _out, err = await _pgw("--server", url, "--data-dir", data_dir, "log", "quarantine", "1", "--reason", "test")
    assert rc != 0 and "is the kernel's own" in err and "Traceback" not in err, err
    for seq in (junk.seq, forged.seq, head.seq):
        rc, out, err = await _pgw("--server", url, "--data-dir", data_dir, "log", "quarantine", str(seq),
                                  "--reason", "planted by the test")
        assert rc == 0, err
        assert json.loads(out)["quarantined_by"] > seq

    rc, out, err = await _pgw("--server", url, "--data-dir", data_dir, "log", "verify")
    assert rc == 0, (out, err)
    result = json.loads(out)
    assert result["ok"] and result["problems"] == []
    assert [(q["seq"], q["reason"]) for q in result["quarantined"]] == [
        (junk.seq, "planted by the test"), (forged.seq, "planted by the test"), (head.seq, "planted by the test")]

    with capture_logs() as logs:
        async with running_gateway(cfg, nc):
            assert await permitted()
    assert _alarms(logs) == []
    # The revocations' walk still meets the two on pgw.log.MANDATE_REVOKED, and knows them as quarantined.
    assert {e["seq"] for e in logs if e.get("quarantined_by")} == {junk.seq, forged.seq}
