//! Runs one planned command through a sandbox helper and turns what happens into an outcome.
//!
//! The runner lives in the daemon (or in `executor run`). It spawns the helper, hands it the
//! plan, reads the output pipe into a bounded buffer (streaming it if asked), and ends the command
//! on timeout or stop by closing the helper's lifeline. It never waits on a pipe without a
//! deadline: once the helper has reported, the output is drained for at most [`DRAIN_DEADLINE`].

pub mod attached;
pub mod output;

use std::future::Future;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::unistd::Pid;
use protocol::{Ending, OutputChunk, ServerMessage};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::process::Child;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use attached::Attached;
use output::{Captured, HeadTail, Utf8Stream};
use sandbox::cgroup;
use sandbox::plan::{HelperReport, Plan};
use sandbox::spawner::Spawner;
use sandbox::HELPER_ARG;

/// How long the helper may take to kill the tree and report after the lifeline closes.
const STOP_GRACE: Duration = Duration::from_secs(6);
/// How long to keep reading output after the helper has reported.
const DRAIN_DEADLINE: Duration = Duration::from_millis(500);
/// Size of one read from the output pipe, and so the largest streamed chunk.
const READ_CHUNK: usize = 64 * 1024;
/// The helper's report is one short JSON line; anything longer is cut.
const MAX_REPORT_BYTES: u64 = 64 * 1024;

/// Why the daemon stopped a command before it ended on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    Cancelled,
    Disconnected,
    Shutdown,
}

impl StopReason {
    fn ending(self) -> Ending {
        match self {
            Self::Cancelled => Ending::Cancelled,
            Self::Disconnected => Ending::Disconnected,
            Self::Shutdown => Ending::Shutdown,
        }
    }
}

/// How the command's stdio is served.
pub enum Io {
    /// A command: stdin /dev/null, output captured head and tail for its result (and
    /// streamed as `output` messages when a sink is given).
    Capture(Option<OutputSink>),
    /// A process or file operation: stdio on a descriptor the daemon keeps talking to.
    Attached(Attached),
}

/// Where streamed output goes: `output` messages for request `id`.
pub struct OutputSink {
    pub id: String,
    pub to: std::sync::Arc<dyn Replies>,
}

/// Whoever delivers replies to the client (the daemon's session). Awaiting `send` is the
/// backpressure a slow client puts on its command.
pub trait Replies: Send + Sync {
    fn send(&self, msg: ServerMessage) -> futures_util::future::BoxFuture<'_, ()>;
}

/// A plain queue (`executor run` prints from one); a closed queue drops the reply.
impl Replies for mpsc::Sender<ServerMessage> {
    fn send(&self, msg: ServerMessage) -> futures_util::future::BoxFuture<'_, ()> {
        Box::pin(async move {
            let _ = mpsc::Sender::send(self, msg).await;
        })
    }
}

/// How one command ended, before it is shaped into a protocol result.
#[derive(Debug)]
pub struct Outcome {
    pub captured: Captured,
    pub ending: Ending,
    /// Exit code, `-signal`, or -1 when the command did not finish on its own.
    pub returncode: i32,
    pub signal: Option<i32>,
    pub exception_info: String,
    pub killed: u32,
    pub layers: Vec<String>,
    pub limits_hit: Vec<String>,
    pub duration: Duration,
    /// What the network policy let through and refused, when one filtered the command.
    pub network: Option<protocol::NetworkUse>,
}

/// A network policy's listeners, to put in the command's namespace before it starts
/// (`crate::enforce`).
pub struct NetAttach<'a> {
    pub enforcer: &'a crate::enforce::Enforcer,
    pub ctx: Arc<crate::egress::CommandContext>,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot start the sandbox helper {path}: {source}")]
    SpawnHelper {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot serialize the plan: {0}")]
    Plan(#[source] serde_json::Error),
    #[error("sandbox setup failed at stage {stage}: {message}")]
    Setup { stage: String, message: String },
}

/// Starts helpers and runs commands through them; one per daemon.
#[derive(Debug, Clone)]
pub struct Runner {
    pub helper_exe: PathBuf,
    pub max_output_bytes: usize,
    /// The fork server, when the process started one (`executor serve`); otherwise each
    /// helper is started by exec of our own binary.
    spawner: Option<Arc<Spawner>>,
    /// Whether the fork server keeps a worker warm after each command (`--no-warm-workers`
    /// turns it off).
    pub warm_workers: bool,
}

/// A started helper: the daemon's ends of its three pipes, and its process.
struct Helper {
    lifeline: Box<dyn AsyncWrite + Send + Unpin>,
    /// None when the command's output descriptor was given (an attached command).
    output: Option<Box<dyn AsyncRead + Send + Unpin>>,
    status: Box<dyn AsyncRead + Send + Unpin>,
    process: HelperProcess,
}

enum HelperProcess {
    /// Started by exec: a child of ours, waited for by tokio.
    Exec(Child),
    /// Forked by the fork server, which reaps it.
    Forked(Pid),
}

impl HelperProcess {
    fn pid(&self) -> u32 {
        match self {
            Self::Exec(child) => child.id().unwrap_or(0),
            Self::Forked(pid) => pid.as_raw().unsigned_abs(),
        }
    }

    /// Kill a helper that stopped answering. Only called while its status pipe is still open,
    /// which proves it is alive, so a forked helper's pid cannot have been reused.
    fn kill(&mut self) {
        match self {
            Self::Exec(child) => {
                let _ = child.start_kill();
            }
            Self::Forked(pid) => {
                let _ = nix::sys::signal::kill(*pid, nix::sys::signal::Signal::SIGKILL);
            }
        }
    }

    async fn wait(&mut self) {
        if let Self::Exec(child) = self {
            let _ = child.wait().await;
        }
    }
}

impl Runner {
    pub fn new(helper_exe: PathBuf, max_output_bytes: usize) -> Self {
        Self {
            helper_exe,
            max_output_bytes,
            spawner: None,
            warm_workers: true,
        }
    }

    /// Fork helpers from `spawner` instead of exec'ing them.
    pub fn use_spawner(&mut self, spawner: Spawner) {
        self.spawner = Some(Arc::new(spawner));
    }

    /// The fork server in use, if any (a one-shot's, for its last words: `executor run`).
    pub fn spawner(&self) -> Option<Arc<Spawner>> {
        self.spawner.clone()
    }

    /// End every idle warm worker (after a reload of the clients file).
    pub fn dismiss_warm_workers(&self) {
        if let Some(spawner) = &self.spawner {
            if let Err(err) = spawner.dismiss_idle() {
                tracing::warn!(%err, "cannot dismiss the idle warm workers");
            }
        }
    }

    /// Start a helper for `plan`: from the fork server (a warm worker when one waits for the
    /// template; another kept warm after it when `warm`), or by exec. Returns it and the line
    /// still to be written into its lifeline.
    /// With `withhold`, none of the command line is written yet (the caller writes it once
    /// the command may start).
    fn start_helper(
        &self,
        plan: &Plan,
        warm: bool,
        output: Option<&OwnedFd>,
        withhold: bool,
    ) -> Result<(Helper, Vec<u8>), RunError> {
        if let Some(spawner) = &self.spawner {
            let template = serde_json::to_vec(&plan.template).map_err(RunError::Plan)?;
            let mut command = serde_json::to_vec(&plan.command).map_err(RunError::Plan)?;
            command.push(b'\n');
            let broken_before = spawner.is_broken();
            let line: &[u8] = if withhold { &[] } else { &command };
            match fork_helper(spawner, &template, warm, line, output) {
                Ok((helper, written)) => return Ok((helper, command.split_off(written))),
                // Said once, when it happens, in words a user can act on; every command after
                // it takes the same slower path without a line each.
                Err(err) if !broken_before => tracing::warn!(
                    %err,
                    "the fork server (the process that starts each command's sandbox) stopped \
                     working; commands still run, with the same isolation, each started by \
                     executing the executor binary again: about a millisecond slower each, and \
                     no sandbox is built ahead of its command. Nothing to do unless it comes \
                     back after a restart of the executor: then report it with this log"
                ),
                Err(err) => tracing::debug!(%err, "fork server unusable; helper started by exec"),
            }
        }
        if withhold {
            // An exec'd helper makes the pid namespace's init itself: the daemon would not
            // learn which process holds the network namespace. Refused, never run unfiltered.
            return Err(RunError::Setup {
                stage: "network".into(),
                message: "a network policy needs the fork server, which is not running; \
                          the command was not started"
                    .into(),
            });
        }
        // Exec mode: the template's length on a line, the template, then the command line
        // (`helper::main` reads the template alone and leaves the command to the payload).
        let template = serde_json::to_vec(&plan.template).map_err(RunError::Plan)?;
        let mut line = format!("{}\n", template.len()).into_bytes();
        line.extend_from_slice(&template);
        serde_json::to_writer(&mut line, &plan.command).map_err(RunError::Plan)?;
        line.push(b'\n');
        Ok((self.exec_helper(output)?, line))
    }

    fn exec_helper(&self, output: Option<&OwnedFd>) -> Result<Helper, RunError> {
        let spawn_err = |source| RunError::SpawnHelper {
            path: self.helper_exe.clone(),
            source,
        };
        let stdout = match output {
            Some(fd) => Stdio::from(fd.try_clone().map_err(spawn_err)?),
            None => Stdio::piped(),
        };
        // The helper starts from an empty environment: nothing of the daemon's reaches it.
        let mut child = tokio::process::Command::new(&self.helper_exe)
            .arg(HELPER_ARG)
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(stdout)
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(spawn_err)?;
        let (Some(lifeline), Some(status)) = (child.stdin.take(), child.stderr.take()) else {
            return Err(spawn_err(std::io::Error::other("helper pipes missing")));
        };
        let output = child
            .stdout
            .take()
            .map(|out| Box::new(out) as Box<dyn AsyncRead + Send + Unpin>);
        Ok(Helper {
            lifeline: Box::new(lifeline),
            output,
            status: Box::new(status),
            process: HelperProcess::Exec(child),
        })
    }

    /// Run `plan` until it ends, `timeout` passes, or `stop` resolves. With `warm`, a worker
    /// for the same sandbox is kept ready for the next command.
    /// Under a network policy (`net`), its listeners are put in the command's namespace
    /// before the command line is written: the command never runs without them.
    pub async fn run(
        &self,
        plan: &Plan,
        warm: bool,
        timeout: Duration,
        io: Io,
        stop: impl Future<Output = StopReason>,
        net: Option<NetAttach<'_>>,
    ) -> Result<Outcome, RunError> {
        let started = Instant::now();
        let warm = warm && self.warm_workers;
        let (sink, attached) = match io {
            Io::Capture(sink) => (sink, None),
            Io::Attached(attached) => (None, Some(attached)),
        };
        let (
            Helper {
                mut lifeline,
                output: out_pipe,
                status: status_pipe,
                mut process,
            },
            rest,
        ) = self.start_helper(
            plan,
            warm,
            attached.as_ref().map(|a| &a.theirs),
            net.is_some(),
        )?;
        let listening = match net {
            None => None,
            Some(net) => match net.enforcer.attach(process.pid(), net.ctx).await {
                Ok(listening) => Some(listening),
                Err(err) => {
                    // Closing the lifeline before any command line ends the sandbox. A
                    // sandbox whose set-up failed (so it made no namespace) says why.
                    drop(lifeline);
                    let report = tokio::time::timeout(STOP_GRACE, read_status(status_pipe, None));
                    if let Ok(Some(HelperReport::SetupFailed { stage, message })) = report.await {
                        return Err(RunError::Setup { stage, message });
                    }
                    return Err(RunError::Setup {
                        stage: "network".into(),
                        message: format!(
                            "cannot put the network policy's listeners in the command's \
                             network namespace ({err}); the command was not started"
                        ),
                    });
                }
            },
        };
        // A failed write means the helper already died; its report (or its absence) says why.
        if !rest.is_empty() {
            let _ = lifeline.write_all(&rest).await;
        }

        let drain_stop = CancellationToken::new();
        let (reader, ring, mut signals, started_tx) = match (attached, out_pipe) {
            (Some(a), _) => {
                // The helper has its copy of the payload's end; ours would keep the output
                // open after the command's tree is gone.
                drop(a.theirs);
                let pump = tokio::spawn(attached::pump(a.output, a.ring.clone()));
                drop(pump);
                (None, Some(a.ring), Some(a.signals), a.started)
            }
            (None, Some(pipe)) => {
                let reader = tokio::spawn(read_output(
                    pipe,
                    self.max_output_bytes,
                    sink,
                    drain_stop.clone(),
                ));
                (Some(reader), None, None, None)
            }
            (None, None) => {
                return Err(RunError::Setup {
                    stage: "output".into(),
                    message: "the helper was started without an output pipe".into(),
                })
            }
        };
        let report_fut = read_status(status_pipe, started_tx);
        tokio::pin!(report_fut, stop);
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);

        // Wait for the helper to report on its own, or stop it; pass signals on meanwhile.
        let mut stopped_for = None;
        // The status pipe's end came without a report (its supervisor died): nothing more
        // will come on it, and it may not be polled again.
        let mut ended_silent = false;
        let report = loop {
            tokio::select! {
                report = &mut report_fut => {
                    ended_silent = report.is_none();
                    break report;
                }
                () = &mut deadline => {
                    stopped_for = Some(Ending::TimedOut);
                    break None;
                }
                reason = &mut stop => {
                    stopped_for = Some(reason.ending());
                    break None;
                }
                Some(signal) = async {
                    match signals.as_mut() {
                        Some(rx) => rx.recv().await,
                        None => std::future::pending().await,
                    }
                } => {
                    let line = format!("signal {signal}\n");
                    let _ = lifeline.write_all(line.as_bytes()).await;
                }
            }
        };
        let mut hung = false;
        let report = match report {
            Some(report) => Some(report),
            None if ended_silent => None,
            None => {
                // Closing the lifeline tells the helper to kill the tree and report.
                drop(lifeline);
                match tokio::time::timeout(STOP_GRACE, &mut report_fut).await {
                    Ok(report) => report,
                    Err(_) => {
                        tracing::warn!("sandbox helper did not report within {STOP_GRACE:?}");
                        hung = true;
                        None
                    }
                }
            }
        };
        // Backstops for a helper that died or hung: kill it (only if it is surely still
        // alive) and everything in its cgroup.
        if report.is_none() {
            if hung {
                process.kill();
            }
            let name = sandbox::plan::cgroup_name(process.pid());
            let dirs: Vec<_> = plan
                .template
                .cgroups
                .iter()
                .map(|c| (c.dir(&name), c.kill, c.is_parent))
                .collect();
            tokio::task::spawn_blocking(move || {
                for (dir, kill, _) in &dirs {
                    if *kill {
                        cgroup::kill(dir);
                    }
                }
                // A caller's own directory is its caller's to remove.
                for (dir, _, _) in dirs.iter().filter(|(_, _, is_parent)| !is_parent) {
                    cgroup::remove(dir);
                }
            });
        }
        process.wait().await;

        // Every writer of the output pipe is dead by now, unless a process escaped every kill;
        // read what is buffered, but never wait on such an orphan for long. An attached
        // command's output goes on into its ring, read by the client at its own pace.
        let captured = match (reader, ring) {
            (Some(mut reader), _) => {
                let joined = match tokio::time::timeout(DRAIN_DEADLINE, &mut reader).await {
                    Ok(joined) => joined,
                    Err(_) => {
                        tracing::warn!(
                            "output pipe still open {DRAIN_DEADLINE:?} after the command ended"
                        );
                        drain_stop.cancel();
                        reader.await
                    }
                };
                match joined {
                    Ok(buffer) => buffer.finish(),
                    Err(_) => HeadTail::new(0).finish(),
                }
            }
            (None, ring) => Captured {
                text: String::new(),
                total_bytes: ring.map_or(0, |r| r.total()),
                elided_bytes: 0,
            },
        };

        let mut outcome = Outcome {
            captured,
            ending: Ending::Exited,
            returncode: protocol::RETURNCODE_NOT_FINISHED,
            signal: None,
            exception_info: String::new(),
            killed: 0,
            layers: plan.template.layers.clone(),
            limits_hit: Vec::new(),
            duration: started.elapsed(),
            // The command has ended: its tally is complete, and its listeners close here.
            network: listening.map(|l| protocol::NetworkUse {
                captured_ports: l.captured.clone(),
                proxy_only: l.proxy_only.clone(),
                ..l.tally.snapshot()
            }),
        };
        match report {
            Some(HelperReport::SetupFailed { stage, message }) => {
                return Err(RunError::Setup { stage, message })
            }
            // `read_status` never returns it.
            Some(HelperReport::Started) => {}
            Some(HelperReport::Finished {
                code,
                signal,
                killed,
                stopped,
                layers,
                limits_hit,
            }) => {
                outcome.limits_hit = limits_hit;
                outcome.killed = killed;
                outcome.layers = layers;
                outcome.signal = signal;
                match (stopped, stopped_for) {
                    // The payload ended on its own, even if a stop raced with it.
                    (false, _) | (true, None) => {
                        if let Some(code) = code {
                            outcome.returncode = code;
                        } else if let Some(sig) = signal {
                            outcome.ending = Ending::Signaled;
                            outcome.returncode = -sig;
                        }
                    }
                    (true, Some(ending)) => {
                        outcome.ending = ending;
                        outcome.exception_info = stop_message(ending, timeout);
                    }
                }
            }
            None => {
                outcome.ending = stopped_for.unwrap_or(Ending::Signaled);
                outcome.exception_info = match stopped_for {
                    Some(ending) => stop_message(ending, timeout),
                    None => "the sandbox helper died before the command finished; \
                             its process tree was killed"
                        .to_string(),
                };
            }
        }
        Ok(outcome)
    }
}

fn stop_message(ending: Ending, timeout: Duration) -> String {
    match ending {
        Ending::TimedOut => format!(
            "Command timed out after {} seconds; its whole process tree was killed.",
            timeout.as_secs_f64()
        ),
        Ending::Cancelled => "Command cancelled by the client; its process tree was killed.".into(),
        Ending::Disconnected => {
            "The client disconnected; the command's process tree was killed.".into()
        }
        Ending::Shutdown => {
            "The executor is shutting down; the command's process tree was killed.".into()
        }
        Ending::Exited | Ending::Signaled => String::new(),
    }
}

/// Have the fork server start (or hand over) a helper, wired to fresh pipes (or, for the
/// output, to `output` when given); `line` goes into its lifeline first. Returns how much of
/// it was written.
fn fork_helper(
    spawner: &Spawner,
    template: &[u8],
    warm: bool,
    line: &[u8],
    output: Option<&OwnedFd>,
) -> std::io::Result<(Helper, usize)> {
    let started = spawner.start_helper(template, warm, line, output)?;
    use tokio::net::unix::pipe;
    let output = match started.output {
        Some(r) => {
            Some(Box::new(pipe::Receiver::from_owned_fd(r)?) as Box<dyn AsyncRead + Send + Unpin>)
        }
        None => None,
    };
    let helper = Helper {
        lifeline: Box::new(pipe::Sender::from_owned_fd(started.lifeline)?),
        output,
        status: Box::new(pipe::Receiver::from_owned_fd(started.status)?),
        process: HelperProcess::Forked(started.pid),
    };
    Ok((helper, started.written))
}

/// Read the supervisor's status pipe: `started` (passed on to `started`), then the report, the
/// first line after it (from init or the helper, ARCHITECTURE.md "Init leads"), or nothing
/// when the pipe closes without one. The pipe's end is not awaited: a process the payload
/// forked (a file operation's) may hold a copy a moment longer.
async fn read_status(
    pipe: impl AsyncRead + Unpin,
    mut started: Option<tokio::sync::oneshot::Sender<()>>,
) -> Option<HelperReport> {
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(pipe.take(MAX_REPORT_BYTES)).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<HelperReport>(&line) {
            Ok(HelperReport::Started) => {
                if let Some(tx) = started.take() {
                    let _ = tx.send(());
                }
            }
            Ok(report) => return Some(report),
            Err(err) => {
                tracing::warn!(%err, output = %line, "unreadable report from the sandbox helper");
            }
        }
    }
    None
}

/// Copy the output pipe into a head-and-tail buffer until end-of-file or `stop`, streaming
/// chunks to `sink` if given. Awaiting the sink is the backpressure: a slow client slows the
/// command instead of growing our memory.
async fn read_output(
    mut pipe: impl AsyncRead + Unpin,
    cap: usize,
    mut sink: Option<OutputSink>,
    stop: CancellationToken,
) -> HeadTail {
    let mut buffer = HeadTail::new(cap);
    let mut decoder = Utf8Stream::default();
    let mut chunk = vec![0u8; READ_CHUNK];
    let mut seq = 0u64;
    loop {
        let n = tokio::select! {
            read = pipe.read(&mut chunk) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            },
            () = stop.cancelled() => break,
        };
        buffer.push(&chunk[..n]);
        if let Some(out) = &sink {
            let data = decoder.decode(&chunk[..n]);
            if data.is_empty() {
                continue;
            }
            let msg = ServerMessage::Output(OutputChunk {
                id: out.id.clone(),
                seq,
                data,
            });
            seq += 1;
            let sent = tokio::select! {
                () = out.to.send(msg) => true,
                () = stop.cancelled() => false,
            };
            if !sent {
                sink = None;
            }
        }
    }
    if let Some(out) = &sink {
        let data = decoder.finish();
        if !data.is_empty() {
            let msg = ServerMessage::Output(OutputChunk {
                id: out.id.clone(),
                seq,
                data,
            });
            out.to.send(msg).await;
        }
    }
    buffer
}
