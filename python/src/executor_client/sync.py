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
from collections.abc import Coroutine
from typing import Any, TypeVar

from .aio import CONNECT_TIMEOUT, RESULT_SLACK, AsyncClient, OutputCallback
from .protocol import ExecResult, Hello

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
    ) -> ExecResult:
        """Run `command` and wait for its result; see `AsyncClient.exec`."""
        return self._run(
            self._inner.exec(
                command,
                cwd=cwd,
                env=env,
                timeout=timeout,
                profile=profile,
                on_output=on_output,
                request_id=request_id,
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
