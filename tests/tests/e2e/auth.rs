//! Authentication: only the exact bearer token opens a session; health checks need none.

use executor_tests::{eventually, http_get, Client, Daemon, PATIENCE};

#[tokio::test]
async fn wrong_missing_and_prefix_tokens_are_rejected_and_the_exact_token_is_accepted() {
    let daemon = Daemon::start();
    let token = &daemon.token;
    assert_eq!(token.len(), 64);
    let cases = [
        None,
        Some("Bearer ".to_string()),
        Some(format!("Bearer {}", &token[..32])),
        Some(format!("Bearer {token}x")),
        Some(format!("Bearer {}", token.to_uppercase())),
        Some(format!("Basic {token}")),
        Some(token.clone()),
    ];
    for auth in cases {
        let err = Client::connect_raw(&daemon.url, auth.as_deref())
            .await
            .unwrap_err();
        assert!(err.to_string().contains("401"), "{auth:?}: {err}");
    }
    // Allowed twin: the exact token.
    let mut client = Client::connect(&daemon.url, Some(token)).await.unwrap();
    assert_eq!(client.run("ok", "echo in").await.output, "in\n");
    // The token never appears in the daemon's log, even after rejected attempts.
    assert!(!daemon.log().contains(token.as_str()));
    // The log is written by a thread of its own: wait for the line (a fast build answers
    // before the line is written).
    assert!(eventually(PATIENCE, || daemon.log().contains("rejected connection")).await);
}

#[tokio::test]
async fn health_endpoints_answer_without_auth_and_other_paths_do_not_exist() {
    let daemon = Daemon::start();
    let health = http_get(daemon.addr, "/healthz", None).await.unwrap();
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    let ready = http_get(daemon.addr, "/readyz", None).await.unwrap();
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    let other = http_get(daemon.addr, "/v1/other", None).await.unwrap();
    assert!(other.starts_with("HTTP/1.1 404"), "{other}");
    // A plain GET with the right token but no upgrade headers is refused politely.
    let auth = format!("Bearer {}", daemon.token);
    let plain = http_get(daemon.addr, protocol::WS_PATH, Some(&auth))
        .await
        .unwrap();
    assert!(plain.starts_with("HTTP/1.1 400"), "{plain}");
    let unauth = http_get(daemon.addr, protocol::WS_PATH, None)
        .await
        .unwrap();
    assert!(unauth.starts_with("HTTP/1.1 401"), "{unauth}");
}

#[tokio::test]
async fn token_file_is_private_and_never_reaches_a_command() {
    let daemon = Daemon::start();
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(daemon.state.path().join("token")).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let mut client = daemon.connect().await;
    // The daemon's environment and command line hold no token.
    let environ = std::fs::read(format!("/proc/{}/environ", daemon.pid())).unwrap_or_default();
    assert!(!String::from_utf8_lossy(&environ).contains(daemon.token.as_str()));
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", daemon.pid())).unwrap();
    assert!(!String::from_utf8_lossy(&cmdline).contains(daemon.token.as_str()));
    let out = client
        .run("env", "env; cat /proc/$PPID/cmdline | tr '\\0' ' '")
        .await
        .output;
    assert!(!out.contains(daemon.token.as_str()));
}

#[tokio::test]
async fn a_same_uid_command_cannot_read_the_daemons_memory_or_environment() {
    if !executor_tests::require(
        "root (to start the daemon as another user)",
        executor_tests::is_root(),
    ) {
        return;
    }
    // Run the daemon as an unprivileged user, so its commands share its uid and hold no
    // capability: only the daemon's non-dumpable flag stands between them and its memory.
    const NOBODY: u32 = 65534;
    let daemon = executor_tests::Daemon::start_as_user(NOBODY, &executor_tests::ALLOW_ALL_PROFILES);
    let mut client = daemon.connect().await;
    let pid = daemon.pid();
    let probe = |target: u32| {
        format!(
            "id -u; for f in environ maps; do head -c 1 /proc/{target}/$f >/dev/null 2>&1 \
             && echo $f:readable || echo $f:denied; done"
        )
    };
    // The trusted profile, so that nothing but the daemon's own flag is tested.
    let trusted = |id: &str, command: String| {
        let mut r = executor_tests::req(id, &command);
        r.profile = Some("trusted".into());
        r
    };
    let out = client
        .exec(trusted("daemon", probe(pid)))
        .await
        .result
        .unwrap()
        .output;
    assert_eq!(out, format!("{NOBODY}\nenviron:denied\nmaps:denied\n"));
    // Control: an ordinary process of the same uid is readable by the same command.
    let mut peer = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sleep",
            "30",
        ])
        .spawn()
        .unwrap();
    // setpriv is non-dumpable between its setresuid and its exec of sleep, so wait for the
    // exec: a warm worker runs the probe fast enough to land in that window.
    let comm = format!("/proc/{}/comm", peer.id());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::fs::read_to_string(&comm).unwrap_or_default().trim() != "sleep" {
        assert!(
            std::time::Instant::now() < deadline,
            "the peer never became sleep"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let out = client
        .exec(trusted("peer", probe(peer.id())))
        .await
        .result
        .unwrap()
        .output;
    let _ = peer.kill();
    let _ = peer.wait();
    assert_eq!(out, format!("{NOBODY}\nenviron:readable\nmaps:readable\n"));
}

#[tokio::test]
async fn non_loopback_listen_without_a_token_file_is_refused() {
    let state = executor_tests::TempDir::new().unwrap();
    let out = std::process::Command::new(executor_tests::binary("executor"))
        .args(["serve", "--listen", "0.0.0.0:0", "--state-dir"])
        .arg(state.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("non-loopback"), "{stderr}");
    assert!(
        !state.path().join("token").exists(),
        "no token generated for it"
    );
}

#[tokio::test]
async fn a_token_file_someone_else_owns_is_refused() {
    // Whoever owns the token file can change the token; a root daemon took one owned by
    // nobody. Checked on the opened file, so a link to a private file of root's is fine.
    if !executor_tests::require("root (to chown)", executor_tests::is_root()) {
        return;
    }
    let dir = executor_tests::TempDir::new().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "n".repeat(64)).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    nix::unistd::chown(&token, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
    let refused = Daemon::try_start_opts(executor_tests::DaemonOptions {
        extra: vec!["--token-file".into(), token.display().to_string()],
        ..Default::default()
    });
    let log = refused
        .err()
        .expect("the daemon started with nobody's token file");
    assert!(log.contains("belongs to uid 65534"), "{log}");
    // Control: the same file owned by root, through a symlink.
    nix::unistd::chown(&token, Some(nix::unistd::Uid::from_raw(0)), None).unwrap();
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&token, &link).unwrap();
    let daemon = Daemon::start_opts(executor_tests::DaemonOptions {
        extra: vec!["--token-file".into(), link.display().to_string()],
        ..Default::default()
    });
    let mut client = Client::connect(&daemon.url, Some(&"n".repeat(64)))
        .await
        .unwrap();
    assert_eq!(client.run("ok", "echo in").await.output, "in\n");
}
