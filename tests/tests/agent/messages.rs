//! What a newcomer reads when something is off: each message says what happened and what to
//! do, once. Checked on the text itself, beside a control that works.

use executor_tests::{is_root, require, Daemon};

use crate::{agent_against, finish_one_shot, one_shot, Finished, Scratch};

/// `agent exec --executor URL [--token-file PATH] -- CMD`, bounded.
async fn exec_at(url: &str, token_file: Option<&std::path::Path>, command: &str) -> Finished {
    let mut c = one_shot();
    c.args(["exec", "--executor", url]);
    if let Some(path) = token_file {
        c.arg("--token-file").arg(path);
    }
    let child = c
        .args(["--", command])
        .env_remove("EXECUTOR_TOKEN")
        .spawn()
        .unwrap();
    finish_one_shot(child, &format!("agent exec at {url}")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_and_a_missing_one_are_told_apart() {
    if !require("root", is_root()) {
        return;
    }
    let daemon = Daemon::start();
    let s = Scratch::new();
    let wrong = s.write("token", "not-the-token\n");
    let refused = exec_at(&daemon.url, Some(&wrong), "true").await;
    assert_eq!(refused.code, 255);
    assert!(
        refused
            .stderr
            .contains("the executor refused the token we sent (HTTP 401 Unauthorized)"),
        "{}",
        refused.stderr
    );
    let missing = exec_at(&daemon.url, None, "true").await;
    assert_eq!(missing.code, 255);
    assert!(
        missing
            .stderr
            .contains("the executor requires a token and none was given (HTTP 401 Unauthorized)"),
        "{}",
        missing.stderr
    );
    assert!(
        missing.stderr.contains("--token-file PATH"),
        "{}",
        missing.stderr
    );
    // Control: the right token runs, and the profile is the executor's default, said so.
    let right = s.write("right", &daemon.token);
    let ran = exec_at(&daemon.url, Some(&right), "echo ok").await;
    assert_eq!(ran.code, 0, "{}", ran.stderr);
    assert_eq!(String::from_utf8_lossy(&ran.stdout), "ok\n");
    assert!(
        ran.stderr
            .contains("executor: profile \"strict\" (the executor's default); layers: "),
        "{}",
        ran.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_executor_for_one_command_is_said_so_without_pools_or_quarantines() {
    // A port nobody listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("ws://127.0.0.1:{port}/v1/ws");
    let out = exec_at(&url, None, "true").await;
    assert_eq!(out.code, 255);
    assert!(
        out.stderr.contains(&format!(
            "cannot reach the executor at {url}: cannot connect to 127.0.0.1:{port}"
        )),
        "{}",
        out.stderr
    );
    for jargon in ["pool", "quarantin"] {
        assert!(!out.stderr.contains(jargon), "{jargon}: {}", out.stderr);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configs_are_found_by_name_as_mini_finds_them_and_a_missing_one_names_where_it_looked() {
    if !require("root", is_root()) {
        return;
    }
    let s = Scratch::new();
    let submit = "- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n";
    // mini's swebench.yaml by name (its cwd, /testbed, is a task image's: here, ours).
    let cwd = format!("environment.cwd={}", s.path().display());
    let run = s
        .run_scripted(submit, &["-c", "swebench.yaml", "-c", &cwd])
        .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.exit_status(), "Submitted");
    let config = &run.traj["info"]["config"];
    // swebench.yaml's own values, not the defaults (0 and 30).
    assert_eq!(config["agent"]["step_limit"], 250, "{config}");
    assert!(
        run.messages()[0]["content"]
            .as_str()
            .unwrap()
            .contains("interact with a computer shell to solve programming tasks"),
        "{}",
        run.messages()[0]
    );
    // A name that is nowhere: every place looked, once, and the names that exist.
    let missing = s.run_scripted(submit, &["-c", "nosuch"]).await;
    assert_eq!(missing.code, 2);
    assert!(
        missing.stderr.contains(
            "no config file \"nosuch\": looked for nosuch, nosuch.yaml, and among \
             mini-swe-agent's built-in configs bundled with the agent (mini.yaml, \
             default.yaml, swebench.yaml, from mini-swe-agent 2.4.6)"
        ),
        "{}",
        missing.stderr
    );
    // A file that cannot be read says its cause once.
    let unreadable = s.path().join("binary.yaml");
    std::fs::write(&unreadable, [0xff, 0xfe, 0x00]).unwrap();
    let bad = s
        .run_scripted(submit, &["-c", unreadable.to_str().unwrap()])
        .await;
    assert_eq!(bad.code, 2);
    let line = bad.stderr.lines().last().unwrap_or_default();
    assert!(line.contains("cannot read config file"), "{}", bad.stderr);
    assert_eq!(line.matches("valid UTF-8").count(), 1, "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_without_the_scripted_model_says_to_add_it() {
    let s = Scratch::new();
    let script = s.write("s.yaml", "- command: true\n").display().to_string();
    let run = s.run(&["--script", &script, "--task", "t"]).await;
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("add `-m scripted` to `agent run`"),
        "{}",
        run.stderr
    );
    let batch = tokio::process::Command::new(executor_tests::binary("agent"))
        .args(["batch", "--subset"])
        .arg(s.write(
            "i.jsonl",
            "{\"instance_id\": \"a\", \"problem_statement\": \"p\"}\n",
        ))
        .args(["--script", &script, "-o"])
        .arg(s.path().join("out"))
        .env_remove("MSWEA_MODEL_NAME")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&batch.stderr);
    assert_eq!(batch.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("add `-m scripted` to `agent batch`"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_working_directory_outside_stricts_root_says_so_and_what_to_use_instead() {
    if !require("root", is_root()) {
        return;
    }
    let daemon = Daemon::start();
    let outside = executor_tests::TempDir::with_prefix_in("testbed-", "/var/tmp").unwrap();
    let place = outside.path().display().to_string();
    let refused = agent_against(&daemon, "exec", &["--cwd", &place, "--", "pwd"], b"").await;
    assert_eq!(refused.code, 255);
    assert!(
        refused.stderr.contains(&format!(
            "cannot work in {place} under profile strict: the sandbox's root has no {place}"
        )),
        "{}",
        refused.stderr
    );
    assert!(
        refused.stderr.contains(&format!(
            "the workspace {} (writable)",
            daemon.workspace.display()
        )),
        "{}",
        refused.stderr
    );
    assert!(!refused.stderr.contains("ENOENT"), "{}", refused.stderr);
    // Control: the workspace itself.
    let ws = daemon.workspace.display().to_string();
    let ok = agent_against(&daemon, "exec", &["--cwd", &ws, "--", "pwd"], b"").await;
    assert_eq!(ok.code, 0, "{}", ok.stderr);
    assert_eq!(String::from_utf8_lossy(&ok.stdout), format!("{ws}\n"));
}

#[tokio::test]
async fn the_daemons_log_has_no_colour_codes_when_stderr_is_a_file() {
    if !require("root", is_root()) {
        return;
    }
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let _ = client.run("a", "true").await;
    let log = daemon.log();
    // Control: it logged (at the harness's RUST_LOG=debug), levels and all.
    assert!(log.contains("INFO"), "{log}");
    assert!(!log.contains('\x1b'), "escape sequences in a file: {log:?}");
}
