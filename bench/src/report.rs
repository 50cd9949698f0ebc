//! What a run measured, as JSON (`--json`) and as the markdown tables printed on stdout.

use std::fmt::Write;
use std::time::Duration;

use serde::Serialize;

use crate::stats::{summarize, Summary};

#[derive(Debug, Serialize)]
pub struct Report {
    pub machine: Machine,
    pub settings: Settings,
    /// `bash -c 'echo hi'` spawned by the benchmark itself; absent when latency is skipped.
    pub bare: Option<BareReport>,
    /// The same spawn in the environment landlock gives its commands (its locale among it).
    pub bare_profile_env: Option<BareReport>,
    /// The same loop through bubblewrap with strict's namespaces; absent when latency is
    /// skipped or bwrap is not installed.
    pub bubblewrap: Option<BareReport>,
    pub profiles: Vec<ProfileReport>,
    /// Latency of each profile on a second daemon started with `--no-warm-workers`, so every
    /// command pays its whole sandbox setup: the baseline the warm workers are measured by.
    pub cold: Vec<ProfileReport>,
    /// One-shot `executor run` beside bwrap and a bare spawn; absent when skipped.
    pub oneshot: Option<OneShotReport>,
    pub daemon: DaemonReport,
    /// The cost of each isolation step on its own; absent when `steps` is skipped.
    pub steps: Option<StepsReport>,
    /// Protocol 1.1 file transfer beside the processes API; absent when `files` is skipped.
    pub files: Option<FilesReport>,
}

#[derive(Debug, Serialize)]
pub struct Machine {
    /// Cores this process may run on.
    pub cores: usize,
    /// From the daemon's hello (`uname -sr`).
    pub kernel: String,
    pub arch: String,
    pub server: String,
    pub executor: String,
    /// Whether the benchmark itself was built with optimizations.
    pub release_build: bool,
    pub unix_time: u64,
    /// Share of the machine's CPU time (all cores) that other processes used during the run:
    /// the user-space processes not descended from this benchmark, process by process
    /// (kernel threads and processes that came and went meanwhile are not counted).
    pub foreign_cpu_percent: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    pub mode: String,
    pub iterations: usize,
    pub duration_s: f64,
    pub concurrency: Vec<usize>,
    pub output_mb: Vec<f64>,
    /// Output requested with `stream: true` (otherwise only the result comes back).
    pub output_streamed: bool,
    pub repeats: usize,
    pub idle_connections: usize,
    pub kill_timeout_s: f64,
    /// Runs of each `unshare` variant in the steps phase.
    pub step_iterations: usize,
    /// Size of the file of the files phase, in MB of 10^6 bytes.
    pub file_mb: f64,
    /// Round trips alone (after 100 ms of idleness each) per profile and baseline.
    pub alone: usize,
}

/// Start-to-exit of one `true`, no daemon kept running.
#[derive(Debug, Serialize)]
pub struct OneShotReport {
    pub runs: usize,
    pub rows: Vec<OneShot>,
}

#[derive(Debug, Serialize)]
pub struct OneShot {
    pub label: String,
    /// In a loop: right after another row's run.
    pub p50_ms: f64,
    /// Alone: after 100 ms of idleness.
    pub alone_p50_ms: f64,
}

#[derive(Debug, Serialize)]
pub struct BareReport {
    pub sequential: Summary,
    /// The same command, each after 100 ms of idleness.
    pub alone: Option<Summary>,
    /// CPU per spawn in the sequential loop (`children_ms` is bash).
    pub cpu: Option<CpuPerCommand>,
    pub seq_cmd_per_s: f64,
    /// Same loop on N threads.
    pub concurrent: Vec<Throughput>,
}

/// CPU time per command of the sequential loop, from /proc/PID/stat (10 ms ticks summed over
/// the whole loop, so precise to 10 ms / iterations).
#[derive(Debug, Serialize)]
pub struct CpuPerCommand {
    /// The daemon's own threads (absent for the bare spawn).
    pub daemon_ms: Option<f64>,
    /// Reaped descendants: the helper and bash for the daemon; bash for the bare spawn.
    pub children_ms: f64,
    /// The benchmark process: the client, or the spawning loop of the bare spawn.
    pub client_ms: f64,
    /// Busy time of the whole machine (all processes) per command during the loop.
    pub machine_ms: Option<f64>,
}

/// Commands completed by `workers` closed-loop clients (each waits for its result before
/// sending the next) over the phase's wall time.
#[derive(Debug, Serialize)]
pub struct Throughput {
    pub workers: usize,
    pub completed: usize,
    pub elapsed_s: f64,
    pub cmd_per_s: f64,
    pub latency: Option<Summary>,
}

impl Throughput {
    pub fn new(workers: usize, latencies: &[Duration], elapsed: Duration) -> Self {
        Self {
            workers,
            completed: latencies.len(),
            elapsed_s: elapsed.as_secs_f64(),
            cmd_per_s: latencies.len() as f64 / elapsed.as_secs_f64().max(1e-9),
            latency: summarize(latencies),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct ProfileReport {
    pub name: String,
    /// Layers the hello says this profile applies on this host.
    pub layers: Vec<String>,
    /// Why this profile was not measured: the daemon's hello says this host cannot run it.
    pub skipped: Option<String>,
    /// Phases that failed for this profile, with the error.
    pub failures: Vec<String>,
    /// Round trip of `echo hi`, one connection, one command at a time.
    pub sequential: Option<Summary>,
    /// The same round trip, each after 100 ms of idleness (as an agent's commands come).
    pub alone: Option<Summary>,
    pub seq_cmd_per_s: Option<f64>,
    pub cpu: Option<CpuPerCommand>,
    pub concurrent: Vec<Throughput>,
    /// p50 minus the bare spawn's p50.
    pub overhead_p50_ms: Option<f64>,
    /// p50 divided by the bare spawn's p50.
    pub overhead_ratio_p50: Option<f64>,
    pub output: Vec<OutputRun>,
    pub timeout_kill: Option<KillReport>,
}

impl ProfileReport {
    /// Overhead over the bare spawn, from the sequential p50s.
    pub fn set_overhead(&mut self, bare: Option<&BareReport>) {
        if let (Some(bare), Some(own)) = (bare, &self.sequential) {
            self.overhead_p50_ms = Some(own.p50_ms - bare.sequential.p50_ms);
            self.overhead_ratio_p50 = Some(own.p50_ms / bare.sequential.p50_ms);
        }
    }

    pub fn new(name: &str, layers: &[String]) -> Self {
        Self {
            name: name.to_string(),
            layers: layers.to_vec(),
            skipped: None,
            failures: Vec::new(),
            sequential: None,
            alone: None,
            seq_cmd_per_s: None,
            cpu: None,
            concurrent: Vec::new(),
            overhead_p50_ms: None,
            overhead_ratio_p50: None,
            output: Vec::new(),
            timeout_kill: None,
        }
    }
}

/// One output size. Streamed (`stream: true`, the default): MB/s = bytes of `data` received in
/// `output` messages / 10^6 / wall time from sending the request to receiving its result.
/// Unstreamed (`--no-stream`): the daemon's `extra.output_bytes` over the same wall time.
#[derive(Debug, Default, Serialize)]
pub struct OutputRun {
    pub megabytes: f64,
    /// Median over the repeats.
    pub mb_per_s: f64,
    pub wall_ms: Vec<f64>,
    pub streamed_bytes: u64,
    /// `extra.output_bytes` the daemon reported.
    pub output_bytes: u64,
    /// Daemon VmRSS just before the (last) transfer.
    pub idle_rss_kib: u64,
    /// Highest daemon peak RSS seen over the repeats.
    pub peak_rss_kib: u64,
    /// Largest peak minus the idle RSS before it, over the repeats.
    pub peak_growth_kib: u64,
    /// Peak read from VmHWM after resetting it (clear_refs 5); otherwise sampled every 2 ms.
    pub peak_from_vmhwm: bool,
}

#[derive(Debug, Serialize)]
pub struct KillReport {
    pub timeout_s: f64,
    /// Client side: time from sending the request to its result, minus the timeout (an upper
    /// bound: it includes the spawn before the deadline clock starts).
    pub deadline_to_result_ms: Option<Summary>,
    /// Daemon side: `extra.duration_ms` minus the timeout.
    pub daemon_overrun_ms: Option<Summary>,
    pub killed_processes: Vec<u32>,
    /// Processes of the tree still alive when the result arrived (should be 0).
    pub leftover_processes: usize,
}

#[derive(Debug, Serialize)]
pub struct DaemonReport {
    pub rss_after_hello_kib: Option<u64>,
    /// After every profile phase, before the idle-connection phase.
    pub rss_idle_kib: Option<u64>,
    pub connections: Option<ConnectionsReport>,
    /// Spawn to the `executor listening on` line.
    pub start_to_listening_ms: Option<Summary>,
    /// Spawn to a received hello on a new authenticated connection.
    pub start_to_hello_ms: Option<Summary>,
}

/// `unshare FLAGS /bin/true` per kind of namespace, against `unshare /bin/true` (none).
#[derive(Debug, Serialize)]
pub struct StepsReport {
    /// `unshare --version`.
    pub unshare: String,
    pub payload: String,
    /// Runs of each variant, interleaved round by round.
    pub iterations: usize,
    /// The baseline first, then one kind of namespace each, then all of strict's together.
    pub steps: Vec<StepRun>,
    /// Variants that failed, with the error.
    pub failures: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct StepRun {
    pub name: String,
    /// `unshare` flags (none for the baseline).
    pub flags: Vec<String>,
    /// Spawn to exit of `unshare FLAGS /bin/true`, waited for.
    pub latency: Summary,
    /// p50 minus the baseline's p50: what creating these namespaces adds (absent for the
    /// baseline itself).
    pub cost_p50_ms: Option<f64>,
}

/// One file moved over the WebSocket every way the protocol offers, on one daemon.
#[derive(Debug, Serialize)]
pub struct FilesReport {
    pub profile: String,
    pub bytes: u64,
    /// Raw bytes per `write` message (base64 in it).
    pub chunk_bytes: usize,
    /// Bytes the paced `spawn` reader asks for at a time: the output ring's size.
    pub window_bytes: usize,
    pub repeats: usize,
    /// In table order; a kind whose every repeat failed has no row.
    pub rows: Vec<TransferRun>,
    /// `spawn` `cat FILE` read by offset without pacing (absent when the upload failed).
    pub unpaced_read: Option<UnpacedRead>,
    pub failures: Vec<String>,
}

/// One way of moving the file, over the repeats.
#[derive(Debug, Serialize)]
pub struct TransferRun {
    /// `upload`, `download`, `spawn_write`, `spawn_read`, `exec_cat`.
    pub kind: String,
    pub label: String,
    /// How the bytes were checked: `sha256`, or `byte count only` for `exec`.
    pub verified: String,
    /// Median over the repeats: bytes / 10^6 / seconds from the first request sent to the
    /// last answer received.
    pub mb_per_s: f64,
    /// Median seconds.
    pub seconds: f64,
    /// Median CPU time of the daemon's own threads (not the sandboxed payload's) during one.
    pub daemon_cpu_ms: f64,
    /// Median CPU time of this benchmark process (the client: base64, JSON, sha256) during one.
    pub client_cpu_ms: f64,
    /// Median minor page faults of the daemon during one: pages touched for the first time,
    /// e.g. of buffers above glibc's mmap threshold, mapped and unmapped per message.
    pub daemon_minor_faults: u64,
    pub all_seconds: Vec<f64>,
    /// Daemon VmRSS before the first repeat (after a 300 ms settle).
    pub rss_before_kib: u64,
    /// Highest daemon peak RSS during a repeat.
    pub rss_peak_kib: u64,
    /// Daemon VmRSS 300 ms after the first repeat (with `rss_before_kib`: what one transfer
    /// left behind).
    pub rss_after_kib: u64,
    /// Largest peak minus the RSS just before it, over the repeats.
    pub peak_growth_kib: u64,
    /// Peaks read from VmHWM after resetting it (clear_refs 5), beside 2 ms VmRSS samples.
    pub peak_from_vmhwm: bool,
}

/// What a reader that does not pace the writer gets from a process's output ring.
#[derive(Debug, Serialize)]
pub struct UnpacedRead {
    /// The process's whole output (the file's size when `cat` succeeded).
    pub output_bytes: u64,
    pub received_bytes: u64,
    /// Bytes that fell out of the ring before they were read.
    pub dropped_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct ConnectionsReport {
    pub count: usize,
    pub rss_before_kib: u64,
    pub rss_kib: u64,
    pub peak_rss_kib: u64,
    pub per_connection_kib: f64,
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_string(), |v| format!("{v:.2}"))
}

fn rate(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_string(), |v| format!("{v:.0}"))
}

fn mib(kib: Option<u64>) -> String {
    kib.map_or_else(
        || "-".to_string(),
        |k| format!("{:.1} MiB", k as f64 / 1024.0),
    )
}

fn throughput_at(list: &[Throughput], workers: usize) -> Option<f64> {
    list.iter()
        .find(|t| t.workers == workers)
        .map(|t| t.cmd_per_s)
}

/// The markdown tables.
pub fn markdown(r: &Report) -> String {
    let mut out = String::new();
    let m = &r.machine;
    let s = &r.settings;
    let noise = m.foreign_cpu_percent.map_or_else(String::new, |p| {
        format!("; other processes used {p:.1}% of the CPU during the run")
    });
    let _ = writeln!(
        out,
        "## executor benchmark ({} mode)\n\n{} cores, {} ({}), {}{}; {} sequential round trips, \
         {:.1} s per concurrency level, {} repeats of output/kill/start-up{noise}\n",
        s.mode,
        m.cores,
        m.kernel,
        m.arch,
        m.server,
        if m.release_build {
            ""
        } else {
            " (benchmark NOT a release build)"
        },
        s.iterations,
        s.duration_s,
        s.repeats
    );

    // Latency and throughput.
    let mut header =
        "| `echo hi` round trip | p50 ms | p90 ms | p99 ms | alone p50 ms | seq cmd/s |"
            .to_string();
    let mut rule = "|---|---:|---:|---:|---:|---:|".to_string();
    for c in &s.concurrency {
        let _ = write!(header, " {c} conn cmd/s |");
        rule.push_str("---:|");
    }
    header.push_str(" overhead p50 ms | ratio p50 |");
    rule.push_str("---:|---:|");
    let table_start = out.len();
    let _ = writeln!(out, "{header}\n{rule}");
    let rows_start = out.len();
    for (label, b) in [
        ("bare spawn, no daemon (threads for concurrency)", &r.bare),
        (
            "bare spawn in landlock's environment (its locale: LANG, LC_ALL)",
            &r.bare_profile_env,
        ),
        ("bubblewrap, strict's namespaces, no daemon", &r.bubblewrap),
    ] {
        let Some(b) = b else { continue };
        let mut row = format!(
            "| {label} | {:.2} | {:.2} | {:.2} | {} | {:.0} |",
            b.sequential.p50_ms,
            b.sequential.p90_ms,
            b.sequential.p99_ms,
            ms(b.alone.as_ref().map(|a| a.p50_ms)),
            b.seq_cmd_per_s
        );
        for c in &s.concurrency {
            let _ = write!(row, " {} |", rate(throughput_at(&b.concurrent, *c)));
        }
        match &r.bare {
            Some(bare) if !std::ptr::eq(bare, b) => {
                let _ = write!(
                    row,
                    " {:.2} | {:.2}x |",
                    b.sequential.p50_ms - bare.sequential.p50_ms,
                    b.sequential.p50_ms / bare.sequential.p50_ms
                );
            }
            _ => row.push_str(" - | 1.00x |"),
        }
        let _ = writeln!(out, "{row}");
    }
    let cold = r.cold.iter().map(|p| (p, " cold (--no-warm-workers)"));
    for (p, suffix) in r.profiles.iter().map(|p| (p, "")).chain(cold) {
        let name = format!("{}{suffix} ({})", p.name, p.layers.join(", "));
        if let Some(why) = &p.skipped {
            let _ = writeln!(out, "| {name} | unavailable on this host: {why} |");
            continue;
        }
        let Some(q) = &p.sequential else {
            if !p.failures.is_empty() {
                let _ = writeln!(out, "| {name} | FAILED (below) |");
            }
            continue;
        };
        let mut row = format!(
            "| {name} | {:.2} | {:.2} | {:.2} | {} | {} |",
            q.p50_ms,
            q.p90_ms,
            q.p99_ms,
            ms(p.alone.as_ref().map(|a| a.p50_ms)),
            rate(p.seq_cmd_per_s)
        );
        for c in &s.concurrency {
            let _ = write!(row, " {} |", rate(throughput_at(&p.concurrent, *c)));
        }
        let _ = write!(
            row,
            " {} | {} |",
            ms(p.overhead_p50_ms),
            p.overhead_ratio_p50
                .map_or_else(|| "-".to_string(), |v| format!("{v:.2}x"))
        );
        let _ = writeln!(out, "{row}");
    }
    // No header without rows (`--skip latency`).
    if out.len() == rows_start {
        out.truncate(table_start);
    }

    // Where the CPU of one sequential command goes. The machine's busy time is the total;
    // a helper's own time is not in the daemon's reaped children (the fork server lets the
    // kernel reap them), so it is not shown on its own.
    let mut cpu_rows = Vec::new();
    for (label, b) in [
        ("bare spawn", &r.bare),
        ("bare spawn, landlock's environment", &r.bare_profile_env),
        ("bubblewrap", &r.bubblewrap),
    ] {
        if let Some(c) = b.as_ref().and_then(|b| b.cpu.as_ref()) {
            cpu_rows.push((label.to_string(), c));
        }
    }
    let cold = r.cold.iter().map(|p| (p, " cold"));
    for (p, suffix) in r.profiles.iter().map(|p| (p, "")).chain(cold) {
        if let Some(c) = &p.cpu {
            cpu_rows.push((format!("{}{suffix}", p.name), c));
        }
    }
    if !cpu_rows.is_empty() {
        let _ = writeln!(
            out,
            "\n| CPU per sequential command, ms | whole machine | daemon | benchmark process |\n\
             |---|---:|---:|---:|"
        );
        for (label, c) in cpu_rows {
            let _ = writeln!(
                out,
                "| {label} | {} | {} | {:.2} |",
                ms(c.machine_ms),
                ms(c.daemon_ms),
                c.client_ms
            );
        }
    }

    // Output and timeout kill, per profile.
    let measured: Vec<&ProfileReport> = r
        .profiles
        .iter()
        .filter(|p| p.skipped.is_none() && (!p.output.is_empty() || p.timeout_kill.is_some()))
        .collect();
    if !measured.is_empty() {
        let mut header = "\n| profile |".to_string();
        let mut rule = "|---|".to_string();
        for mb in &s.output_mb {
            let _ = write!(
                header,
                " {mb} MB {} MB/s | daemon RSS idle -> peak ({mb} MB) |",
                if s.output_streamed {
                    "streamed"
                } else {
                    "unstreamed"
                }
            );
            rule.push_str("---:|---:|");
        }
        header.push_str(" timeout kill: deadline to result p50 / max ms | survivors |");
        rule.push_str("---:|---:|");
        let _ = writeln!(out, "{header}\n{rule}");
        for p in measured {
            let mut row = format!("| {} |", p.name);
            for mb in &s.output_mb {
                match p.output.iter().find(|o| o.megabytes == *mb) {
                    Some(o) => {
                        let _ = write!(
                            row,
                            " {:.0} | {} -> {} (+{:.1} MiB) |",
                            o.mb_per_s,
                            mib(Some(o.idle_rss_kib)),
                            mib(Some(o.peak_rss_kib)),
                            o.peak_growth_kib as f64 / 1024.0
                        );
                    }
                    None => row.push_str(" - | - |"),
                }
            }
            match &p.timeout_kill {
                Some(k) => {
                    let d = k.deadline_to_result_ms.as_ref();
                    let _ = write!(
                        row,
                        " {} / {} | {} |",
                        ms(d.map(|d| d.p50_ms)),
                        ms(d.map(|d| d.max_ms)),
                        k.leftover_processes
                    );
                }
                None => row.push_str(" - | - |"),
            }
            let _ = writeln!(out, "{row}");
        }
    }

    if let Some(o) = &r.oneshot {
        out.push_str(&oneshot_markdown(o));
    }

    for p in r.profiles.iter().chain(&r.cold) {
        for failure in &p.failures {
            let _ = writeln!(out, "\n**{} FAILED** {failure}", p.name);
        }
    }

    // Daemon-wide figures.
    let d = &r.daemon;
    let _ = writeln!(out, "\n| daemon | value | target |\n|---|---:|---:|");
    let _ = writeln!(
        out,
        "| RSS after start and first hello | {} | |",
        mib(d.rss_after_hello_kib)
    );
    let _ = writeln!(
        out,
        "| RSS idle after the load above | {} | <= 10 MB |",
        mib(d.rss_idle_kib)
    );
    if let Some(c) = &d.connections {
        let _ = writeln!(
            out,
            "| RSS with {} idle authenticated connections | {} ({:.1} KiB per connection) | <= 64 MB |",
            c.count,
            mib(Some(c.rss_kib)),
            c.per_connection_kib
        );
    }
    if let Some(h) = &d.start_to_hello_ms {
        let listening = d.start_to_listening_ms.as_ref().map(|l| l.p50_ms);
        let _ = writeln!(
            out,
            "| start to hello, p50 of {} (to listening line: {} ms) | {:.1} ms | <= 50 ms |",
            h.count,
            ms(listening),
            h.p50_ms
        );
    }

    if let Some(files) = &r.files {
        files_markdown(&mut out, files);
    }

    if let Some(st) = &r.steps {
        steps_markdown(&mut out, st);
    }
    out
}

/// MiB with one decimal, from KiB.
/// The one-shot table (`baselines::oneshot`), after a blank line.
pub fn oneshot_markdown(o: &OneShotReport) -> String {
    let mut out = format!(
        "\n| one-shot `true`, start to exit, p50 of {} (the rows take turns) | in a loop, ms | alone (100 ms idle before), ms |\n|---|---:|---:|\n",
        o.runs
    );
    for row in &o.rows {
        let _ = writeln!(
            out,
            "| {} | {:.2} | {:.2} |",
            row.label, row.p50_ms, row.alone_p50_ms
        );
    }
    out
}

fn mib1(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

/// One row of the file-transfer table.
fn transfer_row(t: &TransferRun) -> String {
    format!(
        "| {} | {:.0} | {:.2} | {:.0} | {:.0} | {} | {} | {} | +{} | {} |",
        t.label,
        t.mb_per_s,
        t.seconds,
        t.daemon_cpu_ms,
        t.client_cpu_ms,
        mib1(t.rss_before_kib),
        mib1(t.rss_peak_kib),
        mib1(t.rss_after_kib),
        mib1(t.peak_growth_kib),
        t.verified
    )
}

/// The file-transfer table: one row per way of moving the file.
fn files_markdown(out: &mut String, f: &FilesReport) {
    let _ = writeln!(
        out,
        "\n| {} MB file over one WebSocket, profile {}, {} KiB per `write`, median of {} | MB/s | \
         seconds | daemon CPU ms | bench CPU ms | daemon RSS before MiB | peak MiB | after MiB | \
         peak growth MiB | checked |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        f.bytes as f64 / 1e6,
        f.profile,
        f.chunk_bytes / 1024,
        f.repeats
    );
    for t in &f.rows {
        let _ = writeln!(out, "{}", transfer_row(t));
    }
    if let Some(u) = &f.unpaced_read {
        let _ = writeln!(
            out,
            "\n`spawn` `cat FILE` read by offset without pacing: {:.1} of {:.1} MB arrived, {:.1} MB \
             fell out of the {} KiB output ring before they were read (a process's output is not \
             flow-controlled; the paced row above asks for one ring's worth at a time).",
            u.received_bytes as f64 / 1e6,
            u.output_bytes as f64 / 1e6,
            u.dropped_bytes as f64 / 1e6,
            f.window_bytes / 1024
        );
    }
    for failure in &f.failures {
        let _ = writeln!(out, "\n**files FAILED** {failure}");
    }
}

/// The cost of each isolation step: one row per `unshare` variant.
fn steps_markdown(out: &mut String, st: &StepsReport) {
    let _ = writeln!(
        out,
        "
| isolation step: `unshare FLAGS {}`, {} runs each | flags | p50 ms | p99 ms | \
         cost p50 ms (minus baseline) |\n|---|---|---:|---:|---:|",
        st.payload, st.iterations
    );
    for step in &st.steps {
        let flags = if step.flags.is_empty() {
            "(none)".to_string()
        } else {
            format!("`{}`", step.flags.join(" "))
        };
        let _ = writeln!(
            out,
            "| {} | {flags} | {:.2} | {:.2} | {} |",
            step.name,
            step.latency.p50_ms,
            step.latency.p99_ms,
            step.cost_p50_ms
                .map_or_else(|| "-".to_string(), |c| format!("{c:+.2}"))
        );
    }
    let _ = writeln!(
        out,
        "\nCost = what creating the namespace adds to one command ({}). strict creates all of \
         them but the network namespace per command (one emptied by an earlier command of the \
         same client is reused): warm workers take that off the critical path (they create \
         the next command's namespaces ahead of it).",
        if st.unshare.is_empty() {
            "unshare(1)"
        } else {
            st.unshare.as_str()
        }
    );
    for failure in &st.failures {
        let _ = writeln!(out, "\n**steps FAILED** {failure}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_row_shows_rate_seconds_and_rss_in_mib() {
        let row = TransferRun {
            kind: "upload".into(),
            label: "`upload`".into(),
            verified: "sha256".into(),
            mb_per_s: 123.456,
            seconds: 0.40501,
            daemon_cpu_ms: 250.0,
            client_cpu_ms: 180.4,
            daemon_minor_faults: 0,
            all_seconds: vec![0.40501],
            rss_before_kib: 8 * 1024,
            rss_peak_kib: 10 * 1024 + 512,
            rss_after_kib: 9 * 1024,
            peak_growth_kib: 2 * 1024 + 512,
            peak_from_vmhwm: true,
        };
        assert_eq!(
            transfer_row(&row),
            "| `upload` | 123 | 0.41 | 250 | 180 | 8.0 | 10.5 | 9.0 | +2.5 | sha256 |"
        );
    }

    #[test]
    fn mib_has_one_decimal() {
        assert_eq!(mib1(0), "0.0");
        assert_eq!(mib1(1536), "1.5");
    }
}
