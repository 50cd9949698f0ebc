//! Waiting on the host for a test's processes to come or go, and signalling them: the
//! `eventually(PATIENCE, || ...)` polls that nearly every process test repeats, named for what
//! they wait for. Each returns whether it held, so the test's own `assert!` keeps its message.

use nix::sys::signal::Signal;

use crate::{eventually, processes_matching, sleepers, PATIENCE};

/// Whether a process whose command line holds `needle` shows up within [`PATIENCE`].
pub async fn started(needle: &str) -> bool {
    eventually(PATIENCE, || !processes_matching(needle).is_empty()).await
}

/// Whether every process whose command line holds `needle` is gone within [`PATIENCE`].
pub async fn none_left(needle: &str) -> bool {
    eventually(PATIENCE, || processes_matching(needle).is_empty()).await
}

/// Whether exactly `n` sleeps marked with `marker` are up within [`PATIENCE`].
pub async fn sleepers_up(marker: &str, n: usize) -> bool {
    eventually(PATIENCE, || sleepers(marker).len() == n).await
}

/// Whether every sleep marked with `marker` is gone within [`PATIENCE`].
pub async fn sleepers_gone(marker: &str) -> bool {
    eventually(PATIENCE, || sleepers(marker).is_empty()).await
}

/// Send `signal` to the process `pid` (it must exist: a failure panics naming both).
pub fn send_signal(pid: i32, signal: Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal)
        .unwrap_or_else(|e| panic!("{signal} to {pid}: {e}"));
}

/// Asserts that every process whose command line holds `needle` is gone within [`PATIENCE`];
/// the failure reads "`what`: [survivors' pids]".
pub async fn assert_none_left(needle: &str, what: &str) {
    assert!(
        none_left(needle).await,
        "{what}: {:?}",
        processes_matching(needle)
    );
}

/// Waits until exactly one sleep marked `marker` is up and returns its pid; panics naming the
/// marker and what it saw if that never happens.
pub async fn one_sleeper(marker: &str) -> i32 {
    let mut pids = Vec::new();
    assert!(
        eventually(PATIENCE, || {
            pids = sleepers(marker);
            pids.len() == 1
        })
        .await,
        "not one sleep marked {marker}: {pids:?}"
    );
    pids[0]
}
