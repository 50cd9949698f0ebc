"""Executors this process starts: a local `executor serve`, or an `agent deploy up` deployment.

Both hold the child's stdin as its lifeline: closing it (or this process dying, even by
SIGKILL) makes a local executor drain and exit (`--exit-on-stdin-eof`) and a deployment tear
itself down. Deployment logic lives once, in the Rust agent; this module only runs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .errors import DeploymentError
from .protocol import Network

#: Variables a local executor inherits. Everything else, API keys above all, stays with us.
INHERITED_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TMPDIR",
    "TZ",
    "RUST_LOG",
    "RUST_BACKTRACE",
)
#: Every built-in profile: a local executor is ours alone, so all are ours to choose from (a
#: shared executor offers only the filtered ones unless its operator names the others).
ALL_PROFILES = ("strict", "landlock", "task-container", "trusted")
READY_PREFIX = "executor listening on "


def find_binary(name: str, explicit: str | None, variable: str) -> str:
    """`explicit`, else `$variable`, else `name` on PATH."""
    for candidate in (explicit, os.environ.get(variable)):
        if candidate:
            if Path(candidate).is_file():
                return candidate
            raise DeploymentError(f"{candidate} (for `{name}`) does not exist")
    found = shutil.which(name)
    if found is None:
        raise DeploymentError(
            f"cannot find the `{name}` binary: put it on PATH, set {variable}, or name it in "
            "the configuration (build it with `cargo build -p executor -p agent`)"
        )
    return found


def _read_line(stream: IO[bytes], deadline: float) -> bytes:
    """One line from a child's pipe, or what came before the deadline or EOF."""
    fd = stream.fileno()
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0]


def _first_line(process: subprocess.Popen[bytes], timeout: float) -> bytes:
    """The first line the child prints; we read nothing more (it logs to stderr)."""
    if process.stdout is None:
        return b""
    try:
        return _read_line(process.stdout, time.monotonic() + timeout)
    finally:
        process.stdout.close()


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return text[-limit:]


def _stop(process: subprocess.Popen[bytes], patience: float) -> None:
    """Close the lifeline; SIGTERM, then SIGKILL, if the child outlives `patience`."""
    if process.stdin is not None:
        with contextlib.suppress(OSError):
            process.stdin.close()
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None and process.poll() is None:
            with contextlib.suppress(OSError):
                process.send_signal(sig)
        try:
            process.wait(timeout=patience)
        except subprocess.TimeoutExpired:
            continue
        return


@dataclass
class LocalExecutor:
    """`executor serve` on a free loopback port with a fresh state directory (a fresh token)."""

    process: subprocess.Popen[bytes]
    url: str
    token_file: str
    state_dir: tempfile.TemporaryDirectory[str]
    binary: str

    @classmethod
    def start(
        cls,
        workspace: str,
        *,
        binary: str | None = None,
        allow_profiles: tuple[str, ...] = ALL_PROFILES,
        resume_grace: float = 30,
        start_timeout: float = 20,
        extra_args: tuple[str, ...] = (),
        network: Network | None = None,
    ) -> LocalExecutor:
        """Start it with `workspace` as its default working directory (created if missing).

        A policy `network` becomes the ceiling of its one client, us (`serve --allow-net`):
        without it that ceiling is `host`, and a profile that enforces policies (strict)
        answers a requested policy with no network at all.
        """
        path = find_binary("executor", binary, "EXECUTOR_BIN")
        state = tempfile.TemporaryDirectory(prefix="executor-client-")
        Path(state.name).chmod(0o700)  # only we may read the token it writes there
        log_path = Path(state.name) / "executor.log"
        argv = [path, "serve", "--listen", "127.0.0.1:0", "--state-dir", state.name]
        argv += ["--workspace", workspace, "--exit-on-stdin-eof"]
        # A loopback connection rarely breaks; if ours does, the command survives and we
        # resume it. Free otherwise: our close frame ends the session at once, and if we die
        # the executor does too.
        argv += ["--resume-grace", f"{resume_grace:g}"]
        for name in allow_profiles:
            argv += ["--allow-profile", name]
        if network is not None and network.mode == "policy":
            for rule in network.allow:
                argv += ["--allow-net", rule]
            for rule in network.deny:
                argv += ["--deny-net", rule]
        argv += list(extra_args)
        env = {k: v for k in INHERITED_ENV if (v := os.environ.get(k)) is not None}
        env.setdefault("RUST_LOG", "warn")
        with log_path.open("wb") as log:
            try:
                process = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=env,
                    start_new_session=True,  # a Ctrl-C for us is not for it: we stop it
                )
            except OSError as e:
                state.cleanup()
                raise DeploymentError(f"cannot start {path}: {e}") from e
        line = _first_line(process, start_timeout).decode("utf-8", "replace")
        if not line.startswith(READY_PREFIX):
            _stop(process, 2)
            log_tail = _tail(log_path)
            state.cleanup()
            raise DeploymentError(
                f"the local executor {path} did not start (stdout: {line!r}); its log:\n{log_tail}"
            )
        url = line[len(READY_PREFIX) :].split()[0]
        return cls(process, url, str(Path(state.name) / "token"), state, path)

    def log(self) -> str:
        return _tail(Path(self.state_dir.name) / "executor.log", 100_000)

    def stop(self, patience: float = 5) -> None:
        """Stop it (its commands die with it) and remove its state directory."""
        _stop(self.process, patience)
        with contextlib.suppress(OSError):
            self.state_dir.cleanup()

    def abandon(self) -> None:
        """Close the lifeline without waiting (garbage collection): it drains by itself."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()


@dataclass
class Deployment:
    """An executor started by `agent deploy up ... --json`, torn down when its stdin closes.

    The agent prints one JSON line: `{"url", "token_file", "tls_fingerprint", "deployment",
    "id", "owned"}` (`owned`: started for us alone, every profile ours to choose), or
    `{"error"}` with a non-zero exit; it stays in the foreground until its stdin reaches EOF (or
    SIGTERM), then tears the deployment down.
    """

    process: subprocess.Popen[bytes]
    url: str
    token_file: str | None
    tls_fingerprint: str | None
    deployment: str
    id: str
    log_path: Path
    owned: bool = False

    @classmethod
    def start(
        cls,
        *,
        deploy: str,
        image: str | None,
        agent_binary: str | None = None,
        extra_args: tuple[str, ...] = (),
        start_timeout: float = 600,
    ) -> Deployment:
        path = find_binary("agent", agent_binary, "EXECUTOR_AGENT_BIN")
        argv = [path, "deploy", "up", "--deploy", deploy]
        if image:
            argv += ["--image", image]
        argv += [*extra_args, "--json"]
        log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115 - outlives this function
            prefix="executor-deploy-", suffix=".log", delete=False
        )
        log_path = Path(log_file.name)
        try:
            # The agent's progress goes to a file, not our terminal (mini's batch draws a
            # live progress display there).
            process = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                start_new_session=True,
            )
        except OSError as e:
            raise DeploymentError(f"cannot start {path}: {e}") from e
        finally:
            log_file.close()
        raw = _first_line(process, start_timeout)
        what = f"`{' '.join(argv)}`"
        try:
            answer = json.loads(raw) if raw.strip() else {}
        except ValueError:
            answer = {"error": f"unreadable answer {raw[:500]!r}"}
        if not isinstance(answer, dict):
            answer = {"error": f"unexpected answer {raw[:500]!r}"}
        url = answer.get("url")
        if "error" in answer or not isinstance(url, str):
            _stop(process, 30)
            reason = answer.get("error") or (
                f"exited with {process.returncode}"
                if raw
                else f"printed nothing within {start_timeout:g} s"
            )
            raise DeploymentError(f"{what} failed: {reason}; its log:\n{_tail(log_path)}")
        token_file = answer.get("token_file")
        fingerprint = answer.get("tls_fingerprint")
        return cls(
            process=process,
            url=url,
            token_file=token_file if isinstance(token_file, str) else None,
            tls_fingerprint=fingerprint if isinstance(fingerprint, str) else None,
            deployment=str(answer.get("deployment", deploy)),
            id=str(answer.get("id", "")),
            log_path=log_path,
            owned=answer.get("owned") is True,
        )

    def stop(self, patience: float = 60) -> None:
        """Close its stdin and wait for the teardown (SIGTERM, then SIGKILL, past `patience`)."""
        _stop(self.process, patience)
        with contextlib.suppress(OSError):
            self.log_path.unlink()

    def abandon(self) -> None:
        """Close the lifeline without waiting (garbage collection): it tears down by itself."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
