//! `agent cp` against a real executor (protocol 1.1 files): bytes and trees there and back,
//! checked on the host; a path the sandbox denies fails with the executor's message and
//! leaves nothing behind, beside its allowed control case.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use executor_tests::{marker, Daemon};

use crate::{agent_against, Scratch};

/// Every byte value, over and over.
pub fn every_byte(len: usize) -> Vec<u8> {
    (0..=255u8).cycle().take(len).collect()
}

fn text(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cp_moves_a_file_with_every_byte_value_there_and_back_unchanged() {
    let daemon = Daemon::start();
    let s = Scratch::new();
    // More than two 512 KiB chunks, and not a multiple of one.
    let bytes = every_byte(1_300_007);
    let local = s.path().join("bytes.bin");
    std::fs::write(&local, &bytes).unwrap();
    let up = agent_against(&daemon, "cp", &[text(&local), ":bytes.bin"], b"").await;
    assert_eq!(up.code, 0, "{}", up.stderr);
    assert_eq!(
        std::fs::read(daemon.workspace.join("bytes.bin")).unwrap(),
        bytes
    );
    let back = s.path().join("back.bin");
    let down = agent_against(&daemon, "cp", &[":bytes.bin", text(&back)], b"").await;
    assert_eq!(down.code, 0, "{}", down.stderr);
    assert_eq!(std::fs::read(&back).unwrap(), bytes);
    // Into an existing directory a file keeps its name.
    let into = s.path().join("into");
    std::fs::create_dir(&into).unwrap();
    let down = agent_against(&daemon, "cp", &[":bytes.bin", text(&into)], b"").await;
    assert_eq!(down.code, 0, "{}", down.stderr);
    assert_eq!(std::fs::read(into.join("bytes.bin")).unwrap(), bytes);
    // `-` is stdin as a source and stdout as a destination.
    let small = every_byte(256);
    let piped = agent_against(&daemon, "cp", &["-", ":piped.bin"], &small).await;
    assert_eq!(piped.code, 0, "{}", piped.stderr);
    assert_eq!(
        std::fs::read(daemon.workspace.join("piped.bin")).unwrap(),
        small
    );
    let out = agent_against(&daemon, "cp", &[":piped.bin", "-"], b"").await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, small);
    // Nothing but the copies was left beside them (temporary files are renamed or removed).
    let mut names: Vec<String> = std::fs::read_dir(s.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["back.bin", "bytes.bin", "into"]);
}

/// A small tree: nested directories, every byte value, an empty file, an executable.
fn make_tree(root: &Path) {
    std::fs::create_dir_all(root.join("sub/deeper")).unwrap();
    std::fs::write(root.join("a.txt"), "alpha\n").unwrap();
    std::fs::write(root.join("sub/bytes.bin"), every_byte(70_000)).unwrap();
    std::fs::write(root.join("sub/deeper/empty"), "").unwrap();
    std::fs::write(root.join("run.sh"), "#!/bin/sh\necho ran\n").unwrap();
    std::fs::set_permissions(root.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn assert_same_tree(copy: &Path) {
    assert_eq!(
        std::fs::read_to_string(copy.join("a.txt")).unwrap(),
        "alpha\n"
    );
    assert_eq!(
        std::fs::read(copy.join("sub/bytes.bin")).unwrap(),
        every_byte(70_000)
    );
    assert_eq!(std::fs::read(copy.join("sub/deeper/empty")).unwrap(), b"");
    let mode = std::fs::metadata(copy.join("run.sh"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o111, 0o111, "{mode:o}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cp_moves_a_directory_there_and_back_as_tar() {
    let daemon = Daemon::start();
    let s = Scratch::new();
    let tree = s.path().join("tree");
    make_tree(&tree);
    let up = agent_against(&daemon, "cp", &[text(&tree), ":tree"], b"").await;
    assert_eq!(up.code, 0, "{}", up.stderr);
    assert_same_tree(&daemon.workspace.join("tree"));
    // The command sees it where cp put it.
    let seen = agent_against(&daemon, "exec", &["--", "sh tree/run.sh"], b"").await;
    assert_eq!(
        (seen.code, String::from_utf8_lossy(&seen.stdout).as_ref()),
        (0, "ran\n")
    );
    // A file into the existing directory keeps its name; `-p` makes missing parents.
    let extra = s.write("extra.txt", "more\n");
    let into = agent_against(&daemon, "cp", &[text(&extra), ":tree"], b"").await;
    assert_eq!(into.code, 0, "{}", into.stderr);
    assert_eq!(
        std::fs::read_to_string(daemon.workspace.join("tree/extra.txt")).unwrap(),
        "more\n"
    );
    let deep = agent_against(&daemon, "cp", &[text(&extra), ":new/deep/x.txt"], b"").await;
    assert_eq!(deep.code, 255, "a missing parent was made without -p");
    assert!(deep.stderr.contains("(not_found)"), "{}", deep.stderr);
    let deep = agent_against(&daemon, "cp", &["-p", text(&extra), ":new/deep/x.txt"], b"").await;
    assert_eq!(deep.code, 0, "{}", deep.stderr);
    assert!(daemon.workspace.join("new/deep/x.txt").is_file());
    std::fs::remove_file(daemon.workspace.join("tree/extra.txt")).unwrap();
    // Back to a new directory...
    let back = s.path().join("back");
    let down = agent_against(&daemon, "cp", &[":tree", text(&back)], b"").await;
    assert_eq!(down.code, 0, "{}", down.stderr);
    assert_same_tree(&back);
    // ... and into an existing one, under its own name, as `docker cp` does.
    let down = agent_against(&daemon, "cp", &[":tree/", text(&back)], b"").await;
    assert_eq!(down.code, 0, "{}", down.stderr);
    assert_same_tree(&back.join("tree"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cp_into_a_path_the_sandbox_denies_fails_with_the_executors_message_and_leaves_nothing() {
    let daemon = Daemon::start();
    let s = Scratch::new();
    let m = marker();
    let local = s.write("f", "payload\n");
    // /etc is read-only to commands under the default profile.
    let denied_path = format!("/etc/agent-cp-{m}");
    let denied = agent_against(
        &daemon,
        "cp",
        &[text(&local), &format!(":{denied_path}")],
        b"",
    )
    .await;
    assert_eq!(denied.code, 255, "{}", denied.stderr);
    assert!(denied.stderr.contains(&denied_path), "{}", denied.stderr);
    assert!(denied.stderr.contains("(denied)"), "{}", denied.stderr);
    assert!(
        !Path::new(&denied_path).exists(),
        "the denied copy reached the host"
    );
    // Control: the same file into the workspace.
    let allowed = agent_against(
        &daemon,
        "cp",
        &[text(&local), &format!(":agent-cp-{m}")],
        b"",
    )
    .await;
    assert_eq!(allowed.code, 0, "{}", allowed.stderr);
    assert_eq!(
        std::fs::read_to_string(daemon.workspace.join(format!("agent-cp-{m}"))).unwrap(),
        "payload\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cp_reports_a_missing_source_on_either_side_and_writes_nothing() {
    let daemon = Daemon::start();
    let s = Scratch::new();
    let missing = s.path().join("missing");
    let local = agent_against(&daemon, "cp", &[text(&missing), ":x"], b"").await;
    assert_eq!(local.code, 255);
    assert!(
        local
            .stderr
            .contains(&format!("cannot read {}", missing.display())),
        "{}",
        local.stderr
    );
    assert!(!daemon.workspace.join("x").exists());
    let out = s.path().join("out");
    let remote = agent_against(&daemon, "cp", &[":no-such-file", text(&out)], b"").await;
    assert_eq!(remote.code, 255);
    // The executor's own words, with its code.
    assert!(
        remote.stderr.contains("could not read :no-such-file: ")
            && remote.stderr.contains("(not_found)"),
        "{}",
        remote.stderr
    );
    assert!(!out.exists());
    let both = agent_against(&daemon, "cp", &[":a", ":b"], b"").await;
    assert_eq!(both.code, 255);
    assert!(
        both.stderr.contains("one side must be local"),
        "{}",
        both.stderr
    );
}

/// A protocol 1.0 executor: a hello without capabilities, then silence until the client goes.
struct OldExecutor {
    url: String,
    task: tokio::task::JoinHandle<()>,
}

impl OldExecutor {
    async fn start() -> Self {
        use futures_util::{SinkExt, StreamExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "ws://{}{}",
            listener.local_addr().unwrap(),
            protocol::WS_PATH
        );
        let task = tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                // The agent probes the address with a bare TCP connection first.
                let Ok(mut ws) = tokio_tungstenite::accept_async(tcp).await else {
                    continue;
                };
                let hello = protocol::ServerMessage::Hello(Box::new(protocol::Hello {
                    protocol: protocol::PROTOCOL_VERSION,
                    server: "executor 0.0.9".into(),
                    default_profile: "strict".into(),
                    ..protocol::Hello::default()
                }));
                let text = serde_json::to_string(&hello).unwrap();
                ws.send(tokio_tungstenite::tungstenite::Message::text(text))
                    .await
                    .unwrap();
                while let Some(Ok(_)) = ws.next().await {}
            }
        });
        Self { url, task }
    }
}

impl Drop for OldExecutor {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_new_commands_name_the_missing_capability_of_an_older_executor() {
    let old = OldExecutor::start().await;
    let s = Scratch::new();
    let local = s.write("f", "x\n");
    for (args, capability) in [
        (vec!["cp", text(&local), ":f"], "\"files\""),
        (vec!["exec", "--stdin", "--", "cat"], "\"processes\""),
        (vec!["shell"], "\"processes\""),
    ] {
        let out = tokio::time::timeout(
            executor_tests::PATIENCE,
            tokio::process::Command::new(executor_tests::binary("agent"))
                .arg(args[0])
                .args(["--executor", &old.url])
                .args(&args[1..])
                .env_remove("EXECUTOR_TOKEN")
                .stdin(std::process::Stdio::null())
                .output(),
        )
        .await
        .unwrap()
        .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(255), "{args:?}: {stderr}");
        assert!(
            stderr.contains(capability) && stderr.contains("upgrade the executor"),
            "{args:?}: {stderr}"
        );
    }
}
