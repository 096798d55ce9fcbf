"""Kernel commands: ``pgw log verify`` and the dev/demo ``pgw mandate`` helpers.

``pgw log verify`` walks the event log (``PGW_EVENTLOG``, or one subject of
it) and checks every event's Ed25519 signature against the kernel public
keys of the data folder (active and retired), or those given with
``--pubkey``, and the hash chain (spec 003 §8.2); then it checks the log
against its latest anchored head (``gateway.kernel.checkpoint``), so a
truncated, rolled-back or forked log is reported too. It prints one JSON
result on stdout, one line per problem on stderr (its stream sequence and what
is wrong: a record that does not decode, is signed by no kernel key, or does
not chain), and exits 0 when the log is intact, 1 otherwise.

``pgw log quarantine SEQ --reason TEXT`` records, with the kernel's key of the
data folder, that the record at SEQ is not the kernel's own: a signed, chained
``LOG_RECORD_QUARANTINED`` event naming SEQ and the SHA-256 of its bytes
(``gateway.kernel.eventlog``). It refuses a record that is the kernel's own.

``pgw mandate issue`` signs a mandate JWT (EdDSA) with the dev issuer key of
the data folder (``keys/mandate_issuer``, created on first use); the kernel
trusts it only with ``kernel.trust_dev_issuer = true`` or when its public
key (``pgw mandate pubkey``) is listed in ``kernel.issuers``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from nats.js.errors import NotFoundError

from pgwcore.config import Config
from pgwcore.connect import connect


def register(sub: argparse._SubParsersAction) -> None:
    lg = sub.add_parser("log", help="the kernel event log (spec 003): verify signatures and the hash chain")
    lsub = lg.add_subparsers(dest="log_command", metavar="ACTION")
    v = lsub.add_parser("verify", help="walk the event log; report the first break or bad signature")
    v.add_argument("--stream", default="PGW_EVENTLOG", help="stream to verify (default PGW_EVENTLOG)")
    v.add_argument("--subject", help="only this subject (e.g. pgw.log.IDP_SUBMITTED); links still checked")
    v.add_argument(
        "--pubkey", action="append", default=[], metavar="PEM",
        help="kernel public key PEM file to trust (repeatable); default: the keys in the data folder",
    )
    v.add_argument(
        "--anchor", action="append", default=[], metavar="JSON",
        help="an anchored head kept elsewhere: a copy of {data_dir}/kernel/eventlog-anchor.json, or a "
             "Transparent checkpoint statement from PGW_CAPSULES (receipt checked; repeatable)",
    )
    v.add_argument(
        "--ts-key", action="append", default=[], metavar="KEY",
        help="Transparency Service key for the receipts of checkpoint statements in PGW_CAPSULES "
             "(as for pgw verify; default: the pinned and configured keys)",
    )
    v.set_defaults(handler=verify_command)
    q = lsub.add_parser(
        "quarantine",
        help="record that the log's record at SEQ is not the kernel's own (signed with the kernel key; "
             "pgw log verify then lists it as quarantined)",
    )
    q.add_argument("seq", type=int, help="the stream sequence pgw log verify reported")
    q.add_argument("--reason", required=True, help="what you found and did (kept in the log)")
    q.add_argument("--stream", default="PGW_EVENTLOG", help="the event log's stream (default PGW_EVENTLOG)")
    q.set_defaults(handler=quarantine_command)

    m = sub.add_parser("mandate", help="dev/demo mandate JWTs for the IDP kernel")
    msub = m.add_subparsers(dest="mandate_command", metavar="ACTION")
    i = msub.add_parser("issue", help="print a mandate JWT signed with the dev issuer key")
    i.add_argument("--agent", required=True, help="the agent (JWT sub)")
    i.add_argument("--so-id", required=True, help="the governed object UUID")
    i.add_argument("--principal", required=True, help="the principal handle for HEM")
    i.add_argument("--action", action="append", required=True, help="a Cedar action in scope (repeatable)")
    i.add_argument("--mission-ref", help="MissionDeclaration UUID")
    i.add_argument("--ttl", type=int, default=3600, help="seconds until exp (default 3600)")
    i.add_argument("--jti", help="mandate id (default: a new UUID)")
    i.add_argument("--aud", help="audience claim (the gateway's kernel.audience)")
    i.add_argument("--iss", help="issuer name claim (kernel.issuer_names)")
    i.set_defaults(handler=issue_command)
    p = msub.add_parser("pubkey", help="print the dev issuer's kid and public key PEM")
    p.set_defaults(handler=pubkey_command)
    from pgwcli.commands.audit import revoke_command

    r = msub.add_parser("revoke", help="revoke a mandate on every gateway now (signed; recorded in the event log)")
    r.add_argument("jti", help="the mandate's jti")
    r.add_argument("--reason", help="why (recorded in the event log)")
    r.add_argument("--key", help="private key PEM of a trusted issuer or revoker (default: the dev issuer key)")
    r.add_argument("--kid", help="the key's kid (default: derived from an Ed25519 key)")
    r.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the kernel")
    r.set_defaults(handler=revoke_command)


def kernel_keys(config: Config, pem_files: list[str]) -> dict[str, Ed25519PublicKey]:
    from pgwcore.keys import KeyFileError, kid_of, public_keys, read_ed25519_public

    if pem_files:
        out = {}
        for f in pem_files:
            try:
                key = read_ed25519_public(f)
            except KeyFileError as e:
                raise SystemExit(f"pgw: {e}") from None
            out[kid_of(key)] = key
        return out
    return {k.kid: k.public for k in public_keys(config.data_path, "kernel", keys_dir=config.keys_path)}


async def verify_command(args: argparse.Namespace, config: Config) -> int:
    from consumers.checkpoint_statement import CAPSULES_STREAM, kept_statement, latest_anchored
    from gateway.kernel.checkpoint import check_anchor
    from gateway.kernel.eventlog import verify_stream
    from pgwcli.commands.capsules import trusted_ts_keys

    keys = kernel_keys(config, args.pubkey)
    ts_keys = trusted_ts_keys(config, getattr(args, "ts_key", []))
    notes: list[str] = []
    json_files: list[Path] = []
    anchored: list[tuple[str, Any, dict[str, Any]]] = []
    bad_file: dict[str, Any] | None = None
    for a in getattr(args, "anchor", []):
        try:
            data = Path(a).read_bytes()  # noqa: ASYNC240 - one small file the user named
        except OSError:
            json_files.append(Path(a))  # check_anchor reports it as not found
            continue
        if data.lstrip()[:1] == b"{":
            json_files.append(Path(a))
            continue
        try:  # a checkpoint statement the TS holds, kept by the auditor
            cp, facts = kept_statement(data, ts_keys)
            anchored.append((a, cp, facts))
        except ValueError as e:
            bad_file = bad_file or {"seq": None, "event_type": None, "problem": f"anchor {a}: {e}"}
    nc = await connect(config.nats_url, creds=config.creds, tls=config.tls.files(), name="pgw-log-verify", once=True)
    try:
        js = nc.jetstream()
        try:
            result = await verify_stream(js, config.subjects, keys, stream=args.stream, subject=args.subject)
        except NotFoundError:
            raise SystemExit(f"pgw log verify: stream {args.stream!r} does not exist (`pgw streams` lists them)") from None
        # The head the Transparency Service holds (a checkpoint statement with a verified receipt).
        outside = None
        try:
            outside = await latest_anchored(js, args.stream, ts_keys)
        except Exception as e:  # noqa: BLE001 - the other anchors still count; said, not raised
            notes.append(f"{CAPSULES_STREAM} not read: {type(e).__name__}: {e}")
        if not ts_keys:
            notes.append("no Transparency Service key: checkpoint statements in PGW_CAPSULES not used")
        # The chain cannot show that the log is whole: its anchored head can (checkpoint.py).
        if outside:
            anchored.append((CAPSULES_STREAM, outside[0], outside[1]))
        anchor, broken = await check_anchor(
            js, keys, prefix=config.subjects.prefix, data_dir=config.data_path, stream=args.stream,
            anchor_files=json_files, anchored=anchored,
        )
        broken = bad_file or broken
    finally:
        await nc.drain()
    if broken is not None and (result.first_break is None or (broken["seq"] or 0) < result.first_break["seq"]):
        result.ok = False
        result.first_break = broken
    if broken is not None:
        result.problems.insert(0, {"seq": broken["seq"], "event_type": broken["event_type"], "subject": None,
                                   "problem": broken["problem"]})
    out: dict[str, Any] = result.to_dict()
    out["anchor"] = anchor
    if notes:
        out["notes"] = notes
    out["stream"] = args.stream
    if args.subject:
        out["subject"] = args.subject
    if not keys:
        out["warning"] = "no kernel public keys found; every event will fail signature verification"
    print(json.dumps(out, indent=2))
    for p in result.problems:  # one line each, for a person (the JSON above is for tools)
        where = f"seq {p['seq']}" if p["seq"] is not None else "the log"
        on = f" on {p['subject']}" if p.get("subject") else ""
        print(f"pgw log verify: {where}{on}: {p['problem']}", file=sys.stderr)
    for q in result.quarantined:
        print(f"pgw log verify: seq {q['seq']}: quarantined by seq {q['quarantined_by']} ({q['problem']})",
              file=sys.stderr)
    if not result.ok:
        print(f"pgw log verify: {args.stream} does not verify; a record that is not the kernel's own is recorded "
              "as such with `pgw log quarantine SEQ --reason TEXT` (docs/operations.md)", file=sys.stderr)
    return 0 if result.ok else 1


async def quarantine_command(args: argparse.Namespace, config: Config) -> int:
    from gateway.kernel.eventlog import (
        QUARANTINED,
        EventLog,
        check_record,
        quarantined,
        record_digest,
    )
    from pgwcore.keys import MissingKeyError, load_or_create
    from subjects.util import stable_id

    try:
        key = load_or_create(config.data_path, "kernel", create=False, keys_dir=config.keys_path)
    except MissingKeyError:
        raise SystemExit(f"pgw log quarantine: no kernel signing key in {config.keys_path or config.data_path}: "
                         "run it where the gateway's data folder is (--data-dir)") from None
    keys = kernel_keys(config, [])
    nc = await connect(config.nats_url, creds=config.creds, tls=config.tls.files(), name="pgw-log-quarantine", once=True)
    try:
        js = nc.jetstream()
        try:
            raw = await js.get_msg(args.stream, args.seq)
        except NotFoundError:
            raise SystemExit(f"pgw log quarantine: {args.stream} holds no record at {args.seq}") from None
        prev: tuple[int, str] | None = None
        if args.seq == 1:
            from subjects.idp import GENESIS_DIGEST

            prev = (0, GENESIS_DIGEST)
        else:
            try:
                before = await js.get_msg(args.stream, args.seq - 1)
                prev = (args.seq - 1, record_digest(before.data or b""))
            except NotFoundError:
                prev = None
        rec = check_record(args.seq, raw.subject or "", raw.data or b"", keys, config.subjects, prev)
        if rec.problem is None:
            raise SystemExit(f"pgw log quarantine: the record at {args.seq} is the kernel's own "
                             f"{rec.event.event_type if rec.event else ''} event; nothing to quarantine")
        done = (await quarantined(js, config.subjects, keys, stream=args.stream)).get(args.seq)
        if done is not None and done.sha256 == rec.digest:
            print(json.dumps({"ok": True, "seq": args.seq, "quarantined_by": done.by_seq, "already": True}, indent=2))
            return 0
        log = EventLog(nc, config.subjects, key, stream=args.stream, keys=keys)
        log.said(args.seq)  # this command is the report; the append must not alarm about it again
        body = {"seq": args.seq, "subject": rec.subject, "sha256": rec.digest, "size": len(rec.data),
                "problem": rec.problem, "reason": args.reason}
        ev = await log.append(QUARANTINED, body, msg_id=stable_id(QUARANTINED, args.stream, str(args.seq), rec.digest))
    finally:
        await nc.drain()
    print(json.dumps({"ok": True, "seq": args.seq, "quarantined_by": ev.seq, "already": ev.duplicate,
                      "problem": rec.problem}, indent=2))
    return 0


async def issue_command(args: argparse.Namespace, config: Config) -> int:
    import msgspec

    from gateway.kernel.mandate import DEV_ISSUER_ROLE, issue_mandate
    from pgwcore.keys import load_or_create
    from subjects.idp import UuidV4
    from subjects.names import agent_token, principal_token

    # A mandate the kernel would refuse whatever it is asked is refused here, where it can be mended.
    agent_token(args.agent)
    principal_token(args.principal)
    try:
        msgspec.convert(args.so_id, UuidV4)  # spec 003 §4.2: so_id is a UUID v4
    except msgspec.ValidationError:
        raise SystemExit(f"pgw mandate issue: --so-id {args.so_id!r} is not a UUID v4 (spec 003 §4.2), "
                         "e.g. the output of `python -c 'import uuid; print(uuid.uuid4())'`") from None
    key = load_or_create(config.data_path, DEV_ISSUER_ROLE, keys_dir=config.keys_path)
    token = issue_mandate(
        key.private, key.kid, agent=args.agent, so_id=args.so_id, principal=args.principal,
        actions=args.action, ttl_s=args.ttl, jti=args.jti, mission_ref=args.mission_ref,
        aud=args.aud, iss=args.iss,
    )
    print(token)
    if not config.kernel.trust_dev_issuer and key.kid not in config.kernel.issuers:
        print(
            f"pgw: note: the kernel trusts this issuer only with kernel.trust_dev_issuer = true "
            f"or kernel.issuers.{key.kid} = <PEM from `pgw mandate pubkey`>",
            file=sys.stderr,
        )
    return 0


async def pubkey_command(args: argparse.Namespace, config: Config) -> int:
    from gateway.kernel.mandate import DEV_ISSUER_ROLE
    from pgwcore.keys import load_or_create

    key = load_or_create(config.data_path, DEV_ISSUER_ROLE, keys_dir=config.keys_path)
    pem = key.public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    print(f"# kid {key.kid}\n{pem}", end="")
    return 0
