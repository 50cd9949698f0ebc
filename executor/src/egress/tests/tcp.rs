//! Plain TCP by name (the capture path): relayed when allowed, closed when not, and the
//! first message judged without holding up a server that speaks first.

use super::*;

#[tokio::test]
async fn plain_tcp_by_name_is_relayed_when_allowed_and_closed_when_not() {
    let (port, heads) = web_server().await;
    let allow = ["web.test", "127.0.0.0/8"];
    let s = setup(
        &allow,
        names(&["web.test", "other.test"]),
        Vec::new(),
        Limits::default(),
    );
    let ask = |host: &str| format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n").into_bytes();
    let answer = s.tcp("web.test", port, &ask("web.test")).await;
    assert!(answer.ends_with("hello"), "{answer}");
    let record = s.sink.find("web.test", port).await;
    assert_eq!(
        (&record["allowed"], &record["kind"]),
        (&true.into(), &"tcp".into()),
        "{record}"
    );
    assert!(record["bytes_down"].as_u64().unwrap() > 20, "{record}");
    // Denied: another name, closed without an answer.
    assert_eq!(s.tcp("other.test", port, &ask("other.test")).await, "");
    assert_denied(&s.sink.find("other.test", port).await, "not_allowed");
    assert_eq!(heads.lock().unwrap().len(), 1);
    // Denied: an allowed name whose first request names another host.
    assert_eq!(s.tcp("web.test", port, &ask("other.test")).await, "");
    assert_eq!(heads.lock().unwrap().len(), 1);
    let records = s.sink.all(3).await;
    let mismatch = records
        .iter()
        .find(|r| r["code"] == "host_mismatch")
        .expect("a host_mismatch record");
    assert_eq!(
        (&mismatch["allowed"], &mismatch["bytes_up"]),
        (&false.into(), &0.into()),
        "{mismatch}"
    );
}

/// A server that speaks first (as SSH or SMTP do), then echoes one line.
async fn banner_server() -> u16 {
    let listener = TcpListener::bind((LOOPBACK, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let _ = stream.write_all(b"220 banner\r\n").await;
                let mut line = [0u8; 64];
                if let Ok(n) = stream.read(&mut line).await {
                    let _ = stream.write_all(&line[..n]).await;
                }
            });
        }
    });
    port
}

/// One command allowed `banner.test` (127.0.0.1, named by CIDR).
fn banner_setup(limits: Limits) -> Setup {
    let allow = ["banner.test", "127.0.0.0/8"];
    setup(&allow, names(&["banner.test"]), Vec::new(), limits)
}

#[tokio::test]
async fn a_server_that_speaks_first_is_heard_while_the_first_message_is_awaited() {
    let port = banner_server().await;
    let s = banner_setup(Limits::default());
    let (mut ours, theirs) = tokio::net::UnixStream::pair().unwrap();
    let (engine, ctx) = (s.engine.clone(), s.ctx.clone());
    tokio::spawn(async move { engine.serve_tcp(ctx, theirs, "banner.test", port).await });
    let mut banner = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(30), ours.read_exact(&mut banner))
        .await
        .expect("the banner comes before the command says anything")
        .unwrap();
    assert_eq!(&banner, b"220 banner\r\n");
    // An SMTP command is not taken for an HTTP request line.
    ours.write_all(b"EHLO me\r\n").await.unwrap();
    assert_eq!(read_all(&mut ours).await, "EHLO me\r\n");
    // The record is written when both directions are done.
    drop(ours);
    let record = s.sink.find("banner.test", port).await;
    assert_eq!(
        (
            &record["allowed"],
            &record["bytes_up"],
            &record["bytes_down"]
        ),
        (&true.into(), &9.into(), &21.into()),
        "{record}"
    );
}

#[tokio::test]
async fn a_first_message_that_is_too_slow_or_too_long_is_refused() {
    let port = banner_server().await;
    let s = banner_setup(Limits {
        first_bytes: Duration::from_millis(300),
        max_head: 8192,
        ..Limits::default()
    });
    // A request head begun and never finished (our end stays open: the proxy closes).
    s.tcp(
        "banner.test",
        port,
        b"GET / HTTP/1.1\r\nHost: banner.test\r\n",
    )
    .await;
    // A request head past the limit.
    let mut long = b"GET / HTTP/1.1\r\nX-Pad: ".to_vec();
    long.extend(std::iter::repeat_n(b'a', 9000));
    s.tcp("banner.test", port, &long).await;
    // Control: a whole, short head passes (the server echoes what it reads).
    let whole = b"GET / HTTP/1.1\r\nHost: banner.test\r\n\r\n";
    let answer = s.tcp("banner.test", port, whole).await;
    assert!(answer.contains("GET / HTTP/1.1"), "{answer}");
    let codes: Vec<Value> = s
        .sink
        .all(3)
        .await
        .iter()
        .map(|r| r["code"].clone())
        .collect();
    for code in ["slow_first_message", "first_message_too_long", "allowed"] {
        assert!(codes.contains(&code.into()), "{code} in {codes:?}");
    }
}

/// Counts its lookups; answers 127.0.0.1.
#[derive(Default)]
struct Counting(std::sync::atomic::AtomicUsize);

impl Resolver for Counting {
    fn resolve<'a>(&'a self, _: &'a str, _: u16) -> crate::egress::resolve::Lookup<'a> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move { Ok(vec![LOOPBACK]) })
    }
}

#[tokio::test]
async fn a_name_the_policy_refuses_is_never_looked_up() {
    let (port, _) = web_server().await;
    let counting = Arc::new(Counting::default());
    let s = setup(
        &["web.test", "127.0.0.0/8"],
        counting.clone(),
        Vec::new(),
        Limits::default(),
    );
    let lookups = || counting.0.load(std::sync::atomic::Ordering::SeqCst);
    // Denied: a name carrying data out (a lookup would reach the name's DNS server).
    assert_eq!(s.tcp("secret-data.evil.test", port, b"").await, "");
    let record = s.sink.find("secret-data.evil.test", port).await;
    assert_denied(&record, "not_allowed");
    assert_eq!(lookups(), 0);
    // Control: the allowed name is looked up.
    let answer = s
        .tcp(
            "web.test",
            port,
            b"GET / HTTP/1.1\r\nHost: web.test\r\n\r\n",
        )
        .await;
    assert!(answer.ends_with("hello"), "{answer}");
    assert_eq!(lookups(), 1);
}

/// A sink that takes its time (a slow disk): each record lands only after `delay`.
struct SlowSink {
    delay: Duration,
    inner: MemorySink,
}

impl DecisionSink for SlowSink {
    fn record(&self, record: &DecisionRecord) {
        std::thread::sleep(self.delay);
        self.inner.record(record);
    }
}

/// A command's result counts what was recorded by the time the command ended, and a command
/// ends as soon as it sees its connection close: so a refused tunnel (captured, or after
/// CONNECT) is recorded before the command's side is closed, however slow the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_tunnel_is_recorded_before_the_command_sees_it_close() {
    let port = banner_server().await;
    let Setup { ctx, .. } = banner_setup(Limits::default());
    let sink = Arc::new(SlowSink {
        delay: Duration::from_millis(300),
        inner: MemorySink::default(),
    });
    let engine = Arc::new(Engine {
        resolver: names(&["banner.test"]),
        sink: sink.clone(),
        own_listeners: Vec::new(),
        limits: Limits::default(),
    });
    let fronted = b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n";
    for via_connect in [false, true] {
        let (mut ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let (engine, ctx) = (engine.clone(), ctx.clone());
        if via_connect {
            tokio::spawn(async move { engine.serve_proxy(ctx, theirs).await });
            let connect =
                format!("CONNECT banner.test:{port} HTTP/1.1\r\nHost: banner.test:{port}\r\n\r\n");
            ours.write_all(connect.as_bytes()).await.unwrap();
            let head = read_head(&mut ours).await;
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        } else {
            tokio::spawn(async move { engine.serve_tcp(ctx, theirs, "banner.test", port).await });
        }
        ours.write_all(fronted).await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), ours.read_to_end(&mut got))
            .await
            .expect("the refused tunnel closes")
            .unwrap();
        // At once, no waiting: the record is there.
        let records = sink.inner.0.lock().unwrap().clone();
        assert_eq!(records.len(), usize::from(via_connect) + 1, "{records:?}");
        let record = records.last().unwrap();
        assert_eq!(record["code"], "host_mismatch", "{record}");
    }
}

/// The daemon's listeners hand over TCP sockets: the bytes each way are counted exactly on the
/// capture path and through CONNECT, where the first message comes in the same write as the
/// CONNECT head (read by hyper with it, so relayed from what hyper read).
#[tokio::test]
async fn a_tcp_socket_is_relayed_and_counted_exactly_on_both_paths() {
    let port = banner_server().await;
    let s = banner_setup(Limits::default());
    let listener = TcpListener::bind((LOOPBACK, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    for via_connect in [false, true] {
        let (ours, theirs) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (mut ours, theirs) = (ours.unwrap(), theirs.unwrap().0);
        let (engine, ctx) = (s.engine.clone(), s.ctx.clone());
        let mut sent = Vec::new();
        if via_connect {
            tokio::spawn(async move { engine.serve_proxy(ctx, theirs).await });
            let head = format!("CONNECT banner.test:{port} HTTP/1.1\r\nHost: banner.test\r\n\r\n");
            sent.extend_from_slice(head.as_bytes());
        } else {
            tokio::spawn(async move { engine.serve_tcp(ctx, theirs, "banner.test", port).await });
        }
        sent.extend_from_slice(b"EHLO me\r\n");
        ours.write_all(&sent).await.unwrap();
        let answer = read_all(&mut ours).await;
        assert!(answer.ends_with("220 banner\r\nEHLO me\r\n"), "{answer}");
        drop(ours);
        let records = s.sink.all(usize::from(via_connect) + 1).await;
        let record = records.last().unwrap();
        let kind = if via_connect { "connect" } else { "tcp" };
        assert_eq!(
            (
                &record["kind"],
                &record["allowed"],
                &record["bytes_up"],
                &record["bytes_down"]
            ),
            (&kind.into(), &true.into(), &9.into(), &21.into()),
            "{record}"
        );
    }
}

/// A tunnel still open when its command ends (the daemon drops the task serving it) is
/// recorded all the same, allowed, with why it closed: no attempt goes unlogged.
#[tokio::test]
async fn a_tunnel_cut_when_its_command_ends_is_still_recorded() {
    let listener = TcpListener::bind((LOOPBACK, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let _ = stream.write_all(b"hello\n").await;
                // Held open until the other side goes.
                let mut rest = Vec::new();
                let _ = stream.read_to_end(&mut rest).await;
            });
        }
    });
    let Setup { engine, ctx, sink } = banner_setup(Limits::default());
    let (mut ours, theirs) = tokio::net::UnixStream::pair().unwrap();
    let task =
        tokio::spawn(async move { engine.serve_tcp(ctx, theirs, "banner.test", port).await });
    let mut hello = [0u8; 6];
    ours.read_exact(&mut hello).await.unwrap();
    assert_eq!(&hello, b"hello\n");
    assert!(sink.0.lock().unwrap().is_empty(), "recorded while open");
    // The command ends: the daemon drops its connections' tasks.
    task.abort();
    let records = sink.all(1).await;
    assert_eq!(records.len(), 1, "{records:?}");
    let record = &records[0];
    assert_eq!(record["allowed"], true, "{record}");
    assert_eq!(record["code"], "allowed", "{record}");
    assert_eq!(record["error"], "closed: its command ended", "{record}");
    assert_eq!(record["bytes_down"], 6, "{record}");
}
