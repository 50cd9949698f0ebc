//! Protocol 1.1, files: `upload`, `download`, `stat`, `list_dir`, each carried out inside a
//! sandbox of the named profile with the identity a command would have, so a path means what
//! it means to a command and reaches only what a command could reach.

use serde::{Deserialize, Serialize};

use crate::is_false;

/// Write a file (or, with `tar`, unpack a tar stream into a directory). The content follows in
/// `write` messages with this id, the last with `eof: true`; the answer is `uploaded`. The file
/// is written under a temporary name beside `path` and renamed over it at the end, so a reader
/// never sees half a file and a link at `path` is replaced, never written through.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UploadRequest {
    pub id: String,
    /// As a command sees it; relative paths start at the workspace.
    pub path: String,
    /// Permission bits of the new file (default 0o644; a directory made by `tar` keeps the
    /// archive's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
    /// Create missing parent directories.
    #[serde(default, skip_serializing_if = "is_false")]
    pub parents: bool,
    /// The content is a tar stream to unpack into the directory `path`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub tar: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
}

/// Read a file (a byte range of it), or with `tar` a directory as a tar stream. The answer is
/// `download_data` chunks and then `downloaded`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DownloadRequest {
    pub id: String,
    pub path: String,
    /// First byte to send (not with `tar`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub offset: u64,
    /// At most this many bytes (not with `tar`); to the end when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length: Option<u64>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub tar: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

/// Facts about one path (not followed if it is a symbolic link). Answered with `file_info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatRequest {
    pub id: String,
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
}

/// The entries of a directory. Answered with `dir_listing`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListDirRequest {
    pub id: String,
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
}

/// `upload` is complete: the file is in place.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Uploaded {
    pub id: String,
    /// The absolute path written, as a command sees it.
    pub path: String,
    /// Bytes received (for `tar`, the archive's).
    pub bytes: u64,
}

/// A piece of a download, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DownloadData {
    pub id: String,
    /// 0, 1, 2, ... per download.
    pub seq: u64,
    /// Base64 of the bytes.
    pub data: String,
}

/// `download` is complete: every `download_data` chunk was sent before it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Downloaded {
    pub id: String,
    pub path: String,
    /// Bytes sent in all.
    pub bytes: u64,
}

/// One path's facts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    /// The entry's name (`list_dir`) or the absolute path asked for (`stat`).
    pub name: String,
    /// `file`, `dir`, `symlink`, `fifo`, `socket`, `char`, `block`.
    pub kind: String,
    pub size: u64,
    /// Permission bits (`0o7777` part of st_mode).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
    /// Where a symbolic link points.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileInfo {
    pub id: String,
    #[serde(flatten)]
    pub stat: FileStat,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DirListing {
    pub id: String,
    pub path: String,
    /// Sorted by name; at most 10,000 (then `truncated`).
    pub entries: Vec<FileStat>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub truncated: bool,
}
