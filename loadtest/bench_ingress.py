"""The ingress path's CPU per message in one process, without the network or the
dispatcher: HTTP/1.1 bytes in -> auth -> routing -> checks -> WAL staging and group
commit -> the 202's bytes out. The real parts run (``narad.api.http1._Conn`` with
httptools, ``build_app``'s router, authenticator and produce handler, a real
``IngressWAL`` with its I/O thread on a temp dir); stubbed: the metastore (one topic
without a schema, one admin user), the version counters, the caps table, the socket
(a transport that counts writes) and, unless ``--sync``, fdatasync (a no-op: the
figure is our CPU, not the disk's).

Prints, per stage, the cost of one call (timeit, best of 5) and then the whole path
with C connections each sending one request per round (one WAL group per round):
the loop thread's CPU per message (``time.thread_time``) and the process's (all
threads). The machine is shared: run it a few times and read the best figure.

    .venv/bin/python loadtest/bench_ingress.py [--conns 64] [--messages 30000] [--batch 0] [--sync]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import gc
import shutil
import sys
import tempfile
import time
import timeit
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from narad import metrics  # noqa: E402
from narad.api import app as APP  # noqa: E402
from narad.api import http1  # noqa: E402
from narad.api.auth import Authenticator, _key, csrf_ok  # noqa: E402
from narad.api.context import ApiContext  # noqa: E402
from narad.api.messages import payload_flags  # noqa: E402
from narad.api.router import Request, Response  # noqa: E402
from narad.config import load_config  # noqa: E402
from narad.meta.grants import Identity  # noqa: E402
from narad.meta.records import TopicRecord, UserRecord  # noqa: E402
from narad.storage import fileio  # noqa: E402
from narad.storage.wal import Entry, IngressWAL  # noqa: E402

MSG = b'{"id":"0000000000000000","pad":"' + b"x" * (1024 - 34) + b'"}'
AUTH = "Basic " + base64.b64encode(b"admin:not-checked-here").decode()


class _Versions:
    def load(self, i: int) -> int:
        return 7


class _Store:
    t = TopicRecord("bench", "0011223344556677", 6, 86_400_000, 30_000, 0, 0, 0)
    u = UserRecord("admin", b"", [], True)

    def topic(self, name: str) -> TopicRecord | None:
        return self.t if name == "bench" else None

    def user(self, name: str) -> UserRecord | None:
        return self.u

    @contextlib.contextmanager
    def read(self) -> Iterator[_Store]:
        yield self  # one read transaction: the produce handler's draining check reads the member record

    def member(self, node_id: str) -> None:
        return None  # not a member being drained


class _Caps:
    def try_take(self, *a: Any) -> bool:
        return True

    def give_back(self, *a: Any) -> None:
        pass


class _Broker:
    def __init__(self, wal: IngressWAL) -> None:
        self.wal = wal
        self.m = metrics.get()
        self.i = 0

    def choose_partition(self, t: TopicRecord, key: bytes | None, idem: str | None = None) -> int:
        self.i += 1
        return self.i % t.partitions

    async def produce(self, entries: list[Entry], watch: list[Entry] | None = None,
                      timeout: float = 5.0) -> None:
        await self.wal.append(entries)  # no idempotency keys here: nothing is watched


class _Transport:
    """Counts responses; wakes the driver when the round's last one is written."""

    written = 0
    want = 0
    fut: asyncio.Future[None] | None = None

    def write(self, data: bytes) -> None:
        cls = type(self)
        cls.written += 1
        if cls.fut is not None and cls.written >= cls.want and not cls.fut.done():
            cls.fut.set_result(None)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _best(fn: Callable[[], Any], n: int = 20_000) -> float:
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def request_bytes(batch: int) -> bytes:
    body = MSG if not batch else b'{"messages":[' + b",".join([b'{"payload":' + MSG + b"}"] * batch) + b"]}"
    path = "/v1/topics/bench/produce" + ("/batch" if batch else "")
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nAuthorization: {AUTH}\r\n"
            f"X-Narad-Client: narad-bench\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"\r\n").encode() + body


async def main(args: argparse.Namespace) -> None:
    if not args.sync:
        fileio.fdatasync = lambda fd: None
    loop = asyncio.get_running_loop()
    tmp = Path(tempfile.mkdtemp(prefix="narad-ingress-"))
    pool = ThreadPoolExecutor(2)
    wal = IngressWAL(tmp / "wal", pool)
    wal.open()
    auth = Authenticator(security=True, users=lambda n: None, versions=_Versions(), supervisor_call=None,
                         supervisor_note=None)
    auth._cache_ver = 7
    auth._cache[_key(AUTH)] = Identity("admin")  # verified earlier: the cache hit every request takes
    ctx = ApiContext(cfg=load_config(None, env={}), node_id="n", store=_Store(), versions=_Versions(),  # type: ignore[arg-type]
                     sup=None, auth=auth, broker=_Broker(wal), caps=_Caps())  # type: ignore[arg-type]
    app = APP.build_app(ctx)
    srv = http1.Http1Server(app, None, http1.Http1Limits())  # type: ignore[arg-type]
    srv._loop = loop
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)  # as the worker does
    raw = request_bytes(args.batch)

    # ---- stages, one call each -------------------------------------------------------------
    print("# per stage (one call, best of 5):")
    c = http1._Conn(srv, "127.0.0.1")
    c.connection_made(_Transport())  # type: ignore[arg-type]
    c._fast = lambda req, reply: True  # stop at the handler's door

    def parse() -> None:
        c.data_received(raw)
        c._busy = False

    rows = [("HTTP/1.1 parse, bytes -> Request (httptools and 9 callbacks)", parse)]
    req = Request("POST", "/v1/topics/bench/produce", {}, {"host": "x", "authorization": AUTH,
                  "x-narad-client": "b", "content-type": "application/json"}, MSG, "127.0.0.1", "h1",
                  raw_path="/v1/topics/bench/produce")
    e = Entry("bench", b"01234567", 3, 1_700_000_000_000, 6, None, MSG)
    obs = app.observer
    m = metrics.get()
    c2 = http1._Conn(srv, "127.0.0.1")
    c2.connection_made(_Transport())  # type: ignore[arg-type]
    r202 = Response(202, b"", None)

    one = [e]

    def stage() -> None:  # 64 records a group, as under load
        for _ in range(64):
            wal._stage(one)
        wal._staging = bytearray()
        wal._staged = []

    rows += [
        ("auth: the verified-credential cache hit", lambda: auth.identify_cached(req)),
        ("415 guard", lambda: csrf_ok(req)),
        ("routing (cached match)", lambda: app.router.match("POST", "/v1/topics/bench/produce")),
        ("payload flags: JSON probe of 1 KiB", lambda: payload_flags(MSG)),
        ("WAL: record head + frame + CRC-32C + copy into the group buffer", stage),
        ("metrics: accepted counter, request counter, latency histogram",
         lambda: (m.messages_accepted.labels("bench").inc(1),
                  obs.observe("POST /v1/topics/{topic}/produce", "POST", 202, 0.001, 1024, 0))),  # type: ignore[union-attr]
        ("response bytes (202, no body) to the transport", lambda: c2._write(r202, False, False, 1)),
    ]
    for name, fn in rows:
        print(f"  {_best(fn, 20_000 if fn is not stage else 500) / (64 if fn is stage else 1):7.2f} us  {name}")

    # ---- the whole path ----------------------------------------------------------------------
    per_req = max(1, args.batch)
    conns = []
    for _ in range(args.conns):
        cn = http1._Conn(srv, "127.0.0.1")
        cn.connection_made(_Transport())  # type: ignore[arg-type]
        conns.append(cn)
    rounds = max(1, args.messages // per_req // args.conns)
    for warm in (True, False):
        n = 3 if warm else rounds
        t_cpu, t_loop, t_wall = time.process_time(), time.thread_time(), time.perf_counter()
        for _ in range(n):
            _Transport.want = _Transport.written + len(conns)
            _Transport.fut = loop.create_future()
            for cn in conns:
                cn.data_received(raw)
            await _Transport.fut
        msgs = n * len(conns) * per_req
    cpu, th, wall = time.process_time() - t_cpu, time.thread_time() - t_loop, time.perf_counter() - t_wall
    kind = f"batch produce ({args.batch} per call)" if args.batch else "single produce"
    print(f"# whole path, {kind}, {args.conns} connections, one request each per round (one WAL group a round), "
          f"{msgs:,} messages{', real fdatasync' if args.sync else ''}:")
    print(f"  {th / msgs * 1e6:7.2f} us/msg  loop thread CPU")
    print(f"  {cpu / msgs * 1e6:7.2f} us/msg  process CPU (all threads)")
    print(f"  {wall / msgs * 1e6:7.2f} us/msg  wall")
    wal.close()
    pool.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--conns", type=int, default=64, help="connections, one request in flight each")
    ap.add_argument("--messages", type=int, default=30_000)
    ap.add_argument("--batch", type=int, default=0, help="messages per batch produce (0: single produce)")
    ap.add_argument("--sync", action="store_true", help="real fdatasync (the figure then includes its kernel CPU)")
    uvloop.run(main(ap.parse_args()))
