"""The node-RPC client: one shared ``NodeRpcClient`` per node process, one multiplexed TLS
connection per peer address, dialled on demand.

A call is a REQ frame with a fresh request id on the peer's connection, answered by OK / ERR
with that id; any number run at once on one connection. A caller that gives up (deadline or
cancellation) sends CANCEL (the handler is cancelled there) and a late answer is discarded.
A connection is usable once the server's HELLO arrived (the server checked our certificate;
until then the dial is not over). Dials are bounded by ``dial_timeout`` and back off (0.25 s
doubling to 2 s) after a failure; a failure in the TLS handshake is reported as
``cluster_auth`` (cluster secret mismatch?).

Liveness: a connection that received nothing for ``PING_AFTER`` seconds sends a PING; if
nothing at all arrives within ``PING_TIMEOUT`` of it, the connection is dropped and its calls
fail at once (the next call redials); while our own output is still draining (a large frame
ahead of the PING on a slow link) the peer counts as alive. A call that times out sends a PING at once. A peer that
dies or restarts closes or resets the TCP connection: its calls fail at once. A connection with
no call for ``idle_timeout`` seconds is closed.

Imports narad.cluster.rpc_frames/rpc_auth/rpc_conn, narad.errors, narad.metrics, the stdlib and
msgspec.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import ssl
from dataclasses import dataclass
from typing import Any, TypeVar

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
    decode_error,
    encode,
)
from narad.errors import BadGateway, GatewayTimeout, NaradError, PayloadTooLarge, Unavailable

T = TypeVar("T")

PING_AFTER = 0.5  # seconds of silence before a PING
PING_TIMEOUT = 1.0  # seconds a PING may go unanswered (with nothing else received)
_TICK = 0.25
_DIAL_BACKOFF_MIN = 0.25
_DIAL_BACKOFF_MAX = 2.0


class _AuthFailed(Exception):
    pass


class _ClientConn(FrameConn):
    """Our connection to one peer node."""

    role = "client"

    def __init__(self, client: NodeRpcClient, addr: tuple[str, int]) -> None:
        super().__init__()
        self._client = client
        self.peer_addr = addr
        self.peer = addr
        self.name = f"node {fmt_addr(addr)}"
        self.hello: asyncio.Future[None] = self._loop.create_future()
        self.calls: dict[int, asyncio.Future[msgspec.Raw]] = {}
        self._ids = itertools.count(1)
        self._ping: tuple[int, float] | None = None  # (id, sent at)
        self._ping_ids = itertools.count(1)
        self._last_call = self._loop.time()
        self._ticker: asyncio.TimerHandle | None = None
        self.lost_reason = ""

    @property
    def usable(self) -> bool:
        return not self.dead and self.hello.done() and not self.hello.cancelled() and self.hello.exception() is None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        problem = rpc_auth.pinned(transport.get_extra_info("ssl_object"), self._client._secret)
        if problem is not None:
            self._fail_dial(_AuthFailed(problem))
            self.abort(problem)
            return
        self.last_rx = self._loop.time()
        self._ticker = self._loop.call_later(_TICK, self._tick)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.hello.done():
            # the server refused our certificate after our side of the handshake completed
            self._fail_dial(_AuthFailed(f"the peer refused our certificate ({exc})")
                            if isinstance(exc, ssl.SSLError)
                            else ConnectionError(f"the peer closed the connection before HELLO ({exc})"))
        super().connection_lost(exc)

    def _fail_dial(self, exc: BaseException) -> None:
        if not self.hello.done():
            self.hello.set_exception(exc)
            self.hello.exception()  # retrieved: the dialer reports it

    # -- input -------------------------------------------------------------------------------

    def on_frame(self, kind: int, rid: int, body: bytes | None) -> None:
        if kind in (OK, ERR):
            fut = self.calls.pop(rid, None)
            if fut is None or fut.done():
                return  # cancelled or timed out meanwhile: discarded
            if body is None:
                fut.set_exception(BadGateway(f"{self.name} sent a reply over the {MAX_FRAME} byte frame limit"))
            elif kind == OK:
                fut.set_result(msgspec.Raw(body))
            else:
                try:
                    fut.set_exception(decode_error(body))
                except msgspec.DecodeError:
                    fut.set_exception(BadGateway(f"{self.name} sent a malformed error reply"))
        elif kind == PONG:
            if self._ping is not None and self._ping[0] == rid:
                self._ping = None
        elif kind == HELLO:
            if not self.hello.done():
                self.hello.set_result(None)
        else:
            raise ProtocolError(f"unexpected frame kind {kind} from a server")

    # -- calls -------------------------------------------------------------------------------

    def request(self, body: bytes, fut: asyncio.Future[msgspec.Raw]) -> int:
        rid = next(self._ids)
        if self.dead:  # died between the dial and this caller resuming: nobody would answer
            fut.set_exception(BadGateway(f"no answer from {self.name}: connection lost ({self.lost_reason})"))
            return rid
        self.calls[rid] = fut
        self._last_call = self._loop.time()
        self.send(REQ, rid, body)
        return rid

    def note(self, body: bytes) -> None:
        self._last_call = self._loop.time()
        self.send(NOTE, 0, body)

    def cancel(self, rid: int) -> None:
        if self.calls.pop(rid, None) is not None and not self.dead:
            self.send(CANCEL, rid)

    def probe(self) -> None:
        """After a timeout: PING now (if none is outstanding)."""
        if not self.dead and self._ping is None and self.usable:
            self._send_ping(self._loop.time())

    def _send_ping(self, now: float) -> None:
        pid = next(self._ping_ids)
        self._ping = (pid, now)
        self.send(PING, pid)

    def _tick(self) -> None:
        self._ticker = None
        if self.dead:
            return
        now = self._loop.time()
        self.tx_progress(now)
        if self._ping is not None:
            # the PING may sit behind a large frame of ours still leaving: a peer that keeps
            # taking our bytes is alive, so the PING's clock starts when that stops
            since = max(self._ping[1], self.last_tx_progress)
            if now - since >= PING_TIMEOUT and self.last_rx < self._ping[1]:
                log.warning("cluster client: %s did not answer a PING within %gs; dropping the connection",
                            self.name, PING_TIMEOUT)
                self.abort("liveness probe unanswered")
                return
        elif not self.calls and now - self._last_call > self._client._idle_timeout:
            self.close("idle")
            return
        elif now - self.last_rx >= PING_AFTER and self.usable:
            self._send_ping(now)
        delay = _TICK
        if self._ping is not None:  # wake up exactly at the PING's deadline
            since = max(self._ping[1], self.last_tx_progress)
            delay = min(_TICK, max(0.0, since + PING_TIMEOUT - now) + 0.001)
        self._ticker = self._loop.call_later(delay, self._tick)

    def teardown(self, reason: str) -> None:
        if self.dead:
            return
        self.dead = True
        self.lost_reason = reason
        self._fail_dial(ConnectionError(reason))
        calls = list(self.calls.values())
        self.calls.clear()
        for fut in calls:
            if not fut.done():
                fut.set_exception(BadGateway(f"no answer from {self.name}: connection lost ({reason})"))
        self._client._forget(self)
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None


@dataclass
class _PeerState:
    conn: _ClientConn | None = None
    dialing: asyncio.Task[_ClientConn] | None = None
    backoff: float = _DIAL_BACKOFF_MIN
    retry_at: float = 0.0
    last_error: str = ""
    auth_failed: bool = False


class NodeRpcClient:
    """Calls peer nodes: one multiplexed TLS connection per peer address, dialled on demand."""

    def __init__(self, secret: bytes, *, dial_timeout: float = 1.0, idle_timeout: float = 30.0) -> None:
        if not secret:
            raise ValueError("the cluster secret must not be empty")
        self._secret = bytes(secret)
        # the TLS context needs the secret's key: derived on a thread (it takes 50-100 ms of
        # PBKDF2, which must not stall the loop), started now if a loop runs, awaited by dials
        self._ssl: ssl.SSLContext | None = None
        self._ssl_task: asyncio.Task[ssl.SSLContext] | None = None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            self._ssl_context_task()
        self._dial_timeout = dial_timeout
        self._idle_timeout = idle_timeout
        self._peers: dict[tuple[str, int], _PeerState] = {}
        self._notes: set[asyncio.Task[None]] = set()
        self._closed = False
        self._log = RateLimitedLog()
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
                lines.append(f"  to {fmt_addr(addr)}: no connection dialing={p.dialing is not None} "
                             f"last_error={p.last_error!r}")
                continue
            now = c._loop.time()
            rids = ", ".join(str(r) for r in list(c.calls)[:20])
            lines.append(f"  to {fmt_addr(addr)}: dead={c.dead} usable={c.usable} quiet={now - c.last_rx:.1f}s "
                         f"frames={c.rx_frames} ping={c._ping is not None} out={c.write_buffered}B calls=[{rids}]")
        return "\n".join(lines)

    async def call(self, addr: tuple[str, int], msg: msgspec.Struct, resp_type: type[T], timeout: float = 5.0) -> T:
        raw = await self.call_raw(addr, msg, timeout)
        try:
            return msgspec.msgpack.decode(raw, type=resp_type)
        except msgspec.DecodeError as e:
            raise BadGateway(f"node {fmt_addr(addr)} sent an undecodable {resp_type.__name__}: {e}") from None

    async def call_raw(self, addr: tuple[str, int], msg: msgspec.Struct, timeout: float = 5.0) -> msgspec.Raw:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        body = encode(msg)
        if len(body) > MAX_FRAME:
            raise PayloadTooLarge(f"cluster request {type(msg).__name__} of {len(body)} bytes exceeds the "
                                  f"{MAX_FRAME} byte frame limit")
        op = metrics.op_label(type(msg))
        p = self._peers.get(addr)
        conn = p.conn if p is not None else None
        if conn is None or not conn.usable:
            try:
                conn = await self._connection(addr, deadline, msg)
            except asyncio.CancelledError:
                raise
            except BaseException:
                _count(op, "failed")  # no connection: the call never went out
                raise
        fut: asyncio.Future[msgspec.Raw] = loop.create_future()
        rid = conn.request(body, fut)
        timer = loop.call_at(deadline, _expire, fut)
        try:
            raw = await fut
            _count(op, "ok")
            return raw
        except _Timeout:
            conn.cancel(rid)
            conn.probe()
            _count(op, "timeout")
            raise GatewayTimeout(f"no answer from node {fmt_addr(addr)} within {timeout:g}s "
                                 f"({type(msg).__name__})") from None
        except asyncio.CancelledError:
            conn.cancel(rid)
            raise
        except NaradError:
            _count(op, "rejected")  # the peer answered with an error of its own
            raise
        except Exception:
            _count(op, "error")
            raise
        finally:
            timer.cancel()

    def notify(self, addr: tuple[str, int], msg: msgspec.Struct) -> None:
        """Send a one-way message (on the authenticated connection, like a call). Fire and
        forget: failures are logged, never raised; no ordering promised between notes."""
        if self._closed:
            return
        try:
            body = encode(msg)
        except Exception:
            log.exception("cluster note %s is not encodable", type(msg).__name__)
            return
        if len(body) > MAX_FRAME:
            log.error("cluster note %s of %d bytes exceeds the frame limit; dropped", type(msg).__name__, len(body))
            return
        _count(metrics.op_label(type(msg)), "ok")
        p = self._peers.get(addr)
        if p is not None and p.conn is not None and p.conn.usable:
            p.conn.note(body)
            return
        task = asyncio.get_running_loop().create_task(self._send_note(addr, body, type(msg).__name__))
        self._notes.add(task)
        task.add_done_callback(self._notes.discard)

    async def _send_note(self, addr: tuple[str, int], body: bytes, name: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn = await self._connection(addr, loop.time() + self._dial_timeout + 0.5, None)
            conn.note(body)
        except NaradError as e:
            self._log(f"note:{addr}", logging.WARNING, "cluster note %s to %s dropped: %s", name,
                      fmt_addr(addr), e.message)
        except Exception as e:
            self._log(f"note:{addr}", logging.WARNING, "cluster note %s to %s dropped: %s", name, fmt_addr(addr), e)

    async def close(self) -> None:
        self._closed = True
        if self._ssl_task is not None and not self._ssl_task.done():
            self._ssl_task.cancel()
        for t in list(self._notes):
            t.cancel()
        peers = list(self._peers.values())
        for p in peers:
            if p.dialing is not None:
                p.dialing.cancel()
            if p.conn is not None:
                p.conn.close("node client closing")
        self._peers.clear()
        pending = list(self._notes) + [p.dialing for p in peers if p.dialing is not None]
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
            return conn
        loop = asyncio.get_running_loop()
        now = loop.time()
        if p.dialing is None:
            if now < p.retry_at:
                if p.auth_failed:
                    raise BadGateway(f"node {fmt_addr(addr)} failed cluster authentication ({p.last_error}; "
                                     f"cluster secret mismatch?)", code="cluster_auth")
                raise Unavailable(f"node {fmt_addr(addr)} unreachable ({p.last_error}; next dial in "
                                  f"{p.retry_at - now:.2f}s)", code="node_unreachable")
            p.dialing = loop.create_task(self._dial(addr, p))
            p.dialing.add_done_callback(_retrieve)
        try:
            return await asyncio.wait_for(asyncio.shield(p.dialing), max(0.0, deadline - now))
        except TimeoutError:
            what = type(msg).__name__ if msg is not None else "note"
            raise GatewayTimeout(f"no answer from node {fmt_addr(addr)}: call deadline passed while "
                                 f"connecting ({what})") from None

    def _ssl_context_task(self) -> asyncio.Task[ssl.SSLContext]:
        if self._ssl_task is None:
            self._ssl_task = asyncio.get_running_loop().create_task(
                rpc_auth.context_off_loop(self._secret, server=False))
            self._ssl_task.add_done_callback(_retrieve)
        return self._ssl_task

    async def _dial(self, addr: tuple[str, int], p: _PeerState) -> _ClientConn:
        loop = asyncio.get_running_loop()
        conn: _ClientConn | None = None
        try:
            if self._ssl is None:  # once per client (the first dial waits for the derivation)
                self._ssl = await asyncio.shield(self._ssl_context_task())
            async with asyncio.timeout(self._dial_timeout):
                infos = await loop.getaddrinfo(addr[0], addr[1], type=socket.SOCK_STREAM)
                family, _, _, _, sockaddr = infos[0]
                sock = socket.socket(family, socket.SOCK_STREAM)
                try:
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    await loop.sock_connect(sock, sockaddr)
                    conn = _ClientConn(self, addr)
                    created = conn
                    await loop.create_connection(lambda: created, sock=sock, ssl=self._ssl, server_hostname="",
                                                 ssl_handshake_timeout=self._dial_timeout)
                except BaseException:
                    sock.close()
                    raise
                await conn.hello
        except (TimeoutError, OSError, ConnectionError, _AuthFailed) as e:
            if conn is not None:
                conn.abort("dial failed")
            auth = isinstance(e, (_AuthFailed, ssl.SSLError))
            if isinstance(e, TimeoutError):
                why = "dial timed out"
            elif auth:
                why = f"TLS authentication failed: {e}"
            else:
                why = f"dial failed: {str(e) or type(e).__name__}"
            p.last_error = why
            p.auth_failed = auth
            p.retry_at = loop.time() + p.backoff
            p.backoff = min(p.backoff * 2, _DIAL_BACKOFF_MAX)
            log.debug("cluster client: node %s: %s (backoff %.2fs)", fmt_addr(addr), why, p.retry_at - loop.time())
            if auth:
                self._log(f"auth:{addr}", logging.WARNING, "cluster client: %s: %s (cluster secret mismatch?)",
                          fmt_addr(addr), why)
                raise BadGateway(f"node {fmt_addr(addr)} failed cluster authentication (cluster secret mismatch?)",
                                 code="cluster_auth") from None
            raise Unavailable(f"node {fmt_addr(addr)} unreachable: {why}", code="node_unreachable") from None
        except BaseException:
            if conn is not None:
                conn.abort("dial abandoned")
            raise
        finally:
            p.dialing = None
        if self._closed or self._peers.get(addr) is not p or conn.dead:
            conn.close("node client closing")
            raise Unavailable("the cluster client is closed" if self._closed else
                              f"node {fmt_addr(addr)}: connection lost while dialing ({conn.lost_reason})")
        p.conn = conn
        p.backoff = _DIAL_BACKOFF_MIN
        p.retry_at = 0.0
        p.auth_failed = False
        self.dials += 1
        return conn

    def _forget(self, conn: _ClientConn) -> None:
        p = self._peers.get(conn.peer_addr)
        if p is not None and p.conn is conn:
            p.conn = None


class _Timeout(Exception):
    pass


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(_Timeout())


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


_COUNTERS: dict[tuple[str, str], tuple[Any, Any]] = {}


def _count(op: str, outcome: str) -> None:
    """narad_cluster_rpc_requests_total{op,outcome}: one dict lookup and an add."""
    m = metrics.get()
    c = _COUNTERS.get((op, outcome))
    if c is None or c[0] is not m:  # a process's fresh metrics (metrics.setup after fork)
        c = _COUNTERS[(op, outcome)] = (m, m.cluster_rpc.labels(op, outcome))
    c[1].value += 1
