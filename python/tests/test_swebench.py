"""`mini-extra-executor swebench`: mini's own batch runner, on an offline instances file, with
a deterministic model, each instance's image handed to our class in the docker slot, two worker
threads, and mini's outputs (preds.json, trajectories, exit statuses) written through it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import processes_with, wait_until
from test_deploy import STAND_IN

CLASS = "executor_client.mini.ExecutorEnvironment"

INSTANCES = [
    {
        "instance_id": "demo__alpha-1",
        "problem_statement": "Fix alpha.",
        "image_name": "registry.example/alpha:1",
    },
    # No image field: SWE-bench's naming, as mini computes it.
    {"instance_id": "demo__beta-2", "problem_statement": "Fix beta."},
    # Its deployment fails: recorded with its exit status, the batch goes on.
    {
        "instance_id": "demo__gamma-3",
        "problem_statement": "Fix gamma.",
        "image_name": "registry.example/missing:3",
    },
]


def script(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} is not installed (pip install the package)"
    return found


@pytest.mark.parametrize("deployer", ["stand-in", "agent"])
def test_mini_extra_executor_swebench_runs_a_batch_through_our_class(
    deployer, executor_bin, agent_bin, tmp_path
):
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "test.jsonl").write_text("".join(json.dumps(i) + "\n" for i in INSTANCES))
    log = tmp_path / "deployments.jsonl"
    submit = (
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; "
        'printf \'diff for %s (PAGER=%s)\\n\' "$(cat instance.txt)" "$PAGER"'
    )
    config = {
        "environment": {
            # swebench.yaml names `docker`; cwd /testbed is the task image's, not ours here.
            "cwd": "",
            "timeout": 20,
            "agent_bin": STAND_IN if deployer == "stand-in" else agent_bin,
            **({"deployment": "local"} if deployer == "agent" else {}),
        },
        "model": {
            "model_class": "deterministic",
            "model_name": "deterministic-test",
            "outputs": [
                {
                    "role": "assistant",
                    "content": "look",
                    "extra": {"actions": [{"command": "cat instance.txt"}], "cost": 0.0},
                },
                {
                    "role": "assistant",
                    "content": "submit",
                    "extra": {"actions": [{"command": submit}], "cost": 0.0},
                },
            ],
        },
        "run": {"env_startup_command": "printf '%s' '{{instance_id}}' > instance.txt"},
    }
    config_file = tmp_path / "test.yaml"
    config_file.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    env = {
        **os.environ,
        "EXECUTOR_BIN": executor_bin,
        "STAND_IN_EXECUTOR": executor_bin,
        "STAND_IN_LOG": str(log),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "mini-config"),
    }
    run = subprocess.run(
        [
            script("mini-extra-executor"),
            "swebench",
            "--subset",
            str(dataset),
            "--split",
            "test",
            "-o",
            str(out),
            "-w",
            "2",
            "-c",
            "swebench.yaml",
            "-c",
            str(config_file),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    preds = json.loads((out / "preds.json").read_text())
    assert set(preds) == {i["instance_id"] for i in INSTANCES}
    # The stand-in fails an image it does not know, as a registry would; the agent's `local`
    # deployment runs every instance on this host, whatever its image.
    failing = ["demo__gamma-3"] if deployer == "stand-in" else []
    submitted = sorted(i["instance_id"] for i in INSTANCES if i["instance_id"] not in failing)
    for iid in submitted:
        # Each instance ran in its own deployment (the startup command wrote its id there),
        # with swebench.yaml's env (PAGER=cat) applied.
        assert preds[iid] == {
            "model_name_or_path": "deterministic-test",
            "instance_id": iid,
            "model_patch": f"diff for {iid} (PAGER=cat)\n",
        }
        trajectory = json.loads((out / iid / f"{iid}.traj.json").read_text())
        assert trajectory["info"]["exit_status"] == "Submitted"
        assert trajectory["info"]["config"]["environment_type"] == CLASS
        environment = trajectory["info"]["config"]["environment"]
        assert environment["cwd"] == ""
        assert environment["env"]["PAGER"] == "cat"
        assert trajectory["info"]["executor"]["profile"] in ("strict", "landlock")
        assert trajectory["instance_id"] == iid
        observation = trajectory["messages"][3]["content"]
        assert iid in observation
        assert "<returncode>0</returncode>" in observation
    for iid in failing:
        assert preds[iid]["model_patch"] == ""
    statuses = yaml.safe_load(next(out.glob("exit_statuses_*.yaml")).read_text())
    by_status = statuses["instances_by_exit_status"]
    assert sorted(by_status["Submitted"]) == submitted
    assert by_status.get("DeploymentError", []) == failing
    assert (out / "minisweagent.log").exists()

    def events() -> list[dict[str, object]]:
        return [json.loads(line) for line in log.read_text().splitlines()]

    if deployer == "stand-in":
        images = sorted(str(e["image"]) for e in events() if e["event"] == "up")
        # Each instance's image reached its deployment, SWE-bench's naming included.
        assert images == [
            "docker.io/swebench/sweb.eval.x86_64.demo_1776_beta-2:latest",
            "registry.example/alpha:1",
            "registry.example/missing:3",
        ]
        ready = {e["id"] for e in events() if e["event"] == "ready"}
        assert len(ready) == 2
        # mini never closes its environments: each deployment was torn down all the same
        # (when its environment was collected, at the latest when the runner exited: its
        # deployments see their stdin close then, and finish alone).
        wait_until(
            lambda: ready <= {e["id"] for e in events() if e["event"] == "down"},
            what="every deployment torn down",
        )
    wait_until(lambda: processes_with("stand-in-state-") == [], what="no stand-in left")
    wait_until(lambda: processes_with("agent-deploy-") == [], what="no deployed executor left")
