//! The fork server of a one-shot `executor run`: forked from the run, it prepares what the
//! run's profile needs while the run sets up (`Ahead`), serves its one command, and removes
//! what the run leaves behind after the run has exited.
//!
//! **Why after.** A command is over, for its run, once its verdict is in: every process of
//! its tree is killed and reaped. What is left is clean-up nobody waits for: the run's
//! cgroup directories (under strict, busy until the kernel has torn the command's init's
//! namespaces down: about forty mounts and an RCU grace period, 0.3 to 0.8 ms here), its
//! home (two `rmdir`s, each waiting for its block's discard on this machine's ext4: 0.6 ms
//! a run), and the sweep of what killed runs left. A run that removed them itself held its
//! exit status that long. So the run tells its server, once it knows them and before its
//! command starts, what it will leave ([`Leftover`], [`Spawner::leave`]); the server
//! removes them when the run's end of the socket closes, having reaped its children, as
//! bubblewrap exits once its command's status is in, not when its sandbox is gone.
//!
//! **Outliving the run.** The server is the run's child but does not die with it (no
//! PR_SET_PDEATHSIG): the run's end of the socket closing, however the run ends (killed
//! outright too), is its cue to clean up and exit. It shares the run's process group, so it
//! blocks the terminal's signals (a Ctrl-C, a hang-up as the terminal closes), and it holds
//! neither the run's stdio nor its working directory: a caller reading the run's output to
//! its end, or unmounting where it ran, must not wait for the server. It takes one list of
//! leftovers, before the command only. It waits at most [`LINGER`] for its children (a
//! command's process still there then could still shape the home, which is then left to a
//! later sweep), and gives each cgroup directory the usual 100 ms (`cgroup::remove`). What it
//! could not remove (it was killed too) is swept by a later run's server: cgroup directories
//! and homes name the pid of their run, which is gone. A server that died before the run's
//! end leaves the run to remove its cgroup directories and home itself ([`Spawner::gone`]).

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
    MAX_TEMPLATE_BYTES,
};
use crate::removal::RemoveError;
use crate::sys::{self, Forked};
use crate::wire::{encode, Leftover};

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
/// anyone else's) and keeps only the socket; its stdio is /dev/null.
pub fn fork_here(ahead: Ahead) -> io::Result<Spawner> {
    sys::assert_single_threaded()?;
    let (ours, server_end) = seqpacket_pair()?;
    match sys::fork()? {
        Forked::Child => {
            drop(ours);
            sys::close_fds_above_stderr_except(&[server_end.as_raw_fd()]);
            outlive_the_run();
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
    /// Tell a one-shot's fork server what the run will leave behind, to remove after it
    /// (module docs). No answer: the server reads it before the end-of-file that the run's
    /// exit makes. A daemon's server ignores it.
    pub fn leave(&self, leftovers: &[Leftover]) -> io::Result<()> {
        // A server that failed before may have read only part of what it was sent.
        if self.broken.load(Ordering::Acquire) {
            return Err(io::Error::other("the fork server failed before"));
        }
        let message = encode(leftovers);
        if message.len() > MAX_TEMPLATE_BYTES {
            return Err(io::Error::other("too many leftovers to hand over"));
        }
        let sock = self
            .sock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let sent = nix::unistd::write(&*sock, &message)?;
        if sent != message.len() {
            return Err(io::Error::other(
                "the fork server took part of the leftovers",
            ));
        }
        Ok(())
    }
}

impl Spawner {
    /// Whether the server is gone (its end of the socket closed): then what it was told to
    /// remove is its caller's again.
    pub fn gone(&self) -> bool {
        let sock = self
            .sock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut fds = [PollFd::new(sock.as_fd(), PollFlags::empty())];
        match poll(&mut fds, PollTimeout::ZERO) {
            Ok(_) => fds[0]
                .revents()
                .is_some_and(|r| r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR)),
            Err(_) => true,
        }
    }
}

/// Remove what a run left, in this order: its cgroup directories (a parent stays busy while a
/// child is in it, so these come before any sweep), its home, then what dead runs left. The
/// home's errors are returned, for a run that removes its own leftovers to report.
pub fn remove_leftovers(leftovers: Vec<Leftover>) -> Vec<(PathBuf, RemoveError)> {
    let mut errors = Vec::new();
    for leftover in &leftovers {
        if let Leftover::Cgroup(dir) = leftover {
            crate::cgroup::remove(dir);
        }
    }
    for leftover in &leftovers {
        if let Leftover::Home { dir, unmount } = leftover {
            if let Err(err) = crate::homes::remove(dir, *unmount) {
                errors.push((dir.clone(), err));
            }
        }
    }
    for leftover in &leftovers {
        match leftover {
            Leftover::StaleCgroups(dir) => crate::cgroup::remove_stale(dir),
            Leftover::StaleHomes(dir) => crate::homes::remove_stale(dir),
            Leftover::Cgroup(_) | Leftover::Home { .. } => {}
        }
    }
    errors
}

/// The signals a terminal sends the run's whole process group (a Ctrl-C, a Ctrl-\, a hang-up
/// as it closes): blocked in a one-shot's server (`serve`), so that none ends its clean-up.
/// We are gone within [`LINGER`] of the run's end in any case.
pub(super) const TERMINAL_SIGNALS: [Signal; 3] = [Signal::SIGINT, Signal::SIGQUIT, Signal::SIGHUP];

/// In a one-shot's server, at its start: hold none of the run's stdio, nor its working
/// directory (a caller waiting for the output's end, or to unmount where it ran, must not wait
/// for us; module docs). Every path we are given is absolute.
fn outlive_the_run() {
    sys::devnull_stdio(true);
    let _ = nix::unistd::chdir("/");
}

/// The run is gone (its end of the socket closed): reap our children as they end, for at most
/// [`LINGER`], then remove what they left and what the run left ([`remove_leftovers`]).
pub(super) fn finish(
    children: &SignalFd,
    leaders: &mut std::collections::HashMap<Pid, Leader>,
    pools: &mut Option<Pools>,
    removals: &mut Removals,
    mut after_run: Vec<Leftover>,
) {
    let deadline = Instant::now() + LINGER;
    let mut any_left;
    loop {
        reap(leaders, pools, removals);
        any_left = nix::sys::wait::waitid(
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
    // A command's process still there after all this time (a supervisor stuck with it) could
    // still shape the home: it is left to a later run's sweep, which unmounts nothing.
    if any_left {
        after_run.retain(|leftover| !matches!(leftover, Leftover::Home { .. }));
    }
    remove_leftovers(after_run);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_is_gone_once_its_end_of_the_socket_closes_and_not_before() {
        let (ours, theirs) = seqpacket_pair().unwrap();
        let server = Spawner {
            sock: Mutex::new(ours),
            broken: AtomicBool::new(false),
        };
        assert!(!server.gone());
        // Unread messages from it do not make it gone.
        nix::unistd::write(&theirs, b"pid").unwrap();
        assert!(!server.gone());
        drop(theirs);
        assert!(server.gone());
    }
}
