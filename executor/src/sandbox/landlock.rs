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
//! The ABI is a hard requirement (V6: filesystem, TCP and scopes): on an older kernel the layer
//! fails and the command is refused, rather than running with part of its policy.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use landlock::{
    Access, AccessFs, AccessNet, CompatLevel, Compatible, PathBeneath, PathFd, PathFdError,
    Ruleset, RulesetAttr, RulesetCreated, RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};

use crate::plan::LandlockPlan;

const TARGET_ABI: ABI = ABI::V6;

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
/// privileges). A path that does not exist is skipped (profiles list toolchain directories
/// only some hosts have); any other failure to open one fails the layer.
pub fn prepare(plan: &LandlockPlan) -> Result<Prepared, LandlockError> {
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(AccessFs::from_all(TARGET_ABI))?
        .scope(Scope::from_all(TARGET_ABI))?;
    if plan.deny_tcp {
        // Handled with no rule allowing any port: every bind and connect is denied.
        ruleset = ruleset.handle_access(AccessNet::from_all(ABI::V4))?;
    }
    let mut created = ruleset.create()?;
    let grants = [
        (&plan.read, AccessFs::from_read(TARGET_ABI)),
        (&plan.write, AccessFs::from_all(TARGET_ABI)),
        (&plan.list, AccessFs::ReadDir.into()),
    ];
    for (paths, access) in grants {
        for path in paths {
            let Some(fd) = open_rule_path(path)? else {
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
                access & AccessFs::from_file(TARGET_ABI)
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

fn open_rule_path(path: &Path) -> Result<Option<PathFd>, LandlockError> {
    match PathFd::new(path) {
        Ok(fd) => Ok(Some(fd)),
        Err(PathFdError::OpenCall { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
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
