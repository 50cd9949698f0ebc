//! Which profiles the 6.1 kernel offers, and why: the hello, `executor check` run in the VM,
//! and a command under each profile the hello calls available.

use executor_tests::checks::run_as;
use executor_tests::profiles::SHIPPED;
use executor_tests::{vm, Target};

/// What issue 10 asks of a 6.1 kernel with namespaces: landlock's rights are enforced as far
/// as its ABI (2) goes, the missing ones named, so strict (whose network namespace does what
/// the missing TCP rules would) and landlock (whose seccomp filter refuses IP sockets) run, and
/// strict is the default; task-container and trusted need nothing 6.1 lacks.
const EXPECTED_AVAILABLE: [&str; 4] = ["strict", "landlock", "task-container", "trusted"];

#[tokio::test]
async fn the_61_kernel_offers_every_profile_with_strict_by_default_and_check_agrees() {
    let Some(vm) = vm::shared() else { return };
    let mut client = vm.endpoint().connect().await;
    let hello = client.hello.clone();
    assert!(
        hello.host.kernel.starts_with("Linux 6.1."),
        "not the 6.1 kernel: {:?}",
        hello.host
    );
    // `executor check` with the daemon's --profiles-dir: the shipped profiles and the -small
    // ones, every one the hello lists.
    let check = vm.outside("executor check --profiles-dir /etc/executor/profiles");
    eprintln!("executor check in the VM:\n{}", check.output);
    for name in SHIPPED {
        assert!(
            hello.profiles.iter().any(|p| p.name == name),
            "the hello does not list {name}"
        );
    }
    for profile in &hello.profiles {
        eprintln!(
            "hello: {} available={} layers={:?} reason={:?}",
            profile.name, profile.available, profile.layers, profile.unavailable_reason
        );
        // check prints one line per profile: "  NAME  ok  layers" or "  NAME  NO  reason".
        let line = check
            .output
            .lines()
            .find(|l| l.split_whitespace().next() == Some(profile.name.as_str()))
            .unwrap_or_else(|| panic!("executor check does not list {}", profile.name));
        let verdict = line.split_whitespace().nth(1);
        assert_eq!(
            verdict,
            Some(if profile.available { "ok" } else { "NO" }),
            "check and hello disagree on {}: {line}",
            profile.name
        );
        if !profile.available {
            assert!(
                profile
                    .unavailable_reason
                    .as_deref()
                    .is_some_and(|r| !r.is_empty()),
                "{} is unavailable without a reason",
                profile.name
            );
        }
    }
    // Every profile the hello offers runs a command (the control of the list above).
    for profile in hello.profiles.iter().filter(|p| p.available) {
        let result = run_as(
            &mut client,
            Some(&profile.name),
            &format!("probe-{}", profile.name),
            "echo ran",
            crate::SLOW_TIMEOUT,
        )
        .await;
        assert_eq!(result.output, "ran\n", "[{}] {result:?}", profile.name);
    }
    let unavailable: Vec<String> = EXPECTED_AVAILABLE
        .iter()
        .filter(|name| {
            !hello
                .profiles
                .iter()
                .any(|p| &p.name == *name && p.available)
        })
        .map(|name| {
            let reason = hello
                .profiles
                .iter()
                .find(|p| &p.name == name)
                .and_then(|p| p.unavailable_reason.clone());
            format!("{name}: {reason:?}")
        })
        .collect();
    assert!(
        unavailable.is_empty(),
        "profiles the 6.1 kernel should run are unavailable:\n{}",
        unavailable.join("\n")
    );
    assert_eq!(hello.default_profile, "strict", "default profile on 6.1");
}

#[tokio::test]
async fn check_names_cgroup_v2_with_its_pids_and_memory_controllers() {
    let Some(vm) = vm::shared() else { return };
    // Control: the VM really is pure cgroup v2 with both controllers (cgroup_no_v1=all).
    let controllers = vm.outside_ok("cat /sys/fs/cgroup/cgroup.controllers");
    for c in ["pids", "memory"] {
        assert!(
            controllers.split_whitespace().any(|w| w == c),
            "{controllers}"
        );
    }
    assert!(
        vm.outside_ok("grep -c ' cgroup ' /proc/mounts || true")
            .trim()
            == "0",
        "a cgroup v1 hierarchy is mounted in the VM"
    );
    let check = vm.outside_ok("executor check");
    assert!(check.contains("cgroups: v2"), "{check}");
    for name in ["pids limit", "memory limit", "cgroup.kill"] {
        let line = check
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("check has no {name:?} line:\n{check}"));
        assert!(
            line.contains("cgroup v2") || (name == "cgroup.kill" && line.contains("yes")),
            "on pure cgroup v2, check says no per-command {name}:\n{check}"
        );
    }
    assert!(check.contains("landlock: ABI 2"), "{check}");
}
