"""Partition scale: one node, security on, N workers, many partitions with one
message each. Prints, per worker, open descriptors and RSS (psutil on the
worker PIDs) at each step; topic creation time (creates run concurrently with a
bound); time to ready after a restart (SIGTERM + start, kill -9 + start); and
list / describe latency (p50 / p99), checking that describe opens no log.

Two sittings on the same data:
1. a short idle eviction (``--idle-ms``, default 5 s, so the run does not wait
   30 min): descriptors after the produce, after the idle logs are closed, after
   a restart and a describe of every topic;
2. Narad's defaults (idle eviction 30 min): one more message to every partition;
   only the cap on open logs per worker bounds the descriptors.

Usage: .venv/bin/python loadtest/bench_partitions.py [--topics 1250] [--partitions 8]
       [--workers 2] [--idle-ms 5000] [--concurrency 16]
The load generator shares this machine's cores with the node: latencies are noisy.
"""

from __future__ import annotations

import argparse
import http.client
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.harness import Node, wait_for  # noqa: E402

OCTET = {"Content-Type": "application/octet-stream"}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def ms(xs: list[float]) -> str:
    return f"p50 {pct(xs, 0.5) * 1000:.2f} ms, p99 {pct(xs, 0.99) * 1000:.2f} ms (n={len(xs)})"


def workers(node: Node) -> list[tuple[int, int]]:
    return [(w["index"], w["pid"]) for w in node.status()["workers"] if w["alive"]]


def usage(node: Node) -> list[tuple[int, int, float]]:
    """(worker, open descriptors, RSS MiB) per worker."""
    out = []
    for idx, pid in workers(node):
        p = psutil.Process(pid)
        out.append((idx, p.num_fds(), p.memory_info().rss / (1 << 20)))
    return out


def show(label: str, node: Node) -> None:
    parts = ", ".join(f"w{i}: {fds} fds, {rss:.0f} MiB" for i, fds, rss in usage(node))
    print(f"  {label:<44} {parts}", flush=True)


class Peak:
    """Samples descriptors per worker every 0.2 s while a step runs."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.pids = workers(node)
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        procs = [(i, psutil.Process(pid)) for i, pid in self.pids]
        while not self._stop.is_set():
            for i, p in procs:
                try:
                    self.peak[i] = max(self.peak.get(i, 0), p.num_fds())
                except psutil.Error:
                    pass
            self._stop.wait(0.2)

    def __enter__(self) -> Peak:
        self._t.start()
        return self

    def __exit__(self, *_a: object) -> None:
        self._stop.set()
        self._t.join()

    def line(self) -> str:
        return ", ".join(f"w{i}: {n} fds" for i, n in sorted(self.peak.items()))


def run_many(node: Node, jobs: list[Any], fn: Callable[[http.client.HTTPConnection, Any], float],
             concurrency: int) -> list[float]:
    """Run fn(conn, job) for every job on `concurrency` threads, one keep-alive connection each."""
    local = threading.local()

    def one(job: Any) -> float:
        c = getattr(local, "conn", None)
        if c is None:
            c = local.conn = node.conn()
        try:
            return fn(c, job)
        except (OSError, http.client.HTTPException):
            c.close()
            local.conn = node.conn()
            return fn(local.conn, job)

    with ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(one, jobs))


def timed(node: Node, method: str, path: str, body: Any = None, want: int = 200,
          conn: http.client.HTTPConnection | None = None, headers: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    r = node.request(method, path, body, conn=conn, headers=headers)
    dt = time.perf_counter() - t0
    if r.status != want:
        raise RuntimeError(f"{method} {path}: {r.status} {r.body[:200]!r}")
    return dt


def produce_all(node: Node, names: list[str], partitions: int, concurrency: int, tag: str) -> float:
    jobs = [(n, p) for n in names for p in range(partitions)]
    t0 = time.monotonic()
    run_many(node, jobs, lambda c, j: timed(node, "POST", f"/v1/topics/{j[0]}/produce?partition={j[1]}",
                                            f"{tag}-{j[0]}-{j[1]}".encode(), 202, c, OCTET), concurrency)
    return time.monotonic() - t0


def committed_everywhere(node: Node, names: list[str], want: int, concurrency: int) -> bool:
    def check(c: http.client.HTTPConnection, n: str) -> float:
        r = node.request("GET", f"/v1/topics/{n}", conn=c)
        return float(all(s["high_watermark"] >= want for s in r.json()["partition_stats"]))

    return all(run_many(node, names, check, concurrency))


def list_and_describe(node: Node, names: list[str], concurrency: int, samples: int) -> None:
    lat: list[float] = []
    t0 = time.monotonic()
    token, pages = "", 0
    while True:
        c0 = time.perf_counter()
        r = node.get(f"/v1/topics?limit=100&page_token={token}")
        lat.append(time.perf_counter() - c0)
        pages += 1
        token = r.json()["next_page_token"]
        if not token:
            break
    print(f"  list (100 per page, {pages} pages, {time.monotonic() - t0:.2f} s): {ms(lat)}")
    pick = random.sample(names, min(samples, len(names)))
    one = run_many(node, pick, lambda c, n: timed(node, "GET", f"/v1/topics/{n}", conn=c), 1)
    print(f"  describe, one client: {ms(one)}")
    many = run_many(node, pick, lambda c, n: timed(node, "GET", f"/v1/topics/{n}", conn=c), concurrency)
    print(f"  describe, {concurrency} clients: {ms(many)}")


def restart(node: Node, how: str) -> float:
    if how == "kill -9":
        node.kill9()
    else:
        node.stop()
    t0 = time.monotonic()
    node.start(wait=True)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--topics", type=int, default=1250)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--idle-ms", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--describe-samples", type=int, default=500)
    ap.add_argument("--keep", action="store_true", help="keep the data directory")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="narad-bench-parts-"))
    total = a.topics * a.partitions
    names = [f"t{i:05d}" for i in range(a.topics)]
    short = {"NARAD_STORAGE_IDLE_LOG_EVICTION_MS": str(a.idle_ms)}
    print(f"{a.topics} topics x {a.partitions} partitions = {total} partitions, {a.workers} workers, security on")
    node = Node(tmp / "data", workers=a.workers, env=short)
    try:
        node.start()
        print(f"sitting 1: storage.idle_log_eviction_ms = {a.idle_ms} (short, for the benchmark)")
        show("started", node)
        t0 = time.monotonic()
        lat = run_many(node, names, lambda c, n: timed(node, "POST", "/v1/topics",
                                                       {"name": n, "partitions": a.partitions}, 201, c),
                       a.concurrency)
        dt = time.monotonic() - t0
        print(f"  created {a.topics} topics in {dt:.1f} s ({a.topics / dt:.0f}/s, {a.concurrency} at a time): "
              f"{ms(lat)}")
        with Peak(node) as peak:
            dt = produce_all(node, names, a.partitions, a.concurrency, "a")
            wait_for(lambda: committed_everywhere(node, names, 1, a.concurrency), 600, 0.5, "every commit")
        print(f"  produced 1 message to each of {total} partitions in {dt:.1f} s; peak during it: {peak.line()}")
        show("after the produce", node)
        t0 = time.monotonic()
        wait_for(lambda: node.metric("narad_open_partition_logs") == 0, 600, 0.5, "idle logs closed")
        print(f"  every log closed {time.monotonic() - t0:.1f} s after the produce ended "
              f"(narad_idle_logs_evicted_total {node.metric('narad_idle_logs_evicted_total'):.0f})")
        show("idle logs closed", node)
        list_and_describe(node, names, a.concurrency, a.describe_samples)
        show("after list and describe", node)
        print(f"  open logs after describe: {node.metric('narad_open_partition_logs'):.0f}")
        for how in ("SIGTERM", "kill -9"):
            print(f"  ready {restart(node, how):.2f} s after start ({how} before)")
            show(f"after {how} + start", node)
        list_and_describe(node, names, a.concurrency, a.describe_samples)
        show("after a describe of the samples", node)
        node.stop()

        print("sitting 2: Narad's defaults (storage.idle_log_eviction_ms = 1800000)")
        node = Node(tmp / "data", workers=a.workers)
        t0 = time.monotonic()
        node.start()
        print(f"  ready {time.monotonic() - t0:.2f} s after start")
        show("started", node)
        with Peak(node) as peak:
            dt = produce_all(node, names, a.partitions, a.concurrency, "b")
            wait_for(lambda: committed_everywhere(node, names, 2, a.concurrency), 600, 0.5, "every commit")
        print(f"  produced 1 more message to each partition in {dt:.1f} s; peak during it: {peak.line()}")
        show("after the produce", node)
        print(f"  open logs: {node.metric('narad_open_partition_logs'):.0f} "
              f"(closed at the cap: {node.metric('narad_idle_logs_evicted_total'):.0f})")
        list_and_describe(node, names, a.concurrency, a.describe_samples)
        show("after list and describe", node)
        for how in ("SIGTERM", "kill -9"):
            print(f"  ready {restart(node, how):.2f} s after start ({how} before)")
            show(f"after {how} + start", node)
    finally:
        node.close()
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"data kept in {tmp}")


if __name__ == "__main__":
    main()
