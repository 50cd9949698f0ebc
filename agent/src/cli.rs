//! Command line: the subcommands and their dispatch. Each subcommand's flags live with it.

use clap::{Parser, Subcommand};

use crate::command_args::ExecArgs;
use crate::run::RunArgs;

#[derive(Parser)]
#[command(
    name = "agent",
    version,
    about = "Run the mini-swe-agent loop with every command sent to a sandboxed executor"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Solve a task: query the model, run its commands through an executor, save a trajectory.
    Run(Box<RunArgs>),
    /// Run one command through an executor; its output on stdout, its return code as ours.
    Exec(Box<ExecArgs>),
    /// Copy files or directories between here and an executor (`:PATH` is the executor's
    /// side, `-` stdin or stdout), like `docker cp`.
    Cp(Box<crate::cp::CpArgs>),
    /// An interactive shell on a terminal in the sandbox, like `docker exec -it`.
    Shell(Box<crate::attach::ShellArgs>),
    /// Run a benchmark: many instances, each with its own executor, several at once
    /// (mirrors `mini-extra swebench`).
    Batch(Box<crate::batch::BatchArgs>),
    /// Start executors for other clients, or remove what a killed agent left behind.
    #[command(subcommand)]
    Deploy(crate::deploy::cli::DeployCommand),
}

pub async fn dispatch(cli: Cli) -> anyhow::Result<u8> {
    match cli.command {
        Command::Run(args) => crate::run::run(*args).await,
        Command::Exec(args) => crate::exec::exec(*args).await,
        Command::Cp(args) => crate::cp::cp(*args).await,
        Command::Shell(args) => crate::attach::shell(*args).await,
        Command::Batch(args) => crate::batch::command(*args).await,
        Command::Deploy(command) => crate::deploy::cli::dispatch(command).await,
    }
}
