//! The landlock profile where it matters most: a daemon that is not root (an unprivileged
//! container), so commands run as the daemon's own uid and file modes, uids and capabilities
//! stop nothing. Only landlock, no_new_privs, seccomp and the daemon's non-dumpability stand
//! between the command and the daemon's token, memory and process. The control in each case
//! is the same probe under `trusted` on the same daemon: same uid, no such layers.

use std::process::Command;

use executor_tests::{eventually, is_root, marked_sleep, marker, require, Daemon, DaemonOptions};

use crate::common::*;

/// Uid of the unprivileged daemon. 65534 ("nobody"), because a daemon of any other ordinary
/// uid does not start today (`an_ordinary_user_daemon_starts_and_runs_landlock` pins that).
const UID: u32 = 65_534;

/// A daemon running as `uid` with its state directory outside every path landlock opens.
fn daemon_as(uid: u32) -> Result<Daemon, String> {
    Daemon::try_start_opts(DaemonOptions {
        extra: executor_tests::ALLOW_ALL_PROFILES
            .map(String::from)
            .to_vec(),
        user: Some(uid),
        state_parent: Some("/var/tmp".into()),
        env: vec![(
            "ESCAPE_DAEMON_SECRET".into(),
            format!("dsecret{}", marker()),
        )],
        ..Default::default()
    })
}

/// The daemon of [`UID`], or `None` where the host cannot start one (see
/// [`executor_tests::require`]).
fn unprivileged_daemon() -> Option<Daemon> {
    if !require("root (to start the daemon as another uid)", is_root()) {
        return None;
    }
    let daemon =
        daemon_as(UID).unwrap_or_else(|log| panic!("daemon as uid {UID} did not start:\n{log}"));
    Some(daemon)
}

/// The unprivileged daemon's landlock commands are stopped; `trusted` on the same daemon (same
/// uid, no such layers) is the control.
const SAME_UID: [(&str, Expect); 2] = [(LANDLOCK, Denied), (TRUSTED, Allowed)];

#[tokio::test]
async fn an_ordinary_user_daemon_starts_and_runs_landlock() {
    // The landlock profile exists for hosts where the daemon cannot be root. A daemon of an
    // ordinary uid must start and run landlock commands as that uid.
    if !require("root (to start the daemon as another uid)", is_root()) {
        return;
    }
    let daemon = daemon_as(40_000)
        .unwrap_or_else(|log| panic!("a daemon as uid 40000 did not start:\n{log}"));
    let mut client = daemon.connect().await;
    let out = run_in(&mut client, LANDLOCK, "id", "id -u; echo x > f; echo ws=$?")
        .await
        .output;
    assert!(out.starts_with("40000\n"), "{out}");
    assert_eq!(field(&out, "ws"), Some("0"), "{out}");
}

/// A process of the daemon's uid on the host.
async fn same_uid_canary(m: &str) -> Canary {
    let mut command = Command::new("setpriv");
    command
        .arg(format!("--reuid={UID}"))
        .arg(format!("--regid={UID}"))
        .arg("--clear-groups")
        .arg("sleep")
        .arg(format!("3600.{m}"));
    Canary::start(command).await
}

#[tokio::test]
async fn same_uid_landlock_commands_cannot_read_the_token_or_the_daemons_memory() {
    let Some(daemon) = unprivileged_daemon() else {
        return;
    };
    let d = daemon.pid();
    let s = daemon.state.path().display().to_string();
    let probe = format!(
        "id -u; cat {s}/token; echo token_rc=$?; head -c 100 {s}/audit.jsonl; echo audit_rc=$?\n\
         tr '\\0' '\\n' < /proc/{d}/environ | grep ESCAPE_DAEMON_SECRET; echo env_rc=$?\n\
         head -c 16 /proc/{d}/maps; echo maps_rc=$?"
    );
    each_row(&daemon, &SAME_UID, async |client, row| {
        let out = row.output(client, "secrets", &probe).await;
        assert!(
            out.starts_with(&format!("{UID}\n")),
            "{row} runs as the daemon's uid: {out}"
        );
        row.check_contains(&out, &daemon.token, "read the token");
        if row.denied() {
            assert!(
                !out.contains("dsecret"),
                "{row} read the daemon's environment: {out}"
            );
            assert_ne!(field(&out, "audit_rc"), Some("0"), "{row} {out}");
            assert_ne!(field(&out, "maps_rc"), Some("0"), "{row} {out}");
        }
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn same_uid_landlock_commands_cannot_signal_or_trace_the_daemon_or_a_host_process() {
    let Some(daemon) = unprivileged_daemon() else {
        return;
    };
    let d = daemon.pid();
    each_row(&daemon, &SAME_UID, async |client, row| {
        let canary = same_uid_canary(&marker()).await;
        let c = canary.pid;
        // Under trusted the daemon is spared: the canary shows the paths work.
        let daemon_attack = if row.denied() {
            format!("kill -STOP {d}; echo stop=$?; kill -KILL {d}; echo daemon=$?\n")
        } else {
            String::new()
        };
        let probe = format!(
            "{daemon_attack}{py}\nkill -KILL {c}; echo canary=$?; sleep 30 & kill -KILL $!; echo own=$?",
            py = python(&format!(
                "r, e = sc(101, 0x4206, {c}, 0, 0)   # PTRACE_SEIZE\nprint(f'seize={{r}} seize_errno={{e}}')"
            ))
        );
        let out = row.output(client, "signal", &probe).await;
        assert_eq!(field(&out, "own"), Some("0"), "{row} control: {out}");
        match row.expect {
            Denied => {
                let calls = ["stop", "daemon", "seize", "canary"];
                crate::daemon_reach::assert_signals_failed(row, &out, &calls, &canary, d).await;
            }
            Allowed => {
                assert_eq!(field(&out, "seize"), Some("0"), "{row} control: {out}");
                assert!(
                    eventually(executor_tests::PATIENCE, || !canary.alive()).await,
                    "{row} control: the same-uid canary died: {out}"
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
async fn same_uid_landlock_commands_cannot_reach_the_daemons_port() {
    let Some(daemon) = unprivileged_daemon() else {
        return;
    };
    let port = daemon.addr.port();
    let probe = format!(
        "exec 3<>/dev/tcp/127.0.0.1/{port} && printf 'GET /healthz HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n' >&3 \
         && head -1 <&3 | tr ' ' _ | sed 's/^/status=/'; echo done"
    );
    each_row(&daemon, &SAME_UID, async |client, row| {
        let out = row.output(client, "port", &probe).await;
        match row.expect {
            Denied => assert!(
                !out.contains("status=HTTP"),
                "{row} reached the daemon: {out}"
            ),
            Allowed => assert!(out.contains("status=HTTP/1.1_200"), "{row} control: {out}"),
        }
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn an_unprivileged_daemon_keeps_the_kill_guarantees() {
    let Some(daemon) = unprivileged_daemon() else {
        return;
    };
    let mut client = daemon.connect().await;
    for profile in [LANDLOCK, TRUSTED] {
        let m = marker();
        let s = marked_sleep(&m);
        let (id, _) = start_until(
            &mut client,
            profile,
            "tree",
            &format!(
                "setsid {s} & ( ( {s} & ) & ) ; ( trap '' TERM HUP; {s} ) & \
                 ( {s} & sleep 0.1; kill -STOP $! ) & sleep 0.3; echo started; {s}"
            ),
            "started",
            60.0,
        )
        .await;
        // Control: all five run.
        wait_sleepers(&m, 5).await;
        cancel(&mut client, &id).await;
        assert_none_left(&m, &format!("[{profile}]")).await;
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn without_cgroups_the_sweep_still_kills_a_tree_that_keeps_forking_orphans() {
    // An unprivileged daemon has no cgroup (see its log) and no pid namespace: the subreaper
    // sweep alone must win the race against a shell that keeps forking orphans.
    let Some(daemon) = unprivileged_daemon() else {
        return;
    };
    let mut client = daemon.connect().await;
    for profile in [LANDLOCK, TRUSTED] {
        let m = marker();
        let _reaper = Reaper(m.clone());
        crate::kill::start_and_cancel_a_racing_forker(&mut client, profile, &m).await;
        assert_none_left(&m, &format!("[{profile}] the racing forker survived")).await;
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn same_uid_landlock_commands_cannot_change_the_daemons_limits_or_priority() {
    // The daemon's uid is the command's here: the kernel's uid check lets `prlimit --pid` and
    // friends through. `prlimit --pid <daemon> --nofile=4:4` left it failing every accept
    // (`Too many open files`), locking every client out.
    let Some(daemon) = unprivileged_daemon() else {
        return;
    };
    let mut client = daemon.connect().await;
    let d = daemon.pid();
    let limits = || std::fs::read_to_string(format!("/proc/{d}/limits")).unwrap();
    let nice = || {
        let stat = std::fs::read_to_string(format!("/proc/{d}/stat")).unwrap();
        stat[stat.rfind(')').unwrap() + 2..]
            .split_whitespace()
            .nth(16)
            .unwrap()
            .to_string()
    };
    let (limits_before, nice_before) = (limits(), nice());
    let out = run_in(
        &mut client,
        LANDLOCK,
        "daemon-limits",
        &format!(
            "prlimit --pid {d} --nofile=4:4; echo nofile=$?; renice -n 19 -p {d}; echo renice=$?; \
             prlimit --nofile=64:64 true; echo own=$?"
        ),
    )
    .await
    .output;
    assert_ne!(field(&out, "nofile"), Some("0"), "{out}");
    assert_ne!(field(&out, "renice"), Some("0"), "{out}");
    assert_eq!(field(&out, "own"), Some("0"), "control: {out}");
    // On the host: the daemon's limits and priority are what they were, and it serves.
    assert_eq!(limits(), limits_before);
    assert_eq!(nice(), nice_before);
    for _ in 0..3 {
        let mut more = daemon.connect().await;
        assert_eq!(more.run("again", "echo ok").await.output, "ok\n");
    }
    assert_daemon_intact(&daemon).await;
}
