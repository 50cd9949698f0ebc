//! Private workspaces and homes: one per client, or scratch per session, under one root in the
//! state directory (which every profile that shows the host's root covers, and landlock never
//! opens but for the client's own).
//! Removing one is `removal.rs`; a client with a disk quota has its files on a volume of its
//! own (`volumes.rs`).

pub mod volumes;

pub use sandbox::removal::remove;
pub use volumes::{VolumeError, Volumes};

use crate::clients::{Client, WorkspacePolicy};
use crate::disk_quota::DiskQuota;

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use anyhow::Context;

#[derive(Debug)]
pub struct Workspaces {
    root: PathBuf,
    /// Owner of new workspaces (the identity the default profile runs commands as).
    owner: Option<(u32, u32)>,
    /// Held while a directory is made and handed to its owner, so that a concurrent command
    /// never finds it half made (still root's).
    creating: std::sync::Mutex<()>,
    /// Disk quotas: the volumes of clients that have one.
    pub volumes: Volumes,
}

impl Workspaces {
    pub fn new(root: PathBuf, owner: Option<(u32, u32)>, volumes: Volumes) -> Self {
        Self {
            root,
            owner,
            creating: std::sync::Mutex::new(()),
            volumes,
        }
    }

    /// The disk quota of a client's files: its entry's, else the daemon's; clients sharing the
    /// workspace share the shared volume, of the daemon's quota.
    pub fn quota_of(&self, client: &Client) -> Option<DiskQuota> {
        match client.workspace {
            WorkspacePolicy::Shared => self.volumes.default,
            _ => client.limits.disk_quota.or(self.volumes.default),
        }
    }

    /// The volume holding a client's files (its name), when it has a quota.
    fn volume_of(&self, client: &Client) -> Option<String> {
        self.quota_of(client).map(|_| match client.workspace {
            WorkspacePolicy::Shared => volumes::SHARED.to_string(),
            _ => client.name.clone(),
        })
    }

    /// Mount the volume of a client with a quota (made on its first command); where it is
    /// mounted, or `None` when the client has no quota. Before anything is made in it.
    pub fn mount_volume(&self, client: &Client) -> Result<Option<PathBuf>, VolumeError> {
        match (self.volume_of(client), self.quota_of(client)) {
            (Some(name), Some(quota)) => self.volumes.mount(&name, quota).map(Some),
            _ => Ok(None),
        }
    }

    /// A client's disk quota as its hello states it. Asks for the probe (once) when the
    /// client has a quota and none was made yet.
    pub fn disk_quota_info(&self, client: &Client) -> protocol::DiskQuotaInfo {
        let none = |reason: String| protocol::DiskQuotaInfo {
            mechanism: "none".into(),
            reason,
            ..Default::default()
        };
        let Some(quota) = self.quota_of(client) else {
            return none(
                "no disk quota is set for this client (--disk-quota-bytes, or the clients file's disk_quota_bytes)"
                    .into(),
            );
        };
        if let Err(why) = self.volumes.probe() {
            return none(format!(
                "a disk quota is set ({} bytes) but cannot be had here, so this client's commands are refused: {why}",
                quota.bytes
            ));
        }
        let mut covers = vec!["home".to_string(), "tmp".to_string()];
        let mut reason = String::new();
        if client.workspace == WorkspacePolicy::Shared && !self.volumes.shared_workspace {
            reason = "the shared workspace is under no quota: --workspace names the operator's tree (or its volume could not be made at start: see the daemon's log)".into();
        } else {
            covers.insert(0, "workspace".into());
        }
        protocol::DiskQuotaInfo {
            mechanism: volumes::MECHANISM.into(),
            bytes: Some(quota.bytes),
            files: Some(quota.files),
            covers,
            reason,
        }
    }

    /// A client's own workspace (policy `per_client`).
    pub fn workspace_of(&self, client: &Client) -> PathBuf {
        match self.volume_of(client) {
            Some(volume) => self.volumes.mount_point(&volume).join("workspace"),
            None => self.of_client(&client.name),
        }
    }

    /// A client's home (on its volume when it has a quota).
    pub fn home_of_client(&self, client: &Client) -> PathBuf {
        match self.volume_of(client) {
            Some(volume) => self
                .volumes
                .mount_point(&volume)
                .join("home")
                .join(&client.name),
            None => self.home_of(&client.name),
        }
    }

    /// Where a client's sessions' scratch directories go (policy `per_connection`).
    pub fn scratch_root_of(&self, client: &Client) -> PathBuf {
        match self.volume_of(client) {
            Some(volume) => self.volumes.mount_point(&volume).join(volumes::SCRATCH),
            None => self.scratch_root(),
        }
    }

    /// Where every private workspace lives.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A client's workspace without a quota (with one: [`Self::workspace_of`], on its volume).
    fn of_client(&self, name: &str) -> PathBuf {
        self.root.join("client").join(name)
    }

    /// A client's home directory (`HOME` in profiles that use `{home}`): private to the
    /// client, so no other client can plant configuration its programs read (`.gitconfig`,
    /// Python's user site-packages). Without a quota; with one: [`Self::home_of_client`].
    fn home_of(&self, name: &str) -> PathBuf {
        self.root.join("home").join(name)
    }

    /// Where sessions' scratch directories go (each named by its session id), for clients
    /// without a quota; with one: [`Self::scratch_root_of`].
    fn scratch_root(&self) -> PathBuf {
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

    /// Who owns a directory made for a client: its own identity when it has one, else the
    /// default profile's; nobody (the daemon's user) when the daemon is not root.
    pub fn owner_for(&self, identity: Option<(u32, u32)>) -> Option<(u32, u32)> {
        self.owner.map(|default| identity.unwrap_or(default))
    }

    /// Create `dir` (a client's workspace or home, a session's scratch) if it is missing,
    /// owned by `owner` (see [`Self::owner_for`]) and closed to everyone else. One that exists
    /// must belong to `owner` already: its commands could not write it otherwise (a client's
    /// uid changed in the clients file, say), and the daemon does not chown trees a command
    /// wrote.
    pub fn ensure(&self, dir: &Path, owner: Option<(u32, u32)>) -> anyhow::Result<()> {
        use std::os::unix::fs::MetadataExt;
        let _creating = self
            .creating
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Ok(meta) = std::fs::symlink_metadata(dir) {
            if !meta.is_dir() {
                anyhow::bail!("{} is not a directory", dir.display());
            }
            if let Some((uid, _)) = owner {
                if meta.uid() != uid {
                    anyhow::bail!(
                        "{} belongs to uid {}, but this client's commands run as uid {uid}; \
                         chown -R {uid}:{uid} it (or remove it)",
                        dir.display(),
                        meta.uid()
                    );
                }
            }
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
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {
                anyhow::bail!("{} appeared while it was being made", dir.display())
            }
            Err(err) => {
                return Err(err).with_context(|| format!("cannot create {}", dir.display()))
            }
        }
        if let Some((uid, gid)) = owner {
            nix::unistd::chown(
                dir,
                Some(nix::unistd::Uid::from_raw(uid)),
                Some(nix::unistd::Gid::from_raw(gid)),
            )
            .with_context(|| format!("cannot hand {} to uid {uid}", dir.display()))?;
        }
        Ok(())
    }
}
