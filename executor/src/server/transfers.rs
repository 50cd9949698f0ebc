//! Protocol 1.1's file operations on a connection: `upload`, `download`, `stat` and
//! `list_dir`, each a payload doing the operation in place of a command (`files`), admitted
//! and run as `exec` is; the process requests are in `attached`.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use protocol::{
    DirListing, DownloadData, DownloadRequest, Downloaded, ErrorCode, ErrorMessage, ExecRequest,
    ExecResult, Exited, FileInfo, ServerMessage, UploadRequest, Uploaded,
};
use tokio_util::sync::CancellationToken;

use super::attached::{b64, bad, make_stdio, register};
use super::connection::{Connection, Job};
use super::processes::{Kind, Process};
use super::session::Session;
use crate::engine::ExecError;
use crate::request::ValidRequest;
use crate::runner::attached::{Attached, OutputRing};
use crate::runner::Io;
use sandbox::files::{FileOp, Header, MAX_HEADER_BYTES};
use sandbox::plan::StdinKind;

/// Raw bytes in one `download_data` message.
const DOWNLOAD_CHUNK: usize = 64 * 1024;
/// A download's bounded queue: the most of a file the daemon holds at once.
const DOWNLOAD_QUEUE: usize = 256 * 1024;
/// Longest accepted path, as Linux's PATH_MAX.
const MAX_PATH_BYTES: usize = 4096;

fn check_path(path: &str) -> Result<(), ExecError> {
    if path.is_empty() || path.len() > MAX_PATH_BYTES || path.contains('\0') {
        return Err(bad(format!(
            "path must be 1 to {MAX_PATH_BYTES} bytes without NUL"
        )));
    }
    Ok(())
}

impl Connection {
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
            network: None,
        };
        let (mut valid, job, held) = self.admit_job(exec, draining).await?;
        // The daemon's own helper runs a file operation, no command of the client's: it runs
        // under the profile as it is (as before network policies), never refused for a client
        // policy it has no use for, nor given a network namespace it does not need.
        valid.client_network = sandbox::network::Mode::Host;
        Some((valid, job, held))
    }

    pub(super) async fn upload(
        &mut self,
        req: UploadRequest,
        draining: bool,
    ) -> Result<(), ExecError> {
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
        let record = self.record_of(&label);
        let (process, attached) = register(
            &self.session,
            &valid.id,
            label,
            Kind::Upload,
            ring,
            stdio,
            record,
        );
        let task = self.session.tasks.track_future(async move {
            job.run_file_op(valid, attached, process, Answer::Upload)
                .await;
            drop(held);
        });
        self.daemon.tasks.spawn(task);
        Ok(())
    }

    pub(super) async fn download(
        &mut self,
        req: DownloadRequest,
        draining: bool,
    ) -> Result<(), ExecError> {
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

    pub(super) async fn file_op(
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
        let ring = OutputRing::kept_for(queue, false, Some(&self.memory_owner()));
        let record = self.record_of(&label);
        let (process, attached) = register(
            &self.session,
            &valid.id,
            label,
            Kind::Query,
            ring,
            stdio,
            record,
        );
        let task = self.session.tasks.track_future(async move {
            job.run_file_op(valid, attached, process, answer).await;
            drop(held);
        });
        self.daemon.tasks.spawn(task);
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
                Answer::Download => {
                    let on = (self.connection, &self.cancel);
                    forward_download(&self.session, on, &id, &ring, &failed).await
                }
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
        if matches!(answer, Answer::Upload) {
            self.session.processes.forget_old_ended(Kind::Upload);
        } else {
            self.session.processes.remove(&id, &process);
        }
        let reply = match (process.failure(), &result, header) {
            // Abandoned by the daemon (a `write` it could not take): that is the answer, not
            // the "cut off" the payload saw.
            (Some(err), _, _) => Err(err),
            (None, Err(err), _) => Err(err.clone()),
            (None, Ok(_), Err(err)) => Err(err),
            (None, Ok(result), Ok((header, sent))) => {
                answer_from(&id, answer, header, sent, result)
            }
        };
        // Its chunks went to a connection that is gone since: some may never have arrived.
        let reply = match reply {
            Ok(ServerMessage::Downloaded(done))
                if self.session.connection_gone(self.connection).is_cancelled() =>
            {
                Err(connection_dropped(done.bytes))
            }
            other => other,
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
            use sandbox::files::ErrorKind;
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

/// A download's answer once the connection it started on is gone.
fn connection_dropped(sent: u64) -> ExecError {
    ExecError::new(
        ErrorCode::EnvironmentError,
        format!(
            "the connection dropped during the download after {sent} bytes; \
             download the rest with offset"
        ),
    )
}

/// Send a download's bytes as they come, in `download_data` chunks, to the connection it
/// started on; the connection's pace sets the payload's (the ring is a bounded queue). Once
/// that connection is gone (dropped, or the session resumed on another) the download fails at
/// once: no chunk goes to another connection, and the client downloads the rest from its
/// offset, and the payload is stopped (`stop`: it would wait for a reader that is gone).
async fn forward_download(
    session: &Session,
    (connection, stop): (u64, &CancellationToken),
    id: &str,
    ring: &OutputRing,
    failed: &CancellationToken,
) -> Result<(Header, u64), ExecError> {
    let gone = session.connection_gone(connection);
    let dropped = |sent: u64| {
        stop.cancel();
        ring.discarded.cancel();
        Err(connection_dropped(sent))
    };
    let (header, mut offset) = tokio::select! {
        header = read_header(ring, failed) => header?,
        () = gone.cancelled() => return dropped(0),
    };
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
            () = gone.cancelled() => return dropped(sent),
        }
        let slice = ring.read(offset, DOWNLOAD_CHUNK);
        offset = slice.next_offset;
        if !slice.data.is_empty() {
            let chunk = ServerMessage::DownloadData(DownloadData {
                id: id.to_string(),
                seq,
                data: b64().encode(&slice.data),
            });
            if !session.send_on(connection, chunk).await {
                return dropped(sent);
            }
            sent += slice.data.len() as u64;
            seq += 1;
        }
        if slice.eof {
            return Ok((header, sent));
        }
    }
}
