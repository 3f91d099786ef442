"""Text the CLI reads and prints: Go-style durations (``12h``, ``1m30s``, ``500ms``),
byte sizes, and a message rendered for a terminal (``[p<P> @<O>] key=<k> <time>
<payload>``), for a pipe (``--raw``: the payload only) or as one JSON object.

Imports narad.client.models, msgspec and the standard library.
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
from typing import Any

import msgspec

from narad.client.models import Message

__all__ = ["format_duration", "message_json", "message_line", "parse_duration", "percentile"]

_UNITS_MS = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0,
             "d": 86_400_000.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h|d)")


def parse_duration(text: str) -> int:
    """Milliseconds in a duration such as ``12h``, ``1h30m``, ``30s``, ``500ms``, ``7d``
    or ``0``, a fraction of a millisecond rounded up (``0.4ms`` is 1 ms, never 0: a 0 means
    "the default" to several options and would silently stand for something else, as the
    SDK's durations do). Raises ValueError saying what is accepted."""
    s = text.strip()
    if s == "0":
        return 0
    pos, total = 0, 0.0
    while pos < len(s):
        m = _PART.match(s, pos)
        if m is None:
            raise ValueError(f"{text!r} is not a duration (such as 12h, 1h30m, 30s, 500ms, 7d or 0)")
        total += float(m.group(1)) * _UNITS_MS[m.group(2)]
        pos = m.end()
    if pos == 0:
        raise ValueError(f"{text!r} is not a duration (such as 12h, 1h30m, 30s, 500ms, 7d or 0)")
    if total <= 0:
        return 0
    return max(1, math.ceil(round(total, 6)))  # (to the ns first: 1.1s is 1100 ms, not 1101; 0.5ns is 1)


def format_duration(ms: int) -> str:
    """Go's spelling of a duration: ``48h0m0s``, ``1m30s``, ``2.5s``, ``500ms``, ``0s``."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if h:
        return f"{h}h{m}m{secs}s"
    if m:
        return f"{m}m{secs}s"
    return f"{secs}s"


def percentile(sorted_values: list[float], p: float) -> float:
    """The ``p`` (0..1) percentile of an ascending list (nearest rank below); 0 if empty."""
    if not sorted_values:
        return 0.0
    return sorted_values[int(p * (len(sorted_values) - 1))]


def format_ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:.2f}ms" if ms < 10 else f"{ms:.1f}ms" if ms < 100 else f"{ms:.0f}ms"


def _key_text(key: bytes) -> str:
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return key.hex() + " (binary)"


def message_line(msg: Message) -> str:
    """The terminal form: ``[p0 @12] key=k 14:03:22 {"id":1}``; binary payloads as
    ``(binary, N bytes)`` and hex on the next line. The extensions a delivery or a
    record has come before the time: ``delivery=N`` from the second delivery on,
    ``headers={...}`` (compact JSON), ``dead-letter-of=topic/pP@O`` (and its count
    and nack reason) for a dead-letter copy."""
    meta = f"[p{msg.partition} @{msg.offset}]"
    if msg.key is not None and msg.key != b"":
        meta += " key=" + _key_text(msg.key)
    if msg.delivery_count is not None and msg.delivery_count > 1:
        meta += f" delivery={msg.delivery_count}"
    if msg.headers:
        meta += " headers=" + json.dumps(msg.headers, separators=(",", ":"), ensure_ascii=False)
    d = msg.dead_letter
    if d is not None:
        meta += f" dead-letter-of={d.topic}/p{d.partition}@{d.offset} after={d.delivery_count}"
        if d.reason:
            meta += " reason=" + json.dumps(d.reason, ensure_ascii=False)
    if msg.timestamp > 0:
        meta += " " + time.strftime("%H:%M:%S", time.localtime(msg.timestamp))
    if msg.payload_kind == "bytes":
        return f"{meta} (binary, {len(msg.payload)} bytes)\n{msg.payload.hex()}"
    return f"{meta} {msg.payload.decode('utf-8', 'replace')}"


def _put_key(d: dict[str, Any], key: bytes | None) -> None:
    """A key as Narad writes it: UTF-8 text, else base64 with ``key_encoding``."""
    if key is None:
        return
    try:
        d["key"] = key.decode("utf-8")
    except UnicodeDecodeError:
        d["key"] = base64.b64encode(key).decode()
        d["key_encoding"] = "base64"


def message_json(msg: Message) -> bytes:
    """One JSON object in Narad's message shape: ``payload`` verbatim when it is JSON,
    a string when it is text, base64 with ``payload_encoding`` when binary; the same
    for ``key``. ``receipt_handle`` and ``delivery_count`` only on a consume;
    ``headers`` and ``dead_letter`` when the record has them."""
    d: dict[str, Any] = {"topic": msg.topic, "partition": msg.partition, "offset": msg.offset}
    _put_key(d, msg.key)
    if msg.payload_kind == "json":
        d["payload"] = msgspec.Raw(msg.payload_json if msg.payload_json is not None else msg.payload)
    elif msg.payload_kind == "text":
        d["payload"] = msg.payload.decode("utf-8", "replace")
    else:
        d["payload"] = base64.b64encode(msg.payload).decode()
        d["payload_encoding"] = "base64"
    d["timestamp"] = msg.timestamp
    if msg.receipt_handle:
        d["receipt_handle"] = msg.receipt_handle
    if msg.delivery_count is not None:
        d["delivery_count"] = msg.delivery_count
    if msg.headers:
        d["headers"] = msg.headers
    dl = msg.dead_letter
    if dl is not None:  # the node's shape (narad.api.messages.dead_letter_json)
        origin: dict[str, Any] = {"topic": dl.topic, "partition": dl.partition, "offset": dl.offset,
                                  "delivery_count": dl.delivery_count}
        _put_key(origin, dl.key)
        if dl.reason is not None:
            origin["reason"] = dl.reason
        if dl.timestamp:
            origin["timestamp"] = dl.timestamp
        d["dead_letter"] = origin
    return msgspec.json.encode(d)


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n}B"
    value = float(n)
    for unit in "KMGTPE":
        value /= 1024
        if value < 1024:
            return f"{value:.1f}{unit}iB"
    return f"{value:.1f}EiB"
