"""Retry with delay (issue 14): a nack with a delay, a per-consume lease length
(``visibility``) and an extend by a given length, on a real node with two forked
workers (the settle and consume hops between workers are exercised), plus a
3-node cluster (the nack sent to a node that does not own the partition, checked
by the delivery-contract checker) and a kill -9 of the owner (the documented
bound: delays live in memory, so a restart delivers the record again at once)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from narad.api.messages import MAX_DELAY_S, duration_ms
from narad.broker.routing import owner_worker
from tests import contract as C
from tests.harness import Cluster, Node, Response, wait_for

OCTET = {"Content-Type": "application/octet-stream"}
BATCH = {"X-Narad-Client": "tests"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("retry") / "data", workers=2).start()
    yield n
    n.close()


PARTS = 3


W1_PART: dict[str, int] = {}  # topic -> the partition of it worker 1 owns, where every record goes


def other_worker_topic(prefix: str) -> str:
    """A topic with a partition worker 1 owns: records are produced there only, so every
    consume and settle sent to worker 0 hops (probe, AckReq)."""
    for i in range(1000):
        name = f"{prefix}{i}"
        for p in range(PARTS):
            if owner_worker(name, p, 2) == 1:
                W1_PART[name] = p
                return name
    raise AssertionError("no topic name with a partition of worker 1")


def mk(node: Node, prefix: str, **fields: Any) -> str:
    name = other_worker_topic(prefix)
    r = node.post("/v1/topics", {"name": name, "partitions": PARTS, **fields})
    assert r.status == 201, r
    return name


def produce(node: Node, name: str, body: bytes) -> None:
    assert node.post(f"/v1/topics/{name}/produce?partition={W1_PART[name]}", body, headers=OCTET).status == 202


def consume(node: Node, name: str, query: str = "", conn: Any = None) -> Response:
    return node.request("GET", f"/v1/topics/{name}/consume{'?' + query if query else ''}", conn=conn, headers=BATCH)


def take(node: Node, name: str, query: str = "", conn: Any = None, timeout: float = 10.0) -> dict[str, Any]:
    """The next consume answer with records (a 202 is durable before it is committed
    at the owner: the first consumes may find nothing yet)."""
    r = wait_for(lambda: (lambda x: x if x.status == 200 else None)(consume(node, name, query, conn)), timeout, 0.02,
                 f"a record of {name}")
    return r.json()  # type: ignore[no-any-return]


def error(r: Response) -> str:
    assert r.status == 400, r
    return str(r.json()["error"])


def test_a_nack_with_a_delay_is_not_delivered_before_it_then_is(node: Node) -> None:
    name = mk(node, "rd-single-")
    produce(node, name, b"m1")
    w0 = node.worker_connection(0)  # the partition is worker 1's: every call below hops
    m = take(node, name, conn=w0)
    t_nack = time.monotonic()
    r = node.post(f"/v1/topics/{name}/ack?receipt_handle={m['receipt_handle']}&extend=0&delay=2s", conn=w0)
    assert r.status == 204, r
    assert consume(node, name, conn=w0).status == 204  # held back
    assert consume(node, name).status == 204  # on any worker
    row = next(s for s in node.get(f"/v1/topics/{name}").json()["partition_stats"] if s["index"] == m["partition"])
    assert row["delayed"] == 1 and row["in_flight"] == 0, row  # describe shows the delayed record
    again = take(node, name)
    assert time.monotonic() - t_nack >= 2.0 - 0.05
    assert (again["partition"], again["offset"]) == (m["partition"], m["offset"]) and again["payload"] == "m1"
    assert node.post(f"/v1/topics/{name}/ack?receipt_handle={again['receipt_handle']}").status == 204


def test_a_batch_nack_delay_applies_to_every_handle(node: Node) -> None:
    name = mk(node, "rd-batch-")
    for i in range(3):
        produce(node, name, f"b{i}".encode())
    w0 = node.worker_connection(0)
    msgs: list[dict[str, Any]] = []
    wait_for(lambda: msgs.extend(take(node, name, "max=3", conn=w0)["messages"]) or len(msgs) >= 3, 10, 0.0,
             "three records")
    t_nack = time.monotonic()
    r = node.post(f"/v1/topics/{name}/ack?extend=0",
                  {"receipt_handles": [m["receipt_handle"] for m in msgs], "delay": "1500ms"}, conn=w0)
    assert r.status == 200 and [x["status"] for x in r.json()["results"]] == [204, 204, 204], r
    assert consume(node, name, "max=3").status == 204
    got: list[dict[str, Any]] = []

    def drained() -> bool:
        r = consume(node, name, "max=3")
        if r.status == 200:
            got.extend(r.json()["messages"])
        return len(got) >= 3

    wait_for(drained, 10, 0.05, "the three delayed records back")
    assert time.monotonic() - t_nack >= 1.5 - 0.05
    assert sorted(m["payload"] for m in got) == sorted(m["payload"] for m in msgs)
    r = node.post(f"/v1/topics/{name}/ack", {"receipt_handles": [m["receipt_handle"] for m in got]})
    assert [x["status"] for x in r.json()["results"]] == [204, 204, 204]


def test_bad_values_are_400s_that_say_what_to_fix(node: Node) -> None:
    name = mk(node, "rd-bad-")
    produce(node, name, b"x")
    h = take(node, name)["receipt_handle"]
    base = f"/v1/topics/{name}/ack?receipt_handle={h}"
    assert "duration" in error(node.post(base + "&extend=0&delay=30"))  # no unit
    assert "duration" in error(node.post(base + "&extend=0&delay=3d"))  # wrong unit
    assert "12h" in error(node.post(base + "&extend=0&delay=13h"))
    assert "duration" in error(node.post(base + "&extend=0&delay=-1s"))
    assert "nack only" in error(node.post(base + "&delay=1s"))  # an ack
    assert "nack only" in error(node.post(base + "&extend=true&delay=1s"))
    assert "extend only" in error(node.post(base + "&visibility=1m"))  # an ack
    assert "extend only" in error(node.post(base + "&extend=0&visibility=1m"))
    assert "1s to 12h" in error(node.post(base + "&extend=true&visibility=500ms"))
    assert "1s to 12h" in error(node.post(base + "&extend=true&visibility=13h"))
    assert "more than once" in error(node.post(base + "&extend=0&delay=1s&delay=2s"))
    assert "1s to 12h" in error(consume(node, name, "visibility=0s"))
    assert "duration" in error(consume(node, name, "visibility=abc"))
    assert "offset" in error(consume(node, name, "partition=0&offset=0&visibility=5s"))
    ack = f"/v1/topics/{name}/ack"
    assert "duration string" in error(node.post(ack + "?extend=0", {"receipt_handles": [h], "delay": 30}))
    assert "nack only" in error(node.post(ack, {"receipt_handles": [h], "delay": "1s"}))
    assert "extend only" in error(node.post(ack + "?extend=0", {"receipt_handles": [h], "visibility": "1m"}))
    assert "12h" in error(node.post(ack + "?extend=0", {"receipt_handles": [h], "delay": "24h"}))
    assert "both" in error(node.post(ack + "?extend=0&delay=1s", {"receipt_handles": [h], "delay": "1s"}))
    # nothing above touched the lease: it is still live and acks
    assert node.post(base).status == 204


def test_a_parked_long_poll_is_woken_when_the_delay_falls_due(node: Node) -> None:
    name = mk(node, "rd-park-")
    produce(node, name, b"p")
    m = take(node, name)
    delay = 2.0
    assert node.post(f"/v1/topics/{name}/ack?receipt_handle={m['receipt_handle']}&extend=0&delay=2s").status == 204
    due = time.monotonic() + delay
    out: dict[str, Any] = {}
    w0 = node.worker_connection(0)  # parked on the worker that does not own the partition

    def poll() -> None:
        out["r"] = consume(node, name, "wait=15s", conn=w0)
        out["at"] = time.monotonic()

    th = threading.Thread(target=poll)
    th.start()
    th.join(20)
    assert out["r"].status == 200 and out["r"].json()["payload"] == "p", out
    assert out["at"] >= due - 0.05  # never early
    late = out["at"] - due
    # Woken by the 1 s sweep (or its own 1 s re-check), not at the end of its 15 s wait; the
    # bound is generous (a loaded CI box), the figure is printed.
    print(f"\nparked poll got the delayed record {late:.2f}s after it fell due")
    assert late < 6.0, f"the parked poll got the record {late:.2f}s after it fell due (its wait was 15 s)"
    assert node.post(f"/v1/topics/{name}/ack?receipt_handle={out['r'].json()['receipt_handle']}").status == 204


def test_a_per_consume_visibility_sets_that_deliverys_lease(node: Node) -> None:
    name = mk(node, "rd-vis-", visibility_timeout_ms=60_000)
    produce(node, name, b"short")
    produce(node, name, b"long")
    w0 = node.worker_connection(0)
    b = take(node, name, "visibility=30s", conn=w0)  # a probe of worker 1 carries it
    a = take(node, name, "visibility=1s", conn=w0)
    t_a = time.monotonic()
    # the 1 s lease expires and comes back (the topic's 60 s would not); the 30 s one does not
    back = take(node, name)  # the 1 s lease expired
    assert back["payload"] == a["payload"] and time.monotonic() - t_a >= 1.0 - 0.05
    assert consume(node, name).status == 204  # the 30 s lease still holds
    assert node.post(f"/v1/topics/{name}/ack?receipt_handle={b['receipt_handle']}").status == 204
    assert node.post(f"/v1/topics/{name}/ack?receipt_handle={a['receipt_handle']}").status == 410  # expired
    assert node.post(f"/v1/topics/{name}/ack?receipt_handle={back['receipt_handle']}").status == 204


def test_extend_by_a_given_duration(node: Node) -> None:
    name = mk(node, "rd-ext-", visibility_timeout_ms=60_000)
    produce(node, name, b"e1")
    produce(node, name, b"e2")
    w0 = node.worker_connection(0)
    a = take(node, name, "visibility=30s", conn=w0)
    b = take(node, name, "visibility=30s", conn=w0)
    # a: shortened to 1 s (single form); b: extended to 2 min (batch form)
    assert node.post(f"/v1/topics/{name}/ack?receipt_handle={a['receipt_handle']}&extend=true&visibility=1s",
                     conn=w0).status == 204
    r = node.post(f"/v1/topics/{name}/ack?extend=true", {"receipt_handles": [b["receipt_handle"]],
                                                         "visibility": "2m"}, conn=w0)
    assert r.json()["results"] == [{"status": 204}], r
    back = take(node, name)  # the lease set to 1 s by the extend expired
    assert back["payload"] == a["payload"]
    assert consume(node, name).status == 204  # b's 2 min lease holds
    r = node.post(f"/v1/topics/{name}/ack", {"receipt_handles": [b["receipt_handle"], back["receipt_handle"]]})
    assert [x["status"] for x in r.json()["results"]] == [204, 204]


def test_sdk_nack_delay_extend_visibility_and_consume_visibility(node: Node) -> None:
    from narad.client import Client
    from narad.client.errors import BadRequest, LeaseGone
    from tests.harness import ADMIN_PASSWORD

    name = mk(node, "rd-sdk-", visibility_timeout_ms=60_000)
    produce(node, name, b"s1")
    produce(node, name, b"s2")
    with Client(f"127.0.0.1:{node.port}", auth=("admin", ADMIN_PASSWORD)) as c:
        m = wait_for(lambda: c.consume(name, visibility=30.0), 10, 0.02, "a record")
        t_nack = time.monotonic()
        c.nack(name, m, delay=1.5)
        n = wait_for(lambda: c.consume(name, visibility=30.0), 10, 0.02, "the other record")
        assert n.payload != m.payload
        c.extend(name, n, visibility=1.0)  # shortened: comes back after ~1 s
        got = []
        wait_for(lambda: got.extend(c.consume_batch(name, 2)) or len(got) >= 2, 10, 0.02, "both back")
        assert time.monotonic() - t_nack >= 1.5 - 0.05
        assert sorted(x.payload for x in got) == sorted([m.payload, n.payload])
        with pytest.raises(LeaseGone):
            c.ack(name, m)  # the nacked handle is gone
        with pytest.raises(BadRequest, match="12h"):
            c.nack(name, got[0], delay=13 * 3600)
        res = c.ack_batch(name, got, mode="nack", delay=1.0)
        assert [r.status for r in res] == [204, 204]
        with pytest.raises(ValueError):
            c.ack_batch(name, got, delay=1.0)  # delay with an ack: refused before it is sent
        again: list[Any] = []
        wait_for(lambda: again.extend(c.consume_batch(name, 2)) or len(again) >= 2, 10, 0.02, "both back again")
        assert [r.status for r in c.ack_batch(name, again)] == [204, 204]


def test_the_trailing_wire_fields_decode_both_ways() -> None:
    """ConsumeReq.vis_ms and AckReq.dur_ms are trailing defaulted fields: a frame from a
    node without them decodes (0: the topic's lease, no delay), and one with them
    decodes at such a node (the field is dropped: the safe failure is Narad's behaviour)."""
    import msgspec

    from narad.broker import peers as P

    class OldConsumeReq(msgspec.Struct, tag="ConsumeReq", array_like=True):
        topic: str
        topic_id: str
        max: int
        partition: int | None = None
        scope: int = P.WORKER

    class OldAckReq(msgspec.Struct, tag="AckReq", array_like=True):
        topic: str
        topic_id: str
        mode: int
        items: list[tuple[int, int, int]]
        scope: int = P.WORKER

    enc = msgspec.msgpack.encode
    assert msgspec.msgpack.decode(enc(OldConsumeReq("t", "id", 3, 1, P.NODE)), type=P.ConsumeReq) == \
        P.ConsumeReq("t", "id", 3, 1, P.NODE, 0)
    assert msgspec.msgpack.decode(enc(OldAckReq("t", "id", 2, [(0, 1, 2)])), type=P.AckReq).dur_ms == 0
    assert msgspec.msgpack.decode(enc(P.ConsumeReq("t", "id", 3, None, P.WORKER, 5000)), type=OldConsumeReq) == \
        OldConsumeReq("t", "id", 3, None, P.WORKER)
    assert msgspec.msgpack.decode(enc(P.AckReq("t", "id", 2, [(0, 1, 2)], P.NODE, 30_000)), type=OldAckReq) == \
        OldAckReq("t", "id", 2, [(0, 1, 2)], P.NODE)


# ---- the partition's lease state (no node) ----------------------------------------------------------
def test_partition_delayed_offsets_are_held_back_uncounted_and_keep_it_open(tmp_path: Path) -> None:
    from tests.test_partition import _partition

    p = _partition(tmp_path, 3)
    d = p.reserve(100.0, 3, 30.0, 1024, 1024)
    assert [x.offset for x in d] == [0, 1, 2]
    assert p.nack(1, d[1].nonce, 100.0, 5.0) and p.nack(2, d[2].nonce, 100.0, 0.0)
    assert not p.nack(1, d[1].nonce, 100.0, 5.0)  # the lease is gone: 410
    assert p.ack(0, d[0].nonce, 100.0)
    assert p.available() == 1 and p.ready(1024, 1024) == 1  # offset 2 only; 1 is delayed
    assert p.next_expiry() == 105.0
    assert not p.evictable()
    got = p.reserve(104.9, 5, 30.0, 1024, 1024)
    assert [x.offset for x in got] == [2]
    assert p.reserve(104.99, 5, 30.0, 1024, 1024) == []  # never early
    assert p.purge(105.0) == 1 and p.available() == 1  # due: back in the redelivery queue
    again = p.reserve(105.0, 5, 30.0, 1024, 1024)
    assert [x.offset for x in again] == [1]
    # an extend sets the lease to now + the given length (shorter than before too)
    assert p.extend(1, again[0].nonce, 106.0, 1.0)
    assert p.reserve(106.5, 5, 30.0, 1024, 1024) == []
    assert [x.offset for x in p.reserve(107.0, 5, 30.0, 1024, 1024)] == [1]


def test_partition_a_delayed_nack_keeps_its_in_flight_slot(tmp_path: Path) -> None:
    """Leases plus delayed nacks never exceed max_in_flight (the memory of delays is
    bounded as the leases' is): nacking with a delay frees no slot until it falls due."""
    from tests.test_partition import _partition

    p = _partition(tmp_path, 4)
    d = p.reserve(100.0, 5, 30.0, 2, 1024)
    assert [x.offset for x in d] == [0, 1]
    assert p.nack(0, d[0].nonce, 100.0, 10.0)
    assert p.ready(2, 1024) == 0 and p.reserve(101.0, 5, 30.0, 2, 1024) == []
    assert p.nack(1, d[1].nonce, 101.0, 0.0)  # an immediate nack frees its slot: offset 1 again
    assert [x.offset for x in p.reserve(101.0, 5, 30.0, 2, 1024)] == [1]
    assert p.ready(2, 1024) == 0
    assert [x.offset for x in p.reserve(110.0, 5, 30.0, 3, 1024)] == [0, 2]  # due: back first, then the next


# ---- a 3-node cluster -------------------------------------------------------------------------------
def test_cluster_nack_with_delay_at_non_owners_and_the_bound_after_a_kill9(tmp_path: Path) -> None:
    """Nacks with a delay sent to a node that does not own (all of) the partitions are
    never delivered early (contract checker, strict); then a kill -9 of an owner holding
    a 60 s delayed nack: the record comes back after the restart, long before the 60 s
    (delays live in memory: the documented bound), and nothing is lost."""
    c = Cluster(tmp_path, 3, initial=3).start()
    try:
        c.leader()
        name = "rdc"
        assert c["n1"].post("/v1/topics", {"name": name, "partitions": PARTS,
                                           "visibility_timeout_ms": 10_000}).status == 201
        wait_for(lambda: all(c[n].get(f"/v1/topics/{name}").status == 200 for n in c.ids), 20, 0.05, "the topic")
        stats = c["n1"].get(f"/v1/topics/{name}").json()["partition_stats"]
        owner = {s["index"]: s["owner_node"] for s in stats}
        y = "n1"
        foreign = [k for k, o in owner.items() if o != y]
        assert foreign, owner  # with 3 nodes and 3 partitions some are another node's
        h = C.History(10.0)
        rec = C.Recorder(h, name)
        for i in range(6):  # two records in each partition, produced at y (keyless would stay on y's own)
            t0 = C.now()
            st = c[y].post(f"/v1/topics/{name}/produce?partition={i % PARTS}", f"m{i}:".encode(), headers=OCTET).status
            h.produced([f"m{i}"], t0, C.now(), st, y)
            assert st == 202
        got: list[C.Delivery] = []
        wait_for(lambda: got.extend(rec.consume(c[y], wait="1s", max_n=10) or []) or len(got) >= 6, 30, 0.0,
                 "six deliveries")
        assert {d.partition for d in got} & set(foreign), got  # some settle at another node
        assert rec.settle(c[y], got, "nack", delay_s=2.0) == [204] * len(got)
        acked: set[str] = set()

        def drain() -> bool:
            for nid in c.ids:
                ds = rec.consume(c[nid], wait="0s", max_n=10) or []
                if ds:
                    rec.settle(c[nid], ds, "ack")
                    acked.update(d.mid for d in ds)
            return acked >= {f"m{i}" for i in range(6)}

        wait_for(drain, 30, 0.05, "the delayed records back and acked")
        h.finish()
        v = C.check(h, "strict")
        assert v.ok and v.counts["nacks"] == 6, v.summary("retry delay across nodes")
        # ---- a per-consume visibility and an extend by a duration, sent to a non-owner node ----
        k = foreign[0]
        assert c[y].post(f"/v1/topics/{name}/produce?partition={k}", b"v0", headers=OCTET).status == 202
        r = wait_for(lambda: (lambda r: r if r.status == 200 else None)(
            c[y].get(f"/v1/topics/{name}/consume?partition={k}&visibility=1s&wait=1s")), 20, 0.05, "v0")
        assert r.json()["payload"] == "v0"
        t_lease = time.monotonic()
        r = wait_for(lambda: (lambda r: r if r.status == 200 else None)(
            c[y].get(f"/v1/topics/{name}/consume?partition={k}&wait=1s")), 7, 0.0,
            "v0 back after its 1 s lease (the topic's is 10 s)")
        assert r.json()["payload"] == "v0" and r.json()["delivery_count"] == 2
        assert time.monotonic() - t_lease >= 0.9
        h_v0 = r.json()["receipt_handle"]  # (this lease is the topic's 10 s)
        assert c[y].post(f"/v1/topics/{name}/ack?receipt_handle={h_v0}&extend=true&visibility=1s").status == 204
        r = wait_for(lambda: (lambda r: r if r.status == 200 else None)(
            c[y].get(f"/v1/topics/{name}/consume?partition={k}&wait=1s")), 7, 0.0,
            "v0 back after its extend to 1 s (not the topic's 10 s)")
        assert r.json()["payload"] == "v0" and r.json()["delivery_count"] == 3
        assert c[y].post(f"/v1/topics/{name}/ack?receipt_handle={r.json()['receipt_handle']}").status == 204
        # ---- kill -9 of the owner of a partition holding a delayed nack ----
        x = owner[k]
        h2 = C.History(10.0)
        t0 = C.now()
        assert c[y].post(f"/v1/topics/{name}/produce?partition={k}", b"k0:", headers=OCTET).status == 202
        h2.produced(["k0"], t0, C.now(), 202)
        t0 = C.now()
        r = c[y].get(f"/v1/topics/{name}/consume?partition={k}&wait=5s")
        assert r.status == 200, r
        d = C.record_delivery(h2, r.json(), t0, C.now(), y)
        t0 = C.now()
        r = c[y].post(f"/v1/topics/{name}/ack?receipt_handle={d.handle}&extend=0&delay=60s")
        assert r.status == 204, r
        h2.settled(C.Settle(d.handle, "nack", t0, C.now(), 204, delay_ns=60 * C.NS), "k0")
        t_nack = time.monotonic()
        with h2.fault(f"kill -9 of {x} (the owner of partition {k}) and its restart"):
            c[x].kill9()
            c[x].start()
        back: list[C.Delivery] = []

        def again() -> bool:
            for nid in c.ids:
                t1 = C.now()
                rr = c[nid].get(f"/v1/topics/{name}/consume?partition={k}&wait=0s")
                if rr.status == 200 and C.message_id(rr.json()["payload"]) != "k0":
                    # A first-phase record whose ack the kill -9 caught before the owner synced
                    # its offsets (at most ~1 s of acks): at least once, not this history's business.
                    c[nid].post(f"/v1/topics/{name}/ack?receipt_handle={rr.json()['receipt_handle']}")
                    return False
                if rr.status == 200:
                    back.append(C.record_delivery(h2, rr.json(), t1, C.now(), nid))
                    t2 = C.now()
                    a = c[nid].post(f"/v1/topics/{name}/ack?receipt_handle={back[-1].handle}")
                    h2.settled(C.Settle(back[-1].handle, "ack", t2, C.now(), a.status), "k0")
                    return a.status == 204
            return False

        wait_for(again, 45, 0.1, "the delayed record back after the owner's restart")
        assert time.monotonic() - t_nack < 60  # the delay was forgotten with the owner's memory
        h2.finish()
        v2 = C.check(h2, "faults")
        assert v2.ok and v2.allowed["delayed_early"] == 1, v2.summary("delayed nack across a kill -9")
    finally:
        C.stop_all()
        c.close()


def test_consume_forever_retry_delay_holds_a_failed_message_back(node: Node) -> None:
    """The SDK's worker pool with ``retry_delay``: a handler that raises has its message
    nacked with that delay; it comes back not before it, and is then acked."""
    import asyncio

    from narad.client import AsyncClient
    from tests.harness import ADMIN_PASSWORD

    name = mk(node, "rd-loop-", visibility_timeout_ms=60_000)
    produce(node, name, b"job")
    seen: list[float] = []

    async def run() -> list[str]:
        async with AsyncClient(f"127.0.0.1:{node.port}", auth=("admin", ADMIN_PASSWORD)) as c:
            async def handler(m: Any) -> None:
                seen.append(time.monotonic())
                if len(seen) == 1:
                    raise RuntimeError("first attempt fails")

            with pytest.raises(ValueError):
                c.consume_forever(name, handler, on_failure="lapse", retry_delay=1.0)
            loop = c.consume_forever(name, handler, wait=1.0, retry_delay=1.5)
            outcomes: list[str] = []
            async for o in loop:
                outcomes.append(o.result)
                if o.result == "acked":
                    loop.request_stop()
            return outcomes

    outcomes = asyncio.run(asyncio.wait_for(run(), 30))
    assert outcomes == ["nacked", "acked"], outcomes
    assert seen[1] - seen[0] >= 1.5 - 0.1, seen  # held back by the delay, not redelivered at once


def test_durations_round_up_to_whole_milliseconds() -> None:
    """A delay (or a lease) is kept in whole ms, rounded up: never shorter than asked, so a
    delayed nack is never delivered early (400us was no delay at all, 1.4ms was 1 ms)."""
    got = [duration_ms(x, "delay", 0.0, MAX_DELAY_S) for x in ("0", "100ns", "400us", "1ms", "1.4ms", "0.1s", "12h")]
    assert got == [0, 1, 1, 1, 2, 100, 12 * 3600 * 1000]


def test_a_single_form_ack_refuses_settings_given_in_its_body(node: Node) -> None:
    """The single form (receipt_handle in the query) reads no body, as Narad's; a body
    giving delay / visibility / reason meant them, so it is a 400 saying where they go
    (it was a 204 and a nack at once: the record came straight back). A body without
    them is ignored as before, and the lease is untouched by the refused call."""
    name = mk(node, "rd-body-", visibility_timeout_ms=60_000)
    produce(node, name, b"m1")
    m = take(node, name)
    h = m["receipt_handle"]
    for body in ({"delay": "30s"}, {"visibility": "2m"}, {"reason": "bad", "other": 1}):
        r = node.post(f"/v1/topics/{name}/ack?receipt_handle={h}&extend=0", body)
        assert "query parameter" in error(r) and next(iter(body)) in error(r)
    assert consume(node, name).status == 204  # still leased: nothing was nacked
    r = node.post(f"/v1/topics/{name}/ack?receipt_handle={h}&extend=true", {"receipt_handles": ["x"], "n": "delay"})
    assert r.status == 204, r  # a body without those fields is ignored, as Narad does
    assert node.post(f"/v1/topics/{name}/ack?receipt_handle={h}", b"not json delay", headers=OCTET).status == 204


def test_a_very_long_duration_is_refused_without_stalling_the_worker(node: Node) -> None:
    """Durations are parsed in linear time, and one over 100 characters is refused unread
    (a run of digits made the old term search quadratic: 12,000 digits held a worker's
    loop for 4 s, a request can carry 60,000). Found by a review of issue 14."""
    from narad.api.messages import parse_go_duration

    for text in ("1" * 60_000, "1" * 99, "1s" * 50 + "x"):
        with pytest.raises(ValueError):
            parse_go_duration(text)  # (the old parser took minutes on the first: the test times out)
    assert parse_go_duration("1s" * 50) == 50.0  # 100 characters: still read
    name = mk(node, "rd-long-")
    produce(node, name, b"x")
    h = take(node, name)["receipt_handle"]
    digits = "1" * 60_000
    assert "duration" in error(node.post(f"/v1/topics/{name}/ack?extend=0", {"receipt_handles": [h], "delay": digits}))
    assert "duration" in error(consume(node, name, f"visibility={digits[:20_000]}"))
    assert node.post(f"/v1/topics/{name}/ack?receipt_handle={h}").status == 204  # the lease was untouched
