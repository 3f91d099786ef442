"""Tests for node RPC over TLS 1.3 on TCP (narad.cluster.transport and the rpc_* modules).

Every test runs a real NodeRpcServer on a listening TCP socket bound to 127.0.0.1 (a free
port, SO_REUSEPORT as the supervisor makes them) and a NodeRpcClient, under uvloop, with a
small Service of handlers defined here; a killed peer is a real server process killed with
SIGKILL. Waits are on events and states, never on fixed sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from narad.cluster import rpc_auth, rpc_frames
from narad.cluster.rpc_frames import HEADER, MAX_FRAME, REQ, FrameReader, ProtocolError
from narad.cluster.transport import NodePeer, NodeRpcClient, NodeRpcServer
from narad.errors import BadGateway, BadRequest, GatewayTimeout, InternalError, NotFound, PayloadTooLarge, Unavailable
from narad.ipc.rpc import Service

SECRET = b"s3cret-cluster-key-of-32-bytes!!"
ROOT = Path(__file__).resolve().parent.parent


class Echo(msgspec.Struct, tag=True):
    text: str
    blob: bytes = b""


class EchoReply(msgspec.Struct, tag=True):
    text: str
    blob: bytes = b""
    peer: str = ""


class Lookup(msgspec.Struct, tag=True):
    name: str


class Crash(msgspec.Struct, tag=True):
    pass


class Hang(msgspec.Struct, tag=True):
    pass


class Huge(msgspec.Struct, tag=True):
    size: int


class Note(msgspec.Struct, tag=True):
    n: int


class NotServed(msgspec.Struct, tag=True):
    pass


@dataclass
class State:
    calls: int = 0
    hang_started: asyncio.Event = field(default_factory=asyncio.Event)
    hang_cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    notes: asyncio.Queue[int] = field(default_factory=asyncio.Queue)


def make_service(state: State) -> Service:
    svc = Service()

    async def echo(m: Echo, peer: NodePeer) -> EchoReply:
        state.calls += 1
        return EchoReply(text=m.text, blob=m.blob, peer=str(peer.addr[0]))

    async def lookup(m: Lookup, peer: NodePeer) -> EchoReply:
        state.calls += 1
        raise NotFound(f"no thing named {m.name!r}", code="thing_not_found")

    async def crash(m: Crash, peer: NodePeer) -> EchoReply:
        state.calls += 1
        raise RuntimeError("handler bug")

    async def hang(m: Hang, peer: NodePeer) -> EchoReply:
        state.calls += 1
        state.hang_started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            state.hang_cancelled.set()
            raise
        raise AssertionError("unreachable")

    async def huge(m: Huge, peer: NodePeer) -> EchoReply:
        state.calls += 1
        return EchoReply(text="big", blob=b"x" * m.size)

    async def note(m: Note, peer: NodePeer) -> None:
        state.calls += 1
        state.notes.put_nowait(m.n)

    for typ, fn in ((Echo, echo), (Lookup, lookup), (Crash, crash), (Hang, hang), (Huge, huge), (Note, note)):
        svc.register(typ, fn)  # type: ignore[arg-type]
    return svc


def tcp_listener(port: int = 0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen(128)
    return s


def run(coro: Coroutine[Any, Any, None], timeout: float = 15.0) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(coro, timeout)

    uvloop.run(bounded())


async def until(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    """Wait for a state (polls; the transport has no event for every state)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


@dataclass
class Node:
    server: NodeRpcServer
    sock: socket.socket
    addr: tuple[str, int]
    state: State


@contextlib.asynccontextmanager
async def node(secret: bytes = SECRET, port: int = 0, **kw: Any) -> AsyncIterator[Node]:
    state = State()
    sock = tcp_listener(port)
    server = NodeRpcServer(sock, secret, make_service(state), **kw)
    await server.start()
    try:
        yield Node(server, sock, sock.getsockname(), state)
    finally:
        await server.close(grace=0.2)
        sock.close()


@contextlib.asynccontextmanager
async def client(secret: bytes = SECRET, **kw: Any) -> AsyncIterator[NodeRpcClient]:
    c = NodeRpcClient(secret, **kw)
    try:
        yield c
    finally:
        await c.close()


async def conn_of(c: NodeRpcClient, addr: tuple[str, int]) -> Any:
    return await c._connection(addr, asyncio.get_running_loop().time() + 2.0, None)


async def raw_request(c: NodeRpcClient, addr: tuple[str, int], wire: bytes, rid: int) -> msgspec.Raw:
    """Write ``wire`` as-is on the client's connection (bypassing its checks), registered as
    request ``rid``, and wait for what the server answers."""
    conn = await conn_of(c, addr)
    fut: asyncio.Future[msgspec.Raw] = asyncio.get_running_loop().create_future()
    conn.calls[rid] = fut
    conn._out.append(wire)
    conn._flush()
    return await asyncio.wait_for(fut, 5.0)


def rogue_context(secret: bytes) -> ssl.SSLContext:
    """A TLS client that presents ``secret``'s certificate and trusts any server."""
    ctx = rpc_auth.context(secret, server=False)
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


class Relay:
    """A TCP relay between a client and a server; can record what the client sent and be
    frozen (stops forwarding both ways without closing anything: a peer gone silent)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.frozen = False
        self.recorded: list[bytes] = []
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(*self.target)
        self._writers += [w, uw]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, record: bool) -> None:
            while data := await src.read(65536):
                if record:
                    self.recorded.append(data)
                if not self.frozen:
                    dst.write(data)
            dst.close()

        for t in (pump(r, uw, True), pump(ur, w, False)):
            task = asyncio.ensure_future(t)
            self._tasks.add(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in self._tasks:
            t.cancel()
        for w in self._writers:
            w.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)


# -- frames and identity ----------------------------------------------------------------------------


def test_frame_reader_caps_before_buffering() -> None:
    got: list[tuple[int, int, bytes | None]] = []
    rd = FrameReader(lambda k, r, b: got.append((k, r, b)), cap=100)
    wire = HEADER.pack(3, REQ, 7) + b"abc" + HEADER.pack(0, rpc_frames.PING, 8)
    for i in range(len(wire)):  # byte by byte
        rd.feed(wire[i : i + 1])
    assert got == [(REQ, 7, b"abc"), (rpc_frames.PING, 8, b"")]
    got.clear()
    # a frame announced over the cap is reported from its header and skipped as it streams in
    rd.feed(HEADER.pack(10_000, REQ, 9) + b"x" * 500)
    assert got == [(REQ, 9, None)] and rd.buffered == 0 and rd.skipping == 9_500
    for _ in range(19):
        rd.feed(b"x" * 500)
        assert rd.buffered == 0
    rd.feed(HEADER.pack(2, REQ, 10) + b"ok")
    assert got[-1] == (REQ, 10, b"ok") and rd.skipping == 0
    with pytest.raises(ProtocolError):
        rd.feed(HEADER.pack(0, 99, 1))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=40),
                          st.tuples(st.integers(0, 300), st.integers(0, 9), st.integers(0, 2**64 - 1)).map(
                              lambda t: HEADER.pack(*t))), min_size=1, max_size=12))
def test_frame_reader_on_random_bytes(chunks: list[bytes]) -> None:
    """Random bytes and headers in random chunks: frames come out with exactly the announced
    body, bodies over the cap come out as None, ProtocolError is the only failure, and no more
    than one incomplete frame (header + cap) is ever kept."""
    cap = 200
    got: list[tuple[int, int, bytes | None]] = []
    rd = FrameReader(lambda k, r, b: got.append((k, r, b)), cap=cap)
    wire = b"".join(chunks)
    try:
        for c in chunks:
            rd.feed(c)
            assert rd.buffered < rpc_frames.HEADER_LEN + cap
    except ProtocolError:
        return
    # replay the same bytes through a straight parse and compare
    pos, want = 0, []
    while len(wire) - pos >= rpc_frames.HEADER_LEN:
        length, kind, rid = HEADER.unpack_from(wire, pos)
        pos += rpc_frames.HEADER_LEN
        if length > cap:
            want.append((kind, rid, None))
            pos += length
            continue
        if pos + length > len(wire):
            break
        want.append((kind, rid, wire[pos : pos + length]))
        pos += length
    assert got == want


def test_identity_is_the_secrets_and_the_same_in_every_process() -> None:
    der, _ = rpc_auth.identity(SECRET)
    other, _ = rpc_auth.identity(b"another secret of at least 32 bytes")
    assert der != other
    code = ("import sys; from narad.cluster import rpc_auth; "
            f"sys.stdout.write(rpc_auth.identity({SECRET!r})[0].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert bytes.fromhex(out) == der  # Ed25519 is deterministic: every node builds the same certificate


# -- calls ------------------------------------------------------------------------------------------


def test_round_trip() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            r = await c.call(n.addr, Echo(text="hello", blob=b"\x00\xff"), EchoReply)
            assert r == EchoReply(text="hello", blob=b"\x00\xff", peer="127.0.0.1")
            r = await c.call(n.addr, Echo(text="again"), EchoReply)
            assert r.text == "again"
            assert c.dials == 1 and n.server.handshakes == 1
            conn = await conn_of(c, n.addr)
            tls = conn.transport.get_extra_info("ssl_object")
            assert tls.version() == "TLSv1.3" and tls.selected_alpn_protocol() == rpc_auth.ALPN
            assert n.sock.fileno() != -1  # the caller's socket is left open

    run(main())


class CountingTransport:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_200_concurrent_calls_share_one_connection_and_one_write() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            conn = await conn_of(c, n.addr)
            counting = CountingTransport(conn.transport)
            conn.transport = counting
            replies = await asyncio.gather(*(c.call(n.addr, Echo(text=str(i)), EchoReply) for i in range(200)))
            assert [r.text for r in replies] == [str(i) for i in range(200)]
            assert c.dials == 1 and n.server.handshakes == 1 and n.server.connections == 1
            assert n.state.calls == 200
            assert counting.writes == 1  # 200 requests queued in one loop pass leave in one write
            (sconn,) = n.server._conns
            assert sconn.rx_frames <= 210  # HELLO-less side: 200 requests (+ maybe a PING)

    run(main())


def test_10_mib_request_and_reply() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            blob = bytes(range(256)) * (10 * 4096)  # 10 MiB
            r = await c.call(n.addr, Echo(text="big", blob=blob), EchoReply, timeout=10.0)
            assert r.blob == blob

    run(main(), timeout=20.0)


def test_frames_over_16_mib_are_refused_without_buffering() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            # the client refuses to send one
            with pytest.raises(PayloadTooLarge):
                await c.call(n.addr, Echo(text="x", blob=b"x" * (MAX_FRAME + 1)), EchoReply)
            # the server refuses one announced by the header, before reading its body
            wire = HEADER.pack(MAX_FRAME + 1, REQ, 10_000) + b"x" * 100_000
            with pytest.raises(PayloadTooLarge):
                await raw_request(c, n.addr, wire, 10_000)
            (sconn,) = n.server._conns
            assert sconn.reader.buffered == 0 and sconn.reader.skipping > 0
            # the rest of that body is skipped unread; the connection goes on
            conn = await conn_of(c, n.addr)
            conn._out.append(b"y" * (MAX_FRAME + 1 - 100_000))
            conn._flush()
            assert (await c.call(n.addr, Echo(text="ok"), EchoReply, timeout=10.0)).text == "ok"
            assert sconn.reader.skipping == 0
            # a reply over the limit becomes a 500, not a broken connection
            with pytest.raises(InternalError) as ei:
                await c.call(n.addr, Huge(size=MAX_FRAME + 1), EchoReply, timeout=10.0)
            assert ei.value.status == 500 and "limit" in ei.value.message
            assert n.state.calls == 2  # Echo and Huge ran
            assert (await c.call(n.addr, Echo(text="ok"), EchoReply)).text == "ok"
            assert c.dials == 1

    run(main(), timeout=30.0)


def test_handler_errors_come_back_as_the_same_class() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            with pytest.raises(NotFound) as ei:
                await c.call(n.addr, Lookup(name="ghost"), EchoReply)
            assert ei.value.status == 404
            assert ei.value.message == "no thing named 'ghost'"
            assert ei.value.code == "thing_not_found"
            with pytest.raises(InternalError) as ei2:
                await c.call(n.addr, Crash(), EchoReply)
            assert ei2.value.status == 500 and "handler bug" in ei2.value.message
            with pytest.raises(BadRequest, match="unsupported rpc operation"):
                await c.call(n.addr, NotServed(), EchoReply)
            # an undecodable request costs only that request
            with pytest.raises(BadRequest, match="undecodable"):
                await raw_request(c, n.addr, HEADER.pack(5, REQ, 10_001) + b"\xc1\xc1\xc1\xc1\xc1", 10_001)
            assert (await c.call(n.addr, Echo(text="still here"), EchoReply)).text == "still here"
            assert c.dials == 1

    run(main())


def test_timeout_cancels_the_handler_and_discards_the_reply() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            t0 = time.monotonic()
            with pytest.raises(GatewayTimeout, match="no answer from node"):
                await c.call(n.addr, Hang(), EchoReply, timeout=0.3)
            assert time.monotonic() - t0 < 1.0
            assert n.state.hang_started.is_set()
            await asyncio.wait_for(n.state.hang_cancelled.wait(), 2.0)
            (sconn,) = n.server._conns
            assert not sconn.tasks
            conn = await conn_of(c, n.addr)
            assert not conn.calls
            # the connection survives (the liveness PING sent on the timeout is answered)
            assert (await c.call(n.addr, Echo(text="after"), EchoReply)).text == "after"
            assert c.dials == 1

    run(main())


def test_cancelling_the_caller_cancels_the_handler() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            call = asyncio.ensure_future(c.call(n.addr, Hang(), EchoReply, timeout=30.0))
            await asyncio.wait_for(n.state.hang_started.wait(), 2.0)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await asyncio.wait_for(n.state.hang_cancelled.wait(), 2.0)
            assert (await c.call(n.addr, Echo(text="after"), EchoReply)).text == "after"

    run(main())


# -- authentication ---------------------------------------------------------------------------------


def test_wrong_secret_on_the_client_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="narad.cluster.transport")

    async def main() -> None:
        async with node() as n, client(b"not-the-secret-but-also-32-bytes") as c:
            for _ in range(3):
                t0 = time.monotonic()
                with pytest.raises(BadGateway) as ei:
                    await c.call(n.addr, Echo(text="let me in"), EchoReply)
                assert ei.value.code == "cluster_auth"
                assert time.monotonic() - t0 < 1.0
            # a rogue client that does not check the server, presenting the wrong certificate,
            # is refused by the server: no handler runs, nothing of ours is ever buffered
            body = msgspec.msgpack.encode(Echo(text="x"))
            for _ in range(2):
                with contextlib.suppress(OSError):  # refused during or right after the handshake
                    r, w = await asyncio.open_connection(*n.addr, server_hostname="",
                                                         ssl=rogue_context(b"wrong secret, 32 bytes or more!!"))
                    w.write(HEADER.pack(len(body), REQ, 1) + body)
                    try:
                        assert await asyncio.wait_for(r.read(), 3.0) == b""
                    finally:
                        w.close()
            assert n.state.calls == 0 and n.server.connections == 0 and n.server.handshakes == 0
            assert n.server.rejected >= 2

    run(main())
    rejected = [r for r in caplog.records if "cluster connection rejected" in r.getMessage()]
    assert len(rejected) == 1  # at most once per 10 s per peer


def test_wrong_secret_on_the_server_is_rejected_by_the_client() -> None:
    async def main() -> None:
        async with node(secret=b"an impostor's secret, long enough") as n, client() as c:
            with pytest.raises(BadGateway) as ei:
                await c.call(n.addr, Echo(text="who are you"), EchoReply)
            assert ei.value.code == "cluster_auth"
            assert n.state.calls == 0 and c.connections == 0

    run(main())


def test_unauthenticated_peer_runs_nothing_and_is_held_to_the_handshake() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            # plaintext frames and junk are not TLS: refused, nothing handled
            plain = HEADER.pack(5, REQ, 1) + msgspec.msgpack.encode(Echo(text="x"))
            for junk in (plain, b"\x16\x03\x01" + b"z" * 300_000):
                r, w = await asyncio.open_connection(*n.addr)
                w.write(junk)
                with contextlib.suppress(OSError):
                    assert await asyncio.wait_for(r.read(), 3.0) == b""  # closed on us
                w.close()
            # at most MAX_HANDSHAKING connections sit in a handshake: the oldest make room
            idle = [await asyncio.open_connection(*n.addr) for _ in range(rpc_auth.MAX_HANDSHAKING + 6)]
            await until(lambda: len(n.server._handshaking) == rpc_auth.MAX_HANDSHAKING)
            assert (await c.call(n.addr, Echo(text="still served"), EchoReply)).text == "still served"
            assert n.state.calls == 1 and n.server.handshakes == 1
            for _, w in idle:
                w.close()

    run(main())


def test_a_recorded_handshake_replayed_on_another_session_fails() -> None:
    """The proof (each side's CertificateVerify) signs its own session's transcript: the bytes
    a client sent on one session, replayed verbatim on a new one, authenticate nothing."""

    async def main() -> None:
        async with node() as n:
            relay = Relay(n.addr)
            via = await relay.start()
            try:
                async with client() as c:
                    assert (await c.call(via, Echo(text="recorded"), EchoReply)).text == "recorded"
                    recorded = b"".join(relay.recorded)
                assert n.state.calls == 1 and n.server.handshakes == 1
                r, w = await asyncio.open_connection(*n.addr)
                w.write(recorded)
                with contextlib.suppress(OSError):
                    await asyncio.wait_for(r.read(), 3.0)
                w.close()
                await until(lambda: n.server.rejected >= 1)
                assert n.state.calls == 1 and n.server.handshakes == 1
            finally:
                await relay.close()

    run(main())


# -- liveness ---------------------------------------------------------------------------------------


def test_server_restart_redials() -> None:
    async def main() -> None:
        async with client() as c:
            async with node() as n1:
                port = n1.addr[1]
                assert (await c.call(n1.addr, Echo(text="one"), EchoReply)).text == "one"
            await until(lambda: c.connections == 0)  # the server's close arrived
            async with node(port=port) as n2:
                assert (await c.call(n2.addr, Echo(text="two"), EchoReply)).text == "two"
                assert c.dials == 2

    run(main())


SERVE = """
import asyncio, sys, uvloop
sys.path.insert(0, {root!r})
from tests.test_cluster_transport import State, make_service, tcp_listener, SECRET
from narad.cluster.transport import NodeRpcServer
async def main():
    s = NodeRpcServer(tcp_listener(int(sys.argv[1])), SECRET, make_service(State()))
    await s.start()
    print("serving", flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""


def serve_process(port: int) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", SERVE.format(root=str(ROOT)), str(port)], stdout=subprocess.PIPE,
                         text=True, cwd=ROOT)
    assert p.stdout is not None and p.stdout.readline().strip() == "serving"
    return p


def test_killed_peer_fails_calls_at_once_and_a_restarted_one_is_redialled() -> None:
    probe = tcp_listener()
    port = probe.getsockname()[1]
    probe.close()
    addr = ("127.0.0.1", port)
    procs: list[subprocess.Popen[str]] = []

    async def main() -> None:
        async with client() as c:
            procs.append(serve_process(port))
            assert (await c.call(addr, Echo(text="one"), EchoReply)).text == "one"
            waiting = asyncio.ensure_future(c.call(addr, Hang(), EchoReply, timeout=30.0))
            await asyncio.sleep(0.1)  # let the request reach the server (no event to wait on here)
            os.kill(procs[0].pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(BadGateway, match="connection lost"):
                await waiting
            assert time.monotonic() - t0 < 1.0  # the kernel closed the dead process's socket
            procs[0].wait(5)
            procs.append(serve_process(port))
            t1 = time.monotonic()
            while True:  # the dial backs off for at most 0.25 s after the failure
                try:
                    assert (await c.call(addr, Echo(text="two"), EchoReply)).text == "two"
                    break
                except Unavailable:
                    assert time.monotonic() - t1 < 2.0
                    await asyncio.sleep(0.05)
            assert c.dials == 2

    try:
        run(main())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)


def test_silent_peer_is_dropped_after_an_unanswered_ping(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="narad.cluster.transport")

    async def main() -> None:
        async with node() as n:
            relay = Relay(n.addr)
            via = await relay.start()
            try:
                async with client() as c:
                    # idle: the PING of a quiet connection finds out
                    assert (await c.call(via, Echo(text="one"), EchoReply)).text == "one"
                    relay.frozen = True
                    t0 = time.monotonic()
                    await until(lambda: c.connections == 0, timeout=4.0)
                    assert time.monotonic() - t0 < 2.5  # 0.5 s quiet, then 1 s for the PING
                    # with a call waiting: its timeout sends a PING at once
                    relay.frozen = False
                    assert (await c.call(via, Echo(text="two"), EchoReply)).text == "two"
                    relay.frozen = True
                    t0 = time.monotonic()
                    with pytest.raises(GatewayTimeout):
                        await c.call(via, Echo(text="anyone?"), EchoReply, timeout=0.2)
                    await until(lambda: c.connections == 0, timeout=3.0)
                    assert time.monotonic() - t0 < 2.0
            finally:
                await relay.close()

    run(main())
    assert any("did not answer a PING" in r.getMessage() for r in caplog.records)


def test_long_calls_survive_and_idle_connections_close() -> None:
    async def main() -> None:
        state = State()
        svc = make_service(state)

        async def slow(m: Echo, peer: NodePeer) -> EchoReply:
            await asyncio.sleep(1.6)  # longer than the server's idle timeout: the client PINGs meanwhile
            return EchoReply(text=m.text)

        svc.register(Echo, slow)  # type: ignore[arg-type]
        sock = tcp_listener()
        server = NodeRpcServer(sock, SECRET, svc, idle_timeout=1.0)
        await server.start()
        try:
            async with client(idle_timeout=0.5) as c:
                addr = sock.getsockname()
                assert (await c.call(addr, Echo(text="long"), EchoReply)).text == "long"
                assert c.dials == 1
                await until(lambda: c.connections == 0)  # no call for 0.5 s: closed
                assert (await c.call(addr, Echo(text="again"), EchoReply)).text == "again"
                assert c.dials == 2
        finally:
            await server.close(grace=0.2)
            sock.close()

    run(main())


def test_unreachable_node_fails_fast_during_backoff() -> None:
    async def main() -> None:
        silent = tcp_listener()  # the kernel accepts; nobody speaks TLS
        try:
            addr = silent.getsockname()
            async with client() as c:
                t0 = time.monotonic()
                with pytest.raises(Unavailable, match="unreachable"):
                    await c.call(addr, Echo(text="anyone?"), EchoReply)
                assert 0.9 <= time.monotonic() - t0 < 1.5
                t1 = time.monotonic()
                with pytest.raises(Unavailable, match="unreachable"):
                    await c.call(addr, Echo(text="anyone?"), EchoReply)
                assert time.monotonic() - t1 < 0.1
        finally:
            silent.close()
        probe = tcp_listener()
        refused = probe.getsockname()
        probe.close()  # nothing listens: connection refused at once
        async with client() as c:
            t0 = time.monotonic()
            with pytest.raises(Unavailable, match="unreachable"):
                await c.call(refused, Echo(text="anyone?"), EchoReply)
            assert time.monotonic() - t0 < 0.5

    run(main())


# -- notes and closing ------------------------------------------------------------------------------


def test_notify_delivers_one_way_messages() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            c.notify(n.addr, Note(n=1))  # no connection yet: dials in the background
            assert await asyncio.wait_for(n.state.notes.get(), 3.0) == 1
            c.notify(n.addr, Note(n=2))  # on the existing connection
            assert await asyncio.wait_for(n.state.notes.get(), 3.0) == 2
            assert c.dials == 1
        async with node() as n, client(b"wrong secret, but 32 bytes long!") as c:
            c.notify(n.addr, Note(n=3))  # authenticated too: never delivered
            await until(lambda: not c._notes)
            assert n.state.notes.empty() and n.state.calls == 0

    run(main())


def test_close_lets_running_handlers_answer_and_refuses_new_requests() -> None:
    async def main() -> None:
        state = State()
        svc = make_service(state)
        release = asyncio.Event()

        async def slow(m: Echo, peer: NodePeer) -> EchoReply:
            state.hang_started.set()
            await release.wait()
            return EchoReply(text=m.text)

        svc.register(Echo, slow)  # type: ignore[arg-type]
        sock = tcp_listener()
        server = NodeRpcServer(sock, SECRET, svc)
        await server.start()
        async with client() as c:
            call = asyncio.ensure_future(c.call(sock.getsockname(), Echo(text="in flight"), EchoReply))
            await asyncio.wait_for(state.hang_started.wait(), 2.0)
            closing = asyncio.ensure_future(server.close(grace=2.0))
            await until(lambda: server._closing)
            with pytest.raises(Unavailable) as ei:
                await c.call(sock.getsockname(), Lookup(name="late"), EchoReply)
            assert ei.value.code == "refused"
            release.set()
            assert (await call).text == "in flight"
            await closing
            assert server.connections == 0
        assert sock.fileno() != -1
        sock.close()

    run(main())


def test_an_array_like_request_an_older_node_lacks_is_named_unsupported() -> None:
    """A tagged array-like struct whose tag a node does not know (a newer peer's request,
    e.g. ``MoveClaimsReq``) is answered as an unsupported operation, which a caller may
    downgrade on, not as a malformed request."""
    import msgspec as M

    from narad.broker import peers as P
    from narad.cluster.rpc_frames import undecodable

    body = M.msgpack.encode(P.MoveClaimsReq("t", "id", 1, "tok"))
    try:
        M.msgpack.Decoder(P.MoveThawReq | P.MoveFreezeReq).decode(body)
    except M.DecodeError as e:
        assert undecodable(body, e) == "unsupported rpc operation MoveClaimsReq"
    else:
        raise AssertionError("decoded a type it does not know")
    bad = M.msgpack.encode([1, 2])
    try:
        M.msgpack.Decoder(P.MoveThawReq | P.MoveFreezeReq).decode(bad)
    except M.DecodeError as e:
        assert undecodable(bad, e).startswith("undecodable request")
