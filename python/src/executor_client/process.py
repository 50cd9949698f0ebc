"""A process spawned with `AsyncClient.spawn` (protocol 1.1): its stdin, its output (kept by
the executor in a bounded buffer and read by offset), signals, terminal size and end."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Protocol

from .protocol import ProcessExit, ProcessOutput

#: The longest wait the executor grants one `read` or `wait` request; longer waits repeat it.
MAX_WAIT = 60.0


class ProcessCalls(Protocol):
    """What a process asks of its client's connection (`AsyncClient` is one): named here, below
    the client, so that this module needs nothing of it."""

    async def _process_write(self, rid: str, data: bytes, *, eof: bool) -> None: ...

    async def _process_read(
        self, rid: str, offset: int, wait: float, max_bytes: int | None
    ) -> ProcessOutput: ...

    async def _process_signal(self, rid: str, name: str, foreground: bool) -> None: ...

    async def _process_resize(self, rid: str, rows: int, cols: int) -> None: ...

    async def _process_wait(self, rid: str, timeout: float) -> ProcessExit: ...


class AsyncProcess:
    """A running (or ended) process of the session. Calls go over the client's connection."""

    def __init__(self, client: ProcessCalls, process_id: str, command: str, *, pty: bool) -> None:
        self._client = client
        self.id = process_id
        self.command = command
        #: Whether it runs on a terminal.
        self.pty = pty
        #: Where the next `read` without an offset starts: the end of what was read so far.
        self.offset = 0
        #: Bytes of output that fell out of the executor's buffer before they were read.
        self.dropped = 0
        #: How it ended, once a `wait` saw it end.
        self.exit: ProcessExit | None = None

    def __repr__(self) -> str:
        return f"<AsyncProcess {self.id} {self.command!r}>"

    @property
    def returncode(self) -> int | None:
        """The exit code once `wait` saw the process end, else None."""
        return None if self.exit is None else self.exit.returncode

    async def write(self, data: bytes | str) -> None:
        """Send bytes (str: UTF-8) to its stdin. No answer comes: a failed write (the process
        ended; `BusyError` when it leaves 64 writes or 4 MiB unread) raises at the next
        `write` or `close_stdin`."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        await self._client._process_write(self.id, raw, eof=False)

    async def close_stdin(self) -> None:
        """End its input (on a terminal: the end-of-file character, as Ctrl-D)."""
        await self._client._process_write(self.id, b"", eof=True)

    async def read(
        self, offset: int | None = None, *, wait: float = 0.0, max_bytes: int | None = None
    ) -> ProcessOutput:
        """Output from `offset` (default: where the last read ended), waiting up to `wait`
        seconds (at most 60) for some when there is none yet."""
        start = self.offset if offset is None else offset
        chunk = await self._client._process_read(self.id, start, wait, max_bytes)
        self.offset = chunk.next_offset
        self.dropped += chunk.dropped
        return chunk

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.output()

    async def output(self, *, wait: float = MAX_WAIT) -> AsyncIterator[bytes]:
        """The output from `offset` on, piece by piece as it comes, until it ends."""
        while True:
            chunk = await self.read(wait=wait)
            if chunk.data:
                yield chunk.data
            if chunk.eof:
                return

    async def signal(self, name: str = "INT", *, foreground: bool = False) -> None:
        """Send `INT`, `TERM`, `KILL`, `HUP`, ... to its whole tree, or with `foreground` to
        its terminal's foreground process group only (what Ctrl-C reaches)."""
        await self._client._process_signal(self.id, name, foreground)

    async def resize(self, rows: int, cols: int) -> None:
        """Set its terminal's size (the process gets SIGWINCH)."""
        await self._client._process_resize(self.id, rows, cols)

    async def wait(self, timeout: float | None = None) -> ProcessExit:
        """Wait for it to end (`timeout` None: for as long as it takes). The answer says
        `running` if it still runs when `timeout` passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = MAX_WAIT if deadline is None else max(0.0, deadline - time.monotonic())
            ended = await self._client._process_wait(self.id, min(left, MAX_WAIT))
            if not ended.running:
                self.exit = ended
                return ended
            if deadline is not None and time.monotonic() >= deadline:
                return ended
