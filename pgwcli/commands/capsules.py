"""Capsule commands (spec 004): ``pgw signer``, ``pgw registrar``, ``pgw verify``,
``pgw keys`` and ``pgw capsules`` (``status``, ``list``, ``show``, ``export``, ``open-items``).

Also runnable without the full CLI: ``python -m pgwcli.commands.capsules ...``
takes the same global options and only these subcommands.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from nats.js.errors import NotFoundError

from consumers.cose import TrustedKey
from consumers.ledger_check import LedgerIssue, check_ledger, missing_from
from consumers.notify.vapid import load_or_create_vapid_key, vapid_key_path
from consumers.registrar import DLQ_STREAM, DeadLetter, Registrar, load_ts_key, read_pinned_ts_keys
from consumers.signer import LEDGER_STREAM, Signer
from consumers.verifier import (
    Finding,
    Result,
    Store,
    open_items,
    payload_of,
    verify_many,
    verify_statement,
)
from pgwcore.atomic import not_written_by_us
from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.keys import KeyFileError, kid_of, public_keys, read_ed25519_public, rotate
from pgwcore.micro import service_name
from pgwcore.msgget import outside, stored_range
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
    p.add_argument("--verbose", "-v", action="store_true",
                   help="also print the notes on values outside spec 004's registries (your own action names)")
    p.add_argument("--ledger", action="store_true",
                   help="also walk the signer's hash chain (PGW_SIGNER_LEDGER) and report ledger capsules the "
                        "verified set lacks (give both PGW_CAPSULES and PGW_REGISTRATION)")
    p.set_defaults(handler=handle_verify)

    p = sub.add_parser("keys", help="print the public keys (raw hex, PEM, kid) verifiers should trust")
    p.add_argument("--rotate", metavar="ROLE", help="make a new active key for ROLE (old keys stay valid); for "
                   "signer, then check that every running signer signs with it")
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
    q = csub.add_parser("list", help="the newest capsules, one line each, registered or waiting")
    q.add_argument("--last", type=int, default=20, metavar="N", help="how many (default 20)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler=handle_list)
    q = csub.add_parser("show", help="one capsule decoded: what was decided, by whom, under which assurance, "
                                     "registered or not")
    q.add_argument("capsule_id", metavar="ID", help=f"a capsule id, or its first {MIN_PREFIX} or more hex digits")
    q.add_argument("--json", action="store_true", help="the payload, where it is stored and the verification")
    q.add_argument("--verbose", "-v", action="store_true", help="also the notes on unregistered values")
    q.set_defaults(handler=handle_show)
    q = csub.add_parser("export", help="write one capsule's statement to FILE (what `pgw verify FILE` reads)")
    q.add_argument("capsule_id", metavar="ID", help=f"a capsule id, or its first {MIN_PREFIX} or more hex digits")
    q.add_argument("file", metavar="FILE", help="where to write it ('-': standard output)")
    q.set_defaults(handler=handle_export)


# -- services -----------------------------------------------------------------


async def handle_signer(args: argparse.Namespace, config: Config) -> int:
    return await serve_alone(config, Signer, "signer")


async def handle_registrar(args: argparse.Namespace, config: Config) -> int:
    return await serve_alone(config, Registrar, "registrar")


# -- keys -----------------------------------------------------------------------


async def handle_keys(args: argparse.Namespace, config: Config) -> int:
    signers: list[str] = []  # the report on the running signers, printed last
    status = 0
    if args.rotate:
        k = rotate(config.data_path, args.rotate, keys_dir=config.keys_path)
        print(f"rotated {args.rotate}: new active kid {k.kid} (the retired keys stay trusted for verification)")
        if args.rotate == "signer":
            status, signers = await reach_signers(config, k.kid)
        elif args.rotate == "kernel":  # the gateway's kernel reads its key once, at start
            signers = [f"running gateways keep signing the kernel's event log with the retired key until they "
                       f"restart (pgw up, pgw gateway); each started from now on signs with {k.kid}"]
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
    for line in signers:  # a signer left behind is an error line; the others are the report
        print(line, file=sys.stderr if line.startswith("pgw keys:") else sys.stdout)
    return status


# How long `pgw keys --rotate signer` gives the running signers to take the new key: each reads
# the active kid every Signer.key_check_s seconds (docs/capsules.md "Keys").
SIGNER_TAKES_KEY_S = 2 * Signer.key_check_s + 3.0


async def reach_signers(config: Config, kid: str) -> tuple[int, list[str]]:
    """Wait until every signer answering the services API signs with ``kid``: (exit status, report lines).

    Each signer reports the kid it signs with in its STATS data (``signing_kid``). One
    that still has another key after ``SIGNER_TAKES_KEY_S`` reads another key folder
    (another host, another ``keys.dir``): it is named, with what to do, and the status is 1.
    """
    folder = config.keys_path / "signer"
    try:
        nc = await connect(config.nats_url, creds=config.creds, tls=config.tls.files(), name="pgw-keys", once=True)
    except Exception as e:  # noqa: BLE001 - no server, or not ours to ask: said, and the rotation stands
        return 0, [f"no running signer could be asked ({config.nats_url}: {e}); a signer reading {folder} takes "
                   f"{kid} within {Signer.key_check_s:g} s, and one started from now on signs with it"]
    try:
        deadline = asyncio.get_running_loop().time() + SIGNER_TAKES_KEY_S
        while True:
            kids = await signer_kids(nc)
            if all(k == kid for k in kids.values()) or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.5)
    finally:
        await nc.close()
    if not kids:
        return 0, [f"no signer is running on {config.nats_url}: the next one to start signs with {kid}"]
    lines, status = [], 0
    for instance, has in sorted(kids.items()):
        if has == kid:
            lines.append(f"signer {instance}: signs with {kid}")
            continue
        status = 1
        lines.append(f"pgw keys: signer {instance} still signs with {has or 'a key it does not name (an older pgw)'} "
                     f"after {SIGNER_TAKES_KEY_S:g} s: it does not read {folder} (another host, another keys.dir); "
                     f"give it that folder's {kid}.pem and active files, or restart it with this folder")
    return status, lines


async def signer_kids(nc: Any, window: float = 0.75) -> dict[str, str | None]:
    """{instance id: the kid it signs with (None: it does not say)} of every signer answering STATS within ``window``."""
    found: dict[str, str | None] = {}

    async def on_reply(msg: Any) -> None:
        try:
            body = json.loads(msg.data)
            data = [e.get("data") or {} for e in body.get("endpoints") or []]
            found[str(body["id"])] = next((d["signing_kid"] for d in data if d.get("signing_kid")), None)
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # not a STATS reply of ours

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(f"$SRV.STATS.{service_name('signer')}", b"", reply=inbox)
        await asyncio.sleep(window)
    finally:
        await sub.unsubscribe()
    return found


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
            info = await js.stream_info(stream)
        except NotFoundError:
            raise SystemExit(f"pgw verify: stream {stream!r} does not exist (`pgw streams` lists them)") from None
        state, own = info.state, list(info.config.subjects or [])
        # A message stored under a subject that is not the stream's is one the server delivered to a party's
        # reply subject (pgwcore.msgget.outside): read as an empty record, which no writer of these streams
        # stores, so each reader takes it for the server's (not_written_by_us). A mirror or sourced stream
        # names no subjects of its own: nothing to compare with.
        return [(f"{stream}#{m.seq}", b"" if own and outside(m.subject, own) else m.data or b"")
                async for m in stored_range(js, stream, state.first_seq, state.last_seq)]
    finally:
        await nc.close()


def _parse_key(spec: str, role: str) -> TrustedKey:
    s = spec.strip()
    if len(s) == 64 and all(c in "0123456789abcdefABCDEF" for c in s):
        pub = Ed25519PublicKey.from_public_bytes(bytes.fromhex(s))
    else:
        try:
            pub = read_ed25519_public(s)
        except KeyFileError as e:
            raise SystemExit(f"pgw verify: key {s} is not 64 hex digits, and {e}") from None
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


async def _gather(config: Config, paths: list[str], streams: list[str],
                  foreign: list[str] | None = None) -> list[tuple[str, bytes]]:
    """The statements of ``paths`` and ``streams``; a stream's record that is an answer of the server's (a
    publish acknowledgement or refusal, a JetStream API answer, an empty status answer: ``not_written_by_us``) is
    left out, its source
    appended to ``foreign`` when given."""
    items = _read_paths(paths)
    for s in streams:
        for source, data in await read_stream(config, s):
            if not_written_by_us(data):
                if foreign is not None:
                    foreign.append(source)
                continue
            items.append((source, data))
    return items


# Notes a person sees only with --verbose: spec 004 §9's registries do not hold the names a
# deployment gives its own actions and effects (agent tools, envelope kinds), so nearly every
# gate capsule would carry one. --json keeps every finding.
QUIET = frozenset({"unregistered_value"})


def _shown(findings: Iterable[Finding], verbose: bool) -> list[Finding]:
    return [f for f in findings if verbose or not (f.severity == "info" and f.code in QUIET)]


def format_result(r: Result, *, verbose: bool = True) -> str:
    head = "OK  " if r.ok else "FAIL"
    if r.ok and r.unsigned:
        # A bare capsule JSON is verified by its content alone (Class 1, docs/capsules.md): anyone can write one
        # that passes, so its line must not read as a signed statement's (a docs-only attack's forged "approve").
        head = "OK (UNSIGNED: content only, no signature checked)"
    a = r.assurance or {}
    line = (f"{head} {r.source}  format={r.profile or '-'} statement={r.statement_type or '-'} "
            f"capsule_id={r.capsule_id or '-'} verdict_class={r.verdict_class or '-'} "
            f"attestation={a.get('attestation_mode', '-')} ledger={a.get('ledger_mode', '-')}")
    if r.effect_grade or a.get("effect_mode"):
        # spec 004 §5.2: who vouches for the effect (gate_executed: observed by the gate;
        # runtime_claimed: the runtime's word) and what is known of it.
        line += f" effect={a.get('effect_mode', '-')} effect_attestation={r.effect_grade or '-'}"
    for f in _shown(r.findings, verbose):
        line += f"\n      [{f.check} {f.name}] {f.severity}: {f.code}: {f.message}" + (f" ({f.path})" if f.path else "")
    return line


async def handle_verify(args: argparse.Namespace, config: Config) -> int:
    if not args.paths and not args.stream:
        print("pgw verify: give statement files/directories or --stream NAME", file=sys.stderr)
        return 2
    foreign: list[str] = []
    items = await _gather(config, args.paths, args.stream, foreign)
    for source in foreign:
        print(f"SKIP {source}: an answer of the server's (a publish acknowledgement or refusal, a JetStream API "
              "answer, an empty status answer, or a message it delivered), stored by a party's reply subject (no statement; "
              "docs/security.md \"Replies\")", file=sys.stderr if args.json else sys.stdout)
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
        print(_enc.encode(r).decode() if args.json else format_result(r, verbose=getattr(args, "verbose", False)))
    bad = sum(not r.ok for r in results)
    if not results and not args.paths:  # streams only, all of them empty: nothing is wrong
        print(f"0 capsules: nothing to verify ({', '.join(args.stream)} {'is' if len(args.stream) == 1 else 'are'} "
              "empty)", file=sys.stderr if args.json else sys.stdout)
    elif not args.json:
        hidden = sum(len(r.findings) - len(_shown(r.findings, getattr(args, "verbose", False))) for r in results)
        notes = f"; {hidden} note(s) on unregistered values (your own action names) not shown: --verbose shows them" \
            if hidden else ""
        print(f"{len(results)} statement(s): {len(results) - bad} ok, {bad} failed{notes}")
    if getattr(args, "ledger", False) and not await _verify_ledger(config, results, args.json):
        return 1
    return 0 if bad == 0 and (results or not args.paths) else 1


async def _verify_ledger(config: Config, results: list[Result], as_json: bool) -> bool:
    """``--ledger``: the signer's hash chain intact, and every capsule it lists among ``results``.

    The store-level check that finds a removed or reordered capsule of any
    format (a format "4" capsule carries no linkage of its own, see
    consumers.ledger_check).
    """
    report = check_ledger(d for _, d in await read_stream(config, LEDGER_STREAM))
    missing = missing_from(report, (r.capsule_id for r in results if r.capsule_id)) if results else []
    for cid in missing:
        report.issues.append(LedgerIssue(report.positions[report.capsule_ids.index(cid)], "capsule_missing",
                                         f"capsule {cid} is in the ledger but not among the verified statements"))
    ok = not report.issues
    if as_json:
        print(_enc.encode({"ledger": {"ok": ok, "links": report.links, "issues": report.issues,
                                      "foreign": report.foreign}}).decode())
    else:
        print(f"{'OK  ' if ok else 'FAIL'} ledger {LEDGER_STREAM}: {report.links} link(s)")
        for i in report.issues:
            print(f"      position {i.position}: {i.code}: {i.message}")
        if report.foreign:
            # docs/security.md "Replies": the server's acknowledgement a party aimed at the ledger
            print(f"      {len(report.foreign)} record(s) that are no link, passed over (the chain is whole "
                  f"across them): position(s) {', '.join(map(str, report.foreign[:20]))}"
                  f"{' ...' if len(report.foreign) > 20 else ''}")
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


# -- looking at one capsule ------------------------------------------------------------

# Where a capsule may be, in the order a lookup asks (docs/capsules.md "Looking at a capsule"):
# registered (with its receipt), still waiting for the registrar, or refused by the TS for good.
PLACES = (("PGW_CAPSULES", "registered"), ("PGW_REGISTRATION", "waiting"), (DLQ_STREAM, "failed"))
MIN_PREFIX = 6  # hex digits of a capsule id a person may type instead of all 64


@dataclass(frozen=True)
class StoredCapsule:
    """One stored statement of the signer's, where it is, and what it says (best effort)."""

    capsule_id: str
    state: str  # registered | waiting | failed
    stream: str
    seq: int
    statement: bytes
    payload: dict[str, Any] | None
    last_error: str | None = None  # a failed registration's reason

    @property
    def where(self) -> str:
        return f"{self.stream}#{self.seq}"


_dead_letter = msgspec.json.Decoder(DeadLetter)


def _stored(stream: str, state: str, raw: Any) -> StoredCapsule | None:
    data, error = bytes(raw.data or b""), None
    if stream == DLQ_STREAM:
        try:
            dead = _dead_letter.decode(data)
            data, error = base64.b64decode(dead.statement_b64), dead.last_error
        except (msgspec.DecodeError, ValueError):
            return None
    payload = payload_of(data)
    cid = (raw.headers or {}).get("Pgw-Capsule-Id") or (payload or {}).get("capsule_id")
    if not isinstance(cid, str) or not cid:
        return None
    return StoredCapsule(cid, state, stream, raw.seq or 0, data, payload, error)


async def stored_capsules(config: Config, *, last: int | None = None) -> list[StoredCapsule]:
    """Every stored capsule (or each stream's ``last`` newest), registered ones first; one entry per capsule."""
    nc = await connect(config.nats_url, creds=config.creds, tls=config.tls.files(), name="pgw-capsules", once=True)
    found: dict[str, StoredCapsule] = {}
    try:
        js = nc.jetstream()
        for stream, state in PLACES:
            try:
                info = (await js.stream_info(stream)).state
            except NotFoundError:
                continue  # no DLQ before the registrar's first start
            first = info.first_seq if last is None else max(info.first_seq, info.last_seq - last + 1)
            async for raw in stored_range(js, stream, first, info.last_seq):
                cap = _stored(stream, state, raw)
                if cap is not None:
                    found.setdefault(cap.capsule_id, cap)
    finally:
        await nc.close()
    return list(found.values())


async def find_capsule(config: Config, wanted: str, command: str) -> tuple[StoredCapsule, list[StoredCapsule]]:
    """The one stored capsule whose id is ``wanted`` or starts with it, and every stored capsule (the store
    its chain is checked against); SystemExit with the reason otherwise."""
    q = wanted.strip().lower()
    if len(q) < MIN_PREFIX or any(c not in "0123456789abcdef" for c in q):
        raise SystemExit(f"pgw capsules {command}: {wanted!r} is no capsule id (64 hex digits, or the first "
                         f"{MIN_PREFIX} or more of them)")
    every = await stored_capsules(config)
    hits = [c for c in every if c.capsule_id.startswith(q)]
    if not hits:
        raise SystemExit(f"pgw capsules {command}: no capsule {wanted} in {', '.join(s for s, _ in PLACES)} "
                         f"(`pgw capsules list` shows the newest)")
    if len(hits) > 1:
        raise SystemExit(f"pgw capsules {command}: {wanted} starts {len(hits)} capsule ids ("
                         f"{', '.join(c.capsule_id[:16] for c in hits[:5])}...): give more digits")
    return hits[0], every


def _decided(p: dict[str, Any]) -> str:
    d = p.get("disposition") or {}
    return f"{d.get('verdict_class') or 'executed (clean)'}: {d.get('decision', '-')}"


def _by_whom(p: dict[str, Any]) -> str:
    d, pgw = p.get("disposition") or {}, p.get("pgw") or {}
    who = "the principal (a person decided)" if d.get("approver") == "human" and d.get("human_disposed") \
        else f"{d.get('approver', '-')} (no person decided)"
    line = f"{who}; agent {pgw.get('agent') or p.get('developer') or '-'}, operator {p.get('operator', '-')}"
    if pgw.get("principal_digest"):
        line += f"; principal by salted digest {pgw['principal_digest'][:16]}... (spec 004 §13)"
    return line


def _effect(p: dict[str, Any]) -> str:
    e = p.get("effect")
    if not isinstance(e, dict):
        return "none (nothing was carried out by this decision)"
    return f"{e.get('type', '-')} {e.get('status', '-')}, effect_attestation {e.get('effect_attestation', '-')}"


def _registration(c: StoredCapsule, config: Config) -> str:
    if c.state == "registered":
        return f"yes: {c.where}, a Transparent Statement with the Transparency Service's receipt"
    if c.state == "failed":
        return f"no: refused for good ({c.where}): {c.last_error}"
    ts = config.registrar.ts_url or "none configured, so it waits"
    return f"not yet: waiting in {c.where} for the registrar (transparency service: {ts})"


def describe_capsule(c: StoredCapsule, r: Result, config: Config, *, verbose: bool) -> str:
    """The capsule decoded for a person: one fact a line (``pgw capsules show``)."""
    p = c.payload or {}
    pgw = p.get("pgw") or {}
    signed = p.get("assurance") or {}
    verified = r.assurance or {}
    ids = ", ".join(f"{k} {pgw[k]}" for k in ("verdict_id", "moment_id", "envelope_id", "idp_id") if pgw.get(k))
    chain = p.get("chain") or {}
    rows = [
        ("capsule", c.capsule_id),
        ("decided", f"{_decided(p)}  ({p.get('action_type', '-')} {p.get('action_id', '-')})"),
        ("by", _by_whom(p)),
        ("when", str(p.get("timestamp", "-"))),
        ("effect", _effect(p)),
        ("assurance", f"attestation {verified.get('attestation_mode', signed.get('attestation_mode', '-'))}, "
                      f"effect {verified.get('effect_mode', signed.get('effect_mode', '-'))}, "
                      f"ledger {verified.get('ledger_mode', signed.get('ledger_mode', '-'))} (as verified here)"),
        ("verified", ("OK" if r.ok else "FAIL") + (f", signed by key {r.kid}" if r.kid else "")),
        ("registered", _registration(c, config)),
        ("format", f"{p.get('format_version', r.profile or '-')} ({p.get('spec_version', '-')})"
                   + (f", statement {r.statement_type}" if r.statement_type else "")),
    ]
    if chain:
        rows.insert(5, ("chain", f"{chain.get('relation', '-')} {chain.get('parent_capsule_id', '-')}"))
    if ids:
        rows.append(("ids", ids))
    out = "\n".join(f"{k:<11} {v}" for k, v in rows)
    for f in _shown(r.findings, verbose):
        out += f"\n  [{f.check} {f.name}] {f.severity}: {f.code}: {f.message}"
    return out


async def handle_show(args: argparse.Namespace, config: Config) -> int:
    c, every = await find_capsule(config, args.capsule_id, "show")
    store = Store(e.payload for e in every if e.payload is not None)  # its chain parent is checked too
    (r,) = verify_many([(c.where, c.statement)], keys=trusted_keys(config, []), ts_keys=trusted_ts_keys(config, []),
                       store=store, kernel_keys=kernel_public_keys(config))
    if args.json:
        print(_enc.encode({"capsule_id": c.capsule_id, "state": c.state, "where": c.where,
                           "last_error": c.last_error, "payload": c.payload, "verified": r}).decode())
    else:
        print(describe_capsule(c, r, config, verbose=args.verbose))
    return 0


async def handle_export(args: argparse.Namespace, config: Config) -> int:
    c, _ = await find_capsule(config, args.capsule_id, "export")
    kind = "a Transparent Statement (with its receipt)" if c.state == "registered" else "a Signed Statement"
    if args.file == "-":
        sys.stdout.buffer.write(c.statement)
        sys.stdout.buffer.flush()
        print(f"capsule {c.capsule_id}: {kind}, {len(c.statement)} bytes", file=sys.stderr)
        return 0
    path = Path(args.file)
    try:
        path.write_bytes(c.statement)  # noqa: ASYNC240 - a one-shot CLI write
    except OSError as e:
        print(f"pgw capsules export: cannot write {path}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote {path}: capsule {c.capsule_id}, {kind}, {len(c.statement)} bytes\n"
          f"check it anywhere with: pgw verify {path}")
    return 0


async def handle_list(args: argparse.Namespace, config: Config) -> int:
    caps = sorted(await stored_capsules(config, last=args.last),
                  key=lambda c: (str((c.payload or {}).get("timestamp", "")), c.seq), reverse=True)[: args.last]
    for c in caps:
        p = c.payload or {}
        row = {"capsule_id": c.capsule_id, "timestamp": p.get("timestamp"), "decided": _decided(p),
               "action_id": p.get("action_id"), "state": c.state}
        if args.json:
            print(_enc.encode(row).decode())
        else:
            print(f"{row['timestamp']}  {c.capsule_id[:16]}  {row['decided']:<28} {c.state:<10} {row['action_id']}")
    if not args.json:
        print(f"{len(caps)} capsule(s), newest first (`pgw capsules show ID` decodes one)")
    return 0


# -- standalone entry point -----------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pgwcli.commands.capsules``: the same as ``pgw`` (kept for scripts that use it)."""
    from pgwcli.main import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
