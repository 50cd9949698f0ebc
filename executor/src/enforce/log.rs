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
    /// The tallies of running commands by [`key`] (two at once under one key, a client's
    /// command ids reused across its connections, both count what either does).
    running: Mutex<HashMap<String, Vec<Arc<Mutex<NetworkUse>>>>>,
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
        lock(&self.running)
            .entry(key.clone())
            .or_default()
            .push(usage.clone());
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
        let tallies = lock(&self.running)
            .get(&key(&record.client, &record.session, &record.command))
            .cloned()
            .unwrap_or_default();
        for usage in tallies {
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
        let mut running = lock(&self.log.running);
        if let Some(tallies) = running.get_mut(&self.key) {
            tallies.retain(|t| !Arc::ptr_eq(t, &self.usage));
            if tallies.is_empty() {
                running.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(command: &str, host: &str, allowed: bool) -> DecisionRecord {
        DecisionRecord {
            ts: String::new(),
            client: "c".into(),
            session: "s".into(),
            command: command.into(),
            kind: "http",
            host: host.into(),
            port: 443,
            address: None,
            layer: None,
            rule: None,
            allowed,
            code: if allowed { "allowed" } else { "not_allowed" },
            reason: String::new(),
            error: None,
            bytes_up: 0,
            bytes_down: 0,
            duration_ms: 0.0,
        }
    }

    #[test]
    fn each_command_counts_its_own_decisions_and_the_file_and_counters_get_all() {
        let dir = std::env::temp_dir().join(format!("enforce-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = path_beside(&dir.join("audit.jsonl"));
        assert_eq!(path, dir.join("audit.network.jsonl"));
        let _ = std::fs::remove_file(&path);
        let log = Arc::new(DecisionLog::open(Some(&path)).unwrap());
        let counters = Counters::default();
        log.count_in(counters.clone());
        let one = log.tally("c", "s", "one");
        let two = log.tally("c", "s", "two");
        log.record(&record("one", "pypi.org", true));
        for n in 0..10 {
            log.record(&record("one", &format!("evil{n}.example"), false));
        }
        log.record(&record("other", "x.example", false));
        let used = one.snapshot();
        assert_eq!((used.allowed, used.denied), (1, 10));
        assert_eq!(used.denied_first.len(), DENIED_NAMED);
        assert_eq!(used.denied_first[0], "evil0.example:443 (not_allowed)");
        assert_eq!(two.snapshot(), NetworkUse::default());
        assert_eq!((counters.allowed.get(), counters.denied.get()), (1, 11));
        let lines = std::fs::read_to_string(&path).unwrap();
        assert_eq!(lines.lines().count(), 12);
        // A tally ends with its command; the other stays.
        drop(one);
        assert!(!lock(&log.running).contains_key(&key("c", "s", "one")));
        assert!(lock(&log.running).contains_key(&key("c", "s", "two")));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
