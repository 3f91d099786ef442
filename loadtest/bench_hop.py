"""The cost of one local hop between workers (narad.ipc over a Unix socket).

Two processes, like two workers: one serves CommitReq-shaped requests (it
answers at once), the other sends them one at a time (latency) and with 64 in
flight (throughput), with 1 record of 1 KiB and with 100 records. Prints p50 /
p99 round trip and the CPU both processes spend per request.

With ``--cross``: a real node with two workers and the full flow forced across
the hop: producers' connections all on worker 0, consumers' (long poll 1 s,
ack each consume) all on worker 1, once one message per call (16 + 16
connections) and once in batches (2 producers x 50 per call, 2 consumers
max=100 and one batch ack each). Prints msgs/s (acked) and the node's server
CPU per message (psutil over every node process).

``--cross --spread``: the same, connections wherever the kernel puts them (32 + 32
single, like the peer harness's unbatched e2e shape).

Usage: .venv/bin/python loadtest/bench_hop.py [--count N] [--cross [--spread] [--seconds S]]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from narad.broker.peers import CommitReq, CommitResp  # noqa: E402
from narad.ipc import rpc  # noqa: E402


def serve(path: str, ready_w: int) -> None:
    async def main() -> None:
        svc = rpc.Service()

        async def commit(m: CommitReq, _c: rpc.Connection) -> CommitResp:
            return CommitResp(len(m.records))

        svc.register(CommitReq, commit)  # type: ignore[arg-type]
        await rpc.serve_unix(path, lambda: svc)
        os.write(ready_w, b"x")
        await asyncio.Event().wait()

    uvloop.run(main())


async def client(path: str, count: int, records: int, inflight: int) -> tuple[float, float, float, float]:
    conn = await rpc.connect_unix(path)
    req = CommitReq("topic", "0123456789abcdef", 3, [(None, 6, b"x" * 1024)] * records)
    for _ in range(200):
        await conn.call(req, CommitResp)
    lat: list[float] = []
    t0, c0 = time.perf_counter(), time.process_time()

    async def one() -> None:
        for _ in range(count // inflight):
            s = time.perf_counter()
            await conn.call(req, CommitResp)
            lat.append(time.perf_counter() - s)

    await asyncio.gather(*(one() for _ in range(inflight)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    conn.close()
    lat.sort()
    return lat[len(lat) // 2] * 1e6, lat[int(len(lat) * 0.99)] * 1e6, len(lat) / wall, cpu / len(lat) * 1e6


def _conn_class() -> Any:
    from loadtest.bench import HttpConn

    class Conn(HttpConn):
        last_worker = ""

        def on_header(self, name: bytes, value: bytes) -> None:
            if name.lower() == b"x-narad-worker":
                self.last_worker = value.decode()

    return Conn


async def _pinned(port: int, worker: int, reqs: Any) -> Any:
    conn = _conn_class()
    for _ in range(200):
        c = await conn.open(port)
        _s, _b = await c.request(reqs.describe)
        if c.last_worker == str(worker):
            return c
        c.close()
    raise SystemExit(f"no connection landed on worker {worker}")


async def _cross_flow(port: int, auth: str, seconds: float, batch: int, conns: int,
                      spread: bool) -> tuple[int, float]:
    from loadtest.bench import Requests

    reqs = Requests(port, auth)
    conn = _conn_class()
    if spread:  # wherever the kernel puts them, producers and consumers on connections of their own
        prod = [await conn.open(port) for _ in range(conns)]
        cons = [await conn.open(port) for _ in range(conns)]
    else:
        prod = [await _pinned(port, 0, reqs) for _ in range(conns)]
        cons = [await _pinned(port, 1, reqs) for _ in range(conns)]
    end = time.monotonic() + seconds
    acked = 0
    backlog = 0

    async def producer(c: Any, gid: int) -> None:
        nonlocal backlog
        seq = 0
        while time.monotonic() < end:
            if backlog > 5000:
                await asyncio.sleep(0.005)
                continue
            req = reqs.produce(gid << 32 | seq) if batch == 1 else reqs.produce_batch(gid << 32 | seq, batch)
            st, body = await c.request(req)
            assert st == 202, (st, body[:200])
            seq += batch
            backlog += batch

    async def consumer(c: Any) -> None:
        nonlocal acked, backlog
        while time.monotonic() < end:
            st, body = await c.request(reqs.consume_one if batch == 1 else reqs.consume_many)
            if st == 204:
                continue
            assert st == 200, (st, body[:200])
            doc = msgspec.json.decode(body)
            msgs = [doc] if batch == 1 else doc["messages"]
            handles = [m["receipt_handle"] for m in msgs]
            st, body = await c.request(reqs.ack_one(handles[0]) if batch == 1 else reqs.ack_many(handles))
            assert st in (200, 204), (st, body[:200])
            acked += len(handles)
            backlog -= len(handles)

    t0 = time.monotonic()
    await asyncio.gather(*(producer(c, i) for i, c in enumerate(prod)), *(consumer(c) for c in cons))
    wall = time.monotonic() - t0
    for c in prod + cons:
        c.close()
    return acked, wall


def _cpu(procs: list[Any]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs if p.is_running())


def cross(seconds: float, spread: bool) -> None:
    import shutil

    import psutil

    from tests.harness import Node

    if spread:
        print("# full flow on a node with 2 workers, producers and consumers on connections of their own "
              "(kernel-placed)")
    else:
        print("# full flow across the hop: producers on worker 0, consumers on worker 1 (node with 2 workers)")
    for label, batch, conns in (("single", 1, 32 if spread else 16), ("batch50", 50, 2)):
        tmp = Path(tempfile.mkdtemp(prefix="narad-hop-"))
        node = Node(tmp / "data", workers=2).start()
        try:
            r = node.post("/v1/topics", {"name": "bench", "partitions": 6})
            assert r.status == 201, r
            procs = [psutil.Process(node.proc.pid)]  # type: ignore[union-attr]
            procs += procs[0].children(recursive=True)

            c0 = _cpu(procs)
            acked, wall = uvloop.run(_cross_flow(node.port, node.auth, seconds, batch, conns, spread))
            used = _cpu(procs) - c0
            print(f"{label:>8}: {acked:>8,} acked in {wall:4.1f} s  {acked / wall:9,.0f} msgs/s  "
                  f"server CPU {used / max(acked, 1) * 1e6:7.1f} us/msg")
        finally:
            node.close()
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=20000)
    ap.add_argument("--cross", action="store_true", help="full flow on a 2-worker node, across the hop")
    ap.add_argument("--spread", action="store_true", help="with --cross: connections wherever the kernel puts them")
    ap.add_argument("--seconds", type=float, default=6.0)
    args = ap.parse_args()
    if args.cross:
        cross(args.seconds, args.spread)
        return
    path = os.path.join(tempfile.mkdtemp(), "hop.sock")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        serve(path, w)
        os._exit(0)
    os.read(r, 1)
    import psutil

    server = psutil.Process(pid)
    print("# one local hop (narad.ipc, Unix socket, msgpack frames), CommitReq of 1 KiB records")
    for records, inflight in ((1, 1), (1, 64), (100, 1), (100, 16)):
        s0 = server.cpu_times()
        p50, p99, rps, ccpu = uvloop.run(client(path, args.count if records == 1 else args.count // 10, records,
                                                inflight))
        s1 = server.cpu_times()
        n = (args.count if records == 1 else args.count // 10) // inflight * inflight
        scpu = ((s1.user + s1.system) - (s0.user + s0.system)) / n * 1e6
        print(f"{records:>3} record(s), {inflight:>2} in flight: p50 {p50:7.1f} us  p99 {p99:7.1f} us  "
              f"{rps:9,.0f} req/s  client CPU {ccpu:6.1f} us/req  server CPU {scpu:6.1f} us/req")
    os.kill(pid, 9)


if __name__ == "__main__":
    main()
