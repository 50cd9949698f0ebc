//! Signals to a command's processes, each sent through a pidfd (`pidfd_open(2)`, Linux 5.3)
//! taken while the process is known to be in the command's tree.
//!
//! A pid read from a list (`/proc/<pid>/task/<tid>/children`, `cgroup.procs`) may be freed
//! and given to another process before `kill(2)` gets there: a helper runs as root in the
//! host's pid namespace, so a command that lets its children exit at the moment of the walk
//! could have a host process signalled in their place (issue 35). A pidfd names one process
//! for its whole life, so the order here closes the window:
//!
//! 1. read the list (the pids that were in the tree),
//! 2. open a pidfd for each,
//! 3. read the list again (and, for a parent's children, check that the parent has not exited
//!    since: a pid is reused only once its process is reaped).
//!
//! A pid in both reads was in the tree after its pidfd was opened. The pidfd names either that
//! process, or one that held the pid before it and has since been reaped (a pid changes hands
//! only then), which `pidfd_send_signal(2)` answers with ESRCH. A pid that is gone from the
//! second read is not signalled. Where the command has a cgroup with `cgroup.kill`, killing
//! goes through it (no pid involved); with a pid namespace, its init signals with
//! `kill(-1)`, which reaches only its namespace.

use std::os::fd::{AsFd, OwnedFd};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::resource::{getrlimit, setrlimit, Resource};
use nix::sys::signal::Signal;

/// How many pidfds one step of a list holds open at once: a list may be longer than the
/// descriptors a helper may open; the step is repeated for the rest.
const CHUNK: usize = 256;

/// Most processes one walk of a tree holds (a bound on work, not a limit that matters: the
/// command's process limit is far below it).
const MAX_WALK: usize = 1 << 20;

/// A process held by its pidfd.
struct Held {
    pid: i32,
    fd: OwnedFd,
}

fn open(pid: i32) -> Option<Held> {
    let raw = rustix::process::Pid::from_raw(pid)?;
    rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty())
        .ok()
        .map(|fd| Held { pid, fd })
}

/// Send `signal` to the process the pidfd names; ESRCH (it has exited) counts as done.
fn send(held: &Held, signal: Signal) -> bool {
    let Some(sig) = rustix::process::Signal::from_named_raw(signal as i32) else {
        return false;
    };
    rustix::process::pidfd_send_signal(&held.fd, sig).is_ok()
}

/// Whether the process has not exited: a pidfd polls readable once it has (pidfd_open(2)).
fn running(fd: &OwnedFd) -> bool {
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    matches!(poll(&mut fds, PollTimeout::ZERO), Ok(0))
}

/// Hold a pidfd for each pid of `pids` that `list` still shows when read after they were
/// opened (step 3 of the module's order). `list` returns `None` when the list's owner is
/// gone or no longer the one meant; then nothing is held.
fn confirm(pids: &[i32], list: &mut dyn FnMut() -> Option<Vec<i32>>) -> Vec<Held> {
    let held: Vec<Held> = pids.iter().filter_map(|pid| open(*pid)).collect();
    let Some(again) = list() else {
        return Vec::new();
    };
    held.into_iter()
        .filter(|h| again.contains(&h.pid))
        .collect()
}

/// Send `signal` to every process `list` names (a cgroup's `cgroup.procs`, a subreaper's
/// children), each through a pidfd confirmed by a second read of the list. Returns the pids
/// signalled.
pub fn signal_listed(mut list: impl FnMut() -> Option<Vec<i32>>, signal: Signal) -> Vec<i32> {
    let Some(first) = list() else {
        return Vec::new();
    };
    let mut sent = Vec::new();
    for chunk in first.chunks(CHUNK) {
        for held in confirm(chunk, &mut list) {
            if send(&held, signal) {
                sent.push(held.pid);
            }
        }
    }
    sent
}

/// Send `signal` to every child of ours (`children` lists them), through pidfds as
/// [`signal_listed`] does. Where no pidfd can be had (ENOSYS before Linux 5.3, no descriptor
/// left), by pid: a child we have not reaped keeps its pid (we are its only reaper, and
/// single-threaded), so that pid cannot name another process. Without this a sweep on such a
/// host would wait for children nothing killed.
pub fn signal_our_children(mut children: impl FnMut() -> Vec<i32>, signal: Signal) -> Vec<i32> {
    let mut sent = signal_listed(|| Some(children()), signal);
    for pid in children() {
        if sent.contains(&pid) || open(pid).is_some() {
            continue;
        }
        if nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal).is_ok() {
            sent.push(pid);
        }
    }
    sent
}

/// The children of process `pid` now, from the kernel's lists of each of its threads.
fn children_of(pid: i32) -> Option<Vec<i32>> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut children = Vec::new();
    for task in tasks.flatten() {
        if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
            children.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok()),
            );
        }
    }
    Some(children)
}

/// Send `signal` to every descendant of the calling process (a subreaper: its command's
/// tree), walking the children lists from ourselves down. Each process is held by a pidfd
/// opened before its parent's list was read again, and that parent's own pidfd shows it had
/// not exited after that read (so its pid still named it). The whole tree is held before any
/// signal is sent: a parent killed first would hand its children to us mid-walk, out of the
/// part already read. Returns the pids signalled.
pub fn signal_descendants(signal: Signal) -> Vec<i32> {
    // The tree is bounded by the command's process limit, but may pass the soft limit on our
    // descriptors: ours may rise to the hard one (the payload has its own limits already).
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
        }
    }
    let me = std::process::id() as i32;
    let mut held: Vec<Held> = Vec::new();
    // Parents still to visit, as indexes into `held`; `None` is ourselves, alive by definition.
    let mut pending: Vec<Option<usize>> = vec![None];
    while let Some(parent) = pending.pop() {
        let (pid, parent_fd) = match parent {
            None => (me, None),
            Some(i) => (held[i].pid, Some(&held[i].fd)),
        };
        let mut list = || {
            let children = children_of(pid)?;
            // Read after the list: the parent had not exited, so the list was its own.
            match parent_fd {
                Some(fd) if !running(fd) => None,
                _ => Some(children),
            }
        };
        let Some(first) = list() else {
            continue;
        };
        let mut found = Vec::new();
        for chunk in first.chunks(CHUNK) {
            found.extend(confirm(chunk, &mut list));
        }
        for child in found {
            if held.len() >= MAX_WALK {
                break;
            }
            pending.push(Some(held.len()));
            held.push(child);
        }
    }
    held.iter()
        .filter(|h| send(h, signal))
        .map(|h| h.pid)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn a_pid_missing_from_the_second_read_is_not_signalled() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        let mut reads = 0;
        // The first read lists the child, the second no longer does: nothing is sent.
        let sent = signal_listed(
            || {
                reads += 1;
                Some(if reads == 1 { vec![pid] } else { vec![] })
            },
            Signal::SIGKILL,
        );
        assert!(sent.is_empty());
        assert!(
            child.try_wait().unwrap().is_none(),
            "the child was signalled"
        );
        // Control: listed both times, it is killed.
        let sent = signal_listed(|| Some(vec![pid]), Signal::SIGKILL);
        assert_eq!(sent, vec![pid]);
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9)
        );
    }
}
