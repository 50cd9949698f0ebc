"""Exceptions: one class per error code of the protocol, and the client's own failures.

Every error reply of the executor (`{"type":"error","code":...}`) becomes an instance of
the class registered for its code in `ERRORS`, a subclass of `ServerError` carrying `code`,
`message` and the request `id`. An unknown code (a newer executor) gives `ServerError` itself.
"""

from __future__ import annotations


class ExecutorClientError(Exception):
    """Base class of everything this package raises."""


class ConnectError(ExecutorClientError):
    """The connection could not be opened (refused, wrong token, no hello in time)."""

    def __init__(self, message: str, *, retry: bool = True) -> None:
        super().__init__(message)
        #: False when trying again cannot help (a refused certificate, a wrong token).
        self.retry = retry


class PinMismatchError(ConnectError):
    """The executor presented a certificate other than the pinned one: never retried."""

    def __init__(self, pinned: str, presented: str) -> None:
        super().__init__(
            f"the executor presented a TLS certificate with fingerprint {presented}, but "
            f"{pinned} is pinned; refusing to connect (if the executor's certificate was "
            "replaced on purpose, pin the new one: `executor tls-fingerprint` on its host "
            "prints it)",
            retry=False,
        )
        self.pinned = pinned
        self.presented = presented


class ConnectionLostError(ExecutorClientError):
    """The connection broke and the command's session could not be taken back.

    The executor killed whatever the session ran (or will, when its grace period ends), so
    the command may have run in part. `reconnected` tells whether the client holds a new
    connection (a fresh session) for the commands that follow.
    """

    def __init__(self, message: str, *, reconnected: bool = False) -> None:
        super().__init__(message)
        self.reconnected = reconnected


class ProtocolError(ExecutorClientError):
    """The executor sent something this client cannot read (or speaks another protocol)."""


class DeploymentError(ExecutorClientError):
    """A local executor or an `agent deploy up` deployment did not start."""


class UnsupportedError(ExecutorClientError):
    """The executor does not offer what the call needs (a protocol 1.1 capability: a 1.0
    executor, or one built without it). Nothing was sent."""

    def __init__(self, capability: str, server: str, offered: list[str]) -> None:
        super().__init__(
            f"{server or 'the executor'} does not offer {capability!r} (protocol 1.1; it "
            f"offers {', '.join(offered) if offered else 'nothing beyond protocol 1'}): "
            "upgrade the executor"
        )
        self.capability = capability


class ServerError(ExecutorClientError):
    """An `error` reply of the executor; the request did not run."""

    code = "unknown"

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class BadRequestError(ServerError):
    """Malformed or out-of-range request (too long, bad cwd or env name): never retry as is."""

    code = "bad_request"


class DuplicateIdError(ServerError):
    """The id names a command still running in this session."""

    code = "duplicate_id"


class NotFoundError(ServerError):
    """`cancel` of no running command, or `resume` of no live session."""

    code = "not_found"


class BusyError(ServerError):
    """A command limit is reached: retry later."""

    code = "busy"


class QuotaExceededError(ServerError):
    """A client quota is used up (the message says when to retry, if ever)."""

    code = "quota_exceeded"


class ProfileDeniedError(ServerError):
    """The profile is unknown or not allowed for this client."""

    code = "profile_denied"


class ExecutorEnvironmentError(ServerError):
    """The environment is unusable (a sandbox layer, the cwd or the interpreter failed).

    Not the command's failure: stop, and never show it to a model as an observation.
    """

    code = "environment_error"


class ShuttingDownError(ServerError):
    """The executor is draining."""

    code = "shutting_down"


class InternalError(ServerError):
    """A bug in the executor."""

    code = "internal"


class DeniedError(ServerError):
    """The sandbox refused a file operation (permission, read-only, out of the profile's
    reach), as it would have refused a command."""

    code = "denied"


ERRORS: dict[str, type[ServerError]] = {
    cls.code: cls
    for cls in (
        BadRequestError,
        DuplicateIdError,
        NotFoundError,
        BusyError,
        QuotaExceededError,
        ProfileDeniedError,
        ExecutorEnvironmentError,
        ShuttingDownError,
        InternalError,
        DeniedError,
    )
}


def server_error(code: str, message: str, request_id: str | None = None) -> ServerError:
    """The exception for an `error` reply."""
    return ERRORS.get(code, ServerError)(code, message, request_id)
