//! `executor serve`: HTTP on one port, `GET /v1/ws` upgraded to the protocol's WebSocket.
//!
//! Unauthenticated peers get a 401 before anything is allocated for them beyond hyper's request
//! parsing, which is bounded by a header timeout, a 16 KiB buffer and the connection limit.

mod connection;
pub mod tls;

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
use crate::engine::Engine;
use crate::token::Token;

/// Time a peer has to send its request headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Time connections get to send the results of killed commands when the daemon drains.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(15);

/// Everything a connection needs, shared.
pub struct Daemon {
    pub engine: Engine,
    pub token: Token,
    pub audit: Audit,
    pub hello: Hello,
    /// Global bound on running commands; a request past it gets `busy`.
    pub commands: Arc<Semaphore>,
    /// Cancelled on SIGTERM: stop accepting, kill running commands, send results, close.
    pub shutdown: CancellationToken,
    pub max_connections: usize,
    /// Every connection task, so draining can wait for them.
    pub tasks: TaskTracker,
    next_connection: AtomicU64,
}

impl Daemon {
    pub fn new(
        engine: Engine,
        token: Token,
        audit: Audit,
        hello: Hello,
        max_connections: usize,
    ) -> Self {
        let commands = Arc::new(Semaphore::new(engine.limits.max_commands_total));
        Self {
            engine,
            token,
            audit,
            hello,
            commands,
            shutdown: CancellationToken::new(),
            max_connections,
            tasks: TaskTracker::new(),
            next_connection: AtomicU64::new(1),
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
        tracker.spawn(async move {
            match tls {
                Some(acceptor) => {
                    let handshake = tls::handshake(&acceptor, stream, peer, &daemon.shutdown);
                    if let Some(stream) = handshake.await {
                        serve_http(stream, peer, daemon).await;
                    }
                }
                None => serve_http(stream, peer, daemon).await,
            }
            drop(slot);
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

async fn serve_http<S>(stream: S, peer: SocketAddr, daemon: Arc<Daemon>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let daemon = daemon.clone();
        async move { Ok::<_, std::convert::Infallible>(route(req, peer, daemon)) }
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

fn route(req: Request<Incoming>, peer: SocketAddr, daemon: Arc<Daemon>) -> Response<Full<Bytes>> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
        (&Method::GET, "/readyz") if daemon.shutdown.is_cancelled() => {
            text(StatusCode::SERVICE_UNAVAILABLE, "draining\n")
        }
        (&Method::GET, "/readyz") => text(StatusCode::OK, "ready\n"),
        (&Method::GET, WS_PATH) => upgrade(req, peer, daemon),
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

/// Check the token, then answer the WebSocket handshake (RFC 6455, section 4.2) and hand the
/// upgraded stream to a connection task.
fn upgrade(
    mut req: Request<Incoming>,
    peer: SocketAddr,
    daemon: Arc<Daemon>,
) -> Response<Full<Bytes>> {
    let authorized = req
        .headers()
        .get(header::AUTHORIZATION)
        .is_some_and(|value| daemon.token.matches_header(value.as_bytes()));
    if !authorized {
        tracing::info!(%peer, "rejected connection: missing or wrong bearer token");
        let mut resp = text(StatusCode::UNAUTHORIZED, "unauthorized\n");
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return resp;
    }
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
    let accept = derive_accept_key(key.as_bytes());
    let upgraded = hyper::upgrade::on(&mut req);
    let connection = daemon.next_connection.fetch_add(1, Ordering::Relaxed);
    daemon.tasks.clone().spawn(async move {
        let io = match upgraded.await {
            Ok(io) => TokioIo::new(io),
            Err(err) => {
                tracing::debug!(%peer, %err, "upgrade failed");
                return;
            }
        };
        let limits = &daemon.engine.limits;
        let config = WebSocketConfig::default()
            .read_buffer_size(16 * 1024)
            .write_buffer_size(16 * 1024)
            // A result escapes at most 6 bytes of JSON per output byte (\u0000).
            .max_write_buffer_size(limits.max_message_bytes + limits.max_output_bytes * 6)
            .max_message_size(Some(limits.max_message_bytes))
            .max_frame_size(Some(limits.max_message_bytes));
        let ws = WebSocketStream::from_raw_socket(io, Role::Server, Some(config)).await;
        connection::run(ws, daemon, peer, connection).await;
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
