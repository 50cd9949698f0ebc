//! The fork server of a one-shot `executor run`: forked from the run, it prepares what the
//! run's profile needs while the run sets up (`Ahead`), serves its one command, and removes
//! the run's cgroup directories after the run has exited.
//!
//! **Why after.** A command is over, for its run, once its init's verdict is in: every
//! process of its tree is killed and reaped. What is left is the kernel's teardown of its
//! namespaces, done in init's own exit: its mount namespace goes with about forty mounts and
//! a wait for an RCU grace period, and init leaves its cgroups only after that (about half a
//! millisecond here, 0.3 to 0.8 ms). A run that removed its directories itself waited that
//! long with its exit status in hand. So the run removes those already empty and hands the
//! rest to its fork server ([`Spawner::remove_after`]), which is outside those cgroups, reaps
//! the init, removes them and exits; the run exits without waiting, as bubblewrap exits once
//! its command's status is in, not when its sandbox's init is gone.
//!
//! The fork server dies with the run (PR_SET_PDEATHSIG) until it takes the directories
//! over: only then, and only in a one-shot's server, does it give that up (and stop
//! answering the terminal's signals), after which it waits at most [`LINGER`] for its
//! children and gives each directory the usual 100 ms (`cgroup::remove`). A directory it
//! could not remove is swept by the next run or daemon of the pid namespace
//! (`cgroup::prepare`: the directory names a pid that is gone).

use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::Signal;
use nix::sys::signalfd::SignalFd;
use nix::sys::socket::{setsockopt, sockopt};
use nix::unistd::Pid;

use super::{
    reap, seqpacket_pair, serve, Leader, Pools, Removals, Spawner, ANSWER_TIMEOUT,
    MAX_TEMPLATE_BYTES, REMOVE_AFTER,
};
use crate::sys::{self, Forked};

/// How long a one-shot's fork server waits for its children to be gone before it removes
/// the run's directories anyway (an init is gone well within a millisecond of its verdict).
const LINGER: Duration = Duration::from_secs(5);

/// What a one-shot's fork server prepares while the run sets up, before its one request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ahead {
    /// A network namespace (`net_pool::made_ahead`): the run's profile makes one.
    pub net: bool,
}

/// For a one-shot `executor run`: the server forked from this process while it is still
/// single-threaded (before any runtime starts), instead of exec'ing our binary again. It saves
/// one exec of a large binary (its loader, relocations and start-up) on a run's critical
/// path; the daemon keeps [`super::start`], whose server holds nothing of the daemon's
/// memory. The child starts from a copy of ours (the run's arguments, nothing secret of
/// anyone else's) and keeps only the socket, the stdio it points at /dev/null and our stderr.
pub fn fork_here(ahead: Ahead) -> io::Result<Spawner> {
    sys::assert_single_threaded()?;
    let (ours, server_end) = seqpacket_pair()?;
    let parent = nix::unistd::getpid();
    match sys::fork()? {
        Forked::Child => {
            drop(ours);
            let _ = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL);
            if nix::unistd::getppid() != parent {
                sys::exit_child(1);
            }
            sys::close_fds_above_stderr_except(&[server_end.as_raw_fd()]);
            // One command: no next one to reuse its network namespace.
            serve(server_end, false, ahead)
        }
        Forked::Parent(_) => {
            drop(server_end);
            setsockopt(&ours, sockopt::ReceiveTimeout, &ANSWER_TIMEOUT)?;
            let _ = setsockopt(&ours, sockopt::SndBuf, &(MAX_TEMPLATE_BYTES * 2));
            Ok(Spawner {
                sock: Mutex::new(ours),
                broken: AtomicBool::new(false),
            })
        }
    }
}

impl Spawner {
    /// A one-shot's last words to its fork server: remove `dirs` (the run's cgroup
    /// directories, still busy with its init's exit) once its children are gone. `Ok` once
    /// the server has taken them over and will outlive us; the server exits when our end
    /// closes. A daemon's fork server refuses.
    pub fn remove_after(&self, dirs: &[PathBuf]) -> io::Result<()> {
        // A server that failed before may still owe an answer, which would pass for ours.
        if self.broken.load(Ordering::Acquire) {
            return Err(io::Error::other("the fork server failed before"));
        }
        let mut message = vec![REMOVE_AFTER];
        for dir in dirs {
            message.extend_from_slice(dir.as_os_str().as_encoded_bytes());
            message.push(0);
        }
        if message.len() > MAX_TEMPLATE_BYTES {
            return Err(io::Error::other("too many directories to hand over"));
        }
        let sock = self
            .sock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        nix::unistd::write(&*sock, &message)?;
        let mut reply = [0u8; 4];
        let read = nix::unistd::read(&*sock, &mut reply)?;
        if read != reply.len() || i32::from_le_bytes(reply) != 1 {
            return Err(io::Error::other("the fork server did not take them over"));
        }
        Ok(())
    }
}

/// The directories of a [`REMOVE_AFTER`] message (each path ends with a NUL).
pub(super) fn parse_dirs(body: &[u8]) -> Vec<PathBuf> {
    body.split(|b| *b == 0)
        .filter(|p| !p.is_empty())
        .map(|p| {
            use std::os::unix::ffi::OsStrExt;
            PathBuf::from(std::ffi::OsStr::from_bytes(p))
        })
        .collect()
}

/// In a one-shot's server: take `dirs` over, to remove after the run ([`finish`]). From now
/// on the run's exit must not kill us. Refused by a daemon's (`pooled`) server, whose
/// directories the daemon removes itself.
pub(super) fn take_over(pooled: bool, after_run: &mut Vec<PathBuf>, dirs: Vec<PathBuf>) -> bool {
    if pooled || nix::sys::prctl::set_pdeathsig(None).is_err() {
        return false;
    }
    // The run's stderr, which we share, must not stay open after it: a caller reading it to
    // its end would wait for us. Nor may the terminal's signals to the run's process group (a
    // Ctrl-C, a hang-up as the terminal closes) end our clean-up: they stay blocked; we are
    // gone within `LINGER` in any case.
    sys::devnull_stdio(true);
    let mut terminal = nix::sys::signal::SigSet::empty();
    for signal in [Signal::SIGINT, Signal::SIGQUIT, Signal::SIGHUP] {
        terminal.add(signal);
    }
    let _ = terminal.thread_block();
    after_run.extend(dirs);
    true
}

/// The run is gone (its end of the socket closed): reap our children as they end, for at most
/// [`LINGER`], then remove what they left and the directories the run handed over.
pub(super) fn finish(
    children: &SignalFd,
    leaders: &mut std::collections::HashMap<Pid, Leader>,
    pools: &mut Option<Pools>,
    removals: &mut Removals,
    after_run: Vec<PathBuf>,
) {
    let deadline = Instant::now() + LINGER;
    loop {
        reap(leaders, pools, removals);
        let any_left = nix::sys::wait::waitid(
            nix::sys::wait::Id::All,
            nix::sys::wait::WaitPidFlag::WEXITED
                | nix::sys::wait::WaitPidFlag::WNOHANG
                | nix::sys::wait::WaitPidFlag::WNOWAIT,
        )
        .is_ok();
        let left = deadline.saturating_duration_since(Instant::now());
        if !any_left || left.is_zero() {
            break;
        }
        let wait = PollTimeout::try_from(left.as_millis() as u64 + 1).unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(children.as_fd(), PollFlags::POLLIN)];
        if poll(&mut fds, wait).is_ok() {
            while let Ok(Some(_)) = children.read_signal() {}
        }
    }
    // Below the run's directories first: a parent stays busy while a child directory is in it.
    for (dir, _) in removals.dirs.drain(..) {
        crate::cgroup::remove(&dir);
    }
    for dir in after_run {
        crate::cgroup::remove(&dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directories_handed_over_are_read_back_as_sent() {
        let sent = [
            PathBuf::from("/sys/fs/cgroup/pids/executor-7-ns1"),
            PathBuf::from("/sys/fs/cgroup/unified/a b/executor-7-ns1"),
        ];
        let mut body = Vec::new();
        for dir in &sent {
            body.extend_from_slice(dir.as_os_str().as_encoded_bytes());
            body.push(0);
        }
        assert_eq!(parse_dirs(&body), sent);
        assert_eq!(parse_dirs(b""), Vec::<PathBuf>::new());
    }
}
