//! Network by policy (issue 38) from the agent's side: `environment.network`, the
//! `--allow-net` / `--no-net` flags and a batch instance's own `network` reach the executor on
//! every command's request. What the executor does with them is the e2e suite's to check
//! (tests/tests/e2e/network_policy.rs); here: that it received them, read from its answer, the
//! trajectory and its audit log; each beside a control with `none` that runs.

use executor_tests::{eventually, is_root, marker, require, Daemon, PATIENCE};
use serde_json::Value;

use crate::{agent_against, assert_complete_trajectory, finish_one_shot, one_shot, Scratch};

/// The "PyPI, npm and GitHub only" recipe of the docs, plus a deny rule.
const POLICY_YAML: &str = "environment:\n  network:\n    mode: policy\n    allow:\n      - pypi.org:443\n      - files.pythonhosted.org:443\n      - registry.npmjs.org:443\n      - github.com:443\n      - codeload.github.com:443\n      - objects.githubusercontent.com:443\n    deny: [evil.pypi.org]\n";
const ALLOWED: [&str; 6] = [
    "pypi.org:443",
    "files.pythonhosted.org:443",
    "registry.npmjs.org:443",
    "github.com:443",
    "codeload.github.com:443",
    "objects.githubusercontent.com:443",
];

/// A daemon offering task-container (the host's network, which a policy narrows) beside
/// strict.
fn daemon() -> Daemon {
    Daemon::start_with(&[
        "--allow-profile",
        "strict",
        "--allow-profile",
        "task-container",
    ])
}

/// The daemon's hello says a policy is enforced under `profile`.
async fn assert_enforceable(daemon: &Daemon, profile: &str) {
    let client = daemon.connect().await;
    let summary = client
        .hello
        .profiles
        .iter()
        .find(|p| p.name == profile)
        .unwrap_or_else(|| panic!("no {profile} in {:?}", client.hello.profiles));
    let network = summary
        .network
        .as_ref()
        .expect("the hello states each profile's network");
    assert!(network.policy_enforceable, "{network:?}");
}

/// A script that plants `ran-{m}` in the workspace, then submits.
fn planting(m: &str) -> String {
    format!("- command: touch ran-{m}\n- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n")
}

/// The audit records of commands whose text contains `needle`, once there is one (the log
/// is written by a thread of its own, just after each result).
async fn audited(daemon: &Daemon, needle: &str) -> Vec<Value> {
    let matching = || {
        daemon
            .audit()
            .into_iter()
            .filter(|r| r["command"].as_str().is_some_and(|c| c.contains(needle)))
            .collect::<Vec<_>>()
    };
    eventually(PATIENCE, || !matching().is_empty()).await;
    matching()
}

/// The network report of the first tool message's command.
fn first_report(traj: &Value) -> Value {
    let tool = traj["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "tool")
        .unwrap_or_else(|| panic!("no tool message: {traj}"));
    tool["extra"]["executor"]["isolation"]["network"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_in_the_config_reaches_the_executor_on_every_command_beside_none_which_runs() {
    if !require("root", is_root()) {
        return;
    }
    let daemon = daemon();
    assert_enforceable(&daemon, "task-container").await;
    let s = Scratch::new();
    let config = s.write("net.yaml", POLICY_YAML).display().to_string();
    let m = marker();
    let planted = daemon.workspace.join(format!("ran-{m}"));
    let run = s
        .run_scripted_against(
            &daemon,
            &planting(&m),
            &["--profile", "task-container", "-c", &config],
        )
        .await;
    // The trajectory records the network the run asked for, in the protocol's shape.
    let asked = &run.traj["info"]["config"]["environment"]["config"]["network"];
    assert_eq!(asked["mode"], "policy", "{asked}");
    assert_eq!(asked["allow"], serde_json::json!(ALLOWED), "{asked}");
    assert_eq!(
        asked["deny"],
        serde_json::json!(["evil.pypi.org"]),
        "{asked}"
    );
    let records = audited(&daemon, &format!("touch ran-{m}")).await;
    assert_eq!(records.len(), 1, "{records:?}");
    // The command ran with the request's rules among its layers.
    assert_eq!(run.code, 0, "{}", run.stderr);
    let report = first_report(&run.traj);
    assert_eq!(report["mode"], "policy", "{report}");
    let request = report["layers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["layer"] == "request")
        .unwrap_or_else(|| panic!("no request layer: {report}"));
    assert_eq!(request["allow"], serde_json::json!(ALLOWED), "{report}");
    assert!(planted.exists());

    // Control: `none` (a -c override) on the same daemon and profile runs, and the executor
    // reports the command had no network.
    let s = Scratch::new();
    let m = marker();
    let planted = daemon.workspace.join(format!("ran-{m}"));
    let run = s
        .run_scripted_against(
            &daemon,
            &planting(&m),
            &[
                "--profile",
                "task-container",
                "-c",
                "environment.network=none",
            ],
        )
        .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_complete_trajectory(&run, "Submitted");
    assert_eq!(
        run.traj["info"]["config"]["environment"]["config"]["network"],
        serde_json::json!({"mode": "none"})
    );
    assert_eq!(first_report(&run.traj)["mode"], "none");
    assert!(planted.exists(), "the control did not run");
    let records = audited(&daemon, &format!("touch ran-{m}")).await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0]["returncode"], 0, "{records:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_network_of_the_wrong_shape_stops_the_run_before_any_command_naming_the_fault() {
    let daemon = Daemon::start();
    let s = Scratch::new();
    let submit = "- command: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n";
    let config = s
        .write(
            "net.yaml",
            "environment:\n  network:\n    mode: policy\n    alow: [pypi.org:443]\n",
        )
        .display()
        .to_string();
    let run = s
        .run_scripted_against(&daemon, submit, &["-c", &config])
        .await;
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(
        run.stderr
            .contains("environment.network: unknown key \"alow\""),
        "{}",
        run.stderr
    );
    // --deny-net alone would allow nothing: said, not sent.
    let run = s
        .run_scripted_against(&daemon, submit, &["--deny-net", "evil.pypi.org"])
        .await;
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(
        run.stderr.contains("give at least one --allow-net"),
        "{}",
        run.stderr
    );
    assert!(daemon.audit().is_empty(), "{:?}", daemon.audit());
    // Control: the flags well formed, the run reaches the executor and submits (strict: the
    // client is granted no policy there, so the command has none, as its report says).
    let run = s
        .run_scripted_against(
            &daemon,
            submit,
            &["--allow-net", "pypi.org:443", "--deny-net", "evil.pypi.org"],
        )
        .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_complete_trajectory(&run, "Submitted");
    assert_eq!(
        run.traj["info"]["config"]["environment"]["config"]["network"],
        serde_json::json!({"mode": "policy", "allow": ["pypi.org:443"], "deny": ["evil.pypi.org"]})
    );
    let records = audited(&daemon, "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT").await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(daemon.audit().len(), 1, "{:?}", daemon.audit());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_exec_sends_its_network_flags_and_no_net_runs() {
    if !require("root", is_root()) {
        return;
    }
    let daemon = daemon();
    assert_enforceable(&daemon, "task-container").await;
    let m = marker();
    let planted = daemon.workspace.join(format!("ran-{m}"));
    let ws = daemon.workspace.display().to_string();
    let touch = format!("touch ran-{m}");
    let asked = agent_against(
        &daemon,
        "exec",
        &[
            "--profile",
            "task-container",
            "--cwd",
            &ws,
            "--allow-net",
            "pypi.org:443",
            "--",
            &touch,
        ],
        b"",
    )
    .await;
    assert_eq!(asked.code, 0, "{}", asked.stderr);
    assert!(planted.exists());
    std::fs::remove_file(&planted).unwrap();
    // The same through `spawn` (exec --stdin).
    let spawned = agent_against(
        &daemon,
        "exec",
        &[
            "--profile",
            "task-container",
            "--cwd",
            &ws,
            "--stdin",
            "--allow-net",
            "pypi.org:443",
            "--",
            "cat",
        ],
        b"through spawn\n",
    )
    .await;
    assert_eq!(spawned.code, 0, "{}", spawned.stderr);
    assert_eq!(String::from_utf8_lossy(&spawned.stdout), "through spawn\n");
    // Control: --no-net runs the same command.
    let none = agent_against(
        &daemon,
        "exec",
        &[
            "--profile",
            "task-container",
            "--cwd",
            &ws,
            "--no-net",
            "--",
            &touch,
        ],
        b"",
    )
    .await;
    assert_eq!(none.code, 0, "{}", none.stderr);
    assert!(planted.exists(), "the control did not run");
    // Under strict this client is granted no network: the policy asked for cannot widen it.
    // The command runs with none, and the agent says so (the executor read the policy).
    let strict = agent_against(
        &daemon,
        "exec",
        &[
            "--profile",
            "strict",
            "--cwd",
            &ws,
            "--allow-net",
            "pypi.org:443",
            "--",
            "echo ran",
        ],
        b"",
    )
    .await;
    assert_eq!(strict.code, 0, "{}", strict.stderr);
    assert_eq!(String::from_utf8_lossy(&strict.stdout), "ran\n");
    assert!(
        strict.stderr.contains("network none: ") && strict.stderr.contains("cannot widen"),
        "{}",
        strict.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_instance_carries_its_own_network_over_the_batchs() {
    if !require("root", is_root()) {
        return;
    }
    let daemon = daemon();
    assert_enforceable(&daemon, "task-container").await;
    let s = Scratch::new();
    let (ma, mb) = (marker(), marker());
    for (id, m) in [("a", &ma), ("b", &mb)] {
        s.write(&format!("s-{id}.yaml"), &planting(m));
    }
    // The batch asks for none; instance a for a policy of its own, instance b nothing of its
    // own (the batch's).
    let instances = s.write(
        "i.jsonl",
        "{\"instance_id\": \"a\", \"problem_statement\": \"p\", \"network\": {\"mode\": \"policy\", \"allow\": [\"pypi.org:443\"]}}\n\
         {\"instance_id\": \"b\", \"problem_statement\": \"p\"}\n",
    );
    let out = s.path().join("out");
    let script = s.path().join("s-{instance_id}.yaml");
    let batch = tokio::process::Command::new(executor_tests::binary("agent"))
        .args(["batch", "--subset"])
        .arg(&instances)
        .args(["-m", "scripted", "--script"])
        .arg(&script)
        .arg("-o")
        .arg(&out)
        .args(["--profile", "task-container", "--no-net"])
        .args(executor_tests::Target::agent_args(&daemon))
        .env_remove("MSWEA_MODEL_NAME")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&batch.stderr);
    eprintln!("{stderr}");
    let traj = |id: &str| -> Value {
        let text = std::fs::read_to_string(out.join(id).join(format!("{id}.traj.json")))
            .unwrap_or_else(|e| panic!("no trajectory of {id}: {e}; {stderr}"));
        serde_json::from_str(&text).unwrap()
    };
    let (a, b) = (traj("a"), traj("b"));
    assert_eq!(
        a["info"]["config"]["environment"]["config"]["network"],
        serde_json::json!({"mode": "policy", "allow": ["pypi.org:443"]})
    );
    let a_records = audited(&daemon, &format!("touch ran-{ma}")).await;
    assert_eq!(a_records.len(), 1, "{a_records:?}");
    assert_eq!(a["info"]["exit_status"], "Submitted", "{a}");
    assert_eq!(first_report(&a)["mode"], "policy");
    assert!(daemon.workspace.join(format!("ran-{ma}")).exists());
    // Control: b has the batch's none, and runs.
    assert_eq!(
        b["info"]["config"]["environment"]["config"]["network"],
        serde_json::json!({"mode": "none"})
    );
    assert_eq!(b["info"]["exit_status"], "Submitted", "{b}");
    assert_eq!(first_report(&b)["mode"], "none");
    assert!(daemon.workspace.join(format!("ran-{mb}")).exists());
}

/// The GET requests `role`'s server of the test internet has logged.
fn served(net: &executor_tests::test_internet::TestInternet, role: &str) -> usize {
    net.log(role).matches("\"GET ").count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_executor_started_with_a_policy_reaches_the_allowed_server_and_not_another() {
    if !require("root", is_root()) {
        return;
    }
    // Without --executor the agent starts an executor of its own, whose one client (us) it
    // gives the policy as ceiling: under strict a requested policy is then that policy, where
    // a ceiling of `host` would give no network at all. No --egress-resolve there, so the
    // rule names the allowed server by its address.
    let net = executor_tests::test_internet::TestInternet::start();
    let scratch = Scratch::new();
    let (pypi, git) = (net.pypi().v4, net.git().v4);
    let allow = format!("{pypi}/32:80");
    let code = |url: String| {
        format!("echo \"$(curl -s -o /dev/null -m 20 -w '%{{http_code}}' {url}) rc=$?\"")
    };
    let command = format!(
        "{}; {}",
        code(format!("http://{pypi}/simple/")),
        code(format!("http://{git}/HEAD"))
    );
    let child = one_shot()
        .args(["exec", "--profile", "strict", "--allow-net", &allow, "--"])
        .arg(&command)
        .current_dir(scratch.path())
        .spawn()
        .unwrap();
    let done = finish_one_shot(child, "agent exec --allow-net").await;
    assert_eq!(done.code, 0, "{}", done.stderr);
    let stdout = String::from_utf8_lossy(&done.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    // The allowed server answered, through the proxy; the other was refused by the proxy
    // (403), and its server saw nothing.
    assert_eq!(lines, ["200 rc=0", "403 rc=0"], "{stdout}");
    assert_eq!(served(&net, "pypi"), 1, "{}", net.log("pypi"));
    assert_eq!(served(&net, "git"), 0, "{}", net.log("git"));
}
