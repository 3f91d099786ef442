"""Review tests for node RPC over TLS on TCP (issue 10 follow-up): holes an authenticated or
unauthenticated peer, a slow link or a stalled process could open in narad.cluster.rpc_*.

Real servers and clients on 127.0.0.1 under uvloop (the helpers of tests/test_cluster_transport.py),
real TCP relays for a slow link. Waits are on states with deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import ssl
import threading
import time
from typing import Any

import msgspec
import pytest

from narad.cluster import rpc_auth, rpc_server
from narad.cluster.rpc_frames import HEADER, REQ
from narad.cluster.transport import NodeRpcClient, NodeRpcServer
from narad.errors import BadGateway, GatewayTimeout, Unavailable
from tests.test_cluster_transport import (
    SECRET,
    Echo,
    EchoReply,
    Hang,
    Huge,
    Relay,
    State,
    client,
    conn_of,
    make_service,
    node,
    run,
    serve_process,
    tcp_listener,
)


class SlowRelay(Relay):
    """A TCP relay that forwards client -> server at ``rate`` bytes per second (a slow link)
    and server -> client at full speed. Small socket buffers on the relay's side, so the
    kernel does not absorb what the link has not carried yet."""

    def __init__(self, target: tuple[str, int], rate: int) -> None:
        super().__init__(target)
        self.rate = rate

    async def start(self) -> tuple[str, int]:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
        ls.bind(("127.0.0.1", 0))
        self._server = await asyncio.start_server(self._serve, sock=ls)
        return ls.getsockname()

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(*self.target)
        self._writers += [w, uw]

        async def slow(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            chunk = max(1, self.rate // 50)
            while data := await src.read(chunk):
                dst.write(data)
                await asyncio.sleep(len(data) / self.rate)
            dst.close()

        async def fast(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
            dst.close()

        for t in (slow(r, uw), fast(ur, w)):
            task = asyncio.ensure_future(t)
            self._tasks.add(task)


def served_elsewhere() -> tuple[tuple[str, int], Any]:
    """A node-RPC server in a process of its own on a free port: (address, process)."""
    probe = tcp_listener()
    port = probe.getsockname()[1]
    probe.close()
    return ("127.0.0.1", port), serve_process(port)


def test_a_peer_that_stops_reading_does_not_grow_our_write_buffer() -> None:
    """Backpressure: a client that keeps asking for large replies but reads none of them must
    not make the server queue reply after reply in memory (it stops reading requests while its
    output is over the transport's high-water mark)."""

    async def main() -> None:
        async with node() as n, client() as c:
            conn = await conn_of(c, n.addr)
            conn.transport.pause_reading()  # we read nothing from now on
            if conn._ticker is not None:  # (and our own liveness check, which would drop it, is off)
                conn._ticker.cancel()
            (sconn,) = n.server._conns
            calls = []
            peak = 0
            for _ in range(48):  # one request at a time, each asking for 1 MiB, while watching
                calls.append(asyncio.ensure_future(c.call(n.addr, Huge(size=1 << 20), EchoReply, timeout=30.0)))
                for _ in range(3):
                    await asyncio.sleep(0.01)
                    peak = max(peak, sconn.write_buffered)
            assert n.state.calls < 48, "every request was read and answered into the write buffer"
            assert peak < 12 << 20, f"server buffered {peak} bytes of replies for a peer that reads none"
            conn.transport.resume_reading()  # and everything is still answered once it reads again
            replies = await asyncio.gather(*calls)
            assert all(len(r.blob) == 1 << 20 for r in replies) and n.state.calls == 48

    run(main(), timeout=40.0)


def test_a_large_request_on_a_slow_link_is_not_mistaken_for_a_dead_peer() -> None:
    """Head of line: while a large request is still leaving (the link carries it slower than
    the liveness window), the PING waits behind it and no PONG can come back; the bytes the peer
    keeps taking prove it alive, so the connection must not be dropped."""

    async def main() -> None:
        async with node() as n:
            relay = SlowRelay(n.addr, rate=2 << 20)
            via = await relay.start()
            try:
                async with client() as c:
                    assert (await c.call(via, Echo(text="warm"), EchoReply)).text == "warm"
                    blob = b"y" * (10 << 20)
                    r = await c.call(via, Echo(text="big", blob=blob), EchoReply, timeout=30.0)
                    assert len(r.blob) == len(blob)
                    assert c.dials == 1
            finally:
                await relay.close()

    run(main(), timeout=40.0)


def test_the_key_derivation_never_runs_on_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """PBKDF2 of the secret takes 50-100 ms (more on a loaded box): a worker that builds its
    node-RPC client and server inside its running loop must not stall that loop on it."""
    real = rpc_auth.hashlib.pbkdf2_hmac
    threads: list[int] = []

    def spy(*a: Any, **kw: Any) -> bytes:
        threads.append(threading.get_ident())
        return real(*a, **kw)

    monkeypatch.setattr(rpc_auth.hashlib, "pbkdf2_hmac", spy)
    secret = b"a secret this process never derived before, 32+ bytes"

    async def main() -> None:
        loop_thread = threading.get_ident()
        state = State()
        sock = tcp_listener()
        server = NodeRpcServer(sock, secret, make_service(state))
        c = NodeRpcClient(secret)
        try:
            await server.start()
            assert (await c.call(sock.getsockname(), Echo(text="hi"), EchoReply)).text == "hi"
        finally:
            await c.close()
            await server.close(grace=0.2)
            sock.close()
        assert threads, "the key was never derived"
        assert loop_thread not in threads, "PBKDF2 ran on the event loop's thread"

    run(main())


def test_a_stopped_peer_is_detected_within_two_seconds_and_a_continued_one_serves_again() -> None:
    """SIGSTOP (no FIN, no RST: the kernel still ACKs): a waiting call fails with BadGateway,
    new calls fail fast (504 / 503, never hang), and after SIGCONT calls succeed again."""
    addr, proc = served_elsewhere()

    async def main() -> None:
        async with client() as c:
            assert (await c.call(addr, Echo(text="one"), EchoReply)).text == "one"
            waiting = asyncio.ensure_future(c.call(addr, Hang(), EchoReply, timeout=30.0))
            await asyncio.sleep(0.1)  # let the request reach the server
            os.kill(proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(BadGateway, match="liveness probe unanswered"):
                await waiting
            assert time.monotonic() - t0 < 2.5  # 0.5 s quiet + 1 s for the PING (+ ticks)
            with pytest.raises((GatewayTimeout, Unavailable)):  # the stopped peer cannot finish a handshake
                await c.call(addr, Echo(text="two"), EchoReply, timeout=3.0)
            assert time.monotonic() - t0 < 6.0
            os.kill(proc.pid, signal.SIGCONT)

            async def served() -> bool:
                try:
                    return (await c.call(addr, Echo(text="three"), EchoReply, timeout=1.0)).text == "three"
                except (Unavailable, GatewayTimeout, BadGateway):
                    return False

            deadline = time.monotonic() + 5.0
            while not await served():
                assert time.monotonic() < deadline, "the continued peer was not redialled"
                await asyncio.sleep(0.05)

    try:
        run(main(), timeout=30.0)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(5)


class SlowNote(msgspec.Struct, tag=True):
    n: int


def test_notes_count_towards_the_in_flight_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """One-way notes run handlers too: a peer sending notes faster than they finish must be
    paused like one sending requests, not make the server spawn a task per note without bound."""
    monkeypatch.setattr(rpc_server, "MAX_IN_FLIGHT", 32)

    async def main() -> None:
        state = State()
        svc = make_service(state)
        release = asyncio.Event()
        started = 0

        async def slow_note(m: SlowNote, peer: Any) -> None:
            nonlocal started
            started += 1
            await release.wait()

        svc.register(SlowNote, slow_note)  # type: ignore[arg-type]
        sock = tcp_listener()
        server = NodeRpcServer(sock, SECRET, svc)
        await server.start()
        addr = sock.getsockname()
        try:
            async with client() as c:
                await c.call(addr, Echo(text="up"), EchoReply)
                for i in range(500):
                    c.notify(addr, SlowNote(n=i))
                await asyncio.sleep(0.3)  # the notes arrive (no event for "not processed")
                assert started <= 32, f"{started} note handlers running at once"
                release.set()
                deadline = time.monotonic() + 10.0
                while started < 500:  # and all of them run once earlier ones finished
                    assert time.monotonic() < deadline, f"only {started} of 500 notes handled"
                    await asyncio.sleep(0.01)
        finally:
            await server.close(grace=0.2)
            sock.close()

    run(main())


def test_a_call_on_a_connection_that_died_meanwhile_fails_at_once() -> None:
    """A caller resumed after its dial may find the connection already gone (it died in the
    loop passes between): its request must fail at once, not wait out its whole deadline."""

    async def main() -> None:
        async with node() as n, client() as c:
            conn = await conn_of(c, n.addr)
            conn.abort("gone")
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            conn.request(b"\x80", fut)
            assert fut.done(), "a request queued on a dead connection is never answered"
            with pytest.raises(BadGateway, match="connection lost"):
                fut.result()

    run(main())


def test_no_certificate_another_alpn_or_tls_1_2_gets_nothing() -> None:
    """A TLS client without a certificate, one with the cluster's certificate but another (or
    no) ALPN protocol, and one limited to TLS 1.2 are all refused before any handler runs."""

    def no_cert() -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.set_alpn_protocols([rpc_auth.ALPN])
        return ctx

    def with_alpn(alpn: list[str]) -> ssl.SSLContext:
        """The cluster's own certificate and key, offering ``alpn`` (nothing if empty)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        rpc_auth._load_chain(ctx, rpc_auth.identity(SECRET)[1])
        if alpn:
            ctx.set_alpn_protocols(alpn)
        return ctx

    def tls12() -> ssl.SSLContext:
        ctx = with_alpn([rpc_auth.ALPN])
        ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        return ctx

    async def main() -> None:
        async with node() as n:
            body = msgspec.msgpack.encode(Echo(text="x"))
            wire = HEADER.pack(len(body), REQ, 1) + body
            for make in (no_cert, lambda: with_alpn(["h2"]), lambda: with_alpn([]), tls12):
                got = b""
                with contextlib.suppress(OSError, ssl.SSLError):
                    r, w = await asyncio.open_connection(*n.addr, server_hostname="", ssl=make())
                    w.write(wire)
                    try:
                        got = await asyncio.wait_for(r.read(), 3.0)
                    finally:
                        w.close()
                assert got == b""  # not even HELLO
            assert n.state.calls == 0 and n.server.handshakes == 0 and n.server.connections == 0
            assert n.server.rejected >= 3

    run(main())


def test_a_peer_that_closes_before_hello_is_unreachable_not_an_auth_failure() -> None:
    """A node shutting down (or restarting) may finish a handshake and close without HELLO: the
    caller must see 503 node_unreachable and a short backoff, not 502 cluster_auth ("secret
    mismatch?") for a cluster whose secrets agree; a dial error always says what happened."""

    async def main() -> None:
        async def drop(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.close()  # the handshake (with the right certificate) is done: close cleanly

        srv = await asyncio.start_server(drop, "127.0.0.1", 0, ssl=rpc_auth.context(SECRET, server=True))
        addr = srv.sockets[0].getsockname()
        try:
            async with client() as c:
                with pytest.raises(Unavailable) as ei:
                    await c.call(addr, Echo(text="x"), EchoReply)
                assert ei.value.code == "node_unreachable"
        finally:
            srv.close()

        async def eof(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.read(65536)  # the ClientHello, then a plain FIN (not TLS at all)
            w.close()

        plain = await asyncio.start_server(eof, "127.0.0.1", 0)
        try:
            async with client() as c:
                with pytest.raises(Unavailable) as ei:
                    await c.call(plain.sockets[0].getsockname(), Echo(text="x"), EchoReply)
                assert not ei.value.message.rstrip().endswith(":"), ei.value.message  # says what failed
        finally:
            plain.close()

    run(main())


def test_a_server_at_its_in_flight_limit_is_not_mistaken_for_a_dead_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """At MAX_IN_FLIGHT running requests the server stopped reading, so the client's PING (and
    CANCELs) waited unread behind the next request: the client dropped a healthy connection
    (failing every long call on it) 1.5 s later. PINGs and CANCELs must still be served."""
    monkeypatch.setattr(rpc_server, "MAX_IN_FLIGHT", 16)

    async def main() -> None:
        async with node() as n, client() as c:
            hangs = [asyncio.ensure_future(c.call(n.addr, Hang(), EchoReply, timeout=20.0)) for _ in range(16)]
            echo = asyncio.ensure_future(c.call(n.addr, Echo(text="behind"), EchoReply, timeout=20.0))
            deadline = time.monotonic() + 3.0
            while not (n.state.calls == 16 and n.server.connections == 1
                       and len(next(iter(n.server._conns))._deferred) == 1):
                assert time.monotonic() < deadline, "the 17th request is not waiting for a slot"
                await asyncio.sleep(0.01)
            assert not echo.done()
            deadline = time.monotonic() + 3.0  # twice the liveness window
            while time.monotonic() < deadline:
                assert c.connections == 1 and not echo.done(), "the client dropped a live, busy server"
                await asyncio.sleep(0.05)
            for h in hangs:
                h.cancel()
            assert (await echo).text == "behind"  # read and served once slots freed
            assert c.dials == 1

    run(main())


class Gate(msgspec.Struct, tag=True):
    pad: bytes = b""


def test_a_server_paused_on_held_requests_keeps_the_connection_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past DEFER_CAP bytes of held requests the server stops reading altogether (PINGs unread):
    its unsolicited PONGs keep the client from dropping it, and it resumes once slots free."""
    monkeypatch.setattr(rpc_server, "MAX_IN_FLIGHT", 4)
    monkeypatch.setattr(rpc_server, "DEFER_CAP", 64 << 10)

    async def main() -> None:
        state = State()
        svc = make_service(state)
        gate = asyncio.Event()

        async def gated(m: Gate, peer: Any) -> EchoReply:
            await gate.wait()
            return EchoReply(text="through")

        svc.register(Gate, gated)  # type: ignore[arg-type]
        sock = tcp_listener()
        server = NodeRpcServer(sock, SECRET, svc)
        await server.start()
        addr = sock.getsockname()
        try:
            async with client() as c:
                calls = [asyncio.ensure_future(c.call(addr, Gate(pad=b"p" * (16 << 10)), EchoReply, timeout=20.0))
                         for _ in range(40)]
                deadline = time.monotonic() + 3.0
                while not any(sc._paused for sc in server._conns):
                    assert time.monotonic() < deadline, "reading never paused on held requests"
                    await asyncio.sleep(0.01)
                t0 = time.monotonic()
                while time.monotonic() - t0 < 3.0:  # twice the liveness window, paused all along
                    assert c.connections == 1, "the client dropped a live server paused on held requests"
                    await asyncio.sleep(0.05)
                gate.set()
                replies = await asyncio.gather(*calls)
                assert all(r.text == "through" for r in replies) and c.dials == 1
        finally:
            await server.close(grace=0.2)
            sock.close()

    run(main())


def test_a_stopped_peer_is_detected_while_we_keep_sending_small_notes() -> None:
    """A stopped process's kernel still ACKs what we send until its receive buffer fills: small
    steady traffic must not pass for liveness (only a draining backlog ahead of our PING does)."""
    addr, proc = served_elsewhere()

    async def main() -> None:
        async with client() as c:
            assert (await c.call(addr, Echo(text="one"), EchoReply)).text == "one"
            os.kill(proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            i = 0
            while c.connections:
                assert time.monotonic() - t0 < 3.0, "a stopped peer that ACKs small notes still passes for alive"
                c.notify(addr, Echo(text=f"note {i}"))
                i += 1
                await asyncio.sleep(0.05)

    try:
        run(main(), timeout=30.0)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(5)
