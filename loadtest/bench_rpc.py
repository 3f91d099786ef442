"""Node-RPC transport micro-benchmark: one NodeRpcServer and one NodeRpcClient in two
processes on loopback (uvloop both), an echo handler, nothing else. Prints calls/s and CPU
microseconds per call on each side for small calls and 100 KiB calls at several
concurrencies, and one-way notes.

Usage: .venv/bin/python loadtest/bench_rpc.py [--seconds 2] [--tree DIR]

``--tree DIR`` runs the transport of another checkout (e.g. a ``git worktree`` of an older
commit) with the same load, for before/after figures: a transport whose ALPN names QUIC gets
a UDP socket, otherwise a listening TCP one. Both processes share this machine's cores with
whatever else runs: compare CPU per call, taken in the same minute.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _setup_path(tree: str | None) -> None:
    sys.path.insert(0, str(Path(tree).resolve()) if tree else str(ROOT))


SECRET = b"bench-cluster-secret-of-32-bytes!"


def _types() -> tuple[Any, Any, Any]:
    import msgspec

    class Echo(msgspec.Struct, tag=True):
        blob: bytes

    class EchoReply(msgspec.Struct, tag=True):
        n: int

    class Ping(msgspec.Struct, tag=True):
        n: int

    return Echo, EchoReply, Ping


def _socket(quic: bool) -> socket.socket:
    if quic:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        return s
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s


def _serve(tree: str | None, sock: socket.socket, ready: Any, notes: Any) -> None:
    _setup_path(tree)
    import uvloop

    from narad.cluster.transport import NodeRpcServer
    from narad.ipc.rpc import Service

    Echo, EchoReply, Ping = _types()

    async def main() -> None:
        svc = Service()

        async def echo(m: Any, _peer: Any) -> Any:
            return EchoReply(n=len(m.blob))

        async def ping(m: Any, _peer: Any) -> None:
            with notes.get_lock():
                notes.value += 1

        svc.register(Echo, echo)
        svc.register(Ping, ping)
        server = NodeRpcServer(sock, SECRET, svc)
        await server.start()
        ready.set()
        await asyncio.Event().wait()

    uvloop.run(main())


async def _load(client: Any, addr: tuple[str, int], blob: bytes, conc: int, seconds: float,
                server_cpu: Any) -> tuple[int, float, float, float]:
    Echo, EchoReply, _ = _types()
    msg = Echo(blob=blob)
    stop = False
    count = 0

    async def worker() -> None:
        nonlocal count
        while not stop:
            r = await client.call(addr, msg, EchoReply, timeout=30.0)
            assert r.n == len(blob)
            count += 1

    tasks = [asyncio.ensure_future(worker()) for _ in range(conc)]
    await asyncio.sleep(min(0.5, seconds / 4))  # warm-up
    c0, s0, t0, n0 = time.process_time(), server_cpu(), time.perf_counter(), count
    await asyncio.sleep(seconds)
    c1, s1, t1, n1 = time.process_time(), server_cpu(), time.perf_counter(), count
    stop = True
    await asyncio.gather(*tasks)
    n = n1 - n0
    return n, t1 - t0, (c1 - c0) / n * 1e6 if n else 0.0, (s1 - s0) / n * 1e6 if n else 0.0


async def _notes(client: Any, addr: tuple[str, int], seconds: float, server_cpu: Any,
                 notes: Any) -> tuple[int, float, float, float]:
    _, _, Ping = _types()
    c0, s0, t0, got0 = time.process_time(), server_cpu(), time.perf_counter(), notes.value
    sent = 0
    end = t0 + seconds
    while time.perf_counter() < end:
        for _ in range(200):
            client.notify(addr, Ping(n=sent))
            sent += 1
        await asyncio.sleep(0)
        while sent - (notes.value - got0) > 2000:  # keep at most ~2k in flight
            await asyncio.sleep(0.001)
    deadline = time.perf_counter() + 10
    while notes.value - got0 < sent and time.perf_counter() < deadline:
        await asyncio.sleep(0.005)
    c1, s1, t1 = time.process_time(), server_cpu(), time.perf_counter()
    n = notes.value - got0
    return n, t1 - t0, (c1 - c0) / n * 1e6 if n else 0.0, (s1 - s0) / n * 1e6 if n else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--seconds", type=float, default=2.0, help="timed window per row")
    ap.add_argument("--tree", help="import narad from this checkout instead of this one")
    args = ap.parse_args()
    _setup_path(args.tree)
    import psutil
    import uvloop

    from narad.cluster import transport

    quic = "quic" in str(getattr(transport, "ALPN", "")).lower()
    sock = _socket(quic)
    addr = sock.getsockname()
    ctx = mp.get_context("fork")
    ready, notes = ctx.Event(), ctx.Value("q", 0)
    proc = ctx.Process(target=_serve, args=(args.tree, sock, ready, notes), daemon=True)
    proc.start()
    if not ready.wait(30):
        raise SystemExit("the server did not start")
    ps = psutil.Process(proc.pid)

    def server_cpu() -> float:
        t = ps.cpu_times()
        return t.user + t.system

    where = args.tree or str(ROOT)
    print(f"# node-RPC transport benchmark: {'QUIC (aioquic)' if quic else 'TLS 1.3 over TCP (ssl, uvloop)'} "
          f"from {where}; {len(os.sched_getaffinity(0))} CPUs, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'shape':<28}{'calls':>9}{'calls/s':>10}{'client us/call':>16}{'server us/call':>16}")

    async def run() -> None:
        client = transport.NodeRpcClient(SECRET)
        try:
            await client.call(addr, _types()[0](blob=b""), _types()[1], timeout=10.0)  # dial
            for size, label in ((100, "100 B"), (100 << 10, "100 KiB")):
                concs = (1, 16, 128) if size < 1000 else (1, 8)
                for conc in concs:
                    n, wall, cli, srv = await _load(client, addr, b"x" * size, conc, args.seconds, server_cpu)
                    print(f"{f'call {label} x{conc} concurrent':<28}{n:>9,}{n / wall:>10,.0f}{cli:>16.1f}{srv:>16.1f}",
                          flush=True)
            n, wall, cli, srv = await _notes(client, addr, args.seconds, server_cpu, notes)
            print(f"{'note 20 B (one-way)':<28}{n:>9,}{n / wall:>10,.0f}{cli:>16.1f}{srv:>16.1f}", flush=True)
        finally:
            await client.close()

    try:
        uvloop.run(run())
    finally:
        proc.kill()
        proc.join(5)


if __name__ == "__main__":
    main()
