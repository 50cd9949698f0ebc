//! Filling things: the private tmpfs mounts, the disk (file size limit), the descriptor table,
//! the output channel, and waiting on stdin. Each fill stops at its bound and the host is
//! untouched; each has a small control of the same action that succeeds.

use std::time::{Duration, Instant};

use executor_tests::{fd_count, marker, peak_rss_kib, rss_kib};

use crate::common::*;

const MIB: u64 = 1024 * 1024;

/// Write up to `mib` MiB into `path`, then print its size.
fn fill(path: &str, mib: u64) -> String {
    format!(
        "dd if=/dev/zero of={path} bs=1M count={mib} 2>&1; \
         echo size=$(stat -c %s {path}); df -m $(dirname {path}) | tail -1"
    )
}

#[tokio::test]
async fn private_tmp_and_dev_shm_fill_up_at_their_size_without_touching_the_host() {
    let _heavy = HEAVY.lock().await;
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    for (dir, size_mib) in [("/tmp", 512u64), ("/dev/shm", 64)] {
        let m = marker();
        let path = format!("{dir}/fill-{m}");
        // Control: a small file fits, and the host's directory of the same name never sees it.
        let ok = run_in(&mut client, STRICT, "small", &fill(&path, 8)).await;
        assert!(
            ok.output.contains(&format!("size={}", 8 * MIB)),
            "[strict] control {dir}: {}",
            ok.output
        );
        assert!(
            !std::path::Path::new(&path).exists(),
            "[strict] {path} appeared on the host: {dir} is not private"
        );
        let big = run_streamed(
            &mut client,
            STRICT,
            "big",
            &fill(&path, size_mib + 200),
            60.0,
        )
        .await;
        let size: u64 = field(&big.output, "size").unwrap().parse().unwrap();
        assert!(
            size + 16 * MIB >= size_mib * MIB,
            "[strict] {dir} filled at {size} bytes, well before its {size_mib} MiB: {}",
            big.output
        );
        assert!(
            size <= size_mib * MIB,
            "[strict] wrote {size} bytes into a {size_mib} MiB {dir}: {}",
            big.output
        );
        assert!(
            big.output.contains("No space left on device"),
            "[strict] {dir}: {}",
            big.output
        );
        assert!(
            !std::path::Path::new(&path).exists(),
            "[strict] host {path}"
        );
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn file_size_limit_stops_a_big_workspace_write() {
    let _heavy = HEAVY.lock().await;
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    for profile in [STRICT, LANDLOCK] {
        let name = format!("big-{}", marker());
        let host_path = daemon.workspace.join(&name);
        // Control: 16 MiB is written and seen on the host.
        let ok = run_in(&mut client, profile, "small", &fill(&name, 16)).await;
        assert_eq!(
            std::fs::metadata(&host_path).map(|m| m.len()).ok(),
            Some(16 * MIB),
            "[{profile}] control: {}",
            ok.output
        );
        // First try to lift the limit: a soft-only limit is no limit.
        let big = run_streamed(
            &mut client,
            profile,
            "big",
            &format!("ulimit -f unlimited; ulimit -Hf; {}", fill(&name, 1100)),
            90.0,
        )
        .await;
        let on_host = std::fs::metadata(&host_path).map_or(0, |m| m.len());
        assert!(
            on_host >= 1000 * MIB,
            "[{profile}] stopped at {on_host} bytes, well before the 1024 MiB limit: {}",
            big.output
        );
        assert!(
            on_host <= 1024 * MIB,
            "[{profile}] a {on_host}-byte file passed the 1024 MiB file size limit: {}",
            big.output
        );
        assert!(
            big.output.contains("File size limit exceeded")
                || big.output.contains("File too large"),
            "[{profile}] SIGXFSZ or EFBIG: {}",
            big.output
        );
        let _ = std::fs::remove_file(&host_path);
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn descriptor_exhaustion_stops_at_the_open_files_limit() {
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let daemon_fds = fd_count(daemon.pid() as i32);
    let probe = python(
        r#"
import resource
fds = []; err = 0
try:
    while len(fds) < 200000:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e:
    err = e.errno
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard * 4, hard * 4))
    raised = 1
except (OSError, ValueError):
    raised = 0
print(f"opened={len(fds)} errno={err} hard={hard} raised={raised}")
"#,
    );
    for (profile, limit) in [(STRICT, 1024usize), (LANDLOCK, 1024), (TASK, 4096)] {
        let out = run_in(&mut client, profile, "fds", &probe).await.output;
        let opened: usize = field(&out, "opened").unwrap().parse().unwrap();
        // Control: well over a hundred descriptors are fine.
        assert!(opened > 100, "[{profile}] control: {out}");
        assert!(opened < limit, "[{profile}] opened {opened}: {out}");
        assert_eq!(
            field(&out, "errno"),
            Some("24"),
            "[{profile}] EMFILE: {out}"
        );
        assert_eq!(
            field(&out, "hard"),
            Some(limit.to_string().as_str()),
            "[{profile}] hard limit: {out}"
        );
        assert_eq!(
            field(&out, "raised"),
            Some("0"),
            "[{profile}] raised its hard limit: {out}"
        );
    }
    // The daemon's own table is untouched.
    assert!(
        fd_count(daemon.pid() as i32) <= daemon_fds + 8,
        "daemon fds grew from {daemon_fds} to {}",
        fd_count(daemon.pid() as i32)
    );
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn endless_output_is_capped_at_the_deadline_and_other_clients_stay_responsive() {
    let _heavy = HEAVY.lock().await;
    let Some(daemon) = daemon() else {
        return;
    };
    let pid = daemon.pid();
    let mut warm = daemon.connect().await;
    warm.run("warm", "head -c 4000000 /dev/zero").await;
    let before = rss_kib(pid);
    for profile in ALL_PROFILES {
        let mut flooder = daemon.connect().await;
        let mut bystander = daemon.connect().await;
        let started = Instant::now();
        // The flood lasts long enough (8 s) that a bystander held until its end could not pass
        // for a prompt one even on a busy machine, where a prompt answer can take seconds.
        let flood =
            async { run_with_timeout(&mut flooder, profile, "flood", "yes flood-line", 8.0).await };
        let probe = async {
            // Another client's command during the flood answers quickly.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let t = Instant::now();
            let r = run_in(&mut bystander, profile, "bystander", "echo ping").await;
            (r, t.elapsed())
        };
        let (result, (ping, ping_took)) = tokio::join!(flood, probe);
        assert!(result.extra.timed_out, "[{profile}] {:?}", result.extra);
        assert!(
            started.elapsed() < Duration::from_secs(8) + executor_tests::PROMPTLY,
            "[{profile}] result {:?} after start, timeout 8 s",
            started.elapsed()
        );
        assert!(result.extra.truncated, "[{profile}]");
        assert!(
            result.output.len() as u64 <= 2 * warm.hello.limits.max_output_bytes as u64,
            "[{profile}] kept {} bytes",
            result.output.len()
        );
        assert!(
            result.extra.output_bytes > 10 * MIB,
            "[{profile}] control: the flood really flowed ({} bytes)",
            result.extra.output_bytes
        );
        assert_eq!(ping.output, "ping\n", "[{profile}]");
        assert!(
            ping_took < Duration::from_secs(7),
            "[{profile}] bystander took {ping_took:?} (the flood ends 7.5 s after it began)"
        );
    }
    let growth = peak_rss_kib(pid).saturating_sub(before);
    assert!(
        growth < 16 * 1024,
        "daemon grew by {growth} KiB over the floods"
    );
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn commands_waiting_on_stdin_or_a_terminal_return_at_once() {
    let Some(daemon) = daemon() else {
        return;
    };
    let probe = format!(
        "cat; read x; echo read=$?; {PY} -c 'import sys; print(\"py=%d\" % len(sys.stdin.read()))'; \
         cat /dev/tty 2>/dev/null; echo tty=$?; cat <<< control-line"
    );
    each_profile_at_once(&daemon, &ALL_PROFILES, async |client, profile| {
        let started = Instant::now();
        let r = run_with_timeout(client, profile, "stdin", &probe, 15.0).await;
        assert!(
            // Below the 15 s timeout: not held until it.
            started.elapsed() < Duration::from_secs(14),
            "[{profile}] stdin readers hung for {:?}",
            started.elapsed()
        );
        assert!(!r.extra.timed_out, "[{profile}]");
        assert!(r.output.contains("read=1"), "[{profile}] {}", r.output);
        assert!(r.output.contains("py=0"), "[{profile}] {}", r.output);
        assert!(!r.output.contains("tty=0"), "[{profile}] {}", r.output);
        // Control: the same reader consumes input when there is some.
        assert!(
            r.output.contains("control-line"),
            "[{profile}] {}",
            r.output
        );
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn sixteen_concurrent_floods_on_one_connection_leave_other_clients_responsive() {
    // A connection's full allowance of commands, all flooding output at once: the daemon's
    // per-connection buffers stay bounded and another client is still served promptly.
    let _heavy = HEAVY.lock().await;
    let Some(daemon) = daemon() else {
        return;
    };
    let pid = daemon.pid();
    let mut flooder = daemon.connect().await;
    let mut bystander = daemon.connect().await;
    let n = flooder.hello.limits.max_commands_per_connection.min(16);
    let before = rss_kib(pid);
    for profile in [STRICT, LANDLOCK] {
        for i in 0..n {
            let r = preq(
                profile,
                &format!("{profile}-flood-{i}"),
                "yes flood-line",
                // Long enough that a bystander held until the floods end (7.5 s after it
                // asks) cannot pass for a prompt one, even on a busy machine.
                8.0,
            );
            flooder.send(&protocol::ClientMessage::Exec(r)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let t = Instant::now();
        let ping = run_in(&mut bystander, profile, "bystander", "echo ping").await;
        let took = t.elapsed();
        assert_eq!(ping.output, "ping\n", "[{profile}]");
        assert!(
            took < Duration::from_secs(7),
            "[{profile}] bystander took {took:?} (the floods end 7.5 s after it began)"
        );
        // Results arrive in any order: gather them all by id.
        let mut results = std::collections::BTreeMap::new();
        while results.len() < n {
            match flooder.recv_within(executor_tests::PATIENCE).await {
                Ok(Some(protocol::ServerMessage::Result(r))) => {
                    results.insert(r.id.clone(), r);
                }
                Ok(Some(protocol::ServerMessage::Error(e))) => panic!("[{profile}] {e:?}"),
                Ok(Some(_)) => {}
                other => panic!(
                    "[{profile}] {} of {n} results, then {other:?}",
                    results.len()
                ),
            }
        }
        for (id, result) in &results {
            assert!(
                result.extra.timed_out,
                "[{profile}] {id}: {:?}",
                result.extra
            );
            assert!(
                result.extra.output_bytes > MIB,
                "[{profile}] control: {id} flowed ({} bytes)",
                result.extra.output_bytes
            );
        }
    }
    let growth = peak_rss_kib(pid).saturating_sub(before);
    assert!(
        growth < 64 * 1024,
        "daemon grew by {growth} KiB for {n} concurrent floods"
    );
    assert_daemon_intact(&daemon).await;
}
