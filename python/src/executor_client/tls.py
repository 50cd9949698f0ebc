"""TLS towards `wss://` executors: a pinned certificate, or the usual verification.

**Pinning** (`tls_fingerprint`) accepts exactly the certificate whose DER has that SHA-256
digest, whatever its names, issuer or dates, as the Rust agent does; that is what the
self-signed certificate of `executor serve --tls` needs. Python's `ssl` has no hook to replace
certificate verification, and a CA store holding the pinned certificate would need the
certificate itself (we have only its digest) and would still check its dates and key usage.
So chain verification is turned off (`CERT_NONE`, no host name check) and the pin is checked
on the certificate the peer presented, inside the handshake step itself: the context returns
socket and memory-BIO objects of ours (`SSLContext.sslsocket_class`, `sslobject_class`, both
documented hooks) whose `do_handshake` compares the digest as soon as the handshake completes
and fails it otherwise. Nothing has been sent over the connection by then, so the token in the
upgrade request never reaches an impostor. OpenSSL still verifies the handshake signature
(TLS 1.3 CertificateVerify, TLS 1.2 ServerKeyExchange) with the presented certificate's key
whatever the verify mode, so the peer must hold the pinned certificate's private key: a copy of
the certificate alone does not pass.

Without a pin, the certificate is verified as usual against the system's CAs, plus `tls_ca`.
"""

from __future__ import annotations

import hashlib
import ssl
from typing import Any

_PREFIXES = ("sha256 fingerprint=", "sha256:", "sha256=")


def parse_fingerprint(text: str) -> str:
    """Normalise a fingerprint to `sha256:<64 lowercase hex>`.

    Accepts what operators paste: `sha256:<hex>` as the executor prints it, bare hex, or hex
    with colons in either case (`openssl x509 -noout -fingerprint -sha256` prints
    `sha256 Fingerprint=AB:CD:...`).
    """
    lower = text.strip().lower()
    for prefix in _PREFIXES:
        if lower.startswith(prefix):
            lower = lower[len(prefix) :]
            break
    digits = lower.replace(":", "")
    if len(digits) != 64 or any(c not in "0123456789abcdef" for c in digits):
        raise ValueError(
            f"invalid TLS fingerprint {text!r}: expected sha256: and 64 hex digits (colons "
            "allowed), as `executor tls-fingerprint` prints it"
        )
    return "sha256:" + digits


def fingerprint_of(der: bytes) -> str:
    """The fingerprint of a DER certificate, as the executor prints it."""
    return "sha256:" + hashlib.sha256(der).hexdigest()


class PinRefused(ssl.SSLCertVerificationError):
    """Raised inside the handshake; the client turns it into `PinMismatchError`.

    An `ssl.SSLError` so that asyncio's SSL transport fails the handshake with it as with any
    certificate error (another exception type would escape as a fatal protocol error).
    """

    def __init__(self, pinned: str, presented: str) -> None:
        super().__init__(f"certificate {presented} is not the pinned {pinned}")
        self.pinned = pinned
        self.presented = presented


def _check_pin(pinned: str, der: bytes | None) -> None:
    presented = fingerprint_of(der) if der else "(no certificate)"
    if presented != pinned:
        raise PinRefused(pinned, presented)


class _PinnedSSLSocket(ssl.SSLSocket):
    """Blocking sockets (the sync path of `websockets`, `ssl.wrap_socket`)."""

    _pin: str

    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        _check_pin(self._pin, self.getpeercert(binary_form=True))


class _PinnedSSLObject(ssl.SSLObject):
    """Memory-BIO objects (asyncio's SSL transport, used by `websockets.asyncio`)."""

    _pin: str

    def do_handshake(self) -> None:
        # Raises SSLWantReadError until the handshake is complete; the check runs once.
        super().do_handshake()
        _check_pin(self._pin, self.getpeercert(binary_form=True))


def pinned_context(fingerprint: str) -> ssl.SSLContext:
    """A client context that accepts exactly the certificate with this fingerprint."""
    pin = parse_fingerprint(fingerprint)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    # Subclasses per context, so that two clients pinning different certificates in one
    # process never see each other's pin.
    socket_class: Any = type("PinnedSSLSocket", (_PinnedSSLSocket,), {"_pin": pin})
    object_class: Any = type("PinnedSSLObject", (_PinnedSSLObject,), {"_pin": pin})
    context.sslsocket_class = socket_class
    context.sslobject_class = object_class
    return context


def client_context(fingerprint: str | None, ca_file: str | None) -> ssl.SSLContext:
    """The context for a `wss://` URL: pinned, or verified (system CAs plus `ca_file`)."""
    if fingerprint and ca_file:
        raise ValueError("give either a TLS fingerprint to pin or a CA file, not both")
    if fingerprint:
        return pinned_context(fingerprint)
    context = ssl.create_default_context()
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_file:
        context.load_verify_locations(cafile=ca_file)
    return context
