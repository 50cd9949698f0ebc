//! The egress proxy (issue 38): the one way out of a command's network namespace under a
//! network policy. It takes a stream the command opened (TCP or a Unix socket: anything
//! `AsyncRead + AsyncWrite`) together with the command it belongs to and that command's
//! effective policy ([`sandbox::network::Effective`]), and handles
//! - an HTTP/1.1 forward-proxy request (`GET http://host/path`; the `Host` header must name
//!   the same authority), forwarded on a fresh connection per request;
//! - `CONNECT host:port`, whose bytes then pass through untouched (TLS is not terminated),
//!   once the first of them are judged: a TLS ClientHello's SNI, when it has one, must name
//!   the CONNECT host, and so must an HTTP request's `Host`;
//! - plain TCP to a name and port the caller gives ([`Engine::serve_tcp`], for connections
//!   captured inside the namespace), judged the same way.
//!
//! **Dial by name.** The proxy resolves the name itself ([`resolve::Resolver`]), judges every
//! address it got with the policy before connecting to any (so an `/etc/hosts` entry, an IP
//! literal or a name that rebinds to 127.0.0.1 reaches nothing the rules do not name), and
//! connects only to a judged address; a name the policy refuses is not even looked up.
//!
//! **One record per attempt** ([`record::DecisionRecord`], one JSON line through a
//! [`record::DecisionSink`]), written when the attempt ends, with bytes each way and its
//! duration. A denial answers HTTP 403 with the reason in the body (HTTP and CONNECT), or
//! closes the connection (plain TCP).
//!
//! Bounded: a request head or ClientHello is at most [`Limits::max_head`] bytes and must
//! arrive within [`Limits::first_bytes`] once it has begun; connecting and resolving are
//! bounded in time. The daemon's wiring (a listener per command, the namespace's route to it,
//! the log file) comes in a later step.
//!
//! Files: `resolve.rs` (resolvers), `record.rs` (the decision log), `tunnel.rs` (judging the
//! first bytes of a tunnel and relaying it), `http.rs` (the HTTP side, on hyper); this file
//! holds the engine and the dialing all three entry points share.

pub mod record;
pub mod resolve;

mod http;
mod tunnel;

#[cfg(test)]
mod tests;

use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use sandbox::network::{Decision, Effective, Host, Reason};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use record::{DecisionRecord, DecisionSink};
use resolve::Resolver;

/// The command a stream belongs to.
#[derive(Debug, Clone)]
pub struct CommandContext {
    pub client: String,
    pub session: String,
    pub command: String,
    /// Its policy, every layer combined.
    pub policy: Arc<Effective>,
}

/// Bounds on what one attempt may hold or wait for.
#[derive(Debug, Clone)]
pub struct Limits {
    /// How long a request head or a ClientHello may take to arrive once it has begun.
    pub first_bytes: Duration,
    /// How long connecting to the target may take (each address).
    pub connect: Duration,
    /// Largest request head or ClientHello read before judging it (hyper's minimum is 8 KiB).
    pub max_head: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            first_bytes: Duration::from_secs(10),
            connect: Duration::from_secs(10),
            max_head: 16 * 1024,
        }
    }
}

/// The proxy: how it resolves, where its records go, what it must never dial.
pub struct Engine {
    pub resolver: Arc<dyn Resolver>,
    pub sink: Arc<dyn DecisionSink>,
    /// The daemon's own listeners: reached only by an allow rule naming address and port.
    pub own_listeners: Vec<SocketAddr>,
    pub limits: Limits,
}

impl Engine {
    /// Serve a proxy connection (forward-proxy requests and CONNECT) until it closes.
    pub async fn serve_proxy<S>(self: &Arc<Self>, ctx: Arc<CommandContext>, stream: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        http::serve(self.clone(), ctx, stream).await;
    }

    /// Relay `stream` to `host`:`port` if the policy allows it; otherwise close it.
    pub async fn serve_tcp<S>(
        self: &Arc<Self>,
        ctx: Arc<CommandContext>,
        mut stream: S,
        host: &str,
        port: u16,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let mut attempt = Attempt::new(&ctx, &self.sink, "tcp", host, port);
        let target = match attempt.target(host) {
            Some(target) => target,
            None => return attempt.finish(),
        };
        if let Ok(upstream) = self.dial(&ctx, &mut attempt, &target, port).await {
            let end = tunnel::relay(&mut stream, upstream, &target, port, &self.limits).await;
            attempt.ended(end);
        }
        attempt.finish();
        // Only now, recorded, does the stream close (dropped here): a command that ends as
        // soon as it sees the close has this attempt counted in its result.
        drop(stream);
    }

    /// Resolve, judge every address, connect to the first that answers.
    async fn dial(
        &self,
        ctx: &CommandContext,
        attempt: &mut Attempt,
        target: &Host,
        port: u16,
    ) -> Result<Counted<TcpStream>, Refusal> {
        let own = &self.own_listeners;
        let early = ctx.policy.decide_before_resolving(target, port, own);
        if !early.allowed {
            attempt.decided(&early);
            return Err(Refusal::Denied);
        }
        let addrs: Vec<IpAddr> = match target {
            Host::Ip(ip) => vec![*ip],
            Host::Name(name) => match self.resolver.resolve(name, port).await {
                Ok(addrs) => addrs,
                Err(err) => {
                    attempt.refuse(
                        Reason::NoAddress.code(),
                        format!("{name} did not resolve: {err}"),
                    );
                    return Err(Refusal::Failed);
                }
            },
        };
        let decision = ctx.policy.decide(target, port, &addrs, own);
        attempt.decided(&decision);
        if !decision.allowed {
            return Err(Refusal::Denied);
        }
        let mut last_error = String::from("no address to connect to");
        for addr in addrs {
            let addr = SocketAddr::new(addr, port);
            attempt.record.address = Some(addr.to_string());
            match tokio::time::timeout(self.limits.connect, TcpStream::connect(addr)).await {
                Ok(Ok(stream)) => {
                    let _ = stream.set_nodelay(true);
                    return Ok(Counted::new(
                        stream,
                        attempt.up.clone(),
                        attempt.down.clone(),
                    ));
                }
                Ok(Err(err)) => last_error = format!("connect {addr}: {err}"),
                Err(_) => last_error = format!("connect {addr}: timed out"),
            }
        }
        attempt.record.error = Some(last_error);
        Err(Refusal::Failed)
    }
}

/// Why [`Engine::dial`] gave no connection (the attempt's record says the rest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// The policy (or a check of the request) refused it: 403.
    Denied,
    /// Allowed, but it could not be reached (no address, connect failed): 502.
    Failed,
}

/// One connection attempt, becoming its [`DecisionRecord`].
///
/// Its record is written once: when it finishes, or when it is dropped unfinished (its
/// command ended while it was still being decided or relayed: the daemon closes every
/// connection of a command that has ended), so that no attempt goes unlogged.
struct Attempt {
    started: Instant,
    record: DecisionRecord,
    up: Arc<AtomicU64>,
    down: Arc<AtomicU64>,
    sink: Arc<dyn DecisionSink>,
    recorded: bool,
}

impl Attempt {
    fn new(
        ctx: &CommandContext,
        sink: &Arc<dyn DecisionSink>,
        kind: &'static str,
        host: &str,
        port: u16,
    ) -> Self {
        Self {
            sink: sink.clone(),
            recorded: false,
            started: Instant::now(),
            record: DecisionRecord {
                ts: humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
                client: ctx.client.clone(),
                session: ctx.session.clone(),
                command: ctx.command.clone(),
                kind,
                host: host.to_string(),
                port,
                address: None,
                layer: None,
                rule: None,
                allowed: false,
                code: "pending",
                reason: String::new(),
                error: None,
                bytes_up: 0,
                bytes_down: 0,
                duration_ms: 0.0,
            },
            up: Arc::new(AtomicU64::new(0)),
            down: Arc::new(AtomicU64::new(0)),
        }
    }

    /// `host` as a target, normalized in the record; refused (and `None`) when it is no host.
    fn target(&mut self, host: &str) -> Option<Host> {
        match Host::parse(host) {
            Ok(target) => {
                self.record.host = target.to_string();
                Some(target)
            }
            Err(err) => {
                self.refuse("bad_host", err.to_string());
                None
            }
        }
    }

    fn decided(&mut self, decision: &Decision) {
        let r = &mut self.record;
        r.allowed = decision.allowed;
        r.layer = decision.layer;
        r.rule = decision.rule.as_ref().map(|rule| rule.to_string());
        r.code = decision.reason.code();
        r.reason = decision.reason.to_string();
        if let Reason::Special { addr, .. } = decision.reason {
            r.address = Some(SocketAddr::new(addr, r.port).to_string());
        }
        if let Reason::OwnListener { addr } = decision.reason {
            r.address = Some(addr.to_string());
        }
    }

    /// Denied by a check of the request itself (not the policy's rules).
    fn refuse(&mut self, code: &'static str, reason: String) {
        self.record.allowed = false;
        self.record.code = code;
        self.record.reason = reason;
    }

    /// How the tunnel ended.
    fn ended(&mut self, end: Result<(), tunnel::End>) {
        match end {
            Ok(()) => {}
            Err(tunnel::End::Refused { code, reason }) => self.refuse(code, reason),
            Err(tunnel::End::Io(err)) => self.record.error = Some(err.to_string()),
        }
    }

    /// The sentence a denied program reads (HTTP 403's body).
    fn denial_text(&self) -> String {
        let r = &self.record;
        let by = match (&r.layer, &r.rule) {
            (Some(layer), Some(rule)) => format!(" ({layer} rule {rule})"),
            (Some(layer), None) => format!(" ({layer} policy)"),
            (None, Some(rule)) => format!(" (rule {rule})"),
            (None, None) => String::new(),
        };
        format!(
            "executor network policy: {}:{} denied: {}{by}\n",
            r.host, r.port, r.reason
        )
    }

    fn finish(mut self) {
        self.write();
    }

    fn write(&mut self) {
        if self.recorded {
            return;
        }
        self.recorded = true;
        self.record.bytes_up = self.up.load(Ordering::Relaxed);
        self.record.bytes_down = self.down.load(Ordering::Relaxed);
        self.record.duration_ms = self.started.elapsed().as_secs_f64() * 1000.0;
        self.sink.record(&self.record);
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if self.recorded {
            return;
        }
        if self.record.code == "pending" {
            self.refuse(
                "command_ended",
                "its command ended before it was decided".into(),
            );
        } else if self.record.error.is_none() {
            self.record.error = Some("closed: its command ended".into());
        }
        self.write();
    }
}

/// A connection to the target that counts the bytes written to it (up) and read from it
/// (down).
struct Counted<S> {
    inner: S,
    up: Arc<AtomicU64>,
    down: Arc<AtomicU64>,
}

impl<S> Counted<S> {
    fn new(inner: S, up: Arc<AtomicU64>, down: Arc<AtomicU64>) -> Self {
        Self { inner, up, down }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = buf.filled().len().saturating_sub(before);
        self.down.fetch_add(read as u64, Ordering::Relaxed);
        poll
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = poll {
            self.up.fetch_add(n as u64, Ordering::Relaxed);
        }
        poll
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Whether `value` (a `Host` header, or an authority) names `target`:`port`. Without a port
/// it names the target's `default_port`, or any port when there is none (a tunnel, where the
/// port was fixed by CONNECT or the caller). User info (`user@host`) never matches.
fn authority_matches(value: &[u8], target: &Host, port: u16, default_port: Option<u16>) -> bool {
    let Ok(text) = std::str::from_utf8(value) else {
        return false;
    };
    let Ok(authority) = text.trim().parse::<hyper::http::uri::Authority>() else {
        return false;
    };
    if authority.as_str().contains('@') {
        return false;
    }
    let host_ok = Host::parse(authority.host()).is_ok_and(|h| h == *target);
    let port_ok = match authority.port_u16() {
        Some(p) => p == port,
        None => default_port.is_none_or(|d| d == port),
    };
    host_ok && port_ok
}
