//! Which profile a local executor's commands run under, and that every entry point says so:
//! the agent chooses only strict or landlock by itself, and a directory neither can write
//! (a repository checked out as root, a SWE-bench `/testbed`) is an error with its ways out,
//! never a silent step down to task-container, whose commands write the host as root.

use std::os::unix::fs::PermissionsExt;

use executor_tests::{is_root, require};

use crate::{finish_one_shot, one_shot, Finished, Scratch};

/// What every entry point says in a directory neither strict nor landlock can write.
const NEITHER_WRITES: &str = "neither strict nor landlock can run commands that write";

/// `agent <args>` with no executor flags (a local executor) in `dir`, bounded.
async fn agent_in(dir: &std::path::Path, args: &[&str]) -> Finished {
    let child = one_shot().args(args).current_dir(dir).spawn().unwrap();
    finish_one_shot(child, &format!("agent {args:?} in {}", dir.display())).await
}

/// A directory only root may write, as a repository checked out by root is.
fn root_owned_dir() -> executor_tests::TempDir {
    let dir = executor_tests::TempDir::with_prefix("agent-rootdir-").unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_root_owned_directory_exec_refuses_with_the_ways_out_and_writes_nothing_on_the_host() {
    if !require("root", is_root()) {
        return;
    }
    let dir = root_owned_dir();
    let marker = format!("/usr/local/agent-fallback-{}", std::process::id());
    let refused = agent_in(
        dir.path(),
        &["exec", "--", &format!("touch {marker}; touch here")],
    )
    .await;
    assert_eq!(refused.code, 255, "{}", refused.stderr);
    let place = dir.path().display().to_string();
    for said in [
        format!("{NEITHER_WRITES} {place}"),
        "owned by root, mode 0755".to_string(),
        format!("strict: its commands cannot write {place}"),
        format!("landlock: its commands cannot write {place}"),
        format!("chown -R 65534:65534 {place}"),
        "--profile task-container".to_string(),
        "task-container and trusted write the host and run only when named".to_string(),
    ] {
        assert!(refused.stderr.contains(&said), "missing {said:?}");
    }
    // The command never ran, under any profile: nothing on the host, nothing in the directory.
    assert!(!std::path::Path::new(&marker).exists(), "{marker} written");
    assert!(!dir.path().join("here").exists());
    assert!(!refused.stderr.contains("profile \"task-container\""));

    // Named, task-container runs there as root (the ways out are real), and says why.
    let named = agent_in(
        dir.path(),
        &[
            "exec",
            "--profile",
            "task-container",
            "--",
            "id -u; touch here",
        ],
    )
    .await;
    assert_eq!(named.code, 0, "{}", named.stderr);
    assert_eq!(String::from_utf8_lossy(&named.stdout), "0\n");
    assert!(dir.path().join("here").exists());
    assert!(
        named
            .stderr
            .contains("executor: profile \"task-container\" (named with --profile)"),
        "{}",
        named.stderr
    );

    // Control: a directory uid 65534 may write gets strict, chosen and said with its reason.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let chosen = agent_in(dir.path(), &["exec", "--", "id -u"]).await;
    assert_eq!(chosen.code, 0, "{}", chosen.stderr);
    assert_eq!(String::from_utf8_lossy(&chosen.stdout), "65534\n");
    assert!(
        chosen.stderr.contains(&format!(
            "executor: profile \"strict\" (the strongest of strict > landlock whose commands \
             can write {place}; task-container and trusted run only when named); layers: "
        )),
        "{}",
        chosen.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_run_cp_and_shell_also_refuse_a_root_owned_directory_and_say_their_profile_elsewhere()
{
    if !require("root", is_root()) {
        return;
    }
    let dir = root_owned_dir();
    let s = Scratch::new();
    let script = s.write("s.yaml", "- command: touch made\n");
    let script = script.display().to_string();
    let traj = s.traj().display().to_string();
    let run = agent_in(
        dir.path(),
        &[
            "run", "-m", "scripted", "--script", &script, "--task", "t", "-o", &traj,
        ],
    )
    .await;
    assert_ne!(run.code, 0);
    assert!(run.stderr.contains(NEITHER_WRITES), "{}", run.stderr);
    assert!(!dir.path().join("made").exists());
    let source = s.write("f.txt", "x\n");
    let cp = agent_in(dir.path(), &["cp", source.to_str().unwrap(), ":f.txt"]).await;
    assert_eq!(cp.code, 255);
    assert!(cp.stderr.contains(NEITHER_WRITES), "{}", cp.stderr);
    assert!(!dir.path().join("f.txt").exists());
    let shell = agent_in(dir.path(), &["shell", "--", "true"]).await;
    assert_eq!(shell.code, 255);
    assert!(shell.stderr.contains(NEITHER_WRITES), "{}", shell.stderr);

    // Controls, in a directory strict can write: each says the profile it chose.
    let open = s.path();
    let cp = agent_in(open, &["cp", source.to_str().unwrap(), ":copied.txt"]).await;
    assert_eq!(cp.code, 0, "{}", cp.stderr);
    assert_eq!(
        std::fs::read_to_string(open.join("copied.txt")).unwrap(),
        "x\n"
    );
    let shell = agent_in(open, &["shell", "--", "echo in-shell"]).await;
    assert_eq!(shell.code, 0, "{}", shell.stderr);
    for stderr in [&cp.stderr, &shell.stderr] {
        assert!(
            stderr.contains("executor: profile \"strict\" (the strongest of strict > landlock"),
            "{stderr}"
        );
    }
}
