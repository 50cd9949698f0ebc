//! `agent exec`: one command through an executor, like `ssh host CMD` but sandboxed.

use std::collections::BTreeMap;
use std::io::Write;

use anyhow::{bail, Context};
use clap::Args;
use futures_util::{SinkExt, StreamExt};
use protocol::{ClientMessage, Ending, ExecRequest, ServerMessage};
use tokio_tungstenite::tungstenite::Message;

use crate::agent_loop::{Interrupts, INTERRUPTED};
use crate::deploy::flags::ExecutorArgs;
use crate::executor_client;
use crate::target::{Reached, Unreached};

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

pub async fn exec(args: ExecArgs) -> anyhow::Result<u8> {
    let mut interrupts = Interrupts::install()?;
    let reached = match crate::target::reach(&args.executor, "exec", &mut interrupts).await {
        Ok(reached) => reached,
        Err(Unreached::Interrupted) => return Ok(INTERRUPTED),
        Err(Unreached::Failed(e)) => {
            eprintln!("agent exec: {e:#}");
            return Ok(EXEC_FAILED);
        }
    };
    let result = if args.stdin {
        crate::attach::exec_with_stdin(&args, &reached, &mut interrupts).await
    } else {
        exec_with(&args, &reached, &mut interrupts).await
    };
    reached.stop().await;
    match result {
        Ok(code) => Ok(code),
        Err(e) => {
            eprintln!("agent exec: {e:#}");
            Ok(EXEC_FAILED)
        }
    }
}

/// Where a command runs and what it adds to its environment (`exec`, `shell`).
#[derive(Args)]
pub struct CommandPlace {
    /// Working directory (default: the executor's workspace; for a local executor, here).
    #[arg(long, value_name = "DIR")]
    pub cwd: Option<String>,
    /// Extra environment variable NAME=VALUE; repeatable.
    #[arg(long = "env", value_name = "NAME=VALUE")]
    pub env: Vec<String>,
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

async fn exec_with(
    args: &ExecArgs,
    reached: &Reached,
    interrupts: &mut Interrupts,
) -> anyhow::Result<u8> {
    let env = env_pairs(&args.place.env)?;
    // A local executor: the strongest profile whose commands can write here, as `run` does.
    let profile = reached.profile(args.executor.profile.as_deref()).await?;
    let target = &reached.target;
    let (mut ws, hello) = executor_client::connect(
        &target.endpoint.url,
        target.endpoint.token.as_deref(),
        &reached.tls,
    )
    .await
    .map_err(|e| {
        anyhow::anyhow!(
            "cannot connect to the executor at {}: {e}",
            target.endpoint.url
        )
    })?;
    crate::target::say_default_profile(&profile, &hello);
    let request = ExecRequest {
        id: "exec".into(),
        command: args.command.join(" "),
        cwd: args.place.cwd.clone(),
        env,
        timeout: Some(args.timeout),
        profile,
        stream: true,
    };
    let text = serde_json::to_string(&ClientMessage::Exec(request))?;
    let outcome = run_command(&mut ws, text, args.timeout, interrupts).await;
    // A close frame, whatever happened: the executor ends the session at once. A socket that
    // is merely dropped would leave the command running for the executor's resume grace.
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), ws.close(None)).await;
    outcome
}

/// Send the command and stream its output until its result.
async fn run_command(
    ws: &mut executor_client::Ws,
    text: String,
    timeout: f64,
    interrupts: &mut Interrupts,
) -> anyhow::Result<u8> {
    ws.send(Message::text(text))
        .await
        .context("cannot send the command")?;
    let mut stdout = std::io::stdout();
    let deadline =
        tokio::time::Instant::now() + std::time::Duration::from_secs_f64(timeout.max(0.0) + 30.0);
    let mut cancelled = false;
    loop {
        let frame = tokio::select! {
            frame = tokio::time::timeout_at(deadline, ws.next()) => {
                frame.map_err(|_| anyhow::anyhow!("the executor sent no result in time"))?
            }
            _ = interrupts.recv() => {
                if cancelled {
                    return Ok(INTERRUPTED);
                }
                // Ctrl-C: ask the executor to kill the command; its result follows.
                cancelled = true;
                let cancel = ClientMessage::Cancel(protocol::CancelRequest { id: "exec".into() });
                ws.send(Message::text(serde_json::to_string(&cancel)?)).await.context("cannot send the cancel")?;
                continue;
            }
        };
        let text = match frame {
            Some(Ok(Message::Text(text))) => text,
            Some(Ok(Message::Close(_))) | None => bail!("the executor closed the connection"),
            Some(Err(e)) => bail!("connection to the executor failed: {e}"),
            Some(Ok(_)) => continue,
        };
        match serde_json::from_str::<ServerMessage>(text.as_str())? {
            ServerMessage::Resumed(_) => {}
            ServerMessage::Output(chunk) => {
                let _ = stdout.write_all(chunk.data.as_bytes());
                let _ = stdout.flush();
            }
            ServerMessage::Result(result) => {
                if !result.exception_info.is_empty() {
                    eprintln!("agent exec: {}", result.exception_info);
                }
                return Ok(exit_code(result.returncode, result.extra.ended));
            }
            ServerMessage::Error(err) => bail!(
                "the executor refused the command ({}): {}",
                err.code,
                err.message
            ),
            // Hello, and replies to protocol 1.1 requests this command never makes.
            _ => continue,
        }
    }
}
