"""On-disk formats of the partition log: frames and record envelopes.

Frame (big-endian, 27-byte header, after Narad's storage/format.go):

    0  2  magic 0xCA 0xFE (outside the CRC, so a resync scan can look for it)
    2  1  flags: bits 0-2 codec (0 = none; the only codec written)
    3  4  record count
    7  8  base offset (offset of the first record)
    15 4  payload size
    19 4  on-disk payload size (equal without a codec)
    23 4  CRC-32C over header bytes [2:23] and the payload
    27 n  payload: count x (u32 length, record bytes)

Record envelope: ``u8 version (3) | u8 flags | uvarint key length | key |
u64 committed-at ms | payload``. Flags: bit0 has key, bit1 the payload is one
valid JSON text, bit2 it is valid UTF-8 (computed once at produce time, so a
consume renders the payload without parsing it again), bit3 (``F_EXT``) the
payload starts with an *extension block* (issue 14).

Extension block: ``uvarint length | MessagePack map | message body``. The map
(``Ext``) carries what Narad's record has no place for: ``i`` an idempotency
key (always the first key written, so ``has_idem`` tells from two bytes), ``h``
headers (the JSON text of one string-to-string object, kept as text so a
consume copies it into its answer without parsing), ``d`` a dead-letter origin. Bits 1-2
describe the body alone. The block lives inside the payload field, so every
path that carries (key, flags, payload) untouched (the ingress WAL, commits
between workers and nodes, fan-out and delay children, partition moves) carries
it without knowing of it; only produce (``pack_ext``) and consume rendering
(``split_ext``) look inside. Unknown map keys are ignored (a newer writer's
fields), so the block can grow. A record without bit3 is byte-for-byte what it
was.

Pure functions. Imports crc32c (a maintained C implementation), msgspec.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from itertools import repeat
from operator import itemgetter
from typing import Any

import msgspec
from crc32c import crc32c

from narad._native import ffi as _ffi
from narad._native import lib as _native

MAGIC = b"\xca\xfe"
HEADER = struct.Struct(">2sBiqII I")
HEADER_SIZE = 27
MAX_FRAME_BYTES = 256 << 20
RECORD_VERSION = 3
F_KEY, F_JSON, F_UTF8, F_EXT = 1, 2, 4, 8
# A reader's bound on an extension block's length (the block must also fit its payload). Produce
# writes at most ~50 KB (8 KiB of headers, JSON-escaped, and a 128-byte key), but a dead-letter copy
# carries the source record's key, which may be as large as a WAL record allows.
MAX_EXT_BYTES = 16 << 20

_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_CRC_HDR = struct.Struct(">BiqII")

assert HEADER.size == HEADER_SIZE


def uvarint(n: int) -> bytes:
    """`n` (>= 0) as a uvarint: the record's key length, the extension block's length, the
    offsets slot's deltas and counts."""
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_uvarint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it) of the uvarint at `pos`: the record's key length and the
    extension block's length. Value -1 when it runs past `buf` or over 10 bytes."""
    n = len(buf)
    if pos < n and buf[pos] < 0x80:  # one byte: nearly every key and block
        return buf[pos], pos + 1
    shift = val = 0
    while pos < n and shift <= 63:
        b = buf[pos]
        pos += 1
        val |= (b & 0x7F) << shift
        if b < 0x80:
            return val, pos
        shift += 7
    return -1, pos


def encode_record(key: bytes | None, committed_ms: int, flags: int, payload: bytes) -> bytes:
    if key:
        return bytes((RECORD_VERSION, flags | F_KEY)) + uvarint(len(key)) + key + _U64.pack(committed_ms) + payload
    return bytes((RECORD_VERSION, flags & ~F_KEY, 0)) + _U64.pack(committed_ms) + payload


def decode_record(rec: bytes | memoryview) -> tuple[bytes | None, int, int, bytes]:
    """-> (key or None, committed-at ms, flags, payload). Raises FrameError (a
    ValueError) for anything malformed: a short envelope, a key length running
    past the record or a varint longer than 10 bytes."""
    n = len(rec)
    if n < 3:
        raise FrameError("record envelope too short")
    if rec[0] != RECORD_VERSION:
        raise FrameError(f"unknown record version {rec[0]}")
    flags = rec[1]
    klen = rec[2]
    if klen < 0x80:  # a one-byte key length (read inline: this runs for every record read)
        pos = 3
    else:
        klen, pos = read_uvarint(rec, 2)
        if klen < 0:
            raise FrameError("bad key length in record envelope")
    if pos + klen + 8 > n:
        raise FrameError("record envelope shorter than its key and timestamp")
    key = bytes(rec[pos : pos + klen]) if klen else None
    pos += klen
    (ts,) = _U64.unpack_from(rec, pos)
    return key, ts, flags, bytes(rec[pos + 8 :])


class Laid:
    """A frame's records laid out by ``lay`` and not yet joined: for each, its length
    and envelope head (one bytes) and its payload (the caller's object, not copied).
    ``encode_frame`` joins them once; the frame's bytes are those of
    ``encode_frame(base, [encode_record(...) for each record])``."""

    __slots__ = ("count", "parts")

    def __init__(self) -> None:
        self.count = 0
        self.parts: list[Any] = []  # bytes, and the native lay's cffi buffers (bytes-like)

    def __len__(self) -> int:
        return self.count


def lay(laid: Laid, records: Iterable[tuple[bytes | None, int, bytes]], committed_ms: int,
        decoded: list[tuple[bytes | None, int, int, bytes]]) -> None:
    """Append (key, flags, payload) records, committed at `committed_ms`, to `laid`
    (``encode_record``'s envelope, with its length in front as a frame holds it), and
    each as (key, committed-at, flags, payload) to `decoded`. Per record this is a
    fraction of ``encode_record`` + ``encode_frame``'s work: a keyless record's head
    depends only on its flags and length, so it is built once a batch for each, and no
    payload is copied until the frame is joined."""
    ts8 = _U64.pack(committed_ms)
    parts = laid.parts
    u32 = _U32.pack
    last = -1
    heads: dict[int, bytes] = {}
    head = b""
    n = 0
    for key, flags, payload in records:
        if key:
            h = bytes((RECORD_VERSION, flags | F_KEY)) + uvarint(len(key)) + key + ts8
            parts.append(u32(len(h) + len(payload)) + h)
        else:
            if flags != last:  # (a batch's flags are nearly always one value)
                last = flags
                heads = {}
                head = bytes((RECORD_VERSION, flags & ~F_KEY, 0)) + ts8
            size = len(payload)
            h = heads.get(size)
            if h is None:
                h = heads[size] = u32(len(head) + size) + head
            parts.append(h)
        parts.append(payload)
        decoded.append((key, committed_ms, flags, payload))
        n += 1
    laid.count += n


def encode_frame(base_offset: int, records: list[bytes] | Laid) -> bytes:
    """A frame at `base_offset` holding `records` (each ``encode_record``'s bytes, or
    laid out by ``lay``)."""
    if isinstance(records, Laid):
        payload = b"".join(records.parts)
    else:
        parts = []
        for r in records:
            parts.append(_U32.pack(len(r)))
            parts.append(r)
        payload = b"".join(parts)
    n = len(payload)
    crc = crc32c(payload, crc32c(_CRC_HDR.pack(0, len(records), base_offset, n, n)), _gil_mode(n))
    return HEADER.pack(MAGIC, 0, len(records), base_offset, n, n, crc) + payload


# The crc32c package releases the GIL for a buffer of 32 KiB or more. A frame's CRC takes
# some microseconds (SSE4.2): releasing the GIL for it only hands the GIL to the event loop
# and back, two waits of the commit thread and a switch of the loop each time (measured with
# strace: a commit round over three partitions' frames of ~33 KiB made the loop thread's
# futex calls 2.5 times as many). The GIL is kept for a frame under GIL_KEEP_BYTES.
GIL_KEEP_BYTES = 1 << 20


def _gil_mode(n: int) -> int:
    """crc32c's gil_release_mode for `n` bytes: 0 (keep the GIL) under GIL_KEEP_BYTES, else 1."""
    return 0 if n < GIL_KEEP_BYTES else 1


class FrameError(ValueError):
    pass


def parse_header(buf: bytes | memoryview, pos: int = 0) -> tuple[int, int, int, int]:
    """-> (record count, base offset, payload size, crc). Raises FrameError."""
    if len(buf) - pos < HEADER_SIZE or pos < 0:
        raise FrameError("short frame header")
    magic, flags, count, base, usize, csize, crc = HEADER.unpack_from(buf, pos)
    if magic != MAGIC:
        raise FrameError("bad magic")
    if flags & 0x07:
        raise FrameError("unknown codec")
    if count <= 0 or base < 0 or usize != csize or csize > MAX_FRAME_BYTES or csize < 4 * count:
        raise FrameError("implausible header")
    return count, base, csize, crc


def frame_crc_ok(buf: bytes | memoryview, pos: int, count: int, base: int, size: int, crc: int) -> bool:
    hdr = _CRC_HDR.pack(buf[pos + 2], count, base, size, size)
    return crc32c(buf[pos + HEADER_SIZE : pos + HEADER_SIZE + size], crc32c(hdr), _gil_mode(size)) == crc


def split_records(payload: bytes | memoryview, count: int) -> list[memoryview]:
    view = memoryview(payload)
    out = []
    pos = 0
    if count < 0 or 4 * count > len(view):
        raise FrameError("record count does not fit the frame")
    for _ in range(count):
        if pos + 4 > len(view):
            raise FrameError("record runs past the frame")
        (n,) = _U32.unpack_from(view, pos)
        pos += 4
        if pos + n > len(view):
            raise FrameError("record runs past the frame")
        out.append(view[pos : pos + n])
        pos += n
    if pos != len(view):
        raise FrameError("trailing bytes in frame")
    return out


# ---- extension block (issue 14) ----------------------------------------------------------------
class DeadLetter(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """Where a dead-lettered record came from (``Ext.d``)."""

    t: str  # source topic
    p: int  # source partition
    o: int  # source offset
    c: int  # deliveries it had
    k: bytes | None = None  # source key
    r: str | None = None  # the last nack's reason
    ts: int = 0  # committed-at ms in the source
    # Later fields (an older node ignores them; a record without them is redriven by name):
    id: str | None = None  # the source topic's id: a redrive sends it back to that incarnation only
    q: str | None = None  # the id of the dead-letter topic it was committed to (a copy elsewhere is not redriven)
    prev: DeadLetter | None = None  # its own origin when it was a dead letter itself (a chain), to restore


MAX_ORIGINS = 8  # origins a dead letter keeps (a chain's deepest beyond this is dropped)


def nest_origin(d: DeadLetter, prev: DeadLetter | None, keep: int = MAX_ORIGINS) -> DeadLetter:
    """`d` with `prev` under it, at most `keep` origins in all (the deepest dropped)."""
    chain: list[DeadLetter] = []
    while prev is not None and len(chain) < keep - 1:
        chain.append(prev)
        prev = prev.prev
    under = None
    for o in reversed(chain):
        under = msgspec.structs.replace(o, prev=under)
    return msgspec.structs.replace(d, prev=under)


class Ext(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """The extension block's map. Every field optional; empty fields are not written.
    msgspec writes the fields in this order: ``i`` first is what ``has_idem`` reads."""

    i: str | None = None  # idempotency key
    h: bytes | None = None  # headers: one JSON object text, string to string (``headers_json``)
    d: DeadLetter | None = None  # dead-letter origin


_ext_enc = msgspec.msgpack.Encoder()
_ext_dec = msgspec.msgpack.Decoder(Ext)
_hdr_enc = msgspec.json.Encoder()
_IDEM_KEY = b"\xa1i"  # MessagePack fixstr "i": the first key of a map that has an idempotency key
_HDR_KEY = b"\xa1h"  # fixstr "h": the headers' key
_IDEM_FIXMAP = b"\x81\xa1i"  # a one-entry map {"i": ...}: an idempotency key alone
_HDR_BIN8 = b"\x81\xa1h\xc4"  # a one-entry map {"h": bin8}: headers alone, their text under 256 bytes
# ``stored[1:4]`` of a block holding headers alone (a one-byte length, a one-entry map
# whose key is "h"): a consume reads its headers in place after it. (It has no
# idempotency key: a commit answers None without ``idem.key_of`` for any block with a
# one-byte length whose ``stored[3]``, the map's first key, is not "i".)
HEADERS_ALONE = b"\x81\xa1h"
# ``stored[1:4]`` of a block that starts as an idempotency key alone (a one-byte length, a
# one-entry map whose key is "i"): a consume skips a key of up to 122 bytes in place after it.
KEY_ALONE = _IDEM_FIXMAP


# headers_json(h: dict[str, str]) -> bytes: headers as they are stored in ``Ext.h`` (and
# returned on consume): their compact JSON text. The encoder's own method (no Python frame
# around it: it runs once a message with headers).
headers_json = _hdr_enc.encode


def pack_ext(ext: Ext, body: bytes) -> bytes:
    """The stored payload of a record with an extension block (set ``F_EXT`` in its flags)."""
    blob = _ext_enc.encode(ext)
    return b"".join((uvarint(len(blob)), blob, body))  # one copy of the body


# Length byte and map head of a headers-only block whose JSON text is n < 123 bytes
# (the block, 5 + n bytes, then has a one-byte length). The batch produce path joins
# ``HEADERS_HEADS[n] + hjson + body`` itself (``pack_headers`` inline).
HEADERS_HEADS = tuple(bytes((5 + n, 0x81, 0xA1, 0x68, 0xC4, n)) for n in range(0x80 - 5))


def pack_headers(hjson: bytes, body: bytes) -> bytes:
    """``pack_ext(Ext(h=hjson), body)`` byte for byte (a one-entry map, the headers as
    bin8 or bin16, as msgspec writes it), without building the struct: the produce
    path's common block."""
    n = len(hjson)
    if n < 0x7B:  # (``len(HEADERS_HEADS)``: the block's length still fits in one byte)
        return b"".join((HEADERS_HEADS[n], hjson, body))
    if n < 0x100:
        head = b"\x81\xa1h\xc4" + bytes((n,))
    elif n < 0x10000:
        head = b"\x81\xa1h\xc5" + n.to_bytes(2, "big")
    else:
        return pack_ext(Ext(h=bytes(hjson)), body)
    return b"".join((uvarint(len(head) + n), head, hjson, body))


# Length byte and map head of an idempotency-key-only block whose key is n < 32 bytes
# of UTF-8 (a fixstr; the block, 4 + n bytes, has a one-byte length).
# A commit reads a short key's block in place by ``stored.startswith(IDEM_HEADS[stored[0] - 4])``
# (the length byte fixes the whole head).
IDEM_HEADS = tuple(bytes((4 + n, 0x81, 0xA1, 0x69, 0xA0 | n)) for n in range(32))
# Length byte and map head of an idempotency-key-only block whose key is 32 <= n <= 122
# bytes (a str8: a UUID's 36 characters are the common case; the block, 6 + n bytes, still
# has a one-byte length): ``IDEM_HEADS8[n - 32]``, read as ``IDEM_HEADS8[stored[0] - 37]``.
IDEM_HEADS8 = tuple(bytes((5 + n, 0x81, 0xA1, 0x69, 0xD9, n)) for n in range(32, 123))


def pack_idem(key: bytes, body: bytes) -> bytes:
    """``pack_ext(Ext(i=key.decode()), body)`` byte for byte (a one-entry map, the key
    as fixstr or str8, as msgspec writes it), without building the struct: an
    idempotent produce's block. `key` is the key's UTF-8."""
    n = len(key)
    if n < 32:
        return b"".join((IDEM_HEADS[n], key, body))
    if n < 123:
        return b"".join((IDEM_HEADS8[n - 32], key, body))
    if n < 0x100:
        return b"".join((uvarint(5 + n), b"\x81\xa1i\xd9", bytes((n,)), key, body))
    return pack_ext(Ext(i=key.decode()), body)


def lay_keyed(laid: Laid, records: list[tuple[bytes | None, int, bytes]], ikeys: list[str | None],
              committed_ms: int, decoded: list[tuple[bytes | None, int, int, bytes]]) -> None:
    """``lay`` for a producer's direct commit (``ikeys``: each record's idempotency key):
    a record with a key and no ``F_EXT`` came without its block (the one-pass idempotent
    batch sends the body alone). It is written as ``pack_idem`` makes it (flags |
    ``F_EXT``, the key-alone block in front of the body: the same bytes on disk) and kept
    in `decoded` as given, so what a consume reads from memory is the body alone (no block
    to cut off); read from disk it has its block, which a consume cuts off. Any other
    record is laid as ``lay`` lays it. As in ``lay``, nothing is joined here: a keyless
    record's envelope head depends only on its flags and size (built once a batch for
    each), and the block's head, the key and the body are parts of their own.

    The common case (every record keyed, none with a message key or ``F_EXT``, one
    flags value, every key 1 to 122 bytes) is laid in one native call (``lay_idem``)
    into one part, the same bytes: no Python runs per record."""
    n = len(records)
    if n > 1 and _lay_native(laid, records, ikeys, committed_ms, decoded, n):
        return
    ts8 = _U64.pack(committed_ms)
    parts = laid.parts
    append = parts.append
    u32 = _U32.pack
    short, long8 = IDEM_HEADS, IDEM_HEADS8
    last = -1
    pre: dict[int, bytes] = {}
    head = b""
    n = 0
    for (key, flags, payload), ik in zip(records, ikeys, strict=True):
        if ik is None or flags & F_EXT:
            lay(laid, ((key, flags, payload),), committed_ms, decoded)
            n -= 1  # (counted by lay)
        else:
            kb = ik.encode()
            m = len(kb)
            if key or m >= 123:  # (a message key, or a key of 123 bytes or more: packed, then laid)
                lay(laid, ((key, flags | F_EXT, pack_idem(kb, payload)),), committed_ms, [])
                decoded.append((key, committed_ms, flags, payload))
                continue
            bh = short[m] if m < 32 else long8[m - 32]
            if flags != last:  # (a batch's flags are nearly always one value)
                last = flags
                pre = {}
                head = bytes((RECORD_VERSION, (flags | F_EXT) & ~F_KEY, 0)) + ts8
            size = len(bh) + m + len(payload)
            h = pre.get(size)
            if h is None:
                h = pre[size] = u32(len(head) + size) + head
            append(h)
            append(bh)
            append(kb)
            append(payload)
            decoded.append((None, committed_ms, flags, payload))
        n += 1
    laid.count += n


_KEY_OF, _FLAGS_OF, _BODY_OF = itemgetter(0), itemgetter(1), itemgetter(2)
_new_uncleared = _ffi.new_allocator(should_clear_after_alloc=False)


def _lay_native(laid: Laid, records: list[tuple[bytes | None, int, bytes]], ikeys: list[str | None],
                committed_ms: int, decoded: list[tuple[bytes | None, int, int, bytes]], n: int) -> bool:
    """``lay_keyed``'s common case in one native call; False (nothing laid) when the
    records are not all of it: the caller lays them record by record."""
    flags = set(map(_FLAGS_OF, records))
    if len(flags) != 1 or any(map(_KEY_OF, records)):
        return False
    (fl,) = flags
    if fl & (F_EXT | F_KEY) or not 0 <= fl < 0x100:
        return False
    try:
        kj = "\0".join(ikeys).encode()  # type: ignore[arg-type]
    except (TypeError, UnicodeEncodeError):  # (a record without a key, or a lone surrogate)
        return False
    bodies = list(map(_BODY_OF, records))
    bj = b"".join(bodies)
    cap = len(bj) + len(kj) + 21 * n
    out = _new_uncleared("char[]", cap)  # (every byte of it that is kept is written)
    w = _native.lay_idem(bj, _ffi.new("uint32_t[]", list(map(len, bodies))), kj, len(kj), n,
                         fl | F_EXT, committed_ms, out, cap)
    if w < 0:
        return False
    laid.parts.append(_ffi.buffer(out, w))  # (over `out`, which it keeps alive: joined at the write)
    laid.count += n
    decoded.extend(zip(repeat(None), repeat(committed_ms), repeat(fl), bodies))
    return True


def idem_span(stored: bytes) -> tuple[int, int]:
    """Where the idempotency key's UTF-8 lies in `stored` (flags with ``F_EXT``) when
    its block is a key alone (fixstr or str8, ending where the block ends), else
    (-1, -1): the caller decodes the block (``read_ext``). The bytes are not checked."""
    if len(stored) < 5:
        return -1, -1
    blen = stored[0]
    if blen < 0x80:
        pos = 1
    else:
        blen, pos = read_uvarint(stored, 0)
    if blen < 4 or stored[pos : pos + 3] != b"\x81\xa1i":
        return -1, -1
    end = pos + blen
    t = stored[pos + 3]
    if 0xA0 <= t <= 0xBF:
        ks = pos + 4
        ke = ks + (t & 0x1F)
    elif t == 0xD9 and blen >= 5:
        ks = pos + 5
        ke = ks + stored[pos + 4]
    else:
        return -1, -1
    return (ks, ke) if ke == end and end <= len(stored) else (-1, -1)


NOT_PLAIN = (0, 0, -1)


def plain_block(stored: bytes) -> tuple[int, int, int]:
    """A consume's fast path through the extension block of `stored` (flags with
    ``F_EXT``) when it is one of the two common shapes, read without decoding it:
    an idempotency key alone (a one-entry map ``i``: fixstr, str8 or str16, a key
    being at most 128 bytes; its bytes are not checked, a consume never shows it),
    or headers alone (a one-entry map ``h``: bin8 or bin16), in either case ending
    exactly where the block ends. -> (start, end of the headers' JSON text, equal
    when there are none; where the body starts), or ``NOT_PLAIN`` (body start -1)
    for any other block: the caller decodes it (``ext_at``), which refuses a
    malformed one."""
    if not stored:
        return NOT_PLAIN
    blen = stored[0]
    if blen < 0x80:
        # The commonest block first: headers alone, their JSON text under 256 bytes
        # (bin8), the block's length in one byte.
        head = stored[1:5]
        if head == _HDR_BIN8 and len(stored) > 5:
            end = blen + 1
            return (6, end, end) if 6 + stored[5] == end and end <= len(stored) else NOT_PLAIN
        if head[:3] == _IDEM_FIXMAP and len(head) == 4 and 0xA0 <= head[3] <= 0xBF:
            # An idempotency key alone, under 32 bytes (a fixstr); a longer one is read below.
            end = blen + 1
            return (0, 0, end) if 5 + (head[3] & 0x1F) == end <= len(stored) else NOT_PLAIN
        pos = 1
    else:
        blen, pos = read_uvarint(stored, 0)
    end = pos + blen
    if blen < 4 or end > len(stored) or stored[pos] != 0x81:
        return NOT_PLAIN
    key = stored[pos + 1 : pos + 3]
    t = stored[pos + 3]
    if key == _HDR_KEY:
        if t == 0xC4 and blen >= 5:
            hs = pos + 5
            he = hs + stored[pos + 4]
        elif t == 0xC5 and blen >= 6:
            hs = pos + 6
            he = hs + (stored[pos + 4] << 8 | stored[pos + 5])
        else:
            return NOT_PLAIN
        return (hs, he, end) if he == end else NOT_PLAIN
    if key != _IDEM_KEY:
        return NOT_PLAIN
    if 0xA0 <= t <= 0xBF:
        at = pos + 4 + (t & 0x1F)
    elif t == 0xD9 and blen >= 5:
        at = pos + 5 + stored[pos + 4]
    elif t == 0xDA and blen >= 6:
        at = pos + 6 + (stored[pos + 4] << 8 | stored[pos + 5])
    else:
        return NOT_PLAIN
    return (0, 0, end) if at == end else NOT_PLAIN


def has_idem(stored: bytes) -> bool:
    """Whether the extension block of `stored` (a payload whose flags have ``F_EXT``)
    carries an idempotency key, read from its first map key without decoding the map
    (records with headers alone pay two byte reads). A malformed block may answer
    either way: ``read_ext`` (``key_of``) decides, and finds it malformed."""
    if stored and stored[0] < 0x80:  # a one-byte length: nearly every block
        return stored[0] >= 3 and stored[2:4] == _IDEM_KEY
    blen, pos = read_uvarint(stored, 0)
    return blen >= 3 and stored[pos + 1 : pos + 3] == _IDEM_KEY


def split_ext(flags: int, stored: bytes) -> tuple[Ext | None, bytes]:
    """-> (extension block or None, message body). A record without ``F_EXT`` is
    returned whole. Raises FrameError when the block is malformed."""
    if not flags & F_EXT:
        return None, stored
    ext, pos = ext_at(stored)
    return ext, stored[pos:]


def without_idem(flags: int, stored: bytes) -> tuple[int, bytes]:
    """(flags, stored payload) of the record with its idempotency key taken out of the
    extension block (headers and a dead-letter origin kept; no block left: no ``F_EXT``).
    A record without a key, or with a malformed block, is returned as it is."""
    if not flags & F_EXT or not has_idem(stored):
        return flags, stored
    try:
        ext, pos = ext_at(stored)
    except FrameError:
        return flags, stored
    if ext.i is None:
        return flags, stored
    if ext.h is None and ext.d is None:
        return flags & ~F_EXT, stored[pos:]
    return flags, pack_ext(Ext(h=ext.h, d=ext.d), stored[pos:])


def read_ext(stored: bytes) -> Ext:
    """The extension block of a stored payload whose flags have ``F_EXT`` (the body
    is not copied). Raises FrameError when the block is malformed."""
    return ext_at(stored)[0]


def ext_at(stored: bytes) -> tuple[Ext, int]:
    """-> (extension block, where the body starts) of a payload whose flags have
    ``F_EXT``, for a reader that slices the body itself. Raises FrameError when the
    block is malformed."""
    blen, pos = read_uvarint(stored, 0)
    if blen < 0:
        raise FrameError("bad extension block length")
    if blen > MAX_EXT_BYTES or pos + blen > len(stored):
        raise FrameError("extension block runs past the record")
    try:
        return _ext_dec.decode(stored[pos : pos + blen]), pos + blen  # a short copy beats a memoryview
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise FrameError(f"bad extension block: {e}") from None
