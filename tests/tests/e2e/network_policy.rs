//! Network by policy (issue 38), from the user's side: what the hello says about each profile's
//! network and this client's ceiling, how rules are checked (clients file at start, requests
//! when they arrive), and that a request never gets more network than its layers give; and
//! `executor run --allow-net`, enforced by the run's own proxy (what the daemon's proxy lets
//! through is network_enforce.rs's and network_matrix.rs's to check). Checked on the host,
//! each denial beside its allowed control.

use std::io::Read;
use std::net::TcpListener;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use executor_tests::{eventually, is_root, marker, req, require, Client, Daemon, PATIENCE};
use protocol::{ClientMessage, ErrorCode, RequestNetwork, SpawnRequest};

use crate::clients::{clients_file, connect, start, write_clients, ALICE, BOB, CAROL};

const PROFILES: &[&str] = &[
    "--allow-profile",
    "strict",
    "--allow-profile",
    "landlock",
    "--allow-profile",
    "task-container",
];

fn policy(allow: &[&str]) -> RequestNetwork {
    RequestNetwork::Policy {
        allow: allow.iter().map(|r| r.to_string()).collect(),
        deny: Vec::new(),
    }
}

fn asking(
    id: &str,
    command: &str,
    profile: &str,
    network: RequestNetwork,
) -> protocol::ExecRequest {
    let mut r = req(id, command);
    r.profile = Some(profile.into());
    r.network = Some(network);
    r
}

/// The clients of these tests: alice with no network entry (no filter of her own), bob
/// granted PyPI, carol granted none.
fn three_clients() -> serde_json::Value {
    serde_json::json!({"clients": [
        {"name": "alice", "token": ALICE},
        {"name": "bob", "token": BOB, "network": {"mode": "policy",
            "allow": ["pypi.org:443", "files.pythonhosted.org:443"], "deny": ["evil.pypi.org"]}},
        {"name": "carol", "token": CAROL, "network": {"mode": "none"}},
    ]})
}

/// A listener on the host's loopback that keeps the first line of every connection.
struct HostListener {
    port: u16,
    heard: Arc<Mutex<Vec<String>>>,
}

impl HostListener {
    fn open() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let heard = Arc::new(Mutex::new(Vec::new()));
        let keep = heard.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                let mut text = String::new();
                let _ = stream.read_to_string(&mut text);
                keep.lock().unwrap().push(text.trim().to_string());
            }
        });
        Self { port, heard }
    }

    /// A shell command that connects and sends `m`, saying whether it connected.
    fn dial(&self, m: &str) -> String {
        format!(
            "if echo {m} > /dev/tcp/127.0.0.1/{port}; then echo connected=yes; else echo connected=no; fi",
            port = self.port
        )
    }

    fn heard(&self, m: &str) -> bool {
        self.heard.lock().unwrap().iter().any(|line| line == m)
    }
}

#[tokio::test]
async fn the_hello_lists_each_profiles_network_and_this_clients_ceiling() {
    let (_dir, file) = clients_file(&three_clients());
    let daemon = start(&file, PROFILES);
    let alice = connect(&daemon, ALICE).await;
    let bob = connect(&daemon, BOB).await;
    let carol = connect(&daemon, CAROL).await;
    let network = |c: &Client, name: &str| {
        c.hello
            .profiles
            .iter()
            .find(|p| p.name == name)
            .and_then(|p| p.network.clone())
            .unwrap_or_else(|| panic!("no network for {name}: {:?}", c.hello.profiles))
    };
    let strict = network(&alice, "strict");
    assert_eq!(strict.mode, "none");
    let task = network(&alice, "task-container");
    assert_eq!(task.mode, "host");
    let landlock = network(&alice, "landlock");
    assert_eq!(landlock.mode, "none");
    // Landlock can never hold a policy, and says why; the namespaced profiles can.
    assert!(!landlock.policy_enforceable);
    assert!(
        landlock.policy_reason.contains("no network namespace"),
        "{landlock:?}"
    );
    for namespaced in [&strict, &task] {
        assert!(namespaced.policy_enforceable, "{namespaced:?}");
        assert!(namespaced.policy_reason.is_empty(), "{namespaced:?}");
    }
    // Each client's ceiling, as its entry states it.
    let ceiling = |c: &Client| c.hello.network.clone().expect("a ceiling in the hello");
    assert_eq!(ceiling(&alice).mode, "host");
    assert!(ceiling(&alice).layers.is_empty());
    assert_eq!(ceiling(&carol).mode, "none");
    let bob_ceiling = ceiling(&bob);
    assert_eq!(bob_ceiling.mode, "policy");
    assert_eq!(bob_ceiling.layers.len(), 1);
    assert_eq!(bob_ceiling.layers[0].layer, "client");
    assert_eq!(
        bob_ceiling.layers[0].allow,
        ["pypi.org:443", "files.pythonhosted.org:443"]
    );
    assert_eq!(bob_ceiling.layers[0].deny, ["evil.pypi.org"]);
}

#[tokio::test]
async fn a_clients_file_with_a_bad_rule_is_refused_at_start_naming_the_rule() {
    let mut bad = three_clients();
    bad["clients"][1]["network"]["allow"][1] = "files.pythonhosted.org:99999".into();
    let (_dir, file) = clients_file(&bad);
    let log = Daemon::try_start_opts(executor_tests::DaemonOptions {
        extra: vec!["--clients".into(), file.display().to_string()],
        state_parent: Some("/var/tmp".into()),
        ..Default::default()
    })
    .err()
    .expect("refused");
    assert!(
        log.contains("client \\\"bob\\\": network: rule \\\"files.pythonhosted.org:99999\\\"")
            || log.contains("client \"bob\": network: rule \"files.pythonhosted.org:99999\""),
        "{log}"
    );
    // Control: the same file with the rule fixed starts, and bob's ceiling is its rules.
    write_clients(&file, &three_clients());
    let daemon = start(&file, PROFILES);
    let bob = connect(&daemon, BOB).await;
    assert_eq!(bob.hello.network.unwrap().mode, "policy");
}

#[tokio::test]
async fn a_request_with_a_bad_rule_gets_bad_request_naming_it_and_nothing_runs() {
    let (_dir, file) = clients_file(&three_clients());
    let daemon = start(&file, PROFILES);
    let mut alice = connect(&daemon, ALICE).await;
    let m = marker();
    let planted = daemon.workspace.join(format!("ran-{m}"));
    let touch = format!("touch {}", planted.display());
    let bad = policy(&["pypi.org:443", "*"]);
    let err = alice
        .exec(asking("bad", &touch, "strict", bad.clone()))
        .await
        .result
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest, "{err:?}");
    assert!(err.message.contains("rule \"*\""), "{err:?}");
    // The same for a process.
    alice
        .send(&ClientMessage::Spawn(SpawnRequest {
            id: "bad-spawn".into(),
            command: touch.clone(),
            cwd: None,
            env: Default::default(),
            timeout: None,
            profile: Some("strict".into()),
            pty: None,
            network: Some(bad),
        }))
        .await;
    let err = alice.collect("bad-spawn").await.result.unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest, "{err:?}");
    assert!(err.message.contains("rule \"*\""), "{err:?}");
    assert!(!planted.exists(), "a refused request ran");
    // Control: a well-formed request (no network) runs the same command.
    let ok = alice
        .run_req(asking("ok", &touch, "strict", RequestNetwork::None {}))
        .await;
    assert_eq!(ok.returncode, 0, "{ok:?}");
    assert!(planted.exists());
    assert_eq!(ok.extra.isolation.network.unwrap().mode, "none");
}

#[tokio::test]
async fn host_asked_under_strict_has_no_network_beside_task_container_which_has_the_hosts() {
    if !require("root", is_root()) {
        return;
    }
    let (_dir, file) = clients_file(&three_clients());
    let daemon = start(&file, PROFILES);
    let mut alice = connect(&daemon, ALICE).await;
    let listener = HostListener::open();
    // Strict: asking for the host's network does not get it.
    let strict_m = marker();
    let strict = alice
        .run_req(asking(
            "strict",
            &listener.dial(&strict_m),
            "strict",
            RequestNetwork::Host {},
        ))
        .await;
    assert!(strict.output.contains("connected=no"), "{strict:?}");
    let report = strict.extra.isolation.network.clone().unwrap();
    assert_eq!(report.mode, "none", "{report:?}");
    assert!(report.layers.is_empty());
    assert!(report.note.contains("cannot widen"), "{report:?}");
    // Control: task-container has the host's network, as asked.
    let task_m = marker();
    let task = alice
        .run_req(asking(
            "task",
            &listener.dial(&task_m),
            "task-container",
            RequestNetwork::Host {},
        ))
        .await;
    assert!(task.output.contains("connected=yes"), "{task:?}");
    assert_eq!(task.extra.isolation.network.unwrap().mode, "host");
    // On the host: the listener heard task-container's command and never strict's.
    assert!(
        eventually(PATIENCE, || listener.heard(&task_m)).await,
        "the host never heard the allowed control"
    );
    assert!(!listener.heard(&strict_m), "strict reached the host");
    // And a client granted none gets none under task-container too, whatever it asks.
    let mut carol = connect(&daemon, CAROL).await;
    let carol_m = marker();
    let none = carol
        .run_req(asking(
            "carol",
            &listener.dial(&carol_m),
            "task-container",
            RequestNetwork::Host {},
        ))
        .await;
    assert!(none.output.contains("connected=no"), "{none:?}");
    assert_eq!(none.extra.isolation.network.unwrap().mode, "none");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!listener.heard(&carol_m), "carol reached the host");
}

#[tokio::test]
async fn landlock_refuses_a_policy_with_the_reason_and_runs_without_one() {
    let (_dir, file) = clients_file(&three_clients());
    let daemon = start(&file, PROFILES);
    let mut alice = connect(&daemon, ALICE).await;
    let m = marker();
    let planted = daemon.workspace.join(format!("ran-{m}"));
    let touch = format!("touch {}", planted.display());
    let err = alice
        .exec(asking("p", &touch, "landlock", policy(&["pypi.org:443"])))
        .await
        .result
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest, "{err:?}");
    assert!(
        err.message
            .contains("\"landlock\" has no network namespace"),
        "{err:?}"
    );
    assert!(!planted.exists(), "a refused request ran");
    // A client granted a policy gets every landlock command refused (the operator's grant
    // cannot be had there), naming the same reason.
    let mut bob = connect(&daemon, BOB).await;
    let err = bob
        .exec(asking("b", &touch, "landlock", RequestNetwork::Host {}))
        .await
        .result
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::EnvironmentError, "{err:?}");
    assert!(err.message.contains("no network namespace"), "{err:?}");
    assert!(!planted.exists(), "a refused request ran");
    // Controls: without a policy landlock runs, with no network, and bob asking for none
    // runs too.
    let ok = alice
        .run_req(asking("ok", &touch, "landlock", RequestNetwork::Host {}))
        .await;
    assert_eq!(ok.returncode, 0, "{ok:?}");
    assert_eq!(ok.extra.isolation.network.unwrap().mode, "none");
    assert!(planted.exists());
    let ok = bob
        .run_req(asking("none", "true", "landlock", RequestNetwork::None {}))
        .await;
    assert_eq!(ok.returncode, 0, "{ok:?}");
}

#[tokio::test]
async fn a_granted_policy_runs_and_its_report_names_every_layer_that_filtered() {
    let (_dir, file) = clients_file(&three_clients());
    let daemon = start(&file, PROFILES);
    let mut alice = connect(&daemon, ALICE).await;
    let mut bob = connect(&daemon, BOB).await;
    let m = marker();
    let planted = daemon.workspace.join(format!("ran-{m}"));
    let touch = format!("touch {}", planted.display());
    // Bob's own grant under strict (his request's `host` cannot widen it), the same narrowed
    // by his request, and alice's request narrowing task-container's host: each runs under
    // the policy its layers give, and says so.
    let cases = [
        (
            bob.run_req(asking("b", &touch, "strict", RequestNetwork::Host {}))
                .await,
            vec!["client"],
        ),
        (
            bob.run_req(asking("n", &touch, "strict", policy(&["pypi.org:443"])))
                .await,
            vec!["client", "request"],
        ),
        (
            alice
                .run_req(asking(
                    "a",
                    &touch,
                    "task-container",
                    policy(&["pypi.org:443"]),
                ))
                .await,
            vec!["request"],
        ),
    ];
    for (result, layers) in cases {
        assert_eq!(result.returncode, 0, "{result:?}");
        let network = result.extra.isolation.network.clone().unwrap();
        assert_eq!(network.mode, "policy", "{result:?}");
        let named: Vec<&str> = network.layers.iter().map(|l| l.layer.as_str()).collect();
        assert_eq!(named, layers, "{network:?}");
        assert!(network.connections.is_some(), "{network:?}");
    }
    assert!(planted.exists(), "the commands ran");
    std::fs::remove_file(&planted).unwrap();
    // Control: bob narrowing his grant to none runs.
    let ok = bob
        .run_req(asking("ok", &touch, "strict", RequestNetwork::None {}))
        .await;
    assert_eq!(ok.returncode, 0, "{ok:?}");
    assert_eq!(ok.extra.isolation.network.unwrap().mode, "none");
    assert!(planted.exists());
    // A file operation runs no command of bob's: his policy does not refuse it.
    bob.send(&ClientMessage::Stat(protocol::StatRequest {
        id: "stat".into(),
        path: planted.display().to_string(),
        profile: Some("strict".into()),
    }))
    .await;
    match bob.reply_for("stat").await {
        protocol::ServerMessage::FileInfo(_) => {}
        other => panic!("expected file_info, got {other:?}"),
    }
}

#[tokio::test]
async fn executor_run_checks_allow_net_rules_and_enforces_a_policy_with_its_own_proxy() {
    if !require("root", is_root()) {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    // Outside /tmp, which strict gives its commands a private one of: the planted file is seen
    // from the host.
    let dir = executor_tests::TempDir::with_prefix_in("executor-net-", "/var/tmp").unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let planted = dir.path().join(format!("ran-{}", marker()));
    let touch = format!("touch {}", planted.display());
    let run = |extra: &[&str], command: &str| {
        let mut run = Command::new(executor_tests::binary("executor"));
        run.args(["run", "--profile", "strict"])
            .args(extra)
            .arg("--cwd")
            .arg(dir.path())
            .args(["--", command]);
        run.output().unwrap()
    };
    let bad = run(&["--allow-net", "pypi.org:0"], &touch);
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("rule \"pypi.org:0\""), "{stderr}");
    let deny_only = run(&["--deny-net", "evil.pypi.org"], &touch);
    assert!(!deny_only.status.success());
    assert!(!planted.exists(), "a refused run ran");
    // Control: without a rule the same run runs.
    let ok = run(&[], &touch);
    assert!(ok.status.success(), "{ok:?}");
    assert!(planted.exists());
    std::fs::remove_file(&planted).unwrap();

    // A policy is enforced by the run's own proxy and resolver: the allowed server of the
    // test internet answers, the other is refused (and sees nothing), and both decisions are
    // in the run's decision log.
    let net = executor_tests::test_internet::TestInternet::start();
    let (pypi, git) = (net.pypi().name, net.git().name);
    let log = dir.path().join("network.jsonl");
    let allow = format!("{pypi}:80");
    let log_arg = log.display().to_string();
    let mut extra = vec![
        "--allow-net",
        &allow,
        "--deny-net",
        "evil.pypi.org",
        "--network-log",
        &log_arg,
    ];
    let pairs = net.resolve_pairs();
    for pair in &pairs {
        extra.extend(["--egress-resolve", pair]);
    }
    let code = |url: String| format!("curl -s -o /dev/null -m 20 -w '%{{http_code}}' {url}");
    let command = format!(
        "{touch}; echo \"pypi: $({})\"; echo \"git: $({})\"",
        code(format!("http://{pypi}/simple/")),
        code(format!("{}/HEAD", net.repo_url()))
    );
    let policy = run(&extra, &command);
    let stdout = String::from_utf8_lossy(&policy.stdout);
    let stderr = String::from_utf8_lossy(&policy.stderr);
    assert!(policy.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "pypi: 200\ngit: 403", "{stderr}");
    assert!(planted.exists(), "the policy's run ran");
    assert!(
        stderr.contains("network policy: 1 allowed, 1 refused"),
        "{stderr}"
    );
    assert_eq!(net.log("pypi").matches("\"GET ").count(), 1);
    assert_eq!(
        net.log("git").matches("\"GET ").count(),
        0,
        "{}",
        net.log("git")
    );
    let records: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let decided: Vec<(&str, bool)> = records
        .iter()
        .map(|r| (r["host"].as_str().unwrap(), r["allowed"].as_bool().unwrap()))
        .collect();
    assert_eq!(decided, [(pypi, true), (git, false)], "{records:#?}");
}
