"""The asyncio client: one WebSocket to an executor, any number of commands on it.

`AsyncClient` is built in layers, each in a module of its own: `connecting.py` opens a
connection (TLS, token, hello); `session.py` keeps the session across breaks (reconnect,
resume, routing what comes in; its docstring tells how commands and requests survive a
break); `files.py` adds protocol 1.1's file requests; this module adds commands and
processes, and the class users open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time

from websockets.exceptions import ConnectionClosed

from .connecting import CONNECT_TIMEOUT, MAX_INCOMING_BYTES, read_token, ssl_context_for
from .errors import ExecutorClientError
from .files import FileTransfers
from .process import MAX_WAIT, AsyncProcess
from .protocol import (
    ExecResult,
    JsonDict,
    NetworkSpec,
    ProcessExit,
    ProcessInfo,
    ProcessOutput,
    encode_bytes,
    exec_request,
)
from .session import (
    CHUNK_BYTES,
    REPLAY_PATIENCE,
    REPLY_PATIENCE,
    RESULT_SLACK,
    TAKE_BACK_PATIENCE,
    OutputCallback,
    PendingExec,
    log,
)

# What this module offered before its parts moved out (`connecting`, `session`, `files`).
__all__ = [
    "CHUNK_BYTES",
    "CONNECT_TIMEOUT",
    "MAX_INCOMING_BYTES",
    "MAX_UNSETTLED_WRITES",
    "REPLAY_PATIENCE",
    "REPLY_PATIENCE",
    "RESULT_SLACK",
    "TAKE_BACK_PATIENCE",
    "AsyncClient",
    "OutputCallback",
    "log",
    "read_token",
]

#: Writes to a process whose fate is not known yet, remembered per process (see `PendingCall`).
MAX_UNSETTLED_WRITES = 1024


class AsyncClient(FileTransfers):
    """A connection to an executor. Open it with `await AsyncClient.connect(url, ...)`.

    Commands may run concurrently (`asyncio.gather` over `exec`), up to the executor's
    `hello.limits.max_commands_per_connection`. Not thread-safe: use it from one event loop.
    """

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
            ssl_context=ssl_context_for(url, tls_fingerprint, tls_ca),
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
        network: NetworkSpec | None = None,
    ) -> ExecResult:
        """Run `command` (as `<interpreter> <command>`, `bash -c` by default) and wait for it.

        `network` narrows the network this client is granted for this command (never widens
        it): `Network.none()`, `Network.policy(allow=["pypi.org:443"], deny=[...])`, `"host"`,
        or the protocol's dict. Its shape is checked here (`ValueError`, `TypeError`), its
        rules by the executor (`BadRequestError` naming the rule); a policy the executor
        cannot enforce under the profile is refused, never run with another network.
        `result.isolation.network` says what the command ran with.

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
        pending = PendingExec(
            id=rid,
            message=exec_request(
                rid,
                command,
                cwd=cwd,
                env=env,
                timeout=timeout,
                profile=profile,
                stream=on_output is not None,
                network=network,
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

    # --- processes (protocol 1.1) ---------------------------------------------------------

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
        network: NetworkSpec | None = None,
    ) -> AsyncProcess:
        """Start `command` and keep it: write its stdin, read its output, signal it, wait.

        `pty=(rows, cols)` (or True: 24x80) runs it on a terminal; else stdin is a socket and
        stdout and stderr are one stream. `timeout` defaults to the executor's `max_timeout`.
        `network` as for `exec`.
        """
        self.require("processes")
        rid = request_id or self.new_id()
        message: JsonDict = exec_request(
            rid,
            command,
            cwd=cwd,
            env=env,
            timeout=timeout,
            profile=profile,
            stream=False,
            network=network,
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
        message: JsonDict = {"type": "read", "id": rid, "offset": offset}
        if max_bytes is not None:
            message["max_bytes"] = max_bytes
        reply = await self._waiting_call(message, "process_output", "wait", wait)
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
        message: JsonDict = {"type": "wait", "id": rid}
        return ProcessExit.from_json(
            await self._waiting_call(message, "exited", "timeout", timeout)
        )

    async def _waiting_call(
        self, message: JsonDict, reply: str, wait_field: str, wait: float
    ) -> JsonDict:
        """A process request the executor may hold up to `wait` seconds (at most `MAX_WAIT`,
        sent as `wait_field`) before it answers: a `read` for output, a `wait` for the end."""
        wait = min(max(wait, 0.0), MAX_WAIT)
        if wait > 0:
            message[wait_field] = wait
        return await self._call(
            message,
            (reply,),
            patience=wait + REPLY_PATIENCE,
            long_poll=wait > 0,
            again=True,
            process=True,
        )
