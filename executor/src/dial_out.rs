//! The daemon's side of `executor connect`: it keeps one connection waiting at the agent's
//! relay, over TLS to the relay's pinned certificate, and when the relay hands that
//! connection a client (one byte, `g`), the connection is joined to the daemon's own port and
//! the next one is dialled. Below `serve`, which starts it, and `connect`, which says where.
//!
//! Each connection presents the daemon's token to the relay (inside TLS, to the pinned
//! certificate only), so a relay accepts no executor but its own and no impostor relay learns
//! the token. When the relay cannot be reached for the give-up time the daemon is shut down.
//!
//! A waiting connection may die without a sound (a NAT entry expires, a route drops: no FIN,
//! no RST). The relay pings it (`p`, answered `p`; greeting version 2) and drops one that does
//! not answer; here, one that hears nothing for [`WAIT_DEADLINE`] is dropped and redialled.
//! TCP keepalive runs on every connection to the relay besides.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use pinning::Fingerprint;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// What the relay sends to hand a waiting connection a client.
const GO: u8 = b'g';
/// What the relay sends on a waiting connection to check it is alive; answered with the same
/// byte. Only between the greeting and GO: afterwards every byte is the client's.
const PING: u8 = b'p';
/// The greeting's version: 2 answers the relay's heartbeats (1 did not).
const GREETING_VERSION: u32 = 2;
/// A waiting connection that hears nothing from the relay (no heartbeat, no GO) for this long
/// is dead, as after a NAT entry expired or a silent network drop (no FIN, no RST would
/// ever come): dropped and redialled. Three of the relay's heartbeats.
const WAIT_DEADLINE: Duration = Duration::from_secs(30);
/// TCP keepalive: probes after this idle time, then every interval, dead after the count
/// (a half-open connection ends within about 30 s of silence beyond the idle time, and NAT
/// entries see traffic). The heartbeat covers what keepalive cannot (a relay process that
/// stopped serving), and a peer's kernel that answers probes for a dead process.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_COUNT: u32 = 3;
/// Longest wait between two dial attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// A TCP connect plus TLS handshake that takes longer failed.
const DIAL_PATIENCE: Duration = Duration::from_secs(10);

/// Where to dial, and what to present.
#[derive(Clone)]
pub(crate) struct Relay {
    host: String,
    port: u16,
    /// `host` resolved once, before any command runs: a name lookup may load libc's modules
    /// for the sources `/etc/nsswitch.conf` names, which a command of a profile that writes
    /// `/etc` (task-container) could name for us (`accounts` says more).
    addrs: Vec<SocketAddr>,
    pin: Fingerprint,
    token: String,
    /// Tells this daemon's connections from another executor's at the relay.
    id: String,
    give_up_after: Duration,
}

impl Relay {
    /// The relay at `url` (`wss://HOST:PORT`), its host resolved now; `pin` is its
    /// certificate's, `token` what this daemon presents to it.
    pub(crate) fn resolve(
        url: &str,
        pin: Fingerprint,
        token: String,
        give_up_after: Duration,
    ) -> anyhow::Result<Self> {
        let rest = url
            .strip_prefix("wss://")
            .context("the relay URL must be wss://HOST:PORT")?;
        let hostport = rest.split('/').next().unwrap_or_default();
        let (host, port) = hostport
            .rsplit_once(':')
            .context("the relay URL needs a port")?;
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let port: u16 = port
            .parse()
            .context("the relay URL's port is not a number")?;
        let addrs: Vec<SocketAddr> =
            std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), port))
                .with_context(|| format!("cannot resolve the relay's host {host:?}"))?
                .collect();
        if addrs.is_empty() {
            bail!("the relay's host {host:?} has no address");
        }
        let mut id = [0u8; 16];
        getrandom::fill(&mut id).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
        Ok(Self {
            host,
            port,
            addrs,
            pin,
            token,
            id: hex::encode(id),
            give_up_after,
        })
    }
}

/// Keep one connection waiting at the relay; join each one the relay hands a client to the
/// daemon's own port at `local`. Ends when the daemon shuts down, or shuts it down when the
/// relay stays out of reach.
pub(crate) async fn dial(relay: Relay, local: SocketAddr, shutdown: CancellationToken) {
    let config = match pinning::client_config(relay.pin) {
        Ok(c) => c,
        Err(err) => {
            tracing::error!(%err, "cannot set up TLS towards the relay");
            shutdown.cancel();
            return;
        }
    };
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    // The name is not checked (the pin is); any valid one does.
    let name = ServerName::try_from(relay.host.clone())
        .unwrap_or(ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()));
    let mut backoff = Duration::from_millis(100);
    let mut failing_since: Option<Instant> = None;
    tracing::info!(relay = %format!("{}:{}", relay.host, relay.port), "dialling out to the relay");
    loop {
        let attempt = tokio::time::timeout(DIAL_PATIENCE, async {
            let tcp = TcpStream::connect(relay.addrs.as_slice()).await?;
            let _ = tcp.set_nodelay(true);
            if let Err(err) = keepalive(&tcp) {
                tracing::debug!(%err, "cannot set TCP keepalive towards the relay");
            }
            let mut tls = connector.connect(name.clone(), tcp).await?;
            tls.write_all(
                format!(
                    "executor-connect {GREETING_VERSION} {} {}\n",
                    relay.id, relay.token
                )
                .as_bytes(),
            )
            .await?;
            tls.flush().await?;
            std::io::Result::Ok(tls)
        });
        let connected = tokio::select! {
            c = attempt => c,
            () = shutdown.cancelled() => return,
        };
        // Wait for a client, answering heartbeats. Anything but GO or PING, or silence past
        // the deadline, means the relay is gone, refused us (a wrong token) or the path to it
        // died: all count as not reaching it, and the next connection is dialled.
        let handed = match connected {
            Ok(Ok(tls)) => {
                let waited = tokio::select! {
                    w = wait_for_client(tls) => w,
                    () = shutdown.cancelled() => return,
                };
                match waited {
                    Ok(tls) => Some(tls),
                    Err(err) => {
                        tracing::info!(%err, "the waiting connection to the relay ended");
                        None
                    }
                }
            }
            Ok(Err(err)) => {
                tracing::debug!(%err, "cannot reach the relay");
                None
            }
            Err(_) => None,
        };
        let Some(mut tls) = handed else {
            let since = *failing_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= relay.give_up_after {
                tracing::warn!("the relay stayed out of reach: shutting down");
                shutdown.cancel();
                return;
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = shutdown.cancelled() => return,
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
            continue;
        };
        failing_since = None;
        backoff = Duration::from_millis(100);
        tokio::spawn(async move {
            let Ok(mut daemon) = TcpStream::connect(local).await else {
                return;
            };
            let _ = daemon.set_nodelay(true);
            let _ = tokio::io::copy_bidirectional(&mut tls, &mut daemon).await;
        });
    }
}

type RelayStream = tokio_rustls::client::TlsStream<TcpStream>;

/// Read the relay's bytes on a waiting connection until GO: answer each PING, and give up
/// when nothing comes within [`WAIT_DEADLINE`].
async fn wait_for_client(mut tls: RelayStream) -> std::io::Result<RelayStream> {
    use std::io::{Error, ErrorKind};
    loop {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(WAIT_DEADLINE, tls.read(&mut byte))
            .await
            .map_err(|_| Error::new(ErrorKind::TimedOut, "no heartbeat from the relay"))??;
        match (read, byte[0]) {
            (1, GO) => return Ok(tls),
            (1, PING) => {
                tls.write_all(&[PING]).await?;
                tls.flush().await?;
            }
            (0, _) => return Err(Error::new(ErrorKind::UnexpectedEof, "the relay closed")),
            (_, other) => {
                return Err(Error::new(
                    ErrorKind::InvalidData,
                    format!("unexpected byte {other:#x} from the relay"),
                ))
            }
        }
    }
}

/// TCP keepalive on a connection to the relay (see [`KEEPALIVE_IDLE`]).
fn keepalive(tcp: &TcpStream) -> nix::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    setsockopt(tcp, sockopt::KeepAlive, &true)?;
    setsockopt(tcp, sockopt::TcpKeepIdle, &secs(KEEPALIVE_IDLE))?;
    setsockopt(tcp, sockopt::TcpKeepInterval, &secs(KEEPALIVE_INTERVAL))?;
    setsockopt(tcp, sockopt::TcpKeepCount, &KEEPALIVE_COUNT)?;
    Ok(())
}

fn secs(d: Duration) -> u32 {
    u32::try_from(d.as_secs()).unwrap_or(u32::MAX)
}
