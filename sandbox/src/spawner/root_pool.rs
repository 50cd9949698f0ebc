//! Sandbox roots built once per template and copied for each command.
//!
//! strict's root is about forty mounts (read-only binds of system directories, the workspace,
//! covers over daemon files, a minimal /dev) made in every command's mount namespace, and
//! taken down again when it ends: most of its init's CPU. All of it is the same for every
//! command of a template but three mounts, the tmpfs `/tmp` and `/dev/shm` and a fresh
//! `/proc`, and what the plan puts inside them (`apply::mounts` says which). So the fork
//! server has a process of its own build that shared part once, in a mount namespace it then
//! keeps open; each worker's init enters it and makes a copy (`unshare(CLONE_NEWNS)`, which
//! copies the mount tree without a path lookup or a mount call), and mounts only its own part
//! into the copy.
//!
//! - **Who gets one**: templates whose commands run as a uid other than 0 with no capability
//!   and no_new_privs, in a pid namespace, under a root of their own (an empty tmpfs). What
//!   the copies share with each other are the template's tmpfs mounts (the root, `/dev`, the
//!   covers), owned by root and, but for `/dev`, read-only: such a command can write none of
//!   them, so nothing one leaves there meets the next. Everything writable (`/tmp`,
//!   `/dev/shm`) is made per command, as before; the workspace and other host directories
//!   are the host's own in either case.
//! - **When it is stale**: a bind shows the host inode it was made on, and a cover hides the
//!   file that was there. So before each loan the fork server looks at every path the plan
//!   binds, covers or pins (`lstat`: device, inode, type, or absent) and compares with what it
//!   saw when the template was built: a path replaced, created or removed since (a workspace
//!   made anew, a daemon file written by rename) makes it build the template again. That a
//!   path changes while a command runs (a replaced file uncovered in its namespace too) is as
//!   it was without templates.
//! - **How long**: a template unused for 60 s is closed, at most [`MAX_ROOTS`] are kept, and a
//!   reload of the clients file closes all of them (templates name clients as they were).
//!
//! A one-shot `executor run` builds none (there is no next command).

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sched::CloneFlags;
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

use crate::apply::mounts;
use crate::plan::{MountPlan, Template};
use crate::profile::Namespace;
use crate::sys::{self, Forked};

/// Templates kept at once (each a mount namespace of about forty mounts).
const MAX_ROOTS: usize = 16;
/// How long the fork server waits for a template to be built (it takes about a millisecond).
const BUILD_TIMEOUT_MS: u16 = 2000;

/// Whether commands of `template` may run in a copy of a shared root (module docs).
pub fn eligible(template: &Template) -> bool {
    let plan = &template.sandbox;
    plan.namespaces.contains(&Namespace::Mount)
        && plan.mounts.as_ref().is_some_and(mounts::splits)
        && super::unprivileged(plan)
}

/// What a host path was when a template was built: device, inode and file type, or absent.
type Seen = Option<(u64, u64, u32)>;

struct Root {
    template: Vec<u8>,
    /// The template's mount namespace.
    ns: OwnedFd,
    /// Every path the plan binds, covers or pins, as it was.
    seen: Vec<Seen>,
    since: Instant,
}

/// The fork server's templates.
#[derive(Default)]
pub struct Roots {
    roots: Vec<Root>,
    /// Templates whose shared root could not be built, with what the host was then: not
    /// tried again (a fork and a build per worker) until the host changes.
    failed: Vec<(Vec<u8>, Vec<Seen>)>,
}

impl Roots {
    /// The mount namespace of `template`'s shared root for a worker about to be forked,
    /// built now if there is none or the host changed under it; `None` where the template
    /// is not eligible or the build failed (the worker then builds its whole root).
    pub fn lease(&mut self, template: &[u8], parsed: &Template) -> Option<OwnedFd> {
        if !eligible(parsed) {
            return None;
        }
        let plan = parsed.sandbox.mounts.as_ref()?;
        let seen = look_at(plan);
        if let Some(at) = self.roots.iter().position(|r| r.template == template) {
            if self.roots[at].seen == seen {
                let root = &mut self.roots[at];
                root.since = Instant::now();
                return root.ns.try_clone().ok();
            }
            self.roots.remove(at);
        }
        if self.failed.iter().any(|(t, s)| t == template && *s == seen) {
            return None;
        }
        let Ok(ns) = build(plan) else {
            if self.failed.len() >= MAX_ROOTS {
                self.failed.remove(0);
            }
            self.failed.push((template.to_vec(), seen));
            return None;
        };
        if self.roots.len() >= MAX_ROOTS {
            // The least recently used goes.
            if let Some(oldest) = (0..self.roots.len()).min_by_key(|i| self.roots[*i].since) {
                self.roots.remove(oldest);
            }
        }
        let lent = ns.try_clone().ok();
        self.roots.push(Root {
            template: template.to_vec(),
            ns,
            seen,
            since: Instant::now(),
        });
        lent
    }

    /// Close templates unused for `idle_for`; how long until the next one is.
    pub fn expire(&mut self, idle_for: Duration) -> Option<Duration> {
        super::expire_idle(&mut self.roots, idle_for, |r| r.since, |_| {})
    }

    /// Close every template (the clients file was reloaded).
    pub fn clear(&mut self) {
        self.roots.clear();
        self.failed.clear();
    }
}

/// [`Seen`] of every host path `plan` binds, covers or pins, in plan order.
fn look_at(plan: &MountPlan) -> Vec<Seen> {
    use std::os::unix::fs::MetadataExt;
    let paths: Vec<&PathBuf> = plan
        .read_only
        .iter()
        .chain(&plan.writable)
        .chain(&plan.hidden)
        .chain(&plan.pins)
        .collect();
    paths
        .into_iter()
        .map(|p| {
            std::fs::symlink_metadata(p)
                .ok()
                .map(|m| (m.dev(), m.ino(), m.mode() & libc::S_IFMT))
        })
        .collect()
}

/// Build `plan`'s shared root in a process of its own, in a new mount namespace, and return
/// that namespace. The process exits once it has handed the namespace over.
fn build(plan: &MountPlan) -> io::Result<OwnedFd> {
    let (ours, theirs) = super::seqpacket_pair()?;
    match sys::fork()? {
        Forked::Child => {
            drop(ours);
            sys::close_fds_above_stderr_except(&[theirs.as_raw_fd()]);
            let built = nix::sched::unshare(CloneFlags::CLONE_NEWNS)
                .map_err(io::Error::from)
                .and_then(|()| std::fs::File::open("/proc/self/ns/mnt"))
                .and_then(|ns| {
                    mounts::build_template(plan).map_err(io::Error::other)?;
                    Ok(ns)
                });
            if let Ok(ns) = built {
                let fds = [ns.as_raw_fd()];
                let _ = sendmsg::<()>(
                    theirs.as_raw_fd(),
                    &[IoSlice::new(b"root")],
                    &[ControlMessage::ScmRights(&fds)],
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                );
            }
            sys::exit_child(0)
        }
        Forked::Parent(_) => {
            drop(theirs);
            // Reaped by the fork server with its other children (`spawner::reap`).
            let mut fds = [PollFd::new(ours.as_fd(), PollFlags::POLLIN)];
            if poll(&mut fds, PollTimeout::from(BUILD_TIMEOUT_MS))? == 0 {
                return Err(io::Error::other("the root template was not built in time"));
            }
            receive_one(&ours)
        }
    }
}

/// The one descriptor of the builder's message.
fn receive_one(sock: &OwnedFd) -> io::Result<OwnedFd> {
    let mut buf = [0u8; 8];
    let mut iov = [IoSliceMut::new(&mut buf)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    for cmsg in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = cmsg {
            let mut fds: Vec<OwnedFd> = raw.into_iter().map(sys::own_received_fd).collect();
            if let (Some(fd), true) = (fds.pop(), fds.is_empty()) {
                return Ok(fd);
            }
        }
    }
    Err(io::Error::other("the root template's builder failed"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::RootMode;

    fn template(f: impl FnOnce(&mut crate::plan::SandboxPlan)) -> Template {
        super::super::unprivileged_template(vec![Namespace::Pid, Namespace::Mount], |s| {
            s.mounts = Some(MountPlan {
                root: RootMode::Empty,
                read_only: vec!["/usr".into()],
                writable: vec![],
                hidden: vec![],
                pins: vec![],
                tmpfs: vec![("/tmp".into(), 1 << 20)],
                files: vec![],
            });
            f(s)
        })
    }

    #[test]
    fn only_unprivileged_commands_with_a_root_of_their_own_share_a_template() {
        assert!(eligible(&template(|_| {})));
        assert!(!eligible(&template(|s| s
            .namespaces
            .retain(|n| *n != Namespace::Mount))));
        assert!(!eligible(&template(|s| {
            if let Some(m) = &mut s.mounts {
                m.root = RootMode::Host;
            }
        })));
        // The identity's part is `unprivileged`'s (tested in the module above).
        assert!(!eligible(&template(|s| s.user = Some((0, 0)))));
    }

    #[test]
    fn a_path_replaced_created_or_removed_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        let plan = MountPlan {
            root: RootMode::Empty,
            read_only: vec![dir.path().into()],
            writable: vec![],
            hidden: vec![file.clone()],
            pins: vec![],
            tmpfs: vec![],
            files: vec![],
        };
        let absent = look_at(&plan);
        assert_eq!(absent, look_at(&plan));
        std::fs::write(&file, "a").unwrap();
        let created = look_at(&plan);
        assert_ne!(created, absent);
        // Written in place: the same file.
        std::fs::write(&file, "b").unwrap();
        assert_eq!(look_at(&plan), created);
        // Replaced by rename: another inode.
        let other = dir.path().join("token.new");
        std::fs::write(&other, "c").unwrap();
        std::fs::rename(&other, &file).unwrap();
        assert_ne!(look_at(&plan), created);
    }
}
