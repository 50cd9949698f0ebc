//! Nothing outlives its command: timeout, cancel, disconnect and background jobs, checked with
//! the host's process table.

use std::time::{Duration, Instant};

use executor_tests::checks::preq;
use executor_tests::host_waits::{
    assert_none_left, none_left, send_signal, sleepers_gone, sleepers_up,
};
use executor_tests::{
    eventually, marked_sleep, marker, namespace_of, process_state, req, sleepers, Client, Daemon,
    PATIENCE,
};
use nix::sys::signal::Signal;
use protocol::{CancelRequest, ClientMessage, Ending, RETURNCODE_NOT_FINISHED};

/// A command tree that tries every classic way out of a process-group kill.
fn escaping_tree(m: &str) -> String {
    let s = marked_sleep(m);
    format!(
        "{s} &                                   # plain background job\n\
         setsid {s} &                            # new session\n\
         ( ( {s} & ) & )                         # double fork, orphaned\n\
         nohup {s} >/dev/null 2>&1 &             # nohup\n\
         ( trap '' TERM HUP INT; {s} ) &         # ignores catchable signals\n\
         ( {s} & sleep 0.1; kill -STOP $! ) &    # stopped task\n\
         echo started; {s}"
    )
}

#[tokio::test]
async fn timeout_kills_setsid_double_forked_stopped_and_signal_ignoring_children() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    let mut r = req("t", &escaping_tree(&m));
    r.timeout = Some(1.0);
    let started = Instant::now();
    let result = client.exec(r).await.result.unwrap();
    let took = started.elapsed();

    assert_eq!(result.returncode, RETURNCODE_NOT_FINISHED);
    assert!(result.extra.timed_out);
    assert_eq!(result.extra.ended, Ending::TimedOut);
    assert!(
        result.exception_info.contains("timed out"),
        "{}",
        result.exception_info
    );
    assert_eq!(result.output, "started\n", "partial output is kept");
    assert!(
        took < Duration::from_secs(1) + executor_tests::PROMPTLY,
        "result came {took:?} after a 1 s timeout"
    );
    assert!(result.extra.killed_processes >= 7, "{:?}", result.extra);
    // On the host: not one of the sleeps survived.
    assert_none_left(&m, "survivors").await;
}

#[tokio::test]
async fn control_the_same_tree_really_runs_until_it_is_killed() {
    // Control for the timeout test: while the command runs, its escapees exist on the host, so
    // the check above can fail.
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    let mut r = req("t", &escaping_tree(&m));
    r.stream = true;
    client.send(&ClientMessage::Exec(r)).await;
    assert!(sleepers_up(&m, 7).await);
    assert!(
        eventually(PATIENCE, || sleepers(&m)
            .iter()
            .any(|p| process_state(*p) == Some('T')))
        .await,
        "one of them is stopped"
    );
    client
        .send(&ClientMessage::Cancel(CancelRequest { id: "t".into() }))
        .await;
    let result = client.collect("t").await.result.unwrap();
    assert!(result.extra.cancelled);
    assert_eq!(result.extra.ended, Ending::Cancelled);
    assert_eq!(result.returncode, RETURNCODE_NOT_FINISHED);
    assert_none_left(&m, "cancel left survivors").await;
}

#[tokio::test]
async fn background_job_holding_stdout_does_not_delay_the_result_and_is_killed() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    let started = Instant::now();
    let result = client
        .run("bg", &format!("{} & echo shell done", marked_sleep(&m)))
        .await;
    assert!(
        started.elapsed() < executor_tests::PROMPTLY,
        "{:?}",
        started.elapsed()
    );
    assert_eq!(result.output, "shell done\n");
    assert_eq!(result.returncode, 0);
    assert_eq!(result.extra.ended, Ending::Exited);
    assert_eq!(result.extra.killed_processes, 1);
    assert!(none_left(&m).await);
}

#[tokio::test]
async fn client_disconnect_mid_command_kills_the_tree_and_is_audited() {
    let daemon = Daemon::start();
    let m = marker();
    {
        let mut client = daemon.connect().await;
        let mut r = req("d", &format!("setsid {s} & {s}", s = marked_sleep(&m)));
        r.timeout = Some(600.0);
        client.send(&ClientMessage::Exec(r)).await;
        assert!(sleepers_up(&m, 2).await);
        // Dropped without a close frame: the TCP connection just goes away.
    }
    assert_none_left(&m, "survivors").await;
    assert!(
        eventually(executor_tests::PATIENCE, || {
            daemon
                .audit()
                .iter()
                .any(|r| r["id"] == "d" && r["ended"] == "disconnected")
        })
        .await
    );
    // The daemon lives on for the next client.
    let mut next = daemon.connect().await;
    assert_eq!(next.run("after", "echo alive").await.output, "alive\n");
}

#[tokio::test]
async fn cancel_of_an_unknown_id_is_not_found_and_the_running_command_is_untouched() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let mut r = req("slow", "sleep 0.5; echo finished");
    r.timeout = Some(30.0);
    client.send(&ClientMessage::Exec(r)).await;
    client
        .send(&ClientMessage::Cancel(CancelRequest { id: "other".into() }))
        .await;
    let err = client.collect("other").await.result.unwrap_err();
    assert_eq!(err.code, protocol::ErrorCode::NotFound);
    let result = client.collect("slow").await.result.unwrap();
    assert_eq!(result.output, "finished\n");
    assert!(!result.extra.cancelled);
}

/// Host processes in the pid namespace `ns` (as `readlink /proc/PID/ns/pid` names it).
fn in_pid_namespace(ns: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| namespace_of(pid, "pid").as_deref() == Some(ns))
        .collect()
}

#[tokio::test]
async fn a_strict_command_that_leaves_nothing_is_reported_before_its_namespace_goes_and_it_goes() {
    // Under strict the helper reports as soon as the sandbox's init has reaped the command and
    // found nothing else in its pid namespace; init's own exit, which takes the namespaces
    // down, follows the result. Checked from the host: nothing is counted as killed, and the
    // namespace empties. The control: while a command runs, its namespace holds processes on
    // the host (init and the command), so the emptiness check can fail.
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    let mut running = preq(
        Some("strict"),
        "running",
        &format!("readlink /proc/self/ns/pid; {}", marked_sleep(&m)),
        60.0,
    );
    running.stream = true;
    client.send(&ClientMessage::Exec(running)).await;
    assert!(sleepers_up(&m, 1).await);
    let ns = namespace_of(sleepers(&m)[0], "pid").unwrap();
    assert_ne!(
        namespace_of(std::process::id() as i32, "pid"),
        Some(ns.clone())
    );
    assert_eq!(in_pid_namespace(&ns).len(), 2, "init and the sleep");
    client
        .send(&ClientMessage::Cancel(CancelRequest {
            id: "running".into(),
        }))
        .await;
    let cancelled = client.collect("running").await.result.unwrap();
    assert_eq!(cancelled.extra.ended, Ending::Cancelled);
    assert!(
        eventually(executor_tests::PATIENCE, || in_pid_namespace(&ns)
            .is_empty())
        .await
    );

    let done = client
        .exec(preq(
            Some("strict"),
            "done",
            "readlink /proc/self/ns/pid",
            10.0,
        ))
        .await
        .result
        .unwrap();
    assert_eq!(done.returncode, 0, "{done:?}");
    assert_eq!(done.extra.ended, Ending::Exited);
    assert_eq!(done.extra.killed_processes, 0);
    let ns = done.output.trim().to_string();
    assert!(ns.starts_with("pid:["), "{ns}");
    assert!(
        eventually(executor_tests::PATIENCE, || in_pid_namespace(&ns)
            .is_empty())
        .await,
        "left in the command's pid namespace: {:?}",
        in_pid_namespace(&ns)
    );

    // And one that leaves a process behind is not reported early: init's count is the
    // result's, and the process is gone on the host.
    let left = client
        .exec(preq(
            Some("strict"),
            "left",
            &format!("{} & echo shell done", marked_sleep(&m)),
            10.0,
        ))
        .await
        .result
        .unwrap();
    assert_eq!(left.output, "shell done\n");
    assert_eq!(left.extra.killed_processes, 1, "{:?}", left.extra);
    assert!(none_left(&m).await);
}

/// A timed-out command's `killed_processes` is every process it had when it was stopped,
/// however they died: a shell killed in `wait` may reap a child killed beside it before its
/// own death, which a count of the processes reaped misses (the Python suite caught 4 of 5).
/// Three times per profile, since that order is a race; the host sees all six while it
/// runs (the control) and none after.
#[tokio::test]
async fn a_stopped_commands_killed_count_is_every_process_it_had() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    for profile in ["strict", "landlock"] {
        for round in 0..3 {
            let m = marker();
            let s = marked_sleep(&m);
            let tree = format!(
                "{s} & {s} & ({s} &) & setsid {s} & nohup {s} >/dev/null 2>&1 & echo started; wait"
            );
            let id = format!("{profile}-{round}");
            let mut r = preq(Some(profile), &id, &tree, 30.0);
            r.stream = true;
            client.send(&ClientMessage::Exec(r)).await;
            assert!(
                sleepers_up(&m, 5).await,
                "{profile}: the five sleeps did not start"
            );
            client
                .send(&ClientMessage::Cancel(CancelRequest { id: id.clone() }))
                .await;
            let result = client.collect(&id).await.result.unwrap();
            assert_eq!(result.extra.ended, Ending::Cancelled, "{profile}");
            // The shell and its five sleeps.
            assert_eq!(
                result.extra.killed_processes, 6,
                "{profile} round {round}: {:?}",
                result.extra
            );
            assert!(sleepers_gone(&m).await);
        }
    }
}

/// Start `id` under strict (it says "started", then sleeps marked `m`) and, once the sleep is
/// up, find its ancestors on the host: the sleep's parent is the shell, whose parent is the
/// namespace's init, whose parent is the daemon's fork server (checked: the daemon's child).
/// Returns (shell, init, fork server).
async fn strict_sleeper(
    daemon: &Daemon,
    client: &mut Client,
    id: &str,
    m: &str,
) -> (i32, i32, i32) {
    // `; true`: the shell stays (bash execs a last simple command in its own place).
    let r = preq(
        Some("strict"),
        id,
        &format!("echo started; {}; true", marked_sleep(m)),
        30.0,
    );
    client.send(&ClientMessage::Exec(r)).await;
    assert!(sleepers_up(m, 1).await, "{id}: the sleep never started");
    let shell = executor_tests::parent_of(sleepers(m)[0]).unwrap();
    let init = executor_tests::parent_of(shell).unwrap();
    let server = executor_tests::parent_of(init).unwrap();
    assert_eq!(
        executor_tests::parent_of(server),
        Some(daemon.pid() as i32),
        "sleep {} < shell {shell} < init {init} < fork server {server} < daemon",
        sleepers(m)[0]
    );
    (shell, init, server)
}

/// An init killed from outside while its command runs (as the kernel's OOM group kill does
/// where init cannot exempt itself, without CAP_SYS_RESOURCE) takes the command with it, and
/// the command still gets its result: killed by that signal, reported by the fork server,
/// not a missing report. On the host nothing of it is left.
#[tokio::test]
async fn a_command_whose_init_is_killed_ends_killed_and_is_reported() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    let (_shell, init, _server) = strict_sleeper(&daemon, &mut client, "killed-init", &m).await;
    assert!(
        executor_tests::proc_status(init, "NSpid:").is_some_and(|ns| ns.ends_with("\t1")),
        "{init} is not pid 1 of the command's pid namespace"
    );
    send_signal(init, Signal::SIGKILL);
    let result = client.collect("killed-init").await.result.unwrap();
    assert_eq!(result.extra.ended, Ending::Signaled, "{result:?}");
    assert_eq!(result.returncode, -9, "{result:?}");
    assert_eq!(result.output, "started\n");
    assert!(sleepers_gone(&m).await);
    // The daemon goes on.
    assert_eq!(client.run("after", "echo ok").await.output, "ok\n");
}

/// The fork server killed while a strict command runs takes the command's init with it
/// (PR_SET_PDEATHSIG), and so the command: the result says its sandbox died, nothing of it is
/// left on the host, and the daemon goes on, exec'ing its helpers.
#[tokio::test]
async fn a_command_whose_fork_server_dies_ends_and_is_reported() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    let (_shell, _init, server) = strict_sleeper(&daemon, &mut client, "orphaned", &m).await;
    send_signal(server, Signal::SIGKILL);
    let result = client.collect("orphaned").await.result.unwrap();
    assert_eq!(result.returncode, RETURNCODE_NOT_FINISHED, "{result:?}");
    assert!(
        result.exception_info.contains("died"),
        "{}",
        result.exception_info
    );
    assert!(sleepers_gone(&m).await);
    assert_eq!(client.run("after", "echo ok").await.output, "ok\n");
}
