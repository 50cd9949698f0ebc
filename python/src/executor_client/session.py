"""One session with an executor over a WebSocket that may break: the connection, its reader
task, reconnecting and resuming, and the routing of what comes in to the requests waiting for it.

A reader task per connection routes the executor's messages to the commands waiting for
them. When the connection drops without a close frame and the executor keeps sessions for a
while (`hello.resume_grace` > 0), the client reconnects with backoff, sends `resume` with the
ids it has no result for, and the commands go on: their missed output and results arrive on
the new connection, each exactly once. A request that may not have reached the executor
before the break is sent again only when the executor's replay shows it never arrived (the
answer to a `cancel` of an unused id comes after the whole replay). `protocol/README.md`
("resume") is the contract; the Rust agent (`agent/src/environment.rs`) does the same.

Protocol 1.1 requests (processes, files) are answered by a reply of their own type with the
same id. Across a broken connection, those that only ask (`read`, `wait`, `resize`, `stat`,
`list_dir`, `list_processes`) are sent again once the session is back, as the executor expects
("ask again after the resume"); a `spawn` is awaited in the resume as a command is (its answer
replayed, or sent again if it never arrived); `signal` and transfers fail with
`ConnectionLostError`, since they may have taken effect. A process request whose session could
not be taken back fails too: the session's processes died with it.

`ResumableConnection` is the base of `AsyncClient` (`aio.py`), which adds the requests
themselves (`exec`, processes; files come from `files.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from .connecting import CONNECTION_FAILURES, open_connection
from .errors import (
    ConnectError,
    ConnectionLostError,
    ExecutorClientError,
    NotFoundError,
    ProtocolError,
    ServerError,
    UnsupportedError,
    server_error,
)
from .protocol import ExecResult, Hello, JsonDict, decode_bytes

log = logging.getLogger("executor_client")

#: Time past a command's own timeout before the executor counts as unresponsive.
RESULT_SLACK = 30.0
#: After a resume, time granted for the result the executor replays.
REPLAY_PATIENCE = 10.0
#: How long a deliberate close may spend taking back a session a lost connection left running.
TAKE_BACK_PATIENCE = 5.0
#: How long the answer to a protocol 1.1 request may take (past any wait it asked for), and
#: the longest pause between two pieces of a download.
REPLY_PATIENCE = 30.0
#: Raw bytes per `write` message: 512 KiB is well under the default 1 MiB `max_message_bytes`
#: once in base64.
CHUNK_BYTES = 512 * 1024

OutputCallback = Callable[[str], object]


@dataclass
class PendingExec:
    """A command sent (or about to be) whose result has not arrived."""

    id: str
    message: JsonDict
    on_output: OutputCallback | None
    future: asyncio.Future[ExecResult]
    deadline: float
    #: Whether the request may have reached the executor.
    sent: bool = False
    #: Next streamed chunk expected; a replay never repeats one, this guards anyway.
    next_seq: int = 0
    callback_errors: list[BaseException] = field(default_factory=list)


@dataclass
class PendingCall:
    """A protocol 1.1 request waiting for its answer.

    The answer carries the request's id (for process requests, the process's), so it is
    matched by id and type. An `error` carries only the id: the executor reads requests in
    order and answers at once all but a `read` or `wait` that waits, so an error goes to the
    first prompt request with that id (or an unanswered `write`, which has no reply of its own
    and whose error is kept for the process's next write), else to the first waiting one.
    """

    id: str
    #: Order of sending, shared with writes.
    seq: int
    replies: frozenset[str]
    future: asyncio.Future[JsonDict]
    ws: ClientConnection
    #: Answered late on purpose (a `read` or `wait` that waits, an upload, a download).
    long_poll: bool = False
    #: Receives a download's pieces, in order.
    on_data: Callable[[bytes], Awaitable[None]] | None = None
    next_seq: int = 0
    #: The request, when it may be sent again after a dropped connection (it only asks).
    again: JsonDict | None = None
    #: The session (`AsyncClient._epoch`) a process request belongs to; None: any.
    epoch: int | None = None
    #: A `spawn`: listed in a resume's `awaiting`, which replays its answer, and sent again
    #: only when the replay shows it never arrived (as `exec`).
    resumable: JsonDict | None = None


class ResumableConnection:
    """A client's connection to an executor and the session on it, kept across breaks.

    Not thread-safe: use it from one event loop.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        ssl_context: ssl.SSLContext | None,
        connect_timeout: float,
        reconnect_attempts: int,
        result_slack: float,
    ) -> None:
        self.url = url
        self._result_slack = result_slack
        self._token = token
        self._ssl = ssl_context
        self._connect_timeout = connect_timeout
        self._reconnect_attempts = max(1, reconnect_attempts)
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._recovery: asyncio.Task[ClientConnection] | None = None
        self._pending: dict[str, PendingExec] = {}
        self._ids = itertools.count(1)
        self._id_prefix = f"py{os.getpid()}-{id(self) & 0xFFFF:x}-"
        self._closed = False
        #: When the connection broke (no close frame), while the session may wait for us.
        self._lost_at: float | None = None
        #: After a resume: the id of a sync message and the requests whose fate it tells.
        self._sync: tuple[str, list[str]] | None = None
        #: Protocol 1.1 requests waiting for answers, by id, in order of sending.
        self._calls: dict[str, list[PendingCall]] = {}
        #: Per process: the send order of writes whose error (if any) has not come yet.
        self._writes: dict[str, list[int]] = {}
        #: Per process: the error of a write, raised by its next write.
        self._write_errors: dict[str, ServerError] = {}
        self._seq = itertools.count()
        #: Counts the sessions this client has had (a fresh one after a failed resume).
        self._epoch = 0
        self.hello: Hello
        #: The session our commands belong to; a resume keeps it.
        self.session = ""
        self.resume_grace = 0.0

    # --- the session -----------------------------------------------------------------------

    def new_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids)}"

    async def close(self) -> None:
        """End the session: a close frame makes the executor kill what still runs at once."""
        if self._closed:
            return
        if self._ws is None and self._may_resume():
            # A lost connection left the session (and maybe commands) running on the
            # executor until its grace ends: take it back, briefly, to end it now.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._connection(), TAKE_BACK_PATIENCE)
        self._closed = True
        ws, self._ws = self._ws, None
        if ws is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), 2.0)
        for task in (self._reader, self._recovery):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self._fail_pending(ConnectionLostError("the client was closed"))
        self._fail_calls(None, ConnectionLostError("the client was closed"))

    @property
    def connected(self) -> bool:
        return self._ws is not None

    def require(self, capability: str) -> None:
        """Raise `UnsupportedError` unless the executor lists `capability` in its hello."""
        if capability not in self.hello.capabilities:
            raise UnsupportedError(capability, self.hello.server, self.hello.capabilities)

    # --- protocol 1.1 requests ------------------------------------------------------------

    def _chunk_bytes(self) -> int:
        """Raw bytes per `write`: base64 grows them by 4/3, and 1 KiB is left for the JSON."""
        limit = self.hello.limits.max_message_bytes or 1 << 20
        return max(3, min(CHUNK_BYTES, (limit - 1024) // 4 * 3))

    async def _call(
        self,
        message: JsonDict,
        replies: Iterable[str],
        *,
        patience: float = REPLY_PATIENCE,
        long_poll: bool = False,
        again: bool = False,
        process: bool = False,
        resumable: bool = False,
    ) -> JsonDict:
        """Send a request and wait for its answer; an `error` raises its `ServerError`.
        `again`: it only asks, so it is sent again after a dropped connection; `process`: it
        names a process of the session, so it fails if the session is not taken back;
        `resumable`: its answer is awaited in a resume (see `PendingCall.resumable`)."""
        ws = await self._connection()
        call = self._open_call(ws, str(message["id"]), replies, long_poll=long_poll)
        call.again = message if again else None
        call.resumable = message if resumable else None
        call.epoch = self._epoch if process or resumable else None
        try:
            try:
                await self._send(ws, message)
            except ConnectionLostError:
                if call.again is None and call.resumable is None:
                    raise
                if self._ws is not ws:
                    # The loss was seen before this call was registered: reconnect for it.
                    self._send_again(call, await self._connection())
            return await self._answer(call, patience)
        finally:
            self._forget(call)

    def _open_call(
        self,
        ws: ClientConnection,
        rid: str,
        replies: Iterable[str],
        *,
        long_poll: bool = False,
        on_data: Callable[[bytes], Awaitable[None]] | None = None,
    ) -> PendingCall:
        call = PendingCall(
            id=rid,
            seq=next(self._seq),
            replies=frozenset(replies),
            future=asyncio.get_running_loop().create_future(),
            ws=ws,
            long_poll=long_poll,
            on_data=on_data,
        )
        self._calls.setdefault(rid, []).append(call)
        return call

    def _forget(self, call: PendingCall) -> None:
        calls = self._calls.get(call.id)
        if calls is not None and call in calls:
            calls.remove(call)
            if not calls:
                del self._calls[call.id]

    async def _send(self, ws: ClientConnection, message: JsonDict) -> None:
        try:
            await ws.send(json.dumps(message))
        except (ConnectionClosed, OSError) as e:
            raise ConnectionLostError(
                f"the connection to the executor at {self.url} broke while sending "
                f"{message.get('type')} {message.get('id')!r}: {e!r}"
            ) from e

    async def _answer(self, call: PendingCall, patience: float) -> JsonDict:
        """The call's answer; a download that goes on delivering pieces may take longer."""
        progress = -1
        while True:
            done, _ = await asyncio.wait({call.future}, timeout=patience)
            if done:
                return call.future.result()
            recovery = self._recovery
            if recovery is not None and not recovery.done():
                # Reconnecting: it ends in bounded time, and sends the call again or fails it.
                await asyncio.wait({recovery})
                continue
            if call.next_seq == progress or call.on_data is None:
                raise ConnectionLostError(
                    f"the executor at {self.url} did not answer {call.id!r} in time"
                )
            progress = call.next_seq

    def _route(
        self, kind: object, rid: str, message: JsonDict
    ) -> tuple[bool, Awaitable[None] | None]:
        """Deliver an answer to a protocol 1.1 request: whether it was one, and for a
        download's piece, the coroutine writing it."""
        calls = self._calls.get(rid, [])
        if kind == "error":
            error = server_error(str(message.get("code", "")), str(message.get("message", "")), rid)
            return self._route_error(rid, calls, error), None
        call = next((c for c in calls if kind in c.replies), None)
        if call is None:
            return False, None
        if kind == "download_data":
            return True, self._piece(call, message)
        writes = self._writes.get(rid)
        if writes:
            # The executor read those writes before this request: none of them failed.
            writes[:] = [seq for seq in writes if seq > call.seq]
            if not writes:
                del self._writes[rid]
        self._forget(call)
        if not call.future.done():
            call.future.set_result(message)
        return True, None

    def _route_error(self, rid: str, calls: list[PendingCall], error: ServerError) -> bool:
        prompt = next((c for c in calls if not c.long_poll), None)
        writes = self._writes.get(rid)
        if writes and (prompt is None or writes[0] < prompt.seq):
            writes.pop(0)
            if not writes:
                del self._writes[rid]
            self._write_errors.setdefault(rid, error)
            return True
        call = prompt or (calls[0] if calls else None)
        if call is None:
            return False
        self._forget(call)
        if not call.future.done():
            call.future.set_exception(error)
        return True

    def _piece(self, call: PendingCall, message: JsonDict) -> Awaitable[None] | None:
        if call.future.done() or call.on_data is None:
            return None
        seq = message.get("seq")
        if seq != call.next_seq:
            call.future.set_exception(
                ProtocolError(f"download {call.id!r}: piece {seq} where {call.next_seq} was due")
            )
            return None
        call.next_seq += 1
        try:
            data = decode_bytes(message.get("data"))
        except ProtocolError as e:
            call.future.set_exception(e)
            return None
        return _deliver(call, call.on_data, data)

    def _fail_calls(
        self, ws: ClientConnection | None, error: ExecutorClientError, *, keep: bool = False
    ) -> None:
        """Fail the requests sent on `ws` (None: all); with `keep`, not those that may be
        sent again (the recovery does that, or fails them)."""
        for calls in list(self._calls.values()):
            for call in list(calls):
                kept = call.again is not None or call.resumable is not None
                if (ws is None or call.ws is ws) and not (keep and kept):
                    self._forget(call)
                    if not call.future.done():
                        call.future.set_exception(error)
        # Errors of writes sent on a dead connection will never come.
        self._writes.clear()

    def _send_again(self, call: PendingCall, ws: ClientConnection) -> None:
        """Send a request that only asks again on a new connection, unless it names a process
        of a session that is gone."""
        if call.future.done() or call.ws is ws:
            return
        if call.resumable is not None and call.epoch == self._epoch:
            return  # awaited in the resume: its answer is replayed, or it is sent again
        if call.again is None or (call.epoch is not None and call.epoch != self._epoch):
            self._forget(call)
            call.future.set_exception(
                ConnectionLostError(
                    "the connection to the executor was lost and its session could not be "
                    "taken back: the session's processes were killed",
                    reconnected=True,
                )
            )
            return
        log.info("sending %s %r again on the new connection", call.again.get("type"), call.id)
        call.ws = ws
        task = asyncio.ensure_future(ws.send(json.dumps(call.again)))
        task.add_done_callback(_consume)

    def _send_calls_again(self, ws: ClientConnection) -> None:
        for calls in list(self._calls.values()):
            for call in list(calls):
                self._send_again(call, ws)

    # --- waiting --------------------------------------------------------------------------

    async def _send_request(self, pending: PendingExec) -> None:
        ws = await self._connection()
        pending.sent = True
        try:
            await ws.send(json.dumps(pending.message))
        except (ConnectionClosed, OSError):
            # It may or may not have reached the executor: the reader sees the drop, and the
            # recovery finds out (see `_after_resume`).
            log.debug("sending %s failed; the recovery decides whether to resend", pending.id)

    async def _wait(self, pending: PendingExec) -> ExecResult:
        asked_again = False
        while True:
            remaining = pending.deadline - time.monotonic()
            if remaining > 0:
                done, _ = await asyncio.wait({pending.future}, timeout=remaining)
                if done:
                    return await self._finish(pending)
                continue
            recovery = self._recovery
            if recovery is not None and not recovery.done():
                # Reconnecting: that ends in bounded time, then the deadline is renewed.
                await asyncio.wait({recovery})
                continue
            ws = self._ws
            if ws is not None and self.resume_grace > 0 and not asked_again:
                # The connection may have died silently (an outage that delivers no FIN or
                # RST) with the result written into it: ask for the session on a new
                # connection, whose replay holds the result if the command finished.
                asked_again = True
                log.info("no result for %s in time; reconnecting to ask again", pending.id)
                ws.transport.abort()
                pending.deadline = time.monotonic() + REPLAY_PATIENCE
                continue
            # Unresponsive: end the session (its commands die) rather than leave it running
            # for a resume nobody will ask for.
            if ws is not None:
                self._ws = None
                self._lost_at = None
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(ws.close(), 2.0)
            raise ConnectionLostError(f"the executor at {self.url} sent no result in time")

    async def _finish(self, pending: PendingExec) -> ExecResult:
        result = pending.future.result()
        if pending.callback_errors:
            raise pending.callback_errors[0]
        return result

    # --- connections ----------------------------------------------------------------------

    async def _open(self) -> tuple[ClientConnection, Hello]:
        """A new connection and its hello."""
        return await open_connection(
            self.url, token=self._token, ssl_context=self._ssl, timeout=self._connect_timeout
        )

    def _adopt(self, ws: ClientConnection, hello: Hello) -> None:
        """Use a new connection as a new session."""
        self.hello = hello
        self.session = hello.session
        self.resume_grace = hello.resume_grace
        self._epoch += 1
        self._start(ws)

    def _start(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._lost_at = None
        self._reader = asyncio.ensure_future(self._read(ws))

    async def _connection(self) -> ClientConnection:
        """The open connection, reconnecting (and resuming) if it is gone."""
        if self._closed:
            raise ExecutorClientError("the client is closed")
        if self._ws is not None:
            return self._ws
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.ensure_future(self._reconnect())
        return await asyncio.shield(self._recovery)

    def _may_resume(self) -> bool:
        return bool(self.session) and self.resume_grace > 0 and self._lost_at is not None

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for text in ws:
                writing = self._dispatch(json.loads(text))
                if writing is not None:
                    # A download's piece: reading on only once it is written is the flow
                    # control that keeps a large download out of memory.
                    await writing
            deliberate = True  # a close frame from the executor ended the iteration
        except ConnectionClosed as e:
            deliberate = e.rcvd is not None
        except (OSError, ValueError) as e:
            log.debug("reading from %s failed: %r", self.url, e)
            deliberate = False
        current = not self._closed and self._ws is ws
        self._fail_calls(
            ws,
            ConnectionLostError(
                f"the connection to the executor at {self.url} ended before it answered"
            ),
            keep=current and not deliberate,
        )
        if not current:
            return
        self._ws = None
        if deliberate:
            # The executor closed the connection on purpose (shutdown, revoked client, a
            # message too large): that ends the session and its commands; no resume.
            self._lost_at = None
            code = ws.close_code
            reason = ws.close_reason or ""
            self._fail_pending(
                ConnectionLostError(
                    f"the executor closed the connection (code {code}{': ' if reason else ''}"
                    f"{reason}); its commands were killed"
                )
            )
            return
        if self._lost_at is None:
            self._lost_at = time.monotonic()
        log.info("lost the connection to %s", self.url)
        if any(p.sent for p in self._pending.values()) or self._calls:
            # Commands or requests are waiting: get them back now, not at their deadline.
            task = self._recovery
            if task is None or task.done():
                self._recovery = asyncio.ensure_future(self._reconnect())
                self._recovery.add_done_callback(_consume)

    def _dispatch(self, message: JsonDict) -> Awaitable[None] | None:
        kind = message.get("type")
        rid = message.get("id")
        if isinstance(rid, str) and (rid in self._calls or rid in self._writes):
            routed, writing = self._route(kind, rid, message)
            if routed:
                return writing
        pending = self._pending.get(rid) if isinstance(rid, str) else None
        if kind == "output":
            seq = message.get("seq")
            data = message.get("data")
            if pending is None or not isinstance(seq, int) or not isinstance(data, str):
                return None
            if seq < pending.next_seq or pending.on_output is None:
                return None
            pending.next_seq = seq + 1
            try:
                pending.on_output(data)
            except Exception as e:  # noqa: BLE001 - handed to the caller of exec
                pending.callback_errors.append(e)
        elif kind == "result":
            if pending is not None and not pending.future.done():
                try:
                    pending.future.set_result(ExecResult.from_json(message))
                except ProtocolError as e:
                    pending.future.set_exception(e)
        elif kind == "error":
            code = str(message.get("code", ""))
            text = str(message.get("message", ""))
            if self._sync is not None and rid == self._sync[0]:
                self._resend_unsure(self._sync[1])
                self._sync = None
            elif code == NotFoundError.code:
                # The answer to a cancel of a command that had ended: nothing to do.
                pass
            elif pending is not None and not pending.future.done():
                pending.future.set_exception(server_error(code, text, rid))
            elif rid is None:
                log.warning("the executor reported an error: %s: %s", code, text)
        return None

    def _fail_pending(self, error: ExecutorClientError, *, only_sent: bool = False) -> None:
        for pending in list(self._pending.values()):
            if only_sent and not pending.sent:
                continue
            if not pending.future.done():
                pending.future.set_exception(error)

    async def _reconnect(self) -> ClientConnection:
        """Connect again with bounded backoff, taking the session back if it may wait for us.

        At least `reconnect_attempts` attempts; while a resume is possible they go on (backoff
        capped at 4 s) until the grace period ends, so an outage shorter than it costs nothing.
        """
        delay = 0.25
        last = "not attempted"
        attempt = 0
        while True:
            if attempt > 0:
                grace_left = (
                    self._lost_at is not None
                    and time.monotonic() - self._lost_at + delay < self.resume_grace
                )
                if attempt >= self._reconnect_attempts and not grace_left:
                    error = ConnectionLostError(
                        f"lost the connection to the executor at {self.url} and could not "
                        f"reconnect: {last}"
                    )
                    self._fail_pending(error, only_sent=True)
                    self._fail_calls(None, error)
                    raise error
                await asyncio.sleep(delay)
                delay = min(delay * 2, 4.0)
            attempt += 1
            try:
                ws, hello = await self._open()
            except ConnectError as e:
                if not e.retry:
                    self._fail_pending(ConnectionLostError(str(e)), only_sent=True)
                    self._fail_calls(None, ConnectionLostError(str(e)))
                    raise
                last = str(e)
                continue
            if not self._may_resume():
                self._fresh(ws, hello, "reconnected")
                return ws
            awaiting = [p.id for p in self._pending.values() if p.sent] + [
                c.id for calls in self._calls.values() for c in calls if c.resumable is not None
            ]
            try:
                running = await self._resume(ws, awaiting)
            except (*CONNECTION_FAILURES, ProtocolError) as e:
                # The resume may have reached the executor (then the session is detached
                # again, with a new grace period): try again.
                last = f"the resume failed: {e!r}"
                with contextlib.suppress(Exception):
                    ws.transport.abort()
                continue
            if running is None:
                self._fresh(ws, hello, f"session {self.session} could not be resumed")
                return ws
            log.info(
                "reconnected to %s and resumed session %s (%d of its commands still running)",
                self.url,
                self.session,
                len(running),
            )
            # The new hello's own session (and its workspace, for per-connection clients)
            # was discarded by the executor: ours goes on.
            self.hello = replace(hello, session=self.session, workspace=self.hello.workspace)
            self._start(ws)
            # Results come from the replay or live, even if a deadline passed meanwhile.
            renewed = time.monotonic() + REPLAY_PATIENCE
            for pending in self._pending.values():
                pending.deadline = max(pending.deadline, renewed)
            self._send_calls_again(ws)
            await self._after_resume(ws, [i for i in awaiting if i not in running])
            return ws

    def _fresh(self, ws: ClientConnection, hello: Hello, why: str) -> None:
        """A new session: whatever the old one ran was killed with it."""
        log.info("%s: %s; starting a new session", self.url, why)
        self._fail_pending(
            ConnectionLostError(
                "the connection to the executor was lost while this command ran; the executor "
                "killed it, so it may have run in part",
                reconnected=True,
            ),
            only_sent=True,
        )
        self._adopt(ws, hello)
        self._send_calls_again(ws)

    async def _resume(self, ws: ClientConnection, awaiting: list[str]) -> list[str] | None:
        """Ask for our session back as the first message on `ws`: the ids still running, or
        None when the executor no longer has it (the connection is then a fresh session)."""
        request = {"type": "resume", "session": self.session, "awaiting": awaiting}

        async def exchange() -> list[str] | None:
            await ws.send(json.dumps(request))
            while True:
                message = json.loads(await ws.recv())
                kind = message.get("type")
                if kind == "resumed" and message.get("session") == self.session:
                    running = message.get("running")
                    return [r for r in running if isinstance(r, str)] if running else []
                if kind == "error" and message.get("id") is None:
                    # `not_found`: expired or unknown (its commands were killed).
                    log.info("resume refused: %s", message.get("message"))
                    return None
                if kind in ("output", "result", "error"):
                    raise ProtocolError(f"a {kind} before the answer to resume")

        return await asyncio.wait_for(exchange(), self._connect_timeout)

    async def _after_resume(self, ws: ClientConnection, unsure: list[str]) -> None:
        """Requests neither running nor answered yet: their results are in the replay that
        follows `resumed`, or they never reached the executor. The executor answers in order
        and replays before it reads our next message, so its `not_found` to a cancel of an id
        nobody uses marks the end of the replay (see `_dispatch`)."""
        if not unsure:
            return
        sync = f"sync-{self.new_id()}"
        self._sync = (sync, unsure)
        with contextlib.suppress(ConnectionClosed, OSError):
            await ws.send(json.dumps({"type": "cancel", "id": sync}))

    def _resend_unsure(self, ids: list[str]) -> None:
        ws = self._ws
        for rid in ids:
            for call in self._calls.get(rid, []):
                if call.resumable is not None and not call.future.done() and ws is not None:
                    log.info("%s never reached the executor; sending it again", rid)
                    call.ws = ws
                    task = asyncio.ensure_future(ws.send(json.dumps(call.resumable)))
                    task.add_done_callback(_consume)
            pending = self._pending.get(rid)
            if pending is None or pending.future.done() or ws is None:
                continue
            log.info("%s never reached the executor; sending it again", rid)
            pending.deadline = max(pending.deadline, time.monotonic() + REPLAY_PATIENCE)
            task = asyncio.ensure_future(ws.send(json.dumps(pending.message)))
            task.add_done_callback(_consume)


async def _deliver(
    call: PendingCall, on_data: Callable[[bytes], Awaitable[None]], data: bytes
) -> None:
    try:
        await on_data(data)
    except Exception as e:  # noqa: BLE001 - handed to the caller of the download
        if not call.future.done():
            call.future.set_exception(e)


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a background task's exception (its waiters got it already)."""
    if not task.cancelled():
        task.exception()
