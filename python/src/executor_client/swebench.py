"""`mini-extra-executor`: mini-swe-agent's `mini-extra` with `ExecutorEnvironment` in the
docker slot.

mini's benchmark runners hand each instance's image only to the classes they know as
docker-like (`get_sb_environment` in `minisweagent/run/benchmarks/swebench.py` sets `image`
for `docker` and `swerex_modal`); a class named by its import path gets none. So this entry
point maps `docker` (the default of `swebench.yaml`), and the names `executor` and
`executor_client.mini.ExecutorEnvironment`, to our class before running `mini-extra` with the
same arguments: every instance gets an executor deployed for its image by `agent deploy up`
(docker unless `environment.deployment` says otherwise), and everything else (datasets,
configs, workers, preds.json, trajectories, the progress display) is mini's own::

    mini-extra swebench --subset verified --split test -m MODEL -w 4 -o out      # before
    mini-extra-executor swebench --subset verified --split test -m MODEL -w 4 -o out  # after
"""

from __future__ import annotations

from typing import Any

ENVIRONMENT = "executor_client.mini.ExecutorEnvironment"
#: Names that select our class here; each is run in mini's docker slot.
NAMES = ("docker", "executor", ENVIRONMENT)


def install() -> None:
    """Make mini's runners build `ExecutorEnvironment` with each instance's image."""
    from minisweagent import environments
    from minisweagent.run.benchmarks import swebench

    mapping: dict[str, str] = environments._ENVIRONMENT_MAPPING
    mapping["docker"] = ENVIRONMENT
    mapping["executor"] = ENVIRONMENT
    original = swebench.get_sb_environment
    if getattr(original, "executor_slot", False):
        return

    def get_sb_environment(config: dict[str, Any], instance: dict[str, Any]) -> Any:
        environment = dict(config.get("environment", {}))
        if environment.get("environment_class", "docker") in NAMES:
            # The docker slot: mini sets `image` for it, and `docker` now means our class.
            config = {**config, "environment": {**environment, "environment_class": "docker"}}
        return original(config, instance)

    get_sb_environment.executor_slot = True  # type: ignore[attr-defined]
    swebench.get_sb_environment = get_sb_environment
    # `swebench-single` imported the function by name.
    from minisweagent.run.benchmarks import swebench_single as single

    single.get_sb_environment = get_sb_environment


def main() -> None:
    """`mini-extra-executor SUBCOMMAND ...`: `mini-extra` with our class in the docker slot."""
    install()
    from minisweagent.run.utilities.mini_extra import main as mini_extra

    mini_extra()


if __name__ == "__main__":
    main()
