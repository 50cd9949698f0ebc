//! cgroups: one cgroup per command in each usable hierarchy.
//!
//! The daemon owns `<its cgroup>/executor-<pid>-ns<pid namespace>/` in each hierarchy; each
//! command gets `cmd-<serial>/` below it. The pid namespace is in the name because daemons in
//! different pid namespaces (containers sharing a cgroup tree, CI running in one) may have the
//! same pid: without it they would share, kill and remove each other's cgroups.
//!
//! Three host shapes:
//! - **cgroup v2** (Debian 11+, Ubuntu 22.04+, RHEL 9, Kubernetes nodes, containers on them):
//!   one hierarchy gives placement, `cgroup.kill` (Linux 5.14) and the `pids` and `memory`
//!   controllers. A cgroup that enables controllers for its children may hold no process
//!   (the "no internal processes" rule, Documentation/admin-guide/cgroup-v2.rst), so when the
//!   daemon's own cgroup must enable them, the daemon first moves itself into a leaf of its
//!   own, `executor-<pid>-ns<ns>-daemon`, beside the commands' parent.
//! - **hybrid** (this project's CI): a bare cgroup2 mount for placement and `cgroup.kill`, the
//!   controllers in v1 hierarchies, used for the limits.
//! - **v1 only**, or no writable cgroups at all (an unprivileged container): limits fall back to
//!   rlimits, and whole trees die by the pid namespace and the helper's subreaper sweep.
//!
//! `executor check` and the hello say which shape was found and what it gives.

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A warning in the daemon's log, with the target its lines had while this module was part of
/// the executor's binary, so that the log and `RUST_LOG` filters read as before.
macro_rules! warn {
    ($($arg:tt)*) => {
        tracing::warn!(target: "executor::cgroup", $($arg)*)
    };
}

/// One cgroup hierarchy the daemon uses: where its commands go, and where helpers go back to.
#[derive(Debug, Clone, PartialEq)]
pub struct Hierarchy {
    /// `<home>/executor-<pid>-ns<inode>`, parent of every command cgroup of this daemon.
    pub parent: PathBuf,
    /// The daemon's own cgroup in this hierarchy: a helper that had to join a command's
    /// cgroup to place its child there moves back here, so killing the command never kills it.
    pub back: PathBuf,
}

/// Where a per-command limit comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum Controller {
    /// The controller is enabled in the unified (v2) hierarchy: set on the command's cgroup2
    /// directory.
    Unified,
    /// A v1 hierarchy of its own.
    V1(Hierarchy),
}

impl Controller {
    /// `v2` or `v1`, for reports.
    pub fn version(&self) -> &'static str {
        match self {
            Self::Unified => "v2",
            Self::V1(_) => "v1",
        }
    }
}

/// The hierarchies available on this host.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CgroupRoot {
    /// cgroup v2: placement (and the controllers marked [`Controller::Unified`]).
    pub unified: Option<Hierarchy>,
    /// Whether the unified hierarchy has `cgroup.kill` (Linux 5.14); without it a cgroup is
    /// killed by signalling every process it lists until none is left.
    pub kill: bool,
    /// Whether `memory.swap.max` exists (swap accounting on), so a command's swap can be cut.
    pub swap: bool,
    /// The process limit's controller, if any.
    pub pids: Option<Controller>,
    /// The memory limit's controller, if any.
    pub memory: Option<Controller>,
    /// Each parent is the cgroup of the one command there will be ([`Placement::one_command`]).
    pub one_command: bool,
}

impl CgroupRoot {
    /// Every hierarchy the daemon made a parent in.
    pub fn all(&self) -> impl Iterator<Item = &Hierarchy> {
        let v1 = |c: &Option<Controller>| match c {
            Some(Controller::V1(h)) => Some(h.clone()),
            _ => None,
        };
        let mut all: Vec<&Hierarchy> = self.unified.iter().collect();
        let owned: Vec<Hierarchy> = [v1(&self.pids), v1(&self.memory)]
            .into_iter()
            .flatten()
            .collect();
        // Borrow the v1 hierarchies from self (the clones above only found them).
        for c in [&self.pids, &self.memory] {
            if let Some(Controller::V1(h)) = c {
                if owned.contains(h) {
                    all.push(h);
                }
            }
        }
        all.into_iter()
    }

    /// Whether a command's move into its cgroups may wait for a normal RCU grace period: v1
    /// hierarchies need the move, the kernel (`release`) is older than the one whose
    /// self-moves skip the lock ([`join_process`]) and grace periods are not `expedited`
    /// ([`grace_periods_expedited`], [`warm_attach`]). (cgroup2's `favordynmods`, which also
    /// removes the wait, came later, in 6.0.)
    pub fn attach_may_wait(&self, release: &str, expedited: bool) -> bool {
        let v1 = [&self.pids, &self.memory]
            .iter()
            .any(|c| matches!(c, Some(Controller::V1(_))));
        v1 && !self_moves_skip_the_lock(release) && !expedited
    }

    /// The host's shape as `executor check` and the hello name it.
    pub fn mode(&self) -> &'static str {
        let v1 = [&self.pids, &self.memory]
            .iter()
            .any(|c| matches!(c, Some(Controller::V1(_))));
        match (self.unified.is_some(), v1) {
            (true, false) => "v2",
            (true, true) => "hybrid",
            (false, true) => "v1",
            (false, false) => "none",
        }
    }

    /// What the hello tells clients.
    pub fn facts(&self) -> protocol::CgroupFacts {
        let via = |c: &Option<Controller>| c.as_ref().map_or("rlimit", Controller::version);
        protocol::CgroupFacts {
            mode: self.mode().to_string(),
            kill: self.unified.is_some() && self.kill,
            pids: via(&self.pids).to_string(),
            memory: via(&self.memory).to_string(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no {0} hierarchy is mounted")]
    NotMounted(&'static str),
    #[error("cannot tell this process's {0} cgroup from /proc/self/cgroup")]
    UnknownOwnCgroup(&'static str),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The daemon may not write the cgroup tree it would make its commands' cgroups in.
    #[error(
        "cannot create the commands' parent cgroup {path}: {source}. Give the daemon a cgroup \
         tree it may write ({fix})"
    )]
    CreateParent {
        path: PathBuf,
        #[source]
        source: io::Error,
        fix: &'static str,
    },
}

/// How to give the daemon a writable cgroup2 tree, for start-up messages.
const UNIFIED_FIX: &str = "systemd: Delegate=yes on its service; a container: writable \
                           cgroups; or name a writable cgroup2 directory with --cgroup-parent";
/// The same for a v1 controller's hierarchy (`--cgroup-parent` names a cgroup2 directory).
const V1_FIX: &str = "run it as root; in a container, with writable cgroups (--privileged)";

/// Create `dir`, the daemon's parent of its commands' cgroups, or say how to make it possible.
fn create_parent(dir: &Path, fix: &'static str) -> Result<(), CgroupError> {
    create_if_missing(dir).map_err(|err| match err {
        CgroupError::Io { path, source } => CgroupError::CreateParent { path, source, fix },
        other => other,
    })
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// How [`prepare`] may arrange the daemon's own cgroup.
#[derive(Debug, Clone, Default)]
pub struct Placement {
    /// A cgroup2 directory to make the commands' parent in, instead of the daemon's own
    /// cgroup (`--cgroup-parent`).
    pub parent_of_parent: Option<PathBuf>,
    /// The daemon may move itself into a leaf of its own (`serve`, before it starts any other
    /// process): needed where its cgroup must enable controllers for its children. `run` and
    /// `check` share their cgroup with the shell that started them and never move.
    pub move_into_leaf: bool,
    /// One command only (`executor run`): its cgroups are the parents themselves, made
    /// before the command's helper starts and removed after it is gone, so the command's path
    /// makes and removes no directory of its own (a `mkdir` and an `rmdir` a hierarchy, each
    /// the kernel's set-up or teardown of the controllers' state and files). Dead runs'
    /// directories are not swept here but after the run, by its fork server.
    pub one_command: bool,
}

/// A /proc file's text, empty if unreadable. Its size says 0, so `read_to_string` would start
/// with a 32-byte read and double from there (eight reads for a mount table); into room made
/// beforehand it reads 8 KiB at a time (std's cap for a file of unknown size), which takes
/// the tables of most hosts in one read and the end-of-file.
fn read_proc(path: &str) -> String {
    use std::io::Read;
    let mut text = String::with_capacity(16 * 1024);
    match std::fs::File::open(path).and_then(|mut f| f.read_to_string(&mut text)) {
        Ok(_) => text,
        Err(_) => String::new(),
    }
}

/// Find the hierarchies, create the daemon's parent cgroup in each, and remove what dead
/// daemons left behind (not for [`Placement::one_command`]). A hierarchy or controller that
/// cannot be used is logged, with the path and what would fix it, and left out.
pub fn prepare(daemon_pid: u32, placement: &Placement) -> CgroupRoot {
    let mountinfo = read_proc("/proc/self/mountinfo");
    let own = read_proc("/proc/self/cgroup");
    let mut root = CgroupRoot {
        one_command: placement.one_command,
        ..CgroupRoot::default()
    };
    let name = format!("executor-{daemon_pid}-ns{}", pid_namespace());
    match prepare_unified(&mountinfo, &own, &name, placement) {
        Ok(unified) => {
            root.kill = unified.hierarchy.parent.join("cgroup.kill").exists();
            if !root.kill {
                warn!(
                    "cgroup.kill is missing (it needs Linux 5.14): whole trees are killed by \
                     signalling every process of a command's cgroup, its pid namespace and the \
                     helper's sweep"
                );
            }
            root.swap = unified.hierarchy.parent.join("memory.swap.max").exists();
            if unified.pids {
                root.pids = Some(Controller::Unified);
            }
            if unified.memory {
                root.memory = Some(Controller::Unified);
            }
            root.unified = Some(unified.hierarchy);
        }
        Err(err) => warn!(
            %err,
            "cgroup v2 unavailable: commands get no cgroup2 directory; whole trees die by the \
             pid namespace and the helper's sweep"
        ),
    }
    for (slot, controller) in [(&mut root.pids, "pids"), (&mut root.memory, "memory")] {
        if slot.is_some() {
            continue;
        }
        match prepare_v1(controller, &mountinfo, &own, &name, !placement.one_command) {
            Ok(h) => *slot = Some(Controller::V1(h)),
            Err(CgroupError::NotMounted(_)) if root.unified.is_some() => warn!(
                controller,
                "the {controller} controller is neither enabled in cgroup v2 nor mounted as \
                 cgroup v1: its per-command limit falls back to an rlimit"
            ),
            Err(err) => warn!(
                %err,
                controller,
                "cgroup v1 controller unavailable: its per-command limit falls back to an rlimit"
            ),
        }
    }
    root
}

/// The unified hierarchy as prepared: the parent, and which controllers it enables.
struct PreparedUnified {
    hierarchy: Hierarchy,
    pids: bool,
    memory: bool,
}

fn prepare_unified(
    mountinfo: &str,
    own: &str,
    name: &str,
    placement: &Placement,
) -> Result<PreparedUnified, CgroupError> {
    let own_dir = own_dir(mountinfo, own, Kind::Unified, "cgroup2")?;
    let home = placement
        .parent_of_parent
        .clone()
        .unwrap_or_else(|| own_dir.clone());
    if !placement.one_command {
        remove_stale(&home);
    }
    let mut back = own_dir;
    // The controllers this cgroup may hand to its children (none on a hybrid host, where
    // they are bound to v1 hierarchies).
    let offered = get(&home, "cgroup.controllers");
    let wanted: Vec<&str> = ["pids", "memory"]
        .into_iter()
        .filter(|c| offered.split_whitespace().any(|o| o == *c))
        .collect();
    let mut enabled = enable(&home, &wanted);
    if enabled.is_err() && placement.move_into_leaf && placement.parent_of_parent.is_none() {
        // EBUSY: our own cgroup holds processes (us, at least). Move into a leaf of our own
        // and try again; processes that are not ours still block it.
        let leaf = home.join(format!("{name}-daemon"));
        let moved = create_if_missing(&leaf).and_then(|()| join_process(&leaf));
        match moved {
            Ok(()) => {
                back = leaf;
                enabled = enable(&home, &wanted);
            }
            Err(err) => warn!(%err, "cannot move the daemon into a cgroup of its own"),
        }
    }
    let wanted = match enabled {
        Ok(()) => wanted,
        Err(err) => {
            if !wanted.is_empty() {
                warn!(
                    %err,
                    cgroup = %home.display(),
                    "cannot enable the pids and memory controllers for commands: {} holds \
                     other processes or may not be changed. Give the daemon a cgroup of its \
                     own (systemd: Delegate=yes; a container: the daemon as its only process), \
                     or name a writable cgroup2 directory with --cgroup-parent. Per-command \
                     limits fall back to rlimits",
                    home.display()
                );
            }
            Vec::new()
        }
    };
    let parent = home.join(name);
    create_parent(&parent, UNIFIED_FIX)?;
    // The parent holds no process: it can pass the controllers on to each command's cgroup.
    // The one command's own cgroup passes nothing on: cgroup2 puts no process in a cgroup
    // whose controllers are enabled for children, and its own come from `home`'s.
    let enabled = if placement.one_command {
        Ok(())
    } else {
        enable(&parent, &wanted)
    };
    let wanted = match enabled {
        Ok(()) => wanted,
        Err(err) => {
            warn!(%err, "cannot enable controllers below {}", parent.display());
            Vec::new()
        }
    };
    Ok(PreparedUnified {
        hierarchy: Hierarchy { parent, back },
        pids: wanted.contains(&"pids"),
        memory: wanted.contains(&"memory"),
    })
}

/// Enable `controllers` for the children of `dir` (a no-op for those already enabled).
fn enable(dir: &Path, controllers: &[&str]) -> Result<(), CgroupError> {
    let on = get(dir, "cgroup.subtree_control");
    let missing: Vec<String> = controllers
        .iter()
        .filter(|c| !on.split_whitespace().any(|o| o == **c))
        .map(|c| format!("+{c}"))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    set(dir, "cgroup.subtree_control", &missing.join(" "))
}

fn create_if_missing(dir: &Path) -> Result<(), CgroupError> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io_err(dir)(e)),
    }
}

fn prepare_v1(
    controller: &'static str,
    mountinfo: &str,
    own: &str,
    name: &str,
    sweep: bool,
) -> Result<Hierarchy, CgroupError> {
    let home = own_dir(mountinfo, own, Kind::V1(controller), controller)?;
    if sweep {
        remove_stale(&home);
    }
    let parent = home.join(name);
    create_parent(&parent, V1_FIX)?;
    Ok(Hierarchy { parent, back: home })
}

/// Bounds on all commands of the daemon together, set on its parent cgroups: per-command
/// limits alone let 64 concurrent commands ask for 64 times as much.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TotalLimits {
    pub processes: u64,
    pub memory_bytes: u64,
}

impl TotalLimits {
    /// Three quarters of the host's pid space and memory: the rest stays for the host.
    pub fn host_default() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        let pid_max: u64 = read("/proc/sys/kernel/pid_max")
            .trim()
            .parse()
            .unwrap_or(32768);
        let mem_kib: u64 = read("/proc/meminfo")
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(4 * 1024 * 1024);
        Self {
            processes: pid_max / 4 * 3,
            memory_bytes: mem_kib * 1024 / 4 * 3,
        }
    }
}

/// Set `limits` on the daemon's parent cgroups. A controller that is missing, or a v1 memory
/// hierarchy without `use_hierarchy` (where a parent's limit would not cover its children), is
/// reported and skipped.
pub fn limit_all(root: &CgroupRoot, limits: TotalLimits) {
    let processes = limits.processes.to_string();
    let memory = limits.memory_bytes.to_string();
    let (pids_at, pids_file) = match &root.pids {
        Some(Controller::Unified) => (root.unified.as_ref(), "pids.max"),
        Some(Controller::V1(h)) => (Some(h), "pids.max"),
        None => (None, ""),
    };
    if let Some(h) = pids_at {
        if let Err(err) = set(&h.parent, pids_file, &processes) {
            warn!(%err, "cannot bound the processes of all commands together");
        }
    }
    let memory_at = match &root.memory {
        Some(Controller::Unified) => root.unified.as_ref().map(|h| (h, "memory.max")),
        Some(Controller::V1(h)) if get(&h.parent, "memory.use_hierarchy") == "1" => {
            Some((h, "memory.limit_in_bytes"))
        }
        Some(Controller::V1(_)) => {
            warn!(
                "memory.use_hierarchy is off: the memory of all commands together is not bounded"
            );
            None
        }
        None => None,
    };
    if let Some((h, file)) = memory_at {
        if let Err(err) = set(&h.parent, file, &memory) {
            warn!(%err, "cannot bound the memory of all commands together");
        }
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Unified,
    V1(&'static str),
}

/// Where this process's cgroup of a hierarchy lies: the mount point, and below it the
/// process's path (/proc/self/cgroup) taken relative to the mount's root. A container without
/// a cgroup namespace mounts only its own subtree (root `/libpod_parent/libpod-<id>`) while
/// /proc/self/cgroup names the full path.
fn own_dir(
    mountinfo: &str,
    own: &str,
    kind: Kind,
    name: &'static str,
) -> Result<PathBuf, CgroupError> {
    let (mount, root) = mount_point(mountinfo, kind).ok_or(CgroupError::NotMounted(name))?;
    let path = own_path(own, kind).ok_or(CgroupError::UnknownOwnCgroup(name))?;
    let below = Path::new(&path)
        .strip_prefix(&root)
        .map_err(|_| CgroupError::UnknownOwnCgroup(name))?;
    Ok(mount.join(below))
}

/// Mount point and root of a hierarchy, from /proc/self/mountinfo (proc(5)): the cgroup2
/// mount, or the v1 mount whose super options name the controller.
fn mount_point(mountinfo: &str, kind: Kind) -> Option<(PathBuf, PathBuf)> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mut fields = right.split_whitespace();
        let fstype = fields.next()?;
        let options = fields.nth(1).unwrap_or_default();
        let wanted = match kind {
            Kind::Unified => fstype == "cgroup2",
            Kind::V1(controller) => {
                fstype == "cgroup" && options.split(',').any(|o| o == controller)
            }
        };
        if !wanted {
            return None;
        }
        let mut fields = left.split_whitespace();
        let root = fields.nth(3)?;
        let point = fields.next()?;
        Some((PathBuf::from(point), PathBuf::from(root)))
    })
}

/// Whether `/sys/kernel/rcu_expedited` reads 1: every grace period the kernel waits for is an
/// expedited one (tens of microseconds instead of 8-24 ms here), a move's included.
pub fn grace_periods_expedited() -> bool {
    std::fs::read_to_string("/sys/kernel/rcu_expedited").is_ok_and(|v| v.trim() == "1")
}

/// This process's path in a hierarchy, from /proc/self/cgroup (cgroups(7)): `0::<path>` for
/// cgroup2, `<n>:<controllers>:<path>` for v1.
fn own_path(proc_cgroup: &str, kind: Kind) -> Option<String> {
    proc_cgroup.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let wanted = match kind {
            Kind::Unified => controllers.is_empty(),
            Kind::V1(controller) => controllers.split(',').any(|c| c == controller),
        };
        wanted.then(|| path.to_string())
    })
}

/// Inode of our pid namespace: pids are only comparable within one.
pub fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

/// The pid in an `executor-<pid>-ns<ns>[-daemon]` name of our pid namespace.
fn daemon_of(name: &str, ns_suffix: &str) -> Option<u32> {
    let rest = name.strip_prefix("executor-")?;
    let rest = rest.strip_suffix("-daemon").unwrap_or(rest);
    rest.strip_suffix(ns_suffix)?.parse().ok()
}

/// Remove the cgroups of dead daemons and runs of our pid namespace in `home` (a daemon killed
/// by SIGKILL cannot remove its own; its commands died with it). Those of other namespaces
/// are not ours to judge: their pids mean nothing here. A daemon sweeps at its start
/// ([`prepare`]); a one-shot run leaves it to its fork server, after the run
/// (`spawner::Leftover::StaleCgroups`).
pub fn remove_stale(home: &Path) {
    let Ok(entries) = std::fs::read_dir(home) else {
        return;
    };
    let ours = format!("-ns{}", pid_namespace());
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| daemon_of(n, &ours)) else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        remove_tree(&entry.path());
    }
}

/// Kill and remove every command cgroup below the parent `dir`, then `dir`: a daemon's at its
/// end (idle workers and the fork server's free directories are below it) or a dead one's.
pub fn remove_tree(dir: &Path) {
    if let Ok(commands) = std::fs::read_dir(dir) {
        for cmd in commands.flatten().filter(|e| e.path().is_dir()) {
            kill(&cmd.path());
            remove(&cmd.path());
        }
    }
    remove(dir);
}

/// Create a command's cgroup.
pub fn create(dir: &Path) -> Result<(), CgroupError> {
    std::fs::create_dir(dir).map_err(io_err(dir))
}

/// Write one setting (`pids.max`, `memory.max`, ...) of a command's cgroup.
pub fn set(dir: &Path, file: &str, value: &str) -> Result<(), CgroupError> {
    let path = dir.join(file);
    std::fs::write(&path, value).map_err(io_err(&path))
}

/// One setting's current value, trimmed; empty if unreadable.
pub fn get(dir: &Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Open a counter file of `dir` to read it later with [`read_counter`].
pub fn open_counter(dir: &Path, file: &str) -> io::Result<OwnedFd> {
    Ok(std::fs::File::open(dir.join(file))?.into())
}

/// A counter opened by [`open_counter`], read from its start: the value of `key` in a flat
/// keyed file, or the file's one number; 0 if unreadable (its cgroup removed).
pub fn read_counter(file: &OwnedFd, key: Option<&str>) -> u64 {
    let mut buf = [0u8; 1024];
    let Ok(n) = nix::sys::uio::pread(file, &mut buf, 0) else {
        return 0;
    };
    let text = String::from_utf8_lossy(&buf[..n]);
    match key {
        Some(key) => text
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or(0),
        None => text.trim().parse().unwrap_or(0),
    }
}

/// Move the calling process, which has one thread (a process just cloned, not a thread of
/// a runtime: init, a payload), into `dir`.
///
/// It moves itself through v1's `tasks` file: a thread that names itself ("0") there moves
/// without the kernel's global cgroup threadgroup rwsem (`cgroup_procs_write_start`,
/// "Optimize single thread migration", Linux 5.5). A `cgroup.procs` write takes that rwsem
/// for writing, and after a quiet spell that waits for a full RCU grace period
/// (`percpu_down_write` -> `rcu_sync_enter` -> `synchronize_rcu`): measured here (Linux 6.18,
/// 2 cores, each move after 100 ms of idleness, 2026-12-02) 11.9 ms median against 0.04
/// through `tasks`; the writer holds the cgroup mutex meanwhile, so every cgroup `mkdir`
/// waits too. In a cgroup2 directory (no `tasks`; a process moves whole there),
/// `cgroup.procs`. With one thread, moving the thread moves the process; the callers are
/// single-threaded by construction, so it is not counted per move (`/proc/self/task`, read
/// twice a command when it was).
pub fn join_alone(dir: &Path) -> Result<(), CgroupError> {
    let tasks = dir.join("tasks");
    match std::fs::OpenOptions::new().write(true).open(&tasks) {
        Ok(mut file) => {
            return io::Write::write_all(&mut file, b"0").map_err(io_err(&tasks));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&tasks)(e)),
    }
    join_process(dir)
}

/// Move the calling process, all its threads, into `dir` (`cgroup.procs`: see [`join_alone`]
/// for what that may wait for).
pub fn join_process(dir: &Path) -> Result<(), CgroupError> {
    let procs = dir.join("cgroup.procs");
    // "0" names the writing process itself (Documentation/admin-guide/cgroup-v2.rst).
    std::fs::write(&procs, "0").map_err(io_err(&procs))
}

/// Whether this kernel moves a thread that names itself in v1's `tasks` without the global
/// threadgroup rwsem, so that [`join_alone`] never waits for a grace period (Linux 5.5+).
pub fn self_moves_skip_the_lock(release: &str) -> bool {
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().unwrap_or(0));
    let version = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
    version >= (5, 5)
}

/// This kernel's release (`uname -r`), or "" where it cannot be read.
pub fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// On a kernel before 5.5, start, on a thread of its own, the wait that the first cgroup v1
/// move of this process's commands would otherwise make on their critical path ([`join_process`]):
/// a move into the cgroup this thread is already in, which changes nothing, so that the
/// grace period passes while the rest of the set-up runs (the kernel's rwsem then stays ready
/// for writers for about one more grace period after the last). Errors are of no
/// consequence and ignored. From 5.5 on the helpers' moves do not wait, and this move would
/// only hold the cgroup mutex through a grace period while they `mkdir`.
pub fn warm_attach(root: &CgroupRoot) {
    if self_moves_skip_the_lock(&kernel_release()) {
        return;
    }
    let v1 = [&root.pids, &root.memory]
        .into_iter()
        .find_map(|c| match c {
            Some(Controller::V1(h)) => Some(h.back.join("tasks")),
            _ => None,
        });
    let Some(tasks) = v1 else {
        return;
    };
    let _ = std::thread::Builder::new()
        .name("cgroup-warm".into())
        .spawn(move || {
            let _ = std::fs::write(&tasks, nix::unistd::gettid().as_raw().to_string());
        });
}

/// Pids currently in `dir`.
pub fn procs(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// SIGKILL every task in `dir` and below, stopped and signal-ignoring ones included: at once
/// with `cgroup.kill`, else by signalling every process it lists, each through a pidfd
/// confirmed by a second read of the list (`signals`: a pid freed meanwhile may be a host
/// process's). The caller repeats until none is left; a pid namespace and the helper's sweep
/// stand behind it.
pub fn kill(dir: &Path) {
    // A missing cgroup is already empty; nothing else can be done about another error here.
    if std::fs::write(dir.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    let list = || {
        std::fs::read_to_string(dir.join("cgroup.procs"))
            .ok()
            .map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect())
    };
    crate::signals::signal_listed(list, nix::sys::signal::Signal::SIGKILL);
}

/// Remove `dir` at once if it can be: `false` only while it is busy (tasks or child
/// directories still in it), for a caller that must not wait (the fork server) to try again
/// later. A directory that is gone, or that we may not remove, is done with.
pub fn try_remove(dir: &Path) -> bool {
    match std::fs::remove_dir(dir) {
        Ok(()) => true,
        Err(e) => !matches!(
            nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0)),
            nix::errno::Errno::EBUSY | nix::errno::Errno::ENOTEMPTY
        ),
    }
}

/// Remove `dir`. Reaped tasks can linger in it for a moment, and a parent stays busy until
/// its children are gone (`executor run`'s, while its helper finishes after the report), so
/// retry for up to about 100 ms: every 50 µs for the first 2 ms (what a helper's last steps
/// take), then every millisecond (a fixed 1 ms step cost a one-shot run most of a millisecond
/// for a wait of a fraction of one). The next daemon start removes what is left. Only
/// `EBUSY` (tasks or child directories still in it; `ENOTEMPTY` too, in case) is worth the
/// wait: a directory we may not remove stays as it is (an unprivileged daemon sweeping a root
/// daemon's stale ones at its start cost itself 100 ms per directory).
pub fn remove(dir: &Path) {
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_millis(100) {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e)
                if !matches!(
                    nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(0)),
                    nix::errno::Errno::EBUSY | nix::errno::Errno::ENOTEMPTY
                ) =>
            {
                return
            }
            Err(_) if started.elapsed() < Duration::from_millis(2) => {
                std::thread::sleep(Duration::from_micros(50));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

#[cfg(test)]
#[path = "cgroup_tests.rs"]
mod tests;
