//! `docker`: one container per task from the task's image (docker or podman, same CLI), with
//! the static executor bind-mounted read-only as its entrypoint: nothing is installed in the
//! image and nothing needs Python, PyPI or a registry at start.
//!
//! - The token is fresh per container, in a private host file mounted read-only; inside, the
//!   executor's sandbox keeps it from commands (see the profiles' promises).
//! - The port is published on 127.0.0.1 only, and the executor serves TLS, pinned by the
//!   fingerprint its ready line prints.
//! - Lifelines: the container runs attached (`run -i --rm`) with the executor started with
//!   `--exit-on-stdin-eof`, so when we die the client's stdin closes, the executor drains and
//!   the container is removed; `rm -f` by name on every end we see (and from `Drop` when a
//!   start is abandoned); and labels on every container for `agent deploy reap`.
//! - Both pipes of the client are drained from the start, so a chatty container never blocks.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use futures_util::future::BoxFuture;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, ChildStdin};

use super::config::DockerConfig;
use super::containers::{docker_command, Owner, LABEL, RUN_LABEL, TASK_LABEL};
use super::{Deployed, Deployment, Handle, TaskSpec};
use crate::config::EnvironmentConfig;
use crate::executor_client::Endpoint;

/// Where the executor and its token appear in the container.
const EXECUTOR_IN_CONTAINER: &str = "/.executor/executor";
const TOKEN_IN_CONTAINER: &str = "/.executor/token";
const PORT: u16 = 7681;
/// How long a stopping container may drain before it is removed by force.
const STOP_PATIENCE: Duration = Duration::from_secs(10);
/// Seconds the executor keeps a dropped connection's commands for a resume.
const RESUME_GRACE: &str = "5";
/// Bytes of the client's stderr kept for error reports.
const LOG_TAIL: usize = 8192;

pub struct Docker {
    config: DockerConfig,
    executor: PathBuf,
    run_id: String,
    /// Arguments of the executor after `serve` besides ours (profiles it may offer).
    profiles: Vec<String>,
    /// This agent, in every container's labels, so `deploy reap` spares a live run's.
    owner: Owner,
}

impl Docker {
    pub fn new(config: &EnvironmentConfig, run_id: &str) -> anyhow::Result<Self> {
        Ok(Self {
            config: config.docker.clone(),
            executor: super::static_executor(config.executor_static.as_deref())?,
            run_id: run_id.to_string(),
            profiles: super::offered_profiles(config.profile.as_deref())
                .into_iter()
                .flat_map(|p| ["--allow-profile".to_string(), p.to_string()])
                .collect(),
            owner: Owner::current(),
        })
    }
}

/// A container name: docker allows `[a-zA-Z0-9][a-zA-Z0-9_.-]`.
fn container_name(run_id: &str, task: &str) -> String {
    let clean: String = task
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(80)
        .collect();
    let suffix = super::fresh_token()
        .map(|t| t[..8].to_string())
        .unwrap_or_default();
    format!("agent-{run_id}-{clean}-{suffix}")
}

impl Deployment for Docker {
    fn kind(&self) -> &'static str {
        "docker"
    }

    fn start<'a>(&'a self, task: &'a TaskSpec) -> BoxFuture<'a, anyhow::Result<Deployed>> {
        Box::pin(async move {
            let Some(image) = task.image.as_deref() else {
                bail!("the docker deployment needs an image (--image, environment.image, or the instance's)");
            };
            // It comes after our options: one starting with `-` would be parsed as another
            // option of `docker run` (`--privileged`, `-v/:/host`), by anyone who can write
            // an instances file.
            if image.starts_with('-') || image.trim().is_empty() {
                bail!("{image:?} is not an image name (it must not start with '-')");
            }
            let token = super::fresh_token()?;
            let (token_dir, token_file) = super::private_token_dir(&token)?;
            let name = container_name(&self.run_id, &task.name);
            // Made before the container exists: whatever ends this start removes it.
            let guard = Removal {
                config: self.config.clone(),
                name: name.clone(),
                armed: true,
            };
            let mut run = docker_command(&self.config);
            run.args(["run", "-i", "--rm", "--name", &name])
                .args(["--label", &format!("{LABEL}=1")])
                .args(["--label", &format!("{RUN_LABEL}={}", self.run_id)])
                .args(["--label", &format!("{TASK_LABEL}={}", task.name)]);
            for (k, v) in self.owner.labels() {
                run.args(["--label", &format!("{k}={v}")]);
            }
            for (k, v) in &self.config.labels {
                run.args(["--label", &format!("{k}={v}")]);
            }
            run.args(["-p", &format!("127.0.0.1::{PORT}")])
                .arg("-v")
                .arg(format!(
                    "{}:{EXECUTOR_IN_CONTAINER}:ro",
                    self.executor.display()
                ))
                .arg("-v")
                .arg(format!("{}:{TOKEN_IN_CONTAINER}:ro", token_file.display()))
                .args(["--entrypoint", EXECUTOR_IN_CONTAINER]);
            if let Some(pull) = &self.config.pull {
                run.arg(format!("--pull={pull}"));
            }
            run.args(&self.config.run_args).arg(image);
            run.args(["serve", "--listen", &format!("0.0.0.0:{PORT}"), "--tls"])
                .args(["--token-file", TOKEN_IN_CONTAINER])
                .arg("--exit-on-stdin-eof")
                // A loopback connection to a container rarely breaks; when it does because
                // the container died, a short grace ends the instance quickly.
                .args(["--resume-grace", RESUME_GRACE])
                .args(&self.profiles);
            if let Some(workspace) = &task.workspace {
                run.args(["--workspace", workspace]);
            }
            run.stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                // Our own end (stop, or Drop) removes the container; killing the client
                // alone would not.
                .kill_on_drop(true);
            let mut child = run
                .spawn()
                .with_context(|| format!("cannot run {}", self.config.executable))?;
            let lifeline = child.stdin.take().context("docker stdin missing")?;
            let log = Arc::new(Mutex::new(String::new()));
            let stderr = child.stderr.take().map(|e| drain(e, log.clone()));
            let stdout = child.stdout.take().context("docker stdout missing")?;
            let mut lines = BufReader::new(stdout).lines();
            let ready = loop {
                match lines.next_line().await {
                    Ok(Some(line)) => {
                        if let Some(ready) = parse_ready_line(&line) {
                            break ready;
                        }
                        append(&log, &format!("{line}\n"));
                    }
                    Ok(None) | Err(_) => {
                        let status = child.wait().await.ok();
                        // Its error is on stderr, read by another task: wait for that to
                        // end (the exit closed it), or the message may miss it (seen
                        // empty on a busy machine).
                        if let Some(stderr) = stderr {
                            let _ = tokio::time::timeout(Duration::from_secs(10), stderr).await;
                        }
                        bail!(
                            "the container did not start ({} {}): {}",
                            self.config.executable,
                            status.map(|s| s.to_string()).unwrap_or_default(),
                            tail_of(&log)
                        );
                    }
                }
            };
            // The rest of stdout is drained too.
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            let port = docker_command(&self.config)
                .args(["port", &name, &format!("{PORT}/tcp")])
                .output()
                .await
                .context("docker port")?;
            let published = String::from_utf8_lossy(&port.stdout)
                .lines()
                .find(|l| l.starts_with("127.0.0.1:"))
                .map(str::to_string)
                .with_context(|| {
                    format!(
                        "the container publishes no 127.0.0.1 port: {}{}",
                        String::from_utf8_lossy(&port.stdout),
                        String::from_utf8_lossy(&port.stderr)
                    )
                })?;
            let (scheme, fingerprint) = ready;
            Ok(Deployed {
                endpoint: Endpoint {
                    url: format!("{scheme}://{published}{}", protocol::WS_PATH),
                    token: Some(token),
                    token_file: Some(token_file),
                    tls_fingerprint: fingerprint,
                    tls_ca: None,
                },
                kind: "docker",
                id: name,
                owned: true,
                local_fs: false,
                handle: Box::new(Running {
                    child,
                    lifeline: Some(lifeline),
                    guard,
                    log,
                    _token_dir: token_dir,
                }),
            })
        })
    }
}

/// `executor listening on wss://0.0.0.0:7681/v1/ws tls-fingerprint sha256:...` -> the scheme
/// and the fingerprint.
fn parse_ready_line(line: &str) -> Option<(String, Option<String>)> {
    let rest = line.trim().strip_prefix("executor listening on ")?;
    let mut words = rest.split_whitespace();
    let url = words.next()?;
    let scheme = url.split_once("://")?.0.to_string();
    let fingerprint = match (words.next(), words.next()) {
        (Some("tls-fingerprint"), Some(f)) => Some(f.to_string()),
        _ => None,
    };
    Some((scheme, fingerprint))
}

fn drain(
    stream: impl AsyncRead + Unpin + Send + 'static,
    log: Arc<Mutex<String>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut lines = BufReader::new(stream).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            append(&log, &format!("{line}\n"));
        }
    })
}

fn append(log: &Mutex<String>, text: &str) {
    if let Ok(mut log) = log.lock() {
        super::keep_tail(&mut log, text, LOG_TAIL);
    }
}

fn tail_of(log: &Mutex<String>) -> String {
    log.lock().map(|l| l.trim().to_string()).unwrap_or_default()
}

struct Running {
    child: Child,
    lifeline: Option<ChildStdin>,
    guard: Removal,
    log: Arc<Mutex<String>>,
    _token_dir: tempfile::TempDir,
}

impl Handle for Running {
    fn stop(mut self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            // End of file on the executor's stdin: it kills its commands and exits, and the
            // container goes with it (`--rm`). Then make sure, by name.
            drop(self.lifeline.take());
            let _ = tokio::time::timeout(STOP_PATIENCE, self.child.wait()).await;
            self.guard.remove().await;
        })
    }

    fn log(&self) -> String {
        tail_of(&self.log)
    }
}

/// Removes the container by name: `remove` on a deliberate end, `Drop` on any other.
struct Removal {
    config: DockerConfig,
    name: String,
    armed: bool,
}

impl Removal {
    async fn remove(&mut self) {
        let _ = docker_command(&self.config)
            .args(["rm", "-f", &self.name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await;
        self.armed = false;
    }
}

impl Drop for Removal {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (executable, global_args, name) = (
            self.config.executable.clone(),
            self.config.global_args.clone(),
            self.name.clone(),
        );
        let rm = move || {
            let _ = std::process::Command::new(&executable)
                .args(&global_args)
                .args(["rm", "-f", &name])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            // On a runtime worker (a start dropped at its deadline): `rm -f` waits for the
            // container to stop, seconds that would stall every task on this worker. A
            // thread of its own does it; should the process end first, the container's
            // lifeline (our pipe on its stdin) still ends it, and `--rm` removes it.
            let again = rm.clone();
            if std::thread::Builder::new()
                .name("docker-rm".into())
                .spawn(rm)
                .is_ok()
            {
                return;
            }
            // No thread: here and now after all.
            again();
            return;
        }
        // No runtime (we are going away): here and now.
        rm();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_lines_give_scheme_and_pin() {
        assert_eq!(
            parse_ready_line(
                "executor listening on wss://0.0.0.0:7681/v1/ws tls-fingerprint sha256:ab"
            ),
            Some(("wss".into(), Some("sha256:ab".into())))
        );
        assert_eq!(parse_ready_line("other"), None);
    }

    #[test]
    fn container_names_keep_only_allowed_characters() {
        let name = container_name("r1", "django__django-11099/x");
        assert!(
            name.starts_with("agent-r1-django__django-11099_x-"),
            "{name}"
        );
    }
}
