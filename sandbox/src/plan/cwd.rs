//! Where a command's working directory may be, for a profile with a root of its own.

use std::path::{Path, PathBuf};

use super::{MountPlan, PlanError};
use crate::profile::Profile;

/// A root of the profile's own holds only what it mounts (and the directories on the way to
/// them): a working directory elsewhere would fail at the command's `chdir` with ENOENT,
/// which says nothing of why (the directory exists on the host). Refused here, saying what the
/// root holds.
pub(super) fn check_in_root(
    profile: &Profile,
    mounts: &MountPlan,
    workspace: &Path,
    cwd: &Path,
) -> Result<(), PlanError> {
    let fixed = ["/proc", "/dev"].map(PathBuf::from);
    let bound = || {
        mounts
            .read_only
            .iter()
            .chain(&mounts.writable)
            .chain(&fixed)
    };
    let tmpfs = || mounts.tmpfs.iter().map(|(path, _)| path);
    // The mount the cwd lies in is the deepest that holds it; a tmpfs starts empty for every
    // command, so only the tmpfs itself (and what another mount puts in it) is there.
    let holder = bound()
        .chain(tmpfs())
        .filter(|m| cwd.starts_with(m))
        .max_by_key(|m| m.components().count());
    let fresh = holder.filter(|m| tmpfs().any(|t| t == *m) && cwd != m.as_path());
    if let Some(tmp) = fresh {
        return Err(PlanError::CwdInFreshTmpfs {
            profile: profile.name.clone(),
            cwd: cwd.to_path_buf(),
            tmpfs: tmp.clone(),
        });
    }
    if holder.is_some() || bound().chain(tmpfs()).any(|m| m.starts_with(cwd)) {
        return Ok(());
    }
    let read_only: Vec<String> = mounts
        .read_only
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    let mut parts = vec![format!(
        "system directories, read-only ({})",
        read_only.join(", ")
    )];
    for path in &mounts.writable {
        if path == workspace {
            parts.push(format!("the workspace {} (writable)", path.display()));
        } else {
            parts.push(format!("{} (writable)", path.display()));
        }
    }
    for (path, _) in &mounts.tmpfs {
        parts.push(format!("{} (private)", path.display()));
    }
    parts.push("/proc and a minimal /dev".into());
    Err(PlanError::CwdNotInRoot {
        profile: profile.name.clone(),
        cwd: cwd.to_path_buf(),
        shown: parts.join(", "),
    })
}
