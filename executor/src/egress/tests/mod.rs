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

use super::record::{DecisionRecord, DecisionSink};
use super::resolve::{OverrideResolver, Resolver};
use super::{CommandContext, Engine, Limits};

mod connect;
mod http;
mod resolve;
mod tcp;

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
    /// Every record, once there are at least `n` (a tunnel's is written when it closes).
    async fn all(&self, n: usize) -> Vec<Value> {
        for _ in 0..800 {
            let records = self.0.lock().unwrap().clone();
            if records.len() >= n {
                return records;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("fewer than {n} records: {:?}", self.0.lock().unwrap());
    }

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
    let mut rules: Vec<&str> = allow.to_vec();
    let mut more = Vec::new();
    extra(addr, &mut more);
    rules.extend(more.iter().map(String::as_str));
    let own = if own { vec![addr] } else { Vec::new() };
    let resolver = names(&["web.test", "secure.test", "other.test"]);
    let Setup { engine, ctx, sink } = setup(&rules, resolver, own, Limits::default());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let engine = engine.clone();
            let ctx = ctx.clone();
            tokio::spawn(async move { engine.serve_proxy(ctx, stream).await });
        }
    });
    Proxy { addr, sink }
}

/// An engine and one command whose policy (one layer, the profile's) allows `allow`.
struct Setup {
    engine: Arc<Engine>,
    ctx: Arc<CommandContext>,
    sink: Arc<MemorySink>,
}

fn setup(
    allow: &[&str],
    resolver: Arc<dyn Resolver>,
    own: Vec<SocketAddr>,
    limits: Limits,
) -> Setup {
    let sink = Arc::new(MemorySink::default());
    let engine = Arc::new(Engine {
        resolver,
        sink: sink.clone(),
        own_listeners: own,
        limits,
    });
    let policy = Policy {
        allow: allow.iter().map(|r| r.parse().unwrap()).collect(),
        deny: Vec::new(),
    };
    let ctx = Arc::new(context(Effective::combine([(
        Layer::Profile,
        &Mode::Policy(policy),
    )])));
    Setup { engine, ctx, sink }
}

/// A resolver answering 127.0.0.1 for `names`, and nothing else.
fn names(names: &[&str]) -> Arc<dyn Resolver> {
    let mut resolver = OverrideResolver::new(None);
    for name in names {
        resolver.set(name, vec![LOOPBACK]);
    }
    Arc::new(resolver)
}

impl Setup {
    /// Plain TCP by name over a Unix socket (as a namespace's bridge would hand it over):
    /// send `request`, then read until the proxy closes.
    async fn tcp(&self, host: &str, port: u16, request: &[u8]) -> String {
        let (mut ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let (engine, ctx, host) = (self.engine.clone(), self.ctx.clone(), host.to_string());
        tokio::spawn(async move { engine.serve_tcp(ctx, theirs, &host, port).await });
        ours.write_all(request).await.unwrap();
        read_all(&mut ours).await
    }

    /// A proxy connection over a Unix socket: send `request`, read until the proxy closes.
    async fn proxied(&self, request: &str) -> String {
        let (mut ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let (engine, ctx) = (self.engine.clone(), self.ctx.clone());
        tokio::spawn(async move { engine.serve_proxy(ctx, theirs).await });
        ours.write_all(request.as_bytes()).await.unwrap();
        read_all(&mut ours).await
    }
}

async fn read_all<S: AsyncRead + Unpin>(stream: &mut S) -> String {
    let mut got = Vec::new();
    // A refusal may close with our request unread: a reset is an end like any other.
    let _ = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut got))
        .await
        .expect("the proxy closes");
    String::from_utf8_lossy(&got).into_owned()
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
    read_all(&mut stream).await
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
