"""Capsule commands (spec 004): ``pgw signer``, ``pgw registrar``, ``pgw verify``,
``pgw keys`` and ``pgw capsules open-items``.

Also runnable without the full CLI: ``python -m cli.commands.capsules ...``
takes the same global options and only these subcommands.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from nats.js.errors import NotFoundError

from consumers.cose import TrustedKey
from consumers.ledger_check import LedgerIssue, check_ledger, missing_from
from consumers.notify.vapid import load_or_create_vapid_key, vapid_key_path
from consumers.registrar import Registrar, load_ts_key, read_pinned_ts_keys
from consumers.signer import LEDGER_STREAM, Signer
from consumers.verifier import Result, Store, open_items, payload_of, verify_many, verify_statement
from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.keys import kid_of, public_keys, rotate
from pgwcore.msgget import stored_range
from pgwcore.service import serve_alone
from subjects.errors import PgwError

if TYPE_CHECKING:
    from consumers.ts_keys import TsKey

_enc = msgspec.json.Encoder()


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("signer", help="run the capsule signer (verdicts -> signed capsules) against --server")
    p.set_defaults(handler=handle_signer)

    p = sub.add_parser("registrar", help="run the SCITT registrar (capsule.register -> capsule.registered)")
    p.set_defaults(handler=handle_registrar)

    p = sub.add_parser("verify", help="Class 1 verification of capsules (spec 004 §6)")
    p.add_argument("paths", nargs="*", help="statement files or directories of them")
    p.add_argument("--stream", action="append", default=[],
                   help="verify every statement in a stream (PGW_REGISTRATION, PGW_CAPSULES)")
    p.add_argument("--key", action="append", default=[],
                   help="trusted signer key: raw hex or a PEM public key file (added to the data folder's keys; "
                        "trusted under whatever kid the producer put on its statements)")
    p.add_argument("--ts-key", action="append", default=[], help="trusted Transparency Service key (hex or PEM)")
    p.add_argument("--store", action="append", default=[],
                   help="extra capsules for chain checks: a directory, or stream:NAME")
    p.add_argument("--json", action="store_true", help="one JSON result per line")
    p.add_argument("--ledger", action="store_true",
                   help="also walk the signer's hash chain (PGW_SIGNER_LEDGER) and report ledger capsules the "
                        "verified set lacks (give both PGW_CAPSULES and PGW_REGISTRATION)")
    p.set_defaults(handler=handle_verify)

    p = sub.add_parser("keys", help="print the public keys (raw hex, PEM, kid) verifiers should trust")
    p.add_argument("--rotate", metavar="ROLE", help="make a new active key for ROLE (old keys stay valid)")
    p.add_argument("--role", help="only this role")
    p.set_defaults(handler=handle_keys)

    p = sub.add_parser("capsules", help="capsule queries (alone: registration progress, as `capsules status`)")
    p.set_defaults(handler=handle_status, json=False)
    csub = p.add_subparsers(dest="capsules_command", metavar="QUERY")
    q = csub.add_parser("open-items", help="items still open per spec 004 §5.4.4")
    q.add_argument("paths", nargs="*", help="statement files or directories")
    q.add_argument("--stream", action="append", default=[], help="stream(s) to read (default PGW_CAPSULES "
                   "and PGW_REGISTRATION when no path is given)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler=handle_open_items)
    q = csub.add_parser("status", help="registration progress: waiting, retrying, registered, failed")
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler=handle_status)


# -- services -----------------------------------------------------------------


async def handle_signer(args: argparse.Namespace, config: Config) -> int:
    return await serve_alone(config, Signer, "signer")


async def handle_registrar(args: argparse.Namespace, config: Config) -> int:
    return await serve_alone(config, Registrar, "registrar")


# -- keys -----------------------------------------------------------------------


async def handle_keys(args: argparse.Namespace, config: Config) -> int:
    if args.rotate:
        k = rotate(config.data_path, args.rotate, keys_dir=config.keys_path)
        print(f"rotated {args.rotate}: new active kid {k.kid}")
    keys = public_keys(config.data_path, args.role, keys_dir=config.keys_path) if args.role != "vapid" else []
    vapid = vapid_key_path(config.data_path, config.keys_path) if args.role in (None, "vapid") else None
    if not keys and not (vapid and vapid.exists()):
        print(f"no keys under {config.data_path / 'keys'} (they are created on first start)", file=sys.stderr)
        return 1
    for k in keys:
        print(f"role: {k.role}\nkid: {k.kid}\nstatus: {'active' if k.active else 'retired'}\n"
              f"alg: EdDSA (Ed25519)\nraw: {k.raw_hex}\n{k.pem}")
    if vapid and vapid.exists():  # the notifier's Web Push key (RFC 8292): P-256, not a signing role
        v = load_or_create_vapid_key(config.data_path, create=False, keys_dir=config.keys_path)
        print(f"role: vapid\nstatus: active\nalg: ES256 (P-256)\npublic (applicationServerKey): {v.public_b64url}\n"
              f"file: {v.path}")
    return 0


# -- reading statements ------------------------------------------------------------


def _read_paths(paths: list[str]) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    for p in map(Path, paths):
        try:
            if p.is_dir():
                out += [(str(f), f.read_bytes()) for f in sorted(p.rglob("*")) if f.is_file()]
            else:
                out.append((str(p), p.read_bytes()))
        except OSError as e:
            raise SystemExit(f"pgw verify: cannot read {p}: {e.strerror or e}") from None
    return out


async def read_stream(config: Config, stream: str) -> list[tuple[str, bytes]]:
    """Every message of ``stream`` by sequence (a direct read: no consumer, nothing acked)."""
    nc = await connect(config.nats_url, creds=config.creds, tls=config.tls.files(), name="pgw-verify", once=True)
    try:
        js = nc.jetstream()
        try:
            state = (await js.stream_info(stream)).state
        except NotFoundError:
            raise SystemExit(f"pgw verify: stream {stream!r} does not exist (`pgw streams` lists them)") from None
        return [(f"{stream}#{m.seq}", m.data or b"")
                async for m in stored_range(js, stream, state.first_seq, state.last_seq)]
    finally:
        await nc.close()


def _parse_key(spec: str, role: str) -> TrustedKey:
    s = spec.strip()
    if len(s) == 64 and all(c in "0123456789abcdefABCDEF" for c in s):
        pub = Ed25519PublicKey.from_public_bytes(bytes.fromhex(s))
    else:
        try:
            loaded = serialization.load_pem_public_key(Path(s).read_bytes())
        except (OSError, ValueError) as e:
            raise SystemExit(f"pgw verify: key {s} is neither 64 hex digits nor a readable PEM public key: {e}") from None
        if not isinstance(loaded, Ed25519PublicKey):
            raise SystemExit(f"pgw verify: {s} is not an Ed25519 public key")
        pub = loaded
    return TrustedKey(kid_of(pub), pub, role=role)


def trusted_keys(config: Config, extra: list[str]) -> dict[str, TrustedKey]:
    """The signer keys of the data folder (active and retired) plus ``--key``."""
    keys: dict[str, TrustedKey] = {}
    try:
        for k in public_keys(config.data_path, "signer", keys_dir=config.keys_path):
            keys[k.kid] = TrustedKey(k.kid, k.public, role="signer")
    except Exception as e:  # noqa: BLE001 - an unreadable folder just means no default keys
        print(f"pgw verify: not using keys of {config.data_path}: {e}", file=sys.stderr)
    for spec in extra:
        k = _parse_key(spec, "signer")
        keys[k.kid] = k
    return keys


def kernel_public_keys(config: Config) -> dict[str, Any]:
    """The kernel's public keys in the data folder (active and retired); {} if none."""
    try:
        return {k.kid: k.public for k in public_keys(config.data_path, "kernel", keys_dir=config.keys_path)}
    except Exception:  # noqa: BLE001 - no folder, no keys: the check is then reported as not made
        return {}


def trusted_ts_keys(config: Config, extra: list[str]) -> dict[str, TsKey]:
    """Pinned TS keys, the configured one, and ``--ts-key`` (hex, PEM, JWK/JWKS file or JSON)."""
    keys = read_pinned_ts_keys(config.data_path)
    if config.registrar.ts_public_key:
        keys.update(load_ts_key(config.registrar.ts_public_key, config.registrar.ts_key_id))
    for spec in extra:
        try:
            keys.update(load_ts_key(spec))
        except PgwError as e:
            raise SystemExit(f"pgw verify: --ts-key {spec}: {e}") from None
    return keys


async def _gather(config: Config, paths: list[str], streams: list[str]) -> list[tuple[str, bytes]]:
    items = _read_paths(paths)
    for s in streams:
        items += await read_stream(config, s)
    return items


def format_result(r: Result) -> str:
    head = "OK  " if r.ok else "FAIL"
    a = r.assurance or {}
    line = (f"{head} {r.source}  format={r.profile or '-'} statement={r.statement_type or '-'} "
            f"capsule_id={r.capsule_id or '-'} verdict_class={r.verdict_class or '-'} "
            f"attestation={a.get('attestation_mode', '-')} ledger={a.get('ledger_mode', '-')}")
    if r.effect_grade or a.get("effect_mode"):
        # spec 004 §5.2: who vouches for the effect (gate_executed: observed by the gate;
        # runtime_claimed: the runtime's word) and what is known of it.
        line += f" effect={a.get('effect_mode', '-')} effect_attestation={r.effect_grade or '-'}"
    for f in r.findings:
        line += f"\n      [{f.check} {f.name}] {f.severity}: {f.code}: {f.message}" + (f" ({f.path})" if f.path else "")
    return line


async def handle_verify(args: argparse.Namespace, config: Config) -> int:
    if not args.paths and not args.stream:
        print("pgw verify: give statement files/directories or --stream NAME", file=sys.stderr)
        return 2
    items = await _gather(config, args.paths, args.stream)
    extra_store: list[tuple[str, bytes]] = []
    for s in args.store:
        extra_store += await read_stream(config, s[7:]) if s.startswith("stream:") else _read_paths([s])
    keys = trusted_keys(config, args.key)
    explicit = [_parse_key(spec, "signer") for spec in args.key]  # tried for a producer-chosen kid
    ts_keys = trusted_ts_keys(config, args.ts_key)
    kk = kernel_public_keys(config)  # the kernel's signature inside a checkpoint statement
    single = len(items) == 1 and not args.stream and not Path(args.paths[0]).is_dir()  # noqa: ASYNC240 - a CLI stat
    if extra_store:
        store = Store(p for p in (payload_of(d) for _, d in items + extra_store) if p is not None)
        results = verify_many(items, keys=keys, ts_keys=ts_keys, store=store, any_kid=explicit, kernel_keys=kk)
    elif single:  # one statement and no store: chain parents are reported as not checked
        results = [verify_statement(items[0][1], keys=keys, ts_keys=ts_keys, source=items[0][0],
                                    any_kid=explicit, kernel_keys=kk)]
    else:  # the set is the store
        results = verify_many(items, keys=keys, ts_keys=ts_keys, any_kid=explicit, kernel_keys=kk)
    for r in results:
        print(_enc.encode(r).decode() if args.json else format_result(r))
    bad = sum(not r.ok for r in results)
    if not args.json:
        print(f"{len(results)} statement(s): {len(results) - bad} ok, {bad} failed")
    if getattr(args, "ledger", False) and not await _verify_ledger(config, results, args.json):
        return 1
    return 0 if bad == 0 and results else 1


async def _verify_ledger(config: Config, results: list[Result], as_json: bool) -> bool:
    """``--ledger``: the signer's hash chain intact, and every capsule it lists among ``results``.

    The store-level check that finds a removed or reordered capsule of any
    format (a format "4" capsule carries no linkage of its own, see
    consumers.ledger_check).
    """
    report = check_ledger(d for _, d in await read_stream(config, LEDGER_STREAM))
    missing = missing_from(report, (r.capsule_id for r in results if r.capsule_id)) if results else []
    for cid in missing:
        report.issues.append(LedgerIssue(report.capsule_ids.index(cid) + 1, "capsule_missing",
                                         f"capsule {cid} is in the ledger but not among the verified statements"))
    ok = not report.issues
    if as_json:
        print(_enc.encode({"ledger": {"ok": ok, "links": report.links, "issues": report.issues}}).decode())
    else:
        print(f"{'OK  ' if ok else 'FAIL'} ledger {LEDGER_STREAM}: {report.links} link(s)")
        for i in report.issues:
            print(f"      position {i.position}: {i.code}: {i.message}")
    return ok


async def handle_open_items(args: argparse.Namespace, config: Config) -> int:
    streams = args.stream or ([] if args.paths else ["PGW_CAPSULES", "PGW_REGISTRATION"])
    items = await _gather(config, args.paths, streams)
    store = Store(p for p in (payload_of(d) for _, d in items) if p is not None)
    rows = open_items(store)
    for p in rows:
        d = p.get("disposition", {})
        row = {"capsule_id": p.get("capsule_id"), "verdict_class": d.get("verdict_class"),
               "action_id": p.get("action_id"), "timestamp": p.get("timestamp"),
               "decision": d.get("decision")}
        if args.json:
            print(_enc.encode(row).decode())
        else:
            print(f"{row['timestamp']}  {row['verdict_class']:<16} {row['capsule_id']}  {row['action_id']}")
    if not args.json:
        print(f"{len(rows)} open item(s) among {len(store)} capsule(s)")
    return 0


async def handle_status(args: argparse.Namespace, config: Config) -> int:
    """Registration progress from the streams (docs/capsules.md "Registration")."""
    from consumers.registrar_status import progress  # only this command needs it

    nc = await connect(config.nats_url, creds=config.creds, tls=config.tls.files(), name="pgw-capsules", once=True)
    try:
        p = await progress(nc.jetstream(), config.registrar.durable)
    finally:
        await nc.close()
    if args.json:
        print(_enc.encode(p).decode())
    else:
        ts = config.registrar.ts_url or "none configured (capsules wait)"
        print(f"transparency service: {ts}\n"
              f"waiting     {p.waiting:>8}   in capsule.register, not yet registered\n"
              f"retrying    {p.retrying:>8}   of those, delivered more than once so far\n"
              f"registered  {p.registered:>8}   anchored, receipt verified (PGW_CAPSULES)\n"
              f"failed      {p.failed:>8}   refused permanently (PGW_REGISTRATION_DLQ)")
    return 0


# -- standalone entry point -----------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cli.commands.capsules``: the same as ``pgw`` (kept for scripts that use it)."""
    from cli.main import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
