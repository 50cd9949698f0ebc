//! TLS with a pinned certificate, as the agent does it: the tests' own verifier (accept
//! exactly the certificate with a given SHA-256 fingerprint, still check the handshake).

use std::net::SocketAddr;

use tokio::net::TcpStream;

use crate::PATIENCE;

/// A raw HTTP/1.1 GET over TLS, accepting only the certificate with fingerprint `pin`.
pub async fn https_get(addr: SocketAddr, path: &str, pin: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let tcp = TcpStream::connect(addr).await?;
    let connector = tokio_rustls::TlsConnector::from(pinned_config(pin));
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut stream = connector.connect(name, tcp).await?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(req.as_bytes()).await?;
    let mut out = Vec::new();
    // The daemon closes without a TLS close_notify; what arrived before counts.
    let _ = tokio::time::timeout(PATIENCE, stream.read_to_end(&mut out))
        .await
        .map_err(|_| std::io::Error::other("timeout"))?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// `sha256:` and lowercase hex of the SHA-256 of a DER certificate, as the daemon prints it.
pub fn fingerprint_of_der(der: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, der);
    let hex: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// The fingerprint of the first certificate of a PEM file.
pub fn fingerprint_of_pem_file(path: &std::path::Path) -> String {
    use rustls::pki_types::pem::PemObject;
    let cert = rustls::pki_types::CertificateDer::pem_file_iter(path)
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    fingerprint_of_der(&cert)
}

/// A rustls client configuration that accepts exactly the certificate with fingerprint `pin`
/// (and still checks the handshake signatures). The agent has its own; this one is the tests'.
pub fn pinned_config(pin: &str) -> std::sync::Arc<rustls::ClientConfig> {
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(std::sync::Arc::new(PinnedVerifier {
            pin: pin.to_string(),
            provider,
        }))
        .with_no_client_auth();
    std::sync::Arc::new(config)
}

#[derive(Debug)]
struct PinnedVerifier {
    pin: String,
    provider: std::sync::Arc<rustls::crypto::CryptoProvider>,
}

impl rustls::client::danger::ServerCertVerifier for PinnedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let presented = fingerprint_of_der(end_entity);
        if presented == self.pin {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "pinned {} but the server presented {presented}",
                self.pin
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
