//! A test internet (issue 38, part 5): real servers in a network namespace of their own,
//! reachable from the host's namespace by a veth pair and from nowhere else, so that the
//! network-policy tests talk to "the internet" without a packet leaving the machine.
//!
//! ```text
//!  host namespace                         | the test internet's namespace (held by `sh`)
//!  tnetN  203.0.113.16N+1/28              | eth0  .16N+2 pypi   HTTP :80   (PEP 503 index)
//!         2001:db8:7e57:N::1/64           |       .16N+3 git    HTTP :80   (dumb protocol)
//!                                         |       .16N+4 tls    HTTPS :443 (test CA)
//!                                         |       .16N+5 echo   TCP+UDP :7, :7007
//!                                         |       .16N+6 dns    UDP :53    (the test names)
//!                                         |       and 2001:db8:7e57:N::2..6 the same
//! ```
//!
//! The addresses are from the documentation ranges (RFC 5737: 203.0.113.0/24 for slots 0-15,
//! 198.51.100.0/24 for slots 16-31; RFC 3849: 2001:db8::/32). A policy that refuses loopback,
//! private and link-local addresses has no special case for them, so the daemon treats them as
//! the public internet; and nothing routes off the machine: the host's route to them is the
//! veth's (more specific than any default route), and the namespace has no route out at all.
//!
//! **One instance per caller, a slot each.** Every [`TestInternet::start`] gets a namespace,
//! a veth and a /28 of its own (its "slot"), rather than one instance shared per test binary:
//! a shared one would live in a static, which Rust never drops, so the clean-up the leftover
//! checks demand would have to happen behind the test's back; and a test that wants a server
//! to misbehave can have one to itself. Several tests of one binary, and several test binaries
//! at once, each start their own: the slot is taken atomically by creating the host side of
//! the veth, `tnet<slot>`, whose name the kernel refuses to give twice, so two starters never
//! share a subnet (the search starts at the pid plus a counter, to rarely meet). 32 slots.
//! Starting takes about 0.2 s (measured on 2 cores at a load of 3; 2 s for four started at
//! once): the servers start in parallel, each a `python3` that makes what it serves (`git` a
//! repository, `openssl` a CA and a certificate, `zipfile` a wheel) before it binds.
//!
//! **Nothing is left on the host.** The namespace is held by a child (`unshare --net sh`, not
//! `ip netns add`, which would leave a file in /run/netns); the servers run in it through
//! `nsenter --net`. Each child reads its standard input, whose write end only this process
//! holds, and exits at end of file: so when the test process ends, however it ends (a panic,
//! SIGKILL), the children end too, the namespace goes with its last process, and the veth with
//! the namespace (the host end of a veth is removed with its peer). [`Drop`] kills them at
//! once and waits until the host end of the veth is gone, so the slot is free again on return.
//! (Not `PR_SET_PDEATHSIG`: it fires when the spawning *thread* ends, and a test's thread is
//! not the process; nor `unshare --kill-child`, which covers unshare's child, not unshare.)
//!
//! Names: [`TestInternet::names`] gives the NAME=ADDR pairs for the daemon's resolver
//! override; [`TestInternet::curl_resolve_args`] the same for curl; and
//! [`TestInternet::host_command`] runs a host program (pip, git) that resolves them, through
//! a hosts file bind-mounted over /etc/hosts in a mount namespace of its own.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::TempDir;

/// The servers' program: one role per process (see its docstring).
const SERVERS_PY: &str = include_str!("servers.py");

/// The interpreter the servers run on: the host's, which `tests/setup` installs.
const PYTHON: &str = "/usr/bin/python3";

/// The project the index serves (PEP 503 normalized), its module, and what the module says.
pub const PACKAGE: &str = "testnet-hello";
pub const PACKAGE_MODULE: &str = "testnet_hello";
pub const PACKAGE_GREETING: &str = "hello from the test internet";
/// The one file of the git repository's one commit, and its content.
pub const GIT_FILE: &str = "README";
pub const GIT_CONTENT: &str = "hello from the test internet's git server\n";
/// What the HTTPS server answers to any GET.
pub const TLS_BODY: &str = "hello over TLS from the test internet\n";
/// The echo server's port, TCP and UDP (RFC 862); it echoes on [`ECHO_OTHER_PORT`] too, for
/// a port-scoped rule's denial beside its allowed control.
pub const ECHO_PORT: u16 = 7;
pub const ECHO_OTHER_PORT: u16 = 7007;
/// Every HTTP and HTTPS server answers `GET /bytes/N` with N zero bytes, streamed (for
/// throughput measurements): this path, N appended.
pub const BYTES_PATH: &str = "/bytes/";
/// The DNS server's port (UDP).
pub const DNS_PORT: u16 = 53;

/// How many test internets can exist on the machine at once.
const SLOTS: u32 = 32;
/// How long starting may take at most, on a busy machine (a hung server fails the start
/// instead of hanging the test).
const STARTING: Duration = crate::PATIENCE;
/// How long the host end of the veth may take to go once the namespace's processes are gone
/// (the kernel frees a namespace asynchronously, in a work queue).
const LINK_GONE: Duration = Duration::from_secs(10);

/// One server: its name, and its own IPv4 and IPv6 address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Site {
    /// Its role in the servers' program: `pypi`, `git`, `tls`, `echo` or `dns`.
    pub role: &'static str,
    pub name: &'static str,
    pub v4: Ipv4Addr,
    pub v6: Ipv6Addr,
}

/// The servers, in the order of their addresses in the slot (the host side has `.1`).
const ROLES: [(&str, &str); 5] = [
    ("pypi", "pypi.test.example"),
    ("git", "git.test.example"),
    ("tls", "tls.test.example"),
    ("echo", "echo.test.example"),
    ("dns", "dns.test.example"),
];

/// A running test internet; everything of it ends on drop.
pub struct TestInternet {
    /// `unshare --net sh`, which holds the namespace.
    holder: Child,
    /// The servers, by role.
    servers: Vec<(&'static str, Child)>,
    /// The host end of the veth, once created.
    link: Option<String>,
    slot: u32,
    sites: Vec<Site>,
    dir: TempDir,
    /// How long [`TestInternet::start`] took.
    pub started_in: Duration,
}

/// The IPv4 address `host` (1 to 14) of `slot`'s /28.
fn v4_of(slot: u32, host: u8) -> Ipv4Addr {
    let (net, index) = if slot < 16 {
        ([203, 0, 113], slot)
    } else {
        ([198, 51, 100], slot - 16)
    };
    // index < 16, so 16 * index + host < 256.
    let last = u8::try_from(16 * index).unwrap_or(0) + host;
    Ipv4Addr::new(net[0], net[1], net[2], last)
}

/// The IPv6 address `host` of `slot`'s /64.
fn v6_of(slot: u32, host: u8) -> Ipv6Addr {
    let slot = u16::try_from(slot).unwrap_or(0);
    Ipv6Addr::new(0x2001, 0xdb8, 0x7e57, slot, 0, 0, 0, u16::from(host))
}

/// Runs `command` with `stdin` as its standard input; its standard error on failure.
fn run(command: &mut Command, stdin: &str) -> anyhow::Result<Result<(), String>> {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {command:?}"))?;
    child
        .stdin
        .take()
        .context("stdin is piped")?
        .write_all(stdin.as_bytes())?;
    let out = child.wait_with_output()?;
    if out.status.success() {
        Ok(Ok(()))
    } else {
        Ok(Err(String::from_utf8_lossy(&out.stderr).into_owned()))
    }
}

impl TestInternet {
    /// Starts one, or panics saying what failed. Needs root (the caller checks with
    /// [`crate::require`]).
    pub fn start() -> Self {
        Self::try_start().unwrap_or_else(|err| panic!("the test internet did not start: {err:#}"))
    }

    /// Starts one: the namespace, a slot's veth, then the servers, each `ready` before this
    /// returns. On an error, what was started ends (by [`Drop`]).
    pub fn try_start() -> anyhow::Result<Self> {
        let began = Instant::now();
        let dir = TempDir::with_prefix("executor-tests-internet-")?;
        // Readable by anyone: a sandboxed command may be given the CA's path.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let holder = Command::new("unshare")
            .args(["--net", "--", "sh", "-c", "echo ready; read _ignored"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot run unshare(1)")?;
        let deadline = began + STARTING;
        let mut net = Self {
            holder,
            servers: Vec::new(),
            link: None,
            slot: 0,
            sites: Vec::new(),
            dir,
            started_in: Duration::ZERO,
        };
        // `ready` only once unshare(2) has happened: before, /proc/PID/ns/net is the host's.
        let ready = first_line(&mut net.holder, deadline);
        if ready.as_deref() != Ok("ready") {
            bail!("unshare --net did not start: {ready:?}");
        }
        net.take_slot()?;
        net.sites = ROLES
            .iter()
            .zip(2..)
            .map(|(&(role, name), host)| Site {
                role,
                name,
                v4: v4_of(net.slot, host),
                v6: v6_of(net.slot, host),
            })
            .collect();
        net.configure_links()?;
        net.start_servers(deadline)?;
        net.started_in = began.elapsed();
        Ok(net)
    }

    /// Creates the veth pair, its host end named for the first free slot.
    fn take_slot(&mut self) -> anyhow::Result<()> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let first = std::process::id().wrapping_add(COUNTER.fetch_add(1, Ordering::Relaxed));
        let pid = self.holder.id().to_string();
        for k in 0..SLOTS {
            let slot = first.wrapping_add(k) % SLOTS;
            let link = format!("tnet{slot}");
            let made = run(
                Command::new("ip").args([
                    "link", "add", &link, "type", "veth", "peer", "name", "eth0", "netns", &pid,
                ]),
                "",
            )?;
            match made {
                Ok(()) => {
                    self.link = Some(link);
                    self.slot = slot;
                    return Ok(());
                }
                Err(stderr) if stderr.contains("File exists") => {}
                Err(stderr) => bail!("ip link add {link}: {stderr}"),
            }
        }
        bail!("all {SLOTS} test internet slots are taken (`ip link` lists tnet0..)")
    }

    /// Addresses both ends of the veth and brings them up.
    fn configure_links(&self) -> anyhow::Result<()> {
        let link = self.link_name();
        let host = format!(
            "addr add {}/28 dev {link}\naddr add {}/64 dev {link} nodad\nlink set {link} up\n",
            v4_of(self.slot, 1),
            v6_of(self.slot, 1),
        );
        let mut inner = String::from("link set lo up\n");
        for site in &self.sites {
            inner += &format!("addr add {}/28 dev eth0\n", site.v4);
            // nodad: usable at once, not after duplicate address detection's second or two.
            inner += &format!("addr add {}/64 dev eth0 nodad\n", site.v6);
        }
        inner += "link set eth0 up\n";
        if let Err(stderr) = run(Command::new("ip").args(["-batch", "-"]), &host)? {
            bail!("configuring {link}: {stderr}");
        }
        let netns = format!("--net={}", self.netns().display());
        if let Err(stderr) = run(
            Command::new("nsenter").args([&netns, "ip", "-batch", "-"]),
            &inner,
        )? {
            bail!("configuring the namespace's eth0: {stderr}");
        }
        Ok(())
    }

    /// Starts every server at once, then waits for each to say `ready`.
    fn start_servers(&mut self, deadline: Instant) -> anyhow::Result<()> {
        let dir = self.dir.path();
        std::fs::write(dir.join("servers.py"), SERVERS_PY)?;
        let sites: serde_json::Map<String, serde_json::Value> = self
            .sites
            .iter()
            .map(|s| {
                let (v4, v6) = (s.v4.to_string(), s.v6.to_string());
                let site = serde_json::json!({ "name": s.name, "v4": v4, "v6": v6 });
                (s.role.to_owned(), site)
            })
            .collect();
        std::fs::write(
            dir.join("config.json"),
            serde_json::json!({ "sites": sites }).to_string(),
        )?;
        let netns = format!("--net={}", self.netns().display());
        for site in &self.sites {
            let child = Command::new("nsenter")
                .arg(&netns)
                .arg(PYTHON)
                .arg(dir.join("servers.py"))
                .arg(site.role)
                .arg(dir.join(site.role))
                .arg(dir.join("config.json"))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(
                    dir.join(format!("{}.log", site.role)),
                )?)
                .spawn()
                .context("cannot run nsenter(1)")?;
            self.servers.push((site.role, child));
        }
        for (role, child) in &mut self.servers {
            let ready = first_line(child, deadline);
            if ready.as_deref() != Ok("ready") {
                let log = std::fs::read_to_string(dir.join(format!("{role}.log")));
                bail!(
                    "the {role} server did not start ({ready:?}): {}",
                    log.unwrap_or_default()
                );
            }
        }
        Ok(())
    }

    /// All servers, in slot order.
    pub fn sites(&self) -> &[Site] {
        &self.sites
    }

    fn site(&self, role: &str) -> &Site {
        self.sites
            .iter()
            .find(|s| s.role == role)
            .unwrap_or_else(|| panic!("no {role} site"))
    }

    /// The PEP 503 index, on port 80.
    pub fn pypi(&self) -> &Site {
        self.site("pypi")
    }

    /// The git repository over HTTP, on port 80.
    pub fn git(&self) -> &Site {
        self.site("git")
    }

    /// The HTTPS server, on port 443, its certificate issued by [`Self::ca_pem`].
    pub fn tls(&self) -> &Site {
        self.site("tls")
    }

    /// The TCP and UDP echo server, on [`ECHO_PORT`] and [`ECHO_OTHER_PORT`].
    pub fn echo(&self) -> &Site {
        self.site("echo")
    }

    /// The DNS server, on UDP [`DNS_PORT`], answering every site's name.
    pub fn dns(&self) -> &Site {
        self.site("dns")
    }

    /// `pip install --index-url` this.
    pub fn index_url(&self) -> String {
        format!("http://{}/simple/", self.pypi().name)
    }

    /// `git clone` this.
    pub fn repo_url(&self) -> String {
        format!("http://{}/repo.git", self.git().name)
    }

    /// `curl --cacert CA` this, to get [`TLS_BODY`].
    pub fn tls_url(&self) -> String {
        format!("https://{}/", self.tls().name)
    }

    /// The test CA's certificate (PEM), which issued the HTTPS server's.
    pub fn ca_pem(&self) -> PathBuf {
        self.dir.path().join("tls").join("ca.pem")
    }

    /// Every name with each of its addresses (IPv4 first), for the daemon's resolver override.
    pub fn names(&self) -> Vec<(&'static str, IpAddr)> {
        self.sites
            .iter()
            .flat_map(|s| [(s.name, IpAddr::V4(s.v4)), (s.name, IpAddr::V6(s.v6))])
            .collect()
    }

    /// [`Self::names`] as `NAME=ADDR` strings.
    pub fn resolve_pairs(&self) -> Vec<String> {
        self.names()
            .into_iter()
            .map(|(name, addr)| format!("{name}={addr}"))
            .collect()
    }

    /// curl's `--resolve NAME:PORT:ADDR` arguments for every name, on ports 80 and 443, to
    /// its IPv4 address.
    pub fn curl_resolve_args(&self) -> Vec<String> {
        self.sites
            .iter()
            .flat_map(|s| {
                [80, 443].map(|port| {
                    [
                        "--resolve".to_owned(),
                        format!("{}:{port}:{}", s.name, s.v4),
                    ]
                })
            })
            .flatten()
            .collect()
    }

    /// Hosts-file lines (`ADDR NAME`) for every name and address.
    pub fn hosts_lines(&self) -> String {
        self.names()
            .into_iter()
            .map(|(name, addr)| format!("{addr} {name}\n"))
            .collect()
    }

    /// Writes a hosts file to `path`: the host's /etc/hosts followed by [`Self::hosts_lines`].
    pub fn write_hosts_file(&self, path: &Path) -> std::io::Result<()> {
        let mut hosts = std::fs::read_to_string("/etc/hosts").unwrap_or_default();
        if !hosts.is_empty() && !hosts.ends_with('\n') {
            hosts.push('\n');
        }
        hosts += &self.hosts_lines();
        std::fs::write(path, hosts)
    }

    /// `program` on the host, resolving the test names: run in a mount namespace of its own
    /// (private propagation: `unshare`'s default) where a hosts file from
    /// [`Self::write_hosts_file`] is bind-mounted over /etc/hosts. Add its arguments.
    pub fn host_command(&self, program: &str) -> Command {
        let hosts = self.dir.path().join("hosts");
        if !hosts.exists() {
            self.write_hosts_file(&hosts)
                .unwrap_or_else(|err| panic!("writing {}: {err}", hosts.display()));
        }
        let mut command = Command::new("unshare");
        command.args([
            "--mount",
            "--",
            "sh",
            "-c",
            r#"mount --bind "$0" /etc/hosts && exec "$@""#,
        ]);
        command.arg(hosts).arg(program);
        command
    }

    /// The namespace's path, while it lives.
    pub fn netns(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/net", self.holder.id()))
    }

    /// The host end of the veth.
    pub fn link_name(&self) -> &str {
        self.link.as_deref().unwrap_or("")
    }

    /// The host's address on the veth (IPv4 and IPv6), which the servers see as the client.
    pub fn host_addrs(&self) -> (Ipv4Addr, Ipv6Addr) {
        (v4_of(self.slot, 1), v6_of(self.slot, 1))
    }

    /// The processes of the test internet: the namespace's holder and the servers.
    pub fn pids(&self) -> Vec<u32> {
        std::iter::once(self.holder.id())
            .chain(self.servers.iter().map(|(_, c)| c.id()))
            .collect()
    }

    /// What a server logged (one line per request for the HTTP servers), for a failure message.
    pub fn log(&self, role: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{role}.log"))).unwrap_or_default()
    }
}

/// The first line of `child`'s standard output, without its newline: an error at end of file
/// or at `deadline` (read on a thread of its own, which ends with the child).
fn first_line(child: &mut Child, deadline: Instant) -> Result<String, String> {
    let stdout = child.stdout.take().ok_or("no standard output")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let read = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(read.map(|_| line));
    });
    match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(Ok(line)) if line.is_empty() => Err("end of file".into()),
        Ok(Ok(line)) => Ok(line.trim_end().to_owned()),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no line within {STARTING:?}")),
    }
}

fn end(child: &mut Child) {
    drop(child.stdin.take());
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for TestInternet {
    fn drop(&mut self) {
        for (_, child) in &mut self.servers {
            end(child);
        }
        end(&mut self.holder);
        let Some(link) = &self.link else { return };
        let sys = Path::new("/sys/class/net").join(link);
        let began = Instant::now();
        while sys.exists() {
            if began.elapsed() > LINK_GONE {
                eprintln!(
                    "executor-tests: {link} still exists {LINK_GONE:?} after its namespace ended"
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Asks the DNS server at `server` for `name`'s A (or, with `v6`, AAAA) records: their
/// addresses, `Ok(None)` for NXDOMAIN; an error if no answer comes within `timeout`.
pub fn dns_query(
    server: SocketAddr,
    name: &str,
    v6: bool,
    timeout: Duration,
) -> std::io::Result<Option<Vec<IpAddr>>> {
    use std::io::{Error, ErrorKind};
    let bind: SocketAddr = if server.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(bind)?;
    socket.set_read_timeout(Some(timeout))?;
    socket.connect(server)?;
    let qtype: u16 = if v6 { 28 } else { 1 };
    let ident: u16 = 0x7e57;
    // Header: id, flags (recursion desired), one question.
    let mut query = Vec::new();
    query.extend_from_slice(&ident.to_be_bytes());
    query.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.split('.') {
        let len = u8::try_from(label.len()).map_err(|_| Error::from(ErrorKind::InvalidInput))?;
        query.push(len);
        query.extend_from_slice(label.as_bytes());
    }
    query.push(0);
    query.extend_from_slice(&qtype.to_be_bytes());
    query.extend_from_slice(&1u16.to_be_bytes());
    socket.send(&query)?;
    let mut reply = [0u8; 512];
    let n = socket.recv(&mut reply)?;
    let reply = &reply[..n];
    let bad = || Error::new(ErrorKind::InvalidData, format!("bad DNS reply {reply:?}"));
    if n < 12 || reply[..2] != ident.to_be_bytes() {
        return Err(bad());
    }
    if reply[3] & 0x0f == 3 {
        return Ok(None);
    }
    let answers = u16::from_be_bytes([reply[6], reply[7]]);
    // Skip the question: it is ours, echoed.
    let mut at = query.len();
    let mut addrs = Vec::new();
    for _ in 0..answers {
        // A compressed name (2 bytes) is all our server sends; then type, class, ttl, length.
        let fixed = reply.get(at + 2..at + 12).ok_or_else(bad)?;
        let rtype = u16::from_be_bytes([fixed[0], fixed[1]]);
        let len = usize::from(u16::from_be_bytes([fixed[8], fixed[9]]));
        let data = reply.get(at + 12..at + 12 + len).ok_or_else(bad)?;
        match (rtype, data.len()) {
            (1, 4) => addrs.push(IpAddr::from(<[u8; 4]>::try_from(data).map_err(|_| bad())?)),
            (28, 16) => addrs.push(IpAddr::from(<[u8; 16]>::try_from(data).map_err(|_| bad())?)),
            _ => {}
        }
        at += 12 + len;
    }
    Ok(Some(addrs))
}
