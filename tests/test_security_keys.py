"""Keys and credentials (DESIGN §7, issue 7 "Keys"): file modes, reuse, rotation, never logged."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import re
import stat
from pathlib import Path

import pytest
import structlog
from cryptography.hazmat.primitives import serialization

from gateway.security import CredentialsError, Party, embedded_auth, read_creds, rotate_creds
from pgwcli.main import build_parser, config_from_args
from pgwcore import keys
from pgwcore.config import load_config
from pgwcore.connect import connect
from pgwcore.identity import creds_connect_options, new_seed, public_of
from pgwcore.server import EmbeddedServer

pytestmark = pytest.mark.security
# A user seed is one 58-character token "SU..."; a public user key is 56 ("U..."),
# so a public key that merely holds "SU" near its start is not taken for a seed.
SEED_RE = re.compile(r"(?<![A-Z2-7])SU[A-Z2-7]{56}(?![A-Z2-7])")


def _config(tmp: Path, **kw: object):
    return load_config(None, data_dir=str(tmp / "data"), agents={"planner": {"principals": ["alice"]}}, **kw)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_credentials_are_private_and_reused(tmp_path: Path) -> None:
    """Every party's credentials file is 0600 in a 0700 folder, and a second start reuses the same keys."""
    cfg = _config(tmp_path, security={"principals": ["bob"], "ops": ["oncall"]})
    first = embedded_auth(cfg)
    labels = {p.label for p in first.parties}
    assert {"agent:planner", "principal:alice", "principal:bob", "ops:oncall", "service:gateway"} <= labels
    assert _mode(first.party_creds_dir) == 0o700
    for party in first.parties:
        assert _mode(first.creds_for(party)) == 0o600
    second = embedded_auth(cfg)
    for party in first.parties:
        assert read_creds(first.creds_for(party)).public_nkey == read_creds(second.creds_for(party)).public_nkey
    assert not SEED_RE.search(first.server_block), "the block holds public keys only"


def test_group_readable_credentials_are_refused(tmp_path: Path) -> None:
    """A credentials file readable by group or others is refused, with the chmod to fix it."""
    auth = embedded_auth(_config(tmp_path))
    path = auth.creds_for(Party("agent", "planner"))
    os.chmod(path, 0o644)
    with pytest.raises(CredentialsError, match="chmod 600"):
        read_creds(path)


def test_connect_options_carry_the_party_inbox_prefix(tmp_path: Path) -> None:
    """The nkey-seed file gives nats-py the seed and the party's own inbox prefix; a JWT .creds file passes through."""
    auth = embedded_auth(_config(tmp_path))
    opts = creds_connect_options(auth.creds_for(Party("principal", "alice")))
    assert opts["inbox_prefix"] == "_INBOX_principal_alice"
    assert str(opts["nkeys_seed_str"]).startswith("SU")
    jwt_creds = tmp_path / "user.creds"
    jwt_creds.write_text("-----BEGIN NATS USER JWT-----\neyJ0eXAi.x.y\n------END NATS USER JWT------\n")
    assert creds_connect_options(jwt_creds) == {"user_credentials": str(jwt_creds)}


async def test_rotated_credentials_replace_the_old_key(tmp_path: Path) -> None:
    """After `pgw creds --rotate`, the server with the new block accepts the new key and refuses the old one."""
    cfg = _config(tmp_path)
    auth = embedded_auth(cfg)
    path = auth.creds_for(Party("agent", "planner"))
    old_copy = tmp_path / "old.creds"
    old_copy.write_bytes(path.read_bytes())
    os.chmod(old_copy, 0o600)
    rotate_creds(auth.party_creds_dir, Party("agent", "planner"))  # what `pgw creds --rotate` calls
    auth2 = embedded_auth(cfg)
    assert read_creds(path).public_nkey != read_creds(old_copy).public_nkey
    async with EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1,
                              authorization=auth2.server_block) as server:
        nc = await connect(server.client_url, creds=str(path), allow_reconnect=False, max_reconnect_attempts=0)
        assert nc.new_inbox().startswith("_INBOX_agent_planner.")
        await nc.close()
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await connect(server.client_url, creds=str(old_copy), allow_reconnect=False, max_reconnect_attempts=0)


def pgw(argv: list[str]) -> int:
    """Run a `pgw` subcommand in-process without `main()`'s global logging set-up."""
    args = build_parser().parse_args(argv)
    return asyncio.run(args.handler(args, config_from_args(args)))


def test_creds_command_never_prints_a_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pgw creds`, `--rotate`, `--show` and `--block` print public keys and paths, never a seed."""
    data = str(tmp_path / "data")
    assert pgw(["--data-dir", data, "creds"]) == 0
    gw_creds = tmp_path / "data" / "creds" / "service-gateway.creds"
    before = read_creds(gw_creds).public_nkey
    assert pgw(["--data-dir", data, "creds", "--rotate", "service:gateway"]) == 0
    assert read_creds(gw_creds).public_nkey != before
    assert read_creds(gw_creds).public_nkey in (tmp_path / "data" / "creds" / "authorization.conf").read_text()
    assert pgw(["--data-dir", data, "creds", "--show", "service:gateway"]) == 0
    assert pgw(["--data-dir", data, "creds", "--block"]) == 0
    out = capsys.readouterr()
    assert "service:gateway" in out.out and "authorization {" in out.out
    assert not SEED_RE.search(out.out + out.err)
    for creds in (tmp_path / "data" / "creds").glob("*.creds"):
        assert read_creds(creds).seed not in out.out + out.err


def test_seed_pattern_tells_seeds_from_public_keys() -> None:
    """The check above finds a real seed and never a public key, whatever letters the key happens to hold."""
    seed = new_seed()
    assert SEED_RE.search(f"oops: {seed}\n")
    assert not SEED_RE.search(public_of(seed))
    assert not SEED_RE.search("U" + "ASU" + "A" * 52), "a public key holding 'SU' is not a seed"


def test_signing_keys_are_0600_and_rotation_keeps_old_keys_verifiable(tmp_path: Path) -> None:
    """Kernel/signer keys are created 0600 in a 0700 folder; after rotation the old public key still verifies old signatures."""
    old = keys.load_or_create(tmp_path, "signer")
    key_dir = tmp_path / "keys" / "signer"
    assert _mode(key_dir) == 0o700 and _mode(key_dir / f"{old.kid}.pem") == 0o600
    signed_before = old.sign(b"capsule before rotation")
    new = keys.rotate(tmp_path, "signer")
    assert new.kid != old.kid and keys.load_or_create(tmp_path, "signer").kid == new.kid
    published = {k.kid: k for k in keys.public_keys(tmp_path, "signer")}
    assert set(published) == {old.kid, new.kid} and published[new.kid].active and not published[old.kid].active
    published[old.kid].public.verify(signed_before, b"capsule before rotation")  # raises if not verifiable
    os.chmod(key_dir / f"{old.kid}.pem", 0o644)
    with pytest.raises(keys.KeyFileError, match="0600"):
        keys.public_keys(tmp_path, "signer")


def _secret_forms(data_dir: Path) -> list[str]:
    """Every textual form key material could take in a log line."""
    forms: list[str] = []
    for pem in (data_dir / "keys").rglob("*.pem"):
        text = pem.read_text()
        forms.append("".join(text.splitlines()[1:-1])[:40])  # base64 body of the PEM
        priv = serialization.load_pem_private_key(pem.read_bytes(), password=None)
        raw = priv.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                 serialization.NoEncryption())
        forms += [raw.hex(), base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode().rstrip("=")]
    for creds in (data_dir / "creds").glob("*.creds"):
        forms.append(read_creds(creds).seed)
    return [f for f in forms if f]


async def test_keys_and_seeds_are_never_logged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Starting the gateway (kernel key) and the signer on a secured server logs no private key or nkey seed."""
    from consumers.signer import Signer
    from gateway.app import Gateway

    cfg = _config(tmp_path)
    auth = embedded_auth(cfg)
    with structlog.testing.capture_logs() as logs:
        async with EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1,
                                  authorization=auth.server_block) as server:
            nc = await connect(server.client_url, creds=str(auth.service_creds), name="svc")
            try:
                async with Gateway(cfg, nc) as gw, Signer(cfg, nc) as signer:
                    await gw.drain()
                    await signer.drain()
            finally:
                await nc.drain()
    forms = _secret_forms(tmp_path / "data")
    assert len(forms) >= 8, "kernel and signer keys and the credentials must exist by now"
    text = repr(logs) + capsys.readouterr().err + (tmp_path / "nats" / "nats-server.log").read_text()
    assert logs, "the services logged something (the capture works)"
    leaked = [f[:8] + "..." for f in forms if f in text]
    assert not leaked, f"key material in logs: {leaked}"


def test_open_mode_gets_only_the_demo_parties(tmp_path: Path) -> None:
    """With no [agents] the block has the services plus `pgw demo`'s pair, and nothing else unless configured."""
    open_mode = {p.label for p in embedded_auth(load_config(None, data_dir=str(tmp_path / "a"))).parties}
    # Each service is two users: its own and its answering connection (docs/security.md "Replies").
    services = ("service:", "responder:")
    assert {x for x in open_mode if not x.startswith(services)} == {"agent:demo-agent", "principal:alice"}
    closed = embedded_auth(load_config(None, data_dir=str(tmp_path / "b"), security={"demo": False})).parties
    assert all(p.role in ("service", "responder") for p in closed)


def test_missing_keys_refused_when_create_is_false(tmp_path: Path) -> None:
    """keys.create = false: a missing kernel/signer key, salt or VAPID key stops start-up naming the file, none is made."""
    from consumers.notify.vapid import load_or_create_vapid_key
    from consumers.signer import load_or_create_salt
    from pgwcore.keys import MissingKeyError, load_or_create

    for role in ("kernel", "signer"):
        with pytest.raises(MissingKeyError, match=rf"{role} signing key is missing at .*keys/{role}/active"):
            load_or_create(tmp_path, role, create=False)
    with pytest.raises(MissingKeyError, match="salt"):
        load_or_create_salt(tmp_path / "salt", create=False)
    with pytest.raises(MissingKeyError, match="VAPID key is missing"):
        load_or_create_vapid_key(tmp_path, create=False)
    assert not (tmp_path / "keys").exists() and not (tmp_path / "salt").exists(), "nothing may be created"
    made = load_or_create(tmp_path, "kernel")  # the development default still makes it...
    assert load_or_create(tmp_path, "kernel", create=False).kid == made.kid  # ...and then it is simply read


async def test_signer_refuses_to_start_without_its_key(make_config, nats_server) -> None:
    """A signer configured with keys.create = false and no key volume fails at start instead of signing with a new key."""
    from consumers.signer import Signer
    from pgwcore.connect import connect
    from pgwcore.keys import MissingKeyError

    config = make_config(keys={"create": False})
    nc = await connect(nats_server.client_url, name="signer-test")
    try:
        with pytest.raises(MissingKeyError, match="signer signing key"):
            async with Signer(config, nc):
                pass
    finally:
        await nc.close()
    assert not (config.data_path / "keys" / "signer").exists()


def test_pgw_keys_lists_every_role_including_vapid(tmp_path: Path) -> None:
    """`pgw keys` lists the Ed25519 roles and the notifier's VAPID key instead of crashing on it."""
    import subprocess
    import sys

    from consumers.notify.vapid import load_or_create_vapid_key
    from pgwcore.keys import load_or_create

    load_or_create(tmp_path, "kernel")
    load_or_create(tmp_path, "signer")
    vapid = load_or_create_vapid_key(tmp_path)
    out = subprocess.run([sys.executable, "-m", "pgwcli", "--data-dir", str(tmp_path), "keys"],
                         capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert "role: kernel" in out.stdout and "role: signer" in out.stdout
    assert "role: vapid" in out.stdout and vapid.public_b64url in out.stdout


def test_keys_dir_moves_every_key_out_of_the_data_folder(tmp_path: Path) -> None:
    """keys.dir: `pgw keys --rotate` writes there, `pgw keys` lists from there, nothing lands under {data_dir}/keys."""
    import subprocess
    import sys

    keys_dir = tmp_path / "secrets" / "keys"
    cfg = tmp_path / "pgw.toml"
    cfg.write_text(f'[keys]\ndir = "{keys_dir}"\n')
    repo = Path(__file__).resolve().parent.parent
    base = [sys.executable, "-m", "pgwcli", "--config", str(cfg), "--data-dir", str(tmp_path / "data"), "keys"]
    made = subprocess.run([*base, "--rotate", "signer"], capture_output=True, text=True, timeout=60, cwd=repo)
    assert made.returncode == 0, made.stderr
    listed = subprocess.run(base, capture_output=True, text=True, timeout=60, cwd=repo)
    assert listed.returncode == 0 and "role: signer" in listed.stdout
    assert list((keys_dir / "signer").glob("*.pem")) and not (tmp_path / "data" / "keys").exists()
    from pgwcore.config import load_config

    assert load_config(cfg).keys_path == keys_dir


def test_the_digest_key_is_kept_and_rotated_with_the_keys(tmp_path) -> None:
    """The digest key is made 0600 under keys/digest; a digest names its kid and is no plain sha256; after `pgw
    keys --rotate digest` every earlier digest still checks, a wrong guess or another deployment's key does not, a
    legacy bare sha256 still reads, and a key file readable by others is refused."""
    from pgwcore.keys import (
        KeyFileError,
        MissingKeyError,
        load_or_create_digest_key,
        public_keys,
        rotate,
    )

    first = load_or_create_digest_key(tmp_path)
    old = first.digest("yes")
    assert old.startswith(f"hmac-sha256:{first.kid}:") and hashlib.sha256(b"yes").hexdigest() not in old
    files = list((tmp_path / "keys" / "digest").glob("*.key"))
    assert [f.stat().st_mode & 0o777 for f in files] == [0o600]
    assert rotate(tmp_path, "digest").kid != first.kid
    now = load_or_create_digest_key(tmp_path, create=False)
    assert now.kid != first.kid and now.digest("yes") != old
    assert now.matches("yes", old) and not now.matches("no", old)
    assert now.matches("yes", hashlib.sha256(b"yes").hexdigest())  # a record forgotten before keyed digests
    assert not load_or_create_digest_key(tmp_path / "elsewhere").matches("yes", old)
    assert public_keys(tmp_path) == []  # a secret key: `pgw keys` lists no public key for it
    assert repr(now) == f"DigestKey(kid={now.kid!r}, keys=2)"  # never the key material
    with pytest.raises(MissingKeyError):
        load_or_create_digest_key(tmp_path / "none", create=False)
    files[0].chmod(0o644)
    with pytest.raises(KeyFileError):
        load_or_create_digest_key(tmp_path)
