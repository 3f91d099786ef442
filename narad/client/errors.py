"""The SDK's exceptions: one class per case a caller must tell apart, and the one
mapping from an HTTP answer (or a transport failure) to them.

Every exception is a ``NaradError`` and carries two answers a caller needs
without matching on strings:

- ``uncertain``: the operation may have taken effect anyway (a produce that timed
  out or got a 5xx: retrying it may store a second copy);
- ``retryable``: Narad says trying again is safe (nothing was stored or changed).

Server errors (an HTTP answer) are ``ApiError`` subclasses with ``status``,
``message`` (the ``{"error": ...}`` text), ``node`` and ``retry_after``. A request
that got no answer is a ``TransportError``: ``ConnectError`` (nothing was sent),
``RequestTimeout`` / ``ConnectionLost`` (sent, outcome unknown).

Imports the standard library only (the bottom of narad.client).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

__all__ = [
    "ApiError",
    "BadGateway",
    "BadRequest",
    "ClientClosed",
    "Conflict",
    "ConnectError",
    "ConnectionLost",
    "DeadlineExceeded",
    "Forbidden",
    "GatewayTimeout",
    "Gone",
    "InternalServerError",
    "LeaseGone",
    "Misdirected",
    "NaradError",
    "NotFound",
    "OffsetGone",
    "PayloadTooLarge",
    "RequestTimeout",
    "ServerError",
    "TooManyRequests",
    "TopicChanged",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "UnsupportedMediaType",
    "error_from_response",
]


class NaradError(Exception):
    """Base class of every SDK error."""

    uncertain: bool = False
    retryable: bool = False

    def __init__(self, message: str, *, node: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.node = node


# ---- answers from a node -------------------------------------------------------------------
class ApiError(NaradError):
    """The node answered with an error status."""

    status: int = 0
    default_status: ClassVar[int] = 0

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        node: str | None = None,
        retry_after: float | None = None,
        code: str | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message, node=node)
        self.status = status if status is not None else self.default_status
        self.retry_after = retry_after
        self.code = code
        self.body = body or {}

    def __str__(self) -> str:
        where = f" (node {self.node})" if self.node else ""
        return f"{self.status} {self.message}{where}"


class BadRequest(ApiError):
    """400: the request is wrong (a field, a name, a schema failure); fix it, never retry."""

    default_status = 400


class Unauthorized(ApiError):
    """401: missing or wrong credentials."""

    default_status = 401


class Forbidden(ApiError):
    """403: authenticated, but no grant for this action on this topic (or not admin)."""

    default_status = 403


class NotFound(ApiError):
    """404: the topic (user, child link) does not exist."""

    default_status = 404


class Conflict(ApiError):
    """409: exists already, a fan-out rule, a delay child refusing a direct produce, ..."""

    default_status = 409


class TopicChanged(Conflict):
    """409 ``topic changed since it was read``: a concurrent delete/recreate; read again."""


class Gone(ApiError):
    """410."""

    default_status = 410


class LeaseGone(Gone):
    """410 on ack/extend/nack: the lease expired, was settled, or the message was
    redelivered under a new handle. Never retry it; another consumer may hold it."""


class OffsetGone(Gone):
    """410 on replay: the record aged out of retention (or is unreadable)."""


class PayloadTooLarge(ApiError):
    """413: message over 1 MiB, batch body over its cap, batch-ack body over 64 KiB."""

    default_status = 413


class UnsupportedMediaType(ApiError):
    """415: the CSRF guard (the SDK always sends the header; seen only through a proxy)."""

    default_status = 415


class Misdirected(ApiError):
    """421: the partition moved while the request ran; retry."""

    default_status = 421
    retryable = True


class TooManyRequests(ApiError):
    """429: a per-identity cap (consume or produce in flight) or the failed-login
    throttle; ``retry_after`` is set when the node said when."""

    default_status = 429


class ServerError(ApiError):
    """5xx. For a produce (or any write) the outcome is unknown: ``uncertain`` is set."""

    default_status = 500


class InternalServerError(ServerError):
    """500 (e.g. ``produce failed``: the node's ingress WAL is latched off)."""

    default_status = 500


class BadGateway(ServerError):
    """502: a forwarded request got no answer."""

    default_status = 502


class Unavailable(ServerError):
    """503: no Raft leader, the partition owner is down, the node is draining or
    busy. With ``retry_after`` on a produce nothing was stored."""

    default_status = 503


class GatewayTimeout(ServerError):
    """504."""

    default_status = 504


# ---- no answer -------------------------------------------------------------------------------
class TransportError(NaradError):
    """No HTTP answer was received."""


class ConnectError(TransportError):
    """The connection could not be made: nothing was sent, so a retry is always safe."""

    retryable = True


class PoolTimeout(ConnectError):
    """No connection of this client's own pool became free in time (every one of
    ``max_connections`` busy, e.g. with long polls): nothing was sent, and the node is
    not at fault (it is not put in cooldown)."""


class RequestTimeout(TransportError):
    """The request was sent (perhaps partly) and no answer came in time: the outcome is unknown."""

    uncertain = True


class ConnectionLost(TransportError):
    """The connection broke after the request was sent: the outcome is unknown."""

    uncertain = True


class DeadlineExceeded(NaradError):
    """The call's overall deadline passed while retrying; ``last`` is the last error
    (also ``__cause__``). ``uncertain`` is true when any attempt's outcome was unknown."""

    def __init__(self, message: str, *, last: NaradError | None, attempts: int, uncertain: bool) -> None:
        super().__init__(message, node=last.node if last is not None else None)
        self.last = last
        self.attempts = attempts
        self.uncertain = uncertain


class ClientClosed(NaradError):
    """The client was closed."""


_BY_STATUS: dict[int, type[ApiError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    410: Gone,
    413: PayloadTooLarge,
    415: UnsupportedMediaType,
    421: Misdirected,
    429: TooManyRequests,
    500: InternalServerError,
    502: BadGateway,
    503: Unavailable,
    504: GatewayTimeout,
}


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (Narad sends delta-seconds; an HTTP date is not used)."""
    if not value:
        return None
    try:
        secs = float(value.strip())
    except ValueError:
        return None
    return secs if secs >= 0 else None


def error_from_response(
    status: int, headers: dict[str, str], body: bytes, *, node: str | None = None, op: str = ""
) -> ApiError:
    """The exception for an error answer. ``op`` refines 410 (``ack`` -> LeaseGone,
    ``replay`` -> OffsetGone) and marks write answers uncertain (``produce``,
    ``write``: a 5xx may have landed)."""
    message = ""
    code: str | None = None
    parsed: dict[str, Any] = {}
    if body:
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            doc = None
        if isinstance(doc, dict):
            parsed = doc
            message = str(doc.get("error", "")) or body[:500].decode("utf-8", "replace")
            c = doc.get("code")
            code = c if isinstance(c, str) else None
        else:
            message = body[:500].decode("utf-8", "replace").strip()
    if not message:
        message = f"HTTP {status}"
    cls: type[ApiError]
    if status == 410:
        cls = LeaseGone if op == "ack" else OffsetGone if op == "replay" else Gone
    elif status == 409 and (code == "topic_changed" or "changed since it was read" in message):
        cls = TopicChanged
    else:
        cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else ApiError)
    retry_after = parse_retry_after(headers.get("retry-after"))
    err = cls(message, status=status, node=node, retry_after=retry_after, code=code, body=parsed)
    if status >= 500 and op == "redrive":
        # a redrive may have moved part of its records before failing: never sent again by
        # itself (another call moves what is left; the counts of this one are unknown)
        err.uncertain = True
        err.retryable = False
    elif status >= 500 and op in ("produce", "write"):
        # Narad: a 503 that carries Retry-After on a produce stored nothing; a metadata
        # write's 503 says when it may have landed. Everything else is ambiguous.
        safe = status == 503 and retry_after is not None and "may have landed" not in message
        err.uncertain = not safe
        err.retryable = safe
    elif status in (502, 503):
        err.retryable = True
    return err
