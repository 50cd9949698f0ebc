//! Servers kept running as processes: who can reach them under each profile.

use super::*;

/// A free TCP port on the host's loopback.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A command that fetches `url` with Python's urllib, retrying for a few seconds while the
/// server starts; it prints the body or the last error.
fn fetch(url: &str) -> String {
    format!(
        "python3 - <<'EOF'\n\
         import time, urllib.request\n\
         err = None\n\
         for _ in range(40):\n\
         \x20   try:\n\
         \x20       print(urllib.request.urlopen('{url}', timeout=2).read().decode(), end='')\n\
         \x20       break\n\
         \x20   except Exception as e:\n\
         \x20       err = e\n\
         \x20       time.sleep(0.1)\n\
         else:\n\
         \x20   print('unreachable:', err)\n\
         EOF"
    )
}

/// A daemon allowing `profiles`, its workspace `ws` in a directory of its own outside the
/// state directory (task-container hides the state directory, so the workspace lives outside
/// it). Returns the directory (removed on drop), the workspace and the daemon.
fn daemon_with_workspace_outside(
    profiles: &[&str],
) -> (executor_tests::TempDir, std::path::PathBuf, Daemon) {
    let root = executor_tests::TempDir::with_prefix_in("e2e-ws-", "/var/tmp").unwrap();
    let workspace = root.path().join("ws");
    let mut flags = Vec::new();
    for profile in profiles {
        flags.extend(["--allow-profile", profile]);
    }
    flags.extend(["--workspace", workspace.to_str().unwrap()]);
    let daemon = Daemon::start_with(&flags);
    (root, workspace, daemon)
}

#[tokio::test]
async fn a_server_spawned_under_task_container_is_reached_by_a_second_command_and_the_host() {
    // Which profiles share a network with the next command (sandbox-profiles/*.json):
    // task-container and trusted use the host's network; strict gives every command a network
    // namespace of its own (a loopback nobody else reaches, see the next test); landlock
    // refuses IP sockets altogether (seccomp), so no server can even listen there.
    let (_root, workspace, daemon) = daemon_with_workspace_outside(&["task-container", "strict"]);
    let mut client = daemon.connect().await;
    let m = marker();
    std::fs::write(workspace.join("hello.txt"), format!("served {m}\n")).unwrap();
    let port = free_port();
    let mut server = spawn_req(
        "server",
        &format!("exec python3 -m http.server {port} --bind 127.0.0.1"),
    );
    server.profile = Some("task-container".into());
    spawn(&mut client, server).await;
    let url = format!("http://127.0.0.1:{port}/hello.txt");
    let mut exec = req("client", &fetch(&url));
    exec.profile = Some("task-container".into());
    let result = client.run_req(exec).await;
    assert_eq!(result.output, format!("served {m}\n"), "{result:?}");
    // The host reaches it too, and the server logged both requests.
    let body = executor_tests::http_get(
        format!("127.0.0.1:{port}").parse().unwrap(),
        "/hello.txt",
        None,
    )
    .await
    .unwrap();
    assert!(body.ends_with(&format!("served {m}\n")), "{body}");
    let mut offset = 0;
    read_until(&mut client, "server", &mut offset, "GET /hello.txt").await;
    signal(&mut client, "server", "TERM", false).await;
    let exited = wait(&mut client, "server", 10.0).await;
    assert!(!exited.running, "{exited:?}");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the server still listens after TERM"
    );
}

#[tokio::test]
async fn under_strict_and_landlock_no_command_can_listen_on_tcp_so_none_reaches_another() {
    // strict gives each command a loopback of its own and landlock's TCP rules refuse bind;
    // landlock (no namespaces) has seccomp refuse IP sockets. So a server spawned there never
    // listens, and a second command (or the host) has nothing to reach. Control: the same
    // listener under task-container (the host's network).
    let (_root, _workspace, daemon) =
        daemon_with_workspace_outside(&["task-container", "strict", "landlock"]);
    let mut client = daemon.connect().await;
    for (profile, listens) in [
        ("strict", false),
        ("landlock", false),
        ("task-container", true),
    ] {
        let port = free_port();
        let id = format!("listen-{profile}");
        let mut r = spawn_req(
            &id,
            &format!(
                "python3 -c \"import socket, time\n\
                 try:\n s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()\n\
                 except OSError as e:\n print('refused', e.errno); raise SystemExit(1)\n\
                 print('listening', flush=True); time.sleep(30)\""
            ),
        );
        r.profile = Some(profile.to_string());
        spawn(&mut client, r).await;
        let mut offset = 0;
        let said = read_until(&mut client, &id, &mut offset, "\n").await;
        let host_reaches = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
        if listens {
            assert!(said.starts_with("listening"), "[{profile}] {said:?}");
            assert!(host_reaches, "[{profile}] control: the host reaches it");
            signal(&mut client, &id, "KILL", false).await;
        } else {
            assert!(said.starts_with("refused"), "[{profile}] {said:?}");
            assert!(!host_reaches, "[{profile}] something listens on {port}");
            assert_eq!(wait(&mut client, &id, 10.0).await.returncode, 1);
        }
        assert!(!wait(&mut client, &id, 10.0).await.running);
    }
}
