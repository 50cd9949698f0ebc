//! What `agent exec` and `agent shell` share below both (`exec --stdin` runs through the
//! shell's attached loop): where a command runs, its `--env` pairs, and the exit code its end
//! becomes.

use std::collections::BTreeMap;

use anyhow::bail;
use clap::Args;
use protocol::Ending;

use crate::deploy::flags::ExecutorArgs;

#[derive(Args)]
pub struct ExecArgs {
    #[command(flatten)]
    pub executor: ExecutorArgs,
    /// Seconds before the command's whole process tree is killed.
    #[arg(long, default_value_t = 30.0)]
    pub timeout: f64,
    #[command(flatten)]
    pub place: CommandPlace,
    /// Feed our stdin to the command's stdin (protocol 1.1 `spawn`; without it the command's
    /// stdin is empty).
    #[arg(long)]
    pub stdin: bool,
    /// The command; several words are joined with spaces, as ssh does.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Exit code of `agent exec` for its own failures (as ssh uses 255).
pub const EXEC_FAILED: u8 = 255;

/// Where a command runs, what it adds to its environment and the network it asks for
/// (`exec`, `shell`).
#[derive(Args)]
pub struct CommandPlace {
    /// Working directory (default: the executor's workspace; for a local executor, here).
    #[arg(long, value_name = "DIR")]
    pub cwd: Option<String>,
    /// Extra environment variable NAME=VALUE; repeatable.
    #[arg(long = "env", value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    #[command(flatten)]
    pub network: crate::network::NetworkArgs,
}

/// `--env NAME=VALUE` flags as a map.
pub fn env_pairs(pairs: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    let mut env = BTreeMap::new();
    for pair in pairs {
        let Some((name, value)) = pair.split_once('=') else {
            bail!("--env expects NAME=VALUE, got {pair:?}");
        };
        env.insert(name.to_string(), value.to_string());
    }
    Ok(env)
}

/// Our exit code for how a command ended: its own code, 124 on timeout, 128+N when signal N
/// ended it, 130 when it was cancelled.
pub fn exit_code(returncode: i32, ended: Ending) -> u8 {
    match ended {
        Ending::TimedOut => 124,
        Ending::Cancelled | Ending::Disconnected | Ending::Shutdown => 130,
        Ending::Signaled => 128 + returncode.unsigned_abs().min(127) as u8,
        Ending::Exited => (returncode & 0xff) as u8,
    }
}
