//! The daemon's way in: a helper started by the fork server for one command, wired to fresh
//! pipes. The daemon wraps the ends it gets in its own async types; nothing here waits but
//! for the fork server's answer, itself bounded (`ANSWER_TIMEOUT`).

use std::io;
use std::os::fd::OwnedFd;

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::unistd::Pid;

use super::Spawner;

/// A command's helper, started: its pid and the daemon's ends of its three pipes.
pub struct Started {
    /// The helper, a child of the fork server.
    pub pid: Pid,
    /// The lifeline's write end (non-blocking): the rest of the command line goes in after
    /// the first [`Started::written`] bytes; closing it tells the helper to kill the command's
    /// tree and report.
    pub lifeline: OwnedFd,
    /// The output pipe's read end, unless the output went to a descriptor of the caller's.
    pub output: Option<OwnedFd>,
    /// The status pipe's read end: `started` once the payload runs, then the verdict
    /// ([`crate::plan::HelperReport`]), one JSON line each.
    pub status: OwnedFd,
    /// How much of the command line is already in the lifeline.
    pub written: usize,
}

impl Spawner {
    /// Have the fork server start (or hand over) a helper for `template` (the JSON of a
    /// [`crate::plan::Template`]; another kept warm for it when `warm`), wired to fresh pipes
    /// (or, for the output, to `output` when given); `line` (the JSON of the command's
    /// [`crate::plan::CommandPlan`] and a newline) goes into its lifeline first, as much as
    /// fits without waiting.
    pub fn start_helper(
        &self,
        template: &[u8],
        warm: bool,
        line: &[u8],
        output: Option<&OwnedFd>,
    ) -> io::Result<Started> {
        let pipe =
            || -> io::Result<(OwnedFd, OwnedFd)> { Ok(nix::unistd::pipe2(OFlag::O_CLOEXEC)?) };
        let (stdin_r, stdin_w) = pipe()?;
        let (out_r, out_w) = match output {
            Some(fd) => (None, fd.try_clone()?),
            None => {
                let (r, w) = pipe()?;
                (Some(r), w)
            }
        };
        let (status_r, status_w) = pipe()?;
        // The command goes into the pipe before the helper has it, so it finds it there at
        // once instead of waiting for us to be scheduled again: one wake-up fewer per command.
        // The write end is non-blocking (as an async runtime wants it anyway): what does not
        // fit follows later.
        fcntl(&stdin_w, FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;
        let written = nix::unistd::write(&stdin_w, line).unwrap_or(0);
        let pid = self.spawn(template, warm, [&stdin_r, &out_w, &status_w])?;
        // The helper has its copies now; ours would hold its pipes open.
        drop((stdin_r, out_w, status_w));
        Ok(Started {
            pid,
            lifeline: stdin_w,
            output: out_r,
            status: status_r,
            written,
        })
    }
}
