//! Where commands go: a remote executor (URL and token), or a local `executor serve` owned by
//! this agent, started on a free loopback port with a fresh state directory (so a fresh token)
//! and stopped when the agent exits.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use futures_util::future::BoxFuture;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// How long the executor may take to print its listening line.
const START_PATIENCE: Duration = Duration::from_secs(20);
/// How long a stopping executor may drain before it is killed.
const STOP_PATIENCE: Duration = Duration::from_secs(5);
/// Seconds the local executor keeps our commands running after a dropped connection.
const LOCAL_RESUME_GRACE: &str = "30";

/// Variables a local executor inherits from the agent. Everything else, API keys above all,
/// stays with the agent: the executor and its commands never see the model's credentials.
const INHERITED_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TMPDIR",
    "TZ",
    "RUST_LOG",
    "RUST_BACKTRACE",
];

/// The executor binary: the override, else next to this executable, else on `PATH`.
pub fn find_executor(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(path) = explicit {
        if path.is_file() {
            return Ok(path.to_path_buf());
        }
        bail!("--executor-bin {} does not exist", path.display());
    }
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf))
    {
        let sibling = dir.join("executor");
        if sibling.is_file() {
            return Ok(sibling);
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join("executor");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    bail!(
        "cannot find the `executor` binary next to the agent or on PATH; build it with \
         `cargo build --bins`, pass --executor-bin PATH, or connect to a running one with --executor URL"
    )
}

pub struct LocalExecutor {
    child: Child,
    pub url: String,
    pub token: String,
    pub binary: PathBuf,
    state: tempfile::TempDir,
    /// Write end of the executor's stdin; dropping it (or our death) stops the executor.
    _lifeline: tokio::process::ChildStdin,
}

impl LocalExecutor {
    /// Start `binary serve` with `workspace` as its default working directory, and, when
    /// `network` is a policy, that policy as the ceiling of its one client (us): without it
    /// the client's ceiling is `host`, and a profile that enforces policies (strict) would
    /// answer a requested policy with no network at all.
    pub async fn start(
        binary: &Path,
        workspace: &Path,
        network: Option<&protocol::RequestNetwork>,
    ) -> anyhow::Result<Self> {
        let state = tempfile::Builder::new()
            .prefix("agent-executor-")
            .tempdir()
            .context("cannot create a state directory for the local executor")?;
        // Only we may read the token the executor writes here.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(state.path(), std::fs::Permissions::from_mode(0o700))
            .context("cannot restrict the local executor's state directory")?;
        let log_path = state.path().join("executor.log");
        let log = std::fs::File::create(&log_path)
            .with_context(|| format!("cannot create {}", log_path.display()))?;
        let mut command = Command::new(binary);
        command.env_clear();
        for name in INHERITED_ENV {
            if let Some(value) = std::env::var_os(name) {
                command.env(name, value);
            }
        }
        command
            .arg("serve")
            .args(["--listen", "127.0.0.1:0", "--state-dir"])
            .arg(state.path())
            .arg("--workspace")
            .arg(workspace)
            // We are its only client and the user's own: every profile is ours to choose from
            // (a shared executor offers only the filtered ones unless its operator says so).
            .args(
                crate::executor_client::PROFILE_PREFERENCE
                    .iter()
                    .flat_map(|name| ["--allow-profile", name]),
            )
            // Our end of this pipe is the executor's lifeline: when we die, even by SIGKILL,
            // it drains and exits.
            .arg("--exit-on-stdin-eof")
            // A loopback connection rarely breaks, but if ours does (a WebSocket error on
            // either side), the running command survives and we resume it. It costs nothing:
            // every deliberate end of ours sends a close frame (commands killed at once), and
            // if we die the executor does too, killing everything.
            .args(["--resume-grace", LOCAL_RESUME_GRACE])
            .args(network_args(network))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true);
        if std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "warn");
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("cannot start {}", binary.display()))?;
        let lifeline = child.stdin.take().context("executor stdin missing")?;
        let stdout = child.stdout.take().context("executor stdout missing")?;
        let mut line = String::new();
        let read =
            tokio::time::timeout(START_PATIENCE, BufReader::new(stdout).read_line(&mut line)).await;
        let url = line
            .trim()
            .strip_prefix("executor listening on ")
            .map(str::to_string);
        let url = match (read, url) {
            (Ok(Ok(_)), Some(url)) => url,
            _ => {
                let _ = child.start_kill();
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                bail!(
                    "the local executor {} did not start (stdout: {:?}); its log:\n{}",
                    binary.display(),
                    line.trim(),
                    tail(&log, 2000)
                );
            }
        };
        let token = std::fs::read_to_string(state.path().join("token"))
            .context("the local executor wrote no token")?
            .trim()
            .to_string();
        Ok(Self {
            child,
            _lifeline: lifeline,
            url,
            token,
            binary: binary.to_path_buf(),
            state,
        })
    }

    /// The executor's log so far, for error reports.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.state.path().join("executor.log")).unwrap_or_default()
    }

    /// SIGTERM (the executor kills its commands and drains), then SIGKILL after a bound.
    pub async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            if tokio::time::timeout(STOP_PATIENCE, self.child.wait())
                .await
                .is_ok()
            {
                return;
            }
        }
        let _ = self.child.kill().await;
    }
}

/// `serve`'s flags giving its single token `network` as its ceiling: a policy's rules; none
/// for `host`, `none` or no setting (`none` is the request's to ask, and is always granted).
fn network_args(network: Option<&protocol::RequestNetwork>) -> Vec<String> {
    match network {
        Some(protocol::RequestNetwork::Policy { allow, deny }) => allow
            .iter()
            .flat_map(|rule| ["--allow-net".to_string(), rule.clone()])
            .chain(
                deny.iter()
                    .flat_map(|rule| ["--deny-net".to_string(), rule.clone()]),
            )
            .collect(),
        _ => Vec::new(),
    }
}

fn tail(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// `local`: an `executor serve` of our own on this host per task, its workspace the task's.
pub struct Local {
    binary: PathBuf,
}

impl Local {
    pub fn new(binary: Option<&Path>) -> anyhow::Result<Self> {
        Ok(Self {
            binary: find_executor(binary)?,
        })
    }
}

impl super::Deployment for Local {
    fn kind(&self) -> &'static str {
        "local"
    }

    fn start<'a>(
        &'a self,
        task: &'a super::TaskSpec,
    ) -> BoxFuture<'a, anyhow::Result<super::Deployed>> {
        Box::pin(async move {
            let workspace = match &task.workspace {
                Some(w) => PathBuf::from(w),
                None => std::env::current_dir().context("cannot read the current directory")?,
            };
            std::fs::create_dir_all(&workspace)
                .with_context(|| format!("cannot create the workspace {}", workspace.display()))?;
            let local =
                LocalExecutor::start(&self.binary, &workspace, task.network.as_ref()).await?;
            crate::notes::note!(
                "executor: started a local executor ({}) at {} with workspace {}",
                local.binary.display(),
                local.url,
                workspace.display()
            );
            Ok(super::Deployed {
                endpoint: crate::executor_client::Endpoint {
                    url: local.url.clone(),
                    token: Some(local.token.clone()),
                    token_file: Some(local.state.path().join("token")),
                    tls_fingerprint: None,
                    tls_ca: None,
                },
                kind: "local",
                id: local.child.id().map(|p| p.to_string()).unwrap_or_default(),
                owned: true,
                local_fs: true,
                handle: Box::new(local),
            })
        })
    }
}

impl super::Handle for LocalExecutor {
    fn stop(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(LocalExecutor::stop(*self))
    }

    fn log(&self) -> String {
        LocalExecutor::log(self)
    }
}

/// A directory whoever the sandbox runs commands as can write (uid 65534 under strict and
/// landlock; the demo's reason).
pub fn make_open_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777))?;
    // Its parent is ours (0700 by tempfile): the sandbox's uid must pass through it.
    if let Some(parent) = dir.parent() {
        std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o711))?;
    }
    Ok(())
}
