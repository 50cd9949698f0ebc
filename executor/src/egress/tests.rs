//! The proxy against real sockets on loopback: a tiny HTTP server and a TLS server stand for
//! the internet, names are given by an override resolver (nothing leaves the machine). The
//! policies name `127.0.0.0/8` by CIDR where loopback targets are to be reached; each denial
//! sits beside its allowed control, and each attempt is found in the decision records.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sandbox::network::{Effective, Layer, Mode, Policy};
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::record::{DecisionRecord, DecisionSink, JsonLinesFile};
use super::resolve::{OverrideResolver, Resolver, SystemResolver};
use super::{CommandContext, Engine, Limits};

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

#[derive(Default)]
struct MemorySink(Mutex<Vec<Value>>);

impl DecisionSink for MemorySink {
    fn record(&self, record: &DecisionRecord) {
        let value = serde_json::from_str(&record.json_line()).unwrap();
        self.0.lock().unwrap().push(value);
    }
}

impl MemorySink {
    /// The record of the attempt on `host`:`port`, waiting for it to be written (a tunnel's
    /// is written when it closes).
    async fn find(&self, host: &str, port: u16) -> Value {
        for _ in 0..800 {
            let found = self
                .0
                .lock()
                .unwrap()
                .iter()
                .find(|r| r["host"] == host && r["port"] == port)
                .cloned();
            if let Some(found) = found {
                return found;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!(
            "no record for {host}:{port} in {:?}",
            self.0.lock().unwrap()
        );
    }
}

struct Proxy {
    addr: SocketAddr,
    sink: Arc<MemorySink>,
}

/// A proxy on loopback for a command whose policy allows `allow` (one layer, the profile's);
/// `web.test`, `secure.test` and `other.test` resolve to 127.0.0.1. With `own`, the proxy's
/// own address is one of the daemon's listeners.
async fn proxy(allow: &[&str], own: bool) -> Proxy {
    proxy_with(allow, own, |_, _| {}).await
}

/// [`proxy`], with `extra` adding rules that name the proxy's own address.
async fn proxy_with(
    allow: &[&str],
    own: bool,
    extra: impl FnOnce(SocketAddr, &mut Vec<String>),
) -> Proxy {
    let listener = TcpListener::bind((LOOPBACK, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut rules: Vec<String> = allow.iter().map(|r| r.to_string()).collect();
    extra(addr, &mut rules);
    let policy = Policy {
        allow: rules.iter().map(|r| r.parse().unwrap()).collect(),
        deny: Vec::new(),
    };
    let mut resolver = OverrideResolver::new(None);
    for name in ["web.test", "secure.test", "other.test"] {
        resolver.set(name, vec![LOOPBACK]);
    }
    let sink = Arc::new(MemorySink::default());
    let engine = Arc::new(Engine {
        resolver: Arc::new(resolver),
        sink: sink.clone(),
        own_listeners: if own { vec![addr] } else { Vec::new() },
        limits: Limits::default(),
    });
    let ctx = Arc::new(context(Effective::combine([(
        Layer::Profile,
        &Mode::Policy(policy),
    )])));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let engine = engine.clone();
            let ctx = ctx.clone();
            tokio::spawn(async move { engine.serve_proxy(ctx, stream).await });
        }
    });
    Proxy { addr, sink }
}

fn context(policy: Effective) -> CommandContext {
    CommandContext {
        client: "alice".into(),
        session: "s1".into(),
        command: "c7".into(),
        policy: Arc::new(policy),
    }
}

/// A web server answering every request with `hello`; the request heads it received.
async fn web_server() -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind((LOOPBACK, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = heads.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let head = read_head(&mut stream).await;
                if head.is_empty() {
                    return;
                }
                seen.lock().unwrap().push(head);
                let answer =
                    "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello";
                let _ = stream.write_all(answer.as_bytes()).await;
            });
        }
    });
    (port, heads)
}

async fn read_head<S: AsyncRead + Unpin>(stream: &mut S) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// A TLS server for `secure.test` that says `hello tls` after the handshake; its certificate.
async fn tls_server() -> (u16, rustls::pki_types::CertificateDer<'static>) {
    let certified = rcgen::generate_simple_self_signed(vec!["secure.test".to_string()]).unwrap();
    let der = certified.cert.der().clone();
    let key =
        rustls::pki_types::PrivateKeyDer::try_from(certified.signing_key.serialize_der()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![der.clone()], key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind((LOOPBACK, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                if let Ok(mut tls) = acceptor.accept(stream).await {
                    let _ = tls.write_all(b"hello tls").await;
                    let _ = tls.shutdown().await;
                }
            });
        }
    });
    (port, der)
}

/// Send `request` to the proxy and read the whole answer (requests say `Connection: close`).
async fn exchange(proxy: SocketAddr, request: &str) -> String {
    let mut stream = TcpStream::connect(proxy).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer))
        .await
        .expect("the proxy answers and closes")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

fn get(url: &str, host: &str) -> String {
    format!("GET {url} HTTP/1.1\r\nHost: {host}\r\nProxy-Connection: keep-alive\r\nConnection: close\r\n\r\n")
}

/// CONNECT through the proxy: the status line and the stream, for the tunnel.
async fn connect(proxy: SocketAddr, target: &str) -> (String, TcpStream) {
    let mut stream = TcpStream::connect(proxy).await.unwrap();
    let request = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let head = read_head(&mut stream).await;
    (head, stream)
}

/// A TLS handshake over `stream` for `sni`, trusting `ca`; what the server says.
async fn tls_hello(
    stream: TcpStream,
    sni: &str,
    ca: &rustls::pki_types::CertificateDer<'static>,
) -> std::io::Result<String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let name = rustls::pki_types::ServerName::try_from(sni.to_string()).unwrap();
    let mut tls = connector.connect(name, stream).await?;
    let mut said = String::new();
    tls.read_to_string(&mut said).await?;
    Ok(said)
}

fn status(answer: &str) -> &str {
    answer.split("\r\n").next().unwrap_or_default()
}

#[track_caller]
fn assert_denied(record: &Value, code: &str) {
    assert_eq!(record["allowed"], false, "{record}");
    assert_eq!(record["code"], code, "{record}");
    assert_eq!(record["bytes_up"], 0, "{record}");
    assert_eq!(record["bytes_down"], 0, "{record}");
    assert!(
        !record["reason"].as_str().unwrap_or_default().is_empty(),
        "{record}"
    );
}

#[tokio::test]
async fn an_http_request_reaches_an_allowed_name_and_another_name_is_refused() {
    let (port, heads) = web_server().await;
    let proxy = proxy(&["web.test", "127.0.0.0/8"], false).await;
    let url = format!("http://web.test:{port}/hello?x=1");
    let answer = exchange(proxy.addr, &get(&url, &format!("web.test:{port}"))).await;
    assert_eq!(status(&answer), "HTTP/1.1 200 OK", "{answer}");
    assert!(answer.ends_with("hello"), "{answer}");
    let head = heads.lock().unwrap()[0].clone();
    // Sent on in origin form, without the proxy's own headers.
    assert!(head.starts_with("GET /hello?x=1 HTTP/1.1\r\n"), "{head}");
    assert!(
        !head.to_ascii_lowercase().contains("proxy-connection"),
        "{head}"
    );
    let record = proxy.sink.find("web.test", port).await;
    assert_eq!(record["allowed"], true, "{record}");
    assert_eq!(record["code"], "allowed");
    assert_eq!(record["kind"], "http");
    assert_eq!(record["rule"], "web.test");
    assert_eq!(record["layer"], "profile");
    assert_eq!(record["address"], format!("127.0.0.1:{port}"));
    assert_eq!(
        (&record["client"], &record["session"], &record["command"]),
        (&"alice".into(), &"s1".into(), &"c7".into())
    );
    assert!(record["bytes_up"].as_u64().unwrap() > 20, "{record}");
    assert!(record["bytes_down"].as_u64().unwrap() > 20, "{record}");
    assert!(record["duration_ms"].as_f64().unwrap() >= 0.0);
    assert!(record["ts"].as_str().unwrap().ends_with('Z'), "{record}");

    // User info in the URI stays out of the Host sent on.
    let url = format!("http://user:secret@web.test:{port}/");
    let answer = exchange(proxy.addr, &get(&url, &format!("web.test:{port}"))).await;
    assert_eq!(status(&answer), "HTTP/1.1 200 OK", "{answer}");
    let head = heads.lock().unwrap()[1].clone();
    assert!(!head.contains("secret"), "{head}");

    // Denied: a name no rule allows (it resolves to the same server). Nothing reaches it.
    let url = format!("http://other.test:{port}/");
    let answer = exchange(proxy.addr, &get(&url, &format!("other.test:{port}"))).await;
    assert_eq!(status(&answer), "HTTP/1.1 403 Forbidden", "{answer}");
    assert!(answer.contains("no allow rule covers"), "{answer}");
    assert_eq!(heads.lock().unwrap().len(), 2);
    let record = proxy.sink.find("other.test", port).await;
    assert_denied(&record, "not_allowed");
    assert_eq!(record["kind"], "http");
}

#[tokio::test]
async fn an_ip_literal_is_reached_only_through_a_cidr_rule() {
    let (port, heads) = web_server().await;
    let proxy = proxy(&["web.test", "127.0.0.0/8"], false).await;
    // Denied: an address no rule covers (TEST-NET-1, never dialed).
    let answer = exchange(
        proxy.addr,
        &get(
            &format!("http://192.0.2.1:{port}/"),
            &format!("192.0.2.1:{port}"),
        ),
    )
    .await;
    assert_eq!(status(&answer), "HTTP/1.1 403 Forbidden", "{answer}");
    assert_denied(&proxy.sink.find("192.0.2.1", port).await, "not_allowed");
    // Control: the loopback address the CIDR rule names.
    let answer = exchange(
        proxy.addr,
        &get(
            &format!("http://127.0.0.1:{port}/"),
            &format!("127.0.0.1:{port}"),
        ),
    )
    .await;
    assert_eq!(status(&answer), "HTTP/1.1 200 OK", "{answer}");
    let record = proxy.sink.find("127.0.0.1", port).await;
    assert_eq!(
        (&record["allowed"], &record["rule"]),
        (&true.into(), &"127.0.0.0/8".into()),
        "{record}"
    );
    assert_eq!(heads.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn a_name_resolving_to_loopback_is_refused_without_the_cidr_rule() {
    let (port, heads) = web_server().await;
    let request = get(
        &format!("http://web.test:{port}/"),
        &format!("web.test:{port}"),
    );
    let bare = proxy(&["web.test"], false).await;
    let answer = exchange(bare.addr, &request).await;
    assert_eq!(status(&answer), "HTTP/1.1 403 Forbidden", "{answer}");
    assert!(answer.contains("loopback"), "{answer}");
    let record = bare.sink.find("web.test", port).await;
    assert_denied(&record, "special_address");
    assert_eq!(record["address"], format!("127.0.0.1:{port}"));
    assert!(heads.lock().unwrap().is_empty());
    // Control: the same name with loopback named by CIDR.
    let named = proxy(&["web.test", "127.0.0.0/8"], false).await;
    assert_eq!(
        status(&exchange(named.addr, &request).await),
        "HTTP/1.1 200 OK"
    );
    assert_eq!(named.sink.find("web.test", port).await["allowed"], true);
}

#[tokio::test]
async fn a_host_header_naming_another_host_than_the_uri_is_refused() {
    let (port, heads) = web_server().await;
    let proxy = proxy(&["web.test", "other.test", "127.0.0.0/8"], false).await;
    let url = format!("http://web.test:{port}/");
    for host in [
        format!("other.test:{port}"),
        "web.test".to_string(),
        format!("web.test:{}", port + 1),
    ] {
        let answer = exchange(proxy.addr, &get(&url, &host)).await;
        assert_eq!(
            status(&answer),
            "HTTP/1.1 403 Forbidden",
            "Host {host}: {answer}"
        );
        assert!(answer.contains("Host header"), "{answer}");
    }
    assert_denied(&proxy.sink.find("web.test", port).await, "host_mismatch");
    assert!(heads.lock().unwrap().is_empty());
    // Control: the Host the URI names (case and trailing dot aside).
    let answer = exchange(proxy.addr, &get(&url, &format!("WEB.test.:{port}"))).await;
    assert_eq!(status(&answer), "HTTP/1.1 200 OK", "{answer}");
    assert_eq!(heads.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn connect_passes_tls_through_and_refuses_a_client_hello_naming_another_host() {
    let (port, ca) = tls_server().await;
    let proxy = proxy(&["secure.test", "127.0.0.0/8"], false).await;
    let target = format!("secure.test:{port}");
    let (head, stream) = connect(proxy.addr, &target).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // The handshake is end to end: the client verifies the server's own certificate.
    assert_eq!(
        tls_hello(stream, "secure.test", &ca).await.unwrap(),
        "hello tls"
    );
    let record = proxy.sink.find("secure.test", port).await;
    assert_eq!(
        (&record["allowed"], &record["kind"]),
        (&true.into(), &"connect".into()),
        "{record}"
    );
    assert!(record["bytes_up"].as_u64().unwrap() > 100, "{record}");
    assert!(record["bytes_down"].as_u64().unwrap() > 100, "{record}");

    // Denied: an SNI other than the CONNECT host (an allowed tunnel, a fronted name).
    let sneaky = self::proxy(&["secure.test", "127.0.0.0/8"], false).await;
    let (head, stream) = connect(sneaky.addr, &target).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(tls_hello(stream, "other.test", &ca).await.is_err());
    let record = sneaky.sink.find("secure.test", port).await;
    assert_eq!(record["allowed"], false, "{record}");
    assert_eq!(record["code"], "sni_mismatch", "{record}");
    assert!(
        record["reason"].as_str().unwrap().contains("other.test"),
        "{record}"
    );
    assert_eq!(
        record["bytes_up"], 0,
        "the ClientHello was not sent on: {record}"
    );

    // Denied: CONNECT to a name no rule allows, answered 403 with the reason.
    let (head, _) = connect(sneaky.addr, &format!("other.test:{port}")).await;
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    assert_denied(&sneaky.sink.find("other.test", port).await, "not_allowed");
}

#[tokio::test]
async fn connect_to_the_daemons_own_listener_is_refused_unless_a_rule_names_it() {
    let (web_port, _) = web_server().await;
    let proxy = proxy(&["127.0.0.0/8"], true).await;
    let own = proxy.addr;
    let (head, _) = connect(own, &own.to_string()).await;
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    let record = proxy.sink.find("127.0.0.1", own.port()).await;
    assert_denied(&record, "own_listener");
    assert_eq!(record["address"], own.to_string());
    // Controls: another port of the same address, and a rule naming the listener exactly.
    let (head, _) = connect(own, &format!("127.0.0.1:{web_port}")).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let named = proxy_with(&["127.0.0.0/8"], true, |own, rules| {
        rules.push(own.to_string())
    })
    .await;
    let (head, _) = connect(named.addr, &named.addr.to_string()).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let record = named.sink.find("127.0.0.1", named.addr.port()).await;
    assert_eq!(record["rule"], named.addr.to_string(), "{record}");
}

#[tokio::test]
async fn plain_tcp_by_name_is_relayed_when_allowed_and_closed_when_not() {
    let (port, heads) = web_server().await;
    let resolver = {
        let mut r = OverrideResolver::new(None);
        r.set("web.test", vec![LOOPBACK])
            .set("other.test", vec![LOOPBACK]);
        r
    };
    let sink = Arc::new(MemorySink::default());
    let engine = Arc::new(Engine {
        resolver: Arc::new(resolver),
        sink: sink.clone(),
        own_listeners: Vec::new(),
        limits: Limits::default(),
    });
    let policy = Policy {
        allow: vec!["web.test".parse().unwrap(), "127.0.0.0/8".parse().unwrap()],
        deny: Vec::new(),
    };
    let ctx = Arc::new(context(Effective::combine([(
        Layer::Profile,
        &Mode::Policy(policy),
    )])));
    // Over a Unix socket, as a namespace's bridge would hand it over.
    let run = |host: &'static str, request: String| {
        let (mut ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let engine = engine.clone();
        let ctx = ctx.clone();
        tokio::spawn(async move { engine.serve_tcp(ctx, theirs, host, port).await });
        async move {
            ours.write_all(request.as_bytes()).await.unwrap();
            let mut answer = String::new();
            let _ = tokio::time::timeout(Duration::from_secs(30), ours.read_to_string(&mut answer))
                .await
                .unwrap();
            answer
        }
    };
    let ask = |host: &str| format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
    let answer = run("web.test", ask("web.test")).await;
    assert!(answer.ends_with("hello"), "{answer}");
    let record = sink.find("web.test", port).await;
    assert_eq!(
        (&record["allowed"], &record["kind"]),
        (&true.into(), &"tcp".into()),
        "{record}"
    );
    assert!(record["bytes_down"].as_u64().unwrap() > 20, "{record}");
    // Denied: another name, closed without an answer.
    assert_eq!(run("other.test", ask("other.test")).await, "");
    assert_denied(&sink.find("other.test", port).await, "not_allowed");
    assert_eq!(heads.lock().unwrap().len(), 1);
    // Denied: an allowed name whose first request names another host.
    let answer = run("web.test", ask("other.test")).await;
    assert_eq!(answer, "");
    assert_eq!(heads.lock().unwrap().len(), 1);
    let records = sink.0.lock().unwrap().clone();
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

#[test]
fn decision_records_are_appended_to_a_file_one_json_line_each() {
    let path = std::env::temp_dir().join(format!("egress-log-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let file = JsonLinesFile::open(&path).unwrap();
    let mut record = DecisionRecord {
        ts: "2026-01-01T00:00:00.000Z".into(),
        client: "alice".into(),
        session: "s1".into(),
        command: "c1".into(),
        kind: "connect",
        host: "pypi.org".into(),
        port: 443,
        address: Some("151.101.0.223:443".into()),
        layer: Some(Layer::Request),
        rule: Some("pypi.org:443".into()),
        allowed: true,
        code: "allowed",
        reason: "allowed by rule".into(),
        error: None,
        bytes_up: 517,
        bytes_down: 4096,
        duration_ms: 12.5,
    };
    file.record(&record);
    record.host = "evil.org".into();
    record.allowed = false;
    file.record(&record);
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["host"], "pypi.org");
    assert_eq!(lines[0]["layer"], "request");
    assert_eq!(lines[1]["allowed"], false);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    std::fs::remove_file(&path).unwrap();
}

/// Generic over the stream: the proxy serves a Unix socket as it serves TCP.
#[tokio::test]
async fn the_proxy_serves_a_unix_socket() {
    let (port, _) = web_server().await;
    let mut resolver = OverrideResolver::new(None);
    resolver.set("web.test", vec![LOOPBACK]);
    let sink = Arc::new(MemorySink::default());
    let engine = Arc::new(Engine {
        resolver: Arc::new(resolver),
        sink: sink.clone(),
        own_listeners: Vec::new(),
        limits: Limits::default(),
    });
    let policy = Policy {
        allow: vec!["web.test".parse().unwrap(), "127.0.0.0/8".parse().unwrap()],
        deny: Vec::new(),
    };
    let ctx = Arc::new(context(Effective::combine([(
        Layer::Profile,
        &Mode::Policy(policy),
    )])));
    let (mut ours, theirs) = tokio::net::UnixStream::pair().unwrap();
    tokio::spawn(async move { engine.serve_proxy(ctx, theirs).await });
    let request = get(
        &format!("http://web.test:{port}/"),
        &format!("web.test:{port}"),
    );
    ours.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    ours.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert_eq!(sink.find("web.test", port).await["allowed"], true);
}

#[tokio::test]
async fn the_system_resolver_reads_the_hosts_file() {
    let addrs = SystemResolver::default()
        .resolve("localhost", 80)
        .await
        .unwrap();
    assert!(
        addrs.iter().all(|a| a.is_loopback()) && !addrs.is_empty(),
        "{addrs:?}"
    );
    // Control: the override resolver answers only the names it was given.
    let mut resolver = OverrideResolver::new(None);
    resolver.set("Web.Test.", vec![LOOPBACK]);
    assert_eq!(
        resolver.resolve("web.test", 80).await.unwrap(),
        vec![LOOPBACK]
    );
    assert!(resolver.resolve("localhost", 80).await.is_err());
}

/// Whether the decision on a CONNECT allowed it, by its record: the tunnel may still fail
/// where the host has no IPv6 (502), which the decision does not depend on.
async fn connect_decision(proxy: &Proxy, target: &str, host: &str, port: u16) -> (String, Value) {
    let (head, _) = connect(proxy.addr, target).await;
    (status(&head).to_string(), proxy.sink.find(host, port).await)
}

#[tokio::test]
async fn ipv6_and_ipv4_mapped_literals_are_judged_like_the_addresses_they_reach() {
    let (port, _) = web_server().await;
    let v4 = proxy(&["web.test", "127.0.0.0/8"], false).await;
    // IPv6 loopback: 127.0.0.0/8 does not cover it, and ::/0 does not name it.
    let (status, record) = connect_decision(&v4, &format!("[::1]:{port}"), "::1", port).await;
    assert_eq!(status, "HTTP/1.1 403 Forbidden");
    assert_denied(&record, "not_allowed");
    let all6 = proxy(&["::/0"], false).await;
    let (status, record) = connect_decision(&all6, &format!("[::1]:{port}"), "::1", port).await;
    assert_eq!(status, "HTTP/1.1 403 Forbidden");
    assert_denied(&record, "special_address");
    // An IPv6 address no rule covers.
    let (status, record) =
        connect_decision(&v4, &format!("[2001:db8::1]:{port}"), "2001:db8::1", port).await;
    assert_eq!(status, "HTTP/1.1 403 Forbidden");
    assert_denied(&record, "not_allowed");
    // Control: a rule naming ::1 allows it.
    let v6 = proxy(&["::1"], false).await;
    let (_, record) = connect_decision(&v6, &format!("[::1]:{port}"), "::1", port).await;
    assert_eq!(
        (&record["allowed"], &record["rule"]),
        (&true.into(), &"::1".into()),
        "{record}"
    );

    // 127.0.0.1 written as IPv4-mapped IPv6 is loopback: refused under rules for every
    // public address of both families ...
    let mapped = "::ffff:127.0.0.1";
    let bare = proxy(&["0.0.0.0/0", "::/0"], false).await;
    let (status, record) =
        connect_decision(&bare, &format!("[{mapped}]:{port}"), mapped, port).await;
    assert_eq!(status, "HTTP/1.1 403 Forbidden");
    assert_denied(&record, "special_address");
    // ... and allowed by the rule naming loopback (control).
    let (_, record) = connect_decision(&v4, &format!("[{mapped}]:{port}"), mapped, port).await;
    assert_eq!(
        (&record["allowed"], &record["rule"]),
        (&true.into(), &"127.0.0.0/8".into()),
        "{record}"
    );
}

/// Answers 127.0.0.1 and 10.0.0.1 by turns, as a name that rebinds between lookups.
struct Rebinding(std::sync::atomic::AtomicBool);

impl Resolver for Rebinding {
    fn resolve<'a>(&'a self, _: &'a str, _: u16) -> super::resolve::Lookup<'a> {
        let second = self.0.fetch_xor(true, std::sync::atomic::Ordering::SeqCst);
        let addr = if !second {
            LOOPBACK
        } else {
            IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))
        };
        Box::pin(async move { Ok(vec![addr]) })
    }
}

#[tokio::test]
async fn every_lookup_is_judged_so_a_name_that_rebinds_is_refused_at_its_new_address() {
    let (port, heads) = web_server().await;
    let sink = Arc::new(MemorySink::default());
    let engine = Arc::new(Engine {
        resolver: Arc::new(Rebinding(Default::default())),
        sink: sink.clone(),
        own_listeners: Vec::new(),
        limits: Limits::default(),
    });
    let policy = Policy {
        allow: vec!["web.test".parse().unwrap(), "127.0.0.0/8".parse().unwrap()],
        deny: Vec::new(),
    };
    let ctx = Arc::new(context(Effective::combine([(
        Layer::Profile,
        &Mode::Policy(policy),
    )])));
    let request = get(
        &format!("http://web.test:{port}/"),
        &format!("web.test:{port}"),
    );
    let mut answers = Vec::new();
    for _ in 0..2 {
        let (mut ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let (engine, ctx) = (engine.clone(), ctx.clone());
        tokio::spawn(async move { engine.serve_proxy(ctx, theirs).await });
        ours.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        ours.read_to_string(&mut answer).await.unwrap();
        answers.push(status(&answer).to_string());
    }
    // The first lookup (loopback, named) is the control; the second (private) is refused.
    assert_eq!(answers, ["HTTP/1.1 200 OK", "HTTP/1.1 403 Forbidden"]);
    assert_eq!(heads.lock().unwrap().len(), 1);
    for _ in 0..800 {
        if sink.0.lock().unwrap().len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let records = sink.0.lock().unwrap().clone();
    assert_eq!(records.len(), 2, "{records:?}");
    let refused = records.iter().find(|r| r["allowed"] == false).unwrap();
    assert_eq!(refused["code"], "special_address", "{refused}");
    assert_eq!(refused["address"], format!("10.0.0.1:{port}"));
}

#[tokio::test]
async fn a_connect_whose_host_header_names_another_host_is_refused() {
    let (port, _) = web_server().await;
    let proxy = proxy(&["web.test", "127.0.0.0/8"], false).await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let request = format!("CONNECT web.test:{port} HTTP/1.1\r\nHost: other.test:{port}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let head = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    assert_denied(&proxy.sink.find("web.test", port).await, "host_mismatch");
    // Control: the same CONNECT with its own Host.
    let (head, _) = connect(proxy.addr, &format!("web.test:{port}")).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
}

/// An engine for plain TCP by name to `banner.test` (127.0.0.1), with `limits`.
fn tcp_engine(limits: Limits) -> (Arc<Engine>, Arc<CommandContext>, Arc<MemorySink>) {
    let mut resolver = OverrideResolver::new(None);
    resolver.set("banner.test", vec![LOOPBACK]);
    let sink = Arc::new(MemorySink::default());
    let engine = Arc::new(Engine {
        resolver: Arc::new(resolver),
        sink: sink.clone(),
        own_listeners: Vec::new(),
        limits,
    });
    let policy = Policy {
        allow: vec![
            "banner.test".parse().unwrap(),
            "127.0.0.0/8".parse().unwrap(),
        ],
        deny: Vec::new(),
    };
    let ctx = Arc::new(context(Effective::combine([(
        Layer::Profile,
        &Mode::Policy(policy),
    )])));
    (engine, ctx, sink)
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

#[tokio::test]
async fn a_server_that_speaks_first_is_heard_while_the_first_message_is_awaited() {
    let port = banner_server().await;
    let (engine, ctx, sink) = tcp_engine(Limits::default());
    let (mut ours, theirs) = tokio::net::UnixStream::pair().unwrap();
    tokio::spawn(async move { engine.serve_tcp(ctx, theirs, "banner.test", port).await });
    let mut banner = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(30), ours.read_exact(&mut banner))
        .await
        .expect("the banner comes before the command says anything")
        .unwrap();
    assert_eq!(&banner, b"220 banner\r\n");
    ours.write_all(b"EHLO me\r\n").await.unwrap();
    let mut echo = String::new();
    ours.read_to_string(&mut echo).await.unwrap();
    assert_eq!(echo, "EHLO me\r\n");
    // The record is written when both directions are done.
    drop(ours);
    let record = sink.find("banner.test", port).await;
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
    let limits = Limits {
        first_bytes: Duration::from_millis(300),
        max_head: 8192,
        ..Limits::default()
    };
    let (engine, ctx, sink) = tcp_engine(limits);
    let run = |request: Vec<u8>| {
        let (mut ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let (engine, ctx) = (engine.clone(), ctx.clone());
        tokio::spawn(async move { engine.serve_tcp(ctx, theirs, "banner.test", port).await });
        async move {
            ours.write_all(&request).await.unwrap();
            let mut got = Vec::new();
            // Ends when the proxy closes (the stream is kept open by us meanwhile).
            let _ = tokio::time::timeout(Duration::from_secs(30), ours.read_to_end(&mut got))
                .await
                .unwrap();
            String::from_utf8_lossy(&got).into_owned()
        }
    };
    // A request head begun and never finished.
    run(b"GET / HTTP/1.1\r\nHost: banner.test\r\n".to_vec()).await;
    // A request head past the limit.
    let mut long = b"GET / HTTP/1.1\r\nX-Pad: ".to_vec();
    long.extend(std::iter::repeat_n(b'a', 9000));
    run(long).await;
    // Control: a whole, short head passes (the server echoes what it reads).
    let answer = run(b"GET / HTTP/1.1\r\nHost: banner.test\r\n\r\n".to_vec()).await;
    assert!(answer.contains("GET / HTTP/1.1"), "{answer}");
    for _ in 0..800 {
        if sink.0.lock().unwrap().len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let codes: Vec<Value> = sink
        .0
        .lock()
        .unwrap()
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
    fn resolve<'a>(&'a self, _: &'a str, _: u16) -> super::resolve::Lookup<'a> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move { Ok(vec![LOOPBACK]) })
    }
}

#[tokio::test]
async fn a_name_the_policy_refuses_is_never_looked_up() {
    let (port, _) = web_server().await;
    let resolver = Arc::new(Counting::default());
    let sink = Arc::new(MemorySink::default());
    let engine = Arc::new(Engine {
        resolver: resolver.clone(),
        sink: sink.clone(),
        own_listeners: Vec::new(),
        limits: Limits::default(),
    });
    let policy = Policy {
        allow: vec!["web.test".parse().unwrap(), "127.0.0.0/8".parse().unwrap()],
        deny: Vec::new(),
    };
    let ctx = Arc::new(context(Effective::combine([(
        Layer::Profile,
        &Mode::Policy(policy),
    )])));
    let lookups = || resolver.0.load(std::sync::atomic::Ordering::SeqCst);
    // Denied: a name carrying data out (a lookup would reach the name's DNS server).
    let (mut ours, theirs) = tokio::net::UnixStream::pair().unwrap();
    let (e, c) = (engine.clone(), ctx.clone());
    tokio::spawn(async move { e.serve_tcp(c, theirs, "secret-data.evil.test", port).await });
    let mut got = Vec::new();
    ours.read_to_end(&mut got).await.unwrap();
    assert_denied(
        &sink.find("secret-data.evil.test", port).await,
        "not_allowed",
    );
    assert_eq!(lookups(), 0);
    // Control: the allowed name is looked up.
    let (mut ours, theirs) = tokio::net::UnixStream::pair().unwrap();
    tokio::spawn(async move { engine.serve_tcp(ctx, theirs, "web.test", port).await });
    ours.write_all(b"GET / HTTP/1.1\r\nHost: web.test\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    ours.read_to_string(&mut answer).await.unwrap();
    assert!(answer.ends_with("hello"), "{answer}");
    assert_eq!(lookups(), 1);
}

#[test]
fn an_authority_names_the_target_only_with_the_same_host_and_port() {
    use super::authority_matches;
    use sandbox::network::Host;
    let web = Host::parse("web.test").unwrap();
    let v6 = Host::parse("::1").unwrap();
    assert!(authority_matches(b"web.test:8080", &web, 8080, Some(80)));
    assert!(authority_matches(b"WEB.test.:8080", &web, 8080, Some(80)));
    assert!(authority_matches(b"web.test", &web, 80, Some(80)));
    assert!(
        authority_matches(b"web.test", &web, 8080, None),
        "a tunnel's port is fixed"
    );
    assert!(authority_matches(b"[::1]:443", &v6, 443, None));
    for (value, port) in [
        (&b"web.test"[..], 8080),
        (b"web.test:8081", 8080),
        (b"other.test:8080", 8080),
        (b"user@web.test:8080", 8080),
        (b"web.test:8080/x", 8080),
        (b"\xffweb.test", 8080),
        (b"", 8080),
    ] {
        let text = String::from_utf8_lossy(value);
        assert!(
            !authority_matches(value, &web, port, Some(80)),
            "{text}:{port}"
        );
    }
    assert!(!authority_matches(b"[::2]:443", &v6, 443, None));
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
    let (_, ctx, _) = tcp_engine(Limits::default());
    let mut resolver = OverrideResolver::new(None);
    resolver.set("banner.test", vec![LOOPBACK]);
    let sink = Arc::new(SlowSink {
        delay: Duration::from_millis(300),
        inner: MemorySink::default(),
    });
    let engine = Arc::new(Engine {
        resolver: Arc::new(resolver),
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
