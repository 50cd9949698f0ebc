//! Escape suite: hostile commands against every sandbox profile, through the real daemon over
//! WebSocket, with outcomes checked on the host. One module per attack class of
//! `../shared/design.md` section 5; every denial is paired with its allowed control.
//!
//! Profiles and what they promise: `sandbox-profiles/*.json`. Cases name the profiles they run
//! under in a (profile, expectation) table; `trusted` is usually the control, since it is the
//! same action with no policy in the way.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod host_side;
mod table;

mod bombs;
mod cgroup_reuse;
mod cgroups;
mod cross_client;
mod daemon_reach;
mod env_injection;
mod file_paths;
mod floods;
mod fs_tricks;
mod isolation;
mod kernel_surfaces;
mod kill;
mod leftovers;
mod network;
mod network_reuse;
mod pid_reuse;
mod privilege;
mod root_templates;
mod syscalls;
mod terminal;
mod unprivileged;
