//! Shared vocabulary of the escape suite: profile names, the (profile, expectation) tables,
//! running a command under a named profile, and the host-side checks every case ends with.

use std::time::Duration;

use executor_tests::checks;
use executor_tests::{
    eventually, process_state, sleepers, Client, Daemon, DaemonOptions, PATIENCE,
};
use protocol::{ClientMessage, ExecRequest, ExecResult};

pub use crate::host_side::*;
pub use crate::table::*;

/// Interpreter for probes. Every profile's root holds /usr/bin/python3 (checked by the
/// `tools_exist_in_every_profile` case); the absolute path avoids pyenv shims on the host.
pub const PY: &str = "/usr/bin/python3";

/// Python prelude for syscall probes: `sc(nr, *args)` returns `(ret, errno)`.
pub const PY_PRELUDE: &str = r#"
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(nr, *args):
    conv = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *conv)
    return r, (ctypes.get_errno() if r == -1 else 0)
def sleeping_child():
    """A child that sleeps 5 s, and a pidfd for it."""
    import time
    child = os.fork()
    if child == 0:
        time.sleep(5)
        os._exit(0)
    pidfd, _ = sc(434, child, 0)   # pidfd_open
    return child, pidfd
"#;

/// `python3 - <<'PY' ... PY` around `body` (with the prelude), as one shell command.
pub fn python(body: &str) -> String {
    format!("{PY} - <<'PY_EOF'\n{PY_PRELUDE}\n{body}\nPY_EOF")
}

/// An exec request for `profile` with a bounded timeout.
pub fn preq(profile: &str, id: &str, command: &str, timeout: f64) -> ExecRequest {
    checks::preq(Some(profile), id, command, timeout)
}

/// Start `command` under `profile` with streaming on, and wait until its output contains
/// `ready`. Returns the request id and the output so far.
pub async fn start_until(
    client: &mut Client,
    profile: &str,
    id: &str,
    command: &str,
    ready: &str,
    timeout: f64,
) -> (String, String) {
    let id = format!("{profile}-{id}");
    let seen = checks::start_until(client, preq(profile, &id, command, timeout), ready).await;
    (id, seen)
}

/// Cancel a command started with [`start_until`] and return its result.
pub use executor_tests::checks::cancel;

/// The daemon survived the attack: its process lives, it answers /healthz, and a fresh
/// connection runs a follow-up command.
pub async fn assert_daemon_intact(daemon: &Daemon) {
    let pid = daemon.pid() as i32;
    assert!(
        matches!(process_state(pid), Some(s) if s != 'Z'),
        "the daemon (pid {pid}) is gone: {}",
        daemon.log()
    );
    assert!(
        daemon.healthy().await,
        "the daemon stopped answering /healthz"
    );
    let mut client = daemon.connect().await;
    let result = client
        .exec(preq(TRUSTED, "follow-up", "echo alive", 10.0))
        .await
        .result
        .unwrap_or_else(|e| panic!("follow-up command refused: {e:?}"));
    assert_eq!(result.output, "alive\n", "follow-up command: {result:?}");
}

/// Grace period for host-side checks after a command's result (what must happen: waited for,
/// returning as soon as it holds, so generous for a busy machine).
pub const SETTLE: Duration = executor_tests::PATIENCE;

/// Serializes the cases that load the machine (bombs, floods, fills) so they neither starve
/// each other on 2 cores nor share a per-uid process budget.
pub static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Host pids of live processes whose command line starts with `prefix`.
pub fn pids_with_prefix(prefix: &str) -> Vec<i32> {
    executor_tests::processes_matching(prefix)
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
                .is_ok_and(|c| c.starts_with(prefix))
        })
        .collect()
}

/// `python3 - <marker>` around `body`: the marker lands in the interpreter's argv so the host
/// can find the probe's own process with [`pids_with_prefix`]`(&py_argv(m))`.
pub fn python_marked(m: &str, body: &str) -> String {
    format!("{PY} - {m} <<'PY_EOF'\n{PY_PRELUDE}\n{body}\nPY_EOF")
}

pub fn py_argv(m: &str) -> String {
    format!("{PY} - {m}")
}

/// MemAvailable of the host in MiB.
pub fn mem_available_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(0)
        / 1024
}

/// A daemon whose workspace lies outside its state directory (in a directory of its own under
/// /var/tmp, removed with it). task-container covers the state directory; with the default
/// layout (workspace inside it) that cover also hides the workspace, which
/// `isolation::task_container_runs_in_the_default_layout` pins separately. Every other case
/// uses this layout so that it tests its own attack, not that one bug.
pub struct TestDaemon {
    pub daemon: Daemon,
    _workspace_root: executor_tests::TempDir,
}

impl std::ops::Deref for TestDaemon {
    type Target = Daemon;
    fn deref(&self) -> &Daemon {
        &self.daemon
    }
}

impl std::ops::DerefMut for TestDaemon {
    fn deref_mut(&mut self) -> &mut Daemon {
        &mut self.daemon
    }
}

/// Start a daemon for a case, or fail it (skip it only where skips are allowed, through
/// [`executor_tests::require`]) when this host cannot run what the suite tests: root for the
/// namespaced profiles, and every profile available (its layers work on this kernel).
pub fn daemon() -> Option<TestDaemon> {
    daemon_with(DaemonOptions::default())
}

/// [`daemon`] and a connection to it: the set-up of a case that runs its commands in turn.
pub async fn daemon_and_client() -> Option<(TestDaemon, Client)> {
    let daemon = daemon()?;
    let client = daemon.connect().await;
    Some((daemon, client))
}

pub fn daemon_with(mut opts: DaemonOptions) -> Option<TestDaemon> {
    use std::os::unix::fs::PermissionsExt;
    if !executor_tests::require(
        "root (strict and task-container need it)",
        executor_tests::is_root(),
    ) {
        return None;
    }
    let root = executor_tests::TempDir::with_prefix_in("escape-ws-", "/var/tmp").unwrap();
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let workspace = root.path().join("workspace");
    opts.extra
        .extend(["--workspace".to_string(), workspace.display().to_string()]);
    // The suite attacks every profile, trusted and task-container included, unless a case
    // names its own.
    if !opts.extra.iter().any(|a| a == "--allow-profile") {
        opts.extra
            .extend(executor_tests::ALLOW_ALL_PROFILES.map(String::from));
    }
    // A token file named by the case replaces the one in the state directory.
    let token_file = opts
        .extra
        .iter()
        .position(|a| a == "--token-file")
        .and_then(|i| opts.extra.get(i + 1))
        .cloned();
    let mut daemon = Daemon::start_opts(opts);
    daemon.workspace = workspace;
    if let Some(file) = token_file {
        daemon.token = std::fs::read_to_string(file).unwrap().trim().to_string();
    }
    for (name, reason) in unavailable_profiles(&daemon) {
        if !executor_tests::require(&format!("profile {name} on this host: {reason}"), false) {
            return None;
        }
    }
    Some(TestDaemon {
        daemon,
        _workspace_root: root,
    })
}

/// Profiles of the suite that `daemon`'s hello says this host cannot run, with the reason.
/// Read on a thread of its own: callers are inside a test's runtime and cannot block on it.
pub fn unavailable_profiles(daemon: &Daemon) -> Vec<(String, String)> {
    let (url, token) = (daemon.url.clone(), daemon.token.clone());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let client = Client::connect(&url, Some(&token)).await.unwrap();
            client
                .hello
                .profiles
                .iter()
                .filter(|p| ALL_PROFILES.contains(&p.name.as_str()))
                .filter(|p| !p.available)
                .map(|p| {
                    (
                        p.name.clone(),
                        p.unavailable_reason.clone().unwrap_or_default(),
                    )
                })
                .collect()
        })
    })
    .join()
    .unwrap()
}

/// Wait until exactly `n` marked sleeps of `m` run on the host (a fork is visible before its
/// exec), and return their pids.
pub async fn wait_sleepers(m: &str, n: usize) -> Vec<i32> {
    assert!(
        eventually(PATIENCE, || sleepers(m).len() == n).await,
        "expected {n} sleeps marked {m} on the host, saw {:?}",
        sleepers(m)
    );
    sleepers(m)
}

/// Like [`run_with_timeout`] but with streaming on, so a long command that keeps printing never
/// trips the harness's per-message patience; the whole wait is bounded by `timeout` + 15 s.
pub async fn run_streamed(
    client: &mut Client,
    profile: &str,
    id: &str,
    command: &str,
    timeout: f64,
) -> ExecResult {
    let id = format!("{profile}-{id}");
    let mut r = preq(profile, &id, command, timeout);
    r.stream = true;
    client.send(&ClientMessage::Exec(r)).await;
    let wait = Duration::from_secs_f64(timeout) + Duration::from_secs(15);
    checks::result_within(client, &id, wait).await
}

/// A case whose attack surface does not exist on this host (as opposed to a missing test
/// precondition, which is [`executor_tests::require`]'s business): say so and pass.
pub fn not_applicable(why: &str) {
    eprintln!("NOT APPLICABLE on this host: {why}");
}

/// Kills every host process whose command line holds the marker when dropped, so that a case
/// whose escapee really escaped does not leave it running on the shared machine.
pub struct Reaper(pub String);

impl Drop for Reaper {
    fn drop(&mut self) {
        for _ in 0..50 {
            let pids = executor_tests::processes_matching(&self.0);
            if pids.is_empty() {
                return;
            }
            for pid in pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A daemon serving `clients` (a clients file), its state outside /tmp.
pub fn clients_daemon(clients: &serde_json::Value, extra: &[&str]) -> Result<Daemon, String> {
    let (dir, path) = executor_tests::clients_file(clients);
    let mut args = vec!["--clients".to_string(), path.display().to_string()];
    args.extend(extra.iter().map(|a| a.to_string()));
    let started = Daemon::try_start_opts(DaemonOptions {
        extra: args,
        state_parent: Some("/var/tmp".into()),
        ..Default::default()
    });
    drop(dir);
    started
}

/// [`daemon`] with the profiles of `dir` (`--profiles-dir`), offering exactly `allow` and
/// `trusted` (the control of [`assert_daemon_intact`]).
pub fn profiles_daemon(dir: &std::path::Path, allow: &[&str]) -> Option<TestDaemon> {
    let mut extra = vec!["--profiles-dir".to_string(), dir.display().to_string()];
    for name in allow.iter().chain(&[TRUSTED]) {
        extra.extend(["--allow-profile".to_string(), name.to_string()]);
    }
    daemon_with(DaemonOptions {
        extra,
        ..Default::default()
    })
}

/// Start `{before}<marked sleep of m> & echo ready; wait` under `profile` and wait until the
/// host sees the sleep: returns the request id (for [`cancel`]) and the
/// sleep's host pid.
pub async fn start_sleeper(
    client: &mut Client,
    profile: &str,
    id: &str,
    m: &str,
    before: &str,
    timeout: f64,
) -> (String, i32) {
    let command = format!(
        "{before}{} & echo ready; wait",
        executor_tests::marked_sleep(m)
    );
    let (id, _) = start_until(client, profile, id, &command, "ready", timeout).await;
    (id, wait_sleepers(m, 1).await[0])
}
