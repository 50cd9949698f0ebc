//! Certificate pinning for rustls clients, shared by the agent (`--tls-fingerprint` towards a
//! `wss://` executor) and the executor (`executor connect` towards the agent's relay).
//!
//! A pinned client accepts exactly the certificate whose SHA-256 it was given, whatever its
//! names, issuer or dates: what a self-signed certificate (`executor serve --tls`, the relay's)
//! needs, since no CA vouches for it. The handshake signatures are still checked, so the server
//! must hold the pinned certificate's private key.
//!
//! Its own crate, not a module of `protocol`: that crate is plain serde types, and this one
//! brings rustls and ring, which every user of the wire types should not pay for.
#![forbid(unsafe_code)]

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, SignatureScheme};

/// A certificate's SHA-256 digest, shown as `sha256:` and lowercase hex (the form
/// `executor serve --tls` and `executor tls-fingerprint` print).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint([u8; 32]);

/// Text that is no fingerprint; it carries the text as given.
#[derive(Debug, thiserror::Error)]
#[error(
    "invalid TLS fingerprint {0:?}: expected sha256: and 64 hex digits (colons allowed), as \
     `executor tls-fingerprint` prints it"
)]
pub struct InvalidFingerprint(pub String);

impl Fingerprint {
    /// The fingerprint of a DER certificate.
    pub fn of(der: &[u8]) -> Self {
        let digest = ring::digest::digest(&ring::digest::SHA256, der);
        let mut bytes = [0u8; 32];
        bytes.copy_from_slice(digest.as_ref());
        Self(bytes)
    }

    /// Accept what operators paste: `sha256:<hex>` as the executor prints it, bare hex, hex
    /// with colons (`openssl x509 -fingerprint -sha256` prints `sha256 Fingerprint=AB:CD:...`),
    /// in either case.
    pub fn parse(text: &str) -> Result<Self, InvalidFingerprint> {
        let invalid = || InvalidFingerprint(text.to_string());
        let lower = text.trim().to_ascii_lowercase();
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

/// The pinned certificate was not the one presented. The handshake fails with it inside
/// `rustls::Error::InvalidCertificate(CertificateError::Other(..))`, where [`mismatch_in`]
/// finds it again for a message that names both fingerprints.
#[derive(Debug, thiserror::Error)]
#[error(
    "the server presented a TLS certificate with fingerprint {presented}, but {pinned} is pinned"
)]
pub struct PinMismatch {
    pub pinned: Fingerprint,
    pub presented: Fingerprint,
}

/// The [`PinMismatch`] inside a failed handshake's rustls error, if that is why it failed.
pub fn mismatch_in(err: &rustls::Error) -> Option<&PinMismatch> {
    match err {
        rustls::Error::InvalidCertificate(CertificateError::Other(other)) => {
            other.0.downcast_ref::<PinMismatch>()
        }
        _ => None,
    }
}

/// A rustls client configuration (ring provider, safe default versions) that accepts exactly
/// the certificate `pin` names.
pub fn client_config(pin: Fingerprint) -> Result<ClientConfig, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedVerifier {
            pinned: pin,
            provider,
        }))
        .with_no_client_auth())
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
    fn the_fingerprint_of_a_certificate_is_its_sha256() {
        // SHA-256 of the empty input, a known vector.
        assert_eq!(
            Fingerprint::of(b"").to_string(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
