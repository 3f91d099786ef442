"""Message routes: produce (single and batch), consume (lease, batch, long
poll, replay) and ack (ack / extend / nack, single and batch).

Handlers check the request (Narad's rules and status codes), then call the
worker's broker: a produce returns 202 only after the WAL sync that covers it;
a consume reserves before it reads; acks go to each partition's owner.

Headers (issue 14, an extension): ``headers`` (string to string) on a batch
message, or ``?header=name:value`` (repeatable) on a single produce; bounded
(``MAX_HEADERS`` entries, names ``MAX_HEADER_NAME`` bytes of ``[A-Za-z0-9._-]``,
``MAX_HEADERS_BYTES`` in all), stored in the record's extension block and
returned as ``headers`` on consume (children get them with the record).

Extensions (issue 14, optional, absent = Narad's behaviour): ``delay`` on a nack
(``extend=0``; query or batch body field, 0 to 12 h) holds the record back that
long; ``visibility`` on a consume (this delivery's lease length) and on an extend
(``extend=true``: the new lease length), 1 s to 12 h. Go duration syntax.
``idempotency_key`` on a produce (single: query parameter; batch: message field;
1 to 128 bytes of UTF-8): the key rides in the record's extension block, a keyless
message hashes to its partition by it, and the answer waits (after the WAL sync)
up to ``IDEM_WAIT_S`` for the owner's commit verdict: single 202
``{"duplicate": bool}``, batch 202 ``{"accepted": N, "duplicates": D}`` (N counts
duplicates too); verdicts not in by then are ``"pending"`` (single
``{"duplicate": null, "pending": true}``, batch ``"pending": K`` beside
``duplicates``, which counts the verdicts known). Produces without a key take
the same path and give the same answers as before (the fast path included).
``reason`` on a nack (query, or batch body field; at most 256 bytes of UTF-8)
is kept for the record's dead-letter copy. ``POST /v1/topics/{dlt}/redrive``
moves a dead-letter topic's records back to their origin topics.

Imports narad.api.{context,router}, narad.broker, narad.meta, narad.errors.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import logging
import os
import re
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from typing import Annotated, Any, overload

import msgspec

from narad._native import ffi as native_ffi
from narad._native import lib as native
from narad.api.context import NESTED_TOO_DEEP, ApiContext, decode_why, parse_int
from narad.api.hangup import cancel_on_hangup
from narad.api.router import Reply, Request, Response, Router, empty, json_response
from narad.broker import caps as CAPS
from narad.broker.broker import ACK, EXTEND, NACK, DirectBatch, DirectGroup, hop_unknown
from narad.broker.dispatcher import Watch
from narad.broker.peers import Item
from narad.broker.routing import crc32c, key_partition
from narad.broker.validation import ValidationCapacity
from narad.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    Gone,
    InternalError,
    NotFound,
    PayloadTooLarge,
    TooManyRequests,
    Unavailable,
    UnsupportedMediaType,
)
from narad.meta import grants as G
from narad.meta import versions as V
from narad.meta.records import TopicRecord
from narad.meta.schemas import PayloadValidator
from narad.meta.validate import INT64_MAX, INT64_MIN, strict_int
from narad.storage import frames as FR
from narad.storage.frames import F_EXT, F_JSON, F_UTF8
from narad.storage.wal import Entry, WALFailed

log = logging.getLogger("narad.api.messages")

MAX_MESSAGE = 1 << 20
MAX_BATCH_MESSAGES = 1000
MAX_BATCH_BODY = 16 << 20
MAX_CONSUME_BATCH = 100
MAX_ACK_BATCH = 100
ACK_BODY_LIMIT = 64 << 10
RESPONSE_BUDGET = 8 << 20
GONE_HANDLE = "receipt handle no longer matches an active reservation"
DRAINING = "node is draining (decommission): produce to another node"

_raw_json = msgspec.json.Decoder(msgspec.Raw)
_enc = msgspec.json.Encoder()
_DUR = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|ms|s|m|h)")  # ASCII digits, as Go
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_MSG_IDX = re.compile(r"\$\.messages\[(\d+)\]")
IDEM_PARAM = "idempotency_key"
MAX_IDEM_KEY = 128  # bytes of UTF-8
# How long a produce with idempotency keys waits for the owners' verdicts (the env: a test seam).
IDEM_WAIT_S = float(os.environ.get("NARAD_FAULT_IDEM_WAIT_MS", "5000") or 5000) / 1000


def _retrieve(f: asyncio.Future[Any]) -> None:
    """Read a future's outcome nobody waits for any more (no "never retrieved" warning)."""
    if not f.cancelled():
        f.exception()


_BODY_SETTINGS = ("delay", "visibility", "reason")


def _no_body_settings(body: bytes) -> None:
    """A single-form ack (``receipt_handle`` in the query) reads no body, as Narad's;
    but a body that gives this extension's ``delay``, ``visibility`` or ``reason``
    meant them, and acting without them (a nack at once instead of a delayed one) is
    a silent loss of what was asked: 400, saying where they go. Any other body is
    ignored as before (Narad clients may send one)."""
    if not any(f.encode() in body for f in _BODY_SETTINGS):
        return  # (the common case: no such word at all, nothing decoded)
    try:
        doc = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return
    if isinstance(doc, dict):
        given = [f for f in _BODY_SETTINGS if f in doc]
        if given:
            raise BadRequest(f"invalid argument: {', '.join(given)} in the body is read only by the batch form "
                             f"(no receipt_handle in the query); give it as a query parameter")


def idem_key(raw: str) -> bytes:
    """An idempotency key's UTF-8 (1 to 128 bytes), else 400."""
    try:
        b = raw.encode()
    except UnicodeEncodeError:  # non-UTF-8 bytes in the query (kept as surrogates) or a lone surrogate
        raise BadRequest("invalid argument: idempotency_key must be UTF-8") from None
    if not 1 <= len(b) <= MAX_IDEM_KEY:
        raise BadRequest(f"invalid argument: idempotency_key must be 1 to {MAX_IDEM_KEY} bytes, got {len(b)}")
    return b


_DUP_BODIES = (msgspec.json.encode({"duplicate": False}), msgspec.json.encode({"duplicate": True}))


def dup_answer(dup: bool) -> Response:
    """``json_response(202, {"duplicate": dup})`` from bytes encoded once."""
    return Response(202, _DUP_BODIES[dup], "application/json", [])


MAX_DURATION_CHARS = 100  # a Go duration string longer than this is refused unread


def parse_go_duration(text: str) -> float:
    """A Go duration string ("1h30m", "250ms", "1.5s") in seconds; ValueError when
    it is not one. Linear in the text: each term is matched where the previous one
    ended (``finditer`` over a long run of digits retried the match from every
    position: quadratic, seconds of a worker's loop for a 12,000-digit value), and a
    text over ``MAX_DURATION_CHARS`` is refused before any matching."""
    if len(text) > MAX_DURATION_CHARS:
        raise ValueError("too long")
    if text in ("0", "+0", "-0"):
        return 0.0
    if text.startswith("-"):
        raise ValueError("negative")
    s = text[1:] if text.startswith("+") else text
    pos, total, n = 0, 0.0, len(s)
    match = _DUR.match
    while pos < n:
        m = match(s, pos)
        if m is None:
            raise ValueError(text)
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos == 0:
        raise ValueError(text)
    return total


def format_go_duration(seconds: float) -> str:
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{round(seconds * 1000)}ms"


def payload_flags(payload: bytes) -> int:
    try:
        _raw_json.decode(payload)
        return F_JSON | F_UTF8
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        pass  # not JSON (or nested deeper than the decoder follows): kept as text or bytes
    try:
        payload.decode()
        return F_UTF8
    except UnicodeDecodeError:
        return 0


class MessageOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Narad's ``Message`` (fields that are None are left out)."""

    topic: str
    partition: int
    offset: int
    key: str | None = None
    key_encoding: str | None = None
    payload: Any
    payload_encoding: str | None = None
    timestamp: int
    receipt_handle: str | None = None
    # Extensions (issue 14): absent unless the record or the delivery has them.
    delivery_count: int | None = None  # consume: this lease is the record's n-th delivery
    headers: msgspec.Raw | None = None  # the stored JSON object text (string to string)
    dead_letter: dict[str, Any] | None = None  # a dead-lettered record: where it came from


def _key_out(key: bytes | None) -> tuple[str | None, str | None]:
    if key is None:
        return None, None
    try:
        return key.decode(), None
    except UnicodeDecodeError:
        return base64.b64encode(key).decode(), "base64"


def dead_letter_json(d: FR.DeadLetter) -> dict[str, Any]:
    key, key_enc = _key_out(d.k)
    out: dict[str, Any] = {"topic": d.t, "partition": d.p, "offset": d.o, "delivery_count": d.c}
    if key is not None:
        out["key"] = key
        if key_enc is not None:
            out["key_encoding"] = key_enc
    if d.r is not None:
        out["reason"] = d.r
    if d.ts:
        out["timestamp"] = d.ts // 1000
    return out


def render(topic: str, it: Item, handle: bool) -> MessageOut:
    key, key_enc = _key_out(it.key)
    payload_enc = None
    f = it.flags
    body = it.payload
    headers = dead = None
    if f & FR.F_EXT:
        hs, he, pos = FR.plain_block(body)  # a key alone (never shown) or headers alone: read in place
        if pos >= 0:
            if he > hs:
                if body[hs] != 0x7B or body[he - 1] != 0x7D:  # not shaped as a JSON object: a damaged block
                    f &= ~(F_JSON | F_UTF8)
                    pos = 0
                else:
                    headers = msgspec.Raw(body[hs:he])
            if pos:
                body = body[pos:]
        else:
            try:
                ext, pos = FR.ext_at(body)
                h = ext.h
                # Written only from checked headers (with_ext; dead-letter copies and redrive
                # carry those bytes on) under the record's CRC: trusted as JSON, as a body
                # flagged F_JSON is; a block not even shaped as an object is a damaged one.
                if h and (h[:1] != b"{" or h[-1:] != b"}"):
                    raise FR.FrameError("headers in the extension block are not a JSON object")
                dead = dead_letter_json(ext.d) if ext.d is not None else None
                headers = msgspec.Raw(h) if h else None
                body = body[pos:]
            except FR.FrameError:
                f &= ~(F_JSON | F_UTF8)  # a damaged block: the stored bytes are shown as they are (base64)
    payload: Any
    if f & F_JSON:
        payload = msgspec.Raw(body)
    elif f & F_UTF8:
        payload = body.decode()
    else:
        payload, payload_enc = base64.b64encode(body).decode(), "base64"
    return MessageOut(topic=topic, partition=it.partition, offset=it.offset, key=key, key_encoding=key_enc,
                      payload=payload, payload_encoding=payload_enc, timestamp=it.ts_ms // 1000,
                      receipt_handle=f"{it.partition}:{it.offset}:{it.nonce}" if handle else None,
                      delivery_count=(it.deliveries or None) if handle else None, headers=headers,
                      dead_letter=dead)


class _Leased(msgspec.Struct, omit_defaults=True):
    """A leased record without a key as ``MessageOut`` writes it (the same fields in
    the same order), built positionally: the consume path's common case."""

    topic: str
    partition: int
    offset: int
    payload: Any
    timestamp: int
    receipt_handle: str
    delivery_count: int | None = None
    headers: msgspec.Raw | None = None


class _LeasedKey(msgspec.Struct, omit_defaults=True):
    """``_Leased`` with a UTF-8 key."""

    topic: str
    partition: int
    offset: int
    key: str
    payload: Any
    timestamp: int
    receipt_handle: str
    delivery_count: int | None = None
    headers: msgspec.Raw | None = None


# ``render_leased``'s tables of the two commonest blocks, read in place with slices built
# once. Headers alone whose JSON text is 1 to 122 bytes (a bin8), by the block's first
# seven bytes (its one-byte length 5 + m, a one-entry map, its key "h", bin8, the text's
# length m and its opening brace) -> (the text's slice, the body's slice, the index of
# the text's last byte, which must be its closing brace). An idempotency key alone, by
# the block's first byte (its length b0: the body begins at b0 + 1) -> (the slice of the
# head, the head it must be: b0, the map, "i" and the key's type, a fixstr of b0 - 4
# bytes, 0 to 31, or a str8 and its length b0 - 5, 32 to 122), None for a length no such
# block has (a list index and one compare: no head hashed and looked up, no call). A
# record that ends within its block leaves an empty body: ``plain_block`` then reads it.
_HEADERS_HEADS: dict[bytes, tuple[slice, slice, int]] = {
    bytes((5 + m, 0x81, 0xA1, 0x68, 0xC4, m, 0x7B)): (slice(6, 6 + m), slice(6 + m, None), 5 + m)
    for m in range(1, 123)
}
_KEY_HEADS: list[tuple[slice, bytes] | None] = [None] * 256
for _n in range(32):
    _KEY_HEADS[4 + _n] = (slice(0, 5), bytes((4 + _n, 0x81, 0xA1, 0x69, 0xA0 | _n)))
for _n in range(32, 123):
    _KEY_HEADS[5 + _n] = (slice(0, 6), bytes((5 + _n, 0x81, 0xA1, 0x69, 0xD9, _n)))
del _n
_Raw = msgspec.Raw


def render_leased(topic: str, it: Item) -> MessageOut | _Leased | _LeasedKey:
    """``render(topic, it, True)``, encoding to the same bytes, for a consume: the
    common records (a JSON or UTF-8 body, a UTF-8 key or none, no extension block or
    one holding a key alone or headers alone) without building a ``MessageOut``
    (keywords, twelve fields); anything else, a damaged block included, is ``render``'s."""
    f = it.flags
    body = it.payload
    hdr = None
    if f & F_EXT:
        # ``plain_block``'s two commonest cases inline (a call less a message): headers alone
        # and an idempotency key alone, told apart by the map's first key (the fourth byte)
        # and named by the block's first bytes (``_HEADERS_HEADS``, ``_KEY_HEADS``); anything
        # else, or a record shorter than its block, goes through ``plain_block``.
        rest = None
        try:
            if body[3] == 0x68:
                h = _HEADERS_HEADS.get(body[:7])
                if h is not None:
                    hs, cut, last = h
                    if body[last] == 0x7D:
                        hdr = _Raw(body[hs])
                        rest = body[cut]
            else:
                b0 = body[0]
                kh = _KEY_HEADS[b0]
                if kh is not None and body[kh[0]] == kh[1]:
                    rest = body[b0 + 1 :]  # (a key under 32 bytes, a fixstr; or 32 to 122, a str8: a UUID)
        except IndexError:  # (shorter than its block: ``plain_block`` says so)
            pass
        if rest:  # (empty: the record ends within its block, or is not one of these two)
            body = rest
        else:
            hs, he, pos = FR.plain_block(body)
            if pos < 0 or (he > hs and (body[hs] != 0x7B or body[he - 1] != 0x7D)):
                return render(topic, it, True)
            hdr = _Raw(body[hs:he]) if he > hs else None
            body = body[pos:]
    if f & F_JSON:
        pay: Any = _Raw(body)
    elif f & F_UTF8:
        pay = body.decode()
    else:
        return render(topic, it, True)
    p, o = it.partition, it.offset
    k = it.key
    if k is None:
        return _Leased(topic, p, o, pay, it.ts_ms // 1000, f"{p}:{o}:{it.nonce}", it.deliveries or None, hdr)
    try:
        ks = k.decode()
    except UnicodeDecodeError:
        return render(topic, it, True)
    return _LeasedKey(topic, p, o, ks, pay, it.ts_ms // 1000, f"{p}:{o}:{it.nonce}", it.deliveries or None, hdr)


class DeferredEntries(Sequence[Entry]):
    """A one-pass keyed batch's entries (``MessagesAPI._keyed_entries``), each message's
    ``Entry`` built only when something reads one: the WAL, and what ``Broker.direct``
    leaves to it (a partition owned elsewhere, a direct commit that failed). The direct
    commits read the groups' records instead, so the common batch builds none (an
    ``Entry`` and its append were about 1k instructions a message). Built from the groups
    (each partition's indexes in batch order, their records and keys), in batch order,
    once; a record that is the body alone (no ``F_EXT``, a key) gets its key's block, as
    the WAL stores it."""

    __slots__ = ("_built", "_given", "_groups", "_inc", "_n", "_now", "_topic")

    def __init__(self, n: int, groups: dict[int, DirectGroup], topic: str, inc: bytes, now: int,
                 given: set[int] | None = None) -> None:
        self._n, self._groups, self._topic, self._inc, self._now = n, groups, topic, inc, now
        self._given = given  # the indexes of messages whose partition the client gave (not ``Entry.placed``)
        self._built: list[Entry] | None = None

    def __len__(self) -> int:
        return self._n

    def built(self) -> list[Entry]:
        es = self._built
        if es is None:
            out: list[Entry | None] = [None] * self._n
            topic, inc, now = self._topic, self._inc, self._now
            ext = FR.F_EXT
            given = self._given or ()
            for part, (idx, records, iks) in self._groups.items():
                for i, (key, flags, body), ik in zip(idx, records, iks or [None] * len(idx), strict=True):
                    placed = key is None and ik is not None and i not in given
                    if ik is not None and not flags & ext:  # (the body alone: the WAL stores its block too)
                        out[i] = Entry(topic, inc, part, now, flags | ext, key, FR.pack_idem(ik.encode(), body),
                                       placed=placed)
                    else:
                        out[i] = Entry(topic, inc, part, now, flags, key, body, placed=placed)
            assert None not in out, "every message is in one group"
            es = self._built = out  # type: ignore[assignment]
        return es

    @overload
    def __getitem__(self, i: int) -> Entry: ...
    @overload
    def __getitem__(self, i: slice) -> list[Entry]: ...
    def __getitem__(self, i: int | slice) -> Entry | list[Entry]:
        return self.built()[i]

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.built())


class BatchMsg(msgspec.Struct, forbid_unknown_fields=True):
    payload: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    payload_encoding: str | None = None
    key: str | None = None
    key_encoding: str | None = None
    partition: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)] | None = None
    # extension (issue 14): the JSON text as given (a string to string object, or null),
    # checked and made the stored text by ``batch_headers``
    headers: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    idempotency_key: str | None = None  # extension (issue 14)


MAX_HEADERS = 32
MAX_HEADER_NAME = 128
MAX_HEADERS_BYTES = 8192  # names and values together, UTF-8
_HEADER_NAME = re.compile(r"[A-Za-z0-9._-]+")
_GOOD_NAMES: set[str] = set()  # header names already checked (clients repeat a few): one set lookup each


def headers_text(h: dict[str, str]) -> bytes:
    """The message's headers checked within their bounds (400 naming what to fix),
    as the JSON text they are stored and returned as (``FR.headers_json``). The
    byte bound is read off that text in the common case: it holds every name and
    value's UTF-8 and more (quotes, colons, commas, escapes), so a text within the
    bound means headers within it; only a longer one is counted exactly."""
    if len(h) > MAX_HEADERS:
        raise BadRequest(f"invalid argument: at most {MAX_HEADERS} headers per message, got {len(h)}")
    if not _GOOD_NAMES.issuperset(h):  # the common case (names seen before) is one C call
        for name in h:
            if not name or len(name) > MAX_HEADER_NAME or not _HEADER_NAME.fullmatch(name):
                raise BadRequest(f"invalid argument: header name {name[:40]!r} must be 1 to "
                                 f"{MAX_HEADER_NAME} characters of A-Z a-z 0-9 . _ -")
        if len(_GOOD_NAMES) >= 4096:
            _GOOD_NAMES.clear()
        _GOOD_NAMES.update(h)
    try:
        text = FR.headers_json(h)
    except UnicodeEncodeError:  # a lone surrogate (a query's value; a JSON body's is refused when decoded)
        bad = next((n for n, v in h.items() if not _utf8_ok(v)), "?")
        raise BadRequest(f"invalid argument: header {bad!r} is not valid UTF-8") from None
    if len(text) > MAX_HEADERS_BYTES and sum(len(n) + len(v.encode()) for n, v in h.items()) > MAX_HEADERS_BYTES:
        raise BadRequest(f"invalid argument: headers larger than {MAX_HEADERS_BYTES} bytes in all")
    return text


_hdr_dec = msgspec.json.Decoder(dict[str, str])


def batch_headers(raw: msgspec.Raw) -> bytes | None:
    """A batch message's ``headers`` (the JSON text of the value as given; the body's
    decoder checked its syntax) as ``headers_text`` stores them, or None (null or an
    empty object), or the 400 naming what to fix. A text that already is what
    ``headers_text`` would make of it (``headers_canonical`` in native/narad_native.c:
    compact, ASCII without escapes, names by the rule and none twice, within the
    bounds; the common case) is stored as it is, without decoding it into a dict and
    encoding that again; any other goes through the dict, as a batch's headers did
    before. ``headers_canonical_all`` checks a whole batch's texts in one call."""
    t = bytes(raw)
    if native.headers_canonical(t, len(t)):
        return t
    if t == b"null":
        return None
    try:
        h = _hdr_dec.decode(t)
    except msgspec.ValidationError as e:
        raise BadRequest(f"invalid json: {str(e).replace('`$', '`$.headers', 1)}") from None
    except msgspec.DecodeError as e:  # (invalid UTF-8: the body's decoder skipped the text unread)
        raise BadRequest(f"invalid json: headers: {e}") from None
    return headers_text(h) if h else None


def _utf8_ok(v: str) -> bool:
    try:
        v.encode()
    except UnicodeEncodeError:
        return False
    return True


def query_headers(vals: list[str]) -> bytes:
    """``?header=name:value`` (repeatable; the first ``:`` splits) as the stored JSON
    text (``headers_text``); a name given twice is a 400 (which one was meant is
    unknowable)."""
    out: dict[str, str] = {}
    for v in vals:
        name, sep, value = v.partition(":")
        if not sep:
            raise BadRequest(f'invalid argument: header must be "name:value", got {v[:40]!r}')
        if name in out:
            raise BadRequest(f"invalid argument: header {name[:40]!r} given twice")
        out[name] = value
    return headers_text(out)


def with_ext(flags: int, body: bytes, headers: bytes | None, idem: bytes | None = None) -> tuple[int, bytes]:
    """The stored (flags, payload) of a message: with an extension block when it has
    headers (their checked JSON text, ``headers_text``) or an idempotency key (its
    UTF-8, ``idem_key``) (F_JSON / F_UTF8 still describe the body)."""
    if idem is None:
        if headers is None:
            return flags, body
        return flags | FR.F_EXT, FR.pack_headers(headers, body)
    if headers is None:
        return flags | FR.F_EXT, FR.pack_idem(idem, body)
    return flags | FR.F_EXT, FR.pack_ext(FR.Ext(i=idem.decode(), h=headers), body)


class BatchBody(msgspec.Struct, forbid_unknown_fields=True):
    messages: list[BatchMsg] | msgspec.UnsetType = msgspec.UNSET


class AckBody(msgspec.Struct, forbid_unknown_fields=True):
    receipt_handles: list[str] | msgspec.UnsetType = msgspec.UNSET
    delay: str | msgspec.UnsetType = msgspec.UNSET  # a nack's delay (extension, issue 14)
    visibility: str | msgspec.UnsetType = msgspec.UNSET  # an extend's lease length (extension)
    reason: str | msgspec.UnsetType = msgspec.UNSET  # a nack's reason (extension, issue 14)


_batch_dec = msgspec.json.Decoder(BatchBody)
_ack_dec = msgspec.json.Decoder(AckBody)
_count_dec = msgspec.json.Decoder(dict[str, list[msgspec.Raw]])


_waits = functools.lru_cache(maxsize=256)(parse_go_duration)  # consume's ?wait= (clients repeat one value)
MAX_DELAY_S = 12 * 3600.0  # a nack's delay: 0 to 12 h
MIN_VISIBILITY_S, MAX_VISIBILITY_S = 1.0, 12 * 3600.0  # a consume's or an extend's lease length


def duration_ms(raw: str, name: str, lo: float, hi: float) -> int:
    """A Go duration argument within [lo, hi] seconds, in whole ms rounded up (a delay
    or a lease is never shorter than asked), 400 otherwise."""
    try:
        sec = _waits(raw)
    except ValueError:
        raise BadRequest(f'invalid argument: {name} must be a duration such as "30s", "2m" or "1h" '
                         f"(units ns, us, ms, s, m, h), got {raw[:32]!r}") from None
    if not lo <= sec <= hi:
        raise BadRequest(f"invalid argument: {name} must be from {format_go_duration(lo)} to 12h, got {raw[:32]!r}")
    return -(-round(sec * 1e9) // 1_000_000)  # (via whole ns: 0.1 s is 100 ms, not 101)
_SETTLED: dict[str, Any] = {"status": 204}
_GONE_RESULT: dict[str, Any] = {"status": 410, "error": GONE_HANDLE}
_HANDLE = re.compile(r"([0-9]{1,20}):([0-9]{1,20}):([0-9]{1,20})")


def _handle_fields(h: str) -> tuple[int, int, int] | None:
    """``partition:offset:nonce`` exactly as _parse_handle reads it (each ASCII digits
    within int64), in one regular-expression match."""
    m = _HANDLE.fullmatch(h)
    if m is None:
        return None
    p, off, nonce = int(m[1]), int(m[2]), int(m[3])
    if p > INT64_MAX or off > INT64_MAX or nonce > INT64_MAX:
        return None
    return p, off, nonce


class MessagesAPI:
    def __init__(self, ctx: ApiContext) -> None:
        self.ctx = ctx
        self.broker = ctx.broker
        self.caps: CAPS.CapTable | None = ctx.caps
        self._validation = ValidationCapacity()  # one slot: this worker's core
        self.max_wait = ctx.cfg.seconds("http", "max_consume_wait")
        self.consume_cap = ctx.cfg.http.max_consume_in_flight_per_identity
        self.produce_cap = ctx.cfg.http.max_produce_in_flight_per_identity
        self.m = ctx.broker.m
        self._background: set[asyncio.Task[None]] = set()
        self._incs: dict[str, bytes] = {}  # topic id -> its incarnation bytes
        self._members_ver = -1  # the members version slot _draining was read at
        self._draining = False  # this node's member record is marked draining (decommission)

    def register(self, r: Router) -> None:
        r.add("POST", "/v1/topics/{topic}/produce", self.produce, body_limit=MAX_MESSAGE, fast=self.produce_fast)
        r.add("POST", "/v1/topics/{topic}/produce/batch", self.produce_batch, body_limit=MAX_BATCH_BODY)
        r.add("GET", "/v1/topics/{topic}/consume", self.consume)
        r.add("POST", "/v1/topics/{topic}/ack", self.ack, body_limit=ACK_BODY_LIMIT)
        r.add("POST", "/v1/topics/{topic}/redrive", self.redrive)

    # ---- shared checks -----------------------------------------------------------------
    def _topic(self, req: Request) -> TopicRecord:
        name = req.params["topic"]
        t = self.ctx.store.topic(name)
        if t is None:
            raise NotFound("topic not found")
        return t

    def _require(self, req: Request, t: TopicRecord, action: str) -> None:
        who: G.Identity = req.identity
        if who.unrestricted:
            return
        user = self.ctx.store.user(who.name or "")
        if not G.has_grant(user, action, t.name):
            raise Forbidden(f"{action} not allowed on this topic")

    def _delay_child(self, t: TopicRecord) -> Conflict:
        """A delay child is fed only by its parent: a produce to it is a 409 (counted)."""
        self.m.produce_rejections.labels(t.name, "delayed_child").inc()
        return Conflict(f'topic "{t.name}" is a delay child of "{t.parent}"; produce to the parent')

    def _refuse_if_draining(self, t: TopicRecord) -> None:
        """A node being decommissioned takes no new produce (503 with Retry-After:
        nothing was stored, so a client sends it to another node). The member record
        is re-read only when the members version slot moved (one atomic load)."""
        ver = self.ctx.versions.load(V.MEMBERS)
        if ver != self._members_ver:
            with self.ctx.store.read() as r:
                rec = r.member(self.ctx.node_id)
            self._draining = rec is not None and rec.draining
            self._members_ver = ver
        if self._draining:
            self.m.produce_rejections.labels(t.name, "draining").inc()
            raise Unavailable(DRAINING, headers=[("Retry-After", "1")])

    def _identity_key(self, req: Request) -> str:
        who: G.Identity = req.identity
        return who.name if who.name else f"ip:{req.client}"

    async def _validator(self, t: TopicRecord) -> PayloadValidator | None:
        """The topic's compiled validator; built on the validation thread (never
        on the loop), may raise SchemaValidationBusy (503)."""
        if not t.schema_version:
            return None
        key = (t.id, t.schema_version)
        v = self._validation.cached(key)
        if v is not None:
            return v
        with self.ctx.store.read() as r:
            rec = r.schema(t.name, t.schema_version)
        if rec is None:
            return None
        name, version, raw = t.name, t.schema_version, rec.schema
        return await self._validation.validator(key, lambda: PayloadValidator(name, version, raw))

    def _single_query(self, req: Request, name: str) -> str | None:
        vals = req.query.get(name)
        if not vals:
            return None
        if len(vals) > 1:
            raise BadRequest(f"invalid argument: {name} given more than once")
        return vals[0]

    def _partition_arg(self, req: Request, t: TopicRecord) -> int | None:
        raw = self._single_query(req, "partition")
        if raw is None:
            return None
        p = parse_int(raw, "partition", minimum=INT64_MIN)
        if not 0 <= p < t.partitions:
            raise BadRequest("invalid argument: partition out of range")
        return p

    async def _append(self, req: Request, t: TopicRecord, entries: Sequence[Entry],
                      watch: Sequence[Entry] | None = None, direct: int | None = None,
                      spread: bool = False,
                      plan: tuple[dict[int, DirectGroup], bool] | None = None
                      ) -> list[bool | None]:
        """Durable (202 follows), else the error. ``watch``: entries with an idempotency
        key; returns the verdict of every entry (True: dropped as a repeat of its key;
        False: stored, or no key; None: not known within ``IDEM_WAIT_S``), or [] without
        ``watch``. ``direct``: the partition every entry (keyless, its partition chosen
        here) goes to: committed there without the WAL when the broker can
        (``Broker.commit_direct``). ``spread``: a produce with idempotency keys (its
        answer waits for the partitions' commits anyway): the entries whose partition is
        on this node are committed there without the WAL when they can
        (``Broker.direct``). Everything else takes the WAL: keyed records without an
        idempotency key do (one WAL fsync answers them sooner than rounds syncing each
        partition they hash to: measured). ``plan``: what the producer knows for
        ``Broker.direct`` (its ``groups``, records and idempotency keys included, and ``keyed``)."""
        ident = None
        if self.produce_cap > 0 and self.caps is not None:
            ident = self._identity_key(req)
            if not self.caps.try_take(self.ctx.worker_index, CAPS.PRODUCE, ident, len(entries), self.produce_cap):
                raise TooManyRequests(f"too many in-flight produce requests for this identity "
                                      f"(limit {self.produce_cap} per node)")
        held = [ident is not None and self.caps is not None]

        def release() -> None:  # once: when durable (a verdict wait does not hold the cap), or on failure
            if held[0] and self.caps is not None:
                held[0] = False
                self.caps.give_back(self.ctx.worker_index, CAPS.PRODUCE, ident, len(entries))

        try:
            if direct is not None:
                fut = self.broker.commit_direct(t, direct, entries)
                if fut is not None:
                    try:  # shielded: a hang-up does not cancel the commit under the other waiters
                        await asyncio.shield(fut)
                    except Exception as e:  # nothing of it counts: the WAL takes the records
                        log.debug("direct commit refused; through the WAL", extra={
                            "topic": t.name, "partition": direct, "err": f"{type(e).__name__}: {e}"})
                    else:
                        self.m.messages_accepted.labels(t.name).inc(len(entries))
                        return []
            elif spread:
                dplan = (self.broker.direct(t, entries, *plan, inc=bytes.fromhex(t.id)) if plan is not None
                         else self.broker.direct(t, entries))
                if dplan is not None:
                    def durable() -> None:
                        release()
                        self.m.messages_accepted.labels(t.name).inc(len(entries))

                    return await self._append_plan(entries, watch, dplan, durable)
            if isinstance(entries, DeferredEntries):  # (the WAL keeps and reads a list of its own)
                deferred, entries = entries, entries.built()
                if watch is deferred:
                    watch = entries
            w = await self.broker.produce(entries, watch, IDEM_WAIT_S)
        except WALFailed as e:
            self.m.wal_failed.set(1)
            raise InternalError("produce failed") from e
        finally:
            release()
        self.m.messages_accepted.labels(t.name).inc(len(entries))
        if w is None:
            return []
        got = await self.broker.verdicts(w)
        out: list[bool | None] = [False] * len(entries)
        at = {id(e): i for i, e in enumerate(entries)}
        for e, d in zip(watch or (), got, strict=True):
            out[at[id(e)]] = d
        return out

    async def _append_plan(self, entries: Sequence[Entry], watch: Sequence[Entry] | None,
                           plan: DirectBatch, durable: Callable[[], None]) -> list[bool | None]:
        """``_append`` once ``Broker.direct`` took some entries: the rest go to the WAL at
        once, and those whose direct commit failed after it; ``durable()`` is called once
        every entry is (before the WAL's verdicts are waited for), and this returns every
        entry's verdict as ``_append`` gives it."""
        # The watched entries, by identity: every entry (the common case: every message has an
        # idempotency key) needs no set (built only when some entry is not watched).
        every = watch is not None and len(watch) == len(entries)
        wanted = {id(e) for e in watch} if watch and not every else None

        def watched(e: Entry) -> bool:
            return every or (wanted is not None and id(e) in wanted)

        waits: list[tuple[asyncio.Future[None], Watch | None, list[int]]] = []

        def to_wal(idx: list[int]) -> None:
            es = [entries[i] for i in idx]
            fut, w = self.broker.stage(es, [e for e in es if watched(e)] if watch else None, IDEM_WAIT_S)
            waits.append((fut, w, idx))

        out: list[bool | None] = []
        try:
            if plan.rest:
                to_wal(plan.rest)
            await asyncio.shield(plan.done)  # a hang-up does not cancel the commits under the other waiters
            if watch:
                out = list(plan.dup)  # (the direct commits' verdicts, bools; the WAL's below)
            if plan.failed:
                to_wal(plan.failed)
            for fut, _w, _idx in waits:
                await fut
            durable()
            for _fut, w, idx in waits:
                if w is None:
                    continue
                got = iter(await self.broker.verdicts(w))
                for i in idx:
                    if watched(entries[i]):
                        v = next(got)  # (in order: one per watched entry of this append)
                        out[i] = None if i in plan.unknown else v
        finally:
            for fut, w, _idx in waits:
                if w is not None:
                    self.broker.unwatch(w)
                if not fut.done():  # given up on (a hang-up): its failure is nobody's to read
                    fut.add_done_callback(_retrieve)
        return out

    def _append_cb(self, req: Request, t: TopicRecord, entries: list[Entry], reply: Reply,
                   watched: bool = False, direct: int | None = None, spread: bool = False,
                   ikey: str | None = None) -> None:
        """``_append`` for the synchronous entry: the WAL calls back when the group's sync
        returned and ``reply`` gets the same answer the async path gives (202, or 500).
        ``watched`` (one entry with an idempotency key): the answer waits, by callback, for
        the owner's duplicate verdict, as the async path's does. ``direct`` and ``spread``:
        as ``_append``'s (a direct commit's callback answers, or hands the entries to the
        WAL). ``ikey``: the one entry's idempotency key as given (``Broker.direct_one``)."""
        ident = None
        n = len(entries)
        if self.produce_cap > 0 and self.caps is not None:
            ident = self._identity_key(req)
            if not self.caps.try_take(self.ctx.worker_index, CAPS.PRODUCE, ident, n, self.produce_cap):
                raise TooManyRequests(f"too many in-flight produce requests for this identity "
                                      f"(limit {self.produce_cap} per node)")
        w: Watch | None = None
        plan: DirectBatch | None = None
        one = False  # ``Broker.direct_one`` took the record (no plan)
        unknown = False  # a hop that may have committed it was given up: its verdict is not known

        def give_back() -> None:
            if ident is not None and self.caps is not None:
                self.caps.give_back(self.ctx.worker_index, CAPS.PRODUCE, ident, n)

        def verdict(_: object = None) -> None:
            assert w is not None
            self.broker.unwatch(w)
            dup = w.dup[0]
            reply(json_response(202, {"duplicate": None, "pending": True}) if dup is None else dup_answer(dup))

        def done(err: OSError | None) -> None:
            give_back()
            if err is not None:
                if w is not None:
                    self.broker.unwatch(w)
                self.m.wal_failed.set(1)
                reply(InternalError("produce failed"))
                return
            self.m.messages_accepted.labels(t.name).inc(n)
            if w is None:
                if watched:  # the verdict of a given-up hop: not known
                    reply(json_response(202, {"duplicate": None, "pending": True}))
                else:
                    reply(Response(202, b"", None) if n == 1 else json_response(202, {"accepted": n}))
            elif w.done.done():
                verdict()
            else:
                w.done.add_done_callback(verdict)

        def to_wal() -> None:  # after a refused direct commit: answered here, no handler is left
            nonlocal w
            try:
                self.broker.append_cb(entries, done)
            except BaseException as e:
                give_back()
                if isinstance(e, WALFailed):
                    self.m.wal_failed.set(1)
                else:
                    log.exception("produce failed after a refused direct commit")
                reply(InternalError("produce failed"))
                return
            if watched and not unknown:
                w = self.broker.watch(entries, IDEM_WAIT_S)

        if direct is not None or spread:
            try:
                if direct is not None:
                    fut: asyncio.Future[Any] | None = self.broker.commit_direct(t, direct, entries)
                elif n == 1 and entries[0].key is None:  # one record, no order to keep: no plan
                    fut = self.broker.direct_one(t, entries[0], ikey)
                    one = True
                else:
                    plan = self.broker.direct(t, entries)
                    fut = plan.done if plan is not None and not plan.rest else None
            except BaseException:
                give_back()
                raise
            if fut is not None:
                def direct_done(f: asyncio.Future[Any]) -> None:
                    nonlocal unknown
                    if f.cancelled():  # nobody cancels it; if something did, the batch may still commit
                        give_back()
                        reply(InternalError("produce failed"))
                        return
                    exc = f.exception()
                    if exc is None and (plan is None or not plan.failed):
                        if one:
                            give_back()
                            self.m.messages_accepted.labels(t.name).inc(1)
                            reply(dup_answer(bool(f.result()[1])))
                        elif plan is not None and watched:
                            give_back()
                            self.m.messages_accepted.labels(t.name).inc(n)
                            reply(dup_answer(plan.dup[0]))
                        else:
                            done(None)
                        return
                    if exc is not None:
                        log.debug("direct commit refused; through the WAL", extra={
                            "topic": t.name, "partition": entries[0].partition, "err": repr(exc)})
                        unknown = one and hop_unknown(exc)
                    elif plan is not None:
                        unknown = bool(plan.unknown)
                    to_wal()

                fut.add_done_callback(direct_done)
                return
        try:
            self.broker.append_cb(entries, done)
        except WALFailed as e:
            give_back()
            self.m.wal_failed.set(1)
            raise InternalError("produce failed") from e
        except BaseException:
            give_back()
            raise
        if watched:  # the seqs are assigned; done() runs only after the sync this waits for
            w = self.broker.watch(entries, IDEM_WAIT_S)

    def _incarnation(self, t: TopicRecord) -> bytes:
        inc = self._incs.get(t.id)
        if inc is None:
            if len(self._incs) > 10_000:
                self._incs.clear()
            inc = self._incs[t.id] = bytes.fromhex(t.id)
        return inc

    # ---- produce -------------------------------------------------------------------------------
    def _produce_args(self, req: Request, t: TopicRecord) -> tuple[bytes, bytes | None, int | None]:
        """The checks of a single produce before its schema: (body, key, partition).
        Its headers (``?header=``) and idempotency key are read after these."""
        self._require(req, t, "produce")
        if t.delay_ms and t.parent is not None:  # a delay child (one attribute check when not)
            raise self._delay_child(t)
        self._refuse_if_draining(t)
        body = req.body
        if not body:
            raise BadRequest("message required")
        if not req.query:
            return body, None, None
        key_raw = self._single_query(req, "key")
        partition = self._partition_arg(req, t)
        key = key_raw.encode("utf-8", "surrogateescape") if key_raw else None
        return body, key, partition

    def produce_fast(self, req: Request, reply: Reply) -> bool:
        """The synchronous entry of ``produce`` (no task, no future): a topic without a
        schema; the same checks, in the same order, and the same answers."""
        t = self._topic(req)
        if t.schema_version:
            return False  # its check may run on the validation thread: the async path
        body, key, partition = self._produce_args(req, t)
        idem = raw_idem = None
        if req.query and IDEM_PARAM in req.query:
            raw_idem = self._single_query(req, IDEM_PARAM)
            idem = idem_key(raw_idem) if raw_idem is not None else None
        direct = None
        placed = False  # (``Entry.placed``: the node chose the partition of a keyless idempotent record)
        if partition is None:
            partition = self.broker.choose_partition(t, key, idem)
            if key is None:
                if idem is None:
                    direct = partition
                else:
                    placed = True
        flags, stored = payload_flags(body), body
        hdrs = query_headers(req.query["header"]) if req.query and "header" in req.query else None
        if hdrs is not None or idem is not None:
            flags, stored = with_ext(flags, body, hdrs, idem)
        entry = Entry(t.name, self._incarnation(t), partition, int(time.time() * 1000), flags, key, stored,
                      placed=placed)
        self._append_cb(req, t, [entry], reply, watched=idem is not None, direct=direct, spread=idem is not None,
                        ikey=raw_idem if idem is not None else None)
        return True

    async def produce(self, req: Request) -> Response:
        t = self._topic(req)
        body, key, partition = self._produce_args(req, t)
        raw_idem = self._single_query(req, IDEM_PARAM) if req.query else None
        idem = idem_key(raw_idem) if raw_idem is not None else None
        v = await self._validator(t)
        if v is not None:
            why = await self._validation.check(v, body)
            if why is not None:
                self.m.produce_rejections.labels(t.name, "schema").inc()
                raise BadRequest(f"invalid argument: {why}")
        direct = None
        placed = False  # (``Entry.placed``)
        if partition is None:
            partition = self.broker.choose_partition(t, key, idem)
            if key is None:
                if idem is None:
                    direct = partition
                else:
                    placed = True
        flags = payload_flags(body)
        hdrs = query_headers(req.query["header"]) if req.query and "header" in req.query else None
        flags, stored = with_ext(flags, body, hdrs, idem)
        entry = Entry(t.name, self._incarnation(t), partition, int(time.time() * 1000), flags, key, stored,
                      placed=placed)
        if idem is None:
            await self._append(req, t, [entry], direct=direct)
            return Response(202, b"", None)
        dup = (await self._append(req, t, [entry], [entry], spread=True))[0]
        if dup is None:
            return json_response(202, {"duplicate": None, "pending": True})
        return dup_answer(dup)

    def _batch_error(self, e: Exception) -> BadRequest:
        msg = str(e)
        m = _MSG_IDX.search(msg)
        if m:
            idx = m.group(1)
            msg = msg.replace(m.group(0), "$")
            if msg.startswith("Object contains unknown field"):
                field = msg.split("`")[1] if "`" in msg else "?"
                return BadRequest(f'message {idx}: invalid json: unknown field "{field}"')
            return BadRequest(f"message {idx}: invalid json: {msg}")
        if msg.startswith("Object contains unknown field"):
            field = msg.split("`")[1] if "`" in msg else "?"
            return BadRequest(f'invalid json: unknown field "{field}"')
        return BadRequest(f"invalid json: {msg}")

    async def produce_batch(self, req: Request) -> Response:
        t = self._topic(req)
        self._require(req, t, "produce")
        if t.delay_ms and t.parent is not None:
            raise self._delay_child(t)
        self._refuse_if_draining(t)
        if req.query.get("key") or req.query.get("partition"):
            raise BadRequest("invalid argument: key and partition go in each message of a batch, not the query")
        for name, field in (("idempotency_key", "idempotency_key"), ("header", "headers")):
            if name in req.query:  # (taken by single produce only: never silently dropped here)
                raise BadRequest(f'invalid argument: {name} goes in each message of a batch (field "{field}"), '
                                 f"not the query")
        body = req.body
        enc = (req.headers.get("content-encoding") or "").strip().lower()
        if enc in ("gzip", "x-gzip"):
            try:
                d = zlib.decompressobj(wbits=31)
                body = d.decompress(body, MAX_BATCH_BODY + 1)
            except zlib.error as e:
                raise BadRequest(f"invalid gzip body: {e}") from None
            if len(body) > MAX_BATCH_BODY or d.unconsumed_tail:
                raise PayloadTooLarge("decoded batch body larger than 16 MiB")
        elif enc not in ("", "identity"):
            raise UnsupportedMediaType(f"unsupported Content-Encoding {enc!r} (gzip is supported)")
        if not body.strip():
            raise BadRequest("invalid json: request body required")
        try:
            parsed = _batch_dec.decode(body)
        except msgspec.ValidationError as e:
            try:
                n = len(_count_dec.decode(body).get("messages", []))
            except (msgspec.DecodeError, RecursionError):
                n = 0
            if n > MAX_BATCH_MESSAGES:
                raise BadRequest(f"too many messages: more than {MAX_BATCH_MESSAGES}") from None
            raise self._batch_error(e) from None
        except msgspec.DecodeError as e:
            raise BadRequest(f"invalid json: {decode_why(e, body)}") from None
        except RecursionError:
            raise BadRequest(NESTED_TOO_DEEP) from None
        if parsed.messages is msgspec.UNSET or not parsed.messages:
            raise BadRequest("invalid argument: messages required (1 to 1000)")
        msgs = parsed.messages
        if len(msgs) > MAX_BATCH_MESSAGES:
            raise BadRequest(f"too many messages: more than {MAX_BATCH_MESSAGES}")
        if msgs[0].idempotency_key is not None and not t.schema_version:
            # The common idempotent batch (every message keyed, nothing unusual): one pass.
            fast = self._keyed_entries(t, msgs)
            if fast is not None:
                entries_k, groups_k, keyed_k = fast
                return await self._produce_keyed(req, t, entries_k, entries_k, groups_k, keyed_k)
        now = int(time.time() * 1000)
        inc = bytes.fromhex(t.id)
        prepared: list[tuple[Any, bytes | None, int | None, int, Any, bytes | None]] = []
        keys_given = False  # an idempotency key in some message
        unset = msgspec.UNSET
        texts: list[msgspec.Raw] = []  # the headers' texts as given, in message order (checked after pass 1)
        # Pass 1: the format of every message.
        for i, m in enumerate(msgs):
            if m.payload is unset:
                raise BadRequest(f"message {i}: payload required")
            flags = F_JSON | F_UTF8  # a value taken from a JSON document is one valid JSON text
            ik = m.idempotency_key
            h = m.headers
            if m.payload_encoding is None:
                # (with an idempotency key or headers the stored payload is a new bytes anyway,
                # its block and the body joined: the body is read from the request's buffer, no copy)
                payload = m.payload if ik is not None or h is not unset else bytes(m.payload)  # type: ignore[arg-type]
            elif m.payload_encoding == "base64":
                raw = bytes(m.payload)  # type: ignore[arg-type]
                try:
                    s = msgspec.json.decode(raw, type=str)
                    payload = base64.b64decode(s, validate=True)
                except (msgspec.DecodeError, binascii.Error, ValueError):
                    raise BadRequest(f"message {i}: payload is not a base64 string") from None
                flags = payload_flags(payload)
            else:
                raise BadRequest(f'message {i}: unknown payload_encoding "{m.payload_encoding}" (base64)')
            if not payload:
                raise BadRequest(f"message {i}: message required")
            if len(payload) > MAX_MESSAGE:
                raise PayloadTooLarge(f"message {i}: message too large")
            key: bytes | None = None
            if m.key:
                if m.key_encoding is None:
                    key = m.key.encode()
                elif m.key_encoding == "base64":
                    try:
                        key = base64.b64decode(m.key, validate=True)
                    except (binascii.Error, ValueError):
                        raise BadRequest(f"message {i}: key is not base64") from None
                else:
                    raise BadRequest(f'message {i}: unknown key_encoding "{m.key_encoding}" (base64)')
                key = key or None
            if m.partition is not None and m.partition < 0:
                raise BadRequest(f"message {i}: invalid argument: partition out of range")
            if h is unset:
                hdrs = None
            else:  # (taken as given here; checked with the batch's others below, in one call)
                hdrs = h
                texts.append(h)
            try:  # (the message's index is named only in an answer: no prefix built a message)
                if ik is None:
                    idem = None
                else:  # ``idem_key`` inline (a JSON string holds no lone surrogate: msgspec refuses one)
                    idem = ik.encode()
                    keys_given = True
                    if not 0 < len(idem) <= MAX_IDEM_KEY:
                        idem_key(ik)  # (raises its 400, naming the bound)
            except BadRequest as e:
                raise BadRequest(f"message {i}: {e.message}") from None
            prepared.append((payload, key, m.partition, flags, hdrs, idem))
        if texts:
            self._batch_headers(msgs, prepared, texts)
        # Pass 2: partition range and schema.
        for i, (_payload, _key, part, _flags, _h, _idem) in enumerate(prepared):
            if part is not None and part >= t.partitions:
                raise BadRequest(f"message {i}: invalid argument: partition out of range")
        v = await self._validator(t)
        if v is not None:
            bad = await self._validation.check_many(v, [bytes(p) for p, _k, _part, _f, _h, _i in prepared])
            if bad is not None:
                self.m.produce_rejections.labels(t.name, "schema").inc()
                raise BadRequest(f"message {bad[0]}: invalid argument: {bad[1]}")
        entries = []
        keyless = -1  # the keyless choice: sticky, the same for every keyless message of this pass (asked once)
        if not keys_given:  # (the common case)
            chosen: set[int] = set()  # keyless partitions chosen here; one alone (sticky) may commit directly
            hheads = FR.HEADERS_HEADS
            placed = False  # a key or a partition from the client
            for payload, key, part, flags, hdrs, _idem in prepared:
                if part is None:
                    if key is None:
                        if keyless < 0:
                            keyless = self.broker.choose_partition(t, None)
                            chosen.add(keyless)
                        part = keyless
                    else:  # (``choose_partition``'s hash of a key: a call less)
                        part = key_partition(key, t.partitions)
                        placed = True
                else:
                    placed = True
                if hdrs is None:
                    fl, stored = flags, payload
                elif (n := len(hdrs)) < 0x7B:  # (``pack_headers`` inline for a text under 123 bytes)
                    fl, stored = flags | F_EXT, b"".join((hheads[n], hdrs, payload))
                else:
                    fl, stored = flags | F_EXT, FR.pack_headers(hdrs, payload)
                entries.append(Entry(t.name, inc, part, now, fl, key, stored))
            direct = next(iter(chosen)) if len(chosen) == 1 and not placed else None
            await self._append(req, t, entries, direct=direct)
            return json_response(202, {"accepted": len(entries)})
        # With idempotency keys: the direct commits are planned here as the entries are
        # built (``Broker.direct``'s groups; the keys handed to the commits as given).
        watch: list[Entry] = []
        groups: dict[int, DirectGroup] = {}  # (each partition's records and keys built here, as they go)
        keyed = False  # a message key: its order is kept (``Broker.direct``)
        nparts = t.partitions
        heads = FR.IDEM_HEADS
        rule = self.broker.idem_rule(t)
        for i, (payload, key, part, flags, hdrs, idem) in enumerate(prepared):
            placed = False  # (``Entry.placed``)
            if part is None:
                if key is None and idem is None:
                    if keyless < 0:
                        keyless = self.broker.choose_partition(t, None)
                    part = keyless
                else:  # (``key_partition`` of a key, else of an idempotency key, inline: a call less)
                    part = crc32c(key or idem) % nparts  # type: ignore[arg-type]
                    if key is None and rule is not None and rule[0][part]:
                        part = rule[1]  # (topic.idempotent_local_placement)
                        placed = True
            if key is not None:
                keyed = True
            # (with_ext's cases, a call less a message)
            if idem is None:
                fl, stored = (flags, payload) if hdrs is None else (flags | FR.F_EXT, FR.pack_headers(hdrs, payload))
            elif hdrs is None:  # (``pack_idem`` inline for a key under 32 bytes)
                n = len(idem)
                fl, stored = flags | FR.F_EXT, (b"".join((heads[n], idem, payload)) if n < 32
                                                else FR.pack_idem(idem, payload))
            else:
                fl, stored = with_ext(flags, payload, bytes(hdrs), idem)
            e = Entry(t.name, inc, part, now, fl, key, stored, placed=placed)
            entries.append(e)
            ik = msgs[i].idempotency_key  # (the commit's key, as given)
            g = groups.get(part)
            if g is None:
                groups[part] = ([i], [(key, fl, stored)], [ik])
            else:
                g[0].append(i)
                g[1].append((key, fl, stored))
                g[2].append(ik)  # type: ignore[union-attr]
            if idem is not None:
                watch.append(e)
        return await self._produce_keyed(req, t, entries, watch, groups, keyed)

    @staticmethod
    def _batch_headers(msgs: list[BatchMsg], prepared: list[Any], texts: list[msgspec.Raw]) -> None:
        """Pass 1's headers, checked: every text at once (``headers_canonical_all``; the
        common batch is done in that call, each message's text stored as given); from
        the first text that is not already stored form on, each through
        ``batch_headers`` (the 400 names its message; null and an empty object leave
        the message without headers, its payload then a copy as any other's)."""
        joined = b"\0".join(texts)
        first = native.headers_canonical_all(joined, len(joined), len(texts))
        if first < 0:
            return
        at = [i for i, m in enumerate(msgs) if m.headers is not msgspec.UNSET]
        for i in at[first:]:
            try:
                hdrs = batch_headers(msgs[i].headers)  # type: ignore[arg-type]
            except BadRequest as e:
                raise BadRequest(f"message {i}: {e.message}") from None
            payload, key, part, flags, _h, idem = prepared[i]
            if hdrs is None and idem is None:
                payload = bytes(payload)  # (no block to join it to: the request's buffer is not kept)
            prepared[i] = (payload, key, part, flags, hdrs, idem)

    async def _produce_keyed(self, req: Request, t: TopicRecord, entries: Sequence[Entry], watch: Sequence[Entry],
                             groups: dict[int, DirectGroup], keyed: bool) -> Response:
        """A batch with idempotency keys, its entries built: appended (``Broker.direct``'s
        plan given), and the answer with its duplicates."""
        got = await self._append(req, t, entries, watch, spread=True, plan=(groups, keyed))
        n = len(entries)
        if got.count(False) == n:  # (the common answer: a count of False compares by identity, fast)
            return json_response(202, {"accepted": n, "duplicates": 0})
        out: dict[str, int] = {"accepted": n, "duplicates": got.count(True)}
        pending = got.count(None)
        if pending:
            out["pending"] = pending
        return json_response(202, out)

    def _keyed_entries(self, t: TopicRecord, msgs: list[BatchMsg]
                       ) -> tuple[DeferredEntries, dict[int, DirectGroup], bool] | None:
        """The common idempotent batch in one pass: every message a JSON payload (no
        ``payload_encoding``) with an idempotency key, no headers, a UTF-8 message key or
        none, a partition in range or none. Its entries, ``Broker.direct``'s groups and
        whether any message has a message key; None as soon as a message is anything else,
        an invalid one included (the general passes then check every message and answer
        what is wrong), so this path never decides a 400. The entries are the general
        passes' byte for byte (same flags, blocks and partitions), built only when something
        reads them (``DeferredEntries``: the direct commits read the groups' records)."""
        groups: dict[int, DirectGroup] = {}
        keyed = False
        nparts = t.partitions
        name, inc, now = t.name, bytes.fromhex(t.id), int(time.time() * 1000)
        # The body alone, without its key's block: the commit writes the block from the key
        # (``FR.lay_keyed``) and keeps the body alone in memory, what a consume reads.
        fl = F_JSON | F_UTF8
        unset = msgspec.UNSET
        # Every key's partition in one native call (``key_partition`` of each: the crc32c of
        # its UTF-8 modulo the partitions), used where a message has no message key.
        count = len(msgs)
        iks = [m.idempotency_key for m in msgs]
        try:
            joined = "\0".join(iks).encode()  # type: ignore[arg-type]
        except TypeError:  # (a message without one)
            return None
        out = native_ffi.new("uint32_t[]", count)
        # (each key's length checked there too: 1 to MAX_IDEM_KEY bytes of UTF-8)
        rc = native.crc32c_parts_max(joined, len(joined), count, nparts, MAX_IDEM_KEY, out)
        if rc == -2:
            return None
        if rc != 0:  # (a key holding a NUL)
            for i, ik in enumerate(iks):
                kb = ik.encode()  # type: ignore[union-attr]
                if not 0 < len(kb) <= MAX_IDEM_KEY:
                    return None
                out[i] = crc32c(kb) % nparts
        hashed = native_ffi.unpack(out, count)
        rule = self.broker.idem_rule(t)  # (topic.idempotent_local_placement)
        if rule is not None:
            home_here, here = rule
            if all(home_here):  # (every key's partition this node's, none moving: the common case)
                hashed = [here] * count
                out[0:count] = hashed
            else:
                for i, h in enumerate(hashed):
                    if home_here[h]:
                        out[i] = hashed[i] = here
        records: list[tuple[bytes | None, int, bytes]] = []
        given: set[int] | None = None
        for i, m in enumerate(msgs):
            ik = m.idempotency_key
            payload = m.payload
            if (ik is None or payload is unset or m.payload_encoding is not None or m.headers is not unset
                    or m.key_encoding is not None or not payload or len(payload) > MAX_MESSAGE):  # type: ignore[arg-type]
                return None
            part = m.partition
            key: bytes | None = None
            if m.key:
                key = m.key.encode()
                keyed = True
                if part is None:
                    part = crc32c(key) % nparts
            if part is None:
                part = hashed[i]
            elif part >= nparts:
                return None
            else:
                if m.partition is not None:
                    given = given or set()
                    given.add(i)
                if part != hashed[i]:
                    out[i] = part  # (placed by its message key or as given: grouped where it goes)
            records.append((key, fl, bytes(payload)))  # type: ignore[arg-type]
        # ``Broker.direct``'s groups: each partition's indexes in batch order, their records and
        # keys, from one native counting sort over the placements (``out``).
        perm_c, starts_c = native_ffi.new("uint32_t[]", count), native_ffi.new("uint32_t[]", nparts + 1)
        parts_c = native_ffi.new("uint32_t[]", min(count, nparts))
        k = native.group_by_part(out, count, nparts, perm_c, starts_c, parts_c)
        if k < 0:
            return None  # (cannot happen: every placement is below nparts; the general passes then)
        perm, starts = native_ffi.unpack(perm_c, count), native_ffi.unpack(starts_c, nparts + 1)
        for p in native_ffi.unpack(parts_c, k):
            lo, hi = starts[p], starts[p + 1]
            idx = perm[lo:hi]
            if hi - lo == 1:
                j = idx[0]
                groups[p] = (idx, [records[j]], [iks[j]])
            else:
                pick = itemgetter(*idx)
                groups[p] = (idx, list(pick(records)), list(pick(iks)))
        return DeferredEntries(count, groups, name, inc, now, given), groups, keyed

    # ---- consume --------------------------------------------------------------------------------
    async def consume(self, req: Request) -> Response:
        t = self._topic(req)
        self._require(req, t, "consume")
        headers: list[tuple[str, str]] = []
        wait = 0.0
        raw_wait = self._single_query(req, "wait")
        if raw_wait is not None:
            try:
                wait = _waits(raw_wait)
            except ValueError:
                raise BadRequest(f'invalid argument: wait must be a duration such as "500ms" or "10s", '
                                 f"got {raw_wait[:32]!r}") from None
            if wait > self.max_wait:
                wait = self.max_wait
                headers.append(("X-Narad-Wait-Clamped", format_go_duration(wait)))
        partition = self._partition_arg(req, t)
        raw_off = self._single_query(req, "offset")
        raw_max = self._single_query(req, "max")
        raw_vis = self._single_query(req, "visibility") if req.query else None
        vis_ms = 0
        if raw_vis is not None:
            vis_ms = duration_ms(raw_vis, "visibility", MIN_VISIBILITY_S, MAX_VISIBILITY_S)
        batch = raw_max is not None
        max_n = 1
        if batch:
            max_n = parse_int(raw_max, "max", minimum=INT64_MIN)  # type: ignore[arg-type]
            if not 1 <= max_n <= MAX_CONSUME_BATCH:
                raise BadRequest("invalid argument: max must be an integer from 1 to 100")
            if not req.headers.get("x-narad-client"):
                raise BadRequest("batch consume (max) requires an X-Narad-Client header")
        if raw_off is not None:
            if partition is None:
                raise BadRequest("partition required for replay-mode consume")
            if batch:
                raise BadRequest("invalid argument: max cannot be combined with offset")
            if raw_vis is not None:
                raise BadRequest("invalid argument: visibility cannot be combined with offset "
                                 "(a replay takes no lease)")
            offset = parse_int(raw_off, "offset", minimum=0)
            return await self._replay(t, partition, offset)
        if wait > 0:
            # A client that goes away cancels the poll at once: the broker gives back what it held.
            cancel_on_hangup()
        ident = None
        if self.consume_cap > 0 and self.caps is not None:
            ident = self._identity_key(req)
            if not self.caps.try_take(self.ctx.worker_index, CAPS.CONSUME, ident, max_n, self.consume_cap):
                raise TooManyRequests(f"too many in-flight consume requests for this identity "
                                      f"(limit {self.consume_cap} per node)")
        try:
            items = await self.broker.consume(t, max_n, wait, partition, vis_ms)
        finally:
            if ident is not None and self.caps is not None:
                self.caps.give_back(self.ctx.worker_index, CAPS.CONSUME, ident, max_n)
        if not items:
            self.m.consume_empty.labels(t.name).inc()
            return empty(204, headers)
        if not batch:
            resp = json_response(200, render_leased(t.name, items[0]), headers)
            resp.on_dropped = self._giver(t, items)
            return resp
        out: list[MessageOut | _Leased | _LeasedKey] = []
        size = 0
        leftover: list[Item] = []
        for it in items:
            if out and size + len(it.payload) + 256 > RESPONSE_BUDGET:
                leftover.append(it)
                continue
            out.append(render_leased(t.name, it))
            size += len(it.payload) + 256
        if leftover:
            # given back in the background: no await between the reserve and the answer, so a
            # cancellation (the client hung up) cannot strand the leases this request holds
            self._giver(t, leftover)()
            items = [it for it in items if it not in leftover]
        resp = json_response(200, {"messages": out}, headers)
        resp.on_dropped = self._giver(t, items)
        return resp

    def _giver(self, t: TopicRecord, items: list[Item]) -> Any:
        """A hook that nacks leases whose response never reached the client."""
        def give_back() -> None:
            task = asyncio.get_running_loop().create_task(self.broker.nack_items(t, items))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return give_back

    async def _replay(self, t: TopicRecord, partition: int, offset: int) -> Response:
        try:
            r = await self.broker.replay(t, partition, offset)
        except Unavailable:
            raise
        if r.status == 204:
            return empty(204)
        if r.status == 410:
            if r.oldest >= 0:
                raise Gone(f"offset {offset} of partition {partition} aged out of retention "
                           f"(oldest retained: {r.oldest})")
            raise Gone(f"offset {offset} of partition {partition} is unreadable")
        assert r.item is not None
        return json_response(200, render(t.name, r.item, False))

    # ---- ack -----------------------------------------------------------------------------------
    async def ack(self, req: Request) -> Response:
        t = self._topic(req)
        self._require(req, t, "consume")
        ext = self._single_query(req, "extend")
        if ext is None or ext.lower() == "false":
            mode = ACK
        elif ext.lower() in ("true", "1"):
            mode = EXTEND
        elif ext == "0":
            mode = NACK
        else:
            raise BadRequest('invalid argument: extend must be "true"/"1" (extend), "0" (nack) or absent (ack)')
        raw_delay = self._single_query(req, "delay")
        raw_vis = self._single_query(req, "visibility")
        raw_reason = self._single_query(req, "reason")
        handle = self._single_query(req, "receipt_handle")
        if handle is not None:
            if req.body:
                _no_body_settings(req.body)
            dur_ms = _settle_ms(mode, raw_delay, raw_vis)
            reason = _nack_reason(mode, raw_reason)
            item = _handle_fields(handle)
            if item is None:
                raise BadRequest("invalid argument: receipt_handle is not partition:offset:nonce")
            (status,) = await self.broker.settle(t, [item], mode, dur_ms, reason)
            if status == 204:
                return empty(204)
            if status == 410:
                raise Gone(GONE_HANDLE)
            raise Unavailable("partition owner is unavailable; retry")
        if not req.body.strip():
            raise BadRequest("receipt_handle required")
        try:
            body = _ack_dec.decode(req.body)
        except msgspec.ValidationError as e:
            if "Expected `array` of length <=" in str(e):
                raise BadRequest(f"too many receipt_handles: more than {MAX_ACK_BATCH}") from None
            for f in ("delay", "visibility"):
                if str(e).endswith(f"`$.{f}`"):
                    raise BadRequest(f'invalid argument: {f} must be a duration string such as "30s"') from None
            if str(e).endswith("`$.reason`"):
                raise BadRequest("invalid argument: reason must be a string") from None
            raise BadRequest(f"invalid json: {e}") from None
        except msgspec.DecodeError as e:
            raise BadRequest(f"invalid json: {decode_why(e, req.body)}") from None
        except RecursionError:
            raise BadRequest(NESTED_TOO_DEEP) from None
        handles = body.receipt_handles
        if handles is msgspec.UNSET or not handles:
            raise BadRequest("receipt_handles required (1 to 100)")
        if len(handles) > MAX_ACK_BATCH:
            raise BadRequest(f"too many receipt_handles: more than {MAX_ACK_BATCH}")
        if body.delay is not msgspec.UNSET:
            if raw_delay is not None:
                raise BadRequest("invalid argument: delay given both in the query and the body; give one")
            raw_delay = body.delay
        if body.visibility is not msgspec.UNSET:
            if raw_vis is not None:
                raise BadRequest("invalid argument: visibility given both in the query and the body; give one")
            raw_vis = body.visibility
        if body.reason is not msgspec.UNSET:
            if raw_reason is not None:
                raise BadRequest("invalid argument: reason given both in the query and the body; give one")
            raw_reason = body.reason
        dur_ms = _settle_ms(mode, raw_delay, raw_vis)
        reason = _nack_reason(mode, raw_reason)
        results: list[dict[str, Any] | None] = [None] * len(handles)
        parsed: list[tuple[int, int, int]] = []
        where: list[int] = []
        for i, h in enumerate(handles):
            it = _handle_fields(h)
            if it is None:
                results[i] = {"status": 400, "error": "receipt_handle is not partition:offset:nonce"}
            else:
                parsed.append(it)
                where.append(i)
        statuses = await self.broker.settle(t, parsed, mode, dur_ms, reason) if parsed else []
        for i, s in zip(where, statuses, strict=True):
            if s == 204:
                results[i] = _SETTLED  # one shared (never mutated) dict per status
            elif s == 410:
                results[i] = _GONE_RESULT
            else:
                results[i] = {"status": s, "error": "partition owner is unavailable; retry"}
        return Response(200, _enc.encode({"results": results}), "application/json")

    # ---- redrive (issue 14) -------------------------------------------------------------------
    async def redrive(self, req: Request) -> Response:
        """Move up to ``max`` records of a dead-letter topic back to their origin topics:
        each is leased here (the consume path, no wait), produced to its origin (the
        WAL: durable before the ack) and only then acked in the dead-letter topic (at
        least once: a crash in between leaves a duplicate, never a loss). Records
        without an origin, whose origin is gone, whose origin the caller may not
        produce to (no produce grant there), or whose body the origin's current
        schema refuses, or whose origin is a delay child, are nacked back and counted
        as skipped. Its leases last ``REDRIVE_LEASE_MS`` (not the topic's visibility,
        which a slow call could outlive), and a record is counted once a call. Skipped
        records stay leased until the call ends, so a call skips past at most the
        topic's ``max_in_flight_per_partition`` records a partition."""
        t = self._topic(req)
        who: G.Identity = req.identity
        user = None if who.unrestricted else self.ctx.store.user(who.name or "")
        if not who.unrestricted and not G.can_manage_topic(user, t):
            raise Forbidden("redrive needs the admin role or management of this topic")
        if t.parent is not None:  # (a child cannot be a dead-letter topic: its records are its parent's copies)
            raise Conflict(f'topic "{t.name}" is a fan-out child of "{t.parent}": its records are copies of '
                           f"{t.parent}'s, and redriving them would send each one back twice; redrive "
                           f'"{t.parent}"')
        raw_max = self._single_query(req, "max")
        limit = REDRIVE_DEFAULT
        if raw_max is not None:
            limit = parse_int(raw_max, "max", minimum=INT64_MIN)
            if not 1 <= limit <= REDRIVE_MAX:
                raise BadRequest(f"invalid argument: max must be an integer from 1 to {REDRIVE_MAX}")
        self._refuse_if_draining(t)  # it produces: a node being decommissioned takes none (503)
        redriven = 0
        skipped: list[Item] = []  # held until the end (a nack now would hand them to the next round)
        again: list[Item] = []  # leased a second time in this call (a lease ran out): given back, not counted
        seen: set[tuple[int, int]] = set()  # (partition, offset) leased in this call
        pending: list[Item] = []  # leased, not yet acked: given back if this call fails
        store = self.ctx.store
        ids: list[set[str]] = []

        def live() -> set[str]:  # (read once a call, and only for a copy of a dead letter)
            if not ids:
                ids.append(_topic_ids(store))
            return ids[0]

        try:
            while redriven + len(skipped) < limit:
                # A lease as long as the call may take (the topic's own may be shorter than a
                # slow round: a record it let go would be leased, counted or moved again).
                items = await self.broker.consume(t, min(MAX_CONSUME_BATCH, limit - redriven - len(skipped)), 0.0,
                                                  vis_ms=REDRIVE_LEASE_MS)
                fresh = []
                for it in items:
                    if (it.partition, it.offset) in seen:
                        again.append(it)
                    else:
                        seen.add((it.partition, it.offset))
                        fresh.append(it)
                if not fresh:
                    break
                items = fresh
                pending = list(items)
                by_topic: dict[str, list[Entry]] = {}
                items_of: dict[str, list[Item]] = {}
                moved: list[Item] = []
                for it in items:
                    got = _redrive_entry(it, t, store, self._incarnation, self.broker.choose_partition, live)
                    if got is None:
                        skipped.append(it)
                        continue
                    e, body = got
                    origin = store.topic(e.topic)
                    if not who.unrestricted and not G.has_grant(user, "produce", e.topic):
                        skipped.append(it)  # sent back only where the caller may produce: left here
                        continue
                    v = await self._validator(origin) if origin is not None else None
                    if v is not None and await self._validation.check(v, body) is not None:
                        skipped.append(it)  # the origin's schema (as it is now) refuses it: left here
                        continue
                    by_topic.setdefault(e.topic, []).append(e)
                    items_of.setdefault(e.topic, []).append(it)
                    moved.append(it)
                pending = moved

                def gone(name: str, by_topic: dict[str, list[Entry]] = by_topic,
                         redriven: int = redriven) -> Unavailable | None:
                    origin = store.topic(name)
                    if origin is None or self._incarnation(origin) != by_topic[name][0].incarnation:
                        # (deleted, or deleted and made again, since the produce was built: its records
                        # stay here, given back, and the next call sees what the origin is now)
                        return Unavailable(f'origin topic "{name}" was deleted (or deleted and created again) '
                                           f"during the redrive; {redriven} record(s) were redriven before it; retry")
                    return None

                for name in by_topic:  # every origin first: nothing is produced when one is gone
                    if (err := gone(name)) is not None:
                        raise err
                produced: list[Item] = []
                try:
                    for name, entries in by_topic.items():
                        if (err := gone(name)) is not None:  # (gone while an earlier origin's produce ran)
                            raise err
                        await self._append(req, store.topic(name), entries)  # type: ignore[arg-type]
                        self.m.redriven.labels(t.name).inc(len(entries))
                        produced.extend(items_of[name])
                except BaseException:
                    if produced:  # durable in their origins: acked here (not sent twice), the rest given back
                        done = {id(i) for i in produced}
                        pending = [i for i in pending if id(i) not in done]
                        try:
                            await self.broker.settle(t, [(i.partition, i.offset, i.nonce) for i in produced], ACK)
                        except Exception:
                            log.warning("redriven records could not be acked in the dead-letter topic after a "
                                        "failed redrive; a later redrive sends them again",
                                        extra={"topic": t.name, "records": len(produced)})
                    raise
                statuses = await self.broker.settle(t, [(i.partition, i.offset, i.nonce) for i in moved], ACK)
                pending = []
                acked = sum(1 for st in statuses if st == 204)
                if acked < len(moved):  # produced back, but still in the dead-letter topic: a later redrive resends
                    log.warning("redriven records could not be acked in the dead-letter topic; they stay there "
                                "and a later redrive sends them again", extra={
                                    "topic": t.name, "records": len(moved) - acked})
                redriven += acked
        finally:
            back = skipped + again + pending
            if back:
                self._giver(t, back)()
        return json_response(200, {"redriven": redriven, "skipped": len(skipped)})


REDRIVE_DEFAULT, REDRIVE_MAX = 1000, 10_000
REDRIVE_LEASE_MS = 600_000  # a redrive's leases: longer than a call takes (they are given back or acked)


def _topic_ids(store: Any) -> set[str]:
    """The ids of every topic there is now (one read of the replica)."""
    with store.read() as r:
        return {t.id for t in r.topics()}


def _redrive_entry(it: Item, here: TopicRecord, store: Any, inc: Any, choose: Any,
                   live: Callable[[], set[str]]) -> tuple[Entry, bytes] | None:
    """The produce that sends a dead-letter record of topic `here` back to its origin
    (original key and headers, and the origin it had itself when it was a dead letter
    already: a chain) and the message body; None when it has no origin, the origin
    topic is gone (a topic of that name made since is another one), or the record is
    a copy of a dead letter committed to another topic (a fan-out child's, attached or
    detached since: the dead-letter topic's own record is the one redriven, while that
    topic is there; `live` gives the ids of the topics there are)."""
    try:
        ext, body = FR.split_ext(it.flags, it.payload)
    except FR.FrameError:
        return None
    d = ext.d if ext is not None else None
    if d is None or (d.q is not None and d.q != here.id and d.q in live()):
        return None
    origin = store.topic(d.t)
    if origin is None or (d.id is not None and d.id != origin.id) or (origin.delay_ms and origin.parent is not None):
        return None  # gone (or another topic of that name), or a delay child (fed by its parent only)
    part = d.p if 0 <= d.p < origin.partitions else choose(origin, d.k)
    flags = it.flags & ~FR.F_EXT
    payload = body
    if ext is not None and (ext.h or d.prev is not None):
        payload = FR.pack_ext(FR.Ext(h=ext.h or None, d=d.prev), body)
        flags |= FR.F_EXT
    return Entry(origin.name, inc(origin), part, int(time.time() * 1000), flags, d.k, payload), body


def _settle_ms(mode: int, raw_delay: str | None, raw_vis: str | None) -> int:
    """The settle's duration in ms: a nack's delay or an extend's lease length (0:
    none given). Each belongs to one mode only: elsewhere it is a 400."""
    if raw_delay is not None:
        if mode != NACK:
            raise BadRequest("invalid argument: delay applies to a nack only (extend=0)")
        if raw_vis is not None:
            raise BadRequest("invalid argument: visibility applies to an extend only (extend=true), not a nack")
        return duration_ms(raw_delay, "delay", 0.0, MAX_DELAY_S)
    if raw_vis is not None:
        if mode != EXTEND:
            raise BadRequest("invalid argument: visibility applies to an extend only (extend=true), "
                             "not an ack or a nack")
        return duration_ms(raw_vis, "visibility", MIN_VISIBILITY_S, MAX_VISIBILITY_S)
    return 0


MAX_REASON_BYTES = 256


def _nack_reason(mode: int, raw: str | None) -> str:
    """A nack's reason ("" when none): a nack only, at most 256 bytes of UTF-8."""
    if raw is None:
        return ""
    if mode != NACK:
        raise BadRequest("invalid argument: reason applies to a nack only (extend=0)")
    try:
        n = len(raw.encode())
    except UnicodeEncodeError:
        raise BadRequest("invalid argument: reason must be valid UTF-8") from None
    if n > MAX_REASON_BYTES:
        raise BadRequest(f"invalid argument: reason must be at most {MAX_REASON_BYTES} bytes of UTF-8, got {n}")
    return raw


def _parse_handle(h: str) -> tuple[int, int, int] | None:
    """``partition:offset:nonce``, each ASCII digits within int64 (nonces are 63-bit,
    offsets fit int64): anything else is not a handle this node handed out (400)."""
    parts = h.split(":")
    if len(parts) != 3:
        return None
    p, off, nonce = (strict_int(x) for x in parts)
    if p is None or off is None or nonce is None:
        return None
    return p, off, nonce
