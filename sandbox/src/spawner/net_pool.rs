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
//! The pool lives in the fork server; helpers return namespaces with their lease
//! (`wire::lease`). A daemon's fork server pools; a one-shot `executor run`'s does not
//! (there is no next command), but makes that command's namespace while the run sets up
//! ([`made_ahead`]).

use std::io;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use nix::sched::CloneFlags;

use crate::plan::Template;
use crate::profile::Namespace;

/// Free namespaces kept per template (a sequential client needs two: the running command
/// holds one, the worker built ahead another).
const MAX_FREE_PER_TEMPLATE: usize = 4;
/// Free namespaces kept over all templates.
const MAX_FREE: usize = 16;

/// Whether commands of `template` may run in a reused network namespace (module docs).
/// Never under a network policy (`egress`): the daemon's listeners for one command live in
/// its namespace, and a namespace made for one command's policy is that command's alone.
pub fn reusable(template: &Template) -> bool {
    let plan = &template.sandbox;
    plan.namespaces.contains(&Namespace::Net) && !plan.egress && super::unprivileged(plan)
}

/// The fork server's free namespaces.
#[derive(Default)]
pub struct Pool {
    free: Vec<Free>,
}

struct Free {
    template: Vec<u8>,
    ns: OwnedFd,
    since: Instant,
}

impl Pool {
    /// What a worker of `template` about to be forked is lent: `None` where the template may
    /// not reuse namespaces; else a free namespace of the template if there is one (its init
    /// enters it), or none (init makes one and the helper gives that back).
    pub fn lease(&mut self, template: &[u8], parsed: &Template) -> Option<Option<OwnedFd>> {
        if !reusable(parsed) {
            return None;
        }
        Some(
            self.free
                .iter()
                .rposition(|f| f.template == template)
                .map(|at| self.free.remove(at).ns),
        )
    }

    /// Take back a namespace a helper returned for `template`.
    pub fn receive(&mut self, template: &[u8], ns: OwnedFd) {
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
        super::expire_idle(&mut self.free, idle_for, |f| f.since, |_| {})
    }

    /// Close every free namespace (the clients file was reloaded: templates may have changed
    /// owner).
    pub fn clear(&mut self) {
        self.free.clear();
    }
}

/// A new network namespace with its loopback up, made from the fork server of a one-shot
/// `executor run` while the run is still setting up (about 0.8 ms of the kernel's work that
/// would otherwise come after the run's set-up, in its init), for that run's one command. The
/// server itself stays in its own namespace: it makes the new one, opens it and goes back.
/// `Err` where it may not (no CAP_SYS_ADMIN); init then makes one, as it always could. Never
/// used by anything before the command, so none of the reuse rules above apply.
pub(super) fn made_ahead() -> io::Result<OwnedFd> {
    let ns_file = || std::fs::File::open("/proc/thread-self/ns/net").map(OwnedFd::from);
    let home = ns_file()?;
    nix::sched::unshare(CloneFlags::CLONE_NEWNET)?;
    let made = crate::sys::loopback_up().and_then(|()| ns_file());
    if nix::sched::setns(&home, CloneFlags::CLONE_NEWNET).is_err() {
        // Never serve from a namespace that is not ours.
        crate::sys::exit_child(1);
    }
    made
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(f: impl FnOnce(&mut crate::plan::SandboxPlan)) -> Template {
        super::super::unprivileged_template(
            vec![Namespace::Pid, Namespace::Net, Namespace::Mount],
            f,
        )
    }

    #[test]
    fn only_unprivileged_commands_in_a_pid_namespace_reuse_network_namespaces() {
        assert!(reusable(&template(|_| {})));
        assert!(!reusable(&template(|s| s
            .namespaces
            .retain(|n| *n != Namespace::Net))));
        // The identity's and the pid namespace's part is `unprivileged`'s (tested there).
        assert!(!reusable(&template(|s| s.user = Some((0, 0)))));
        // A namespace under a network policy holds the daemon's listeners for one command.
        assert!(!reusable(&template(|s| s.egress = true)));
    }
}
