//! The daemon's listeners inside a command's network namespace.
//!
//! **Why a thread may enter the namespace.** `setns(CLONE_NEWNET)` changes the network
//! namespace of the calling thread only, and a socket belongs for good to the namespace it
//! was created in. So a short-lived std thread of ours (never a tokio worker, whose later
//! tasks would all run in the command's namespace) enters it, creates and binds the
//! listeners, and ends; the sockets stay in the command's namespace while the daemon's
//! runtime serves them from its own (Go's netns pattern). This is neither an unshare nor a
//! fork in the tokio process (style.md, practice 3): no process-wide state changes, and the
//! thread that changed is gone before its sockets are used.
//!
//! **When.** The fork server's answer names the command's init; it makes the namespace (and
//! brings its loopback up) while it builds the sandbox, and its payload execs nothing until
//! the daemon writes the command line. So the daemon opens `/proc/<init>/ns/net` until it is
//! no longer its own namespace, binds there (retrying while loopback is not up yet), and only
//! then writes the command line: the command never runs without its listeners.

use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sched::CloneFlags;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::dns::{Resolver, Synthetic};
use super::log::Tally;
use super::{Enforcer, PROXY_PORT};
use crate::egress::record::DecisionRecord;
use crate::egress::CommandContext;

/// How long the sandbox may take to make its namespace and bring loopback up.
const NAMESPACE_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections one command may have open through its listeners at once.
const MAX_CONNECTIONS: usize = 256;
/// How long to wait before accepting again after an error.
const ACCEPT_RETRY: Duration = Duration::from_millis(10);
/// Largest DNS message over UDP we read.
const MAX_DNS_MESSAGE: usize = 4096;
/// How long a DNS-over-TCP connection may wait for its next query (RFC 7766 suggests seconds).
const DNS_TCP_IDLE: Duration = Duration::from_secs(10);

/// The sockets bound in the command's namespace, not yet served.
struct Bound {
    proxy: std::net::TcpListener,
    dns: std::net::UdpSocket,
    dns_tcp: std::net::TcpListener,
    captures: Vec<(u16, std::net::TcpListener)>,
}

/// Wait for `pid`'s network namespace to be another than ours, then bind the listeners in it,
/// both on a thread of their own: the command waits for its listeners, so the wait polls
/// finer than tokio's timer (1 ms) can.
async fn bind_in(pid: u32, ports: Vec<u16>) -> io::Result<Bound> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("egress-bind".into())
        .spawn(move || {
            let start = Instant::now();
            let bound = namespace_of(pid, start).and_then(|ns| bind_here(&ns, &ports, start));
            let _ = tx.send(bound);
        })?;
    rx.await
        .unwrap_or_else(|_| Err(io::Error::other("the binding thread ended without a word")))
}

/// How often the binding thread looks again for the namespace and its loopback.
const POLL: Duration = Duration::from_micros(100);

/// On the binding thread: `pid`'s network namespace, once it is another than ours.
fn namespace_of(pid: u32, start: Instant) -> io::Result<std::fs::File> {
    let ours = std::fs::metadata("/proc/self/ns/net")?.ino();
    let path = format!("/proc/{pid}/ns/net");
    loop {
        // Opened first, then compared: the descriptor holds the namespace it was opened on.
        let file = std::fs::File::open(&path)?;
        if file.metadata()?.ino() != ours {
            return Ok(file);
        }
        if start.elapsed() > NAMESPACE_TIMEOUT {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the sandbox made no network namespace in time",
            ));
        }
        std::thread::sleep(POLL);
    }
}

/// On the binding thread: enter `ns` and bind. The thread ends right after.
fn bind_here(ns: &std::fs::File, ports: &[u16], start: Instant) -> io::Result<Bound> {
    nix::sched::setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
    let localhost = |port| SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
    // Loopback's address exists once the sandbox brought it up: retry until then.
    let proxy = loop {
        match std::net::TcpListener::bind(localhost(PROXY_PORT)) {
            Ok(listener) => break listener,
            Err(err)
                if err.kind() == io::ErrorKind::AddrNotAvailable
                    && start.elapsed() < NAMESPACE_TIMEOUT =>
            {
                std::thread::sleep(POLL);
            }
            Err(err) => return Err(err),
        }
    };
    let dns = std::net::UdpSocket::bind(localhost(53))?;
    let dns_tcp = std::net::TcpListener::bind(localhost(53))?;
    let mut captures = Vec::new();
    for port in ports {
        let any = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, *port));
        captures.push((*port, std::net::TcpListener::bind(any)?));
    }
    Ok(Bound {
        proxy,
        dns,
        dns_tcp,
        captures,
    })
}

/// A command's listeners being served; dropping it closes them and every connection they
/// accepted (so nothing of ours keeps the command's namespace alive).
pub struct Attached {
    stop: CancellationToken,
    loops: Vec<JoinHandle<()>>,
    pub tally: Tally,
    pub captured: Vec<u16>,
    /// Allow rules reachable through the proxy only (`super::proxy_only`).
    pub proxy_only: Vec<String>,
}

impl Drop for Attached {
    fn drop(&mut self) {
        self.stop.cancel();
        for task in &self.loops {
            task.abort();
        }
    }
}

impl Enforcer {
    /// Bind the listeners of the command whose init is `pid` in its namespace and serve them.
    pub async fn attach(&self, pid: u32, ctx: Arc<CommandContext>) -> io::Result<Attached> {
        let ports = super::captured_ports(&ctx.policy);
        let tally = self.log.tally(&ctx.client, &ctx.session, &ctx.command);
        let bound = bind_in(pid, ports.clone()).await?;
        let names = Arc::new(Mutex::new(Synthetic::default()));
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        // Built first: an error below drops it, which ends what was started.
        let mut attached = Attached {
            stop: CancellationToken::new(),
            loops: Vec::new(),
            tally,
            proxy_only: super::proxy_only(&ctx.policy, &ports),
            captured: ports,
        };
        let stop = attached.stop.clone();

        let (engine, c) = (self.engine.clone(), ctx.clone());
        attached.loops.push(accept_loop(
            listener(bound.proxy)?,
            slots.clone(),
            stop.clone(),
            move |stream| {
                let (engine, c) = (engine.clone(), c.clone());
                Some(async move { engine.serve_proxy(c, stream).await })
            },
        ));

        let resolver = Arc::new(Resolver {
            ctx: ctx.clone(),
            names: names.clone(),
            ports: super::candidate_ports(&ctx.policy),
            own: self.engine.own_listeners.clone(),
            sink: self.engine.sink.clone(),
        });
        let r = resolver.clone();
        attached.loops.push(accept_loop(
            listener(bound.dns_tcp)?,
            slots.clone(),
            stop.clone(),
            move |stream| {
                let r = r.clone();
                Some(async move { dns_over_tcp(stream, &r).await })
            },
        ));
        bound.dns.set_nonblocking(true)?;
        let dns = tokio::net::UdpSocket::from_std(bound.dns)?;
        attached.loops.push(tokio::spawn(async move {
            let mut buf = vec![0u8; MAX_DNS_MESSAGE];
            loop {
                match dns.recv_from(&mut buf).await {
                    Ok((n, from)) => {
                        if let Some(reply) = buf.get(..n).and_then(|q| resolver.answer(q)) {
                            let _ = dns.send_to(&reply, from).await;
                        }
                    }
                    // An error on a datagram socket concerns one datagram (an ICMP error for
                    // an earlier reply, say): never a reason to stop answering.
                    Err(_) => tokio::time::sleep(ACCEPT_RETRY).await,
                }
            }
        }));

        for (port, capture) in bound.captures {
            let (engine, c, names) = (self.engine.clone(), ctx.clone(), names.clone());
            attached.loops.push(accept_loop(
                listener(capture)?,
                slots.clone(),
                stop.clone(),
                move |stream| {
                    let local = stream.local_addr().ok();
                    let name = match local {
                        Some(SocketAddr::V4(local)) => match names.lock() {
                            Ok(names) => names.name_of(*local.ip()),
                            Err(poisoned) => poisoned.into_inner().name_of(*local.ip()),
                        },
                        _ => None,
                    };
                    let Some(name) = name else {
                        // Not an address our resolver gave: no name to judge. Closed.
                        let to = local.map(|a| a.ip().to_string()).unwrap_or_default();
                        unresolved(&engine, &c, to, port);
                        return None;
                    };
                    let (engine, c) = (engine.clone(), c.clone());
                    Some(async move { engine.serve_tcp(c, stream, &name, port).await })
                },
            ));
        }
        Ok(attached)
    }
}

/// Accept connections on `listener` for as long as the command runs, each served by what
/// `serve` makes of it (`None`: closed at once) in a task that ends with the command, at most
/// [`MAX_CONNECTIONS`] at once over the command's listeners (past that a connection is
/// closed at once). An accept error (out of descriptors, a connection reset while queued) is
/// waited out, never the end of the listener.
fn accept_loop<F, Fut>(
    listener: tokio::net::TcpListener,
    slots: Arc<Semaphore>,
    stop: CancellationToken,
    serve: F,
) -> JoinHandle<()>
where
    F: Fn(tokio::net::TcpStream) -> Option<Fut> + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(_) => {
                    tokio::time::sleep(ACCEPT_RETRY).await;
                    continue;
                }
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                continue;
            };
            let Some(work) = serve(stream) else {
                continue;
            };
            let stop = stop.clone();
            tokio::spawn(async move {
                let _slot = slot;
                tokio::select! {
                    () = work => {}
                    () = stop.cancelled() => {}
                }
            });
        }
    })
}

/// DNS over TCP (RFC 1035 4.2.2: each message after its length in two bytes), for resolvers
/// that retry there; every wait bounded.
async fn dns_over_tcp(mut stream: tokio::net::TcpStream, resolver: &Resolver) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let mut len = [0u8; 2];
        let read = tokio::time::timeout(DNS_TCP_IDLE, stream.read_exact(&mut len)).await;
        if !matches!(read, Ok(Ok(_))) {
            return;
        }
        let len = usize::from(u16::from_be_bytes(len));
        if len > MAX_DNS_MESSAGE {
            return;
        }
        let mut query = vec![0u8; len];
        let read = tokio::time::timeout(DNS_TCP_IDLE, stream.read_exact(&mut query)).await;
        if !matches!(read, Ok(Ok(_))) {
            return;
        }
        let Some(reply) = resolver.answer(&query) else {
            return;
        };
        let Ok(reply_len) = u16::try_from(reply.len()) else {
            return;
        };
        let mut framed = reply_len.to_be_bytes().to_vec();
        framed.extend_from_slice(&reply);
        if stream.write_all(&framed).await.is_err() {
            return;
        }
    }
}

fn listener(std: std::net::TcpListener) -> io::Result<tokio::net::TcpListener> {
    std.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(std)
}

/// Record a plain connection to an address the resolver never gave (an address literal):
/// refused, since no name stands behind it to judge.
fn unresolved(engine: &crate::egress::Engine, ctx: &CommandContext, host: String, port: u16) {
    let record = DecisionRecord {
        ts: humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
        client: ctx.client.clone(),
        session: ctx.session.clone(),
        command: ctx.command.clone(),
        kind: "tcp",
        address: Some(
            SocketAddr::new(host.parse().unwrap_or(Ipv4Addr::UNSPECIFIED.into()), port).to_string(),
        ),
        host,
        port,
        layer: None,
        rule: None,
        allowed: false,
        code: "not_a_resolved_name",
        reason: "a plain connection reaches only names the namespace's resolver answered; \
                 use the proxy (HTTP_PROXY) for an address"
            .into(),
        error: None,
        bytes_up: 0,
        bytes_down: 0,
        duration_ms: 0.0,
    };
    engine.sink.record(&record);
}
