//! Protocol 1.1 on a connection: processes (`spawn`, `write`, `read`, `signal`, `resize`,
//! `wait`, `list_processes`) and files (`upload`, `download`, `stat`, `list_dir`).
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
    ClientMessage, DirListing, Done, DownloadData, DownloadRequest, Downloaded, ErrorCode,
    ErrorMessage, ExecRequest, ExecResult, Exited, FileInfo, ProcessList, ProcessOutput, PtySize,
    ReadRequest, ResizeRequest, ServerMessage, SignalRequest, SpawnRequest, Spawned, UploadRequest,
    Uploaded, WaitRequest, WriteRequest,
};
use tokio::io::AsyncRead;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::connection::{Connection, Job};
use super::processes::{
    feed_stdin, Kind, Process, StdinChunk, StdinEnd, STDIN_BUDGET_KIB, STDIN_QUEUE,
};
use super::session::Session;
use crate::engine::ExecError;
use crate::files::{FileOp, Header, MAX_HEADER_BYTES};
use crate::plan::StdinKind;
use crate::request::ValidRequest;
use crate::runner::attached::{Attached, OutputRing, PtyMaster};
use crate::runner::Io;

/// Most bytes one `read` returns, and its default.
const MAX_READ_BYTES: u64 = 256 * 1024;
/// Longest a `read` or `wait` may wait, in seconds.
const MAX_WAIT: f64 = 60.0;
/// Raw bytes in one `download_data` message.
const DOWNLOAD_CHUNK: usize = 64 * 1024;
/// A download's bounded queue: the most of a file the daemon holds at once.
const DOWNLOAD_QUEUE: usize = 256 * 1024;
/// Longest accepted path, as Linux's PATH_MAX.
const MAX_PATH_BYTES: usize = 4096;

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

fn bad(message: impl Into<String>) -> ExecError {
    ExecError::new(ErrorCode::BadRequest, message)
}

/// The payload's end of its stdio, ours to read output from and to write stdin into.
struct Stdio {
    theirs: OwnedFd,
    output: Box<dyn AsyncRead + Send + Unpin>,
    stdin: StdinEnd,
    pty: Option<PtyMaster>,
}

fn make_stdio(pty: Option<PtySize>) -> std::io::Result<Stdio> {
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

fn check_path(path: &str) -> Result<(), ExecError> {
    if path.is_empty() || path.len() > MAX_PATH_BYTES || path.contains('\0') {
        return Err(bad(format!(
            "path must be 1 to {MAX_PATH_BYTES} bytes without NUL"
        )));
    }
    Ok(())
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
                self.reply(ServerMessage::Processes(ProcessList {
                    id: req.id,
                    processes,
                }))
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
        };
        let buffer = limits.max_process_buffer_bytes;
        let Some((mut valid, job, held)) = self.admit_job(exec, draining).await else {
            return Ok(());
        };
        let stdio = match make_stdio(req.pty) {
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
        let ring = OutputRing::new(buffer, true);
        let (process, attached) = register(
            &self.session,
            &valid.id,
            req.command,
            Kind::Process,
            ring,
            stdio,
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
            (Some(_), Some(_)) => return Err(bad("give `data` or `text`, not both")),
            (Some(data), None) => b64()
                .decode(data.as_bytes())
                .map_err(|err| bad(format!("data is not base64: {err}")))?,
            (None, Some(text)) => text.into_bytes(),
            (None, None) => Vec::new(),
        };
        let Some(process) = self.session.processes.get(&req.id) else {
            return Err(ExecError::new(
                ErrorCode::NotFound,
                format!("no process or upload with id {:?}", req.id),
            ));
        };
        let permits = super::processes::budget_permits(data.len());
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
                    if process
                        .stdin
                        .send(StdinChunk::Data(data, budget))
                        .await
                        .is_err()
                    {
                        return Ok(());
                    }
                }
                if req.eof && process.running() {
                    let _ = process.stdin.send(StdinChunk::Eof).await;
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
                    chunks.push(StdinChunk::Data(data, budget));
                }
                if req.eof {
                    chunks.push(StdinChunk::Eof);
                }
                for chunk in chunks {
                    match process.stdin.try_send(chunk) {
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
        if ready || wait.is_zero() {
            self.reply(reply).await;
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
            // Nobody to answer: a read is idempotent, the client reads again after a resume
            // (kept, the reply would only fill the session's outbox).
            if session.is_attached() {
                session.send(answer(&process, req.id).1).await;
            }
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
            let Some(pty) = &process.pty else {
                return Err(bad(format!(
                    "process {:?} has no terminal (spawn it with `pty`)",
                    req.id
                )));
            };
            crate::sys::signal_foreground(pty.fd(), signal).map_err(|err| {
                ExecError::new(
                    ErrorCode::EnvironmentError,
                    format!("cannot signal the terminal's foreground group: {err}"),
                )
            })?;
        } else if process.signals.try_send(signal).is_err() {
            return Err(ExecError::new(
                ErrorCode::Busy,
                "too many signals in flight; send again later",
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
        crate::sys::set_window_size(pty.fd(), req.rows, req.cols).map_err(|err| {
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
        if !process.running() || timeout.is_zero() {
            self.reply(answer(&process, req.id)).await;
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
            // As for a read: nobody to answer, the client asks again after a resume.
            if session.is_attached() {
                session.send(answer(&process, req.id)).await;
            }
            drop(permit);
        });
        self.daemon.tasks.spawn(task);
        Ok(())
    }

    /// Admit a file operation as a command of the same profile would be.
    async fn admit_file_op(
        &mut self,
        id: &str,
        label: String,
        profile: Option<String>,
        timeout: f64,
        draining: bool,
    ) -> Option<(ValidRequest, Job, impl Send + 'static)> {
        let exec = ExecRequest {
            id: id.to_string(),
            command: label,
            cwd: None,
            env: Default::default(),
            timeout: Some(timeout),
            profile,
            stream: false,
        };
        self.admit_job(exec, draining).await
    }

    async fn upload(&mut self, req: UploadRequest, draining: bool) -> Result<(), ExecError> {
        check_path(&req.path)?;
        if req.mode.is_some_and(|mode| mode > 0o777) {
            return Err(bad("mode holds permission bits only: at most 0o777 (511)"));
        }
        let limits = &self.daemon.engine.limits;
        let (max_bytes, timeout) = (limits.max_upload_bytes, limits.max_timeout);
        let op = if req.tar {
            FileOp::Unpack {
                path: req.path.clone(),
                parents: req.parents,
                max_bytes,
            }
        } else {
            FileOp::Write {
                path: req.path.clone(),
                mode: req.mode.unwrap_or(0o644),
                parents: req.parents,
                max_bytes,
            }
        };
        let label = format!("[upload{}] {}", if req.tar { " tar" } else { "" }, req.path);
        let Some((mut valid, job, held)) = self
            .admit_file_op(&req.id, label.clone(), req.profile, timeout, draining)
            .await
        else {
            return Ok(());
        };
        let stdio = match make_stdio(None) {
            Ok(stdio) => stdio,
            Err(err) => {
                let err = ExecError::new(ErrorCode::EnvironmentError, err.to_string());
                job.refuse(&valid, err).await;
                return Ok(());
            }
        };
        valid.spec.stdin = StdinKind::Socket;
        valid.spec.builtin = Some(op);
        let ring = OutputRing::new(MAX_HEADER_BYTES, false);
        let (process, attached) =
            register(&self.session, &valid.id, label, Kind::Upload, ring, stdio);
        let task = self.session.tasks.track_future(async move {
            job.run_file_op(valid, attached, process, Answer::Upload)
                .await;
            drop(held);
        });
        self.daemon.tasks.spawn(task);
        Ok(())
    }

    async fn download(&mut self, req: DownloadRequest, draining: bool) -> Result<(), ExecError> {
        check_path(&req.path)?;
        if req.tar && (req.offset != 0 || req.length.is_some()) {
            return Err(bad("a tar download has no byte range"));
        }
        let op = if req.tar {
            FileOp::Pack {
                path: req.path.clone(),
            }
        } else {
            FileOp::Read {
                path: req.path.clone(),
                offset: req.offset,
                length: req.length,
            }
        };
        let label = format!(
            "[download{}] {}",
            if req.tar { " tar" } else { "" },
            req.path
        );
        let timeout = self.daemon.engine.limits.max_timeout;
        self.start_file_op(
            req.id,
            label,
            req.profile,
            op,
            timeout,
            DOWNLOAD_QUEUE,
            Answer::Download,
            draining,
        )
        .await;
        Ok(())
    }

    async fn file_op(
        &mut self,
        id: String,
        path: &str,
        profile: Option<String>,
        op: FileOp,
        draining: bool,
    ) -> Result<(), ExecError> {
        check_path(path)?;
        let (label, answer) = match &op {
            FileOp::List { .. } => (format!("[list_dir] {path}"), Answer::List),
            _ => (format!("[stat] {path}"), Answer::Stat),
        };
        let timeout = self.daemon.engine.limits.default_timeout;
        self.start_file_op(
            id,
            label,
            profile,
            op,
            timeout,
            MAX_HEADER_BYTES,
            answer,
            draining,
        )
        .await;
        Ok(())
    }

    /// A file operation with nothing to write: admitted, registered and started.
    #[allow(clippy::too_many_arguments)]
    async fn start_file_op(
        &mut self,
        id: String,
        label: String,
        profile: Option<String>,
        op: FileOp,
        timeout: f64,
        queue: usize,
        answer: Answer,
        draining: bool,
    ) {
        let Some((mut valid, job, held)) = self
            .admit_file_op(&id, label.clone(), profile, timeout, draining)
            .await
        else {
            return;
        };
        let stdio = match make_stdio(None) {
            Ok(stdio) => stdio,
            Err(err) => {
                let err = ExecError::new(ErrorCode::EnvironmentError, err.to_string());
                job.refuse(&valid, err).await;
                return;
            }
        };
        valid.spec.builtin = Some(op);
        let ring = OutputRing::new(queue, false);
        let (process, attached) =
            register(&self.session, &valid.id, label, Kind::Query, ring, stdio);
        let task = self.session.tasks.track_future(async move {
            job.run_file_op(valid, attached, process, answer).await;
            drop(held);
        });
        self.daemon.tasks.spawn(task);
    }
}

/// Put a process (or file operation) into the session's table, start feeding its stdin, and
/// make what the runner needs.
fn register(
    session: &Session,
    id: &str,
    command: String,
    kind: Kind,
    ring: Arc<OutputRing>,
    stdio: Stdio,
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

/// What a file operation answers with.
#[derive(Debug, Clone, Copy)]
enum Answer {
    Upload,
    Download,
    Stat,
    List,
}

impl Job {
    /// A request admitted but not started (its stdio could not be made): refused.
    async fn refuse(self, req: &ValidRequest, err: ExecError) {
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
                process.exit.send_replace(Some(exited(result)));
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

    /// Run a file operation and answer it from the payload's header (and, for a download,
    /// stream the bytes that follow it).
    async fn run_file_op(
        self,
        req: ValidRequest,
        attached: Attached,
        process: Arc<Process>,
        answer: Answer,
    ) {
        let id = req.id.clone();
        let ring = attached.ring.clone();
        let failed = CancellationToken::new();
        let abort = matches!(answer, Answer::Upload).then(|| process.abort.clone());
        let exec = async {
            let result = self
                .execute_aborting(&req, Io::Attached(attached), abort)
                .await;
            if result.is_err() {
                failed.cancel();
            }
            result
        };
        let read = async {
            match answer {
                Answer::Download => forward_download(&self.session, &id, &ring, &failed).await,
                _ => read_header(&ring, &failed)
                    .await
                    .map(|(header, _)| (header, 0)),
            }
        };
        let (result, header) = tokio::join!(exec, read);
        // Every `write` after this is dropped: the upload has its answer.
        process.exit.send_replace(Some(Exited {
            id: id.clone(),
            running: false,
            returncode: result.as_ref().map_or(-1, |r| r.returncode),
            exception_info: String::new(),
            extra: None,
        }));
        // An answered upload stays listed (ended) so that `write`s still on their way are
        // dropped quietly; the rest are forgotten at once.
        if !matches!(answer, Answer::Upload) {
            self.session.processes.remove(&id, &process);
        }
        let reply = match (&result, header) {
            (Err(err), _) => Err(err.clone()),
            (Ok(_), Err(err)) => Err(err),
            (Ok(result), Ok((header, sent))) => answer_from(&id, answer, header, sent, result),
        };
        let reply = reply.unwrap_or_else(|err| {
            ServerMessage::Error(ErrorMessage {
                id: Some(id.clone()),
                code: err.code,
                message: err.message,
            })
        });
        self.session.running.finishing(&id);
        self.session.send(reply).await;
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

/// The reply to a file operation whose payload answered `header`.
fn answer_from(
    id: &str,
    answer: Answer,
    header: Header,
    sent: u64,
    result: &ExecResult,
) -> Result<ServerMessage, ExecError> {
    let (path, bytes, stat, entries, truncated) = match header {
        Header::Error { kind, message } => {
            use crate::files::ErrorKind;
            let code = match kind {
                ErrorKind::NotFound => ErrorCode::NotFound,
                ErrorKind::Denied => ErrorCode::Denied,
                ErrorKind::TooLarge | ErrorKind::Invalid => ErrorCode::BadRequest,
            };
            return Err(ExecError::new(code, message));
        }
        Header::Ok {
            path,
            bytes,
            stat,
            entries,
            truncated,
        } => (path, bytes, stat, entries, truncated),
    };
    if result.returncode != 0 {
        return Err(ExecError::new(
            ErrorCode::EnvironmentError,
            format!(
                "the file operation on {path} did not finish: {}",
                if result.exception_info.is_empty() {
                    format!("returncode {}", result.returncode)
                } else {
                    result.exception_info.clone()
                }
            ),
        ));
    }
    let id = id.to_string();
    Ok(match answer {
        Answer::Upload => ServerMessage::Uploaded(Uploaded {
            id,
            path,
            bytes: bytes.unwrap_or(0),
        }),
        Answer::Download => {
            if let Some(expected) = bytes.filter(|b| *b != sent) {
                return Err(ExecError::new(
                    ErrorCode::EnvironmentError,
                    format!("{path} changed while it was read: {sent} of {expected} bytes sent"),
                ));
            }
            ServerMessage::Downloaded(Downloaded {
                id,
                path,
                bytes: sent,
            })
        }
        Answer::Stat => ServerMessage::FileInfo(FileInfo {
            id,
            stat: stat.unwrap_or_default(),
        }),
        Answer::List => ServerMessage::DirListing(DirListing {
            id,
            path,
            entries: entries.unwrap_or_default(),
            truncated,
        }),
    })
}

/// The payload's header line, and the offset just after it.
async fn read_header(
    ring: &OutputRing,
    failed: &CancellationToken,
) -> Result<(Header, u64), ExecError> {
    let mut line = Vec::new();
    let mut offset = 0;
    loop {
        tokio::select! {
            () = ring.wait_for(offset, Duration::from_secs(60)) => {}
            () = failed.cancelled() => return Err(ExecError::new(ErrorCode::Internal, "the file operation did not start")),
        }
        let slice = ring.read(offset, 64 * 1024);
        if let Some(end) = slice.data.iter().position(|b| *b == b'\n') {
            line.extend_from_slice(&slice.data[..end]);
            let header = serde_json::from_slice(&line).map_err(|err| {
                ExecError::new(
                    ErrorCode::Internal,
                    format!("unreadable answer from the file operation: {err}"),
                )
            })?;
            return Ok((header, slice.offset + end as u64 + 1));
        }
        line.extend_from_slice(&slice.data);
        offset = slice.next_offset;
        if line.len() > MAX_HEADER_BYTES {
            return Err(ExecError::new(
                ErrorCode::Internal,
                "the file operation's answer is too long",
            ));
        }
        if slice.eof {
            return Err(ExecError::new(
                ErrorCode::EnvironmentError,
                "the file operation ended without an answer",
            ));
        }
    }
}

/// Send a download's bytes as they come, in `download_data` chunks; the connection's pace
/// sets the payload's (the ring is a bounded queue). A connection that drops ends it: the
/// client downloads the rest from its offset.
async fn forward_download(
    session: &Session,
    id: &str,
    ring: &OutputRing,
    failed: &CancellationToken,
) -> Result<(Header, u64), ExecError> {
    let (header, mut offset) = read_header(ring, failed).await?;
    if matches!(header, Header::Error { .. }) {
        ring.discarded.cancel();
        return Ok((header, 0));
    }
    let mut seq = 0;
    let mut sent = 0u64;
    loop {
        tokio::select! {
            () = ring.wait_for(offset, Duration::from_secs(60)) => {}
            () = failed.cancelled() => return Err(ExecError::new(ErrorCode::Internal, "the download stopped")),
        }
        let slice = ring.read(offset, DOWNLOAD_CHUNK);
        offset = slice.next_offset;
        if !slice.data.is_empty() {
            if !session.is_attached() {
                ring.discarded.cancel();
                return Err(ExecError::new(
                    ErrorCode::EnvironmentError,
                    format!(
                        "the connection dropped during the download after {sent} bytes; \
                         download the rest with offset"
                    ),
                ));
            }
            sent += slice.data.len() as u64;
            let chunk = ServerMessage::DownloadData(DownloadData {
                id: id.to_string(),
                seq,
                data: b64().encode(&slice.data),
            });
            seq += 1;
            session.send(chunk).await;
        }
        if slice.eof {
            return Ok((header, sent));
        }
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
