"""The servers of the test internet (tests/src/test_internet/mod.rs), one role per process.

Usage: python3 servers.py ROLE DIR CONFIG_JSON

Each process prepares what it serves under DIR (the package, the repository, the certificate),
binds its IPv4 and IPv6 addresses (from CONFIG_JSON, the harness's site table), prints `ready`
and serves until its standard input reaches end of file: the harness holds the write end, so
the server ends with the test process, however that ends (a panic, SIGKILL), and no process is
left behind. Standard library only: the harness runs it with the host's /usr/bin/python3.
"""

import base64
import hashlib
import http.server
import json
import os
import socket
import socketserver
import ssl
import struct
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

# What the servers serve, also spelled in mod.rs (the tests check them there).
PACKAGE = "testnet_hello"
PROJECT = "testnet-hello"  # the PEP 503 normalized name
VERSION = "1.0"
MODULE_SOURCE = 'GREETING = "hello from the test internet"\n'
GIT_FILE = "README"
GIT_CONTENT = "hello from the test internet's git server\n"
TLS_BODY = b"hello over TLS from the test internet\n"


def v6(cls: type) -> type:
    """The IPv6 variant of a socketserver class."""
    return type(cls.__name__ + "6", (cls,), {"address_family": socket.AF_INET6})


BYTES = "/bytes/"
CHUNK = bytes(1 << 16)


def send_bytes(handler: http.server.BaseHTTPRequestHandler) -> bool:
    """Answers GET /bytes/N with N zero bytes, streamed (for throughput measurements); False
    for any other path."""
    count = handler.path.removeprefix(BYTES)
    if not handler.path.startswith(BYTES) or not count.isdigit():
        return False
    left = int(count)
    handler.send_response(200)
    handler.send_header("Content-Type", "application/octet-stream")
    handler.send_header("Content-Length", str(left))
    handler.end_headers()
    while left > 0:
        handler.wfile.write(CHUNK[: min(left, len(CHUNK))])
        left -= len(CHUNK)
    return True


class Quiet(http.server.SimpleHTTPRequestHandler):
    """Static files (and /bytes/N), one line per request on stderr (the harness keeps it in a
    log file)."""

    def do_GET(self) -> None:
        if not send_bytes(self):
            super().do_GET()

    def log_message(self, format: str, *args: object) -> None:
        sys.stderr.write(f"{self.client_address[0]} {format % args}\n")


class Threading(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def server_bind(self) -> None:
        # HTTPServer's own server_bind asks for the address's fully qualified name, a reverse
        # lookup through the host's resolver, which this namespace cannot reach: skip it.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


def static_http(root: Path) -> list:
    handler = lambda *a, **kw: Quiet(*a, directory=root, **kw)  # noqa: E731
    return [(Threading, handler, 80)]


def wheel(directory: Path) -> tuple[str, str]:
    """Writes the package's wheel by hand (a zip with a RECORD of sha256 digests, PEP 427);
    returns its file name and sha256."""
    info = f"{PACKAGE}-{VERSION}.dist-info"
    files = {
        f"{PACKAGE}/__init__.py": MODULE_SOURCE.encode(),
        f"{info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {PROJECT}\nVersion: {VERSION}\n"
            "Summary: the test internet's package\n"
        ).encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: executor-tests\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    record = ""
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{path},sha256={digest},{len(data)}\n"
    record += f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    name = f"{PACKAGE}-{VERSION}-py3-none-any.whl"
    path = directory / name
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for member, data in files.items():
            zf.writestr(member, data)
    return name, hashlib.sha256(path.read_bytes()).hexdigest()


def pypi(root: Path, _config: dict) -> list:
    """A PEP 503 "simple" index of static files: /simple/, /simple/PROJECT/, /files/WHEEL."""
    (root / "simple" / PROJECT).mkdir(parents=True)
    (root / "files").mkdir()
    name, sha = wheel(root / "files")
    page = "<!DOCTYPE html>\n<html><body>\n{}\n</body></html>\n"
    (root / "simple" / "index.html").write_text(page.format(f'<a href="{PROJECT}/">{PROJECT}</a>'))
    (root / "simple" / PROJECT / "index.html").write_text(
        page.format(f'<a href="../../files/{name}#sha256={sha}">{name}</a>')
    )
    return static_http(root)


def git(root: Path, _config: dict) -> list:
    """A bare repository with one commit, served by git's dumb HTTP protocol: static files
    after `git update-server-info`."""
    repo = str(root / "repo.git")
    env = dict(
        os.environ,
        GIT_AUTHOR_NAME="test internet",
        GIT_AUTHOR_EMAIL="git@test.example",
        GIT_AUTHOR_DATE="2026-01-01T00:00:00Z",
        GIT_COMMITTER_NAME="test internet",
        GIT_COMMITTER_EMAIL="git@test.example",
        GIT_COMMITTER_DATE="2026-01-01T00:00:00Z",
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL="/dev/null",
    )

    def run(*args: str, stdin: str = "") -> str:
        done = subprocess.run(
            ["git", "-C", repo, *args],
            input=stdin,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"git {' '.join(args)}: {done.stderr}")
        return done.stdout.strip()

    subprocess.run(["git", "init", "--quiet", "--bare", repo], env=env, check=True)
    blob = run("hash-object", "-w", "--stdin", stdin=GIT_CONTENT)
    tree = run("mktree", stdin=f"100644 blob {blob}\t{GIT_FILE}\n")
    commit = run("commit-tree", tree, "-m", "the test internet's one commit")
    run("update-ref", "refs/heads/main", commit)
    run("symbolic-ref", "HEAD", "refs/heads/main")
    run("update-server-info")
    return static_http(root)


class TlsHandler(http.server.BaseHTTPRequestHandler):
    """TLS_BODY for any path but /bytes/N."""

    def do_GET(self) -> None:
        if send_bytes(self):
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(TLS_BODY)))
        self.end_headers()
        self.wfile.write(TLS_BODY)

    def log_message(self, format: str, *args: object) -> None:
        sys.stderr.write(f"{self.client_address[0]} {format % args}\n")


def tls(root: Path, config: dict) -> list:
    """HTTPS with a certificate for the TLS site's name and addresses, issued by a CA made
    here (ROOT/ca.pem, which the tests trust)."""
    site = config["sites"]["tls"]

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=root, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=executor-tests test internet CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    openssl(
        "req", "-x509", *ec, "-CA", "ca.pem", "-CAkey", "ca.key",
        "-keyout", "server.key", "-out", "server.pem", "-days", "2",
        "-subj", f"/CN={site['name']}",
        "-addext", f"subjectAltName=DNS:{site['name']},IP:{site['v4']},IP:{site['v6']}",
        "-addext", "basicConstraints=critical,CA:FALSE",
        "-addext", "extendedKeyUsage=serverAuth",
    )  # fmt: skip
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(root / "server.pem", root / "server.key")

    class Tls(Threading):
        def get_request(self) -> tuple:
            # The handshake happens on the handler's thread (on its first read), so one slow
            # client does not hold up the accepting loop.
            sock, addr = self.socket.accept()
            return context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

    return [(Tls, TlsHandler, 443)]


class Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


class UdpEcho(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        data, sock = self.request
        sock.sendto(data, self.client_address)


class TcpServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class UdpServer(socketserver.UDPServer):
    allow_reuse_address = True


ECHOES = ((TcpServer, Echo), (UdpServer, UdpEcho))


def echo(_root: Path, _config: dict) -> list:
    """TCP and UDP echo (RFC 862) on port 7, and the same on 7007 (for a port-scoped rule's
    denial beside its allowed control)."""
    return [(server, handler, port) for port in (7, 7007) for server, handler in ECHOES]


def dns(_root: Path, config: dict) -> list:
    """A DNS server on UDP port 53 answering A and AAAA for the test names; NXDOMAIN for any
    other name."""
    answers: dict[str, dict[int, bytes]] = {}
    for site in config["sites"].values():
        answers[site["name"].lower()] = {
            1: socket.inet_pton(socket.AF_INET, site["v4"]),
            28: socket.inet_pton(socket.AF_INET6, site["v6"]),
        }

    class Dns(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            query, sock = self.request
            try:
                reply = answer(query)
            except (IndexError, struct.error, UnicodeDecodeError):
                return
            sock.sendto(reply, self.client_address)

    def answer(query: bytes) -> bytes:
        ident, _flags, qdcount = struct.unpack("!HHH", query[:6])
        if qdcount != 1:
            return struct.pack("!HHHHHH", ident, 0x8184, 0, 0, 0, 0)  # NOTIMP
        labels, at = [], 12
        while length := query[at]:
            labels.append(query[at + 1 : at + 1 + length].decode("ascii"))
            at += 1 + length
        qtype, _qclass = struct.unpack("!HH", query[at + 1 : at + 5])
        question = query[12 : at + 5]
        records = answers.get(".".join(labels).lower())
        if records is None:
            return struct.pack("!HHHHHH", ident, 0x8183, 1, 0, 0, 0) + question  # NXDOMAIN
        data = records.get(qtype)
        if data is None:
            return struct.pack("!HHHHHH", ident, 0x8180, 1, 0, 0, 0) + question  # no data
        record = struct.pack("!HHHIH", 0xC00C, qtype, 1, 60, len(data)) + data
        return struct.pack("!HHHHHH", ident, 0x8180, 1, 1, 0, 0) + question + record

    return [(UdpServer, Dns, 53)]


ROLES = {"pypi": pypi, "git": git, "tls": tls, "echo": echo, "dns": dns}


def main() -> None:
    role, root, config_path = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    config = json.loads(config_path.read_text())
    site = config["sites"][role]
    root.mkdir(exist_ok=True)
    for cls, handler, port in ROLES[role](root, config):
        for family_cls, address in ((cls, site["v4"]), (v6(cls), site["v6"])):
            server = family_cls((address, port), handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
    print("ready", flush=True)
    # Serve until the harness (or the test process, by ending) closes our standard input.
    while sys.stdin.buffer.read(4096):
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
