//! `agent deploy reap` removes the containers whose agent is gone and keeps those of agents
//! still running (a live batch's), judged by the owner labels every container carries.

use executor_tests::{binary, container};

use crate::batch_docker::containers;

/// This process's start time (field 22 of /proc/<pid>/stat), as the agent records its own.
fn start_time(pid: u32) -> String {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 1..];
    after.split_whitespace().nth(19).unwrap().to_string()
}

/// A sleeping container labelled as ours, owned by `pid` started at `start` on this host.
fn labelled_container(image: &str, tag: &str, pid: u32, start: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let pidns = std::fs::read_link("/proc/self/ns/pid").unwrap();
    let out = container::podman()
        .args([
            "run",
            "-d",
            "--ulimit=nofile=1024:1024",
            "--ulimit=nproc=4096:4096",
        ])
        .args(["--label", "executor-agent=1"])
        .args(["--label", &format!("executor-tests-deploy={tag}")])
        .args([
            "--label",
            &format!("executor-agent.owner-host={}", host.trim()),
        ])
        .args([
            "--label",
            &format!("executor-agent.owner-pidns={}", pidns.display()),
        ])
        .args(["--label", &format!("executor-agent.owner-pid={pid}")])
        .args(["--label", &format!("executor-agent.owner-start={start}")])
        .args([image, "sleep", "600"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn reap_removes_the_container_of_a_dead_agent_and_keeps_a_live_ones() {
    if !container::available() {
        return;
    }
    let image = container::image().unwrap();
    let tag = executor_tests::marker();
    // Owner alive: this test process.
    let me = std::process::id();
    let live = labelled_container(&image, &tag, me, &start_time(me));
    // Owner dead: a process that has exited.
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = gone.id();
    let dead_start = start_time(dead_pid);
    gone.wait().unwrap();
    let dead = labelled_container(&image, &tag, dead_pid, &dead_start);
    // Owner's pid reused by another process: this one's pid, another start time.
    let reused = labelled_container(&image, &tag, me, "1");
    assert_eq!(containers(&tag).len(), 3);

    let out = std::process::Command::new(binary("agent"))
        .args(["deploy", "reap", "--docker-executable", "podman"])
        .arg("--docker-global-arg=--runtime=runc")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let left = containers(&tag);
    let short = |id: &str| id[..12].to_string();
    let left: Vec<String> = left.iter().map(|id| short(id)).collect();
    assert!(
        left.contains(&short(&live)),
        "the live agent's container was removed: {stderr}"
    );
    assert!(!left.contains(&short(&dead)), "{stderr}");
    assert!(!left.contains(&short(&reused)), "{stderr}");
    assert!(stderr.contains("kept"), "{stderr}");

    let _ = container::podman().args(["rm", "-f", &live]).output();
    assert!(containers(&tag).is_empty());
}

/// Every command that deploys names its run at random, as a batch does: `agent exec`'s
/// container is labelled `exec<12 hex digits>`, never with the agent's pid (which agents in
/// other pid namespaces sharing the container daemon may have too, and whose end-of-run reap
/// by run label would then remove this one's containers).
#[tokio::test]
async fn exec_labels_its_container_with_a_random_run_id_not_its_pid() {
    if !container::available() {
        return;
    }
    let image = container::task_image().unwrap();
    let tag = executor_tests::marker();
    let mut flags = crate::batch_docker::podman_flags(&tag);
    flags.extend(["--image".to_string(), image]);
    let child = tokio::process::Command::new(binary("agent"))
        .arg("exec")
        .args(&flags)
        .args(["--", "sleep 20; echo done"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap().to_string();
    let up = crate::wait_for(std::time::Duration::from_secs(60), || {
        containers(&tag).len() == 1
    })
    .await;
    assert!(up, "no container came up");
    let out = container::podman()
        .args([
            "inspect",
            "--format",
            "{{index .Config.Labels \"executor-agent.run\"}}",
        ])
        .arg(&containers(&tag)[0])
        .output()
        .unwrap();
    let run = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let digits = run.strip_prefix("exec").unwrap_or_default();
    assert_eq!(digits.len(), 12, "{run:?}");
    assert!(digits.chars().all(|c| c.is_ascii_hexdigit()), "{run:?}");
    assert_ne!(run, format!("exec{pid}"));
    let done = tokio::time::timeout(std::time::Duration::from_secs(90), child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&done.stdout).trim(), "done");
    assert!(containers(&tag).is_empty(), "{:?}", containers(&tag));
}
