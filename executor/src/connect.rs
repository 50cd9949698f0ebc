//! `executor connect URL`: for targets that accept no inbound connection (behind NAT, a
//! firewall). The daemon serves as usual, on a loopback port of its own, and dials out to the
//! agent's relay over TLS, pinning the relay's certificate: it keeps one connection waiting
//! there, and when the relay hands that connection a client (one byte, `g`), the connection
//! is joined to the daemon's own port and the next one is dialled. So the client speaks the
//! same protocol (HTTP upgrade, token, WebSocket) over the connection the executor opened.
//!
//! Each connection presents the daemon's token to the relay (inside TLS, to the pinned
//! certificate only), so a relay accepts no executor but its own and no impostor relay learns
//! the token. When the relay cannot be reached for `--give-up-after` seconds the daemon drains
//! and exits, as it does when its stdin closes.
//!
//! A waiting connection may die without a sound (a NAT entry expires, a route drops: no FIN,
//! no RST). The relay pings it (`p`, answered `p`; greeting version 2) and drops one that does
//! not answer; here, one that hears nothing for [`WAIT_DEADLINE`] is dropped and redialled.
//! TCP keepalive runs on every connection to the relay besides.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use sha2::Digest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::ServeArgs;

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

#[derive(Args)]
pub(crate) struct ConnectArgs {
    /// The relay, `wss://HOST:PORT` (as the agent prints it).
    url: String,
    /// SHA-256 fingerprint of the relay's certificate (`sha256:<hex>`): exactly that
    /// certificate is accepted.
    #[arg(long, value_name = "sha256:HEX")]
    tls_fingerprint: String,
    /// Seconds without reaching the relay after which the daemon drains and exits.
    #[arg(long, default_value_t = 60.0)]
    give_up_after: f64,
    /// Everything `serve` takes; `--token-file` is required (the relay checks it), and the
    /// daemon listens on a loopback port of its own whatever `--listen` says.
    #[command(flatten)]
    serve: ServeArgs,
}

/// Where to dial, and what to present.
#[derive(Clone)]
pub(crate) struct Relay {
    host: String,
    port: u16,
    /// `host` resolved once, before any command runs: a name lookup may load libc's modules
    /// for the sources `/etc/nsswitch.conf` names, which a command of a profile that writes
    /// `/etc` (task-container) could name for us (`accounts` says more).
    addrs: Vec<SocketAddr>,
    pin: [u8; 32],
    token: String,
    /// Tells this daemon's connections from another executor's at the relay.
    id: String,
    give_up_after: Duration,
}

pub(crate) fn run(args: ConnectArgs) -> anyhow::Result<()> {
    let mut serve = args.serve;
    let Some(token_file) = &serve.token_file else {
        bail!("executor connect needs --token-file: the relay checks the token");
    };
    let token = std::fs::read_to_string(token_file)
        .with_context(|| format!("cannot read {}", token_file.display()))?
        .trim()
        .to_string();
    let rest = args
        .url
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
    let pin = parse_pin(&args.tls_fingerprint)?;
    let addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), port))
        .with_context(|| format!("cannot resolve the relay's host {host:?}"))?
        .collect();
    if addrs.is_empty() {
        bail!("the relay's host {host:?} has no address");
    }
    let mut id = [0u8; 16];
    getrandom::fill(&mut id).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
    serve.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    serve.dial_out = Some(Relay {
        host,
        port,
        addrs,
        pin,
        token,
        id: hex::encode(id),
        give_up_after: Duration::try_from_secs_f64(args.give_up_after)
            .unwrap_or(Duration::from_secs(60)),
    });
    crate::serve::serve(serve)
}

fn parse_pin(text: &str) -> anyhow::Result<[u8; 32]> {
    let hex_part = text
        .trim()
        .to_ascii_lowercase()
        .trim_start_matches("sha256:")
        .replace(':', "");
    let bytes = hex::decode(&hex_part).context("--tls-fingerprint is not sha256:<hex>")?;
    bytes
        .try_into()
        .map_err(|_| anyhow::anyhow!("--tls-fingerprint must be 32 bytes of hex"))
}

/// Keep one connection waiting at the relay; join each one the relay hands a client to the
/// daemon's own port at `local`. Ends when the daemon shuts down, or shuts it down when the
/// relay stays out of reach.
pub(crate) async fn dial(relay: Relay, local: SocketAddr, shutdown: CancellationToken) {
    let config = match client_config(relay.pin) {
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

fn client_config(pin: [u8; 32]) -> anyhow::Result<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Pinned { pin, provider }))
        .with_no_client_auth();
    Ok(config)
}

/// Accepts exactly the certificate whose SHA-256 is the pin (names and dates aside); the
/// handshake's signatures are still checked, so the relay must hold its key.
#[derive(Debug)]
struct Pinned {
    pin: [u8; 32],
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let digest: [u8; 32] = sha2::Sha256::digest(end_entity.as_ref()).into();
        if digest == self.pin {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn pins_are_read_as_the_relay_prints_them() {
        let pin = format!("sha256:{}", "ab".repeat(32));
        assert_eq!(super::parse_pin(&pin).unwrap(), [0xab; 32]);
        assert!(super::parse_pin("sha256:abcd").is_err());
    }
}
