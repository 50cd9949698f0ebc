//! `remote`: executors already running somewhere (VMs, a shared sandbox). A pool: each task
//! takes a free executor and gives it back when it ends; with more workers than executors,
//! tasks wait for one.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use futures_util::future::BoxFuture;
use tokio::sync::{mpsc, Mutex};

use super::config::RemoteExecutor;
use super::{Deployed, Deployment, Endpoint, Handle, TaskSpec};
use crate::config::EnvironmentConfig;

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

pub struct Pool {
    executors: Vec<Endpoint>,
    free: Mutex<mpsc::Receiver<usize>>,
    give_back: mpsc::Sender<usize>,
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
        Ok(Self {
            executors,
            free: Mutex::new(free),
            give_back,
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
            let index = self
                .free
                .lock()
                .await
                .recv()
                .await
                .context("the executor pool is closed")?;
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
