//! The fork server: a small single-threaded process, our own binary started once as
//! `executor __fork-server`, that forks a sandbox helper for each command.
//!
//! Starting a helper by exec costs a dynamic load and a Rust start-up per command (about 2 ms
//! on a VM, most of it CPUID traps in the loader), and makes every helper read the loader's
//! files from a filesystem that a `task-container` command may write. A fork of this small
//! process costs a fraction of that, loads nothing, and runs the same code (`helper::main`).
//!
//! It is exec'd once, at the daemon's start (so it holds none of the daemon's memory, and its
//! command line, which every helper and sandbox init inherits, names nothing of the daemon's),
//! then only forks. Protocol on a SOCK_SEQPACKET socket pair, the server's end being its
//! stdin: the daemon sends one message with three descriptors (the helper's stdin, stdout and
//! stderr, exactly what exec would have given it); the server forks and answers with the
//! helper's pid (4 bytes, little endian). When the daemon goes away the socket reads
//! end-of-file and the server exits; PR_SET_PDEATHSIG covers a daemon killed outright (its
//! main thread, which started us, lives as long as it does).

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use nix::sys::signal::Signal;
use nix::sys::socket::{
    recvmsg, sendmsg, setsockopt, socketpair, sockopt, AddressFamily, ControlMessage,
    ControlMessageOwned, MsgFlags, SockFlag, SockType,
};
use nix::sys::time::TimeVal;
use nix::unistd::Pid;

use crate::sys::{self, Forked};

/// The daemon's end.
pub struct Spawner {
    sock: Mutex<OwnedFd>,
    /// Set after any failure: a late answer could pair a pid with the wrong request, so the
    /// daemon stops using the server and execs helpers instead.
    broken: AtomicBool,
}

/// How long the daemon waits for the server's answer (a fork takes well under a millisecond).
const ANSWER_TIMEOUT: TimeVal = TimeVal::new(2, 0);

impl std::fmt::Debug for Spawner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Spawner")
    }
}

/// argv[1] that selects fork-server mode.
pub const FORK_SERVER_ARG: &str = "__fork-server";

/// Start the server from the main thread (PR_SET_PDEATHSIG follows the thread that forks).
pub fn start(exe: &std::path::Path) -> io::Result<Spawner> {
    let (daemon_end, server_end) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )?;
    // Nothing of the daemon's environment; the socket as stdin; output to nowhere.
    std::process::Command::new(exe)
        .arg(FORK_SERVER_ARG)
        .env_clear()
        .stdin(std::process::Stdio::from(server_end))
        .stdout(std::process::Stdio::null())
        .spawn()?;
    setsockopt(&daemon_end, sockopt::ReceiveTimeout, &ANSWER_TIMEOUT)?;
    Ok(Spawner {
        sock: Mutex::new(daemon_end),
        broken: AtomicBool::new(false),
    })
}

/// Entry point of fork-server mode (checked in `main` before anything else runs).
pub fn main() -> ! {
    let daemon = nix::unistd::getppid();
    let _ = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL);
    if nix::unistd::getppid() != daemon || sys::assert_single_threaded().is_err() {
        sys::exit_child(1);
    }
    let Ok(sock) = std::io::stdin().as_fd().try_clone_to_owned() else {
        sys::exit_child(1);
    };
    serve(sock)
}

impl Spawner {
    /// Start a helper with these descriptors as its stdin, stdout and stderr.
    pub fn spawn(&self, stdio: [&OwnedFd; 3]) -> io::Result<Pid> {
        if self.broken.load(Ordering::Acquire) {
            return Err(io::Error::other("the fork server failed before"));
        }
        let result = self.request(stdio);
        if result.is_err() {
            self.broken.store(true, Ordering::Release);
        }
        result
    }

    fn request(&self, stdio: [&OwnedFd; 3]) -> io::Result<Pid> {
        let sock = self
            .sock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let fds = stdio.map(|fd| fd.as_raw_fd());
        sendmsg::<()>(
            sock.as_raw_fd(),
            &[IoSlice::new(b"spawn")],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )?;
        let mut reply = [0u8; 4];
        let read = nix::unistd::read(&*sock, &mut reply)?;
        let pid = i32::from_le_bytes(reply);
        if read != reply.len() || pid <= 0 {
            return Err(io::Error::other(
                "the fork server is gone or could not fork",
            ));
        }
        Ok(Pid::from_raw(pid))
    }
}

/// The server's loop. Never returns.
fn serve(sock: OwnedFd) -> ! {
    // Our stdin is the socket (`sock` is our own copy) and nothing reads our stdout: point
    // both at /dev/null, so that no helper inherits the socket through them.
    if let Ok(devnull) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        let _ = nix::unistd::dup2_stdin(&devnull);
        let _ = nix::unistd::dup2_stdout(&devnull);
    }
    // Helpers are reaped by the kernel: nobody here waits for them.
    if sys::ignore_children().is_err() {
        sys::exit_child(1);
    }
    loop {
        let stdio = match receive(&sock) {
            Ok(Some(stdio)) => stdio,
            // End-of-file: the daemon is gone.
            Ok(None) | Err(_) => sys::exit_child(0),
        };
        match sys::fork() {
            Ok(Forked::Child) => {
                drop(sock);
                helper_child(stdio)
            }
            Ok(Forked::Parent(pid)) => {
                drop(stdio);
                let _ = nix::unistd::write(&sock, &pid.as_raw().to_le_bytes());
            }
            Err(_) => {
                drop(stdio);
                let _ = nix::unistd::write(&sock, &0i32.to_le_bytes());
            }
        }
    }
}

/// In the forked helper: put the descriptors where exec would have, give back the default
/// signal state (we ignore SIGCHLD here), and run the helper.
fn helper_child(stdio: Vec<OwnedFd>) -> ! {
    let [stdin, stdout, stderr] = match <[OwnedFd; 3]>::try_from(stdio) {
        Ok(fds) => fds,
        Err(_) => sys::exit_child(1),
    };
    let wired = nix::unistd::dup2_stdin(&stdin)
        .and_then(|()| nix::unistd::dup2_stdout(&stdout))
        .and_then(|()| nix::unistd::dup2_stderr(&stderr));
    drop((stdin, stdout, stderr));
    if wired.is_err() || sys::reset_signals().is_err() {
        sys::exit_child(1);
    }
    let _ = crate::helper::main();
    sys::exit_child(0)
}

/// One request: three descriptors, or `None` at end-of-file.
fn receive(sock: &OwnedFd) -> io::Result<Option<Vec<OwnedFd>>> {
    let mut buf = [0u8; 16];
    let mut iov = [IoSliceMut::new(&mut buf)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 3]);
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    if msg.bytes == 0 {
        return Ok(None);
    }
    let mut fds = Vec::new();
    for cmsg in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = cmsg {
            fds.extend(raw.into_iter().map(sys::own_received_fd));
        }
    }
    if fds.len() == 3 {
        Ok(Some(fds))
    } else {
        Err(io::Error::other(
            "a spawn request without three descriptors",
        ))
    }
}
