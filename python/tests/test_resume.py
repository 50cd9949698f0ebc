"""Resume after a dropped connection (protocol README, "resume"), through a proxy the test
cuts, stalls or makes refuse, in front of a real daemon with a grace period."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from conftest import Background, processes_with, wait_until

from executor_client import ConnectionLostError
from executor_client.mini import ExecutorEnvironment


def test_a_running_command_survives_a_cut_and_its_output_arrives_once(cuttable_daemon):
    link = cuttable_daemon(resume_grace=10)
    chunks: list[str] = []
    with link.connect() as client:
        session = client.session
        first = threading.Event()

        def on_output(data: str) -> None:
            chunks.append(data)
            first.set()

        running = Background(
            lambda: client.exec(
                "for i in 1 2 3 4 5 6; do echo $i; sleep 0.3; done", on_output=on_output
            )
        )
        assert first.wait(10)
        assert link.proxy.cut() == 1
        result = running.result(20)
        assert result.returncode == 0
        assert result.output == "1\n2\n3\n4\n5\n6\n"
        # Every chunk exactly once: what was missed came in the replay, nothing twice.
        assert "".join(chunks) == result.output
        assert link.proxy.accepted == 2
        # The session went on: same id, and later commands run in it.
        assert client.session == session
        assert client.exec("echo after").output == "after\n"


def test_a_result_written_while_disconnected_is_replayed(cuttable_daemon):
    link = cuttable_daemon(resume_grace=20)
    marker = "7.0123"
    with link.connect() as client:
        running = Background(lambda: client.exec(f"sleep {marker}; echo finished"))
        wait_until(lambda: processes_with(marker), what="the command to start")
        link.proxy.refusing = True
        link.proxy.cut()
        # The command finishes on the executor while nobody can reach it.
        wait_until(lambda: not processes_with(marker), timeout=15, what="the command to end")
        time.sleep(0.5)
        link.proxy.refusing = False
        result = running.result(30)
        assert result.output == "finished\n"
        assert result.returncode == 0
        assert link.proxy.accepted >= 3  # refused attempts, then the one that resumed


def test_a_request_lost_in_the_break_is_sent_again_and_runs_once(cuttable_daemon, client_log):
    link = cuttable_daemon(resume_grace=10)
    ran = Path(link.daemon.workspace) / "ran.txt"
    with link.connect() as client:
        link.proxy.drop_requests = True  # the exec is swallowed on its way
        running = Background(lambda: client.exec("echo x >> ran.txt; cat ran.txt"))
        time.sleep(0.5)
        assert not ran.exists()
        link.proxy.drop_requests = False
        link.proxy.cut()
        assert running.result(20).output == "x\n"
    # It ran exactly once, though the client could not know it had not arrived.
    assert ran.read_text() == "x\n"
    assert "never reached the executor; sending it again" in client_log.text


def test_a_command_that_arrived_before_the_break_is_not_sent_again(cuttable_daemon, client_log):
    link = cuttable_daemon(resume_grace=10)
    ran = Path(link.daemon.workspace) / "ran.txt"
    with link.connect() as client:
        running = Background(lambda: client.exec("echo x >> ran.txt; sleep 1"))
        wait_until(ran.exists, what="the command to start")
        link.proxy.cut()
        assert running.result(20).returncode == 0
    # Control for the test above: resumed, found running, not sent again.
    assert ran.read_text() == "x\n"
    assert "resumed session" in client_log.text
    assert "sending it again" not in client_log.text


def test_without_a_grace_period_the_command_is_lost_and_the_client_goes_on(cuttable_daemon):
    link = cuttable_daemon(resume_grace=0)
    marker = "8.0123"
    with link.connect() as client:
        session = client.session
        running = Background(lambda: client.exec(f"sleep {marker}"))
        wait_until(lambda: processes_with(marker), what="the command to start")
        link.proxy.cut()
        error = running.error(20)
        assert isinstance(error, ConnectionLostError)
        assert error.reconnected
        # The executor killed it with its session; a new session serves what follows.
        wait_until(lambda: not processes_with(marker), timeout=5, what="the command to die")
        assert client.exec("echo fresh").output == "fresh\n"
        assert client.session != session


def test_a_silent_outage_is_noticed_at_the_deadline_and_the_result_fetched_again(
    cuttable_daemon,
):
    link = cuttable_daemon(resume_grace=20)
    with link.connect(result_slack=1) as client:
        running = Background(lambda: client.exec("sleep 0.5; echo done", timeout=2))
        time.sleep(0.2)
        assert link.proxy.stall() == 1  # nothing flows, nothing closes
        assert running.result(30).output == "done\n"
        assert link.proxy.accepted == 2


def test_concurrent_asyncio_commands_all_resume(cuttable_daemon):
    link = cuttable_daemon(resume_grace=10)

    async def scenario() -> list[str]:
        async with await link.connect_async() as c:
            tasks = [asyncio.ensure_future(c.exec(f"sleep 1; echo {i}")) for i in range(3)]
            await asyncio.sleep(0.4)
            await asyncio.to_thread(link.proxy.cut)
            return [r.output for r in await asyncio.gather(*tasks)]

    assert asyncio.run(scenario()) == ["0\n", "1\n", "2\n"]


@pytest.mark.parametrize("grace", [10, 0])
def test_the_mini_environment_across_a_dropped_connection(cuttable_daemon, grace):
    link = cuttable_daemon(resume_grace=grace)
    env = ExecutorEnvironment(url=link.proxy.url(), token_file=link.daemon.token_file)
    try:
        with link.proxy.cut_after(0.5):
            output = env.execute({"command": "sleep 1.5; echo survived"})
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


def test_a_process_and_the_read_waiting_on_it_survive_a_cut(cuttable_daemon):
    # Protocol 1.1: a `read` answered while no connection is attached is dropped by the
    # executor; the client asks again once the session is back, from the same offset.
    link = cuttable_daemon(resume_grace=10)
    with link.connect() as client:
        session = client.session
        process = client.spawn("echo before; sleep 1.5; echo after")
        assert process.read(wait=5).data == b"before\n"
        with link.proxy.cut_after(0.5):
            chunk = process.read(wait=10)
        assert chunk.data == b"after\n"
        assert link.proxy.accepted == 2
        assert client.session == session
        # A wait cut off is asked again too; and the process is still the session's.
        with link.proxy.cut_after(0.3):
            assert process.wait(10).returncode == 0
        assert process.read(0).data == b"before\nafter\n"
        assert process.id in {p.id for p in client.list_processes()}


def test_without_a_grace_period_a_process_read_fails_and_the_client_goes_on(cuttable_daemon):
    link = cuttable_daemon(resume_grace=0)
    with link.connect() as client:
        process = client.spawn("sleep 30")
        with (
            link.proxy.cut_after(0.5),
            pytest.raises(ConnectionLostError, match="processes were killed") as lost,
        ):
            process.read(wait=10)
        assert lost.value.reconnected
        # A new session serves on; file requests that only ask are sent again.
        assert client.stat(".").kind == "dir"
        assert client.list_processes() == []


def test_a_spawn_lost_in_the_break_is_sent_again_and_starts_once(cuttable_daemon, client_log):
    link = cuttable_daemon(resume_grace=10)
    ran = Path(link.daemon.workspace) / "spawned.txt"
    with link.connect() as client:
        link.proxy.drop_requests = True  # the spawn is swallowed on its way
        spawning = Background(lambda: client.spawn("echo x >> spawned.txt; cat spawned.txt"))
        time.sleep(0.5)
        assert not ran.exists()
        link.proxy.drop_requests = False
        link.proxy.cut()
        process = spawning.result(20)
        assert b"".join(process) == b"x\n"
        assert process.wait(10).returncode == 0
    # It started exactly once, though the client could not know it had not arrived.
    assert ran.read_text() == "x\n"
    assert "never reached the executor; sending it again" in client_log.text


def test_a_spawn_whose_answer_was_lost_is_replayed_not_started_again(cuttable_daemon, client_log):
    link = cuttable_daemon(resume_grace=10)
    ran = Path(link.daemon.workspace) / "spawned-once.txt"
    with link.connect() as client:
        link.proxy.drop_replies = True  # the spawn arrives; its `spawned` is lost on the way back
        spawning = Background(
            lambda: client.spawn("echo x >> spawned-once.txt; sleep 2", pty=(10, 20))
        )
        wait_until(ran.exists, what="the process to start")
        link.proxy.drop_replies = False
        link.proxy.cut()
        process = spawning.result(20)
        assert process.pty
        assert process.wait(10).returncode == 0
    # Control for the test above: resumed, its answer replayed, not sent again.
    assert ran.read_text() == "x\n"
    assert "resumed session" in client_log.text
    assert "sending it again" not in client_log.text
