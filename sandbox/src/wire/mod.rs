//! What the fork server (`spawner`) and the helpers it forks (`helper`: supervisors, inits,
//! payloads) share, below both so that neither imports the other: the messages on the fork
//! server's sockets (the daemon's requests and the server's answers, module docs of
//! `spawner`; what a one-shot run leaves behind; a worker's command descriptors; an init's
//! verdict), and what is lent and given back ([`lease`]). All go over SOCK_SEQPACKET pairs: a
//! message keeps its bounds and carries descriptors.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;

use nix::sys::socket::{
    recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags,
    SockFlag, SockType,
};

use crate::sys;

pub mod lease;

/// First byte of a message to the server: what it asks for.
pub const RUN: u8 = 0;
pub const RUN_AND_WARM: u8 = 1;
pub const DISMISS_IDLE: u8 = 2;
/// What a one-shot run leaves, to remove after it ([`Leftover`]): for each, a kind's
/// byte and a NUL-terminated path.
pub const REMOVE_AFTER: u8 = 3;

/// A connected pair of close-on-exec SOCK_SEQPACKET sockets: what the fork server talks to
/// the daemon, its workers and its helpers over (a message keeps its bounds and carries
/// descriptors).
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )?)
}

/// The three descriptors one command is served with.
pub struct Stdio {
    pub lifeline: OwnedFd,
    pub output: OwnedFd,
    pub status: OwnedFd,
}

/// What init tells the fork server on `control` as its last act: which of the command's
/// things may be lent to the template's next command.
pub mod verdict {
    /// The cgroup directories: the command left no process behind, was not stopped, and hit
    /// no limit (the fork server still checks they are empty, `spawner`).
    pub const CGROUPS: u8 = 1;
    /// The network namespace holds no socket (`lease::settles_empty`); one init
    /// made itself comes with the message.
    pub const NET: u8 = 2;
}

/// One request of the daemon.
pub struct Request {
    pub warm: bool,
    pub template: Vec<u8>,
    pub stdio: [OwnedFd; 3],
}

/// Init's last act: its verdict ([`verdict`] flags) on `control`, with its network
/// namespace where it made it and it may be lent again. Never waits.
pub fn send_verdict(control: &OwnedFd, flags: u8, ns: Option<&OwnedFd>) {
    let fds: Vec<std::os::fd::RawFd> = ns.iter().map(|fd| fd.as_raw_fd()).collect();
    let cmsgs: Vec<ControlMessage<'_>> = if fds.is_empty() {
        Vec::new()
    } else {
        vec![ControlMessage::ScmRights(&fds)]
    };
    let _ = sendmsg::<()>(
        control.as_raw_fd(),
        &[IoSlice::new(&[flags])],
        &cmsgs,
        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
        None,
    );
}

/// An init's verdict, read once it is reaped (so it never waits): the flags, and the network
/// namespace it sent.
pub fn receive_verdict(control: &OwnedFd) -> Option<(u8, Option<OwnedFd>)> {
    let mut buf = [0u8; 1];
    let (bytes, mut fds) = receive_now::<1>(control.as_fd(), &mut buf)?;
    (bytes == 1).then(|| (buf[0], fds.pop()))
}

/// One message already there and the (at most `N`) descriptors that came with it, without
/// waiting: `None` when none is there or it cannot be read.
pub fn receive_now<const N: usize>(
    sock: std::os::fd::BorrowedFd<'_>,
    buf: &mut [u8],
) -> Option<(usize, Vec<OwnedFd>)> {
    let mut iov = [IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; N]);
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
    )
    .ok()?;
    let mut fds = Vec::new();
    for cmsg in msg.cmsgs().ok()? {
        if let ControlMessageOwned::ScmRights(raw) = cmsg {
            fds.extend(raw.into_iter().map(sys::own_received_fd));
        }
    }
    Some((msg.bytes, fds))
}

/// Send a worker its command's three descriptors.
pub fn send_stdio(control: &OwnedFd, stdio: [&OwnedFd; 3]) -> io::Result<()> {
    let fds = stdio.map(|fd| fd.as_raw_fd());
    sendmsg::<()>(
        control.as_raw_fd(),
        &[IoSlice::new(b"run")],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )?;
    Ok(())
}

/// In a worker: the command's descriptors, or `None` when the server closed the socket.
pub fn receive_stdio(control: impl AsFd) -> io::Result<Option<Stdio>> {
    stdio_message(control.as_fd(), MsgFlags::empty())
}

/// In a waiting payload: copies of the command's descriptors, the message left on `control`
/// (`MSG_PEEK`) for its supervisor, which takes it off after the payload's hand-off, or takes
/// it to report on a payload stopped or killed before that (`helper::payload`); `None` when
/// the server closed the socket.
pub fn peek_stdio(control: impl AsFd) -> io::Result<Option<Stdio>> {
    stdio_message(control.as_fd(), MsgFlags::MSG_PEEK)
}

fn stdio_message(
    control: std::os::fd::BorrowedFd<'_>,
    flags: MsgFlags,
) -> io::Result<Option<Stdio>> {
    let mut buf = [0u8; 16];
    let Some((_, fds)) = receive_with(control, &mut buf, flags)? else {
        return Ok(None);
    };
    let [lifeline, output, status] = three(fds)?;
    Ok(Some(Stdio {
        lifeline,
        output,
        status,
    }))
}

/// One message and the descriptors that came with it, or `None` at end-of-file.
pub fn receive_fds(
    sock: std::os::fd::BorrowedFd<'_>,
    buf: &mut [u8],
) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
    receive_with(sock, buf, MsgFlags::empty())
}

/// [`receive_fds`] with `flags` besides `MSG_CMSG_CLOEXEC` (`MSG_PEEK`: the message stays
/// queued; its descriptors come as copies).
fn receive_with(
    sock: std::os::fd::BorrowedFd<'_>,
    buf: &mut [u8],
    flags: MsgFlags,
) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
    let mut iov = [IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 3]);
    let msg = loop {
        match recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC | flags,
        ) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => break other?,
        }
    };
    if msg.bytes == 0 {
        return Ok(None);
    }
    let truncated = msg
        .flags
        .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
    let mut fds = Vec::new();
    for cmsg in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = cmsg {
            fds.extend(raw.into_iter().map(sys::own_received_fd));
        }
    }
    if truncated {
        return Err(io::Error::other("a message too large"));
    }
    Ok(Some((msg.bytes, fds)))
}

pub fn three(fds: Vec<OwnedFd>) -> io::Result<[OwnedFd; 3]> {
    <[OwnedFd; 3]>::try_from(fds)
        .map_err(|_| io::Error::other("a message without three descriptors"))
}

/// What the daemon asks of the server.
pub enum Message {
    Run(Request),
    DismissIdle,
    RemoveAfter(Vec<Leftover>),
}

/// One message of the daemon, or `None` at end-of-file.
pub fn receive(sock: &OwnedFd, buf: &mut [u8]) -> io::Result<Option<Message>> {
    let Some((bytes, fds)) = receive_fds(sock.as_fd(), buf)? else {
        return Ok(None);
    };
    match buf[..bytes].split_first() {
        Some((&DISMISS_IDLE, [])) if fds.is_empty() => Ok(Some(Message::DismissIdle)),
        Some((&REMOVE_AFTER, leftovers)) if fds.is_empty() => {
            Ok(Some(Message::RemoveAfter(parse(leftovers))))
        }
        Some((&flag @ (RUN | RUN_AND_WARM), template)) => Ok(Some(Message::Run(Request {
            warm: flag == RUN_AND_WARM,
            template: template.to_vec(),
            stdio: three(fds)?,
        }))),
        _ => Err(io::Error::other("a malformed request")),
    }
}

/// What a one-shot run leaves behind, for its fork server to remove once the run is over
/// (`spawner::remove_leftovers`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leftover {
    /// A cgroup directory of the run's (its command's own: `cgroup::Placement::one_command`).
    Cgroup(PathBuf),
    /// A directory holding the cgroups of the runs and daemons of our pid namespace: those of
    /// the dead are removed (`cgroup::remove_stale`).
    StaleCgroups(PathBuf),
    /// The run's home (`homes`), what is mounted beneath it unmounted or, without `unmount`,
    /// left with the home.
    Home { dir: PathBuf, unmount: bool },
    /// The directory of the homes of runs: those of runs that are gone are removed
    /// (`homes::remove_stale`).
    StaleHomes(PathBuf),
}

impl Leftover {
    /// Its kind's byte in a [`REMOVE_AFTER`] message.
    fn kind(&self) -> u8 {
        match self {
            Self::Cgroup(_) => b'c',
            Self::StaleCgroups(_) => b'C',
            Self::Home { unmount: false, .. } => b'h',
            Self::Home { unmount: true, .. } => b'H',
            Self::StaleHomes(_) => b's',
        }
    }

    fn path(&self) -> &PathBuf {
        match self {
            Self::Cgroup(p) | Self::StaleCgroups(p) | Self::StaleHomes(p) => p,
            Self::Home { dir, .. } => dir,
        }
    }
}

/// A [`REMOVE_AFTER`] message: each leftover as its kind's byte, its path and a NUL.
pub fn encode(leftovers: &[Leftover]) -> Vec<u8> {
    let mut message = vec![REMOVE_AFTER];
    for leftover in leftovers {
        message.push(leftover.kind());
        message.extend_from_slice(leftover.path().as_os_str().as_encoded_bytes());
        message.push(0);
    }
    message
}

/// The leftovers of a [`REMOVE_AFTER`] message's body; entries of an unknown kind are left
/// out (never removed on a guess).
fn parse(body: &[u8]) -> Vec<Leftover> {
    use std::os::unix::ffi::OsStrExt;
    body.split(|b| *b == 0)
        .filter_map(|entry| {
            let (&kind, path) = entry.split_first()?;
            let path = PathBuf::from(std::ffi::OsStr::from_bytes(path));
            (!path.as_os_str().is_empty()).then_some(())?;
            match kind {
                b'c' => Some(Leftover::Cgroup(path)),
                b'C' => Some(Leftover::StaleCgroups(path)),
                b'h' | b'H' => Some(Leftover::Home {
                    dir: path,
                    unmount: kind == b'H',
                }),
                b's' => Some(Leftover::StaleHomes(path)),
                _ => None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leftovers_are_read_back_as_sent_and_an_unknown_kind_is_left_out() {
        let sent = vec![
            Leftover::Cgroup(PathBuf::from("/sys/fs/cgroup/pids/executor-7-ns1")),
            Leftover::StaleCgroups(PathBuf::from("/sys/fs/cgroup/unified/a b")),
            Leftover::Home {
                dir: PathBuf::from("/tmp/executor-homes-0/executor-home-7-ns1-00"),
                unmount: false,
            },
            Leftover::Home {
                dir: PathBuf::from("/tmp/h"),
                unmount: true,
            },
            Leftover::StaleHomes(PathBuf::from("/tmp/executor-homes-0")),
        ];
        let message = encode(&sent);
        assert_eq!(message[0], REMOVE_AFTER);
        assert_eq!(parse(&message[1..]), sent);
        assert_eq!(parse(b""), Vec::<Leftover>::new());
        // An unknown kind, an empty path: nothing to remove.
        assert_eq!(
            parse(b"x/tmp/a\0c\0c/tmp/b\0"),
            vec![Leftover::Cgroup(PathBuf::from("/tmp/b"))]
        );
    }
}
