//! Network namespaces reused among the commands of one template, one command at a time.
//!
//! A new network namespace costs about 0.9 ms of CPU per command on our 2-core VM: the
//! kernel runs every network subsystem's set-up when it is made and their clean-up (on a
//! kernel worker, behind RCU grace periods) when its last process is gone. Commands of the
//! same template (profile, client identity, workspace) can use the same namespace one after
//! the other, as long as nothing of the one before is left in it:
//!
//! - **Who may reuse**: only commands of a byte-equal template, so never another client's.
//!   Commands of one template already share the writable workspace; what a namespace keeps
//!   after its sockets are gone (loopback's byte counters, `/proc/net/snmp`, the TCP metrics
//!   cache) tells a later command of the same client nothing the workspace could not.
//! - **What the command could change**: nothing but its own sockets. A namespace is lent
//!   only to a template whose commands run as a uid other than 0 with no capability and
//!   no_new_privs (so no setuid program gains root, which could write the namespace's
//!   sysctls as their owner), in a pid namespace of their own (so every process that was in
//!   the network namespace is gone once its init is reaped).
//! - **When it comes back**: the helper gives it back only after reaping every child (init
//!   last: the kernel empties the pid namespace before init's exit completes), and only if
//!   the namespace holds no socket at all (`sockets: used 0` counts every family's: unix
//!   sockets with an abstract name, sockets in flight, netlink, packet), no TCP socket in
//!   TIME_WAIT (`tw 0`; its port stays taken) and no IPv6 flow label (they outlive their
//!   socket). Anything else, and it is closed: the kernel frees it as before.
//! - **One at a time**: the fork server hands a free namespace to exactly one worker, and
//!   takes it back only from that worker's helper, after the command. A worker built with a
//!   fresh namespace (the pool was empty) gives that one back the same way.
//!
//! The pool lives in the fork server; helpers return namespaces on a socket whose other end
//! only the fork server and helpers hold (init drops it before anything of the command runs).
//! A daemon's fork server pools; a one-shot `executor run`'s does not (there is no next
//! command).

use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use nix::sched::CloneFlags;
use nix::sys::socket::{
    sendmsg, setsockopt, socketpair, sockopt, AddressFamily, ControlMessage, MsgFlags, SockFlag,
    SockType,
};
use nix::unistd::Pid;

use crate::plan::Template;
use crate::profile::Namespace;

/// Free namespaces kept per template (a sequential client needs two: the running command
/// holds one, the worker built ahead another).
const MAX_FREE_PER_TEMPLATE: usize = 4;
/// Free namespaces kept over all templates.
const MAX_FREE: usize = 16;

/// Whether commands of `template` may run in a reused network namespace (module docs).
pub fn reusable(template: &Template) -> bool {
    let plan = &template.sandbox;
    plan.namespaces.contains(&Namespace::Net) && super::unprivileged(plan)
}

/// The fork server's free namespaces, and the socket helpers give them back on.
pub struct Pool {
    free: Vec<Free>,
    /// Our end: returned namespaces arrive here.
    returns: OwnedFd,
    /// The helpers' end (each helper with a lease holds a copy).
    helpers: OwnedFd,
}

struct Free {
    template: Vec<u8>,
    ns: OwnedFd,
    since: Instant,
}

impl Pool {
    pub fn new(max_message: usize) -> io::Result<Self> {
        let (returns, helpers) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )?;
        // A message carries the template: room for a few of the largest.
        let _ = setsockopt(&helpers, sockopt::SndBuf, &(max_message * 2));
        Ok(Self {
            free: Vec::new(),
            returns,
            helpers,
        })
    }

    /// What to poll for returned namespaces.
    pub fn returns(&self) -> BorrowedFd<'_> {
        self.returns.as_fd()
    }

    /// A lease for a worker of `template` about to be forked: a free namespace of the
    /// template if there is one (the worker's init enters it), else none (init makes one and
    /// the helper gives that back). `None` where the template may not reuse namespaces.
    pub fn lease(&mut self, template: &[u8], parsed: &Template) -> Option<Lease> {
        if !reusable(parsed) {
            return None;
        }
        let back = self.helpers.try_clone().ok()?;
        let ns = self
            .free
            .iter()
            .rposition(|f| f.template == template)
            .map(|at| self.free.remove(at).ns);
        Some(Lease {
            ns,
            back,
            template: template.to_vec(),
        })
    }

    /// Take one returned namespace (the template in the message, the namespace with it).
    pub fn receive(&mut self, buf: &mut [u8]) {
        let Ok(Some((bytes, mut fds))) = super::receive_fds(&self.returns, buf) else {
            return;
        };
        let (Some(ns), true) = (fds.pop(), fds.is_empty()) else {
            return;
        };
        let template = &buf[..bytes];
        if self.free.iter().filter(|f| f.template == template).count() >= MAX_FREE_PER_TEMPLATE {
            return;
        }
        if self.free.len() >= MAX_FREE {
            // The least recently returned goes.
            self.free.remove(0);
        }
        self.free.push(Free {
            template: template.to_vec(),
            ns,
            since: Instant::now(),
        });
    }

    /// Close namespaces unused for `idle_for`; how long until the next one is.
    pub fn expire(&mut self, idle_for: Duration) -> Option<Duration> {
        self.free.retain(|f| f.since.elapsed() < idle_for);
        self.free
            .iter()
            .map(|f| idle_for.saturating_sub(f.since.elapsed()))
            .min()
    }

    /// Close every free namespace (the clients file was reloaded: templates may have changed
    /// owner).
    pub fn clear(&mut self) {
        self.free.clear();
    }
}

/// A worker's network namespace while its command runs, and the way back to the pool.
pub struct Lease {
    /// The namespace: from the pool, or the one init made (after [`Lease::adopt`]).
    ns: Option<OwnedFd>,
    back: OwnedFd,
    template: Vec<u8>,
}

impl Lease {
    /// Descriptors a forked worker must keep open.
    pub fn fds(&self) -> Vec<RawFd> {
        let mut fds = vec![self.back.as_raw_fd()];
        fds.extend(self.ns.as_ref().map(AsRawFd::as_raw_fd));
        fds
    }

    /// In the worker's child (init): the namespace to enter instead of making one. Dropping
    /// the lease closes the way back: nothing of the command may hold it.
    pub fn into_namespace(self) -> Option<OwnedFd> {
        self.ns
    }

    /// In the helper, once init is ready: a namespace init made is the one to give back.
    pub fn adopt(&mut self, init: Pid) {
        if self.ns.is_none() {
            self.ns = std::fs::File::open(format!("/proc/{init}/ns/net"))
                .ok()
                .map(OwnedFd::from);
        }
    }

    /// The helper's last act, once every process of the command is reaped: enter the
    /// namespace (we exit next), and send it back if nothing is left in it.
    pub fn give_back(self) {
        let Some(ns) = self.ns else {
            return;
        };
        if nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET).is_err() || !settles_empty() {
            return;
        }
        let fds = [ns.as_raw_fd()];
        // Never wait: a fork server too busy to read loses a namespace, nothing else.
        let _ = sendmsg::<()>(
            self.back.as_raw_fd(),
            &[IoSlice::new(&self.template)],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
            None,
        );
    }
}

/// Whether our current network namespace is empty ([`empty_here`]) or becomes so within a few
/// milliseconds: the kernel frees some closed sockets only after an RCU grace period (a
/// netlink socket, which `ip` and glibc's `getaddrinfo` open, always), so a namespace checked
/// right after its command would often be closed for a socket already on its way out. We
/// have reported; this delays only our own exit.
fn settles_empty() -> bool {
    for _ in 0..SETTLE_CHECKS {
        if empty_here() {
            return true;
        }
        std::thread::sleep(SETTLE_STEP);
    }
    empty_here()
}

/// How often, and how far apart, [`settles_empty`] checks again.
const SETTLE_CHECKS: u32 = 5;
const SETTLE_STEP: Duration = Duration::from_millis(2);

/// Whether our current network namespace holds no socket, no TIME_WAIT entry and no IPv6
/// flow label. Anything unreadable counts as not empty.
fn empty_here() -> bool {
    let Ok(sockstat) = std::fs::read_to_string("/proc/thread-self/net/sockstat") else {
        return false;
    };
    let labels = match std::fs::read_to_string("/proc/thread-self/net/ip6_flowlabel") {
        Ok(text) => text.lines().nth(1).is_none(),
        // No IPv6 in this kernel: no flow labels.
        Err(err) => err.kind() == io::ErrorKind::NotFound,
    };
    labels && sockstat_empty(&sockstat)
}

/// `/proc/net/sockstat` says no socket is in use and no TCP socket waits in TIME_WAIT (`used`
/// counts the namespace's own; `tw` too on the kernels we run on, and where a kernel counts
/// the host's instead, a namespace is reused only while the host has none: closed, not open).
fn sockstat_empty(text: &str) -> bool {
    let field = |line: &str, name: &str| -> Option<u64> {
        let mut words = line.split_whitespace();
        words.find(|w| *w == name)?;
        words.next()?.parse().ok()
    };
    let used = text
        .lines()
        .find(|l| l.starts_with("sockets:"))
        .and_then(|l| field(l, "used"));
    let time_wait = text
        .lines()
        .find(|l| l.starts_with("TCP:"))
        .and_then(|l| field(l, "tw"));
    used == Some(0) && time_wait == Some(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FRESH: &str = "sockets: used 0\nTCP: inuse 0 orphan 0 tw 0 alloc 1 mem 114\n\
                         UDP: inuse 0 mem 0\nUDPLITE: inuse 0\nRAW: inuse 0\nFRAG: inuse 0 memory 0\n";

    #[test]
    fn a_fresh_namespaces_sockstat_is_empty() {
        assert!(sockstat_empty(FRESH));
    }

    #[test]
    fn a_socket_or_a_time_wait_entry_is_not_empty() {
        assert!(!sockstat_empty(&FRESH.replace("used 0", "used 1")));
        assert!(!sockstat_empty(&FRESH.replace("tw 0", "tw 3")));
    }

    #[test]
    fn a_sockstat_it_cannot_read_is_not_empty() {
        assert!(!sockstat_empty(""));
        assert!(!sockstat_empty("sockets: used 0\n"));
        assert!(!sockstat_empty(
            "sockets: used x\nTCP: inuse 0 orphan 0 tw 0\n"
        ));
    }

    fn template(f: impl FnOnce(&mut crate::plan::SandboxPlan)) -> Template {
        let mut sandbox = crate::plan::SandboxPlan {
            namespaces: vec![Namespace::Pid, Namespace::Net, Namespace::Mount],
            user: Some((65534, 65534)),
            capabilities: Some(vec![]),
            no_new_privs: true,
            ..Default::default()
        };
        f(&mut sandbox);
        Template {
            cgroups: vec![],
            sandbox,
            layers: vec![],
            missing: vec![],
        }
    }

    #[test]
    fn only_unprivileged_commands_in_a_pid_namespace_reuse_network_namespaces() {
        assert!(reusable(&template(|_| {})));
        assert!(!reusable(&template(|s| s
            .namespaces
            .retain(|n| *n != Namespace::Net))));
        assert!(!reusable(&template(|s| s
            .namespaces
            .retain(|n| *n != Namespace::Pid))));
        assert!(!reusable(&template(|s| s.user = Some((0, 0)))));
        assert!(!reusable(&template(|s| s.user = None)));
        assert!(!reusable(&template(|s| s.capabilities = None)));
        assert!(!reusable(&template(|s| {
            s.capabilities = Some(vec!["CAP_NET_RAW".into()])
        })));
        assert!(!reusable(&template(|s| s.no_new_privs = false)));
    }
}
