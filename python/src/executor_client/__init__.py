"""Python client for the executor sandbox daemon (protocol 1 and 1.1), and a mini-swe-agent
environment class (`executor_client.mini.ExecutorEnvironment`, needs the `mini` extra).

    from executor_client import Client, Network

    with Client.connect("ws://127.0.0.1:7681/v1/ws", token_file="/var/lib/executor/token") as c:
        print(c.hello.host.kernel, c.hello.default_profile)
        result = c.exec("echo hi; ls /nope", on_output=print)
        print(result.returncode, result.extra["isolation"]["profile"])
        # Only PyPI for this command (narrowing what this client is granted):
        c.exec("pip download requests", network=Network.policy(allow=["pypi.org:443"]))

`AsyncClient` is the same over asyncio. An executor offering protocol 1.1
(`hello.capabilities`) also keeps processes (`spawn`) and moves files (`upload`, `download`,
`upload_dir`, `download_dir`, `stat`, `list_dir`).
"""

from ._version import __version__
from .aio import AsyncClient
from .errors import (
    BadRequestError,
    BusyError,
    ConnectError,
    ConnectionLostError,
    DeniedError,
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
    UnsupportedError,
)
from .launch import Deployment, LocalExecutor
from .process import AsyncProcess
from .protocol import (
    DirListing,
    DiskQuota,
    ExecResult,
    FileStat,
    Hello,
    HostFacts,
    Isolation,
    Limits,
    Network,
    NetworkLayer,
    NetworkReport,
    NetworkSpec,
    ProcessExit,
    ProcessInfo,
    ProcessOutput,
    Profile,
    ProfileNetwork,
    Transferred,
)
from .sync import Client, Process
from .tls import fingerprint_of, parse_fingerprint

__all__ = [
    "AsyncClient",
    "AsyncProcess",
    "BadRequestError",
    "BusyError",
    "Client",
    "ConnectError",
    "ConnectionLostError",
    "DeniedError",
    "Deployment",
    "DeploymentError",
    "DirListing",
    "DiskQuota",
    "DuplicateIdError",
    "ExecResult",
    "ExecutorClientError",
    "ExecutorEnvironmentError",
    "FileStat",
    "Hello",
    "HostFacts",
    "InternalError",
    "Isolation",
    "Limits",
    "LocalExecutor",
    "Network",
    "NetworkLayer",
    "NetworkReport",
    "NetworkSpec",
    "NotFoundError",
    "PinMismatchError",
    "Process",
    "ProcessExit",
    "ProcessInfo",
    "ProcessOutput",
    "Profile",
    "ProfileDeniedError",
    "ProfileNetwork",
    "ProtocolError",
    "QuotaExceededError",
    "ServerError",
    "ShuttingDownError",
    "Transferred",
    "UnsupportedError",
    "__version__",
    "fingerprint_of",
    "parse_fingerprint",
]
