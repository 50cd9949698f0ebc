//! `reverse`: executors that dial out to us (`executor connect wss://HOST:PORT`), for targets
//! behind NAT that accept no inbound connection.
//!
//! We are the relay: a TLS listener with a certificate made here (its fingerprint pinned by
//! the executors) that takes connections presenting our token, grouped by the executor that
//! opened them; each executor keeps one waiting. A task takes a free executor, like a
//! `remote` pool, and gets a loopback port here: every client connection on it is joined to a
//! waiting connection of that executor (after a `g` telling the executor it is used), so the
//! client speaks the usual protocol to the executor, which dialled.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use futures_util::future::BoxFuture;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, Notify};
use tokio_rustls::server::TlsStream;

use super::{Deployed, Deployment, Handle, TaskSpec};
use crate::executor_client::Endpoint;

/// What the relay sends on a waiting connection when it hands it a client.
const GO: &[u8] = b"g";
/// What the relay sends on a waiting connection to check it is alive; an executor that
/// greets with version 2 answers it with the same byte.
const PING: u8 = b'p';
/// How often a waiting connection is pinged, and how long its answer may take: one that
/// fails is dropped, never handed to a client (a NAT entry expired, or the network dropped
/// silently: nothing else would ever tell us).
const HEARTBEAT: Duration = Duration::from_secs(10);
const PONG_PATIENCE: Duration = Duration::from_secs(10);
/// TCP keepalive on executors' connections (idle, interval, count).
const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_COUNT: u32 = 3;
/// A dialling executor must say who it is within this.
const GREETING_PATIENCE: Duration = Duration::from_secs(10);
/// A client connection waits this long for its executor's next waiting connection (longer
/// than one heartbeat exchange, which a hand-off waits for).
const HANDOFF_PATIENCE: Duration = Duration::from_secs(25);

type Stream = TlsStream<TcpStream>;

/// A waiting connection, kept alive by its own task (heartbeats); a client takes it by
/// sending a reply channel on `claim`, on which the task returns the stream.
struct Waiting {
    serial: u64,
    claim: oneshot::Sender<oneshot::Sender<Stream>>,
}

#[derive(Default)]
struct State {
    /// Waiting connections, by executor id, oldest first.
    waiting: HashMap<String, VecDeque<Waiting>>,
    /// Executors serving a task now.
    taken: HashSet<String>,
    /// Numbers the waiting connections, so a dead one's task can remove it.
    next_serial: u64,
}

pub struct Reverse {
    state: Arc<Mutex<State>>,
    changed: Arc<Notify>,
    token: String,
    token_file: PathBuf,
    _token_dir: tempfile::TempDir,
}

impl Reverse {
    /// Listen for executors on `listen`; `host` is the name they dial (default: its IP).
    pub fn start(listen: SocketAddr, host: Option<&str>) -> anyhow::Result<Self> {
        let key = rcgen::KeyPair::generate().context("cannot generate a TLS key")?;
        let mut params = rcgen::CertificateParams::new(vec!["agent-relay".to_string()])
            .context("cannot make certificate parameters")?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "agent relay (self-signed)");
        let cert = params
            .self_signed(&key)
            .context("cannot sign the certificate")?;
        let fingerprint = crate::tls::Fingerprint::of(cert.der()).to_string();
        let key_der = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der())
            .map_err(|e| anyhow::anyhow!("unusable key: {e}"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("TLS versions")?
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], key_der)
            .context("cannot use the relay's certificate")?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        // Bound here, before any task starts, so the address can be said at once.
        let listener = std::net::TcpListener::bind(listen)
            .with_context(|| format!("cannot listen for executors on {listen}"))?;
        listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(listener)?;
        let bound = listener.local_addr()?;
        let token = super::fresh_token()?;
        let (token_dir, token_file) = super::private_token_dir(&token)?;
        let state = Arc::new(Mutex::new(State::default()));
        let changed = Arc::new(Notify::new());
        let host = host
            .map(str::to_string)
            .unwrap_or_else(|| bound.ip().to_string());
        let url = format!("wss://{host}:{}", bound.port());
        tokio::spawn(accept_executors(
            listener,
            acceptor,
            token.clone(),
            state.clone(),
            changed.clone(),
        ));
        crate::notes::note!(
            "reverse: executors dial in with: executor connect {url} --tls-fingerprint {fingerprint} \
             --token-file {} (a copy of that token on the target)",
            token_file.display()
        );
        Ok(Self {
            state,
            changed,
            token,
            token_file,
            _token_dir: token_dir,
        })
    }
}

async fn accept_executors(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    token: String,
    state: Arc<Mutex<State>>,
    changed: Arc<Notify>,
) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let _ = tcp.set_nodelay(true);
        if let Err(err) = keepalive(&tcp) {
            tracing::debug!(%err, "cannot set TCP keepalive on an executor's connection");
        }
        let acceptor = acceptor.clone();
        let token = token.clone();
        let state = state.clone();
        let changed = changed.clone();
        tokio::spawn(async move {
            let greeted = tokio::time::timeout(GREETING_PATIENCE, async {
                let tls = acceptor.accept(tcp).await.ok()?;
                let mut reader = BufReader::new(tls);
                let mut line = String::new();
                // Bounded: a greeting is one short line.
                let mut limited = (&mut reader).take(512);
                limited.read_line(&mut line).await.ok()?;
                let mut words = line.split_whitespace();
                let (Some("executor-connect"), Some(version), Some(id), Some(presented)) =
                    (words.next(), words.next(), words.next(), words.next())
                else {
                    return None;
                };
                // Version 1 executors do not answer heartbeats.
                let heartbeats = match version {
                    "1" => false,
                    "2" => true,
                    _ => return None,
                };
                // Compared as digests, in constant time with respect to the token.
                let same = ring::digest::digest(&ring::digest::SHA256, presented.as_bytes())
                    .as_ref()
                    == ring::digest::digest(&ring::digest::SHA256, token.as_bytes()).as_ref();
                if !same || !reader.buffer().is_empty() {
                    return None;
                }
                Some((id.to_string(), heartbeats, reader.into_inner()))
            })
            .await;
            if let Ok(Some((id, heartbeats, tls))) = greeted {
                keep_waiting(id, heartbeats, tls, state, changed).await;
            }
        });
    }
}

/// Hold a waiting connection of executor `id` until a client claims it, pinging it every
/// [`HEARTBEAT`] (version 2 executors): one that does not answer within [`PONG_PATIENCE`] is
/// removed and dropped, and its executor, hearing no heartbeat, dials a new one.
async fn keep_waiting(
    id: String,
    heartbeats: bool,
    mut tls: Stream,
    state: Arc<Mutex<State>>,
    changed: Arc<Notify>,
) {
    let (claim, mut claimed) = oneshot::channel::<oneshot::Sender<Stream>>();
    let serial = {
        let Ok(mut s) = state.lock() else { return };
        s.next_serial += 1;
        let serial = s.next_serial;
        s.waiting
            .entry(id.clone())
            .or_default()
            .push_back(Waiting { serial, claim });
        serial
    };
    changed.notify_waiters();
    let alive = loop {
        tokio::select! {
            reply = &mut claimed => {
                if let Ok(reply) = reply {
                    // The client gets the stream; if it is gone meanwhile, so is this.
                    let _ = reply.send(tls);
                }
                return;
            }
            () = tokio::time::sleep(HEARTBEAT), if heartbeats => {
                if !ping(&mut tls).await {
                    break false;
                }
            }
        }
    };
    if !alive {
        tracing::info!(executor = %id, "a waiting connection missed its heartbeat: dropped");
        if let Ok(mut s) = state.lock() {
            if let Some(queue) = s.waiting.get_mut(&id) {
                queue.retain(|w| w.serial != serial);
            }
        }
    }
}

/// One heartbeat: PING, and the same byte back within [`PONG_PATIENCE`].
async fn ping(tls: &mut Stream) -> bool {
    let exchange = async {
        tls.write_all(&[PING]).await?;
        tls.flush().await?;
        let mut byte = [0u8; 1];
        let n = tls.read(&mut byte).await?;
        std::io::Result::Ok(n == 1 && byte[0] == PING)
    };
    matches!(
        tokio::time::timeout(PONG_PATIENCE, exchange).await,
        Ok(Ok(true))
    )
}

/// TCP keepalive on an executor's connection (see [`KEEPALIVE_IDLE`]).
fn keepalive(tcp: &TcpStream) -> nix::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    let secs = |d: Duration| u32::try_from(d.as_secs()).unwrap_or(u32::MAX);
    setsockopt(tcp, sockopt::KeepAlive, &true)?;
    setsockopt(tcp, sockopt::TcpKeepIdle, &secs(KEEPALIVE_IDLE))?;
    setsockopt(tcp, sockopt::TcpKeepInterval, &secs(KEEPALIVE_INTERVAL))?;
    setsockopt(tcp, sockopt::TcpKeepCount, &KEEPALIVE_COUNT)?;
    Ok(())
}

impl Deployment for Reverse {
    fn kind(&self) -> &'static str {
        "reverse"
    }

    fn start<'a>(&'a self, _task: &'a TaskSpec) -> BoxFuture<'a, anyhow::Result<Deployed>> {
        Box::pin(async move {
            // A free executor that has a connection waiting; wait for one to dial in.
            let id = loop {
                let notified = self.changed.notified();
                let free = {
                    let mut s = self
                        .state
                        .lock()
                        .map_err(|_| anyhow::anyhow!("relay state poisoned"))?;
                    let taken = s.taken.clone();
                    let found = s
                        .waiting
                        .iter()
                        .find(|(id, q)| !q.is_empty() && !taken.contains(*id))
                        .map(|(id, _)| id.clone());
                    if let Some(id) = &found {
                        s.taken.insert(id.clone());
                    }
                    found
                };
                if let Some(id) = free {
                    break id;
                }
                notified.await;
            };
            // The guard exists from the moment the executor is marked taken: whatever ends
            // this start early (the deadline, Ctrl-C dropping the future at the await below,
            // an error) frees it again.
            let mut taken = Taken {
                id: id.clone(),
                state: self.state.clone(),
                changed: self.changed.clone(),
                task: None,
            };
            let local = TcpListener::bind("127.0.0.1:0")
                .await
                .context("cannot listen on loopback")?;
            let port = local.local_addr()?.port();
            taken.task = Some(tokio::spawn(hand_clients(
                local,
                id.clone(),
                self.state.clone(),
                self.changed.clone(),
            )));
            Ok(Deployed {
                endpoint: Endpoint {
                    url: format!("ws://127.0.0.1:{port}{}", protocol::WS_PATH),
                    token: Some(self.token.clone()),
                    token_file: Some(self.token_file.clone()),
                    tls_fingerprint: None,
                    tls_ca: None,
                },
                kind: "reverse",
                id: id.clone(),
                owned: false,
                local_fs: false,
                handle: Box::new(taken),
            })
        })
    }
}

/// Join every client on `local` to a waiting connection of executor `id`.
async fn hand_clients(
    local: TcpListener,
    id: String,
    state: Arc<Mutex<State>>,
    changed: Arc<Notify>,
) {
    while let Ok((mut client, _)) = local.accept().await {
        let _ = client.set_nodelay(true);
        let id = id.clone();
        let state = state.clone();
        let changed = changed.clone();
        tokio::spawn(async move {
            let waiting = tokio::time::timeout(HANDOFF_PATIENCE, async {
                loop {
                    let notified = changed.notified();
                    let next = state
                        .lock()
                        .ok()
                        .and_then(|mut s| s.waiting.get_mut(&id).and_then(VecDeque::pop_front));
                    if let Some(waiting) = next {
                        // Its task hands the stream over after any heartbeat in flight; a
                        // task that found it dead has ended: try the next.
                        let (reply, stream) = oneshot::channel();
                        if waiting.claim.send(reply).is_ok() {
                            if let Ok(conn) = stream.await {
                                return conn;
                            }
                        }
                        continue;
                    }
                    notified.await;
                }
            })
            .await;
            let Ok(mut conn) = waiting else { return };
            if conn.write_all(GO).await.is_err() || conn.flush().await.is_err() {
                return;
            }
            let _ = tokio::io::copy_bidirectional(&mut client, &mut conn).await;
        });
    }
}

/// An executor serving a task: freed (its loopback port closed) when the task ends.
struct Taken {
    id: String,
    state: Arc<Mutex<State>>,
    changed: Arc<Notify>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Taken {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
        if let Ok(mut s) = self.state.lock() {
            s.taken.remove(&self.id);
        }
        self.changed.notify_waiters();
    }
}

impl Handle for Taken {
    fn stop(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move { drop(self) })
    }
}
