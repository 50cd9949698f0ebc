//! Ordinary commands: output, exit codes, cwd, env, stdin, sessions.

use executor_tests::checks::cancel;
use executor_tests::host_waits::{one_sleeper, sleepers_gone};
use executor_tests::{req, Client, Daemon, ALLOW_ALL_PROFILES};
use protocol::{Ending, PROTOCOL_VERSION};

#[tokio::test]
async fn hello_describes_the_daemon() {
    let daemon = Daemon::start_with(&ALLOW_ALL_PROFILES);
    let client = daemon.connect().await;
    let hello = &client.hello;
    assert_eq!(hello.protocol, PROTOCOL_VERSION);
    assert!(hello.server.starts_with("executor "), "{}", hello.server);
    assert!(hello.host.cores >= 1);
    assert!(
        hello.host.kernel.starts_with("Linux"),
        "{}",
        hello.host.kernel
    );
    // On a root host with namespaces, the strongest profile is the default; trusted is only
    // reachable by name.
    assert_eq!(hello.default_profile, "strict");
    for name in ["strict", "landlock", "task-container", "trusted"] {
        let p = hello.profiles.iter().find(|p| p.name == name).unwrap();
        assert!(p.available, "{name}: {:?}", p.unavailable_reason);
        assert!(
            p.layers.contains(&"session".to_string()),
            "{name}: {:?}",
            p.layers
        );
    }
    assert_eq!(hello.interpreter, vec!["bash", "-c"]);
    assert_eq!(hello.workspace, daemon.workspace.display().to_string());
    assert!(hello.limits.max_command_bytes > 0);
    assert!(hello.not_offered.is_empty(), "{:?}", hello.not_offered);
}

#[tokio::test]
async fn by_default_only_the_filtered_profiles_are_offered_and_the_hello_says_why() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let offered: Vec<&str> = client
        .hello
        .profiles
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(offered, ["landlock", "strict"]);
    let not_offered: Vec<&str> = client
        .hello
        .not_offered
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(not_offered, ["task-container", "trusted"]);
    for p in &client.hello.not_offered {
        assert!(p.reason.contains("--allow-profile"), "{p:?}");
    }
    // Asking for one is refused, and nothing ran on the host.
    for profile in ["trusted", "task-container"] {
        let m = executor_tests::marker();
        let mut r = req(profile, &format!("touch /tmp/ran-{m}"));
        r.profile = Some(profile.into());
        let err = client.exec(r).await.result.unwrap_err();
        assert_eq!(err.code, protocol::ErrorCode::ProfileDenied, "{err:?}");
        assert!(!std::path::Path::new(&format!("/tmp/ran-{m}")).exists());
    }
    // Control: a filtered profile runs.
    let mut r = req("l", "id -u");
    r.profile = Some("landlock".into());
    assert_eq!(client.exec(r).await.result.unwrap().output, "65534\n");
}

#[tokio::test]
async fn stdout_and_stderr_are_merged_in_order_with_the_exit_code() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let result = client
        .run("c1", "echo one; echo two >&2; echo three; exit 7")
        .await;
    assert_eq!(result.output, "one\ntwo\nthree\n");
    assert_eq!(result.returncode, 7);
    assert_eq!(result.exception_info, "");
    assert_eq!(result.extra.ended, Ending::Exited);
    assert!(!result.extra.timed_out && !result.extra.cancelled);
    assert_eq!(result.extra.output_bytes, 14);
    assert!(!result.extra.truncated);
    assert_eq!(result.extra.isolation.profile, "strict");
    for layer in [
        "session",
        "pid_ns",
        "net_ns",
        "pivot_root",
        "landlock",
        "seccomp",
    ] {
        assert!(
            result.extra.isolation.layers.contains(&layer.to_string()),
            "{layer}"
        );
    }
    assert!(result.extra.duration_ms > 0.0);

    let ok = client.run("c2", "true").await;
    assert_eq!((ok.returncode, ok.output.as_str()), (0, ""));
}

#[tokio::test]
async fn a_shell_killed_by_a_signal_reports_it() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let result = client.run("sig", "kill -TERM $$").await;
    assert_eq!(result.returncode, -15);
    assert_eq!(result.extra.ended, Ending::Signaled);
    assert_eq!(result.extra.signal.as_deref(), Some("SIGTERM"));
}

#[tokio::test]
async fn workspace_is_the_default_cwd_and_persists_files_between_commands() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let pwd = client.run("pwd", "pwd").await;
    assert_eq!(pwd.output.trim(), daemon.workspace.display().to_string());
    client.run("w", "echo kept > note.txt").await;
    // Checked on the host, and from a later command.
    assert_eq!(
        std::fs::read_to_string(daemon.workspace.join("note.txt")).unwrap(),
        "kept\n"
    );
    assert_eq!(client.run("r", "cat note.txt").await.output, "kept\n");
}

#[tokio::test]
async fn request_cwd_is_used_and_a_missing_cwd_is_an_environment_error() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let mut r = req("cwd", "pwd");
    r.cwd = Some("/tmp".into());
    assert_eq!(client.exec(r).await.result.unwrap().output, "/tmp\n");

    let mut r = req("nocwd", "pwd");
    r.cwd = Some("/nonexistent/dir".into());
    let err = client.exec(r).await.result.unwrap_err();
    assert_eq!(err.code, protocol::ErrorCode::EnvironmentError);
    assert!(err.message.contains("/nonexistent/dir"), "{}", err.message);
}

#[tokio::test]
async fn environment_is_cleared_then_defaults_then_request_env() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let mut r = req("env", "env | sort");
    r.env.insert("MY_VAR".into(), "value with spaces".into());
    r.env.insert("PAGER".into(), "more".into());
    let out = client.exec(r).await.result.unwrap().output;
    assert!(out.contains("MY_VAR=value with spaces\n"), "{out}");
    assert!(out.contains("PAGER=more\n"), "request env wins: {out}");
    assert!(out.contains("GIT_PAGER=cat\n"), "{out}");
    assert!(out.contains("TQDM_DISABLE=1\n"), "{out}");
    assert!(out.contains("PIP_PROGRESS_BAR=off\n"), "{out}");
    // The daemon was started with RUST_LOG set; a command must not inherit it.
    assert!(!out.contains("RUST_LOG"), "{out}");
    assert!(
        !out.contains(&daemon.token),
        "token leaked into the environment"
    );
}

#[tokio::test]
async fn stdin_reading_commands_return_at_once() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let started = std::time::Instant::now();
    let result = client.run("stdin", "cat; read x; echo done:$?").await;
    assert_eq!(result.output, "done:1\n");
    assert!(started.elapsed() < executor_tests::PROMPTLY);
}

#[tokio::test]
async fn every_command_is_a_new_session_without_a_terminal() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    // Inside: no controlling terminal.
    let out = client.run("tty", "ps -o tty= -p $$").await.output;
    assert_eq!(out.trim(), "?", "no controlling terminal: {out}");

    // Outside: sessions are read from the host, because inside a pid namespace a session
    // leader that lives outside it shows as 0 (and so may the test runner's own session,
    // when CI itself runs in a container).
    let m = executor_tests::marker();
    let pid = exec_marked_sleep(&mut client, "sess", None, Some(30.0), &m).await;
    let host = |pid: u32| nix::unistd::Pid::from_raw(pid as i32);
    let sid = nix::unistd::getsid(Some(host(pid as u32))).unwrap();
    let pgid = nix::unistd::getpgid(Some(host(pid as u32))).unwrap();
    let daemon_sid = nix::unistd::getsid(Some(host(daemon.pid()))).unwrap();
    assert_ne!(
        sid.as_raw(),
        0,
        "the session leader is visible from the host"
    );
    assert_ne!(sid, daemon_sid, "command shares the daemon's session");
    assert_eq!(sid, pgid, "the command runs in its session's leading group");
    // The session was made for this command: its leader is neither the daemon nor us.
    assert_ne!(sid.as_raw() as u32, daemon.pid());
    assert_ne!(sid, nix::unistd::getsid(None).unwrap());
    // Control: the daemon itself stays in the session it was started in (ours).
    assert_eq!(daemon_sid, nix::unistd::getsid(None).unwrap());
    client
        .send(&protocol::ClientMessage::Cancel(protocol::CancelRequest {
            id: "sess".into(),
        }))
        .await;
    client.collect("sess").await;
    assert!(sleepers_gone(&m).await);
}

/// Send `id`, whose shell execs a sleep marked `m` (under `profile` and with `timeout` if
/// given), and return the sleep's pid once the host shows it.
async fn exec_marked_sleep(
    client: &mut Client,
    id: &str,
    profile: Option<&str>,
    timeout: Option<f64>,
    m: &str,
) -> i32 {
    let mut r = req(id, &format!("exec {}", executor_tests::marked_sleep(m)));
    if let Some(profile) = profile {
        r.profile = Some(profile.into());
    }
    if timeout.is_some() {
        r.timeout = timeout;
    }
    client.send(&protocol::ClientMessage::Exec(r)).await;
    one_sleeper(m).await
}

#[tokio::test]
async fn only_stdio_descriptors_reach_the_command() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let m = executor_tests::marker();
    let pid = exec_marked_sleep(&mut client, "fds", None, Some(30.0), &m).await;
    // Read the command's descriptor table from the host.
    let fd_dir = format!("/proc/{pid}/fd");
    let mut fds: Vec<u32> = std::fs::read_dir(&fd_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_str().unwrap().parse().unwrap())
        .collect();
    fds.sort_unstable();
    assert_eq!(fds, vec![0, 1, 2]);
    assert_eq!(
        std::fs::read_link(format!("{fd_dir}/0")).unwrap().to_str(),
        Some("/dev/null")
    );
    // Control: the daemon itself holds far more (its listener, its connections, its pipes).
    let daemon_fds = std::fs::read_dir(format!("/proc/{}/fd", daemon.pid()))
        .unwrap()
        .count();
    assert!(daemon_fds > 4, "daemon has {daemon_fds} fds");
    assert!(cancel(&mut client, "fds").await.extra.cancelled);
}

#[tokio::test]
async fn commands_start_with_default_signal_dispositions_and_an_empty_mask() {
    // Rust ignores SIGPIPE and the helper blocks SIGCHLD; neither may leak into a command, or
    // `yes | head` never stops and shells misbehave. Checked on the host, in /proc.
    let daemon = Daemon::start_with(&ALLOW_ALL_PROFILES);
    let mut client = daemon.connect().await;
    for profile in ["strict", "landlock", "task-container", "trusted"] {
        let m = executor_tests::marker();
        let pid = exec_marked_sleep(&mut client, "sig", Some(profile), None, &m).await;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
                .unwrap_or_default()
                .to_string()
        };
        assert_eq!(field("SigIgn:"), "0000000000000000", "{profile}");
        assert_eq!(field("SigBlk:"), "0000000000000000", "{profile}");
        assert!(cancel(&mut client, "sig").await.extra.cancelled);
        let mut r = req("pipe", "yes | head -2; echo rc=${PIPESTATUS[0]}");
        r.profile = Some(profile.into());
        let out = client.exec(r).await.result.unwrap().output;
        // `yes` dies of SIGPIPE (141), silently; control: the output is what head printed.
        assert_eq!(out, "y\ny\nrc=141\n", "{profile}");
    }
}

#[tokio::test]
async fn an_id_is_free_again_as_soon_as_its_result_arrives() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    for i in 0..50 {
        let result = client.exec(req("same", "true")).await.result;
        assert!(result.is_ok(), "attempt {i}: {result:?}");
    }
}
