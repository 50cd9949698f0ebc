"""A newcomer's first hour, replayed: what the README and agent/README tell a new user to do on
a fresh clone (this machine, built by the README's own test command), each step run as a user
runs it (the binaries, mini's own CLI) and its outcome checked from outside: exit codes, what
is printed, the files left on the host.

1. `agent run --demo`, and `executor run` by hand;
2. mini-swe-agent's one-line config change (`environment_class: ExecutorEnvironment`), with
   mini's deterministic model through mini's own `mini` command;
3. a three-instance `agent batch` stopped with Ctrl-C and resumed;
4. `agent cp`, `agent exec`, `agent shell`;
5. a directory checked out as root: refused with the ways out, never a command that writes
   the host.

The issue that asked for it (36) met a silent fallback to a profile writing `/usr`, a locale
warning before every output, `-c swebench.yaml` not found, wrong progress counts and messages
that did not say what to do. Each step checks the fix of what it met.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import shared_dir, wait_until

from executor_client import DeploymentError
from executor_client.mini import ExecutorEnvironment

#: Longest any one step may take on a busy 2-core machine.
STEP = 120


@pytest.fixture
def home() -> Iterator[Path]:
    """A newcomer's working directory (their checkout of a project), writable by the sandbox's
    identity (uid 65534), as a directory of an ordinary user's is to its own commands."""
    path = Path(shared_dir("first-hour-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run(
    argv: list[str], cwd: Path, *, env: dict[str, str] | None = None, timeout: float = STEP
) -> subprocess.CompletedProcess[str]:
    """Run a step to its end, bounded; its output is shown when a check fails."""
    done = subprocess.run(
        argv,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    print(f"$ {' '.join(argv)}\n-> {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


def test_the_demo_and_a_command_by_hand(home: Path, agent_bin: str, executor_bin: str) -> None:
    demo = run([agent_bin, "run", "--demo"], home)
    assert demo.returncode == 0, demo.stderr
    assert "Exit status: Submitted" in demo.stdout
    assert "Model: scripted (SCRIPTED" in demo.stdout
    # The fix is the submission: a diff of the toy repository.
    assert "Submission:\ndiff --git" in demo.stdout
    # The profile and why, before anything ran; strict, not a profile that writes the host.
    assert 'executor: profile "strict" (the strongest of strict > landlock' in demo.stderr
    trajectory = Path(demo.stdout.split("Trajectory: ")[1].strip())
    saved = json.loads(trajectory.read_text())
    assert saved["info"]["exit_status"] == "Submitted"
    repository = Path(demo.stdout.split("Demo repository: ")[1].splitlines()[0])
    # The toy repository changed, seen from the host, outside any sandbox.
    fixed = subprocess.run(
        ["git", "-c", "safe.directory=*", "diff", "--stat"],
        cwd=repository,
        capture_output=True,
        text=True,
        check=True,
    )
    assert fixed.stdout.strip(), "the demo changed nothing in its repository"

    by_hand = run([executor_bin, "run", "--", "echo first; id -u"], home)
    assert by_hand.returncode == 0
    # Nothing precedes the command's own output (no locale warning), and stderr says the
    # profile and why.
    assert by_hand.stdout == "first\n65534\n"
    assert by_hand.stderr.startswith('executor: profile "strict" (the strongest;')


def test_minis_one_line_config_with_its_deterministic_model(home: Path) -> None:
    mini = Path(sys.executable).parent / "mini"
    one_line = home / "executor.yaml"
    # The README's one line.
    one_line.write_text(
        yaml.safe_dump(
            {"environment": {"environment_class": "executor_client.mini.ExecutorEnvironment"}}
        )
    )
    submit = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat greeting.txt"
    outputs = [
        {
            "role": "assistant",
            "content": f"Write it.\n```mswea_bash_command\n{command}\n```",
            "extra": {"actions": [{"command": command}]},
        }
        for command in ("echo hello > greeting.txt", submit)
    ]
    trajectory = home / "mini.traj.json"
    argv = [
        str(mini),
        "-m",
        "deterministic",
        "-c",
        "default.yaml",
        "-c",
        str(one_line),
        "-c",
        "model.model_class=minisweagent.models.test_models.DeterministicModel",
        "-c",
        f"model.outputs={json.dumps(outputs)}",
        "-t",
        "Say hello in greeting.txt",
        "-y",
        "--exit-immediately",
        "-o",
        str(trajectory),
    ]
    # mini's first-run wizard reads a terminal; a run without one needs MSWEA_CONFIGURED
    # (python/README says so).
    ran = run(argv, home, env={"MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1"})
    assert ran.returncode == 0, ran.stderr
    saved = json.loads(trajectory.read_text())
    assert saved["info"]["exit_status"] == "Submitted"
    assert saved["info"]["submission"] == "hello\n"
    assert saved["info"]["executor"]["profile"] == "strict"
    # The command ran in the sandbox, as uid 65534, in this directory.
    assert (home / "greeting.txt").read_text() == "hello\n"
    assert (home / "greeting.txt").stat().st_uid == 65534
    # mini's log shows the profile and why (rich wraps its lines).
    said = " ".join((ran.stdout + ran.stderr).split())
    assert "'strict' profile (the strongest of strict > landlock whose commands can write" in said


def _batch(agent_bin: str, home: Path, scripts: Path, out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            agent_bin,
            "batch",
            "--subset",
            str(home / "instances.jsonl"),
            # agent/README's example config: mini's own, found by name.
            "-c",
            "swebench.yaml",
            "-m",
            "scripted",
            "--script",
            str(scripts / "{instance_id}.yaml"),
            "-w",
            "1",
            "-o",
            str(out),
        ],
        cwd=home,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_three_instance_batch_stopped_with_ctrl_c_and_resumed(home: Path, agent_bin: str) -> None:
    ids = ["first", "second", "third"]
    (home / "instances.jsonl").write_text(
        "".join(json.dumps({"instance_id": i, "problem_statement": f"fix {i}"}) + "\n" for i in ids)
    )
    submit = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo patch-of-$(basename $PWD)"
    quick = home / "quick"
    quick.mkdir()
    for i in ids:
        (quick / f"{i}.yaml").write_text(yaml.safe_dump([{"command": submit}]))
    slow = home / "slow"
    slow.mkdir()
    (slow / "first.yaml").write_text(yaml.safe_dump([{"command": submit}]))
    # The second is still at work when the newcomer presses Ctrl-C; the third never starts.
    marker = f"sleep 600.{os.getpid()}"
    (slow / "second.yaml").write_text(yaml.safe_dump([{"command": marker}, {"command": submit}]))
    (slow / "third.yaml").write_text(yaml.safe_dump([{"command": submit}]))
    out = home / "out"
    batch = _batch(agent_bin, home, slow, out)
    preds = out / "preds.json"

    def sleeping() -> bool:
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
        return marker in ps.stdout

    wait_until(lambda: preds.exists() and "first" in json.loads(preds.read_text()), STEP)
    wait_until(sleeping, STEP, "the second instance's command")
    batch.send_signal(signal.SIGINT)
    _, stderr = batch.communicate(timeout=STEP)
    print(stderr)
    assert batch.returncode == 130, stderr
    # Counted right: one done, one interrupted, one never started, and said so.
    assert (
        "1 of 3 instances done, 1 interrupted, 1 not started; run the same command again to "
        "do the 2 left" in stderr
    )
    assert "batch: [1/3] first: Submitted" in stderr
    assert "batch: second: Interrupted" in stderr
    assert "batch: [2/3]" not in stderr
    assert "batch: [3/3]" not in stderr
    assert list(json.loads(preds.read_text())) == ["first"]
    # The stop killed the sleeping command's whole tree.
    wait_until(lambda: not sleeping(), 30, "the interrupted command to be gone")

    # Resumed: the same command does the two left (their scripts now submit at once).
    shutil.rmtree(slow)
    quick.rename(slow)
    again = _batch(agent_bin, home, slow, out)
    _, stderr = again.communicate(timeout=STEP)
    print(stderr)
    assert again.returncode == 0, stderr
    assert "batch: 2 instances (3 selected, 1 already in" in stderr
    assert "batch: done in" in stderr
    assert "2 of 2 instances" in stderr
    assert "profile strict, else landlock, per instance" in stderr
    predictions = json.loads(preds.read_text())
    assert sorted(predictions) == sorted(ids)
    for i in ids:
        assert predictions[i]["model_patch"].startswith("patch-of-"), predictions[i]
    trajectory = json.loads((out / "third" / "third.traj.json").read_text())
    assert trajectory["info"]["config"]["agent"]["step_limit"] == 250  # swebench.yaml's
    log = (out / "minisweagent.log").read_text()
    assert 'second: executor: profile "strict"' in log
    assert "\x1b" not in log


def test_cp_exec_and_shell_in_the_current_directory(home: Path, agent_bin: str) -> None:
    (home / "notes.txt").write_text("from the host\n")
    sent = run([agent_bin, "cp", "notes.txt", ":copy.txt"], home)
    assert sent.returncode == 0, sent.stderr
    assert (home / "copy.txt").read_text() == "from the host\n"
    executed = run([agent_bin, "exec", "--", "cat copy.txt; id -u; echo made > back.txt"], home)
    assert executed.returncode == 0, executed.stderr
    assert executed.stdout == "from the host\n65534\n"
    assert 'executor: profile "strict"' in executed.stderr
    fetched = run([agent_bin, "cp", ":back.txt", "fetched.txt"], home)
    assert fetched.returncode == 0, fetched.stderr
    assert (home / "fetched.txt").read_text() == "made\n"

    # A shell on a terminal: typed in, answered, exited with its own status.
    terminal, far = os.openpty()
    shell = subprocess.Popen(
        [agent_bin, "shell"], cwd=home, stdin=far, stdout=far, stderr=far, start_new_session=True
    )
    os.close(far)
    os.write(terminal, b"echo $((6 * 7)) as $(id -u)\nexit 3\n")
    seen = b""
    deadline = time.monotonic() + STEP
    while time.monotonic() < deadline:
        ready, _, _ = select.select([terminal], [], [], 1)
        if not ready:
            continue
        try:
            chunk = os.read(terminal, 4096)
        except OSError:  # EIO: the far side closed with the shell's end
            break
        if not chunk:
            break
        seen += chunk
    os.close(terminal)
    status = shell.wait(timeout=STEP)
    text = seen.decode(errors="replace")
    print(text)
    assert "42 as 65534" in text
    assert status == 3


def test_a_directory_checked_out_as_root_is_refused_with_the_ways_out(
    agent_bin: str, executor_bin: str
) -> None:
    repository = Path(tempfile.mkdtemp(prefix="first-hour-testbed-"))
    repository.chmod(0o755)
    marker = Path(f"/usr/local/first-hour-{os.getpid()}")
    try:
        refused = run([agent_bin, "exec", "--", f"touch {marker}"], repository)
        assert refused.returncode == 255
        assert (
            f"neither strict nor landlock can run commands that write {repository} "
            "(owned by root, mode 0755)" in refused.stderr
        )
        assert "--profile task-container" in refused.stderr
        assert not marker.exists(), "a command wrote the host's /usr/local"
        with pytest.raises(DeploymentError, match="neither strict nor landlock"):
            ExecutorEnvironment(cwd=str(repository))
        assert not marker.exists()
        # The way out the message names, taken: in a disposable machine, task-container.
        named = run(
            [agent_bin, "exec", "--profile", "task-container", "--", "id -u; touch made"],
            repository,
        )
        assert named.returncode == 0, named.stderr
        assert named.stdout == "0\n"
        assert (repository / "made").exists()
    finally:
        shutil.rmtree(repository, ignore_errors=True)
        marker.unlink(missing_ok=True)
