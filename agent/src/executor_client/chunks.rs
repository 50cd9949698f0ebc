//! Cutting a byte stream into `write` messages: full chunks as large as one message may carry,
//! the last one marked `eof`, and never more than one chunk held in memory.

use tokio::io::{AsyncRead, AsyncReadExt};

/// Raw bytes per `write`: 512 KiB is 683 KiB of base64, under every executor's message limit
/// we ship (1 MiB and more).
pub const CHUNK_BYTES: usize = 512 * 1024;

/// Room for a `write` message's JSON around its base64 (type, id, eof): ids are at most a few
/// hundred bytes (`max_id_bytes`).
const ENVELOPE_BYTES: usize = 1024;

/// The raw bytes one `write` may carry so that its message stays within `max_message_bytes`
/// (0: the executor did not say; then [`CHUNK_BYTES`]).
pub fn chunk_bytes(max_message_bytes: usize) -> usize {
    if max_message_bytes == 0 {
        return CHUNK_BYTES;
    }
    // Base64 turns every 3 bytes into 4 characters.
    let fits = max_message_bytes.saturating_sub(ENVELOPE_BYTES) / 4 * 3;
    fits.clamp(1, CHUNK_BYTES)
}

/// Reads a stream a chunk at a time, each chunk full unless it is the last.
pub struct Chunker<R> {
    source: R,
    size: usize,
    /// The chunk read ahead, to know whether the current one is the last.
    ahead: Option<Vec<u8>>,
    done: bool,
}

impl<R: AsyncRead + Unpin> Chunker<R> {
    pub fn new(source: R, size: usize) -> Self {
        Self {
            source,
            size: size.max(1),
            ahead: None,
            done: false,
        }
    }

    /// The next chunk and whether it is the last. An empty source gives one empty last chunk
    /// (an upload of an empty file still needs its `eof`). Not to be called after the last.
    pub async fn next(&mut self) -> std::io::Result<(Vec<u8>, bool)> {
        let current = match self.ahead.take() {
            Some(chunk) => chunk,
            None => self.fill().await?,
        };
        if current.len() < self.size {
            // Short: the source ended inside it.
            self.done = true;
            return Ok((current, true));
        }
        let next = self.fill().await?;
        if next.is_empty() {
            self.done = true;
            return Ok((current, true));
        }
        self.ahead = Some(next);
        Ok((current, false))
    }

    /// Read until a chunk is full or the source ends.
    async fn fill(&mut self) -> std::io::Result<Vec<u8>> {
        let mut chunk = vec![0; self.size];
        let mut filled = 0;
        while filled < chunk.len() && !self.done {
            let n = self.source.read(&mut chunk[filled..]).await?;
            if n == 0 {
                self.done = true;
            }
            filled += n;
        }
        chunk.truncate(filled);
        Ok(chunk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn all_chunks(source: impl AsyncRead + Unpin, size: usize) -> Vec<(Vec<u8>, bool)> {
        let mut chunker = Chunker::new(source, size);
        let mut out = Vec::new();
        loop {
            let (chunk, eof) = chunker.next().await.unwrap();
            out.push((chunk, eof));
            if eof {
                return out;
            }
        }
    }

    fn shape(chunks: &[(Vec<u8>, bool)]) -> Vec<(usize, bool)> {
        chunks.iter().map(|(c, eof)| (c.len(), *eof)).collect()
    }

    #[tokio::test]
    async fn an_empty_source_is_one_empty_last_chunk() {
        assert_eq!(shape(&all_chunks(&b""[..], 4).await), [(0, true)]);
    }

    #[tokio::test]
    async fn an_exact_multiple_ends_on_a_full_last_chunk_without_an_empty_one() {
        assert_eq!(
            shape(&all_chunks(&[7u8; 8][..], 4).await),
            [(4, false), (4, true)]
        );
    }

    #[tokio::test]
    async fn a_remainder_is_the_short_last_chunk() {
        assert_eq!(
            shape(&all_chunks(&[7u8; 9][..], 4).await),
            [(4, false), (4, false), (1, true)]
        );
    }

    #[tokio::test]
    async fn small_reads_are_gathered_into_full_chunks_and_every_byte_survives_in_order() {
        // A source that hands out 3 bytes per read, like a pipe written in small pieces.
        let bytes: Vec<u8> = (0..=255).collect();
        let (mut tx, rx) = tokio::io::duplex(3);
        let writer = tokio::spawn({
            let bytes = bytes.clone();
            async move {
                tokio::io::AsyncWriteExt::write_all(&mut tx, &bytes)
                    .await
                    .unwrap();
            }
        });
        let chunks = all_chunks(rx, 100).await;
        writer.await.unwrap();
        assert_eq!(shape(&chunks), [(100, false), (100, false), (56, true)]);
        let joined: Vec<u8> = chunks.into_iter().flat_map(|(c, _)| c).collect();
        assert_eq!(joined, bytes);
    }

    #[test]
    fn chunks_fit_the_executors_message_limit_as_base64() {
        assert_eq!(chunk_bytes(0), CHUNK_BYTES);
        assert_eq!(chunk_bytes(16 << 20), CHUNK_BYTES);
        for limit in [2048, 4096, 65_536, 700_000, 1 << 20] {
            let size = chunk_bytes(limit);
            let base64_len = size.div_ceil(3) * 4;
            assert!(
                base64_len + ENVELOPE_BYTES <= limit,
                "{limit}: {size} raw bytes"
            );
            assert!(size > 0);
        }
    }

    #[test]
    fn a_512_kib_chunk_fits_a_1_mib_message() {
        assert_eq!(chunk_bytes(1 << 20), CHUNK_BYTES);
    }
}
