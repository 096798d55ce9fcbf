"""Looking at capsules and rotating the signer's key, through the command line (`pgw` as a subprocess)
against a real nats-server and a real signer (docs/capsules.md "Looking at a capsule", "Keys")."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from consumers.cose import decode_sign1
from consumers.registrar import DLQ_STREAM, Registrar
from consumers.signer import Signer
from consumers.verifier import payload_of
from pgwcore.config import Config
from pgwcore.publish import Publisher
from tests.polling import until
from tests.scitt_ts import ScittTS
from tests.stored import arrived, stored_msgs
from tests.test_capsule_model import design_rows, verdict

PGW = str(Path(sys.executable).parent / "pgw")
REPO = Path(__file__).resolve().parent.parent


async def pgw(config: Config, *args: str, toml: Path | None = None) -> tuple[int, str, str]:
    """`pgw --server URL --data-dir D ARGS` as a subprocess: (exit status, stdout, stderr)."""
    head = ["--server", config.nats_url, "--data-dir", config.data_dir, "--log-format", "json"]
    if toml is not None:
        head += ["--config", str(toml)]
    proc = await asyncio.create_subprocess_exec(PGW, *head, *args, cwd=REPO, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def signed(nc: Any, config: Config, verdicts: list[Any]) -> list[dict[str, Any]]:
    """Sign ``verdicts`` with a real signer; the payloads stored in PGW_REGISTRATION, in order."""
    pub = Publisher(nc.jetstream(), config.subjects)
    for v in verdicts:
        await pub.verdict(v)
    async with Signer(config, nc) as signer:
        await signer.wait_signed(len(verdicts), timeout=30)
    return [payload_of(m.data) for m in await stored_msgs(nc.jetstream(), "PGW_REGISTRATION")]


async def test_verify_of_an_empty_stream_says_so_and_succeeds(nc: Any, make_config: Any) -> None:
    """`pgw verify --stream PGW_CAPSULES` with nothing registered exits 0 with '0 capsules: nothing to verify'."""
    rc, out, err = await pgw(make_config(), "verify", "--stream", "PGW_CAPSULES")
    assert rc == 0, err
    assert "0 capsules: nothing to verify" in out


async def test_show_export_and_verify_one_capsule(nc: Any, make_config: Any, tmp_path: Path) -> None:
    """`pgw capsules list` names the capsules; `show` (by an id's first digits) decodes one: what was decided, by
    whom, the assurance, not yet registered; `export` writes the statement `pgw verify FILE` then passes."""
    config = make_config()
    payloads = await signed(nc, config, design_rows("s"))
    resolved = next(p for p in payloads if p["disposition"].get("verdict_class") == "resolved")
    cid = resolved["capsule_id"]

    rc, out, err = await pgw(config, "capsules", "list")
    assert rc == 0, err
    assert cid[:16] in out and f"{len(payloads)} capsule(s)" in out

    rc, out, err = await pgw(config, "capsules", "show", cid[:10])
    assert rc == 0, err
    facts = dict(line.split(None, 1) for line in out.splitlines() if line and not line.startswith(" "))
    assert facts["capsule"] == cid
    assert facts["decided"].startswith("resolved: accept")
    assert facts["by"].startswith("the principal (a person decided)")
    assert "attestation self_attested" in facts["assurance"] and "ledger chained" in facts["assurance"]
    assert facts["verified"].startswith("OK")
    assert facts["registered"].startswith("not yet: waiting in PGW_REGISTRATION#")
    assert facts["chain"].startswith("supersedes ")

    rc, out, err = await pgw(config, "capsules", "show", cid, "--json")
    shown = json.loads(out)
    assert (shown["capsule_id"], shown["state"], shown["verified"]["ok"]) == (cid, "waiting", True)

    file = tmp_path / "capsule.cose"
    rc, out, err = await pgw(config, "capsules", "export", cid, str(file))
    assert rc == 0, err
    assert payload_of(file.read_bytes())["capsule_id"] == cid and f"pgw verify {file}" in out
    rc, out, err = await pgw(config, "verify", str(file))
    assert rc == 0, out + err
    assert out.startswith("OK  ") and cid in out


async def test_show_says_registered_with_its_receipt_or_refused_with_the_reason(
        nc: Any, make_config: Any, tmp_path: Path) -> None:
    """A capsule a Transparency Service registered: `show` says yes, with the assurance anchored (its receipt verifies
    under the pinned TS key), and `export` keeps the receipt, which `pgw verify FILE` checks. One the TS refused for
    good (dead-lettered): `show` says no, with the TS's reason."""
    js = nc.jetstream()
    async with ScittTS(mode="see_other") as ts:
        config = make_config(registrar={"ts_url": ts.url, "ts_public_key": ts.public_hex, "backoff_base_s": 0.05})
        (first,) = await signed(nc, config, [verdict("reg1", "denied")])
        async with Registrar(config, nc):
            await arrived(js, "PGW_CAPSULES", timeout=30)
    toml = tmp_path / "pgw.toml"
    toml.write_text(f'[registrar]\nts_public_key = "{ts.public_hex}"\n')
    rc, out, err = await pgw(config, "capsules", "show", first["capsule_id"], toml=toml)
    assert rc == 0, err
    facts = dict(line.split(None, 1) for line in out.splitlines() if line and not line.startswith(" "))
    assert facts["registered"].startswith("yes: PGW_CAPSULES#1, a Transparent Statement")
    assert "attestation anchored" in facts["assurance"]
    file = tmp_path / "registered.cose"
    rc, out, err = await pgw(config, "capsules", "export", first["capsule_id"][:12], str(file), toml=toml)
    assert rc == 0 and len(decode_sign1(file.read_bytes()).receipts()) == 1, err
    rc, out, err = await pgw(config, "verify", str(file), toml=toml)
    assert rc == 0 and "attestation=anchored" in out, out + err

    async with ScittTS(reject=True) as refusing:
        config = make_config(registrar={"ts_url": refusing.url, "ts_public_key": refusing.public_hex,
                                        "max_failures": 1, "backoff_base_s": 0.05})
        payloads = await signed(nc, config, [verdict("reg2", "blocked")])
        async with Registrar(config, nc):
            await arrived(js, DLQ_STREAM, timeout=30)
    refused = next(p for p in payloads if p["capsule_id"] != first["capsule_id"])
    rc, out, err = await pgw(config, "capsules", "show", refused["capsule_id"])
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("registered"))
    assert f"no: refused for good ({DLQ_STREAM}#1)" in line and "400" in line


async def test_an_unknown_or_ambiguous_id_is_one_line(nc: Any, make_config: Any) -> None:
    """No such capsule, a prefix too short, not hex: exit non-zero and one line saying which."""
    config = make_config()
    await signed(nc, config, [verdict("u1", "denied")])
    for wanted, says in (("abcdef0123", "no capsule abcdef0123"), ("ab", "no capsule id"), ("zzzzzzzz", "no capsule id")):
        rc, _out, err = await pgw(config, "capsules", "show", wanted)
        assert rc != 0 and says in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err


async def test_notes_on_unregistered_values_only_with_verbose(nc: Any, make_config: Any) -> None:
    """The verifier's unregistered_value notes (the user's own action names) are counted, not printed, unless
    --verbose; --json keeps every finding."""
    config = make_config()
    await signed(nc, config, design_rows("v"))
    rc, quiet, err = await pgw(config, "verify", "--stream", "PGW_REGISTRATION")
    assert rc == 0, quiet + err
    assert "unregistered_value" not in quiet and "--verbose shows them" in quiet
    rc, loud, err = await pgw(config, "verify", "--verbose", "--stream", "PGW_REGISTRATION")
    assert rc == 0 and "unregistered_value" in loud
    rc, js, err = await pgw(config, "verify", "--json", "--stream", "PGW_REGISTRATION")
    assert "unregistered_value" in js


# -- the signer's key -------------------------------------------------------------------------


@pytest.fixture
async def running_signers(make_config: Any, tmp_path: Path) -> AsyncIterator[Any]:
    """Start `pgw signer` processes (``start(toml_text)``); each is stopped at the end."""
    procs: list[asyncio.subprocess.Process] = []
    config = make_config()

    async def start(toml_text: str = "") -> None:
        toml = tmp_path / f"signer{len(procs)}.toml"
        toml.write_text(toml_text)
        log = (tmp_path / f"signer{len(procs)}.log").open("ab")
        procs.append(await asyncio.create_subprocess_exec(
            PGW, "--server", config.nats_url, "--data-dir", config.data_dir, "--config", str(toml),
            "--log-format", "json", "signer", cwd=REPO, stdout=asyncio.subprocess.DEVNULL, stderr=log))

    try:
        yield config, start
    finally:
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(p.wait(), 20)
                except TimeoutError:
                    p.kill()
                    await p.wait()


async def signer_kids(nc: Any, n: int) -> dict[str, str]:
    """{instance id: the kid it signs with}, once ``n`` signers answer the services API's STATS."""
    async def ask() -> dict[str, str] | None:
        inbox = nc.new_inbox()
        got: dict[str, str] = {}
        sub = await nc.subscribe(inbox)
        await nc.publish("$SRV.STATS.pgw-signer", b"", reply=inbox)
        try:
            while True:
                msg = await sub.next_msg(timeout=0.5)
                body = json.loads(msg.data)
                got[body["id"]] = next(e["data"]["signing_kid"] for e in body["endpoints"] if e.get("data"))
        except Exception:  # noqa: BLE001 - no more answers within the window
            pass
        finally:
            await sub.unsubscribe()
        return got if len(got) >= n else None

    return await until(ask, timeout=30, what=f"{n} signer(s) answering")


async def test_rotating_the_signer_key_reaches_the_running_signer(nc: Any, running_signers: Any) -> None:
    """`pgw keys --rotate signer` with a `pgw signer` running: it takes the new key without a restart, the command
    says so naming it, and the next capsule is signed with the new kid."""
    config, start = running_signers
    await start()
    (instance, old), = (await signer_kids(nc, 1)).items()
    rc, out, err = await pgw(config, "keys", "--rotate", "signer")
    assert rc == 0, out + err
    new = out.split("new active kid ", 1)[1].split()[0]
    assert new != old and f"signer {instance}: signs with {new}" in out
    await Publisher(nc.jetstream(), config.subjects).verdict(verdict("after-rotation", "denied"))

    async def statement() -> bytes | None:
        msgs = await stored_msgs(nc.jetstream(), "PGW_REGISTRATION")
        return msgs[-1].data if msgs else None

    kid = decode_sign1(await until(statement, timeout=30, what="the capsule")).protected.get(4)
    assert (kid.decode() if isinstance(kid, bytes) else kid) == new


async def test_a_signer_that_cannot_see_the_new_key_is_named(nc: Any, running_signers: Any, tmp_path: Path) -> None:
    """A running signer that reads another key folder keeps its key: `pgw keys --rotate signer` exits 1 and names
    it, its kid and what to do, instead of saying the new kid as if every signer used it."""
    config, start = running_signers
    await start(f'[keys]\ndir = "{tmp_path / "elsewhere"}"\n')
    (instance, old), = (await signer_kids(nc, 1)).items()
    rc, out, err = await pgw(config, "keys", "--rotate", "signer")
    assert rc == 1, out + err
    assert instance in err and old in err and "restart" in err


async def test_rotating_the_kernel_key_says_the_gateways_must_restart(make_config: Any) -> None:
    """The gateway's kernel reads its key once, at start: `pgw keys --rotate kernel` says running gateways keep the
    retired key until they restart, rather than only naming the new active kid."""
    rc, out, err = await pgw(make_config(), "keys", "--rotate", "kernel", "--role", "kernel")
    assert rc == 0, err
    new = out.split("new active kid ", 1)[1].split()[0]
    assert f"until they restart (pgw up, pgw gateway); each started from now on signs with {new}" in out
