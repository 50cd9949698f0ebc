//! The command line's arguments of each subcommand but `connect` (which adds its own to
//! `serve`'s), and what they default to: below `main`, which parses them, and the modules
//! that run the subcommands (`serve`, `connect`, `local`).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::bail;
use clap::Args;

use crate::dial_out;

/// Port `executor serve` listens on when `--listen` names none.
const DEFAULT_PORT: u16 = 7681;

#[derive(Args)]
pub(crate) struct TlsFingerprintArgs {
    /// State directory of the daemon whose generated certificate to read.
    #[arg(long)]
    pub(crate) state_dir: Option<PathBuf>,
    /// A PEM certificate file to read instead (as given to `serve --tls-cert`).
    #[arg(long, value_name = "PATH", conflicts_with = "state_dir")]
    pub(crate) tls_cert: Option<PathBuf>,
}

#[derive(Args)]
pub(crate) struct CheckArgs {
    /// Interpreter the probes run under, as for `serve` (`sh -c` on an image without bash).
    #[arg(long, default_value = "bash -c")]
    pub(crate) interpreter: String,
    /// Directory of extra profiles (*.json) to check too.
    #[arg(long)]
    pub(crate) profiles_dir: Option<PathBuf>,
}

#[derive(Args)]
pub(crate) struct CommonArgs {
    /// Interpreter and its flag; the command is appended as the last argument.
    #[arg(long, default_value = "bash -c")]
    pub(crate) interpreter: String,
    /// Bytes of output kept per command (first and last halves); the total is always counted.
    #[arg(long)]
    pub(crate) max_output_bytes: Option<usize>,
}

// clap prints these doc comments as --help, where <placeholders> are meant literally.
#[allow(rustdoc::invalid_html_tags)]
#[derive(Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on. Non-loopback addresses need an existing --token-file, and --tls
    /// (or --allow-plaintext).
    #[arg(long, default_value_t = SocketAddr::from(([127, 0, 0, 1], DEFAULT_PORT)))]
    pub(crate) listen: SocketAddr,
    /// Serve wss:// (TLS). Without --tls-cert, a self-signed certificate is generated on first
    /// start in <state-dir>/tls/ and reused later; its SHA-256 fingerprint is printed for
    /// clients to pin.
    #[arg(long)]
    pub(crate) tls: bool,
    /// PEM certificate (chain) to serve; implies --tls and needs --tls-key.
    #[arg(long, value_name = "PATH", requires = "tls_key")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert; refused if group or others can read it.
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    pub(crate) tls_key: Option<PathBuf>,
    /// Serve plain ws:// on a non-loopback address: only behind a trusted proxy that
    /// terminates TLS, since the token and every command would otherwise cross the network
    /// in clear.
    #[arg(long, conflicts_with_all = ["tls", "tls_cert"])]
    pub(crate) allow_plaintext: bool,
    /// Directory for the token, the audit log and the default workspace.
    #[arg(long)]
    pub(crate) state_dir: Option<PathBuf>,
    /// Bearer token file; created with a random token (mode 0600) if missing.
    #[arg(long, conflicts_with = "clients")]
    pub(crate) token_file: Option<PathBuf>,
    /// Clients file (JSON): named clients with their tokens, profiles, limits and workspace
    /// policy, instead of one token. Reloaded on SIGHUP.
    #[arg(long)]
    pub(crate) clients: Option<PathBuf>,
    /// Seconds a dropped connection's commands keep running for the client to resume its
    /// session (0: they are killed at once). A client entry may override it.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) resume_grace: f64,
    /// Default working directory of commands; created if missing.
    #[arg(long)]
    pub(crate) workspace: Option<PathBuf>,
    /// Audit log, one JSON line per command.
    #[arg(long)]
    pub(crate) audit_log: Option<PathBuf>,
    /// Seconds a command may run when its request names no timeout.
    #[arg(long)]
    pub(crate) default_timeout: Option<f64>,
    /// Largest timeout a request may ask for, in seconds.
    #[arg(long)]
    pub(crate) max_timeout: Option<f64>,
    /// Commands one connection may run at once.
    #[arg(long)]
    pub(crate) max_commands_per_connection: Option<usize>,
    /// Commands the daemon runs at once over all connections.
    #[arg(long)]
    pub(crate) max_commands: Option<usize>,
    /// Open connections accepted at once.
    #[arg(long, default_value_t = 4096)]
    pub(crate) max_connections: usize,
    /// Memory the daemon keeps on behalf of all clients together, in MiB: process output
    /// (running and ended), queued stdin, replies kept for a resume, download queues. Past
    /// it the oldest kept output is dropped (readers see `dropped`) and stdin writes get
    /// `busy`. Default: an eighth of the host's memory (MemTotal), at least 256 MiB and at
    /// most 8 GiB.
    #[arg(long, value_name = "MIB")]
    pub(crate) memory_budget_mb: Option<u64>,
    /// The same for each client, in MiB, unless its clients-file entry names
    /// `memory_budget_bytes` (the single token's budget). Default: only the daemon's.
    #[arg(long, value_name = "MIB")]
    pub(crate) client_memory_budget_mb: Option<u64>,
    /// A browser origin (`Origin` header, e.g. `https://ui.example`) allowed to open the
    /// WebSocket; repeatable. Requests with any other `Origin` are refused, so a web page the
    /// operator visits cannot drive the executor; clients that are not browsers send none.
    #[arg(long = "allow-origin", value_name = "ORIGIN")]
    pub(crate) allow_origins: Vec<String>,
    /// Largest WebSocket message accepted, in bytes.
    #[arg(long)]
    pub(crate) max_message_bytes: Option<usize>,
    /// Profile for requests that name none (default: the strongest this host can run).
    #[arg(long)]
    pub(crate) default_profile: Option<String>,
    /// Directory of extra profiles (*.json); a name there replaces the built-in profile.
    #[arg(long)]
    pub(crate) profiles_dir: Option<PathBuf>,
    /// Profiles clients may use (repeatable); default: every loaded profile.
    #[arg(long = "allow-profile", value_name = "NAME")]
    pub(crate) allow_profiles: Vec<String>,
    /// Processes of all commands together (default: three quarters of the host's pid_max).
    #[arg(long)]
    pub(crate) max_total_processes: Option<u64>,
    /// Memory of all commands together, in MiB (default: three quarters of the host's).
    #[arg(long)]
    pub(crate) max_total_memory_mb: Option<u64>,
    /// A cgroup2 directory (delegated to the daemon, writable) to make the commands' cgroups
    /// in, instead of the daemon's own cgroup.
    #[arg(long, value_name = "DIR")]
    pub(crate) cgroup_parent: Option<PathBuf>,
    /// Disk quota of each client (and of the shared workspace) in bytes: its workspace, home
    /// and temporary space are a filesystem of this size of its own (an ext4 image on a loop
    /// device, allocated in full when the client's first command comes). Clients-file key:
    /// `disk_quota_bytes`.
    #[arg(long, value_name = "BYTES")]
    pub(crate) disk_quota_bytes: Option<u64>,
    /// Files (inodes) of that filesystem (default: one per 16 KiB). Clients-file key:
    /// `disk_quota_files`.
    #[arg(long, value_name = "N")]
    pub(crate) disk_quota_files: Option<u64>,
    /// The single token's network ceiling (without --clients): let its commands connect to
    /// what RULE names and nothing else (repeatable): `pypi.org`, `*.github.com:443`,
    /// `10.0.0.0/8:5432`. A request may narrow it, never widen it (docs/profiles.md,
    /// "network"). With --clients, each entry's `network` says it instead.
    #[arg(long = "allow-net", value_name = "RULE")]
    pub(crate) allow_net: Vec<String>,
    /// Refuse what RULE names even where an --allow-net rule covers it (repeatable; deny wins).
    #[arg(long = "deny-net", value_name = "RULE")]
    pub(crate) deny_net: Vec<String>,
    /// For tests and labs: answer the network policy's lookups of NAME with ADDR (like
    /// curl's --resolve), instead of asking the host's resolver; repeatable (NAME=ADDR).
    /// The answers are judged by the policy like any other.
    #[arg(long = "egress-resolve", value_name = "NAME=ADDR")]
    pub(crate) egress_resolve: Vec<String>,
    /// Build each command's sandbox on demand only: no warm worker (a sandbox built ahead of
    /// time, waiting for the client's next command) is kept. Saves the memory of the idle
    /// workers; costs the sandbox's setup time on every command.
    #[arg(long)]
    pub(crate) no_warm_workers: bool,
    /// Drain and exit when stdin reaches end-of-file: a parent that starts the daemon with a
    /// pipe on stdin takes it down with it, even when the parent is killed with SIGKILL.
    #[arg(long)]
    pub(crate) exit_on_stdin_eof: bool,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value = "text")]
    pub(crate) log_format: LogFormat,
    #[command(flatten)]
    pub(crate) common: CommonArgs,
    /// Set by `executor connect`: dial out to this relay once listening.
    #[arg(skip)]
    pub(crate) dial_out: Option<dial_out::Relay>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

#[derive(Args)]
pub(crate) struct RunArgs {
    /// Sandbox profile.
    #[arg(long)]
    pub(crate) profile: Option<String>,
    /// Seconds before the command's tree is killed (fractions allowed).
    #[arg(long, default_value_t = 30.0)]
    pub(crate) timeout: f64,
    /// Working directory (default: the current one).
    #[arg(long)]
    pub(crate) cwd: Option<PathBuf>,
    /// Extra environment variable, NAME=VALUE; repeatable.
    #[arg(long = "env", value_name = "NAME=VALUE")]
    pub(crate) env: Vec<String>,
    /// Let the command connect to what RULE names and nothing else (repeatable): `pypi.org`,
    /// `*.github.com:443`, `10.0.0.0/8:5432`. The run's network becomes a policy, enforced
    /// through the profile's network namespace (docs/profiles.md, "network").
    #[arg(long = "allow-net", value_name = "RULE")]
    pub(crate) allow_net: Vec<String>,
    /// Refuse what RULE names even where an --allow-net rule covers it (repeatable; deny wins).
    #[arg(long = "deny-net", value_name = "RULE")]
    pub(crate) deny_net: Vec<String>,
    /// Append the policy's decisions (one JSON line per connection attempt and name lookup,
    /// as `serve`'s decision log) to PATH. Without it they are only counted, on stderr.
    #[arg(long, value_name = "PATH", requires = "allow_net")]
    pub(crate) network_log: Option<PathBuf>,
    /// For tests and labs, as `serve --egress-resolve`: answer the policy's lookups of NAME
    /// with ADDR; repeatable (NAME=ADDR).
    #[arg(
        long = "egress-resolve",
        value_name = "NAME=ADDR",
        requires = "allow_net"
    )]
    pub(crate) egress_resolve: Vec<String>,
    #[command(flatten)]
    pub(crate) common: CommonArgs,
    /// The command; several words are joined with spaces, as ssh does.
    #[arg(last = true, required = true)]
    pub(crate) command: Vec<String>,
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
