"""`echo hi` through mini-swe-agent's `execute`: mini's own environments beside
`ExecutorEnvironment`, measured in one run.

Issue 14's first table was measured this way (a Python client, against mini-swe-agent's
environments); `executor-bench` measures the same against a bare spawn from Rust and `bwrap`
with strict's namespaces, a harder frame. This script is the frame a mini user sees when they
change `environment_class`:

- mini's `LocalEnvironment` (no isolation) and `BubblewrapEnvironment` (its experimental
  bwrap wrapper: mounts and a user namespace, no pid or network namespace), each command a
  `subprocess` from this process;
- `ExecutorEnvironment` with `landlock` and with `strict`, against one `executor serve`
  started here (as a lab's shared sandbox is used: one daemon, a connection per client);
- `ExecutorEnvironment` with `landlock` against a second daemon whose interpreter is `sh -c`:
  mini's `LocalEnvironment` runs commands through `subprocess`'s `shell=True`, that is
  `/bin/sh` (dash on Debian, about half a bash start), so this row compares the same shell.

Every backend runs its shell in the profiles' locale (`LANG`/`LC_ALL` = `C.UTF-8`), so that
none is timed with a cheaper start than the others. Sequential round trips take turns between
the backends (one command each per round, the order rotated every round, as the executor
builds its next sandbox while the commands after it run), so a drift of this machine during
the run falls on all alike; "alone" is the same after 100 ms of idleness, as an agent's
commands come; throughput is N processes, each with its own environment, counting the
commands they finish within one window per backend. Every result is checked (`hi`, return
code 0; the executor's interpreter too): a backend that fails stops the run (exit status 1).

    python/dev-venv   # the venv with mini-swe-agent and this package (again after editing it)
    target/python-venv/bin/python python/bench/mini_environments.py \\
        --executor "$(.ci/build-static | sed -n 1p)"

Needs root (the executor's profiles) and `bwrap` on PATH.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

from minisweagent.environments.extra.bubblewrap import BubblewrapEnvironment
from minisweagent.environments.local import LocalEnvironment

from executor_client.launch import LocalExecutor
from executor_client.mini import ExecutorEnvironment

#: The locale the shipped profiles give their commands, given to mini's environments too.
LOCALE = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
COMMAND = {"command": "echo hi"}
IDLE_BEFORE_ALONE = 0.1


class BackendFailed(Exception):
    """A backend gave a wrong result or could not be measured: the run stops."""


class Environment(Protocol):
    def execute(
        self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None
    ) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Backend:
    """How to make one backend's environment, in this process or in a client process (so
    it is plain data: the clients are started with `spawn`)."""

    label: str
    kind: str  # local | bubblewrap | executor
    profile: str = ""
    shell: str = "bash"  # the executor's interpreter (checked against its hello)
    url: str = ""
    token_file: str = ""
    workdir: str = ""

    def make(self) -> Environment:
        if self.kind == "local":
            return LocalEnvironment(cwd=self.workdir, env=LOCALE)  # type: ignore[no-any-return]
        if self.kind == "bubblewrap":
            return BubblewrapEnvironment(cwd=self.workdir, env=LOCALE)  # type: ignore[no-any-return]
        env = ExecutorEnvironment(url=self.url, token_file=self.token_file, profile=self.profile)
        if env.hello.interpreter != [self.shell, "-c"]:
            env.close()
            raise BackendFailed(f"{self.label}: the executor runs {env.hello.interpreter}")
        return env


def close(env: Environment) -> None:
    """What the environment holds: the executor's connection, bubblewrap's directory."""
    for name in ("close", "cleanup"):
        method = getattr(env, name, None)
        if callable(method):
            method()
            return


@dataclass
class Figures:
    label: str
    p50_ms: float
    p90_ms: float
    p99_ms: float
    alone_p50_ms: float
    #: Commands/s from the client processes.
    rate: float


def run_once(env: Environment, label: str) -> float:
    """One round trip, in ms; a wrong result ends the run."""
    start = time.perf_counter()
    result = env.execute(COMMAND)
    elapsed = (time.perf_counter() - start) * 1000
    if result.get("returncode") != 0 or result.get("output") != "hi\n":
        raise BackendFailed(f"{label}: `echo hi` returned {result!r}")
    return elapsed


def percentiles(values: list[float]) -> tuple[float, float, float]:
    """p50, p90, p99, interpolated between ranks as `executor-bench` computes them."""
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return statistics.median(values), cuts[89], cuts[98]


def taking_turns(
    envs: dict[str, Environment], rounds: int, pause: float, progress: Callable[[int], None]
) -> dict[str, list[float]]:
    """`rounds` round trips per backend, one each per round, `pause` seconds apart; each
    round starts one backend further on, so none always follows the same one."""
    labels = list(envs)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for done in range(rounds):
        first = done % len(labels)
        for label in labels[first:] + labels[:first]:
            if pause:
                time.sleep(pause)
            times[label].append(run_once(envs[label], label))
        progress(done + 1)
    return times


def client(backend: Backend, start_at: float, end_at: float) -> tuple[int, float]:
    """A client process: its own environment, round trips from `start_at`; how many finished
    by `end_at`, and how late it started (s)."""
    env = backend.make()
    try:
        run_once(env, backend.label)  # connected and warm before the window opens
        late = time.time() - start_at
        time.sleep(max(0.0, -late))
        done = 0
        while True:
            run_once(env, backend.label)
            if time.time() > end_at:
                return done, max(0.0, late)
            done += 1
    finally:
        close(env)


def throughput(backend: Backend, clients: int, duration: float) -> tuple[float, float]:
    """Commands per second from `clients` processes at once, and the latest client's delay
    past the window's start (s)."""
    start_at = time.time() + 3.0 + 0.2 * clients  # time for every client to start and connect
    end_at = start_at + duration
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(clients, mp_context=context) as pool:
        futures = [pool.submit(client, backend, start_at, end_at) for _ in range(clients)]
        try:
            # A client that died (killed, out of memory) breaks the pool: no wait forever.
            results = [f.result(timeout=end_at - time.time() + 60) for f in futures]
        except Exception as e:
            raise BackendFailed(f"{backend.label}: a client process failed: {e!r}") from e
    return sum(done for done, _ in results) / duration, max(late for _, late in results)


LOCAL = "mini LocalEnvironment (sh -c)"
BUBBLEWRAP = "mini BubblewrapEnvironment (bash -c)"


def executor_label(profile: str, shell: str = "bash") -> str:
    return f"ExecutorEnvironment, {profile} ({shell} -c)"


def report(figures: list[Figures], args: argparse.Namespace) -> str:
    by = {f.label: f for f in figures}
    local, bwrap = by[LOCAL], by[BUBBLEWRAP]
    landlock, strict = by[executor_label("landlock")], by[executor_label("strict")]
    landlock_sh = by[executor_label("landlock", "sh")]
    lines = [
        "## `echo hi` through mini-swe-agent's `execute`",
        "",
        f"{os.cpu_count()} cores, Linux {platform.release()}; {args.iterations} round trips "
        f"each taking turns, {args.alone} alone, {args.clients} client processes for "
        f"{args.duration:g} s per backend",
        "",
        f"| backend | p50 ms | p90 ms | p99 ms | alone p50 ms | {args.clients} clients cmd/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for f in figures:
        lines.append(
            f"| {f.label} | {f.p50_ms:.2f} | {f.p90_ms:.2f} | {f.p99_ms:.2f} | "
            f"{f.alone_p50_ms:.2f} | {f.rate:.0f} |"
        )
    n = args.clients
    # (issue 14's target, the figure, its bound, whether the bound is a floor)
    targets = [
        ("strict p50 <= 0.5x mini's bubblewrap", strict.p50_ms / bwrap.p50_ms, 0.5, False),
        ("strict p99 <= 3x its p50", strict.p99_ms / strict.p50_ms, 3, False),
        ("landlock p99 <= 3x its p50", landlock.p99_ms / landlock.p50_ms, 3, False),
        (f"strict, {n} clients >= 3x mini's bubblewrap", strict.rate / bwrap.rate, 3, True),
        (f"landlock, {n} clients >= 3x mini's bubblewrap", landlock.rate / bwrap.rate, 3, True),
        (
            "landlock p50 within 1.1x mini's local (bash -c against sh -c)",
            landlock.p50_ms / local.p50_ms,
            1.1,
            False,
        ),
        (
            "landlock p50 within 1.1x mini's local (both sh -c)",
            landlock_sh.p50_ms / local.p50_ms,
            1.1,
            False,
        ),
    ]
    lines += ["", "| issue 14's target, in this frame | figure | met |", "|---|---:|---|"]
    for name, figure, bound, floor in targets:
        met = figure >= bound if floor else figure <= bound
        lines.append(f"| {name} | {figure:.2f}x | {'yes' if met else 'no'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--executor", default="target/static/executor", help="executor binary")
    parser.add_argument("--iterations", type=int, default=1000, help="round trips per backend")
    parser.add_argument("--alone", type=int, default=30, help="round trips after idleness")
    parser.add_argument("--clients", type=int, default=8, help="client processes at once")
    parser.add_argument("--duration", type=float, default=4, help="seconds of each throughput")
    parser.add_argument("--quick", action="store_true", help="seconds in all, for CI")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.alone, args.duration = 20, 3, 0.5
    if args.iterations < 2 or args.alone < 1 or args.clients < 1 or args.duration <= 0:
        parser.error("--iterations must be 2 or more, --alone and --clients 1 or more")
    if not Path(args.executor).is_file():
        parser.error(f"no executor at {args.executor} (.ci/build-static builds it)")

    def say(message: str) -> None:
        print(f"mini-bench: {message}", file=sys.stderr, flush=True)

    try:
        figures = measure(args, say)
    except BackendFailed as e:
        say(f"stopped: {e}")
        return 1
    print(report(figures, args))
    if args.json:
        args.json.write_text(json.dumps([asdict(f) for f in figures], indent=2))
    return 0


def measure(args: argparse.Namespace, say: Callable[[str], None]) -> list[Figures]:
    """Both daemons started, every backend measured, everything closed again."""
    with tempfile.TemporaryDirectory(prefix="mini-bench-") as workdir:
        # The profiles' commands run as another user (65534), who must enter it.
        Path(workdir).chmod(0o755)
        daemons: dict[str, LocalExecutor] = {}
        envs: dict[str, Environment] = {}
        try:
            for shell in ("bash", "sh"):
                daemons[shell] = LocalExecutor.start(
                    workdir,
                    binary=args.executor,
                    allow_profiles=("landlock", "strict"),
                    extra_args=("--interpreter", f"{shell} -c"),
                )
            backends = [
                Backend(LOCAL, "local", workdir=workdir),
                Backend(BUBBLEWRAP, "bubblewrap", workdir=workdir),
            ] + [
                Backend(
                    executor_label(profile, shell),
                    "executor",
                    profile=profile,
                    shell=shell,
                    url=daemons[shell].url,
                    token_file=daemons[shell].token_file,
                )
                for profile, shell in (("landlock", "bash"), ("strict", "bash"), ("landlock", "sh"))
            ]
            for backend in backends:
                envs[backend.label] = backend.make()
                run_once(envs[backend.label], backend.label)
            step = max(1, args.iterations // 10)

            def progress(done: int) -> None:
                if done % step == 0 or done == args.iterations:
                    say(f"round trips {done}/{args.iterations}")

            seq = taking_turns(envs, args.iterations, 0.0, progress)
            say(f"{args.alone} round trips each after {IDLE_BEFORE_ALONE * 1000:.0f} ms idle")
            alone = taking_turns(envs, args.alone, IDLE_BEFORE_ALONE, lambda _: None)
            figures = []
            for backend in backends:
                say(f"{backend.label}: {args.clients} clients for {args.duration:g} s")
                rate, late = throughput(backend, args.clients, args.duration)
                if late > 0.05:
                    say(f"{backend.label}: a client started {late * 1000:.0f} ms late")
                p50, p90, p99 = percentiles(seq[backend.label])
                alone_p50 = statistics.median(alone[backend.label])
                figures.append(Figures(backend.label, p50, p90, p99, alone_p50, rate))
            return figures
        finally:
            for env in envs.values():
                close(env)
            for daemon in daemons.values():
                daemon.stop()


if __name__ == "__main__":
    sys.exit(main())
