"""Opening a connection to an executor: the URL's TLS, the token, the WebSocket handshake and
the check of the hello. Each connection of an `AsyncClient` (the first and every reconnect)
is opened here; what it then carries is `session.py`'s."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from pathlib import Path

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from ._version import __version__
from .errors import ConnectError, PinMismatchError, ProtocolError
from .protocol import PROTOCOL_VERSION, Hello
from .tls import PinRefused, client_context

#: How long opening a connection and reading its hello may take.
CONNECT_TIMEOUT = 10.0
#: Largest message accepted from the executor: a result holds up to `max_output_bytes` (1 MiB
#: by default) of output, which JSON escaping can make several times larger.
MAX_INCOMING_BYTES = 64 * 1024 * 1024
#: What a failing connection attempt raises (`asyncio.TimeoutError` is not the built-in one
#: before Python 3.11).
CONNECTION_FAILURES = (OSError, asyncio.TimeoutError, TimeoutError, ConnectionClosed)


def read_token(token: str | None, token_file: str | os.PathLike[str] | None) -> str | None:
    """The bearer token: given, read from a file, or `EXECUTOR_TOKEN`."""
    if token:
        return token.strip()
    if token_file:
        try:
            return Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConnectError(f"cannot read the token file {token_file}: {e}", retry=False) from e
    return os.environ.get("EXECUTOR_TOKEN") or None


def ssl_context_for(
    url: str, fingerprint: str | None, ca_file: str | None
) -> ssl.SSLContext | None:
    """The TLS context a `wss://` URL needs (None for `ws://`, which takes no TLS options)."""
    if url.startswith("wss://"):
        return client_context(fingerprint, ca_file)
    if url.startswith("ws://"):
        if fingerprint or ca_file:
            raise ValueError(
                f"a TLS fingerprint or CA is given but {url} is plain ws://: use wss://"
            )
        return None
    raise ValueError(f"not a WebSocket URL: {url!r} (expected ws://HOST:PORT/v1/ws or wss://...)")


async def open_connection(
    url: str, *, token: str | None, ssl_context: ssl.SSLContext | None, timeout: float
) -> tuple[ClientConnection, Hello]:
    """A new connection and its hello; `ConnectError` (with `retry`) when it cannot be had,
    `ProtocolError` when the executor speaks another protocol."""
    try:
        ws, text = await asyncio.wait_for(_handshake(url, token, ssl_context), timeout)
    except PinRefused as e:
        raise PinMismatchError(e.pinned, e.presented) from None
    except InvalidStatus as e:
        status = e.response.status_code
        refused = (
            ": the token sent is not this executor's (check token_file or EXECUTOR_TOKEN)"
            if token
            else ": it requires a token and none was given (token, token_file or EXECUTOR_TOKEN)"
        )
        hint = {401: refused, 403: " (Origin or Host refused)"}
        raise ConnectError(
            f"the executor at {url} refused the connection: HTTP {status}" + hint.get(status, ""),
            retry=status not in (401, 403),
        ) from e
    except ssl.SSLCertVerificationError as e:
        raise ConnectError(
            f"the executor at {url} presented a certificate that does not verify: "
            f"{e.verify_message or e}",
            retry=False,
        ) from e
    except (*CONNECTION_FAILURES, InvalidHandshake) as e:
        raise ConnectError(f"cannot connect to the executor at {url}: {e!r}") from e
    try:
        hello = Hello.from_json(json.loads(text))
    except (ValueError, ProtocolError) as e:
        await ws.close()
        raise ProtocolError(f"unreadable hello from {url}: {e}") from e
    if hello.protocol != PROTOCOL_VERSION:
        await ws.close()
        raise ProtocolError(
            f"the executor at {url} speaks protocol {hello.protocol}, "
            f"this client speaks {PROTOCOL_VERSION}"
        )
    return ws, hello


async def _handshake(
    url: str, token: str | None, ssl_context: ssl.SSLContext | None
) -> tuple[ClientConnection, str | bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    ws = await connect(
        url,
        ssl=ssl_context,
        additional_headers=headers,
        user_agent_header=f"executor-client-python/{__version__}",
        # The executor talks plain frames; proxies from the environment are not for it
        # (the Rust agent ignores them too).
        compression=None,
        proxy=None,
        open_timeout=None,
        # No keepalive pings: a sync client runs its loop only during calls, and the
        # executor sends none. A silent outage is noticed at the command's deadline.
        ping_interval=None,
        close_timeout=2,
        max_size=MAX_INCOMING_BYTES,
        # Messages read ahead of us: a download's pieces wait here while one is written,
        # so few (four pieces of 512 KiB) keep a large download out of memory.
        max_queue=4,
    )
    try:
        return ws, await ws.recv()
    except BaseException:
        await ws.close()
        raise
