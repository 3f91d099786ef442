"""Node-to-node RPC over QUIC: ``NodeRpcServer`` (one per node, on the cluster UDP port)
and ``NodeRpcClient`` (one shared client per node process).

Protocol (ALPN ``narad-cluster-quic-v2``, raw QUIC streams, no HTTP/3):

* One QUIC connection per (client process, peer address), reused and multiplexed.
* Each request is one new client-initiated bidirectional stream; the stream id is the
  request id, and is also written into the frame for logs.
* Client -> server: ``proof_c`` (32 bytes) + one frame, then FIN.
  Server -> client: ``proof_s`` (32 bytes) + one frame, then FIN (a note gets a bare FIN).
* Frame: ``u32 big-endian length`` + msgpack ``[kind, id, body]`` exactly as narad.ipc.rpc:
  kinds REQ / OK / ERR / NOTE; the body of REQ and NOTE is a tagged ``msgspec.Struct``,
  of OK the handler's returned struct, of ERR ``[status, message, code, extra]`` (re-raised
  on the caller with ``narad.errors.error_for_status``). A frame over ``MAX_FRAME`` (16 MiB)
  is refused: the stream is reset, nothing beyond the cap is buffered.
* Handlers are the ones of a ``narad.ipc.rpc.Service``; they are called as
  ``handler(msg, peer)`` where ``peer`` is a ``NodePeer`` (the peer's UDP address and a
  free ``peer_info`` dict), not an ipc ``Connection``.
* Stream error codes (RESET_STREAM / STOP_SENDING): see ``E_*`` below.

Authentication: the cluster secret is bound to the TLS session with the RFC 8446 exporter.
Both ends derive ``EKM = TLS-Exporter("narad-cluster-auth-v1", b"", 32)``; the client's stream
starts with ``proof_c = HMAC-SHA256(secret, b"client" + EKM)``, the server's answer with
``proof_s = HMAC-SHA256(secret, b"server" + EKM)``. The server reads at most 36 bytes (proof and
frame length; the cap is 64) of a stream before it has checked the proof, runs no handler and
buffers nothing for a stream that fails, and resets it. The client checks ``proof_s`` before it
decodes a reply. A proof relayed from another session fails: its EKM differs. The TLS
certificate is an ephemeral self-signed ECDSA P-256 one made once per process and never
verified: trust comes from the proof alone. There is no session resumption and no 0-RTT.

The exporter and aioquic (1.x, checked at import and at construction; fail closed):
aioquic does not implement RFC 8446 section 7.5 exporters. We compute it from aioquic's own key
schedule. ``exporter_master_secret = Derive-Secret(master_secret, "exp master", transcript hash
through server Finished)`` is derivable exactly when aioquic derives the application traffic
secrets: ``tls.Context._setup_traffic_protection(..., Epoch.ONE_RTT, b"s ap traffic")`` runs with
``key_schedule.secret`` equal to the master secret and ``key_schedule.hash`` covering
ClientHello..server Finished, on the server (in ``_server_handle_hello``) and on the client (in
``_client_handle_finished``) alike. Later the transcript grows (client Finished), so it cannot
be recomputed afterwards. ``_hook_exporter`` therefore wraps, on each of our own
``QuicConnection`` instances only (never the class, so HTTP/3 is untouched):
``QuicConnection._initialize`` (which creates ``self.tls``) and then that ``tls.Context``
instance's ``_setup_traffic_protection``; after the original runs with label
``b"s ap traffic"`` the wrapper derives the exporter master secret, computes
``TLS-Exporter(label, ctx, L) = HKDF-Expand-Label(Derive-Secret(exporter_master, label, ""),
"exporter", Hash(ctx), L)`` with aioquic's ``hkdf_expand_label`` and keeps only the EKM.
A connection whose handshake completes without an EKM is closed (no request is ever sent or
served unauthenticated). tests/test_cluster_transport.py checks the result against OpenSSL's
``SSL_export_keying_material`` (``openssl s_server -keymatexport``) for SHA-256 and SHA-384 suites.

Other aioquic internals used (each guarded, marked "aioquic internal"): the flow-control and
stream-count limits (1024 concurrent request streams; after the first valid proof on a connection
its window is raised to 64 MiB, and each stream's window to the frame it announced once its own
proof checked out, so an unauthenticated peer only ever gets aioquic's 1 MiB defaults), the
close state (a peer's CONNECTION_CLOSE fails calls at once instead of after the draining period),
the peer connection id (stateless reset detection) and the send buffers (graceful close waits
until answers are acknowledged). Transmits are batched once per event-loop pass.

Liveness: the server answers a short-header packet for a connection id it does not know (a
restarted or crashed-and-restarted node) with a stateless reset whose token is
HMAC(secret-derived key, connection id); the client recognises it and fails the connection at
once instead of waiting for timeouts. A call that times out triggers one PING on its connection
(at most one at a time, at most one per second); no acknowledgement within 1 s and nothing else
received meanwhile closes the connection so the next call redials. QUIC's idle timeout (30 s,
the smaller of both ends') ignores open streams, so the client PINGs a quiet connection while
calls wait on it, and redials instead of reusing a connection that has been quiet for nearly
the idle timeout (the peer may have dropped it already).

Imports narad.errors, narad.ipc.rpc (``Service``, frame kinds and ``encode_frame``), the
stdlib, aioquic, cryptography and msgspec. Works on its own dup of the caller's socket.
Logger ``narad.cluster.transport``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import hmac
import inspect
import itertools
import logging
import os
import socket
import ssl
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar, Union, cast

import aioquic
import msgspec
from aioquic import tls
from aioquic.asyncio.protocol import QuicConnectionProtocol, QuicStreamHandler
from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import NetworkAddress, QuicConnection
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    PingAcknowledged,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)
from aioquic.quic.packet import QuicErrorCode, pull_quic_header
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from narad import metrics
from narad.errors import (
    BadGateway,
    GatewayTimeout,
    NaradError,
    PayloadTooLarge,
    Unavailable,
    error_for_status,
)
from narad.ipc.rpc import ERR, NOTE, OK, REQ, Service, encode_frame

log = logging.getLogger("narad.cluster.transport")

__all__ = ["ALPN", "EKM_LABEL", "MAX_FRAME", "NodePeer", "NodeRpcClient", "NodeRpcServer", "tls_exporter"]

ALPN = "narad-cluster-quic-v2"
EKM_LABEL = b"narad-cluster-auth-v1"
EKM_LEN = 32
PROOF_LEN = 32
MAX_FRAME = 16 << 20  # msgpack payload bytes of one frame (after the u32 length)

# application error codes on RESET_STREAM / STOP_SENDING
E_CANCELLED = 0x101  # the caller gave up (timeout or cancellation)
E_AUTH = 0x102  # the stream's proof was wrong
E_TOO_LARGE = 0x103  # a frame over MAX_FRAME
E_PROTOCOL = 0x104  # malformed stream (truncated, trailing bytes, bad frame)
E_REFUSED = 0x105  # the server is shutting down: the request was not processed

_CONN_WINDOW = 64 << 20  # connection flow-control window once the peer proved the secret
_MAX_STREAMS = 1024  # concurrent request streams a client may open

_DIAL_BACKOFF_MIN = 0.25
_DIAL_BACKOFF_MAX = 2.0
_PROBE_TIMEOUT = 1.0
_PROBE_INTERVAL = 1.0
_LOG_EVERY = 10.0  # seconds between two "rejected" log lines per peer

_LEN = struct.Struct(">I")
_enc = msgspec.msgpack.Encoder()
_frame_dec = msgspec.msgpack.Decoder(tuple[int, int, msgspec.Raw])
_err_dec = msgspec.msgpack.Decoder(tuple[int, str, Union[str, None], dict[str, Any]])  # noqa: UP007
T = TypeVar("T")

# phases of a stream being read (both ends)
_PROOF = 0  # reading the 32-byte proof
_LENGTH = 1  # reading the 4-byte frame length
_BODY = 2  # reading the frame
_HANDLING = 3  # server: the handler runs
_DONE = 4  # answered, refused or abandoned: whatever still arrives is ignored


# -- TLS exporter (see the module docstring) ------------------------------------------------------


def tls_exporter(
    algorithm: hashes.HashAlgorithm, exporter_master: bytes, label: bytes, context: bytes, length: int
) -> bytes:
    """RFC 8446 section 7.5: HKDF-Expand-Label(Derive-Secret(exporter_master, label, ""),
    "exporter", Hash(context), length)."""
    empty = hashes.Hash(algorithm)
    ctx_hash = hashes.Hash(algorithm)
    ctx_hash.update(context)
    secret = tls.hkdf_expand_label(algorithm, exporter_master, label, empty.finalize(), algorithm.digest_size)
    return tls.hkdf_expand_label(algorithm, secret, b"exporter", ctx_hash.finalize(), length)


def _exporter_hook_problem() -> str | None:
    """None when the installed aioquic has what ``_hook_exporter`` wraps, else why not."""
    version = str(getattr(aioquic, "__version__", "?"))
    if version.split(".")[0] != "1":
        return f"aioquic {version} is not a 1.x release"
    for owner, name, params in (
        (QuicConnection, "_initialize", ["self", "peer_cid"]),
        (tls.Context, "_setup_traffic_protection", ["self", "direction", "epoch", "label"]),
        (tls.KeySchedule, "derive_secret", ["self", "label"]),
    ):
        fn = getattr(owner, name, None)
        if not callable(fn):
            return f"aioquic {version}: {owner.__name__}.{name} is missing"
        try:
            got = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return f"aioquic {version}: cannot inspect {owner.__name__}.{name}"
        if got != params:
            return f"aioquic {version}: {owner.__name__}.{name}{tuple(got)} changed"
    if not callable(getattr(tls, "hkdf_expand_label", None)):
        return f"aioquic {version}: tls.hkdf_expand_label is missing"
    return None


_HOOK_PROBLEM = _exporter_hook_problem()


def _require_exporter() -> None:
    if _HOOK_PROBLEM is not None:
        raise RuntimeError(f"cluster transport cannot derive TLS exporter keys: {_HOOK_PROBLEM}")


def _hook_exporter(quic: QuicConnection, sink: Callable[[bytes], None]) -> None:
    """Capture the EKM of ``quic``'s handshake and hand it to ``sink`` (aioquic internal)."""
    initialize = quic._initialize

    def hooked_initialize(peer_cid: bytes) -> None:
        initialize(peer_cid)
        ctx = quic.tls
        setup = ctx._setup_traffic_protection

        def hooked_setup(direction: tls.Direction, epoch: tls.Epoch, label: bytes) -> None:
            setup(direction, epoch, label)
            if label == b"s ap traffic" and epoch == tls.Epoch.ONE_RTT:
                ks = ctx.key_schedule
                if ks is not None:
                    exporter_master = ks.derive_secret(b"exp master")
                    sink(tls_exporter(ks.algorithm, exporter_master, EKM_LABEL, b"", EKM_LEN))

        ctx._setup_traffic_protection = hooked_setup  # type: ignore[method-assign]

    quic._initialize = hooked_initialize  # type: ignore[method-assign]


def _proof(secret: bytes, role: bytes, ekm: bytes) -> bytes:
    return hmac.new(secret, role + ekm, hashlib.sha256).digest()


def _reset_key(secret: bytes) -> bytes:
    return hmac.new(secret, b"narad-cluster-stateless-reset-v1", hashlib.sha256).digest()


def _reset_token(key: bytes, cid: bytes) -> bytes:
    return hmac.new(key, cid, hashlib.sha256).digest()[:16]


_identity: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None


def _node_identity() -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The ephemeral self-signed ECDSA P-256 certificate of this process (made once, never
    renewed; dates and issuer are never checked by the peer)."""
    global _identity
    if _identity is None:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "narad-node")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC))  # RFC 5280: none
            .sign(key, hashes.SHA256())
        )
        _identity = (cert, key)
    return _identity


def _grant(quic: QuicConnection, sid: int, need: int, first: bool) -> None:
    """Open the receive windows once a stream's peer proved the secret and announced a frame:
    the stream's to ``need`` bytes (the whole stream) if it is smaller and, the first time, the
    connection's to ``_CONN_WINDOW``. aioquic announces a raised window with MAX_STREAM_DATA /
    MAX_DATA on the next transmit because the value then differs from the one it last sent
    (aioquic internal; without it the windows still double as data flows, which is slower).
    Small frames fit the initial window: no extra frame is sent for them."""
    try:
        if first and quic._local_max_data.value < _CONN_WINDOW:
            quic._local_max_data.value = _CONN_WINDOW
        stream = quic._streams.get(sid)
        if stream is not None and stream.max_stream_data_local < need:
            stream.max_stream_data_local = need
    except AttributeError:
        log.debug("aioquic internals changed: flow-control windows not raised")


def _set_stream_limits(quic: QuicConnection, bidi: int, uni: int) -> None:
    """How many streams the peer may open (aioquic internal; before the handshake)."""
    try:
        quic._local_max_streams_bidi.value = quic._local_max_streams_bidi.sent = bidi
        quic._local_max_streams_uni.value = quic._local_max_streams_uni.sent = uni
    except AttributeError:
        log.debug("aioquic internals changed: stream limits left at their defaults")


def _quic_state(quic: QuicConnection) -> str:
    """aioquic internals for diagnostics (best effort)."""
    try:
        streams = []
        for sid, st in list(quic._streams.items())[:12]:
            snd, rcv = st.sender, st.receiver
            streams.append(f"{sid}(snd fin={snd.is_finished} pending={snd.buffer_is_empty is False} "
                           f"rcv fin={rcv.is_finished} hi={rcv.highest_offset})")
        return (f"state={quic._state.name} streams={len(quic._streams)} "
                f"max_data local={quic._local_max_data.value} remote={quic._remote_max_data} "
                f"used={quic._remote_max_data_used} [{' '.join(streams)}]")
    except Exception as e:
        return f"? ({e})"


def _fmt_addr(addr: Any) -> str:
    if not addr:
        return "?"
    host = str(addr[0])
    if host.startswith("::ffff:"):
        host = host[7:]
    return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"


class _RateLimitedLog:
    """At most one line per key per ``_LOG_EVERY`` seconds."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def __call__(self, key: str, level: int, msg: str, *args: Any) -> None:
        now = asyncio.get_running_loop().time()
        last = self._last.get(key)
        if last is not None and now - last < _LOG_EVERY:
            return
        if len(self._last) > 4096:
            self._last.clear()
        self._last[key] = now
        log.log(level, msg, *args)


class _ReadState:
    """One stream being read: proof, frame length, frame."""

    __slots__ = ("chunks", "fin", "head", "length", "phase", "sid", "size")

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.phase = _PROOF
        self.head = b""  # proof, then length prefix, while incomplete (never more than 32 bytes)
        self.length = 0
        self.chunks: list[bytes] = []
        self.size = 0
        self.fin = False


class _Base(QuicConnectionProtocol):
    """What both ends share: the EKM, batched transmits, guarded event paths."""

    role = "?"

    def __init__(self, quic: QuicConnection, stream_handler: QuicStreamHandler | None = None) -> None:
        super().__init__(quic, stream_handler)
        self.ekm: bytes | None = None
        self.dead = False
        self._authed = False  # the peer proved the secret on some stream
        self._flush_pending = False
        self._addr: NetworkAddress | None = None
        _hook_exporter(quic, self._set_ekm)

    def _set_ekm(self, ekm: bytes) -> None:
        self.ekm = ekm

    # -- guarded input ---------------------------------------------------------------------

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        # as QuicConnectionProtocol.datagram_received, but the transmit is deferred to the end
        # of the loop pass: the datagrams read in one pass, the answers of handlers finished in
        # it and the ACKs then leave together (about a third fewer packets and transmits)
        self._addr = addr
        try:
            self._quic.receive_datagram(cast(bytes, data), addr, now=self._loop.time())
            self._process_events()
        except Exception:
            log.exception("cluster %s: failed to process a datagram from %s; closing", self.role, _fmt_addr(addr))
            self._abort(QuicErrorCode.INTERNAL_ERROR, "internal error")
        self._check_closing()
        self._flush_soon()

    def _handle_timer(self) -> None:
        try:
            super()._handle_timer()
        except Exception:
            log.exception("cluster %s: connection timer failed; closing", self.role)
            self._abort(QuicErrorCode.INTERNAL_ERROR, "internal error")
        self._check_closing()

    def _check_closing(self) -> None:
        """aioquic reports ConnectionTerminated only after the 3 PTO draining period; the
        peer's CONNECTION_CLOSE (or our own close) ends our use of the connection at once
        (aioquic internal)."""
        if not self.dead:
            ev = getattr(self._quic, "_close_event", None)
            if ev is not None:
                self._teardown(getattr(ev, "reason_phrase", "") or "connection closed")

    def quic_event_received(self, event: QuicEvent) -> None:
        try:
            self._on_event(event)
        except Exception:
            log.exception("cluster %s: failed to handle %s; closing", self.role, type(event).__name__)
            self._abort(QuicErrorCode.INTERNAL_ERROR, "internal error")

    def _on_event(self, event: QuicEvent) -> None:
        raise NotImplementedError

    # -- output ----------------------------------------------------------------------------

    def transmit(self) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        super().transmit()

    def _flush_soon(self) -> None:
        """Coalesce the datagrams of everything sent in one loop pass."""
        if not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        if self.dead:
            return
        try:
            self.transmit()
        except Exception:
            log.exception("cluster %s: transmit failed", self.role)

    def _stop(self, sid: int, code: int) -> None:
        """Reset our sending side and ask the peer to stop sending."""
        try:
            self._quic.reset_stream(sid, code)
        except Exception as e:  # already finished or gone
            log.debug("cluster %s: reset_stream(%d): %s", self.role, sid, e)
        try:
            self._quic.stop_stream(sid, code)
        except Exception as e:
            log.debug("cluster %s: stop_stream(%d): %s", self.role, sid, e)
        self._flush_soon()

    def _abort(self, code: int, reason: str) -> None:
        if self.dead:
            return
        try:
            self._quic.close(error_code=code, reason_phrase=reason)
            self.transmit()
        except Exception:
            log.exception("cluster %s: failed to close a connection", self.role)
        self._teardown(reason)

    def _shutdown(self, reason: str) -> None:
        """Send CONNECTION_CLOSE now and forget the connection (no draining period)."""
        if not self.dead:
            try:
                self._quic.close(error_code=QuicErrorCode.NO_ERROR, reason_phrase=reason)
                self.transmit()
            except Exception:
                log.exception("cluster %s: failed to close a connection", self.role)
        self._teardown(reason)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _teardown(self, reason: str) -> None:
        raise NotImplementedError

    def _read(self, st: _ReadState, data: bytes, expected_proof: bytes | None) -> bytes | None:
        """Feed stream data; returns the complete frame once it is, raises _StreamError."""
        pos = 0
        n = len(data)
        if st.phase == _PROOF:
            take = min(PROOF_LEN - len(st.head), n)
            st.head += data[:take]
            pos = take
            if len(st.head) < PROOF_LEN:
                return None
            if expected_proof is None or not hmac.compare_digest(st.head, expected_proof):
                raise _StreamError(E_AUTH)
            st.head = b""
            st.phase = _LENGTH
            if not self._authed:
                self._authed = True
                _grant(self._quic, st.sid, 0, True)
        if st.phase == _LENGTH:
            take = min(4 - len(st.head), n - pos)
            st.head += data[pos : pos + take]
            pos += take
            if len(st.head) < 4:
                return None
            (st.length,) = _LEN.unpack(st.head)
            st.head = b""
            if st.length > MAX_FRAME:
                raise _StreamError(E_TOO_LARGE)
            st.phase = _BODY
            _grant(self._quic, st.sid, PROOF_LEN + 4 + st.length, False)
        if st.phase == _BODY:
            if pos < n:
                chunk = data[pos:] if pos else data
                st.size += len(chunk)
                if st.size > st.length:
                    raise _StreamError(E_PROTOCOL)
                st.chunks.append(chunk)
            if st.size == st.length:
                chunks = st.chunks
                st.chunks = []
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return None



class _StreamError(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


# -- server -----------------------------------------------------------------------------------------


@dataclass
class NodePeer:
    """What a cluster handler learns about the calling node."""

    addr: tuple[Any, ...]
    peer_info: dict[str, Any] = field(default_factory=dict)


class _SStream(_ReadState):
    __slots__ = ("junk", "task")

    def __init__(self, sid: int) -> None:
        super().__init__(sid)
        self.task: asyncio.Task[None] | None = None
        self.junk = 0


class _ServerConn(_Base):
    """One inbound connection from a peer node."""

    role = "server"

    def __init__(
        self, quic: QuicConnection, stream_handler: QuicStreamHandler | None = None, *, server: NodeRpcServer
    ) -> None:
        super().__init__(quic, stream_handler)
        self._srv = server
        self._streams: dict[int, _SStream] = {}
        self._proof_c: bytes | None = None
        self._proof_s = b""
        self._peer: NodePeer | None = None
        _set_stream_limits(quic, _MAX_STREAMS, 0)
        server._conns.add(self)

    def _set_ekm(self, ekm: bytes) -> None:
        self.ekm = ekm
        self._proof_c = _proof(self._srv._verify_secret, b"client", ekm)
        self._proof_s = _proof(self._srv._proof_secret, b"server", ekm)

    def _on_event(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            self._teardown(event.reason_phrase or f"error {event.error_code}")
        elif self.dead:
            return
        elif isinstance(event, StreamDataReceived):
            self._on_data(event.stream_id, event.data, event.end_stream)
        elif isinstance(event, (StreamReset, StopSendingReceived)):
            st = self._streams.get(event.stream_id)
            if st is not None:
                if st.task is not None:  # the caller gave up: stop working for it
                    st.task.cancel()
                    st.task = None
                st.phase = _DONE
                if isinstance(event, StreamReset) or st.fin:
                    del self._streams[st.sid]
        elif isinstance(event, HandshakeCompleted):
            if self.ekm is None or event.alpn_protocol != ALPN:
                log.error("cluster server: handshake from %s without %s; closing",
                          _fmt_addr(self._addr), "exporter keys" if self.ekm is None else "our ALPN")
                self._abort(QuicErrorCode.PROTOCOL_VIOLATION, "narad cluster protocol required")
            else:
                self._srv.handshakes += 1

    def _on_data(self, sid: int, data: bytes, end: bool) -> None:
        if sid & 3 != 0:  # only client-initiated bidirectional streams carry requests
            return
        st = self._streams.get(sid)
        if st is None:
            # entries are dropped only once the peer's side ended (FIN or reset), after which
            # aioquic delivers nothing more: an unknown id is a new stream
            st = _SStream(sid)
            self._streams[sid] = st
            if self._srv._closing or self.ekm is None:
                st.phase = _DONE
                self._stop(sid, E_REFUSED)
        if end:
            st.fin = True
        if st.phase >= _HANDLING:
            if data:
                st.junk += len(data)
                if st.junk > 2 * MAX_FRAME:
                    log.warning("cluster server: %s keeps sending on a finished stream; closing the connection",
                                _fmt_addr(self._addr))
                    self._abort(QuicErrorCode.PROTOCOL_VIOLATION, "stream kept sending")
                    return
            if st.fin and st.phase == _DONE and st.task is None:
                self._streams.pop(sid, None)
            return
        try:
            frame = self._read(st, data, self._proof_c)
            if frame is None and end:
                raise _StreamError(E_PROTOCOL)  # truncated
        except _StreamError as e:
            self._refuse(st, e.code)
            return
        if frame is not None:
            if not end:  # the frame must be the last thing on the stream: see what follows
                st.phase = _HANDLING
            self._dispatch(st, frame)

    def _refuse(self, st: _SStream, code: int) -> None:
        st.phase = _DONE
        st.chunks = []
        if code == E_AUTH:
            peer = _fmt_addr(self._addr)
            self._srv._log(f"auth:{peer.rpartition(':')[0]}", logging.WARNING,
                           "cluster stream rejected: invalid auth (peer %s)", peer)
        elif code == E_TOO_LARGE:
            log.warning("cluster server: %s sent a frame of %d bytes (limit %d); stream refused",
                        _fmt_addr(self._addr), st.length, MAX_FRAME)
        else:
            log.warning("cluster server: malformed request stream from %s; reset", _fmt_addr(self._addr))
        self._stop(st.sid, code)
        if st.fin:
            self._streams.pop(st.sid, None)

    def _dispatch(self, st: _SStream, frame: bytes) -> None:
        srv = self._srv
        try:
            kind, rid, body = _frame_dec.decode(frame)
        except msgspec.DecodeError:
            self._refuse(st, E_PROTOCOL)
            return
        if kind not in (REQ, NOTE):
            self._refuse(st, E_PROTOCOL)
            return
        try:
            msg = srv.service.decoder.decode(body)
        except msgspec.DecodeError as e:
            self._answer_error(st, kind, rid, 400, _undecodable(body, e))
            return
        handler = srv.service.handler_for(msg)
        if handler is None:
            self._answer_error(st, kind, rid, 400, f"unsupported rpc operation {type(msg).__name__}")
            return
        metrics.get().node_rpc_served.labels(type(msg).__name__).inc()
        if self._peer is None:
            self._peer = NodePeer(addr=tuple(self._addr or ()))
        if kind == NOTE:
            self._finish(st, None)
            srv._spawn(self._run_note(handler, msg, self._peer))
            return
        st.phase = _HANDLING
        st.task = self._loop.create_task(self._run(st, rid, handler, msg, self._peer))
        srv._track(st.task)

    async def _run(self, st: _SStream, rid: int, handler: Any, msg: Any, peer: NodePeer) -> None:
        try:
            result = await handler(msg, peer)
            body = _enc.encode(result)
            if len(body) + 16 > MAX_FRAME:
                out = _encode_error(rid, 500, f"reply of {len(body)} bytes exceeds the {MAX_FRAME} byte limit")
            else:
                out = encode_frame(OK, rid, body)
        except NaradError as e:
            out = _encode_error(rid, e.status, e.message, e.code, e.extra)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # the stream is gone: nothing to answer
            # Something the handler awaited was cancelled, not this request: it must
            # still be answered, or the caller waits out its whole deadline.
            log.error("cluster handler %s: an operation it waited on was cancelled (peer %s, request %d)",
                      type(msg).__name__, _fmt_addr(peer.addr), rid)
            out = _encode_error(rid, 503, "the operation was cancelled on the serving node; retry")
        except Exception as e:
            log.exception("cluster handler %s failed (peer %s, request %d)", type(msg).__name__,
                          _fmt_addr(peer.addr), rid)
            out = _encode_error(rid, 500, f"internal error: {type(e).__name__}: {e}")
        finally:
            st.task = None
        if st.phase == _HANDLING and not self.dead:
            self._finish(st, out)

    async def _run_note(self, handler: Any, msg: Any, peer: NodePeer) -> None:
        try:
            await handler(msg, peer)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("cluster note handler %s failed (peer %s)", type(msg).__name__, _fmt_addr(peer.addr))

    def _answer_error(self, st: _SStream, kind: int, rid: int, status: int, message: str) -> None:
        log.warning("cluster server: %s from %s (request %d)", message, _fmt_addr(self._addr), rid)
        self._finish(st, _encode_error(rid, status, message, None, None) if kind == REQ else None)

    def _finish(self, st: _SStream, out: bytes | None) -> None:
        """Answer (proof + frame + FIN; a bare FIN for a note) and forget the stream."""
        st.phase = _DONE
        try:
            if out is None:
                self._quic.send_stream_data(st.sid, b"", end_stream=True)
            else:
                self._quic.send_stream_data(st.sid, self._proof_s)
                self._quic.send_stream_data(st.sid, out, end_stream=True)
        except Exception as e:  # reset or stopped meanwhile
            log.debug("cluster server: could not answer on stream %d: %s", st.sid, e)
        if st.fin:
            self._streams.pop(st.sid, None)
        self._flush_soon()

    def _teardown(self, reason: str) -> None:
        if self.dead:
            return
        self.dead = True
        self._srv._conns.discard(self)
        streams = list(self._streams.values())
        self._streams.clear()
        for st in streams:
            if st.task is not None:
                st.task.cancel()
                st.task = None
            st.phase = _DONE

    def busy(self) -> bool:
        """A request is being handled, or an answer is not yet acknowledged (aioquic internal)."""
        if self.dead:
            return False
        if any(st.task is not None for st in self._streams.values()):
            return True
        try:
            return any(sid & 3 == 0 and not s.sender.is_finished for sid, s in self._quic._streams.items())
        except AttributeError:
            return False


def _undecodable(body: msgspec.Raw, err: msgspec.DecodeError) -> str:
    """An unknown struct tag is an operation this node does not serve (callers may downgrade);
    anything else is a malformed request."""
    if "`$.type`" in str(err):
        try:
            tag = msgspec.msgpack.decode(body).get("type")
        except Exception:
            tag = None
        if isinstance(tag, str):
            return f"unsupported rpc operation {tag[:64]}"
    return f"undecodable request: {err}"


def _encode_error(
    rid: int, status: int, message: str, code: str | None = None, extra: dict[str, Any] | None = None
) -> bytes:
    try:
        body = _enc.encode((status, message, code, extra or {}))
    except Exception:  # extra not encodable
        body = _enc.encode((status, message, code, {}))
    return encode_frame(ERR, rid, body)


class _NodeQuicServer(QuicServer):
    """aioquic's QuicServer plus: stateless resets for unknown connections, no new connections
    while closing, and no datagram ever raising into the event loop."""

    def __init__(self, *, owner: NodeRpcServer, **kw: Any) -> None:
        super().__init__(**kw)
        self._owner = owner
        self._cid_len = self._configuration.connection_id_length
        self._reset_budget = 0.0
        self._reset_at = 0.0

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        try:
            data = cast(bytes, data)
            if not data:
                return
            if not data[0] & 0x80:  # short header: an established connection
                if data[1 : 1 + self._cid_len] not in self._protocols:
                    self._stateless_reset(data, addr)
                    return
            elif self._owner._closing:  # no new connections while closing; known ones go on
                try:
                    header = pull_quic_header(Buffer(data=data), host_cid_length=self._cid_len)
                except ValueError:
                    return
                if header.destination_cid not in self._protocols:
                    return
            super().datagram_received(data, addr)
        except Exception:
            log.exception("cluster server: failed to process a datagram from %s", _fmt_addr(addr))

    def _stateless_reset(self, data: bytes, addr: NetworkAddress) -> None:
        """RFC 9000 10.3: tell a peer whose connection we do not know that it is gone.
        Always smaller than what triggered it; at most ~100 per second."""
        if len(data) <= 21 + self._cid_len or self._transport is None:
            return
        now = self._loop.time()
        self._reset_budget = min(100.0, self._reset_budget + (now - self._reset_at) * 100.0)
        self._reset_at = now
        if self._reset_budget < 1.0:
            return
        self._reset_budget -= 1.0
        size = min(len(data) - 1, 43)
        pad = os.urandom(size - 16)
        token = _reset_token(self._owner._reset_key, data[1 : 1 + self._cid_len])
        self._transport.sendto(bytes([0x40 | (pad[0] & 0x3F)]) + pad[1:] + token, addr)


class NodeRpcServer:
    """Serves a ``Service`` to peer nodes over QUIC on an already bound UDP socket (owned by the
    caller: we work on a dup of it)."""

    def __init__(self, sock: socket.socket, secret: bytes, service: Service, *, idle_timeout: float = 30.0) -> None:
        _require_exporter()
        if not secret:
            raise ValueError("the cluster secret must not be empty")
        self.service = service
        self._sock = sock
        self._verify_secret = bytes(secret)
        self._proof_secret = bytes(secret)  # tests replace it to play a server with the wrong secret
        self._reset_key = _reset_key(bytes(secret))
        cert, key = _node_identity()
        cfg = QuicConfiguration(is_client=False, alpn_protocols=[ALPN], idle_timeout=idle_timeout,
                                max_datagram_frame_size=None)
        cfg.certificate = cert
        cfg.private_key = key
        self._config = cfg
        self._conns: set[_ServerConn] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle: asyncio.Event | None = None
        self._closing = False
        self._transport: asyncio.DatagramTransport | None = None
        self._log = _RateLimitedLog()
        self.handshakes = 0  # connections that completed a handshake (for tests and metrics)

    @property
    def connections(self) -> int:
        return len(self._conns)

    @property
    def address(self) -> tuple[Any, ...]:
        return tuple(self._sock.getsockname())

    def peer_ekms(self) -> list[bytes]:
        """Test and diagnostics hook: the EKM of every live connection."""
        return [c.ekm for c in self._conns if c.ekm is not None]

    def describe(self) -> str:
        """Diagnostics: every inbound connection and its request streams."""
        lines = [f"node rpc server {_fmt_addr(self.address)}: {len(self._conns)} connections, "
                 f"{len(self._tasks)} handlers running, closing={self._closing}"]
        for c in list(self._conns):
            streams = ", ".join(f"{sid}:phase{st.phase}{'+task' if st.task else ''}{'+fin' if st.fin else ''}"
                                for sid, st in list(c._streams.items())[:20])
            lines.append(f"  from {_fmt_addr(c._addr)} dead={c.dead} authed={c._authed} streams=[{streams}] "
                         f"quic={_quic_state(c._quic)}")
        return "\n".join(lines)

    async def start(self) -> None:
        if self._transport is not None:
            raise RuntimeError("NodeRpcServer already started")
        loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        sock = self._sock.dup()  # the transport closes its socket; the caller's must stay open
        sock.setblocking(False)

        def factory() -> QuicServer:
            return _NodeQuicServer(owner=self, configuration=self._config,
                                   create_protocol=partial(_ServerConn, server=self))

        try:
            transport, _ = await loop.create_datagram_endpoint(factory, sock=sock)
        except BaseException:
            sock.close()
            raise
        self._transport = transport

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        if self._idle is not None:
            self._idle.clear()
        task.add_done_callback(self._untrack)

    def _untrack(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not self._tasks and self._idle is not None:
            self._idle.set()

    def _spawn(self, coro: Any) -> None:
        self._track(asyncio.get_running_loop().create_task(coro))

    async def close(self, grace: float = 1.0) -> None:
        """Refuse new connections and streams, let running handlers finish and their answers be
        acknowledged (up to ``grace`` seconds), then close every connection and the socket."""
        if self._closing:
            return
        self._closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, grace)
        if self._tasks and self._idle is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - loop.time()))
        while loop.time() < deadline and any(c.busy() for c in list(self._conns)):
            await asyncio.sleep(0.005)  # answers in flight: aioquic has no "acknowledged" event for them
        if self._tasks:
            log.warning("cluster server: close grace over, cancelling %d running handlers", len(self._tasks))
            for t in list(self._tasks):
                t.cancel()
        for conn in list(self._conns):
            conn._shutdown("node shutting down")
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


# -- client -----------------------------------------------------------------------------------------


class _Call(_ReadState):
    __slots__ = ("fut",)

    def __init__(self, sid: int, fut: asyncio.Future[msgspec.Raw]) -> None:
        super().__init__(sid)
        self.fut = fut


class _ClientConn(_Base):
    """Our connection to one peer node."""

    role = "client"

    def __init__(self, quic: QuicConnection, *, client: NodeRpcClient, addr: tuple[str, int]) -> None:
        super().__init__(quic)
        self._client = client
        self.peer_addr = addr
        self.name = f"node {_fmt_addr(addr)}"
        self.ready: asyncio.Future[None] = self._loop.create_future()
        self.calls: dict[int, _Call] = {}
        self.proof_c = b""
        self._proof_s: bytes | None = None
        self._reset_tokens: dict[bytes, bytes] = {}
        self._rx = 0  # datagrams received (liveness probe)
        self._last_rx = self._loop.time()
        self._probe: tuple[int, int] | None = None  # (ping uid, rx count when sent)
        self._probe_at = -_PROBE_INTERVAL
        self._idle = client._config.idle_timeout
        self._keepalive: asyncio.TimerHandle | None = None
        _set_stream_limits(quic, 0, 0)

    def _set_ekm(self, ekm: bytes) -> None:
        self.ekm = ekm
        self.proof_c = _proof(self._client._secret, b"client", ekm)
        self._proof_s = _proof(self._client._secret, b"server", ekm)

    @property
    def usable(self) -> bool:
        return not self.dead and self.ready.done() and not self.ready.cancelled() and self.ready.exception() is None

    @property
    def stale(self) -> bool:
        """Quiet for so long that the peer may drop it any moment (its idle timeout): a new call
        would risk landing on a connection the peer already forgot, so we redial instead."""
        return not self.calls and self._loop.time() - self._last_rx > self._idle - max(1.0, 0.1 * self._idle)

    def _on_ready(self) -> None:
        remote = getattr(self._quic, "_remote_max_idle_timeout", None)  # aioquic internal
        if remote:
            self._idle = min(self._idle, remote)
        self._keepalive = self._loop.call_later(self._idle / 3, self._keep_alive)
        self.ready.set_result(None)

    def _keep_alive(self) -> None:
        """QUIC's idle timeout ignores open streams: PING while calls wait on a quiet connection
        (long polls), so it does not expire under them."""
        self._keepalive = None
        if self.dead:
            return
        if self.calls and self._loop.time() - self._last_rx >= self._idle / 3:
            try:
                self._quic.send_ping(next(_probe_ids))
                self._flush_soon()
            except Exception:
                log.exception("cluster client: failed to send a keep-alive PING")
        self._keepalive = self._loop.call_later(self._idle / 3, self._keep_alive)

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        if self.dead:
            return
        self._rx += 1
        self._last_rx = self._loop.time()
        data = cast(bytes, data)  # a stateless reset never decrypts: aioquic would just drop it
        if len(data) >= 21 and data[0] & 0xC0 == 0x40 and self._is_stateless_reset(data):
            log.warning("cluster client: %s forgot our connection (restarted?); dropping it", self.name)
            self._teardown("the peer reset the connection (node restarted?)")
            return
        super().datagram_received(data, addr)

    def _is_stateless_reset(self, data: bytes) -> bool:
        try:
            cid = self._quic._peer_cid.cid  # aioquic internal: the connection id we send to
        except AttributeError:
            return False
        token = self._reset_tokens.get(cid)
        if token is None:
            if len(self._reset_tokens) > 16:
                self._reset_tokens.clear()
            token = self._reset_tokens[cid] = _reset_token(self._client._reset_key, cid)
        return hmac.compare_digest(data[-16:], token)

    def _on_event(self, event: QuicEvent) -> None:
        if isinstance(event, StreamDataReceived):
            call = self.calls.get(event.stream_id)
            if call is not None:
                self._on_reply_data(call, event.data, event.end_stream)
        elif isinstance(event, (StreamReset, StopSendingReceived)):
            call = self.calls.pop(event.stream_id, None)
            if call is not None and not call.fut.done():
                call.fut.set_exception(self._reset_error(event.error_code))
                if isinstance(event, StopSendingReceived):
                    self._stop(call.sid, E_CANCELLED)
        elif isinstance(event, PingAcknowledged):
            if self._probe is not None and self._probe[0] == event.uid:
                self._probe = None
        elif isinstance(event, HandshakeCompleted):
            if self.ready.done():
                return
            if self.ekm is None:
                log.error("cluster client: no TLS exporter keys for %s; closing", self.name)
                self._abort(QuicErrorCode.INTERNAL_ERROR, "no exporter keys")
            elif event.alpn_protocol != ALPN:
                self._abort(QuicErrorCode.PROTOCOL_VIOLATION, f"{ALPN} required")
            else:
                self._on_ready()
        elif isinstance(event, ConnectionTerminated):
            self._teardown(event.reason_phrase or f"closed with error {event.error_code}")

    def _on_reply_data(self, call: _Call, data: bytes, end: bool) -> None:
        try:
            frame = self._read(call, data, self._proof_s)
            if frame is None:
                if end:
                    raise _StreamError(E_PROTOCOL)
                return
            kind, _rid, body = _frame_dec.decode(frame)
            if kind == OK:
                result: msgspec.Raw | NaradError = body
            elif kind == ERR:
                status, message, code, extra = _err_dec.decode(body)
                result = error_for_status(status, message, code, extra or None)
            else:
                raise _StreamError(E_PROTOCOL)
        except (_StreamError, msgspec.DecodeError) as e:
            code = e.code if isinstance(e, _StreamError) else E_PROTOCOL
            del self.calls[call.sid]
            call.phase = _DONE
            if code == E_AUTH:
                self._client._log(f"auth:{self.name}", logging.WARNING,
                                  "cluster reply rejected: invalid auth from %s", self.name)
                err: NaradError = BadGateway(f"{self.name} failed cluster authentication (cluster secret mismatch?)",
                                             code="cluster_auth")
            elif code == E_TOO_LARGE:
                err = BadGateway(f"{self.name} sent a reply over the {MAX_FRAME} byte frame limit")
            else:
                err = BadGateway(f"{self.name} sent a malformed reply")
            if not call.fut.done():
                call.fut.set_exception(err)
            if not end:
                self._stop(call.sid, code)
            return
        del self.calls[call.sid]
        call.phase = _DONE
        if not end:  # nothing may follow the reply frame; stop reading
            self._stop(call.sid, E_CANCELLED)
        if not call.fut.done():
            if isinstance(result, NaradError):
                call.fut.set_exception(result)
            else:
                call.fut.set_result(result)

    def _reset_error(self, code: int) -> NaradError:
        if code == E_AUTH:
            self._client._log(f"auth:{self.name}", logging.WARNING,
                              "cluster request rejected by %s: invalid auth (cluster secret mismatch?)", self.name)
            return BadGateway(f"{self.name} rejected our cluster authentication (cluster secret mismatch?)",
                              code="cluster_auth")
        if code == E_TOO_LARGE:
            return PayloadTooLarge(f"{self.name} refused a frame over the {MAX_FRAME} byte limit")
        if code == E_REFUSED:
            return Unavailable(f"{self.name} is shutting down; request not processed", code="refused")
        return BadGateway(f"{self.name} reset the request (code {code:#x})")

    # -- calls -----------------------------------------------------------------------------------

    def send(self, kind: int, body: bytes, call: _Call | None) -> int:
        """Open a stream and send proof + frame + FIN; the stream id is the request id."""
        sid = self._quic.get_next_available_stream_id()
        frame = encode_frame(kind, sid, body)
        if call is not None:
            call.sid = sid
            self.calls[sid] = call
        self._quic.send_stream_data(sid, self.proof_c)
        self._quic.send_stream_data(sid, frame, end_stream=True)
        self._flush_soon()
        return sid

    def cancel(self, sid: int) -> None:
        call = self.calls.pop(sid, None)
        if call is not None:
            call.phase = _DONE
        if not self.dead:
            self._stop(sid, E_CANCELLED)

    def probe(self) -> None:
        """After a timeout: PING the peer; no acknowledgement within 1 s and nothing else
        received meanwhile means the peer is gone."""
        now = self._loop.time()
        if self.dead or self._probe is not None or now - self._probe_at < _PROBE_INTERVAL:
            return
        uid = next(_probe_ids)
        self._probe = (uid, self._rx)
        self._probe_at = now
        try:
            self._quic.send_ping(uid)
        except Exception:
            log.exception("cluster client: failed to send a PING")
            self._probe = None
            return
        self._flush_soon()
        self._loop.call_later(_PROBE_TIMEOUT, self._probe_expired, uid)

    def _probe_expired(self, uid: int) -> None:
        if self.dead or self._probe is None or self._probe[0] != uid:
            return
        rx = self._probe[1]
        self._probe = None
        if self._rx == rx:
            log.warning("cluster client: %s did not answer a PING within %gs; dropping the connection",
                        self.name, _PROBE_TIMEOUT)
            self._abort(QuicErrorCode.NO_ERROR, "liveness probe unanswered")

    def _teardown(self, reason: str) -> None:
        if self.dead:
            return
        self.dead = True
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(reason))
            self.ready.exception()  # retrieved: the dialer reports it
        calls = list(self.calls.values())
        self.calls.clear()
        for call in calls:
            if not call.fut.done():
                call.fut.set_exception(BadGateway(f"no answer from {self.name}: connection lost ({reason})"))
        self._client._forget(self)
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transport is not None:
            self._transport.close()


_probe_ids = itertools.count(1)


@dataclass
class _PeerState:
    conn: _ClientConn | None = None
    dialing: asyncio.Task[_ClientConn] | None = None
    backoff: float = _DIAL_BACKOFF_MIN
    retry_at: float = 0.0
    last_error: str = ""


class NodeRpcClient:
    """Calls peer nodes: one multiplexed QUIC connection per peer address, dialled on demand."""

    def __init__(self, secret: bytes, *, dial_timeout: float = 1.0, idle_timeout: float = 30.0) -> None:
        _require_exporter()
        if not secret:
            raise ValueError("the cluster secret must not be empty")
        self._secret = bytes(secret)
        self._reset_key = _reset_key(self._secret)
        self._dial_timeout = dial_timeout
        self._config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], idle_timeout=idle_timeout,
                                         verify_mode=ssl.CERT_NONE, max_datagram_frame_size=None)
        self._peers: dict[tuple[str, int], _PeerState] = {}
        self._notes: set[asyncio.Task[None]] = set()
        self._closed = False
        self._log = _RateLimitedLog()
        self.dials = 0  # connections established (for tests and metrics)

    @property
    def connections(self) -> int:
        return sum(1 for p in self._peers.values() if p.conn is not None and not p.conn.dead)

    def describe(self) -> str:
        """Diagnostics: every peer connection and the calls waiting on it."""
        lines = [f"node rpc client: {len(self._peers)} peers"]
        for addr, p in list(self._peers.items()):
            c = p.conn
            if c is None:
                lines.append(f"  to {_fmt_addr(addr)}: no connection dialing={p.dialing is not None} "
                             f"last_error={p.last_error!r}")
                continue
            now = c._loop.time()
            calls = ", ".join(f"{sid}" for sid in list(c.calls)[:20])
            lines.append(f"  to {_fmt_addr(addr)}: dead={c.dead} usable={c.usable} quiet={now - c._last_rx:.1f}s "
                         f"rx={c._rx} calls=[{calls}] quic={_quic_state(c._quic)}")
        return "\n".join(lines)

    def connection_ekm(self, addr: tuple[str, int]) -> bytes | None:
        """Test and diagnostics hook: the EKM of our live connection to ``addr``."""
        p = self._peers.get(addr)
        return p.conn.ekm if p is not None and p.conn is not None and not p.conn.dead else None

    async def call(self, addr: tuple[str, int], msg: msgspec.Struct, resp_type: type[T], timeout: float = 5.0) -> T:
        raw = await self.call_raw(addr, msg, timeout)
        try:
            return msgspec.msgpack.decode(raw, type=resp_type)
        except msgspec.DecodeError as e:
            raise BadGateway(f"node {_fmt_addr(addr)} sent an undecodable {resp_type.__name__}: {e}") from None

    async def call_raw(self, addr: tuple[str, int], msg: msgspec.Struct, timeout: float = 5.0) -> msgspec.Raw:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        body = _enc.encode(msg)
        if len(body) + 16 > MAX_FRAME:
            raise PayloadTooLarge(f"cluster request {type(msg).__name__} of {len(body)} bytes exceeds the "
                                  f"{MAX_FRAME} byte frame limit")
        conn = await self._connection(addr, deadline, msg)
        metrics.get().node_rpc_calls.labels(type(msg).__name__).inc()
        fut: asyncio.Future[msgspec.Raw] = loop.create_future()
        call = _Call(0, fut)
        try:
            sid = conn.send(REQ, body, call)
        except Exception as e:  # the connection died under us
            raise BadGateway(f"no answer from node {_fmt_addr(addr)}: {e}") from None
        timer = loop.call_at(deadline, _expire, fut)
        try:
            return await fut
        except _Timeout:
            conn.cancel(sid)
            conn.probe()
            raise GatewayTimeout(f"no answer from node {_fmt_addr(addr)} within {timeout:g}s "
                                 f"({type(msg).__name__})") from None
        except asyncio.CancelledError:
            conn.cancel(sid)
            raise
        finally:
            timer.cancel()
            conn.calls.pop(sid, None)

    def notify(self, addr: tuple[str, int], msg: msgspec.Struct) -> None:
        """Send a one-way message (authenticated like a call). Fire and forget: failures are
        logged, never raised; no ordering between notes."""
        if self._closed:
            return
        try:
            body = _enc.encode(msg)
        except Exception:
            log.exception("cluster note %s is not encodable", type(msg).__name__)
            return
        if len(body) + 16 > MAX_FRAME:
            log.error("cluster note %s of %d bytes exceeds the frame limit; dropped", type(msg).__name__, len(body))
            return
        metrics.get().node_rpc_calls.labels(type(msg).__name__).inc()
        p = self._peers.get(addr)
        if p is not None and p.conn is not None and p.conn.usable and not p.conn.stale:
            try:
                p.conn.send(NOTE, body, None)
                return
            except Exception as e:
                log.debug("cluster note to %s: %s", _fmt_addr(addr), e)
        task = asyncio.get_running_loop().create_task(self._send_note(addr, body, type(msg).__name__))
        self._notes.add(task)
        task.add_done_callback(self._notes.discard)

    async def _send_note(self, addr: tuple[str, int], body: bytes, name: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn = await self._connection(addr, loop.time() + self._dial_timeout + 0.5, None)
            conn.send(NOTE, body, None)
        except NaradError as e:
            self._log(f"note:{addr}", logging.WARNING, "cluster note %s to %s dropped: %s", name,
                      _fmt_addr(addr), e.message)
        except Exception as e:
            self._log(f"note:{addr}", logging.WARNING, "cluster note %s to %s dropped: %s", name, _fmt_addr(addr), e)

    async def close(self) -> None:
        self._closed = True
        for t in list(self._notes):
            t.cancel()
        peers = list(self._peers.values())
        for p in peers:
            if p.dialing is not None:
                p.dialing.cancel()
            if p.conn is not None:
                p.conn._shutdown("node client closing")
        self._peers.clear()
        pending = [t for t in self._notes] + [p.dialing for p in peers if p.dialing is not None]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    # -- connections ---------------------------------------------------------------------------

    async def _connection(self, addr: tuple[str, int], deadline: float, msg: msgspec.Struct | None) -> _ClientConn:
        if self._closed:
            raise Unavailable("the cluster client is closed")
        p = self._peers.get(addr)
        if p is None:
            p = self._peers[addr] = _PeerState()
        conn = p.conn
        if conn is not None and conn.usable:
            if not conn.stale:
                return conn
            conn._shutdown("idle")
        loop = asyncio.get_running_loop()
        now = loop.time()
        if p.dialing is None:
            if now < p.retry_at:
                raise Unavailable(f"node {_fmt_addr(addr)} unreachable ({p.last_error}; next dial in "
                                  f"{p.retry_at - now:.2f}s)", code="node_unreachable")
            p.dialing = loop.create_task(self._dial(addr, p))
            p.dialing.add_done_callback(_retrieve)
        try:
            return await asyncio.wait_for(asyncio.shield(p.dialing), max(0.0, deadline - now))
        except TimeoutError:
            what = type(msg).__name__ if msg is not None else "note"
            raise GatewayTimeout(f"no answer from node {_fmt_addr(addr)}: call deadline passed while "
                                 f"connecting ({what})") from None

    async def _dial(self, addr: tuple[str, int], p: _PeerState) -> _ClientConn:
        loop = asyncio.get_running_loop()
        conn: _ClientConn | None = None
        try:
            async with asyncio.timeout(self._dial_timeout):
                infos = await loop.getaddrinfo(addr[0], addr[1], type=socket.SOCK_DGRAM)
                family, _, _, _, sockaddr = infos[0]
                sock = socket.socket(family, socket.SOCK_DGRAM)
                try:
                    sock.setblocking(False)
                    sock.bind(("::", 0) if family == socket.AF_INET6 else ("0.0.0.0", 0))
                    quic = QuicConnection(configuration=self._config)
                    conn = _ClientConn(quic, client=self, addr=addr)
                    created = conn
                    await loop.create_datagram_endpoint(lambda: created, sock=sock)
                except BaseException:
                    sock.close()
                    raise
                conn.connect(sockaddr)
                await conn.ready
        except (TimeoutError, OSError, ConnectionError) as e:
            if conn is not None:
                conn._shutdown("dial failed")
            why = "dial timed out" if isinstance(e, TimeoutError) else f"dial failed: {e or type(e).__name__}"
            p.last_error = why
            p.retry_at = loop.time() + p.backoff
            p.backoff = min(p.backoff * 2, _DIAL_BACKOFF_MAX)
            log.debug("cluster client: node %s: %s (backoff %.2fs)", _fmt_addr(addr), why, p.retry_at - loop.time())
            raise Unavailable(f"node {_fmt_addr(addr)} unreachable: {why}", code="node_unreachable") from None
        except BaseException:
            if conn is not None:
                conn._shutdown("dial abandoned")
            raise
        finally:
            p.dialing = None
        if self._closed or self._peers.get(addr) is not p:
            conn._shutdown("node client closing")
            raise Unavailable("the cluster client is closed")
        p.conn = conn
        p.backoff = _DIAL_BACKOFF_MIN
        p.retry_at = 0.0
        self.dials += 1
        return conn

    def _forget(self, conn: _ClientConn) -> None:
        p = self._peers.get(conn.peer_addr)
        if p is not None and p.conn is conn:
            p.conn = None


class _Timeout(Exception):
    pass


def _expire(fut: asyncio.Future[msgspec.Raw]) -> None:
    if not fut.done():
        fut.set_exception(_Timeout())


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
