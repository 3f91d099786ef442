"""What every API handler reaches: configuration, the local metastore replica,
the version counters, the link to the supervisor, the authenticator.

One ``ApiContext`` per worker process; handlers get it at registration. Also
the request-input helpers every handler uses: strict JSON body decoding and
strict query-parameter integers (ASCII digits, bounded).
Imports narad.config, narad.meta and narad.ipc (no transports).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from narad.api.auth import Authenticator
from narad.api.router import Request
from narad.config import Config
from narad.errors import BadRequest
from narad.ipc.rpc import Connection
from narad.meta import validate as VAL
from narad.meta.store import MetaStore
from narad.meta.versions import VersionTable

T = TypeVar("T")
NESTED_TOO_DEEP = "invalid json: nested too deeply"


@dataclass
class ApiContext:
    cfg: Config
    node_id: str
    store: MetaStore
    versions: VersionTable
    sup: Connection
    auth: Authenticator
    worker_index: int = 0
    broker: Any = None  # narad.broker.broker.Broker
    caps: Any = None  # narad.broker.caps.CapTable
    started: float = field(default_factory=time.time)

    @property
    def security(self) -> bool:
        return self.cfg.security.enabled

    async def call(self, req: Any, resp_type: type[T], timeout: float | None = None) -> T:
        if timeout is None:
            timeout = self.cfg.seconds("cluster", "write_timeout") + 5.0
        return await self.sup.call(req, resp_type, timeout)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def decode_why(e: Exception, body: bytes) -> str:
    """msgspec's reason for refusing a JSON body, or a clearer one: it calls a lone
    surrogate escape ("\\ud800" not followed by a low one: no Unicode character, so
    no UTF-8 to store) "Input data was truncated", which does not say what to fix."""
    why = str(e)
    if why == "Input data was truncated" and _SURROGATE_ESCAPE.search(body):
        return ("a \\uD800-\\uDFFF escape that is not a surrogate pair (a lone surrogate is not a "
                "character), or the body ends early")
    return why


def decode_json(req: Request, typ: type[T], *, required: bool = True) -> T:
    """Strict JSON body decoding: unknown fields, trailing data, wrong types,
    integers outside int64 (``VAL.Int64`` fields) and nesting deeper than the
    decoder follows are 400 with the reason."""
    if not req.body.strip():
        if required:
            raise BadRequest("invalid json: request body required")
        return msgspec.json.decode(b"{}", type=typ)
    try:
        return msgspec.json.decode(req.body, type=typ)
    except msgspec.ValidationError as e:
        msg = str(e)
        if msg.startswith("Object contains unknown field"):
            field_name = msg.split("`")[1] if "`" in msg else "?"
            raise BadRequest(f'invalid json: unknown field "{field_name}"') from None
        raise BadRequest(f"invalid json: {msg}") from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"invalid json: {decode_why(e, req.body)}") from None
    except RecursionError:
        raise BadRequest(NESTED_TOO_DEEP) from None


def single_query(req: Request, name: str) -> str | None:
    """The one value of query parameter ``name`` (None when absent); twice is a 400."""
    vals = req.query.get(name)
    if not vals:
        return None
    if len(vals) > 1:
        raise BadRequest(f"invalid argument: {name} given more than once")
    return vals[0]


def parse_int(text: str, name: str, *, minimum: int = 0, maximum: int = VAL.INT64_MAX) -> int:
    """``text`` (a query parameter or a field of a path) as an integer in
    [minimum, maximum]: ASCII digits only (``VAL.strict_int``), else a 400."""
    v = VAL.strict_int(text, minimum=VAL.INT64_MIN)
    if v is None:
        raise BadRequest(f"invalid argument: {name} must be an integer")
    if v < minimum:
        raise BadRequest(f"invalid argument: {name} must be >= {minimum}")
    if v > maximum:
        raise BadRequest(f"invalid argument: {name} must be <= {maximum}")
    return v


def query_int(req: Request, name: str, *, default: int | None = None, minimum: int | None = None,
              maximum: int = VAL.INT64_MAX) -> int | None:
    raw = single_query(req, name)
    if raw is None:
        return default
    return parse_int(raw, name, minimum=VAL.INT64_MIN if minimum is None else minimum, maximum=maximum)


def query_bool(req: Request, name: str, default: bool = False) -> bool:
    vals = req.query.get(name)
    if not vals:
        return default
    v = vals[-1].lower()
    if v in ("1", "true", "t", "yes"):
        return True
    if v in ("0", "false", "f", "no"):
        return False
    raise BadRequest(f"invalid argument: {name} must be true or false")
