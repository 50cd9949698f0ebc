//! The messages on the fork server's sockets: the daemon's requests and the server's
//! answers (module docs of `spawner`), a worker's command descriptors, and an init's verdict.
//! All go over SOCK_SEQPACKET pairs: a message keeps its bounds and carries descriptors.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::sys::socket::{
    recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags,
    SockFlag, SockType,
};

use super::Leftover;
use crate::helper::Stdio;
use crate::sys;

/// First byte of a message to the server: what it asks for.
pub(super) const RUN: u8 = 0;
pub(super) const RUN_AND_WARM: u8 = 1;
pub(super) const DISMISS_IDLE: u8 = 2;
/// What a one-shot run leaves, to remove after it (`one_shot::Leftover`): for each, a kind's
/// byte and a NUL-terminated path.
pub(super) const REMOVE_AFTER: u8 = 3;

/// A connected pair of close-on-exec SOCK_SEQPACKET sockets: what the fork server talks to
/// the daemon, its workers and its helpers over (a message keeps its bounds and carries
/// descriptors).
pub(super) fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )?)
}

/// One request of the daemon.
pub(super) struct Request {
    pub(super) warm: bool,
    pub(super) template: Vec<u8>,
    pub(super) stdio: [OwnedFd; 3],
}

/// Init's last act: its verdict (`helper::verdict` flags) on `control`, with its network
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
pub(super) fn receive_verdict(control: &OwnedFd) -> Option<(u8, Option<OwnedFd>)> {
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

pub(super) fn three(fds: Vec<OwnedFd>) -> io::Result<[OwnedFd; 3]> {
    <[OwnedFd; 3]>::try_from(fds)
        .map_err(|_| io::Error::other("a message without three descriptors"))
}

/// What the daemon asks of the server.
pub(super) enum Message {
    Run(Request),
    DismissIdle,
    RemoveAfter(Vec<Leftover>),
}

/// One message of the daemon, or `None` at end-of-file.
pub(super) fn receive(sock: &OwnedFd, buf: &mut [u8]) -> io::Result<Option<Message>> {
    let Some((bytes, fds)) = receive_fds(sock.as_fd(), buf)? else {
        return Ok(None);
    };
    match buf[..bytes].split_first() {
        Some((&DISMISS_IDLE, [])) if fds.is_empty() => Ok(Some(Message::DismissIdle)),
        Some((&REMOVE_AFTER, leftovers)) if fds.is_empty() => Ok(Some(Message::RemoveAfter(
            super::one_shot::parse(leftovers),
        ))),
        Some((&flag @ (RUN | RUN_AND_WARM), template)) => Ok(Some(Message::Run(Request {
            warm: flag == RUN_AND_WARM,
            template: template.to_vec(),
            stdio: three(fds)?,
        }))),
        _ => Err(io::Error::other("a malformed request")),
    }
}
