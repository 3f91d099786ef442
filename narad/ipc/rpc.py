"""Local RPC between narad processes: length-prefixed msgpack frames over Unix
sockets, on asyncio (uvloop in practice).

Frame: ``u32 big-endian length`` + msgpack ``[kind, id, body]``. Requests and
notes carry a tagged ``msgspec.Struct`` (the receiver decodes it against the
union of types its handler accepts); an OK reply carries the handler's
returned struct, decoded by the caller against the type it expects; an error
reply carries ``[status, message, code, extra]`` and is re-raised on the caller
as the same narad.errors class. Either end may call the other.

Used by the supervisor (worker API, naradctl), workers and naradctl.
Imports only narad.errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import struct
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, Union

import msgspec

from narad.errors import GatewayTimeout, NaradError, PayloadTooLarge, Unavailable, error_for_status

log = logging.getLogger("narad.ipc")

REQ, OK, ERR, NOTE = 0, 1, 2, 3
MAX_FRAME = 64 * 1024 * 1024
_LEN = struct.Struct(">I")
T = TypeVar("T")

Handler = Callable[[Any, "Connection"], Awaitable[Any]]


class ConnectionLost(Unavailable):
    pass


_enc = msgspec.msgpack.Encoder()
_frame_dec = msgspec.msgpack.Decoder(tuple[int, int, msgspec.Raw])
_err_dec = msgspec.msgpack.Decoder(tuple[int, str, Union[str, None], dict[str, Any]])  # noqa: UP007


def encode_frame(kind: int, rid: int, body: bytes | msgspec.Raw) -> bytes:
    payload = _enc.encode((kind, rid, body if isinstance(body, msgspec.Raw) else msgspec.Raw(body)))
    return _LEN.pack(len(payload)) + payload


def _frame(kind: int, rid: int, obj: Any) -> bytearray:
    """The frame of `obj`, encoded in one pass: the same bytes as
    ``encode_frame(kind, rid, _enc.encode(obj))`` without the copies."""
    buf = bytearray(4)
    _enc.encode_into((kind, rid, obj), buf, 4)
    _LEN.pack_into(buf, 0, len(buf) - 4)
    return buf


class Service:
    """What one end of a connection serves: request handlers keyed by struct type."""

    def __init__(self) -> None:
        self._handlers: dict[type, Handler] = {}
        self._decoder: msgspec.msgpack.Decoder[Any] | None = None
        self.on_close: Callable[[Connection], None] | None = None

    def register(self, typ: type, fn: Handler) -> None:
        self._handlers[typ] = fn
        self._decoder = None

    @property
    def decoder(self) -> msgspec.msgpack.Decoder[Any]:
        if self._decoder is None:
            types = tuple(self._handlers)
            if not types:
                self._decoder = msgspec.msgpack.Decoder(msgspec.Raw)
            elif len(types) == 1:
                self._decoder = msgspec.msgpack.Decoder(types[0])
            else:
                self._decoder = msgspec.msgpack.Decoder(Union[types])  # type: ignore[valid-type]  # noqa: UP007
        return self._decoder

    def handler_for(self, msg: Any) -> Handler | None:
        return self._handlers.get(type(msg))


class Connection(asyncio.Protocol):
    def __init__(self, service: Service | None = None) -> None:
        self.service = service or Service()
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._pending: dict[int, asyncio.Future[msgspec.Raw]] = {}
        self._ids = itertools.count(1)
        self._loop = asyncio.get_running_loop()
        self._closed = self._loop.create_future()
        self._tasks: set[asyncio.Task[None]] = set()
        self.peer_info: dict[str, Any] = {}
        # Frames written while a write of this loop pass already went out wait here and
        # leave together at the end of the pass (one syscall for many small frames).
        self._wbuf: list[bytes | bytearray] | None = None
        self._wrote = False

    # ---- asyncio.Protocol ----------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        if buf:
            buf += data
            src: bytes | bytearray = buf
        else:
            src = data  # nothing held back: frames are cut from the received bytes directly
        pos = 0
        n = len(src)
        while n - pos >= 4:
            (length,) = _LEN.unpack_from(src, pos)
            if length > MAX_FRAME:
                log.error("ipc frame too large (%d bytes); closing", length)
                self.close()
                return
            if n - pos - 4 < length:
                break
            frame = src[pos + 4 : pos + 4 + length]
            pos += 4 + length
            try:
                self._on_frame(bytes(frame) if src is buf else frame)
            except Exception:
                log.exception("ipc: bad frame; closing connection")
                self.close()
                return
        if src is buf:
            if pos:
                del buf[:pos]
        elif pos < n:
            buf += data[pos:]

    def connection_lost(self, exc: Exception | None) -> None:
        err = ConnectionLost("local peer process went away")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        if not self._closed.done():
            self._closed.set_result(None)
        for t in list(self._tasks):
            t.cancel()
        if self.service.on_close:
            self.service.on_close(self)

    # ---- frames -----------------------------------------------------------
    def _on_frame(self, frame: bytes) -> None:
        kind, rid, body = _frame_dec.decode(frame)
        if kind in (OK, ERR):
            fut = self._pending.pop(rid, None)
            if fut is None or fut.done():
                return
            if kind == OK:
                fut.set_result(body)
            else:
                status, message, code, extra = _err_dec.decode(body)
                fut.set_exception(error_for_status(status, message, code, extra or None))
            return
        try:
            msg = self.service.decoder.decode(body)
        except msgspec.DecodeError as e:
            if kind == REQ:
                self._send_error(rid, 400, f"undecodable request: {e}")
            return
        handler = self.service.handler_for(msg)
        if handler is None:
            if kind == REQ:
                self._send_error(rid, 400, f"unsupported request {type(msg).__name__}")
            return
        task = self._loop.create_task(self._serve(kind, rid, handler, msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, kind: int, rid: int, handler: Handler, msg: Any) -> None:
        try:
            result = await handler(msg, self)
        except NaradError as e:
            if kind == REQ:
                self._send_error(rid, e.status, e.message, e.code, e.extra)
            return
        except asyncio.CancelledError:
            if kind == REQ:
                self._send_error(rid, 503, "request cancelled")
            raise
        except Exception as e:
            log.exception("ipc handler %s failed", type(msg).__name__)
            if kind == REQ:
                self._send_error(rid, 500, f"internal error: {e}")
            return
        if kind == REQ:
            frame = _frame(OK, rid, result)
            if len(frame) - 4 > MAX_FRAME:
                log.error("ipc answer to %s too large (%d bytes); answered with an error", type(msg).__name__,
                          len(frame) - 4)
                self._send_error(rid, 500, f"answer of {len(frame) - 4} bytes is over the ipc frame limit")
                return
            self._write(frame)

    def _send_error(
        self, rid: int, status: int, message: str, code: str | None = None, extra: dict[str, Any] | None = None
    ) -> None:
        self._write(_frame(ERR, rid, (status, message, code, extra or {})))

    def _write(self, data: bytes | bytearray) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        if self._wbuf is not None:
            self._wbuf.append(data)
        elif self._wrote:
            self._wbuf = [data]
        else:
            # The first frame of this loop pass goes out at once; later ones are held
            # until the end of the pass and written together.
            t.write(data)
            self._wrote = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._wrote = False
        held, self._wbuf = self._wbuf, None
        if held:
            t = self.transport
            if t is not None and not t.is_closing():
                t.write(held[0] if len(held) == 1 else b"".join(held))
                self._wrote = True
                self._loop.call_soon(self._flush)

    # ---- calling the other end ------------------------------------------
    async def call(self, msg: Any, resp_type: type[T], timeout: float | None = 10.0) -> T:
        raw = await self.call_raw(msg, timeout)
        return msgspec.msgpack.decode(raw, type=resp_type)

    async def call_raw(self, msg: Any, timeout: float | None = 10.0) -> msgspec.Raw:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionLost("local peer process is not connected")
        rid = next(self._ids)
        frame = _frame(REQ, rid, msg)
        if len(frame) - 4 > MAX_FRAME:
            # The peer would close the link on it (and fail every call in flight there): this
            # call alone fails. Callers keep their requests far below it; this is the backstop.
            raise PayloadTooLarge(f"local call {type(msg).__name__} of {len(frame) - 4} bytes is over the "
                                f"{MAX_FRAME}-byte frame limit; not sent")
        fut: asyncio.Future[msgspec.Raw] = self._loop.create_future()
        self._pending[rid] = fut
        self._write(frame)
        timer = None
        if timeout is not None:
            timer = self._loop.call_later(timeout, _expire, fut, f"local call {type(msg).__name__} timed out "
                                                                 f"after {timeout:g}s")
        try:
            return await fut
        finally:
            if timer is not None:
                timer.cancel()
            self._pending.pop(rid, None)

    def notify(self, msg: Any) -> None:
        self._write(_frame(NOTE, 0, msg))

    @property
    def closed(self) -> bool:
        return self._closed.done()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    def close(self) -> None:
        if self.transport is not None:
            held, self._wbuf = self._wbuf, None
            if held and not self.transport.is_closing():
                self.transport.write(b"".join(held))  # close() still sends what was written before it
            self.transport.close()


def _expire(fut: asyncio.Future[msgspec.Raw], message: str) -> None:
    if not fut.done():
        fut.set_exception(GatewayTimeout(message))


async def serve_unix(path: str, service_factory: Callable[[], Service], mode: int = 0o600) -> asyncio.Server:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    loop = asyncio.get_running_loop()
    old = os.umask(0o177)
    try:
        server = await loop.create_unix_server(lambda: Connection(service_factory()), path)
    finally:
        os.umask(old)
    os.chmod(path, mode)
    return server


async def connect_unix(path: str, service: Service | None = None) -> Connection:
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_unix_connection(lambda: Connection(service), path)
    return proto


async def connect_fd(sock: Any, service: Service | None = None) -> Connection:
    """Wrap an already-connected socket (e.g. one end of a socketpair)."""
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_unix_connection(lambda: Connection(service), sock=sock)
    return proto
