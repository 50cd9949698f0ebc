//! Clients against each other: one command holds a secret in /tmp and a running process;
//! another client's command looks for both, changes its limits and priority, plants
//! configuration its programs read, or runs beside it as the same uid. Controls: the shared
//! workspace is shared, as it must be for an agent, and each call works on the command itself.

use executor_tests::{eventually, marked_sleep, marker, process_state, sleepers, Client, Daemon};

use crate::common::*;

#[tokio::test]
async fn another_clients_tmp_and_processes_are_invisible_under_strict() {
    let Some(daemon) = daemon() else {
        return;
    };
    let mut alice = daemon.connect().await;
    let mut bob = daemon.connect().await;
    let m = marker();
    let before =
        format!("echo tmp-secret-{m} > /tmp/secret-{m}; echo ws-shared-{m} > shared-{m}; ");
    let (alice_id, alice_sleep) =
        start_sleeper(&mut alice, STRICT, "alice", &m, &before, 60.0).await;
    let out = run_in(
        &mut bob,
        STRICT,
        "bob",
        &format!(
            "cat /tmp/secret-{m}; echo tmp_rc=$?; cat shared-{m}; \
             ps -eo args= | grep -c '^sleep [3]600.{m}' | sed 's/^/seen=/'; \
             pkill -KILL -f '^sleep [3]600.{m}'; echo pkill_rc=$?"
        ),
    )
    .await
    .output;
    assert!(
        !out.contains(&format!("tmp-secret-{m}")),
        "[strict] bob read alice's /tmp: {out}"
    );
    assert_ne!(field(&out, "tmp_rc"), Some("0"), "[strict] {out}");
    // The bracket keeps grep and bob's own shell from matching themselves.
    assert_eq!(
        field(&out, "seen"),
        Some("0"),
        "[strict] bob sees alice's process: {out}"
    );
    assert!(
        alive(alice_sleep),
        "[strict] bob killed alice's process: {out}"
    );
    // Control: the workspace is shared between the two clients.
    assert!(
        out.contains(&format!("ws-shared-{m}")),
        "[strict] control: {out}"
    );
    // The host's /tmp never saw alice's file either.
    assert!(!std::path::Path::new(&format!("/tmp/secret-{m}")).exists());
    cancel(&mut alice, &alice_id).await;
    assert!(eventually(SETTLE, || sleepers(&m).is_empty()).await);
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn landlock_commands_share_tmp_but_cannot_signal_each_other() {
    // Landlock's threat model: /tmp is shared and processes are visible, but signals stay
    // inside each command.
    let Some(daemon) = daemon() else {
        return;
    };
    let mut alice = daemon.connect().await;
    let mut bob = daemon.connect().await;
    let m = marker();
    let before = format!("echo tmp-note-{m} > /tmp/note-{m}; ");
    let (alice_id, alice_sleep) =
        start_sleeper(&mut alice, LANDLOCK, "alice", &m, &before, 60.0).await;
    let out = run_in(
        &mut bob,
        LANDLOCK,
        "bob",
        &format!(
            "cat /tmp/note-{m}; kill -KILL {p}; echo kill_rc=$?; \
             sleep 30 & kill -KILL $!; echo own_rc=$?",
            p = alice_sleep
        ),
    )
    .await
    .output;
    // As documented: shared /tmp.
    assert!(out.contains(&format!("tmp-note-{m}")), "[landlock] {out}");
    assert_ne!(
        field(&out, "kill_rc"),
        Some("0"),
        "[landlock] bob signalled alice: {out}"
    );
    assert_eq!(
        field(&out, "own_rc"),
        Some("0"),
        "[landlock] control: {out}"
    );
    assert!(alive(alice_sleep), "[landlock] alice's process died");
    cancel(&mut alice, &alice_id).await;
    let _ = std::fs::remove_file(format!("/tmp/note-{m}"));
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn strict_tmp_is_gone_with_its_command() {
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let m = marker();
    let first = run_in(
        &mut client,
        STRICT,
        "write",
        &format!("echo left-{m} > /tmp/left-{m} && cat /tmp/left-{m}"),
    )
    .await;
    // Control: the write worked inside the command.
    assert_eq!(first.output, format!("left-{m}\n"));
    let second = run_in(
        &mut client,
        STRICT,
        "read",
        &format!("cat /tmp/left-{m}; echo rc=$?"),
    )
    .await
    .output;
    assert!(
        !second.contains(&format!("left-{m}\n")),
        "[strict] {second}"
    );
    assert!(!std::path::Path::new(&format!("/tmp/left-{m}")).exists());
    assert_daemon_intact(&daemon).await;
}

/// Create a SysV shared memory segment on the host, mode 0666, holding `content`; returns its id.
fn host_shm(key: i64, content: &str) -> i64 {
    let script = format!(
        r#"
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
i = libc.shmget({key}, 4096, 0o1666)
a = libc.shmat(i, None, 0)
ctypes.memmove(a, b"{content}", {len})
libc.shmdt(ctypes.c_void_p(a))
print(i)
"#,
        len = content.len()
    );
    let out = std::process::Command::new(PY)
        .arg("-c")
        .arg(script)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

#[tokio::test]
async fn host_sysv_shared_memory_is_out_of_reach() {
    // An IPC endpoint of the host (design section 5: no host IPC endpoints). strict and
    // task-container have IPC namespaces; landlock has none and landlock cannot restrict
    // SysV IPC, so only seccomp could close it there.
    let Some(daemon) = daemon() else {
        return;
    };
    let m = marker();
    let key: i64 = 0x5e_0000 + m[m.len() - 5..].parse::<i64>().unwrap();
    let content = format!("hostshm-{m}");
    let id = host_shm(key, &content);
    struct Rm(i64);
    impl Drop for Rm {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ipcrm")
                .args(["-m", &self.0.to_string()])
                .status();
        }
    }
    let _rm = Rm(id);
    let probe = python(&format!(
        r#"
libc.shmat.restype = ctypes.c_void_p
i = libc.shmget({key}, 0, 0)
if i < 0:
    print(f"shmget_errno={{ctypes.get_errno()}}")
else:
    a = libc.shmat(i, None, 0o10000)   # SHM_RDONLY
    if a in (None, ctypes.c_void_p(-1).value):
        print(f"shmat_errno={{ctypes.get_errno()}}")
    else:
        print("read=" + ctypes.string_at(a, {len}).decode(errors="replace"))
"#,
        len = content.len()
    ));
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let out = row.output(client, "shm", &probe).await;
        row.check_contains(&out, &content, "read the host's shared memory");
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn host_posix_shared_memory_is_out_of_reach() {
    // POSIX shared memory lives in /dev/shm: strict mounts a private one; landlock's profile
    // reads all of /dev, the host's /dev/shm included.
    let Some(daemon) = daemon() else {
        return;
    };
    let m = marker();
    let path = format!("/dev/shm/escape-{m}");
    let content = format!("posixshm-{m}");
    std::fs::write(&path, &content).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let _rm = RemoveOnDrop(path.clone().into());
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let out = row
            .output(client, "posixshm", &format!("cat {path}; echo rc=$?"))
            .await;
        row.check_contains(&out, &content, "read the host's /dev/shm");
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

/// What the host says of `pid`'s limits, nice value, scheduling policy and CPUs.
fn host_view(pid: i32) -> (String, String, String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap_or_default();
    let pick = |name: &str| {
        limits
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_default()
            .to_string()
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rfind(')')
        .map(|i| stat[i + 2..].split_whitespace().collect())
        .unwrap_or_default();
    // After the command name: field 19 of stat(5) is nice, 41 the policy.
    let nice_policy = format!(
        "nice={} policy={}",
        fields.get(16).unwrap_or(&"?"),
        fields.get(38).unwrap_or(&"?")
    );
    let cpus = executor_tests::proc_status(pid, "Cpus_allowed_list:").unwrap_or_default();
    (
        pick("Max cpu time"),
        pick("Max open files"),
        nice_policy,
        cpus,
    )
}

#[tokio::test]
async fn landlock_commands_cannot_change_another_commands_limits_priority_or_scheduling() {
    // Without a pid namespace, another client's process (same uid 65534) is reachable by pid,
    // and the kernel checks only the uid for these calls: `prlimit --pid P --cpu=1:1` killed
    // it, `--nofile=3:3` starved it; renice, taskset, chrt and ionice worked too.
    let Some(daemon) = daemon() else {
        return;
    };
    let mut alice = daemon.connect().await;
    let mut bob = daemon.connect().await;
    let m = marker();
    let (alice_id, _) = start_until(
        &mut alice,
        LANDLOCK,
        "victim",
        &format!("echo ready; exec {}", marked_sleep(&m)),
        "ready",
        120.0,
    )
    .await;
    let victim = wait_sleepers(&m, 1).await[0];
    let before = host_view(victim);
    let p = victim;
    let out = run_in(
        &mut bob,
        LANDLOCK,
        "meddle",
        &format!(
            "prlimit --pid {p} --cpu=1:1; echo cpu=$?; prlimit --pid {p} --nofile=3:3; echo nofile=$?; \
             renice -n 10 -p {p}; echo renice=$?; taskset -p 1 {p}; echo taskset=$?; \
             chrt -i -p 0 {p}; echo chrt=$?; ionice -c 3 -p {p}; echo ionice=$?; \
             prlimit --cpu=100:100 true; echo own_prlimit=$?; nice -n 5 true; echo own_nice=$?; \
             taskset -c 0 true; echo own_taskset=$?; chrt -i 0 true; echo own_chrt=$?; \
             ionice -c 3 true; echo own_ionice=$?"
        ),
    )
    .await
    .output;
    for call in ["cpu", "nofile", "renice", "taskset", "chrt", "ionice"] {
        assert_ne!(
            field(&out, call),
            Some("0"),
            "[landlock] {call} on another command: {out}"
        );
    }
    // Control: the same calls on the command itself work.
    for call in [
        "own_prlimit",
        "own_nice",
        "own_taskset",
        "own_chrt",
        "own_ionice",
    ] {
        assert_eq!(
            field(&out, call),
            Some("0"),
            "[landlock] control {call}: {out}"
        );
    }
    // On the host: the victim lives, with its limits, priority, policy and CPUs unchanged.
    assert!(matches!(process_state(victim), Some(s) if s != 'Z'));
    assert_eq!(host_view(victim), before, "[landlock] {out}");
    // Control: the host-side view does see a change when one is made (trusted is root).
    let ctl = run_in(&mut bob, TRUSTED, "renice", &format!("renice -n 7 -p {p}")).await;
    assert_eq!(ctl.returncode, 0, "{ctl:?}");
    assert_ne!(
        host_view(victim).2,
        before.2,
        "control: renice shows on the host"
    );
    cancel(&mut alice, &alice_id).await;
    assert_daemon_intact(&daemon).await;
}

const ALICE: &str = "alice-token-0123456789abcdef0123456789";
const BOB: &str = "bob-token-0123456789abcdef0123456789abc";
const MALLORY: &str = "mallory-token-0123456789abcdef012345678";

/// A daemon with two landlock clients, alice and bob (each with a workspace of its own when
/// `workspace` names a policy), and a connection of each; `None` where root is missing.
async fn alice_and_bob(workspace: Option<&str>) -> Option<(Daemon, Client, Client)> {
    if !executor_tests::require("root", executor_tests::is_root()) {
        return None;
    }
    let client = |name: &str, token: &str| {
        let mut entry = serde_json::json!({"name": name, "token": token, "profiles": ["landlock"]});
        if let Some(policy) = workspace {
            entry["workspace"] = policy.into();
        }
        entry
    };
    let daemon = clients_daemon(
        &serde_json::json!({"clients": [client("alice", ALICE), client("bob", BOB)]}),
        &[],
    )
    .unwrap();
    let alice = Client::connect(&daemon.url, Some(ALICE)).await.unwrap();
    let bob = Client::connect(&daemon.url, Some(BOB)).await.unwrap();
    Some((daemon, alice, bob))
}

#[tokio::test]
async fn landlock_clients_each_have_a_home_no_other_client_can_plant_configuration_in() {
    // HOME was /tmp for every landlock command: alice wrote /tmp/.gitconfig (core.fsmonitor)
    // and a .pth file in /tmp/.local, and bob's next `git status` and `python3` ran them.
    let Some((daemon, mut alice, mut bob)) = alice_and_bob(None).await else {
        return;
    };
    let m = marker();
    let hook = format!("/tmp/hook-{m}");
    let pth = format!("/tmp/pth-{m}");
    let homes = daemon.state.path().join("workspaces/home");
    let plant = format!(
        "echo HOME=$HOME; git config --global core.fsmonitor 'echo ran > {hook}-hook; false'; \
         site=$({PY} -m site --user-site); mkdir -p $site && \
         echo \"import os; open('{pth}-' + os.environ.get('WHO', '?'), 'w')\" > $site/zz.pth; echo pth=$?; \
         for d in /tmp {h}/bob; do cp $HOME/.gitconfig $d/.gitconfig; echo copy=$?; done",
        h = homes.display()
    );
    let planted = run_in(&mut alice, LANDLOCK, "plant", &plant).await.output;
    assert_eq!(field(&planted, "pth"), Some("0"), "{planted}");
    // Bob's git and python, in a repository of the shared workspace.
    let victim = format!(
        "echo HOME=$HOME; git init -q repo-{m} && cd repo-{m} && git status >/dev/null; \
         WHO=bob {PY} -c pass; echo done"
    );
    let ran = run_in(&mut bob, LANDLOCK, "victim", &victim).await.output;
    assert!(ran.contains("done"), "{ran}");
    assert_ne!(
        field(&planted, "HOME"),
        field(&ran, "HOME"),
        "{planted} / {ran}"
    );
    assert!(
        !homes.join("bob/.gitconfig").exists(),
        "alice wrote into bob's home: {planted}"
    );
    let stray = |prefix: &str| {
        std::fs::read_dir("/tmp")
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect::<Vec<_>>()
    };
    assert!(
        stray(&format!("hook-{m}")).is_empty() && stray(&format!("pth-{m}")).is_empty(),
        "bob ran alice's configuration: {:?} {:?}",
        stray(&format!("hook-{m}")),
        stray(&format!("pth-{m}"))
    );
    // Control: alice's own git and python do run what she planted, so the vectors are real.
    let own = format!(
        "git init -q own-{m} && cd own-{m} && git status >/dev/null; WHO=alice {PY} -c pass; echo done"
    );
    run_in(&mut alice, LANDLOCK, "own", &own).await;
    assert!(
        !stray(&format!("hook-{m}")).is_empty(),
        "control: fsmonitor hook"
    );
    assert_eq!(stray(&format!("pth-{m}")), [format!("pth-{m}-alice")]);
    for name in stray(&format!("hook-{m}"))
        .into_iter()
        .chain(stray(&format!("pth-{m}")))
    {
        let _ = std::fs::remove_file(std::path::Path::new("/tmp").join(name));
    }
    let _ = std::fs::remove_file("/tmp/.gitconfig");
}

#[tokio::test]
async fn landlock_clients_each_have_a_tmpdir_no_other_client_can_read() {
    // /tmp is the host's under landlock (no mount namespace): a program's temporary files
    // (mktemp, Python's tempfile, compilers) go to TMPDIR, which is in the client's own home.
    let Some((daemon, mut alice, mut bob)) = alice_and_bob(None).await else {
        return;
    };
    let made = run_in(
        &mut alice,
        LANDLOCK,
        "mktemp",
        &format!("f=$(mktemp); echo secret > $f; echo file=$f; echo py=$({PY} -c 'import tempfile; print(tempfile.gettempdir())')"),
    )
    .await
    .output;
    let file = field(&made, "file")
        .expect("mktemp printed its file")
        .to_string();
    let alice_tmp = daemon.state.path().join("workspaces/home/alice/tmp");
    assert!(
        std::path::Path::new(&file).starts_with(&alice_tmp),
        "{made}"
    );
    assert_eq!(
        field(&made, "py"),
        Some(alice_tmp.to_str().unwrap()),
        "{made}"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "secret\n");
    let tried = run_in(
        &mut bob,
        LANDLOCK,
        "peek",
        &format!(
            "echo tmp=$TMPDIR; cat {file}; echo cat=$?; ls {}; echo ls=$?",
            alice_tmp.display()
        ),
    )
    .await
    .output;
    assert!(!tried.contains("secret"), "{tried}");
    assert_ne!(field(&tried, "cat"), Some("0"), "{tried}");
    assert_ne!(field(&tried, "ls"), Some("0"), "{tried}");
    assert_eq!(
        field(&tried, "tmp"),
        daemon.state.path().join("workspaces/home/bob/tmp").to_str(),
        "{tried}"
    );
    // Control: alice reads her own temporary file.
    let own = run_in(&mut alice, LANDLOCK, "own", &format!("cat {file}"))
        .await
        .output;
    assert_eq!(own, "secret\n");
}

#[tokio::test]
async fn private_clients_run_as_uids_of_their_own() {
    // Clients with private workspaces are kept apart by the kernel's uid checks too, not only
    // by landlock and seccomp: each runs as a uid of its own, which owns its workspace.
    if !executor_tests::require("root", executor_tests::is_root()) {
        return;
    }
    let daemon = clients_daemon(
        &serde_json::json!({"clients": [
            {"name": "alice", "token": ALICE, "profiles": ["strict", "landlock"], "workspace": "per_client"},
            {"name": "bob", "token": BOB, "profiles": ["strict", "landlock"], "workspace": "per_client", "uid": 61000},
            {"name": "carol", "token": MALLORY, "profiles": ["strict", "landlock"]},
        ]}),
        &[],
    )
    .unwrap();
    let mut uids = Vec::new();
    for token in [ALICE, BOB, MALLORY] {
        let mut client = Client::connect(&daemon.url, Some(token)).await.unwrap();
        let mut seen = Vec::new();
        for profile in [STRICT, LANDLOCK] {
            let m = marker();
            let (id, _) = start_until(
                &mut client,
                profile,
                "uid",
                &format!("touch mine; echo ready; exec {}", marked_sleep(&m)),
                "ready",
                60.0,
            )
            .await;
            let pid = wait_sleepers(&m, 1).await[0];
            // On the host: the process's uid, and the owner of what it wrote.
            let uid: u32 = executor_tests::proc_status(pid, "Uid:")
                .unwrap()
                .split_whitespace()
                .next()
                .unwrap()
                .parse()
                .unwrap();
            seen.push(uid);
            cancel(&mut client, &id).await;
        }
        assert_eq!(
            seen[0], seen[1],
            "the same identity under strict and landlock"
        );
        use std::os::unix::fs::MetadataExt;
        let owner = std::fs::metadata(std::path::Path::new(&client.hello.workspace).join("mine"))
            .unwrap()
            .uid();
        assert_eq!(owner, seen[0], "its files belong to it");
        uids.push(seen[0]);
    }
    let (alice, bob, carol) = (uids[0], uids[1], uids[2]);
    assert_ne!(alice, bob);
    assert_eq!(bob, 61000, "the uid the clients file names");
    assert!(!(0..1000).contains(&alice) && alice != 65534, "{alice}");
    // Control: a client sharing the daemon's workspace runs as the profile's identity.
    assert_eq!(carol, 65534);
}

#[tokio::test]
async fn private_landlock_clients_cannot_list_stat_or_read_each_others_files() {
    // landlock does not restrict stat, readlink or inotify, and /tmp is shared: what keeps two
    // private-workspace clients apart there is their own uids and the files' modes.
    let Some((_daemon, mut alice, mut bob)) = alice_and_bob(Some("per_client")).await else {
        return;
    };
    let m = marker();
    let shared = format!("/tmp/alice-{m}");
    let workspace = alice.hello.workspace.clone();
    let made = run_in(
        &mut alice,
        LANDLOCK,
        "plant",
        &format!("umask 077; echo secret > {shared}; echo secret > notes-{m}; echo rc=$?"),
    )
    .await
    .output;
    assert_eq!(field(&made, "rc"), Some("0"), "{made}");
    let probe = |who: &str| {
        format!(
            "cat {shared}; echo cat=$?; echo x >> {shared}; echo append=$?; \
             stat -c %s {workspace}/notes-{m}; echo stat=$?; ls {workspace}; echo ls=$?; \
             echo {who}"
        )
    };
    let tried = run_in(&mut bob, LANDLOCK, "peek", &probe("bob"))
        .await
        .output;
    assert!(!tried.contains("secret"), "{tried}");
    for step in ["cat", "append", "stat", "ls"] {
        assert_ne!(field(&tried, step), Some("0"), "bob's {step}: {tried}");
    }
    // On the host: alice's file is still hers and unchanged.
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(&shared).unwrap();
    assert_eq!(std::fs::read_to_string(&shared).unwrap(), "secret\n");
    assert_ne!(meta.uid(), 65534, "alice runs as a uid of her own");
    // Control: alice reaches both herself.
    let own = run_in(&mut alice, LANDLOCK, "own", &probe("alice"))
        .await
        .output;
    for step in ["cat", "append", "stat", "ls"] {
        assert_eq!(field(&own, step), Some("0"), "alice's {step}: {own}");
    }
    let _ = std::fs::remove_file(&shared);
}

#[tokio::test]
async fn a_profile_that_writes_what_others_run_cannot_serve_beside_a_private_workspace() {
    // task-container writes the host's /usr, which strict and landlock execute from: a
    // task-container client wrote /usr/local/sbin/ls and the next `ls` of a strict client ran
    // it, in that client's private workspace. Such a combination is refused.
    if !executor_tests::require("root", executor_tests::is_root()) {
        return;
    }
    let alice = serde_json::json!({"name": "alice", "token": ALICE, "profiles": ["strict", "landlock"], "workspace": "per_client"});
    let m = marker();
    let planted = format!("/usr/local/sbin/ls-{m}");
    for writer in ["task-container", "trusted"] {
        let refused = clients_daemon(
            &serde_json::json!({"clients": [
                alice.clone(),
                {"name": "mallory", "token": MALLORY, "profiles": ["strict", writer]},
            ]}),
            &executor_tests::ALLOW_ALL_PROFILES,
        );
        let log = refused
            .err()
            .unwrap_or_else(|| panic!("{writer}: the daemon started"));
        assert!(
            log.contains(&format!("client \"mallory\" may use profile \"{writer}\""))
                && log.contains("private workspace"),
            "{writer}: {log}"
        );
    }
    // A copy of task-container made to look tamer (its `/` grant removed) still shows the
    // host's root writable: not offered unless named, and refused beside a private client
    // when named.
    let profiles = executor_tests::TempDir::new().unwrap();
    let mut tamer: serde_json::Value = serde_json::from_str(include_str!(
        "../../../sandbox-profiles/task-container.json"
    ))
    .unwrap();
    tamer["name"] = "tamer".into();
    tamer["filesystem"]["writable"]
        .as_array_mut()
        .unwrap()
        .retain(|g| g["path"] != "/");
    std::fs::write(profiles.path().join("tamer.json"), tamer.to_string()).unwrap();
    let dir = profiles.path().display().to_string();
    let named = [
        "--allow-profile",
        "tamer",
        "--allow-profile",
        "strict",
        "--allow-profile",
        "landlock",
    ];
    for allow in [&[][..], &named[..]] {
        let mut extra = vec!["--profiles-dir", dir.as_str()];
        extra.extend_from_slice(allow);
        let log = clients_daemon(
            &serde_json::json!({"clients": [
                alice.clone(),
                {"name": "mallory", "token": MALLORY, "profiles": ["strict", "tamer"]},
            ]}),
            &extra,
        )
        .err()
        .unwrap_or_else(|| panic!("{allow:?}: the daemon started"));
        assert!(
            log.contains("no profile \"tamer\"") || log.contains("may use profile \"tamer\""),
            "{allow:?}: {log}"
        );
    }
    // Control: without the private workspace the writer may serve (and writes the host).
    let daemon = clients_daemon(
        &serde_json::json!({"clients": [
            {"name": "alice", "token": ALICE, "profiles": ["strict", "landlock"]},
            {"name": "mallory", "token": MALLORY, "profiles": ["strict", "task-container"]},
        ]}),
        &executor_tests::ALLOW_ALL_PROFILES,
    )
    .unwrap();
    let mut mallory = Client::connect(&daemon.url, Some(MALLORY)).await.unwrap();
    let out = run_in(
        &mut mallory,
        TASK,
        "plant",
        &format!("echo '#!/bin/sh' > {planted}; echo rc=$?"),
    )
    .await
    .output;
    let written = std::path::Path::new(&planted).exists();
    let _ = std::fs::remove_file(&planted);
    assert_eq!(field(&out, "rc"), Some("0"), "{out}");
    assert!(written, "control: task-container writes the host's /usr");
}

#[tokio::test]
async fn posix_message_queues_of_the_host_are_out_of_reach_without_an_ipc_namespace() {
    // landlock has no IPC namespace: a command's queues were the host's, and outlived it (a few
    // hundred filled the host's limit for every user). strict has its own IPC namespace.
    let Some(daemon) = daemon() else {
        return;
    };
    let m = marker();
    let name = format!("escape-mq-{m}");
    let probe = python(&format!(
        r#"
r, e = sc(240, ctypes.c_char_p(b"{name}"), os.O_CREAT | os.O_RDWR, 0o600, 0)   # mq_open
print(f"mq={{r}} mq_errno={{e}}")
"#
    ));
    // The host's queues, seen through a mqueue filesystem of the test's own.
    let mnt = executor_tests::TempDir::new().unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "mqueue", "mqueue"])
        .arg(mnt.path())
        .status()
        .unwrap()
        .success();
    assert!(mounted);
    let on_host = || mnt.path().join(&name).exists();
    each_row(
        &daemon,
        &[(LANDLOCK, Denied), (STRICT, Allowed), (TRUSTED, Allowed)],
        async |client, row| {
            let out = row.output(client, "mq", &probe).await;
            match (row.profile, row.expect) {
                (_, Denied) => {
                    assert_eq!(field(&out, "mq_errno"), Some("1"), "{row} {out}");
                    assert!(!on_host(), "{row} created a host queue");
                }
                // Its own namespace (where landlock refuses the queue file anyway): whatever the
                // call returns, the host never sees a queue.
                (STRICT, _) => {
                    assert!(field(&out, "mq_errno").is_some(), "{row} {out}");
                    assert!(!on_host(), "{row} the queue reached the host");
                }
                // Control: with no policy the same call makes a host queue, which the test sees.
                _ => {
                    assert_eq!(field(&out, "mq_errno"), Some("0"), "{row} {out}");
                    assert!(on_host(), "{row} control: the host queue is visible");
                    let _ = std::fs::remove_file(mnt.path().join(&name));
                }
            }
        },
    )
    .await;
    let _ = std::process::Command::new("umount")
        .arg(mnt.path())
        .status();
    assert_daemon_intact(&daemon).await;
}
