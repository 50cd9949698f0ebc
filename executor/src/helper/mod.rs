//! A command's supervisors, and the sandbox's first steps.
//!
//! The daemon is a multi-threaded tokio process, where forking and changing process-wide state
//! (session, subreaper, cgroups, namespaces, credentials) is unsafe or impossible. So each
//! command is built and watched by single-threaded processes the fork server forks (or, where
//! there is none, the executor binary exec'd as `executor __sandbox-helper`):
//!
//! - With a pid namespace (`strict`, `task-container`), the namespace's init is the command's
//!   supervisor (`init`): it builds the sandbox, starts the payload, watches it, reports and
//!   takes everything down by exiting.
//! - Without one (`landlock`, `trusted`), a helper (here) does, from outside: a subreaper in
//!   a session of its own, which forks the payload into the command's cgroups, watches it,
//!   sweeps what it left (`end`), reports and gives back what it was lent.
//!
//! Either way the work has two halves: everything the template (the sandbox part of the plan)
//! decides, which a warm worker of the fork server does before any command arrives, ending
//! with a confined payload waiting for its command (`payload`); and the command itself, which
//! only has to enter its working directory and exec.
//!
//! The descriptors of a command:
//! - the lifeline: the command line (JSON), then kept open. The daemon writes to it again
//!   only to ask for a signal to the command's tree (`signal <n>` lines, for a process a
//!   client talks to); when the daemon closes it (timeout, cancel, disconnect, shutdown) or dies (even by
//!   SIGKILL, the kernel closes it), the supervisor sees end-of-file and kills the command's tree.
//! - the output pipe, handed to the payload as its stdout and stderr (for a process a client
//!   talks to, a socket or a terminal that is its stdin too).
//! - the status pipe: a `started` line once the payload has exec'd, one [`HelperReport`]
//!   JSON line at the end.
//!
//! The process tree of a command:
//!
//! ```text
//! fork server
//!   |- init (pid 1 of a new pid namespace)            with a pid namespace
//!   |    `- payload: bash -c COMMAND
//!   `- helper (session leader, subreaper)              without one
//!        `- payload: bash -c COMMAND
//! ```
//!
//! The setup order is in `init::prepare`, [`Worker::prepare`] (helper) and
//! `payload::payload_main`; how a helper's command ends is in `end.rs`.

mod end;
mod init;
mod payload;

pub use init::{birth_cgroup, serve as serve_init, verdict, Loans as InitLoans, Place};

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::process::ExitCode;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use crate::cgroup;
use crate::plan::{cgroup_name, CommandPlan, HelperReport, Plan, Template};
use crate::profile::Namespace;
use crate::sandbox::SandboxError;
use crate::spawner::Lease;
use crate::sys::{self, Forked};

/// argv[1] that selects helper mode. Checked in `main` before anything else runs.
pub const HELPER_ARG: &str = "__sandbox-helper";

/// Longest plan or command line the helper accepts; the daemon's request limits keep them far
/// below it.
const MAX_PLAN_BYTES: usize = 4 << 20;
/// Exit code of a child whose setup failed (its reason is on the setup pipe).
const SETUP_FAILED: i32 = 127;

/// A setup step that failed, named so the daemon can say which layer broke.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("cannot read the plan from the daemon: {0}")]
    ReadPlan(#[source] std::io::Error),
    #[error("the plan is not valid: {0}")]
    ParsePlan(#[source] serde_json::Error),
    #[error("{0}")]
    Process(#[source] std::io::Error),
    #[error("cannot start a new session: {0}")]
    Session(#[source] Errno),
    #[error("cannot become a child subreaper: {0}")]
    Subreaper(#[source] Errno),
    #[error("cannot set up signal handling: {0}")]
    Signals(#[source] Errno),
    #[error("cgroup: {0}")]
    Cgroup(#[source] cgroup::CgroupError),
    #[error("cannot create a pid namespace: {0}")]
    PidNamespace(#[source] Errno),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error("cannot enter working directory {dir}: {errno}")]
    Cwd { dir: String, errno: Errno },
    #[error("cannot start {program}: {source}")]
    Exec {
        program: String,
        #[source]
        source: Errno,
    },
    #[error("cannot wire the output pipe: {0}")]
    OutputPipe(#[source] std::io::Error),
    /// A child reported a failure on the setup pipe.
    #[error("{message}")]
    Child { stage: String, message: String },
}

impl SetupError {
    /// Short name of the stage, carried in the report and in the daemon's error message.
    pub fn stage(&self) -> String {
        match self {
            Self::ReadPlan(_) | Self::ParsePlan(_) => "plan".into(),
            Self::Process(_) => "process".into(),
            Self::Session(_) => "session".into(),
            Self::Subreaper(_) => "subreaper".into(),
            Self::Signals(_) => "signals".into(),
            Self::Cgroup(_) => "cgroup".into(),
            Self::PidNamespace(_) => "pid_ns".into(),
            Self::Sandbox(err) => err.layer().into(),
            Self::Cwd { .. } => "cwd".into(),
            Self::Exec { .. } => "exec".into(),
            Self::OutputPipe(_) => "output".into(),
            Self::Child { stage, .. } => stage.clone(),
        }
    }

    fn report(&self) -> HelperReport {
        HelperReport::SetupFailed {
            stage: self.stage(),
            message: self.to_string(),
        }
    }
}

/// What a child writes on the setup pipe, one JSON line each: `Ready` once it is confined
/// and waits for its command, `Failed` when a step failed. End-of-file after `Ready` means the
/// exec happened.
#[derive(Serialize, Deserialize)]
#[serde(tag = "note", rename_all = "snake_case")]
enum ChildNote {
    Ready,
    Failed { stage: String, message: String },
}

/// The three descriptors one command is served with.
pub struct Stdio {
    pub lifeline: OwnedFd,
    pub output: OwnedFd,
    pub status: OwnedFd,
}

/// Exec mode (a daemon without its fork server): the plan line and then the lifeline on
/// stdin, the output pipe on stdout, the status pipe on stderr. Always exits 0: the outcome
/// travels in the report.
pub fn main() -> ExitCode {
    let stdio = (|| {
        Ok::<_, std::io::Error>(Stdio {
            lifeline: std::io::stdin().as_fd().try_clone_to_owned()?,
            output: std::io::stdout().as_fd().try_clone_to_owned()?,
            status: std::io::stderr().as_fd().try_clone_to_owned()?,
        })
    })();
    let Ok(stdio) = stdio else {
        return ExitCode::SUCCESS;
    };
    // Our stdio are the command's descriptors now (kept above): the process's own point at
    // /dev/null, so that nothing holds them by accident.
    sys::devnull_stdio(true);
    // exec kept whatever its caller ignored (Rust ignores SIGPIPE): back to the defaults.
    if let Err(err) = sys::reset_signals() {
        write_report(&stdio.status, &SetupError::Process(err).report());
        return ExitCode::SUCCESS;
    }
    let (plan, rest) = match read_line(stdio.lifeline.as_fd()).and_then(|(line, rest)| {
        let plan = serde_json::from_slice::<Plan>(&line).map_err(SetupError::ParsePlan)?;
        Ok((plan, rest))
    }) {
        Ok(read) => read,
        Err(err) => {
            write_report(&stdio.status, &err.report());
            return ExitCode::SUCCESS;
        }
    };
    if leads(&plan.template) {
        init::exec_mode(&plan.template, &plan.command, stdio, rest);
        return ExitCode::SUCCESS;
    }
    match Worker::prepare(&plan.template, None) {
        Ok(worker) => worker.run(stdio, Some((plan.command, rest))),
        Err(err) => write_report(&stdio.status, &err.report()),
    }
    ExitCode::SUCCESS
}

/// The limits a command ran into, read from its cgroups `name` (for the fork server, which
/// reports for an init that could not).
pub fn limits_hit(template: &Template, name: &str) -> Vec<String> {
    end::Counters::open(template, name).hit()
}

/// Whether the commands of `template` are supervised by their pid namespace's init (`init`)
/// rather than by a helper.
pub fn leads(template: &Template) -> bool {
    template.sandbox.namespaces.contains(&Namespace::Pid)
}

/// Pool mode (forked by the fork server, `control` its end of a socket to us), for a template
/// without a pid namespace: prepare the sandbox at once (in the cgroup directories `lease`
/// names), then serve the command whose descriptors arrive on `control`, or, if `control`
/// closes first (the worker was not needed), take the sandbox down and exit.
pub fn serve_worker(template: &Template, control: OwnedFd, lease: Option<Lease>) -> ! {
    // fds 0, 1 and 2 of the helper itself: /dev/null (the command's descriptors are apart).
    sys::devnull_stdio(true);
    // No PR_SET_PDEATHSIG: killed with the fork server, we could not sweep the command's tree
    // (its processes outside a pid namespace would live on). An idle worker sees `control`
    // close when the fork server dies; a busy one sees its lifeline close, as a cold helper.
    let prepared = Worker::prepare(template, lease);
    let stdio = match crate::spawner::receive_stdio(&control) {
        Ok(Some(stdio)) => stdio,
        // Not needed: take the sandbox down.
        _ => {
            if let Ok(worker) = prepared {
                worker.dismiss();
            }
            sys::exit_child(0);
        }
    };
    drop(control);
    // Built ahead at a lower priority (spawner::AHEAD_NICE): the fork server set us back
    // already; our children too, unless one was being forked just then. Every fork of the
    // sandbox's set-up is done now, so this catches all: the command runs at the normal one.
    let _ = sys::set_nice(sys::NiceOf::Group(nix::unistd::getpid().as_raw()), 0);
    match prepared {
        Ok(worker) => worker.run(stdio, None),
        Err(err) => write_report(&stdio.status, &err.report()),
    }
    sys::exit_child(0)
}

/// How much of the lifeline one read takes: the most that can follow a line in the same read.
const LINE_CHUNK: usize = 16 * 1024;

/// One line, and whatever followed it in the same read (the daemon may write signal
/// requests after the command): read in chunks, not a byte per syscall (a plan is kilobytes).
fn read_line(fd: std::os::fd::BorrowedFd<'_>) -> Result<(Vec<u8>, Vec<u8>), SetupError> {
    let mut line = Vec::new();
    let mut chunk = vec![0u8; LINE_CHUNK];
    loop {
        match nix::unistd::read(fd, &mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                if let Some(end) = chunk[..n].iter().position(|b| *b == b'\n') {
                    line.extend_from_slice(&chunk[..end]);
                    return Ok((line, chunk[end + 1..n].to_vec()));
                }
                line.extend_from_slice(&chunk[..n]);
            }
            Err(Errno::EINTR) => {}
            Err(err) => return Err(SetupError::ReadPlan(err.into())),
        }
        if line.len() > MAX_PLAN_BYTES {
            return Err(SetupError::ReadPlan(std::io::Error::other("plan too long")));
        }
    }
    Ok((line, Vec::new()))
}

fn write_report(status: &OwnedFd, report: &HelperReport) {
    // If the daemon is gone there is nobody to tell; the tree is dead either way.
    let Ok(mut line) = serde_json::to_vec(report) else {
        return;
    };
    line.push(b'\n');
    let _ = status
        .try_clone()
        .map(|fd| std::fs::File::from(fd).write_all(&line));
}

/// A sandbox without a pid namespace built and waiting for its command.
pub struct Worker<'t> {
    template: &'t Template,
    /// Its cgroup directories' name (`w-<our pid>`, or the one the fork server lent).
    name: String,
    /// The payload.
    child: Pid,
    sigchld: SignalFd,
    /// From the payload: `Failed`, or end-of-file once it has exec'd.
    setup: payload::SetupReader,
    /// To the payload: the output descriptor and the command.
    channel: OwnedFd,
    /// The limits' counters of its cgroups.
    counters: end::Counters,
    /// What the fork server lent (cgroup directories), to give back at the end.
    lease: Option<Lease>,
}

impl<'t> Worker<'t> {
    /// Build the sandbox of `template` (which has no pid namespace: `leads`) and leave its
    /// payload waiting for a command, in the cgroup directories `lease` names or in new ones.
    /// The order matters; each step says why.
    pub fn prepare(template: &'t Template, lease: Option<Lease>) -> Result<Self, SetupError> {
        // 1. Forking and credential changes below assume one thread: check, do not hope.
        sys::assert_single_threaded().map_err(SetupError::Process)?;

        // 2. Nothing the daemon or the fork server held may reach the command: every fd above
        //    stderr closes on exec (ours are opened close-on-exec from here on).
        sys::cloexec_fds_above_stderr().map_err(SetupError::Process)?;

        // 3. A new session: the command has no controlling terminal (so no TIOCSTI injection
        //    into the daemon's terminal) and a process group apart from the daemon's.
        nix::unistd::setsid().map_err(SetupError::Session)?;

        // 4. Child subreaper: when the shell's children double-fork or call setsid, their
        //    orphans are reparented to us instead of init, so the final sweep finds them.
        nix::sys::prctl::set_child_subreaper(true).map_err(SetupError::Subreaper)?;

        // 5. SIGCHLD arrives on a signalfd, so one poll waits for "child exited" and "daemon
        //    closed the lifeline" together, without signal handlers. SIGPIPE is blocked too:
        //    a report to a daemon that stopped reading fails with EPIPE instead of killing
        //    us before the sweep. The payload resets the mask.
        let mut mask = SigSet::empty();
        mask.add(Signal::SIGCHLD);
        let mut blocked = mask;
        blocked.add(Signal::SIGPIPE);
        blocked.thread_block().map_err(SetupError::Signals)?;
        let sigchld = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
            .map_err(SetupError::Signals)?;

        // 6. Cgroups: create the command's (or take those the fork server lent, used by a
        //    command of this template before) and set its limits, so that everything we fork
        //    is born inside (and cgroup.kill later takes all of it at once). The cgroup2
        //    directory is entered by the child at its birth (clone3 CLONE_INTO_CGROUP, no
        //    attach for us to make and undo); v1 hierarchies, or a kernel before 5.7, need us
        //    to join first.
        let lent = lease.as_ref().and_then(|l| l.cgroup.clone());
        let existing = lent.as_ref().is_some_and(|c| c.existing);
        let name = lent.map_or_else(|| cgroup_name(std::process::id()), |c| c.name);
        let mut placed = Placed::default();
        if let Err(err) = enter_cgroups(template, &name, existing, &mut placed) {
            // Leave nothing behind for a command that never ran.
            let _ = leave_cgroups(&placed);
            end::remove_cgroups(template, &name);
            return Err(err);
        }
        // The limits' counters, open before the fork: read-only files, not the directory
        // (nothing can be opened or written through them), and closed on exec: the command
        // never holds them.
        let counters = end::Counters::open(template, &name);

        // 7. Fork the payload. It says on the setup pipe when it is confined and waiting.
        let made = nix::unistd::pipe2(OFlag::O_CLOEXEC)
            .and_then(|setup| {
                let channel = nix::sys::socket::socketpair(
                    nix::sys::socket::AddressFamily::Unix,
                    nix::sys::socket::SockType::Stream,
                    None,
                    nix::sys::socket::SockFlag::SOCK_CLOEXEC,
                )?;
                Ok((setup, channel))
            })
            .map_err(|e| SetupError::Process(e.into()));
        let forked = made.and_then(|ends| Ok((ends, fork_placed(template, &name, &mut placed)?)));
        let (((setup_r, setup_w), (ours, theirs)), forked) = match forked {
            Ok(done) => done,
            Err(err) => {
                let _ = leave_cgroups(&placed);
                end::remove_cgroups(template, &name);
                return Err(err);
            }
        };
        let child = match forked {
            Forked::Child => {
                // The cgroup directory stays the helper's: nothing in the sandbox may hold it.
                drop((placed, setup_r, ours, sigchld, lease, counters));
                payload::payload_main(
                    template,
                    setup_w.as_fd(),
                    payload::Source::Helper(theirs.as_fd()),
                );
            }
            Forked::Parent(child) => child,
        };
        drop((setup_w, theirs));

        // 8. Back out of the cgroups we joined, so that killing them never kills us.
        let left = leave_cgroups(&placed);

        // 9. Wait for the payload to be confined and waiting (no step waits on anything
        //    outside the machine, so this is short).
        let mut setup = payload::SetupReader::new(setup_r);
        let ready = setup.ready();
        let worker = Self {
            template,
            name,
            child,
            sigchld,
            setup,
            channel: ours,
            counters,
            lease,
        };
        if let Err(err) = left.and(ready) {
            worker.dismiss();
            return Err(err);
        }
        Ok(worker)
    }

    /// Take the sandbox down without running anything: sweep, then give back or remove what
    /// it used.
    pub fn dismiss(self) {
        let mut status = None;
        let swept = end::sweep(self.template, &self.name, self.child, &mut status);
        release(
            self.template,
            &self.name,
            self.lease,
            &self.counters,
            &swept,
            0,
        );
    }

    /// Run the command: hand it and the output pipe to the waiting payload, wait for the end,
    /// kill what is left, write the report on the status pipe, clean up. `command` is read
    /// from the lifeline when not given (a warm worker learns it only now).
    pub fn run(mut self, stdio: Stdio, command: Option<(CommandPlan, Vec<u8>)>) {
        let Stdio {
            lifeline,
            output,
            status,
        } = stdio;
        let (command, rest) = match command.map(Ok).unwrap_or_else(|| {
            read_line(lifeline.as_fd()).and_then(|(line, rest)| {
                let command =
                    serde_json::from_slice::<CommandPlan>(&line).map_err(SetupError::ParsePlan)?;
                Ok((command, rest))
            })
        }) {
            Ok(command) => command,
            Err(err) => {
                write_report(&status, &err.report());
                self.dismiss();
                return;
            }
        };
        // 10. The payload takes the output pipe and the command; we drop our copy of the
        //     pipe, so the daemon sees end-of-file exactly when the last process of the
        //     command's tree is gone. 11. It enters the working directory and execs.
        let handed = payload::send_command(&self.channel, output, &command)
            .and_then(|()| self.setup.exec_done(&lifeline));
        if let Err(err) = handed {
            write_report(&status, &err.report());
            self.dismiss();
            return;
        }
        write_report(&status, &HelperReport::Started);

        // 12. Wait for the payload to exit, or for the daemon to close the lifeline; pass on
        //     the signals it asks for meanwhile.
        let ending = end::wait_for_end(self.child, &self.sigchld, &lifeline, rest);
        let (mut exit, stopped) = (ending.exit, ending.stopped);
        let counted = end::count(self.template, &self.name);

        // 13. Kill whatever the command left behind and note the limits it hit.
        let sweep = end::sweep(self.template, &self.name, self.child, &mut exit);
        let limits_hit = self.counters.hit();
        let (code, signal) = end::decode(exit);
        let killed = counted.unwrap_or(sweep.killed);
        // 14. Report first (the daemon's result waits for it), then remove the cgroups.
        write_report(
            &status,
            &HelperReport::Finished {
                code,
                signal,
                killed,
                stopped,
                layers: self.template.layers.clone(),
                limits_hit,
            },
        );
        drop(status);
        release(
            self.template,
            &self.name,
            self.lease,
            &self.counters,
            &sweep,
            killed,
        );
    }
}

/// The helper's last act, once the command has been reported: give back the cgroup
/// directories the fork server lent if every process that was in them is gone (we have no
/// child left), they are clean, the command left no process behind (`killed`, the count its
/// result reports) and the sweep did not kill through them (`spawner::cgroup_pool`); remove
/// the directories that are not given back. The helper exits next.
fn release(
    template: &Template,
    name: &str,
    lease: Option<Lease>,
    counters: &end::Counters,
    swept: &end::Swept,
    killed: u32,
) {
    let all_reaped = matches!(
        nix::sys::wait::waitpid(
            Pid::from_raw(-1),
            Some(nix::sys::wait::WaitPidFlag::WNOHANG)
        ),
        Err(Errno::ECHILD)
    );
    let lease = lease.filter(|_| all_reaped);
    let clean = lease.as_ref().is_some_and(|l| l.cgroup.is_some())
        && killed == 0
        && !swept.by_cgroup
        && end::cgroups_clean(template, name, counters);
    if !clean {
        end::remove_cgroups(template, name);
    }
    if let Some(lease) = lease {
        lease.give_back(clean);
    }
}

/// Where the helper stands before forking the command's first process.
#[derive(Default)]
struct Placed {
    /// The command's cgroup2 directory, open for clone3 to start the child inside.
    into: Option<OwnedFd>,
    /// Cgroups we had to go back from after the fork (their `home`): those joined.
    joined: Vec<PathBuf>,
}

/// Enter the command's cgroups `name`: made here, or, `existing`, those a command of the
/// template ran in before (made again if they are gone); the settings written either way.
fn enter_cgroups(
    template: &Template,
    name: &str,
    existing: bool,
    placed: &mut Placed,
) -> Result<(), SetupError> {
    for cg in &template.cgroups {
        let dir = cg.dir(name);
        // The caller's own directory is there already; one lent again, unless it is gone.
        let there = cg.is_parent || (existing && dir.is_dir());
        if !there {
            create_fresh(&dir)?;
        }
        for (file, value) in &cg.settings {
            cgroup::set(&dir, file, value).map_err(SetupError::Cgroup)?;
        }
        if cg.kill {
            let fd = nix::fcntl::open(
                &dir,
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
                nix::sys::stat::Mode::empty(),
            );
            if let Ok(fd) = fd {
                placed.into = Some(fd);
                continue;
            }
        }
        cgroup::join(&dir).map_err(SetupError::Cgroup)?;
        placed.joined.push(cg.home.clone());
    }
    Ok(())
}

/// Create `dir`; one left by a dead helper of the same pid is emptied and made anew.
pub fn create_fresh(dir: &std::path::Path) -> Result<(), SetupError> {
    match cgroup::create(dir) {
        Err(cgroup::CgroupError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::AlreadyExists =>
        {
            cgroup::kill(dir);
            cgroup::remove(dir);
            cgroup::create(dir).map_err(SetupError::Cgroup)
        }
        other => other.map_err(SetupError::Cgroup),
    }
}

/// Fork the command's first process: born in the cgroup2 directory where the kernel can,
/// otherwise after joining it.
fn fork_placed(template: &Template, name: &str, placed: &mut Placed) -> Result<Forked, SetupError> {
    if let Some(dir) = &placed.into {
        match sys::fork_into_cgroup(dir.as_fd()) {
            Ok(forked) => return Ok(forked),
            // No clone3, or no CLONE_INTO_CGROUP (before Linux 5.7).
            Err(err)
                if matches!(
                    err.raw_os_error(),
                    Some(libc::ENOSYS | libc::EINVAL | libc::E2BIG | libc::EOPNOTSUPP)
                ) =>
            {
                placed.into = None;
                if let Some(cg) = template.cgroups.iter().find(|c| c.kill) {
                    cgroup::join(&cg.dir(name)).map_err(SetupError::Cgroup)?;
                    placed.joined.push(cg.home.clone());
                }
            }
            Err(err) => return Err(SetupError::Process(err)),
        }
    }
    sys::fork().map_err(SetupError::Process)
}

fn leave_cgroups(placed: &Placed) -> Result<(), SetupError> {
    for home in &placed.joined {
        cgroup::join(home).map_err(SetupError::Cgroup)?;
    }
    Ok(())
}
