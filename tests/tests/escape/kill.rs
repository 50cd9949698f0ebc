//! Escaping the kill: setsid, double fork, nohup, stopped and signal-ignoring tasks, under every
//! profile. The control in each case: while the command runs, every escapee exists on the host,
//! so "none left" afterwards is a real observation.

use std::time::{Duration, Instant};

use executor_tests::{eventually, marked_sleep, marker, process_state, sleepers, Client, PATIENCE};
use nix::sys::signal::Signal;
use protocol::{ClientMessage, Ending, RETURNCODE_NOT_FINISHED};

use crate::common::*;

/// Seven ways out of a process-group kill; prints `started` once all are launched.
fn escaping_tree(m: &str) -> String {
    let s = marked_sleep(m);
    format!(
        "{s} &\n\
         setsid {s} &\n\
         ( ( {s} & ) & )\n\
         nohup {s} >/dev/null 2>&1 &\n\
         ( trap '' TERM HUP INT; {s} ) &\n\
         ( {s} & sleep 0.1; kill -STOP $! ) &\n\
         sleep 0.3; echo started; {s}"
    )
}

/// Host-side control: all seven sleeps of the tree run, one of them stopped.
async fn tree_is_running(profile: &str, m: &str) {
    assert!(
        eventually(PATIENCE, || sleepers(m).len() == 7).await,
        "[{profile}] control: expected 7 escapees on the host, saw {:?}",
        sleepers(m)
    );
    assert!(
        eventually(PATIENCE, || sleepers(m)
            .iter()
            .any(|p| process_state(*p) == Some('T')))
        .await,
        "[{profile}] control: one escapee is stopped"
    );
}

/// Start [`escaping_tree`] under `profile` and wait until the host sees it whole (the control);
/// returns the request id.
async fn start_escaping_tree(client: &mut Client, profile: &str, m: &str, timeout: f64) -> String {
    let (id, _) = start_until(
        client,
        profile,
        "tree",
        &escaping_tree(m),
        "started",
        timeout,
    )
    .await;
    tree_is_running(profile, m).await;
    id
}

#[tokio::test]
async fn timeout_kills_setsid_double_forked_nohup_stopped_and_signal_ignoring_tasks() {
    let Some(daemon) = daemon() else {
        return;
    };
    each_profile_at_once(&daemon, &ALL_PROFILES, async |client, profile| {
        let m = marker();
        let started = Instant::now();
        let id = start_escaping_tree(client, profile, &m, 4.0).await;
        let result = client.collect(&id).await.result.unwrap();
        assert_eq!(result.extra.ended, Ending::TimedOut, "[{profile}]");
        assert_eq!(result.returncode, RETURNCODE_NOT_FINISHED, "[{profile}]");
        assert!(
            started.elapsed() < Duration::from_secs(4) + executor_tests::PROMPTLY,
            "[{profile}] result {:?} after start with a 4 s timeout",
            started.elapsed()
        );
        assert_none_left(&m, &format!("[{profile}] after timeout")).await;
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn cancel_kills_the_whole_escaping_tree() {
    let Some(daemon) = daemon() else {
        return;
    };
    each_profile_at_once(&daemon, &ALL_PROFILES, async |client, profile| {
        let m = marker();
        let id = start_escaping_tree(client, profile, &m, 120.0).await;
        let result = cancel(client, &id).await;
        assert_eq!(result.extra.ended, Ending::Cancelled, "[{profile}]");
        assert_none_left(&m, &format!("[{profile}] after cancel")).await;
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn disconnect_kills_the_whole_escaping_tree() {
    let Some(daemon) = daemon() else {
        return;
    };
    at_once(&ALL_PROFILES, async |profile| {
        let m = marker();
        {
            let mut client = daemon.connect().await;
            start_escaping_tree(&mut client, profile, &m, 120.0).await;
            // Dropped without a close frame.
        }
        assert_none_left(&m, &format!("[{profile}] after disconnect")).await;
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn shell_exit_kills_what_it_left_running() {
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    for profile in ALL_PROFILES {
        let m = marker();
        let s = marked_sleep(&m);
        let started = Instant::now();
        let result = run_in(
            &mut client,
            profile,
            "left",
            &format!("{s} & setsid {s} & ( {s} & ) ; sleep 0.3; echo shell done"),
        )
        .await;
        assert_eq!(result.output, "shell done\n", "[{profile}] {result:?}");
        assert_eq!(result.returncode, 0, "[{profile}]");
        assert!(
            result.extra.killed_processes >= 3,
            "[{profile}] {:?}",
            result.extra
        );
        assert!(
            started.elapsed() < executor_tests::PROMPTLY,
            "[{profile}] {:?}",
            started.elapsed()
        );
        assert_none_left(&m, &format!("[{profile}] after the shell exited")).await;
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn daemon_sigkill_takes_every_sandboxed_tree_with_it() {
    let Some(mut daemon) = daemon() else {
        return;
    };
    let mut client = daemon.connect().await;
    let m = marker();
    for profile in [STRICT, LANDLOCK, TASK] {
        // A command first, so a warm worker waits for the next of this profile: of the two
        // trees below, the first is served by a sandbox built ahead, the second (most likely)
        // by one built when it comes. Both kinds must die with the daemon.
        let warm_up = run_in(&mut client, profile, "warm-up", "echo up").await;
        assert_eq!(warm_up.output, "up\n", "[{profile}] {warm_up:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
        for n in 0..2 {
            let mut r = preq(
                profile,
                &format!("k{n}-{profile}"),
                &escaping_tree(&m),
                600.0,
            );
            r.stream = true;
            client.send(&ClientMessage::Exec(r)).await;
        }
    }
    // Control: all 3 x 2 x 7 escapees run while the daemon lives.
    assert!(
        eventually(PATIENCE, || sleepers(&m).len() == 42).await,
        "expected 42 escapees, saw {:?}",
        sleepers(&m).len()
    );
    daemon.signal_and_wait(Signal::SIGKILL);
    assert_none_left(&m, "[all] after daemon SIGKILL").await;
}

/// A shell that keeps forking new orphans (throttled, so an escape stays survivable) while the
/// kill is in progress: a single sweep over the process list always misses the newest ones.
pub(crate) fn racing_forker(m: &str) -> String {
    let s = marked_sleep(m);
    format!(
        "( while :; do ( {s} & ) ; sleep 0.01; done ) &\n\
         sleep 0.5; echo started; {s}"
    )
}

/// Start [`racing_forker`] under `profile`, see orphans keep appearing on the host (the
/// control), cancel it, and give a surviving forker time to show itself.
pub(crate) async fn start_and_cancel_a_racing_forker(client: &mut Client, profile: &str, m: &str) {
    let (id, _) = start_until(
        client,
        profile,
        "racer",
        &racing_forker(m),
        "started",
        120.0,
    )
    .await;
    assert!(
        eventually(PATIENCE, || sleepers(m).len() > 20).await,
        "[{profile}] control: the forker runs"
    );
    cancel(client, &id).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
}

#[tokio::test]
async fn cancel_kills_a_tree_that_keeps_forking_orphans() {
    let Some(daemon) = daemon() else {
        return;
    };
    each_profile_at_once(&daemon, &ALL_PROFILES, async |client, profile| {
        let m = marker();
        let _reaper = Reaper(m.clone());
        start_and_cancel_a_racing_forker(client, profile, &m).await;
        assert_none_left(&m, &format!("[{profile}] after cancelling a racing forker")).await;
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn a_shell_that_stops_itself_is_still_killed_at_its_timeout() {
    // SIGSTOP on the shell itself (and a stopped child): nothing reads the pipe, nothing exits,
    // and only the daemon's clock can end the command.
    let Some(daemon) = daemon() else {
        return;
    };
    each_profile_at_once(&daemon, &ALL_PROFILES, async |client, profile| {
        let m = marker();
        let started = Instant::now();
        let result = run_with_timeout(
            client,
            profile,
            "stopped",
            &format!(
                "{} & echo before; kill -STOP $$; echo after",
                marked_sleep(&m)
            ),
            2.0,
        )
        .await;
        assert_eq!(
            result.extra.ended,
            Ending::TimedOut,
            "[{profile}] {result:?}"
        );
        assert_eq!(result.output, "before\n", "[{profile}]");
        assert!(
            started.elapsed() < Duration::from_secs(2) + executor_tests::PROMPTLY,
            "[{profile}] {:?}",
            started.elapsed()
        );
        assert_none_left(
            &m,
            &format!("[{profile}] after a self-stopped shell's timeout"),
        )
        .await;
    })
    .await;
    assert_daemon_intact(&daemon).await;
}
