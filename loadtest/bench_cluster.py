"""Benchmarks for a 3-node cluster on loopback (one worker per node). Prints:

1. metadata write latency p50/p99: sequential topic creates over HTTP/1.1 sent
   to the Raft leader, and sent to a follower (forwarded to the leader over
   node RPC; the follower answers once its own FSM applied the leader's index);
2. the gap in metadata writes while the leader stops gracefully (SIGTERM: it
   hands leadership over first) and after it is killed with SIGKILL;
3. full-flow throughput (produce, consume, ack; single-message and batch) with
   one client process per node, each talking to its own node (keyless
   messages are committed at a partition of the node that took them; consumes
   that find nothing there probe the other nodes), the node RPCs sent per
   message by operation, and, in the same sitting, the same clients against
   one node with one worker (``--no-baseline`` skips it) with the ratio. With
   ``--cross`` every message has a key, so 2 of 3 are committed at an owner one
   node hop away, and the extra server CPU per message that crossed a hop is
   printed.

Usage: .venv/bin/python loadtest/bench_cluster.py [--seconds 5] [--writes 300] [--cross]
Three nodes (six processes) and the load generator share this machine's
cores: the figures are what the whole cluster does on it, not per node.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest import bench as B  # noqa: E402
from tests.harness import Cluster, Node, wait_for  # noqa: E402


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p))] if s else math.nan


def write_latency(node: Node, prefix: str, count: int) -> tuple[float, float]:
    conn = node.conn()
    for i in range(20):  # warm-up: connection, auth cache, forwarding connection
        r = node.post("/v1/topics", {"name": f"{prefix}-warm-{i}", "partitions": 3}, conn=conn)
        if r.status != 201:
            raise SystemExit(f"create at {node.node_id} -> {r.status} {r.body[:300]!r}")
    lat = []
    for i in range(count):
        t = time.perf_counter()
        r = node.post("/v1/topics", {"name": f"{prefix}-{i}", "partitions": 3}, conn=conn)
        lat.append(time.perf_counter() - t)
        if r.status != 201:
            raise SystemExit(f"create at {node.node_id} -> {r.status} {r.body[:300]!r}")
    conn.close()
    return pct(lat, 0.5), pct(lat, 0.99)


def write_gap(c: Cluster, how: str) -> float:
    """Stop the leader (SIGTERM or SIGKILL) while a survivor creates topics in a loop;
    the longest gap between two successful creates, in seconds."""
    leader = c.leader()
    writer = c[next(n for n in c.initial if n != leader)]
    conn = writer.conn()
    conn.timeout = 15
    last, gap, i, stopped_at = time.monotonic(), 0.0, 0, None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if stopped_at is None and i == 20:
            stopped_at = time.monotonic()
            if how == "term":
                c[leader].proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            else:
                c[leader].kill9()
        try:
            r = writer.post("/v1/topics", {"name": f"gap-{how}-{i}", "partitions": 3}, conn=conn)
            ok = r.status == 201
        except OSError:
            conn.close()
            conn = writer.conn()
            conn.timeout = 15
            ok = False
        i += 1
        now = time.monotonic()
        if ok:
            gap = max(gap, now - last)
            last = now
            if stopped_at is not None and now - stopped_at > 3 and i > 40:
                break
        else:
            time.sleep(0.01)
    conn.close()
    if how == "term":
        c[leader].proc.wait(30)  # type: ignore[union-attr]
    c[leader].start()
    c[leader].wait_ready(60)
    return gap


KEYS = 24  # keyed messages spread over every partition: 2 of every 3 are committed one node hop away


class CrossRequests(B.Requests):
    """bench.Requests with a key on every message (``--cross``). A keyless message goes to a
    partition its own node owns (no hop); a keyed one to the partition its key hashes to,
    whoever owns it, so the dispatcher's commit crosses to the owner node for 2 of 3."""

    def __init__(self, port: int, auth: str, topic: str = B.TOPIC, feature: str = "") -> None:
        super().__init__(port, auth, topic, feature)
        head = self.produce_head.decode()
        i = head.index(" HTTP/1.1")
        self._heads = [(head[:i] + f"?key=k{k}" + head[i:]).encode() for k in range(KEYS)]

    def produce(self, mid: int) -> bytes:
        return self._heads[mid % KEYS] + B.payload(mid)

    def produce_batch(self, first: int, n: int) -> bytes:
        body = b'{"messages":[' + b",".join([b'{"key":"k%d","payload":' % ((first + i) % KEYS) + B.payload(first + i)
                                             + b"}" for i in range(n)]) + b"]}"
        return self.batch_head + b"%d\r\n\r\n" % len(body) + body


_RPC_LINE = re.compile(r'^narad_node_rpc_(calls|served)_total\{op="(\w+)"\} ([0-9.e+]+)$', re.M)


def rpc_counts(c: Cluster) -> Counter[tuple[str, str]]:
    """(calls|served, operation) -> count over every node (from /metrics)."""
    out: Counter[tuple[str, str]] = Counter()
    for n in c.initial:
        r = c[n].get("/metrics")
        if r.status == 200:
            for what, op, v in _RPC_LINE.findall(r.body.decode(errors="replace")):
                out[(what, op)] += int(float(v))
    return out


def flow(sc: B.Scenario, profile: Path | None = None) -> B.Result:
    res = B.Result(sc)
    tmp = Path(tempfile.mkdtemp(prefix="narad-bench-cluster-"))
    c = Cluster(tmp, 3)
    try:
        c.start()
        leader = c.leader()
        r = c[leader].post("/v1/topics", {"name": B.TOPIC, "partitions": B.PARTITIONS})
        if r.status != 201:
            raise B.BenchFailure(f"POST /v1/topics -> {r.status} {r.body[:300]!r}")
        for n in c.initial:
            wait_for(lambda n=n: c[n].get(f"/v1/topics/{B.TOPIC}").status == 200, 20)
        procs = [p for n in c.initial for p in B._node_procs(c[n])]
        ctx = mp.get_context("fork")
        barrier = ctx.Barrier(sc.procs + 1)
        pipes, children = [], []
        for i in range(sc.procs):
            node = c[c.initial[i % 3]]
            rd, wr = ctx.Pipe(duplex=False)
            p = ctx.Process(target=B._client_main, args=(sc, node.port, node.auth, i, barrier, wr), daemon=True)
            p.start()
            wr.close()
            pipes.append(rd)
            children.append(p)
        try:
            barrier.wait(timeout=120)
        except Exception:
            pass
        rpc0 = rpc_counts(c)
        cpu0, busy0 = B._cpu(procs), B._machine_busy()
        spies: list = []
        if profile is not None:  # py-spy the first node's worker (the nodes are symmetric)
            spies, res.profiles = B._start_spies(c[c.initial[0]], sc, profile, ".", B.SPY_RATE)
        stats: list[B.Stats] = []
        for rd in pipes:
            if not rd.poll(sc.seconds + 300):
                raise B.BenchFailure("a client process gave no result within the run time + 300 s")
            stats.append(rd.recv())
        cpu1, busy1 = B._cpu(procs), B._machine_busy()
        rpc1 = rpc_counts(c)
        for p in children:
            p.join(10)
        for spy in spies:
            spy.wait(60)
        res.rpc = {k: rpc1[k] - rpc0.get(k, 0) for k in rpc1 if rpc1[k] - rpc0.get(k, 0) > 0}  # type: ignore[attr-defined]
        failures = [s.failure for s in stats if s.failure]
        if failures:
            raise B.BenchFailure(failures[0])
        res.wall = max(s.t1 for s in stats) - min(s.t0 for s in stats)
        res.server_cpu = sum(u + sy - sum(cpu0.get(pid, (0.0, 0.0))) for pid, (u, sy) in cpu1.items())
        res.client_cpu = sum(s.cpu for s in stats)
        res.other_cpu = max(0.0, busy1 - busy0 - res.server_cpu - res.client_cpu)
        res.requests = sum(s.requests for s in stats)
        res.produced = sum(s.produced for s in stats)
        lat = [x for s in stats for x in s.lat]
        res.p50, res.p99 = pct(lat, 0.5), pct(lat, 0.99)
        res.msgs = sum(s.acked for s in stats)
        produced = {x for s in stats for x in s.produced_ids}
        consumed: Counter[int] = Counter()
        for s in stats:
            consumed.update(s.consumed_ids)
        res.check = uvloop.run(B._drain(c[leader].port, c[leader].auth, produced, consumed))
        bad = sum((s.ack_bad for s in stats), Counter())
        if bad:
            res.check.text += f"; acks not 204 in the window: {dict(bad)}"
        clat = [x for s in stats for x in s.clat]
        res.check.text += f"; consume p50 {pct(clat, 0.5) * 1e3:.1f} p99 {pct(clat, 0.99) * 1e3:.1f} ms"
    except (B.BenchFailure, AssertionError, OSError) as e:
        res.failure = f"{e}\n" + "\n".join(f"{n} log tail:\n{B._tail(c[n])}" for n in c.initial)
    finally:
        c.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--seconds", type=float, default=5.0, help="timed window per throughput run")
    ap.add_argument("--writes", type=int, default=300, help="sequential topic creates per latency figure")
    ap.add_argument("--conns", type=int, default=32, help="connections per client process, single-message flow")
    ap.add_argument("--batch-conns", type=int, default=3, help="connections per client process, batch flow")
    ap.add_argument("--skip-flow", action="store_true")
    ap.add_argument("--skip-meta", action="store_true")
    ap.add_argument("--only", help="regex on the flow scenario names")
    ap.add_argument("--profile", type=Path, metavar="DIR", help="py-spy n1's worker during the flow runs")
    ap.add_argument("--no-baseline", action="store_true", help="skip the one-node, one-worker runs")
    ap.add_argument("--cross", action="store_true",
                    help="keyed messages (2 of 3 committed one node hop away) instead of keyless ones (no commit hop)")
    args = ap.parse_args()
    cpus = len(os.sched_getaffinity(0))
    print(f"# narad 3-node loopback cluster benchmark: {cpus} CPUs, {psutil.virtual_memory().total >> 30} GiB, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, code {B.code_version()}")
    if not args.skip_meta:
        metadata(args)
    if args.skip_flow:
        return
    if args.cross:
        B.Requests = CrossRequests  # type: ignore[misc]  # the forked clients build their requests from it
    print("\n# full flow, one client process per node (3 in all), each on its own node; msgs = acked; "
          + ("keyed messages: 2 of 3 committed one node hop away" if args.cross else
             "keyless messages (committed at a partition of their own node)"))
    print(B.HEADER)
    todo = [B.Scenario("flow single", "flow", 1, 3, args.conns, args.seconds),
            B.Scenario("flow batch100", "flow_batch", 1, 3, args.batch_conns, args.seconds, batch=100)]
    if args.only:
        todo = [sc for sc in todo if re.search(args.only, sc.name)]
    failed = False
    for sc in todo:
        r = flow(sc, args.profile)
        print(B.row(r), flush=True)
        sent = {op: v for (what, op), v in getattr(r, "rpc", {}).items() if what == "calls"}
        if sent and r.msgs:  # the window includes a little of the warm-up and drain: per message, roughly
            total = sum(sent.values())
            print(f"  node RPCs sent (requests and notes) per acked message: {total / r.msgs:.2f} = "
                  + ", ".join(f"{op} {v / r.msgs:.2f}" for op, v in sorted(sent.items(), key=lambda kv: -kv[1])),
                  flush=True)
        if r.failure or r.check.failed:
            failed = True
            print(r.failure or r.check.text)
        for f in r.profiles:
            print(B.summarise(f) if f.exists() else f"{f}: py-spy wrote nothing")
        if args.no_baseline or r.failure:
            continue
        one = B.run(B.Scenario(f"{sc.name} 1 node", sc.mode, 1, sc.procs, sc.conns, sc.seconds, batch=sc.batch), None)
        print(B.row(one), flush=True)
        if one.failure or one.check.failed:
            failed = True
            print(one.failure or one.check.text)
            continue
        if one.msgs and r.msgs and one.wall and r.wall:
            ratio = (r.msgs / r.wall) / (one.msgs / one.wall)
            us3, us1 = r.server_cpu / r.msgs * 1e6, one.server_cpu / one.msgs * 1e6
            line = f"  -> 3 nodes / 1 node: {ratio:.2f}x msgs/s; server CPU {us3:.0f} vs {us1:.0f} us/msg"
            if args.cross:  # 2 of every 3 messages are committed one node hop away
                line += f"; extra per message that crossed a node hop ~{(us3 - us1) * 1.5:.0f} us"
            print(line, flush=True)
    if failed:
        sys.exit(1)


def metadata(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="narad-bench-cluster-"))
    c = Cluster(tmp, 3)
    try:
        c.start()
        leader = c.leader()
        follower = next(n for n in c.initial if n != leader)
        p50, p99 = write_latency(c[leader], "at-leader", args.writes)
        print(f"metadata write (topic create) at the leader:      p50 {p50 * 1e3:6.2f} ms  p99 {p99 * 1e3:6.2f} ms "
              f"({args.writes} sequential)")
        p50, p99 = write_latency(c[follower], "via-follower", args.writes)
        print(f"metadata write (topic create) through a follower: p50 {p50 * 1e3:6.2f} ms  p99 {p99 * 1e3:6.2f} ms "
              f"({args.writes} sequential)")
        print(f"metadata write gap, leader stopped with SIGTERM (hands leadership over): {write_gap(c, 'term'):.2f} s")
        print(f"metadata write gap, leader killed with SIGKILL (election):               {write_gap(c, 'kill'):.2f} s")
    finally:
        c.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
