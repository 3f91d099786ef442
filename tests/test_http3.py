"""Tests for the HTTP/3 transport (narad.api.http3) and its client (narad.client.h3).

Each test runs a real QUIC server on 127.0.0.1 under uvloop, with a self-signed
EC P-256 certificate made in tmp_path and a tiny App defined here.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import uvloop
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from narad.api.hangup import cancel_on_hangup
from narad.api.http3 import Http3Limits, Http3Server
from narad.api.router import Request, Response, json_response
from narad.api.router import error_response as router_error_response
from narad.client.h3 import H3Client, H3StreamError
from narad.errors import NaradError

Certs = tuple[str, str]


# -- fixtures and helpers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d: Path = tmp_path_factory.mktemp("h3certs")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = d / "cert.pem", d / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_file), str(key_file)


def udp_socket(port: int = 0, *, reuse_port: bool = False) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if reuse_port:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    return s


def run(coro: Coroutine[Any, Any, None], timeout: float = 15.0) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(coro, timeout)

    uvloop.run(bounded())


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


class EchoApp:
    """Routes: /sleep?s=N, /poll?s=N (a sleep that opts in to hang-up cancellation, as the
    long-poll consume does), /error (raises), /nocontent (204), anything else echoes the
    request. ``finished`` / ``dropped``: sleeps that ran to their end / whose answer the
    transport dropped (``Response.on_dropped``)."""

    def __init__(self, name: str = "a") -> None:
        self.name = name
        self.in_flight = 0
        self.handled = 0
        self.finished = 0
        self.dropped = 0

    def _dropped(self) -> None:
        self.dropped += 1

    def body_limit(self, method: str, path: str) -> tuple[int, int]:
        if path == "/small":
            return 100, 413
        if path == "/small400":
            return 100, 400
        return 1 << 20, 413

    def error_response(self, err: NaradError) -> Response:
        return router_error_response(err)

    async def handle(self, req: Request) -> Response:
        self.handled += 1
        if req.path in ("/sleep", "/poll"):
            if req.path == "/poll":
                cancel_on_hangup()
            self.in_flight += 1
            try:
                await asyncio.sleep(float(req.q1("s") or "0.5"))
            finally:
                self.in_flight -= 1
            self.finished += 1
            resp = json_response(200, {"slept": True})
            resp.on_dropped = self._dropped
            return resp
        if req.path == "/error":
            raise RuntimeError("boom")
        if req.path == "/nocontent":
            return Response(204, b"", None)
        return json_response(
            200,
            {
                "method": req.method,
                "path": req.path,
                "query": req.query,
                "headers": req.headers,
                "body": req.body.decode("latin-1"),
                "client": req.client,
                "transport": req.transport,
                "server": self.name,
            },
            headers=[("X-Served-By", self.name)],
        )


@asynccontextmanager
async def serving(
    app: EchoApp, certs: Certs, limits: Http3Limits | None = None, sock: socket.socket | None = None
) -> AsyncIterator[tuple[Http3Server, int]]:
    own = sock is None
    s = sock if sock is not None else udp_socket()
    srv = Http3Server(app, s, certs[0], certs[1], limits or Http3Limits())
    await srv.start()
    try:
        yield srv, s.getsockname()[1]
    finally:
        await srv.drain(0)
        if own:
            s.close()


@asynccontextmanager
async def client(port: int) -> AsyncIterator[H3Client]:
    c = await H3Client.connect("127.0.0.1", port)
    try:
        yield c
    finally:
        await c.close()


async def raw_request(c: H3Client, method: str, path: str | None, chunks: list[bytes], *, fin: bool = True,
                      extra: list[tuple[bytes, bytes]] | None = None) -> Awaitable[tuple[int, dict[str, str], bytes]]:
    """A request sent piecewise through the client's internals: no content-length,
    the body in several DATA frames, optionally without ending the stream."""
    from narad.client.h3 import _Pending

    proto = c._proto
    sid = proto._quic.get_next_available_stream_id()
    fut: asyncio.Future[tuple[int, dict[str, str], bytes]] = asyncio.get_running_loop().create_future()
    proto.pending[sid] = _Pending(fut)
    headers = [(b":method", method.encode()), (b":authority", b"localhost")]
    if path is not None:
        headers += [(b":scheme", b"https"), (b":path", path.encode())]
    headers += extra or []
    proto.h3.send_headers(sid, headers, end_stream=False)
    for i, chunk in enumerate(chunks):
        proto.h3.send_data(sid, chunk, end_stream=fin and i == len(chunks) - 1)
        proto.transmit()
    if fin and not chunks:
        proto.h3.send_data(sid, b"", end_stream=True)
    proto.transmit()
    return fut


# -- tests --------------------------------------------------------------------------------------


def test_get_and_post_round_trip(certs: Certs) -> None:
    async def main() -> None:
        async with serving(EchoApp(), certs) as (_, port), client(port) as c:
            status, headers, body = await c.request(
                "GET", "/echo/a%20b?x=1&x=2&empty=&q=%C3%A9", headers={"X-Test": "v1", "Accept": "*/*"}
            )
            assert status == 200
            assert headers["content-type"] == "application/json"
            assert headers["content-length"] == str(len(body))
            assert headers["x-served-by"] == "a"
            got = json.loads(body)
            assert got["method"] == "GET"
            assert got["path"] == "/echo/a b"
            assert got["query"] == {"x": ["1", "2"], "empty": [""], "q": ["é"]}
            assert got["headers"]["x-test"] == "v1"
            assert got["headers"]["accept"] == "*/*"
            assert got["transport"] == "h3"
            assert got["client"] == "127.0.0.1"
            assert got["body"] == ""

            payload = b'{"hello": "world"}' * 100
            status, headers, body = await c.request(
                "POST", "/echo/post?k=v", headers={"Content-Type": "application/json"}, body=payload
            )
            assert status == 200
            got = json.loads(body)
            assert got["method"] == "POST"
            assert got["query"] == {"k": ["v"]}
            assert got["body"] == payload.decode()
            assert got["headers"]["content-type"] == "application/json"
            assert got["headers"]["content-length"] == str(len(payload))

            # a body in several DATA frames without content-length; repeated headers joined
            fut = await raw_request(c, "PUT", "/echo/chunks", [b"ab", b"cd", b"ef"],
                                    extra=[(b"x-rep", b"1"), (b"x-rep", b"2")])
            status, _, body = await asyncio.wait_for(fut, 5)
            got = json.loads(body)
            assert (status, got["method"], got["body"]) == (200, "PUT", "abcdef")
            assert got["headers"]["x-rep"] == "1, 2"

    run(main())


def test_concurrent_requests_on_one_connection(certs: Certs) -> None:
    async def main() -> None:
        async with serving(EchoApp(), certs) as (srv, port), client(port) as c:
            async def one(i: int) -> None:
                status, _, body = await c.request("POST", f"/echo/{i}?i={i}", body=f"body-{i}".encode() * (i + 1))
                got = json.loads(body)
                assert status == 200
                assert got["path"] == f"/echo/{i}"
                assert got["query"] == {"i": [str(i)]}
                assert got["body"] == f"body-{i}" * (i + 1)

            await asyncio.gather(*(one(i) for i in range(20)))
            await wait_until(lambda: srv.active_requests == 0, what="streams released")
            assert all(not conn._streams for conn in srv._conns)  # no per-stream state left behind

    run(main())


def test_body_limits(certs: Certs) -> None:
    async def main() -> None:
        async with serving(EchoApp(), certs) as (_, port), client(port) as c:
            status, _, body = await c.request("POST", "/small", body=b"x" * 100)
            assert status == 200
            # declared content-length over the limit
            status, _, body = await c.request("POST", "/small", body=b"x" * 101)
            assert status == 413
            assert json.loads(body) == {"error": "request body too large"}
            status, _, body = await c.request("POST", "/small400", body=b"x" * 5000)
            assert status == 400
            assert json.loads(body) == {"error": "request body too large"}
            # no content-length: the running DATA total trips the limit
            fut = await raw_request(c, "POST", "/small", [b"y" * 60, b"y" * 60, b"y" * 60])
            status, _, body = await asyncio.wait_for(fut, 5)
            assert status == 413
            # a big body over the limit, then the connection still serves
            status, _, _ = await c.request("POST", "/small", body=b"z" * 300_000)
            assert status == 413
            status, _, _ = await c.request("GET", "/echo/after")
            assert status == 200

    run(main())


def test_head_no_content_and_handler_error(certs: Certs) -> None:
    async def main() -> None:
        async with serving(EchoApp(), certs) as (_, port), client(port) as c:
            status, headers, body = await c.request("HEAD", "/echo/head")
            assert status == 200
            assert body == b""
            assert headers["content-type"] == "application/json"
            assert "content-length" not in headers
            status, headers, body = await c.request("GET", "/nocontent")
            assert (status, body) == (204, b"")
            assert "content-length" not in headers
            status, headers, body = await c.request("GET", "/error")
            assert status == 500
            assert json.loads(body)["error"].startswith("internal error")
            status, _, _ = await c.request("GET", "/echo/still-alive")
            assert status == 200

    run(main())


def test_header_limit_and_read_timeout(certs: Certs) -> None:
    async def main() -> None:
        limits = Http3Limits(max_header_bytes=4096, read_timeout=0.3)
        async with serving(EchoApp(), certs, limits) as (srv, port), client(port) as c:
            # one header block of 8 KiB: refused as soon as the frame length is known
            status, _, body = await c.request("GET", "/echo/big", headers={"x-big": "v" * 8000})
            assert status == 431
            assert body == b"431 Request Header Fields Too Large"
            # many small headers: within the frame size thanks to QPACK, over the decoded limit
            many = {f"x-h{i}": "v" * 40 for i in range(60)}
            status, _, _ = await c.request("GET", "/echo/many", headers=many)
            assert status == 431
            # a body that never ends: 408 after read_timeout
            fut = await raw_request(c, "POST", "/echo/slow", [b"partial"], fin=False)
            status, _, body = await asyncio.wait_for(fut, 5)
            assert status == 408
            status, _, _ = await c.request("GET", "/echo/ok")
            assert status == 200
            await wait_until(lambda: srv.active_requests == 0, what="streams released")

    run(main())


def test_client_giving_up_and_malformed_requests(certs: Certs) -> None:
    async def main() -> None:
        app = EchoApp()
        async with serving(app, certs) as (srv, port), client(port) as c:
            # the client times out on a long poll: its stream reset cancels the (opted-in) handler
            with pytest.raises(TimeoutError):
                await c.request("GET", "/poll?s=30", timeout=0.3)
            await wait_until(lambda: app.in_flight == 0 and srv.active_requests == 0, what="handler cancelled")
            assert (app.finished, app.dropped) == (0, 0)
            # any other handler runs to its end, as over HTTP/1.1 (a produce or a redrive cut
            # between its steps would leave duplicates), and its answer is dropped
            with pytest.raises(TimeoutError):
                await c.request("GET", "/sleep?s=0.5", timeout=0.05)
            await wait_until(lambda: app.finished == 1 and app.dropped == 1, what="the handler ran to its end")
            # the same when the client closes its connection mid-request
            async with client(port) as c2:
                c2_req = asyncio.create_task(c2.request("GET", "/sleep?s=0.5", timeout=5))
                await wait_until(lambda: app.in_flight == 1, what="the request in flight")
            with pytest.raises((ConnectionError, H3StreamError, asyncio.CancelledError)):
                await c2_req
            await wait_until(lambda: app.finished == 2 and app.dropped == 2, what="ran to its end after a close")
            await wait_until(lambda: not srv._detached, what="no handler left held")
            # a half-sent request abandoned by the client leaves nothing behind
            fut = await raw_request(c, "POST", "/echo/abandoned", [b"part"], fin=False)
            await wait_until(lambda: srv.active_requests == 1, what="partial request seen")
            sid = next(iter(c._proto.pending))
            c._proto.pending.pop(sid)
            c._proto._quic.reset_stream(sid, 0x10C)
            c._proto.transmit()
            await wait_until(lambda: srv.active_requests == 0, what="abandoned stream dropped")
            assert not fut.done()
            # no :path -> 400, and the connection keeps serving
            fut = await raw_request(c, "GET", None, [])
            status, _, body = await asyncio.wait_for(fut, 5)
            assert status == 400
            assert json.loads(body) == {"error": "missing :method or :path"}
            status, _, _ = await c.request("GET", "/echo/ok")
            assert status == 200

    run(main())


def test_streams_reset_by_the_client_alone_give_their_slot_back(certs: Certs) -> None:
    """A client that resets only its sending side of a half-sent request (no
    STOP_SENDING): the server drops the stream and resets its own side, so the stream
    completes and the client's stream limit gets the slot back. 130 such streams on
    one connection (more than the 128 the server allows open at once), then a request
    on the same connection is answered."""
    async def main() -> None:
        app = EchoApp()
        async with serving(app, certs) as (srv, port), client(port) as c:
            for _ in range(130):
                await raw_request(c, "POST", "/echo/abandoned", [b"part"], fin=False)
                sid = max(c._proto.pending)
                c._proto.pending.pop(sid)
                c._proto._quic.reset_stream(sid, 0x10C)  # H3_REQUEST_CANCELLED, our side only
                c._proto.transmit()
                await asyncio.sleep(0.002)
            await wait_until(lambda: srv.active_requests == 0, what="abandoned streams dropped")
            status, _, _ = await c.request("GET", "/echo/after", timeout=5)
            assert status == 200
            # a request the client cannot encode (a header value QPACK refuses) fails alone
            with pytest.raises(ValueError):
                await c.request("GET", "/echo/big", headers={"x-big": "a" * 70_000}, timeout=5)
            assert (await c.request("GET", "/echo/after-big", timeout=5))[0] == 200
            # and a :path that is not origin form is a 400, the connection still serving
            fut = await raw_request(c, "GET", "healthz", [])
            status, _, body = await asyncio.wait_for(fut, 5)
            assert (status, json.loads(body)) == (400, {"error": ':path must start with "/"'})
            assert (await c.request("GET", "/echo/ok"))[0] == 200

    run(main(), timeout=60)


def test_connections_over_the_cap_are_refused(certs: Certs) -> None:
    async def main() -> None:
        app = EchoApp()
        async with serving(app, certs, Http3Limits(max_connections=2)) as (srv, port), \
                client(port) as a, client(port) as b:
            assert srv.connections == 2
            with pytest.raises((ConnectionError, TimeoutError)):
                extra = await H3Client.connect("127.0.0.1", port, timeout=2)
                await extra.close()
            assert (await a.request("GET", "/echo/a"))[0] == 200  # the ones held keep serving
            await b.close()
            await wait_until(lambda: srv.connections < 2, what="a slot given back")
            async with client(port) as c:
                assert (await c.request("GET", "/echo/c"))[0] == 200

    run(main(), timeout=30)


def test_a_peer_that_takes_no_answer_bytes_is_cut_off(certs: Certs) -> None:
    """A client that grants no flow-control credit (tiny windows, never raised) but
    keeps its connection alive with pings: its answers would sit in the server's
    memory for as long as it pings. After idle_timeout without progress the server
    closes the connection; other clients are served meanwhile."""
    import ssl

    from aioquic.asyncio.client import connect
    from aioquic.h3.connection import H3_ALPN
    from aioquic.quic.configuration import QuicConfiguration

    from narad.client.h3 import _ClientProtocol

    async def main() -> None:
        app = EchoApp()
        async with serving(app, certs, Http3Limits(idle_timeout=2.0)) as (srv, port):
            cfg = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, verify_mode=ssl.CERT_NONE,
                                    server_name="localhost", max_data=2000, max_stream_data=1000)
            async with connect("127.0.0.1", port, configuration=cfg, create_protocol=_ClientProtocol,
                               wait_connected=True) as proto:
                q = proto._quic
                q._write_connection_limits = lambda *a, **k: None  # never grant more credit
                q._write_stream_limits = lambda *a, **k: None
                for _ in range(8):
                    sid = q.get_next_available_stream_id()
                    proto.h3.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"https"),
                                                (b":authority", b"x"), (b":path", b"/echo/big")], end_stream=False)
                    proto.h3.send_data(sid, b"y" * 50_000, end_stream=True)  # echoed back: 50 KB answers
                proto.transmit()
                await wait_until(lambda: srv.connections == 1 and app.handled == 8, what="requests handled")

                async def ping() -> None:
                    while True:
                        q.send_ping(1)
                        proto.transmit()
                        await asyncio.sleep(0.5)

                pinger = asyncio.create_task(ping())
                try:
                    async with client(port) as other:  # served meanwhile
                        assert (await other.request("GET", "/echo/other"))[0] == 200
                    await wait_until(lambda: srv.connections == 0, timeout=10, what="stalled connection closed")
                finally:
                    pinger.cancel()

    run(main(), timeout=40)


def test_the_client_checks_the_certificate_against_a_given_ca_file(certs: Certs) -> None:
    """``verify`` a path: the server's certificate is checked against that PEM file (here
    the self-signed certificate itself); True (the default CAs) refuses it."""
    async def main() -> None:
        async with serving(EchoApp(), certs) as (_srv, port):
            c = await H3Client.connect("127.0.0.1", port, verify=certs[0], server_name="localhost", timeout=5)
            try:
                assert (await c.request("GET", "/echo/ca"))[0] == 200
            finally:
                await c.close()
            with pytest.raises((ConnectionError, TimeoutError)):
                bad = await H3Client.connect("127.0.0.1", port, verify=True, server_name="localhost", timeout=3)
                await bad.close()

    run(main(), timeout=30)


def test_garbage_datagrams_do_not_hurt(certs: Certs) -> None:
    async def main() -> None:
        async with serving(EchoApp(), certs) as (_, port):
            junk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                for size in (1, 20, 1200, 1500):
                    junk.sendto(os.urandom(size), ("127.0.0.1", port))
                junk.sendto(b"\xc0\x00\x00\x00\x01" + os.urandom(1300), ("127.0.0.1", port))  # fake Initial
            finally:
                junk.close()
            async with client(port) as c:
                status, _, _ = await c.request("GET", "/echo/x")
                assert status == 200

    run(main())


def test_drain_lets_in_flight_request_finish(certs: Certs) -> None:
    async def main() -> None:
        app = EchoApp()
        async with serving(app, certs) as (srv, port), client(port) as c:
            slow = asyncio.create_task(c.request("GET", "/sleep?s=1.5"))
            await wait_until(lambda: app.in_flight == 1, what="slow request in flight")
            drain = asyncio.create_task(srv.drain(grace=5.0))
            await wait_until(lambda: srv._draining, what="drain started")
            # GOAWAY sent: a new stream on the old connection is refused, not processed
            with pytest.raises(H3StreamError) as err:
                await c.request("GET", "/echo/late", timeout=3)
            assert err.value.error_code == 0x10B  # H3_REQUEST_REJECTED
            # new connections are refused while draining
            with pytest.raises((ConnectionError, TimeoutError)):
                extra = await H3Client.connect("127.0.0.1", port, timeout=2)
                await extra.close()
            assert not drain.done()
            status, _, body = await slow
            assert (status, json.loads(body)) == (200, {"slept": True})
            await asyncio.wait_for(drain, 5)
            assert srv.connections == 0
            assert app.handled == 1

    run(main())


def test_drain_cancels_after_grace(certs: Certs) -> None:
    async def main() -> None:
        app = EchoApp()
        async with serving(app, certs) as (srv, port), client(port) as c:
            slow = asyncio.create_task(c.request("GET", "/sleep?s=30", timeout=10))
            await wait_until(lambda: app.in_flight == 1, what="slow request in flight")
            await asyncio.wait_for(srv.drain(grace=0.2), 3)
            await wait_until(lambda: app.in_flight == 0, what="handler cancelled")
            with pytest.raises(ConnectionError):
                await slow

    run(main())


def test_two_servers_share_a_port_with_reuseport(certs: Certs) -> None:
    async def main() -> None:
        s1 = udp_socket(reuse_port=True)
        port = s1.getsockname()[1]
        s2 = udp_socket(port, reuse_port=True)
        app_a, app_b = EchoApp("a"), EchoApp("b")
        try:
            async with serving(app_a, certs, sock=s1), serving(app_b, certs, sock=s2):
                async def one_client(i: int) -> str:
                    async with client(port) as c:
                        seen = set()
                        for j in range(3):
                            status, headers, body = await c.request("GET", f"/echo/{i}/{j}")
                            assert status == 200
                            assert json.loads(body)["path"] == f"/echo/{i}/{j}"
                            seen.add(headers["x-served-by"])
                        assert len(seen) == 1  # a connection stays on one server
                        return seen.pop()

                served = await asyncio.gather(*(one_client(i) for i in range(16)))
                assert len(served) == 16
                # the kernel spreads 16 client ports over both sockets (all on one: p = 2**-15)
                assert set(served) == {"a", "b"}
                assert app_a.handled + app_b.handled == 48
            assert s1.fileno() != -1 and s2.fileno() != -1  # the servers never close the caller's sockets
        finally:
            s1.close()
            s2.close()

    run(main())
