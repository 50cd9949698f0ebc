"""`ExecutorEnvironment` behaves as mini-swe-agent's own classes: the same commands give the
same results as mini's `LocalEnvironment` (from PyPI, run beside it on the same directory),
with the differences a sandbox makes on purpose (no host environment, the executor's `extra`)."""

from __future__ import annotations

import gc
import logging
import os
import platform
import subprocess
from pathlib import Path

import pytest
from conftest import processes_with, shared_dir, wait_until
from minisweagent.environments import get_environment
from minisweagent.environments.local import LocalEnvironment
from minisweagent.exceptions import Submitted

from executor_client import DeploymentError, ExecutorClientError
from executor_client.mini import ExecutorEnvironment, ExecutorEnvironmentConfig

CLASS = "executor_client.mini.ExecutorEnvironment"
MINI_KEYS = ("output", "returncode", "exception_info")


@pytest.fixture(scope="module", params=["local", "url"])
def env(request, executor_bin):
    """The class as mini users get it: a local executor it starts itself, or a running one."""
    os.environ["EXECUTOR_BIN"] = executor_bin
    if request.param == "local":
        workdir = shared_dir()
        environment = ExecutorEnvironment(cwd=workdir, timeout=30)
        yield environment
        environment.close()
    else:
        from conftest import start_daemon

        daemon = start_daemon(executor_bin)
        environment = ExecutorEnvironment(
            url=daemon.url, token_file=daemon.token_file, cwd=daemon.workspace
        )
        yield environment
        environment.close()
        daemon.stop()


@pytest.fixture(scope="module")
def local(env):
    """mini's own LocalEnvironment on the same directory, for comparison."""
    return LocalEnvironment(cwd=env.config.cwd, timeout=30)


def same(ours: dict, theirs: dict) -> None:
    assert {k: ours[k] for k in MINI_KEYS} == {k: theirs[k] for k in MINI_KEYS}


@pytest.mark.parametrize(
    "command",
    [
        "echo 'hello world'",  # success
        "exit 1",  # failure: rc 1, empty output
        "exit 42",
        "echo 'error message' >&2",  # stderr is captured in output
        "printf 'line1\\nline2\\nline3\\n'",  # multi-line
        "echo 'hello world' | grep 'world'",  # shell features: a pipe
        "echo $(echo 'nested')",  # command substitution
        "echo out; echo err >&2; echo out2",  # order of the merged streams
        "true",
    ],
)
def test_results_are_those_of_minis_local_environment(env, local, command):
    ours = env.execute({"command": command})
    same(ours, local.execute({"command": command}))
    assert set(ours) == {"output", "returncode", "exception_info", "extra"}
    assert ours["extra"]["ended"] == "exited"
    assert ours["extra"]["isolation"]["profile"] in ("strict", "landlock")


def test_failure_gives_rc_1_and_empty_output(env):
    result = env.execute({"command": "exit 1"})
    assert result["returncode"] == 1
    assert result["output"] == ""
    assert result["exception_info"] == ""


def test_a_missing_command(env, local):
    ours = env.execute({"command": "nonexistent_command_12345"})
    theirs = local.execute({"command": "nonexistent_command_12345"})
    # mini's local runs /bin/sh, we run bash: the message words differ, not the facts.
    assert ours["returncode"] == theirs["returncode"] == 127
    assert "nonexistent_command_12345" in ours["output"]
    assert "not found" in ours["output"]


def test_minis_own_multiline_check(env):
    result = env.execute({"command": "echo -e 'line1\\nline2\\nline3'"})
    lines = result["output"].strip().split("\n")
    assert result["returncode"] == 0
    assert [line[-5:] for line in lines] == ["line1", "line2", "line3"]


def test_a_timeout_has_minis_shape_and_the_output_so_far(env, local):
    command = "echo before; sleep 5"
    ours = env.execute({"command": command}, timeout=1)
    theirs = local.execute({"command": command}, timeout=1)
    same(ours, theirs)
    assert ours["returncode"] == -1
    assert ours["output"] == "before\n"
    assert "timed out" in ours["exception_info"]
    assert ours["exception_info"] == (
        "An error occurred while executing the command: "
        "Command 'echo before; sleep 5' timed out after 1 seconds"
    )
    assert ours["extra"]["exception_type"] == theirs["extra"]["exception_type"] == "TimeoutExpired"
    assert ours["extra"]["exception"] == theirs["extra"]["exception"]
    # And the executor's facts besides.
    assert ours["extra"]["timed_out"] is True
    assert ours["extra"]["ended"] == "timed_out"


def test_the_configured_timeout_applies_and_a_call_overrides_it(env):
    quick = ExecutorEnvironmentConfig(timeout=5)
    assert quick.timeout == 5
    assert ExecutorEnvironmentConfig().timeout == 30
    original = env.config.timeout
    env.config.timeout = 1
    try:
        assert env.execute({"command": "sleep 3"})["returncode"] == -1
        # Control: a longer timeout for one call lets it finish.
        assert env.execute({"command": "sleep 1.5; echo done"}, timeout=10)["output"] == "done\n"
    finally:
        env.config.timeout = original


def test_cwd_parameter_overrides_the_config(env, local):
    sub = Path(env.config.cwd) / "sub dir"
    sub.mkdir(exist_ok=True)
    sub.chmod(0o777)
    ours = env.execute({"command": "pwd"}, cwd=str(sub))
    same(ours, local.execute({"command": "pwd"}, cwd=str(sub)))
    assert ours["output"] == f"{sub}\n"
    assert env.execute({"command": "pwd"})["output"] == f"{env.config.cwd}\n"


def test_files_persist_between_commands(env):
    assert env.execute({"command": "echo 'test content' > test.txt"})["returncode"] == 0
    assert env.execute({"command": "cat test.txt"})["output"] == "test content\n"
    assert (Path(env.config.cwd) / "test.txt").read_text() == "test content\n"


def test_env_and_forward_env(env, monkeypatch):
    monkeypatch.setenv("HOST_VAR", "from_host")
    monkeypatch.setenv("CONFLICT_VAR", "from_host")
    monkeypatch.setenv("NOT_FORWARDED", "secret")
    config = env.config
    saved = (config.env, config.forward_env)
    config.env = {"TEST_VAR": "test_value", "CONFLICT_VAR": "from_config"}
    config.forward_env = ["HOST_VAR", "CONFLICT_VAR", "NONEXISTENT_VAR"]
    try:
        result = env.execute(
            {"command": 'echo $TEST_VAR $HOST_VAR $CONFLICT_VAR "[$NONEXISTENT_VAR]"'}
        )
        # env and forwarded variables arrive; env wins a conflict; an unset one stays unset.
        assert result["output"] == "test_value from_host from_config []\n"
        # Forwarding reads this process's environment at each command, as mini's docker does.
        monkeypatch.setenv("HOST_VAR", "changed")
        assert env.execute({"command": "echo $HOST_VAR"})["output"] == "changed\n"
        # Merged into the command's environment: PATH and the profile's defaults stay.
        path = env.execute({"command": "echo $PATH; command -v ls"})["output"].split("\n")
        assert "/usr/bin" in path[0].split(":")
        assert path[1] in ("/usr/bin/ls", "/bin/ls")
        # Unlike mini's LocalEnvironment, nothing of this process's environment passes
        # unless named: the sandbox never sees the model's API keys.
        assert env.execute({"command": 'echo "[$NOT_FORWARDED]"'})["output"] == "[]\n"
        assert "secret" in LocalEnvironment().execute({"command": "echo $NOT_FORWARDED"})["output"]
    finally:
        config.env, config.forward_env = saved


def test_an_explicit_path_in_env_is_the_users_choice(env):
    saved = env.config.env
    env.config.env = {"PATH": "/opt/nothing:/usr/bin:/bin"}
    try:
        assert env.execute({"command": "echo $PATH"})["output"] == "/opt/nothing:/usr/bin:/bin\n"
    finally:
        env.config.env = saved


SUBMISSIONS = [
    # (command, the submission or None when it must not submit)
    (
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo 'Task completed successfully'",
        "Task completed successfully\n",
    ),
    ("echo; echo '   COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT  '; printf 'a\\nb'", "a\nb"),
    ("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", ""),
    (
        "printf 'COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\\r\\ndiff --git a b\\n\\n'",
        "diff --git a b\n\n",
    ),
    # Controls: a non-zero return code, the sentinel not first, or only part of a line.
    ("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo x; exit 1", None),
    ("echo hi; echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", None),
    ("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT now", None),
]


@pytest.mark.parametrize(("command", "submission"), SUBMISSIONS)
def test_submission_as_mini_decides_it(env, local, command, submission):
    def outcome(environment):
        try:
            return environment.execute({"command": command})
        except Submitted as e:
            return e

    ours, theirs = outcome(env), outcome(local)
    if submission is None:
        assert isinstance(ours, dict)
        assert isinstance(theirs, dict)
        same(ours, theirs)
        return
    assert isinstance(ours, Submitted)
    assert isinstance(theirs, Submitted)
    assert ours.messages == theirs.messages
    assert ours.messages == (
        {
            "role": "exit",
            "content": submission,
            "extra": {"exit_status": "Submitted", "submission": submission},
        },
    )


def test_template_vars_have_the_executor_hosts_uname_and_the_config(env, local):
    ours = env.get_template_vars(task="t")
    uname = platform.uname()
    # The executor runs on this host here, so its uname is ours and mini's.
    for key in ("system", "release", "version", "machine"):
        assert ours[key] == getattr(uname, key) == local.get_template_vars()[key]
    assert ours["node"] == uname.node
    assert ours["cwd"] == env.config.cwd
    assert ours["timeout"] == env.config.timeout
    assert ours["task"] == "t"
    assert ours["profile"] in ("strict", "landlock")
    assert ours["executor_server"].startswith("executor ")
    assert "token" not in ours


def test_serialize_in_minis_shape_without_the_token(executor_bin, daemon):
    token = Path(daemon.token_file).read_text().strip()
    environment = ExecutorEnvironment(url=daemon.url, token=token)
    try:
        data = environment.serialize()
        assert data["info"]["config"]["environment_type"] == CLASS
        config = data["info"]["config"]["environment"]
        assert config["url"] == daemon.url
        assert config["timeout"] == 30
        assert "token" not in config
        assert token not in repr(data)
        assert token not in repr(environment.get_template_vars())
        assert token not in repr(environment.config)
        assert data["info"]["executor"]["profile"] == "strict"
        assert data["info"]["executor"]["host"]["kernel"].startswith("Linux ")
        # The same shape as mini's own, key for key.
        theirs = LocalEnvironment().serialize()
        assert data["info"]["config"].keys() == theirs["info"]["config"].keys()
    finally:
        environment.close()


def test_mini_builds_it_from_a_config_ignoring_keys_it_does_not_know(daemon):
    # What mini does with `environment_class` and the rest of the block (docker's keys too).
    environment = get_environment(
        {
            "environment_class": CLASS,
            "executor_url": daemon.url,  # the Rust agent's name for it works too
            "token_file": daemon.token_file,
            "cwd": daemon.workspace,
            "timeout": 60,
            "interpreter": ["bash", "-c"],
            "run_args": ["--rm"],
            "container_timeout": "2h",
            "executable": "docker",
            "pull_timeout": 120,
        }
    )
    try:
        assert type(environment) is ExecutorEnvironment
        assert environment.config.url == daemon.url
        assert not hasattr(environment.config, "run_args")
        assert environment.execute({"command": "echo $0"})["output"] == "bash\n"
    finally:
        environment.close()


def test_another_interpreter(daemon):
    environment = ExecutorEnvironment(
        url=daemon.url, token_file=daemon.token_file, interpreter=["python3", "-c"]
    )
    try:
        result = environment.execute({"command": "import sys; print(6 * 7, sys.argv[0])"})
        assert result["output"] == "42 -c\n"
    finally:
        environment.close()


def test_close_stops_the_local_executor_and_garbage_collection_too(executor_bin):
    workdir = shared_dir()
    environment = ExecutorEnvironment(cwd=workdir)
    local = environment._resources.local
    assert local is not None
    state = Path(local.state_dir.name)
    assert environment.execute({"command": "echo up"})["output"] == "up\n"
    environment.close()
    assert local.process.poll() is not None
    assert not state.exists()
    environment.close()  # idempotent
    with pytest.raises(ExecutorClientError, match="closed"):
        environment.execute({"command": "true"})

    # mini's batch never closes its environments: dropping the last reference does it.
    collected = ExecutorEnvironment(cwd=workdir)
    assert collected._resources.local is not None
    process = collected._resources.local.process
    assert process.poll() is None
    del collected
    gc.collect()
    wait_until(lambda: process.poll() is not None, timeout=10, what="the executor to stop")


def test_the_local_executor_never_steps_down_to_a_profile_that_writes_the_host(
    executor_bin, tmp_path, caplog
):
    # A directory only root can write: uid 65534 (strict, landlock) cannot work in it, and
    # task-container (root, the host's /usr writable) is never chosen by itself.
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    marker = Path("/usr/local") / f"executor-fallback-{os.getpid()}"
    with pytest.raises(DeploymentError) as refused:
        ExecutorEnvironment(cwd=str(private))
    text = str(refused.value)
    assert f"neither strict nor landlock can run commands that write {private}" in text
    assert "owned by root, mode 0700" in text
    # What each lacked: here the sandbox's uid cannot even enter it.
    assert (
        "strict: environment_error: sandbox setup failed at stage cwd: cannot enter working "
        f"directory {private}" in text
    )
    assert "; landlock: environment_error: " in text
    assert "profile: task-container" in text
    assert f"chown -R 65534:65534 {private}" in text
    assert not marker.exists()
    # Named, task-container runs there (root in its own namespaces), and says why.
    caplog.set_level(logging.INFO, logger="minisweagent.environment")
    named = ExecutorEnvironment(cwd=str(private), profile="task-container")
    try:
        assert named.profile == "task-container"
        assert named.execute({"command": "touch made && id -u"})["output"] == "0\n"
        assert (private / "made").exists()
    finally:
        named.close()
    assert "'task-container' profile (named in the environment's config" in caplog.text
    # Control: a directory the sandbox's identity may write gets strict, and the log says why.
    caplog.clear()
    shared = ExecutorEnvironment(cwd=shared_dir())
    try:
        assert shared.profile == "strict"
        assert shared.execute({"command": "id -u"})["output"] == "65534\n"
    finally:
        shared.close()
    assert "'strict' profile (the strongest of strict > landlock whose commands can" in (
        caplog.text
    )


def test_a_timeout_kills_the_whole_tree_on_the_host(env):
    marker = f"{os.getpid() % 1000}.{id(env) % 997}1"
    command = (
        f"sleep {marker} & (sleep {marker} &) & setsid sleep {marker} & "
        f"nohup sleep {marker} >/dev/null 2>&1 & echo started; wait"
    )
    import threading

    box: dict[str, dict] = {}
    thread = threading.Thread(
        target=lambda: box.update(result=env.execute({"command": command}, timeout=3))
    )
    thread.start()
    # Control: while it runs, the host sees all four sleeps (this check can see them).
    wait_until(
        lambda: len(processes_with(f"sleep {marker}")) >= 4,
        timeout=10,
        what="the backgrounded sleeps",
    )
    thread.join(20)
    result = box["result"]
    assert result["returncode"] == -1
    assert result["output"] == "started\n"
    assert result["extra"]["exception_type"] == "TimeoutExpired"
    assert result["extra"]["killed_processes"] >= 5
    # When the result arrives, none of them is left anywhere on the host.
    assert processes_with(f"sleep {marker}") == []
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    assert f"sleep {marker}" not in ps.stdout
