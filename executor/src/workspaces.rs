//! Private workspaces: one per client, or scratch per session, under one root in the state
//! directory (which every profile that shows the host's root covers, and landlock never opens).
//!
//! Removing a scratch workspace must not reach outside it, whatever a command left there:
//! symlinks are unlinked, never followed (std's `remove_dir_all` works on directory file
//! descriptors with `O_NOFOLLOW`); hardlinks and FIFOs are only unlinked, never opened; and
//! anything mounted beneath is detached first, so the removal cannot descend into a bind
//! mount and delete what it shows.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use anyhow::Context;
use nix::mount::{umount2, MntFlags};

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

/// Remove `dir` and everything in it without touching anything outside it.
pub fn remove(dir: &Path) -> anyhow::Result<()> {
    if std::fs::symlink_metadata(dir).is_err() {
        return Ok(());
    }
    for mount in mounts_beneath(dir)? {
        umount2(&mount, MntFlags::MNT_DETACH).with_context(|| {
            format!(
                "cannot detach {} before removing {}",
                mount.display(),
                dir.display()
            )
        })?;
    }
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(first) => {
            // A command may have left directories without write or search permission, which
            // stop a daemon that is not root. Open them up (directories only: modes of other
            // files do not matter for unlinking, and symlinks are never followed) and retry.
            open_up_dirs(dir);
            std::fs::remove_dir_all(dir).with_context(|| {
                format!("cannot remove {} (first attempt: {first})", dir.display())
            })
        }
    }
}

fn open_up_dirs(dir: &Path) {
    if let Ok(fd) = open_dir(None, dir) {
        open_up(&fd, 0);
    }
}

/// Open a directory without following a symlink in its last component (relative to `parent`
/// when given), so nothing can be swapped in under our feet.
fn open_dir(
    parent: Option<&std::os::fd::OwnedFd>,
    path: &Path,
) -> nix::Result<std::os::fd::OwnedFd> {
    use nix::fcntl::OFlag;
    use nix::sys::stat::Mode;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    match parent {
        Some(fd) => nix::fcntl::openat(fd, path, flags, Mode::empty()),
        None => nix::fcntl::open(path, flags, Mode::empty()),
    }
}

/// `chmod 700` the directory open as `fd` and every directory below it, through descriptors.
fn open_up(fd: &std::os::fd::OwnedFd, depth: u32) {
    use std::os::fd::AsRawFd;
    if depth > 512 {
        return;
    }
    let _ = nix::sys::stat::fchmod(fd, nix::sys::stat::Mode::S_IRWXU);
    // The descriptor's own entry in /proc lists this very directory, wherever it is now.
    let Ok(entries) = std::fs::read_dir(format!("/proc/self/fd/{}", fd.as_raw_fd())) else {
        return;
    };
    for entry in entries.flatten() {
        // The entry's type as stored: a symlink is never taken for a directory.
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            if let Ok(child) = open_dir(Some(fd), Path::new(&entry.file_name())) {
                open_up(&child, depth + 1);
            }
        }
    }
}

/// Mount points at or beneath `dir` in our mount namespace, deepest first.
fn mounts_beneath(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let table = std::fs::read_to_string("/proc/self/mountinfo")
        .context("cannot read /proc/self/mountinfo")?;
    let mut found: Vec<PathBuf> = table
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape_mount_path(field)))
        .filter(|path| path.starts_with(dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found.dedup();
    Ok(found)
}

/// mountinfo writes space, tab, newline and backslash in paths as `\ooo` octal escapes.
fn unescape_mount_path(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn mount_paths_are_unescaped() {
        assert_eq!(unescape_mount_path(r"/a\040b\134c"), r"/a b\c");
        assert_eq!(unescape_mount_path(r"/plain"), "/plain");
        assert_eq!(unescape_mount_path(r"/odd\04"), r"/odd\04");
    }

    #[test]
    fn removal_unlinks_symlinks_hardlinks_and_fifos_without_following_them() {
        let base = std::env::temp_dir().join(format!("ws-remove-{}", std::process::id()));
        let outside = base.join("outside");
        let dir = base.join("scratch");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(outside.join("keep"), "precious").unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("link-to-dir")).unwrap();
        std::os::unix::fs::symlink(outside.join("keep"), dir.join("sub/link-to-file")).unwrap();
        std::fs::hard_link(outside.join("keep"), dir.join("hard")).unwrap();
        nix::unistd::mkfifo(&dir.join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        std::fs::set_permissions(dir.join("sub"), std::fs::Permissions::from_mode(0o000)).unwrap();
        remove(&dir).unwrap();
        assert!(!dir.exists());
        assert_eq!(
            std::fs::read_to_string(outside.join("keep")).unwrap(),
            "precious"
        );
        // Control: removing a missing workspace is not an error.
        remove(&dir).unwrap();
        std::fs::remove_dir_all(&base).unwrap();
    }
}
