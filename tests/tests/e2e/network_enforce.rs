//! A profile's network policy, enforced (issue 38): the command's network namespace holds
//! only loopback and the daemon's listeners (proxy on 3128, resolver on 53, capture ports), so
//! what the policy allows works and everything else is refused, each refusal beside its
//! allowed control and found in the decision log with its fields. Host servers on loopback
//! stand in for the internet: the test profile names `127.0.0.0/8` by CIDR (loopback is
//! special) and the name `allowed.test`, which `--egress-resolve` points at 127.0.0.1.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::Duration;

use executor_tests::{eventually, is_root, req, require, Daemon, TempDir};

/// A tiny HTTP server on the host's loopback answering every request with `body`.
fn http_server(body: &'static str) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let _ = stream.read(&mut buf);
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    port
}

/// A TCP server on the host's loopback that greets every connection with `greeting`.
fn tcp_server(greeting: &'static str) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let _ = stream.write_all(greeting.as_bytes());
        }
    });
    port
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// Every process on the host holding the network namespace `ns` (`net:[N]`), by its
/// namespace link or a descriptor.
fn holders_of(ns: &str) -> Vec<String> {
    let mut found = Vec::new();
    for proc_dir in std::fs::read_dir("/proc").unwrap().flatten() {
        let dir = proc_dir.path();
        if std::fs::read_link(dir.join("ns/net")).is_ok_and(|l| l.to_string_lossy() == ns) {
            found.push(dir.display().to_string());
        }
        for fd in std::fs::read_dir(dir.join("fd"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == ns) {
                found.push(fd.path().display().to_string());
            }
        }
    }
    found
}

#[tokio::test]
async fn a_profile_policy_lets_through_only_what_it_allows_and_logs_every_refusal() {
    if !require("root (network namespaces)", is_root()) {
        return;
    }
    let web = http_server("hello from the allowed web server\n");
    let echo = tcp_server("hello from the allowed tcp server\n");
    let elsewhere = http_server("hello from a port the policy does not name\n");

    let dir = TempDir::new().unwrap();
    let strict = include_str!("../../../sandbox-profiles/strict.json");
    let mut profile: serde_json::Value = serde_json::from_str(strict).unwrap();
    profile["name"] = "strict-policy".into();
    profile["network"] = serde_json::json!({
        "mode": "policy",
        "allow": [
            format!("allowed.test:{web}"),
            format!("allowed.test:{echo}"),
            "127.0.0.0/8",
        ],
        "reason": "the test's servers on the host's loopback",
    });
    std::fs::write(dir.path().join("strict-policy.json"), profile.to_string()).unwrap();
    let daemon = Daemon::start_with(&[
        "--profiles-dir",
        dir.path().to_str().unwrap(),
        "--allow-profile",
        "strict-policy",
        "--egress-resolve",
        "allowed.test=127.0.0.1",
        "--egress-resolve",
        "denied.test=127.0.0.1",
    ]);
    let mut client = daemon.connect().await;
    let available = client
        .hello
        .profiles
        .iter()
        .find(|p| p.name == "strict-policy");
    assert!(
        available.is_some_and(|p| p.available),
        "{:?}\n{}",
        client.hello.profiles,
        daemon.log()
    );
    let fds_before = fd_count(daemon.pid());

    let own = daemon.addr.port();
    let script = format!(
        r#"
code() {{ curl -s -o /dev/null -m 10 -w '%{{http_code}}' "$@"; }}
echo "proxy-allowed: $(curl -s -m 10 http://allowed.test:{web}/)"
echo "proxy-other-name: $(code http://denied.test:{web}/)"
echo "proxy-ip-literal: $(code http://192.0.2.1:{web}/)"
echo "proxy-ip-allowed: $(curl -s -m 10 -x http://127.0.0.1:3128 --noproxy '' http://127.0.0.1:{web}/)"
echo "proxy-other-port: $(code http://allowed.test:{elsewhere}/)"
echo "proxy-connect-allowed: $(curl -s -o /dev/null -m 10 -p -x http://127.0.0.1:3128 --noproxy '' -w '%{{http_connect}}' http://allowed.test:{web}/)"
echo "proxy-own-listener: $(curl -s -o /dev/null -m 10 -p -x http://127.0.0.1:3128 --noproxy '' -w '%{{http_connect}}' http://127.0.0.1:{own}/)"
echo "dns-allowed: $(getent ahosts allowed.test | awk '{{print $1; exit}}')"
echo "dns-other-name: $(getent ahosts denied.test || echo none)"
echo "dns-tcp: $(python3 -c '
import socket, struct
q = struct.pack(">HHHHHH", 9, 0x100, 1, 0, 0, 0) + b"\x07allowed\x04test\x00" + struct.pack(">HH", 1, 1)
s = socket.create_connection(("127.0.0.1", 53), timeout=10)
s.sendall(struct.pack(">H", len(q)) + q)
n = struct.unpack(">H", s.recv(2))[0]
r = s.recv(n)
print(socket.inet_ntoa(r[-4:]))
')"
echo "capture-allowed: $(curl -s -m 10 --noproxy '*' http://allowed.test:{web}/)"
echo "tcp-allowed: $(timeout 10 bash -c 'exec 3<>/dev/tcp/allowed.test/{echo}; head -1 <&3')"
literal=$(timeout 10 bash -c 'exec 3<>/dev/tcp/127.0.0.1/{echo}; head -1 <&3' 2>/dev/null)
echo "tcp-ip-literal: ${{literal:-refused}}"
start=$(date +%s)
echo "route-10: $(curl -s -m 10 --noproxy '*' -o /dev/null -w '%{{http_code}}' http://10.0.0.1:{web}/; echo " rc=$?")"
echo "route-8888: $(timeout 10 bash -c 'exec 3<>/dev/tcp/8.8.8.8/53' 2>&1 | grep -o 'unreachable' | head -1)"
echo "route-seconds: $(( $(date +%s) - start ))"
echo "ns: $(readlink /proc/self/ns/net)"
"#
    );
    let mut r = req("policy", &script);
    r.profile = Some("strict-policy".into());
    r.timeout = Some(120.0);
    let result = client.exec(r).await.result.unwrap();
    let out = result.output.clone();
    let line = |key: &str| -> String {
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}: ")))
            .unwrap_or_else(|| panic!("no {key} in {out}\n{}", daemon.log()))
            .trim()
            .to_string()
    };

    // Through the proxy (the environment names it): the allowed name and port get through;
    // another name, an address literal, another port and the daemon's own listener get 403.
    assert_eq!(line("proxy-allowed"), "hello from the allowed web server");
    assert_eq!(line("proxy-other-name"), "403");
    assert_eq!(line("proxy-ip-literal"), "403");
    // (an address literal a CIDR rule names gets through)
    assert_eq!(
        line("proxy-ip-allowed"),
        "hello from the allowed web server"
    );
    assert_eq!(line("proxy-other-port"), "403");
    // CONNECT to an allowed target is answered 200; to the daemon's own listener, 403.
    assert_eq!(line("proxy-connect-allowed"), "200");
    assert_eq!(line("proxy-own-listener"), "403");
    // The resolver: a synthetic address for the allowed name, nothing for another.
    assert!(line("dns-allowed").starts_with("127.1."), "{out}");
    assert_eq!(line("dns-other-name"), "none");
    // Over TCP too (resolvers retry there), the same answer.
    assert_eq!(line("dns-tcp"), line("dns-allowed"), "{out}");
    // Without the proxy: the resolver's address is captured and relayed, for HTTP and for
    // plain TCP; an address the resolver never gave reaches nothing.
    assert_eq!(line("capture-allowed"), "hello from the allowed web server");
    assert_eq!(line("tcp-allowed"), "hello from the allowed tcp server");
    assert_eq!(line("tcp-ip-literal"), "refused");
    // Straight out: no route at all (fails at once, not by a timeout).
    assert!(line("route-10").ends_with("rc=7"), "{out}");
    assert_eq!(line("route-8888"), "unreachable");
    assert!(line("route-seconds").parse::<u64>().unwrap() < 8, "{out}");

    // The result names the refusals.
    let network = result
        .extra
        .isolation
        .network
        .clone()
        .expect("isolation.network");
    assert_eq!(network.mode, "policy", "{network:?}");
    let network = network.connections.expect("isolation.network.connections");
    assert!(network.denied >= 6, "{network:?}");
    assert!(network.allowed >= 4, "{network:?}");
    assert!(network.captured_ports.contains(&web), "{network:?}");
    // Every port of 127.0.0.0/8 is too many to capture: through the proxy only, and said so.
    assert_eq!(network.proxy_only, vec!["127.0.0.0/8".to_string()]);
    assert!(
        network
            .denied_first
            .iter()
            .any(|d| d.starts_with("denied.test:")),
        "{network:?}"
    );

    // The decision log: every attempt that reached the daemon, with its fields.
    let log_path = daemon.state.path().join("audit.network.jsonl");
    let records: Vec<serde_json::Value> = std::fs::read_to_string(&log_path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let find = |kind: &str, host: &str, port: u16, allowed: bool| {
        records
            .iter()
            .find(|r| {
                r["kind"] == kind
                    && r["host"] == host
                    && (port == 0 || r["port"] == port)
                    && r["allowed"] == allowed
                    && r["command"] == "policy"
            })
            .unwrap_or_else(|| panic!("no {kind} {host}:{port} {allowed} in {records:#?}"))
    };
    let ok = find("http", "allowed.test", web, true);
    assert_eq!(ok["code"], "allowed");
    assert!(ok["bytes_down"].as_u64().unwrap() > 0, "{ok}");
    assert_eq!(
        find("http", "denied.test", web, false)["code"],
        "not_allowed"
    );
    assert_eq!(find("http", "192.0.2.1", web, false)["code"], "not_allowed");
    assert_eq!(
        find("http", "allowed.test", elsewhere, false)["code"],
        "not_allowed"
    );
    let own_record = find("connect", "127.0.0.1", own, false);
    assert_eq!(own_record["code"], "own_listener");
    assert_eq!(find("dns", "allowed.test", 0, true)["code"], "allowed");
    assert_eq!(find("dns", "denied.test", 0, false)["code"], "not_allowed");
    assert_eq!(find("tcp", "allowed.test", web, true)["code"], "allowed");
    assert_eq!(find("tcp", "allowed.test", echo, true)["code"], "allowed");
    assert_eq!(
        find("tcp", "127.0.0.1", echo, false)["code"],
        "not_a_resolved_name"
    );
    // Nothing reached the daemon for the unroutable ones.
    assert!(
        !records
            .iter()
            .any(|r| r["host"] == "10.0.0.1" || r["host"] == "8.8.8.8"),
        "{records:#?}"
    );
    // Counted in /metrics.
    let metrics = client_metrics(&daemon).await;
    assert!(
        metrics.contains("executor_network_decisions_total{decision=\"denied\"}"),
        "{metrics}"
    );

    // The next command (handed to the worker built ahead for it) gets its listeners too, in a
    // namespace of its own: one made for a policy is never lent again.
    let mut r = req(
        "again",
        &format!("curl -s -m 10 http://allowed.test:{web}/; readlink /proc/self/ns/net"),
    );
    r.profile = Some("strict-policy".into());
    let again = client.exec(r).await.result.unwrap();
    let mut again_lines = again.output.lines();
    assert_eq!(
        again_lines.next(),
        Some("hello from the allowed web server"),
        "{}",
        again.output
    );
    let ns = line("ns");
    assert_ne!(again_lines.next(), Some(ns.as_str()), "{}", again.output);

    // On the host: none of the command's listeners is left in the daemon, and nothing holds
    // its namespace.
    assert!(ns.starts_with("net:["), "{out}");
    assert!(
        eventually(Duration::from_secs(10), || fd_count(daemon.pid())
            <= fds_before)
        .await,
        "daemon fds: {} before, {} after",
        fds_before,
        fd_count(daemon.pid())
    );
    assert!(
        eventually(Duration::from_secs(10), || holders_of(&ns).is_empty()).await,
        "{:?}",
        holders_of(&ns)
    );
}

/// `GET /metrics` with the daemon's token.
async fn client_metrics(daemon: &Daemon) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(daemon.addr).await.unwrap();
    let request = format!(
        "GET /metrics HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
        daemon.addr, daemon.token
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).await.unwrap();
    body
}

#[tokio::test]
async fn a_task_container_policy_gets_a_network_namespace_of_its_own() {
    if !require("root (network namespaces)", is_root()) {
        return;
    }
    let web = http_server("hello from the allowed web server\n");
    let dir = TempDir::new().unwrap();
    let container = include_str!("../../../sandbox-profiles/task-container.json");
    let mut profile: serde_json::Value = serde_json::from_str(container).unwrap();
    profile["name"] = "container-policy".into();
    profile["network"] = serde_json::json!({
        "mode": "policy",
        "allow": [format!("allowed.test:{web}"), "127.0.0.0/8"],
        "reason": "the test's server on the host's loopback",
    });
    std::fs::write(
        dir.path().join("container-policy.json"),
        profile.to_string(),
    )
    .unwrap();
    let daemon = Daemon::start_with(&[
        "--profiles-dir",
        dir.path().to_str().unwrap(),
        "--allow-profile",
        "container-policy",
        "--egress-resolve",
        "allowed.test=127.0.0.1",
    ]);
    let mut client = daemon.connect().await;
    let host_resolv = std::fs::read_to_string("/etc/resolv.conf").unwrap();
    let script = format!(
        r#"
echo "proxy-allowed: $(curl -s -m 10 http://allowed.test:{web}/)"
echo "proxy-other-name: $(curl -s -o /dev/null -m 10 -w '%{{http_code}}' http://denied.test:{web}/)"
echo "capture-allowed: $(curl -s -m 10 --noproxy '*' http://allowed.test:{web}/)"
echo "route-10: $(curl -s -m 10 --noproxy '*' -o /dev/null -w '%{{http_code}}' http://10.0.0.1:{web}/; echo " rc=$?")"
echo "resolver: $(grep '^nameserver' /etc/resolv.conf)"
echo "interfaces: $(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\n' ' ')"
"#
    );
    let mut r = req("container", &script);
    r.profile = Some("container-policy".into());
    r.timeout = Some(60.0);
    let result = client.exec(r).await.result.unwrap();
    let out = result.output.clone();
    let line = |key: &str| -> String {
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}: ")))
            .unwrap_or_else(|| panic!("no {key} in {out}\n{}", daemon.log()))
            .trim()
            .to_string()
    };
    assert_eq!(line("proxy-allowed"), "hello from the allowed web server");
    assert_eq!(line("proxy-other-name"), "403");
    assert_eq!(line("capture-allowed"), "hello from the allowed web server");
    assert!(line("route-10").ends_with("rc=7"), "{out}");
    assert_eq!(line("resolver"), "nameserver 127.0.0.1");
    // The host's network (the profile's own mode is host) is not there: loopback only (the
    // command's /proc shows its own namespace; the host's /sys, bound read-only, would not).
    assert_eq!(line("interfaces"), "lo", "{out}");
    // The host's file is untouched: the command saw a bind in its own mount namespace.
    assert_eq!(
        std::fs::read_to_string("/etc/resolv.conf").unwrap(),
        host_resolv
    );
    // The layers say so: a network namespace the profile itself does not list.
    assert!(
        result.extra.isolation.layers.iter().any(|l| l == "net_ns"),
        "{:?}",
        result.extra.isolation.layers
    );
    let network = result.extra.isolation.network.expect("isolation.network");
    assert_eq!(network.mode, "policy", "{network:?}");
    let network = network.connections.expect("isolation.network.connections");
    assert!(network.denied >= 1 && network.allowed >= 2, "{network:?}");
}
