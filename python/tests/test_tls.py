"""`wss://` with a pinned certificate, against a real `executor serve --tls`."""

from __future__ import annotations

import http.client
import shutil
import socket
import ssl
import threading
from pathlib import Path

import pytest

from executor_client import Client, ConnectError, PinMismatchError, fingerprint_of
from executor_client.tls import PinRefused, parse_fingerprint, pinned_context


def cert_der(daemon) -> bytes:
    pem = (Path(daemon.state_dir) / "tls" / "cert.pem").read_text()
    return ssl.PEM_cert_to_DER_cert(pem)


@pytest.fixture(scope="module")
def tls_daemons(executor_bin):
    from conftest import start_daemon

    first = start_daemon(executor_bin, tls=True)
    other = start_daemon(executor_bin, tls=True)
    yield first, other
    first.stop()
    other.stop()


def test_the_pinned_certificate_is_accepted(tls_daemons):
    daemon, _ = tls_daemons
    assert daemon.url.startswith("wss://127.0.0.1:")
    # The fingerprint serve prints is the SHA-256 of its certificate's DER.
    assert daemon.fingerprint == fingerprint_of(cert_der(daemon))
    with daemon.connect(tls_fingerprint=daemon.fingerprint) as client:
        assert client.exec("echo over tls").output == "over tls\n"
    # As operators paste it: openssl's form, upper case with colons.
    hexdigits = daemon.fingerprint.split(":", 1)[1].upper()
    openssl_form = "sha256 Fingerprint=" + ":".join(hexdigits[i : i + 2] for i in range(0, 64, 2))
    assert parse_fingerprint(openssl_form) == daemon.fingerprint
    with daemon.connect(tls_fingerprint=openssl_form) as client:
        assert client.exec("true").returncode == 0


def test_another_certificate_is_refused_with_both_fingerprints(tls_daemons):
    daemon, other = tls_daemons
    assert daemon.fingerprint != other.fingerprint
    with pytest.raises(PinMismatchError) as refused:
        other.connect(tls_fingerprint=daemon.fingerprint)
    assert refused.value.retry is False
    assert refused.value.pinned == daemon.fingerprint
    assert refused.value.presented == other.fingerprint
    assert daemon.fingerprint in str(refused.value)
    assert other.fingerprint in str(refused.value)
    # Control: the same executor with its own pin.
    other.connect(tls_fingerprint=other.fingerprint).close()


def test_without_a_pin_a_self_signed_certificate_does_not_verify(tls_daemons):
    daemon, _ = tls_daemons
    with pytest.raises(ConnectError) as refused:
        daemon.connect()
    assert refused.value.retry is False
    assert "does not verify" in str(refused.value)


def test_a_pin_with_plain_ws_is_an_error(daemon):
    with pytest.raises(ValueError, match="wss://"):
        daemon.connect(tls_fingerprint="sha256:" + "0" * 64)
    with pytest.raises(ValueError, match="invalid TLS fingerprint"):
        parse_fingerprint("sha256:1234")


class Impostor:
    """A TLS server with another certificate that records what a client sends it."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received = b""
        self.accepted = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            self.accepted.set()
            raw.settimeout(3)
            try:
                with self.context.wrap_socket(raw, server_side=True) as conn:
                    while chunk := conn.recv(4096):
                        self.received += chunk
            except OSError:
                pass


def test_an_impostor_never_sees_the_token(tls_daemons, tmp_path):
    daemon, other = tls_daemons
    # The impostor holds a real key pair of its own (the other executor's).
    cert = tmp_path / "cert.pem"
    key = tmp_path / "key.pem"
    shutil.copy(Path(other.state_dir) / "tls" / "cert.pem", cert)
    shutil.copy(Path(other.state_dir) / "tls" / "key.pem", key)
    impostor = Impostor(cert, key)
    url = f"wss://127.0.0.1:{impostor.port}/v1/ws"
    with pytest.raises(PinMismatchError):
        Client.connect(
            url,
            token="secret-token-0123456789",
            tls_fingerprint=daemon.fingerprint,
            connect_timeout=3,
        )
    assert impostor.accepted.is_set()
    # The check ran inside the handshake: not one byte of the upgrade request was sent (the
    # impostor does not even complete its side: our Finished never left).
    assert impostor.received == b""
    # Control: a client that pins the impostor's own certificate does send its request,
    # token included (and then times out: the impostor never answers).
    with pytest.raises(ConnectError):
        Client.connect(
            url,
            token="secret-token-0123456789",
            tls_fingerprint=other.fingerprint,
            connect_timeout=2,
        )
    assert b"GET /v1/ws HTTP/1.1" in impostor.received
    assert b"Authorization: Bearer secret-token-0123456789" in impostor.received


def test_the_pinned_context_works_for_blocking_sockets_too(tls_daemons):
    # `pinned_context` also serves other clients (http.client for /healthz, /metrics).
    daemon, other = tls_daemons
    conn = http.client.HTTPSConnection(
        "127.0.0.1", daemon.port, timeout=10, context=pinned_context(daemon.fingerprint)
    )
    conn.request("GET", "/healthz")
    assert conn.getresponse().status == 200
    conn.close()
    refused = http.client.HTTPSConnection(
        "127.0.0.1", other.port, timeout=10, context=pinned_context(daemon.fingerprint)
    )
    with pytest.raises(PinRefused):
        refused.request("GET", "/healthz")


def test_the_mini_environment_runs_over_a_pinned_wss_executor(tls_daemons):
    """mini's environment class with `url` + `tls_fingerprint`, as a remote config names them."""
    from minisweagent.exceptions import Submitted

    from executor_client.mini import ExecutorEnvironment

    daemon, other = tls_daemons
    env = ExecutorEnvironment(
        url=daemon.url, token_file=daemon.token_file, tls_fingerprint=daemon.fingerprint
    )
    try:
        result = env.execute({"command": "echo pinned"})
        assert (result["output"], result["returncode"]) == ("pinned\n", 0)
        with pytest.raises(Submitted):
            env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo patch"})
    finally:
        env.close()
    # Denial: the same pin against another executor's certificate never connects.
    with pytest.raises(PinMismatchError):
        ExecutorEnvironment(
            url=other.url, token_file=other.token_file, tls_fingerprint=daemon.fingerprint
        ).execute({"command": "true"})
