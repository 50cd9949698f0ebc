//! The payload: the process that confines itself, waits for its command and execs it; and
//! the channels between it and its parent (the setup pipe; the command socket from a helper,
//! or the hand-off to init).

use std::collections::BTreeMap;
use std::io::{IoSlice, IoSliceMut, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::sys::signal::{SigSet, Signal};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use nix::unistd::Pid;

use super::{ChildNote, SetupError, MAX_PLAN_BYTES, SETUP_FAILED};
use crate::plan::{CommandPlan, StdinKind, Template};
use crate::sandbox;
use crate::sys;

/// The helper's end of the setup pipe: notes from the child, one JSON line each.
pub struct SetupReader {
    file: std::fs::File,
    buffer: Vec<u8>,
}

impl SetupReader {
    pub fn new(fd: OwnedFd) -> Self {
        Self {
            file: std::fs::File::from(fd),
            buffer: Vec::new(),
        }
    }

    /// The next note, or `None` at end-of-file.
    fn next(&mut self) -> Result<Option<ChildNote>, SetupError> {
        loop {
            if let Some(end) = self.buffer.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buffer.drain(..=end).collect();
                return serde_json::from_slice(&line[..end]).map(Some).map_err(|_| {
                    SetupError::Child {
                        stage: "process".into(),
                        message: String::from_utf8_lossy(&line).into_owned(),
                    }
                });
            }
            let mut chunk = [0u8; 4096];
            match self.file.read(&mut chunk) {
                Ok(0) if self.buffer.is_empty() => return Ok(None),
                Ok(0) => self.buffer.push(b'\n'),
                Ok(n) => self.buffer.extend_from_slice(&chunk[..n]),
                Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
                Err(err) => return Err(SetupError::Process(err)),
            }
            if self.buffer.len() > 64 * 1024 {
                self.buffer.push(b'\n');
            }
        }
    }

    /// Wait until the child is confined and waiting for its command.
    pub fn ready(&mut self) -> Result<(), SetupError> {
        match self.next()? {
            Some(ChildNote::Ready) => Ok(()),
            Some(ChildNote::Failed { stage, message }) => Err(SetupError::Child { stage, message }),
            None => Err(SetupError::Child {
                stage: "process".into(),
                message: "the sandbox's first process died while it was being set up".into(),
            }),
        }
    }

    /// Wait until the payload has exec'd (end-of-file: the pipe closes on exec) or failed, or
    /// until the daemon closes `lifeline` first (a timeout, cancel or disconnect, also while
    /// a payload stopped as it waited never gets to its exec): `Ok` then too, and the end
    /// path, seeing the lifeline closed, takes the sandbox down at once, so the command
    /// never runs unsupervised and ends as the daemon says (timed out, cancelled...).
    pub fn exec_done(&mut self, lifeline: &OwnedFd) -> Result<(), SetupError> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        use std::os::fd::AsFd;
        if self.buffer.is_empty() {
            loop {
                let mut fds = [
                    PollFd::new(self.file.as_fd(), PollFlags::POLLIN),
                    PollFd::new(lifeline.as_fd(), PollFlags::POLLIN),
                ];
                match poll(&mut fds, PollTimeout::NONE) {
                    Ok(_) => {}
                    Err(Errno::EINTR) => continue,
                    Err(e) => return Err(SetupError::Process(e.into())),
                }
                let ready = |fd: &PollFd| fd.any().unwrap_or(true);
                if ready(&fds[0]) {
                    break;
                }
                if ready(&fds[1]) {
                    return Ok(());
                }
            }
        }
        match self.next()? {
            None => Ok(()),
            Some(ChildNote::Failed { stage, message }) => Err(SetupError::Child { stage, message }),
            Some(ChildNote::Ready) => Err(SetupError::Child {
                stage: "process".into(),
                message: "the sandbox said it was ready twice".into(),
            }),
        }
    }
}

fn note(setup_w: BorrowedFd<'_>, note: &ChildNote) {
    if let Ok(mut text) = serde_json::to_vec(note) {
        text.push(b'\n');
        // One short write into a pipe nobody else writes: it cannot be split.
        let _ = nix::unistd::write(setup_w, &text);
    }
}

fn fail(setup_w: BorrowedFd<'_>, err: &SetupError) -> ! {
    note(
        setup_w,
        &ChildNote::Failed {
            stage: err.stage(),
            message: err.to_string(),
        },
    );
    sys::exit_child(SETUP_FAILED)
}

/// Where a waiting payload's command comes from.
pub enum Source<'a> {
    /// Its helper, on the command socket: the output descriptor and the command, which the
    /// helper read from the lifeline (it keeps the lifeline and the status pipe).
    Helper(BorrowedFd<'a>),
    /// The fork server, on `control`, while init waits for our exec (`super::init`): the
    /// command's three descriptors. We read the command from the lifeline and hand init the
    /// lifeline, the status pipe and whatever came after the command on `handoff`.
    Init {
        control: BorrowedFd<'a>,
        handoff: BorrowedFd<'a>,
    },
}

/// The payload: confine, wait for the command and its output pipe, enter the working
/// directory, exec. Never returns.
///
/// It runs either as a forked process (under a helper) or, under init, in init's memory
/// until its exec (`sys::spawn_sharing_memory`): so it borrows its descriptors (closed by
/// exec or exit) and changes nothing it did not allocate itself. Under init, the hand-off of
/// the command's lifeline and status pipe ([`HandOff`]) is its last act before the exec (or
/// its exit): once init has it, nothing of the payload's touches the allocator again, so
/// init may use it whatever becomes of the payload (decision "Init leads").
pub fn payload_main(template: &Template, setup_w: BorrowedFd<'_>, source: Source<'_>) -> ! {
    if let Err(err) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
        fail(setup_w, &SetupError::Process(err.into()));
    }
    // Nothing blocked, as a fresh process expects (our parent blocks SIGCHLD for its
    // signalfd; every disposition is already the default).
    if let Err(err) = SigSet::empty().thread_set_mask() {
        fail(setup_w, &SetupError::Process(err.into()));
    }
    // stdin from /dev/null for good (never the daemon's lifeline); stdout and stderr there
    // too until the output pipe arrives.
    let devnull = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        Ok(devnull) => devnull,
        Err(err) => fail(setup_w, &SetupError::OutputPipe(err)),
    };
    let wired = nix::unistd::dup2_stdin(&devnull)
        .and_then(|()| nix::unistd::dup2_stdout(&devnull))
        .and_then(|()| nix::unistd::dup2_stderr(&devnull));
    drop(devnull);
    if let Err(err) = wired {
        fail(setup_w, &SetupError::OutputPipe(err.into()));
    }
    if let Err(err) = sandbox::confine_process(&template.sandbox) {
        fail(setup_w, &err.into());
    }
    let (output, command, handing) = match source {
        Source::Helper(channel) => {
            note(setup_w, &ChildNote::Ready);
            match receive_command(channel) {
                Ok((output, command)) => (output, command, None),
                // The helper went away before a command came: nothing to run.
                Err(_) => sys::exit_child(0),
            }
        }
        Source::Init { control, handoff } => {
            let stdio = match crate::spawner::receive_stdio(control) {
                Ok(Some(stdio)) => stdio,
                // Dismissed before a command came (or the fork server is gone).
                _ => sys::exit_child(0),
            };
            let read = super::read_line(stdio.lifeline.as_fd()).and_then(|(line, rest)| {
                let command =
                    serde_json::from_slice::<CommandPlan>(&line).map_err(SetupError::ParsePlan)?;
                Ok((command, rest))
            });
            let super::Stdio {
                lifeline,
                output,
                status,
            } = stdio;
            match read {
                Ok((command, rest)) => {
                    let handing = HandOff::new(handoff, lifeline, status, &rest);
                    (output, command, Some(handing))
                }
                Err(err) => {
                    let handing = HandOff::new(handoff, lifeline, status, &[]);
                    failed(setup_w, &err, Some(handing))
                }
            }
        }
    };
    // stdout and stderr on the one output pipe, so their order is kept; for a process the
    // client talks to, stdin too (a socket, or a terminal that becomes ours).
    if let Err(err) = wire_stdio(&output, command.stdin) {
        failed(setup_w, &SetupError::OutputPipe(err), handing);
    }
    drop(output);
    // Entered as the command, after its confinement: a directory it may not reach fails here
    // as it would for its own `cd`, and tells it no more than `cd` would.
    if let Err(errno) = nix::unistd::chdir(&command.cwd) {
        let err = SetupError::Cwd {
            dir: command.cwd.display().to_string(),
            errno,
        };
        failed(setup_w, &err, handing);
    }
    if let Some(op) = &command.builtin {
        // A file operation, where the command would have exec'd. Under init, which runs again
        // only at our exec or exit, a forked process of its own memory serves it, and init
        // watches that one as the command's.
        if let Some(handing) = handing {
            match sys::fork() {
                Ok(sys::Forked::Child) => {}
                Ok(sys::Forked::Parent(pid)) => {
                    handing.give(pid);
                    sys::exit_child(0)
                }
                Err(err) => failed(setup_w, &SetupError::Process(err), Some(handing)),
            }
        }
        // Nothing but its stdio: exec would have closed what our parent's side left open,
        // and the end of the setup pipe (the pipe among them) tells it we have started.
        sys::close_fds_above_stderr_except(&[]);
        let code = match (
            std::io::stdin().as_fd().try_clone_to_owned(),
            std::io::stdout().as_fd().try_clone_to_owned(),
        ) {
            (Ok(input), Ok(output)) => crate::files::serve(
                op,
                &mut std::fs::File::from(input),
                &mut std::fs::File::from(output),
            ),
            _ => SETUP_FAILED,
        };
        sys::exit_child(code);
    }
    let exec = match prepare_exec(&command.argv, &command.env) {
        Ok(exec) => exec,
        Err(err) => failed(setup_w, &err, handing),
    };
    // What a failed exec says, made now: after the hand-off nothing allocates.
    let mut said = ExecFailure::new(command.argv.first().map_or("", String::as_str));
    if let Some(handing) = handing {
        handing.give(Pid::this());
    }
    let errno = exec.run();
    said.write(setup_w, errno)
}

/// A failure: said on the setup pipe, then (under init) the command's descriptors handed
/// over, so that init reports it; then exit.
fn failed(setup_w: BorrowedFd<'_>, err: &SetupError, handing: Option<HandOff<'_>>) -> ! {
    note(
        setup_w,
        &ChildNote::Failed {
            stage: err.stage(),
            message: err.to_string(),
        },
    );
    if let Some(handing) = handing {
        handing.give(Pid::this());
    }
    sys::exit_child(SETUP_FAILED)
}

/// What a payload under init hands it as its last act: the lifeline and the status pipe
/// (init watches the one and reports on the other), what the daemon wrote after the command
/// (signal requests), and the pid of the command's first process. The message is made when
/// the command comes; [`HandOff::give`] only fills in the pid and sends it, allocating
/// nothing.
struct HandOff<'a> {
    to: BorrowedFd<'a>,
    lifeline: OwnedFd,
    status: OwnedFd,
    /// The pid's four bytes, then what came after the command.
    message: Vec<u8>,
}

impl<'a> HandOff<'a> {
    fn new(to: BorrowedFd<'a>, lifeline: OwnedFd, status: OwnedFd, rest: &[u8]) -> Self {
        let mut message = vec![0u8; 4];
        message.extend_from_slice(rest);
        Self {
            to,
            lifeline,
            status,
            message,
        }
    }

    /// One message init reads when it runs again (after our exec or exit). Where it cannot be
    /// sent, we exit: init must never think the command started without it. Nothing of it is
    /// freed (that would be the allocator again): our copies of the descriptors close at our
    /// exec or exit.
    fn give(mut self, main: Pid) {
        self.message[..4].copy_from_slice(&main.as_raw().to_le_bytes());
        let fds = [self.lifeline.as_raw_fd(), self.status.as_raw_fd()];
        if sys::send_fds_without_allocating(self.to, &self.message, &fds).is_err() {
            sys::exit_child(SETUP_FAILED);
        }
        std::mem::forget(self);
    }
}

/// What init learned from a payload's [`HandOff`]: the command's first process, the lifeline,
/// the status pipe, and what came after the command.
pub struct HandedOver {
    pub main: Pid,
    pub lifeline: OwnedFd,
    pub status: OwnedFd,
    pub rest: Vec<u8>,
}

/// Init's side of [`HandOff`]: never waits. Called only once the payload has handed over
/// (init checks the socket without allocating first), so it may allocate.
pub fn take_handoff(from: &OwnedFd) -> Option<HandedOver> {
    let mut buf = vec![0u8; 4 + super::LINE_CHUNK];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 2]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(
        from.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
    )
    .ok()?;
    let bytes = msg.bytes;
    let mut fds = Vec::new();
    for cmsg in msg.cmsgs().ok()? {
        if let ControlMessageOwned::ScmRights(raw) = cmsg {
            fds.extend(raw.into_iter().map(sys::own_received_fd));
        }
    }
    let [lifeline, status] = <[OwnedFd; 2]>::try_from(fds).ok()?;
    let main = i32::from_le_bytes(buf.get(..4)?.try_into().ok()?);
    Some(HandedOver {
        main: Pid::from_raw(main),
        lifeline,
        status,
        rest: buf.get(4..bytes)?.to_vec(),
    })
}

/// The note of a failed exec, written without allocating: its start made beforehand (with
/// room for the rest), the errno's text and the end added at the failure.
struct ExecFailure {
    text: Vec<u8>,
}

impl ExecFailure {
    fn new(program: &str) -> Self {
        let start = serde_json::to_vec(&ChildNote::Failed {
            stage: "exec".into(),
            message: format!("cannot start {program}: \u{1}"),
        })
        .unwrap_or_default();
        // Up to the placeholder (serde_json writes it as \u0001), which the errno replaces.
        let cut = start
            .windows(6)
            .position(|w| w == b"\\u0001")
            .unwrap_or(start.len());
        let mut text = Vec::with_capacity(cut + 256);
        text.extend_from_slice(&start[..cut]);
        Self { text }
    }

    fn write(&mut self, setup_w: BorrowedFd<'_>, errno: Errno) -> ! {
        // An errno's text is ASCII without quotes or backslashes: nothing to escape. Within
        // the room made beforehand (a note cut short is still a failure to init).
        for part in [errno.desc().as_bytes(), b"\"}\n"] {
            let room = self.text.capacity() - self.text.len();
            self.text.extend_from_slice(&part[..part.len().min(room)]);
        }
        let _ = nix::unistd::write(setup_w, &self.text);
        sys::exit_child(SETUP_FAILED)
    }
}

/// The output descriptor as stdout and stderr, and as stdin unless that is /dev/null; a
/// terminal becomes the controlling terminal of a new session (job control, Ctrl-C).
fn wire_stdio(output: &OwnedFd, stdin: StdinKind) -> std::io::Result<()> {
    use std::os::fd::AsFd;
    nix::unistd::dup2_stdout(output)?;
    nix::unistd::dup2_stderr(output)?;
    match stdin {
        StdinKind::Null => {}
        StdinKind::Socket => nix::unistd::dup2_stdin(output)?,
        StdinKind::Terminal => {
            nix::unistd::setsid()?;
            nix::unistd::dup2_stdin(output)?;
            sys::set_controlling_terminal(std::io::stdin().as_fd())?;
        }
    }
    Ok(())
}

/// Hand the waiting payload its output pipe and its command: the descriptor with the
/// command's length, then the command (JSON).
pub fn send_command(
    channel: &OwnedFd,
    output: OwnedFd,
    command: &CommandPlan,
) -> Result<(), SetupError> {
    let io = |e: Errno| match e {
        Errno::EPIPE | Errno::ECONNRESET => SetupError::Child {
            stage: "process".into(),
            message: "the sandbox's waiting process was gone when its command came (killed as \
                      it waited); the command did not run"
                .into(),
        },
        e => SetupError::Process(e.into()),
    };
    let body = serde_json::to_vec(command).map_err(SetupError::ParsePlan)?;
    let len = (body.len() as u64).to_le_bytes();
    let fds = [output.as_raw_fd()];
    // MSG_NOSIGNAL: a payload killed while it waited (a same-uid command can, before
    // landlock's signal scoping) must give us EPIPE, reported, not a SIGPIPE that kills us.
    sendmsg::<()>(
        channel.as_raw_fd(),
        &[IoSlice::new(&len)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(io)?;
    drop(output);
    let mut sent = 0;
    while sent < body.len() {
        match nix::sys::socket::send(channel.as_raw_fd(), &body[sent..], MsgFlags::MSG_NOSIGNAL) {
            Ok(n) => sent += n,
            Err(Errno::EINTR) => {}
            Err(e) => return Err(io(e)),
        }
    }
    Ok(())
}

fn receive_command(channel: BorrowedFd<'_>) -> Result<(OwnedFd, CommandPlan), SetupError> {
    let io = |e: Errno| SetupError::Process(e.into());
    let mut len = [0u8; 8];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let (bytes, fd) = {
        let mut iov = [IoSliceMut::new(&mut len)];
        let msg = recvmsg::<()>(
            channel.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_WAITALL,
        )
        .map_err(io)?;
        let mut fd = None;
        for cmsg in msg.cmsgs().map_err(io)? {
            if let ControlMessageOwned::ScmRights(raw) = cmsg {
                for raw in raw {
                    let owned = sys::own_received_fd(raw);
                    fd.get_or_insert(owned);
                }
            }
        }
        (msg.bytes, fd)
    };
    let (Some(output), 8) = (fd, bytes) else {
        return Err(io(Errno::EPROTO));
    };
    let len = usize::try_from(u64::from_le_bytes(len)).unwrap_or(usize::MAX);
    if len > MAX_PLAN_BYTES {
        return Err(io(Errno::EMSGSIZE));
    }
    let mut body = vec![0u8; len];
    let mut got = 0;
    while got < len {
        match nix::unistd::read(channel, &mut body[got..]) {
            Ok(0) => return Err(io(Errno::EPIPE)),
            Ok(n) => got += n,
            Err(Errno::EINTR) => {}
            Err(e) => return Err(io(e)),
        }
    }
    let command = serde_json::from_slice(&body).map_err(SetupError::ParsePlan)?;
    Ok((output, command))
}

/// The payload's exec, made ready: the program looked up in the command's PATH (not ours:
/// ours is empty), its arguments and environment as C strings.
fn prepare_exec(argv: &[String], env: &BTreeMap<String, String>) -> Result<sys::Exec, SetupError> {
    let program = argv.first().map_or("", String::as_str);
    let path = resolve(
        program,
        env.get("PATH")
            .map(String::as_str)
            .unwrap_or("/usr/bin:/bin"),
    );
    sys::Exec::new(
        &path.to_string_lossy(),
        argv.iter().map(String::as_str),
        env.iter().map(|(k, v)| format!("{k}={v}")),
    )
    .filter(|_| !program.is_empty())
    .ok_or_else(|| SetupError::Exec {
        program: program.to_string(),
        source: Errno::EINVAL,
    })
}

/// The first executable `program` in `search_path`, as execvp(3) would find it.
fn resolve(program: &str, search_path: &str) -> PathBuf {
    if program.contains('/') {
        return PathBuf::from(program);
    }
    search_path
        .split(':')
        .filter(|dir| !dir.is_empty())
        .map(|dir| Path::new(dir).join(program))
        .find(|candidate| {
            std::fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .unwrap_or_else(|| PathBuf::from(program))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_are_found_on_the_commands_path() {
        assert_eq!(resolve("sh", "/nonexistent:/bin"), PathBuf::from("/bin/sh"));
        assert_eq!(resolve("/x/y", "/bin"), PathBuf::from("/x/y"));
        assert_eq!(
            resolve("no-such-program", "/bin"),
            PathBuf::from("no-such-program")
        );
    }
}
