"""Fan-out, delay and replica children across a 3-node cluster (issue 11), with real
processes: three nodes with one worker each, shared by every test of this module.

What is shown: messages produced to a parent at every node arrive in every child (two
plain children, a delay child, a replica child), each consumed and acked on its own,
at any node (every child's history gets the delivery-contract checker's strict
verdict); nothing committed before an attach is copied; a replica child's partition p
sits on another node than parent partition p; detach stops the copy and the child
keeps its data; a create-as-child whose attach point cannot be read (an owner of a
parent partition is down) answers 503 and leaves no child; the delay child delivers
nothing before its due time and everything soon after; the status codes of the
children routes, asked at a follower (forwarded to the leader); a detach made while a
parent owner was down holds when it returns. An attach (or create-as-child) succeeds
when the receiving node's replica, or the replica of an owner of parent partitions,
has not applied the parent's create yet (both once answered 503).

Imports tests.harness and tests.contract only.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from tests.contract import History, check, clock_samples, now, record_delivery, record_settles, wall_at
from tests.harness import Cluster, Node, wait_for

OCTET = {"Content-Type": "application/octet-stream"}
JSON_CT = {"Content-Type": "application/json"}
DELAY_MS = 2000
LATE_BOUND_S = 10.0  # "every message within a few seconds after due" (Narad: usually ~1 s)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("fan3"), 3).start()
    yield c
    c.close()


# ---- helpers (tests/test_fanout_chaos.py uses some of them) ------------------------------------

def create(n: Node, body: dict[str, Any]) -> dict[str, Any]:
    r = n.post("/v1/topics", body)
    assert r.status == 201, (body, r)
    return r.json()  # type: ignore[no-any-return]


def attach(n: Node, parent: str, child: str, delay_ms: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"child": child}
    if delay_ms:
        body["delay_ms"] = delay_ms
    r = n.post(f"/v1/topics/{parent}/children", body)
    assert r.status == 200, (parent, body, r)
    return r.json()  # type: ignore[no-any-return]


def describe(n: Node, topic: str) -> dict[str, Any]:
    r = n.get(f"/v1/topics/{topic}")
    assert r.status == 200, (topic, r)
    return r.json()  # type: ignore[no-any-return]


def owners(n: Node, topic: str) -> list[str]:
    return [s["owner_node"] for s in describe(n, topic)["partition_stats"]]


def hwm_total(n: Node, topic: str) -> int | None:
    """Sum of the partitions' high watermarks; None while an owner does not answer."""
    d = describe(n, topic)
    if d.get("partial"):
        return None
    return sum(s["high_watermark"] for s in d["partition_stats"])


def hwms_now(n: Node, topic: str, timeout: float = 20.0) -> list[int]:
    """Every partition's high watermark, once every owner answers."""
    end = time.monotonic() + timeout
    while True:
        d = describe(n, topic)
        if not d.get("partial"):
            return [s["high_watermark"] for s in d["partition_stats"]]
        assert time.monotonic() < end, f"describe {topic}: an owner did not answer for {timeout} s"


def total_now(n: Node, topic: str, timeout: float = 20.0) -> int:
    """``hwm_total`` once every owner answers (a describe under load can miss one for 2 s)."""
    end = time.monotonic() + timeout
    while True:
        v = hwm_total(n, topic)
        if v is not None:
            return v
        assert time.monotonic() < end, f"describe {topic}: an owner did not answer for {timeout} s"


def wait_everywhere(c: Cluster, topic: str, cond: Any = None, timeout: float = 20.0) -> None:
    """Wait until every node's replica has the topic (and ``cond(json)`` holds there)."""
    for nid in c.initial:
        def ok(nid: str = nid) -> bool:
            r = c[nid].get(f"/v1/topics/{topic}")
            return r.status == 200 and (cond is None or bool(cond(r.json())))
        wait_for(ok, timeout, 0.05, f"{topic} on {nid}")


def wait_hwm(n: Node, topic: str, total: int, timeout: float = 30.0) -> None:
    wait_for(lambda: hwm_total(n, topic) == total, timeout, 0.05, f"{topic} to hold {total} messages")


def produce_batch(n: Node, topic: str, mids: list[str], keys: list[str | None] | None = None,
                  hs: Sequence[History] = ()) -> None:
    """One batch produce answered 202, recorded in every history of ``hs``."""
    msgs = [{"payload": m} | ({"key": k} if k is not None else {}) for m, k in zip(mids, keys or [None] * len(mids),
                                                                                     strict=True)]
    t0 = now()
    r = n.post(f"/v1/topics/{topic}/produce/batch", {"messages": msgs})
    t1 = now()
    for h in hs:
        h.produced(mids, t0, t1, r.status, n.node_id)
    assert r.status == 202 and r.json()["accepted"] == len(mids), r


def produce_one(n: Node, topic: str, mid: str, key: str | None = None, hs: Sequence[History] = ()) -> None:
    q = f"?key={key}" if key is not None else ""
    t0 = now()
    st = n.request("POST", f"/v1/topics/{topic}/produce{q}", mid.encode(), headers=OCTET).status
    t1 = now()
    for h in hs:
        h.produced([mid], t0, t1, st, n.node_id)
    assert st == 202, (topic, mid, st)


def drain(n: Node, topic: str, want: set[str], h: History, ack_at: Node | None = None, timeout: float = 40.0
          ) -> list[dict[str, Any]]:
    """Consume at ``n`` and ack at ``ack_at`` until every id of ``want`` came; every
    delivery and per-handle ack answer recorded in ``h``. Returns the messages."""
    got: list[dict[str, Any]] = []
    seen: set[str] = set()
    ack_node = ack_at or n
    conn, aconn = n.conn(), ack_node.conn()
    end = time.monotonic() + timeout
    try:
        while not want <= seen and time.monotonic() < end:
            t0 = now()
            r = n.request("GET", f"/v1/topics/{topic}/consume?wait=1s&max=100", headers={"X-Narad-Client": "t"},
                          conn=conn)
            t1 = now()
            if r.status == 204:
                continue
            assert r.status == 200, (topic, r)
            msgs = r.json()["messages"]
            got += msgs
            ds = [record_delivery(h, m, t0, t1, n.node_id, mid=str(m["payload"])) for m in msgs]
            seen |= {d.mid for d in ds}
            t0 = now()
            a = ack_node.request("POST", f"/v1/topics/{topic}/ack",
                                 json.dumps({"receipt_handles": [m["receipt_handle"] for m in msgs]}).encode(),
                                 headers=JSON_CT, conn=aconn)
            statuses = ([x["status"] for x in a.json()["results"]] if a.status == 200
                        else [a.status if a.status < 500 else None] * len(ds))
            record_settles(h, ds, "ack", t0, now(), statuses)
            assert all(s == 204 for s in statuses), (topic, a)
    finally:
        conn.close()
        aconn.close()
    assert want <= seen, f"{topic}: {len(want - seen)} of {len(want)} never arrived, e.g. {sorted(want - seen)[:5]}"
    return got


def verdict(h: History, name: str) -> None:
    h.finish()
    v = check(h, "strict")
    print("\n" + v.summary(name))
    assert v.ok, v.summary(name)


def delay_figures(h: History, delay_ms: int) -> tuple[list[str], float]:
    """(deliveries that came before their due time for certain, the largest lateness in s).
    A delivery whose consume returned before its produce was even sent + the delay was
    early, both instants read on the wall clock (``contract.wall_at``): a node stamps a
    commit and opens a delay child's gate by the wall clock, which on this VM gains up to
    ~1 ms a second on the monotonic clock the history keeps (a run once saw deliveries 1 to
    10 ms "early" by the monotonic clock alone). Lateness is measured from the produce's
    202 + the delay (an upper bound)."""
    produces, deliveries, _, _ = h.snapshot()
    sent = {mid: p for p in produces for mid in p.ids if p.status == 202}
    early, late = [], 0.0
    first: dict[str, int] = {}
    clock = clock_samples()
    for d in deliveries:
        p = sent.get(d.mid)
        if p is None:
            continue
        short = wall_at(p.call, clock) + delay_ms * 1_000_000 - wall_at(d.ret, clock)
        if short > 0:
            early.append(f"{d.mid} delivered {short / 1e6:.0f} ms before due")
        first[d.mid] = min(first.get(d.mid, d.ret), d.ret)
    for mid, t in first.items():
        late = max(late, (t - sent[mid].ret) / 1e9 - delay_ms / 1000)
    return early, late


# ---- tests --------------------------------------------------------------------------------------------

def test_every_child_gets_every_message_produced_at_every_node(cluster: Cluster) -> None:
    n1, n2, n3 = (cluster[n] for n in cluster.initial)
    leader = cluster.leader()
    follower = cluster[next(n for n in cluster.initial if n != leader)]
    create(n1, {"name": "orders", "partitions": 6})
    create(n2, {"name": "orders-a", "partitions": 3})  # a different partition count: keyless round-robin
    create(n3, {"name": "orders-b", "partitions": 6})
    create(n1, {"name": "orders-d", "partitions": 3})
    for t in ("orders", "orders-a", "orders-b", "orders-d"):
        wait_everywhere(cluster, t)
    attach(follower, "orders", "orders-a")
    attach(n2, "orders", "orders-b")
    parent = attach(n3, "orders", "orders-d", delay_ms=DELAY_MS)
    assert parent["role"] == "parent" and parent["children"] == ["orders-a", "orders-b", "orders-d"], parent
    rep = create(follower, {"name": "orders-r", "parent": "orders"})  # a replica child
    assert rep["role"] == "child" and rep["parent"] == "orders" and rep["partitions"] == 6, rep
    children = ["orders-a", "orders-b", "orders-d", "orders-r"]
    wait_everywhere(cluster, "orders", lambda j: j.get("children") == children)

    # The replica child's partition p is on another node than the parent's partition p.
    po, ro = owners(n1, "orders"), owners(n1, "orders-r")
    assert all(ro[p] and ro[p] != po[p] for p in range(6)), (po, ro)
    # Topic answers carry the link, at every node.
    for nid in cluster.initial:
        d = describe(cluster[nid], "orders-d")
        assert d["role"] == "child" and d["parent"] == "orders" and d["delay_ms"] == DELAY_MS, d
        assert len(d["attach_epoch"]) == 16 and len(d["attach_offsets"]) == 6, d
        assert all(o == 0 for o in d["attach_offsets"]), d  # nothing was produced yet
    listing = follower.get("/v1/topics/orders/children")
    assert listing.status == 200, listing
    rows = {c["name"]: c for c in listing.json()["children"]}
    assert listing.json()["parent"] == "orders" and sorted(rows) == children, listing.json()
    assert rows["orders-d"]["delay_ms"] == DELAY_MS and rows["orders-a"]["delay_ms"] == 0

    hs = {t: History(30.0) for t in ["orders", *children]}
    every = list(hs.values())
    # Consumers run while the messages are produced: the delay child is watched from the start.
    results: dict[str, Any] = {}

    ids: dict[str, set[str]] = {}
    for n in (n1, n2, n3):
        batch = [f"{n.node_id}-b{i}" for i in range(20)]
        keyed = [f"{n.node_id}-k{i}" for i in range(6)]
        ids[n.node_id] = set(batch) | set(keyed)
    want = set().union(*ids.values())

    plan = {"orders": (n2, n3), "orders-a": (n1, n2), "orders-b": (n2, n3), "orders-d": (n3, n1),
            "orders-r": (n1, n3)}  # topic -> (consumed at, acked at)

    def consumer(topic: str) -> None:
        try:
            at, ack = plan[topic]
            results[topic] = drain(at, topic, want, hs[topic], ack_at=ack, timeout=60)
        except BaseException as e:  # reported by the main thread
            results[topic] = e

    threads = [threading.Thread(target=consumer, args=(t,), daemon=True) for t in plan]
    for t in threads:
        t.start()
    keys: dict[str, str] = {}
    for n in (n1, n2, n3):
        produce_batch(n, "orders", [f"{n.node_id}-b{i}" for i in range(20)], hs=every)
        for i in range(6):
            mid = f"{n.node_id}-k{i}"
            keys[mid] = f"key-{i}"
            produce_one(n, "orders", mid, keys[mid], hs=every)
    for t in threads:
        t.join(90)
    for topic in plan:
        r = results.get(topic)
        assert not isinstance(r, BaseException), f"{topic}: {r!r}"
        assert r is not None, f"{topic}: the consumer did not finish"
        got = {str(m["payload"]): m for m in r}
        assert set(got) == want, (topic, sorted(set(got) ^ want)[:10])
        for mid, k in keys.items():  # the key travels with the copy
            assert got[mid].get("key") == k, (topic, got[mid])
        verdict(hs[topic], f"fan-out: {topic} (consumed at {plan[topic][0].node_id}, acked at "
                           f"{plan[topic][1].node_id})")
    # Keyless messages keep their partition index in a child with the same count (orders-b, orders-r).
    parent_part = {str(m["payload"]): m["partition"] for m in results["orders"]}
    for topic in ("orders-b", "orders-r"):
        moved = [m for m in results[topic] if str(m["payload"]) not in keys
                 and m["partition"] != parent_part[str(m["payload"])]]
        assert not moved, (topic, moved[:3])
    # The delay child: nothing before it was due, everything soon after.
    early, late = delay_figures(hs["orders-d"], DELAY_MS)
    print(f"delay child ({DELAY_MS} ms): {len(early)} early deliveries; latest message {late:.2f} s after due "
          f"(measured from the produce's 202)")
    assert not early, early[:5]
    assert late < LATE_BOUND_S, f"a message of the delay child came {late:.1f} s after it was due"
    # Every child's lag is 0 once it is all copied, and every partition reported.
    def caught_up() -> bool:
        rows = follower.get("/v1/topics/orders/children").json()["children"]
        return all(c["lag_messages"] == 0 and c["lag_complete"] for c in rows)
    wait_for(caught_up, 20, 0.1, "every child listed with lag 0")


def test_nothing_committed_before_the_attach_is_copied(cluster: Cluster) -> None:
    n1, n2, n3 = (cluster[n] for n in cluster.initial)
    create(n1, {"name": "late", "partitions": 6})
    create(n2, {"name": "late-c", "partitions": 3})
    wait_everywhere(cluster, "late")
    wait_everywhere(cluster, "late-c")
    before = [f"before-{n.node_id}-{i}" for n in (n1, n2, n3) for i in range(10)]
    for n in (n1, n2, n3):
        produce_batch(n, "late", [m for m in before if m.startswith(f"before-{n.node_id}-")])
    wait_hwm(n1, "late", len(before))  # all committed at their owners before the attach
    hwms = hwms_now(n3, "late")
    attach(n3, "late", "late-c")
    wait_everywhere(cluster, "late-c", lambda j: j.get("parent") == "late")
    child = describe(n3, "late-c")
    assert child["attach_offsets"] == hwms, (child, hwms)  # the attach point: each owner's committed HWM
    h = History(30.0)
    after = [f"after-{n.node_id}-{i}" for n in (n1, n2, n3) for i in range(10)]
    for n in (n1, n2, n3):
        produce_batch(n, "late", [m for m in after if m.startswith(f"after-{n.node_id}-")], hs=[h])
    wait_hwm(n2, "late-c", len(after))
    got = drain(n2, "late-c", set(after), h, ack_at=n1)
    assert {str(m["payload"]) for m in got} == set(after)
    assert total_now(n1, "late-c") == len(after)  # nothing else was copied
    verdict(h, "fan-out after the attach only: late-c")


def test_detach_stops_the_copy_and_the_child_keeps_its_data(cluster: Cluster) -> None:
    n1, n2, n3 = (cluster[n] for n in cluster.initial)
    create(n1, {"name": "det", "partitions": 3})
    create(n2, {"name": "det-c", "partitions": 3})
    create(n3, {"name": "det-k", "partitions": 3})
    for t in ("det", "det-c", "det-k"):
        wait_everywhere(cluster, t)
    attach(n2, "det", "det-k")
    attach(n3, "det", "det-c")
    wait_everywhere(cluster, "det", lambda j: j.get("children") == ["det-c", "det-k"])
    first = [f"d1-{n.node_id}-{i}" for n in (n1, n2, n3) for i in range(5)]
    for n in (n1, n2, n3):
        produce_batch(n, "det", [m for m in first if m.startswith(f"d1-{n.node_id}-")])
    wait_hwm(n1, "det-c", len(first))
    wait_hwm(n1, "det-k", len(first))
    assert not cursors_gone(cluster, "det", "det-c")  # the owners export a lag gauge per running cursor
    r = n2.request("DELETE", "/v1/topics/det/children/det-c")
    assert r.status == 204, r
    wait_everywhere(cluster, "det-c", lambda j: "role" not in j and "parent" not in j)
    wait_everywhere(cluster, "det", lambda j: j.get("children") == ["det-k"])
    assert [c["name"] for c in n3.get("/v1/topics/det/children").json()["children"]] == ["det-k"]
    assert n1.request("DELETE", "/v1/topics/det/children/det-c").status == 404  # not linked any more
    wait_for(lambda: cursors_gone(cluster, "det", "det-c"), 10, 0.1, "the cursors of det -> det-c to stop")
    second = [f"d2-{n.node_id}-{i}" for n in (n1, n2, n3) for i in range(5)]
    for n in (n1, n2, n3):
        produce_batch(n, "det", [m for m in second if m.startswith(f"d2-{n.node_id}-")])
    wait_hwm(n1, "det-k", len(first) + len(second))  # the child still attached got the second batch
    assert total_now(n1, "det-c") == len(first)  # the detached one did not
    h = History(30.0)
    h.produced(first, now(), now(), 202)
    got = drain(n3, "det-c", set(first), h)  # and it keeps (and serves) its data
    assert {str(m["payload"]) for m in got} == set(first)
    verdict(h, "detached child keeps its data: det-c")
    # A standalone topic again: direct produce works, and it can be attached again (a fresh copy).
    produce_one(n1, "det-c", "direct")
    again = attach(n1, "det", "det-c")
    assert again["children"] == ["det-c", "det-k"]
    wait_everywhere(cluster, "det-c", lambda j: j.get("parent") == "det")
    assert describe(n1, "det-c")["attach_offsets"] == hwms_now(n1, "det")


def cursors_gone(c: Cluster, parent: str, child: str) -> bool:
    """No node exports a fan-out lag gauge for (parent, child) any more: the owners'
    cursors for the link stopped (a cursor drops its gauge series when it ends)."""
    p, ch = f'parent="{parent}"', f'child="{child}"'
    for nid in c.initial:
        body = c[nid].get("/metrics").body.decode(errors="replace")
        if any(ln.startswith("narad_fanout_lag_messages{") and p in ln and ch in ln for ln in body.splitlines()):
            return False
    return True


def test_children_status_codes_at_a_follower(cluster: Cluster) -> None:
    leader = cluster.leader()
    f = cluster[next(n for n in cluster.initial if n != leader)]
    create(f, {"name": "codes", "partitions": 3})
    create(f, {"name": "codes-c", "partitions": 3})
    create(f, {"name": "codes-d", "partitions": 3})
    create(f, {"name": "codes-x", "partitions": 3})
    create(f, {"name": "codes-short", "partitions": 3, "retention_ms": 3_600_000})
    for t in ("codes", "codes-c", "codes-d", "codes-x", "codes-short"):
        wait_everywhere(cluster, t)  # every owner knows them: the attach point can be read

    def post(path: str, body: dict[str, Any]) -> int:
        return f.post(path, body).status

    assert post("/v1/topics/codes/children", {"child": "codes"}) == 400  # parent == child
    assert post("/v1/topics/codes/children", {}) == 400  # child missing
    assert post("/v1/topics/codes/children", {"child": "codes-c", "fanout_delay_ms": 5}) == 400  # wrong name
    assert post("/v1/topics", {"name": "codes-n", "parent": "codes", "delay_ms": 5}) == 400  # wrong name
    assert post("/v1/topics/codes/children", {"child": "codes-c", "delay_ms": 31_536_000_001}) == 400
    assert post("/v1/topics/codes/children", {"child": "codes-c", "delay_ms": -1}) == 400
    assert post("/v1/topics/codes/children", {"child": "nope"}) == 404
    assert post("/v1/topics/nope/children", {"child": "codes-c"}) == 404
    assert post("/v1/topics", {"name": "codes-m", "parent": "nope"}) == 404
    assert f.get("/v1/topics/nope/children").status == 404
    assert post("/v1/topics/codes/children", {"child": "codes-c", "remote": "b"}) == 501
    # delay + 1 h must fit in the parent's retention
    assert post("/v1/topics/codes-short/children", {"child": "codes-x", "delay_ms": 1}) == 409
    assert post("/v1/topics", {"name": "codes-y", "parent": "codes-short", "fanout_delay_ms": 1}) == 409
    assert f.get("/v1/topics/codes-y").status == 404
    attach(f, "codes", "codes-c")
    attach(f, "codes", "codes-d", delay_ms=60_000)
    wait_everywhere(cluster, "codes-d", lambda j: j.get("parent") == "codes")
    assert post("/v1/topics/codes-x/children", {"child": "codes-c"}) == 409  # already has a parent
    assert post("/v1/topics/codes-c/children", {"child": "codes-x"}) == 409  # a child has no children
    assert post("/v1/topics/codes-x/children", {"child": "codes"}) == 409  # a parent cannot become a child
    assert post("/v1/topics", {"name": "codes-g", "parent": "codes-c"}) == 409  # no grandchildren
    # direct produce to a delay child: 409, single and batch; to a plain child it is allowed
    r = f.request("POST", "/v1/topics/codes-d/produce", b"x", headers=OCTET)
    assert r.status == 409 and "delay child" in r.json()["error"], r
    assert f.post("/v1/topics/codes-d/produce/batch", {"messages": [{"payload": 1}]}).status == 409
    assert f.request("POST", "/v1/topics/codes-c/produce", b"x", headers=OCTET).status == 202
    # retention of a parent cannot shrink below delay + 1 h of a delay child
    assert f.request("PATCH", "/v1/topics/codes", {"retention_ms": 3_600_000}).status == 409
    assert f.request("DELETE", "/v1/topics/codes/children/codes-x").status == 404  # not linked
    assert f.request("DELETE", "/v1/topics/codes/children/nope").status == 404
    assert f.request("DELETE", "/v1/topics/codes/children/codes-d").status == 204


def test_an_owner_down_create_as_child_undone_and_a_detach_it_missed_stays_detached(cluster: Cluster) -> None:
    """A follower owning parent partitions is killed: create-as-child and attach answer
    503 at every live node and leave nothing behind; the children listing says its lag
    is incomplete; a detach made while it is down holds when it comes back (its
    cursors for the gone link do not resume), while a link still attached copies its
    new messages; with every owner back, the create-as-child succeeds."""
    leader = cluster.leader()
    victim, alive = (n for n in cluster.initial if n != leader)  # a follower: no election needed
    v, a, live = cluster[victim], cluster[alive], [cluster[leader], cluster[alive]]
    create(a, {"name": "und", "partitions": 6})
    for t in ("und-c", "und-k", "und-s"):
        create(a, {"name": t, "partitions": 3})
    for t in ("und", "und-c", "und-k", "und-s"):
        wait_everywhere(cluster, t)  # every owner knows them: the attach point can be read
    attach(a, "und", "und-k")
    attach(a, "und", "und-s")
    wait_everywhere(cluster, "und", lambda j: j.get("children") == ["und-k", "und-s"])
    assert victim in owners(a, "und")
    produce_batch(v, "und", [f"v1-{i}" for i in range(12)])  # keyless: committed at the victim's partitions
    produce_batch(a, "und", [f"a1-{i}" for i in range(12)])
    wait_hwm(a, "und-k", 24)
    wait_hwm(a, "und-s", 24)
    v.kill9()
    try:
        for at in live:
            r = at.post("/v1/topics", {"name": "und-r", "parent": "und"})
            assert r.status == 503 and "und" in r.json()["error"], r
            r = at.post("/v1/topics/und/children", {"child": "und-c"})
            assert r.status == 503, r
        for at in live:  # nothing was left behind: no child, no link
            assert at.get("/v1/topics/und-r").status == 404
            assert "und-r" not in at.topic_names()
            assert "role" not in describe(at, "und-c")
            listing = at.get("/v1/topics/und/children")
            assert listing.status == 200, listing
            rows = listing.json()["children"]
            assert [c["name"] for c in rows] == ["und-k", "und-s"], rows
            assert not any(c["lag_complete"] for c in rows), rows  # the victim's partitions did not report
        r = cluster[leader].request("DELETE", "/v1/topics/und/children/und-k")  # needs no attach point
        assert r.status == 204, r
    finally:
        v.start()
    wait_everywhere(cluster, "und-k", lambda j: "role" not in j)
    produce_batch(v, "und", [f"v2-{i}" for i in range(12)])
    wait_hwm(a, "und-s", 36)  # the victim's cursors run again (for the link still attached) ...
    assert total_now(a, "und-k") == 24  # ... and not for the one detached while it was down
    wait_for(lambda: cursors_gone(cluster, "und", "und-k"), 10, 0.1, "no cursor for und -> und-k anywhere")
    # With every owner back, the same create succeeds (what failed was the attach point).
    rep = create(v, {"name": "und-r", "parent": "und"})
    assert rep["role"] == "child" and rep["parent"] == "und"


def _read_by_server(port: int, client_port: int) -> bool:
    """The server side of the loopback connection (port, client_port) has no unread bytes."""
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(path).read().splitlines()[1:]  # noqa: SIM115
        except OSError:
            continue
        for row in rows:
            f = row.split()
            local, remote, queues = f[1], f[2], f[4]
            if int(local.rsplit(":", 1)[1], 16) == port and int(remote.rsplit(":", 1)[1], 16) == client_port:
                return int(queues.split(":")[1], 16) == 0
    return False


def test_attach_at_a_node_that_has_not_seen_the_parent_yet(cluster: Cluster) -> None:
    """A client creates a parent and a child at one node and attaches at another before
    that node's replica applied the creates (its supervisor is held with SIGSTOP until
    its worker has read the request, so the replica is behind for certain). Every owner
    is up: Narad re-checks a write that depends on the replica after catching up, so
    the attach (and a create-as-child) succeeds; a 503 here is spurious."""
    import os
    import signal

    leader = cluster.leader()
    a, b = (cluster[n] for n in cluster.initial if n != leader)
    assert b.proc is not None
    out: dict[str, Any] = {}
    for kind in ("create-as-child", "attach"):
        conn = b.conn()
        conn.connect()
        assert conn.sock is not None
        cport = conn.sock.getsockname()[1]
        os.kill(b.proc.pid, signal.SIGSTOP)  # b's replica applies nothing while stopped
        try:
            create(a, {"name": f"lag-{kind}", "partitions": 3})
            if kind == "attach":
                create(a, {"name": f"lag-{kind}-c", "partitions": 3})
                path, body = f"/v1/topics/lag-{kind}/children", {"child": f"lag-{kind}-c"}
            else:
                path, body = "/v1/topics", {"name": f"lag-{kind}-c", "parent": f"lag-{kind}"}
            conn.request("POST", path, json.dumps(body).encode(),
                         {"Authorization": b.auth, "Content-Type": "application/json"})
            wait_for(lambda p=cport: _read_by_server(b.port, p), 5, 0.005, "b's worker to read the request")
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        t0 = time.monotonic()
        r = conn.getresponse()
        out[kind] = (r.status, r.read())
        print(f"\n{kind}: {out[kind][0]} after {time.monotonic() - t0:.2f} s {out[kind][1][:160]!r}")
        conn.close()
        assert out[kind][0] == (201 if kind == "create-as-child" else 200), out[kind]  # (a 503 takes 10 s)


def test_create_as_child_right_after_the_parent_while_an_owner_applies_it_late(cluster: Cluster) -> None:
    """A client creates a parent and at once a replica child of it, at the same node.
    One owner of parent partitions applies the parent's create late (its supervisor is
    held with SIGSTOP for 0.5 s: a slow replica; its worker keeps serving node RPC).
    Nothing can have been committed at a partition its owner has not heard of, and the
    owner is up and catches up within the second: the create-as-child should succeed
    (on this machine the race alone fails about 1 in 5 creates at the leader)."""
    import os
    import signal

    leader = cluster.leader()
    a = cluster[leader]
    b = cluster[next(n for n in cluster.initial if n != leader)]
    assert b.proc is not None
    os.kill(b.proc.pid, signal.SIGSTOP)
    timer = threading.Timer(0.5, os.kill, (b.proc.pid, signal.SIGCONT))
    try:
        create(a, {"name": "late-owner", "partitions": 6})  # the leader and the third node are a quorum
        assert b.node_id in owners(a, "late-owner")
        timer.start()
        r = a.post("/v1/topics", {"name": "late-owner-r", "parent": "late-owner"})
    finally:
        timer.cancel()
        os.kill(b.proc.pid, signal.SIGCONT)
    assert r.status == 201, r
