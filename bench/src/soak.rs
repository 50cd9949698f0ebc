//! `--soak SECONDS`: protocol 1.1 under load and faults (issue 35, part 6). `--soak-clients`
//! clients take turns, each at random, among: `exec`; processes with and without a PTY
//! (stdin writes, reads by offset, waits, signals); uploads and downloads checked by sha256;
//! connections dropped mid-upload, mid-download and mid-process, then resumed; payloads
//! killed with SIGKILL from the host, found by a marker in their command line. Half way, the
//! daemon is stopped with SIGTERM and started again on the same state directory; clients
//! reconnect and go on. At the end, checked from outside: nothing lost or repeated in any
//! output read through a resume, no `.upload-` temporary file in the state directory or the
//! workspace, the daemon's RSS against its memory budget, no process of its commands left
//! on the host once it stopped. Exits non-zero when one of these is broken or an operation
//! failed unexpectedly.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::anyhow;

use crate::client::Client;
use crate::daemon::{status_kib, Daemon};
use crate::soak_conn::{connect, Conn, Rng, Shared, Tally};
use crate::soak_host::{leftovers, temp_files};
use crate::soak_ops::one_op;
use crate::stats::percentile;

/// RSS allowed past the memory budget: the daemon's code, its runtime and per-connection
/// state, which the budget does not cover (the 4,000-session run measured 102 KiB a session).
pub(crate) const RSS_OVERHEAD_MIB: u64 = 128;

pub(crate) struct Plan {
    pub seconds: f64,
    pub clients: usize,
    pub budget_mb: u64,
}

/// The kinds of operation, in the order they are reported.
const KINDS: [&str; 9] = [
    "exec",
    "counter",
    "pty",
    "signal",
    "files",
    "drop_process",
    "drop_upload",
    "drop_download",
    "host_kill",
];

async fn client_loop(shared: Arc<Shared>, number: usize) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (number as u64 + 1).wrapping_mul(0x2545_f491));
    let mut c: Option<Conn> = None;
    while Instant::now() < shared.deadline {
        // exec weighs three, the others one each.
        let pick = rng.below(KINDS.len() as u64 + 2) as usize;
        let kind = KINDS[pick.saturating_sub(2)];
        let generation = shared.generation.load(Ordering::SeqCst);
        if c.is_none() {
            match connect(&shared, number).await {
                Ok(fresh) => c = Some(fresh),
                Err(err) => {
                    record(&shared, kind, generation, Err(err));
                    continue;
                }
            }
        }
        let t0 = Instant::now();
        let res = tokio::time::timeout(
            Duration::from_secs(180),
            one_op(&shared, &mut c, kind, &mut rng),
        )
        .await
        .unwrap_or_else(|_| Err(anyhow!("no end within 180 s")));
        if res.is_err() {
            c = None;
        }
        if let Ok(mut t) = shared.tally.lock() {
            let ms = t.longest_ms.entry(kind).or_default();
            *ms = ms.max(t0.elapsed().as_secs_f64() * 1e3);
        }
        record(&shared, kind, generation, res);
    }
    if let Some(conn) = c {
        conn.client.close().await;
    }
}

fn record(shared: &Shared, kind: &'static str, generation: u64, res: anyhow::Result<()>) {
    let restarted = shared.generation.load(Ordering::SeqCst) != generation
        || shared.restarting.load(Ordering::SeqCst);
    let Ok(mut t) = shared.tally.lock() else {
        return;
    };
    match res {
        Ok(()) => *t.done.entry(kind).or_default() += 1,
        Err(_) if restarted => {
            *t.expected
                .entry(format!("{kind} interrupted by the restart"))
                .or_default() += 1;
        }
        Err(err) => {
            *t.unexpected.entry(kind).or_default() += 1;
            // Cut: a message may quote a whole chunk of data.
            let text: String = format!("{err:#}").chars().take(300).collect();
            eprintln!("soak: {kind} failed: {text}");
            if t.unexpected_samples.len() < 20 {
                t.unexpected_samples.push(format!("{kind}: {text}"));
            }
        }
    }
}

pub(crate) struct SoakReport {
    pub plan_seconds: f64,
    pub clients: usize,
    pub budget_mb: u64,
    pub seconds: f64,
    pub tally: Tally,
    pub rss_max_kib: u64,
    pub restart_s: f64,
    pub temp_files: Vec<PathBuf>,
    /// Uploaded files the walk for temporary files saw (it reached the workspaces).
    pub uploads_seen: usize,
    pub leftovers: Vec<String>,
    pub load: String,
}

impl SoakReport {
    pub fn broken(&self) -> Vec<String> {
        let mut out = Vec::new();
        let unexpected: u64 = self.tally.unexpected.values().sum();
        if unexpected > 0 {
            out.push(format!("{unexpected} operations failed unexpectedly"));
        }
        if !self.tally.integrity.is_empty() {
            out.push(format!(
                "{} outputs or files lost or repeated bytes",
                self.tally.integrity.len()
            ));
        }
        if !self.temp_files.is_empty() {
            out.push(format!(
                "upload temporary files left: {:?}",
                self.temp_files
            ));
        }
        if self.uploads_seen == 0 {
            out.push("the walk for temporary files saw none of the uploaded files".into());
        }
        if self.rss_max_kib > (self.budget_mb + RSS_OVERHEAD_MIB) * 1024 {
            out.push(format!(
                "daemon RSS reached {} MiB, past the budget {} MiB + {RSS_OVERHEAD_MIB} MiB",
                self.rss_max_kib / 1024,
                self.budget_mb
            ));
        }
        if !self.leftovers.is_empty() {
            out.push(format!(
                "processes of the daemon's commands left: {:?}",
                self.leftovers
            ));
        }
        for kind in KINDS {
            if self.tally.done.get(kind).copied().unwrap_or(0) == 0 {
                out.push(format!("no {kind} operation succeeded"));
            }
        }
        out
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub(crate) async fn run(executor: &Path, plan: &Plan) -> anyhow::Result<SoakReport> {
    let extra = vec![
        "--memory-budget-mb".to_string(),
        plan.budget_mb.to_string(),
        "--resume-grace".to_string(),
        "30".to_string(),
    ];
    let mut daemon = Daemon::start(executor, &extra)?;
    let (probe, hello) = Client::connect(&daemon.url, &daemon.token).await?;
    probe.close().await;
    let workspace = PathBuf::from(&hello.workspace);
    let state_dir = daemon.state_dir().to_path_buf();
    let started = Instant::now();
    let shared = Arc::new(Shared {
        url: Mutex::new(daemon.url.clone()),
        token: Mutex::new(daemon.token.clone()),
        generation: AtomicU64::new(0),
        restarting: AtomicBool::new(false),
        pid: AtomicU32::new(daemon.pid),
        mark: format!("soak{}", std::process::id()),
        deadline: started + Duration::from_secs_f64(plan.seconds),
        tally: Mutex::new(Tally::default()),
    });
    eprintln!(
        "soak: daemon pid {} at {}, {} clients for {} s, budget {} MiB",
        daemon.pid, daemon.url, plan.clients, plan.seconds, plan.budget_mb
    );
    // The daemon's RSS every 100 ms, whichever daemon runs.
    let rss_max = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (shared, rss_max) = (shared.clone(), rss_max.clone());
        tokio::spawn(async move {
            loop {
                let pid = shared.pid.load(Ordering::SeqCst);
                if let Some(kib) = status_kib(pid, "VmRSS") {
                    rss_max.fetch_max(kib, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let clients: Vec<_> = (0..plan.clients)
        .map(|n| tokio::spawn(client_loop(shared.clone(), n)))
        .collect();
    // Half way: SIGTERM, and the same state directory again.
    tokio::time::sleep(Duration::from_secs_f64(plan.seconds / 2.0)).await;
    eprintln!("soak: restarting the daemon");
    shared.restarting.store(true, Ordering::SeqCst);
    shared.generation.fetch_add(1, Ordering::SeqCst);
    let t0 = Instant::now();
    let (exe, flags) = (executor.to_path_buf(), extra.clone());
    daemon = tokio::task::spawn_blocking(move || daemon.restart(&exe, &flags).map(|()| daemon))
        .await??;
    let restart_s = t0.elapsed().as_secs_f64();
    *shared.url.lock().map_err(|_| anyhow!("poisoned"))? = daemon.url.clone();
    *shared.token.lock().map_err(|_| anyhow!("poisoned"))? = daemon.token.clone();
    shared.pid.store(daemon.pid, Ordering::SeqCst);
    shared.generation.fetch_add(1, Ordering::SeqCst);
    shared.restarting.store(false, Ordering::SeqCst);
    eprintln!(
        "soak: daemon back as pid {} at {} after {restart_s:.1} s",
        daemon.pid, daemon.url
    );
    for c in clients {
        c.await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let load = loadavg();
    // Settle: a failed upload's file goes at once, but the last drops may be in flight.
    tokio::time::sleep(Duration::from_secs(2)).await;
    sampler.abort();
    let (mut temps, mut uploads_seen) = temp_files(&state_dir);
    if !workspace.starts_with(&state_dir) {
        let (more, seen) = temp_files(&workspace);
        temps.extend(more);
        uploads_seen += seen;
    }
    let pid = daemon.pid;
    // Both daemons' log (the state directory goes with the daemon), for what failed.
    let log = std::env::temp_dir().join(format!("executor-soak-{}.log", std::process::id()));
    match std::fs::copy(state_dir.join("daemon.log"), &log) {
        Ok(_) => eprintln!("soak: the daemon's log is kept in {}", log.display()),
        Err(err) => eprintln!("soak: cannot keep the daemon's log: {err}"),
    }
    tokio::task::spawn_blocking(move || daemon.stop()).await??;
    // After the daemon stopped: nothing carrying our marker runs on the host.
    let left = leftovers(&shared.mark, pid);
    let tally = std::mem::take(&mut *shared.tally.lock().map_err(|_| anyhow!("poisoned"))?);
    Ok(SoakReport {
        plan_seconds: plan.seconds,
        clients: plan.clients,
        budget_mb: plan.budget_mb,
        seconds,
        tally,
        rss_max_kib: rss_max.load(Ordering::SeqCst),
        restart_s,
        temp_files: temps,
        uploads_seen,
        leftovers: left,
        load,
    })
}

pub(crate) fn markdown(r: &SoakReport) -> String {
    let t = &r.tally;
    let mut out = format!(
        "soak: {} clients, {:.0} s asked, {:.0} s run, one restart ({:.2} s), load average at the end {}\n\n",
        r.clients, r.plan_seconds, r.seconds, r.restart_s, r.load
    );
    out.push_str("| operation | done | unexpected errors | longest |\n|---|---|---|---|\n");
    for kind in KINDS {
        out.push_str(&format!(
            "| {kind} | {} | {} | {:.1} s |\n",
            t.done.get(kind).copied().unwrap_or(0),
            t.unexpected.get(kind).copied().unwrap_or(0),
            t.longest_ms.get(kind).copied().unwrap_or(0.0) / 1e3
        ));
    }
    out.push_str("\n| expected event | count |\n|---|---|\n");
    for (what, n) in &t.expected {
        out.push_str(&format!("| {what} | {n} |\n"));
    }
    let mut ms = t.exec_ms.clone();
    ms.sort_by(f64::total_cmp);
    let p = |q| percentile(&ms, q).unwrap_or(f64::NAN);
    out.push_str("\n| check | value |\n|---|---|\n");
    out.push_str(&format!(
        "| exec latency p50 / p99 | {:.1} / {:.1} ms ({} execs) |\n",
        p(50.0),
        p(99.0),
        ms.len()
    ));
    out.push_str(&format!(
        "| bytes checked (counters by offset, files by sha256) | {:.1} MiB |\n",
        t.checked_bytes as f64 / 1048576.0
    ));
    out.push_str(&format!(
        "| outputs read whole across a drop and resume | {} |\n",
        t.resumed_reads
    ));
    out.push_str(&format!(
        "| lost or repeated (outputs, files) | {} |\n",
        t.integrity.len()
    ));
    out.push_str(&format!(
        "| `.upload-` files left in the state dir / workspace (uploaded files the walk saw) | {} ({}) |\n",
        r.temp_files.len(),
        r.uploads_seen
    ));
    out.push_str(&format!(
        "| daemon RSS max (sampled every 100 ms) vs budget | {:.1} MiB vs {} MiB (+{RSS_OVERHEAD_MIB} allowed) |\n",
        r.rss_max_kib as f64 / 1024.0,
        r.budget_mb
    ));
    out.push_str(&format!(
        "| processes of its commands left after the daemon stopped | {} |\n",
        r.leftovers.len()
    ));
    for s in &t.unexpected_samples {
        out.push_str(&format!("\nunexpected: {s}"));
    }
    out
}
