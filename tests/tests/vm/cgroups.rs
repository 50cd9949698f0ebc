//! The daemon's own place under pure cgroup v2, as a systemd service with `Delegate=yes` has it:
//! the VM's /init starts it in `system.slice/executor.service` (not the root cgroup, which the
//! "no internal processes" rule exempts), so before it can enable `pids` and `memory` for its
//! commands it must move into a leaf of its own. Checked through the side channel: where the
//! daemon is now, what the service's cgroup enables, and where a running command's cgroup sits
//! with its limits.

use std::time::Duration;

use executor_tests::checks::{cancel, eventually_slow, preq, start_until};
use executor_tests::profiles::{SMALL_MEMORY_MB, SMALL_PROCESSES};
use executor_tests::target::{assert_none_left, wait_sleepers};
use executor_tests::vm::Vm;
use executor_tests::{marked_sleep, marker, vm, Target};

/// The cgroup /init starts the daemon in (tests/src/vm/init.sh).
const SERVICE: &str = "/system.slice/executor.service";

/// The `0::` path of a process in the VM.
fn cgroup_of(vm: &Vm, pid: i32) -> String {
    let text = vm.outside_ok(&format!("cat /proc/{pid}/cgroup"));
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or_else(|| panic!("no cgroup2 line for {pid}: {text}"))
        .to_string()
}

/// A file of a cgroup in the VM, trimmed.
fn cgroup_file(vm: &Vm, cgroup: &str, file: &str) -> String {
    vm.outside_ok(&format!("cat /sys/fs/cgroup{cgroup}/{file}"))
        .trim()
        .to_string()
}

#[tokio::test]
async fn the_daemon_started_in_a_service_cgroup_moves_into_a_leaf_and_commands_sit_beside_it() {
    let Some(vm) = vm::shared() else { return };
    let daemon = vm.daemon_pid();
    // Control: /init started the daemon in the service's cgroup.
    let started = format!("vm-init: executor started as pid {daemon} in /sys/fs/cgroup{SERVICE}");
    assert!(
        vm.console().contains(&started),
        "{started:?} not on the console:\n{}",
        vm.console()
    );
    // It moved into `executor-<pid>-ns<ns>-daemon` below it.
    let own = cgroup_of(vm, daemon);
    let leaf = own
        .strip_prefix(&format!("{SERVICE}/"))
        .unwrap_or_else(|| panic!("the daemon left {SERVICE}: {own}"));
    let prefix = format!("executor-{daemon}-ns");
    assert!(
        leaf.starts_with(&prefix) && leaf.ends_with("-daemon") && !leaf.contains('/'),
        "the daemon is not in a leaf of its own: {own}"
    );
    // The service's cgroup now holds no process and enables both controllers for its children.
    assert_eq!(
        cgroup_file(vm, SERVICE, "cgroup.procs"),
        "",
        "{SERVICE} still holds processes"
    );
    let enabled = cgroup_file(vm, SERVICE, "cgroup.subtree_control");
    for c in ["pids", "memory"] {
        assert!(
            enabled.split_whitespace().any(|w| w == c),
            "{SERVICE} does not enable {c}: {enabled:?}"
        );
    }
    // The commands' parent sits beside the daemon's leaf and passes the controllers on.
    let parent = format!("{SERVICE}/{}", leaf.trim_end_matches("-daemon"));
    let passed = cgroup_file(vm, &parent, "cgroup.subtree_control");
    for c in ["pids", "memory"] {
        assert!(
            passed.split_whitespace().any(|w| w == c),
            "{parent} does not enable {c}: {passed:?}"
        );
    }
    // A running command's cgroup is a child of that parent, with the profile's limits.
    let m = marker();
    let mut client = vm.endpoint().connect().await;
    let r = preq(
        Some("landlock-small"),
        "placed",
        &format!("echo up; {}", marked_sleep(&m)),
        600.0,
    );
    start_until(&mut client, r, "up").await;
    let sleeper = wait_sleepers(vm, &m, 1).await[0].pid;
    let command = cgroup_of(vm, sleeper);
    let below = command
        .strip_prefix(&format!("{parent}/"))
        .unwrap_or_else(|| panic!("the command is not below {parent}: {command}"));
    let leaf_of_command = below.split('/').next().unwrap_or_default();
    let cgroup = format!("{parent}/{leaf_of_command}");
    assert_eq!(
        cgroup_file(vm, &cgroup, "pids.max"),
        SMALL_PROCESSES.to_string(),
        "pids.max of {cgroup}"
    );
    assert_eq!(
        cgroup_file(vm, &cgroup, "memory.max"),
        (SMALL_MEMORY_MB * 1024 * 1024).to_string(),
        "memory.max of {cgroup}"
    );
    // Control: the daemon's own leaf has no such limit (the limits are the command's).
    assert_eq!(
        cgroup_file(vm, &own, "pids.max"),
        "max",
        "pids.max of {own}"
    );
    cancel(&mut client, "placed").await;
    assert_none_left(vm, &m, "the cancelled command").await;
    // The command's cgroup is removed with it; the daemon's leaf stays.
    let removed = eventually_slow(Duration::from_secs(30), || {
        vm.outside(&format!("test -d /sys/fs/cgroup{cgroup}")).code != 0
    })
    .await;
    assert!(removed, "{cgroup} is left behind");
    assert_eq!(cgroup_of(vm, daemon), own);
}

#[tokio::test]
async fn the_hello_names_cgroup_v2_with_both_controllers_and_landlock_abi_2() {
    let Some(vm) = vm::shared() else { return };
    let client = vm.endpoint().connect().await;
    let host = &client.hello.host;
    let cgroups = &host.cgroups;
    assert_eq!(cgroups.mode, "v2", "{host:?}");
    assert_eq!(cgroups.pids, "v2", "{host:?}");
    assert_eq!(cgroups.memory, "v2", "{host:?}");
    assert!(cgroups.kill, "6.1 has cgroup.kill: {host:?}");
    assert_eq!(host.landlock_abi, 2, "{host:?}");
}
