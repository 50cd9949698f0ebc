//! Where processes sit in the host's cgroups, read from `/proc` (mountinfo, `<pid>/cgroup`):
//! below both the placement checks (`cgroup_placement`) and the one-shot runs' (`run_local`),
//! which look for a run's own cgroup directories.

use std::collections::BTreeMap;

/// The hierarchies a command is placed in on this host, each with where its files are: the
/// cgroup2 mount (key "0") and v1 mounts of `pids` and `memory` (keyed by controller).
pub(crate) fn hierarchies() -> BTreeMap<String, String> {
    let mut found = BTreeMap::new();
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let mount_point = left.split_whitespace().nth(4).unwrap_or_default();
        let mut fields = right.split_whitespace();
        let (fstype, options) = (fields.next(), fields.nth(1).unwrap_or_default());
        match fstype {
            Some("cgroup2") => {
                found.insert("0".to_string(), mount_point.to_string());
            }
            Some("cgroup") => {
                for controller in ["pids", "memory"] {
                    if options.split(',').any(|o| o == controller) {
                        found.insert(controller.to_string(), mount_point.to_string());
                    }
                }
            }
            _ => {}
        }
    }
    found
}

/// `pid`'s path in each hierarchy of [`hierarchies`] (keys as there).
pub(crate) fn paths_of(pid: i32) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let mut paths = BTreeMap::new();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (id, controllers, path) = (parts.next(), parts.next(), parts.next());
        let (Some(id), Some(controllers), Some(path)) = (id, controllers, path) else {
            continue;
        };
        if id == "0" {
            paths.insert("0".to_string(), path.to_string());
        }
        for c in controllers.split(',') {
            if c == "pids" || c == "memory" {
                paths.insert(c.to_string(), path.to_string());
            }
        }
    }
    paths
}

/// The cgroup directories of the one-shot run `pid`: below the test's own cgroups, which the
/// run shares.
pub(crate) fn run_cgroup_dirs(pid: u32) -> Vec<String> {
    let own = paths_of(std::process::id() as i32);
    let mut found = Vec::new();
    for (key, mount) in &hierarchies() {
        let home = format!("{mount}{}", own.get(key).map_or("", String::as_str));
        for entry in std::fs::read_dir(&home).unwrap().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(&format!("executor-{pid}-ns")) {
                found.push(format!("{home}/{name}"));
            }
        }
    }
    found
}
