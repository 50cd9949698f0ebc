//! Output capture: a bounded head-and-tail buffer and a streaming UTF-8 decoder.
//!
//! A command may print gigabytes; the daemon keeps at most `cap` bytes of it (the first half and
//! the last half), counts the rest, and says how much was left out. mini-swe-agent shows long
//! output as head + elided count + tail, so the head and the tail are what matter.

use std::collections::VecDeque;

/// Keeps the first `cap / 2` and the last `cap - cap / 2` bytes of a byte stream.
#[derive(Debug)]
pub struct HeadTail {
    head: Vec<u8>,
    head_cap: usize,
    tail: VecDeque<u8>,
    tail_cap: usize,
    total: u64,
}

/// The captured output, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct Captured {
    pub text: String,
    pub total_bytes: u64,
    pub elided_bytes: u64,
}

impl HeadTail {
    pub fn new(cap: usize) -> Self {
        let head_cap = cap / 2;
        Self {
            head: Vec::new(),
            head_cap,
            tail: VecDeque::new(),
            tail_cap: cap - head_cap,
            total: 0,
        }
    }

    pub fn push(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        let room = self.head_cap - self.head.len();
        if room > 0 {
            let take = room.min(data.len());
            self.head.extend_from_slice(&data[..take]);
            data = &data[take..];
        }
        if data.len() >= self.tail_cap {
            self.tail.clear();
            self.tail.extend(&data[data.len() - self.tail_cap..]);
            return;
        }
        self.tail.extend(data);
        let excess = self.tail.len().saturating_sub(self.tail_cap);
        self.tail.drain(..excess);
    }

    /// Decode what was kept. When bytes were left out, a marker line between head and tail says
    /// how many, so the model reading the output knows it is not whole.
    pub fn finish(self) -> Captured {
        let kept = (self.head.len() + self.tail.len()) as u64;
        let elided = self.total - kept;
        let (front, back) = self.tail.as_slices();
        let text = if elided == 0 {
            let mut all = self.head;
            all.extend_from_slice(front);
            all.extend_from_slice(back);
            String::from_utf8_lossy(&all).into_owned()
        } else {
            let mut tail = Vec::with_capacity(front.len() + back.len());
            tail.extend_from_slice(front);
            tail.extend_from_slice(back);
            format!(
                "{}\n[... {elided} bytes of output elided by the executor ...]\n{}",
                String::from_utf8_lossy(&self.head),
                String::from_utf8_lossy(&tail)
            )
        };
        Captured {
            text,
            total_bytes: self.total,
            elided_bytes: elided,
        }
    }
}

/// Decodes a byte stream split into arbitrary chunks as UTF-8, replacing invalid sequences with
/// U+FFFD but never splitting a valid character that straddles two chunks.
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    pub fn decode(&mut self, chunk: &[u8]) -> String {
        let joined;
        let mut rest: &[u8] = if self.pending.is_empty() {
            chunk
        } else {
            let mut buf = std::mem::take(&mut self.pending);
            buf.extend_from_slice(chunk);
            joined = buf;
            &joined
        };
        let mut out = String::with_capacity(rest.len());
        loop {
            match std::str::from_utf8(rest) {
                Ok(valid) => {
                    out.push_str(valid);
                    return out;
                }
                Err(err) => {
                    let (valid, after) = rest.split_at(err.valid_up_to());
                    out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                    match err.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[bad..];
                        }
                        // An incomplete sequence at the end: wait for the next chunk.
                        None => {
                            self.pending = after.to_vec();
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// Whatever is still pending at end of stream, decoded lossily.
    pub fn finish(&mut self) -> String {
        let pending = std::mem::take(&mut self.pending);
        String::from_utf8_lossy(&pending).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_output_is_kept_whole() {
        let mut buf = HeadTail::new(10);
        buf.push(b"abc");
        buf.push(b"def");
        assert_eq!(
            buf.finish(),
            Captured {
                text: "abcdef".into(),
                total_bytes: 6,
                elided_bytes: 0
            }
        );
    }

    #[test]
    fn output_at_exactly_the_cap_is_not_truncated() {
        let mut buf = HeadTail::new(10);
        buf.push(b"0123456789");
        assert_eq!(buf.finish().text, "0123456789");
    }

    #[test]
    fn long_output_keeps_head_and_tail_and_counts_the_rest() {
        let mut buf = HeadTail::new(6);
        for chunk in [&b"abcd"[..], b"efgh", b"ijkl", b"mn"] {
            buf.push(chunk);
        }
        let out = buf.finish();
        assert_eq!(out.total_bytes, 14);
        assert_eq!(out.elided_bytes, 8);
        assert_eq!(
            out.text,
            "abc\n[... 8 bytes of output elided by the executor ...]\nlmn"
        );
    }

    #[test]
    fn one_huge_chunk_keeps_its_last_bytes() {
        let mut buf = HeadTail::new(4);
        buf.push(&[b'x'; 1000]);
        buf.push(b"yz");
        let out = buf.finish();
        assert!(out.text.starts_with("xx\n"), "{}", out.text);
        assert!(out.text.ends_with("\nyz"), "{}", out.text);
        assert_eq!(out.elided_bytes, 998);
    }

    #[test]
    fn utf8_split_across_chunks_is_decoded_whole() {
        let bytes = "héllo €".as_bytes();
        let mut dec = Utf8Stream::default();
        let mut text = String::new();
        for b in bytes {
            text.push_str(&dec.decode(&[*b]));
        }
        text.push_str(&dec.finish());
        assert_eq!(text, "héllo €");
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut dec = Utf8Stream::default();
        let text = dec.decode(b"a\xffb\xc3");
        assert_eq!(text, "a\u{FFFD}b");
        assert_eq!(dec.finish(), "\u{FFFD}");
    }
}
