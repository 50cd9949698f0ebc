//! A root shell in the VM that is not the executor: a virtio-serial port whose host end is a
//! unix socket. Sandboxed commands cannot reach it: it is a character device (not a network
//! port), outside every path the filtered profiles open, and the VM's /init holds it open.
//!
//! One request at a time: `script` is sent as `sh -c '<script>'` between two numbered markers,
//! and the reply is what lies between them. Lines before the begin marker are leftovers of an
//! earlier request that timed out, and are skipped.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::target::Outside;

pub struct SideChannel {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
    requests: u64,
}

impl SideChannel {
    /// Connect to qemu's socket and wait until the VM's shell answers, or `wait` passes.
    pub fn connect(socket: &Path, wait: Duration) -> Result<Self, String> {
        let deadline = Instant::now() + wait;
        let stream = loop {
            match UnixStream::connect(socket) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => {
                    return Err(format!("side channel {}: {e}", socket.display()))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        let mut channel = Self {
            writer: stream.try_clone().map_err(|e| e.to_string())?,
            reader: BufReader::new(stream),
            requests: 0,
        };
        // The VM's shell loop may be between two opens of the port: ask again until it answers.
        while Instant::now() < deadline {
            if let Ok(out) = channel.try_run("echo side-channel-up", Duration::from_secs(3)) {
                if out.output == "side-channel-up\n" {
                    return Ok(channel);
                }
            }
        }
        Err("the VM's side channel never answered".into())
    }

    /// Run `script` in the VM as root; `Err` when no complete reply came within `wait`.
    pub fn try_run(&mut self, script: &str, wait: Duration) -> Result<Outside, String> {
        self.requests += 1;
        let begin = format!("@@side-begin-{}@@", self.requests);
        let end = format!("@@side-end-{}@@", self.requests);
        let quoted = script.replace('\'', r"'\''");
        // stdin from /dev/null: the script must not read the channel's next request.
        let request =
            format!("echo {begin}; sh -c '{quoted}' </dev/null 2>&1; echo \"{end} $?\"\n");
        self.writer
            .write_all(request.as_bytes())
            .map_err(|e| format!("side channel write: {e}"))?;
        let deadline = Instant::now() + wait;
        let mut output = String::new();
        let mut started = false;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!("no reply to {script:?} within {wait:?}"));
            }
            self.reader
                .get_ref()
                .set_read_timeout(Some(left))
                .map_err(|e| e.to_string())?;
            let mut line = String::new();
            match self.reader.read_line(&mut line) {
                Ok(0) => return Err("side channel closed".into()),
                Ok(_) => {}
                Err(e) => return Err(format!("side channel read: {e}")),
            }
            if !started {
                started = line.trim_end() == begin;
                continue;
            }
            // The script's output need not end with a newline: the end marker may follow it
            // on the same line.
            if let Some(at) = line.find(&end) {
                output.push_str(&line[..at]);
                let code = line[at + end.len()..].trim().parse().unwrap_or(-1);
                return Ok(Outside { code, output });
            }
            output.push_str(&line);
        }
    }
}
