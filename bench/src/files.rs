//! File transfer over the WebSocket (protocol 1.1): `upload` and `download` of one random file,
//! beside the same bytes moved through the processes API (`spawn` + `write`, `spawn` + `read`)
//! on the same connection, with the daemon's RSS before, at its peak during, and after each.
//!
//! The point is flat daemon memory: the daemon holds a bounded queue of a transfer, never the
//! file. Every transfer is checked: the uploaded file's sha256 (from `sha256sum` run by the
//! daemon) and the downloaded bytes' sha256 must equal the local file's, or the run fails.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use base64::Engine as _;
use protocol::{
    ClientMessage, DownloadRequest, ErrorCode, Hello, ListProcessesRequest, ReadRequest,
    ServerMessage, SpawnRequest, UploadRequest, WaitRequest, WriteRequest,
};
use sha2::{Digest, Sha256};

use crate::client::{request, Client};
use crate::daemon::{reset_peak_rss, status_kib, CpuTimes, Daemon, RssSampler};
use crate::report::{FilesReport, TransferRun, UnpacedRead};
use crate::settle;
use crate::stats::median;

/// Raw bytes per `write` message, as an agent's client would send a large file.
const CHUNK: usize = 512 * 1024;
/// Room left in a `write` message for everything but its base64 `data` (type, id, eof, quotes).
const WRITE_OVERHEAD: usize = 256;
/// Seconds one `read` waits for output before it answers empty.
const READ_WAIT: f64 = 10.0;
/// Where the files go, relative to the workspace (removed at the end).
const DIR: &str = "executor-bench-files";

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

/// MB (10^6 bytes) per second; 0 for an instant that took no time.
pub fn mb_per_s(bytes: u64, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs <= 0.0 {
        return 0.0;
    }
    bytes as f64 / 1e6 / secs
}

/// The raw bytes per `write`: `wanted`, or less when its base64 would not fit the daemon's
/// message limit (a larger message is refused and closes the connection). A multiple of 3 when
/// cut, so no chunk but the last carries base64 padding.
pub fn write_chunk_bytes(wanted: usize, max_message_bytes: usize) -> usize {
    let room = max_message_bytes.saturating_sub(WRITE_OVERHEAD);
    let fits = room / 4 * 3;
    if wanted.div_ceil(3) * 4 <= room {
        wanted
    } else {
        fits.max(3)
    }
}

/// `n` pseudo-random bytes (splitmix64): incompressible enough that nothing on the way can
/// shortcut them, and far faster than the OS's generator for 50 MB.
pub fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        out.extend_from_slice(&z.to_le_bytes());
    }
    out.truncate(n);
    out
}

fn sha256_hex(data: &[u8]) -> String {
    format!("{:x}", Sha256::digest(data))
}

/// The daemon's RSS around one transfer, in KiB, and the CPU time the daemon's own threads
/// and this benchmark process spent during it.
#[derive(Debug, Clone, Copy, Default)]
struct Memory {
    before: u64,
    peak: u64,
    after: u64,
    from_vmhwm: bool,
    daemon_cpu_ms: f64,
    client_cpu_ms: f64,
    /// Minor page faults of the daemon: each a page touched for the first time, as in a
    /// buffer the allocator had to map afresh.
    daemon_minor_faults: u64,
}

/// `minflt` of /proc/PID/stat (proc(5), field 10).
fn minor_faults(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .nth(7)?
        .parse()
        .ok()
}

/// Run `transfer` with the daemon's memory watched: VmRSS after a settle before it, the peak
/// (VmHWM reset just before, and VmRSS sampled every 2 ms), VmRSS after a settle after it.
async fn watched<T>(
    pid: u32,
    transfer: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<(T, Memory)> {
    settle().await;
    let before = status_kib(pid, "VmRSS").unwrap_or(0);
    let from_vmhwm = reset_peak_rss(pid);
    let me = std::process::id();
    let cpu0 = (CpuTimes::of(pid), CpuTimes::of(me));
    let faults0 = minor_faults(pid);
    let sampler = RssSampler::start(pid);
    let got = transfer.await;
    let sampled = sampler.stop();
    let cpu = |before: Option<CpuTimes>, of: u32| match (before, CpuTimes::of(of)) {
        (Some(b), Some(a)) => a.own_ms - b.own_ms,
        _ => 0.0,
    };
    let (daemon_cpu_ms, client_cpu_ms) = (cpu(cpu0.0, pid), cpu(cpu0.1, me));
    let daemon_minor_faults = match (faults0, minor_faults(pid)) {
        (Some(f0), Some(f1)) => f1.saturating_sub(f0),
        _ => 0,
    };
    let peak = if from_vmhwm {
        status_kib(pid, "VmHWM").unwrap_or(0).max(sampled)
    } else {
        sampled
    };
    let got = got?;
    settle().await;
    let after = status_kib(pid, "VmRSS").unwrap_or(0);
    Ok((
        got,
        Memory {
            before,
            peak,
            after,
            from_vmhwm,
            daemon_cpu_ms,
            client_cpu_ms,
            daemon_minor_faults,
        },
    ))
}

/// What to measure: one file of `bytes` under `profile`, `repeats` times.
pub struct Plan<'a> {
    pub profile: &'a str,
    pub bytes: u64,
    pub repeats: usize,
}

/// What is measured, in table order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Upload,
    Download,
    SpawnWrite,
    SpawnRead,
    ExecCat,
}

impl Kind {
    const ALL: [Self; 5] = [
        Self::Upload,
        Self::Download,
        Self::SpawnWrite,
        Self::SpawnRead,
        Self::ExecCat,
    ];

    /// The name in the JSON and on stderr.
    fn key(self) -> &'static str {
        match self {
            Self::Upload => "upload",
            Self::Download => "download",
            Self::SpawnWrite => "spawn_write",
            Self::SpawnRead => "spawn_read",
            Self::ExecCat => "exec_cat",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Upload => "`upload` + `write` chunks",
            Self::Download => "`download`",
            Self::SpawnWrite => "`spawn` `cat > FILE` + `write` chunks (upload baseline)",
            Self::SpawnRead => "`spawn` + `read` by offset, paced (download baseline)",
            Self::ExecCat => "`exec` `cat FILE`, result only (not a transfer)",
        }
    }

    /// Needs the file the upload wrote.
    fn reads_upload(self) -> bool {
        !matches!(self, Self::Upload | Self::SpawnWrite)
    }
}

/// Every transfer of the phase on one connection to `daemon`; a failed one is reported in
/// `failures` and the rest go on (on a fresh connection).
pub async fn measure(daemon: &Daemon, hello: &Hello, plan: &Plan<'_>) -> FilesReport {
    let limits = &hello.limits;
    let chunk = write_chunk_bytes(CHUNK, limits.max_message_bytes);
    let window = limits.max_process_buffer_bytes;
    let mut report = FilesReport {
        profile: plan.profile.to_string(),
        bytes: plan.bytes,
        chunk_bytes: chunk,
        window_bytes: window,
        repeats: plan.repeats,
        rows: Vec::new(),
        unpaced_read: None,
        failures: Vec::new(),
    };
    if !hello.capabilities.iter().any(|c| c == "files") {
        report
            .failures
            .push("the daemon's hello does not list the `files` capability".to_string());
        return report;
    }
    if window == 0 {
        report
            .failures
            .push("the daemon's hello gives no max_process_buffer_bytes".to_string());
        return report;
    }
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id());
    let data = random_bytes(plan.bytes as usize, seed);
    let sha = sha256_hex(&data);
    eprintln!(
        "bench: files: {} MB random file under {}, {} KiB per write, x{} ...",
        plan.bytes as f64 / 1e6,
        plan.profile,
        chunk / 1024,
        plan.repeats
    );
    let mut client = match Client::connect(&daemon.url, &daemon.token).await {
        Ok((client, _)) => client,
        Err(err) => {
            report.failures.push(format!("connect: {err:#}"));
            return report;
        }
    };
    let mut t = Transfers {
        client: &mut client,
        profile: plan.profile,
        data: &data,
        sha: &sha,
        chunk,
        window,
        serial: 0,
        uploaded: false,
    };
    let mut runs: Vec<Vec<(Duration, Memory)>> = vec![Vec::new(); Kind::ALL.len()];
    let file = format!("{DIR}/upload.bin");
    let copy = format!("{DIR}/cat.bin");
    for r in 0..plan.repeats {
        for (k, kind) in Kind::ALL.into_iter().enumerate() {
            if kind.reads_upload() && !t.uploaded {
                continue;
            }
            let pid = daemon.pid;
            let got = match kind {
                Kind::Upload => watched(pid, t.upload(&file)).await,
                Kind::Download => watched(pid, t.download(&file)).await,
                Kind::SpawnWrite => watched(pid, t.spawn_write(&copy)).await,
                Kind::SpawnRead => watched(pid, t.spawn_read(&file)).await,
                Kind::ExecCat => watched(pid, t.exec_cat(&file)).await,
            };
            // What was written is checked after the memory window: the daemon's own
            // sha256sum of the file.
            let got = match (got, kind) {
                (Ok(run), Kind::Upload) => t.check_written(&file).await.map(|()| run),
                (Ok(run), Kind::SpawnWrite) => t.check_written(&copy).await.map(|()| run),
                (other, _) => other,
            };
            match got {
                Ok((took, memory)) => {
                    t.uploaded |= kind == Kind::Upload;
                    eprintln!(
                        "bench: files [{r}] {}: {:.0} MB/s, daemon RSS {} -> peak {} -> {} KiB, \
                         CPU {:.0} ms, {} minor faults",
                        kind.key(),
                        mb_per_s(plan.bytes, took),
                        memory.before,
                        memory.peak,
                        memory.after,
                        memory.daemon_cpu_ms,
                        memory.daemon_minor_faults
                    );
                    runs[k].push((took, memory));
                }
                Err(err) => {
                    eprintln!("bench: files FAILED {}: {err:#}", kind.key());
                    report.failures.push(format!("{}: {err:#}", kind.key()));
                    // The failure may have left the connection mid-transfer.
                    match Client::connect(&daemon.url, &daemon.token).await {
                        Ok((fresh, _)) => std::mem::replace(t.client, fresh).close().await,
                        Err(err) => {
                            report.failures.push(format!("reconnect: {err:#}"));
                            return report;
                        }
                    }
                }
            }
        }
    }
    if t.uploaded {
        match t.unpaced_read(&file).await {
            Ok(unpaced) => report.unpaced_read = Some(unpaced),
            Err(err) => report.failures.push(format!("unpaced spawn read: {err:#}")),
        }
    }
    // Not fatal: the state directory, with the workspace, goes when the daemon stops.
    let _ = t.exec(&format!("rm -rf {DIR}")).await;
    for (kind, runs) in Kind::ALL.into_iter().zip(runs) {
        if let Some(row) = row(kind, plan.bytes, &runs) {
            report.rows.push(row);
        }
    }
    client.close().await;
    report
}

/// One row from a kind's repeats: median rate and time, the first repeat's RSS before and
/// after, the largest peak and growth.
fn row(kind: Kind, bytes: u64, runs: &[(Duration, Memory)]) -> Option<TransferRun> {
    // Before and after of the first repeat, on the freshest daemon: what one transfer left.
    let (_, first) = runs.first()?;
    let rates: Vec<f64> = runs.iter().map(|(d, _)| mb_per_s(bytes, *d)).collect();
    let seconds: Vec<f64> = runs.iter().map(|(d, _)| d.as_secs_f64()).collect();
    let med = |of: fn(&Memory) -> f64| {
        median(&runs.iter().map(|(_, m)| of(m)).collect::<Vec<_>>()).unwrap_or(0.0)
    };
    Some(TransferRun {
        kind: kind.key().to_string(),
        label: kind.label().to_string(),
        verified: if kind == Kind::ExecCat {
            "byte count only".to_string()
        } else {
            "sha256".to_string()
        },
        mb_per_s: median(&rates).unwrap_or(0.0),
        daemon_cpu_ms: med(|m| m.daemon_cpu_ms),
        client_cpu_ms: med(|m| m.client_cpu_ms),
        daemon_minor_faults: med(|m| m.daemon_minor_faults as f64) as u64,
        seconds: median(&seconds).unwrap_or(0.0),
        all_seconds: seconds,
        rss_before_kib: first.before,
        rss_peak_kib: runs.iter().map(|(_, m)| m.peak).max().unwrap_or(0),
        rss_after_kib: first.after,
        peak_growth_kib: runs
            .iter()
            .map(|(_, m)| m.peak.saturating_sub(m.before))
            .max()
            .unwrap_or(0),
        peak_from_vmhwm: runs.iter().all(|(_, m)| m.from_vmhwm),
    })
}

/// The phase's state on its connection.
struct Transfers<'a> {
    client: &'a mut Client,
    profile: &'a str,
    data: &'a [u8],
    sha: &'a str,
    chunk: usize,
    window: usize,
    serial: u64,
    /// The upload succeeded once: the other transfers have a file to read.
    uploaded: bool,
}

impl Transfers<'_> {
    fn id(&mut self, what: &str) -> String {
        self.serial += 1;
        format!("f-{what}-{}", self.serial)
    }

    /// The next message about `id`: an `error` for it is an error here.
    async fn next_for(&mut self, id: &str) -> anyhow::Result<ServerMessage> {
        loop {
            let msg = self.client.recv().await?;
            match &msg {
                ServerMessage::Error(err) if err.id.as_deref() == Some(id) => {
                    bail!("{id}: {}: {}", err.code, err.message)
                }
                ServerMessage::Spawned(m) if m.id == id => return Ok(msg),
                ServerMessage::ProcessOutput(m) if m.id == id => return Ok(msg),
                ServerMessage::Exited(m) if m.id == id => return Ok(msg),
                ServerMessage::Uploaded(m) if m.id == id => return Ok(msg),
                ServerMessage::DownloadData(m) if m.id == id => return Ok(msg),
                ServerMessage::Downloaded(m) if m.id == id => return Ok(msg),
                ServerMessage::Processes(m) if m.id.as_deref() == Some(id) => return Ok(msg),
                _ => {}
            }
        }
    }

    /// Run `command` with `exec` and insist on returncode 0; its output.
    async fn exec(&mut self, command: &str) -> anyhow::Result<String> {
        let id = self.id("exec");
        let (result, _) = self.client.run(request(id, command, self.profile)).await?;
        if result.returncode != 0 {
            bail!(
                "`{command}` gave returncode {}: {} {}",
                result.returncode,
                result.output,
                result.exception_info
            );
        }
        Ok(result.output)
    }

    /// The daemon's own sha256 of `path` equals the local file's.
    async fn check_written(&mut self, path: &str) -> anyhow::Result<()> {
        let out = self.exec(&format!("sha256sum {path}")).await?;
        let theirs = out.split_whitespace().next().unwrap_or_default();
        if theirs != self.sha {
            bail!(
                "{path} as written has sha256 {theirs}, the file sent {}",
                self.sha
            );
        }
        Ok(())
    }

    fn write(id: &str, data: &[u8], eof: bool) -> ClientMessage {
        ClientMessage::Write(WriteRequest {
            id: id.to_string(),
            data: (!data.is_empty()).then(|| b64().encode(data)),
            text: None,
            eof,
        })
    }

    /// `upload`, every chunk in a `write` (the last with `eof`), until `uploaded`. The daemon
    /// paces the writes: it stops reading the connection while the payload's queue is full.
    async fn upload(&mut self, path: &str) -> anyhow::Result<Duration> {
        let id = self.id("upload");
        let t0 = Instant::now();
        self.client
            .send(&ClientMessage::Upload(UploadRequest {
                id: id.clone(),
                path: path.to_string(),
                mode: None,
                parents: true,
                tar: false,
                profile: Some(self.profile.to_string()),
            }))
            .await?;
        let chunks: Vec<&[u8]> = self.data.chunks(self.chunk).collect();
        if chunks.is_empty() {
            self.client.send(&Self::write(&id, &[], true)).await?;
        }
        for (i, chunk) in chunks.iter().enumerate() {
            let eof = i + 1 == chunks.len();
            self.client.send(&Self::write(&id, chunk, eof)).await?;
        }
        match self.next_for(&id).await? {
            ServerMessage::Uploaded(up) if up.bytes == self.data.len() as u64 => Ok(t0.elapsed()),
            other => bail!(
                "upload of {path}: expected uploaded with {} bytes, got {other:?}",
                self.data.len()
            ),
        }
    }

    /// `download` to `downloaded`: chunks in order, decoded and hashed as they come.
    async fn download(&mut self, path: &str) -> anyhow::Result<Duration> {
        let id = self.id("download");
        let t0 = Instant::now();
        self.client
            .send(&ClientMessage::Download(DownloadRequest {
                id: id.clone(),
                path: path.to_string(),
                offset: 0,
                length: None,
                tar: false,
                profile: Some(self.profile.to_string()),
            }))
            .await?;
        let mut hash = Sha256::new();
        let mut got = 0u64;
        let mut seq = 0u64;
        loop {
            match self.next_for(&id).await? {
                ServerMessage::DownloadData(chunk) => {
                    if chunk.seq != seq {
                        bail!("download_data seq {} where {seq} was due", chunk.seq);
                    }
                    seq += 1;
                    let bytes = b64()
                        .decode(chunk.data.as_bytes())
                        .context("download_data is not base64")?;
                    got += bytes.len() as u64;
                    hash.update(&bytes);
                }
                ServerMessage::Downloaded(done) => {
                    let took = t0.elapsed();
                    return self
                        .verify("download", got, done.bytes, hash)
                        .map(|()| took);
                }
                other => bail!("unexpected reply to download: {other:?}"),
            }
        }
    }

    fn verify(&self, what: &str, got: u64, said: u64, hash: Sha256) -> anyhow::Result<()> {
        let theirs = format!("{:x}", hash.finalize());
        let len = self.data.len() as u64;
        if got != len || said != len {
            bail!("{what}: {got} bytes received, the daemon said {said}, the file has {len}");
        }
        if theirs != self.sha {
            bail!("{what}: received sha256 {theirs}, the file's {}", self.sha);
        }
        Ok(())
    }

    async fn spawn(&mut self, what: &str, command: String) -> anyhow::Result<String> {
        let id = self.id(what);
        self.client
            .send(&ClientMessage::Spawn(SpawnRequest {
                id: id.clone(),
                command,
                cwd: None,
                env: Default::default(),
                timeout: None,
                profile: Some(self.profile.to_string()),
                pty: None,
                network: None,
            }))
            .await?;
        match self.next_for(&id).await? {
            ServerMessage::Spawned(_) => Ok(id),
            other => bail!("expected spawned, got {other:?}"),
        }
    }

    /// `wait` until the process has ended; its returncode must be 0.
    async fn wait_zero(&mut self, id: &str) -> anyhow::Result<()> {
        for _ in 0..5 {
            self.client
                .send(&ClientMessage::Wait(WaitRequest {
                    id: id.to_string(),
                    timeout: Some(30.0),
                }))
                .await?;
            match self.next_for(id).await? {
                ServerMessage::Exited(e) if e.running => continue,
                ServerMessage::Exited(e) if e.returncode == 0 => return Ok(()),
                ServerMessage::Exited(e) => {
                    bail!("{id} exited with {}: {}", e.returncode, e.exception_info)
                }
                other => bail!("expected exited, got {other:?}"),
            }
        }
        bail!("{id} still running after 150 s")
    }

    /// `spawn` `cat > FILE`, then each chunk in a `write`, eof, and `wait`. A write to a
    /// process has no reply, and one that finds the process's stdin queue full is refused with
    /// `busy` and its bytes dropped; so each write is confirmed before the next by a
    /// `list_processes` behind it (the daemon handles a connection's messages in order, so an
    /// error for the write comes before that reply), and a refused one is sent again.
    async fn spawn_write(&mut self, path: &str) -> anyhow::Result<Duration> {
        let t0 = Instant::now();
        let id = self
            .spawn("cat-in", format!("mkdir -p {DIR} && exec cat > {path}"))
            .await?;
        let chunks: Vec<&[u8]> = self.data.chunks(self.chunk).collect();
        let mut refused = 0usize;
        for (i, chunk) in chunks.iter().enumerate() {
            loop {
                self.client.send(&Self::write(&id, chunk, false)).await?;
                let ack = format!("{id}-ack{i}");
                self.client
                    .send(&ClientMessage::ListProcesses(ListProcessesRequest {
                        id: Some(ack.clone()),
                    }))
                    .await?;
                let mut busy = false;
                loop {
                    match self.client.recv().await? {
                        ServerMessage::Error(err) if err.id.as_deref() == Some(id.as_str()) => {
                            if err.code != ErrorCode::Busy {
                                bail!("write to {id}: {}: {}", err.code, err.message);
                            }
                            busy = true;
                        }
                        ServerMessage::Processes(list) if list.id.as_deref() == Some(&ack) => break,
                        _ => {}
                    }
                }
                if !busy {
                    break;
                }
                refused += 1;
                if refused > 10_000 {
                    bail!("{id} keeps refusing writes as busy");
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        self.client.send(&Self::write(&id, &[], true)).await?;
        self.wait_zero(&id).await?;
        if refused > 0 {
            eprintln!("bench: files: {refused} writes to `cat` refused as busy and sent again");
        }
        Ok(t0.elapsed())
    }

    /// One `read` from `offset`, waiting for output.
    async fn read(&mut self, id: &str, offset: u64) -> anyhow::Result<protocol::ProcessOutput> {
        self.client
            .send(&ClientMessage::Read(ReadRequest {
                id: id.to_string(),
                offset,
                max_bytes: None,
                wait: Some(READ_WAIT),
            }))
            .await?;
        match self.next_for(id).await? {
            ServerMessage::ProcessOutput(out) => Ok(out),
            other => bail!("expected process_output, got {other:?}"),
        }
    }

    /// `spawn` a shell that sends the file one window (the output ring's size) per line it
    /// reads on stdin, and `read` each window whole by offset before asking for the next: a
    /// process's output ring keeps only the newest bytes (it is not flow-controlled), so a
    /// reader that must not lose any paces the writer.
    async fn spawn_read(&mut self, path: &str) -> anyhow::Result<Duration> {
        let t0 = Instant::now();
        let window = self.window;
        let id = self
            .spawn(
                "cat-out",
                format!("exec 3< {path} && while read -r _; do head -c {window} <&3; done"),
            )
            .await?;
        let len = self.data.len() as u64;
        let mut hash = Sha256::new();
        let mut offset = 0u64;
        while offset < len {
            let end = (offset + window as u64).min(len);
            self.client.send(&Self::write(&id, b"\n", false)).await?;
            while offset < end {
                let out = self.read(&id, offset).await?;
                if out.dropped > 0 || out.offset != offset {
                    bail!(
                        "the ring dropped {} bytes before offset {offset} (paced by window)",
                        out.dropped
                    );
                }
                let bytes = b64()
                    .decode(out.data.as_bytes())
                    .context("process_output is not base64")?;
                if out.eof && out.next_offset < len {
                    bail!("output ended at {} of {len} bytes", out.next_offset);
                }
                if bytes.is_empty() {
                    bail!("no output for {READ_WAIT} s at offset {offset}");
                }
                hash.update(&bytes);
                offset = out.next_offset;
            }
        }
        self.client.send(&Self::write(&id, &[], true)).await?;
        // The whole output: nothing after the file's last byte.
        loop {
            let out = self.read(&id, offset).await?;
            if !out.data.is_empty() {
                bail!(
                    "{} bytes of output past the file's end",
                    out.next_offset - len
                );
            }
            if out.eof {
                break;
            }
        }
        self.wait_zero(&id).await?;
        let took = t0.elapsed();
        self.verify("spawn read", offset, len, hash).map(|()| took)
    }

    /// `exec` `cat FILE` without streaming: the daemon reads every byte but keeps only the head
    /// and tail for the result (`max_output_bytes`), and the result's text is lossy UTF-8, so
    /// this is how fast the daemon drains a command's output, checked by the byte count.
    async fn exec_cat(&mut self, path: &str) -> anyhow::Result<Duration> {
        let id = self.id("exec-cat");
        let t0 = Instant::now();
        let (result, _) = self
            .client
            .run(request(id, &format!("cat {path}"), self.profile))
            .await?;
        let took = t0.elapsed();
        let len = self.data.len() as u64;
        if result.returncode != 0 || result.extra.output_bytes != len {
            bail!(
                "`cat {path}`: returncode {}, {} bytes of output where {len} were due ({})",
                result.returncode,
                result.extra.output_bytes,
                result.exception_info
            );
        }
        Ok(took)
    }

    /// `spawn` `cat FILE` and read by offset as fast as it answers, without pacing: what
    /// arrives, and what the ring dropped before it was read.
    async fn unpaced_read(&mut self, path: &str) -> anyhow::Result<UnpacedRead> {
        let id = self
            .spawn("cat-unpaced", format!("exec cat {path}"))
            .await?;
        let mut offset = 0u64;
        let mut received = 0u64;
        let mut dropped = 0u64;
        loop {
            let out = self.read(&id, offset).await?;
            dropped += out.dropped;
            received += out.next_offset - out.offset;
            offset = out.next_offset;
            if out.eof {
                break;
            }
        }
        self.wait_zero(&id).await?;
        Ok(UnpacedRead {
            output_bytes: offset,
            received_bytes: received,
            dropped_bytes: dropped,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mb_per_s_is_decimal_megabytes_over_seconds() {
        let rate = mb_per_s(50_000_000, Duration::from_millis(500));
        assert!((rate - 100.0).abs() < 1e-9, "{rate}");
        assert_eq!(mb_per_s(1, Duration::ZERO), 0.0);
    }

    #[test]
    fn a_512_kib_chunk_fits_the_default_message_limit_as_is() {
        // base64 of 512 KiB is 699,052 bytes, well inside 1 MiB.
        assert_eq!(write_chunk_bytes(512 * 1024, 1 << 20), 512 * 1024);
    }

    #[test]
    fn a_chunk_too_large_for_the_message_limit_is_cut_to_fit() {
        let limit = 256 * 1024;
        let chunk = write_chunk_bytes(512 * 1024, limit);
        assert_eq!(chunk % 3, 0);
        assert!(chunk.div_ceil(3) * 4 + WRITE_OVERHEAD <= limit, "{chunk}");
        // And not needlessly small: one more 3-byte group would not fit.
        assert!(
            (chunk + 3).div_ceil(3) * 4 + WRITE_OVERHEAD > limit,
            "{chunk}"
        );
        assert_eq!(write_chunk_bytes(512 * 1024, 0), 3);
    }

    #[test]
    fn random_bytes_have_the_length_asked_and_depend_on_the_seed() {
        let a = random_bytes(1001, 1);
        assert_eq!(a.len(), 1001);
        assert_eq!(a, random_bytes(1001, 1));
        assert_ne!(a, random_bytes(1001, 2));
        // Not a run of one byte: every value shows up in 64 KiB.
        let wide = random_bytes(64 * 1024, 7);
        let mut seen = [false; 256];
        for b in wide {
            seen[b as usize] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }
}
