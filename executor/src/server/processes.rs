//! A session's processes (protocol 1.1): what the daemon keeps of each so that later requests,
//! also from a resumed connection, can reach it: its output ring, its stdin, its terminal,
//! its signals and, once it ended, how.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use protocol::{Exited, ProcessInfo};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use crate::runner::attached::{OutputRing, PtyMaster};

/// Ended processes a session keeps for `read` and `wait`; past it the oldest is forgotten
/// (each holds up to a buffer of output).
const KEPT_ENDED: usize = 8;
/// `read`s and `wait`s of a session waiting at once; past it they are refused with `busy`.
pub const MAX_WAITING: usize = 64;
/// Writes queued for a process's stdin at most.
pub const STDIN_QUEUE: usize = 64;
/// Bytes queued for a process's stdin at most, in KiB: a process that does not read its stdin
/// fills it and then a `write` is refused with `busy` (an upload's waits instead), so a
/// client cannot park its messages in the daemon's memory.
pub const STDIN_BUDGET_KIB: usize = 4096;

/// What an entry is for: only processes are listed, read and waited for by clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Process,
    Upload,
    /// Downloads, stat and list_dir: nothing to write.
    Query,
}

pub enum StdinChunk {
    /// Bytes, and their share of the stdin budget and of the client's memory budget, given
    /// back once written.
    Data(
        Vec<u8>,
        tokio::sync::OwnedSemaphorePermit,
        crate::budget::Held,
    ),
    Eof,
}

/// The permits `len` bytes take from a stdin budget (a KiB each, rounded up; a single write
/// larger than the whole budget takes all of it).
pub fn budget_permits(len: usize) -> u32 {
    u32::try_from(len.div_ceil(1024).min(STDIN_BUDGET_KIB)).unwrap_or(u32::MAX)
}

struct Inputs {
    stdin: mpsc::Sender<StdinChunk>,
    signals: mpsc::Sender<i32>,
}

pub struct Process {
    pub id: String,
    pub command: String,
    pub kind: Kind,
    pub pty: Option<PtyMaster>,
    pub ring: Arc<OutputRing>,
    /// Its stdin and signal queues while it may still take them: dropped once it ended, with
    /// their preallocated slots (about 3 KiB, held by each of a session's 8 kept ended
    /// processes, of every idle session).
    inputs: Mutex<Option<Inputs>>,
    /// What queued stdin may hold ([`STDIN_BUDGET_KIB`] permits of a KiB).
    pub stdin_budget: Arc<tokio::sync::Semaphore>,
    pub exit: watch::Sender<Option<Exited>>,
    /// Stops the stdin feeder at once (an upload whose session ended: cut off, not committed).
    pub abort: CancellationToken,
    /// Why an upload was abandoned by the daemon (a `write` it could not take): its answer,
    /// in place of the payload's "cut off".
    failure: Mutex<Option<crate::engine::ExecError>>,
    /// Fires when the payload has exec'd (taken by the process's job).
    pub started: Mutex<Option<oneshot::Receiver<()>>>,
    /// Order of creation, to forget the oldest ended first.
    serial: u64,
    /// The entry's own cost in the client's memory budget (its output counts in its ring's),
    /// given back when the entry is forgotten.
    pub record: Option<crate::budget::Held>,
}

impl Process {
    pub fn new(
        id: String,
        command: String,
        kind: Kind,
        ring: Arc<OutputRing>,
        stdin: mpsc::Sender<StdinChunk>,
        signals: mpsc::Sender<i32>,
    ) -> Self {
        Self {
            id,
            command,
            kind,
            pty: None,
            ring,
            inputs: Mutex::new(Some(Inputs { stdin, signals })),
            stdin_budget: Arc::new(tokio::sync::Semaphore::new(STDIN_BUDGET_KIB)),
            exit: watch::channel(None).0,
            abort: CancellationToken::new(),
            failure: Mutex::new(None),
            started: Mutex::new(None),
            serial: 0,
            record: None,
        }
    }

    fn inputs(&self) -> MutexGuard<'_, Option<Inputs>> {
        self.inputs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Its stdin queue, unless its inputs were closed.
    pub fn stdin(&self) -> Option<mpsc::Sender<StdinChunk>> {
        self.inputs().as_ref().map(|i| i.stdin.clone())
    }

    /// Its signal queue, unless its inputs were closed.
    pub fn signals(&self) -> Option<mpsc::Sender<i32>> {
        self.inputs().as_ref().map(|i| i.signals.clone())
    }

    /// It ended: drop its stdin and signal queues (what is still queued goes with the
    /// receivers), so that an ended process kept for reading holds no queue.
    pub fn close_inputs(&self) {
        let inputs = self.inputs().take();
        drop(inputs);
    }

    pub fn take_started(&self) -> Option<oneshot::Receiver<()>> {
        self.started
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Abandon an upload: its feeder stops at once, so its payload sees the content cut off
    /// and removes its temporary file; `err` becomes the upload's answer.
    pub fn fail(&self, err: crate::engine::ExecError) {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert(err);
        self.abort.cancel();
    }

    /// Why the daemon abandoned it, if it did.
    pub fn failure(&self) -> Option<crate::engine::ExecError> {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub fn running(&self) -> bool {
        self.exit.borrow().is_none()
    }

    pub fn info(&self) -> ProcessInfo {
        let exit = self.exit.borrow();
        ProcessInfo {
            id: self.id.clone(),
            command: self.command.clone(),
            pty: self.pty.is_some(),
            running: exit.is_none(),
            returncode: exit.as_ref().map(|e| e.returncode),
            output_bytes: self.ring.total(),
        }
    }
}

/// Where a process's stdin goes: our end of its socket, or its terminal's master.
pub enum StdinEnd {
    Socket(tokio::net::unix::OwnedWriteHalf),
    Terminal(PtyMaster),
}

/// Write queued stdin chunks until the queue closes, `abort` is cancelled, or a write fails
/// (the process is gone or closed its stdin). End-of-file shuts the socket's sending side, or
/// types the terminal's end-of-file character (^D, as a user would). An upload's content is
/// framed (`files::Framed`): its end-of-file is the commit, and a feeder that stops without
/// it (aborted, the queue closed) leaves the upload cut off, never complete.
pub async fn feed_stdin(
    mut end: StdinEnd,
    mut queue: mpsc::Receiver<StdinChunk>,
    framed: bool,
    abort: CancellationToken,
) {
    loop {
        let chunk = tokio::select! {
            chunk = queue.recv() => chunk,
            () = abort.cancelled() => None,
        };
        let Some(chunk) = chunk else {
            return;
        };
        let written = match (&mut end, chunk) {
            (StdinEnd::Socket(sock), StdinChunk::Data(data, _budget, _held)) => {
                let header = sandbox::files::frame_header(data.len());
                if framed && sock.write_all(&header).await.is_err() {
                    return;
                }
                sock.write_all(&data).await
            }
            (StdinEnd::Terminal(pty), StdinChunk::Data(data, _budget, _held)) => {
                pty.write_all(&data).await
            }
            (StdinEnd::Socket(sock), StdinChunk::Eof) => {
                if framed {
                    let _ = sock.write_all(&sandbox::files::frame_header(0)).await;
                }
                let _ = sock.shutdown().await;
                return;
            }
            (StdinEnd::Terminal(pty), StdinChunk::Eof) => pty.write_all(&[0x04]).await,
        };
        if written.is_err() {
            return;
        }
    }
}

pub struct Processes {
    map: Mutex<(HashMap<String, Arc<Process>>, u64)>,
    /// Permits of the `read`s and `wait`s waiting now.
    pub waiting: Arc<tokio::sync::Semaphore>,
}

impl Default for Processes {
    fn default() -> Self {
        Self {
            map: Mutex::default(),
            waiting: Arc::new(tokio::sync::Semaphore::new(MAX_WAITING)),
        }
    }
}

impl Processes {
    fn lock(&self) -> MutexGuard<'_, (HashMap<String, Arc<Process>>, u64)> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Add a process (replacing an ended one of the same id), forgetting the oldest ended
    /// processes past [`KEPT_ENDED`].
    pub fn insert(&self, mut process: Process) -> Arc<Process> {
        let mut guard = self.lock();
        guard.1 += 1;
        process.serial = guard.1;
        let process = Arc::new(process);
        if let Some(old) = guard.0.insert(process.id.clone(), process.clone()) {
            old.ring.discarded.cancel();
        }
        drop(guard);
        self.forget_old_ended(process.kind);
        process
    }

    /// Forget the oldest ended entries of `kind` past [`KEPT_ENDED`]: called when one is
    /// added and when one ends, so that a session never keeps more (16 processes that all
    /// ran at once used to be kept until the next spawn). Per kind: answered uploads (kept so
    /// late writes are dropped quietly) never push a process's output out.
    pub fn forget_old_ended(&self, kind: Kind) {
        Self::forget_old_ended_locked(&mut self.lock(), kind);
    }

    /// A process ended: its exit recorded and the oldest ended forgotten in one step under
    /// the table's lock, so that a client told of the exit (a `wait` woken by it) never finds
    /// more than [`KEPT_ENDED`] kept when it asks next.
    pub fn end(&self, process: &Process, exited: Exited) {
        let mut guard = self.lock();
        process.exit.send_replace(Some(exited));
        Self::forget_old_ended_locked(&mut guard, process.kind);
    }

    fn forget_old_ended_locked(
        guard: &mut MutexGuard<'_, (HashMap<String, Arc<Process>>, u64)>,
        kind: Kind,
    ) {
        let mut ended: Vec<(u64, String)> = guard
            .0
            .values()
            .filter(|p| !p.running() && p.kind == kind)
            .map(|p| (p.serial, p.id.clone()))
            .collect();
        if ended.len() > KEPT_ENDED {
            ended.sort();
            for (_, id) in &ended[..ended.len() - KEPT_ENDED] {
                if let Some(old) = guard.0.remove(id) {
                    old.ring.discarded.cancel();
                }
            }
        }
    }

    pub fn get(&self, id: &str) -> Option<Arc<Process>> {
        self.lock().0.get(id).cloned()
    }

    /// Forget an entry that is done (a file operation, once answered).
    pub fn remove(&self, id: &str, process: &Arc<Process>) {
        let mut guard = self.lock();
        if guard.0.get(id).is_some_and(|p| Arc::ptr_eq(p, process)) {
            guard.0.remove(id);
        }
        process.ring.discarded.cancel();
    }

    /// The session's processes, by id.
    pub fn list(&self) -> Vec<ProcessInfo> {
        let mut all: Vec<ProcessInfo> = self
            .lock()
            .0
            .values()
            .filter(|p| p.kind == Kind::Process)
            .map(|p| p.info())
            .collect();
        all.sort_by(|a, b| a.id.cmp(&b.id));
        all
    }

    /// The session ended: stop every pump and forget everything.
    pub fn clear(&self) {
        for (_, p) in self.lock().0.drain() {
            p.ring.discarded.cancel();
        }
    }
}
