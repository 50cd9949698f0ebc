//! `agent`: an unprivileged client that runs the mini-swe-agent loop and sends every command to
//! an executor over WebSocket. See agent/README.md.
#![forbid(unsafe_code)]

mod agent_loop;
mod archive;
mod attach;
mod batch;
mod cli;
mod command_args;
mod config;
mod config_files;
mod console;
mod cp;
mod demo;
mod deploy;
mod exec;
mod executor_client;
mod model;
mod network;
mod notes;
mod run;
mod shell;
mod target;
mod templates;
mod terminal;
mod tls;
mod trajectory;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("AGENT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("agent: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(cli::dispatch(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("agent: {e:#}");
            ExitCode::from(2)
        }
    }
}
