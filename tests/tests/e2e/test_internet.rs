//! The test internet (`executor_tests::test_internet`) from the host, without the daemon: each
//! server answers the real client it is for, and nothing of it is left after drop. The
//! network-policy tests rely on both.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use executor_tests::test_internet::{self, TestInternet, BYTES_PATH};
use executor_tests::{is_root, require, TempDir, PATIENCE, PROMPTLY};

fn started() -> Option<TestInternet> {
    if !require("root (a network namespace and a veth)", is_root()) {
        return None;
    }
    let net = TestInternet::start();
    eprintln!("test internet started in {:?}", net.started_in);
    Some(net)
}

fn succeeded(what: &str, out: &Output) -> String {
    assert!(
        out.status.success(),
        "{what}: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn pip_installs_the_package_from_the_test_index() {
    let Some(net) = started() else { return };
    let target = TempDir::new().unwrap();
    let out = net
        .host_command("/usr/bin/python3")
        .args(["-m", "pip", "install", "--isolated", "--no-cache-dir"])
        .args([
            "--disable-pip-version-check",
            "--index-url",
            &net.index_url(),
        ])
        .args(["--trusted-host", net.pypi().name, "--target"])
        .arg(target.path())
        .arg(test_internet::PACKAGE)
        .output()
        .unwrap();
    succeeded("pip install from the test index", &out);
    let out = Command::new("/usr/bin/python3")
        .args([
            "-c",
            &format!(
                "import {0}; print({0}.GREETING)",
                test_internet::PACKAGE_MODULE
            ),
        ])
        .env("PYTHONPATH", target.path())
        .output()
        .unwrap();
    let greeting = succeeded("importing the installed package", &out);
    assert_eq!(greeting.trim(), test_internet::PACKAGE_GREETING);
    // Plain curl by address reads the same index (no name, no proxy: the route of the veth).
    let pypi = net.pypi();
    for url in [
        format!("http://{}/simple/", pypi.v4),
        format!("http://[{}]/simple/", pypi.v6),
    ] {
        let out = Command::new("curl")
            .args(["--silent", "--show-error", "--max-time", "20", &url])
            .output()
            .unwrap();
        let page = succeeded(&url, &out);
        assert!(page.contains(test_internet::PACKAGE), "{url}: {page}");
    }
    assert!(
        net.log("pypi").contains("GET /simple/testnet-hello/"),
        "pip did not ask the index: {}",
        net.log("pypi")
    );
}

#[test]
fn git_clones_the_repository_over_http() {
    let Some(net) = started() else { return };
    let work = TempDir::new().unwrap();
    let clone = work.path().join("clone");
    let out = net
        .host_command("git")
        .args(["clone", "--quiet", &net.repo_url()])
        .arg(&clone)
        .output()
        .unwrap();
    succeeded("git clone from the test internet", &out);
    let content = std::fs::read_to_string(clone.join(test_internet::GIT_FILE)).unwrap();
    assert_eq!(content, test_internet::GIT_CONTENT);
}

fn curl_tls(net: &TestInternet, ca: Option<&Path>, url: &str) -> Output {
    let mut curl = Command::new("curl");
    curl.args(["--silent", "--show-error", "--max-time", "20"])
        .args(net.curl_resolve_args());
    if let Some(ca) = ca {
        curl.arg("--cacert").arg(ca);
    }
    curl.arg(url).output().unwrap()
}

#[test]
fn curl_trusts_the_https_server_through_the_test_ca_only() {
    let Some(net) = started() else { return };
    let body = succeeded(
        "curl with the test CA",
        &curl_tls(&net, Some(&net.ca_pem()), &net.tls_url()),
    );
    assert_eq!(body, test_internet::TLS_BODY);
    // By address too, IPv4 and IPv6: the certificate names both.
    let tls = net.tls();
    for url in [
        format!("https://{}/", tls.v4),
        format!("https://[{}]/", tls.v6),
    ] {
        let body = succeeded(&url, &curl_tls(&net, Some(&net.ca_pem()), &url));
        assert_eq!(body, test_internet::TLS_BODY, "{url}");
    }
    // /bytes/N streams N bytes, over HTTPS and plain HTTP.
    let bytes = 3_000_000;
    for url in [
        format!("https://{}{BYTES_PATH}{bytes}", net.tls().name),
        format!("http://{}{BYTES_PATH}{bytes}", net.git().v4),
    ] {
        let out = curl_tls(&net, Some(&net.ca_pem()), &url);
        succeeded(&url, &out);
        assert_eq!(out.stdout.len(), bytes, "{url}");
        assert!(out.stdout.iter().all(|&b| b == 0), "{url}");
    }
    // Without the CA, the same request is refused: the certificate is the test CA's, no other.
    let out = curl_tls(&net, None, &net.tls_url());
    assert!(
        !out.status.success(),
        "curl trusted the test server without its CA: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn tcp_and_udp_echo_answer_on_both_families_and_ports() {
    let Some(net) = started() else { return };
    let echo = net.echo();
    let ports = [test_internet::ECHO_PORT, test_internet::ECHO_OTHER_PORT];
    for (ip, port) in [IpAddr::V4(echo.v4), IpAddr::V6(echo.v6)]
        .into_iter()
        .flat_map(|ip| ports.map(|port| (ip, port)))
    {
        let addr = SocketAddr::new(ip, port);
        let mut tcp = TcpStream::connect_timeout(&addr, PATIENCE).unwrap();
        tcp.set_read_timeout(Some(PATIENCE)).unwrap();
        tcp.write_all(b"over tcp\n").unwrap();
        tcp.shutdown(std::net::Shutdown::Write).unwrap();
        let mut back = String::new();
        tcp.read_to_string(&mut back).unwrap();
        assert_eq!(back, "over tcp\n", "TCP echo at {addr}");

        let bind: SocketAddr = if ip.is_ipv4() {
            "0.0.0.0:0".parse().unwrap()
        } else {
            "[::]:0".parse().unwrap()
        };
        let udp = UdpSocket::bind(bind).unwrap();
        udp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        udp.send_to(b"over udp", addr).unwrap();
        let mut buf = [0u8; 64];
        let (n, from) = udp.recv_from(&mut buf).unwrap();
        assert_eq!(
            (&buf[..n], from),
            (&b"over udp"[..], addr),
            "UDP echo at {addr}"
        );
    }
}

#[test]
fn the_dns_server_answers_the_test_names_and_no_other() {
    let Some(net) = started() else { return };
    let dns = net.dns();
    let timeout = Duration::from_secs(5);
    for server in [IpAddr::V4(dns.v4), IpAddr::V6(dns.v6)] {
        let server = SocketAddr::new(server, test_internet::DNS_PORT);
        for site in net.sites() {
            let a = test_internet::dns_query(server, site.name, false, timeout).unwrap();
            assert_eq!(
                a,
                Some(vec![IpAddr::V4(site.v4)]),
                "A {} from {server}",
                site.name
            );
            let aaaa = test_internet::dns_query(server, site.name, true, timeout).unwrap();
            assert_eq!(
                aaaa,
                Some(vec![IpAddr::V6(site.v6)]),
                "AAAA {} from {server}",
                site.name
            );
        }
        let other = test_internet::dns_query(server, "example.org", false, timeout).unwrap();
        assert_eq!(
            other, None,
            "a name that is not the test internet's is NXDOMAIN"
        );
    }
}

/// Inode of a namespace file, the namespace's identity.
fn inode(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| m.ino())
}

fn ip_link() -> String {
    let out = Command::new("ip").args(["-o", "link"]).output().unwrap();
    String::from_utf8(out.stdout).unwrap()
}

/// What is left of a test internet whose host link, processes and namespace (by inode) were
/// these: one line each, none when everything is gone.
fn leftovers(link: &str, pids: &[u32], netns: u64) -> Vec<String> {
    let mut left = Vec::new();
    if ip_link().contains(&format!(" {link}@")) {
        left.push(format!("the link {link}"));
    }
    for pid in pids {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        if cmdline.contains("servers.py") || cmdline.contains("_ignored") {
            left.push(format!("process {pid}: {cmdline}"));
        }
    }
    for entry in std::fs::read_dir("/proc").unwrap().filter_map(|e| e.ok()) {
        if inode(&entry.path().join("ns/net")) == Some(netns) {
            left.push(format!("process {:?} in the namespace", entry.file_name()));
        }
    }
    // Nothing is ever named in /run/netns (no `ip netns add`).
    for entry in std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
    {
        if inode(&entry.path()) == Some(netns) {
            left.push(format!("/run/netns/{:?}", entry.file_name()));
        }
    }
    left
}

/// The namespace's inode, checked to be a namespace of its own, and that the servers answer
/// (so that the checks after the end are not vacuous).
fn running(net: &TestInternet) -> u64 {
    let netns = inode(&net.netns()).expect("the namespace exists while it runs");
    assert_ne!(
        Some(netns),
        inode(Path::new("/proc/self/ns/net")),
        "a namespace of its own"
    );
    assert_eq!(net.pids().len(), 6, "the holder and five servers");
    assert!(
        ip_link().contains(&format!(" {}@", net.link_name())),
        "{} exists while it runs",
        net.link_name()
    );
    let echo = SocketAddr::new(IpAddr::V4(net.echo().v4), test_internet::ECHO_PORT);
    TcpStream::connect_timeout(&echo, PATIENCE).unwrap();
    netns
}

#[test]
fn dropping_it_leaves_no_namespace_link_or_process() {
    let Some(net) = started() else { return };
    let netns = running(&net);
    let (link, pids) = (net.link_name().to_owned(), net.pids());

    drop(net);

    let left = leftovers(&link, &pids, netns);
    assert!(left.is_empty(), "left after drop: {left:?}");
}

/// Set in the copy of this test binary that `a_killed_test_process_leaves_nothing` starts and
/// kills.
const KILLED_CHILD_ENV: &str = "EXECUTOR_TESTS_INTERNET_KILLED_CHILD";

#[test]
fn a_killed_test_process_leaves_nothing() {
    const NAME: &str = "test_internet::a_killed_test_process_leaves_nothing";
    if std::env::var_os(KILLED_CHILD_ENV).is_some() {
        // The child: start one, say what it is, and wait to be killed (never dropping it).
        let net = TestInternet::start();
        let netns = running(&net);
        println!("holding {} {netns} {:?}", net.link_name(), net.pids());
        std::thread::sleep(PATIENCE);
        panic!("not killed within {PATIENCE:?}");
    }
    if !require("root (a network namespace and a veth)", is_root()) {
        return;
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env(KILLED_CHILD_ENV, "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let holding = std::io::BufRead::lines(stdout)
        .map(Result::unwrap)
        .find_map(|line| line.split_once("holding ").map(|(_, rest)| rest.to_owned()));
    child.kill().unwrap(); // SIGKILL: no unwinding, no Drop
    child.wait().unwrap();
    let holding = holding.expect("the child started a test internet");
    let (link, rest) = holding.split_once(' ').unwrap();
    let (netns, pids) = rest.split_once(' ').unwrap();
    let netns: u64 = netns.parse().unwrap();
    let pids: Vec<u32> = pids
        .trim_matches(['[', ']'])
        .split(", ")
        .map(|p| p.parse().unwrap())
        .collect();
    // The children see their standard input end with the killed process, and exit; the kernel
    // then frees the namespace and its veth, asynchronously: allow it a moment.
    let began = std::time::Instant::now();
    let mut left = leftovers(link, &pids, netns);
    while !left.is_empty() && began.elapsed() < PROMPTLY {
        std::thread::sleep(Duration::from_millis(20));
        left = leftovers(link, &pids, netns);
    }
    assert!(left.is_empty(), "left {PROMPTLY:?} after SIGKILL: {left:?}");
    eprintln!("all gone {:?} after SIGKILL", began.elapsed());
}

#[test]
fn several_start_at_once_each_with_its_own_addresses() {
    if !require("root (a network namespace and a veth)", is_root()) {
        return;
    }
    let nets: Vec<TestInternet> = std::thread::scope(|s| {
        let starting: Vec<_> = (0..4).map(|_| s.spawn(TestInternet::start)).collect();
        starting.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for net in &nets {
        eprintln!("{} started in {:?}", net.link_name(), net.started_in);
    }
    let mut links: Vec<_> = nets.iter().map(|n| n.link_name().to_owned()).collect();
    links.sort();
    links.dedup();
    assert_eq!(links.len(), nets.len(), "each its own veth: {links:?}");
    let mut addrs: Vec<_> = nets.iter().map(|n| n.echo().v4).collect();
    addrs.sort();
    addrs.dedup();
    assert_eq!(addrs.len(), nets.len(), "each its own subnet: {addrs:?}");
    // Each answers at its own address.
    for net in &nets {
        let body = succeeded(
            net.link_name(),
            &curl_tls(net, Some(&net.ca_pem()), &net.tls_url()),
        );
        assert_eq!(body, test_internet::TLS_BODY);
    }
}
