//! Where executors run. Each deployment (one module each) starts an executor for a task and
//! hands back how to reach it and a handle whose `stop` tears it down; dropping the handle
//! without `stop` (a panic, an aborted task) still tears down, synchronously and best effort.
//!
//! | deployment | the executor | its lifeline |
//! |---|---|---|
//! | `local` | `executor serve` on a loopback port of this host | its stdin, our pipe |
//! | `remote` | already running; a pool hands each task a free one | none: not ours |
//! | `docker` | the static executor, bind-mounted read-only as the entrypoint of the task's image | `docker run -i`'s stdin, and the container's name (`rm -f`) |
//! | `ssh` | the static executor, copied to the host and started in the ssh session | the ssh session |
//! | `reverse` | `executor connect`, dialling out to our relay | not ours |

pub mod cli;
pub mod config;
pub mod containers;
pub mod docker;
pub mod flags;
pub mod k8s;
pub mod local;
pub mod reap;
pub mod remote;
pub mod reverse;
pub mod ssh;
pub mod up;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use futures_util::future::BoxFuture;

use crate::config::EnvironmentConfig;
use crate::executor_client::{Choice, Endpoint, PROFILE_PREFERENCE};

/// What one task asks of its deployment.
#[derive(Debug, Clone, Default)]
pub struct TaskSpec {
    /// Names and labels what is started for it (the instance id in a batch).
    pub name: String,
    /// The task's image (`docker`).
    pub image: Option<String>,
    /// Default working directory of the executor: a host path for `local`, a path in the
    /// container for `docker`, on the host for `ssh`; ignored by `remote`.
    pub workspace: Option<String>,
    /// The network the task's commands ask for (`environment.network`). A `local` executor
    /// is started with it as its client's ceiling (`serve --allow-net`), since the client of
    /// an executor of our own is us; other deployments leave it to their executor's clients.
    pub network: Option<protocol::RequestNetwork>,
}

/// A started executor, owned until [`Deployed::stop`].
pub struct Deployed {
    pub endpoint: Endpoint,
    /// `local`, `remote`, `docker`, `ssh`.
    pub kind: &'static str,
    /// The container id, process id, or URL: what a person would look for.
    pub id: String,
    /// We started it for ourselves: every profile is ours to choose from (the strongest that
    /// works is taken), where a shared executor's default is respected.
    pub owned: bool,
    /// It shares this host's filesystem (paths we create are its paths).
    pub local_fs: bool,
    handle: Box<dyn Handle>,
}

impl Deployed {
    /// How the profile is chosen when none is named: a local executor's among strict and
    /// landlock only, another executor we started among what it offers, a shared one's
    /// default.
    pub fn profile_choice(&self) -> Choice {
        Choice::for_deployment(self.kind, self.owned)
    }

    /// The executor's own log so far (for error reports), where we have it.
    pub fn log(&self) -> String {
        self.handle.log()
    }

    /// Tear down: stop the executor and remove what was made for it. Always completes.
    pub async fn stop(self) {
        self.handle.stop().await;
    }
}

/// The part of a started executor that must be torn down.
pub trait Handle: Send + Sync {
    fn stop(self: Box<Self>) -> BoxFuture<'static, ()>;
    fn log(&self) -> String {
        String::new()
    }
}

/// One kind of deployment.
pub trait Deployment: Send + Sync {
    fn kind(&self) -> &'static str;
    /// Start an executor for `task`. Called under the start deadline: if the deadline passes,
    /// the future is dropped, so whatever it made must be removed by its own `Drop`.
    fn start<'a>(&'a self, task: &'a TaskSpec) -> BoxFuture<'a, anyhow::Result<Deployed>>;
}

/// [`Deployment::start`] within `deadline`.
pub async fn start_within(
    deployment: &dyn Deployment,
    task: &TaskSpec,
    deadline: Duration,
) -> anyhow::Result<Deployed> {
    match tokio::time::timeout(deadline, deployment.start(task)).await {
        Ok(started) => started,
        Err(_) => bail!(
            "the {} executor did not come up within the start timeout of {:.0}s \
             (environment.start_timeout)",
            deployment.kind(),
            deadline.as_secs_f64()
        ),
    }
}

/// The start deadline of `config`.
pub fn start_timeout(config: &EnvironmentConfig) -> Duration {
    Duration::try_from_secs_f64(config.start_timeout).unwrap_or(Duration::from_secs(120))
}

/// The deployment `config` names, ready to start executors.
pub fn from_config(
    config: &EnvironmentConfig,
    run_id: &str,
) -> anyhow::Result<Box<dyn Deployment>> {
    let remote = remote::entries(config);
    let kind = match config.deployment.as_deref() {
        Some(kind) => kind,
        None if !remote.is_empty() => "remote",
        None => "local",
    };
    Ok(match kind {
        "local" => Box::new(local::Local::new(config.executor_bin.as_deref())?),
        "remote" => Box::new(remote::Pool::new(remote)?),
        "docker" => Box::new(docker::Docker::new(config, run_id)?),
        "ssh" => Box::new(ssh::Ssh::new(config)?),
        "reverse" => Box::new(reverse::Reverse::start(
            config.reverse.listen.parse().with_context(|| {
                format!("environment.reverse.listen {:?} is not an address", config.reverse.listen)
            })?,
            config.reverse.host.as_deref(),
        )?),
        other => bail!(
            "unknown deployment {other:?} (environment.deployment, --deploy): local, remote, docker, ssh or reverse"
        ),
    })
}

/// The static executor for targets that do not share this host's libraries: the configured
/// one, else `executor-static` next to `agent`, else the static build of this workspace
/// (`target/static/executor`, where `.ci/build-static` puts it and prints its path).
pub fn static_executor(configured: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(path) = configured {
        if path.is_file() {
            return Ok(path.to_path_buf());
        }
        bail!("the static executor {} does not exist", path.display());
    }
    let exe = std::env::current_exe().context("cannot find this agent's own path")?;
    let dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut candidates = vec![dir.join("executor-static")];
    // target/<profile>/agent or target/static/agent -> target/static/executor
    if let Some(target) = dir.parent() {
        candidates.push(target.join("static/executor"));
    }
    if let Some(found) = candidates.into_iter().find(|c| c.is_file()) {
        return Ok(found);
    }
    bail!(
        "cannot find the static executor (executor-static next to agent, or target/static/executor): \
         build it with `.ci/build-static` and pass --executor-static PATH \
         (environment.executor_static)"
    )
}

/// The profile that runs commands unsandboxed, as the executor's own user.
pub const TRUSTED: &str = "trusted";

/// The profiles an executor we deploy offers: the preference order without `trusted`, unless
/// the user asked for it by name (`--profile trusted`, `environment.profile: trusted`).
/// `trusted` runs commands as the executor's own user, which in a container is root, and so
/// can read the executor's token (`/.executor/token`) and take the executor over: it must
/// never be the silent fallback when the sandboxes cannot work in a task image.
pub fn offered_profiles(requested: Option<&str>) -> Vec<&'static str> {
    let trusted = requested == Some(TRUSTED);
    if trusted {
        crate::notes::note!(
            "WARNING: profile \"trusted\" was asked for: commands run unsandboxed as the \
             executor's user (root in a container) and can read the executor's token and take \
             it over; use it only for trusted commands"
        );
    }
    PROFILE_PREFERENCE
        .iter()
        .copied()
        .filter(|p| *p != TRUSTED || trusted)
        .collect()
}

/// A fresh bearer token: 32 random bytes as hex.
pub fn fresh_token() -> anyhow::Result<String> {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 32];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| anyhow::anyhow!("no randomness for a token"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// A run's id (`<prefix><12 random hex digits>`), in its containers' names and run label.
/// Random, not our pid: two agents in different pid namespaces (two CI jobs, containers)
/// sharing one docker daemon have the same pids, and the end-of-run reap by run label would
/// remove the other's containers.
pub fn fresh_run_id(prefix: &str) -> anyhow::Result<String> {
    let token = fresh_token()?;
    Ok(format!("{prefix}{}", &token[..12]))
}

/// The deployment `config` names, for a new run of `prefix` (`b` a batch, `up`, `run`,
/// `exec`, `cp`, `shell`) with a fresh run id (`fresh_run_id`): every command that deploys
/// comes through here, so every container's run label is random.
pub fn for_new_run(
    config: &EnvironmentConfig,
    prefix: &str,
) -> anyhow::Result<(String, Box<dyn Deployment>)> {
    let run_id = fresh_run_id(prefix)?;
    let deployment = from_config(config, &run_id)?;
    Ok((run_id, deployment))
}

/// A private directory (0700) holding `token` in a file (0600); removed when dropped.
pub fn private_token_dir(token: &str) -> anyhow::Result<(tempfile::TempDir, PathBuf)> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let dir = tempfile::Builder::new()
        .prefix("agent-deploy-")
        .tempdir()
        .context("cannot create a directory for the executor's token")?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))
        .context("cannot restrict the token directory")?;
    let path = dir.path().join("token");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    file.write_all(token.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok((dir, path))
}

/// Keep the last `max` bytes of a stream's text, for error reports.
pub fn keep_tail(buffer: &mut String, more: &str, max: usize) {
    buffer.push_str(more);
    if buffer.len() > max {
        let mut cut = buffer.len() - max;
        while !buffer.is_char_boundary(cut) {
            cut += 1;
        }
        buffer.drain(..cut);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_new_run_gets_a_fresh_random_id_with_its_prefix_not_the_pid() {
        let config = EnvironmentConfig {
            executor_url: Some("ws://127.0.0.1:9/v1/ws".into()),
            ..Default::default()
        };
        let pid = std::process::id().to_string();
        let mut seen = Vec::new();
        for prefix in ["b", "up", "run", "exec", "cp", "shell", "exec"] {
            let (id, deployment) = for_new_run(&config, prefix).unwrap();
            assert_eq!(deployment.kind(), "remote");
            let digits = id.strip_prefix(prefix).unwrap();
            assert_eq!(digits.len(), 12, "{id}");
            assert!(digits.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
            assert_ne!(digits, pid);
            assert!(!seen.contains(&id), "{id} twice");
            seen.push(id);
        }
    }
}
