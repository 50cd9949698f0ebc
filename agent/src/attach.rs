//! A process attached to our stdin and stdout (protocol 1.1): `agent exec --stdin` (pipes)
//! and `agent shell` (a pseudo-terminal, like `docker exec -it`).
//!
//! One loop per process: bytes from our stdin become `write`s (and end of file `eof`), one at
//! a time so that a refused one can be sent again in order; one `read` with a wait is always
//! outstanding and its output goes to our stdout as it arrives; window changes become
//! `resize`; when the output ends, `wait` gives the return code.

use std::io::Read;
use std::time::Duration;

use clap::Args;
use protocol::{ErrorCode, Exited, PtySize, ServerMessage, SpawnRequest};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use crate::agent_loop::{Caught, Interrupts, INTERRUPTED};
use crate::command_args::{env_pairs, exit_code, CommandPlace, ExecArgs, EXEC_FAILED};
use crate::deploy::flags::ExecutorArgs;
use crate::executor_client::{
    decode_output, list_processes_message, resize_message, signal_message, wait_message, Client,
    ClientError,
};
use crate::target::{Reached, Unreached};

/// Seconds a `read` waits for output the process has not written yet (at most 60).
const READ_WAIT: f64 = 30.0;
/// Seconds per `wait` for a process whose output has ended (at most 60; asked again).
const WAIT_STEP: f64 = 30.0;
/// Errors about the process in a row, with no output between them, before we give up.
const MAX_FAILURES: u32 = 8;
/// First and longest pause before a `write` the executor refused as `busy` (64 writes or 4 MiB
/// queued for a program that does not read its stdin) is sent again.
const BUSY_BACKOFF_START: Duration = Duration::from_millis(20);
const BUSY_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Bytes per read of our stdin (a pipe holds 64 KiB).
const STDIN_READ_BYTES: usize = 64 * 1024;
/// Reads of our stdin queued for the loop: what it joins into one `write` when input comes
/// faster than it is sent.
const STDIN_READS_QUEUED: usize = 16;
/// Time past a `wait`'s own timeout for its answer.
const WAIT_SLACK: Duration = Duration::from_secs(30);

#[derive(Args)]
pub struct ShellArgs {
    #[command(flatten)]
    pub executor: ExecutorArgs,
    #[command(flatten)]
    pub place: CommandPlace,
    /// Seconds before the shell's whole process tree is killed (default: the executor's
    /// longest).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// The program (default: `bash -i`); several words are joined with spaces, as ssh does.
    #[arg(last = true)]
    pub command: Vec<String>,
}

/// What the loop feeds the process.
#[derive(Debug)]
enum Input {
    Bytes(Vec<u8>),
    Eof,
    Resize(PtySize),
}

/// What Ctrl-C (SIGINT) does to the process.
#[derive(Clone, Copy, PartialEq, Eq)]
enum OnInterrupt {
    /// Kill its whole tree (`agent exec`: as a cancel does), then report 130.
    Kill,
    /// Pass SIGINT to the terminal's foreground process group, as the key would; the shell
    /// goes on (`agent shell` whose stdin is not a terminal: in raw mode Ctrl-C is a byte the
    /// remote terminal turns into SIGINT itself).
    Forward,
}

/// How the loop ended.
enum Ended {
    Exited(Box<Exited>),
    /// Ctrl-C twice, or SIGTERM: we stopped waiting (closing the connection kills the rest).
    Abandoned,
}

/// `agent exec --stdin`: the command's stdin is ours.
pub async fn exec_with_stdin(
    args: &ExecArgs,
    reached: &Reached,
    interrupts: &mut Interrupts,
) -> anyhow::Result<u8> {
    let env = env_pairs(&args.place.env)?;
    let profile = reached
        .profile(
            args.executor.profile.as_deref(),
            args.place.network.network()?,
        )
        .await?;
    let mut client = reached.client().await?;
    crate::target::say_default_profile(&profile, client.hello());
    let outcome = async {
        client.require("processes", "`agent exec --stdin`")?;
        let id = client.new_id("exec");
        client
            .spawn(SpawnRequest {
                id: id.clone(),
                command: args.command.join(" "),
                cwd: args.place.cwd.clone(),
                env,
                timeout: Some(args.timeout),
                profile,
                pty: None,
                network: args.place.network.network()?,
            })
            .await
            .map_err(|e| anyhow::anyhow!("the executor refused the command: {e}"))?;
        let (tx, rx) = mpsc::channel(STDIN_READS_QUEUED);
        forward_stdin(tx);
        let ended = pump(&mut client, &id, rx, interrupts, OnInterrupt::Kill).await?;
        Ok::<_, anyhow::Error>(ended)
    }
    .await;
    client.close().await;
    Ok(report("exec", outcome?))
}

pub async fn shell(args: ShellArgs) -> anyhow::Result<u8> {
    let mut interrupts = Interrupts::install()?;
    // A bad flag is said before an executor is started or reached.
    let network = match args.place.network.network() {
        Ok(network) => network,
        Err(e) => {
            eprintln!("agent shell: {e:#}");
            return Ok(EXEC_FAILED);
        }
    };
    let reached =
        match crate::target::reach(&args.executor, "shell", network, &mut interrupts).await {
            Ok(reached) => reached,
            Err(Unreached::Interrupted) => return Ok(INTERRUPTED),
            Err(Unreached::Failed(e)) => {
                eprintln!("agent shell: {e:#}");
                return Ok(EXEC_FAILED);
            }
        };
    let result = shell_with(&args, &reached, &mut interrupts).await;
    reached.stop().await;
    match result {
        Ok(code) => Ok(code),
        Err(e) => {
            eprintln!("agent shell: {e:#}");
            Ok(EXEC_FAILED)
        }
    }
}

async fn shell_with(
    args: &ShellArgs,
    reached: &Reached,
    interrupts: &mut Interrupts,
) -> anyhow::Result<u8> {
    let mut env = env_pairs(&args.place.env)?;
    // Programs on the remote terminal draw for ours: tell them what it is.
    if !env.contains_key("TERM") {
        let term = std::env::var("TERM").ok().filter(|t| !t.is_empty());
        env.insert("TERM".into(), term.unwrap_or_else(|| "xterm".into()));
    }
    let command = if args.command.is_empty() {
        "bash -i".to_string()
    } else {
        args.command.join(" ")
    };
    let profile = reached
        .profile(
            args.executor.profile.as_deref(),
            args.place.network.network()?,
        )
        .await?;
    let mut client = reached.client().await?;
    crate::target::say_default_profile(&profile, client.hello());
    let outcome = async {
        client.require("processes", "`agent shell`")?;
        client.require("pty", "`agent shell`")?;
        let id = client.new_id("shell");
        client
            .spawn(SpawnRequest {
                id: id.clone(),
                command,
                cwd: args.place.cwd.clone(),
                env,
                timeout: args.timeout,
                profile,
                pty: Some(crate::terminal::size().unwrap_or(crate::terminal::DEFAULT_SIZE)),
                network: args.place.network.network()?,
            })
            .await
            .map_err(|e| anyhow::anyhow!("the executor refused the shell: {e}"))?;
        // Raw mode only once the shell runs, so that errors before read normally; the guard
        // puts the terminal back however the loop ends (the `?` below included).
        let raw = crate::terminal::RawMode::enter()?;
        let (tx, rx) = mpsc::channel(STDIN_READS_QUEUED);
        let resizes = if raw.is_some() {
            Some(tokio::spawn(forward_resizes(tx.clone())))
        } else {
            None
        };
        forward_stdin(tx);
        let on_interrupt = if raw.is_some() {
            OnInterrupt::Kill
        } else {
            OnInterrupt::Forward
        };
        let ended = pump(&mut client, &id, rx, interrupts, on_interrupt).await;
        if let Some(task) = resizes {
            task.abort();
        }
        drop(raw);
        Ok::<_, anyhow::Error>(ended?)
    }
    .await;
    client.close().await;
    Ok(report("shell", outcome?))
}

/// Our exit code for how the loop ended, with the executor's explanation on stderr.
fn report(verb: &str, ended: Ended) -> u8 {
    match ended {
        Ended::Abandoned => INTERRUPTED,
        Ended::Exited(exited) => {
            if !exited.exception_info.is_empty() {
                eprintln!("agent {verb}: {}", exited.exception_info);
            }
            match exited.extra {
                Some(extra) => exit_code(exited.returncode, extra.ended),
                None => (exited.returncode & 0xff) as u8,
            }
        }
    }
}

/// Our stdin to `tx`, from a thread of its own: a read blocked on a terminal must not hold a
/// runtime thread, nor keep the runtime from shutting down when the process has ended. Each
/// read goes at once (keys typed, a line from a slow pipe); [`Stdin::next`] joins what piles up.
fn forward_stdin(tx: mpsc::Sender<Input>) {
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buffer = vec![0; STDIN_READ_BYTES];
        loop {
            let input = match stdin.read(&mut buffer) {
                Ok(0) => Input::Eof,
                Ok(n) => Input::Bytes(buffer[..n].to_vec()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!("cannot read stdin: {e}; closing the process's stdin");
                    Input::Eof
                }
            };
            let last = matches!(input, Input::Eof);
            if tx.blocking_send(input).is_err() || last {
                return;
            }
        }
    });
}

/// What the loop takes from our stdin: reads that queued up while a `write` was being sent are
/// joined into one, up to a message's worth: fewer messages when the input comes fast, while a
/// trickle of input (keys) still goes a little at a time.
struct Stdin {
    rx: mpsc::Receiver<Input>,
    /// A read that did not fit the last write, or what came after the bytes.
    held: Option<Input>,
    limit: usize,
}

impl Stdin {
    async fn next(&mut self) -> Option<Input> {
        let first = match self.held.take() {
            Some(input) => input,
            None => self.rx.recv().await?,
        };
        let Input::Bytes(mut bytes) = first else {
            return Some(first);
        };
        while bytes.len() < self.limit {
            match self.rx.try_recv() {
                Ok(Input::Bytes(more)) if bytes.len() + more.len() <= self.limit => {
                    bytes.extend_from_slice(&more);
                }
                Ok(other) => {
                    self.held = Some(other);
                    break;
                }
                Err(_) => break,
            }
        }
        Some(Input::Bytes(bytes))
    }
}

/// Window size changes of our terminal (SIGWINCH) to `tx`.
async fn forward_resizes(tx: mpsc::Sender<Input>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut winch) = signal(SignalKind::window_change()) else {
        return;
    };
    while winch.recv().await.is_some() {
        if let Some(size) = crate::terminal::size() {
            if tx.send(Input::Resize(size)).await.is_err() {
                return;
            }
        }
    }
}

/// Move bytes between us and process `id` until its output ends, then learn how it ended.
async fn pump(
    client: &mut Client,
    id: &str,
    input: mpsc::Receiver<Input>,
    interrupts: &mut Interrupts,
    on_interrupt: OnInterrupt,
) -> Result<Ended, ClientError> {
    let mut input = Stdin {
        rx: input,
        held: None,
        limit: client.chunk_bytes(),
    };
    let mut stdout = tokio::io::stdout();
    let mut offset: u64 = 0;
    let mut input_open = true;
    let mut interrupted = false;
    let mut failures = 0;
    // `write`s sent: each may be answered by an error, even after the output ended.
    let mut writes: u32 = 0;
    // The write whose fate is not known yet. The executor answers a write only when it refuses
    // it, and answers requests in order: the answer to a `list_processes` sent right after
    // the write (`marker`) says that everything before it was handled, so an error about the
    // process that came before that answer is the write's. One write at a time: a refused
    // (`busy`) write is sent again before anything after it, so stdin arrives whole and in
    // order however slowly the program reads.
    let mut pending: Option<PendingWrite> = None;
    let mut marks: u64 = 0;
    let mut backoff = BUSY_BACKOFF_START;
    client.request_read(id, offset, Some(READ_WAIT)).await?;
    loop {
        let retry_at = pending.as_ref().and_then(|p| p.retry_at);
        tokio::select! {
            item = input.next(), if input_open && pending.is_none() => match item {
                Some(Input::Resize(size)) => client.send(resize_message(id, size)).await?,
                Some(Input::Bytes(data)) => {
                    marks += 1;
                    let write = PendingWrite::new(data, false, marks);
                    write.send(client, id).await?;
                    writes += 1;
                    pending = Some(write);
                }
                Some(Input::Eof) | None => {
                    marks += 1;
                    let write = PendingWrite::new(Vec::new(), true, marks);
                    write.send(client, id).await?;
                    writes += 1;
                    pending = Some(write);
                    input_open = false;
                }
            },
            _ = sleep_until_some(retry_at) => {
                if let Some(write) = pending.as_mut() {
                    write.retry_at = None;
                    write.refused = None;
                    marks += 1;
                    write.marker = format!("stdin{marks}");
                    write.send(client, id).await?;
                    writes += 1;
                }
            }
            caught = interrupts.recv() => {
                if interrupted || caught == Caught::Terminate {
                    return Ok(Ended::Abandoned);
                }
                interrupted = true;
                let message = match on_interrupt {
                    OnInterrupt::Kill => signal_message(id, "KILL", false),
                    OnInterrupt::Forward => signal_message(id, "INT", true),
                };
                client.send(message).await?;
            }
            message = client.recv() => match message? {
                ServerMessage::ProcessOutput(output) if output.id == id => {
                    let output = decode_output(output)?;
                    if output.offset > offset {
                        eprintln!(
                            "agent: {} bytes of output were lost (the executor keeps {} bytes \
                             per process)",
                            output.offset - offset,
                            client.hello().limits.max_process_buffer_bytes
                        );
                    }
                    let fresh = output.after(offset);
                    if !fresh.is_empty() {
                        // A reader that went away (`| head`) is no reason to stop the process
                        // early: its output is dropped, as a closed pipe would.
                        if stdout.write_all(fresh).await.is_ok() {
                            let _ = stdout.flush().await;
                        }
                    }
                    if output.next_offset > offset {
                        offset = output.next_offset;
                        failures = 0;
                    }
                    if output.eof {
                        break;
                    }
                    client.request_read(id, offset, Some(READ_WAIT)).await?;
                }
                ServerMessage::Processes(list) if pending.as_ref().is_some_and(|p| {
                    list.id.as_deref() == Some(p.marker.as_str()) && p.retry_at.is_none()
                }) => {
                    let Some(mut write) = pending.take() else { continue };
                    match write.refused.take() {
                        None => backoff = BUSY_BACKOFF_START,
                        // The program is not reading yet: the same bytes again, later.
                        Some(ErrorCode::Busy) => {
                            tracing::debug!("process {id}: stdin busy, again in {backoff:?}");
                            write.retry_at = Some(tokio::time::Instant::now() + backoff);
                            backoff = (backoff * 2).min(BUSY_BACKOFF_MAX);
                            pending = Some(write);
                        }
                        // Ended, or its stdin closed: nothing more to write.
                        Some(code) => {
                            tracing::debug!("process {id}: stdin refused ({code})");
                            input_open = false;
                        }
                    }
                }
                ServerMessage::Error(err) if err.id.as_deref() == Some(id) => {
                    if let Some(write) = pending.as_mut().filter(|p| p.retry_at.is_none()) {
                        write.refused.get_or_insert(err.code);
                        continue;
                    }
                    // About our `read` (or a resize): read again, as long as it leads anywhere.
                    // A second read of the same range is harmless (only bytes past `offset`
                    // are new).
                    failures += 1;
                    if failures > MAX_FAILURES {
                        return Err(ClientError::Refused { code: err.code, message: err.message });
                    }
                    tracing::debug!("process {id}: {} ({})", err.message, err.code);
                    client.request_read(id, offset, Some(READ_WAIT)).await?;
                }
                _ => {}
            },
        }
    }
    // Errors about writes sent after the program ended may still come (and, by the executor's
    // order of answers, before the answer to `wait`): each is met by asking again.
    let mut budget = MAX_FAILURES + writes;
    loop {
        client.send(wait_message(id, WAIT_STEP)).await?;
        let patience = Duration::from_secs_f64(WAIT_STEP) + WAIT_SLACK;
        let answer = tokio::select! {
            answer = tokio::time::timeout(patience, exited(client, id)) => answer
                .map_err(|_| ClientError::Silent("wait".into()))??,
            _ = interrupts.recv() => return Ok(Ended::Abandoned),
        };
        match answer {
            Ok(exited) if !exited.running => {
                return Ok(if interrupted && on_interrupt == OnInterrupt::Kill {
                    Ended::Abandoned
                } else {
                    Ended::Exited(Box::new(exited))
                });
            }
            Ok(_) => {}
            Err(refused) => {
                budget = budget.saturating_sub(1);
                if budget == 0 {
                    return Err(refused);
                }
            }
        }
    }
}

/// A `write` of stdin and the `list_processes` sent after it, whose answer says the write was
/// handled.
struct PendingWrite {
    data: Vec<u8>,
    eof: bool,
    marker: String,
    /// The error the executor answered the write with, if it did.
    refused: Option<ErrorCode>,
    /// Refused as `busy`: when to send it again.
    retry_at: Option<tokio::time::Instant>,
}

impl PendingWrite {
    fn new(data: Vec<u8>, eof: bool, mark: u64) -> Self {
        Self {
            data,
            eof,
            marker: format!("stdin{mark}"),
            refused: None,
            retry_at: None,
        }
    }

    async fn send(&self, client: &Client, id: &str) -> Result<(), ClientError> {
        client.write(id, &self.data, self.eof).await?;
        client.send(list_processes_message(&self.marker)).await
    }
}

/// Sleep until `at`; never, for `None`.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The next `exited` about `id`, or an error about it (`Ok(Err)`), passing over the rest (output
/// of reads sent twice, `done`).
async fn exited(client: &mut Client, id: &str) -> Result<Result<Exited, ClientError>, ClientError> {
    loop {
        match client.recv().await? {
            ServerMessage::Exited(exited) if exited.id == id => return Ok(Ok(exited)),
            ServerMessage::Error(err) if err.id.as_deref() == Some(id) => {
                return Ok(Err(ClientError::Refused {
                    code: err.code,
                    message: err.message,
                }))
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn queued(inputs: Vec<Input>, limit: usize) -> Vec<String> {
        let (tx, rx) = mpsc::channel(16);
        for input in inputs {
            tx.send(input).await.unwrap();
        }
        drop(tx);
        let mut stdin = Stdin {
            rx,
            held: None,
            limit,
        };
        let mut seen = Vec::new();
        while let Some(input) = stdin.next().await {
            seen.push(match input {
                Input::Bytes(b) => String::from_utf8(b).unwrap(),
                Input::Eof => "EOF".into(),
                Input::Resize(s) => format!("{}x{}", s.rows, s.cols),
            });
        }
        seen
    }

    fn bytes(text: &str) -> Input {
        Input::Bytes(text.as_bytes().to_vec())
    }

    #[tokio::test]
    async fn reads_that_queued_up_are_joined_up_to_the_limit_in_order() {
        let inputs = || vec![bytes("abc"), bytes("def"), bytes("gh"), Input::Eof];
        assert_eq!(queued(inputs(), 100).await, ["abcdefgh", "EOF"]);
        assert_eq!(queued(inputs(), 6).await, ["abcdef", "gh", "EOF"]);
        assert_eq!(queued(inputs(), 5).await, ["abc", "defgh", "EOF"]);
    }

    #[tokio::test]
    async fn a_resize_is_never_joined_past() {
        let resize = Input::Resize(PtySize { rows: 2, cols: 3 });
        assert_eq!(
            queued(vec![bytes("a"), resize, bytes("b")], 100).await,
            ["a", "2x3", "b"]
        );
    }
}
