"""The naradctl control-socket messages (``run/narad.sock``): one tagged
request naming a command with its arguments, one reply carrying plain data.

Kept apart from the supervisor's services so that naradctl imports only this
and the RPC framing (a naradctl call starts in a fraction of a second). Pure
data; imports msgspec only.
"""

from __future__ import annotations

from typing import Any

import msgspec


class CtlRequest(msgspec.Struct, tag=True):
    cmd: str
    args: dict[str, Any] = {}


class CtlReply(msgspec.Struct):
    data: Any
