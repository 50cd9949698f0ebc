//! The command's filesystem view, built in a fresh mount namespace.
//!
//! Follows bubblewrap's order: make every mount private, mount a staging tmpfs on /tmp and
//! pivot into it so the host's tree sits at /oldroot (bind sources are read from there, so a
//! new mount can never hide a source), build the new root at /newroot, pivot into it, and
//! detach the staging tmpfs with the host's tree below it in one lazy unmount. Paths that do not exist on the host are skipped: a profile may list
//! toolchain directories that only some hosts have.
//!
//! The same plan can be built in two halves ([`build_template`], [`finish_root`]): the part
//! every command of a template sees alike once, into a mount namespace the fork server keeps
//! (`spawner::root_pool`), and per command only what must be the command's own, in a copy of
//! it: the tmpfs mounts (`/tmp`, `/dev/shm`), a fresh `/proc` (it shows the pid namespace of
//! whoever mounts it), and whatever the plan puts inside them (a workspace under `/tmp`,
//! bound from a detached copy of the host's mount made before leaving the host's namespace,
//! [`prepare_finish`]).

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::plan::MountPlan;
use crate::profile::RootMode;

const STAGING: &str = "/tmp";
const OLD: &str = "/oldroot";
const NEW: &str = "/newroot";
/// An empty file in the staging tmpfs, bound over hidden files.
const EMPTY_FILE: &str = "/empty";
/// The empty file a template keeps for [`finish_root`] (no staging tmpfs exists there): under
/// the /proc mount point, so the command's /proc covers it.
const TEMPLATE_EMPTY_FILE: &str = "/proc/.empty";

/// Device nodes of the minimal /dev, bound from the host's.
/// `tty` opens only the caller's controlling terminal.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];
/// /proc directories made read-only (they hold host-wide knobs), as Docker does.
const PROC_READ_ONLY: &[&str] = &["sys", "bus", "fs", "irq"];
/// /proc files covered by /dev/null: kernel memory, keys, timers, and the sysrq trigger.
const PROC_MASKED: &[&str] = &["sysrq-trigger", "kcore", "keys", "timer_list"];

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("{op} {path}: {source}")]
    Sys {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: nix::errno::Errno,
    },
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} must be an absolute path")]
    Relative(PathBuf),
    /// A root of the host's tree is built whole (its top-level directories are listed while
    /// building); a caller asked for half of one.
    #[error("a root of the host's tree is built in one piece")]
    NotSplit,
}

type Result<T> = std::result::Result<T, MountError>;

fn sys(op: &'static str, path: &Path) -> impl FnOnce(nix::errno::Errno) -> MountError {
    let path = path.to_path_buf();
    move |source| MountError::Sys { op, path, source }
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> MountError {
    let path = path.to_path_buf();
    move |source| MountError::Io { op, path, source }
}

/// What to mount at one path of the new root.
#[derive(Debug, Clone, PartialEq)]
enum Entry {
    ReadOnly,
    Writable,
    Hidden,
    Tmpfs(u64),
    Dev,
    /// The command's own devpts instance (`newinstance`): terminals made in the sandbox.
    Pts,
    Proc,
    /// Bound onto itself, writable: a mount point cannot be renamed or replaced (EBUSY), so
    /// the directories on the way to what the next helper loads stay where they are.
    Pin,
    /// A host file (the source, an absolute path) bound read-only over the path: a file the
    /// daemon generated (`MountPlan::files`).
    File(PathBuf),
}

/// Build the new root described by `plan` and pivot into it. Runs in the sandbox's init, in a
/// fresh mount namespace, as root.
pub fn build_root(plan: &MountPlan) -> Result<()> {
    build(plan, Stage::Whole)
}

/// Build the part of `plan`'s root that every command of its template shares, and pivot into
/// it: everything but [`per_command`] entries, whose mount points are made (empty) for
/// [`finish_root`]. Runs in a process of the fork server's that has just made a mount
/// namespace of its own, as root; the namespace it leaves behind is the template.
pub fn build_template(plan: &MountPlan) -> Result<()> {
    build(plan, Stage::Template)
}

/// Whether `plan` can be built in two halves: a root of its own (an empty tmpfs; the host's
/// tree, with its pins, is built whole). The commands' identity decides the rest
/// (`spawner::root_pool`).
pub fn splits(plan: &MountPlan) -> bool {
    plan.root == RootMode::Empty
}

/// Which of the stages a [`Builder`] runs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Stage {
    /// The whole root, per command.
    Whole,
    /// The shared part, once per template.
    Template,
    /// The command's own part, in a copy of the template.
    Finish,
}

fn build(plan: &MountPlan, stage: Stage) -> Result<()> {
    let root = Path::new("/");
    // 1. Nothing we mount may propagate back to the host, nor host mounts into us.
    mount(
        None::<&str>,
        root,
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(sys("make private", root))?;

    // 2. Staging: a tmpfs on /tmp, pivoted into, puts the host tree at /oldroot.
    let staging = Path::new(STAGING);
    mount(
        Some("tmpfs"),
        staging,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0755,size=1m"),
    )
    .map_err(sys("mount staging tmpfs on", staging))?;
    for dir in ["newroot", "oldroot"] {
        mkdir(&staging.join(dir))?;
    }
    let put_old = staging.join("oldroot");
    nix::unistd::pivot_root(staging, &put_old).map_err(sys("pivot_root into", staging))?;
    nix::unistd::chdir(root).map_err(sys("chdir", root))?;
    std::fs::File::create(EMPTY_FILE).map_err(io("create", Path::new(EMPTY_FILE)))?;

    // 3. The new root: an empty tmpfs, or the host's tree.
    let new = Path::new(NEW);
    match plan.root {
        RootMode::Empty => mount(
            Some("tmpfs"),
            new,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some("mode=0755,size=1m"),
        )
        .map_err(sys("mount root tmpfs on", new))?,
        RootMode::Host => mount(
            Some(OLD),
            new,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
        .map_err(sys("bind host root on", new))?,
    }

    // 4. Everything else, parents before children, so a later mount can sit inside an earlier
    //    one (the workspace inside a hidden state directory, /dev/shm inside /dev).
    let entries = entries(plan)?;
    let own = per_command_roots(&entries);
    let mut builder = Builder::new(plan, stage);
    for (path, entry) in &entries {
        let mine = own.iter().any(|r| path.starts_with(r));
        match stage {
            Stage::Template if mine => {
                // The command's own: only the mount point, made here while the root is
                // still writable.
                if own.contains(path) {
                    builder.mount_point(&builder.target(path), true)?;
                }
                if *entry == Entry::Proc {
                    let empty = builder.target(TEMPLATE_EMPTY_FILE);
                    std::fs::File::create(&empty).map_err(io("create", &empty))?;
                }
            }
            _ => builder.apply(path, entry)?,
        }
    }
    builder.seal()?;
    if plan.root == RootMode::Host {
        // The host's /sys holds host-wide knobs; the command only reads it.
        let sys_dir = builder.target("/sys");
        if sys_dir.is_dir() {
            bind(&sys_dir, &sys_dir)?;
            remount(
                &sys_dir,
                MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            )?;
        }
    }
    // Seal the root: an empty root holds only mount points; the host's root keeps its
    // top-level directories writable (each is pinned above) but not the root itself.
    remount(
        new,
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
    )?;

    // 5. Make /newroot the root (runc's pivot_root(".", ".") trick: the old root, the
    //    staging tmpfs with the host's tree at /oldroot, ends up stacked on the new one), then
    //    detach the staging tmpfs and the host's tree below it in one lazy unmount: each
    //    unmount waits for an RCU grace period (`namespace_unlock`), 0.1-0.2 ms here.
    nix::unistd::chdir(new).map_err(sys("chdir", new))?;
    let here = Path::new(".");
    nix::unistd::pivot_root(here, here).map_err(sys("pivot_root into", new))?;
    umount2(here, MntFlags::MNT_DETACH).map_err(sys("detach staging and the host", here))?;
    nix::unistd::chdir(root).map_err(sys("chdir", root))?;
    Ok(())
}

/// What the plan mounts where, parents before children (by depth).
fn entries(plan: &MountPlan) -> Result<Vec<(PathBuf, Entry)>> {
    let mut entries: Vec<(PathBuf, Entry)> = Vec::new();
    if plan.root == RootMode::Host {
        // Every top-level directory becomes a mount point of its own, so that the root itself
        // can be sealed read-only (step 5) while they stay writable: nothing at the top (a
        // /lib -> usr/lib link, /etc) can be renamed or replaced.
        for entry in std::fs::read_dir(OLD)
            .map_err(io("list", Path::new(OLD)))?
            .flatten()
        {
            let top = Path::new("/").join(entry.file_name());
            let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
            if is_dir
                && !["/proc", "/dev", "/sys"]
                    .iter()
                    .any(|s| top == Path::new(s))
            {
                entries.push((top, Entry::Pin));
            }
        }
    }
    // Deeper directories on the way to the loader's files (top-level ones are pinned above).
    entries.extend(
        plan.pins
            .iter()
            .filter(|p| plan.root != RootMode::Host || p.components().count() > 2)
            .map(|p| (p.clone(), Entry::Pin)),
    );
    entries.extend(plan.read_only.iter().map(|p| (p.clone(), Entry::ReadOnly)));
    entries.extend(plan.writable.iter().map(|p| (p.clone(), Entry::Writable)));
    entries.extend(plan.hidden.iter().map(|p| (p.clone(), Entry::Hidden)));
    entries.extend(
        plan.tmpfs
            .iter()
            .map(|(p, size)| (p.clone(), Entry::Tmpfs(*size))),
    );
    entries.extend(
        plan.files
            .iter()
            .map(|(path, source)| (path.clone(), Entry::File(source.clone()))),
    );
    entries.push(("/dev".into(), Entry::Dev));
    entries.push(("/dev/pts".into(), Entry::Pts));
    entries.push(("/proc".into(), Entry::Proc));
    entries.sort_by_key(|(path, _)| path.components().count());
    if let Some((path, _)) = entries.iter().find(|(path, _)| !path.is_absolute()) {
        return Err(MountError::Relative(path.clone()));
    }
    Ok(entries)
}

/// The mounts that must be each command's own: its tmpfs mounts, its /proc and its devpts
/// (a shared one would let a command open another's terminal: same uid). Everything the plan
/// puts inside them is the command's too.
fn per_command_roots(entries: &[(PathBuf, Entry)]) -> Vec<PathBuf> {
    entries
        .iter()
        .filter(|(_, e)| matches!(e, Entry::Tmpfs(_) | Entry::Proc | Entry::Pts))
        .map(|(p, _)| p.clone())
        .collect()
}

/// A host path the command's part of its root binds, looked at (and, for a directory or a
/// file, copied as a detached mount) while the host's mount namespace is still ours.
#[derive(Debug)]
enum HostSource {
    Missing,
    Link(PathBuf),
    /// A directory or a file: a detached copy of its mount, or (`None`) bound by path.
    Tree {
        mount: Option<OwnedFd>,
        dir: bool,
    },
}

/// What [`finish_root`] needs from the host, made by [`prepare_finish`].
#[derive(Debug, Default)]
pub struct FinishSources(Vec<(PathBuf, HostSource)>);

/// In the host's mount namespace, before entering a copy of the template: detached copies
/// (`open_tree(OPEN_TREE_CLONE)`, Linux 5.2) of the host paths the command's part of its root
/// binds (a workspace under /tmp). Most plans bind none.
pub fn prepare_finish(plan: &MountPlan) -> Result<FinishSources> {
    let entries = entries_without_host_root(plan)?;
    let own = per_command_roots(&entries);
    let mut sources = Vec::new();
    for (path, entry) in &entries {
        if !matches!(entry, Entry::ReadOnly | Entry::Writable)
            || !own.iter().any(|r| path.starts_with(r))
        {
            continue;
        }
        // Absolute (checked by `entries`): the host's own path, our namespace still the host's.
        let found = match std::fs::symlink_metadata(path) {
            Err(_) => HostSource::Missing,
            Ok(meta) if meta.file_type().is_symlink() => {
                HostSource::Link(std::fs::read_link(path).map_err(io("readlink", path))?)
            }
            Ok(meta) => HostSource::Tree {
                mount: Some(crate::sys::clone_mount(path).map_err(io("open_tree", path))?),
                dir: meta.is_dir(),
            },
        };
        sources.push((path.clone(), found));
    }
    Ok(FinishSources(sources))
}

/// [`entries`] of a plan whose root is its own (no host tree to list).
fn entries_without_host_root(plan: &MountPlan) -> Result<Vec<(PathBuf, Entry)>> {
    if plan.root == RootMode::Host {
        return Err(MountError::NotSplit);
    }
    entries(plan)
}

/// In a copy of the template's mount namespace (entered, then unshared): mount the command's
/// own part of `plan` onto the template's mount points, parents before children.
pub fn finish_root(plan: &MountPlan, sources: FinishSources) -> Result<()> {
    let entries = entries_without_host_root(plan)?;
    let own = per_command_roots(&entries);
    let mut builder = Builder::new(plan, Stage::Finish);
    builder.sources = sources.0;
    let empty = Path::new(TEMPLATE_EMPTY_FILE);
    builder.empty = Some(open_path(empty)?);
    for (path, entry) in &entries {
        if own.iter().any(|r| path.starts_with(r)) {
            builder.apply(path, entry)?;
        }
    }
    builder.seal()?;
    let root = Path::new("/");
    nix::unistd::chdir(root).map_err(sys("chdir", root))
}

struct Builder {
    stage: Stage,
    /// Whether mount points may be created: always in an empty root (a tmpfs of ours), never
    /// in the host's tree except inside covers and tmpfs mounts we made.
    may_create: bool,
    covers: Vec<PathBuf>,
    /// Mounts of ours (covers, tmpfs) inside which mount points may be created.
    created_roots: Vec<PathBuf>,
    /// [`Stage::Finish`]: the host paths it binds, prepared before the host was left.
    sources: Vec<(PathBuf, HostSource)>,
    /// [`Stage::Finish`]: the template's empty file, open (`O_PATH`) before /proc covers it.
    empty: Option<OwnedFd>,
}

impl Builder {
    fn new(plan: &MountPlan, stage: Stage) -> Self {
        Self {
            stage,
            may_create: plan.root == RootMode::Empty,
            covers: Vec::new(),
            created_roots: Vec::new(),
            sources: Vec::new(),
            empty: None,
        }
    }

    /// Where a sandbox path is while building: under /newroot, or, finishing a copy of the
    /// template (already our root), the path itself.
    fn target(&self, path: impl AsRef<Path>) -> PathBuf {
        let path = path.as_ref();
        match self.stage {
            Stage::Finish => path.to_path_buf(),
            Stage::Whole | Stage::Template => {
                Path::new(NEW).join(path.strip_prefix("/").unwrap_or(path))
            }
        }
    }

    /// Cover the file `target` with an empty one: the staging root's, or, finishing a copy
    /// of the template, a copy of the template's.
    fn cover_file(&self, target: &Path) -> Result<()> {
        match &self.empty {
            Some(empty) => {
                let copy = crate::sys::clone_mount_of(empty.as_fd())
                    .map_err(io("open_tree", Path::new(TEMPLATE_EMPTY_FILE)))?;
                crate::sys::attach_mount(&copy, target).map_err(io("move_mount onto", target))
            }
            None => bind(Path::new(EMPTY_FILE), target),
        }
    }

    fn can_create(&self, target: &Path) -> bool {
        self.may_create || self.created_roots.iter().any(|r| target.starts_with(r))
    }

    /// Covers were writable so mount points could be made inside them; now seal them.
    fn seal(&self) -> Result<()> {
        for cover in &self.covers {
            remount(
                cover,
                MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            )?;
        }
        Ok(())
    }

    fn apply(&mut self, path: &Path, entry: &Entry) -> Result<()> {
        if path == Path::new("/") {
            // The root itself was set up in step 3 (the host's tree, writable, with its
            // submounts); a plain bind here would drop those submounts.
            return Ok(());
        }
        let target = self.target(path);
        match entry {
            Entry::ReadOnly | Entry::Writable => {
                let read_only = *entry == Entry::ReadOnly;
                let (mount, dir) = match self.host_source(path)? {
                    HostSource::Missing => return Ok(()), // Not on this host: skip.
                    HostSource::Link(link) => {
                        // Recreate the link (merged-/usr systems have /bin -> usr/bin).
                        if self.can_create(&target) && std::fs::symlink_metadata(&target).is_err() {
                            create_parent(&target)?;
                            std::os::unix::fs::symlink(&link, &target)
                                .map_err(io("symlink", &target))?;
                        }
                        return Ok(());
                    }
                    HostSource::Tree { mount, dir } => (mount, dir),
                };
                if !self.mount_point(&target, dir)? {
                    return Ok(());
                }
                match mount {
                    Some(mount) => crate::sys::attach_mount(&mount, &target)
                        .map_err(io("move_mount onto", &target))?,
                    None => bind(&from_host(path), &target)?,
                }
                let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
                if read_only {
                    flags |= MsFlags::MS_RDONLY;
                }
                remount(&target, flags)
            }
            Entry::Hidden => {
                let Ok(meta) = std::fs::symlink_metadata(&target) else {
                    return Ok(()); // Nothing there to hide.
                };
                if meta.is_dir() {
                    tmpfs(&target, "mode=0755,size=64k")?;
                    self.covers.push(target.clone());
                    self.created_roots.push(target);
                } else {
                    self.cover_file(&target)?;
                    remount(
                        &target,
                        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                    )?;
                }
                Ok(())
            }
            Entry::Tmpfs(size) => {
                if !self.mount_point(&target, true)? {
                    return Ok(());
                }
                tmpfs(&target, &format!("mode=1777,size={size}"))?;
                self.created_roots.push(target);
                Ok(())
            }
            Entry::Dev => self.minimal_dev(&target),
            Entry::Pts => own_devpts(&target),
            Entry::Proc => self.fresh_proc(&target),
            Entry::File(source) => {
                // Fail closed: the daemon asked for this file (a network policy's resolver),
                // so a sandbox without it is not the one it planned. The mount point must be
                // a file already (a symlink would be followed outside the new root).
                let is_file = std::fs::symlink_metadata(&target).is_ok_and(|m| m.is_file());
                if !is_file && !self.mount_point(&target, false)? {
                    return Err(MountError::Io {
                        op: "bind a generated file onto",
                        path: path.to_path_buf(),
                        source: std::io::Error::other(
                            "no regular file there to cover (a symlink or nothing)",
                        ),
                    });
                }
                bind(&from_host(source), &target)?;
                remount(
                    &target,
                    MsFlags::MS_RDONLY
                        | MsFlags::MS_NOSUID
                        | MsFlags::MS_NODEV
                        | MsFlags::MS_NOEXEC,
                )
            }
            Entry::Pin => {
                if std::fs::symlink_metadata(&target).is_ok_and(|m| m.is_dir()) {
                    mount(
                        Some(&target),
                        &target,
                        None::<&str>,
                        MsFlags::MS_BIND | MsFlags::MS_REC,
                        None::<&str>,
                    )
                    .map_err(sys("pin", &target))?;
                }
                Ok(())
            }
        }
    }

    /// What the host has at `path`: read under /oldroot while building from the staging
    /// root, or taken from what [`prepare_finish`] found (a detached mount to attach).
    fn host_source(&mut self, path: &Path) -> Result<HostSource> {
        if self.stage == Stage::Finish {
            let at = self.sources.iter().position(|(p, _)| p == path);
            return Ok(at.map_or(HostSource::Missing, |at| self.sources.remove(at).1));
        }
        let source = from_host(path);
        Ok(match std::fs::symlink_metadata(&source) {
            Err(_) => HostSource::Missing,
            Ok(meta) if meta.file_type().is_symlink() => {
                HostSource::Link(std::fs::read_link(&source).map_err(io("readlink", &source))?)
            }
            // Bound by its path under /oldroot (no descriptor needed while the host is in
            // reach).
            Ok(meta) => HostSource::Tree {
                mount: None,
                dir: meta.is_dir(),
            },
        })
    }

    /// Make sure `target` exists to mount on; false when it does not and may not be made.
    fn mount_point(&self, target: &Path, dir: bool) -> Result<bool> {
        if std::fs::symlink_metadata(target).is_ok() {
            return Ok(true);
        }
        if !self.can_create(target) {
            return Ok(false);
        }
        if dir {
            mkdir(target)?;
        } else {
            create_parent(target)?;
            std::fs::File::create(target).map_err(io("create", target))?;
        }
        Ok(true)
    }

    /// A tmpfs /dev with only harmless device nodes: no disks, no /dev/mem, no terminal but
    /// the caller's own (`/dev/tty`) and those of its own devpts instance.
    fn minimal_dev(&mut self, target: &Path) -> Result<()> {
        if !self.mount_point(target, true)? {
            return Ok(());
        }
        // nodev on the tmpfs itself: a node made with mknod here would not work; the bound
        // nodes below keep the flags of the host's /dev mount.
        tmpfs(target, "mode=0755,size=64k")?;
        self.created_roots.push(target.to_path_buf());
        for name in DEVICES {
            let node = target.join(name);
            std::fs::File::create(&node).map_err(io("create", &node))?;
            bind(&from_host(&Path::new("/dev").join(name)), &node)?;
        }
        for (link, to) in [
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
            // The multiplexer of the command's own devpts instance (devpts.rst,
            // "newinstance"): terminals made here are numbered and found there.
            ("ptmx", "pts/ptmx"),
        ] {
            let path = target.join(link);
            std::os::unix::fs::symlink(to, &path).map_err(io("symlink", &path))?;
        }
        mkdir(&target.join("shm"))?;
        Ok(())
    }
}

/// A devpts instance of the command's own at `target` (Documentation/filesystems/devpts.rst):
/// it holds only the terminals the command makes (`script`, editors), numbered from 0, none of
/// another sandbox's or of the host's; `ptmxmode=0666` lets the command's uid make them, and
/// each terminal belongs to the uid that made it (`mode=0620`).
fn own_devpts(target: &Path) -> Result<()> {
    if std::fs::symlink_metadata(target).is_err() {
        mkdir(target)?;
    }
    mount(
        Some("devpts"),
        target,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )
    .map_err(sys("mount devpts on", target))
}

impl Builder {
    /// A new procfs: it shows the pid namespace of the mounting process (ours), so only the
    /// command's processes. Host-wide knobs under it are made read-only or masked.
    fn fresh_proc(&self, target: &Path) -> Result<()> {
        if !self.mount_point(target, true)? {
            return Ok(());
        }
        mount(
            Some("proc"),
            target,
            Some("proc"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            None::<&str>,
        )
        .map_err(sys("mount proc on", target))?;
        for dir in PROC_READ_ONLY {
            let path = target.join(dir);
            if path.is_dir() {
                bind(&path, &path)?;
                remount(
                    &path,
                    MsFlags::MS_RDONLY
                        | MsFlags::MS_NOSUID
                        | MsFlags::MS_NODEV
                        | MsFlags::MS_NOEXEC,
                )?;
            }
        }
        for file in PROC_MASKED {
            let path = target.join(file);
            if path.exists() {
                self.cover_file(&path)?;
                remount(
                    &path,
                    MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                )?;
            }
        }
        Ok(())
    }
}

/// Where a host path is while building: under /oldroot.
fn from_host(path: &Path) -> PathBuf {
    Path::new(OLD).join(path.strip_prefix("/").unwrap_or(path))
}

/// `path` open as `O_PATH`: something to clone a mount of later.
fn open_path(path: &Path) -> Result<OwnedFd> {
    nix::fcntl::open(
        path,
        nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(sys("open", path))
}

fn mkdir(path: &Path) -> Result<()> {
    match std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(path)
    {
        Ok(()) => Ok(()),
        Err(e) => Err(io("mkdir", path)(e)),
    }
}

fn create_parent(path: &Path) -> Result<()> {
    match path.parent() {
        Some(parent) => mkdir(parent),
        None => Ok(()),
    }
}

/// Non-recursive bind: submounts of the source stay out, so none of them escapes the
/// read-only remount that follows.
fn bind(source: &Path, target: &Path) -> Result<()> {
    mount(
        Some(source),
        target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(sys("bind onto", target))
}

/// Change the flags of the bind mount at `target` (a bind mount's own flags can only be set
/// by remounting it).
fn remount(target: &Path, flags: MsFlags) -> Result<()> {
    mount(
        None::<&str>,
        target,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | flags,
        None::<&str>,
    )
    .map_err(sys("remount", target))
}

fn tmpfs(target: &Path, options: &str) -> Result<()> {
    mount(
        Some("tmpfs"),
        target,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(options),
    )
    .map_err(sys("mount tmpfs on", target))?;
    // tmpfs honours mode= only at creation; keep it explicit for sticky /tmp.
    if options.starts_with("mode=1777") {
        let _ = std::fs::set_permissions(target, std::fs::Permissions::from_mode(0o1777));
    }
    Ok(())
}
