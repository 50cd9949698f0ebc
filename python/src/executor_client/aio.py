"""The asyncio client: one WebSocket to an executor, any number of commands on it.

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
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from ._version import __version__
from .errors import (
    ConnectError,
    ConnectionLostError,
    ExecutorClientError,
    NotFoundError,
    PinMismatchError,
    ProtocolError,
    ServerError,
    UnsupportedError,
    server_error,
)
from .process import MAX_WAIT, AsyncProcess
from .protocol import (
    PROTOCOL_VERSION,
    DirListing,
    ExecResult,
    FileStat,
    Hello,
    JsonDict,
    ProcessExit,
    ProcessInfo,
    ProcessOutput,
    Transferred,
    decode_bytes,
    encode_bytes,
    exec_request,
)
from .tls import PinRefused, client_context
from .transfer import (
    Destination,
    PipeWriter,
    Source,
    extract_tar,
    opened_sink,
    opened_source,
    write_tar,
)

log = logging.getLogger("executor_client")

#: How long opening a connection and reading its hello may take.
CONNECT_TIMEOUT = 10.0
#: Time past a command's own timeout before the executor counts as unresponsive.
RESULT_SLACK = 30.0
#: After a resume, time granted for the result the executor replays.
REPLAY_PATIENCE = 10.0
#: How long a deliberate close may spend taking back a session a lost connection left running.
TAKE_BACK_PATIENCE = 5.0
#: Largest message accepted from the executor: a result holds up to `max_output_bytes` (1 MiB
#: by default) of output, which JSON escaping can make several times larger.
MAX_INCOMING_BYTES = 64 * 1024 * 1024

#: How long the answer to a protocol 1.1 request may take (past any wait it asked for), and
#: the longest pause between two pieces of a download.
REPLY_PATIENCE = 30.0
#: Raw bytes per `write` message: 512 KiB is well under the default 1 MiB `max_message_bytes`
#: once in base64.
CHUNK_BYTES = 512 * 1024
#: Writes to a process whose fate is not known yet, remembered per process (see `_Call`).
MAX_UNSETTLED_WRITES = 1024

OutputCallback = Callable[[str], object]
#: What a failing connection attempt raises (`asyncio.TimeoutError` is not the built-in one
#: before Python 3.11).
_CONNECTION_FAILURES = (OSError, asyncio.TimeoutError, TimeoutError, ConnectionClosed)


@dataclass
class _Pending:
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
class _Call:
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


def read_token(token: str | None, token_file: str | os.PathLike[str] | None) -> str | None:
    """The bearer token: given, read from a file, or `EXECUTOR_TOKEN`."""
    if token:
        return token.strip()
    if token_file:
        try:
            return Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConnectError(f"cannot read the token file {token_file}: {e}", retry=False) from e
    return os.environ.get("EXECUTOR_TOKEN") or None


def _ssl_context(url: str, fingerprint: str | None, ca_file: str | None) -> ssl.SSLContext | None:
    if url.startswith("wss://"):
        return client_context(fingerprint, ca_file)
    if url.startswith("ws://"):
        if fingerprint or ca_file:
            raise ValueError(
                f"a TLS fingerprint or CA is given but {url} is plain ws://: use wss://"
            )
        return None
    raise ValueError(f"not a WebSocket URL: {url!r} (expected ws://HOST:PORT/v1/ws or wss://...)")


class AsyncClient:
    """A connection to an executor. Open it with `await AsyncClient.connect(url, ...)`.

    Commands may run concurrently (`asyncio.gather` over `exec`), up to the executor's
    `hello.limits.max_commands_per_connection`. Not thread-safe: use it from one event loop.
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
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count(1)
        self._id_prefix = f"py{os.getpid()}-{id(self) & 0xFFFF:x}-"
        self._closed = False
        #: When the connection broke (no close frame), while the session may wait for us.
        self._lost_at: float | None = None
        #: After a resume: the id of a sync message and the requests whose fate it tells.
        self._sync: tuple[str, list[str]] | None = None
        #: Protocol 1.1 requests waiting for answers, by id, in order of sending.
        self._calls: dict[str, list[_Call]] = {}
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

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        tls_fingerprint: str | None = None,
        tls_ca: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        reconnect_attempts: int = 5,
        result_slack: float = RESULT_SLACK,
    ) -> AsyncClient:
        """Connect, read the hello, and check the protocol version.

        `tls_fingerprint` (`sha256:<hex>`, as `executor serve --tls` prints it) pins the
        certificate of a `wss://` executor; `tls_ca` adds a CA file instead. Without `token`
        and `token_file`, `EXECUTOR_TOKEN` is used if set. A lost connection is retried
        `reconnect_attempts` times (and on while the session's grace period lasts); a command
        whose result has not come `result_slack` seconds past its timeout counts as lost.
        """
        client = cls(
            url,
            token=read_token(token, token_file),
            ssl_context=_ssl_context(url, tls_fingerprint, tls_ca),
            connect_timeout=connect_timeout,
            reconnect_attempts=reconnect_attempts,
            result_slack=result_slack,
        )
        ws, hello = await client._open()
        client._adopt(ws, hello)
        return client

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- commands -------------------------------------------------------------------------

    def new_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids)}"

    async def exec(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        profile: str | None = None,
        on_output: OutputCallback | None = None,
        request_id: str | None = None,
    ) -> ExecResult:
        """Run `command` (as `<interpreter> <command>`, `bash -c` by default) and wait for it.

        `on_output(text)` is called with each chunk of output as it is produced (the request
        asks for streaming only then). An `error` reply raises its `ServerError` subclass; a
        result always returns, whatever the command's return code (a timeout is a result
        with `extra["timed_out"]`). `ConnectionLostError` when the connection broke and the
        session could not be taken back.
        """
        if self._closed:
            raise ExecutorClientError("the client is closed")
        rid = request_id or self.new_id()
        if rid in self._pending:
            raise ValueError(f"a command with id {rid!r} is already waiting for its result")
        own = timeout if timeout is not None else self.hello.limits.default_timeout
        wait = own + self._result_slack
        loop = asyncio.get_running_loop()
        pending = _Pending(
            id=rid,
            message=exec_request(
                rid,
                command,
                cwd=cwd,
                env=env,
                timeout=timeout,
                profile=profile,
                stream=on_output is not None,
            ),
            on_output=on_output,
            future=loop.create_future(),
            deadline=time.monotonic() + wait,
        )
        self._pending[rid] = pending
        try:
            await self._send_request(pending)
            pending.deadline = time.monotonic() + wait
            return await self._wait(pending)
        except asyncio.CancelledError:
            # Our caller gave up (a timeout around us, Ctrl-C in the sync client): the
            # command would run on to its own timeout, so ask the executor to kill it.
            ws = self._ws
            if pending.sent and ws is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(ws.send(json.dumps({"type": "cancel", "id": rid})), 2.0)
            raise
        finally:
            self._pending.pop(rid, None)

    async def cancel(self, request_id: str) -> None:
        """Ask the executor to kill a running command's whole tree.

        Its `exec` then returns a result with `extra["cancelled"]`. A command that already
        ended is left alone (the executor's `not_found` is ignored).
        """
        ws = await self._connection()
        with contextlib.suppress(ConnectionClosed, OSError):
            await ws.send(json.dumps({"type": "cancel", "id": request_id}))

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

    # --- processes (protocol 1.1) ---------------------------------------------------------

    def require(self, capability: str) -> None:
        """Raise `UnsupportedError` unless the executor lists `capability` in its hello."""
        if capability not in self.hello.capabilities:
            raise UnsupportedError(capability, self.hello.server, self.hello.capabilities)

    async def spawn(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        profile: str | None = None,
        pty: bool | tuple[int, int] = False,
        request_id: str | None = None,
    ) -> AsyncProcess:
        """Start `command` and keep it: write its stdin, read its output, signal it, wait.

        `pty=(rows, cols)` (or True: 24x80) runs it on a terminal; else stdin is a socket and
        stdout and stderr are one stream. `timeout` defaults to the executor's `max_timeout`.
        """
        self.require("processes")
        rid = request_id or self.new_id()
        message: JsonDict = exec_request(
            rid, command, cwd=cwd, env=env, timeout=timeout, profile=profile, stream=False
        )
        message["type"] = "spawn"
        if pty:
            self.require("pty")
            rows, cols = pty if isinstance(pty, tuple) else (24, 80)
            message["pty"] = {"rows": rows, "cols": cols}
        reply = await self._call(message, ("spawned",), resumable=True)
        return AsyncProcess(self, rid, command, pty=bool(reply.get("pty")))

    async def list_processes(self) -> list[ProcessInfo]:
        """The session's processes, running and ended."""
        self.require("processes")
        message: JsonDict = {"type": "list_processes", "id": self.new_id()}
        reply = await self._call(message, ("processes",), again=True)
        processes = reply.get("processes")
        return [ProcessInfo.from_json(p) for p in processes or [] if isinstance(p, dict)]

    async def _process_write(self, rid: str, data: bytes, *, eof: bool) -> None:
        """Write to a process's stdin in pieces; no answer comes unless it fails."""
        error = self._write_errors.pop(rid, None)
        if error is not None:
            raise error
        if not data and not eof:
            return
        ws = await self._connection()
        size = self._chunk_bytes()
        pieces = [data[i : i + size] for i in range(0, len(data), size)] or [b""]
        for n, piece in enumerate(pieces):
            message: JsonDict = {"type": "write", "id": rid}
            if piece:
                message["data"] = encode_bytes(piece)
            if eof and n == len(pieces) - 1:
                message["eof"] = True
            writes = self._writes.setdefault(rid, [])
            writes.append(next(self._seq))
            del writes[:-MAX_UNSETTLED_WRITES]
            await self._send(ws, message)

    async def _process_read(
        self, rid: str, offset: int, wait: float, max_bytes: int | None
    ) -> ProcessOutput:
        wait = min(max(wait, 0.0), MAX_WAIT)
        message: JsonDict = {"type": "read", "id": rid, "offset": offset}
        if max_bytes is not None:
            message["max_bytes"] = max_bytes
        if wait > 0:
            message["wait"] = wait
        reply = await self._call(
            message,
            ("process_output",),
            patience=wait + REPLY_PATIENCE,
            long_poll=wait > 0,
            again=True,
            process=True,
        )
        return ProcessOutput.from_json(reply)

    async def _process_signal(self, rid: str, name: str, foreground: bool) -> None:
        message: JsonDict = {"type": "signal", "id": rid, "signal": name}
        if foreground:
            message["foreground"] = True
        await self._call(message, ("done",))

    async def _process_resize(self, rid: str, rows: int, cols: int) -> None:
        message: JsonDict = {"type": "resize", "id": rid, "rows": rows, "cols": cols}
        await self._call(message, ("done",), again=True, process=True)

    async def _process_wait(self, rid: str, timeout: float) -> ProcessExit:
        timeout = min(max(timeout, 0.0), MAX_WAIT)
        message: JsonDict = {"type": "wait", "id": rid}
        if timeout > 0:
            message["timeout"] = timeout
        reply = await self._call(
            message,
            ("exited",),
            patience=timeout + REPLY_PATIENCE,
            long_poll=timeout > 0,
            again=True,
            process=True,
        )
        return ProcessExit.from_json(reply)

    # --- files (protocol 1.1) -------------------------------------------------------------

    async def upload(
        self,
        source: Source,
        remote_path: str,
        *,
        mode: int | None = None,
        parents: bool = False,
        profile: str | None = None,
    ) -> Transferred:
        """Write a file on the executor's side from bytes, a local path or a binary file
        object, streamed in pieces. It appears at `remote_path` (relative: to the workspace)
        whole or not at all; `mode` defaults to 0o644, `parents` creates missing directories.
        `DeniedError` when a command could not write there either."""
        self.require("files")
        message = _file_request("upload", self.new_id(), remote_path, profile)
        if mode is not None:
            message["mode"] = mode
        if parents:
            message["parents"] = True
        with opened_source(source) as read:
            return await self._upload(message, read)

    async def download(
        self,
        remote_path: str,
        destination: Destination,
        *,
        offset: int = 0,
        length: int | None = None,
        profile: str | None = None,
    ) -> Transferred:
        """Copy a file (or `length` bytes of it from `offset`) to a local path or a binary
        file object, streamed. A local path is removed again if the download fails."""
        self.require("files")
        message = _file_request("download", self.new_id(), remote_path, profile)
        if offset:
            message["offset"] = offset
        if length is not None:
            message["length"] = length
        with opened_sink(destination) as write:

            async def on_data(data: bytes) -> None:
                write(data)

            return await self._download(message, on_data)

    async def upload_dir(
        self,
        local_dir: str | os.PathLike[str],
        remote_dir: str,
        *,
        parents: bool = False,
        profile: str | None = None,
    ) -> Transferred:
        """Copy a local directory's contents into `remote_dir` as a tar stream made on the fly
        (files, directories, symbolic links; modes kept)."""
        self.require("files")
        self.require("tar")
        if not Path(local_dir).is_dir():
            raise NotADirectoryError(f"not a directory: {local_dir}")
        message = _file_request("upload", self.new_id(), remote_dir, profile)
        message["tar"] = True
        if parents:
            message["parents"] = True
        rfd, wfd = os.pipe()
        producer = asyncio.ensure_future(asyncio.to_thread(write_tar, local_dir, wfd))
        try:
            with open(rfd, "rb") as pipe:  # noqa: PTH123 - a pipe, not a path
                return await self._upload(message, pipe.read, before_eof=lambda: producer)
        finally:
            # A failed upload closed the pipe: the producer ends with EPIPE.
            await asyncio.gather(producer, return_exceptions=True)

    async def download_dir(
        self, remote_dir: str, local_dir: str | os.PathLike[str], *, profile: str | None = None
    ) -> Transferred:
        """Copy a directory's contents into `local_dir` (created if missing), unpacking the
        executor's tar stream as it arrives with tarfile's `data` filter (nothing lands
        outside `local_dir`)."""
        self.require("files")
        self.require("tar")
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        message = _file_request("download", self.new_id(), remote_dir, profile)
        message["tar"] = True
        rfd, wfd = os.pipe()
        extractor = asyncio.ensure_future(asyncio.to_thread(extract_tar, rfd, local_dir))
        pipe = PipeWriter(wfd)

        async def on_data(data: bytes) -> None:
            await asyncio.to_thread(pipe.write, data)

        try:
            result = await self._download(message, on_data)
        except BaseException as e:
            pipe.close()
            (unpacked,) = await asyncio.gather(extractor, return_exceptions=True)
            if isinstance(e, BrokenPipeError) and isinstance(unpacked, Exception):
                raise unpacked from None  # the extractor stopped reading: its reason
            raise
        pipe.close()
        await extractor
        return result

    async def stat(self, remote_path: str, *, profile: str | None = None) -> FileStat:
        """A path's facts (a symbolic link's own); `NotFoundError` when it is missing."""
        self.require("files")
        message = _file_request("stat", self.new_id(), remote_path, profile)
        return FileStat.from_json(await self._call(message, ("file_info",), again=True))

    async def list_dir(self, remote_path: str, *, profile: str | None = None) -> DirListing:
        """A directory's entries, sorted by name."""
        self.require("files")
        message = _file_request("list_dir", self.new_id(), remote_path, profile)
        return DirListing.from_json(await self._call(message, ("dir_listing",), again=True))

    async def _upload(
        self,
        message: JsonDict,
        read: Callable[[int], bytes],
        *,
        before_eof: Callable[[], Awaitable[object]] | None = None,
    ) -> Transferred:
        """Send `upload`, then the content in `write` pieces (read one ahead, so the last
        carries `eof`), then wait for `uploaded`. An error stops the sending at once."""
        rid = str(message["id"])
        ws = await self._connection()
        call = self._open_call(ws, rid, ("uploaded",), long_poll=True)
        try:
            await self._send(ws, message)
            size = self._chunk_bytes()
            piece = await asyncio.to_thread(read, size)
            while not call.future.done():
                following = await asyncio.to_thread(read, size) if piece else b""
                write: JsonDict = {"type": "write", "id": rid}
                if piece:
                    write["data"] = encode_bytes(piece)
                if not following:
                    if before_eof is not None:
                        try:
                            await before_eof()
                        except BaseException:
                            # Never complete a file whose source failed: no `eof`, and a
                            # cancel ends the upload (a failed upload leaves nothing).
                            with contextlib.suppress(ExecutorClientError):
                                await self._send(ws, {"type": "cancel", "id": rid})
                            raise
                    write["eof"] = True
                await self._send(ws, write)
                if not following:
                    break
                piece = following
            return Transferred.from_json(await self._answer(call, REPLY_PATIENCE))
        finally:
            self._forget(call)

    async def _download(
        self, message: JsonDict, on_data: Callable[[bytes], Awaitable[None]]
    ) -> Transferred:
        rid = str(message["id"])
        ws = await self._connection()
        call = self._open_call(
            ws, rid, ("download_data", "downloaded"), long_poll=True, on_data=on_data
        )
        try:
            await self._send(ws, message)
            return Transferred.from_json(await self._answer(call, REPLY_PATIENCE))
        finally:
            self._forget(call)

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
        `resumable`: its answer is awaited in a resume (see `_Call.resumable`)."""
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
    ) -> _Call:
        call = _Call(
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

    def _forget(self, call: _Call) -> None:
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

    async def _answer(self, call: _Call, patience: float) -> JsonDict:
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

    def _route_error(self, rid: str, calls: list[_Call], error: ServerError) -> bool:
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

    def _piece(self, call: _Call, message: JsonDict) -> Awaitable[None] | None:
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

    def _send_again(self, call: _Call, ws: ClientConnection) -> None:
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

    async def _send_request(self, pending: _Pending) -> None:
        ws = await self._connection()
        pending.sent = True
        try:
            await ws.send(json.dumps(pending.message))
        except (ConnectionClosed, OSError):
            # It may or may not have reached the executor: the reader sees the drop, and the
            # recovery finds out (see `_after_resume`).
            log.debug("sending %s failed; the recovery decides whether to resend", pending.id)

    async def _wait(self, pending: _Pending) -> ExecResult:
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

    async def _finish(self, pending: _Pending) -> ExecResult:
        result = pending.future.result()
        if pending.callback_errors:
            raise pending.callback_errors[0]
        return result

    # --- connections ----------------------------------------------------------------------

    async def _open(self) -> tuple[ClientConnection, Hello]:
        """A new connection and its hello."""
        try:
            ws, text = await asyncio.wait_for(self._handshake(), self._connect_timeout)
        except PinRefused as e:
            raise PinMismatchError(e.pinned, e.presented) from None
        except InvalidStatus as e:
            status = e.response.status_code
            refused = (
                ": the token sent is not this executor's (check token_file or EXECUTOR_TOKEN)"
                if self._token
                else ": it requires a token and none was given (token, token_file or "
                "EXECUTOR_TOKEN)"
            )
            hint = {401: refused, 403: " (Origin or Host refused)"}
            raise ConnectError(
                f"the executor at {self.url} refused the connection: HTTP {status}"
                + hint.get(status, ""),
                retry=status not in (401, 403),
            ) from e
        except ssl.SSLCertVerificationError as e:
            raise ConnectError(
                f"the executor at {self.url} presented a certificate that does not verify: "
                f"{e.verify_message or e}",
                retry=False,
            ) from e
        except (*_CONNECTION_FAILURES, InvalidHandshake) as e:
            raise ConnectError(f"cannot connect to the executor at {self.url}: {e!r}") from e
        try:
            hello = Hello.from_json(json.loads(text))
        except (ValueError, ProtocolError) as e:
            await ws.close()
            raise ProtocolError(f"unreadable hello from {self.url}: {e}") from e
        if hello.protocol != PROTOCOL_VERSION:
            await ws.close()
            raise ProtocolError(
                f"the executor at {self.url} speaks protocol {hello.protocol}, "
                f"this client speaks {PROTOCOL_VERSION}"
            )
        return ws, hello

    async def _handshake(self) -> tuple[ClientConnection, str | bytes]:
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        ws = await connect(
            self.url,
            ssl=self._ssl,
            additional_headers=headers,
            user_agent_header=f"executor-client-python/{__version__}",
            # The executor talks plain frames; proxies from the environment are not for it
            # (the Rust agent ignores them too).
            compression=None,
            proxy=None,
            open_timeout=None,
            # No keepalive pings: a sync client runs its loop only during calls, and the
            # executor sends none. A silent outage is noticed at the command's deadline.
            ping_interval=None,
            close_timeout=2,
            max_size=MAX_INCOMING_BYTES,
            # Messages read ahead of us: a download's pieces wait here while one is written,
            # so few (four pieces of 512 KiB) keep a large download out of memory.
            max_queue=4,
        )
        try:
            return ws, await ws.recv()
        except BaseException:
            await ws.close()
            raise

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
            except (*_CONNECTION_FAILURES, ProtocolError) as e:
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


def _file_request(kind: str, rid: str, path: str, profile: str | None) -> JsonDict:
    message: JsonDict = {"type": kind, "id": rid, "path": path}
    if profile:
        message["profile"] = profile
    return message


async def _deliver(call: _Call, on_data: Callable[[bytes], Awaitable[None]], data: bytes) -> None:
    try:
        await on_data(data)
    except Exception as e:  # noqa: BLE001 - handed to the caller of the download
        if not call.future.done():
            call.future.set_exception(e)


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a background task's exception (its waiters got it already)."""
    if not task.cancelled():
        task.exception()
