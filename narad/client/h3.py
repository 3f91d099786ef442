"""An async HTTP/3 client over aioquic: many concurrent requests on one QUIC connection.

``H3Client.connect()`` opens one connection; ``request()`` opens one stream per
request, so any number of requests may run concurrently (beyond the server's
stream limit aioquic queues them). Used by narad's tests and load tests.

It keeps aioquic's ``connect()`` context manager for its whole life: when that
object is garbage-collected the connection closes. Imports the stdlib and aioquic only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from contextlib import AbstractAsyncContextManager
from typing import Any

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol, QuicStreamHandler
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamReset

__all__ = ["H3Client", "H3StreamError"]


class H3StreamError(ConnectionError):
    """The server reset the request stream (e.g. H3_REQUEST_REJECTED while draining)."""

    def __init__(self, stream_id: int, error_code: int) -> None:
        super().__init__(f"stream {stream_id} reset by the server (error code {error_code:#x})")
        self.stream_id = stream_id
        self.error_code = error_code


def _enc(value: str) -> bytes:
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8")


class _Pending:
    __slots__ = ("chunks", "future", "headers", "status")

    def __init__(self, future: asyncio.Future[tuple[int, dict[str, str], bytes]]) -> None:
        self.future = future
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []


class _ClientProtocol(QuicConnectionProtocol):
    def __init__(self, quic: QuicConnection, stream_handler: QuicStreamHandler | None = None) -> None:
        super().__init__(quic, stream_handler)
        self.h3 = H3Connection(quic)
        self.pending: dict[int, _Pending] = {}
        self.error: ConnectionError | None = None
        self._flush_pending = False

    def flush_soon(self) -> None:
        """Send the streams opened in this loop pass together."""
        if not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        if self.error is None:
            self.transmit()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            self.error = ConnectionError(
                f"connection closed (error code {event.error_code:#x}: {event.reason_phrase or 'no reason'})"
            )
            pending, self.pending = self.pending, {}
            for p in pending.values():
                if not p.future.done():
                    p.future.set_exception(self.error)
            return
        for ev in self.h3.handle_event(event):
            if isinstance(ev, HeadersReceived):
                p = self.pending.get(ev.stream_id)
                if p is None:
                    continue
                if p.status is None:
                    hdrs: dict[str, str] = {}
                    status = 0
                    for k, v in ev.headers:
                        if k == b":status":
                            status = int(v)
                        elif k[:1] != b":":
                            name = k.decode("latin-1")
                            old = hdrs.get(name)
                            val = v.decode("latin-1")
                            hdrs[name] = val if old is None else old + ", " + val
                    if status >= 200:  # 1xx answers are interim
                        p.status = status
                        p.headers = hdrs
                if ev.stream_ended:
                    self._finish(ev.stream_id)
            elif isinstance(ev, DataReceived):
                p = self.pending.get(ev.stream_id)
                if p is None:
                    continue
                if ev.data:
                    p.chunks.append(ev.data)
                if ev.stream_ended:
                    self._finish(ev.stream_id)
        if isinstance(event, StreamReset):
            p = self.pending.pop(event.stream_id, None)
            if p is not None and not p.future.done():
                p.future.set_exception(H3StreamError(event.stream_id, event.error_code))

    def _finish(self, sid: int) -> None:
        p = self.pending.pop(sid, None)
        if p is None or p.future.done():
            return
        if p.status is None:
            p.future.set_exception(ConnectionError(f"stream {sid} ended without a response"))
        else:
            p.future.set_result((p.status, p.headers, b"".join(p.chunks)))


class H3Client:
    """One HTTP/3 connection; ``request()`` may be called concurrently."""

    def __init__(self, cm: AbstractAsyncContextManager[Any], proto: _ClientProtocol, authority: bytes) -> None:
        self._cm: AbstractAsyncContextManager[Any] | None = cm  # keeps the connection alive
        self._proto = proto
        self._authority = authority

    @classmethod
    async def connect(
        cls, host: str, port: int, *, verify: bool | str = False, server_name: str | None = None,
        timeout: float = 5.0
    ) -> H3Client:
        """``verify``: False accepts any certificate (a node's self-signed one), True checks it
        against the default CAs, a path checks it against the CA certificates in that PEM file."""
        cfg = QuicConfiguration(
            is_client=True,
            alpn_protocols=H3_ALPN,
            server_name=server_name or host,
            verify_mode=ssl.CERT_REQUIRED if verify else ssl.CERT_NONE,
        )
        if isinstance(verify, str):
            cfg.load_verify_locations(cafile=verify)
        cm = connect(host, port, configuration=cfg, create_protocol=_ClientProtocol, wait_connected=True)
        proto = await asyncio.wait_for(cm.__aenter__(), timeout)
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return cls(cm, proto, authority.encode())

    @property
    def closed(self) -> bool:
        return self._cm is None or self._proto.error is not None

    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        timeout: float = 10.0,
    ) -> tuple[int, dict[str, str], bytes]:
        """Send one request on a new stream; returns (status, headers, body).
        Raises TimeoutError, H3StreamError (stream reset) or ConnectionError."""
        proto = self._proto
        if self._cm is None:
            raise ConnectionError("client closed")
        if proto.error is not None:
            raise proto.error
        hdrs = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", self._authority),
            (b":path", path.encode()),
        ]
        has_length = False
        if headers:
            for k, v in headers.items():
                name = k.lower()
                has_length = has_length or name == "content-length"
                hdrs.append((name.encode(), _enc(v)))
        if body and not has_length:
            hdrs.append((b"content-length", str(len(body)).encode()))
        sid = proto._quic.get_next_available_stream_id()
        fut: asyncio.Future[tuple[int, dict[str, str], bytes]] = asyncio.get_running_loop().create_future()
        proto.pending[sid] = _Pending(fut)
        try:
            proto.h3.send_headers(sid, hdrs, end_stream=not body)
            if body:
                proto.h3.send_data(sid, body, end_stream=True)
        except Exception:
            proto.pending.pop(sid, None)
            # aioquic's HTTP/3 layer may have marked the stream used (a header QPACK refused):
            # the stream id is spent here (reset) so the next request takes a fresh one.
            with contextlib.suppress(Exception):
                proto._quic.reset_stream(sid, ErrorCode.H3_REQUEST_CANCELLED)
                proto.flush_soon()
            raise
        proto.flush_soon()
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except (TimeoutError, asyncio.CancelledError):
            if proto.pending.pop(sid, None) is not None and proto.error is None:
                try:  # abandon the stream both ways
                    proto._quic.reset_stream(sid, ErrorCode.H3_REQUEST_CANCELLED)
                    proto._quic.stop_stream(sid, ErrorCode.H3_REQUEST_CANCELLED)
                except Exception:
                    pass
                proto.flush_soon()
            raise

    async def close(self) -> None:
        cm, self._cm = self._cm, None
        if cm is None:
            return
        try:
            await asyncio.wait_for(cm.__aexit__(None, None, None), 2.0)
        except Exception:
            # the close handshake did not finish in time: drop the socket anyway
            transport = self._proto._transport
            if transport is not None:
                transport.close()
