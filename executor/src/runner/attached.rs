//! Protocol 1.1's processes and file operations: a command whose stdio is one descriptor the
//! daemon keeps talking to (a socket, or a terminal's master), and whose output goes into a
//! bounded buffer that clients read by offset, instead of being captured for one result.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use crate::budget::{Evictable, Held, Owner};

/// Size of one read from the process's descriptor.
const READ_CHUNK: usize = 64 * 1024;

/// What the runner needs for an attached command: the payload's end of its stdio, our read
/// end, where the output goes, the signals to pass on, and whom to tell it started.
pub struct Attached {
    pub theirs: OwnedFd,
    pub output: Box<dyn AsyncRead + Send + Unpin>,
    pub ring: Arc<OutputRing>,
    pub signals: mpsc::Receiver<i32>,
    pub started: Option<oneshot::Sender<()>>,
}

/// A process's output: the last `cap` bytes, addressed by their offset in the whole stream.
///
/// `drop_oldest` (processes): new output pushes the oldest out, and a reader learns how much
/// it missed. Otherwise (file operations) the buffer is a bounded queue: the writer waits for
/// room, which a read from an offset makes by releasing what lies before it, so a download
/// never holds more than `cap` bytes in the daemon.
pub struct OutputRing {
    state: Mutex<RingState>,
    changed: watch::Sender<u64>,
    cap: usize,
    drop_oldest: bool,
    /// Cancelled when nobody will read any more (the process was forgotten, the session
    /// ended): the pump stops.
    pub discarded: CancellationToken,
    /// What the ring holds, counted in its client's memory budget (`None`: not counted).
    held: Option<Held>,
}

#[derive(Default)]
struct RingState {
    buf: VecDeque<u8>,
    /// Offset of `buf[0]` in the whole output.
    start: u64,
    eof: bool,
}

/// One read from the ring.
#[derive(Debug, Clone, PartialEq)]
pub struct Slice {
    pub offset: u64,
    pub data: Vec<u8>,
    pub next_offset: u64,
    pub dropped: u64,
    pub eof: bool,
}

impl OutputRing {
    pub fn new(cap: usize, drop_oldest: bool) -> Arc<Self> {
        Self::kept_for(cap, drop_oldest, None)
    }

    /// A ring whose bytes count against `owner`'s memory budget. A process's ring (dropping
    /// the oldest) keeps what the budget grants, and the budget may drop its oldest bytes to
    /// make room for others; a bounded queue is bounded by its own `cap` and counted.
    pub fn kept_for(cap: usize, drop_oldest: bool, owner: Option<&Owner>) -> Arc<Self> {
        Arc::new_cyclic(|me: &std::sync::Weak<Self>| {
            let held = owner.map(|owner| {
                if drop_oldest {
                    let me: std::sync::Weak<dyn Evictable> = me.clone();
                    owner.hold_evictable(me)
                } else {
                    owner.hold()
                }
            });
            Self {
                state: Mutex::new(RingState::default()),
                changed: watch::channel(0).0,
                cap: cap.max(1),
                drop_oldest,
                discarded: CancellationToken::new(),
                held,
            }
        })
    }

    fn lock(&self) -> MutexGuard<'_, RingState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Add output, dropping the oldest past `cap` (and past what the memory budget grants).
    fn push_dropping(&self, data: &[u8]) {
        let granted = match &self.held {
            Some(held) => {
                held.owner().output_arrived(data.len() as u64);
                let len = self.lock().buf.len();
                let want = (len + data.len()).min(self.cap).saturating_sub(len);
                held.grow(want as u64) as usize
            }
            None => data.len(),
        };
        let release = {
            let mut state = self.lock();
            // The budget may have dropped some of ours meanwhile: what we may hold now.
            let len = state.buf.len();
            let allowed = (len + granted).min(self.cap);
            // Room first, then the newest bytes: the buffer never grows past `cap` (a deque
            // grown past it would keep twice its bytes of capacity).
            let keep_old = allowed.saturating_sub(data.len()).min(len);
            state.buf.drain(..len - keep_old);
            let take = data.len().min(allowed - keep_old);
            state.buf.extend(&data[data.len() - take..]);
            state.start += (len - keep_old + data.len() - take) as u64;
            len + granted - state.buf.len()
        };
        if let Some(held) = &self.held {
            held.shrink(release as u64);
        }
    }

    /// Add output. A bounded queue waits for room (or for the ring to be discarded).
    pub async fn push(&self, mut data: &[u8]) {
        while !data.is_empty() {
            if self.drop_oldest {
                self.push_dropping(data);
                data = &[];
            } else {
                // The one writer: the room only grows (a read releases) until we extend.
                let take = self
                    .cap
                    .saturating_sub(self.lock().buf.len())
                    .min(data.len());
                // Bounded by `cap` already: counted (before a read can release them), never
                // refused.
                if let Some(held) = &self.held {
                    held.force(take as u64);
                }
                self.lock().buf.extend(&data[..take]);
                data = &data[take..];
            }
            self.bump();
            if data.is_empty() {
                break;
            }
            // Subscribed after our own change, then the room looked at again: a read that
            // made room before this is seen here, one after it wakes us. (Subscribed before
            // and marked seen after our change, a read's change in between was taken for
            // ours: writer and reader both waited, until the reader's deadline.)
            let mut changed = self.changed.subscribe();
            if self.lock().buf.len() < self.cap {
                continue;
            }
            tokio::select! {
                _ = changed.changed() => {}
                () = self.discarded.cancelled() => return,
            }
        }
    }

    /// The output has ended. What is kept shrinks to its size (a ring that grew by doubling
    /// would otherwise hold twice its bytes for as long as the ended process is listed).
    pub fn close(&self) {
        {
            let mut state = self.lock();
            state.eof = true;
            state.buf.shrink_to_fit();
        }
        // What an ended process kept is the first to go when a budget is full.
        if let Some(held) = &self.held {
            held.ended();
        }
        self.bump();
    }

    /// Up to `max` bytes from `offset`. In a bounded queue, asking from `offset` releases
    /// everything before it.
    pub fn read(&self, offset: u64, max: usize) -> Slice {
        let mut state = self.lock();
        let end = state.start + state.buf.len() as u64;
        let mut released = 0;
        if !self.drop_oldest && offset > state.start {
            released = (offset.min(end) - state.start) as usize;
            state.buf.drain(..released);
            state.start += released as u64;
        }
        let from = offset.clamp(state.start, end);
        let dropped = state.start.saturating_sub(offset);
        let skip = (from - state.start) as usize;
        let take = max.min(state.buf.len() - skip);
        let data: Vec<u8> = state.buf.range(skip..skip + take).copied().collect();
        let next_offset = from + take as u64;
        let eof = state.eof && next_offset == end;
        drop(state);
        if let Some(held) = &self.held {
            held.shrink(released as u64);
        }
        if !self.drop_oldest {
            self.bump();
        }
        Slice {
            offset: from,
            data,
            next_offset,
            dropped,
            eof,
        }
    }

    /// Wait until there is output after `offset` or the output has ended, for at most `wait`.
    pub async fn wait_for(&self, offset: u64, wait: Duration) {
        let mut changed = self.changed.subscribe();
        let deadline = tokio::time::sleep(wait);
        tokio::pin!(deadline);
        loop {
            {
                let state = self.lock();
                if state.eof || state.start + state.buf.len() as u64 > offset {
                    return;
                }
            }
            tokio::select! {
                res = changed.changed() => if res.is_err() { return },
                () = &mut deadline => return,
            }
        }
    }

    /// Bytes written so far.
    pub fn total(&self) -> u64 {
        let state = self.lock();
        state.start + state.buf.len() as u64
    }
}

impl Evictable for OutputRing {
    /// Called by the budget (under its lock): drop up to `want` of the oldest bytes. A reader
    /// from before them learns how many it missed (`dropped`).
    fn evict(&self, want: u64) -> u64 {
        let mut state = self.lock();
        let n = state
            .buf
            .len()
            .min(usize::try_from(want).unwrap_or(usize::MAX));
        state.buf.drain(..n);
        state.start += n as u64;
        // The ring gives its memory back, not only its bytes: an ended one all of it, a
        // running one what it would not fill again soon (it grows back by doubling).
        if state.eof || state.buf.capacity() > 2 * state.buf.len() {
            state.buf.shrink_to_fit();
        }
        drop(state);
        if let Some(held) = &self.held {
            held.evicted(n as u64);
        }
        n as u64
    }
}

/// Copy `from` into `ring` until end-of-file, an error, or the ring is discarded.
pub async fn pump(mut from: impl AsyncRead + Unpin, ring: Arc<OutputRing>) {
    let mut chunk = vec![0u8; READ_CHUNK];
    loop {
        let n = tokio::select! {
            read = from.read(&mut chunk) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            },
            () = ring.discarded.cancelled() => break,
        };
        ring.push(&chunk[..n]).await;
    }
    ring.close();
}

/// A pseudo-terminal's master, for tokio: read and write without blocking a worker thread.
/// After the last process holding the terminal closes it, reads fail with EIO: end of file.
///
/// Made by the daemon (`open`: the host's devpts), or by the payload in its sandbox's own
/// devpts and handed back over a socket (`made_by_payload`, then `receive`): until it
/// arrives, reads and writes wait and a resize is kept for it; if it never comes (the set-up
/// failed), reads end and writes fail.
#[derive(Clone)]
pub struct PtyMaster(Arc<Master>);

struct Master {
    /// The master once known; `None` inside when it will never come.
    fd: std::sync::OnceLock<Option<AsyncFd<OwnedFd>>>,
    /// Reads and writes waiting for it.
    waiting: Mutex<Vec<std::task::Waker>>,
    /// The size it is to have (rows, cols).
    size: Mutex<(u16, u16)>,
}

impl PtyMaster {
    fn new(rows: u16, cols: u16) -> Self {
        Self(Arc::new(Master {
            fd: std::sync::OnceLock::new(),
            waiting: Mutex::new(Vec::new()),
            size: Mutex::new((rows, cols)),
        }))
    }

    /// A new terminal of `rows` x `cols`: our master and the payload's end (close-on-exec
    /// both: the payload's end travels by SCM_RIGHTS, not by inheritance).
    pub fn open(rows: u16, cols: u16) -> io::Result<(Self, OwnedFd)> {
        let pty = nix::pty::openpty(None, None)?;
        nix::fcntl::fcntl(
            &pty.slave,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )?;
        let master = Self::new(rows, cols);
        master.bind(pty.master)?;
        Ok((master, pty.slave))
    }

    /// A terminal the payload makes in its sandbox's own devpts (so that its programs find
    /// it there by name): the payload's end is a socket, on which it sends the master back;
    /// [`receive`](Self::receive) takes it on `ours`.
    pub fn made_by_payload(
        rows: u16,
        cols: u16,
    ) -> io::Result<(Self, OwnedFd, std::os::unix::net::UnixStream)> {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
        ours.set_nonblocking(true)?;
        Ok((Self::new(rows, cols), theirs.into(), ours))
    }

    /// Take the master the payload sends on `ours`, give it its size, and answer one byte:
    /// the payload starts its command only then, so the command sees the size asked for.
    pub async fn receive(self, ours: std::os::unix::net::UnixStream) {
        use tokio::io::{AsyncWriteExt, Interest};
        let got = async {
            let ours = tokio::net::UnixStream::from_std(ours)?;
            let fd = loop {
                ours.readable().await?;
                let mut buf = [0u8; 1];
                match ours.try_io(Interest::READABLE, || {
                    sandbox::spawner::receive_fds(ours.as_fd(), &mut buf)
                }) {
                    Ok(Some((_, fds))) => break fds.into_iter().next(),
                    Ok(None) => break None,
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => continue,
                    Err(err) => return Err(err),
                }
            };
            let Some(fd) = fd else {
                return Err(io::Error::other("the payload made no terminal"));
            };
            self.bind(fd)?;
            let mut ours = ours;
            ours.write_all(b"k").await?;
            Ok::<(), io::Error>(())
        };
        if let Err(err) = got.await {
            tracing::debug!("the payload's terminal did not come: {err}");
            self.settle(None);
        }
    }

    /// Make `fd` the master: non-blocking, sized, registered with tokio.
    fn bind(&self, fd: OwnedFd) -> io::Result<()> {
        nix::fcntl::fcntl(
            &fd,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )?;
        nix::fcntl::fcntl(
            &fd,
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
        )?;
        let (rows, cols) = *lock(&self.0.size);
        sandbox::sys::set_window_size(fd.as_fd(), rows, cols)?;
        self.settle(Some(register_async(fd)?));
        Ok(())
    }

    fn settle(&self, fd: Option<AsyncFd<OwnedFd>>) {
        let _ = self.0.fd.set(fd);
        for waker in lock(&self.0.waiting).drain(..) {
            waker.wake();
        }
    }

    /// The master, once it is there (`None`: it never will be).
    fn poll_master(&self, cx: &mut Context<'_>) -> Poll<Option<&AsyncFd<OwnedFd>>> {
        if let Some(fd) = self.0.fd.get() {
            return Poll::Ready(fd.as_ref());
        }
        lock(&self.0.waiting).push(cx.waker().clone());
        // Set between the first look and the registration: the wake may have been missed.
        match self.0.fd.get() {
            Some(fd) => Poll::Ready(fd.as_ref()),
            None => Poll::Pending,
        }
    }

    /// The master for an ioctl; an error while the payload has not handed it over yet.
    pub fn fd(&self) -> io::Result<BorrowedFd<'_>> {
        match self.0.fd.get() {
            Some(Some(fd)) => Ok(fd.get_ref().as_fd()),
            _ => Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "the terminal is not made yet",
            )),
        }
    }

    /// Give the terminal a new size, now or when it comes.
    pub fn resize(&self, rows: u16, cols: u16) -> io::Result<()> {
        *lock(&self.0.size) = (rows, cols);
        match self.0.fd.get() {
            Some(Some(fd)) => sandbox::sys::set_window_size(fd.get_ref().as_fd(), rows, cols),
            // Not there yet: `bind` applies the size kept above.
            _ => Ok(()),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl AsyncRead for PtyMaster {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let Some(master) = ready!(self.poll_master(cx)) else {
            return Poll::Ready(Ok(()));
        };
        loop {
            let mut guard = ready!(master.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard
                .try_io(|fd| nix::unistd::read(fd.get_ref(), unfilled).map_err(io::Error::from))
            {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                // Every process holding the terminal is gone.
                Ok(Err(err)) if err.raw_os_error() == Some(libc::EIO) => {
                    return Poll::Ready(Ok(()))
                }
                Ok(Err(err)) => return Poll::Ready(Err(err)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for PtyMaster {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let Some(master) = ready!(self.poll_master(cx)) else {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        };
        loop {
            let mut guard = ready!(master.poll_write_ready(cx))?;
            match guard.try_io(|fd| nix::unistd::write(fd.get_ref(), data).map_err(io::Error::from))
            {
                Ok(result) => return Poll::Ready(result),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Register a descriptor we own with tokio's reactor (a PTY master, which tokio's typed
/// wrappers do not cover). `AsyncFd::register` is an `unsafe fn`: the runtime crate's
/// `sys::register_owned` calls it, keeping its promise (an owned descriptor stays open and
/// the same while registered), so that the daemon holds no `unsafe`.
fn register_async(fd: OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    sandbox::sys::register_owned(fd, AsyncFd::<OwnedFd>::register).map_err(|err| err.into_parts().1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_ring_that_drops_says_how_much_a_reader_missed() {
        let ring = OutputRing::new(4, true);
        ring.push(b"abcdef").await;
        let s = ring.read(0, 100);
        assert_eq!(
            (s.offset, s.data.as_slice(), s.dropped),
            (2, &b"cdef"[..], 2)
        );
        assert_eq!(s.next_offset, 6);
        assert!(!s.eof);
        ring.close();
        let s = ring.read(6, 100);
        assert!(s.eof && s.data.is_empty() && s.dropped == 0);
    }

    /// What a ring holds is what it counts in the budget, whatever reads and drops happen
    /// meanwhile: a drained queue counts nothing, a process's ring its bytes kept.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_ring_counts_exactly_what_it_holds_in_the_budget() {
        let budget = crate::budget::MemoryBudget::new(1 << 20, None, None);
        let owner = budget.owner("c", Some(100));
        let queue = OutputRing::kept_for(16, false, Some(&owner));
        let writer = tokio::spawn({
            let queue = queue.clone();
            async move {
                for chunk in [7u8; 100_000].chunks(61) {
                    queue.push(chunk).await;
                }
                queue.close();
            }
        });
        let mut offset = 0;
        loop {
            queue.wait_for(offset, Duration::from_secs(30)).await;
            let s = queue.read(offset, 7);
            offset = s.next_offset;
            if s.eof {
                break;
            }
        }
        writer.await.unwrap();
        assert_eq!(offset, 100_000);
        // The last slice stays in the queue until a read from past it releases it.
        let _ = queue.read(offset, 0);
        assert_eq!(budget.used("c"), (0, 0), "a drained queue counts nothing");
        // A process's ring within the client's 100 bytes: the newest 100 kept, the rest
        // reported dropped.
        let ring = OutputRing::kept_for(1000, true, Some(&owner));
        ring.push(&[1u8; 250]).await;
        assert_eq!(budget.used("c"), (100, 100));
        let s = ring.read(0, 1000);
        assert_eq!((s.offset, s.data.len(), s.dropped), (150, 100, 150));
        drop((s, ring));
        assert_eq!(budget.used("c"), (0, 0), "a forgotten ring counts nothing");
    }

    #[tokio::test]
    async fn a_bounded_queue_waits_for_its_reader_and_loses_nothing() {
        let ring = OutputRing::new(3, false);
        let writer = tokio::spawn({
            let ring = ring.clone();
            async move {
                ring.push(b"0123456789").await;
                ring.close();
            }
        });
        let mut got = Vec::new();
        let mut offset = 0;
        loop {
            ring.wait_for(offset, Duration::from_secs(5)).await;
            let s = ring.read(offset, 2);
            assert_eq!(s.dropped, 0);
            got.extend_from_slice(&s.data);
            offset = s.next_offset;
            if s.eof {
                break;
            }
        }
        writer.await.unwrap();
        assert_eq!(got, b"0123456789");
    }

    /// A writer waiting for room and a reader waiting for bytes on two threads, many times
    /// over: a wake-up lost between them (a read's release seen as the writer's own change)
    /// would leave both waiting until the reader's deadline, far past the bound below (as a
    /// 50 MB download once stalled in CI).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bounded_queue_never_leaves_its_writer_and_reader_both_waiting() {
        let ring = OutputRing::new(16, false);
        let data: Vec<u8> = (0..400_000u32).map(|i| (i % 251) as u8).collect();
        let writer = tokio::spawn({
            let ring = ring.clone();
            let data = data.clone();
            async move {
                for chunk in data.chunks(61) {
                    ring.push(chunk).await;
                }
                ring.close();
            }
        });
        let reader = async {
            let mut got = Vec::with_capacity(data.len());
            let mut offset = 0;
            loop {
                ring.wait_for(offset, Duration::from_secs(60)).await;
                let s = ring.read(offset, 7);
                got.extend_from_slice(&s.data);
                offset = s.next_offset;
                if s.eof {
                    return got;
                }
            }
        };
        let got = tokio::time::timeout(Duration::from_secs(30), reader)
            .await
            .expect("the writer and the reader both waited");
        writer.await.unwrap();
        assert!(got == data, "the bytes arrived changed");
    }
}
