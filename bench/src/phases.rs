//! The benchmark's phases against one daemon: `echo hi` round trips (sequential and from
//! several connections), output floods, the timeout's kill, idle connections, and start-up.

use super::*;

pub(crate) async fn echo(
    client: &mut Client,
    id: String,
    profile: &str,
) -> anyhow::Result<Duration> {
    let t0 = Instant::now();
    let (result, _) = client.run(request(id, ECHO, profile)).await?;
    let took = t0.elapsed();
    if result.returncode != 0 || result.output != ECHO_OUTPUT {
        bail!(
            "`{ECHO}` under {profile} gave returncode {} output {:?} ({})",
            result.returncode,
            result.output,
            result.exception_info
        );
    }
    Ok(took)
}

pub(crate) async fn latency(
    daemon: &Daemon,
    client: &mut Client,
    profile: &str,
    settings: &Settings,
    report: &mut ProfileReport,
    label: &str,
) -> anyhow::Result<()> {
    for i in 0..warmups(settings.iterations) {
        echo(client, format!("w{i}"), profile).await?;
    }
    let mut progress = Progress::new(
        format!("[{label}] {} sequential round trips", settings.iterations),
        Some(settings.iterations),
    );
    let mut samples = Vec::with_capacity(settings.iterations);
    let me = std::process::id();
    let cpu0 = (CpuTimes::of(daemon.pid), CpuTimes::of(me));
    let machine0 = machine_cpu_ms();
    let t0 = Instant::now();
    for i in 0..settings.iterations {
        samples.push(echo(client, format!("s{i}"), profile).await?);
        progress.tick(i + 1);
    }
    let elapsed = t0.elapsed();
    let machine_ms = per_command_machine_ms(machine0, settings.iterations);
    let mut alone = Vec::with_capacity(settings.alone);
    for i in 0..settings.alone {
        tokio::time::sleep(ALONE_AFTER).await;
        alone.push(echo(client, format!("a{i}"), profile).await?);
    }
    report.alone = summarize(&alone);
    // Helpers are the daemon's reaped children, and the shells the helpers' reaped children.
    if let ((Some(d0), Some(c0)), Some(d1), Some(c1)) =
        (cpu0, CpuTimes::of(daemon.pid), CpuTimes::of(me))
    {
        let daemon_cpu = d1.per(d0, settings.iterations);
        report.cpu = Some(CpuPerCommand {
            daemon_ms: Some(daemon_cpu.own_ms),
            children_ms: daemon_cpu.children_ms,
            client_ms: c1.per(c0, settings.iterations).own_ms,
            machine_ms,
        });
    }
    report.seq_cmd_per_s = Some(settings.iterations as f64 / elapsed.as_secs_f64());
    report.sequential = summarize(&samples);
    if let Some(s) = &report.sequential {
        eprintln!(
            "bench: [{label}] p50 {:.3} ms p99 {:.3} ms, {:.0} cmd/s sequential",
            s.p50_ms,
            s.p99_ms,
            settings.iterations as f64 / elapsed.as_secs_f64()
        );
    }

    for &conns in &settings.concurrency {
        eprintln!(
            "bench: [{label}] {conns} concurrent connections for {:.1} s ...",
            settings.duration_s
        );
        let mut clients = Vec::with_capacity(conns);
        for _ in 0..conns {
            clients.push(Client::connect(&daemon.url, &daemon.token).await?.0);
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(settings.duration_s);
        let t0 = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for (n, mut client) in clients.into_iter().enumerate() {
            let profile = profile.to_string();
            tasks.spawn(async move {
                let mut lat = Vec::new();
                let mut i = 0usize;
                while tokio::time::Instant::now() < deadline {
                    lat.push(echo(&mut client, format!("c{n}-{i}"), &profile).await?);
                    i += 1;
                }
                client.close().await;
                anyhow::Ok(lat)
            });
        }
        let mut all = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            all.extend(joined.context("worker panicked")??);
        }
        let tp = Throughput::new(conns, &all, t0.elapsed());
        eprintln!(
            "bench: [{label}] {conns} connections: {:.0} cmd/s",
            tp.cmd_per_s
        );
        report.concurrent.push(tp);
    }
    Ok(())
}

// ---- output --------------------------------------------------------------------------------

pub(crate) async fn output(
    daemon: &Daemon,
    client: &mut Client,
    profile: &str,
    mb: f64,
    settings: &Settings,
) -> anyhow::Result<OutputRun> {
    let bytes = (mb * 1e6).round() as u64;
    // Printable ASCII, so streamed UTF-8 bytes equal output bytes and JSON escapes only '\n'.
    // `yes` ends on SIGPIPE or, where the payload ignores SIGPIPE, on EPIPE with a message on
    // stderr; that message is not part of the measured output.
    let command = format!(
        "yes 0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ 2>/dev/null \
         | head -c {bytes}"
    );
    eprintln!(
        "bench: [{profile}] {mb} MB of {} output x{} ...",
        if settings.output_streamed {
            "streamed"
        } else {
            "unstreamed"
        },
        settings.repeats
    );
    let mut rates = Vec::new();
    let mut growths = Vec::new();
    let mut run = OutputRun {
        megabytes: mb,
        ..OutputRun::default()
    };
    for r in 0..settings.repeats {
        settle().await;
        let idle = status_kib(daemon.pid, "VmRSS").unwrap_or(0);
        let hwm_reset = reset_peak_rss(daemon.pid);
        // Backup for kernels that refuse the reset: sample VmRSS while the output flows.
        let sampler = RssSampler::start(daemon.pid);
        let mut req = request(format!("o{mb}-{r}"), &command, profile);
        req.stream = settings.output_streamed;
        let t0 = Instant::now();
        let (result, streamed) = client.run(req).await?;
        let wall = t0.elapsed();
        let sampled = sampler.stop();
        let peak = if hwm_reset {
            status_kib(daemon.pid, "VmHWM").unwrap_or(0).max(sampled)
        } else {
            sampled
        };
        let streamed_ok = !settings.output_streamed || streamed == bytes;
        if result.returncode != 0 || result.extra.output_bytes != bytes || !streamed_ok {
            bail!(
                "{mb} MB output under {profile}: returncode {}, {} bytes reported, {streamed} \
                 streamed ({})",
                result.returncode,
                result.extra.output_bytes,
                result.exception_info
            );
        }
        let counted = if settings.output_streamed {
            streamed
        } else {
            result.extra.output_bytes
        };
        let rate = counted as f64 / 1e6 / wall.as_secs_f64();
        rates.push(rate);
        growths.push(peak.saturating_sub(idle) as f64);
        run.streamed_bytes = streamed;
        run.output_bytes = result.extra.output_bytes;
        run.idle_rss_kib = idle;
        run.peak_rss_kib = run.peak_rss_kib.max(peak);
        run.peak_from_vmhwm = hwm_reset;
        run.wall_ms.push(wall.as_secs_f64() * 1e3);
    }
    run.mb_per_s = median(&rates).unwrap_or(0.0);
    run.peak_growth_kib = growths.iter().copied().fold(0.0, f64::max) as u64;
    eprintln!(
        "bench: [{profile}] {mb} MB: {:.0} MB/s, peak RSS +{} KiB",
        run.mb_per_s, run.peak_growth_kib
    );
    Ok(run)
}

// ---- timeout kill --------------------------------------------------------------------------

pub(crate) async fn timeout_kill(
    client: &mut Client,
    profile: &str,
    settings: &Settings,
) -> anyhow::Result<KillReport> {
    eprintln!(
        "bench: [{profile}] timeout kill of a setsid'd tree x{} ...",
        settings.repeats
    );
    let mut client_side = Vec::new();
    let mut daemon_side = Vec::new();
    let mut leftovers = 0usize;
    let mut killed = Vec::new();
    for r in 0..settings.repeats {
        // GNU sleep takes fractions, so the marker rides in the argument and finds survivors.
        let marker = format!("3600.{}{r:04}", std::process::id());
        let command = format!(
            "setsid sleep {marker} & setsid bash -c 'sleep {marker}; true' & \
             (setsid sleep {marker} &); sleep {marker}"
        );
        let mut req = request(format!("k{r}"), &command, profile);
        req.timeout = Some(settings.kill_timeout_s);
        let t0 = Instant::now();
        let (result, _) = client.run(req).await?;
        let took = t0.elapsed().as_secs_f64() * 1e3;
        if !result.extra.timed_out {
            bail!("the timeout-kill command under {profile} did not time out: {result:?}");
        }
        let left = processes_matching(&marker);
        leftovers += left.len();
        for pid in left {
            // Our own leftovers, found by their unique marker: do not leave them running.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let deadline_ms = settings.kill_timeout_s * 1e3;
        client_side.push(Duration::from_secs_f64(
            ((took - deadline_ms).max(0.0)) / 1e3,
        ));
        daemon_side.push(Duration::from_secs_f64(
            ((result.extra.duration_ms - deadline_ms).max(0.0)) / 1e3,
        ));
        killed.push(result.extra.killed_processes);
    }
    let report = KillReport {
        timeout_s: settings.kill_timeout_s,
        deadline_to_result_ms: summarize(&client_side),
        daemon_overrun_ms: summarize(&daemon_side),
        killed_processes: killed,
        leftover_processes: leftovers,
    };
    if let Some(s) = &report.deadline_to_result_ms {
        eprintln!(
            "bench: [{profile}] deadline to result p50 {:.1} ms, {leftovers} survivors",
            s.p50_ms
        );
    }
    Ok(report)
}

/// Pids of live, non-zombie processes whose command line contains `needle`.
pub(crate) fn processes_matching(needle: &str) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let me = std::process::id() as i32;
    dir.flatten()
        .filter_map(|entry| {
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let zombie = stat
                .rfind(')')
                .is_some_and(|i| stat[i + 1..].trim_start().starts_with('Z'));
            (pid != me && !zombie && cmdline.contains(needle)).then_some(pid)
        })
        .collect()
}

// ---- idle connections ----------------------------------------------------------------------

pub(crate) async fn idle_connections(
    daemon: &Daemon,
    count: usize,
) -> anyhow::Result<ConnectionsReport> {
    settle().await;
    let before = status_kib(daemon.pid, "VmRSS").unwrap_or(0);
    let mut progress = Progress::new(
        format!("opening {count} idle authenticated connections"),
        Some(count),
    );
    let mut clients = Vec::with_capacity(count);
    // A few handshakes at a time: the listen backlog is finite and this is not a connect storm.
    let mut connecting = futures_util::stream::iter(0..count)
        .map(|_| Client::connect(&daemon.url, &daemon.token))
        .buffer_unordered(32);
    while let Some(connected) = connecting.next().await {
        clients.push(connected?.0);
        progress.tick(clients.len());
    }
    settle().await;
    let with = status_kib(daemon.pid, "VmRSS").unwrap_or(0);
    let peak = status_kib(daemon.pid, "VmHWM").unwrap_or(0);
    let held = clients.len();
    drop(clients);
    let per_connection = with.saturating_sub(before) as f64 / held.max(1) as f64;
    eprintln!(
        "bench: {held} idle connections: RSS {} KiB (was {before} KiB, {per_connection:.1} KiB each)",
        with
    );
    Ok(ConnectionsReport {
        count: held,
        rss_before_kib: before,
        rss_kib: with,
        peak_rss_kib: peak,
        per_connection_kib: per_connection,
    })
}

// ---- start-up ------------------------------------------------------------------------------

/// Start a fresh daemon `repeats` times: time to its listening line and to a received hello.
pub(crate) async fn startup(
    executor: &std::path::Path,
    repeats: usize,
) -> anyhow::Result<(Option<stats::Summary>, Option<stats::Summary>)> {
    eprintln!("bench: daemon start to hello x{repeats} ...");
    let mut listening = Vec::new();
    let mut hello = Vec::new();
    for _ in 0..repeats {
        let daemon = Daemon::start(executor, &[])?;
        let (client, _) = Client::connect(&daemon.url, &daemon.token).await?;
        hello.push(daemon.spawned_at.elapsed());
        listening.push(daemon.listening_after);
        client.close().await;
        daemon.stop()?;
    }
    let report = (summarize(&listening), summarize(&hello));
    if let Some(s) = &report.1 {
        eprintln!("bench: start to hello p50 {:.1} ms", s.p50_ms);
    }
    Ok(report)
}
