"""Shared test harness: real `executor serve` daemons, a TCP proxy that can cut connections,
and checks on the host's processes.

The binaries come from `EXECUTOR_BIN` / `EXECUTOR_AGENT_BIN` (the Rust test that runs this
suite sets them), else from the repository's `target/debug/`. Tests need root, as the
executor's own tests do. As in the Rust suites (tests/src/skips.rs), a missing precondition
fails the test unless `EXECUTOR_TESTS_ALLOW_SKIPS=1`; a skip is then appended to
`EXECUTOR_TESTS_SKIPS_FILE` when set (the Rust test that runs this suite sets it, and the test
command lists the skips at its end). `EXECUTOR_TESTS_STRICT=1` (CI) forbids skips even then, so
CI can never pass by skipping.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import pytest

from executor_client import AsyncClient, Client

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

REPO = Path(__file__).resolve().parents[2]
ALL_PROFILES = ("strict", "landlock", "task-container", "trusted")
PATIENCE = 20.0


def require(what: str, available: bool) -> None:
    """Fail when a precondition is missing, or skip (recorded) when skips are allowed."""
    if available:
        return
    if os.environ.get("EXECUTOR_TESTS_STRICT") == "1":
        pytest.fail(f"EXECUTOR_TESTS_STRICT=1 and {what} is missing")
    if os.environ.get("EXECUTOR_TESTS_ALLOW_SKIPS") != "1":
        pytest.fail(
            f"{what} is missing (tests/setup installs what the suites need; "
            "EXECUTOR_TESTS_ALLOW_SKIPS=1 lets such tests skip)"
        )
    record = os.environ.get("EXECUTOR_TESTS_SKIPS_FILE")
    if record:
        test = os.environ.get("PYTEST_CURRENT_TEST", "(unknown)").split(" ")[0]
        line = f"python::{test}\t{what}".replace("\n", " ") + "\n"
        with Path(record).open("a", encoding="utf-8") as f:
            f.write(line)
    pytest.skip(f"{what} is missing")


def binary(name: str, variable: str) -> str:
    path = os.environ.get(variable) or str(REPO / "target" / "debug" / name)
    require(
        f"the {name} binary ({path}; build it with `cargo build -p executor -p agent`)",
        Path(path).is_file(),
    )
    return path


@pytest.fixture(scope="session")
def executor_bin() -> str:
    require("root", os.geteuid() == 0)
    return binary("executor", "EXECUTOR_BIN")


@pytest.fixture(scope="session")
def agent_bin() -> str:
    return binary("agent", "EXECUTOR_AGENT_BIN")


@pytest.fixture(autouse=True)
def _binaries_on_path(executor_bin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `ExecutorEnvironment` finds by itself: `EXECUTOR_BIN`."""
    monkeypatch.setenv("EXECUTOR_BIN", executor_bin)


def shared_dir(prefix: str = "pytest-exec-") -> str:
    """A directory the sandbox's unprivileged identity (uid 65534) can write."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    Path(path).chmod(0o777)
    return path


@pytest.fixture
def workdir() -> Iterator[str]:
    path = shared_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Daemon:
    """A real `executor serve` on a loopback port, with its own state directory."""

    process: subprocess.Popen[bytes]
    url: str
    state_dir: str
    workspace: str
    fingerprint: str | None
    log_path: Path
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def token_file(self) -> str:
        return str(Path(self.state_dir) / "token")

    @property
    def port(self) -> int:
        return int(self.url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])

    def connect(self, **options: Any) -> Client:
        """A client of this daemon, with its token."""
        return Client.connect(self.url, token_file=self.token_file, **options)

    async def connect_async(self, **options: Any) -> AsyncClient:
        """An asyncio client of this daemon, with its token."""
        return await AsyncClient.connect(self.url, token_file=self.token_file, **options)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.state_dir, ignore_errors=True)
        shutil.rmtree(self.workspace, ignore_errors=True)


def start_daemon(
    executor: str,
    *args: str,
    tls: bool = False,
    resume_grace: float = 0,
    profiles: tuple[str, ...] = ALL_PROFILES,
) -> Daemon:
    state = tempfile.mkdtemp(prefix="pytest-state-", dir="/tmp")
    Path(state).chmod(0o700)
    workspace = shared_dir("pytest-ws-")
    log_path = Path(state) / "serve.log"
    argv = [
        executor,
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--state-dir",
        state,
        "--workspace",
        workspace,
        "--resume-grace",
        f"{resume_grace:g}",
    ]
    for name in profiles:
        argv += ["--allow-profile", name]
    if tls:
        argv.append("--tls")
    argv += list(args)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL
        )
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], PATIENCE)
    line = process.stdout.readline().decode() if ready else ""
    process.stdout.close()
    if not line.startswith("executor listening on "):
        process.kill()
        raise RuntimeError(f"executor did not start: {line!r}\n{log_path.read_text()}")
    words = line.split()
    fingerprint = words[words.index("tls-fingerprint") + 1] if "tls-fingerprint" in words else None
    return Daemon(process, words[3], state, workspace, fingerprint, log_path)


@pytest.fixture
def daemon_factory(executor_bin: str) -> Iterator[object]:
    started: list[Daemon] = []

    def start(*args: str, **kwargs: object) -> Daemon:
        daemon = start_daemon(executor_bin, *args, **kwargs)  # type: ignore[arg-type]
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()


@pytest.fixture(scope="module")
def daemon(executor_bin: str) -> Iterator[Daemon]:
    """One daemon for a module's tests that do not change its state."""
    started = start_daemon(executor_bin)
    yield started
    started.stop()


class Proxy:
    """Forwards loopback connections to `target`, and simulates outages on them: `cut()`
    resets both sockets of every current link (no WebSocket close frame); `refusing` drops new
    connections at once; `drop_requests` discards what clients send (a request lost in the
    break), `drop_replies` what the daemon sends (an answer lost in the break); `stall()`
    stops forwarding on the current links without closing anything (an outage that delivers
    nothing). The Rust harness has the same (`tests/src/proxy.rs`)."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.links: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        self.accepted = 0
        self.refusing = False
        self.drop_requests = False
        self.drop_replies = False
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            if self.refusing:
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:
                _reset(client)
                continue
            stalled = threading.Event()
            with self._lock:
                self.links.append((client, server, stalled))
            for source, sink, upstream in ((client, server, True), (server, client, False)):
                threading.Thread(
                    target=self._pump, args=(source, sink, upstream, stalled), daemon=True
                ).start()

    def _pump(
        self, source: socket.socket, sink: socket.socket, upstream: bool, stalled: threading.Event
    ) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                with contextlib.suppress(OSError):
                    sink.shutdown(socket.SHUT_WR)
                return
            while stalled.is_set() and not self._closed:
                time.sleep(0.05)
            if upstream and self.drop_requests:
                continue
            if not upstream and self.drop_replies:
                continue
            try:
                sink.sendall(data)
            except OSError:
                return

    @contextlib.contextmanager
    def cut_after(self, delay: float) -> Iterator[None]:
        """Cut every link `delay` seconds into the block (while a call in it waits)."""
        timer = threading.Timer(delay, self.cut)
        timer.start()
        try:
            yield
        finally:
            timer.join()

    def cut(self) -> int:
        """Reset every current link; how many there were."""
        with self._lock:
            links, self.links = self.links, []
        for client, server, _ in links:
            _reset(client)
            _reset(server)
        return len(links)

    def stall(self) -> int:
        """Stop forwarding on every current link, closing nothing; how many there were."""
        with self._lock:
            for _, _, stalled in self.links:
                stalled.set()
            return len(self.links)

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        self.cut()


def _reset(sock: socket.socket) -> None:
    """Drop a connection with no WebSocket close frame, as a broken route does. `shutdown`
    first: a plain `close` would not wake the pump blocked in `recv` on it, and the kernel
    would keep the connection open until that returns."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


@pytest.fixture
def proxy_factory() -> Iterator[object]:
    proxies: list[Proxy] = []

    def start(port: int) -> Proxy:
        proxy = Proxy(port)
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        proxy.close()


@dataclass
class Cuttable:
    """A daemon reached only through a `Proxy` the test cuts, stalls or makes refuse."""

    daemon: Daemon
    proxy: Proxy

    def connect(self, **options: Any) -> Client:
        """A client of the daemon through the proxy."""
        return Client.connect(self.proxy.url(), token_file=self.daemon.token_file, **options)

    async def connect_async(self, **options: Any) -> AsyncClient:
        return await AsyncClient.connect(
            self.proxy.url(), token_file=self.daemon.token_file, **options
        )


@pytest.fixture
def cuttable_daemon(daemon_factory: Any, proxy_factory: Any) -> Callable[..., Cuttable]:
    """Starts a daemon (with the given `resume_grace`) behind a proxy of its own."""

    def start(*, resume_grace: float) -> Cuttable:
        daemon = daemon_factory(resume_grace=resume_grace)
        return Cuttable(daemon, proxy_factory(daemon.port))

    return start


@pytest.fixture
def client_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """The client's log (logger `executor_client`) from INFO up, as `caplog.text`."""
    caplog.set_level(logging.INFO, logger="executor_client")
    return caplog


T = TypeVar("T")


class Background(Generic[T]):
    """A blocking call running in a thread of its own, while the test acts on the link."""

    def __init__(self, call: Callable[[], T]) -> None:
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(call,))
        self._thread.start()

    def _run(self, call: Callable[[], T]) -> None:
        try:
            self._value = call()
        except BaseException as e:  # noqa: BLE001 - handed to the test by `result`/`error`
            self._error = e

    def _join(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"the call in the background did not return in {timeout} s")

    def result(self, timeout: float) -> T:
        """Its return value; the call's own exception if it raised one."""
        self._join(timeout)
        if self._error is not None:
            raise AssertionError(f"the call in the background raised {self._error!r}") from (
                self._error
            )
        return self._value  # type: ignore[return-value]

    def error(self, timeout: float) -> BaseException | None:
        """What it raised (None: it returned)."""
        self._join(timeout)
        return self._error


def processes_with(marker: str) -> list[int]:
    """Pids of the host's processes whose command line contains `marker`."""
    needle = marker.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline.replace(b"\0", b" ") and state != "Z":
            found.append(int(entry.name))
    return found


def wait_until(predicate: object, timeout: float = PATIENCE, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
