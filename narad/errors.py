"""Every error narad reports, and the one mapping from error to HTTP status.

Lives at the bottom of the import graph: any module may raise these, and the
transports (narad.api) turn them into ``{"error": "..."}`` responses with the
status and headers carried here. Internal RPC (narad.ipc) carries the status
and message across process boundaries and re-raises the same class.
Touches nothing else.
"""

from __future__ import annotations

from typing import ClassVar


class NaradError(Exception):
    """Base class: an error with an HTTP status, a message for the client and
    optional extra response headers / JSON fields."""

    status: ClassVar[int] = 500
    default_message: ClassVar[str] = "internal error"

    def __init__(
        self,
        message: str | None = None,
        *,
        code: str | None = None,
        headers: list[tuple[str, str]] | None = None,
        extra: dict[str, object] | None = None,
    ) -> None:
        self.message = message if message is not None else self.default_message
        self.code = code
        self.headers = headers or []
        self.extra = extra or {}
        super().__init__(self.message)

    def body(self) -> dict[str, object]:
        out: dict[str, object] = {"error": self.message}
        if self.code:
            out["code"] = self.code
        out.update(self.extra)
        return out


# Error codes a caller acts on (the ``code`` of the JSON body, carried across RPC).
# A 503 with this code means the attach point sent with an attach or create-as-child
# does not fit the parent (none could be read, or the parent moved since): the write
# was not proposed, and only the receiving node can read the point again, so the
# metadata router does not retry it; the receiving worker does.
ATTACH_POINT = "attach_point"


class BadRequest(NaradError):
    status = 400
    default_message = "bad request"


class Unauthorized(NaradError):
    status = 401
    default_message = "authentication required"

    def __init__(self, message: str | None = None, **kw: object) -> None:
        super().__init__(message, headers=[("WWW-Authenticate", 'Basic realm="narad"')], **kw)  # type: ignore[arg-type]


class Forbidden(NaradError):
    status = 403
    default_message = "forbidden"


class NotFound(NaradError):
    status = 404
    default_message = "not found"


class MethodNotAllowed(NaradError):
    status = 405
    default_message = "method not allowed"

    def __init__(self, allow: list[str]) -> None:
        super().__init__("method not allowed", headers=[("Allow", ", ".join(sorted(allow)))])


class Conflict(NaradError):
    status = 409
    default_message = "conflict"


class Gone(NaradError):
    status = 410
    default_message = "gone"


class PreconditionFailed(NaradError):
    """The cluster cannot do this yet: a member that holds a needed Raft entry type
    back (an older release) is named in the message."""

    status = 412
    default_message = "precondition failed"


class PayloadTooLarge(NaradError):
    status = 413
    default_message = "request body too large"


class UnsupportedMediaType(NaradError):
    status = 415
    default_message = (
        "state-changing requests must send Content-Type: application/json or "
        "application/octet-stream, or an X-Narad-Client header"
    )


class Misdirected(NaradError):
    status = 421
    default_message = "misdirected request"


class TooManyRequests(NaradError):
    status = 429
    default_message = "too many requests"


class HeadersTooLarge(NaradError):
    status = 431
    default_message = "request header fields too large"


class InternalError(NaradError):
    status = 500
    default_message = "internal error"


class NotImplementedYet(NaradError):
    status = 501
    default_message = "not implemented"


class BadGateway(NaradError):
    status = 502
    default_message = "bad gateway"


class Unavailable(NaradError):
    status = 503
    default_message = "service unavailable"


class SchemaValidationBusy(NaradError):
    """Schema validation capacity stayed busy for 5 s: nothing was stored, retry."""

    status = 503
    default_message = "schema: validation capacity busy, retry"

    def __init__(self, message: str | None = None, **kw: object) -> None:
        super().__init__(message, headers=[("Retry-After", "1")], **kw)  # type: ignore[arg-type]


class GatewayTimeout(NaradError):
    status = 504
    default_message = "timed out"


class ConfigError(Exception):
    """A configuration problem found at start: the node refuses to start."""


class FailStop(Exception):
    """The metastore cannot apply a committed entry (unknown type, disk refused
    the write): the node must stop instead of skipping it."""

    def __init__(self, message: str, *, index: int, entry_type: int) -> None:
        super().__init__(message)
        self.index = index
        self.entry_type = entry_type


_BY_STATUS: dict[int, type[NaradError]] = {
    cls.status: cls
    for cls in (
        BadRequest,
        Unauthorized,
        Forbidden,
        NotFound,
        Conflict,
        Gone,
        PreconditionFailed,
        PayloadTooLarge,
        UnsupportedMediaType,
        Misdirected,
        TooManyRequests,
        HeadersTooLarge,
        InternalError,
        NotImplementedYet,
        BadGateway,
        Unavailable,
        GatewayTimeout,
    )
}


def error_for_status(
    status: int, message: str, code: str | None = None, extra: dict[str, object] | None = None
) -> NaradError:
    """Rebuild an error received over internal RPC from its status and message."""
    cls = _BY_STATUS.get(status, InternalError)
    if cls is Unauthorized:
        return Unauthorized(message, code=code, extra=extra)
    err = cls(message, code=code, extra=extra)
    if cls is InternalError and status != 500:
        err.status = status  # type: ignore[misc]
    return err
