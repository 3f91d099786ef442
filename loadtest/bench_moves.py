"""Partition-move benchmark (issue 13) on a loopback cluster. Prints figures, asserts none:

1. move throughput: three nodes bootstrap (``tests.harness.Cluster``, ``--workers``
   per node, NARAD_MOVE_PLAN_MS=300 on every node), a topic of ``--partitions`` (12)
   is filled with ``--size-mib`` (64) MiB of 16 KiB messages (batch produce, each
   message pinned to a partition, sent to its owner; then consumed and acked so
   the live traffic below starts on an empty backlog), then a 4th node joins and
   the controller plans moves to it (12 partitions over 4 nodes: one from each
   original node). Per move, from the node logs (JSON format): bytes copied
   (``copied_bytes`` of the destination's "partition move finished"), the time
   from "partition move started" to "partition move finished" and MB/s
   (1 MB = 10^6 bytes), the pre-copy time (started -> the source's "partition
   frozen for a move") and the freeze (the source's last "partition frozen for a
   move" -> "partition moved to another node; its old copy set aside"); then the
   aggregate MB/s over the first start to the last finish (moves run side by side).
2. client latency while the moves run: one forked client process produces single
   1 KiB messages at ``--rate`` (200) msg/s, open loop, round-robin over the
   three original nodes, and runs ``--consumers`` (1) batch consume + batch ack
   loops per original node. Figures per phase (by wall-clock timestamps: before
   the join, joining = the 4th node booting until the first move starts, during =
   first move started to the last old copy set aside, after): produce latency
   (202 comes from the receiving node's ingress WAL, so a frozen partition hardly
   shows there), end-to-end delivery latency (produce sent -> first consumed; a
   frozen partition's records wait in the dispatcher, so the freeze shows here),
   consume request latency of answers that carried messages; errors = every
   produce that did not get 202 (status or connection error), consumes not 200/204,
   ack results not 204 (a move's flip makes the leases of the moved partition
   stale: 410 there is expected). After the window the client drains the topic:
   produced-but-never-consumed (lost) and redelivered (duplicate) counts.

Usage (repository root):
    .venv/bin/python loadtest/bench_moves.py                      # 64 MiB, 10 s before / after
    .venv/bin/python loadtest/bench_moves.py --quick              # 8 MiB, 3 s phases: ~30-40 s
    .venv/bin/python loadtest/bench_moves.py --size-mib 256 --rate 500 --workers 2 --keep

The four nodes and the client share this machine's cores: the figures are what
the whole cluster does on it (another job on the cores makes them noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import calendar
import contextlib
import http.client
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest import bench as B  # noqa: E402
from tests.harness import Cluster, Node, wait_for  # noqa: E402

TOPIC = "mv"
FILL_MSG = 16 << 10  # bytes per fill message (one JSON object)
FILL_BATCH = 64  # fill messages per batch produce (~1 MiB body)
_FILL_HEAD = b'{"f":"'
_FILL_PAYLOAD = _FILL_HEAD + b"x" * (FILL_MSG - len(_FILL_HEAD) - 2) + b'"}'
MAX_IN_FLIGHT_PRODUCES = 500  # open-loop producer: beyond this many outstanding requests a send is skipped


def pct(values: Any, p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p))] if s else math.nan


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:.1f}"


# ---- setup: topic, fill, drain ---------------------------------------------------------------------


def owners(n: Node) -> dict[int, str]:
    r = n.get(f"/v1/topics/{TOPIC}")
    if r.status != 200:
        raise RuntimeError(f"GET /v1/topics/{TOPIC} -> {r.status} {r.body[:300]!r}")
    return {int(s["index"]): s["owner_node"] for s in r.json()["partition_stats"]}


def high_watermarks(n: Node) -> int:
    r = n.get(f"/v1/topics/{TOPIC}")
    if r.status != 200:
        return -1
    return sum(int(s.get("high_watermark", 0)) for s in r.json()["partition_stats"])


def fill(c: Cluster, partitions: int, size: int) -> tuple[int, float]:
    """Batch-produce ``size`` bytes spread evenly over the partitions, each batch to the
    partition owner's node (one thread per node); returns (messages, seconds)."""
    own = owners(c[c.initial[0]])
    per_part = max(1, -(-size // (partitions * FILL_MSG)))
    jobs: dict[str, list[int]] = {nid: [] for nid in c.initial}
    for p in range(partitions):
        jobs.setdefault(own[p] if own[p] in jobs else c.initial[0], []).append(p)
    errors: list[str] = []

    def run(nid: str, parts: list[int]) -> None:
        node = c[nid]
        conn = node.conn()
        conn.timeout = 120
        try:
            for p in parts:
                left = per_part
                while left > 0 and not errors:
                    k = min(FILL_BATCH, left)
                    one = b'{"partition":%d,"payload":' % p + _FILL_PAYLOAD + b"}"
                    body = b'{"messages":[' + b",".join([one] * k) + b"]}"
                    r = node.post(f"/v1/topics/{TOPIC}/produce/batch", body, conn=conn,
                                  headers={"Content-Type": "application/json"})
                    if r.status != 202 or r.json().get("accepted") != k:
                        errors.append(f"fill batch at {nid} -> {r.status} {r.body[:300]!r}")
                        return
                    left -= k
        except Exception as e:
            errors.append(f"fill at {nid}: {e!r}")
        finally:
            conn.close()

    t0 = time.monotonic()
    threads = [threading.Thread(target=run, args=(nid, parts)) for nid, parts in jobs.items() if parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(errors[0])
    total = per_part * partitions
    wait_for(lambda: high_watermarks(c[c.initial[0]]) >= total, 300, 0.2, "every fill message committed")
    return total, time.monotonic() - t0


def drain_fill(c: Cluster, total: int) -> float:
    """Consume and ack every fill message (batch APIs, one thread per node); returns seconds."""
    got = Counter[str]()
    lock = threading.Lock()
    errors: list[str] = []
    stop = threading.Event()

    def run(nid: str) -> None:
        node = c[nid]
        conn = node.conn()
        try:
            while not stop.is_set():
                r = node.get(f"/v1/topics/{TOPIC}/consume?wait=500ms&max=100", conn=conn,
                              headers={"X-Narad-Client": "bench-moves"})
                if r.status == 204:
                    continue
                if r.status != 200:
                    errors.append(f"drain consume at {nid} -> {r.status} {r.body[:300]!r}")
                    return
                msgs = r.json()["messages"]
                handles = [m["receipt_handle"] for m in msgs]
                a = node.post(f"/v1/topics/{TOPIC}/ack", {"receipt_handles": handles}, conn=conn)
                if a.status != 200:
                    errors.append(f"drain ack at {nid} -> {a.status} {a.body[:300]!r}")
                    return
                with lock:
                    got["n"] += len(msgs)
                    if got["n"] >= total:
                        stop.set()
        except Exception as e:
            errors.append(f"drain at {nid}: {e!r}")
            stop.set()
        finally:
            conn.close()

    t0 = time.monotonic()
    threads = [threading.Thread(target=run, args=(nid,)) for nid in c.initial]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300
    while not stop.is_set() and not errors and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(30)
    if errors:
        raise RuntimeError(errors[0])
    if got["n"] < total:
        raise RuntimeError(f"drained {got['n']} of {total} fill messages in 300 s")
    return time.monotonic() - t0


# ---- the client process: steady produce, consume + ack -----------------------------------------------


@dataclass
class ClientStats:
    """Pickled back to the parent; times are wall clock (time.time()), latencies seconds."""

    produce: array = field(default_factory=lambda: array("d"))  # t, latency, status triples
    consume: array = field(default_factory=lambda: array("d"))  # t, latency, messages, status
    e2e: array = field(default_factory=lambda: array("d"))  # t sent, delay (first delivery)
    ack_bad: Counter[int] = field(default_factory=Counter)
    consume_bad: Counter[int] = field(default_factory=Counter)
    produce_examples: list[str] = field(default_factory=list)
    skipped: int = 0
    produced: int = 0
    duplicates: int = 0
    fill_seen: int = 0
    lost: int = 0
    stopped_at: float = 0.0
    drained: bool = False
    failure: str = ""


_batch_dec = msgspec.json.Decoder(B._Batch)
_results_dec = msgspec.json.Decoder(B._Results)


class Client:
    def __init__(self, ports: list[int], auth: str, rate: float, consumers: int) -> None:
        self.reqs = [B.Requests(p, auth, TOPIC) for p in ports]
        self.ports = ports
        self.rate = rate
        self.consumers = consumers
        self.st = ClientStats()
        self.sent: dict[int, float] = {}  # produced id -> wall time sent (202 or not: an ambiguous one may land)
        self.ok: set[int] = set()  # got 202
        self.seen: set[int] = set()
        self.pools: list[list[B.HttpConn]] = [[] for _ in ports]
        self.in_flight = 0
        self.producing = True

    async def _conn(self, i: int) -> B.HttpConn:
        pool = self.pools[i]
        while pool:
            c = pool.pop()
            if c._lost is None:
                return c
        return await B.HttpConn.open(self.ports[i])

    async def produce_one(self, mid: int) -> None:
        i = mid % len(self.ports)
        st = self.st
        t_wall = time.time()
        self.sent[mid] = t_wall
        t = time.perf_counter()
        status = -1
        try:
            c = await self._conn(i)
            status, body = await asyncio.wait_for(c.request(self.reqs[i].produce(mid)), 30)
            self.pools[i].append(c)
            if status != 202 and len(st.produce_examples) < 5:
                st.produce_examples.append(f"n{i + 1}: {status} {body[:200]!r}")
        except Exception as e:
            if len(st.produce_examples) < 5:
                st.produce_examples.append(f"n{i + 1}: {e!r}"[:300])
        finally:
            self.in_flight -= 1
        st.produce.extend((t_wall, time.perf_counter() - t, float(status)))
        if status == 202:
            self.ok.add(mid)

    async def producer(self, stop: Any) -> None:
        t0 = time.monotonic()
        tasks: set[asyncio.Task[None]] = set()
        i = 0
        while not stop.is_set():
            due = t0 + i / self.rate
            now = time.monotonic()
            if due > now:
                await asyncio.sleep(due - now)
            if self.in_flight >= MAX_IN_FLIGHT_PRODUCES:
                self.st.skipped += 1
            else:
                self.in_flight += 1
                task = asyncio.get_running_loop().create_task(self.produce_one(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            i += 1
        self.st.stopped_at = time.time()
        if tasks:
            await asyncio.wait(tasks, timeout=40)
        self.producing = False

    async def consumer(self, i: int, deadline: list[float]) -> None:
        r, st = self.reqs[i], self.st
        c: B.HttpConn | None = None
        while time.monotonic() < deadline[0]:
            if not self.producing and self.ok <= self.seen:
                return
            try:
                if c is None or c._lost is not None:
                    c = await B.HttpConn.open(self.ports[i])
                t_wall, t = time.time(), time.perf_counter()
                s, body = await asyncio.wait_for(c.request(r.consume_many), 30)
                lat = time.perf_counter() - t
                if s == 204:
                    st.consume.extend((t_wall, lat, 0.0, 204.0))
                    continue
                if s != 200:
                    st.consume_bad[s] += 1
                    st.consume.extend((t_wall, lat, 0.0, float(s)))
                    await asyncio.sleep(0.05)
                    continue
                msgs = _batch_dec.decode(body).messages
                now = time.time()
                st.consume.extend((t_wall, lat, float(len(msgs)), 200.0))
                for m in msgs:
                    if bytes(memoryview(m.payload)[:len(_FILL_HEAD)]) == _FILL_HEAD:
                        st.fill_seen += 1  # a fill message redelivered (its ack was lost): acked below
                        continue
                    mid = B.id_of(m.payload)
                    if mid in self.seen:
                        st.duplicates += 1
                        continue
                    self.seen.add(mid)
                    sent = self.sent.get(mid)
                    if sent is not None:
                        st.e2e.extend((sent, now - sent))
                a, ab = await asyncio.wait_for(c.request(r.ack_many([m.receipt_handle for m in msgs])), 30)
                if a != 200:
                    st.ack_bad[a] += len(msgs)
                    continue
                for x in _results_dec.decode(ab).results:
                    if x.status != 204:
                        st.ack_bad[x.status] += 1
            except (TimeoutError, B.BenchFailure, OSError) as e:
                st.consume_bad[-1] += 1
                if c is not None:
                    c.close()
                c = None
                await asyncio.sleep(0.1)
                del e

    async def run(self, stop: Any, drain_s: float) -> ClientStats:
        deadline = [math.inf]
        cons = [asyncio.get_running_loop().create_task(self.consumer(i, deadline))
                for i in range(len(self.ports)) for _ in range(self.consumers)]
        await self.producer(stop)
        deadline[0] = time.monotonic() + drain_s
        await asyncio.gather(*cons)
        st = self.st
        st.produced = len(self.ok)
        st.lost = len(self.ok - self.seen)
        st.drained = st.lost == 0
        return st


def client_main(ports: list[int], auth: str, rate: float, consumers: int, drain_s: float, ready: Any, stop: Any,
                out: Any) -> None:
    try:
        cl = Client(ports, auth, rate, consumers)
        ready.set()
        st = uvloop.run(cl.run(stop, drain_s))
    except BaseException as e:
        st = ClientStats(failure=f"{type(e).__name__}: {e}")
    out.send(st)
    out.close()


# ---- node logs ----------------------------------------------------------------------------------------


def _ts(s: str) -> float:
    """'2026-12-01T21:34:56.123Z' -> epoch seconds."""
    main, ms = s.rstrip("Z").split(".")
    return calendar.timegm(time.strptime(main, "%Y-%m-%dT%H:%M:%S")) + int(ms) / 1000.0


def log_events(node: Node) -> list[dict[str, Any]]:
    out = []
    for line in node.log().splitlines():
        if not line.startswith("{"):
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("topic") == TOPIC and "ts" in ev:
            ev["t"] = _ts(ev["ts"])
            out.append(ev)
    return out


@dataclass
class Move:
    partition: int
    source: str = "?"
    target: str = "?"
    started: float = math.nan
    finished: float = math.nan
    copied: int = 0
    frozen: float = math.nan  # the source's last freeze before the flip
    freezes: int = 0
    aside: float = math.nan
    completed: float = math.nan  # the leader's "partition move completed" (the flip committed)
    failed_attempts: int = 0


def collect_moves(c: Cluster) -> dict[int, Move]:
    moves: dict[int, Move] = {}
    for nid in c.ids:
        for ev in log_events(c[nid]):
            msg, part = ev.get("msg", ""), ev.get("partition")
            if not isinstance(part, int):
                continue
            m = moves.setdefault(part, Move(part))
            if msg == "partition move started":
                m.started, m.source, m.target = ev["t"], ev.get("from", "?"), ev.get("to", nid)
            elif msg == "partition move finished":
                m.finished, m.copied, m.target = ev["t"], int(ev.get("copied_bytes", 0)), nid
            elif msg == "partition move attempt failed; retrying":
                m.failed_attempts += 1
            elif msg == "partition frozen for a move":
                m.freezes += 1
                if math.isnan(m.aside):
                    m.frozen = ev["t"]
            elif msg == "partition moved to another node; its old copy set aside":
                m.aside = ev["t"]
            elif msg == "partition move completed":
                m.completed = ev["t"]
    return {p: m for p, m in moves.items() if not math.isnan(m.started)}


def moves_done(c: Cluster, want: int) -> bool:
    """No move in flight, the 4th node owns ``want`` partitions, and every finished move's
    source has set its old copy aside."""
    n = c[c.initial[0]]
    r = n.get("/v1/cluster/moves")
    if r.status != 200 or r.json()["moves"]:
        return False
    if Counter(owners(n).values()).get(c.ids[-1], 0) < want:
        return False
    mv = collect_moves(c)
    return bool(mv) and all(not math.isnan(m.finished) and not math.isnan(m.aside) for m in mv.values())


# ---- the run ----------------------------------------------------------------------------------------


def phase_table(st: ClientStats, bounds: list[tuple[str, float, float]]) -> None:
    print(f"{'phase':<8} {'secs':>5} {'sent':>6} {'produce p50/p99/max ms':>24} {'errs':>5} "
          f"{'e2e p50/p99/max ms':>24} {'consume p50/p99/max ms':>24} {'c.err':>5}")
    prod = [(st.produce[i], st.produce[i + 1], st.produce[i + 2]) for i in range(0, len(st.produce), 3)]
    cons = [(st.consume[i], st.consume[i + 1], st.consume[i + 2], st.consume[i + 3])
            for i in range(0, len(st.consume), 4)]
    e2e = [(st.e2e[i], st.e2e[i + 1]) for i in range(0, len(st.e2e), 2)]
    for name, lo, hi in bounds:
        p = [x for x in prod if lo <= x[0] < hi]
        plat = [x[1] for x in p]
        perr = sum(1 for x in p if x[2] != 202)
        el = [d for t, d in e2e if lo <= t < hi]
        cl = [x[1] for x in cons if lo <= x[0] < hi and x[2] > 0]
        cerr = sum(1 for x in cons if lo <= x[0] < hi and x[3] not in (200, 204))

        def three(v: list[float]) -> str:
            return f"{_ms(pct(v, 0.5))}/{_ms(pct(v, 0.99))}/{_ms(max(v) if v else math.nan)}"

        print(f"{name:<8} {hi - lo:5.1f} {len(p):6d} {three(plat):>24} {perr:5d} {three(el):>24} "
              f"{three(cl):>24} {cerr:5d}")


def run(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="narad-bench-moves-"))
    env = {"NARAD_MOVE_PLAN_MS": "300", "NARAD_LOG_FORMAT": "json"}
    c = Cluster(tmp, 4, initial=3, workers=args.workers, env=env)
    ctx = mp.get_context("fork")
    child: Any = None
    rc = 0
    try:
        t_boot = time.monotonic()
        c.start()
        leader = c.leader()
        r = c[leader].post("/v1/topics", {"name": TOPIC, "partitions": args.partitions})
        if r.status != 201:
            raise RuntimeError(f"POST /v1/topics -> {r.status} {r.body[:300]!r}")
        for nid in c.initial:
            wait_for(lambda nid=nid: c[nid].get(f"/v1/topics/{TOPIC}").status == 200, 30)
        print(f"3 nodes up and topic {TOPIC!r} ({args.partitions} partitions) created in "
              f"{time.monotonic() - t_boot:.1f} s; owners {dict(sorted(Counter(owners(c['n1']).values()).items()))}",
              flush=True)
        size = int(args.size_mib * (1 << 20))
        n_fill, fill_s = fill(c, args.partitions, size)
        fill_bytes = n_fill * FILL_MSG
        print(f"fill: {n_fill} x {FILL_MSG >> 10} KiB = {fill_bytes / (1 << 20):.1f} MiB in {fill_s:.1f} s "
              f"({fill_bytes / 1e6 / fill_s:.1f} MB/s, batches of {FILL_BATCH}, each to the partition's owner)",
              flush=True)
        print(f"fill consumed and acked in {drain_fill(c, n_fill):.1f} s (the live traffic starts on an empty backlog)",
              flush=True)

        ready, stop = ctx.Event(), ctx.Event()
        rd, wr = ctx.Pipe(duplex=False)
        ports = [c[nid].port for nid in c.initial]
        child = ctx.Process(target=client_main, args=(ports, c["n1"].auth, args.rate, args.consumers, 60.0, ready,
                                                      stop, wr), daemon=True)
        child.start()
        wr.close()
        if not ready.wait(30):
            raise RuntimeError("the client process did not start")
        t_load = time.time()
        time.sleep(args.before)

        quota = args.partitions // 4  # the planner's floor for the newcomer
        t_join = time.time()
        c.start([c.ids[-1]])
        print(f"{c.ids[-1]} joined (ready {time.time() - t_join:.1f} s after its start); waiting for the moves",
              flush=True)
        wait_for(lambda: moves_done(c, quota), args.move_timeout, 0.25, "the moves to the new node to finish")
        t_moved = time.time()
        time.sleep(args.after)
        stop.set()
        t_stop = time.time()
        if not rd.poll(120):
            raise RuntimeError("the client process sent no result within 120 s of its stop")
        st: ClientStats = rd.recv()
        child.join(10)
        if st.failure:
            raise RuntimeError(f"client process failed: {st.failure}")

        mv = collect_moves(c)
        print(f"\n# move throughput: {len(mv)} moves to {c.ids[-1]} (MB = 10^6 bytes; move = started -> finished "
              f"at the destination; pre-copy = started -> the source's last freeze; ~copy MB/s = every copied byte "
              f"over the pre-copy time (a little is copied after the freeze); freeze = the source's last freeze -> "
              f"its old copy set aside; to flip = that freeze -> the leader committed the flip)")
        print(f"{'part':>4} {'from':>4} {'to':>3} {'copied MiB':>10} {'move s':>7} {'MB/s':>7} {'pre-copy s':>10} "
              f"{'~copy MB/s':>10} {'freeze ms':>9} {'to flip ms':>10} {'freezes':>7} {'retries':>7}")
        for p, m in sorted(mv.items()):
            took, pre = m.finished - m.started, m.frozen - m.started
            print(f"{p:4d} {m.source:>4} {m.target:>3} {m.copied / (1 << 20):10.2f} {took:7.2f} "
                  f"{m.copied / 1e6 / took if took > 0 else math.nan:7.1f} {pre:10.2f} "
                  f"{m.copied / 1e6 / pre if pre > 0 else math.nan:10.1f} {(m.aside - m.frozen) * 1e3:9.0f} "
                  f"{(m.completed - m.frozen) * 1e3:10.0f} {m.freezes:7d} {m.failed_attempts:7d}")
        first = min(m.started for m in mv.values())
        last = max(m.finished for m in mv.values())
        copied = sum(m.copied for m in mv.values())
        freezes = [m.aside - m.frozen for m in mv.values() if not math.isnan(m.aside - m.frozen)]
        print(f"overall: {copied / (1 << 20):.2f} MiB in {last - first:.2f} s (first start -> last finish) = "
              f"{copied / 1e6 / (last - first):.1f} MB/s; freeze p50 {_ms(pct(freezes, 0.5))} ms, "
              f"max {_ms(max(freezes) if freezes else math.nan)} ms; join -> first move started "
              f"{first - t_join:.2f} s, join -> every old copy set aside {t_moved - t_join:.2f} s")

        during_end = max(max(m.aside for m in mv.values()), last)
        print(f"\n# client latency: {args.rate:g} msg/s single produce (1 KiB, round-robin over "
              f"{', '.join(c.initial)}), {args.consumers} batch consume+ack loop(s) per node; "
              f"e2e = produce sent -> first consumed, bucketed by send time; consume = answers with messages")
        phase_table(st, [("before", t_load, t_join), ("joining", t_join, first), ("during", first, during_end),
                         ("after", during_end, t_stop)])
        perr = Counter(int(st.produce[i]) for i in range(2, len(st.produce), 3) if st.produce[i] != 202)
        print(f"produce errors (non-202, -1 = no answer): {dict(perr) or 0}; skipped sends (>{MAX_IN_FLIGHT_PRODUCES} "
              f"outstanding): {st.skipped}; consume errors: {dict(st.consume_bad) or 0}; "
              f"ack results not 204: {dict(st.ack_bad) or 0}")
        for ex in st.produce_examples:
            print(f"  produce error example: {ex}")
        print(f"delivery after a {60:.0f} s drain: {st.produced} got 202, {st.lost} never consumed"
              f"{'' if st.drained else ' (NOT DRAINED)'}, {st.duplicates} redelivered (at-least-once: a move's "
              f"flip redelivers what was unacked)")
        final = Counter(owners(c["n1"]).values())
        print(f"owners at the end: {dict(sorted(final.items()))}")
        if st.lost:
            rc = 1
    except (RuntimeError, AssertionError, OSError, http.client.HTTPException) as e:
        print(f"FAILED: {e}")
        for nid in c.ids:
            if c[nid].proc is not None:
                print(f"{nid} log tail:\n{B._tail(c[nid], 15)}")
        rc = 1
    finally:
        if child is not None and child.is_alive():
            child.terminate()
            child.join(5)
        c.close()
        if args.keep:
            print(f"node data and logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return rc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--size-mib", type=float, default=64.0, help="fill data over all partitions, MiB")
    ap.add_argument("--partitions", type=int, default=12, help="partitions of the topic (12: 3 move to the 4th node)")
    ap.add_argument("--rate", type=float, default=200.0, help="single produces per second during the latency run")
    ap.add_argument("--consumers", type=int, default=1, help="batch consume+ack loops per original node")
    ap.add_argument("--workers", type=int, default=1, help="node workers per node")
    ap.add_argument("--before", type=float, default=10.0, help="seconds of traffic before the 4th node starts")
    ap.add_argument("--after", type=float, default=10.0, help="seconds of traffic after the moves finished")
    ap.add_argument("--move-timeout", type=float, default=600.0, help="give up waiting for the moves after this")
    ap.add_argument("--quick", action="store_true", help="8 MiB, 3 s before and after (~30-40 s in all)")
    ap.add_argument("--keep", action="store_true", help="keep the node data dirs and logs")
    args = ap.parse_args()
    if args.quick:
        args.size_mib, args.before, args.after = min(args.size_mib, 8.0), 3.0, 3.0
    if args.partitions < 4 or args.rate <= 0 or args.consumers < 1 or args.workers < 1:
        ap.error("--partitions >= 4, --rate > 0, --consumers >= 1, --workers >= 1")
    print(f"# narad partition-move benchmark: {len(os.sched_getaffinity(0))} CPUs, {args.size_mib:g} MiB fill, "
          f"{args.partitions} partitions, {args.workers} worker(s) per node, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"code {B.code_version()}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(run(args))
    sys.exit(130)


if __name__ == "__main__":
    main()
