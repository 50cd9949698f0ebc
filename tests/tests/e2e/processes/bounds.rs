//! The bounds on processes: the output ring, slots, stdin, waiting reads, ids and ended
//! processes kept for reading.

use super::*;
use executor_tests::host_waits::sleepers_up;

#[tokio::test]
async fn output_beyond_the_buffer_is_dropped_oldest_first_and_offsets_add_up() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let cap = client.hello.limits.max_process_buffer_bytes as u64;
    assert!(cap > 0, "hello names the per-process buffer");
    // Fixed-width numbered records: the byte at any offset is known.
    const RECORDS: u64 = 300_000;
    let total = RECORDS * 10;
    assert!(total > 2 * cap, "make more output than the buffer holds");
    spawn(
        &mut client,
        spawn_req(
            "flood",
            &format!(
                "python3 -c \"import sys; sys.stdout.write(''.join('%09d\\n' % i for i in \
                 range({RECORDS})))\""
            ),
        ),
    )
    .await;
    let exited = wait(&mut client, "flood", 20.0).await;
    assert_eq!(exited.returncode, 0, "{exited:?}");
    let expected = |from: u64, len: usize| -> Vec<u8> {
        (from..from + len as u64)
            .map(|p| {
                let record = format!("{:09}\n", p / 10);
                record.as_bytes()[(p % 10) as usize]
            })
            .collect()
    };
    let first = read(&mut client, "flood", 0, 0.0).await;
    assert_eq!(first.offset, total - cap, "{first:?}");
    assert_eq!(first.dropped, total - cap);
    let data = unb64(&first.data);
    assert_eq!(first.next_offset, first.offset + data.len() as u64);
    assert_eq!(data, expected(first.offset, data.len()));
    // From there on, every byte to the end, nothing more dropped.
    let mut offset = first.next_offset;
    let mut n = data.len() as u64;
    loop {
        let out = read(&mut client, "flood", offset, 0.0).await;
        assert_eq!(out.dropped, 0);
        assert_eq!(out.offset, offset);
        let data = unb64(&out.data);
        assert_eq!(data, expected(offset, data.len()), "at {offset}");
        offset = out.next_offset;
        n += data.len() as u64;
        if out.eof {
            break;
        }
    }
    assert_eq!((offset, n), (total, cap));
    // A reader part way through the lost bytes learns exactly how many it missed.
    let mid = read(&mut client, "flood", 1000, 0.0).await;
    assert_eq!((mid.offset, mid.dropped), (total - cap, total - cap - 1000));
    let info = list(&mut client).await;
    assert_eq!(info[0].output_bytes, total);
}

/// Regression (issue 35): a read past the end was answered from the end (an `offset` before
/// the one asked for), where the doc promised "the offset asked for, or later". Now refused,
/// naming the end; reads at the end and before it are answered from their offset.
#[tokio::test]
async fn a_read_past_the_end_is_refused_naming_the_end_and_one_at_the_end_is_answered() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    spawn(&mut client, spawn_req("abc", "printf abc")).await;
    assert_eq!(wait(&mut client, "abc", 20.0).await.returncode, 0);
    for offset in [4, 1_000_000] {
        client
            .send(&ClientMessage::Read(ReadRequest {
                id: "abc".into(),
                offset,
                max_bytes: None,
                wait: Some(1.0),
            }))
            .await;
        match client.reply_for("abc").await {
            ServerMessage::Error(e) => {
                assert_eq!(e.code, ErrorCode::BadRequest, "{e:?}");
                assert!(
                    e.message.contains("past the end") && e.message.contains("3 bytes"),
                    "{e:?}"
                );
            }
            other => panic!("a read at {offset} past the end was answered: {other:?}"),
        }
    }
    let at_end = read(&mut client, "abc", 3, 0.0).await;
    assert_eq!(
        (
            at_end.offset,
            at_end.next_offset,
            at_end.dropped,
            at_end.eof
        ),
        (3, 3, 0, true)
    );
    assert!(unb64(&at_end.data).is_empty());
    let inside = read(&mut client, "abc", 1, 0.0).await;
    assert_eq!(
        (inside.offset, inside.next_offset, inside.eof),
        (1, 3, true)
    );
    assert_eq!(unb64(&inside.data), b"bc");
}

#[tokio::test]
async fn spawns_beyond_max_commands_per_connection_are_busy() {
    let daemon = Daemon::start_with(&["--max-commands-per-connection", "2"]);
    let mut client = daemon.connect().await;
    assert_eq!(client.hello.limits.max_commands_per_connection, 2);
    let m = marker();
    spawn(&mut client, spawn_req("one", &marked_sleep(&m))).await;
    spawn(&mut client, spawn_req("two", &marked_sleep(&m))).await;
    let err = spawn_refused(&mut client, spawn_req("three", &marked_sleep(&m))).await;
    assert_eq!(err.code, ErrorCode::Busy, "{err:?}");
    // An exec counts against the same limit.
    let refused = client
        .exec(req("exec", "echo no"))
        .await
        .result
        .unwrap_err();
    assert_eq!(refused.code, ErrorCode::Busy, "{refused:?}");
    assert!(sleepers_up(&m, 2).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sleepers(&m).len(), 2, "the third never ran");
    // Control: once one ends, a spawn fits again.
    signal(&mut client, "one", "KILL", false).await;
    assert!(!wait(&mut client, "one", 10.0).await.running);
    spawn(&mut client, spawn_req("three", &marked_sleep(&m))).await;
    assert!(sleepers_up(&m, 2).await);
}

#[tokio::test]
async fn writes_to_a_process_that_never_reads_stdin_end_in_busy() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    let chunk = vec![b'x'; 64 * 1024];
    const WRITES: usize = 150;
    // Control: a process that reads takes every write.
    spawn(&mut client, spawn_req("reader", "wc -c")).await;
    for _ in 0..WRITES {
        client.write_chunk("reader", &chunk, false).await;
    }
    client.write_chunk("reader", &[], true).await;
    let out = read_to_eof(&mut client, "reader", 0).await;
    assert_eq!(
        String::from_utf8(out).unwrap().trim(),
        (WRITES * chunk.len()).to_string()
    );

    spawn(&mut client, spawn_req("deaf", &marked_sleep(&m))).await;
    for _ in 0..WRITES {
        client.write_chunk("deaf", &chunk, false).await;
    }
    // A `wait` after the writes: its answer comes after every error the writes caused.
    client
        .send(&ClientMessage::Wait(WaitRequest {
            id: "deaf".into(),
            timeout: None,
        }))
        .await;
    let mut busy = 0;
    loop {
        match client.reply_for("deaf").await {
            ServerMessage::Error(e) => {
                assert_eq!(e.code, ErrorCode::Busy, "{e:?}");
                assert!(e.message.contains("not reading its stdin"), "{}", e.message);
                busy += 1;
            }
            ServerMessage::Exited(e) => {
                assert!(e.running, "the process is unharmed: {e:?}");
                break;
            }
            other => panic!("expected busy, got {other:?}"),
        }
    }
    // The daemon took a bounded number of writes (its queue of 64, plus what the socket's
    // buffer holds) and refused the rest.
    let taken = WRITES - busy;
    assert!(
        (64..=80).contains(&taken),
        "{taken} of {WRITES} writes taken"
    );
    assert!(sleepers_up(&m, 1).await);
}

#[tokio::test]
async fn requests_for_an_unknown_process_are_not_found() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    spawn(&mut client, spawn_req("known", "echo here")).await;
    assert_eq!(
        read_to_eof(&mut client, "known", 0).await,
        b"here\n".to_vec()
    );
    for msg in [
        ClientMessage::Read(ReadRequest {
            id: "ghost".into(),
            offset: 0,
            max_bytes: None,
            wait: None,
        }),
        ClientMessage::Wait(WaitRequest {
            id: "ghost".into(),
            timeout: None,
        }),
        ClientMessage::Signal(SignalRequest {
            id: "ghost".into(),
            signal: "TERM".into(),
            foreground: false,
        }),
        ClientMessage::Write(WriteRequest {
            id: "ghost".into(),
            data: Some(b64(b"x")),
            text: None,
            eof: false,
        }),
    ] {
        client.send(&msg).await;
        match client.reply_for("ghost").await {
            ServerMessage::Error(e) => assert_eq!(e.code, ErrorCode::NotFound, "{msg:?}: {e:?}"),
            other => panic!("{msg:?}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_running_process_id_cannot_be_taken_again_but_an_ended_ones_can() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    spawn(&mut client, spawn_req("p", &marked_sleep(&m))).await;
    let err = spawn_refused(&mut client, spawn_req("p", "echo second")).await;
    assert_eq!(err.code, ErrorCode::DuplicateId, "{err:?}");
    let refused = client.exec(req("p", "echo exec")).await.result.unwrap_err();
    assert_eq!(refused.code, ErrorCode::DuplicateId, "{refused:?}");
    // Only the first one runs (`spawned` comes once its shell runs; the sleep just after).
    assert!(sleepers_up(&m, 1).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sleepers(&m).len(), 1);
    signal(&mut client, "p", "KILL", false).await;
    assert!(!wait(&mut client, "p", 10.0).await.running);
    // Ended: the id is free again, and the new process's output is its own.
    spawn(&mut client, spawn_req("p", "echo second")).await;
    assert_eq!(read_to_eof(&mut client, "p", 0).await, b"second\n");
}

#[tokio::test]
async fn waiting_reads_are_bounded_per_session() {
    // Every buffer a client can fill must have a limit (design.md, "Bounded"). A `read` with
    // `wait` parks until output comes or the wait passes (up to 60 s); a client may send them
    // far faster than they end, so past 64 waiting (protocol/README.md) they are `busy`.
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    spawn(&mut client, spawn_req("quiet", "sleep 120")).await;
    // Control: a waiting read is answered when its wait passes.
    let out = read(&mut client, "quiet", 0, 0.2).await;
    assert!(out.data.is_empty() && !out.eof, "{out:?}");
    let before = executor_tests::rss_kib(daemon.pid());
    let text = serde_json::to_string(&ClientMessage::Read(ReadRequest {
        id: "quiet".into(),
        offset: 0,
        max_bytes: None,
        wait: Some(60.0),
    }))
    .unwrap();
    const READS: usize = 5_000;
    const WAITING: usize = 64;
    for _ in 0..READS {
        client.send_text(&text).await;
    }
    // Everything sent has been handled once a request behind it is answered.
    client
        .send(&ClientMessage::ListProcesses(ListProcessesRequest {
            id: Some("after".into()),
        }))
        .await;
    let mut busy = 0;
    loop {
        match client.recv().await {
            Some(ServerMessage::Error(e)) if e.id.as_deref() == Some("quiet") => {
                assert_eq!(e.code, ErrorCode::Busy, "{e:?}");
                busy += 1;
            }
            Some(ServerMessage::Processes(_)) => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(busy, READS - WAITING, "reads refused past the waiting ones");
    let grown = executor_tests::rss_kib(daemon.pid()).saturating_sub(before);
    assert!(
        grown < 20 * 1024,
        "{READS} reads grew the daemon by {grown} KiB"
    );
    // The end of the output wakes the parked reads: each is answered. They may be answered
    // before the signal's own `done` (the kill ends the output at once), so both are counted.
    client
        .send(&ClientMessage::Signal(SignalRequest {
            id: "quiet".into(),
            signal: "KILL".into(),
            foreground: false,
        }))
        .await;
    let (mut answered, mut done) = (0, false);
    while answered < WAITING || !done {
        match client.recv().await {
            Some(ServerMessage::ProcessOutput(out)) if out.id == "quiet" => {
                assert!(out.eof, "{out:?}");
                answered += 1;
            }
            Some(ServerMessage::Done(d)) if d.id == "quiet" => done = true,
            Some(ServerMessage::Error(e)) if e.id.as_deref() == Some("quiet") => panic!("{e:?}"),
            Some(_) => {}
            None => panic!("closed"),
        }
    }
    assert_eq!(answered, WAITING, "every parked read answered once");
}

#[tokio::test]
async fn ended_processes_are_kept_for_reading_until_eight_newer_ones_push_them_out() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    for i in 0..10 {
        let id = format!("p{i}");
        spawn(&mut client, spawn_req(&id, &format!("echo out-{i}"))).await;
        assert_eq!(wait(&mut client, &id, 10.0).await.returncode, 0);
    }
    // Ten ended: as each ended past eight, the oldest went (when it ended, not at the next
    // spawn), so p0 and p1 are gone and p2..p9 stay.
    for gone in ["p0", "p1"] {
        client
            .send(&ClientMessage::Read(ReadRequest {
                id: gone.into(),
                offset: 0,
                max_bytes: None,
                wait: None,
            }))
            .await;
        match client.reply_for(gone).await {
            ServerMessage::Error(e) => assert_eq!(e.code, ErrorCode::NotFound, "{e:?}"),
            other => panic!("{gone}: {other:?}"),
        }
    }
    assert_eq!(read_to_eof(&mut client, "p2", 0).await, b"out-2\n");
    spawn(&mut client, spawn_req("p10", "echo out-10")).await;
    assert_eq!(wait(&mut client, "p10", 10.0).await.returncode, 0);
    let listed: Vec<String> = list(&mut client).await.into_iter().map(|p| p.id).collect();
    let mut expected: Vec<String> = (3..=10).map(|i| format!("p{i}")).collect();
    expected.sort();
    assert_eq!(
        listed, expected,
        "eight ended ones are kept, the oldest forgotten"
    );
    client
        .send(&ClientMessage::Read(ReadRequest {
            id: "p2".into(),
            offset: 0,
            max_bytes: None,
            wait: None,
        }))
        .await;
    match client.reply_for("p2").await {
        ServerMessage::Error(e) => assert_eq!(e.code, ErrorCode::NotFound, "{e:?}"),
        other => panic!("p2: {other:?}"),
    }
    assert_eq!(read_to_eof(&mut client, "p3", 0).await, b"out-3\n");
}
