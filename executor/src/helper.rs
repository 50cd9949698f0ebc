//! The sandbox helper: the executor binary re-run as `executor __sandbox-helper`, once per command.
//!
//! The daemon is a multi-threaded tokio process, where forking and changing process-wide state
//! (session, subreaper, cgroups, namespaces, credentials) is unsafe or impossible. So the daemon
//! spawns this helper, a fresh single-threaded process, before any runtime exists in it. Its
//! descriptors:
//!
//! - fd 0: the plan, one JSON line, then kept open as the lifeline. The daemon never writes to it
//!   again; when the daemon closes it (timeout, cancel, disconnect, shutdown) or dies (even by
//!   SIGKILL, the kernel closes it), the helper sees end-of-file and kills the command's tree.
//! - fd 1: the output pipe, handed to the payload as its stdout and stderr.
//! - fd 2: the status pipe: one [`HelperReport`] JSON line at the end.
//!
//! The process tree of a command:
//!
//! ```text
//! helper (host pid namespace; session leader, subreaper)
//!   `- init (pid 1 of a new pid namespace; builds the root)   only with a pid namespace
//!        `- payload: bash -c COMMAND (confined, then exec)
//! ```
//!
//! The whole setup order is in [`run_plan`] (helper), [`init_main`] and [`payload_main`].

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::{BufRead, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sched::CloneFlags;
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use crate::cgroup;
use crate::plan::{HelperReport, Plan};
use crate::profile::Namespace;
use crate::sandbox::{self, SandboxError};
use crate::sys::{self, Forked};

/// argv[1] that selects helper mode. Checked in `main` before anything else runs.
pub const HELPER_ARG: &str = "__sandbox-helper";

/// Longest plan line the helper accepts; the daemon's request limits keep plans far below it.
const MAX_PLAN_BYTES: usize = 4 << 20;
/// How long the final sweep may take before the helper gives up and reports what it killed.
const SWEEP_DEADLINE: Duration = Duration::from_secs(5);
/// Exit code of a child whose setup failed (its reason is on the setup pipe).
const SETUP_FAILED: i32 = 127;

/// A setup step that failed, named so the daemon can say which layer broke.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("cannot read the plan from the daemon: {0}")]
    ReadPlan(#[source] std::io::Error),
    #[error("the plan is not valid: {0}")]
    ParsePlan(#[source] serde_json::Error),
    #[error("{0}")]
    Process(#[source] std::io::Error),
    #[error("cannot start a new session: {0}")]
    Session(#[source] Errno),
    #[error("cannot become a child subreaper: {0}")]
    Subreaper(#[source] Errno),
    #[error("cannot set up signal handling: {0}")]
    Signals(#[source] Errno),
    #[error("cgroup: {0}")]
    Cgroup(#[source] cgroup::CgroupError),
    #[error("cannot create a pid namespace: {0}")]
    PidNamespace(#[source] Errno),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error("cannot enter working directory {dir}: {errno}")]
    Cwd { dir: String, errno: Errno },
    #[error("cannot start {program}: {source}")]
    Exec {
        program: String,
        #[source]
        source: Errno,
    },
    #[error("cannot wire the output pipe: {0}")]
    OutputPipe(#[source] std::io::Error),
    /// A child reported a failure on the setup pipe.
    #[error("{message}")]
    Child { stage: String, message: String },
}

impl SetupError {
    /// Short name of the stage, carried in the report and in the daemon's error message.
    pub fn stage(&self) -> String {
        match self {
            Self::ReadPlan(_) | Self::ParsePlan(_) => "plan".into(),
            Self::Process(_) => "process".into(),
            Self::Session(_) => "session".into(),
            Self::Subreaper(_) => "subreaper".into(),
            Self::Signals(_) => "signals".into(),
            Self::Cgroup(_) => "cgroup".into(),
            Self::PidNamespace(_) => "pid_ns".into(),
            Self::Sandbox(err) => err.layer().into(),
            Self::Cwd { .. } => "cwd".into(),
            Self::Exec { .. } => "exec".into(),
            Self::OutputPipe(_) => "output".into(),
            Self::Child { stage, .. } => stage.clone(),
        }
    }
}

/// What a child writes on the setup pipe when its setup fails.
#[derive(Serialize, Deserialize)]
struct ChildFailure {
    stage: String,
    message: String,
}

/// What init writes on the status pipe when the payload has exited.
#[derive(Serialize, Deserialize)]
struct InitStatus {
    code: Option<i32>,
    signal: Option<i32>,
    leftover: u32,
}

/// Entry point of helper mode. Always exits 0: the outcome travels in the report.
pub fn main() -> ExitCode {
    let report = match read_plan().and_then(|plan| run_plan(&plan)) {
        Ok(report) => report,
        Err(err) => HelperReport::SetupFailed {
            stage: err.stage(),
            message: err.to_string(),
        },
    };
    // If the daemon is gone there is nobody to tell; the tree is dead either way.
    if let Ok(line) = serde_json::to_string(&report) {
        let _ = writeln!(std::io::stderr(), "{line}");
    }
    ExitCode::SUCCESS
}

fn read_plan() -> Result<Plan, SetupError> {
    let mut line = Vec::new();
    std::io::stdin()
        .lock()
        .take(MAX_PLAN_BYTES as u64)
        .read_until(b'\n', &mut line)
        .map_err(SetupError::ReadPlan)?;
    serde_json::from_slice(&line).map_err(SetupError::ParsePlan)
}

/// The helper's part: prepare the process, start the command, wait, clean up. The order
/// matters; each step says why.
fn run_plan(plan: &Plan) -> Result<HelperReport, SetupError> {
    // 1. Forking and credential changes below assume one thread: check, do not hope.
    sys::assert_single_threaded().map_err(SetupError::Process)?;

    // 2. Nothing the daemon held may reach the command: every fd above stderr closes on exec.
    sys::cloexec_fds_above_stderr().map_err(SetupError::Process)?;

    // 3. A new session: the command has no controlling terminal (so no TIOCSTI injection into
    //    the daemon's terminal) and a process group apart from the daemon's.
    nix::unistd::setsid().map_err(SetupError::Session)?;

    // 4. Child subreaper: when the shell's children double-fork or call setsid, their orphans
    //    are reparented to us instead of init, so the final sweep can find and kill them.
    nix::sys::prctl::set_child_subreaper(true).map_err(SetupError::Subreaper)?;

    // 5. SIGCHLD arrives on a signalfd, so one poll waits for "child exited" and "daemon
    //    closed the lifeline" together, without signal handlers. Children reset their mask.
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGCHLD);
    mask.thread_block().map_err(SetupError::Signals)?;
    let sigchld = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(SetupError::Signals)?;

    // 6. Cgroups: create the command's and set its limits, so that everything we fork is born
    //    inside (and cgroup.kill later takes all of it at once). The cgroup2 directory is
    //    entered by the child at its birth (clone3 CLONE_INTO_CGROUP, no attach for us to
    //    make and undo); v1 hierarchies, or a kernel before 5.7, need us to join first.
    // 7. A pid namespace applies to the children of the process that creates it: our next
    //    child becomes its init, pid 1, whose death kills everything in it.
    let pid_ns = plan.sandbox.namespaces.contains(&Namespace::Pid);
    let mut placed = Placed::default();
    if let Err(err) = enter_cgroups(plan, &mut placed).and_then(|()| {
        if pid_ns {
            nix::sched::unshare(CloneFlags::CLONE_NEWPID).map_err(SetupError::PidNamespace)?;
        }
        Ok(())
    }) {
        // Leave nothing behind for a command that never ran.
        let _ = leave_cgroups(&placed);
        remove_cgroups(plan);
        return Err(err);
    }

    // 8. Fork the child: init (which builds the sandbox and forks the payload) or the payload
    //    itself. Failures come back on the setup pipe; its end-of-file means exec happened.
    let pipe = || nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| SetupError::Process(e.into()));
    let prepared = pipe().and_then(|setup| Ok((setup, pipe()?)));
    let forked = prepared.and_then(|pipes| Ok((pipes, fork_placed(plan, &mut placed)?)));
    let (((setup_r, setup_w), (status_r, status_w)), forked) = match forked {
        Ok(done) => done,
        Err(err) => {
            let _ = leave_cgroups(&placed);
            remove_cgroups(plan);
            return Err(err);
        }
    };
    let child = match forked {
        Forked::Child => {
            // The cgroup directory stays the helper's: nothing in the sandbox may hold it.
            drop(placed);
            drop((setup_r, status_r));
            if pid_ns {
                init_main(plan, setup_w, status_w);
            }
            drop(status_w);
            // Only returns on failure: exec replaces us otherwise.
            let err = payload_main(plan);
            report_child_failure(&setup_w, &err);
            sys::exit_child(SETUP_FAILED);
        }
        Forked::Parent(child) => child,
    };
    drop((setup_w, status_w));

    // 9. Back out of the cgroups we joined, so that killing them never kills us.
    let left = leave_cgroups(&placed);

    // 10. Wait for the child's setup to finish or fail (no step waits on anything outside the
    //     machine, so this is short; the lifeline is watched again from step 12).
    let setup = wait_setup(&setup_r);
    left?;
    if let Err(err) = setup {
        // The child reported a failure and exits; reap it and anything it started.
        let mut status = None;
        sweep(plan, child, &mut status);
        remove_cgroups(plan);
        return Err(err);
    }

    // 11. Drop our copy of the output pipe: the daemon sees end-of-file exactly when the last
    //     process of the command's tree is gone.
    drop_output_pipe()?;

    // 12. Wait for the payload (or init) to exit, or for the daemon to close the lifeline.
    let (mut status, stopped) = wait_for_end(child, &sigchld);
    // How many processes the command has now, before the kill: from its cgroup, or else (no
    // writable cgroups, an unprivileged container) with a pid namespace, init and every
    // process below it (orphans in a pid namespace are reparented to its init).
    let in_cgroup = plan
        .cgroups
        .iter()
        .find(|c| c.kill)
        .map(|c| cgroup::procs(&c.dir).len() as u32)
        .or_else(|| pid_ns.then(|| descendants(child) + 1));

    // 13. Kill whatever the command left behind, note the limits it hit, remove its cgroups.
    let swept = sweep(plan, child, &mut status);
    let limits_hit = limits_hit(plan);
    remove_cgroups(plan);

    let (code, signal, killed) = if pid_ns && !stopped {
        // Init reported the payload's status and how many processes it left behind.
        let mut text = String::new();
        let _ = std::fs::File::from(status_r).read_to_string(&mut text);
        match serde_json::from_str::<InitStatus>(&text) {
            Ok(s) => (s.code, s.signal, s.leftover),
            Err(_) => (None, Some(Signal::SIGKILL as i32), swept),
        }
    } else {
        let (code, signal) = decode(status);
        // With a pid namespace, init itself is not one of the command's processes.
        let killed = in_cgroup.unwrap_or(swept).saturating_sub(u32::from(pid_ns));
        (code, signal, killed)
    };
    Ok(HelperReport::Finished {
        code,
        signal,
        killed,
        stopped,
        layers: plan.layers.clone(),
        limits_hit,
    })
}

/// pid 1 of the sandbox: build the world, fork the payload, reap until it exits, report.
fn init_main(plan: &Plan, setup_w: OwnedFd, status_w: OwnedFd) -> ! {
    let fail = |err: SetupError| -> ! {
        report_child_failure(&setup_w, &err);
        sys::exit_child(SETUP_FAILED)
    };
    // If the helper dies, init dies, and the kernel kills the whole pid namespace with it.
    if let Err(err) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
        fail(SetupError::Process(err.into()));
    }
    // The remaining namespaces, the new root, hostname, loopback.
    if let Err(err) = sandbox::enter_namespaces(&plan.sandbox) {
        fail(err.into());
    }
    let payload = match sys::fork() {
        Ok(Forked::Child) => {
            let err = payload_main(plan);
            report_child_failure(&setup_w, &err);
            sys::exit_child(SETUP_FAILED);
        }
        Ok(Forked::Parent(pid)) => pid,
        Err(err) => fail(SetupError::Process(err)),
    };
    // The payload holds the setup pipe until its exec, and the helper reads it to its end:
    // we must not keep it open, nor the output pipe, the lifeline or the helper's status pipe.
    drop(setup_w);
    if let Ok(devnull) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        let _ = nix::unistd::dup2_stdin(&devnull);
        let _ = nix::unistd::dup2_stdout(&devnull);
        let _ = nix::unistd::dup2_stderr(&devnull);
    }
    // Reap every process of the namespace (orphans are reparented to us) until the payload
    // exits; then report, and exit: the kernel kills whatever is left.
    loop {
        match waitpid(Pid::from_raw(-1), None) {
            Ok(status) if status.pid() == Some(payload) => {
                let (code, signal) = decode(Some(status));
                let leftover = count_processes().saturating_sub(1);
                let report = InitStatus {
                    code,
                    signal,
                    leftover,
                };
                if let Ok(text) = serde_json::to_vec(&report) {
                    let _ = nix::unistd::write(&status_w, &text);
                }
                sys::exit_child(0);
            }
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(_) => sys::exit_child(0),
        }
    }
}

/// Processes in our pid namespace (init included), from our /proc.
fn count_processes() -> u32 {
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.flatten()
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| n.parse::<u32>().is_ok())
                })
                .count() as u32
        })
        .unwrap_or(0)
}

/// The payload: wire stdio, enter the working directory, confine, exec. Returns only on
/// failure.
fn payload_main(plan: &Plan) -> SetupError {
    if let Err(err) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
        return SetupError::Process(err.into());
    }
    if let Err(err) = sys::reset_signals() {
        return SetupError::Process(err);
    }
    // stdin from /dev/null (never the daemon's lifeline), stderr joins stdout on the output
    // pipe so their order is kept.
    let wired = std::fs::File::open("/dev/null")
        .map_err(SetupError::OutputPipe)
        .and_then(|devnull| {
            nix::unistd::dup2_stdin(&devnull).map_err(|e| SetupError::OutputPipe(e.into()))?;
            nix::unistd::dup2_stderr(std::io::stdout().as_fd())
                .map_err(|e| SetupError::OutputPipe(e.into()))
        });
    if let Err(err) = wired {
        return err;
    }
    if let Err(err) = sandbox::confine_process(&plan.sandbox) {
        return err.into();
    }
    // Entered as the command, after its confinement: a directory it may not reach fails here
    // as it would for its own `cd`, and tells it no more than `cd` would.
    if let Err(errno) = nix::unistd::chdir(&plan.cwd) {
        return SetupError::Cwd {
            dir: plan.cwd.display().to_string(),
            errno,
        };
    }
    exec(&plan.argv, &plan.env)
}

/// execve the payload, looking the program up in the plan's PATH (not ours: ours is empty).
fn exec(argv: &[String], env: &BTreeMap<String, String>) -> SetupError {
    let Some(program) = argv.first() else {
        return SetupError::Exec {
            program: String::new(),
            source: Errno::EINVAL,
        };
    };
    let exec_err = |source| SetupError::Exec {
        program: program.clone(),
        source,
    };
    let path = resolve(
        program,
        env.get("PATH")
            .map(String::as_str)
            .unwrap_or("/usr/bin:/bin"),
    );
    let to_c = |s: &str| CString::new(s).map_err(|_| exec_err(Errno::EINVAL));
    let path = match to_c(&path.to_string_lossy()) {
        Ok(p) => p,
        Err(e) => return e,
    };
    let args: Result<Vec<CString>, _> = argv.iter().map(|a| to_c(a)).collect();
    let vars: Result<Vec<CString>, _> =
        env.iter().map(|(k, v)| to_c(&format!("{k}={v}"))).collect();
    match (args, vars) {
        (Ok(args), Ok(vars)) => match nix::unistd::execve(&path, &args, &vars) {
            Err(errno) => exec_err(errno),
            Ok(never) => match never {},
        },
        (Err(e), _) | (_, Err(e)) => e,
    }
}

/// The first executable `program` in `search_path`, as execvp(3) would find it.
fn resolve(program: &str, search_path: &str) -> PathBuf {
    if program.contains('/') {
        return PathBuf::from(program);
    }
    search_path
        .split(':')
        .filter(|dir| !dir.is_empty())
        .map(|dir| Path::new(dir).join(program))
        .find(|candidate| {
            std::fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .unwrap_or_else(|| PathBuf::from(program))
}

fn report_child_failure(setup_w: &OwnedFd, err: &SetupError) {
    let failure = ChildFailure {
        stage: err.stage(),
        message: err.to_string(),
    };
    if let Ok(text) = serde_json::to_vec(&failure) {
        // One short write into an empty pipe: it cannot block or be split.
        let _ = nix::unistd::write(setup_w, &text);
    }
}

/// Read the setup pipe to its end: empty means the payload exec'd; anything else is a child's
/// failure. No setup step waits on anything outside the machine, so this is short.
fn wait_setup(setup_r: &OwnedFd) -> Result<(), SetupError> {
    let mut file = std::fs::File::from(setup_r.try_clone().map_err(SetupError::Process)?);
    let mut text = Vec::new();
    let _ = (&mut file).take(64 * 1024).read_to_end(&mut text);
    if text.is_empty() {
        return Ok(());
    }
    match serde_json::from_slice::<ChildFailure>(&text) {
        Ok(f) => Err(SetupError::Child {
            stage: f.stage,
            message: f.message,
        }),
        Err(_) => Err(SetupError::Child {
            stage: "process".into(),
            message: String::from_utf8_lossy(&text).into_owned(),
        }),
    }
}

/// Where the helper stands before forking the command's first process.
#[derive(Default)]
struct Placed {
    /// The command's cgroup2 directory, open for clone3 to start the child inside.
    into: Option<OwnedFd>,
    /// Cgroups we had to go back from after the fork (their `home`): those joined.
    joined: Vec<PathBuf>,
}

fn enter_cgroups(plan: &Plan, placed: &mut Placed) -> Result<(), SetupError> {
    for cg in &plan.cgroups {
        cgroup::create(&cg.dir).map_err(SetupError::Cgroup)?;
        for (file, value) in &cg.settings {
            cgroup::set(&cg.dir, file, value).map_err(SetupError::Cgroup)?;
        }
        if cg.kill {
            let dir = nix::fcntl::open(
                &cg.dir,
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
                nix::sys::stat::Mode::empty(),
            );
            if let Ok(dir) = dir {
                placed.into = Some(dir);
                continue;
            }
        }
        cgroup::join(&cg.dir).map_err(SetupError::Cgroup)?;
        placed.joined.push(cg.home.clone());
    }
    Ok(())
}

/// Fork the command's first process: born in the cgroup2 directory where the kernel can,
/// otherwise after joining it.
fn fork_placed(plan: &Plan, placed: &mut Placed) -> Result<Forked, SetupError> {
    if let Some(dir) = &placed.into {
        match sys::fork_into_cgroup(dir.as_fd()) {
            Ok(forked) => return Ok(forked),
            // No clone3, or no CLONE_INTO_CGROUP (before Linux 5.7).
            Err(err)
                if matches!(
                    err.raw_os_error(),
                    Some(libc::ENOSYS | libc::EINVAL | libc::E2BIG | libc::EOPNOTSUPP)
                ) =>
            {
                placed.into = None;
                if let Some(cg) = plan.cgroups.iter().find(|c| c.kill) {
                    cgroup::join(&cg.dir).map_err(SetupError::Cgroup)?;
                    placed.joined.push(cg.home.clone());
                }
            }
            Err(err) => return Err(SetupError::Process(err)),
        }
    }
    sys::fork().map_err(SetupError::Process)
}

fn leave_cgroups(placed: &Placed) -> Result<(), SetupError> {
    for home in &placed.joined {
        cgroup::join(home).map_err(SetupError::Cgroup)?;
    }
    Ok(())
}

fn remove_cgroups(plan: &Plan) {
    for cg in &plan.cgroups {
        cgroup::remove(&cg.dir);
    }
}

/// Limits the command ran into, read from its cgroups before they are removed.
fn limits_hit(plan: &Plan) -> Vec<String> {
    let mut hit = Vec::new();
    let mut note = |limit: &str| {
        if !hit.iter().any(|h| h == limit) {
            hit.push(limit.to_string());
        }
    };
    for cg in &plan.cgroups {
        for (file, _) in &cg.settings {
            let dir = &cg.dir;
            match file.as_str() {
                // v1 and v2 alike: forks refused at the limit.
                "pids.max" if cgroup::counter(dir, "pids.events", "max") > 0 => note("processes"),
                // v2: the limit was reached (and reclaim ran), or the OOM killer acted.
                "memory.max"
                    if cgroup::counter(dir, "memory.events", "max") > 0
                        || cgroup::counter(dir, "memory.events", "oom_kill") > 0 =>
                {
                    note("memory")
                }
                "memory.limit_in_bytes"
                    if cgroup::counter(dir, "memory.oom_control", "oom_kill") > 0
                        || cgroup::get(dir, "memory.failcnt")
                            .parse::<u64>()
                            .unwrap_or(0)
                            > 0 =>
                {
                    note("memory")
                }
                _ => {}
            }
        }
    }
    hit
}

fn decode(status: Option<WaitStatus>) -> (Option<i32>, Option<i32>) {
    match status {
        Some(WaitStatus::Exited(_, code)) => (Some(code), None),
        Some(WaitStatus::Signaled(_, sig, _)) => (None, Some(sig as i32)),
        _ => (None, Some(Signal::SIGKILL as i32)),
    }
}

fn drop_output_pipe() -> Result<(), SetupError> {
    let devnull = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .map_err(SetupError::OutputPipe)?;
    nix::unistd::dup2_stdout(&devnull).map_err(|e| SetupError::OutputPipe(e.into()))
}

/// Block until the child exits or the lifeline closes. Returns the child's status if it
/// exited, and whether the daemon asked for the stop.
fn wait_for_end(child: Pid, sigchld: &SignalFd) -> (Option<WaitStatus>, bool) {
    let stdin = std::io::stdin();
    loop {
        if let Some(status) = reap_ready(child) {
            return (Some(status), false);
        }
        let mut fds = [
            PollFd::new(sigchld.as_fd(), PollFlags::POLLIN),
            PollFd::new(stdin.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(Errno::EINTR) => continue,
            // Cannot wait any more: treat it as a stop so the tree is still killed.
            Err(_) => return (None, true),
        }
        if !fds[1].revents().unwrap_or(PollFlags::empty()).is_empty() {
            return (None, true);
        }
        while let Ok(Some(_)) = sigchld.read_signal() {}
    }
}

/// Reap all exited children without blocking; return the given child's status if it was among
/// them.
fn reap_ready(child: Pid) -> Option<WaitStatus> {
    let mut found = None;
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => return found,
            Ok(status) => {
                if status.pid() == Some(child) {
                    found = Some(status);
                }
            }
        }
    }
}

/// Kill every remaining process of the command and reap it; returns how many were killed.
///
/// We are a subreaper, so every live descendant either is our child or has a live ancestor that
/// is: "no children left" means "no descendants left". cgroup.kill takes the whole cgroup at
/// once (stopped and signal-ignoring tasks included); the child sweep covers hosts without it.
fn sweep(plan: &Plan, child: Pid, status: &mut Option<WaitStatus>) -> u32 {
    let deadline = Instant::now() + SWEEP_DEADLINE;
    let mut killed = std::collections::HashSet::new();
    loop {
        for cg in plan.cgroups.iter().filter(|c| c.kill) {
            killed.extend(cgroup::procs(&cg.dir));
            cgroup::kill(&cg.dir);
        }
        for pid in children() {
            // ESRCH means it is already gone: that is success.
            if kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok() {
                killed.insert(pid);
            }
        }
        // Block for one child to change state (they are all dying), then reap the rest.
        match waitpid(Pid::from_raw(-1), None) {
            Err(Errno::ECHILD) => break,
            Err(_) => {}
            Ok(st) => {
                if st.pid() == Some(child) && status.is_none() {
                    *status = Some(st);
                }
            }
        }
        if let Some(st) = reap_ready(child) {
            if status.is_none() {
                *status = Some(st);
            }
        }
        if Instant::now() > deadline {
            break;
        }
    }
    u32::try_from(killed.len()).unwrap_or(u32::MAX)
}

/// Our direct children, from /proc/thread-self/children (one thread, so thread = process),
/// falling back to a scan of /proc where the kernel lacks CONFIG_PROC_CHILDREN.
fn children() -> Vec<i32> {
    if let Ok(text) = std::fs::read_to_string("/proc/thread-self/children") {
        return text
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
    }
    let me = std::process::id() as i32;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| parent_of(*pid) == Some(me))
        .collect()
}

/// How many processes descend from `pid`, from the kernel's children lists
/// (/proc/<pid>/task/<tid>/children), walked without recursion and bounded.
fn descendants(pid: Pid) -> u32 {
    let mut pending = vec![pid.as_raw()];
    let mut count = 0u32;
    while let Some(pid) = pending.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let Ok(text) = std::fs::read_to_string(task.path().join("children")) else {
                continue;
            };
            for child in text.split_whitespace().filter_map(|p| p.parse().ok()) {
                count += 1;
                if count > 1 << 20 {
                    return count;
                }
                pending.push(child);
            }
        }
    }
    count
}

fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses; fields resume after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_are_found_on_the_plans_path() {
        assert_eq!(resolve("sh", "/nonexistent:/bin"), PathBuf::from("/bin/sh"));
        assert_eq!(resolve("/x/y", "/bin"), PathBuf::from("/x/y"));
        assert_eq!(
            resolve("no-such-program", "/bin"),
            PathBuf::from("no-such-program")
        );
    }
}
