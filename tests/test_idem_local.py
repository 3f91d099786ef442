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


def _two_of_three(tmp_path: Path, topic: str, extra: dict[str, dict[str, str]] | None = None) -> Any:
    """A 3-node cluster (fast move planning, local placement on) with n1 and n2 started
    and `topic` made there; n3 joins when the test starts it. `extra`: more env by node."""
    from tests.harness import Cluster
    from tests.test_moves_cluster import FAST

    c = Cluster(tmp_path, 3, initial=2, env={**FAST, **ENV})
    for nid, env in (extra or {}).items():
        c[nid].extra_env.update(env)
    try:
        c.start()
        assert c["n1"].post("/v1/topics", {"name": topic, "partitions": PARTS}).status == 201
        for nid in ("n1", "n2"):
            wait_for(lambda nid=nid: c[nid].get(f"/v1/topics/{topic}").status == 200, 20, 0.05, "the topic")
    except BaseException:
        c.close()
        raise
    return c


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
    from tests.test_moves_cluster import moves, owners, spread

    c = _two_of_three(tmp_path, "lp")
    try:
        n1 = c["n1"]
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


@pytest.mark.slow
def test_a_record_waiting_in_the_wal_through_a_move_is_committed_once_at_its_keys_partition(
        tmp_path: Path) -> None:
    """A keyless idempotent record placed at a partition of its node whose direct commit
    failed waits in the ingress WAL (held by a test seam) while a third node joins and
    one partition of each node moves to it; a retry through the new node is committed
    meanwhile. When the WAL's record is dispatched, its node may no longer commit it where
    it was placed (its key's partition, or the placed one, left the node): it goes to its
    key's partition instead and is found there. Every key is stored once."""
    from tests.test_moves_cluster import moves, owners, spread

    hold = tmp_path / "hold-dispatch"
    hold.write_text("")
    c = _two_of_three(tmp_path, "lw", {"n1": {"NARAD_FAULT_DIRECT_COMMIT_FAIL_EVERY": "1",
                                              "NARAD_FAULT_DISPATCH_HOLD_FILE": str(hold)}})
    try:
        n1 = c["n1"]
        before = owners(n1, "lw")
        keys = [f"w{i}" for i in range(40)]
        msgs = [{"payload": {"k": k}, "idempotency_key": k} for k in keys]
        r = n1.post("/v1/topics/lw/produce/batch", {"messages": msgs})
        assert r.status == 202, r  # durable in n1's WAL, held there
        wait_for(lambda: n1.metric("narad_ingress_dispatch_backlog_records") == 40, 10, 0.1, "40 records held")
        assert {key_partition(k.encode(), PARTS) for k in keys} == set(range(PARTS))
        c.start(["n3"])
        wait_for(lambda: spread(n1, "lw", c.ids, PARTS), 180, 0.2, "partitions spread over 3 nodes")
        after = owners(n1, "lw")
        assert any(before[p] == "n1" and after[p] == "n3" for p in after), (before, after)
        for nid in c.ids:
            wait_for(lambda nid=nid: owners(c[nid], "lw") == after, 20, 0.1, f"{nid} sees the new owners")
        r = c["n3"].post("/v1/topics/lw/produce/batch", {"messages": msgs})  # the client's retry
        assert r.status == 202, r
        hold.unlink()  # the held WAL records go now
        wait_for(lambda: n1.metric("narad_ingress_dispatch_backlog_records") == 0, 60, 0.2, "n1's WAL dispatched")
        assert n1.metric("narad_ingress_dispatch_rehomed_total") > 0  # (the case under test did happen)
        wait_for(lambda: _stored(n1, "lw") >= 40, 30, 0.1, "every key stored")
        assert not moves(n1)
        for nid in c.ids:  # and every key is a duplicate now, through either node
            r = c[nid].post("/v1/topics/lw/produce/batch", {"messages": msgs})
            assert r.status == 202 and r.json() == {"accepted": 40, "duplicates": 40}, (nid, r.json())
        assert _stored(n1, "lw") == 40
    finally:
        c.close()


@pytest.mark.slow
def test_a_key_placed_by_a_worker_that_missed_the_move_is_refused_by_the_seal_not_lost(tmp_path: Path) -> None:
    """A worker whose replica has not shown a move (a test seam: the placement ignores move
    targets) places keys homed at a partition whose move has collected its keys and waits
    to flip. The node's claims table has that home sealed: the commit is refused, the WAL
    holds the record, and once the flip is seen it goes to the partition's new owner. A
    retry through the new owner finds every key; each is stored once."""
    from tests.test_moves_cluster import owners, spread

    stale = {"NARAD_FAULT_PLACEMENT_IGNORES_MOVES": "1"}
    c = _two_of_three(tmp_path, "ls", {"n1": stale, "n2": stale, "n3": {"NARAD_FAULT_MOVE_HOLD_FLIP_MS": "8000"}})
    try:
        n1 = c["n1"]
        c.start(["n3"])
        n3 = c["n3"]
        held: list[dict[str, Any]] = []

        def flip_held() -> bool:
            r = n3.get("/v1/cluster/moves?detail=true")
            assert r.status == 200, r
            held[:] = [m for m in r.json()["moves"] if m.get("worker", {}).get("phase") == "flip_pending"]
            return bool(held)

        wait_for(flip_held, 120, 0.05, "a move to n3 held before its flip")
        home, src = held[0]["partition"], held[0]["from"]
        keys = [k for k in (f"s{i}" for i in range(2000)) if key_partition(k.encode(), PARTS) == home][:24]
        assert len(keys) == 24
        for lo in range(0, 24, 4):  # (batch after batch: placed at one partition after another of the worker)
            msgs = [{"payload": {"k": k}, "idempotency_key": k} for k in keys[lo : lo + 4]]
            r = c[src].post("/v1/topics/ls/produce/batch", {"messages": msgs})
            assert r.status == 202, r
        assert c[src].metric("narad_idempotency_sealed_refusals_total") > 0  # (the case under test did happen)
        wait_for(lambda: spread(n1, "ls", c.ids, PARTS), 180, 0.2, "partitions spread over 3 nodes")
        after = owners(n1, "ls")
        for nid in c.ids:
            wait_for(lambda nid=nid: owners(c[nid], "ls") == after, 20, 0.1, f"{nid} sees the new owners")
        wait_for(lambda: c[src].metric("narad_ingress_dispatch_backlog_records") == 0, 60, 0.2,
                 "the refused records dispatched")
        wait_for(lambda: _stored(n1, "ls") >= 24, 30, 0.1, "every key stored")
        msgs = [{"payload": {"k": k}, "idempotency_key": k} for k in keys]
        for nid in c.ids:
            r = c[nid].post("/v1/topics/ls/produce/batch", {"messages": msgs})
            assert r.status == 202 and r.json() == {"accepted": 24, "duplicates": 24}, (nid, r.json())
        assert _stored(n1, "ls") == 24
    finally:
        c.close()
