"""Input rules for metadata: topic names and fields, usernames, passwords,
grants, and the one strict integer parser for untrusted text (query
parameters, path and receipt-handle fields) with the bounded integer types
body decoders use. Pure functions that raise narad.errors.BadRequest with a
reason the client can act on. Used by the API handlers (early, on the
receiving worker) and by the metadata service (again, on the leader).

Names are matched with ``fullmatch`` (``$`` would also match before a
trailing newline). Imports narad.errors and narad.meta.records only.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

from narad.errors import BadRequest
from narad.meta.records import Grant

NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")
USER_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
PATTERN_RE = re.compile(r"[A-Za-z0-9._-]*\*?")
PASSWORD_MAX = 72  # bytes: bcrypt's limit
INT64_MAX = (1 << 63) - 1
INT64_MIN = -(1 << 63)
# A JSON body integer: anything outside int64 is a 400 at decode time (it could not be
# sent to the supervisor or stored: msgpack stops at 64 bits).
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
_DIGITS = re.compile(r"-?[0-9]{1,20}")


def strict_int(text: str, *, minimum: int = 0, maximum: int = INT64_MAX) -> int | None:
    """``text`` as an integer in [minimum, maximum], or None: ASCII digits only,
    an optional leading '-' (only meaningful when minimum < 0), no spaces, '+',
    underscores or other Unicode digits (Python's ``int()`` takes all of those;
    Narad's Go parsing takes none)."""
    if not _DIGITS.fullmatch(text) or (text[0] == "-" and minimum >= 0):
        return None
    v = int(text)
    if v < minimum or v > maximum:
        return None
    return v
ACTIONS = ("produce", "consume", "create", "admin")
MIN_RETENTION_MS = 3_600_000
MIN_PARTITIONS = 3


def topic_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise BadRequest("invalid argument: topic name required")
    if name in (".", "..") or not NAME_RE.fullmatch(name):
        raise BadRequest(
            f'invalid argument: topic name "{name[:64]}" must be 1-200 characters of A-Z a-z 0-9 . _ - '
            "and not \".\" or \"..\""
        )
    return name


def partitions(value: int, maximum: int) -> int:
    if value < MIN_PARTITIONS or value > maximum:
        raise BadRequest(f"invalid argument: partitions must be between {MIN_PARTITIONS} and {maximum}, got {value}")
    return value


def retention_ms(value: int) -> int:
    if value < 0 or (value != 0 and value < MIN_RETENTION_MS):
        raise BadRequest(
            f"invalid argument: retention_ms must be 0 (forever) or at least {MIN_RETENTION_MS} (1 h), got {value}"
        )
    return value


MAX_DELIVERIES_CAP = 1000
MIN_IDEM_WINDOW_MS, MAX_IDEM_WINDOW_MS = 1000, 86_400_000


def max_deliveries(value: int) -> int:
    if not 0 <= value <= MAX_DELIVERIES_CAP:
        raise BadRequest(f"invalid argument: max_deliveries must be 0 (unlimited) to {MAX_DELIVERIES_CAP}, got {value}")
    return value


def idempotency_window_ms(value: int) -> int:
    if value != 0 and not MIN_IDEM_WINDOW_MS <= value <= MAX_IDEM_WINDOW_MS:
        raise BadRequest(f"invalid argument: idempotency_window_ms must be 0 (the default, 5 min) or "
                         f"{MIN_IDEM_WINDOW_MS} to {MAX_IDEM_WINDOW_MS} (24 h), got {value}")
    return value


def positive_or_default(field: str, value: int | None, default: int) -> int:
    if value is None or value == 0:
        return default
    if value < 0:
        raise BadRequest(f"invalid argument: {field} must be positive, got {value}")
    return value


def username(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise BadRequest("invalid argument: username required")
    if name in (".", "..") or not USER_RE.fullmatch(name):
        raise BadRequest("invalid argument: username must be 1-64 characters of A-Z a-z 0-9 . _ - and not . or ..")
    return name


def is_username(name: str) -> bool:
    """True when ``name`` could be a user (the format rule, no lookup)."""
    return name not in (".", "..") and USER_RE.fullmatch(name) is not None


def password(pw: object, field: str = "password") -> bytes:
    if not isinstance(pw, str) or not pw:
        raise BadRequest(f"invalid argument: {field} required")
    raw = pw.encode("utf-8", "surrogateescape")
    if len(raw) > PASSWORD_MAX:
        raise BadRequest(f"invalid argument: {field} must be at most {PASSWORD_MAX} bytes")
    return raw


def grants(items: list[Grant]) -> list[Grant]:
    out: list[Grant] = []
    for g in items:
        if g.action not in ACTIONS:
            raise BadRequest(f'invalid argument: unknown grant action "{g.action}" (produce, consume, create, admin)')
        if g.action == "admin":
            if g.patterns:
                raise BadRequest("invalid argument: the admin grant takes no patterns")
        else:
            if not g.patterns:
                raise BadRequest(f'invalid argument: the "{g.action}" grant needs at least one topic pattern')
            for p in g.patterns:
                if not p or len(p) > 255 or not PATTERN_RE.fullmatch(p):
                    raise BadRequest(
                        f'invalid argument: grant pattern "{p[:64]}" must be a topic name or a prefix ending '
                        "in a single *"
                    )
        out.append(Grant(g.action, list(g.patterns)))
    return out
