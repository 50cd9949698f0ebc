//! Fork, thread and memory bombs stop at the profile's limits. The bombs are self-limited (a
//! few hundred processes past the limit, a few GB past the memory limit) so that a broken
//! limit fails the case instead of taking the shared test machine down. `trusted` has no
//! limits by design and is not bombed.

use executor_tests::{eventually, marker, sleepers, PATIENCE};

use crate::common::*;

/// First thing every bomb does: try to lift its own limits.
const RAISE: &str = r#"
import resource
for lim in ("RLIMIT_NPROC", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_FSIZE", "RLIMIT_NOFILE"):
    try:   # a limit the command can raise is no limit
        resource.setrlimit(getattr(resource, lim), (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except (OSError, ValueError):
        pass
"#;

/// Fork up to `n` children that exec a marked sleep; print how many and the errno that ended
/// the loop, then hold them until cancelled.
fn fork_probe(m: &str, n: u32) -> String {
    python(&format!(
        r#"
import time
{RAISE}n = 0; err = 0
for i in range({n}):
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        try:
            os.execvp("sleep", ["sleep", "3600.{m}"])
        finally:
            os._exit(1)
    n += 1
print(f"spawned={{n}} errno={{err}}", flush=True)
print("ready", flush=True)
time.sleep(3600)
"#
    ))
}

fn thread_probe(m: &str, n: u32) -> String {
    python_marked(
        m,
        &format!(
            r#"
{RAISE}import threading, time
threading.stack_size(64 * 1024)
n = 0; err = ""
for i in range({n}):
    try:
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    except Exception as e:
        err = type(e).__name__
        break
    n += 1
print(f"threads={{n}} error={{err or 'none'}}", flush=True)
print("ready", flush=True)
time.sleep(3600)
"#
        ),
    )
}

/// Each profile with a process limit, and the limit (landlock had none at all: one fork loop
/// made 6,000 processes).
const PROCESS_LIMITS: [(&str, usize); 3] = [(STRICT, 512), (LANDLOCK, 512), (TASK, 2048)];

/// The bomb made `n` of `what` (children, threads): fewer than `limit`, and so many that it is
/// the declared limit that stopped it, not something far smaller.
fn assert_stopped_by_the_limit(profile: &str, n: usize, what: &str, limit: usize, out: &str) {
    assert!(
        n < limit,
        "[{profile}] made {n} {what} with a limit of {limit}: {out}"
    );
    assert!(
        n >= limit / 2,
        "[{profile}] only {n} {what} under a limit of {limit}: {out}"
    );
}

#[tokio::test]
async fn fork_bomb_stops_at_the_process_limit() {
    let _heavy = HEAVY.lock().await;
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    for (profile, limit) in PROCESS_LIMITS {
        // Control: a modest fan-out works under the same profile.
        let m = marker();
        let (id, out) = start_until(
            &mut client,
            profile,
            "fan",
            &fork_probe(&m, 50),
            "ready",
            60.0,
        )
        .await;
        assert!(
            out.contains("spawned=50 errno=0"),
            "[{profile}] control: {out}"
        );
        wait_sleepers(&m, 50).await;
        cancel(&mut client, &id).await;

        let m = marker();
        let attempt = limit as u32 + 300;
        let (id, out) = start_until(
            &mut client,
            profile,
            "bomb",
            &fork_probe(&m, attempt),
            "ready",
            120.0,
        )
        .await;
        let spawned: usize = field(&out, "spawned").unwrap().parse().unwrap();
        assert_stopped_by_the_limit(profile, spawned, "children", limit, &out);
        assert_eq!(
            field(&out, "errno"),
            Some("11"),
            "[{profile}] fork failed with EAGAIN: {out}"
        );
        // Forks are visible before their exec: wait for all of them to be sleeps.
        eventually(PATIENCE, || sleepers(&m).len() >= spawned).await;
        let on_host = sleepers(&m).len();
        assert!(
            on_host <= limit && on_host == spawned,
            "[{profile}] host sees {on_host} children, the command {spawned}"
        );
        // The daemon serves other clients while the bomb holds its processes.
        assert!(daemon.healthy().await, "[{profile}]");
        cancel(&mut client, &id).await;
        assert_none_left(&m, &format!("[{profile}] after the bomb")).await;
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn thread_bomb_stops_at_the_process_limit() {
    let _heavy = HEAVY.lock().await;
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    for (profile, limit) in PROCESS_LIMITS {
        let m = marker();
        let (id, out) = start_until(
            &mut client,
            profile,
            "few",
            &thread_probe(&m, 50),
            "ready",
            60.0,
        )
        .await;
        assert!(
            out.contains("threads=50 error=none"),
            "[{profile}] control: {out}"
        );
        cancel(&mut client, &id).await;

        let m = marker();
        let attempt = limit as u32 + 300;
        let (id, out) = start_until(
            &mut client,
            profile,
            "bomb",
            &thread_probe(&m, attempt),
            "ready",
            120.0,
        )
        .await;
        let threads: usize = field(&out, "threads").unwrap().parse().unwrap();
        assert_stopped_by_the_limit(profile, threads, "threads", limit, &out);
        let pids = pids_with_prefix(&py_argv(&m));
        assert_eq!(pids.len(), 1, "[{profile}] the probe on the host: {pids:?}");
        let on_host: usize = executor_tests::proc_status(pids[0], "Threads:")
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            on_host <= limit,
            "[{profile}] host sees {on_host} threads in the probe"
        );
        cancel(&mut client, &id).await;
        assert_none_left(&m, &format!("[{profile}] after the bomb")).await;
    }
    assert_daemon_intact(&daemon).await;
}

/// Allocate and touch memory in 256 MiB steps up to `target_mib`, printing each step.
fn memory_probe(target_mib: u64) -> String {
    python(&format!(
        r#"
{RAISE}held = []; got = 0
try:
    while got < {target_mib}:
        held.append(b"\x01" * (256 << 20))
        got += 256
        print(f"allocated={{got}}", flush=True)
except MemoryError:
    print("memoryerror", flush=True)
"#
    ))
}

#[tokio::test]
async fn memory_bomb_stops_at_the_memory_limit() {
    let _heavy = HEAVY.lock().await;
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let mut table = vec![(STRICT, 2048u64), (LANDLOCK, 2048)];
    // 9 GiB past task-container's 8 GiB limit only where a broken limit cannot hurt the host.
    if mem_available_mib() > 14 * 1024 {
        table.push((TASK, 8192));
    } else {
        eprintln!("task-container memory bomb not run: the host has too little free memory");
    }
    for (profile, limit) in table {
        // Control: 512 MiB is fine.
        let ok = run_streamed(&mut client, profile, "small", &memory_probe(512), 60.0).await;
        assert!(
            ok.output.contains("allocated=512") && ok.returncode == 0,
            "[{profile}] control: {ok:?}"
        );
        let target = limit + 1024;
        let bomb = run_streamed(&mut client, profile, "bomb", &memory_probe(target), 90.0).await;
        let reached: u64 = bomb
            .output
            .lines()
            .filter_map(|l| l.strip_prefix("allocated="))
            .filter_map(|v| v.parse().ok())
            .max()
            .unwrap_or(0);
        eprintln!(
            "[{profile}] memory bomb reached {reached} MiB of {target}: {:?} rc {}",
            bomb.extra.ended, bomb.returncode
        );
        assert!(
            reached < limit,
            "[{profile}] touched {reached} MiB with a limit of {limit} MiB: {:?}",
            bomb.extra
        );
        assert!(
            !bomb.extra.timed_out,
            "[{profile}] the bomb was stopped by the limit, not the clock"
        );
        assert!(daemon.healthy().await, "[{profile}]");
    }
    assert_daemon_intact(&daemon).await;
}
