"""Tests for narad.api.http1: a real Http1Server on 127.0.0.1 (event loop in a
background thread) driven by http.client and raw sockets."""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
import uvloop

from narad.api.http1 import Http1Limits, Http1Server
from narad.api.router import Request, Response
from narad.errors import NaradError

DEADLINE = 5.0  # seconds any awaited condition may take before the test fails


class DemoApp:
    """A tiny App: echo, sleep, inspect, 204, crash."""

    def __init__(self) -> None:
        self.started = 0
        self.finished = 0

    def body_limit(self, method: str, path: str) -> tuple[int, int]:
        if path == "/limited400":
            return 16, 400
        return 1024, 413

    async def handle(self, req: Request) -> Response:
        self.started += 1
        try:
            p = req.path
            ident = [("X-Id", req.q1("id") or "")]
            if p in ("/echo", "/limited400"):
                return Response(200, req.body, "application/octet-stream", [("X-Method", req.method), *ident])
            if p == "/sleep":
                await asyncio.sleep(int(req.q1("ms") or "0") / 1000)
                return Response(200, b"slept", "text/plain", ident)
            if p.startswith("/inspect"):
                out = {"method": req.method, "path": req.path, "query": req.query, "headers": req.headers,
                       "client": req.client, "transport": req.transport, "body": req.body.decode()}
                return Response(200, json.dumps(out).encode())
            if p == "/big":
                return Response(200, b"b" * int(req.q1("size") or "0"), "application/octet-stream", ident)
            if p == "/hello":
                return Response(200, b"hello world", "text/plain")
            if p == "/nocontent":
                return Response(204, b"must not be sent", None)
            if p == "/boom":
                raise RuntimeError("boom")
            return Response(404, b"404 page not found\n", "text/plain; charset=utf-8")
        finally:
            self.finished += 1

    def error_response(self, err: NaradError) -> Response:
        return Response(err.status, json.dumps(err.body()).encode(), "application/json", list(err.headers))


class Harness:
    """An Http1Server on an ephemeral port, its loop running in a daemon thread."""

    def __init__(self, limits: Http1Limits, app: DemoApp, loop_kind: str) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port: int = self.sock.getsockname()[1]
        self.loop = uvloop.new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = Http1Server(app, self.sock, limits)
        self.call(self.server.start())

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = DEADLINE) -> Any:
        return self.submit(coro).result(timeout)

    def open_connections(self) -> int:
        async def get() -> int:
            return self.server.open_connections

        return int(self.call(get()))

    def close(self) -> None:
        try:
            self.call(self.server.drain(0.0))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(DEADLINE)
            self.loop.close()
            self.sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(loop_kind: str = "uvloop", app: DemoApp | None = None, **limits: Any) -> Harness:
        h = Harness(Http1Limits(**limits), app or DemoApp(), loop_kind)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def wait_until(cond: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.01)


def stays(cond: Callable[[], bool], what: str, seconds: float) -> None:
    """Absence check: ``cond`` holds for the whole of ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert cond(), f"no longer true: {what}"
        time.sleep(0.01)


class Raw:
    """A raw-socket HTTP/1.1 client that reads responses off one byte stream."""

    opened: list[Raw] = []  # closed after each test by the close_clients fixture

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
        self.buf = b""
        Raw.opened.append(self)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise EOFError("server closed the connection")
        self.buf += chunk

    def response(self, head: bool = False) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        top, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = top.decode("latin-1").split("\r\n")
        version, status, _ = lines[0].split(" ", 2)
        assert version == "HTTP/1.1"
        headers: dict[str, str] = {}
        for ln in lines[1:]:
            k, v = ln.split(":", 1)
            assert k.lower() not in headers, f"duplicate header {k}"
            headers[k.lower()] = v.strip()
        code = int(status)
        n = 0 if head or code < 200 or code in (204, 304) else int(headers["content-length"])
        while len(self.buf) < n:
            self._fill()
        body, self.buf = self.buf[:n], self.buf[n:]
        return code, headers, body

    def closed_by_server(self, timeout: float = DEADLINE) -> bool:
        """True once the server closes (EOF or reset) with no further bytes sent."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
        finally:
            self.sock.settimeout(DEADLINE)
        assert data == b"", f"unexpected bytes {data[:80]!r}"
        return True

    def silent_for(self, seconds: float) -> bool:
        """True if nothing at all (no byte, no close) arrives for ``seconds`` (an absence check)."""
        self.sock.settimeout(seconds)
        try:
            self.sock.recv(1)
        except TimeoutError:
            return True
        except OSError:
            return False
        finally:
            self.sock.settimeout(DEADLINE)
        return False

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(autouse=True)
def close_clients() -> Iterator[None]:
    yield
    while Raw.opened:
        Raw.opened.pop().close()


def get(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: t\r\n{extra}\r\n".encode()


# ---- round trips --------------------------------------------------------------


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_get_post_keepalive_reuses_one_connection(serve: Callable[..., Harness], loop_kind: str) -> None:
    h = serve(loop_kind)
    conn = http.client.HTTPConnection("127.0.0.1", h.port, timeout=DEADLINE)
    conn.request("GET", "/hello")
    r = conn.getresponse()
    assert (r.status, r.reason, r.read()) == (200, "OK", b"hello world")
    assert r.getheader("Content-Type") == "text/plain"
    first_sock = conn.sock
    for i in range(5):
        body = f"payload {i}".encode() * 10
        conn.request("POST", f"/echo?id={i}", body=body, headers={"Content-Type": "application/octet-stream"})
        r = conn.getresponse()
        assert r.status == 200
        assert r.read() == body
        assert r.getheader("X-Method") == "POST"
        assert r.getheader("X-Id") == str(i)
        assert r.getheader("Content-Length") == str(len(body))
        assert r.getheader("Connection") is None
    assert conn.sock is first_sock  # kept alive: the same socket served every request
    assert h.open_connections() == 1
    conn.close()
    wait_until(lambda: h.open_connections() == 0, "server sees the close")


def test_request_fields(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(b"POST /inspect/a%20b%2Fc?x=1&x=2&y=&z=%C3%A9 HTTP/1.1\r\nHost: t\r\nX-Rep: one\r\n"
           b"x-rep: two\r\nContent-Length: 3\r\n\r\nabc")
    status, _, body = c.response()
    assert status == 200
    got = json.loads(body)
    assert got["method"] == "POST"
    assert got["path"] == "/inspect/a b/c"
    assert got["query"] == {"x": ["1", "2"], "y": [""], "z": ["é"]}
    assert got["headers"]["x-rep"] == "one, two"
    assert got["headers"]["host"] == "t"
    assert got["client"] == "127.0.0.1"
    assert got["transport"] == "h1"
    assert got["body"] == "abc"
    c.close()


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_pipelined_requests_answered_in_order(serve: Callable[..., Harness], loop_kind: str) -> None:
    h = serve(loop_kind)
    c = Raw(h.port)
    c.send(get("/sleep?ms=150&id=1") + b"POST /echo?id=2 HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\ntwo"
           + get("/sleep?ms=1&id=3") + get("/echo?id=4"))
    got = [c.response() for _ in range(4)]
    assert [r[1]["x-id"] for r in got] == ["1", "2", "3", "4"]
    assert [r[2] for r in got] == [b"slept", b"two", b"slept", b""]
    # the connection is still usable afterwards
    c.send(get("/hello"))
    assert c.response()[2] == b"hello world"
    c.close()


def test_many_pipelined_requests(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    n = 300
    c.send(b"".join(get(f"/echo?id={i}") for i in range(n)))
    assert [c.response()[1]["x-id"] for _ in range(n)] == [str(i) for i in range(n)]
    c.close()


def test_half_closed_client_still_gets_answers(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(get("/sleep?ms=100&id=1") + get("/echo?id=2"))
    c.sock.shutdown(socket.SHUT_WR)
    assert [c.response()[1]["x-id"] for _ in range(2)] == ["1", "2"]
    assert c.closed_by_server()


def test_slow_reader_gets_one_response_buffered_at_a_time(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    size, n = 8 << 20, 6
    c.send(b"".join(get(f"/big?size={size}&id={i}") for i in range(n)))
    wait_until(lambda: h.app.started >= 1, "first handler ran")
    # the client reads nothing: the first response fills the socket buffers, the server stops there
    stays(lambda: h.app.started <= 2, "at most one response waits in the write buffer", 0.3)
    for i in range(n):
        status, headers, body = c.response()
        assert (status, headers["x-id"], len(body)) == (200, str(i), size)
    assert h.app.started == n
    c.close()


def test_chunked_upload(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5\r\nhello\r\n1\r\n \r\n")
    c.send(b"5\r\nworld\r\n0\r\n\r\n")
    status, headers, body = c.response()
    assert (status, body) == (200, b"hello world")
    assert headers["content-length"] == "11"
    c.send(get("/hello"))
    assert c.response()[2] == b"hello world"
    c.close()


# ---- body limits ----------------------------------------------------------------


def test_content_length_over_limit_413_and_close(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n" + b"x" * 100)
    status, headers, body = c.response()
    assert status == 413
    assert json.loads(body) == {"error": "request body too large"}
    assert headers["connection"] == "close"
    assert c.closed_by_server()
    assert h.app.started == 0  # the handler never ran


def test_content_length_over_limit_400_variant(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(b"POST /limited400 HTTP/1.1\r\nHost: t\r\nContent-Length: 17\r\n\r\n")
    status, headers, body = c.response()
    assert status == 400
    assert json.loads(body) == {"error": "request body too large"}
    assert headers["connection"] == "close"
    assert c.closed_by_server()
    c = Raw(h.port)  # at the limit is fine
    c.send(b"POST /limited400 HTTP/1.1\r\nHost: t\r\nContent-Length: 16\r\n\r\n" + b"y" * 16)
    assert c.response()[:3:2] == (200, b"y" * 16)
    c.close()


def test_chunked_body_over_limit(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(3):
        c.send(b"200\r\n" + b"z" * 512 + b"\r\n")  # 1536 bytes > 1024
    status, headers, body = c.response()
    assert status == 413
    assert json.loads(body) == {"error": "request body too large"}
    assert headers["connection"] == "close"
    assert c.closed_by_server()
    assert h.app.started == 0


def test_expect_100_continue_accepted(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    status, _, body = c.response()
    assert (status, body) == (100, b"")
    c.send(b"12345")
    status, _, body = c.response()
    assert (status, body) == (200, b"12345")
    c.close()


def test_expect_100_continue_refused(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 4096\r\nExpect: 100-continue\r\n\r\n")
    status, headers, _ = c.response()
    assert status == 413  # no 100 Continue first
    assert headers["connection"] == "close"
    assert c.closed_by_server()


# ---- protocol errors ---------------------------------------------------------------


def test_oversized_headers_431(serve: Callable[..., Harness]) -> None:
    h = serve(max_header_bytes=2048)
    c = Raw(h.port)
    c.send(get("/hello", "X-Ok: " + "a" * 1500 + "\r\n"))  # under the limit: served
    assert c.response()[2] == b"hello world"
    c.send(get("/hello", "X-Big: " + "a" * 3000 + "\r\n"))
    status, headers, body = c.response()
    assert status == 431
    assert body == b"431 Request Header Fields Too Large"
    assert headers["connection"] == "close"
    assert c.closed_by_server()
    # a header line that never ends is cut off too (no CRLF ever arrives)
    c = Raw(h.port)
    c.send(b"GET / HTTP/1.1\r\nX-Endless: " + b"b" * 5000)
    assert c.response()[0] == 431
    assert c.closed_by_server()


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost t\r\n\r\n",
    b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
])
def test_malformed_request_400(serve: Callable[..., Harness], raw: bytes) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(raw)
    status, headers, body = c.response()
    assert status == 400
    assert json.loads(body) == {"error": "malformed HTTP request"}
    assert headers["connection"] == "close"
    assert c.closed_by_server()


def test_malformed_after_good_pipelined_request(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(get("/sleep?ms=50&id=1") + b"BAD REQUEST LINE\r\n\r\n")
    status, headers, _ = c.response()
    assert (status, headers["x-id"]) == (200, "1")
    assert c.response()[0] == 400
    assert c.closed_by_server()


def test_upgrade_request_400(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(get("/hello", "Connection: Upgrade\r\nUpgrade: websocket\r\n"))
    status, headers, _ = c.response()
    assert status == 400
    assert headers["connection"] == "close"
    assert c.closed_by_server()
    assert h.app.started == 0


def test_handler_exception_is_500_and_connection_survives(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(get("/boom"))
    status, headers, body = c.response()
    assert status == 500
    assert "connection" not in headers
    assert json.loads(body) == {"error": "internal error"}
    c.send(get("/hello"))
    assert c.response()[2] == b"hello world"
    c.close()


# ---- response serialization ----------------------------------------------------------


def test_head_has_content_length_but_no_body(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(b"HEAD /hello HTTP/1.1\r\nHost: t\r\n\r\n" + get("/echo?id=next"))
    status, headers, body = c.response(head=True)
    assert (status, headers["content-length"], body) == (200, "11", b"")
    status, headers, body = c.response()  # would fail to parse if HEAD had leaked body bytes
    assert (status, headers["x-id"]) == (200, "next")
    c.close()


def test_a_short_answer_kept_whole_is_sent_whole_each_time_and_head_gets_none(serve: Callable[..., Harness]) -> None:
    """A short 2xx body is kept with its head (``SMALL_BODY``): every GET gets the body,
    a HEAD of the same answer only the head, and an error's short body is built each time."""
    h = serve()
    c = Raw(h.port)
    c.send(get("/hello") + b"HEAD /hello HTTP/1.1\r\nHost: t\r\n\r\n" + get("/hello") + get("/nope") + get("/hello"))
    assert c.response()[::2] == (200, b"hello world")
    status, headers, body = c.response(head=True)
    assert (status, headers["content-length"], body) == (200, "11", b"")
    for _ in range(2):
        status, headers, body = c.response()
        if status == 404:
            assert body == b"404 page not found\n"
            continue
        assert (status, headers["content-length"], body) == (200, "11", b"hello world")
    assert c.response()[::2] == (200, b"hello world")
    kept = [k for k in h.server._heads if k[0] == 200]  # type: ignore[attr-defined]
    assert sorted(k[3] for k in kept) == [False, True]  # the GET's and the HEAD's, body-keyed
    assert all(k[5] == b"hello world" for k in kept)
    assert not any(k[0] == 404 for k in h.server._heads)  # type: ignore[attr-defined]
    c.close()


def test_204_has_no_body(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(get("/nocontent") + get("/echo?id=after"))
    status, headers, _ = c.response()
    assert status == 204
    assert "content-type" not in headers
    assert "content-length" not in headers
    status, headers, _ = c.response()
    assert (status, headers["x-id"]) == (200, "after")
    c.close()


def test_empty_body_has_content_length_zero(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(get("/echo"))
    status, headers, body = c.response()
    assert (status, headers["content-length"], body) == (200, "0", b"")
    c.close()


def test_alt_svc_header(serve: Callable[..., Harness]) -> None:
    h = serve(alt_svc='h3=":8443"; ma=86400')
    conn = http.client.HTTPConnection("127.0.0.1", h.port, timeout=DEADLINE)
    for path in ("/hello", "/nope"):
        conn.request("GET", path)
        r = conn.getresponse()
        r.read()
        assert r.getheader("Alt-Svc") == 'h3=":8443"; ma=86400'
    conn.close()
    plain = serve()
    conn = http.client.HTTPConnection("127.0.0.1", plain.port, timeout=DEADLINE)
    conn.request("GET", "/hello")
    r = conn.getresponse()
    r.read()
    assert r.getheader("Alt-Svc") is None
    conn.close()


def test_connection_close_and_http10(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)  # HTTP/1.1 asking to close
    c.send(get("/hello", "Connection: close\r\n") + get("/hello"))
    status, headers, _ = c.response()
    assert (status, headers["connection"]) == (200, "close")
    assert c.closed_by_server()  # the second request is not answered
    c = Raw(h.port)  # HTTP/1.0: close by default
    c.send(b"GET /hello HTTP/1.0\r\n\r\n")
    status, headers, _ = c.response()
    assert (status, headers["connection"]) == (200, "close")
    assert c.closed_by_server()
    c = Raw(h.port)  # HTTP/1.0 keep-alive
    c.send(b"GET /hello HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    status, headers, _ = c.response()
    assert (status, headers["connection"]) == (200, "keep-alive")
    c.send(b"GET /echo?id=2 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert c.response()[1]["x-id"] == "2"
    c.close()


# ---- connections, timeouts, drain ---------------------------------------------------------


def test_max_connections_pauses_accepting(serve: Callable[..., Harness]) -> None:
    h = serve(max_connections=2)
    a, b = Raw(h.port), Raw(h.port)
    for c in (a, b):
        c.send(get("/hello"))
        assert c.response()[0] == 200
    assert h.open_connections() == 2
    third = Raw(h.port)  # completes the TCP handshake in the kernel backlog, but is not accepted
    third.send(get("/echo?id=3"))
    assert third.silent_for(0.3)
    assert h.open_connections() == 2
    a.close()
    status, headers, _ = third.response()  # accepted and served once a slot frees up
    assert (status, headers["x-id"]) == (200, "3")
    assert h.open_connections() == 2
    b.close()
    third.close()
    wait_until(lambda: h.open_connections() == 0, "all connections closed")


def test_idle_timeout_closes_idle_connection(serve: Callable[..., Harness]) -> None:
    h = serve(idle_timeout=0.3)
    c = Raw(h.port)
    c.send(get("/hello"))
    assert c.response()[0] == 200
    t0 = time.monotonic()
    assert c.closed_by_server()
    assert 0.2 <= time.monotonic() - t0 < 3.0
    wait_until(lambda: h.open_connections() == 0, "connection released")


def test_idle_timeout_does_not_cut_a_running_handler(serve: Callable[..., Harness]) -> None:
    h = serve(idle_timeout=0.2, read_timeout=0.2)
    c = Raw(h.port)
    c.send(get("/sleep?ms=600"))  # the handler outlives both timeouts
    status, _, body = c.response()
    assert (status, body) == (200, b"slept")
    c.close()


def test_read_timeout_closes_slow_request(serve: Callable[..., Harness]) -> None:
    h = serve(read_timeout=0.3)
    c = Raw(h.port)
    c.send(b"GET /hello HTTP/1.1\r\nHost: t\r\n")  # headers never finish
    t0 = time.monotonic()
    assert c.closed_by_server()
    assert time.monotonic() - t0 < 3.0
    assert h.app.started == 0


def test_client_gone_while_handler_runs(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(get("/sleep?ms=200"))
    wait_until(lambda: h.app.started == 1, "handler started")
    c.close()
    wait_until(lambda: h.app.finished == 1, "handler finished despite the disconnect")
    wait_until(lambda: h.open_connections() == 0, "connection released")
    d = Raw(h.port)  # and the server keeps serving
    d.send(get("/hello"))
    assert d.response()[0] == 200
    d.close()


def test_drain_finishes_in_flight_and_refuses_new(serve: Callable[..., Harness]) -> None:
    h = serve()
    idle = Raw(h.port)
    idle.send(get("/hello"))
    assert idle.response()[0] == 200
    busy = Raw(h.port)
    busy.send(get("/sleep?ms=700&id=slow"))
    wait_until(lambda: h.app.started == 2, "slow handler started")
    t0 = time.monotonic()
    drained = h.submit(h.server.drain(5.0))
    assert idle.closed_by_server()  # idle keep-alive connection closed at once
    late = Raw(h.port)  # lands in the backlog: never accepted while draining
    late.send(get("/hello"))
    status, headers, body = busy.response()
    assert (status, headers["x-id"], body) == (200, "slow", b"slept")
    assert headers["connection"] == "close"
    assert busy.closed_by_server()
    busy.close()  # as a client does on "Connection: close" (the server lingers up to 2 s for this)
    drained.result(DEADLINE)
    assert time.monotonic() - t0 < 2.5  # returned when the last connection closed, not after grace
    assert h.open_connections() == 0
    assert late.silent_for(0.2)
    h.sock.close()  # the owner closes the listener; the backlog connection is dropped
    assert late.closed_by_server()


def test_drain_force_closes_after_grace(serve: Callable[..., Harness]) -> None:
    h = serve()
    c = Raw(h.port)
    c.send(get("/sleep?ms=4000"))
    wait_until(lambda: h.app.started == 1, "handler started")
    t0 = time.monotonic()
    h.call(h.server.drain(0.3))
    took = time.monotonic() - t0
    assert 0.25 <= took < 2.5
    assert c.closed_by_server(1.0)  # cut without a response
    assert h.open_connections() == 0
