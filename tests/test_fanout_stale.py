"""The lifecycle seed's chaos bug 2 on a real node: fan-out cursors must not
start from a stale metastore replica.

The node comes back with an old FSM copy (as if restored from an old
snapshot) and a slow replay (NARAD_FAULT_APPLY_DELAY_MS), so for seconds its
workers see the child linked under a dead attach epoch (E1, no delay) while
the current link is a re-attach (E2, a delay child) whose cursor files hold
the position below a backlog that is not due yet. A naive node starts E1
cursors from that view, re-anchors over E2's files and copies the backlog at
once (early, and duplicates from E1's attach point); the seed's version
anchored at the tail and skipped the backlog. Here no cursor starts until the
replica is provably current, anchoring needs the leader to confirm the epoch,
and the E2 cursors resume their own files: the backlog arrives once, when due."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from narad.storage import cursor_file as CF
from tests.harness import Node, wait_for
from tests.test_fanout_engine import attach, consume, copied, create, drain, produce

DELAY_MS = 8000


def _files(n: Node, parent: str, pid: str, child: str) -> list[Path]:
    return sorted((n.data_dir / "topics" / f"{parent}@{pid}").glob(f"p*/{CF.file_name(child)}"))


def _epoch(n: Node, topic: str) -> Any:
    return n.get(f"/v1/topics/{topic}").json().get("attach_epoch")


def test_a_stale_replica_neither_starts_cursors_nor_reanchors_and_the_delay_backlog_arrives(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=2)
    try:
        n.start()
        pid = create(n, "fs-par", 3)
        create(n, "fs-kid", 3)
        attach(n, "fs-par", "fs-kid")  # E1: a plain child
        e1 = _epoch(n, "fs-kid")
        for i in range(6):
            assert produce(n, "fs-par", f"e1-{i}".encode()) == 202
        wait_for(lambda: copied(n, "fs-par"), 20, 0.1, "the E1 copies")
        assert sorted(m["payload"] for m in drain(n, "fs-kid", 6)) == sorted(f"e1-{i}" for i in range(6))
        assert n.stop() == 0
        fsm = n.data_dir / "metastore" / "fsm"
        old = tmp_path / "fsm-e1"
        shutil.copytree(fsm, old)  # the "old snapshot": linked under E1, no delay

        n.start()
        assert n.request("DELETE", "/v1/topics/fs-par/children/fs-kid").status == 204
        attach(n, "fs-par", "fs-kid", DELAY_MS)  # E2: a delay child, attached at the parent's tail
        e2 = _epoch(n, "fs-kid")
        assert e2 != e1

        def anchored() -> bool:
            fs = _files(n, "fs-par", pid, "fs-kid")
            return len(fs) == 3 and all((st := CF.CursorFile(f.parent, "fs-kid").read()) is not None
                                        and st.epoch == e2 for f in fs)

        wait_for(anchored, 20, 0.1, "the E2 cursors anchored")
        sent: dict[str, float] = {}
        for i in range(9):
            t0 = time.time()
            assert produce(n, "fs-par", f"backlog-{i}".encode()) == 202
            sent[f"backlog-{i}"] = t0
        for i in range(80):  # entries the stale replica replays slowly before it sees E2
            assert n.post("/v1/topics", {"name": f"fs-later-{i}"}).status == 201
        wait_for(lambda: sum(p["high_watermark"] for p in n.get("/v1/topics/fs-par").json()["partition_stats"])
                 == 15, 10, what="the backlog committed to the parent")
        assert time.time() < min(sent.values()) + DELAY_MS / 1000 - 2, "the backlog fell due before the restart"
        assert n.stop() == 0
        before = {f: (f.stat().st_ino, CF.CursorFile(f.parent, "fs-kid").read()) for f in
                  _files(n, "fs-par", pid, "fs-kid")}
        assert all(st is not None and st.epoch == e2 for _, st in before.values())

        shutil.rmtree(fsm)
        shutil.copytree(old, fsm)
        n.extra_env["NARAD_FAULT_APPLY_DELAY_MS"] = "40"
        log_from = len(n.log())
        n.start(wait=False)
        # The stale window is real: the workers serve the old link for a while.
        seen = wait_for(lambda: _epoch(n, "fs-kid"), 30, 0.02, "the child served from the stale replica")
        assert seen == e1, "the replica was not stale at the start; the test proves nothing"
        n.wait_ready(60)
        wait_for(lambda: _epoch(n, "fs-kid") == e2, 30, 0.1, "the replica caught up")

        arrived: dict[str, float] = {}
        extra: list[Any] = []
        end = time.monotonic() + max(0.0, min(sent.values()) + DELAY_MS / 1000 - time.time()) + 20
        while len(arrived) < len(sent) and time.monotonic() < end:
            for m in consume(n, "fs-kid"):
                if m["payload"] in sent and m["payload"] not in arrived:
                    arrived[m["payload"]] = time.time()
                else:
                    extra.append(m["payload"])
        extra += [m["payload"] for m in consume(n, "fs-kid", "1s")]
        assert sorted(arrived) == sorted(sent), f"backlog skipped: {sorted(set(sent) - set(arrived))}"
        assert not extra, f"copied from the dead epoch's view (duplicates or early copies): {extra}"
        for body, t_send in sent.items():
            early = t_send + DELAY_MS / 1000 - arrived[body]
            assert early <= 0, f"{body} delivered {early:.3f}s before it was due"
        after = {f: (f.stat().st_ino, CF.CursorFile(f.parent, "fs-kid").read()) for f in
                 _files(n, "fs-par", pid, "fs-kid")}
        assert sorted(after) == sorted(before)
        for f, (ino, st) in after.items():
            assert ino == before[f][0], f"{f.name} was re-anchored (replaced) after the restart"
            assert st is not None and st.epoch == e2
        log = n.log()[log_from:]
        started = [line for line in log.splitlines() if "fan-out cursor started" in line]
        assert len(started) == 3 and all(e2 in line for line in started), started
    finally:
        n.close()
