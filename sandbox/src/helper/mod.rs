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
//!   a session of its own, outside the command's cgroups, which starts the payload in its own
//!   memory, born into them, watches it, sweeps what it left (`end`), reports and gives back
//!   what it was lent.
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
//! Either supervisor starts its payload in its own memory (`payload::start`), where it
//! confines itself and waits for the command's descriptors from the fork server, and waits
//! until it has exec'd: no copy of the supervisor's address space is made per command
//! (ARCHITECTURE.md, decision "Init leads", and "A helper's payload in its memory").
//!
//! The setup order is in `init::prepare`, [`Worker::prepare`] and [`Worker::serve`] (helper)
//! and `payload::payload_main`; how a helper's command ends is in `end.rs`.

mod end;
mod init;
mod payload;

pub use init::{birth_cgroup, serve as serve_init, Loans as InitLoans, Place};

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

use crate::apply::SandboxError;
use crate::cgroup;
use crate::plan::{cgroup_name, HelperReport, Template};
use crate::profile::Namespace;
use crate::sys;
use crate::wire::lease::Lease;
use crate::wire::{self, Stdio};

/// `argv[1]` that selects helper mode. Checked in `main` before anything else runs.
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

/// What a payload writes on the setup pipe when a step failed (one JSON line). End-of-file
/// without it means the exec happened (or the payload was dismissed, or died: `payload::start`).
#[derive(Serialize, Deserialize)]
#[serde(tag = "note", rename_all = "snake_case")]
enum ChildNote {
    Failed { stage: String, message: String },
}

/// Exec mode (a daemon without its fork server): the template (its length first, then the
/// JSON) and then the lifeline, starting with the command line, on stdin, the output pipe on stdout, the status pipe on stderr. Always exits 0: the outcome
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
    // The template, its length first: the lifeline then stands at the command line, where a
    // fork server's worker finds it.
    let template = match read_template(stdio.lifeline.as_fd()) {
        Ok(template) => template,
        Err(err) => {
            write_report(&stdio.status, &err.report());
            return ExitCode::SUCCESS;
        }
    };
    if leads(&template) {
        init::exec_mode(&template, stdio);
        return ExitCode::SUCCESS;
    }
    let worker = match Worker::prepare(&template, None) {
        Ok(worker) => worker,
        Err(err) => {
            write_report(&stdio.status, &err.report());
            return ExitCode::SUCCESS;
        }
    };
    // We stand in for the fork server: the payload takes the command's descriptors from us
    // (our copies close, so that only the command holds the output pipe).
    let control = nix::sys::socket::socketpair(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::SeqPacket,
        None,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
    );
    let sent = control
        .map_err(std::io::Error::from)
        .and_then(|(ours, theirs)| {
            wire::send_stdio(&ours, [&stdio.lifeline, &stdio.output, &stdio.status])?;
            Ok(theirs)
        });
    match sent {
        Ok(theirs) => {
            drop(stdio);
            worker.serve(&theirs);
        }
        Err(err) => {
            write_report(&stdio.status, &SetupError::Process(err).report());
            worker.dismiss(None);
        }
    }
    ExitCode::SUCCESS
}

/// Exec mode's first read: the template's length in decimal on a line of its own, then the
/// template (JSON), read to its last byte and no further.
fn read_template(fd: std::os::fd::BorrowedFd<'_>) -> Result<Template, SetupError> {
    let short = |what: &str| SetupError::ReadPlan(std::io::Error::other(what.to_string()));
    let mut digits = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        match nix::unistd::read(fd, &mut byte) {
            Ok(0) => return Err(short("the lifeline ended before the template")),
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) if digits.len() < 12 => digits.push(byte[0]),
            Ok(_) => return Err(short("the template's length is not a number")),
            Err(Errno::EINTR) => {}
            Err(err) => return Err(SetupError::ReadPlan(err.into())),
        }
    }
    let len = std::str::from_utf8(&digits)
        .ok()
        .and_then(|d| d.parse::<usize>().ok())
        .filter(|len| *len <= MAX_PLAN_BYTES)
        .ok_or_else(|| short("the template's length is not a number"))?;
    let mut template = vec![0u8; len];
    let mut got = 0;
    while got < len {
        match nix::unistd::read(fd, &mut template[got..]) {
            Ok(0) => return Err(short("the lifeline ended within the template")),
            Ok(n) => got += n,
            Err(Errno::EINTR) => {}
            Err(err) => return Err(SetupError::ReadPlan(err.into())),
        }
    }
    serde_json::from_slice(&template).map_err(SetupError::ParsePlan)
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
    // (its processes outside a pid namespace would live on). An idle worker's payload sees
    // `control` close when the fork server dies; a busy one sees its lifeline close.
    match Worker::prepare(template, lease) {
        Ok(worker) => worker.serve(&control),
        // Nothing ran: report the failure to the command that comes for this worker.
        Err(err) => report_to_next(&control, &err),
    }
    sys::exit_child(0)
}

/// Report `err` to the command that comes on `control` (none comes when it closes first).
fn report_to_next(control: &OwnedFd, err: &SetupError) {
    if let Ok(Some(stdio)) = wire::receive_stdio(control) {
        write_report(&stdio.status, &err.report());
    }
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

/// A sandbox without a pid namespace being built: its helper's part done (session,
/// subreaper, the command's cgroups), its payload still to start ([`Worker::serve`]).
pub struct Worker<'t> {
    template: &'t Template,
    /// Its cgroup directories' name (`w-<our pid>`, or the one the fork server lent).
    name: String,
    sigchld: SignalFd,
    /// The cgroup2 directory the payload is born in (`CLONE_INTO_CGROUP`), open.
    into: Option<OwnedFd>,
    /// The limits' counters of its cgroups.
    counters: end::Counters,
    /// The command's cgroup directories we made or were lent, as C strings: removed without
    /// allocating after a payload that died where it may have held the allocator.
    dirs: Vec<std::ffi::CString>,
    /// What the fork server lent (cgroup directories), to give back at the end.
    lease: Option<Lease>,
}

impl<'t> Worker<'t> {
    /// The helper's part of the sandbox of `template` (which has no pid namespace: `leads`),
    /// in the cgroup directories `lease` names or in new ones. The order matters; each step
    /// says why.
    pub fn prepare(template: &'t Template, lease: Option<Lease>) -> Result<Self, SetupError> {
        // 1. The payload's start in our memory (only one thread may use the allocator while
        //    it does) and the process-wide changes below assume one thread: check, do not hope.
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
        //    command of this template before) and set its limits, so that everything of the
        //    command is born inside (and cgroup.kill later takes all of it at once). The
        //    payload is born in the cgroup2 directory (clone3 CLONE_INTO_CGROUP) and joins
        //    the v1 hierarchies itself; we never join any, so killing them never kills us.
        let lent = lease.as_ref().and_then(|l| l.cgroup.clone());
        let existing = lent.as_ref().is_some_and(|c| c.existing);
        let name = lent.map_or_else(|| cgroup_name(std::process::id()), |c| c.name);
        let into = match make_cgroups(template, &name, existing) {
            Ok(into) => into,
            Err(err) => {
                // Leave nothing behind for a command that never ran.
                end::remove_cgroups(template, &name);
                return Err(err);
            }
        };
        // The limits' counters, open now: read-only files, not the directory (nothing can be
        // opened or written through them), and closed on exec: the command never holds them.
        let counters = end::Counters::open(template, &name);
        let dirs = template
            .cgroups
            .iter()
            .filter(|cg| !cg.is_parent)
            .filter_map(|cg| {
                let dir = cg.dir(&name).into_os_string().into_encoded_bytes();
                std::ffi::CString::new(dir).ok()
            })
            .collect();
        Ok(Self {
            template,
            name,
            sigchld,
            into,
            counters,
            dirs,
            lease,
        })
    }

    /// Start the payload in our memory (`payload::start`): it confines itself, takes the
    /// command's descriptors from the fork server on `control`, hands us the lifeline and the
    /// status pipe, and execs. Then: `started`, wait for the end, kill what is left, report
    /// on the status pipe, clean up. A failure is reported to the command that comes.
    pub fn serve(self, control: &OwnedFd) {
        // 7. The payload, in its cgroups from its birth (those it was not born in it joins).
        let joins: Vec<PathBuf> = self
            .template
            .cgroups
            .iter()
            .filter(|cg| !cg.kill || self.into.is_none())
            .map(|cg| cg.dir(&self.name))
            .collect();
        let kill_dir = self
            .template
            .cgroups
            .iter()
            .find(|cg| cg.kill)
            .map(|cg| cg.dir(&self.name));
        let birth = payload::Birth {
            into: self.into.as_ref().map(AsFd::as_fd).zip(kill_dir.as_deref()),
            join: joins.iter().map(PathBuf::as_path).collect(),
        };
        let started = payload::Channels::new().and_then(|channels| {
            payload::start(
                self.template,
                control.as_fd(),
                channels,
                &self.sigchld,
                &birth,
            )
        });
        let started = match started {
            Ok(Some(started)) => started,
            Ok(None) => {
                // Disturbed before its hand-off (reported): clean up allocating nothing.
                self.remove_without_allocating();
                sys::exit_child(0)
            }
            Err(err) => {
                report_to_next(control, &err);
                self.dismiss(None);
                return;
            }
        };
        let Some(handed) = payload::take_handoff(&started.handoff, control.as_fd()) else {
            // No command came: the payload was dismissed (it exited cleanly), or failed
            // before its command (reported to the command that comes for this worker).
            if let Some(err) = &started.failure {
                report_to_next(control, err);
            }
            self.dismiss(Some(started.pid));
            return;
        };
        let payload::HandedOver {
            main,
            lifeline,
            status,
            rest,
        } = handed;
        if let Some(err) = &started.failure {
            write_report(&status, &err.report());
            self.dismiss(Some(main));
            return;
        }
        write_report(&status, &HelperReport::Started);

        // 8. Wait for the command's first process to exit, or for the daemon to close the
        //    lifeline; pass on the signals it asks for meanwhile. (A payload that exited
        //    while we waited for it is reaped already.)
        let ended = started.ended.filter(|_| main == started.pid);
        let ending = end::wait_for_end(main, ended, &self.sigchld, &lifeline, rest);
        let (mut exit, stopped) = (ending.exit, ending.stopped);
        let counted = end::count(self.template, &self.name);

        // 9. Kill whatever the command left behind and note the limits it hit.
        let sweep = end::sweep(self.template, &self.name, main, &mut exit);
        let limits_hit = self.counters.hit();
        let (code, signal) = end::decode(exit);
        let killed = counted.unwrap_or(sweep.killed);
        // 10. Report first (the daemon's result waits for it), then remove the cgroups.
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

    /// Take the sandbox down without running anything (`child`: the payload, if one started):
    /// sweep, then give back or remove what it used.
    pub fn dismiss(self, child: Option<Pid>) {
        let mut status = None;
        let child = child.unwrap_or_else(|| Pid::from_raw(0));
        let swept = end::sweep(self.template, &self.name, child, &mut status);
        release(
            self.template,
            &self.name,
            self.lease,
            &self.counters,
            &swept,
            0,
        );
    }

    /// After a payload disturbed before its hand-off: reap it and remove the cgroup
    /// directories, without the allocator (the payload may have died holding it). Nothing
    /// is given back.
    fn remove_without_allocating(&self) {
        while !matches!(
            nix::sys::wait::waitpid(Pid::from_raw(-1), None),
            Err(Errno::ECHILD)
        ) {}
        for dir in &self.dirs {
            for _ in 0..50 {
                match sys::remove_dir_made(dir) {
                    Err(err) if err.raw_os_error() == Some(libc::EBUSY) => {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    _ => break,
                }
            }
        }
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

/// Make the command's cgroups `name` (or, `existing`, take those a command of the template
/// ran in before, made again if they are gone) and write their settings. Returns the cgroup2
/// directory the payload is to be born in (`cgroup.kill`), open.
fn make_cgroups(
    template: &Template,
    name: &str,
    existing: bool,
) -> Result<Option<OwnedFd>, SetupError> {
    let mut into = None;
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
            into = fd.ok();
        }
    }
    Ok(into)
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
