"""Files (protocol 1.1) against a real daemon: uploads and downloads byte for byte (every byte
value, 5 MB by sha256, ranges, file objects), streamed without holding the file in memory,
a denied path with its allowed control, `stat` and `list_dir`, and a directory's round trip
through tar. Paths are checked on the host: the workspace is a host directory."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import stat
import tracemalloc
from dataclasses import replace
from pathlib import Path

import pytest

from executor_client import (
    DeniedError,
    NotFoundError,
    ServerError,
    UnsupportedError,
)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def random_file(path: Path, size: int) -> Path:
    with path.open("wb") as file:
        for _ in range(size // (1 << 20)):
            file.write(os.urandom(1 << 20))
        file.write(os.urandom(size % (1 << 20)))
    return path


def test_the_executor_offers_files_and_tar(daemon):
    with daemon.connect() as client:
        assert {"files", "tar"} <= set(client.hello.capabilities)
        assert client.hello.limits.max_upload_bytes >= 5 * 1024 * 1024


def test_every_byte_value_round_trips(daemon):
    every_byte = bytes(range(256))
    with daemon.connect() as client:
        sent = client.upload(every_byte, "every-byte.bin")
        host = Path(daemon.workspace) / "every-byte.bin"
        assert (sent.path, sent.bytes) == (str(host), 256)
        assert host.read_bytes() == every_byte
        assert stat.S_IMODE(host.stat().st_mode) == 0o644
        received = io.BytesIO()
        got = client.download("every-byte.bin", received)
        assert received.getvalue() == every_byte
        assert (got.path, got.bytes) == (str(host), 256)
        # A range of it, by absolute path this time.
        part = io.BytesIO()
        assert client.download(str(host), part, offset=10, length=20).bytes == 20
        assert part.getvalue() == every_byte[10:30]
        # An upload replaces the file whole, with the mode asked for.
        client.upload(b"short", "every-byte.bin", mode=0o600)
        assert host.read_bytes() == b"short"
        assert stat.S_IMODE(host.stat().st_mode) == 0o600


def test_five_megabytes_round_trip_with_equal_sha256(daemon, tmp_path):
    size = 5 * 1024 * 1024 + 7  # not a whole number of pieces
    local = random_file(tmp_path / "five.bin", size)
    with daemon.connect() as client:
        assert client.upload(local, "five.bin").bytes == size
        host = Path(daemon.workspace) / "five.bin"
        assert sha256_of(host) == sha256_of(local)
        back = tmp_path / "back.bin"
        assert client.download("five.bin", back).bytes == size
        assert sha256_of(back) == sha256_of(local)
        # From an open file object, as far as it is read, and to one.
        with local.open("rb") as file:
            file.seek(1000)
            assert client.upload(file, "tail.bin").bytes == size - 1000
        tail = io.BytesIO()
        client.download("tail.bin", tail)
        assert (
            hashlib.sha256(tail.getvalue()).hexdigest()
            == hashlib.sha256(local.read_bytes()[1000:]).hexdigest()
        )


def test_large_transfers_are_streamed_not_held_in_memory(daemon, tmp_path):
    with daemon.connect() as client:
        size = min(40 * 1024 * 1024, client.hello.limits.max_upload_bytes or 1 << 40)
        local = random_file(tmp_path / "large.bin", size)
        tracemalloc.start()
        try:
            client.upload(local, "large.bin")
            _, upload_peak = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            client.download("large.bin", tmp_path / "large-back.bin")
            _, download_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert sha256_of(tmp_path / "large-back.bin") == sha256_of(local)
    assert upload_peak < size / 3, upload_peak
    assert download_peak < size / 3, download_peak


def test_an_upload_where_commands_cannot_write_is_denied(daemon, tmp_path):
    with daemon.connect() as client:
        # The sandbox sees the host's /usr read-only, as a command would.
        with pytest.raises(DeniedError) as denied:
            client.upload(b"nope", "/usr/bin/executor-denied-upload")
        assert denied.value.code == "denied"
        assert not Path("/usr/bin/executor-denied-upload").exists()
        marker = tmp_path / "executor-denied-marker"
        marker.write_text("x")
        with pytest.raises(DeniedError):
            client.upload_dir(tmp_path, "/usr/share")
        assert not Path("/usr/share/executor-denied-marker").exists()
        # Reading too: the sandbox's identity may not read the host's shadow file.
        with pytest.raises(DeniedError):
            client.download("/etc/shadow", io.BytesIO())
        assert client.download("/etc/passwd", io.BytesIO()).bytes > 0
        # Control: the same upload into the workspace is written; the session goes on.
        client.upload(b"yes", "allowed-upload")
        assert (Path(daemon.workspace) / "allowed-upload").read_bytes() == b"yes"


class FailingSource(io.RawIOBase):
    """A source that breaks after `good` bytes, as a failing disk or network would."""

    def __init__(self, good: int) -> None:
        self.left = good

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.left <= 0:
            raise OSError("the source broke")
        n = min(self.left, len(buffer))
        buffer[:n] = b"x" * n
        self.left -= n
        return n


def test_a_source_that_fails_midway_leaves_no_file(daemon):
    with daemon.connect() as client:
        with pytest.raises(OSError, match="the source broke"):
            client.upload(io.BufferedReader(FailingSource(3 * 1024 * 1024)), "half.bin")
        host = Path(daemon.workspace) / "half.bin"
        assert not host.exists()
        # Control: the connection serves on, and a whole source lands.
        client.upload(b"x" * 1000, "half.bin")
        assert host.read_bytes() == b"x" * 1000


def test_parents_are_made_only_when_asked(daemon):
    with daemon.connect() as client:
        with pytest.raises(ServerError):
            client.upload(b"deep", "no/such/dirs/file.txt")
        assert not (Path(daemon.workspace) / "no").exists()
        client.upload(b"deep", "no/such/dirs/file.txt", parents=True)
        assert (Path(daemon.workspace) / "no/such/dirs/file.txt").read_bytes() == b"deep"


def test_a_failed_download_leaves_no_local_file(daemon, tmp_path):
    with daemon.connect() as client:
        target = tmp_path / "missing.bin"
        with pytest.raises(NotFoundError):
            client.download("does-not-exist.bin", target)
        assert not target.exists()
        # Control: an existing file lands there.
        client.upload(b"here", "exists.bin")
        client.download("exists.bin", target)
        assert target.read_bytes() == b"here"


def test_stat_and_list_dir_describe_files_directories_and_links(daemon):
    with daemon.connect() as client:
        made = client.exec(
            "mkdir -p described/sub && printf abc > described/file && "
            "chmod 640 described/file && ln -s file described/link"
        )
        assert made.returncode == 0, made.output
        host = Path(daemon.workspace) / "described"
        info = client.stat("described/file")
        assert info.name == str(host / "file")
        assert (info.kind, info.size, info.mode) == ("file", 3, 0o640)
        assert info.mtime == int(host.joinpath("file").stat().st_mtime)
        link = client.stat("described/link")
        assert (link.kind, link.target) == ("symlink", "file")
        assert client.stat(str(host)).kind == "dir"
        listing = client.list_dir("described")
        assert [(e.name, e.kind) for e in listing.entries] == [
            ("file", "file"),
            ("link", "symlink"),
            ("sub", "dir"),
        ]
        assert not listing.truncated
        with pytest.raises(NotFoundError):
            client.stat("described/missing")
        with pytest.raises(NotFoundError):
            client.list_dir("described/missing")


def make_tree(root: Path) -> Path:
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    (root / "text.txt").write_text("hello\n")
    (root / "sub" / "every-byte.bin").write_bytes(bytes(range(256)) * 100)
    (root / "sub" / "deeper" / "empty").write_bytes(b"")
    script = root / "run.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o755)
    (root / "sub" / "private").write_text("secret\n")
    (root / "sub" / "private").chmod(0o600)
    (root / "link").symlink_to("sub/every-byte.bin")
    return root


def describe(root: Path) -> dict[str, tuple[str, int, bytes | str]]:
    """Each path under `root`: its kind, permission bits, and content or link target."""
    found: dict[str, tuple[str, int, bytes | str]] = {}
    for path in sorted(root.rglob("*")):
        mode = stat.S_IMODE(path.lstat().st_mode)
        name = str(path.relative_to(root))
        if path.is_symlink():
            found[name] = ("link", 0, str(path.readlink()))
        elif path.is_dir():
            found[name] = ("dir", mode, "")
        else:
            found[name] = ("file", mode, path.read_bytes())
    return found


def test_a_directory_round_trips_through_tar(daemon, tmp_path):
    tree = describe(make_tree(tmp_path / "tree"))
    with daemon.connect() as client:
        sent = client.upload_dir(tmp_path / "tree", "tree", parents=True)
        host = Path(daemon.workspace) / "tree"
        assert sent.path == str(host)
        assert sent.bytes > 25600
        assert describe(host) == tree
        # A command sees it too.
        assert client.exec("./tree/run.sh").output == "ran\n"
        got = client.download_dir("tree", tmp_path / "back")
        assert got.bytes > 25600
    assert describe(tmp_path / "back") == tree


def test_transfers_run_concurrently_on_one_connection(daemon, tmp_path):
    payloads = {f"concurrent-{n}.bin": os.urandom(300_000 + n) for n in range(4)}

    async def scenario() -> None:
        async with await daemon.connect_async() as client:
            await asyncio.gather(*(client.upload(data, name) for name, data in payloads.items()))
            sinks = {name: io.BytesIO() for name in payloads}
            await asyncio.gather(*(client.download(name, sinks[name]) for name in payloads))
            assert {name: sink.getvalue() for name, sink in sinks.items()} == payloads

    asyncio.run(scenario())


def test_files_need_an_executor_that_offers_them(daemon, tmp_path):
    with daemon.connect() as client:
        client._inner.hello = replace(client.hello, capabilities=["processes"])
        with pytest.raises(UnsupportedError, match="'files'"):
            client.upload(b"x", "never-sent")
        with pytest.raises(UnsupportedError, match="'files'"):
            client.stat(".")
        client._inner.hello = replace(client.hello, capabilities=["files"])
        with pytest.raises(UnsupportedError, match="'tar'"):
            client.download_dir(".", tmp_path / "never")
        assert not (Path(daemon.workspace) / "never-sent").exists()
        # Control: offered, the same call runs.
        client._inner.hello = replace(client.hello, capabilities=["files", "tar"])
        assert client.stat(".").kind == "dir"
