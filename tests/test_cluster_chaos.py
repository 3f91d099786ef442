"""Chaos with a recorded history: sustained produce / consume / ack against every
node of a 3-node cluster while a follower and then the leader are killed with
SIGKILL and restarted. The delivery-contract checker (tests/contract.py, faults
mode) gives the verdict: every message answered 202 delivered and acked (an ack whose
answer was lost, or whose per-handle result was 5xx, counts only once the broker
reports nothing left), no redelivery after a 204 ack outside the kill windows + grace,
no double lease outside them, every lapsed lease delivered again; figures printed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.contract import History, Traffic, broker_empty, check, stop_all
from tests.harness import Cluster, wait_for

pytestmark = pytest.mark.slow


def test_kill_follower_then_leader_under_traffic_loses_nothing(tmp_path: Path) -> None:
    c = Cluster(tmp_path, 3).start()
    try:
        leader = c.leader()
        assert c[leader].post("/v1/topics", {"name": "chaos", "partitions": 6,
                                             "visibility_timeout_ms": 3000}).status == 201
        for n in c.initial:
            wait_for(lambda n=n: c[n].get("/v1/topics/chaos").status == 200)
        h = History(3.0)
        tr = Traffic(h, "chaos", lambda: [c[n] for n in c.initial]).start()
        tr.wait_more(200, what="before the faults")
        follower = next(n for n in c.initial if n != leader)
        with h.fault(f"kill -9 follower {follower}"):
            c[follower].kill9()
            tr.wait_more(150, what="with a follower down")
            c[follower].start()
        tr.wait_more(150, what="after the follower returned")
        leader = c.leader()
        with h.fault(f"kill -9 leader {leader}"):
            c[leader].kill9()
            tr.wait_more(150, what="with the leader down")
            c[leader].start()
        tr.wait_more(150, what="after the leader returned")
        empty = tr.drain(broker_empty(c[c.initial[0]], "chaos", 6), timeout=150)
        v = check(h, "faults", broker_empty=empty)
        stats = c[c.initial[0]].get("/v1/topics/chaos").json()["partition_stats"]
        print("\n" + v.summary("chaos: kill follower then leader")
              + f"\nchaos: client-side errors {tr.errors}; (lag, in flight) per partition "
              f"{[(s.get('lag'), s.get('in_flight')) for s in stats]}")
        assert empty, "some partition still holds an unacked message (or an owner is unavailable)"
        assert v.ok, v.summary()
    finally:
        stop_all()
        c.close()
