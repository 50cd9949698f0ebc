//! The suites' temporary directories, removed without recursion whatever their depth.
//!
//! A case can leave a tree of any depth in a directory the harness made (a scratch workspace a
//! command filled with 25,000 nested directories, a daemon killed while removing one). std's
//! `remove_dir_all`, which `tempfile::TempDir` uses, recurses once per level: such a tree
//! overflowed the test thread's stack and aborted the whole `escape` binary (SIGABRT), so every
//! test after it never ran. [`TempDir`] is the one temporary directory of the suites; its
//! removal ([`remove_tree`]) is a loop with the path from the top kept on the heap, one
//! directory descriptor open at a time, so neither the stack nor the descriptors grow with the
//! depth. `tests/clippy.toml` disallows `tempfile`'s directories and std's `remove_dir_all`
//! in the suites so that recursion does not come back. (The executor's own removal,
//! `sandbox/src/removal.rs`, also defends against the commands that shaped the
//! tree; here the trees are the tests' own, and the walk only checks that it never leaves
//! them: it does not cross into mounts, and stops if a directory it climbs back to is not the
//! one it went down from.)

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::dir::{Dir, Type};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::{fstat, Mode, SFlag};
use nix::unistd::UnlinkatFlags;

/// A directory of its own, created fresh and removed with everything in it when dropped.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// A new directory in the system's temporary directory.
    pub fn new() -> io::Result<Self> {
        Self::with_prefix(".tmp")
    }

    /// A new directory in `parent`.
    pub fn new_in(parent: impl AsRef<Path>) -> io::Result<Self> {
        Self::with_prefix_in(".tmp", parent)
    }

    /// A new directory in the system's temporary directory, its name starting with `prefix`.
    pub fn with_prefix(prefix: &str) -> io::Result<Self> {
        Self::with_prefix_in(prefix, std::env::temp_dir())
    }

    /// A new directory in `parent`, its name starting with `prefix`.
    pub fn with_prefix_in(prefix: &str, parent: impl AsRef<Path>) -> io::Result<Self> {
        // tempfile makes the name (random, created with mkdir: never an existing directory);
        // the removal is ours.
        #[allow(clippy::disallowed_methods)]
        let made = tempfile::Builder::new().prefix(prefix).tempdir_in(parent)?;
        Ok(Self { path: made.keep() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(err) = remove_tree(&self.path) {
            // A test's clean-up must not fail the test (nor panic while one unwinds); what is
            // left is said, not hidden.
            eprintln!(
                "executor-tests: could not remove {} entirely: {err}",
                self.path.display()
            );
        }
    }
}

/// One directory on the way down from the top: its name in its parent, its identity (to check
/// that climbing back with `..` reaches it), and its subdirectories still to remove.
struct Level {
    name: Option<OsString>,
    id: (u64, u64),
    pending: Vec<OsString>,
}

/// Remove `path` and everything beneath it, without recursion and with one directory
/// descriptor open at a time, whatever the depth. A missing `path` is not an error. Entries
/// on another filesystem (a mount beneath) are left in place and reported; an entry that
/// cannot be removed (an immutable file) is reported after everything else that can go has
/// gone.
pub fn remove_tree(path: &Path) -> io::Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(err),
        Ok(meta) => meta,
    };
    if !meta.is_dir() {
        return std::fs::remove_file(path);
    }
    let mut first_error: Option<io::Error> = None;
    let mut note = |what: String, errno: Errno| {
        first_error.get_or_insert_with(|| os_error(errno, &what));
    };
    let mut current = open_dir(None, path.as_os_str().as_bytes())
        .map_err(|e| os_error(e, &format!("open {}", path.display())))?;
    let top = identity(&current)?;
    let mut levels = vec![Level {
        name: None,
        id: top,
        pending: empty_of_files(&current, &mut note)?,
    }];
    while let Some(level) = levels.last_mut() {
        if let Some(child) = level.pending.pop() {
            match open_dir(Some(&current), child.as_bytes()) {
                Ok(fd) => {
                    let id = identity(&fd)?;
                    if id.0 != top.0 {
                        note(
                            format!("{child:?} is a mount beneath {}", path.display()),
                            Errno::EXDEV,
                        );
                        continue;
                    }
                    current = fd;
                    let pending = empty_of_files(&current, &mut note)?;
                    levels.push(Level {
                        name: Some(child),
                        id,
                        pending,
                    });
                }
                Err(Errno::ENOENT) => {}
                // It became something else than a directory since it was listed.
                Err(Errno::ENOTDIR | Errno::ELOOP) => {
                    if let Err(e) = nix::unistd::unlinkat(
                        &current,
                        child.as_os_str(),
                        UnlinkatFlags::NoRemoveDir,
                    ) {
                        note(format!("unlink {child:?}"), e);
                    }
                }
                Err(e) => note(format!("open {child:?}"), e),
            }
            continue;
        }
        // Everything below this level is gone (or reported): climb back and remove it.
        let Some(done) = levels.pop() else { break };
        let Some(name) = done.name else { break };
        let Some(parent) = levels.last() else { break };
        let up = open_dir(Some(&current), b"..")
            .map_err(|e| os_error(e, &format!("open .. under {}", path.display())))?;
        if identity(&up)? != parent.id {
            return Err(io::Error::other(format!(
                "{} changed while it was removed (a directory moved)",
                path.display()
            )));
        }
        current = up;
        if let Err(e) = nix::unistd::unlinkat(&current, name.as_os_str(), UnlinkatFlags::RemoveDir)
        {
            note(format!("remove directory {name:?}"), e);
        }
    }
    drop(current);
    if let Err(err) = std::fs::remove_dir(path) {
        return Err(first_error.unwrap_or(err));
    }
    first_error.map_or(Ok(()), Err)
}

fn open_dir(parent: Option<&OwnedFd>, name: &[u8]) -> nix::Result<OwnedFd> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let name = std::ffi::OsStr::from_bytes(name);
    match parent {
        Some(parent) => nix::fcntl::openat(parent, name, flags, Mode::empty()),
        None => nix::fcntl::open(name, flags, Mode::empty()),
    }
}

/// An `io::Error` of `errno`'s kind saying what failed.
fn os_error(errno: Errno, what: &str) -> io::Error {
    io::Error::new(io::Error::from(errno).kind(), format!("{what}: {errno}"))
}

fn identity(fd: &OwnedFd) -> io::Result<(u64, u64)> {
    let st = fstat(fd.as_fd()).map_err(io::Error::from)?;
    Ok((st.st_dev, st.st_ino))
}

/// Unlink every entry of the directory open as `dir` that is not a directory; return the
/// names of its subdirectories.
fn empty_of_files(
    dir: &OwnedFd,
    note: &mut impl FnMut(String, Errno),
) -> io::Result<Vec<OsString>> {
    let listing = Dir::openat(
        dir,
        ".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io::Error::from)?;
    let mut subdirs = Vec::new();
    for entry in listing {
        let entry = entry.map_err(io::Error::from)?;
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        let name = OsString::from(std::ffi::OsStr::from_bytes(name));
        let is_dir = match entry.file_type() {
            Some(kind) => kind == Type::Directory,
            // The filesystem does not say in the listing: ask.
            None => nix::sys::stat::fstatat(
                dir,
                name.as_os_str(),
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .is_ok_and(|st| {
                SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR
            }),
        };
        if is_dir {
            subdirs.push(name);
        } else if let Err(e) =
            nix::unistd::unlinkat(dir, name.as_os_str(), UnlinkatFlags::NoRemoveDir)
        {
            if e != Errno::ENOENT {
                note(format!("unlink {name:?}"), e);
            }
        }
    }
    Ok(subdirs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Make `top/d/d/.../d`, `levels` deep with a file at each level, through descriptors (no
    /// path gets long).
    fn build_deep(top: &Path, levels: u32) {
        let mut level = open_dir(None, top.as_os_str().as_bytes()).unwrap();
        for _ in 0..levels {
            nix::sys::stat::mkdirat(&level, "d", Mode::S_IRWXU).unwrap();
            let file = nix::fcntl::openat(
                &level,
                "f",
                OFlag::O_CREAT | OFlag::O_WRONLY | OFlag::O_CLOEXEC,
                Mode::S_IRUSR,
            )
            .unwrap();
            drop(file);
            level = open_dir(Some(&level), b"d").unwrap();
        }
    }

    #[test]
    fn a_tree_30000_deep_is_removed_on_a_small_stack_and_nothing_outside_it() {
        // On a tmpfs where there is one: disks here discard on every removal.
        let shm = Path::new("/dev/shm");
        let parent = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let outside = TempDir::with_prefix_in("scratch-outside-", &parent).unwrap();
        let keep = outside.path().join("keep");
        std::fs::write(&keep, "outside").unwrap();
        let dir = TempDir::with_prefix_in("scratch-deep-", &parent).unwrap();
        let top = dir.path().to_path_buf();
        build_deep(&top, 30_000);
        // Links out of the tree are unlinked, never followed.
        std::os::unix::fs::symlink(outside.path(), top.join("link")).unwrap();
        std::fs::hard_link(&keep, top.join("hard")).unwrap();
        // std's remove_dir_all overflows a 2 MiB stack on 25,000 levels; this removal keeps
        // its path on the heap and runs on a stack of 128 KiB.
        std::thread::Builder::new()
            .stack_size(128 << 10)
            .spawn(move || drop(dir))
            .unwrap()
            .join()
            .unwrap();
        assert!(!top.exists(), "{} is still there", top.display());
        assert_eq!(std::fs::read_to_string(&keep).unwrap(), "outside");
    }

    #[test]
    fn a_missing_directory_or_a_file_is_removed_without_error() {
        let dir = TempDir::new().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, "x").unwrap();
        remove_tree(&file).unwrap();
        assert!(!file.exists());
        remove_tree(&dir.path().join("missing")).unwrap();
        assert!(dir.path().is_dir());
    }
}
