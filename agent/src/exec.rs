//! `agent exec`: one command through an executor, like `ssh host CMD` but sandboxed.

use std::io::Write;

use anyhow::{bail, Context};
use futures_util::{SinkExt, StreamExt};
use protocol::{ClientMessage, ExecRequest, ServerMessage};
use tokio_tungstenite::tungstenite::Message;

use crate::agent_loop::{Interrupts, INTERRUPTED};
use crate::command_args::{env_pairs, exit_code, ExecArgs, EXEC_FAILED};
use crate::executor_client;
use crate::target::{Reached, Unreached};

pub async fn exec(args: ExecArgs) -> anyhow::Result<u8> {
    let mut interrupts = Interrupts::install()?;
    // A bad flag is said before an executor is started or reached.
    let network = match args.place.network.network() {
        Ok(network) => network,
        Err(e) => {
            eprintln!("agent exec: {e:#}");
            return Ok(EXEC_FAILED);
        }
    };
    let reached = match crate::target::reach(&args.executor, "exec", network, &mut interrupts).await
    {
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

async fn exec_with(
    args: &ExecArgs,
    reached: &Reached,
    interrupts: &mut Interrupts,
) -> anyhow::Result<u8> {
    let env = env_pairs(&args.place.env)?;
    // A local executor: the strongest profile whose commands can write here, as `run` does.
    let profile = reached
        .profile(
            args.executor.profile.as_deref(),
            args.place.network.network()?,
        )
        .await?;
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
        network: args.place.network.network()?,
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
                // The network it ran with, when it is not what was asked (a policy under a
                // profile and client granting none): said, as the command's output cannot.
                if let Some(network) = &result.extra.isolation.network {
                    if !network.note.is_empty() {
                        eprintln!("agent exec: network {}: {}", network.mode, network.note);
                    }
                }
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
