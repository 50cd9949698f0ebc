//! A `--privileged` container: the daemon may create namespaces, so strict works inside.

use executor_tests::checks::{each_profile, tree_dies, End};
use executor_tests::target::wait_sleepers;
use executor_tests::{container, marked_sleep, marker, namespace_of, Target};

#[tokio::test]
async fn strict_works_in_a_privileged_container_with_namespaces_seen_from_the_host() {
    let Some(c) = container::shared_privileged() else {
        return;
    };
    let mut client = c.endpoint().connect().await;
    let strict = client
        .hello
        .profiles
        .iter()
        .find(|p| p.name == "strict")
        .unwrap()
        .clone();
    assert!(strict.available, "strict is unavailable: {strict:?}");
    assert_eq!(client.hello.default_profile, "strict");
    let m = marker();
    let r = executor_tests::checks::preq(
        Some("strict"),
        "ns",
        &format!("echo up; {}", marked_sleep(&m)),
        60.0,
    );
    executor_tests::checks::start_until(&mut client, r, "up").await;
    let sleeper = wait_sleepers(c, &m, 1).await[0].pid;
    let daemon = c.daemon_host_pid().unwrap();
    // From the host: the command lives in namespaces of its own, not the container's.
    for kind in ["pid", "net", "mnt"] {
        assert_ne!(
            namespace_of(sleeper, kind),
            namespace_of(daemon, kind),
            "the strict command shares the daemon's {kind} namespace"
        );
    }
    // Control: the host sees the container's own namespaces differ from its own, too.
    assert_ne!(namespace_of(daemon, "pid"), namespace_of(1, "pid"));
    executor_tests::checks::cancel(&mut client, "ns").await;
    executor_tests::target::assert_none_left(c, &m, "the cancelled strict command").await;
}

#[tokio::test]
async fn strict_trees_die_in_a_privileged_container() {
    let Some(c) = container::shared_privileged() else {
        return;
    };
    each_profile(&["strict"], move |profile| async move {
        for how in [End::Timeout, End::Cancel, End::Disconnect] {
            tree_dies(c, Some(&profile), how, crate::TIMEOUT).await;
        }
    })
    .await;
}
