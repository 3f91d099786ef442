"""The fan-out engine on a real node with 2 workers (one node shared by the
tests of this module): copies of everything committed to a parent after the
attach reach every child and nothing from before it does; keys are kept and
land by the child's partitioner (keyless records keep their partition index
when the counts match); a delay child delivers nothing before committed-at +
delay and everything soon after; detach stops the copy (the cursor's own file
goes once the leader confirms); kill -9 under produce loses no acknowledged
parent message in the child (duplicates counted). Idle logs close after 300 ms
on this node, so waiting cursors must let their parent's logs close and copy
again after a commit reopened them.

Two tests run in one process instead (a real broker, partition logs, cursor
files and an FSM applied directly; the one seam is a commit_to refusing chosen
child partitions, as an owner that does not answer): only the failed bucket is
retried and the cursor file waits for it; a cursor behind retention delivers
the slab it holds, skips to the oldest offset and counts the loss."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from narad import metrics
from narad.broker import fanout as FO
from narad.broker.broker import Broker
from narad.broker.routing import key_partition
from narad.errors import Unavailable
from narad.meta import commands as C
from narad.meta.records import TopicRecord
from narad.storage import cursor_file as CF
from tests.fanout_world import World
from tests.harness import Node, basic, wait_for

OCTET = {"Content-Type": "application/octet-stream"}
CLIENT = {"X-Narad-Client": "tests"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    # Idle logs close after 300 ms: cursors must reopen their parent's log on demand.
    n = Node(tmp_path_factory.mktemp("fanout-engine") / "data", workers=2,
             env={"NARAD_STORAGE_IDLE_LOG_EVICTION_MS": "300"}).start()
    try:
        yield n
    finally:
        n.close()


def create(n: Node, name: str, partitions: int) -> str:
    r = n.post("/v1/topics", {"name": name, "partitions": partitions})
    assert r.status == 201, r
    return r.json()["id"]  # type: ignore[no-any-return]


def attach(n: Node, parent: str, child: str, delay_ms: int = 0) -> None:
    body: dict[str, Any] = {"child": child}
    if delay_ms:
        body["delay_ms"] = delay_ms
    r = n.post(f"/v1/topics/{parent}/children", body)
    assert r.status == 200, r


def produce(n: Node, topic: str, body: bytes, query: str = "") -> int:
    return n.request("POST", f"/v1/topics/{topic}/produce{query}", body, headers=OCTET).status


def consume(n: Node, topic: str, wait: str = "1s") -> list[dict[str, Any]]:
    r = n.get(f"/v1/topics/{topic}/consume?wait={wait}&max=100", headers=CLIENT)
    if r.status == 204:
        return []
    assert r.status == 200, r
    msgs: list[dict[str, Any]] = r.json()["messages"]
    a = n.post(f"/v1/topics/{topic}/ack", {"receipt_handles": [m["receipt_handle"] for m in msgs]})
    assert a.status == 200 and all(x["status"] == 204 for x in a.json()["results"]), a
    return msgs


def drain(n: Node, topic: str, want: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    end = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < end:
        got += consume(n, topic)
    return got


def lags(n: Node, parent: str) -> dict[str, tuple[int, bool]]:
    r = n.get(f"/v1/topics/{parent}/children")
    assert r.status == 200, r
    return {c["name"]: (c["lag_messages"], c["lag_complete"]) for c in r.json()["children"]}


def copied(n: Node, parent: str) -> bool:
    """Every child's cursors are at the parent's high watermark (all owners answered)."""
    return all(v == (0, True) for v in lags(n, parent).values())


def payloads(msgs: list[dict[str, Any]]) -> list[str]:
    return sorted(str(m["payload"]) for m in msgs)


def test_every_message_after_the_attach_reaches_every_child_with_its_key(node: Node) -> None:
    create(node, "fe-par", 3)
    create(node, "fe-same", 3)  # same partition count: keyless copies keep their index
    create(node, "fe-wide", 5)
    for i in range(9):
        assert produce(node, "fe-par", f"before-{i}".encode(), f"?partition={i % 3}") == 202
    wait_for(lambda: sum(p["high_watermark"] for p in node.get("/v1/topics/fe-par").json()["partition_stats"]) == 9,
             10, what="the pre-attach messages committed")
    attach(node, "fe-par", "fe-same")
    attach(node, "fe-par", "fe-wide")
    sent: dict[str, tuple[str | None, int | None]] = {}  # payload -> (key, parent partition)
    for i in range(30):
        body = f"after-{i}"
        if i % 3 == 0:
            assert produce(node, "fe-par", body.encode(), f"?key=k{i}") == 202
            sent[body] = (f"k{i}", None)
        else:
            assert produce(node, "fe-par", body.encode(), f"?partition={i % 3}") == 202
            sent[body] = (None, i % 3)
    batch = [{"payload": {"n": i}, "key": f"bk{i}"} for i in range(10)]
    r = node.post("/v1/topics/fe-par/produce/batch", {"messages": batch}, headers=CLIENT)
    assert r.status == 202, r
    wait_for(lambda: copied(node, "fe-par"), 30, 0.1, "every copy committed")
    want = 40
    for child, parts in (("fe-same", 3), ("fe-wide", 5)):
        got = drain(node, child, want)
        got += consume(node, child, "0s")
        assert len(got) == want, payloads(got)
        names = [str(m["payload"]) for m in got if isinstance(m["payload"], str)]
        assert sorted(names) == sorted(sent), "exactly the messages committed after the attach"
        for m in got:
            if isinstance(m["payload"], dict):  # a JSON payload stays JSON; its key is kept
                key = f"bk{m['payload']['n']}"
                assert m["key"] == key and m["partition"] == key_partition(key.encode(), parts)
                continue
            key, part = sent[m["payload"]]
            assert m.get("key") == key
            if key is not None:
                assert m["partition"] == key_partition(key.encode(), parts)
            elif parts == 3:
                assert m["partition"] == part
    text = node.get("/metrics").body.decode()
    assert 'narad_fanout_committed_total{child="fe-same",parent="fe-par"} 40.0' in text, text[-2000:]
    # The fan-out series name two topics: a caller sees them only if it may see both.
    r = node.post("/v1/users", {"username": "dora", "password": "dora-pw",
                                "grants": [{"action": "consume", "patterns": ["fe-same"]}]})
    assert r.status == 201, r
    seen = node.get("/metrics", auth=basic("dora", "dora-pw")).body.decode()
    assert any(line.startswith("narad_messages_produced_total{") and 'topic="fe-same"' in line
               for line in seen.splitlines()), seen[-2000:]
    assert "fe-par" not in seen and "fe-wide" not in seen
    # Waiting cursors do not keep their parent's logs open (idle eviction is 300 ms here): a
    # commit reopens the log and wakes them.
    wait_for(lambda: node.metric("narad_idle_logs_evicted_total") >= 3, 15, 0.1, "idle logs closed")
    for i in range(3):
        assert produce(node, "fe-par", f"late-{i}".encode(), f"?partition={i}") == 202
    for child in ("fe-same", "fe-wide"):
        assert payloads(drain(node, child, 3)) == [f"late-{i}" for i in range(3)]


def test_a_delay_child_delivers_nothing_early_and_everything_soon_after(node: Node) -> None:
    delay = 1500
    create(node, "fd-par", 3)
    create(node, "fd-late", 3)
    attach(node, "fd-par", "fd-late", delay)
    sent: dict[str, tuple[float, float]] = {}
    for i in range(12):
        t0 = time.time()
        assert produce(node, "fd-par", f"d-{i}".encode()) == 202
        sent[f"d-{i}"] = (t0, time.time())
    arrived: dict[str, float] = {}
    end = time.monotonic() + delay / 1000 + 15
    while len(arrived) < len(sent) and time.monotonic() < end:
        for m in consume(node, "fd-late"):
            arrived.setdefault(m["payload"], time.time())
    assert sorted(arrived) == sorted(sent)
    for body, (t_send, t_ack) in sent.items():
        # The parent committed it after the send began: its due time is later still.
        early = t_send + delay / 1000 - arrived[body]
        assert early <= 0, f"{body} delivered {early:.3f}s early"
        assert arrived[body] <= t_ack + delay / 1000 + 5, f"{body} delivered late"
    assert consume(node, "fd-late", "0s") == []


def _cursor_files(n: Node, topic: str, child: str) -> list[Path]:
    tid = n.get(f"/v1/topics/{topic}").json()["id"]
    return sorted((n.data_dir / "topics" / f"{topic}@{tid}").glob(f"p*/fanout-{child}.offset"))


def test_detach_stops_the_copy_and_the_child_keeps_its_data(node: Node) -> None:
    create(node, "fx-par", 3)
    create(node, "fx-stay", 3)
    create(node, "fx-gone", 3)
    attach(node, "fx-par", "fx-stay")
    attach(node, "fx-par", "fx-gone")
    # Cursors anchor on a parent nothing was produced to yet (its directories do not exist before).
    wait_for(lambda: len(_cursor_files(node, "fx-par", "fx-stay")) == 3, 15, 0.1, "cursors anchored on an empty parent")
    for i in range(6):
        assert produce(node, "fx-par", f"one-{i}".encode()) == 202
    wait_for(lambda: copied(node, "fx-par"), 30, 0.1, "the first copies")
    assert len(_cursor_files(node, "fx-par", "fx-gone")) == 3
    r = node.request("DELETE", "/v1/topics/fx-par/children/fx-gone")
    assert r.status == 204, r
    # Commits right after the detach wake the cursors, which may notice the unlink before the
    # reconciler does; either way the files go. (These may or may not reach fx-gone.)
    for i in range(3):
        assert produce(node, "fx-par", f"mid-{i}".encode(), f"?partition={i}") == 202
    # The cursors stop; each deletes its own file once the leader says the link is gone.
    wait_for(lambda: not _cursor_files(node, "fx-par", "fx-gone"), 15, 0.1, "the detached cursors' files removed")
    assert len(_cursor_files(node, "fx-par", "fx-stay")) == 3
    for i in range(6):
        assert produce(node, "fx-par", f"two-{i}".encode()) == 202
    wait_for(lambda: copied(node, "fx-par"), 30, 0.1, "the copies into the child still attached")
    both = [f"one-{i}" for i in range(6)] + [f"mid-{i}" for i in range(3)] + [f"two-{i}" for i in range(6)]
    assert payloads(drain(node, "fx-stay", 15)) == sorted(both)
    kept = drain(node, "fx-gone", 6)
    kept += consume(node, "fx-gone", "0s")
    assert [p for p in payloads(kept) if not p.startswith("mid-")] == sorted(f"one-{i}" for i in range(6))
    d = node.get("/v1/topics/fx-gone").json()
    assert "parent" not in d and sum(p["high_watermark"] for p in d["partition_stats"]) == len(kept)


def test_a_partition_added_to_the_parent_later_is_copied_from_offset_0(node: Node) -> None:
    create(node, "fg-par", 3)
    create(node, "fg-kid", 3)
    attach(node, "fg-par", "fg-kid")
    r = node.request("PATCH", "/v1/topics/fg-par", {"partitions": 4})
    assert r.status == 200, r
    for i in range(4):
        assert produce(node, "fg-par", f"grown-{i}".encode(), "?partition=3") == 202
    wait_for(lambda: copied(node, "fg-par"), 30, 0.1, "the new partition's records copied")
    assert payloads(drain(node, "fg-kid", 4)) == [f"grown-{i}" for i in range(4)]


def test_kill9_under_produce_loses_no_acknowledged_message_in_the_child(node: Node) -> None:
    create(node, "fk-par", 3)
    create(node, "fk-kid", 4)
    attach(node, "fk-par", "fk-kid")
    acked: list[str] = []
    stop = threading.Event()

    def producer() -> None:
        i = 0
        conn = node.conn()
        while not stop.is_set():
            body = f"k9-{i}"
            i += 1
            try:
                conn.request("POST", "/v1/topics/fk-par/produce", body.encode(),
                             headers={**OCTET, "Authorization": node.auth})
                r = conn.getresponse()
                r.read()
            except OSError:
                return  # the node is gone: this one's outcome is unknown (not acknowledged)
            if r.status == 202:
                acked.append(body)

    t = threading.Thread(target=producer)
    t.start()
    try:
        wait_for(lambda: len(acked) >= 150, 30, 0.01, "acknowledged produces before the kill")
        node.kill9()
    finally:
        stop.set()
        t.join(10)
    assert len(acked) >= 150
    node.start()
    seen: Counter[str] = Counter()
    end = time.monotonic() + 40
    while time.monotonic() < end and not set(acked) <= set(seen):
        for m in consume(node, "fk-kid"):
            seen[m["payload"]] += 1
    missing = sorted(set(acked) - set(seen), key=lambda s: int(s[3:]))
    dups = sum(c - 1 for c in seen.values() if c > 1)
    print(f"kill -9 under produce: {len(acked)} acknowledged, {len(missing)} missing, {dups} duplicates in the child")
    assert not missing, f"acknowledged but never copied: {missing[:20]}"
    assert set(seen) <= {f"k9-{i}" for i in range(len(acked) + 1000)}, json.dumps(sorted(seen)[:10])


# ---- in one process: a real broker, partition logs, cursor files and metastore; the only
# seam is a commit_to that refuses chosen child partitions (an owner that does not answer) ----

class _FlakyBroker(Broker):
    """Refuses commits to the chosen partitions of the child (as a dead owner would)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.fail: set[int] = set()
        self.refused = 0
        self.landed: list[tuple[int, int]] = []

    async def commit_to(self, t: TopicRecord, partition: int, records: list[tuple[bytes | None, int, bytes]]
                        ) -> int:
        if t.name == "kid" and partition in self.fail:
            self.refused += 1
            raise Unavailable("injected: the child partition's owner does not answer")
        base = await super().commit_to(t, partition, records)
        self.landed.append((partition, len(records)))
        return base


def _record(name: str, tid: str) -> TopicRecord:
    return TopicRecord(name=name, id=tid, partitions=3, retention_ms=0, visibility_timeout_ms=30000,
                       max_in_flight_per_partition=1024, max_acked_ahead_per_partition=1024, created_at=1)


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    monkeypatch.setattr(FO, "RECONCILE_EVERY", 0.05)  # the 1 s cadences, shortened for these tests
    monkeypatch.setattr(FO, "RETRY_BACKOFF", 0.05)
    w = World(tmp_path)
    w.apply(C.CreateTopic(_record("par", "00000000000000a1")))
    w.apply(C.CreateTopic(_record("kid", "00000000000000a2")))
    w.apply(C.AttachChildCas("par", "00000000000000a1", "kid", "00000000000000a2", 0, "e1e1e1e1e1e1e1e1", [0, 0, 0]))
    try:
        yield w
    finally:
        w.close()


async def _until(cond: Any, timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _file_at(w: World, partition: int) -> int | None:
    st = CF.CursorFile(w.tmp / "data" / "topics" / "par@00000000000000a1" / f"p{partition:05d}", "kid").read()
    return None if st is None else st.next_offset


def test_a_failed_bucket_alone_is_retried_and_the_cursor_waits_for_it(world: World) -> None:
    async def main() -> None:
        b = await world.broker(_FlakyBroker, linger_ms=0)
        try:
            b.fail = {1}
            keys = [f"key-{i}".encode() for i in range(30)]
            want = Counter(key_partition(k, 3) for k in keys)
            assert set(want) == {0, 1, 2}
            await b.commit_local("par", "00000000000000a1", 0, [(k, 0, b"v" + k) for k in keys])
            await _until(lambda: b.refused >= 2, 10, "the refused bucket retried")
            # The healthy buckets landed once; the refused one holds the file back.
            assert sorted(b.landed) == sorted((p, n) for p, n in want.items() if p != 1)
            assert _file_at(world, 0) == 0, "the cursor file passed records a child did not acknowledge"
            b.fail = set()
            await _until(lambda: _file_at(world, 0) == 30, 10, "the cursor file advanced")
            assert sorted(b.landed) == sorted(want.items()), "only the failed bucket was sent again"
            for i in range(3):
                assert (await b.partition(world.topic("kid"), i)).log.hwm == want[i]
        finally:
            await b.close()

    asyncio.run(main())


def test_a_cursor_behind_retention_skips_to_the_oldest_offset_and_counts_the_loss(world: World) -> None:
    async def main() -> None:
        b = await world.broker(_FlakyBroker, linger_ms=0)
        try:
            b.fail = {0, 1, 2}
            await b.commit_local("par", "00000000000000a1", 1, [(None, 0, f"a{i}".encode()) for i in range(10)])
            await _until(lambda: b.refused >= 1, 10, "the cursor holding its first slab")
            await b.commit_local("par", "00000000000000a1", 1, [(None, 0, f"b{i}".encode()) for i in range(10)])
            p = await b.partition(world.topic("par"), 1)
            far = int(time.time() * 1000) + 10**9
            assert p.log.roll_idle_active(1, far)  # retention ages out everything committed so far
            assert p.log.delete_segments(p.log.expired_segments(1, far))[0] == 20 and p.log.oldest == 20
            dropped = metrics.get().fanout_dropped.labels("par", "kid")
            before = dropped.value
            b.fail = set()
            await _until(lambda: _file_at(world, 1) == 20, 10, "the cursor past the aged-out records")
            assert dropped.value - before == 10, "the ten records never read were counted as lost"
            # The slab read before the records aged out was still delivered.
            kid = world.topic("kid")
            assert sum([(await b.partition(kid, i)).log.hwm for i in range(3)]) == 10
        finally:
            await b.close()

    asyncio.run(main())
