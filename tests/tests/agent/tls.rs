//! The agent against a `wss://` executor: the certificate pinned by fingerprint (flag or config
//! key) or trusted through `--tls-ca`; a wrong pin is a clear error that is never retried.

use std::process::Stdio;

use executor_tests::{
    binary, eventually, fingerprint_of_der, marked_sleep, marker, Daemon, PATIENCE,
};

use crate::{agent_exec, assert_ended, Scratch};

/// `sha256:0a1b...` as `openssl x509 -fingerprint -sha256` writes it: `0A:1B:...`.
fn openssl_form(pin: &str) -> String {
    let hex = pin.strip_prefix("sha256:").unwrap().to_uppercase();
    hex.as_bytes()
        .chunks(2)
        .map(|pair| std::str::from_utf8(pair).unwrap())
        .collect::<Vec<_>>()
        .join(":")
}

fn wrong(pin: &str) -> String {
    let last = if pin.ends_with('0') { "1" } else { "0" };
    format!("{}{last}", &pin[..pin.len() - 1])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_pinning_the_executors_fingerprint_runs_its_commands_over_tls() {
    let daemon = Daemon::start_with(&["--tls"]);
    let pin = daemon.fingerprint.clone().unwrap();
    let token = daemon.state.path().join("token");
    let token = token.to_str().unwrap();
    let s = Scratch::new();
    // `agent run`, pinned through the config key.
    let run = s
        .run_scripted(
            "- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo over-tls\n",
            &[
                "--executor",
                &daemon.url,
                "--token-file",
                token,
                "-c",
                &format!("environment.tls_fingerprint={pin}"),
            ],
        )
        .await;
    assert_ended(&run, 0, "Submitted");
    assert_eq!(run.traj["info"]["submission"], "over-tls\n");
    let env = &run.traj["info"]["config"]["environment"];
    assert_eq!(env["config"]["tls_fingerprint"], pin.as_str());
    assert!(env["executor_url"].as_str().unwrap().starts_with("wss://"));
    assert!(
        !run.stderr.contains("ignoring keys"),
        "the key is known: {}",
        run.stderr
    );

    // `agent exec`, pinned with the flag in openssl's colon form.
    let (code, out, err) = agent_exec(&[
        "--executor",
        &daemon.url,
        "--token-file",
        token,
        "--tls-fingerprint",
        &openssl_form(&pin),
        "--",
        "echo pinned",
    ])
    .await;
    assert_eq!((code, out.as_str()), (0, "pinned\n"), "{err}");

    // Or the certificate trusted as a CA: verified the usual way, names included.
    let cert = daemon.state.path().join("tls/cert.pem");
    let localhost = daemon.url.replacen("127.0.0.1", "localhost", 1);
    let (code, out, err) = agent_exec(&[
        "--executor",
        &localhost,
        "--token-file",
        token,
        "--tls-ca",
        cert.to_str().unwrap(),
        "--",
        "echo trusted",
    ])
    .await;
    assert_eq!((code, out.as_str()), (0, "trusted\n"), "{err}");
    // The audit log is written by a thread of its own, just after each result.
    assert!(
        eventually(PATIENCE, || daemon
            .audit()
            .iter()
            .any(|r| r["command"] == "echo trusted"))
        .await
    );
    let commands: Vec<String> = daemon
        .audit()
        .iter()
        .map(|r| r["command"].as_str().unwrap_or_default().to_string())
        .collect();
    for command in ["echo pinned", "echo trusted"] {
        assert!(commands.iter().any(|c| c == command), "{commands:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_pin_is_refused_at_once_naming_both_fingerprints() {
    let daemon = Daemon::start_with(&["--tls"]);
    let pin = daemon.fingerprint.clone().unwrap();
    let bad = wrong(&pin);
    let token = daemon.state.path().join("token");
    let token = token.to_str().unwrap();
    let s = Scratch::new();
    let wrongly_pinned = [
        "--executor",
        &daemon.url,
        "--token-file",
        token,
        "--tls-fingerprint",
        &bad,
    ];
    let started = std::time::Instant::now();
    let run = s
        .run_scripted("- command: echo hi\n", &wrongly_pinned)
        .await;
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains(&pin), "{}", run.stderr);
    assert!(run.stderr.contains(&bad), "{}", run.stderr);
    assert!(run.stderr.contains("refusing to connect"), "{}", run.stderr);
    assert!(started.elapsed() < std::time::Duration::from_secs(10));

    let (code, _, err) = agent_exec(&[&wrongly_pinned[..], &["--", "echo never"]].concat()).await;
    assert_eq!(code, 255);
    assert!(err.contains(&pin) && err.contains(&bad), "{err}");

    // Without a pin, a self-signed certificate is refused too, with the way out named.
    let (code, _, err) = agent_exec(&[
        "--executor",
        &daemon.url,
        "--token-file",
        token,
        "--",
        "true",
    ])
    .await;
    assert_eq!(code, 255);
    assert!(err.contains("--tls-fingerprint"), "{err}");
    // A pin is never silently dropped on a plain ws:// URL.
    let plain = daemon.url.replacen("wss://", "ws://", 1);
    let (code, _, err) = agent_exec(&[
        "--executor",
        &plain,
        "--token-file",
        token,
        "--tls-fingerprint",
        &pin,
        "--",
        "true",
    ])
    .await;
    assert_eq!(code, 255);
    assert!(err.contains("not a wss:// URL"), "{err}");
    // A malformed pin is a usage error.
    let (code, _, err) = agent_exec(&[
        "--executor",
        &daemon.url,
        "--tls-fingerprint",
        "sha256:abc",
        "--",
        "true",
    ])
    .await;
    assert_eq!(code, 255);
    assert!(err.contains("invalid TLS fingerprint"), "{err}");
    // Nothing ran.
    assert!(daemon.audit().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_certificate_ends_the_run_on_the_first_reconnect_without_retrying() {
    let mut daemon = Daemon::start_with(&["--tls"]);
    let pin = daemon.fingerprint.clone().unwrap();
    let s = Scratch::new();
    let marker = marker();
    let child = s
        .kill_executor_mid_command(
            &mut daemon,
            &format!(
                "- command: {}\n- command: echo never\n",
                marked_sleep(&marker)
            ),
            &marker,
            &["-c", "environment.reconnect_attempts=10"],
        )
        .await;
    // Same address and token, another certificate: what an impostor would present.
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let other = fingerprint_of_der(cert.der());
    let cert_path = s.write("cert.pem", &cert.pem());
    let key_path = s.write("key.pem", &key.serialize_pem());
    std::fs::set_permissions(
        &key_path,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let log_path = s.path().join("impostor.log");
    let mut impostor = std::process::Command::new(binary("executor"))
        .arg("serve")
        .args(["--listen", &daemon.addr.to_string(), "--state-dir"])
        .arg(daemon.state.path())
        .arg("--tls-cert")
        .arg(&cert_path)
        .arg("--tls-key")
        .arg(&key_path)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let run = s.finish(child).await;
    let read_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        eventually(PATIENCE, || read_log().contains("TLS handshake failed")).await,
        "{}",
        read_log()
    );
    let log = read_log();
    let _ = impostor.kill();
    let _ = impostor.wait();
    assert_ended(&run, 6, "EnvironmentError");
    let exit = run.messages().last().unwrap()["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(exit.contains(&pin) && exit.contains(&other), "{exit}");
    // One handshake with the impostor, refused; no second attempt.
    assert_eq!(log.matches("TLS handshake failed").count(), 1, "{log}");
    assert!(!run.stderr.contains("reconnected"), "{}", run.stderr);
}
