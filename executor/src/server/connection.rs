//! One authenticated WebSocket connection: reads requests, runs commands, writes replies.
//!
//! A single writer task owns the socket's sending half and drains a bounded queue; commands and
//! the reader only enqueue. When the peer goes away, every command of the connection is killed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use protocol::{CancelRequest, ClientMessage, ErrorCode, ErrorMessage, ExecRequest, ServerMessage};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;

use super::Daemon;
use crate::audit::{now_rfc3339, AuditRecord};
use crate::engine::ExecError;
use crate::metrics::{InFlight, DEFAULT_CLIENT};
use crate::request::{validate, ValidRequest};
use crate::runner::{OutputSink, StopReason};

type Ws = WebSocketStream<TokioIo<Upgraded>>;

/// Messages queued for the writer; a stalled client fills it and then slows its own commands.
const OUTBOUND_QUEUE: usize = 16;
/// Time the writer gets to flush results and a close frame when the connection ends normally.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(10);

pub async fn run(ws: Ws, daemon: Arc<Daemon>, peer: SocketAddr, connection: u64) {
    tracing::info!(%peer, connection, "client connected");
    let _open = daemon.metrics.connection_opened(DEFAULT_CLIENT);
    let (mut sink, mut stream) = ws.split();
    let (tx, mut rx) = mpsc::channel::<ServerMessage>(OUTBOUND_QUEUE);
    let (close_tx, mut close_rx) = oneshot::channel::<(CloseCode, &'static str)>();

    // The writer: the only code that sends on the socket. A failed send ends the connection.
    // Queued replies go first (biased), so a requested close frame follows every result.
    let writer_gone = CancellationToken::new();
    let mut writer = tokio::spawn({
        let gone = writer_gone.clone();
        async move {
            let mut close_pending = true;
            loop {
                let frame = tokio::select! {
                    biased;
                    msg = rx.recv() => match msg {
                        Some(msg) => match serde_json::to_string(&msg) {
                            Ok(text) => Message::text(text),
                            Err(err) => {
                                tracing::error!(%err, "cannot serialize a reply");
                                continue;
                            }
                        },
                        None => break,
                    },
                    close = &mut close_rx, if close_pending => match close {
                        Ok((code, reason)) => Message::Close(Some(CloseFrame { code, reason: reason.into() })),
                        Err(_) => { close_pending = false; continue }
                    },
                };
                let closing = matches!(frame, Message::Close(_));
                if sink.send(frame).await.is_err() || closing {
                    break;
                }
            }
            let _ = sink.close().await;
            gone.cancel();
        }
    });
    let mut close_tx = Some(close_tx);
    let replies = Replies(tx);
    replies
        .send(ServerMessage::Hello(daemon.hello.clone()))
        .await;

    let mut session = Session {
        daemon: daemon.clone(),
        replies: replies.clone(),
        peer,
        connection,
        running: Running::default(),
        tasks: JoinSet::new(),
        gone: CancellationToken::new(),
    };
    let mut draining = false;
    let mut peer_left = false;
    loop {
        if draining && session.tasks.is_empty() {
            break;
        }
        tokio::select! {
            frame = stream.next() => match frame {
                Some(Ok(Message::Text(text))) => session.handle_text(text.as_str(), draining).await,
                Some(Ok(Message::Binary(_))) => {
                    replies.error(None, ErrorCode::BadRequest, "binary frames are not part of the protocol; send JSON text").await;
                }
                Some(Ok(Message::Close(_))) | None => { peer_left = true; break }
                Some(Ok(_)) => {} // ping and pong are answered by tungstenite
                Some(Err(WsError::Capacity(err))) => {
                    let message = format!("message too large: {err}; limit {} bytes", daemon.engine.limits.max_message_bytes);
                    replies.error(None, ErrorCode::BadRequest, &message).await;
                    if let Some(close) = close_tx.take() {
                        let _ = close.send((CloseCode::Size, "message too large"));
                    }
                    break;
                }
                Some(Err(err)) => {
                    tracing::info!(%peer, connection, %err, "connection error");
                    peer_left = true;
                    break;
                }
            },
            // Jobs leave `running` themselves, before their reply (so an id is free again as
            // soon as its result arrives); here they are only reaped.
            Some(_) = session.tasks.join_next() => {}
            () = daemon.shutdown.cancelled(), if !draining => draining = true,
            () = writer_gone.cancelled() => { peer_left = true; break }
        }
    }

    if peer_left {
        // Nobody can receive results now: kill everything, and do not let replies wait on a
        // socket nobody reads.
        session.gone.cancel();
        writer.abort();
    }
    while session.tasks.join_next().await.is_some() {}
    if draining {
        if let Some(close) = close_tx.take() {
            let _ = close.send((CloseCode::Away, "executor shutting down"));
        }
    }
    drop(session);
    drop(replies);
    if tokio::time::timeout(FLUSH_TIMEOUT, &mut writer)
        .await
        .is_err()
    {
        writer.abort();
    }
    tracing::info!(%peer, connection, "client disconnected");
}

#[derive(Clone)]
struct Replies(mpsc::Sender<ServerMessage>);

impl Replies {
    async fn send(&self, msg: ServerMessage) {
        // Fails only when the writer is gone, and then the connection is ending anyway.
        let _ = self.0.send(msg).await;
    }

    async fn error(&self, id: Option<String>, code: ErrorCode, message: &str) {
        self.send(ServerMessage::Error(ErrorMessage {
            id,
            code,
            message: message.to_string(),
        }))
        .await;
    }
}

struct Session {
    daemon: Arc<Daemon>,
    replies: Replies,
    peer: SocketAddr,
    connection: u64,
    running: Running,
    /// Command tasks.
    tasks: JoinSet<()>,
    /// Cancelled when the peer is gone.
    gone: CancellationToken,
}

impl Session {
    async fn handle_text(&mut self, text: &str, draining: bool) {
        let msg = match serde_json::from_str::<ClientMessage>(text) {
            Ok(msg) => msg,
            Err(err) => {
                // Name the request in the error if its id can be read at all.
                let id = serde_json::from_str::<serde_json::Value>(text)
                    .ok()
                    .and_then(|v| v.get("id")?.as_str().map(str::to_string));
                let message = format!("malformed message: {err}");
                self.replies
                    .error(id, ErrorCode::BadRequest, &message)
                    .await;
                return;
            }
        };
        match msg {
            ClientMessage::Exec(req) => self.exec(req, draining).await,
            ClientMessage::Cancel(CancelRequest { id }) => match self.running.get(&id) {
                Some(cancel) => cancel.cancel(),
                None => {
                    let message = format!("no running command with id {id:?}");
                    self.replies
                        .error(Some(id), ErrorCode::NotFound, &message)
                        .await;
                }
            },
        }
    }

    async fn exec(&mut self, req: ExecRequest, draining: bool) {
        let id = req.id.clone();
        match self.admit(req, draining) {
            Ok((valid, permit)) => {
                let cancel = CancellationToken::new();
                self.running.insert(valid.id.clone(), cancel.clone());
                let job = Job {
                    daemon: self.daemon.clone(),
                    replies: self.replies.clone(),
                    running: self.running.clone(),
                    peer: self.peer,
                    connection: self.connection,
                    gone: self.gone.clone(),
                    cancel,
                    in_flight: self.daemon.metrics.command_started(DEFAULT_CLIENT),
                };
                self.tasks.spawn(async move {
                    job.run(valid).await;
                    drop(permit);
                });
            }
            Err(err) => {
                self.daemon
                    .metrics
                    .command_refused(DEFAULT_CLIENT, err.code);
                self.replies.error(Some(id), err.code, &err.message).await;
            }
        }
    }

    /// Validate a request and take a slot for it, or say why not.
    fn admit(
        &self,
        req: ExecRequest,
        draining: bool,
    ) -> Result<(ValidRequest, tokio::sync::OwnedSemaphorePermit), ExecError> {
        let limits = &self.daemon.engine.limits;
        if draining {
            return Err(ExecError::new(
                ErrorCode::ShuttingDown,
                "the executor is shutting down",
            ));
        }
        let valid = validate(req, limits)
            .map_err(|err| ExecError::new(ErrorCode::BadRequest, err.to_string()))?;
        self.daemon.engine.profile(valid.profile.as_deref())?;
        if self.running.contains_key(&valid.id) {
            return Err(ExecError::new(
                ErrorCode::DuplicateId,
                format!("a command with id {:?} is already running", valid.id),
            ));
        }
        if self.running.len() >= limits.max_commands_per_connection {
            return Err(ExecError::new(
                ErrorCode::Busy,
                format!(
                    "this connection already runs {} commands, the limit",
                    limits.max_commands_per_connection
                ),
            ));
        }
        let permit = self
            .daemon
            .commands
            .clone()
            .try_acquire_owned()
            .map_err(|_| {
                ExecError::new(
                    ErrorCode::Busy,
                    format!(
                        "the executor already runs {} commands, the limit",
                        limits.max_commands_total
                    ),
                )
            })?;
        Ok((valid, permit))
    }
}

/// Cancel handles of a connection's running commands, by client id. Shared with the jobs so
/// that each removes its own id right before replying.
#[derive(Clone, Default)]
struct Running(Arc<std::sync::Mutex<HashMap<String, CancellationToken>>>);

impl Running {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, CancellationToken>> {
        // A poisoned lock only means a job panicked while holding it; the map is still valid.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
    fn insert(&self, id: String, cancel: CancellationToken) {
        self.lock().insert(id, cancel);
    }
    fn remove(&self, id: &str) {
        self.lock().remove(id);
    }
    fn get(&self, id: &str) -> Option<CancellationToken> {
        self.lock().get(id).cloned()
    }
    fn contains_key(&self, id: &str) -> bool {
        self.lock().contains_key(id)
    }
    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// One admitted command.
struct Job {
    daemon: Arc<Daemon>,
    replies: Replies,
    running: Running,
    peer: SocketAddr,
    connection: u64,
    gone: CancellationToken,
    cancel: CancellationToken,
    in_flight: InFlight,
}

impl Job {
    async fn run(self, req: ValidRequest) {
        let stop = async {
            tokio::select! {
                () = self.cancel.cancelled() => StopReason::Cancelled,
                () = self.gone.cancelled() => StopReason::Disconnected,
                () = self.daemon.shutdown.cancelled() => StopReason::Shutdown,
            }
        };
        let sink = req.stream.then(|| OutputSink {
            id: req.id.clone(),
            tx: self.replies.0.clone(),
        });
        let engine = &self.daemon.engine;
        let result = engine.execute(&req, sink, stop).await;
        let profile = req
            .profile
            .clone()
            .unwrap_or_else(|| engine.default_profile.clone());
        let cwd = req
            .spec
            .cwd
            .clone()
            .unwrap_or_else(|| engine.plan_settings.workspace.clone());
        let mut record = AuditRecord {
            ts: now_rfc3339(),
            client: self.peer.to_string(),
            connection: self.connection,
            id: req.id.clone(),
            command: req.spec.command.clone(),
            cwd: cwd.display().to_string(),
            profile,
            ended: "error".into(),
            returncode: None,
            duration_ms: 0.0,
            output_bytes: 0,
            killed_processes: 0,
            error: None,
        };
        match result {
            Ok(result) => {
                let extra = &result.extra;
                record.ended = serde_json::to_value(extra.ended)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default();
                record.returncode = Some(result.returncode);
                record.duration_ms = extra.duration_ms;
                record.output_bytes = extra.output_bytes;
                record.killed_processes = extra.killed_processes;
                tracing::debug!(id = %req.id, rc = result.returncode, ended = %record.ended, "command finished");
                self.running.remove(&req.id);
                self.daemon
                    .metrics
                    .command_finished(self.in_flight, &record.profile, &result);
                self.replies.send(ServerMessage::Result(result)).await;
                self.daemon.audit.record(record).await;
            }
            Err(err) => {
                tracing::warn!(id = %req.id, code = %err.code, message = %err.message, "command failed to run");
                record.error = Some(format!("{}: {}", err.code, err.message));
                self.running.remove(&req.id);
                self.daemon
                    .metrics
                    .command_failed(self.in_flight, &record.profile, err.code);
                self.daemon.audit.record(record).await;
                self.replies
                    .error(Some(req.id.clone()), err.code, &err.message)
                    .await;
            }
        }
    }
}
