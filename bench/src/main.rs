//! `executor-bench`: the figures of the performance bar (design notes, section 6), measured
//! against a bare spawn of the same command in the same run.
//!
//! One command, from the workspace root:
//!
//! ```text
//! cargo run --release -p executor-bench -- [--quick] [--json PATH]
//! ```
//!
//! It builds `target/release/executor` (unless `--executor` or `--no-build`), starts
//! `executor serve` on 127.0.0.1 with a fresh state directory, and measures, for every profile
//! the daemon's hello lists and this host can run: round trips of `echo hi`, throughput with
//! concurrent connections, streamed output with the daemon's peak RSS, and the timeout kill of a
//! tree with setsid'd children; then daemon-wide figures: RSS with many idle authenticated
//! connections, protocol 1.1 file upload and download beside the processes API with the
//! daemon's RSS (files.rs), and start-to-hello time; last, without the daemon, the cost of creating each
//! kind of namespace (`unshare(1)` per namespace against one creating none). Every load goes
//! to 127.0.0.1 and is bounded in count and time. See bench/README.md for what each figure
//! means.
#![forbid(unsafe_code)]

mod baselines;
mod client;
mod daemon;
mod deployments;
mod egress;
mod files;
mod lab;
mod memory;
mod phases;
mod places;
mod report;
mod soak;
mod soak_conn;
mod soak_host;
mod soak_ops;
mod stats;
mod steps;
mod versus;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use futures_util::StreamExt;
use protocol::Hello;

use crate::client::{request, Client};
use crate::daemon::{
    find_executor, machine_cpu_ms, others_cpu_ms, others_used_ms, raise_nofile, reset_peak_rss,
    status_kib, CpuTimes, Daemon, RssSampler,
};
use crate::phases::{idle_connections, latency, output, startup, timeout_kill};
use crate::report::{
    BareReport, ConnectionsReport, CpuPerCommand, DaemonReport, KillReport, Machine, OutputRun,
    ProfileReport, Report, Settings, Throughput,
};
use crate::stats::{median, summarize};

/// The command whose round trip is measured, as in the design notes' peer table.
pub(crate) const ECHO: &str = "echo hi";
pub(crate) const ECHO_OUTPUT: &str = "hi\n";

#[derive(Parser, Debug)]
#[command(
    name = "executor-bench",
    about = "Latency, throughput, output and memory figures of the executor against a bare spawn"
)]
struct Opts {
    /// A few seconds in all, for CI: fewer iterations, shorter phases, 100 idle connections.
    /// Only shows that the benchmark runs; its figures are not comparable.
    #[arg(long)]
    quick: bool,
    /// Also write every figure as JSON to this file.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// The executor binary to benchmark (default: target/release/executor, built first).
    #[arg(long, value_name = "PATH")]
    executor: Option<PathBuf>,
    /// Do not run `cargo build --release -p executor` before starting.
    #[arg(long)]
    no_build: bool,
    /// A second executor binary run beside --executor in the one-shot phase, taking turns with
    /// it: the static build (`.ci/build-static` prints its path), which is what ships.
    #[arg(long, value_name = "PATH")]
    static_executor: Option<PathBuf>,
    /// Benchmark only these profiles (repeatable; default: every profile in the hello).
    #[arg(long = "profile", value_name = "NAME")]
    profiles: Vec<String>,
    /// Sequential round trips per profile and for the bare spawn [default: 2000; quick: 50].
    #[arg(long, value_name = "N")]
    iterations: Option<usize>,
    /// Seconds per concurrency level [default: 4; quick: 0.25].
    #[arg(long, value_name = "SECS")]
    duration: Option<f64>,
    /// Concurrent connections (and bare-spawn threads) to measure throughput with.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 8, 32])]
    concurrency: Vec<usize>,
    /// Output sizes in MB (10^6 bytes, fractions allowed) to stream.
    #[arg(long, value_delimiter = ',', default_values_t = [10.0, 50.0])]
    output_mb: Vec<f64>,
    /// Ask for output without `stream: true`: only the result (head and tail) comes back, and
    /// MB/s is the daemon's `extra.output_bytes` over wall time.
    #[arg(long)]
    no_stream: bool,
    /// Repeats of each output size, timeout kill and daemon start; medians are reported
    /// [default: 3; quick: 1].
    #[arg(long, value_name = "N")]
    repeats: Option<usize>,
    /// Idle authenticated connections held open for the RSS figure [default: 1000; quick: 100].
    #[arg(long, value_name = "N")]
    idle_connections: Option<usize>,
    /// Timeout of the timeout-kill command, in seconds [default: 0.5; quick: 0.2].
    #[arg(long, value_name = "SECS")]
    kill_timeout: Option<f64>,
    /// Runs of each `unshare` variant in the steps phase [default: 200; quick: 20].
    #[arg(long, value_name = "N")]
    step_iterations: Option<usize>,
    /// Round trips "alone" per profile and baseline, each after 100 ms of idleness, as an
    /// agent's commands come [default: 30; quick: 5].
    #[arg(long, value_name = "N")]
    alone: Option<usize>,
    /// Size of the file uploaded and downloaded in the files phase, in MB (10^6 bytes)
    /// [default: 50; quick: 5].
    #[arg(long, value_name = "MB")]
    file_mb: Option<f64>,
    /// Skip phases (repeatable): latency, output, kill, connections, files, startup, steps;
    /// and the baselines: bubblewrap (the same loop through bwrap), cold (each profile again
    /// on a daemon with --no-warm-workers), oneshot (`executor run` beside bwrap).
    #[arg(long, value_name = "PHASE", value_parser = ["latency", "output", "kill", "connections", "files", "startup", "steps", "bubblewrap", "cold", "oneshot"])]
    skip: Vec<String>,
    /// Instead of the local daemon: start-to-ready and `echo hi` round trips of the static
    /// executor in the test lab's VM or container, beside a bare spawn there (repeatable).
    #[arg(long, value_name = "PLACE", value_parser = ["vm", "container"])]
    lab: Vec<String>,
    /// Instead of the local daemon: per-task overhead of these deployments (start to a first
    /// command result) and `agent batch` throughput with 1, 4 and 8 workers (repeatable:
    /// local, docker, remote, reverse, ssh).
    #[arg(long = "deployments", value_name = "KIND", value_parser = ["local", "docker", "remote", "reverse", "ssh"])]
    deployments: Vec<String>,
    /// Trivial instances per batch for --deployments.
    #[arg(long, default_value_t = 16)]
    batch_instances: usize,
    /// Instead of the usual phases: --executor (the base) and this binary (the new build)
    /// serve side by side, and `echo hi` round trips take turns between them, 5 ms apart,
    /// --iterations pairs per profile: for changes smaller than this machine's drift between
    /// runs. Then (unless --skip oneshot) each build's `executor run` one-shot, taking turns
    /// with the other and with bwrap.
    #[arg(long, value_name = "PATH")]
    versus: Option<PathBuf>,
    /// Instead: the daemon's RSS with this many idle sessions that each ran
    /// --memory-processes processes printing 1 MiB, against its --memory-budget-mb.
    #[arg(long, value_name = "N")]
    memory_sessions: Option<usize>,
    /// Processes printing 1 MiB per session for --memory-sessions (all at once: at most the
    /// daemon's 16 commands per connection).
    #[arg(long, value_name = "N", default_value_t = 16)]
    memory_processes: usize,
    /// Instead: a soak of this many seconds with protocol 1.1 (processes with and without a
    /// PTY, stdin, signals, uploads and downloads, dropped connections resumed, payloads
    /// SIGKILLed from the host, one daemon restart half way); non-zero exit when something
    /// is lost or repeated, left behind, or fails unexpectedly.
    #[arg(long, value_name = "SECONDS")]
    soak: Option<f64>,
    /// Concurrent clients of --soak.
    #[arg(long, value_name = "N", default_value_t = 6)]
    soak_clients: usize,
    /// Instead: what a network policy costs (issue 38): connection set-up through the proxy
    /// and capture, download throughput, the daemon's RSS with --egress-held tunnels open, and
    /// `echo hi` under a policy against `none`, each beside a direct baseline in the same run.
    /// --iterations sets the connections timed per way [default: 1000; quick: 100] and the
    /// `echo hi` pairs [default: 300; quick: 20]; --alone the pairs after 100 ms of idleness;
    /// --repeats the downloads per way.
    #[arg(long)]
    egress: bool,
    /// Size of the --egress download, in MB (10^6 bytes) [default: 200; quick: 20].
    #[arg(long, value_name = "MB")]
    egress_mb: Option<f64>,
    /// Tunnels held open through the proxy for the --egress RSS figure [default: 1000;
    /// quick: 100].
    #[arg(long, value_name = "N")]
    egress_held: Option<usize>,
    /// The daemon's --memory-budget-mb for --memory-sessions and --soak.
    #[arg(long, value_name = "MIB", default_value_t = 256)]
    memory_budget_mb: u64,
}

impl Opts {
    fn settings(&self) -> Settings {
        let q = self.quick;
        Settings {
            mode: if q { "quick" } else { "default" }.to_string(),
            iterations: self.iterations.unwrap_or(if q { 50 } else { 2000 }).max(1),
            duration_s: self
                .duration
                .unwrap_or(if q { 0.25 } else { 4.0 })
                .max(0.01),
            concurrency: self
                .concurrency
                .iter()
                .copied()
                .filter(|&c| c > 0)
                .collect(),
            output_mb: self
                .output_mb
                .iter()
                .copied()
                .filter(|&mb| mb > 0.0)
                .collect(),
            output_streamed: !self.no_stream,
            repeats: self.repeats.unwrap_or(if q { 1 } else { 3 }).max(1),
            idle_connections: self.idle_connections.unwrap_or(if q { 100 } else { 1000 }),
            kill_timeout_s: self.kill_timeout.unwrap_or(if q { 0.2 } else { 0.5 }),
            step_iterations: self
                .step_iterations
                .unwrap_or(if q { 20 } else { 200 })
                .max(1),
            file_mb: self.file_mb.unwrap_or(if q { 5.0 } else { 50.0 }).max(0.0),
            alone: self.alone.unwrap_or(if q { 5 } else { 30 }),
        }
    }

    fn runs(&self, phase: &str) -> bool {
        !self.skip.iter().any(|s| s == phase)
    }
}

fn main() -> std::process::ExitCode {
    match run(Opts::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("executor-bench: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(opts: Opts) -> anyhow::Result<()> {
    if cfg!(debug_assertions) {
        eprintln!(
            "bench: WARNING: this benchmark is a debug build; its client side is slow and the \
             figures are not comparable (use cargo run --release)"
        );
    }
    let settings = opts.settings();
    if !opts.lab.is_empty() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the async runtime")?;
        let reports = rt.block_on(async {
            tokio::time::timeout(lab::PATIENCE, lab::run(&opts.lab, settings.iterations)).await
        });
        let reports = reports.context("the lab took too long")??;
        println!("{}", lab::markdown(&reports));
        return Ok(());
    }
    if !opts.deployments.is_empty() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("cannot start the async runtime")?;
        let agent = deployments::build_agent()?;
        let table = rt.block_on(async {
            let overheads =
                deployments::overhead(&agent, &opts.deployments, settings.repeats.max(5)).await?;
            let throughputs = deployments::throughput(
                &agent,
                &opts.deployments,
                &[1, 4, 8],
                opts.batch_instances,
            )
            .await?;
            anyhow::Ok(deployments::markdown(&overheads, &throughputs))
        })?;
        println!("{table}");
        return Ok(());
    }
    if opts.egress {
        let executor = find_executor(opts.executor.clone(), !opts.no_build)?;
        let q = opts.quick;
        let plan = egress::Plan {
            connections: opts.iterations.unwrap_or(if q { 100 } else { 1000 }).max(1),
            rounds: 5,
            download_mb: opts
                .egress_mb
                .unwrap_or(if q { 20.0 } else { 200.0 })
                .max(0.001),
            repeats: settings.repeats,
            held: opts.egress_held.unwrap_or(if q { 100 } else { 1000 }),
            pairs: opts
                .iterations
                .map(|n| n.min(2000))
                .unwrap_or(if q { 20 } else { 300 }),
            alone_pairs: settings.alone,
        };
        // Two descriptors per held tunnel in the daemon, one here (the holding server).
        let want_fds = (plan.held as u64) * 2 + 1024;
        let nofile = raise_nofile(want_fds)?;
        if nofile < want_fds {
            eprintln!("bench: RLIMIT_NOFILE is {nofile}, below the {want_fds} wanted");
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the async runtime")?;
        let report = rt.block_on(egress::run(&executor, &plan))?;
        println!("{}", egress::markdown(&report));
        if !report.failures.is_empty() {
            bail!("some egress phases failed (see FAILED above)");
        }
        return Ok(());
    }
    if let Some(sessions) = opts.memory_sessions {
        let executor = find_executor(opts.executor.clone(), !opts.no_build)?;
        // A descriptor per connection here and in the daemon, and per ended process kept.
        let want_fds = (sessions as u64) * (opts.memory_processes as u64 + 2) + 1024;
        let nofile = raise_nofile(want_fds)?;
        if nofile < want_fds {
            eprintln!("bench: RLIMIT_NOFILE is {nofile}, below the {want_fds} wanted");
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the async runtime")?;
        let plan = memory::Plan {
            sessions,
            processes: opts.memory_processes,
            budget_mb: opts.memory_budget_mb,
        };
        let report = rt.block_on(memory::measure(&executor, &plan))?;
        println!("{}", memory::markdown(&report));
        return Ok(());
    }
    if let Some(seconds) = opts.soak {
        let executor = find_executor(opts.executor.clone(), !opts.no_build)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("cannot start the async runtime")?;
        let plan = soak::Plan {
            seconds,
            clients: opts.soak_clients.max(1),
            budget_mb: opts.memory_budget_mb,
        };
        let report = rt.block_on(soak::run(&executor, &plan))?;
        println!("{}", soak::markdown(&report));
        let broken = report.broken();
        if !broken.is_empty() {
            bail!("the soak broke invariants: {}", broken.join("; "));
        }
        return Ok(());
    }
    if let Some(new) = &opts.versus {
        let base = find_executor(opts.executor.clone(), !opts.no_build)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the async runtime")?;
        let compared = rt.block_on(versus::run(&base, new, &opts.profiles, settings.iterations))?;
        println!("{}", versus::markdown(&base, new, &compared));
        if opts.runs("oneshot") {
            // The same builds one-shot (`executor run`), taking turns with each other and
            // with bwrap.
            let profiles: Vec<String> = compared.iter().map(|c| c.profile.clone()).collect();
            let (_fresh, base, new) = versus::fresh_copies(&base, new)?;
            let executors = [
                ("base: executor".to_string(), base),
                ("new: executor".to_string(), new),
            ];
            let bwrap = baselines::Spawn::bubblewrap();
            let report =
                baselines::oneshot(&executors, &profiles, bwrap.as_ref(), settings.repeats * 10)?;
            println!("{}", report::oneshot_markdown(&report));
        }
        return Ok(());
    }
    // Checked first: a host without unshare(1) should not lose a whole run to it.
    let unshare = if opts.runs("steps") {
        Some(steps::check_unshare()?)
    } else {
        None
    };
    let executor = find_executor(opts.executor.clone(), !opts.no_build)?;
    // Idle connections need a descriptor each, here and in the daemon, which inherits this.
    let want_fds = (settings.idle_connections as u64 + 256).max(1024);
    let nofile = raise_nofile(want_fds)?;
    if nofile < want_fds {
        eprintln!("bench: RLIMIT_NOFILE is {nofile}, below the {want_fds} wanted");
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let report = rt.block_on(bench(&opts, settings, &executor, unshare))?;
    println!("{}", report::markdown(&report));
    let failed = report.profiles.iter().any(|p| !p.failures.is_empty())
        || report
            .files
            .as_ref()
            .is_some_and(|f| !f.failures.is_empty())
        || report
            .steps
            .as_ref()
            .is_some_and(|s| !s.failures.is_empty());
    if let Some(path) = &opts.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("bench: wrote {}", path.display());
    }
    if failed {
        bail!("some phases failed (see FAILED above); their figures are missing");
    }
    Ok(())
}

async fn bench(
    opts: &Opts,
    settings: Settings,
    executor: &std::path::Path,
    unshare: Option<String>,
) -> anyhow::Result<Report> {
    let started = Instant::now();
    let noise_start = (machine_cpu_ms(), others_cpu_ms());
    eprintln!("bench: starting {} serve", executor.display());
    let daemon = Daemon::start(executor, &[])?;
    let (mut first, hello) = Client::connect(&daemon.url, &daemon.token).await?;
    let rss_after_hello_kib = status_kib(daemon.pid, "VmRSS");
    let machine = machine(&hello, executor);
    eprintln!(
        "bench: daemon pid {} at {}; {} cores, {}",
        daemon.pid, daemon.url, machine.cores, machine.kernel
    );

    let bare = if opts.runs("latency") {
        Some(baselines::measure(&baselines::Spawn::bare(), &settings)?)
    } else {
        None
    };
    // The same spawn in the profile's environment: the locale it sets costs bash a dozen
    // file loads, which is the profile's choice, not the sandbox's mechanism.
    let profile_env_home = tempfile::tempdir().context("a home for the profile's environment")?;
    let bare_profile_env = if opts.runs("latency") {
        let spawn = baselines::Spawn::bare_in_profile_env(profile_env_home.path())?;
        Some(baselines::measure(&spawn, &settings)?)
    } else {
        None
    };
    let bwrap = baselines::Spawn::bubblewrap();
    if bwrap.is_none() && (opts.runs("bubblewrap") || opts.runs("oneshot")) {
        eprintln!("bench: bwrap is not installed; the bubblewrap baselines are left out");
    }
    // A baseline that cannot run here (no user namespaces, say) is left out, not fatal.
    let bubblewrap = match &bwrap {
        Some(spawn) if opts.runs("latency") && opts.runs("bubblewrap") => {
            match baselines::measure(spawn, &settings) {
                Ok(report) => Some(report),
                Err(err) => {
                    eprintln!("bench: bubblewrap cannot run here, left out: {err:#}");
                    None
                }
            }
        }
        _ => None,
    };

    let mut profiles = Vec::new();
    for summary in &hello.profiles {
        if !opts.profiles.is_empty() && !opts.profiles.contains(&summary.name) {
            continue;
        }
        let mut report = ProfileReport::new(&summary.name, &summary.layers);
        // A profile the daemon found it cannot run here is reported as such, not measured.
        if !summary.available {
            let why = summary
                .unavailable_reason
                .clone()
                .unwrap_or_else(|| "no reason given".to_string());
            eprintln!("bench: [{}] unavailable on this host: {why}", summary.name);
            report.skipped = Some(why);
            profiles.push(report);
            continue;
        }
        // Probe: one command at the daemon's defaults. A profile advertised as available that
        // refuses it is a failure of the daemon, reported with the profile.
        let probe = first
            .exec(request(
                format!("probe-{}", summary.name),
                "true",
                &summary.name,
            ))
            .await?;
        if let Err(err) = probe.result {
            let failure = format!(
                "advertised as available, but its first command failed: {}: {}",
                err.code, err.message
            );
            eprintln!("bench: [{}] FAILED {failure}", summary.name);
            report.failures.push(failure);
            profiles.push(report);
            continue;
        }
        // A phase that fails is reported with the profile and the run goes on, on a fresh
        // connection in case the failure broke this one.
        let mut failures = Vec::new();
        if opts.runs("latency") {
            let label = summary.name.clone();
            match latency(
                &daemon,
                &mut first,
                &summary.name,
                &settings,
                &mut report,
                &label,
            )
            .await
            {
                Ok(()) => report.set_overhead(bare.as_ref()),
                Err(err) => failures.push(format!("latency: {err:#}")),
            }
        }
        if opts.runs("output") {
            for &mb in &settings.output_mb {
                match output(&daemon, &mut first, &summary.name, mb, &settings).await {
                    Ok(run) => report.output.push(run),
                    Err(err) => failures.push(format!("output {mb} MB: {err:#}")),
                }
            }
        }
        if opts.runs("kill") {
            match timeout_kill(&mut first, &summary.name, &settings).await {
                Ok(kill) => report.timeout_kill = Some(kill),
                Err(err) => failures.push(format!("timeout kill: {err:#}")),
            }
        }
        if !failures.is_empty() {
            for failure in &failures {
                eprintln!("bench: [{}] FAILED {failure}", summary.name);
            }
            report.failures = failures;
            first.close().await;
            first = Client::connect(&daemon.url, &daemon.token).await?.0;
        }
        profiles.push(report);
    }
    settle().await;
    let rss_idle_kib = status_kib(daemon.pid, "VmRSS");
    first.close().await;

    let connections = if opts.runs("connections") && settings.idle_connections > 0 {
        Some(idle_connections(&daemon, settings.idle_connections).await?)
    } else {
        None
    };
    let files = if opts.runs("files") {
        let profile = files_profile(&hello, &opts.profiles);
        match profile {
            Some(profile) => Some(
                files::measure(
                    &daemon,
                    &hello,
                    &files::Plan {
                        profile: &profile,
                        bytes: (settings.file_mb * 1e6).round() as u64,
                        repeats: settings.repeats,
                    },
                )
                .await,
            ),
            None => {
                eprintln!(
                    "bench: files: no available profile to run them under (the hello's default, \
                     or the first --profile); left out"
                );
                None
            }
        }
    } else {
        None
    };
    daemon.stop()?;

    let cold = if opts.runs("latency") && opts.runs("cold") {
        cold_latency(executor, &profiles, &settings, bare.as_ref()).await?
    } else {
        Vec::new()
    };
    let oneshot = if opts.runs("oneshot") {
        let measured: Vec<String> = profiles
            .iter()
            .filter(|p| p.skipped.is_none() && p.failures.is_empty())
            .map(|p| p.name.clone())
            .collect();
        let mut executors = vec![("executor".to_string(), executor.to_path_buf())];
        if let Some(path) = &opts.static_executor {
            executors.push(("executor (static)".to_string(), path.clone()));
        }
        Some(baselines::oneshot(
            &executors,
            &measured,
            bwrap.as_ref(),
            settings.repeats * 10,
        )?)
    } else {
        None
    };

    let (start_to_listening_ms, start_to_hello_ms) = if opts.runs("startup") {
        startup(executor, settings.repeats).await?
    } else {
        (None, None)
    };

    // After every daemon is stopped, so it measures namespace creation on a quiet daemon side.
    let steps = unshare.map(|version| steps::steps(settings.step_iterations, version));

    eprintln!("bench: done in {:.1} s", started.elapsed().as_secs_f64());
    let mut machine = machine;
    // Noise is what the machine's other processes did meanwhile, counted process by process:
    // our own reaped children's time does not cover the sandboxes (the daemon's fork server
    // lets the kernel reap its helpers, whose time is then added to no parent), so "the
    // machine's busy time minus ours" counted every command's sandbox as noise.
    if let ((Some((_, total0)), others0), Some((_, total1))) = (noise_start, machine_cpu_ms()) {
        let foreign = others_used_ms(&others0, &others_cpu_ms());
        machine.foreign_cpu_percent = Some(100.0 * foreign / (total1 - total0).max(1.0));
    }
    if let Some(p) = machine.foreign_cpu_percent.filter(|&p| p > 5.0) {
        eprintln!(
            "bench: WARNING: other processes used {p:.0}% of the machine's CPU during this run; \
             its figures are noisy"
        );
    }
    Ok(Report {
        machine,
        settings,
        bare,
        bare_profile_env,
        bubblewrap,
        profiles,
        cold,
        oneshot,
        daemon: DaemonReport {
            rss_after_hello_kib,
            rss_idle_kib,
            connections,
            start_to_listening_ms,
            start_to_hello_ms,
        },
        steps,
        files,
    })
}

/// The profile file transfers run under: the first `--profile` the daemon can run, else the
/// hello's default (the strongest this host runs).
fn files_profile(hello: &Hello, wanted: &[String]) -> Option<String> {
    let available = |name: &str| hello.profiles.iter().any(|p| p.name == name && p.available);
    match wanted.first() {
        Some(_) => wanted.iter().find(|w| available(w)).cloned(),
        None => available(&hello.default_profile).then(|| hello.default_profile.clone()),
    }
}

/// The latency phase again for each measured profile, on a second daemon started with
/// `--no-warm-workers`: every command builds its sandbox while the client waits.
async fn cold_latency(
    executor: &std::path::Path,
    warm: &[ProfileReport],
    settings: &Settings,
    bare: Option<&BareReport>,
) -> anyhow::Result<Vec<ProfileReport>> {
    let measured: Vec<&ProfileReport> = warm.iter().filter(|p| p.sequential.is_some()).collect();
    if measured.is_empty() {
        return Ok(Vec::new());
    }
    eprintln!("bench: starting a second daemon with --no-warm-workers");
    let daemon = Daemon::start(executor, &["--no-warm-workers".to_string()])?;
    let mut client = Client::connect(&daemon.url, &daemon.token).await?.0;
    let mut reports = Vec::new();
    for p in measured {
        let mut report = ProfileReport::new(&p.name, &p.layers);
        let label = format!("{} cold", p.name);
        match latency(&daemon, &mut client, &p.name, settings, &mut report, &label).await {
            Ok(()) => report.set_overhead(bare),
            Err(err) => {
                eprintln!("bench: [{label}] FAILED {err:#}");
                report.failures.push(format!("cold latency: {err:#}"));
                client.close().await;
                client = Client::connect(&daemon.url, &daemon.token).await?.0;
            }
        }
        reports.push(report);
    }
    client.close().await;
    daemon.stop()?;
    Ok(reports)
}

fn machine(hello: &Hello, executor: &std::path::Path) -> Machine {
    Machine {
        cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        kernel: hello.host.kernel.clone(),
        arch: hello.host.arch.clone(),
        server: hello.server.clone(),
        executor: executor.display().to_string(),
        release_build: !cfg!(debug_assertions),
        foreign_cpu_percent: None,
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    }
}

/// Let the daemon finish what it was doing (audit writes, cgroup removal) before reading RSS.
pub(crate) async fn settle() {
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// How long the machine is left idle before each round trip or run "alone": longer than the
/// time a CPU takes to go idle, and than an RCU grace period here (8-24 ms), which a move
/// through `cgroup.procs` waits for after a spell without one (bench/JOURNAL.md, "A cgroup v1
/// move waits for an RCU grace period" and "A v1 move without the wait").
pub(crate) const ALONE_AFTER: Duration = Duration::from_millis(100);

/// Prints a progress line at most once a second during long loops.
pub(crate) struct Progress {
    what: String,
    total: Option<usize>,
    last: Instant,
}

impl Progress {
    pub(crate) fn new(what: String, total: Option<usize>) -> Self {
        eprintln!("bench: {what} ...");
        Self {
            what,
            total,
            last: Instant::now(),
        }
    }

    pub(crate) fn tick(&mut self, done: usize) {
        if self.last.elapsed() >= Duration::from_secs(1) {
            self.last = Instant::now();
            match self.total {
                Some(total) => eprintln!("bench: {} {done}/{total}", self.what),
                None => eprintln!("bench: {} {done}", self.what),
            }
        }
    }
}

/// Busy CPU time of the whole machine since `before`, per one of `count` commands: the honest
/// total, as the fork server's helpers are reaped by the kernel and charged to nobody.
pub(crate) fn per_command_machine_ms(before: Option<(f64, f64)>, count: usize) -> Option<f64> {
    let ((busy0, _), (busy1, _)) = (before?, machine_cpu_ms()?);
    Some((busy1 - busy0) / count.max(1) as f64)
}

pub(crate) fn warmups(iterations: usize) -> usize {
    (iterations / 20).clamp(5, 100)
}
