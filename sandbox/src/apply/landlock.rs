//! Landlock rules: read and execute beneath the read list, everything beneath the write list,
//! nothing elsewhere; optionally no TCP at all; signals and abstract unix sockets confined to
//! the sandbox's own processes.
//!
//! Two steps, because the command drops its identity in between: [`prepare`] opens every
//! rule's path while the payload still has the daemon's privileges (a path the command's uid
//! cannot reach, such as a workspace inside the daemon's 0711 state directory, must still get
//! its rule: the landlock crate's `path_beneath_rules` silently skips a path it cannot open,
//! and a ruleset missing a write rule would still report "fully enforced"), and [`enforce`]
//! restricts the process once it runs as the command.
//!
//! The plan says which ABI to handle (the kernel's, read at start, up to the newest this daemon
//! knows) and whether TCP and scopes are handled; the planner has already refused a profile
//! whose required rights the kernel lacks, and named the others as missing. Everything asked
//! for here is then a hard requirement: a ruleset the kernel enforces only in part fails.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use landlock::{
    Access, AccessFs, AccessNet, CompatLevel, Compatible, PathBeneath, PathFd, PathFdError,
    Ruleset, RulesetAttr, RulesetCreated, RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};

use crate::plan::LandlockPlan;

#[derive(Debug, thiserror::Error)]
pub enum LandlockError {
    #[error("landlock: {0}")]
    Ruleset(#[from] landlock::RulesetError),
    #[error("landlock rule for {path}: {source}")]
    Rule {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("landlock was only {0:?} by this kernel")]
    NotEnforced(RulesetStatus),
}

/// A ruleset with every rule added, not yet enforced.
pub struct Prepared(RulesetCreated);

/// Create the ruleset and add a rule per path, opening each path now (with the caller's
/// privileges). See [`open_rule_path`] for the paths that may be skipped; any other failure
/// to make a rule fails the layer.
pub fn prepare(plan: &LandlockPlan) -> Result<Prepared, LandlockError> {
    let abi = ABI::from(i32::try_from(plan.abi).unwrap_or(0));
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(AccessFs::from_all(abi))?;
    if plan.scope {
        ruleset = ruleset.scope(Scope::from_all(abi))?;
    }
    if plan.deny_tcp {
        // Handled with no rule allowing any port: every bind and connect is denied.
        ruleset = ruleset.handle_access(AccessNet::from_all(ABI::V4))?;
    }
    let mut created = ruleset.create()?;
    // (paths, rights, whether the daemon must be able to open every one that exists)
    let grants = [
        (&plan.read, AccessFs::from_read(abi), false),
        (&plan.write, AccessFs::from_all(abi), true),
        (&plan.list, AccessFs::ReadDir.into(), false),
    ];
    for (paths, access, required) in grants {
        for path in paths {
            let Some(fd) = open_rule_path(path, required)? else {
                continue;
            };
            // Directory-only rights (listing, creating, removing) cannot be granted on a file.
            let is_dir = nix::sys::stat::fstat(fd.as_fd())
                .map(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR)
                .map_err(|errno| LandlockError::Rule {
                    path: path.clone(),
                    source: errno.into(),
                })?;
            let access = if is_dir {
                access
            } else {
                access & AccessFs::from_file(abi)
            };
            created = created.add_rule(PathBeneath::new(fd, access))?;
        }
    }
    Ok(Prepared(created))
}

/// Restrict the calling process (and what it execs) to the prepared rules. no_new_privs must
/// be set already.
pub fn enforce(prepared: Prepared) -> Result<(), LandlockError> {
    let status = prepared.0.restrict_self()?;
    match status.ruleset {
        RulesetStatus::FullyEnforced => Ok(()),
        other => Err(LandlockError::NotEnforced(other)),
    }
}

/// Open a rule's path. One that does not exist is skipped (profiles list toolchain
/// directories only some hosts have); so is a read-only one the daemon itself may not reach
/// (a daemon of an ordinary user and `/root/.cargo`: its commands, of the same uid, could not
/// read it either, and a missing allow rule only denies). A writable one that exists must be
/// opened: a workspace without its rule would be silently read-only.
fn open_rule_path(path: &Path, required: bool) -> Result<Option<PathFd>, LandlockError> {
    match PathFd::new(path) {
        Ok(fd) => Ok(Some(fd)),
        Err(PathFdError::OpenCall { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound
                || (!required && source.kind() == std::io::ErrorKind::PermissionDenied) =>
        {
            Ok(None)
        }
        Err(PathFdError::OpenCall { source, .. }) => Err(LandlockError::Rule {
            path: path.to_path_buf(),
            source,
        }),
        Err(other) => Err(LandlockError::Rule {
            path: path.to_path_buf(),
            source: std::io::Error::other(other.to_string()),
        }),
    }
}
