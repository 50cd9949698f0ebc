//! How a helper's command ends: wait for the payload or the lifeline, count and kill what is
//! left, read the limits it hit, remove its cgroups. (With a pid namespace, init does this
//! itself: `init`.)

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::Signal;
use nix::sys::signalfd::SignalFd;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::cgroup;
use crate::plan::Template;
use crate::signals;

/// How long the final sweep may take before the helper gives up and reports what it killed.
const SWEEP_DEADLINE: Duration = Duration::from_secs(5);

/// How the wait for a command's end came out.
pub struct Ending {
    /// The payload's exit status, when it was reaped.
    pub exit: Option<WaitStatus>,
    /// The lifeline closed (the daemon asked for the stop) or waiting failed.
    pub stopped: bool,
}

/// Block until the command's first process `child` exits (`exited`, if it did already) or the
/// lifeline closes. Lines the daemon writes on the lifeline meanwhile (`pending` holds what
/// came with the command) ask for signals: `signal <number>` goes to every process of the
/// command's tree.
pub fn wait_for_end(
    child: Pid,
    exited: Option<WaitStatus>,
    sigchld: &SignalFd,
    lifeline: &OwnedFd,
    mut pending: Vec<u8>,
) -> Ending {
    let ending = |exit, stopped| Ending { exit, stopped };
    loop {
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            if let Some(signal) = std::str::from_utf8(&line[..end])
                .ok()
                .and_then(|l| l.strip_prefix("signal "))
                .and_then(|n| n.trim().parse::<i32>().ok())
                .and_then(|n| Signal::try_from(n).ok())
            {
                signal_tree(signal);
            }
        }
        if pending.len() > 4096 {
            pending.clear();
        }
        if let Some(status) = reap_ready(child).or(exited) {
            return ending(Some(status), false);
        }
        let mut fds = [
            PollFd::new(sigchld.as_fd(), PollFlags::POLLIN),
            PollFd::new(lifeline.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(Errno::EINTR) => continue,
            // Cannot wait any more: treat it as a stop so the tree is still killed.
            Err(_) => return ending(None, true),
        }
        if fds[1].any().unwrap_or(true) {
            let mut chunk = [0u8; 512];
            match nix::unistd::read(lifeline, &mut chunk) {
                Ok(0) => return ending(None, true),
                Ok(n) => pending.extend_from_slice(&chunk[..n]),
                Err(Errno::EINTR | Errno::EAGAIN) => {}
                Err(_) => return ending(None, true),
            }
        }
        while let Ok(Some(_)) = sigchld.read_signal() {}
    }
}

/// Send `signal` to every process of the command: everything below us (orphans come to us,
/// the subreaper), each through a pidfd taken while it was in the tree (`signals`).
fn signal_tree(signal: Signal) {
    signals::signal_descendants(signal);
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

/// How many processes the command has now, before the kill: from its cgroup, where there is
/// one (else the sweep's count stands).
pub fn count(template: &Template, name: &str) -> Option<u32> {
    template
        .cgroups
        .iter()
        .find(|c| c.kill)
        .map(|c| cgroup::procs(&c.dir(name)).len() as u32)
}

/// What a [`sweep`] did.
pub struct Swept {
    /// How many processes it killed.
    pub killed: u32,
    /// Whether it wrote `cgroup.kill`: the directory may not be lent again. (Linux 6.14 to
    /// 6.18 kill every child cloned into a cgroup, `CLONE_INTO_CGROUP`, whose kill count differs
    /// from its parent's cgroup's: once killed, a directory kills every later command's first
    /// process at its birth.)
    pub by_cgroup: bool,
}

/// Kill every remaining process of the command and reap it.
///
/// We are a subreaper, so every live descendant either is our child or has a live ancestor that
/// is: "no children left" means "no descendants left". cgroup.kill takes the whole cgroup at
/// once (stopped and signal-ignoring tasks included), when it holds any; the child sweep covers
/// hosts without it.
pub fn sweep(
    template: &Template,
    name: &str,
    child: Pid,
    status: &mut Option<WaitStatus>,
) -> Swept {
    let deadline = Instant::now() + SWEEP_DEADLINE;
    let mut killed = std::collections::HashSet::new();
    let mut by_cgroup = false;
    loop {
        for cg in template.cgroups.iter().filter(|c| c.kill) {
            let dir = cg.dir(name);
            let procs = cgroup::procs(&dir);
            if !procs.is_empty() {
                killed.extend(procs);
                cgroup::kill(&dir);
                by_cgroup = true;
            }
        }
        // Through pidfds like every other kill (`signals`); one already gone is done.
        killed.extend(signals::signal_our_children(children, Signal::SIGKILL));
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
    Swept {
        killed: u32::try_from(killed.len()).unwrap_or(u32::MAX),
        by_cgroup,
    }
}

/// Remove the command's cgroups (not those that are the caller's own: it removes them).
pub fn remove_cgroups(template: &Template, name: &str) {
    for cg in template.cgroups.iter().filter(|c| !c.is_parent) {
        cgroup::remove(&cg.dir(name));
    }
}

/// Whether the command's cgroups may be lent to the template's next command: no process in
/// them, no limit hit (the counters [`Counters`] reads are zero, as in new directories),
/// and little memory still charged to them (`spawner::cgroup_pool`).
pub fn cgroups_clean(template: &Template, name: &str, counters: &Counters) -> bool {
    let charged = |dir: &std::path::Path| {
        ["memory.current", "memory.usage_in_bytes"]
            .iter()
            .map(|file| cgroup::get(dir, file))
            .find(|v| !v.is_empty())
            .map_or(Some(0), |v| v.parse::<u64>().ok())
    };
    counters.hit().is_empty()
        && template.cgroups.iter().all(|cg| {
            let dir = cg.dir(name);
            dir.is_dir()
                && cgroup::procs(&dir).is_empty()
                && charged(&dir).is_some_and(|c| c <= crate::wire::lease::MAX_CHARGED)
        })
}

/// The counter files that say which limits a command ran into, opened once when its cgroups
/// are entered: read at its end without a path lookup, and by init, whose root no longer
/// shows the host's cgroup directories (it reports a command that left nothing behind).
#[derive(Default)]
pub struct Counters {
    files: Vec<Counter>,
}

struct Counter {
    /// The limit it tells of, as the report names it.
    limit: &'static str,
    file: OwnedFd,
    /// The key of a flat keyed file (`pids.events`), or none for a bare number.
    key: Option<&'static str>,
}

impl Counters {
    /// Open the counters of the limits `template` sets on the cgroups `name`; one that cannot
    /// be opened counts as never hit (a file this kernel does not have).
    pub fn open(template: &Template, name: &str) -> Self {
        let mut files = Vec::new();
        for cg in &template.cgroups {
            let dir = cg.dir(name);
            for (setting, _) in &cg.settings {
                let watched: &[(&str, Option<&str>)] = match setting.as_str() {
                    // v1 and v2 alike: forks refused at the limit.
                    "pids.max" => &[("pids.events", Some("max"))],
                    // v2: the limit was reached (and reclaim ran), or the OOM killer acted.
                    "memory.max" => &[
                        ("memory.events", Some("max")),
                        ("memory.events", Some("oom_kill")),
                    ],
                    "memory.limit_in_bytes" => &[
                        ("memory.oom_control", Some("oom_kill")),
                        ("memory.failcnt", None),
                    ],
                    _ => &[],
                };
                let limit = if setting.starts_with("pids.") {
                    "processes"
                } else {
                    "memory"
                };
                for (file, key) in watched {
                    if let Ok(file) = cgroup::open_counter(&dir, file) {
                        files.push(Counter {
                            limit,
                            file,
                            key: *key,
                        });
                    }
                }
            }
        }
        Self { files }
    }

    /// The limits the command ran into, each named once.
    pub fn hit(&self) -> Vec<String> {
        let mut hit: Vec<String> = Vec::new();
        for counter in &self.files {
            if hit.iter().any(|h| h == counter.limit) {
                continue;
            }
            if cgroup::read_counter(&counter.file, counter.key) > 0 {
                hit.push(counter.limit.to_string());
            }
        }
        hit
    }
}

pub fn decode(status: Option<WaitStatus>) -> (Option<i32>, Option<i32>) {
    match status {
        Some(WaitStatus::Exited(_, code)) => (Some(code), None),
        Some(WaitStatus::Signaled(_, sig, _)) => (None, Some(sig as i32)),
        _ => (None, Some(Signal::SIGKILL as i32)),
    }
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
