//! The operator's own commands: `executor run` (one command, locally, through the daemon's
//! path), `executor check` (what this host can enforce) and `executor tls-fingerprint`.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context};
use protocol::{Ending, ServerMessage};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use crate::args::{default_state_dir, interpreter, CheckArgs, RunArgs, TlsFingerprintArgs};
use crate::engine::default_limits;
use crate::runner::{OutputSink, StopReason};
use crate::runtimes::{local_runtime, runtime};
use crate::serve::host_facts;
use crate::setup::{setup, Paths, ProfileChoice, Setup};
use sandbox::cgroup;
use sandbox::homes::{self, HomeAhead, TempHome};
use sandbox::spawner::Leftover;

use crate::{request, server};

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
    // Without --profile, the strongest (strict) is set up as if named, and landlock takes its
    // place only where strict's set-up fails before the command runs: no probe command first,
    // which cost a one-shot as much as its own command. task-container and trusted run only
    // when named.
    let by_name = args.profile.is_some();
    let first = args
        .profile
        .unwrap_or_else(|| sandbox::profile::DEFAULT_PREFERENCE[0].to_string());
    if by_name {
        eprintln!("executor: profile {first:?} (named with --profile)");
    } else {
        eprintln!(
            "executor: profile {first:?} (the strongest; {} where strict cannot run here; \
             --profile NAME to choose)",
            sandbox::profile::DEFAULT_PREFERENCE[1..].join(", then ")
        );
    }
    let request = protocol::ExecRequest {
        id: "local".into(),
        command: args.command.join(" "),
        cwd: Some(cwd.display().to_string()),
        env,
        timeout: Some(args.timeout),
        profile: Some(first),
        stream: true,
        network: None,
    };
    let mut valid = request::validate(request, &limits)?;
    // The run's client layer: the operator's own grant, as a clients-file entry's would be.
    if !args.allow_net.is_empty() || !args.deny_net.is_empty() {
        if args.allow_net.is_empty() {
            bail!("--deny-net narrows what --allow-net allows; give at least one --allow-net");
        }
        let policy = crate::network_policy::parse_policy(&args.allow_net, &args.deny_net)?;
        valid.client_network = sandbox::network::Mode::Policy(policy);
    }
    // A policy holds only where a network namespace does: no stepping down to a profile
    // without one (landlock), which would refuse it anyway, with a less useful reason.
    let by_name = by_name || matches!(valid.client_network, sandbox::network::Mode::Policy(_));
    let interpreter = interpreter(&args.common.interpreter)?;
    // Before the runtime's threads exist: a fork server forked from us spares the run an
    // exec of our binary as its helper. Where it cannot be made, the helper is exec'd.
    // The fork server makes the command's network namespace while we set up, when the named
    // profile is one that makes one.
    let named = valid
        .profile
        .as_deref()
        .and_then(sandbox::profile::Profile::builtin)
        .and_then(Result::ok);
    let ahead = sandbox::spawner::Ahead {
        net: named
            .as_ref()
            .is_some_and(|p| p.namespaces.contains(&sandbox::profile::Namespace::Net)),
    };
    let spawner = sandbox::spawner::fork_here(ahead)
        .map_err(|err| tracing::debug!(%err, "no forked fork server: the helper is exec'd"))
        .ok();
    // The home of a named built-in profile that gives one is made on a thread of its own
    // while we set up: two `mkdir`s on `$TMPDIR`, 0.2 ms on a fresh ext4 file system and over
    // a millisecond in this machine's much-used /tmp.
    let early_home = named.as_ref().and_then(homes::owner).map(HomeAhead::start);
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
    // A policy is enforced as the daemon does it, by an egress engine of this run's own: its
    // proxy, resolver and capture listeners put in the command's namespace and served by our
    // runtime while the command runs. Its resolver configuration lies in a directory of the
    // run's own, removed afterwards.
    let egress = match &valid.client_network {
        sandbox::network::Mode::Policy(_) => {
            let dir = RunDir::make()?;
            let enforcer = crate::enforce::Enforcer::new(
                &dir.0,
                args.network_log.as_deref(),
                &args.egress_resolve,
                Vec::new(),
            )?;
            Some((dir, enforcer))
        }
        _ => None,
    };
    let (_egress_dir, enforcer) = match egress {
        Some((dir, enforcer)) => (Some(dir), Some(enforcer)),
        None => (None, None),
    };
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
            enforcer,
        },
        cgroups,
        ProfileChoice {
            default: valid.profile.clone(),
            only_default: true,
            parsed_default: named,
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
    let home = match profile.and_then(homes::owner) {
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
    // What the run leaves behind is its fork server's to remove after we exit; without one
    // (it could not be made, or failed), ours, after the command.
    let mut leftovers = leftovers(&cgroups, home.as_ref());
    let server = engine.runner.spawner();
    let left = server
        .as_ref()
        .is_some_and(|server| server.leave(&leftovers).is_ok());
    if let Some(home) = home {
        home.leave();
    }
    // A home made for a profile the run steps down to: removed when dropped, after the command.
    let mut fallback_home: Option<TempHome> = None;
    let code = rt.block_on(async {
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
        let to = Arc::new(tx);
        let sink = || OutputSink {
            id: valid.id.clone(),
            to: to.clone(),
        };
        let stop = || async {
            let _ = tokio::signal::ctrl_c().await;
            StopReason::Cancelled
        };
        let mut result = engine
            .execute(&valid, crate::runner::Io::Capture(Some(sink())), stop())
            .await;
        // The command did not run (an error, never a result): where the profile was ours to
        // choose, the next one takes its place.
        let mut choices = sandbox::profile::DEFAULT_PREFERENCE[1..].iter();
        while let (false, Err(err), Some(next)) = (by_name, &result, choices.next()) {
            let failed = valid.profile.clone().unwrap_or_default();
            eprintln!(
                "executor: profile {next:?} instead: {failed} cannot run here ({}: {})",
                err.code, err.message
            );
            fallback_home = step_down(&mut engine, next)?;
            valid.profile = Some(next.to_string());
            result = engine
                .execute(&valid, crate::runner::Io::Capture(Some(sink())), stop())
                .await;
        }
        drop(to);
        let _ = printer.await;
        let result = result.map_err(|e| anyhow::anyhow!("{}: {}", e.code, e.message))?;
        if !result.exception_info.is_empty() {
            eprintln!("executor: {}", result.exception_info);
        }
        if let Some(network) = &result.extra.isolation.network {
            say_network(network, args.network_log.as_deref());
        }
        if result.extra.truncated {
            eprintln!(
                "executor: output was {} bytes; the result kept {kept} of them (head and tail)",
                result.extra.output_bytes
            );
        }
        Ok(exit_code(result.returncode, result.extra.ended))
    });
    // Removed as it drops, now that its command is over.
    drop(fallback_home);
    // The server may have died since (killed, out of memory): then they are ours again. The
    // sweeps of dead runs' leftovers are not ours to wait for (a dead command's tree may be
    // large): a later run's server does them.
    if !left || server.is_none_or(|server| server.gone()) {
        leftovers.retain(|l| matches!(l, Leftover::Cgroup(_) | Leftover::Home { .. }));
        for (dir, err) in sandbox::spawner::remove_leftovers(leftovers) {
            eprintln!("executor: cannot remove {}: {err}", dir.display());
        }
    }
    code
}

/// A directory of the run's own in the temporary directory (mode 0700), removed when dropped.
struct RunDir(std::path::PathBuf);

impl RunDir {
    fn make() -> anyhow::Result<Self> {
        let template = std::env::temp_dir().join("executor-run-XXXXXX");
        let dir = nix::unistd::mkdtemp(&template)
            .with_context(|| format!("cannot make a directory like {}", template.display()))?;
        Ok(Self(dir))
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What the run's network policy let through and refused, on stderr: the decision log's
/// summary, and where its lines went (`--network-log`), if anywhere.
fn say_network(network: &protocol::NetworkReport, log: Option<&std::path::Path>) {
    let Some(used) = &network.connections else {
        return;
    };
    let mut line = format!(
        "executor: network policy: {} allowed, {} refused",
        used.allowed, used.denied
    );
    if !used.denied_first.is_empty() {
        line.push_str(&format!(" ({})", used.denied_first.join(", ")));
    }
    if let Some(log) = log {
        line.push_str(&format!("; decisions in {}", log.display()));
    }
    eprintln!("{line}");
}

/// Load built-in profile `name` into `engine` for a run stepping down to it, with the home it
/// gives its commands (made now; the caller removes it after the command).
fn step_down(engine: &mut crate::engine::Engine, name: &str) -> anyhow::Result<Option<TempHome>> {
    let profile = sandbox::profile::Profile::builtin(name)
        .transpose()?
        .with_context(|| format!("no built-in profile {name:?}"))?;
    let home = match homes::owner(&profile) {
        Some(owner) => {
            let home = TempHome::create(owner)?;
            engine.plan_settings.home = home.dir.clone();
            Some(home)
        }
        None => {
            engine.plan_settings.home = "/nonexistent".into();
            None
        }
    };
    engine.profiles.insert(profile.name.clone(), profile);
    Ok(home)
}

/// What a run leaves behind once its command is over ([`Leftover`]): its cgroup directories,
/// its home, and the sweep of what dead runs left where both are made.
fn leftovers(cgroups: &cgroup::CgroupRoot, home: Option<&TempHome>) -> Vec<Leftover> {
    let mut leftovers: Vec<Leftover> = cgroups
        .all()
        .map(|hierarchy| Leftover::Cgroup(hierarchy.parent.clone()))
        .collect();
    let mut stale: Vec<std::path::PathBuf> = cgroups
        .all()
        .filter_map(|hierarchy| hierarchy.parent.parent().map(std::path::Path::to_path_buf))
        .collect();
    stale.sort();
    stale.dedup();
    leftovers.extend(stale.into_iter().map(Leftover::StaleCgroups));
    if let Some(home) = home {
        leftovers.push(home.leftover());
        leftovers.extend(home.homes.clone().map(Leftover::StaleHomes));
    }
    leftovers
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
            enforcer: None,
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
            n if n >= sandbox::plan::MAX_LANDLOCK_ABI => "",
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
    match disk_quotas() {
        Ok(()) => println!(
            "disk quotas: {} (serve --disk-quota-bytes: each client's workspace, home and TMPDIR on an ext4 image of its own, on a loop device)",
            crate::workspaces::volumes::MECHANISM
        ),
        Err(why) => println!("disk quotas: none ({why})"),
    }
    for hierarchy in cgroups.all() {
        cgroup::remove(&hierarchy.parent);
    }
    Ok(ExitCode::SUCCESS)
}

/// Whether `serve --disk-quota-bytes` can have its volumes here: a small one made, mounted
/// and removed in a directory of its own.
fn disk_quotas() -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).map_err(|err| format!("no random bytes: {err}"))?;
    let base = if std::path::Path::new("/var/tmp").is_dir() {
        std::path::PathBuf::from("/var/tmp")
    } else {
        std::env::temp_dir()
    };
    let dir = base.join(format!("executor-check-{}", hex::encode(bytes)));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|err| format!("no directory to try one in: {}: {err}", dir.display()))?;
    let volumes = crate::workspaces::Volumes::new(dir.join("images"), dir.join("mounts"), None);
    let outcome = volumes.probe();
    // Emptied by the probe (the image removed, the volume unmounted).
    let _ = std::fs::remove_dir_all(&dir);
    outcome
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
