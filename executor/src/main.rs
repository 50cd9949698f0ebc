//! `executor`: runs shell commands for agents, each as a new process session whose whole tree
//! dies with it. See the README for the commands and `protocol/README.md` for the wire format.

#![forbid(unsafe_code)]

mod accounts;
mod args;
mod audit;
mod budget;
mod clients;
mod connect;
mod dial_out;
mod disk_quota;
// The egress proxy of issue 38: built and tested here, wired into the daemon in a later step.
#[cfg_attr(not(test), allow(dead_code))]
mod egress;
mod enforce;
mod engine;
mod local;
mod metrics;
mod network_policy;
mod request;
mod runner;
mod runtimes;
mod serve;
mod server;
mod setup;
mod token;
mod workspaces;

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::args::{CheckArgs, RunArgs, ServeArgs, TlsFingerprintArgs};

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
