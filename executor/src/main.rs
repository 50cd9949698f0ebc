//! `executor`: runs shell commands for agents, each as a new process session whose whole tree
//! dies with it. See the README for the commands and `protocol/README.md` for the wire format.

mod audit;
mod cgroup;
mod clients;
mod engine;
mod helper;
mod metrics;
mod plan;
mod profile;
mod request;
mod runner;
mod sandbox;
mod server;
mod spawner;
mod sys;
mod token;
mod workspaces;

/// The static (musl) build allocates with jemalloc (options in `sys::JEMALLOC_CONF`); the
/// dynamic (glibc) build keeps glibc's malloc. `sys::tune_allocator` bounds either in the
/// daemon. See ARCHITECTURE.md, "One static binary".
#[cfg(target_env = "musl")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use protocol::{Ending, HostFacts, Limits, ProfileSummary, ServerMessage};
use tokio::sync::mpsc;

use crate::engine::{default_limits, Engine};
use crate::plan::PlanSettings;
use crate::profile::Profile;
use crate::runner::{OutputSink, StopReason};

/// Port `executor serve` listens on when `--listen` names none.
const DEFAULT_PORT: u16 = 7681;

#[derive(Parser)]
#[command(
    name = "executor",
    version,
    about = "Run agents' shell commands in isolated, fully killable process sessions"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the WebSocket protocol.
    Serve(Box<ServeArgs>),
    /// Run one command locally through the same path the daemon uses; exit with its code.
    Run(RunArgs),
    /// Show which isolation layers and profiles work on this host, and why others do not.
    Check,
    /// Print the SHA-256 fingerprint of the daemon's TLS certificate, for clients to pin.
    TlsFingerprint(TlsFingerprintArgs),
}

#[derive(Args)]
struct TlsFingerprintArgs {
    /// State directory of the daemon whose generated certificate to read.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// A PEM certificate file to read instead (as given to `serve --tls-cert`).
    #[arg(long, value_name = "PATH", conflicts_with = "state_dir")]
    tls_cert: Option<PathBuf>,
}

#[derive(Args)]
struct CommonArgs {
    /// Interpreter and its flag; the command is appended as the last argument.
    #[arg(long, default_value = "bash -c")]
    interpreter: String,
    /// Bytes of output kept per command (first and last halves); the total is always counted.
    #[arg(long)]
    max_output_bytes: Option<usize>,
}

#[derive(Args)]
struct ServeArgs {
    /// Address to listen on. Non-loopback addresses need an existing --token-file, and --tls
    /// (or --allow-plaintext).
    #[arg(long, default_value_t = SocketAddr::from(([127, 0, 0, 1], DEFAULT_PORT)))]
    listen: SocketAddr,
    /// Serve wss:// (TLS). Without --tls-cert, a self-signed certificate is generated on first
    /// start in <state-dir>/tls/ and reused later; its SHA-256 fingerprint is printed for
    /// clients to pin.
    #[arg(long)]
    tls: bool,
    /// PEM certificate (chain) to serve; implies --tls and needs --tls-key.
    #[arg(long, value_name = "PATH", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert; refused if group or others can read it.
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve plain ws:// on a non-loopback address: only behind a trusted proxy that
    /// terminates TLS, since the token and every command would otherwise cross the network
    /// in clear.
    #[arg(long, conflicts_with_all = ["tls", "tls_cert"])]
    allow_plaintext: bool,
    /// Directory for the token, the audit log and the default workspace.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Bearer token file; created with a random token (mode 0600) if missing.
    #[arg(long, conflicts_with = "clients")]
    token_file: Option<PathBuf>,
    /// Clients file (JSON): named clients with their tokens, profiles, limits and workspace
    /// policy, instead of one token. Reloaded on SIGHUP.
    #[arg(long)]
    clients: Option<PathBuf>,
    /// Seconds a dropped connection's commands keep running for the client to resume its
    /// session (0: they are killed at once). A client entry may override it.
    #[arg(long, default_value_t = 0.0)]
    resume_grace: f64,
    /// Default working directory of commands; created if missing.
    #[arg(long)]
    workspace: Option<PathBuf>,
    /// Audit log, one JSON line per command.
    #[arg(long)]
    audit_log: Option<PathBuf>,
    /// Seconds a command may run when its request names no timeout.
    #[arg(long)]
    default_timeout: Option<f64>,
    /// Largest timeout a request may ask for, in seconds.
    #[arg(long)]
    max_timeout: Option<f64>,
    /// Commands one connection may run at once.
    #[arg(long)]
    max_commands_per_connection: Option<usize>,
    /// Commands the daemon runs at once over all connections.
    #[arg(long)]
    max_commands: Option<usize>,
    /// Open connections accepted at once.
    #[arg(long, default_value_t = 4096)]
    max_connections: usize,
    /// Largest WebSocket message accepted, in bytes.
    #[arg(long)]
    max_message_bytes: Option<usize>,
    /// Profile for requests that name none (default: the strongest this host can run).
    #[arg(long)]
    default_profile: Option<String>,
    /// Directory of extra profiles (*.json); a name there replaces the built-in profile.
    #[arg(long)]
    profiles_dir: Option<PathBuf>,
    /// Profiles clients may use (repeatable); default: every loaded profile.
    #[arg(long = "allow-profile", value_name = "NAME")]
    allow_profiles: Vec<String>,
    /// Processes of all commands together (default: three quarters of the host's pid_max).
    #[arg(long)]
    max_total_processes: Option<u64>,
    /// Memory of all commands together, in MiB (default: three quarters of the host's).
    #[arg(long)]
    max_total_memory_mb: Option<u64>,
    /// Drain and exit when stdin reaches end-of-file: a parent that starts the daemon with a
    /// pipe on stdin takes it down with it, even when the parent is killed with SIGKILL.
    #[arg(long)]
    exit_on_stdin_eof: bool,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    #[command(flatten)]
    common: CommonArgs,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Args)]
struct RunArgs {
    /// Sandbox profile.
    #[arg(long)]
    profile: Option<String>,
    /// Seconds before the command's tree is killed (fractions allowed).
    #[arg(long, default_value_t = 30.0)]
    timeout: f64,
    /// Working directory (default: the current one).
    #[arg(long)]
    cwd: Option<PathBuf>,
    /// Extra environment variable, NAME=VALUE; repeatable.
    #[arg(long = "env", value_name = "NAME=VALUE")]
    env: Vec<String>,
    #[command(flatten)]
    common: CommonArgs,
    /// The command; several words are joined with spaces, as ssh does.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn main() -> ExitCode {
    // Helper and fork-server modes first: before clap, before any runtime or thread exists.
    match std::env::args_os().nth(1).as_deref() {
        Some(arg) if arg == OsStr::new(helper::HELPER_ARG) => return helper::main(),
        Some(arg) if arg == OsStr::new(spawner::FORK_SERVER_ARG) => spawner::main(),
        _ => {}
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve(*args).map(|()| ExitCode::SUCCESS),
        Command::Run(args) => run_local(args),
        Command::Check => check(),
        Command::TlsFingerprint(args) => tls_fingerprint(args),
    };
    result.unwrap_or_else(|err| {
        eprintln!("executor: {err:#}");
        ExitCode::from(2)
    })
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Where the executor binary lies, for profiles that hide it.
fn executor_bin() -> anyhow::Result<PathBuf> {
    std::env::current_exe().context("cannot locate the executor binary")
}

/// What the daemon executes as the sandbox helper: its own image, through /proc/self/exe in
/// the freshly forked child. Never the path the binary was started from: a command of a profile
/// with a writable host root could replace what lies there (or rename a parent directory), and
/// a rebuild would mix versions.
fn helper_exe() -> PathBuf {
    PathBuf::from("/proc/self/exe")
}

fn interpreter(text: &str) -> anyhow::Result<Vec<String>> {
    let argv: Vec<String> = text.split_whitespace().map(str::to_string).collect();
    if argv.is_empty() {
        bail!("--interpreter must name a program");
    }
    Ok(argv)
}

fn builtin_profiles() -> anyhow::Result<BTreeMap<String, Profile>> {
    Ok(Profile::all_builtin()?
        .into_iter()
        .map(|p| (p.name.clone(), p))
        .collect())
}

fn home_dir() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"))
}

fn default_state_dir() -> PathBuf {
    if nix::unistd::geteuid().is_root() {
        PathBuf::from("/var/lib/executor")
    } else {
        home_dir().join(".local/state/executor")
    }
}

/// What serve, run and check share: profiles, cgroups, the engine, and which profiles this
/// host can run (found by running `true` under each).
struct Setup {
    engine: Engine,
    probe: BTreeMap<String, Result<Vec<String>, String>>,
    cgroups: cgroup::CgroupRoot,
}

/// Which profiles the engine offers and which one it uses by default.
#[derive(Default)]
struct ProfileChoice<'a> {
    /// Directory of extra profiles.
    dir: Option<&'a std::path::Path>,
    /// Only these may be used (empty: all).
    allow: &'a [String],
    /// Default profile instead of the strongest available.
    default: Option<String>,
    /// Probe every profile (for the hello and `check`), or only what choosing a default needs.
    probe_all: bool,
}

async fn setup(
    limits: Limits,
    interpreter: Vec<String>,
    workspace: PathBuf,
    state_dir: PathBuf,
    daemon_files: Vec<PathBuf>,
    choice: ProfileChoice<'_>,
    spawner: Option<spawner::Spawner>,
) -> anyhow::Result<Setup> {
    let cgroups = cgroup::prepare(std::process::id());
    let mut profiles = builtin_profiles()?;
    if let Some(dir) = choice.dir {
        for profile in Profile::load_dir(dir)? {
            profiles.insert(profile.name.clone(), profile);
        }
    }
    if !choice.allow.is_empty() {
        if let Some(unknown) = choice.allow.iter().find(|n| !profiles.contains_key(*n)) {
            bail!("--allow-profile {unknown}: no such profile");
        }
        profiles.retain(|name, _| choice.allow.contains(name));
    }
    let default_profile = choice.default;
    let plan_settings = PlanSettings {
        interpreter,
        workspace,
        home: home_dir(),
        state_dir,
        executor_bin: executor_bin()?,
        daemon_files,
        daemon_uid: nix::unistd::geteuid().as_raw(),
        loader_files: loader_files(),
        cgroups: cgroups.clone(),
    };
    let mut engine = Engine::new(limits, plan_settings, helper_exe(), profiles, String::new());
    if let Some(spawner) = spawner {
        engine.runner.use_spawner(spawner);
    }
    let probe = match (&default_profile, choice.probe_all) {
        (_, true) => engine.probe().await,
        (None, false) => engine.probe_for_default().await,
        (Some(_), false) => BTreeMap::new(),
    };
    engine.default_profile = match default_profile {
        Some(name) if !engine.profiles.contains_key(&name) => bail!("no profile named {name:?}"),
        Some(name) => name,
        None => Engine::choose_default(&probe),
    };
    for (name, outcome) in &probe {
        match outcome {
            Ok(layers) => {
                tracing::info!(profile = %name, layers = %layers.join(","), "profile available")
            }
            Err(reason) => {
                tracing::warn!(profile = %name, %reason, "profile unavailable on this host")
            }
        }
    }
    Ok(Setup {
        engine,
        probe,
        cgroups,
    })
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    sys::tune_allocator();
    init_logging(args.log_format);
    let mut limits = default_limits();
    apply_overrides(&mut limits, &args);
    // Same-uid commands must not read our memory or environment through /proc or ptrace.
    nix::sys::prctl::set_dumpable(false).context("cannot make the daemon non-dumpable")?;
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
    let workspace = args
        .workspace
        .clone()
        .unwrap_or_else(|| state_dir.join("workspace"));
    let workspace_created = !workspace.exists();
    std::fs::create_dir_all(&workspace)
        .with_context(|| format!("cannot create workspace {}", workspace.display()))?;

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

    let audit_path = args
        .audit_log
        .clone()
        .unwrap_or_else(|| state_dir.join("audit.jsonl"));
    let audit = audit::Audit::open(&audit_path)?;
    let interpreter = interpreter(&args.common.interpreter)?;
    let workspaces_root = state_dir.join("workspaces");

    let rt = runtime()?;
    rt.block_on(async move {
        let Setup {
            engine,
            probe,
            cgroups,
        } = setup(
            limits.clone(),
            interpreter.clone(),
            workspace.clone(),
            state_dir.clone(),
            // The TLS key is a secret like the token: covered wherever it is.
            [
                credentials.clone(),
                audit_path.clone(),
                workspaces_root.clone(),
            ]
            .into_iter()
            .chain(tls_key)
            .map(|path| resolved(&path))
            .collect(),
            ProfileChoice {
                dir: args.profiles_dir.as_deref(),
                allow: &args.allow_profiles,
                default: args.default_profile.clone(),
                probe_all: true,
            },
            spawner,
        )
        .await?;
        if workspace_created {
            hand_workspace_to(&engine, &workspace)?;
        }
        let clients = match &args.clients {
            Some(path) => clients::ClientTable::load(path, &engine.profiles)?,
            None => {
                let (token, _) = token::Token::load_or_create(&credentials, loopback)?;
                clients::ClientTable::single(token.as_bytes())
            }
        };
        let client_names = clients.names();
        let workspaces = workspaces::Workspaces::new(workspaces_root, workspace_owner(&engine));
        // Scratch of sessions a previous daemon could not end (it was killed).
        workspaces::remove(&workspaces.scratch_root())
            .context("cannot remove the scratch workspaces a previous daemon left")?;
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
            host: host_facts(),
            profiles: engine
                .profiles
                .values()
                .map(|p| {
                    let outcome = probe.get(&p.name);
                    ProfileSummary {
                        name: p.name.clone(),
                        description: p.description.clone(),
                        available: outcome.is_some_and(Result::is_ok),
                        layers: outcome
                            .and_then(|o| o.as_ref().ok())
                            .cloned()
                            .unwrap_or_default(),
                        unavailable_reason: outcome.and_then(|o| o.as_ref().err()).cloned(),
                    }
                })
                .collect(),
            default_profile: engine.default_profile.clone(),
            limits,
            interpreter,
            workspace: workspace.display().to_string(),
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
            },
        ));
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        let addr = listener.local_addr()?;
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
        server::serve(listener, daemon, tls.map(|identity| identity.acceptor)).await;
        for hierarchy in cgroups.all() {
            cgroup::remove(&hierarchy.parent);
        }
        tracing::info!("executor stopped");
        Ok(())
    })
}

/// Files the dynamic loader reads when this binary starts: the shared libraries mapped into
/// this process, the loader cache and the preload list, plus every directory that holds a
/// symlink on the way to them (the interpreter is reached through /lib64 -> usr/lib64, a
/// link in a directory). The preload list is created empty (when we may) so that it exists to
/// be made read-only: otherwise a command of a profile with a writable host root could create
/// it and run code in the next helper.
fn loader_files() -> Vec<PathBuf> {
    let preload = PathBuf::from("/etc/ld.so.preload");
    if !preload.exists() && nix::unistd::geteuid().is_root() {
        if let Err(err) = std::fs::File::create(&preload) {
            tracing::warn!(%err, "cannot create an empty /etc/ld.so.preload to protect it");
        }
    }
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mapped: Vec<PathBuf> = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| path.starts_with('/') && path.contains(".so"))
        .map(PathBuf::from)
        .collect();
    let mut files = mapped.clone();
    files.extend(["/etc/ld.so.cache".into(), preload]);
    // The paths the loader opens, which may differ from the mapped (resolved) ones.
    let mut opened = vec![PathBuf::from("/lib64/ld-linux-x86-64.so.2")];
    for lib in &mapped {
        if let Some(name) = lib.file_name() {
            opened.push(Path::new("/lib/x86_64-linux-gnu").join(name));
        }
    }
    for path in &opened {
        link_dirs(path, &mut files, 0);
    }
    files.sort();
    files.dedup();
    files.retain(|f| f.exists() && f != Path::new("/"));
    files
}

/// Add to `dirs` every directory (but the root) holding a symlink on the way to `path`.
fn link_dirs(path: &Path, dirs: &mut Vec<PathBuf>, depth: u32) {
    if depth > 16 {
        return;
    }
    let mut current = PathBuf::from("/");
    let mut components = path.components().skip(1);
    while let Some(component) = components.next() {
        let next = current.join(component);
        let Ok(target) = std::fs::read_link(&next) else {
            current = next;
            continue;
        };
        dirs.push(current.clone());
        let resolved = if target.is_absolute() {
            target
        } else {
            current.join(target)
        };
        let rest: PathBuf = components.collect();
        link_dirs(&resolved.join(rest), dirs, depth + 1);
        return;
    }
}

/// Absolute and, where it exists, free of symlinks: sandbox rules and covers compare paths by
/// prefix, so a relative `--tls-key key.pem` or a symlinked certificate directory would slip
/// past them.
fn resolved(path: &Path) -> PathBuf {
    std::fs::canonicalize(path)
        .or_else(|_| std::path::absolute(path))
        .unwrap_or_else(|_| path.to_path_buf())
}

/// The state directory holds the token and the audit log: only the daemon's user may enter.
fn create_private_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("cannot create state directory {}", dir.display()))?;
    let mode = std::fs::metadata(dir)?.permissions().mode();
    if mode & 0o077 != 0 {
        tracing::warn!(dir = %dir.display(), mode = format!("{:o}", mode & 0o777), "state directory is open to other users");
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
    let user = engine
        .profiles
        .get(&engine.default_profile)
        .and_then(|p| p.user.as_ref())?;
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

fn host_facts() -> HostFacts {
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
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// `executor run`: one command, output streamed to stdout, exit code passed on.
fn run_local(args: RunArgs) -> anyhow::Result<ExitCode> {
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
    let rt = runtime()?;
    let Setup {
        engine, cgroups, ..
    } = rt.block_on(setup(
        limits,
        interpreter,
        cwd.clone(),
        default_state_dir(),
        Vec::new(),
        ProfileChoice {
            default: valid.profile.clone(),
            ..ProfileChoice::default()
        },
        None,
    ))?;
    let kept = engine.limits.max_output_bytes;
    let code = rt.block_on(async move {
        let (tx, mut rx) = mpsc::channel::<ServerMessage>(16);
        let printer = tokio::spawn(async move {
            let mut stdout = std::io::stdout();
            while let Some(msg) = rx.recv().await {
                if let ServerMessage::Output(chunk) = msg {
                    let _ = stdout.write_all(chunk.data.as_bytes());
                    let _ = stdout.flush();
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
        let result = engine.execute(&valid, Some(sink), stop).await;
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
    for hierarchy in cgroups.all() {
        cgroup::remove(&hierarchy.parent);
    }
    code
}

/// `executor check`: which layers and profiles this host supports, and why not.
fn check() -> anyhow::Result<ExitCode> {
    let rt = runtime()?;
    let workspace = std::env::temp_dir();
    let Setup {
        engine,
        probe,
        cgroups,
    } = rt.block_on(setup(
        default_limits(),
        vec!["bash".into(), "-c".into()],
        workspace,
        default_state_dir(),
        Vec::new(),
        ProfileChoice {
            probe_all: true,
            ..ProfileChoice::default()
        },
        None,
    ))?;
    let facts = host_facts();
    println!(
        "host: {} {} ({} cores)",
        facts.kernel, facts.arch, facts.cores
    );
    println!("cgroups:");
    for (name, h) in [
        ("cgroup2 (kill)", &cgroups.unified),
        ("pids controller", &cgroups.pids),
        ("memory controller", &cgroups.memory),
    ] {
        match h {
            Some(h) => println!("  {name:<18} yes  {}", h.home.display()),
            None => println!("  {name:<18} no   (limits fall back to rlimits)"),
        }
    }
    println!("profiles:");
    for (name, outcome) in &probe {
        match outcome {
            Ok(layers) => println!("  {name:<15} ok    {}", layers.join(" ")),
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
fn tls_fingerprint(args: TlsFingerprintArgs) -> anyhow::Result<ExitCode> {
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
