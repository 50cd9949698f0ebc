//! The `ssh` deployment against a real sshd started by the test on a loopback port, with a
//! key the test makes: the static executor is copied over, runs inside the ssh session and is
//! reached through a tunnel; when the session ends, it and its files are gone.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use executor_tests::{binary, require};

use crate::{assert_fixed, processes_with, wait_for, Bench};

use executor_tests::sshd::{Sshd, SSHD};

fn start_sshd() -> Option<Sshd> {
    if !require("root", executor_tests::is_root())
        || !require(
            "openssh-server (apt-get install openssh-server)",
            Path::new(SSHD).exists(),
        )
    {
        return None;
    }
    Some(Sshd::start().unwrap())
}

/// Executors of this sshd's sessions still running.
/// `agent deploy up --json` with `flags`, and the one JSON line it prints.
async fn deploy_up(flags: &[String]) -> (tokio::process::Child, serde_json::Value) {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(binary("agent"))
        .args(["deploy", "up", "--json"])
        .args(flags)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    (child, serde_json::from_str(&line).unwrap())
}

/// A client of the deployment `line` describes, with the token it handed over.
async fn connect_to(line: &serde_json::Value) -> executor_tests::Client {
    let token = std::fs::read_to_string(line["token_file"].as_str().unwrap()).unwrap();
    executor_tests::Client::connect(line["url"].as_str().unwrap(), Some(token.trim()))
        .await
        .unwrap()
}

/// The executor's directory on the target, from the deployment's id (`host:dir`).
fn remote_dir_of(line: &serde_json::Value) -> String {
    let id = line["id"].as_str().unwrap();
    id.split_once(':').unwrap().1.to_string()
}

/// The tests here count the executors of every ssh deployment on this host: one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn remote_executors() -> Vec<String> {
    processes_with("/tmp/agent-executor.")
        .into_iter()
        .filter(|p| {
            // "STAT ARGS": the executor itself, not the ssh client or the shell around it.
            p.split_once(' ')
                .is_some_and(|(_, args)| args.trim_start().starts_with("/tmp/agent-executor."))
        })
        .collect()
}

#[tokio::test]
async fn a_batch_over_ssh_runs_each_instance_in_a_session_of_its_own_and_leaves_nothing() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(sshd) = start_sshd() else { return };
    let bench = Bench::new(2, &[], &[]);
    let flags = sshd.deploy_flags();
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["-w", "2"]);
    let run = bench.run(&args).await;
    assert_eq!(run.code, 0);
    for i in 0..2 {
        assert_eq!(bench.status_of(i), "Submitted", "{}", bench.log());
        assert_fixed(&bench.patch(i), i);
    }
    assert!(wait_for(Duration::from_secs(10), || remote_executors().is_empty()).await);
}

#[tokio::test]
async fn the_executor_dies_with_the_ssh_session_when_the_agent_is_killed() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(sshd) = start_sshd() else { return };
    let flags = sshd.deploy_flags();
    let (mut child, line) = deploy_up(&flags).await;
    assert_eq!(line["deployment"], "ssh");
    assert!(line["url"].as_str().unwrap().starts_with("ws://127.0.0.1:"));
    // Reachable through the tunnel with the token it handed over.
    let mut client = connect_to(&line).await;
    assert_eq!(client.run("c1", "echo hi").await.output, "hi\n");
    drop(client);
    assert_eq!(remote_executors().len(), 1, "{:?}", remote_executors());
    let remote_dir = remote_dir_of(&line);
    assert!(Path::new(&remote_dir).exists());
    // SIGKILL: no teardown of ours runs; the session's end must do it.
    child.start_kill().unwrap();
    let _ = child.wait().await;
    assert!(
        wait_for(Duration::from_secs(20), || remote_executors().is_empty()).await,
        "{:?}",
        remote_executors()
    );
    assert!(
        wait_for(executor_tests::PATIENCE, || !Path::new(&remote_dir)
            .exists())
        .await
    );
}

/// The deployment's ssh client processes (the master and its helpers) going through `port`.
fn ssh_clients(port: u16) -> Vec<String> {
    processes_with(&format!("-p {port} "))
        .into_iter()
        .filter(|p| p.contains("BatchMode=yes"))
        .collect()
}

/// A network drop that says nothing (no FIN, no RST: the proxy stops forwarding) ends the
/// session within a minute: our ssh probes the server (`ServerAliveInterval=10`,
/// `ServerAliveCountMax=3`) and exits, where TCP alone would retransmit for many minutes; the
/// target's sshd (ClientAliveInterval here) ends the session, and with it the executor.
#[tokio::test]
async fn a_silent_network_drop_ends_the_ssh_session_within_a_minute() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(sshd) = start_sshd() else { return };
    let proxy = executor_tests::Proxy::start(([127, 0, 0, 1], sshd.port).into()).await;
    let mut flags = sshd.deploy_flags();
    let at = flags.iter().position(|f| f == "--ssh-port").unwrap();
    flags[at + 1] = proxy.addr.port().to_string();
    let (mut child, line) = deploy_up(&flags).await;
    // Control: up and reachable through the proxy, its ssh client probing the server.
    let mut client = connect_to(&line).await;
    assert_eq!(client.run("c1", "echo hi").await.output, "hi\n");
    drop(client);
    let port = proxy.addr.port();
    let clients = ssh_clients(port);
    assert!(!clients.is_empty());
    assert!(
        clients.iter().all(|c| c.contains("ServerAliveInterval=10")),
        "{clients:?}"
    );
    assert_eq!(remote_executors().len(), 1, "{:?}", remote_executors());
    let remote_dir = remote_dir_of(&line);
    let _cleanup = KillLeftovers(remote_dir);
    // The drop.
    assert!(proxy.stall() >= 1);
    let began = std::time::Instant::now();
    assert!(
        wait_for(Duration::from_secs(70), || ssh_clients(port).is_empty()).await,
        "ssh outlived a silent drop: {:?}",
        ssh_clients(port)
    );
    assert!(
        began.elapsed() < Duration::from_secs(60),
        "{:?}",
        began.elapsed()
    );
    // The target's side is its sshd's to end (ClientAliveInterval here): the session ends,
    // the executor's stdin reaches end of file, and it exits (its log, a stderr nobody reads
    // any more, never holds it). The guard removes what is left, also when this fails.
    assert!(
        wait_for(Duration::from_secs(40), || remote_executors().is_empty()).await,
        "the executor outlived its ssh session: {:?}",
        remote_executors()
    );
    drop(child.stdin.take());
    let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
}

/// Kills the executors of a remote directory still running when dropped.
struct KillLeftovers(String);

impl Drop for KillLeftovers {
    fn drop(&mut self) {
        let Ok(out) = Command::new("ps").args(["-eo", "pid=,args="]).output() else {
            return;
        };
        let needle = format!("{}/executor serve", self.0);
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let (pid, args) = line.trim_start().split_once(' ').unwrap_or_default();
            if args.trim_start().starts_with(&needle) {
                eprintln!("killing a leftover on the target: {args}");
                if let Ok(pid) = pid.parse::<i32>() {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
    }
}
