//! `agent batch` with the `docker` deployment, driven through podman (docker's CLI): one
//! container per instance from its image, the static executor mounted as its entrypoint.
//! What is left on the host is read with `podman ps -a --filter label=...`.

use std::time::Duration;

use executor_tests::container;
use serde_json::json;

use crate::{assert_fixed, interrupt, slow_script, wait_for, Bench, SHORT_SCRIPT};

/// The flags that point the batch at podman on this host (runc, the lab's ulimits), the
/// static executor, and a label of the test's own.
pub fn podman_flags(label: &str) -> Vec<String> {
    [
        "--deploy",
        "docker",
        "--docker-executable",
        "podman",
        "--docker-global-arg=--runtime=runc",
        "--docker-run-arg=--ulimit=nofile=1024:1024",
        "--docker-run-arg=--ulimit=nproc=4096:4096",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        "--executor-static".to_string(),
        executor_tests::static_executor().display().to_string(),
        "--label".to_string(),
        format!("executor-tests-deploy={label}"),
    ])
    .collect()
}

/// Containers (running or not) carrying our test label.
pub fn containers(label: &str) -> Vec<String> {
    let out = container::podman()
        .args([
            "ps",
            "-a",
            "-q",
            "--filter",
            &format!("label=executor-tests-deploy={label}"),
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

fn ready() -> Option<String> {
    if !container::available() {
        return None;
    }
    Some(container::task_image().unwrap())
}

/// Give every instance without an image `image` (as a benchmark's instances name theirs),
/// and never pull.
fn with_image(bench: &Bench, image: &str, extra: serde_json::Value) {
    let file = bench.path().join("instances.jsonl");
    let mut lines = String::new();
    for line in std::fs::read_to_string(&file).unwrap().lines() {
        let mut instance: serde_json::Value = serde_json::from_str(line).unwrap();
        if instance.get("image_name").is_none() {
            instance["image_name"] = json!(image);
        }
        lines.push_str(&format!("{instance}\n"));
    }
    std::fs::write(&file, lines).unwrap();
    let mut config = json!({
        "run": {"env_startup_command": crate::STARTUP},
        "environment": {"docker": {"pull": "never"}},
    });
    executor_tests::merge_json(&mut config, extra);
    std::fs::write(
        bench.path().join("config.yaml"),
        serde_norway::to_string(&config).unwrap(),
    )
    .unwrap();
}

#[tokio::test]
async fn a_batch_in_podman_containers_submits_every_instance_and_leaves_no_container() {
    let Some(image) = ready() else { return };
    // Instance 2 also tries to read the token the executor was handed: it cannot.
    let snoop = format!(
        "- thought: snoop\n  command: cat /.executor/token; echo rc=$?\n{}",
        crate::FIX_SCRIPT
    );
    let bench = Bench::new(3, &[(2, &snoop)], &[]);
    with_image(&bench, &image, json!({}));
    let flags = podman_flags(&bench.tag);
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["-w", "2"]);
    let run = bench.run(&args).await;
    assert_eq!(run.code, 0);
    for i in 0..3 {
        assert_eq!(bench.status_of(i), "Submitted", "{}", bench.log());
        assert_fixed(&bench.patch(i), i);
        assert_eq!(
            bench.trajectory(i)["info"]["config"]["deployment"],
            "docker"
        );
    }
    // The denial, beside the control (the same command's other turns read f.txt).
    let messages = bench.trajectory(2)["messages"].as_array().unwrap().clone();
    let observed = |needle: &str| {
        messages
            .iter()
            .filter(|m| m["role"] == "tool")
            .find(|m| {
                m["extra"]["command"]
                    .as_str()
                    .unwrap_or_default()
                    .contains(needle)
            })
            .map(|m| {
                m["extra"]["raw_output"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            })
            .unwrap()
    };
    let snooped = observed("/.executor/token");
    assert!(snooped.contains("rc=1"), "{snooped}");
    assert!(
        !snooped
            .split_whitespace()
            .any(|w| w.len() == 64 && w.chars().all(|c| c.is_ascii_hexdigit())),
        "{snooped}"
    );
    assert!(observed("cat f.txt").contains("value=2"));
    assert!(
        containers(&bench.tag).is_empty(),
        "{:?}",
        containers(&bench.tag)
    );
}

#[tokio::test]
async fn a_missing_image_a_killed_container_and_a_model_error_are_recorded_and_the_batch_goes_on() {
    let Some(image) = ready() else { return };
    let bench = Bench::new(
        4,
        &[(2, &slow_script(121)), (3, SHORT_SCRIPT)],
        &[(
            1,
            json!({"image_name": "localhost/executor-tests-no-such-image:1"}),
        )],
    );
    with_image(
        &bench,
        &image,
        json!({"environment": {"reconnect_attempts": 1}}),
    );
    let flags = podman_flags(&bench.tag);
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["-w", "4"]);
    let child = bench.command(&args).spawn().unwrap();
    // Kill instance 2's container once its long command runs.
    let victim_label = format!("executor-agent.task={}", bench.id(2));
    let victim = || {
        let out = container::podman()
            .args(["ps", "-q", "--filter", &format!("label={victim_label}")])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let running = wait_for(Duration::from_secs(90), || {
        !victim().is_empty() && crate::processes_with("sleep 121").len() == 1
    })
    .await;
    assert!(
        running,
        "instance 2 never ran its long command: {}",
        bench.log()
    );
    let killed = container::podman()
        .args(["kill", &victim()])
        .status()
        .unwrap();
    assert!(killed.success());
    let run = crate::finish(child).await;
    assert_eq!(run.code, 0);
    assert_eq!(bench.status_of(0), "Submitted", "{}", bench.log());
    assert_fixed(&bench.patch(0), 0);
    assert_eq!(bench.status_of(1), "DeploymentError");
    assert!(bench.log().contains("no-such-image"), "{}", bench.log());
    assert_eq!(bench.status_of(2), "EnvironmentError");
    assert_eq!(bench.status_of(3), "ModelError");
    for i in 1..4 {
        assert_eq!(bench.patch(i), "");
    }
    assert!(
        containers(&bench.tag).is_empty(),
        "{:?}",
        containers(&bench.tag)
    );
}

#[tokio::test]
async fn an_executor_that_never_comes_up_is_given_up_at_the_start_deadline_and_removed() {
    let Some(image) = ready() else { return };
    let bench = Bench::new(1, &[], &[]);
    with_image(&bench, &image, json!({"environment": {"start_timeout": 5}}));
    // An "executor" that never prints its ready line.
    let hang = bench.path().join("hang");
    executor_tests::write_executable(&hang, "#!/bin/sh\nexec sleep 600\n", 0o755);
    let mut flags = podman_flags(&bench.tag);
    let at = flags.iter().position(|f| f == "--executor-static").unwrap();
    flags[at + 1] = hang.display().to_string();
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let started = std::time::Instant::now();
    let run = bench.run(&args).await;
    assert_eq!(run.code, 0);
    assert!(started.elapsed() < Duration::from_secs(60));
    assert_eq!(bench.status_of(0), "DeploymentError");
    assert!(bench.log().contains("start timeout"), "{}", bench.log());
    assert!(
        containers(&bench.tag).is_empty(),
        "{:?}",
        containers(&bench.tag)
    );
}

#[tokio::test]
async fn ctrl_c_stops_a_docker_batch_and_leaves_no_container() {
    let Some(image) = ready() else { return };
    let bench = Bench::new(
        3,
        &[
            (0, &slow_script(122)),
            (1, &slow_script(122)),
            (2, &slow_script(122)),
        ],
        &[],
    );
    with_image(&bench, &image, json!({}));
    let flags = podman_flags(&bench.tag);
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["-w", "2"]);
    let child = bench.command(&args).spawn().unwrap();
    let running = wait_for(Duration::from_secs(90), || {
        bench.log().matches("executor docker").count() >= 2
            && crate::processes_with("sleep 122").len() >= 2
    })
    .await;
    assert!(running, "{}", bench.log());
    assert_eq!(containers(&bench.tag).len(), 2);
    interrupt(&child);
    let run = crate::finish(child).await;
    assert_eq!(run.code, 130);
    assert!(
        containers(&bench.tag).is_empty(),
        "{:?}",
        containers(&bench.tag)
    );
    assert!(bench.preds().is_empty(), "{:?}", bench.preds());
    assert_eq!(bench.starts(2), 0, "a new instance started after Ctrl-C");
}

/// A SWE-bench-like task: the workspace is `/testbed`, owned by root in the image. In a
/// default (unprivileged) container strict and task-container cannot create namespaces and
/// landlock's uid 65534 cannot write it; the only profile left would be `trusted`, whose
/// commands run as root in the container and can read the executor's token.
fn testbed_bench(image: &str) -> Bench {
    let bench = Bench::new(1, &[], &[]);
    with_image(&bench, image, json!({"environment": {"cwd": "/testbed"}}));
    bench
}

/// The profile the instance's commands ran under, from its trajectory.
fn profile_of(bench: &Bench) -> String {
    let text = bench.trajectory(0).to_string();
    ["strict", "landlock", "task-container", "trusted"]
        .into_iter()
        .find(|p| text.contains(&format!("\"profile\":\"{p}\"")))
        .unwrap_or_default()
        .to_string()
}

#[tokio::test]
async fn a_root_owned_workspace_fails_closed_instead_of_falling_back_to_trusted() {
    let Some(image) = ready() else { return };
    // Denial: no profile but trusted could write /testbed, and trusted is not offered.
    let bench = testbed_bench(&image);
    let flags = podman_flags(&bench.tag);
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let run = bench.run(&args).await;
    assert_eq!(run.code, 0);
    assert_eq!(bench.status_of(0), "DeploymentError", "{}", bench.log());
    let log = bench.log();
    assert!(log.contains("no sandbox profile"), "{log}");
    assert!(log.contains("/testbed"), "{log}");
    assert!(log.contains("--cap-add=SYS_ADMIN"), "{log}");
    assert!(log.contains("--profile trusted"), "{log}");
    assert!(
        !log.contains("executor: not using profile \"trusted\""),
        "{log}"
    );
    assert_eq!(bench.patch(0), "");
    assert!(
        containers(&bench.tag).is_empty(),
        "{:?}",
        containers(&bench.tag)
    );

    // Control: asked for by name, trusted runs (with a warning about the token).
    let bench = testbed_bench(&image);
    let flags = podman_flags(&bench.tag);
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["--profile", "trusted"]);
    let run = bench.run(&args).await;
    assert_eq!(run.code, 0);
    assert_eq!(bench.status_of(0), "Submitted", "{}", bench.log());
    assert_fixed(&bench.patch(0), 0);
    assert_eq!(profile_of(&bench), "trusted");
    assert!(
        run.stderr.contains("WARNING: profile \"trusted\""),
        "{}",
        run.stderr
    );
    assert!(
        containers(&bench.tag).is_empty(),
        "{:?}",
        containers(&bench.tag)
    );
}

#[tokio::test]
async fn the_namespace_run_args_of_the_error_let_a_root_owned_workspace_run_sandboxed() {
    let Some(image) = ready() else { return };
    let bench = testbed_bench(&image);
    let mut flags = podman_flags(&bench.tag);
    flags.extend([
        "--docker-run-arg=--cap-add=SYS_ADMIN".to_string(),
        "--docker-run-arg=--cap-add=NET_ADMIN".to_string(),
    ]);
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let run = bench.run(&args).await;
    assert_eq!(run.code, 0);
    assert_eq!(bench.status_of(0), "Submitted", "{}", bench.log());
    assert_fixed(&bench.patch(0), 0);
    // strict (uid 65534) cannot write a root-owned /testbed either; task-container can, as
    // root of its own namespaces, without the executor's files.
    let profile = profile_of(&bench);
    assert!(
        profile == "task-container" || profile == "strict",
        "{profile}: {}",
        bench.log()
    );
    assert!(
        containers(&bench.tag).is_empty(),
        "{:?}",
        containers(&bench.tag)
    );
}

/// The batch's argument list with podman's flags and `-w workers`.
fn podman_args(bench: &Bench, workers: &str) -> Vec<String> {
    let mut args = podman_flags(&bench.tag);
    args.extend(["-w".to_string(), workers.to_string()]);
    args
}

#[tokio::test]
async fn sigterm_stops_a_docker_batch_cleanly_and_leaves_no_container() {
    let Some(image) = ready() else { return };
    // 0 finishes at once; 1 and 2 are running their first command at the SIGTERM.
    let bench = Bench::new(3, &[(1, &slow_script(123)), (2, &slow_script(123))], &[]);
    with_image(&bench, &image, json!({}));
    let args = podman_args(&bench, "2");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let child = bench.command(&args).spawn().unwrap();
    let running = wait_for(Duration::from_secs(120), || {
        bench.preds().len() == 1 && crate::processes_with("sleep 123").len() >= 2
    })
    .await;
    assert!(
        running,
        "never reached one done and two running: {}",
        bench.log()
    );
    assert_eq!(containers(&bench.tag).len(), 2);
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let run = crate::finish(child).await;
    // Not killed by the signal: it stopped, saved, tore down and said so.
    assert_eq!(run.code, 130, "{}", run.stderr);
    assert!(run.stderr.contains("batch: interrupted"), "{}", run.stderr);
    // preds.json is whole and holds only what finished, with its patch.
    let preds = bench.preds();
    assert_eq!(preds.keys().cloned().collect::<Vec<_>>(), [bench.id(0)]);
    assert_fixed(&bench.patch(0), 0);
    for i in 1..3 {
        assert_eq!(bench.trajectory(i)["info"]["exit_status"], "Interrupted");
        assert_eq!(bench.status_of(i), "Interrupted");
    }
    assert!(
        containers(&bench.tag).is_empty(),
        "{:?}",
        containers(&bench.tag)
    );
    assert!(crate::processes_with("sleep 123").is_empty());
}

/// A killed agent (`kill -9`): its container goes by itself, by its lifeline (the attached
/// client's stdin closes, the executor exits on EOF, `--rm` removes it). One whose executor
/// cannot notice (stuck: paused here) is left behind, and `agent deploy reap` (no `--run`:
/// judged by the owner labels, whose agent is gone) removes it.
#[tokio::test]
async fn a_killed_docker_batch_leaves_a_stuck_container_to_deploy_reap() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let Some(image) = ready() else { return };
    let start = |bench: &Bench| {
        let args = podman_args(bench, "1");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        bench.command(&args).spawn().unwrap()
    };
    let running = |bench: &Bench, sleep: &'static str| {
        let tag = bench.tag.clone();
        let out = bench.out();
        async move {
            let up = wait_for(Duration::from_secs(120), || {
                containers(&tag).len() == 1 && crate::processes_with(sleep).len() == 1
            })
            .await;
            let log = std::fs::read_to_string(out.join("minisweagent.log")).unwrap_or_default();
            assert!(up, "the instance never ran its long command: {log}");
        }
    };
    let sigkill = |child: &tokio::process::Child| {
        kill(Pid::from_raw(child.id().unwrap() as i32), Signal::SIGKILL).unwrap();
    };

    // The control: a live executor sees its lifeline end and its container goes by itself.
    let alone = Bench::new(1, &[(0, &slow_script(124))], &[]);
    with_image(&alone, &image, json!({}));
    let mut child = start(&alone);
    running(&alone, "sleep 124").await;
    sigkill(&child);
    let _ = child.wait().await;
    let gone = wait_for(Duration::from_secs(30), || {
        containers(&alone.tag).is_empty()
    })
    .await;
    assert!(gone, "{:?}", containers(&alone.tag));

    // A stuck one stays (still there after a while, its command still running) ...
    let bench = Bench::new(1, &[(0, &slow_script(125))], &[]);
    with_image(&bench, &image, json!({}));
    let mut child = start(&bench);
    running(&bench, "sleep 125").await;
    let left = containers(&bench.tag);
    let paused = container::podman()
        .args(["pause", &left[0]])
        .status()
        .unwrap();
    assert!(paused.success());
    sigkill(&child);
    let _ = child.wait().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(containers(&bench.tag), left);
    assert_eq!(crate::processes_with("sleep 125").len(), 1);
    // ... until `agent deploy reap` removes it: its owner, the killed agent, is gone.
    let reap = tokio::process::Command::new(executor_tests::binary("agent"))
        .args(["deploy", "reap", "--docker-executable", "podman"])
        .arg("--docker-global-arg=--runtime=runc")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&reap.stderr);
    assert!(reap.status.success(), "{stderr}");
    assert!(
        containers(&bench.tag).is_empty(),
        "{:?}: {stderr}",
        containers(&bench.tag)
    );
    let cleared = wait_for(Duration::from_secs(15), || {
        crate::processes_with("sleep 125").is_empty()
            && crate::processes_with(&bench.tag).is_empty()
    })
    .await;
    assert!(cleared, "{:?}", crate::processes_with(&bench.tag));
}
