//! The fork server: a small single-threaded process, our own binary started once as
//! `executor __fork-server`, that forks the sandbox helpers and keeps a few of them warm.
//!
//! Starting a helper by exec costs a dynamic load and a Rust start-up per command (about 2 ms
//! on a VM, most of it CPUID traps in the loader), and makes every helper read the loader's
//! files from a filesystem that a `task-container` command may write. A fork of this small
//! process costs a fraction of that, loads nothing, and runs the same code (`crate::helper`).
//!
//! **Warm workers.** Building a sandbox (namespaces, the new root, cgroups, identity,
//! landlock, seccomp) takes longer than the command it is for. So after serving a command the
//! server forks another helper for the same template (the sandbox part of a plan: profile,
//! client identity, workspace, home), which builds the sandbox at once and waits, confined,
//! for its command. The next command with that template is handed to it and only has to
//! enter its working directory and exec. Each worker serves one command and is gone with it:
//! nothing is shared between commands. Idle workers are dismissed after `IDLE_FOR`, and at
//! most `MAX_IDLE` wait at once, `MAX_IDLE_PER_TEMPLATE` of one template (the least
//! recently made go first).
//!
//! It is exec'd once, at the daemon's start (so it holds none of the daemon's memory, and its
//! command line, which every helper and sandbox init inherits, names nothing of the daemon's),
//! then only forks. Protocol on a SOCK_SEQPACKET socket pair, the server's end being its
//! stdin: the daemon sends one message (a byte saying whether to keep a worker warm for this
//! template, then the template as JSON) with the command's three descriptors (lifeline,
//! output, status); the server hands them to a waiting worker or a new one and answers with
//! that helper's pid (4 bytes, little endian). A message of the one byte `DISMISS_IDLE`
//! (sent when the clients file is reloaded) ends every idle worker. When the daemon goes away
//! the socket reads end-of-file and the server exits; PR_SET_PDEATHSIG covers a daemon killed
//! outright (its main thread, which started us, lives as long as it does), and every worker
//! dies with us. A one-shot run's server alone also takes `wire::REMOVE_AFTER`, unanswered: what
//! the run will leave behind (its cgroup directories, its home), which the server removes
//! after the run has exited (`one_shot`); it does not die with the run.

use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::Signal;
use nix::sys::socket::{sendmsg, setsockopt, sockopt, ControlMessage, MsgFlags};
use nix::sys::time::TimeVal;
use nix::unistd::Pid;

mod cgroup_pool;
mod inits;
mod net_pool;
mod one_shot;
mod root_pool;
mod started;

pub use one_shot::{fork_here, remove_leftovers, Ahead};
pub use started::Started;

pub use crate::wire::{receive_fds, Leftover};

use crate::helper::{InitLoans, Place};
use crate::plan::{SandboxPlan, Template};
use crate::sys::{self, Forked};

use crate::wire::lease::{self, CgroupName, Lease};
use crate::wire::{
    receive, send_stdio, seqpacket_pair, Message, Request, DISMISS_IDLE, RUN, RUN_AND_WARM,
};
use inits::{reap, Leader, Removals};

/// How long an idle worker waits for a command before it is dismissed.
const IDLE_FOR: Duration = Duration::from_secs(60);
/// Idle workers at once, over all templates.
const MAX_IDLE: usize = 16;
/// Idle workers of one template (one client's profile) at once.
const MAX_IDLE_PER_TEMPLATE: usize = 4;
/// The largest template a request may carry.
const MAX_TEMPLATE_BYTES: usize = 128 << 10;
/// The nice value a worker built ahead of its command has until the command comes: on a busy
/// machine its set-up yields to the commands already running (with two cores, building the
/// next sandbox beside the running command slowed that command down), and fills the idle
/// time between them instead.
const AHEAD_NICE: i32 = 10;

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

/// `argv[1]` that selects fork-server mode.
pub const FORK_SERVER_ARG: &str = "__fork-server";

/// Drop the entries of a pool unused for `idle_for` (`since` says when each was last used;
/// `gone` sees each before it goes); how long until the next one is due.
fn expire_idle<T>(
    free: &mut Vec<T>,
    idle_for: Duration,
    since: impl Fn(&T) -> Instant,
    mut gone: impl FnMut(&T),
) -> Option<Duration> {
    free.retain(|f| {
        let keep = since(f).elapsed() < idle_for;
        if !keep {
            gone(f);
        }
        keep
    });
    free.iter()
        .map(|f| idle_for.saturating_sub(since(f).elapsed()))
        .min()
}

/// Start the server from the main thread (PR_SET_PDEATHSIG follows the thread that forks).
pub fn start(exe: &std::path::Path) -> io::Result<Spawner> {
    let (daemon_end, server_end) = seqpacket_pair()?;
    // Nothing of the daemon's environment; the socket as stdin; output to nowhere.
    std::process::Command::new(exe)
        .arg(FORK_SERVER_ARG)
        .env_clear()
        .stdin(std::process::Stdio::from(server_end))
        .stdout(std::process::Stdio::null())
        .spawn()?;
    setsockopt(&daemon_end, sockopt::ReceiveTimeout, &ANSWER_TIMEOUT)?;
    // Room for the largest template in one message.
    let _ = setsockopt(&daemon_end, sockopt::SndBuf, &(MAX_TEMPLATE_BYTES * 2));
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
    serve(sock, true, Ahead::default())
}

impl Spawner {
    /// Have a helper serve a command of `template` (JSON) with these descriptors (lifeline,
    /// output, status); keep another warm for the template when `warm`. Returns the
    /// helper's pid.
    pub fn spawn(&self, template: &[u8], warm: bool, stdio: [&OwnedFd; 3]) -> io::Result<Pid> {
        if self.broken.load(Ordering::Acquire) {
            return Err(io::Error::other("the fork server failed before"));
        }
        let result = self.request(template, warm, stdio);
        if result.is_err() {
            self.broken.store(true, Ordering::Release);
        }
        result
    }

    /// Whether it failed once: every later command is started by exec.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Dismiss every idle worker: their templates name clients as they were, and a reload
    /// of the clients file may have changed what a client is.
    pub fn dismiss_idle(&self) -> io::Result<()> {
        if self.broken.load(Ordering::Acquire) {
            return Ok(());
        }
        let sock = self
            .sock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let sent = nix::unistd::write(&*sock, &[DISMISS_IDLE]).map_err(io::Error::from);
        let mut reply = [0u8; 4];
        let answered = sent.and_then(|_| Ok(nix::unistd::read(&*sock, &mut reply)?));
        if !matches!(answered, Ok(4)) {
            self.broken.store(true, Ordering::Release);
            return Err(io::Error::other("the fork server did not answer"));
        }
        Ok(())
    }

    fn request(&self, template: &[u8], warm: bool, stdio: [&OwnedFd; 3]) -> io::Result<Pid> {
        if template.len() > MAX_TEMPLATE_BYTES {
            return Err(io::Error::other("the sandbox template is too large"));
        }
        let sock = self
            .sock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let fds = stdio.map(|fd| fd.as_raw_fd());
        let flag = [if warm { RUN_AND_WARM } else { RUN }];
        sendmsg::<()>(
            sock.as_raw_fd(),
            &[IoSlice::new(&flag), IoSlice::new(template)],
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

/// A worker (a helper, or an init: `Leader`) that is building, or has built, the sandbox of
/// `template` and waits for its command on `control`.
struct Idle {
    template: Vec<u8>,
    control: OwnedFd,
    pid: Pid,
    since: Instant,
    /// Built at [`AHEAD_NICE`]: to be set back to 0 when its command comes.
    niced: bool,
}

impl Drop for Idle {
    /// Given its command, or dismissed: either way nothing more comes on `control`. An init
    /// reads end-of-file there once dismissed (our copy of the socket in its `Leader` stays
    /// open for its verdict).
    fn drop(&mut self) {
        let _ =
            nix::sys::socket::shutdown(self.control.as_raw_fd(), nix::sys::socket::Shutdown::Write);
    }
}

/// Whether a template's commands run unprivileged: a uid other than 0, no capability,
/// no_new_privs. What the pools share among such commands over time (cgroup directories, a
/// network namespace, a root's mount tree) is what they cannot change.
fn unprivileged_identity(plan: &SandboxPlan) -> bool {
    matches!(plan.user, Some((uid, _)) if uid != 0)
        && plan.capabilities.as_ref().is_some_and(Vec::is_empty)
        && plan.no_new_privs
}

/// [`unprivileged_identity`], in a pid namespace of their own (so every process that was in
/// a namespace is gone once its init is reaped: `net_pool`, `root_pool`).
fn unprivileged(plan: &SandboxPlan) -> bool {
    plan.namespaces.contains(&crate::profile::Namespace::Pid) && unprivileged_identity(plan)
}

/// The server's loop, pooling network namespaces and root templates when `pool` (modules
/// `net_pool`, `root_pool`), first making what `ahead` asks for. Never returns.
fn serve(sock: OwnedFd, pool: bool, ahead: Ahead) -> ! {
    // Our stdin is the socket (`sock` is our own copy) and nothing reads our stdout: point
    // both at /dev/null, so that no helper inherits the socket through them.
    sys::devnull_stdio(false);
    // Our memory, and every worker's until it execs, closed to other processes of the
    // payload's uid (a payload shares its init's memory until then: decision "Init leads").
    if sys::set_non_dumpable().is_err() {
        sys::exit_child(1);
    }
    // Give every worker the default signal state once: we were started by the daemon, whose
    // runtime ignores SIGPIPE. Our children's ends come on a signalfd: an init's end is when
    // what it was lent comes back (`Leader`); a helper's is only reaped.
    // SIGPIPE blocked too: a report for an init (`report_for_init`) to a daemon that stopped
    // reading fails instead of killing us. Workers start from an empty mask (`worker_start`).
    // A one-shot run's server also keeps the terminal's signals blocked (`one_shot`).
    let mut chld = nix::sys::signal::SigSet::empty();
    chld.add(Signal::SIGCHLD);
    let mut blocked = chld;
    blocked.add(Signal::SIGPIPE);
    if !pool {
        for signal in one_shot::TERMINAL_SIGNALS {
            blocked.add(signal);
        }
    }
    let children = sys::reset_signals().ok().and_then(|()| {
        blocked.thread_block().ok()?;
        nix::sys::signalfd::SignalFd::with_flags(
            &chld,
            nix::sys::signalfd::SfdFlags::SFD_CLOEXEC | nix::sys::signalfd::SfdFlags::SFD_NONBLOCK,
        )
        .ok()
    });
    let Some(children) = children else {
        sys::exit_child(1);
    };
    let mut leaders: std::collections::HashMap<Pid, Leader> = std::collections::HashMap::new();
    let mut removals = Removals::default();
    let mut removals_due: Option<Duration> = None;
    // What a one-shot run leaves, to remove once it has gone (`one_shot`), and whether a
    // command came yet.
    let mut after_run: Vec<Leftover> = Vec::new();
    let mut ran = false;
    // Workers built ahead are niced only where their priority can be given back (root, or
    // CAP_SYS_NICE): a command must never run at less than the normal priority.
    let nice_ahead = caps::has_cap(
        None,
        caps::CapSet::Effective,
        caps::Capability::CAP_SYS_NICE,
    )
    .unwrap_or(false);
    // Without the pools every command makes its own cgroups, network namespace and root.
    let mut pools = pool
        .then(|| Pools::new(MAX_TEMPLATE_BYTES))
        .and_then(Result::ok);
    let mut idle: Vec<Idle> = Vec::new();
    let mut buf = vec![0u8; MAX_TEMPLATE_BYTES + 1];
    let mut net_ahead = if ahead.net {
        net_pool::made_ahead().ok()
    } else {
        None
    };
    loop {
        // Dismiss workers idle too long (closing their control socket ends them), close
        // network namespaces unused as long.
        let idle_expire = expire_idle(&mut idle, IDLE_FOR, |w| w.since, |_| {});
        let pools_expire = pools.as_mut().and_then(|pools| pools.expire(IDLE_FOR));
        let wait = idle_expire
            .into_iter()
            .chain(pools_expire)
            .chain(removals_due.or_else(|| removals.due()))
            .min()
            .map_or(PollTimeout::NONE, |d| {
                PollTimeout::try_from(d.as_millis().min(60_000) as u64 + 1)
                    .unwrap_or(PollTimeout::MAX)
            });
        let mut fds = vec![
            PollFd::new(sock.as_fd(), PollFlags::POLLIN),
            PollFd::new(children.as_fd(), PollFlags::POLLIN),
        ];
        if let Some(pools) = &pools {
            fds.push(PollFd::new(
                pools.returns.socket().as_fd(),
                PollFlags::POLLIN,
            ));
        }
        match poll(&mut fds, wait) {
            Ok(0) => {
                removals_due = removals.try_now();
                continue;
            }
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => sys::exit_child(1),
        }
        let returned = fds.get(2).and_then(PollFd::revents);
        let ended = fds[1].revents();
        let asked = fds[0].revents();
        drop(fds);
        if ended.is_some_and(|r| !r.is_empty()) {
            while let Ok(Some(_)) = children.read_signal() {}
            reap(&mut leaders, &mut pools, &mut removals);
        }
        if returned.is_some_and(|r| !r.is_empty()) {
            if let Some(pools) = &mut pools {
                pools.receive(&mut buf);
            }
        }
        if asked.is_none_or(|r| r.is_empty()) {
            continue;
        }
        let request = match receive(&sock, &mut buf) {
            Ok(Some(Message::Run(request))) => request,
            Ok(Some(Message::DismissIdle)) => {
                idle.clear();
                if let Some(pools) = &mut pools {
                    pools.clear();
                }
                let _ = nix::unistd::write(&sock, &0i32.to_le_bytes());
                continue;
            }
            // A one-shot run's leftovers, taken once and only before its command; a daemon
            // removes its own.
            Ok(Some(Message::RemoveAfter(leftovers))) => {
                if !pool && !ran && after_run.is_empty() {
                    after_run.extend(leftovers);
                }
                continue;
            }
            // End-of-file: the daemon is gone (and every worker with us), or a one-shot run,
            // whose leftovers we remove.
            Ok(None) => {
                if let Some(pools) = &mut pools {
                    pools.clear();
                }
                if !after_run.is_empty() {
                    one_shot::finish(
                        &children,
                        &mut leaders,
                        &mut pools,
                        &mut removals,
                        std::mem::take(&mut after_run),
                    );
                }
                sys::exit_child(0)
            }
            Err(_) => {
                let _ = nix::unistd::write(&sock, &0i32.to_le_bytes());
                continue;
            }
        };
        let mut workers = Workers {
            idle: &mut idle,
            leaders: &mut leaders,
            pools: &mut pools,
            net_ahead: &mut net_ahead,
        };
        ran = true;
        let pid = dispatch(&sock, &mut workers, &request).map_or(0, Pid::as_raw);
        let _ = nix::unistd::write(&sock, &pid.to_le_bytes());
        drop(request.stdio);
        // A worker for the next command of this template. One replaces each that is used, so
        // as many wait as commands of the template came at once lately, up to a bound.
        let waiting = idle
            .iter()
            .filter(|w| w.template == request.template)
            .count();
        if request.warm && pid > 0 && waiting < MAX_IDLE_PER_TEMPLATE {
            if idle.len() >= MAX_IDLE {
                // The least recently made goes.
                idle.remove(0);
            }
            let mut workers = Workers {
                idle: &mut idle,
                leaders: &mut leaders,
                pools: &mut pools,
                net_ahead: &mut net_ahead,
            };
            if let Ok(worker) = fork_worker(&sock, &mut workers, &request.template, nice_ahead) {
                idle.push(worker);
            }
        }
        // What was served comes first; then what reaped inits left to remove.
        removals_due = removals.try_now();
    }
}

/// What the fork server lends its workers, where it pools, and the socket it comes back on.
struct Pools {
    returns: lease::Returns,
    cgroups: cgroup_pool::Cgroups,
    nets: net_pool::Pool,
    roots: root_pool::Roots,
}

impl Pools {
    fn new(max_template: usize) -> io::Result<Self> {
        Ok(Self {
            returns: lease::Returns::new(max_template)?,
            cgroups: cgroup_pool::Cgroups::default(),
            nets: net_pool::Pool::default(),
            roots: root_pool::Roots::default(),
        })
    }

    /// What a helper of `template` about to be forked is lent: its lease (cgroup name).
    fn lend(&mut self, template: &[u8], parsed: &Template) -> Option<Lease> {
        let cgroup = self.cgroups.lease(template, parsed);
        self.returns.lease(template, cgroup)
    }

    /// What an init of `template` about to be forked is lent: a network namespace (`None`:
    /// the template's are not pooled; `Some(None)`: none free, it makes one), cgroup
    /// directories, and a copy of its root template.
    fn lend_to_init(
        &mut self,
        template: &[u8],
        parsed: &Template,
    ) -> (Option<Option<OwnedFd>>, Option<CgroupName>, Option<OwnedFd>) {
        (
            self.nets.lease(template, parsed),
            self.cgroups.lease(template, parsed),
            self.roots.lease(template, parsed),
        )
    }

    /// Take back what one helper returned.
    fn receive(&mut self, buf: &mut [u8]) {
        let Ok(Some((bytes, _))) = receive_fds(self.returns.socket().as_fd(), buf) else {
            return;
        };
        if let Some((Some(name), template)) = lease::parse_returned(&buf[..bytes]) {
            self.cgroups.receive(template, name);
        }
    }

    /// Close what was unused for `idle_for`; how long until the next is.
    fn expire(&mut self, idle_for: Duration) -> Option<Duration> {
        [
            self.cgroups.expire(idle_for),
            self.nets.expire(idle_for),
            self.roots.expire(idle_for),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Close everything free (a reload of the clients file, or the end).
    fn clear(&mut self) {
        self.cgroups.clear();
        self.nets.clear();
        self.roots.clear();
    }
}

/// What the server keeps of its workers, and what it lends them.
struct Workers<'a> {
    idle: &'a mut Vec<Idle>,
    leaders: &'a mut std::collections::HashMap<Pid, Leader>,
    pools: &'a mut Option<Pools>,
    /// The network namespace made ahead for a one-shot's command (`Ahead`).
    net_ahead: &'a mut Option<OwnedFd>,
}

/// Hand the command's descriptors to a waiting worker of its template, or to a new one.
fn dispatch(sock: &OwnedFd, workers: &mut Workers<'_>, request: &Request) -> Option<Pid> {
    let stdio = [&request.stdio[0], &request.stdio[1], &request.stdio[2]];
    if let Some(at) = workers
        .idle
        .iter()
        .position(|w| w.template == request.template)
    {
        let worker = workers.idle.remove(at);
        if worker.niced {
            back_to_normal_priority(worker.pid);
        }
        if send_stdio(&worker.control, stdio).is_ok() {
            keep_status(workers, worker.pid, request);
            return Some(worker.pid);
        }
        // It died while it waited (it failed, or a command of its uid killed it): a new one.
    }
    let worker = fork_worker(sock, workers, &request.template, false).ok()?;
    send_stdio(&worker.control, stdio).ok()?;
    keep_status(workers, worker.pid, request);
    Some(worker.pid)
}

/// An init's command's status pipe, kept until the init is reaped ([`Leader::status`]).
fn keep_status(workers: &mut Workers<'_>, pid: Pid, request: &Request) {
    if let Some(leader) = workers.leaders.get_mut(&pid) {
        leader.status = request.stdio[2].try_clone().ok();
    }
}

/// The worker `pid` built ahead at [`AHEAD_NICE`], and every process it forked (its session's
/// process group, once it has one: the payload), back at nice 0 before its command runs. The
/// worker first, so that a child it forks from now on is born at 0.
fn back_to_normal_priority(pid: Pid) {
    let _ = sys::set_nice(sys::NiceOf::Process(pid.as_raw()), 0);
    // ESRCH while the worker has not made its session yet: then it has no child either.
    let _ = sys::set_nice(sys::NiceOf::Group(pid.as_raw()), 0);
}

/// Fork a worker that builds the sandbox of `template` and waits on its control socket;
/// `ahead` (of its command) at [`AHEAD_NICE`]; with what the pools lend (cgroup directories,
/// a network namespace, a copy of the template's root) where the template may have them, or
/// the network namespace made ahead (`net_ahead`, taken by the first worker that makes one).
/// With a pid namespace the worker is the namespace's init ([`fork_leader`]), else a helper.
fn fork_worker(
    sock: &OwnedFd,
    workers: &mut Workers<'_>,
    template: &[u8],
    ahead: bool,
) -> io::Result<Idle> {
    let parsed: Template = serde_json::from_slice(template).map_err(io::Error::other)?;
    if crate::helper::leads(&parsed) {
        return fork_leader(sock, workers, template, &parsed, ahead);
    }
    let (ours, theirs) = seqpacket_pair()?;
    // Ours to give: the worker takes it (its copy survives the fork), our copy closes below.
    let lease = workers
        .pools
        .as_mut()
        .and_then(|pools| pools.lend(template, &parsed));
    match sys::fork()? {
        Forked::Child => {
            // Nothing of the server's may stay open in the worker: the daemon's socket, the
            // other workers' control sockets and the pool's other namespaces, our end of
            // this one.
            drop(ours);
            let mut keep = vec![theirs.as_raw_fd()];
            keep.extend(lease.iter().flat_map(Lease::fds));
            sys::close_fds_above_stderr_except(&keep);
            let _ = sock;
            worker_start(ahead);
            crate::helper::serve_worker(&parsed, theirs, lease)
        }
        Forked::Parent(pid) => Ok(Idle {
            template: template.to_vec(),
            control: ours,
            pid,
            since: Instant::now(),
            niced: ahead,
        }),
    }
}

/// In a worker just forked: its priority ([`AHEAD_NICE`] when built ahead) and a signal mask
/// of its own (ours blocks SIGCHLD for our signalfd).
fn worker_start(ahead: bool) {
    if ahead {
        let _ = sys::set_nice(sys::NiceOf::Me, AHEAD_NICE);
    }
    let _ = nix::sys::signal::SigSet::empty().thread_set_mask();
}

/// Fork the init of a worker of `template` (which has a pid namespace) straight into a new
/// pid namespace and, where the kernel can, into the command's cgroup2 directory; keep what
/// it was lent until it is reaped ([`Leader`], [`reap`]).
fn fork_leader(
    sock: &OwnedFd,
    workers: &mut Workers<'_>,
    template: &[u8],
    parsed: &Template,
    ahead: bool,
) -> io::Result<Idle> {
    let (ours, theirs) = seqpacket_pair()?;
    let ours_kept = ours.try_clone()?;
    let (net, cgroup, root) = match workers.pools.as_mut() {
        Some(pools) => pools.lend_to_init(template, parsed),
        None => (None, None, None),
    };
    let net_pooled = net.is_some();
    let mut net = net.flatten();
    if net.is_none() && !net_pooled {
        net = workers.net_ahead.take_if(|_| {
            parsed
                .sandbox
                .namespaces
                .contains(&crate::profile::Namespace::Net)
        });
    }
    let pooled = cgroup.is_some();
    let (name, existing) = match cgroup {
        Some(c) => (c.name, c.existing),
        None => (next_name(workers.pools), false),
    };
    let born_in = crate::helper::birth_cgroup(parsed, &name, existing);
    let dirs: Vec<std::path::PathBuf> = parsed
        .cgroups
        .iter()
        .filter(|c| !c.is_parent)
        .map(|c| c.dir(&name))
        .collect();
    let (forked, placed) =
        match sys::fork_into_pid_namespace(born_in.as_ref().map(std::os::fd::AsFd::as_fd)) {
            Ok(forked) => forked,
            Err(err) => {
                // Nothing ran in them: what the name's directories hold is nothing.
                remove_dirs(&dirs);
                return Err(err);
            }
        };
    match forked {
        Forked::Child => {
            drop((ours, ours_kept, born_in));
            let mut keep = vec![theirs.as_raw_fd()];
            keep.extend(net.as_ref().map(AsRawFd::as_raw_fd));
            keep.extend(root.as_ref().map(AsRawFd::as_raw_fd));
            sys::close_fds_above_stderr_except(&keep);
            let _ = sock;
            worker_start(ahead);
            let loans = InitLoans {
                net,
                root,
                net_pooled,
            };
            let place = Place {
                name,
                existing,
                placed,
            };
            crate::helper::serve_init(parsed, theirs, loans, &place)
        }
        Forked::Parent(pid) => {
            drop((theirs, root, born_in));
            // A namespace init enters is ours to keep and take back (one made ahead is not
            // pooled: it goes with the one command it was made for).
            let ns = net.filter(|_| net_pooled);
            workers.leaders.insert(
                pid,
                Leader {
                    template: template.to_vec(),
                    control: ours_kept,
                    name,
                    dirs,
                    pooled,
                    net_pooled,
                    ns,
                    status: None,
                },
            );
            Ok(Idle {
                template: template.to_vec(),
                control: ours,
                pid,
                since: Instant::now(),
                niced: ahead,
            })
        }
    }
}

/// A name for the cgroup directories of an init whose template does not pool them.
fn next_name(pools: &mut Option<Pools>) -> String {
    static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    match pools {
        Some(pools) => pools.cgroups.name_once(),
        None => format!(
            "i-{}-{}",
            std::process::id(),
            MADE.fetch_add(1, Ordering::Relaxed)
        ),
    }
}

fn remove_dirs(dirs: &[std::path::PathBuf]) {
    for dir in dirs {
        crate::cgroup::remove(dir);
    }
}

/// A template whose commands run unprivileged (uid 65534, no capability, no_new_privs) in
/// `namespaces`, for the pools' tests to change one thing of.
#[cfg(test)]
pub fn unprivileged_template(
    namespaces: Vec<crate::profile::Namespace>,
    f: impl FnOnce(&mut SandboxPlan),
) -> Template {
    let mut sandbox = SandboxPlan {
        namespaces,
        user: Some((65534, 65534)),
        capabilities: Some(vec![]),
        no_new_privs: true,
        ..Default::default()
    };
    f(&mut sandbox);
    Template {
        cgroups: vec![],
        sandbox,
        layers: vec![],
        missing: vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Namespace;

    #[test]
    fn only_an_unprivileged_identity_in_a_pid_namespace_counts_as_unprivileged() {
        let t = |f: fn(&mut SandboxPlan)| unprivileged_template(vec![Namespace::Pid], f).sandbox;
        assert!(unprivileged(&t(|_| {})));
        assert!(!unprivileged(&t(|s| s.namespaces.clear())));
        assert!(unprivileged_identity(&t(|s| s.namespaces.clear())));
        assert!(!unprivileged_identity(&t(|s| s.user = Some((0, 0)))));
        assert!(!unprivileged_identity(&t(|s| s.user = None)));
        assert!(!unprivileged_identity(&t(|s| s.capabilities = None)));
        assert!(!unprivileged_identity(&t(|s| {
            s.capabilities = Some(vec!["CAP_NET_RAW".into()])
        })));
        assert!(!unprivileged_identity(&t(|s| s.no_new_privs = false)));
    }
}
