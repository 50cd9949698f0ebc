//! Protocol 1.1 in the tests: bytes as base64, and file transfers (upload, download) driven to
//! their answer.

use protocol::{ClientMessage, ServerMessage};

use crate::Client;

/// Base64 (standard alphabet, padded), as protocol 1.1 carries bytes.
pub fn b64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The bytes of a base64 `data` field; invalid base64 from the daemon fails the test.
pub fn unb64(text: &str) -> Vec<u8> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(text.as_bytes())
        .unwrap_or_else(|e| panic!("the daemon sent invalid base64 ({e}): {text:.80}"))
}

/// Raw bytes per `write` of an upload: well under the default 1 MiB message limit once
/// base64 and JSON are added.
pub const UPLOAD_CHUNK: usize = 256 * 1024;

/// The id a protocol 1.1 reply (or error) names, if any.
pub fn reply_id(msg: &ServerMessage) -> Option<&str> {
    Some(match msg {
        ServerMessage::Error(e) => e.id.as_deref()?,
        ServerMessage::Spawned(m) => &m.id,
        ServerMessage::ProcessOutput(m) => &m.id,
        ServerMessage::Exited(m) => &m.id,
        ServerMessage::Processes(m) => m.id.as_deref()?,
        ServerMessage::Done(m) => &m.id,
        ServerMessage::Uploaded(m) => &m.id,
        ServerMessage::DownloadData(m) => &m.id,
        ServerMessage::Downloaded(m) => &m.id,
        ServerMessage::FileInfo(m) => &m.id,
        ServerMessage::DirListing(m) => &m.id,
        ServerMessage::Output(m) => &m.id,
        ServerMessage::Result(m) => &m.id,
        ServerMessage::Hello(_) | ServerMessage::Resumed(_) => return None,
    })
}

/// A whole download: its bytes (chunks joined in `seq` order) and its final message.
#[derive(Debug)]
pub struct Download {
    pub data: Vec<u8>,
    pub done: protocol::Downloaded,
    pub chunks: u64,
}

impl Client {
    /// The next message naming `id` (messages for other ids are skipped: each test drives one
    /// request at a time per id). Fails the test if the connection closes first.
    pub async fn reply_for(&mut self, id: &str) -> ServerMessage {
        loop {
            match self.recv().await {
                Some(msg) if reply_id(&msg) == Some(id) => return msg,
                Some(_) => continue,
                None => panic!("connection closed before a reply for {id}"),
            }
        }
    }

    /// Upload `content` with `req` (in [`UPLOAD_CHUNK`] writes, the last with `eof`) and return
    /// the `uploaded` answer or the error.
    pub async fn upload(
        &mut self,
        req: protocol::UploadRequest,
        content: &[u8],
    ) -> Result<protocol::Uploaded, protocol::ErrorMessage> {
        let id = req.id.clone();
        self.send(&ClientMessage::Upload(req)).await;
        let mut chunks = content.chunks(UPLOAD_CHUNK).peekable();
        if chunks.peek().is_none() {
            self.write_chunk(&id, &[], true).await;
        }
        while let Some(chunk) = chunks.next() {
            self.write_chunk(&id, chunk, chunks.peek().is_none()).await;
        }
        match self.reply_for(&id).await {
            ServerMessage::Uploaded(done) => Ok(done),
            ServerMessage::Error(e) => Err(e),
            other => panic!("{id}: expected uploaded, got {other:?}"),
        }
    }

    /// One `write` of `bytes` (base64) to `id`.
    pub async fn write_chunk(&mut self, id: &str, bytes: &[u8], eof: bool) {
        self.send(&ClientMessage::Write(protocol::WriteRequest {
            id: id.to_string(),
            data: (!bytes.is_empty()).then(|| b64(bytes)),
            text: None,
            eof,
        }))
        .await;
    }

    /// Run `req` to its end: every `download_data` chunk in order (checked by `seq`), then
    /// `downloaded`, whose byte count must match; or the error.
    pub async fn download(
        &mut self,
        req: protocol::DownloadRequest,
    ) -> Result<Download, protocol::ErrorMessage> {
        let id = req.id.clone();
        self.send(&ClientMessage::Download(req)).await;
        let mut data = Vec::new();
        let mut seq = 0;
        loop {
            match self.reply_for(&id).await {
                ServerMessage::DownloadData(chunk) => {
                    assert_eq!(chunk.seq, seq, "{id}: chunks out of order");
                    seq += 1;
                    data.extend_from_slice(&unb64(&chunk.data));
                }
                ServerMessage::Downloaded(done) => {
                    assert_eq!(done.bytes, data.len() as u64, "{id}: byte count");
                    return Ok(Download {
                        data,
                        done,
                        chunks: seq,
                    });
                }
                ServerMessage::Error(e) => return Err(e),
                other => panic!("{id}: expected download_data, got {other:?}"),
            }
        }
    }
}

/// An upload request of `path` with defaults (mode 0644, no parents, no tar, default profile).
pub fn upload_req(id: &str, path: &str) -> protocol::UploadRequest {
    protocol::UploadRequest {
        id: id.to_string(),
        path: path.to_string(),
        mode: None,
        parents: false,
        tar: false,
        profile: None,
    }
}

/// A download request of the whole of `path` with defaults.
pub fn download_req(id: &str, path: &str) -> protocol::DownloadRequest {
    protocol::DownloadRequest {
        id: id.to_string(),
        path: path.to_string(),
        offset: 0,
        length: None,
        tar: false,
        profile: None,
    }
}

/// Names in `dir` (on the host) of temporary upload files (`.<name>.upload-<hex>`) left behind.
pub fn upload_leftovers(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with('.') && n.contains(".upload-"))
                .collect()
        })
        .unwrap_or_default()
}
