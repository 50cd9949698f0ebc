//! What the fork server lends a worker, and the way it comes back.
//!
//! A worker of a pooled template gets a [`Lease`]: the network namespace to run in
//! (`net_pool`), the name of the cgroup directories to run in (`cgroup_pool`), and a copy of
//! the socket on which its helper gives back, as its last act, what is fit to be lent again:
//! one message carrying the template, the cgroup name if its directories are clean, and the
//! network namespace if it is empty. Only the fork server and helpers hold that socket (init
//! drops its copy before anything of the command runs), and the fork server takes a thing
//! back only as what the message says it is.

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use nix::sched::CloneFlags;
use nix::sys::socket::{sendmsg, setsockopt, sockopt, ControlMessage, MsgFlags};
use nix::unistd::Pid;

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

    /// A lease for a worker of `template`, with what the pools lend it.
    pub fn lease(
        &self,
        template: &[u8],
        net: Option<Option<OwnedFd>>,
        cgroup: Option<CgroupName>,
    ) -> Option<Lease> {
        if net.is_none() && cgroup.is_none() {
            return None;
        }
        Some(Lease {
            back: self.helpers.try_clone().ok()?,
            template: template.to_vec(),
            net_pooled: net.is_some(),
            ns: net.flatten(),
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

/// A worker's loans while its command runs, and the way back.
pub struct Lease {
    back: OwnedFd,
    template: Vec<u8>,
    /// Whether the template's network namespaces are pooled.
    net_pooled: bool,
    /// The namespace: from the pool, or the one init made (after [`Lease::adopt`]).
    ns: Option<OwnedFd>,
    pub cgroup: Option<CgroupName>,
}

impl Lease {
    /// Descriptors a forked worker must keep open.
    pub fn fds(&self) -> Vec<RawFd> {
        let mut fds = vec![self.back.as_raw_fd()];
        fds.extend(self.ns.as_ref().map(AsRawFd::as_raw_fd));
        fds
    }

    /// In the worker's child (init): the network namespace to enter instead of making one.
    /// Dropping the lease closes the way back: nothing of the command may hold it.
    pub fn into_namespace(self) -> Option<OwnedFd> {
        self.ns
    }

    /// In the helper, once init is ready: a namespace init made is the one to give back.
    pub fn adopt(&mut self, init: Pid) {
        if self.net_pooled && self.ns.is_none() {
            self.ns = std::fs::File::open(format!("/proc/{init}/ns/net"))
                .ok()
                .map(OwnedFd::from);
        }
    }

    /// The helper's last act, once every process of the command is reaped: give back the
    /// cgroup directories when `cgroups_clean`, and the network namespace if nothing is left
    /// in it (we enter it to look: we exit next).
    pub fn give_back(self, cgroups_clean: bool) {
        let name = self
            .cgroup
            .as_ref()
            .filter(|_| cgroups_clean)
            .map(|c| c.name.as_bytes().to_vec())
            .unwrap_or_default();
        let ns = self.ns.filter(|ns| {
            nix::sched::setns(ns, CloneFlags::CLONE_NEWNET).is_ok()
                && super::net_pool::settles_empty()
        });
        if name.is_empty() && ns.is_none() {
            return;
        }
        let Ok(len) = u8::try_from(name.len()) else {
            return;
        };
        let fds: Vec<RawFd> = ns.iter().map(AsRawFd::as_raw_fd).collect();
        let cmsgs: Vec<ControlMessage<'_>> = if fds.is_empty() {
            Vec::new()
        } else {
            vec![ControlMessage::ScmRights(&fds)]
        };
        // Never wait: a fork server too busy to read loses what it lent, nothing else.
        let _ = sendmsg::<()>(
            self.back.as_raw_fd(),
            &[
                IoSlice::new(&[len]),
                IoSlice::new(&name),
                IoSlice::new(&self.template),
            ],
            &cmsgs,
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
