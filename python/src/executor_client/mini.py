"""`ExecutorEnvironment`: mini-swe-agent 2.x's environment protocol over an executor.

Switch a mini-swe-agent config with one line::

    environment:
      environment_class: executor_client.mini.ExecutorEnvironment

Results, timeouts, the submission sentinel, template variables and `serialize()` behave as
mini's own environment classes (`minisweagent/environments/local.py`, `docker.py`); the
commands run in an executor's sandbox, on this machine (a local executor started and stopped
with the environment), on a running executor (`url`), or on one the Rust agent deploys for an
`image` (`agent deploy up`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_serializer, field_validator

from .errors import (
    BadRequestError,
    BusyError,
    ConnectionLostError,
    DeploymentError,
    ExecutorClientError,
    ExecutorEnvironmentError,
    QuotaExceededError,
)
from .launch import Deployment, LocalExecutor
from .protocol import ExecResult, Hello, JsonDict, Network
from .sync import Client

#: Profiles from strongest to weakest; where we choose, we take the first that works.
PROFILE_PREFERENCE = ("strict", "landlock", "task-container", "trusted")
#: What we choose from by ourselves for an executor on this machine: the profiles that confine
#: commands to the working directory. task-container (root, the host's system directories
#: writable) and trusted (no sandbox) would write this machine itself: only when named.
LOCAL_CHOICES = ("strict", "landlock")
#: `busy` / `quota_exceeded` answers retried (with backoff up to 5 s) before giving up.
BUSY_RETRIES = 8
SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class ExecutorEnvironmentConfig(BaseModel):
    """Configuration; unknown keys are ignored (mini passes e.g. docker's `run_args` to any
    class), as mini's own configs do."""

    model_config = ConfigDict(extra="ignore")

    url: str | None = Field(default=None, validation_alias=AliasChoices("url", "executor_url"))
    """A running executor (`ws://` on loopback or through a tunnel, `wss://` elsewhere)."""
    token: str | None = Field(default=None, exclude=True, repr=False)
    """The bearer token; never serialised. Prefer `token_file` (or `EXECUTOR_TOKEN`)."""
    token_file: str | None = None
    tls_fingerprint: str | None = None
    """Pin a `wss://` executor's certificate: `sha256:<hex>`, as `executor serve --tls` prints."""
    tls_ca: str | None = None
    """Or verify it against this CA file (PEM) besides the system's."""
    profile: str | None = None
    """Sandbox profile; default: the executor's, or the strongest that works for a local one."""
    network: Network | None = None
    """The network every command asks for: `none`, `host`, or `{mode: policy, allow: [RULE,
    ...], deny: [...]}` (rules such as `pypi.org:443`), as in the Rust agent's
    `environment.network`; a `Network` too. It narrows what the executor grants this client,
    never widens it. Default: the client's."""

    @field_validator("network", mode="before")
    @classmethod
    def _network(cls, value: object) -> Network | None:
        if value is None:
            return None
        try:
            return Network.of(value)  # type: ignore[arg-type]
        except TypeError as e:
            # pydantic reports ValueError and AssertionError only.
            raise ValueError(str(e)) from e

    @field_serializer("network")
    def _network_json(self, network: Network | None) -> JsonDict | None:
        return network.to_json() if network is not None else None

    cwd: str = ""
    """Working directory of commands; default: the executor's workspace (local: the current
    directory, which becomes the local executor's workspace)."""
    env: dict[str, str] = {}
    """Added to each command's environment (the profile's PATH, HOME... stay unless named)."""
    forward_env: list[str] = []
    """Variables of this process passed on when set; `env` wins on conflict."""
    timeout: int | float = 30
    """Seconds per command."""
    interpreter: list[str] | None = None
    """Run commands with this argv instead of the executor's (`bash -c`)."""
    image: str | None = None
    """Deploy an executor for this image (`agent deploy up --image`; `deployment` says how)."""
    deployment: str | None = None
    """`agent deploy up --deploy` kind: docker (the default with an image), ssh, local, remote."""
    deploy_args: list[str] = []
    """More arguments for `agent deploy up` (e.g. `["--executable", "podman"]`)."""
    start_timeout: float = 600
    """Seconds a deployment may take to come up (pulling an image included)."""
    agent_bin: str | None = None
    """The agent binary for deployments; default `$EXECUTOR_AGENT_BIN`, else `agent` on PATH."""
    executor_bin: str | None = None
    """The executor binary for a local executor; default `$EXECUTOR_BIN`, else on PATH."""
    reconnect_attempts: int = 5


class _Resources:
    """What an environment holds, closed once by `close()` or by the garbage collector (a
    `weakref.finalize` on the environment holds this, never the environment itself)."""

    def __init__(self) -> None:
        self.client: Client | None = None
        self.local: LocalExecutor | None = None
        self.deployment: Deployment | None = None
        self._lock = threading.Lock()

    def close(self, *, wait: bool = True) -> None:
        with self._lock:
            client, self.client = self.client, None
            local, self.local = self.local, None
            deployment, self.deployment = self.deployment, None
        if client is not None:
            # A close frame: the executor kills what still runs at once.
            with contextlib.suppress(Exception):
                client.close()
        if local is not None:
            local.stop()
        if deployment is not None:
            if wait:
                deployment.stop()
            else:
                # Collected with the object (mini's batch never closes its environments):
                # the agent tears the deployment down by itself once its stdin closes.
                deployment.abandon()


class ExecutorEnvironment:
    """Runs mini-swe-agent's actions in an executor's sandbox."""

    def __init__(
        self,
        *,
        config_class: type[ExecutorEnvironmentConfig] = ExecutorEnvironmentConfig,
        logger: logging.Logger | None = None,
        **kwargs: Any,
    ) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self._resources = _Resources()
        self._finalizer = weakref.finalize(self, self._resources.close, wait=False)
        self.profile: str | None = None
        #: The executor's hello and URL, kept for template variables and the trajectory
        #: (mini saves it once more after the run, when the environment may be closed).
        self.hello: Hello
        self.url = ""
        try:
            self._start()
        except BaseException:
            self._resources.close()
            raise

    # --- mini's protocol ------------------------------------------------------------------

    def execute(
        self, action: dict[str, Any], cwd: str = "", *, timeout: int | float | None = None
    ) -> dict[str, Any]:
        """Run `action["command"]`; mini's result dictionary. Raises `Submitted` when the
        output starts with the submission sentinel and the command returned 0, and an
        `ExecutorClientError` when the environment itself is broken (never an observation)."""
        command = action.get("command", "")
        timeout = timeout or self.config.timeout
        try:
            result = self._run(
                self._wrap(command), cwd or self.config.cwd or None, timeout, self._command_env()
            )
            output = self._shape(command, timeout, result)
        except BadRequestError as e:
            # The request itself was refused (a command longer than the executor takes): the
            # model can change it, so it sees this as the command failing, as mini shows any
            # exception of `execute`.
            output = _exception_output(e, "")
        except ConnectionLostError as e:
            if not e.reconnected:
                raise
            # The executor killed the command with its session; we hold a new one.
            output = _exception_output(e, "")
        self._check_finished(output)
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config, the executor host's `platform.uname()` fields and executor facts."""
        merged: dict[str, Any] = recursive_merge(
            self.config.model_dump(), self._host_vars(), kwargs
        )
        return merged

    def serialize(self) -> dict[str, Any]:
        info: JsonDict = {
            "config": {
                "environment": self.config.model_dump(mode="json"),
                "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
            }
        }
        hello = getattr(self, "hello", None)
        if hello is not None:
            info["executor"] = {
                "url": self.url,
                "server": hello.server,
                "host": hello.raw.get("host", {}),
                "profile": self._effective_profile(),
                "profile_layers": self._profile_layers(),
                "workspace": hello.workspace,
                "interpreter": hello.interpreter,
            }
        return {"info": info}

    def close(self) -> None:
        """End the session (what still runs is killed) and stop what this environment started.
        Idempotent; also done when the environment is garbage-collected."""
        self._finalizer.detach()
        self._resources.close()

    def cleanup(self) -> None:
        """mini's name for `close()`."""
        self.close()

    def __enter__(self) -> ExecutorEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the executor ---------------------------------------------------------------------

    @property
    def client(self) -> Client:
        client = self._resources.client
        if client is None:
            raise ExecutorClientError("the environment is closed")
        return client

    def _start(self) -> None:
        config = self.config
        # Which profiles we may choose from when none is named: none (the executor's default),
        # those an executor started for us offers, or for one on this machine strict and
        # landlock only.
        choose: tuple[str, ...] | None = None
        token = None
        if config.url:
            url, token_file, fingerprint = config.url, config.token_file, config.tls_fingerprint
            token = config.token
        elif config.image or config.deployment:
            deployment = Deployment.start(
                deploy=config.deployment or "docker",
                image=config.image,
                agent_binary=config.agent_bin,
                extra_args=tuple(config.deploy_args),
                start_timeout=config.start_timeout,
            )
            self._resources.deployment = deployment
            self.logger.info(
                "deployed executor %s (%s) at %s",
                deployment.id,
                deployment.deployment,
                deployment.url,
            )
            url, token_file = deployment.url, deployment.token_file
            fingerprint = deployment.tls_fingerprint or config.tls_fingerprint
            # Started for us alone (not a shared remote one): take the strongest that works;
            # on this machine, never one that writes it.
            if deployment.deployment == "local":
                choose = LOCAL_CHOICES
            elif deployment.owned:
                choose = PROFILE_PREFERENCE
        else:
            local = LocalExecutor.start(
                config.cwd or str(Path.cwd()),
                binary=config.executor_bin,
                network=config.network,
            )
            self._resources.local = local
            self.logger.info("started a local executor at %s", local.url)
            url, token_file, fingerprint = local.url, local.token_file, None
            # Ours alone: the strongest of strict and landlock that works here (the others
            # are allowed, to be named, never chosen).
            choose = LOCAL_CHOICES
        client = Client.connect(
            url,
            token=token,
            token_file=token_file,
            tls_fingerprint=fingerprint,
            tls_ca=config.tls_ca,
            reconnect_attempts=config.reconnect_attempts,
        )
        self._resources.client = client
        hello = self.hello = client.hello
        self.url = url
        if not 0 < config.timeout <= hello.limits.max_timeout:
            raise ValueError(
                f"timeout {config.timeout} is outside the executor's range "
                f"(0, {hello.limits.max_timeout:g}]"
            )
        if config.profile:
            summary = hello.profile(config.profile)
            if summary is None:
                offered = ", ".join(p.name for p in hello.profiles)
                raise DeploymentError(
                    f"the executor offers no profile {config.profile!r} (it has: {offered})"
                )
            if not summary.available:
                raise DeploymentError(
                    f"profile {config.profile!r} cannot run on the executor's host: "
                    f"{summary.unavailable_reason or 'no reason given'}"
                )
            self.profile = config.profile
            why = "named in the environment's config (profile)"
        elif choose is not None or not hello.default_profile:
            self.profile, why = self._strongest_usable_profile(choose or PROFILE_PREFERENCE)
        else:
            why = "the executor's default"
        self.logger.info(
            "commands run under the executor's %r profile (%s); layers: %s",
            self._effective_profile(),
            why,
            ", ".join(self._profile_layers()),
        )
        if config.network is not None:
            summary = hello.profile(self._effective_profile())
            held = summary.network if summary is not None else None
            reason = (
                f" (the executor says: {held.policy_reason})"
                if config.network.mode == "policy" and held and not held.policy_enforceable
                else ""
            )
            self.logger.info("commands ask for network %s%s", config.network.to_json(), reason)

    def _strongest_usable_profile(self, choices: tuple[str, ...]) -> tuple[str, str]:
        """The first of `choices` (strongest first) the executor reports available and under
        which a probe can write the working directory (only a command shows whether the
        sandbox's identity may write it: uid 65534 cannot write a directory that is yours
        alone), and why it is the one."""
        hello = self.client.hello
        names = [p.name for p in hello.profiles]
        ordered = [p for p in PROFILE_PREFERENCE if p in names and p in choices]
        if choices == PROFILE_PREFERENCE:
            ordered += [p for p in names if p not in ordered]
        place = self.config.cwd or hello.workspace
        refused: list[str] = []
        for name in ordered:
            summary = hello.profile(name)
            if summary is not None and not summary.available:
                why = f"unavailable on this host ({summary.unavailable_reason})"
                self.logger.info("not using profile %s: %s", name, why)
                refused.append(f"{name}: {why}")
                continue
            try:
                # With the network the commands ask for: a profile that cannot hold it (a
                # policy under landlock) is not one they can run under.
                probe = self.client.exec(
                    "test -w . && test -x .",
                    cwd=self.config.cwd or None,
                    timeout=10,
                    profile=name,
                    network=self.config.network,
                )
            except (ExecutorEnvironmentError, BadRequestError) as e:
                self.logger.info("not using profile %s: %s", name, e)
                refused.append(f"{name}: {e}")
                continue
            if probe.returncode == 0:
                if choices == LOCAL_CHOICES:
                    return name, (
                        f"the strongest of {' > '.join(LOCAL_CHOICES)} whose commands can write "
                        f"{place}; task-container and trusted run only when named"
                    )
                return name, f"the strongest offered whose commands can write {place}"
            why = f"its commands cannot write {place}"
            self.logger.info("not using profile %s: %s", name, why)
            refused.append(f"{name}: {why}")
        if choices == LOCAL_CHOICES:
            raise DeploymentError(_no_local_profile(place, refused))
        raise DeploymentError(
            f"no profile of the executor can run commands that write {place} "
            f"({'; '.join(refused) or 'it offers none'}); make it writable by uid 65534 (the "
            "identity of strict and landlock) or name a profile"
        )

    def _effective_profile(self) -> str:
        return self.profile or self.hello.default_profile

    def _profile_layers(self) -> list[str]:
        summary = self.hello.profile(self._effective_profile())
        return list(summary.layers) if summary else []

    def _wrap(self, command: str) -> str:
        """With an interpreter other than the executor's: `exec <interpreter...> '<command>'`."""
        argv = self.config.interpreter
        if not argv or argv == self.client.hello.interpreter:
            return command
        return "exec " + " ".join(_quote(word) for word in [*argv, command])

    def _command_env(self) -> dict[str, str]:
        env = {k: v for k in self.config.forward_env if (v := os.environ.get(k)) is not None}
        env.update(self.config.env)
        return env

    def _run(
        self, command: str, cwd: str | None, timeout: float, env: dict[str, str]
    ) -> ExecResult:
        delay = 0.1
        for attempt in range(BUSY_RETRIES + 1):
            try:
                return self.client.exec(
                    command,
                    cwd=cwd,
                    env=env,
                    timeout=timeout,
                    profile=self.profile,
                    network=self.config.network,
                )
            except (BusyError, QuotaExceededError):
                if attempt == BUSY_RETRIES:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    @staticmethod
    def _shape(command: str, timeout: float, result: ExecResult) -> dict[str, Any]:
        if result.timed_out:
            # As mini's classes report it: the exception `subprocess.run` raises, the output
            # so far, return code -1. The executor's `extra` tells the rest (the whole tree
            # was killed, how many processes).
            error = subprocess.TimeoutExpired(command, timeout)
            return {
                "output": result.output,
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {error}",
                "extra": {
                    **result.extra,
                    "exception_type": type(error).__name__,
                    "exception": str(error),
                },
            }
        return result.to_dict()

    @staticmethod
    def _check_finished(output: dict[str, Any]) -> None:
        """mini's submission rule: the first line of the output (after leading whitespace) is
        the sentinel and the command returned 0; the rest of the output is the submission."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_SENTINEL and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def _host_vars(self) -> dict[str, Any]:
        """`platform.uname()`'s fields for the executor's host (mini's templates use
        `{{system}} {{release}} {{version}} {{machine}}`), and the Rust agent's extras."""
        hello = self.hello
        host = hello.host
        return {
            "system": host.system,
            "node": host.hostname,
            "release": host.release,
            "version": host.version,
            "machine": host.arch,
            "processor": host.arch,
            "hostname": host.hostname,
            "cores": host.cores,
            "executor_server": hello.server,
            "workspace": hello.workspace,
            "profile": self._effective_profile(),
            "profile_layers": self._profile_layers(),
        }


def _no_local_profile(place: str, refused: list[str]) -> str:
    """Neither strict nor landlock can write `place` on this machine: what each lacked, who
    owns it, and the ways out. Never a silent step down to a profile that writes the host."""
    try:
        st = Path(place).stat()
        owner = "root" if st.st_uid == 0 else f"uid {st.st_uid}"
        described = f"owned by {owner}, mode {st.st_mode & 0o7777:04o}"
    except OSError:
        st = None
        described = "which cannot be read"
    ways = [
        "work in a directory uid 65534 (the identity of strict and landlock) may write, or make "
        f"this one so (`chown -R 65534:65534 {place}`, or `chmod -R o+w {place}`)"
    ]
    if st is not None and st.st_uid != 0 and os.geteuid() == 0:
        ways.append(
            "run as the directory's owner: a local executor of an ordinary user runs landlock's "
            "commands as that user"
        )
    ways.append(
        "only in a disposable task container (a SWE-bench image's /testbed), name "
        "`profile: task-container` in the environment's config: its commands run as root and "
        "can write this machine's system directories"
    )
    return (
        f"neither strict nor landlock can run commands that write {place} ({described}): "
        f"{'; '.join(refused) or 'the executor offers neither'}. ExecutorEnvironment chooses "
        "only between those two by itself; task-container and trusted write the host and run "
        f"only when named. Ways out: {'; or '.join(ways)}"
    )


def _exception_output(error: Exception, output: str) -> dict[str, Any]:
    """How mini's classes report an exception of `execute`."""
    return {
        "output": output,
        "returncode": -1,
        "exception_info": f"An error occurred while executing the command: {error}",
        "extra": {"exception_type": type(error).__name__, "exception": str(error)},
    }


def _quote(word: str) -> str:
    """Quote a word for POSIX sh."""
    return "'" + word.replace("'", "'\\''") + "'"
