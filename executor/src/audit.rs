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
                }
            })
            .map_err(|source| AuditError {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Self { tx })
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
