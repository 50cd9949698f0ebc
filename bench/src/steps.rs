//! The cost of each isolation step on its own: `unshare(1)` of `/bin/true` with one kind of
//! namespace at a time, against `unshare /bin/true` that creates none (fork + exec of both).
//! The difference of the p50s is what creating that namespace adds to every command, whoever
//! creates it; the daemon's strict profile creates all of them per command.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::report::{StepRun, StepsReport};
use crate::stats::summarize;

/// The program every variant runs inside its namespaces: exits at once, no dynamic work.
const PAYLOAD: &str = "/bin/true";

/// (row name, `unshare` flags). The first one creates nothing: the baseline.
const VARIANTS: &[(&str, &[&str])] = &[
    ("baseline: no new namespace", &[]),
    ("network", &["--net"]),
    ("mount", &["--mount"]),
    ("IPC", &["--ipc"]),
    ("UTS", &["--uts"]),
    ("cgroup", &["--cgroup"]),
    ("PID (+ the fork into it)", &["--pid", "--fork"]),
    (
        "all of strict's: mount, PID, network, IPC, UTS, cgroup",
        &[
            "--mount", "--pid", "--fork", "--net", "--ipc", "--uts", "--cgroup",
        ],
    ),
];

/// Fails with a clear message when `unshare(1)` cannot run: checked before anything else, so
/// a host without util-linux does not lose a whole run. Returns its version line.
pub fn check_unshare() -> anyhow::Result<String> {
    let out = Command::new("unshare")
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .context(
            "the `steps` phase needs unshare(1) from util-linux, which is not on PATH: \
             install util-linux (apt-get install util-linux) or pass --skip steps",
        )?;
    let version = String::from_utf8_lossy(&out.stdout);
    let version = version.lines().next().unwrap_or("").trim().to_string();
    if !out.status.success() {
        bail!(
            "`unshare --version` failed ({}): the `steps` phase needs unshare(1) from \
             util-linux; install it or pass --skip steps",
            out.status
        );
    }
    Ok(version)
}

/// One `unshare FLAGS /bin/true`: spawn, wait, check it exited 0.
fn once(flags: &[&str]) -> anyhow::Result<Duration> {
    let t0 = Instant::now();
    let out = Command::new("unshare")
        .args(flags)
        .arg(PAYLOAD)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .context("cannot spawn unshare")?;
    let took = t0.elapsed();
    if !out.status.success() {
        bail!(
            "`unshare {} {PAYLOAD}` failed ({}): {} (the steps phase needs root, or \
             CAP_SYS_ADMIN, and a kernel that allows these namespaces; --skip steps skips it)",
            flags.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(took)
}

/// `iterations` of every variant, interleaved (one of each per round) so that noise from the
/// rest of the machine falls on every variant alike. A variant that fails is dropped from the
/// rounds and reported; the others go on.
pub fn steps(iterations: usize, unshare: String) -> StepsReport {
    let iterations = iterations.max(1);
    eprintln!(
        "bench: [steps] {} variants of unshare {PAYLOAD} x{iterations}, interleaved ...",
        VARIANTS.len()
    );
    let mut samples: Vec<Vec<Duration>> = vec![Vec::with_capacity(iterations); VARIANTS.len()];
    let mut failed: Vec<Option<String>> = vec![None; VARIANTS.len()];
    let warmups = (iterations / 20).clamp(2, 10);
    for round in 0..warmups + iterations {
        for (i, (_, flags)) in VARIANTS.iter().enumerate() {
            if failed[i].is_some() {
                continue;
            }
            match once(flags) {
                Ok(took) if round >= warmups => samples[i].push(took),
                Ok(_) => {}
                Err(err) => failed[i] = Some(format!("{err:#}")),
            }
        }
    }
    let baseline_p50 = if failed[0].is_none() {
        summarize(&samples[0]).map(|s| s.p50_ms)
    } else {
        None
    };
    let mut report = StepsReport {
        unshare,
        payload: PAYLOAD.to_string(),
        iterations,
        steps: Vec::new(),
        failures: Vec::new(),
    };
    for (i, (name, flags)) in VARIANTS.iter().enumerate() {
        if let Some(err) = &failed[i] {
            eprintln!("bench: [steps] FAILED {name}: {err}");
            report.failures.push(format!("{name}: {err}"));
            continue;
        }
        let Some(latency) = summarize(&samples[i]) else {
            continue;
        };
        let cost_p50_ms = if i == 0 {
            None
        } else {
            baseline_p50.map(|b| latency.p50_ms - b)
        };
        eprintln!(
            "bench: [steps] {name}: p50 {:.3} ms, p99 {:.3} ms{}",
            latency.p50_ms,
            latency.p99_ms,
            cost_p50_ms.map_or_else(String::new, |c| format!(", cost {c:+.3} ms"))
        );
        report.steps.push(StepRun {
            name: (*name).to_string(),
            flags: flags.iter().map(|f| (*f).to_string()).collect(),
            latency,
            cost_p50_ms,
        });
    }
    report
}
