"""The message envelope shared with the Go SDK (narad-go), opt-in.

An enveloped payload is one JSON object
``{"_narad":1,"id","body","produced_at","attempts","last_error","headers"}``:
``body`` is the message itself (any JSON value, embedded verbatim), ``id`` a
UUIDv7 (sorts by creation), ``produced_at`` Unix milliseconds, ``attempts`` how
many times it was published (from 1; moved only by a republish, never by a
redelivery), ``last_error`` and ``headers`` optional. A payload is an envelope
only when it is a JSON object holding the ``_narad`` key, so a plain message
with an ``id`` field is never mistaken for one. ``attempts``, ``last_error`` and
``headers`` are left out when empty, as the Go client writes them.

Imports the standard library and msgspec only.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = ["Envelope", "new_id", "unwrap", "wrap"]

MARKER = "_narad"


class _Wire(msgspec.Struct, omit_defaults=True, kw_only=True):
    # field order is the Go client's; the first four are always written
    version: int = msgspec.field(name="_narad")
    id: str
    body: msgspec.Raw
    produced_at: int
    attempts: int = 0
    last_error: str = ""
    headers: dict[str, str] = msgspec.field(default_factory=dict)


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(_Wire)
_probe = msgspec.json.Decoder(dict[str, msgspec.Raw])


@dataclass(frozen=True, slots=True)
class Envelope:
    """A decoded envelope. ``body`` is the raw JSON of the message inside it."""

    id: str
    body: bytes
    produced_at: int = 0
    attempts: int = 1
    last_error: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    version: int = 1

    def json(self) -> Any:
        """The message inside, decoded from JSON."""
        return msgspec.json.decode(self.body)


_lock = threading.Lock()
_last_ms = 0
_seq = 0


def _tick() -> tuple[int, int]:
    """(Unix ms, 12-bit sequence): ids made in one millisecond still sort in order."""
    global _last_ms, _seq
    with _lock:
        while True:
            now = time.time_ns() // 1_000_000
            if now > _last_ms:
                _last_ms, _seq = now, 0
                return now, 0
            if _seq < 0xFFF:  # same millisecond, or the clock went back: keep counting on the last one
                _seq += 1
                return _last_ms, _seq
            time.sleep(0.001)


def new_id() -> str:
    """A UUIDv7: 48 bits of Unix ms, a 12-bit sequence (in place of rand_a), random bits."""
    ms, seq = _tick()
    b = bytearray(os.urandom(16))
    b[0:6] = ms.to_bytes(6, "big")
    b[6] = 0x70 | (seq >> 8)
    b[7] = seq & 0xFF
    b[8] = (b[8] & 0x3F) | 0x80
    h = b.hex()
    return f"{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def wrap(
    body_json: bytes,
    *,
    id: str | None = None,
    attempts: int = 1,
    last_error: str = "",
    headers: dict[str, str] | None = None,
    produced_at: int | None = None,
) -> bytes:
    """The envelope bytes around ``body_json`` (one JSON text, embedded verbatim)."""
    try:
        msgspec.json.decode(body_json)
    except msgspec.DecodeError:
        raise ValueError("an envelope needs a JSON message (the body is not one JSON text)") from None
    wire = _Wire(
        version=1,
        id=id or new_id(),
        body=msgspec.Raw(body_json),
        produced_at=produced_at if produced_at is not None else time.time_ns() // 1_000_000,
        attempts=max(1, attempts),
        last_error=last_error,
        headers=dict(headers or {}),
    )
    return _enc.encode(wire)


def unwrap(payload: bytes) -> Envelope | None:
    """The envelope in ``payload``, or None when it is not one."""
    if not payload or payload.lstrip()[:1] != b"{":
        return None
    try:
        probe = _probe.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return None
    if MARKER not in probe:
        return None
    try:
        w = _dec.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return None
    return Envelope(id=w.id, body=bytes(w.body), produced_at=w.produced_at, attempts=w.attempts,
                    last_error=w.last_error, headers=dict(w.headers), version=w.version)
