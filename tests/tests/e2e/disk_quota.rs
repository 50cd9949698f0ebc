//! Disk quotas: a client's workspace, home and temporary space are a filesystem of its own (an
//! ext4 image on a loop device). Writing past the quota fails inside the sandbox with ENOSPC
//! and the result names the quota; other clients, and the same client under its quota, write
//! on; the files are on the host where the hello says; nothing stays mounted or attached once
//! the daemon stops.

use std::path::Path;
use std::time::Duration;

use executor_tests::host_waits::send_signal;
use executor_tests::{eventually, is_root, req, require, Client, Daemon, PATIENCE};
use nix::sys::signal::Signal;

use crate::clients::{clients_file, connect, start, ALICE, BOB};

const MIB: u64 = 1024 * 1024;

/// Whether this host can have loop devices (root, and /dev/loop-control).
fn loops_available() -> bool {
    require("root", is_root())
        && require(
            "loop devices (/dev/loop-control)",
            Path::new("/dev/loop-control").exists(),
        )
}

fn in_profile(id: &str, command: &str, profile: &str) -> protocol::ExecRequest {
    let mut r = req(id, command);
    r.profile = Some(profile.into());
    r.timeout = Some(60.0);
    r
}

/// Mount points beneath `dir`, from the host's mount table.
fn mounts_under(dir: &Path) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| Path::new(p).starts_with(dir))
        .map(str::to_string)
        .collect()
}

/// Loop devices whose backing file is beneath `dir` (`losetup -a`).
fn loops_under(dir: &Path) -> Vec<String> {
    let out = std::process::Command::new("losetup")
        .arg("-a")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&*dir.to_string_lossy()))
        .map(str::to_string)
        .collect()
}

/// Unmounts what is left beneath a state directory when a test fails before its daemon
/// stopped (the harness kills a daemon with SIGKILL, which unmounts nothing). Declared before
/// the daemon, so that it runs after the daemon is gone.
#[derive(Default)]
struct Leftovers(Option<std::path::PathBuf>);

impl Drop for Leftovers {
    fn drop(&mut self) {
        if let Some(state) = &self.0 {
            for point in mounts_under(state) {
                let _ = std::process::Command::new("umount")
                    .arg("-l")
                    .arg(&point)
                    .status();
            }
        }
    }
}

/// A daemon whose volumes are unmounted whatever the test's end: the fields drop in order, so
/// the `Leftovers` runs once the daemon is gone, and the clients file goes last.
struct WithVolumes {
    daemon: Daemon,
    _leftovers: Leftovers,
    _clients: Option<executor_tests::TempDir>,
}

impl std::ops::Deref for WithVolumes {
    type Target = Daemon;
    fn deref(&self) -> &Daemon {
        &self.daemon
    }
}

impl std::ops::DerefMut for WithVolumes {
    fn deref_mut(&mut self) -> &mut Daemon {
        &mut self.daemon
    }
}

fn with_volumes(daemon: Daemon, clients: Option<executor_tests::TempDir>) -> WithVolumes {
    let leftovers = Leftovers(Some(daemon.state.path().to_path_buf()));
    WithVolumes {
        daemon,
        _leftovers: leftovers,
        _clients: clients,
    }
}

/// A daemon serving these clients-file entries, with its volumes unmounted at the end.
fn start_clients_with_volumes(clients: &[serde_json::Value]) -> WithVolumes {
    let (dir, file) = clients_file(&serde_json::json!({ "clients": clients }));
    with_volumes(start(&file, &[]), Some(dir))
}

/// A daemon serving alice (`alice`, her clients-file entry) and bob, both connected.
async fn alice_and_bob(
    alice: serde_json::Value,
    bob: serde_json::Value,
) -> (WithVolumes, Client, Client) {
    let daemon = start_clients_with_volumes(&[alice, bob]);
    let alice = connect(&daemon, ALICE).await;
    let bob = connect(&daemon, BOB).await;
    (daemon, alice, bob)
}

/// A daemon serving alice alone (`alice`, her clients-file entry), connected.
async fn alice_alone(alice: serde_json::Value) -> (WithVolumes, Client) {
    let daemon = start_clients_with_volumes(&[alice]);
    let alice = connect(&daemon, ALICE).await;
    (daemon, alice)
}

/// A single-token daemon started with `flags`, with its volumes unmounted at the end.
fn start_flags_with_volumes(flags: &[&str]) -> WithVolumes {
    with_volumes(Daemon::start_with(flags), None)
}

/// A clients-file entry: strict and landlock, a `workspace` of its own (per_client or
/// per_connection) and a quota of `bytes`.
fn quota_client(name: &str, token: &str, workspace: &str, bytes: u64) -> serde_json::Value {
    serde_json::json!({"name": name, "token": token, "profiles": ["strict", "landlock"],
        "workspace": workspace, "disk_quota_bytes": bytes})
}

/// [`quota_client`] with a quota of `files` inodes too.
fn with_file_quota(mut client: serde_json::Value, files: u64) -> serde_json::Value {
    client["disk_quota_files"] = files.into();
    client
}

/// Writes 32 MiB into the workspace and says dd's return code.
const FILL_32_MIB: &str = "dd if=/dev/zero of=big bs=1M count=32 2>&1; echo rc=$?";

/// Whether the result names `limit` among the limits it hit.
fn hit(r: &protocol::ExecResult, limit: &str) -> bool {
    r.extra.limits_hit.iter().any(|l| l == limit)
}

/// Stop the daemon as an operator would, then check that it left no mount and no loop device.
async fn stop_and_check_nothing_left(mut daemon: WithVolumes) {
    let state = daemon.state.path().to_path_buf();
    assert!(
        !mounts_under(&state).is_empty() && !loops_under(&state).is_empty(),
        "volumes mounted while the daemon runs"
    );
    let status = daemon.signal_and_wait(Signal::SIGTERM);
    assert!(status.success(), "{status:?}\n{}", daemon.log());
    // The loop device goes with the filesystem's last reference (autoclear), which the
    // kernel drops once the daemon's sandboxes are gone: allow it a moment on a busy machine.
    let gone = eventually(PATIENCE, || {
        mounts_under(&state).is_empty() && loops_under(&state).is_empty()
    })
    .await;
    assert!(
        gone,
        "left after the daemon stopped: mounts {:?}, loop devices {:?}\n{}",
        mounts_under(&state),
        loops_under(&state),
        daemon.log()
    );
}

#[tokio::test]
async fn writing_past_the_byte_quota_gets_enospc_and_the_result_names_it_while_others_write_on() {
    if !loops_available() {
        return;
    }
    let (daemon, mut alice, mut bob) = alice_and_bob(
        quota_client("alice", ALICE, "per_client", 16 * MIB),
        quota_client("bob", BOB, "per_client", 64 * MIB),
    )
    .await;
    let quota = &alice.hello.disk_quota;
    assert_eq!(quota.mechanism, "ext4_loop", "{quota:?}");
    assert_eq!(quota.bytes, Some(16 * MIB));
    assert_eq!(quota.covers, ["workspace", "home", "tmp"]);
    assert_eq!(bob.hello.disk_quota.bytes, Some(64 * MIB));

    // Past the quota: dd fails with ENOSPC inside the sandbox; the result names the quota.
    let full = alice
        .run_req(in_profile("fill", FILL_32_MIB, "strict"))
        .await;
    assert!(
        full.output.contains("No space left on device") && full.output.contains("rc=1"),
        "{full:?}"
    );
    assert!(hit(&full, "disk_bytes"), "{full:?}");
    assert!(!hit(&full, "disk_files"));
    // The file is on the host, in the client's workspace the hello named, cut at the quota.
    let big = Path::new(&alice.hello.workspace).join("big");
    let size = std::fs::metadata(&big).unwrap().len();
    assert!(size > 8 * MIB && size < 16 * MIB, "{size}");

    // Another client writes twice as much, on a filesystem of its own.
    let other = bob
        .run_req(in_profile("write", FILL_32_MIB, "strict"))
        .await;
    assert!(other.output.contains("rc=0"), "{other:?}");
    assert!(other.extra.limits_hit.is_empty(), "{other:?}");
    let bobs = Path::new(&bob.hello.workspace).join("big");
    assert_eq!(std::fs::metadata(&bobs).unwrap().len(), 32 * MIB);

    // The same client, under its quota again, writes fine; its home and TMPDIR count too
    // (landlock's commands have them).
    let again = alice
        .run_req(in_profile(
            "again",
            "rm big && dd if=/dev/zero of=small bs=1M count=4 2>&1 && echo rc=$?",
            "strict",
        ))
        .await;
    assert!(again.output.contains("rc=0"), "{again:?}");
    assert!(again.extra.limits_hit.is_empty(), "{again:?}");
    let tmp = alice
        .run_req(in_profile(
            "tmp",
            "dd if=/dev/zero of=\"$TMPDIR/t\" bs=1M count=32 2>&1; echo rc=$?; echo tmp=$TMPDIR",
            "landlock",
        ))
        .await;
    assert!(
        tmp.output.contains("No space left on device") && tmp.output.contains("rc=1"),
        "{tmp:?}"
    );
    assert!(hit(&tmp, "disk_bytes"), "{tmp:?}");
    let home = alice
        .run_req(in_profile(
            "home",
            "rm \"$TMPDIR/t\"; echo $HOME",
            "landlock",
        ))
        .await;
    let home = home.output.trim();
    // The home is the client's own, on its volume (not the host's /tmp).
    assert!(
        mounts_under(daemon.state.path())
            .iter()
            .any(|m| Path::new(home).starts_with(m)),
        "{home} is on no volume: {:?}",
        mounts_under(daemon.state.path())
    );
    drop((alice, bob));
    stop_and_check_nothing_left(daemon).await;
}

#[tokio::test]
async fn creating_files_past_the_file_quota_gets_enospc_and_the_result_names_the_file_quota() {
    if !loops_available() {
        return;
    }
    let (daemon, mut alice, mut bob) = alice_and_bob(
        with_file_quota(quota_client("alice", ALICE, "per_client", 32 * MIB), 100),
        quota_client("bob", BOB, "per_client", 32 * MIB),
    )
    .await;
    assert_eq!(alice.hello.disk_quota.files, Some(100));
    let touch =
        "for i in $(seq 1 300); do touch f$i 2>&1 || { echo stopped=$i; break; }; done; ls | wc -l";
    let full = alice.run_req(in_profile("files", touch, "strict")).await;
    assert!(
        full.output.contains("No space left on device") && full.output.contains("stopped="),
        "{full:?}"
    );
    assert!(hit(&full, "disk_files"), "{full:?}");
    assert!(!hit(&full, "disk_bytes"));
    // On the host: fewer files than asked for, more than none.
    let made = std::fs::read_dir(&alice.hello.workspace).unwrap().count();
    assert!((50..300).contains(&made), "{made}");
    // Bob's quota has files to spare (one per 16 KiB: 2048).
    let fine = bob.run_req(in_profile("files", touch, "strict")).await;
    assert!(!fine.output.contains("stopped="), "{fine:?}");
    assert!(fine.extra.limits_hit.is_empty(), "{fine:?}");
    assert_eq!(
        std::fs::read_dir(&bob.hello.workspace).unwrap().count(),
        300
    );
    // Alice, under her quota again, creates files.
    let again = alice
        .run_req(in_profile(
            "again",
            "rm -f f*; touch a b c && echo made",
            "strict",
        ))
        .await;
    assert!(again.output.contains("made"), "{again:?}");
    assert!(again.extra.limits_hit.is_empty(), "{again:?}");
    drop((alice, bob));
    stop_and_check_nothing_left(daemon).await;
}

#[tokio::test]
async fn a_single_token_daemon_puts_its_workspace_under_the_quota_its_flags_set() {
    if !loops_available() {
        return;
    }
    let quota = (16 * MIB).to_string();
    let mut flags = vec![
        "--disk-quota-bytes",
        quota.as_str(),
        "--disk-quota-files",
        "1000",
    ];
    flags.extend(executor_tests::ALLOW_ALL_PROFILES);
    let daemon = start_flags_with_volumes(&flags);
    let mut client = daemon.connect().await;
    let quota = &client.hello.disk_quota;
    assert_eq!(quota.mechanism, "ext4_loop", "{quota:?}");
    assert_eq!((quota.bytes, quota.files), (Some(16 * MIB), Some(1000)));
    let workspace = Path::new(&client.hello.workspace).to_path_buf();
    assert!(
        mounts_under(daemon.state.path())
            .iter()
            .any(|m| workspace.starts_with(m)),
        "{} is on no volume",
        workspace.display()
    );
    let full = client
        .run_req(in_profile("fill", FILL_32_MIB, "strict"))
        .await;
    assert!(full.output.contains("No space left on device"), "{full:?}");
    assert!(hit(&full, "disk_bytes"));
    let small = client
        .run_req(in_profile(
            "small",
            "rm big; echo hi > small && cat small",
            "strict",
        ))
        .await;
    assert_eq!(small.output, "hi\n");
    assert!(small.extra.limits_hit.is_empty(), "{small:?}");
    assert_eq!(
        std::fs::read_to_string(workspace.join("small")).unwrap(),
        "hi\n"
    );
    // Every profile writes the workspace on its volume, and is bound by its quota.
    for profile in ["landlock", "task-container"] {
        let wrote = client
            .run_req(in_profile(
                profile,
                &format!("echo {profile} > {profile} && cat {profile}"),
                profile,
            ))
            .await;
        assert_eq!(wrote.output, format!("{profile}\n"), "{wrote:?}");
        assert_eq!(
            std::fs::read_to_string(workspace.join(profile)).unwrap(),
            format!("{profile}\n")
        );
        let full = client
            .run_req(in_profile(
                "fill",
                "dd if=/dev/zero of=big bs=1M count=32 2>&1; rm -f big",
                profile,
            ))
            .await;
        assert!(
            full.output.contains("No space left on device"),
            "{profile}: {full:?}"
        );
        assert!(
            full.extra.limits_hit.is_empty(),
            "{profile}: removed before the end: {full:?}"
        );
    }
    // The daemon's own files are not on the volume: its audit log is still written.
    assert!(
        eventually(Duration::from_secs(10), || daemon
            .audit()
            .iter()
            .any(|r| r["id"] == "small"))
        .await
    );
    drop(client);
    stop_and_check_nothing_left(daemon).await;
}

#[tokio::test]
async fn without_a_quota_the_hello_says_none_and_why() {
    let daemon = Daemon::start();
    let client = daemon.connect().await;
    let quota = &client.hello.disk_quota;
    assert_eq!(quota.mechanism, "none");
    assert!(quota.reason.contains("no disk quota is set"), "{quota:?}");
    assert!(mounts_under(daemon.state.path()).is_empty());
}

#[tokio::test]
async fn commands_are_refused_while_the_audit_log_cannot_reserve_its_disk_and_accepted_once_it_can()
{
    if !require("root (to mount a small tmpfs)", is_root()) {
        return;
    }
    // A small filesystem for the state directory, nearly filled before the daemon starts: the
    // audit log cannot reserve its 8 MiB ahead.
    let fs = executor_tests::TempDir::with_prefix_in("executor-small-", "/var/tmp").unwrap();
    let status = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "mode=0755,size=16m", "tmpfs"])
        .arg(fs.path())
        .status()
        .unwrap();
    assert!(status.success());
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _unmount = Unmount(fs.path().to_path_buf());
    let filler = fs.path().join("filler");
    let status = std::process::Command::new("fallocate")
        .args(["-l", "14m"])
        .arg(&filler)
        .status()
        .unwrap();
    assert!(status.success());
    let daemon = Daemon::start_opts(executor_tests::DaemonOptions {
        state_parent: Some(fs.path().to_path_buf()),
        ..Default::default()
    });
    let mut client = daemon.connect().await;
    let refused = client.exec(req("refused", "echo ran")).await.result;
    let err = refused.expect_err("accepted without the audit log's reserve");
    assert_eq!(err.code, protocol::ErrorCode::EnvironmentError);
    assert!(
        err.message.contains("audit log") && err.message.contains("reserved"),
        "{err:?}"
    );
    // Space freed: the reserve is taken on the next command, which runs and is recorded.
    std::fs::remove_file(&filler).unwrap();
    let ran = client.run("ran", "echo ran").await;
    assert_eq!(ran.output, "ran\n");
    assert!(
        eventually(Duration::from_secs(10), || daemon
            .audit()
            .iter()
            .any(|r| r["id"] == "ran"))
        .await
    );
    // The log holds its reserve: blocks allocated past its end.
    let log = daemon.state.path().join("audit.jsonl");
    let meta = std::fs::metadata(&log).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert!(
        meta.blocks() * 512 >= meta.len() + 4 * MIB,
        "{} bytes, {} allocated",
        meta.len(),
        meta.blocks() * 512
    );
}

#[tokio::test]
async fn executor_check_says_which_disk_quota_mechanism_this_host_has_and_why_not_when_none() {
    if !loops_available() {
        return;
    }
    let check = |user: Option<u32>| {
        let mut command = match user {
            None => std::process::Command::new(executor_tests::binary("executor")),
            Some(id) => {
                let mut c = std::process::Command::new("setpriv");
                c.arg(format!("--reuid={id}"))
                    .arg(format!("--regid={id}"))
                    .arg("--clear-groups")
                    .arg(executor_tests::binary("executor"));
                c
            }
        };
        let out = command.arg("check").output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| l.starts_with("disk quotas:"))
            .unwrap_or_default()
            .to_string()
    };
    let root = check(None);
    assert!(root.starts_with("disk quotas: ext4_loop"), "{root}");
    // Not root: no loop device can be had, and the line says so.
    let user = check(Some(65534));
    assert!(
        user.starts_with("disk quotas: none") && user.contains("not root"),
        "{user}"
    );
    // The probe left nothing mounted or attached.
    assert!(loops_under(Path::new("/var/tmp/executor-check-")).is_empty());
    assert!(!std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .contains("executor-check-"));
}

#[tokio::test]
async fn a_session_scratch_is_on_its_clients_volume_and_goes_with_the_session() {
    if !loops_available() {
        return;
    }
    let (daemon, mut alice) =
        alice_alone(quota_client("alice", ALICE, "per_connection", 16 * MIB)).await;
    let scratch = Path::new(&alice.hello.workspace).to_path_buf();
    let full = alice
        .run_req(in_profile("fill", FILL_32_MIB, "strict"))
        .await;
    assert!(full.output.contains("No space left on device"), "{full:?}");
    assert!(hit(&full, "disk_bytes"));
    let volume = mounts_under(daemon.state.path());
    assert!(
        volume.iter().any(|m| scratch.starts_with(m)),
        "{} is on no volume: {volume:?}",
        scratch.display()
    );
    assert!(scratch.join("big").exists());
    // The session ends: its scratch goes, and with it the space it held.
    drop(alice);
    assert!(
        eventually(PATIENCE, || !scratch.exists()).await,
        "{} left",
        scratch.display()
    );
    let mut again = connect(&daemon, ALICE).await;
    let fits = again
        .run_req(in_profile(
            "fits",
            "dd if=/dev/zero of=f bs=1M count=8 2>&1; echo rc=$?",
            "strict",
        ))
        .await;
    assert!(fits.output.contains("rc=0"), "{fits:?}");
    assert!(fits.extra.limits_hit.is_empty(), "{fits:?}");
    drop(again);
    stop_and_check_nothing_left(daemon).await;
}

#[tokio::test]
async fn a_quota_larger_than_the_hosts_free_disk_is_refused_with_an_error_naming_it() {
    if !loops_available() {
        return;
    }
    // A petabyte: no test machine has it free. Control: a small quota on the same host is
    // had (the other tests).
    let (daemon, mut alice, mut bob) = alice_and_bob(
        quota_client("alice", ALICE, "per_client", 1u64 << 50),
        quota_client("bob", BOB, "per_client", 16 * MIB),
    )
    .await;
    let err = alice
        .exec(in_profile("big", "echo ran > f", "strict"))
        .await
        .result
        .expect_err("ran without its quota");
    assert_eq!(err.code, protocol::ErrorCode::EnvironmentError);
    assert!(
        err.message.contains("disk quota") && err.message.contains("free"),
        "{err:?}"
    );
    // Nothing was allocated for it on the host.
    assert!(!daemon.state.path().join("volumes/alice.img").exists());
    assert!(!daemon
        .state
        .path()
        .join("volumes/alice.img.partial")
        .exists());
    let ok = bob
        .run_req(in_profile("small", "echo ran > f && cat f", "strict"))
        .await;
    assert_eq!(ok.output, "ran\n");
    drop((alice, bob));
    stop_and_check_nothing_left(daemon).await;
}

#[tokio::test]
async fn an_upload_past_the_quota_fails_with_enospc_and_a_smaller_one_lands() {
    if !loops_available() {
        return;
    }
    let (daemon, mut alice) =
        alice_alone(quota_client("alice", ALICE, "per_client", 16 * MIB)).await;
    let workspace = Path::new(&alice.hello.workspace).to_path_buf();
    let big = vec![7u8; 32 * MIB as usize];
    let err = alice
        .upload(executor_tests::upload_req("big", "big.bin"), &big)
        .await
        .expect_err("32 MiB uploaded into a 16 MiB quota");
    assert!(err.message.contains("No space left on device"), "{err:?}");
    assert!(!workspace.join("big.bin").exists());
    let small = vec![7u8; 4 * MIB as usize];
    let done = alice
        .upload(executor_tests::upload_req("small", "small.bin"), &small)
        .await
        .unwrap_or_else(|e| panic!("{e:?}"));
    assert_eq!(done.bytes, 4 * MIB);
    assert_eq!(std::fs::read(workspace.join("small.bin")).unwrap(), small);
    drop(alice);
    stop_and_check_nothing_left(daemon).await;
}

#[tokio::test]
async fn a_restart_after_sigkill_unmounts_what_was_left_and_the_workspace_keeps_its_files() {
    if !loops_available() {
        return;
    }
    let quota = (16 * MIB).to_string();
    let flags = ["--disk-quota-bytes", quota.as_str()];
    let mut daemon = start_flags_with_volumes(&flags);
    let state = daemon.state.path().to_path_buf();
    let mut client = daemon.connect().await;
    let kept = client
        .run_req(in_profile("keep", "echo kept > kept", "strict"))
        .await;
    assert_eq!(kept.returncode, 0, "{kept:?}");
    drop(client);
    // Killed: nothing of the daemon unmounts its volume.
    let _ = daemon.signal_and_wait(Signal::SIGKILL);
    assert_eq!(mounts_under(&state).len(), 1, "{:?}", mounts_under(&state));
    // The next start on the same state directory unmounts it first, then mounts the image
    // again: one mount, one loop device, and the workspace's files are there.
    let (mut again, line) = crate::tls::serve_in(&state, &flags);
    let (url, _, _) = executor_tests::parse_ready_line(&line).unwrap_or_else(|| panic!("{line:?}"));
    assert_eq!(mounts_under(&state).len(), 1, "{:?}", mounts_under(&state));
    assert_eq!(loops_under(&state).len(), 1, "{:?}", loops_under(&state));
    let mut client = Client::connect(&url, Some(&daemon.token)).await.unwrap();
    let read = client
        .run_req(in_profile("read", "cat kept", "strict"))
        .await;
    assert_eq!(read.output, "kept\n");
    drop(client);
    send_signal(again.id() as i32, Signal::SIGTERM);
    let status = again.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(
        eventually(PATIENCE, || mounts_under(&state).is_empty()
            && loops_under(&state).is_empty())
        .await,
        "left: {:?} {:?}",
        mounts_under(&state),
        loops_under(&state)
    );
}

#[tokio::test]
async fn many_clients_first_commands_at_once_each_get_a_volume_of_their_own() {
    if !loops_available() {
        return;
    }
    const N: usize = 6;
    let tokens: Vec<String> = (0..N)
        .map(|i| format!("client{i}-token-0123456789abcdef0123456789abcdef"))
        .collect();
    let entries: Vec<serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, token)| quota_client(&format!("c{i}"), token, "per_client", 8 * MIB))
        .collect();
    let daemon = start_clients_with_volumes(&entries);
    let mut clients = Vec::new();
    for token in &tokens {
        clients.push(connect(&daemon, token).await);
    }
    let runs = clients
        .iter_mut()
        .enumerate()
        .map(|(i, client)| async move {
            let r = client
                .run_req(in_profile(
                    "first",
                    &format!("echo {i} > mine && stat -f -c %i ."),
                    "strict",
                ))
                .await;
            (i, r, client.hello.workspace.clone())
        });
    let mut points = std::collections::BTreeSet::new();
    for (i, r, workspace) in futures_util::future::join_all(runs).await {
        assert_eq!(r.returncode, 0, "{r:?}");
        points.insert(r.output.trim().to_string());
        assert_eq!(
            std::fs::read_to_string(Path::new(&workspace).join("mine")).unwrap(),
            format!("{i}\n")
        );
    }
    // Each saw a filesystem of its own (its ID); the host has one mount per client.
    assert_eq!(points.len(), N, "{points:?}");
    assert_eq!(mounts_under(daemon.state.path()).len(), N);
    drop(clients);
    stop_and_check_nothing_left(daemon).await;
}

#[tokio::test]
async fn a_workspace_the_operator_names_stays_the_operators_and_the_hello_says_it_has_no_quota() {
    if !loops_available() {
        return;
    }
    let tree = executor_tests::TempDir::with_prefix_in("executor-operator-", "/var/tmp").unwrap();
    std::fs::set_permissions(
        tree.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let quota = (16 * MIB).to_string();
    let daemon = start_flags_with_volumes(&[
        "--disk-quota-bytes",
        quota.as_str(),
        "--workspace",
        tree.path().to_str().unwrap(),
    ]);
    let mut client = daemon.connect().await;
    let info = client.hello.disk_quota.clone();
    assert_eq!(info.mechanism, "ext4_loop");
    assert_eq!(info.covers, ["home", "tmp"], "{info:?}");
    assert!(info.reason.contains("--workspace"), "{info:?}");
    assert_eq!(client.hello.workspace, tree.path().display().to_string());
    // The workspace is the operator's tree on the host's disk; the home is on the volume.
    let r = client
        .run_req(in_profile("where", "echo hi > f && echo $HOME", "landlock"))
        .await;
    assert_eq!(
        std::fs::read_to_string(tree.path().join("f")).unwrap(),
        "hi\n"
    );
    let home = r.output.trim().to_string();
    assert!(
        mounts_under(daemon.state.path())
            .iter()
            .any(|m| Path::new(&home).starts_with(m)),
        "{home}"
    );
    assert!(mounts_under(tree.path()).is_empty());
    drop(client);
    stop_and_check_nothing_left(daemon).await;
}

#[tokio::test]
async fn a_spawned_process_past_the_quota_exits_with_the_quota_named_and_one_under_it_without() {
    if !loops_available() {
        return;
    }
    let (daemon, mut alice) =
        alice_alone(quota_client("alice", ALICE, "per_client", 16 * MIB)).await;
    let under = spawn_and_wait(
        &mut alice,
        "under",
        "dd if=/dev/zero of=small bs=1M count=2",
    )
    .await;
    assert_eq!(under.returncode, 0, "{under:?}");
    assert!(
        under.extra.as_ref().unwrap().limits_hit.is_empty(),
        "{under:?}"
    );
    let past = spawn_and_wait(&mut alice, "past", "dd if=/dev/zero of=big bs=1M count=32").await;
    assert_ne!(past.returncode, 0, "{past:?}");
    assert!(
        past.extra
            .as_ref()
            .unwrap()
            .limits_hit
            .contains(&"disk_bytes".to_string()),
        "{past:?}"
    );
    drop(alice);
    stop_and_check_nothing_left(daemon).await;
}

/// Spawn `command` under strict (protocol 1.1) and wait for its `exited`.
async fn spawn_and_wait(client: &mut Client, id: &str, command: &str) -> protocol::Exited {
    use protocol::{ClientMessage, ServerMessage, SpawnRequest, WaitRequest};
    client
        .send(&ClientMessage::Spawn(SpawnRequest {
            id: id.into(),
            command: command.into(),
            cwd: None,
            env: Default::default(),
            timeout: Some(60.0),
            profile: Some("strict".into()),
            pty: None,
            network: None,
        }))
        .await;
    match client.reply_for(id).await {
        ServerMessage::Spawned(_) => {}
        other => panic!("{id}: {other:?}"),
    }
    client
        .send(&ClientMessage::Wait(WaitRequest {
            id: id.into(),
            timeout: Some(60.0),
        }))
        .await;
    match client.reply_for(id).await {
        ServerMessage::Exited(e) => e,
        other => panic!("{id}: {other:?}"),
    }
}

#[tokio::test]
async fn a_daemon_that_cannot_have_volumes_says_why_in_the_hello_and_refuses_commands_naming_the_quota(
) {
    if !require("root (to start the daemon as another user)", is_root()) {
        return;
    }
    // Not root: no loop device can be attached. Control: the root daemons above have them.
    let quota = (16 * MIB).to_string();
    // Its state outside /tmp, which landlock (the profile a daemon not root can run) opens.
    let daemon = Daemon::start_opts(executor_tests::DaemonOptions {
        extra: vec!["--disk-quota-bytes".into(), quota],
        state_parent: Some("/var/tmp".into()),
        user: Some(65534),
        ..Default::default()
    });
    let mut client = daemon.connect().await;
    let info = &client.hello.disk_quota;
    assert_eq!(info.mechanism, "none", "{info:?}");
    assert!(
        info.reason.contains("cannot be had here") && info.reason.contains("not root"),
        "{info:?}"
    );
    let err = client
        .exec(in_profile("refused", "echo ran > f", "landlock"))
        .await
        .result
        .expect_err("ran without its quota");
    assert_eq!(
        err.code,
        protocol::ErrorCode::EnvironmentError,
        "{err:?} {:?}",
        client.hello.profiles
    );
    assert!(
        err.message.contains("disk quota") && err.message.contains("not root"),
        "{err:?}"
    );
    assert!(!Path::new(&client.hello.workspace).join("f").exists());
    assert!(mounts_under(daemon.state.path()).is_empty());
}
