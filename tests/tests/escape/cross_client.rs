//! Cross-command snooping between two clients: one command holds a secret in /tmp and a
//! running process; another client's command looks for both. Control: the shared workspace is
//! shared, as it must be for an agent.

use executor_tests::{eventually, marked_sleep, marker, process_state, sleepers};

use crate::common::*;

#[tokio::test]
async fn another_clients_tmp_and_processes_are_invisible_under_strict() {
    let Some(daemon) = daemon() else {
        return;
    };
    let mut alice = daemon.connect().await;
    let mut bob = daemon.connect().await;
    let m = marker();
    let (alice_id, _) = start_until(
        &mut alice,
        STRICT,
        "alice",
        &format!(
            "echo tmp-secret-{m} > /tmp/secret-{m}; echo ws-shared-{m} > shared-{m}; \
             {} & echo ready; wait",
            marked_sleep(&m)
        ),
        "ready",
        60.0,
    )
    .await;
    let alice_sleep = wait_sleepers(&m, 1).await;
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
        matches!(process_state(alice_sleep[0]), Some(s) if s != 'Z'),
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
    let (alice_id, _) = start_until(
        &mut alice,
        LANDLOCK,
        "alice",
        &format!(
            "echo tmp-note-{m} > /tmp/note-{m}; {} & echo ready; wait",
            marked_sleep(&m)
        ),
        "ready",
        60.0,
    )
    .await;
    let alice_sleep = wait_sleepers(&m, 1).await;
    let out = run_in(
        &mut bob,
        LANDLOCK,
        "bob",
        &format!(
            "cat /tmp/note-{m}; kill -KILL {p}; echo kill_rc=$?; \
             sleep 30 & kill -KILL $!; echo own_rc=$?",
            p = alice_sleep[0]
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
    assert!(
        matches!(process_state(alice_sleep[0]), Some(s) if s != 'Z'),
        "[landlock] alice's process died"
    );
    cancel(&mut alice, &alice_id).await;
    let _ = std::fs::remove_file(format!("/tmp/note-{m}"));
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn strict_tmp_is_gone_with_its_command() {
    let Some(daemon) = daemon() else {
        return;
    };
    let mut client = daemon.connect().await;
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
    let mut client = daemon.connect().await;
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
    for (profile, expect) in [
        (STRICT, Denied),
        (LANDLOCK, Denied),
        (TASK, Denied),
        (TRUSTED, Allowed),
    ] {
        let l = label(profile, expect);
        let out = run_in(&mut client, profile, "shm", &probe).await.output;
        match expect {
            Denied => assert!(
                !out.contains(&content),
                "{l} read the host's shared memory: {out}"
            ),
            Allowed => assert!(out.contains(&content), "{l} control: {out}"),
        }
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn host_posix_shared_memory_is_out_of_reach() {
    // POSIX shared memory lives in /dev/shm: strict mounts a private one; landlock's profile
    // reads all of /dev, the host's /dev/shm included.
    let Some(daemon) = daemon() else {
        return;
    };
    let mut client = daemon.connect().await;
    let m = marker();
    let path = format!("/dev/shm/escape-{m}");
    let content = format!("posixshm-{m}");
    std::fs::write(&path, &content).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    struct Rm(String);
    impl Drop for Rm {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _rm = Rm(path.clone());
    for (profile, expect) in [
        (STRICT, Denied),
        (LANDLOCK, Denied),
        (TASK, Denied),
        (TRUSTED, Allowed),
    ] {
        let l = label(profile, expect);
        let out = run_in(
            &mut client,
            profile,
            "posixshm",
            &format!("cat {path}; echo rc=$?"),
        )
        .await
        .output;
        match expect {
            Denied => assert!(
                !out.contains(&content),
                "{l} read the host's /dev/shm: {out}"
            ),
            Allowed => assert!(out.contains(&content), "{l} control: {out}"),
        }
    }
    assert_daemon_intact(&daemon).await;
}
