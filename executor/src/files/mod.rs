//! File operations of protocol 1.1 (`upload`, `download`, `stat`, `list_dir`), carried out by a
//! sandbox's payload in place of its command: after the payload has confined itself (mount
//! namespace, identity, landlock, seccomp) and entered the working directory, exactly where a
//! command would exec. So a path means what it means to a command, and the operation reaches
//! only what a command could: the sandbox is the path check, not code of ours that could
//! disagree with it.
//!
//! The payload's stdin is the content to write (an upload), its stdout the one stream back:
//! a [`Header`] line (JSON), then for a download the bytes. A write reads all of stdin before
//! it answers; a read answers first, then streams.

mod ops;

use protocol::FileStat;
use serde::{Deserialize, Serialize};

pub use ops::serve;

/// Longest header line the daemon reads (a listing of 10,000 entries fits).
pub const MAX_HEADER_BYTES: usize = 4 << 20;
/// Entries `list_dir` returns at most.
pub const MAX_LIST_ENTRIES: usize = 10_000;

/// What the payload does instead of exec'ing a command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum FileOp {
    /// stdin -> a temporary file beside `path` (mode `mode`), renamed over `path` at the end.
    Write {
        path: String,
        mode: u32,
        parents: bool,
        max_bytes: u64,
    },
    /// stdin is a tar stream, unpacked into the directory `path` (created if missing).
    Unpack {
        path: String,
        parents: bool,
        max_bytes: u64,
    },
    /// `path`'s bytes from `offset`, at most `length`, to stdout after the header.
    Read {
        path: String,
        offset: u64,
        length: Option<u64>,
    },
    /// The directory `path` as a tar stream to stdout after the header.
    Pack {
        path: String,
    },
    Stat {
        path: String,
    },
    List {
        path: String,
    },
}

/// The first line the payload writes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Header {
    Ok {
        /// The absolute path, as the sandbox sees it.
        path: String,
        /// Write, Unpack: bytes taken from stdin. Read: bytes that follow the header.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bytes: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stat: Option<FileStat>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        entries: Option<Vec<FileStat>>,
        #[serde(default)]
        truncated: bool,
    },
    Error {
        kind: ErrorKind,
        message: String,
    },
}

/// How a file operation failed, as the daemon maps it to a wire error code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// ENOENT (or a parent missing without `parents`).
    NotFound,
    /// EACCES, EPERM, EROFS, EXDEV: the sandbox or the file's permissions refused it.
    Denied,
    /// More than `max_bytes`.
    TooLarge,
    /// Anything else: a directory where a file was asked for, a bad tar stream, ...
    Invalid,
}
