"""The client library against a real daemon: the hello, exec, streaming, cancel, typed errors,
asyncio concurrency, and one client per thread."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import Daemon, processes_with, wait_until

from executor_client import (
    BadRequestError,
    BusyError,
    Client,
    ConnectError,
    ConnectionLostError,
    DuplicateIdError,
    ExecutorEnvironmentError,
    ProfileDeniedError,
    ServerError,
)
from executor_client.errors import ERRORS, NotFoundError, server_error


def test_hello_reports_the_executor_hosts_facts(daemon):
    with daemon.connect() as client:
        hello = client.hello
        uname = os.uname()
        assert hello.protocol == 1
        assert hello.server.startswith("executor ")
        # The daemon runs here, so its host is ours.
        assert hello.host.kernel == f"{uname.sysname} {uname.release}"
        assert (hello.host.system, hello.host.release) == (uname.sysname, uname.release)
        assert hello.host.version == uname.version
        assert hello.host.arch == uname.machine == platform.machine()
        assert hello.host.cores == os.cpu_count()
        assert re.fullmatch(r"[0-9a-f]{32}", hello.session)
        assert client.session == hello.session
        assert hello.interpreter == ["bash", "-c"]
        assert hello.workspace == daemon.workspace
        assert hello.default_profile == "strict"
        assert {"strict", "landlock", "trusted"} <= {p.name for p in hello.profiles}
        strict = hello.profile("strict")
        assert strict is not None
        assert strict.available
        assert "seccomp" in strict.layers
        assert hello.limits.max_commands_per_connection == 16
        # This daemon has no disk quota, and says why.
        assert hello.disk_quota.mechanism == "none"
        assert hello.disk_quota.reason
        assert hello.limits.default_timeout == 30


def test_a_profile_not_offered_is_listed_with_its_reason_and_refused(daemon_factory):
    filtered = daemon_factory(profiles=())
    with filtered.connect() as client:
        assert "trusted" not in {p.name for p in client.hello.profiles}
        assert "trusted" in {n["name"] for n in client.hello.not_offered}
        with pytest.raises(ProfileDeniedError) as refused:
            client.exec("id -un", profile="trusted")
        assert refused.value.code == "profile_denied"
        # Control: an offered profile runs.
        assert client.exec("echo ok", profile="strict").output == "ok\n"


def test_exec_returns_mini_swe_agents_result_shape(daemon):
    with daemon.connect() as client:
        result = client.exec("echo out; echo err >&2; exit 3", timeout=10)
        assert result.output == "out\nerr\n"
        assert result.returncode == 3
        assert result.exception_info == ""
        assert result.ended == "exited"
        assert result.extra["isolation"]["profile"] == "strict"
        assert set(result.to_dict()) == {"output", "returncode", "exception_info", "extra"}


def test_output_streams_while_the_command_runs(daemon):
    chunks: list[tuple[float, str]] = []
    with daemon.connect() as client:
        started = time.monotonic()
        result = client.exec(
            "echo one; sleep 1; echo two",
            on_output=lambda data: chunks.append((time.monotonic() - started, data)),
        )
        finished = time.monotonic() - started
    assert "".join(data for _, data in chunks) == result.output == "one\ntwo\n"
    # The first chunk came a second before the command ended, not with its result.
    assert chunks[0][1] == "one\n"
    assert finished - chunks[0][0] > 0.7


def test_a_timeout_is_a_result_with_the_output_so_far(daemon):
    with daemon.connect() as client:
        result = client.exec("echo before; sleep 30", timeout=0.5)
    assert result.output == "before\n"
    assert result.returncode == -1
    assert result.timed_out
    assert "timed out" in result.exception_info


def test_cancel_from_another_thread_kills_the_running_command(daemon):
    with daemon.connect() as client:
        rid = client.new_id()
        streamed = threading.Event()

        def cancel() -> None:
            streamed.wait(PATIENCE_S)
            client.cancel(rid)

        canceller = threading.Thread(target=cancel)
        canceller.start()
        started = time.monotonic()
        result = client.exec(
            "echo running; sleep 30", request_id=rid, on_output=lambda _: streamed.set()
        )
        canceller.join()
        assert result.cancelled
        assert result.returncode == -1
        assert result.output == "running\n"
        assert time.monotonic() - started < 10
        # Control: the same command without a cancel runs to its end.
        assert client.exec("echo running; sleep 0.2").returncode == 0


def test_cancel_of_a_finished_command_is_harmless(daemon):
    with daemon.connect() as client:
        result = client.exec("true", request_id="done")
        client.cancel("done")  # the executor answers not_found, which is ignored
        assert result.returncode == 0
        assert client.exec("echo still fine").output == "still fine\n"


def test_each_error_code_raises_its_own_exception(daemon):
    with daemon.connect() as client:
        with pytest.raises(BadRequestError) as bad:
            client.exec("true", timeout=0)
        assert bad.value.code == "bad_request"
        with pytest.raises(ExecutorEnvironmentError) as broken:
            client.exec("true", cwd="/nonexistent-dir")
        # Not in strict's root: said when planned, with what the root holds instead.
        assert "cannot work in /nonexistent-dir under profile strict" in broken.value.message
        with pytest.raises(ProfileDeniedError):
            client.exec("true", profile="no-such-profile")
        # Control: the same requests, valid, run; the connection survived the errors.
        assert client.exec("true", timeout=1, cwd="/", profile="strict").returncode == 0
    # Every documented code has its class, and an unknown one (a newer executor) still
    # raises a ServerError.
    documented = {
        "bad_request",
        "duplicate_id",
        "not_found",
        "busy",
        "quota_exceeded",
        "profile_denied",
        "environment_error",
        "shutting_down",
        "internal",
        "denied",  # protocol 1.1: the sandbox refused a file operation
    }
    assert set(ERRORS) == documented
    for code, cls in ERRORS.items():
        error = server_error(code, "m", "i")
        assert type(error) is cls
        assert (error.code, error.request_id) == (code, "i")
    assert isinstance(server_error("bad_request", "m"), ServerError)
    assert type(server_error("from_the_future", "m")) is ServerError
    assert isinstance(server_error("not_found", "m"), NotFoundError)


def test_busy_and_duplicate_ids_are_refused_and_the_client_goes_on(daemon_factory):
    small = daemon_factory("--max-commands-per-connection", "1")

    async def scenario() -> None:
        async with await small.connect_async() as client:
            first = asyncio.ensure_future(client.exec("sleep 1; echo first", request_id="a"))
            await asyncio.sleep(0.3)
            with pytest.raises(BusyError):
                await client.exec("echo second")
            assert (await first).output == "first\n"
            # Control: with the slot free again, the second one runs.
            assert (await client.exec("echo second")).output == "second\n"

    asyncio.run(scenario())

    roomy = daemon_factory()

    async def duplicate() -> None:
        async with await roomy.connect_async() as client:
            first = asyncio.ensure_future(client.exec("sleep 1", request_id="same"))
            await asyncio.sleep(0.3)
            # Our own check refuses an id we are still waiting for...
            with pytest.raises(ValueError, match="already waiting"):
                await client.exec("true", request_id="same")
            await first
            # ... and reuse after the result is fine.
            assert (await client.exec("true", request_id="same")).returncode == 0

    asyncio.run(duplicate())


def test_the_executor_refuses_an_id_still_running_in_the_session(daemon):
    # Two clients cannot share a session, so this needs the raw protocol: our client never
    # sends a duplicate itself. A second exec with a running id comes back `duplicate_id`.
    async def scenario() -> None:
        async with await daemon.connect_async() as client:
            first = asyncio.ensure_future(client.exec("sleep 1", request_id="dup"))
            await asyncio.sleep(0.3)
            client._pending.pop("dup")  # forget it, as a buggy client would
            with pytest.raises(DuplicateIdError):
                await client.exec("true", request_id="dup")
            first.cancel()

    asyncio.run(scenario())


def test_a_wrong_token_is_refused_and_not_retried(daemon, tmp_path):
    wrong = tmp_path / "token"
    wrong.write_text("0" * 64)
    with pytest.raises(ConnectError) as refused:
        Client.connect(daemon.url, token_file=str(wrong))
    assert "401" in str(refused.value)
    assert "the token sent is not this executor's" in str(refused.value)
    assert refused.value.retry is False
    # A missing token is told apart from a wrong one.
    with pytest.raises(ConnectError, match="401: it requires a token and none was given"):
        Client.connect(daemon.url, token=None)
    # Control: the right token, by file, by value, or from EXECUTOR_TOKEN.
    token = Path(daemon.token_file).read_text().strip()
    Client.connect(daemon.url, token_file=daemon.token_file).close()
    Client.connect(daemon.url, token=token).close()
    os.environ["EXECUTOR_TOKEN"] = token
    try:
        Client.connect(daemon.url).close()
    finally:
        del os.environ["EXECUTOR_TOKEN"]


def test_asyncio_runs_commands_concurrently_on_one_connection(daemon):
    async def scenario() -> list[str]:
        async with await daemon.connect_async() as client:
            started = time.monotonic()
            results = await asyncio.gather(*(client.exec(f"sleep 1; echo {i}") for i in range(4)))
            assert time.monotonic() - started < 3.5  # together, not one after another
            return [r.output for r in results]

    assert asyncio.run(scenario()) == ["0\n", "1\n", "2\n", "3\n"]


def test_asyncio_streams_output(daemon: Daemon):
    chunks: list[str] = []

    async def scenario() -> str:
        async with await daemon.connect_async() as client:
            result = await client.exec(
                "for i in 1 2 3; do echo $i; sleep 0.1; done", on_output=chunks.append
            )
            return result.output

    assert asyncio.run(scenario()) == "".join(chunks) == "1\n2\n3\n"
    assert len(chunks) >= 2


def test_one_client_per_thread(daemon):
    errors: list[BaseException] = []
    outputs: dict[int, list[str]] = {}

    def worker(n: int) -> None:
        try:
            with daemon.connect() as client:
                outputs[n] = [client.exec(f"echo {n}-{i}").output for i in range(5)]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert outputs == {n: [f"{n}-{i}\n" for i in range(5)] for n in range(4)}


def test_closing_ends_the_session_and_kills_what_runs(daemon_factory):
    # A grace period would keep a dropped connection's commands running; a close frame ends
    # the session at once.
    graceful = daemon_factory(resume_grace=30)
    marker = "31.4159"

    async def scenario() -> None:
        client = await graceful.connect_async()
        task = asyncio.ensure_future(client.exec(f"sleep {marker}"))
        await asyncio.to_thread(wait_until, lambda: processes_with(marker), what="the command")
        await client.close()
        with pytest.raises(ConnectionLostError, match="closed"):
            await task

    asyncio.run(scenario())
    wait_until(lambda: not processes_with(marker), timeout=5, what="the command to die")


PATIENCE_S = 20


def test_giving_up_on_a_command_cancels_it_on_the_executor(daemon):
    marker = "29.7182"

    async def scenario() -> None:
        async with await daemon.connect_async() as client:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.exec(f"sleep {marker}"), 1)
            # Killed now, not at its own timeout; and the connection serves on.
            await asyncio.to_thread(
                wait_until, lambda: not processes_with(marker), 5, "the command to die"
            )
            assert (await client.exec("echo next")).output == "next\n"

    asyncio.run(scenario())
    assert audit_ending(daemon, f"sleep {marker}") == "cancelled"


def test_ctrl_c_in_the_sync_client_cancels_the_command(daemon):
    marker = "28.1828"
    previous = signal.signal(signal.SIGALRM, signal.default_int_handler)
    try:
        with daemon.connect() as client:
            signal.setitimer(signal.ITIMER_REAL, 1.0)
            with pytest.raises(KeyboardInterrupt):
                client.exec(f"sleep {marker}")
            wait_until(lambda: not processes_with(marker), 5, "the command to die")
            # Control: the client still works, and a command left alone runs.
            assert client.exec("echo next").output == "next\n"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    # It ran, and ended by our cancel (not by the connection closing, nor its own end).
    assert audit_ending(daemon, f"sleep {marker}") == "cancelled"


def audit_ending(daemon, command: str) -> str:
    """How the daemon's audit log says `command` ended."""
    for line in (Path(daemon.state_dir) / "audit.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("command") == command:
            return str(record.get("ended"))
    raise AssertionError(f"no audit record of {command!r}")


def test_a_used_up_output_quota_raises_its_own_exception(daemon_factory, tmp_path):
    """`quota_exceeded` from a real daemon: a client whose lifetime output quota is spent."""
    from executor_client.errors import QuotaExceededError

    token = "q" * 40
    clients = tmp_path / "clients.json"
    clients.write_text(
        json.dumps(
            {
                "clients": [
                    {"name": "small", "token": token, "profiles": ["landlock"]},
                    {"name": "tiny", "token": "t" * 40, "output_quota_bytes": 100},
                ]
            }
        )
    )
    clients.chmod(0o600)
    daemon = daemon_factory("--clients", str(clients))
    with Client.connect(daemon.url, token="t" * 40) as client:
        assert client.exec("head -c 500 /dev/zero | tr '\\0' x").returncode == 0
        with pytest.raises(QuotaExceededError):
            client.exec("echo more")
    # Control: another client's quota is its own.
    with Client.connect(daemon.url, token=token) as client:
        assert client.exec("echo fine").output == "fine\n"
