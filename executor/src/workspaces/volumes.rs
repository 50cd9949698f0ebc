//! Disk quotas: each client's workspace, home and temporary space on a filesystem of its own,
//! an ext4 image on a loop device, sized in bytes and inodes.
//!
//! Chosen from measurements (ARCHITECTURE.md, "Disk quotas"): the host's filesystem has no
//! project quotas (and this kernel cannot enforce ext4's: no `CONFIG_QFMT_V2`), a tmpfs costs
//! memory, and an image made with `fallocate` is allocated in full when it is made, so a
//! client can never take from the host's disk more than its quota, whatever it writes.
//!
//! An image (`<state>/volumes/<name>.img`) outlives the daemon, as a workspace does; its mount
//! (`<workspaces>/volume/<name>`) does not: the daemon unmounts every volume when it stops
//! (the loop device, attached by mount(8) with autoclear, goes with the last reference), and a
//! start unmounts those a killed daemon left.

use std::collections::BTreeMap;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::disk_quota::{DiskQuota, MIN_BYTES, MIN_FILES};

/// Disk the host keeps free beyond a new image: the daemon's own files (audit log, state)
/// must still fit once a client's image is allocated.
pub const HOST_RESERVE_BYTES: u64 = 256 * 1024 * 1024;

/// Free space under which a volume counts as full (or 1% of it, when more).
pub const FULL_MARGIN: u64 = 1024 * 1024;

/// Which quota a command ran into (an entry of a result's `limits_hit`).
pub const HIT_BYTES: &str = "disk_bytes";
pub const HIT_FILES: &str = "disk_files";

#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("disk quota: no quota mechanism on this host: {0}")]
    Unavailable(String),
    #[error("disk quota: the host has {free} bytes free, too few for client {client}'s quota of {bytes} bytes plus {HOST_RESERVE_BYTES} kept for the daemon's own files")]
    HostFull {
        client: String,
        bytes: u64,
        free: u64,
    },
    #[error("disk quota: cannot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("disk quota: {program} failed for {path}: {message}")]
    Tool {
        program: &'static str,
        path: PathBuf,
        message: String,
    },
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> VolumeError + 'a {
    move |source| VolumeError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// The mechanism in force, as the hello and `executor check` say it.
pub const MECHANISM: &str = "ext4_loop";

/// The volume of the shared workspace (and the homes of clients that share it): not a
/// client name (those never start with a dot).
pub const SHARED: &str = ".shared";

/// Where sessions' scratch directories are in a volume.
pub const SCRATCH: &str = "session";

/// Every client's volume, made and mounted on its first command.
#[derive(Debug)]
pub struct Volumes {
    /// Where images are kept (in the state directory, beside the daemon's own files, which
    /// no command reaches).
    images: PathBuf,
    /// Where clients' volumes are mounted (beneath the workspaces' root, which no command
    /// reaches but for its own).
    mounts: PathBuf,
    /// The quota of clients whose entry sets none, and of the shared volume (`--disk-quota-*`).
    pub default: Option<DiskQuota>,
    /// Whether the shared workspace is on the shared volume (it is not when the operator
    /// named it with `--workspace`: the operator's tree, which the daemon does not move).
    pub shared_workspace: bool,
    /// Whether volumes can be had here, once probed; `Err` says why not.
    probed: std::sync::OnceLock<Result<(), String>>,
    /// Volumes by name, each mounted (`Some`) or not yet; one's own lock is held while it is
    /// made and mounted, so two commands never make it twice and others' are not held up.
    mounted: Mutex<BTreeMap<String, Arc<Mutex<Option<PathBuf>>>>>,
    /// Held while an image is made: the host's free space is checked and taken in one step.
    making: Mutex<()>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Volumes {
    pub fn new(images: PathBuf, mounts: PathBuf, default: Option<DiskQuota>) -> Self {
        Self {
            images,
            mounts,
            default,
            shared_workspace: false,
            probed: std::sync::OnceLock::new(),
            mounted: Mutex::new(BTreeMap::new()),
            making: Mutex::new(()),
        }
    }

    /// Where the images are (a daemon file: no command may reach it).
    pub fn images(&self) -> &Path {
        &self.images
    }

    /// Learn whether volumes can be had here by making, mounting and removing a small one
    /// (once; later calls answer the same); `Err` says why not (an unprivileged container
    /// without loop devices, no mkfs.ext4).
    pub fn probe(&self) -> Result<(), String> {
        self.probed.get_or_init(|| self.try_probe()).clone()
    }

    fn try_probe(&self) -> Result<(), String> {
        if !nix::unistd::geteuid().is_root() {
            return Err("the daemon is not root: it cannot mount a filesystem per client".into());
        }
        if !Path::new("/dev/loop-control").exists() {
            return Err(
                "no /dev/loop-control: this host (or container) has no loop devices".into(),
            );
        }
        let name = ".probe";
        let quota = DiskQuota {
            bytes: MIN_BYTES,
            files: MIN_FILES,
        };
        let image = self.image_of(name);
        let _ = std::fs::remove_file(&image);
        let made = self.mount_new(name, quota);
        let point = self.mount_point(name);
        let outcome = match made {
            Err(err) => Err(err.to_string()),
            Ok(()) => {
                unmount(&point).map_err(|err| format!("cannot unmount a probe volume: {err}"))
            }
        };
        let _ = std::fs::remove_dir(&point);
        let _ = std::fs::remove_file(&image);
        outcome
    }

    fn image_of(&self, name: &str) -> PathBuf {
        self.images.join(format!("{name}.img"))
    }

    /// Where the volume `name` is mounted (whether or not it is now).
    pub fn mount_point(&self, name: &str) -> PathBuf {
        self.mounts.join(name)
    }

    /// Mount the volume `name` (made for `quota` if it has no image yet) and return where;
    /// at once if it is mounted already.
    pub fn mount(&self, name: &str, quota: DiskQuota) -> Result<PathBuf, VolumeError> {
        self.probe().map_err(VolumeError::Unavailable)?;
        let slot = lock(&self.mounted)
            .entry(name.to_string())
            .or_default()
            .clone();
        let mut slot = lock(&slot);
        if let Some(point) = &*slot {
            return Ok(point.clone());
        }
        let started = std::time::Instant::now();
        self.mount_new(name, quota)?;
        let point = self.mount_point(name);
        tracing::info!(
            volume = name,
            ms = started.elapsed().as_secs_f64() * 1000.0,
            "disk quota volume mounted"
        );
        *slot = Some(point.clone());
        Ok(point)
    }

    fn mount_new(&self, name: &str, quota: DiskQuota) -> Result<(), VolumeError> {
        for dir in [&self.images, &self.mounts] {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o711)
                .create(dir)
                .map_err(io("create", dir))?;
        }
        let image = self.image_of(name);
        if !image.exists() {
            self.make_image(name, &image, quota)?;
        } else if let Ok(meta) = std::fs::metadata(&image) {
            if meta.len() != quota.bytes {
                tracing::warn!(
                    volume = name,
                    image_bytes = meta.len(),
                    quota_bytes = quota.bytes,
                    "this volume was made for another quota; it keeps its size until its image is removed"
                );
            }
        }
        let point = self.mount_point(name);
        match std::fs::DirBuilder::new().mode(0o711).create(&point) {
            Ok(()) => {}
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(err) => return Err(io("create", &point)(err)),
        }
        // mount(8) attaches the image to a free loop device with autoclear: the device is
        // released with the filesystem's last reference, so an unmount leaks none.
        // nosuid, nodev: what a command leaves in its volume grants nothing.
        run(
            "mount",
            &point,
            std::process::Command::new(tool("mount"))
                .args(["-t", "ext4", "-o", "loop,nosuid,nodev"])
                .arg(&image)
                .arg(&point),
        )?;
        // Its root lists nothing to the uids of the clients whose directories it holds.
        std::fs::set_permissions(&point, std::fs::Permissions::from_mode(0o711))
            .map_err(io("chmod", &point))?;
        // Scratch of sessions a killed daemon could not end: no session of ours has any
        // here yet (a session's scratch is made after its volume is mounted).
        let scratch = point.join(SCRATCH);
        if scratch.exists() {
            if let Err(err) = sandbox::removal::remove(&scratch) {
                tracing::error!(%err, dir = %scratch.display(), "cannot remove the scratch a previous daemon left");
            }
        }
        Ok(())
    }

    /// Make the image of `name`: allocated in full, so that the host's disk cannot be
    /// overcommitted, then formatted.
    fn make_image(&self, name: &str, image: &Path, quota: DiskQuota) -> Result<(), VolumeError> {
        let _making = lock(&self.making);
        let free = nix::sys::statvfs::statvfs(&self.images)
            .map(|st| st.blocks_available() * st.fragment_size())
            .map_err(|e| io("statvfs", &self.images)(e.into()))?;
        if free < quota.bytes.saturating_add(HOST_RESERVE_BYTES) {
            return Err(VolumeError::HostFull {
                client: name.to_string(),
                bytes: quota.bytes,
                free,
            });
        }
        // Made under a temporary name and renamed once whole: a daemon killed meanwhile
        // leaves no half-made image that would be mounted later.
        let partial = self.images.join(format!("{name}.img.partial"));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&partial)
            .map_err(io("create", &partial))?;
        let len = i64::try_from(quota.bytes).unwrap_or(i64::MAX);
        let allocated = nix::fcntl::fallocate(&file, nix::fcntl::FallocateFlags::empty(), 0, len);
        drop(file);
        if let Err(err) = allocated {
            let _ = std::fs::remove_file(&partial);
            return Err(io("allocate", &partial)(err.into()));
        }
        // -m 0: no blocks reserved for root (the quota is the client's to use); -N: the
        // file quota; nodiscard: keep the blocks allocated (a discard would punch holes in
        // the image and give the host's disk back, to be taken again later).
        let made = run(
            "mkfs.ext4",
            &partial,
            std::process::Command::new(tool("mkfs.ext4"))
                .args(["-q", "-F", "-m", "0", "-N"])
                .arg(quota.files.to_string())
                .args(["-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1"])
                .arg(&partial),
        );
        if let Err(err) = made {
            let _ = std::fs::remove_file(&partial);
            return Err(err);
        }
        std::fs::rename(&partial, image).map_err(io("rename", &partial))?;
        tracing::info!(
            volume = name,
            bytes = quota.bytes,
            files = quota.files,
            "made a disk quota volume"
        );
        Ok(())
    }

    /// Which quota the volume at `point` is at: its inodes used up, or its space all but
    /// [`FULL_MARGIN`]. The kernel does not say which write failed; ext4 refuses a write
    /// with room left (delayed allocation reserves ahead of the data: 163 KiB of a 16 MiB
    /// volume were still free when `dd bs=1M` got ENOSPC), so "full" has a margin.
    pub fn hit(point: &Path) -> Vec<String> {
        let Ok(st) = nix::sys::statvfs::statvfs(point) else {
            return Vec::new();
        };
        let mut hit = Vec::new();
        let total = st.blocks() * st.fragment_size();
        let free = st.blocks_available() * st.fragment_size();
        if free <= (total / 100).max(FULL_MARGIN) {
            hit.push(HIT_BYTES.to_string());
        }
        if st.files_available() == 0 {
            hit.push(HIT_FILES.to_string());
        }
        hit
    }

    /// Unmount every volume (the daemon stops).
    pub fn unmount_all(&self) {
        let volumes = std::mem::take(&mut *lock(&self.mounted));
        for (name, slot) in volumes {
            let Some(point) = lock(&slot).take() else {
                continue;
            };
            match unmount(&point) {
                Ok(()) => tracing::info!(volume = name, "unmounted"),
                Err(err) => tracing::error!(volume = name, %err, "cannot unmount"),
            }
        }
    }

    /// At start: unmount the volumes a killed daemon left mounted, and remove images it left
    /// half made.
    pub fn clear_leftovers(&self) {
        let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
            return;
        };
        // Deepest first, in case a command's files were mounted over (they cannot be).
        let mut points: Vec<PathBuf> = info
            .lines()
            .filter_map(|line| line.split(' ').nth(4))
            .map(unescape_mountinfo)
            .filter(|p| p.starts_with(&self.mounts) && p != &self.mounts)
            .collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for point in points {
            match unmount(&point) {
                Ok(()) => {
                    tracing::info!(point = %point.display(), "unmounted a volume a previous daemon left")
                }
                Err(err) => {
                    tracing::error!(point = %point.display(), %err, "cannot unmount a volume a previous daemon left")
                }
            }
        }
        if let Ok(entries) = std::fs::read_dir(&self.images) {
            for entry in entries.flatten() {
                if entry
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".img.partial")
                {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
    }
}

/// Unmount `point`; lazily when busy (a process of a command still ending), so that the
/// filesystem and its loop device go with the last process using them.
fn unmount(point: &Path) -> Result<(), nix::Error> {
    use nix::mount::{umount2, MntFlags};
    match umount2(point, MntFlags::empty()) {
        Err(nix::errno::Errno::EBUSY) => umount2(point, MntFlags::MNT_DETACH),
        other => other,
    }
}

/// mountinfo escapes space, tab, newline and backslash as octal (`\040`).
fn unescape_mountinfo(field: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            std::str::from_utf8(d)
                .ok()
                .and_then(|d| u8::from_str_radix(d, 8).ok())
        });
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// A system tool by its path: in `PATH`, or where Debian puts it (root's `PATH` may lack the
/// sbin directories when the daemon is started by a service manager or a script).
fn tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(name))
}

/// Run a tool to its end; its stderr is the error.
fn run(
    program: &'static str,
    path: &Path,
    command: &mut std::process::Command,
) -> Result<(), VolumeError> {
    let output = command
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|err| VolumeError::Tool {
            program,
            path: path.to_path_buf(),
            message: format!("cannot run it: {err}"),
        })?;
    if output.status.success() {
        return Ok(());
    }
    Err(VolumeError::Tool {
        program,
        path: path.to_path_buf(),
        message: format!(
            "{}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(
            unescape_mountinfo(r"/a\040b\134c"),
            PathBuf::from("/a b\\c")
        );
        assert_eq!(unescape_mountinfo("/plain"), PathBuf::from("/plain"));
    }
}
