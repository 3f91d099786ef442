"""Durable messages on one node, end to end with real processes: produce,
consume with leases, ack / extend / nack, long polls, replay, caps, batch
forms, payload rendering, topic delete and growth, ack persistence. The tests that
move messages through a ledger or a drain record a history (tests/contract.py) and
end with the delivery-contract checker's verdict (strict; faults mode, with the
restart windows declared, for the ack persistence test)."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from narad.storage.offsets import SLOT, _decode
from tests.contract import Delivery, History, check, now, record_delivery, record_settles
from tests.harness import Node, Response, basic, wait_for

JSON = {"Content-Type": "application/json"}
OCTET = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("msgs") / "data", workers=2).start()
    yield n
    n.close()


def mk(node: Node, name: str, **kw: Any) -> dict[str, Any]:
    r = node.post("/v1/topics", {"name": name, **kw})
    assert r.status == 201, r
    return r.json()  # type: ignore[no-any-return]


def produce(node: Node, topic: str, body: bytes, query: str = "", conn: Any = None) -> Response:
    return node.request("POST", f"/v1/topics/{topic}/produce{query}", body, headers=OCTET, conn=conn)


def consume(node: Node, topic: str, query: str = "", conn: Any = None, headers: dict[str, str] | None = None
            ) -> Response:
    return node.request("GET", f"/v1/topics/{topic}/consume{query}", conn=conn, headers=headers)


def ack(node: Node, topic: str, handle: str, extend: str | None = None, conn: Any = None) -> Response:
    q = f"?receipt_handle={handle}" + (f"&extend={extend}" if extend is not None else "")
    return node.request("POST", f"/v1/topics/{topic}/ack{q}", conn=conn)


MidOf = Callable[[dict[str, Any]], str]


def payload_id(m: dict[str, Any]) -> str:
    """The message id of a delivered message: its payload's text (a JSON payload re-encoded)."""
    p = m["payload"]
    return p if isinstance(p, str) else json.dumps(p, sort_keys=True)


def drain(node: Node, topic: str, *, wait: str = "1s", idle_rounds: int = 2, h: History | None = None,
          mid: MidOf = payload_id) -> list[dict[str, Any]]:
    """Consume and ack until `idle_rounds` consecutive empty answers; with a history,
    every delivery (message id: ``mid(message)``) and per-handle ack answer recorded."""
    got: list[dict[str, Any]] = []
    idle = 0
    c = node.conn()
    while idle < idle_rounds:
        t0 = now()
        r = consume(node, topic, f"?wait={wait}&max=100", conn=c, headers={"X-Narad-Client": "t"})
        t1 = now()
        if r.status == 204:
            idle += 1
            continue
        assert r.status == 200, r
        msgs = r.json()["messages"]
        got.extend(msgs)
        ds = [record_delivery(h, m, t0, t1, mid=mid(m)) for m in msgs] if h is not None else []
        body = json.dumps({"receipt_handles": [m["receipt_handle"] for m in msgs]}).encode()
        t0 = now()
        a = node.request("POST", f"/v1/topics/{topic}/ack", body, headers=JSON, conn=c)
        if h is not None:
            record_settles(h, ds, "ack", t0, now(), [x["status"] for x in a.json()["results"]] if a.status == 200
                           else [a.status if a.status < 500 else None] * len(ds))
        assert a.status == 200 and all(x["status"] == 204 for x in a.json()["results"]), a
        idle = 0
    c.close()
    return got


def produce_recorded(h: History, mid: str, node: Node, topic: str, body: bytes, query: str = "", conn: Any = None
                     ) -> Response:
    """A produce recorded in the history under message id `mid`."""
    t0 = now()
    r = produce(node, topic, body, query, conn)
    h.produced([mid], t0, now(), r.status)
    return r


def consume_recorded(h: History, node: Node, topic: str, query: str = "", conn: Any = None,
                     headers: dict[str, str] | None = None, mid: MidOf = payload_id) -> Response:
    """A single or batch consume; every message answered is recorded as a delivery."""
    t0 = now()
    r = consume(node, topic, query, conn, headers)
    t1 = now()
    if r.status == 200:
        j = r.json()
        for m in j.get("messages", [j]):
            if "receipt_handle" in m:
                record_delivery(h, m, t0, t1, mid=mid(m))
    return r


def settle_recorded(h: History, node: Node, topic: str, m: dict[str, Any], extend: str | None = None,
                    conn: Any = None, mid: MidOf = payload_id) -> Response:
    """A single-handle ack (extend=None), extend ("true"/"1"...) or nack ("0"), recorded."""
    t0 = now()
    r = ack(node, topic, m["receipt_handle"], extend, conn)
    p, o, nonce = m["receipt_handle"].split(":", 2)
    d = Delivery(mid(m), int(p), int(o), nonce, 0, 0)
    kind = "ack" if extend is None else ("nack" if extend == "0" else "extend")
    record_settles(h, [d], kind, t0, now(), [r.status if r.status < 500 else None])
    return r


def verdict(h: History, name: str, mode: str = "strict") -> None:
    """End the history, print the checker's verdict (CI logs carry it) and assert it clean."""
    h.finish()
    v = check(h, mode)
    print("\n" + v.summary(name))
    assert v.ok, v.summary(name)


def n_of(m: dict[str, Any]) -> str:
    return str(m["payload"]["n"])


def test_every_message_is_consumed_exactly_once_across_partitions_and_workers(node: Node) -> None:
    mk(node, "exact", partitions=12)
    conns = [node.worker_connection(0), node.worker_connection(1)]
    h = History(30.0)
    sent = set()
    for i in range(240):
        c = conns[i % 2]
        body = json.dumps({"n": i}).encode()
        q = f"?key=k{i % 17}" if i % 3 else ""
        assert produce_recorded(h, str(i), node, "exact", body, q, conn=c).status == 202
        sent.add(i)
    seen: list[int] = []
    for i in range(30):  # single consumes on both workers, acked one by one
        c = conns[i % 2]
        r = consume_recorded(h, node, "exact", "?wait=2s", conn=c, mid=n_of)
        assert r.status == 200, r
        m = r.json()
        seen.append(m["payload"]["n"])
        assert settle_recorded(h, node, "exact", m, conn=c, mid=n_of).status == 204
    seen += [m["payload"]["n"] for m in drain(node, "exact", h=h, mid=n_of)]
    assert sorted(seen) == sorted(sent), "every message exactly once"
    assert consume_recorded(h, node, "exact", mid=n_of).status == 204
    verdict(h, "exactly once across partitions and workers")
    stats = node.get("/v1/topics/exact").json()["partition_stats"]
    assert sum(s["high_watermark"] for s in stats) == 240
    assert all(s["committed_offset"] == s["high_watermark"] - 1 and s["lag"] == 0 for s in stats)
    assert sum(1 for s in stats if s["high_watermark"] > 0) >= 6  # spread over partitions


def test_unacked_message_returns_after_the_visibility_timeout(node: Node) -> None:
    mk(node, "lease", visibility_timeout_ms=600)
    assert produce(node, "lease", b"hello").status == 202
    first = consume(node, "lease", "?wait=2s").json()
    assert consume(node, "lease").status == 204  # leased: hidden
    again = wait_for(lambda: (r := consume(node, "lease", "?wait=1s")).status == 200 and r.json(), 5.0,
                     what="redelivery after the visibility timeout")
    assert again["offset"] == first["offset"] and again["partition"] == first["partition"]
    assert again["receipt_handle"] != first["receipt_handle"]
    gone = ack(node, "lease", first["receipt_handle"])
    assert gone.status == 410 and "no longer matches" in gone.json()["error"]
    assert ack(node, "lease", again["receipt_handle"]).status == 204
    assert ack(node, "lease", again["receipt_handle"]).status == 410  # already settled


def test_extend_keeps_the_lease_and_nack_releases_it(node: Node) -> None:
    mk(node, "extend", visibility_timeout_ms=800)
    assert produce(node, "extend", b"x").status == 202
    m = consume(node, "extend", "?wait=2s").json()
    h = m["receipt_handle"]
    end = time.monotonic() + 2.0
    while time.monotonic() < end:  # keep extending well past the original timeout
        assert ack(node, "extend", h, extend="true").status == 204
        assert consume(node, "extend").status == 204
        time.sleep(0.2)
    assert ack(node, "extend", h, extend="0").status == 204  # nack: back at once
    again = consume(node, "extend").json()
    assert again["offset"] == m["offset"] and again["receipt_handle"] != h
    assert ack(node, "extend", h).status == 410
    assert ack(node, "extend", again["receipt_handle"], extend="maybe").status == 400
    assert ack(node, "extend", again["receipt_handle"], extend="1").status == 204
    assert ack(node, "extend", again["receipt_handle"]).status == 204


def _parked_consume(node: Node, topic: str, wait: str, conn: Any, out: dict[str, Any]) -> None:
    t0, call = time.monotonic(), now()
    r = consume(node, topic, f"?wait={wait}", conn=conn)
    out["status"], out["seconds"], out["resp"] = r.status, time.monotonic() - t0, r
    out["call"], out["ret"] = call, now()


def test_long_poll_wakes_on_produce_on_the_same_and_another_worker(node: Node) -> None:
    mk(node, "wake", partitions=6)
    h = History(30.0)
    for consumer_worker in (0, 1):
        c = node.worker_connection(consumer_worker)
        out: dict[str, Any] = {}
        t = threading.Thread(target=_parked_consume, args=(node, "wake", "10s", c, out))
        t.start()
        node.wait_parked(1)  # the produce must happen while it waits
        t_produce = time.monotonic()
        for p in range(6):  # one message on every partition: owners on both workers
            mid = f"ping-{consumer_worker}-{p}"
            assert produce_recorded(h, mid, node, "wake", mid.encode(), f"?partition={p}").status == 202
        t.join(15)
        assert out["status"] == 200
        assert out["seconds"] < 5, f"long poll answered after {out['seconds']:.2f}s, not on the produce"
        print(f"long poll on worker {consumer_worker} woke {time.monotonic() - t_produce:.4f}s after produce")
        m = out["resp"].json()
        record_delivery(h, m, out["call"], out["ret"], mid=payload_id(m))
        assert settle_recorded(h, node, "wake", m).status == 204
        drain(node, "wake", wait="200ms", idle_rounds=1, h=h)
    verdict(h, "long polls woken by produce")


def test_wait_is_clamped_and_times_out_with_204(node: Node) -> None:
    mk(node, "clamp")
    t0 = time.monotonic()
    r = consume(node, "clamp", "?wait=300ms")
    assert r.status == 204 and time.monotonic() - t0 >= 0.3
    assert consume(node, "clamp", "?wait=bogus").status == 400
    assert consume(node, "clamp", "?wait=-1s").status == 400


def test_replay_reads_without_leasing(node: Node) -> None:
    mk(node, "replay")
    h = History(30.0)
    c = node.conn()  # one connection, one worker, one WAL: partition order is kept
    for i in range(3):
        assert produce_recorded(h, str(i), node, "replay", f'{{"i":{i}}}'.encode(), "?partition=1",
                                conn=c).status == 202
    wait_for(lambda: node.get("/v1/topics/replay?partition=1").json()["partition_stats"][0]["high_watermark"] == 3)
    r = consume(node, "replay", "?partition=1&offset=1")
    assert r.status == 200
    m = r.json()
    assert m["payload"] == {"i": 1} and "receipt_handle" not in m and m["offset"] == 1
    assert consume(node, "replay", "?partition=1&offset=3").status == 204
    assert consume(node, "replay", "?partition=1&offset=99&wait=5s").status == 204  # replay never waits
    assert consume(node, "replay", "?offset=1").status == 400
    assert consume(node, "replay", "?partition=7&offset=0").status == 400
    r = consume(node, "replay", "?partition=1&offset=0&max=2", headers={"X-Narad-Client": "t"})
    assert r.status == 400
    # Nothing was leased by the replays: all three are still consumable.
    assert sorted(m["payload"]["i"] for m in drain(node, "replay", h=h, mid=lambda m: str(m["payload"]["i"]))) \
        == [0, 1, 2]
    verdict(h, "replays lease nothing")


def test_payload_and_key_rendering(node: Node) -> None:
    mk(node, "render")
    bodies = [b'{"a": [1, 2]}', b"plain text", bytes([0xFF, 0x00, 0x10]), b'"a json string"']
    c = node.conn()
    for b in bodies:
        assert produce(node, "render", b, "?partition=0&key=%C3%A9t%C3%A9", conn=c).status == 202
    assert node.request("POST", "/v1/topics/render/produce?partition=0&key=%FF%FE", b"k",
                        headers=OCTET, conn=c).status == 202
    msgs = sorted(drain(node, "render"), key=lambda m: m["offset"])
    assert msgs[0]["payload"] == {"a": [1, 2]} and "payload_encoding" not in msgs[0]
    assert msgs[1]["payload"] == "plain text"
    assert msgs[2]["payload_encoding"] == "base64" and base64.b64decode(msgs[2]["payload"]) == bytes([0xFF, 0, 0x10])
    assert msgs[3]["payload"] == "a json string"
    assert msgs[0]["key"] == "été" and "key_encoding" not in msgs[0]
    assert msgs[4]["key_encoding"] == "base64" and base64.b64decode(msgs[4]["key"]) == b"\xff\xfe"
    assert isinstance(msgs[0]["timestamp"], int) and abs(msgs[0]["timestamp"] - time.time()) < 60


def test_batch_forms_match_single_forms(node: Node) -> None:
    mk(node, "batches", partitions=4)
    body = {"messages": [
        {"payload": {"n": 1}},
        {"payload": "hi", "key": "k"},
        {"payload": base64.b64encode(b"\xff\x01").decode(), "payload_encoding": "base64", "partition": 2},
        {"payload": [1, 2, 3], "key": base64.b64encode(b"\xfa").decode(), "key_encoding": "base64"},
    ]}
    r = node.post("/v1/topics/batches/produce/batch", body)
    assert r.status == 202 and r.json() == {"accepted": 4}
    r = consume(node, "batches", "?wait=2s&max=10", headers={"X-Narad-Client": "t"})
    assert r.status == 200
    msgs = r.json()["messages"]
    while len(msgs) < 4:
        more = consume(node, "batches", "?wait=2s&max=10", headers={"X-Narad-Client": "t"})
        assert more.status == 200
        msgs += more.json()["messages"]
    by_payload = {json.dumps(m["payload"]): m for m in msgs}
    assert '{"n": 1}' in by_payload and by_payload['"hi"']["payload"] == "hi"
    assert by_payload['"hi"']["key"] == "k"
    binary = next(m for m in msgs if m.get("payload_encoding") == "base64")
    assert base64.b64decode(binary["payload"]) == b"\xff\x01" and binary["partition"] == 2
    assert next(m for m in msgs if m["payload"] == [1, 2, 3])["key_encoding"] == "base64"
    handles = [m["receipt_handle"] for m in msgs]
    r = node.request("POST", "/v1/topics/batches/ack",
                     json.dumps({"receipt_handles": [*handles, handles[0], "garbage"]}).encode(), headers=JSON)
    assert r.status == 200
    res = r.json()["results"]
    assert [x["status"] for x in res] == [204, 204, 204, 204, 410, 400]
    # batch consume needs X-Narad-Client; max range is 1..100
    assert consume(node, "batches", "?max=2").status == 400
    assert consume(node, "batches", "?max=0", headers={"X-Narad-Client": "t"}).status == 400
    assert consume(node, "batches", "?max=101", headers={"X-Narad-Client": "t"}).status == 400
    assert consume(node, "batches", "?max=1", headers={"X-Narad-Client": "t"}).status == 204


def test_batch_produce_is_all_or_nothing(node: Node) -> None:
    mk(node, "atomic", partitions=3, schema={"type": "object", "required": ["id"]})
    bad = {"messages": [{"payload": {"id": 1}}, {"payload": {"id": 2}, "partition": 9}]}
    r = node.post("/v1/topics/atomic/produce/batch", bad)
    assert r.status == 400 and r.json()["error"].startswith("message 1: ")
    bad = {"messages": [{"payload": {"id": 1}}, {"payload": {"no": 2}}]}
    r = node.post("/v1/topics/atomic/produce/batch", bad)
    assert r.status == 400 and r.json()["error"].startswith("message 1: ") and "schema" in r.json()["error"]
    r = node.post("/v1/topics/atomic/produce/batch", {"messages": [{"payload": {"id": 1}, "bogus": 1}]})
    assert r.status == 400 and "message 0" in r.json()["error"] and "bogus" in r.json()["error"]
    r = node.post("/v1/topics/atomic/produce/batch", {"messages": [{"payload": {"id": i}} for i in range(1001)]})
    assert r.status == 400 and "more than 1000" in r.json()["error"]
    assert node.post("/v1/topics/atomic/produce/batch?key=x", {"messages": [{"payload": {"id": 1}}]}).status == 400
    assert node.post("/v1/topics/atomic/produce/batch", {"messages": []}).status == 400
    assert consume(node, "atomic").status == 204  # nothing of the refused batches was stored
    h = History(30.0)
    t0 = now()
    ok = node.post("/v1/topics/atomic/produce/batch", {"messages": [{"payload": {"id": i}} for i in range(1000)]})
    h.produced([str(i) for i in range(1000)], t0, now(), ok.status)
    assert ok.status == 202 and ok.json()["accepted"] == 1000
    assert len(drain(node, "atomic", h=h, mid=lambda m: str(m["payload"]["id"]))) == 1000
    verdict(h, "an accepted batch of 1000, refused batches stored nothing")


def test_produce_rules(node: Node) -> None:
    mk(node, "rules", schema={"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]})
    assert produce(node, "rules", b"").status == 400
    assert produce(node, "rules", b'{"id":1}', "?partition=3").status == 400
    assert produce(node, "rules", b'{"id":1}', "?key=a&key=b").status == 400
    assert produce(node, "nope", b"x").status == 404
    r = produce(node, "rules", b'{"id":"x"}')
    assert r.status == 400 and "jsonschema validation failed" in r.json()["error"] and "/id" in r.json()["error"]
    assert produce(node, "rules", b"not json").status == 400
    assert produce(node, "rules", b'{"id":5}').status == 202
    big = node.request("POST", "/v1/topics/rules/produce", b"x" * ((1 << 20) + 1), headers=OCTET)
    assert big.status == 413
    r = node.request("POST", "/v1/topics/rules/produce", b"x",
                     headers={"Content-Type": "text/plain", "X-Narad-Client": ""})
    assert r.status == 415
    node.post("/v1/users", {"username": "reader", "password": "r",
                            "grants": [{"action": "consume", "patterns": ["*"]}]})
    r = node.request("POST", "/v1/topics/rules/produce", b'{"id":1}', headers=OCTET, auth=basic("reader", "r"))
    assert r.status == 403 and r.json()["error"] == "produce not allowed on this topic"
    assert consume(node, "rules").status == 200  # the reader's grant is consume


def test_in_flight_and_acked_ahead_caps(node: Node) -> None:
    mk(node, "inflight", partitions=3, max_in_flight_per_partition=2)
    for _ in range(3):
        assert produce(node, "inflight", b"m", "?partition=0").status == 202
    # 202 means durable in the WAL; visible once committed at the owner.
    wait_for(lambda: node.get("/v1/topics/inflight?partition=0").json()["partition_stats"][0]["high_watermark"] == 3)
    a = consume(node, "inflight", "?partition=0&wait=2s").json()
    b = consume(node, "inflight", "?partition=0").json()
    assert consume(node, "inflight", "?partition=0").status == 204  # cap of 2 leases reached
    assert ack(node, "inflight", a["receipt_handle"]).status == 204
    c = consume(node, "inflight", "?partition=0").json()
    assert {a["offset"], b["offset"], c["offset"]} == {0, 1, 2}

    mk(node, "ahead", partitions=3, max_acked_ahead_per_partition=2)
    for _ in range(5):
        assert produce(node, "ahead", b"m", "?partition=0").status == 202
    wait_for(lambda: node.get("/v1/topics/ahead?partition=0").json()["partition_stats"][0]["high_watermark"] == 5)
    got = {m["offset"]: m["receipt_handle"] for m in
           consume(node, "ahead", "?partition=0&max=4", headers={"X-Narad-Client": "t"}).json()["messages"]}
    assert sorted(got) == [0, 1, 2, 3]
    assert ack(node, "ahead", got[1]).status == 204
    assert ack(node, "ahead", got[2]).status == 204  # two held above the frontier: the cap
    assert ack(node, "ahead", got[3]).status == 204  # acks are never refused
    assert consume(node, "ahead", "?partition=0").status == 204  # only the frontier may go, and it is leased
    assert ack(node, "ahead", got[0], extend="0").status == 204  # nack the frontier
    front = consume(node, "ahead", "?partition=0").json()
    assert front["offset"] == 0  # the frontier hole is deliverable at the cap
    assert consume(node, "ahead", "?partition=0").status == 204  # offset 4 is not, yet
    assert ack(node, "ahead", front["receipt_handle"]).status == 204  # frontier moves to 3
    assert consume(node, "ahead", "?partition=0").json()["offset"] == 4


def test_a_batch_ack_that_frees_the_in_flight_cap_wakes_a_parked_consumer(tmp_path: Path) -> None:
    """A batch ack tells the partition's waiters once, with the count of records it settled
    (not once a record): a consumer parked while the in-flight cap was full is woken by it
    and takes both records the cap held back. A parked poll's own re-check is set to 60 s
    here, beyond its 10 s wait: without the wake it would find them only at the end of it."""
    node = Node(tmp_path / "data", workers=1, env={"NARAD_FAULT_PARK_RECHECK_MS": "60000"}).start()
    try:
        _batch_ack_wakes(node)
    finally:
        node.stop()


def _batch_ack_wakes(node: Node) -> None:
    name = "inflight-batch"
    mk(node, name, partitions=3, max_in_flight_per_partition=2)
    for _ in range(4):
        assert produce(node, name, b"m", "?partition=0").status == 202
    wait_for(lambda: node.get(f"/v1/topics/{name}?partition=0").json()["partition_stats"][0]["high_watermark"] == 4)
    hdr = {"X-Narad-Client": "t"}
    held = consume(node, name, "?partition=0&max=2", headers=hdr).json()["messages"]
    assert sorted(m["offset"] for m in held) == [0, 1]
    assert consume(node, name, "?partition=0").status == 204  # the cap is full
    out: dict[str, Any] = {}

    def park() -> None:
        t0 = time.monotonic()
        out["r"] = consume(node, name, "?partition=0&wait=10s&max=2", headers=hdr)
        out["secs"] = time.monotonic() - t0

    parked = node.metric("narad_consume_waiters")
    th = threading.Thread(target=park)
    th.start()
    node.wait_parked(int(parked) + 1)
    r = node.request("POST", f"/v1/topics/{name}/ack",
                     json.dumps({"receipt_handles": [m["receipt_handle"] for m in held]}).encode(), headers=JSON)
    assert r.status == 200 and [x["status"] for x in r.json()["results"]] == [204, 204]
    th.join(30)
    assert out["r"].status == 200, out
    assert sorted(m["offset"] for m in out["r"].json()["messages"]) == [2, 3]
    # woken, not found by the last look at the end of its wait (10 s: the node's maximum)
    assert out["secs"] < 5, out


def test_topic_delete_answers_parked_long_polls_and_recreate_starts_empty(node: Node) -> None:
    mk(node, "doomed")
    for i in range(5):
        assert produce(node, "doomed", f"old-{i}".encode()).status == 202
    drain(node, "doomed", wait="300ms", idle_rounds=1)
    for i in range(3):
        assert produce(node, "doomed", f"unconsumed-{i}".encode()).status == 202
    wait_for(lambda: sum(s["high_watermark"] for s in node.get("/v1/topics/doomed").json()["partition_stats"]) == 8)
    mk(node, "doomed-wait")
    out: dict[str, Any] = {}
    waiter = threading.Thread(target=_parked_consume, args=(node, "doomed-wait", "10s", node.conn(), out))
    waiter.start()
    node.wait_parked(1)
    assert node.request("DELETE", "/v1/topics/doomed-wait").status == 204
    waiter.join(15)
    assert out["status"] in (204, 404) and out["seconds"] < 5
    assert node.request("DELETE", "/v1/topics/doomed").status == 204
    assert produce(node, "doomed", b"x").status == 404
    mk(node, "doomed")
    assert consume(node, "doomed", "?wait=500ms").status == 204  # nothing of the old life
    assert produce(node, "doomed", b"new").status == 202
    assert [m["payload"] for m in drain(node, "doomed")] == ["new"]
    # The old incarnation's directory is removed once the delete is confirmed.
    topics_dir = node.data_dir / "topics"
    wait_for(lambda: len([d for d in topics_dir.iterdir() if d.name.startswith("doomed@")]) == 1,
             what="old incarnation data removed")


def test_partition_count_grows_and_new_partitions_serve_at_once(node: Node) -> None:
    mk(node, "grow", partitions=3)
    assert produce(node, "grow", b"x", "?partition=5").status == 400
    r = node.request("PATCH", "/v1/topics/grow", {"partitions": 6})
    assert r.status == 200 and r.json()["partitions"] == 6
    assert produce(node, "grow", b"on-5", "?partition=5").status == 202
    m = consume(node, "grow", "?partition=5&wait=2s").json()
    assert m["payload"] == "on-5" and m["partition"] == 5


def test_describe_reports_partition_stats(node: Node) -> None:
    mk(node, "stats", partitions=3)
    for _ in range(4):
        assert produce(node, "stats", b"s", "?partition=1").status == 202
    wait_for(lambda: node.get("/v1/topics/stats?partition=1").json()["partition_stats"][0]["high_watermark"] == 4)
    m = consume(node, "stats", "?partition=1").json()
    st = node.get("/v1/topics/stats?partition=1").json()["partition_stats"][0]
    assert st["in_flight"] == 1 and st["lag"] == 4 and st["committed_offset"] == -1 and st["oldest_offset"] == 0
    assert ack(node, "stats", m["receipt_handle"]).status == 204
    st = node.get("/v1/topics/stats?partition=1").json()["partition_stats"][0]
    assert st["committed_offset"] == 0 and st["lag"] == 3 and st["in_flight"] == 0


def _window_frontiers(data_dir: Path, topic: str) -> dict[int, int]:
    out = {}
    for d in (data_dir / "topics").glob(f"{topic}@*/p*"):
        raw = (d / "consumer.ahead").read_bytes()
        slots = [s for s in (_decode(raw[:SLOT]), _decode(raw[SLOT:])) if s is not None]
        out[int(d.name[1:])] = max(slots)[1] if slots else -1
    return out


def test_acks_survive_graceful_restart_and_kill9(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=2).start()
    try:
        mk(n, "persist", partitions=4)
        h = History(30.0)
        for i in range(60):
            assert produce_recorded(h, str(i), n, "persist", str(i).encode()).status == 202
        acked = set()
        # Ack 40, out of order within each batch (acks held above the frontier persist too).
        while len(acked) < 40:
            r = consume_recorded(h, n, "persist", "?wait=2s&max=10", headers={"X-Narad-Client": "t"})
            assert r.status == 200
            msgs = r.json()["messages"][: 40 - len(acked)]
            for m in reversed(msgs):
                assert settle_recorded(h, n, "persist", m).status == 204
                acked.add(m["payload"])
            for m in r.json()["messages"][len(msgs):]:
                assert settle_recorded(h, n, "persist", m, extend="0").status == 204
        with h.fault("graceful stop and restart"):
            assert n.stop() == 0
            n.start()
        rest = {m["payload"] for m in drain(n, "persist", h=h)}
        assert rest.isdisjoint(acked), "a graceful restart redelivers nothing acked"
        assert len(rest) == 20
        # kill -9: acks older than one commit tick (~100 ms) are already in the page cache.
        for i in range(60, 80):
            assert produce_recorded(h, str(i), n, "persist", str(i).encode()).status == 202
        second = {m["payload"] for m in drain(n, "persist", wait="500ms", idle_rounds=1, h=h)}
        assert len(second) == 20
        hwms = {s["index"]: s["high_watermark"] for s in n.get("/v1/topics/persist").json()["partition_stats"]}
        wait_for(lambda: _window_frontiers(n.data_dir, "persist") == {p: hw - 1 for p, hw in hwms.items()},
                 what="acks written to the offset window")
        with h.fault("kill -9 and restart"):
            n.kill9()
            n.start()
        assert consume_recorded(h, n, "persist", "?wait=1s").status == 204, \
            "acked before the kill, so nothing comes back"
        verdict(h, "acks across a graceful restart and a kill -9", "faults")
    finally:
        n.close()


def test_per_identity_consume_cap(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=2, env={"NARAD_HTTP_MAX_CONSUME_IN_FLIGHT_PER_IDENTITY": "2"}).start()
    try:
        mk(n, "capped")
        outs: list[dict[str, Any]] = [{}, {}]
        threads = [threading.Thread(target=_parked_consume, args=(n, "capped", "3s", n.conn(), o)) for o in outs]
        for t in threads:
            t.start()
        n.wait_parked(2)
        r = consume(n, "capped")
        assert r.status == 429 and "limit 2 per node" in r.json()["error"]
        for t in threads:
            t.join(10)
        assert [o["status"] for o in outs] == [204, 204]
        assert consume(n, "capped").status == 204  # the budget came back
    finally:
        n.close()
