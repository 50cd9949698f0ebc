"""The wire types of protocol 1 (`protocol/README.md` in the repository), read from JSON.

Replies may gain fields within protocol 1: readers here ignore what they do not know and keep
the whole message in `raw`. Requests are built as plain dicts, with only the documented
fields (the executor rejects unknown ones). Protocol 1.1 (processes, files) is what a daemon
lists in `hello.capabilities`; its types are at the end.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import ProtocolError

PROTOCOL_VERSION = 1
WS_PATH = "/v1/ws"
#: Protocol 1.1's additions, as `hello.capabilities` names them.
CAPABILITIES = ("processes", "pty", "files", "tar")

JsonDict = dict[str, Any]


def _str(value: object, default: str = "") -> str:
    return value if isinstance(value, str) else default


def _int(value: object, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _float(value: object, default: float = 0.0) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return default


def _strs(value: object) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _dict(value: object) -> JsonDict:
    return value if isinstance(value, dict) else {}


#: How a reply's field is read, by the type the dataclass declares for it: a value of another
#: type (or none) reads as that type's empty value, as readers of protocol 1 must allow.
_READERS: dict[str, Callable[[object], object]] = {
    "str": _str,
    "int": _int,
    "float": _float,
    "bool": bool,
    "list[str]": _strs,
    "JsonDict": _dict,
    "str | None": lambda value: value if isinstance(value, str) else None,
    "int | None": lambda value: value if isinstance(value, int) else None,
}


def _read(cls: type, reply: JsonDict, /, **given: object) -> dict[str, Any]:
    """The arguments of dataclass `cls` from `reply`, each field read by its declared type;
    `given` holds those that need more (a nested type, a default other than empty)."""
    read = dict(given)
    for f in fields(cls):
        if f.name not in read:
            read[f.name] = _READERS[str(f.type)](reply.get(f.name))
    return read


@dataclass(frozen=True)
class HostFacts:
    """The executor's host: `uname` facts and what it can enforce."""

    hostname: str
    #: `uname -s` and `uname -r` together, e.g. `Linux 6.18.44`.
    kernel: str
    #: `uname -v`.
    version: str
    #: `uname -m`.
    arch: str
    cores: int
    #: `{mode, kill, pids, memory}`.
    cgroups: JsonDict
    landlock_abi: int

    @property
    def system(self) -> str:
        """`uname -s` (`Linux`)."""
        return self.kernel.split(" ", 1)[0]

    @property
    def release(self) -> str:
        """`uname -r` (`6.18.44`)."""
        parts = self.kernel.split(" ", 1)
        return parts[1] if len(parts) > 1 else ""

    @classmethod
    def from_json(cls, data: JsonDict) -> HostFacts:
        return cls(**_read(cls, data))


# --- network by policy ------------------------------------------------------------------


@dataclass(frozen=True)
class Network:
    """The network a command asks for (`network=` of `exec` and `spawn`). It narrows what the
    executor grants this client and never widens it: `host` under a client policy is that
    policy, a policy under `none` is `none` (the result's `isolation.network.note` says so).

    Rules are strings the executor checks (`pypi.org:443`, `*.github.com`, `10.0.0.0/8:5432`,
    `[::1]:8080`); it answers a rule it cannot read with `BadRequestError` naming it. Deny
    rules win over allow rules.

        Network.policy(allow=["pypi.org:443", "files.pythonhosted.org:443"])
        Network.none()
    """

    #: `none`, `host` or `policy`.
    mode: str
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in ("none", "host", "policy"):
            raise ValueError(f"network mode must be none, host or policy, not {self.mode!r}")
        for name, rules in (("allow", self.allow), ("deny", self.deny)):
            if isinstance(rules, str) or not all(isinstance(r, str) for r in rules):
                raise TypeError(f"network {name} must be a list of rules (strings), got {rules!r}")
            if any(not r.strip() for r in rules):
                raise ValueError(f"network {name} holds an empty rule")
        if self.mode != "policy" and (self.allow or self.deny):
            raise ValueError(f"network mode {self.mode} takes no allow or deny rules")
        if self.mode == "policy" and not self.allow:
            raise ValueError(
                "a network policy with no allow rule allows nothing; use Network.none()"
            )

    @classmethod
    def none(cls) -> Network:
        """No network at all."""
        return cls("none")

    @classmethod
    def host(cls) -> Network:
        """Whatever the client is granted, unnarrowed."""
        return cls("host")

    @classmethod
    def policy(cls, allow: Iterable[str], deny: Iterable[str] = ()) -> Network:
        """Only what `allow` names (and every other layer allows), minus what `deny` names."""
        if isinstance(allow, str) or isinstance(deny, str):
            raise TypeError("allow and deny are lists of rules, not one string")
        return cls("policy", tuple(allow), tuple(deny))

    @classmethod
    def of(cls, value: NetworkSpec) -> Network:
        """A `Network` from itself, a mode (`"none"`, `"host"`) or the protocol's dict
        (`{"mode": "policy", "allow": [...], "deny": [...]}`); `ValueError` or `TypeError`
        naming what is wrong."""
        if isinstance(value, Network):
            return value
        if isinstance(value, str):
            if value == "policy":
                raise ValueError("network mode policy needs its allow rules")
            return cls(value)
        if not isinstance(value, dict):
            raise TypeError(
                f"network must be a Network, a mode or a dict, not {type(value).__name__}"
            )
        unknown = sorted(set(value) - {"mode", "allow", "deny"})
        if unknown:
            raise ValueError(f"network: unknown key {unknown[0]!r}")
        mode = value.get("mode")
        if mode is None:
            raise ValueError("network needs a mode: none, host or policy")
        if not isinstance(mode, str):
            raise TypeError(f"network mode must be a string, got {mode!r}")
        allow, deny = value.get("allow") or [], value.get("deny") or []
        for name, rules in (("allow", allow), ("deny", deny)):
            if not isinstance(rules, (list, tuple)):
                raise TypeError(f"network {name} must be a list of rules, got {rules!r}")
        return cls(mode, tuple(allow), tuple(deny))

    def to_json(self) -> JsonDict:
        """The request's `network` field."""
        data: JsonDict = {"mode": self.mode}
        if self.mode == "policy":
            data["allow"] = list(self.allow)
            if self.deny:
                data["deny"] = list(self.deny)
        return data


#: What `network=` takes: a `Network`, a mode, or the protocol's dict.
NetworkSpec = Network | str | JsonDict


@dataclass(frozen=True)
class NetworkLayer:
    """One layer of a policy: `profile`, `client` or `request`, and its rules."""

    layer: str
    allow: list[str]
    deny: list[str]

    @classmethod
    def from_json(cls, data: JsonDict) -> NetworkLayer:
        return cls(**_read(cls, data))


@dataclass(frozen=True)
class NetworkReport:
    """A network as the executor states it: this client's ceiling (`hello.network`), or a
    command's (`result.isolation.network`)."""

    #: `none`, `host` or `policy`.
    mode: str
    #: Under `policy`, every layer that filters, outermost first: a connection is allowed only
    #: when each of them allows it.
    layers: list[NetworkLayer] = field(default_factory=list)
    #: How the layers came to this when it is not what the request asked for.
    note: str = ""

    @classmethod
    def from_json(cls, data: JsonDict) -> NetworkReport:
        layers = [NetworkLayer.from_json(_dict(x)) for x in data.get("layers") or []]
        return cls(**_read(cls, data, layers=layers))


def _network_report(value: object) -> NetworkReport | None:
    return NetworkReport.from_json(value) if isinstance(value, dict) else None


@dataclass(frozen=True)
class ProfileNetwork:
    """What a profile gives by default, and whether a policy can be enforced under it."""

    #: `none`, `host` or `policy` (then `allow` and `deny` are the profile's rules).
    mode: str
    allow: list[str] = field(default_factory=list)
    deny: list[str] = field(default_factory=list)
    policy_enforceable: bool = False
    #: Why not, when it cannot.
    policy_reason: str = ""

    @classmethod
    def from_json(cls, data: JsonDict) -> ProfileNetwork:
        return cls(**_read(cls, data))


def _profile_network(value: object) -> ProfileNetwork | None:
    return ProfileNetwork.from_json(value) if isinstance(value, dict) else None


@dataclass(frozen=True)
class Isolation:
    """`extra["isolation"]` of a result: what the command ran under."""

    profile: str
    #: The layers applied, e.g. `mount_ns`, `seccomp`.
    layers: list[str]
    #: Parts of the profile this host could not apply.
    missing: list[str]
    #: The network it ran with; `None` from executors older than network policies.
    network: NetworkReport | None = None

    @classmethod
    def from_json(cls, data: JsonDict) -> Isolation:
        return cls(**_read(cls, data, network=_network_report(data.get("network"))))


@dataclass(frozen=True)
class Profile:
    """A sandbox profile this connection may use."""

    name: str
    description: str
    #: Whether the executor's host can run it (it ran `true` under it at start).
    available: bool
    layers: list[str]
    #: Parts of its policy this host cannot apply and the profile does without.
    missing: list[str]
    unavailable_reason: str | None
    #: Its default network and whether it can hold a policy; `None` from older executors.
    network: ProfileNetwork | None = None

    @classmethod
    def from_json(cls, data: JsonDict) -> Profile:
        return cls(**_read(cls, data, network=_profile_network(data.get("network"))))


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int
    max_command_bytes: int
    max_env_entries: int
    max_env_bytes: int
    max_id_bytes: int
    default_timeout: float
    max_timeout: float
    max_output_bytes: int
    max_commands_per_connection: int
    max_commands_total: int
    #: Protocol 1.1: output kept per process for `read` (older bytes fall out); 0 from 1.0.
    max_process_buffer_bytes: int = 0
    #: Protocol 1.1: largest file (or tar stream) `upload` takes; 0 from 1.0.
    max_upload_bytes: int = 0

    @classmethod
    def from_json(cls, data: JsonDict) -> Limits:
        return cls(
            **_read(
                cls,
                data,
                default_timeout=_float(data.get("default_timeout"), 30.0),
                max_timeout=_float(data.get("max_timeout"), 86400.0),
            )
        )


@dataclass(frozen=True)
class DiskQuota:
    """`hello.disk_quota`: the client's disk quota and the mechanism in force."""

    #: `ext4_loop` (workspace, home and TMPDIR on a filesystem of the client's own) or `none`.
    mechanism: str
    bytes: int = 0
    files: int = 0
    #: What the quota holds: `workspace`, `home`, `tmp`.
    covers: list[str] = field(default_factory=list)
    #: Why there is none, or why something is not covered.
    reason: str = ""

    @classmethod
    def from_json(cls, data: JsonDict) -> DiskQuota:
        return cls(**_read(cls, data, mechanism=_str(data.get("mechanism")) or "none"))


@dataclass(frozen=True)
class Hello:
    """The first message of every connection: what the executor is and offers."""

    protocol: int
    #: `executor <version>`.
    server: str
    host: HostFacts
    profiles: list[Profile]
    #: Used when a request names none; empty if neither `strict` nor `landlock` runs.
    default_profile: str
    limits: Limits
    #: The argv a command is appended to, e.g. `["bash", "-c"]`.
    interpreter: list[str]
    workspace: str
    client: str
    session: str
    #: Seconds this session's commands outlive a dropped connection (0: killed at once).
    resume_grace: float
    #: `[{name, reason}]`: profiles the daemon has but does not offer.
    not_offered: list[JsonDict]
    raw: JsonDict = field(repr=False, compare=False)
    #: What the executor offers beyond protocol 1 (`CAPABILITIES`); empty from a 1.0 one.
    capabilities: list[str] = field(default_factory=list)
    #: The client's disk quota; `mechanism == "none"` from daemons without one (or older ones).
    disk_quota: DiskQuota = field(default_factory=lambda: DiskQuota(mechanism="none"))
    #: This client's network ceiling (requests narrow it, never widen it); `None` from
    #: executors older than network policies.
    network: NetworkReport | None = None

    def profile(self, name: str) -> Profile | None:
        return next((p for p in self.profiles if p.name == name), None)

    @classmethod
    def from_json(cls, data: JsonDict) -> Hello:
        if data.get("type") != "hello":
            raise ProtocolError(f"expected a hello, got {data.get('type')!r}")
        return cls(
            **_read(
                cls,
                data,
                host=HostFacts.from_json(_dict(data.get("host"))),
                profiles=[Profile.from_json(_dict(p)) for p in data.get("profiles") or []],
                limits=Limits.from_json(_dict(data.get("limits"))),
                not_offered=[_dict(n) for n in data.get("not_offered") or []],
                raw=data,
                disk_quota=DiskQuota.from_json(_dict(data.get("disk_quota"))),
                network=_network_report(data.get("network")),
            )
        )


@dataclass(frozen=True)
class ExecResult:
    """A command's result: mini-swe-agent's result dictionary plus the executor's `extra`."""

    id: str
    #: stdout and stderr merged in order (head and tail kept past `max_output_bytes`).
    output: str
    #: The exit code; `-N` for signal N; -1 when it did not finish on its own.
    returncode: int
    #: Empty when it ran to its end; else what stopped it.
    exception_info: str
    #: `ended`, `timed_out`, `cancelled`, `duration_ms`, `output_bytes`, `isolation`, ...
    extra: JsonDict

    @property
    def ended(self) -> str:
        return _str(self.extra.get("ended"))

    @property
    def timed_out(self) -> bool:
        return bool(self.extra.get("timed_out"))

    @property
    def cancelled(self) -> bool:
        return bool(self.extra.get("cancelled"))

    @property
    def isolation(self) -> Isolation:
        """What it ran under: profile, layers, and its network (`isolation.network`)."""
        return Isolation.from_json(_dict(self.extra.get("isolation")))

    def to_dict(self) -> JsonDict:
        """mini's shape: `output`, `returncode`, `exception_info`, `extra`."""
        return {
            "output": self.output,
            "returncode": self.returncode,
            "exception_info": self.exception_info,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_json(cls, data: JsonDict) -> ExecResult:
        returncode = data.get("returncode")
        if not isinstance(returncode, int):
            raise ProtocolError(f"a result without a return code: {data!r:.200}")
        return cls(**_read(cls, data, returncode=returncode))


def exec_request(
    request_id: str,
    command: str,
    *,
    cwd: str | None,
    env: dict[str, str] | None,
    timeout: float | None,
    profile: str | None,
    stream: bool,
    network: NetworkSpec | None = None,
) -> JsonDict:
    """An `exec` message with only the fields that are set (`network` checked for its shape:
    `ValueError` or `TypeError` naming what is wrong)."""
    message: JsonDict = {"type": "exec", "id": request_id, "command": command}
    if cwd:
        message["cwd"] = cwd
    if env:
        message["env"] = dict(env)
    if timeout is not None:
        message["timeout"] = timeout
    if profile:
        message["profile"] = profile
    if stream:
        message["stream"] = True
    if network is not None:
        message["network"] = Network.of(network).to_json()
    return message


# --- protocol 1.1: processes and files ---------------------------------------------------


def encode_bytes(data: bytes) -> str:
    """Bytes as the protocol's `data` fields carry them (standard base64, padded)."""
    return base64.b64encode(data).decode("ascii")


def decode_bytes(value: object) -> bytes:
    if not isinstance(value, str):
        raise ProtocolError(f"expected base64 data, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ProtocolError(f"invalid base64 data: {e}") from e


@dataclass(frozen=True)
class ProcessOutput:
    """A piece of a process's output (the answer to `read`)."""

    #: Where `data` starts in the process's whole output.
    offset: int
    data: bytes
    #: Read from here next time.
    next_offset: int
    #: Bytes before `offset` that fell out of the executor's buffer unread (0: none lost).
    dropped: int
    #: The output has ended and `next_offset` is its end.
    eof: bool

    @classmethod
    def from_json(cls, data: JsonDict) -> ProcessOutput:
        return cls(**_read(cls, data, data=decode_bytes(data.get("data", ""))))


@dataclass(frozen=True)
class ProcessExit:
    """The answer to `wait`: how a process ended, or `running` if it has not yet."""

    id: str
    running: bool
    #: As in `ExecResult` (placeholders while running).
    returncode: int
    exception_info: str
    #: `ended`, `timed_out`, `duration_ms`, ... (empty while running).
    extra: JsonDict

    @property
    def isolation(self) -> Isolation:
        """What it ran under, its network included (empty while running)."""
        return Isolation.from_json(_dict(self.extra.get("isolation")))

    @classmethod
    def from_json(cls, data: JsonDict) -> ProcessExit:
        return cls(**_read(cls, data, returncode=_int(data.get("returncode"), -1)))


@dataclass(frozen=True)
class ProcessInfo:
    """One of the session's processes, as `list_processes` reports it."""

    id: str
    command: str
    pty: bool
    running: bool
    returncode: int | None
    output_bytes: int

    @classmethod
    def from_json(cls, data: JsonDict) -> ProcessInfo:
        return cls(**_read(cls, data))


@dataclass(frozen=True)
class FileStat:
    """One path's facts (symbolic links not followed)."""

    #: The absolute path (`stat`) or the entry's name (`list_dir`).
    name: str
    #: `file`, `dir`, `symlink`, `fifo`, `socket`, `char`, `block`.
    kind: str
    size: int
    #: Permission bits (`0o7777`).
    mode: int
    uid: int
    gid: int
    #: Seconds since the epoch.
    mtime: int
    #: Where a symbolic link points.
    target: str | None = None

    @classmethod
    def from_json(cls, data: JsonDict) -> FileStat:
        return cls(**_read(cls, data))


@dataclass(frozen=True)
class DirListing:
    path: str
    #: Sorted by name.
    entries: list[FileStat]
    #: More entries than the executor lists (10,000).
    truncated: bool

    @classmethod
    def from_json(cls, data: JsonDict) -> DirListing:
        entries = [FileStat.from_json(_dict(e)) for e in data.get("entries") or []]
        return cls(**_read(cls, data, entries=entries))


@dataclass(frozen=True)
class Transferred:
    """An upload or download completed: the absolute path as a command sees it, and the
    bytes that went over the wire (for a tar transfer, the archive's)."""

    path: str
    bytes: int

    @classmethod
    def from_json(cls, data: JsonDict) -> Transferred:
        return cls(**_read(cls, data))
