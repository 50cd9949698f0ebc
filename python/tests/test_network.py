"""Network by policy (issue 38) from the Python client: `network=` on `exec` and `spawn`
(sync and asyncio) and `ExecutorEnvironment(network=...)` reach the daemon on every command;
the hello's and the result's network reports are read. What the daemon does with a policy is
the Rust e2e suite's to check (tests/tests/e2e/network_policy.rs): here, that it received the
request, read from its answer, each beside a control with `none` that runs, and a planted
file shows on the host whether it ran. One test
checks enforcement itself: a local executor the environment starts is given its policy, and a
command reaches the allowed server on the host's loopback and not another."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Daemon, shared_dir
from minisweagent.environments import get_environment
from pydantic import ValidationError

from executor_client import (
    BadRequestError,
    Client,
    Network,
    NetworkReport,
    NetworkSpec,
)
from executor_client.mini import ExecutorEnvironment
from executor_client.protocol import exec_request

#: The "PyPI, npm and GitHub only" recipe of the README.
RECIPE = [
    "pypi.org:443",
    "files.pythonhosted.org:443",
    "registry.npmjs.org:443",
    "github.com:443",
    "codeload.github.com:443",
    "objects.githubusercontent.com:443",
]


def assert_enforceable(client: Client, profile: str) -> None:
    """The hello says a policy is enforced under `profile`."""
    summary = client.hello.profile(profile)
    assert summary is not None, client.hello.profiles
    assert summary.network is not None, summary
    assert summary.network.policy_enforceable, summary.network


def planted(daemon: Daemon) -> tuple[str, Path]:
    """A command that plants a file in the daemon's workspace, and the file."""
    name = f"ran-{uuid.uuid4().hex}"
    return f"touch {name}", Path(daemon.workspace) / name


def request_layer(report: NetworkReport) -> list[str]:
    layers = [layer for layer in report.layers if layer.layer == "request"]
    assert len(layers) == 1, report
    return layers[0].allow


def test_a_network_is_sent_in_the_protocols_shape_and_a_bad_shape_never_leaves() -> None:
    def sent(network: Any) -> Any:
        return exec_request(
            "c1", "true", cwd=None, env=None, timeout=None, profile=None, stream=False,
            network=network,
        )["network"]  # fmt: skip

    policy = {"mode": "policy", "allow": ["pypi.org:443"], "deny": ["evil.pypi.org"]}
    assert sent(Network.policy(allow=["pypi.org:443"], deny=["evil.pypi.org"])) == policy
    assert sent(policy) == policy
    assert sent(Network.policy(["pypi.org:443"])) == {"mode": "policy", "allow": ["pypi.org:443"]}
    assert sent(Network.none()) == {"mode": "none"}
    assert sent("none") == {"mode": "none"}
    assert sent(Network.host()) == {"mode": "host"}
    assert sent({"mode": "host"}) == {"mode": "host"}
    assert "network" not in exec_request(
        "c1", "true", cwd=None, env=None, timeout=None, profile=None, stream=False
    )
    bad_ones: list[tuple[Any, type[Exception], str]] = [
        ("open", ValueError, "none, host or policy, not 'open'"),
        ("policy", ValueError, "needs its allow rules"),
        ({"mode": "policy"}, ValueError, "allows nothing"),
        ({"mode": "policy", "alow": ["pypi.org"]}, ValueError, "unknown key 'alow'"),
        ({"allow": ["pypi.org"]}, ValueError, "needs a mode"),
        ({"mode": "none", "allow": ["pypi.org"]}, ValueError, "takes no allow or deny"),
        ({"mode": "policy", "allow": "pypi.org"}, TypeError, "must be a list of rules"),
        ({"mode": "policy", "allow": [443]}, TypeError, "must be a list of rules"),
        ({"mode": "policy", "allow": [" "]}, ValueError, "empty rule"),
        (["pypi.org"], TypeError, "not list"),
    ]
    for bad, error, says in bad_ones:
        with pytest.raises(error, match=None) as raised:
            sent(bad)
        assert says in str(raised.value), (bad, raised.value)
    with pytest.raises(TypeError, match="not one string"):
        Network.policy("pypi.org:443")


def test_the_hello_states_each_profiles_network_and_this_clients_ceiling(daemon: Daemon) -> None:
    with daemon.connect() as client:
        hello = client.hello
        assert hello.network == NetworkReport(mode="host")
        networks = {p.name: p.network for p in hello.profiles}
        assert networks["strict"] is not None
        assert networks["strict"].mode == "none"
        assert networks["task-container"] is not None
        assert networks["task-container"].mode == "host"
        landlock = networks["landlock"]
        assert landlock is not None
        assert not landlock.policy_enforceable
        assert "no network namespace" in landlock.policy_reason


def test_a_policy_reaches_the_daemon_beside_none_which_runs(daemon: Daemon) -> None:
    with daemon.connect() as client:
        assert_enforceable(client, "task-container")
        networks: list[NetworkSpec] = [
            Network.policy(allow=RECIPE, deny=["evil.pypi.org"]),
            {"mode": "policy", "allow": RECIPE},
        ]
        for network in networks:
            command, file = planted(daemon)
            result = client.exec(command, profile="task-container", network=network)
            report = result.isolation.network
            assert report is not None, result.extra
            assert report.mode == "policy", report
            assert request_layer(report) == RECIPE
            assert file.exists()
        # Under strict this client is granted no network: the request's policy cannot widen
        # it. The command runs with none, and the report says why (the daemon read the policy).
        command, file = planted(daemon)
        result = client.exec(command, profile="strict", network=Network.policy(RECIPE))
        assert result.returncode == 0, result
        report = result.isolation.network
        assert report is not None, result.extra
        assert report.mode == "none", report
        assert "cannot widen" in report.note, report
        assert file.exists()
        # Control: none under task-container runs, and the report says none.
        command, file = planted(daemon)
        result = client.exec(command, profile="task-container", network=Network.none())
        assert result.returncode == 0, result
        assert result.isolation.profile == "task-container"
        assert result.isolation.network == NetworkReport(mode="none")
        assert file.exists(), "the control did not run"


def test_a_bad_rule_raises_bad_request_naming_the_rule_and_nothing_runs(daemon: Daemon) -> None:
    with daemon.connect() as client:
        command, file = planted(daemon)
        bad = Network.policy(allow=["pypi.org:443", "*"])
        with pytest.raises(BadRequestError, match='rule "\\*"'):
            client.exec(command, profile="strict", network=bad)
        client.require("processes")
        with pytest.raises(BadRequestError, match='rule "\\*"'):
            client.spawn(command, profile="strict", network=bad)
        assert not file.exists(), "a refused request ran"
        # Control: the same command, well formed, runs.
        result = client.exec(command, profile="strict", network=Network.policy(["pypi.org:443"]))
        assert result.returncode == 0, result
        assert file.exists()


def test_spawn_and_the_asyncio_client_carry_the_network(daemon: Daemon) -> None:
    async def main() -> None:
        async with await daemon.connect_async() as client:
            summary = client.hello.profile("task-container")
            assert summary is not None
            assert summary.network is not None
            assert summary.network.policy_enforceable, summary.network
            # A policy, by exec and by spawn.
            command, file = planted(daemon)
            result = await client.exec(
                command, profile="task-container", network=Network.policy(RECIPE)
            )
            assert result.isolation.network is not None, result.extra
            assert result.isolation.network.mode == "policy", result.extra
            assert file.exists()
            process = await client.spawn(
                "echo spawned", profile="task-container", network=Network.policy(RECIPE)
            )
            ended = await process.wait(timeout=20)
            assert ended.returncode == 0, ended
            assert ended.isolation.network is not None, ended.extra
            assert ended.isolation.network.mode == "policy", ended.extra
            # Controls: none, by exec and by spawn.
            command, file = planted(daemon)
            result = await client.exec(command, profile="task-container", network="none")
            assert result.isolation.network == NetworkReport(mode="none")
            assert file.exists()
            process = await client.spawn(
                "echo spawned", profile="task-container", network=Network.none()
            )
            ended = await process.wait(timeout=20)
            assert ended.returncode == 0, ended
            assert ended.isolation.network == NetworkReport(mode="none"), ended.extra

    asyncio.run(main())


def test_the_mini_environment_asks_for_its_network_on_every_command(daemon: Daemon) -> None:
    policy = {"mode": "policy", "allow": RECIPE, "deny": ["evil.pypi.org"]}
    environment = get_environment(
        {
            "environment_class": "executor_client.mini.ExecutorEnvironment",
            "url": daemon.url,
            "token_file": daemon.token_file,
            "cwd": daemon.workspace,
            "profile": "task-container",
            "network": policy,
        }
    )
    try:
        assert isinstance(environment, ExecutorEnvironment)
        assert environment.config.network == Network.policy(RECIPE, ["evil.pypi.org"])
        # The trajectory records it in the protocol's shape.
        recorded = environment.serialize()["info"]["config"]["environment"]["network"]
        assert recorded == policy
        command, file = planted(daemon)
        assert_enforceable(environment.client, "task-container")
        output = environment.execute({"command": command})
        assert output["extra"]["isolation"]["network"]["mode"] == "policy"
        assert file.exists()
    finally:
        environment.close()
    # Control: none runs, and every command's report says so.
    environment = ExecutorEnvironment(
        url=daemon.url,
        token_file=daemon.token_file,
        cwd=daemon.workspace,
        profile="task-container",
        network="none",
    )
    try:
        assert environment.serialize()["info"]["config"]["environment"]["network"] == {
            "mode": "none"
        }
        command, file = planted(daemon)
        for action in (command, "echo again"):
            output = environment.execute({"command": action})
            assert output["returncode"] == 0, output
            assert output["extra"]["isolation"]["network"] == {"mode": "none"}
        assert file.exists()
    finally:
        environment.close()


def test_the_mini_environment_refuses_a_bad_network_shape_naming_it(
    daemon: Daemon,
) -> None:
    with pytest.raises(ValidationError, match="unknown key 'alow'"):
        ExecutorEnvironment(
            url=daemon.url,
            token_file=daemon.token_file,
            network={"mode": "policy", "alow": ["pypi.org"]},
        )
    with pytest.raises(ValidationError, match="must be a list of rules"):
        ExecutorEnvironment(
            url=daemon.url,
            token_file=daemon.token_file,
            network={"mode": "policy", "allow": "pypi.org"},
        )
    # Control: no network named, the client's; nothing recorded.
    environment = ExecutorEnvironment(url=daemon.url, token_file=daemon.token_file)
    try:
        assert environment.config.network is None
        assert environment.serialize()["info"]["config"]["environment"]["network"] is None
        assert environment.execute({"command": "true"})["returncode"] == 0
    finally:
        environment.close()


class _CountingServer(http.server.ThreadingHTTPServer):
    """An HTTP server on the host's loopback answering every GET with 200, counting them."""

    seen = 0

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Counted)


class _Counted(http.server.BaseHTTPRequestHandler):
    server: _CountingServer

    def do_GET(self) -> None:
        self.server.seen += 1
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def two_servers() -> Iterator[tuple[_CountingServer, _CountingServer]]:
    """Two HTTP servers on the host's loopback, each counting the requests it gets."""
    servers = (_CountingServer(), _CountingServer())
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_local_executor_started_with_a_policy_reaches_the_allowed_server_and_not_another(
    two_servers: tuple[_CountingServer, _CountingServer],
) -> None:
    # With no url the environment starts an executor of its own, whose one client (us) gets
    # the policy as its ceiling: under strict a requested policy is then that policy (with a
    # ceiling of `host` it would be no network at all). Loopback is special to a policy, so
    # the rule names it by address: the allowed server's port only.
    allowed, other = (server.server_address[1] for server in two_servers)
    environment = ExecutorEnvironment(
        cwd=shared_dir(),
        profile="strict",
        network={"mode": "policy", "allow": [f"127.0.0.1/32:{allowed}"]},
    )
    try:
        # Through the sandbox's proxy (its environment excepts 127.0.0.1 from it by default).
        curl = "curl -s -o /dev/null -m 20 -w '%{http_code}' -x http://127.0.0.1:3128 --noproxy ''"
        output = environment.execute(
            {
                "command": f"echo $({curl} http://127.0.0.1:{allowed}/) "
                f"$({curl} http://127.0.0.1:{other}/)"
            }
        )
        assert output["output"] == "200 403\n", output
        assert output["extra"]["isolation"]["network"]["mode"] == "policy", output
        assert [server.seen for server in two_servers] == [1, 0]
        # The refusal is in the executor's decision log, under its one client.
        local = environment._resources.local
        assert local is not None
        log = Path(local.state_dir.name) / "audit.network.jsonl"
        records = [json.loads(line) for line in log.read_text().splitlines()]
        decided = {(r["port"], r["allowed"]) for r in records if r["client"] == "default"}
        assert decided == {(allowed, True), (other, False)}, records
    finally:
        environment.close()
