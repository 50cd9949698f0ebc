//! What the fork server lends a worker, and the way it comes back.
//!
//! A helper of a pooled template gets a [`Lease`]: the name of the cgroup directories to run
//! in (`cgroup_pool`), and a copy of the socket on which it gives back, as its last act, what
//! is fit to be lent again: one message carrying the template and the cgroup name if its
//! directories are clean. Only the fork server and helpers hold that socket (the payload
//! closes its copy at exec), and the fork server takes a name back only as what the message
//! says it is. (An init gives back on its own control socket: `wire::verdict`.) Here too what
//! makes a loan fit to be lent again, which the helpers check and the fork server's pools
//! rely on: at most [`MAX_CHARGED`] still charged to cgroup directories, and a network
//! namespace that [`settles_empty`].

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::Duration;

use nix::sys::socket::{sendmsg, setsockopt, sockopt, MsgFlags};

/// The socket helpers give back on: the fork server's end, and the end each lease copies.
pub struct Returns {
    ours: OwnedFd,
    helpers: OwnedFd,
}

impl Returns {
    pub fn new(max_template: usize) -> io::Result<Self> {
        let (ours, helpers) = super::seqpacket_pair()?;
        // A message carries the template: room for a few of the largest.
        let _ = setsockopt(&helpers, sockopt::SndBuf, &(max_template * 2));
        Ok(Self { ours, helpers })
    }

    /// What to poll and receive from.
    pub fn socket(&self) -> &OwnedFd {
        &self.ours
    }

    /// A lease for a helper of `template`, with the cgroup name the pool lends it.
    pub fn lease(&self, template: &[u8], cgroup: Option<CgroupName>) -> Option<Lease> {
        cgroup.as_ref()?;
        Some(Lease {
            back: self.helpers.try_clone().ok()?,
            template: template.to_vec(),
            cgroup,
        })
    }
}

/// The most memory still charged to directories that are lent again.
pub const MAX_CHARGED: u64 = 8 << 20;

/// The name of a worker's cgroup directories (the same in every hierarchy), as the fork
/// server gave it.
#[derive(Debug, Clone, PartialEq)]
pub struct CgroupName {
    pub name: String,
    /// They exist already, set for this template by a worker before (else: make them).
    pub existing: bool,
}

/// A helper's loans while its command runs, and the way back.
pub struct Lease {
    back: OwnedFd,
    template: Vec<u8>,
    pub cgroup: Option<CgroupName>,
}

impl Lease {
    /// Descriptors a forked helper must keep open.
    pub fn fds(&self) -> Vec<RawFd> {
        vec![self.back.as_raw_fd()]
    }

    /// The helper's last act, once every process of the command is reaped: give back the
    /// cgroup directories when `cgroups_clean`.
    pub fn give_back(self, cgroups_clean: bool) {
        let Some(name) = self.cgroup.as_ref().filter(|_| cgroups_clean) else {
            return;
        };
        let Ok(len) = u8::try_from(name.name.len()) else {
            return;
        };
        // Never wait: a fork server too busy to read loses what it lent, nothing else.
        let _ = sendmsg::<()>(
            self.back.as_raw_fd(),
            &[
                IoSlice::new(&[len]),
                IoSlice::new(name.name.as_bytes()),
                IoSlice::new(&self.template),
            ],
            &[],
            MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
            None,
        );
    }
}

/// A message of [`Lease::give_back`]: the cgroup name given back (if any) and the template.
pub fn parse_returned(message: &[u8]) -> Option<(Option<&str>, &[u8])> {
    let (&len, rest) = message.split_first()?;
    let (name, template) = rest.split_at_checked(usize::from(len))?;
    let name = std::str::from_utf8(name).ok()?;
    Some(((!name.is_empty()).then_some(name), template))
}

/// Whether our current network namespace is empty ([`empty_here`]) or becomes so within a few
/// milliseconds: the kernel frees some closed sockets only after an RCU grace period (a
/// netlink socket, which `ip` and glibc's `getaddrinfo` open, always), so a namespace checked
/// right after its command would often be closed for a socket already on its way out. We
/// have reported; this delays only our own exit.
pub fn settles_empty() -> bool {
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

    #[test]
    fn a_returned_message_names_its_cgroup_and_its_template() {
        assert_eq!(
            parse_returned(b"\x03c-7{\"t\":1}"),
            Some((Some("c-7"), &b"{\"t\":1}"[..]))
        );
        assert_eq!(parse_returned(b"\x00{}"), Some((None, &b"{}"[..])));
        assert_eq!(parse_returned(b"\x09c-7"), None);
        assert_eq!(parse_returned(b""), None);
    }
}
