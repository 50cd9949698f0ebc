//! `executor serve`: HTTP on one port, `GET /v1/ws` upgraded to the protocol's WebSocket,
//! `GET /metrics` for Prometheus (same bearer token), `/healthz` and `/readyz` (no token).
//!
//! Unauthenticated peers get a 401 before anything is allocated for them beyond hyper's request
//! parsing, which is bounded by a header timeout, a 16 KiB buffer and the connection limit.

mod attached;
mod connection;
mod processes;
mod session;
pub mod tls;
mod transfers;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use protocol::{Hello, WS_PATH};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::audit::Audit;
use crate::budget::MemoryBudget;
use crate::clients::{Client, Registry};
use crate::engine::Engine;
use crate::metrics::{self, Metrics};
use crate::workspaces::Workspaces;

pub use connection::end_session;
use session::{Session, Sessions};

/// Time a peer has to send its request headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Time connections get to send the results of killed commands when the daemon drains.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(15);

/// Everything a connection needs, shared.
pub struct Daemon {
    pub engine: Engine,
    /// Who may connect, with what limits; reloaded on SIGHUP.
    pub clients: Registry,
    pub sessions: Sessions,
    pub workspaces: Workspaces,
    /// How long a dropped connection's commands keep running, unless the client says.
    pub resume_grace: Duration,
    pub audit: Audit,
    pub hello: Hello,
    pub metrics: Metrics,
    /// What the daemon keeps on behalf of clients, bounded (`budget.rs`).
    pub memory: Arc<MemoryBudget>,
    /// Global bound on running commands; a request past it gets `busy`.
    pub commands: Arc<Semaphore>,
    /// Cancelled on SIGTERM: stop accepting, kill running commands, send results, close.
    pub shutdown: CancellationToken,
    pub max_connections: usize,
    /// Which browser origins and host names may reach the authenticated endpoints.
    pub origins: OriginPolicy,
    /// Every connection task, so draining can wait for them.
    pub tasks: TaskTracker,
    next_connection: AtomicU64,
}

/// What the daemon is made of, besides the engine.
pub struct DaemonParts {
    pub clients: Registry,
    pub workspaces: Workspaces,
    pub resume_grace: Duration,
    pub audit: Audit,
    pub hello: Hello,
    pub max_connections: usize,
    pub origins: OriginPolicy,
    /// Bytes of the daemon's memory budget (`--memory-budget-mb`).
    pub memory_budget: u64,
    /// A client's budget when its entry names none (`--client-memory-budget-mb`).
    pub client_memory_budget: Option<u64>,
}

/// Which requests may reach the WebSocket and the metrics, besides holding the token: a web
/// page in the operator's browser must not drive the executor (its requests carry an
/// `Origin`), nor reach a loopback daemon through a name that resolves to 127.0.0.1 (DNS
/// rebinding: its `Host` is then that name).
#[derive(Debug, Clone, Default)]
pub struct OriginPolicy {
    /// `Origin` values allowed (`--allow-origin`); requests without one are not from a browser.
    pub allowed: Vec<String>,
    /// The daemon listens on loopback only: `Host` must name a loopback address.
    pub loopback: bool,
}

impl OriginPolicy {
    /// Why `headers` may not reach an authenticated endpoint, if they may not.
    fn refusal(&self, headers: &hyper::HeaderMap) -> Option<String> {
        if let Some(origin) = headers.get(header::ORIGIN) {
            let origin = String::from_utf8_lossy(origin.as_bytes());
            if !self.allowed.iter().any(|a| a.eq_ignore_ascii_case(&origin)) {
                return Some(format!(
                    "origin {origin:?} may not use this executor (the operator allows origins with --allow-origin)"
                ));
            }
        }
        if self.loopback {
            let host = headers
                .get(header::HOST)
                .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned())
                .unwrap_or_default();
            if !is_loopback_host(&host) {
                return Some(format!(
                    "host {host:?} is not a loopback name, and this executor listens on loopback only"
                ));
            }
        }
        None
    }
}

/// `localhost`, `127.x.x.x` or `[::1]`, with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl Daemon {
    pub fn new(engine: Engine, parts: DaemonParts) -> Self {
        let DaemonParts {
            clients,
            workspaces,
            resume_grace,
            audit,
            hello,
            max_connections,
            origins,
            memory_budget,
            client_memory_budget,
        } = parts;
        let commands = Arc::new(Semaphore::new(engine.limits.max_commands_total));
        let metrics = Metrics::new();
        if let Some(enforcer) = &engine.enforcer {
            enforcer.log.count_in(metrics.network());
        }
        let memory = MemoryBudget::new(memory_budget, client_memory_budget, Some(metrics.memory()));
        for name in clients.table().names() {
            metrics.add_client(&name);
        }
        Self {
            engine,
            clients,
            sessions: Sessions::default(),
            workspaces,
            resume_grace,
            audit,
            hello,
            metrics,
            memory,
            commands,
            shutdown: CancellationToken::new(),
            max_connections,
            origins,
            tasks: TaskTracker::new(),
            next_connection: AtomicU64::new(1),
        }
    }

    /// The hello for one connection: the daemon's, narrowed to what this client may use.
    pub fn hello_for(&self, client: &Client, session: &Session) -> Hello {
        let mut hello = self.hello.clone();
        hello.profiles.retain(|p| client.may_use(&p.name));
        if !client.may_use(&hello.default_profile) {
            // The client's own first choice that this host can run.
            hello.default_profile = client
                .profiles
                .iter()
                .flatten()
                .find(|name| {
                    hello
                        .profiles
                        .iter()
                        .any(|p| &p.name == *name && p.available)
                })
                .cloned()
                .unwrap_or_default();
        }
        hello.workspace = match client.workspace {
            crate::clients::WorkspacePolicy::Shared => hello.workspace,
            crate::clients::WorkspacePolicy::PerClient => {
                self.workspaces.workspace_of(client).display().to_string()
            }
            crate::clients::WorkspacePolicy::PerConnection => session
                .scratch
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
        };
        hello.disk_quota = self.workspaces.disk_quota_info(client);
        hello.client = client.name.clone();
        hello.network = Some(crate::network_policy::client_report(&client.network));
        hello.session = session.id.clone();
        hello.resume_grace = session.grace.as_secs_f64();
        hello
    }

    /// Re-read the clients file. Connections of removed clients close themselves; their
    /// detached sessions end here.
    pub async fn reload_clients(&self) {
        match self.clients.reload(&self.engine.profiles) {
            Ok(names) => {
                tracing::info!(clients = %names.join(","), "clients reloaded");
                // Idle workers were built for the clients as they were.
                let runner = self.engine.runner.clone();
                let _ = tokio::task::spawn_blocking(move || runner.dismiss_warm_workers()).await;
                for name in &names {
                    self.metrics.add_client(name);
                }
                let table = self.clients.table();
                for session in self.sessions.all() {
                    if table.current(&session.client).is_none() {
                        end_session(self, &session).await;
                    }
                }
            }
            Err(err) => {
                tracing::error!(%err, "clients file not reloaded; the previous one stays in force")
            }
        }
    }
}

/// Accept connections until `daemon.shutdown` is cancelled, then drain. With `tls`, every
/// connection starts with a TLS handshake (bounded by [`tls::HANDSHAKE_TIMEOUT`]) and holds its
/// connection slot from the moment it is accepted.
pub async fn serve(
    listener: TcpListener,
    daemon: Arc<Daemon>,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let tracker = daemon.tasks.clone();
    let slots = Arc::new(Semaphore::new(daemon.max_connections));
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = daemon.shutdown.cancelled() => break,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(err) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(%err, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "connection limit reached; dropping connection");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let daemon = daemon.clone();
        let tls = tls.clone();
        // Shared with a WebSocket the connection upgrades to, which outlives the HTTP task:
        // the slot is free only when both are done.
        let slot = Arc::new(slot);
        tracker.spawn(async move {
            match tls {
                Some(acceptor) => {
                    let handshake = tls::handshake(&acceptor, stream, peer, &daemon.shutdown);
                    if let Some(stream) = handshake.await {
                        serve_http(stream, peer, daemon, slot).await;
                    }
                }
                None => serve_http(stream, peer, daemon, slot).await,
            }
        });
    }
    drop(listener);
    tracker.close();
    if tokio::time::timeout(DRAIN_TIMEOUT, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after {DRAIN_TIMEOUT:?}; exiting anyway");
    }
}

async fn serve_http<S>(stream: S, peer: SocketAddr, daemon: Arc<Daemon>, slot: Slot)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let daemon = daemon.clone();
        let slot = slot.clone();
        async move { Ok::<_, std::convert::Infallible>(route(req, peer, daemon, slot)) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(16 * 1024)
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    if let Err(err) = conn.await {
        tracing::debug!(%peer, %err, "http connection ended with an error");
    }
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *resp.status_mut() = status;
    resp
}

fn text_owned(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp
}

/// A connection's place under `--max-connections`.
type Slot = Arc<tokio::sync::OwnedSemaphorePermit>;

fn route(
    req: Request<Incoming>,
    peer: SocketAddr,
    daemon: Arc<Daemon>,
    slot: Slot,
) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    if matches!(path, WS_PATH | "/metrics") {
        if let Some(why) = daemon.origins.refusal(req.headers()) {
            tracing::info!(%peer, %why, "refused a request");
            return text_owned(StatusCode::FORBIDDEN, format!("{why}\n"));
        }
    }
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
        (&Method::GET, "/readyz") if daemon.shutdown.is_cancelled() => {
            text(StatusCode::SERVICE_UNAVAILABLE, "draining\n")
        }
        (&Method::GET, "/readyz") => text(StatusCode::OK, "ready\n"),
        (&Method::GET, WS_PATH) => upgrade(req, peer, daemon, slot),
        (&Method::GET, "/metrics") => scrape(&req, peer, &daemon),
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

/// Whether `req` may read the metrics: today, whoever holds the token the WebSocket needs.
fn metrics_client<B>(daemon: &Daemon, req: &Request<B>) -> Option<Arc<Client>> {
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| daemon.clients.table().authenticate(value.as_bytes()))
}

/// `GET /metrics`: the exposition, for an authorized scraper. It names clients and profiles and
/// counts their commands, so it is not for everyone who can reach the port.
fn scrape<B>(req: &Request<B>, peer: SocketAddr, daemon: &Daemon) -> Response<Full<Bytes>> {
    match metrics_client(daemon, req) {
        None => {
            tracing::info!(%peer, "rejected metrics scrape: missing or wrong bearer token");
            let mut resp = text(StatusCode::UNAUTHORIZED, "unauthorized\n");
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return resp;
        }
        Some(client) if !client.metrics => {
            tracing::info!(%peer, client = %client.name, "rejected metrics scrape: client lacks the metrics permission");
            return text(
                StatusCode::FORBIDDEN,
                "this client may not read metrics (\"metrics\": true in the clients file)\n",
            );
        }
        Some(_) => {}
    }
    let Ok(body) = daemon.metrics.render() else {
        tracing::error!("cannot encode the metrics");
        return text(
            StatusCode::INTERNAL_SERVER_ERROR,
            "cannot encode the metrics\n",
        );
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(metrics::CONTENT_TYPE),
    );
    resp
}

/// Check the token, then answer the WebSocket handshake (RFC 6455, section 4.2) and hand the
/// upgraded stream to a connection task.
fn upgrade(
    mut req: Request<Incoming>,
    peer: SocketAddr,
    daemon: Arc<Daemon>,
    slot: Slot,
) -> Response<Full<Bytes>> {
    let client = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| daemon.clients.table().authenticate(value.as_bytes()));
    let Some(client) = client else {
        tracing::info!(%peer, "rejected connection: missing or wrong bearer token");
        let mut resp = text(StatusCode::UNAUTHORIZED, "unauthorized\n");
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return resp;
    };
    if daemon.shutdown.is_cancelled() {
        return text(StatusCode::SERVICE_UNAVAILABLE, "draining\n");
    }
    let headers = req.headers();
    let is_upgrade = headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    let version_ok = headers
        .get(header::SEC_WEBSOCKET_VERSION)
        .is_some_and(|v| v == "13");
    let Some(key) = headers
        .get(header::SEC_WEBSOCKET_KEY)
        .filter(|_| is_upgrade && version_ok)
    else {
        return text(
            StatusCode::BAD_REQUEST,
            "expected a WebSocket upgrade (version 13)\n",
        );
    };
    // The connection's own cost counts against the budgets like what it keeps: idle
    // connections cannot take the daemon past them (an old one's output goes first).
    let held = daemon
        .memory
        .owner(&client.name, client.limits.memory_budget_bytes)
        .hold();
    if !held.try_grow(crate::budget::CONNECTION_BYTES) {
        let why = held.owner().describe();
        tracing::warn!(%peer, client = %client.name, %why, "memory budget full; refusing a connection");
        return text_owned(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("memory budget full: {why}; close idle connections or raise the budget\n"),
        );
    }
    let accept = derive_accept_key(key.as_bytes());
    let upgraded = hyper::upgrade::on(&mut req);
    let connection = daemon.next_connection.fetch_add(1, Ordering::Relaxed);
    daemon.tasks.clone().spawn(async move {
        // Held for the WebSocket's life.
        let _slot = slot;
        let io = match upgraded.await {
            Ok(io) => TokioIo::new(io),
            Err(err) => {
                tracing::debug!(%peer, %err, "upgrade failed");
                return;
            }
        };
        let limits = &daemon.engine.limits;
        let config = WebSocketConfig::default()
            .read_buffer_size(connection::READ_BUFFER_BYTES)
            .write_buffer_size(connection::FRAME_BYTES)
            // A result escapes at most 6 bytes of JSON per output byte (\u0000).
            .max_write_buffer_size(limits.max_message_bytes + limits.max_output_bytes * 6)
            .max_message_size(Some(limits.max_message_bytes))
            .max_frame_size(Some(limits.max_message_bytes));
        let ws = WebSocketStream::from_raw_socket(io, Role::Server, Some(config)).await;
        connection::run(ws, daemon, peer, connection, client, held).await;
    });
    let mut resp = Response::new(Full::new(Bytes::new()));
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    if let Ok(value) = HeaderValue::from_str(&accept) {
        h.insert(header::SEC_WEBSOCKET_ACCEPT, value);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_are_told_from_other_names() {
        for host in [
            "localhost",
            "localhost:7681",
            "127.0.0.1:80",
            "127.1.2.3",
            "[::1]:7681",
            "LOCALHOST",
        ] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in [
            "",
            "evil.example",
            "evil.example:7681",
            "10.0.0.1:7681",
            "[::2]:1",
            "localhost.evil.example",
        ] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }
}
