//! `executor serve`: the daemon's start, in order (state directory, credentials, TLS, audit
//! log, engine and probes, clients, workspaces, cgroup bounds, listener), and its signals.

use std::ffi::OsStr;
use std::io::Write;
use std::sync::Arc;

use anyhow::{bail, Context};
use protocol::{HostFacts, Limits, ProfileSummary};

use crate::args::{default_state_dir, interpreter, LogFormat, ServeArgs};
use crate::engine::{default_limits, Engine};
use crate::runtimes::runtime;
use crate::setup::{helper_exe, resolved, setup, Paths, ProfileChoice, Setup};
use sandbox::{cgroup, spawner, sys};

use crate::{audit, clients, server, token, workspaces};

/// The single token's network ceiling from `--allow-net`/`--deny-net`: `host` without them.
/// A clients file says each client's in its entries, so both together are refused.
fn single_token_network(args: &ServeArgs) -> anyhow::Result<sandbox::network::Mode> {
    if args.allow_net.is_empty() && args.deny_net.is_empty() {
        return Ok(sandbox::network::Mode::Host);
    }
    if args.clients.is_some() {
        bail!(
            "--allow-net/--deny-net set the single token's network; with --clients, put \
             `network` in the clients file's entries instead"
        );
    }
    if args.allow_net.is_empty() {
        bail!("--deny-net narrows what --allow-net allows; give at least one --allow-net");
    }
    let policy = crate::network_policy::parse_policy(&args.allow_net, &args.deny_net)
        .context("--allow-net/--deny-net")?;
    Ok(sandbox::network::Mode::Policy(policy))
}

pub(crate) fn serve(mut args: ServeArgs) -> anyhow::Result<()> {
    sys::tune_allocator();
    // Held to the end: dropping it flushes what is queued (for a second at most).
    let _logging = init_logging(args.log_format);
    resolve_daemon_paths(&mut args);
    let mut limits = default_limits();
    apply_overrides(&mut limits, &args);
    let single_network = single_token_network(&args)?;
    // Same-uid commands must not read our memory or environment through /proc or ptrace.
    nix::sys::prctl::set_dumpable(false).context("cannot make the daemon non-dumpable")?;
    // Cgroups first: where the daemon must move into a leaf of its own (cgroup v2), it must do
    // so before it starts the fork server, which would otherwise be left behind.
    let cgroups = cgroup::prepare(
        std::process::id(),
        &cgroup::Placement {
            parent_of_parent: args.cgroup_parent.clone(),
            move_into_leaf: true,
            one_command: false,
        },
    );
    // Before Linux 5.5 the start-up probes' first cgroup v1 move would wait for an RCU grace
    // period.
    cgroup::warm_attach(&cgroups);
    // The fork server, from the main thread (which lives as long as the daemon). Without it,
    // helpers are started by exec.
    let spawner = match spawner::start(&helper_exe()) {
        Ok(spawner) => Some(spawner),
        Err(err) => {
            tracing::warn!(%err, "cannot start the fork server; helpers will be exec'd");
            None
        }
    };

    let state_dir = args.state_dir.clone().unwrap_or_else(default_state_dir);
    create_private_dir(&state_dir)?;
    // Absolute and free of symlinks: workspaces below it are compared with mount points.
    let state_dir = std::fs::canonicalize(&state_dir)
        .with_context(|| format!("cannot resolve state directory {}", state_dir.display()))?;
    let workspaces_root = state_dir.join("workspaces");
    // Disk quotas: clients' volumes, and the shared workspace's, made before anything is put
    // in it. A quota that cannot be had here does not stop the start: the hello says why, and
    // the commands it would bind are refused.
    let default_quota =
        crate::disk_quota::DiskQuota::from_limits(args.disk_quota_bytes, args.disk_quota_files)
            .transpose()
            .map_err(|why| anyhow::anyhow!("--disk-quota-bytes/--disk-quota-files: {why}"))?;
    let mut volumes = workspaces::Volumes::new(
        state_dir.join("volumes"),
        workspaces_root.join("volume"),
        default_quota,
    );
    volumes.clear_leftovers();
    let mut shared_volume = None;
    if let (Some(quota), None) = (default_quota, &args.workspace) {
        match volumes.mount(workspaces::volumes::SHARED, quota) {
            Ok(point) => {
                volumes.shared_workspace = true;
                shared_volume = Some(point);
            }
            Err(err) => {
                tracing::error!(%err, "the shared workspace has no disk quota: commands that use it are refused")
            }
        }
    }
    let workspace = args
        .workspace
        .clone()
        .unwrap_or_else(|| match &shared_volume {
            Some(point) => point.join("workspace"),
            None => state_dir.join("workspace"),
        });
    let workspace_created = !workspace.exists();
    if workspace_created {
        use std::os::unix::fs::DirBuilderExt;
        // Closed to other users of the host; handed to the commands' identity below.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&workspace)
            .with_context(|| format!("cannot create workspace {}", workspace.display()))?;
    }

    if !(0.0..=86_400.0).contains(&args.resume_grace) {
        bail!("--resume-grace must be 0 to 86400 seconds");
    }
    let loopback = args.listen.ip().is_loopback();
    let want_tls = args.tls || args.tls_cert.is_some();
    // Off loopback, plain ws:// would show the token and every command and its output to
    // anyone on the path.
    if !loopback && !want_tls && !args.allow_plaintext {
        bail!(
            "refusing to serve plaintext ws:// on non-loopback address {}: the token and every \
             command would cross the network in clear. Add --tls (a self-signed certificate \
             whose fingerprint clients pin, or --tls-cert/--tls-key), or keep the daemon on \
             127.0.0.1 and reach it through an SSH tunnel (ssh -N -L {port}:127.0.0.1:{port} \
             HOST); --allow-plaintext only behind a trusted proxy that terminates TLS",
            args.listen,
            port = args.listen.port()
        );
    }
    // Either named clients, or one token (read, or created on loopback).
    let (credentials, token_created) = match &args.clients {
        Some(path) => (path.clone(), false),
        None => {
            let explicit_token = args.token_file.is_some();
            let token_path = args
                .token_file
                .clone()
                .unwrap_or_else(|| state_dir.join("token"));
            // Off loopback, a token nobody chose would lock everyone out or, worse, be guessed
            // from a world-readable default path: insist on a deliberately placed token file.
            let deliberate_token = explicit_token && token_path.exists();
            if !loopback && !deliberate_token {
                bail!(
                    "refusing to listen on non-loopback address {} without an existing --token-file or a --clients file",
                    args.listen
                );
            }
            let created = !token_path.exists();
            (token_path, created)
        }
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(server::tls::load(cert, key)?),
        _ if want_tls => {
            let hostname = nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok());
            let names = server::tls::subject_names(args.listen, hostname);
            Some(server::tls::load_or_generate(&state_dir, &names)?)
        }
        _ => None,
    };
    let tls_key = tls.as_ref().map(|identity| identity.key_path.clone());
    let tls_cert = tls.as_ref().map(|identity| identity.cert_path.clone());

    let audit_path = args
        .audit_log
        .clone()
        .unwrap_or_else(|| state_dir.join("audit.jsonl"));
    let audit = audit::Audit::open(&audit_path)?;
    // The network policy's decisions, one JSON line per attempt, beside the audit log.
    let network_log = crate::enforce::log::path_beside(&audit_path);
    let interpreter = interpreter(&args.common.interpreter)?;

    let rt = runtime()?;
    rt.block_on(async move {
        // Bound here, served at the end: the egress engine must know the daemon's own
        // address (a command's policy never reaches it).
        let listener = listen(args.listen, args.max_connections)
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        let addr = listener.local_addr()?;
        let enforcer = crate::enforce::Enforcer::new(
            &state_dir,
            Some(&network_log),
            &args.egress_resolve,
            vec![addr],
        )?;
        let Setup {
            engine,
            probe,
            cgroups,
            not_offered,
        } = setup(
            limits.clone(),
            interpreter.clone(),
            Paths {
                workspace: workspace.clone(),
                // Every command through the server has its client's home; probes get the
                // directory holding them, which they cannot write.
                home: workspaces_root.join("home"),
                state_dir: state_dir.clone(),
                // The TLS key is a secret like the token: covered wherever it is. The profiles
                // directory and the certificate are not secret, but a command that rewrote
                // them would weaken the next start.
                daemon_files: [
                    Some(credentials.clone()),
                    Some(audit_path.clone()),
                    Some(network_log.clone()),
                    Some(workspaces_root.clone()),
                    // Clients' images: one written from outside would be another client's files.
                    Some(volumes.images().to_path_buf()),
                    tls_key,
                    tls_cert,
                    args.profiles_dir.clone(),
                ]
                .into_iter()
                .flatten()
                .map(|path| resolved(&path))
                .collect(),
                enforcer: Some(enforcer),
            },
            cgroups,
            ProfileChoice {
                dir: args.profiles_dir.as_deref(),
                allow: &args.allow_profiles,
                default: args.default_profile.clone(),
                probe_all: true,
                only_default: false,
                safe_default: true,
                parsed_default: None,
            },
            spawner,
        )
        .await?;
        let mut engine = engine;
        engine.runner.warm_workers = !args.no_warm_workers;
        if workspace_created {
            hand_workspace_to(&engine, &workspace)?;
        }
        let clients = match &args.clients {
            Some(path) => clients::ClientTable::load(path, &engine.profiles)?,
            None => {
                let (token, _) = token::Token::load_or_create(&credentials, loopback)?;
                clients::ClientTable::single(token.as_bytes(), single_network)
            }
        };
        let client_names = clients.names();
        if clients.any_disk_quota() || default_quota.is_some() {
            match volumes.probe() {
                Ok(()) => tracing::info!(
                    mechanism = workspaces::volumes::MECHANISM,
                    "disk quotas in force"
                ),
                Err(why) => tracing::error!(
                    %why,
                    "disk quotas are set but cannot be had here: the commands of clients with one are refused"
                ),
            }
        }
        let workspaces =
            workspaces::Workspaces::new(workspaces_root, workspace_owner(&engine), volumes);
        // Scratch of sessions a previous daemon could not end (it was killed). Whatever
        // cannot be removed is set aside and logged: it never stops a start.
        workspaces.clear_leftovers();
        let mut totals = cgroup::TotalLimits::host_default();
        if let Some(n) = args.max_total_processes {
            totals.processes = n;
        }
        if let Some(mb) = args.max_total_memory_mb {
            totals.memory_bytes = mb * 1024 * 1024;
        }
        cgroup::limit_all(&cgroups, totals);
        let hello = protocol::Hello {
            protocol: protocol::PROTOCOL_VERSION,
            server: format!("executor {}", env!("CARGO_PKG_VERSION")),
            host: host_facts(&cgroups),
            profiles: engine
                .profiles
                .values()
                .map(|p| {
                    let outcome = probe.get(&p.name);
                    let probed = outcome.and_then(|o| o.as_ref().ok());
                    ProfileSummary {
                        name: p.name.clone(),
                        description: p.description.clone(),
                        available: probed.is_some(),
                        layers: probed.map(|p| p.layers.clone()).unwrap_or_default(),
                        missing: probed.map(|p| p.missing.clone()).unwrap_or_default(),
                        unavailable_reason: outcome.and_then(|o| o.as_ref().err()).cloned(),
                        network: Some(crate::network_policy::profile_report(p)),
                    }
                })
                .collect(),
            default_profile: engine.default_profile.clone(),
            limits,
            interpreter,
            workspace: workspace.display().to_string(),
            not_offered,
            capabilities: protocol::CAPABILITIES
                .iter()
                .map(|c| c.to_string())
                .collect(),
            ..protocol::Hello::default()
        };
        let daemon = Arc::new(server::Daemon::new(
            engine,
            server::DaemonParts {
                clients: clients::Registry::new(clients, args.clients.clone()),
                workspaces,
                resume_grace: std::time::Duration::from_secs_f64(args.resume_grace),
                audit,
                hello,
                max_connections: args.max_connections,
                origins: server::OriginPolicy {
                    allowed: args.allow_origins.clone(),
                    loopback,
                },
                memory_budget: args
                    .memory_budget_mb
                    .map_or_else(crate::budget::MemoryBudget::default_limit, |mb| {
                        mb.saturating_mul(1 << 20)
                    }),
                client_memory_budget: args
                    .client_memory_budget_mb
                    .map(|mb| mb.saturating_mul(1 << 20)),
            },
        ));
        let (scheme, fingerprint) = match &tls {
            Some(identity) => ("wss", Some(identity.fingerprint.as_str())),
            None => ("ws", None),
        };
        if let Some(identity) = &tls {
            tracing::info!(
                certificate = %identity.cert_path.display(),
                generated = identity.generated,
                fingerprint = %identity.fingerprint,
                "TLS certificate (clients pin this fingerprint)"
            );
        }
        tracing::info!(
            %addr,
            tls = tls.is_some(),
            credentials = %credentials.display(),
            token_created,
            clients = %client_names.join(","),
            workspace = %workspace.display(),
            audit_log = %audit_path.display(),
            default_profile = %daemon.engine.default_profile,
            "executor ready"
        );
        // One line on stdout for scripts and tests that start us on port 0: the URL, then with
        // TLS the certificate's fingerprint, as `tls-fingerprint sha256:<hex>`.
        let mut stdout = std::io::stdout();
        let pin = fingerprint
            .map(|f| format!(" tls-fingerprint {f}"))
            .unwrap_or_default();
        let _ = writeln!(
            stdout,
            "executor listening on {scheme}://{addr}{}{pin}",
            protocol::WS_PATH
        );
        let _ = stdout.flush();

        if let Some(relay) = args.dial_out.take() {
            tokio::spawn(crate::dial_out::dial(relay, addr, daemon.shutdown.clone()));
        }
        tokio::spawn(shutdown_on_signal(daemon.clone()));
        tokio::spawn(reload_on_sighup(daemon.clone()));
        if args.exit_on_stdin_eof {
            let shutdown = daemon.shutdown.clone();
            std::thread::Builder::new()
                .name("stdin-lifeline".into())
                .spawn(move || {
                    use std::io::Read;
                    let mut byte = [0u8; 64];
                    while matches!(std::io::stdin().read(&mut byte), Ok(n) if n > 0) {}
                    tracing::info!("stdin closed: shutting down");
                    shutdown.cancel();
                })
                .context("cannot start the stdin watcher")?;
        }
        server::serve(listener, daemon.clone(), tls.map(|identity| identity.acceptor)).await;
        // Every command has ended: nothing of theirs holds a volume any more.
        daemon.workspaces.volumes.unmount_all();
        for hierarchy in cgroups.all() {
            cgroup::remove_tree(&hierarchy.parent);
        }
        tracing::info!("executor stopped");
        Ok(())
    })
}

/// The daemon's files are used by the paths they resolve to at start, for its whole life: the
/// sandbox covers and pins those, and a symlink on the way (`--clients /srv/c/link/clients.json`)
/// could otherwise be pointed elsewhere by a command of a profile that writes the host, and be
/// followed at the next reload. The link itself is the operator's to keep safe until the next
/// start: say so.
fn resolve_daemon_paths(args: &mut ServeArgs) {
    let paths = [
        &mut args.clients,
        &mut args.token_file,
        &mut args.tls_cert,
        &mut args.tls_key,
        &mut args.profiles_dir,
        &mut args.audit_log,
    ];
    for slot in paths.into_iter() {
        let Some(given) = slot.as_ref() else { continue };
        let Ok(real) = std::fs::canonicalize(given) else {
            continue; // Not there yet (a token to create): made where it is named.
        };
        if real != *given && std::path::absolute(given).is_ok_and(|a| a != real) {
            tracing::warn!(
                given = %given.display(),
                resolved = %real.display(),
                "a daemon file is named through a symlink: it is used as resolved until the \
                 daemon stops, but a command of a profile that writes the host could point the \
                 link elsewhere before the next start; name the resolved path instead"
            );
        }
        *slot = Some(real);
    }
}

/// A listening socket whose accept queue holds as many connections as the daemon serves (the
/// default of 1024, or 128 on older setups, would drop a burst the connection limit allows;
/// the kernel still caps it at net.core.somaxconn).
fn listen(
    addr: std::net::SocketAddr,
    max_connections: usize,
) -> std::io::Result<tokio::net::TcpListener> {
    let socket = match addr {
        std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(u32::try_from(max_connections).unwrap_or(u32::MAX))
}

/// The state directory holds the token, the audit log and the workspaces.
fn create_private_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("cannot create state directory {}", dir.display()))?;
    let meta = std::fs::metadata(dir)?;
    let mode = meta.permissions().mode() & 0o777;
    let root = nix::unistd::geteuid().is_root();
    // A root daemon runs commands as other uids, whose paths to their workspaces and homes
    // lead through here: they may enter (0711) but not list. Everything secret in it is 0600.
    if root && meta.uid() == 0 && mode != 0o711 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
            .with_context(|| format!("cannot set the mode of state directory {}", dir.display()))?;
    } else if mode & 0o066 != 0 {
        tracing::warn!(dir = %dir.display(), mode = format!("{mode:o}"), "state directory is open to other users");
    }
    Ok(())
}

/// A workspace the daemon just created belongs to the identity its default profile runs
/// commands as, so that they can write it.
fn hand_workspace_to(engine: &Engine, workspace: &std::path::Path) -> anyhow::Result<()> {
    let Some((uid, gid)) = workspace_owner(engine) else {
        return Ok(());
    };
    nix::unistd::chown(
        workspace,
        Some(nix::unistd::Uid::from_raw(uid)),
        Some(nix::unistd::Gid::from_raw(gid)),
    )
    .with_context(|| {
        format!(
            "cannot hand the workspace {} to uid {uid}",
            workspace.display(),
        )
    })
}

/// Who should own workspaces the daemon creates: the identity its default profile runs
/// commands as, when the daemon is root. An ordinary user's daemon runs every command as
/// itself, so it already owns them.
fn workspace_owner(engine: &Engine) -> Option<(u32, u32)> {
    if !nix::unistd::geteuid().is_root() {
        return None;
    }
    // The default profile's identity; with none (no default can run here), the unprivileged
    // identity of any profile offered.
    let user = engine
        .profiles
        .get(&engine.default_profile)
        .and_then(|p| p.user.as_ref())
        .or_else(|| {
            engine
                .profiles
                .values()
                .filter_map(|p| p.user.as_ref())
                .find(|u| u.uid != 0)
        })?;
    Some((user.uid, user.gid))
}

fn apply_overrides(limits: &mut Limits, args: &ServeArgs) {
    if let Some(v) = args.default_timeout {
        limits.default_timeout = v;
    }
    if let Some(v) = args.max_timeout {
        limits.max_timeout = v;
    }
    if let Some(v) = args.max_commands_per_connection {
        limits.max_commands_per_connection = v;
    }
    if let Some(v) = args.max_commands {
        limits.max_commands_total = v;
    }
    if let Some(v) = args.max_message_bytes {
        limits.max_message_bytes = v;
    }
    if let Some(v) = args.common.max_output_bytes {
        limits.max_output_bytes = v;
    }
}

/// SIGHUP re-reads the clients file; connections stay open.
async fn reload_on_sighup(daemon: Arc<server::Daemon>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::error!("cannot install the SIGHUP handler; the clients file will not reload");
        return;
    };
    while hup.recv().await.is_some() {
        daemon.reload_clients().await;
    }
}

async fn shutdown_on_signal(daemon: Arc<server::Daemon>) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; SIGTERM will not drain");
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down: killing running commands and sending their results");
    daemon.shutdown.cancel();
}

pub(crate) fn host_facts(cgroups: &cgroup::CgroupRoot) -> HostFacts {
    let uts = nix::sys::utsname::uname().ok();
    let field = |f: fn(&nix::sys::utsname::UtsName) -> &OsStr| {
        uts.as_ref()
            .map(|u| f(u).to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    HostFacts {
        hostname: nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_default(),
        kernel: format!("{} {}", field(|u| u.sysname()), field(|u| u.release())),
        version: field(|u| u.version()),
        arch: std::env::consts::ARCH.to_string(),
        cores: std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1),
        cgroups: cgroups.facts(),
        landlock_abi: sys::landlock_abi(),
    }
}

/// Logs go to stderr through a thread of their own, and are dropped when it falls behind: a
/// stderr nobody reads (a wedged ssh session, a full pipe) must never block the daemon, its
/// shutdown included.
fn init_logging(format: LogFormat) -> tracing_appender::non_blocking::WorkerGuard {
    // 4,096 lines queued at most: the default (128,000) preallocates megabytes.
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .buffered_lines_limit(4096)
        .lossy(true)
        .thread_name("executor-log")
        .finish(std::io::stderr());
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour only for a person at a terminal: a log file or a pipe (an agent keeps ours in a
    // file, a batch copies it into minisweagent.log) gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(writer);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    guard
}
