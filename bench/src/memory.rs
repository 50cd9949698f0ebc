//! `--memory-sessions N`: the daemon's resident memory with N idle sessions that each ran
//! `--memory-processes` processes printing 1 MiB (issue 35), against its memory budget
//! (`--memory-budget-mb`, given to a daemon of its own). Without a budget every session kept
//! 8 MiB and more; with it the daemon should grow by the budget and a small amount per
//! session (the connection, its session, its table of ended processes).

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures_util::StreamExt;
use protocol::{ClientMessage, ListProcessesRequest, ServerMessage, SpawnRequest};

use crate::client::Client;
use crate::daemon::{status_kib, Daemon};

/// Prints exactly 1 MiB.
const MEBIBYTE: &str = "yes 0123456789abcde | head -c 1048576";
/// Sessions filling at once (each runs `processes` commands at a time).
const AT_ONCE: usize = 4;

pub(crate) struct Plan {
    pub sessions: usize,
    pub processes: usize,
    pub budget_mb: u64,
}

pub(crate) struct MemoryReport {
    pub sessions: usize,
    pub processes: usize,
    pub budget_mb: u64,
    pub rss_before_kib: u64,
    pub rss_kib: u64,
    pub peak_rss_kib: u64,
    pub kept_bytes: u64,
    pub seconds: f64,
    /// Connections refused with HTTP 503 (the budget had no room for them).
    pub refused: usize,
}

/// One session: connect, run `processes` processes printing 1 MiB at once, wait until none
/// runs; the connection is returned open (idle).
async fn fill(daemon: &Daemon, session: usize, processes: usize) -> anyhow::Result<Client> {
    let (mut client, _) = Client::connect(&daemon.url, &daemon.token).await?;
    for i in 0..processes {
        let id = format!("s{session}-{i}");
        client
            .send(&ClientMessage::Spawn(SpawnRequest {
                id: id.clone(),
                command: MEBIBYTE.into(),
                cwd: None,
                env: Default::default(),
                timeout: None,
                profile: None,
                pty: None,
                network: None,
            }))
            .await?;
        match client.recv().await? {
            ServerMessage::Spawned(_) => {}
            other => bail!("{id}: expected spawned, got {other:?}"),
        }
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        client
            .send(&ClientMessage::ListProcesses(ListProcessesRequest {
                id: None,
            }))
            .await?;
        let listed = match client.recv().await? {
            ServerMessage::Processes(list) => list.processes,
            other => bail!("expected processes, got {other:?}"),
        };
        // Ended, and their output read to its end (a process's end may be known a moment
        // before the last of its output is in).
        if listed
            .iter()
            .all(|p| !p.running && p.output_bytes == 1 << 20)
        {
            return Ok(client);
        }
        if Instant::now() > deadline {
            bail!("session {session}: not all ended with 1 MiB of output after 120 s: {listed:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of the metric `name` (a whole line's name, labels included).
async fn metric(daemon: &Daemon, name: &str) -> anyhow::Result<u64> {
    let addr = daemon
        .url
        .strip_prefix("ws://")
        .and_then(|rest| rest.split('/').next())
        .context("daemon url")?
        .parse()?;
    let text =
        executor_tests::http_get(addr, "/metrics", Some(&format!("Bearer {}", daemon.token)))
            .await?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .with_context(|| format!("no {name} in /metrics"))
}

pub(crate) async fn measure(
    executor: &std::path::Path,
    plan: &Plan,
) -> anyhow::Result<MemoryReport> {
    let extra = [
        "--memory-budget-mb".to_string(),
        plan.budget_mb.to_string(),
        "--max-connections".to_string(),
        (plan.sessions + 64).to_string(),
    ];
    let daemon = Daemon::start(executor, &extra)?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = status_kib(daemon.pid, "VmRSS").unwrap_or(0);
    let started = Instant::now();
    let mut held = Vec::with_capacity(plan.sessions);
    let mut filling = futures_util::stream::iter(0..plan.sessions)
        .map(|s| fill(&daemon, s, plan.processes))
        .buffer_unordered(AT_ONCE);
    let mut refused = 0;
    while let Some(client) = filling.next().await {
        match client {
            Ok(client) => held.push(client),
            // Past the budget the daemon refuses connections (their cost counts in it).
            Err(err) if format!("{err:#}").contains("503") => refused += 1,
            Err(err) => return Err(err),
        }
        if held.len() % 100 == 0 {
            eprintln!(
                "bench: {} sessions, daemon RSS {} MiB",
                held.len(),
                status_kib(daemon.pid, "VmRSS").unwrap_or(0) / 1024
            );
        }
    }
    drop(filling);
    let seconds = started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss = status_kib(daemon.pid, "VmRSS").unwrap_or(0);
    let peak = status_kib(daemon.pid, "VmHWM").unwrap_or(0);
    let kept_bytes = metric(&daemon, "executor_memory_kept_bytes").await?;
    let budget = metric(&daemon, "executor_memory_budget_bytes").await?;
    if budget != plan.budget_mb << 20 {
        bail!(
            "the daemon's budget is {budget} bytes, not {} MiB",
            plan.budget_mb
        );
    }
    drop(held);
    daemon.stop()?;
    Ok(MemoryReport {
        sessions: plan.sessions,
        processes: plan.processes,
        budget_mb: plan.budget_mb,
        rss_before_kib: before,
        rss_kib: rss,
        peak_rss_kib: peak,
        kept_bytes,
        seconds,
        refused,
    })
}

pub(crate) fn markdown(r: &MemoryReport) -> String {
    let grown = r.rss_kib.saturating_sub(r.rss_before_kib);
    let over_budget = grown.saturating_sub(r.budget_mb * 1024);
    let per_session = over_budget as f64 / r.sessions.max(1) as f64;
    let mut out = String::new();
    out.push_str("| figure | value |\n|---|---|\n");
    out.push_str(&format!(
        "| idle sessions, each ran {} processes printing 1 MiB | {} ({} MiB of output, filled in {:.0} s) |\n",
        r.processes,
        r.sessions,
        r.sessions * r.processes,
        r.seconds
    ));
    out.push_str(&format!("| memory budget | {} MiB |\n", r.budget_mb));
    out.push_str(&format!(
        "| kept for clients at the end (`executor_memory_kept_bytes`) | {:.1} MiB |\n",
        r.kept_bytes as f64 / 1048576.0
    ));
    out.push_str(&format!(
        "| daemon RSS before -> after (peak) | {:.1} -> {:.1} MiB ({:.1} MiB) |\n",
        r.rss_before_kib as f64 / 1024.0,
        r.rss_kib as f64 / 1024.0,
        r.peak_rss_kib as f64 / 1024.0
    ));
    out.push_str(&format!(
        "| growth past the budget | {:.1} MiB, {per_session:.1} KiB per session |\n",
        over_budget as f64 / 1024.0
    ));
    out.push_str(&format!(
        "| growth against the budget | {:.1} of {} MiB ({}) |\n",
        grown as f64 / 1024.0,
        r.budget_mb,
        if over_budget == 0 {
            "within"
        } else {
            "PAST IT"
        }
    ));
    out.push_str(&format!(
        "| refused connections (HTTP 503, memory budget full) | {} |\n",
        r.refused
    ));
    out
}
