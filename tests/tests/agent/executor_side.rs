//! The environment side: the demo, `agent exec`, remote executors with a token, and an
//! executor that breaks or dies mid-run.

use std::process::Stdio;

use executor_tests::{
    binary, eventually, marked_sleep, marker, processes_matching, Daemon, PATIENCE,
};

use crate::{agent_exec, agent_exec_in, assert_ended, signal, Scratch};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_fixes_the_toy_repository_and_submits_a_git_diff() {
    let s = Scratch::new();
    let run = s.run(&["--demo"]).await;
    assert_ended(&run, 0, "Submitted");
    let submission = run.traj["info"]["submission"].as_str().unwrap();
    assert!(
        submission.starts_with("diff --git a/mathlib.sh b/mathlib.sh"),
        "{submission}"
    );
    assert!(
        submission.contains("+  echo $(( $1 + $2 ))"),
        "{submission}"
    );
    assert!(run.stderr.contains("SCRIPTED"));
    assert!(run.stderr.contains("profile \"trusted\"") || run.stderr.contains("profile \""));
    assert!(run
        .stdout
        .contains(&format!("Trajectory: {}", s.traj().display())));
    // The failing test was seen failing, then passing.
    let tools = run.with_role("tool");
    assert!(tools[1]["content"]
        .as_str()
        .unwrap()
        .contains("FAIL: add 2 3 gave -1"));
    assert!(tools[3]["content"].as_str().unwrap().contains("PASS"));
    // The local executor the agent started is gone.
    let url = run
        .stderr
        .lines()
        .find_map(|l| l.split(" at ws://").nth(1))
        .and_then(|rest| rest.split('/').next())
        .expect("the agent says where its executor listens")
        .to_string();
    let addr: std::net::SocketAddr = url.parse().unwrap();
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "local executor still listening"
    );
    // The demo keeps its directory for people to look at; tests clean up.
    let repo = run
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("Demo repository: "))
        .expect("the demo says where its repository is");
    let dir = std::path::Path::new(repo).parent().unwrap();
    assert!(dir.join("repo/.git").is_dir());
    executor_tests::scratch::remove_tree(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_executor_is_used_with_its_token_and_default_profile() {
    let daemon = Daemon::start();
    let s = Scratch::new();
    let run = s
        .run_scripted_against(
            &daemon,
            "- command: pwd && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && pwd\n",
            &[],
        )
        .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    // No cwd configured: commands run in the executor's workspace.
    let workspace = std::fs::canonicalize(&daemon.workspace).unwrap();
    assert_eq!(
        run.traj["info"]["submission"].as_str().unwrap().trim(),
        workspace.to_str().unwrap()
    );
    let env = &run.traj["info"]["config"]["environment"];
    assert_eq!(env["profile"], daemon_default_profile(&daemon).await);
    assert!(
        !run.stderr.contains(&daemon.token),
        "the token must never be printed"
    );
    assert!(!serde_json::to_string(&run.traj)
        .unwrap()
        .contains(&daemon.token));
}

async fn daemon_default_profile(daemon: &Daemon) -> String {
    daemon.connect().await.hello.default_profile
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_refused_at_start() {
    let daemon = Daemon::start();
    let s = Scratch::new();
    let bad = s.write("token", "not-the-token\n");
    let run = s
        .run_scripted(
            "- command: echo hi\n",
            &[
                "--executor",
                &daemon.url,
                "--token-file",
                bad.to_str().unwrap(),
            ],
        )
        .await;
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("cannot connect to the executor"),
        "{}",
        run.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executor_killed_mid_run_gives_environment_error_and_a_complete_trajectory() {
    let mut daemon = Daemon::start();
    let s = Scratch::new();
    let marker = marker();
    let child = s
        .kill_executor_mid_command(
            &mut daemon,
            &format!(
                "- command: echo first\n- command: {}\n- command: echo never\n",
                marked_sleep(&marker)
            ),
            &marker,
            &["-c", "environment.reconnect_attempts=2"],
        )
        .await;
    let run = s.finish(child).await;
    assert_ended(&run, 6, "EnvironmentError");
    // Everything up to the failure is on disk: both model turns and the first observation.
    assert_eq!(run.with_role("assistant").len(), 2);
    assert_eq!(run.with_role("tool").len(), 1);
    let exit = run.messages().last().unwrap();
    assert!(
        exit["content"]
            .as_str()
            .unwrap()
            .contains("could not reconnect"),
        "{exit}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_environment_error_stops_the_run_and_is_never_shown_to_the_model() {
    let s = Scratch::new();
    let daemon = Daemon::start();
    let run = s
        .run_scripted_against(
            &daemon,
            "- command: echo hi\n- command: echo again\n",
            &[
                "--cwd",
                "/nonexistent/agent-e2e",
                "-c",
                "environment.create_cwd=false",
            ],
        )
        .await;
    assert_ended(&run, 6, "EnvironmentError");
    assert!(
        run.with_role("tool").is_empty(),
        "the model saw the environment error"
    );
    assert_eq!(run.traj["info"]["model_stats"]["api_calls"], 1);
    let exit = run.messages().last().unwrap();
    assert!(
        exit["content"]
            .as_str()
            .unwrap()
            .contains("environment_error"),
        "{exit}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_exec_prints_output_and_exits_with_the_return_code() {
    let daemon = Daemon::start();
    let token = daemon.state.path().join("token");
    let remote = [
        "--executor",
        &daemon.url,
        "--token-file",
        token.to_str().unwrap(),
    ];
    let (code, out, _) =
        agent_exec(&[&remote[..], &["--", "echo out; echo err >&2; exit 3"]].concat()).await;
    assert_eq!(code, 3);
    assert_eq!(out, "out\nerr\n");
    let (code, out, err) =
        agent_exec(&[&remote[..], &["--timeout", "1", "--", "echo x; sleep 30"]].concat()).await;
    assert_eq!((code, out.as_str()), (124, "x\n"));
    assert!(err.contains("timed out"), "{err}");
    let (code, out, _) =
        agent_exec(&[&remote[..], &["--env", "A=b c", "--", "echo", "\"$A\""]].concat()).await;
    assert_eq!((code, out.as_str()), (0, "b c\n"));
    // Its own failures are 255, as with ssh.
    let (code, _, err) = agent_exec(&["--executor", "ws://127.0.0.1:9/v1/ws", "--", "true"]).await;
    assert_eq!(code, 255);
    assert!(err.contains("cannot connect"), "{err}");
    let (code, _, err) =
        agent_exec(&[&remote[..], &["--cwd", "/nonexistent/x", "--", "true"]].concat()).await;
    assert_eq!(code, 255);
    assert!(err.contains("environment_error"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_exec_starts_and_stops_a_local_executor_without_a_url() {
    // In a directory the sandbox's identity may write (a root-owned one is refused:
    // `choices::`).
    let s = Scratch::new();
    let (code, out, err) = agent_exec_in(Some(s.path()), &["--", "echo local"]).await;
    assert_eq!((code, out.as_str()), (0, "local\n"), "{err}");
    assert!(err.contains("started a local executor"), "{err}");
    assert!(err.contains("executor: profile \"strict\""), "{err}");
}

/// Kills the child when the test ends, however it ends.
struct Reaper(std::process::Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_executor_is_reconnected_and_the_cut_command_is_reported_to_the_model() {
    let mut daemon = Daemon::start();
    let s = Scratch::new();
    let marker = marker();
    let child = s
        .kill_executor_mid_command(
            &mut daemon,
            &format!(
                "- command: {}\n- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo after\n",
                marked_sleep(&marker)
            ),
            &marker,
            &["-c", "environment.reconnect_attempts=10"],
        )
        .await;
    // Same address, same state directory (so the same token).
    let mut again = std::process::Command::new(binary("executor"));
    again
        .arg("serve")
        .args(["--listen", &daemon.addr.to_string(), "--state-dir"])
        .arg(daemon.state.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut restarted = Reaper(again.spawn().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(restarted.0.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert!(line.starts_with("executor listening on"), "{line:?}");
    let run = s.finish(child).await;
    assert_ended(&run, 0, "Submitted");
    assert_eq!(run.traj["info"]["submission"], "after\n");
    let cut = run.with_role("tool")[0]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(cut.contains("\"returncode\": -1"), "{cut}");
    assert!(cut.contains("connection to the executor was lost"), "{cut}");
    assert!(run.stderr.contains("reconnected"), "{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_exec_with_a_local_executor_can_write_the_current_directory() {
    let s = Scratch::new();
    let (code, out, stderr) =
        agent_exec_in(Some(s.path()), &["--", "echo written > f.txt && cat f.txt"]).await;
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(out, "written\n");
    assert_eq!(
        std::fs::read_to_string(s.path().join("f.txt")).unwrap(),
        "written\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_on_agent_exec_cancels_the_command_and_exits_130() {
    let daemon = Daemon::start();
    let token = daemon.state.path().join("token");
    let marker = marker();
    let child = tokio::process::Command::new(binary("agent"))
        .args(["exec", "--executor", &daemon.url, "--token-file"])
        .arg(&token)
        .args(["--", &marked_sleep(&marker)])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // The agent's own command line holds the marker too: wait for the sleep itself.
    let sleeping = || {
        processes_matching(&marker).into_iter().any(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.starts_with(b"sleep\0"))
        })
    };
    assert!(eventually(PATIENCE, sleeping).await);
    signal(&child, nix::sys::signal::Signal::SIGINT);
    let out = tokio::time::timeout(PATIENCE, child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(out.status.code(), Some(130));
    assert!(
        eventually(PATIENCE, || !sleeping()).await,
        "the command survived"
    );
}
