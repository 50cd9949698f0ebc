//! cgroups: one cgroup per command in each usable hierarchy.
//!
//! The daemon owns `<its cgroup>/executor-<pid>-ns<pid namespace>/` in each hierarchy; each
//! command gets `cmd-<serial>/` below it. The pid namespace is in the name because daemons in
//! different pid namespaces (containers sharing a cgroup tree, CI running in one) may have the
//! same pid: without it they would share, kill and remove each other's cgroups. cgroup v2 gives placement and `cgroup.kill` (Linux 5.14), which
//! work without any controller; the v1 `pids` and `memory` controllers, where that is what the
//! host has (hybrid hosts such as this project's CI), give the process and memory limits.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// One cgroup hierarchy the daemon uses: where it lives and where its commands go.
#[derive(Debug, Clone, PartialEq)]
pub struct Hierarchy {
    /// The daemon's own cgroup, which helpers return to after placing their payload.
    pub home: PathBuf,
    /// `<home>/executor-<pid>-ns<inode>`, parent of every command cgroup of this daemon.
    pub parent: PathBuf,
}

/// The hierarchies available on this host. Hybrid hosts (like the one CI runs on) have a bare
/// cgroup2 mount for `cgroup.kill` and v1 controllers for limits.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CgroupRoot {
    /// cgroup v2: placement and `cgroup.kill`.
    pub unified: Option<Hierarchy>,
    /// The pids controller (v1), for the process limit.
    pub pids: Option<Hierarchy>,
    /// The memory controller (v1), for the memory limit.
    pub memory: Option<Hierarchy>,
}

impl CgroupRoot {
    pub fn all(&self) -> impl Iterator<Item = &Hierarchy> {
        [&self.unified, &self.pids, &self.memory]
            .into_iter()
            .flatten()
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
    #[error("{0} has no cgroup.kill (needs Linux 5.14 or later)")]
    NoKill(PathBuf),
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Find the hierarchies, create the daemon's parent cgroup in each, and remove what dead
/// daemons left behind. A hierarchy that cannot be used is logged and left out.
pub fn prepare(daemon_pid: u32) -> CgroupRoot {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let mountinfo = read("/proc/self/mountinfo");
    let own = read("/proc/self/cgroup");
    let mut root = CgroupRoot::default();
    for (slot, kind) in [
        (&mut root.unified, Kind::Unified),
        (&mut root.pids, Kind::V1("pids")),
        (&mut root.memory, Kind::V1("memory")),
    ] {
        match prepare_one(kind, &mountinfo, &own, daemon_pid) {
            Ok(h) => *slot = Some(h),
            Err(err) => tracing::warn!(%err, "cgroup hierarchy unavailable"),
        }
    }
    root
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

/// Set `limits` on the daemon's parent cgroups. A hierarchy that is missing, or a v1 memory
/// hierarchy without `use_hierarchy` (where a parent's limit would not cover its children), is
/// reported and skipped.
pub fn limit_all(root: &CgroupRoot, limits: TotalLimits) {
    if let Some(h) = &root.pids {
        if let Err(err) = set(&h.parent, "pids.max", &limits.processes.to_string()) {
            tracing::warn!(%err, "cannot bound the processes of all commands together");
        }
    }
    match &root.memory {
        Some(h) if get(&h.parent, "memory.use_hierarchy") == "1" => {
            if let Err(err) = set(
                &h.parent,
                "memory.limit_in_bytes",
                &limits.memory_bytes.to_string(),
            ) {
                tracing::warn!(%err, "cannot bound the memory of all commands together");
            }
        }
        Some(_) => tracing::warn!(
            "memory.use_hierarchy is off: the memory of all commands together is not bounded"
        ),
        None => {}
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Unified,
    V1(&'static str),
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::Unified => "cgroup2",
            Self::V1(controller) => controller,
        }
    }
}

fn prepare_one(
    kind: Kind,
    mountinfo: &str,
    own: &str,
    daemon_pid: u32,
) -> Result<Hierarchy, CgroupError> {
    let mount = mount_point(mountinfo, kind).ok_or(CgroupError::NotMounted(kind.name()))?;
    let own = own_path(own, kind).ok_or(CgroupError::UnknownOwnCgroup(kind.name()))?;
    let home = mount.join(own.trim_start_matches('/'));
    remove_stale(&home);
    let parent = home.join(format!("executor-{daemon_pid}-ns{}", pid_namespace()));
    match std::fs::create_dir(&parent) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_err(&parent)(e)),
    }
    if matches!(kind, Kind::Unified) && !parent.join("cgroup.kill").exists() {
        let _ = std::fs::remove_dir(&parent);
        return Err(CgroupError::NoKill(parent));
    }
    Ok(Hierarchy { home, parent })
}

/// Mount point of a hierarchy, from /proc/self/mountinfo (proc(5)): the cgroup2 mount, or the
/// v1 mount whose super options name the controller.
fn mount_point(mountinfo: &str, kind: Kind) -> Option<PathBuf> {
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
        left.split_whitespace().nth(4).map(PathBuf::from)
    })
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

/// Kill and remove `executor-<pid>` cgroups of daemons that no longer run (a daemon killed
/// with SIGKILL cannot clean up; its helpers kill their trees, but may have died too).
/// Inode of our pid namespace: pids are only comparable within one.
fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

/// Remove the cgroups of dead daemons of our pid namespace (a daemon killed by SIGKILL cannot
/// remove its own; its commands died with it). Those of other namespaces are not ours to
/// judge: their pids mean nothing here.
fn remove_stale(home: &Path) {
    let Ok(entries) = std::fs::read_dir(home) else {
        return;
    };
    let ours = format!("-ns{}", pid_namespace());
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("executor-"))
            .and_then(|rest| rest.strip_suffix(ours.as_str()))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let dir = entry.path();
        if let Ok(commands) = std::fs::read_dir(&dir) {
            for cmd in commands.flatten().filter(|e| e.path().is_dir()) {
                kill(&cmd.path());
                remove(&cmd.path());
            }
        }
        remove(&dir);
    }
}

/// Create a command's cgroup.
pub fn create(dir: &Path) -> Result<(), CgroupError> {
    std::fs::create_dir(dir).map_err(io_err(dir))
}

/// Write one setting (`pids.max`, `memory.limit_in_bytes`, ...) of a command's cgroup.
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

/// Move the calling process into `dir`.
pub fn join(dir: &Path) -> Result<(), CgroupError> {
    let procs = dir.join("cgroup.procs");
    // "0" names the writing process itself (Documentation/admin-guide/cgroup-v2.rst).
    std::fs::write(&procs, "0").map_err(io_err(&procs))
}

/// Pids currently in `dir`.
pub fn procs(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// SIGKILL every task in `dir` and below, stopped and signal-ignoring ones included.
pub fn kill(dir: &Path) {
    // A missing cgroup is already empty; nothing else can be done about another error here.
    let _ = std::fs::write(dir.join("cgroup.kill"), "1");
}

/// Remove `dir`. Reaped tasks can linger in it for a moment, so retry briefly; the next daemon
/// start removes what is left.
pub fn remove(dir: &Path) {
    for _ in 0..100 {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cgroup2_and_v1_controller_mounts() {
        let mountinfo = "\
35 24 0:30 / /sys/fs/cgroup/memory rw,relatime shared:12 - cgroup cgroup rw,memory
36 24 0:31 / /sys/fs/cgroup/unified rw,relatime shared:13 - cgroup2 cgroup2 rw
";
        assert_eq!(
            mount_point(mountinfo, Kind::Unified),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(
            mount_point(mountinfo, Kind::V1("memory")),
            Some(PathBuf::from("/sys/fs/cgroup/memory"))
        );
        assert_eq!(mount_point(mountinfo, Kind::V1("pids")), None);
        assert_eq!(
            mount_point("1 2 0:3 / /proc rw - proc proc rw\n", Kind::Unified),
            None
        );
    }

    #[test]
    fn reads_unified_and_v1_entries_of_proc_self_cgroup() {
        let text = "12:memory:/user.slice\n0::/system.slice/executor.service\n";
        assert_eq!(
            own_path(text, Kind::Unified).as_deref(),
            Some("/system.slice/executor.service")
        );
        assert_eq!(
            own_path(text, Kind::V1("memory")).as_deref(),
            Some("/user.slice")
        );
        assert_eq!(own_path("4:pids:/\n", Kind::Unified), None);
    }
}
