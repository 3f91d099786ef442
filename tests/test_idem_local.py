"""topic.idempotent_local_placement (issue 14): a keyless idempotent record whose key's
partition is on this node is committed into a partition of the worker that received it,
its key checked in the node's shared-memory claims table. A real two-worker node: the
records stay at the receiving worker, a repeat through the other worker is found, a race
of the same keys through both workers stores each once, and after a kill -9 every
worker's keys are loaded at start, before anything is produced."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from narad.broker.routing import key_partition, owner_worker
from tests.harness import Node, wait_for

PARTS = 6
ENV = {"NARAD_TOPIC_IDEMPOTENT_LOCAL_PLACEMENT": "true"}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path / "data", workers=2, env=ENV).start()
    yield n
    n.close()


def _mk(node: Node, name: str) -> str:
    r = node.post("/v1/topics", {"name": name, "partitions": PARTS})
    assert r.status == 201, r
    return name


def _drain(node: Node, name: str, want: int) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []

    def take() -> bool:
        r = node.get(f"/v1/topics/{name}/consume?max=100&wait=200ms", headers={"X-Narad-Client": "tests"})
        assert r.status in (200, 204), r
        if r.status == 200:
            msgs = r.json()["messages"]
            got.extend(msgs)
            a = node.post(f"/v1/topics/{name}/ack", {"receipt_handles": [m["receipt_handle"] for m in msgs]})
            assert a.status == 200, a
        return len(got) >= want

    wait_for(take, 20, 0.02, f"{want} records consumed")
    return got


def _stored(node: Node, name: str) -> int:
    r = node.get(f"/v1/topics/{name}")
    assert r.status == 200, r
    return sum(int(s["high_watermark"]) for s in r.json()["partition_stats"])


def test_records_stay_at_the_receiving_worker_and_a_repeat_through_the_other_is_found(node: Node) -> None:
    name = _mk(node, "local-a")
    keys = [f"a{i}" for i in range(40)]
    assert {owner_worker(name, key_partition(k.encode(), PARTS), 2) for k in keys} == {0, 1}
    msgs = [{"payload": {"k": k}, "idempotency_key": k} for k in keys]
    w0, w1 = node.worker_connection(0), node.worker_connection(1)
    r = node.post(f"/v1/topics/{name}/produce/batch", {"messages": msgs}, conn=w0)
    assert r.status == 202 and r.json() == {"accepted": 40, "duplicates": 0}, r
    r = node.post(f"/v1/topics/{name}/produce/batch", {"messages": [*msgs, msgs[0]]}, conn=w1)
    assert r.status == 202 and r.json() == {"accepted": 41, "duplicates": 41}, r
    for k in (keys[3], keys[17]):  # a single produce of a key, through either worker
        for conn in (w0, w1):
            s = node.post(f"/v1/topics/{name}/produce?idempotency_key={k}", b"again",
                          headers={"Content-Type": "application/octet-stream"}, conn=conn)
            assert s.status == 202 and s.json() == {"duplicate": True}, s
    new = node.post(f"/v1/topics/{name}/produce?idempotency_key=a-new", b"new",
                    headers={"Content-Type": "application/octet-stream"}, conn=w1)
    assert new.status == 202 and new.json() == {"duplicate": False}, new
    got = _drain(node, name, 41)
    assert sorted(m["payload"]["k"] for m in got if isinstance(m["payload"], dict)) == sorted(keys)
    # Every record of the batch went to worker 0's partitions (it received it), none hopped;
    # the single produce through worker 1 went to worker 1's.
    where = {owner_worker(name, m["partition"], 2) for m in got if isinstance(m["payload"], dict)}
    assert where == {0}
    assert [owner_worker(name, m["partition"], 2) for m in got if m["payload"] == "new"] == [1]
    assert _stored(node, name) == 41
    assert node.metric("narad_idempotency_table_keys") == 41


def test_the_same_keys_racing_through_both_workers_are_stored_once(node: Node) -> None:
    name = _mk(node, "local-race")
    for round_ in range(5):
        keys = [f"r{round_}-{i}" for i in range(100)]
        msgs = [{"payload": {"k": k}, "idempotency_key": k} for k in keys]
        conns = [node.worker_connection(0), node.worker_connection(1)]
        answers: list[Any] = [None, None]
        go = threading.Barrier(2)

        def send(i: int, conns: list[Any] = conns, msgs: list[Any] = msgs, answers: list[Any] = answers,
                 go: threading.Barrier = go) -> None:
            go.wait(timeout=10)
            answers[i] = node.post(f"/v1/topics/{name}/produce/batch", {"messages": msgs}, conn=conns[i])

        ts = [threading.Thread(target=send, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=60)
        for a in answers:
            assert a is not None and a.status == 202, a
        assert all("pending" not in a.json() for a in answers), answers
        assert sum(a.json()["duplicates"] for a in answers) == 100, answers  # each key new for one of them
        wait_for(lambda n=100 * (round_ + 1): _stored(node, name) == n, 20, 0.05, "each key stored once")
    got = _drain(node, name, 500)
    assert len(got) == 500 and len({m["payload"]["k"] for m in got}) == 500


def test_after_a_kill9_every_workers_keys_are_loaded_at_start(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=2, env=ENV).start()
    try:
        name = _mk(n, "local-restart")
        keys = [f"k{i}" for i in range(30)]
        msgs = [{"payload": {"k": k}, "idempotency_key": k} for k in keys]
        for w, part in ((0, msgs[:15]), (1, msgs[15:])):
            r = n.post(f"/v1/topics/{name}/produce/batch", {"messages": part}, conn=n.worker_connection(w))
            assert r.status == 202 and r.json() == {"accepted": 15, "duplicates": 0}, r
        n.kill9()
        n.start()
        wait_for(lambda: n.get(f"/v1/topics/{name}").status == 200, 20, 0.05, "the topic after the restart")
        # Loaded at start by both workers, before anything was produced or consumed.
        wait_for(lambda: n.metric("narad_idempotency_table_keys") == 30, 20, 0.1, "30 keys loaded at start")
        for w in (0, 1):
            r = n.post(f"/v1/topics/{name}/produce/batch", {"messages": msgs}, conn=n.worker_connection(w))
            assert r.status == 202 and r.json() == {"accepted": 30, "duplicates": 30}, r
        assert _stored(n, name) == 30
        # Opening every partition again (a consume of all) did not read their logs' keys a second time.
        assert len(_drain(n, name, 30)) == 30
        assert "idempotency keys loaded into the node's claims table" in n.log()
        assert "idempotency keys rebuilt from the log" not in n.log()
    finally:
        n.close()


@pytest.mark.slow
def test_a_move_carries_the_keys_committed_away_from_their_partition(tmp_path: Path) -> None:
    """Two nodes take keyed records, each committing a key homed at one of its partitions
    into a partition of its own; a third node joins and partitions move to it. Every key,
    retried through every node, is still found (the moves carried the keys homed at the
    moved partitions, ``idem.carried``), and so after a kill -9 of a source (its start
    reads the keys of the copies moved aside)."""
    from tests.harness import Cluster
    from tests.test_moves_cluster import FAST, moves, owners, spread

    c = Cluster(tmp_path, 3, initial=2, env={**FAST, **ENV})
    try:
        c.start()
        n1 = c["n1"]
        assert n1.post("/v1/topics", {"name": "lp", "partitions": PARTS}).status == 201
        for nid in ("n1", "n2"):
            wait_for(lambda nid=nid: c[nid].get("/v1/topics/lp").status == 200, 20, 0.05, "the topic")
        before = owners(n1, "lp")
        keys = [f"m{i}" for i in range(60)]
        for nid, part in (("n1", keys[:30]), ("n2", keys[30:])):
            for lo in range(0, 30, 5):  # (batch after batch over the node's partitions)
                msgs = [{"payload": {"k": k}, "idempotency_key": k} for k in part[lo : lo + 5]]
                r = c[nid].post("/v1/topics/lp/produce/batch", {"messages": msgs})
                assert r.status == 202 and r.json() == {"accepted": 5, "duplicates": 0}, r
        homes = {k: key_partition(k.encode(), PARTS) for k in keys}
        c.start(["n3"])
        wait_for(lambda: spread(n1, "lp", c.ids, PARTS), 180, 0.2, "partitions spread over 3 nodes")
        after = owners(n1, "lp")
        moved = {p for p in after if after[p] != before[p]}
        assert moved and any(homes[k] in moved for k in keys), (before, after)
        msgs = [{"payload": {"k": k}, "idempotency_key": k} for k in keys]

        def all_duplicates(nid: str) -> bool:
            r = c[nid].post("/v1/topics/lp/produce/batch", {"messages": msgs})
            assert r.status == 202, r
            assert r.json() == {"accepted": 60, "duplicates": 60}, (nid, r.json())
            return True

        for nid in c.ids:
            wait_for(lambda nid=nid: owners(c[nid], "lp") == after, 20, 0.1, f"{nid} sees the new owners")
            all_duplicates(nid)
        sources = {before[p] for p in moved}
        for src in sorted(sources):
            c[src].kill9()
            c[src].start()
            wait_for(lambda src=src: c[src].get("/v1/topics/lp").status == 200, 30, 0.1, f"{src} back")
            wait_for(lambda: not moves(n1), 60, 0.2, "no move in flight")
            for nid in c.ids:
                all_duplicates(nid)
        r = n1.get("/v1/topics/lp")
        assert sum(int(s["high_watermark"]) for s in r.json()["partition_stats"]) == 60
    finally:
        c.close()
