"""Processes (protocol 1.1) against a real daemon: a REPL driven over several turns, stdin to
`cat`, a terminal's size and resize, Ctrl-C at a shell prompt, signals to the whole tree,
`wait`, `list_processes`, errors routed to the request that caused them, and the capability
check."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from conftest import PATIENCE, processes_with, wait_until

from executor_client import (
    AsyncProcess,
    BadRequestError,
    NotFoundError,
    Process,
    UnsupportedError,
)


def read_until(process: Process, marker: bytes, timeout: float = PATIENCE) -> bytes:
    """Output from where the last read ended until `marker` has appeared (inclusive of all
    bytes read so far past it)."""
    deadline = time.monotonic() + timeout
    seen = b""
    while marker not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {marker!r} within {timeout} s; the output: {seen!r}")
        chunk = process.read(wait=min(left, 5.0))
        seen += chunk.data
        if chunk.eof and marker not in seen:
            raise AssertionError(f"the output ended without {marker!r}: {seen!r}")
    return seen


def test_the_executor_offers_processes_and_terminals(daemon):
    with daemon.connect() as client:
        assert {"processes", "pty"} <= set(client.hello.capabilities)
        assert client.hello.limits.max_process_buffer_bytes > 0


def test_a_python_repl_is_driven_over_several_turns(daemon):
    with daemon.connect() as client:
        repl = client.spawn("python3 -u -i -q")
        assert not repl.pty
        read_until(repl, b">>> ")
        repl.write("x = 6 * 7\n")
        read_until(repl, b">>> ")
        repl.write("print(x)\n")
        assert read_until(repl, b">>> ") == b"42\n>>> "
        # A block over several lines, continued with `... ` prompts.
        repl.write("def grow(n):\n    return n + 1\n\n")
        assert b"... " in read_until(repl, b">>> ")
        repl.write(b"print(grow(x))\n")
        assert read_until(repl, b">>> ") == b"43\n>>> "
        # An exception is a turn like the others: the interpreter and its state go on.
        repl.write("1 / 0\n")
        assert b"ZeroDivisionError" in read_until(repl, b">>> ")
        repl.write("print(x, 'still here')\n")
        assert read_until(repl, b">>> ") == b"42 still here\n>>> "
        # The end of stdin ends the REPL, as Ctrl-D does.
        repl.close_stdin()
        ended = repl.wait(PATIENCE)
        assert not ended.running
        assert ended.returncode == 0
        assert repl.returncode == 0


def test_stdin_reaches_cat_byte_for_byte_and_its_end_ends_cat(daemon):
    with daemon.connect() as client:
        cat = client.spawn("cat")
        cat.write(b"hello\n")
        assert read_until(cat, b"hello\n") == b"hello\n"
        every_byte = bytes(range(256))
        cat.write(every_byte)
        echoed = b""
        while len(echoed) < 256:
            chunk = cat.read(wait=5)
            assert chunk.data, "cat echoed nothing within 5 s"
            echoed += chunk.data
        assert echoed == every_byte
        cat.write("héllo ✓\n")
        assert read_until(cat, "✓\n".encode()) == "héllo ✓\n".encode()
        # Control: with stdin open, cat runs on.
        assert cat.wait(0.5).running
        cat.close_stdin()
        assert b"".join(cat) == b""  # nothing more, and the iteration ends with the output
        assert cat.wait(PATIENCE).returncode == 0
        assert cat.dropped == 0
        # The whole output stays readable from its start.
        whole = cat.read(0)
        assert whole.offset == 0
        assert whole.data == b"hello\n" + every_byte + "héllo ✓\n".encode()
        assert whole.eof


def test_a_terminal_reports_its_size_and_a_resize(daemon):
    with daemon.connect() as client:
        shell = client.spawn(
            "test -t 0 && test -t 1 && echo on-a-terminal; stty size; read line; stty size",
            pty=(24, 80),
        )
        assert shell.pty
        assert b"24 80" in read_until(shell, b"24 80")
        shell.resize(40, 120)
        shell.write("\n")
        assert b"40 120" in read_until(shell, b"40 120")
        assert shell.wait(PATIENCE).returncode == 0
        assert b"on-a-terminal" in shell.read(0).data
        # Control: without a terminal, stdin and stdout are no tty.
        plain = client.spawn("test -t 0 || test -t 1 || echo no-terminal")
        assert b"".join(plain) == b"no-terminal\n"


def test_ctrl_c_stops_the_foreground_job_and_the_prompt_returns(daemon):
    marker = "99.125"
    with daemon.connect() as client:
        # Set by `env`: the `bash -c` the command runs in drops PS1 from the environment.
        shell = client.spawn("exec env PS1='PROMPT$ ' bash --norc --noprofile -i", pty=(24, 80))
        read_until(shell, b"PROMPT$ ")
        shell.write(f"sleep {marker}\n")
        wait_until(lambda: processes_with(f"sleep {marker}"), what="the sleep to start")
        # Control: while the job runs, no prompt comes back by itself.
        assert b"PROMPT$ " not in shell.read(wait=1).data
        started = time.monotonic()
        shell.signal("INT", foreground=True)
        read_until(shell, b"PROMPT$ ", timeout=10)
        assert time.monotonic() - started < 10
        wait_until(lambda: not processes_with(f"sleep {marker}"), 5, "the sleep to die")
        # The shell itself got nothing: it answers the next line.
        shell.write("echo alive-$((40 + 2))\n")
        assert b"alive-42" in read_until(shell, b"alive-42")
        shell.write("exit 7\n")
        assert shell.wait(PATIENCE).returncode == 7


def test_a_signal_reaches_the_whole_tree(daemon):
    markers = ("98.375", "97.625")
    with daemon.connect() as client:
        tree = client.spawn(f"sleep {markers[0]} & sleep {markers[1]}; wait")
        wait_until(lambda: all(processes_with(f"sleep {m}") for m in markers), what="both sleeps")
        # Control: a wait that times out leaves it running.
        assert tree.wait(0.3).running
        tree.signal("TERM")
        ended = tree.wait(PATIENCE)
        assert not ended.running
        assert ended.returncode != 0
        wait_until(
            lambda: not any(processes_with(f"sleep {m}") for m in markers), 5, "the tree to die"
        )


def test_wait_and_list_processes_report_how_processes_ended(daemon):
    with daemon.connect() as client:
        done = client.spawn("echo out; exit 3")
        ended = done.wait(PATIENCE)
        assert (ended.running, ended.returncode, ended.exception_info) == (False, 3, "")
        assert ended.extra.get("ended") == "exited"
        assert b"".join(done) == b"out\n"
        running = client.spawn("sleep 30")
        listed = {p.id: p for p in client.list_processes()}
        assert listed[done.id].running is False
        assert listed[done.id].returncode == 3
        assert listed[done.id].output_bytes == 4
        assert listed[done.id].command == "echo out; exit 3"
        assert listed[running.id].running is True
        assert listed[running.id].returncode is None
        running.signal("KILL")
        assert not running.wait(PATIENCE).running
        after = {p.id: p for p in client.list_processes()}
        assert after[running.id].running is False


def test_a_failed_write_raises_at_the_next_write_not_at_other_requests(daemon):
    with daemon.connect() as client:
        cat = client.spawn("cat")
        cat.close_stdin()
        assert cat.wait(PATIENCE).returncode == 0
        cat.write("too late\n")  # no answer on success, so nothing is known yet
        # The write's error arrives while this read waits for its own answer: the read
        # still gets its answer ...
        assert cat.read(0, wait=1).eof
        # ... and the write's error is raised by the next write.
        with pytest.raises(NotFoundError, match="ended"):
            cat.write("again\n")
        # A terminal request to a process without a terminal is the request's own error.
        plain = client.spawn("sleep 5")
        with pytest.raises(BadRequestError):
            plain.resize(10, 10)
        plain.signal("KILL")
        assert not plain.wait(PATIENCE).running


def test_errors_name_the_request_that_caused_them(daemon):
    async def scenario() -> None:
        async with await daemon.connect_async() as client:
            cat = await client.spawn("cat")
            # A read waiting for output is not the request a bad signal's error belongs to.
            waiting = asyncio.ensure_future(cat.read(wait=10))
            await asyncio.sleep(0.2)
            with pytest.raises(BadRequestError):
                await cat.signal("NOT-A-SIGNAL")
            assert not waiting.done()
            await cat.write(b"late\n")
            assert (await asyncio.wait_for(waiting, PATIENCE)).data == b"late\n"
            # Output is read while input is written, as two tasks.
            lines = [f"line {n}\n".encode() for n in range(50)]

            async def feed() -> None:
                for line in lines:
                    await cat.write(line)
                await cat.close_stdin()

            pieces, _ = await asyncio.gather(collect(cat), feed())
            assert b"".join(pieces) == b"".join(lines)
            assert (await cat.wait(PATIENCE)).returncode == 0
            # A process the session does not have.
            ghost = AsyncProcess(client, "no-such-process", "", pty=False)
            with pytest.raises(NotFoundError):
                await ghost.read()

    asyncio.run(scenario())


async def collect(process: AsyncProcess) -> list[bytes]:
    return [data async for data in process]


def test_processes_need_an_executor_that_offers_them(daemon):
    with daemon.connect() as client:
        client._inner.hello = replace(client.hello, capabilities=["files"])
        with pytest.raises(UnsupportedError, match="'processes'") as refused:
            client.spawn("true")
        assert refused.value.capability == "processes"
        client._inner.hello = replace(client.hello, capabilities=["processes"])
        with pytest.raises(UnsupportedError, match="'pty'"):
            client.spawn("true", pty=True)
        # Control: offered, the same call runs (and the refusals sent nothing).
        client._inner.hello = replace(client.hello, capabilities=["processes", "pty"])
        assert client.spawn("true", pty=True).wait(PATIENCE).returncode == 0
