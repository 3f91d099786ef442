"""Metadata benchmarks for one node on loopback. Prints:

1. topic-lookup cost on the worker read path: a cache hit (one atomic load of
   the topic's version slot + dict lookup) and an LMDB read (short read
   transaction + msgpack decode), in ns per lookup;
2. metadata write latency p50/p99: sequential topic creates over HTTP/1.1
   (worker -> supervisor -> Raft propose -> FSM commit -> answer);
3. GET /v1/topics/{topic} requests/s over HTTP/1.1 (wrk) and HTTP/3 (aioquic
   client), with 1 worker and with N workers, plus the client's CPU.

Usage: .venv/bin/python loadtest/bench_meta.py [--seconds 5] [--workers N]
The load generator shares this machine's cores with the node, so
requests/s are a floor for what the server alone can do.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.harness import Node  # noqa: E402


def lookup_costs(n_topics: int = 10_000, rounds: int = 200_000) -> tuple[float, float, float]:
    from narad.meta import commands as C
    from narad.meta import versions as V
    from narad.meta.fsm import FSM
    from narad.meta.records import TopicRecord

    tmp = Path(tempfile.mkdtemp(prefix="narad-bench-"))
    shm = f"/narad-bench-{os.getpid()}"
    versions = V.VersionTable.create(shm)
    fsm = FSM(tmp / "fsm", on_commit=lambda t, i: versions.bump(t))
    for i in range(n_topics):
        t = TopicRecord(name=f"topic-{i}", id=f"{i:016x}", partitions=3, retention_ms=0,
                        visibility_timeout_ms=30000, max_in_flight_per_partition=1024,
                        max_acked_ahead_per_partition=1024, created_at=1)
        fsm.apply(i + 1, C.encode(C.CreateTopic(t), request_id="", stamp_ms=1))
    fsm.commit()
    fsm.close()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a reader process, like a worker: read-only env opened after fork
        from narad.meta.store import MetaStore

        store = MetaStore(tmp / "fsm", V.VersionTable.attach(shm))
        names = [f"topic-{i % n_topics}" for i in range(1000)]
        for nm in names:
            store.topic(nm)
        t0 = time.perf_counter_ns()
        for i in range(rounds):
            store.topic(names[i % 1000])
        hit = (time.perf_counter_ns() - t0) / rounds
        t0 = time.perf_counter_ns()
        for i in range(rounds // 10):
            with store.read() as rd:
                rd.topic(names[i % 1000])
        miss = (time.perf_counter_ns() - t0) / (rounds // 10)
        t0 = time.perf_counter_ns()
        for _ in range(rounds):
            versions.load(V.TOPICS)
        load = (time.perf_counter_ns() - t0) / rounds
        os.write(w, f"{hit} {miss} {load}".encode())
        os._exit(0)
    os.waitpid(pid, 0)
    hit, miss, load = (float(x) for x in os.read(r, 200).decode().split())
    versions.close(unlink=True)
    shutil.rmtree(tmp)
    return hit, miss, load


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p))]


def write_latency(node: Node, count: int) -> tuple[float, float, float]:
    conn = node.conn()
    lat = []
    for i in range(count):
        t0 = time.perf_counter()
        r = node.post("/v1/topics", {"name": f"bench-w-{i}"}, conn=conn)
        lat.append(time.perf_counter() - t0)
        assert r.status == 201, r
    conn.close()
    return pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3, statistics.mean(lat) * 1e3


def wrk_get(node: Node, seconds: int, connections: int) -> tuple[float, float]:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("wrk not found: `make bench` installs it (apt-get install wrk)")
    t0 = os.times()
    p = subprocess.run([wrk, "-t1", f"-c{connections}", f"-d{seconds}s", "-H", f"Authorization: {node.auth}",
                        f"http://127.0.0.1:{node.port}/v1/topics/bench-get"], capture_output=True, text=True)
    t1 = os.times()
    m = re.search(r"Requests/sec:\s+([\d.]+)", p.stdout)
    if not m:
        raise SystemExit(p.stdout + p.stderr)
    client_cpu = (t1.children_user + t1.children_system) - (t0.children_user + t0.children_system)
    return float(m.group(1)), client_cpu / seconds


async def _h3_load(node: Node, seconds: float, conns: int, streams: int) -> tuple[int, float]:
    from narad.client.h3 import H3Client

    clients = [await H3Client.connect("127.0.0.1", node.port) for _ in range(conns)]
    done = 0
    end = time.monotonic() + seconds

    async def loop(c: H3Client) -> None:
        nonlocal done
        while time.monotonic() < end:
            st, _, _ = await c.request("GET", "/v1/topics/bench-get", headers={"authorization": node.auth})
            assert st == 200
            done += 1

    t0 = time.process_time()
    await asyncio.gather(*(loop(c) for c in clients for _ in range(streams)))
    cpu = time.process_time() - t0
    for c in clients:
        await c.close()
    return done, cpu


def h3_get(node: Node, seconds: int) -> tuple[float, float]:
    done, cpu = asyncio.run(_h3_load(node, seconds, conns=2, streams=16))
    return done / seconds, cpu / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--writes", type=int, default=300)
    args = ap.parse_args()
    print(f"# narad metadata benchmark, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}")
    hit, miss, load = lookup_costs()
    print(f"topic lookup, worker read path: cache hit {hit:.0f} ns, LMDB read {miss:.0f} ns "
          f"(version-slot atomic load alone {load:.0f} ns)")
    for workers in sorted({1, args.workers}):
        tmp = Path(tempfile.mkdtemp(prefix="narad-bench-node-"))
        node = Node(tmp / "data", workers=workers).start()
        try:
            node.post("/v1/topics", {"name": "bench-get"})
            if workers == 1:
                p50, p99, mean = write_latency(node, args.writes)
                print(f"metadata write (create topic, sequential, n={args.writes}): "
                      f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, mean {mean:.2f} ms")
            rps, ccpu = wrk_get(node, args.seconds, 32)
            print(f"GET topic HTTP/1.1, {workers} worker(s): {rps:,.0f} req/s (wrk 1 thread 32 conns, "
                  f"client CPU {ccpu * 100:.0f}% of a core)")
            rps3, ccpu3 = h3_get(node, args.seconds)
            print(f"GET topic HTTP/3,   {workers} worker(s): {rps3:,.0f} req/s (aioquic client 2 conns x 16 "
                  f"streams, client CPU {ccpu3 * 100:.0f}% of a core)")
        finally:
            node.close()
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
