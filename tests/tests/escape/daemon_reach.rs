//! Reaching the daemon from a command: its token, audit log and state directory, its
//! environment and memory, its process, signals and ptrace. Controls run the same probe under
//! `trusted` (where the daemon's root can do all of it) and against the command's own children.

use std::process::Command;
use std::time::Duration;

use executor_tests::{
    eventually, marked_sleep, marker, proc_status, process_state, Daemon, DaemonOptions,
};

use crate::common::*;

/// Env var given to the daemon, to be looked for in the command's view of the daemon.
const SECRET_VAR: &str = "EXECUTOR_ESCAPE_SECRET";

/// A daemon whose state directory lies outside /tmp (landlock's profile writes /tmp) and whose
/// environment holds a secret.
fn daemon_with_secret(secret: &str) -> Option<TestDaemon> {
    daemon_with(DaemonOptions {
        state_parent: Some("/var/tmp".into()),
        env: vec![(SECRET_VAR.to_string(), secret.to_string())],
        ..Default::default()
    })
}

fn secrets_probe(daemon: &Daemon) -> String {
    let d = daemon.pid();
    let s = daemon.state.path().display();
    let scan = python(&format!(
        r#"
total = 0
try:
    with open("/proc/{d}/maps") as maps, open("/proc/{d}/mem", "rb", 0) as mem:
        for line in maps:
            addr, perms = line.split()[:2]
            if not perms.startswith("rw"):
                continue
            lo, hi = (int(x, 16) for x in addr.split("-"))
            try:
                mem.seek(lo)
                total += len(mem.read(min(hi - lo, 1 << 20)))
            except OSError:
                pass
except OSError as e:
    print(f"memerr={{e.errno}}")
print(f"memread={{total}}")
"#
    ));
    format!(
        "cat {s}/token; echo tokenrc=$?\n\
         head -c 200 {s}/audit.jsonl; echo auditrc=$?\n\
         echo listing=$(ls -A {s} 2>/dev/null | tr '\\n' ,)\n\
         tr '\\0' '\\n' < /proc/{d}/environ | grep {SECRET_VAR}; echo envrc=$?\n\
         for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f; done 2>/dev/null | grep {SECRET_VAR}\n\
         for p in /proc/[0-9]*; do cat $p/root{s}/token; done 2>/dev/null\n\
         {scan}"
    )
}

#[tokio::test]
async fn token_audit_log_environment_and_memory_of_the_daemon_are_out_of_reach() {
    let secret = format!("s3cret{}", marker());
    let Some(daemon) = daemon_with_secret(&secret) else {
        return;
    };
    // A line in the audit log to look for.
    let mut client = daemon.connect().await;
    run_in(&mut client, TRUSTED, "seed", "true").await;
    let probe = secrets_probe(&daemon);
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let out = row.output(client, "secrets", &probe).await;
        let memread: u64 = field(&out, "memread")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        match row.expect {
            Denied => {
                assert!(!out.contains(&daemon.token), "{row} read the token: {out}");
                assert!(
                    !out.contains(&secret),
                    "{row} read the daemon's environment: {out}"
                );
                assert_ne!(field(&out, "tokenrc"), Some("0"), "{row} {out}");
                assert_ne!(field(&out, "auditrc"), Some("0"), "{row} {out}");
                // A mount point's parents may exist as empty directories; nothing else may.
                let listing = field(&out, "listing").unwrap_or("");
                assert!(
                    listing.is_empty() || listing == "workspace,",
                    "{row} sees the state directory's files: {out}"
                );
                assert_eq!(memread, 0, "{row} read the daemon's memory: {out}");
            }
            Allowed => {
                assert!(out.contains(&daemon.token), "{row} control: {out}");
                assert!(out.contains(&secret), "{row} control: {out}");
                assert!(memread > 0, "{row} control: {out}");
            }
        }
    })
    .await;
    // The token file itself is untouched on the host.
    assert_eq!(
        std::fs::read_to_string(daemon.state.path().join("token"))
            .unwrap()
            .trim(),
        daemon.token
    );
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn landlock_never_exposes_a_token_whose_state_dir_lies_under_writable_tmp() {
    // The harness's usual state directory is under /tmp, which landlock's profile makes
    // writable, and landlock cannot carve an exception out of an allowed tree. The daemon must
    // then refuse the profile (fail closed) rather than run the command next to its token.
    let daemon = Daemon::start_with(&executor_tests::ALLOW_ALL_PROFILES);
    assert!(daemon.state.path().starts_with("/tmp"));
    let mut client = daemon.connect().await;
    let s = daemon.state.path().display();
    let got = client
        .exec(preq(
            LANDLOCK,
            "tmp-token",
            &format!("cat {s}/token; echo x >> {s}/token; echo rc=$?"),
            10.0,
        ))
        .await
        .result;
    match got {
        Err(err) => assert_eq!(
            err.code,
            protocol::ErrorCode::EnvironmentError,
            "refused, naming the reason: {err:?}"
        ),
        Ok(result) => {
            assert!(
                !result.output.contains(&daemon.token),
                "landlock command read the token at {s}/token: {}",
                result.output
            );
        }
    }
    assert_eq!(
        std::fs::read_to_string(daemon.state.path().join("token"))
            .unwrap()
            .trim(),
        daemon.token,
        "token file was modified"
    );
    // Control: trusted reads it (the path is right).
    let r = run_in(&mut client, TRUSTED, "ctl", &format!("cat {s}/token")).await;
    assert!(r.output.contains(&daemon.token));
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn the_daemon_process_is_invisible_from_namespaced_profiles() {
    let Some(daemon) = daemon() else {
        return;
    };
    let probe = "ps -eo pid=,args= ; echo; echo count=$(ls /proc | grep -c '^[0-9]*$')";
    each_row(
        &daemon,
        &[(STRICT, Denied), (TASK, Denied), (TRUSTED, Allowed)],
        async |client, row| {
            let out = row.output(client, "ps", probe).await;
            let count: usize = field(&out, "count").unwrap().parse().unwrap();
            match row.expect {
                Denied => {
                    assert!(
                        !out.contains("executor serve"),
                        "{row} sees the daemon: {out}"
                    );
                    assert!(count <= 8, "{row} sees {count} processes: {out}");
                }
                Allowed => {
                    assert!(out.contains("executor serve"), "{row} control: {out}");
                    assert!(count > 8, "{row} control: {out}");
                }
            }
        },
    )
    .await;
    assert_daemon_intact(&daemon).await;
}

/// The denied half of a signal attack on the daemon (pid `daemon_pid`) and a host canary:
/// every call the probe reports under `calls` failed, and on the host the canary lives and the
/// daemon is not stopped.
pub(crate) async fn assert_signals_failed(
    row: Row,
    out: &str,
    calls: &[&str],
    canary: &Canary,
    daemon_pid: u32,
) {
    for call in calls {
        assert_ne!(field(out, call), Some("0"), "{row} {call}: {out}");
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(canary.alive(), "{row} killed the host canary: {out}");
    assert_ne!(
        process_state(daemon_pid as i32),
        Some('T'),
        "{row} stopped the daemon"
    );
}

#[tokio::test]
async fn commands_cannot_signal_the_daemon_or_a_host_process_but_can_signal_their_own() {
    let Some(daemon) = daemon() else {
        return;
    };
    let d = daemon.pid();
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let canary = Canary::sleep(&marker()).await;
        let c = canary.pid;
        // Under trusted only the canary is attacked: killing the daemon there proves nothing.
        let daemon_attack = if row.denied() {
            format!("kill -KILL {d}; echo daemon=$?; kill -STOP {d}; echo stop=$?; ")
        } else {
            String::new()
        };
        let out = row
            .output(
                client,
                "kill",
                &format!(
                    "{daemon_attack}kill -KILL {c}; echo canary=$?; \
                 sleep 30 & kill -KILL $!; echo own=$?; wait"
                ),
            )
            .await;
        // Control in every profile: the command's own child can be killed.
        assert_eq!(field(&out, "own"), Some("0"), "{row} control: {out}");
        match row.expect {
            Denied => {
                assert_signals_failed(row, &out, &["daemon", "stop", "canary"], &canary, d).await;
            }
            Allowed => {
                assert_eq!(field(&out, "canary"), Some("0"), "{row} control: {out}");
                assert!(
                    eventually(executor_tests::PATIENCE, || !alive(c)).await,
                    "{row} control: the canary died"
                );
            }
        }
        drop(canary);
        assert!(daemon.healthy().await, "{row}");
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn commands_cannot_ptrace_or_read_the_memory_of_the_daemon_or_a_host_process() {
    let Some(daemon) = daemon() else {
        return;
    };
    let d = daemon.pid();
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let canary = Canary::sleep(&marker()).await;
        let c = canary.pid;
        let targets = if row.denied() {
            vec![("daemon", d as i32), ("canary", c)]
        } else {
            vec![("canary", c)]
        };
        let mut body = String::from(
            r#"
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
def tracer_of(pid):
    try:
        return [l.split()[1] for l in open(f"/proc/{pid}/status") if l.startswith("TracerPid")][0]
    except OSError:
        return "?"
"#,
        );
        for (name, pid) in &targets {
            body.push_str(&format!(
                r#"
r, e = sc(101, 0x4206, {pid}, 0, 0)   # ptrace(PTRACE_SEIZE)
print(f"{name}_seize={{r}} {name}_seize_errno={{e}} {name}_tracer={{tracer_of({pid})}}")
buf = ctypes.create_string_buffer(16)
local = iovec(ctypes.cast(buf, ctypes.c_void_p), 16)
remote = iovec(ctypes.c_void_p(0x400000), 16)
r, e = sc(310, {pid}, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)   # process_vm_readv
print(f"{name}_vmread_errno={{e}}")
"#
            ));
        }
        let out = row.output(client, "ptrace", &python(&body)).await;
        for (name, pid) in &targets {
            let seize = field(&out, &format!("{name}_seize"));
            let vm = field(&out, &format!("{name}_vmread_errno"));
            match row.expect {
                Denied => {
                    assert_ne!(seize, Some("0"), "{row} seized the {name}: {out}");
                    // EPERM, EACCES or ESRCH (not in view); EFAULT would mean permission was
                    // granted and only the address was bad.
                    assert!(
                        matches!(vm, Some("1" | "3" | "13")),
                        "{row} process_vm_readv on the {name}: {out}"
                    );
                }
                Allowed => {
                    assert_eq!(seize, Some("0"), "{row} control: {out}");
                    assert_ne!(
                        field(&out, &format!("{name}_tracer")),
                        Some("0"),
                        "{row} control: {out}"
                    );
                }
            }
            // On the host: nobody traces the target once the command is over.
            assert!(
                eventually(executor_tests::PATIENCE, || proc_status(*pid, "TracerPid:")
                    .as_deref()
                    == Some("0"))
                .await,
                "{row} {name} still traced"
            );
        }
        assert!(alive(c), "{row}");
        drop(canary);
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn pidfd_and_sigio_cannot_signal_a_host_process() {
    // Two signal paths besides kill(2): pidfd_send_signal, and SIGIO/F_SETSIG delivered to the
    // owner of a file set with F_SETOWN (landlock scopes both, see landlock(7) "Scope flags").
    // One canary per path, so the trusted control proves each path on its own.
    let Some(daemon) = daemon() else {
        return;
    };
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let (c1, c2) = (
            Canary::sleep(&marker()).await,
            Canary::sleep(&marker()).await,
        );
        let (p1, p2) = (c1.pid, c2.pid);
        let probe = python(&format!(
            r#"
import fcntl
fd, e = sc(434, {p1}, 0)   # pidfd_open
r, e2 = sc(424, fd, 9, None, 0) if fd >= 0 else (-1, e)   # pidfd_send_signal(SIGKILL)
print(f"pidfd_open={{fd}} pidfd_kill={{r}} pidfd_errno={{e2}}")
try:
    rd, wr = os.pipe()
    fcntl.fcntl(rd, fcntl.F_SETOWN, {p2})
    fcntl.fcntl(rd, 10, 9)   # F_SETSIG: SIGKILL instead of SIGIO
    fcntl.fcntl(rd, fcntl.F_SETFL, fcntl.fcntl(rd, fcntl.F_GETFL) | os.O_ASYNC)
    os.write(wr, b"x")
    print("sigio_armed=1")
except OSError as e:
    print(f"sigio_errno={{e.errno}}")
"#
        ));
        let out = row.output(client, "pidfd", &probe).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        match row.expect {
            Denied => {
                assert!(
                    alive(p1),
                    "{row} pidfd_send_signal killed a host process: {out}"
                );
                assert!(alive(p2), "{row} SIGIO killed a host process: {out}");
            }
            Allowed => {
                assert!(
                    eventually(executor_tests::PATIENCE, || !alive(p1) && !alive(p2)).await,
                    "{row} control: both canaries die: {out}"
                );
            }
        }
        drop((c1, c2));
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn a_host_process_environment_is_unreadable() {
    // Not only the daemon: any same-uid host process (an agent holding API keys, a shell).
    // Landlock's ptrace restriction closes /proc/<pid>/environ of processes outside the
    // sandbox even to the same uid; namespaced profiles do not see them at all.
    let Some(daemon) = daemon() else {
        return;
    };
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let m = marker();
        let secret = format!("hostsecret{m}");
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(format!("exec {}", marked_sleep(&m)))
            .env("ESCAPE_HOST_SECRET", &secret);
        let c = Canary::start(command).await;
        let p = c.pid;
        let out = row
            .output(
                client,
                "hostenv",
                &format!(
                    "tr '\\0' '\\n' < /proc/{p}/environ | grep ESCAPE_HOST_SECRET; echo rc=$?"
                ),
            )
            .await;
        row.check_contains(&out, &secret, "read a host process's environment");
        drop(c);
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn a_token_file_and_audit_log_outside_the_state_dir_are_out_of_reach_too() {
    // `--token-file` and `--audit-log` may point anywhere; task-container's covers must follow
    // them, not only the state directory.
    let files =
        executor_tests::TempDir::with_prefix_in("escape-daemon-files-", "/var/tmp").unwrap();
    let token_file = files.path().join("token");
    let audit_log = files.path().join("audit.jsonl");
    let Some(daemon) = daemon_with(DaemonOptions {
        extra: vec![
            "--token-file".into(),
            token_file.display().to_string(),
            "--audit-log".into(),
            audit_log.display().to_string(),
        ],
        ..Default::default()
    }) else {
        return;
    };
    let token = std::fs::read_to_string(&token_file)
        .unwrap()
        .trim()
        .to_string();
    let probe = format!(
        "cat {t}; echo token_rc=$?; echo '{{\"forged\":1}}' >> {a}; echo audit_rc=$?; \
         head -c 300 {a}; echo",
        t = token_file.display(),
        a = audit_log.display()
    );
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let out = row.output(client, "files", &probe).await;
        // A line of its own: the daemon's record of this command quotes the text too.
        let forged = std::fs::read_to_string(&audit_log)
            .unwrap_or_default()
            .lines()
            .any(|line| line.trim() == r#"{"forged":1}"#);
        match row.expect {
            Denied => {
                assert!(!out.contains(&token), "{row} read the token file: {out}");
                assert!(!forged, "{row} forged an audit record: {out}");
                assert!(
                    !out.contains("\"command\""),
                    "{row} read the audit log: {out}"
                );
            }
            Allowed => {
                assert!(out.contains(&token) && forged, "{row} control: {out}");
                // Undo the forged line for the next profiles' check.
                let text = std::fs::read_to_string(&audit_log).unwrap();
                let kept: String = text
                    .lines()
                    .filter(|line| line.trim() != r#"{"forged":1}"#)
                    .map(|line| format!("{line}\n"))
                    .collect();
                std::fs::write(&audit_log, kept).unwrap();
            }
        }
    })
    .await;
    assert!(daemon.healthy().await);
}

#[tokio::test]
async fn signals_to_the_sandbox_init_end_only_that_command() {
    // Inside a pid namespace the command can signal its pid 1 (the helper's reaper). Whatever
    // it does to it, the result must come back promptly and nothing may be left behind.
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    for profile in [STRICT, TASK] {
        let m = marker();
        let started = std::time::Instant::now();
        let got = client
            .exec(preq(
                profile,
                &format!("{profile}-init"),
                &format!(
                    "{} & for s in TERM HUP INT USR1 USR2 PIPE ALRM CHLD STOP KILL; do kill -$s 1; done; \
                     sleep 1; echo survived",
                    marked_sleep(&m)
                ),
                20.0,
            ))
            .await
            .result;
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "[{profile}] the result took {:?}: {got:?}",
            started.elapsed()
        );
        assert!(
            eventually(executor_tests::PATIENCE, || {
                executor_tests::processes_matching(&m).is_empty()
            })
            .await,
            "[{profile}] leftovers after signalling init"
        );
        // Control: the daemon is unaffected and the next command of this profile runs.
        let next = run_in(&mut client, profile, "after-init", "echo next").await;
        assert_eq!(next.output, "next\n", "[{profile}]");
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn helpers_are_the_daemons_own_image_not_whatever_lies_at_its_path_later() {
    // Root cause behind `task_container_cannot_replace_the_helper_by_renaming_a_parent_directory`
    // (and the plan-version errors seen when the binary is rebuilt under a running daemon):
    // each helper is started by path. Here the host replaces the file at that path with a
    // program that records itself and hangs. The next command must still run under the
    // daemon's own code, and in no case may it outlive its timeout.
    if !executor_tests::require(
        "root (private copy of the binary)",
        executor_tests::is_root(),
    ) {
        return;
    }
    let root = executor_tests::TempDir::with_prefix_in("escape-swap-", "/var/tmp").unwrap();
    let exe = root.path().join("executor");
    executor_tests::copy_executable(executor_tests::binary("executor"), &exe);
    let Some(daemon) = daemon_with(DaemonOptions {
        binary: Some(exe.clone()),
        ..Default::default()
    }) else {
        return;
    };
    let mut client = daemon.connect().await;
    // Control: commands run through the copy.
    assert_eq!(
        run_in(&mut client, STRICT, "before", "echo ok")
            .await
            .output,
        "ok\n"
    );
    let marker_file = root.path().join("impostor-ran");
    std::fs::remove_file(&exe).unwrap();
    std::fs::write(
        &exe,
        format!(
            "#!/bin/sh\ntouch {}\nexec sleep 60\n",
            marker_file.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let started = std::time::Instant::now();
    client
        .send(&protocol::ClientMessage::Exec(preq(
            STRICT, "after", "echo ok", 3.0,
        )))
        .await;
    let answer = client.recv_within(executor_tests::PATIENCE).await;
    let took = started.elapsed();
    let _reaper = Reaper(root.path().display().to_string());
    assert!(
        !marker_file.exists(),
        "the daemon started whatever now lies at its binary's path as its helper (answer after {took:?}: {answer:?})"
    );
    assert!(
        took < Duration::from_secs(3) + executor_tests::PROMPTLY,
        "a 3 s command answered after {took:?}: {answer:?}"
    );
}
