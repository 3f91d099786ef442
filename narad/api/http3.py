"""HTTP/3 transport: serves the same ``App`` as the HTTP/1.1 transport, over QUIC (aioquic).

``Http3Server`` runs an aioquic ``QuicServer`` on a UDP socket handed in by the
caller (a SO_REUSEPORT socket the supervisor owns). Each QUIC connection is an
``_H3Protocol`` holding one ``H3Connection``, one ``_Stream`` per request stream
and one task per request being handled. The transport enforces the header-size,
body-size and read-time limits, answers an app crash with 500, and keeps a hostile
peer's damage to its own stream or connection. ``drain()`` sends GOAWAY, refuses
new connections and streams, lets in-flight requests finish and closes.

A client that goes away mid-request (resets the request stream, stops reading
the answer, or closes the connection) cancels the handler when it opted in
(``narad.api.hangup``: the long-poll consume), so a parked consume gives back
what it reserved at once; an answer that can no longer be sent is dropped
through ``Response.on_dropped`` (a consume nacks its leases). A reset of a
request side that already ended (a GET's, sent with FIN) is not seen: QUIC
discards it (aioquic drops RESET_STREAM on a finished receive side), so such a
request is cancelled by STOP_SENDING (what ``narad.client.h3`` sends with its
reset) or by closing the connection; otherwise its answer is still sent.

Imports narad.api.router, narad.api.hangup, narad.errors, the stdlib and aioquic only. It works on
its own dup of the caller's socket, so the caller's socket is never closed here.
A few aioquic internals are read (marked "aioquic internal"); they are guarded
so a future aioquic release degrades a feature instead of crashing the worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
from dataclasses import dataclass
from functools import partial
from typing import Any, cast
from urllib.parse import parse_qs, unquote

from aioquic.asyncio.protocol import QuicConnectionProtocol, QuicStreamHandler
from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer, encode_uint_var
from aioquic.h3.connection import (
    CONNECTION_SPECIFIC_HEADERS,
    H3_ALPN,
    ErrorCode,
    FrameType,
    H3Connection,
    encode_frame,
)
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE, QuicConfiguration
from aioquic.quic.connection import TRANSPORT_CLOSE_FRAME_CAPACITY, NetworkAddress, QuicConnection
from aioquic.quic.crypto import CryptoPair
from aioquic.quic.events import (
    ConnectionTerminated,
    ProtocolNegotiated,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)
from aioquic.quic.packet import QuicErrorCode, QuicFrameType, QuicPacketType, pull_quic_header
from aioquic.quic.packet_builder import QuicPacketBuilder

from narad.api.hangup import Hangup, enter
from narad.api.router import GENERAL_BODY_LIMIT, App, Request, Response
from narad.errors import BadRequest, InternalError, NaradError, PayloadTooLarge

log = logging.getLogger("narad.api.http3")

__all__ = ["Http3Limits", "Http3Server"]


@dataclass(frozen=True)
class Http3Limits:
    idle_timeout: float = 60.0  # also the write-stall deadline: an answer that makes no progress this long
    max_header_bytes: int = 65536  # RFC 9114 field section size: name + value + 32 per field
    read_timeout: float = 10.0  # a request stream must deliver its whole body within this
    max_connections: int = 0  # connections held at once, half-open ones included; 0 = unlimited (beyond: refused)


_SEND_CHECK = 1.0  # how often a connection with answers still being sent checks their progress


# request stream phases
_HEADERS = 0  # waiting for the HEADERS frame
_BODY = 1  # headers seen, collecting DATA
_HANDLING = 2  # request complete, the app is handling it
_DONE = 3  # answered or refused; whatever the peer still sends is ignored

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-z]+")
_SKIP_RESPONSE_HEADERS = frozenset(CONNECTION_SPECIFIC_HEADERS) | {b"content-length", b"content-type"}
_431 = Response(431, b"431 Request Header Fields Too Large", "text/plain; charset=utf-8")  # as narad.api.http1
_408 = Response(408, b"request timeout\n", "text/plain; charset=utf-8")


class _Stream:
    """One request stream's state."""

    __slots__ = ("chunks", "fin", "hang", "headers", "junk", "limit", "method", "over_status", "path", "phase",
                 "query", "sid", "size", "task", "timer")

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.phase = _HEADERS
        self.fin = False  # the peer finished (FIN) or reset its sending side
        self.method = ""
        self.path = ""
        self.query = ""
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.size = 0
        self.limit = GENERAL_BODY_LIMIT
        self.over_status = 413
        self.junk = 0  # bytes received after we stopped reading
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None
        self.hang: Hangup | None = None


def _header_value(value: str) -> bytes | None:
    try:
        raw = value.encode("latin-1")
    except UnicodeEncodeError:
        raw = value.encode("utf-8")
    raw = raw.strip(b" \t")
    if b"\r" in raw or b"\n" in raw or b"\0" in raw:
        return None
    return raw


def _peer_ip(addr: NetworkAddress | None) -> str:
    if not addr:
        return ""
    host = str(addr[0])
    return host[7:] if host.startswith("::ffff:") else host


class _H3Protocol(QuicConnectionProtocol):
    """One QUIC connection carrying HTTP/3 requests."""

    def __init__(
        self, quic: QuicConnection, stream_handler: QuicStreamHandler | None = None, *, server: Http3Server
    ) -> None:
        super().__init__(quic, stream_handler)
        self._srv = server
        self._h3: H3Connection | None = None
        self._streams: dict[int, _Stream] = {}
        self._addr: NetworkAddress | None = None
        self._max_sid = -4  # highest client request stream id seen
        self._goaway_id: int | None = None  # set while draining: streams at or above it are refused
        self._dead = False
        self._flush_pending = False
        # Answers handed to aioquic and not all sent yet: stream id -> [bytes sent, when that last moved].
        # A peer that grants no flow-control credit for idle_timeout is cut off (as HTTP/1 does with a
        # client that stops reading), else its answers would sit in memory for as long as it pings.
        self._sending: dict[int, list[float]] = {}
        self._send_timer: asyncio.TimerHandle | None = None
        server._conns.add(self)

    # -- input -------------------------------------------------------------------------------

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        self._addr = addr
        try:
            super().datagram_received(data, addr)
        except Exception:
            log.exception("http3: failed to process a datagram; closing the connection")
            self._abort(ErrorCode.H3_INTERNAL_ERROR, "internal error")

    def _handle_timer(self) -> None:
        try:
            super()._handle_timer()
        except Exception:
            log.exception("http3: connection timer failed; closing the connection")
            self._abort(ErrorCode.H3_INTERNAL_ERROR, "internal error")

    def quic_event_received(self, event: QuicEvent) -> None:
        try:
            self._on_quic_event(event)
        except Exception:
            log.exception("http3: failed to handle %s; closing the connection", type(event).__name__)
            self._abort(ErrorCode.H3_INTERNAL_ERROR, "internal error")

    def _on_quic_event(self, event: QuicEvent) -> None:
        h3 = self._h3
        if isinstance(event, StreamDataReceived):
            if h3 is None:
                return
            sid = event.stream_id
            st: _Stream | None = None
            if sid & 3 == 0:  # client-initiated bidirectional: a request stream
                st = self._streams.get(sid)
                if st is None:
                    st = self._open(sid)
                elif st.phase == _DONE:
                    st.junk += len(event.data)
                    if st.junk > self._srv._junk_limit:
                        log.warning("http3: peer %s keeps sending on a stopped stream; closing the connection",
                                    _peer_ip(self._addr))
                        self._abort(ErrorCode.H3_EXCESSIVE_LOAD, "stopped stream kept sending")
                        return
                if event.end_stream:
                    st.fin = True
            for ev in h3.handle_event(event):
                self._on_h3_event(ev)
            if st is not None and st.phase == _HEADERS and self._streams.get(sid) is st:
                self._check_pending_headers(st)
            if st is not None and st.fin and st.phase == _DONE:
                self._streams.pop(sid, None)
        elif isinstance(event, StreamReset):
            if h3 is not None:
                for ev in h3.handle_event(event):
                    self._on_h3_event(ev)
            st = self._streams.get(event.stream_id)
            if st is not None:
                st.fin = True
                if st.phase != _HANDLING:
                    self._forget(st)
                elif st.hang is not None:
                    st.hang.client_gone()  # the client cancelled the request (RFC 9114 4.1.2)
        elif isinstance(event, StopSendingReceived):
            if h3 is not None:
                h3.handle_event(event)
            st = self._streams.get(event.stream_id)
            if st is not None:  # the peer no longer wants the answer
                if st.hang is not None:
                    # An opted-in handler (a long poll) is cancelled; any other runs to its end
                    # (a produce, an ack, a redrive cut between its steps would leave duplicates)
                    # and its answer is dropped (phase _DONE: ``_run`` sends nothing).
                    st.hang.client_gone()
                if st.task is not None:
                    self._srv._detach(st.task)
                if st.timer is not None:
                    st.timer.cancel()
                    st.timer = None
                st.phase = _DONE
                if st.fin:
                    self._streams.pop(st.sid, None)
        elif isinstance(event, ProtocolNegotiated):
            if event.alpn_protocol in H3_ALPN:
                self._h3 = H3Connection(self._quic)
            else:
                self._quic.close(error_code=QuicErrorCode.PROTOCOL_VIOLATION, reason_phrase="h3 required")
        elif isinstance(event, ConnectionTerminated):
            self._teardown()
        elif h3 is not None:
            for ev in h3.handle_event(event):
                self._on_h3_event(ev)

    def _open(self, sid: int) -> _Stream:
        st = _Stream(sid)
        self._streams[sid] = st
        if sid > self._max_sid:
            self._max_sid = sid
        if self._goaway_id is not None and sid >= self._goaway_id:
            # draining: not processed, so the client may safely retry elsewhere
            self._reset(st, ErrorCode.H3_REQUEST_REJECTED)
        else:
            st.timer = self._loop.call_later(self._srv.limits.read_timeout, self._read_timeout, st)
        return st

    def _on_h3_event(self, ev: H3Event) -> None:
        if isinstance(ev, DataReceived):
            st = self._streams.get(ev.stream_id)
            if st is None or st.phase != _BODY:
                return
            data = ev.data
            if data:
                st.size += len(data)
                if st.size > st.limit:
                    self._too_large(st)
                    return
                st.chunks.append(data)
            if ev.stream_ended:
                self._dispatch(st)
        elif isinstance(ev, HeadersReceived):
            st = self._streams.get(ev.stream_id)
            if st is None:
                return
            if st.phase == _HEADERS:
                self._on_headers(st, ev.headers)
                if st.phase == _BODY and ev.stream_ended:
                    self._dispatch(st)
            elif st.phase == _BODY and ev.stream_ended:  # trailers end the request; their content is ignored
                self._dispatch(st)

    def _on_headers(self, st: _Stream, headers: list[tuple[bytes, bytes]]) -> None:
        size = 0
        method: bytes | None = None
        target: bytes | None = None
        hdrs: dict[str, str] = {}
        for k, v in headers:
            size += len(k) + len(v) + 32
            if k[:1] == b":":
                if k == b":method":
                    method = v
                elif k == b":path":
                    target = v
                continue
            name = k.decode("latin-1")
            val = v.decode("latin-1")
            old = hdrs.get(name)
            hdrs[name] = val if old is None else old + ", " + val
        if size > self._srv.limits.max_header_bytes:
            self._answer_early(st, _431)
            return
        if not method or not target:
            self._answer_early(st, self._srv._error(BadRequest("missing :method or :path")))
            return
        if target[:1] != b"/":  # origin form only (RFC 9114 4.3.1; no "*": there is no OPTIONS route)
            self._answer_early(st, self._srv._error(BadRequest(':path must start with "/"')))
            return
        raw_path, _, raw_query = target.partition(b"?")
        raw_query = raw_query.partition(b"#")[0]
        raw_path = raw_path.partition(b"#")[0]
        st.method = method.decode("latin-1")
        st.path = raw_path.decode("utf-8", "replace")  # still percent-encoded: the router decodes per segment
        st.query = raw_query.decode("utf-8", "replace")
        st.headers = hdrs
        st.limit, st.over_status = self._srv._body_limit(st.method, st.path)
        cl = hdrs.get("content-length")
        if cl is not None:
            try:
                declared = int(cl)
            except ValueError:  # aioquic validates it; a list of lengths is still possible
                declared = 0
            if declared > st.limit:
                self._too_large(st)
                return
        st.phase = _BODY

    def _check_pending_headers(self, st: _Stream) -> None:
        """Reject a HEADERS frame that announces more than the header limit before
        aioquic buffers all of it; drop a stream that ended without headers."""
        try:
            hs = self._h3._stream.get(st.sid) if self._h3 is not None else None  # aioquic internal
            if hs is None:
                if st.fin:
                    self._forget(st)
                return
            if hs.frame_type == FrameType.HEADERS and (hs.frame_size or 0) > self._srv.limits.max_header_bytes:
                self._answer_early(st, _431)
            elif st.fin and not hs.blocked:
                self._forget(st)  # aioquic already reset it: the request never had headers
        except AttributeError:
            return

    # -- handling ----------------------------------------------------------------------------

    def _dispatch(self, st: _Stream) -> None:
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None
        chunks = st.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        st.chunks = []
        # surrogateescape keeps non-UTF-8 bytes (binary keys) recoverable
        query = parse_qs(st.query, keep_blank_values=True, errors="surrogateescape") if st.query else {}
        req = Request(st.method, unquote(st.path), query, st.headers, body, client=_peer_ip(self._addr),
                      transport="h3", raw_path=st.path)
        st.phase = _HANDLING
        h = st.hang = Hangup()
        h.task = st.task = self._loop.create_task(self._run(st, req, h))

    async def _run(self, st: _Stream, req: Request, h: Hangup) -> None:
        enter(h)
        try:
            try:
                resp = await self._srv.app.handle(req)
            except Exception as e:
                log.exception("http3: handler raised", extra={"method": req.method, "path": req.path})
                resp = self._srv._error(InternalError(f"internal error: {type(e).__name__}"))
            sent = False
            if st.phase == _HANDLING and not (h.gone and h.armed):
                try:
                    sent = self._respond(st, resp)
                except Exception:  # not a usable Response: nothing was sent yet
                    log.exception("http3: could not encode the response", extra={"method": req.method})
                    self._respond(st, self._srv._error(InternalError()))
            if not sent and resp.on_dropped is not None:
                try:
                    resp.on_dropped()  # the client is gone: a consume gives its leases back now
                except Exception:
                    log.exception("http3: on_dropped hook failed")
        finally:
            st.hang = None
            st.task = None
            if st.phase == _HANDLING:
                st.phase = _DONE
            if st.fin and self._streams.get(st.sid) is st:
                del self._streams[st.sid]

    def _respond(self, st: _Stream, resp: Response) -> bool:
        """Hand the answer to aioquic; False if it cannot be sent (stream or connection gone)."""
        h3 = self._h3
        if self._dead or h3 is None:
            return False
        status = resp.status
        headers: list[tuple[bytes, bytes]] = [(b":status", str(status).encode())]
        no_body = st.method == "HEAD" or status == 204 or status == 304 or status < 200
        body = b"" if no_body else resp.body
        if not no_body:
            # HEAD answers carry no content-length: aioquic clients reject a length without DATA
            headers.append((b"content-length", str(len(body)).encode()))
        if resp.content_type is not None:
            ct = _header_value(resp.content_type)
            if ct is not None:
                headers.append((b"content-type", ct))
        for name, value in resp.headers:
            n = name.lower().encode("latin-1", "replace")
            v = _header_value(value)
            if v is None or n in _SKIP_RESPONSE_HEADERS or not _TOKEN.fullmatch(n):
                log.debug("http3: dropped response header %r", name)
                continue
            headers.append((n, v))
        try:
            h3.send_headers(st.sid, headers, end_stream=not body)
            if body:
                h3.send_data(st.sid, body, end_stream=True)
        except Exception as e:  # the stream was reset or stopped meanwhile
            log.debug("http3: could not send the response on stream %d: %s", st.sid, e)
            self._flush_soon()
            return False
        self._flush_soon()
        if body:
            self._sending[st.sid] = [-1.0, self._loop.time()]
            if self._send_timer is None:
                self._send_timer = self._loop.call_later(_SEND_CHECK, self._check_sends)
        return True

    def _check_sends(self) -> None:
        """Answers still being sent: one whose sent bytes have not moved for
        ``idle_timeout`` (the peer grants no flow-control credit) closes the connection.
        Reads aioquic internals (the stream's sender); without them, nothing is watched."""
        self._send_timer = None
        if self._dead:
            self._sending.clear()
            return
        now = self._loop.time()
        stall = self._srv.limits.idle_timeout
        try:
            streams = self._quic._streams  # aioquic internal
            for sid, mark in list(self._sending.items()):
                sender = getattr(streams.get(sid), "sender", None)
                if sender is None or sender.is_finished or sender._reset_error_code is not None \
                        or sender.highest_offset >= (sender._buffer_fin or 0):
                    del self._sending[sid]  # sent whole (the peer's acks are the idle timeout's), or gone
                elif sender.highest_offset != mark[0]:
                    mark[0], mark[1] = sender.highest_offset, now
                elif now - mark[1] >= stall:
                    log.warning("http3: peer %s took no answer bytes for %.0f s (no flow-control credit); "
                                "closing the connection", _peer_ip(self._addr), stall)
                    self._abort(ErrorCode.H3_EXCESSIVE_LOAD, "answers not read")
                    return
        except Exception:  # a future aioquic without these internals: degrade, never crash the worker
            log.debug("http3: could not check answer progress", exc_info=True)
            self._sending.clear()
            return
        if self._sending:
            self._send_timer = self._loop.call_later(_SEND_CHECK, self._check_sends)

    # -- early answers, refusals ------------------------------------------------------------

    def _too_large(self, st: _Stream) -> None:
        if st.over_status == 400:
            resp = self._srv._error(BadRequest("request body too large"))
        else:
            resp = self._srv._error(PayloadTooLarge())
        self._answer_early(st, resp)

    def _answer_early(self, st: _Stream, resp: Response) -> None:
        """Answer before the request is complete and stop reading it."""
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None
        st.chunks = []
        st.phase = _DONE
        self._respond(st, resp)
        if st.fin:
            self._streams.pop(st.sid, None)
        else:
            self._stop_reading(st, ErrorCode.H3_NO_ERROR)

    def _stop_reading(self, st: _Stream, code: int) -> None:
        try:
            self._quic.stop_stream(st.sid, code)
        except Exception as e:
            log.debug("http3: stop_stream(%d) failed: %s", st.sid, e)
        self._flush_soon()

    def _reset(self, st: _Stream, code: int) -> None:
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None
        st.phase = _DONE
        try:
            self._quic.reset_stream(st.sid, code)
        except Exception as e:
            log.debug("http3: reset_stream(%d) failed: %s", st.sid, e)
        if not st.fin:
            self._stop_reading(st, code)
        self._flush_soon()

    def _read_timeout(self, st: _Stream) -> None:
        st.timer = None
        if self._dead or self._streams.get(st.sid) is not st or st.phase > _BODY:
            return
        log.debug("http3: stream %d from %s did not finish its request in time", st.sid, _peer_ip(self._addr))
        try:
            self._answer_early(st, _408)
        except Exception:
            log.exception("http3: failed to time out stream %d", st.sid)

    def _forget(self, st: _Stream) -> None:
        """Drop a stream that will get no answer. Its sending side is reset (H3 request
        cancelled), else the stream would never complete and the client's stream limit
        would never get its slot back (a client that reset only its own side)."""
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None
        if st.phase != _DONE:
            try:
                self._quic.reset_stream(st.sid, ErrorCode.H3_REQUEST_CANCELLED)  # (no-op once finished)
                self._flush_soon()
            except Exception:  # an aioquic refusal must not take the connection's other streams down
                log.debug("http3: could not reset stream %d", st.sid, exc_info=True)
        st.phase = _DONE
        if self._streams.get(st.sid) is st:
            del self._streams[st.sid]

    # -- sending, closing ----------------------------------------------------------------------

    def _flush_soon(self) -> None:
        """Coalesce the datagrams of several answers finished in one loop pass."""
        if not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        if self._dead:
            return
        try:
            self.transmit()
        except Exception:
            log.exception("http3: transmit failed")

    def _abort(self, code: int, reason: str) -> None:
        try:
            self._quic.close(error_code=code, reason_phrase=reason)
            self.transmit()
        except Exception:
            log.exception("http3: failed to close a connection")
        self._teardown()

    def _teardown(self, cancel_all: bool = False) -> None:
        """The connection is gone (the peer closed it, or we did). Opted-in handlers
        (long polls) are cancelled; the others run to their end and their answers are
        dropped (``_run``: the connection is dead), as HTTP/1.1 does. ``cancel_all``
        (shutdown after the drain's grace): every handler is cancelled."""
        self._dead = True
        self._srv._conns.discard(self)
        self._sending.clear()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        streams = list(self._streams.values())
        self._streams.clear()
        for st in streams:
            if st.timer is not None:
                st.timer.cancel()
                st.timer = None
            if st.task is not None:
                if cancel_all:
                    st.task.cancel()
                else:
                    if st.hang is not None:
                        st.hang.client_gone()
                    self._srv._detach(st.task)
            st.phase = _DONE

    def _send_goaway(self) -> None:
        if self._dead:
            return
        self._goaway_id = self._max_sid + 4
        if self._h3 is None:
            return
        # aioquic internal: H3Connection has no GOAWAY call, so write the frame on its control stream
        ctrl = self._h3._local_control_stream_id
        if ctrl is None:
            return
        self._quic.send_stream_data(ctrl, encode_frame(FrameType.GOAWAY, encode_uint_var(self._goaway_id)))
        self.transmit()

    def _busy(self) -> bool:
        """An accepted request is unfinished, or an answer is not yet acknowledged."""
        if self._dead:
            return False
        if any(st.phase != _DONE for st in self._streams.values()):
            return True
        try:
            return any(sid & 3 == 0 and not s.sender.is_finished for sid, s in self._quic._streams.items())
        except AttributeError:  # aioquic internal changed: do not wait for acknowledgements
            return False

    def _shutdown(self) -> None:
        if not self._dead:
            try:
                self._quic.close(error_code=ErrorCode.H3_NO_ERROR, reason_phrase="server shutting down")
                self.transmit()
            except Exception:
                log.exception("http3: failed to close a connection")
        self._teardown(cancel_all=True)
        if self._timer is not None:  # the transport is about to close: nothing more to send
            self._timer.cancel()
            self._timer = None


def _refused_close(version: int, source_cid: bytes, destination_cid: bytes) -> bytes:
    """A server Initial packet closing a new connection with CONNECTION_REFUSED."""
    crypto = CryptoPair()
    crypto.setup_initial(cid=source_cid, is_client=False, version=version)
    builder = QuicPacketBuilder(
        host_cid=source_cid, is_client=False, max_datagram_size=SMALLEST_MAX_DATAGRAM_SIZE,
        peer_cid=destination_cid, version=version,
    )
    builder.start_packet(QuicPacketType.INITIAL, crypto)
    buf = builder.start_frame(QuicFrameType.TRANSPORT_CLOSE, capacity=TRANSPORT_CLOSE_FRAME_CAPACITY)
    buf.push_uint_var(QuicErrorCode.CONNECTION_REFUSED)
    buf.push_uint_var(QuicFrameType.PADDING)
    buf.push_uint_var(0)
    datagrams, _ = builder.flush()
    return datagrams[0]


class _QuicServer(QuicServer):
    """aioquic's QuicServer, refusing new connections while draining or at the
    connection cap, and never letting one bad datagram raise into the event loop."""

    def __init__(self, *, owner: Http3Server, **kw: Any) -> None:
        super().__init__(**kw)
        self._owner = owner

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        try:
            if (self._owner._draining or self._owner._full()) and self._refuse(cast(bytes, data), addr):
                return  # (a packet of a connection already held always passes)
            super().datagram_received(data, addr)
        except Exception:
            log.exception("http3: failed to process a datagram from %s", _peer_ip(addr))

    def _refuse(self, data: bytes, addr: NetworkAddress) -> bool:
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=self._configuration.connection_id_length)
        except ValueError:
            return True
        if header.destination_cid in self._protocols:
            return False
        if (header.packet_type == QuicPacketType.INITIAL and len(data) >= SMALLEST_MAX_DATAGRAM_SIZE
                and header.version in self._configuration.supported_versions and self._transport is not None):
            self._transport.sendto(_refused_close(header.version, header.destination_cid, header.source_cid), addr)
        return True


class Http3Server:
    """Serves ``app`` over HTTP/3 on an already bound UDP socket."""

    def __init__(self, app: App, sock: socket.socket, cert_file: str, key_file: str, limits: Http3Limits) -> None:
        self.app = app
        self.limits = limits
        self._sock = sock
        cfg = QuicConfiguration(
            is_client=False, alpn_protocols=H3_ALPN, idle_timeout=limits.idle_timeout, max_datagram_frame_size=None
        )
        cfg.load_cert_chain(cert_file, key_file)
        self._config = cfg
        # a peer ignoring STOP_SENDING may still have a flow-control window in flight; beyond that it is abuse
        self._junk_limit = 2 * cfg.max_stream_data + 65536
        self._conns: set[_H3Protocol] = set()
        # Handlers still running after their client went (not opted in to cancellation):
        # held here (the loop keeps only a weak reference to a task), waited for by a drain.
        self._detached: set[asyncio.Task[None]] = set()
        self._draining = False
        self._transport: asyncio.DatagramTransport | None = None

    @property
    def connections(self) -> int:
        return len(self._conns)

    def _full(self) -> bool:
        """At ``max_connections``: a new connection is refused (CONNECTION_REFUSED)."""
        cap = self.limits.max_connections
        return cap > 0 and len(self._conns) >= cap

    def _detach(self, task: asyncio.Task[None]) -> None:
        """Hold a handler's task whose stream no longer does, until it ends."""
        if not task.done():
            self._detached.add(task)
            task.add_done_callback(self._detached.discard)

    @property
    def active_requests(self) -> int:
        """Requests accepted and not yet answered (being read or handled)."""
        return sum(1 for c in self._conns for st in c._streams.values() if st.phase != _DONE)

    async def start(self) -> None:
        if self._transport is not None:
            raise RuntimeError("Http3Server already started")
        loop = asyncio.get_running_loop()
        sock = self._sock.dup()  # the transport closes its socket; the caller's must stay open
        sock.setblocking(False)

        def factory() -> QuicServer:
            proto = partial(_H3Protocol, server=self)
            return _QuicServer(owner=self, configuration=self._config, create_protocol=proto)

        try:
            transport, _ = await loop.create_datagram_endpoint(factory, sock=sock)
        except BaseException:
            sock.close()
            raise
        self._transport = transport

    async def drain(self, grace: float) -> None:
        """Send GOAWAY, refuse new connections and streams, let in-flight requests
        finish (up to ``grace`` seconds), then close every connection."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, grace)
        self._draining = True
        for conn in list(self._conns):
            try:
                conn._send_goaway()
            except Exception:
                log.exception("http3: failed to send GOAWAY")
        while loop.time() < deadline and (self._detached or any(c._busy() for c in list(self._conns))):
            await asyncio.sleep(0.01)
        left = self.active_requests + len(self._detached)
        if left:
            log.warning("http3: drain grace over, cancelling %d unfinished requests", left)
        for conn in list(self._conns):
            conn._shutdown()
        for task in list(self._detached):
            task.cancel()
        if self._transport is not None:
            self._transport.close()

    # -- app calls that must not raise into the transport ---------------------------------------

    def _body_limit(self, method: str, path: str) -> tuple[int, int]:
        try:
            return self.app.body_limit(method, path)
        except Exception:
            log.exception("http3: body_limit failed")
            return GENERAL_BODY_LIMIT, 413

    def _error(self, err: NaradError) -> Response:
        try:
            return self.app.error_response(err)
        except Exception:
            log.exception("http3: error_response failed")
            return Response(err.status, json.dumps({"error": err.message}).encode(), "application/json")
