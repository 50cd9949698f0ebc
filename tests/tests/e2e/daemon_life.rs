//! The daemon's own life: SIGKILL takes every command with it, SIGTERM drains, many clients at
//! once, audit records.

use std::time::Duration;

use executor_tests::host_waits::{assert_none_left, send_signal, sleepers_gone, sleepers_up};
use executor_tests::{
    descendants, eventually, marked_sleep, marker, parent_of, processes_matching, req, sleepers,
    Daemon, PATIENCE,
};
use nix::sys::signal::Signal;
use protocol::{ClientMessage, Ending, ServerMessage, RETURNCODE_NOT_FINISHED};

#[tokio::test]
async fn daemon_sigkill_mid_command_kills_every_command_tree() {
    let mut daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    for i in 0..3 {
        let mut r = req(
            &format!("k{i}"),
            &format!("setsid {s} & ( {s} & ) ; {s}", s = marked_sleep(&m)),
        );
        r.timeout = Some(600.0);
        client.send(&ClientMessage::Exec(r)).await;
    }
    // Control: all nine sleeps run while the daemon lives, below it: its fork server, three
    // helpers, their inits, shells and sleeps.
    assert!(sleepers_up(&m, 9).await);
    let below = descendants(daemon.pid() as i32);
    // Nine sleeps, three helpers and at least the fork server.
    assert!(below.len() > 9 + 3, "descendants: {below:?}");
    daemon.signal_and_wait(Signal::SIGKILL);
    assert_none_left(&m, "survivors after daemon SIGKILL").await;
    // Nothing that was below the daemon is left: not the fork server, not a helper, not an
    // init (recorded before the kill, while they were still its descendants).
    assert!(
        eventually(executor_tests::PATIENCE, || below.iter().all(|pid| {
            executor_tests::process_state(*pid).is_none_or(|s| s == 'Z')
        }))
        .await,
        "survivors: {:?}",
        below
            .iter()
            .filter(|pid| executor_tests::process_state(**pid).is_some_and(|s| s != 'Z'))
            .collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn sigterm_drains_kills_running_commands_sends_their_results_and_exits() {
    let mut daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = marker();
    let mut r = req("long", &format!("echo begun; {}", marked_sleep(&m)));
    r.timeout = Some(600.0);
    r.stream = true;
    client.send(&ClientMessage::Exec(r)).await;
    // Wait until the command printed, so it is surely running.
    match client.recv().await {
        Some(ServerMessage::Output(chunk)) => assert_eq!(chunk.data, "begun\n"),
        other => panic!("expected output, got {other:?}"),
    }
    send_signal(daemon.pid() as i32, Signal::SIGTERM);
    let result = client.collect("long").await.result.unwrap();
    assert_eq!(result.extra.ended, Ending::Shutdown);
    assert_eq!(result.returncode, RETURNCODE_NOT_FINISHED);
    assert_eq!(result.output, "begun\n");
    assert!(result.exception_info.contains("shutting down"));
    // Then the connection closes and the daemon exits cleanly.
    assert!(client.recv().await.is_none());
    let status = daemon.signal_and_wait(Signal::SIGCONT);
    assert!(status.success(), "{status:?}");
    assert!(processes_matching(&m).is_empty());
    // A new connection is refused once draining is over.
    assert!(
        executor_tests::Client::connect(&daemon.url, Some(&daemon.token))
            .await
            .is_err()
    );
}

#[tokio::test]
async fn thirty_two_concurrent_clients_each_get_their_own_results() {
    let daemon = Daemon::start();
    let mut handles = Vec::new();
    for n in 0..32 {
        let url = daemon.url.clone();
        let token = daemon.token.clone();
        handles.push(tokio::spawn(async move {
            let mut client = executor_tests::Client::connect(&url, Some(&token))
                .await
                .unwrap();
            for i in 0..5 {
                let result = client
                    .run(
                        &format!("c{i}"),
                        &format!("echo client {n} cmd {i}; exit {}", (n + i) % 7),
                    )
                    .await;
                assert_eq!(result.output, format!("client {n} cmd {i}\n"));
                assert_eq!(result.returncode, (n + i) % 7);
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    assert!(daemon.healthy().await);
    // The audit log is written by a thread of its own, just after each result.
    assert!(
        eventually(executor_tests::PATIENCE, || daemon.audit().len() == 32 * 5).await,
        "{} audit records",
        daemon.audit().len()
    );
}

#[tokio::test]
async fn audit_log_has_one_line_per_command_without_the_token() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    client.run("a1", "echo audited; exit 3").await;
    let mut r = req("a2", "sleep 5");
    r.timeout = Some(0.2);
    client.exec(r).await.result.unwrap();
    let mut r = req("a3", "true");
    r.cwd = Some("/does/not/exist".into());
    client.exec(r).await.result.unwrap_err();
    assert!(eventually(executor_tests::PATIENCE, || daemon.audit().len() == 3).await);
    let records = daemon.audit();
    let by_id = |id: &str| records.iter().find(|r| r["id"] == id).unwrap().clone();
    let a1 = by_id("a1");
    assert_eq!(a1["command"], "echo audited; exit 3");
    assert_eq!(a1["returncode"], 3);
    assert_eq!(a1["ended"], "exited");
    assert_eq!(a1["output_bytes"], 8);
    assert_eq!(a1["profile"], "strict");
    assert_eq!(a1["cwd"], daemon.workspace.display().to_string());
    assert_eq!(a1["client"], "default");
    assert!(a1["peer"].as_str().unwrap().starts_with("127.0.0.1:"));
    assert_eq!(a1["session"], client.hello.session.as_str());
    assert_eq!(client.hello.session.len(), 32, "{}", client.hello.session);
    assert_eq!(by_id("a2")["ended"], "timed_out");
    let a3 = by_id("a3");
    assert_eq!(a3["ended"], "error");
    assert!(a3["error"].as_str().unwrap().contains("environment_error"));
    let text = std::fs::read_to_string(daemon.state.path().join("audit.jsonl")).unwrap();
    assert!(!text.contains(daemon.token.as_str()));
}

#[tokio::test]
async fn a_local_executor_dies_with_the_agent_that_started_it_even_by_sigkill() {
    let m = marker();
    // A directory the sandbox's uid may write: the agent runs nothing in one it cannot
    // (agent `choices::`).
    let here = executor_tests::TempDir::new().unwrap();
    std::fs::set_permissions(
        here.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let mut agent = std::process::Command::new(executor_tests::binary("agent"))
        .args(["exec", "--timeout", "600", "--"])
        .arg(marked_sleep(&m))
        .current_dir(here.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Control: while the agent lives, its executor and the command run.
    assert!(sleepers_up(&m, 1).await);
    let executors: Vec<i32> = processes_matching("--exit-on-stdin-eof")
        .into_iter()
        .filter(|pid| parent_of(*pid) == Some(agent.id() as i32))
        .collect();
    assert_eq!(executors.len(), 1, "the agent's local executor");
    agent.kill().unwrap();
    agent.wait().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || processes_matching(&m)
            .is_empty()
            && executor_tests::process_state(executors[0])
                .is_none_or(|s| s == 'Z'))
        .await,
        "executor or command survived the agent: {:?}",
        processes_matching(&m)
    );
}

#[tokio::test]
async fn all_commands_together_stay_under_the_daemons_total_process_limit() {
    // Per-command limits alone would let 64 commands ask for 64 times as much; the daemon's
    // parent cgroup bounds them together. Checked on the host: the cgroup file, and the
    // processes that really exist.
    let tree = |m: &str| {
        format!(
            "for i in $(seq 80); do {} & done 2>/dev/null; sleep 2; echo done",
            marked_sleep(m)
        )
    };
    let bounded = Daemon::start_with(&["--max-total-processes", "40"]);
    let prefix = format!("executor-{}-ns", bounded.pid());
    let parent = std::fs::read_dir("/sys/fs/cgroup/pids")
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .expect("the daemon's pids cgroup")
        .path();
    let pids_max = parent.join("pids.max");
    assert_eq!(std::fs::read_to_string(&pids_max).unwrap().trim(), "40");
    let mut client = bounded.connect().await;
    let m = marker();
    let mut r = req("many", &tree(&m));
    // bash keeps retrying the refused forks; the timeout ends it.
    r.timeout = Some(3.0);
    client.send(&ClientMessage::Exec(r)).await;
    let mut peak = 0;
    for _ in 0..50 {
        peak = peak.max(sleepers(&m).len());
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    client.collect("many").await.result.unwrap();
    assert!(
        peak > 0 && peak < 40,
        "peak {peak} processes under a total of 40"
    );
    // Control: the same command under a daemon with the default total runs all 80.
    let free = Daemon::start();
    let mut client = free.connect().await;
    let m = marker();
    let mut r = req("many", &tree(&m));
    r.timeout = Some(20.0);
    client.send(&ClientMessage::Exec(r)).await;
    assert!(sleepers_up(&m, 80).await);
    client.collect("many").await.result.unwrap();
}

#[tokio::test]
async fn commands_still_run_when_the_fork_server_dies() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let server: Vec<i32> = processes_matching("__fork-server")
        .into_iter()
        .filter(|pid| parent_of(*pid) == Some(daemon.pid() as i32))
        .collect();
    assert_eq!(server.len(), 1, "the daemon's fork server");
    // Control: commands run through it.
    assert_eq!(client.run("before", "echo one").await.output, "one\n");
    send_signal(server[0], Signal::SIGKILL);
    // The daemon falls back to exec'ing helpers: same results, same isolation.
    for i in 0..3 {
        let result = client.run(&format!("after{i}"), "echo two; exit 3").await;
        assert_eq!((result.output.as_str(), result.returncode), ("two\n", 3));
        assert!(result
            .extra
            .isolation
            .layers
            .contains(&"seccomp".to_string()));
    }
    // Said in the log once, in words a user can act on, not once per command.
    let log = daemon.log();
    assert_eq!(
        log.matches(
            "the fork server (the process that starts each command's sandbox) stopped working; \
             commands still run, with the same isolation"
        )
        .count(),
        1,
        "{log}"
    );
    // Nothing outlives an exec'd helper's command either: not what it left behind, not a
    // command timed out (with a pid namespace the exec'd helper stands in for the fork
    // server and relays the lifeline to init; without one it watches the command itself).
    for profile in ["strict", "landlock"] {
        let m = marker();
        let left = client
            .exec(executor_tests::checks::preq(
                Some(profile),
                &format!("left-{profile}"),
                &format!("{} & echo left", marked_sleep(&m)),
                30.0,
            ))
            .await
            .result
            .unwrap();
        assert_eq!(left.output, "left\n", "{profile}");
        assert!(left.extra.killed_processes >= 1, "{profile}: {left:?}");
        assert!(sleepers(&m).is_empty(), "{profile}: a leftover lives on");
        let started = std::time::Instant::now();
        let timed = client
            .exec(executor_tests::checks::preq(
                Some(profile),
                &format!("timed-{profile}"),
                &format!("echo begun; {}", marked_sleep(&m)),
                1.0,
            ))
            .await
            .result
            .unwrap();
        assert_eq!(timed.extra.ended, Ending::TimedOut, "{profile}: {timed:?}");
        assert_eq!(timed.output, "begun\n", "{profile}");
        assert!(
            started.elapsed() < Duration::from_secs(1) + executor_tests::PROMPTLY,
            "{profile}"
        );
        assert!(
            sleepers_gone(&m).await,
            "{profile}: the timed-out command lives on"
        );
    }
    assert!(daemon.healthy().await);
}

/// A stderr nobody reads (a wedged ssh session, a full pipe) never blocks the daemon: it
/// serves, and exits at its stdin's end of file. Control: its log goes to that stderr while
/// there is room.
#[tokio::test]
async fn a_stderr_nobody_reads_never_blocks_the_daemon() {
    use std::io::{BufRead, BufReader, Write};
    let (reader, writer) = nix::unistd::pipe().unwrap();
    let filler = writer.try_clone().unwrap();
    let scratch = executor_tests::TempDir::new().unwrap();
    let workspace = scratch.path().join("ws");
    std::fs::create_dir(&workspace).unwrap();
    let mut child = std::process::Command::new(executor_tests::binary("executor"))
        .args(["serve", "--listen", "127.0.0.1:0", "--exit-on-stdin-eof"])
        .arg("--state-dir")
        .arg(scratch.path().join("state"))
        .arg("--workspace")
        .arg(&workspace)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(writer)
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let url = line.trim().rsplit(' ').next().unwrap().to_string();
    let mut log = [0u8; 4096];
    let n = nix::unistd::read(&reader, &mut log).unwrap();
    assert!(
        String::from_utf8_lossy(&log[..n]).contains("INFO"),
        "control: the log goes to stderr: {:?}",
        String::from_utf8_lossy(&log[..n])
    );
    // Fill the pipe: a thread writes until its write blocks (for good: nobody reads).
    std::thread::spawn(move || {
        let mut filler = std::fs::File::from(filler);
        while filler.write_all(&[b'x'; 4096]).is_ok() {}
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let token = std::fs::read_to_string(scratch.path().join("state/token")).unwrap();
    let mut client = executor_tests::Client::connect(&url, Some(token.trim()))
        .await
        .unwrap();
    // Commands, each logged, while nobody reads the log.
    for i in 0..50 {
        let r = client.exec(req(&format!("c{i}"), "echo hi")).await;
        assert_eq!(r.result.unwrap().output, "hi\n");
    }
    drop(client);
    drop(child.stdin.take());
    let deadline = std::time::Instant::now() + PATIENCE;
    while child.try_wait().unwrap().is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "the daemon did not exit at its stdin's end of file"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The filler's write fails now, and its thread ends.
    drop(reader);
}
