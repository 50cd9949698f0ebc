//! `agent deploy reap`: remove the containers a killed agent left behind, found by the label
//! every container of ours carries.
//!
//! Every container also names its owner: the agent's host, pid namespace, pid and the start
//! time of that pid (`/proc/<pid>/stat`, field 22). By default only containers whose owner is
//! gone are removed: same host and pid namespace (else we cannot tell, and keep it), and the
//! pid dead or reused by another process (the start time differs). Live containers of a
//! running batch are left alone; `--all` removes every container of ours, `--run ID` every
//! container of that run.

use clap::Args;

use super::config::DockerConfig;
use super::containers::{
    docker_command, start_time, Owner, LABEL, OWNER_HOST_LABEL, OWNER_PIDNS_LABEL, OWNER_PID_LABEL,
    OWNER_START_LABEL, RUN_LABEL,
};

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
    /// Every container of this run (a batch's or a `deploy up`'s run id), owner alive or not.
    #[arg(long, value_name = "ID", conflicts_with = "all")]
    pub run: Option<String>,
    /// Every container of ours, also those of agents still running.
    #[arg(long)]
    pub all: bool,
}

/// Whether the owner recorded in a container's labels is gone, as seen from `here`: same
/// host and pid namespace, and its pid dead or now another process. `None` labels (an older
/// agent's container) or another host or namespace: not known to be gone.
fn owner_gone(labels: &Labels, here: &Owner) -> bool {
    let (Some(host), Some(pidns), Some(pid), Some(start)) = (
        labels.host.as_deref(),
        labels.pidns.as_deref(),
        labels.pid.as_deref().and_then(|p| p.parse::<u32>().ok()),
        labels.start.as_deref(),
    ) else {
        return false;
    };
    if host != here.host || pidns != here.pidns || here.pidns.is_empty() {
        return false;
    }
    match start_time(pid) {
        None => true,
        Some(now) => now != start,
    }
}

/// A container's owner labels, as `inspect` printed them.
#[derive(Debug, Default)]
struct Labels {
    host: Option<String>,
    pidns: Option<String>,
    pid: Option<String>,
    start: Option<String>,
}

/// `inspect`'s line `<id>\t<host>\t<pidns>\t<pid>\t<start>`; a missing label prints as
/// `<no value>` (docker) or nothing (podman).
fn parse_inspect_line(line: &str) -> Option<(String, Labels)> {
    let mut fields = line.split('\t');
    let id = fields.next()?.trim().to_string();
    if id.is_empty() {
        return None;
    }
    let mut value = || {
        fields
            .next()
            .map(str::trim)
            .filter(|v| !v.is_empty() && *v != "<no value>")
            .map(str::to_string)
    };
    let labels = Labels {
        host: value(),
        pidns: value(),
        pid: value(),
        start: value(),
    };
    Some((id, labels))
}

/// Which containers `reap` removes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope<'a> {
    /// Those whose owning agent is gone (the default).
    Orphans,
    /// Every container of this run.
    Run(&'a str),
    /// Every container of ours.
    All,
}

/// Remove every container of `run` (the batch's own, at its end), or without a run those
/// whose owner is gone; returns how many were removed.
pub async fn reap(config: &DockerConfig, run: Option<&str>) -> anyhow::Result<usize> {
    let scope = run.map_or(Scope::Orphans, Scope::Run);
    Ok(reap_scope(config, scope).await?.0)
}

/// Remove the containers with our label that `scope` selects; returns how many, and how many
/// were kept because their owner lives (or cannot be judged from here).
pub async fn reap_scope(config: &DockerConfig, scope: Scope<'_>) -> anyhow::Result<(usize, usize)> {
    let run = match scope {
        Scope::Run(run) => Some(run),
        Scope::Orphans | Scope::All => None,
    };
    let all = list_ours(config, run).await?;
    let ids = match scope {
        Scope::Run(_) | Scope::All => all.clone(),
        Scope::Orphans => orphans(config, &all).await?,
    };
    let kept = all.len() - ids.len();
    if ids.is_empty() {
        return Ok((0, kept));
    }
    let mut left = ids.clone();
    // Twice at most: a container can end by itself while we remove it (`rm -f` unpauses a
    // paused one, whose executor then sees its lifeline gone, exits, and `--rm` removes it
    // first), and podman then fails the whole `rm` with "container state improper". What
    // counts is whether any is still there.
    for attempt in 0..2 {
        let rm = docker_command(config)
            .args(["rm", "-f"])
            .args(&left)
            .output()
            .await?;
        if rm.status.success() {
            return Ok((ids.len(), kept));
        }
        let listed = list_ours(config, None).await?;
        left.retain(|id| listed.contains(id));
        if left.is_empty() {
            return Ok((ids.len(), kept));
        }
        if attempt == 1 {
            anyhow::bail!(
                "{} rm failed ({} container(s) left): {}",
                config.executable,
                left.len(),
                String::from_utf8_lossy(&rm.stderr).trim()
            );
        }
    }
    Ok((ids.len(), kept))
}

/// Ids of the containers with our label (of `run` only, when given), running or not.
async fn list_ours(config: &DockerConfig, run: Option<&str>) -> anyhow::Result<Vec<String>> {
    let mut list = docker_command(config);
    list.args([
        "ps",
        "-a",
        "-q",
        "--no-trunc",
        "--filter",
        &format!("label={LABEL}"),
    ]);
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
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect())
}

/// The containers of `ids` whose owner is gone.
async fn orphans(config: &DockerConfig, ids: &[String]) -> anyhow::Result<Vec<String>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let format = [
        OWNER_HOST_LABEL,
        OWNER_PIDNS_LABEL,
        OWNER_PID_LABEL,
        OWNER_START_LABEL,
    ]
    .iter()
    .map(|l| format!("{{{{index .Config.Labels \"{l}\"}}}}"))
    .fold("{{.Id}}".to_string(), |line, field| line + "\t" + &field);
    let out = docker_command(config)
        .args(["inspect", "--format", &format])
        .args(ids)
        .output()
        .await?;
    // A container removed meanwhile makes inspect fail for it alone: judge the others.
    let here = Owner::current();
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(parse_inspect_line)
        .filter(|(_, labels)| owner_gone(labels, &here))
        .map(|(id, _)| id)
        .collect())
}

pub async fn command(args: ReapArgs) -> anyhow::Result<u8> {
    let mut config = DockerConfig::default();
    if let Some(x) = args.docker_executable {
        config.executable = x;
    }
    config.global_args = args.docker_global_args;
    let scope = match (&args.run, args.all) {
        (Some(run), _) => Scope::Run(run),
        (None, true) => Scope::All,
        (None, false) => Scope::Orphans,
    };
    let (removed, kept) = reap_scope(&config, scope).await?;
    eprintln!("deploy reap: removed {removed} container(s) labelled {LABEL}");
    if kept > 0 {
        eprintln!(
            "deploy reap: kept {kept} whose agent is alive or not on this host (--all removes them)"
        );
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inspect_lines_give_the_owner_labels_and_missing_ones_are_none() {
        let (id, l) = parse_inspect_line("abc\th\tpid:[1]\t42\t99").unwrap();
        assert_eq!(id, "abc");
        assert_eq!(l.pid.as_deref(), Some("42"));
        assert_eq!(l.start.as_deref(), Some("99"));
        let (_, l) = parse_inspect_line("abc\t<no value>\t\t<no value>\t").unwrap();
        assert!(l.host.is_none() && l.pidns.is_none() && l.pid.is_none() && l.start.is_none());
    }

    #[test]
    fn this_process_is_an_owner_alive_and_a_changed_start_time_is_gone() {
        let here = Owner::current();
        assert!(!here.start.is_empty());
        let labels = |o: &Owner| Labels {
            host: Some(o.host.clone()),
            pidns: Some(o.pidns.clone()),
            pid: Some(o.pid.to_string()),
            start: Some(o.start.clone()),
        };
        assert!(!owner_gone(&labels(&here), &here));
        let reused = Owner {
            start: "1".into(),
            ..here.clone()
        };
        assert!(owner_gone(&labels(&reused), &here));
        let elsewhere = Owner {
            host: "another-host".into(),
            start: "1".into(),
            ..here.clone()
        };
        assert!(!owner_gone(&labels(&elsewhere), &here));
        assert!(!owner_gone(&Labels::default(), &here));
    }
}
