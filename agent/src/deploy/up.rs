//! `agent deploy up`: start one executor and say how to reach it, for clients in other
//! languages (the Python package) that keep the deployment logic here, once.
//!
//! The contract: one JSON line on stdout,
//! `{"url", "token_file", "tls_fingerprint", "deployment", "id", "owned"}` (`owned`: started for
//! this caller alone, so every profile is its to choose from); then the deployment stays up
//! until our stdin reaches end of file (or SIGTERM / SIGINT), is torn down, and we exit 0.
//! On failure: a non-zero exit, `{"error": "..."}` on stdout and a message on stderr.

use std::io::{Read, Write};

use clap::Args;
use serde_json::json;
use tokio::signal::unix::{signal, SignalKind};

use super::flags::ExecutorArgs;
use super::TaskSpec;

#[derive(Args)]
pub struct UpArgs {
    #[command(flatten)]
    pub executor: ExecutorArgs,
    /// Config file (mini-swe-agent YAML) or KEY=VALUE override (repeatable).
    #[arg(short = 'c', long = "config", value_name = "FILE|KEY=VALUE")]
    pub config: Vec<String>,
    /// Default working directory of the executor (local: a host directory; docker: a path
    /// in the container; default: the executor's own workspace).
    #[arg(long, value_name = "DIR")]
    pub workspace: Option<String>,
    /// Print the JSON line (the only output format; accepted for clarity).
    #[arg(long)]
    pub json: bool,
}

/// Exit code of a deployment that did not come up.
const FAILED: u8 = 1;

pub async fn command(args: UpArgs) -> anyhow::Result<u8> {
    let failed = |message: String| {
        println!("{}", json!({ "error": message }));
        eprintln!("agent deploy up: {message}");
        Ok(FAILED)
    };
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut config = match crate::config::load(&args.config) {
        Ok(c) => c,
        Err(e) => return failed(e.to_string()),
    };
    if let Err(e) = args.executor.apply(&mut config.environment) {
        return failed(format!("{e:#}"));
    }
    let env = &config.environment;
    let deployment = match super::for_new_run(env, "up") {
        Ok((_, d)) => d,
        Err(e) => return failed(format!("{e:#}")),
    };
    let mut workspace = args.workspace.clone().or_else(|| env.cwd.clone());
    // A local executor deployed for a client gets a fresh workspace of its own, as a container
    // has its image's (never the caller's working directory, which every deployment would
    // share); removed after the teardown.
    let mut fresh = None;
    if workspace.is_none() && deployment.kind() == "local" {
        match fresh_workspace() {
            Ok((dir, path)) => {
                workspace = Some(path.display().to_string());
                fresh = Some(dir);
            }
            Err(e) => return failed(format!("{e:#}")),
        }
    }
    let task = TaskSpec {
        name: "deploy-up".into(),
        image: env.image.clone(),
        workspace,
        network: env.network.clone(),
    };
    let start = super::start_within(deployment.as_ref(), &task, super::start_timeout(env));
    let deployed = tokio::select! {
        d = start => match d {
            Ok(d) => d,
            Err(e) => return failed(format!("{e:#}")),
        },
        _ = term.recv() => return failed("terminated while starting".into()),
        _ = int.recv() => return failed("interrupted while starting".into()),
    };
    // A client needs a file: write the token into a private one if the executor's is not.
    let mut kept = None;
    let token_file = match (&deployed.endpoint.token_file, &deployed.endpoint.token) {
        (Some(path), _) => Some(path.clone()),
        (None, Some(token)) => match super::private_token_dir(token) {
            Ok((dir, path)) => {
                kept = Some(dir);
                Some(path)
            }
            Err(e) => {
                deployed.stop().await;
                return failed(format!("{e:#}"));
            }
        },
        (None, None) => None,
    };
    let line = json!({
        "url": deployed.endpoint.url,
        "token_file": token_file,
        "tls_fingerprint": deployed.endpoint.tls_fingerprint,
        "deployment": deployed.kind,
        "id": deployed.id,
        "owned": deployed.owned,
    });
    let mut stdout = std::io::stdout();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
    // Stdin is read on a plain thread: the runtime never waits for it at exit.
    let (eof_tx, eof_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut sink = [0u8; 4096];
        let mut stdin = std::io::stdin();
        while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
        let _ = eof_tx.send(());
    });
    tokio::select! {
        _ = eof_rx => {}
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    deployed.stop().await;
    drop((kept, fresh));
    Ok(0)
}

/// `<tmp>/agent-deploy-XXXX/workspace`, writable by the sandbox's identity.
fn fresh_workspace() -> anyhow::Result<(tempfile::TempDir, std::path::PathBuf)> {
    let dir = tempfile::Builder::new().prefix("agent-deploy-").tempdir()?;
    let path = dir.path().join("workspace");
    super::local::make_open_dir(&path)?;
    Ok((dir, path))
}
