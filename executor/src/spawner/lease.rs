//! What the fork server lends a worker, and the way it comes back.
//!
//! A helper of a pooled template gets a [`Lease`]: the name of the cgroup directories to run
//! in (`cgroup_pool`), and a copy of the socket on which it gives back, as its last act, what
//! is fit to be lent again: one message carrying the template and the cgroup name if its
//! directories are clean. Only the fork server and helpers hold that socket (the payload
//! closes its copy at exec), and the fork server takes a name back only as what the message
//! says it is. (An init gives back on its own control socket: `helper::verdict`.)

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

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

#[cfg(test)]
mod tests {
    use super::*;

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
