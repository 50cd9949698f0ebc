//! Removing a tree a command left behind, without reaching outside it and without letting its
//! shape hurt the daemon.
//!
//! - Nothing outside: directories are opened relative to their parent's descriptor with
//!   `O_NOFOLLOW`, so a symlink is unlinked, never followed; hardlinks, FIFOs and sockets are only
//!   unlinked, never opened; mounts beneath are detached first, so the removal cannot descend
//!   into a bind mount and delete what it shows.
//! - Bounded, whatever the depth: the walk is a loop over an explicit stack of at most
//!   `MAX_OPEN_DIRS` open directories (two descriptors each), not recursion. A directory
//!   deeper than that is moved up to the top of the tree and removed from there on a later
//!   pass, so neither the stack, nor memory, nor descriptors grow with depth. (std's
//!   `remove_dir_all` recurses and holds a descriptor per level: a 25,000-deep tree overflowed
//!   a runtime thread's stack and aborted the daemon.)

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::dir::{Dir, OwningIter, Type};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::mount::{umount2, MntFlags};
use nix::sys::stat::Mode;
use nix::unistd::UnlinkatFlags;

/// Directories held open at once by one removal (each costs two descriptors).
const MAX_OPEN_DIRS: usize = 16;
/// Passes over the top of the tree before giving up; each pass removes everything no deeper
/// than [`MAX_OPEN_DIRS`] and moves the rest up, so a tree of depth D needs about
/// D / MAX_OPEN_DIRS passes. Only a tree that keeps changing under us (it cannot: its commands
/// are dead) would run out.
const MAX_PASSES: usize = 1 << 20;
/// Prefix of the names that deep subtrees are moved to at the top of the tree.
const MOVED_PREFIX: &str = ".executor-moved-";

#[derive(Debug, thiserror::Error)]
pub enum RemoveError {
    #[error("cannot {op} {path}: {source}")]
    Sys {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("cannot read /proc/self/mountinfo: {0}")]
    Mounts(#[source] std::io::Error),
    #[error("{0} keeps changing while it is removed")]
    Unstable(PathBuf),
    #[error("{0} has a mount beneath it")]
    Mounted(PathBuf),
}

/// Remove `dir` and everything in it without touching anything outside it. A missing `dir` is
/// not an error.
pub fn remove(dir: &Path) -> Result<(), RemoveError> {
    remove_tree(dir, true)
}

/// [`remove`] for a tree that someone other than its commands could have shaped (a home in a
/// shared temporary directory): one with a mount beneath it is refused, never unmounted. An
/// unmount goes by path, and a path under a tree others may write can be turned into a
/// symlink between reading the mount table and the unmount, which would then detach a host
/// mount. A mount that appears after the check is one its maker could make (FUSE, on a
/// directory of its own): what the removal deletes there is that maker's.
pub fn remove_unmounting_nothing(dir: &Path) -> Result<(), RemoveError> {
    remove_tree(dir, false)
}

fn remove_tree(dir: &Path, unmount: bool) -> Result<(), RemoveError> {
    let sys = |op, source| RemoveError::Sys {
        op,
        path: dir.to_path_buf(),
        source,
    };
    match nix::sys::stat::lstat(dir) {
        Err(Errno::ENOENT) => return Ok(()),
        Err(errno) => return Err(sys("inspect", errno)),
        Ok(st) if st.st_mode & libc::S_IFMT != libc::S_IFDIR => {
            return nix::unistd::unlink(dir).map_err(|e| sys("unlink", e));
        }
        Ok(_) => {}
    }
    let mounts = mounts_beneath(dir)?;
    if !unmount && !mounts.is_empty() {
        return Err(RemoveError::Mounted(dir.to_path_buf()));
    }
    for mount in mounts {
        umount2(&mount, MntFlags::MNT_DETACH).map_err(|source| RemoveError::Sys {
            op: "detach the mount",
            path: mount.clone(),
            source,
        })?;
    }
    let top = open_dir(None, dir, dir)?;
    let mut first_error = None;
    for _ in 0..MAX_PASSES {
        let pass = empty(&top, dir)?;
        if let Some(err) = pass.error {
            first_error.get_or_insert(err);
        }
        // Subtrees moved up during the pass are still there: another pass, even after an
        // error elsewhere, so that as much as can go does.
        if pass.moved > 0 {
            continue;
        }
        if let Some(err) = first_error {
            return Err(err);
        }
        return std::fs::remove_dir(dir).map_err(|err| {
            sys(
                "remove",
                Errno::from_raw(err.raw_os_error().unwrap_or(libc::EIO)),
            )
        });
    }
    Err(RemoveError::Unstable(dir.to_path_buf()))
}

/// What one pass over the tree did.
struct Pass {
    /// Subtrees moved up to the top, for the next pass.
    moved: u64,
    /// The first entry that could not be removed.
    error: Option<RemoveError>,
}

/// One open directory of the walk.
struct Frame {
    /// For the `*at` calls on its entries.
    fd: OwnedFd,
    /// Its entries, read as the walk goes (a second open file: the listing's own).
    entries: OwningIter,
    /// Its name in the frame below; `None` for the top.
    name: Option<OsString>,
    /// Path for messages only (never used to reach anything).
    path: PathBuf,
}

/// Remove everything in the directory open as `top`; subtrees deeper than the stack allows are
/// moved up into `top` under fresh names (and removed by a later pass). An entry that cannot
/// be removed is left where it is and the walk goes on with the others: the first such error
/// is kept for the caller, so one stuck file does not keep the rest of the tree on disk.
fn empty(top: &OwnedFd, top_path: &Path) -> Result<Pass, RemoveError> {
    let mut moved: u64 = 0;
    let mut first_error = None;
    let mut stack = vec![frame(top.try_clone(), None, top_path.to_path_buf())?];
    loop {
        let depth = stack.len();
        let Some(current) = stack.last_mut() else {
            break;
        };
        let step = match current.entries.next() {
            Some(entry) => visit(current, entry, depth, top, &mut moved),
            None => {
                // Listed to the end: empty now, unless something in it could not be
                // removed; remove it from its parent. The top is removed by the caller.
                let Some(done) = stack.pop() else { break };
                match (stack.last(), done.name) {
                    (Some(parent), Some(name)) => {
                        unlink(&parent.fd, &name, true, &done.path).map(|()| None)
                    }
                    _ => Ok(None),
                }
            }
        };
        match step {
            Ok(Some(child)) => stack.push(child),
            Ok(None) => {}
            Err(err) => {
                first_error.get_or_insert(err);
            }
        }
    }
    Ok(Pass {
        moved,
        error: first_error,
    })
}

/// Remove one listed entry of `current`: unlink it, or return the frame to descend into.
fn visit(
    current: &Frame,
    entry: nix::Result<nix::dir::Entry>,
    depth: usize,
    top: &OwnedFd,
    moved: &mut u64,
) -> Result<Option<Frame>, RemoveError> {
    let entry = entry.map_err(|source| RemoveError::Sys {
        op: "list",
        path: current.path.clone(),
        source,
    })?;
    let name = OsStr::from_bytes(entry.file_name().to_bytes()).to_os_string();
    if name == "." || name == ".." {
        return Ok(None);
    }
    let path = current.path.join(&name);
    if !is_dir(&current.fd, &name, entry.file_type(), &path)? {
        unlink(&current.fd, &name, false, &path)?;
        return Ok(None);
    }
    // An empty directory goes at once; only a full one needs opening.
    match nix::unistd::unlinkat(&current.fd, name.as_os_str(), UnlinkatFlags::RemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => return Ok(None),
        Err(Errno::ENOTEMPTY | Errno::EEXIST) => {}
        Err(source) => {
            return Err(RemoveError::Sys {
                op: "remove",
                path,
                source,
            })
        }
    }
    if depth >= MAX_OPEN_DIRS {
        move_up(&current.fd, &name, top, moved, &path)?;
        return Ok(None);
    }
    let child = open_dir(Some(&current.fd), Path::new(&name), &path)?;
    frame(Ok(child), Some(name), path).map(Some)
}

fn frame(
    fd: std::io::Result<OwnedFd>,
    name: Option<OsString>,
    path: PathBuf,
) -> Result<Frame, RemoveError> {
    let sys = |op, source| RemoveError::Sys {
        op,
        path: path.clone(),
        source,
    };
    let fd = fd.map_err(|e| sys("duplicate a descriptor of", io_errno(&e)))?;
    // We remove it anyway: make sure we may list and empty it (a daemon that is not root
    // needs this for directories a command left without permissions; errors are harmless).
    let _ = nix::sys::stat::fchmod(&fd, Mode::S_IRWXU);
    // A new open file of its own (a duplicate would share the read position, and a second
    // pass over the top must list it from the start).
    let listing = nix::fcntl::openat(
        &fd,
        ".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| sys("list", e))?;
    let entries = Dir::from_fd(listing)
        .map_err(|e| sys("list", e))?
        .into_iter();
    Ok(Frame {
        fd,
        entries,
        name,
        path,
    })
}

/// Whether `name` in `dir` is a directory, without following a symlink.
fn is_dir(
    dir: &OwnedFd,
    name: &OsStr,
    listed: Option<Type>,
    path: &Path,
) -> Result<bool, RemoveError> {
    if let Some(kind) = listed {
        return Ok(kind == Type::Directory);
    }
    // Filesystems that do not fill in d_type.
    match nix::sys::stat::fstatat(dir, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(st.st_mode & libc::S_IFMT == libc::S_IFDIR),
        Err(Errno::ENOENT) => Ok(false),
        Err(source) => Err(RemoveError::Sys {
            op: "inspect",
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn unlink(dir: &OwnedFd, name: &OsStr, is_dir: bool, path: &Path) -> Result<(), RemoveError> {
    let flag = if is_dir {
        UnlinkatFlags::RemoveDir
    } else {
        UnlinkatFlags::NoRemoveDir
    };
    match nix::unistd::unlinkat(dir, name, flag) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(source) => Err(RemoveError::Sys {
            op: "remove",
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Move the directory `name` of `dir` to the top of the tree under a name nothing else uses.
fn move_up(
    dir: &OwnedFd,
    name: &OsStr,
    top: &OwnedFd,
    moved: &mut u64,
    path: &Path,
) -> Result<(), RemoveError> {
    loop {
        *moved += 1;
        let fresh = format!("{MOVED_PREFIX}{moved}");
        // renameat replaces an empty directory of the same name: check first (nothing else
        // writes in this tree, so the check holds).
        match nix::sys::stat::fstatat(
            top,
            fresh.as_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        ) {
            Err(Errno::ENOENT) => {}
            Ok(_) => continue,
            Err(source) => {
                return Err(RemoveError::Sys {
                    op: "inspect the top of",
                    path: path.to_path_buf(),
                    source,
                })
            }
        }
        return nix::fcntl::renameat(dir, name, top, fresh.as_str()).map_err(|source| {
            RemoveError::Sys {
                op: "move up",
                path: path.to_path_buf(),
                source,
            }
        });
    }
}

/// Open a directory without following a symlink in its last component (relative to `parent`
/// when given). One without read permission (left so by a command) is opened up first.
fn open_dir(parent: Option<&OwnedFd>, name: &Path, path: &Path) -> Result<OwnedFd, RemoveError> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let open = |flags| match parent {
        Some(fd) => nix::fcntl::openat(fd, name, flags, Mode::empty()),
        None => nix::fcntl::open(name, flags, Mode::empty()),
    };
    match open(flags) {
        Err(Errno::EACCES) => {
            // A path descriptor needs no permission on the directory itself; chmod through
            // its /proc entry (which names this very directory) and try again.
            use std::os::fd::AsRawFd;
            let handle =
                open(OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
                    .map_err(|source| RemoveError::Sys {
                        op: "open",
                        path: path.to_path_buf(),
                        source,
                    })?;
            let proc_path = format!("/proc/self/fd/{}", handle.as_fd().as_raw_fd());
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&proc_path, std::fs::Permissions::from_mode(0o700));
            open(flags)
        }
        other => other,
    }
    .map_err(|source| RemoveError::Sys {
        op: "open",
        path: path.to_path_buf(),
        source,
    })
}

fn io_errno(err: &std::io::Error) -> Errno {
    Errno::from_raw(err.raw_os_error().unwrap_or(libc::EIO))
}

/// Mount points at or beneath `dir` in our mount namespace, deepest first.
fn mounts_beneath(dir: &Path) -> Result<Vec<PathBuf>, RemoveError> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").map_err(RemoveError::Mounts)?;
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

    fn base(name: &str) -> PathBuf {
        let base = std::env::temp_dir().join(format!("ws-remove-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        base
    }

    #[test]
    fn mount_paths_are_unescaped() {
        assert_eq!(unescape_mount_path(r"/a\040b\134c"), r"/a b\c");
        assert_eq!(unescape_mount_path(r"/plain"), "/plain");
        assert_eq!(unescape_mount_path(r"/odd\04"), r"/odd\04");
    }

    #[test]
    fn removal_unlinks_symlinks_hardlinks_and_fifos_without_following_them() {
        let base = base("links");
        let outside = base.join("outside");
        let dir = base.join("scratch");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::create_dir_all(dir.join("sub/deeper")).unwrap();
        std::fs::write(outside.join("keep"), "precious").unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("link-to-dir")).unwrap();
        std::os::unix::fs::symlink(outside.join("keep"), dir.join("sub/link-to-file")).unwrap();
        std::fs::hard_link(outside.join("keep"), dir.join("hard")).unwrap();
        nix::unistd::mkfifo(&dir.join("fifo"), Mode::S_IRWXU).unwrap();
        std::fs::write(dir.join("sub/deeper/f"), "x").unwrap();
        std::fs::set_permissions(dir.join("sub"), std::fs::Permissions::from_mode(0o000)).unwrap();
        remove(&dir).unwrap();
        assert!(!dir.exists());
        assert_eq!(
            std::fs::read_to_string(outside.join("keep")).unwrap(),
            "precious"
        );
        // Control: removing a missing tree is not an error.
        remove(&dir).unwrap();
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn a_tree_far_deeper_than_the_descriptor_bound_is_removed_on_a_small_stack() {
        // A thread with a 256 KiB stack (std's remove_dir_all recursed a frame per level) and
        // a depth of 3,000 (it also held a descriptor per level).
        let base = base("deep");
        let dir = base.join("scratch");
        std::fs::create_dir(&dir).unwrap();
        // Built through descriptors, as a command would with chdir (no PATH_MAX limit, and
        // the test process's working directory is left alone).
        let open = |parent: &OwnedFd| {
            nix::fcntl::openat(
                parent,
                "d",
                OFlag::O_RDONLY | OFlag::O_DIRECTORY,
                Mode::empty(),
            )
            .unwrap()
        };
        let mut level: OwnedFd = std::fs::File::open(&dir).unwrap().into();
        for i in 0..3000 {
            nix::sys::stat::mkdirat(&level, "d", Mode::S_IRWXU).unwrap();
            let next = open(&level);
            if i % 500 == 0 {
                let file =
                    nix::fcntl::openat(&next, "f", OFlag::O_CREAT | OFlag::O_WRONLY, Mode::S_IRUSR)
                        .unwrap();
                drop(file);
            }
            level = next;
        }
        drop(level);
        let removal = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || remove(&dir).map(|()| dir))
            .unwrap();
        let dir = removal.join().unwrap().unwrap();
        assert!(!dir.exists());
        // Control: the base it was in is still there.
        assert!(base.is_dir());
        std::fs::remove_dir_all(&base).unwrap();
    }
}
