"""The blocking client: `AsyncClient` driven by an event loop of its own.

Each `Client` owns a private event loop and runs it in the calling thread for the length of
each call, so output callbacks run in the caller's thread and no thread is started. Clients
share nothing, so one client per thread is safe (mini-swe-agent's batch runs one environment
per worker thread). Calls on one client from several threads are serialised by a lock, except
`cancel`, which may come from another thread while `exec` runs there (a Ctrl-C handler).
Not usable from inside a running event loop: use `AsyncClient` there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from .aio import CONNECT_TIMEOUT, RESULT_SLACK, AsyncClient, OutputCallback
from .process import MAX_WAIT, AsyncProcess
from .protocol import (
    DirListing,
    ExecResult,
    FileStat,
    Hello,
    NetworkSpec,
    ProcessExit,
    ProcessInfo,
    ProcessOutput,
    Transferred,
)
from .transfer import Destination, Source

T = TypeVar("T")


class Client:
    """A connection to an executor. `Client.connect(url, token_file=...)`, then `exec`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, inner: AsyncClient) -> None:
        self._loop = loop
        self._inner = inner
        self._lock = threading.Lock()

    @classmethod
    def connect(
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
    ) -> Client:
        """Connect and read the hello; see `AsyncClient.connect`."""
        loop = asyncio.new_event_loop()
        try:
            inner = loop.run_until_complete(
                AsyncClient.connect(
                    url,
                    token=token,
                    token_file=token_file,
                    tls_fingerprint=tls_fingerprint,
                    tls_ca=tls_ca,
                    connect_timeout=connect_timeout,
                    reconnect_attempts=reconnect_attempts,
                    result_slack=result_slack,
                )
            )
        except BaseException:
            loop.close()
            raise
        return cls(loop, inner)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        return self._inner.url

    @property
    def hello(self) -> Hello:
        """The hello of the session (after a resume: the new connection's, with our session)."""
        return self._inner.hello

    @property
    def session(self) -> str:
        return self._inner.session

    @property
    def closed(self) -> bool:
        return self._loop.is_closed()

    def new_id(self) -> str:
        return self._inner.new_id()

    def exec(
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
        """Run `command` and wait for its result; see `AsyncClient.exec` (`network` included:
        `Network.policy(allow=[...])`, `Network.none()`, ...)."""
        return self._run(
            self._inner.exec(
                command,
                cwd=cwd,
                env=env,
                timeout=timeout,
                profile=profile,
                on_output=on_output,
                request_id=request_id,
                network=network,
            )
        )

    def cancel(self, request_id: str) -> None:
        """Kill a running command's tree; callable from another thread while `exec` waits."""
        if self._lock.acquire(blocking=False):
            try:
                self._run_locked(self._inner.cancel(request_id))
            finally:
                self._lock.release()
            return
        # `exec` holds the loop in another thread: hand the cancel to it.
        with contextlib.suppress(RuntimeError):  # the loop was closed meanwhile
            asyncio.run_coroutine_threadsafe(self._inner.cancel(request_id), self._loop)

    def require(self, capability: str) -> None:
        """Raise `UnsupportedError` unless the executor offers `capability`."""
        self._inner.require(capability)

    def spawn(
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
    ) -> Process:
        """Start `command` and keep it; see `AsyncClient.spawn`."""
        inner = self._run(
            self._inner.spawn(
                command,
                cwd=cwd,
                env=env,
                timeout=timeout,
                profile=profile,
                pty=pty,
                request_id=request_id,
                network=network,
            )
        )
        return Process(self, inner)

    def list_processes(self) -> list[ProcessInfo]:
        """The session's processes, running and ended."""
        return self._run(self._inner.list_processes())

    def upload(
        self,
        source: Source,
        remote_path: str,
        *,
        mode: int | None = None,
        parents: bool = False,
        profile: str | None = None,
    ) -> Transferred:
        """Write a file from bytes, a local path or a file object; see `AsyncClient.upload`."""
        return self._run(
            self._inner.upload(source, remote_path, mode=mode, parents=parents, profile=profile)
        )

    def download(
        self,
        remote_path: str,
        destination: Destination,
        *,
        offset: int = 0,
        length: int | None = None,
        profile: str | None = None,
    ) -> Transferred:
        """Copy a file to a local path or file object; see `AsyncClient.download`."""
        return self._run(
            self._inner.download(
                remote_path, destination, offset=offset, length=length, profile=profile
            )
        )

    def upload_dir(
        self,
        local_dir: str | os.PathLike[str],
        remote_dir: str,
        *,
        parents: bool = False,
        profile: str | None = None,
    ) -> Transferred:
        """Copy a local directory's contents there as a tar stream."""
        return self._run(
            self._inner.upload_dir(local_dir, remote_dir, parents=parents, profile=profile)
        )

    def download_dir(
        self, remote_dir: str, local_dir: str | os.PathLike[str], *, profile: str | None = None
    ) -> Transferred:
        """Copy a directory's contents into `local_dir`, unpacked as they arrive."""
        return self._run(self._inner.download_dir(remote_dir, local_dir, profile=profile))

    def stat(self, remote_path: str, *, profile: str | None = None) -> FileStat:
        return self._run(self._inner.stat(remote_path, profile=profile))

    def list_dir(self, remote_path: str, *, profile: str | None = None) -> DirListing:
        return self._run(self._inner.list_dir(remote_path, profile=profile))

    def close(self) -> None:
        """End the session (its commands are killed) and free the loop. Idempotent."""
        with self._lock:
            if self._loop.is_closed():
                return
            try:
                self._run_locked(self._inner.close())
            finally:
                with contextlib.suppress(Exception):
                    self._loop.run_until_complete(self._loop.shutdown_asyncgens())
                self._loop.close()

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            return self._run_locked(coroutine)

    def _run_locked(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coroutine.close()
            raise RuntimeError("the client is closed")
        task = self._loop.create_task(coroutine)
        try:
            return self._loop.run_until_complete(task)
        except BaseException:
            # KeyboardInterrupt (Ctrl-C) or SystemExit left the call unfinished: cancel it
            # properly, so that a running command is cancelled on the executor too.
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    self._loop.run_until_complete(task)
            raise


class Process:
    """A process spawned with `Client.spawn`; see `AsyncProcess`. Its calls run on the
    client's loop, one at a time like the client's own."""

    def __init__(self, client: Client, inner: AsyncProcess) -> None:
        self._client = client
        self._inner = inner

    def __repr__(self) -> str:
        return f"<Process {self.id} {self.command!r}>"

    @property
    def id(self) -> str:
        return self._inner.id

    @property
    def command(self) -> str:
        return self._inner.command

    @property
    def pty(self) -> bool:
        return self._inner.pty

    @property
    def offset(self) -> int:
        """Where the next `read` without an offset starts."""
        return self._inner.offset

    @property
    def dropped(self) -> int:
        """Bytes of output lost to the executor's bounded buffer before they were read."""
        return self._inner.dropped

    @property
    def exit(self) -> ProcessExit | None:
        return self._inner.exit

    @property
    def returncode(self) -> int | None:
        return self._inner.returncode

    def write(self, data: bytes | str) -> None:
        """Send bytes (str: UTF-8) to its stdin."""
        self._client._run(self._inner.write(data))

    def close_stdin(self) -> None:
        self._client._run(self._inner.close_stdin())

    def read(
        self, offset: int | None = None, *, wait: float = 0.0, max_bytes: int | None = None
    ) -> ProcessOutput:
        """Output from `offset` (default: where the last read ended), waiting up to `wait`."""
        return self._client._run(self._inner.read(offset, wait=wait, max_bytes=max_bytes))

    def __iter__(self) -> Iterator[bytes]:
        return self.output()

    def output(self, *, wait: float = MAX_WAIT) -> Iterator[bytes]:
        """The output from `offset` on, piece by piece as it comes, until it ends."""
        while True:
            chunk = self.read(wait=wait)
            if chunk.data:
                yield chunk.data
            if chunk.eof:
                return

    def signal(self, name: str = "INT", *, foreground: bool = False) -> None:
        self._client._run(self._inner.signal(name, foreground=foreground))

    def resize(self, rows: int, cols: int) -> None:
        self._client._run(self._inner.resize(rows, cols))

    def wait(self, timeout: float | None = None) -> ProcessExit:
        """Wait for it to end; `running` in the answer if `timeout` passed first."""
        return self._client._run(self._inner.wait(timeout))
