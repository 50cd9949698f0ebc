//! Private workspaces: one per client, or scratch per session, under one root in the state
//! directory (which every profile that shows the host's root covers, and landlock never opens).
//! Removing one is `removal.rs`.

mod removal;

pub use removal::remove;

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use anyhow::Context;

#[derive(Debug, Clone)]
pub struct Workspaces {
    root: PathBuf,
    /// Owner of new workspaces (the identity the default profile runs commands as).
    owner: Option<(u32, u32)>,
}

impl Workspaces {
    pub fn new(root: PathBuf, owner: Option<(u32, u32)>) -> Self {
        Self { root, owner }
    }

    /// Where every private workspace lives.
    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn of_client(&self, name: &str) -> PathBuf {
        self.root.join("client").join(name)
    }

    /// Where sessions' scratch directories go (each named by its session id).
    pub fn scratch_root(&self) -> PathBuf {
        self.root.join("session")
    }

    /// Where scratch that could not be removed is set aside, out of the way of new sessions.
    fn quarantine_root(&self) -> PathBuf {
        self.root.join("quarantine")
    }

    /// At start: remove the scratch of sessions a previous daemon could not end (it was
    /// killed), and what earlier starts set aside. What cannot be removed is moved into the
    /// quarantine directory and logged; nothing here fails the start.
    pub fn clear_leftovers(&self) {
        let scratch = self.scratch_root();
        if let Err(err) = remove(&scratch) {
            let aside = self.quarantine_root().join(format!(
                "session-{}",
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos())
            ));
            let moved = std::fs::create_dir_all(self.quarantine_root())
                .and_then(|()| std::fs::rename(&scratch, &aside));
            match moved {
                Ok(()) => tracing::error!(
                    %err,
                    quarantined = %aside.display(),
                    "cannot remove the scratch workspaces a previous daemon left; set aside"
                ),
                Err(move_err) => tracing::error!(
                    %err,
                    %move_err,
                    dir = %scratch.display(),
                    "cannot remove or set aside the scratch workspaces a previous daemon left"
                ),
            }
        }
        let quarantine = self.quarantine_root();
        if quarantine.exists() {
            match remove(&quarantine) {
                Ok(()) => {
                    tracing::info!(dir = %quarantine.display(), "removed scratch set aside earlier")
                }
                Err(err) => {
                    tracing::warn!(%err, dir = %quarantine.display(), "scratch set aside earlier is still there")
                }
            }
        }
    }

    /// Create `dir` (a client's or a session's) if it is missing, owned by the commands'
    /// identity and closed to everyone else.
    pub fn ensure(&self, dir: &Path) -> anyhow::Result<()> {
        if dir.is_dir() {
            return Ok(());
        }
        if let Some(parent) = dir.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o711)
                .create(parent)
                .with_context(|| format!("cannot create {}", parent.display()))?;
        }
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => {}
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => return Ok(()),
            Err(err) => {
                return Err(err)
                    .with_context(|| format!("cannot create workspace {}", dir.display()))
            }
        }
        if let Some((uid, gid)) = self.owner {
            nix::unistd::chown(
                dir,
                Some(nix::unistd::Uid::from_raw(uid)),
                Some(nix::unistd::Gid::from_raw(gid)),
            )
            .with_context(|| format!("cannot hand workspace {} to uid {uid}", dir.display()))?;
        }
        Ok(())
    }
}
