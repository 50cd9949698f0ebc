//! The default, unprivileged container: no CAP_SYS_ADMIN, seccomp on, read-only cgroups.

use executor_tests::checks::{each_profile, run_as, tree_dies, End};
use executor_tests::{container, marked_sleep, marker, Target};

#[tokio::test]
async fn namespaces_are_refused_so_the_daemon_says_so_and_defaults_to_landlock() {
    let Some(c) = container::shared() else { return };
    let mut client = c.endpoint().connect().await;
    let hello = &client.hello;
    let profile = |name: &str| {
        hello
            .profiles
            .iter()
            .find(|p| p.name == name)
            .unwrap()
            .clone()
    };
    let strict = profile("strict");
    assert!(
        !strict.available,
        "strict runs in an unprivileged container: {strict:?}"
    );
    let reason = strict.unavailable_reason.clone().unwrap_or_default();
    assert!(
        reason.contains("namespace") || reason.contains("unshare"),
        "strict's reason does not name the namespaces: {reason}"
    );
    assert!(profile("landlock").available, "{:?}", profile("landlock"));
    assert_eq!(hello.default_profile, "landlock");
    // Control: a command under the default profile runs, and says it ran under landlock.
    let result = run_as(&mut client, None, "default", "id -u", crate::TIMEOUT).await;
    assert_eq!(result.output, "65534\n", "{result:?}");
    assert_eq!(result.extra.isolation.profile, "landlock");
    // `executor check` in the container agrees (run beside the daemon, outside the sandbox).
    let check = c.outside_ok("executor check");
    assert!(
        check
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()[..].starts_with(&["strict", "NO"])),
        "{check}"
    );
    assert!(check.contains("default profile: landlock"), "{check}");
}

#[tokio::test]
async fn whole_trees_die_on_timeout_cancel_and_a_dropped_client() {
    let Some(c) = container::shared() else { return };
    each_profile(&["landlock", "trusted"], move |profile| async move {
        for how in [End::Timeout, End::Cancel, End::Disconnect] {
            tree_dies(c, Some(&profile), how, crate::TIMEOUT).await;
        }
    })
    .await;
}

#[tokio::test]
async fn a_command_cannot_read_the_token_which_the_daemon_still_uses() {
    let Some(c) = container::shared() else { return };
    let token = c.endpoint().token;
    // Control: the file holds the token, readable from outside the sandbox.
    assert_eq!(c.outside_ok("cat /etc/executor-token").trim(), token);
    let mut client = c.endpoint().connect().await;
    let probe = "cat /etc/executor-token; cat /var/lib/executor/tls/key.pem; \
                 ls /var/lib/executor >/dev/null && echo listed-state; echo done";
    let result = run_as(&mut client, None, "token", probe, crate::TIMEOUT).await;
    assert!(result.output.contains("done"), "{result:?}");
    assert!(
        !result.output.contains(&token),
        "the command read the token: {result:?}"
    );
    assert!(
        !result.output.contains("PRIVATE KEY"),
        "the command read the TLS key: {result:?}"
    );
    // And the daemon still authenticates with it.
    c.endpoint().connect().await;
}

#[tokio::test]
async fn a_command_cannot_replace_the_executor_binary() {
    let Some(c) = container::shared() else { return };
    let before = c.outside_ok("sha256sum /usr/local/bin/executor");
    let mut client = c.endpoint().connect().await;
    let m = marker();
    let probe = format!(
        "echo x > /usr/local/bin/executor 2>/dev/null && echo overwrote\n\
         mv /usr/local/bin/executor /tmp/moved-{m} 2>/dev/null && echo moved\n\
         cp /bin/busybox /usr/local/bin/executor 2>/dev/null && echo replaced\n\
         cp /bin/busybox /tmp/copy-{m} && echo ok > /tmp/copy-{m} && echo wrote-tmp"
    );
    let result = run_as(&mut client, None, "binary", &probe, crate::TIMEOUT).await;
    assert!(result.output.contains("wrote-tmp"), "control: {result:?}");
    for verb in ["overwrote", "moved", "replaced"] {
        assert!(
            !result.output.contains(verb),
            "{verb} the binary: {result:?}"
        );
    }
    assert_eq!(c.outside_ok("sha256sum /usr/local/bin/executor"), before);
    let host = executor_tests::static_executor();
    let on_host = executor_tests::target::host_shell(&format!("sha256sum < {}", host.display()));
    assert_eq!(
        before.split_whitespace().next(),
        on_host.output.split_whitespace().next(),
        "the container's executor is not the host's static build"
    );
    // From outside: the allowed write landed.
    assert_eq!(c.outside_ok(&format!("cat /tmp/copy-{m}")), "ok\n");
}

#[tokio::test]
async fn a_command_under_the_default_profile_writes_its_workspace() {
    let Some(c) = container::shared() else { return };
    let mut client = c.endpoint().connect().await;
    let m = marker();
    let result = run_as(
        &mut client,
        None,
        "workspace",
        &format!("pwd; echo ok > written-{m} && echo wrote"),
        crate::TIMEOUT,
    )
    .await;
    assert!(result.output.contains("wrote"), "{result:?}");
    // From outside: the file is in the daemon's workspace.
    let workspace = client.hello.workspace.clone();
    assert_eq!(
        c.outside_ok(&format!("cat {workspace}/written-{m}")),
        "ok\n"
    );
}

#[tokio::test]
async fn a_command_cannot_signal_the_daemon_but_can_signal_its_own_children() {
    let Some(c) = container::shared() else { return };
    let daemon = c.daemon_host_pid().unwrap();
    let mut client = c.endpoint().connect().await;
    // The daemon is the container's pid 1.
    let probe = "sleep 30 & kill -9 $! && echo own-killed; \
                 kill -9 1 2>/dev/null && echo daemon-killed || echo daemon-refused";
    let result = run_as(&mut client, None, "signal", probe, crate::TIMEOUT).await;
    assert!(result.output.contains("own-killed"), "control: {result:?}");
    assert!(result.output.contains("daemon-refused"), "{result:?}");
    assert!(c.running(), "the container stopped");
    assert_eq!(c.daemon_host_pid(), Some(daemon), "the daemon changed");
    c.endpoint().connect().await;
}

#[tokio::test]
async fn process_and_memory_limits_hold_in_the_container() {
    let Some(c) = container::shared() else { return };
    let m = marker();
    let mut client = c.endpoint().connect().await;
    // 64 processes (landlock-small): more sleeps than that cannot start; the host counts them.
    let bomb = format!(
        "i=0; while [ $i -lt 100 ]; do {} & i=$((i+1)); done 2>/dev/null; echo forked",
        marked_sleep(&m)
    );
    let mut r = executor_tests::checks::preq(Some("landlock-small"), "bomb", &bomb, 60.0);
    r.stream = true;
    client.send(&protocol::ClientMessage::Exec(r)).await;
    let mut most = 0;
    let reached = executor_tests::eventually(std::time::Duration::from_secs(30), || {
        most = most.max(c.sleepers(&m).len());
        most >= 32
    })
    .await;
    assert!(reached, "control: only {most} sleeps started");
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    most = most.max(c.sleepers(&m).len());
    assert!(most <= 64, "{most} sleeps ran under a 64-process limit");
    let result = executor_tests::checks::cancel(&mut client, "bomb").await;
    eprintln!("bomb result: {:?}", result.extra);
    executor_tests::target::assert_none_left(c, &m, "the fork bomb").await;
    // 128 MiB (landlock-small): 20 MB can be held, 400 MB cannot.
    let hold = |n: u64| format!("x=$(head -c {n} /dev/zero | tr '\\0' a); echo held ${{#x}}");
    let small = run_as(
        &mut client,
        Some("landlock-small"),
        "mem-ok",
        &hold(20_000_000),
        60.0,
    )
    .await;
    assert_eq!(small.output, "held 20000000\n", "control: {small:?}");
    let big = run_as(
        &mut client,
        Some("landlock-small"),
        "mem-big",
        &hold(400_000_000),
        60.0,
    )
    .await;
    assert!(
        !big.output.contains("held"),
        "held 400 MB under 128 MiB: {big:?}"
    );
}
