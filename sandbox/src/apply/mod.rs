//! Applying a [`SandboxPlan`]. Two entry points, called by the helper in its child processes:
//!
//! - [`enter_namespaces`]: in the sandbox's init (pid 1 of a new pid namespace): the remaining
//!   namespaces, the new root, hostname and loopback. Process-wide, done once per command.
//! - [`confine_process`]: in the payload right before exec: rlimits, landlock's rules (made
//!   while every path can still be opened), capabilities, identity, no_new_privs, landlock in
//!   force, seccomp, in that order (each step needs the privileges the next one removes;
//!   seccomp goes last so it never blocks our own setup).
//!
//! Every step fails closed: an error aborts the command with the step's name.

pub mod landlock;
pub mod mounts;
pub mod seccomp;

use std::os::fd::OwnedFd;
use std::str::FromStr;

use caps::{CapSet, Capability, CapsHashSet};
use nix::sched::CloneFlags;
use nix::sys::resource::{getrlimit, setrlimit, Resource};
use nix::unistd::{Gid, Uid};

use crate::plan::{RlimitKind, SandboxPlan};
use crate::profile::Namespace;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("cannot create namespaces {flags}: {source}")]
    Namespaces {
        flags: String,
        #[source]
        source: nix::errno::Errno,
    },
    #[error(transparent)]
    Mounts(#[from] mounts::MountError),
    #[error("cannot set the hostname: {0}")]
    Hostname(#[source] nix::errno::Errno),
    #[error("cannot bring up loopback: {0}")]
    Loopback(#[source] std::io::Error),
    #[error("cannot set {kind:?} limit: {source}")]
    Rlimit {
        kind: RlimitKind,
        #[source]
        source: nix::errno::Errno,
    },
    #[error("cannot switch to uid {uid} gid {gid}: {source}")]
    Identity {
        uid: u32,
        gid: u32,
        #[source]
        source: nix::errno::Errno,
    },
    #[error("cannot drop capabilities: {0}")]
    Capabilities(String),
    #[error("cannot set no_new_privs: {0}")]
    NoNewPrivs(#[source] nix::errno::Errno),
    #[error(transparent)]
    Landlock(#[from] landlock::LandlockError),
    #[error(transparent)]
    Seccomp(#[from] seccomp::SeccompError),
}

impl SandboxError {
    /// The layer that failed, as named in results and errors.
    pub fn layer(&self) -> &'static str {
        match self {
            Self::Namespaces { .. } => "namespaces",
            Self::Mounts(_) => "pivot_root",
            Self::Hostname(_) => "uts_ns",
            Self::Loopback(_) => "net_ns",
            Self::Rlimit { .. } => "rlimits",
            Self::Identity { .. } => "uid",
            Self::Capabilities(_) => "caps",
            Self::NoNewPrivs(_) => "no_new_privs",
            Self::Landlock(_) => "landlock",
            Self::Seccomp(_) => "seccomp",
        }
    }
}

/// Flags for every namespace of the plan except pid, which the helper creates before forking
/// init (a new pid namespace applies to children only).
pub fn namespace_flags(namespaces: &[Namespace]) -> CloneFlags {
    namespaces.iter().fold(CloneFlags::empty(), |flags, ns| {
        flags
            | match ns {
                Namespace::Mount => CloneFlags::CLONE_NEWNS,
                Namespace::Pid => CloneFlags::empty(),
                Namespace::Net => CloneFlags::CLONE_NEWNET,
                Namespace::Ipc => CloneFlags::CLONE_NEWIPC,
                Namespace::Uts => CloneFlags::CLONE_NEWUTS,
                Namespace::Cgroup => CloneFlags::CLONE_NEWCGROUP,
            }
    })
}

/// In the sandbox's init: unshare the other namespaces, build the root, name the host, bring
/// up loopback. The cgroup namespace is created here, after the helper placed us in the
/// command's cgroup, so that cgroup becomes the root of what the command can see. `net`: a
/// network namespace reused from an earlier command of the same template, entered instead of
/// a new one (its loopback is up already; `spawner::net_pool` says when that is allowed).
/// `root`: the mount namespace of the template's shared root (`spawner::root_pool`): entered
/// and copied, and only the command's own part of the root mounted into the copy.
pub fn enter_namespaces(
    plan: &SandboxPlan,
    net: Option<&OwnedFd>,
    root: Option<&OwnedFd>,
) -> Result<(), SandboxError> {
    let mut flags = namespace_flags(&plan.namespaces);
    if let Some(net) = net.filter(|_| flags.contains(CloneFlags::CLONE_NEWNET)) {
        nix::sched::setns(net, CloneFlags::CLONE_NEWNET).map_err(|source| {
            SandboxError::Namespaces {
                flags: "reused CLONE_NEWNET".into(),
                source,
            }
        })?;
        flags.remove(CloneFlags::CLONE_NEWNET);
    }
    // With a template: what the command's own part binds from the host is taken now, while
    // the host's tree is ours (a workspace under /tmp); then into the template, whose copy the
    // unshare below makes ours. Where that cannot be taken (open_tree before Linux 5.2), the
    // whole root is built as without a template.
    let finish = match (root, &plan.mounts) {
        (Some(root), Some(mounts)) if flags.contains(CloneFlags::CLONE_NEWNS) => {
            match mounts::prepare_finish(mounts) {
                Ok(sources) => {
                    nix::sched::setns(root, CloneFlags::CLONE_NEWNS).map_err(|source| {
                        SandboxError::Namespaces {
                            flags: "root template CLONE_NEWNS".into(),
                            source,
                        }
                    })?;
                    Some(sources)
                }
                Err(_) => None,
            }
        }
        _ => None,
    };
    nix::sched::unshare(flags).map_err(|source| SandboxError::Namespaces {
        flags: format!("{flags:?}"),
        source,
    })?;
    match (&plan.mounts, finish) {
        (Some(mounts), Some(sources)) => mounts::finish_root(mounts, sources)?,
        (Some(mounts), None) => mounts::build_root(mounts)?,
        (None, _) => {}
    }
    if let Some(name) = &plan.hostname {
        nix::unistd::sethostname(name).map_err(SandboxError::Hostname)?;
    }
    if plan.namespaces.contains(&Namespace::Net) && net.is_none() {
        crate::sys::loopback_up().map_err(SandboxError::Loopback)?;
    }
    Ok(())
}

/// In the payload, right before exec: everything that restricts this one process tree.
pub fn confine_process(plan: &SandboxPlan) -> Result<(), SandboxError> {
    // 1. Resource limits, while we may still raise them.
    for limit in &plan.rlimits {
        let resource = match limit.kind {
            RlimitKind::Core => Resource::RLIMIT_CORE,
            RlimitKind::Nofile => Resource::RLIMIT_NOFILE,
            RlimitKind::Fsize => Resource::RLIMIT_FSIZE,
            RlimitKind::Cpu => Resource::RLIMIT_CPU,
            RlimitKind::Nproc => Resource::RLIMIT_NPROC,
            RlimitKind::As => Resource::RLIMIT_AS,
        };
        // A limit is a ceiling: where the host already set a lower hard one (a container's
        // --ulimit), that one stays; raising it would need CAP_SYS_RESOURCE and loosen it.
        let value = match getrlimit(resource) {
            Ok((_, hard)) if hard < limit.value => hard,
            _ => limit.value,
        };
        setrlimit(resource, value, value).map_err(|source| SandboxError::Rlimit {
            kind: limit.kind,
            source,
        })?;
    }

    // 2. Landlock's rules are made now, while we may still open every path they name (the
    //    command's uid may not be able to reach its own workspace's parent); they take effect
    //    in step 6.
    let landlock = plan.landlock.as_ref().map(landlock::prepare).transpose()?;

    // 3. Capabilities out of the bounding, inheritable and ambient sets (this needs
    //    CAP_SETPCAP, so before the identity switch drops it).
    let keep = match &plan.capabilities {
        Some(names) => Some(parse_caps(names)?),
        None => None,
    };
    let bounding_shrunk = can_shrink_bounding();
    if let Some(keep) = &keep {
        drop_unkept(keep)?;
    }

    // 4. Identity. Leaving uid 0 clears the permitted and effective sets (capabilities(7)).
    if let Some((uid, gid)) = plan.user {
        let identity_err = |source| SandboxError::Identity { uid, gid, source };
        let (u, g) = (Uid::from_raw(uid), Gid::from_raw(gid));
        nix::unistd::setgroups(&[g]).map_err(identity_err)?;
        nix::unistd::setresgid(g, g, g).map_err(identity_err)?;
        nix::unistd::setresuid(u, u, u).map_err(identity_err)?;
    }
    if let Some(keep) = &keep {
        // Staying root: cut the sets we run with to the kept ones too, then check.
        for set in [CapSet::Effective, CapSet::Permitted] {
            let have =
                caps::read(None, set).map_err(|e| SandboxError::Capabilities(e.to_string()))?;
            if !have.is_subset(keep) {
                let want: CapsHashSet = have.intersection(keep).copied().collect();
                caps::set(None, set, &want)
                    .map_err(|e| SandboxError::Capabilities(e.to_string()))?;
            }
        }
        verify_caps(keep, bounding_shrunk)?;
    }

    // 5. no_new_privs: setuid binaries and file capabilities can no longer raise privileges
    //    (and landlock and seccomp may be installed without CAP_SYS_ADMIN).
    if plan.no_new_privs {
        nix::sys::prctl::set_no_new_privs().map_err(SandboxError::NoNewPrivs)?;
    }

    // 6. Landlock: filesystem, TCP and scope rules.
    if let Some(prepared) = landlock {
        landlock::enforce(prepared)?;
    }

    // 7. seccomp, last: from here on even our own setup syscalls would be filtered.
    if plan.seccomp {
        seccomp::install(seccomp::Extra {
            deny_inet: plan.deny_inet,
            deny_sysv_ipc: plan.deny_sysv_ipc,
            own_process_only: plan.own_process_only,
        })?;
    }
    Ok(())
}

fn parse_caps(names: &[String]) -> Result<CapsHashSet, SandboxError> {
    names
        .iter()
        .map(|n| {
            Capability::from_str(n)
                .map_err(|_| SandboxError::Capabilities(format!("unknown capability {n}")))
        })
        .collect()
}

/// Whether we may change the bounding set (it takes CAP_SETPCAP). A daemon running as an
/// ordinary user has no capability to drop: its bounding set stays full but unreachable, since
/// no_new_privs stops setuid binaries and file capabilities from ever granting any.
fn can_shrink_bounding() -> bool {
    caps::has_cap(None, CapSet::Effective, Capability::CAP_SETPCAP).unwrap_or(false)
}

fn drop_unkept(keep: &CapsHashSet) -> Result<(), SandboxError> {
    let err = |e: caps::errors::CapsError| SandboxError::Capabilities(e.to_string());
    if can_shrink_bounding() {
        for cap in caps::all() {
            if !keep.contains(&cap) {
                caps::drop(None, CapSet::Bounding, cap).map_err(err)?;
            }
        }
    }
    caps::clear(None, CapSet::Ambient).map_err(err)?;
    let inheritable: CapsHashSet = caps::read(None, CapSet::Inheritable)
        .map_err(err)?
        .intersection(keep)
        .copied()
        .collect();
    caps::set(None, CapSet::Inheritable, &inheritable).map_err(err)
}

/// Fail closed: read the sets back and refuse to go on if any holds more than the plan keeps
/// (the bounding set only where we could shrink it, see [`can_shrink_bounding`]).
fn verify_caps(keep: &CapsHashSet, bounding_shrunk: bool) -> Result<(), SandboxError> {
    if bounding_shrunk {
        let have = caps::read(None, CapSet::Bounding)
            .map_err(|e| SandboxError::Capabilities(e.to_string()))?;
        if !have.is_subset(keep) {
            return Err(SandboxError::Capabilities(format!(
                "the bounding set still holds {:?}",
                have.difference(keep).collect::<Vec<_>>()
            )));
        }
    }
    // Not the ambient set: the kernel keeps it within both the permitted and the inheritable
    // sets (capabilities(7)), both checked here, and reading it costs two prctl calls per
    // capability (the `caps` crate probes which exist first): 82 syscalls a command.
    for set in [CapSet::Effective, CapSet::Permitted, CapSet::Inheritable] {
        let have = caps::read(None, set).map_err(|e| SandboxError::Capabilities(e.to_string()))?;
        if !have.is_subset(keep) {
            return Err(SandboxError::Capabilities(format!(
                "{set:?} still holds {:?}",
                have.difference(keep).collect::<Vec<_>>()
            )));
        }
    }
    Ok(())
}
