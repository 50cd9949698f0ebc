"""Local ends of file transfers: sources read and sinks written piece by piece, and tar
streams made and unpacked on the fly through a pipe, so no file is ever held in memory."""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import IO

#: What `upload` reads: bytes, a local path, or a binary file object (read from where it is).
Source = bytes | str | os.PathLike[str] | IO[bytes]
#: Where `download` writes: a local path (replaced) or a binary file object.
Destination = str | os.PathLike[str] | IO[bytes]


@contextlib.contextmanager
def opened_source(source: Source) -> Iterator[Callable[[int], bytes]]:
    """`read(n)` over the source; b"" at its end."""
    if isinstance(source, bytes):
        yield io.BytesIO(source).read
    elif isinstance(source, (str, os.PathLike)):
        with Path(source).open("rb") as file:
            yield file.read
    else:
        yield source.read


@contextlib.contextmanager
def opened_sink(destination: Destination) -> Iterator[Callable[[bytes], object]]:
    """`write(data)` into the destination; a local file is removed again on failure."""
    if not isinstance(destination, (str, os.PathLike)):
        yield destination.write
        return
    path = Path(destination)
    try:
        with path.open("wb") as file:
            yield file.write
    except BaseException:
        path.unlink(missing_ok=True)
        raise


class PipeWriter:
    """The writing end of a pipe, written from worker threads and closed from the event loop:
    the lock keeps a close from freeing the descriptor number while a write still uses it."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._fd is None:
                raise BrokenPipeError("the pipe is closed")
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def write_tar(directory: str | os.PathLike[str], fd: int) -> None:
    """Write a tar stream of `directory`'s contents (not the directory itself, whose mode and
    owner are the destination's business) into `fd`, and close it."""
    with os.fdopen(fd, "wb") as pipe, tarfile.open(fileobj=pipe, mode="w|") as tar:
        for entry in sorted(Path(directory).iterdir()):
            tar.add(entry, arcname=entry.name)


def extract_tar(fd: int, directory: str | os.PathLike[str]) -> None:
    """Unpack the tar stream read from `fd` into `directory`, and close `fd`. The stream
    comes from the sandbox: tarfile's `data` filter keeps every member inside `directory`
    and refuses devices and set-id bits; the same checks by hand where it is missing."""
    with os.fdopen(fd, "rb") as pipe, tarfile.open(fileobj=pipe, mode="r|") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(directory, filter="data")
        else:  # Python before 3.10.12 / 3.11.4
            tar.extractall(directory, members=_checked(tar, Path(directory)))  # noqa: S202


def _checked(tar: tarfile.TarFile, root: Path) -> Iterator[tarfile.TarInfo]:
    base = root.resolve()
    for member in tar:
        name = PurePosixPath(member.name)
        if name.is_absolute() or ".." in name.parts:
            raise tarfile.TarError(f"member outside the destination: {member.name!r}")
        if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
            raise tarfile.TarError(f"special file in the archive: {member.name!r}")
        if member.issym() or member.islnk():
            link = PurePosixPath(member.linkname)
            parent = (base / name).parent if member.issym() else base
            target = Path(os.path.normpath(parent / link))
            if link.is_absolute() or not target.is_relative_to(base):
                raise tarfile.TarError(f"link outside the destination: {member.name!r}")
        member.mode &= 0o777
        yield member
