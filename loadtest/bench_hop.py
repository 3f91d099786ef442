"""The cost of one local hop between workers (narad.ipc over a Unix socket).

Two processes, like two workers: one serves CommitReq-shaped requests (it
answers at once), the other sends them one at a time (latency) and with 64 in
flight (throughput), with 1 record of 1 KiB and with 100 records. Prints p50 /
p99 round trip and the CPU both processes spend per request.

Usage: .venv/bin/python loadtest/bench_hop.py [--count N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=20000)
    args = ap.parse_args()
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
