//! TLS towards `wss://` executors (rustls with the ring provider).
//!
//! Either the executor's certificate is pinned by its SHA-256 fingerprint (`--tls-fingerprint`,
//! `environment.tls_fingerprint`): exactly that certificate is accepted, whatever its names, issuer
//! or dates, which is what a self-signed `executor serve --tls` certificate needs. Or it is
//! verified as usual, against the WebPKI roots plus an optional extra CA (`--tls-ca`).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_tungstenite::Connector;

/// A certificate's SHA-256 digest, shown as `sha256:` and lowercase hex (the form
/// `executor serve --tls` prints).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    pub fn of(der: &[u8]) -> Self {
        let digest = ring::digest::digest(&ring::digest::SHA256, der);
        let mut bytes = [0u8; 32];
        bytes.copy_from_slice(digest.as_ref());
        Self(bytes)
    }

    /// Accept what operators paste: `sha256:<hex>` as the executor prints it, bare hex, hex
    /// with colons (`openssl x509 -fingerprint -sha256` prints `sha256 Fingerprint=AB:CD:...`),
    /// in either case.
    pub fn parse(text: &str) -> Result<Self, TlsError> {
        let invalid = || TlsError::Fingerprint(text.to_string());
        let trimmed = text.trim();
        let lower = trimmed.to_ascii_lowercase();
        let hex = ["sha256 fingerprint=", "sha256:", "sha256="]
            .iter()
            .find_map(|prefix| lower.strip_prefix(prefix))
            .unwrap_or(&lower);
        let digits: Vec<u8> = hex.bytes().filter(|&b| b != b':').collect();
        if digits.len() != 64 {
            return Err(invalid());
        }
        let mut bytes = [0u8; 32];
        for (byte, pair) in bytes.iter_mut().zip(digits.chunks(2)) {
            let pair = std::str::from_utf8(pair).map_err(|_| invalid())?;
            *byte = u8::from_str_radix(pair, 16).map_err(|_| invalid())?;
        }
        Ok(Self(bytes))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("sha256:")?;
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(
        "invalid TLS fingerprint {0:?}: expected sha256: and 64 hex digits (colons allowed), as \
         `executor tls-fingerprint` prints it"
    )]
    Fingerprint(String),
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

/// The pinned certificate was not the one presented.
#[derive(Debug, thiserror::Error)]
#[error(
    "the executor presented a TLS certificate with fingerprint {presented}, but {pinned} is \
     pinned; refusing to connect (if the executor's certificate was replaced on purpose, pin the \
     new one: `executor tls-fingerprint` on its host prints it)"
)]
pub struct PinMismatch {
    pub pinned: Fingerprint,
    pub presented: Fingerprint,
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
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Config)?;
        let config = match (fingerprint, ca) {
            (Some(_), Some(_)) => return Err(TlsError::PinAndCa),
            (Some(pin), None) => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(PinnedVerifier {
                    pinned: Fingerprint::parse(pin)?,
                    provider,
                }))
                .with_no_client_auth(),
            (None, ca) => {
                let mut roots = RootCertStore::empty();
                roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
                if let Some(path) = ca {
                    add_ca_file(&mut roots, path)?;
                }
                builder.with_root_certificates(roots).with_no_client_auth()
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

/// Accepts exactly the certificate whose SHA-256 is pinned. Names, issuer and validity dates
/// are not checked (a pinned self-signed certificate has no CA to vouch for them), but the
/// handshake signatures are: the server must hold the pinned certificate's private key.
#[derive(Debug)]
struct PinnedVerifier {
    pinned: Fingerprint,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let presented = Fingerprint::of(end_entity);
        // Digests of public data: a comparison that leaks timing gives nothing away.
        if presented == self.pinned {
            return Ok(ServerCertVerified::assertion());
        }
        let mismatch = PinMismatch {
            pinned: self.pinned,
            presented,
        };
        Err(rustls::Error::InvalidCertificate(CertificateError::Other(
            rustls::OtherError(Arc::new(mismatch)),
        )))
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
    let rustls::Error::InvalidCertificate(cert) = io.get_ref()?.downcast_ref::<rustls::Error>()?
    else {
        return None;
    };
    if let CertificateError::Other(other) = cert {
        if let Some(mismatch) = other.0.downcast_ref::<PinMismatch>() {
            return Some(mismatch.to_string());
        }
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
    fn fingerprints_parse_in_the_forms_operators_paste_and_print_canonically() {
        let canonical = format!("sha256:{HEX}");
        let colons: String = HEX
            .as_bytes()
            .chunks(2)
            .map(|p| std::str::from_utf8(p).unwrap().to_uppercase())
            .collect::<Vec<_>>()
            .join(":");
        for form in [
            canonical.clone(),
            HEX.to_string(),
            HEX.to_uppercase(),
            format!("SHA256:{}", HEX.to_uppercase()),
            colons.clone(),
            format!("sha256 Fingerprint={colons}"),
            format!("  sha256:{colons}\n"),
        ] {
            let parsed = Fingerprint::parse(&form).unwrap_or_else(|e| panic!("{form}: {e}"));
            assert_eq!(parsed.to_string(), canonical, "{form}");
        }
        for bad in [
            "",
            "sha256:",
            &HEX[..62],
            &format!("{HEX}00"),
            &format!("sha1:{HEX}"),
            &HEX.replace('a', "g"),
        ] {
            assert!(Fingerprint::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

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
