"""Fan-out throughput: a parent with 1, 3 and 10 children (and 0 children, the
baseline for the CPU per copy), on one node and on a 3-node loopback cluster, one
worker per node. Prints a table with, per run:

- msgs/s into the parent: batch produce (100 x 1 KiB per request) for ``--seconds``
  with bench.py's client, one client process per node, each talking to its own node
  (keyless messages: committed at a partition of the node that took them);
- copies/s into the children: the sum of every child's high watermark, read from
  describe every ``--sample`` seconds: the copies made by the time the producers
  stopped over the produce window, and every copy over the time from the start until
  every child held every message; and the catch-up time after the producers stopped;
- server CPU (psutil over every process of every node, start to catch-up) per parent
  message, and per copy: (CPU - the 0-children run's CPU per message x messages) /
  copies. The describes of the sampler are included (a few per second).

Every child has the parent's 6 partitions (keyless records keep their partition
index); on the cluster the children are placed round-robin like any topic, so a
share of the copies (column x-node) crosses to another node. Afterwards each child's high watermarks must add up to
the parent's (more: duplicates; fewer: a loss) and the parent's to what got 202.

Usage: .venv/bin/python loadtest/bench_fanout.py [--seconds 5] [--children 0,1,3,10] [--nodes 1,3] [--replica]
``--replica``: on the cluster the children are created as replica children instead
(create-as-child: child partition p off the node of parent partition p, every copy
crosses node RPC).
The nodes and the load generator share this machine's cores: the figures are what the
whole set-up does on it, a floor for the server alone.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest import bench as B  # noqa: E402
from tests.harness import Cluster, Node, wait_for  # noqa: E402

PARTITIONS = 6


@dataclass
class Row:
    setup: str
    children: int
    msgs: int = 0
    wall: float = 0.0
    window_copies: int = 0  # copies made during the produce window (sampled)
    window_secs: float = 0.0
    copies: int = 0
    total_secs: float = 0.0  # from the start until every child held every message
    catchup: float = 0.0
    server_cpu: float = 0.0
    client_cpu: float = 0.0
    other_cpu: float = 0.0  # the rest of the machine (other jobs make a run noisy)
    cross: float = math.nan  # share of child partitions on another node than the same parent partition
    check: str = "ok"
    failed: bool = False
    samples: list[tuple[float, int]] = field(default_factory=list)


def hwms(node: Node, topic: str) -> int | None:
    r = node.get(f"/v1/topics/{topic}")
    if r.status != 200:
        raise B.BenchFailure(f"GET /v1/topics/{topic} -> {r.status} {r.body[:300]!r}")
    j = r.json()
    if j.get("partial"):
        return None
    return sum(s["high_watermark"] for s in j["partition_stats"])


def copies_total(node: Node, children: list[str], tries: int = 20) -> int:
    """Every child's high watermarks summed; a describe with a partition missing
    (its owner slower than 2 s to answer) is asked again, never counted as 0."""
    total = 0
    for ch in children:
        for _ in range(tries):
            v = hwms(node, ch)
            if v is not None:
                break
        else:
            raise B.BenchFailure(f"describe {ch}: an owner did not answer {tries} times in a row")
        total += v
    return total


def make_topics(members: list[Node], parent: str, k: int, replica: bool) -> list[str]:
    a = members[0]
    r = a.post("/v1/topics", {"name": parent, "partitions": PARTITIONS})
    if r.status != 201:
        raise B.BenchFailure(f"create {parent} -> {r.status} {r.body[:300]!r}")
    # Every replica holds the parent before a child is linked: an attach right after the create can answer
    # 503 while an owner of parent partitions has not applied it yet (see tests/test_fanout_cluster.py).
    for n in members:
        wait_for(lambda n=n: n.get(f"/v1/topics/{parent}").status == 200, 20)
    children = [f"{parent}-c{i}" for i in range(k)]
    for ch in children:
        if replica:  # create-as-child: partition p placed off the owner of parent partition p
            r = a.post("/v1/topics", {"name": ch, "parent": parent})
            if r.status != 201:
                raise B.BenchFailure(f"create {ch} as a child -> {r.status} {r.body[:300]!r}")
            continue
        r = a.post("/v1/topics", {"name": ch, "partitions": PARTITIONS})
        if r.status != 201:
            raise B.BenchFailure(f"create {ch} -> {r.status} {r.body[:300]!r}")
        r = a.post(f"/v1/topics/{parent}/children", {"child": ch})
        if r.status != 200:
            raise B.BenchFailure(f"attach {ch} -> {r.status} {r.body[:300]!r}")
    for n in members:
        wait_for(lambda n=n: n.get(f"/v1/topics/{parent}").status == 200
                 and len(n.get(f"/v1/topics/{parent}").json().get("children", [])) == k, 20)
    return children


def owners(node: Node, topic: str) -> list[str]:
    return [s["owner_node"] for s in node.get(f"/v1/topics/{topic}").json()["partition_stats"]]


def one_run(setup: str, members: list[Node], k: int, args: argparse.Namespace) -> Row:
    row = Row(setup, k)
    parent = f"fan{k}"
    children = make_topics(members, parent, k, args.replica and len(members) > 1)
    if children:
        po = owners(members[0], parent)
        cross = [o != po[p] for ch in children for p, o in enumerate(owners(members[0], ch))]
        row.cross = sum(cross) / len(cross)

    class ParentRequests(B.Requests):  # the forked clients build their requests from bench.Requests
        def __init__(self, port: int, auth: str, topic: str = parent) -> None:
            super().__init__(port, auth, topic)

    B.Requests = ParentRequests  # type: ignore[misc]
    sc = B.Scenario(f"fan-out {k}", "produce_batch", 1, len(members), args.conns, args.seconds, batch=100)
    procs = [p for n in members for p in B._node_procs(n)]
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(sc.procs + 1)
    pipes, clients = [], []
    for i, node in enumerate(members):
        rd, wr = ctx.Pipe(duplex=False)
        p = ctx.Process(target=B._client_main, args=(sc, node.port, node.auth, i, barrier, wr), daemon=True)
        p.start()
        wr.close()
        pipes.append(rd)
        clients.append(p)
    try:
        barrier.wait(timeout=120)
    except Exception:
        pass
    t0 = time.monotonic()
    cpu0, busy0 = B._cpu(procs), B._machine_busy()
    probe = members[0]
    stats: list[B.Stats] = []
    t_end: float | None = None
    at_end = 0
    deadline = t0 + args.seconds + 300
    pending = list(pipes)
    while pending and time.monotonic() < deadline:
        row.samples.append((time.monotonic() - t0, copies_total(probe, children)))
        for rd in list(pending):
            if rd.poll(0):
                pending.remove(rd)
                try:
                    stats.append(rd.recv())
                except EOFError:
                    stats.append(B.Stats(failure="a client process exited without a result"))
        if pending:
            time.sleep(args.sample)
    at_end = copies_total(probe, children)
    t_end = time.monotonic()
    for p in clients:
        p.join(10)
    failures = [s.failure for s in stats if s.failure]
    if len(stats) < len(pipes) or failures:
        raise B.BenchFailure(failures[0] if failures else "a client process gave no result")
    row.msgs = sum(s.produced for s in stats)
    row.wall = max(s.t1 for s in stats) - min(s.t0 for s in stats)
    # The children are new and empty at t0 (a first sample of ten describes takes long enough under load
    # for copies to be made while it is read: it is no baseline).
    row.window_copies, row.window_secs = at_end, t_end - t0
    want = row.msgs * k
    done = at_end
    end = time.monotonic() + args.catchup_timeout
    while done < want and time.monotonic() < end:
        time.sleep(args.sample)
        done = copies_total(probe, children)
        row.samples.append((time.monotonic() - t0, done))
    t_done = time.monotonic()
    cpu1, busy1 = B._cpu(procs), B._machine_busy()
    row.server_cpu = sum(u + sy - sum(cpu0.get(pid, (0.0, 0.0))) for pid, (u, sy) in cpu1.items())
    row.client_cpu = sum(s.cpu for s in stats)
    row.other_cpu = max(0.0, busy1 - busy0 - row.server_cpu - row.client_cpu)
    row.copies, row.total_secs, row.catchup = done, t_done - t0, t_done - t_end
    # checks: the parent holds what got 202; each child holds exactly the parent's messages
    try:
        wait_for(lambda: hwms(probe, parent) == row.msgs, 30, 0.1, "the parent to hold every message")
    except AssertionError:
        row.check, row.failed = f"parent holds {hwms(probe, parent)} of {row.msgs:,} accepted", True
    bad = {ch: v for ch in children if (v := hwms(probe, ch)) != row.msgs}
    if bad:
        row.failed = True
        row.check = (f"children not equal to the parent's {row.msgs:,} (after {args.catchup_timeout:.0f} s): "
                     + ", ".join(f"{ch} {v}" for ch, v in list(bad.items())[:4]))
    for t in [parent, *children]:  # free the disk for the next run
        members[0].request("DELETE", f"/v1/topics/{t}")
    return row


HEADER = (f"{'setup':<9}{'children':>9}{'msgs':>10}{'secs':>6}{'msgs/s':>9}{'copies/s win':>13}"
          f"{'copies/s all':>13}{'catch-up s':>11}{'srv CPU':>8}{'oth CPU':>8}{'srv µs/msg':>11}{'µs/copy':>8}"
          f"{'x-node':>7}  check")


def fmt(r: Row, base_us: float | None) -> str:
    rate = r.msgs / r.wall if r.wall else 0.0
    win = r.window_copies / r.window_secs if r.window_secs else 0.0
    allr = r.copies / r.total_secs if r.total_secs and r.children else 0.0
    us_msg = r.server_cpu / r.msgs * 1e6 if r.msgs else math.nan
    us_copy = ((r.server_cpu - base_us * 1e-6 * r.msgs) / r.copies * 1e6
               if base_us is not None and r.copies else math.nan)
    cross = f"{r.cross:.0%}" if not math.isnan(r.cross) else "-"
    return (f"{r.setup:<9}{r.children:>9}{r.msgs:>10,}{r.wall:>6.1f}{rate:>9,.0f}{win:>13,.0f}{allr:>13,.0f}"
            f"{r.catchup:>11.1f}{r.server_cpu / r.total_secs * 100:>7.0f}%{r.other_cpu / r.total_secs * 100:>7.0f}%"
            f"{us_msg:>11.0f}{us_copy:>8.0f}"
            f"{cross:>7}  {r.check}")


def setup(nodes: int, tmp: Path) -> tuple[list[Node], object]:
    if nodes == 1:
        n = Node(tmp / "data", workers=1).start()
        return [n], n
    c = Cluster(tmp, nodes).start()
    c.leader()
    return [c[x] for x in c.initial], c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--seconds", type=float, default=5.0, help="produce window per run")
    ap.add_argument("--children", default="0,1,3,10", help="comma-separated child counts (0: the CPU baseline)")
    ap.add_argument("--nodes", default="1,3", help="comma-separated: 1 (one node) and/or 3 (a 3-node cluster)")
    ap.add_argument("--conns", type=int, default=3, help="batch-produce connections per client process (per node)")
    ap.add_argument("--sample", type=float, default=0.5, help="seconds between reads of the children's HWMs")
    ap.add_argument("--catchup-timeout", type=float, default=180.0, help="max wait for the children to catch up")
    ap.add_argument("--replica", action="store_true",
                    help="on the cluster, create the children as replica children (POST /v1/topics with parent): "
                         "every child partition off the node of the same-index parent partition")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still stops its nodes (finally)
    ks = [int(x) for x in args.children.split(",")]
    cpus = len(os.sched_getaffinity(0))
    print(f"# narad fan-out benchmark: {cpus} CPUs, {psutil.virtual_memory().total >> 30} GiB, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, code {B.code_version()}; 1 KiB messages, batch produce 100, "
          f"{args.conns} connections per node, {args.seconds:.0f} s windows, one worker per node"
          + ("; cluster children created as replica children" if args.replica else ""))
    print(HEADER, flush=True)
    failed = False
    for nodes in (int(x) for x in args.nodes.split(",")):
        name = "1 node" if nodes == 1 else f"{nodes} nodes"
        tmp = Path(tempfile.mkdtemp(prefix="narad-bench-fanout-"))
        members, owner = setup(nodes, tmp)
        base_us: float | None = None
        try:
            for k in ks:
                try:
                    r = one_run(name, members, k, args)
                except (B.BenchFailure, AssertionError, OSError) as e:
                    failed = True
                    print(f"{name:<9}{k:>9}  FAILED: {e}\n" + "\n".join(B._tail(n) for n in members), flush=True)
                    continue
                if k == 0 and r.msgs:
                    base_us = r.server_cpu / r.msgs * 1e6
                print(fmt(r, base_us), flush=True)
                if r.failed:  # what the nodes said about it
                    for n in members:
                        lines = [ln for ln in n.log().splitlines() if (" WARN " in ln or " ERRO " in ln)]
                        print(f"  {n.node_id}: {len(lines)} warnings/errors; last ones:\n"
                              + "\n".join("    " + ln[:400] for ln in lines[-15:]), flush=True)
                failed |= r.failed
        finally:
            owner.close()  # type: ignore[attr-defined]
            shutil.rmtree(tmp, ignore_errors=True)
    print("copies/s win: copies made during the produce window; all: every copy / time from the start until "
          "the children caught up; µs/copy: server CPU beyond the 0-children run's per message, per copy; "
          "x-node: share of child partitions owned by another node than the same-index parent partition; oth CPU: the "
          "rest of the machine besides the nodes and the clients (large: someone else's job, a noisy run)")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
