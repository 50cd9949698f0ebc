"""Resume after a dropped connection (protocol README, "resume"), through a proxy the test
cuts, stalls or makes refuse, in front of a real daemon with a grace period."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

import pytest
from conftest import processes_with, wait_until

from executor_client import AsyncClient, Client, ConnectionLostError
from executor_client.mini import ExecutorEnvironment


def through(proxy, daemon, **kwargs) -> Client:
    return Client.connect(proxy.url(), token_file=daemon.token_file, **kwargs)


def run_in_thread(fn):
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller
            box["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    return thread, box


def test_a_running_command_survives_a_cut_and_its_output_arrives_once(
    daemon_factory, proxy_factory
):
    daemon = daemon_factory(resume_grace=10)
    proxy = proxy_factory(daemon.port)
    chunks: list[str] = []
    with through(proxy, daemon) as client:
        session = client.session
        first = threading.Event()

        def on_output(data: str) -> None:
            chunks.append(data)
            first.set()

        thread, box = run_in_thread(
            lambda: client.exec(
                "for i in 1 2 3 4 5 6; do echo $i; sleep 0.3; done", on_output=on_output
            )
        )
        assert first.wait(10)
        assert proxy.cut() == 1
        thread.join(20)
        assert "error" not in box, box.get("error")
        result = box["value"]
        assert result.returncode == 0
        assert result.output == "1\n2\n3\n4\n5\n6\n"
        # Every chunk exactly once: what was missed came in the replay, nothing twice.
        assert "".join(chunks) == result.output
        assert proxy.accepted == 2
        # The session went on: same id, and later commands run in it.
        assert client.session == session
        assert client.exec("echo after").output == "after\n"


def test_a_result_written_while_disconnected_is_replayed(daemon_factory, proxy_factory):
    daemon = daemon_factory(resume_grace=20)
    proxy = proxy_factory(daemon.port)
    marker = "7.0123"
    with through(proxy, daemon) as client:
        thread, box = run_in_thread(lambda: client.exec(f"sleep {marker}; echo finished"))
        wait_until(lambda: processes_with(marker), what="the command to start")
        proxy.refusing = True
        proxy.cut()
        # The command finishes on the executor while nobody can reach it.
        wait_until(lambda: not processes_with(marker), timeout=15, what="the command to end")
        time.sleep(0.5)
        proxy.refusing = False
        thread.join(30)
        assert "error" not in box, box.get("error")
        assert box["value"].output == "finished\n"
        assert box["value"].returncode == 0
        assert proxy.accepted >= 3  # refused attempts, then the one that resumed


def test_a_request_lost_in_the_break_is_sent_again_and_runs_once(
    daemon_factory, proxy_factory, caplog
):
    caplog.set_level(logging.INFO, logger="executor_client")
    daemon = daemon_factory(resume_grace=10)
    proxy = proxy_factory(daemon.port)
    ran = Path(daemon.workspace) / "ran.txt"
    with through(proxy, daemon) as client:
        proxy.drop_requests = True  # the exec is swallowed on its way
        thread, box = run_in_thread(lambda: client.exec("echo x >> ran.txt; cat ran.txt"))
        time.sleep(0.5)
        assert not ran.exists()
        proxy.drop_requests = False
        proxy.cut()
        thread.join(20)
        assert "error" not in box, box.get("error")
        assert box["value"].output == "x\n"
    # It ran exactly once, though the client could not know it had not arrived.
    assert ran.read_text() == "x\n"
    assert "never reached the executor; sending it again" in caplog.text


def test_a_command_that_arrived_before_the_break_is_not_sent_again(
    daemon_factory, proxy_factory, caplog
):
    caplog.set_level(logging.INFO, logger="executor_client")
    daemon = daemon_factory(resume_grace=10)
    proxy = proxy_factory(daemon.port)
    ran = Path(daemon.workspace) / "ran.txt"
    with through(proxy, daemon) as client:
        thread, box = run_in_thread(lambda: client.exec("echo x >> ran.txt; sleep 1"))
        wait_until(ran.exists, what="the command to start")
        proxy.cut()
        thread.join(20)
        assert "error" not in box, box.get("error")
        assert box["value"].returncode == 0
    # Control for the test above: resumed, found running, not sent again.
    assert ran.read_text() == "x\n"
    assert "resumed session" in caplog.text
    assert "sending it again" not in caplog.text


def test_without_a_grace_period_the_command_is_lost_and_the_client_goes_on(
    daemon_factory, proxy_factory
):
    daemon = daemon_factory(resume_grace=0)
    proxy = proxy_factory(daemon.port)
    marker = "8.0123"
    with through(proxy, daemon) as client:
        session = client.session
        thread, box = run_in_thread(lambda: client.exec(f"sleep {marker}"))
        wait_until(lambda: processes_with(marker), what="the command to start")
        proxy.cut()
        thread.join(20)
        error = box.get("error")
        assert isinstance(error, ConnectionLostError)
        assert error.reconnected
        # The executor killed it with its session; a new session serves what follows.
        wait_until(lambda: not processes_with(marker), timeout=5, what="the command to die")
        assert client.exec("echo fresh").output == "fresh\n"
        assert client.session != session


def test_a_silent_outage_is_noticed_at_the_deadline_and_the_result_fetched_again(
    daemon_factory, proxy_factory
):
    daemon = daemon_factory(resume_grace=20)
    proxy = proxy_factory(daemon.port)
    with through(proxy, daemon, result_slack=1) as client:
        thread, box = run_in_thread(lambda: client.exec("sleep 0.5; echo done", timeout=2))
        time.sleep(0.2)
        assert proxy.stall() == 1  # nothing flows, nothing closes
        thread.join(30)
        assert "error" not in box, box.get("error")
        assert box["value"].output == "done\n"
        assert proxy.accepted == 2


def test_concurrent_asyncio_commands_all_resume(daemon_factory, proxy_factory):
    daemon = daemon_factory(resume_grace=10)
    proxy = proxy_factory(daemon.port)

    async def scenario() -> list[str]:
        async with await AsyncClient.connect(proxy.url(), token_file=daemon.token_file) as c:
            tasks = [asyncio.ensure_future(c.exec(f"sleep 1; echo {i}")) for i in range(3)]
            await asyncio.sleep(0.4)
            await asyncio.to_thread(proxy.cut)
            return [r.output for r in await asyncio.gather(*tasks)]

    assert asyncio.run(scenario()) == ["0\n", "1\n", "2\n"]


@pytest.mark.parametrize("grace", [10, 0])
def test_the_mini_environment_across_a_dropped_connection(daemon_factory, proxy_factory, grace):
    daemon = daemon_factory(resume_grace=grace)
    proxy = proxy_factory(daemon.port)
    env = ExecutorEnvironment(url=proxy.url(), token_file=daemon.token_file)
    try:
        cut = threading.Timer(0.5, proxy.cut)
        cut.start()
        output = env.execute({"command": "sleep 1.5; echo survived"})
        cut.join()
        if grace:
            # The model sees nothing unusual.
            assert output["output"] == "survived\n"
            assert output["returncode"] == 0
        else:
            # mini's shape for a command that raised: the model learns it was cut short.
            assert output["returncode"] == -1
            assert output["output"] == ""
            assert "connection to the executor was lost" in output["exception_info"]
            assert output["extra"]["exception_type"] == "ConnectionLostError"
        assert env.execute({"command": "echo next"})["output"] == "next\n"
    finally:
        env.close()


def test_a_process_and_the_read_waiting_on_it_survive_a_cut(daemon_factory, proxy_factory):
    # Protocol 1.1: a `read` answered while no connection is attached is dropped by the
    # executor; the client asks again once the session is back, from the same offset.
    daemon = daemon_factory(resume_grace=10)
    proxy = proxy_factory(daemon.port)
    with through(proxy, daemon) as client:
        session = client.session
        process = client.spawn("echo before; sleep 1.5; echo after")
        assert process.read(wait=5).data == b"before\n"
        cut = threading.Timer(0.5, proxy.cut)
        cut.start()
        chunk = process.read(wait=10)
        cut.join()
        assert chunk.data == b"after\n"
        assert proxy.accepted == 2
        assert client.session == session
        # A wait cut off is asked again too; and the process is still the session's.
        cut = threading.Timer(0.3, proxy.cut)
        cut.start()
        assert process.wait(10).returncode == 0
        cut.join()
        assert process.read(0).data == b"before\nafter\n"
        assert process.id in {p.id for p in client.list_processes()}


def test_without_a_grace_period_a_process_read_fails_and_the_client_goes_on(
    daemon_factory, proxy_factory
):
    daemon = daemon_factory(resume_grace=0)
    proxy = proxy_factory(daemon.port)
    with through(proxy, daemon) as client:
        process = client.spawn("sleep 30")
        cut = threading.Timer(0.5, proxy.cut)
        cut.start()
        with pytest.raises(ConnectionLostError, match="processes were killed") as lost:
            process.read(wait=10)
        cut.join()
        assert lost.value.reconnected
        # A new session serves on; file requests that only ask are sent again.
        assert client.stat(".").kind == "dir"
        assert client.list_processes() == []


def test_a_spawn_lost_in_the_break_is_sent_again_and_starts_once(
    daemon_factory, proxy_factory, caplog
):
    caplog.set_level(logging.INFO, logger="executor_client")
    daemon = daemon_factory(resume_grace=10)
    proxy = proxy_factory(daemon.port)
    ran = Path(daemon.workspace) / "spawned.txt"
    with through(proxy, daemon) as client:
        proxy.drop_requests = True  # the spawn is swallowed on its way
        thread, box = run_in_thread(lambda: client.spawn("echo x >> spawned.txt; cat spawned.txt"))
        time.sleep(0.5)
        assert not ran.exists()
        proxy.drop_requests = False
        proxy.cut()
        thread.join(20)
        assert "error" not in box, box.get("error")
        process = box["value"]
        assert b"".join(process) == b"x\n"
        assert process.wait(10).returncode == 0
    # It started exactly once, though the client could not know it had not arrived.
    assert ran.read_text() == "x\n"
    assert "never reached the executor; sending it again" in caplog.text


def test_a_spawn_whose_answer_was_lost_is_replayed_not_started_again(
    daemon_factory, proxy_factory, caplog
):
    caplog.set_level(logging.INFO, logger="executor_client")
    daemon = daemon_factory(resume_grace=10)
    proxy = proxy_factory(daemon.port)
    ran = Path(daemon.workspace) / "spawned-once.txt"
    with through(proxy, daemon) as client:
        proxy.drop_replies = True  # the spawn arrives; its `spawned` is lost on the way back
        thread, box = run_in_thread(
            lambda: client.spawn("echo x >> spawned-once.txt; sleep 2", pty=(10, 20))
        )
        wait_until(ran.exists, what="the process to start")
        proxy.drop_replies = False
        proxy.cut()
        thread.join(20)
        assert "error" not in box, box.get("error")
        process = box["value"]
        assert process.pty
        assert process.wait(10).returncode == 0
    # Control for the test above: resumed, its answer replayed, not sent again.
    assert ran.read_text() == "x\n"
    assert "resumed session" in caplog.text
    assert "sending it again" not in caplog.text
