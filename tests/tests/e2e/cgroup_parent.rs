//! `--cgroup-parent`: the cgroup2 directory the daemon makes its commands' cgroups in, and the
//! start-up message when the daemon may not create them there (the path, and how to fix it).

use std::path::{Path, PathBuf};

use executor_tests::{eventually, is_root, marker, require, Daemon, PATIENCE};

/// The host's cgroup2 mount point, from /proc/self/mountinfo.
fn cgroup2_mount() -> Option<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .ok()?
        .lines()
        .find(|l| {
            l.split_once(" - ")
                .is_some_and(|(_, r)| r.starts_with("cgroup2 "))
        })
        .and_then(|l| l.split_whitespace().nth(4).map(PathBuf::from))
}

/// Remove a cgroup directory and every cgroup below it (children first), waiting for the
/// processes of a killed daemon to leave them.
async fn remove_tree(dir: &Path) {
    eventually(PATIENCE, || {
        remove_once(dir);
        !dir.exists()
    })
    .await;
}

fn remove_once(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_once(&entry.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

const MESSAGE: &str = "cannot create the commands' parent cgroup";

#[tokio::test]
async fn a_cgroup_parent_the_daemon_cannot_create_in_is_named_at_start_with_the_fix() {
    let Some(mount) = cgroup2_mount() else {
        require("a cgroup2 mount", false);
        return;
    };
    if !require("root (cgroup directories)", is_root()) {
        return;
    }
    let m = marker();
    // Not there at all: nothing can be created below it.
    let missing = format!("/nonexistent-cgroup-parent-{m}");
    let daemon = Daemon::start_with(&["--cgroup-parent", &missing]);
    // The log is written by a thread of its own: wait for the line.
    eventually(PATIENCE, || daemon.log().contains(MESSAGE)).await;
    let log = daemon.log();
    let line = log
        .lines()
        .find(|l| l.contains(MESSAGE))
        .unwrap_or_else(|| panic!("no start-up message about {missing}:\n{log}"));
    assert!(line.contains(&missing), "the path is not named: {line}");
    for fix in ["--cgroup-parent", "Delegate=yes"] {
        assert!(line.contains(fix), "the fix {fix} is not named: {line}");
    }
    assert!(!Path::new(&missing).exists(), "{missing} was created");
    // The daemon still serves, without cgroup v2 placement.
    let mut client = daemon.connect().await;
    assert!(!client.hello.host.cgroups.kill, "{:?}", client.hello.host);
    assert_eq!(client.run("runs", "echo ran").await.output, "ran\n");
    drop(client);
    drop(daemon);

    // Control: a writable cgroup2 directory is used, and nothing is said.
    let writable = mount.join(format!("executor-e2e-parent-{m}"));
    std::fs::create_dir(&writable).unwrap();
    let daemon = Daemon::start_with(&["--cgroup-parent", writable.to_str().unwrap()]);
    let mut client = daemon.connect().await;
    assert!(client.hello.host.cgroups.kill, "{:?}", client.hello.host);
    assert_eq!(client.run("runs", "echo ran").await.output, "ran\n");
    let log = daemon.log();
    assert!(!log.contains(MESSAGE), "{log}");
    // From outside: the commands' parent lies in the named directory.
    let prefix = format!("executor-{}-ns", daemon.pid());
    let made: Vec<String> = std::fs::read_dir(&writable)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        made.iter().any(|n| n.starts_with(&prefix)),
        "no {prefix}* in {}: {made:?}",
        writable.display()
    );
    drop(client);
    drop(daemon);
    remove_tree(&writable).await;
}
