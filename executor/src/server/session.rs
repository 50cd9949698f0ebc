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

use protocol::ServerMessage;
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
            processes: super::processes::Processes::default(),
            ended: CancellationToken::new(),
            tasks: TaskTracker::new(),
            link: Mutex::new(Link::default()),
            kept: std::sync::OnceLock::new(),
        });
        self.lock().insert(id, session.clone());
        session
    }

    /// The session `id` if it exists, belongs to `client` (same name and token) and has not
    /// ended. Another client's session is reported exactly like a missing one.
    pub fn find(&self, id: &str, client: &Client) -> Option<Arc<Session>> {
        self.lock()
            .get(id)
            .filter(|s| s.client.same_identity(client) && !s.ended.is_cancelled())
            .cloned()
    }

    /// Detached sessions of `client` beyond `keep`, oldest first: the ones to end so that a
    /// client dropping connections over and over cannot pile up sessions (and what they keep)
    /// for the length of the grace period.
    pub fn excess_detached(&self, client: &Client, keep: usize) -> Vec<Arc<Session>> {
        let mut detached: Vec<(std::time::Instant, Arc<Session>)> = self
            .lock()
            .values()
            .filter(|s| s.client.same_identity(client) && !s.ended.is_cancelled())
            .filter_map(|s| s.detached_since().map(|at| (at, s.clone())))
            .collect();
        detached.sort_by_key(|(at, _)| *at);
        let excess = detached.len().saturating_sub(keep);
        detached.into_iter().take(excess).map(|(_, s)| s).collect()
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
        session.processes.clear();
        self.lock().remove(&session.id);
        session.scratch.clone()
    }
}

fn new_session_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static FALLBACK: AtomicU64 = AtomicU64::new(0);
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_err() {
        // Without randomness the id is only unique, not secret; `find` still checks that the
        // session is the asking client's own.
        let n = FALLBACK.fetch_add(1, Ordering::Relaxed);
        tracing::warn!("no randomness for a session id; using a counter");
        return format!("{:016x}{:016x}", std::process::id(), n);
    }
    hex::encode(bytes)
}

pub struct Session {
    pub id: String,
    /// The client as it authenticated (its workspace policy holds for the session's life;
    /// its current limits come from the registry).
    pub client: Arc<Client>,
    /// How long commands outlive a dropped connection (0: killed at once).
    pub grace: Duration,
    /// Per-connection workspace, removed when the session ends.
    pub scratch: Option<PathBuf>,
    pub running: Running,
    /// Protocol 1.1: its processes and file operations, running and ended.
    pub processes: super::processes::Processes,
    /// Cancelled when the session ends: its commands are killed and replies dropped.
    pub ended: CancellationToken,
    /// The session's command tasks.
    pub tasks: TaskTracker,
    link: Mutex<Link>,
    /// The outbox's streamed output and the written replies kept for a resume, counted in
    /// the client's memory budget (once [`Session::count_in`] said whose).
    kept: std::sync::OnceLock<crate::budget::Held>,
}

#[derive(Default)]
struct Link {
    attached: Option<Attachment>,
    /// Bumped on every attach, so a grace timer knows whether the client came back.
    generation: u64,
    /// When the last connection let go (none attached since).
    detached_at: Option<std::time::Instant>,
    /// Replies no connection took, oldest first.
    outbox: VecDeque<ServerMessage>,
    outbox_output_bytes: usize,
    dropped_output: bool,
    /// Results (and errors) written to a connection that may have broken before they arrived.
    written: VecDeque<ServerMessage>,
    written_bytes: usize,
}

struct Attachment {
    connection: u64,
    tx: mpsc::Sender<ServerMessage>,
    /// Cancelled when another connection takes the session over.
    evicted: CancellationToken,
    /// Stops the connection's writer (it hands its queue back to the session).
    writer_stop: CancellationToken,
    /// Cancelled when the connection's writer has handed its queue back.
    writer_done: CancellationToken,
    /// While the outbox is replayed, new replies queue behind it.
    replaying: bool,
    /// Cancelled when the connection lets go of the session or another takes it over: what
    /// is tied to this connection (a download's chunks) stops at once.
    gone: CancellationToken,
}

/// A connection's writer, as `attach` needs it: how to stop it and how to know it is done.
#[derive(Clone, Default)]
pub struct WriterControl {
    pub stop: CancellationToken,
    pub done: CancellationToken,
}

/// What `attach` found.
pub enum Attached {
    /// The session is this connection's. `previous_writer` is cancelled once the connection
    /// it was taken from has handed back what it had queued; `evicted` is cancelled if yet
    /// another connection takes it.
    Yes {
        evicted: CancellationToken,
        previous_writer: Option<CancellationToken>,
    },
    /// It ended meanwhile (grace period over, client revoked).
    Ended,
}

impl Session {
    fn link(&self) -> MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Count what the session keeps for a resume against `owner`'s memory budget.
    pub fn count_in(&self, owner: &crate::budget::Owner) {
        let _ = self.kept.set(owner.hold());
    }

    fn kept_shrink(&self, bytes: usize) {
        if let Some(kept) = self.kept.get() {
            kept.shrink(bytes as u64);
        }
    }

    fn resumable(&self) -> bool {
        !self.grace.is_zero()
    }

    /// Send a reply to the attached connection, or keep it for the next one. Gives up when
    /// the session ends (nobody will read it).
    pub async fn send(&self, msg: ServerMessage) {
        let mut msg = msg;
        // At most twice: a connection that went away meanwhile may have been replaced.
        for _ in 0..2 {
            let tx = {
                let link = self.link();
                match &link.attached {
                    Some(a) if !a.replaying => Some(a.tx.clone()),
                    _ => None,
                }
            };
            let Some(tx) = tx else {
                break;
            };
            tokio::select! {
                sent = tx.send(msg) => match sent {
                    Ok(()) => return,
                    Err(mpsc::error::SendError(back)) => msg = back,
                },
                () = self.ended.cancelled() => return,
            }
        }
        self.keep(msg);
    }

    /// Send the answer to a request that only asks (`read`, `wait`, `list_processes`) to the
    /// connection that asked, if it still holds the session; otherwise drop it. Never kept
    /// for a resume: the client asks again on its new connection (reads do not consume), and
    /// an old answer replayed there would carry the id of its next request (issue 35).
    pub async fn answer(&self, connection: u64, msg: ServerMessage) {
        let tx = {
            let link = self.link();
            match &link.attached {
                Some(a) if a.connection == connection && !a.replaying => a.tx.clone(),
                _ => return,
            }
        };
        tokio::select! {
            _ = tx.send(msg) => {}
            () = self.ended.cancelled() => {}
        }
    }

    /// Keep a reply that no live connection took, for the next one.
    pub fn keep(&self, msg: ServerMessage) {
        let mut link = self.link();
        self.keep_locked(&mut link, msg);
    }

    /// Take back what a connection that is going away had not sent, oldest first: `first`
    /// (the message it was writing), then its queue. Under the lock, so a reply that fails
    /// to enter the closed queue meanwhile (its sender then calls `keep`) lands after them.
    pub fn keep_queue(&self, first: Option<ServerMessage>, rx: &mut mpsc::Receiver<ServerMessage>) {
        let mut link = self.link();
        rx.close();
        if let Some(msg) = first {
            self.keep_locked(&mut link, msg);
        }
        while let Ok(msg) = rx.try_recv() {
            self.keep_locked(&mut link, msg);
        }
    }

    fn keep_locked(&self, link: &mut Link, msg: ServerMessage) {
        if self.ended.is_cancelled()
            || (!self.resumable() && link.attached.is_none())
            || is_connection_bound(&msg)
        {
            return;
        }
        if let ServerMessage::Output(chunk) = &msg {
            let over_budget = || {
                self.kept
                    .get()
                    .is_some_and(|kept| !kept.try_grow(chunk.data.len() as u64))
            };
            if link.outbox_output_bytes + chunk.data.len() > OUTBOX_OUTPUT_BYTES || over_budget() {
                if !link.dropped_output {
                    tracing::info!(session = %self.id, "detached session's output exceeds the outbox or the memory budget; dropping streamed chunks");
                    link.dropped_output = true;
                }
                return;
            }
            link.outbox_output_bytes += chunk.data.len();
        }
        link.outbox.push_back(msg);
    }

    /// Remember a final reply (result, or error of a request) the writer put on the wire or
    /// was cut off writing, in case it never arrived. Only sessions that can be resumed.
    pub fn written(&self, msg: ServerMessage) {
        let Some((_, size)) = final_reply(&msg) else {
            return;
        };
        if !self.resumable() {
            return;
        }
        let mut link = self.link();
        link.written.push_back(msg);
        link.written_bytes += size;
        // Bounded by WRITTEN_RESULTS and WRITTEN_BYTES: counted, never refused.
        if let Some(kept) = self.kept.get() {
            kept.force(size as u64);
        }
        while link.written.len() > WRITTEN_RESULTS || link.written_bytes > WRITTEN_BYTES {
            let Some(old) = link.written.pop_front() else {
                break;
            };
            link.written_bytes -= final_size(&old);
            self.kept_shrink(final_size(&old));
        }
    }

    /// Attach a connection. Replies queue in the outbox until `next_replay` drains it (after
    /// `resend_written`, once the previous connection handed back its queue).
    pub fn attach(
        &self,
        connection: u64,
        tx: mpsc::Sender<ServerMessage>,
        writer: WriterControl,
    ) -> Attached {
        let mut link = self.link();
        // Checked under the lock the grace timer ends the session under.
        if self.ended.is_cancelled() {
            return Attached::Ended;
        }
        let previous_writer = link.attached.take().map(|old| {
            tracing::info!(session = %self.id, old = old.connection, new = connection, "session taken over by a new connection");
            old.evicted.cancel();
            old.gone.cancel();
            // Its writer may be stuck on a dead socket: stop it now, whatever its reader does.
            old.writer_stop.cancel();
            old.writer_done
        });
        let evicted = CancellationToken::new();
        link.generation += 1;
        link.detached_at = None;
        link.dropped_output = false;
        link.attached = Some(Attachment {
            connection,
            tx,
            evicted: evicted.clone(),
            writer_stop: writer.stop,
            writer_done: writer.done,
            replaying: true,
            gone: CancellationToken::new(),
        });
        Attached::Yes {
            evicted,
            previous_writer,
        }
    }

    /// Put the final replies written to the old connection whose ids the client awaits at the
    /// front of the replay; forget the rest. Returns the ids still running (or finishing).
    pub fn resend_written(&self, awaiting: &[String]) -> Vec<String> {
        let mut link = self.link();
        let queued: Vec<String> = link.outbox.iter().filter_map(final_id).collect();
        let resend: Vec<ServerMessage> = std::mem::take(&mut link.written)
            .into_iter()
            .filter(|m| {
                final_id(m).is_some_and(|id| awaiting.contains(&id) && !queued.contains(&id))
            })
            .collect();
        self.kept_shrink(std::mem::take(&mut link.written_bytes));
        for msg in resend.into_iter().rev() {
            link.outbox.push_front(msg);
        }
        self.running.ids()
    }

    /// The next kept reply for the attached connection; `None` once the outbox is empty, and
    /// from then on replies go straight to the connection.
    pub fn next_replay(&self) -> Option<ServerMessage> {
        let mut link = self.link();
        match link.outbox.pop_front() {
            Some(msg) => {
                if let ServerMessage::Output(chunk) = &msg {
                    link.outbox_output_bytes -= chunk.data.len();
                    self.kept_shrink(chunk.data.len());
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

    /// Let go of `connection`. Returns the attach generation, for the grace timer, or `None`
    /// if another connection holds the session now (then it is not ours to end).
    pub fn detach(&self, connection: u64) -> Option<u64> {
        let mut link = self.link();
        match &link.attached {
            Some(a) if a.connection == connection => {
                a.gone.cancel();
                link.attached = None;
                link.detached_at = Some(std::time::Instant::now());
                Some(link.generation)
            }
            Some(_) => None,
            None => Some(link.generation),
        }
    }

    /// Cancelled once `connection` no longer holds the session (it let go, or another
    /// connection took the session over); already cancelled if it does not hold it now.
    /// What is tied to a connection (a download) fails at once then: it never goes on over
    /// another connection, and the client downloads the rest from its offset after a resume.
    pub fn connection_gone(&self, connection: u64) -> CancellationToken {
        match &self.link().attached {
            Some(a) if a.connection == connection => a.gone.clone(),
            _ => {
                let gone = CancellationToken::new();
                gone.cancel();
                gone
            }
        }
    }

    /// Send `msg` to `connection` only, while it holds the session (and has replayed what was
    /// kept for it). Returns whether it was queued there; never kept for another connection.
    pub async fn send_on(&self, connection: u64, msg: ServerMessage) -> bool {
        let (tx, gone) = {
            let link = self.link();
            match &link.attached {
                Some(a) if a.connection == connection && !a.replaying => {
                    (a.tx.clone(), a.gone.clone())
                }
                _ => return false,
            }
        };
        tokio::select! {
            sent = tx.send(msg) => sent.is_ok() && !gone.is_cancelled(),
            () = gone.cancelled() => false,
            () = self.ended.cancelled() => false,
        }
    }

    /// Since when no connection is attached, if none is.
    fn detached_since(&self) -> Option<std::time::Instant> {
        let link = self.link();
        link.attached
            .is_none()
            .then_some(link.detached_at)
            .flatten()
    }

    /// End the session if nobody attached since `generation`: the check and the end happen
    /// under the lock `attach` checks under, so a resume either wins or finds it ended.
    pub fn expire(&self, generation: u64) -> bool {
        let link = self.link();
        let expired = link.attached.is_none() && link.generation == generation;
        if expired {
            self.ended.cancel();
        }
        expired
    }
}

/// Bytes of kept written replies per session, at most.
const WRITTEN_BYTES: usize = 4 << 20;

fn final_size(msg: &ServerMessage) -> usize {
    final_reply(msg).map_or(0, |(_, size)| size)
}

/// The request id of a final reply (a result, or an error naming a request).
fn final_id(msg: &ServerMessage) -> Option<String> {
    final_reply(msg).map(|(id, _)| id)
}

/// Whether `msg` answers a request that only asks (`process_output`, `exited`, `processes`):
/// it goes to the connection that asked or nowhere (see [`Session::answer`]); and a
/// download's chunks, tied to the connection the download started on (a chunk its queue
/// hands back when it drops is never replayed on the next one).
pub fn is_connection_bound(msg: &ServerMessage) -> bool {
    matches!(
        msg,
        ServerMessage::ProcessOutput(_)
            | ServerMessage::Exited(_)
            | ServerMessage::Processes(_)
            | ServerMessage::DownloadData(_)
    )
}

/// Whether `msg` is the one final answer to a request (so worth sending again after a resume
/// if the client awaits it), as opposed to streamed output and answers a client can ask for
/// again (`process_output`, `exited`, `done`, `processes`).
pub fn is_final(msg: &ServerMessage) -> bool {
    final_reply(msg).is_some()
}

/// About what one file's facts cost kept (names and link targets are up to 4 KiB each).
fn stat_size(stat: &protocol::FileStat) -> usize {
    stat.name.len() + stat.target.as_ref().map_or(0, String::len) + 128
}

/// A final reply's request id and about how many bytes keeping it costs.
fn final_reply(msg: &ServerMessage) -> Option<(String, usize)> {
    let found = match msg {
        ServerMessage::Result(r) => (r.id.clone(), r.output.len() + 256),
        ServerMessage::Error(e) => (e.id.clone()?, e.message.len() + 64),
        ServerMessage::Spawned(r) => (r.id.clone(), 64),
        ServerMessage::Uploaded(r) => (r.id.clone(), r.path.len() + 64),
        ServerMessage::Downloaded(r) => (r.id.clone(), r.path.len() + 64),
        ServerMessage::FileInfo(r) => (r.id.clone(), stat_size(&r.stat)),
        ServerMessage::DirListing(r) => (
            r.id.clone(),
            r.entries.iter().map(stat_size).sum::<usize>() + r.path.len(),
        ),
        _ => return None,
    };
    Some(found)
}

impl crate::runner::Replies for Session {
    fn send(&self, msg: ServerMessage) -> futures_util::future::BoxFuture<'_, ()> {
        Box::pin(Session::send(self, msg))
    }
}

/// Cancel handles of a session's running commands, by client id, and the ids whose reply is
/// on its way. Shared with the jobs: each moves its id to `finishing` right before replying
/// (so the id is free for a new command as soon as the result can arrive) and drops it once
/// the reply is queued (so a resume in between still reports it as running).
#[derive(Clone, Default)]
pub struct Running(Arc<Mutex<RunningIds>>);

#[derive(Default)]
pub struct RunningIds {
    cancel: HashMap<String, CancellationToken>,
    finishing: HashMap<String, usize>,
}

impl Running {
    fn lock(&self) -> MutexGuard<'_, RunningIds> {
        // A poisoned lock only means a job panicked while holding it; the map is still valid.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
    pub fn insert(&self, id: String, cancel: CancellationToken) {
        self.lock().cancel.insert(id, cancel);
    }
    /// The command is done and its reply about to be queued.
    pub fn finishing(&self, id: &str) {
        let mut ids = self.lock();
        ids.cancel.remove(id);
        *ids.finishing.entry(id.to_string()).or_default() += 1;
    }
    /// Its reply is queued (or kept).
    pub fn finished(&self, id: &str) {
        let mut ids = self.lock();
        if let Some(n) = ids.finishing.get_mut(id) {
            *n -= 1;
            if *n == 0 {
                ids.finishing.remove(id);
            }
        }
    }
    /// Ended, its reply not queued yet.
    pub fn is_finishing(&self, id: &str) -> bool {
        self.lock().finishing.contains_key(id)
    }
    pub fn get(&self, id: &str) -> Option<CancellationToken> {
        self.lock().cancel.get(id).cloned()
    }
    pub fn contains_key(&self, id: &str) -> bool {
        self.lock().cancel.contains_key(id)
    }
    pub fn len(&self) -> usize {
        self.lock().cancel.len()
    }
    /// Running and finishing ids, sorted.
    pub fn ids(&self) -> Vec<String> {
        let ids = self.lock();
        let mut all: Vec<String> = ids
            .cancel
            .keys()
            .chain(ids.finishing.keys())
            .cloned()
            .collect();
        all.sort();
        all.dedup();
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::{ExecResult, OutputChunk};

    fn client() -> Arc<Client> {
        crate::clients::ClientTable::single(
            b"token-token-token-token-token-token",
            sandbox::network::Mode::Host,
        )
        .current_by_name(crate::clients::DEFAULT_CLIENT)
        .unwrap()
    }

    fn output(id: &str, seq: u64) -> ServerMessage {
        ServerMessage::Output(OutputChunk {
            id: id.into(),
            seq,
            data: format!("{seq}\n"),
        })
    }

    fn result(id: &str) -> ServerMessage {
        ServerMessage::Result(ExecResult {
            id: id.into(),
            output: String::new(),
            returncode: 0,
            exception_info: String::new(),
            extra: serde_json::from_value(serde_json::json!({
                "ended": "exited", "timed_out": false, "cancelled": false, "duration_ms": 1.0,
                "output_bytes": 0, "truncated": false, "elided_bytes": 0, "killed_processes": 0,
                "isolation": {"profile": "p", "layers": []}
            }))
            .unwrap(),
        })
    }

    fn describe(msg: &ServerMessage) -> String {
        match msg {
            ServerMessage::Output(c) => format!("out {} {}", c.id, c.seq),
            ServerMessage::Result(r) => format!("result {}", r.id),
            other => format!("{other:?}"),
        }
    }

    fn replay(session: &Session) -> Vec<String> {
        std::iter::from_fn(|| session.next_replay())
            .map(|m| describe(&m))
            .collect()
    }

    #[tokio::test]
    async fn a_dead_connections_queue_comes_back_in_order_and_replays_before_anything_newer() {
        let sessions = Sessions::default();
        let session = sessions.create(client(), Duration::from_secs(30), None);
        let (tx, mut rx) = mpsc::channel(16);
        assert!(matches!(
            session.attach(1, tx, WriterControl::default()),
            Attached::Yes { .. }
        ));
        assert!(replay(&session).is_empty(), "nothing kept yet; now live");
        session.send(output("a", 1)).await;
        session.send(output("a", 2)).await;
        // The writer was writing chunk 0 when the socket died; 1 and 2 are still queued.
        session.keep_queue(Some(output("a", 0)), &mut rx);
        // A reply sent after the queue closed lands behind them.
        session.send(result("a")).await;
        assert_eq!(session.detach(1), Some(1));
        let (tx2, _rx2) = mpsc::channel(16);
        let Attached::Yes {
            previous_writer, ..
        } = session.attach(2, tx2, WriterControl::default())
        else {
            panic!("not attached")
        };
        assert!(previous_writer.is_none(), "the first connection had let go");
        assert_eq!(session.resend_written(&[]), Vec::<String>::new());
        assert_eq!(
            replay(&session),
            ["out a 0", "out a 1", "out a 2", "result a"]
        );
    }

    #[tokio::test]
    async fn written_results_are_sent_again_only_if_awaited() {
        let sessions = Sessions::default();
        let session = sessions.create(client(), Duration::from_secs(30), None);
        session.written(result("got-it"));
        session.written(result("lost"));
        session.written(output("x", 0)); // not a final reply: never kept
        let (tx, _rx) = mpsc::channel(16);
        assert!(matches!(
            session.attach(7, tx, WriterControl::default()),
            Attached::Yes { .. }
        ));
        session.resend_written(&["lost".to_string(), "still-running".to_string()]);
        assert_eq!(replay(&session), ["result lost"]);
        // Forgotten after one resume.
        assert!(session.resend_written(&["lost".to_string()]).is_empty());
        assert!(replay(&session).is_empty());
    }

    #[tokio::test]
    async fn an_expired_session_cannot_be_attached_and_a_resumed_one_does_not_expire() {
        let sessions = Sessions::default();
        let session = sessions.create(client(), Duration::from_secs(30), None);
        let (tx, _rx) = mpsc::channel(16);
        let _ = session.attach(1, tx.clone(), WriterControl::default());
        let generation = session.detach(1).unwrap();
        // The client came back before the timer fired: the timer must not end it.
        let _ = session.attach(2, tx.clone(), WriterControl::default());
        assert!(!session.expire(generation));
        assert!(!session.ended.is_cancelled());
        // The old connection's late detach does not let go of the new one.
        assert_eq!(session.detach(1), None);
        let generation = session.detach(2).unwrap();
        assert!(session.expire(generation));
        assert!(matches!(
            session.attach(3, tx, WriterControl::default()),
            Attached::Ended
        ));
    }

    fn process_output(id: &str, offset: u64) -> ServerMessage {
        ServerMessage::ProcessOutput(protocol::ProcessOutput {
            id: id.into(),
            offset,
            data: String::new(),
            next_offset: offset,
            dropped: 0,
            eof: false,
        })
    }

    #[tokio::test]
    async fn an_answer_goes_to_the_connection_that_asked_and_is_never_kept_for_a_resume() {
        let sessions = Sessions::default();
        let session = sessions.create(client(), Duration::from_secs(30), None);
        let (tx, mut rx) = mpsc::channel(16);
        let _ = session.attach(1, tx, WriterControl::default());
        assert!(replay(&session).is_empty());
        session.answer(1, process_output("p", 0)).await;
        assert!(matches!(rx.try_recv(), Ok(ServerMessage::ProcessOutput(_))));
        // Two more answers queued on connection 1 when it dies: neither is kept, while a
        // result sent after its queue closed is.
        session.answer(1, process_output("p", 1)).await;
        session.send(process_output("p", 2)).await;
        session.keep_queue(None, &mut rx);
        session.send(result("r")).await;
        assert_eq!(session.detach(1), Some(1));
        let (tx2, mut rx2) = mpsc::channel(16);
        let _ = session.attach(2, tx2, WriterControl::default());
        // Asked on connection 1, answered once 2 holds the session: dropped.
        session.answer(1, process_output("p", 3)).await;
        assert_eq!(replay(&session), ["result r"]);
        session.answer(2, process_output("p", 4)).await;
        match rx2.try_recv() {
            Ok(ServerMessage::ProcessOutput(o)) => assert_eq!(o.offset, 4),
            other => panic!("{other:?}"),
        }
        assert!(rx2.try_recv().is_err(), "nothing else reached connection 2");
    }

    fn chunk(id: &str, seq: u64) -> ServerMessage {
        ServerMessage::DownloadData(protocol::DownloadData {
            id: id.into(),
            seq,
            data: String::new(),
        })
    }

    #[tokio::test]
    async fn what_is_tied_to_a_connection_stops_when_it_lets_go_or_is_taken_over() {
        let sessions = Sessions::default();
        let session = sessions.create(client(), Duration::from_secs(30), None);
        let (tx, mut rx) = mpsc::channel(16);
        let _ = session.attach(1, tx, WriterControl::default());
        assert!(replay(&session).is_empty());
        let gone = session.connection_gone(1);
        assert!(!gone.is_cancelled());
        assert!(session.connection_gone(2).is_cancelled(), "2 never held it");
        assert!(session.send_on(1, chunk("d", 0)).await);
        assert!(matches!(rx.try_recv(), Ok(ServerMessage::DownloadData(_))));
        // Queued on connection 1 when it drops: handed back, never kept for the next one.
        assert!(session.send_on(1, chunk("d", 1)).await);
        session.keep_queue(None, &mut rx);
        assert_eq!(session.detach(1), Some(1));
        assert!(
            gone.is_cancelled(),
            "detach wakes what waits on connection 1"
        );
        assert!(!session.send_on(1, chunk("d", 2)).await);
        let (tx2, mut rx2) = mpsc::channel(16);
        let _ = session.attach(2, tx2, WriterControl::default());
        assert!(replay(&session).is_empty(), "no chunk of 1 replayed on 2");
        assert!(!session.send_on(1, chunk("d", 3)).await);
        assert!(rx2.try_recv().is_err());
        // A takeover (no detach first) stops what is tied to the connection taken from.
        let gone2 = session.connection_gone(2);
        let (tx3, _rx3) = mpsc::channel(16);
        let _ = session.attach(3, tx3, WriterControl::default());
        assert!(gone2.is_cancelled());
    }

    #[test]
    fn a_finishing_id_is_free_for_reuse_but_still_reported_running() {
        let running = Running::default();
        running.insert("a".into(), CancellationToken::new());
        running.finishing("a");
        assert!(!running.contains_key("a"), "the id may be used again");
        assert_eq!(running.ids(), ["a"], "a resume still waits for its reply");
        running.finished("a");
        assert!(running.ids().is_empty());
    }
}
