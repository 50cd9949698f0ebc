"""`image` / deployment settings: the environment asks the agent binary to deploy an executor
(`agent deploy up ... --json`), uses it, and tears it down by closing the agent's stdin.

The real agent deploys a local executor in `test_the_real_agent_deploys_a_local_executor` (and
the swebench suite's batch). `stand_in_agent.py` plays the agent only where the real one cannot
be made to misbehave on cue: a deployment that fails with a reason, one that never answers, and
logging which image each instance asked for."""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import pytest
from conftest import shared_dir, wait_until

from executor_client import DeploymentError
from executor_client.launch import Deployment
from executor_client.mini import ExecutorEnvironment

STAND_IN = str(Path(__file__).with_name("stand_in_agent.py"))


@pytest.fixture
def stand_in(executor_bin, tmp_path, monkeypatch):
    log = tmp_path / "deployments.jsonl"
    monkeypatch.setenv("STAND_IN_EXECUTOR", executor_bin)
    monkeypatch.setenv("STAND_IN_LOG", str(log))

    def events() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return events


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_an_image_deploys_an_executor_that_close_tears_down(stand_in):
    env = ExecutorEnvironment(
        image="registry.example/task:1", agent_bin=STAND_IN, deploy_args=["--label", "run=test"]
    )
    deployment = env._resources.deployment
    assert deployment is not None
    try:
        assert env.execute({"command": "echo in the deployment"})["output"] == "in the deployment\n"
        up, ready = stand_in()[:2]
        # docker unless told otherwise, the image, the extra arguments, and --json.
        assert up["argv"] == [
            "deploy",
            "up",
            "--deploy",
            "docker",
            "--image",
            "registry.example/task:1",
            "--label",
            "run=test",
            "--json",
        ]
        assert (
            env.serialize()["info"]["config"]["environment"]["image"] == "registry.example/task:1"
        )
        assert env.serialize()["info"]["executor"]["url"] == deployment.url
    finally:
        env.close()
    # Closing its stdin tore it down: the agent and its executor are gone.
    assert deployment.process.poll() == 0
    assert stand_in()[-1]["event"] == "down"
    assert not alive(ready["executor_pid"])


def test_garbage_collection_tears_the_deployment_down(stand_in):
    env = ExecutorEnvironment(image="img:gc", agent_bin=STAND_IN)
    assert env._resources.deployment is not None
    process = env._resources.deployment.process
    assert env.execute({"command": "true"})["returncode"] == 0
    del env
    gc.collect()
    wait_until(lambda: process.poll() is not None, timeout=15, what="the teardown")
    assert stand_in()[-1]["event"] == "down"


def test_a_failed_deployment_raises_with_the_agents_reason(stand_in):
    with pytest.raises(DeploymentError, match="image img/missing:1 not found"):
        ExecutorEnvironment(image="img/missing:1", agent_bin=STAND_IN)
    # Control: another image deploys.
    ExecutorEnvironment(image="img/present:1", agent_bin=STAND_IN).close()


def test_a_deployment_that_never_answers_hits_its_start_deadline(stand_in):
    started = time.monotonic()
    with pytest.raises(DeploymentError, match="printed nothing within 1 s"):
        Deployment.start(
            deploy="docker", image="img/silent:1", agent_binary=STAND_IN, start_timeout=1
        )
    assert time.monotonic() - started < 10
    # Its stdin was closed, so it ended too.
    up = stand_in()[-1]
    assert up["image"] == "img/silent:1"


def test_a_missing_agent_binary_is_a_clear_error(tmp_path):
    with pytest.raises(DeploymentError, match="does not exist"):
        ExecutorEnvironment(image="img:1", agent_bin=str(tmp_path / "nope"))


def test_deployment_without_an_image(stand_in):
    # `deployment` alone (e.g. ssh or remote, whose settings go in deploy_args) also asks the
    # agent; no --image is passed.
    env = ExecutorEnvironment(deployment="remote", agent_bin=STAND_IN)
    env.close()
    assert stand_in()[0]["argv"] == ["deploy", "up", "--deploy", "remote", "--json"]


def test_the_real_agent_deploys_a_local_executor(agent_bin, executor_bin, monkeypatch):
    os.environ.setdefault("EXECUTOR_BIN", executor_bin)
    # Its workspace is the current directory: one the sandbox's uid may write, since on this
    # machine only strict or landlock is ever chosen.
    monkeypatch.chdir(shared_dir())
    env = ExecutorEnvironment(deployment="local", agent_bin=agent_bin)
    deployment = env._resources.deployment
    assert deployment is not None
    try:
        assert env.profile == "strict"
        assert env.execute({"command": "echo deployed"})["output"] == "deployed\n"
    finally:
        env.close()
    assert deployment.process.poll() is not None


def test_mini_extra_executor_puts_our_class_in_the_docker_slot(stand_in, monkeypatch):
    from minisweagent import environments
    from minisweagent.run.benchmarks import swebench, swebench_single

    from executor_client.swebench import install

    # Undone after the test: install() changes mini's module state for this process.
    mapping = environments._ENVIRONMENT_MAPPING
    monkeypatch.setitem(mapping, "docker", mapping["docker"])
    monkeypatch.setitem(mapping, "executor", "")
    monkeypatch.setattr(swebench, "get_sb_environment", swebench.get_sb_environment)
    monkeypatch.setattr(swebench_single, "get_sb_environment", swebench_single.get_sb_environment)
    instance = {"instance_id": "demo__slot-1", "image_name": "img/slot:1"}
    # Control: without it, a class named by its path gets no image from mini (and starts a
    # local executor here, in a directory the sandbox's uid may write).
    monkeypatch.chdir(shared_dir())
    unpatched = swebench.get_sb_environment(
        {"environment": {"environment_class": "executor_client.mini.ExecutorEnvironment"}},
        instance,
    )
    assert unpatched.config.image is None  # it started a local executor instead
    unpatched.close()
    install()
    install()  # idempotent
    for name in ("docker", "executor", "executor_client.mini.ExecutorEnvironment", None):
        block = {"agent_bin": STAND_IN}
        if name:
            block["environment_class"] = name
        env = swebench.get_sb_environment({"environment": block}, instance)
        try:
            assert type(env) is ExecutorEnvironment
            assert env.config.image == "img/slot:1"
        finally:
            env.close()
    assert swebench_single.get_sb_environment is swebench.get_sb_environment
    assert [e["image"] for e in stand_in() if e["event"] == "up"] == ["img/slot:1"] * 4
