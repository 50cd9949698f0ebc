//! Starting and stopping `executor serve`, and reading its memory from /proc.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Longest time the daemon may take to print its listening line or to exit on SIGTERM.
const PATIENCE: Duration = Duration::from_secs(20);

/// A running `executor serve` on a free loopback port, with its own state directory.
pub struct Daemon {
    child: Child,
    /// Kept open so the daemon never writes to a closed stdout.
    _stdout: BufReader<ChildStdout>,
    pub pid: u32,
    pub url: String,
    pub token: String,
    state_dir: PathBuf,
    /// From spawn to the listening line on stdout.
    pub listening_after: Duration,
    /// When the daemon was spawned, for start-to-hello time.
    pub spawned_at: Instant,
}

impl Daemon {
    /// Start `exe serve --listen 127.0.0.1:0` with a fresh state directory and `extra` flags,
    /// and wait for its listening line.
    pub fn start(exe: &Path, extra: &[String]) -> anyhow::Result<Self> {
        static SERIAL: AtomicU32 = AtomicU32::new(0);
        let state_dir = std::env::temp_dir().join(format!(
            "executor-bench-{}-{}",
            std::process::id(),
            SERIAL.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&state_dir)
            .with_context(|| format!("cannot create {}", state_dir.display()))?;
        Self::start_in(exe, extra, state_dir)
    }

    /// Start `exe serve` on `state_dir` (fresh or a stopped daemon's, whose token it keeps).
    fn start_in(exe: &Path, extra: &[String], state_dir: PathBuf) -> anyhow::Result<Self> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(state_dir.join("daemon.log"))?;
        let spawned_at = Instant::now();
        let mut child = Command::new(exe)
            .args(["serve", "--listen", "127.0.0.1:0", "--state-dir"])
            .arg(&state_dir)
            .args(extra)
            // The daemon's own default, pinned so a RUST_LOG in the caller's shell cannot skew it.
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot start {}", exe.display()))?;
        let pid = child.id();
        let Some(stdout) = child.stdout.take() else {
            bail!("daemon stdout missing");
        };
        // Read the one line on a thread so a daemon that never prints cannot hang the bench.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            let read = reader.read_line(&mut line);
            let _ = tx.send((read.map(|_| line), reader));
        });
        let got = rx.recv_timeout(PATIENCE);
        let listening_after = spawned_at.elapsed();
        let mut daemon_log = || {
            let _ = child.kill();
            let _ = child.wait();
            std::fs::read_to_string(state_dir.join("daemon.log")).unwrap_or_default()
        };
        let (line, stdout) = match got {
            Ok((Ok(line), reader)) => (line, reader),
            _ => {
                let log = daemon_log();
                let _ = std::fs::remove_dir_all(&state_dir);
                bail!("the daemon printed no listening line within {PATIENCE:?}; its log:\n{log}");
            }
        };
        let Some(url) = line.trim().strip_prefix("executor listening on ") else {
            let log = daemon_log();
            let _ = std::fs::remove_dir_all(&state_dir);
            bail!("unexpected first line {line:?} from the daemon; its log:\n{log}");
        };
        let url = url.to_string();
        let token = std::fs::read_to_string(state_dir.join("token"))
            .context("cannot read the daemon's token")?
            .trim()
            .to_string();
        Ok(Self {
            child,
            _stdout: stdout,
            pid,
            url,
            token,
            state_dir,
            listening_after,
            spawned_at,
        })
    }

    /// Its state directory (token, audit log, workspaces), removed when it is dropped.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// Stop with SIGTERM and start `exe serve` again on the same state directory (a new
    /// port: `url` changes, and `pid`).
    pub fn restart(&mut self, exe: &Path, extra: &[String]) -> anyhow::Result<()> {
        self.terminate()?;
        let fresh = Self::start_in(exe, extra, self.state_dir.clone())?;
        // The old value's drop must not remove the directory the new daemon runs on.
        let mut old = std::mem::replace(self, fresh);
        old.state_dir = PathBuf::new();
        Ok(())
    }

    /// SIGTERM and wait for the exit, or fail after PATIENCE.
    fn terminate(&mut self) -> anyhow::Result<()> {
        let _ = kill(Pid::from_raw(self.pid as i32), Signal::SIGTERM);
        let deadline = Instant::now() + PATIENCE;
        while Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        bail!("the daemon did not exit within {PATIENCE:?} of SIGTERM")
    }

    /// Stop with SIGTERM (so it removes its cgroups) and wait; SIGKILL if it hangs.
    pub fn stop(mut self) -> anyhow::Result<()> {
        self.terminate().context("killed it")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if !self.state_dir.as_os_str().is_empty() {
            let _ = std::fs::remove_dir_all(&self.state_dir);
        }
    }
}

/// A `kB` field of /proc/PID/status (`VmRSS`, `VmHWM`) in KiB.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Reset VmHWM to the current RSS (proc(5), /proc/PID/clear_refs, value 5). Needs to own the
/// process or be root; returns whether it worked.
pub fn reset_peak_rss(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

/// Samples a process's VmRSS every 2 ms on a thread until stopped; returns the maximum in KiB.
pub struct RssSampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: std::thread::JoinHandle<u64>,
}

impl RssSampler {
    pub fn start(pid: u32) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut max = 0;
            while !flag.load(Ordering::Relaxed) {
                max = max.max(status_kib(pid, "VmRSS").unwrap_or(0));
                std::thread::sleep(Duration::from_millis(2));
            }
            max
        });
        Self { stop, handle }
    }

    pub fn stop(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.handle.join().unwrap_or(0)
    }
}

/// Raise our RLIMIT_NOFILE soft limit to at least `want` (up to the hard limit); the daemon
/// inherits it. Returns the soft limit in force.
pub fn raise_nofile(want: u64) -> anyhow::Result<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).context("getrlimit")?;
    if soft >= want {
        return Ok(soft);
    }
    let new = want.min(hard);
    setrlimit(Resource::RLIMIT_NOFILE, new, hard).context("setrlimit(RLIMIT_NOFILE)")?;
    Ok(new)
}

/// The `executor` binary: `explicit` if given; otherwise the release build next to this
/// benchmark's own target directory, built first with `cargo build --release -p executor`
/// unless `build` is false.
pub fn find_executor(explicit: Option<PathBuf>, build: bool) -> anyhow::Result<PathBuf> {
    if let Some(path) = explicit {
        return Ok(path);
    }
    let me = std::env::current_exe().context("cannot locate the benchmark binary")?;
    // target/<profile>/executor-bench -> target/release/executor
    let Some(target) = me.parent().and_then(Path::parent) else {
        bail!("cannot tell the target directory from {}", me.display());
    };
    let exe = target.join("release").join("executor");
    if build {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        eprintln!("bench: cargo build --release -p executor");
        let status = Command::new(cargo)
            .args(["build", "--release", "--quiet", "-p", "executor"])
            .env("CARGO_TARGET_DIR", target)
            .status()
            .context("cannot run cargo to build the executor (pass --executor PATH)")?;
        if !status.success() {
            bail!("building the executor failed");
        }
    }
    if !exe.is_file() {
        bail!(
            "{} not found; build it with `cargo build --release -p executor` or pass --executor",
            exe.display()
        );
    }
    Ok(exe)
}

/// CPU time of a process itself and of its reaped descendants, in milliseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuTimes {
    pub own_ms: f64,
    pub children_ms: f64,
}

impl CpuTimes {
    /// `utime + stime` and `cutime + cstime` of /proc/PID/stat (proc(5), fields 14 to 17).
    pub fn of(pid: u32) -> Option<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // The command name may hold spaces and parentheses; fields resume after the last ')'.
        let fields: Vec<f64> = stat[stat.rfind(')')? + 1..]
            .split_whitespace()
            .skip(11)
            .take(4)
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        let &[utime, stime, cutime, cstime] = fields.as_slice() else {
            return None;
        };
        let tick_ms = 1e3 / clock_ticks_per_second();
        Some(Self {
            own_ms: (utime + stime) * tick_ms,
            children_ms: (cutime + cstime) * tick_ms,
        })
    }

    /// What was spent since `earlier`, per one of `count` operations.
    pub fn per(self, earlier: Self, count: usize) -> Self {
        let n = count.max(1) as f64;
        Self {
            own_ms: (self.own_ms - earlier.own_ms) / n,
            children_ms: (self.children_ms - earlier.children_ms) / n,
        }
    }
}

/// CPU time in milliseconds of every user-space process alive now but this benchmark and what
/// descends from it, keyed by pid and start time (so a reused pid is another process).
/// Kernel threads are left out: their work here is mostly ours (a network namespace's
/// clean-up, a cgroup's release), and it cannot be told apart.
pub fn others_cpu_ms() -> std::collections::HashMap<(u32, u64), f64> {
    let me = std::process::id();
    let tick_ms = 1e3 / clock_ticks_per_second();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Default::default();
    };
    let stats: Vec<(u32, Vec<u64>)> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // Fields from 3 (state) on, after the command name's last ')'; state is not a
            // number, so it reads as 0.
            let fields = stat[stat.rfind(')')? + 1..]
                .split_whitespace()
                .map(|f| f.parse().unwrap_or(0))
                .collect();
            Some((pid, fields))
        })
        .collect();
    // proc(5) numbering: ppid 4, flags 9, utime 14, stime 15, starttime 22 (index = n - 3).
    let field = |f: &[u64], n: usize| f.get(n - 3).copied().unwrap_or(0);
    let parents: std::collections::HashMap<u32, u32> = stats
        .iter()
        .map(|(pid, f)| (*pid, field(f, 4) as u32))
        .collect();
    let ours = |mut pid: u32| {
        for _ in 0..64 {
            if pid == me {
                return true;
            }
            match parents.get(&pid) {
                Some(&parent) if parent > 1 => pid = parent,
                _ => return false,
            }
        }
        false
    };
    const PF_KTHREAD: u64 = 0x0020_0000;
    stats
        .iter()
        .filter(|(pid, f)| field(f, 9) & PF_KTHREAD == 0 && *pid != 2 && !ours(*pid))
        .map(|(pid, f)| {
            let cpu = (field(f, 14) + field(f, 15)) as f64 * tick_ms;
            ((*pid, field(f, 22)), cpu)
        })
        .collect()
}

/// What the processes of `later` used since `earlier` (a process born in between: all of it).
pub fn others_used_ms(
    earlier: &std::collections::HashMap<(u32, u64), f64>,
    later: &std::collections::HashMap<(u32, u64), f64>,
) -> f64 {
    later
        .iter()
        .map(|(key, ms)| (ms - earlier.get(key).copied().unwrap_or(0.0)).max(0.0))
        .sum()
}

fn clock_ticks_per_second() -> f64 {
    use nix::unistd::{sysconf, SysconfVar};
    match sysconf(SysconfVar::CLK_TCK) {
        Ok(Some(ticks)) if ticks > 0 => ticks as f64,
        _ => 100.0,
    }
}

/// Busy and total CPU time of the whole machine in milliseconds, from the `cpu` line of
/// /proc/stat (proc(5)): busy is user + nice + system + irq + softirq + steal.
pub fn machine_cpu_ms() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    let &[user, nice, system, idle, iowait, irq, softirq, steal] = v.as_slice() else {
        return None;
    };
    let busy = user + nice + system + irq + softirq + steal;
    let tick_ms = 1e3 / clock_ticks_per_second();
    Some((busy * tick_ms, (busy + idle + iowait) * tick_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn others_are_everything_but_us_below_and_kernel_threads() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let others = others_cpu_ms();
        let pids: Vec<u32> = others.keys().map(|(pid, _)| *pid).collect();
        let _ = child.kill();
        let _ = child.wait();
        assert!(!pids.contains(&std::process::id()), "ourselves");
        assert!(!pids.contains(&child.id()), "our child");
        assert!(!pids.contains(&2), "kthreadd");
        // The control: a process that is not ours is counted (our parent, cargo's test runner
        // or a shell).
        let parent = std::os::unix::process::parent_id();
        assert!(
            parent <= 1 || pids.contains(&parent),
            "{parent} in {pids:?}"
        );
    }

    #[test]
    fn what_others_used_counts_a_reused_pid_as_a_new_process() {
        let earlier = [((10, 100), 50.0), ((11, 100), 5.0)].into_iter().collect();
        // pid 10 went on (+20 ms), pid 11 ended and its number came back for a process born
        // later (all of its 7 ms), and one came and stayed (3 ms).
        let later = [((10, 100), 70.0), ((11, 900), 7.0), ((12, 950), 3.0)]
            .into_iter()
            .collect();
        assert_eq!(others_used_ms(&earlier, &later), 30.0);
    }
}
