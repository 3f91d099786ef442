"""The lifecycle seed's chaos bugs, reproduced on a real node whose metastore
replica is stale: its FSM is an older copy (as if restored from an old
snapshot) and its replay is slowed (20 ms an entry), so for seconds after the
start the local replica lacks a topic that is live, with data on disk and
records accepted in the WAL. A naive node deletes the topic's directory (the
startup orphan sweep), or discards its WAL records because the topic looks
deleted and, being the leader, trusts its own still-replaying state. Here the
sweep waits for a caught-up replica and a leader-confirmed "gone", and the
self-leader passes a barrier and re-reads before it confirms anything."""

from __future__ import annotations

import asyncio
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from narad.api.messages import payload_flags
from narad.storage.wal import Entry, IngressWAL
from tests.harness import Node, wait_for
from tests.test_cluster import drain, produce

GHOST = "ghost@0123456789abcdef"


def _append_wal(wal_dir: Path, topic: str, topic_id: str, payloads: list[bytes]) -> None:
    """Records accepted (202) but not yet at their partition when the node died."""

    async def main() -> None:
        with ThreadPoolExecutor(1) as io:
            wal = IngressWAL(wal_dir, io)
            wal.open()
            now = int(time.time() * 1000)
            await wal.append([Entry(topic, bytes.fromhex(topic_id), i % 3, now, payload_flags(p), None, p)
                              for i, p in enumerate(payloads)])
            wal.close()

    asyncio.run(main())


def test_a_stale_replica_keeps_live_topic_data_and_wal_records(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=1)
    try:
        n.start()
        assert n.stop() == 0
        fsm = n.data_dir / "metastore" / "fsm"
        early = tmp_path / "fsm-before-live"
        shutil.copytree(fsm, early)  # the "old snapshot": no topic yet
        n.start()
        assert n.post("/v1/topics", {"name": "live", "partitions": 3}).status == 201
        live_id = n.get("/v1/topics/live").json()["id"]
        for i in range(6):
            assert produce(n, "live", f"on-disk-{i}".encode(), f"?partition={i % 3}") == 202
        for i in range(60):  # entries the stale replica must replay before it sees "live" again
            assert n.post("/v1/topics", {"name": f"later-{i}"}).status == 201
        wait_for(lambda: n.get("/v1/topics/live").json()["partition_stats"] is not None
                 and sum(p["lag"] for p in n.get("/v1/topics/live").json()["partition_stats"]) == 6, 10)
        assert n.stop() == 0
        live_dir = n.data_dir / "topics" / f"live@{live_id}"
        assert live_dir.is_dir()
        # The node dies with two records accepted but not yet delivered...
        _append_wal(n.data_dir / "ingress" / "w0", "live", live_id, [b"in-wal-0", b"in-wal-1"])
        # ...a directory of an incarnation that really is gone lies beside it...
        (n.data_dir / "topics" / GHOST / "p00000").mkdir(parents=True)
        # ...and it comes back with the old replica, replaying slowly.
        shutil.rmtree(fsm)
        shutil.copytree(early, fsm)
        n.extra_env["NARAD_FAULT_APPLY_DELAY_MS"] = "20"
        n.start(wait=False)
        n.wait_ready(60)
        wait_for(lambda: "orphan sweep finished" in n.log(), 30, 0.1, "the orphan sweep")
        assert not (n.data_dir / "topics" / GHOST).exists(), "the sweep removes a confirmed-gone incarnation"
        assert live_dir.is_dir() and sorted(p.name for p in live_dir.iterdir() if p.is_dir()) == [
            "p00000", "p00001", "p00002"]
        assert "discarded WAL records" not in n.log()
        got = drain(n, "live", 8, timeout=30)
        want = [f"on-disk-{i}" for i in range(6)] + ["in-wal-0", "in-wal-1"]
        assert sorted(m["payload"] for m in got) == sorted(want)
    finally:
        n.close()
