//! Network and IPC endpoints on the host: TCP egress to a listener the test holds on
//! 127.0.0.1, the daemon's own port, binding TCP, UDP, abstract and filesystem unix sockets.
//! Every case asks the host side whether it saw the connection; `trusted` (and
//! `task-container`, which has the host's network by design) are the controls.

use std::net::{TcpListener, TcpStream, UdpSocket};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};
use std::time::Duration;

use executor_tests::marker;

use crate::common::*;

/// Connect to 127.0.0.1:`port` by one of four routes (plain TCP, TCP over IPv6 to the
/// v4-mapped address, MPTCP, TCP Fast Open through sendto), send `payload`, print
/// `connect=<errno>`. MPTCP and Fast Open are known gaps of landlock's TCP rules
/// (landlock-lsm/linux#54 and #41), so a landlock-only profile must close them another way.
fn tcp_probe(port: u16, payload: &str, variant: &str) -> String {
    python(&format!(
        r#"
import socket
variant = "{variant}"
try:
    if variant == "fastopen":
        # sendto(MSG_FASTOPEN) connects implicitly, without connect(2) and its LSM hook;
        # blocking, so it waits for the handshake and then sends the payload.
        s = socket.socket()
        s.sendto(b"{payload}", 0x20000000, ("127.0.0.1", {port}))
    else:
        if variant == "v6mapped":
            s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            addr = ("::ffff:127.0.0.1", {port})
        elif variant == "mptcp":
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 262)   # IPPROTO_MPTCP
            addr = ("127.0.0.1", {port})
        else:
            s = socket.socket()
            addr = ("127.0.0.1", {port})
        s.settimeout(3)
        s.connect(addr)
        s.sendall(b"{payload}")
    print("connect=0")
except OSError as e:
    print(f"connect={{e.errno}}")
"#
    ))
}

#[tokio::test]
async fn tcp_to_a_host_listener_on_loopback_is_denied_without_network() {
    let Some(daemon) = daemon() else {
        return;
    };
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut holes = Vec::new();
    each_row(&daemon, &ONLY_HOST_NETWORK, async |client, row| {
        for variant in ["tcp", "v6mapped", "mptcp", "fastopen"] {
            let l = format!("{row} {variant}");
            let payload = format!("hello-{}", marker());
            let out = row
                .output(client, variant, &tcp_probe(port, &payload, variant))
                .await;
            let got = accepted(&listener);
            // Every route is tried under every profile before failing, so one run reports
            // all the holes.
            match row.expect {
                Denied if got.is_some() || field(&out, "connect") == Some("0") => {
                    holes.push(format!("{l} the host listener got {got:?}: {out}"));
                }
                // MPTCP falls back to TCP against a plain listener: every route connects.
                Allowed if got.as_deref() != Some(payload.as_str()) => {
                    holes.push(format!("{l} control failed, got {got:?}: {out}"));
                }
                _ => {}
            }
        }
    })
    .await;
    assert!(holes.is_empty(), "{}", holes.join("\n"));
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn the_daemons_own_port_is_unreachable_without_network() {
    let Some(daemon) = daemon() else {
        return;
    };
    let port = daemon.addr.port();
    // Plain TCP, and the two routes landlock's TCP rule does not see (see `tcp_probe`).
    let probe = python(&format!(
        r#"
import socket
req = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
for variant in ("tcp", "mptcp", "fastopen"):
    try:
        if variant == "fastopen":
            s = socket.socket()
            s.sendto(req, 0x20000000, ("127.0.0.1", {port}))
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 262 if variant == "mptcp" else 0)
            s.settimeout(3)
            s.connect(("127.0.0.1", {port}))
            s.sendall(req)
        s.settimeout(3)
        print(f"{{variant}}_status=" + s.recv(100).split(b"\r\n")[0].decode().replace(" ", "_"))
    except OSError as e:
        print(f"{{variant}}_errno={{e.errno}}")
"#
    ));
    let mut holes = Vec::new();
    each_row(&daemon, &ONLY_HOST_NETWORK, async |client, row| {
        let out = row.output(client, "port", &probe).await;
        for variant in ["tcp", "mptcp", "fastopen"] {
            let status = field(&out, &format!("{variant}_status"));
            match row.expect {
                Denied if status.is_some() => {
                    holes.push(format!("{row} {variant} reached the daemon: {out}"))
                }
                Allowed if status != Some("HTTP/1.1_200_OK") => {
                    holes.push(format!("{row} {variant} control: {out}"))
                }
                _ => {}
            }
        }
    })
    .await;
    assert!(holes.is_empty(), "{}", holes.join("\n"));
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn binding_a_tcp_port_is_denied_without_network() {
    let Some(daemon) = daemon() else {
        return;
    };
    each_row(&daemon, &ONLY_HOST_NETWORK, async |client, row| {
        let probe = python(
            r#"
import socket, time
try:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    print(f"port={s.getsockname()[1]}", flush=True)
except OSError as e:
    print(f"bind_errno={e.errno}", flush=True)
print("ready", flush=True)
time.sleep(60)
"#,
        );
        let (id, out) = start_until(client, row.profile, "bind", &probe, "ready", 60.0).await;
        // From the host: can anything be reached on the port the command bound?
        let reached = field(&out, "port")
            .and_then(|p| p.parse::<u16>().ok())
            .is_some_and(|p| TcpStream::connect(("127.0.0.1", p)).is_ok());
        match row.expect {
            Denied => {
                assert!(
                    !reached,
                    "{row} the host reached the command's listener: {out}"
                );
                // Binding inside a private network namespace is harmless, but landlock's
                // TCP rule denies it in both profiles.
                assert!(
                    field(&out, "bind_errno").is_some(),
                    "{row} bind succeeded: {out}"
                );
            }
            Allowed => assert!(reached, "{row} control: {out}"),
        }
        cancel(client, &id).await;
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn udp_reaches_the_host_only_from_profiles_with_the_host_network() {
    // Landlock's TCP rules do not cover UDP; strict's empty network namespace does, and the
    // landlock profile refuses IP sockets altogether with seccomp (its threat model).
    let Some(daemon) = daemon() else {
        return;
    };
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let port = socket.local_addr().unwrap().port();
    each_row(&daemon, &ONLY_HOST_NETWORK, async |client, row| {
        let payload = format!("udp-{}", marker());
        let out = row
            .output(
                client,
                "udp",
                &python(&format!(
                    "import socket\ntry:\n    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'{payload}', ('127.0.0.1', {port}))\n    print('sent=1')\nexcept OSError as e:\n    print(f'sent_errno={{e.errno}}')"
                )),
            )
            .await;
        let mut buf = [0u8; 128];
        let got = socket
            .recv_from(&mut buf)
            .ok()
            .map(|(n, _)| String::from_utf8_lossy(&buf[..n]).into_owned());
        row.check_received(got.as_deref(), &payload, "the host got a datagram", &out);
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn strict_sees_only_its_own_loopback_interface() {
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let probe = "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' ' | sort | tr '\\n' ,";
    let host = run_in(&mut client, TRUSTED, "ifaces", probe).await.output;
    assert!(
        host.contains("lo,") && host != "lo,",
        "[trusted] control: {host}"
    );
    let out = run_in(&mut client, STRICT, "ifaces", probe).await.output;
    assert_eq!(out, "lo,", "[strict] interfaces: {out}");
    assert_daemon_intact(&daemon).await;
}

fn unix_probe(address: &str, payload: &str) -> String {
    python(&format!(
        r#"
import socket
s = socket.socket(socket.AF_UNIX)
s.settimeout(3)
try:
    s.connect({address})
    s.sendall(b"{payload}")
    print("connect=0")
except OSError as e:
    print(f"connect={{e.errno}}")
"#
    ))
}

#[tokio::test]
async fn abstract_unix_sockets_of_the_host_are_unreachable() {
    let Some(daemon) = daemon() else {
        return;
    };
    let name = format!("executor-escape-{}", marker());
    let addr = UnixAddr::from_abstract_name(name.as_bytes()).unwrap();
    let listener = UnixListener::bind_addr(&addr).unwrap();
    each_row(&daemon, &ONLY_HOST_NETWORK, async |client, row| {
        let payload = format!("abstract-{}", marker());
        let probe = unix_probe(&format!("\"\\0{name}\""), &payload);
        let out = row.output(client, "abstract", &probe).await;
        let got = accepted(&listener);
        row.check_received(
            got.as_deref(),
            &payload,
            "the host socket got a connection",
            &out,
        );
        if row.denied() {
            assert_ne!(field(&out, "connect"), Some("0"), "{row} {out}");
        }
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn abstract_unix_sockets_work_within_one_command() {
    // Control for the case above: the scope confines abstract sockets to the command, it does
    // not remove them (programs use them internally).
    let Some((daemon, mut client)) = daemon_and_client().await else {
        return;
    };
    let probe = python(
        r#"
import socket
name = b"\0escape-inner-" + str(os.getpid()).encode()
srv = socket.socket(socket.AF_UNIX); srv.bind(name); srv.listen(1)
if os.fork() == 0:
    c = socket.socket(socket.AF_UNIX); c.connect(name); c.sendall(b"inner-ok"); os._exit(0)
conn, _ = srv.accept()
print(conn.recv(100).decode())
"#,
    );
    for profile in ALL_PROFILES {
        let out = run_in(&mut client, profile, "inner", &probe).await.output;
        assert!(out.contains("inner-ok"), "[{profile}] {out}");
    }
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn host_unix_sockets_outside_the_sandbox_view_are_unreachable_under_strict() {
    // Landlock does not cover connecting to filesystem sockets (its threat model says so), and
    // task-container shares the host's root; strict does not even see the path.
    let Some(daemon) = daemon() else {
        return;
    };
    let dir = executor_tests::TempDir::with_prefix_in("escape-sock-", "/var/tmp").unwrap();
    let path = dir.path().join("host.sock");
    let listener = UnixListener::bind(&path).unwrap();
    // Open to every uid, so that only the sandbox's view (not file modes) can keep strict's
    // uid 65534 away, while landlock's (also 65534) may connect as its profile allows.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
    let table = [
        (STRICT, Denied),
        (LANDLOCK, Allowed),
        (TASK, Allowed),
        (TRUSTED, Allowed),
    ];
    each_row(&daemon, &table, async |client, row| {
        let payload = format!("path-{}", marker());
        let probe = unix_probe(&format!("\"{}\"", path.display()), &payload);
        let out = row.output(client, "pathsock", &probe).await;
        let got = accepted(&listener);
        let what = format!("reached {}", path.display());
        row.check_received(got.as_deref(), &payload, &what, &out);
    })
    .await;
    assert_daemon_intact(&daemon).await;
}

#[tokio::test]
async fn vsock_sockets_are_refused_in_every_sandboxed_profile() {
    // AF_VSOCK is not network-namespaced and landlock's rules do not cover it: in a VM it is a
    // channel to the hypervisor side (CID 2) that no network namespace closes, so seccomp
    // refuses it in every profile with a filter, task-container's host network included. Only socket
    // creation and a local bind are tried here (connecting to CID 2 would touch services that
    // are not ours). The host must have vsock for the control to mean anything.
    if !std::path::Path::new("/dev/vsock").exists() {
        not_applicable("no /dev/vsock on this host");
        return;
    }
    let Some(daemon) = daemon() else {
        return;
    };
    let probe = python(
        r#"
import socket
try:
    s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    s.bind((socket.VMADDR_CID_ANY, socket.VMADDR_PORT_ANY))
    print("vsock=0")
except OSError as e:
    print(f"vsock={e.errno}")
"#,
    );
    each_row(&daemon, &ONLY_TRUSTED, async |client, row| {
        let out = row.output(client, "vsock", &probe).await;
        row.check_zero(&out, "vsock", "has vsock");
    })
    .await;
    assert_daemon_intact(&daemon).await;
}
