//! `--lab vm|container`: start-to-ready and the `echo hi` round trip of the static executor in
//! the test lab's VM (Debian 12's kernel under qemu's emulation) and default container
//! (podman), each beside a bare spawn of `bash -c 'echo hi'` in the same place. The targets
//! are the test harness's own (`executor_tests::vm`, `executor_tests::container`): the same
//! image, daemon flags and pinned `wss://` connection as the suites.
//!
//! Timings inside a target come from bash's `$EPOCHREALTIME` (microseconds), read through
//! the target's way in that is not the executor (the VM's side channel, `podman exec`).

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use executor_tests::{req, Target};

use crate::stats::{median, summarize, Summary};

/// Figures of one target.
pub struct LabReport {
    pub place: String,
    /// From starting qemu or `podman run` to the daemon's ready line, in seconds.
    pub machine_to_ready_s: f64,
    /// A second daemon started inside the running target, spawn to ready line (median), ms.
    pub daemon_start_to_ready_ms: f64,
    /// `bash -c 'echo hi'` spawned by bash in the target, per spawn (mean), ms.
    pub bare_spawn_ms: f64,
    /// `echo hi` round trips from this host over the pinned `wss://` connection.
    pub round_trips: Vec<(String, Summary)>,
    pub unavailable: Vec<(String, String)>,
}

pub async fn run(places: &[String], iterations: usize) -> anyhow::Result<Vec<LabReport>> {
    let mut reports = Vec::new();
    for place in places {
        let report = match place.as_str() {
            "vm" => {
                eprintln!("bench: booting the lab VM (qemu, software emulation)");
                let Some(vm) = executor_tests::vm::shared() else {
                    bail!("the lab VM needs qemu, busybox-static, bash-static and cpio");
                };
                measure(vm, "VM (6.1, qemu TCG)", vm.boot_seconds, iterations / 4).await?
            }
            "container" => {
                eprintln!("bench: starting the lab container (podman, runc)");
                let Some(c) = executor_tests::container::shared() else {
                    bail!("the lab container needs podman and runc");
                };
                measure(
                    c,
                    "container (podman, default)",
                    c.start_seconds,
                    iterations,
                )
                .await?
            }
            other => bail!("--lab takes vm or container, not {other}"),
        };
        reports.push(report);
    }
    Ok(reports)
}

async fn measure(
    target: &impl Target,
    place: &str,
    machine_to_ready_s: f64,
    iterations: usize,
) -> anyhow::Result<LabReport> {
    let iterations = iterations.max(5);
    let mut starts = Vec::new();
    for _ in 0..3 {
        starts.push(timed_in(target, DAEMON_START)?);
    }
    let spawns = timed_in(target, &BARE_SPAWN.replace("N", &iterations.to_string()))?;
    let mut client = target.endpoint().connect().await;
    let mut round_trips = Vec::new();
    let mut unavailable = Vec::new();
    for profile in client.hello.profiles.clone() {
        if !executor_tests::profiles::SHIPPED.contains(&profile.name.as_str()) {
            continue;
        }
        if !profile.available {
            let why = profile.unavailable_reason.unwrap_or_default();
            unavailable.push((profile.name, why));
            continue;
        }
        let mut samples = Vec::new();
        for i in 0..iterations + 2 {
            let mut r = req(&format!("{}-{i}", profile.name), "echo hi");
            r.profile = Some(profile.name.clone());
            let sent = Instant::now();
            let result = client.exec(r).await.result;
            let took = sent.elapsed();
            match result {
                Ok(result) if result.output == "hi\n" => {}
                other => bail!("[{}] echo hi: {other:?}", profile.name),
            }
            // The first two warm up the connection and the daemon's caches.
            if i >= 2 {
                samples.push(took);
            }
        }
        round_trips.push((profile.name, summarize(&samples).context("no samples")?));
    }
    Ok(LabReport {
        place: place.to_string(),
        machine_to_ready_s,
        daemon_start_to_ready_ms: median(&starts).unwrap_or(f64::NAN),
        bare_spawn_ms: spawns / iterations as f64,
        round_trips,
        unavailable,
    })
}

/// A second daemon on a loopback port of the target, timed from spawn to its ready line.
const DAEMON_START: &str = r#"d=$(mktemp -d)
t0=$EPOCHREALTIME
executor serve --listen 127.0.0.1:0 --state-dir "$d" >"$d/out" 2>/dev/null &
p=$!
until grep -q listening "$d/out"; do sleep 0.002; done
t1=$EPOCHREALTIME
kill $p; wait $p; rm -rf "$d"
echo "$t0 $t1""#;

/// N spawns of `bash -c 'echo hi'` by bash, output read and discarded.
const BARE_SPAWN: &str = r#"t0=$EPOCHREALTIME
for ((i = 0; i < N; i++)); do bash -c 'echo hi' >/dev/null; done
t1=$EPOCHREALTIME
echo "$t0 $t1""#;

/// Run the bash `script` on the target, outside the sandbox; it prints `t0 t1` (seconds):
/// returns the difference in milliseconds.
fn timed_in(target: &impl Target, script: &str) -> anyhow::Result<f64> {
    let out = target.outside(&format!("bash <<'BENCH_EOF'\n{script}\nBENCH_EOF"));
    let times: Vec<f64> = out
        .output
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    match times[..] {
        [t0, t1] if out.code == 0 => Ok((t1 - t0) * 1e3),
        _ => bail!("timing script failed: {out:?}"),
    }
}

/// The lab figures as a markdown table.
pub fn markdown(reports: &[LabReport]) -> String {
    let mut text = String::from(
        "| where | machine start to ready | daemon start to ready | bare `bash -c 'echo hi'` | `echo hi` round trip p50 / p90 |\n\
         |---|---:|---:|---:|---|\n",
    );
    for r in reports {
        let trips: Vec<String> = r
            .round_trips
            .iter()
            .map(|(p, s)| format!("{p} {:.2} / {:.2} ms", s.p50_ms, s.p90_ms))
            .collect();
        text.push_str(&format!(
            "| {} | {:.1} s | {:.0} ms | {:.2} ms | {} |\n",
            r.place,
            r.machine_to_ready_s,
            r.daemon_start_to_ready_ms,
            r.bare_spawn_ms,
            trips.join("; ")
        ));
    }
    for r in reports {
        for (profile, why) in &r.unavailable {
            text.push_str(&format!("\n{}: {profile} unavailable: {why}", r.place));
        }
    }
    text
}

/// How long the lab may take before the benchmark gives up on it.
pub const PATIENCE: Duration = Duration::from_secs(900);
