//! Placeholder until the implementation lands (branch `files`).

use std::io::{Read, Write};

use super::{ErrorKind, FileOp, Header};

/// Carry out `op` with `input` as stdin and `output` as stdout; returns the exit code.
pub fn serve(_op: &FileOp, _input: &mut dyn Read, output: &mut dyn Write) -> i32 {
    let header = Header::Error {
        kind: ErrorKind::Invalid,
        message: "file operations are not built yet".into(),
    };
    if let Ok(mut line) = serde_json::to_vec(&header) {
        line.push(b'\n');
        let _ = output.write_all(&line);
    }
    1
}
