//! The sandbox helper: the executor binary re-run as `executor __sandbox-helper`, once per command.
//!
//! The daemon is a multi-threaded tokio process, where forking and changing process-wide state
//! (session, subreaper, cgroup, later namespaces) is unsafe or impossible. So the daemon spawns
//! this helper, a fresh single-threaded process, before any runtime exists in it. Its descriptors:
//!
//! - fd 0: the plan, one JSON line, then kept open as the lifeline. The daemon never writes to it
//!   again; when the daemon closes it (timeout, cancel, disconnect, shutdown) or dies (even by
//!   SIGKILL, the kernel closes it), the helper sees end-of-file and kills the command's tree.
//! - fd 1: the output pipe, handed to the payload as its stdout and stderr.
//! - fd 2: the status pipe: one [`HelperReport`] JSON line at the end.
//!
//! All setup happens in [`run_plan`], in order, one step each.

use std::io::{BufRead, Read, Write};
use std::os::fd::AsFd;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::cgroup;
use crate::plan::{HelperReport, Plan};
use crate::sys;

/// argv[1] that selects helper mode. Checked in `main` before anything else runs.
pub const HELPER_ARG: &str = "__sandbox-helper";

/// Longest plan line the helper accepts; the daemon's request limits keep plans far below it.
const MAX_PLAN_BYTES: usize = 4 << 20;

/// How long the final sweep may take before the helper gives up and reports what it killed.
const SWEEP_DEADLINE: Duration = Duration::from_secs(5);

/// A setup step that failed, named so the daemon can say which layer broke.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("cannot read the plan from the daemon: {0}")]
    ReadPlan(#[source] std::io::Error),
    #[error("the plan is not valid: {0}")]
    ParsePlan(#[source] serde_json::Error),
    #[error("cannot mark inherited descriptors close-on-exec: {0}")]
    CloseFds(#[source] std::io::Error),
    #[error("cannot start a new session: {0}")]
    Session(#[source] Errno),
    #[error("cannot become a child subreaper: {0}")]
    Subreaper(#[source] Errno),
    #[error("cannot set up signal handling: {0}")]
    Signals(#[source] Errno),
    #[error("cgroup: {0}")]
    Cgroup(#[source] cgroup::CgroupError),
    #[error("working directory {0} does not exist or is not a directory")]
    Cwd(String),
    #[error("cannot start {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot duplicate the output pipe: {0}")]
    OutputPipe(#[source] std::io::Error),
}

impl SetupError {
    /// Short name of the stage, carried in the report and in the daemon's error message.
    pub fn stage(&self) -> &'static str {
        match self {
            Self::ReadPlan(_) | Self::ParsePlan(_) => "plan",
            Self::CloseFds(_) => "fds",
            Self::Session(_) => "session",
            Self::Subreaper(_) => "subreaper",
            Self::Signals(_) => "signals",
            Self::Cgroup(_) => "cgroup",
            Self::Cwd(_) => "cwd",
            Self::Spawn { .. } => "exec",
            Self::OutputPipe(_) => "output",
        }
    }
}

/// Entry point of helper mode. Always exits 0: the outcome travels in the report.
pub fn main() -> ExitCode {
    let report = match read_plan().and_then(|plan| run_plan(&plan)) {
        Ok(report) => report,
        Err(err) => HelperReport::SetupFailed {
            stage: err.stage().to_string(),
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

/// Apply the plan and run the payload to its end. The order matters; each step says why.
fn run_plan(plan: &Plan) -> Result<HelperReport, SetupError> {
    let mut layers = Vec::new();

    // 1. Nothing the daemon held may reach the command: every fd above stderr closes on exec.
    sys::cloexec_fds_above_stderr().map_err(SetupError::CloseFds)?;

    // 2. A new session: the command has no controlling terminal (so no TIOCSTI injection into
    //    the daemon's terminal) and its own process group, apart from the daemon's.
    nix::unistd::setsid().map_err(SetupError::Session)?;
    layers.push("session".to_string());

    // 3. Child subreaper: when the shell's children double-fork or call setsid, their orphans
    //    are reparented to us instead of init, so the final sweep can find and kill them.
    nix::sys::prctl::set_child_subreaper(true).map_err(SetupError::Subreaper)?;
    layers.push("subreaper".to_string());

    // 4. SIGCHLD arrives on a signalfd, so one poll waits for "payload exited" and "daemon
    //    closed the lifeline" together, without signal handlers. The payload's mask is reset
    //    by std::process before exec.
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGCHLD);
    mask.thread_block().map_err(SetupError::Signals)?;
    let sigchld = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(SetupError::Signals)?;

    // 5. Cgroup: join the command's cgroup so the payload is born inside it, which lets the
    //    end of the command kill every task in one write to cgroup.kill, stopped ones included.
    if let Some(cgroup) = &plan.cgroup {
        cgroup::create(&cgroup.dir).map_err(SetupError::Cgroup)?;
        cgroup::join(&cgroup.dir).map_err(SetupError::Cgroup)?;
    }

    // 6. Spawn the payload: cleared environment plus the plan's, stdin from /dev/null, stdout
    //    and stderr both on the output pipe so their order is kept.
    if !plan.cwd.is_dir() {
        leave_cgroup(plan)?;
        return Err(SetupError::Cwd(plan.cwd.display().to_string()));
    }
    let spawned = spawn_payload(plan);

    // 7. Move ourselves out of the command's cgroup again, so cgroup.kill never hits us.
    leave_cgroup(plan)?;
    let payload = spawned?;
    if plan.cgroup.is_some() {
        layers.push("cgroup".to_string());
    }

    // 8. Drop our copy of the output pipe: the daemon sees end-of-file exactly when the last
    //    process of the command's tree is gone.
    drop_output_pipe()?;

    // 9. Wait for the payload to exit, or for the daemon to close the lifeline.
    let (mut status, stopped) = wait_for_end(payload, &sigchld);

    // 10. Kill whatever the command left behind, then remove its cgroup.
    let killed = sweep(plan, payload, &mut status);
    if let Some(cgroup) = &plan.cgroup {
        cgroup::remove(&cgroup.dir);
    }

    let (code, signal) = match status {
        Some(WaitStatus::Exited(_, code)) => (Some(code), None),
        Some(WaitStatus::Signaled(_, sig, _)) => (None, Some(sig as i32)),
        _ => (None, Some(Signal::SIGKILL as i32)),
    };
    Ok(HelperReport::Finished {
        code,
        signal,
        killed,
        stopped,
        layers,
    })
}

fn spawn_payload(plan: &Plan) -> Result<Pid, SetupError> {
    let (program, args) = plan.argv.split_first().ok_or_else(|| SetupError::Spawn {
        program: String::new(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty argv"),
    })?;
    let output = std::io::stdout()
        .as_fd()
        .try_clone_to_owned()
        .map_err(SetupError::OutputPipe)?;
    let output_dup = output.try_clone().map_err(SetupError::OutputPipe)?;
    let child = Command::new(program)
        .args(args)
        .env_clear()
        .envs(&plan.env)
        .current_dir(&plan.cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::from(output))
        .stderr(Stdio::from(output_dup))
        .spawn()
        .map_err(|source| SetupError::Spawn {
            program: program.clone(),
            source,
        })?;
    Ok(Pid::from_raw(child.id() as i32))
}

fn drop_output_pipe() -> Result<(), SetupError> {
    let devnull = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .map_err(SetupError::OutputPipe)?;
    nix::unistd::dup2_stdout(&devnull).map_err(|e| SetupError::OutputPipe(e.into()))
}

/// Block until the payload exits or the lifeline closes. Returns the payload's status if it
/// exited, and whether the daemon asked for the stop.
fn wait_for_end(payload: Pid, sigchld: &SignalFd) -> (Option<WaitStatus>, bool) {
    let stdin = std::io::stdin();
    loop {
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
        let lifeline = fds[1].revents().unwrap_or(PollFlags::empty());
        if !lifeline.is_empty() {
            return (None, true);
        }
        // Drain the signalfd, then reap every child that has changed state.
        while let Ok(Some(_)) = sigchld.read_signal() {}
        if let Some(status) = reap_ready(payload) {
            return (Some(status), false);
        }
    }
}

/// Reap all exited children without blocking; return the payload's status if it was among them.
fn reap_ready(payload: Pid) -> Option<WaitStatus> {
    let mut found = None;
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => return found,
            Ok(status) => {
                if status.pid() == Some(payload) {
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
fn sweep(plan: &Plan, payload: Pid, status: &mut Option<WaitStatus>) -> u32 {
    let deadline = Instant::now() + SWEEP_DEADLINE;
    let mut killed = std::collections::HashSet::new();
    loop {
        if let Some(cgroup) = &plan.cgroup {
            killed.extend(cgroup::procs(&cgroup.dir));
            cgroup::kill(&cgroup.dir);
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
                if st.pid() == Some(payload) && status.is_none() {
                    *status = Some(st);
                }
            }
        }
        if let Some(st) = reap_ready(payload) {
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

fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses; fields resume after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

fn leave_cgroup(plan: &Plan) -> Result<(), SetupError> {
    match &plan.cgroup {
        Some(cgroup) => cgroup::join(&cgroup.helper_home).map_err(SetupError::Cgroup),
        None => Ok(()),
    }
}
