//! The deployment keys of the `environment` section (YAML), next to mini's own keys.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Seconds a deployment may take to give a usable executor: started, connected, its profile
/// chosen. Separate from command timeouts: a task image that is slow to start is not a slow
/// command, and an executor that never comes up must not hang a batch.
pub fn default_start_timeout() -> f64 {
    120.0
}

/// One executor of a `remote` pool.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteExecutor {
    pub url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_fingerprint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_ca: Option<PathBuf>,
}

/// `docker` deployment: one container per task from the task's image.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DockerConfig {
    /// `docker`, `podman`, or a path to either (mini's `MSWEA_DOCKER_EXECUTABLE` also works).
    #[serde(default = "default_docker")]
    pub executable: String,
    /// Arguments before the subcommand, e.g. `["--runtime", "runc"]` for podman.
    #[serde(default)]
    pub global_args: Vec<String>,
    /// Extra `run` arguments, e.g. `["--memory", "4g"]`.
    #[serde(default)]
    pub run_args: Vec<String>,
    /// Labels added to every container (besides ours, which `agent deploy reap` finds).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// `--pull` policy: `missing` (default), `never`, `always`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull: Option<String>,
}

impl Default for DockerConfig {
    fn default() -> Self {
        Self {
            executable: default_docker(),
            global_args: Vec::new(),
            run_args: Vec::new(),
            labels: BTreeMap::new(),
            pull: None,
        }
    }
}

fn default_docker() -> String {
    std::env::var("MSWEA_DOCKER_EXECUTABLE")
        .ok()
        .filter(|e| !e.is_empty())
        .unwrap_or_else(|| "docker".into())
}

/// `ssh` deployment: the static executor copied to a host and started over ssh.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SshConfig {
    /// `host`, `user@host`, or a `Host` alias of ssh_config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity_file: Option<PathBuf>,
    /// Extra `ssh` arguments, e.g. `["-o", "StrictHostKeyChecking=accept-new"]`.
    #[serde(default)]
    pub ssh_args: Vec<String>,
}

/// `reverse` deployment: we listen, executors dial in (`executor connect`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReverseConfig {
    /// Where executors dial in (TLS).
    #[serde(default = "default_reverse_listen")]
    pub listen: String,
    /// The name executors dial, in the printed command (default: the listen address's IP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

impl Default for ReverseConfig {
    fn default() -> Self {
        Self {
            listen: default_reverse_listen(),
            host: None,
        }
    }
}

fn default_reverse_listen() -> String {
    "0.0.0.0:7690".into()
}
