//! Per-command process and memory limits under pure cgroup v2 (issue 10, Deliver 2): each
//! command's cgroup carries `pids.max` and `memory.max` (swap off, `memory.oom.group`), the
//! kernel stops the command at the limit, and the result says which limit it hit. Checked from
//! outside: the cgroup files of the running command and the kernel's own counters, read
//! through the side channel. The `-small` profiles are the shipped ones with 64 processes and
//! 128 MiB (`executor_tests::profiles`), so the limits are reached in seconds under emulation.

use std::time::Duration;

use executor_tests::checks::{
    cancel, each_profile, each_profile_in_turn, preq, run_as, start_until,
};
use executor_tests::profiles::{SMALL_MEMORY_MB, SMALL_PROCESSES};
use executor_tests::target::{assert_none_left, wait_sleepers};
use executor_tests::vm::Vm;
use executor_tests::{marked_sleep, marker, vm, Target};

const SMALL: [&str; 3] = ["strict-small", "landlock-small", "task-container-small"];

/// The nearest cgroup, from the process's own up to the root, whose `file` is not `max`:
/// `(directory, value)`. A limit may sit on a parent of the command's leaf.
fn limit_of(vm: &Vm, pid: i32, file: &str) -> Option<(String, String)> {
    let script = format!(
        "path=$(sed -n 's/^0:://p' /proc/{pid}/cgroup)\n\
         while :; do\n\
           v=$(cat \"/sys/fs/cgroup$path/{file}\" 2>/dev/null)\n\
           if [ -n \"$v\" ] && [ \"$v\" != max ]; then echo \"/sys/fs/cgroup$path $v\"; exit 0; fi\n\
           [ -z \"$path\" ] || [ \"$path\" = / ] && exit 1\n\
           path=${{path%/*}}\n\
         done"
    );
    let out = vm.outside(&script);
    let line = out.output.trim();
    (out.code == 0)
        .then(|| line.split_once(' '))
        .flatten()
        .map(|(dir, value)| (dir.to_string(), value.to_string()))
}

#[tokio::test]
async fn a_fork_bomb_stops_at_pids_max_and_the_result_says_so() {
    let Some(vm) = vm::shared() else { return };
    each_profile(&SMALL, move |profile| async move {
        let m = marker();
        let id = format!("{profile}-bomb");
        let mut client = vm.endpoint().connect().await;
        // More sleeps than the limit allows; bash retries failed forks, so it never finishes
        // on its own: the test cancels it once the limit is seen from outside.
        let bomb = format!(
            "echo forking; i=0; while [ $i -lt 200 ]; do {} & i=$((i+1)); done 2>/dev/null; wait",
            marked_sleep(&m)
        );
        start_until(
            &mut client,
            preq(Some(&profile), &id, &bomb, 600.0),
            "forking",
        )
        .await;
        // Control: the command really forks, up to (nearly) the limit.
        let floor = SMALL_PROCESSES as usize / 2;
        let mut seen = 0;
        let reached = executor_tests::checks::eventually_slow(Duration::from_secs(120), || {
            seen = vm.sleepers(&m).len();
            seen >= floor
        })
        .await;
        assert!(reached, "only {seen} sleeps started (expected {floor}+)");
        let pid = vm.sleepers(&m)[0].pid;
        let (dir, max) = limit_of(vm, pid, "pids.max")
            .unwrap_or_else(|| panic!("no pids.max above the command's process {pid}"));
        assert_eq!(max, SMALL_PROCESSES.to_string(), "pids.max of {dir}");
        // The kernel refused forks at the limit: pids.events counts them.
        let refused = executor_tests::checks::eventually_slow(Duration::from_secs(120), || {
            vm.outside_ok(&format!("cat {dir}/pids.events"))
                .split_whitespace()
                .nth(1)
                .and_then(|n| n.parse::<u64>().ok())
                .is_some_and(|n| n > 0)
        })
        .await;
        assert!(refused, "pids.events of {dir} never counted a refused fork");
        let total = vm.sleepers(&m).len();
        assert!(
            total <= SMALL_PROCESSES as usize,
            "{total} sleeps run, above pids.max {SMALL_PROCESSES}"
        );
        let result = cancel(&mut client, &id).await;
        assert!(
            result.extra.limits_hit.iter().any(|l| l == "processes"),
            "the result does not report the processes limit: {:?}",
            result.extra
        );
        assert_none_left(vm, &m, "the cancelled fork bomb").await;
    })
    .await;
}

#[tokio::test]
async fn memory_max_is_set_with_swap_off_and_oom_group_on_each_command() {
    let Some(vm) = vm::shared() else { return };
    each_profile(&SMALL, move |profile| async move {
        let m = marker();
        let id = format!("{profile}-mem-files");
        let mut client = vm.endpoint().connect().await;
        let r = preq(
            Some(&profile),
            &id,
            &format!("echo up; {}", marked_sleep(&m)),
            600.0,
        );
        start_until(&mut client, r, "up").await;
        let pid = wait_sleepers(vm, &m, 1).await[0].pid;
        let (dir, max) = limit_of(vm, pid, "memory.max")
            .unwrap_or_else(|| panic!("no memory.max above the command's process {pid}"));
        assert_eq!(
            max,
            (SMALL_MEMORY_MB * 1024 * 1024).to_string(),
            "memory.max of {dir}"
        );
        let swap = vm.outside(&format!("cat {dir}/memory.swap.max"));
        if swap.code == 0 {
            assert_eq!(swap.output.trim(), "0", "memory.swap.max of {dir}");
        }
        let group = vm.outside_ok(&format!("cat {dir}/memory.oom.group"));
        assert_eq!(group.trim(), "1", "memory.oom.group of {dir}");
        cancel(&mut client, &id).await;
        assert_none_left(vm, &m, "the cancelled sleep").await;
    })
    .await;
}

/// `$(...)` of `n` bytes: bash holds the whole string in memory.
fn hold_bytes(n: u64) -> String {
    format!("x=$(head -c {n} /dev/zero | tr '\\0' a); echo held ${{#x}}")
}

#[tokio::test]
async fn a_command_past_memory_max_is_oom_killed_and_the_result_says_so() {
    let Some(vm) = vm::shared() else { return };
    each_profile_in_turn(&SMALL, move |profile| async move {
        let mut client = vm.endpoint().connect().await;
        // Control: well under the limit, the same command completes.
        let small = run_as(
            &mut client,
            Some(&profile),
            "mem-ok",
            &hold_bytes(20_000_000),
            120.0,
        )
        .await;
        assert_eq!(small.output, "held 20000000\n", "{small:?}");
        assert!(small.extra.limits_hit.is_empty(), "{:?}", small.extra);
        let ooms_before = oom_kills(vm);
        let big = run_as(
            &mut client,
            Some(&profile),
            "mem-big",
            &hold_bytes(400_000_000),
            300.0,
        )
        .await;
        assert!(
            !big.output.contains("held"),
            "held 400 MB under a 128 MiB limit: {big:?}"
        );
        assert!(
            big.extra.limits_hit.iter().any(|l| l == "memory"),
            "the result does not report the memory limit: {big:?}"
        );
        // The kernel's own record: a memory-cgroup OOM kill, not a failed allocation.
        assert!(
            oom_kills(vm) > ooms_before,
            "no memory cgroup OOM kill in the VM's kernel log: {big:?}"
        );
    })
    .await;
}

/// Memory-cgroup OOM kills in the VM's kernel log so far.
fn oom_kills(vm: &Vm) -> usize {
    vm.outside("dmesg | grep -c 'Memory cgroup out of memory'")
        .output
        .trim()
        .parse()
        .unwrap_or(0)
}
