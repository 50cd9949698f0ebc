//! The daemon's decision sink: the JSON-lines file beside the audit log, the counters of
//! `/metrics`, and the tally of each running command (its result names its denials).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use prometheus_client::metrics::counter::Counter;
use protocol::NetworkUse;

use crate::egress::record::{DecisionRecord, DecisionSink, JsonLinesFile};

/// Denied targets a result names at most.
const DENIED_NAMED: usize = 8;

/// Allowed and denied attempts over every command (registered in [`crate::metrics`]).
#[derive(Clone, Default)]
pub struct Counters {
    pub allowed: Counter,
    pub denied: Counter,
}

/// The decision log beside the audit log: `audit.jsonl` -> `audit.network.jsonl`.
pub fn path_beside(audit: &Path) -> PathBuf {
    audit.with_extension("network.jsonl")
}

/// Where every decision goes.
pub struct DecisionLog {
    file: Option<JsonLinesFile>,
    /// Set once the daemon's metrics exist.
    counters: OnceLock<Counters>,
    running: Mutex<HashMap<String, Arc<Mutex<NetworkUse>>>>,
}

/// The key of a command's tally: who ran it, and its id.
fn key(client: &str, session: &str, command: &str) -> String {
    format!("{client}\0{session}\0{command}")
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

impl DecisionLog {
    /// Append to `path` (created mode 0600), or keep no file (tests).
    pub fn open(path: Option<&Path>) -> std::io::Result<Self> {
        Ok(Self {
            file: path.map(JsonLinesFile::open).transpose()?,
            counters: OnceLock::new(),
            running: Mutex::new(HashMap::new()),
        })
    }

    /// Count every decision from now on in `counters` (the daemon's metrics).
    pub fn count_in(&self, counters: Counters) {
        let _ = self.counters.set(counters);
    }

    /// Start the tally of a command; it ends when the returned [`Tally`] is dropped.
    pub fn tally(self: &Arc<Self>, client: &str, session: &str, command: &str) -> Tally {
        let key = key(client, session, command);
        let usage = Arc::new(Mutex::new(NetworkUse::default()));
        lock(&self.running).insert(key.clone(), usage.clone());
        Tally {
            log: self.clone(),
            key,
            usage,
        }
    }
}

impl DecisionSink for DecisionLog {
    fn record(&self, record: &DecisionRecord) {
        if let Some(file) = &self.file {
            file.record(record);
        }
        if let Some(counters) = self.counters.get() {
            if record.allowed {
                counters.allowed.inc();
            } else {
                counters.denied.inc();
            }
        }
        let usage = lock(&self.running)
            .get(&key(&record.client, &record.session, &record.command))
            .cloned();
        if let Some(usage) = usage {
            let mut usage = lock(&usage);
            if record.allowed {
                usage.allowed += 1;
            } else {
                usage.denied += 1;
                if usage.denied_first.len() < DENIED_NAMED {
                    usage
                        .denied_first
                        .push(format!("{}:{} ({})", record.host, record.port, record.code));
                }
            }
        }
    }
}

/// One command's tally, removed from the log when dropped.
pub struct Tally {
    log: Arc<DecisionLog>,
    key: String,
    usage: Arc<Mutex<NetworkUse>>,
}

impl Tally {
    pub fn snapshot(&self) -> NetworkUse {
        lock(&self.usage).clone()
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        lock(&self.log.running).remove(&self.key);
    }
}
