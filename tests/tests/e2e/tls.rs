//! `serve --tls`: a self-signed certificate generated once and pinned by its fingerprint, or the
//! operator's own with `--tls-cert/--tls-key`; plaintext refused off loopback.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use executor_tests::{
    binary, eventually, fingerprint_of_der, fingerprint_of_pem_file, parse_ready_line, Client,
    Daemon, DaemonOptions,
};

/// A certificate and key made here, as an operator would bring them.
struct OwnCert {
    dir: executor_tests::TempDir,
    fingerprint: String,
}

impl OwnCert {
    fn new() -> Self {
        let dir = executor_tests::TempDir::new().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["executor.test".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        std::fs::write(dir.path().join("cert.pem"), cert.pem()).unwrap();
        let key_path = dir.path().join("key.pem");
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600)).unwrap();
        Self {
            fingerprint: fingerprint_of_der(cert.der()),
            dir,
        }
    }

    fn cert(&self) -> PathBuf {
        self.dir.path().join("cert.pem")
    }

    fn key(&self) -> PathBuf {
        self.dir.path().join("key.pem")
    }

    fn args(&self) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            self.cert().display().to_string(),
            "--tls-key".into(),
            self.key().display().to_string(),
        ]
    }
}

/// A wrong pin: the right one with its last digit changed.
fn wrong(pin: &str) -> String {
    let mut wrong = pin.to_string();
    let last = if wrong.ends_with('0') { "1" } else { "0" };
    wrong.replace_range(wrong.len() - 1.., last);
    wrong
}

fn start(extra: &[String]) -> Result<Daemon, String> {
    Daemon::try_start_opts(DaemonOptions {
        extra: extra.to_vec(),
        ..DaemonOptions::default()
    })
}

#[tokio::test]
async fn a_self_signed_certificate_is_generated_once_and_its_printed_fingerprint_is_pinned() {
    let daemon = Daemon::start_with(&["--tls"]);
    assert!(daemon.url.starts_with("wss://"), "{}", daemon.url);
    let pin = daemon
        .fingerprint
        .clone()
        .expect("a fingerprint on the ready line");
    assert!(pin.starts_with("sha256:") && pin.len() == 71, "{pin}");
    // The printed fingerprint is the certificate's; the key is private.
    let tls_dir = daemon.state.path().join("tls");
    assert_eq!(fingerprint_of_pem_file(&tls_dir.join("cert.pem")), pin);
    let mode = std::fs::metadata(tls_dir.join("key.pem"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    // The daemon's log is written by a thread of its own: wait for the line, not the race.
    assert!(
        eventually(executor_tests::PATIENCE, || daemon.log().contains(&pin)).await,
        "the log names the fingerprint"
    );
    // `executor tls-fingerprint` prints the same for the operator to hand out.
    let out = Command::new(binary("executor"))
        .arg("tls-fingerprint")
        .arg("--state-dir")
        .arg(daemon.state.path())
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), pin);

    // A client pinning it runs commands.
    let mut client = Client::connect_pinned(&daemon.url, Some(&daemon.token), &pin)
        .await
        .unwrap();
    assert_eq!(
        client.run("tls", "echo over tls").await.output,
        "over tls\n"
    );
    assert!(daemon.healthy().await);

    // A restart with the same state directory keeps the certificate, so the pin holds.
    let state = daemon.state.path().to_path_buf();
    let mut daemon = daemon;
    daemon.signal_and_wait(nix::sys::signal::Signal::SIGTERM);
    let (mut again, line) = serve_in(&state, &["--tls"]);
    let (url, _, printed) = parse_ready_line(&line).unwrap_or_else(|| panic!("{line:?}"));
    assert_eq!(printed.as_deref(), Some(pin.as_str()));
    let mut client = Client::connect_pinned(&url, Some(&daemon.token), &pin)
        .await
        .unwrap();
    assert_eq!(client.run("again", "echo still").await.output, "still\n");
    let _ = again.kill();
    let _ = again.wait();
}

/// `executor serve --listen 127.0.0.1:0 --state-dir <state> <extra>` started by hand (to reuse a
/// state directory); returns the child and its ready line.
pub(crate) fn serve_in(state: &Path, extra: &[&str]) -> (std::process::Child, String) {
    let mut child = Command::new(binary("executor"))
        .args(["serve", "--listen", "127.0.0.1:0", "--state-dir"])
        .arg(state)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    (child, line)
}

#[tokio::test]
async fn a_wrong_fingerprint_is_refused_before_anything_runs_and_the_daemon_stays_healthy() {
    let daemon = Daemon::start_with(&["--tls"]);
    let pin = daemon.fingerprint.clone().unwrap();
    let auth = format!("Bearer {}", daemon.token);
    let err = Client::connect_raw_pinned(&daemon.url, Some(&auth), &wrong(&pin))
        .await
        .expect_err("a wrong pin must not connect");
    assert!(err.to_string().contains(&pin), "{err}");
    // Nothing reached the WebSocket: no session, no command; the daemon saw a failed handshake.
    assert!(daemon.audit().is_empty());
    assert!(!daemon.log().contains("rejected connection"));
    assert!(
        executor_tests::eventually(executor_tests::PATIENCE, || daemon
            .log()
            .contains("TLS handshake failed"))
        .await,
        "{}",
        daemon.log()
    );
    // Control: the right pin, on the same daemon, still works.
    assert!(daemon.healthy().await);
    let mut client = daemon.connect().await;
    assert_eq!(client.run("ok", "echo ok").await.output, "ok\n");
    // The audit log is written by a thread of its own, just after the result.
    assert!(eventually(executor_tests::PATIENCE, || daemon.audit().len() == 1).await);
}

#[tokio::test]
async fn a_plaintext_client_on_the_tls_port_gets_a_clear_refusal_and_the_daemon_keeps_serving() {
    let daemon = Daemon::start_with(&["--tls"]);
    let plain_url = daemon.url.replacen("wss://", "ws://", 1);
    let auth = format!("Bearer {}", daemon.token);
    let err = Client::connect_raw(&plain_url, Some(&auth))
        .await
        .expect_err("plain ws must not connect to a TLS port");
    assert!(err.to_string().contains("400"), "{err}");
    let raw = executor_tests::http_get(daemon.addr, "/healthz", None)
        .await
        .unwrap();
    assert!(raw.contains("this port speaks TLS"), "{raw}");
    // Still serving, over TLS.
    assert!(daemon.healthy().await);
    let mut client = daemon.connect().await;
    assert_eq!(client.run("after", "echo fine").await.output, "fine\n");
    assert!(daemon.audit().iter().all(|r| r["id"] == "after"));
}

#[tokio::test]
async fn a_silent_peer_loses_its_connection_slot_after_the_tls_handshake_timeout() {
    let daemon = Daemon::start_with(&["--tls", "--max-connections", "1"]);
    let pin = daemon.fingerprint.clone().unwrap();
    // Holds the only slot and never says a word.
    let mut silent = tokio::net::TcpStream::connect(daemon.addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        Client::connect_pinned(&daemon.url, Some(&daemon.token), &pin)
            .await
            .is_err(),
        "the slot is taken"
    );
    // The daemon hangs up on it after its handshake timeout (10 s), freeing the slot.
    let mut byte = [0u8; 1];
    let closed = tokio::time::timeout(
        Duration::from_secs(15),
        tokio::io::AsyncReadExt::read(&mut silent, &mut byte),
    )
    .await
    .expect("the silent peer is still connected after 15 s");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    // The log line may land just after the hang-up.
    assert!(
        executor_tests::eventually(executor_tests::PATIENCE, || daemon
            .log()
            .contains("TLS handshake timed out"))
        .await,
        "{}",
        daemon.log()
    );
    let mut client = daemon.connect().await;
    assert_eq!(client.run("freed", "echo freed").await.output, "freed\n");
}

#[tokio::test]
async fn an_operators_certificate_is_served_and_its_pin_accepted() {
    let own = OwnCert::new();
    let daemon = start(&own.args()).unwrap_or_else(|log| panic!("{log}"));
    assert_eq!(
        daemon.fingerprint.as_deref(),
        Some(own.fingerprint.as_str())
    );
    // No certificate is generated when one is given.
    assert!(!daemon.state.path().join("tls").exists());
    let mut client = daemon.connect().await;
    assert_eq!(client.run("own", "echo own").await.output, "own\n");
    let out = Command::new(binary("executor"))
        .arg("tls-fingerprint")
        .arg("--tls-cert")
        .arg(own.cert())
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), own.fingerprint);
}

#[tokio::test]
async fn unusable_certificates_and_keys_are_refused_at_start_with_the_reason() {
    let own = OwnCert::new();
    let other = OwnCert::new();
    // A key others can read.
    std::fs::set_permissions(own.key(), std::fs::Permissions::from_mode(0o644)).unwrap();
    let log = start(&own.args()).err().expect("a readable key is refused");
    assert!(log.contains("chmod 600"), "{log}");
    std::fs::set_permissions(own.key(), std::fs::Permissions::from_mode(0o600)).unwrap();
    // Another certificate's key.
    let mismatched = [
        "--tls-cert".to_string(),
        own.cert().display().to_string(),
        "--tls-key".to_string(),
        other.key().display().to_string(),
    ];
    let log = start(&mismatched).err().expect("a foreign key is refused");
    assert!(log.contains("does not belong to the certificate"), "{log}");
    // Not PEM, and missing.
    let junk = own.dir.path().join("junk.pem");
    std::fs::write(&junk, "junk\n").unwrap();
    let not_pem = [
        "--tls-cert".to_string(),
        junk.display().to_string(),
        "--tls-key".to_string(),
        own.key().display().to_string(),
    ];
    let log = start(&not_pem).err().expect("a file without a certificate");
    assert!(log.contains("holds no PEM certificate"), "{log}");
    let missing = [
        "--tls-cert".to_string(),
        "/nonexistent/cert.pem".to_string(),
        "--tls-key".to_string(),
        own.key().display().to_string(),
    ];
    let log = start(&missing).err().expect("a missing certificate");
    assert!(log.contains("cannot read TLS certificate"), "{log}");
    // Only both together.
    let log = start(&["--tls-cert".to_string(), own.cert().display().to_string()])
        .err()
        .expect("a certificate without its key");
    assert!(log.contains("--tls-key"), "{log}");
    // Control: the same pair, readable by its owner only, is served.
    let daemon = start(&own.args()).unwrap_or_else(|log| panic!("{log}"));
    assert_eq!(
        daemon.fingerprint.as_deref(),
        Some(own.fingerprint.as_str())
    );
}

#[tokio::test]
async fn a_non_loopback_address_needs_tls_unless_plaintext_is_allowed_explicitly() {
    let tokens = executor_tests::TempDir::new().unwrap();
    let token = tokens.path().join("token");
    std::fs::write(&token, format!("{}\n", "ab".repeat(32))).unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let on_all = |extra: &[&str]| {
        let mut args: Vec<String> = vec!["--token-file".into(), token.display().to_string()];
        args.extend(extra.iter().map(|a| a.to_string()));
        Daemon::try_start_opts(DaemonOptions {
            listen: Some("0.0.0.0:0".into()),
            extra: args,
            ..DaemonOptions::default()
        })
    };
    // Plain ws:// on every interface: refused, with both ways out named.
    let log = on_all(&[])
        .err()
        .expect("plaintext off loopback is refused");
    assert!(log.contains("non-loopback"), "{log}");
    assert!(log.contains("--tls"), "{log}");
    assert!(log.contains("ssh -N -L"), "{log}");
    // With TLS it serves; reached here over loopback, pinned.
    let daemon = on_all(&["--tls"]).unwrap_or_else(|log| panic!("{log}"));
    assert!(daemon.url.starts_with("wss://0.0.0.0:"), "{}", daemon.url);
    let pin = daemon.fingerprint.clone().unwrap();
    let url = format!(
        "wss://127.0.0.1:{}{}",
        daemon.addr.port(),
        protocol::WS_PATH
    );
    let token_text = "ab".repeat(32);
    let mut client = Client::connect_pinned(&url, Some(&token_text), &pin)
        .await
        .unwrap();
    assert_eq!(client.run("remote", "echo remote").await.output, "remote\n");
    // Behind a proxy that terminates TLS, plaintext is an explicit choice.
    let proxied = on_all(&["--allow-plaintext"]).unwrap_or_else(|log| panic!("{log}"));
    assert!(proxied.url.starts_with("ws://"), "{}", proxied.url);
    assert!(proxied.fingerprint.is_none());
}
