//! Runs one planned command through a sandbox helper and turns what happens into an outcome.
//!
//! The runner lives in the daemon (or in `executor run`). It spawns the helper, hands it the
//! plan, reads the output pipe into a bounded buffer (streaming it if asked), and ends the command
//! on timeout or stop by closing the helper's lifeline. It never waits on a pipe without a
//! deadline: once the helper has reported, the output is drained for at most [`DRAIN_DEADLINE`].

pub mod output;

use std::future::Future;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use protocol::{Ending, OutputChunk, ServerMessage};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Child;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::cgroup;
use crate::helper::HELPER_ARG;
use crate::plan::{HelperReport, Plan};
use output::{Captured, HeadTail, Utf8Stream};

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

/// Where streamed output goes: `output` messages for request `id`.
pub struct OutputSink {
    pub id: String,
    pub tx: mpsc::Sender<ServerMessage>,
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

/// Spawns helpers; one per daemon.
#[derive(Debug, Clone)]
pub struct Runner {
    pub helper_exe: PathBuf,
    pub max_output_bytes: usize,
    /// Helpers started ahead of time, waiting for their plan on stdin: the exec of our binary
    /// (about 2 ms) happens off the command's path. Empty for one-shot runs.
    warm: Arc<Mutex<Vec<Child>>>,
    warm_target: usize,
    refilling: Arc<AtomicBool>,
}

impl Runner {
    pub fn new(helper_exe: PathBuf, max_output_bytes: usize) -> Self {
        Self {
            helper_exe,
            max_output_bytes,
            warm: Arc::default(),
            warm_target: 0,
            refilling: Arc::default(),
        }
    }

    /// Keep `count` helpers started ahead of time (call inside the runtime).
    pub fn keep_warm(&mut self, count: usize) {
        self.warm_target = count;
        self.refill();
    }

    fn spawn_helper(&self) -> Result<Child, RunError> {
        // The helper starts from an empty environment: nothing of the daemon's reaches it.
        tokio::process::Command::new(&self.helper_exe)
            .arg(HELPER_ARG)
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| RunError::SpawnHelper {
                path: self.helper_exe.clone(),
                source,
            })
    }

    fn warm(&self) -> std::sync::MutexGuard<'_, Vec<Child>> {
        // A panic while holding the lock leaves a valid Vec; keep using it.
        self.warm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A warm helper if one is alive, else a fresh one; either way the pool is topped up in
    /// the background.
    fn take_helper(&self) -> Result<Child, RunError> {
        let warm = {
            let mut pool = self.warm();
            let mut found = None;
            while let Some(mut child) = pool.pop() {
                if matches!(child.try_wait(), Ok(None)) {
                    found = Some(child);
                    break;
                }
            }
            found
        };
        let child = match warm {
            Some(child) => child,
            None => self.spawn_helper()?,
        };
        self.refill();
        Ok(child)
    }

    fn refill(&self) {
        if self.warm_target == 0 || self.refilling.swap(true, Ordering::AcqRel) {
            return;
        }
        let runner = self.clone();
        tokio::task::spawn_blocking(move || {
            while runner.warm().len() < runner.warm_target {
                match runner.spawn_helper() {
                    Ok(child) => runner.warm().push(child),
                    Err(err) => {
                        tracing::warn!(%err, "cannot start a helper ahead of time");
                        break;
                    }
                }
            }
            runner.refilling.store(false, Ordering::Release);
        });
    }

    /// Run `plan` until it ends, `timeout` passes, or `stop` resolves.
    pub async fn run(
        &self,
        plan: &Plan,
        timeout: Duration,
        sink: Option<OutputSink>,
        stop: impl Future<Output = StopReason>,
    ) -> Result<Outcome, RunError> {
        let started = Instant::now();
        let mut line = serde_json::to_vec(plan).map_err(RunError::Plan)?;
        line.push(b'\n');

        let mut child = self.take_helper()?;
        let (Some(mut lifeline), Some(out_pipe), Some(status_pipe)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(RunError::SpawnHelper {
                path: self.helper_exe.clone(),
                source: std::io::Error::other("helper pipes missing"),
            });
        };
        // A failed write means the helper already died; its report (or its absence) says why.
        let _ = lifeline.write_all(&line).await;

        let drain_stop = CancellationToken::new();
        let reader = tokio::spawn(read_output(
            out_pipe,
            self.max_output_bytes,
            sink,
            drain_stop.clone(),
        ));
        let report_fut = read_report(status_pipe);
        tokio::pin!(report_fut, stop);

        // Wait for the helper to report on its own, or stop it.
        let mut stopped_for = None;
        let report = tokio::select! {
            report = &mut report_fut => report,
            () = tokio::time::sleep(timeout) => {
                stopped_for = Some(Ending::TimedOut);
                None
            }
            reason = &mut stop => {
                stopped_for = Some(reason.ending());
                None
            }
        };
        let report = match report {
            Some(report) => Some(report),
            None => {
                // Closing the lifeline tells the helper to kill the tree and report.
                drop(lifeline);
                match tokio::time::timeout(STOP_GRACE, &mut report_fut).await {
                    Ok(report) => report,
                    Err(_) => {
                        tracing::warn!("sandbox helper did not report within {STOP_GRACE:?}");
                        None
                    }
                }
            }
        };
        // Backstops for a helper that died or hung: kill it and everything in its cgroup.
        if report.is_none() {
            let _ = child.start_kill();
            let dirs: Vec<_> = plan
                .cgroups
                .iter()
                .map(|c| (c.dir.clone(), c.kill))
                .collect();
            tokio::task::spawn_blocking(move || {
                for (dir, kill) in &dirs {
                    if *kill {
                        cgroup::kill(dir);
                    }
                }
                for (dir, _) in &dirs {
                    cgroup::remove(dir);
                }
            });
        }
        let _ = child.wait().await;

        // Every writer of the output pipe is dead by now, unless a process escaped every kill;
        // read what is buffered, but never wait on such an orphan for long.
        let mut reader = reader;
        let joined = match tokio::time::timeout(DRAIN_DEADLINE, &mut reader).await {
            Ok(joined) => joined,
            Err(_) => {
                tracing::warn!("output pipe still open {DRAIN_DEADLINE:?} after the command ended");
                drain_stop.cancel();
                reader.await
            }
        };
        let captured = match joined {
            Ok(buffer) => buffer.finish(),
            Err(_) => HeadTail::new(0).finish(),
        };

        let mut outcome = Outcome {
            captured,
            ending: Ending::Exited,
            returncode: protocol::RETURNCODE_NOT_FINISHED,
            signal: None,
            exception_info: String::new(),
            killed: 0,
            layers: plan.layers.clone(),
            limits_hit: Vec::new(),
            duration: started.elapsed(),
        };
        match report {
            Some(HelperReport::SetupFailed { stage, message }) => {
                return Err(RunError::Setup { stage, message })
            }
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

/// Read the helper's report: the last line it wrote before closing its stderr.
async fn read_report(pipe: impl AsyncRead + Unpin) -> Option<HelperReport> {
    let mut bytes = Vec::new();
    let _ = pipe.take(MAX_REPORT_BYTES).read_to_end(&mut bytes).await;
    let text = String::from_utf8_lossy(&bytes);
    let line = text.lines().rev().find(|l| !l.trim().is_empty())?;
    match serde_json::from_str(line) {
        Ok(report) => Some(report),
        Err(err) => {
            tracing::warn!(%err, output = %text, "unreadable report from the sandbox helper");
            None
        }
    }
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
                sent = out.tx.send(msg) => sent.is_ok(),
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
            let _ = out.tx.try_send(msg);
        }
    }
    buffer
}
