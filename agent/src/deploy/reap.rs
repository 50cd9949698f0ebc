//! `agent deploy reap`: remove the containers a killed agent left behind, found by the label
//! every container of ours carries.

use clap::Args;

use super::config::DockerConfig;
use super::docker::{docker_command, LABEL, RUN_LABEL};

#[derive(Args)]
pub struct ReapArgs {
    /// `docker` or `podman` (default: environment.docker.executable's default).
    #[arg(long, value_name = "PROGRAM")]
    pub docker_executable: Option<String>,
    /// An argument before the docker subcommand (repeatable), e.g. --docker-global-arg=--runtime=runc.
    #[arg(
        long = "docker-global-arg",
        value_name = "ARG",
        allow_hyphen_values = true
    )]
    pub docker_global_args: Vec<String>,
    /// Only the containers of this run (a batch's or a `deploy up`'s run id).
    #[arg(long, value_name = "ID")]
    pub run: Option<String>,
}

/// Remove every container with our label (and the run's, if given); returns how many.
pub async fn reap(config: &DockerConfig, run: Option<&str>) -> anyhow::Result<usize> {
    let mut list = docker_command(config);
    list.args(["ps", "-a", "-q", "--filter", &format!("label={LABEL}")]);
    if let Some(run) = run {
        list.args(["--filter", &format!("label={RUN_LABEL}={run}")]);
    }
    let out = list.output().await?;
    if !out.status.success() {
        anyhow::bail!(
            "{} ps failed: {}",
            config.executable,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect();
    if ids.is_empty() {
        return Ok(0);
    }
    let rm = docker_command(config)
        .args(["rm", "-f"])
        .args(&ids)
        .output()
        .await?;
    if !rm.status.success() {
        anyhow::bail!(
            "{} rm failed: {}",
            config.executable,
            String::from_utf8_lossy(&rm.stderr).trim()
        );
    }
    Ok(ids.len())
}

pub async fn command(args: ReapArgs) -> anyhow::Result<u8> {
    let mut config = DockerConfig::default();
    if let Some(x) = args.docker_executable {
        config.executable = x;
    }
    config.global_args = args.docker_global_args;
    let n = reap(&config, args.run.as_deref()).await?;
    eprintln!("deploy reap: removed {n} container(s) labelled {LABEL}");
    Ok(0)
}
