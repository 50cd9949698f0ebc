//! Making processes: fork, clones into a pid namespace or a cgroup, and a child that shares
//! our memory until its exec (`spawn_sharing_memory`), with what such a child does without
//! allocating (send descriptors, exec, and, for its parent, receive them).

use std::io;

use super::exit_child;

/// Result of [`fork`] as seen by the caller.
pub enum Forked {
    Parent(nix::unistd::Pid),
    Child,
}

/// fork(2) for the fork server (its workers, a root template's builder), for `executor run`'s
/// fork server, and for a payload's file operation.
///
/// Only single-threaded callers use it (the fork server and the processes it forks have one
/// thread; `spawner::fork_here` runs before the runtime exists), so the child inherits no
/// lock held by another thread and may allocate.
pub fn fork() -> io::Result<Forked> {
    // SAFETY: the caller is single-threaded (see above); nothing in the child can deadlock on
    // state another thread held at fork time.
    match unsafe { nix::unistd::fork() } {
        Ok(nix::unistd::ForkResult::Parent { child }) => Ok(Forked::Parent(child)),
        Ok(nix::unistd::ForkResult::Child) => Ok(Forked::Child),
        Err(errno) => Err(errno.into()),
    }
}

/// The stack of a child that shares our memory until it execs ([`spawn_sharing_memory`]):
/// mapped apart from everything of ours, with an inaccessible page below it, so that an
/// overflow faults instead of writing over our memory.
pub struct ChildStack {
    base: std::ptr::NonNull<libc::c_void>,
    len: usize,
}

/// The size of a [`ChildStack`]: what the payload's set-up needs (landlock's rules, the
/// command's JSON, its environment), with room to spare. Only the pages it touches are
/// ever backed by memory.
const CHILD_STACK: usize = 1 << 20;
/// Inaccessible pages below it: Rust probes its large frames, but C code (libc, the
/// allocator) does not, so a frame of up to this much cannot step over the guard.
const GUARD: usize = 64 << 10;

impl ChildStack {
    pub fn new() -> io::Result<Self> {
        let len = CHILD_STACK + GUARD;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches
        // nothing of ours; the result is checked against MAP_FAILED below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let stack = Self {
            base: std::ptr::NonNull::new(base).ok_or_else(|| io::Error::other("mmap gave null"))?,
            len,
        };
        // SAFETY: the guard page is the lowest page of the mapping just made, ours alone.
        if unsafe { libc::mprotect(base, GUARD, libc::PROT_NONE) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stack)
    }
}

impl Drop for ChildStack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of `len` bytes; nothing runs on it any more (the
        // child it was lent to has exec'd or exited before `spawn_sharing_memory` returned).
        unsafe { libc::munmap(self.base.as_ptr(), self.len) };
    }
}

/// What a child sharing our memory starts from, written at the top of its own stack (which we
/// never touch while it may run): the function to run, the descriptor to give it, and whether
/// it was born in the cgroup asked for.
struct Start<'a> {
    child: *mut (dyn FnMut(std::os::fd::BorrowedFd<'_>, bool) + 'a),
    done: std::os::fd::RawFd,
    placed: bool,
}

/// Start `child` in a new process that shares our memory (CLONE_VM), and wait until it is done
/// with it: until it has exec'd (its new address space in place) or exited. Nothing of our
/// address space is copied, faulted in again or torn down at its exec, as with posix_spawn.
/// Returns its pid and what it wrote on the pipe (up to `said.len()` bytes).
///
/// With `into`, the child is born in that cgroup2 directory (clone3 `CLONE_INTO_CGROUP`) where
/// the kernel and this architecture can; `child`'s second argument says whether it was (if
/// not, it must join the directory itself).
///
/// `watch`, a signalfd of our SIGCHLD, lets us see the child stopped while we wait (a stopped
/// child holds the pipe open for good): we kill it and say so, and where it ended meanwhile,
/// how.
///
/// The child gets the pipe's write end `done_w` (close-on-exec, so closed by its exec or
/// exit) and runs on `stack`, with a copy of our descriptor table, signal handlers and
/// credentials: what it changes of those stays its own, what it writes to memory is ours.
/// We close our copy of `done_w` and read `done` to its end, waiting in a plain pipe read
/// (not the uninterruptible wait of CLONE_VFORK, which would count every waiting sandbox in
/// the load average), and touch no other memory meanwhile. So `child` must leave our objects
/// as they are (read them, allocate its own, which we inherit), never give another process
/// the pipe's write end for long, and end by exec or exit (one that returns exits with 127).
/// The caller is single-threaded (nothing else could use the allocator while the child
/// does). It is the caller's to make sure the child is not killed half-way through an
/// allocation, or not to use the allocator after such a death.
pub fn spawn_sharing_memory(
    stack: &mut ChildStack,
    done: std::os::fd::BorrowedFd<'_>,
    done_w: std::os::fd::OwnedFd,
    said: &mut [u8],
    watch: Option<std::os::fd::BorrowedFd<'_>>,
    into: Option<std::os::fd::BorrowedFd<'_>>,
    child: &mut dyn FnMut(std::os::fd::BorrowedFd<'_>, bool),
) -> io::Result<Waited> {
    use std::os::fd::AsRawFd;
    extern "C" fn start(arg: *mut libc::c_void) -> libc::c_int {
        // SAFETY: `arg` points at the `Start` written at the top of our stack, which our
        // parent does not touch while we run; its `child` points at the caller's closure,
        // which outlives our use of it (the caller waits in `spawn_sharing_memory` until we
        // exec or exit), and nothing else calls it meanwhile.
        let (child, done, placed) = unsafe {
            let start = &*arg.cast::<Start<'_>>();
            (
                &mut *start.child,
                std::os::fd::BorrowedFd::borrow_raw(start.done),
                start.placed,
            )
        };
        // A panic ends the child here, by `_exit` (status 127): never by abort(), whose signal
        // musl sends to the thread id cached in the thread-local storage we share with our
        // parent (so to our parent, not to us); glibc asks the kernel.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| child(done, placed)));
        // It was to exec or exit; returning would end the clone in code of our parent's.
        exit_child(127)
    }
    let top = stack.len - std::mem::size_of::<Start<'_>>().next_multiple_of(64);
    let child = std::ptr::from_mut(child);
    // SAFETY: `top` is within the mapping (`len` bytes, far more than a `Start`), aligned to
    // 64 bytes, and nothing runs on the stack yet.
    let arg = unsafe { stack.base.as_ptr().cast::<u8>().add(top).cast::<Start>() };
    let write_start = |placed: bool| {
        // SAFETY: `arg` is within the mapping and aligned (above); no child runs on it yet
        // (a clone that failed started none).
        unsafe {
            arg.write(Start {
                child,
                done: done_w.as_raw_fd(),
                placed,
            })
        }
    };
    let mut rc = -1;
    if let Some(cgroup) = into {
        write_start(true);
        // SAFETY: clone_args is plain old data; all-zero is a valid value.
        let mut args: libc::clone_args = unsafe { std::mem::zeroed() };
        args.flags = libc::CLONE_VM as u64 | CLONE_INTO_CGROUP;
        args.exit_signal = libc::SIGCHLD as u64;
        args.cgroup = cgroup.as_raw_fd() as u64;
        // The child's stack: from the mapping's base up to `arg` (its stack pointer starts at
        // base + size, below the `Start`).
        args.stack = stack.base.as_ptr() as u64;
        args.stack_size = top as u64;
        // SAFETY: as for `libc::clone` below: the stack is ours and outlives the child's use
        // of it, `start` reads `arg` as written above; the kernel reads `args` (valid for the
        // call) and the cgroup descriptor, which is open.
        rc = unsafe { clone3_running(&args, start, arg.cast()) };
        let unable = [libc::ENOSYS, libc::E2BIG, libc::EINVAL, libc::EOPNOTSUPP];
        if rc < 0 && !unable.contains(&io::Error::last_os_error().raw_os_error().unwrap_or(0)) {
            return Err(io::Error::last_os_error());
        }
    }
    if rc < 0 {
        write_start(false);
        // SAFETY: the child's stack pointer starts below `arg` (stacks grow down on every
        // architecture we build for), within the mapping owned by `stack`, which outlives the
        // child's use of it: we return only after it exec'd or exited.
        rc = unsafe {
            libc::clone(
                start,
                arg.cast(),
                libc::CLONE_VM | libc::SIGCHLD,
                arg.cast(),
            )
        } as libc::c_long;
    }
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    let rc = rc as libc::c_int;
    drop(done_w);
    // Until end-of-file the child may be using our memory: plain syscalls on our stack and
    // nothing else (no allocation).
    let mut waited = Waited {
        pid: nix::unistd::Pid::from_raw(rc),
        said: 0,
        stopped: false,
        ended: None,
    };
    let mut scratch = [0u8; 128];
    loop {
        let mut fds = [
            libc::pollfd {
                fd: done.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: watch.map_or(-1, |w| w.as_raw_fd()),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: poll(2) on two pollfd structs of ours, valid for the call (a negative fd is
        // ignored).
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if ready < 0 {
            if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            // We cannot tell when the child is done with our memory: nothing of ours may run.
            exit_child(1);
        }
        if fds[1].revents != 0 {
            // SAFETY: read(2) into `scratch`, valid for its length: drains the signalfd.
            while unsafe { libc::read(fds[1].fd, scratch.as_mut_ptr().cast(), scratch.len()) } > 0 {
            }
            let mut status = 0;
            // SAFETY: waitpid(2) on our child, writing its status into `status`.
            let got = unsafe { libc::waitpid(rc, &mut status, libc::WNOHANG | libc::WUNTRACED) };
            if got == rc && libc::WIFSTOPPED(status) && !writer_gone(done) {
                // Stopped where it may hold our memory in any state: it never goes on.
                waited.stopped = true;
                // SAFETY: kill(2) of our own child, which is not reaped (a stopped one is
                // not), so its pid names it.
                unsafe { libc::kill(rc, libc::SIGKILL) };
            } else if got == rc && !libc::WIFSTOPPED(status) {
                waited.ended = nix::sys::wait::WaitStatus::from_raw(waited.pid, status).ok();
            }
        }
        if fds[0].revents != 0 {
            let room = if waited.said < said.len() {
                &mut said[waited.said..]
            } else {
                &mut scratch[..]
            };
            // SAFETY: read(2) into `room`, valid for its length; `done` is open.
            let got = unsafe { libc::read(done.as_raw_fd(), room.as_mut_ptr().cast(), room.len()) };
            match got {
                0 => break,
                got if got > 0 => {
                    if waited.said < said.len() {
                        waited.said += got as usize;
                    }
                }
                _ if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => {}
                _ => exit_child(1),
            }
        }
    }
    Ok(waited)
}

/// clone3(2) whose child runs `entry(arg)` on the stack `args` gives it and exits with what
/// that returns; the parent gets the child's pid or -1 (errno set). A child with its own stack
/// starts in the middle of the syscall instruction's caller, so the call and what the child
/// does after it are written out here: no compiled code of ours runs on the new stack
/// expecting a frame that is not there.
///
/// # Safety
/// `args` must describe a stack that stays mapped while the child runs on it, and `entry`
/// must be sound to call with `arg` on it (as for `libc::clone`).
#[cfg(target_arch = "x86_64")]
unsafe fn clone3_running(
    args: &libc::clone_args,
    entry: extern "C" fn(*mut libc::c_void) -> libc::c_int,
    arg: *mut libc::c_void,
) -> libc::c_long {
    let rc: libc::c_long;
    // SAFETY: the caller's contract above. In the parent this is one syscall (which clobbers
    // rcx and r11 only); the child, with rax 0, calls `entry` with `arg` from its own stack
    // (aligned to 16 bytes by the caller: `call` leaves it as the ABI expects at a function's
    // entry) and never comes back here.
    unsafe {
        std::arch::asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            "xor ebp, ebp",
            "mov rdi, r12",
            "call r13",
            "mov edi, eax",
            "mov eax, 60",
            "syscall",
            "ud2",
            "2:",
            inlateout("rax") libc::SYS_clone3 => rc,
            in("rdi") std::ptr::from_ref(args),
            in("rsi") std::mem::size_of::<libc::clone_args>(),
            in("r12") arg,
            in("r13") entry,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    if rc < 0 {
        // SAFETY: errno is this thread's; the raw syscall returned -errno.
        unsafe { *libc::__errno_location() = -rc as libc::c_int };
        return -1;
    }
    rc
}

/// Elsewhere the child is cloned with `libc::clone`, outside the cgroup, and joins it itself.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn clone3_running(
    _args: &libc::clone_args,
    _entry: extern "C" fn(*mut libc::c_void) -> libc::c_int,
    _arg: *mut libc::c_void,
) -> libc::c_long {
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = libc::ENOSYS };
    -1
}

/// Whether every write end of the pipe `done` is closed: a child stopped after that has
/// exec'd (its copy closed at its exec) and stopped as the command it now is, which is not
/// ours to take for a disturbance.
fn writer_gone(done: std::os::fd::BorrowedFd<'_>) -> bool {
    use std::os::fd::AsRawFd;
    let mut fd = libc::pollfd {
        fd: done.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll(2) on one pollfd struct of ours, valid for the call; no wait.
    let ready = unsafe { libc::poll(&mut fd, 1, 0) };
    ready > 0 && fd.revents & libc::POLLHUP != 0
}

/// How a child sharing our memory ([`spawn_sharing_memory`]) got done with it.
pub struct Waited {
    pub pid: nix::unistd::Pid,
    /// How many bytes of `said` it wrote on the pipe.
    pub said: usize,
    /// It was stopped (by a signal from someone else) before it was done, and we killed it.
    pub stopped: bool,
    /// Its end, where it exited (or was killed) and we reaped it while waiting.
    pub ended: Option<nix::sys::wait::WaitStatus>,
}

/// Receive up to three descriptors on `sock` without allocating (after a child sharing our
/// memory died where it may have held the allocator half-way): the last one received, which
/// is the status pipe of a command's descriptors as the fork server and a payload send them.
pub fn receive_last_fd(
    sock: std::os::fd::BorrowedFd<'_>,
    wait: bool,
) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let mut data = [0u8; 64];
    // Room for one SCM_RIGHTS message of three descriptors, aligned for cmsghdr.
    let mut control = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    // SAFETY: msghdr is plain old data; all-zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    let flags = libc::MSG_CMSG_CLOEXEC | if wait { 0 } else { libc::MSG_DONTWAIT };
    // SAFETY: recvmsg(2) into the buffers `msg` points at, all ours and valid for the call.
    if unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, flags) } <= 0 {
        return None;
    }
    let mut last = None;
    // SAFETY: the CMSG_* walk stays within `msg_controllen` bytes of `control`, which the
    // kernel filled in; each SCM_RIGHTS payload holds whole descriptors it installed for us,
    // owned by nothing else: each is taken once.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                let count = ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<libc::c_int>();
                for i in 0..count {
                    let fd = std::os::fd::OwnedFd::from_raw_fd(data.add(i).read_unaligned());
                    last = Some(fd);
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    last
}

/// Like [`fork`], but the child is pid 1 of a new pid namespace, born inside the cgroup open
/// as `cgroup` where one is given and the kernel can (clone3 with `CLONE_INTO_CGROUP`, Linux
/// 5.7). Returns whether it was placed there; where it was not (no clone3: before 5.3, or a
/// container's seccomp profile that answers ENOSYS), the child must join the cgroup itself.
pub fn fork_into_pid_namespace(
    cgroup: Option<std::os::fd::BorrowedFd<'_>>,
) -> io::Result<(Forked, bool)> {
    use std::os::fd::AsRawFd;
    let forked = |rc: libc::c_long| match rc {
        0 => Ok(Forked::Child),
        pid if pid > 0 => Ok(Forked::Parent(nix::unistd::Pid::from_raw(pid as i32))),
        _ => Err(io::Error::last_os_error()),
    };
    // SAFETY: clone_args is plain old data; all-zero is a valid value (no pidfd, no tid
    // pointers, no stack: a fork-like clone).
    let mut args: libc::clone_args = unsafe { std::mem::zeroed() };
    args.flags = libc::CLONE_NEWPID as u64;
    args.exit_signal = libc::SIGCHLD as u64;
    if let Some(cgroup) = cgroup {
        args.flags |= CLONE_INTO_CGROUP;
        args.cgroup = cgroup.as_raw_fd() as u64;
    }
    // SAFETY: as for `fork`: the caller is the single-threaded fork server (or helper).
    // clone3 without CLONE_VM and without a stack duplicates the process like fork(2); the
    // kernel reads `args` (valid for the call, its size passed) and the cgroup descriptor,
    // which is open.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args as *const libc::clone_args,
            std::mem::size_of::<libc::clone_args>(),
        )
    };
    match forked(rc) {
        Err(err)
            if matches!(
                err.raw_os_error(),
                Some(libc::ENOSYS | libc::E2BIG | libc::EOPNOTSUPP)
            ) || (cgroup.is_some() && err.raw_os_error() == Some(libc::EINVAL)) => {}
        other => return other.map(|f| (f, cgroup.is_some())),
    }
    // SAFETY: clone(2) with a null stack and no CLONE_VM duplicates the process like fork(2)
    // (the x86_64 argument order: flags, stack, parent tid, child tid, tls; none of the
    // pointers is used without the flags that ask for them). The caller is single-threaded.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_NEWPID | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    forked(rc).map(|f| (f, false))
}

/// `CLONE_INTO_CGROUP` (linux/sched.h, Linux 5.7): the child starts in the cgroup whose
/// directory descriptor `clone_args.cgroup` holds.
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// Send `data` and `fds` (SCM_RIGHTS, at most four) on `sock` without allocating (nix's
/// `sendmsg` builds its control buffer on the heap): what a payload sharing init's memory
/// sends after its last allocation. Never waits, never raises SIGPIPE.
pub fn send_fds_without_allocating(
    sock: std::os::fd::BorrowedFd<'_>,
    data: &[u8],
    fds: &[std::os::fd::RawFd],
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    if fds.len() > 4 {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // Room for one SCM_RIGHTS message of four descriptors, aligned for cmsghdr.
    let mut control = [0u64; 6];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr().cast_mut().cast(),
        iov_len: data.len(),
    };
    // SAFETY: msghdr is plain old data; all-zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    let bytes = std::mem::size_of_val(fds);
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE only computes a size.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(bytes as u32) } as _;
        // SAFETY: `control` holds at least CMSG_SPACE(16) bytes, so the first header and its
        // data fit; the data pointer is within it, and the descriptors are copied in whole.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(bytes as u32) as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(cmsg).cast::<libc::c_int>(),
                fds.len(),
            );
        }
    }
    // SAFETY: sendmsg(2) reads the buffers `msg` points at, all ours and valid for the call;
    // `iov_base` is only read.
    let sent = unsafe {
        libc::sendmsg(
            sock.as_raw_fd(),
            &msg,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A program ready to exec: its path and its argument and environment vectors, made before
/// (so that the exec, and what follows a failed one, allocates nothing).
pub struct Exec {
    path: std::ffi::CString,
    _strings: Vec<std::ffi::CString>,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
}

impl Exec {
    /// `None` where a string holds a NUL byte.
    pub fn new<'a>(
        path: &str,
        args: impl IntoIterator<Item = &'a str>,
        env: impl IntoIterator<Item = String>,
    ) -> Option<Self> {
        let path = std::ffi::CString::new(path).ok()?;
        let args: Vec<std::ffi::CString> = args
            .into_iter()
            .map(|a| std::ffi::CString::new(a).ok())
            .collect::<Option<_>>()?;
        let vars: Vec<std::ffi::CString> = env
            .into_iter()
            .map(|v| std::ffi::CString::new(v).ok())
            .collect::<Option<_>>()?;
        let vector = |strings: &[std::ffi::CString]| -> Vec<*const libc::c_char> {
            strings
                .iter()
                .map(|s| s.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect()
        };
        let (argv, envp) = (vector(&args), vector(&vars));
        let mut strings = args;
        strings.extend(vars);
        Some(Self {
            path,
            _strings: strings,
            argv,
            envp,
        })
    }

    /// execve(2); returns only on failure, with its errno.
    pub fn run(&self) -> nix::errno::Errno {
        // SAFETY: the path and both vectors are NUL-terminated and null-terminated, and the
        // strings they point at are owned by `self`, alive for the call.
        unsafe { libc::execve(self.path.as_ptr(), self.argv.as_ptr(), self.envp.as_ptr()) };
        nix::errno::Errno::last()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// The child writes into our memory, says something on the pipe and execs (or exits);
    /// we run again only once it has, with what it said. Nothing the child does allocates:
    /// the test harness has other threads.
    fn spawn(then_exec: bool) -> (Waited, u32, Vec<u8>) {
        spawn_into(then_exec.then_some(&["/bin/true"][..]), None)
    }

    /// As [`spawn`], exec'ing `program` (its argv) if given, born in `into` if given (and then
    /// saying so in capitals).
    fn spawn_into(
        program: Option<&[&str]>,
        into: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> (Waited, u32, Vec<u8>) {
        let seen = AtomicU32::new(0);
        let strings: Vec<std::ffi::CString> = program
            .unwrap_or_default()
            .iter()
            .map(|a| std::ffi::CString::new(*a).unwrap())
            .collect();
        let argv: Vec<*const libc::c_char> = strings
            .iter()
            .map(|a| a.as_ptr())
            .chain([std::ptr::null()])
            .collect();
        let (done, done_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let mut stack = ChildStack::new().unwrap();
        let mut said = [0u8; 16];
        let waited = spawn_sharing_memory(
            &mut stack,
            done.as_fd(),
            done_w,
            &mut said,
            None,
            into,
            &mut |w, placed| {
                seen.store(std::process::id(), Ordering::SeqCst);
                let _ = nix::unistd::write(w, if placed { b"HELLO" } else { b"hello" });
                if let Some(path) = strings.first() {
                    // SAFETY: a NUL-terminated path and argv, alive for the call.
                    unsafe { libc::execv(path.as_ptr(), argv.as_ptr()) };
                }
                exit_child(7)
            },
        )
        .unwrap();
        let said = said[..waited.said].to_vec();
        (waited, seen.load(Ordering::SeqCst), said)
    }

    #[test]
    fn a_child_sharing_our_memory_writes_it_and_we_go_on_once_it_has_exec_d() {
        let (waited, seen, said) = spawn(true);
        // It wrote our memory: its own pid (a process apart from ours).
        assert_eq!(seen, waited.pid.as_raw() as u32);
        assert_ne!(seen, std::process::id());
        assert_eq!(said, b"hello");
        // Exec'd: /bin/true exits 0 (not the 7 of the exit after a failed exec).
        let status = nix::sys::wait::waitpid(waited.pid, None).unwrap();
        assert_eq!(status, nix::sys::wait::WaitStatus::Exited(waited.pid, 0));
        assert!(!waited.stopped);
    }

    #[test]
    fn a_child_sharing_our_memory_that_exits_lets_us_go_on_too() {
        let (waited, seen, said) = spawn(false);
        assert_eq!(seen, waited.pid.as_raw() as u32);
        assert_eq!(said, b"hello");
        let status = waited
            .ended
            .unwrap_or_else(|| nix::sys::wait::waitpid(waited.pid, None).unwrap());
        assert_eq!(status, nix::sys::wait::WaitStatus::Exited(waited.pid, 7));
    }

    /// Born in the cgroup2 directory asked for (clone3 `CLONE_INTO_CGROUP` with a stack of its
    /// own), as its exec'd program sees from `/proc/self/cgroup`; the parent stays where it
    /// was. Needs root and a cgroup2 mount.
    #[test]
    fn a_child_sharing_our_memory_is_born_in_the_cgroup_asked_for() {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let mount = mountinfo
            .lines()
            .find_map(|l| {
                let (left, right) = l.split_once(" - ")?;
                right
                    .starts_with("cgroup2 ")
                    .then(|| left.split(' ').nth(4).map(str::to_string))?
            })
            .expect("a cgroup2 mount");
        let name = format!("sys-test-{}", std::process::id());
        let dir = std::path::Path::new(&mount).join(&name);
        std::fs::create_dir(&dir).unwrap();
        let fd = nix::fcntl::open(
            &dir,
            nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY,
            nix::sys::stat::Mode::empty(),
        )
        .unwrap();
        let out = tempfile::NamedTempFile::new().unwrap();
        let script = format!("grep '^0::' /proc/self/cgroup > {}", out.path().display());
        let (waited, _, said) = spawn_into(Some(&["/bin/sh", "-c", &script]), Some(fd.as_fd()));
        assert_eq!(said, b"HELLO");
        let status = nix::sys::wait::waitpid(waited.pid, None).unwrap();
        assert_eq!(status, nix::sys::wait::WaitStatus::Exited(waited.pid, 0));
        let seen = std::fs::read_to_string(out.path()).unwrap();
        assert!(seen.trim_end().ends_with(&format!("/{name}")), "{seen}");
        // We did not move.
        let ours = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        assert!(!ours.contains(&name), "{ours}");
        std::fs::remove_dir(&dir).unwrap();
    }
}
