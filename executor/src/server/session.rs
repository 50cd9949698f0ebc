//! Sessions: a client's running commands and the replies owed to it.
//!
//! A session starts with a connection. If the connection drops (without a close frame) and the
//! client has a grace period, the session outlives it: its commands keep running and their
//! replies wait in the outbox until the client resumes the session on a new connection, or the
//! grace period ends and the commands are killed. Replies go through the session, never
//! straight to a socket, so a command never needs to know which connection (if any) is there.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use protocol::{ExecResult, ServerMessage};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::clients::Client;

/// Output bytes of streamed chunks kept for a detached session; past it, chunks are dropped
/// (the result still carries the output's head and tail, and `seq` shows the gap).
const OUTBOX_OUTPUT_BYTES: usize = 4 << 20;
/// Results kept after they were written, in case the connection broke before they arrived.
const WRITTEN_RESULTS: usize = 16;

/// Every live session, by id.
#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, Arc<Session>>>,
}

impl Sessions {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<Session>>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn create(
        &self,
        client: Arc<Client>,
        grace: Duration,
        scratch_root: Option<PathBuf>,
    ) -> Arc<Session> {
        let id = new_session_id();
        let session = Arc::new(Session {
            scratch: scratch_root.map(|root| root.join(&id)),
            id: id.clone(),
            client,
            grace,
            running: Running::default(),
            ended: CancellationToken::new(),
            tasks: TaskTracker::new(),
            link: Mutex::new(Link::default()),
        });
        self.lock().insert(id, session.clone());
        session
    }

    /// The session `id` if it exists, belongs to `client` and has not ended. Another
    /// client's session is reported exactly like a missing one.
    pub fn find(&self, id: &str, client: &str) -> Option<Arc<Session>> {
        self.lock()
            .get(id)
            .filter(|s| s.client.name == client && !s.ended.is_cancelled())
            .cloned()
    }

    pub fn all(&self) -> Vec<Arc<Session>> {
        self.lock().values().cloned().collect()
    }

    /// End `session` for good: kill its commands, wait for them, forget it. Returns its
    /// scratch workspace, for the caller to remove.
    pub async fn end(&self, session: &Session) -> Option<PathBuf> {
        session.ended.cancel();
        session.tasks.close();
        session.tasks.wait().await;
        self.lock().remove(&session.id);
        session.scratch.clone()
    }
}

fn new_session_id() -> String {
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_err() {
        // Unguessability is what makes a session private; without randomness, make it
        // unusable rather than predictable.
        return format!("unresumable-{}", std::process::id());
    }
    hex::encode(bytes)
}

pub struct Session {
    pub id: String,
    /// The client as it authenticated; its current limits come from the registry.
    pub client: Arc<Client>,
    /// How long commands outlive a dropped connection (0: killed at once).
    pub grace: Duration,
    /// Per-connection workspace, removed when the session ends.
    pub scratch: Option<PathBuf>,
    pub running: Running,
    /// Cancelled when the session ends: its commands are killed and replies dropped.
    pub ended: CancellationToken,
    /// The session's command tasks.
    pub tasks: TaskTracker,
    link: Mutex<Link>,
}

#[derive(Default)]
struct Link {
    attached: Option<Attachment>,
    /// Bumped on every attach, so a grace timer knows whether the client came back.
    generation: u64,
    /// Replies no connection took, oldest first.
    outbox: VecDeque<ServerMessage>,
    outbox_output_bytes: usize,
    dropped_output: bool,
    /// Results written to a connection that may have broken before they arrived.
    written: VecDeque<ExecResult>,
}

struct Attachment {
    connection: u64,
    tx: mpsc::Sender<ServerMessage>,
    /// Cancelled when another connection takes the session over.
    evicted: CancellationToken,
    /// While the outbox is replayed, new replies queue behind it.
    replaying: bool,
}

impl Session {
    fn link(&self) -> MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn resumable(&self) -> bool {
        !self.grace.is_zero()
    }

    /// Send a reply to the attached connection, or keep it for the next one.
    pub async fn send(&self, msg: ServerMessage) {
        let tx = {
            let link = self.link();
            match &link.attached {
                Some(a) if !a.replaying => Some(a.tx.clone()),
                _ => None,
            }
        };
        match tx {
            Some(tx) => {
                if let Err(mpsc::error::SendError(msg)) = tx.send(msg).await {
                    self.keep(msg);
                }
            }
            None => self.keep(msg),
        }
    }

    /// Keep a reply that a connection could not take, for the next one (or hand it to the
    /// connection that took over meanwhile), if anyone may still come for it.
    pub fn keep(&self, msg: ServerMessage) {
        let mut link = self.link();
        self.keep_locked(&mut link, msg);
    }

    /// Take back everything still queued for a connection that is going away, oldest first.
    /// Under the lock: a reply that fails to enter the closed queue meanwhile (its sender then
    /// calls `keep`) lands after them.
    pub fn keep_queue(&self, rx: &mut mpsc::Receiver<ServerMessage>) {
        let mut link = self.link();
        rx.close();
        while let Ok(msg) = rx.try_recv() {
            self.keep_locked(&mut link, msg);
        }
    }

    fn keep_locked(&self, link: &mut Link, msg: ServerMessage) {
        if self.ended.is_cancelled() {
            return;
        }
        let msg = match &link.attached {
            Some(a) if !a.replaying => match a.tx.try_send(msg) {
                Ok(()) => return,
                Err(
                    mpsc::error::TrySendError::Full(msg) | mpsc::error::TrySendError::Closed(msg),
                ) => msg,
            },
            _ => msg,
        };
        if !self.resumable() && link.attached.is_none() {
            return;
        }
        if let ServerMessage::Output(chunk) = &msg {
            if link.outbox_output_bytes + chunk.data.len() > OUTBOX_OUTPUT_BYTES {
                if !link.dropped_output {
                    tracing::info!(session = %self.id, "detached session's output exceeds the outbox; dropping streamed chunks");
                    link.dropped_output = true;
                }
                return;
            }
            link.outbox_output_bytes += chunk.data.len();
        }
        link.outbox.push_back(msg);
    }

    /// Remember a result the writer put on the wire (only sessions that can be resumed).
    pub fn written(&self, msg: &ServerMessage) {
        if let (true, ServerMessage::Result(result)) = (self.resumable(), msg) {
            let mut link = self.link();
            if link.written.len() == WRITTEN_RESULTS {
                link.written.pop_front();
            }
            link.written.push_back(result.clone());
        }
    }

    /// Attach a connection. Returns the token cancelled if another connection takes over.
    /// Replies keep queueing in the outbox until `next_replay` drains it.
    pub fn attach(
        &self,
        connection: u64,
        tx: mpsc::Sender<ServerMessage>,
        awaiting: &[String],
    ) -> CancellationToken {
        let evicted = CancellationToken::new();
        let mut link = self.link();
        if let Some(old) = link.attached.take() {
            tracing::info!(session = %self.id, old = old.connection, new = connection, "session taken over by a new connection");
            old.evicted.cancel();
        }
        // Results written to the old connection that the client says it never got go first.
        let queued: Vec<String> = link
            .outbox
            .iter()
            .filter_map(|m| match m {
                ServerMessage::Result(r) => Some(r.id.clone()),
                _ => None,
            })
            .collect();
        let resend: Vec<ExecResult> = std::mem::take(&mut link.written)
            .into_iter()
            .filter(|r| awaiting.contains(&r.id) && !queued.contains(&r.id))
            .collect();
        for result in resend.into_iter().rev() {
            link.outbox.push_front(ServerMessage::Result(result));
        }
        link.generation += 1;
        link.dropped_output = false;
        link.attached = Some(Attachment {
            connection,
            tx,
            evicted: evicted.clone(),
            replaying: true,
        });
        evicted
    }

    /// The next kept reply for the attached connection; `None` once the outbox is empty, and
    /// from then on replies go straight to the connection.
    pub fn next_replay(&self) -> Option<ServerMessage> {
        let mut link = self.link();
        match link.outbox.pop_front() {
            Some(msg) => {
                if let ServerMessage::Output(chunk) = &msg {
                    link.outbox_output_bytes -= chunk.data.len();
                }
                Some(msg)
            }
            None => {
                if let Some(a) = &mut link.attached {
                    a.replaying = false;
                }
                None
            }
        }
    }

    /// Let go of `connection` (if it is still the attached one). Returns the attach
    /// generation, for the grace timer.
    pub fn detach(&self, connection: u64) -> u64 {
        let mut link = self.link();
        if link
            .attached
            .as_ref()
            .is_some_and(|a| a.connection == connection)
        {
            link.attached = None;
        }
        link.generation
    }

    /// Whether nobody attached since `generation` was handed out.
    pub fn still_detached(&self, generation: u64) -> bool {
        let link = self.link();
        link.attached.is_none() && link.generation == generation
    }
}

impl crate::runner::Replies for Session {
    fn send(&self, msg: ServerMessage) -> futures_util::future::BoxFuture<'_, ()> {
        Box::pin(Session::send(self, msg))
    }
}

/// Cancel handles of a session's running commands, by client id. Shared with the jobs so that
/// each removes its own id right before replying.
#[derive(Clone, Default)]
pub struct Running(Arc<Mutex<HashMap<String, CancellationToken>>>);

impl Running {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, CancellationToken>> {
        // A poisoned lock only means a job panicked while holding it; the map is still valid.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
    pub fn insert(&self, id: String, cancel: CancellationToken) {
        self.lock().insert(id, cancel);
    }
    pub fn remove(&self, id: &str) {
        self.lock().remove(id);
    }
    pub fn get(&self, id: &str) -> Option<CancellationToken> {
        self.lock().get(id).cloned()
    }
    pub fn contains_key(&self, id: &str) -> bool {
        self.lock().contains_key(id)
    }
    pub fn len(&self) -> usize {
        self.lock().len()
    }
    pub fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.lock().keys().cloned().collect();
        ids.sort();
        ids
    }
}
