//! Protocol 1.1 over one connection: processes (`spawn`, `write`, `read`, `signal`, `resize`,
//! `wait`, `list_processes`) and files (`upload`, `download`, `stat`, `list_dir`).
//!
//! Unlike [`super::Environment`] this client neither reconnects nor resumes: its users (`agent
//! cp`, `agent exec --stdin`, `agent shell`) are one-shot commands a person can run again. The
//! socket is split so that sending never waits for reading: a writer task owns the sending half
//! and takes messages from a bounded queue, so a long upload still notices an early error and
//! a process's output is read while its stdin is written.

use std::time::Duration;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use futures_util::stream::SplitStream;
use futures_util::{FutureExt, SinkExt, StreamExt};
use protocol::{
    ClientMessage, DirListing, DownloadRequest, Downloaded, ErrorCode, ErrorMessage, Exited,
    FileStat, Hello, ListDirRequest, ListProcessesRequest, ProcessInfo, PtySize, ReadRequest,
    ResizeRequest, ServerMessage, SignalRequest, SpawnRequest, Spawned, StatRequest, UploadRequest,
    Uploaded, WaitRequest, WriteRequest,
};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

use super::chunks::{chunk_bytes, Chunker};
use super::connection::{connect, Ws};
use crate::tls::Tls;

/// Messages queued for the writer task; a full queue makes senders wait (backpressure from the
/// socket reaches the code producing the messages).
const OUTGOING_QUEUE: usize = 4;
/// Extra time past a request's own wait for its answer before the executor counts as
/// unresponsive.
const ANSWER_SLACK: Duration = Duration::from_secs(30);
/// Longest silence between the pieces of a download, and before `uploaded` after the last
/// byte (the executor renames the file into place, or finishes unpacking, first).
const TRANSFER_PATIENCE: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The executor answered with `error`.
    #[error("{message} ({code})")]
    Refused { code: ErrorCode, message: String },
    #[error(
        "the executor at {url} does not support {what} (it lacks the protocol 1.1 capability \
         {capability:?}; it offers {offered}): upgrade the executor"
    )]
    Unsupported {
        url: String,
        capability: String,
        what: String,
        offered: String,
    },
    #[error("cannot connect to the executor at {url}: {reason}")]
    Connect { url: String, reason: String },
    #[error("the connection to the executor failed: {0}")]
    Lost(String),
    #[error("the executor sent no answer in time ({0})")]
    Silent(String),
    #[error("the executor broke the protocol: {0}")]
    Protocol(String),
    #[error("cannot {action} {what}: {source}")]
    Local {
        action: &'static str,
        what: String,
        source: std::io::Error,
    },
}

impl ClientError {
    fn refused(err: ErrorMessage) -> Self {
        Self::Refused {
            code: err.code,
            message: err.message,
        }
    }

    /// The daemon's error code, when it refused.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Self::Refused { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// Bytes of a process's output, decoded (`process_output`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputBytes {
    pub offset: u64,
    pub data: Vec<u8>,
    pub next_offset: u64,
    pub dropped: u64,
    pub eof: bool,
}

impl OutputBytes {
    /// The bytes from `from` on: replies to two reads of the same range (after an error whose
    /// request we could not tell) overlap, and only what we have not seen is new.
    pub fn after(&self, from: u64) -> &[u8] {
        let skip = from.saturating_sub(self.offset);
        let skip = usize::try_from(skip)
            .unwrap_or(usize::MAX)
            .min(self.data.len());
        &self.data[skip..]
    }
}

pub struct Client {
    url: String,
    hello: Hello,
    outgoing: mpsc::Sender<Message>,
    incoming: SplitStream<Ws>,
    writer: tokio::task::JoinHandle<()>,
    next_id: u64,
}

impl Client {
    /// Connect and read the hello.
    pub async fn connect(url: &str, token: Option<&str>, tls: &Tls) -> Result<Self, ClientError> {
        let (ws, hello) = connect(url, token, tls)
            .await
            .map_err(|e| ClientError::Connect {
                url: url.to_string(),
                reason: e.to_string(),
            })?;
        if hello.protocol != protocol::PROTOCOL_VERSION {
            return Err(ClientError::Connect {
                url: url.to_string(),
                reason: format!(
                    "it speaks protocol {}, this agent speaks {}",
                    hello.protocol,
                    protocol::PROTOCOL_VERSION
                ),
            });
        }
        Ok(Self::over(url, ws, hello))
    }

    /// A client on an open connection whose hello was read.
    pub fn over(url: &str, ws: Ws, hello: Hello) -> Self {
        let (mut sink, incoming) = ws.split();
        let (outgoing, mut queue) = mpsc::channel::<Message>(OUTGOING_QUEUE);
        let writer = tokio::spawn(async move {
            while let Some(message) = queue.recv().await {
                if sink.send(message).await.is_err() {
                    return;
                }
            }
            // Every sender is gone: a close frame ends the session, and the executor kills
            // what it still runs for us at once (a dropped socket would leave it running for
            // the resume grace period).
            let _ = sink.close().await;
        });
        Self {
            url: url.to_string(),
            hello,
            outgoing,
            incoming,
            writer,
            next_id: 0,
        }
    }

    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    /// Fail clearly against an executor without `capability` (one that predates protocol 1.1
    /// answers these requests with `bad_request`, which says nothing useful).
    pub fn require(&self, capability: &str, what: &str) -> Result<(), ClientError> {
        if self.hello.capabilities.iter().any(|c| c == capability) {
            return Ok(());
        }
        Err(ClientError::Unsupported {
            url: self.url.clone(),
            capability: capability.to_string(),
            what: what.to_string(),
            offered: if self.hello.capabilities.is_empty() {
                "none".into()
            } else {
                self.hello.capabilities.join(", ")
            },
        })
    }

    /// A fresh request id.
    pub fn new_id(&mut self, prefix: &str) -> String {
        self.next_id += 1;
        format!("{prefix}{}", self.next_id)
    }

    /// The largest piece of a file or stdin one `write` may carry.
    pub fn chunk_bytes(&self) -> usize {
        chunk_bytes(self.hello.limits.max_message_bytes)
    }

    /// Queue a message for the executor.
    pub async fn send(&self, message: ClientMessage) -> Result<(), ClientError> {
        let text = serde_json::to_string(&message)
            .map_err(|e| ClientError::Protocol(format!("cannot encode a request: {e}")))?;
        self.outgoing
            .send(Message::text(text))
            .await
            .map_err(|_| ClientError::Lost("the connection is closed".into()))
    }

    /// The next message from the executor. Cancel-safe: a message is either returned or left
    /// in the socket.
    pub async fn recv(&mut self) -> Result<ServerMessage, ClientError> {
        loop {
            let frame = self.incoming.next().await;
            if let Some(message) = Self::parse(frame)? {
                return Ok(message);
            }
        }
    }

    /// A message that has already arrived, without waiting.
    fn recv_ready(&mut self) -> Result<Option<ServerMessage>, ClientError> {
        while let Some(frame) = self.incoming.next().now_or_never() {
            if let Some(message) = Self::parse(frame)? {
                return Ok(Some(message));
            }
        }
        Ok(None)
    }

    fn parse(
        frame: Option<Result<Message, tokio_tungstenite::tungstenite::Error>>,
    ) -> Result<Option<ServerMessage>, ClientError> {
        let text = match frame {
            Some(Ok(Message::Text(text))) => text,
            Some(Ok(Message::Close(frame))) => {
                return Err(ClientError::Lost(format!(
                    "the executor closed the connection{}",
                    frame.map(|f| format!(": {}", f.reason)).unwrap_or_default()
                )))
            }
            None => {
                return Err(ClientError::Lost(
                    "the executor closed the connection".into(),
                ))
            }
            Some(Err(e)) => return Err(ClientError::Lost(e.to_string())),
            Some(Ok(_)) => return Ok(None),
        };
        serde_json::from_str(text.as_str())
            .map(Some)
            .map_err(|e| ClientError::Protocol(format!("unreadable message ({e})")))
    }

    /// Wait for the answer to request `id` that `pick` accepts, or its error. Messages about
    /// other requests are passed over (this client asks one thing at a time).
    async fn answer<T>(
        &mut self,
        id: &str,
        patience: Duration,
        what: &str,
        mut pick: impl FnMut(ServerMessage) -> Option<T>,
    ) -> Result<T, ClientError> {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            let message = tokio::time::timeout_at(deadline, self.recv())
                .await
                .map_err(|_| ClientError::Silent(what.to_string()))??;
            match message {
                // An error without an id answers a request the executor could not read.
                ServerMessage::Error(err) if err.id.as_deref().is_none_or(|i| i == id) => {
                    return Err(ClientError::refused(err))
                }
                other => {
                    if let Some(answer) = pick(other) {
                        return Ok(answer);
                    }
                }
            }
        }
    }

    // Processes.

    pub async fn spawn(&mut self, request: SpawnRequest) -> Result<Spawned, ClientError> {
        let id = request.id.clone();
        self.send(ClientMessage::Spawn(request)).await?;
        self.answer(&id, ANSWER_SLACK, "spawn", |m| match m {
            ServerMessage::Spawned(s) if s.id == id => Some(s),
            _ => None,
        })
        .await
    }

    /// Bytes for process `id`'s stdin; `eof` closes it after them. The executor answers only
    /// a failure (`error` with the id).
    pub async fn write(&self, id: &str, data: &[u8], eof: bool) -> Result<(), ClientError> {
        self.send(write_message(id, data, eof)).await
    }

    /// Ask for output from `offset` on; the answer is a `process_output` message (see
    /// [`Client::read`] for the whole exchange).
    pub async fn request_read(
        &self,
        id: &str,
        offset: u64,
        wait: Option<f64>,
    ) -> Result<(), ClientError> {
        self.send(ClientMessage::Read(ReadRequest {
            id: id.to_string(),
            offset,
            max_bytes: None,
            wait,
        }))
        .await
    }

    // Files.

    pub async fn stat(
        &mut self,
        path: &str,
        profile: Option<String>,
    ) -> Result<FileStat, ClientError> {
        let id = self.new_id("stat");
        self.send(ClientMessage::Stat(StatRequest {
            id: id.clone(),
            path: path.to_string(),
            profile,
        }))
        .await?;
        self.answer(&id, ANSWER_SLACK, "stat", |m| match m {
            ServerMessage::FileInfo(f) if f.id == id => Some(f.stat),
            _ => None,
        })
        .await
    }

    /// Upload `source` (named `what` in errors) as `request` says, a chunk at a time: never
    /// more than one chunk is in memory here. `progress` gets the bytes sent so far.
    pub async fn upload(
        &mut self,
        request: UploadRequest,
        source: impl AsyncRead + Unpin,
        what: &str,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Uploaded, ClientError> {
        let id = request.id.clone();
        let limit = self.hello.limits.max_upload_bytes;
        self.send(ClientMessage::Upload(request)).await?;
        let mut chunks = Chunker::new(source, self.chunk_bytes());
        let mut sent: u64 = 0;
        loop {
            let (data, eof) = chunks.next().await.map_err(|source| ClientError::Local {
                action: "read",
                what: what.to_string(),
                source,
            })?;
            sent += data.len() as u64;
            if limit > 0 && sent > limit {
                return Err(ClientError::Refused {
                    code: ErrorCode::BadRequest,
                    message: format!("{what} is larger than the executor accepts ({limit} bytes)"),
                });
            }
            // The executor refuses at once what it cannot write (a denied or missing path):
            // stop there rather than send the rest of the file for nothing.
            while let Some(message) = self.recv_ready()? {
                match message {
                    ServerMessage::Error(err) if err.id.as_deref().is_none_or(|i| i == id) => {
                        return Err(ClientError::refused(err))
                    }
                    ServerMessage::Uploaded(u) if u.id == id => {
                        return Err(ClientError::Protocol(format!(
                            "upload {id} was reported complete before its end"
                        )))
                    }
                    _ => {}
                }
            }
            self.send(write_message(&id, &data, eof)).await?;
            progress(sent);
            if eof {
                break;
            }
        }
        let uploaded = self
            .answer(&id, TRANSFER_PATIENCE, "upload", |m| match m {
                ServerMessage::Uploaded(u) if u.id == id => Some(u),
                _ => None,
            })
            .await?;
        if uploaded.bytes != sent {
            return Err(ClientError::Protocol(format!(
                "the executor received {} bytes of {what}, {sent} were sent",
                uploaded.bytes
            )));
        }
        Ok(uploaded)
    }

    /// Download as `request` says into `sink` (named `what` in errors), a piece at a time.
    /// `progress` gets the bytes received so far.
    pub async fn download(
        &mut self,
        request: DownloadRequest,
        mut sink: impl AsyncWrite + Unpin,
        what: &str,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Downloaded, ClientError> {
        let id = request.id.clone();
        self.send(ClientMessage::Download(request)).await?;
        let mut seq = 0;
        let mut received: u64 = 0;
        loop {
            let message = tokio::time::timeout(TRANSFER_PATIENCE, self.recv())
                .await
                .map_err(|_| ClientError::Silent("download".into()))??;
            match message {
                ServerMessage::DownloadData(piece) if piece.id == id => {
                    if piece.seq != seq {
                        return Err(ClientError::Protocol(format!(
                            "download piece {} came where {seq} was due",
                            piece.seq
                        )));
                    }
                    seq += 1;
                    let data = decode(&piece.data)?;
                    sink.write_all(&data)
                        .await
                        .map_err(|source| ClientError::Local {
                            action: "write",
                            what: what.to_string(),
                            source,
                        })?;
                    received += data.len() as u64;
                    progress(received);
                }
                ServerMessage::Downloaded(done) if done.id == id => {
                    if done.bytes != received {
                        return Err(ClientError::Protocol(format!(
                            "the executor sent {} bytes, {received} arrived",
                            done.bytes
                        )));
                    }
                    sink.flush().await.map_err(|source| ClientError::Local {
                        action: "write",
                        what: what.to_string(),
                        source,
                    })?;
                    return Ok(done);
                }
                ServerMessage::Error(err) if err.id.as_deref().is_none_or(|i| i == id) => {
                    return Err(ClientError::refused(err))
                }
                _ => {}
            }
        }
    }

    /// End the session with a close frame (the executor kills what still runs for us).
    pub async fn close(self) {
        let Self {
            outgoing, writer, ..
        } = self;
        drop(outgoing);
        let _ = tokio::time::timeout(Duration::from_secs(2), writer).await;
    }
}

/// The rest of protocol 1.1 as typed calls. No command of the agent needs them yet (its loops
/// send `read`, `resize` and `signal` without waiting for each answer); the unit tests drive
/// them against a scripted executor.
#[allow(dead_code)]
impl Client {
    /// How process `id` ended, waiting up to `timeout` seconds (`running` when it had not).
    pub async fn wait(&mut self, id: &str, timeout: Option<f64>) -> Result<Exited, ClientError> {
        self.send(ClientMessage::Wait(WaitRequest {
            id: id.to_string(),
            timeout,
        }))
        .await?;
        let patience = Duration::from_secs_f64(timeout.unwrap_or(0.0).max(0.0)) + ANSWER_SLACK;
        self.answer(id, patience, "wait", |m| match m {
            ServerMessage::Exited(e) if e.id == id => Some(e),
            _ => None,
        })
        .await
    }

    /// Output of process `id` from `offset` on, waiting up to `wait` seconds for some.
    pub async fn read(
        &mut self,
        id: &str,
        offset: u64,
        wait: Option<f64>,
    ) -> Result<OutputBytes, ClientError> {
        self.request_read(id, offset, wait).await?;
        let patience = Duration::from_secs_f64(wait.unwrap_or(0.0).max(0.0)) + ANSWER_SLACK;
        let output = self
            .answer(id, patience, "read", |m| match m {
                ServerMessage::ProcessOutput(o) if o.id == id => Some(o),
                _ => None,
            })
            .await?;
        decode_output(output)
    }

    pub async fn signal(
        &mut self,
        id: &str,
        signal: &str,
        foreground: bool,
    ) -> Result<(), ClientError> {
        self.send(ClientMessage::Signal(SignalRequest {
            id: id.to_string(),
            signal: signal.to_string(),
            foreground,
        }))
        .await?;
        self.answer(id, ANSWER_SLACK, "signal", |m| match m {
            ServerMessage::Done(d) if d.id == id => Some(()),
            _ => None,
        })
        .await
    }

    pub async fn resize(&mut self, id: &str, size: PtySize) -> Result<(), ClientError> {
        self.send(resize_message(id, size)).await?;
        self.answer(id, ANSWER_SLACK, "resize", |m| match m {
            ServerMessage::Done(d) if d.id == id => Some(()),
            _ => None,
        })
        .await
    }

    pub async fn list_processes(&mut self) -> Result<Vec<ProcessInfo>, ClientError> {
        let id = self.new_id("list");
        self.send(ClientMessage::ListProcesses(ListProcessesRequest {
            id: Some(id.clone()),
        }))
        .await?;
        self.answer(&id, ANSWER_SLACK, "list_processes", |m| match m {
            ServerMessage::Processes(p) if p.id.as_deref() == Some(id.as_str()) => {
                Some(p.processes)
            }
            _ => None,
        })
        .await
    }

    pub async fn list_dir(
        &mut self,
        path: &str,
        profile: Option<String>,
    ) -> Result<DirListing, ClientError> {
        let id = self.new_id("ls");
        self.send(ClientMessage::ListDir(ListDirRequest {
            id: id.clone(),
            path: path.to_string(),
            profile,
        }))
        .await?;
        self.answer(&id, ANSWER_SLACK, "list_dir", |m| match m {
            ServerMessage::DirListing(d) if d.id == id => Some(d),
            _ => None,
        })
        .await
    }
}

pub fn write_message(id: &str, data: &[u8], eof: bool) -> ClientMessage {
    ClientMessage::Write(WriteRequest {
        id: id.to_string(),
        data: Some(BASE64.encode(data)),
        text: None,
        eof,
    })
}

pub fn resize_message(id: &str, size: PtySize) -> ClientMessage {
    ClientMessage::Resize(ResizeRequest {
        id: id.to_string(),
        rows: size.rows,
        cols: size.cols,
    })
}

/// `list_processes` with `id` echoed: its answer marks that every request before it was
/// handled (the executor answers in order).
pub fn list_processes_message(id: &str) -> ClientMessage {
    ClientMessage::ListProcesses(ListProcessesRequest {
        id: Some(id.to_string()),
    })
}

pub fn wait_message(id: &str, timeout: f64) -> ClientMessage {
    ClientMessage::Wait(WaitRequest {
        id: id.to_string(),
        timeout: Some(timeout),
    })
}

pub fn signal_message(id: &str, signal: &str, foreground: bool) -> ClientMessage {
    ClientMessage::Signal(SignalRequest {
        id: id.to_string(),
        signal: signal.to_string(),
        foreground,
    })
}

fn decode(data: &str) -> Result<Vec<u8>, ClientError> {
    BASE64
        .decode(data)
        .map_err(|e| ClientError::Protocol(format!("bytes that are not base64 ({e})")))
}

pub fn decode_output(output: protocol::ProcessOutput) -> Result<OutputBytes, ClientError> {
    Ok(OutputBytes {
        offset: output.offset,
        data: decode(&output.data)?,
        next_offset: output.next_offset,
        dropped: output.dropped,
        eof: output.eof,
    })
}
