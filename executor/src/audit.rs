//! The audit log: one JSON line per command, appended by a dedicated thread.
//!
//! Records carry who ran what, where, under which profile, and how it ended; never the token
//! (the daemon never hands it to this module) and never the output.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::Serialize;
use tokio::sync::mpsc;

/// Records waiting to be written; a full queue makes finishing commands wait, never drops.
const QUEUE: usize = 1024;
/// Longest command kept in a record: a refused request may carry up to a whole message
/// (1 MiB by default), which would make one line of the log as large.
pub const MAX_COMMAND_BYTES: usize = 4096;
/// Longest id, cwd, profile or error kept in a record.
const MAX_FIELD_BYTES: usize = 1024;

#[derive(Debug, Serialize)]
pub struct AuditRecord {
    /// RFC 3339 time the command ended.
    pub ts: String,
    /// The client's name (from the clients file; `default` with a single token).
    pub client: String,
    /// Its address.
    pub peer: String,
    pub connection: u64,
    pub session: String,
    pub id: String,
    /// The command, cut to [`MAX_COMMAND_BYTES`] (its head) when longer.
    pub command: String,
    /// The command's true size in bytes, when `command` was cut.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command_bytes: Option<usize>,
    pub cwd: String,
    pub profile: String,
    /// How it ended: an `Ending` value, or `error` when it never ran.
    pub ended: String,
    pub returncode: Option<i32>,
    pub duration_ms: f64,
    pub output_bytes: u64,
    pub killed_processes: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Clone)]
pub struct Audit {
    tx: mpsc::Sender<AuditRecord>,
    reserve: std::sync::Arc<Reserve>,
}

/// Disk kept allocated ahead of the audit log's end (fallocate, `FALLOC_FL_KEEP_SIZE`), so
/// that a client filling the host's disk (where no quota binds it) cannot push the log off it:
/// the next records go into blocks already the log's.
pub const RESERVE_BYTES: u64 = 8 * 1024 * 1024;

/// The log's reservation, renewed once half of it is written.
struct Reserve {
    /// The log, opened again for `fallocate` and `fstat` (the writer thread owns the other).
    file: std::fs::File,
    path: PathBuf,
    /// End of the blocks allocated ahead, and whether the last renewal failed.
    state: std::sync::Mutex<(u64, Option<String>)>,
}

impl Reserve {
    /// Keep [`RESERVE_BYTES`] allocated past the log's end once less than half is left;
    /// `Err` says why it cannot (the disk is full).
    fn renew(&self) -> Result<(), String> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let len = self.file.metadata().map(|m| m.len()).unwrap_or(0);
        if state.1.is_none() && state.0 >= len.saturating_add(RESERVE_BYTES / 2) {
            return Ok(());
        }
        let outcome = nix::fcntl::fallocate(
            &self.file,
            nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
            i64::try_from(len).unwrap_or(i64::MAX),
            i64::try_from(RESERVE_BYTES).unwrap_or(i64::MAX),
        );
        match outcome {
            Ok(()) => {
                if state.1.take().is_some() {
                    tracing::info!(path = %self.path.display(), "the audit log has its disk reserved again: commands are accepted");
                }
                state.0 = len + RESERVE_BYTES;
                Ok(())
            }
            // A filesystem that cannot reserve (some network and FUSE filesystems) is not a
            // full disk: said once, and commands go on.
            Err(nix::errno::Errno::EOPNOTSUPP) => {
                if state.0 != u64::MAX {
                    tracing::warn!(path = %self.path.display(), "the audit log's filesystem cannot reserve disk ahead (fallocate unsupported): a client filling it could stop the log");
                    state.0 = u64::MAX;
                }
                Ok(())
            }
            Err(err) => {
                let why = format!(
                    "the audit log {} cannot keep {} MiB of disk reserved ahead ({err}): the host's disk is full; no command is accepted until space is freed",
                    self.path.display(),
                    RESERVE_BYTES >> 20
                );
                if state.1.is_none() {
                    tracing::error!("{why}");
                }
                state.1 = Some(why.clone());
                Err(why)
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("cannot open audit log {path}: {source}")]
pub struct AuditError {
    path: PathBuf,
    #[source]
    source: std::io::Error,
}

impl Audit {
    /// Open `path` for appending (0600, no symlink following) and start the writer thread.
    pub fn open(path: &Path) -> Result<Self, AuditError> {
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(|source| AuditError {
                path: path.to_path_buf(),
                source,
            })?;
        let reserve = std::sync::Arc::new(Reserve {
            file: file.try_clone().map_err(|source| AuditError {
                path: path.to_path_buf(),
                source,
            })?,
            path: path.to_path_buf(),
            state: std::sync::Mutex::new((0, None)),
        });
        // A log that cannot reserve its disk now refuses commands until it can (`ready`).
        let _ = reserve.renew();
        let writer_reserve = reserve.clone();
        let (tx, mut rx) = mpsc::channel::<AuditRecord>(QUEUE);
        std::thread::Builder::new()
            .name("audit".into())
            .spawn(move || {
                let mut file = file;
                while let Some(record) = rx.blocking_recv() {
                    let Ok(mut line) = serde_json::to_vec(&record) else {
                        continue;
                    };
                    line.push(b'\n');
                    // One write per record: O_APPEND keeps lines whole.
                    if let Err(err) = file.write_all(&line) {
                        tracing::error!(%err, "audit log write failed");
                    }
                    let _ = writer_reserve.renew();
                }
            })
            .map_err(|source| AuditError {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Self { tx, reserve })
    }

    /// Whether a new command may be accepted: the log has its disk reserved ahead (tried
    /// again here when it had not). `Err` says why not.
    pub fn ready(&self) -> Result<(), String> {
        self.reserve.renew()
    }

    pub async fn record(&self, mut record: AuditRecord) {
        let size = record.command.len();
        if clip(&mut record.command, MAX_COMMAND_BYTES) {
            record.command_bytes = Some(size);
        }
        for field in [&mut record.id, &mut record.cwd, &mut record.profile] {
            clip(field, MAX_FIELD_BYTES);
        }
        if let Some(error) = &mut record.error {
            clip(error, MAX_FIELD_BYTES);
        }
        // Fails only if the writer thread died, which it already logged.
        let _ = self.tx.send(record).await;
    }
}

/// Cut `text` to at most `max` bytes at a character boundary, marking the cut with `…`;
/// returns whether it was cut.
fn clip(text: &mut String, max: usize) -> bool {
    if text.len() <= max {
        return false;
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text.push('…');
    true
}

/// Current time as RFC 3339 with milliseconds.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_fields_are_cut_at_a_character_boundary() {
        let mut short = "echo hi".to_string();
        assert!(!clip(&mut short, 16));
        assert_eq!(short, "echo hi");
        let mut long = "é".repeat(3000);
        assert!(clip(&mut long, MAX_COMMAND_BYTES));
        assert!(
            long.len() <= MAX_COMMAND_BYTES && long.ends_with('…'),
            "{}",
            long.len()
        );
    }
}
