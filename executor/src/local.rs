//! The operator's own commands: `executor run` (one command, locally, through the daemon's
//! path), `executor check` (what this host can enforce) and `executor tls-fingerprint`.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context};
use protocol::{Ending, ServerMessage};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use crate::engine::default_limits;
use crate::runner::{OutputSink, StopReason};
use crate::serve::host_facts;
use crate::setup::{setup, Paths, ProfileChoice, Setup};
use crate::{
    cgroup, default_state_dir, interpreter, local_runtime, request, runtime, server, workspaces,
    CheckArgs, RunArgs, TlsFingerprintArgs,
};

/// The home directory of one `executor run`: private to the command's identity, removed when
/// the run ends. Made in [`homes_dir`], named `executor-home-<pid>-ns<pid namespace>-<random>`,
/// so that a later run can tell when its run died without removing it
/// ([`remove_stale_homes`]).
struct TempHome {
    dir: std::path::PathBuf,
    /// The [`homes_dir`] it is in; `None` where that could not be trusted.
    homes: Option<std::path::PathBuf>,
    /// Handed to another uid (the profile's user): processes of that uid outside the sandbox
    /// may have shaped it too.
    handed: bool,
}

/// What every home's name starts with.
const HOME_PREFIX: &str = "executor-home-";
/// How long a run waits at its end for the removal of killed runs' homes: a dead command's
/// tree may be large, and it is not this run's to wait for (the next run goes on).
const STALE_SWEEP_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// `$TMPDIR/executor-homes-<euid>`, where this user's runs make their homes: made if missing,
/// mode 0711 (a command of another uid reaches its own home in it, lists nothing, creates
/// nothing). `None` where it is not a directory of ours that only we may write (someone made
/// it first): homes then go straight into `$TMPDIR`, and no killed run's is removed, since
/// only in a directory of ours is every entry one a run made.
fn homes_dir() -> Option<std::path::PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let euid = nix::unistd::geteuid().as_raw();
    let dir = std::env::temp_dir().join(format!("executor-homes-{euid}"));
    match std::fs::DirBuilder::new().mode(0o711).create(&dir) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(_) => return None,
    }
    // Checked and given its mode through one descriptor that follows no symlink (the umask
    // may have narrowed the mode at creation).
    let fd = nix::fcntl::open(
        &dir,
        nix::fcntl::OFlag::O_RDONLY
            | nix::fcntl::OFlag::O_DIRECTORY
            | nix::fcntl::OFlag::O_NOFOLLOW
            | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    );
    let ours = fd.ok().and_then(|fd| {
        let meta = std::fs::File::from(fd);
        let st = meta.metadata().ok()?;
        (st.uid() == euid && st.mode() & 0o022 == 0)
            .then(|| nix::sys::stat::fchmod(&meta, nix::sys::stat::Mode::from_bits_truncate(0o711)))
            .and_then(Result::ok)
    });
    if ours.is_none() {
        eprintln!(
            "executor: {} is not this user's own directory: the home goes into {} and homes of killed runs are not removed",
            dir.display(),
            std::env::temp_dir().display()
        );
        return None;
    }
    Some(dir)
}

impl TempHome {
    fn create(owner: Owner) -> anyhow::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let ours = format!(
            "{HOME_PREFIX}{}-ns{}",
            std::process::id(),
            cgroup::pid_namespace()
        );
        let homes = homes_dir();
        let parent = homes.clone().unwrap_or_else(std::env::temp_dir);
        for _ in 0..16 {
            let mut bytes = [0u8; 8];
            getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no random bytes: {e}"))?;
            let dir = parent.join(format!("{ours}-{}", hex::encode(bytes)));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {}
                Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(err) => {
                    return Err(err).with_context(|| format!("cannot create {}", dir.display()))
                }
            }
            let home = Self {
                dir,
                homes: homes.clone(),
                handed: owner.is_some(),
            };
            // `{home}/tmp`: TMPDIR in profiles that use it.
            let tmp = home.dir.join("tmp");
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&tmp)
                .with_context(|| format!("cannot create {}", tmp.display()))?;
            if let Some((uid, gid)) = owner {
                for dir in [&home.dir, &tmp] {
                    nix::unistd::chown(
                        dir,
                        Some(nix::unistd::Uid::from_raw(uid)),
                        Some(nix::unistd::Gid::from_raw(gid)),
                    )
                    .with_context(|| format!("cannot hand {} to uid {uid}", dir.display()))?;
                }
            }
            return Ok(home);
        }
        bail!("cannot find a free name for a home directory in the temporary directory")
    }
}

/// Remove the homes in `dir` (our [`homes_dir`]) of runs of our pid namespace that are gone
/// (a run killed by SIGKILL cannot remove its own). Those of other pid namespaces are not ours
/// to judge (their pids mean nothing here), nor names of another shape. A dead command may
/// have shaped its home, so nothing beneath one is unmounted: a home with a mount beneath it
/// stays.
fn remove_stale_homes(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let ns = format!("-ns{}-", cgroup::pid_namespace());
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| home_run(n, &ns)) else {
            continue;
        };
        // Asked of the kernel, in our pid namespace (a /proc mounted for another namespace
        // would answer for its own pids).
        let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX));
        if nix::sys::signal::kill(pid, None) == Err(nix::errno::Errno::ESRCH) {
            let _ = workspaces::remove_unmounting_nothing(&entry.path());
        }
    }
}

/// The pid of the run a home named `name` is of, when it is of our pid namespace (`ns`:
/// `-ns<inode>-`).
fn home_run(name: &str, ns: &str) -> Option<u32> {
    let (pid, random) = name.strip_prefix(HOME_PREFIX)?.split_once(ns)?;
    let random_ok = random.len() == 16 && random.bytes().all(|b| b.is_ascii_hexdigit());
    random_ok.then(|| pid.parse().ok()).flatten()
}

impl Drop for TempHome {
    fn drop(&mut self) {
        // A home handed to another uid is removed as a killed run's is, unmounting nothing:
        // its command cannot mount, but a process of that uid outside the sandbox might
        // (FUSE), and turn a path into a symlink before the unmount (`workspaces`).
        let removed = if self.handed {
            workspaces::remove_unmounting_nothing(&self.dir)
        } else {
            workspaces::remove(&self.dir)
        };
        if let Err(err) = removed {
            eprintln!("executor: cannot remove {}: {err}", self.dir.display());
        }
    }
}

/// `executor run`: one command, output streamed to stdout, exit code passed on.
pub(crate) fn run_local(args: RunArgs) -> anyhow::Result<ExitCode> {
    let mut limits = default_limits();
    if let Some(bytes) = args.common.max_output_bytes {
        limits.max_output_bytes = bytes;
    }
    let cwd = match args.cwd {
        Some(cwd) => cwd,
        None => std::env::current_dir().context("cannot read the current directory")?,
    };
    let cwd = std::path::absolute(&cwd).unwrap_or(cwd);
    let mut env = BTreeMap::new();
    for pair in &args.env {
        let Some((name, value)) = pair.split_once('=') else {
            bail!("--env expects NAME=VALUE, got {pair:?}");
        };
        env.insert(name.to_string(), value.to_string());
    }
    let request = protocol::ExecRequest {
        id: "local".into(),
        command: args.command.join(" "),
        cwd: Some(cwd.display().to_string()),
        env,
        timeout: Some(args.timeout),
        profile: args.profile,
        stream: true,
    };
    let valid = request::validate(request, &limits)?;
    let interpreter = interpreter(&args.common.interpreter)?;
    // Before the runtime's threads exist: a fork server forked from us spares the run an
    // exec of our binary as its helper. Where it cannot be made, the helper is exec'd.
    // The fork server makes the command's network namespace while we set up, when the named
    // profile is one that makes one.
    let named = valid
        .profile
        .as_deref()
        .and_then(crate::profile::Profile::builtin)
        .and_then(Result::ok);
    let ahead = crate::spawner::Ahead {
        net: named
            .as_ref()
            .is_some_and(|p| p.namespaces.contains(&crate::profile::Namespace::Net)),
    };
    let spawner = crate::spawner::fork_here(ahead)
        .map_err(|err| tracing::debug!(%err, "no forked fork server: the helper is exec'd"))
        .ok();
    // The home of a named built-in profile that gives one is made on a thread of its own
    // while we set up: two `mkdir`s on `$TMPDIR`, 0.2 ms on a fresh ext4 file system and over
    // a millisecond in this machine's much-used /tmp.
    let early_home = named.as_ref().and_then(home_owner).map(HomeAhead::start);
    let cgroups = cgroup::prepare(
        std::process::id(),
        &cgroup::Placement {
            one_command: true,
            ..cgroup::Placement::default()
        },
    );
    // Before Linux 5.5 the helper's first cgroup v1 move would wait for an RCU grace period:
    // let it start now, beside the rest of the set-up.
    cgroup::warm_attach(&cgroups);
    let rt = local_runtime()?;
    let Setup {
        mut engine,
        cgroups,
        ..
    } = rt.block_on(setup(
        limits,
        interpreter,
        Paths {
            workspace: cwd.clone(),
            home: std::env::temp_dir(),
            state_dir: default_state_dir(),
            daemon_files: Vec::new(),
        },
        cgroups,
        ProfileChoice {
            default: valid.profile.clone(),
            only_default: true,
            ..ProfileChoice::default()
        },
        spawner,
    ))?;
    // One command: a worker kept warm for a next one would only be built and killed.
    engine.runner.warm_workers = false;
    // `{home}`: a directory of this run's own, as the command's identity, gone afterwards;
    // none where the profile gives its commands none (strict's HOME is its private /tmp).
    let profile = engine
        .profiles
        .get(valid.profile.as_deref().unwrap_or(&engine.default_profile));
    let early_home = early_home.and_then(HomeAhead::take);
    let home = match profile.and_then(home_owner) {
        Some(owner) => {
            let home = match early_home {
                Some((made_for, Some(made))) if made_for == owner => made?,
                // Not made ahead (or for another identity: removed here), or its thread
                // could not start or panicked: made now.
                other => {
                    drop(other);
                    TempHome::create(owner)?
                }
            };
            engine.plan_settings.home = home.dir.clone();
            Some(home)
        }
        None => {
            // One made ahead for a profile that gives none (it cannot be: the same built-in).
            drop(early_home);
            // Fail closed: were `{home}` named after all, it names nothing (not the temporary
            // directory, which every command shares).
            engine.plan_settings.home = "/nonexistent".into();
            None
        }
    };
    let kept = engine.limits.max_output_bytes;
    // Kept past the command: our end of the fork server's socket stays open until it has
    // taken over the cgroup directories (below).
    let fork_server = engine.runner.spawner();
    let code = rt.block_on(async move {
        let (tx, mut rx) = mpsc::channel::<ServerMessage>(16);
        // tokio's stdout: a reader that stops reading blocks its writes, never the runtime's
        // one thread (the timeout still fires).
        let printer = tokio::spawn(async move {
            let mut stdout = tokio::io::stdout();
            while let Some(msg) = rx.recv().await {
                if let ServerMessage::Output(chunk) = msg {
                    let _ = stdout.write_all(chunk.data.as_bytes()).await;
                    let _ = stdout.flush().await;
                }
            }
        });
        let sink = OutputSink {
            id: valid.id.clone(),
            to: Arc::new(tx),
        };
        let stop = async {
            let _ = tokio::signal::ctrl_c().await;
            StopReason::Cancelled
        };
        let result = engine
            .execute(&valid, crate::runner::Io::Capture(Some(sink)), stop)
            .await;
        let _ = printer.await;
        let result = result.map_err(|e| anyhow::anyhow!("{}: {}", e.code, e.message))?;
        if !result.exception_info.is_empty() {
            eprintln!("executor: {}", result.exception_info);
        }
        if result.extra.truncated {
            eprintln!(
                "executor: output was {} bytes; the result kept {kept} of them (head and tail)",
                result.extra.output_bytes
            );
        }
        Ok(exit_code(result.returncode, result.extra.ended))
    });
    // The command's tree is gone: its home (on ext4, mounted with `discard` here, an rmdir
    // waits for its block's discard) and its cgroups go side by side, and so do the homes of
    // runs killed before they could remove theirs, waited for only so long.
    let swept = home.as_ref().and_then(|h| h.homes.clone()).map(|dir| {
        let (done, swept) = std::sync::mpsc::channel::<()>();
        let _ = std::thread::Builder::new().spawn(move || {
            remove_stale_homes(&dir);
            let _ = done.send(());
        });
        swept
    });
    let removing = home.map(|home| std::thread::Builder::new().spawn(move || drop(home)));
    remove_cgroups(&cgroups, fork_server);
    if let Some(Ok(thread)) = removing {
        let _ = thread.join();
    }
    if let Some(swept) = swept {
        let _ = swept.recv_timeout(STALE_SWEEP_WAIT);
    }
    code
}

/// Remove the run's cgroup directories: at once where they are empty, else (the command's
/// init still on its way out, tearing down its namespaces) by the fork server after we exit
/// (`spawner::one_shot`), or, without one that takes them over, here, waiting for them.
/// Empty ones are not handed over too: on a machine at rest the server's core has to wake for
/// it, which cost more than the `rmdir`s (landlock one-shot, alone: +0.14 to +0.39 ms p50).
fn remove_cgroups(cgroups: &cgroup::CgroupRoot, fork_server: Option<Arc<crate::spawner::Spawner>>) {
    let busy: Vec<std::path::PathBuf> = cgroups
        .all()
        .map(|hierarchy| hierarchy.parent.clone())
        .filter(|dir| !cgroup::try_remove(dir))
        .collect();
    if busy.is_empty() {
        return;
    }
    let handed = fork_server.is_some_and(|server| server.remove_after(&busy).is_ok());
    if !handed {
        for dir in &busy {
            cgroup::remove(dir);
        }
    }
}

/// Who a home is made for: a uid and gid to hand it to, or ourselves.
type Owner = Option<(u32, u32)>;

/// The home being made on a thread of its own while the run sets up, for the identity
/// `owner`. Dropped untaken (the run failed first), it waits for the thread, so that the
/// home is removed, not left half made by a process that exits meanwhile.
struct HomeAhead {
    owner: Owner,
    thread: Option<std::thread::JoinHandle<anyhow::Result<TempHome>>>,
}

impl HomeAhead {
    fn start(owner: Owner) -> Self {
        let thread = std::thread::Builder::new()
            .name("home".into())
            .spawn(move || TempHome::create(owner))
            .ok();
        Self { owner, thread }
    }

    /// For whom it was made, and what came of it (`None`: the thread did not start or panicked).
    fn take(mut self) -> Option<(Owner, Option<anyhow::Result<TempHome>>)> {
        let made = self.thread.take()?.join().ok();
        Some((self.owner, made))
    }
}

impl Drop for HomeAhead {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Whose `{home}` a command of `profile` gets: `Some` where the profile gives its commands a
/// home (strict's HOME is its private /tmp), with the owner it needs (the profile's user,
/// when we are root and can hand it over).
fn home_owner(profile: &crate::profile::Profile) -> Option<Owner> {
    profile.uses_home().then(|| {
        profile
            .user
            .as_ref()
            .filter(|_| nix::unistd::geteuid().is_root())
            .map(|u| (u.uid, u.gid))
    })
}

/// `executor check`: which layers and profiles this host supports, and why not.
pub(crate) fn check(args: CheckArgs) -> anyhow::Result<ExitCode> {
    let rt = runtime()?;
    let workspace = std::env::temp_dir();
    let cgroups = cgroup::prepare(std::process::id(), &cgroup::Placement::default());
    let facts = host_facts(&cgroups);
    let Setup {
        engine,
        probe,
        cgroups,
        ..
    } = rt.block_on(setup(
        default_limits(),
        interpreter(&args.interpreter)?,
        Paths {
            workspace: workspace.clone(),
            home: workspace,
            state_dir: default_state_dir(),
            daemon_files: Vec::new(),
        },
        cgroups,
        ProfileChoice {
            dir: args.profiles_dir.as_deref(),
            probe_all: true,
            ..ProfileChoice::default()
        },
        None,
    ))?;
    println!(
        "host: {} {} ({} cores)",
        facts.kernel, facts.arch, facts.cores
    );
    let cg = &facts.cgroups;
    println!("cgroups: {}", cg.mode);
    println!(
        "  {:<18} {}",
        "cgroup.kill",
        if cgroups.unified.is_none() {
            "no   (no writable cgroup v2: the pid namespace and the helper's sweep kill trees)"
        } else if cg.kill {
            "yes"
        } else {
            "no   (before Linux 5.14: processes are killed one by one, then swept)"
        }
    );
    for (name, via) in [("pids limit", &cg.pids), ("memory limit", &cg.memory)] {
        match via.as_str() {
            "rlimit" => {
                println!("  {name:<18} rlimit (no controller: RLIMIT_NPROC per uid, RLIMIT_AS)")
            }
            v => println!("  {name:<18} cgroup {v}"),
        }
    }
    if let Some(h) = &cgroups.unified {
        println!("  {:<18} {}", "commands in", h.parent.display());
    }
    if cgroups.attach_may_wait(&cgroup::kernel_release(), cgroup::grace_periods_expedited()) {
        println!(
            "  {:<18} a command's move into its v1 cgroups waits for an RCU grace period after \
             a quiet spell on this kernel (before Linux 5.5; 8-24 ms measured on 6.18 for the \
             move that waits; a one-shot `executor run` pays it, the daemon's warm workers \
             move before their command comes). `echo 1 > /sys/kernel/rcu_expedited` removes \
             the wait host-wide (until reboot; every grace period is then expedited, by \
             interrupting every CPU), as does a kernel of 5.5 or later",
            "attach"
        );
    }
    println!(
        "landlock: ABI {}{}",
        facts.landlock_abi,
        match facts.landlock_abi {
            0 => " (not in this kernel)",
            n if n >= crate::plan::MAX_LANDLOCK_ABI => "",
            _ => " (older than 6: see each profile's missing rights)",
        }
    );
    println!("interpreter: {}", args.interpreter);
    println!("profiles:");
    for (name, outcome) in &probe {
        match outcome {
            Ok(probed) if probed.missing.is_empty() => {
                println!("  {name:<15} ok    {}", probed.layers.join(" "))
            }
            Ok(probed) => println!(
                "  {name:<15} ok    {}\n  {:<15}       missing here: {}",
                probed.layers.join(" "),
                "",
                probed.missing.join(" ")
            ),
            Err(reason) => println!("  {name:<15} NO    {reason}"),
        }
    }
    match engine.default_profile.as_str() {
        "" => println!("default profile: none (requests must name a profile)"),
        name => println!("default profile: {name}"),
    }
    for hierarchy in cgroups.all() {
        cgroup::remove(&hierarchy.parent);
    }
    Ok(ExitCode::SUCCESS)
}

/// `executor tls-fingerprint`: the fingerprint of the certificate `serve --tls` uses.
pub(crate) fn tls_fingerprint(args: TlsFingerprintArgs) -> anyhow::Result<ExitCode> {
    let cert = match args.tls_cert {
        Some(cert) => cert,
        None => server::tls::generated_cert(&args.state_dir.unwrap_or_else(default_state_dir)),
    };
    if !cert.exists() {
        bail!(
            "no certificate at {} (`executor serve --tls` generates one there on its first start)",
            cert.display()
        );
    }
    let fingerprint = server::tls::fingerprint_of_file(&cert)?;
    println!("{fingerprint}");
    Ok(ExitCode::SUCCESS)
}

/// Shell conventions: the code itself, 128 + n for a signal, 124 for a timeout (as timeout(1)),
/// 130 for an interrupt.
fn exit_code(returncode: i32, ended: Ending) -> ExitCode {
    let code = match ended {
        Ending::TimedOut => 124,
        Ending::Cancelled | Ending::Disconnected | Ending::Shutdown => 130,
        Ending::Signaled => 128 + returncode.unsigned_abs().min(127) as u8,
        Ending::Exited => (returncode & 0xff) as u8,
    };
    ExitCode::from(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_home_names_its_run_only_in_our_pid_namespace_and_in_the_shape_we_make() {
        let ns = "-ns4026531836-";
        let random = "0123456789abcdef";
        assert_eq!(
            home_run(&format!("executor-home-4242-ns4026531836-{random}"), ns),
            Some(4242)
        );
        // Another pid namespace's, an older version's, someone else's files: not ours.
        assert_eq!(
            home_run(&format!("executor-home-4242-ns4026532000-{random}"), ns),
            None
        );
        assert_eq!(home_run(&format!("executor-home-{random}"), ns), None);
        assert_eq!(home_run("executor-home-4242-ns4026531836-x", ns), None);
        assert_eq!(
            home_run(&format!("executor-home-me-ns4026531836-{random}"), ns),
            None
        );
        assert_eq!(home_run("executor-4242-ns4026531836", ns), None);
    }
}
