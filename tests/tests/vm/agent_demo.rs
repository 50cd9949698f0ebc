//! The agent's demo task submitted against the VM's executor, as from another machine: the
//! agent gets the `wss://` URL of the forwarded port, the token file and the pinned
//! fingerprint (agent/README.md, "A remote executor").

use std::time::Duration;

use executor_tests::{binary, vm, Target};

#[tokio::test]
async fn the_agent_demo_task_is_submitted_against_the_vm() {
    let Some(vm) = vm::shared() else { return };
    let run = tokio::process::Command::new(binary("agent"))
        .args(["run", "--demo"])
        .args(vm.agent_args())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(600), run)
        .await
        .expect("the demo finished within 10 minutes")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "agent failed: {stdout}\n{stderr}");
    assert!(
        stdout.contains("Exit status: Submitted"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("+  echo $(( $1 + $2 ))"),
        "no fix in the diff: {stdout}"
    );
    // From outside: the repository in the VM holds the fix the model made. It lies in the
    // executor's workspace (strict's /tmp is private to each command).
    let repo = stdout
        .lines()
        .find_map(|l| l.strip_prefix("Demo repository: "))
        .and_then(|l| l.strip_suffix(" (on the executor's machine)"))
        .unwrap_or_else(|| panic!("the agent names the repository on the VM: {stdout}"));
    let lib = vm.outside_ok(&format!("cat {repo}/mathlib.sh"));
    assert!(lib.contains("$1 + $2"), "the VM's mathlib.sh: {lib}");
}
