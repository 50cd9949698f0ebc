//! Where `--deployments` puts executors, and what each needs beside the agent's flags:
//! `remote` a pool of executors the bench starts on loopback, `reverse` executors that dial
//! the agent's relay once it says where (`executor connect`), `ssh` an sshd the bench starts
//! on loopback with keys it makes (as the deploy suite does), `docker` podman with the test
//! harness's task image.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::daemon::Daemon;

/// Executors in the `remote` pool: one per worker of the largest batch.
pub const POOL: usize = 8;

/// A deployment ready to be used: the flags for `agent deploy up` / `agent batch`, and what
/// must live while they run.
pub struct Place {
    pub flags: Vec<String>,
    /// `reverse`: executors dial in once the agent prints its relay's address.
    pub reverse: bool,
    /// The executor for `executor connect`.
    pub executor: PathBuf,
    _daemons: Vec<Daemon>,
    _sshd: Option<executor_tests::sshd::Sshd>,
    dir: tempfile::TempDir,
}

impl Place {
    pub fn new(kind: &str, agent: &Path) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("executor-bench-place-")
            .tempdir()?;
        let executor = agent.with_file_name("executor");
        let mut place = Self {
            flags: Vec::new(),
            reverse: false,
            executor: executor.clone(),
            _daemons: Vec::new(),
            _sshd: None,
            dir,
        };
        place.flags = match kind {
            "local" => vec!["--deploy".into(), "local".into()],
            "docker" => podman_flags()?,
            "remote" => {
                // A pool of executors of this build, each with its own token: a config file
                // names them (the flags take one token file for all).
                let mut entries = Vec::new();
                for i in 0..POOL {
                    let daemon = Daemon::start(&executor, &[])?;
                    let token_file = place.dir.path().join(format!("token-{i}"));
                    std::fs::write(&token_file, &daemon.token)?;
                    entries.push(serde_json::json!({"url": daemon.url, "token_file": token_file}));
                    place._daemons.push(daemon);
                }
                let config = place.dir.path().join("remote.json");
                std::fs::write(
                    &config,
                    serde_json::to_string(
                        &serde_json::json!({"environment": {"remote": entries}}),
                    )?,
                )?;
                vec![
                    "--deploy".into(),
                    "remote".into(),
                    "-c".into(),
                    config.display().to_string(),
                ]
            }
            "reverse" => {
                place.reverse = true;
                vec![
                    "--deploy".into(),
                    "reverse".into(),
                    "--reverse-listen".into(),
                    "127.0.0.1:0".into(),
                ]
            }
            "ssh" => {
                let sshd = executor_tests::sshd::Sshd::start()?;
                let flags = sshd.deploy_flags();
                place._sshd = Some(sshd);
                flags
            }
            other => bail!("no benchmark for deployment {other}"),
        };
        Ok(place)
    }

    /// For `reverse`: read the agent's stderr until it prints `executor connect wss://...`,
    /// then start `count` executors dialling that relay. The rest of stderr is drained.
    pub async fn dial_in(
        &self,
        stderr: tokio::process::ChildStderr,
        count: usize,
    ) -> anyhow::Result<Vec<tokio::process::Child>> {
        let mut lines = BufReader::new(stderr).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await? {
                if line.contains("executor connect wss://") {
                    return Ok(line);
                }
            }
            bail!("the agent never said where its relay listens")
        })
        .await
        .context("the agent never said where its relay listens")??;
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let words: Vec<&str> = line.split_whitespace().collect();
        let after = |flag: &str| -> anyhow::Result<String> {
            let at = words
                .iter()
                .position(|w| *w == flag)
                .with_context(|| format!("no {flag} in {line:?}"))?;
            Ok(words.get(at + 1).context("truncated")?.to_string())
        };
        let (url, pin, token_file) = (
            after("connect")?,
            after("--tls-fingerprint")?,
            after("--token-file")?,
        );
        let mut executors = Vec::new();
        for _ in 0..count {
            let state = tempfile::Builder::new()
                .prefix("state-")
                .tempdir_in(self.dir.path())?
                .keep();
            executors.push(
                tokio::process::Command::new(&self.executor)
                    .args(["connect", &url, "--tls-fingerprint", &pin])
                    .args(["--token-file", &token_file])
                    .arg("--state-dir")
                    .arg(&state)
                    .args(["--give-up-after", "3"])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .kill_on_drop(true)
                    .spawn()
                    .context("cannot run executor connect")?,
            );
        }
        Ok(executors)
    }
}

/// Stop dialling executors (SIGKILL, waited for).
pub async fn hang_up(executors: Vec<tokio::process::Child>) {
    for mut executor in executors {
        let _ = executor.kill().await;
    }
}

fn podman_flags() -> anyhow::Result<Vec<String>> {
    let image = executor_tests::container::task_image().map_err(anyhow::Error::msg)?;
    Ok(vec![
        "--deploy".into(),
        "docker".into(),
        "--docker-executable".into(),
        "podman".into(),
        "--docker-global-arg=--runtime=runc".into(),
        "--docker-run-arg=--ulimit=nofile=1024:1024".into(),
        "--docker-run-arg=--ulimit=nproc=4096:4096".into(),
        "--executor-static".into(),
        executor_tests::static_executor().display().to_string(),
        "--image".into(),
        image,
        "--label".into(),
        "executor-bench=1".into(),
    ])
}
