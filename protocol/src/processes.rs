//! Protocol 1.1, processes: long-running programs a client talks to over several requests
//! (`spawn`, `write`, `read`, `signal`, `resize`, `wait`, `list_processes`).
//!
//! Bytes travel base64-encoded (standard alphabet, with padding) in `data` fields, so binary
//! input and output survive JSON.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{is_false, RequestNetwork, ResultExtra};

/// Start a program and keep it: its output goes into a bounded buffer that `read` takes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpawnRequest {
    /// Chosen by the client, unique among the session's running commands and processes.
    pub id: String,
    /// Passed to the interpreter as `<interpreter> -c <command>`.
    pub command: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Wall-clock limit in seconds; `max_timeout` when absent (a server runs until stopped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// Run on a pseudo-terminal of this size (stdin, stdout and stderr are the terminal);
    /// without it stdin is a socket the client writes and stdout+stderr one stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
    /// As [`crate::ExecRequest::network`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<RequestNetwork>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    pub rows: u16,
    pub cols: u16,
}

/// Bytes for a process's stdin (or an upload's content). No reply on success.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriteRequest {
    pub id: String,
    /// Base64 of the bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
    /// The same as UTF-8 text, for hand-written requests; at most one of `data` and `text`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Close stdin after these bytes (a terminal gets its end-of-file character).
    #[serde(default, skip_serializing_if = "is_false")]
    pub eof: bool,
}

/// Output of a process from byte `offset` on. Answered with `process_output`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadRequest {
    pub id: String,
    /// Byte position in the process's whole output (0: its first byte); usually the
    /// `next_offset` of the previous reply.
    #[serde(default)]
    pub offset: u64,
    /// At most this many bytes in the reply (default and cap: 256 KiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
    /// Seconds to wait for output when there is none after `offset` yet (default 0: answer
    /// at once; at most 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait: Option<f64>,
}

/// Send a signal to the process's whole tree, or to the terminal's foreground process group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    pub id: String,
    /// `INT`, `TERM`, `KILL`, `HUP`, `QUIT`, `USR1`, `USR2`, `CONT`, `STOP` (a `SIG` prefix is
    /// accepted).
    pub signal: String,
    /// Only the terminal's foreground process group (a PTY process; what Ctrl-C reaches).
    #[serde(default, skip_serializing_if = "is_false")]
    pub foreground: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResizeRequest {
    pub id: String,
    pub rows: u16,
    pub cols: u16,
}

/// Wait for a process to end. Answered with `exited` once it ended, or with `exited` and
/// `running: true` when `timeout` passed first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitRequest {
    pub id: String,
    /// Seconds to wait (default 0: report at once; at most 60). Wait again to wait longer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<f64>,
}

/// The session's processes, running and ended (until forgotten).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListProcessesRequest {
    /// Echoed in the reply, to tell replies apart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

/// `spawn` succeeded: the process is confined and running.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Spawned {
    pub id: String,
    pub pty: bool,
}

/// The answer to `read`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessOutput {
    pub id: String,
    /// Where `data` starts in the whole output: the `offset` asked for, or later when bytes
    /// before it fell out of the buffer (by `dropped` bytes). An `offset` past the end of
    /// the output so far is refused with `bad_request`.
    pub offset: u64,
    /// Base64 of the bytes.
    pub data: String,
    /// Ask from here next time.
    pub next_offset: u64,
    /// Bytes between the asked `offset` and `offset` that fell out of the bounded buffer
    /// before they were read (0: nothing lost).
    pub dropped: u64,
    /// The output has ended (the process and everything holding its stdout are gone) and
    /// `next_offset` is its end.
    pub eof: bool,
}

/// The answer to `wait`: how the process ended, in `result`'s shape without the output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Exited {
    pub id: String,
    /// True when `wait`'s timeout passed first; the other fields are then placeholders.
    pub running: bool,
    pub returncode: i32,
    pub exception_info: String,
    /// Absent while running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra: Option<ResultExtra>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessList {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub processes: Vec<ProcessInfo>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessInfo {
    pub id: String,
    pub command: String,
    pub pty: bool,
    pub running: bool,
    /// Exit code once ended (as in `result`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub returncode: Option<i32>,
    /// Bytes of output so far.
    pub output_bytes: u64,
}

/// A request without a reply of its own (`signal`, `resize`) was carried out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Done {
    pub id: String,
}
