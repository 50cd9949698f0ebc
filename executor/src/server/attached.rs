//! Protocol 1.1 on a connection: its requests taken apart here; processes (`spawn`, `write`,
//! `read`, `signal`, `resize`, `wait`, `list_processes`) done here, files (`upload`,
//! `download`, `stat`, `list_dir`) in `transfers`.
//!
//! Each is admitted exactly as `exec` is (validation, profile, client limits, workspace) and
//! runs through the same engine, so the same sandbox, limits and whole-tree kill apply; what
//! differs is its stdio (a socket or a terminal the daemon keeps) and its output (a ring read
//! by offset). A file operation is a payload doing the operation in place of a command.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use protocol::{
    ClientMessage, Done, ErrorCode, ErrorMessage, ExecRequest, ExecResult, Exited, ProcessList,
    ProcessOutput, PtySize, ReadRequest, ResizeRequest, ServerMessage, SignalRequest, SpawnRequest,
    Spawned, WaitRequest, WriteRequest,
};
use tokio::io::AsyncRead;
use tokio::sync::{mpsc, oneshot};

use super::connection::{Connection, Job};
use super::processes::{
    feed_stdin, Kind, Process, StdinChunk, StdinEnd, STDIN_BUDGET_KIB, STDIN_QUEUE,
};
use super::session::Session;
use crate::engine::ExecError;
use crate::request::ValidRequest;
use crate::runner::attached::{Attached, OutputRing, PtyMaster};
use crate::runner::Io;
use sandbox::files::FileOp;
use sandbox::plan::StdinKind;

/// Most bytes one `read` returns, and its default.
const MAX_READ_BYTES: u64 = 256 * 1024;
/// Longest a `read` or `wait` may wait, in seconds.
const MAX_WAIT: f64 = 60.0;

pub(super) fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

pub(super) fn bad(message: impl Into<String>) -> ExecError {
    ExecError::new(ErrorCode::BadRequest, message)
}

/// The payload's end of its stdio, ours to read output from and to write stdin into.
pub(super) struct Stdio {
    theirs: OwnedFd,
    output: Box<dyn AsyncRead + Send + Unpin>,
    stdin: StdinEnd,
    pty: Option<PtyMaster>,
}

/// A spawned process's stdio. `own_devpts`: the sandbox has a devpts of its own, where the
/// payload makes the terminal (its programs then find it by name: `tty`, `/dev/pts/N`) and
/// hands us the master.
fn process_stdio(pty: Option<PtySize>, own_devpts: bool) -> std::io::Result<Stdio> {
    let Some(size) = pty.filter(|_| own_devpts) else {
        return make_stdio(pty);
    };
    let (master, theirs, ours) = PtyMaster::made_by_payload(size.rows, size.cols)?;
    tokio::spawn(master.clone().receive(ours));
    Ok(Stdio {
        theirs,
        output: Box::new(master.clone()),
        stdin: StdinEnd::Terminal(master.clone()),
        pty: Some(master),
    })
}

pub(super) fn make_stdio(pty: Option<PtySize>) -> std::io::Result<Stdio> {
    if let Some(size) = pty {
        let (master, theirs) = PtyMaster::open(size.rows, size.cols)?;
        return Ok(Stdio {
            theirs,
            output: Box::new(master.clone()),
            stdin: StdinEnd::Terminal(master.clone()),
            pty: Some(master),
        });
    }
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
    ours.set_nonblocking(true)?;
    let (read, write) = tokio::net::UnixStream::from_std(ours)?.into_split();
    Ok(Stdio {
        theirs: theirs.into(),
        output: Box::new(read),
        stdin: StdinEnd::Socket(write),
        pty: None,
    })
}

fn signal_number(name: &str) -> Option<i32> {
    use nix::sys::signal::Signal;
    let name = name.trim().to_ascii_uppercase();
    let name = name.strip_prefix("SIG").unwrap_or(&name);
    let signal = match name {
        "INT" => Signal::SIGINT,
        "TERM" => Signal::SIGTERM,
        "KILL" => Signal::SIGKILL,
        "HUP" => Signal::SIGHUP,
        "QUIT" => Signal::SIGQUIT,
        "USR1" => Signal::SIGUSR1,
        "USR2" => Signal::SIGUSR2,
        "CONT" => Signal::SIGCONT,
        "STOP" => Signal::SIGSTOP,
        _ => return None,
    };
    Some(signal as i32)
}

fn seconds(value: Option<f64>, what: &str) -> Result<Duration, ExecError> {
    match value {
        None => Ok(Duration::ZERO),
        Some(s) if (0.0..=MAX_WAIT).contains(&s) => Ok(Duration::from_secs_f64(s)),
        Some(s) => Err(bad(format!(
            "{what} must be 0 to {MAX_WAIT} seconds, got {s}"
        ))),
    }
}

impl Connection {
    /// Whose memory budget what this connection's requests keep counts against: its client's
    /// (with the client's current limits).
    pub(super) fn memory_owner(&self) -> crate::budget::Owner {
        let limit = self
            .daemon
            .clients
            .table()
            .current(&self.client)
            .and_then(|c| c.limits.memory_budget_bytes);
        self.daemon
            .memory
            .owner(&self.client.name, limit)
            .counting_output(self.daemon.clients.usage(&self.client.name))
    }

    /// The memory-budget entry of a file operation's table entry named `label`: counted
    /// whatever the budget says (a file operation's entry lives until it is answered, and
    /// 8 ended uploads are kept).
    pub(super) fn record_of(&self, label: &str) -> crate::budget::Held {
        let record = self.memory_owner().hold();
        record.force(crate::budget::RECORD_BYTES + label.len() as u64);
        record
    }

    pub(super) async fn handle_v1_1(&mut self, msg: ClientMessage, draining: bool) {
        let id = request_id(&msg);
        let handled = match msg {
            ClientMessage::Spawn(req) => self.spawn(req, draining).await,
            ClientMessage::Write(req) => self.write(req).await,
            ClientMessage::Read(req) => self.read(req).await,
            ClientMessage::Signal(req) => self.signal(req).await,
            ClientMessage::Resize(req) => self.resize(req).await,
            ClientMessage::Wait(req) => self.wait(req).await,
            ClientMessage::ListProcesses(req) => {
                let processes = self.session.processes.list();
                self.session
                    .answer(
                        self.connection,
                        ServerMessage::Processes(ProcessList {
                            id: req.id,
                            processes,
                        }),
                    )
                    .await;
                Ok(())
            }
            ClientMessage::Upload(req) => self.upload(req, draining).await,
            ClientMessage::Download(req) => self.download(req, draining).await,
            ClientMessage::Stat(req) => {
                let op = FileOp::Stat {
                    path: req.path.clone(),
                };
                self.file_op(req.id, &req.path, req.profile, op, draining)
                    .await
            }
            ClientMessage::ListDir(req) => {
                let op = FileOp::List {
                    path: req.path.clone(),
                };
                self.file_op(req.id, &req.path, req.profile, op, draining)
                    .await
            }
            ClientMessage::Exec(_) | ClientMessage::Cancel(_) | ClientMessage::Resume(_) => Err(
                ExecError::new(ErrorCode::Internal, "not a protocol 1.1 request"),
            ),
        };
        if let Err(err) = handled {
            self.error(id, err.code, &err.message).await;
        }
    }

    async fn spawn(&mut self, req: SpawnRequest, draining: bool) -> Result<(), ExecError> {
        if let Some(size) = req.pty {
            if size.rows == 0 || size.cols == 0 {
                return Err(bad("pty rows and cols must be at least 1"));
            }
        }
        let limits = &self.daemon.engine.limits;
        let exec = ExecRequest {
            id: req.id.clone(),
            command: req.command.clone(),
            cwd: req.cwd,
            env: req.env,
            timeout: Some(req.timeout.unwrap_or(limits.max_timeout)),
            profile: req.profile,
            stream: false,
            network: req.network,
        };
        let buffer = limits.max_process_buffer_bytes;
        // The process's entry is kept (until forgotten) on the client's behalf, and counted:
        // refused here, before anything starts, when no room can be made for it.
        let record = self.memory_owner().hold();
        if !record.try_grow(crate::budget::RECORD_BYTES + req.command.len() as u64) {
            return Err(ExecError::new(
                ErrorCode::Busy,
                format!("memory budget full: {}", record.owner().describe()),
            ));
        }
        let Some((mut valid, job, held)) = self.admit_job(exec, draining).await else {
            return Ok(());
        };
        let engine = &self.daemon.engine;
        let own_devpts = engine
            .profiles
            .get(valid.profile.as_deref().unwrap_or(&engine.default_profile))
            .is_some_and(|p| p.namespaces.contains(&sandbox::profile::Namespace::Mount));
        let stdio = match process_stdio(req.pty, own_devpts) {
            Ok(stdio) => stdio,
            Err(err) => {
                let err = ExecError::new(
                    ErrorCode::EnvironmentError,
                    format!("cannot make the process's stdio: {err}"),
                );
                job.refuse(&valid, err).await;
                return Ok(());
            }
        };
        valid.spec.stdin = if req.pty.is_some() {
            StdinKind::Terminal
        } else {
            StdinKind::Socket
        };
        let ring = OutputRing::kept_for(buffer, true, Some(&self.memory_owner()));
        let (process, attached) = register(
            &self.session,
            &valid.id,
            req.command,
            Kind::Process,
            ring,
            stdio,
            record,
        );
        let task = self.session.tasks.track_future(async move {
            job.run_process(valid, attached, process).await;
            drop(held);
        });
        self.daemon.tasks.spawn(task);
        Ok(())
    }

    async fn write(&mut self, req: WriteRequest) -> Result<(), ExecError> {
        let data = match (req.data, req.text) {
            (Some(_), Some(_)) => Err(bad("give `data` or `text`, not both")),
            (Some(data), None) => b64()
                .decode(data.as_bytes())
                .map_err(|err| bad(format!("data is not base64: {err}"))),
            (None, Some(text)) => Ok(text.into_bytes()),
            (None, None) => Ok(Vec::new()),
        };
        let Some(process) = self.session.processes.get(&req.id) else {
            data?;
            return Err(ExecError::new(
                ErrorCode::NotFound,
                format!("no process or upload with id {:?}", req.id),
            ));
        };
        let data = match data {
            Ok(data) => data,
            // An upload that lost part of its content cannot be completed: it fails now, and
            // its payload removes the temporary file before the upload is answered with this
            // error (its one answer).
            Err(err) if process.kind == Kind::Upload && process.running() => {
                process.fail(bad(format!(
                    "{}; the upload {:?} is abandoned and its temporary file removed",
                    err.message, req.id
                )));
                return Ok(());
            }
            Err(err) => return Err(err),
        };
        let permits = super::processes::budget_permits(data.len());
        // Queued stdin counts against the client's memory budget until it is written.
        let held = self.memory_owner().hold();
        match process.kind {
            Kind::Query => Err(bad(format!("{:?} takes no input", req.id))),
            // An upload waits for its writer (the connection's backpressure); one already
            // answered (it failed early) drops what still comes.
            Kind::Upload => {
                if !data.is_empty() && process.running() {
                    let Ok(budget) = process
                        .stdin_budget
                        .clone()
                        .acquire_many_owned(permits)
                        .await
                    else {
                        return Ok(());
                    };
                    let Some(stdin) = process.stdin() else {
                        return Ok(());
                    };
                    // Bounded by the upload's own queue: counted, never refused.
                    held.force(data.len() as u64);
                    if stdin
                        .send(StdinChunk::Data(data, budget, held))
                        .await
                        .is_err()
                    {
                        return Ok(());
                    }
                }
                if req.eof && process.running() {
                    if let Some(stdin) = process.stdin() {
                        let _ = stdin.send(StdinChunk::Eof).await;
                    }
                }
                Ok(())
            }
            Kind::Process => {
                if !process.running() {
                    return Err(ExecError::new(
                        ErrorCode::NotFound,
                        format!("process {:?} has ended", req.id),
                    ));
                }
                let not_reading = || {
                    ExecError::new(
                        ErrorCode::Busy,
                        format!(
                            "process {:?} is not reading its stdin ({STDIN_QUEUE} writes or \
                             {STDIN_BUDGET_KIB} KiB queued); write again later",
                            req.id
                        ),
                    )
                };
                let closed = || bad(format!("the stdin of {:?} is closed", req.id));
                let mut chunks = Vec::new();
                if !data.is_empty() {
                    let budget = process
                        .stdin_budget
                        .clone()
                        .try_acquire_many_owned(permits)
                        .map_err(|_| not_reading())?;
                    if !held.try_grow(data.len() as u64) {
                        let owner = held.owner();
                        return Err(ExecError::new(
                            ErrorCode::Busy,
                            format!(
                                "the memory budget is used up ({}); {} bytes of stdin for {:?} \
                                 cannot be queued; write again later",
                                owner.describe(),
                                data.len(),
                                req.id
                            ),
                        ));
                    }
                    chunks.push(StdinChunk::Data(data, budget, held));
                }
                if req.eof {
                    chunks.push(StdinChunk::Eof);
                }
                let stdin = process.stdin().ok_or_else(closed)?;
                for chunk in chunks {
                    match stdin.try_send(chunk) {
                        Ok(()) => {}
                        Err(mpsc::error::TrySendError::Full(_)) => return Err(not_reading()),
                        Err(mpsc::error::TrySendError::Closed(_)) => return Err(closed()),
                    }
                }
                Ok(())
            }
        }
    }

    fn process(&self, id: &str) -> Result<Arc<Process>, ExecError> {
        self.session
            .processes
            .get(id)
            .filter(|p| p.kind == Kind::Process)
            .ok_or_else(|| {
                ExecError::new(ErrorCode::NotFound, format!("no process with id {id:?}"))
            })
    }

    /// A place among the session's waiting `read`s and `wait`s.
    fn waiting_permit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, ExecError> {
        self.session
            .processes
            .waiting
            .clone()
            .try_acquire_owned()
            .map_err(|_| {
                ExecError::new(
                    ErrorCode::Busy,
                    format!(
                        "{} reads and waits of this session are waiting already",
                        super::processes::MAX_WAITING
                    ),
                )
            })
    }

    /// Answered at once when there is output after `offset` (or it ended, or no `wait`), on
    /// the connection's own pace; otherwise a task waits, holding one of the session's
    /// waiting places until its answer is sent.
    async fn read(&self, req: ReadRequest) -> Result<(), ExecError> {
        let wait = seconds(req.wait, "wait")?;
        let max = req
            .max_bytes
            .unwrap_or(MAX_READ_BYTES)
            .clamp(1, MAX_READ_BYTES) as usize;
        let process = self.process(&req.id)?;
        // Past the end: no offset the daemon gave makes one (they come from `next_offset`).
        // Refused rather than answered from the end, so that an answer's `offset` is always
        // the one asked for, or later only by the bytes `dropped` says were lost.
        let end = process.ring.total();
        if req.offset > end {
            return Err(bad(format!(
                "offset {} is past the end of the output of {:?} ({end} bytes so far); \
                 read from the last next_offset",
                req.offset, req.id
            )));
        }
        let answer = move |process: &Process, id: String| {
            let slice = process.ring.read(req.offset, max);
            let ready = !slice.data.is_empty() || slice.eof;
            let reply = ServerMessage::ProcessOutput(ProcessOutput {
                id,
                offset: slice.offset,
                data: b64().encode(&slice.data),
                next_offset: slice.next_offset,
                dropped: slice.dropped,
                eof: slice.eof,
            });
            (ready, reply)
        };
        let (ready, reply) = answer(&process, req.id.clone());
        let connection = self.connection;
        if ready || wait.is_zero() {
            self.session.answer(connection, reply).await;
            return Ok(());
        }
        let session = self.session.clone();
        let permit = self.waiting_permit()?;
        let shutdown = self.daemon.shutdown.clone();
        let task = self.session.tasks.track_future(async move {
            tokio::select! {
                () = process.ring.wait_for(req.offset, wait) => {}
                () = session.ended.cancelled() => return,
                () = shutdown.cancelled() => {}
            }
            // Only to the connection that asked: after a drop the client reads again on its
            // new one (a read is idempotent).
            session.answer(connection, answer(&process, req.id).1).await;
            drop(permit);
        });
        self.daemon.tasks.spawn(task);
        Ok(())
    }

    async fn signal(&self, req: SignalRequest) -> Result<(), ExecError> {
        let Some(signal) = signal_number(&req.signal) else {
            return Err(bad(format!(
                "unknown signal {:?}; one of INT, TERM, KILL, HUP, QUIT, USR1, USR2, CONT, STOP",
                req.signal
            )));
        };
        let process = self.process(&req.id)?;
        if !process.running() {
            return Err(ExecError::new(
                ErrorCode::NotFound,
                format!("process {:?} has ended", req.id),
            ));
        }
        if req.foreground {
            // What the terminal itself sends (Ctrl-C, Ctrl-\): the kernel's TIOCSIG takes no
            // other signal, and the group is not signalled by its id (which could be reused).
            if signal != libc::SIGINT && signal != libc::SIGQUIT {
                return Err(bad(format!(
                    "a foreground signal is one the terminal sends, INT or QUIT, not {:?}; \
                     without `foreground` it reaches every process of the command",
                    req.signal
                )));
            }
            let Some(pty) = &process.pty else {
                return Err(bad(format!(
                    "process {:?} has no terminal (spawn it with `pty`)",
                    req.id
                )));
            };
            pty.fd()
                .and_then(|fd| sandbox::sys::signal_foreground(fd, signal))
                .map_err(|err| {
                    ExecError::new(
                        ErrorCode::EnvironmentError,
                        format!("cannot signal the terminal's foreground group: {err}"),
                    )
                })?;
        } else if let Some(signals) = process.signals() {
            if signals.try_send(signal).is_err() {
                return Err(ExecError::new(
                    ErrorCode::Busy,
                    "too many signals in flight; send again later",
                ));
            }
        } else {
            return Err(ExecError::new(
                ErrorCode::NotFound,
                format!("process {:?} has ended", req.id),
            ));
        }
        self.reply(ServerMessage::Done(Done { id: req.id })).await;
        Ok(())
    }

    async fn resize(&self, req: ResizeRequest) -> Result<(), ExecError> {
        if req.rows == 0 || req.cols == 0 {
            return Err(bad("rows and cols must be at least 1"));
        }
        let process = self.process(&req.id)?;
        let Some(pty) = &process.pty else {
            return Err(bad(format!("process {:?} has no terminal", req.id)));
        };
        pty.resize(req.rows, req.cols).map_err(|err| {
            ExecError::new(
                ErrorCode::EnvironmentError,
                format!("cannot resize the terminal: {err}"),
            )
        })?;
        self.reply(ServerMessage::Done(Done { id: req.id })).await;
        Ok(())
    }

    /// As `read`: at once when the process ended or no `timeout` was given.
    async fn wait(&self, req: WaitRequest) -> Result<(), ExecError> {
        let timeout = seconds(req.timeout, "timeout")?;
        let process = self.process(&req.id)?;
        let answer = |process: &Process, id: String| {
            let ended = process.exit.borrow().clone();
            ServerMessage::Exited(ended.unwrap_or(Exited {
                id,
                running: true,
                returncode: protocol::RETURNCODE_NOT_FINISHED,
                exception_info: String::new(),
                extra: None,
            }))
        };
        let connection = self.connection;
        if !process.running() || timeout.is_zero() {
            self.session
                .answer(connection, answer(&process, req.id))
                .await;
            return Ok(());
        }
        let session = self.session.clone();
        let permit = self.waiting_permit()?;
        let shutdown = self.daemon.shutdown.clone();
        let task = self.session.tasks.track_future(async move {
            let mut exit = process.exit.subscribe();
            tokio::select! {
                _ = tokio::time::timeout(timeout, exit.wait_for(Option::is_some)) => {}
                () = session.ended.cancelled() => return,
                () = shutdown.cancelled() => {}
            }
            // As for a read: only to the connection that asked.
            session.answer(connection, answer(&process, req.id)).await;
            drop(permit);
        });
        self.daemon.tasks.spawn(task);
        Ok(())
    }
}

/// Put a process (or file operation) into the session's table, start feeding its stdin, and
/// make what the runner needs.
pub(super) fn register(
    session: &Session,
    id: &str,
    command: String,
    kind: Kind,
    ring: Arc<OutputRing>,
    stdio: Stdio,
    record: crate::budget::Held,
) -> (Arc<Process>, Attached) {
    let (stdin_tx, stdin_rx) = mpsc::channel(STDIN_QUEUE);
    let (signal_tx, signal_rx) = mpsc::channel(16);
    let (started_tx, started_rx) = oneshot::channel();
    let mut process = Process::new(
        id.to_string(),
        command,
        kind,
        ring.clone(),
        stdin_tx,
        signal_tx,
    );
    process.pty = stdio.pty;
    process.record = Some(record);
    process.started = std::sync::Mutex::new(Some(started_rx));
    let abort = process.abort.clone();
    let process = session.processes.insert(process);
    // Not a session task: it ends when the entry is forgotten (its queue closes), its
    // process is gone (a write fails) or it is aborted, and must not hold the session's end up.
    tokio::spawn(feed_stdin(
        stdio.stdin,
        stdin_rx,
        kind == Kind::Upload,
        abort,
    ));
    let attached = Attached {
        theirs: stdio.theirs,
        output: stdio.output,
        ring,
        signals: signal_rx,
        started: Some(started_tx),
    };
    (process, attached)
}

fn request_id(msg: &ClientMessage) -> Option<String> {
    match msg {
        ClientMessage::Spawn(r) => Some(r.id.clone()),
        ClientMessage::Write(r) => Some(r.id.clone()),
        ClientMessage::Read(r) => Some(r.id.clone()),
        ClientMessage::Signal(r) => Some(r.id.clone()),
        ClientMessage::Resize(r) => Some(r.id.clone()),
        ClientMessage::Wait(r) => Some(r.id.clone()),
        ClientMessage::ListProcesses(r) => r.id.clone(),
        ClientMessage::Upload(r) => Some(r.id.clone()),
        ClientMessage::Download(r) => Some(r.id.clone()),
        ClientMessage::Stat(r) => Some(r.id.clone()),
        ClientMessage::ListDir(r) => Some(r.id.clone()),
        ClientMessage::Exec(r) => Some(r.id.clone()),
        ClientMessage::Cancel(r) => Some(r.id.clone()),
        ClientMessage::Resume(_) => None,
    }
}

impl Job {
    /// A request admitted but not started (its stdio could not be made): refused.
    pub(super) async fn refuse(self, req: &ValidRequest, err: ExecError) {
        self.session.running.finishing(&req.id);
        self.session
            .send(ServerMessage::Error(ErrorMessage {
                id: Some(req.id.clone()),
                code: err.code,
                message: err.message.clone(),
            }))
            .await;
        self.session.running.finished(&req.id);
        self.account(req, &Err(err)).await;
    }

    /// Run a process: `spawned` once its payload has exec'd, its end kept for `wait`.
    async fn run_process(self, req: ValidRequest, attached: Attached, process: Arc<Process>) {
        let id = req.id.clone();
        let pty = process.pty.is_some();
        let mut started = process.take_started();
        let mut announced = false;
        let result = {
            let exec = self.execute(&req, Io::Attached(attached));
            tokio::pin!(exec);
            loop {
                tokio::select! {
                    result = &mut exec => break result,
                    Ok(()) = async {
                        match started.as_mut() {
                            Some(rx) => rx.await,
                            None => std::future::pending().await,
                        }
                    } => {
                        started = None;
                        announced = true;
                        self.session
                            .send(ServerMessage::Spawned(Spawned { id: id.clone(), pty }))
                            .await;
                    }
                }
            }
        };
        self.session.running.finishing(&id);
        match &result {
            Ok(result) => {
                if !announced {
                    self.session
                        .send(ServerMessage::Spawned(Spawned {
                            id: id.clone(),
                            pty,
                        }))
                        .await;
                }
                self.session.processes.end(&process, exited(result));
                // Its stdin feeder stops, closing our end of its socket: an ended process
                // kept for reading holds no descriptor (idle sessions held 8 each), nor
                // queues.
                process.abort.cancel();
                process.close_inputs();
            }
            Err(err) => {
                self.session.processes.remove(&id, &process);
                self.session
                    .send(ServerMessage::Error(ErrorMessage {
                        id: Some(id.clone()),
                        code: err.code,
                        message: err.message.clone(),
                    }))
                    .await;
            }
        }
        self.session.running.finished(&id);
        self.account(&req, &result).await;
    }
}

fn exited(result: &ExecResult) -> Exited {
    Exited {
        id: result.id.clone(),
        running: false,
        returncode: result.returncode,
        exception_info: result.exception_info.clone(),
        extra: Some(result.extra.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_names_are_read_with_or_without_sig() {
        assert_eq!(signal_number("INT"), Some(libc::SIGINT));
        assert_eq!(signal_number("sigterm"), Some(libc::SIGTERM));
        assert_eq!(signal_number("SIGKILL"), Some(libc::SIGKILL));
        assert_eq!(signal_number("SEGV"), None);
    }
}
