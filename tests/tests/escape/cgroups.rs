//! Cgroup escape: a command writes its own pid into another cgroup's `cgroup.procs` (the v2
//! root and every v1 hierarchy) to leave the cgroup that is killed as a whole. The host reads
//! the process's /proc/<pid>/cgroup while it runs. Control under `trusted`: the move works, and
//! the subreaper sweep still kills the escapee.

use executor_tests::{eventually, marked_sleep, marker, processes_matching};

use crate::common::*;

/// `0::<path>` line of /proc/<pid>/cgroup.
fn v2_path(pid: i32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("0::").map(str::to_string))
}

#[tokio::test]
async fn writing_own_pid_into_another_cgroup_is_denied() {
    let Some(daemon) = daemon() else {
        return;
    };
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let m = marker();
        let probe = format!(
            "{s} & p=$!\n\
             moved=0\n\
             for f in /sys/fs/cgroup/unified/cgroup.procs /sys/fs/cgroup/cgroup.procs \
                      /sys/fs/cgroup/*/cgroup.procs; do\n\
               [ -e \"$f\" ] || continue\n\
               echo $p > \"$f\" 2>/dev/null && moved=$((moved+1))\n\
             done\n\
             echo moved=$moved; echo ready; wait",
            s = marked_sleep(&m)
        );
        let (id, out) = start_until(client, row.profile, "cgroup", &probe, "ready", 30.0).await;
        let pids = wait_sleepers(&m, 1).await;
        let now = v2_path(pids[0]).unwrap();
        match row.expect {
            Denied => {
                assert_eq!(field(&out, "moved"), Some("0"), "{row} {out}");
                assert!(
                    now.contains(&format!("executor-{}-ns", daemon.pid())),
                    "{row} the process left the daemon's command cgroup: {now} ({out})"
                );
            }
            Allowed => {
                assert_ne!(field(&out, "moved"), Some("0"), "{row} control: {out}");
                assert!(
                    !now.contains("executor-"),
                    "{row} control: the host sees the move ({now})"
                );
            }
        }
        cancel(client, &id).await;
        // Moved or not, the escapee dies with its command.
        assert!(
            eventually(executor_tests::PATIENCE, || processes_matching(&m)
                .is_empty())
            .await,
            "{row} survivor {:?}",
            processes_matching(&m)
        );
    })
    .await;
    assert_daemon_intact(&daemon).await;
}
