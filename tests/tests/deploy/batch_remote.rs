//! `agent batch` with the `remote` deployment: a pool of running executors, each task taking
//! a free one.

use std::time::{Duration, Instant};

use executor_tests::Daemon;
use serde_json::json;

use crate::{assert_fixed, Bench};

/// A config naming `executors` as (url, token file) pairs, plus the startup command.
fn remote_config(
    bench: &Bench,
    executors: &[(String, std::path::PathBuf)],
    extra: serde_json::Value,
) {
    let remote: Vec<_> = executors
        .iter()
        .map(|(url, token)| json!({"url": url, "token_file": token}))
        .collect();
    let mut config = json!({
        "run": {"env_startup_command": crate::STARTUP},
        "environment": {"deployment": "remote", "remote": remote},
    });
    executor_tests::merge_json(&mut config, extra);
    std::fs::write(
        bench.path().join("config.yaml"),
        serde_norway::to_string(&config).unwrap(),
    )
    .unwrap();
}

#[tokio::test]
async fn a_batch_over_two_remote_executors_runs_on_both() {
    let a = Daemon::start();
    let b = Daemon::start();
    let bench = Bench::new(4, &[], &[]);
    remote_config(
        &bench,
        &[
            (a.url.clone(), a.state.path().join("token")),
            (b.url.clone(), b.state.path().join("token")),
        ],
        json!({}),
    );
    let run = bench.run(&["-w", "2"]).await;
    assert_eq!(run.code, 0);
    for i in 0..4 {
        assert_eq!(bench.status_of(i), "Submitted");
        assert_fixed(&bench.patch(i), i);
    }
    let ran = |d: &Daemon| {
        d.audit()
            .iter()
            .filter(|r| {
                r["command"]
                    .as_str()
                    .is_some_and(|c| c.contains("git init"))
            })
            .count()
    };
    assert!(
        ran(&a) >= 1 && ran(&b) >= 1,
        "a ran {}, b ran {}",
        ran(&a),
        ran(&b)
    );
    assert_eq!(ran(&a) + ran(&b), 4);
}

#[tokio::test]
async fn an_unreachable_remote_and_one_that_never_answers_are_deployment_errors() {
    // A closed port, and a listener that accepts and never says anything.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_url = format!("ws://{}/v1/ws", closed.local_addr().unwrap());
    drop(closed);
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!("ws://{}/v1/ws", silent.local_addr().unwrap());
    let bench = Bench::new(2, &[], &[]);
    let token = bench.path().join("token");
    std::fs::write(&token, "0123456789abcdef0123456789abcdef").unwrap();
    remote_config(
        &bench,
        &[(closed_url, token.clone()), (silent_url, token)],
        json!({"environment": {"start_timeout": 3, "reconnect_attempts": 1}}),
    );
    let began = Instant::now();
    let run = bench.run(&["-w", "2"]).await;
    assert_eq!(run.code, 0);
    assert!(
        began.elapsed() < Duration::from_secs(30),
        "{:?}",
        began.elapsed()
    );
    for i in 0..2 {
        assert_eq!(bench.status_of(i), "DeploymentError", "{}", bench.log());
        assert_eq!(bench.patch(i), "");
    }
    let log = bench.log();
    assert!(
        log.contains("did not answer within the start timeout"),
        "{log}"
    );
    drop(silent);
}

/// One dead executor in a pool is quarantined at its first failed connect, and every
/// instance runs on the live one; before, it was handed straight back and drew most of the
/// batch, each draw a DeploymentError.
#[tokio::test]
async fn a_dead_executor_in_the_pool_is_quarantined_and_the_batch_runs_on_the_live_one() {
    let live = Daemon::start();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("ws://{}/v1/ws", closed.local_addr().unwrap());
    drop(closed);
    let bench = Bench::new(4, &[], &[]);
    remote_config(
        &bench,
        &[
            (dead_url.clone(), live.state.path().join("token")),
            (live.url.clone(), live.state.path().join("token")),
        ],
        json!({}),
    );
    let run = bench.run(&["-w", "2"]).await;
    assert_eq!(run.code, 0);
    // Control and denial at once: every instance ran, on the live executor alone.
    for i in 0..4 {
        assert_eq!(bench.status_of(i), "Submitted", "{}", bench.log());
        assert_fixed(&bench.patch(i), i);
    }
    let log = bench.log();
    let quarantined = log
        .lines()
        .filter(|l| l.contains("quarantined for 30s") && l.contains(&dead_url))
        .count();
    assert_eq!(quarantined, 1, "{log}");
}

/// A pool over `wss://`, each entry with its own pin from the config: the instances run on
/// the executor whose pin matches; the one whose entry pins another certificate (here the
/// first executor's, a real certificate, just not its own) is refused at the TLS handshake
/// before any token is sent, quarantined, and never gets a command. The control: the same
/// executor with its own pin serves.
#[tokio::test]
async fn a_wss_pool_with_a_pin_per_entry_runs_and_an_entry_pinning_another_certificate_is_quarantined(
) {
    let good = Daemon::start_with(&["--tls"]);
    let other = Daemon::start_with(&["--tls"]);
    assert!(good.url.starts_with("wss://") && other.url.starts_with("wss://"));
    let pin = |d: &Daemon| d.fingerprint.clone().unwrap();
    let config = |bench: &Bench, entries: &[(&Daemon, String)]| {
        let remote: Vec<_> = entries
            .iter()
            .map(|(d, pin)| {
                json!({
                    "url": d.url,
                    "token_file": d.state.path().join("token"),
                    "tls_fingerprint": pin,
                })
            })
            .collect();
        let config = json!({
            "run": {"env_startup_command": crate::STARTUP},
            "environment": {"deployment": "remote", "remote": remote},
        });
        std::fs::write(
            bench.path().join("config.yaml"),
            serde_norway::to_string(&config).unwrap(),
        )
        .unwrap();
    };
    let ran = |d: &Daemon| {
        d.audit()
            .iter()
            .filter(|r| {
                r["command"]
                    .as_str()
                    .is_some_and(|c| c.contains("git init"))
            })
            .count()
    };

    // The wrong pin comes first, so the first task draws it.
    let bench = Bench::new(4, &[], &[]);
    config(&bench, &[(&other, pin(&good)), (&good, pin(&good))]);
    let run = bench.run(&["-w", "2"]).await;
    assert_eq!(run.code, 0);
    for i in 0..4 {
        assert_eq!(bench.status_of(i), "Submitted", "{}", bench.log());
        assert_fixed(&bench.patch(i), i);
    }
    assert_eq!((ran(&good), ran(&other)), (4, 0));
    let log = bench.log();
    let quarantined: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("quarantined for 30s") && l.contains(&other.url))
        .collect();
    assert_eq!(quarantined.len(), 1, "{log}");
    assert!(
        quarantined[0].contains(&pin(&other)) && quarantined[0].contains("pinned"),
        "{}",
        quarantined[0]
    );

    // Control: the same executor, pinned with its own certificate, serves.
    let bench = Bench::new(2, &[], &[]);
    config(&bench, &[(&other, pin(&other))]);
    let run = bench.run(&["-w", "1"]).await;
    assert_eq!(run.code, 0);
    for i in 0..2 {
        assert_eq!(bench.status_of(i), "Submitted", "{}", bench.log());
    }
    assert_eq!(ran(&other), 2);
    assert!(!bench.log().contains("quarantined"), "{}", bench.log());
}
