//! The only `unsafe` code of the executor and its sandbox runtime: thin wrappers over syscalls that nix does not expose
//! safely. Each block states why it is sound and checks errno at once.
#![allow(unsafe_code)]

use std::io;

mod process;

pub use process::*;

/// Mark every descriptor above stderr close-on-exec, so nothing the daemon or the helper holds
/// can leak into a command (the class of bug behind runc's CVE-2024-21626).
pub fn cloexec_fds_above_stderr() -> io::Result<()> {
    // The raw syscall rather than libc's wrapper: musl has none, and glibc's is a plain
    // syscall too (Linux 5.11+ for CLOSE_RANGE_CLOEXEC; older kernels answer ENOSYS/EINVAL).
    // SAFETY: close_range(2) with CLOSE_RANGE_CLOEXEC only sets a flag on descriptors in the
    // range; it reads and writes no memory of ours and closes nothing that Rust code owns.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    // An older kernel: one descriptor at a time, from /proc/self/fd.
    for fd in open_fds_above_stderr()? {
        // SAFETY: F_SETFD with FD_CLOEXEC only sets a flag on the descriptor (a plain
        // integer argument); one closed meanwhile (the listing's own) answers EBADF.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    Ok(())
}

/// The descriptors above stderr this process holds, from /proc/self/fd (the listing's own
/// descriptor included: it is closed by the time the caller uses the list).
fn open_fds_above_stderr() -> io::Result<Vec<std::os::fd::RawFd>> {
    Ok(std::fs::read_dir("/proc/self/fd")?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<std::os::fd::RawFd>().ok())
        .filter(|fd| *fd > 2)
        .collect())
}

/// Close every descriptor above stderr but those in `keep`: a worker forked by the fork
/// server must not hold the daemon's socket, the other workers' sockets or their network
/// namespaces.
pub fn close_fds_above_stderr_except(keep: &[std::os::fd::RawFd]) {
    let mut kept: Vec<libc::c_uint> = keep
        .iter()
        .filter(|fd| **fd > 2)
        .map(|fd| *fd as libc::c_uint)
        .collect();
    kept.sort_unstable();
    kept.dedup();
    let mut failed = false;
    let mut first: libc::c_uint = 3;
    for last in kept.iter().map(|fd| Some(*fd)).chain([None]) {
        let (end, next) = match last {
            Some(fd) => (fd.checked_sub(1), fd.saturating_add(1)),
            None => (Some(libc::c_uint::MAX), libc::c_uint::MAX),
        };
        if let Some(end) = end.filter(|end| first <= *end) {
            // SAFETY: close_range(2) closes descriptors in the range. The caller is a freshly
            // forked single-threaded child that owns no Rust object wrapping those
            // descriptors any more (it never returns to code that would use them).
            let rc = unsafe { libc::syscall(libc::SYS_close_range, first, end, 0 as libc::c_uint) };
            failed |= rc != 0;
        }
        first = next;
    }
    if failed {
        // Before Linux 5.9: one at a time.
        for fd in open_fds_above_stderr().unwrap_or_default() {
            if !keep.contains(&fd) {
                // SAFETY: as above; a descriptor already closed answers EBADF, harmlessly.
                unsafe { libc::close(fd) };
            }
        }
    }
}

/// `open_tree(2)` flags (linux/mount.h, Linux 5.2): a detached copy of the mount, its
/// descriptor closed on exec.
const OPEN_TREE_CLONE: libc::c_uint = 1;
const OPEN_TREE_CLOEXEC: libc::c_uint = libc::O_CLOEXEC as libc::c_uint;
/// `move_mount(2)`: the source is the descriptor itself.
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;

fn open_tree(
    dirfd: libc::c_int,
    path: &std::ffi::CStr,
    flags: libc::c_uint,
) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: open_tree(2) reads the NUL-terminated path (valid for the call) and returns a new
    // descriptor or -1; nothing else of ours is touched.
    let rc = unsafe { libc::syscall(libc::SYS_open_tree, dirfd, path.as_ptr(), flags) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just returned to us, owned by nothing else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(rc as libc::c_int) })
}

/// A detached copy of the mount at `path` (not of its submounts), to attach elsewhere with
/// [`attach_mount`], even in another mount namespace: what a bind mount by path cannot do
/// once the source's namespace is left.
pub fn clone_mount(path: &std::path::Path) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    open_tree(libc::AT_FDCWD, &path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)
}

/// [`clone_mount`] of what `fd` (an `O_PATH` descriptor) names.
pub fn clone_mount_of(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::AsRawFd;
    open_tree(
        fd.as_raw_fd(),
        c"",
        OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | libc::AT_EMPTY_PATH as libc::c_uint,
    )
}

/// Attach the detached mount `mount` ([`clone_mount`]) at `target` of our mount namespace.
pub fn attach_mount(mount: &std::os::fd::OwnedFd, target: &std::path::Path) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::ffi::OsStrExt;
    let target = std::ffi::CString::new(target.as_os_str().as_bytes())?;
    // SAFETY: move_mount(2) reads the two NUL-terminated paths (valid for the call) and the
    // descriptor, which is open; it changes our mount namespace only.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            mount.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The kernel's landlock ABI version; 0 when landlock is not built in or not enabled at boot
/// (Documentation/userspace-api/landlock.rst, "Landlock ABI versions").
pub fn landlock_abi() -> u32 {
    const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;
    // SAFETY: with a null attribute pointer, size 0 and the VERSION flag, landlock_create_ruleset
    // reads no memory and returns the ABI version (or fails with ENOSYS/EOPNOTSUPP).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    u32::try_from(rc).unwrap_or(0)
}

/// Leave a forked child at once, without running exit handlers or flushing the parent's
/// buffers a second time.
pub fn exit_child(code: i32) -> ! {
    // SAFETY: _exit(2) never returns and touches no memory of ours.
    unsafe { libc::_exit(code) }
}

/// Set the loopback interface up in the current network namespace (a new one starts with
/// `lo` down), so that servers a command starts on 127.0.0.1 are reachable from it.
pub fn loopback_up() -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let sock = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Inet,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // ioctl's request argument is an unsigned long in glibc and an int in musl; `Ioctl` names
    // the one of this target (both values fit either type).
    let (get_flags, set_flags) = (
        libc::SIOCGIFFLAGS as libc::Ioctl,
        libc::SIOCSIFFLAGS as libc::Ioctl,
    );
    // SAFETY: SIOCGIFFLAGS reads the flags of the interface named in `req` into `req`; the
    // pointer is valid for the call and the socket is open.
    if unsafe { libc::ioctl(sock.as_raw_fd(), get_flags, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: ifru_flags is the union member SIOCGIFFLAGS just filled in.
    unsafe { req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    // SAFETY: SIOCSIFFLAGS reads `req`, which is valid for the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), set_flags, &req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Fail unless the calling process has exactly one thread: forking or changing credentials
/// in a multi-threaded process would leave other threads behind with the old state.
pub fn assert_single_threaded() -> io::Result<()> {
    match threads()? {
        1 => Ok(()),
        n => Err(io::Error::other(format!(
            "the sandbox helper must be single-threaded, has {n} threads"
        ))),
    }
}

/// How many threads the calling process has: the entries of /proc/self/task (a third of the
/// cost of generating /proc/self/status for its `Threads:` line, 8 against 22 us here).
pub fn threads() -> io::Result<usize> {
    Ok(std::fs::read_dir("/proc/self/task")?.count())
}

/// Give the payload the signal state a fresh process expects: every disposition back to its
/// default and nothing blocked. exec keeps ignored signals and the mask, and the helper inherits
/// Rust's ignored SIGPIPE (and whatever its own parent ignored) and blocks SIGCHLD for its
/// signalfd; a shell started with SIGPIPE ignored makes `yes | head` print "Broken pipe"
/// forever instead of stopping.
pub fn reset_signals() -> io::Result<()> {
    /// The kernel's struct sigaction on x86_64 (glibc's wrapper refuses its reserved signals 32
    /// and 33, so the raw syscall is used for all of them alike).
    #[repr(C)]
    struct KernelSigaction {
        handler: usize,
        flags: u64,
        restorer: usize,
        mask: u64,
    }
    let default = KernelSigaction {
        handler: libc::SIG_DFL,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    for signo in 1..=64 {
        if signo == libc::SIGKILL || signo == libc::SIGSTOP {
            continue;
        }
        // SAFETY: rt_sigaction reads `default` (valid for the call, the kernel's layout, an
        // 8-byte mask) and writes nothing back (old action NULL). SIG_DFL installs no code.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                signo,
                &default as *const KernelSigaction,
                std::ptr::null_mut::<KernelSigaction>(),
                8usize,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    nix::sys::signal::SigSet::empty()
        .thread_set_mask()
        .map_err(io::Error::from)
}

/// Keep the daemon's memory flat: glibc raises its mmap threshold after freeing a large block
/// and then keeps such blocks (1 MiB output buffers) in the heap, and gives every thread an
/// arena. Fixed thresholds return large buffers to the kernel when freed, and two arenas are
/// plenty for a daemon that mostly waits. Measured by the benchmark: idle RSS after output
/// floods went from about 13 MiB to under 8 MiB.
pub fn tune_allocator() {
    // SAFETY: mallopt only changes allocator parameters; called before any thread exists.
    // A parameter glibc refuses (returns 0) just keeps its default.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 * 1024);
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// rmdir(2) of a path made beforehand, allocating nothing (after a child sharing our memory
/// died where it may have held the allocator).
pub fn remove_dir_made(path: &std::ffi::CStr) -> io::Result<()> {
    // SAFETY: rmdir(2) reads the NUL-terminated path, valid for the call.
    if unsafe { libc::rmdir(path.as_ptr()) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Make the calling process's memory non-dumpable: no core dump of it, and `/proc/PID/mem`,
/// `/proc/PID/environ` and ptrace closed to all but CAP_SYS_PTRACE. A child forked from us, or
/// sharing our memory, is too, until it execs (the kernel decides anew then).
pub fn set_non_dumpable() -> io::Result<()> {
    // SAFETY: prctl(2) with PR_SET_DUMPABLE takes plain integers.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Take ownership of a descriptor received with SCM_RIGHTS.
pub fn own_received_fd(fd: std::os::fd::RawFd) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: the kernel installed this descriptor in our table for this message alone;
    // nothing else owns it, so taking ownership (and closing it once) is sound.
    unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }
}

/// Point stdin, stdout and (with `stderr`) stderr at /dev/null, so that no child inherits
/// what they were (a socket, the daemon's pipes). Best effort: without /dev/null they stay.
pub fn devnull_stdio(stderr: bool) {
    if let Ok(devnull) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        let _ = nix::unistd::dup2_stdin(&devnull);
        let _ = nix::unistd::dup2_stdout(&devnull);
        if stderr {
            let _ = nix::unistd::dup2_stderr(&devnull);
        }
    }
}

/// Make the terminal `fd` the caller's controlling terminal (the caller leads a session that
/// has none): what a shell on a PTY needs for job control and Ctrl-C.
pub fn set_controlling_terminal(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: TIOCSCTTY takes an int argument (0: do not steal another session's terminal);
    // no memory is passed.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSCTTY, 0 as libc::c_int) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Set a terminal's size (on the PTY's master: the kernel tells the foreground group with
/// SIGWINCH).
pub fn set_window_size(fd: std::os::fd::BorrowedFd<'_>, rows: u16, cols: u16) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let size = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `struct winsize`, which `size` is, for the call's duration.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &size) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Send `signal` to the foreground process group of the terminal whose master is `fd`
/// (TIOCSIG, Linux 2.6.25): what typing Ctrl-C does, without depending on the line discipline's
/// settings.
pub fn signal_foreground(fd: std::os::fd::BorrowedFd<'_>, signal: i32) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // TIOCSIG is _IOW('T', 0x36, int); the libc crate does not name it.
    const TIOCSIG: libc::c_ulong = 0x4004_5436;
    // SAFETY: TIOCSIG takes the signal number as an int argument; no memory is passed.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), TIOCSIG as _, signal as libc::c_int) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Hand a descriptor we own to `register`, an `unsafe fn` whose one safety condition is that
/// the descriptor is open and stays the same open descriptor for as long as what it returns
/// holds it: tokio's `AsyncFd::register`, with which the daemon registers a PTY master with
/// its reactor (tokio's typed wrappers do not cover one). The tokio part stays in the daemon;
/// the promise is kept here, which holds no other `unsafe`. Pass no function with any other
/// condition.
pub fn register_owned<R>(
    fd: std::os::fd::OwnedFd,
    register: unsafe fn(std::os::fd::OwnedFd) -> R,
) -> R {
    // SAFETY: an OwnedFd is open, is closed only when dropped (by what `register` returns,
    // which now owns it), and its as_raw_fd always returns the same descriptor: the condition
    // `register` states (see above).
    unsafe { register(fd) }
}

/// Whose nice value [`set_nice`] sets.
#[derive(Clone, Copy)]
pub enum NiceOf {
    /// The calling process.
    Me,
    /// Process `pid`.
    Process(i32),
    /// Every process of the process group `pgid`.
    Group(i32),
}

/// Set a nice value. Lowering one needs CAP_SYS_NICE (the fork server's; a confined command
/// has none and cannot raise its own priority).
pub fn set_nice(of: NiceOf, nice: i32) -> io::Result<()> {
    let (which, who) = match of {
        NiceOf::Me => (libc::PRIO_PROCESS, 0),
        NiceOf::Process(pid) => (libc::PRIO_PROCESS, pid),
        NiceOf::Group(pgid) => (libc::PRIO_PGRP, pgid),
    };
    let who = libc::id_t::try_from(who).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: setpriority(2) takes three integers and touches no memory of ours.
    let rc = unsafe { libc::setpriority(which, who, nice) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The errno of a raw syscall (0 when it succeeds; what it returned, a descriptor say, is
/// closed), for the seccomp filter's tests.
#[cfg(test)]
pub fn syscall_errno(nr: libc::c_long, args: [libc::c_long; 3]) -> i32 {
    // SAFETY: the tests pass only numbers (a null pointer at most), never memory of ours for
    // the kernel to read or write.
    let ret = unsafe { libc::syscall(nr, args[0], args[1], args[2]) };
    if ret < 0 {
        return io::Error::last_os_error().raw_os_error().unwrap_or(0);
    }
    if nr == libc::SYS_socket {
        // SAFETY: the descriptor the kernel just gave us, closed once.
        unsafe { libc::close(ret as libc::c_int) };
    }
    0
}
