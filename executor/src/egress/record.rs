//! The decision log: one JSON line per connection attempt, through a small sink.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Mutex;

use sandbox::network::Layer;
use serde::Serialize;

/// One connection attempt: who asked, for what, what was decided and why, and what passed.
#[derive(Debug, Clone, Serialize)]
pub struct DecisionRecord {
    /// RFC 3339 time the attempt began.
    pub ts: String,
    pub client: String,
    pub session: String,
    /// The command's id.
    pub command: String,
    /// How the command asked: `http` (a forward-proxy request), `connect` or `tcp` (by name,
    /// from the capture path).
    pub kind: &'static str,
    /// The host as requested (normalized when it parsed), and the port.
    pub host: String,
    pub port: u16,
    /// The address connected to (or the first that was refused).
    pub address: Option<String>,
    /// The layer and rule that decided, when one did.
    pub layer: Option<Layer>,
    pub rule: Option<String>,
    pub allowed: bool,
    /// A short stable name for why (`allowed`, `not_allowed`, `special_address`,
    /// `host_mismatch`, ...), and the sentence a person reads.
    pub code: &'static str,
    pub reason: String,
    /// What went wrong after an allowed decision (connecting, relaying), if anything.
    pub error: Option<String>,
    /// Bytes sent to the target and received from it.
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub duration_ms: f64,
}

impl DecisionRecord {
    /// The record as one line of JSON, newline included.
    pub fn json_line(&self) -> String {
        let mut line = serde_json::to_string(self).unwrap_or_else(|err| {
            format!("{{\"error\":\"decision record not serializable: {err}\"}}")
        });
        line.push('\n');
        line
    }
}

/// Where decision records go.
pub trait DecisionSink: Send + Sync {
    fn record(&self, record: &DecisionRecord);
}

/// Appends each record as one line to a file (mode 0600, `O_APPEND`: one write per line, so
/// concurrent writers never interleave within a line).
pub struct JsonLinesFile {
    file: Mutex<std::fs::File>,
}

impl JsonLinesFile {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(path)?;
        Ok(Self {
            file: Mutex::new(file),
        })
    }
}

impl DecisionSink for JsonLinesFile {
    fn record(&self, record: &DecisionRecord) {
        let line = record.json_line();
        let mut file = match self.file.lock() {
            Ok(file) => file,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Err(err) = file.write_all(line.as_bytes()) {
            tracing::warn!(%err, "cannot write the network decision log");
        }
    }
}
