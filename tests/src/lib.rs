//! Harness for the end-to-end tests: start the real `executor` binary, talk to it over
//! WebSocket, and inspect the host (processes, files) afterwards.
//!
//! Tests that need root, a kernel feature or a program call [`require`]: a missing one fails
//! the test, unless `EXECUTOR_TESTS_ALLOW_SKIPS=1` lets it skip (recorded, see [`skips`]);
//! `EXECUTOR_TESTS_STRICT=1` (set by `.ci/run`) forbids skips even then, so CI can never pass
//! by skipping.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::missing_panics_doc)]

pub mod checks;
pub mod container;
mod executable;
mod host;
pub mod lifeline;
mod pinned_tls;
pub mod profiles;
mod proxy;
pub mod rootfs;
pub mod scratch;
pub mod skips;
pub mod sshd;
pub mod static_build;
pub mod target;
pub mod test_internet;
mod transfer;
pub mod vm;

pub use executable::{copy_executable, write_executable};
pub use host::*;
pub use pinned_tls::{fingerprint_of_der, fingerprint_of_pem_file, https_get, pinned_config};
pub use proxy::Proxy;
pub use scratch::TempDir;
pub use static_build::static_executor;
pub use target::{Endpoint, Target};
pub use transfer::*;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use protocol::{ClientMessage, ExecRequest, ExecResult, Hello, OutputChunk, ServerMessage};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// `serve` flags that offer every built-in profile: `trusted` and `task-container` (which writes
/// the host's system files) are offered only when the operator names them.
pub const ALLOW_ALL_PROFILES: [&str; 8] = [
    "--allow-profile",
    "strict",
    "--allow-profile",
    "landlock",
    "--allow-profile",
    "task-container",
    "--allow-profile",
    "trusted",
];

/// How long any single wait in a test may take before the test fails: generous, because the
/// suites must pass on a busy machine (a load average of 10 on 2 cores), where starting a
/// sandbox can take seconds. Waiting this long only ever delays a failure.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// How late something that should happen at once (a result after a kill, an answer during a
/// flood) may be on such a busy machine. Below the daemon's default command timeout (30 s), so
/// that "at once" still differs from "at the timeout"; a bound past a command's own timeout is
/// that timeout plus this.
pub const PROMPTLY: Duration = Duration::from_secs(20);

/// Environment variable naming a directory that holds `executor` and `agent` to test instead
/// of the workspace's debug build: `.ci/run` points it at the static release binaries of
/// `.ci/build-static` (`target/static/`), so the e2e, escape and agent suites run against the build that ships.
pub const BINARIES_ENV: &str = "EXECUTOR_TESTS_BINARIES";

/// Path of a workspace binary, built once per test process so it is never stale; or, with
/// [`BINARIES_ENV`] set, the one in that directory (built by whoever set it, and not rebuilt
/// here).
pub fn binary(name: &str) -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    let dir = BUILT.get_or_init(|| {
        if let Some(dir) = std::env::var_os(BINARIES_ENV).filter(|d| !d.is_empty()) {
            let dir = PathBuf::from(dir);
            for bin in ["executor", "agent"] {
                assert!(
                    dir.join(bin).is_file(),
                    "{BINARIES_ENV}={}: no {bin} there",
                    dir.display()
                );
            }
            return dir;
        }
        // target/<profile>/deps/e2e-<hash> -> target/<profile>
        let exe = std::env::current_exe().unwrap();
        let dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut build = Command::new(cargo);
        static_build::without_package_env(&mut build);
        build.args([
            "build", "--quiet", "--bins", "-p", "executor", "-p", "agent",
        ]);
        if dir.file_name().is_some_and(|n| n == "release") {
            build.arg("--release");
        }
        let status = build.status().expect("cargo build runs");
        assert!(status.success(), "building the binaries failed");
        dir
    });
    dir.join(name)
}

/// Whether a precondition of the test (root, a kernel feature, a program) holds: `true` when
/// it does. When it does not, the test fails, unless [`skips::ALLOW_ENV`] allows skipping
/// (and [`skips::STRICT_ENV`] does not forbid it): then the skip is recorded for the test
/// command's summary and `false` tells the test to return. A test that cannot run is never
/// counted as passed without saying so.
pub fn require(what: &str, available: bool) -> bool {
    if available {
        return true;
    }
    skips::skip_or_fail(what);
    false
}

pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// A running `executor serve` on a free loopback port with its own state directory.
pub struct Daemon {
    pub child: Child,
    pub addr: SocketAddr,
    pub url: String,
    pub token: String,
    pub state: TempDir,
    pub workspace: PathBuf,
    /// With `--tls`: the certificate fingerprint from the ready line (`sha256:<hex>`).
    pub fingerprint: Option<String>,
    stderr_log: PathBuf,
}

/// The daemon's ready line, `executor listening on <url>[ tls-fingerprint sha256:<hex>]`, as
/// (url, address, fingerprint).
pub fn parse_ready_line(line: &str) -> Option<(String, SocketAddr, Option<String>)> {
    let rest = line.trim().strip_prefix("executor listening on ")?;
    let mut words = rest.split_whitespace();
    let url = words.next()?.to_string();
    let fingerprint = match (words.next(), words.next()) {
        (Some("tls-fingerprint"), Some(f)) => Some(f.to_string()),
        _ => None,
    };
    let addr = url
        .trim_start_matches("wss://")
        .trim_start_matches("ws://")
        .trim_end_matches(protocol::WS_PATH)
        .parse()
        .ok()?;
    Some((url, addr, fingerprint))
}

impl Daemon {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Start with extra `serve` flags.
    pub fn start_with(extra: &[&str]) -> Self {
        Self::spawn(None, extra)
    }

    /// Start as an unprivileged user (uid and gid `id`), through setpriv(1).
    pub fn start_as_user(id: u32, extra: &[&str]) -> Self {
        Self::spawn(Some(id), extra)
    }

    fn spawn(user: Option<u32>, extra: &[&str]) -> Self {
        let state = TempDir::with_prefix("executor-e2e-").unwrap();
        let workspace = state.path().join("workspace");
        let stderr_log = state.path().join("daemon.log");
        let mut command = match user {
            None => Command::new(binary("executor")),
            Some(id) => {
                let uid = Some(nix::unistd::Uid::from_raw(id));
                let gid = Some(nix::unistd::Gid::from_raw(id));
                nix::unistd::chown(state.path(), uid, gid).unwrap();
                let mut c = Command::new("setpriv");
                c.arg(format!("--reuid={id}"))
                    .arg(format!("--regid={id}"))
                    .arg("--clear-groups")
                    .arg(binary("executor"));
                c
            }
        };
        let mut child = command
            .arg("serve")
            .args(["--listen", "127.0.0.1:0", "--state-dir"])
            .arg(state.path())
            .args(extra)
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_log).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let (url, addr, fingerprint) = parse_ready_line(&line).unwrap_or_else(|| {
            panic!(
                "daemon did not start: {line:?}\n{}",
                std::fs::read_to_string(&stderr_log).unwrap_or_default()
            )
        });
        let token = std::fs::read_to_string(state.path().join("token"))
            .unwrap_or_default()
            .trim()
            .to_string();
        Self {
            child,
            addr,
            url,
            token,
            state,
            workspace,
            fingerprint,
            stderr_log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A client with the token (pinning the daemon's certificate when it serves TLS).
    pub async fn connect(&self) -> Client {
        match &self.fingerprint {
            Some(pin) => Client::connect_pinned(&self.url, Some(&self.token), pin)
                .await
                .unwrap(),
            None => Client::connect(&self.url, Some(&self.token)).await.unwrap(),
        }
    }

    /// The daemon's log so far (stderr).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }

    /// Audit log records so far.
    pub fn audit(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.state.path().join("audit.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Send a signal and wait for the daemon to exit, returning its exit status.
    pub fn signal_and_wait(
        &mut self,
        signal: nix::sys::signal::Signal,
    ) -> std::process::ExitStatus {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid() as i32), signal).unwrap();
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "daemon did not exit after {signal}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Whether the daemon answers `/healthz` (over TLS, pinned, when it serves TLS).
    pub async fn healthy(&self) -> bool {
        let response = match &self.fingerprint {
            Some(pin) => https_get(self.addr, "/healthz", pin).await,
            None => http_get(self.addr, "/healthz", None).await,
        };
        response.is_ok_and(|r| r.starts_with("HTTP/1.1 200"))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A raw HTTP/1.1 GET; returns the whole response text.
pub async fn http_get(addr: SocketAddr, path: &str, auth: Option<&str>) -> std::io::Result<String> {
    let auth: Vec<(&str, &str)> = auth.map(|a| ("Authorization", a)).into_iter().collect();
    http_get_with(addr, path, &auth).await
}

/// [`http_get`] with headers of the caller's (besides `Host` and `Connection`).
pub async fn http_get_with(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = TcpStream::connect(addr).await?;
    let headers: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Connection: close\r\n\r\n");
    stream.write_all(req.as_bytes()).await?;
    let mut out = Vec::new();
    tokio::time::timeout(PATIENCE, stream.read_to_end(&mut out))
        .await
        .map_err(|_| std::io::Error::other("timeout"))??;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// A protocol client.
pub struct Client {
    pub ws: Ws,
    pub hello: Hello,
}

/// Everything received for one command.
#[derive(Debug)]
pub struct Received {
    pub chunks: Vec<OutputChunk>,
    pub result: Result<ExecResult, protocol::ErrorMessage>,
}

impl Client {
    /// Connect with `Authorization: <auth>` (e.g. `Bearer x`), or none.
    pub async fn connect_raw(
        url: &str,
        auth: Option<&str>,
    ) -> Result<Ws, tokio_tungstenite::tungstenite::Error> {
        let mut req = url.into_client_request()?;
        if let Some(auth) = auth {
            req.headers_mut()
                .insert("Authorization", HeaderValue::from_str(auth).unwrap());
        }
        let (ws, _) = tokio_tungstenite::connect_async(req).await?;
        Ok(ws)
    }

    /// Connect over TLS with `Authorization: <auth>`, accepting only the certificate with
    /// fingerprint `pin`.
    pub async fn connect_raw_pinned(
        url: &str,
        auth: Option<&str>,
        pin: &str,
    ) -> Result<Ws, tokio_tungstenite::tungstenite::Error> {
        let mut req = url.into_client_request()?;
        if let Some(auth) = auth {
            req.headers_mut()
                .insert("Authorization", HeaderValue::from_str(auth).unwrap());
        }
        let connector = tokio_tungstenite::Connector::Rustls(pinned_config(pin));
        let (ws, _) =
            tokio_tungstenite::connect_async_tls_with_config(req, None, false, Some(connector))
                .await?;
        Ok(ws)
    }

    /// [`Client::connect`] over TLS, pinning the certificate's fingerprint.
    pub async fn connect_pinned(
        url: &str,
        token: Option<&str>,
        pin: &str,
    ) -> Result<Self, tokio_tungstenite::tungstenite::Error> {
        let auth = token.map(|t| format!("Bearer {t}"));
        let ws = Self::connect_raw_pinned(url, auth.as_deref(), pin).await?;
        Self::after_connect(ws).await
    }

    pub async fn connect(
        url: &str,
        token: Option<&str>,
    ) -> Result<Self, tokio_tungstenite::tungstenite::Error> {
        let auth = token.map(|t| format!("Bearer {t}"));
        let ws = Self::connect_raw(url, auth.as_deref()).await?;
        Self::after_connect(ws).await
    }

    /// Read the hello.
    async fn after_connect(ws: Ws) -> Result<Self, tokio_tungstenite::tungstenite::Error> {
        let mut client = Self {
            ws,
            hello: placeholder_hello(),
        };
        match client.recv().await {
            Some(ServerMessage::Hello(hello)) => client.hello = *hello,
            other => panic!("expected hello, got {other:?}"),
        }
        Ok(client)
    }

    pub async fn send(&mut self, msg: &ClientMessage) {
        self.send_text(&serde_json::to_string(msg).unwrap()).await;
    }

    pub async fn send_text(&mut self, text: &str) {
        self.ws.send(Message::text(text.to_string())).await.unwrap();
    }

    /// Next protocol message, or `None` when the connection closed. Fails the test after
    /// [`PATIENCE`].
    pub async fn recv(&mut self) -> Option<ServerMessage> {
        self.recv_within(PATIENCE)
            .await
            .expect("no message within the test's patience")
    }

    /// Next protocol message within `wait`: `Err` on timeout, `Ok(None)` on close.
    pub async fn recv_within(&mut self, wait: Duration) -> Result<Option<ServerMessage>, ()> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let frame = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .map_err(|_| ())?;
            match frame {
                Some(Ok(Message::Text(text))) => {
                    return Ok(Some(serde_json::from_str(text.as_str()).unwrap_or_else(
                        |e| panic!("server sent invalid JSON ({e}): {text}"),
                    )))
                }
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return Ok(None),
                Some(Ok(_)) => continue,
            }
        }
    }

    /// Send `req` and collect its output chunks and its result or error.
    pub async fn exec(&mut self, req: ExecRequest) -> Received {
        let id = req.id.clone();
        self.send(&ClientMessage::Exec(req)).await;
        self.collect(&id).await
    }

    /// Collect messages for `id` until its result or error.
    pub async fn collect(&mut self, id: &str) -> Received {
        let mut chunks = Vec::new();
        loop {
            match self.recv().await {
                Some(ServerMessage::Output(chunk)) if chunk.id == id => chunks.push(chunk),
                Some(ServerMessage::Result(result)) if result.id == id => {
                    return Received {
                        chunks,
                        result: Ok(result),
                    }
                }
                Some(ServerMessage::Error(err)) if err.id.as_deref() == Some(id) => {
                    return Received {
                        chunks,
                        result: Err(err),
                    }
                }
                Some(_) => continue,
                None => panic!("connection closed before the result of {id}"),
            }
        }
    }

    /// Run `command` and return its result, failing the test on a protocol error.
    pub async fn run(&mut self, id: &str, command: &str) -> ExecResult {
        self.run_req(req(id, command)).await
    }

    /// Run a request and return its result, failing the test on a protocol error.
    pub async fn run_req(&mut self, r: ExecRequest) -> ExecResult {
        let id = r.id.clone();
        self.exec(r)
            .await
            .result
            .unwrap_or_else(|e| panic!("{id}: {e:?}"))
    }
}

/// An exec request with defaults.
pub fn req(id: &str, command: &str) -> ExecRequest {
    ExecRequest {
        id: id.to_string(),
        command: command.to_string(),
        cwd: None,
        env: BTreeMap::new(),
        timeout: None,
        profile: None,
        stream: false,
    }
}

fn placeholder_hello() -> Hello {
    Hello::default()
}

/// Poll `cond` until it holds or `wait` passes; returns whether it held.
pub async fn eventually(wait: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + wait;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers added for the escape suite (tests/tests/escape). Appended only: nothing above changes.
// ---------------------------------------------------------------------------------------------

/// Runs on the state directory before the daemon starts.
pub type PrepareStateDir = Box<dyn FnOnce(&std::path::Path)>;

/// How to start a daemon when [`Daemon::start_with`] is not enough: a state directory prepared
/// before the daemon sees it (pre-planted symlinks), a state directory outside /tmp, extra
/// environment (a secret to look for), or a terminal as the daemon's controlling terminal.
#[derive(Default)]
pub struct DaemonOptions {
    /// Extra `serve` flags.
    pub extra: Vec<String>,
    /// Directory in which the state directory is created (default: the system temp dir).
    pub state_parent: Option<PathBuf>,
    /// Called with the (empty) state directory before the daemon starts.
    pub prepare: Option<PrepareStateDir>,
    /// Extra environment variables of the daemon process.
    pub env: Vec<(String, String)>,
    /// A terminal (a pty slave) made the daemon's stdin and controlling terminal, through
    /// `setsid --ctty` (the daemon is then a session leader with that terminal).
    pub terminal: Option<std::os::fd::OwnedFd>,
    /// Run the daemon as this uid and gid (through setpriv(1)); the state directory is handed
    /// to it first.
    pub user: Option<u32>,
    /// Run this copy of the executor binary instead of the built one.
    pub binary: Option<PathBuf>,
    /// `--listen` address (default: `127.0.0.1:0`).
    pub listen: Option<String>,
}

impl Daemon {
    /// Start with [`DaemonOptions`]; `Err` carries the daemon's log when it refused to start.
    pub fn try_start_opts(opts: DaemonOptions) -> Result<Self, String> {
        let state = match &opts.state_parent {
            Some(parent) => {
                std::fs::create_dir_all(parent).unwrap();
                TempDir::with_prefix_in("executor-escape-", parent).unwrap()
            }
            None => TempDir::with_prefix("executor-escape-").unwrap(),
        };
        if let Some(prepare) = opts.prepare {
            prepare(state.path());
        }
        let workspace = state.path().join("workspace");
        let stderr_log = state.path().join("daemon.log");
        let exe = opts.binary.clone().unwrap_or_else(|| binary("executor"));
        let mut command = match (&opts.terminal, opts.user) {
            (None, None) => Command::new(&exe),
            (Some(_), None) => {
                let mut c = Command::new("setsid");
                c.arg("--ctty").arg(&exe);
                c
            }
            (None, Some(id)) => {
                let uid = Some(nix::unistd::Uid::from_raw(id));
                let gid = Some(nix::unistd::Gid::from_raw(id));
                nix::unistd::chown(state.path(), uid, gid).unwrap();
                let mut c = Command::new("setpriv");
                c.arg(format!("--reuid={id}"))
                    .arg(format!("--regid={id}"))
                    .arg("--clear-groups")
                    .arg(&exe);
                c
            }
            (Some(_), Some(_)) => panic!("DaemonOptions: terminal and user together"),
        };
        command
            .arg("serve")
            .arg("--listen")
            .arg(opts.listen.as_deref().unwrap_or("127.0.0.1:0"))
            .arg("--state-dir")
            .arg(state.path())
            .args(&opts.extra)
            .env("RUST_LOG", "debug")
            .envs(opts.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_log).unwrap());
        match opts.terminal {
            Some(tty) => command.stdin(Stdio::from(tty)),
            None => command.stdin(Stdio::null()),
        };
        let mut child = command.spawn().unwrap();
        let mut line = String::new();
        let _ = BufReader::new(child.stdout.take().unwrap()).read_line(&mut line);
        let Some((url, addr, fingerprint)) = parse_ready_line(&line) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::fs::read_to_string(&stderr_log).unwrap_or_default());
        };
        let token = std::fs::read_to_string(state.path().join("token"))
            .unwrap_or_default()
            .trim()
            .to_string();
        Ok(Self {
            child,
            addr,
            url,
            token,
            state,
            workspace,
            fingerprint,
            stderr_log,
        })
    }

    /// Start with [`DaemonOptions`], failing the test if the daemon does not come up.
    pub fn start_opts(opts: DaemonOptions) -> Self {
        Self::try_start_opts(opts).unwrap_or_else(|log| panic!("daemon did not start:\n{log}"))
    }
}

// ---------------------------------------------------------------------------------------------
// Clients files and scratch filesystems for the suites.
// ---------------------------------------------------------------------------------------------

/// Write `json` as a private clients file (mode 0600) in a directory of its own.
pub fn clients_file(json: &serde_json::Value) -> (TempDir, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("clients.json");
    std::fs::write(&path, serde_json::to_string_pretty(json).unwrap()).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    (dir, path)
}

/// A tmpfs mounted on a directory of its own (needs root), unmounted when dropped: for state
/// directories whose trees a case makes huge (the test machines' disks discard on every
/// removal, at milliseconds a directory).
pub struct Tmpfs {
    pub dir: TempDir,
}

impl Tmpfs {
    pub fn mount() -> Self {
        let dir = TempDir::with_prefix_in("executor-tmpfs-", "/var/tmp").unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "mode=0755,size=1g", "tmpfs"])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(status.success(), "mount tmpfs on {}", dir.path().display());
        Self { dir }
    }

    pub fn path(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// Merge `layer` into `base`: objects key by key, anything else replaced.
pub fn merge_json(base: &mut serde_json::Value, layer: serde_json::Value) {
    match (base, layer) {
        (serde_json::Value::Object(base), serde_json::Value::Object(layer)) => {
            for (key, value) in layer {
                match base.get_mut(&key) {
                    Some(slot) => merge_json(slot, value),
                    None => {
                        base.insert(key, value);
                    }
                }
            }
        }
        (slot, value) => *slot = value,
    }
}
