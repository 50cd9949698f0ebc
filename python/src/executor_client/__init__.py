"""Python client for the executor sandbox daemon (protocol 1), and a mini-swe-agent
environment class (`executor_client.mini.ExecutorEnvironment`, needs the `mini` extra).

    from executor_client import Client

    with Client.connect("ws://127.0.0.1:7681/v1/ws", token_file="/var/lib/executor/token") as c:
        print(c.hello.host.kernel, c.hello.default_profile)
        result = c.exec("echo hi; ls /nope", on_output=print)
        print(result.returncode, result.extra["isolation"]["profile"])

`AsyncClient` is the same over asyncio.
"""

from ._version import __version__
from .aio import AsyncClient
from .errors import (
    BadRequestError,
    BusyError,
    ConnectError,
    ConnectionLostError,
    DeploymentError,
    DuplicateIdError,
    ExecutorClientError,
    ExecutorEnvironmentError,
    InternalError,
    NotFoundError,
    PinMismatchError,
    ProfileDeniedError,
    ProtocolError,
    QuotaExceededError,
    ServerError,
    ShuttingDownError,
)
from .launch import Deployment, LocalExecutor
from .protocol import ExecResult, Hello, HostFacts, Limits, Profile
from .sync import Client
from .tls import fingerprint_of, parse_fingerprint

__all__ = [
    "AsyncClient",
    "BadRequestError",
    "BusyError",
    "Client",
    "ConnectError",
    "ConnectionLostError",
    "Deployment",
    "DeploymentError",
    "DuplicateIdError",
    "ExecResult",
    "ExecutorClientError",
    "ExecutorEnvironmentError",
    "Hello",
    "HostFacts",
    "InternalError",
    "Limits",
    "LocalExecutor",
    "NotFoundError",
    "PinMismatchError",
    "Profile",
    "ProfileDeniedError",
    "ProtocolError",
    "QuotaExceededError",
    "ServerError",
    "ShuttingDownError",
    "__version__",
    "fingerprint_of",
    "parse_fingerprint",
]
