//! End-to-end tests: the real `executor` binary over WebSocket, outcomes checked on the host.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod auth;
mod basics;
mod cgroup_parent;
mod cgroup_placement;
mod clients;
mod daemon_life;
mod disk_quota;
mod files;
mod host_cgroups;
mod kill;
mod metrics;
mod network_enforce;
mod network_matrix;
mod network_policy;
mod output;
mod processes;
mod profiles;
mod protocol_errors;
mod resume;
mod run_local;
mod test_internet;
mod tls;
mod warm;
