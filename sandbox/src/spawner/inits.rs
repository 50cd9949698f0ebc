//! What the fork server keeps of a worker whose init leads, from its fork until it is reaped,
//! and what it does then: take back what the init was lent, or remove it.

use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::Signal;
use nix::unistd::Pid;

use super::{cgroup_pool, Pools};
use crate::plan::Template;
use crate::wire::{receive_verdict, verdict};

/// A worker whose init leads (a template with a pid namespace, `helper::leads`), from its fork
/// until its init is reaped: what it was lent, and where its init says, as its last act, what
/// of it may be lent again (`wire::verdict`).
pub(super) struct Leader {
    pub(super) template: Vec<u8>,
    /// Our copy of its control socket.
    pub(super) control: OwnedFd,
    /// Its cgroup directories' name, and the directories (not the caller's own).
    pub(super) name: String,
    pub(super) dirs: Vec<std::path::PathBuf>,
    /// The name came from the cgroup pool and may go back to it.
    pub(super) pooled: bool,
    /// The template's network namespaces are pooled; the one lent, if any (our copy).
    pub(super) net_pooled: bool,
    pub(super) ns: Option<OwnedFd>,
    /// Our copy of its command's status pipe, once it has one: to report for an init that
    /// died without reporting (the kernel's OOM group kill spares only what is exempt, and an
    /// init without CAP_SYS_RESOURCE cannot exempt itself).
    pub(super) status: Option<OwnedFd>,
}

/// Reap our children that ended; give back or remove what each init was lent.
pub(super) fn reap(
    leaders: &mut std::collections::HashMap<Pid, Leader>,
    pools: &mut Option<Pools>,
    removals: &mut Removals,
) {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => return,
            Ok(status) => {
                if let Some(leader) = status.pid().and_then(|pid| leaders.remove(&pid)) {
                    release(leader, status, pools, removals);
                }
            }
        }
    }
}

/// An init is gone, and with it every process of its namespace (the kernel empties a pid
/// namespace before its init's exit completes): take back what it was lent if its verdict and
/// the directories themselves say so (`cgroup_pool`, `net_pool`), else remove the
/// directories and let the namespace go.
fn release(
    leader: Leader,
    ended: nix::sys::wait::WaitStatus,
    pools: &mut Option<Pools>,
    removals: &mut Removals,
) {
    let verdict = receive_verdict(&leader.control);
    let Leader {
        template,
        name,
        dirs,
        pooled,
        net_pooled,
        ns,
        status,
        ..
    } = leader;
    if let (None, Some(status), nix::sys::wait::WaitStatus::Signaled(_, signal, _)) =
        (&verdict, status, ended)
    {
        report_for_init(&template, &name, &status, signal);
    }
    let (flags, made) = verdict.unwrap_or((0, None));
    let Some(pools) = pools else {
        removals.push(dirs);
        return;
    };
    let cgroups = flags & verdict::CGROUPS != 0 && pooled && cgroup_pool::clean(&dirs);
    if cgroups {
        pools.cgroups.take_back(&template, &name, dirs);
    } else {
        removals.push(dirs);
    }
    if flags & verdict::NET != 0 && net_pooled {
        if let Some(ns) = ns.or(made) {
            pools.nets.receive(&template, ns);
        }
    }
}

/// An init killed before its verdict (most likely by the kernel's OOM group kill, which takes
/// its pid namespace, and so its command, with it): report the command's end as killed by
/// that signal, with the limits its cgroups counted, in case init could not. The daemon takes
/// the first report on the pipe; ours never waits for room.
fn report_for_init(template: &[u8], name: &str, status: &OwnedFd, signal: Signal) {
    let Ok(parsed) = serde_json::from_slice::<Template>(template) else {
        return;
    };
    let report = crate::plan::HelperReport::Finished {
        code: None,
        signal: Some(signal as i32),
        killed: 0,
        stopped: false,
        layers: parsed.layers.clone(),
        limits_hit: crate::helper::limits_hit(&parsed, name),
    };
    let Ok(mut line) = serde_json::to_vec(&report) else {
        return;
    };
    line.push(b'\n');
    let mut fds = [PollFd::new(status.as_fd(), PollFlags::POLLOUT)];
    if matches!(poll(&mut fds, PollTimeout::ZERO), Ok(1)) {
        let _ = nix::unistd::write(status, &line);
    }
}

/// Cgroup directories of reaped inits to remove: tried once each when the loop has served
/// what came (never on a request's path), again every [`Removals::RETRY`] while one is busy
/// (a task still on its way out), given up after [`Removals::TRIES`] (the daemon removes its
/// whole tree at its end, and a dead one's at the next start). The fork server never sleeps
/// on a directory.
#[derive(Default)]
pub(super) struct Removals {
    pub(super) dirs: Vec<(std::path::PathBuf, u32)>,
}

impl Removals {
    const RETRY: Duration = Duration::from_millis(2);
    const TRIES: u32 = 50;

    pub(super) fn push(&mut self, dirs: Vec<std::path::PathBuf>) {
        self.dirs.extend(dirs.into_iter().map(|dir| (dir, 0)));
    }

    /// One try at each; how long until the next is due, if any is left.
    pub(super) fn try_now(&mut self) -> Option<Duration> {
        self.dirs.retain_mut(|(dir, tries)| {
            *tries += 1;
            !crate::cgroup::try_remove(dir) && *tries < Self::TRIES
        });
        (!self.dirs.is_empty()).then_some(Self::RETRY)
    }

    pub(super) fn due(&self) -> Option<Duration> {
        (!self.dirs.is_empty()).then_some(Duration::ZERO)
    }
}
