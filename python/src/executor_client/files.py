"""Protocol 1.1's file requests (`upload`, `download`, their tar forms for directories,
`stat`, `list_dir`) on an `AsyncClient`'s connection; the local side of a transfer (sources,
sinks, tar streams) is `transfer.py`'s."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from .errors import ExecutorClientError
from .protocol import DirListing, FileStat, JsonDict, Transferred, encode_bytes
from .session import REPLY_PATIENCE, ResumableConnection
from .transfer import (
    Destination,
    PipeWriter,
    Source,
    extract_tar,
    opened_sink,
    opened_source,
    write_tar,
)


class FileTransfers(ResumableConnection):
    """The file requests of protocol 1.1: a part of `AsyncClient`."""

    async def upload(
        self,
        source: Source,
        remote_path: str,
        *,
        mode: int | None = None,
        parents: bool = False,
        profile: str | None = None,
    ) -> Transferred:
        """Write a file on the executor's side from bytes, a local path or a binary file
        object, streamed in pieces. It appears at `remote_path` (relative: to the workspace)
        whole or not at all; `mode` defaults to 0o644, `parents` creates missing directories.
        `DeniedError` when a command could not write there either."""
        self.require("files")
        message = _file_request("upload", self.new_id(), remote_path, profile)
        if mode is not None:
            message["mode"] = mode
        if parents:
            message["parents"] = True
        with opened_source(source) as read:
            return await self._upload(message, read)

    async def download(
        self,
        remote_path: str,
        destination: Destination,
        *,
        offset: int = 0,
        length: int | None = None,
        profile: str | None = None,
    ) -> Transferred:
        """Copy a file (or `length` bytes of it from `offset`) to a local path or a binary
        file object, streamed. A local path is removed again if the download fails."""
        self.require("files")
        message = _file_request("download", self.new_id(), remote_path, profile)
        if offset:
            message["offset"] = offset
        if length is not None:
            message["length"] = length
        with opened_sink(destination) as write:

            async def on_data(data: bytes) -> None:
                write(data)

            return await self._download(message, on_data)

    async def upload_dir(
        self,
        local_dir: str | os.PathLike[str],
        remote_dir: str,
        *,
        parents: bool = False,
        profile: str | None = None,
    ) -> Transferred:
        """Copy a local directory's contents into `remote_dir` as a tar stream made on the fly
        (files, directories, symbolic links; modes kept)."""
        self.require("files")
        self.require("tar")
        if not Path(local_dir).is_dir():
            raise NotADirectoryError(f"not a directory: {local_dir}")
        message = _file_request("upload", self.new_id(), remote_dir, profile)
        message["tar"] = True
        if parents:
            message["parents"] = True
        rfd, wfd = os.pipe()
        producer = asyncio.ensure_future(asyncio.to_thread(write_tar, local_dir, wfd))
        try:
            with open(rfd, "rb") as pipe:  # noqa: PTH123 - a pipe, not a path
                return await self._upload(message, pipe.read, before_eof=lambda: producer)
        finally:
            # A failed upload closed the pipe: the producer ends with EPIPE.
            await asyncio.gather(producer, return_exceptions=True)

    async def download_dir(
        self, remote_dir: str, local_dir: str | os.PathLike[str], *, profile: str | None = None
    ) -> Transferred:
        """Copy a directory's contents into `local_dir` (created if missing), unpacking the
        executor's tar stream as it arrives with tarfile's `data` filter (nothing lands
        outside `local_dir`)."""
        self.require("files")
        self.require("tar")
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        message = _file_request("download", self.new_id(), remote_dir, profile)
        message["tar"] = True
        rfd, wfd = os.pipe()
        extractor = asyncio.ensure_future(asyncio.to_thread(extract_tar, rfd, local_dir))
        pipe = PipeWriter(wfd)

        async def on_data(data: bytes) -> None:
            await asyncio.to_thread(pipe.write, data)

        try:
            result = await self._download(message, on_data)
        except BaseException as e:
            pipe.close()
            (unpacked,) = await asyncio.gather(extractor, return_exceptions=True)
            if isinstance(e, BrokenPipeError) and isinstance(unpacked, Exception):
                raise unpacked from None  # the extractor stopped reading: its reason
            raise
        pipe.close()
        await extractor
        return result

    async def stat(self, remote_path: str, *, profile: str | None = None) -> FileStat:
        """A path's facts (a symbolic link's own); `NotFoundError` when it is missing."""
        self.require("files")
        message = _file_request("stat", self.new_id(), remote_path, profile)
        return FileStat.from_json(await self._call(message, ("file_info",), again=True))

    async def list_dir(self, remote_path: str, *, profile: str | None = None) -> DirListing:
        """A directory's entries, sorted by name."""
        self.require("files")
        message = _file_request("list_dir", self.new_id(), remote_path, profile)
        return DirListing.from_json(await self._call(message, ("dir_listing",), again=True))

    async def _upload(
        self,
        message: JsonDict,
        read: Callable[[int], bytes],
        *,
        before_eof: Callable[[], Awaitable[object]] | None = None,
    ) -> Transferred:
        """Send `upload`, then the content in `write` pieces (read one ahead, so the last
        carries `eof`), then wait for `uploaded`. An error stops the sending at once."""
        rid = str(message["id"])
        ws = await self._connection()
        call = self._open_call(ws, rid, ("uploaded",), long_poll=True)
        try:
            await self._send(ws, message)
            size = self._chunk_bytes()
            piece = await asyncio.to_thread(read, size)
            while not call.future.done():
                following = await asyncio.to_thread(read, size) if piece else b""
                write: JsonDict = {"type": "write", "id": rid}
                if piece:
                    write["data"] = encode_bytes(piece)
                if not following:
                    if before_eof is not None:
                        try:
                            await before_eof()
                        except BaseException:
                            # Never complete a file whose source failed: no `eof`, and a
                            # cancel ends the upload (a failed upload leaves nothing).
                            with contextlib.suppress(ExecutorClientError):
                                await self._send(ws, {"type": "cancel", "id": rid})
                            raise
                    write["eof"] = True
                await self._send(ws, write)
                if not following:
                    break
                piece = following
            return Transferred.from_json(await self._answer(call, REPLY_PATIENCE))
        finally:
            self._forget(call)

    async def _download(
        self, message: JsonDict, on_data: Callable[[bytes], Awaitable[None]]
    ) -> Transferred:
        rid = str(message["id"])
        ws = await self._connection()
        call = self._open_call(
            ws, rid, ("download_data", "downloaded"), long_poll=True, on_data=on_data
        )
        try:
            await self._send(ws, message)
            return Transferred.from_json(await self._answer(call, REPLY_PATIENCE))
        finally:
            self._forget(call)


def _file_request(kind: str, rid: str, path: str, profile: str | None) -> JsonDict:
    message: JsonDict = {"type": kind, "id": rid, "path": path}
    if profile:
        message["profile"] = profile
    return message
