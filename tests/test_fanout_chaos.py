"""Fan-out chaos with a ledger per child: sustained produce / consume / ack on a parent
with a plain child and a delay child, on every node of a 3-node cluster, while the
node owning parent partitions and then a node owning child partitions are killed with
SIGKILL and restarted. Each topic has its own recorded history (tests/contract.py);
the children's histories take the parent's produce answers as their own, so the
checker (faults mode, the kill windows declared) shows that every message answered
202 to the producer reached every child and was consumed and acked there: losses zero,
duplicates counted and printed. The delay child delivered nothing before its due time
(its backlog is not skipped: every message arrives, none early)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.contract import History, Traffic, broker_empty, check, stop_all
from tests.harness import Cluster
from tests.test_fanout_cluster import attach, create, delay_figures, owners, wait_everywhere

pytestmark = pytest.mark.slow

DELAY_MS = 3000
VIS_MS = 3000


@contextlib.contextmanager
def fault(hs: list[History], name: str) -> Iterator[None]:
    fs = [h.begin_fault(name) for h in hs]
    try:
        yield
    finally:
        for h, f in zip(hs, fs, strict=True):
            h.end_fault(f)


def test_kill_parent_owner_then_child_owner_under_traffic_every_child_gets_every_message(tmp_path: Path) -> None:
    c = Cluster(tmp_path, 3).start()
    try:
        leader = c.leader()
        at = c[leader]
        create(at, {"name": "src", "partitions": 6, "visibility_timeout_ms": VIS_MS})
        create(at, {"name": "src-a", "partitions": 6, "visibility_timeout_ms": VIS_MS})
        create(at, {"name": "src-d", "partitions": 3, "visibility_timeout_ms": VIS_MS})
        for t in ("src", "src-a", "src-d"):
            wait_everywhere(c, t)  # every owner knows them: the attach point can be read
        attach(at, "src", "src-a")
        attach(at, "src", "src-d", delay_ms=DELAY_MS)
        wait_everywhere(c, "src", lambda j: j.get("children") == ["src-a", "src-d"])
        po, ao, do = owners(at, "src"), owners(at, "src-a"), owners(at, "src-d")
        followers = [n for n in c.initial if n != leader]  # no election: the kills hit owners, not Raft
        x = next(n for n in followers if n in po)
        y = next(n for n in followers if n != x)
        assert y in ao and y in do, (ao, do)
        print(f"\nparent owners {po}, plain child {ao}, delay child {do}; kill {x} (parent owner), then {y} "
              f"(child owner); leader {leader}")

        hp, ha, hd = History(VIS_MS / 1000), History(VIS_MS / 1000), History(VIS_MS / 1000)
        every = [hp, ha, hd]
        nodes = lambda: [c[n] for n in c.initial]  # noqa: E731
        tp = Traffic(hp, "src", nodes, producers=2, consumers=1, rotate_every=40).start()
        ta = Traffic(ha, "src-a", nodes, producers=0, consumers=1, rotate_every=40).start()
        td = Traffic(hd, "src-d", nodes, producers=0, consumers=1, rotate_every=40).start()
        tp.wait_more(150, what="before the faults")
        with fault(every, f"kill -9 {x} (owns parent partitions) until it is ready again"):
            c[x].kill9()
            tp.wait_more(100, what=f"with {x} down")
            c[x].start()
        tp.wait_more(100, what=f"after {x} returned")
        with fault(every, f"kill -9 {y} (owns child partitions) until it is ready again"):
            c[y].kill9()
            tp.wait_more(100, what=f"with {y} down")
            c[y].start()
        tp.wait_more(100, what=f"after {y} returned")
        tp.finish_producing()
        # The children's ledgers: every produce answer of the parent is theirs too.
        for p in hp.snapshot()[0]:
            ha.produced(p.ids, p.call, p.ret, p.status, p.node)
            hd.produced(p.ids, p.call, p.ret, p.status, p.node)
        probe = c[c.initial[0]]
        empty = {"src": tp.drain(broker_empty(probe, "src", 6), timeout=60),
                 "src-a": ta.drain(broker_empty(probe, "src-a", 6), timeout=60),
                 "src-d": td.drain(broker_empty(probe, "src-d", 3), timeout=60)}
        verdicts = {t: check(h, "faults", broker_empty=empty[t]) for t, h in zip(empty, every, strict=True)}
        early, late = delay_figures(hd, DELAY_MS)
        for t, v in verdicts.items():
            print(v.summary(f"fan-out chaos: {t}"))
        print(f"fan-out chaos: duplicates per topic {({t: v.counts['duplicates'] for t, v in verdicts.items()})}; "
              f"client-side errors {tp.errors + ta.errors + td.errors}; delay child: {len(early)} early, latest "
              f"{late:.2f} s after due")
        for t, v in verdicts.items():
            assert v.counts["lost"] == 0, v.summary(t)
            assert v.ok, v.summary(t)
            assert empty[t], f"{t}: some partition still holds an unacked message (or an owner is unavailable)"
        assert not early, early[:5]
    finally:
        stop_all()
        c.close()
