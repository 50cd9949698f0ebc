//! A dropped connection to the executor: the agent resumes its session when the executor keeps
//! it (`--resume-grace`), so the command in flight finishes as if nothing happened; without a
//! grace period the model learns the command was cut short. The connection goes through a TCP
//! proxy that the test cuts, as a network failure would (no WebSocket close frame).

use std::time::Duration;

use executor_tests::{
    eventually, marked_sleep, marker, processes_matching, Daemon, Proxy, PATIENCE,
};
use serde_json::Value;

use crate::{assert_ended, started, Run, Scratch};

/// A daemon that keeps a dropped session `grace` seconds, a proxy in front of it that the test
/// cuts, and an agent connected through the proxy with a two-turn script: `first`, then a
/// submission. Returned once the command holding `needle` is up on the host.
async fn agent_through_proxy(
    grace: &str,
    first: &str,
    needle: &str,
    extra: &[&str],
) -> (Daemon, Proxy, Scratch, tokio::process::Child) {
    let daemon = Daemon::start_with(&["--resume-grace", grace]);
    let proxy = Proxy::start(daemon.addr).await;
    let s = Scratch::new();
    let token = daemon.state.path().join("token");
    let url = proxy.url();
    let mut args = vec!["--executor", &url, "--token-file", token.to_str().unwrap()];
    args.extend_from_slice(extra);
    let child = s
        .scripted(
            &format!(
                "- command: {first}\n- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo submitted\n"
            ),
            &args,
        )
        .spawn()
        .unwrap();
    assert!(
        started(needle).await,
        "the command with {needle} never started"
    );
    (daemon, proxy, s, child)
}

/// The audit records of commands containing `needle`, once there are `n` of them.
async fn audit_records(daemon: &Daemon, needle: &str, n: usize) -> Vec<Value> {
    let matching = || {
        daemon
            .audit()
            .into_iter()
            .filter(|r| r["command"].as_str().is_some_and(|c| c.contains(needle)))
            .collect::<Vec<_>>()
    };
    eventually(PATIENCE, || matching().len() >= n).await;
    matching()
}

/// The daemon's log without the terminal colours its text format writes.
fn plain_log(daemon: &Daemon) -> String {
    let log = daemon.log();
    let mut plain = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI sequence: ESC [ parameters, ended by a letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    plain
}

/// The first observation the model got, as the trajectory stores it.
fn first_observation(run: &Run) -> (String, Value) {
    let tool = run.with_role("tool")[0];
    (
        tool["content"].as_str().unwrap().to_string(),
        tool["extra"].clone(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_survives_a_cut_connection_when_the_executor_keeps_the_session() {
    let marker = format!("survived-{}", marker());
    let (daemon, proxy, s, child) =
        agent_through_proxy("30", &format!("sleep 2; echo {marker}"), &marker, &[]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(proxy.cut(), 1, "the agent's connection was not live");
    let run = s.finish(child).await;

    assert_ended(&run, 0, "Submitted");
    assert_eq!(run.traj["info"]["submission"], "submitted\n");
    // The model saw the command's whole output and its real return code.
    let (content, extra) = first_observation(&run);
    assert!(content.contains(&marker), "{content}");
    assert!(content.contains("\"returncode\": 0"), "{content}");
    assert_eq!(extra["returncode"], 0);
    assert_eq!(extra["raw_output"], format!("{marker}\n"));
    assert_eq!(extra["executor"]["ended"], "exited");
    // It ran once, to its end, and the session went on: the next command ran in it too.
    let records = audit_records(&daemon, &marker, 1).await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0]["ended"], "exited", "{records:?}");
    assert_eq!(records[0]["returncode"], 0, "{records:?}");
    let next = audit_records(&daemon, "echo submitted", 1).await;
    assert_eq!(next.len(), 1, "{next:?}");
    assert_eq!(next[0]["session"], records[0]["session"], "{next:?}");
    assert_ne!(next[0]["connection"], records[0]["connection"], "{next:?}");
    // Both sides say what happened; the agent reconnected through the proxy.
    assert!(proxy.accepted() >= 2);
    assert!(
        run.stderr.contains("resumed session"),
        "agent stderr: {}",
        run.stderr
    );
    let log = plain_log(&daemon);
    assert!(log.contains("session resumed"), "daemon log: {log}");
    assert!(
        log.contains("connection dropped; session kept for a resume"),
        "daemon log: {log}"
    );
    // The agent ended with a close frame, which ends the session (not kept for a resume).
    assert!(
        eventually(PATIENCE, || plain_log(&daemon).contains("ending=Closed")).await,
        "daemon log: {}",
        plain_log(&daemon)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_grace_period_a_cut_connection_kills_the_command_and_the_model_is_told() {
    let marker = format!("survived-{}", marker());
    let (daemon, proxy, s, child) =
        agent_through_proxy("0", &format!("sleep 2; echo {marker}"), &marker, &[]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(proxy.cut(), 1, "the agent's connection was not live");
    let run = s.finish(child).await;

    assert_ended(&run, 0, "Submitted");
    let (content, extra) = first_observation(&run);
    assert!(
        content.contains("connection to the executor was lost"),
        "{content}"
    );
    assert!(content.contains("\"returncode\": -1"), "{content}");
    assert_eq!(extra["raw_output"], "");
    let records = audit_records(&daemon, &marker, 1).await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0]["ended"], "disconnected", "{records:?}");
    assert!(
        processes_matching(&marker).is_empty(),
        "the command survived"
    );
    assert!(run.stderr.contains("reconnected"), "{}", run.stderr);
    assert!(!run.stderr.contains("resumed session"), "{}", run.stderr);
    assert!(!plain_log(&daemon).contains("session resumed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_longer_than_the_reconnect_attempts_but_within_the_grace_is_bridged() {
    let marker = format!("survived-{}", marker());
    // One reconnect attempt alone would give up at once; the grace period keeps it trying.
    let (daemon, proxy, s, child) = agent_through_proxy(
        "30",
        &format!("sleep 1; echo {marker}"),
        &marker,
        &["-c", "environment.reconnect_attempts=1"],
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.refuse(true);
    assert_eq!(proxy.cut(), 1, "the agent's connection was not live");
    // The command finishes while nobody is connected: its result waits in the session.
    let records = audit_records(&daemon, &marker, 1).await;
    assert_eq!(records[0]["ended"], "exited", "{records:?}");
    assert!(
        eventually(PATIENCE, || proxy.accepted() >= 3).await,
        "the agent stopped trying"
    );
    proxy.refuse(false);
    let run = s.finish(child).await;

    assert_ended(&run, 0, "Submitted");
    let (content, extra) = first_observation(&run);
    assert!(content.contains(&marker), "{content}");
    assert_eq!(extra["returncode"], 0);
    let records = audit_records(&daemon, &marker, 1).await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert!(run.stderr.contains("resumed session"), "{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silently_dead_connection_is_given_up_at_the_deadline_and_the_result_replayed() {
    // The wait is the command's timeout plus the agent's 30 s of slack: the grace outlasts it.
    let marker = format!("survived-{}", marker());
    let (daemon, proxy, s, child) = agent_through_proxy(
        "120",
        &format!("sleep 1; echo {marker}"),
        &marker,
        &["--timeout", "3"],
    )
    .await;
    assert_eq!(proxy.stall(), 1, "the agent's connection was not live");
    // The result is written into the stalled connection, and never arrives through it.
    let records = audit_records(&daemon, &marker, 1).await;
    assert_eq!(
        records[0]["ended"],
        "exited",
        "{records:?}\n{}",
        plain_log(&daemon)
    );
    let run = s.finish(child).await;

    assert_ended(&run, 0, "Submitted");
    let (content, extra) = first_observation(&run);
    assert!(content.contains(&marker), "{content}");
    assert_eq!(extra["returncode"], 0);
    assert_eq!(audit_records(&daemon, &marker, 1).await.len(), 1);
    assert!(run.stderr.contains("resumed session"), "{}", run.stderr);
    // The executor never saw the old connection end: the resume took the session from it.
    let log = plain_log(&daemon);
    assert!(
        log.contains("session taken over by a new connection"),
        "daemon log: {log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deliberate_end_kills_the_running_command_at_once_despite_a_grace_period() {
    let marker = marker();
    let (daemon, _proxy, s, child) = agent_through_proxy(
        "30",
        &marked_sleep(&marker),
        &marker,
        &["-c", "agent.wall_time_limit=2"],
    )
    .await;
    let run = s.finish(child).await;
    assert_ended(&run, 4, "TimeExceeded");
    // Killed because the agent closed the connection, not 30 s later when the grace ends.
    assert!(
        eventually(executor_tests::PATIENCE, || processes_matching(&marker)
            .is_empty())
        .await,
        "the command outlived the agent"
    );
    let records = audit_records(&daemon, &marker, 1).await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0]["ended"], "disconnected", "{records:?}");
    // The daemon's log is written by a thread of its own: wait for the line, not the race.
    assert!(
        eventually(PATIENCE, || plain_log(&daemon).contains("ending=Closed")).await,
        "{}",
        plain_log(&daemon)
    );
    assert!(!plain_log(&daemon).contains("session kept for a resume"));
}
