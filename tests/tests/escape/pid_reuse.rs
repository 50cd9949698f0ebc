//! Pid reuse during a signal's walk of the tree (issue 35): the helper of a profile without a
//! pid namespace runs as root in the host's, lists the command's processes and signals them.
//! A child that exits between the list and the signal frees its pid for a host process; the
//! signal must not reach that process. The helper is held in the middle of its walk with
//! strace (`delay_enter` on the call that names the child: `pidfd_open`, or `kill` in a
//! helper that signals by pid), the child is killed and its pid handed to a host process with
//! `ns_last_pid`, then the walk goes on.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use executor_tests::{
    eventually, marked_sleep, marker, parent_of, process_state, processes_matching, sleepers,
    PATIENCE,
};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use protocol::{ClientMessage, ServerMessage, SignalRequest, SpawnRequest, WaitRequest};

use crate::common::*;

/// x86_64 syscall numbers, as /proc/<pid>/syscall shows them.
const SYS_KILL: u64 = 62;
const SYS_PIDFD_OPEN: u64 = 434;

/// The syscall a stopped task is in and its first argument, from /proc/<pid>/syscall.
fn in_syscall(pid: i32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/syscall")).ok()?;
    let mut fields = text.split_whitespace();
    let nr = fields.next()?.parse().ok()?;
    let arg = u64::from_str_radix(fields.next()?.trim_start_matches("0x"), 16).ok()?;
    Some((nr, arg))
}

/// Start a host process whose pid is `pid` (just freed): `ns_last_pid` set to the one before,
/// then a fork; other processes of the host may fork in between, so it is tried again.
fn host_process_at(pid: i32, m: &str) -> Option<Child> {
    for _ in 0..200 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).ok()?;
        let mut child = Command::new("sleep")
            .arg(format!("3600.{m}"))
            .stdin(Stdio::null())
            .spawn()
            .ok()?;
        if child.id() as i32 == pid {
            return Some(child);
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    None
}

#[tokio::test]
async fn a_pid_freed_during_the_signal_walk_and_taken_by_a_host_process_is_not_signalled() {
    let Some(daemon) = daemon() else {
        return;
    };
    if !executor_tests::require("strace", Path::new("/usr/bin/strace").exists()) {
        return;
    }
    let mut client = daemon.connect().await;
    let m = marker();
    let (first, second) = (format!("{m}1"), format!("{m}2"));
    client
        .send(&ClientMessage::Spawn(SpawnRequest {
            id: "tree".into(),
            // The shell outlives the signal (its children do not) and reaps what exits, so
            // a pid freed in the middle of the walk is free at once.
            command: format!(
                "trap '' TERM; (trap - TERM; exec {}) & (trap - TERM; exec {}) & wait",
                marked_sleep(&first),
                marked_sleep(&second)
            ),
            cwd: None,
            env: BTreeMap::new(),
            timeout: Some(600.0),
            profile: Some(LANDLOCK.into()),
            pty: None,
            network: None,
        }))
        .await;
    assert!(matches!(
        client.reply_for("tree").await,
        ServerMessage::Spawned(_)
    ));
    assert!(
        eventually(PATIENCE, || sleepers(&first).len() == 1
            && sleepers(&second).len() == 1)
        .await,
        "control: both children run on the host"
    );
    let children = [sleepers(&first)[0], sleepers(&second)[0]];
    let shell = parent_of(children[0]).unwrap();
    let helper = parent_of(shell).unwrap();
    assert_eq!(parent_of(children[1]), Some(shell));
    // Hold the helper at its second call naming a process (the first names the shell).
    let mut strace = Command::new("strace")
        .args(["-qq", "-o", "/dev/null", "-p", &helper.to_string()])
        .args(["-e", "trace=pidfd_open,kill"])
        .args(["-e", "inject=pidfd_open,kill:delay_enter=300000000:when=2"])
        .spawn()
        .unwrap();
    assert!(
        eventually(PATIENCE, || executor_tests::proc_status(
            helper,
            "TracerPid:"
        )
        .is_some_and(|t| t != "0"))
        .await,
        "strace did not attach to the helper"
    );
    client
        .send(&ClientMessage::Signal(SignalRequest {
            id: "tree".into(),
            signal: "TERM".into(),
            foreground: false,
        }))
        .await;
    assert!(matches!(
        client.reply_for("tree").await,
        ServerMessage::Done(_)
    ));
    let deadline = Instant::now() + PATIENCE;
    let victim = loop {
        if let Some((nr, arg)) = in_syscall(helper) {
            if (nr == SYS_PIDFD_OPEN || nr == SYS_KILL) && children.iter().any(|c| *c as u64 == arg)
            {
                break arg as i32;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the helper never reached a call naming a child: {:?}",
            in_syscall(helper)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let other = children.into_iter().find(|c| *c != victim).unwrap();

    // The child exits at the moment of the walk; its parent reaps it and a host process takes
    // its pid.
    kill(Pid::from_raw(victim), Signal::SIGKILL).unwrap();
    assert!(
        eventually(PATIENCE, || !Path::new(&format!("/proc/{victim}")).exists()).await,
        "the killed child was not reaped (state {:?})",
        process_state(victim)
    );
    let host_marker = format!("{m}9");
    let mut host = host_process_at(victim, &host_marker)
        .unwrap_or_else(|| panic!("no host process could take pid {victim}"));

    // Let the walk go on.
    kill(Pid::from_raw(strace.id() as i32), Signal::SIGTERM).unwrap();
    let _ = strace.wait();
    client
        .send(&ClientMessage::Wait(WaitRequest {
            id: "tree".into(),
            timeout: Some(PATIENCE.as_secs_f64()),
        }))
        .await;
    let exited = match client.reply_for("tree").await {
        ServerMessage::Exited(e) => e,
        other => panic!("expected exited, got {other:?}"),
    };

    // The host process lives: not signalled, by TERM or any other.
    std::thread::sleep(Duration::from_millis(300));
    let alive = host.try_wait().unwrap().is_none() && kill(Pid::from_raw(victim), None).is_ok();
    let _ = host.kill();
    let _ = host.wait();
    assert!(
        alive,
        "the host process that took pid {victim} was signalled"
    );
    // Allowed case: the signal reached the command's real processes, and its tree is gone.
    assert!(!exited.running, "{exited:?}");
    assert_eq!(
        exited.returncode, 0,
        "the shell ends once its children are gone"
    );
    assert!(
        eventually(Duration::from_secs(5), || sleepers(&second).is_empty()
            && !Path::new(&format!("/proc/{shell}")).exists())
        .await,
        "the command's own processes were not signalled: {other} {:?}, shell {shell} {:?}",
        process_state(other),
        process_state(shell)
    );
    assert!(
        processes_matching(&m).is_empty(),
        "{:?}",
        processes_matching(&m)
    );
}
