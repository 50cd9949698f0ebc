//! Nothing outlives its command: timeout, cancel, disconnect and background jobs, checked with
//! the host's process table.

use std::time::{Duration, Instant};

use executor_tests::{
    eventually, marked_sleep, marker, process_state, processes_matching, req, sleepers, Daemon,
    PATIENCE,
};
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
        took < Duration::from_secs(4),
        "result came {took:?} after a 1 s timeout"
    );
    assert!(result.extra.killed_processes >= 7, "{:?}", result.extra);
    // On the host: not one of the sleeps survived.
    assert!(
        eventually(Duration::from_secs(2), || processes_matching(&m).is_empty()).await,
        "survivors: {:?}",
        processes_matching(&m)
    );
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
    assert!(eventually(PATIENCE, || sleepers(&m).len() == 7).await);
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
    assert!(
        eventually(Duration::from_secs(2), || processes_matching(&m).is_empty()).await,
        "cancel left survivors: {:?}",
        processes_matching(&m)
    );
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
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(result.output, "shell done\n");
    assert_eq!(result.returncode, 0);
    assert_eq!(result.extra.ended, Ending::Exited);
    assert_eq!(result.extra.killed_processes, 1);
    assert!(eventually(Duration::from_secs(2), || processes_matching(&m).is_empty()).await);
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
        assert!(eventually(PATIENCE, || sleepers(&m).len() == 2).await);
        // Dropped without a close frame: the TCP connection just goes away.
    }
    assert!(
        eventually(Duration::from_secs(5), || processes_matching(&m).is_empty()).await,
        "survivors: {:?}",
        processes_matching(&m)
    );
    assert!(
        eventually(Duration::from_secs(5), || {
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
