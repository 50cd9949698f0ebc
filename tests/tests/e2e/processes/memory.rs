//! The memory budgets (issue 35): what the daemon keeps for clients (here: the output of
//! ended processes) stays within the daemon's budget and each client's, checked by the
//! daemon's resident memory on the host and by what reads return.

use executor_tests::{http_get, rss_kib};

use super::*;

const MIB: u64 = 1 << 20;
/// Prints exactly 1 MiB: "0123456789abcde\n" over and over, so the byte at any offset is known.
const MEBIBYTE: &str = "yes 0123456789abcde | head -c 1048576";

fn pattern(from: u64, len: usize) -> Vec<u8> {
    const LINE: &[u8] = b"0123456789abcde\n";
    (from..from + len as u64)
        .map(|p| LINE[(p % 16) as usize])
        .collect()
}

/// Spawn `count` processes printing 1 MiB on `client` and wait for each to end.
async fn print_mebibytes(client: &mut Client, prefix: &str, count: usize) {
    for i in 0..count {
        spawn(client, spawn_req(&format!("{prefix}{i}"), MEBIBYTE)).await;
    }
    for i in 0..count {
        let exited = wait(client, &format!("{prefix}{i}"), 60.0).await;
        assert_eq!(exited.returncode, 0, "{exited:?}");
    }
}

/// Everything a read from 0 returns of `id`: (bytes dropped before the first kept byte, the
/// kept bytes, checked against the pattern).
async fn read_all(client: &mut Client, id: &str) -> (u64, u64) {
    let first = read(client, id, 0, 0.0).await;
    let dropped = first.dropped;
    let mut offset = first.offset;
    let mut kept = 0;
    loop {
        let out = read(client, id, offset, 0.0).await;
        let data = unb64(&out.data);
        assert_eq!(data, pattern(out.offset, data.len()), "{id}: bytes changed");
        kept += data.len() as u64;
        offset = out.next_offset;
        if out.eof {
            assert_eq!(offset, MIB, "{id}: the output's end");
            return (dropped, kept);
        }
    }
}

async fn metric(daemon: &Daemon, token: &str, name: &str) -> u64 {
    let text = http_get(daemon.addr, "/metrics", Some(&format!("Bearer {token}")))
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in the metrics:\n{text}"))
}

const ALICE: &str = "alice-token-0123456789abcdef0123456789";
const BOB: &str = "bob-token-0123456789abcdef0123456789abc";
const CAROL: &str = "carol-token-0123456789abcdef0123456789a";

#[tokio::test]
async fn a_client_past_its_memory_budget_loses_its_oldest_output_and_another_clients_is_intact() {
    let (_dir, file) = executor_tests::clients_file(&serde_json::json!({"clients": [
        {"name": "alice", "token": ALICE, "memory_budget_bytes": 3 * MIB, "metrics": true},
        {"name": "bob", "token": BOB},
    ]}));
    let daemon = Daemon::start_opts(executor_tests::DaemonOptions {
        extra: [
            "--clients",
            &file.display().to_string(),
            "--memory-budget-mb",
            "64",
        ]
        .map(String::from)
        .to_vec(),
        state_parent: Some("/var/tmp".into()),
        ..Default::default()
    });
    let mut bob = Client::connect(&daemon.url, Some(BOB)).await.unwrap();
    print_mebibytes(&mut bob, "b", 1).await;
    // Alice keeps 6 MiB of output over two connections, twice her budget.
    let mut alice = Vec::new();
    for c in 0..2 {
        let mut client = Client::connect(&daemon.url, Some(ALICE)).await.unwrap();
        print_mebibytes(&mut client, &format!("a{c}-"), 3).await;
        alice.push(client);
    }
    let kept = metric(
        &daemon,
        ALICE,
        "executor_client_memory_kept_bytes{client=\"alice\"}",
    )
    .await;
    assert!(kept <= 3 * MIB, "alice keeps {kept} bytes, past her 3 MiB");
    assert_eq!(
        metric(&daemon, ALICE, "executor_memory_budget_bytes").await,
        64 * MIB
    );
    // Her oldest output went first, whole, and its reader is told how much.
    let (dropped, kept) = read_all(&mut alice[0], "a0-0").await;
    assert_eq!((dropped, kept), (MIB, 0), "the oldest ended output");
    // Her newest is intact (allowed case).
    let (dropped, kept) = read_all(&mut alice[1], "a1-2").await;
    assert_eq!((dropped, kept), (0, MIB), "the newest ended output");
    // Bob's output, older than all of alice's, is untouched by her budget.
    let (dropped, kept) = read_all(&mut bob, "b0").await;
    assert_eq!((dropped, kept), (0, MIB), "another client's output");
    let listed = list(&mut alice[0]).await;
    assert!(
        listed.iter().all(|p| p.output_bytes == MIB),
        "every process printed its mebibyte: {listed:?}"
    );
}

/// Issue 35: 40 idle connections that each ran 16 processes printing 1 MiB grew a daemon by
/// about 16 MiB a connection (16 ended processes were kept, where the doc says 8). Here 12
/// connections run 16 processes each, all at once (192 MiB of output), and keep 8 ended ones
/// each (96 MiB) under a 16 MiB budget: the daemon's resident memory grows by the budget and
/// a fixed overhead at most (by about 98 MiB without the budget).
#[tokio::test]
async fn idle_sessions_that_printed_mebibytes_keep_the_daemon_within_its_memory_budget() {
    const CONNECTIONS: usize = 12;
    const PROCESSES: usize = 16;
    const KEPT: usize = 8;
    const BUDGET_MIB: u64 = 16;
    const OVERHEAD_MIB: u64 = 32;
    let daemon = Daemon::start_with(&["--memory-budget-mb", &BUDGET_MIB.to_string()]);
    // Warm up (allocator arenas, warm workers) before the baseline.
    let mut warm = daemon.connect().await;
    print_mebibytes(&mut warm, "w", 2).await;
    drop(warm);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = rss_kib(daemon.pid());
    let fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", daemon.pid()))
            .unwrap()
            .count()
    };
    let fds_before = fds();
    let mut idle = Vec::new();
    for c in 0..CONNECTIONS {
        let mut client = daemon.connect().await;
        for i in 0..PROCESSES {
            spawn(&mut client, spawn_req(&format!("c{c}-{i}"), MEBIBYTE)).await;
        }
        idle.push(client);
    }
    // Control: the output was made and is listed, 8 kept per session as the doc says (the
    // oldest 8 forgotten as newer ones ended, not at the next spawn).
    for client in &mut idle {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let listed = list(client).await;
            if listed.iter().all(|p| !p.running) {
                assert_eq!(listed.len(), KEPT, "{listed:?}");
                assert!(listed.iter().all(|p| p.output_bytes == MIB), "{listed:?}");
                break;
            }
            assert!(Instant::now() < deadline, "still running: {listed:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let token = daemon.token.clone();
    let kept = metric(&daemon, &token, "executor_memory_kept_bytes").await;
    assert!(kept <= BUDGET_MIB * MIB, "{kept} bytes kept");
    // The last session's 8 ended last: nothing newer pushed them out.
    assert!(kept >= 8 * MIB, "the budget is used: {kept} bytes kept");
    // An ended process kept for reading holds no descriptor: a connection's socket each.
    let fds_after = fds();
    assert!(
        fds_after <= fds_before + CONNECTIONS + 8,
        "the daemon holds {fds_after} descriptors, {fds_before} before {CONNECTIONS} idle sessions"
    );
    let after = rss_kib(daemon.pid());
    let grown_mib = after.saturating_sub(before) / 1024;
    eprintln!(
        "daemon RSS {} -> {} MiB over {CONNECTIONS} idle sessions ({} MiB of output, budget {BUDGET_MIB} MiB)",
        before / 1024,
        after / 1024,
        (CONNECTIONS * PROCESSES) as u64
    );
    assert!(
        grown_mib <= BUDGET_MIB + OVERHEAD_MIB,
        "the daemon grew by {grown_mib} MiB, past its {BUDGET_MIB} MiB budget and {OVERHEAD_MIB} MiB"
    );
}

/// Kept output counts against `output_quota_bytes` as it arrives: a process that prints and
/// runs on (a server, which never ends) used to be charged only when it ended.
#[tokio::test]
async fn a_running_processs_output_counts_against_the_output_quota_as_it_arrives() {
    let (_dir, file) = executor_tests::clients_file(&serde_json::json!({"clients": [
        {"name": "alice", "token": ALICE, "output_quota_bytes": MIB},
    ]}));
    let daemon = Daemon::start_opts(executor_tests::DaemonOptions {
        extra: ["--clients", &file.display().to_string()]
            .map(String::from)
            .to_vec(),
        state_parent: Some("/var/tmp".into()),
        ..Default::default()
    });
    let mut client = Client::connect(&daemon.url, Some(ALICE)).await.unwrap();
    // Allowed case: within the quota a command runs.
    let ok = client.run_req(req("before", "echo fine")).await;
    assert_eq!(ok.output, "fine\n");
    spawn(
        &mut client,
        spawn_req("server", &format!("{MEBIBYTE}; {MEBIBYTE}; exec sleep 600")),
    )
    .await;
    let mut offset = 0;
    while offset < 2 * MIB {
        offset = read(&mut client, "server", offset, 30.0).await.next_offset;
    }
    let info = list(&mut client).await;
    assert!(info[0].running, "the server still runs: {info:?}");
    let refused = client
        .exec(req("after", "echo no"))
        .await
        .result
        .unwrap_err();
    assert_eq!(refused.code, ErrorCode::QuotaExceeded, "{refused:?}");
    assert!(refused.message.contains("output quota"), "{refused:?}");
}

async fn write_32k_times_40(client: &mut Client, id: &str) {
    let data = b64(&[b'x'; 32 * 1024]);
    for _ in 0..40 {
        client
            .send(&ClientMessage::Write(WriteRequest {
                id: id.into(),
                data: Some(data.clone()),
                text: None,
                eof: false,
            }))
            .await;
    }
}

/// Queued stdin counts against the client's memory budget: writes to a process that does
/// not read get `busy` naming the budget once it is full, while the same writes to one that
/// reads are all taken.
#[tokio::test]
async fn stdin_queued_past_the_clients_memory_budget_is_busy_naming_it() {
    let (_dir, file) = executor_tests::clients_file(&serde_json::json!({"clients": [
        {"name": "alice", "token": ALICE, "memory_budget_bytes": 256 * 1024},
    ]}));
    let daemon = Daemon::start_opts(executor_tests::DaemonOptions {
        extra: ["--clients", &file.display().to_string()]
            .map(String::from)
            .to_vec(),
        state_parent: Some("/var/tmp".into()),
        ..Default::default()
    });
    let mut client = Client::connect(&daemon.url, Some(ALICE)).await.unwrap();
    // Allowed case: a reader takes 1.25 MiB, five times the budget, in rounds of 128 KiB
    // (half the budget) each written once the one before is on the host's disk: stdin that
    // is read does not stay counted. (Not all at once: on a busy machine `cat` may not read
    // 1.25 MiB as fast as it comes, and the queue would rightly fill.)
    let got = daemon.workspace.join(format!("got-{}", marker()));
    spawn(
        &mut client,
        spawn_req("reader", &format!("cat >{}", got.display())),
    )
    .await;
    let data = b64(&[b'x'; 32 * 1024]);
    for round in 1..=10u64 {
        for _ in 0..4 {
            client
                .send(&ClientMessage::Write(WriteRequest {
                    id: "reader".into(),
                    data: Some(data.clone()),
                    text: None,
                    eof: false,
                }))
                .await;
        }
        let want = round * 128 * 1024;
        assert!(
            eventually(PATIENCE, || {
                std::fs::metadata(&got).ok().map(|m| m.len()) == Some(want)
            })
            .await,
            "round {round}: the reader did not get {want} bytes"
        );
    }
    let quiet = client.recv_within(Duration::from_secs(2)).await;
    assert!(
        matches!(quiet, Err(())),
        "a write to a reader was refused: {quiet:?}"
    );
    // Denial: one that never reads fills its socket, then the queue, then the budget.
    spawn(&mut client, spawn_req("sleeper", "exec sleep 600")).await;
    write_32k_times_40(&mut client, "sleeper").await;
    match client.reply_for("sleeper").await {
        ServerMessage::Error(e) => {
            assert_eq!(e.code, ErrorCode::Busy, "{e:?}");
            assert!(e.message.contains("memory budget"), "{e:?}");
            assert!(e.message.contains("memory_budget_bytes"), "{e:?}");
        }
        other => panic!("expected busy, got {other:?}"),
    }
}

/// A `write` of 700 KB (512 KiB in base64) to no process: refused at once, after it was read.
async fn send_big(client: &mut Client) {
    client
        .send(&ClientMessage::Write(WriteRequest {
            id: "nobody".into(),
            data: Some(b64(&vec![b'x'; 512 * 1024])),
            text: None,
            eof: false,
        }))
        .await;
    match client.recv().await {
        Some(ServerMessage::Error(e)) => assert_eq!(e.code, ErrorCode::NotFound, "{e:?}"),
        other => panic!("expected not_found, got {other:?}"),
    }
}

/// The daemon's resident memory in KiB once it settled (allocator arenas warmed by `warm`).
async fn settled_rss(daemon: &Daemon) -> u64 {
    tokio::time::sleep(Duration::from_millis(500)).await;
    rss_kib(daemon.pid())
}

/// Issue 35: "the same output through `exec` on 30 held connections: 14 -> 44 MiB". A result
/// of 1 MiB was written as one WebSocket frame, and the connection's write buffer kept that
/// capacity while it stayed open. Results now go out in frames of 16 KiB: 16 idle
/// connections that each received a mebibyte's result hold far less than a mebibyte each.
#[tokio::test]
async fn idle_connections_that_received_a_mebibyte_result_do_not_keep_it() {
    const CONNECTIONS: usize = 16;
    let daemon = Daemon::start();
    let mut warm = daemon.connect().await;
    let result = warm.run("w", MEBIBYTE).await;
    assert_eq!(result.output.len() as u64, MIB);
    drop(warm);
    let before = settled_rss(&daemon).await;
    let mut idle = Vec::new();
    for c in 0..CONNECTIONS {
        let mut client = daemon.connect().await;
        let result = client.run(&format!("c{c}"), MEBIBYTE).await;
        // Allowed case: the whole result arrives, in order (fragmented on the wire).
        assert_eq!(result.returncode, 0, "{}", result.exception_info);
        assert_eq!(
            result.output.as_bytes(),
            pattern(0, MIB as usize),
            "c{c}: the result's output"
        );
        idle.push(client);
    }
    let after = settled_rss(&daemon).await;
    let grown_kib = after.saturating_sub(before);
    eprintln!(
        "daemon RSS {} -> {} KiB over {CONNECTIONS} idle connections that each received 1 MiB",
        before, after
    );
    // Before: about 1 MiB per connection (16 MiB); now the connection's own cost.
    assert!(
        grown_kib < CONNECTIONS as u64 * 320,
        "the daemon grew by {grown_kib} KiB: more than 320 KiB per idle connection"
    );
}

/// A message from the client grows the connection's read buffer (tungstenite keeps it at the
/// largest frame read). That is counted in the memory budget, and with a resume grace the
/// budget takes it back from idle connections by dropping them, before any output; their
/// sessions wait for a resume. 24 connections each send a 700 KB message (16 MiB in all)
/// under an 8 MiB budget: the daemon stays within it, and a dropped one resumes.
#[tokio::test]
async fn grown_read_buffers_count_in_the_budget_and_idle_ones_are_dropped_for_a_resume() {
    const CONNECTIONS: usize = 24;
    const BUDGET_MIB: u64 = 8;
    const OVERHEAD_MIB: u64 = 12;
    let daemon = Daemon::start_with(&[
        "--memory-budget-mb",
        &BUDGET_MIB.to_string(),
        "--resume-grace",
        "300",
    ]);
    let mut warm = daemon.connect().await;
    send_big(&mut warm).await;
    drop(warm);
    let before = settled_rss(&daemon).await;
    let mut clients = Vec::new();
    for _ in 0..CONNECTIONS {
        let mut client = daemon.connect().await;
        send_big(&mut client).await;
        clients.push(client);
    }
    let token = daemon.token.clone();
    let kept = metric(&daemon, &token, "executor_memory_kept_bytes").await;
    assert!(kept <= BUDGET_MIB * MIB, "{kept} bytes kept");
    let after = settled_rss(&daemon).await;
    let grown_mib = after.saturating_sub(before) / 1024;
    eprintln!("daemon RSS {before} -> {after} KiB, {kept} bytes kept");
    assert!(
        grown_mib <= BUDGET_MIB + OVERHEAD_MIB,
        "the daemon grew by {grown_mib} MiB, past its {BUDGET_MIB} MiB budget and {OVERHEAD_MIB} MiB"
    );
    // The first connections were dropped (no close frame: a drop, resumed like any), the
    // last ones are open (allowed case).
    let mut dropped = Vec::new();
    for (i, client) in clients.iter_mut().enumerate() {
        client
            .send(&ClientMessage::ListProcesses(ListProcessesRequest {
                id: None,
            }))
            .await;
        match client.recv_within(PATIENCE).await {
            Ok(Some(ServerMessage::Processes(_))) => {}
            Ok(None) => dropped.push(i),
            other => panic!("connection {i}: {other:?}"),
        }
    }
    eprintln!("dropped connections: {dropped:?}");
    assert!(!dropped.is_empty(), "no connection was dropped");
    assert!(
        dropped.len() < CONNECTIONS,
        "every connection was dropped, the newest too"
    );
    assert!(
        dropped[0] == 0,
        "the oldest grown buffer goes first: {dropped:?}"
    );
    let session = clients[dropped[0]].hello.session.clone();
    let mut again = daemon.connect().await;
    again
        .send(&ClientMessage::Resume(ResumeRequest {
            session: session.clone(),
            awaiting: Vec::new(),
        }))
        .await;
    match again.recv().await {
        Some(ServerMessage::Resumed(r)) => assert_eq!(r.session, session),
        other => panic!("expected resumed, got {other:?}"),
    }
    assert_eq!(
        metric(
            &daemon,
            &token,
            "executor_limit_hits_total{client=\"default\",limit=\"memory_budget_connection_shed\"}"
        )
        .await,
        dropped.len() as u64
    );
}

/// Each open connection counts in its client's budget: past it a connection is refused
/// with 503 naming the budget, while another client connects (allowed case), and a closed
/// connection gives its share back. A spawn whose entry (its command counted) does not fit is `busy`.
#[tokio::test]
async fn connections_and_process_entries_past_a_clients_budget_are_refused_naming_it() {
    let (_dir, file) = executor_tests::clients_file(&serde_json::json!({"clients": [
        {"name": "alice", "token": ALICE, "memory_budget_bytes": 200 * 1024},
        {"name": "bob", "token": BOB},
        {"name": "carol", "token": CAROL, "memory_budget_bytes": 100 * 1024},
    ]}));
    let daemon = Daemon::start_opts(executor_tests::DaemonOptions {
        extra: ["--clients", &file.display().to_string()]
            .map(String::from)
            .to_vec(),
        state_parent: Some("/var/tmp".into()),
        ..Default::default()
    });
    let mut alice = Vec::new();
    let refused = loop {
        match Client::connect(&daemon.url, Some(ALICE)).await {
            Ok(client) => alice.push(client),
            Err(err) => break err,
        }
        assert!(
            alice.len() < 64,
            "alice's budget never refused a connection"
        );
    };
    assert!(!alice.is_empty(), "alice could not connect at all");
    match refused {
        tokio_tungstenite::tungstenite::Error::Http(resp) => {
            assert_eq!(resp.status(), 503);
            let body = String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default());
            assert!(body.contains("memory budget full"), "{body}");
            assert!(body.contains("memory_budget_bytes"), "{body}");
        }
        other => panic!("expected HTTP 503, got {other}"),
    }
    // Another client is not refused.
    let mut bob = Client::connect(&daemon.url, Some(BOB)).await.unwrap();
    assert_eq!(bob.run("b", "echo hi").await.output, "hi\n");
    // A closed connection gives its share back.
    alice.pop();
    let mut back = None;
    for _ in 0..50 {
        if let Ok(client) = Client::connect(&daemon.url, Some(ALICE)).await {
            back = Some(client);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut back = back.expect("alice could not connect again after closing one connection");
    assert_eq!(back.run("a", "echo back").await.output, "back\n");
    // A process entry counts its command: with one connection open, a short one spawns
    // (allowed case) and one of 64 KiB, more than carol's 100 KiB budget has left, is busy.
    let mut carol = Client::connect(&daemon.url, Some(CAROL)).await.unwrap();
    spawn(&mut carol, spawn_req("short", "true")).await;
    assert_eq!(wait(&mut carol, "short", 60.0).await.returncode, 0);
    let long = format!("true {}", "x".repeat(64 * 1024));
    carol
        .send(&ClientMessage::Spawn(spawn_req("long", &long)))
        .await;
    match carol.reply_for("long").await {
        ServerMessage::Error(e) => {
            assert_eq!(e.code, ErrorCode::Busy, "{e:?}");
            assert!(e.message.contains("memory budget full"), "{e:?}");
        }
        other => panic!("expected busy, got {other:?}"),
    }
}
