//! `--egress`: what a network policy (issue 38, part 6) costs, beside a direct baseline
//! measured in the same run, taking turns with it.
//!
//! A daemon of its own gets a profile `strict-egress` (strict with `"network": {"mode":
//! "policy"}` allowing `bench.test` on the ports of the servers below, and `127.0.0.0/8`:
//! loopback is reached only by a CIDR rule naming it) and `--egress-resolve
//! bench.test=127.0.0.1`. Servers on the host's loopback, run by this process on threads of
//! their own, stand in for the internet. Four figures:
//!
//! 1. Connection set-up: a small Python client (the same one on the host and in the command)
//!    times each connect, request and first byte of the answer, one connection after another:
//!    on the host straight to the server (direct), in the command through the proxy
//!    (127.0.0.1:3128, an absolute-URI GET) and through the capture listener (the name
//!    resolved by the command's resolver to a synthetic address, a plain GET). Rounds of each
//!    take turns.
//! 2. Download throughput: curl fetches `--egress-mb` MB direct on the host, in the command
//!    through the proxy (`-x`), and through capture (`--noproxy '*'`), taking turns.
//! 3. The daemon's RSS (/proc/PID/status) with `--egress-held` tunnels (CONNECT) open through
//!    the proxy to a host server that holds them: a command may have 256 connections open
//!    through its listeners at once (executor/src/enforce/listen.rs), so they are opened by
//!    as many commands as that takes, 250 each; the same commands holding one tunnel each are
//!    measured first, so the per-connection figure leaves out the commands' own cost.
//! 4. `echo hi` round trips under `strict-egress` and under `strict` (network `none`), taking
//!    turns.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::client::{request, Client};
use crate::daemon::{status_kib, Daemon};
use crate::stats::{median, summarize, Summary};

/// The name the policy allows; `--egress-resolve` points it at the host's loopback.
const NAME: &str = "bench.test";
/// The policy profile the daemon is given, and the profile it is compared with.
const POLICY_PROFILE: &str = "strict-egress";
const NONE_PROFILE: &str = "strict";
/// The profile of the direct baseline from a command (the host's network), when available.
const CONTAINER_PROFILE: &str = "task-container";
/// Connections one command opens at most in the RSS phase (the daemon allows 256 at once).
const PER_COMMAND: usize = 250;
/// Longest a phase may take; past it the run fails naming the phase.
const PHASE_DEADLINE: Duration = Duration::from_secs(600);
/// Longest the held connections may take to be all open.
const HOLD_DEADLINE: Duration = Duration::from_secs(50);

/// The client of phases 1 and 3, run by `python3` on the host and in the command alike.
const CLIENT: &str = r#"
import socket, sys, time

def head(s):
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(4096)
        if not chunk:
            raise SystemExit("closed before the end of the response head: %r" % buf[:80])
        buf += chunk
    return buf

mode = sys.argv[1]
if mode == "setup":
    how, host, port, n = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    if how == "proxy":
        addr, target = ("127.0.0.1", 3128), "http://%s:%d/" % (host, port)
    else:
        addr, target = (socket.gethostbyname(host), port), "/"
    req = ("GET %s HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n" % (target, host, port)).encode()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        s = socket.create_connection(addr, timeout=10)
        s.sendall(req)
        first = s.recv(1)
        out.append(round((time.perf_counter() - t) * 1e6))
        if first != b"H":
            raise SystemExit("no HTTP answer from %s: %r" % (target, first))
        s.close()
    print("us", *out)
elif mode == "hold":
    host, port, n = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    held = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
        s.sendall(("CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (host, port, host, port)).encode())
        h = head(s)
        if h.split(b"\r\n")[0].split()[1:2] != [b"200"]:
            raise SystemExit("CONNECT refused: %r" % h[:80])
        held.append(s)
    print("open", len(held), flush=True)
    for s in held:
        s.settimeout(55)
        s.recv(1)
    print("released")
"#;

/// The PATH of the strict profile, so the host runs the same python3 and curl as the command.
const PROFILE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

pub(crate) struct Plan {
    /// Connections timed per way in phase 1, split over `rounds`.
    pub connections: usize,
    pub rounds: usize,
    /// MB (10^6 bytes) downloaded in phase 2, `repeats` times per way.
    pub download_mb: f64,
    pub repeats: usize,
    /// Tunnels held open in phase 3.
    pub held: usize,
    /// `echo hi` pairs in phase 4, back to back and alone.
    pub pairs: usize,
    pub alone_pairs: usize,
}

pub(crate) struct Way {
    pub label: &'static str,
    pub summary: Option<Summary>,
}

pub(crate) struct Download {
    pub label: &'static str,
    pub mb_per_s: Vec<f64>,
}

pub(crate) struct Held {
    pub commands: usize,
    pub held: usize,
    pub rss_before_kib: u64,
    pub rss_one_each_kib: u64,
    pub rss_all_kib: u64,
    pub fds_one_each: usize,
    pub fds_all: usize,
}

pub(crate) struct EgressReport {
    pub setup: Vec<Way>,
    pub downloads: Vec<Download>,
    pub download_mb: f64,
    pub held: Option<Held>,
    /// `echo hi` under the policy and under `none`: back to back, then alone.
    pub echo: Option<(Summary, Summary)>,
    pub echo_alone: Option<(Summary, Summary)>,
    pub failures: Vec<String>,
}

/// Host-side servers on loopback: `web` answers `GET /big` with the download and anything
/// else with a short page; `hold` keeps every connection open until released.
struct Servers {
    web: u16,
    /// A plain relay to `web`: what any user-space relay costs on this machine.
    relay: u16,
    hold: u16,
    held: Arc<Mutex<Vec<TcpStream>>>,
    accepted: Arc<AtomicUsize>,
}

impl Servers {
    fn start(download_bytes: u64) -> anyhow::Result<Self> {
        let web = TcpListener::bind("127.0.0.1:0").context("cannot bind the web server")?;
        let web_port = web.local_addr()?.port();
        std::thread::spawn(move || {
            for stream in web.incoming().flatten() {
                std::thread::spawn(move || serve_web(stream, download_bytes));
            }
        });
        let hold = TcpListener::bind("127.0.0.1:0").context("cannot bind the hold server")?;
        let hold_port = hold.local_addr()?.port();
        let held: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let accepted = Arc::new(AtomicUsize::new(0));
        let (h, a) = (held.clone(), accepted.clone());
        std::thread::spawn(move || {
            for stream in hold.incoming().flatten() {
                if let Ok(mut list) = h.lock() {
                    list.push(stream);
                    a.store(list.len(), Ordering::SeqCst);
                }
            }
        });
        let relay = TcpListener::bind("127.0.0.1:0").context("cannot bind the relay")?;
        let relay_port = relay.local_addr()?.port();
        std::thread::spawn(move || {
            for client in relay.incoming().flatten() {
                std::thread::spawn(move || serve_relay(client, web_port));
            }
        });
        Ok(Self {
            web: web_port,
            relay: relay_port,
            hold: hold_port,
            held,
            accepted,
        })
    }

    /// Close every held connection (the clients see their end and exit).
    fn release(&self) {
        if let Ok(mut list) = self.held.lock() {
            list.clear();
            self.accepted.store(0, Ordering::SeqCst);
        }
    }
}

/// Relay `client` to the web server with a thread and `std::io::copy` each way (read and
/// write through an 8 KiB buffer, as `tokio::io::copy` does).
fn serve_relay(client: TcpStream, web: u16) {
    let Ok(upstream) = TcpStream::connect(("127.0.0.1", web)) else {
        return;
    };
    let _ = (client.set_nodelay(true), upstream.set_nodelay(true));
    let (Ok(mut client_read), Ok(mut up_read)) = (client.try_clone(), upstream.try_clone()) else {
        return;
    };
    let (mut client_write, mut up_write) = (client, upstream);
    let up = std::thread::spawn(move || {
        let _ = std::io::copy(&mut client_read, &mut up_write);
        let _ = up_write.shutdown(std::net::Shutdown::Write);
    });
    let _ = std::io::copy(&mut up_read, &mut client_write);
    let _ = client_write.shutdown(std::net::Shutdown::Write);
    let _ = up.join();
}

fn serve_web(mut stream: TcpStream, download_bytes: u64) {
    let _ = stream.set_nodelay(true);
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 65536 {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let first_line = buf.split(|&b| b == b'\n').next().unwrap_or_default();
    let big = first_line.windows(5).any(|w| w == b"/big ");
    if !big {
        let _ = stream
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n");
        return;
    }
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Length: {download_bytes}\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n\r\n"
    );
    if stream.write_all(head.as_bytes()).is_err() {
        return;
    }
    let block = vec![b'x'; 1 << 20];
    let mut left = download_bytes;
    while left > 0 {
        let n = left.min(block.len() as u64) as usize;
        if stream.write_all(&block[..n]).is_err() {
            return;
        }
        left -= n as u64;
    }
}

/// The policy profile: the shipped strict profile with a policy naming the servers.
fn policy_profile(servers: &Servers) -> anyhow::Result<String> {
    let strict = include_str!("../../sandbox-profiles/strict.json");
    let mut profile: serde_json::Value = serde_json::from_str(strict)?;
    profile["name"] = POLICY_PROFILE.into();
    profile["network"] = serde_json::json!({
        "mode": "policy",
        "allow": [
            format!("{NAME}:{}", servers.web),
            format!("{NAME}:{}", servers.hold),
            "127.0.0.0/8",
        ],
        "reason": "the benchmark's servers on the host's loopback",
    });
    Ok(profile.to_string())
}

/// `python3 - ARGS` with the client on stdin, as a shell command line.
fn client_command(args: &str) -> String {
    format!("python3 - {args} <<'EOF'\n{CLIENT}\nEOF\n")
}

/// Run `command` with bash on the host, with the profile's PATH; its stdout.
async fn on_host(command: &str) -> anyhow::Result<String> {
    let run = tokio::process::Command::new("bash")
        .arg("-c")
        .arg(command)
        .env("PATH", PROFILE_PATH)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(300), run)
        .await
        .context("a host command took more than 300 s")?
        .context("cannot run bash")?;
    if !out.status.success() {
        bail!(
            "on the host: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Run `command` under `profile`; its output, failing unless it exited 0.
async fn in_command(
    client: &mut Client,
    id: String,
    command: &str,
    profile: &str,
) -> anyhow::Result<String> {
    Ok(judged(client, id, command, profile, 0).await?.0)
}

/// Run `command` under `profile`, failing unless it exited 0 and the policy allowed at least
/// `allowed` attempts (so the figures are of connections the daemon relayed); its output and
/// how many attempts the policy allowed.
async fn judged(
    client: &mut Client,
    id: String,
    command: &str,
    profile: &str,
    allowed: u64,
) -> anyhow::Result<(String, u64)> {
    let mut req = request(id.clone(), command, profile);
    req.timeout = Some(300.0);
    let (result, _) = client.run(req).await?;
    if result.returncode != 0 {
        bail!(
            "command {id} under {profile} exited {}: {}",
            result.returncode,
            result.output.trim()
        );
    }
    let network = result
        .extra
        .isolation
        .network
        .as_ref()
        .and_then(|n| n.connections.as_ref());
    let (got, denied) = network.map(|n| (n.allowed, n.denied)).unwrap_or((0, 0));
    if got < allowed || denied > 0 {
        bail!(
            "command {id}: the policy allowed {got} attempts (at least {allowed} expected) and \
             refused {denied}: {network:?}"
        );
    }
    Ok((result.output, got))
}

/// The `us ...` line of the client's output, in durations.
fn timings(output: &str) -> anyhow::Result<Vec<Duration>> {
    let line = output
        .lines()
        .find_map(|l| l.strip_prefix("us "))
        .with_context(|| format!("no timings in the client's output: {}", output.trim()))?;
    line.split_whitespace()
        .map(|t| Ok(Duration::from_micros(t.parse()?)))
        .collect()
}

/// Where one way of phases 1 and 2 runs: its label, the profile of the command (`None`: on
/// the host), the host to name and whether the policy judges it.
struct Route {
    label: &'static str,
    profile: Option<&'static str>,
    host: &'static str,
    /// `proxy` (the client or curl through 127.0.0.1:3128) or `direct` (a plain connection).
    how: &'static str,
    /// To the host's plain relay instead of the web server.
    relay: bool,
}

impl Route {
    fn port(&self, servers: &Servers) -> u16 {
        if self.relay {
            servers.relay
        } else {
            servers.web
        }
    }
}

/// The ways to compare: direct on the host, direct from a command of `task-container` (the
/// host's network) when this host runs it, through the proxy and through capture.
fn routes(container: bool) -> Vec<Route> {
    let mut routes = vec![Route {
        label: "direct (host, no policy)",
        profile: None,
        host: "127.0.0.1",
        how: "direct",
        relay: false,
    }];
    if container {
        routes.push(Route {
            label: "direct (a task-container command, host network)",
            profile: Some(CONTAINER_PROFILE),
            host: "127.0.0.1",
            how: "direct",
            relay: false,
        });
    }
    routes.push(Route {
        label: "reference: the host, through a plain relay (threads, 8 KiB copies)",
        profile: None,
        host: "127.0.0.1",
        how: "direct",
        relay: true,
    });
    routes.push(Route {
        label: "policy: through the proxy (127.0.0.1:3128)",
        profile: Some(POLICY_PROFILE),
        host: NAME,
        how: "proxy",
        relay: false,
    });
    routes.push(Route {
        label: "policy: through capture (synthetic address)",
        profile: Some(POLICY_PROFILE),
        host: NAME,
        how: "capture",
        relay: false,
    });
    routes
}

/// `command` where `route` runs; under the policy, at least `allowed` attempts allowed.
async fn run_on(
    client: &mut Client,
    route: &Route,
    id: String,
    command: &str,
    allowed: u64,
) -> anyhow::Result<String> {
    match route.profile {
        None => on_host(command).await,
        Some(POLICY_PROFILE) => Ok(judged(client, id, command, POLICY_PROFILE, allowed)
            .await?
            .0),
        Some(profile) => in_command(client, id, command, profile).await,
    }
}

async fn setup_phase(
    client: &mut Client,
    servers: &Servers,
    plan: &Plan,
    routes: &[Route],
) -> anyhow::Result<Vec<Way>> {
    let per_round = (plan.connections / plan.rounds.max(1)).max(1);
    let mut samples: Vec<Vec<Duration>> = routes.iter().map(|_| Vec::new()).collect();
    // Round 0 is a warm-up (python's imports in the page cache, the daemon's first policy).
    for round in 0..=plan.rounds {
        let n = if round == 0 { 20 } else { per_round };
        eprintln!("bench: egress set-up round {round}/{}", plan.rounds);
        for (k, route) in routes.iter().enumerate() {
            let command = client_command(&format!(
                "setup {} {} {} {n}",
                route.how,
                route.host,
                route.port(servers)
            ));
            let id = format!("setup-{}-{round}", route.how);
            let got = timings(&run_on(client, route, id, &command, n as u64).await?)?;
            if round > 0 {
                samples[k].extend(got);
            }
        }
    }
    Ok(routes
        .iter()
        .zip(samples)
        .map(|(route, samples)| Way {
            label: route.label,
            summary: summarize(&samples),
        })
        .collect())
}

/// MB/s from curl's `-w '%{http_code} %{size_download} %{time_total}'`.
fn curl_rate(output: &str, bytes: u64) -> anyhow::Result<f64> {
    let line = output
        .lines()
        .rev()
        .find(|l| l.starts_with("200 "))
        .with_context(|| format!("curl did not get a 200: {}", output.trim()))?;
    let mut fields = line.split_whitespace().skip(1);
    let size: f64 = fields.next().context("size")?.parse()?;
    let seconds: f64 = fields.next().context("time")?.parse()?;
    if size as u64 != bytes {
        bail!("curl got {size} bytes of {bytes}");
    }
    Ok(size / seconds.max(1e-9) / 1e6)
}

async fn download_phase(
    client: &mut Client,
    servers: &Servers,
    plan: &Plan,
    bytes: u64,
    routes: &[Route],
) -> anyhow::Result<Vec<Download>> {
    let curl = "curl -sS -o /dev/null -m 240 -w '%{http_code} %{size_download} %{time_total}\\n'";
    let mut out: Vec<Download> = routes
        .iter()
        .map(|r| Download {
            label: r.label,
            mb_per_s: Vec::new(),
        })
        .collect();
    for r in 0..plan.repeats {
        eprintln!("bench: egress download {}/{}", r + 1, plan.repeats);
        for (k, route) in routes.iter().enumerate() {
            let via = if route.how == "proxy" {
                "-x http://127.0.0.1:3128"
            } else {
                "--noproxy '*'"
            };
            let command = format!(
                "{curl} {via} http://{}:{}/big",
                route.host,
                route.port(servers)
            );
            let id = format!("download-{}-{r}", route.how);
            out[k].mb_per_s.push(curl_rate(
                &run_on(client, route, id, &command, 1).await?,
                bytes,
            )?);
        }
    }
    Ok(out)
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// `commands` commands each holding `each` tunnels; the daemon's RSS and descriptors once
/// all are open, then released.
async fn hold_round(
    daemon: &Daemon,
    servers: &Servers,
    commands: usize,
    each: usize,
    tag: &str,
) -> anyhow::Result<(u64, usize)> {
    let want = commands * each;
    let mut clients = Vec::new();
    for _ in 0..commands {
        clients.push(Client::connect(&daemon.url, &daemon.token).await?.0);
    }
    let command = client_command(&format!("hold {NAME} {} {each}", servers.hold));
    // No count of allowed attempts is asked of these: a tunnel is tallied when it closes, and
    // those closing as the command ends may be tallied after its result is made (246 of 250
    // were, once). The client's "open N" (each CONNECT answered 200) and the holding server's
    // count say they were relayed.
    let runs = clients
        .iter_mut()
        .enumerate()
        .map(|(i, c)| judged(c, format!("hold-{tag}-{i}"), &command, POLICY_PROFILE, 0));
    let all = futures_util::future::join_all(runs);
    let watch = async {
        let started = Instant::now();
        loop {
            let open = servers.accepted.load(Ordering::SeqCst);
            if open >= want {
                break;
            }
            if started.elapsed() > HOLD_DEADLINE {
                servers.release();
                bail!("only {open} of {want} held connections open after {HOLD_DEADLINE:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The daemon's last accepts and buffers settle.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let rss = status_kib(daemon.pid, "VmRSS").unwrap_or(0);
        let fds = fd_count(daemon.pid);
        servers.release();
        anyhow::Ok((rss, fds))
    };
    let (results, measured) = tokio::join!(all, watch);
    for c in clients {
        c.close().await;
    }
    let measured = measured?;
    for r in results {
        let (out, _) = r?;
        if !out.contains(&format!("open {each}")) || !out.contains("released") {
            bail!("a holding command said: {}", out.trim());
        }
    }
    Ok(measured)
}

async fn held_phase(daemon: &Daemon, servers: &Servers, plan: &Plan) -> anyhow::Result<Held> {
    let commands = plan.held.div_ceil(PER_COMMAND).max(1);
    let each = plan.held.div_ceil(commands);
    crate::settle().await;
    let rss_before_kib = status_kib(daemon.pid, "VmRSS").unwrap_or(0);
    eprintln!("bench: egress: {commands} commands holding 1 tunnel each");
    let (rss_one_each_kib, fds_one_each) = hold_round(daemon, servers, commands, 1, "one").await?;
    crate::settle().await;
    eprintln!("bench: egress: {commands} commands holding {each} tunnels each");
    let (rss_all_kib, fds_all) = hold_round(daemon, servers, commands, each, "all").await?;
    Ok(Held {
        commands,
        held: commands * each,
        rss_before_kib,
        rss_one_each_kib,
        rss_all_kib,
        fds_one_each,
        fds_all,
    })
}

/// `pairs` round trips of `echo hi` under each profile, taking turns; with `alone`, each after
/// [`crate::ALONE_AFTER`] of idleness (the daemon's warm worker for the next command built).
async fn echo_phase(
    client: &mut Client,
    pairs: usize,
    alone: bool,
) -> anyhow::Result<(Summary, Summary)> {
    let mut policy = Vec::new();
    let mut none = Vec::new();
    let warmups = if alone { 2 } else { crate::warmups(pairs) };
    let what = if alone { "alone" } else { "back to back" };
    let mut progress =
        crate::Progress::new(format!("egress echo pairs, {what}"), Some(pairs + warmups));
    for i in 0..pairs + warmups {
        // Each pair in the other order than the last, so neither always goes first.
        let order = if i % 2 == 0 {
            [POLICY_PROFILE, NONE_PROFILE]
        } else {
            [NONE_PROFILE, POLICY_PROFILE]
        };
        for profile in order {
            if alone {
                tokio::time::sleep(crate::ALONE_AFTER).await;
            }
            let began = Instant::now();
            let out =
                in_command(client, format!("echo-{profile}-{i}"), crate::ECHO, profile).await?;
            let took = began.elapsed();
            if out != crate::ECHO_OUTPUT {
                bail!("echo hi under {profile} printed {out:?}");
            }
            if i >= warmups {
                if profile == POLICY_PROFILE {
                    policy.push(took);
                } else {
                    none.push(took);
                }
            }
        }
        progress.tick(i + 1);
    }
    Ok((
        summarize(&policy).context("no policy samples")?,
        summarize(&none).context("no none samples")?,
    ))
}

/// Runs `phase` under PHASE_DEADLINE; a failure is recorded under `name`, not fatal.
async fn bounded<T>(
    name: &str,
    failures: &mut Vec<String>,
    phase: impl std::future::Future<Output = anyhow::Result<T>>,
) -> Option<T> {
    match tokio::time::timeout(PHASE_DEADLINE, phase).await {
        Ok(Ok(v)) => Some(v),
        Ok(Err(err)) => {
            eprintln!("bench: egress {name} FAILED: {err:#}");
            failures.push(format!("{name}: {err:#}"));
            None
        }
        Err(_) => {
            eprintln!("bench: egress {name} FAILED: took more than {PHASE_DEADLINE:?}");
            failures.push(format!("{name}: took more than {PHASE_DEADLINE:?}"));
            None
        }
    }
}

pub(crate) async fn run(executor: &std::path::Path, plan: &Plan) -> anyhow::Result<EgressReport> {
    let bytes = (plan.download_mb * 1e6).round() as u64;
    let servers = Servers::start(bytes)?;
    let dir = tempfile::tempdir().context("a directory for the benchmark's profile")?;
    std::fs::write(
        dir.path().join(format!("{POLICY_PROFILE}.json")),
        policy_profile(&servers)?,
    )?;
    let extra: Vec<String> = [
        "--profiles-dir",
        &dir.path().display().to_string(),
        "--allow-profile",
        POLICY_PROFILE,
        "--allow-profile",
        NONE_PROFILE,
        "--allow-profile",
        CONTAINER_PROFILE,
        "--egress-resolve",
        &format!("{NAME}=127.0.0.1"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let daemon = Daemon::start(executor, &extra)?;
    let (mut client, hello) = Client::connect(&daemon.url, &daemon.token).await?;
    for name in [POLICY_PROFILE, NONE_PROFILE] {
        match hello.profiles.iter().find(|p| p.name == name) {
            Some(p) if p.available => {}
            Some(p) => bail!(
                "profile {name} is unavailable on this host: {}",
                p.unavailable_reason.clone().unwrap_or_default()
            ),
            None => bail!("the daemon does not offer profile {name}"),
        }
    }
    let container = hello
        .profiles
        .iter()
        .any(|p| p.name == CONTAINER_PROFILE && p.available);
    if !container {
        eprintln!(
            "bench: egress: {CONTAINER_PROFILE} is unavailable here; no direct baseline from a \
             command (the host's one only)"
        );
    }
    let routes = routes(container);
    // A first command under the policy: its answer says whether the proxy works at all.
    let probe = in_command(
        &mut client,
        "probe".into(),
        &format!(
            "curl -sS -m 10 -x http://127.0.0.1:3128 http://{NAME}:{}/",
            servers.web
        ),
        POLICY_PROFILE,
    )
    .await
    .context("the probe through the proxy failed")?;
    if probe.trim() != "ok" {
        bail!("the probe through the proxy got {probe:?}");
    }
    eprintln!("bench: egress daemon pid {} at {}", daemon.pid, daemon.url);

    let mut failures = Vec::new();
    let setup = bounded(
        "set-up",
        &mut failures,
        setup_phase(&mut client, &servers, plan, &routes),
    )
    .await
    .unwrap_or_default();
    let downloads = bounded(
        "download",
        &mut failures,
        download_phase(&mut client, &servers, plan, bytes, &routes),
    )
    .await
    .unwrap_or_default();
    let held = if plan.held > 0 {
        bounded(
            "held connections",
            &mut failures,
            held_phase(&daemon, &servers, plan),
        )
        .await
    } else {
        None
    };
    let echo = bounded(
        "echo",
        &mut failures,
        echo_phase(&mut client, plan.pairs, false),
    )
    .await;
    let echo_alone = if plan.alone_pairs > 0 {
        bounded(
            "echo alone",
            &mut failures,
            echo_phase(&mut client, plan.alone_pairs, true),
        )
        .await
    } else {
        None
    };
    client.close().await;
    daemon.stop()?;
    Ok(EgressReport {
        setup,
        downloads,
        download_mb: plan.download_mb,
        held,
        echo,
        echo_alone,
        failures,
    })
}

fn ms(s: &Option<Summary>, f: impl Fn(&Summary) -> f64) -> String {
    s.as_ref()
        .map(|s| format!("{:.3}", f(s)))
        .unwrap_or_else(|| "-".into())
}

pub(crate) fn markdown(r: &EgressReport) -> String {
    let mut out = String::new();
    let direct = r.setup.first().and_then(|w| w.summary.clone());
    out.push_str(
        "Connection set-up (connect, request, first byte of the answer; one connection after another)\n\n\
         | way | connections | p50 ms | p99 ms | p50 over direct | p99 over direct |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    for w in &r.setup {
        let over = |f: fn(&Summary) -> f64| match (&w.summary, &direct) {
            (Some(s), Some(d)) if w.label != r.setup[0].label => {
                format!("{:+.3} ms", f(s) - f(d))
            }
            _ => "-".into(),
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            w.label,
            w.summary.as_ref().map(|s| s.count).unwrap_or(0),
            ms(&w.summary, |s| s.p50_ms),
            ms(&w.summary, |s| s.p99_ms),
            over(|s| s.p50_ms),
            over(|s| s.p99_ms),
        ));
    }
    out.push_str(&format!(
        "\nDownload of {} MB (curl's size / time_total; median of the runs, taking turns)\n\n\
         | way | runs MB/s | median MB/s | of direct |\n|---|---|---:|---:|\n",
        r.download_mb
    ));
    let direct_rate = r.downloads.first().and_then(|d| median(&d.mb_per_s));
    for d in &r.downloads {
        let m = median(&d.mb_per_s);
        let runs: Vec<String> = d.mb_per_s.iter().map(|v| format!("{v:.0}")).collect();
        out.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            d.label,
            runs.join(", "),
            m.map(|m| format!("{m:.0}")).unwrap_or_else(|| "-".into()),
            match (m, direct_rate) {
                (Some(m), Some(d)) => format!("{:.0}%", 100.0 * m / d),
                _ => "-".into(),
            }
        ));
    }
    if let Some(h) = &r.held {
        let per_conn = (h.rss_all_kib as f64 - h.rss_one_each_kib as f64) * 1024.0
            / (h.held.saturating_sub(h.commands)).max(1) as f64;
        out.push_str(&format!(
            "\nDaemon memory with {} tunnels (CONNECT) held open through the proxy by {} command(s)\n\n\
             | figure | value |\n|---|---|\n\
             | daemon RSS before | {:.1} MiB |\n\
             | {} command(s) holding 1 tunnel each | {:.1} MiB, {} descriptors |\n\
             | {} command(s) holding {} tunnels | {:.1} MiB, {} descriptors |\n\
             | per held tunnel (the difference over {} tunnels) | {:.1} KiB |\n",
            h.held,
            h.commands,
            h.rss_before_kib as f64 / 1024.0,
            h.commands,
            h.rss_one_each_kib as f64 / 1024.0,
            h.fds_one_each,
            h.commands,
            h.held,
            h.rss_all_kib as f64 / 1024.0,
            h.fds_all,
            h.held.saturating_sub(h.commands),
            per_conn / 1024.0,
        ));
    }
    if r.echo.is_some() || r.echo_alone.is_some() {
        out.push_str(&format!(
            "\n`echo hi` round trips under {POLICY_PROFILE} (strict with a network policy) and \
             {NONE_PROFILE} (network none), taking turns\n\n\
             | run | pairs | none p50 ms | policy p50 ms | policy over none (p50) | none p99 ms | policy p99 ms |\n\
             |---|---:|---:|---:|---:|---:|---:|\n"
        ));
        for (label, got) in [
            ("back to back", &r.echo),
            ("alone (100 ms idle before each)", &r.echo_alone),
        ] {
            if let Some((p, n)) = got {
                out.push_str(&format!(
                    "| {label} | {} | {:.3} | {:.3} | {:+.1}% | {:.3} | {:.3} |\n",
                    p.count,
                    n.p50_ms,
                    p.p50_ms,
                    100.0 * (p.p50_ms / n.p50_ms - 1.0),
                    n.p99_ms,
                    p.p99_ms
                ));
            }
        }
    }
    for f in &r.failures {
        out.push_str(&format!("\nFAILED {f}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_read_the_clients_microseconds() {
        let got = timings("noise\nus 120 85 3000\n").unwrap();
        assert_eq!(
            got,
            vec![
                Duration::from_micros(120),
                Duration::from_micros(85),
                Duration::from_micros(3000)
            ]
        );
        assert!(timings("Traceback ...").is_err());
    }

    #[test]
    fn curl_rate_is_megabytes_per_second_and_checks_the_size() {
        let rate = curl_rate("200 200000000 0.5\n", 200_000_000).unwrap();
        assert!((rate - 400.0).abs() < 1e-9);
        assert!(curl_rate("200 1000 0.5\n", 200_000_000).is_err());
        assert!(curl_rate("403 0 0.01\n", 200_000_000).is_err());
    }

    #[test]
    fn the_host_direct_way_comes_first_and_the_container_only_when_available() {
        let with = routes(true);
        let without = routes(false);
        assert_eq!(with[0].profile, None);
        assert!(!with[0].relay);
        assert_eq!(with.len(), without.len() + 1);
        assert!(with.iter().any(|r| r.profile == Some(CONTAINER_PROFILE)));
        assert!(!without.iter().any(|r| r.profile == Some(CONTAINER_PROFILE)));
        assert_eq!(
            without
                .iter()
                .filter(|r| r.profile == Some(POLICY_PROFILE))
                .map(|r| r.how)
                .collect::<Vec<_>>(),
            ["proxy", "capture"]
        );
    }
}
