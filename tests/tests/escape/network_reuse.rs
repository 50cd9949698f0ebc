//! Network namespaces reused between strict commands (the fork server's pool,
//! `sandbox/src/spawner/net_pool.rs`): a later command of the same template may get the
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
{BIND}
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

/// Python for the probes: `bind(family, kind, address)` returns the bound socket and 0, or
/// `None` and the errno.
const BIND: &str = r#"import socket
def bind(family, kind, addr):
    s = socket.socket(family, kind)
    try:
        s.bind(addr)
        return s, 0
    except OSError as e:
        s.close()
        return None, e.errno
"#;

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
    start_holding_with(client, id, |m| probe(tag, m)).await
}

/// Start `command` (given the marker its sleep carries) under strict and hold its namespace
/// once it prints `ready`; returns its request id.
async fn start_holding_with(
    client: &mut Client,
    id: &str,
    command: impl FnOnce(&str) -> String,
) -> (String, Held) {
    let m = marker();
    let (id, output) = start_until(client, STRICT, id, &command(&m), "ready", 20.0).await;
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

/// Report what is left of earlier commands (SysV objects, files under `/tmp` named `tag`, an
/// abstract name and a UDP port of `tag`, processes but init, ourselves and our parent,
/// descriptors above stderr, a variable), then leave each of them (the sockets and a
/// descriptor held by a marked sleep left running, the variable in its environment) and
/// report them again: the control, seen the same way from inside.
fn leave_and_find(tag: &str, m: &str) -> String {
    python(&format!(
        r#"
import subprocess
{BIND}
def sysv():
    return sum(len(open(f"/proc/sysvipc/{{k}}").read().splitlines()) - 1 for k in ("shm", "msg", "sem"))
def udp():
    return bind(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", {PORT}))
def abstract():
    return bind(socket.AF_UNIX, socket.SOCK_DGRAM, b"\0leave-{tag}")
def state(prefix):
    us, ue = udp()
    ab, ae = abstract()
    for s in (us, ab):
        if s is not None:
            s.close()
    procs = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid(), os.getppid())]
    # The listing's own descriptor is not counted.
    fds = len([f for f in os.listdir("/proc/self/fd") if int(f) > 2]) - 1
    tmp = [f for f in os.listdir("/tmp") if "{tag}" in f]
    return (f"{{prefix}}sysv={{sysv()}} {{prefix}}tmp={{len(tmp)}} {{prefix}}udp={{ue}} "
            f"{{prefix}}abstract={{ae}} {{prefix}}procs={{len(procs)}} {{prefix}}fds={{fds}} "
            f"{{prefix}}env={{int('LEFT_{tag}' in os.environ)}}")
print(state("found_"), flush=True)
for kind, size in (("-M", "4096"), ("-Q", None), ("-S", "1")):
    subprocess.run(["ipcmk", kind] + ([size] if size else []), check=True, stdout=subprocess.DEVNULL)
open("/tmp/left-{tag}", "w").write("left")
os.environ["LEFT_{tag}"] = "1"
held = [udp()[0], abstract()[0], open("/tmp/left-{tag}")]
for f in held:
    os.set_inheritable(f.fileno(), True)
subprocess.Popen("{sleep}".split(), close_fds=False)
print(state(""), f"net={{os.readlink('/proc/self/ns/net')}} ready", flush=True)
import time
time.sleep(60)
"#,
        sleep = marked_sleep(m),
    ))
}

#[tokio::test]
async fn a_command_in_a_reused_network_namespace_finds_nothing_of_the_one_before() {
    let Some((_daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let tag = marker();
    let host = host_ino();
    let mut held = Vec::new();
    for i in 0..6 {
        let (id, h) = start_holding_with(&mut client, &format!("leave-{i}"), |m| {
            leave_and_find(&tag, m)
        })
        .await;
        cancel(&mut client, &id).await;
        assert!(eventually(SETTLE, || gone(h.pid)).await, "{}", h.output);
        held.push(h);
    }
    for h in &held {
        let out = &h.output;
        // Nothing of the command before: no SysV object, no file, the name and the port free,
        // no process, no descriptor, no variable.
        for (key, want) in [
            ("found_sysv", "0"),
            ("found_tmp", "0"),
            ("found_udp", "0"),
            ("found_abstract", "0"),
            ("found_procs", "0"),
            ("found_fds", "0"),
            ("found_env", "0"),
        ] {
            assert_eq!(field(out, key), Some(want), "{key}: {out}");
        }
        // Control: what it left is there, seen the same way (three SysV objects, the file,
        // the name and the port taken, its sleep, three descriptors, the variable).
        for (key, want) in [
            ("sysv", "3"),
            ("tmp", "1"),
            ("udp", "98"),
            ("abstract", "98"),
            ("procs", "1"),
            ("fds", "3"),
            ("env", "1"),
        ] {
            assert_eq!(field(out, key), Some(want), "{key}: {out}");
        }
        assert_eq!(
            field(out, "net"),
            Some(format!("net:[{}]", h.ino).as_str()),
            "{out}"
        );
        assert_ne!(h.ino, host);
    }
    // Control: the commands did run in namespaces of earlier ones.
    let nets: HashSet<u64> = held.iter().map(|h| h.ino).collect();
    assert!(
        nets.len() < held.len(),
        "no namespace was reused: {:?}",
        inodes(&held)
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
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
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
