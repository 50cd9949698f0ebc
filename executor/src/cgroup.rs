//! cgroup v2 handling: one cgroup per command, killed as a whole with `cgroup.kill`.
//!
//! The daemon owns `<its cgroup>/executor-<pid>/`; each command gets `cmd-<serial>/` below it.
//! Only process placement and `cgroup.kill` (Linux 5.14) are used here, which work without any
//! controller, so hybrid hosts (v1 controllers, a bare v2 mount) get them too.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where the daemon puts its commands' cgroups.
#[derive(Debug, Clone, PartialEq)]
pub struct CgroupRoot {
    /// The daemon's own cgroup, which helpers return to after placing their payload.
    pub home: PathBuf,
    /// `<home>/executor-<pid>`, parent of every command cgroup of this daemon.
    pub parent: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no cgroup2 hierarchy is mounted")]
    NotMounted,
    #[error("cannot tell this process's cgroup2 path from /proc/self/cgroup")]
    UnknownOwnCgroup,
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

/// Find the cgroup2 mount and this process's place in it, create the daemon's parent cgroup,
/// and remove what dead daemons left behind.
pub fn prepare(daemon_pid: u32) -> Result<CgroupRoot, CgroupError> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(io_err(Path::new("/proc/self/mountinfo")))?;
    let mount = cgroup2_mount(&mountinfo).ok_or(CgroupError::NotMounted)?;
    let own = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(io_err(Path::new("/proc/self/cgroup")))?;
    let own = own_cgroup2_path(&own).ok_or(CgroupError::UnknownOwnCgroup)?;
    let home = mount.join(own.trim_start_matches('/'));
    remove_stale(&home);
    let parent = home.join(format!("executor-{daemon_pid}"));
    match std::fs::create_dir(&parent) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_err(&parent)(e)),
    }
    if !parent.join("cgroup.kill").exists() {
        let _ = std::fs::remove_dir(&parent);
        return Err(CgroupError::NoKill(parent));
    }
    Ok(CgroupRoot { home, parent })
}

/// Mount point of the cgroup2 filesystem, from /proc/self/mountinfo (proc(5)).
fn cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        if right.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        left.split_whitespace().nth(4).map(PathBuf::from)
    })
}

/// The `0::<path>` entry of /proc/self/cgroup (cgroups(7)).
fn own_cgroup2_path(proc_cgroup: &str) -> Option<String> {
    proc_cgroup
        .lines()
        .find_map(|line| line.strip_prefix("0::").map(str::to_string))
}

/// Kill and remove `executor-<pid>` cgroups of daemons that no longer run (a daemon killed
/// with SIGKILL cannot clean up; its helpers kill their trees, but may have died too).
fn remove_stale(home: &Path) {
    let Ok(entries) = std::fs::read_dir(home) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("executor-"))
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
    fn finds_the_cgroup2_mount_among_v1_mounts() {
        let mountinfo = "\
35 24 0:30 / /sys/fs/cgroup/memory rw,relatime shared:12 - cgroup cgroup rw,memory
36 24 0:31 / /sys/fs/cgroup/unified rw,relatime shared:13 - cgroup2 cgroup2 rw
";
        assert_eq!(
            cgroup2_mount(mountinfo),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(cgroup2_mount("1 2 0:3 / /proc rw - proc proc rw\n"), None);
    }

    #[test]
    fn reads_the_unified_entry_of_proc_self_cgroup() {
        let text = "12:memory:/user.slice\n0::/system.slice/executor.service\n";
        assert_eq!(
            own_cgroup2_path(text).as_deref(),
            Some("/system.slice/executor.service")
        );
        assert_eq!(own_cgroup2_path("4:pids:/\n"), None);
    }
}
