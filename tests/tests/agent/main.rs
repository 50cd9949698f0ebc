//! End-to-end tests of the `agent` binary: real executor, real HTTP model APIs (mocked
//! in-process), outcomes read from the exit code, stdout and the trajectory on disk.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod attached;
mod choices;
mod copies;
mod executor_side;
mod exits;
mod interactive;
mod messages;
mod mock;
mod models;
mod network;
mod resume;
mod tls;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

pub use executor_tests::host_waits::started;
use executor_tests::{binary, Target};
use serde_json::Value;

/// Longest any agent run in these tests may take.
const RUN_PATIENCE: Duration = Duration::from_secs(90);

/// A finished agent run.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub traj: Value,
}

impl Run {
    pub fn exit_status(&self) -> &str {
        self.traj["info"]["exit_status"]
            .as_str()
            .unwrap_or_default()
    }

    pub fn messages(&self) -> &Vec<Value> {
        self.traj["messages"].as_array().unwrap()
    }

    pub fn with_role(&self, role: &str) -> Vec<&Value> {
        self.messages()
            .iter()
            .filter(|m| m["role"] == role)
            .collect()
    }
}

/// A scratch directory with a trajectory path inside.
pub struct Scratch {
    pub dir: executor_tests::TempDir,
}

impl Default for Scratch {
    fn default() -> Self {
        Self::new()
    }
}

impl Scratch {
    /// Writable by the sandbox's identity (uid 65534 under strict and landlock): a local
    /// executor works here under strict, as in a user's own checkout (the agent never steps
    /// down to a profile that writes the host).
    pub fn new() -> Self {
        use std::os::unix::fs::PermissionsExt;
        let dir = executor_tests::TempDir::with_prefix("agent-e2e-").unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        Self { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn traj(&self) -> PathBuf {
        self.path().join("run.traj.json")
    }

    /// Write a file and return its path.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Build the agent command: `agent run -o <traj> <args>`, cwd = scratch dir.
    pub fn agent(&self, args: &[&str]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(binary("agent"));
        cmd.arg("run")
            .arg("-o")
            .arg(self.traj())
            .args(args)
            .current_dir(self.path())
            .env("OPENAI_API_KEY", mock::API_KEY)
            .env("ANTHROPIC_API_KEY", mock::API_KEY)
            .env_remove("OPENAI_BASE_URL")
            .env_remove("ANTHROPIC_BASE_URL")
            .env_remove("MSWEA_MODEL_NAME")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        cmd
    }

    /// Write `script` (the scripted model's YAML) as `script.yaml` and return the arguments
    /// that play it on the task "t".
    pub fn scripted_args(&self, script: &str) -> Vec<String> {
        let path = self.write("script.yaml", script).display().to_string();
        ["--model", "scripted", "--script", &path, "--task", "t"]
            .map(String::from)
            .to_vec()
    }

    /// [`Scratch::agent`] with the scripted model playing `script` on the task "t", then
    /// `extra` arguments.
    pub fn scripted(&self, script: &str, extra: &[&str]) -> tokio::process::Command {
        let mut cmd = self.agent(&[]);
        cmd.args(self.scripted_args(script)).args(extra);
        cmd
    }

    /// [`Scratch::scripted`] pointed at `target`'s executor.
    pub fn scripted_against(
        &self,
        target: &impl Target,
        script: &str,
        extra: &[&str],
    ) -> tokio::process::Command {
        let mut cmd = self.scripted(script, extra);
        cmd.args(target.agent_args());
        cmd
    }

    /// [`Scratch::scripted`] run to completion.
    pub async fn run_scripted(&self, script: &str, extra: &[&str]) -> Run {
        self.finish(self.scripted(script, extra).spawn().unwrap())
            .await
    }

    /// [`Scratch::scripted_against`] run to completion.
    pub async fn run_scripted_against(
        &self,
        target: &impl Target,
        script: &str,
        extra: &[&str],
    ) -> Run {
        self.finish(
            self.scripted_against(target, script, extra)
                .spawn()
                .unwrap(),
        )
        .await
    }

    /// Start [`Scratch::scripted_against`] `daemon`; once the command holding `marker` runs,
    /// SIGKILL the executor under it. Returns the agent, which runs on.
    pub async fn kill_executor_mid_command(
        &self,
        daemon: &mut executor_tests::Daemon,
        script: &str,
        marker: &str,
        extra: &[&str],
    ) -> tokio::process::Child {
        let child = self
            .scripted_against(daemon, script, extra)
            .spawn()
            .unwrap();
        assert!(
            started(marker).await,
            "the command with {marker} never started"
        );
        daemon.signal_and_wait(nix::sys::signal::Signal::SIGKILL);
        child
    }

    /// [`Scratch::agent`] pointed at `target`'s executor (its URL, token file and pin).
    pub fn agent_against(&self, target: &impl Target, args: &[&str]) -> tokio::process::Command {
        let mut cmd = self.agent(args);
        cmd.args(target.agent_args());
        cmd
    }

    /// [`Scratch::run`] against `target`'s executor.
    pub async fn run_against(&self, target: &impl Target, args: &[&str]) -> Run {
        let child = self.agent_against(target, args).spawn().unwrap();
        self.finish(child).await
    }

    /// Run the agent to completion (bounded) and read its trajectory.
    pub async fn run(&self, args: &[&str]) -> Run {
        let child = self.agent(args).spawn().unwrap();
        self.finish(child).await
    }

    pub async fn finish(&self, child: tokio::process::Child) -> Run {
        let out = tokio::time::timeout(RUN_PATIENCE, child.wait_with_output())
            .await
            .expect("agent run did not finish in time")
            .unwrap();
        let traj = std::fs::read_to_string(self.traj())
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(Value::Null);
        let run = Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            traj,
        };
        eprintln!(
            "--- agent exit {} ---\nstdout:\n{}\nstderr:\n{}",
            run.code, run.stdout, run.stderr
        );
        run
    }
}

/// A finished one-shot command (`agent exec`, `cp`, `shell`): exit code, stdout as bytes, stderr.
pub struct Finished {
    pub code: i32,
    pub stdout: Vec<u8>,
    pub stderr: String,
}

/// The `agent` binary for a one-shot command: no stdin, output piped, killed with the test.
pub fn one_shot() -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(binary("agent"));
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// Wait for a one-shot agent command, bounded, and log what it said under `label`.
pub async fn finish_one_shot(child: tokio::process::Child, label: &str) -> Finished {
    let out = tokio::time::timeout(RUN_PATIENCE, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{label} did not finish in time"))
        .unwrap();
    let finished = Finished {
        code: out.status.code().unwrap_or(-1),
        stdout: out.stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    eprintln!(
        "--- {label}: exit {} ---\nstdout:\n{}\nstderr:\n{}",
        finished.code,
        String::from_utf8_lossy(&finished.stdout),
        finished.stderr
    );
    finished
}

/// Run `agent <subcommand> <target's flags> <args>` with `stdin` as its stdin, bounded.
pub async fn agent_against(
    target: &impl Target,
    subcommand: &str,
    args: &[&str],
    stdin: &[u8],
) -> Finished {
    use tokio::io::AsyncWriteExt;
    let mut child = one_shot()
        .arg(subcommand)
        .args(target.agent_args())
        .args(args)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let stdin = stdin.to_vec();
    // A writer of its own: a command that does not read all of it must not stall the test.
    let writer = tokio::spawn(async move {
        let _ = input.write_all(&stdin).await;
    });
    let finished = finish_one_shot(child, &format!("agent {subcommand} {args:?}")).await;
    writer.abort();
    finished
}

/// `agent exec <args>` to its end: exit code, stdout, stderr.
pub async fn agent_exec(args: &[&str]) -> (i32, String, String) {
    agent_exec_in(None, args).await
}

/// [`agent_exec`] in `cwd`, if given.
pub async fn agent_exec_in(cwd: Option<&std::path::Path>, args: &[&str]) -> (i32, String, String) {
    let mut cmd = tokio::process::Command::new(binary("agent"));
    cmd.arg("exec").args(args).stdin(Stdio::null());
    if let Some(cwd) = cwd {
        cmd.current_dir(cwd);
    }
    let out = tokio::time::timeout(executor_tests::PATIENCE, cmd.output())
        .await
        .expect("agent exec did not finish")
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Send `signal` to a running agent.
pub fn signal(child: &tokio::process::Child, signal: nix::sys::signal::Signal) {
    let pid = child.id().expect("the agent has exited already") as i32;
    executor_tests::host_waits::send_signal(pid, signal);
}

/// Asserts that the run exited with `code` and left a complete trajectory ending in `status`.
pub fn assert_ended(run: &Run, code: i32, status: &str) {
    assert_eq!(run.code, code, "{status}: {}", run.stderr);
    assert_complete_trajectory(run, status);
}

/// Every trajectory, whatever the exit, has mini's shape and ends with an exit message.
pub fn assert_complete_trajectory(run: &Run, status: &str) {
    let traj = &run.traj;
    assert_eq!(traj["trajectory_format"], "mini-swe-agent-1.1", "{traj}");
    assert_eq!(traj["info"]["exit_status"], status);
    assert!(traj["info"]["model_stats"]["api_calls"].is_u64());
    assert!(traj["info"]["model_stats"]["instance_cost"].is_number());
    assert!(traj["info"]["config"]["agent"].is_object());
    assert!(traj["info"]["config"]["environment"].is_object());
    let messages = run.messages();
    assert_eq!(messages[0]["role"], "system");
    assert_eq!(messages[1]["role"], "user");
    let last = messages.last().unwrap();
    assert_eq!(last["role"], "exit");
    assert_eq!(last["extra"]["exit_status"], status);
}
