"""Hostile input against a real node (security on, two workers) over HTTP/1.1
and HTTP/3: every bad request gets a 4xx with a JSON error, never a 500 or a
hang, the failed-login throttle holds under concurrency, unknown user names
cannot be told apart by timing, and the node is healthy afterwards.

Also the login throttle's token rules on their own (``LoginThrottle``, pure).
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from narad.supervisor.services import LoginThrottle
from tests.harness import Node, Response, basic

JSON = {"Content-Type": "application/json"}
OCTET = {"Content-Type": "application/octet-stream"}
DEEP = b"[" * 10_000 + b"]" * 10_000


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("hostile") / "data", workers=2).start()
    yield n
    n.close()


def is_4xx(r: Response, status: int | None = None) -> bool:
    """A client error with a JSON body saying what is wrong."""
    if status is not None and r.status != status:
        return False
    if not 400 <= r.status < 500:
        return False
    body = r.json()
    return isinstance(body, dict) and isinstance(body.get("error"), str) and bool(body["error"])


def healthy(node: Node) -> None:
    assert node.get("/readyz", auth=None).status == 200
    log = node.log()
    assert "Traceback" not in log, log[-4000:]
    assert "user store unreadable" not in log, log[-4000:]


def mk_topic(node: Node, name: str, **kw: Any) -> None:
    r = node.post("/v1/topics", {"name": name, **kw})
    assert r.status in (201, 409), r


def mk_user(node: Node, name: str, pw: str) -> None:
    r = node.post("/v1/users", {"username": name, "password": pw})
    assert r.status == 201, r


def bad_password_failures(node: Node) -> float:
    for line in node.get("/metrics").body.decode().splitlines():
        if line.startswith('narad_auth_failures_total{reason="bad_password"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- authentication -------------------------------------------------------------------------


def test_password_over_72_bytes_and_empty_user_name_are_failed_logins(node: Node) -> None:
    mk_user(node, "longpw-login", "short")
    for pw in ("x" * 73, "x" * 500, "é" * 40):
        r = node.get("/v1/topics", auth=basic("longpw-login", pw))
        assert is_4xx(r, 401), r
    r = node.get("/v1/topics", auth=basic("", "whatever"))
    assert is_4xx(r, 401), r
    for name in ("admin\n", "a" * 65, "bad/name", "é"):
        assert is_4xx(node.get("/v1/topics", auth=basic(name, "whatever")), 401)
    healthy(node)


def test_user_passwords_over_72_bytes_are_refused(node: Node) -> None:
    assert is_4xx(node.post("/v1/users", {"username": "longpw", "password": "é" * 37}), 400)
    mk_user(node, "longpw", "p" * 72)
    assert node.get("/v1/topics", auth=basic("longpw", "p" * 72)).status == 200
    r = node.request("PUT", "/v1/users/longpw/password", {"new_password": "x" * 73})
    assert is_4xx(r, 400), r
    r = node.request("PUT", "/v1/users/longpw/password", {"new_password": "n", "current_password": "p" * 100},
                     auth=basic("longpw", "p" * 72))
    assert is_4xx(r, 403), r


def test_concurrent_wrong_passwords_are_throttled_before_bcrypt(node: Node) -> None:
    mk_user(node, "target", "the-right-one")
    before = bad_password_failures(node)
    n = 40
    start = threading.Barrier(n)
    statuses: list[int] = []
    lock = threading.Lock()

    def attempt(i: int) -> None:
        c = node.conn()
        try:
            c.connect()
            start.wait(10)
            r = node.get("/v1/topics", auth=basic("target", f"wrong-{i}"), conn=c)
            assert is_4xx(r)
            with lock:
                statuses.append(r.status)
        finally:
            c.close()

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(statuses) == n
    assert set(statuses) <= {401, 429}
    assert statuses.count(401) <= 5, statuses
    assert statuses.count(429) >= n - 5
    assert bad_password_failures(node) - before <= 5
    # The bucket is empty: even the right password waits for it to refill.
    assert is_4xx(node.get("/v1/topics", auth=basic("target", "the-right-one")), 429)
    healthy(node)


def test_a_correct_password_gives_its_token_back(node: Node) -> None:
    mk_user(node, "refund", "right")
    assert [node.get("/v1/topics", auth=basic("refund", f"w{i}")).status for i in range(4)] == [401] * 4
    # One token left: the right password takes it and gives it back.
    assert node.get("/v1/topics", auth=basic("refund", "right")).status == 200
    assert node.get("/v1/topics", auth=basic("refund", "w5")).status == 401
    assert node.get("/v1/topics", auth=basic("refund", "w6")).status == 429


def _median_refusal(node: Node, creds: list[tuple[str, str]]) -> float:
    times = []
    c = node.conn()
    try:
        for user, pw in creds:
            t0 = time.perf_counter()
            r = node.get("/v1/topics", auth=basic(user, pw), conn=c)
            times.append(time.perf_counter() - t0)
            assert r.status == 401, r
    finally:
        c.close()
    return statistics.median(times)


def test_unknown_user_names_cannot_be_told_apart_by_timing(node: Node) -> None:
    for u in ("timing-a", "timing-b"):
        mk_user(node, u, "right-password")
    # Four tries per name, under the throttle's burst of five.
    real = _median_refusal(node, [(u, f"wrong-{i}") for u in ("timing-a", "timing-b") for i in range(4)])
    unknown = _median_refusal(node, [(f"nobody-{i}", "wrong") for i in range(8)])
    # A refusal of an unknown name runs the same (dummy) bcrypt check as a real one.
    assert unknown >= real / 4, (unknown, real)
    # And an unknown name is throttled like a real one.
    statuses = [node.get("/v1/topics", auth=basic("nobody-x", f"w{i}")).status for i in range(6)]
    assert statuses == [401] * 5 + [429]
    healthy(node)


def test_login_throttle_takes_tokens_before_the_check() -> None:
    th = LoginThrottle()
    now = 1000.0
    # Five checks for one name are admitted before any outcome is known, then none.
    grants = [th.attempt("u", now) for _ in range(8)]
    assert [g[0] for g in grants] == [True] * 5 + [False] * 3
    assert 0 < grants[-1][1] <= 12.0
    # One token per 12 s comes back.
    assert th.attempt("u", now + 12.0)[0] is True
    assert th.attempt("u", now + 12.0)[0] is False
    # A correct password gives back what its check took.
    allowed, _, budget = th.attempt("v", now)
    assert allowed
    th.outcome("v", True, budget, now)
    assert all(th.attempt("v", now)[0] for _ in range(5))


def test_login_throttle_node_wide_failure_budget() -> None:
    th = LoginThrottle()
    now = 50.0
    # Many names, each with a recent failure: together they drain the node-wide budget.
    for i in range(40):
        allowed, _, budget = th.attempt(f"n{i}", now)
        assert allowed and th.outcome(f"n{i}", False, budget, now) is None
    admitted = sum(th.attempt(f"n{i}", now)[0] for i in range(40))
    assert admitted == 0  # the budget (32) went on the first checks
    # It refills at 4 per second.
    assert sum(th.attempt(f"n{i}", now + 1.0)[0] for i in range(40)) == 4


# ---- integers -------------------------------------------------------------------------------


def test_metadata_integers_beyond_64_bits_are_400(node: Node) -> None:
    for field in ("partitions", "retention_ms", "visibility_timeout_ms", "max_in_flight_per_partition",
                  "max_acked_ahead_per_partition", "fanout_delay_ms"):
        for v in (2**64, 10**30, -(2**64)):
            r = node.post("/v1/topics", {"name": "ints", field: v})
            assert is_4xx(r, 400), (field, v, r)
    mk_topic(node, "ints")
    for field in ("partitions", "retention_ms", "max_in_flight_per_partition", "max_acked_ahead_per_partition",
                  "schema_base_version"):
        r = node.request("PATCH", "/v1/topics/ints", {field: 2**64})
        assert is_4xx(r, 400), (field, r)
    r = node.post("/v1/topics/ints/produce/batch", {"messages": [{"payload": 1, "partition": 2**64}]})
    assert is_4xx(r, 400), r
    healthy(node)


def test_replay_offsets_and_receipt_handles_beyond_64_bits_are_400(node: Node) -> None:
    mk_topic(node, "big-offsets")
    for q in ("?partition=0&offset=" + "1" + "0" * 30, "?partition=0&offset=18446744073709551616",
              "?partition=99999999999999999999999", "?partition=0&offset=-1", "?max=" + "9" * 40):
        r = node.request("GET", f"/v1/topics/big-offsets/consume{q}", headers={"X-Narad-Client": "t"})
        assert is_4xx(r, 400), (q, r)
    for h in ("0:18446744073709551616:1", "0:1:18446744073709551616", "18446744073709551616:0:1",
              "0:9223372036854775808:1"):
        r = node.post(f"/v1/topics/big-offsets/ack?receipt_handle={h}")
        assert is_4xx(r, 400), (h, r)
    r = node.post("/v1/topics/big-offsets/ack", {"receipt_handles": ["0:18446744073709551616:1"]})
    assert r.status == 200 and r.json()["results"][0]["status"] == 400, r
    healthy(node)


def test_integers_are_ascii_digits_only(node: Node) -> None:
    mk_topic(node, "digits")
    odd = ("%D9%A1", "%201", "1%20", "+1", "1_0", "%EF%BC%91", "0x1", "1.0", "1" * 25)
    for v in odd:
        r = node.request("POST", f"/v1/topics/digits/produce?partition={v}", b"m", headers=OCTET)
        assert is_4xx(r, 400), (v, r)
        r = node.get(f"/v1/topics?limit={v}")
        assert is_4xx(r, 400), (v, r)
        r = node.get(f"/v1/topics/digits?partition={v}")
        assert is_4xx(r, 400), (v, r)
        r = node.request("GET", f"/v1/topics/digits/consume?max={v}", headers={"X-Narad-Client": "t"})
        assert is_4xx(r, 400), (v, r)
        r = node.get(f"/v1/topics/digits/consume?partition=0&offset={v}")
        assert is_4xx(r, 400), (v, r)
        r = node.post(f"/v1/topics/digits/ack?receipt_handle=0:{v}:1")
        assert is_4xx(r, 400), (v, r)
    r = node.get("/v1/topics/digits/consume?wait=%D9%A1s")
    assert is_4xx(r, 400), r
    # Plain ASCII still works.
    assert node.request("POST", "/v1/topics/digits/produce?partition=1", b"m", headers=OCTET).status == 202
    assert node.get("/v1/topics?limit=1").status == 200
    healthy(node)


# ---- bodies and tokens ----------------------------------------------------------------------


def test_deeply_nested_json_bodies_are_400(node: Node) -> None:
    mk_topic(node, "deep")
    cases = [
        ("POST", "/v1/topics", b'{"name":"deep2","schema":' + DEEP + b"}"),
        ("PATCH", "/v1/topics/deep", b'{"schema":' + DEEP + b"}"),
        ("POST", "/v1/topics/deep/produce/batch", b'{"messages":[{"payload":' + DEEP + b"}]}"),
        ("POST", "/v1/topics/deep/produce/batch", b'{"messages":' + DEEP + b"}"),
        ("POST", "/v1/topics/deep/ack", b'{"receipt_handles":' + DEEP + b"}"),
        ("POST", "/v1/users", b'{"username":"deep","password":"x","grants":' + DEEP + b"}"),
        ("PUT", "/v1/users/admin/grants", b'{"grants":' + DEEP + b"}"),
        ("POST", "/v1/topics", DEEP),
        ("POST", "/v1/topics", b'{"name":' + b'{"a":' * 10_000 + b"1" + b"}" * 10_000 + b"}"),
    ]
    for method, path, body in cases:
        r = node.request(method, path, body, headers=JSON)
        assert is_4xx(r, 400), (method, path, r)
    # A single produce takes any bytes: a deep payload is refused or stored, never a 500.
    r = node.request("POST", "/v1/topics/deep/produce", DEEP, headers=OCTET)
    assert r.status == 202 or is_4xx(r), r
    healthy(node)


def test_page_token_that_is_not_utf8_is_400(node: Node) -> None:
    for tok in ("%ff", "%C3%28", "a%00b", "a%0A"):
        r = node.get(f"/v1/topics?page_token={tok}")
        assert is_4xx(r, 400), (tok, r)
    assert node.get("/v1/topics?page_token=zzz").status == 200
    healthy(node)


# ---- names and routing ----------------------------------------------------------------------


def test_names_with_a_trailing_newline_are_refused(node: Node) -> None:
    assert is_4xx(node.post("/v1/users", {"username": "admin\n", "password": "x"}), 400)
    assert is_4xx(node.post("/v1/users", {"username": "u\n", "password": "x"}), 400)
    assert is_4xx(node.post("/v1/topics", {"name": "nl\n"}), 400)
    r = node.post("/v1/users", {"username": "grantee", "password": "x",
                                "grants": [{"action": "produce", "patterns": ["nl\n"]}]})
    assert is_4xx(r, 400), r
    users = {u["username"] for u in node.get("/v1/users").json()}
    assert not any("\n" in u for u in users)
    assert "nl\n" not in node.topic_names()
    assert node.get("/v1/topics/nl%0A").status == 404


def test_an_encoded_slash_stays_inside_its_segment(node: Node) -> None:
    mk_topic(node, "x")
    # Consume of "x" answers 204 (empty topic); "x/consume" is not a topic.
    assert node.get("/v1/topics/x/consume").status == 204
    r = node.get("/v1/topics/x%2Fconsume")
    assert is_4xx(r, 404), r
    r = node.request("POST", "/v1/topics/x%2Fproduce", b"m", headers=OCTET)
    # the topic route, which takes no POST: Narad's plain-text 405, not a produce
    assert (r.status, r.body) == (405, b"Method Not Allowed\n"), r
    r = node.get("/v1/topics/x%2Fconsume%3Fwait=1s")
    assert is_4xx(r, 404), r
    # Encoded characters in a literal segment still route (each segment is decoded).
    assert node.get("/v1/%74opics/x").status == 200
    assert node.get("/v1/topics/%78").json()["name"] == "x"

    async def via_h3() -> list[int]:
        from narad.client.h3 import H3Client

        c = await H3Client.connect("127.0.0.1", node.port)
        try:
            out = []
            for path in ("/v1/topics/x%2Fconsume", "/v1/topics/x/consume", "/v1/%74opics/x"):
                st, _, _ = await c.request("GET", path, headers={"authorization": node.auth})
                out.append(st)
            return out
        finally:
            await c.close()

    assert asyncio.run(via_h3()) == [404, 204, 200]
    healthy(node)


# ---- found in review: bytes that reach the node before authentication ------------------------


def _raw(node: Node, request: bytes) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_a_non_ascii_basic_value_is_401_not_500(node: Node) -> None:
    for value in ("Basic é".encode(), b"Basic \xe9\xe9", "Basic ééé=".encode()):
        out = _raw(node, b"GET /v1/topics HTTP/1.1\r\nHost: x\r\nAuthorization: " + value
                   + b"\r\nConnection: close\r\n\r\n")
        status = out.split(b" ", 2)[1]
        assert status == b"401", out[:300]
    healthy(node)


def test_the_route_cache_remembers_only_short_paths() -> None:
    """Routes are matched before authentication: long unique paths must not pile up."""
    from narad.api.router import Router

    async def h(req: Any) -> Any:
        return None

    r = Router()
    r.add("POST", "/v1/topics/{topic}/produce", h)
    for i in range(300):
        _route, params = r.match("POST", f"/v1/topics/{'x' * 60_000}{i}/produce")
        assert params["topic"].endswith(str(i))
    assert not any(len(p) > 512 for _, p in r._cache)
    for i in range(20_000):
        r.match("POST", f"/v1/topics/t{i}/produce")
    assert len(r._cache) <= 10_000
