"""Message headers (issue 14): produced as a batch message field or as
``?header=name:value`` on a single produce (the fast path and the schema path),
returned as ``headers`` on consume and replay, copied to a fan-out child with
the record, bounded (400s naming what to fix), and absent from the answer of a
record without them. A real node with two forked workers (a record produced on
one worker and consumed through the other), and the SDK's record headers with
OpenTelemetry trace context."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import msgspec
import pytest

from narad.storage import frames as FR
from tests.harness import ADMIN_PASSWORD, Node, Response, wait_for

OCTET = {"Content-Type": "application/octet-stream"}
CLIENT = {"X-Narad-Client": "tests"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("headers") / "data", workers=2).start()
    yield n
    n.close()


def mk(node: Node, name: str, **fields: Any) -> None:
    r = node.post("/v1/topics", {"name": name, "partitions": 3, **fields})
    assert r.status == 201, r


def take_all(node: Node, name: str, n: int, timeout: float = 15.0) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []

    def more() -> bool:
        r = node.request("GET", f"/v1/topics/{name}/consume?max=100", headers=CLIENT)
        if r.status == 200:
            doc = r.json()
            got.extend(doc["messages"] if isinstance(doc, dict) and "messages" in doc else [doc])
        return len(got) >= n

    wait_for(more, timeout, 0.02, f"{n} records of {name}")
    return got


def err(r: Response) -> str:
    assert r.status == 400, r
    return str(r.json()["error"])


def test_extension_block_round_trips_and_leaves_plain_records_alone() -> None:
    hdrs = {"a": "1", "trace": "x" * 300}
    stored = FR.pack_ext(FR.Ext(h=FR.headers_json(hdrs)), b'{"v":1}')
    ext, body = FR.split_ext(FR.F_EXT, stored)
    assert ext is not None and ext.h is not None and msgspec.json.decode(ext.h) == hdrs and body == b'{"v":1}'
    assert not FR.has_idem(stored)  # headers alone: no idempotency key, told without decoding
    # the key is the map's first entry whatever else the block holds, short or long block
    for h in (None, FR.headers_json({"a": "1"}), FR.headers_json(hdrs)):
        with_key = FR.pack_ext(FR.Ext(h=h, i="k1", d=FR.DeadLetter("t", 0, 1, 2)), b"x")
        assert FR.has_idem(with_key) and FR.read_ext(with_key).i == "k1"
        assert not FR.has_idem(FR.pack_ext(FR.Ext(h=h, d=FR.DeadLetter("t", 0, 1, 2)), b"x"))
    assert len(FR.pack_ext(FR.Ext(h=FR.headers_json(hdrs), i="k"), b"")) > 0x80  # the two-byte length path
    assert not FR.has_idem(b"") and not FR.has_idem(b"\xff")
    # a key alone or headers alone: a consume finds the body (and the headers' text) without
    # decoding the block; anything more, it decodes
    only = FR.pack_ext(FR.Ext(i="k" * 200), b"body")
    assert FR.plain_block(only) == (0, 0, len(only) - 4) and only[FR.plain_block(only)[2]:] == b"body"
    assert FR.plain_block(FR.pack_ext(FR.Ext(i="k", h=b'{"a":"1"}'), b"x")) == FR.NOT_PLAIN
    for h in (b'{"a":"1"}', FR.headers_json(hdrs), b"{" + b"x" * 300 + b"}"):
        stored = FR.pack_headers(h, b"body")
        assert stored == FR.pack_ext(FR.Ext(h=h), b"body")  # the hand-made block is msgspec's, byte for byte
        hs, he, at = FR.plain_block(stored)
        assert (stored[hs:he], stored[at:]) == (h, b"body")
    assert FR.plain_block(FR.pack_ext(FR.Ext(h=b'{"a":"1"}', d=FR.DeadLetter("t", 0, 1, 2)), b"x")) == FR.NOT_PLAIN
    for bad in (b"", b"\x05\x81\xa1i", b"\xff\xff", b"\x01\x81", b"\x05\x81\xa1h\xc4\x09", b"\x06\x81\xa1h\xc5\x00"):
        assert FR.plain_block(bad) == FR.NOT_PLAIN
    assert FR.split_ext(FR.F_JSON, b'{"v":1}') == (None, b'{"v":1}')
    for bad in (b"", b"\xff", b"\x05ab", b"\x02\xc1\xc1rest"):
        with pytest.raises(FR.FrameError):
            FR.split_ext(FR.F_EXT, bad)


def test_batch_and_single_headers_come_back_on_consume(node: Node) -> None:
    mk(node, "hd-basic")
    r = node.post("/v1/topics/hd-basic/produce/batch", {"messages": [
        {"payload": {"n": 1}, "headers": {"traceparent": "00-abc-def-01", "kind": "order"}},
        {"payload": {"n": 2}},
        {"payload": base64.b64encode(b"\x00\xffbin").decode(), "payload_encoding": "base64",
         "headers": {"x": ""}},
    ]})
    assert r.status == 202 and r.json() == {"accepted": 3}, r
    # Single produce, fast path (no schema): two headers, a value holding ':'.
    r = node.post("/v1/topics/hd-basic/produce?header=kind:single&header=" + quote("url:http://h:1/x"), b"plain text",
                  headers=OCTET)
    assert r.status == 202 and r.body == b"", r
    got = {json.dumps(m["payload"]) if m.get("payload_encoding") is None else m["payload"]: m
           for m in take_all(node, "hd-basic", 4)}
    assert got['{"n": 1}']["headers"] == {"traceparent": "00-abc-def-01", "kind": "order"}
    assert got['{"n": 1}']["payload"] == {"n": 1}
    assert "headers" not in got['{"n": 2}']
    binary = got[base64.b64encode(b"\x00\xffbin").decode()]
    assert binary["payload_encoding"] == "base64" and binary["headers"] == {"x": ""}
    single = got['"plain text"']
    assert single["headers"] == {"kind": "single", "url": "http://h:1/x"}
    # Replay (offset mode) shows them too.
    r = node.get(f"/v1/topics/hd-basic/consume?partition={single['partition']}&offset={single['offset']}")
    assert r.status == 200 and r.json()["headers"] == {"kind": "single", "url": "http://h:1/x"}, r


def test_a_batch_of_headers_texts_of_every_shape_stores_what_their_dicts_give(node: Node) -> None:
    """A batch's headers texts are taken as given when they already are the stored form
    (checked for the whole batch in one native call) and go through a dict otherwise,
    from the first such text on: a batch mixing compact texts, spaces, an escape,
    a repeated name (the last value kept), non-ASCII, null and an empty object (no
    headers; the payload stored whole) comes back as each text's dict gives it, in
    order, with every payload intact; a bad text after good ones is the 400 naming
    its message, and nothing of that batch is stored."""
    mk(node, "hd-shapes")  # (a keyless batch goes to one partition: its offsets are its order)
    texts = [b'{"a":"1","b":"2"}', b'{"a" : "1"}', b'{"\\u0061":"x"}', b'{"a":"1","a":"2"}', b'{"a":"\xc3\xa9"}',
             b"null", b"{}", b'{"t":"v"}', None]
    rows = [b'{"payload":{"n":%d}' % i + (b',"headers":' + t if t is not None else b"") + b"}"
            for i, t in enumerate(texts)]
    body = b'{"messages":[' + b",".join(rows) + b"]}"
    r = node.request("POST", "/v1/topics/hd-shapes/produce/batch", body, headers={"Content-Type": "application/json"})
    assert r.status == 202 and r.json() == {"accepted": len(texts)}, r
    got = sorted(take_all(node, "hd-shapes", len(texts)), key=lambda m: (m["partition"], m["offset"]))
    assert [m["payload"] for m in got] == [{"n": i} for i in range(len(texts))]
    want = [json.loads(t) if t is not None else None for t in texts]
    assert [m.get("headers") for m in got] == [w or None for w in want]
    assert got[3]["headers"] == {"a": "2"} and got[4]["headers"] == {"a": "é"}
    for bad in (b'{"a":1}', b'{"sp ace":"1"}', b'[1]', b'{"a":"\xff"}'):
        body = b'{"messages":[{"payload":1,"headers":{"ok":"1"}},{"payload":2,"headers":' + bad + b"}]}"
        r = node.request("POST", "/v1/topics/hd-shapes/produce/batch", body,
                         headers={"Content-Type": "application/json"})
        assert r.status == 400 and r.json()["error"].startswith("message 1: "), (bad, r)
    r = node.request("GET", "/v1/topics/hd-shapes/consume?max=10", headers=CLIENT)
    assert r.status == 204, r


def test_the_native_stored_form_check_keeps_the_bounds_of_the_python_side() -> None:
    """``headers_canonical`` (native) and ``messages``' bounds agree: 32 names but not
    33, a 128-byte name but not 129, 8192 bytes of text but not 8193 (a longer text
    still goes through the dict, which counts names and values only)."""
    from narad._native import lib

    from narad.api import messages as M

    def ok(t: bytes) -> bool:
        return bool(lib.headers_canonical(t, len(t)))

    def many(n: int) -> bytes:
        return b"{" + b",".join(b'"h%d":"v"' % i for i in range(n)) + b"}"

    assert ok(many(M.MAX_HEADERS)) and not ok(many(M.MAX_HEADERS + 1))
    longest = M.MAX_HEADER_NAME
    assert ok(b'{"' + b"n" * longest + b'":"v"}') and not ok(b'{"' + b"n" * (longest + 1) + b'":"v"}')
    fill = M.MAX_HEADERS_BYTES - len(b'{"a":""}')
    assert ok(b'{"a":"' + b"x" * fill + b'"}') and not ok(b'{"a":"' + b"x" * (fill + 1) + b'"}')
    assert ok(b'{"a":"\x7f ~!#"}') and not ok(b'{"a":"\x1f"}') and not ok(b'{"a":"\x80"}')
    for c in range(256):  # the byte classes: a name's by the name rule, a value's any ASCII but controls, '"' and '\\'
        b = bytes((c,))
        assert ok(b'{"' + b + b'":"v"}') == bool(M._HEADER_NAME.fullmatch(chr(c))), c
        assert ok(b'{"a":"' + b + b'"}') == (0x20 <= c < 0x80 and b not in b'"\\'), c


def test_single_produce_with_a_schema_keeps_headers_and_checks_only_the_body(node: Node) -> None:
    schema = {"type": "object", "required": ["id"]}
    mk(node, "hd-schema", schema=schema)
    assert node.post("/v1/topics/hd-schema/produce?header=h:v", {"id": 1}).status == 202
    assert node.post("/v1/topics/hd-schema/produce?header=h:v", {"nope": 1}).status == 400
    (m,) = take_all(node, "hd-schema", 1)
    assert m["payload"] == {"id": 1} and m["headers"] == {"h": "v"}


@pytest.mark.parametrize(("query", "why"), [
    ("header=novalue", 'must be "name:value"'),
    ("header=a:1&header=a:2", "given twice"),
    ("header=" + quote("bad name:1"), "header name"),
    ("header=:1", "header name"),
    ("&".join(f"header=h{i}:v" for i in range(33)), "at most 32 headers"),
    ("header=big:" + "v" * 9000, "larger than 8192 bytes"),
])
def test_bad_single_headers_are_400(node: Node, query: str, why: str) -> None:
    mk(node, f"hd-bad-{abs(hash(query)) % 10**8}")
    name = f"hd-bad-{abs(hash(query)) % 10**8}"
    assert why in err(node.post(f"/v1/topics/{name}/produce?{query}", b"x", headers=OCTET))
    assert node.get(f"/v1/topics/{name}").json().get("partitions") == 3


def test_the_headers_byte_bound_counts_names_and_values_not_their_json_text(node: Node) -> None:
    """8192 bytes of UTF-8 in names and values together: quotes the stored JSON text
    escapes (twice as long) do not count, a two-byte character counts twice."""
    mk(node, "hd-bound")
    quotes = {"q": '"' * 8000}  # JSON text of over 16,000 bytes, 8,001 bytes of headers
    wide_ok = {"w": "\u00e9" * 4095}  # 1 + 8,190 bytes
    wide_bad = {"w": "\u00e9" * 4096}  # 1 + 8,192 bytes
    r = node.post("/v1/topics/hd-bound/produce/batch", {"messages": [{"payload": 1, "headers": quotes},
                                                                       {"payload": 2, "headers": wide_ok}]})
    assert r.status == 202, r
    r = node.post("/v1/topics/hd-bound/produce/batch", {"messages": [{"payload": 3, "headers": wide_bad}]})
    assert "message 0: invalid argument: headers larger than 8192 bytes" in err(r)
    r = node.post(f"/v1/topics/hd-bound/produce?header={quote('q:' + chr(34) * 8000)}", b"4", headers=OCTET)
    assert r.status == 202, r
    r = node.post("/v1/topics/hd-bound/produce?header=bad:%ED%A0%80", b"5", headers=OCTET)  # a lone surrogate
    assert r.status == 400, r
    got = sorted(take_all(node, "hd-bound", 3), key=lambda m: str(m["payload"]))
    assert [m["headers"] for m in got] == [quotes, wide_ok, quotes], [m["headers"] for m in got]


def test_bad_batch_headers_are_400_naming_the_message_and_store_nothing(node: Node) -> None:
    mk(node, "hd-badbatch")
    r = node.post("/v1/topics/hd-badbatch/produce/batch", {"messages": [
        {"payload": 1, "headers": {"ok": "1"}}, {"payload": 2, "headers": {"sp ace": "1"}}]})
    assert "message 1: invalid argument: header name" in err(r)
    r = node.post("/v1/topics/hd-badbatch/produce/batch", {"messages": [{"payload": 1, "headers": {"a": 1}}]})
    assert r.status == 400 and "message 0" in r.json()["error"], r
    r = node.request("GET", "/v1/topics/hd-badbatch/consume?max=10", headers=CLIENT)
    assert r.status == 204, r


@pytest.mark.parametrize("query", ["header=a:b", "idempotency_key=k1", "idempotency_key=", "header="])
def test_single_produce_extensions_in_a_batch_query_are_400_not_dropped(node: Node, query: str) -> None:
    """Headers and idempotency keys go in each message of a batch: given in the query
    (single produce's form) they would be dropped silently (no dedup, no headers)."""
    name = f"hd-bq-{abs(hash(query)) % 10**8}"
    mk(node, name)
    r = node.post(f"/v1/topics/{name}/produce/batch?{query}", {"messages": [{"payload": 1}]})
    assert r.status == 400 and "each message of a batch" in r.json()["error"], r
    r = node.request("GET", f"/v1/topics/{name}/consume?max=10", headers=CLIENT)
    assert r.status == 204, r


def test_a_child_gets_the_headers_with_the_record(node: Node) -> None:
    mk(node, "hd-parent")
    r = node.post("/v1/topics", {"name": "hd-child", "parent": "hd-parent"})
    assert r.status == 201, r
    assert node.post("/v1/topics/hd-parent/produce/batch",
                     {"messages": [{"payload": {"c": 1}, "headers": {"origin": "parent"}}]}).status == 202
    (m,) = take_all(node, "hd-child", 1, timeout=30.0)
    assert m["payload"] == {"c": 1} and m["headers"] == {"origin": "parent"}


def test_sdk_record_headers_and_trace_context(node: Node) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from narad.client import AsyncClient, BatchMessage

    mk(node, "hd-sdk")
    trace.set_tracer_provider(TracerProvider())
    tracer = trace.get_tracer("tests")

    async def run() -> tuple[list[Any], str]:
        async with AsyncClient(f"127.0.0.1:{node.port}", auth=("admin", ADMIN_PASSWORD)) as c:
            with tracer.start_as_current_span("produce") as span:
                await c.produce("hd-sdk", {"one": 1}, record_headers={"k": "v"})
                await c.produce_batch("hd-sdk", [BatchMessage({"two": 2}, record_headers={"b": "2"})])
                want = format(span.get_span_context().trace_id, "032x")
            msgs: list[Any] = []
            for _ in range(200):
                msgs.extend(await c.consume_batch("hd-sdk", 10, wait=0.5))
                if len(msgs) >= 2:
                    break
            return msgs, want

    msgs, trace_id = asyncio.run(run())
    by = {m.json().get("one", 2): m for m in msgs}
    assert by[1].headers["k"] == "v" and by[2].headers["b"] == "2"
    for m in by.values():
        assert m.headers["traceparent"].split("-")[1] == trace_id  # injected by the SDK
        ctx = m.trace_context()
        assert format(trace.get_current_span(ctx).get_span_context().trace_id, "032x") == trace_id


def test_headers_cross_nodes_and_survive_an_owner_kill9(tmp_path: Any) -> None:
    """3 nodes: records with headers produced at one node for partitions other nodes own
    (CommitReq over node RPC), consumed through a third node (consume probes), then the
    owner of one partition is killed with SIGKILL and restarted: its records come back
    from disk with their headers. The topic's child gets every record with its headers
    (fan-out copies from each parent owner to the child's owners, across nodes), and a
    record the SDK produced at one node under a span carries that span's trace context
    to a consumer at another."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from narad.client import AsyncClient
    from tests.harness import Cluster

    c = Cluster(tmp_path, 3, initial=3).start()
    try:
        c.leader()
        assert c["n1"].post("/v1/topics", {"name": "hdc", "partitions": 3}).status == 201
        assert c["n1"].post("/v1/topics", {"name": "hdc-child", "parent": "hdc", "partitions": 4}).status == 201
        wait_for(lambda: all(c[n].get(f"/v1/topics/{t}").status == 200 for n in c.ids for t in ("hdc", "hdc-child")),
                 20, 0.05, "the topics")
        owner = {s["index"]: s["owner_node"] for s in c["n1"].get("/v1/topics/hdc").json()["partition_stats"]}
        rows = [{"payload": {"i": i}, "partition": i % 3, "headers": {"i": str(i), "from": "n1"}} for i in range(6)]
        assert c["n1"].post("/v1/topics/hdc/produce/batch", {"messages": rows}).status == 202
        # Wait until every record is committed at its owner (describe sums the high watermarks).
        wait_for(lambda: sum(s["high_watermark"] for s in c["n1"].get("/v1/topics/hdc").json()["partition_stats"])
                 == 6, 30, 0.05, "six records committed")
        victim = next(o for o in owner.values() if o != "n1")
        c[victim].kill9()
        c[victim].start()
        reader = next(n for n in c.ids if n not in ("n1", victim))
        got: dict[int, dict[str, Any]] = {}

        def drain() -> bool:
            for nid in (reader, victim, "n1"):
                r = c[nid].request("GET", "/v1/topics/hdc/consume?max=10", headers=CLIENT)
                if r.status == 200:
                    for m in r.json()["messages"]:
                        got[m["payload"]["i"]] = m
            return len(got) == 6

        wait_for(drain, 60, 0.1, "all six records")
        for i, m in got.items():
            assert m["headers"] == {"i": str(i), "from": "n1"}, m
            assert m["partition"] == i % 3
        assert {owner[m["partition"]] for m in got.values()} - {"n1"}, owner  # some crossed a node hop
        kids: dict[int, dict[str, Any]] = {}

        def drain_child() -> bool:
            for nid in c.ids:
                r = c[nid].request("GET", "/v1/topics/hdc-child/consume?max=10", headers=CLIENT)
                if r.status == 200:
                    for m in r.json()["messages"]:
                        kids[m["payload"]["i"]] = m
                        assert c[nid].post("/v1/topics/hdc-child/ack", {"receipt_handles": [m["receipt_handle"]]}
                                           ).status == 200
            return len(kids) == 6

        wait_for(drain_child, 60, 0.1, "the child's copies of all six records")
        for i, m in kids.items():
            assert m["headers"] == {"i": str(i), "from": "n1"}, m  # the copy keeps the record's headers
        # The SDK's trace context, produced at n1 into a partition another node owns, read at a third.
        far = next(k for k, o in owner.items() if o != "n1")
        reader2 = next(n for n in c.ids if n not in ("n1", owner[far]))
        trace.set_tracer_provider(TracerProvider())
        tracer = trace.get_tracer("tests")

        async def traced() -> tuple[str, Any]:
            async with AsyncClient(f"127.0.0.1:{c['n1'].port}", auth=("admin", ADMIN_PASSWORD)) as cl:
                with tracer.start_as_current_span("produce") as span:
                    await cl.produce("hdc", {"i": 99}, partition=far, record_headers={"k": "v"})
                    want = format(span.get_span_context().trace_id, "032x")
            async with AsyncClient(f"127.0.0.1:{c[reader2].port}", auth=("admin", ADMIN_PASSWORD)) as cl:
                for _ in range(100):
                    for m in await cl.consume_batch("hdc", 10, wait=0.5, partition=far):
                        if m.json() == {"i": 99}:
                            return want, m
            raise AssertionError("the traced record never came back")

        trace_id, m = asyncio.run(traced())
        assert m.headers["k"] == "v" and m.headers["traceparent"].split("-")[1] == trace_id, m.headers
        ctx = m.trace_context()
        assert format(trace.get_current_span(ctx).get_span_context().trace_id, "032x") == trace_id
    finally:
        c.close()


def test_headers_and_an_idempotency_key_share_one_extension_block(node: Node) -> None:
    mk(node, "hd-idem")
    q = "?header=h:1&idempotency_key=k-1"
    r = node.post(f"/v1/topics/hd-idem/produce{q}", b"first", headers=OCTET)
    assert r.status == 202 and r.json() == {"duplicate": False}, r
    r = node.post(f"/v1/topics/hd-idem/produce{q}", b"again", headers=OCTET)
    assert r.status == 202 and r.json() == {"duplicate": True}, r
    r = node.post("/v1/topics/hd-idem/produce/batch", {"messages": [
        {"payload": 1, "headers": {"b": "2"}, "idempotency_key": "k-2"},
        {"payload": 2, "headers": {"b": "3"}, "idempotency_key": "k-1"}]})
    assert r.status == 202 and r.json() == {"accepted": 2, "duplicates": 1}, r
    got = take_all(node, "hd-idem", 2)
    assert sorted((json.dumps(m["payload"]), m["headers"]["h" if "h" in m["headers"] else "b"]) for m in got) == \
        [('"first"', "1"), ("1", "2")]
    assert node.request("GET", "/v1/topics/hd-idem/consume?max=10", headers=CLIENT).status == 204


def test_sdk_single_produce_refuses_a_header_name_with_a_colon(node: Node) -> None:
    """Single produce sends headers as ``?header=name:value`` (split at the first ":"):
    a name with a ":" would have been stored as another header ({"a:b": "c"} became
    {"a": "b:c"}). The SDK refuses it before sending, as the batch form's 400 does.
    Found by a review of issue 14."""
    from narad.client import AsyncClient, BadRequest, BatchMessage

    mk(node, "hd-colon")

    async def run() -> list[str]:
        errs = []
        async with AsyncClient(f"127.0.0.1:{node.port}", auth=("admin", ADMIN_PASSWORD)) as c:
            for send in (lambda: c.produce("hd-colon", "s", record_headers={"a:b": "c"}, trace_context=False),
                         lambda: c.produce_batch("hd-colon", [BatchMessage("b", record_headers={"a:b": "c"})],
                                                 trace_context=False)):
                try:
                    await send()
                except BadRequest as e:
                    errs.append(str(e))
        return errs

    errs = asyncio.run(run())
    assert len(errs) == 2 and all("header name" in e for e in errs), errs
    stats = node.get("/v1/topics/hd-colon").json()["partition_stats"]
    assert sum(p["high_watermark"] for p in stats) == 0  # nothing stored


def test_a_lone_surrogate_escape_is_a_400_that_says_so(node: Node) -> None:
    """msgspec calls a lone surrogate escape "Input data was truncated"; the 400 says what
    is wrong instead (found by a review of issue 14)."""
    mk(node, "hd-surrogate")
    for body in (b'{"messages":[{"payload":1,"headers":{"a":"\\ud800"}}]}',
                 b'{"messages":[{"payload":"\\udc00x"}]}'):
        r = node.post("/v1/topics/hd-surrogate/produce/batch", body, headers={"Content-Type": "application/json"})
        assert r.status == 400 and "surrogate" in err(r), r
    # Every JSON body says so: a batch ack's reason or delay, a topic's settings (found by a
    # review of the wire contract).
    j = {"Content-Type": "application/json", "X-Narad-Client": "t"}
    for path, body in (("/v1/topics/hd-surrogate/ack?extend=0", b'{"receipt_handles":["0:0:1"],"reason":"\\ud800"}'),
                       ("/v1/topics/hd-surrogate/ack?extend=0", b'{"receipt_handles":["0:0:1"],"delay":"\\ud800"}'),
                       ("/v1/topics", b'{"name":"hd-s2","dead_letter_topic":"\\udc00"}')):
        r = node.post(path, body, headers=j)
        assert r.status == 400 and "surrogate" in err(r), (path, r)


def test_sdk_trace_context_never_pushes_headers_past_the_bounds() -> None:
    """The SDK adds traceparent only when the headers stay within the node's bounds: a
    caller's 32 headers (or 8192 bytes) are sent as given, not refused for the trace
    context they did not ask for (found by a review of issue 14)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from narad.api.messages import MAX_HEADERS, MAX_HEADERS_BYTES
    from narad.client.models import MAX_RECORD_HEADER_BYTES, MAX_RECORD_HEADERS, inject_trace_context

    assert (MAX_RECORD_HEADERS, MAX_RECORD_HEADER_BYTES) == (MAX_HEADERS, MAX_HEADERS_BYTES)
    trace.set_tracer_provider(TracerProvider())
    with trace.get_tracer("tests").start_as_current_span("s"):
        assert "traceparent" in (inject_trace_context({"a": "b"}) or {})
        full = {f"h{i}": "v" for i in range(MAX_HEADERS)}
        assert inject_trace_context(full) == full
        big = {"big": "x" * (MAX_HEADERS_BYTES - 10)}
        assert inject_trace_context(big) == big


def test_sdk_batch_trace_context_is_best_effort_as_a_single_produces(node: Node) -> None:
    """A batch message with 32 headers, produced inside a recording span, is stored as
    given (no traceparent), as a single produce's is: it was a 400 ("got 33")."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from narad.client import AsyncClient, BatchMessage

    mk(node, "hd-batch-trace")
    trace.set_tracer_provider(TracerProvider())
    full = {f"h{i}": "v" for i in range(32)}

    async def run() -> list[Any]:
        async with AsyncClient(f"127.0.0.1:{node.port}", auth=("admin", ADMIN_PASSWORD)) as c:
            with trace.get_tracer("tests").start_as_current_span("produce"):
                n = await c.produce_batch("hd-batch-trace", [BatchMessage({"n": 1}, record_headers=full),
                                                             BatchMessage({"n": 2}, record_headers={"a": "b"})])
                assert n == 2
            msgs: list[Any] = []
            for _ in range(200):
                msgs.extend(await c.consume_batch("hd-batch-trace", 10, wait=0.5))
                if len(msgs) >= 2:
                    return msgs
            return msgs

    by = {m.json()["n"]: m for m in asyncio.run(run())}
    assert by[1].headers == full  # as given: the trace context would have passed the bound
    assert "traceparent" in by[2].headers and by[2].headers["a"] == "b"
