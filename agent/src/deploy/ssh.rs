//! `ssh`: the static executor copied to a host over ssh and started inside the ssh session,
//! reached through a tunnel of that same session. The target needs sshd and nothing else: no
//! inbound port besides ssh's, no install, any libc.
//!
//! - One master connection (`ssh -M`, a control socket in a private directory) runs
//!   `executor serve --listen 127.0.0.1:0 --exit-on-stdin-eof` with our pipe as its stdin:
//!   when the session ends (we stop, die, or the network drops), the executor's stdin closes
//!   and it kills its commands and exits; the shell around it removes the copied files. A
//!   silent drop (no FIN, no RST) ends our ssh within about 40 s (`ServerAliveInterval=10`,
//!   `ServerAliveCountMax=3`); the target's sshd ends the session on its side by its own
//!   `ClientAliveInterval` (or TCP keepalive), which is the target's configuration.
//! - The port is read from its ready line and forwarded from a loopback port here through the
//!   master (`ssh -O forward`); plain `ws://` is fine inside the tunnel.
//! - The token is the one the executor generated in its private state directory, read back
//!   over the same connection into a private file here.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use futures_util::future::BoxFuture;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};

use super::config::SshConfig;
use super::{Deployed, Deployment, Handle, TaskSpec};
use crate::config::EnvironmentConfig;
use crate::executor_client::Endpoint;
use crate::shell::quote;

const STOP_PATIENCE: Duration = Duration::from_secs(10);
const LOG_TAIL: usize = 8192;

pub struct Ssh {
    config: SshConfig,
    host: String,
    executor: PathBuf,
    /// The profiles the executor may offer (never `trusted` unless asked for).
    profiles: Vec<&'static str>,
}

impl Ssh {
    pub fn new(config: &EnvironmentConfig) -> anyhow::Result<Self> {
        let Some(host) = config.ssh.host.clone() else {
            bail!("the ssh deployment needs a host (--ssh-host, environment.ssh.host)");
        };
        Ok(Self {
            config: config.ssh.clone(),
            host,
            executor: super::static_executor(config.executor_static.as_deref())?,
            profiles: super::offered_profiles(config.profile.as_deref()),
        })
    }

    /// `ssh` with our options, the configured ones, and the control socket if any.
    fn ssh(&self, control: Option<&std::path::Path>) -> Command {
        let mut c = Command::new("ssh");
        c.args(["-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes"]);
        if let Some(port) = self.config.port {
            c.args(["-p", &port.to_string()]);
        }
        if let Some(identity) = &self.config.identity_file {
            c.arg("-i").arg(identity);
        }
        if let Some(control) = control {
            c.arg("-S").arg(control);
        }
        c.args(&self.config.ssh_args);
        // A silent network drop (no FIN, no RST) would leave the session up for hours of TCP
        // retransmits: probe the server inside the session every 10 s and give up after 3
        // unanswered, so ssh exits within about 40 s and the deployment notices. After the
        // configured arguments: ssh takes the first value of an option, so users can override.
        c.args([
            "-o",
            "ServerAliveInterval=10",
            "-o",
            "ServerAliveCountMax=3",
        ]);
        c.kill_on_drop(true);
        c
    }
}

impl Deployment for Ssh {
    fn kind(&self) -> &'static str {
        "ssh"
    }

    fn start<'a>(&'a self, task: &'a TaskSpec) -> BoxFuture<'a, anyhow::Result<Deployed>> {
        Box::pin(async move {
            // 1. Copy the executor into a private directory of the target.
            let binary = std::fs::File::open(&self.executor)
                .with_context(|| format!("cannot open {}", self.executor.display()))?;
            let copy = self
                .ssh(None)
                .arg(&self.host)
                .arg(
                    "umask 077 && d=$(mktemp -d /tmp/agent-executor.XXXXXX) && \
                     cat > \"$d/executor\" && chmod 700 \"$d/executor\" && echo \"$d\"",
                )
                .stdin(Stdio::from(binary))
                .output()
                .await
                .context("cannot run ssh")?;
            if !copy.status.success() {
                bail!(
                    "cannot copy the executor to {} over ssh: {}",
                    self.host,
                    String::from_utf8_lossy(&copy.stderr).trim()
                );
            }
            let remote_dir = String::from_utf8_lossy(&copy.stdout).trim().to_string();
            if !remote_dir.starts_with("/tmp/agent-executor.") {
                bail!("unexpected answer from the target: {remote_dir:?}");
            }
            // 2. Start it in the master session, its stdin our lifeline.
            let local = tempfile::Builder::new()
                .prefix("agent-ssh-")
                .tempdir()
                .context("cannot create a directory for the ssh control socket")?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(local.path(), std::fs::Permissions::from_mode(0o700))?;
            let control = local.path().join("ctl");
            let d = quote(&remote_dir);
            let mut serve = format!(
                "{d}/executor serve --listen 127.0.0.1:0 --state-dir {d}/state \
                 --exit-on-stdin-eof --resume-grace 30"
            );
            for p in &self.profiles {
                serve.push_str(&format!(" --allow-profile {p}"));
            }
            if let Some(w) = &task.workspace {
                serve.push_str(&format!(" --workspace {}", quote(w)));
            }
            let script = format!("{serve}; rm -rf {d}");
            let mut master = self.ssh(Some(&control));
            master
                .args(["-M", "-o", "ControlPersist=no"])
                .arg(&self.host)
                .arg(script)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let mut child = master.spawn().context("cannot run ssh")?;
            let lifeline = child.stdin.take().context("ssh stdin missing")?;
            let log = Arc::new(Mutex::new(String::new()));
            let stderr = child.stderr.take().map(|stderr| {
                let log = log.clone();
                tokio::spawn(async move {
                    let mut lines = BufReader::new(stderr).lines();
                    while let Ok(Some(line)) = lines.next_line().await {
                        if let Ok(mut log) = log.lock() {
                            super::keep_tail(&mut log, &format!("{line}\n"), LOG_TAIL);
                        }
                    }
                })
            });
            let stdout = child.stdout.take().context("ssh stdout missing")?;
            let mut lines = BufReader::new(stdout).lines();
            let remote_port = loop {
                match lines.next_line().await {
                    Ok(Some(line)) => {
                        if let Some(port) = ready_port(&line) {
                            break port;
                        }
                    }
                    _ => {
                        let _ = child.wait().await;
                        // Its error is on stderr, read by the task above: wait for it to end.
                        if let Some(stderr) = stderr {
                            let _ =
                                tokio::time::timeout(std::time::Duration::from_secs(10), stderr)
                                    .await;
                        }
                        bail!(
                            "the executor did not start on {}: {}",
                            self.host,
                            log.lock().map(|l| l.trim().to_string()).unwrap_or_default()
                        );
                    }
                }
            };
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            // 3. Its token, into a private file here.
            let token = self
                .ssh(Some(&control))
                .arg(&self.host)
                .arg(format!("cat {d}/state/token"))
                .output()
                .await
                .context("cannot run ssh")?;
            let token = String::from_utf8_lossy(&token.stdout).trim().to_string();
            if token.len() < 32 {
                bail!("cannot read the executor's token on {}", self.host);
            }
            let (token_dir, token_file) = super::private_token_dir(&token)?;
            // 4. The tunnel: a loopback port here to the executor's loopback port there.
            let local_port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .context("cannot find a free loopback port")?
                .port();
            let forward = self
                .ssh(Some(&control))
                .args(["-O", "forward", "-L"])
                .arg(format!("127.0.0.1:{local_port}:127.0.0.1:{remote_port}"))
                .arg(&self.host)
                .output()
                .await
                .context("cannot run ssh")?;
            if !forward.status.success() {
                bail!(
                    "cannot forward a port to the executor on {}: {}",
                    self.host,
                    String::from_utf8_lossy(&forward.stderr).trim()
                );
            }
            Ok(Deployed {
                endpoint: Endpoint {
                    url: format!("ws://127.0.0.1:{local_port}{}", protocol::WS_PATH),
                    token: Some(token),
                    token_file: Some(token_file),
                    tls_fingerprint: None,
                    tls_ca: None,
                },
                kind: "ssh",
                id: format!("{}:{remote_dir}", self.host),
                owned: true,
                local_fs: false,
                handle: Box::new(Session {
                    child,
                    lifeline: Some(lifeline),
                    log,
                    _dirs: (local, token_dir),
                }),
            })
        })
    }
}

/// `executor listening on ws://127.0.0.1:PORT/v1/ws` -> PORT.
fn ready_port(line: &str) -> Option<u16> {
    let url = line.trim().strip_prefix("executor listening on ")?;
    let url = url.split_whitespace().next()?;
    let hostport = url.split_once("://")?.1.split('/').next()?;
    hostport.rsplit_once(':')?.1.parse().ok()
}

struct Session {
    child: Child,
    lifeline: Option<ChildStdin>,
    log: Arc<Mutex<String>>,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

impl Handle for Session {
    fn stop(mut self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            drop(self.lifeline.take());
            if tokio::time::timeout(STOP_PATIENCE, self.child.wait())
                .await
                .is_err()
            {
                let _ = self.child.kill().await;
            }
        })
    }

    fn log(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_port_comes_from_the_ready_line() {
        assert_eq!(
            super::ready_port("executor listening on ws://127.0.0.1:40123/v1/ws"),
            Some(40123)
        );
    }
}
