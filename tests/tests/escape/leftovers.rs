//! What a command leaves behind cannot take the daemon down, now or at its next start. Scratch
//! workspaces of any depth are removed with a bounded stack and bounded descriptors (a
//! 25,000-deep tree overflowed a runtime thread's stack with std's `remove_dir_all` and aborted
//! the daemon with every client's commands; the next start then refused to run), and what
//! cannot be removed is set aside and logged, never in the way of a start. State directories
//! live on a tmpfs of the case's own: the test machines' disks discard on every removal, at
//! milliseconds a directory.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use executor_tests::{
    clients_file, eventually, process_state, Client, Daemon, DaemonOptions, Tmpfs, PATIENCE,
};
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use crate::common::*;

const DEEP: u32 = 25_000;
const EPH: &str = "ephemeral-token-0123456789abcdef012345";
const OTHER: &str = "other-token-0123456789abcdef0123456789a";

fn open_dir(parent: &OwnedFd, name: &str) -> nix::Result<OwnedFd> {
    nix::fcntl::openat(
        parent,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
}

/// Make `top/d/d/.../d`, `levels` deep, through descriptors (no path gets long).
fn build_deep(top: &Path, levels: u32) {
    std::fs::create_dir_all(top).unwrap();
    let mut level: OwnedFd = std::fs::File::open(top).unwrap().into();
    for _ in 0..levels {
        nix::sys::stat::mkdirat(&level, "d", Mode::S_IRWXU).unwrap();
        level = open_dir(&level, "d").unwrap();
    }
}

/// How many `d` directories nest below `top`, counted on the host.
fn depth_of(top: &Path) -> u32 {
    let Ok(file) = std::fs::File::open(top) else {
        return 0;
    };
    let mut level: OwnedFd = file.into();
    let mut depth = 0;
    while let Ok(next) = open_dir(&level, "d") {
        level = next;
        depth += 1;
    }
    depth
}

/// Makes a tree removable (`chattr -i`) and removes it with `rm -rf` when dropped, before the
/// daemon's state directory is (the harness's [`executor_tests::TempDir`], whose removal is
/// iterative: a tree this deep left behind cannot overflow the test's stack either).
struct RmRf(PathBuf);

impl Drop for RmRf {
    fn drop(&mut self) {
        let _ = std::process::Command::new("chattr")
            .args(["-R", "-i"])
            .arg(&self.0)
            .stderr(std::process::Stdio::null())
            .status();
        let _ = std::process::Command::new("rm")
            .arg("-rf")
            .arg(&self.0)
            .status();
    }
}

/// The daemon process lives and answers /healthz, and `client` still runs commands.
async fn still_serving(daemon: &Daemon, client: &mut Client) {
    let pid = daemon.pid() as i32;
    assert!(
        matches!(process_state(pid), Some(s) if s != 'Z'),
        "the daemon died: {}",
        daemon.log()
    );
    assert!(daemon.healthy().await, "no /healthz: {}", daemon.log());
    let alive = client.run("alive", "echo alive").await;
    assert_eq!(alive.output, "alive\n", "{alive:?}");
}

#[tokio::test]
async fn a_scratch_tree_25000_directories_deep_is_removed_and_the_daemon_stays_up() {
    if !executor_tests::require("root (tmpfs, strict)", executor_tests::is_root()) {
        return;
    }
    let _heavy = HEAVY.lock().await;
    let fs = Tmpfs::mount();
    let (_dir, clients) = clients_file(&serde_json::json!({"clients": [
        {"name": "eph", "token": EPH, "profiles": ["strict"], "workspace": "per_connection"},
        {"name": "other", "token": OTHER, "profiles": ["strict"]},
    ]}));
    let daemon = Daemon::start_opts(DaemonOptions {
        extra: vec!["--clients".into(), clients.display().to_string()],
        state_parent: Some(fs.path().to_path_buf()),
        ..Default::default()
    });
    let _rm = RmRf(daemon.state.path().join("workspaces"));
    let mut eph = Client::connect(&daemon.url, Some(EPH)).await.unwrap();
    let mut other = Client::connect(&daemon.url, Some(OTHER)).await.unwrap();
    let scratch = PathBuf::from(&eph.hello.workspace);
    let build = format!(
        "{PY} -c \"import os\nfor i in range({DEEP}): os.mkdir('d'); os.chdir('d')\nprint('built')\""
    );
    // Minutes on a busy machine (landlock checks walk the path up: quadratic in depth):
    // seen past 120 s at a load average of 12 on two cores.
    let built = run_with_timeout(&mut eph, STRICT, "deep", &build, 900.0).await;
    assert!(built.output.contains("built"), "{built:?}");
    assert_eq!(depth_of(&scratch), DEEP, "the tree on the host");

    // The session ends: its scratch is removed while the other client keeps working.
    eph.ws.close(None).await.unwrap();
    assert!(
        eventually(Duration::from_secs(600), || !scratch.exists()).await,
        "scratch still there, {} deep",
        depth_of(&scratch)
    );
    still_serving(&daemon, &mut other).await;
    let log = daemon.log();
    assert!(!log.contains("overflowed"), "{log}");
    assert!(!log.contains("cannot remove a session's scratch"), "{log}");
    // Control: the other client's shared workspace was never touched.
    assert!(daemon.workspace.is_dir());
}

#[tokio::test]
async fn leftovers_a_killed_daemon_could_not_remove_never_stop_the_next_start() {
    if !executor_tests::require("root (tmpfs, chattr)", executor_tests::is_root()) {
        return;
    }
    let _heavy = HEAVY.lock().await;
    let fs = Tmpfs::mount();
    // What a daemon killed mid-session leaves: a scratch tree far deeper than the descriptor
    // limit, and one holding a file nobody may remove (immutable).
    let stuck: std::sync::Arc<std::sync::Mutex<Option<PathBuf>>> = Default::default();
    let stuck_file = stuck.clone();
    let daemon = Daemon::start_opts(DaemonOptions {
        state_parent: Some(fs.path().to_path_buf()),
        prepare: Some(Box::new(move |state| {
            let sessions = state.join("workspaces/session");
            build_deep(&sessions.join("deep-session"), DEEP);
            let file = sessions.join("stuck-session/keep");
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(&file, "immutable").unwrap();
            let status = std::process::Command::new("chattr")
                .arg("+i")
                .arg(&file)
                .status()
                .unwrap();
            assert!(status.success(), "chattr +i");
            *stuck_file.lock().unwrap() = Some(file);
        })),
        ..Default::default()
    });
    let state = daemon.state.path().to_path_buf();
    let _rm = RmRf(state.join("workspaces"));
    let quarantine = state.join("workspaces/quarantine");
    let set_aside: Vec<PathBuf> = std::fs::read_dir(&quarantine)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    // It started and serves (start_opts waited for its ready line).
    let mut client = daemon.connect().await;
    still_serving(&daemon, &mut client).await;
    // The leftovers are out of the way of new sessions: nothing under the scratch root, the
    // unremovable file set aside (and said so in the log), the deep tree gone.
    let sessions = state.join("workspaces/session");
    assert!(
        std::fs::read_dir(&sessions).map_or(true, |mut d| d.next().is_none()),
        "scratch root still holds {:?}",
        std::fs::read_dir(&sessions).map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
    );
    assert_eq!(set_aside.len(), 1, "{set_aside:?}");
    assert!(
        set_aside[0].join("stuck-session/keep").exists(),
        "{set_aside:?}"
    );
    assert_eq!(depth_of(&set_aside[0].join("deep-session")), 0);
    // The log is written by a thread of its own: wait for the line.
    eventually(PATIENCE, || daemon.log().contains("set aside")).await;
    let log = daemon.log();
    assert!(log.contains("set aside"), "{log}");
    assert!(stuck.lock().unwrap().is_some());
}
