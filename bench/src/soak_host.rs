//! The soak's checks from outside the daemon: host processes by command line or environment,
//! and upload temporary files left on disk.

use std::path::{Path, PathBuf};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Every process on the host but this one, with the bytes of /proc/PID/`file`.
fn processes_with(file: &str) -> Vec<(i32, Vec<u8>)> {
    let me = std::process::id() as i32;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != me)
        .filter_map(|pid| Some((pid, std::fs::read(format!("/proc/{pid}/{file}")).ok()?)))
        .collect()
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

/// SIGKILL every process whose command line holds `marker`; how many were sent it.
pub(crate) fn kill_by_cmdline(marker: &str) -> usize {
    processes_with("cmdline")
        .into_iter()
        .filter(|(_, cmdline)| contains(cmdline, marker))
        .filter(|(pid, _)| kill(Pid::from_raw(*pid), Signal::SIGKILL).is_ok())
        .count()
}

/// Processes (but `daemon`) whose environment or command line holds `mark`: every command
/// of the soak runs with `EXECUTOR_SOAK=<mark>`, and its children inherit it.
pub(crate) fn leftovers(mark: &str, daemon: u32) -> Vec<String> {
    let mut out = Vec::new();
    for file in ["environ", "cmdline"] {
        for (pid, bytes) in processes_with(file) {
            if pid as u32 != daemon && contains(&bytes, mark) {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
                out.push(format!("{pid} {}", cmdline.trim()));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Files named `.NAME.upload-HEX` under `root` (symbolic links not followed), and how many
/// files in directories named `soak` were seen (the soak's uploads: the walk reached them).
pub(crate) fn temp_files(root: &Path) -> (Vec<PathBuf>, usize) {
    let mut found = Vec::new();
    let mut uploads = 0;
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if kind.is_dir() {
                todo.push(entry.path());
            } else if entry.file_name().to_string_lossy().contains(".upload-") {
                found.push(entry.path());
            } else if dir.file_name().is_some_and(|n| n == "soak") {
                uploads += 1;
            }
        }
    }
    (found, uploads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_files_are_found_below_and_others_are_not() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("a/b")).unwrap();
        std::fs::write(dir.path().join("a/b/.x.bin.upload-1f2e"), "").unwrap();
        std::fs::write(dir.path().join("a/x.bin"), "").unwrap();
        std::fs::create_dir_all(dir.path().join("w/soak")).unwrap();
        std::fs::write(dir.path().join("w/soak/c0.bin"), "").unwrap();
        assert_eq!(
            temp_files(dir.path()),
            (vec![dir.path().join("a/b/.x.bin.upload-1f2e")], 1)
        );
    }

    #[test]
    fn a_process_is_found_by_its_environment_and_killed_by_its_command_line() {
        let mark = format!("soaktest{}", std::process::id());
        let mut child = std::process::Command::new("sh")
            .args(["-c", &format!(": {mark}-kill; sleep 30")])
            .env("EXECUTOR_SOAK", &mark)
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!leftovers(&mark, 0).is_empty());
        assert_eq!(kill_by_cmdline(&format!("{mark}-kill")), 1);
        child.wait().unwrap();
        // Its sleep got the environment too; end it (the control: nothing left after).
        for line in leftovers(&mark, 0) {
            let pid: i32 = line.split(' ').next().unwrap().parse().unwrap();
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(leftovers(&mark, 0).is_empty());
    }
}
