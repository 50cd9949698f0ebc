//! A daemon somewhere: on this host ([`crate::Daemon`]), in a VM ([`crate::vm::Vm`]) or in a
//! container ([`crate::container::Container`]). A suite connects to it like a client on another
//! machine would, and checks the outcome from outside the sandbox, on the target itself:
//! its processes, files and cgroups, through a way in that is not the executor.

use crate::{Client, PATIENCE};

/// Where a daemon listens and how to authenticate to it.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// `ws://` or `wss://` URL of `/v1/ws`.
    pub url: String,
    pub token: String,
    /// With TLS: the certificate's `sha256:<hex>` fingerprint, pinned by clients.
    pub fingerprint: Option<String>,
}

impl Endpoint {
    /// A client with the token, pinning the certificate when the daemon serves TLS.
    pub async fn connect(&self) -> Client {
        let connected = match &self.fingerprint {
            Some(pin) => Client::connect_pinned(&self.url, Some(&self.token), pin).await,
            None => Client::connect(&self.url, Some(&self.token)).await,
        };
        connected.unwrap_or_else(|e| panic!("cannot connect to {}: {e}", self.url))
    }
}

/// A process seen from outside the sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Process {
    pub pid: i32,
    /// State letter (`R`, `S`, `T`, `Z`, ...).
    pub state: char,
    /// Command line, arguments separated by spaces.
    pub cmdline: String,
}

/// What a command run from outside the sandbox printed (stdout and stderr) and its exit code.
#[derive(Debug, Clone)]
pub struct Outside {
    pub code: i32,
    pub output: String,
}

pub trait Target {
    fn endpoint(&self) -> Endpoint;

    /// A host file holding the token (mode 0600), for clients that read one (the agent).
    fn token_file(&self) -> std::path::PathBuf;

    /// The agent's flags for this daemon: `--executor URL --token-file PATH`, and
    /// `--tls-fingerprint PIN` when it serves TLS.
    fn agent_args(&self) -> Vec<String> {
        let endpoint = self.endpoint();
        let mut args = vec![
            "--executor".to_string(),
            endpoint.url,
            "--token-file".to_string(),
            self.token_file().display().to_string(),
        ];
        if let Some(pin) = endpoint.fingerprint {
            args.extend(["--tls-fingerprint".to_string(), pin]);
        }
        args
    }

    /// Run `script` with `sh -c` as root on the target, outside any sandbox (the host's shell,
    /// the VM's side channel, `podman exec`).
    fn outside(&self, script: &str) -> Outside;

    /// Live processes as the target's root sees them.
    fn processes(&self) -> Vec<Process>;

    /// [`Target::outside`], failing the test unless `script` exits 0; returns its output.
    fn outside_ok(&self, script: &str) -> String {
        let out = self.outside(script);
        assert_eq!(
            out.code, 0,
            "outside the sandbox, `{script}` failed: {out:?}"
        );
        out.output
    }

    /// Live (not zombie) processes whose command line contains `needle`.
    fn matching(&self, needle: &str) -> Vec<Process> {
        self.processes()
            .into_iter()
            .filter(|p| p.state != 'Z' && p.cmdline.contains(needle))
            .collect()
    }

    /// Live `sleep` processes started by [`crate::marked_sleep`] with marker `m`.
    fn sleepers(&self, m: &str) -> Vec<Process> {
        let prefix = crate::marked_sleep(m);
        self.processes()
            .into_iter()
            .filter(|p| p.state != 'Z' && p.cmdline.starts_with(&prefix))
            .collect()
    }
}

/// Wait until exactly `n` marked sleeps of `m` run on the target; fails the test otherwise.
/// The control of every kill case: the escapees exist before the kill.
pub async fn wait_sleepers(target: &impl Target, m: &str, n: usize) -> Vec<Process> {
    let mut seen = Vec::new();
    let held = crate::eventually(PATIENCE, || {
        seen = target.sleepers(m);
        seen.len() == n
    })
    .await;
    assert!(
        held,
        "expected {n} sleeps marked {m} on the target, saw {seen:?}"
    );
    seen
}

/// Wait until no process with `m` in its command line is left on the target; fails the test
/// with the survivors otherwise.
pub async fn assert_none_left(target: &impl Target, m: &str, after: &str) {
    let mut left = Vec::new();
    let gone = crate::eventually(std::time::Duration::from_secs(10), || {
        left = target.matching(m);
        left.is_empty()
    })
    .await;
    assert!(gone, "survivors on the target after {after}: {left:?}");
}

/// Live processes of this host, from /proc.
pub fn host_processes() -> Vec<Process> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let Some(state) = crate::process_state(pid) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline)
            .trim_end_matches('\0')
            .replace('\0', " ");
        if pid != std::process::id() as i32 {
            out.push(Process {
                pid,
                state,
                cmdline,
            });
        }
    }
    out
}

/// Run `sh -c script` on this host.
pub fn host_shell(script: &str) -> Outside {
    let out = std::process::Command::new("sh")
        .args(["-c", &format!("exec 2>&1; {script}")])
        .output()
        .expect("sh runs");
    Outside {
        code: out.status.code().unwrap_or(-1),
        output: String::from_utf8_lossy(&out.stdout).into_owned(),
    }
}

impl Target for crate::Daemon {
    fn endpoint(&self) -> Endpoint {
        Endpoint {
            url: self.url.clone(),
            token: self.token.clone(),
            fingerprint: self.fingerprint.clone(),
        }
    }

    /// The token the daemon generated in its state directory.
    fn token_file(&self) -> std::path::PathBuf {
        self.state.path().join("token")
    }

    fn outside(&self, script: &str) -> Outside {
        host_shell(script)
    }

    fn processes(&self) -> Vec<Process> {
        host_processes()
    }
}

/// Parse `ps -o pid,stat,args` output (busybox's or procps').
pub fn parse_ps(text: &str) -> Vec<Process> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let pid = words.next()?.parse().ok()?;
            let state = words.next()?.chars().next()?;
            let cmdline = words.collect::<Vec<_>>().join(" ");
            Some(Process {
                pid,
                state,
                cmdline,
            })
        })
        .collect()
}

/// 64 hex characters from the host's random source.
pub fn fresh_token() -> String {
    let mut bytes = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes).unwrap();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Write a secret file readable by its owner only.
pub fn write_private(path: &std::path::Path, text: &str) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .unwrap();
    file.write_all(text.as_bytes()).unwrap();
}

/// A loopback port free right now (qemu binds it a moment later).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
