"""mini-swe-agent's own agent loop, from PyPI, with its deterministic models, on our class: the
one-line change of a mini config (`environment_class`), and nothing else."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import shared_dir
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_from_spec
from minisweagent.environments import get_environment
from minisweagent.models.test_models import (
    DeterministicModel,
    DeterministicToolcallModel,
    make_output,
    make_toolcall_output,
)

CLASS = "executor_client.mini.ExecutorEnvironment"


def environment_from(config: dict, **overrides):
    """As mini's CLI builds it: the config's environment block with our class named."""
    block = {**config.get("environment", {}), "environment_class": CLASS, **overrides}
    return get_environment(block)


def test_default_agent_reaches_submitted_with_the_exact_submission(tmp_path):
    config = get_config_from_spec("default.yaml")  # mini's own default config, text actions
    env = environment_from(config, cwd=shared_dir())
    model = DeterministicModel(
        outputs=[
            make_output(
                "Look around.\n```mswea_bash_command\necho $PAGER; ls\n```",
                [{"command": "echo $PAGER; ls"}],
            ),
            make_output(
                "Write.\n```mswea_bash_command\necho hello > a.txt\n```",
                [{"command": "echo hello > a.txt"}],
            ),
            make_output(
                "Done.\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && "
                "echo 'Task completed successfully'\n```",
                [
                    {
                        "command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && "
                        "echo 'Task completed successfully'"
                    }
                ],
            ),
        ],
        observation_template=config["model"]["observation_template"],
    )
    trajectory = tmp_path / "run.traj.json"
    agent = DefaultAgent(model, env, **{**config["agent"], "output_path": trajectory})
    try:
        info = agent.run("Say hello in a.txt")
    finally:
        env.close()
    assert info["exit_status"] == "Submitted"
    assert info["submission"] == "Task completed successfully\n"
    messages = agent.messages
    # mini's templates rendered under StrictUndefined with our template variables.
    assert "Please solve this issue: Say hello in a.txt" in messages[1]["content"]
    assert env.get_template_vars()["release"] in messages[1]["content"]
    # Observations went through mini's own template; the config's env (PAGER) arrived.
    assert "<returncode>0</returncode>" in messages[3]["content"]
    assert "cat" in messages[3]["content"]
    assert messages[-1] == {
        "role": "exit",
        "content": "Task completed successfully\n",
        "extra": {"exit_status": "Submitted", "submission": "Task completed successfully\n"},
    }
    saved = json.loads(trajectory.read_text())
    assert saved["info"]["exit_status"] == "Submitted"
    assert saved["info"]["submission"] == "Task completed successfully\n"
    assert saved["info"]["config"]["environment_type"] == CLASS
    assert saved["info"]["config"]["environment"]["env"]["PAGER"] == "cat"
    assert saved["info"]["executor"]["profile"] in ("strict", "landlock")
    assert saved["trajectory_format"] == "mini-swe-agent-1.1"


def test_tool_calling_agent_with_minis_mini_yaml(tmp_path):
    config = get_config_from_spec("mini.yaml")  # mini's CLI default, tool calls
    env = environment_from(config, cwd=shared_dir())
    calls = [
        ("call_1", "printf 'x\\ny\\n' | wc -l"),
        ("call_2", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; printf 'diff --git a/f b/f\\n'"),
    ]
    model = DeterministicToolcallModel(
        outputs=[
            make_toolcall_output(
                None,
                [
                    {
                        "id": cid,
                        "type": "function",
                        "function": {"name": "bash", "arguments": json.dumps({"command": cmd})},
                    }
                ],
                [{"command": cmd, "tool_call_id": cid}],
            )
            for cid, cmd in calls
        ],
        observation_template=config["model"]["observation_template"],
    )
    agent = DefaultAgent(model, env, **{**config["agent"], "mode": "yolo"})
    try:
        info = agent.run("Count lines")
    finally:
        env.close()
    assert info == {"exit_status": "Submitted", "submission": "diff --git a/f b/f\n"}
    tool_result = next(m for m in agent.messages if m.get("role") == "tool")
    assert tool_result["tool_call_id"] == "call_1"
    assert json.loads(tool_result["content"])["output"].strip() == "2"
    assert tool_result["extra"]["returncode"] == 0


def test_an_environment_error_ends_the_run_and_is_never_an_observation(tmp_path):
    config = get_config_from_spec("default.yaml")
    env = environment_from(config, cwd=shared_dir())
    model = DeterministicModel(
        outputs=[
            make_output("Go.\n```mswea_bash_command\nls\n```", [{"command": "ls"}]),
        ],
    )
    agent = DefaultAgent(model, env, **config["agent"])
    env.config.cwd = "/no/such/directory"  # the executor cannot enter it: the environment is broken
    from executor_client import ExecutorEnvironmentError

    try:
        with pytest.raises(ExecutorEnvironmentError):
            agent.run("task")
    finally:
        env.close()
    assert agent.messages[-1]["extra"]["exit_status"] == "ExecutorEnvironmentError"
    assert not any(
        m["role"] == "user" and "cannot enter" in str(m["content"]) for m in agent.messages[2:]
    )


def test_the_one_line_change_in_a_yaml_config(tmp_path):
    # What a user writes: their mini config, with the environment class named.
    config_file = tmp_path / "my.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {"environment": {"environment_class": CLASS, "cwd": shared_dir(), "timeout": 10}}
        )
    )
    config = get_config_from_spec(str(config_file))
    env = get_environment(config["environment"])
    try:
        assert env.execute({"command": "echo switched"})["output"] == "switched\n"
    finally:
        env.close()
