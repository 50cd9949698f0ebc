//! The helper's children: init (pid 1 of the sandbox's pid namespace) and the payload, which
//! confines itself, says it is ready, waits for its command and execs it; and the two channels
//! between them and the helper (the setup pipe, the command socket).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::{IoSlice, IoSliceMut, Read};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::sys::signal::{SigSet, Signal};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use nix::sys::wait::waitpid;
use nix::unistd::Pid;

use super::{ChildNote, SetupError, MAX_PLAN_BYTES, SETUP_FAILED};
use crate::plan::{CommandPlan, StdinKind, Template};
use crate::sandbox;
use crate::sys::{self, Forked};

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

fn note(setup_w: &OwnedFd, note: &ChildNote) {
    if let Ok(mut text) = serde_json::to_vec(note) {
        text.push(b'\n');
        // One short write into a pipe nobody else writes: it cannot be split.
        let _ = nix::unistd::write(setup_w, &text);
    }
}

fn fail(setup_w: &OwnedFd, err: &SetupError) -> ! {
    note(
        setup_w,
        &ChildNote::Failed {
            stage: err.stage(),
            message: err.to_string(),
        },
    );
    sys::exit_child(SETUP_FAILED)
}

/// What init writes on its status pipe when the payload has exited.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct InitStatus {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub leftover: u32,
    /// Init wrote the command's report on the daemon's status pipe itself.
    #[serde(default)]
    pub reported: bool,
}

/// What init needs to report a command that left nothing behind: the socket the helper sends
/// the daemon's status pipe on (once `started` is written on it), and the limits' counters.
pub struct InitReport {
    pub status: OwnedFd,
    pub counters: super::end::Counters,
}

/// pid 1 of the sandbox: build the world, fork the payload, reap until it exits, report.
/// `net`: a network namespace of the pool to enter instead of making one; `root`: the mount
/// namespace of the template's shared root, to copy instead of building all of it.
pub fn init_main(
    template: &Template,
    setup_w: OwnedFd,
    status_w: OwnedFd,
    channel: OwnedFd,
    net: Option<OwnedFd>,
    root: Option<OwnedFd>,
    report: InitReport,
) -> ! {
    // If the helper dies, init dies, and the kernel kills the whole pid namespace with it.
    if let Err(err) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
        fail(&setup_w, &SetupError::Process(err.into()));
    }
    // The remaining namespaces, the new root, hostname, loopback.
    if let Err(err) = sandbox::enter_namespaces(&template.sandbox, net.as_ref(), root.as_ref()) {
        fail(&setup_w, &err.into());
    }
    // Entered: nothing of the command may hold the namespaces' descriptors.
    drop((net, root));
    let payload = match sys::fork() {
        Ok(Forked::Child) => payload_main(template, setup_w, channel),
        Ok(Forked::Parent(pid)) => pid,
        Err(err) => fail(&setup_w, &SetupError::Process(err)),
    };
    // The payload holds the setup pipe and the command socket; the helper reads the pipe to
    // its end: we must not keep either open.
    drop((setup_w, channel));
    // The daemon's status pipe comes once the command has started (none if the helper gave
    // up first); an early exit of the payload waits as a zombie meanwhile.
    let InitReport {
        status: socket,
        counters,
    } = report;
    let daemon = receive_fd(&socket);
    // Reap every process of the namespace (orphans are reparented to us) until the payload
    // exits; then report, and exit: the kernel kills whatever is left.
    loop {
        match waitpid(Pid::from_raw(-1), None) {
            Ok(status) if status.pid() == Some(payload) => {
                let (code, signal) = super::end::decode(Some(status));
                let leftover = leftovers();
                // Nothing left of the command: its result is whole, and ours to give.
                // The claim comes first, on a socket the helper does not wait on (no wake-up on
                // the result's path): the daemon closes the lifeline once it has the report,
                // and the helper, seeing that, must know the end was not a stop.
                let reported = leftover == 0
                    && daemon.as_ref().is_some_and(|fd| {
                        claim(&socket)
                            && super::report_line(
                                fd,
                                &super::finished(template, code, signal, &counters),
                            )
                    });
                drop(daemon);
                let report = InitStatus {
                    code,
                    signal,
                    leftover,
                    reported,
                };
                if let Ok(text) = serde_json::to_vec(&report) {
                    let _ = nix::unistd::write(&status_w, &text);
                }
                sys::exit_child(0);
            }
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(_) => sys::exit_child(0),
        }
    }
}

/// Processes of the command still in our pid namespace once the payload is reaped. With no
/// child left there are none (every process of the namespace descends from init: orphans
/// are reparented to it), which one `waitpid` tells without reading /proc.
fn leftovers() -> u32 {
    loop {
        match waitpid(
            Pid::from_raw(-1),
            Some(nix::sys::wait::WaitPidFlag::WNOHANG),
        ) {
            Err(Errno::ECHILD) => return 0,
            // A zombie reaped: look again.
            Ok(status) if status.pid().is_some() => {}
            Err(Errno::EINTR) => {}
            _ => return count_processes().saturating_sub(1),
        }
    }
}

/// Processes in our pid namespace (init included), from our /proc.
fn count_processes() -> u32 {
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.flatten()
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| n.parse::<u32>().is_ok())
                })
                .count() as u32
        })
        .unwrap_or(0)
}

/// The payload: confine, say so, wait for the command and its output pipe, enter the
/// working directory, exec. Never returns.
pub fn payload_main(template: &Template, setup_w: OwnedFd, channel: OwnedFd) -> ! {
    if let Err(err) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
        fail(&setup_w, &SetupError::Process(err.into()));
    }
    // Nothing blocked, as a fresh process expects (the helper blocks SIGCHLD for its
    // signalfd; every disposition is already the default).
    if let Err(err) = SigSet::empty().thread_set_mask() {
        fail(&setup_w, &SetupError::Process(err.into()));
    }
    // stdin from /dev/null for good (never the daemon's lifeline); stdout and stderr there
    // too until the output pipe arrives.
    let devnull = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        Ok(devnull) => devnull,
        Err(err) => fail(&setup_w, &SetupError::OutputPipe(err)),
    };
    let wired = nix::unistd::dup2_stdin(&devnull)
        .and_then(|()| nix::unistd::dup2_stdout(&devnull))
        .and_then(|()| nix::unistd::dup2_stderr(&devnull));
    drop(devnull);
    if let Err(err) = wired {
        fail(&setup_w, &SetupError::OutputPipe(err.into()));
    }
    if let Err(err) = sandbox::confine_process(&template.sandbox) {
        fail(&setup_w, &err.into());
    }
    note(&setup_w, &ChildNote::Ready);
    let (output, command) = match receive_command(&channel) {
        Ok(received) => received,
        // The helper went away before a command came: nothing to run.
        Err(_) => sys::exit_child(0),
    };
    drop(channel);
    // stdout and stderr on the one output pipe, so their order is kept; for a process the
    // client talks to, stdin too (a socket, or a terminal that becomes ours).
    if let Err(err) = wire_stdio(&output, command.stdin) {
        fail(&setup_w, &SetupError::OutputPipe(err));
    }
    drop(output);
    // Entered as the command, after its confinement: a directory it may not reach fails here
    // as it would for its own `cd`, and tells it no more than `cd` would.
    if let Err(errno) = nix::unistd::chdir(&command.cwd) {
        fail(
            &setup_w,
            &SetupError::Cwd {
                dir: command.cwd.display().to_string(),
                errno,
            },
        );
    }
    if let Some(op) = &command.builtin {
        // A file operation, where the command would have exec'd: the end of the setup pipe
        // (exec would have closed it) tells the helper it has started.
        drop(setup_w);
        // Nothing but its stdio: exec would have closed what the helper's side left open.
        sys::close_fds_above_stderr_except(&[]);
        use std::os::fd::AsFd;
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
    let err = exec(&command.argv, &command.env);
    fail(&setup_w, &err)
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

/// Hand init the daemon's status pipe (`started` is on it): init reports a command that left
/// nothing behind itself.
pub fn send_status(socket: &OwnedFd, status: &OwnedFd) -> Result<(), Errno> {
    let fds = [status.as_raw_fd()];
    sendmsg::<()>(
        socket.as_raw_fd(),
        &[IoSlice::new(&[0])],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map(|_| ())
}

/// Init's claim of the report, before it writes it.
fn claim(socket: &OwnedFd) -> bool {
    nix::sys::socket::send(socket.as_raw_fd(), b"r", MsgFlags::MSG_NOSIGNAL).is_ok()
}

/// Whether init has claimed the command's report (it reports, or is about to).
pub fn init_claimed(socket: &OwnedFd) -> bool {
    let mut byte = [0u8; 1];
    matches!(
        nix::sys::socket::recv(socket.as_raw_fd(), &mut byte, MsgFlags::MSG_DONTWAIT),
        Ok(1)
    )
}

/// The descriptor [`send_status`] sent, or none when the helper closed the socket first.
fn receive_fd(socket: &OwnedFd) -> Option<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    loop {
        let mut iov = [IoSliceMut::new(&mut byte)];
        match recvmsg::<()>(
            socket.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Err(Errno::EINTR) => continue,
            Err(_) => return None,
            Ok(msg) => {
                let mut fd = None;
                for cmsg in msg.cmsgs().ok()? {
                    if let ControlMessageOwned::ScmRights(raw) = cmsg {
                        for raw in raw {
                            let owned = sys::own_received_fd(raw);
                            fd.get_or_insert(owned);
                        }
                    }
                }
                return fd;
            }
        }
    }
}

fn receive_command(channel: &OwnedFd) -> Result<(OwnedFd, CommandPlan), SetupError> {
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

/// execve the payload, looking the program up in the command's PATH (not ours: ours is
/// empty).
fn exec(argv: &[String], env: &BTreeMap<String, String>) -> SetupError {
    let Some(program) = argv.first() else {
        return SetupError::Exec {
            program: String::new(),
            source: Errno::EINVAL,
        };
    };
    let exec_err = |source| SetupError::Exec {
        program: program.clone(),
        source,
    };
    let path = resolve(
        program,
        env.get("PATH")
            .map(String::as_str)
            .unwrap_or("/usr/bin:/bin"),
    );
    let to_c = |s: &str| CString::new(s).map_err(|_| exec_err(Errno::EINVAL));
    let path = match to_c(&path.to_string_lossy()) {
        Ok(p) => p,
        Err(e) => return e,
    };
    let args: Result<Vec<CString>, _> = argv.iter().map(|a| to_c(a)).collect();
    let vars: Result<Vec<CString>, _> =
        env.iter().map(|(k, v)| to_c(&format!("{k}={v}"))).collect();
    match (args, vars) {
        (Ok(args), Ok(vars)) => match nix::unistd::execve(&path, &args, &vars) {
            Err(errno) => exec_err(errno),
            Ok(never) => match never {},
        },
        (Err(e), _) | (_, Err(e)) => e,
    }
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
