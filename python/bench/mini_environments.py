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

Every backend runs bash in the profiles' locale (`LANG`/`LC_ALL` = `C.UTF-8`), so that none
is timed with a cheaper bash start than the others. Sequential round trips take turns between
the backends (one command each per round), so a drift of this machine during the run falls
on all alike; "alone" is the same after 100 ms of idleness, as an agent's commands come;
throughput is N processes, each with its own environment, for a fixed time per backend.
Every result is checked (`hi`, return code 0): a backend that fails stops the run.

    python/dev-venv   # the venv with mini-swe-agent from PyPI and this package
    target/python-venv/bin/python python/bench/mini_environments.py \\
        --executor target/static/executor

Needs root (the executor's profiles) and `bwrap` on PATH.
"""

from __future__ import annotations

import argparse
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
    shell: str = "bash"  # the executor's interpreter, for the report's checks
    url: str = ""
    token_file: str = ""
    workdir: str = ""

    def make(self) -> Environment:
        if self.kind == "local":
            return LocalEnvironment(cwd=self.workdir, env=LOCALE)  # type: ignore[no-any-return]
        if self.kind == "bubblewrap":
            return BubblewrapEnvironment(cwd=self.workdir, env=LOCALE)  # type: ignore[no-any-return]
        return ExecutorEnvironment(url=self.url, token_file=self.token_file, profile=self.profile)


@dataclass
class Figures:
    label: str
    p50_ms: float
    p90_ms: float
    p99_ms: float
    alone_p50_ms: float
    clients_cmd_per_s: float


def run_once(env: Environment, label: str) -> float:
    """One round trip, in ms; a wrong result ends the run."""
    start = time.perf_counter()
    result = env.execute(COMMAND)
    elapsed = (time.perf_counter() - start) * 1000
    if result.get("returncode") != 0 or result.get("output") != "hi\n":
        raise SystemExit(f"{label}: `echo hi` returned {result!r}")
    return elapsed


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def taking_turns(
    envs: dict[str, Environment], rounds: int, pause: float, progress: Callable[[int], None]
) -> dict[str, list[float]]:
    """`rounds` round trips per backend, one each per round, `pause` seconds apart."""
    times: dict[str, list[float]] = {label: [] for label in envs}
    for done in range(rounds):
        for label, env in envs.items():
            if pause:
                time.sleep(pause)
            times[label].append(run_once(env, label))
        progress(done + 1)
    return times


def client(backend: Backend, start_at: float, duration: float) -> int:
    """A client process: its own environment, round trips from `start_at` for `duration`."""
    env = backend.make()
    run_once(env, backend.label)  # connected and warm before the clock starts
    time.sleep(max(0.0, start_at - time.time()))
    done = 0
    end = time.time() + duration
    while time.time() < end:
        run_once(env, backend.label)
        done += 1
    return done


def throughput(backend: Backend, clients: int, duration: float) -> float:
    """Commands per second from `clients` processes at once."""
    context = multiprocessing.get_context("spawn")
    start_at = time.time() + 3.0 + 0.2 * clients  # time for every client to start and connect
    with context.Pool(clients) as pool:
        counts = pool.starmap(client, [(backend, start_at, duration)] * clients)
    return sum(counts) / duration


LOCAL = "mini LocalEnvironment (sh -c)"
BUBBLEWRAP = "mini BubblewrapEnvironment (bash -c)"


def executor_label(profile: str, shell: str = "bash") -> str:
    return f"ExecutorEnvironment, {profile} ({shell} -c)"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


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
            f"{f.alone_p50_ms:.2f} | {f.clients_cmd_per_s:.0f} |"
        )
    checks = [
        (
            "strict p50 <= 0.5x mini's bubblewrap",
            strict.p50_ms / bwrap.p50_ms <= 0.5,
            ratio(strict.p50_ms, bwrap.p50_ms),
        ),
        (
            "strict p99 <= 3x its p50",
            strict.p99_ms / strict.p50_ms <= 3,
            ratio(strict.p99_ms, strict.p50_ms),
        ),
        (
            "landlock p99 <= 3x its p50",
            landlock.p99_ms / landlock.p50_ms <= 3,
            ratio(landlock.p99_ms, landlock.p50_ms),
        ),
        (
            f"strict, {args.clients} clients >= 3x mini's bubblewrap",
            strict.clients_cmd_per_s >= 3 * bwrap.clients_cmd_per_s,
            ratio(strict.clients_cmd_per_s, bwrap.clients_cmd_per_s),
        ),
        (
            f"landlock, {args.clients} clients >= 3x mini's bubblewrap",
            landlock.clients_cmd_per_s >= 3 * bwrap.clients_cmd_per_s,
            ratio(landlock.clients_cmd_per_s, bwrap.clients_cmd_per_s),
        ),
        (
            "landlock p50 within 1.1x mini's local (bash -c against sh -c)",
            landlock.p50_ms / local.p50_ms <= 1.1,
            ratio(landlock.p50_ms, local.p50_ms),
        ),
        (
            "landlock p50 within 1.1x mini's local (both sh -c)",
            landlock_sh.p50_ms / local.p50_ms <= 1.1,
            ratio(landlock_sh.p50_ms, local.p50_ms),
        ),
    ]
    lines += ["", "| issue 14's target, in this frame | figure | met |", "|---|---:|---|"]
    lines += [f"| {name} | {figure} | {'yes' if met else 'no'} |" for name, met, figure in checks]
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
    if not Path(args.executor).is_file():
        parser.error(f"no executor at {args.executor} (.ci/build-static builds it)")

    def say(message: str) -> None:
        print(f"mini-bench: {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="mini-bench-") as workdir:
        Path(workdir).chmod(0o755)
        daemons: dict[str, LocalExecutor] = {}
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
            envs = {b.label: b.make() for b in backends}
            for label, env in envs.items():
                run_once(env, label)
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
                rate = throughput(backend, args.clients, args.duration)
                times = seq[backend.label]
                figures.append(
                    Figures(
                        backend.label,
                        statistics.median(times),
                        percentile(times, 0.90),
                        percentile(times, 0.99),
                        statistics.median(alone[backend.label]),
                        rate,
                    )
                )
        finally:
            for daemon in daemons.values():
                daemon.stop()
    print(report(figures, args))
    if args.json:
        args.json.write_text(json.dumps([asdict(f) for f in figures], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
