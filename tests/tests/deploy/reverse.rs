//! Reverse connect: `executor connect` dials out to the agent's relay over TLS, pinning the
//! relay's certificate, and serves the usual protocol over the connections it opened. The
//! relay (`agent deploy up --deploy reverse`) takes only executors with its token; an
//! executor that was told another pin never hands its token over.

use std::process::Stdio;
use std::time::Duration;

use executor_tests::{binary, Client};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::wait_for;

struct Relay {
    child: tokio::process::Child,
    stdout: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    url: String,
    pin: String,
    token_file: String,
}

async fn relay() -> Relay {
    let mut child = tokio::process::Command::new(binary("agent"))
        .args([
            "deploy",
            "up",
            "--json",
            "--deploy",
            "reverse",
            "--reverse-listen",
            "127.0.0.1:0",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let line = stderr
                .next_line()
                .await
                .unwrap()
                .expect("the relay said nothing");
            if line.contains("executor connect wss://") {
                return line;
            }
        }
    })
    .await
    .unwrap();
    tokio::spawn(async move { while let Ok(Some(_)) = stderr.next_line().await {} });
    let words: Vec<&str> = line.split_whitespace().collect();
    let after = |flag: &str| words[words.iter().position(|w| *w == flag).unwrap() + 1].to_string();
    let url = after("connect");
    Relay {
        stdout: BufReader::new(child.stdout.take().unwrap()).lines(),
        child,
        pin: after("--tls-fingerprint"),
        token_file: after("--token-file"),
        url,
    }
}

fn executor_connect(
    relay: &Relay,
    url: &str,
    pin: &str,
    state: &std::path::Path,
) -> tokio::process::Child {
    tokio::process::Command::new(binary("executor"))
        .args([
            "connect",
            url,
            "--tls-fingerprint",
            pin,
            "--token-file",
            &relay.token_file,
        ])
        .arg("--state-dir")
        .arg(state)
        .args(["--give-up-after", "3"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

fn exited(child: &mut tokio::process::Child) -> bool {
    child.try_wait().unwrap().is_some()
}

#[tokio::test]
async fn an_executor_dialling_out_serves_the_protocol_and_one_with_another_pin_gets_nowhere() {
    if !executor_tests::require("root", executor_tests::is_root()) {
        return;
    }
    let mut relay = relay().await;
    let states = executor_tests::TempDir::new().unwrap();
    // Denial: a pin that is not the relay's. The handshake fails, the token is never sent,
    // the relay has nobody to offer, and the executor gives up and exits.
    let wrong = format!("sha256:{}", "0".repeat(64));
    let mut impostor_side = executor_connect(&relay, &relay.url, &wrong, &states.path().join("a"));
    let nothing = tokio::time::timeout(Duration::from_secs(4), relay.stdout.next_line()).await;
    assert!(
        nothing.is_err(),
        "the relay took an executor that pinned another certificate"
    );
    assert!(wait_for(Duration::from_secs(30), || exited(&mut impostor_side)).await);

    // A relay named by a host name that does not resolve: refused at start, before serving.
    let unresolvable = relay.url.replace("127.0.0.1", "no-such-relay.invalid");
    let refused = std::process::Command::new(binary("executor"))
        .args(["connect", &unresolvable, "--tls-fingerprint", &relay.pin])
        .args(["--token-file", &relay.token_file])
        .arg("--state-dir")
        .arg(states.path().join("c"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && said.contains("cannot resolve the relay's host"),
        "{:?}: {said}",
        refused.status
    );

    // Control: the right pin, the relay named by a host name (resolved once, at start). The
    // relay hands it out, and a client reaches it.
    let by_name = relay.url.replace("127.0.0.1", "localhost");
    assert_ne!(by_name, relay.url);
    let mut executor = executor_connect(
        &relay,
        &by_name,
        &relay.pin.clone(),
        &states.path().join("b"),
    );
    let line = tokio::time::timeout(Duration::from_secs(30), relay.stdout.next_line())
        .await
        .expect("no executor dialled in")
        .unwrap()
        .unwrap();
    let up: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(up["deployment"], "reverse");
    let token = std::fs::read_to_string(up["token_file"].as_str().unwrap()).unwrap();
    let url = up["url"].as_str().unwrap().to_string();
    let mut client = Client::connect(&url, Some(token.trim())).await.unwrap();
    assert_eq!(client.run("c1", "echo hi").await.output, "hi\n");
    drop(client);
    // A second connection goes through too (the executor keeps one waiting).
    let mut again = Client::connect(&url, Some(token.trim())).await.unwrap();
    assert_eq!(again.run("c2", "echo again").await.output, "again\n");
    drop(again);
    // A wrong token is refused by the executor itself, as on any listener.
    assert!(Client::connect(&url, Some(&"f".repeat(64))).await.is_err());

    // The relay goes (stdin closed): the executor cannot reach it and exits.
    drop(relay.child.stdin.take());
    let status = tokio::time::timeout(Duration::from_secs(30), relay.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(wait_for(Duration::from_secs(30), || exited(&mut executor)).await);
}

/// A waiting connection whose path dies silently (a NAT entry expires: no FIN, no RST ever
/// arrives) is noticed on both ends by the heartbeat: the executor redials, the relay drops
/// the dead one, and the next client gets a live connection instead of a hang.
#[tokio::test]
async fn a_silently_dead_waiting_connection_is_redialled_and_never_handed_to_a_client() {
    if !executor_tests::require("root", executor_tests::is_root()) {
        return;
    }
    let mut relay = relay().await;
    let target: std::net::SocketAddr = relay.url.trim_start_matches("wss://").parse().unwrap();
    let proxy = executor_tests::Proxy::start(target).await;
    let states = executor_tests::TempDir::new().unwrap();
    let through_proxy = format!("wss://{}", proxy.addr);
    let mut executor = tokio::process::Command::new(binary("executor"))
        .args(["connect", &through_proxy, "--tls-fingerprint", &relay.pin])
        .args(["--token-file", &relay.token_file])
        .arg("--state-dir")
        .arg(states.path())
        .args(["--give-up-after", "120"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let line = tokio::time::timeout(Duration::from_secs(30), relay.stdout.next_line())
        .await
        .expect("no executor dialled in")
        .unwrap()
        .unwrap();
    let up: serde_json::Value = serde_json::from_str(&line).unwrap();
    let token = std::fs::read_to_string(up["token_file"].as_str().unwrap()).unwrap();
    let url = up["url"].as_str().unwrap().to_string();
    // Control: through the proxy, a client reaches the executor.
    let mut client = Client::connect(&url, Some(token.trim())).await.unwrap();
    assert_eq!(client.run("c1", "echo hi").await.output, "hi\n");
    drop(client);
    // The executor's waiting connection (and the finished one) go silent, closing nothing.
    assert!(wait_for(Duration::from_secs(10), || proxy.accepted() >= 2).await);
    let before = proxy.accepted();
    assert!(proxy.stall() >= 1);
    // The executor hears no heartbeat and dials a new connection.
    assert!(
        wait_for(Duration::from_secs(60), || proxy.accepted() > before).await,
        "the executor never redialled after its waiting connection went silent"
    );
    // The next client gets the live connection, not the dead one (the relay dropped it).
    let next = tokio::time::timeout(Duration::from_secs(40), async {
        let mut client = Client::connect(&url, Some(token.trim())).await.unwrap();
        client.run("c2", "echo again").await.output
    })
    .await
    .expect("the relay handed the client a dead connection");
    assert_eq!(next, "again\n");
    assert!(!exited(&mut executor));
    drop(relay.child.stdin.take());
    let _ = tokio::time::timeout(Duration::from_secs(30), relay.child.wait()).await;
}
