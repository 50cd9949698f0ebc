//! The soak's connections: a client's session on a daemon that may restart, dropped and
//! resumed; the shared tally.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use base64::Engine;
use protocol::{
    ClientMessage, ErrorCode, PtySize, ResumeRequest, ServerMessage, SpawnRequest, WaitRequest,
    WriteRequest,
};
use sha2::{Digest, Sha256};

use crate::client::Client;
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

pub(crate) struct Shared {
    pub(crate) url: Mutex<String>,
    pub(crate) token: Mutex<String>,
    /// Bumped when the daemon is stopped for its restart and again once it is back.
    pub(crate) generation: AtomicU64,
    pub(crate) restarting: AtomicBool,
    pub(crate) pid: AtomicU32,
    pub(crate) mark: String,
    pub(crate) deadline: Instant,
    pub(crate) tally: Mutex<Tally>,
}

impl Shared {
    pub(crate) fn note_expected(&self, what: &str) {
        if let Ok(mut t) = self.tally.lock() {
            *t.expected.entry(what.to_string()).or_default() += 1;
        }
    }

    pub(crate) fn integrity(&self, what: String) {
        eprintln!("soak: INTEGRITY: {what}");
        if let Ok(mut t) = self.tally.lock() {
            t.integrity.push(what);
        }
    }

    pub(crate) fn env(&self) -> BTreeMap<String, String> {
        [("EXECUTOR_SOAK".to_string(), self.mark.clone())].into()
    }
}

/// A connection and its session.
pub(crate) struct Conn {
    pub(crate) client: Client,
    pub(crate) session: String,
    /// The daemon generation it was made under.
    pub(crate) generation: u64,
    pub(crate) serial: u64,
    pub(crate) number: usize,
}

impl Conn {
    pub(crate) fn id(&mut self, what: &str) -> String {
        self.serial += 1;
        format!("c{}-{what}-{}", self.number, self.serial)
    }

    /// The next message about `id`; an `error` for it is an error here.
    pub(crate) async fn next_for(&mut self, id: &str) -> anyhow::Result<ServerMessage> {
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

    pub(crate) async fn spawn(
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
                network: None,
            }))
            .await?;
        match self.next_for(&id).await? {
            ServerMessage::Spawned(_) => Ok(id),
            other => bail!("expected spawned, got {other:?}"),
        }
    }

    pub(crate) async fn write(&mut self, id: &str, data: &[u8], eof: bool) -> anyhow::Result<()> {
        self.client
            .send(&ClientMessage::Write(WriteRequest {
                id: id.to_string(),
                data: (!data.is_empty()).then(|| b64().encode(data)),
                text: None,
                eof,
            }))
            .await
    }

    pub(crate) async fn read(
        &mut self,
        id: &str,
        offset: u64,
    ) -> anyhow::Result<protocol::ProcessOutput> {
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
    pub(crate) async fn wait(&mut self, id: &str) -> anyhow::Result<(i32, String)> {
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
pub(crate) fn about(msg: &ServerMessage) -> Option<&str> {
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

pub(crate) fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

pub(crate) fn sha(data: &[u8]) -> String {
    format!("{:x}", Sha256::digest(data))
}

/// xorshift64: the mix of operations and file contents, reproducible per client.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub(crate) fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// A fresh connection, waiting out a restart.
pub(crate) async fn connect(shared: &Shared, number: usize) -> anyhow::Result<Conn> {
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
pub(crate) async fn drop_and_resume(
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

pub(crate) fn conn(c: &mut Option<Conn>) -> anyhow::Result<&mut Conn> {
    c.as_mut().context("no connection")
}
