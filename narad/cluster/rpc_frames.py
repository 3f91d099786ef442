"""Node RPC frames: the wire codec, the frame cap, and how errors travel.

A connection carries a sequence of frames in both directions (TLS 1.3 over TCP, see
narad.cluster.rpc_auth). A frame is a fixed 13-byte header then the body:

    u32 big-endian body length | u8 kind | u64 big-endian request id | body

Kinds: ``REQ`` (client -> server; body a tagged ``msgspec.Struct``, msgpack), ``OK`` (the
handler's returned struct), ``ERR`` (``[status, message, code, extra]``, re-raised on the caller
as the same ``narad.errors`` class), ``NOTE`` (one-way, like REQ, never answered), ``CANCEL``
(the caller gave up on request ``id``: the handler is cancelled), ``PING`` / ``PONG`` (liveness;
``id`` echoed) and ``HELLO`` (the server's first frame: the client's proof was accepted). The
numbers of REQ/OK/ERR/NOTE are those of narad.ipc.rpc.

The header sits outside the body so that a frame whose announced length is over ``MAX_FRAME``
is refused from its 13 bytes alone: the receiver answers (or fails) that one request and skips
the body as it arrives without keeping any of it (``FrameReader``); nothing over the cap is
ever buffered.

Imports narad.errors and msgspec only.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Union

import msgspec

from narad.errors import NaradError, error_for_status

REQ, OK, ERR, NOTE = 0, 1, 2, 3  # as narad.ipc.rpc
CANCEL, PING, PONG, HELLO = 4, 5, 6, 7
KINDS = frozenset((REQ, OK, ERR, NOTE, CANCEL, PING, PONG, HELLO))

MAX_FRAME = 16 << 20  # body bytes of one frame
HEADER = struct.Struct(">IBQ")
HEADER_LEN = HEADER.size  # 13

_enc = msgspec.msgpack.Encoder()
_err_dec = msgspec.msgpack.Decoder(tuple[int, str, Union[str, None], dict[str, Any]])  # noqa: UP007

encode = _enc.encode


def header(kind: int, rid: int, length: int) -> bytes:
    return HEADER.pack(length, kind, rid)


def encode_error(status: int, message: str, code: str | None = None, extra: dict[str, Any] | None = None) -> bytes:
    """The body of an ERR frame."""
    try:
        return _enc.encode((status, message, code, extra or {}))
    except Exception:  # extra not encodable
        return _enc.encode((status, message, code, {}))


def decode_error(body: bytes) -> NaradError:
    """An ERR body as the narad error it stands for (raises msgspec.DecodeError if malformed)."""
    status, message, code, extra = _err_dec.decode(body)
    return error_for_status(status, message, code, extra or None)


def undecodable(body: bytes, err: msgspec.DecodeError) -> str:
    """Why a request body could not be decoded: an unknown struct tag is an operation this
    node does not serve (callers may downgrade); anything else is a malformed request."""
    where = str(err)
    if "`$.type`" in where or (where.startswith("Invalid value") and where.endswith("at `$[0]`")):
        try:  # (a map's "type", or an array-like struct's first element)
            doc = msgspec.msgpack.decode(body)
            tag = doc.get("type") if isinstance(doc, dict) else doc[0] if isinstance(doc, list) and doc else None
        except Exception:
            tag = None
        if isinstance(tag, str):
            return f"unsupported rpc operation {tag[:64]}"
    return f"undecodable request: {err}"


class ProtocolError(Exception):
    """The byte stream is not a sequence of our frames: the connection must close."""


# on_frame(kind, rid, body); body is None for a frame over the cap (its body is being skipped)
OnFrame = Callable[[int, int, "bytes | None"], None]


_SCRATCH = bytearray(64 << 10)  # where skipped bodies are read to (never looked at)


class FrameReader:
    """Incremental frame parser, shaped for ``asyncio.BufferedProtocol``: the transport reads
    straight into ``get_buffer()`` and reports with ``updated(n)``; ``on_frame`` is called per
    complete frame. (``feed`` does both, for bytes at hand.)

    Keeps at most one incomplete frame (never more than ``HEADER_LEN + cap`` bytes; the buffer
    grows to a frame's size once its header announced it, so a large frame is read in place,
    without repeated copies). A frame announced over ``cap`` is reported at once with
    ``body=None`` and its body is then read into a scratch buffer and dropped as it streams
    in (``skipping`` counts what is left of it)."""

    __slots__ = ("_buf", "_cap", "_len", "_need", "_on_frame", "_skip_view", "paused", "skipping")

    MIN_FREE = 64 << 10
    INITIAL = 128 << 10

    def __init__(self, on_frame: OnFrame, cap: int = MAX_FRAME) -> None:
        self._on_frame = on_frame
        self._cap = cap
        self._buf = bytearray(self.INITIAL)
        self._len = 0  # valid bytes at the start of _buf
        self._need = 0  # total size of the incomplete frame at the start of _buf, once known
        self._skip_view = False
        self.skipping = 0
        # set (by on_frame or its owner) to stop delivering frames: what is buffered waits for
        # the next ``parse()`` (reading must be paused meanwhile, or the buffer grows)
        self.paused = False

    @property
    def buffered(self) -> int:
        return self._len

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self.skipping:
            self._skip_view = True
            return memoryview(_SCRATCH)[: min(self.skipping, len(_SCRATCH))]
        self._skip_view = False
        buf = self._buf
        want = max(self.MIN_FREE, self._need - self._len)
        if len(buf) - self._len < want:
            # a new buffer, not a resize: the transport may still hold a view of the old one
            grown = bytearray(self._len + want)
            grown[: self._len] = memoryview(buf)[: self._len]
            self._buf = buf = grown
        return memoryview(buf)[self._len :]

    def updated(self, nbytes: int) -> None:
        """``nbytes`` more arrived in the last buffer. Raises ProtocolError on an unknown kind
        (whatever came before it was delivered)."""
        if self._skip_view:
            self._skip_view = False
            self.skipping -= nbytes
            return
        self._len += nbytes
        self.parse()

    def hold(self, nbytes: int) -> None:
        """``nbytes`` more arrived, not to be parsed yet (``parse`` later)."""
        if self._skip_view:
            self._skip_view = False
            self.skipping -= nbytes
        else:
            self._len += nbytes

    def parse(self) -> None:
        buf = self._buf
        end_ = self._len
        pos = 0
        unpack = HEADER.unpack_from
        on_frame = self._on_frame
        cap = self._cap
        self._need = 0
        mv = memoryview(buf)
        try:
            while end_ - pos >= HEADER_LEN and not self.paused:
                length, kind, rid = unpack(buf, pos)
                if kind not in KINDS:
                    raise ProtocolError(f"unknown frame kind {kind}")
                if length > cap:
                    pos += HEADER_LEN
                    avail = end_ - pos
                    if avail >= length:
                        pos += length
                    else:
                        self.skipping = length - avail
                        pos = end_
                    on_frame(kind, rid, None)
                    continue
                end = pos + HEADER_LEN + length
                if end > end_:
                    self._need = HEADER_LEN + length
                    break
                body = bytes(mv[pos + HEADER_LEN : end])
                pos = end
                on_frame(kind, rid, body)
        finally:
            rest = end_ - pos
            if pos:
                if rest:
                    mv[:rest] = bytes(mv[pos:end_])
                self._len = rest
            mv.release()
            if rest == 0 and len(buf) > 4 * self.INITIAL:
                self._buf = bytearray(self.INITIAL)  # give a large frame's memory back

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            b = self.get_buffer(len(view))
            n = min(len(b), len(view))
            b[:n] = view[:n]
            b.release()
            self.updated(n)
            view = view[n:]
