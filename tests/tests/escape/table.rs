//! Running one case over a (profile, expectation) table: the suite's profiles, what a case
//! expects of each, running a command under a named profile, the tables most cases share, the
//! row a case sees (its profile, its expectation and the label its messages start with), and
//! the checks that pair a denial with its control in one call. `common` re-exports all of it.
//!
//! A case stays a few lines of intent:
//!
//! ```ignore
//! let Some(daemon) = daemon() else { return };
//! each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
//!     let out = row.output(client, "vsock", &probe).await;
//!     row.check_zero(&out, "vsock", "has vsock");
//! })
//! .await;
//! assert_daemon_intact(&daemon).await;
//! ```

use std::fmt;

use executor_tests::{checks, Client, Daemon};
use futures_util::future::join_all;
use protocol::ExecResult;

pub const STRICT: &str = "strict";
pub const LANDLOCK: &str = "landlock";
pub const TASK: &str = "task-container";
pub const TRUSTED: &str = "trusted";

/// What a case expects of a profile: the attack is stopped, or policy permits the same action
/// (the control that proves the probe and the host-side check can see a success).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    Denied,
    Allowed,
}
pub use Expect::{Allowed, Denied};

/// Run `command` under `profile` and return its result. A refused command (error message)
/// fails the case: every profile named in a table must run on the test host.
pub async fn run_in(client: &mut Client, profile: &str, id: &str, command: &str) -> ExecResult {
    run_with_timeout(client, profile, id, command, 20.0).await
}

pub async fn run_with_timeout(
    client: &mut Client,
    profile: &str,
    id: &str,
    command: &str,
    timeout: f64,
) -> ExecResult {
    let id = format!("{profile}-{id}");
    let result = checks::run_as(client, Some(profile), &id, command, timeout).await;
    assert_eq!(
        result.extra.isolation.profile, profile,
        "[{profile}] {id}: ran under another profile: {:?}",
        result.extra.isolation
    );
    result
}

/// Profiles of `table` with their expectations, for messages.
pub fn label(profile: &str, expect: Expect) -> String {
    format!("[{profile} expects {expect:?}]")
}

/// Parse `key=value` tokens printed by a probe (`key=value key2=value2`), last one wins.
pub fn field<'a>(output: &'a str, key: &str) -> Option<&'a str> {
    output
        .split_whitespace()
        .filter_map(|t| t.strip_prefix(key)?.strip_prefix('='))
        .next_back()
}

/// A (profile, expectation) table.
pub type Table = [(&'static str, Expect)];

/// Every sandboxed profile stops the attack; `trusted` (the same action with no policy in the
/// way) is the control.
pub const ONLY_TRUSTED: [(&str, Expect); 4] = [
    (STRICT, Denied),
    (LANDLOCK, Denied),
    (TASK, Denied),
    (TRUSTED, Allowed),
];

/// The profiles without the host's network stop it; task-container (the host's network by
/// design) and trusted are the controls.
pub const ONLY_HOST_NETWORK: [(&str, Expect); 4] = [
    (STRICT, Denied),
    (LANDLOCK, Denied),
    (TASK, Allowed),
    (TRUSTED, Allowed),
];

/// [`ONLY_TRUSTED`] without task-container, where its profile grants what the case attacks
/// (the host's root: sysfs, /dev/kmsg, the host's files), so that a write there is no escape.
pub const ONLY_TRUSTED_TASK_LEFT_OUT: [(&str, Expect); 3] =
    [(STRICT, Denied), (LANDLOCK, Denied), (TRUSTED, Allowed)];

/// Every profile of the suite.
pub const ALL_PROFILES: [&str; 4] = [STRICT, LANDLOCK, TASK, TRUSTED];

/// One row of a table, as its case sees it. Displays as the label every message of the case
/// starts with (`[strict expects Denied]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    pub profile: &'static str,
    pub expect: Expect,
}

impl fmt::Display for Row {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&label(self.profile, self.expect))
    }
}

impl Row {
    pub fn denied(self) -> bool {
        self.expect == Denied
    }

    /// The output of `command` run under this row's profile (see [`run_in`]).
    pub async fn output(self, client: &mut Client, id: &str, command: &str) -> String {
        run_in(client, self.profile, id, command).await.output
    }

    /// The probe printed `key=0` (the call succeeded) exactly where policy allows it: a denied
    /// row panics "`<row> <what>: <out>`" on a `0`, an allowed row "`<row> control: <out>`"
    /// on anything else.
    #[track_caller]
    pub fn check_zero(self, out: &str, key: &str, what: &str) {
        match self.expect {
            Denied => assert_ne!(field(out, key), Some("0"), "{self} {what}: {out}"),
            Allowed => assert_eq!(field(out, key), Some("0"), "{self} control: {out}"),
        }
    }

    /// `out` holds `needle` exactly where policy allows it (a secret read, a status line).
    #[track_caller]
    pub fn check_contains(self, out: &str, needle: &str, what: &str) {
        match self.expect {
            Denied => assert!(!out.contains(needle), "{self} {what}: {out}"),
            Allowed => assert!(out.contains(needle), "{self} control: {out}"),
        }
    }

    /// What the host side received (`None`: nothing) is `sent` exactly where policy allows it.
    #[track_caller]
    pub fn check_received(self, got: Option<&str>, sent: &str, what: &str, out: &str) {
        match self.expect {
            Denied => assert_eq!(got, None, "{self} {what}: {out}"),
            Allowed => assert_eq!(got, Some(sent), "{self} control: {out}"),
        }
    }
}

/// Run `case` once per row of `table`, in order, on one connection to `daemon`.
pub async fn each_row(daemon: &Daemon, table: &Table, mut case: impl AsyncFnMut(&mut Client, Row)) {
    let mut client = daemon.connect().await;
    for &(profile, expect) in table {
        case(&mut client, Row { profile, expect }).await;
    }
}

/// Run `case` for every profile at the same time (each with a connection of its own), so that
/// the slow waits of a case (timeouts, kills) overlap.
pub async fn each_profile_at_once(
    daemon: &Daemon,
    profiles: &[&'static str],
    case: impl AsyncFn(&mut Client, &'static str),
) {
    at_once(profiles, async |profile| {
        let mut client = daemon.connect().await;
        case(&mut client, profile).await;
    })
    .await;
}

/// Run `case` for every profile at the same time; the case makes its own connections.
pub async fn at_once(profiles: &[&'static str], case: impl AsyncFn(&'static str)) {
    join_all(profiles.iter().map(|&profile| case(profile))).await;
}
