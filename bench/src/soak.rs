//! `--soak SECONDS`: protocol 1.1 under load and faults (issue 35, part 6). `--soak-clients`
//! clients take turns, each at random, among: `exec`; processes with and without a PTY
//! (stdin writes, reads by offset, waits, signals); uploads and downloads checked by sha256;
//! connections dropped mid-upload, mid-download and mid-process, then resumed; payloads
//! killed with SIGKILL from the host, found by a marker in their command line. Half way, the
//! daemon is stopped with SIGTERM and started again on the same state directory; clients
//! reconnect and go on. At the end, checked from outside: nothing lost or repeated in any
//! output read through a resume, no `.upload-` temporary file in the state directory or the
//! workspace, the daemon's RSS against its memory budget, no process of its commands left
//! on the host once it stopped. Exits non-zero when one of these is broken or an operation
//! failed unexpectedly.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use base64::Engine;
use protocol::{
    ClientMessage, DownloadRequest, ErrorCode, PtySize, ResumeRequest, ServerMessage,
    SignalRequest, SpawnRequest, UploadRequest, WaitRequest, WriteRequest,
};
use sha2::{Digest, Sha256};

use crate::client::Client;
use crate::daemon::{status_kib, Daemon};
use crate::soak_host::{kill_by_cmdline, leftovers, temp_files};
use crate::stats::percentile;

/// RSS allowed past the memory budget: the daemon's code, its runtime and per-connection
/// state, which the budget does not cover (the 4,000-session run measured 102 KiB a session).
pub(crate) const RSS_OVERHEAD_MIB: u64 = 128;
/// Lines of a counter process.
const COUNT: u32 = 400;

pub(crate) struct Plan {
    pub seconds: f64,
    pub clients: usize,
    pub budget_mb: u64,
}

/// The kinds of operation, in the order they are reported.
const KINDS: [&str; 9] = [
    "exec",
    "counter",
    "pty",
    "signal",
    "files",
    "drop_process",
    "drop_upload",
    "drop_download",
    "host_kill",
];

#[derive(Default)]
pub(crate) struct Tally {
    pub done: BTreeMap<&'static str, u64>,
    /// Failures explained by the fault injected: a resume after the restart, an operation the
    /// restart interrupted, an upload or download the drop failed.
    pub expected: BTreeMap<String, u64>,
    pub unexpected: BTreeMap<&'static str, u64>,
    pub unexpected_samples: Vec<String>,
    /// Outputs read whole through a resume, and the bytes checked.
    pub resumed_reads: u64,
    pub checked_bytes: u64,
    /// Lost or repeated bytes, hash mismatches: never expected.
    pub integrity: Vec<String>,
    pub exec_ms: Vec<f64>,
    /// The longest operation of each kind, in ms.
    pub longest_ms: BTreeMap<&'static str, f64>,
}

struct Shared {
    url: Mutex<String>,
    token: Mutex<String>,
    /// Bumped when the daemon is stopped for its restart and again once it is back.
    generation: AtomicU64,
    restarting: AtomicBool,
    pid: AtomicU32,
    mark: String,
    deadline: Instant,
    tally: Mutex<Tally>,
}

impl Shared {
    fn note_expected(&self, what: &str) {
        if let Ok(mut t) = self.tally.lock() {
            *t.expected.entry(what.to_string()).or_default() += 1;
        }
    }

    fn integrity(&self, what: String) {
        eprintln!("soak: INTEGRITY: {what}");
        if let Ok(mut t) = self.tally.lock() {
            t.integrity.push(what);
        }
    }

    fn env(&self) -> BTreeMap<String, String> {
        [("EXECUTOR_SOAK".to_string(), self.mark.clone())].into()
    }
}

/// A connection and its session.
struct Conn {
    client: Client,
    session: String,
    /// The daemon generation it was made under.
    generation: u64,
    serial: u64,
    number: usize,
}

impl Conn {
    fn id(&mut self, what: &str) -> String {
        self.serial += 1;
        format!("c{}-{what}-{}", self.number, self.serial)
    }

    /// The next message about `id`; an `error` for it is an error here.
    async fn next_for(&mut self, id: &str) -> anyhow::Result<ServerMessage> {
        loop {
            let msg = self.client.recv().await?;
            if about(&msg) == Some(id) {
                if let ServerMessage::Error(err) = &msg {
                    bail!("{id}: {:?}: {}", err.code, err.message);
                }
                return Ok(msg);
            }
        }
    }

    async fn spawn(
        &mut self,
        shared: &Shared,
        what: &str,
        command: String,
        pty: bool,
    ) -> anyhow::Result<String> {
        let id = self.id(what);
        self.client
            .send(&ClientMessage::Spawn(SpawnRequest {
                id: id.clone(),
                command,
                cwd: None,
                env: shared.env(),
                timeout: Some(120.0),
                profile: None,
                pty: pty.then_some(PtySize { rows: 24, cols: 80 }),
            }))
            .await?;
        match self.next_for(&id).await? {
            ServerMessage::Spawned(_) => Ok(id),
            other => bail!("expected spawned, got {other:?}"),
        }
    }

    async fn write(&mut self, id: &str, data: &[u8], eof: bool) -> anyhow::Result<()> {
        self.client
            .send(&ClientMessage::Write(WriteRequest {
                id: id.to_string(),
                data: (!data.is_empty()).then(|| b64().encode(data)),
                text: None,
                eof,
            }))
            .await
    }

    async fn read(&mut self, id: &str, offset: u64) -> anyhow::Result<protocol::ProcessOutput> {
        self.client
            .send(&ClientMessage::Read(protocol::ReadRequest {
                id: id.to_string(),
                offset,
                max_bytes: None,
                wait: Some(10.0),
            }))
            .await?;
        match self.next_for(id).await? {
            ServerMessage::ProcessOutput(out) => Ok(out),
            other => bail!("expected process_output, got {other:?}"),
        }
    }

    /// `wait` until it ended: (returncode, exception_info).
    async fn wait(&mut self, id: &str) -> anyhow::Result<(i32, String)> {
        for _ in 0..6 {
            self.client
                .send(&ClientMessage::Wait(WaitRequest {
                    id: id.to_string(),
                    timeout: Some(20.0),
                }))
                .await?;
            match self.next_for(id).await? {
                ServerMessage::Exited(e) if e.running => continue,
                ServerMessage::Exited(e) => return Ok((e.returncode, e.exception_info)),
                other => bail!("expected exited, got {other:?}"),
            }
        }
        bail!("{id} still running after 120 s")
    }
}

/// The id a message is about.
fn about(msg: &ServerMessage) -> Option<&str> {
    Some(match msg {
        ServerMessage::Error(m) => m.id.as_deref()?,
        ServerMessage::Spawned(m) => &m.id,
        ServerMessage::ProcessOutput(m) => &m.id,
        ServerMessage::Exited(m) => &m.id,
        ServerMessage::Done(m) => &m.id,
        ServerMessage::Uploaded(m) => &m.id,
        ServerMessage::DownloadData(m) => &m.id,
        ServerMessage::Downloaded(m) => &m.id,
        ServerMessage::Result(m) => &m.id,
        ServerMessage::Output(m) => &m.id,
        _ => return None,
    })
}

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

fn sha(data: &[u8]) -> String {
    format!("{:x}", Sha256::digest(data))
}

/// xorshift64: the mix of operations and file contents, reproducible per client.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// A fresh connection, waiting out a restart.
async fn connect(shared: &Shared, number: usize) -> anyhow::Result<Conn> {
    let give_up = Instant::now() + Duration::from_secs(60);
    loop {
        let generation = shared.generation.load(Ordering::SeqCst);
        let url = shared.url.lock().map_err(|_| anyhow!("poisoned"))?.clone();
        let token = shared
            .token
            .lock()
            .map_err(|_| anyhow!("poisoned"))?
            .clone();
        match Client::connect(&url, &token).await {
            Ok((client, hello)) => {
                return Ok(Conn {
                    client,
                    session: hello.session,
                    generation,
                    serial: 0,
                    number,
                })
            }
            Err(err) if Instant::now() > give_up => return Err(err),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Drop `conn` without a close frame and take its session back on a new connection; the
/// replay before the next request is left for the caller to read. `Ok(None)`: the resume
/// was refused after a restart (expected), and the connection goes on with a fresh session.
async fn drop_and_resume(
    shared: &Shared,
    conn: &mut Option<Conn>,
    awaiting: Vec<String>,
) -> anyhow::Result<bool> {
    let old = conn.take().context("no connection")?;
    let (session, generation, serial, number) =
        (old.session.clone(), old.generation, old.serial, old.number);
    drop(old);
    for attempt in 0..5 {
        tokio::time::sleep(Duration::from_millis(100 * (attempt + 1))).await;
        let mut fresh = connect(shared, number).await?;
        fresh
            .client
            .send(&ClientMessage::Resume(ResumeRequest {
                session: session.clone(),
                awaiting: awaiting.clone(),
            }))
            .await?;
        match fresh.client.recv().await? {
            ServerMessage::Resumed(r) if r.session == session => {
                fresh.session = session;
                fresh.generation = generation;
                fresh.serial = serial;
                *conn = Some(fresh);
                return Ok(true);
            }
            ServerMessage::Error(e) if e.code == ErrorCode::NotFound => {
                if shared.generation.load(Ordering::SeqCst) != generation {
                    shared.note_expected("resume refused after the restart");
                    fresh.serial = serial;
                    *conn = Some(fresh);
                    return Ok(false);
                }
                // The daemon may not have seen the drop yet: try again.
            }
            other => bail!("expected resumed, got {other:?}"),
        }
    }
    bail!("resume of {session} refused 5 times with no restart in between")
}

fn conn(c: &mut Option<Conn>) -> anyhow::Result<&mut Conn> {
    c.as_mut().context("no connection")
}

/// `exec` of an echo: its output and latency.
async fn op_exec(shared: &Shared, c: &mut Option<Conn>) -> anyhow::Result<()> {
    let conn = conn(c)?;
    let id = conn.id("exec");
    let mut req = crate::client::request(id.clone(), &format!("echo {id}"), "");
    req.profile = None;
    req.env = shared.env();
    let t0 = Instant::now();
    let (result, _) = conn.client.run(req).await?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    if result.returncode != 0 || result.output != format!("{id}\n") {
        bail!("exec {id}: {} {:?}", result.returncode, result.output);
    }
    if let Ok(mut t) = shared.tally.lock() {
        t.exec_ms.push(ms);
    }
    Ok(())
}

/// The counter's whole output: "1\n2\n...COUNT\n".
fn counter_expected() -> Vec<u8> {
    (1..=COUNT)
        .map(|i| format!("{i}\n"))
        .collect::<String>()
        .into_bytes()
}

/// Read a counter process from `offset` to its end, checking that each reply starts where it
/// was asked (or later by exactly `dropped`); stop early, before the end, after `stop_at`
/// bytes if given. Returns the bytes read and the offset reached.
async fn read_counter(
    conn: &mut Conn,
    id: &str,
    mut offset: u64,
    got: &mut Vec<u8>,
    dropped: &mut u64,
    stop_at: Option<u64>,
) -> anyhow::Result<u64> {
    let give_up = Instant::now() + Duration::from_secs(120);
    loop {
        let out = conn.read(id, offset).await?;
        if out.offset != offset + out.dropped {
            bail!(
                "read from {offset} answered from {} with dropped {}",
                out.offset,
                out.dropped
            );
        }
        *dropped += out.dropped;
        got.extend(b64().decode(out.data.as_bytes())?);
        offset = out.next_offset;
        if out.eof {
            return Ok(offset);
        }
        if stop_at.is_some_and(|s| offset >= s) {
            return Ok(offset);
        }
        if Instant::now() > give_up {
            bail!("{id}: no end after 120 s at offset {offset}");
        }
    }
}

/// Check a counter's output read through `resumes` resumes: exactly 1..COUNT, or, when the
/// daemon said it dropped bytes, a tail of it.
fn check_counter(shared: &Shared, id: &str, got: &[u8], dropped: u64, resumed: bool) {
    let want = counter_expected();
    let ok = if dropped == 0 {
        got == want.as_slice()
    } else {
        want.ends_with(got) && got.len() as u64 + dropped == want.len() as u64
    };
    if !ok {
        let text = String::from_utf8_lossy(got);
        let lines: Vec<&str> = text.lines().collect();
        shared.integrity(format!(
            "{id}: {} bytes read (dropped {dropped}), {} wanted; first lines {:?}, last {:?}",
            got.len(),
            want.len(),
            &lines[..lines.len().min(3)],
            &lines[lines.len().saturating_sub(3)..]
        ));
    } else if let Ok(mut t) = shared.tally.lock() {
        t.checked_bytes += got.len() as u64;
        t.resumed_reads += u64::from(resumed);
    }
}

fn counter_command(pace: &str) -> String {
    format!("for i in $(seq 1 {COUNT}); do echo $i; {pace}done")
}

/// A counter process read whole by offset; `drop_after`: drop the connection after that many
/// bytes, resume, and read on from the last `next_offset`.
async fn op_counter(
    shared: &Shared,
    c: &mut Option<Conn>,
    drop_after: Option<u64>,
) -> anyhow::Result<()> {
    let pace = if drop_after.is_some() {
        "sleep 0.005; "
    } else {
        ""
    };
    let id = conn(c)?
        .spawn(shared, "count", counter_command(pace), false)
        .await?;
    let (mut got, mut dropped) = (Vec::new(), 0);
    let offset = read_counter(conn(c)?, &id, 0, &mut got, &mut dropped, drop_after).await?;
    if drop_after.is_some() && !drop_and_resume(shared, c, vec![]).await? {
        return Ok(());
    }
    read_counter(conn(c)?, &id, offset, &mut got, &mut dropped, None).await?;
    let (rc, info) = conn(c)?.wait(&id).await?;
    if rc != 0 {
        bail!("{id} exited {rc}: {info}");
    }
    check_counter(shared, &id, &got, dropped, drop_after.is_some());
    Ok(())
}

/// A PTY process reads a line typed on its terminal and answers it.
async fn op_pty(shared: &Shared, c: &mut Option<Conn>) -> anyhow::Result<()> {
    let conn = conn(c)?;
    let id = conn
        .spawn(shared, "pty", "read -r x; echo \"got-$x\"".into(), true)
        .await?;
    let word = format!("w{}", conn.serial);
    conn.write(&id, format!("{word}\n").as_bytes(), false)
        .await?;
    let (mut got, mut offset) = (Vec::new(), 0);
    loop {
        let out = conn.read(&id, offset).await?;
        got.extend(b64().decode(out.data.as_bytes())?);
        offset = out.next_offset;
        if out.eof {
            break;
        }
    }
    let text = String::from_utf8_lossy(&got);
    if !text.contains(&format!("got-{word}\r\n")) {
        bail!("{id}: the terminal showed {text:?}");
    }
    let (rc, info) = conn.wait(&id).await?;
    if rc != 0 {
        bail!("{id} exited {rc}: {info}");
    }
    Ok(())
}

/// `signal TERM` to a sleeping process's tree, or INT to its terminal's foreground group.
async fn op_signal(shared: &Shared, c: &mut Option<Conn>, pty: bool) -> anyhow::Result<()> {
    let conn = conn(c)?;
    let id = conn.spawn(shared, "sig", "sleep 60".into(), pty).await?;
    conn.client
        .send(&ClientMessage::Signal(SignalRequest {
            id: id.clone(),
            // To a terminal's foreground group: INT, as Ctrl-C (the kernel's TIOCSIG takes
            // only INT, QUIT and TSTP; TERM is refused with EINVAL).
            signal: if pty { "INT" } else { "TERM" }.into(),
            foreground: pty,
        }))
        .await?;
    match conn.next_for(&id).await? {
        ServerMessage::Done(_) => {}
        other => bail!("expected done, got {other:?}"),
    }
    let (rc, info) = conn.wait(&id).await?;
    if rc == 0 {
        bail!("{id} ended 0 after SIGTERM: {info}");
    }
    Ok(())
}

async fn upload_start(conn: &mut Conn, path: &str) -> anyhow::Result<String> {
    let id = conn.id("up");
    conn.client
        .send(&ClientMessage::Upload(UploadRequest {
            id: id.clone(),
            path: path.to_string(),
            mode: None,
            parents: true,
            tar: false,
            profile: None,
        }))
        .await?;
    Ok(id)
}

const CHUNK: usize = 128 * 1024;

async fn upload(conn: &mut Conn, path: &str, data: &[u8]) -> anyhow::Result<()> {
    let id = upload_start(conn, path).await?;
    let chunks: Vec<&[u8]> = data.chunks(CHUNK).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        conn.write(&id, chunk, i + 1 == chunks.len()).await?;
    }
    match conn.next_for(&id).await? {
        ServerMessage::Uploaded(up) if up.bytes == data.len() as u64 => Ok(()),
        other => bail!("upload {path}: got {other:?}"),
    }
}

/// Download `path` from `offset` into `got`; `stop_after` chunks: return early (Ok(false)).
async fn download(
    conn: &mut Conn,
    path: &str,
    got: &mut Vec<u8>,
    stop_after: Option<u64>,
) -> anyhow::Result<(String, bool)> {
    let id = conn.id("down");
    conn.client
        .send(&ClientMessage::Download(DownloadRequest {
            id: id.clone(),
            path: path.to_string(),
            offset: got.len() as u64,
            length: None,
            tar: false,
            profile: None,
        }))
        .await?;
    let mut seq = 0;
    loop {
        match conn.next_for(&id).await? {
            ServerMessage::DownloadData(chunk) => {
                if chunk.seq != seq {
                    bail!("{id}: seq {} where {seq} was due", chunk.seq);
                }
                seq += 1;
                got.extend(b64().decode(chunk.data.as_bytes())?);
                if stop_after.is_some_and(|s| seq >= s) {
                    return Ok((id, false));
                }
            }
            ServerMessage::Downloaded(_) => return Ok((id, true)),
            other => bail!("{id}: unexpected {other:?}"),
        }
    }
}

fn check_hash(shared: &Shared, what: &str, got: &[u8], want: &[u8]) {
    if sha(got) != sha(want) {
        shared.integrity(format!(
            "{what}: {} bytes with sha256 {}, sent {} bytes with {}",
            got.len(),
            sha(got),
            want.len(),
            sha(want)
        ));
    } else if let Ok(mut t) = shared.tally.lock() {
        t.checked_bytes += got.len() as u64;
    }
}

/// Upload random bytes, download them, compare.
async fn op_files(shared: &Shared, c: &mut Option<Conn>, rng: &mut Rng) -> anyhow::Result<()> {
    let conn = conn(c)?;
    let size = 16 * 1024 + rng.below(512 * 1024) as usize;
    let data = rng.bytes(size);
    let path = format!("soak/c{}.bin", conn.number);
    upload(conn, &path, &data).await?;
    let mut got = Vec::new();
    download(conn, &path, &mut got, None).await?;
    check_hash(shared, &path, &got, &data);
    Ok(())
}

/// Drop the connection half way through an upload, resume, send the rest: either it is
/// taken whole (checked by a download) or it failed with the drop (expected).
async fn op_drop_upload(
    shared: &Shared,
    c: &mut Option<Conn>,
    rng: &mut Rng,
) -> anyhow::Result<()> {
    let size = 4 * CHUNK + rng.below(CHUNK as u64) as usize;
    let data = rng.bytes(size);
    let path = format!("soak/c{}-dropped.bin", conn(c)?.number);
    let id = upload_start(conn(c)?, &path).await?;
    let chunks: Vec<&[u8]> = data.chunks(CHUNK).collect();
    conn(c)?.write(&id, chunks[0], false).await?;
    conn(c)?.write(&id, chunks[1], false).await?;
    if !drop_and_resume(shared, c, vec![id.clone()]).await? {
        return Ok(());
    }
    let conn = conn(c)?;
    for (i, chunk) in chunks.iter().enumerate().skip(2) {
        conn.write(&id, chunk, i + 1 == chunks.len()).await?;
    }
    match conn.next_for(&id).await {
        Ok(ServerMessage::Uploaded(up)) => {
            shared.note_expected("upload taken whole across a drop");
            let mut got = Vec::new();
            download(conn, &path, &mut got, None).await?;
            if up.bytes != data.len() as u64 {
                shared.integrity(format!("{id}: uploaded says {} bytes", up.bytes));
            }
            check_hash(shared, &path, &got, &data);
        }
        Ok(other) => bail!("{id}: got {other:?}"),
        Err(_) => shared.note_expected("upload failed by the drop"),
    }
    Ok(())
}

/// Drop the connection two chunks into a download, resume, download the rest by offset.
async fn op_drop_download(
    shared: &Shared,
    c: &mut Option<Conn>,
    rng: &mut Rng,
) -> anyhow::Result<()> {
    let size = 1024 * 1024 + rng.below(512 * 1024) as usize;
    let data = rng.bytes(size);
    let path = format!("soak/c{}-big.bin", conn(c)?.number);
    upload(conn(c)?, &path, &data).await?;
    let mut got = Vec::new();
    let (id, whole) = download(conn(c)?, &path, &mut got, Some(2)).await?;
    if whole {
        bail!("{id}: a download of {} bytes ended in 2 chunks", data.len());
    }
    if !drop_and_resume(shared, c, vec![id.clone()]).await? {
        return Ok(());
    }
    // The download's answer kept for the resume: its error (chunks not delivered before the
    // drop are not replayed), or `downloaded` if it was all sent before the drop.
    let conn = conn(c)?;
    let mut more = Vec::new();
    let mut seq = 2;
    let resumed = Instant::now();
    let completed = loop {
        // The answer is owed: `awaiting` named the download. It may take up to a minute: a
        // download finds its connection gone only at its next chunk, or after waiting 60 s
        // for one (forward_download in the daemon).
        let next = tokio::time::timeout(Duration::from_secs(75), conn.next_for(&id))
            .await
            .map_err(|_| anyhow!("{id}: no answer within 75 s of a resume awaiting it"))?;
        match next {
            Ok(ServerMessage::DownloadData(d)) if d.seq == seq => {
                seq += 1;
                more.extend(b64().decode(d.data.as_bytes())?);
            }
            Ok(ServerMessage::DownloadData(d)) if d.seq > seq => {
                // It went on on the new connection: the chunks written to the dropped one
                // are a gap in `seq`. The bytes before the gap are good; the rest is
                // downloaded again from there.
                shared.note_expected("download went on after the resume with a gap in seq");
                break false;
            }
            Ok(ServerMessage::DownloadData(d)) => {
                shared.integrity(format!("{id}: seq {} again after {seq}", d.seq));
                break false;
            }
            Ok(ServerMessage::Downloaded(_)) => break true,
            Ok(other) => bail!("{id}: after the resume: {other:?}"),
            Err(_) => {
                shared.note_expected("download failed by the drop");
                break false;
            }
        }
    };
    if resumed.elapsed() > Duration::from_secs(5) {
        shared.note_expected("download's answer came more than 5 s after the resume");
    }
    if completed {
        shared.note_expected("download completed across the drop");
    }
    got.extend(more);
    if got.len() < data.len() {
        download(conn, &path, &mut got, None).await?;
    }
    check_hash(shared, &format!("{path} across a drop"), &got, &data);
    Ok(())
}

/// A process found on the host by its command line and killed with SIGKILL.
async fn op_host_kill(shared: &Shared, c: &mut Option<Conn>) -> anyhow::Result<()> {
    let conn = conn(c)?;
    let marker = format!("soakkill-{}-{}-{}", shared.mark, conn.number, conn.serial);
    let id = conn
        .spawn(
            shared,
            "kill",
            format!(": {marker}; while :; do sleep 0.05; done"),
            false,
        )
        .await?;
    let give_up = Instant::now() + Duration::from_secs(20);
    loop {
        if kill_by_cmdline(&marker) > 0 {
            break;
        }
        if Instant::now() > give_up {
            bail!("{id}: no process with {marker} in its command line on the host");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (rc, info) = conn.wait(&id).await?;
    if rc == 0 {
        bail!("{id} ended 0 after SIGKILL: {info}");
    }
    Ok(())
}

async fn one_op(
    shared: &Shared,
    c: &mut Option<Conn>,
    kind: &str,
    rng: &mut Rng,
) -> anyhow::Result<()> {
    match kind {
        "exec" => op_exec(shared, c).await,
        "counter" => op_counter(shared, c, None).await,
        "pty" => op_pty(shared, c).await,
        "signal" => op_signal(shared, c, rng.below(2) == 0).await,
        "files" => op_files(shared, c, rng).await,
        "drop_process" => op_counter(shared, c, Some(200 + rng.below(800))).await,
        "drop_upload" => op_drop_upload(shared, c, rng).await,
        "drop_download" => op_drop_download(shared, c, rng).await,
        _ => op_host_kill(shared, c).await,
    }
}

async fn client_loop(shared: Arc<Shared>, number: usize) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (number as u64 + 1).wrapping_mul(0x2545_f491));
    let mut c: Option<Conn> = None;
    while Instant::now() < shared.deadline {
        // exec weighs three, the others one each.
        let pick = rng.below(KINDS.len() as u64 + 2) as usize;
        let kind = KINDS[pick.saturating_sub(2)];
        let generation = shared.generation.load(Ordering::SeqCst);
        if c.is_none() {
            match connect(&shared, number).await {
                Ok(fresh) => c = Some(fresh),
                Err(err) => {
                    record(&shared, kind, generation, Err(err));
                    continue;
                }
            }
        }
        let t0 = Instant::now();
        let res = tokio::time::timeout(
            Duration::from_secs(180),
            one_op(&shared, &mut c, kind, &mut rng),
        )
        .await
        .unwrap_or_else(|_| Err(anyhow!("no end within 180 s")));
        if res.is_err() {
            c = None;
        }
        if let Ok(mut t) = shared.tally.lock() {
            let ms = t.longest_ms.entry(kind).or_default();
            *ms = ms.max(t0.elapsed().as_secs_f64() * 1e3);
        }
        record(&shared, kind, generation, res);
    }
    if let Some(conn) = c {
        conn.client.close().await;
    }
}

fn record(shared: &Shared, kind: &'static str, generation: u64, res: anyhow::Result<()>) {
    let restarted = shared.generation.load(Ordering::SeqCst) != generation
        || shared.restarting.load(Ordering::SeqCst);
    let Ok(mut t) = shared.tally.lock() else {
        return;
    };
    match res {
        Ok(()) => *t.done.entry(kind).or_default() += 1,
        Err(_) if restarted => {
            *t.expected
                .entry(format!("{kind} interrupted by the restart"))
                .or_default() += 1;
        }
        Err(err) => {
            *t.unexpected.entry(kind).or_default() += 1;
            // Cut: a message may quote a whole chunk of data.
            let text: String = format!("{err:#}").chars().take(300).collect();
            eprintln!("soak: {kind} failed: {text}");
            if t.unexpected_samples.len() < 20 {
                t.unexpected_samples.push(format!("{kind}: {text}"));
            }
        }
    }
}

pub(crate) struct SoakReport {
    pub plan_seconds: f64,
    pub clients: usize,
    pub budget_mb: u64,
    pub seconds: f64,
    pub tally: Tally,
    pub rss_max_kib: u64,
    pub restart_s: f64,
    pub temp_files: Vec<PathBuf>,
    /// Uploaded files the walk for temporary files saw (it reached the workspaces).
    pub uploads_seen: usize,
    pub leftovers: Vec<String>,
    pub load: String,
}

impl SoakReport {
    pub fn broken(&self) -> Vec<String> {
        let mut out = Vec::new();
        let unexpected: u64 = self.tally.unexpected.values().sum();
        if unexpected > 0 {
            out.push(format!("{unexpected} operations failed unexpectedly"));
        }
        if !self.tally.integrity.is_empty() {
            out.push(format!(
                "{} outputs or files lost or repeated bytes",
                self.tally.integrity.len()
            ));
        }
        if !self.temp_files.is_empty() {
            out.push(format!(
                "upload temporary files left: {:?}",
                self.temp_files
            ));
        }
        if self.uploads_seen == 0 {
            out.push("the walk for temporary files saw none of the uploaded files".into());
        }
        if self.rss_max_kib > (self.budget_mb + RSS_OVERHEAD_MIB) * 1024 {
            out.push(format!(
                "daemon RSS reached {} MiB, past the budget {} MiB + {RSS_OVERHEAD_MIB} MiB",
                self.rss_max_kib / 1024,
                self.budget_mb
            ));
        }
        if !self.leftovers.is_empty() {
            out.push(format!(
                "processes of the daemon's commands left: {:?}",
                self.leftovers
            ));
        }
        for kind in KINDS {
            if self.tally.done.get(kind).copied().unwrap_or(0) == 0 {
                out.push(format!("no {kind} operation succeeded"));
            }
        }
        out
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub(crate) async fn run(executor: &Path, plan: &Plan) -> anyhow::Result<SoakReport> {
    let extra = vec![
        "--memory-budget-mb".to_string(),
        plan.budget_mb.to_string(),
        "--resume-grace".to_string(),
        "30".to_string(),
    ];
    let mut daemon = Daemon::start(executor, &extra)?;
    let (probe, hello) = Client::connect(&daemon.url, &daemon.token).await?;
    probe.close().await;
    let workspace = PathBuf::from(&hello.workspace);
    let state_dir = daemon.state_dir().to_path_buf();
    let started = Instant::now();
    let shared = Arc::new(Shared {
        url: Mutex::new(daemon.url.clone()),
        token: Mutex::new(daemon.token.clone()),
        generation: AtomicU64::new(0),
        restarting: AtomicBool::new(false),
        pid: AtomicU32::new(daemon.pid),
        mark: format!("soak{}", std::process::id()),
        deadline: started + Duration::from_secs_f64(plan.seconds),
        tally: Mutex::new(Tally::default()),
    });
    eprintln!(
        "soak: daemon pid {} at {}, {} clients for {} s, budget {} MiB",
        daemon.pid, daemon.url, plan.clients, plan.seconds, plan.budget_mb
    );
    // The daemon's RSS every 100 ms, whichever daemon runs.
    let rss_max = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (shared, rss_max) = (shared.clone(), rss_max.clone());
        tokio::spawn(async move {
            loop {
                let pid = shared.pid.load(Ordering::SeqCst);
                if let Some(kib) = status_kib(pid, "VmRSS") {
                    rss_max.fetch_max(kib, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let clients: Vec<_> = (0..plan.clients)
        .map(|n| tokio::spawn(client_loop(shared.clone(), n)))
        .collect();
    // Half way: SIGTERM, and the same state directory again.
    tokio::time::sleep(Duration::from_secs_f64(plan.seconds / 2.0)).await;
    eprintln!("soak: restarting the daemon");
    shared.restarting.store(true, Ordering::SeqCst);
    shared.generation.fetch_add(1, Ordering::SeqCst);
    let t0 = Instant::now();
    let (exe, flags) = (executor.to_path_buf(), extra.clone());
    daemon = tokio::task::spawn_blocking(move || daemon.restart(&exe, &flags).map(|()| daemon))
        .await??;
    let restart_s = t0.elapsed().as_secs_f64();
    *shared.url.lock().map_err(|_| anyhow!("poisoned"))? = daemon.url.clone();
    *shared.token.lock().map_err(|_| anyhow!("poisoned"))? = daemon.token.clone();
    shared.pid.store(daemon.pid, Ordering::SeqCst);
    shared.generation.fetch_add(1, Ordering::SeqCst);
    shared.restarting.store(false, Ordering::SeqCst);
    eprintln!(
        "soak: daemon back as pid {} at {} after {restart_s:.1} s",
        daemon.pid, daemon.url
    );
    for c in clients {
        c.await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let load = loadavg();
    // Settle: a failed upload's file goes at once, but the last drops may be in flight.
    tokio::time::sleep(Duration::from_secs(2)).await;
    sampler.abort();
    let (mut temps, mut uploads_seen) = temp_files(&state_dir);
    if !workspace.starts_with(&state_dir) {
        let (more, seen) = temp_files(&workspace);
        temps.extend(more);
        uploads_seen += seen;
    }
    let pid = daemon.pid;
    // Both daemons' log (the state directory goes with the daemon), for what failed.
    let log = std::env::temp_dir().join(format!("executor-soak-{}.log", std::process::id()));
    match std::fs::copy(state_dir.join("daemon.log"), &log) {
        Ok(_) => eprintln!("soak: the daemon's log is kept in {}", log.display()),
        Err(err) => eprintln!("soak: cannot keep the daemon's log: {err}"),
    }
    tokio::task::spawn_blocking(move || daemon.stop()).await??;
    // After the daemon stopped: nothing carrying our marker runs on the host.
    let left = leftovers(&shared.mark, pid);
    let tally = std::mem::take(&mut *shared.tally.lock().map_err(|_| anyhow!("poisoned"))?);
    Ok(SoakReport {
        plan_seconds: plan.seconds,
        clients: plan.clients,
        budget_mb: plan.budget_mb,
        seconds,
        tally,
        rss_max_kib: rss_max.load(Ordering::SeqCst),
        restart_s,
        temp_files: temps,
        uploads_seen,
        leftovers: left,
        load,
    })
}

pub(crate) fn markdown(r: &SoakReport) -> String {
    let t = &r.tally;
    let mut out = format!(
        "soak: {} clients, {:.0} s asked, {:.0} s run, one restart ({:.2} s), load average at the end {}\n\n",
        r.clients, r.plan_seconds, r.seconds, r.restart_s, r.load
    );
    out.push_str("| operation | done | unexpected errors | longest |\n|---|---|---|---|\n");
    for kind in KINDS {
        out.push_str(&format!(
            "| {kind} | {} | {} | {:.1} s |\n",
            t.done.get(kind).copied().unwrap_or(0),
            t.unexpected.get(kind).copied().unwrap_or(0),
            t.longest_ms.get(kind).copied().unwrap_or(0.0) / 1e3
        ));
    }
    out.push_str("\n| expected event | count |\n|---|---|\n");
    for (what, n) in &t.expected {
        out.push_str(&format!("| {what} | {n} |\n"));
    }
    let mut ms = t.exec_ms.clone();
    ms.sort_by(f64::total_cmp);
    let p = |q| percentile(&ms, q).unwrap_or(f64::NAN);
    out.push_str("\n| check | value |\n|---|---|\n");
    out.push_str(&format!(
        "| exec latency p50 / p99 | {:.1} / {:.1} ms ({} execs) |\n",
        p(50.0),
        p(99.0),
        ms.len()
    ));
    out.push_str(&format!(
        "| bytes checked (counters by offset, files by sha256) | {:.1} MiB |\n",
        t.checked_bytes as f64 / 1048576.0
    ));
    out.push_str(&format!(
        "| outputs read whole across a drop and resume | {} |\n",
        t.resumed_reads
    ));
    out.push_str(&format!(
        "| lost or repeated (outputs, files) | {} |\n",
        t.integrity.len()
    ));
    out.push_str(&format!(
        "| `.upload-` files left in the state dir / workspace (uploaded files the walk saw) | {} ({}) |\n",
        r.temp_files.len(),
        r.uploads_seen
    ));
    out.push_str(&format!(
        "| daemon RSS max (sampled every 100 ms) vs budget | {:.1} MiB vs {} MiB (+{RSS_OVERHEAD_MIB} allowed) |\n",
        r.rss_max_kib as f64 / 1024.0,
        r.budget_mb
    ));
    out.push_str(&format!(
        "| processes of its commands left after the daemon stopped | {} |\n",
        r.leftovers.len()
    ));
    for s in &t.unexpected_samples {
        out.push_str(&format!("\nunexpected: {s}"));
    }
    out
}
