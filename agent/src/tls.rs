//! TLS towards `wss://` executors (rustls with the ring provider).
//!
//! Either the executor's certificate is pinned by its SHA-256 fingerprint (`--tls-fingerprint`,
//! `environment.tls_fingerprint`): exactly that certificate is accepted, whatever its names, issuer
//! or dates, which is what a self-signed `executor serve --tls` certificate needs. Or it is
//! verified as usual, against the WebPKI roots plus an optional extra CA (`--tls-ca`). The pin
//! itself (the fingerprint, the verifier) is the `pinning` crate's, shared with `executor
//! connect`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use tokio_tungstenite::Connector;

pub use pinning::Fingerprint;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(transparent)]
    Fingerprint(#[from] pinning::InvalidFingerprint),
    #[error("cannot read the CA file {path}: {source}")]
    ReadCa {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the CA file {path} holds no usable PEM certificate{reason}")]
    NoCa { path: PathBuf, reason: String },
    #[error("give either a TLS fingerprint to pin or a CA file, not both")]
    PinAndCa,
    #[error("cannot set up TLS: {0}")]
    Config(#[source] rustls::Error),
}

/// How to set up TLS for `wss://` URLs; plain `ws://` URLs use none of it.
#[derive(Clone)]
pub struct Tls {
    config: Arc<ClientConfig>,
    /// Whether the user asked for something (a pin, a CA), which a `ws://` URL would ignore.
    configured: bool,
}

impl Tls {
    /// From `--tls-fingerprint` / `--tls-ca` (or their config keys).
    pub fn new(fingerprint: Option<&str>, ca: Option<&Path>) -> Result<Self, TlsError> {
        let config = match (fingerprint, ca) {
            (Some(_), Some(_)) => return Err(TlsError::PinAndCa),
            (Some(pin), None) => {
                pinning::client_config(Fingerprint::parse(pin)?).map_err(TlsError::Config)?
            }
            (None, ca) => {
                let mut roots = RootCertStore::empty();
                roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
                if let Some(path) = ca {
                    add_ca_file(&mut roots, path)?;
                }
                let provider = Arc::new(rustls::crypto::ring::default_provider());
                ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .map_err(TlsError::Config)?
                    .with_root_certificates(roots)
                    .with_no_client_auth()
            }
        };
        Ok(Self {
            config: Arc::new(config),
            configured: fingerprint.is_some() || ca.is_some(),
        })
    }

    /// The connector for `url`: rustls with this configuration for `wss://`, none for `ws://`.
    /// A pin or CA with a `ws://` URL is refused rather than silently unused.
    pub fn connector(&self, url: &str) -> Result<Option<Connector>, String> {
        let scheme = url.split("://").next().unwrap_or_default();
        if scheme.eq_ignore_ascii_case("wss") {
            return Ok(Some(Connector::Rustls(self.config.clone())));
        }
        if self.configured {
            return Err(format!(
                "a TLS fingerprint or CA is configured but {url} is not a wss:// URL; the \
                 connection would not be encrypted"
            ));
        }
        Ok(None)
    }
}

impl Tls {
    /// A TLS handshake over `tcp` with `host`, checking the pin or CA exactly as a connection
    /// would; nothing is sent after it. `Err` says why in a sentence (a refused certificate as
    /// [`certificate_refused`] says it).
    pub async fn handshake(&self, tcp: tokio::net::TcpStream, host: &str) -> Result<(), String> {
        let name = ServerName::try_from(host.to_string())
            .map_err(|e| format!("{host:?} is not a server name: {e}"))?;
        let connector = tokio_rustls::TlsConnector::from(self.config.clone());
        match connector.connect(name, tcp).await {
            Ok(_) => Ok(()),
            Err(io) => Err(io_certificate_refused(&io)
                .unwrap_or_else(|| format!("the TLS handshake failed: {io}"))),
        }
    }
}

fn add_ca_file(roots: &mut RootCertStore, path: &Path) -> Result<(), TlsError> {
    let pem = std::fs::read(path).map_err(|source| TlsError::ReadCa {
        path: path.to_path_buf(),
        source,
    })?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::NoCa {
            path: path.to_path_buf(),
            reason: format!(" ({e})"),
        })?;
    let (added, _ignored) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(TlsError::NoCa {
            path: path.to_path_buf(),
            reason: String::new(),
        });
    }
    Ok(())
}

/// If `err` is a refused certificate, say why in a sentence: connecting again cannot help, so
/// callers do not retry it.
pub fn certificate_refused(err: &tokio_tungstenite::tungstenite::Error) -> Option<String> {
    let tokio_tungstenite::tungstenite::Error::Io(io) = err else {
        return None;
    };
    io_certificate_refused(io)
}

/// [`certificate_refused`] for the I/O error of a handshake.
fn io_certificate_refused(io: &std::io::Error) -> Option<String> {
    let err = io.get_ref()?.downcast_ref::<rustls::Error>()?;
    let rustls::Error::InvalidCertificate(cert) = err else {
        return None;
    };
    if let Some(mismatch) = pinning::mismatch_in(err) {
        return Some(format!(
            "the executor presented a TLS certificate with fingerprint {}, but {} is pinned; \
             refusing to connect (if the executor's certificate was replaced on purpose, pin \
             the new one: `executor tls-fingerprint` on its host prints it)",
            mismatch.presented, mismatch.pinned
        ));
    }
    Some(format!(
        "the executor's TLS certificate was refused: {cert}; pin its fingerprint with \
         --tls-fingerprint (`executor tls-fingerprint` on its host prints it) or trust its CA \
         with --tls-ca"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "07157fa82463878b9dfbea67b3a71f613c05817af48bc0a55e20a87d56ac4704";

    #[test]
    fn a_pin_or_ca_is_refused_with_a_plain_ws_url_and_a_pin_excludes_a_ca() {
        let pinned = Tls::new(Some(HEX), None).unwrap();
        assert!(pinned.connector("wss://h:1/v1/ws").unwrap().is_some());
        let err = pinned.connector("ws://h:1/v1/ws").err().unwrap();
        assert!(err.contains("not a wss:// URL"), "{err}");
        let plain = Tls::new(None, None).unwrap();
        assert!(plain.connector("ws://h:1/v1/ws").unwrap().is_none());
        assert!(matches!(
            Tls::new(Some(HEX), Some(Path::new("/nonexistent"))),
            Err(TlsError::PinAndCa)
        ));
        assert!(matches!(
            Tls::new(None, Some(Path::new("/nonexistent/ca.pem"))),
            Err(TlsError::ReadCa { .. })
        ));
        assert!(matches!(
            Tls::new(Some("sha256:zz"), None),
            Err(TlsError::Fingerprint(_))
        ));
    }
}
