"""Fuzzing one real node (security on, 2 workers) over HTTP/1.1.

(a) Raw framing over sockets: bad request lines, header floods, broken chunked
    encodings, huge or conflicting Content-Length, pipelined garbage, random
    bytes. The node never answers 5xx, every connection is answered or closed
    within a deadline, and the worker pids are the same at the end (no crash).
(b) Route fuzzing: every operation of the API description (narad/api/openapi.json;
    tests/test_openapi.py keeps it equal to the router's table), with
    hypothesis-generated path parameters, the operation's own query parameters
    (values drawn from their schemas, and hostile ones) and JSON bodies drawn
    from its request-body schema (valid-shaped, wrong types, big ints, deep
    nesting, unknown fields), with admin credentials and without. Zero 5xx,
    every answer within the deadline.

Bounded for CI: a fixed example budget, derandomized, no example database.
The figures (requests tried, status histogram, 5xx seen) are printed at the end
of the module (run with -s to see them).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import narad.api
from narad.api import messages, ops, topics, users
from narad.api.router import Router

from .harness import Node, basic

pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")

READ_TIMEOUT = 3.0  # the node's http.read_timeout in this test
DEADLINE = 12.0  # no answer may take longer (read timeout, a 1 s consume wait, a metadata write)

EXAMPLES_PER_ROUTE = 20
STATS: Counter[str] = Counter()
FIVE_XX: list[str] = []
HANGS: list[str] = []


# ---- the operations, from the API description ---------------------------------------------------------

DOC: dict[str, Any] = json.loads((Path(narad.api.__file__).parent / "openapi.json").read_text())
_METHODS = ("get", "put", "post", "delete", "patch")


def route_table() -> list[tuple[str, str]]:
    """(method, pattern) of every route the worker's app registers."""
    r = Router()
    for cls in (topics.TopicsAPI, users.UsersAPI, messages.MessagesAPI, ops.OpsAPI):
        cls.register(cls.__new__(cls), r)  # register only names bound methods
    return [(x.method, x.pattern) for x in r._routes]


def doc_operations() -> dict[tuple[str, str], dict[str, Any]]:
    """(METHOD, path template) -> the operation object, for every operation of the document."""
    return {(m.upper(), path): op for path, item in DOC["paths"].items() for m, op in item.items() if m in _METHODS}


OPERATIONS = doc_operations()
ROUTES = sorted(OPERATIONS)


def resolve(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = DOC["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def query_params(method: str, pattern: str) -> dict[str, dict[str, Any]]:
    """The operation's query parameters: name -> schema."""
    return {p["name"]: p.get("schema", {}) for p in OPERATIONS[(method, pattern)].get("parameters", [])
            if p["in"] == "query"}


def body_schema(method: str, pattern: str) -> dict[str, Any] | None:
    rb = OPERATIONS[(method, pattern)].get("requestBody")
    if not rb:
        return None
    js = rb.get("content", {}).get("application/json")
    return resolve(js["schema"]) if js and js.get("schema") else None


def body_types(method: str, pattern: str) -> list[str]:
    rb = OPERATIONS[(method, pattern)].get("requestBody") or {}
    return list(rb.get("content", {}))


KEEP = "fz-keep"  # a topic the fuzz never deletes (its produce/consume/ack run on real state)


# ---- the node --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    d: Path = tmp_path_factory.mktemp("fuzzhttp") / "data"
    n = Node(d, workers=2, env={"NARAD_HTTP_READ_TIMEOUT": f"{READ_TIMEOUT:g}s",
                                "NARAD_HTTP_MAX_CONSUME_WAIT": "1s"})
    n.start()
    assert n.post("/v1/topics", {"name": KEEP, "partitions": 3}).status == 201
    for i in range(5):
        assert n.post(f"/v1/topics/{KEEP}/produce", f"msg-{i}".encode(),
                      headers={"Content-Type": "application/octet-stream"}).status == 202
    pids = n.worker_pids()
    yield n
    try:
        assert n.worker_pids() == pids, "a worker was restarted during the fuzz (it crashed)"
        assert n.get("/healthz").status == 200
    finally:
        total = sum(v for k, v in STATS.items() if k.startswith("status:"))
        print(f"\n[fuzz-http] raw connections tried: {STATS['raw']}, route requests tried: {STATS['route']}, "
              f"answers: {total}, 5xx: {len(FIVE_XX)}, hangs: {len(HANGS)}, worker crashes: "
              f"{'0' if n.worker_pids() == pids else 'some'}")
        print("[fuzz-http] status histogram:", dict(sorted((k, v) for k, v in STATS.items()
                                                           if k.startswith("status:"))))
        for line in FIVE_XX[:20]:
            print("[fuzz-http] 5xx:", line)
        n.close()


def _record(status: int, what: str) -> None:
    STATS[f"status:{status}"] += 1
    if status >= 500:
        FIVE_XX.append(f"{status} {what}")


# ---- (a) raw framing --------------------------------------------------------------------------------------

def raw_exchange(port: int, data: bytes, *, half_close: bool = True) -> tuple[list[int], float]:
    """Send `data`, read until the server closes or the deadline; -> (statuses seen, seconds)."""
    t0 = time.monotonic()
    statuses: list[int] = []
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as s:
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may close early (431, 413) while we still send
        buf = b""
        s.settimeout(1.0)
        while time.monotonic() - t0 < DEADLINE:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
        else:
            return statuses, float("inf")
    for line in buf.split(b"\r\n"):
        if line.startswith(b"HTTP/1.") and len(line) >= 12 and line[9:12].isdigit():
            statuses.append(int(line[9:12]))
    return statuses, time.monotonic() - t0


def framing_cases(auth: str) -> list[tuple[str, bytes, bool]]:
    a = f"Authorization: {auth}\r\n".encode()
    get = b"GET /v1/topics HTTP/1.1\r\nHost: x\r\n" + a
    post = b"POST /v1/topics/" + KEEP.encode() + b"/produce HTTP/1.1\r\nHost: x\r\nX-Narad-Client: f\r\n" + a
    cases: list[tuple[str, bytes, bool]] = [
        ("empty line", b"\r\n\r\n", True),
        ("garbage", b"\x00\xff\xfe garbage \r\n\r\n", True),
        ("no version", b"GET /\r\n\r\n", True),
        ("bad version", b"GET / HTTP/9.9\r\nHost: x\r\n\r\n", True),
        ("http/1.0", b"GET /healthz HTTP/1.0\r\n\r\n", True),
        ("lowercase method", b"get /healthz HTTP/1.1\r\nHost: x\r\n\r\n", True),
        ("unknown method", b"BREW /v1/topics HTTP/1.1\r\nHost: x\r\n" + a + b"\r\n", True),
        ("absolute form", b"GET http://x/v1/topics HTTP/1.1\r\nHost: x\r\n" + a + b"\r\n", True),
        ("asterisk", b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", True),
        ("huge uri", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", True),
        ("percent junk path", b"GET /v1/topics/%ff%fe%00%2F.. HTTP/1.1\r\nHost: x\r\n" + a + b"\r\n", True),
        ("dotdot", b"GET /v1/../../etc/passwd HTTP/1.1\r\nHost: x\r\n" + a + b"\r\n", True),
        ("header flood count", get + b"".join(b"X-H%d: v\r\n" % i for i in range(5000)) + b"\r\n", True),
        ("header flood size", get + b"X-Big: " + b"v" * 100000 + b"\r\n\r\n", True),
        ("header no colon", get + b"NoColonHere\r\n\r\n", True),
        ("header space before colon", get + b"X-A : b\r\n\r\n", True),
        ("obs-fold", get + b"X-A: b\r\n  folded\r\n\r\n", True),
        ("nul in header", get + b"X-A: b\x00c\r\n\r\n", True),
        ("bare LF", b"GET /healthz HTTP/1.1\nHost: x\n\n", True),
        ("bad auth b64", b"GET /v1/topics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic ***\r\n\r\n", True),
        ("auth not utf8", b"GET /v1/topics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic /w==\r\n\r\n", True),
        ("auth long password",
         b"GET /v1/topics HTTP/1.1\r\nHost: x\r\nAuthorization: " + basic("admin", "p" * 200).encode() + b"\r\n\r\n",
         True),
        ("auth huge", b"GET /v1/topics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic " + b"QUFB" * 8000 + b"\r\n\r\n",
         True),
        ("content-length huge", post + b"Content-Length: 99999999999999999999\r\n\r\nabc", True),
        ("content-length negative", post + b"Content-Length: -5\r\n\r\nabc", True),
        ("content-length not a number", post + b"Content-Length: 12abc\r\n\r\nabc", True),
        ("content-length twice differing", post + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", True),
        ("content-length and chunked", post + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0"
                                              b"\r\n\r\n", True),
        ("content-length short body", post + b"Content-Length: 100\r\n\r\nabc", True),
        ("content-length over route limit", post + b"Content-Length: 2000000\r\n\r\n" + b"x" * 1000, True),
        ("chunked bad size", post + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", True),
        ("chunked huge size", post + b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\nabc\r\n0\r\n\r\n", True),
        ("chunked no terminator", post + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", True),
        ("chunked missing crlf", post + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabcXX0\r\n\r\n", True),
        ("chunked extension flood", post + b"Transfer-Encoding: chunked\r\n\r\n3;" + b"e=1;" * 20000 + b"\r\nabc\r\n0"
                                            b"\r\n\r\n", True),
        ("chunked trailer flood", post + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n"
         + b"".join(b"T%d: v\r\n" % i for i in range(3000)) + b"\r\n", True),
        ("te gzip", post + b"Transfer-Encoding: gzip\r\n\r\nabc", True),
        ("te chunked, twice", post + b"Transfer-Encoding: chunked, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", True),
        ("expect 100", post + b"Expect: 100-continue\r\nContent-Length: 3\r\n\r\nabc", True),
        ("expect other", post + b"Expect: something\r\nContent-Length: 3\r\n\r\nabc", True),
        ("upgrade h2c", get + b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                              b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n", True),
        ("h2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", True),
        ("tls hello", bytes.fromhex("16030100a5010000a10303") + bytes(200), True),
        ("pipelined then garbage", (get + b"\r\n") * 3 + b"\x00\x01garbage\r\n\r\n", True),
        ("pipelined 50", (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n") * 50, True),
        ("pipelined body then bad", post + b"Content-Length: 3\r\n\r\nabc" + b"GET / HTTP/1.1\r\nContent-Length: x"
                                             b"\r\n\r\n", True),
        ("slow: no end of headers", get, False),
        ("slow: half a request line", b"GET /v1/top", False),
        ("slow: body never arrives", post + b"Content-Length: 10\r\n\r\nab", False),
    ]
    return cases


def test_raw_framing_fuzz(node: Node) -> None:
    cases = framing_cases(node.auth)
    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(lambda c: (c[0], *raw_exchange(node.port, c[1], half_close=c[2])), cases))
    for name, statuses, secs in results:
        STATS["raw"] += 1
        for s in statuses:
            _record(s, f"raw framing case {name!r}")
        if secs > DEADLINE:
            HANGS.append(f"raw framing case {name!r}")
    assert not [x for x in FIVE_XX if x.split(" ", 1)[1].startswith("raw")], FIVE_XX
    assert not HANGS, HANGS


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.lists(st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"GET ", b"POST ", b"/v1/topics", b" HTTP/1.1", b"\r\n", b"Host: x", b"Content-Length: ",
                     b"Transfer-Encoding: chunked", b"0\r\n", b"ffff", b":", b"\x00", b"%ff", b"\r\n\r\n"])),
    min_size=1, max_size=25))
def test_raw_random_bytes_fuzz(node: Node, parts: list[bytes]) -> None:
    data = b"".join(parts)
    statuses, secs = raw_exchange(node.port, data)
    STATS["raw"] += 1
    for s in statuses:
        _record(s, f"raw bytes {data[:120]!r}")
    assert all(s < 500 for s in statuses), f"5xx for raw bytes {data[:300]!r}: {statuses}"
    assert secs <= DEADLINE, f"no answer or close within {DEADLINE}s for {data[:300]!r}"


# ---- (b) route fuzz -----------------------------------------------------------------------------------------

HOSTILE_TEXT = ["", " ", "%ff", "%00", "%2F", "..", ".", "-1", "0", "1", "3", "99999999999999999999999999",
                "9" * 80, "1e9", "0x10", "1_000", "+5", "\u0663", "\uff11\uff12", "\u00b2", "\u0660\u0661",
                "true", "null", "[]",
                "a b", "\t", "é", "\U0001f600", "a" * 120, "*", "fz-keep", "x:y:z", "0:0:0", "1:2:3:4",
                "99999999999999999999:1:1", "0:-1:5", "10ms", "1s", "99999h", "-1s", "1.5", "NaN"]

big_ints = st.sampled_from([1 << 63, (1 << 63) - 1, -(1 << 63) - 1, 1 << 64, 10 ** 30, -(10 ** 30), 10 ** 400])


def deep(n: int) -> bytes:
    """JSON nested n levels (objects and arrays alternating), built as text."""
    opens = "".join('{"a":' if i % 2 else "[" for i in range(n))
    closes = "".join("}" if i % 2 else "]" for i in reversed(range(n)))
    return (opens + "1" + closes).encode()


json_any = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12) | st.sampled_from(HOSTILE_TEXT),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12)


def from_schema(schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """A value shaped after a JSON schema of the document (loosely: bounds are kept, and
    hostile values of the same type are mixed in)."""
    schema = resolve(schema)
    if depth > 4:
        return json_any
    if "allOf" in schema:
        props: dict[str, Any] = {}
        for part in schema["allOf"]:
            props.update(resolve(part).get("properties", {}))
        return from_schema({"type": "object", "properties": props}, depth)
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return st.one_of(*[from_schema(x, depth + 1) for x in schema[key]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"]) | st.sampled_from(HOSTILE_TEXT)
    if "const" in schema:
        return st.just(schema["const"]) | json_any
    t = schema.get("type")
    if t == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        fields = {k: from_schema(v, depth + 1) for k, v in props.items()}
        return st.fixed_dictionaries({k: v for k, v in fields.items() if k in required},  # type: ignore[arg-type]
                                     optional={k: v for k, v in fields.items() if k not in required})
    if t == "array":
        hi = min(int(schema.get("maxItems", 4)), 4)
        return st.lists(from_schema(schema.get("items", {}), depth + 1), max_size=hi)
    if t == "integer":
        lo, hi = schema.get("minimum", -5), schema.get("maximum", 3_600_000)
        return (st.integers(lo, hi) | st.sampled_from([3, 4, 30000, 3_600_000, 0, 1]) | st.integers(-5, 200)
                | big_ints)
    if t == "string":
        return st.sampled_from(["fz-" + x for x in ("a", "b", "c")] + HOSTILE_TEXT) | st.text(max_size=20)
    if t == "boolean":
        return st.booleans() | json_any
    return json_any


def query_value(schema: dict[str, Any]) -> st.SearchStrategy[str]:
    """A query value after the parameter's schema (as text), or a hostile one."""
    t = schema.get("type")
    shaped: st.SearchStrategy[str]
    if "enum" in schema:
        shaped = st.sampled_from([str(v) for v in schema["enum"]])
    elif t == "integer":
        shaped = st.integers(schema.get("minimum", -3), min(schema.get("maximum", 1000), 1000)).map(str)
    else:
        shaped = st.sampled_from(["0", "1", "500ms", "true", KEEP])
    return st.one_of(shaped, shaped, st.sampled_from(HOSTILE_TEXT), st.text(max_size=8))


def body_strategy(method: str, pattern: str) -> st.SearchStrategy[bytes | None]:
    schema = body_schema(method, pattern)
    shaped: st.SearchStrategy[Any] = from_schema(schema) if schema is not None else json_any
    wrong = st.one_of(
        shaped.map(lambda d: {**d, "unknown_field_zz": 1} if isinstance(d, dict) else d),  # unknown fields
        json_any,  # wrong types altogether
        big_ints.map(lambda v: {"partitions": v, "retention_ms": v, "messages": v}),
    )
    enc = st.one_of(shaped, shaped, wrong).map(lambda v: json.dumps(v).encode())
    nested = st.integers(10, 5000).map(deep)  # deep nesting, past any recursion limit
    return st.one_of(st.none(), enc, enc, enc, st.binary(max_size=64), nested,
                     st.integers(1, 3000).map(lambda n: b'{"messages":' + b"[" * n + b"]" * n + b"}"))


def segment(pattern_part: str, method: str) -> st.SearchStrategy[str]:
    name = pattern_part[1:-1]
    pool = list(HOSTILE_TEXT)
    if name == "topic" and method != "DELETE":
        pool += [KEEP] * 6  # mostly real state
    if name == "topic":
        pool = [p for p in pool if not (method == "DELETE" and p == KEEP)]
    if name == "username":
        pool = [p for p in pool if p != "admin"] + ["fz-user", "nobody"]
    if name == "id":
        pool += ["n2", "n9"]
    raw = st.sampled_from(pool) | st.text(max_size=12).filter(lambda s: s not in ("admin", KEEP))
    # quoted (as a client would send it) or raw (percent escapes and all)
    return st.tuples(raw, st.booleans()).map(lambda t: urllib.parse.quote(t[0], safe="") if t[1] else
                                             urllib.parse.quote(t[0], safe="%:@!$&'()*+,;="))


def request_strategy(method: str, pattern: str) -> st.SearchStrategy[tuple[str, bytes | None, dict[str, str]]]:
    parts = pattern.strip("/").split("/")
    segs = [segment(p, method) if p.startswith("{") else st.just(p) for p in parts]
    path = st.tuples(*segs).map(lambda xs: "/" + "/".join(xs))
    documented = query_params(method, pattern)
    # the operation's own parameters (values after their schemas), and unknown ones
    known = [st.tuples(st.just(name), query_value(sch)) for name, sch in documented.items()]
    unknown = st.tuples(st.text(min_size=1, max_size=5), st.sampled_from(HOSTILE_TEXT) | st.text(max_size=8))
    query = st.lists(st.one_of(*known, *known, unknown) if known else unknown, max_size=4)
    qs = query.map(lambda q: urllib.parse.urlencode(q, safe="%") if q else "")
    odd_headers = st.fixed_dictionaries({}, optional={
        "Content-Type": st.sampled_from(["application/json", "application/octet-stream", "text/plain", "",
                                         "application/json; charset=utf-8"]),
        "X-Narad-Client": st.sampled_from(["fuzz", ""])})
    # mostly what a real client sends (so requests get past the 415 guard to the handler)
    types = body_types(method, pattern) or ["application/json", "application/octet-stream"]
    headers = st.one_of(st.sampled_from(types).map(lambda ct: {"Content-Type": ct, "X-Narad-Client": "fuzz"}),
                        odd_headers)
    return st.tuples(path, qs, body_strategy(method, pattern), headers).map(
        lambda t: (t[0] + (("?" + t[1]) if t[1] else ""), t[2], t[3]))


def send(node: Node, method: str, target: str, body: bytes | None, headers: dict[str, str],
         auth: str | None) -> tuple[int, float]:
    h = dict(headers)
    if auth:
        h["Authorization"] = auth
    c = http.client.HTTPConnection("127.0.0.1", node.port, timeout=DEADLINE)
    t0 = time.monotonic()
    try:
        c.putrequest(method, target, skip_accept_encoding=True)
        for k, v in h.items():
            c.putheader(k, v)
        if body is not None:
            c.putheader("Content-Length", str(len(body)))
        c.endheaders(body)
        r = c.getresponse()
        r.read()
        return r.status, time.monotonic() - t0
    except TimeoutError:
        return -1, float("inf")
    finally:
        c.close()


@pytest.mark.parametrize(("method", "pattern"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_route_fuzz(node: Node, method: str, pattern: str) -> None:
    failures: list[str] = []

    @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request_strategy(method, pattern), st.sampled_from(["admin"] * 6 + ["none", "wrong"]))
    def run(req: tuple[str, bytes | None, dict[str, str]], who: str) -> None:
        target, body, headers = req
        auth = {"admin": node.auth, "none": None, "wrong": basic("admin", "wrong-password")}[who]
        if who == "wrong":
            # 5 wrong passwords lock the user for a while (429): use an unknown user instead
            auth = basic("fz-nobody", "x")
        status, secs = send(node, method, target, body, headers, auth)
        STATS["route"] += 1
        what = f"{method} {target} auth={who} body={(body or b'')[:200]!r} headers={headers}"
        if secs > DEADLINE:
            HANGS.append(what)
            failures.append(f"no answer within {DEADLINE}s: {what}")
            return
        _record(status, what)
        if status >= 500:
            failures.append(f"{status}: {what}")

    run()
    assert not failures, "\n".join(failures[:20])


def test_routes_enumerated() -> None:
    """The operations fuzzed are the document's, and they are every route the router serves."""
    assert len(ROUTES) >= 20
    assert set(ROUTES) == set(route_table())
    assert ("POST", "/v1/topics/{topic}/produce") in ROUTES and ("GET", "/v1/users") in ROUTES
    shaped = [r for r in ROUTES if body_schema(*r) is not None]
    assert ("POST", "/v1/topics") in shaped and ("POST", "/v1/topics/{topic}/produce/batch") in shaped


def known_hostile(auth: str) -> list[tuple[str, str, bytes | None, dict[str, str], str | None]]:
    """The classes of input that answered 5xx before (issue 9), sent explicitly so the
    fuzz cannot miss them by chance."""
    j = {"Content-Type": "application/json"}
    long_pw = basic("admin", "p" * 100)
    cases: list[tuple[str, str, bytes | None, dict[str, str], str | None]] = [
        ("GET", "/v1/topics", None, {}, long_pw),
        ("GET", "/v1/topics", None, {}, basic("u" * 300, "p" * 300)),
        ("GET", "/v1/topics?page_token=%ff", None, {}, auth),
        ("GET", "/v1/topics?page_token=%ff%fe%00", None, {}, auth),
        ("GET", "/v1/topics?limit=%D9%A3", None, {}, auth),
        ("GET", "/v1/topics?limit=99999999999999999999999999", None, {}, auth),
        ("GET", f"/v1/topics/{KEEP}/consume?partition=%D9%A3&offset=0", None, {}, auth),
        ("GET", f"/v1/topics/{KEEP}/consume?partition=0&offset=99999999999999999999999", None, {}, auth),
        ("GET", f"/v1/topics/{KEEP}/consume?max=%EF%BC%92", None, {"X-Narad-Client": "f"}, auth),
        ("GET", "/v1/topics/a%2Fb", None, {}, auth),
        ("GET", f"/v1/topics/{KEEP}%2Fconsume", None, {}, auth),
        ("DELETE", "/v1/topics/%2F", None, {}, auth),
        ("POST", f"/v1/topics/{KEEP}/ack?receipt_handle=%D9%A3:0:1", None, {"X-Narad-Client": "f"}, auth),
        ("POST", f"/v1/topics/{KEEP}/ack?receipt_handle=99999999999999999999999:0:1", None,
         {"X-Narad-Client": "f"}, auth),
        ("POST", f"/v1/topics/{KEEP}/ack", b'{"receipt_handles":["0:0:99999999999999999999999999"]}', j, auth),
        ("POST", f"/v1/topics/{KEEP}/produce?partition=99999999999999999999", b"x", j, auth),
        ("POST", f"/v1/topics/{KEEP}/produce/batch", b'{"messages":[{"payload":1,"partition":' + b"9" * 30 + b"}]}",
         j, auth),
        ("POST", f"/v1/topics/{KEEP}/produce/batch", b'{"messages":' + b"[" * 5000 + b"]" * 5000 + b"}", j, auth),
        ("POST", f"/v1/topics/{KEEP}/produce/batch", b'{"messages":[{"payload":' + deep(5000) + b"}]}", j, auth),
        ("POST", "/v1/topics", b'{"name":"fz-big","partitions":' + b"9" * 30 + b"}", j, auth),
        ("POST", "/v1/topics", b'{"name":"fz-big2","retention_ms":' + b"9" * 400 + b"}", j, auth),
        ("POST", "/v1/topics", b'{"name":"fz-deep","schema":' + deep(5000) + b"}", j, auth),
        ("POST", "/v1/topics", b'{"name":"fz-re","schema":{"type":"string","pattern":"(a+)+$"}}', j, auth),
        ("POST", "/v1/topics", b'{"name":"fz-re2","schema":{"type":"string","pattern":"(?<=a)b"}}', j, auth),
        ("POST", "/v1/topics", b'{"name":"fz-re3","schema":{"type":"string","pattern":"["}}', j, auth),
        ("POST", "/v1/topics", b'{"name":"fz-re4","schema":{"patternProperties":{"(":{}}}}', j, auth),
        ("PATCH", f"/v1/topics/{KEEP}", b'{"retention_ms":' + b"9" * 30 + b"}", j, auth),
        ("PATCH", f"/v1/topics/{KEEP}", b'{"schema_base_version":-99999999999999999999}', j, auth),
        ("POST", "/v1/users", b'{"username":"fz-u1","password":"' + b"p" * 200 + b'"}', j, auth),
        ("POST", "/v1/users", b'{"username":"fz-u2","password":"pw-123456","grants":' + deep(5000) + b"}", j, auth),
        ("PUT", "/v1/users/fz-u1/password", b'{"new_password":"' + b"q" * 200 + b'"}', j, auth),
        ("GET", "/v1/users/%ff", None, {}, auth),
        ("POST", "/v1/cluster/members/%ff/forget", None, {"X-Narad-Client": "f"}, auth),
        ("GET", "/v1/cluster/members?detail=%ff", None, {}, auth),
    ]
    return cases


def test_known_hostile_requests(node: Node) -> None:
    bad = []
    for method, target, body, headers, auth in known_hostile(node.auth):
        status, secs = send(node, method, target, body, headers, auth)
        STATS["route"] += 1
        what = f"{method} {target[:120]} body={(body or b'')[:80]!r}"
        if secs > DEADLINE:
            HANGS.append(what)
            bad.append(f"no answer within {DEADLINE}s: {what}")
            continue
        _record(status, what)
        if status >= 500:
            bad.append(f"{status}: {what}")
    assert not bad, "\n".join(bad)
