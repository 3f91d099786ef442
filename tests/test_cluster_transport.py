"""Tests for node RPC over QUIC (narad.cluster.transport).

Every test runs a real NodeRpcServer on a UDP socket bound to 127.0.0.1 (a free port, with
SO_REUSEPORT as the supervisor makes them) and a NodeRpcClient, under uvloop, with a small
Service of handlers defined here. Waits are on events and states, never on fixed sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
import socket
import ssl
import struct
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import uvloop

from narad.cluster import transport as tr
from narad.cluster.transport import MAX_FRAME, NodePeer, NodeRpcClient, NodeRpcServer
from narad.errors import BadGateway, BadRequest, GatewayTimeout, InternalError, NotFound, PayloadTooLarge, Unavailable
from narad.ipc.rpc import Service
from tests.harness import wait_for

SECRET = b"s3cret-cluster-key"


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


def udp_socket(port: int = 0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
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
async def node(secret: bytes = SECRET, port: int = 0) -> AsyncIterator[Node]:
    state = State()
    sock = udp_socket(port)
    server = NodeRpcServer(sock, secret, make_service(state))
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


async def raw_stream(c: NodeRpcClient, addr: tuple[str, int], payload: bytes, end: bool = True) -> msgspec.Raw:
    """Send ``payload`` as the whole client side of a new request stream (bypassing the
    client's own checks) and wait for what the server makes of it."""
    loop = asyncio.get_running_loop()
    conn = await c._connection(addr, loop.time() + 2.0, None)
    fut: asyncio.Future[msgspec.Raw] = loop.create_future()
    call = tr._Call(0, fut)
    sid = conn._quic.get_next_available_stream_id()
    call.sid = sid
    conn.calls[sid] = call
    conn._quic.send_stream_data(sid, payload, end_stream=end)
    conn.transmit()
    return await asyncio.wait_for(fut, 5.0)


def request_frame(msg: msgspec.Struct, rid: int = 0) -> bytes:
    return tr.encode_frame(tr.REQ, rid, msgspec.msgpack.encode(msg))


# -- tests --------------------------------------------------------------------------------------


def test_round_trip() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            r = await c.call(n.addr, Echo(text="hello", blob=b"\x00\xff"), EchoReply)
            assert r == EchoReply(text="hello", blob=b"\x00\xff", peer="127.0.0.1")
            r = await c.call(n.addr, Echo(text="again"), EchoReply)
            assert r.text == "again"
            assert c.dials == 1 and n.server.handshakes == 1
            # the caller's socket is left open and bound
            assert n.sock.fileno() != -1

    run(main())


def test_200_concurrent_calls_share_one_connection() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            replies = await asyncio.gather(*(c.call(n.addr, Echo(text=str(i)), EchoReply) for i in range(200)))
            assert [r.text for r in replies] == [str(i) for i in range(200)]
            assert c.dials == 1
            assert n.server.handshakes == 1 and n.server.connections == 1
            assert n.state.calls == 200

    run(main())


def test_10_mib_request_and_reply() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            blob = bytes(range(256)) * (10 * 4096)  # 10 MiB
            r = await c.call(n.addr, Echo(text="big", blob=blob), EchoReply, timeout=10.0)
            assert r.blob == blob

    run(main(), timeout=20.0)


def test_frames_over_16_mib_are_refused() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            # the client refuses to send one
            with pytest.raises(PayloadTooLarge):
                await c.call(n.addr, Echo(text="x", blob=b"x" * (MAX_FRAME + 1)), EchoReply)
            # the server refuses one announced by the length prefix, before reading it
            conn = await c._connection(n.addr, asyncio.get_running_loop().time() + 2, None)
            head = conn.proof_c + struct.pack(">I", MAX_FRAME + 1)
            with pytest.raises(PayloadTooLarge):
                await raw_stream(c, n.addr, head + b"x" * 100_000, end=False)
            # a reply over the limit becomes a 500, not a broken stream
            with pytest.raises(InternalError) as ei:
                await c.call(n.addr, Huge(size=MAX_FRAME + 1), EchoReply, timeout=10.0)
            assert ei.value.status == 500 and "limit" in ei.value.message
            assert n.state.calls == 1  # only Huge ran
            # the connection is still fine
            assert (await c.call(n.addr, Echo(text="ok"), EchoReply)).text == "ok"
            assert c.dials == 1

    run(main(), timeout=20.0)


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

    run(main())


def test_timeout_resets_the_stream_and_cancels_the_handler() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            t0 = time.monotonic()
            with pytest.raises(GatewayTimeout, match="no answer from node"):
                await c.call(n.addr, Hang(), EchoReply, timeout=0.3)
            assert time.monotonic() - t0 < 1.0
            assert n.state.hang_started.is_set()
            await asyncio.wait_for(n.state.hang_cancelled.wait(), 2.0)
            # the connection survives (the liveness PING is answered)
            assert (await c.call(n.addr, Echo(text="after"), EchoReply)).text == "after"
            assert c.dials == 1

    run(main())


def test_wrong_secret_on_the_client_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="narad.cluster.transport")

    async def main() -> None:
        async with node() as n, client(b"not-the-secret") as c:
            for _ in range(3):
                t0 = time.monotonic()
                with pytest.raises(BadGateway) as ei:
                    await c.call(n.addr, Echo(text="let me in"), EchoReply)
                assert ei.value.code == "cluster_auth"
                assert time.monotonic() - t0 < 1.0
            assert n.state.calls == 0

    run(main())
    rejected = [r for r in caplog.records if "cluster stream rejected: invalid auth" in r.getMessage()]
    assert len(rejected) == 1  # at most once per 10 s per peer


def test_wrong_secret_on_the_server_is_rejected_by_the_client() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            n.server._proof_secret = b"impostor"  # accepts our proof, answers with a wrong one
            with pytest.raises(BadGateway) as ei:
                await c.call(n.addr, Echo(text="who are you"), EchoReply)
            assert ei.value.code == "cluster_auth"

    run(main())


def test_ekm_equal_on_both_ends_and_distinct_per_connection() -> None:
    async def main() -> None:
        async with node() as n, client() as c1, client() as c2:
            await c1.call(n.addr, Echo(text="1"), EchoReply)
            await c2.call(n.addr, Echo(text="2"), EchoReply)
            e1, e2 = c1.connection_ekm(n.addr), c2.connection_ekm(n.addr)
            assert e1 is not None and e2 is not None and len(e1) == len(e2) == 32
            assert e1 != e2
            assert sorted(n.server.peer_ekms()) == sorted([e1, e2])
            # a proof relayed from another session fails: c1's proof on c2's connection
            conn1 = c1._peers[n.addr].conn
            assert conn1 is not None
            calls = n.state.calls
            with pytest.raises(BadGateway) as ei:
                await raw_stream(c2, n.addr, conn1.proof_c + request_frame(Echo(text="relayed")))
            assert ei.value.code == "cluster_auth"
            assert n.state.calls == calls

    run(main())


def test_exporter_is_rfc8446_shaped() -> None:
    """TLS-Exporter(label, ctx, L) = HKDF-Expand-Label(Derive-Secret(S, label, ""), "exporter", Hash(ctx), L)."""
    from cryptography.hazmat.primitives import hashes, hmac
    from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

    def expand_label(secret: bytes, label: bytes, ctx: bytes, n: int) -> bytes:
        full = b"tls13 " + label
        info = struct.pack("!HB", n, len(full)) + full + bytes([len(ctx)]) + ctx
        return HKDFExpand(hashes.SHA256(), n, info).derive(secret)

    def sha256(b: bytes) -> bytes:
        h = hashes.Hash(hashes.SHA256())
        h.update(b)
        return h.finalize()

    master = bytes(range(32))
    expected = expand_label(expand_label(master, b"narad-cluster-auth-v1", sha256(b""), 32), b"exporter",
                            sha256(b"ctx"), 32)
    assert tr.tls_exporter(hashes.SHA256(), master, b"narad-cluster-auth-v1", b"ctx", 32) == expected
    h = hmac.HMAC(b"k", hashes.SHA256())  # the proofs are plain HMAC-SHA256
    h.update(b"client" + expected)
    assert tr._proof(b"k", b"client", expected) == h.finalize()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
@pytest.mark.parametrize("suite", ["TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384"])
def test_exporter_matches_openssl(suite: str, tmp_path: Path) -> None:
    """The EKM captured from aioquic's key schedule equals OpenSSL's SSL_export_keying_material:
    aioquic's tls.Context (hooked as the transport hooks it) runs a TLS 1.3 handshake over TCP,
    through a minimal record layer, against ``openssl s_server -keymatexport``."""
    from aioquic import tls
    from aioquic.buffer import Buffer
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    cert, key = tr._node_identity()
    (tmp_path / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    srv = subprocess.Popen(
        ["openssl", "s_server", "-accept", f"127.0.0.1:{port}", "-tls1_3", "-ciphersuites", suite, "-naccept", "1",
         "-cert", str(tmp_path / "c.pem"), "-key", str(tmp_path / "k.pem"),
         "-keymatexport", tr.EKM_LABEL.decode(), "-keymatexportlen", "32"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # EOF on stdin stops it
    try:
        def connect() -> socket.socket | None:
            try:
                return socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                return None

        s = wait_for(connect, 5, 0.02, "openssl s_server listening")
        ctx = tls.Context(is_client=True, verify_mode=ssl.CERT_NONE,
                          cipher_suites=[tls.CipherSuite[suite.removeprefix("TLS_")]])
        ours: list[bytes] = []

        class FakeQuic:  # what _hook_exporter wraps: _initialize() creating self.tls
            def _initialize(self, peer_cid: bytes) -> None:
                self.tls = ctx

        fake = FakeQuic()
        tr._hook_exporter(fake, ours.append)  # type: ignore[arg-type]
        fake._initialize(b"")
        keys: dict[Any, list[Any]] = {}

        def on_key(direction: Any, epoch: Any, cs: Any, secret: bytes) -> None:
            alg = tls.cipher_suite_hash(cs)
            n = 32 if cs == tls.CipherSuite.AES_256_GCM_SHA384 else 16
            keys[(direction, epoch)] = keys["rx" if direction == tls.Direction.DECRYPT else "tx"] = [
                AESGCM(tls.hkdf_expand_label(alg, secret, b"key", b"", n)),
                tls.hkdf_expand_label(alg, secret, b"iv", b"", 12), 0]

        ctx.update_traffic_key_cb = on_key

        def nonce(k: list[Any]) -> bytes:
            return bytes(a ^ b for a, b in zip(k[1], k[2].to_bytes(12, "big"), strict=True))

        def step(data: bytes) -> None:
            out = {e: Buffer(capacity=16384) for e in (tls.Epoch.INITIAL, tls.Epoch.HANDSHAKE, tls.Epoch.ONE_RTT)}
            ctx.handle_message(data, out)
            for epoch, buf in out.items():
                if not buf.data:
                    continue
                if epoch == tls.Epoch.INITIAL:
                    s.sendall(struct.pack("!BHH", 22, 0x0301, len(buf.data)) + buf.data)
                    continue
                k = keys[(tls.Direction.ENCRYPT, epoch)]
                hdr = struct.pack("!BHH", 23, 0x0303, len(buf.data) + 17)
                s.sendall(hdr + k[0].encrypt(nonce(k), buf.data + b"\x16", hdr))
                k[2] += 1

        step(b"")
        rx = b""
        while ctx.state != tls.State.CLIENT_POST_HANDSHAKE:
            chunk = s.recv(65536)
            assert chunk, srv.communicate(timeout=5)[0].decode(errors="replace")
            rx += chunk
            while len(rx) >= 5 and len(rx) >= 5 + struct.unpack("!H", rx[3:5])[0]:
                typ, _, n = struct.unpack("!BHH", rx[:5])
                hdr, body, rx = rx[:5], rx[5 : 5 + n], rx[5 + n :]
                if typ == 23:
                    k = keys["rx"]
                    plain = k[0].decrypt(nonce(k), body, hdr).rstrip(b"\x00")
                    k[2] += 1
                    typ, body = plain[-1], plain[:-1]
                if typ == 22:
                    step(body)
        s.close()
        out, _ = srv.communicate(timeout=5)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    m = re.search(rb"Keying material: ([0-9A-Fa-f]+)", out)
    assert m, out.decode(errors="replace")
    assert ours == [bytes.fromhex(m.group(1).decode())]


def test_malformed_stream_costs_only_that_stream() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            conn = await c._connection(n.addr, asyncio.get_running_loop().time() + 2, None)
            for junk in (b"", b"short", conn.proof_c + b"\x00\x00",
                         conn.proof_c + struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1"):
                with pytest.raises(BadGateway):
                    await raw_stream(c, n.addr, junk)
            assert n.state.calls == 0
            assert (await c.call(n.addr, Echo(text="still here"), EchoReply)).text == "still here"
            assert c.dials == 1

    run(main())


def test_server_restart_redials() -> None:
    async def main() -> None:
        async with client() as c:
            async with node() as n1:
                port = n1.addr[1]
                assert (await c.call(n1.addr, Echo(text="one"), EchoReply)).text == "one"
            await until(lambda: c.connections == 0)  # the server's CONNECTION_CLOSE arrived
            async with node(port=port) as n2:
                assert (await c.call(n2.addr, Echo(text="two"), EchoReply)).text == "two"
                assert c.dials == 2

    run(main())


def crash(server: NodeRpcServer, sock: socket.socket) -> None:
    """The server process dies: its socket goes away without a CONNECTION_CLOSE."""
    for conn in list(server._conns):
        conn._teardown("crash")
        if conn._timer is not None:
            conn._timer.cancel()
    assert server._transport is not None
    server._transport.close()
    sock.close()


def test_crashed_and_restarted_server_is_detected_by_stateless_reset(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="narad.cluster.transport")

    async def main() -> None:
        async with client() as c:
            state = State()
            sock1 = udp_socket()
            addr = sock1.getsockname()
            s1 = NodeRpcServer(sock1, SECRET, make_service(state))
            await s1.start()
            assert (await c.call(addr, Echo(text="one"), EchoReply)).text == "one"
            crash(s1, sock1)
            async with node(port=addr[1]) as n2:
                t0 = time.monotonic()
                with pytest.raises(BadGateway, match="connection lost"):
                    await c.call(addr, Echo(text="lost"), EchoReply)
                assert time.monotonic() - t0 < 1.0
                assert (await c.call(addr, Echo(text="two"), EchoReply)).text == "two"
                assert n2.state.calls == 1 and c.dials == 2

    run(main())
    assert any("forgot our connection" in r.getMessage() for r in caplog.records)


def test_silent_peer_is_dropped_after_an_unanswered_ping(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="narad.cluster.transport")

    async def main() -> None:
        async with client() as c:
            state = State()
            sock = udp_socket()
            addr = sock.getsockname()
            server = NodeRpcServer(sock, SECRET, make_service(state))
            await server.start()
            assert (await c.call(addr, Echo(text="one"), EchoReply)).text == "one"
            crash(server, sock)  # and nobody takes its place: no stateless reset either
            t0 = time.monotonic()
            with pytest.raises(GatewayTimeout):
                await c.call(addr, Echo(text="anyone?"), EchoReply, timeout=0.2)
            await until(lambda: c.connections == 0, timeout=3.0)
            assert 1.0 <= time.monotonic() - t0 < 2.0  # the timeout, then 1 s for the PING

    run(main())
    assert any("did not answer a PING" in r.getMessage() for r in caplog.records)


def test_idle_timeout_keepalive_and_stale_connections() -> None:
    async def main() -> None:
        state = State()
        svc = make_service(state)

        async def slow(m: Echo, peer: NodePeer) -> EchoReply:
            await asyncio.sleep(1.6)  # longer than the 1 s idle timeout, with nothing sent meanwhile
            return EchoReply(text=m.text)

        svc.register(Echo, slow)  # type: ignore[arg-type]
        sock = udp_socket()
        server = NodeRpcServer(sock, SECRET, svc, idle_timeout=1.0)
        await server.start()
        try:
            async with client(idle_timeout=1.0) as c:
                addr = sock.getsockname()
                # a call longer than the idle timeout survives: the client PINGs while it waits
                assert (await c.call(addr, Echo(text="long"), EchoReply)).text == "long"
                assert c.dials == 1
                # a quiet connection is given up before the peer's idle timeout, not used for a call
                conn = c._peers[addr].conn
                assert conn is not None
                await until(lambda: conn.stale)
                assert (await c.call(addr, Echo(text="again"), EchoReply)).text == "again"
                assert c.dials == 2
        finally:
            await server.close(grace=0.2)
            sock.close()

    run(main())


def test_unreachable_node_fails_fast_during_backoff() -> None:
    async def main() -> None:
        silent = udp_socket()  # bound, never answers
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

    run(main())


def test_notify_delivers_one_way_messages() -> None:
    async def main() -> None:
        async with node() as n, client() as c:
            c.notify(n.addr, Note(n=1))  # no connection yet: dials in the background
            assert await asyncio.wait_for(n.state.notes.get(), 3.0) == 1
            c.notify(n.addr, Note(n=2))  # on the existing connection
            assert await asyncio.wait_for(n.state.notes.get(), 3.0) == 2
            assert c.dials == 1
        async with node() as n, client(b"wrong") as c:
            c.notify(n.addr, Note(n=3))  # authenticated too: dropped by the server
            await until(lambda: c.connections == 1 and not c._notes)
            assert (await asyncio.gather(c.call(n.addr, Echo(text="x"), EchoReply),
                                         return_exceptions=True))[0].code == "cluster_auth"
            assert n.state.notes.empty() and n.state.calls == 0

    run(main())


def test_close_lets_running_handlers_answer() -> None:
    async def main() -> None:
        state = State()
        svc = make_service(state)
        release = asyncio.Event()

        async def slow(m: Echo, peer: NodePeer) -> EchoReply:
            state.hang_started.set()
            await release.wait()
            return EchoReply(text=m.text)

        svc.register(Echo, slow)  # type: ignore[arg-type]
        sock = udp_socket()
        server = NodeRpcServer(sock, SECRET, svc)
        await server.start()
        async with client() as c:
            call = asyncio.ensure_future(c.call(sock.getsockname(), Echo(text="in flight"), EchoReply))
            await asyncio.wait_for(state.hang_started.wait(), 2.0)
            closing = asyncio.ensure_future(server.close(grace=2.0))
            await asyncio.sleep(0)
            release.set()
            assert (await call).text == "in flight"
            await closing
            assert server.connections == 0
        assert sock.fileno() != -1
        sock.close()

    run(main())
