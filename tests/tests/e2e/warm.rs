//! Warm workers: a sandbox built before its command, checked from the host while it waits
//! (already confined), used by exactly one command, out of reach of the command before it,
//! dismissed on a clients reload, and absent with `--no-warm-workers`.

use std::time::Duration;

use executor_tests::checks::{preq, start_until};
use executor_tests::host_waits::{send_signal, sleepers_gone};
use executor_tests::{
    descendants, eventually, marked_sleep, marker, namespace_of, nice_of, proc_status,
    process_state, Daemon, PATIENCE,
};
use nix::sys::signal::Signal;

use crate::clients::{clients_file, connect, start, ALICE};

/// Payloads of idle workers below the daemon: live processes already under seccomp that have
/// not exec'd a command yet (they still carry the fork server's command line).
fn waiting(daemon: &Daemon) -> Vec<i32> {
    descendants(daemon.pid() as i32)
        .into_iter()
        .filter(|&pid| {
            alive(pid)
                && proc_status(pid, "Seccomp:").as_deref() == Some("2")
                && std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| c.ends_with(b"__fork-server\0"))
        })
        .collect()
}

fn alive(pid: i32) -> bool {
    process_state(pid).is_some_and(|s| s != 'Z')
}

/// What a command served by the payload `pid` prints for [`WHO`]: its pid as it sees it (the
/// last NSpid entry) and its pid namespace.
fn who(pid: i32) -> String {
    let nspid = proc_status(pid, "NSpid:").unwrap_or_default();
    let own = nspid
        .split_whitespace()
        .last()
        .unwrap_or_default()
        .to_string();
    format!("{own}\n{}\n", namespace_of(pid, "pid").unwrap_or_default())
}

const WHO: &str = "echo $$; readlink /proc/self/ns/pid";

#[tokio::test]
async fn a_warm_worker_waits_confined_serves_one_command_and_the_one_before_cannot_reach_it() {
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    for profile in ["strict", "landlock"] {
        // Workers of the profile before wait on; only this profile's are looked at.
        let others = waiting(&daemon);
        let waiting = |daemon: &Daemon| -> Vec<i32> {
            waiting(daemon)
                .into_iter()
                .filter(|pid| !others.contains(pid))
                .collect()
        };
        // The first command of a template is served cold; a worker for the next is built
        // beside it and waits.
        let first = client
            .exec(preq(Some(profile), "first", "true", 30.0))
            .await;
        assert_eq!(first.result.unwrap().returncode, 0);
        assert!(
            eventually(PATIENCE, || waiting(&daemon).len() == 1).await,
            "{profile}: no worker waits: {:?}",
            waiting(&daemon)
        );
        let worker = waiting(&daemon)[0];
        // Confined before any command reaches it: the sandbox user, no new privileges.
        assert_eq!(
            proc_status(worker, "Uid:").as_deref(),
            Some("65534\t65534\t65534\t65534"),
            "{profile}"
        );
        assert_eq!(proc_status(worker, "NoNewPrivs:").as_deref(), Some("1"));
        // Non-dumpable (under strict it shares its init's memory until it execs): its /proc
        // files are root's, closed to processes of its own uid. Control: the command it
        // serves is its uid's again ("second" below reads its own).
        assert_eq!(
            std::os::unix::fs::MetadataExt::uid(
                &std::fs::metadata(format!("/proc/{worker}/mem")).unwrap()
            ),
            0,
            "{profile}: a waiting worker is dumpable"
        );
        // Built ahead at a lower priority, so that on a busy machine it yields to the commands
        // running beside it (the command it serves runs at the normal one: "third" below).
        assert_eq!(nice_of(worker), Some(10), "{profile}");

        // The next command is served by that very process. While it runs, the worker for the
        // command after it is built; this command tries to signal every process of its uid
        // and reports those it may (its own background job: the allowed case).
        let m = marker();
        let expected_who = who(worker);
        let probe = format!(
            "{WHO}; stat -c owner:%u /proc/self/mem; {sleep} & mine=$!; touch /tmp/warm-{m}; echo started; \
             while [ ! -e ./go-{m} ]; do sleep 0.05; done; \
             for p in $(ps -u 65534 -o pid=); do echo seen:$p; kill -0 $p 2>/dev/null && echo signal:$p; done; \
             echo mine:$mine",
            sleep = marked_sleep(&m)
        );
        let started = start_until(
            &mut client,
            preq(Some(profile), "second", &probe, 30.0),
            "started",
        )
        .await;
        assert!(
            started.starts_with(&format!("{expected_who}owner:65534\n")),
            "{profile}: {started:?} vs {expected_who:?}"
        );
        assert!(
            !waiting(&daemon).contains(&worker),
            "{profile}: a busy worker still waits"
        );
        assert!(
            eventually(PATIENCE, || waiting(&daemon).len() == 1).await,
            "{profile}: no worker for the next command"
        );
        let next = waiting(&daemon)[0];
        assert_ne!(next, worker);
        std::fs::write(daemon.workspace.join(format!("go-{m}")), "").unwrap();
        let second = client.collect("second").await.result.unwrap();
        let out = second.output;
        let mine = out
            .lines()
            .find_map(|l| l.strip_prefix("mine:"))
            .unwrap_or_else(|| panic!("{profile}: {out}"));
        assert!(
            out.contains(&format!("signal:{mine}\n")),
            "{profile}: the command could not signal its own job: {out}"
        );
        // The next command's worker is out of its reach (landlock's scope or a pid namespace
        // of its own), though it runs as the same user.
        let next_host_pid = proc_status(next, "NSpid:")
            .unwrap_or_default()
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string();
        assert!(
            !out.contains(&format!("signal:{next_host_pid}\n")),
            "{profile}: the command could signal the next worker {next_host_pid}: {out}"
        );
        // Under landlock alone it does see that worker (so the check above is a denial, not a
        // miss); strict's pid namespace hides it.
        assert_eq!(
            out.contains(&format!("seen:{next_host_pid}\n")),
            profile == "landlock",
            "{profile}: {out}"
        );
        // Nothing of it outlives it; the worker that served it is gone.
        assert!(sleepers_gone(&m).await);
        assert!(eventually(PATIENCE, || !alive(worker)).await);
        std::fs::remove_file(daemon.workspace.join(format!("go-{m}"))).unwrap();

        // The command after it runs in the worker that waited, undisturbed, with nothing but
        // its standard descriptors open, and (strict) its own /tmp.
        let expected_who = who(next);
        let third = client
            .exec(preq(
                Some(profile),
                "third",
                &format!("{WHO}; nice; ls /proc/self/fd | tr '\\n' ' '; echo; ls /tmp/warm-{m} 2>&1 >/dev/null | grep -c 'No such'"),
                30.0,
            ))
            .await
            .result
            .unwrap();
        let tmp_is_fresh = if profile == "strict" { "1" } else { "0" };
        assert_eq!(
            third.output,
            format!("{expected_who}0\n0 1 2 3 \n{tmp_is_fresh}\n"),
            "{profile}"
        );
        let _ = std::fs::remove_file(format!("/tmp/warm-{m}"));
        // And one waits for the command after that (so the next profile sees it among the
        // others).
        assert!(eventually(PATIENCE, || waiting(&daemon).len() == 1).await);
        assert!(!waiting(&daemon).contains(&next));
    }
}

#[tokio::test]
async fn no_worker_waits_with_no_warm_workers_and_a_clients_reload_dismisses_those_that_do() {
    // Without warm workers every command builds its sandbox when it comes.
    let cold = Daemon::start_with(&["--no-warm-workers"]);
    let mut client = cold.connect().await;
    for profile in ["strict", "landlock"] {
        let r = client.exec(preq(Some(profile), "cold", WHO, 30.0)).await;
        assert_eq!(r.result.unwrap().returncode, 0);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(waiting(&cold), Vec::<i32>::new());
    drop(client);
    drop(cold);

    // With them, one waits per template (here alice's strict and landlock) until the
    // clients file is reloaded.
    let (_dir, file) = clients_file(&serde_json::json!({"clients": [
        {"name": "alice", "token": ALICE},
    ]}));
    let daemon = start(&file, &[]);
    let mut alice = connect(&daemon, ALICE).await;
    for profile in ["strict", "landlock"] {
        let r = alice.exec(preq(Some(profile), "warm", WHO, 30.0)).await;
        assert_eq!(r.result.unwrap().returncode, 0);
    }
    assert!(eventually(PATIENCE, || waiting(&daemon).len() == 2).await);
    let before = waiting(&daemon);
    send_signal(daemon.pid() as i32, Signal::SIGHUP);
    assert!(
        eventually(PATIENCE, || before.iter().all(|&pid| !alive(pid))).await,
        "still waiting after the reload: {:?}",
        waiting(&daemon)
    );
    // Commands go on, cold first, then warm again.
    let r = alice
        .exec(preq(Some("strict"), "after", "echo ok", 30.0))
        .await;
    assert_eq!(r.result.unwrap().output, "ok\n");
    assert!(eventually(PATIENCE, || waiting(&daemon).len() == 1).await);
}

/// A payload stopped or killed while it waits (by root here; by a command of the same uid
/// on kernels before landlock's signal scoping) never runs the command it is then handed:
/// a killed one refuses it with a clear error; a stopped one is seen by its supervisor (init,
/// or a helper), whose memory it shares, killed, and the command refused at once with a clear
/// error; the next command runs.
#[tokio::test]
async fn a_worker_disturbed_while_it_waits_never_runs_its_command() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let daemon = Daemon::start();
    let mut client = daemon.connect().await;
    let host_pid_ns = namespace_of(daemon.pid() as i32, "pid");
    for profile in ["landlock", "strict"] {
        for signal in [Signal::SIGSTOP, Signal::SIGKILL] {
            let others = settled_waiting(&daemon).await;
            // This profile's only (strict's payload has a pid namespace of its own): the
            // landlock worker built after the last landlock command may start waiting only
            // now, on a busy machine.
            let fresh = |daemon: &Daemon| -> Vec<i32> {
                waiting(daemon)
                    .into_iter()
                    .filter(|pid| !others.contains(pid))
                    .filter(|&pid| {
                        (namespace_of(pid, "pid") != host_pid_ns) == (profile == "strict")
                    })
                    .collect()
            };
            let warm_up = client.exec(preq(Some(profile), "up", "true", 30.0)).await;
            assert_eq!(warm_up.result.unwrap().returncode, 0);
            assert!(
                eventually(PATIENCE, || fresh(&daemon).len() == 1).await,
                "{profile}: no worker waits"
            );
            let worker = fresh(&daemon)[0];
            kill(Pid::from_raw(worker), signal).unwrap();
            if signal == Signal::SIGKILL {
                // Dead, its descriptors closed, before its command comes (a command that
                // comes while it is still dying finds it "killed by SIGKILL" instead).
                assert!(eventually(PATIENCE, || !alive(worker)).await);
            }
            let m = marker();
            let ran = daemon.workspace.join(format!("ran-{m}"));
            let started = std::time::Instant::now();
            let disturbed = client
                .exec(preq(
                    Some(profile),
                    "disturbed",
                    &format!("touch ./ran-{m}"),
                    10.0,
                ))
                .await;
            // Either profile's payload shares its supervisor's memory until its exec: one
            // stopped is killed and said, as one killed is.
            match (&disturbed.result, signal) {
                (Err(e), Signal::SIGSTOP) => {
                    assert!(
                        e.message.contains("stopped as it waited"),
                        "{profile}: {e:?}"
                    )
                }
                (Err(e), Signal::SIGKILL) => {
                    assert!(
                        e.message.contains("killed as it waited"),
                        "{profile}: {e:?}"
                    )
                }
                (other, _) => panic!("{profile} {signal}: {other:?}"),
            }
            // By itself, before its timeout (10 s, far above the milliseconds it takes even
            // on a busy machine): the daemon's timer starts after ours, so a refusal that
            // waited for the timeout (and then the kill grace) comes later than this.
            let took = started.elapsed();
            assert!(
                took < Duration::from_secs(10),
                "{profile} {signal}: {took:?}"
            );
            assert!(!ran.exists(), "{profile} {signal}: the command ran");
            assert!(
                eventually(PATIENCE, || !alive(worker)).await,
                "{profile} {signal}: the disturbed worker lives on"
            );
            // Control: the daemon goes on, and the next command runs.
            let before_next = waiting(&daemon);
            let next = client
                .exec(preq(
                    Some(profile),
                    "next",
                    &format!("touch ./ran-{m}"),
                    30.0,
                ))
                .await;
            assert_eq!(next.result.unwrap().returncode, 0, "{profile} {signal}");
            assert!(ran.exists(), "{profile} {signal}");
            std::fs::remove_file(&ran).unwrap();
            // The worker made to replace the one that ran it waits before the next round
            // counts the waiting ones (on a busy machine it came after that count, and the
            // round saw two fresh workers where it expects one).
            assert!(
                eventually(PATIENCE, || waiting(&daemon)
                    .iter()
                    .any(|pid| !before_next.contains(pid)))
                .await,
                "{profile} {signal}: no worker replaced the one that ran \"next\""
            );
        }
    }
}

/// The waiting workers, once their set has not changed for a second (a worker still being made
/// would otherwise count as the next command's).
async fn settled_waiting(daemon: &Daemon) -> Vec<i32> {
    let deadline = std::time::Instant::now() + PATIENCE;
    let mut last = waiting(daemon);
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = waiting(daemon);
        if now == last || std::time::Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}
