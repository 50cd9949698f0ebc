//! Where a command's processes sit, read on the host from `/proc/<pid>/cgroup` while it runs:
//! in a cgroup of the command's own in every hierarchy the host limits it by (the cgroup2 one,
//! and the v1 `pids` and `memory` hierarchies where the controllers live there, which the
//! helper joins through v1's `tasks` file, `sandbox/src/cgroup.rs` `join`), with the profile's
//! limits written there; and the helper that made the command back in the daemon's (or the
//! one-shot run's) own cgroups, so that killing the command's never kills it. Control: the
//! daemon and the test itself are in none of the command's.

use std::process::Stdio;

use executor_tests::checks::{cancel, preq};
use executor_tests::host_waits::{send_signal, sleepers_gone, sleepers_up};
use executor_tests::{
    eventually, is_root, marked_sleep, marker, parent_of, require, sleepers, Daemon, PATIENCE,
};
use nix::sys::signal::Signal;
use protocol::ClientMessage;

use crate::host_cgroups::{hierarchies, paths_of, run_cgroup_dirs};
use crate::run_local::executor_run;

/// Check the placement of the command whose sleeper is `sleeper`, made by a daemon (or run)
/// whose own process is `owner`, under `profile`. `one_command`: the owner is a one-shot
/// run, whose own directory (`executor-<pid>-ns<ns>`) is its one command's; a daemon's
/// commands each have one below it.
fn assert_placed(sleeper: i32, owner: i32, profile: &str, one_command: bool) {
    let places = hierarchies();
    assert!(
        places.contains_key("0") || places.contains_key("pids"),
        "no cgroup hierarchy on this host"
    );
    let command = paths_of(sleeper);
    let own = paths_of(owner);
    let test = paths_of(std::process::id() as i32);
    let limits: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join(format!("../sandbox-profiles/{profile}.json")),
        )
        .unwrap(),
    )
    .unwrap();
    let processes = limits["limits"]["processes"].as_u64().unwrap();
    let memory = limits["limits"]["memory_mb"].as_u64().unwrap() << 20;
    for (key, mount) in &places {
        let path = &command[key];
        // Its own: below the daemon's (`executor-<pid>-ns<ns>/...`), not the daemon's nor
        // the test's.
        assert!(
            path.contains(&format!("/executor-{owner}-ns")),
            "[{profile}] hierarchy {key}: the command is in {path}, not one of the daemon's \
             command cgroups (the daemon is in {:?})",
            own.get(key)
        );
        let run_dir = format!("executor-{owner}-ns");
        let mut up = path.rsplit('/');
        let (last, above) = (up.next().unwrap_or_default(), up.next().unwrap_or_default());
        if one_command {
            assert!(
                last.starts_with(&run_dir),
                "[{profile}] hierarchy {key}: the one-shot's command is in {path}, not in the \
                 run's own directory"
            );
        } else {
            assert!(
                above.starts_with(&run_dir) && !last.is_empty(),
                "[{profile}] hierarchy {key}: the daemon's command is in {path}, not in a \
                 directory of its own below the daemon's"
            );
        }
        assert_ne!(Some(path), own.get(key), "[{profile}] {key}");
        assert_ne!(Some(path), test.get(key), "[{profile}] {key}");
        let dir = format!("{mount}{path}");
        let listed = std::fs::read_to_string(format!("{dir}/cgroup.procs")).unwrap();
        assert!(
            listed.lines().any(|l| l.trim() == sleeper.to_string()),
            "[{profile}] {dir} does not list the command: {listed}"
        );
        // The limits, in whichever hierarchy holds each controller.
        let read = |file: &str| std::fs::read_to_string(format!("{dir}/{file}")).ok();
        if key == "pids" || (key == "0" && !places.contains_key("pids")) {
            assert_eq!(
                read("pids.max").as_deref().map(str::trim),
                Some(processes.to_string().as_str()),
                "[{profile}] {dir}"
            );
        }
        if key == "memory" {
            assert_eq!(
                read("memory.limit_in_bytes").as_deref().map(str::trim),
                Some(memory.to_string().as_str()),
                "[{profile}] {dir}"
            );
        } else if key == "0" && !places.contains_key("memory") {
            assert_eq!(
                read("memory.max").as_deref().map(str::trim),
                Some(memory.to_string().as_str()),
                "[{profile}] {dir}"
            );
        }
    }
    // Up from the sleeper: the first process outside the command's cgroups is its helper,
    // and it is back in the owner's own in every hierarchy.
    let mut pid = sleeper;
    let helper = loop {
        let parent = parent_of(pid).unwrap();
        assert_ne!(parent, 0, "[{profile}] no helper above the command");
        if paths_of(parent).get("0") != command.get("0")
            || paths_of(parent).get("pids") != command.get("pids")
        {
            break parent;
        }
        pid = parent;
    };
    for key in places.keys() {
        assert_eq!(
            paths_of(helper).get(key),
            own.get(key),
            "[{profile}] the helper {helper} is not back in the daemon's cgroup of {key}"
        );
    }
}

#[tokio::test]
async fn a_daemons_command_runs_in_cgroups_of_its_own_in_every_hierarchy_and_its_helper_does_not() {
    if !require("root", is_root()) {
        return;
    }
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    for profile in ["landlock", "strict"] {
        let m = marker();
        client
            .send(&ClientMessage::Exec(preq(
                Some(profile),
                profile,
                &marked_sleep(&m),
                30.0,
            )))
            .await;
        assert!(
            sleepers_up(&m, 1).await,
            "[{profile}] the command did not start"
        );
        assert_placed(sleepers(&m)[0], daemon.pid() as i32, profile, false);
        cancel(&mut client, profile).await;
        assert!(sleepers_gone(&m).await);
    }
}

#[tokio::test]
async fn a_one_shot_runs_its_command_in_cgroups_of_its_own_and_its_helper_does_not() {
    if !require("root", is_root()) {
        return;
    }
    for profile in ["landlock", "strict"] {
        let m = marker();
        let mut run = executor_run(profile, &[], &marked_sleep(&m))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        assert!(
            sleepers_up(&m, 1).await,
            "[{profile}] the command did not start"
        );
        assert_placed(sleepers(&m)[0], run.id() as i32, profile, true);
        run.kill().unwrap();
        run.wait().unwrap();
        assert!(sleepers_gone(&m).await);
    }
}

#[tokio::test]
async fn a_one_shot_leaves_no_cgroup_directory_behind() {
    if !require("root", is_root()) {
        return;
    }
    let places = hierarchies();
    for profile in ["landlock", "strict"] {
        let mut run = executor_run(profile, &[], "exit 3")
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let pid = run.id();
        assert_eq!(run.wait().unwrap().code(), Some(3), "[{profile}]");
        // Those still busy with the command's init on its way out (its namespaces' teardown)
        // are removed by the run's fork server just after the run exits.
        assert!(
            eventually(PATIENCE, || run_cgroup_dirs(pid).is_empty()).await,
            "[{profile}] left behind: {:?}",
            run_cgroup_dirs(pid)
        );
    }
    // Control: a run whose command still runs has one in every hierarchy; interrupted, it
    // removes them too.
    let m = marker();
    let mut run = executor_run("landlock", &[], &marked_sleep(&m))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = run.id();
    assert!(
        sleepers_up(&m, 1).await,
        "control: the command did not start"
    );
    assert_eq!(
        run_cgroup_dirs(pid).len(),
        places.len(),
        "control: {:?}",
        run_cgroup_dirs(pid)
    );
    send_signal(pid as i32, Signal::SIGINT);
    run.wait().unwrap();
    assert!(
        sleepers(&m).is_empty(),
        "control: the command outlived its run"
    );
    assert!(
        eventually(PATIENCE, || run_cgroup_dirs(pid).is_empty()).await,
        "control: left behind: {:?}",
        run_cgroup_dirs(pid)
    );
}
