"""A small SDK for executors: the services that carry out gated actions (subjects/gate.py).

An executor serves the actions of one kind of governed object. The kernel is
the only party that may send to it (the server enforces that: only the
gateway's identity may publish on ``{prefix}.exec.>``), so what it runs is
what the kernel dispatched after validation, the log commit and Cedar (spec
003 §5.1, §8.7)::

    async with Executor(nc, "files") as ex:
        @ex.action("WriteFile")
        async def write(args):
            Path(args["path"]).write_text(args["text"])
            return {"written": len(args["text"])}

        await stop.wait()

What it guarantees (docs/gate.md, "Crash safety"):

* **At most once per idempotency key.** Before an action runs, the executor
  claims the key in its KV bucket ``PGW_EXEC_{KIND}`` (a create, which the
  server lets succeed once); the result (or the error) is then stored under
  the key. A second dispatch of a key that has a result gets the stored
  result without the action running again; one whose claim has no result
  yet (running now, or an executor that died while running it) gets
  ``running``: the kernel keeps it ``dispatched_unconfirmed`` rather than
  guess.
* ``{prefix}.exec.{kind}._result`` answers what became of a key: the stored
  result, ``running``, or ``unknown`` (never claimed here, so never run): the
  kernel's crash recovery may then dispatch it again, safely.
* A handler that raises ``ActionError`` is a clean failure (``error``, the
  kernel records ``failed``); any other exception is stored as the error
  ``EXECUTOR_EXCEPTION`` (the executor cannot say more about what happened).
* **Large results.** The kernel carries a result in messages of the bus (its
  ``DONE`` reply, the verdict, the ``action_result`` outcome), each at most the
  server's ``max_payload``. A result whose answer is larger than
  ``inline_limit`` (default a quarter of ``max_payload``, leaving the kernel
  room for its own fields) is not lost after the action ran: the answer is kept
  in the executor's own bucket in parts (``{key}.part.{n}``, written before the
  key's answer, so a crash between leaves ``running`` as before), and the
  kernel is answered with a reference ``{"pgw_large_result": {"digest", "size",
  "sha256", "parts", "bucket", "key"}}``: ``digest`` is the JSON-DIGEST of the
  result itself (spec 004 §5.2), so the capsule's ``response_digest``, which is
  over the reference, binds the result by its digest. :meth:`Executor.read_large`
  reads it back and checks both digests (the MCP gate does, for its host).

The service registers with the NATS services API as ``pgw-exec-{kind}``, so
``nats micro ls`` shows it. This module imports ``subjects`` only, like an
agent: an executor is an outside party.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.micro import Request
from nats.micro.service import Service, ServiceConfig

from subjects.gate import (
    IDEMPOTENCY_HEADER,
    RESULT_ENDPOINT,
    ExecError,
    ExecRequest,
    ExecResponse,
    check_action_token,
    check_kind,
    exec_bucket,
    exec_request_decoder,
    exec_service_name,
    result_query_decoder,
)
from subjects.jcs import json_digest
from subjects.names import Subjects
from subjects.replies import GuardedService, ReplyGate, describe

_log = structlog.get_logger("pgw.executor")

Handler = Callable[..., Awaitable[Any]]

# The executors' queue group: several instances of one kind share the work.
EXEC_QUEUE = "pgw-exec"
_RUNNING = b'{"status":"running"}'
_enc = msgspec.json.Encoder()
_resp_dec = msgspec.json.Decoder(ExecResponse)


class ActionError(Exception):
    """Raised by a handler for a clean failure: the executor answers ``error`` with this code."""

    def __init__(self, code: str, message: str = "") -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}" if message else code)


class Executor:
    """One executor kind on the bus; an async context manager with an idempotent ``drain()``.

    ``action(name)`` registers a handler ``async def f(args)`` or ``async def
    f(args, request)`` (``request``: the ``ExecRequest``, for its idp_id, agent,
    principal and idempotency key). Handlers may be added before or after start.
    """

    def __init__(
        self, nc: Any, kind: str, *, prefix: str = "pgw", version: str = "0.1.0", replicas: int = 1,
        inline_limit: int | None = None,
    ) -> None:
        self.nc = nc
        self.kind = check_kind(kind)
        self.subjects = Subjects(prefix)
        self.version = version
        self.replicas = replicas
        self.bucket = exec_bucket(kind)
        self.kv: Any = None
        self.handlers: dict[str, Handler] = {}
        self.runs = 0  # how many times a handler actually ran in this process
        self._service: Service | None = None
        self._local: dict[str, asyncio.Future[bytes]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._gate = ReplyGate(self.subjects.prefix, self._refused)  # answers the gateway only
        self.inline_limit = inline_limit  # None: a quarter of the server's max_payload, read at start

    # -- registration ----------------------------------------------------------
    def action(self, name: str) -> Callable[[Handler], Handler]:
        check_action_token(name)

        def deco(fn: Handler) -> Handler:
            # Served at once, before or after start: one endpoint takes every action of the kind.
            self.handlers[name] = fn
            return fn

        return deco

    # -- life cycle --------------------------------------------------------------
    async def __aenter__(self) -> Executor:
        if self.inline_limit is None:
            self.inline_limit = max(1024, int(self.nc.max_payload) // 4)
        js = self.nc.jetstream()
        try:
            self.kv = await js.key_value(self.bucket)
        except BucketNotFoundError:
            with contextlib.suppress(Exception):
                await js.create_key_value(
                    KeyValueConfig(bucket=self.bucket, history=1, storage=StorageType.FILE, replicas=self.replicas)
                )
            self.kv = await js.key_value(self.bucket)
        self._service = GuardedService(
            self.nc,
            ServiceConfig(
                name=exec_service_name(self.kind), version=self.version,
                description=f"Principal Gateway executor of kind {self.kind}",
                metadata={"prefix": self.subjects.prefix, "kind": self.kind},
            ),
            self._gate,
        )
        await self._service.start()
        # One endpoint, exec.{kind}.*: every action of the kind and the _result query. (Two
        # subscriptions of one queue group on one connection would each get a share of _result.)
        await self._service.add_endpoint(
            name="actions", subject=self.subjects.exec_all(self.kind)[:-1] + "*", handler=self._on_request,
            queue_group=EXEC_QUEUE,
        )
        await self.nc.flush()
        return self

    def _refused(self, msg: Any, who: Any) -> None:
        _log.warning("request not answered: its reply subject is no inbox of the party that may send it", kind=self.kind,
                     request=msg.subject[:200], reply=(msg.reply or "")[:200], party=describe(who))

    async def _answer(self, req: Request, payload: bytes) -> None:
        # The reply rule (subjects/replies.py): only to the gateway's inbox, no request header copied.
        await self._gate.answer(req._msg, payload)

    async def _on_request(self, req: Request) -> None:
        if not self._gate.admits(req._msg):  # before the action runs: no claim, no call
            return
        # A subscription's callbacks run one after another: each request gets a task of its own,
        # so a slow action holds up neither the others nor the _result query.
        task = asyncio.get_running_loop().create_task(self._serve(req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, req: Request) -> None:
        name = req.subject.rsplit(".", 1)[-1]
        if name == RESULT_ENDPOINT:
            await self._on_result(req)
        elif name in self.handlers:
            await self._on_action(name, req)
        else:
            # Refused, not run: this instance serves no such action.
            await self._answer(req, _enc.encode(ExecResponse(status="error", error=ExecError(
                code="UNKNOWN_ACTION", message=f"executor {self.kind} serves no action {name[:128]}"))))

    async def drain(self) -> None:
        """Stop taking requests, let those in flight answer; idempotent."""
        service, self._service = self._service, None
        if service is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await service.stop()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()

    # -- the two endpoints ---------------------------------------------------------
    async def _on_result(self, req: Request) -> None:
        try:
            q = result_query_decoder.decode(req.data)
        except msgspec.ValidationError as e:
            await self._answer(req, _enc.encode(ExecResponse(status="error", error=ExecError(code="REQUEST_MALFORMED", message=str(e)[:500]))))
            return
        await self._answer(req, await self.lookup(q.idempotency_key))

    async def lookup(self, key: str) -> bytes:
        """The stored answer for ``key``: a result, ``running`` or ``unknown``."""
        try:
            e = await self.kv.get(key)
        except KeyNotFoundError:
            return _enc.encode(ExecResponse(status="unknown"))
        return bytes(e.value) if e.value else _enc.encode(ExecResponse(status="unknown"))

    async def _on_action(self, name: str, req: Request) -> None:
        try:
            er = exec_request_decoder.decode(req.data)
        except msgspec.ValidationError as e:
            await self._answer(req, _enc.encode(ExecResponse(status="error", error=ExecError(code="REQUEST_MALFORMED", message=str(e)[:500]))))
            return
        header = (req.headers or {}).get(IDEMPOTENCY_HEADER)
        if er.action != name or (header is not None and header != er.idempotency_key):
            await self._answer(req, _enc.encode(ExecResponse(status="error", error=ExecError(
                code="REQUEST_MALFORMED", message="action or idempotency key differs between subject, header and body"))))
            return
        await self._answer(req, await self.run(name, er))

    async def run(self, name: str, er: ExecRequest) -> bytes:
        """Run ``er`` at most once for its key; the answer (stored, or just made)."""
        key = er.idempotency_key
        local = self._local.get(key)
        if local is not None:  # the same key in flight in this process: share its answer
            return await asyncio.shield(local)
        try:
            await self.kv.create(key, _RUNNING)
        except KeyWrongLastSequenceError:
            # Claimed before: its result, or "running" (never run twice).
            return await self.lookup(key)
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._local[key] = fut
        try:
            answer = await self._fit(key, await self._call(name, er))
            # The result under the key; a crash before this leaves "running" (docs/gate.md).
            await self.kv.put(key, answer)
            fut.set_result(answer)
            return answer
        except BaseException as e:
            if not fut.done():
                fut.set_exception(e)
                fut.exception()  # retrieved: no "never retrieved" warning when nobody shared it
            raise
        finally:
            self._local.pop(key, None)

    async def _call(self, name: str, er: ExecRequest) -> bytes:
        fn = self.handlers[name]
        self.runs += 1
        try:
            params = len(inspect.signature(fn).parameters)
            out = await (fn(er.arguments, er) if params >= 2 else fn(er.arguments))
        except ActionError as e:
            return _enc.encode(ExecResponse(status="error", error=ExecError(code=e.code[:128], message=e.message[:2000])))
        except Exception as e:  # noqa: BLE001 - the executor cannot say more; the kernel records failed
            return _enc.encode(ExecResponse(status="error", error=ExecError(code="EXECUTOR_EXCEPTION", message=type(e).__name__)))
        return _enc.encode(ExecResponse(status="ok", result=out))


    # -- large results -------------------------------------------------------------
    async def _fit(self, key: str, answer: bytes) -> bytes:
        """``answer``, or, past ``inline_limit``, the reference to it kept in parts (module docstring)."""
        limit = self.inline_limit or len(answer)
        if len(answer) <= limit:
            return answer
        resp = _resp_dec.decode(answer)
        if resp.status != "ok":  # an error is clipped to 2,000 characters; not this case, kept whole anyway
            resp = ExecResponse(status="error", error=ExecError(code="RESULT_TOO_LARGE", message="error too large"))
            return _enc.encode(resp)
        parts = [answer[i:i + limit] for i in range(0, len(answer), limit)]
        for n, part in enumerate(parts):
            await self.kv.put(f"{key}.part.{n}", part)
        ref = {LARGE_RESULT: {
            "digest": json_digest(resp.result if resp.result is not None else {}), "size": len(answer),
            "sha256": hashlib.sha256(answer).hexdigest(), "parts": len(parts), "bucket": self.bucket, "key": key,
        }}
        _log.info("result kept in parts: larger than one answer may be", kind=self.kind, size=len(answer),
                  parts=len(parts), limit=limit)
        return _enc.encode(ExecResponse(status="ok", result=ref))

    async def read_large(self, ref: Any) -> Any:
        """The result a reference made by this executor kind points to, checked against both its digests."""
        if not is_large_result(ref):
            raise LargeResultError("not a large-result reference")
        info = ref[LARGE_RESULT]
        if info.get("bucket") != self.bucket:
            raise LargeResultError(f"kept in bucket {info.get('bucket')!r}, not this executor's {self.bucket}")
        chunks = []
        try:
            for n in range(int(info["parts"])):
                chunks.append(bytes((await self.kv.get(f"{info['key']}.part.{n}")).value or b""))
        except (KeyNotFoundError, KeyError, TypeError, ValueError) as e:
            raise LargeResultError(f"a part is missing ({type(e).__name__})") from None
        data = b"".join(chunks)
        if hashlib.sha256(data).hexdigest() != info.get("sha256"):
            raise LargeResultError("the parts do not match the reference's sha256")
        resp = _resp_dec.decode(data)
        result = resp.result if resp.result is not None else {}
        if json_digest(result) != info.get("digest"):
            raise LargeResultError("the result does not match the reference's digest")
        return resp.result


LARGE_RESULT = "pgw_large_result"


class LargeResultError(Exception):
    """A large result could not be read back, or did not match its reference."""


def is_large_result(value: Any) -> bool:
    """Whether an executor's result is the reference to a result kept in parts (module docstring)."""
    return isinstance(value, dict) and len(value) == 1 and isinstance(value.get(LARGE_RESULT), dict)


def decode_response(data: bytes) -> ExecResponse:
    """An executor's answer, decoded (``msgspec.ValidationError`` if it is not one)."""
    return _resp_dec.decode(data)
