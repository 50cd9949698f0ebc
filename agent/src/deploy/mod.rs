//! Where the executor runs: the deployments, one module each, and the flags that choose one.

pub mod local;

use std::path::PathBuf;

use clap::Args;

#[derive(Args, Clone, Default)]
pub struct ExecutorArgs {
    /// Executor URL (ws:// or wss://). Without it a local `executor serve` is started.
    #[arg(long = "executor", value_name = "URL")]
    pub executor: Option<String>,
    /// File holding the executor's bearer token (or set EXECUTOR_TOKEN).
    #[arg(long, value_name = "PATH")]
    pub token_file: Option<PathBuf>,
    /// Accept exactly the wss:// executor certificate with this SHA-256 fingerprint
    /// (sha256:<hex>, as `executor tls-fingerprint` prints it), whoever issued it.
    #[arg(long, value_name = "sha256:HEX", conflicts_with = "tls_ca")]
    pub tls_fingerprint: Option<String>,
    /// Also trust this CA certificate (PEM) for wss:// executors, besides the WebPKI roots.
    #[arg(long, value_name = "PATH")]
    pub tls_ca: Option<PathBuf>,
    /// The `executor` binary to start locally (default: next to `agent`, then PATH).
    #[arg(long, value_name = "PATH")]
    pub executor_bin: Option<PathBuf>,
    /// Sandbox profile (default: the strongest a local executor offers, else the executor's).
    #[arg(long)]
    pub profile: Option<String>,
}
