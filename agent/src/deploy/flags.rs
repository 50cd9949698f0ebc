//! The flags that say where the executor is or goes, shared by `run`, `exec`, `batch` and
//! `deploy up`; each overrides its `environment` config key.

use std::path::PathBuf;

use clap::Args;

use crate::config::EnvironmentConfig;

// clap prints these doc comments as --help, where <placeholders> are meant literally.
#[allow(rustdoc::invalid_html_tags)]
#[derive(Args, Clone, Default)]
pub struct ExecutorArgs {
    /// Executor URL (ws:// or wss://): use that running executor (`--deploy remote`).
    /// Repeatable: a pool, each task taking a free one.
    #[arg(long = "executor", value_name = "URL")]
    pub executor: Vec<String>,
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
    /// Sandbox profile. Default: for a local executor, the strongest of strict and landlock
    /// whose commands can write the workspace (task-container and trusted only when named);
    /// for one we deployed elsewhere, the strongest it offers that works; else the executor's
    /// default.
    #[arg(long)]
    pub profile: Option<String>,
    #[command(flatten)]
    pub deploy: DeployArgs,
}

#[derive(Args, Clone, Default)]
pub struct DeployArgs {
    /// Where executors run (environment.deployment): local (started here), remote (running
    /// ones, --executor URL), docker (a container per task), ssh (copied to a host), reverse
    /// (executors that dial in to us, for targets behind NAT).
    #[arg(long = "deploy", value_name = "KIND", value_parser = ["local", "remote", "docker", "ssh", "reverse"])]
    pub deployment: Option<String>,
    /// Seconds an executor may take to come up and answer (environment.start_timeout).
    #[arg(long, value_name = "S")]
    pub start_timeout: Option<f64>,
    /// The task's image (docker; environment.image).
    #[arg(long, value_name = "IMAGE")]
    pub image: Option<String>,
    /// The static executor to mount or copy into targets (environment.executor_static).
    #[arg(long, value_name = "PATH")]
    pub executor_static: Option<PathBuf>,
    /// `docker` or `podman` (environment.docker.executable).
    #[arg(long, value_name = "PROGRAM")]
    pub docker_executable: Option<String>,
    /// An argument before the docker subcommand, e.g. --docker-global-arg=--runtime=runc.
    #[arg(
        long = "docker-global-arg",
        value_name = "ARG",
        allow_hyphen_values = true
    )]
    pub docker_global_args: Vec<String>,
    /// An extra `docker run` argument, e.g. --docker-run-arg=--memory=4g (repeatable).
    #[arg(
        long = "docker-run-arg",
        value_name = "ARG",
        allow_hyphen_values = true
    )]
    pub docker_run_args: Vec<String>,
    /// A label KEY=VALUE for every container (repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
    /// ssh target: host, user@host or an ssh_config alias (environment.ssh.host).
    #[arg(long, value_name = "HOST")]
    pub ssh_host: Option<String>,
    #[arg(long, value_name = "PORT")]
    pub ssh_port: Option<u16>,
    #[arg(long, value_name = "PATH")]
    pub ssh_identity: Option<PathBuf>,
    /// An extra ssh option, as for `ssh -o` (repeatable), e.g. StrictHostKeyChecking=accept-new.
    #[arg(long = "ssh-option", value_name = "OPTION")]
    pub ssh_options: Vec<String>,
    /// reverse: where executors dial in (environment.reverse.listen, 0.0.0.0:7690).
    #[arg(long, value_name = "ADDR")]
    pub reverse_listen: Option<String>,
    /// reverse: the name executors dial (environment.reverse.host).
    #[arg(long, value_name = "HOST")]
    pub reverse_host: Option<String>,
}

impl ExecutorArgs {
    /// Write the flags given into `e`; flags win over config files.
    pub fn apply(&self, e: &mut EnvironmentConfig) -> anyhow::Result<()> {
        let mut urls = self.executor.iter();
        if let Some(first) = urls.next() {
            e.executor_url = Some(first.clone());
        }
        for url in urls {
            e.remote.push(crate::deploy::config::RemoteExecutor {
                url: url.clone(),
                ..Default::default()
            });
        }
        set(&mut e.token_file, &self.token_file);
        set(&mut e.tls_fingerprint, &self.tls_fingerprint);
        set(&mut e.tls_ca, &self.tls_ca);
        set(&mut e.executor_bin, &self.executor_bin);
        set(&mut e.profile, &self.profile);
        let d = &self.deploy;
        set(&mut e.deployment, &d.deployment);
        if let Some(t) = d.start_timeout {
            e.start_timeout = t;
        }
        set(&mut e.image, &d.image);
        set(&mut e.executor_static, &d.executor_static);
        if let Some(x) = &d.docker_executable {
            e.docker.executable = x.clone();
        }
        e.docker
            .global_args
            .extend(d.docker_global_args.iter().cloned());
        e.docker.run_args.extend(d.docker_run_args.iter().cloned());
        for label in &d.labels {
            let Some((k, v)) = label.split_once('=') else {
                anyhow::bail!("--label expects KEY=VALUE, got {label:?}");
            };
            e.docker.labels.insert(k.to_string(), v.to_string());
        }
        set(&mut e.ssh.host, &d.ssh_host);
        if d.ssh_port.is_some() {
            e.ssh.port = d.ssh_port;
        }
        set(&mut e.ssh.identity_file, &d.ssh_identity);
        if let Some(listen) = &d.reverse_listen {
            e.reverse.listen = listen.clone();
        }
        set(&mut e.reverse.host, &d.reverse_host);
        for option in &d.ssh_options {
            e.ssh.ssh_args.extend(["-o".to_string(), option.clone()]);
        }
        Ok(())
    }
}

fn set<T: Clone>(slot: &mut Option<T>, flag: &Option<T>) {
    if flag.is_some() {
        slot.clone_from(flag);
    }
}
