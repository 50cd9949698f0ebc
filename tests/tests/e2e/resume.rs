//! Sessions that outlive a dropped connection for a grace period, and `resume`.

use std::time::Duration;

use executor_tests::host_waits::{sleepers_gone, sleepers_up};
use executor_tests::{eventually, marked_sleep, marker, req, sleepers, Client, Daemon, PATIENCE};
use protocol::{ClientMessage, ErrorCode, ResumeRequest, ServerMessage};

/// Drop the connection the way a network failure does: no close frame.
fn cut(client: Client) {
    drop(client);
}

/// Send `resume` for `session`, awaiting `awaiting`, and return the answer.
async fn ask_resume(
    client: &mut Client,
    session: &str,
    awaiting: &[&str],
) -> Option<ServerMessage> {
    client
        .send(&ClientMessage::Resume(ResumeRequest {
            session: session.to_string(),
            awaiting: awaiting.iter().map(|s| s.to_string()).collect(),
        }))
        .await;
    client.recv().await
}

/// Resume `session` on a new connection, awaiting `awaiting`; returns the connection and the
/// ids still running.
async fn resume(daemon: &Daemon, session: &str, awaiting: &[&str]) -> (Client, Vec<String>) {
    let mut client = daemon.connect().await;
    assert_ne!(
        client.hello.session, session,
        "a new connection gets a new session first"
    );
    match ask_resume(&mut client, session, awaiting).await {
        Some(ServerMessage::Resumed(r)) => {
            assert_eq!(r.session, session);
            (client, r.running)
        }
        other => panic!("expected resumed, got {other:?}"),
    }
}

/// Send `id` running `command` (timeout 60 s) without waiting for its result, and wait until
/// `n` sleeps marked `m` are up on the host.
async fn start_sleeping(client: &mut Client, id: &str, command: &str, m: &str, n: usize) {
    let mut r = req(id, command);
    r.timeout = Some(60.0);
    client.send(&ClientMessage::Exec(r)).await;
    assert!(sleepers_up(m, n).await, "{id}: {n} sleeps never came up");
}

/// Every message that arrives within `wait`.
async fn drain(client: &mut Client, wait: Duration) -> Vec<ServerMessage> {
    let mut all = Vec::new();
    while let Ok(Some(msg)) = client.recv_within(wait).await {
        all.push(msg);
    }
    all
}

#[tokio::test]
async fn a_dropped_connection_is_resumed_and_the_result_arrives_exactly_once() {
    let daemon = Daemon::start_with(&["--resume-grace", "30"]);
    let mut client = daemon.connect().await;
    assert_eq!(client.hello.resume_grace, 30.0);
    let session = client.hello.session.clone();
    let m = marker();
    let mut r = req(
        "long",
        &format!(
            "echo before; {} & wait_for=$!; sleep 1.5; echo after; kill $wait_for",
            marked_sleep(&m)
        ),
    );
    r.stream = true;
    r.timeout = Some(30.0);
    client.send(&ClientMessage::Exec(r)).await;
    match client.recv().await {
        Some(ServerMessage::Output(chunk)) => assert_eq!(chunk.data, "before\n"),
        other => panic!("{other:?}"),
    }
    cut(client);
    // Within the grace period the command goes on: its child is alive on the host.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        sleepers(&m).len(),
        1,
        "the command died with its connection"
    );

    let (mut client, running) = resume(&daemon, &session, &["long"]).await;
    assert_eq!(running, vec!["long".to_string()]);
    let received = client.collect("long").await;
    let result = received.result.unwrap();
    assert_eq!(result.output, "before\nafter\n");
    assert_eq!(result.extra.ended, protocol::Ending::Exited);
    assert!(
        received.chunks.iter().any(|c| c.data.contains("after")),
        "the output missed meanwhile is sent: {:?}",
        received.chunks
    );
    // Exactly once: nothing more for it, and one audit record.
    let rest = drain(&mut client, Duration::from_secs(1)).await;
    assert!(
        !rest.iter().any(|m| matches!(m, ServerMessage::Result(_))),
        "{rest:?}"
    );
    assert!(eventually(executor_tests::PATIENCE, || daemon.audit().len() == 1).await);
    assert_eq!(daemon.audit()[0]["ended"], "exited");
    assert_eq!(daemon.audit()[0]["session"], session.as_str());
    // The session goes on: a new command on it works, under the same session id.
    assert_eq!(client.run("next", "echo on").await.output, "on\n");
    assert!(sleepers(&m).is_empty());
}

#[tokio::test]
async fn results_that_finished_while_detached_are_replayed_in_order() {
    let daemon = Daemon::start_with(&["--resume-grace", "30"]);
    let mut client = daemon.connect().await;
    let session = client.hello.session.clone();
    for (id, secs) in [("a", "0.2"), ("b", "0.4")] {
        let mut r = req(id, &format!("sleep {secs}; echo {id}"));
        r.timeout = Some(30.0);
        client.send(&ClientMessage::Exec(r)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    cut(client);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let (mut client, running) = resume(&daemon, &session, &["a", "b"]).await;
    assert!(running.is_empty(), "{running:?}");
    let results: Vec<String> = drain(&mut client, Duration::from_millis(500))
        .await
        .into_iter()
        .filter_map(|m| match m {
            ServerMessage::Result(r) => Some(r.output),
            _ => None,
        })
        .collect();
    assert_eq!(results, ["a\n", "b\n"]);
}

#[tokio::test]
async fn after_the_grace_period_the_tree_is_killed_and_the_session_is_gone() {
    let daemon = Daemon::start_with(&["--resume-grace", "1"]);
    let mut client = daemon.connect().await;
    let session = client.hello.session.clone();
    let m = marker();
    // A tree that a plain kill of the shell would miss.
    let tree = format!("setsid {s} & ( {s} & ) ; {s}", s = marked_sleep(&m));
    start_sleeping(&mut client, "tree", &tree, &m, 3).await;
    cut(client);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        sleepers(&m).len(),
        3,
        "killed before the grace period ended"
    );
    assert!(
        sleepers_gone(&m).await,
        "the tree outlived the grace period"
    );
    assert!(eventually(executor_tests::PATIENCE, || daemon.audit().len() == 1).await);
    assert_eq!(daemon.audit()[0]["ended"], "disconnected");
    // Too late to resume: not found, and the connection stays usable.
    let mut client = daemon.connect().await;
    match ask_resume(&mut client, &session, &["tree"]).await {
        Some(ServerMessage::Error(e)) => {
            assert_eq!(e.code, ErrorCode::NotFound);
            assert!(e.message.contains("grace period"), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(client.run("x", "echo fine").await.output, "fine\n");
}

#[tokio::test]
async fn a_close_frame_ends_the_session_at_once_even_with_a_grace_period() {
    let daemon = Daemon::start_with(&["--resume-grace", "30"]);
    let mut client = daemon.connect().await;
    let session = client.hello.session.clone();
    let m = marker();
    start_sleeping(&mut client, "s", &marked_sleep(&m), &m, 1).await;
    client.ws.close(None).await.unwrap();
    assert!(
        sleepers_gone(&m).await,
        "a deliberate close kept the command"
    );
    let mut again = daemon.connect().await;
    assert!(
        matches!(ask_resume(&mut again, &session, &[]).await, Some(ServerMessage::Error(e)) if e.code == ErrorCode::NotFound)
    );
}

#[tokio::test]
async fn without_a_grace_period_a_drop_kills_at_once_and_resume_must_come_first() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    assert_eq!(client.hello.resume_grace, 0.0);
    let session = client.hello.session.clone();
    let m = marker();
    start_sleeping(&mut client, "s", &marked_sleep(&m), &m, 1).await;
    cut(client);
    assert!(sleepers_gone(&m).await);
    // resume is only valid as a connection's first message.
    let mut client = daemon.connect().await;
    client.run("first", "true").await;
    match ask_resume(&mut client, &session, &[]).await {
        Some(ServerMessage::Error(e)) => {
            assert_eq!(e.code, ErrorCode::BadRequest);
            assert!(e.message.contains("first message"), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_client_that_keeps_dropping_connections_keeps_at_most_32_sessions_for_a_resume() {
    let daemon = Daemon::start_with(&["--resume-grace", "120"]);
    let m = marker();
    let mut sessions = Vec::new();
    for i in 0..34 {
        let mut client = daemon.connect().await;
        sessions.push(client.hello.session.clone());
        let mut r = req("job", &marked_sleep(&m));
        r.timeout = Some(120.0);
        client.send(&ClientMessage::Exec(r)).await;
        // Earlier sessions past the 32 kept ones have been ended already.
        let expected = i.min(32) + 1;
        assert!(
            sleepers_up(&m, expected).await,
            "command {i}: {} running",
            sleepers(&m).len()
        );
        cut(client);
        // Wait for the daemon to see the drop before the next one.
        assert!(
            eventually(PATIENCE, || daemon
                .log()
                .matches("session kept for a resume")
                .count()
                > i)
            .await
        );
    }
    // The two oldest sessions were ended, their commands killed on the host.
    assert!(
        sleepers_up(&m, 32).await,
        "{} commands left",
        sleepers(&m).len()
    );
    let mut late = daemon.connect().await;
    assert!(
        matches!(ask_resume(&mut late, &sessions[0], &["job"]).await, Some(ServerMessage::Error(e)) if e.code == ErrorCode::NotFound)
    );
    // Control: the newest is still there, its command running.
    let (_client, running) = resume(&daemon, &sessions[33], &["job"]).await;
    assert_eq!(running, vec!["job".to_string()]);
}
