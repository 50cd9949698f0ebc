//! Cgroup directories reused among the commands of one template
//! (`sandbox/src/spawner/cgroup_pool.rs`), read on the host from `/proc/<pid>/cgroup` of each
//! command's process while it runs: commands of one client come back to directories an
//! earlier one ran in, never two at once, never another client's; a directory whose command
//! left a process behind or hit a limit is removed, never lent again, and the command after
//! it starts with no limit counted.

use std::collections::HashSet;

use executor_tests::{eventually, marker, processes_matching, Client, Daemon};

use crate::common::*;

const ALICE: &str = "alice-cgroups-token-0123456789abcdef0123";
const BOB: &str = "bob-cgroups-token-0123456789abcdef012345";

/// The command's cgroup2 directory as the host sees it (the `0::` line of its process).
fn cgroup_of(pid: i32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("0::").map(str::to_string))
}

/// Run `then` after a process that prints `ready` and sleeps a little (gone by itself, so the
/// command leaves nothing), and return the cgroup2 directory its process ran in and the
/// result. `then` runs before the sleep.
async fn run_seen(
    client: &mut Client,
    profile: &str,
    id: &str,
    then: &str,
) -> (String, protocol::ExecResult) {
    let m = marker();
    let command =
        format!("{then}\n{PY} -c 'import time; print(\"ready\", flush=True); time.sleep(0.4)' {m}");
    let (id, _) = start_until(client, profile, id, &command, "ready", 30.0).await;
    let mut dir = None;
    assert!(
        eventually(SETTLE, || {
            dir = processes_matching(&m).into_iter().find_map(cgroup_of);
            dir.is_some()
        })
        .await,
        "{id}: its process was not found"
    );
    let result = client.collect(&id).await.result.unwrap();
    (dir.unwrap_or_default(), result)
}

/// Fork 40 children that sleep 0.2 s, stopping at the first refusal, and reap them all.
const FORK_TO_THE_LIMIT: &str = "/usr/bin/python3 -c 'import os, time
for _ in range(40):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(0.2)
        os._exit(0)
while True:
    try:
        os.wait()
    except ChildProcessError:
        break'";

/// The last part of a cgroup path: the directory's name.
fn name(dir: &str) -> &str {
    dir.rsplit('/').next().unwrap_or_default()
}

/// A copy of `base` with a process limit of 16, so that a test reaches it in a moment.
fn small(profiles: &std::path::Path, base: &str) -> String {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("../sandbox-profiles/{base}.json")),
    )
    .unwrap();
    let mut profile: serde_json::Value = serde_json::from_str(&text).unwrap();
    let name = format!("{base}-16");
    profile["name"] = name.clone().into();
    profile["limits"]["processes"] = 16.into();
    std::fs::write(profiles.join(format!("{name}.json")), profile.to_string()).unwrap();
    name
}

#[tokio::test]
async fn a_cgroup_is_lent_again_only_clean_only_within_its_template_and_one_at_a_time() {
    let profiles = executor_tests::TempDir::new().unwrap();
    let small_landlock = small(profiles.path(), "landlock");
    let small_strict = small(profiles.path(), "strict");
    let Some(daemon) = profiles_daemon(profiles.path(), &[&small_landlock, &small_strict]) else {
        return;
    };
    let mut client = daemon.connect().await;
    let parent = format!("executor-{}-ns", daemon.pid());
    for profile in [small_landlock.as_str(), small_strict.as_str()] {
        // Commands that leave nothing come back to directories made for earlier ones.
        let mut seen = Vec::new();
        for i in 0..6 {
            let (dir, result) = run_seen(&mut client, profile, &format!("clean-{i}"), "").await;
            assert!(dir.contains(&parent), "{profile}: {dir}");
            assert!(result.extra.limits_hit.is_empty(), "{profile}: {result:?}");
            seen.push(dir);
        }
        let distinct: HashSet<&String> = seen.iter().collect();
        assert!(
            distinct.len() < seen.len(),
            "{profile}: never reused: {seen:?}"
        );

        // Two at once never share one.
        let mut other = daemon.connect().await;
        let m = marker();
        let hold =
            format!("{PY} -c 'import time; print(\"ready\", flush=True); time.sleep(1.5)' {m}");
        let (first, _) =
            start_until(&mut client, profile, "together-1", &hold, "ready", 30.0).await;
        let (second, _) =
            start_until(&mut other, profile, "together-2", &hold, "ready", 30.0).await;
        let mut dirs = HashSet::new();
        assert!(
            eventually(SETTLE, || {
                dirs = processes_matching(&m)
                    .into_iter()
                    .filter_map(cgroup_of)
                    .collect();
                dirs.len() >= 2
            })
            .await,
            "{profile}: two commands at once in {dirs:?}"
        );
        client.collect(&first).await.result.unwrap();
        other.collect(&second).await.result.unwrap();

        // A process left behind: its directory goes with it, and is never lent again. Three
        // times: under strict's pid namespace, init's exit or the helper's sweep kills the
        // leftover, whichever comes first, and neither may let the directory back.
        let mut left = Vec::new();
        for i in 0..3 {
            let (dir, result) =
                run_seen(&mut client, profile, &format!("left-{i}"), "sleep 100 &").await;
            assert_eq!(result.extra.killed_processes, 1, "{profile}: {result:?}");
            left.push(dir);
        }
        // A limit hit: the same, and the command after starts from no limit counted. Python
        // forks until refused and reaps what it made (bash may give up on the script when a
        // fork of its own stays refused, before the line that prints "ready").
        let (limited, result) = run_seen(&mut client, profile, "limited", FORK_TO_THE_LIMIT).await;
        assert_eq!(
            result.extra.limits_hit,
            ["processes"],
            "{profile}: {result:?}"
        );
        // On the host: gone (cgroup2 at /sys/fs/cgroup/unified on a hybrid host, else at
        // /sys/fs/cgroup).
        let exists = |dir: &str| {
            ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
                .iter()
                .any(|m| {
                    std::path::Path::new(m)
                        .join(dir.trim_start_matches('/'))
                        .is_dir()
                })
        };
        let gone: Vec<&String> = left.iter().chain([&limited]).collect();
        assert!(
            eventually(SETTLE, || gone.iter().all(|d| !exists(d))).await,
            "{profile}: one of {gone:?} is still there"
        );
        let mut last = String::new();
        for i in 0..6 {
            let (dir, result) = run_seen(&mut client, profile, &format!("after-{i}"), "").await;
            assert!(
                gone.iter().all(|d| name(&dir) != name(d)),
                "{profile}: lent again: {dir}"
            );
            assert!(result.extra.limits_hit.is_empty(), "{profile}: {result:?}");
            last = dir;
        }
        // Control: a clean command's directory stays on the host, for the next one.
        assert!(exists(&last), "{profile}: {last} is not on the host");
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn another_clients_commands_never_run_in_a_clients_cgroup() {
    if !executor_tests::require("root", executor_tests::is_root()) {
        return;
    }
    let client = |name: &str, token: &str| serde_json::json!({"name": name, "token": token, "profiles": ["strict", "landlock"], "workspace": "per_client"});
    let daemon: Daemon = clients_daemon(
        &serde_json::json!({"clients": [client("alice", ALICE), client("bob", BOB)]}),
        &[],
    )
    .unwrap();
    let mut alice = Client::connect(&daemon.url, Some(ALICE)).await.unwrap();
    let mut bob = Client::connect(&daemon.url, Some(BOB)).await.unwrap();
    for profile in [LANDLOCK, STRICT] {
        let (mut hers, mut his) = (Vec::new(), Vec::new());
        for i in 0..5 {
            hers.push(
                run_seen(&mut alice, profile, &format!("alice-{i}"), "")
                    .await
                    .0,
            );
            his.push(run_seen(&mut bob, profile, &format!("bob-{i}"), "").await.0);
        }
        let hers: HashSet<String> = hers.iter().map(|d| name(d).to_string()).collect();
        let his_names: HashSet<String> = his.iter().map(|d| name(d).to_string()).collect();
        assert!(
            hers.is_disjoint(&his_names),
            "{profile}: alice {hers:?} bob {his_names:?}"
        );
        // Control: each reuses its own.
        assert!(his_names.len() < his.len(), "{profile}: {his:?}");
    }
}
