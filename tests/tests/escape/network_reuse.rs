//! Network namespaces reused between strict commands (the fork server's pool,
//! `executor/src/spawner/net_pool.rs`): a later command of the same template may get the
//! namespace an earlier one ran in, never while that one runs, never a client with a
//! workspace of its own, and never one where anything was left. Each command here binds a UDP
//! port and an abstract unix name and tries both again (the control: the second bind sees the
//! first), so a command that landed where an earlier socket lived would see its bind refused;
//! the test holds every command's namespace open from the host (so an inode names one
//! namespace only: the kernel reuses the numbers of freed ones) and compares them there.

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::MetadataExt;
use std::process::{Child, Command, Stdio};

use executor_tests::{eventually, marked_sleep, marker, sleepers, Client};

use crate::common::*;

const ALICE: &str = "alice-netns-token-0123456789abcdef01234";
const BOB: &str = "bob-netns-token-0123456789abcdef0123456";
const PORT: u16 = 7777;
/// What [`leave_sockets_in`] binds: a UDP port and `\0left-<tag>`.
const LEFT_PORT: u16 = 7778;

/// Bind UDP 127.0.0.1:PORT and the abstract name `\0reuse-<tag>`, then both again; bind and
/// release what [`leave_sockets_in`] binds; print the errnos and the namespace we are in; exec
/// a marked sleep that keeps the first two sockets.
fn probe(tag: &str, m: &str) -> String {
    python(&format!(
        r#"
import socket
def bind(family, kind, addr):
    s = socket.socket(family, kind)
    try:
        s.bind(addr)
        return s, 0
    except OSError as e:
        return None, e.errno
udp, u = bind(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", {PORT}))
name, a = bind(socket.AF_UNIX, socket.SOCK_DGRAM, b"\0reuse-{tag}")
_, u2 = bind(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", {PORT}))
_, a2 = bind(socket.AF_UNIX, socket.SOCK_DGRAM, b"\0reuse-{tag}")
_, lu = bind(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", {LEFT_PORT}))
_, la = bind(socket.AF_UNIX, socket.SOCK_DGRAM, b"\0left-{tag}")
net = os.readlink("/proc/self/ns/net")
print(f"udp={{u}} abstract={{a}} udp_again={{u2}} abstract_again={{a2}} left_udp={{lu}} "
      f"left_abstract={{la}} net={{net}} ready", flush=True)
for s in (udp, name):
    if s is not None:
        os.set_inheritable(s.fileno(), True)
os.execvp("sleep", "{sleep}".split())
"#,
        sleep = marked_sleep(m),
    ))
}

/// A running command's network namespace, open on the host.
struct Held {
    /// Held open: keeps the namespace, and so its inode number, from being freed.
    _ns: std::fs::File,
    ino: u64,
    /// The command's sleep, in the namespace.
    pid: i32,
    output: String,
}

/// Start [`probe`] under strict and hold its namespace once it runs; returns its request id.
async fn start_holding(client: &mut Client, id: &str, tag: &str) -> (String, Held) {
    let m = marker();
    let (id, output) = start_until(client, STRICT, id, &probe(tag, &m), "ready", 20.0).await;
    assert!(
        eventually(SETTLE, || sleepers(&m).len() == 1).await,
        "{id}: its sleep never ran: {output}"
    );
    let pid = sleepers(&m)[0];
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net")).unwrap();
    let ino = ns.metadata().unwrap().ino();
    (
        id,
        Held {
            _ns: ns,
            ino,
            pid,
            output,
        },
    )
}

/// [`start_holding`], then cancel the command.
async fn run_holding(client: &mut Client, id: &str, tag: &str) -> Held {
    let (id, held) = start_holding(client, id, tag).await;
    cancel(client, &id).await;
    held
}

/// The command found the port and the name free, its control binds were refused (98,
/// EADDRINUSE), and it saw from inside the namespace the host holds.
fn assert_clean_start(held: &Held, host_ino: u64) {
    let out = &held.output;
    for (key, want) in [
        ("udp", "0"),
        ("abstract", "0"),
        ("udp_again", "98"),
        ("abstract_again", "98"),
        ("left_udp", "0"),
        ("left_abstract", "0"),
    ] {
        assert_eq!(field(out, key), Some(want), "{key}: {out}");
    }
    assert_eq!(
        field(out, "net"),
        Some(format!("net:[{}]", held.ino).as_str()),
        "the command's namespace is the one its process has on the host: {out}"
    );
    assert_ne!(
        held.ino, host_ino,
        "a strict command in the host's namespace"
    );
}

fn host_ino() -> u64 {
    std::fs::metadata("/proc/self/ns/net").unwrap().ino()
}

fn inodes(held: &[Held]) -> Vec<u64> {
    held.iter().map(|h| h.ino).collect()
}

#[tokio::test]
async fn strict_commands_reuse_a_network_namespace_only_within_their_client_and_one_at_a_time() {
    if !executor_tests::require("root", executor_tests::is_root()) {
        return;
    }
    // Workspaces of their own: their templates differ (with the shared default they would
    // be equal, and what a reused namespace could carry between them the workspace carries).
    let client = |name: &str, token: &str| serde_json::json!({"name": name, "token": token, "profiles": ["strict"], "workspace": "per_client"});
    let daemon = clients_daemon(
        &serde_json::json!({"clients": [client("alice", ALICE), client("bob", BOB)]}),
        &[],
    )
    .unwrap();
    let mut alice = Client::connect(&daemon.url, Some(ALICE)).await.unwrap();
    let mut bob = Client::connect(&daemon.url, Some(BOB)).await.unwrap();
    let tag = marker();
    let host = host_ino();

    let mut alices = Vec::new();
    for i in 0..6 {
        alices.push(run_holding(&mut alice, &format!("alice-{i}"), &tag).await);
    }
    alices.iter().for_each(|h| assert_clean_start(h, host));
    let alice_nets: HashSet<u64> = alices.iter().map(|h| h.ino).collect();
    // The pool works: some of alice's commands ran where an earlier one of hers had, and
    // still found the port and the name free.
    assert!(
        alice_nets.len() < alices.len(),
        "no namespace was reused: {:?}",
        inodes(&alices)
    );

    // Bob never gets one of alice's (all still held, so equal inodes would be one namespace),
    // though they have the same profile.
    let mut bobs = Vec::new();
    for i in 0..4 {
        bobs.push(run_holding(&mut bob, &format!("bob-{i}"), &tag).await);
    }
    bobs.iter().for_each(|h| assert_clean_start(h, host));
    assert!(
        bobs.iter().all(|h| !alice_nets.contains(&h.ino)),
        "bob ran in alice's namespace: alice {:?} bob {:?}",
        inodes(&alices),
        inodes(&bobs)
    );
    // Control: bob's commands reuse among themselves too.
    let bob_nets: HashSet<u64> = bobs.iter().map(|h| h.ino).collect();
    assert!(bob_nets.len() < bobs.len(), "{:?}", inodes(&bobs));

    // Two of alice's commands at once never share one: the second would find the port taken.
    let mut alice_too = Client::connect(&daemon.url, Some(ALICE)).await.unwrap();
    let (first_id, first) = start_holding(&mut alice, "alice-together-1", &tag).await;
    let (second_id, second) = start_holding(&mut alice_too, "alice-together-2", &tag).await;
    assert_clean_start(&first, host);
    assert_clean_start(&second, host);
    assert_ne!(first.ino, second.ino);
    cancel(&mut alice, &first_id).await;
    cancel(&mut alice_too, &second_id).await;
    let after = run_in(&mut alice, STRICT, "after", "echo alive").await;
    assert_eq!(after.output, "alive\n", "{after:?}");
}

/// A process of the host that entered `pid`'s network namespace and bound two sockets there,
/// so the namespace keeps them after the command is gone; [`probe`] tries to bind the same.
fn leave_sockets_in(pid: i32, tag: &str) -> Child {
    let script = format!(
        r#"
import socket, sys, time
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("127.0.0.1", {LEFT_PORT}))
a = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); a.bind(b"\0left-{tag}")
print("bound", flush=True)
time.sleep(120)
"#
    );
    let mut child = Command::new("nsenter")
        .arg(format!("--net=/proc/{pid}/ns/net"))
        .args([PY, "-c", &script])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "bound");
    child
}

/// `sockets: used N` of the network namespace `pid` is in, read on the host.
fn sockets_used(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/net/sockstat")).unwrap();
    field(&text.replace(": used ", " used="), "used")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{text}"))
}

#[tokio::test]
async fn a_network_namespace_with_a_socket_left_in_it_is_never_lent_again() {
    let Some(daemon) = daemon() else {
        return;
    };
    let mut client = daemon.connect().await;
    let tag = marker();
    let host = host_ino();
    let (id, dirty) = start_holding(&mut client, "left-behind", &tag).await;
    assert_clean_start(&dirty, host);
    let mut leftover = leave_sockets_in(dirty.pid, &tag);
    cancel(&mut client, &id).await;
    // Control, on the host: the command is gone, its namespace still holds two sockets.
    assert!(eventually(SETTLE, || gone(dirty.pid)).await);
    assert!(sockets_used(leftover.id()) >= 2);

    let mut later = Vec::new();
    for i in 0..6 {
        later.push(run_holding(&mut client, &format!("later-{i}"), &tag).await);
    }
    // Had one landed in the dirty namespace, its binds would have been refused.
    later.iter().for_each(|h| assert_clean_start(h, host));
    assert!(
        later.iter().all(|h| h.ino != dirty.ino),
        "a namespace with sockets left was lent again: {} in {:?}",
        dirty.ino,
        inodes(&later)
    );
    // Control: namespaces were being reused meanwhile.
    let nets: HashSet<u64> = later.iter().map(|h| h.ino).collect();
    assert!(nets.len() < later.len(), "{:?}", inodes(&later));
    let _ = leftover.kill();
    let _ = leftover.wait();
    assert_daemon_intact(&daemon).await;
}

fn gone(pid: i32) -> bool {
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
}
