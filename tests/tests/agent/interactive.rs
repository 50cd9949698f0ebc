//! `confirm` and `human` modes, driven through a pseudo-terminal as a person would; and the
//! boundary between the agent's secrets and the executor it starts.

use std::io::Write;
use std::process::Stdio;

use executor_tests::{eventually, marked_sleep, marker, processes_matching, PATIENCE};

use crate::{assert_ended, signal, started, Scratch};

/// Spawn `agent run` with a terminal on stdin and `typed` already waiting in it.
async fn run_on_terminal(s: &Scratch, args: &[&str], typed: &str) -> crate::Run {
    let pty = nix::pty::openpty(None, None).unwrap();
    let mut cmd = s.agent(args);
    cmd.stdin(Stdio::from(pty.slave));
    let child = cmd.spawn().unwrap();
    let mut keyboard = std::fs::File::from(pty.master);
    keyboard.write_all(typed.as_bytes()).unwrap();
    let run = s.finish(child).await;
    drop(keyboard);
    run
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirm_mode_rejects_edits_and_approves_commands() {
    let s = Scratch::new();
    let script = s
        .write(
            "s.yaml",
            "- command: echo nope > rejected.txt\n- command: echo original > e.txt\n- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat e.txt\n",
        )
        .display()
        .to_string();
    // Reject with a reason; edit the second command; approve the third with Enter.
    let typed = "not that one\n/e\necho edited > e.txt\n\n";
    let run = run_on_terminal(
        &s,
        &[
            "--model", "scripted", "--script", &script, "--task", "t", "--mode", "confirm",
        ],
        typed,
    )
    .await;
    assert_ended(&run, 0, "Submitted");
    assert_eq!(run.traj["info"]["submission"], "edited\n");
    assert!(
        !s.path().join("rejected.txt").exists(),
        "a rejected command ran"
    );
    let tools = run.with_role("tool");
    let rejection = tools[0]["content"].as_str().unwrap();
    assert!(rejection.contains("rejected your command"), "{rejection}");
    assert!(rejection.contains("not that one"), "{rejection}");
    assert_eq!(tools[0]["tool_call_id"], "call_1_0");
    assert_eq!(tools[1]["extra"]["edited_from"], "echo original > e.txt");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn human_mode_runs_typed_commands_then_switches_to_the_model() {
    let s = Scratch::new();
    let script = s
        .write(
            "s.yaml",
            "- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat h.txt\n",
        )
        .display()
        .to_string();
    let run = run_on_terminal(
        &s,
        &[
            "--model", "scripted", "--script", &script, "--task", "t", "--mode", "human",
        ],
        "echo typed > h.txt\n/y\n",
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.traj["info"]["submission"], "typed\n");
    assert_eq!(run.traj["info"]["model_stats"]["api_calls"], 1);
    let users = run.with_role("user");
    assert!(users[1]["content"]
        .as_str()
        .unwrap()
        .contains("echo typed > h.txt"));
    assert_eq!(users[1]["extra"]["source"], "human");
    assert!(users[2]["content"]
        .as_str()
        .unwrap()
        .contains("\"returncode\": 0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirm_mode_without_a_terminal_is_refused() {
    let s = Scratch::new();
    let run = s
        .run_scripted("- command: echo hi\n", &["--mode", "confirm"])
        .await;
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("needs a terminal"), "{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_executor_never_inherits_the_api_key() {
    const SECRET: &str = "sk-agent-e2e-secret-4711";
    let s = Scratch::new();
    let marker = marker();
    let mut cmd = s.scripted(&format!("- command: {}\n", marked_sleep(&marker)), &[]);
    cmd.env("OPENAI_API_KEY", SECRET).env("SOME_TOKEN", SECRET);
    let child = cmd.spawn().unwrap();
    let agent_pid = child.id().unwrap() as i32;
    assert!(started(&marker).await);
    let daemons: Vec<i32> = processes_matching("agent-executor-")
        .into_iter()
        .filter(|pid| {
            let ppid = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|st| {
                    st.rsplit(')')
                        .next()?
                        .split_whitespace()
                        .nth(1)?
                        .parse::<i32>()
                        .ok()
                });
            ppid == Some(agent_pid)
        })
        .collect();
    assert_eq!(daemons.len(), 1, "the agent's own executor is found");
    let environ = std::fs::read(format!("/proc/{}/environ", daemons[0])).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    assert!(
        environ.contains("PATH="),
        "control: the environment is readable"
    );
    assert!(
        !environ.contains(SECRET),
        "the executor inherited the API key"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent_pid),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let run = s.finish(child).await;
    assert_eq!(run.code, 130);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_in_yolo_mode_kills_the_command_and_switches_to_confirm() {
    let s = Scratch::new();
    let marker = marker();
    let pty = nix::pty::openpty(None, None).unwrap();
    let mut cmd = s.scripted(
        &format!(
            "- command: {}\n- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo approved\n",
            marked_sleep(&marker)
        ),
        &["--mode", "yolo"],
    );
    cmd.stdin(Stdio::from(pty.slave));
    let child = cmd.spawn().unwrap();
    let mut keyboard = std::fs::File::from(pty.master);
    assert!(started(&marker).await);
    signal(&child, nix::sys::signal::Signal::SIGINT);
    // Switch to confirm at the interrupt menu, then approve the next command with Enter.
    keyboard.write_all(b"/c\n\n").unwrap();
    let run = s.finish(child).await;
    drop(keyboard);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.traj["info"]["submission"], "approved\n");
    assert!(run.stderr.contains("--- interrupted ---"));
    assert!(
        run.stderr.contains("command proposed by the model"),
        "confirm mode asked"
    );
    let cut = run.with_role("tool")[0]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(cut.contains("interrupted this command"), "{cut}");
    assert!(
        eventually(PATIENCE, || processes_matching(&marker).is_empty()).await,
        "the interrupted command was not killed"
    );
}
