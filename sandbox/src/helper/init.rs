//! The sandbox's init: pid 1 of a command's pid namespace, and the command's only supervisor
//! (ARCHITECTURE.md, decision "Init leads").
//!
//! The fork server clones it straight into a new pid namespace and, where the kernel can,
//! into the command's cgroup2 directory. It joins the command's other cgroups, makes the
//! remaining namespaces and the new root, and starts the payload in its own memory
//! (`sys::spawn_sharing_memory`), which confines itself and waits for its command; init waits
//! meanwhile. The fork server hands the command's descriptors to the payload, which reads the
//! command, hands init the lifeline and the status pipe (`payload::HandOff`) and execs; init
//! then runs again, watches the command, reports its end and tells the fork server what may
//! be lent again.
//!
//! Nothing of the command outlives init: it is the parent of every process of the namespace
//! (orphans are reparented to it) and the kernel kills whatever is left when it exits. It
//! exits when the fork server does (PR_SET_PDEATHSIG), and kills everything when the daemon
//! closes the lifeline (a timeout, a cancel, a disconnect, the daemon's death).
//!
//! ```text
//! fork server (host pid namespace)
//!   `- init (pid 1 of a new pid namespace, in the command's cgroups)
//!        `- payload: bash -c COMMAND (its memory init's until it execs)
//! ```

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use super::end::{decode, Counters};
use super::payload::{self, HandedOver};
use super::{write_report, SetupError};
use crate::apply;
use crate::plan::{cgroup_name, HelperReport, Template};
use crate::sys;
use crate::wire::{self, lease, verdict, Stdio};

/// How long init goes on killing what a command left before it reports and leaves the rest
/// to the kernel (its own exit empties the namespace).
const KILL_DEADLINE: Duration = Duration::from_secs(5);

/// Where init's cgroups are: the name of the command's directories, whether they exist
/// already (lent again by the fork server's pool), and whether the fork server placed init in
/// the cgroup2 one at its birth (`CLONE_INTO_CGROUP`) or it must join it itself.
pub struct Place {
    pub name: String,
    pub existing: bool,
    pub placed: bool,
}

/// What the fork server lends init (`spawner::net_pool`, `spawner::root_pool`).
#[derive(Default)]
pub struct Loans {
    /// A network namespace to enter instead of making one: one of the pool, or one made
    /// ahead for a one-shot's command.
    pub net: Option<OwnedFd>,
    /// The mount namespace of the template's shared root, to copy.
    pub root: Option<OwnedFd>,
    /// The template's network namespaces are pooled: say whether ours may be lent again.
    pub net_pooled: bool,
}

/// Init's life (module docs). Never returns.
pub fn serve(template: &Template, control: OwnedFd, loans: Loans, place: &Place) -> ! {
    // The fork server's death is ours, and ours the whole namespace's.
    if nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).is_err() {
        sys::exit_child(1);
    }
    // fds 0, 1 and 2 of init itself: /dev/null (the command's descriptors are apart).
    sys::devnull_stdio(true);
    match prepare(template, &control, loans, place) {
        Ok(prepared) => prepared.run(template, control),
        Err(err) => {
            // Nothing ran: report the failure to the command that comes for this worker.
            if let Ok(Some(stdio)) = wire::receive_stdio(&control) {
                write_report(&stdio.status, &err.report());
            }
            sys::exit_child(0)
        }
    }
}

/// Init once its payload has exec'd or exited.
struct Prepared {
    payload: Pid,
    /// The payload's end, where it exited before we ran again (and was reaped).
    ended: Option<WaitStatus>,
    sigchld: SignalFd,
    /// What the payload said failed, if anything.
    failure: Option<SetupError>,
    handoff: OwnedFd,
    counters: Counters,
    /// The command's processes as a cgroup lists them, to count what a kill takes.
    procs: Option<OwnedFd>,
    /// The template's network namespaces are pooled, and ours was made here (not lent):
    /// what we give back with our verdict.
    net_pooled: bool,
    net_made: bool,
}

/// Build the sandbox and start the payload; return once it has exec'd or exited. The order
/// matters; each step says why.
fn prepare(
    template: &Template,
    control: &OwnedFd,
    loans: Loans,
    place: &Place,
) -> Result<Prepared, SetupError> {
    // 1. A new session: the command has no controlling terminal (so no TIOCSTI injection
    //    into the daemon's terminal) and a process group apart from the daemon's.
    nix::unistd::setsid().map_err(SetupError::Session)?;

    // 2. The command's cgroups, its limits written, before anything of it runs: we are in
    //    the cgroup2 one already where the fork server could place us, and join the others
    //    (v1 hierarchies) as one thread naming itself, which never waits for the kernel's
    //    global lock (`cgroup::join_alone`). The counters of the limits are opened now: our root
    //    will show no host cgroup directory.
    for cg in &template.cgroups {
        let dir = cg.dir(&place.name);
        let inside = cg.kill && place.placed;
        if !(inside || cg.is_parent || (place.existing && dir.is_dir())) {
            super::create_fresh(&dir)?;
        }
        for (file, value) in &cg.settings {
            crate::cgroup::set(&dir, file, value).map_err(SetupError::Cgroup)?;
        }
        if !inside {
            crate::cgroup::join_alone(&dir).map_err(SetupError::Cgroup)?;
        }
    }
    let counters = Counters::open(template, &place.name);
    let procs = template
        .cgroups
        .first()
        .and_then(|cg| crate::cgroup::open_counter(&cg.dir(&place.name), "cgroup.procs").ok());

    // 3. SIGCHLD on a signalfd, so one poll waits for "child exited" and "daemon closed the
    //    lifeline" together. SIGPIPE blocked too: a report to a daemon that stopped reading
    //    fails with EPIPE instead of killing us. The payload resets the mask.
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGCHLD);
    let mut blocked = mask;
    blocked.add(Signal::SIGPIPE);
    blocked.thread_block().map_err(SetupError::Signals)?;
    let sigchld = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(SetupError::Signals)?;

    // 4. The payload's channels to us, made before the network namespace is entered (a
    //    socket counts in the namespace it is made in, and ours must leave it empty).
    let channels = payload::Channels::new()?;

    // 5. The remaining namespaces, the new root, hostname, loopback.
    let Loans {
        net,
        root,
        net_pooled,
    } = loans;
    let net_made = net.is_none();
    apply::enter_namespaces(&template.sandbox, net.as_ref(), root.as_ref())?;
    // Entered: nothing of the command may hold the namespaces' descriptors (the fork server
    // keeps its own).
    drop((net, root));

    // 6. The payload, in our memory until its exec (we are in all of its cgroups already).
    let Some(started) = payload::start(
        template,
        control.as_fd(),
        channels,
        &sigchld,
        &payload::Birth::default(),
    )?
    else {
        // Disturbed before its hand-off (reported): go, allocating nothing.
        sys::exit_child(0)
    };
    // 7. The memory is ours again, and init must outlive whatever the command does to its
    //    cgroup: a group OOM kill (`memory.oom.group`) spares only what is exempt, and we
    //    report it. Set now, after the payload's exec (before it, the kernel would apply it
    //    to the payload too, which shared our memory).
    //    Without CAP_SYS_RESOURCE (some containers, and this project's development VM) it
    //    cannot be lowered: the fork server then reports for an init the kernel killed.
    let _ = std::fs::write("/proc/self/oom_score_adj", "-1000");
    Ok(Prepared {
        payload: started.pid,
        ended: started.ended,
        sigchld,
        failure: started.failure,
        handoff: started.handoff,
        counters,
        procs,
        net_pooled,
        net_made,
    })
}

impl Prepared {
    /// The payload has exec'd or exited: serve the command it took, or report why it could
    /// not; then tell the fork server what may be lent again, and exit.
    fn run(self, template: &Template, control: OwnedFd) -> ! {
        let handed = payload::take_handoff(&self.handoff, control.as_fd());
        let Some(handed) = handed else {
            // No command came: the payload was dismissed (it exited cleanly), or failed
            // before its command (reported to the command that comes for this worker).
            if self.failure.is_none() {
                self.verdict(&control, verdict::CGROUPS);
                sys::exit_child(0)
            }
            if let Ok(Some(stdio)) = wire::receive_stdio(&control) {
                if let Some(err) = &self.failure {
                    write_report(&stdio.status, &err.report());
                }
            }
            sys::exit_child(0)
        };
        let HandedOver {
            main,
            lifeline,
            status,
            rest,
        } = handed;
        if let Some(err) = &self.failure {
            write_report(&status, &err.report());
            drop(status);
            self.verdict(&control, 0);
            sys::exit_child(0)
        }
        write_report(&status, &HelperReport::Started);

        // Watch the command until its first process exits or the daemon closes the lifeline;
        // pass on the signals it asks for meanwhile. Then kill what is left: leftovers of a
        // command that ended, the whole tree of one stopped.
        // (A payload that exited while we waited for it is reaped already.)
        let ended = self.ended.filter(|_| main == self.payload);
        let (stopped, mut exit) = match watch(main, ended, &self.sigchld, &lifeline, rest) {
            End::Exited(exit) => (false, Some(exit)),
            End::Stopped(exit) => (true, exit),
        };
        let (killed, all_gone) = end_tree(main, &mut exit, self.procs.as_ref());
        let (code, signal) = decode(exit);
        let limits_hit = self.counters.hit();
        // What a command that left nothing and hit no limit ran in may serve the next one.
        let clean = !stopped && killed == 0 && limits_hit.is_empty();
        write_report(
            &status,
            &HelperReport::Finished {
                code,
                signal,
                killed,
                stopped,
                layers: template.layers.clone(),
                limits_hit,
            },
        );
        drop((status, lifeline));
        // A namespace with processes we could not kill in time is no one's to lend.
        let flags = if clean { verdict::CGROUPS } else { 0 };
        if all_gone {
            self.verdict(&control, flags);
        } else {
            wire::send_verdict(&control, flags, None);
        }
        sys::exit_child(0)
    }

    /// Tell the fork server what it may lend again: `flags` ([`verdict`]), and whether our
    /// network namespace is empty (waiting for it to settle only now that the command is
    /// reported), with the namespace itself where we made it.
    fn verdict(&self, control: &OwnedFd, flags: u8) {
        let net = self.net_pooled && lease::settles_empty();
        let ns = (net && self.net_made)
            .then(|| std::fs::File::open("/proc/thread-self/ns/net").ok())
            .flatten()
            .map(OwnedFd::from);
        let flags = flags | if net { verdict::NET } else { 0 };
        wire::send_verdict(control, flags, ns.as_ref());
    }
}

/// How the watch of a command ended.
enum End {
    /// Its first process exited (leftovers may still run).
    Exited(WaitStatus),
    /// The daemon closed the lifeline (or waiting failed): the first process's status if it
    /// had already exited.
    Stopped(Option<WaitStatus>),
}

/// Block until `main` exits (`main_exit`, if it did already) or the lifeline closes. Lines the daemon writes on the lifeline
/// meanwhile (`pending` holds what came with the command) ask for signals: `signal <number>`
/// goes to every process of the namespace but us.
fn watch(
    main: Pid,
    mut main_exit: Option<WaitStatus>,
    sigchld: &SignalFd,
    lifeline: &OwnedFd,
    mut pending: Vec<u8>,
) -> End {
    loop {
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            if let Some(signal) = std::str::from_utf8(&line[..end])
                .ok()
                .and_then(|l| l.strip_prefix("signal "))
                .and_then(|n| n.trim().parse::<i32>().ok())
                .and_then(|n| Signal::try_from(n).ok())
            {
                // -1 from a namespace's init: every process of the namespace but init.
                let _ = kill(Pid::from_raw(-1), signal);
            }
        }
        if pending.len() > 4096 {
            pending.clear();
        }
        // Reap what exited (orphans of the namespace are ours too).
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(status) if status.pid() == Some(main) => main_exit = Some(status),
                Ok(_) => {}
            }
        }
        if let Some(status) = main_exit {
            return End::Exited(status);
        }
        let mut fds = [
            PollFd::new(sigchld.as_fd(), PollFlags::POLLIN),
            PollFd::new(lifeline.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(Errno::EINTR) => continue,
            // Cannot wait any more: treat it as a stop so the tree is still killed.
            Err(_) => return End::Stopped(main_exit),
        }
        if fds[1].any().unwrap_or(true) {
            let mut chunk = [0u8; 512];
            match nix::unistd::read(lifeline, &mut chunk) {
                Ok(0) => return End::Stopped(main_exit),
                Ok(n) => pending.extend_from_slice(&chunk[..n]),
                Err(Errno::EINTR | Errno::EAGAIN) => {}
                Err(_) => return End::Stopped(main_exit),
            }
        }
        while let Ok(Some(_)) = sigchld.read_signal() {}
    }
}

/// Kill every process of the namespace but us and reap it: how many there were (`main`
/// among them if it still ran: its status goes into `main_exit`), counted before the kill
/// (as they are reaped, a parent may reap its own child first), and whether none is left. A
/// process that escapes one round (forked as it went) is taken by the next; after
/// [`KILL_DEADLINE`] the rest is left to the kernel, which kills it when we exit.
fn end_tree(main: Pid, main_exit: &mut Option<WaitStatus>, procs: Option<&OwnedFd>) -> (u32, bool) {
    // Nothing left is the common case: one waitpid says so. What exited on its own (a
    // zombie) is reaped, not counted.
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Err(Errno::ECHILD) => return (0, true),
            Ok(WaitStatus::StillAlive) => break,
            Ok(status) if status.pid() == Some(main) => *main_exit = Some(status),
            Ok(_) | Err(_) => {}
        }
    }
    // We are one of them.
    let counted = alive(procs).saturating_sub(1);
    let deadline = Instant::now() + KILL_DEADLINE;
    loop {
        // -1 from a namespace's init: every process of the namespace but init (stopped ones
        // too: SIGKILL needs no running task).
        let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
        match waitpid(Pid::from_raw(-1), None) {
            Err(Errno::ECHILD) => return (counted, true),
            Ok(status) if status.pid() == Some(main) => *main_exit = Some(status),
            Ok(_) | Err(_) => {}
        }
        if Instant::now() > deadline {
            return (counted, false);
        }
    }
}

/// The live processes of our pid namespace, us included: the cgroup's list (`procs`, which
/// holds no zombie), or else those of our /proc that are not zombies.
fn alive(procs: Option<&OwnedFd>) -> u32 {
    if let Some(procs) = procs {
        let mut lines = 0u32;
        let mut buf = [0u8; 16 << 10];
        let mut at = 0;
        while let Ok(n) = nix::sys::uio::pread(procs, &mut buf, at) {
            if n == 0 {
                return lines;
            }
            lines += buf[..n].iter().filter(|b| **b == b'\n').count() as u32;
            at += n as i64;
        }
    }
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.flatten()
                .filter(|e| {
                    e.file_name().to_str().is_some_and(|n| {
                        n.parse::<u32>().is_ok()
                            && std::fs::read_to_string(format!("/proc/{n}/stat"))
                                .ok()
                                .and_then(|s| {
                                    s.rsplit(')')
                                        .next()
                                        .map(|r| r.trim_start().starts_with('Z'))
                                })
                                == Some(false)
                    })
                })
                .count() as u32
        })
        .unwrap_or(0)
}

/// The cgroup2 directory init is to be born in (`CLONE_INTO_CGROUP`): the template's
/// `cgroup.kill` one for the directories `name`, made here unless it exists (`existing`: lent
/// again; or the caller's own), open. `None` where the template has none or it cannot be
/// made: init then makes and joins it itself.
pub fn birth_cgroup(template: &Template, name: &str, existing: bool) -> Option<OwnedFd> {
    let cg = template.cgroups.iter().find(|c| c.kill)?;
    let dir = cg.dir(name);
    if !(cg.is_parent || (existing && dir.is_dir())) {
        super::create_fresh(&dir).ok()?;
    }
    nix::fcntl::open(
        &dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .ok()
}

/// Exec mode (a daemon without its fork server, `super::main`), for a template with a pid
/// namespace: we stand in for the fork server for one command. We clone its init, hand it
/// the command's descriptors, and relay the lifeline (the command line, then what the daemon
/// writes after it, and its end); then we wait for init and remove the command's cgroup
/// directories.
pub fn exec_mode(template: &Template, stdio: Stdio) {
    let report = |err: SetupError| write_report(&stdio.status, &err.report());
    let name = cgroup_name(std::process::id());
    let mut pending = Vec::new();
    let process = |e: Errno| SetupError::Process(e.into());
    let made = nix::unistd::pipe2(OFlag::O_CLOEXEC)
        .and_then(|(r, w)| {
            nix::fcntl::fcntl(&w, nix::fcntl::FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;
            let control = socketpair(
                AddressFamily::Unix,
                SockType::SeqPacket,
                None,
                SockFlag::SOCK_CLOEXEC,
            )?;
            Ok(((r, w), control))
        })
        .map_err(process);
    let ((life_r, life_w), (ours, theirs)) = match made {
        Ok(made) => made,
        Err(err) => return report(err),
    };
    // SIGCHLD on a signalfd; SIGPIPE blocked, so that a write to a lifeline init no longer
    // reads fails instead of killing us before the cgroups are removed.
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGCHLD);
    let mut blocked = mask;
    blocked.add(Signal::SIGPIPE);
    let sigchld = match blocked
        .thread_block()
        .and_then(|()| SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK))
    {
        Ok(fd) => fd,
        Err(err) => return report(SetupError::Signals(err)),
    };
    let born_in = birth_cgroup(template, &name, false);
    let init = match sys::fork_into_pid_namespace(born_in.as_ref().map(AsFd::as_fd)) {
        Ok((sys::Forked::Child, placed)) => {
            sys::close_fds_above_stderr_except(&[std::os::fd::AsRawFd::as_raw_fd(&theirs)]);
            let place = Place {
                name,
                existing: false,
                placed,
            };
            serve(template, theirs, Loans::default(), &place)
        }
        Ok((sys::Forked::Parent(pid), _)) => pid,
        Err(err) => {
            report(SetupError::PidNamespace(Errno::from_raw(
                err.raw_os_error().unwrap_or(0),
            )));
            super::end::remove_cgroups(template, &name);
            return;
        }
    };
    drop((born_in, theirs));
    let Stdio {
        lifeline,
        output,
        status,
    } = stdio;
    let _ = wire::send_stdio(&ours, [&life_r, &output, &status]);
    // Nothing more comes: a payload that took nothing, or init waiting for what it never
    // got, reads the end.
    let _ = nix::sys::socket::shutdown(
        std::os::fd::AsRawFd::as_raw_fd(&ours),
        nix::sys::socket::Shutdown::Write,
    );
    drop((life_r, output, status));
    // Relay until init is gone: what the daemon writes on the lifeline, and its end. Init
    // ends the command at once when the lifeline closes; one that has not within
    // `KILL_DEADLINE` more is killed (its namespace with it).
    let mut life_w = Some(life_w);
    let mut lifeline = Some(lifeline);
    let mut closed_at: Option<Instant> = None;
    loop {
        if !matches!(
            waitpid(init, Some(WaitPidFlag::WNOHANG)),
            Ok(WaitStatus::StillAlive)
        ) {
            break;
        }
        if closed_at.is_some_and(|at| at.elapsed() > KILL_DEADLINE * 2) {
            let _ = kill(init, Signal::SIGKILL);
            let _ = waitpid(init, None);
            break;
        }
        let (readable, writable) = {
            let mut fds = vec![PollFd::new(sigchld.as_fd(), PollFlags::POLLIN)];
            let read_at = lifeline.as_ref().map(|fd| {
                fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
                fds.len() - 1
            });
            let write_at = life_w.as_ref().filter(|_| !pending.is_empty()).map(|fd| {
                fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLOUT));
                fds.len() - 1
            });
            let wait = if closed_at.is_some() {
                PollTimeout::from(100u16)
            } else {
                PollTimeout::NONE
            };
            match poll(&mut fds, wait) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(_) => break,
            }
            let ready = |at: Option<usize>| at.is_some_and(|i| fds[i].any().unwrap_or(true));
            (ready(read_at), ready(write_at))
        };
        while let Ok(Some(_)) = sigchld.read_signal() {}
        if let (true, Some(fd)) = (readable, &lifeline) {
            let mut chunk = [0u8; 512];
            match nix::unistd::read(fd, &mut chunk) {
                Ok(n) if n > 0 => pending.extend_from_slice(&chunk[..n]),
                Err(Errno::EAGAIN | Errno::EINTR) => {}
                // The daemon asks for the stop: init sees it at once.
                _ => {
                    lifeline = None;
                    life_w = None;
                    closed_at = Some(Instant::now());
                }
            }
        }
        if let (true, Some(fd)) = (writable, &life_w) {
            match nix::unistd::write(fd, &pending) {
                Ok(n) => {
                    pending.drain(..n);
                }
                Err(Errno::EAGAIN | Errno::EINTR) => {}
                Err(_) => life_w = None,
            }
        }
    }
    super::end::remove_cgroups(template, &name);
}
