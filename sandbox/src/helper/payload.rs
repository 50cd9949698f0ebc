//! The payload: the process that confines itself, waits for its command and execs it, in its
//! supervisor's memory until then; and the supervisor's side of it (`start`: the setup pipe,
//! the hand-off of the command's lifeline and status pipe).

use std::collections::BTreeMap;
use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::SignalFd;
use nix::sys::socket::{socketpair, AddressFamily, MsgFlags, SockFlag, SockType};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid;

use super::{ChildNote, SetupError, SETUP_FAILED};
use crate::apply;
use crate::plan::{CommandPlan, HelperReport, StdinKind, Template};
use crate::sys;

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

/// Where a waiting payload's command comes from: the fork server, on `control`, while its
/// supervisor (init, or a helper) waits for our exec: the command's three descriptors. We
/// read the command from the lifeline and hand the supervisor the lifeline, the status pipe
/// and whatever came after the command on `handoff`.
pub struct Source<'a> {
    pub control: BorrowedFd<'a>,
    pub handoff: BorrowedFd<'a>,
}

/// The payload: confine, wait for the command and its descriptors, enter the working
/// directory, exec. Never returns.
///
/// It runs in its supervisor's memory (init's, or a helper's) until its exec
/// (`sys::spawn_sharing_memory`): so it borrows its descriptors (closed by exec or exit) and
/// changes nothing it did not allocate itself. The hand-off of the command's lifeline and
/// status pipe ([`HandOff`]) is its last act before the exec (or its exit): once the
/// supervisor has it, nothing of the payload's touches the allocator again, so the supervisor
/// may use it whatever becomes of the payload (decision "Init leads"). It first joins the
/// cgroups in `join`, those it was not born in.
pub fn payload_main(
    template: &Template,
    setup_w: BorrowedFd<'_>,
    source: Source<'_>,
    join: &[&Path],
) -> ! {
    if let Err(err) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
        fail(setup_w, &SetupError::Process(err.into()));
    }
    // Nothing blocked, as a fresh process expects (our parent blocks SIGCHLD for its
    // signalfd; every disposition is already the default).
    if let Err(err) = SigSet::empty().thread_set_mask() {
        fail(setup_w, &SetupError::Process(err.into()));
    }
    // Into the command's cgroups before anything of it runs: v1 hierarchies as one thread
    // naming itself (`cgroup::join_alone`: no wait for the kernel's global lock). Our supervisor
    // stays outside them, so that killing them never kills it.
    for dir in join {
        if let Err(err) = crate::cgroup::join_alone(dir) {
            fail(setup_w, &SetupError::Cgroup(err));
        }
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
    if let Err(err) = apply::confine_process(&template.sandbox) {
        fail(setup_w, &err.into());
    }
    let Source { control, handoff } = source;
    // Copies only: the message stays on `control` until our supervisor takes it off after our
    // hand-off. A stop (or kill) that lands as the message comes takes effect only once we
    // return from this call, with the descriptors ours alone if we had taken them, and the
    // supervisor could not report it on the status pipe.
    let stdio = match crate::wire::peek_stdio(control) {
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
    let (command, handing) = match read {
        Ok((command, rest)) => (command, HandOff::new(handoff, lifeline, status, &rest)),
        Err(err) => failed(setup_w, &err, HandOff::new(handoff, lifeline, status, &[])),
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
        // A file operation, where the command would have exec'd. Our supervisor runs again
        // only at our exec or exit: a forked process of its own memory serves it, and the
        // supervisor watches that one as the command's.
        match sys::fork() {
            Ok(sys::Forked::Child) => {}
            Ok(sys::Forked::Parent(pid)) => {
                handing.give(pid);
                sys::exit_child(0)
            }
            Err(err) => failed(setup_w, &SetupError::Process(err), handing),
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
    handing.give(Pid::this());
    let errno = exec.run();
    said.write(setup_w, errno)
}

/// A failure: said on the setup pipe, then the command's descriptors handed over, so that
/// our supervisor reports it; then exit.
fn failed(setup_w: BorrowedFd<'_>, err: &SetupError, handing: HandOff<'_>) -> ! {
    note(
        setup_w,
        &ChildNote::Failed {
            stage: err.stage(),
            message: err.to_string(),
        },
    );
    handing.give(Pid::this());
    sys::exit_child(SETUP_FAILED)
}

/// A payload's channels to the supervisor whose memory it shares: the setup pipe, on which
/// it says what failed and whose end tells the supervisor it is done with that memory, and
/// the hand-off socket. Made before anything could make them count elsewhere (init makes
/// them before its network namespace: a socket counts in the namespace it is made in).
pub struct Channels {
    setup: OwnedFd,
    setup_w: OwnedFd,
    handoff: OwnedFd,
    theirs: OwnedFd,
}

impl Channels {
    pub fn new() -> Result<Self, SetupError> {
        let process = |e: Errno| SetupError::Process(e.into());
        let (setup, setup_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(process)?;
        let (handoff, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(process)?;
        Ok(Self {
            setup,
            setup_w,
            handoff,
            theirs,
        })
    }
}

/// Where a payload starts: born in a cgroup2 directory (`into`, open, and its path, which it
/// joins itself where the kernel cannot place it at its birth) and joining the cgroups
/// `join` (v1 hierarchies) itself.
#[derive(Default)]
pub struct Birth<'a> {
    pub into: Option<(BorrowedFd<'a>, &'a Path)>,
    pub join: Vec<&'a Path>,
}

/// A payload done with its supervisor's memory: it exec'd, or exited.
pub struct Started {
    pub pid: Pid,
    /// Its end, where it exited before we ran again (and was reaped).
    pub ended: Option<WaitStatus>,
    /// What it said failed, if anything.
    pub failure: Option<SetupError>,
    /// Where its hand-off ([`take_handoff`]) waits, if it made one.
    pub handoff: OwnedFd,
}

/// What a supervisor's payload's setup notes are kept of: a failure's message names the
/// working directory, a path of up to 4096 bytes, escaped.
const SAID: usize = 32 << 10;

/// Start the payload of `template` in our memory (`sys::spawn_sharing_memory`) and wait until
/// it is done with it: it confines itself, waits for its command's descriptors from the fork
/// server on `control`, hands us the lifeline and the status pipe, and execs; we wait
/// meanwhile (we have nothing to do before its command runs): no copy of our address space is
/// made, faulted in and torn down again at its exec. `sigchld` is our SIGCHLD's signalfd.
///
/// `None`: the payload was disturbed (stopped or killed by a signal from outside) before its
/// hand-off. That is reported to the command that came, or comes, for it; the caller must
/// exit without allocating (the payload may have died half-way through an allocation in our
/// memory).
pub fn start(
    template: &Template,
    control: BorrowedFd<'_>,
    channels: Channels,
    sigchld: &SignalFd,
    birth: &Birth<'_>,
) -> Result<Option<Started>, SetupError> {
    let Channels {
        setup,
        setup_w,
        handoff,
        theirs,
    } = channels;
    // Written now: after a payload stopped or killed before its hand-off, nothing of ours
    // allocates.
    let disturbed = |how: &str| {
        report_bytes(&HelperReport::SetupFailed {
            stage: "process".into(),
            message: format!(
                "the sandbox's waiting process was {how} as it waited (by a signal from \
                 outside); the command did not run"
            ),
        })
    };
    // Never dropped after a disturbance (that would be the allocator): see the end.
    let stopped = ManuallyDrop::new(disturbed("stopped"));
    let killed = ManuallyDrop::new(disturbed("killed"));
    let mut stack = sys::ChildStack::new().map_err(SetupError::Process)?;
    let mut said = [0u8; SAID];
    let mut join = ManuallyDrop::new(birth.join.clone());
    let waited = sys::spawn_sharing_memory(
        &mut stack,
        setup.as_fd(),
        setup_w,
        &mut said,
        Some(sigchld.as_fd()),
        birth.into.map(|(fd, _)| fd),
        &mut |setup_w, placed| {
            if let (false, Some((_, dir))) = (placed, birth.into) {
                join.push(dir);
            }
            let source = Source {
                control,
                handoff: theirs.as_fd(),
            };
            payload_main(template, setup_w, source, &join)
        },
    )
    .map_err(SetupError::Process)?;
    drop((stack, theirs, setup));
    // Whether the payload is done with the allocator, found without it: its hand-off is its
    // last act before its exec or exit; without one, it has exited (the setup pipe's end),
    // and only a payload that exited on its own got to the end of what it was doing.
    let handed = {
        // A message waits (its end of file would poll readable too).
        let mut peek = [0u8; 4];
        matches!(
            nix::sys::socket::recv(
                handoff.as_raw_fd(),
                &mut peek,
                MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
            ),
            Ok(n) if n > 0
        )
    };
    let ended = match waited.ended {
        None if !handed => waitpid(waited.pid, None).ok(),
        ended => ended,
    };
    let disturbance = if waited.stopped {
        Some(&stopped)
    } else if !handed && !matches!(ended, Some(WaitStatus::Exited(..))) {
        Some(&killed)
    } else {
        None
    };
    if let Some(report) = disturbance {
        // Report that to the command that comes (or came: the payload only peeked at its
        // message, which stays on `control` until a hand-off), and free nothing: what was made
        // before the payload started stays allocated until our exit.
        let status = sys::receive_last_fd(handoff.as_fd(), false)
            .or_else(|| sys::receive_last_fd(control, true));
        if let Some(status) = status {
            let _ = nix::unistd::write(&status, report);
        }
        return Ok(None);
    }
    // The allocator is ours again.
    drop((
        ManuallyDrop::into_inner(stopped),
        ManuallyDrop::into_inner(killed),
        ManuallyDrop::into_inner(join),
    ));
    Ok(Some(Started {
        pid: waited.pid,
        ended,
        failure: failure(&said[..waited.said]),
        handoff,
    }))
}

/// A report as the line written on the status pipe.
pub fn report_bytes(report: &HelperReport) -> Vec<u8> {
    let mut line = serde_json::to_vec(report).unwrap_or_default();
    line.push(b'\n');
    line
}

/// The failure the payload wrote on the setup pipe, if it wrote one (one it could not write
/// whole, or we could not keep whole, is still one).
fn failure(said: &[u8]) -> Option<SetupError> {
    let line = said
        .split(|b| *b == b'\n')
        .next()
        .filter(|l| !l.is_empty())?;
    match serde_json::from_slice::<ChildNote>(line) {
        Ok(ChildNote::Failed { stage, message }) => Some(SetupError::Child { stage, message }),
        Err(_) => Some(SetupError::Child {
            stage: "process".into(),
            message: format!(
                "the sandbox's first process failed before its command ran: {}",
                String::from_utf8_lossy(&line[..line.len().min(1024)])
            ),
        }),
    }
}

/// What a payload hands its supervisor (init, or a helper) as its last act: the lifeline and
/// the status pipe (the supervisor watches the one and reports on the other), what the daemon wrote after the command
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

    /// One message the supervisor reads when it runs again (after our exec or exit). Where it cannot be
    /// sent, we exit: the supervisor must never think the command started without it. Nothing of it is
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

/// What the supervisor learned from a payload's [`HandOff`]: the command's first process, the lifeline,
/// the status pipe, and what came after the command.
pub struct HandedOver {
    pub main: Pid,
    pub lifeline: OwnedFd,
    pub status: OwnedFd,
    pub rest: Vec<u8>,
}

/// The supervisor's side of [`HandOff`]: never waits. Called only once the payload has handed over
/// (the supervisor checks the socket without allocating first), so it may allocate. Once it
/// has, the command's message the payload only peeked at is taken off `control` and its
/// descriptors closed (queued, they would hold the output open).
pub fn take_handoff(from: &OwnedFd, control: BorrowedFd<'_>) -> Option<HandedOver> {
    let mut buf = vec![0u8; 4 + super::LINE_CHUNK];
    let (bytes, fds) = crate::wire::receive_now::<2>(from.as_fd(), &mut buf)?;
    // (End of file, from a payload that exited without handing over, is no hand-off: the
    // message on `control` stays for the report to the command.)
    let [lifeline, status] = <[OwnedFd; 2]>::try_from(fds).ok()?;
    let main = i32::from_le_bytes(buf.get(..4)?.try_into().ok()?);
    let handed = HandedOver {
        main: Pid::from_raw(main),
        lifeline,
        status,
        rest: buf.get(4..bytes)?.to_vec(),
    };
    drop(crate::wire::receive_now::<3>(control, &mut [0u8; 16]));
    Some(handed)
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
    // A socket where a terminal is asked for: the sandbox has a devpts of its own, where we
    // make the terminal (so that its programs find it by name) and hand the daemon its master.
    let own = match stdin {
        StdinKind::Terminal if is_socket(output)? => Some(own_terminal(output)?),
        _ => None,
    };
    let output = own.as_ref().unwrap_or(output);
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

fn is_socket(fd: &OwnedFd) -> std::io::Result<bool> {
    let stat = nix::sys::stat::fstat(fd)?;
    Ok(stat.st_mode & libc::S_IFMT == libc::S_IFSOCK)
}

/// Make a terminal in the sandbox's devpts (`/dev/ptmx` leads there), send its master to the
/// daemon on `daemon`, and wait for its answer (it has sized the terminal by then); return
/// the terminal's slave, which becomes the command's stdio and controlling terminal.
fn own_terminal(daemon: &OwnedFd) -> std::io::Result<OwnedFd> {
    use nix::sys::socket::{sendmsg, ControlMessage};
    let master = nix::pty::posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY)?;
    nix::pty::grantpt(&master)?;
    nix::pty::unlockpt(&master)?;
    let name = nix::pty::ptsname_r(&master)?;
    let slave = OwnedFd::from(
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOCTTY)
            .open(&name)?,
    );
    let fds = [master.as_raw_fd()];
    sendmsg::<()>(
        daemon.as_raw_fd(),
        &[std::io::IoSlice::new(b"t")],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )?;
    // Ours closes here: the command never holds the master.
    drop(master);
    let mut answer = [0u8; 1];
    if nix::unistd::read(daemon, &mut answer)? != 1 {
        return Err(std::io::Error::other(
            "the daemon did not take the terminal",
        ));
    }
    Ok(slave)
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
