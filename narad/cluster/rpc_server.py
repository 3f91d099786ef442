"""The node-RPC server: serves a ``narad.ipc.rpc.Service`` to peer nodes over TLS 1.3 on TCP
(one per worker, on a listening socket of the cluster port that the supervisor made with
SO_REUSEPORT; any worker of a node may accept a peer's connection).

Per accepted connection: nobody reads the socket until ``connect_accepted_socket`` runs the handshake (at most
``MAX_HANDSHAKING`` at once, ``HANDSHAKE_TIMEOUT`` each; narad.cluster.rpc_auth says why the
handshake proves the cluster secret). Then the server checks the pinned certificate, sends
HELLO and serves frames: each REQ runs its handler in a task of its own (``handler(msg, peer)``
with ``peer`` a ``NodePeer``) and is answered OK / ERR with the request's id, in any order; a
NOTE runs its handler and is never answered; CANCEL cancels the handler of that request (its
answer is never sent); PING is answered PONG. At most ``MAX_IN_FLIGHT`` requests and notes run per
connection: past it they wait, in order, for a slot, while PINGs and CANCELs are still read and
served; reading pauses (TCP backpressure) once ``DEFER_CAP`` bytes of them wait, and while our
output to the peer is over the transport's high-water mark (a peer that stops reading its answers
is not read either). While paused the server sends an unsolicited PONG every ``KEEPALIVE``
seconds (the client's PINGs wait unread meanwhile). A
frame over the cap is answered 413 and its body skipped unread. A connection silent for
``idle_timeout`` (clients PING every half second while connected) is dropped and its handlers
cancelled; a peer that closes or resets the connection cancels its handlers at once.

Imports narad.cluster.rpc_frames/rpc_auth/rpc_conn, narad.errors, narad.ipc.rpc (``Service``),
narad.metrics, the stdlib and msgspec. Works on its own dup of the caller's socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import ssl
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from narad import metrics
from narad.cluster import rpc_auth
from narad.cluster.rpc_conn import FrameConn, RateLimitedLog, fmt_addr, log
from narad.cluster.rpc_frames import (
    CANCEL,
    ERR,
    HELLO,
    MAX_FRAME,
    NOTE,
    OK,
    PING,
    PONG,
    REQ,
    ProtocolError,
    encode,
    encode_error,
    undecodable,
)
from narad.errors import NaradError
from narad.ipc.rpc import Service

MAX_IN_FLIGHT = 1024  # requests handled at once per connection
DEFER_CAP = 4 << 20  # bytes of requests held (read at the in-flight limit) before reading pauses
KEEPALIVE = 0.25  # seconds between two unsolicited PONGs while a connection's reading is paused
PRE_AUTH_CAP = 64 << 10  # bytes held for a connection between its handshake and its pin check


@dataclass
class NodePeer:
    """What a cluster handler learns about the calling node."""

    addr: tuple[Any, ...]
    peer_info: dict[str, Any] = field(default_factory=dict)


class _ServerConn(FrameConn):
    """One authenticated inbound connection from a peer node."""

    role = "server"

    def __init__(self, server: NodeRpcServer, peer: tuple[Any, ...]) -> None:
        super().__init__()
        self._srv = server
        self.peer = peer
        self.node_peer = NodePeer(addr=peer)
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.notes = 0  # note handlers running for this connection (they count towards MAX_IN_FLIGHT)
        self._attached = False  # the pin check passed: frames are parsed
        self._paused = False
        self._keepalive: asyncio.TimerHandle | None = None
        # requests and notes read while MAX_IN_FLIGHT run, in arrival order (key: request id,
        # or a negative number for a note); their bodies' bytes
        self._deferred: OrderedDict[int, tuple[int, bytes]] = OrderedDict()
        self._deferred_bytes = 0
        self._note_keys = itertools.count(-1, -1)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    # data arriving between the handshake and attach() (the pin check) is held, capped
    def buffer_updated(self, nbytes: int) -> None:
        if self._attached:
            super().buffer_updated(nbytes)
            return
        self.reader.hold(nbytes)
        if self.reader.buffered > PRE_AUTH_CAP and not self.dead:
            self.abort("sent too much before its certificate was checked")

    def attach(self) -> None:
        self._attached = True
        self.send(HELLO, 0)
        if self.reader.buffered:
            try:
                self.reader.parse()
            except ProtocolError as e:
                self._protocol_error(e)

    def on_frame(self, kind: int, rid: int, body: bytes | None) -> None:
        if kind in (REQ, NOTE):
            if body is not None and (self._deferred or len(self.tasks) + self.notes >= MAX_IN_FLIGHT):
                self._defer(kind, rid, body)
            elif kind == REQ:
                self._request(rid, body)
            else:
                self._note(body)
        elif kind == CANCEL:
            task = self.tasks.pop(rid, None)
            if task is not None:
                task.cancel()
                self._start_deferred()
            else:
                waiting = self._deferred.pop(rid, None)
                if waiting is not None:
                    self._deferred_bytes -= len(waiting[1])
                    self._check_resume()
        elif kind == PING:
            self.send(PONG, rid)
        else:
            raise ProtocolError(f"unexpected frame kind {kind} from a client")

    def _request(self, rid: int, body: bytes | None) -> None:
        srv = self._srv
        if body is None:
            log.warning("cluster server: %s sent a request over the %d byte frame limit; refused",
                        fmt_addr(self.peer), MAX_FRAME)
            self.send(ERR, rid, encode_error(413, f"request over the {MAX_FRAME} byte frame limit"))
            return
        if rid in self.tasks:
            raise ProtocolError(f"request id {rid} reused while in flight")
        if srv._closing:
            self.send(ERR, rid, encode_error(503, "the node is shutting down; request not processed", "refused"))
            return
        try:
            msg = srv.service.decoder.decode(body)
        except msgspec.DecodeError as e:
            self._answer_error(rid, 400, undecodable(body, e))
            return
        handler = srv.service.handler_for(msg)
        if handler is None:
            self._answer_error(rid, 400, f"unsupported rpc operation {type(msg).__name__}")
            return
        metrics.get().node_rpc_served.labels(type(msg).__name__).inc()
        task = self._loop.create_task(self._run(rid, handler, msg))
        self.tasks[rid] = task
        srv._track(task)

    def on_write_pressure(self) -> None:
        self._check_resume()

    def _defer(self, kind: int, rid: int, body: bytes) -> None:
        """At the in-flight limit: keep reading (so PINGs and CANCELs are seen at once) but hold
        the request until a slot frees; past DEFER_CAP bytes held, reading pauses."""
        if kind == REQ:
            if rid in self.tasks or rid in self._deferred:
                raise ProtocolError(f"request id {rid} reused while in flight")
            key = rid
        else:
            key = next(self._note_keys)
        self._deferred[key] = (kind, body)
        self._deferred_bytes += len(body)
        if self._deferred_bytes > DEFER_CAP:
            self._check_resume()

    def _start_deferred(self) -> None:
        """A slot freed: start held requests in order, then see whether reading may resume."""
        while self._deferred and len(self.tasks) + self.notes < MAX_IN_FLIGHT and not self.dead:
            key, (kind, body) = self._deferred.popitem(last=False)
            self._deferred_bytes -= len(body)
            if kind == REQ:
                self._request(key, body)
            else:
                self._note(body)
        self._check_resume()

    def _check_resume(self) -> None:
        """Read (and parse) requests only while fewer than MAX_IN_FLIGHT run and our output is
        under the transport's high-water mark: a peer that stops reading its answers, or floods
        requests, stops being read (TCP backpressure) instead of growing our memory. Frames
        already buffered wait in the reader too (one socket read can hold thousands)."""
        if self.dead or self.transport is None:
            return
        want = self._deferred_bytes > DEFER_CAP or self.write_paused
        if want == self._paused:
            return
        self._paused = want
        self.reader.paused = want
        if want:
            self.transport.pause_reading()
            if self._keepalive is None:
                self._keepalive = self._loop.call_later(KEEPALIVE, self._send_keepalive)
        else:
            self.transport.resume_reading()
            if self._keepalive is not None:
                self._keepalive.cancel()
                self._keepalive = None
            if self.reader.buffered:
                self._loop.call_soon(self._parse_held)

    def _send_keepalive(self) -> None:
        """While reading is paused the client's PINGs sit unread behind requests: show we are
        alive anyway (any frame counts for the client's liveness check; id 0 answers no PING)."""
        self._keepalive = None
        if self.dead or not self._paused:
            return
        self.send(PONG, 0)
        self._keepalive = self._loop.call_later(KEEPALIVE, self._send_keepalive)

    def _parse_held(self) -> None:
        if self.dead or self.reader.paused or not self._attached:
            return
        try:
            self.reader.parse()
        except ProtocolError as e:
            self._protocol_error(e)

    def _note(self, body: bytes | None) -> None:
        srv = self._srv
        if body is None:
            log.warning("cluster server: %s sent a note over the frame limit; dropped", fmt_addr(self.peer))
            return
        if srv._closing:
            return
        try:
            msg = srv.service.decoder.decode(body)
        except msgspec.DecodeError as e:
            log.warning("cluster server: note from %s: %s", fmt_addr(self.peer), undecodable(body, e))
            return
        handler = srv.service.handler_for(msg)
        if handler is None:
            log.warning("cluster server: note from %s: unsupported %s", fmt_addr(self.peer), type(msg).__name__)
            return
        metrics.get().node_rpc_served.labels(type(msg).__name__).inc()
        self.notes += 1
        srv._spawn(self._run_note(handler, msg))

    async def _run(self, rid: int, handler: Any, msg: Any) -> None:
        peer = self.node_peer
        try:
            result = await handler(msg, peer)
            out = encode(result)
            kind = OK
            if len(out) > MAX_FRAME:
                kind, out = ERR, encode_error(500, f"reply of {len(out)} bytes exceeds the {MAX_FRAME} byte limit")
        except NaradError as e:
            kind, out = ERR, encode_error(e.status, e.message, e.code, e.extra)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # the caller gave up or the connection is gone: nothing to answer
            # Something the handler awaited was cancelled, not this request: it must
            # still be answered, or the caller waits out its whole deadline.
            log.error("cluster handler %s: an operation it waited on was cancelled (peer %s, request %d)",
                      type(msg).__name__, fmt_addr(peer.addr), rid)
            kind, out = ERR, encode_error(503, "the operation was cancelled on the serving node; retry")
        except Exception as e:
            log.exception("cluster handler %s failed (peer %s, request %d)", type(msg).__name__,
                          fmt_addr(peer.addr), rid)
            kind, out = ERR, encode_error(500, f"internal error: {type(e).__name__}: {e}")
        if self.tasks.pop(rid, None) is not None and not self.dead:
            self.send(kind, rid, out)
            if self._deferred or self._paused:
                self._start_deferred()

    async def _run_note(self, handler: Any, msg: Any) -> None:
        try:
            await handler(msg, self.node_peer)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("cluster note handler %s failed (peer %s)", type(msg).__name__, fmt_addr(self.peer))
        finally:
            self.notes -= 1
            if self._deferred or self._paused:
                self._start_deferred()

    def _answer_error(self, rid: int, status: int, message: str) -> None:
        log.warning("cluster server: %s from %s (request %d)", message, fmt_addr(self.peer), rid)
        self.send(ERR, rid, encode_error(status, message))

    def teardown(self, reason: str) -> None:
        if self.dead:
            return
        self.dead = True
        self._srv._conns.discard(self)
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        tasks = list(self.tasks.values())
        self.tasks.clear()
        self._deferred.clear()
        self._deferred_bytes = 0
        for t in tasks:
            t.cancel()
        if self._srv._conns_gone is not None and not self._srv._conns:
            self._srv._conns_gone.set()

    def busy(self) -> bool:
        return not self.dead and (bool(self.tasks) or self.write_buffered > 0)


class NodeRpcServer:
    """Serves a ``Service`` to peer nodes over TLS on an already listening TCP socket (owned by
    the caller: we work on a dup of it)."""

    def __init__(self, sock: socket.socket, secret: bytes, service: Service, *, idle_timeout: float = 10.0) -> None:
        if not secret:
            raise ValueError("the cluster secret must not be empty")
        self.service = service
        self._sock = sock
        self._secret = bytes(secret)
        self._ssl: ssl.SSLContext | None = None  # built in start(): the key derivation runs off the loop
        self._idle_timeout = idle_timeout
        self._conns: set[_ServerConn] = set()
        self._conns_gone: asyncio.Event | None = None
        self._handshaking: OrderedDict[int, asyncio.Task[None]] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle: asyncio.Event | None = None
        self._closing = False
        self._listen: socket.socket | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._log = RateLimitedLog()
        self.handshakes = 0  # connections that proved the secret (for tests and metrics)
        self.rejected = 0  # handshakes that failed

    @property
    def connections(self) -> int:
        return len(self._conns)

    @property
    def address(self) -> tuple[Any, ...]:
        return tuple(self._sock.getsockname())

    def describe(self) -> str:
        """Diagnostics: every inbound connection and the requests running on it."""
        lines = [f"node rpc server {fmt_addr(self.address)}: {len(self._conns)} connections, "
                 f"{len(self._handshaking)} handshaking, {len(self._tasks)} handlers running, "
                 f"closing={self._closing}"]
        now = asyncio.get_running_loop().time()
        for c in list(self._conns):
            rids = ", ".join(str(r) for r in list(c.tasks)[:20])
            lines.append(f"  from {fmt_addr(c.peer)}: quiet={now - c.last_rx:.1f}s frames={c.rx_frames} "
                         f"paused={c._paused} held={len(c._deferred)} out={c.write_buffered}B running=[{rids}]")
        return "\n".join(lines)

    async def start(self) -> None:
        if self._listen is not None:
            raise RuntimeError("NodeRpcServer already started")
        loop = asyncio.get_running_loop()
        if self._ssl is None:
            self._ssl = await rpc_auth.context_off_loop(self._secret, server=True)
        self._idle = asyncio.Event()
        self._idle.set()
        sock = self._sock.dup()  # we close ours; the caller's must stay open
        sock.setblocking(False)
        self._listen = sock
        loop.add_reader(sock.fileno(), self._accept_ready)
        self._sweeper = loop.call_later(1.0, self._sweep)

    def _accept_ready(self) -> None:
        """Accept what is queued; each connection's socket is read by nobody until its TLS
        layer owns it (connect_accepted_socket), so nothing a peer sends is lost or buffered
        by us before the handshake."""
        lsock = self._listen
        if lsock is None:
            return
        loop = asyncio.get_running_loop()
        for _ in range(64):
            try:
                s, addr = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: say so, keep serving what we have
                self._log("accept", logging.ERROR, "cluster server: accept failed: %s", e)
                return
            if self._closing:
                s.close()
                continue
            s.setblocking(False)
            hs = self._handshaking
            while len(hs) >= rpc_auth.MAX_HANDSHAKING:
                _, oldest = hs.popitem(last=False)
                oldest.cancel()
            task = loop.create_task(self._handshake(s, tuple(addr)))
            hs[id(task)] = task
            task.add_done_callback(lambda t: self._handshaking.pop(id(t), None))

    async def _handshake(self, s: socket.socket, peer: tuple[Any, ...]) -> None:
        loop = asyncio.get_running_loop()
        conn = _ServerConn(self, peer)
        try:
            tls, _ = await loop.connect_accepted_socket(lambda: conn, sock=s, ssl=self._ssl,
                                                        ssl_handshake_timeout=rpc_auth.HANDSHAKE_TIMEOUT)
        except asyncio.CancelledError:
            s.close()
            return
        except (OSError, ConnectionError, TimeoutError, ssl.SSLError) as e:
            self.rejected += 1
            s.close()
            why = "timed out" if isinstance(e, TimeoutError) else (str(e) or type(e).__name__)
            self._log(f"auth:{peer[0] if peer else '?'}", logging.WARNING,
                      "cluster connection rejected: TLS handshake with %s failed (%s; cluster secret mismatch?)",
                      fmt_addr(peer), why)
            return
        problem = rpc_auth.pinned(tls.get_extra_info("ssl_object"), self._secret)
        if problem is not None or self._closing:
            self.rejected += 1
            if problem is not None:
                self._log(f"auth:{peer[0] if peer else '?'}", logging.WARNING,
                          "cluster connection rejected: %s (peer %s)", problem, fmt_addr(peer))
            conn.abort(problem or "closing")
            return
        self.handshakes += 1
        self._conns.add(conn)
        conn.attach()

    def _sweep(self) -> None:
        """Drop connections silent for the idle timeout (clients PING while connected)."""
        self._sweeper = None
        if self._closing:
            return
        now = asyncio.get_running_loop().time()
        for c in list(self._conns):
            c.tx_progress(now)  # a peer still taking a long answer of ours is not idle
            if now - max(c.last_rx, c.last_tx_progress) > self._idle_timeout:
                log.warning("cluster server: %s silent for %.0fs; dropping the connection",
                            fmt_addr(c.peer), now - c.last_rx)
                c.abort("idle")
        self._sweeper = asyncio.get_running_loop().call_later(min(1.0, self._idle_timeout / 2), self._sweep)

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
        """Stop accepting and refuse new requests (503 ``refused``), let running handlers finish
        and their answers leave (up to ``grace`` seconds), then close every connection and the
        socket."""
        if self._closing:
            return
        self._closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, grace)
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._listen is not None:
            loop.remove_reader(self._listen.fileno())
            self._listen.close()
            self._listen = None
        for task in list(self._handshaking.values()):
            task.cancel()
        if self._tasks and self._idle is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - loop.time()))
        while loop.time() < deadline and any(c.busy() for c in list(self._conns)):
            await asyncio.sleep(0.005)  # answers still in the write buffer
        if self._tasks:
            log.warning("cluster server: close grace over, cancelling %d running handlers", len(self._tasks))
            for t in list(self._tasks):
                t.cancel()
        self._conns_gone = asyncio.Event()
        conns = list(self._conns)
        for conn in conns:
            conn.close("node shutting down")
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
