//! `executor`: runs shell commands for agents, each as a new process session whose whole tree
//! dies with it. See the README for the commands and `protocol/README.md` for the wire format.

#![forbid(unsafe_code)]

mod accounts;
mod audit;
mod budget;
mod clients;
mod connect;
mod disk_quota;
mod engine;
mod local;
mod metrics;
mod request;
mod runner;
mod serve;
mod server;
mod setup;
mod token;
mod workspaces;

use std::ffi::OsStr;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};

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
    #[command(about = RUN_ABOUT)]
    Run(RunArgs),
    /// Show which isolation layers and profiles work on this host, and why others do not.
    Check(CheckArgs),
    /// Serve as `serve` does, but over connections this daemon dials out to an agent's relay
    /// (targets that accept no inbound connection).
    Connect(Box<connect::ConnectArgs>),
    /// Print the SHA-256 fingerprint of the daemon's TLS certificate, for clients to pin.
    TlsFingerprint(TlsFingerprintArgs),
}

#[derive(Args)]
pub(crate) struct TlsFingerprintArgs {
    /// State directory of the daemon whose generated certificate to read.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// A PEM certificate file to read instead (as given to `serve --tls-cert`).
    #[arg(long, value_name = "PATH", conflicts_with = "state_dir")]
    tls_cert: Option<PathBuf>,
}

#[derive(Args)]
pub(crate) struct CheckArgs {
    /// Interpreter the probes run under, as for `serve` (`sh -c` on an image without bash).
    #[arg(long, default_value = "bash -c")]
    interpreter: String,
    /// Directory of extra profiles (*.json) to check too.
    #[arg(long)]
    profiles_dir: Option<PathBuf>,
}

#[derive(Args)]
pub(crate) struct CommonArgs {
    /// Interpreter and its flag; the command is appended as the last argument.
    #[arg(long, default_value = "bash -c")]
    interpreter: String,
    /// Bytes of output kept per command (first and last halves); the total is always counted.
    #[arg(long)]
    max_output_bytes: Option<usize>,
}

#[derive(Args)]
pub(crate) struct ServeArgs {
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
    /// Memory the daemon keeps on behalf of all clients together, in MiB: process output
    /// (running and ended), queued stdin, replies kept for a resume, download queues. Past
    /// it the oldest kept output is dropped (readers see `dropped`) and stdin writes get
    /// `busy`. Default: an eighth of the host's memory (MemTotal), at least 256 MiB and at
    /// most 8 GiB.
    #[arg(long, value_name = "MIB")]
    memory_budget_mb: Option<u64>,
    /// The same for each client, in MiB, unless its clients-file entry names
    /// `memory_budget_bytes` (the single token's budget). Default: only the daemon's.
    #[arg(long, value_name = "MIB")]
    client_memory_budget_mb: Option<u64>,
    /// A browser origin (`Origin` header, e.g. `https://ui.example`) allowed to open the
    /// WebSocket; repeatable. Requests with any other `Origin` are refused, so a web page the
    /// operator visits cannot drive the executor; clients that are not browsers send none.
    #[arg(long = "allow-origin", value_name = "ORIGIN")]
    allow_origins: Vec<String>,
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
    /// A cgroup2 directory (delegated to the daemon, writable) to make the commands' cgroups
    /// in, instead of the daemon's own cgroup.
    #[arg(long, value_name = "DIR")]
    cgroup_parent: Option<PathBuf>,
    /// Disk quota of each client (and of the shared workspace) in bytes: its workspace, home
    /// and temporary space are a filesystem of this size of its own (an ext4 image on a loop
    /// device, allocated in full when the client's first command comes). Clients-file key:
    /// `disk_quota_bytes`.
    #[arg(long, value_name = "BYTES")]
    disk_quota_bytes: Option<u64>,
    /// Files (inodes) of that filesystem (default: one per 16 KiB). Clients-file key:
    /// `disk_quota_files`.
    #[arg(long, value_name = "N")]
    disk_quota_files: Option<u64>,
    /// Build each command's sandbox on demand only: no warm worker (a sandbox built ahead of
    /// time, waiting for the client's next command) is kept. Saves the memory of the idle
    /// workers; costs the sandbox's setup time on every command.
    #[arg(long)]
    no_warm_workers: bool,
    /// Drain and exit when stdin reaches end-of-file: a parent that starts the daemon with a
    /// pipe on stdin takes it down with it, even when the parent is killed with SIGKILL.
    #[arg(long)]
    exit_on_stdin_eof: bool,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    #[command(flatten)]
    common: CommonArgs,
    /// Set by `executor connect`: dial out to this relay once listening.
    #[arg(skip)]
    dial_out: Option<connect::Relay>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

const RUN_ABOUT: &str =
    "Run one command locally through the same path the daemon uses; exit with its code";

/// `executor run` parsed on its own (see `main`): the same arguments, help and errors as the
/// `run` subcommand of [`Cli`].
#[derive(Parser)]
#[command(
    name = "executor run",
    about = RUN_ABOUT
)]
struct RunCli {
    #[command(flatten)]
    args: RunArgs,
}

#[derive(Args)]
pub(crate) struct RunArgs {
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
        Some(arg) if arg == OsStr::new(sandbox::HELPER_ARG) => return sandbox::helper_main(),
        Some(arg) if arg == OsStr::new(sandbox::spawner::FORK_SERVER_ARG) => {
            sandbox::spawner::main()
        }
        _ => {}
    }
    // `executor run` is a one-shot whose start-up is part of every command it runs; clap
    // builds every subcommand's arguments before it parses any (about 0.25 ms here, most of
    // them `serve`'s), so `run`'s are parsed alone.
    if std::env::args_os().nth(1).as_deref() == Some(OsStr::new("run")) {
        // Usage lines name the program as it was invoked, as they do for the subcommand.
        let mut name = std::env::args_os()
            .next()
            .map(PathBuf::from)
            .and_then(|p| p.file_name().map(|n| n.to_os_string()))
            .unwrap_or_else(|| "executor".into());
        name.push(" run");
        let run = RunCli::parse_from(std::iter::once(name).chain(std::env::args_os().skip(2)));
        return finish(local::run_local(run.args));
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve::serve(*args).map(|()| ExitCode::SUCCESS),
        Command::Connect(args) => connect::run(*args).map(|()| ExitCode::SUCCESS),
        Command::Run(args) => local::run_local(args),
        Command::Check(args) => local::check(args),
        Command::TlsFingerprint(args) => local::tls_fingerprint(args),
    };
    finish(result)
}

/// The exit code of a subcommand, its error (if any) said on stderr.
fn finish(result: anyhow::Result<ExitCode>) -> ExitCode {
    result.unwrap_or_else(|err| {
        eprintln!("executor: {err:#}");
        ExitCode::from(2)
    })
}

pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// The runtime of `executor run`: one command needs one thread, and a multi-thread runtime's
/// workers cost a one-shot about 0.3 ms to start and stop. Nothing of the command's path
/// blocks it for long (stdout is written through tokio's, which writes on its blocking pool).
pub(crate) fn local_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

pub(crate) fn interpreter(text: &str) -> anyhow::Result<Vec<String>> {
    let argv: Vec<String> = text.split_whitespace().map(str::to_string).collect();
    if argv.is_empty() {
        bail!("--interpreter must name a program");
    }
    Ok(argv)
}

pub(crate) fn home_dir() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"))
}

pub(crate) fn default_state_dir() -> PathBuf {
    if nix::unistd::geteuid().is_root() {
        PathBuf::from("/var/lib/executor")
    } else {
        home_dir().join(".local/state/executor")
    }
}
