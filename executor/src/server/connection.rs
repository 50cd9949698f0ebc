//! One authenticated WebSocket connection: reads requests, runs commands, writes replies.
//!
//! A single writer task owns the socket's sending half and drains a bounded queue. Commands
//! reply through their session (`session.rs`), which hands replies to the attached
//! connection's queue or keeps them while none is attached.
//!
//! How a connection ends decides what happens to its session's commands: a close frame from
//! the client, a revoked client or a grace period of 0 kill them at once; a connection that
//! just drops leaves them running for the grace period, for the client to resume.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use protocol::{
    CancelRequest, ClientMessage, ErrorCode, ErrorMessage, ExecRequest, ResumeRequest, Resumed,
    ServerMessage,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_tungstenite::tungstenite::protocol::frame::coding::{CloseCode, Data, OpCode};
use tokio_tungstenite::tungstenite::protocol::frame::Frame;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Bytes, Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;

use super::session::{Attached, Session, WriterControl};
use super::Daemon;
use crate::audit::{now_rfc3339, AuditRecord};
use crate::clients::{Client, Slot, WorkspacePolicy};
use crate::engine::ExecError;
use crate::metrics::InFlight;
use crate::request::{validate, ValidRequest};
use crate::runner::{Io, OutputSink, StopReason};

type Ws = WebSocketStream<TokioIo<Upgraded>>;

/// Messages queued for the writer; a stalled client fills it and then slows its own commands.
const OUTBOUND_QUEUE: usize = 16;
/// Sessions of one client kept for a resume at once; past it the oldest ends (its commands
/// are killed), so a client dropping connections over and over cannot pile them up.
const MAX_DETACHED_PER_CLIENT: usize = 32;
/// Largest frame the writer sends: longer messages go out fragmented (see [`send_in_frames`]).
pub(super) const FRAME_BYTES: usize = 16 * 1024;
/// Time the writer gets to flush results and a close frame when the connection ends normally.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the read loop stopped.
#[derive(Debug, PartialEq)]
enum Ending {
    /// Close frame: the client is done; its commands die.
    Closed,
    /// The connection broke: commands outlive it for the grace period.
    Dropped,
    /// Another connection resumed the session.
    TakenOver,
    /// The client was removed from the clients file.
    Revoked,
    /// The daemon drained.
    Shutdown,
    /// We closed it (oversized message).
    Refused,
    /// We dropped it to give its grown read buffer back (the memory budget was full): as when
    /// a connection drops, its session is kept for a resume (no close frame: clients resume
    /// after a drop, not after a close).
    Shed,
}

/// What a connection's WebSocket read buffer grew to past [`READ_BUFFER_BYTES`], counted in
/// the memory budget, which may take it back by dropping the connection (`shed`).
struct ReadBuffer {
    held: crate::budget::Held,
    /// Cancelled when the budget wants the buffer back.
    shed: CancellationToken,
}

impl ReadBuffer {
    /// Made when the buffer first grows: only grown buffers are among the budget's candidates.
    /// Sheddable only when a dropped connection keeps its session for a resume (a grace
    /// period): else the growth is counted and kept.
    fn new(owner: &crate::budget::Owner, sheddable: bool, shed: CancellationToken) -> Arc<Self> {
        Arc::new_cyclic(|me: &std::sync::Weak<Self>| {
            let held = if sheddable {
                let me: std::sync::Weak<dyn crate::budget::Evictable> = me.clone();
                owner.hold_read_buffer(me)
            } else {
                owner.hold()
            };
            Self { held, shed }
        })
    }

    fn sheddable(&self) -> bool {
        self.held.is_evictable()
    }

    /// The buffer grew by `bytes`: counted, after others' grown buffers and ended output
    /// made room.
    fn grew(&self, bytes: u64) {
        self.held.force(bytes);
    }
}

impl crate::budget::Evictable for ReadBuffer {
    fn evict(&self, _want: u64) -> u64 {
        // A buffer that never grew has nothing to give back: its connection stays.
        if self.held.bytes() == 0 {
            return 0;
        }
        self.shed.cancel();
        self.held.evicted_all()
    }
}

/// The WebSocket read buffer a connection starts with; a larger frame grows it, and it keeps
/// that size for the connection's life (tungstenite reuses it), so the growth is counted.
pub(super) const READ_BUFFER_BYTES: usize = 16 * 1024;

pub async fn run(
    ws: Ws,
    daemon: Arc<Daemon>,
    peer: SocketAddr,
    connection: u64,
    client: Arc<Client>,
    cost: crate::budget::Held,
) {
    tracing::info!(%peer, connection, client = %client.name, "client connected");
    let _open = daemon.metrics.connection_opened(&client.name);
    let (mut sink, mut stream) = ws.split();
    let (tx, mut rx) = mpsc::channel::<ServerMessage>(OUTBOUND_QUEUE);
    let (close_tx, mut close_rx) = oneshot::channel::<(CloseCode, &'static str)>();

    let grace = client.resume_grace.unwrap_or(daemon.resume_grace);
    // The largest message read so far: tungstenite's read buffer holds about that much.
    let mut read_peak = READ_BUFFER_BYTES;
    let shed = CancellationToken::new();
    let mut read_buffer: Option<Arc<ReadBuffer>> = None;
    let scratch_root = (client.workspace == WorkspacePolicy::PerConnection)
        .then(|| daemon.workspaces.scratch_root_of(&client));
    let fresh = daemon.sessions.create(client.clone(), grace, scratch_root);
    fresh.count_in(
        &daemon
            .memory
            .owner(&client.name, client.limits.memory_budget_bytes),
    );
    // The writer follows the session: a resume switches it.
    let (current_tx, current) = watch::channel(fresh.clone());

    // The writer: the only code that sends on the socket. A failed send ends the connection.
    // Queued replies go first (biased), so a requested close frame follows every result.
    let writer_gone = CancellationToken::new();
    // Cancelled when the connection dropped: stop writing to the dead socket, and hand what
    // is still queued back to the session instead of losing it.
    let writer_stop = CancellationToken::new();
    // Cancelled when the client sent a close frame: nobody reads replies any more; the
    // writer only completes the closing handshake (tungstenite queued the reply frame when
    // the reader took the client's; closing the sink sends it).
    let peer_closed = CancellationToken::new();
    let mut writer = tokio::spawn({
        let gone = writer_gone.clone();
        let stop = writer_stop.clone();
        let peer_closed = peer_closed.clone();
        async move {
            let mut close_pending = true;
            // The reply being written when the connection was found dead, if any.
            let mut unsent = None;
            loop {
                let (frame, msg) = tokio::select! {
                    biased;
                    () = stop.cancelled() => break,
                    () = peer_closed.cancelled() => break,
                    msg = rx.recv() => match msg {
                        Some(msg) => match serde_json::to_string(&msg) {
                            Ok(text) => (Message::text(text), Some(msg)),
                            Err(err) => {
                                tracing::error!(%err, "cannot serialize a reply");
                                continue;
                            }
                        },
                        // Every reply is out. A close we were asked for goes last (a refused
                        // oversized message closes with 1009 once its error is sent).
                        None => match close_rx.try_recv() {
                            Ok((code, reason)) if close_pending => {
                                close_pending = false;
                                (Message::Close(Some(CloseFrame { code, reason: reason.into() })), None)
                            }
                            _ => break,
                        },
                    },
                    close = &mut close_rx, if close_pending => match close {
                        Ok((code, reason)) => {
                            close_pending = false;
                            (Message::Close(Some(CloseFrame { code, reason: reason.into() })), None)
                        }
                        Err(_) => { close_pending = false; continue }
                    },
                };
                let closing = matches!(frame, Message::Close(_));
                let sent = tokio::select! {
                    sent = send_in_frames(&mut sink, frame) => Some(sent.is_ok()),
                    () = stop.cancelled() => None,
                    () = peer_closed.cancelled() => Some(false),
                };
                let session = current.borrow().clone();
                match (sent, msg) {
                    (Some(true), Some(msg)) => session.written(msg),
                    // Not delivered: kept for a resume, ahead of the queue.
                    (Some(false), Some(msg)) => unsent = Some(msg),
                    // Cut off mid-write: a final reply may or may not have arrived, which is
                    // what `written` is for (sent again only if the client awaits it).
                    (None, Some(msg)) if super::session::is_final(&msg) => session.written(msg),
                    (None, Some(msg)) => unsent = Some(msg),
                    (_, None) => {}
                }
                if sent != Some(true) || closing {
                    break;
                }
            }
            // Whatever is still queued was never sent: it goes back to the session, in order.
            let session = current.borrow().clone();
            session.keep_queue(unsent, &mut rx);
            if !stop.is_cancelled() {
                let _ = sink.close().await;
            }
            gone.cancel();
        }
    });
    let mut close_tx = Some(close_tx);

    let mut conn = Connection {
        hello: daemon.hello_for(&client, &fresh),
        daemon: daemon.clone(),
        client,
        session: fresh.clone(),
        current: current_tx,
        tx: tx.clone(),
        peer,
        connection,
        evicted: CancellationToken::new(),
        writer: WriterControl {
            stop: writer_stop.clone(),
            done: writer_gone.clone(),
        },
        first: true,
    };
    if let Attached::Yes { evicted, .. } = fresh.attach(connection, tx.clone(), conn.writer.clone())
    {
        conn.evicted = evicted;
    }
    conn.reply(ServerMessage::Hello(Box::new(conn.hello.clone())))
        .await;
    conn.replay().await;

    let mut reloads = daemon.clients.subscribe();
    let mut draining = false;
    let ending = loop {
        if draining && conn.session.tasks.is_empty() {
            break Ending::Shutdown;
        }
        let evicted = conn.evicted.clone();
        tokio::select! {
            // Eviction first: a request still buffered on a connection whose session was
            // taken over must not run (its client resends it on the new connection).
            biased;
            () = evicted.cancelled() => break Ending::TakenOver,
            () = shed.cancelled() => {
                let why = cost.owner().describe();
                tracing::warn!(%peer, connection, %why, "memory budget full; dropping a connection to give its grown read buffer back (its session waits for a resume)");
                daemon.metrics.limit_hit(&conn.client.name, "memory_budget_connection_shed");
                break Ending::Shed;
            }
            frame = stream.next() => match frame {
                Some(Ok(Message::Text(text))) => {
                    let len = text.len();
                    conn.handle_text(text.as_str(), draining).await;
                    if len > read_peak {
                        let buffer = read_buffer.get_or_insert_with(|| {
                            ReadBuffer::new(cost.owner(), !grace.is_zero(), shed.clone())
                        });
                        buffer.grew((len - read_peak) as u64);
                        read_peak = len;
                        // Past a budget with nothing else to give back: this connection's
                        // own buffer goes (the message was handled; its replies wait for the
                        // resume).
                        if buffer.sheddable() && cost.owner().over_budget() {
                            shed.cancel();
                        }
                    }
                }
                Some(Ok(Message::Binary(_))) => {
                    conn.error(None, ErrorCode::BadRequest, "binary frames are not part of the protocol; send JSON text").await;
                }
                Some(Ok(Message::Close(_))) => break Ending::Closed,
                None => break Ending::Dropped,
                Some(Ok(_)) => {} // ping and pong are answered by tungstenite
                Some(Err(WsError::Capacity(err))) => {
                    let message = format!("message too large: {err}; limit {} bytes", daemon.engine.limits.max_message_bytes);
                    conn.error(None, ErrorCode::BadRequest, &message).await;
                    if let Some(close) = close_tx.take() {
                        let _ = close.send((CloseCode::Size, "message too large"));
                    }
                    break Ending::Refused;
                }
                Some(Err(err)) => {
                    tracing::info!(%peer, connection, %err, "connection error");
                    break Ending::Dropped;
                }
            },
            // Wakes the drain check above when the session's last command is done.
            () = conn.session.tasks.wait(), if draining => {}
            () = daemon.shutdown.cancelled(), if !draining => {
                draining = true;
                conn.session.tasks.close();
            }
            changed = reloads.changed() => {
                if changed.is_ok() && daemon.clients.table().current(&conn.client).is_none() {
                    if let Some(close) = close_tx.take() {
                        let _ = close.send((CloseCode::Policy, "client removed from the clients file"));
                    }
                    break Ending::Revoked;
                }
            }
            () = writer_gone.cancelled() => break Ending::Dropped,
        }
    };

    // Evicted while something else woke us: the session is another connection's now, and
    // what our writer still holds is owed to it.
    let ending = if conn.evicted.is_cancelled() {
        Ending::TakenOver
    } else {
        ending
    };
    let session = conn.session.clone();
    let mut writer_done = false;
    match ending {
        // Nobody reads replies any more: the writer answers the close frame and stops.
        Ending::Closed => peer_closed.cancel(),
        Ending::Dropped | Ending::TakenOver | Ending::Shed => {
            // Its queue goes back to the session before anything newer does, so the client
            // gets the replies in order when it resumes (or is resuming: the new connection
            // waits for this). It writes nothing more: this is quick.
            writer_stop.cancel();
            if tokio::time::timeout(FLUSH_TIMEOUT, &mut writer)
                .await
                .is_err()
            {
                writer.abort();
            }
            writer_done = true;
        }
        _ => {}
    }
    match session.detach(connection) {
        // Another connection holds the session now: not ours to end.
        None => {}
        // Taken over, and the connection that took it has let go already (it dropped before
        // this one finished): that one's end decided the session's fate, not ours. (Ended
        // here, a session kept for a resume was lost: found by the resume race test.)
        Some(_) if ending == Ending::TakenOver => {}
        Some(generation)
            if matches!(ending, Ending::Dropped | Ending::Shed) && !session.grace.is_zero() =>
        {
            tracing::info!(%peer, connection, session = %session.id, grace = ?session.grace, running = session.running.len(), "connection dropped; session kept for a resume");
            daemon.tasks.spawn(expire_after_grace(
                daemon.clone(),
                session.clone(),
                generation,
            ));
            for old in daemon
                .sessions
                .excess_detached(&session.client, MAX_DETACHED_PER_CLIENT)
            {
                tracing::info!(session = %old.id, client = %old.client.name, "too many detached sessions; ending the oldest");
                end_session(&daemon, &old).await;
            }
        }
        Some(_) => end_session(&daemon, &session).await,
    }
    if ending == Ending::Shutdown {
        if let Some(close) = close_tx.take() {
            let _ = close.send((CloseCode::Away, "executor shutting down"));
        }
    }
    drop(conn);
    drop(tx);
    if !writer_done
        && tokio::time::timeout(FLUSH_TIMEOUT, &mut writer)
            .await
            .is_err()
    {
        writer.abort();
    }
    tracing::info!(%peer, connection, ?ending, "client disconnected");
}

/// Kill a session's commands, wait for them, and remove its scratch workspace.
pub async fn end_session(daemon: &Daemon, session: &Session) {
    if let Some(scratch) = daemon.sessions.end(session).await {
        let removed = tokio::task::spawn_blocking(move || {
            crate::workspaces::remove(&scratch).map_err(|err| (scratch, err))
        })
        .await;
        match removed {
            Ok(Ok(())) => {}
            Ok(Err((dir, err))) => {
                tracing::error!(dir = %dir.display(), %err, "cannot remove a session's scratch workspace; the next start removes it")
            }
            Err(err) => tracing::error!(%err, "scratch removal panicked"),
        }
    }
}

/// Send `message`, a text message in frames of at most [`FRAME_BYTES`] (RFC 6455 section
/// 5.4 fragmentation). tungstenite's write buffer keeps the capacity of the largest frame it
/// ever held for the connection's life: one result of 1 MiB sent whole made an idle
/// connection hold 1 MiB until it closed (issue 35: 30 idle connections, +30 MiB).
async fn send_in_frames<S>(sink: &mut S, message: Message) -> Result<(), WsError>
where
    S: futures_util::Sink<Message, Error = WsError> + Unpin,
{
    let text = match message {
        Message::Text(text) if text.len() > FRAME_BYTES => text,
        other => return sink.send(other).await,
    };
    let bytes = Bytes::from(text);
    let mut from = 0;
    while from < bytes.len() {
        let to = (from + FRAME_BYTES).min(bytes.len());
        let opcode = if from == 0 {
            OpCode::Data(Data::Text)
        } else {
            OpCode::Data(Data::Continue)
        };
        let frame = Frame::message(bytes.slice(from..to), opcode, to == bytes.len());
        sink.feed(Message::Frame(frame)).await?;
        from = to;
    }
    sink.flush().await
}

/// End a detached session whose client did not come back in time.
async fn expire_after_grace(daemon: Arc<Daemon>, session: Arc<Session>, generation: u64) {
    tokio::select! {
        () = tokio::time::sleep(session.grace) => {}
        () = session.ended.cancelled() => return,
        () = daemon.shutdown.cancelled() => {}
    }
    if daemon.shutdown.is_cancelled() || session.expire(generation) {
        tracing::info!(session = %session.id, running = session.running.len(), "grace period over; ending the session");
        end_session(&daemon, &session).await;
    }
}

pub(super) struct Connection {
    pub(super) daemon: Arc<Daemon>,
    pub(super) client: Arc<Client>,
    hello: protocol::Hello,
    pub(super) session: Arc<Session>,
    current: watch::Sender<Arc<Session>>,
    tx: mpsc::Sender<ServerMessage>,
    pub(super) peer: SocketAddr,
    pub(super) connection: u64,
    /// Cancelled when another connection resumes our session.
    evicted: CancellationToken,
    /// This connection's writer, for a session it attaches to.
    writer: WriterControl,
    /// No message read yet (only then may it be `resume`).
    first: bool,
}

impl Connection {
    pub(super) async fn reply(&self, msg: ServerMessage) {
        self.session.send(msg).await;
    }

    pub(super) async fn error(&self, id: Option<String>, code: ErrorCode, message: &str) {
        self.reply(ServerMessage::Error(ErrorMessage {
            id,
            code,
            message: message.to_string(),
        }))
        .await;
    }

    /// Send what the session kept while no connection was attached, then go live.
    async fn replay(&self) {
        while let Some(msg) = self.session.next_replay() {
            if self.tx.send(msg).await.is_err() {
                break;
            }
        }
    }

    async fn handle_text(&mut self, text: &str, draining: bool) {
        if self.evicted.is_cancelled() {
            return;
        }
        let first = std::mem::replace(&mut self.first, false);
        let msg = match serde_json::from_str::<ClientMessage>(text) {
            Ok(msg) => msg,
            Err(err) => {
                // Name the request in the error if its id can be read at all.
                let id = serde_json::from_str::<serde_json::Value>(text)
                    .ok()
                    .and_then(|v| v.get("id")?.as_str().map(str::to_string));
                let message = format!("malformed message: {err}");
                self.error(id, ErrorCode::BadRequest, &message).await;
                return;
            }
        };
        match msg {
            ClientMessage::Exec(req) => self.exec(req, draining).await,
            ClientMessage::Cancel(CancelRequest { id }) => match self.session.running.get(&id) {
                Some(cancel) => cancel.cancel(),
                // Ended, its result being queued: that result answers the cancel (an error
                // now could reach the client before it).
                None if self.session.running.is_finishing(&id) => {}
                None => {
                    let message = format!("no running command with id {id:?}");
                    self.error(Some(id), ErrorCode::NotFound, &message).await;
                }
            },
            ClientMessage::Resume(req) if first => self.resume(req, draining).await,
            ClientMessage::Resume(_) => {
                self.error(
                    None,
                    ErrorCode::BadRequest,
                    "resume must be the first message on a connection",
                )
                .await;
            }
            other => self.handle_v1_1(other, draining).await,
        }
    }

    /// Take over a session whose connection dropped (or is about to be found dead).
    async fn resume(&mut self, req: ResumeRequest, draining: bool) {
        if draining {
            self.error(
                None,
                ErrorCode::ShuttingDown,
                "the executor is shutting down",
            )
            .await;
            return;
        }
        if req.session == self.session.id {
            self.error(
                None,
                ErrorCode::BadRequest,
                "that is this connection's own session",
            )
            .await;
            return;
        }
        let attached = self
            .daemon
            .sessions
            .find(&req.session, &self.client)
            .map(|old| {
                let attached = old.attach(self.connection, self.tx.clone(), self.writer.clone());
                (old, attached)
            });
        let Some((
            old,
            Attached::Yes {
                evicted,
                previous_writer,
            },
        )) = attached
        else {
            let message = format!(
                "no session {:?} to resume: unknown, or its grace period ran out and its commands were killed",
                req.session
            );
            self.error(None, ErrorCode::NotFound, &message).await;
            return;
        };
        // The session made for this connection never ran anything: end it.
        let fresh = std::mem::replace(&mut self.session, old.clone());
        self.current.send_replace(old.clone());
        self.evicted = evicted;
        fresh.detach(self.connection);
        end_session(&self.daemon, &fresh).await;
        // A connection it was taken from first hands back what it still had queued.
        if let Some(previous) = previous_writer {
            if tokio::time::timeout(FLUSH_TIMEOUT, previous.cancelled())
                .await
                .is_err()
            {
                tracing::warn!(session = %old.id, "the previous connection did not hand back its queue in time");
            }
        }
        let running = old.resend_written(&req.awaiting);
        tracing::info!(connection = self.connection, session = %old.id, client = %self.client.name, running = running.len(), "session resumed");
        let resumed = ServerMessage::Resumed(Resumed {
            session: old.id.clone(),
            running,
        });
        if self.tx.send(resumed).await.is_ok() {
            self.replay().await;
        }
    }

    async fn exec(&mut self, req: ExecRequest, draining: bool) {
        if let Some((valid, job, held)) = self.admit_job(req, draining).await {
            let task = self.session.tasks.track_future(async move {
                job.run(valid).await;
                drop(held);
            });
            self.daemon.tasks.spawn(task);
        }
    }

    /// Admit a request: on success it is registered as running in the session and its job is
    /// ready (run it, then drop the slots it holds); on refusal the audit log and the client
    /// are told, and `None` returned.
    pub(super) async fn admit_job(
        &mut self,
        req: ExecRequest,
        draining: bool,
    ) -> Option<(ValidRequest, Job, (tokio::sync::OwnedSemaphorePermit, Slot))> {
        let id = req.id.clone();
        // What the audit log keeps of a refused request.
        let asked = (req.command.clone(), req.cwd.clone(), req.profile.clone());
        match self.admit(req, draining) {
            Ok((valid, permit, slot)) => {
                let cancel = CancellationToken::new();
                self.session
                    .running
                    .insert(valid.id.clone(), cancel.clone());
                let job = Job {
                    daemon: self.daemon.clone(),
                    session: self.session.clone(),
                    client: self.client.name.clone(),
                    peer: self.peer,
                    connection: self.connection,
                    cancel,
                    in_flight: self.daemon.metrics.command_started(&self.client.name),
                };
                Some((valid, job, (permit, slot)))
            }
            Err(err) => {
                self.daemon
                    .metrics
                    .command_refused(&self.client.name, err.code);
                let (command, cwd, profile) = asked;
                self.daemon
                    .audit
                    .record(AuditRecord {
                        ts: now_rfc3339(),
                        client: self.client.name.clone(),
                        peer: self.peer.to_string(),
                        connection: self.connection,
                        session: self.session.id.clone(),
                        id: id.clone(),
                        command,
                        command_bytes: None,
                        cwd: cwd.unwrap_or_default(),
                        profile: profile.unwrap_or_default(),
                        ended: "refused".into(),
                        returncode: None,
                        duration_ms: 0.0,
                        output_bytes: 0,
                        killed_processes: 0,
                        error: Some(format!("{}: {}", err.code, err.message)),
                    })
                    .await;
                self.error(Some(id), err.code, &err.message).await;
                None
            }
        }
    }

    /// Validate a request and take its slots, or say why not.
    pub(super) fn admit(
        &self,
        req: ExecRequest,
        draining: bool,
    ) -> Result<(ValidRequest, tokio::sync::OwnedSemaphorePermit, Slot), ExecError> {
        let limits = &self.daemon.engine.limits;
        if draining {
            return Err(ExecError::new(
                ErrorCode::ShuttingDown,
                "the executor is shutting down",
            ));
        }
        // Every command leaves a record: none is accepted that the audit log could not keep.
        self.daemon
            .audit
            .ready()
            .map_err(|why| ExecError::new(ErrorCode::EnvironmentError, why))?;
        let mut valid = validate(req, limits)
            .map_err(|err| ExecError::new(ErrorCode::BadRequest, err.to_string()))?;
        // The client's entry as of the last reload: limits and profiles may have changed.
        let Some(client) = self.daemon.clients.table().current(&self.client) else {
            return Err(ExecError::new(
                ErrorCode::ProfileDenied,
                "this client was removed from the clients file",
            ));
        };
        let profile = valid
            .profile
            .clone()
            .unwrap_or_else(|| self.hello.default_profile.clone());
        if !profile.is_empty() && !client.may_use(&profile) {
            let allowed = client.profiles.as_deref().unwrap_or_default().join(", ");
            return Err(ExecError::new(
                ErrorCode::ProfileDenied,
                format!(
                    "client {} may not use profile {profile:?}; it may use: {allowed}",
                    client.name
                ),
            ));
        }
        self.daemon
            .engine
            .profile(Some(&profile).filter(|p| !p.is_empty()).map(String::as_str))?;
        valid.profile = Some(profile).filter(|p| !p.is_empty());
        valid.client_network = client.network.clone();
        valid.client = client.name.clone();
        valid.session = self.session.id.clone();
        if self.session.running.contains_key(&valid.id) {
            return Err(ExecError::new(
                ErrorCode::DuplicateId,
                format!("a command with id {:?} is already running", valid.id),
            ));
        }
        if self.session.running.len() >= limits.max_commands_per_connection {
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
        // The policy and identity the session started with: a reload does not move a
        // session's files or change who owns them.
        let started = &self.session.client;
        let workspaces = &self.daemon.workspaces;
        valid.spec.identity = started.uid.map(|uid| (uid, uid));
        let owner = workspaces.owner_for(valid.spec.identity);
        // The client's volume first, when it has a disk quota: everything below is made in it.
        valid.spec.volume = workspaces
            .mount_volume(started)
            .map_err(|err| ExecError::new(ErrorCode::EnvironmentError, err.to_string()))?;
        valid.spec.workspace = match started.workspace {
            WorkspacePolicy::Shared => None,
            WorkspacePolicy::PerClient => Some(workspaces.workspace_of(started)),
            WorkspacePolicy::PerConnection => self.session.scratch.clone(),
        };
        let home = workspaces.home_of_client(started);
        // `{home}/tmp`: the client's own TMPDIR (landlock shares the host's /tmp).
        let tmp = home.join("tmp");
        for dir in valid.spec.workspace.iter().chain([&home, &tmp]) {
            workspaces
                .ensure(dir, owner)
                .map_err(|err| ExecError::new(ErrorCode::EnvironmentError, format!("{err:#}")))?;
        }
        valid.spec.home = Some(home);
        // While any client has a workspace of its own, no command may reach the others'.
        if self.daemon.clients.table().any_private_workspace() {
            valid.spec.private_root = Some(self.daemon.workspaces.root().to_path_buf());
        }
        // Last, so that the rate is charged only for a command that will run.
        let slot = self
            .daemon
            .clients
            .usage(&client.name)
            .admit(&client.name, &client.limits)
            .map_err(|refusal| {
                tracing::info!(client = %client.name, limit = refusal.limit, "command refused by a client limit");
                self.daemon.metrics.limit_hit(&client.name, refusal.limit);
                ExecError::new(refusal.code, refusal.message)
            })?;
        Ok((valid, permit, slot))
    }
}

/// How long a stopped upload gets to remove its temporary file before it is killed.
const ABORT_GRACE: Duration = Duration::from_secs(2);

/// One admitted command (or process, or file operation).
pub(super) struct Job {
    pub(super) daemon: Arc<Daemon>,
    pub(super) session: Arc<Session>,
    pub(super) client: String,
    pub(super) peer: SocketAddr,
    pub(super) connection: u64,
    pub(super) cancel: CancellationToken,
    pub(super) in_flight: InFlight,
}

impl Job {
    async fn run(self, req: ValidRequest) {
        let sink = req.stream.then(|| OutputSink {
            id: req.id.clone(),
            to: self.session.clone(),
        });
        let result = self.execute(&req, Io::Capture(sink)).await;
        let reply = match &result {
            Ok(result) => ServerMessage::Result(result.clone()),
            Err(err) => ServerMessage::Error(ErrorMessage {
                id: Some(req.id.clone()),
                code: err.code,
                message: err.message.clone(),
            }),
        };
        self.session.running.finishing(&req.id);
        self.session.send(reply).await;
        self.session.running.finished(&req.id);
        self.account(&req, &result).await;
    }

    /// Run the request until it ends, is cancelled, its session ends or the daemon drains.
    pub(super) async fn execute(
        &self,
        req: &ValidRequest,
        io: Io,
    ) -> Result<protocol::ExecResult, ExecError> {
        self.execute_aborting(req, io, None).await
    }

    /// As `execute`; when it is stopped, `abort` (an upload's) is cancelled first and the
    /// command gets [`ABORT_GRACE`] to end by itself (an upload removes its temporary file)
    /// before its tree is killed.
    pub(super) async fn execute_aborting(
        &self,
        req: &ValidRequest,
        io: Io,
        abort: Option<CancellationToken>,
    ) -> Result<protocol::ExecResult, ExecError> {
        let stop = async {
            let reason = tokio::select! {
                () = self.cancel.cancelled() => StopReason::Cancelled,
                () = self.session.ended.cancelled() => StopReason::Disconnected,
                () = self.daemon.shutdown.cancelled() => StopReason::Shutdown,
            };
            if let Some(abort) = abort {
                abort.cancel();
                tokio::time::sleep(ABORT_GRACE).await;
            }
            reason
        };
        self.daemon.engine.execute(req, io, stop).await
    }

    /// The audit record, metrics and usage of a request that ran (or failed to).
    pub(super) async fn account(
        self,
        req: &ValidRequest,
        result: &Result<protocol::ExecResult, ExecError>,
    ) {
        let engine = &self.daemon.engine;
        let profile = req
            .profile
            .clone()
            .unwrap_or_else(|| engine.default_profile.clone());
        let cwd = req
            .spec
            .cwd
            .clone()
            .or_else(|| req.spec.workspace.clone())
            .unwrap_or_else(|| engine.plan_settings.workspace.clone());
        let mut record = AuditRecord {
            ts: now_rfc3339(),
            client: self.client.clone(),
            peer: self.peer.to_string(),
            connection: self.connection,
            session: self.session.id.clone(),
            id: req.id.clone(),
            command: req.spec.command.clone(),
            command_bytes: None,
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
                record.ended = extra.ended.as_str().to_string();
                record.returncode = Some(result.returncode);
                record.duration_ms = extra.duration_ms;
                record.output_bytes = extra.output_bytes;
                record.killed_processes = extra.killed_processes;
                // A process's output was counted as it arrived (`budget::Owner`).
                let counted =
                    req.spec.builtin.is_none() && req.spec.stdin != sandbox::plan::StdinKind::Null;
                if !counted {
                    self.daemon
                        .clients
                        .usage(&self.client)
                        .add_output(extra.output_bytes);
                }
                tracing::debug!(id = %req.id, rc = result.returncode, ended = %record.ended, "command finished");
                self.daemon
                    .metrics
                    .command_finished(self.in_flight, &record.profile, result);
            }
            Err(err) => {
                tracing::warn!(id = %req.id, code = %err.code, message = %err.message, "command failed to run");
                record.error = Some(format!("{}: {}", err.code, err.message));
                self.daemon
                    .metrics
                    .command_failed(self.in_flight, &record.profile, err.code);
            }
        }
        self.daemon.audit.record(record).await;
    }
}
