//! Named clients from a clients file: identity, permissions, private workspaces, quotas,
//! reload on SIGHUP, and isolation between clients. Checked on the host.

use std::path::{Path, PathBuf};
use std::time::Duration;

use executor_tests::host_waits::{sleepers_gone, sleepers_up};
use executor_tests::{eventually, marked_sleep, marker, req, sleepers, Client, Daemon, PATIENCE};
use protocol::{CancelRequest, ClientMessage, ErrorCode, ResumeRequest, ServerMessage};

pub const ALICE: &str = "alice-token-0123456789abcdef0123456789";
pub const BOB: &str = "bob-token-0123456789abcdef0123456789abc";
pub const CAROL: &str = "carol-token-0123456789abcdef0123456789a";
pub const DAVE: &str = "dave-token-0123456789abcdef0123456789ab";

/// Write `json` as a private clients file in a directory of its own and return its path.
pub fn clients_file(json: &serde_json::Value) -> (executor_tests::TempDir, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let dir = executor_tests::TempDir::new().unwrap();
    let path = dir.path().join("clients.json");
    write_clients(&path, json);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    (dir, path)
}

pub fn write_clients(path: &Path, json: &serde_json::Value) {
    std::fs::write(path, serde_json::to_string_pretty(json).unwrap()).unwrap();
}

/// Start a daemon with a clients file. Its state directory is outside /tmp, which the landlock
/// profile opens to commands (private workspaces there are refused, see the plan's tests).
pub fn start(clients: &Path, extra: &[&str]) -> Daemon {
    let mut args = vec!["--clients".to_string(), clients.display().to_string()];
    args.extend(extra.iter().map(|a| a.to_string()));
    Daemon::start_opts(executor_tests::DaemonOptions {
        extra: args,
        state_parent: Some("/var/tmp".into()),
        ..Default::default()
    })
}

pub async fn connect(daemon: &Daemon, token: &str) -> Client {
    Client::connect(&daemon.url, Some(token)).await.unwrap()
}

fn in_profile(id: &str, command: &str, profile: &str) -> protocol::ExecRequest {
    let mut r = req(id, command);
    r.profile = Some(profile.into());
    r
}

async fn error_of(client: &mut Client, r: protocol::ExecRequest) -> protocol::ErrorMessage {
    client.exec(r).await.result.unwrap_err()
}

#[tokio::test]
async fn each_client_gets_its_name_its_profiles_and_a_workspace_others_cannot_reach() {
    let (_dir, file) = clients_file(&serde_json::json!({"clients": [
        {"name": "alice", "token": ALICE, "profiles": ["strict", "landlock"], "workspace": "per_client"},
        {"name": "bob", "token": BOB, "profiles": ["strict", "landlock"], "workspace": "per_client"},
        {"name": "carol", "token": CAROL, "profiles": ["strict"]},
    ]}));
    let daemon = start(&file, &[]);
    let mut alice = connect(&daemon, ALICE).await;
    let mut bob = connect(&daemon, BOB).await;
    let carol = connect(&daemon, CAROL).await;
    assert_eq!(alice.hello.client, "alice");
    assert_eq!(bob.hello.client, "bob");
    let names = |c: &Client| {
        c.hello
            .profiles
            .iter()
            .map(|p| p.name.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&alice), ["landlock", "strict"]);
    assert_eq!(names(&carol), ["strict"]);
    assert_ne!(alice.hello.workspace, bob.hello.workspace);
    assert_eq!(
        carol.hello.workspace,
        daemon.workspace.display().to_string(),
        "carol shares the daemon's workspace"
    );
    let alice_ws = PathBuf::from(&alice.hello.workspace);
    let bob_ws = PathBuf::from(&bob.hello.workspace);

    for profile in ["strict", "landlock"] {
        let m = marker();
        let out = alice
            .exec(in_profile(
                "w",
                &format!("pwd; echo {m} > secret-{profile}; echo rc=$?"),
                profile,
            ))
            .await
            .result
            .unwrap()
            .output;
        assert!(out.starts_with(&alice.hello.workspace), "[{profile}] {out}");
        assert!(out.contains("rc=0"), "[{profile}] {out}");
        // On the host: in alice's directory, not in bob's, not in the shared one.
        assert_eq!(
            std::fs::read_to_string(alice_ws.join(format!("secret-{profile}")))
                .unwrap()
                .trim(),
            m
        );
        assert!(!bob_ws.join(format!("secret-{profile}")).exists());
        assert!(!daemon.workspace.join(format!("secret-{profile}")).exists());
        // Bob cannot read it, list alice's directory, or write there, by path.
        let probe = format!(
            "cat {a}/secret-{profile}; echo read=$?; ls {a}; echo list=$?; echo x > {a}/planted; echo write=$?",
            a = alice_ws.display()
        );
        let out = bob
            .exec(in_profile("b", &probe, profile))
            .await
            .result
            .unwrap()
            .output;
        assert!(
            !out.contains(&m),
            "[{profile}] bob read alice's file: {out}"
        );
        assert!(
            !out.contains("read=0") && !out.contains("list=0") && !out.contains("write=0"),
            "[{profile}] {out}"
        );
        assert!(!alice_ws.join("planted").exists());
        // Control: alice reads her own file back in a later command (the workspace persists).
        let out = alice
            .exec(in_profile("r", &format!("cat secret-{profile}"), profile))
            .await
            .result
            .unwrap()
            .output;
        assert_eq!(out.trim(), m, "[{profile}]");
    }
}

#[tokio::test]
async fn a_client_is_refused_a_profile_it_may_not_use_and_allowed_its_own() {
    let (_dir, file) = clients_file(&serde_json::json!({"clients": [
        {"name": "carol", "token": CAROL, "profiles": ["landlock"]},
    ]}));
    let daemon = start(&file, &[]);
    let mut carol = connect(&daemon, CAROL).await;
    // The daemon's default (strict) is not hers: her own first choice is her default.
    assert_eq!(carol.hello.default_profile, "landlock");
    for profile in ["strict", "trusted", "task-container"] {
        let err = error_of(
            &mut carol,
            in_profile("p", "touch /tmp/ran-anyway", profile),
        )
        .await;
        assert_eq!(err.code, ErrorCode::ProfileDenied, "{profile}: {err:?}");
        assert!(err.message.contains("may not use"), "{}", err.message);
    }
    let ok = carol.run("d", "echo ok").await;
    assert_eq!(ok.extra.isolation.profile, "landlock");
    let ok = carol
        .exec(in_profile("l", "echo ok", "landlock"))
        .await
        .result
        .unwrap();
    assert_eq!(ok.output, "ok\n");
    // The audit log names the client for both.
    assert!(eventually(executor_tests::PATIENCE, || daemon.audit().len() == 5).await);
    assert!(daemon.audit().iter().all(|r| r["client"] == "carol"));
    let refused: Vec<_> = daemon
        .audit()
        .into_iter()
        .filter(|r| r["ended"] == "refused")
        .collect();
    assert_eq!(refused.len(), 3);
    assert!(refused
        .iter()
        .all(|r| r["error"].as_str().unwrap().starts_with("profile_denied")));
    assert!(refused
        .iter()
        .any(|r| r["command"] == "touch /tmp/ran-anyway" && r["profile"] == "trusted"));
}

#[tokio::test]
async fn wrong_tokens_are_refused_and_the_token_file_mode_is_gone() {
    let (_dir, file) = clients_file(&serde_json::json!({"clients": [
        {"name": "alice", "token": ALICE},
    ]}));
    let daemon = start(&file, &[]);
    assert!(
        !daemon.state.path().join("token").exists(),
        "no token file is made in clients mode"
    );
    for bad in [BOB, &ALICE[1..], &format!("{ALICE}x")] {
        assert!(
            Client::connect(&daemon.url, Some(bad)).await.is_err(),
            "{bad}"
        );
    }
    connect(&daemon, ALICE).await;
}

#[tokio::test]
async fn a_readable_clients_file_with_plain_tokens_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let (_dir, file) =
        clients_file(&serde_json::json!({"clients": [{"name": "alice", "token": ALICE}]}));
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let log = Daemon::try_start_opts(executor_tests::DaemonOptions {
        extra: vec!["--clients".into(), file.display().to_string()],
        ..Default::default()
    })
    .err()
    .expect("refused");
    assert!(log.contains("readable by group or others"), "{log}");
    // Control: a digest instead of the token may be world-readable.
    use sha2::Digest;
    let digest = hex::encode(sha2::Sha256::digest(ALICE.as_bytes()));
    write_clients(
        &file,
        &serde_json::json!({"clients": [{"name": "alice", "token_sha256": digest}]}),
    );
    let daemon = start(&file, &[]);
    let mut alice = connect(&daemon, ALICE).await;
    assert_eq!(alice.run("x", "echo hi").await.output, "hi\n");
    // But a file others may write is refused whatever it holds: they could add a client.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o664)).unwrap();
    let log = Daemon::try_start_opts(executor_tests::DaemonOptions {
        extra: vec!["--clients".into(), file.display().to_string()],
        ..Default::default()
    })
    .err()
    .expect("refused");
    assert!(
        log.contains("may be changed by someone other than"),
        "{log}"
    );
}

#[tokio::test]
async fn one_client_can_neither_cancel_nor_resume_nor_signal_anothers_commands() {
    let (_dir, file) = clients_file(&serde_json::json!({"clients": [
        {"name": "alice", "token": ALICE},
        {"name": "bob", "token": BOB},
    ]}));
    let daemon = start(&file, &["--resume-grace", "30"]);
    let mut alice = connect(&daemon, ALICE).await;
    let mut bob = connect(&daemon, BOB).await;
    let m = marker();
    let mut r = req("job", &marked_sleep(&m));
    r.timeout = Some(60.0);
    alice.send(&ClientMessage::Exec(r)).await;
    assert!(sleepers_up(&m, 1).await);
    let pid = sleepers(&m)[0];

    // Bob guesses the id: not found, and the sleeper lives.
    bob.send(&ClientMessage::Cancel(CancelRequest { id: "job".into() }))
        .await;
    match bob.recv().await {
        Some(ServerMessage::Error(e)) => assert_eq!(e.code, ErrorCode::NotFound),
        other => panic!("{other:?}"),
    }
    // Bob tries to take over alice's session on a new connection: not found either.
    let mut thief = connect(&daemon, BOB).await;
    thief
        .send(&ClientMessage::Resume(ResumeRequest {
            session: alice.hello.session.clone(),
            awaiting: vec!["job".into()],
        }))
        .await;
    match thief.recv().await {
        Some(ServerMessage::Error(e)) => assert_eq!(e.code, ErrorCode::NotFound, "{e:?}"),
        other => panic!("{other:?}"),
    }
    // And from inside a sandbox, bob cannot signal it.
    let out = bob
        .run("kill", &format!("kill -9 {pid}; echo rc=$?"))
        .await
        .output;
    assert!(!out.contains("rc=0"), "{out}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(sleepers(&m), vec![pid], "alice's command survived bob");

    // Control: alice cancels her own.
    alice
        .send(&ClientMessage::Cancel(CancelRequest { id: "job".into() }))
        .await;
    let result = alice.collect("job").await.result.unwrap();
    assert_eq!(result.extra.ended, protocol::Ending::Cancelled);
    assert!(sleepers_gone(&m).await);
}

#[tokio::test]
async fn quotas_refuse_with_their_own_codes_and_are_counted() {
    let (_dir, file) = clients_file(&serde_json::json!({"clients": [
        {"name": "one", "token": ALICE, "max_concurrent": 1},
        {"name": "rate", "token": BOB, "commands_per_minute": 3},
        {"name": "out", "token": CAROL, "output_quota_bytes": 1000},
        {"name": "ops", "token": DAVE, "metrics": true, "profiles": ["strict"]},
    ]}));
    let daemon = start(&file, &[]);

    // Concurrency: a second command while one runs is busy, across connections too.
    let mut one = connect(&daemon, ALICE).await;
    let mut one_b = connect(&daemon, ALICE).await;
    let m = marker();
    let mut r = req("long", &marked_sleep(&m));
    r.timeout = Some(60.0);
    one.send(&ClientMessage::Exec(r)).await;
    assert!(sleepers_up(&m, 1).await);
    let err = error_of(&mut one_b, req("second", "touch /tmp/never")).await;
    assert_eq!(err.code, ErrorCode::Busy, "{err:?}");
    assert!(err.message.contains("client one"), "{}", err.message);
    one.send(&ClientMessage::Cancel(CancelRequest { id: "long".into() }))
        .await;
    one.collect("long").await.result.unwrap();
    // Control: with the first one done, the slot is free again.
    assert_eq!(one_b.run("third", "echo ok").await.output, "ok\n");

    // Rate: three per minute, the fourth is refused with a retry hint.
    let mut rate = connect(&daemon, BOB).await;
    for i in 0..3 {
        rate.run(&format!("r{i}"), "true").await;
    }
    let err = error_of(&mut rate, req("r3", "true")).await;
    assert_eq!(err.code, ErrorCode::QuotaExceeded);
    assert!(err.message.contains("retry in"), "{}", err.message);

    // Output: commands run until the quota is used up; then they are refused.
    let mut out = connect(&daemon, CAROL).await;
    let first = out.run("o1", "head -c 1500 /dev/zero | tr '\\0' x").await;
    assert_eq!(first.extra.output_bytes, 1500);
    let err = error_of(&mut out, req("o2", "echo more")).await;
    assert_eq!(err.code, ErrorCode::QuotaExceeded);
    assert!(err.message.contains("output quota"), "{}", err.message);

    // Every refusal is in the metrics, by client and limit; the others' work is not affected.
    let scrape = executor_tests::http_get(daemon.addr, "/metrics", Some(&format!("Bearer {DAVE}")))
        .await
        .unwrap();
    for line in [
        r#"executor_limit_hits_total{client="one",limit="concurrency"} 1"#,
        r#"executor_limit_hits_total{client="rate",limit="rate"} 1"#,
        r#"executor_limit_hits_total{client="out",limit="output_quota"} 1"#,
    ] {
        assert!(
            scrape.lines().any(|l| l == line),
            "{line} missing from:\n{scrape}"
        );
    }
    // A client without the metrics permission is forbidden, a stranger unauthorized.
    let denied =
        executor_tests::http_get(daemon.addr, "/metrics", Some(&format!("Bearer {ALICE}")))
            .await
            .unwrap();
    assert!(denied.starts_with("HTTP/1.1 403"), "{denied}");
    let stranger = executor_tests::http_get(
        daemon.addr,
        "/metrics",
        Some("Bearer nobody-at-all-0123456789abcdef"),
    )
    .await
    .unwrap();
    assert!(stranger.starts_with("HTTP/1.1 401"), "{stranger}");
}

#[tokio::test]
async fn sighup_reloads_clients_without_dropping_connections_and_revokes_removed_ones() {
    let (_dir, file) = clients_file(&serde_json::json!({"clients": [
        {"name": "alice", "token": ALICE},
        {"name": "bob", "token": BOB},
    ]}));
    let daemon = start(&file, &[]);
    let mut alice = connect(&daemon, ALICE).await;
    let mut bob = connect(&daemon, BOB).await;
    assert!(
        Client::connect(&daemon.url, Some(DAVE)).await.is_err(),
        "dave is not a client yet"
    );
    let m = marker();
    let mut r = req("bobs", &marked_sleep(&m));
    r.timeout = Some(60.0);
    bob.send(&ClientMessage::Exec(r)).await;
    assert!(sleepers_up(&m, 1).await);

    // A broken file is not loaded: everything goes on as before.
    std::fs::write(&file, "{ not json").unwrap();
    let hup = || {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(daemon.pid() as i32),
            nix::sys::signal::Signal::SIGHUP,
        )
        .unwrap()
    };
    hup();
    assert!(
        eventually(PATIENCE, || daemon
            .log()
            .contains("clients file not reloaded"))
        .await
    );
    assert_eq!(alice.run("a1", "echo still").await.output, "still\n");
    assert_eq!(sleepers(&m).len(), 1);

    // Dave added, alice limited, bob removed.
    write_clients(
        &file,
        &serde_json::json!({"clients": [
            {"name": "alice", "token": ALICE, "profiles": ["landlock"]},
            {"name": "dave", "token": DAVE},
        ]}),
    );
    hup();
    assert!(eventually(PATIENCE, || daemon.log().contains("clients reloaded")).await);
    // Alice's connection stayed open and follows her new entry.
    let err = error_of(&mut alice, in_profile("a2", "true", "strict")).await;
    assert_eq!(err.code, ErrorCode::ProfileDenied);
    assert_eq!(
        alice
            .exec(in_profile("a3", "echo same", "landlock"))
            .await
            .result
            .unwrap()
            .output,
        "same\n"
    );
    let mut dave = connect(&daemon, DAVE).await;
    assert_eq!(dave.run("d", "echo new").await.output, "new\n");
    // Bob is gone: his connection closed, his command killed, his token refused.
    assert!(
        sleepers_gone(&m).await,
        "bob's command outlived his removal"
    );
    let mut closed = false;
    while let Ok(msg) = bob.recv_within(PATIENCE).await {
        if msg.is_none() {
            closed = true;
            break;
        }
    }
    assert!(closed, "bob's connection stayed open");
    assert!(Client::connect(&daemon.url, Some(BOB)).await.is_err());
}

#[tokio::test]
async fn per_connection_scratch_is_removed_without_reaching_outside_it() {
    let (_dir, file) = clients_file(&serde_json::json!({"clients": [
        {"name": "eph", "token": ALICE, "profiles": ["strict", "landlock"], "workspace": "per_connection"},
    ]}));
    let daemon = start(&file, &[]);
    let outside = executor_tests::TempDir::new().unwrap();
    std::fs::write(outside.path().join("keep"), "precious").unwrap();
    std::fs::create_dir(outside.path().join("tree")).unwrap();
    std::fs::write(outside.path().join("tree/inner"), "also precious").unwrap();

    let mut eph = connect(&daemon, ALICE).await;
    let mut other = connect(&daemon, ALICE).await;
    assert_ne!(
        eph.hello.workspace, other.hello.workspace,
        "each connection has its own scratch"
    );
    let scratch = PathBuf::from(&eph.hello.workspace);
    let o = outside.path().display();
    // What a command can leave behind: symlinks out, a FIFO, deep and unwritable directories.
    let out = eph
        .run(
            "mess",
            &format!("ln -s {o} link-dir; ln -s {o}/keep link-file; mkfifo fifo; mkdir -p deep/er/est; echo x > deep/er/est/f; chmod 000 deep/er; echo rc=$?"),
        )
        .await
        .output;
    assert!(out.contains("rc=0"), "{out}");
    // And what the host may have put there: a hardlink to an outside file, a bind mount.
    std::fs::hard_link(outside.path().join("keep"), scratch.join("hard")).unwrap();
    std::fs::create_dir(scratch.join("mnt")).unwrap();
    let status = std::process::Command::new("mount")
        .args([
            "--bind",
            &outside.path().join("tree").display().to_string(),
            &scratch.join("mnt").display().to_string(),
        ])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(scratch.join("fifo").exists() && scratch.join("mnt/inner").exists());
    // Control: the other connection's scratch is untouched by all this and stays.
    other.run("o", "echo mine > mine").await;
    let other_scratch = PathBuf::from(&other.hello.workspace);

    eph.ws.close(None).await.unwrap();
    assert!(
        eventually(PATIENCE, || !scratch.exists()).await,
        "scratch not removed: {:?}",
        std::fs::read_dir(&scratch).map(|d| d.count())
    );
    assert_eq!(
        std::fs::read_to_string(outside.path().join("keep")).unwrap(),
        "precious"
    );
    assert_eq!(
        std::fs::read_to_string(outside.path().join("tree/inner")).unwrap(),
        "also precious"
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&scratch.display().to_string()),
        "bind mount left behind"
    );
    assert_eq!(
        std::fs::read_to_string(other_scratch.join("mine")).unwrap(),
        "mine\n"
    );
}

/// One client flooding commands and output cannot starve another. Bound: with alice holding
/// every slot she may have (2 of the daemon's 4) busy streaming output as fast as it can, and
/// asking for more all the time, none of bob's `echo` round trips is refused, their median
/// stays under 500 ms and the slowest under 2 s (on 2 cores that alice's two `yes` keep busy;
/// quiet, they take about 10 ms). Control: a greedy client with no per-client limit takes all 4 slots and
/// bob is refused.
#[tokio::test]
async fn an_abusive_client_cannot_starve_another() {
    let (_dir, file) = clients_file(&serde_json::json!({"clients": [
        {"name": "alice", "token": ALICE, "max_concurrent": 2},
        {"name": "bob", "token": BOB},
        {"name": "greedy", "token": CAROL},
    ]}));
    let daemon = start(
        &file,
        &["--max-commands", "4", "--max-commands-per-connection", "16"],
    );

    // Control first: greedy takes every slot, and bob is refused.
    let mut greedy = connect(&daemon, CAROL).await;
    for i in 0..4 {
        let mut r = req(&format!("g{i}"), "sleep 30");
        r.timeout = Some(60.0);
        greedy.send(&ClientMessage::Exec(r)).await;
    }
    let mut bob = connect(&daemon, BOB).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let err = error_of(&mut bob, req("starved", "echo hi")).await;
    assert_eq!(
        err.code,
        ErrorCode::Busy,
        "the control did not starve bob: {err:?}"
    );
    greedy.ws.close(None).await.unwrap();
    drop(greedy);
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Quiet baseline for bob.
    let mut quiet = Vec::new();
    for i in 0..10 {
        let t = std::time::Instant::now();
        assert_eq!(bob.run(&format!("q{i}"), "echo hi").await.output, "hi\n");
        quiet.push(t.elapsed());
    }

    // Alice floods from three connections: output-heavy commands, and requests beyond her
    // limit as fast as the refusals come back.
    let stop = tokio_util::sync::CancellationToken::new();
    // The flood runs on a thread and runtime of its own, so that decoding alice's output in
    // this test process does not delay bob's client (only the daemon is under test).
    let url = daemon.url.clone();
    let flood = std::thread::spawn({
        let stop = stop.clone();
        move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let flooders = (0..3).map(|c| {
                    let stop = stop.clone();
                    let url = url.clone();
                    async move {
                        let mut alice = Client::connect(&url, Some(ALICE)).await.unwrap();
                        let (mut busy, mut ran, mut bytes) = (0u64, 0u64, 0u64);
                        let mut n = 0u64;
                        while !stop.is_cancelled() {
                            n += 1;
                            let mut r =
                                req(&format!("f{c}-{n}"), "yes alice-flood | head -c 20000000");
                            r.stream = true;
                            match alice.exec(r).await.result {
                                Ok(res) => {
                                    ran += 1;
                                    bytes += res.extra.output_bytes;
                                }
                                Err(e) if e.code == ErrorCode::Busy => busy += 1,
                                Err(e) => panic!("{e:?}"),
                            }
                        }
                        (busy, ran, bytes)
                    }
                });
                futures_util::future::join_all(flooders).await
            })
        }
    });
    // On the host, all through the flood: how many of alice's commands run. Sampled from its
    // start, not only while bob runs: a command's processes end before its last output has
    // reached alice (a slow client holds its slot that long), so a late window can see one.
    let sampler = std::thread::spawn({
        let stop = stop.clone();
        move || {
            let yes = |pid: &i32| {
                std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .is_ok_and(|c| c.trim() == "yes")
            };
            let mut counts = Vec::new();
            while !stop.is_cancelled() {
                let running = executor_tests::processes_matching("yes alice-flood");
                counts.push(running.iter().filter(|p| yes(p)).count());
                std::thread::sleep(Duration::from_millis(2));
            }
            counts
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut flooded = Vec::new();
    for i in 0..20 {
        let t = std::time::Instant::now();
        let result = bob.exec(req(&format!("b{i}"), "echo hi")).await.result;
        flooded.push(t.elapsed());
        assert_eq!(
            result
                .unwrap_or_else(|e| panic!("bob refused under flood: {e:?}"))
                .output,
            "hi\n"
        );
    }
    stop.cancel();
    let alice_running = sampler.join().unwrap();
    let mut totals = (0, 0, 0);
    for (busy, ran, bytes) in flood.join().unwrap() {
        totals = (totals.0 + busy, totals.1 + ran, totals.2 + bytes);
    }
    quiet.sort();
    flooded.sort();
    let samples = |n: usize| alice_running.iter().filter(|c| **c == n).count();
    // In order, run-length coded ("2x40 1x3"): how her commands came and went.
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &n in &alice_running {
        match runs.last_mut() {
            Some((last, times)) if *last == n => *times += 1,
            _ => runs.push((n, 1)),
        }
    }
    let runs: Vec<String> = runs
        .iter()
        .map(|(n, times)| format!("{n}x{times}"))
        .collect();
    let running = format!(
        "alice's commands running, sampled on the host: {}",
        runs.join(" ")
    );
    eprintln!(
        "bob quiet median {:?} max {:?}; flooded median {:?} max {:?}; alice ran {} (busy {}), {} MB; {running}",
        quiet[quiet.len() / 2],
        quiet.last().unwrap(),
        flooded[flooded.len() / 2],
        flooded.last().unwrap(),
        totals.1,
        totals.0,
        totals.2 / 1_000_000
    );
    // Alice really flooded: she asked past her limit, and ran as many commands as she may
    // (2, seen on the host) at times, never more.
    assert!(
        totals.0 > 0 && totals.2 >= 20_000_000,
        "alice did not really flood: {totals:?}"
    );
    assert_eq!(
        alice_running.iter().max(),
        Some(&2),
        "{running}, max {:?}",
        alice_running.iter().max()
    );
    assert!(samples(2) >= 5, "{running}");
    // Bounds relative to bob's quiet figures on this machine as well as absolute ones: on a
    // busy machine his quiet commands already take hundreds of milliseconds. His slowest one
    // may meet the machine's worst moment (3.7 s once at a load of 10 on 2 cores, quiet max
    // 0.11 s): 10 s, still short of waiting for alice's commands (there, each of hers outlasted
    // all of bob's); his median says whether he is served promptly.
    let (quiet_median, quiet_max) = (quiet[quiet.len() / 2], *quiet.last().unwrap());
    assert!(
        *flooded.last().unwrap() < Duration::from_secs(10).max(quiet_max * 5),
        "bob waited {:?} under the flood (quiet max {quiet_max:?})",
        flooded.last().unwrap()
    );
    assert!(
        flooded[flooded.len() / 2] < Duration::from_millis(500).max(quiet_median * 5),
        "bob's median under the flood: {:?} (quiet median {quiet_median:?})",
        flooded[flooded.len() / 2]
    );
}

#[tokio::test]
async fn a_private_workspace_that_landlock_would_expose_is_refused_not_shared() {
    // State in /tmp, which the landlock profile opens: every client's workspace would be
    // reachable by path, so landlock commands of a private-workspace client are refused.
    let (_dir, file) = clients_file(&serde_json::json!({"clients": [
        {"name": "alice", "token": ALICE, "profiles": ["strict", "landlock"], "workspace": "per_client"},
    ]}));
    let daemon = Daemon::start_with(&["--clients", file.to_str().unwrap()]);
    assert!(daemon.state.path().starts_with("/tmp"));
    let mut alice = connect(&daemon, ALICE).await;
    let err = error_of(&mut alice, in_profile("l", "touch ran-anyway", "landlock")).await;
    assert_eq!(err.code, ErrorCode::EnvironmentError, "{err:?}");
    assert!(
        err.message.contains("other clients' workspaces"),
        "{}",
        err.message
    );
    assert!(!PathBuf::from(&alice.hello.workspace)
        .join("ran-anyway")
        .exists());
    // Control: strict covers the other workspaces with a root of its own.
    let ok = alice
        .exec(in_profile("s", "touch ran && echo ok", "strict"))
        .await
        .result
        .unwrap();
    assert_eq!(ok.output, "ok\n");
    assert!(PathBuf::from(&alice.hello.workspace).join("ran").exists());
}
