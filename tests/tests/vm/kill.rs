//! Whole-tree kill in the VM: a setsid'd, double-forked, signal-ignoring and stopped tree is
//! gone from the VM's process list (read through the side channel) after a timeout, a cancel
//! and a dropped connection, under every shipped profile. On 6.1 there is no landlock scoping
//! and, under pure cgroup v2, the kill has to come from `cgroup.kill` or the subreaper sweep.

use executor_tests::checks::{each_profile, tree_dies, End};
use executor_tests::vm;

const PROFILES: [&str; 4] = ["strict", "landlock", "task-container", "trusted"];

async fn every_profile(how: End) {
    let Some(vm) = vm::shared() else { return };
    each_profile(&PROFILES, move |profile| async move {
        tree_dies(vm, Some(&profile), how, crate::SLOW_TIMEOUT).await;
    })
    .await;
}

#[tokio::test]
async fn timeout_kills_setsid_and_double_forked_trees_in_the_vm() {
    every_profile(End::Timeout).await;
}

#[tokio::test]
async fn cancel_kills_setsid_and_double_forked_trees_in_the_vm() {
    every_profile(End::Cancel).await;
}

#[tokio::test]
async fn a_dropped_connection_kills_the_tree_in_the_vm() {
    every_profile(End::Disconnect).await;
}
