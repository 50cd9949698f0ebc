//! Sending a command and getting its result across broken connections: reconnect with
//! backoff, take the session back with `resume`, and find out where the request stands.

use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use protocol::{CancelRequest, ClientMessage, ErrorCode, ExecRequest, Hello, ServerMessage};
use serde_json::Value;
use tokio_tungstenite::tungstenite::Message;

use super::connection::{connect, resume, Resume, Ws};
use super::{EnvError, Environment, Output};

/// Extra time past a command's own timeout before the executor counts as unresponsive.
const RESULT_SLACK: Duration = Duration::from_secs(30);
/// Times one request is sent before the connection counts as unusable.
const SEND_ATTEMPTS: u32 = 3;
/// After a resume, time granted for the result the executor replays, even if the command's
/// own deadline passed while we were reconnecting.
const REPLAY_PATIENCE: Duration = Duration::from_secs(10);
/// How long a deliberate end (closing, cancelling) may spend taking back a session that a
/// lost connection left running on the executor.
const TAKE_BACK_PATIENCE: Duration = Duration::from_secs(5);

impl Environment {
    pub(super) async fn exec_once(&mut self, request: &ExecRequest) -> Result<Attempt, EnvError> {
        let text = serde_json::to_string(&ClientMessage::Exec(request.clone())).map_err(|e| {
            EnvError::Unusable {
                code: "client".into(),
                message: format!("cannot encode the request: {e}"),
            }
        })?;
        let wait = Duration::from_secs_f64(
            request
                .timeout
                .unwrap_or(self.hello.limits.default_timeout)
                .max(0.0),
        ) + RESULT_SLACK;
        let mut deadline = tokio::time::Instant::now() + wait;
        let mut sends = 0;
        let mut must_send = true;
        // After a resume in which the request was not running: the id of a sync message whose
        // answer comes after everything the executor replayed (see `Environment::recover`).
        let mut sync: Option<String> = None;
        // Whether the deadline already sent us to a new connection for the result.
        let mut asked_again = false;
        loop {
            if must_send {
                sends += 1;
                if sends > SEND_ATTEMPTS {
                    return Err(self.lost("the connection failed while sending a command"));
                }
                let ws = self.connected().await?;
                let sent = ws.send(Message::text(text.clone())).await.is_ok();
                self.last_id = Some(request.id.clone());
                deadline = tokio::time::Instant::now() + wait;
                if sent {
                    must_send = false;
                    continue;
                }
                // The request may or may not have reached the executor before the break.
                self.connection_lost();
                match self.recover(&request.id).await? {
                    // A new session never saw the request (the old one killed it if it did).
                    Standing::Gone => {}
                    Standing::Running => must_send = false,
                    Standing::Unsure(id) => {
                        must_send = false;
                        sync = Some(id);
                    }
                }
                continue;
            }
            let Some(ws) = self.ws.as_mut() else {
                return Err(self.lost("no connection"));
            };
            let frame = match tokio::time::timeout_at(deadline, ws.next()).await {
                Ok(frame) => frame,
                Err(_) if !asked_again && !self.resume_grace.is_zero() => {
                    // The connection may have died silently (an outage that delivers no FIN
                    // or RST is noticed by neither side) with the result written into it:
                    // ask for the session on a new connection, whose replay has the result.
                    asked_again = true;
                    None
                }
                Err(_) => {
                    // Unresponsive: end the session (a close frame kills its commands) rather
                    // than leave it running for a resume nobody will ask for.
                    self.close_connection().await;
                    return Err(self.lost("the executor sent no result in time"));
                }
            };
            let text = match frame {
                Some(Ok(Message::Text(text))) => text,
                Some(Ok(Message::Close(_))) => {
                    // The executor closed the connection deliberately (shutdown, revoked
                    // client): that ends the session and its commands; no resume.
                    self.session_over();
                    self.connected().await?;
                    return Ok(Attempt::Done(Output::not_run(CUT_SHORT)));
                }
                Some(Err(_)) | None => {
                    self.connection_lost();
                    match self.recover(&request.id).await? {
                        // The executor killed the command with the old session; its result
                        // is gone. We are connected again: the model learns it was cut short.
                        Standing::Gone => return Ok(Attempt::Done(Output::not_run(CUT_SHORT))),
                        Standing::Running => {}
                        Standing::Unsure(id) => sync = Some(id),
                    }
                    // Its result comes on the new connection, from the replay or live.
                    deadline = deadline.max(tokio::time::Instant::now() + REPLAY_PATIENCE);
                    continue;
                }
                Some(Ok(_)) => continue,
            };
            let message: ServerMessage = match serde_json::from_str(text.as_str()) {
                Ok(message) => message,
                Err(e) => {
                    return Err(EnvError::Unusable {
                        code: "protocol".into(),
                        message: format!("the executor sent an unreadable message ({e})"),
                    })
                }
            };
            match message {
                ServerMessage::Result(result) if result.id == request.id => {
                    let extra = serde_json::to_value(&result.extra).unwrap_or(Value::Null);
                    return Ok(Attempt::Done(Output {
                        output: result.output,
                        returncode: result.returncode,
                        exception_info: result.exception_info,
                        extra,
                    }));
                }
                ServerMessage::Error(err)
                    if sync.is_some() && err.id.as_deref() == sync.as_deref() =>
                {
                    // Everything replayed came before this answer, and no result of ours was
                    // among it: the request never reached the executor. Send it again.
                    sync = None;
                    must_send = true;
                }
                ServerMessage::Error(err)
                    if err.id.as_deref() == Some(&request.id) || err.id.is_none() =>
                {
                    return self.map_error(err).await;
                }
                _ => continue,
            }
        }
    }

    /// After the connection broke while `id` was being sent or run: reconnect, taking our
    /// session back if the executor may still keep it, and find out where `id` stands.
    async fn recover(&mut self, id: &str) -> Result<Standing, EnvError> {
        let awaiting = [id.to_string()];
        for _ in 0..SEND_ATTEMPTS {
            let running = match self.reconnect(&awaiting).await? {
                Reconnected::Fresh => return Ok(Standing::Gone),
                Reconnected::Resumed { running } => running,
            };
            if running.iter().any(|r| r == id) {
                return Ok(Standing::Running);
            }
            // Not running: its result (or error) is among what the executor replays right
            // after `resumed`, or the request never reached it. The executor answers messages
            // in order and replays before it reads the next one, so its answer to a cancel of
            // an id nobody uses (not_found) comes after the whole replay: if our result has
            // not come by then, it never will.
            self.next_id += 1;
            let sync = format!("sync{}", self.next_id);
            let cancel = ClientMessage::Cancel(CancelRequest { id: sync.clone() });
            let sent = match (serde_json::to_string(&cancel), self.ws.as_mut()) {
                (Ok(text), Some(ws)) => ws.send(Message::text(text)).await.is_ok(),
                _ => false,
            };
            if sent {
                return Ok(Standing::Unsure(sync));
            }
            self.connection_lost();
        }
        Err(self.lost("the connection kept failing right after a resume"))
    }

    async fn map_error(&mut self, err: protocol::ErrorMessage) -> Result<Attempt, EnvError> {
        match err.code {
            // A client quota (commands per minute) refills: wait like for a busy executor.
            ErrorCode::Busy | ErrorCode::QuotaExceeded => Ok(Attempt::Busy(err.message)),
            // The request itself was refused (e.g. a command longer than the executor allows):
            // the model can change it, so it sees this like a failed command.
            ErrorCode::BadRequest => Ok(Attempt::Done(Output::not_run(format!(
                "The executor refused to run this command: {}",
                err.message
            )))),
            ErrorCode::ShuttingDown => {
                self.session_over();
                Err(self.lost(&format!("the executor is shutting down: {}", err.message)))
            }
            ErrorCode::EnvironmentError
            | ErrorCode::ProfileDenied
            | ErrorCode::Internal
            | ErrorCode::DuplicateId
            | ErrorCode::NotFound
            | ErrorCode::Denied => Err(EnvError::Unusable {
                code: err.code.to_string(),
                message: err.message,
            }),
        }
    }

    /// The open connection, reconnecting with bounded backoff if it is gone (and resuming our
    /// session if the executor may still keep it).
    async fn connected(&mut self) -> Result<&mut Ws, EnvError> {
        if self.ws.is_none() {
            self.reconnect(&[]).await?;
        }
        self.ws.as_mut().ok_or_else(|| EnvError::Lost {
            url: String::new(),
            reason: "no connection".into(),
        })
    }

    /// Connect again with bounded backoff. If the session may still be waiting for us (the
    /// connection broke less than its grace period ago), ask for it back with `resume`,
    /// listing in `awaiting` the ids we have no result for; otherwise, or if the executor no
    /// longer has it, the new connection starts a fresh session.
    ///
    /// At least `reconnect_attempts` attempts are made, and while a resume is possible they go
    /// on (backoff capped at 4 s) until the grace period ends: a network outage shorter than
    /// the grace period then costs nothing.
    async fn reconnect(&mut self, awaiting: &[String]) -> Result<Reconnected, EnvError> {
        let mut delay = Duration::from_millis(250);
        let mut last = String::from("not attempted");
        let mut attempt = 0;
        loop {
            if attempt > 0 {
                let grace_left = self
                    .lost_at
                    .is_some_and(|t| t.elapsed() + delay < self.resume_grace);
                if attempt >= self.config.reconnect_attempts.max(1) && !grace_left {
                    return Err(self.lost(&last));
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(4));
            }
            attempt += 1;
            let (mut ws, hello) = match connect(&self.url, self.token.as_deref(), &self.tls).await {
                Ok(connection) => connection,
                Err(err) => {
                    // A refused certificate will be refused again: stop at once.
                    if !err.retry {
                        return Err(self.lost(&err.reason));
                    }
                    last = err.reason;
                    continue;
                }
            };
            if !self.may_resume() {
                crate::notes::note!("executor: reconnected to {}", self.url);
                self.start_fresh(ws, hello);
                return Ok(Reconnected::Fresh);
            }
            match resume(&mut ws, &self.session, awaiting).await {
                Ok(Resume::Resumed(running)) => {
                    crate::notes::note!(
                        "executor: reconnected to {} and resumed session {} ({} of its commands \
                         still running)",
                        self.url,
                        self.session,
                        running.len()
                    );
                    // The new hello's own session (and its workspace, for per-connection
                    // clients) was discarded by the executor: ours goes on.
                    self.hello = Hello {
                        session: self.session.clone(),
                        workspace: self.hello.workspace.clone(),
                        ..hello
                    };
                    self.ws = Some(ws);
                    self.lost_at = None;
                    return Ok(Reconnected::Resumed { running });
                }
                Ok(Resume::Refused(reason)) => {
                    // Expired (the executor killed its commands) or unknown: the connection
                    // goes on as the fresh session its hello announced.
                    crate::notes::note!(
                        "executor: reconnected to {}, but session {} could not be resumed: {reason}",
                        self.url, self.session
                    );
                    self.start_fresh(ws, hello);
                    return Ok(Reconnected::Fresh);
                }
                // The new connection failed too (the resume may have reached the executor;
                // then the session is detached again, with a new grace period): retry.
                Err(reason) => last = reason,
            }
        }
    }

    /// Use a new connection as a new session.
    fn start_fresh(&mut self, ws: Ws, hello: Hello) {
        self.hello = hello;
        self.ws = Some(ws);
        self.lost_at = None;
        self.adopt_session();
    }

    /// Take the session and its grace period from the current hello.
    pub(super) fn adopt_session(&mut self) {
        self.session = self.hello.session.clone();
        self.resume_grace =
            Duration::try_from_secs_f64(self.hello.resume_grace).unwrap_or(Duration::ZERO);
    }

    /// Whether the executor may still keep the session of the connection we lost.
    /// Whether to ask for the session back. Only the executor knows whether its grace period
    /// is over (it starts when the executor notices the drop, which may be much later than we
    /// did), so we always ask when there is one, and its `not_found` decides.
    fn may_resume(&self) -> bool {
        !self.session.is_empty() && !self.resume_grace.is_zero() && self.lost_at.is_some()
    }

    /// The connection broke (no close frame either way): the executor keeps the session for
    /// its grace period.
    fn connection_lost(&mut self) {
        self.ws = None;
        self.lost_at.get_or_insert_with(Instant::now);
    }

    /// The session ended on the executor's side (it sent a close frame): nothing to resume.
    fn session_over(&mut self) {
        self.ws = None;
        self.lost_at = None;
    }

    /// A deliberate end needs a connection to say so: if a lost connection left the session
    /// (and maybe a command) running on the executor, take it back, briefly.
    pub(super) async fn take_back(&mut self) {
        if self.ws.is_none() && self.may_resume() {
            let _ = tokio::time::timeout(TAKE_BACK_PATIENCE, self.reconnect(&[])).await;
        }
    }

    /// Send a close frame: the executor ends the session and kills its commands at once.
    pub(super) async fn close_connection(&mut self) {
        if let Some(mut ws) = self.ws.take() {
            let _ = tokio::time::timeout(Duration::from_secs(2), ws.close(None)).await;
        }
        self.lost_at = None;
    }

    fn lost(&self, reason: &str) -> EnvError {
        EnvError::Lost {
            url: self.url.clone(),
            reason: reason.to_string(),
        }
    }
}

/// What the model learns of a command whose connection broke and whose session is gone.
pub(super) const CUT_SHORT: &str =
    "The connection to the executor was lost while this command ran; the \
                         executor killed it, so it may have run partly.";

pub(super) enum Attempt {
    Done(Output),
    Busy(String),
}

enum Reconnected {
    /// The old session is back, with the ids of its commands still running.
    Resumed { running: Vec<String> },
    /// A new session: whatever the old one ran was killed.
    Fresh,
}

/// Where a request stands after a reconnection.
enum Standing {
    /// In a session that is gone (killed if it ran at all).
    Gone,
    /// Running in the resumed session; its result will come.
    Running,
    /// Not running in the resumed session: its result is in the replay, or it never reached
    /// the executor. The answer to the sync message with this id tells which.
    Unsure(String),
}
