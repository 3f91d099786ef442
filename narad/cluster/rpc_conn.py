"""What both ends of a node-RPC connection share: frame parsing on input, coalesced output
(every frame queued during one event-loop pass leaves in one ``transport.write``, so one TLS
write and one socket write), teardown, and small logging helpers.

Imports narad.cluster.rpc_frames and the stdlib.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import termios
from typing import Any

from narad.cluster.rpc_frames import HEADER, FrameReader, ProtocolError

log = logging.getLogger("narad.cluster.transport")

LOG_EVERY = 10.0  # seconds between two lines of one rate-limited kind and peer


def fmt_addr(addr: Any) -> str:
    if not addr:
        return "?"
    host = str(addr[0])
    if host.startswith("::ffff:"):
        host = host[7:]
    return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"


_TCP_INFO = getattr(socket, "TCP_INFO", None)
_BYTES_ACKED = struct.Struct("=Q")  # struct tcp_info's tcpi_bytes_acked, at offset 120 (Linux >= 4.1)
_OUTQ = getattr(termios, "TIOCOUTQ", None)  # SIOCOUTQ: bytes in the socket's send queue
BACKLOG = 64 << 10  # bytes queued ahead of a PING that can delay its PONG noticeably


def _send_state(transport: asyncio.BaseTransport | None) -> tuple[int, int]:
    """(our bytes the peer's TCP acknowledged so far, our bytes in the kernel's send queue);
    zeros where unknown. uvloop's TLS transport hands everything it encrypted to its TCP
    transport at once, so the TLS write buffer does not show a large frame draining; these do."""
    if _TCP_INFO is None or transport is None:
        return 0, 0
    try:
        sock = transport.get_extra_info("socket")
        if sock is None:
            return 0, 0
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 136)
        acked = _BYTES_ACKED.unpack_from(info, 120)[0] if len(info) >= 128 else 0
        queued = 0
        if _OUTQ is not None:
            queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
        return acked, queued
    except (OSError, ValueError, struct.error):
        return 0, 0


class RateLimitedLog:
    """At most one line per key per ``LOG_EVERY`` seconds."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def __call__(self, key: str, level: int, msg: str, *args: Any) -> None:
        now = asyncio.get_running_loop().time()
        last = self._last.get(key)
        if last is not None and now - last < LOG_EVERY:
            return
        if len(self._last) > 4096:
            self._last.clear()
        self._last[key] = now
        log.log(level, msg, *args)


class FrameConn(asyncio.BufferedProtocol):
    """A TLS connection carrying frames. Subclasses implement ``on_frame`` and ``teardown``."""

    role = "?"

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader(self._on_frame_guarded)
        self.dead = False
        self.peer: tuple[Any, ...] = ()
        self.last_rx = self._loop.time()
        self.rx_frames = 0
        self._out: list[bytes] = []
        self._flush_pending = False
        self.write_paused = False  # the transport's output is over its high-water mark
        self._tx_seen = 0  # write_buffered when last sampled (see tx_progress)
        self._acked_seen = 0  # the kernel's count of our bytes the peer acknowledged, then
        self._backlog_seen = 0  # our bytes still queued (ours, the TLS layer's and the kernel's), then
        self.last_tx_progress = self.last_rx

    # -- input -----------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self.dead:
            self.reader.hold(nbytes)
            return
        self.last_rx = self._loop.time()
        try:
            self.reader.updated(nbytes)
        except ProtocolError as e:
            self._protocol_error(e)

    def _protocol_error(self, e: ProtocolError) -> None:
        log.warning("cluster %s: %s sent %s; closing the connection", self.role, fmt_addr(self.peer), e)
        self.abort(f"protocol error: {e}")

    def _on_frame_guarded(self, kind: int, rid: int, body: bytes | None) -> None:
        if self.dead:
            return
        self.rx_frames += 1
        try:
            self.on_frame(kind, rid, body)
        except ProtocolError:
            raise
        except Exception:
            log.exception("cluster %s: failed to handle a frame from %s", self.role, fmt_addr(self.peer))

    def on_frame(self, kind: int, rid: int, body: bytes | None) -> None:
        raise NotImplementedError

    def eof_received(self) -> bool | None:
        return None  # close

    def connection_lost(self, exc: Exception | None) -> None:
        self.teardown(f"connection lost ({exc})" if exc else "connection closed by the peer")

    # -- output ----------------------------------------------------------------------------

    def send(self, kind: int, rid: int, body: bytes = b"") -> None:
        """Queue one frame; everything queued in this loop pass is written together."""
        out = self._out
        out.append(HEADER.pack(len(body), kind, rid))
        if body:
            out.append(body)
        if not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        t = self.transport
        if t is None or self.dead or not self._out:
            return
        out = self._out
        self._out = []
        try:
            t.write(out[0] if len(out) == 1 else b"".join(out))
        except Exception as e:  # closing under us
            log.debug("cluster %s: write to %s failed: %s", self.role, fmt_addr(self.peer), e)

    def pause_writing(self) -> None:
        self.write_paused = True
        self.on_write_pressure()

    def resume_writing(self) -> None:
        self.write_paused = False
        self.on_write_pressure()

    def on_write_pressure(self) -> None:
        """``write_paused`` changed (subclasses stop producing output while it is set)."""

    def tx_progress(self, now: float) -> None:
        """Sample the output queue: if it shrank since the last sample the peer is taking our
        bytes (it is alive even if a large frame of ours keeps its answers from coming back)."""
        wb = self.write_buffered
        acked, queued = _send_state(self.transport)
        backlog = max(wb, queued)
        # ACKs count only while a backlog is draining: a stopped process's kernel keeps ACKing
        # small writes until its receive buffer fills, which must not pass for liveness
        if wb < self._tx_seen or (acked > self._acked_seen and max(backlog, self._backlog_seen) >= BACKLOG):
            self.last_tx_progress = now
        self._tx_seen = wb
        self._acked_seen = acked
        self._backlog_seen = backlog

    @property
    def write_buffered(self) -> int:
        t = self.transport
        return (t.get_write_buffer_size() if t is not None else 0) + sum(len(b) for b in self._out)

    # -- ending ----------------------------------------------------------------------------

    def close(self, reason: str) -> None:
        """Flush what is queued, close the TLS session cleanly, forget the connection."""
        if self.transport is not None and not self.dead:
            self._flush()
            self.transport.close()
        self.teardown(reason)

    def abort(self, reason: str) -> None:
        """Drop the connection now (nothing queued is sent)."""
        t = self.transport
        self.teardown(reason)
        if t is not None:
            t.abort()

    def teardown(self, reason: str) -> None:
        raise NotImplementedError
