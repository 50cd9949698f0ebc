//! The host's view of processes, from /proc: finding a test's processes by a marker in their
//! command line, their state, parents, namespaces, descriptors and memory.

/// A string unlikely to appear in any other process's command line, to find a test's
/// processes on the host.
pub fn marker() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{}{:05}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A `sleep` whose argument embeds `marker` (GNU sleep takes fractions: `sleep 3600.<marker>`).
pub fn marked_sleep(marker: &str) -> String {
    format!("sleep 3600.{marker}")
}

/// Pids of live (non-zombie) processes whose command line contains `needle`.
pub fn processes_matching(needle: &str) -> Vec<i32> {
    processes_where(|cmdline| cmdline.contains(needle))
}

/// Pids of live `sleep` processes started by [`marked_sleep`] with `marker` (shells whose
/// command line merely mentions the marker are not counted).
pub fn sleepers(marker: &str) -> Vec<i32> {
    let prefix = marked_sleep(marker);
    processes_where(|cmdline| cmdline.starts_with(&prefix))
}

fn processes_where(matches: impl Fn(&str) -> bool) -> Vec<i32> {
    let mut pids = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if !matches(&cmdline) || pid == std::process::id() as i32 {
            continue;
        }
        if process_state(pid) != Some('Z') {
            pids.push(pid);
        }
    }
    pids
}

/// State letter of a process (`R`, `S`, `T`, `Z`, ...) from `/proc/<pid>/stat`.
pub fn process_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..].chars().next()
}

/// Resident set size of `pid` in KiB, from `/proc/<pid>/status`.
pub fn rss_kib(pid: u32) -> u64 {
    status_field(pid, "VmRSS:")
}

/// Peak resident set size of `pid` in KiB.
pub fn peak_rss_kib(pid: u32) -> u64 {
    status_field(pid, "VmHWM:")
}

fn status_field(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// A field of `/proc/<pid>/status` as text (`"Uid:"` -> `"65534\t65534\t65534\t65534"`).
pub fn proc_status(pid: i32, field: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .map(|v| v.trim().to_string())
}

/// Target of `/proc/<pid>/ns/<kind>` (e.g. `net:[4026531840]`).
pub fn namespace_of(pid: i32, kind: &str) -> Option<String> {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}"))
        .ok()
        .map(|p| p.display().to_string())
}

/// Every live process whose chain of parents leads to `root`.
pub fn descendants(root: i32) -> Vec<i32> {
    let all: Vec<i32> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    all.into_iter()
        .filter(|pid| {
            let mut cur = *pid;
            for _ in 0..64 {
                match parent_of(cur) {
                    Some(p) if p == root => return true,
                    Some(p) if p > 1 => cur = p,
                    _ => return false,
                }
            }
            false
        })
        .collect()
}

/// Field `field` (1-based, as proc(5) numbers them; 3 or later) of `/proc/<pid>/stat`. The
/// command name may hold spaces and parentheses: the fields resume after the last ')'.
fn stat_field(pid: i32, field: usize) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..]
        .split_whitespace()
        .nth(field.checked_sub(3)?)?
        .parse()
        .ok()
}

/// The parent pid of `pid`, from `/proc/<pid>/stat`.
pub fn parent_of(pid: i32) -> Option<i32> {
    stat_field(pid, 4)
}

/// The nice value of `pid`, from `/proc/<pid>/stat`.
pub fn nice_of(pid: i32) -> Option<i32> {
    stat_field(pid, 19)
}

/// Number of open file descriptors of `pid`.
pub fn fd_count(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}
