//! Hostile and malformed input: every bad message gets a typed error, nothing panics, and the
//! connection and the daemon live on.

use executor_tests::{eventually, req, Daemon, PATIENCE};
use futures_util::{SinkExt, StreamExt};
use protocol::{ClientMessage, ErrorCode, ServerMessage};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;

/// The code of the close frame the daemon sends next, skipping other messages; `None` when
/// the connection ends without one (a client then sees 1006, abnormal closure).
async fn close_code(client: &mut executor_tests::Client) -> Option<CloseCode> {
    loop {
        let frame = tokio::time::timeout(executor_tests::PATIENCE, client.ws.next())
            .await
            .expect("no close within the test's patience");
        match frame {
            Some(Ok(Message::Close(frame))) => return frame.map(|f| f.code),
            Some(Ok(_)) => continue,
            Some(Err(_)) | None => return None,
        }
    }
}

async fn expect_error(client: &mut executor_tests::Client, text: &str) -> protocol::ErrorMessage {
    client.send_text(text).await;
    match client.recv().await {
        Some(ServerMessage::Error(err)) => err,
        other => panic!("for {text:?} expected an error, got {other:?}"),
    }
}

#[tokio::test]
async fn malformed_json_unknown_types_and_bad_fields_get_typed_errors_and_the_connection_lives_on()
{
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let cases: &[(&str, ErrorCode)] = &[
        ("not json at all", ErrorCode::BadRequest),
        ("{\"type\":\"exec\"", ErrorCode::BadRequest),
        ("[]", ErrorCode::BadRequest),
        ("{\"type\":\"launch\",\"id\":\"x\"}", ErrorCode::BadRequest),
        ("{\"id\":\"x\",\"command\":\"true\"}", ErrorCode::BadRequest),
        ("{\"type\":\"exec\",\"id\":\"x\"}", ErrorCode::BadRequest),
        (
            "{\"type\":\"exec\",\"id\":\"x\",\"command\":\"true\",\"timout\":3}",
            ErrorCode::BadRequest,
        ),
        (
            "{\"type\":\"exec\",\"id\":\"x\",\"command\":\"true\",\"timeout\":-1}",
            ErrorCode::BadRequest,
        ),
        (
            "{\"type\":\"exec\",\"id\":\"x\",\"command\":\"true\",\"timeout\":1e300}",
            ErrorCode::BadRequest,
        ),
        (
            "{\"type\":\"exec\",\"id\":\"x\",\"command\":\"true\",\"timeout\":\"10\"}",
            ErrorCode::BadRequest,
        ),
        (
            "{\"type\":\"exec\",\"id\":\"x\",\"command\":\"true\",\"cwd\":\"rel\"}",
            ErrorCode::BadRequest,
        ),
        (
            "{\"type\":\"exec\",\"id\":\"x\",\"command\":\"a\\u0000b\"}",
            ErrorCode::BadRequest,
        ),
        (
            "{\"type\":\"exec\",\"id\":\"x\",\"command\":\"true\",\"env\":{\"A=B\":\"c\"}}",
            ErrorCode::BadRequest,
        ),
        (
            "{\"type\":\"exec\",\"id\":\"\",\"command\":\"true\"}",
            ErrorCode::BadRequest,
        ),
        (
            "{\"type\":\"exec\",\"id\":\"x\",\"command\":\"true\",\"profile\":\"nope\"}",
            ErrorCode::ProfileDenied,
        ),
        ("{\"type\":\"cancel\"}", ErrorCode::BadRequest),
    ];
    for (text, code) in cases {
        let err = expect_error(&mut client, text).await;
        assert_eq!(err.code, *code, "{text}: {err:?}");
        assert!(!err.message.is_empty());
    }
    // The error names the request when its id could be read.
    let err = expect_error(
        &mut client,
        "{\"type\":\"exec\",\"id\":\"named\",\"command\":1}",
    )
    .await;
    assert_eq!(err.id.as_deref(), Some("named"));
    // Binary frames are refused the same way.
    use futures_util::SinkExt;
    client
        .ws
        .send(tokio_tungstenite::tungstenite::Message::binary(vec![
            1u8, 2, 3,
        ]))
        .await
        .unwrap();
    assert!(
        matches!(client.recv().await, Some(ServerMessage::Error(e)) if e.code == ErrorCode::BadRequest)
    );
    // Allowed twin: the same connection still runs commands.
    assert_eq!(
        client.run("ok", "echo still here").await.output,
        "still here\n"
    );
}

#[tokio::test]
async fn oversized_command_is_refused_but_one_at_the_limit_runs() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let max = client.hello.limits.max_command_bytes;
    let too_long = format!("echo {}", "x".repeat(max));
    let err = client.exec(req("big", &too_long)).await.result.unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest);
    assert!(err.message.contains("limit"), "{}", err.message);
    let at_limit = format!(": {}", "x".repeat(max - 2));
    assert_eq!(at_limit.len(), max);
    let result = client.run("fits", &at_limit).await;
    assert_eq!(result.returncode, 0);
}

#[tokio::test]
async fn oversized_message_gets_an_error_and_a_close_while_the_daemon_lives_on() {
    let daemon = Daemon::start_with(&["--max-message-bytes", "65536"]);
    let mut client = daemon.connect().await;
    let huge = format!(
        "{{\"type\":\"exec\",\"id\":\"h\",\"command\":\"{}\"}}",
        "x".repeat(100_000)
    );
    client.send_text(&huge).await;
    match client.recv().await {
        Some(ServerMessage::Error(err)) => {
            assert_eq!(err.code, ErrorCode::BadRequest);
            assert!(err.message.contains("too large"), "{}", err.message);
        }
        other => panic!("expected an error, got {other:?}"),
    }
    // Then the close, with the code RFC 6455 gives a message too big to process.
    assert_eq!(
        close_code(&mut client).await,
        Some(CloseCode::Size),
        "connection closes with 1009 after an oversized message"
    );
    // Allowed twin: a new connection works, with a message just under the limit.
    let mut again = daemon.connect().await;
    let fits = format!(": {}", "x".repeat(60_000));
    assert_eq!(again.run("fits", &fits).await.returncode, 0);
}

#[tokio::test]
async fn duplicate_ids_and_too_many_concurrent_commands_are_refused() {
    let daemon = Daemon::start_with(&["--max-commands-per-connection", "2"]);
    let mut client = daemon.connect().await;
    for id in ["a", "b"] {
        let mut r = req(id, "sleep 0.5; echo done");
        r.timeout = Some(10.0);
        client.send(&ClientMessage::Exec(r)).await;
    }
    let err = client.exec(req("a", "true")).await.result.unwrap_err();
    assert_eq!(err.code, ErrorCode::DuplicateId);
    let err = client.exec(req("c", "true")).await.result.unwrap_err();
    assert_eq!(err.code, ErrorCode::Busy);
    // Both originals still finish normally...
    assert_eq!(client.collect("a").await.result.unwrap().output, "done\n");
    assert_eq!(client.collect("b").await.result.unwrap().output, "done\n");
    // ...and once they have, the id and the slot are free again.
    assert_eq!(client.run("a", "echo reused").await.output, "reused\n");
}

#[tokio::test]
async fn global_command_limit_applies_across_connections() {
    let daemon = Daemon::start_with(&["--max-commands", "1"]);
    let mut first = daemon.connect().await;
    let mut second = daemon.connect().await;
    let mut r = req("long", "sleep 1; echo first");
    r.timeout = Some(10.0);
    first.send(&ClientMessage::Exec(r)).await;
    // Wait until it is surely running.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let err = second.exec(req("x", "true")).await.result.unwrap_err();
    assert_eq!(err.code, ErrorCode::Busy);
    assert_eq!(
        first.collect("long").await.result.unwrap().output,
        "first\n"
    );
    assert_eq!(second.run("y", "echo second").await.output, "second\n");
}

#[tokio::test]
async fn open_websockets_count_against_the_connection_limit() {
    let daemon = executor_tests::Daemon::start_with(&["--max-connections", "2"]);
    let first = daemon.connect().await;
    let mut second = daemon.connect().await;
    // Both are WebSockets now, past their HTTP upgrade: a third connection has no slot.
    let third = executor_tests::Client::connect(&daemon.url, Some(&daemon.token)).await;
    assert!(
        third.is_err(),
        "a third connection was accepted over the limit"
    );
    assert_eq!(second.run("alive", "echo yes").await.output, "yes\n");
    // Control: closing one frees its slot.
    drop(first);
    let mut again = None;
    for _ in 0..50 {
        if let Ok(client) = executor_tests::Client::connect(&daemon.url, Some(&daemon.token)).await
        {
            again = Some(client);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let mut again = again.expect("no slot after a connection closed");
    assert_eq!(again.run("x", "echo ok").await.output, "ok\n");
}

#[tokio::test]
async fn a_client_close_frame_is_answered_with_a_close_frame() {
    // RFC 6455 5.5.1: an endpoint that receives a close frame sends one back. The daemon used
    // to drop the connection instead, so every orderly close ended as 1006 for the client.
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    assert_eq!(client.run("first", "echo hi").await.output, "hi\n");
    client
        .ws
        .send(Message::Close(Some(CloseFrame {
            code: CloseCode::Normal,
            reason: "done".into(),
        })))
        .await
        .unwrap();
    assert_eq!(close_code(&mut client).await, Some(CloseCode::Normal));
    // Control: the daemon serves a new connection afterwards.
    let mut again = daemon.connect().await;
    assert_eq!(again.run("again", "echo hi").await.output, "hi\n");
}

#[tokio::test]
async fn browser_origins_and_foreign_host_names_are_refused() {
    // A web page in the operator's browser sends its Origin; a DNS-rebinding page reaches a
    // loopback daemon under its own host name. Neither may use the WebSocket or the metrics,
    // token or not (a browser can be made to send neither, but a leaked token could be used).
    let daemon = Daemon::start_with(&["--allow-origin", "https://ui.example"]);
    let port = daemon.addr.port();
    let try_with = |headers: Vec<(&'static str, String)>| {
        let url = daemon.url.clone();
        let token = daemon.token.clone();
        async move {
            use tokio_tungstenite::tungstenite::client::IntoClientRequest;
            let mut request = url.into_client_request().unwrap();
            let h = request.headers_mut();
            h.insert("Authorization", format!("Bearer {token}").parse().unwrap());
            for (name, value) in headers {
                h.insert(name, value.parse().unwrap());
            }
            tokio_tungstenite::connect_async(request)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    };
    for (headers, what) in [
        (
            vec![("Origin", "https://evil.example".to_string())],
            "foreign origin",
        ),
        (
            vec![("Host", format!("evil.example:{port}"))],
            "foreign host",
        ),
        (
            vec![("Host", format!("localhost.evil.example:{port}"))],
            "look-alike host",
        ),
    ] {
        let err = try_with(headers).await.unwrap_err();
        assert!(err.contains("403"), "{what}: {err}");
    }
    let metrics = executor_tests::http_get(daemon.addr, "/metrics", None)
        .await
        .unwrap();
    assert!(metrics.starts_with("HTTP/1.1 401"), "{metrics}");
    // The metrics, with the token: refused to a foreign Origin, served to the allowed one.
    let bearer = format!("Bearer {}", daemon.token);
    for (origin, status) in [
        ("https://evil.example", "HTTP/1.1 403"),
        ("https://ui.example", "HTTP/1.1 200"),
    ] {
        let headers = [("Authorization", bearer.as_str()), ("Origin", origin)];
        let metrics = executor_tests::http_get_with(daemon.addr, "/metrics", &headers)
            .await
            .unwrap();
        assert!(metrics.starts_with(status), "{origin}: {metrics}");
    }
    // Allowed twins: no Origin (not a browser), the allowed one, loopback names.
    for headers in [
        vec![],
        vec![("Origin", "https://ui.example".to_string())],
        vec![("Host", format!("localhost:{port}"))],
        vec![("Host", format!("127.0.0.1:{port}"))],
    ] {
        try_with(headers.clone())
            .await
            .unwrap_or_else(|e| panic!("{headers:?}: {e}"));
    }
    // The log is written by a thread of its own: wait for the line (a fast build answers
    // before the line is written).
    assert!(eventually(PATIENCE, || daemon.log().contains("refused a request")).await);
}

#[tokio::test]
async fn the_accept_queue_is_as_long_as_the_connection_limit() {
    // The listen backlog was 1024 (128 on older setups) whatever --max-connections said.
    let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    for limit in [3000u32, 200] {
        let daemon = Daemon::start_with(&["--max-connections", &limit.to_string()]);
        let out = std::process::Command::new("ss")
            .args(["-Hltn", &format!("sport = :{}", daemon.addr.port())])
            .output()
            .unwrap();
        let line = String::from_utf8_lossy(&out.stdout).to_string();
        // State Recv-Q Send-Q ...: for a listening socket Send-Q is the backlog.
        let backlog: u32 = line.split_whitespace().nth(2).unwrap().parse().unwrap();
        assert_eq!(backlog, limit.min(somaxconn), "{line}");
    }
}

#[tokio::test]
async fn an_audit_line_stays_small_whatever_a_refused_request_carries() {
    // A refused request was audited in full: a 900 KB command made a 900 KB line.
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let huge = "x".repeat(900_000);
    let err = client.exec(req("huge", &huge)).await.result.unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest);
    // Control: an ordinary command is audited whole.
    client.run("small", "echo small").await;
    assert!(
        executor_tests::eventually(executor_tests::PATIENCE, || daemon.audit().len() >= 2).await
    );
    let text = std::fs::read_to_string(daemon.state.path().join("audit.jsonl")).unwrap();
    let longest = text.lines().map(str::len).max().unwrap();
    assert!(longest < 8192, "an audit line of {longest} bytes");
    let records = daemon.audit();
    let refused = records.iter().find(|r| r["id"] == "huge").unwrap();
    assert_eq!(refused["ended"], "refused");
    assert_eq!(refused["command_bytes"], 900_000);
    assert!(refused["command"].as_str().unwrap().starts_with("xxxx"));
    let small = records.iter().find(|r| r["id"] == "small").unwrap();
    assert_eq!(small["command"], "echo small");
    assert!(small.get("command_bytes").is_none());
}
