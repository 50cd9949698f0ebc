//! Directories as tar streams for `agent cp`, built and unpacked on a blocking thread while
//! the async side moves the bytes: at most a few chunks are in memory, whatever the size.

use std::io::Write;
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};

use protocol::{DownloadRequest, Downloaded, UploadRequest, Uploaded};
use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::mpsc;

use crate::executor_client::{Client, ClientError};

/// Chunks between the thread building an archive and the upload.
const CHUNKS_IN_FLIGHT: usize = 2;

/// Upload the directory `dir` into the remote directory `request.path` (which `request.tar`
/// must say is a tar stream). Symbolic links are sent as links, never followed.
pub async fn upload_dir(
    client: &mut Client,
    request: UploadRequest,
    dir: &Path,
    progress: &mut dyn FnMut(u64),
) -> Result<Uploaded, ClientError> {
    let (tx, rx) = mpsc::channel(CHUNKS_IN_FLIGHT);
    let mut writer = ChannelWriter {
        tx,
        buffer: Vec::new(),
        size: client.chunk_bytes(),
    };
    let source = dir.to_path_buf();
    let builder = tokio::task::spawn_blocking(move || {
        let mut archive = tar::Builder::new(&mut writer);
        archive.follow_symlinks(false);
        // Entries relative to the directory ("a", "sub/b"), without an entry for itself.
        let built = archive
            .append_dir_all("", &source)
            .and_then(|()| archive.finish());
        drop(archive);
        match built {
            Ok(()) => writer.finish(),
            Err(e) => {
                let e = std::io::Error::new(e.kind(), format!("{}: {e}", source.display()));
                writer.fail(e);
            }
        }
    });
    let reader = ChannelReader {
        rx,
        current: Vec::new(),
        position: 0,
    };
    let what = dir.display().to_string();
    let uploaded = client.upload(request, reader, &what, progress).await;
    // The builder stops at its next chunk once the reader is gone.
    let _ = builder.await;
    uploaded
}

/// Download the remote directory `request.path` as a tar stream and unpack it into `target`,
/// which is created if missing (and removed again if the copy fails). Entries that would land
/// outside `target` (`..`, absolute paths, through links) are refused by the tar crate.
pub async fn download_dir(
    client: &mut Client,
    request: DownloadRequest,
    target: &Path,
    progress: &mut dyn FnMut(u64),
) -> Result<Downloaded, ClientError> {
    let local = |action, source| ClientError::Local {
        action,
        what: target.display().to_string(),
        source,
    };
    let mut created = match std::fs::symlink_metadata(target) {
        Ok(meta) if meta.is_dir() => Created(None),
        Ok(_) => {
            return Err(local(
                "unpack a directory over the file",
                std::io::Error::from(std::io::ErrorKind::AlreadyExists),
            ))
        }
        Err(_) => {
            std::fs::create_dir(target).map_err(|e| local("create", e))?;
            Created(Some(target.to_path_buf()))
        }
    };
    let (sink, source) = tokio::io::duplex(client.chunk_bytes());
    let bridge = tokio_util::io::SyncIoBridge::new(source);
    let into = target.to_path_buf();
    let unpacker = tokio::task::spawn_blocking(move || {
        let mut archive = tar::Archive::new(bridge);
        archive.set_preserve_permissions(false);
        archive.set_overwrite(true);
        archive.unpack(&into)
    });
    let downloaded = client
        .download(request, sink, &target.display().to_string(), progress)
        .await;
    // `download` dropped its end: the unpacker reads to the end and stops.
    let unpacked = unpacker
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))
        .and_then(|r| r);
    let result = match (downloaded, unpacked) {
        (Ok(done), Ok(())) => Ok(done),
        // The unpacker's error explains a refused write on our side better than the pipe.
        (Err(ClientError::Local { .. }), Err(e)) | (Ok(_), Err(e)) => Err(local("unpack into", e)),
        (Err(e), _) => Err(e),
    };
    if result.is_ok() {
        created.keep();
    }
    result
}

/// A directory made for a download, removed again unless the download completes (also when
/// the download is dropped half way, as Ctrl-C does).
struct Created(Option<std::path::PathBuf>);

impl Created {
    fn keep(&mut self) {
        self.0 = None;
    }
}

impl Drop for Created {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The writing end of a tar stream on a blocking thread: full chunks into a channel.
struct ChannelWriter {
    tx: mpsc::Sender<std::io::Result<Vec<u8>>>,
    buffer: Vec<u8>,
    size: usize,
}

impl ChannelWriter {
    fn send_buffer(&mut self) -> std::io::Result<()> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::take(&mut self.buffer);
        self.tx.blocking_send(Ok(chunk)).map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the upload has stopped")
        })
    }

    /// The stream is complete: an empty chunk says so (a closed channel alone could also mean
    /// the builder died, and a truncated archive must not pass for a whole one).
    fn finish(mut self) {
        if self.send_buffer().is_ok() {
            let _ = self.tx.blocking_send(Ok(Vec::new()));
        }
    }

    fn fail(self, error: std::io::Error) {
        let _ = self.tx.blocking_send(Err(error));
    }
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let room = self.size.max(1) - self.buffer.len();
        let n = data.len().min(room);
        self.buffer.extend_from_slice(&data[..n]);
        if self.buffer.len() >= self.size {
            self.send_buffer()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The reading end: the chunks as an [`AsyncRead`] that ends only at the end marker.
struct ChannelReader {
    rx: mpsc::Receiver<std::io::Result<Vec<u8>>>,
    current: Vec<u8>,
    position: usize,
}

impl AsyncRead for ChannelReader {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        loop {
            if self.position < self.current.len() {
                let n = buf.remaining().min(self.current.len() - self.position);
                let start = self.position;
                buf.put_slice(&self.current[start..start + n]);
                self.position += n;
                return Poll::Ready(Ok(()));
            }
            match self.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(chunk))) if chunk.is_empty() => {
                    return Poll::Ready(Ok(()));
                }
                Poll::Ready(Some(Ok(chunk))) => {
                    self.current = chunk;
                    self.position = 0;
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
                Poll::Ready(None) => {
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the archive stopped before its end",
                    )))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt;

    use super::*;

    #[tokio::test]
    async fn a_directory_goes_through_the_channel_as_a_tar_stream_that_unpacks_the_same() {
        let from = tempfile::tempdir().unwrap();
        std::fs::create_dir(from.path().join("sub")).unwrap();
        let all_bytes: Vec<u8> = (0..=255).collect();
        std::fs::write(from.path().join("sub/bytes"), &all_bytes).unwrap();
        std::fs::write(from.path().join("big"), vec![7u8; 100_000]).unwrap();
        std::os::unix::fs::symlink("sub/bytes", from.path().join("link")).unwrap();
        let (tx, rx) = mpsc::channel(CHUNKS_IN_FLIGHT);
        let source = from.path().to_path_buf();
        let builder = tokio::task::spawn_blocking(move || {
            let mut writer = ChannelWriter {
                tx,
                buffer: Vec::new(),
                size: 4096,
            };
            let mut archive = tar::Builder::new(&mut writer);
            archive.follow_symlinks(false);
            archive.append_dir_all("", &source).unwrap();
            archive.finish().unwrap();
            drop(archive);
            writer.finish();
        });
        let mut reader = ChannelReader {
            rx,
            current: Vec::new(),
            position: 0,
        };
        let mut stream = Vec::new();
        reader.read_to_end(&mut stream).await.unwrap();
        builder.await.unwrap();
        let to = tempfile::tempdir().unwrap();
        tar::Archive::new(&stream[..]).unpack(to.path()).unwrap();
        assert_eq!(
            std::fs::read(to.path().join("sub/bytes")).unwrap(),
            all_bytes
        );
        assert_eq!(std::fs::read(to.path().join("big")).unwrap().len(), 100_000);
        assert_eq!(
            std::fs::read_link(to.path().join("link")).unwrap(),
            Path::new("sub/bytes")
        );
    }

    #[tokio::test]
    async fn a_stream_whose_writer_vanished_without_the_end_marker_is_an_error_not_an_end() {
        let (tx, rx) = mpsc::channel(CHUNKS_IN_FLIGHT);
        tx.send(Ok(vec![1, 2, 3])).await.unwrap();
        drop(tx);
        let mut reader = ChannelReader {
            rx,
            current: Vec::new(),
            position: 0,
        };
        let mut out = Vec::new();
        let err = reader.read_to_end(&mut out).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);
        assert_eq!(out, [1, 2, 3]);
    }
}
