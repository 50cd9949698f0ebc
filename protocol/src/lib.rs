//! Wire protocol between an executor daemon and its clients.
//!
//! Plain data: every message is one JSON text frame on a WebSocket, tagged by `type`.
//! `protocol/README.md` documents the fields and shows a whole session as a transcript.
//! Requests reject unknown fields so a misspelt option (`timout`) is an error, not a silent
//! default; replies may gain fields over time, so clients should ignore fields they do not know.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

mod files;
mod processes;

pub use files::*;
pub use processes::*;

/// What this daemon adds to version 1 (protocol 1.1), listed in [`Hello::capabilities`]: a
/// client checks for a name before it uses the requests it covers.
pub const CAPABILITIES: &[&str] = &["processes", "pty", "files", "tar"];

/// Version of this protocol, sent in [`Hello::protocol`]. Bumped only for breaking changes.
pub const PROTOCOL_VERSION: u32 = 1;

/// Path of the WebSocket endpoint.
pub const WS_PATH: &str = "/v1/ws";

/// Exit code reported when a command did not finish on its own (timeout, cancel, error),
/// as mini-swe-agent does.
pub const RETURNCODE_NOT_FINISHED: i32 = -1;

/// Messages a client sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ClientMessage {
    Exec(ExecRequest),
    Cancel(CancelRequest),
    /// Re-attach this connection to a session whose connection dropped (first message only).
    Resume(ResumeRequest),
    // Protocol 1.1: processes.
    Spawn(SpawnRequest),
    Write(WriteRequest),
    Read(ReadRequest),
    Signal(SignalRequest),
    Resize(ResizeRequest),
    Wait(WaitRequest),
    ListProcesses(ListProcessesRequest),
    // Protocol 1.1: files.
    Upload(UploadRequest),
    Download(DownloadRequest),
    Stat(StatRequest),
    ListDir(ListDirRequest),
}

/// Run one shell command as a fresh process session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// Chosen by the client, unique among the connection's running commands.
    pub id: String,
    /// Passed to the interpreter as `<interpreter> -c <command>`.
    pub command: String,
    /// Working directory; the daemon's workspace when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Added to the cleared environment and the profile's defaults; wins over both.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Wall-clock limit in seconds (fractions allowed); the daemon's default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<f64>,
    /// Sandbox profile name; the daemon's default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// Send `output` messages while the command runs, in addition to the final result.
    #[serde(default, skip_serializing_if = "is_false")]
    pub stream: bool,
}

pub(crate) fn is_false(value: &bool) -> bool {
    !*value
}

/// Stop a running command; its result follows with `extra.cancelled = true`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelRequest {
    pub id: String,
}

/// Messages the daemon sends.
/// Ask for a dropped connection's session back. `awaiting` lists the ids the client has no
/// result for yet: their results are (re)sent even if they were written to the old connection
/// just before it broke; results of ids not listed are forgotten.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResumeRequest {
    pub session: String,
    #[serde(default)]
    pub awaiting: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerMessage {
    /// Boxed: sent once per connection and far larger than every other message.
    Hello(Box<Hello>),
    /// The answer to `resume`: the session is this connection's now. Results and output the
    /// client missed follow it.
    Resumed(Resumed),
    Output(OutputChunk),
    Result(ExecResult),
    Error(ErrorMessage),
    // Protocol 1.1.
    Spawned(Spawned),
    ProcessOutput(ProcessOutput),
    Exited(Exited),
    Processes(ProcessList),
    Done(Done),
    Uploaded(Uploaded),
    DownloadData(DownloadData),
    Downloaded(Downloaded),
    FileInfo(FileInfo),
    DirListing(DirListing),
}

/// First message on every connection.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub protocol: u32,
    /// `executor <version>`.
    pub server: String,
    pub host: HostFacts,
    /// Profiles this connection may ask for.
    pub profiles: Vec<ProfileSummary>,
    /// Profile used when a request names none: the strongest this host can run. Empty when
    /// it can run none of the defaults (then every request must name a profile).
    pub default_profile: String,
    pub limits: Limits,
    /// Interpreter commands run under, e.g. `["bash", "-c"]`.
    pub interpreter: Vec<String>,
    /// Default working directory of commands.
    pub workspace: String,
    /// The authenticated client's name (`default` with a single token).
    #[serde(default)]
    pub client: String,
    /// This connection's session, for `resume` after a dropped connection.
    #[serde(default)]
    pub session: String,
    /// Seconds a session's commands keep running after its connection drops (0: killed at once).
    #[serde(default)]
    pub resume_grace: f64,
    /// Profiles the daemon has but does not offer, and why (`trusted` and profiles that write
    /// the host's system files are offered only when the operator names them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_offered: Vec<NotOffered>,
    /// What the daemon offers beyond protocol 1 ([`CAPABILITIES`]); empty from a 1.0 daemon.
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// This client's disk quota and the mechanism enforcing it (absent from older daemons).
    #[serde(default)]
    pub disk_quota: DiskQuotaInfo,
}

/// A client's disk quota, as the hello states it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DiskQuotaInfo {
    /// `ext4_loop` (a filesystem of the client's own, an ext4 image on a loop device), or
    /// `none` (then `reason` says why).
    pub mechanism: String,
    /// Size of the client's filesystem (usable: a little less, ext4's metadata and journal).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// Its inodes: files, directories and symlinks together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<u64>,
    /// What the quota holds: `workspace`, `home`, `tmp` (the client's `TMPDIR`, `{home}/tmp`).
    #[serde(default)]
    pub covers: Vec<String>,
    /// Why there is none, or what it leaves out.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

/// A profile the daemon knows but does not let clients use.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NotOffered {
    pub name: String,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Resumed {
    pub session: String,
    /// Ids of the session's commands still running.
    pub running: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HostFacts {
    pub hostname: String,
    /// `uname -sr`, e.g. `Linux 6.18.44`.
    pub kernel: String,
    /// `uname -v`, the kernel build (mini-swe-agent templates show it as `version`).
    #[serde(default)]
    pub version: String,
    pub arch: String,
    pub cores: u32,
    /// What the host's cgroups give the daemon.
    #[serde(default)]
    pub cgroups: CgroupFacts,
    /// Landlock ABI of the kernel (0: no landlock); profiles name the rights a lower ABI lacks
    /// in `missing`.
    #[serde(default)]
    pub landlock_abi: u32,
}

/// The cgroups the daemon found and uses.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CgroupFacts {
    /// `v2` (one unified hierarchy), `hybrid` (v1 controllers beside cgroup2), `v1`, `none`.
    pub mode: String,
    /// Whether a command's tree is killed with `cgroup.kill` (Linux 5.14).
    pub kill: bool,
    /// Where the per-command process limit comes from: `v2`, `v1` or `rlimit`.
    pub pids: String,
    /// Where the per-command memory limit comes from: `v2`, `v1` or `rlimit`.
    pub memory: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfileSummary {
    pub name: String,
    pub description: String,
    /// Whether this host can run the profile (checked at start by running a command under it).
    pub available: bool,
    /// Isolation layers this profile applies on this host.
    pub layers: Vec<String>,
    /// Parts of its policy this host cannot apply and the profile does without.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<String>,
    /// Why the profile cannot run here, naming the layer that failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable_reason: Option<String>,
}

/// Bounds the daemon enforces; requests beyond them get a `bad_request` or `busy` error.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    pub max_message_bytes: usize,
    pub max_command_bytes: usize,
    pub max_env_entries: usize,
    /// Sum over `env` of name + value + 2 bytes.
    pub max_env_bytes: usize,
    pub max_id_bytes: usize,
    pub default_timeout: f64,
    pub max_timeout: f64,
    /// Bytes of output kept per command (head and tail); the true total is always reported.
    pub max_output_bytes: usize,
    pub max_commands_per_connection: usize,
    pub max_commands_total: usize,
    /// Protocol 1.1: output kept per process for `read` (older bytes fall out).
    #[serde(default)]
    pub max_process_buffer_bytes: usize,
    /// Protocol 1.1: largest file (or tar stream) `upload` takes.
    #[serde(default)]
    pub max_upload_bytes: u64,
}

/// A piece of a command's merged stdout and stderr, sent only when the request set `stream`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputChunk {
    pub id: String,
    /// 0, 1, 2, ... per command, so a client can tell nothing was lost.
    pub seq: u64,
    /// UTF-8 text; invalid bytes are replaced with U+FFFD.
    pub data: String,
}

/// The end of a command, shaped like mini-swe-agent's result dictionary plus `extra`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecResult {
    pub id: String,
    /// Merged stdout and stderr in order; head and tail when longer than the daemon's cap.
    pub output: String,
    /// Exit code; `-signal` when a signal ended the shell; -1 when the command did not finish
    /// on its own (timeout, cancel, disconnect, shutdown).
    pub returncode: i32,
    /// Empty when the command ran to completion; otherwise what stopped it.
    pub exception_info: String,
    pub extra: ResultExtra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultExtra {
    /// How the command ended.
    pub ended: Ending,
    pub timed_out: bool,
    pub cancelled: bool,
    /// Wall-clock time from spawn to result, in milliseconds.
    pub duration_ms: f64,
    /// Signal that ended the shell, if any (e.g. `SIGKILL`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    /// True number of bytes the command wrote.
    pub output_bytes: u64,
    /// Whether the middle of the output was left out of `output`.
    pub truncated: bool,
    /// Bytes left out of `output` (0 unless truncated).
    pub elided_bytes: u64,
    /// Processes killed when the command ended: leftovers of the shell, and the shell itself
    /// if it was still running.
    pub killed_processes: u32,
    /// Resource limits the command ran into (`processes`, `memory`; `disk_bytes`, `disk_files`:
    /// the client's filesystem was full, or out of inodes, when the command ended).
    #[serde(default)]
    pub limits_hit: Vec<String>,
    pub isolation: Isolation,
}

/// Why a command stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Ending {
    /// The shell exited with a code.
    Exited,
    /// The shell was ended by a signal it did not get from the daemon.
    Signaled,
    TimedOut,
    Cancelled,
    /// The client's connection closed; only the audit log sees this result.
    Disconnected,
    /// The daemon is shutting down.
    Shutdown,
}

impl Ending {
    /// The wire name, as serde writes it (`timed_out`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exited => "exited",
            Self::Signaled => "signaled",
            Self::TimedOut => "timed_out",
            Self::Cancelled => "cancelled",
            Self::Disconnected => "disconnected",
            Self::Shutdown => "shutdown",
        }
    }
}

/// Which isolation the command actually ran under.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Isolation {
    pub profile: String,
    /// Layers applied, in order, e.g. `["session", "subreaper", "cgroup"]`.
    pub layers: Vec<String>,
    /// Parts of the profile's policy this host cannot apply and the profile does without,
    /// e.g. `["landlock_scope"]` on a kernel before 6.12 (see docs/profiles.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<String>,
    /// The command's network when a policy filtered it (absent under `none` and `host`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkUse>,
}

/// What a network policy let through for one command, and what it refused.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NetworkUse {
    /// Connection attempts (and name lookups) the policy allowed, and refused.
    pub allowed: u64,
    pub denied: u64,
    /// The first refused targets, `host:port (code)`, in the order they came (at most 8).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub denied_first: Vec<String>,
    /// Ports reachable by a plain connection to a resolved name (captured in the command's
    /// namespace); every other allowed port is reachable through the proxy only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub captured_ports: Vec<u16>,
    /// Allow rules whose ports were not all captured (a range too wide): what they allow is
    /// reachable through the proxy (`HTTP_PROXY`, `CONNECT`) only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub proxy_only: Vec<String>,
}

/// A request could not be served. `id` names the request when it could be read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorMessage {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub code: ErrorCode,
    pub message: String,
}

/// The few error classes a client has to tell apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The message is malformed, too large, or a field is out of range. Fix the request.
    BadRequest,
    /// The id is already in use by a running command of this connection.
    DuplicateId,
    /// `cancel` named no running command of this connection (or a process request no process,
    /// a file request a missing path).
    NotFound,
    /// A concurrency limit is reached. Retry later.
    Busy,
    /// The profile does not exist or this client may not use it.
    ProfileDenied,
    /// The execution environment itself is broken (the sandbox could not be set up, the
    /// interpreter or working directory is missing, the host refused a resource). The command
    /// did not run; an agent should stop rather than show this to the model.
    EnvironmentError,
    /// The daemon is draining and takes no new commands.
    ShuttingDown,
    /// A quota of this client is used up (commands per minute, total output). The message
    /// says which and, for a rate, when to retry.
    QuotaExceeded,
    /// A bug in the daemon. Nothing was run.
    Internal,
    /// Protocol 1.1: the sandbox refused a file operation (permission, read-only, outside
    /// what the profile lets a command reach); a command would have been refused the same.
    Denied,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BadRequest => "bad_request",
            Self::DuplicateId => "duplicate_id",
            Self::NotFound => "not_found",
            Self::Busy => "busy",
            Self::ProfileDenied => "profile_denied",
            Self::EnvironmentError => "environment_error",
            Self::ShuttingDown => "shutting_down",
            Self::QuotaExceeded => "quota_exceeded",
            Self::Internal => "internal",
            Self::Denied => "denied",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_exec_request_uses_defaults() {
        let msg: ClientMessage =
            serde_json::from_str(r#"{"type":"exec","id":"c1","command":"echo hi"}"#).unwrap();
        let ClientMessage::Exec(req) = msg else {
            panic!("not an exec: {msg:?}")
        };
        assert_eq!(req.id, "c1");
        assert_eq!(req.cwd, None);
        assert!(req.env.is_empty());
        assert_eq!(req.timeout, None);
        assert!(!req.stream);
    }

    #[test]
    fn full_exec_request_round_trips() {
        let text = r#"{"type":"exec","id":"c1","command":"echo hi","cwd":"/work","env":{"K":"V"},"timeout":2.5,"profile":"strict","stream":true}"#;
        let msg: ClientMessage = serde_json::from_str(text).unwrap();
        assert_eq!(serde_json::to_string(&msg).unwrap(), text);
    }

    #[test]
    fn misspelt_request_field_is_rejected() {
        let err = serde_json::from_str::<ClientMessage>(
            r#"{"type":"exec","id":"c1","command":"x","timout":3}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("timout"), "{err}");
    }

    #[test]
    fn unknown_type_is_rejected() {
        assert!(serde_json::from_str::<ClientMessage>(r#"{"type":"launch","id":"c1"}"#).is_err());
    }

    #[test]
    fn error_codes_serialize_as_documented() {
        let msg = ServerMessage::Error(ErrorMessage {
            id: Some("c1".into()),
            code: ErrorCode::EnvironmentError,
            message: "m".into(),
        });
        assert_eq!(
            serde_json::to_string(&msg).unwrap(),
            r#"{"type":"error","id":"c1","code":"environment_error","message":"m"}"#
        );
        assert_eq!(ErrorCode::EnvironmentError.as_str(), "environment_error");
    }

    #[test]
    fn ending_names_are_the_serialized_ones() {
        for ending in [
            Ending::Exited,
            Ending::Signaled,
            Ending::TimedOut,
            Ending::Cancelled,
            Ending::Disconnected,
            Ending::Shutdown,
        ] {
            assert_eq!(
                serde_json::to_value(ending).unwrap(),
                serde_json::Value::from(ending.as_str())
            );
        }
    }
}
