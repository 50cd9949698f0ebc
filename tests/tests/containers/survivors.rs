//! `podman kill` of a container whose daemon is running an escaping tree: the host sees no
//! survivor (the container's processes die with its pid namespace, the tree's with them).

use executor_tests::checks::{escaping_tree, preq, start_until, ESCAPEES};
use executor_tests::container::{Container, ContainerOptions};
use executor_tests::target::{assert_none_left, wait_sleepers};
use executor_tests::{marker, Target};

#[tokio::test]
async fn podman_kill_leaves_no_survivor_on_the_host() {
    let Some(c) = Container::start(ContainerOptions::default()) else {
        return;
    };
    let m = marker();
    let mut client = c.endpoint().connect().await;
    start_until(
        &mut client,
        preq(None, "tree", &escaping_tree(&m), 600.0),
        "started",
    )
    .await;
    // Control: the escapees run, on the host.
    wait_sleepers(&c, &m, ESCAPEES).await;
    c.kill();
    assert_none_left(&c, &m, "podman kill").await;
    assert!(!c.running(), "the container still runs after podman kill");
}
