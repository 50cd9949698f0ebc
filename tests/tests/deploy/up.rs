//! `agent deploy up --json`, the contract other clients (the Python package) build on: one
//! JSON line saying how to reach the executor, the deployment up until stdin closes (or
//! SIGTERM), then nothing left; on failure a JSON error line and a non-zero exit.

use std::process::Stdio;
use std::time::Duration;

use executor_tests::{binary, container, Client};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::batch_docker::{containers, podman_flags};

struct Up {
    child: tokio::process::Child,
    line: Value,
    /// The rest of stdout, read until it closes: a second line there breaks the contract.
    rest: tokio::task::JoinHandle<Vec<String>>,
}

async fn up(args: &[&str]) -> Up {
    let mut command = tokio::process::Command::new(binary("agent"));
    command.args(["deploy", "up", "--json"]).args(args);
    up_with(command).await
}

async fn up_with(mut command: tokio::process::Command) -> Up {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let first = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
        .await
        .expect("no line from deploy up")
        .unwrap()
        .expect("deploy up closed stdout");
    // Drained so the child never blocks on it; checked to be empty when it exits (a panic
    // here, in a task nobody awaits, would have been lost).
    let rest = tokio::spawn(async move {
        let mut rest = Vec::new();
        while let Ok(Some(extra)) = lines.next_line().await {
            rest.push(extra);
        }
        rest
    });
    Up {
        child,
        line: serde_json::from_str(&first).unwrap_or_else(|e| panic!("{first:?}: {e}")),
        rest,
    }
}

impl Up {
    /// Connect like a client of the contract: the URL, the token from the file, the pin.
    async fn client(&self) -> Client {
        let url = self.line["url"].as_str().unwrap();
        let token = std::fs::read_to_string(self.line["token_file"].as_str().unwrap()).unwrap();
        match self.line["tls_fingerprint"].as_str() {
            Some(pin) => Client::connect_pinned(url, Some(token.trim()), pin)
                .await
                .unwrap(),
            None => Client::connect(url, Some(token.trim())).await.unwrap(),
        }
    }

    /// Close stdin and wait for the exit code; nothing may have followed the JSON line.
    async fn close(mut self) -> i32 {
        drop(self.child.stdin.take());
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("deploy up did not exit after stdin closed")
            .unwrap();
        self.no_second_line().await;
        status.code().unwrap_or(-1)
    }

    /// After the exit: stdout held the JSON line alone.
    async fn no_second_line(self) {
        let rest = tokio::time::timeout(Duration::from_secs(10), self.rest)
            .await
            .expect("deploy up's stdout stayed open after it exited")
            .unwrap();
        assert!(rest.is_empty(), "deploy up wrote more lines: {rest:?}");
    }
}

#[tokio::test]
async fn a_local_deployment_is_reachable_from_its_json_line_and_gone_after_stdin_closes() {
    let up = up(&["--deploy", "local"]).await;
    let line = up.line.clone();
    let keys: Vec<&str> = line
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        [
            "deployment",
            "id",
            "owned",
            "tls_fingerprint",
            "token_file",
            "url"
        ]
    );
    assert_eq!(line["owned"], true);
    assert_eq!(line["deployment"], "local");
    assert!(line["url"].as_str().unwrap().starts_with("ws://127.0.0.1:"));
    assert!(line["tls_fingerprint"].is_null());
    let mut client = up.client().await;
    let result = client.run("c1", "echo hi").await;
    assert_eq!(result.output, "hi\n");
    drop(client);
    let pid: i32 = line["id"].as_str().unwrap().parse().unwrap();
    let token_file = std::path::PathBuf::from(line["token_file"].as_str().unwrap());
    assert_eq!(up.close().await, 0);
    assert!(
        executor_tests::process_state(pid).is_none(),
        "the executor outlived deploy up"
    );
    assert!(!token_file.exists(), "the token file outlived deploy up");
}

#[tokio::test]
async fn sigterm_tears_a_deployment_down_too() {
    let up = up(&["--deploy", "local"]).await;
    let pid: i32 = up.line["id"].as_str().unwrap().parse().unwrap();
    let agent = nix::unistd::Pid::from_raw(up.child.id().unwrap() as i32);
    nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGTERM).unwrap();
    let mut up = up;
    let status = tokio::time::timeout(Duration::from_secs(30), up.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    up.no_second_line().await;
    assert!(executor_tests::process_state(pid).is_none());
}

#[tokio::test]
async fn a_docker_deployment_is_pinned_tls_on_loopback_and_removed_after_stdin_closes() {
    if !container::available() {
        return;
    }
    let image = container::task_image().unwrap();
    let tag = executor_tests::marker();
    let flags = podman_flags(&tag);
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["--image", &image]);
    let up = up(&args).await;
    let line = up.line.clone();
    assert_eq!(line["deployment"], "docker");
    assert!(
        line["url"]
            .as_str()
            .unwrap()
            .starts_with("wss://127.0.0.1:"),
        "{line}"
    );
    assert!(line["tls_fingerprint"]
        .as_str()
        .unwrap()
        .starts_with("sha256:"));
    assert_eq!(containers(&tag).len(), 1);
    let mut client = up.client().await;
    assert_eq!(client.run("c1", "echo hi").await.output, "hi\n");
    drop(client);
    assert_eq!(up.close().await, 0);
    assert!(containers(&tag).is_empty(), "{:?}", containers(&tag));
}

#[tokio::test]
async fn a_deployment_that_cannot_start_says_so_in_json_and_exits_non_zero() {
    let out = tokio::process::Command::new(binary("agent"))
        .args([
            "deploy", "up", "--json", "--deploy", "docker", "--image", "x",
        ])
        .args(["--docker-executable", "/nonexistent/docker"])
        .args(["--executor-static", "/bin/true"])
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    let line: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(
        line["error"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/docker"),
        "{line}"
    );
    assert!(!String::from_utf8_lossy(&out.stderr).is_empty());
}

/// The harness itself: a second line on stdout fails the test that closes the deployment
/// (it was checked in a task nobody awaited, whose panic was lost), and one line passes.
#[tokio::test]
async fn the_harness_fails_a_deployment_that_writes_a_second_line() {
    let fake = |script: &str| {
        let mut command = tokio::process::Command::new("sh");
        command.args(["-c", script]);
        command
    };
    let chatty = up_with(fake(r#"echo '{"url": "x"}'; echo extra; cat >/dev/null"#)).await;
    let closed = tokio::spawn(chatty.close()).await;
    assert!(closed.as_ref().is_err_and(|e| e.is_panic()), "{closed:?}");
    // Control: one line and nothing else passes.
    let quiet = up_with(fake(r#"echo '{"url": "x"}'; cat >/dev/null"#)).await;
    assert_eq!(quiet.close().await, 0);
}

/// The `executor-agent.run` label of a container.
fn run_label(id: &str) -> String {
    let out = container::podman()
        .args([
            "inspect",
            "--format",
            "{{index .Config.Labels \"executor-agent.run\"}}",
            id,
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Two agents' run ids differ and are not their pids: with `up<pid>`, two agents in
/// different pid namespaces (CI jobs in containers sharing one docker daemon) had the same
/// run id, and a reap by run label removed the other's containers.
#[tokio::test]
async fn two_agents_get_random_run_ids_not_their_pids() {
    if !container::available() {
        return;
    }
    let image = container::task_image().unwrap();
    let tag = executor_tests::marker();
    let flags = podman_flags(&tag);
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["--image", &image]);
    let first = up(&args).await;
    let second = up(&args).await;
    let pids = [first.child.id().unwrap(), second.child.id().unwrap()];
    let ids = containers(&tag);
    assert_eq!(ids.len(), 2, "{ids:?}");
    let labels: Vec<String> = ids.iter().map(|id| run_label(id)).collect();
    // Control: each carries a run label, as the reap needs.
    assert!(
        labels
            .iter()
            .all(|l| l.len() == "up".len() + 12 && l.starts_with("up")),
        "{labels:?}"
    );
    assert_ne!(labels[0], labels[1], "{labels:?}");
    for pid in pids {
        assert!(!labels.contains(&format!("up{pid}")), "{labels:?} {pids:?}");
    }
    assert_eq!(first.close().await, 0);
    assert_eq!(second.close().await, 0);
    assert!(containers(&tag).is_empty(), "{:?}", containers(&tag));
}

/// An image name is the last argument before the executor's: one starting with `-` would be
/// another `docker run` option (here a bind mount of the host's root). Refused before docker
/// runs; the control, a plain name, gets as far as running docker.
#[tokio::test]
async fn an_image_name_that_is_an_option_is_refused() {
    let attempt = |image: &'static str| async move {
        let out = tokio::process::Command::new(binary("agent"))
            .args(["deploy", "up", "--json", "--deploy", "docker"])
            .arg(format!("--image={image}"))
            .args(["--docker-executable", "/nonexistent/docker"])
            .args(["--executor-static", "/bin/true"])
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        assert_ne!(out.status.code(), Some(0));
        let line: Value =
            serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
        line["error"].as_str().unwrap().to_string()
    };
    let refused = attempt("-v/:/host").await;
    assert!(refused.contains("is not an image name"), "{refused}");
    assert!(!refused.contains("/nonexistent/docker"), "{refused}");
    let control = attempt("example.org/task:1").await;
    assert!(control.contains("/nonexistent/docker"), "{control}");
}
