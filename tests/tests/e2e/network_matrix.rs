//! Real programs under a network policy, against the test internet (issue 38, part 5): pip,
//! git, curl, Python's sockets, run inside the sandbox under a copy of `strict` and a copy of
//! `task-container` whose `network` is the same policy. Every case is a command of its own;
//! its outcome is checked from outside: its output, the decision log's lines carrying its id
//! (every line it left matches one expected, and every expected line is there), and which of
//! the test internet's HTTP servers saw a request (the others saw none). Each refusal stands
//! beside its allowed control in [`cases`].
//!
//! Beside the matrix: a policy under `landlock` (no namespaces) is refused when the daemon
//! starts, and two commands under different policies at once each keep to their own.
//!
//! The test internet (`executor_tests::test_internet`) is real servers on documentation-range
//! addresses in a namespace of their own; the daemon resolves their names through
//! `--egress-resolve`, as it would a registry's, and judges them like any public address.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use executor_tests::test_internet::{self, TestInternet, ECHO_OTHER_PORT, ECHO_PORT};
use executor_tests::{eventually, is_root, req, require, Client, Daemon, DaemonOptions, TempDir};
use serde_json::Value;

/// Names the daemon resolves besides the test internet's own, and what to.
const EVIL: &str = "evil.test.example"; // 127.0.0.1: allowed by name, refused by address
const OTHER: &str = "other.test.example"; // the index's address: no rule names it
const BLOCKED: &str = "blocked.test.example"; // the index's address: allowed, and denied
const MIXED: &str = "mixed.test.example"; // 127.0.0.1 and the index's address: allowed by name

/// What a case's output (trimmed) must be.
enum Expect {
    Is(String),
    Contains(&'static str),
    /// Any of these: a connection the daemon closes before reading the request is closed
    /// (curl's 52) or, when the request had come, reset (56).
    OneOf(&'static [&'static str]),
}

/// A decision-log line a case must leave: `port` 0 for any (a name lookup's).
struct Logged {
    kind: &'static str,
    host: String,
    port: u16,
    code: &'static str,
}

fn logged(kind: &'static str, host: impl ToString, port: u16, code: &'static str) -> Logged {
    Logged {
        kind,
        host: host.to_string(),
        port,
        code,
    }
}

/// One command inside the sandbox.
struct Case {
    /// The command's id, which its decision-log lines carry.
    id: &'static str,
    /// Shell, run in the workspace (where `probe.py` and `ca.pem` lie); it prints its outcome
    /// on standard output, its standard error goes to `<id>.err` (shown on failure).
    shell: String,
    expect: Expect,
    /// Every line the command leaves in the decision log matches one of these, and each of
    /// these matches one line (none: nothing reached the daemon).
    log: Vec<Logged>,
    /// The test internet's HTTP servers (`pypi`, `git`, `tls`) that must log a request; the
    /// others must log none.
    served: &'static [&'static str],
}

/// Probes the network from inside the sandbox, each printing one line: what happened.
const PROBE_PY: &str = r#"
import errno, socket, struct, sys

def failed(err):
    return errno.errorcode.get(err.errno, type(err).__name__) if err.errno else type(err).__name__

def connect(host, port):
    """CONNECT through the proxy, then a line through the tunnel: the status and the echo."""
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        if not chunk:
            break
        head += chunk
    status = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/") else "closed"
    if status != "200":
        return status
    s.sendall(b"ping\n")
    return f"{status} {s.recv(64).decode().strip()}"

def tcp(host, port):
    """A line to HOST:PORT (resolved in the sandbox) and its echo."""
    try:
        s = socket.create_connection((host, int(port)), timeout=20)
        s.sendall(b"ping\n")
        return s.recv(64).decode().strip() or "closed"
    except OSError as err:
        return failed(err)

def udp(host, port, payload=b"ping"):
    """A datagram to HOST:PORT and the reply within 3 s."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    try:
        s.connect((host, int(port)))
        s.send(payload)
        return s.recv(512)
    except OSError as err:
        return failed(err)

def dns(server, name):
    """An A query for NAME straight to SERVER:53: the address, or why not."""
    labels = b"".join(bytes([len(l)]) + l.encode() for l in name.split("."))
    query = struct.pack(">HHHHHH", 7, 0x100, 1, 0, 0, 0) + labels + b"\0" + struct.pack(">HH", 1, 1)
    reply = udp(server, 53, query)
    return socket.inet_ntoa(reply[-4:]) if isinstance(reply, bytes) else reply

def raw():
    """A stream socket (the control), then a raw one."""
    socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()
        return "stream=ok raw=ok"
    except OSError as err:
        return f"stream=ok raw={failed(err)}"

what, args = sys.argv[1], sys.argv[2:]
out = {"connect": connect, "tcp": tcp, "udp": udp, "dns": dns, "raw": raw}[what](*args)
print(out.decode() if isinstance(out, bytes) else out)
"#;

/// Shell functions every case may use: `code ARGS...` prints curl's HTTP status and exit code
/// (`403 rc=0`: refused by the proxy; `000 rc=7`: nothing to connect to; [`CLOSED`]: closed
/// with no answer), `probe` runs [`PROBE_PY`].
const PRELUDE: &str = r#"
code() { curl -sS -o /dev/null -m 20 -w '%{http_code}' "$@"; echo " rc=$?"; }
probe() { python3 probe.py "$@"; }
"#;

/// curl's outcome when the connection closes with no answer: closed (52), or reset (56).
const CLOSED: &[&str] = &["000 rc=52", "000 rc=56"];

/// The cases, in pairs: an allowed control, then the refusals beside it.
fn cases(net: &TestInternet, own_port: u16, loopback_port: u16) -> Vec<Case> {
    let (pypi, git, tls, echo) = (
        net.pypi().name,
        net.git().name,
        net.tls().name,
        net.echo().name,
    );
    let index = net.index_url();
    let pypi_v4 = net.pypi().v4;
    let pypi_v6 = net.pypi().v6;
    let (echo_v4, dns_v4) = (net.echo().v4, net.dns().v4);
    let package = test_internet::PACKAGE;
    let simple = format!("http://{pypi}/simple/");
    let is = |s: &str| Expect::Is(s.to_string());
    let dns_ok = |name: &str| logged("dns", name, 0, "allowed");
    vec![
        // Programs that need the network, through the proxy the environment names.
        Case {
            id: "pip",
            shell: format!(
                "python3 -m pip install --no-cache-dir --disable-pip-version-check \
                 --index-url {index} --trusted-host {pypi} --target pkgs {package} >&2 && \
                 PYTHONPATH=pkgs python3 -c 'import {m}; print({m}.GREETING)'",
                m = test_internet::PACKAGE_MODULE
            ),
            expect: is(test_internet::PACKAGE_GREETING),
            log: vec![logged("http", pypi, 80, "allowed")],
            served: &["pypi"],
        },
        // (An identity of its own: without one, as under strict's empty HOME, git looks up
        // the sandbox's host name for its reflog, which the resolver refuses and logs.)
        Case {
            id: "git",
            shell: format!(
                "git -c user.name=agent -c user.email=agent@sandbox.invalid clone --quiet {} \
                 clone >&2 && cat clone/README",
                net.repo_url()
            ),
            expect: is(test_internet::GIT_CONTENT.trim()),
            log: vec![logged("http", git, 80, "allowed")],
            served: &["git"],
        },
        Case {
            id: "curl-https",
            shell: format!("curl -sS -m 20 --cacert ca.pem {}", net.tls_url()),
            expect: is(test_internet::TLS_BODY.trim()),
            log: vec![logged("connect", tls, 443, "allowed")],
            served: &["tls"],
        },
        Case {
            id: "curl-proxy",
            shell: format!("curl -sS -m 20 {simple}"),
            expect: Expect::Contains(package),
            log: vec![logged("http", pypi, 80, "allowed")],
            served: &["pypi"],
        },
        // Another name, though the daemon resolves it to the index: no rule names it.
        Case {
            id: "other-name",
            shell: format!("code http://{OTHER}/simple/"),
            expect: is("403 rc=0"),
            log: vec![logged("http", OTHER, 80, "not_allowed")],
            served: &[],
        },
        // A deny rule wins over the allow rule naming the same name.
        Case {
            id: "deny-rule",
            shell: format!("code http://{BLOCKED}/simple/"),
            expect: is("403 rc=0"),
            log: vec![logged("http", BLOCKED, 80, "denied_by_rule")],
            served: &[],
        },
        // The allowed server by its address: no rule names the address.
        Case {
            id: "ip-literal",
            shell: format!("code http://{pypi_v4}/simple/"),
            expect: is("403 rc=0"),
            log: vec![logged("http", pypi_v4, 80, "not_allowed")],
            served: &[],
        },
        Case {
            id: "ipv6-literal",
            shell: format!("code -g 'http://[{pypi_v6}]/simple/'"),
            expect: is("403 rc=0"),
            log: vec![logged("http", pypi_v6, 80, "not_allowed")],
            served: &[],
        },
        // The Host header names another host than the request's target.
        Case {
            id: "host-mismatch",
            shell: format!("code -H 'Host: {OTHER}' {simple}"),
            expect: is("403 rc=0"),
            log: vec![logged("http", pypi, 80, "host_mismatch")],
            served: &[],
        },
        // Allowed by name, but the daemon resolves it to loopback.
        Case {
            id: "loopback-name",
            shell: format!("code http://{EVIL}:{loopback_port}/"),
            expect: is("403 rc=0"),
            log: vec![logged("http", EVIL, loopback_port, "special_address")],
            served: &[],
        },
        // One of its addresses is the index's, one loopback: the one refuses the other too.
        Case {
            id: "loopback-among-addresses",
            shell: format!("code http://{MIXED}/simple/"),
            expect: is("403 rc=0"),
            log: vec![logged("http", MIXED, 80, "special_address")],
            served: &[],
        },
        // The same without the proxy: the sandbox's resolver and the capture listeners.
        Case {
            id: "resolver",
            shell: format!("getent ahosts {pypi} | awk '{{print $1; exit}}'"),
            expect: Expect::Contains("127.1."),
            log: vec![dns_ok(pypi)],
            served: &[],
        },
        Case {
            id: "resolver-other-name",
            shell: format!("getent ahosts {OTHER} || echo none"),
            expect: is("none"),
            log: vec![logged("dns", OTHER, 0, "not_allowed")],
            served: &[],
        },
        Case {
            id: "capture",
            shell: format!("curl -sS -m 20 --noproxy '*' {simple}"),
            expect: Expect::Contains(package),
            log: vec![dns_ok(pypi), logged("tcp", pypi, 80, "allowed")],
            served: &["pypi"],
        },
        Case {
            id: "capture-https",
            shell: format!(
                "curl -sS -m 20 --noproxy '*' --cacert ca.pem {}",
                net.tls_url()
            ),
            expect: is(test_internet::TLS_BODY.trim()),
            log: vec![dns_ok(tls), logged("tcp", tls, 443, "allowed")],
            served: &["tls"],
        },
        Case {
            id: "capture-other-name",
            shell: format!("code --noproxy '*' http://{OTHER}/simple/"),
            expect: is("000 rc=6"),
            log: vec![logged("dns", OTHER, 0, "not_allowed")],
            served: &[],
        },
        Case {
            id: "capture-host-mismatch",
            shell: format!("code --noproxy '*' -H 'Host: {OTHER}' {simple}"),
            expect: Expect::OneOf(CLOSED),
            log: vec![dns_ok(pypi), logged("tcp", pypi, 80, "host_mismatch")],
            served: &[],
        },
        Case {
            id: "capture-loopback-name",
            shell: format!("code --noproxy '*' http://{EVIL}/"),
            expect: Expect::OneOf(CLOSED),
            log: vec![dns_ok(EVIL), logged("tcp", EVIL, 80, "special_address")],
            served: &[],
        },
        // Straight to an address, or over IPv6: nothing to connect to (no route, no AAAA),
        // and nothing reaches the daemon.
        Case {
            id: "direct-ip-literal",
            shell: format!("code --noproxy '*' http://{pypi_v4}/simple/"),
            expect: is("000 rc=7"),
            log: vec![],
            served: &[],
        },
        Case {
            id: "direct-ipv6-literal",
            shell: format!("code --noproxy '*' -g 'http://[{pypi_v6}]/simple/'"),
            expect: is("000 rc=7"),
            log: vec![],
            served: &[],
        },
        // (curl looks up both families and finds no IPv6 address to try: the sandbox's
        // resolver answers AAAA with none.)
        Case {
            id: "ipv6-by-name",
            shell: format!("code -6 --noproxy '*' {simple}"),
            expect: is("000 rc=7"),
            log: vec![dns_ok(pypi)],
            served: &[],
        },
        // TLS whose SNI names another host than the one tunnelled to (curl's --connect-to
        // sends the connection, and the CONNECT, to the TLS server; the SNI stays the index's).
        Case {
            id: "sni-mismatch",
            shell: format!(
                "code --cacert ca.pem --connect-to {pypi}:443:{tls}:443 https://{pypi}/"
            ),
            expect: is("000 rc=35"),
            log: vec![logged("connect", tls, 443, "sni_mismatch")],
            served: &[],
        },
        Case {
            id: "capture-sni-mismatch",
            shell: format!(
                "code --noproxy '*' --cacert ca.pem --connect-to {pypi}:443:{tls}:443 \
                 https://{pypi}/"
            ),
            expect: is("000 rc=35"),
            log: vec![dns_ok(tls), logged("tcp", tls, 443, "sni_mismatch")],
            served: &[],
        },
        // Plain TCP: the echo server on its allowed port, then on a port no rule names.
        Case {
            id: "tcp-echo",
            shell: format!("probe tcp {echo} {ECHO_PORT}"),
            expect: is("ping"),
            log: vec![dns_ok(echo), logged("tcp", echo, ECHO_PORT, "allowed")],
            served: &[],
        },
        Case {
            id: "tcp-other-port",
            shell: format!("probe tcp {echo} {ECHO_OTHER_PORT}"),
            expect: is("ECONNREFUSED"),
            log: vec![dns_ok(echo)],
            served: &[],
        },
        Case {
            id: "connect-echo",
            shell: format!("probe connect {echo} {ECHO_PORT}"),
            expect: is("200 ping"),
            log: vec![logged("connect", echo, ECHO_PORT, "allowed")],
            served: &[],
        },
        Case {
            id: "connect-other-port",
            shell: format!("probe connect {echo} {ECHO_OTHER_PORT}"),
            expect: is("403"),
            log: vec![logged("connect", echo, ECHO_OTHER_PORT, "not_allowed")],
            served: &[],
        },
        // CONNECT to the daemon's own listener and to the host's loopback, by address and by
        // the allowed name that resolves there.
        Case {
            id: "connect-own-listener",
            shell: format!("probe connect 127.0.0.1 {own_port}"),
            expect: is("403"),
            log: vec![logged("connect", "127.0.0.1", own_port, "not_allowed")],
            served: &[],
        },
        Case {
            id: "connect-own-listener-by-name",
            shell: format!("probe connect {EVIL} {own_port}"),
            expect: is("403"),
            log: vec![logged("connect", EVIL, own_port, "own_listener")],
            served: &[],
        },
        Case {
            id: "connect-loopback",
            shell: format!("probe connect 127.0.0.1 {loopback_port}"),
            expect: is("403"),
            log: vec![logged("connect", "127.0.0.1", loopback_port, "not_allowed")],
            served: &[],
        },
        Case {
            id: "connect-loopback-by-name",
            shell: format!("probe connect {EVIL} {loopback_port}"),
            expect: is("403"),
            log: vec![logged("connect", EVIL, loopback_port, "special_address")],
            served: &[],
        },
        // UDP and raw sockets: the resolver in the sandbox answers (the control, `resolver`
        // above); the test internet's DNS server and its UDP echo are not reachable at all.
        Case {
            id: "dns-direct",
            shell: format!("probe dns {dns_v4} {pypi}"),
            expect: is("ENETUNREACH"),
            log: vec![],
            served: &[],
        },
        Case {
            id: "udp-echo",
            shell: format!("probe udp {echo_v4} {ECHO_PORT}"),
            expect: is("ENETUNREACH"),
            log: vec![],
            served: &[],
        },
        Case {
            id: "udp-echo-by-name",
            shell: format!("probe udp {echo} {ECHO_PORT}"),
            expect: is("ECONNREFUSED"),
            log: vec![dns_ok(echo)],
            served: &[],
        },
        Case {
            id: "raw-socket",
            shell: "probe raw".to_string(),
            expect: is("stream=ok raw=EPERM"),
            log: vec![],
            served: &[],
        },
    ]
}

/// A TCP server on the host's loopback counting the connections it accepts (none must come:
/// the policy names no loopback address). Stops on drop.
struct Loopback {
    port: u16,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl Loopback {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (count, stopping) = (accepted.clone(), stop.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stopping.load(Ordering::SeqCst) {
                    break;
                }
                if let Ok(mut stream) = stream {
                    count.fetch_add(1, Ordering::SeqCst);
                    let _ = stream.write_all(b"hello from the host's loopback\n");
                }
            }
        });
        Self {
            port,
            accepted,
            stop,
        }
    }
}

impl Drop for Loopback {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accepting thread, which then ends and closes the listener.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// The policy under test, the same in both profiles.
fn policy(net: &TestInternet) -> Value {
    serde_json::json!({
        "mode": "policy",
        "allow": [
            format!("{}:80", net.pypi().name),
            format!("{}:80", net.git().name),
            format!("{}:443", net.tls().name),
            format!("{}:{ECHO_PORT}", net.echo().name),
            format!("{BLOCKED}:80"),
            EVIL,
            format!("{MIXED}:80"),
        ],
        "deny": [BLOCKED],
        "reason": "the test internet's servers",
    })
}

/// Writes a copy of `base` (a profile of `sandbox-profiles/`) named `name`, its `network`
/// replaced, into `dir`.
fn write_profile(dir: &Path, base: &str, name: &str, network: Value) {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../sandbox-profiles/{base}.json")),
    )
    .unwrap();
    let mut profile: Value = serde_json::from_str(&text).unwrap();
    profile["name"] = name.into();
    profile["network"] = network;
    std::fs::write(dir.join(format!("{name}.json")), profile.to_string()).unwrap();
}

/// Requests seen by each HTTP server of the test internet so far (its log's request lines).
fn requests_seen(net: &TestInternet) -> [(&'static str, usize); 3] {
    ["pypi", "git", "tls"].map(|role| (role, net.log(role).matches("\"GET ").count()))
}

fn records(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn matches(record: &Value, want: &Logged) -> bool {
    record["kind"] == want.kind
        && record["host"] == want.host.as_str()
        && (want.port == 0 || record["port"] == want.port)
        && record["code"] == want.code
        && record["allowed"] == (want.code == "allowed")
}

/// Runs every case under `base` (a profile of `sandbox-profiles/`) with the policy, and checks
/// each from outside.
async fn run_matrix(base: &str) {
    if !require("root (network namespaces, the test internet)", is_root()) {
        return;
    }
    let net = TestInternet::start();
    let loopback = Loopback::start();
    let profiles = TempDir::new().unwrap();
    let name = format!("{base}-matrix");
    write_profile(profiles.path(), base, &name, policy(&net));

    let pypi_v4 = net.pypi().v4.to_string();
    let mut resolve = net.resolve_pairs();
    resolve.push(format!("{EVIL}=127.0.0.1"));
    resolve.push(format!("{OTHER}={pypi_v4}"));
    resolve.push(format!("{BLOCKED}={pypi_v4}"));
    // (Loopback first: the index's address, given last, must not replace it.)
    resolve.push(format!("{MIXED}=127.0.0.1"));
    resolve.push(format!("{MIXED}={pypi_v4}"));
    let mut args = vec![
        "--profiles-dir".to_string(),
        profiles.path().display().to_string(),
        "--allow-profile".to_string(),
        name.clone(),
    ];
    for pair in &resolve {
        args.extend(["--egress-resolve".to_string(), pair.clone()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let daemon = Daemon::start_with(&args);
    let mut client = daemon.connect().await;
    let available = client.hello.profiles.iter().find(|p| p.name == name);
    assert!(
        available.is_some_and(|p| p.available),
        "{:?}\n{}",
        client.hello.profiles,
        daemon.log()
    );

    // What the cases read: the probes, and the test CA (the sandbox sees no test file).
    let ws = &daemon.workspace;
    std::fs::create_dir_all(ws).unwrap();
    std::fs::write(ws.join("probe.py"), PROBE_PY).unwrap();
    std::fs::copy(net.ca_pem(), ws.join("ca.pem")).unwrap();

    let log_path = daemon.state.path().join("audit.network.jsonl");
    let mut failures = Vec::new();
    let all = cases(&net, daemon.addr.port(), loopback.port);
    for case in &all {
        let before = requests_seen(&net);
        let (out, denied) = run_case(&mut client, &name, ws, case).await;
        let after = requests_seen(&net);
        let ok = match &case.expect {
            Expect::Is(want) => out == *want,
            Expect::Contains(want) => out.contains(want),
            Expect::OneOf(any) => any.contains(&out.as_str()),
        };
        if !ok {
            let err = std::fs::read_to_string(ws.join(format!("{}.err", case.id)));
            failures.push(format!(
                "{}: printed {out:?}, wanted {}\n  stderr: {}",
                case.id,
                match &case.expect {
                    Expect::Is(w) => format!("{w:?}"),
                    Expect::Contains(w) => format!("something with {w:?}"),
                    Expect::OneOf(any) => format!("one of {any:?}"),
                },
                err.unwrap_or_default().trim()
            ));
        }
        // The result names each refusal too, as `host:port (code)`.
        for want in case.log.iter().filter(|l| l.code != "allowed") {
            let (host, code) = (format!("{}:", want.host), format!(" ({})", want.code));
            if !denied
                .iter()
                .any(|d| d.starts_with(&host) && d.ends_with(&code))
            {
                failures.push(format!(
                    "{}: the result's denied_first {denied:?} does not name {host}{}{code}",
                    case.id, want.port
                ));
            }
        }
        for ((role, was), (_, now)) in before.iter().zip(after) {
            let should = case.served.contains(role);
            if (now > *was) != should {
                failures.push(format!(
                    "{}: the {role} server saw {} requests, wanted {}",
                    case.id,
                    now - was,
                    if should { "some" } else { "none" }
                ));
            }
        }
    }

    // The decision log: a line is written when its attempt ends (a relayed response's after
    // its last byte), so wait for every expected one, then check the lines each command left.
    let found_all = |records: &[Value]| {
        all.iter().all(|case| {
            case.log.iter().all(|want| {
                records
                    .iter()
                    .any(|r| r["command"] == case.id && matches(r, want))
            })
        })
    };
    eventually(Duration::from_secs(15), || found_all(&records(&log_path))).await;
    let records = records(&log_path);
    for case in &all {
        let own: Vec<&Value> = records.iter().filter(|r| r["command"] == case.id).collect();
        for want in &case.log {
            if !own.iter().any(|r| matches(r, want)) {
                failures.push(format!(
                    "{}: no {} {}:{} {} line in the decision log; its lines: {own:#?}",
                    case.id, want.kind, want.host, want.port, want.code
                ));
            }
        }
        for r in &own {
            if !case.log.iter().any(|want| matches(r, want)) {
                failures.push(format!("{}: an unexpected decision-log line {r}", case.id));
            }
        }
    }
    // Nothing reached the host's loopback: the daemon refused before dialing.
    if loopback.accepted.load(Ordering::SeqCst) != 0 {
        failures.push("the host's loopback server accepted a connection".to_string());
    }
    assert!(
        failures.is_empty(),
        "{} failures in {} cases under {name}:\n{}\n\ndaemon log:\n{}",
        failures.len(),
        all.len(),
        failures.join("\n"),
        tail(&daemon.log(), 60)
    );
}

/// Runs one case as a command of its own (its id the case's): its output, trimmed, and the
/// refusals its result names (`isolation.network.denied_first`).
async fn run_case(
    client: &mut Client,
    profile: &str,
    ws: &Path,
    case: &Case,
) -> (String, Vec<String>) {
    let script = format!("{PRELUDE}\n{{\n{}\n}} 2>{}.err\n", case.shell, case.id);
    let mut r = req(case.id, &script);
    r.profile = Some(profile.to_string());
    r.cwd = Some(ws.display().to_string());
    r.timeout = Some(120.0);
    let result = client
        .exec(r)
        .await
        .result
        .unwrap_or_else(|err| panic!("{}: {err:?}", case.id));
    assert!(
        result.exception_info.is_empty(),
        "{}: {}",
        case.id,
        result.exception_info
    );
    let network = result
        .extra
        .isolation
        .network
        .and_then(|network| network.connections)
        .unwrap_or_else(|| {
            panic!(
                "{}: no isolation.network.connections in the result",
                case.id
            )
        });
    (result.output.trim().to_string(), network.denied_first)
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[tokio::test]
async fn real_programs_under_a_strict_policy_reach_what_it_allows_and_nothing_else() {
    run_matrix("strict").await;
}

#[tokio::test]
async fn real_programs_under_a_task_container_policy_reach_what_it_allows_and_nothing_else() {
    run_matrix("task-container").await;
}

/// Under `landlock` (no namespaces) a command could connect around the daemon's proxy, so a
/// policy is never offered there: the daemon refuses the profile when it starts, naming why.
/// The control: the same profile with its shipped `none` starts and is offered.
#[tokio::test]
async fn a_landlock_policy_is_refused_when_the_daemon_starts() {
    let start = |network: Value| {
        let profiles = TempDir::new().unwrap();
        write_profile(profiles.path(), "landlock", "landlock-matrix", network);
        let extra = ["--profiles-dir", profiles.path().to_str().unwrap()]
            .into_iter()
            .chain(["--allow-profile", "landlock-matrix"])
            .map(String::from)
            .collect();
        Daemon::try_start_opts(DaemonOptions {
            extra,
            ..DaemonOptions::default()
        })
    };
    let refused = start(serde_json::json!({
        "mode": "policy",
        "allow": ["pypi.test.example:80"],
        "reason": "the test internet's index",
    }));
    let log = refused
        .err()
        .expect("the daemon started with a landlock policy");
    assert!(
        log.contains("landlock-matrix")
            && log.contains("needs the network namespace")
            && log.contains("could not be enforced"),
        "{log}"
    );
    let control = start(serde_json::json!({ "mode": "none" }))
        .unwrap_or_else(|log| panic!("the control did not start: {log}"));
    let client = control.connect().await;
    let offered = client
        .hello
        .profiles
        .iter()
        .find(|p| p.name == "landlock-matrix");
    assert!(
        offered.is_some_and(|p| p.available),
        "{:?}",
        client.hello.profiles
    );
}

/// Two commands at once on one daemon, under two profiles whose policies differ (the index
/// only, the git server only), each in its namespace with its own listeners: each reaches what
/// its own policy allows and is refused the other's, and the decision log says which command
/// asked. (Two clients with policies of their own come with the clients file's `network`.)
#[tokio::test]
async fn two_commands_under_different_policies_at_once_stay_apart() {
    if !require("root (network namespaces, the test internet)", is_root()) {
        return;
    }
    let net = TestInternet::start();
    let profiles = TempDir::new().unwrap();
    let (pypi, git) = (net.pypi().name, net.git().name);
    let only = |name: &str| {
        serde_json::json!({
            "mode": "policy",
            "allow": [format!("{name}:80")],
            "reason": "one server of the test internet",
        })
    };
    write_profile(profiles.path(), "strict", "strict-pypi", only(pypi));
    write_profile(profiles.path(), "strict", "strict-git", only(git));
    let mut args = vec![
        "--profiles-dir".to_string(),
        profiles.path().display().to_string(),
    ];
    for name in ["strict-pypi", "strict-git"] {
        args.extend(["--allow-profile".to_string(), name.to_string()]);
    }
    for pair in net.resolve_pairs() {
        args.extend(["--egress-resolve".to_string(), pair]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let daemon = Daemon::start_with(&args);
    let (mut a, mut b) = (daemon.connect().await, daemon.connect().await);
    let ws = daemon.workspace.display().to_string();
    // Each says it is running, then waits for the other: the two overlap.
    let script = |me: &str, other: &str| {
        format!(
            r#"touch {me}.running
for _ in $(seq 200); do [ -e {other}.running ] && break; sleep 0.05; done
[ -e {other}.running ] || echo "{other} never ran beside {me}"
echo "pypi: $(curl -s -o /dev/null -m 20 -w '%{{http_code}}' http://{pypi}/simple/)"
echo "git: $(curl -s -o /dev/null -m 20 -w '%{{http_code}}' {repo}/HEAD)"
"#,
            repo = net.repo_url()
        )
    };
    let request = |id: &str, profile: &str, other: &str| {
        let mut r = req(id, &script(id, other));
        r.profile = Some(profile.to_string());
        r.cwd = Some(ws.clone());
        r.timeout = Some(60.0);
        r
    };
    let (ra, rb) = tokio::join!(
        a.exec(request("with-pypi", "strict-pypi", "with-git")),
        b.exec(request("with-git", "strict-git", "with-pypi")),
    );
    let (ra, rb) = (ra.result.unwrap(), rb.result.unwrap());
    assert_eq!(ra.output.trim(), "pypi: 200\ngit: 403", "{}", ra.output);
    assert_eq!(rb.output.trim(), "pypi: 403\ngit: 200", "{}", rb.output);

    let log_path = daemon.state.path().join("audit.network.jsonl");
    let expected = [
        ("with-pypi", logged("http", pypi, 80, "allowed")),
        ("with-pypi", logged("http", git, 80, "not_allowed")),
        ("with-git", logged("http", git, 80, "allowed")),
        ("with-git", logged("http", pypi, 80, "not_allowed")),
    ];
    let found = |records: &[Value]| {
        expected.iter().all(|(id, want)| {
            records
                .iter()
                .any(|r| r["command"] == *id && matches(r, want))
        })
    };
    eventually(Duration::from_secs(15), || found(&records(&log_path))).await;
    let records = records(&log_path);
    assert!(found(&records), "{records:#?}");
    assert_eq!(records.len(), expected.len(), "{records:#?}");
}

/// `curl`'s HTTP status for the test internet's index and for its git server, one line each.
fn pypi_and_git(net: &TestInternet) -> String {
    format!(
        "echo \"pypi: $(curl -s -o /dev/null -m 20 -w '%{{http_code}}' http://{pypi}/simple/)\"
echo \"git: $(curl -s -o /dev/null -m 20 -w '%{{http_code}}' {repo}/HEAD)\"",
        pypi = net.pypi().name,
        repo = net.repo_url()
    )
}

/// `serve --egress-resolve` for each of the test internet's names.
fn resolve_args(net: &TestInternet) -> Vec<String> {
    net.resolve_pairs()
        .into_iter()
        .flat_map(|pair| ["--egress-resolve".to_string(), pair])
        .collect()
}

/// `serve --allow-net` without a clients file: the single token's ceiling is that policy, so
/// under strict a command that asks for nothing gets it (reaches the allowed server, is
/// refused the other, its refusal in the decision log under the client `default`). With a
/// clients file the flag is refused at start, naming where a client's network goes.
#[tokio::test]
async fn serve_allow_net_is_the_single_tokens_ceiling_and_is_refused_beside_a_clients_file() {
    if !require("root (network namespaces, the test internet)", is_root()) {
        return;
    }
    let net = TestInternet::start();
    let (pypi, git) = (net.pypi().name, net.git().name);
    let allow = format!("{pypi}:80");
    let mut args = vec![
        "--allow-profile".to_string(),
        "strict".to_string(),
        "--allow-net".to_string(),
        allow.clone(),
        "--deny-net".to_string(),
        BLOCKED.to_string(),
    ];
    args.extend(resolve_args(&net));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let daemon = Daemon::start_with(&args);
    let mut client = daemon.connect().await;
    let ceiling = client
        .hello
        .network
        .clone()
        .expect("a ceiling in the hello");
    assert_eq!(ceiling.mode, "policy", "{ceiling:?}");
    assert_eq!(ceiling.layers.len(), 1, "{ceiling:?}");
    assert_eq!(ceiling.layers[0].layer, "client");
    assert_eq!(ceiling.layers[0].allow, [allow.as_str()]);
    assert_eq!(ceiling.layers[0].deny, [BLOCKED]);
    let mut r = req("single", &pypi_and_git(&net));
    r.profile = Some("strict".into());
    r.timeout = Some(60.0);
    let result = client.exec(r).await.result.unwrap();
    assert_eq!(result.output.trim(), "pypi: 200\ngit: 403", "{result:?}");
    let network = result.extra.isolation.network.clone().unwrap();
    assert_eq!(network.mode, "policy", "{network:?}");
    let [(_, pypi_seen), (_, git_seen), _] = requests_seen(&net);
    assert_eq!((pypi_seen, git_seen), (1, 0), "{}", net.log("git"));
    let log_path = daemon.state.path().join("audit.network.jsonl");
    let expected = [
        logged("http", pypi, 80, "allowed"),
        logged("http", git, 80, "not_allowed"),
    ];
    let found = |records: &[Value]| {
        expected.iter().all(|want| {
            records
                .iter()
                .any(|r| r["command"] == "single" && r["client"] == "default" && matches(r, want))
        })
    };
    eventually(Duration::from_secs(15), || found(&records(&log_path))).await;
    assert!(found(&records(&log_path)), "{:#?}", records(&log_path));

    // A clients file says each client's network in its entries: beside it the flag is
    // refused at start.
    let (_dir, file) = crate::clients::clients_file(&serde_json::json!({"clients": [
        {"name": "alice", "token": crate::clients::ALICE},
    ]}));
    let refused = Daemon::try_start_opts(DaemonOptions {
        extra: vec![
            "--clients".into(),
            file.display().to_string(),
            "--allow-net".into(),
            allow.clone(),
        ],
        state_parent: Some("/var/tmp".into()),
        ..Default::default()
    })
    .err()
    .expect("refused");
    assert!(
        refused.contains("put `network` in the clients file's entries"),
        "{refused}"
    );
    // Control: the same clients file without the flag starts.
    let started = crate::clients::start(&file, &["--allow-profile", "strict"]);
    crate::clients::connect(&started, crate::clients::ALICE).await;
}

/// Two clients of one daemon, each with a policy of its own in the clients file (the index
/// only, the git server only), both under strict: each reaches its own server and is refused
/// the other's, and each refusal is in the decision log under its own client's name.
#[tokio::test]
async fn two_clients_with_policies_of_their_own_stay_apart() {
    if !require("root (network namespaces, the test internet)", is_root()) {
        return;
    }
    let net = TestInternet::start();
    let (pypi, git) = (net.pypi().name, net.git().name);
    let only = |name: &str| serde_json::json!({"mode": "policy", "allow": [format!("{name}:80")]});
    let (_dir, file) = crate::clients::clients_file(&serde_json::json!({"clients": [
        {"name": "alice", "token": crate::clients::ALICE, "network": only(pypi)},
        {"name": "bob", "token": crate::clients::BOB, "network": only(git)},
    ]}));
    let mut args = vec!["--allow-profile".to_string(), "strict".to_string()];
    args.extend(resolve_args(&net));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let daemon = crate::clients::start(&file, &args);
    let mut alice = crate::clients::connect(&daemon, crate::clients::ALICE).await;
    let mut bob = crate::clients::connect(&daemon, crate::clients::BOB).await;
    let request = |id: &str| {
        let mut r = req(id, &pypi_and_git(&net));
        r.profile = Some("strict".into());
        r.timeout = Some(60.0);
        r
    };
    let (ra, rb) = tokio::join!(alice.exec(request("a")), bob.exec(request("b")));
    let (ra, rb) = (ra.result.unwrap(), rb.result.unwrap());
    assert_eq!(ra.output.trim(), "pypi: 200\ngit: 403", "{ra:?}");
    assert_eq!(rb.output.trim(), "pypi: 403\ngit: 200", "{rb:?}");
    let [(_, pypi_seen), (_, git_seen), _] = requests_seen(&net);
    assert_eq!((pypi_seen, git_seen), (1, 1));

    let log_path = daemon.state.path().join("audit.network.jsonl");
    let expected = [
        ("alice", logged("http", pypi, 80, "allowed")),
        ("alice", logged("http", git, 80, "not_allowed")),
        ("bob", logged("http", git, 80, "allowed")),
        ("bob", logged("http", pypi, 80, "not_allowed")),
    ];
    let found = |records: &[Value]| {
        expected.iter().all(|(client, want)| {
            records
                .iter()
                .any(|r| r["client"] == *client && matches(r, want))
        })
    };
    eventually(Duration::from_secs(15), || found(&records(&log_path))).await;
    let records = records(&log_path);
    assert!(found(&records), "{records:#?}");
    assert_eq!(records.len(), expected.len(), "{records:#?}");
}
