//! Cleanup that runs however the test process ends.
//!
//! VMs and containers are shared by every test of a binary through statics, which Rust never
//! drops; and a test process can die by SIGKILL or an abort. So each one is paired with a
//! watcher: a shell in a session of its own (out of reach of a terminal's Ctrl-C) that reads a
//! pipe whose write end only the test process holds. When that process ends, whatever the way,
//! the kernel closes the write end, `read` returns at end of file, and the watcher runs the
//! cleanup command.

use std::process::{Child, Command, Stdio};

pub struct Lifeline {
    watcher: Child,
}

impl Lifeline {
    /// Run the shell command `cleanup` when this value is dropped or the process ends.
    pub fn new(cleanup: &str) -> Self {
        let watcher = Command::new("setsid")
            .args(["sh", "-c", &format!("read _ignored; {cleanup}"), "lifeline"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("setsid(1) and sh start the lifeline watcher");
        Self { watcher }
    }
}

impl Drop for Lifeline {
    /// Close the pipe and wait for the cleanup to finish.
    fn drop(&mut self) {
        drop(self.watcher.stdin.take());
        let _ = self.watcher.wait();
    }
}
