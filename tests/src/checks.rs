//! Scenarios every target runs the same way: start a command under a profile, make it escape
//! a process-group kill, end it (timeout, cancel, dropped connection) and look for survivors
//! from outside. Each check fails the test with the profile's name.

use std::future::Future;
use std::time::Duration;

use protocol::{CancelRequest, ClientMessage, Ending, ExecRequest, ExecResult, ServerMessage};

use crate::target::{assert_none_left, wait_sleepers, Target};
use crate::{marked_sleep, marker, req, Client, PATIENCE};

/// An exec request under `profile` (`None`: the daemon's default) with a timeout.
pub fn preq(profile: Option<&str>, id: &str, command: &str, timeout: f64) -> ExecRequest {
    let mut r = req(id, command);
    r.profile = profile.map(str::to_string);
    r.timeout = Some(timeout);
    r
}

/// Run `command` under `profile` and return its result; a refusal fails the test.
pub async fn run_as(
    client: &mut Client,
    profile: Option<&str>,
    id: &str,
    command: &str,
    timeout: f64,
) -> ExecResult {
    client
        .send(&ClientMessage::Exec(preq(profile, id, command, timeout)))
        .await;
    // The whole timeout may pass without a message: wait for the result that long.
    let wait = Duration::from_secs_f64(timeout) + PATIENCE;
    result_within(client, id, wait).await
}

/// Start `command` with streaming on and wait until its output contains `ready`.
pub async fn start_until(client: &mut Client, r: ExecRequest, ready: &str) -> String {
    let id = r.id.clone();
    let mut request = r;
    request.stream = true;
    client.send(&ClientMessage::Exec(request)).await;
    let mut seen = String::new();
    let deadline = tokio::time::Instant::now() + PATIENCE * 3;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match client.recv_within(left).await {
            Ok(Some(ServerMessage::Output(chunk))) if chunk.id == id => {
                seen.push_str(&chunk.data);
                if seen.contains(ready) {
                    return seen;
                }
            }
            Ok(Some(ServerMessage::Result(result))) if result.id == id => panic!(
                "{id} ended before printing {ready:?}: {:?} output {:?}",
                result.extra.ended, result.output
            ),
            Ok(Some(ServerMessage::Error(err))) if err.id.as_deref() == Some(id.as_str()) => {
                panic!("{id}: refused: {} {}", err.code, err.message)
            }
            Ok(Some(_)) => {}
            Ok(None) => panic!("{id}: connection closed"),
            Err(()) => panic!("{id}: no {ready:?} in time; saw {seen:?}"),
        }
    }
}

/// Cancel `id` and return its result.
pub async fn cancel(client: &mut Client, id: &str) -> ExecResult {
    client
        .send(&ClientMessage::Cancel(CancelRequest { id: id.to_string() }))
        .await;
    client
        .collect(id)
        .await
        .result
        .unwrap_or_else(|e| panic!("{id}: {e:?}"))
}

/// Wait up to `wait` for the result (or error) of `id`, skipping other messages.
pub async fn result_within(client: &mut Client, id: &str, wait: Duration) -> ExecResult {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match client.recv_within(left).await {
            Ok(Some(ServerMessage::Result(result))) if result.id == id => return result,
            Ok(Some(ServerMessage::Error(err))) if err.id.as_deref() == Some(id) => {
                panic!("{id}: refused: {} {}", err.code, err.message)
            }
            Ok(Some(_)) => {}
            Ok(None) => panic!("{id}: connection closed before its result"),
            Err(()) => panic!("{id}: no result within {wait:?}"),
        }
    }
}

/// Ways out of a process-group kill with only busybox and bash (no nohup): a background
/// sleep, a `setsid` one, a double-forked one, one ignoring the usual signals and a stopped
/// one. Prints `started` once all are launched.
pub fn escaping_tree(m: &str) -> String {
    let s = marked_sleep(m);
    format!(
        "{s} &\n\
         setsid {s} &\n\
         ( ( {s} & ) & )\n\
         ( trap '' TERM HUP INT; {s} ) &\n\
         ( {s} & sleep 0.1; kill -STOP $! ) &\n\
         sleep 0.5; echo started; {s}"
    )
}

/// Sleeps of [`escaping_tree`], its own foreground one included.
pub const ESCAPEES: usize = 6;

/// How a tree's command is ended.
#[derive(Debug, Clone, Copy)]
pub enum End {
    Timeout,
    Cancel,
    /// The client's connection drops without a close frame.
    Disconnect,
}

/// Start [`escaping_tree`] under `profile`, see every escapee from outside (the control), end
/// the command as `how`, and find none left on the target. `timeout` must leave the target
/// time to show the escapees (seconds under emulation).
pub async fn tree_dies(target: &impl Target, profile: Option<&str>, how: End, timeout: f64) {
    let m = marker();
    let id = format!("tree-{how:?}-{m}");
    let mut client = target.endpoint().connect().await;
    let command_timeout = match how {
        End::Timeout => timeout,
        End::Cancel | End::Disconnect => timeout * 10.0,
    };
    start_until(
        &mut client,
        preq(profile, &id, &escaping_tree(&m), command_timeout),
        "started",
    )
    .await;
    wait_sleepers(target, &m, ESCAPEES).await;
    let ended = match how {
        End::Timeout => Some(
            result_within(
                &mut client,
                &id,
                Duration::from_secs_f64(timeout) + PATIENCE,
            )
            .await,
        ),
        End::Cancel => Some(cancel(&mut client, &id).await),
        End::Disconnect => {
            // Dropping the socket sends no close frame, as a broken network would.
            drop(client);
            None
        }
    };
    // Survivors first: what matters most, whatever the result says.
    assert_none_left(target, &m, &format!("{how:?} under {profile:?}")).await;
    if let Some(result) = ended {
        let expected = match how {
            End::Timeout => Ending::TimedOut,
            _ => Ending::Cancelled,
        };
        assert_eq!(result.extra.ended, expected, "[{profile:?}] {result:?}");
        assert!(
            result.extra.killed_processes >= ESCAPEES as u32,
            "[{profile:?}] the result counts {} killed processes, {ESCAPEES} escapees ran",
            result.extra.killed_processes
        );
    }
}

/// Run `check` for each profile concurrently and fail once, listing every profile whose check
/// failed with its message (so one refused profile does not hide how the others behave).
pub async fn each_profile<F, Fut>(profiles: &[&str], check: F)
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let tasks: Vec<_> = profiles
        .iter()
        .map(|p| (p.to_string(), tokio::spawn(check(p.to_string()))))
        .collect();
    let mut failures = Vec::new();
    for (profile, task) in tasks {
        if let Err(e) = task.await {
            failures.push(format!("[{profile}] {}", panic_message(e)));
        }
    }
    assert!(failures.is_empty(), "failed:\n{}", failures.join("\n"));
}

/// [`each_profile`], one profile after the other: for checks that read machine-wide counters.
pub async fn each_profile_in_turn<F, Fut>(profiles: &[&str], check: F)
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut failures = Vec::new();
    for profile in profiles {
        if let Err(e) = tokio::spawn(check(profile.to_string())).await {
            failures.push(format!("[{profile}] {}", panic_message(e)));
        }
    }
    assert!(failures.is_empty(), "failed:\n{}", failures.join("\n"));
}

fn panic_message(e: tokio::task::JoinError) -> String {
    match e.try_into_panic() {
        Ok(panic) => panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default(),
        Err(e) => e.to_string(),
    }
}

/// Poll `cond` every 200 ms (targets reached through a side channel are slow to ask).
pub async fn eventually_slow(wait: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if cond() {
            return true;
        }
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
