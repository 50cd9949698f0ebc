//! `remote`: executors already running somewhere (VMs, a shared sandbox). A pool: each task
//! takes a free executor and gives it back when it ends; with more workers than executors,
//! tasks wait for one.
//!
//! A free executor is first reached with a TCP connect: one that cannot be reached is
//! quarantined (30 s, doubling on each further failure up to 10 min, logged) and the task
//! takes another, so one dead executor does not fail every task that draws it (it came back
//! at once and drew most of a batch). When every executor of the pool is in quarantine, a
//! task fails at once with the last reason instead of waiting. A single executor is no pool: one
//! that cannot be reached fails the task at once, saying so and nothing about quarantines (the
//! next task tries it again).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures_util::future::BoxFuture;
use tokio::sync::{mpsc, Mutex};

use super::config::RemoteExecutor;
use super::{Deployed, Deployment, Handle, TaskSpec};
use crate::config::EnvironmentConfig;
use crate::executor_client::Endpoint;

/// Every remote executor `config` names: `executor_url` (with the top-level token and TLS
/// keys) first, then the `remote` list (whose entries default to the same keys).
pub fn entries(config: &EnvironmentConfig) -> Vec<RemoteExecutor> {
    let mut out = Vec::new();
    if let Some(url) = &config.executor_url {
        out.push(RemoteExecutor {
            url: url.clone(),
            ..Default::default()
        });
    }
    out.extend(config.remote.iter().cloned());
    for entry in &mut out {
        if entry.token_file.is_none() {
            entry.token_file.clone_from(&config.token_file);
        }
        if entry.tls_fingerprint.is_none() && entry.tls_ca.is_none() {
            entry.tls_fingerprint.clone_from(&config.tls_fingerprint);
            entry.tls_ca.clone_from(&config.tls_ca);
        }
    }
    out
}

/// How long an executor that could not be reached sits out, at first; doubled on each
/// failure in a row, up to [`MAX_QUARANTINE`].
const QUARANTINE: Duration = Duration::from_secs(30);
const MAX_QUARANTINE: Duration = Duration::from_secs(600);
/// A TCP connect (and for `wss://` the TLS handshake) to a free executor that takes longer
/// failed.
const PROBE_PATIENCE: Duration = Duration::from_secs(5);

pub struct Pool {
    executors: Vec<Endpoint>,
    free: Mutex<mpsc::Receiver<usize>>,
    give_back: mpsc::Sender<usize>,
    /// Per executor: the quarantine its next failure gets (zero: healthy).
    penalty: std::sync::Mutex<Vec<Duration>>,
    /// Executors in quarantine now, and why the last one went there.
    quarantined: Arc<std::sync::atomic::AtomicUsize>,
    last_failure: std::sync::Mutex<String>,
}

impl Pool {
    pub fn new(entries: Vec<RemoteExecutor>) -> anyhow::Result<Self> {
        if entries.is_empty() {
            anyhow::bail!(
                "the remote deployment needs an executor URL (--executor URL, \
                 environment.executor_url or environment.remote)"
            );
        }
        let env_token = std::env::var("EXECUTOR_TOKEN")
            .ok()
            .filter(|t| !t.is_empty());
        let mut executors = Vec::new();
        for entry in entries {
            let token = match &entry.token_file {
                Some(path) => Some(read_token(path)?),
                None => env_token.clone(),
            };
            executors.push(Endpoint {
                url: entry.url,
                token,
                token_file: entry.token_file,
                tls_fingerprint: entry.tls_fingerprint,
                tls_ca: entry.tls_ca,
            });
        }
        let (give_back, free) = mpsc::channel(executors.len());
        for i in 0..executors.len() {
            give_back
                .try_send(i)
                .map_err(|_| anyhow::anyhow!("the executor pool is full"))?;
        }
        let penalty = std::sync::Mutex::new(vec![Duration::ZERO; executors.len()]);
        Ok(Self {
            executors,
            free: Mutex::new(free),
            give_back,
            penalty,
            quarantined: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            last_failure: std::sync::Mutex::new(String::new()),
        })
    }
}

fn read_token(path: &PathBuf) -> anyhow::Result<String> {
    Ok(std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the token file {}", path.display()))?
        .trim()
        .to_string())
}

impl Deployment for Pool {
    fn kind(&self) -> &'static str {
        "remote"
    }

    fn start<'a>(&'a self, _task: &'a TaskSpec) -> BoxFuture<'a, anyhow::Result<Deployed>> {
        Box::pin(async move {
            let index = loop {
                self.fail_if_all_quarantined()?;
                let index = self
                    .free
                    .lock()
                    .await
                    .recv()
                    .await
                    .context("the executor pool is closed")?;
                match probe(&self.executors[index]).await {
                    Ok(()) => {
                        self.set_penalty(index, Duration::ZERO);
                        break index;
                    }
                    // One executor is no pool: no other to take while it sits out, so it
                    // is tried again by the next task, and the error says only what failed.
                    Err(reason) if self.executors.len() == 1 => {
                        let _ = self.give_back.try_send(index);
                        anyhow::bail!(
                            "cannot reach the executor at {}: {reason}",
                            self.executors[index].url
                        );
                    }
                    Err(reason) => self.quarantine(index, &reason),
                }
            };
            let endpoint = self.executors[index].clone();
            Ok(Deployed {
                id: endpoint.url.clone(),
                endpoint,
                kind: "remote",
                owned: false,
                local_fs: false,
                handle: Box::new(Slot {
                    index,
                    give_back: Arc::new(self.give_back.clone()),
                }),
            })
        })
    }
}

impl Pool {
    fn fail_if_all_quarantined(&self) -> anyhow::Result<()> {
        use std::sync::atomic::Ordering;
        if self.quarantined.load(Ordering::SeqCst) < self.executors.len() {
            return Ok(());
        }
        let last = self
            .last_failure
            .lock()
            .map(|l| l.clone())
            .unwrap_or_default();
        anyhow::bail!("no executor of the pool can be reached now: {last}")
    }

    fn set_penalty(&self, index: usize, penalty: Duration) {
        if let Ok(mut p) = self.penalty.lock() {
            if let Some(slot) = p.get_mut(index) {
                *slot = penalty;
            }
        }
    }

    /// Keep executor `index` out of the pool for its quarantine, then free it again.
    fn quarantine(&self, index: usize, reason: &str) {
        let current = self
            .penalty
            .lock()
            .ok()
            .and_then(|p| p.get(index).copied())
            .unwrap_or_default();
        let wait = if current.is_zero() {
            QUARANTINE
        } else {
            current
        };
        self.set_penalty(index, (wait * 2).min(MAX_QUARANTINE));
        crate::notes::note!(
            "remote: executor {} cannot be used ({reason}): quarantined for {}s",
            self.executors[index].url,
            wait.as_secs()
        );
        if let Ok(mut last) = self.last_failure.lock() {
            *last = format!("{} cannot be used ({reason})", self.executors[index].url);
        }
        use std::sync::atomic::Ordering;
        self.quarantined.fetch_add(1, Ordering::SeqCst);
        let quarantined = self.quarantined.clone();
        let give_back = self.give_back.clone();
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            quarantined.fetch_sub(1, Ordering::SeqCst);
            let _ = give_back.send(index).await;
        });
    }
}

/// A TCP connect to the host and port of the executor's URL (`ws://HOST:PORT/...`,
/// `wss://...`); for `wss://` also the TLS handshake with its pin or CA, so an executor that
/// presents another certificate is put aside like an unreachable one, before a task takes it.
async fn probe(endpoint: &Endpoint) -> Result<(), String> {
    let url = &endpoint.url;
    let rest = url
        .split_once("://")
        .map(|(_, rest)| rest)
        .ok_or_else(|| "not a URL".to_string())?;
    let authority = rest.split('/').next().unwrap_or_default();
    let tls = url
        .get(..6)
        .is_some_and(|s| s.eq_ignore_ascii_case("wss://"));
    let default_port = if tls { 443 } else { 80 };
    let (host, address) = if authority.starts_with('[') {
        // [v6]:port or [v6]
        match authority.rsplit_once("]:") {
            Some((host, port)) => (host.trim_start_matches('['), format!("{host}]:{port}")),
            None => (
                authority.trim_start_matches('[').trim_end_matches(']'),
                format!("{authority}:{default_port}"),
            ),
        }
    } else if let Some((host, _)) = authority.rsplit_once(':') {
        (host, authority.to_string())
    } else {
        (authority, format!("{authority}:{default_port}"))
    };
    let checked = async {
        let tcp = tokio::net::TcpStream::connect(&address)
            .await
            .map_err(|e| format!("cannot connect to {address}: {e}"))?;
        if tls {
            crate::tls::Tls::new(
                endpoint.tls_fingerprint.as_deref(),
                endpoint.tls_ca.as_deref(),
            )
            .map_err(|e| e.to_string())?
            .handshake(tcp, host)
            .await?;
        }
        Ok(())
    };
    match tokio::time::timeout(PROBE_PATIENCE, checked).await {
        Ok(result) => result,
        Err(_) => Err(format!(
            "no {} to {address} within {}s",
            if tls {
                "TLS handshake"
            } else {
                "TCP connection"
            },
            PROBE_PATIENCE.as_secs()
        )),
    }
}

/// A taken executor; dropping it (stopped or not) makes it free again.
struct Slot {
    index: usize,
    give_back: Arc<mpsc::Sender<usize>>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let _ = self.give_back.try_send(self.index);
    }
}

impl Handle for Slot {
    fn stop(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move { drop(self) })
    }
}
