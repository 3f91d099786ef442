"""The load generator's own floor: what bench-peers' HTTP adapter (aiohttp, Basic
auth, 1 KiB bodies, one message per call, 64 connections in one process) costs per
request against a server that answers at once (a uvloop protocol writing a canned
202), next to the same loop driving a canned RESP server with redis-py (the Redis
adapter's client). On a box where the client shares the cores with the broker, a
shape's ratio against Redis cannot beat the ratio of these two client costs.

    /tmp/peers-venv/bin/python loadtest/client_floor.py [--requests 40000]

(bench-peers' venv has aiohttp and redis; the project venv does not.)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import re
import resource
import signal
import time

import uvloop

HTTP_202 = b'HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\nAlt-Svc: h3=":1"; ma=86400\r\n\r\n'
_RESP_CMD = re.compile(rb"(?:^|\n)\*\d+\r\n\$(\d+)\r\n([A-Za-z]+)")  # a command array's head and its name


class _Canned(asyncio.Protocol):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.t: asyncio.Transport | None = None

    def connection_made(self, t: asyncio.BaseTransport) -> None:
        self.t = t  # type: ignore[assignment]

    def data_received(self, d: bytes) -> None:
        assert self.t is not None
        if self.kind == "http":
            n = d.count(b"HTTP/1.1\r\n")
            if n:
                self.t.write(HTTP_202 * n)
        else:  # an id per XADD, +OK (PING, CLIENT SETINFO) otherwise; commands never split here
            out = [b"$15\r\n1700000000000-0\r\n" if name.upper() == b"XADD" else b"+OK\r\n"
                   for _len, name in _RESP_CMD.findall(d)]
            if out:
                self.t.write(b"".join(out))


def _serve(kind: str, port: int) -> None:
    uvloop.install()
    loop = asyncio.new_event_loop()
    loop.run_until_complete(loop.create_server(lambda: _Canned(kind), "127.0.0.1", port))
    loop.run_forever()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _http(port: int, n: int) -> tuple[float, float]:
    import aiohttp

    s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64),
                              headers={"Authorization": "Basic " + base64.b64encode(b"admin:pw").decode(),
                                       "X-Narad-Client": "peers-loadgen"})
    body = b"x" * 1024

    async def one() -> None:
        for _ in range(n // 64):
            async with s.post(f"http://127.0.0.1:{port}/v1/topics/t/produce", data=body,
                              headers={"Content-Type": "application/octet-stream"}) as r:
                if r.status != 202:
                    raise RuntimeError(r.status)
                await r.read()

    t0, c0 = time.perf_counter(), _cpu()
    await asyncio.gather(*[one() for _ in range(64)])
    t, c = time.perf_counter() - t0, _cpu() - c0
    await s.close()
    return n / t, c / n * 1e6


async def _redis(port: int, n: int) -> tuple[float, float]:
    import redis.asyncio as aredis

    r = aredis.Redis(port=port, max_connections=64, decode_responses=False)
    await r.ping()
    body = b"x" * 1024

    async def one() -> None:
        for _ in range(n // 64):
            await r.xadd("bench", {b"p": body})

    t0, c0 = time.perf_counter(), _cpu()
    await asyncio.gather(*[one() for _ in range(64)])
    t, c = time.perf_counter() - t0, _cpu() - c0
    await r.aclose()
    return n / t, c / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40_000)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    print("# client CPU per call against a server that answers at once (1 process, 64 tasks, 1 KiB)")
    print(f"{'client':<28}{'calls/s':>10}{'client us/call':>16}")
    for _ in range(a.rounds):
        for kind, port, fn in (("http", 18111, _http), ("redis", 18112, _redis)):
            pid = os.fork()
            if pid == 0:
                _serve(kind, port)
                os._exit(0)
            try:
                time.sleep(0.5)
                uvloop.install()
                rate, us = asyncio.run(fn(port, a.requests))
                name = "aiohttp (HTTP adapter)" if kind == "http" else "redis-py (Redis adapter)"
                print(f"{name:<28}{rate:>10,.0f}{us:>16.1f}")
            finally:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
