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
//!
//! An upload's content arrives framed ([`Framed`]): chunks with their length, then an empty
//! chunk that commits it. End-of-file before that means the upload was cut off (its
//! connection closed, the daemon stopping): the temporary file is removed and nothing is
//! renamed into place, so a partial upload can never pass for a whole one.

mod ops;

use std::io::{self, Read};

use protocol::FileStat;
use serde::{Deserialize, Serialize};

pub use ops::serve;

/// Longest header line the daemon reads (a listing is cut to fit: `List` stops at half of it).
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

/// The length prefix of one chunk of an upload's content (the commit is an empty chunk).
pub fn frame_header(len: usize) -> [u8; 4] {
    u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes()
}

/// Reads an upload's framed content as a plain stream that ends at the commit; end-of-file
/// before it is an error (`UnexpectedEof`).
pub struct Framed<'a> {
    inner: &'a mut dyn Read,
    /// Bytes left in the current chunk.
    left: usize,
    committed: bool,
}

impl<'a> Framed<'a> {
    pub fn new(inner: &'a mut dyn Read) -> Self {
        Self {
            inner,
            left: 0,
            committed: false,
        }
    }
}

impl Read for Framed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let cut = || io::Error::new(io::ErrorKind::UnexpectedEof, "the upload was cut off");
        while self.left == 0 {
            if self.committed || buf.is_empty() {
                return Ok(0);
            }
            let mut len = [0u8; 4];
            self.inner
                .read_exact(&mut len)
                .map_err(|err| match err.kind() {
                    io::ErrorKind::UnexpectedEof => cut(),
                    _ => err,
                })?;
            self.left = u32::from_le_bytes(len) as usize;
            if self.left == 0 {
                self.committed = true;
            }
        }
        let want = buf.len().min(self.left);
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(cut());
        }
        self.left -= n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(chunks: &[&[u8]], commit: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for chunk in chunks {
            out.extend_from_slice(&frame_header(chunk.len()));
            out.extend_from_slice(chunk);
        }
        if commit {
            out.extend_from_slice(&frame_header(0));
        }
        out
    }

    #[test]
    fn framed_content_reads_whole_up_to_its_commit() {
        let bytes = framed(&[b"ab", b"c"], true);
        let mut input = bytes.as_slice();
        let mut got = Vec::new();
        Framed::new(&mut input).read_to_end(&mut got).unwrap();
        assert_eq!(got, b"abc");
    }

    #[test]
    fn content_cut_off_before_its_commit_is_an_error() {
        for bytes in [
            framed(&[b"abc"], false),
            framed(&[b"abc"], true)[..5].to_vec(),
        ] {
            let mut input = bytes.as_slice();
            let mut got = Vec::new();
            let err = Framed::new(&mut input).read_to_end(&mut got).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        }
    }
}
