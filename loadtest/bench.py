"""Message-path benchmarks for one node on loopback, 1 KiB messages. Prints:

(a) single produce latency p50/p99 at low load: one client, one keep-alive
    connection, sequential requests (100 warm-up requests not counted);
(b) produce-only throughput (msgs/s) with the single API and with the batch
    API (``--batch`` messages per request), each with 1 node worker and with N;
    afterwards the partitions' high watermarks must add up to what got 202;
(c) full produce -> consume -> ack throughput with the single API (each
    connection loops: produce one, consume one with wait=1s, ack it) and with
    the batch APIs (each connection loops: batch produce, batch consume
    ``max=100`` + batch ack, more consumes while this process's backlog is over
    one batch per connection), 1 and N workers. msgs counts messages that were
    produced, consumed and acked (204) in the window. Afterwards the topic is
    drained and every produced message must have been consumed at least once;
    duplicates (consumed more than once), missing and unexpected messages and
    acks that did not get 204 are reported;
(d) for every run: the client's CPU (process CPU seconds / wall, summed over
    the client processes), the server's CPU (summed over the node's processes
    with psutil; split per process, with the kernel's share, below the table),
    the rest of the machine's CPU (other jobs make a run noisy) and the server
    CPU per message in µs. CPU figures are in % of one core.

Each scenario starts a fresh node (tests.harness.Node) in a temp dir, creates
a 6-partition topic, runs, verifies and stops the node. A failing request
stops the scenario and is reported as request line, status and body, with the
node's log tail. The load generator is raw asyncio on uvloop: keep-alive
HTTP/1.1 connections as asyncio Protocols, responses parsed by httptools,
requests pre-rendered as bytes, one request in flight per connection, many
connections. ``--procs 2`` spreads the connections over two client processes.

Usage:
    .venv/bin/python loadtest/bench.py [--seconds S] [--workers N] [--quick]
        [--procs P] [--conns C] [--batch-conns C] [--only REGEX]
        [--profile DIR [--profile-runs REGEX] [--profile-rate HZ]]
    .venv/bin/python loadtest/bench.py --summarise DIR/*.txt

--profile runs py-spy (raw format, every thread, idle ones included, native
frames) on each node worker during the runs --profile-runs selects (default:
the flow runs), writes DIR/<run>-worker<i>.txt and prints a summary: thread
states (idle / GIL wait / fsync / CPU) and, over the CPU samples, self time by
file, function and line and inclusive time by function. Native unwinding
costs CPU on the same cores: at the default 50 Hz a run loses about a third of
its throughput, so profile with longer runs and read the table from a run
without --profile.

The load generator shares this machine's cores with the node, so the numbers
are a floor for what the server alone can do.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import msgspec
import psutil
import uvloop
from crc32c import crc32c

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.harness import Node  # noqa: E402

TOPIC = "bench"
PARTITIONS = 6
MSG_SIZE = 1024
CONSUME_WAIT = "1s"
CONSUME_MAX = 100
CONSUME_CAP = 1024  # the node's default http.max_consume_in_flight_per_identity (a batch consume counts as max)
DRAIN_TIMEOUT = 20.0
SPY_RATE = 50  # py-spy samples/s per process (--profile-rate); every thread is sampled each time
SPY_LIGHT = False  # --profile-light: py-spy --nonblocking, Python frames of busy threads only (far less distortion)

# A message is one JSON object of exactly MSG_SIZE bytes whose first field is a
# 16-hex-digit id: (client global index << 32) | sequence number.
_ID_HEAD = b'{"id":"'
_ID_LEN = 16
_PAD_HEAD = b'","pad":"'
_TAIL = b'"}'
_PAD = b"x" * (MSG_SIZE - len(_ID_HEAD) - _ID_LEN - len(_PAD_HEAD) - len(_TAIL))
_MSG_TAIL = _PAD_HEAD + _PAD + _TAIL


def payload(mid: int) -> bytes:
    return _ID_HEAD + b"%016x" % mid + _MSG_TAIL


def id_of(raw: msgspec.Raw | bytes) -> int:
    mv = memoryview(raw)
    if mv[:7] != _ID_HEAD:
        raise BenchFailure(f"consumed a payload that is not a bench message: {bytes(mv[:120])!r}")
    return int(bytes(mv[7:23]), 16)


class BenchFailure(Exception):
    """A request got an answer the benchmark does not accept (message says which)."""


# ---- a minimal HTTP/1.1 client -------------------------------------------------------------------


class HttpConn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request in flight at a time."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._body: list[bytes] = []
        self._lost: BaseException | None = None
        self._loop = asyncio.get_running_loop()

    @classmethod
    async def open(cls, port: int) -> HttpConn:
        _, proto = await asyncio.get_running_loop().create_connection(cls, "127.0.0.1", port)
        return proto

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(BenchFailure(f"unparseable HTTP response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = exc or ConnectionResetError("connection closed by the server")
        self._fail(self._lost)

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._body = []

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_result((self._parser.get_status_code(), b"".join(self._body)))

    def _fail(self, exc: BaseException) -> None:
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_exception(exc)

    async def request(self, data: bytes) -> tuple[int, bytes]:
        if self._lost is not None:
            raise BenchFailure(f"{_line(data)}: connection already closed ({self._lost!r})")
        assert self._transport is not None
        w = self._waiter = self._loop.create_future()
        self._transport.write(data)
        try:
            return await w
        except (OSError, BenchFailure) as e:
            raise BenchFailure(f"{_line(data)}: no response ({e!r})") from None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _line(req: bytes) -> str:
    return req.split(b"\r\n", 1)[0].decode("latin-1")


def expect(status: int, want: int, req: bytes, body: bytes) -> None:
    if status != want:
        raise BenchFailure(f"{_line(req)} -> {status} (want {want}), body {body[:800]!r}")


# --features (issue 14): what each variant adds to every message (or to the topic).
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
FEATURE_HEADERS = {"traceparent": TRACEPARENT, "tenant": "acme"}
# "key": the placement an idempotency key implies, without it; "same": nothing changed, the plain run
# again (an A/A control: the cost that the order of the runs and the noise alone make up); "bytes":
# each batched message's payload longer by what "headers" adds to its JSON (a control for size);
# "nodc": delivery counts off (the node's NARAD_TOPIC_DELIVERY_COUNTS=false: consume answers without
# delivery_count, no lease counted), the one feature on in the plain runs: its figure is minus the
# counts' cost. "idemlocal": "idem" on a node with topic.idempotent_local_placement on (the default: its
# keys checked in the node's claims table where the receiving worker commits them, no spread, no hop);
# "idemhash": "idem" with it off (each record committed at its key's partition, as before 2026-12-07).
# "vis": every consume sets its lease length (``visibility=30s``, the topic's own); "retry": every
# message given back (a batch nack) at its first delivery and acked at its second (the redelivery and
# its count); "retrydelay": the same nack with ``"delay":"20ms"`` (its cost against "retry" is the
# delay's own: the due-time heap). The retry features are batched full-flow shapes only.
FEATURES = ("headers", "dlq", "idem", "idem1s", "idem1p", "idemlocal", "idemhash", "key", "same", "bytes", "vis",
            "retry", "retrydelay", "nodc")
RETRY_FEATURES = ("retry", "retrydelay")
RETRY_DELAY = "20ms"
DLQ_TOPIC = "bench-dlq"


def topic_body(feature: str) -> dict[str, Any]:
    """The bench topic's create body for a feature variant."""
    body: dict[str, Any] = {"name": TOPIC, "partitions": PARTITIONS}
    if feature == "dlq":
        body.update(max_deliveries=5, dead_letter_topic=DLQ_TOPIC)
    if feature == "idem1s":  # the shortest window: from the run's second second on, keys expire as they come
        body.update(idempotency_window_ms=1000)
    return body


def one_partition_keys(first: int, n: int) -> list[bytes]:
    """Idempotency keys for messages ``first`` .. ``first + n - 1``, unique, each hashing
    (the node's ``key_partition``: crc32c modulo the partitions) to the same partition,
    which moves on batch after batch as a keyless batch's does."""
    target = ((first & 0xFFFFFFFF) // max(1, n) + (first >> 32)) % PARTITIONS
    out = []
    for mid in range(first, first + n):
        base = b"%016x" % mid
        k, s = base, 0
        while crc32c(k) % PARTITIONS != target:
            s += 1
            k = base + b"-%d" % s
        out.append(k)
    return out


class Requests:
    """Pre-rendered request bytes for one topic on one node. ``feature``: "" (plain),
    "headers" (two headers per message, 80 bytes: a traceparent and a tenant),
    "idem" (an idempotency key per message: its id), "idem1s" (the same on a topic whose
    idempotency window is 1 s: the owners' key tables at steady state, expiring a key for
    each one committed, as every table does once a topic has taken keys for longer than its
    window; a run of "idem" is shorter than the default 5 min), "idem1p" (an idempotency key
    per message, each batch's keys chosen to hash to one partition, a different one batch
    after batch: the keys' own cost without the spread of a batch over partitions, which
    "idem" minus "idem1p" is; single produces as "idem"), "key" (a message key per message,
    its id: each message goes to the partition its key hashes to, as a keyed one with an
    idempotency key does, but nothing is deduplicated), "dlq" (no change to requests:
    the topic has max_deliveries and a dead-letter topic), "same" (no change at all; nor for
    "nodc", whose node counts no deliveries),
    "bytes" (batched payloads longer by what "headers" adds; single produces unchanged)."""

    def __init__(self, port: int, auth: str, topic: str = TOPIC, feature: str = "") -> None:
        common = f"Host: 127.0.0.1:{port}\r\nAuthorization: {auth}\r\nX-Narad-Client: narad-bench\r\n"
        base = f"/v1/topics/{topic}"
        self.feature = feature
        query = ""
        if feature == "headers":
            query = "?" + "&".join(f"header={k}:{v}" for k, v in FEATURE_HEADERS.items())
        self._extra = b""
        if feature == "headers":
            self._extra = b',"headers":' + msgspec.json.encode(FEATURE_HEADERS)
        hdr_len = len(b',"headers":' + msgspec.json.encode(FEATURE_HEADERS))
        self._pad_more = b"y" * hdr_len if feature == "bytes" else b""
        if feature in ("idem1s", "idemlocal", "idemhash"):
            feature = self.feature = "idem"  # (the same requests; only the topic or the node differs)
        self.one_part = feature == "idem1p"
        if self.one_part:
            feature = self.feature = "idem"  # (single produces the same; a batch's keys chosen below)
        self._idem_head = (f"POST {base}/produce?{'key' if feature == 'key' else 'idempotency_key'}=").encode()
        self._idem_tail = (f" HTTP/1.1\r\n{common}Content-Type: application/json\r\n"
                           f"Content-Length: {MSG_SIZE}\r\n\r\n").encode()
        self.produce_head = (f"POST {base}/produce{query} HTTP/1.1\r\n{common}Content-Type: application/json\r\n"
                             f"Content-Length: {MSG_SIZE}\r\n\r\n").encode()
        self.batch_head = (f"POST {base}/produce/batch HTTP/1.1\r\n{common}Content-Type: application/json\r\n"
                           f"Content-Length: ").encode()
        vis = "&visibility=30s" if feature == "vis" else ""
        self.consume_one = f"GET {base}/consume?wait={CONSUME_WAIT}{vis} HTTP/1.1\r\n{common}\r\n".encode()
        self.consume_many = (f"GET {base}/consume?wait={CONSUME_WAIT}&max={CONSUME_MAX}{vis} HTTP/1.1\r\n"
                             f"{common}\r\n").encode()
        self.consume_now = f"GET {base}/consume?wait=0s&max={CONSUME_MAX}{vis} HTTP/1.1\r\n{common}\r\n".encode()
        # retry, retrydelay: first deliveries are nacked (with a delay for retrydelay), the rest acked
        self.retry = feature in RETRY_FEATURES
        self._nack_extra = {"delay": RETRY_DELAY} if feature == "retrydelay" else {}
        self.nack_many_head = (f"POST {base}/ack?extend=0 HTTP/1.1\r\n{common}Content-Type: application/json\r\n"
                               f"Content-Length: ").encode()
        self.ack_one_head = f"POST {base}/ack?receipt_handle=".encode()
        self.ack_one_tail = f" HTTP/1.1\r\n{common}Content-Length: 0\r\n\r\n".encode()
        self.ack_many_head = (f"POST {base}/ack HTTP/1.1\r\n{common}Content-Type: application/json\r\n"
                              f"Content-Length: ").encode()
        self.describe = f"GET {base} HTTP/1.1\r\n{common}\r\n".encode()

    def produce(self, mid: int) -> bytes:
        if self.feature in ("idem", "key"):
            return self._idem_head + b"%016x" % mid + self._idem_tail + payload(mid)
        return self.produce_head + payload(mid)

    def produce_batch(self, first: int, n: int) -> bytes:
        if self.one_part:
            rows = [b'{"payload":' + payload(first + i) + b',"idempotency_key":"' + k + b'"}'
                    for i, k in enumerate(one_partition_keys(first, n))]
        elif self.feature in ("idem", "key"):
            field = b"idempotency_key" if self.feature == "idem" else b"key"
            rows = [b'{"payload":' + payload(first + i) + b',"' + field + b'":"%016x"}' % (first + i)
                    for i in range(n)]
        elif self._pad_more:
            more = self._pad_more
            rows = [b'{"payload":' + payload(first + i)[:-2] + more + b'"}}' for i in range(n)]
        else:
            extra = self._extra
            rows = [b'{"payload":' + payload(first + i) + extra + b"}" for i in range(n)]
        body = b'{"messages":[' + b",".join(rows) + b"]}"
        return self.batch_head + b"%d\r\n\r\n" % len(body) + body

    def ack_one(self, handle: str) -> bytes:
        return self.ack_one_head + handle.encode() + self.ack_one_tail

    def ack_many(self, handles: list[str]) -> bytes:
        body = _enc.encode({"receipt_handles": handles})
        return self.ack_many_head + b"%d\r\n\r\n" % len(body) + body

    def nack_many(self, handles: list[str]) -> bytes:
        body = _enc.encode({"receipt_handles": handles, **self._nack_extra})
        return self.nack_many_head + b"%d\r\n\r\n" % len(body) + body


class _Msg(msgspec.Struct):
    payload: msgspec.Raw
    receipt_handle: str = ""
    delivery_count: int = 0


class _Batch(msgspec.Struct):
    messages: list[_Msg]


class _Result(msgspec.Struct):
    status: int


class _Results(msgspec.Struct):
    results: list[_Result]


class _Accepted(msgspec.Struct):
    accepted: int


_enc = msgspec.json.Encoder()
_msg_dec = msgspec.json.Decoder(_Msg)
_batch_dec = msgspec.json.Decoder(_Batch)
_results_dec = msgspec.json.Decoder(_Results)
_accepted_dec = msgspec.json.Decoder(_Accepted)


# ---- scenarios and the per-process load loop ---------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    mode: str  # latency | produce | produce_batch | flow | flow_batch
    workers: int  # node workers
    procs: int  # client processes
    conns: int  # connections per client process
    seconds: float
    count: int = 0  # latency mode: sequential requests
    batch: int = 100
    feature: str = ""  # --features: "" plain, or one of FEATURES
    rate: float = 0.0  # --rate: messages/s offered over all connections (batch runs), 0 = as fast as answers come


@dataclass
class Stats:
    """What one client process measured (pickled back to the parent)."""

    t0: float = 0.0
    t1: float = 0.0
    cpu: float = 0.0
    requests: int = 0
    produced: int = 0
    consumed: int = 0
    acked: int = 0
    empty: int = 0
    consumes: int = 0  # consume requests that returned messages (flow runs)
    nacked: int = 0  # first deliveries given back (--features retry, retrydelay)
    ack_bad: Counter[int] = field(default_factory=Counter)
    ack_bad_example: str = ""
    lat: array = field(default_factory=lambda: array("d"))  # produce request latencies, seconds
    clat: array = field(default_factory=lambda: array("d"))  # consume request latencies, seconds
    produced_ids: array = field(default_factory=lambda: array("Q"))
    consumed_ids: array = field(default_factory=lambda: array("Q"))
    failure: str = ""


class Load:
    def __init__(self, sc: Scenario, reqs: Requests, st: Stats, deadline: float) -> None:
        self.sc, self.r, self.st, self.deadline = sc, reqs, st, deadline
        self.backlog = 0  # flow_batch: messages produced by this process and not yet consumed by it

    async def latency(self, c: HttpConn, gid: int) -> None:
        r, st = self.r, self.st
        for seq in range(100):  # warm-up, not recorded
            req = r.produce((gid << 32) | (1 << 31) | seq)
            s, b = await c.request(req)
            expect(s, 202, req, b)
        for seq in range(self.sc.count):
            req = r.produce((gid << 32) | seq)
            t = time.perf_counter()
            s, b = await c.request(req)
            st.lat.append(time.perf_counter() - t)
            expect(s, 202, req, b)
        st.requests += self.sc.count + 100
        st.produced += self.sc.count + 100

    async def produce(self, c: HttpConn, gid: int) -> None:
        r, st, seq, pace = self.r, self.st, 0, self.pacer(gid, 1)
        while time.monotonic() < self.deadline:
            if pace:
                await pace.wait()
            req = r.produce((gid << 32) | seq)
            t = time.perf_counter()
            s, b = await c.request(req)
            st.lat.append(time.perf_counter() - t)
            expect(s, 202, req, b)
            seq += 1
        st.requests += seq
        st.produced += seq

    async def _batch(self, c: HttpConn, first: int, n: int) -> None:
        req = self.r.produce_batch(first, n)
        t = time.perf_counter()
        s, b = await c.request(req)
        self.st.lat.append(time.perf_counter() - t)
        expect(s, 202, req, b)
        got = _accepted_dec.decode(b).accepted
        if got != n:
            raise BenchFailure(f"{_line(req)} -> 202 accepted {got}, sent {n}")
        self.st.requests += 1
        self.st.produced += n

    def pacer(self, gid: int, per: int = 0) -> Pacer | None:
        """--rate: this connection's share of the offered load, its first request staggered among the
        others; `per`: messages a request (0: the scenario's batch)."""
        if not self.sc.rate:
            return None
        interval = (per or self.sc.batch) * self.sc.procs * self.sc.conns / self.sc.rate  # seconds between sends
        slot = (gid // 1000) * self.sc.conns + gid % 1000  # this connection's index over all processes
        return Pacer(self.st.t0 + interval * slot / (self.sc.procs * self.sc.conns), interval)

    async def produce_batch(self, c: HttpConn, gid: int) -> None:
        seq, n, pace = 0, self.sc.batch, self.pacer(gid)
        while time.monotonic() < self.deadline:
            if pace:
                await pace.wait()
            await self._batch(c, (gid << 32) | seq, n)
            seq += n

    async def flow(self, c: HttpConn, gid: int) -> None:
        r, st, seq, pace = self.r, self.st, 0, self.pacer(gid, 1)
        while time.monotonic() < self.deadline:
            if pace:
                await pace.wait()
            mid = (gid << 32) | seq
            seq += 1
            req = r.produce(mid)
            t = time.perf_counter()
            s, b = await c.request(req)
            st.lat.append(time.perf_counter() - t)
            expect(s, 202, req, b)
            st.produced += 1
            st.produced_ids.append(mid)
            t = time.perf_counter()
            s, b = await c.request(r.consume_one)
            st.clat.append(time.perf_counter() - t)
            st.requests += 2
            if s == 204:
                st.empty += 1
                continue
            expect(s, 200, r.consume_one, b)
            m = _msg_dec.decode(b)
            st.consumed += 1
            st.consumed_ids.append(id_of(m.payload))
            req = r.ack_one(m.receipt_handle)
            s, b = await c.request(req)
            st.requests += 1
            if s == 204:
                st.acked += 1
            elif s == 410:
                st.ack_bad[s] += 1
                st.ack_bad_example = st.ack_bad_example or f"{_line(req)} -> {s} {b[:300]!r}"
            else:
                expect(s, 204, req, b)

    async def flow_batch(self, c: HttpConn, gid: int) -> None:
        """Batch produce, then batch consume + batch ack once; consume more while this process's backlog
        (produced - consumed, any connection's messages) exceeds one batch per connection."""
        r, st, seq, n = self.r, self.st, 0, self.sc.batch
        limit, pace = n * self.sc.conns, self.pacer(gid)
        while time.monotonic() < self.deadline:
            if pace:
                await pace.wait()
            first = (gid << 32) | seq
            await self._batch(c, first, n)
            st.produced_ids.extend(range(first, first + n))
            seq += n
            self.backlog += n
            while True:
                done = st.consumed
                got = await consume_and_ack(c, r, st, r.consume_many)
                self.backlog -= st.consumed - done  # (a nacked first delivery is still to come)
                if got == 0:
                    st.empty += 1
                    break
                if self.backlog <= limit or time.monotonic() >= self.deadline:
                    break


class Pacer:
    """Open-loop pacing for one connection: a batch every ``interval`` seconds from ``at``. A connection
    that fell behind sends at once and keeps its schedule (no catch-up burst beyond what it owes)."""

    def __init__(self, at: float, interval: float) -> None:
        self.at, self.interval = at, interval

    async def wait(self) -> None:
        delay = self.at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        self.at = max(self.at + self.interval, time.monotonic() - self.interval)


async def consume_and_ack(c: HttpConn, r: Requests, st: Stats, req: bytes) -> int:
    """One batch consume and one batch ack of what it returned; returns the number of messages.
    With ``r.retry``, first deliveries are nacked instead (one batch nack), and only the
    messages acked count as consumed."""
    t = time.perf_counter()
    s, b = await c.request(req)
    st.clat.append(time.perf_counter() - t)
    st.requests += 1
    if s == 204:
        return 0
    expect(s, 200, req, b)
    msgs = _batch_dec.decode(b).messages
    if not msgs:
        raise BenchFailure(f"{_line(req)} -> 200 with an empty messages list")
    st.consumes += 1
    delivered = len(msgs)
    if r.retry:
        first = [m.receipt_handle for m in msgs if m.delivery_count == 1]
        if first:
            nack = r.nack_many(first)
            s, b = await c.request(nack)
            st.requests += 1
            expect(s, 200, nack, b)
            res = _results_dec.decode(b).results
            if len(res) != len(first) or any(x.status != 204 for x in res):
                raise BenchFailure(f"{_line(nack)} -> 200 but not every nack settled: {b[:300]!r}")
            st.nacked += len(first)
            msgs = [m for m in msgs if m.delivery_count != 1]
            if not msgs:
                return delivered
    st.consumed += len(msgs)
    st.consumed_ids.extend([id_of(m.payload) for m in msgs])
    ack = r.ack_many([m.receipt_handle for m in msgs])
    s, b = await c.request(ack)
    st.requests += 1
    expect(s, 200, ack, b)
    res = _results_dec.decode(b).results
    if len(res) != len(msgs):
        raise BenchFailure(f"{_line(ack)} -> {len(res)} results for {len(msgs)} handles: {b[:300]!r}")
    for x in res:
        if x.status == 204:
            st.acked += 1
        elif x.status == 410:
            st.ack_bad[410] += 1
            st.ack_bad_example = st.ack_bad_example or f"{_line(ack)} -> 200, a result {b[:300]!r}"
        else:
            raise BenchFailure(f"{_line(ack)} -> 200 with result status {x.status}: {b[:600]!r}")
    return delivered


async def _client(sc: Scenario, port: int, auth: str, index: int, barrier: Any) -> Stats:
    st = Stats()
    reqs = Requests(port, auth, feature=sc.feature)
    conns: list[HttpConn] = []
    try:
        for _ in range(sc.conns):
            c = await HttpConn.open(port)
            conns.append(c)
            s, b = await c.request(reqs.describe)  # warms the connection, auth and the topic cache
            expect(s, 200, reqs.describe, b)
    except (BenchFailure, OSError) as e:
        barrier.abort()
        st.failure = f"client {index} setup: {e}"
        return st
    barrier.wait(timeout=120)
    st.t0 = time.monotonic()
    cpu0 = time.process_time()
    load = Load(sc, reqs, st, st.t0 + sc.seconds)
    fn = getattr(load, sc.mode)
    try:
        async with asyncio.TaskGroup() as tg:
            for i, c in enumerate(conns):
                tg.create_task(fn(c, index * 1000 + i))
    except* BenchFailure as eg:
        st.failure = str(eg.exceptions[0])
    st.t1 = time.monotonic()
    st.cpu = time.process_time() - cpu0
    for c in conns:
        c.close()
    return st


def _client_main(sc: Scenario, port: int, auth: str, index: int, barrier: Any,
                 out: multiprocessing.connection.Connection) -> None:
    try:
        st = uvloop.run(_client(sc, port, auth, index, barrier))
    except BaseException as e:  # report anything, the parent prints it
        st = Stats(failure=f"client {index} crashed: {e!r}")
    out.send(st)
    out.close()


# ---- verification (parent side) -------------------------------------------------------------------


@dataclass
class Check:
    text: str = "ok"
    failed: bool = False


async def _drain(port: int, auth: str, produced: set[int], consumed: Counter[int]) -> Check:
    """Consume (and ack) until every produced id was seen; then look for anything left over."""
    reqs = Requests(port, auth)
    st = Stats()
    missing = produced - consumed.keys()
    before = len(missing)
    conns = [await HttpConn.open(port) for _ in range(4)]
    end = time.monotonic() + DRAIN_TIMEOUT

    async def one(c: HttpConn) -> None:
        while missing and time.monotonic() < end:
            n0 = len(st.consumed_ids)
            await consume_and_ack(c, reqs, st, reqs.consume_many)
            for mid in st.consumed_ids[n0:]:
                missing.discard(mid)

    await asyncio.gather(*(one(c) for c in conns))
    extra = 0
    if not missing:  # anything still ready is a message nobody produced (or a lost ack)
        while await consume_and_ack(conns[0], reqs, st, reqs.consume_now):
            pass
    for c in conns:
        c.close()
    consumed.update(st.consumed_ids)
    extra = len(consumed.keys() - produced)
    dups = sum(n - 1 for n in consumed.values() if n > 1)
    parts = [f"all {len(produced):,} consumed" if not missing else f"MISSING {len(missing):,} of {len(produced):,}",
             f"{before:,} drained after the window", f"dups {dups}"]
    if extra:
        parts.append(f"UNEXPECTED {extra}")
    if st.ack_bad:
        parts.append(f"drain acks not 204: {dict(st.ack_bad)}")
    return Check("; ".join(parts), failed=bool(missing or extra or dups))


def _hwm_check(node: Node, produced: int) -> Check:
    """Produce-only: the partitions' high watermarks must add up to what was accepted."""
    total = -1
    end = time.monotonic() + 15
    while time.monotonic() < end:
        r = node.get(f"/v1/topics/{TOPIC}")
        if r.status != 200:
            return Check(f"GET /v1/topics/{TOPIC} -> {r.status} {r.body[:300]!r}", True)
        total = sum(p["high_watermark"] for p in r.json()["partition_stats"])
        if total == produced:
            return Check(f"hwm sum = {total:,} accepted")
        time.sleep(0.1)
    return Check(f"hwm sum {total:,} != {produced:,} accepted (after 15 s)", True)


# ---- running one scenario -------------------------------------------------------------------------------


@dataclass
class Result:
    sc: Scenario
    wall: float = 0.0
    msgs: int = 0
    produced: int = 0
    requests: int = 0
    p50: float = math.nan
    p99: float = math.nan
    client_cpu: float = 0.0
    server_cpu: float = 0.0
    cpu_split: dict[str, float] = field(default_factory=dict)  # supervisor / workerN / other -> CPU seconds
    thread_split: dict[str, float] = field(default_factory=dict)  # "workerN loop" / "workerN threads" -> CPU s
    hops: dict[str, float] = field(default_factory=dict)  # narad_worker_hops_total{op} during the window
    rounds: tuple[float, float] = (0.0, 0.0)  # commit rounds and the commits they carried, during the window
    server_sys: float = 0.0  # the system (kernel) part of server_cpu
    other_cpu: float = 0.0  # everything else on the machine (other users' jobs make a run noisy)
    check: Check = field(default_factory=Check)
    failure: str = ""
    profiles: list[Path] = field(default_factory=list)
    cprofile: str = ""  # --cprofile: the prefix of the workers' cProfile files of this run
    opcount: str = ""  # --opcount: the prefix of the workers' opcode-count files of this run
    pids: dict[int, str] = field(default_factory=dict)  # the node's processes: pid -> supervisor / workerN


def _node_procs(node: Node) -> list[psutil.Process]:
    assert node.proc is not None
    root = psutil.Process(node.proc.pid)
    return [root, *root.children(recursive=True)]


def _cpu(procs: list[psutil.Process]) -> dict[int, tuple[float, float]]:
    """pid -> (user, system) CPU seconds so far."""
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[p.pid] = (t.user, t.system)
    return out


def _thread_cpu(procs: list[psutil.Process]) -> dict[tuple[int, str], float]:
    """(pid, "loop" | "threads") -> CPU seconds so far: the main (event-loop) thread apart from the rest."""
    out: dict[tuple[int, str], float] = {}
    for p in procs:
        try:
            threads = p.threads()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for t in threads:
            k = (p.pid, "loop" if t.id == p.pid else "threads")
            out[k] = out.get(k, 0.0) + t.user_time + t.system_time
    return out


def _machine_busy() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def worker_pids(node: Node) -> dict[int, int]:
    """worker index -> pid, from the node's log ("worker-0[1234] narad.worker: worker serving")."""
    found = re.findall(r"worker-(\d+)\[(\d+)\] narad\.worker: worker serving", node.log())
    return {int(i): int(p) for i, p in found}


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p))] if s else math.nan


NODE_ENV: dict[str, str] = {}  # --node-env: settings for every node this run starts
NODE_WRAP: list[str] = []  # a command every node runs under (loadtest/bench_instructions.py: valgrind)
CPROFILE_DIR: Path | None = None  # --cprofile: every worker runs under cProfile, its stats written here
_cprofile_runs = itertools.count()
OPCOUNT_DIR: Path | None = None  # --opcount: every worker counts its Python opcodes, written here


def run(sc: Scenario, profile_dir: Path | None, profile_which: str = "flow", profile_rate: int = SPY_RATE) -> Result:
    res = Result(sc)
    tmp = Path(tempfile.mkdtemp(prefix="narad-bench-"))
    env = dict(NODE_ENV)
    if CPROFILE_DIR is not None:
        res.cprofile = str(CPROFILE_DIR / f"{sc.name.replace(' ', '_')}-w{sc.workers}-{next(_cprofile_runs)}")
        env["NARAD_WORKER_CPROFILE"] = res.cprofile
    if sc.feature == "nodc":  # delivery counts off: the plain runs' requests on such a node
        env["NARAD_TOPIC_DELIVERY_COUNTS"] = "false"
    if sc.feature in ("idemlocal", "idemhash"):  # idempotency keys committed where received, or by key
        env["NARAD_TOPIC_IDEMPOTENT_LOCAL_PLACEMENT"] = "true" if sc.feature == "idemlocal" else "false"
    if OPCOUNT_DIR is not None:
        res.opcount = str(OPCOUNT_DIR / f"{sc.name.replace(' ', '_')}-w{sc.workers}-{next(_cprofile_runs)}")
        env["NARAD_WORKER_OPCOUNT"] = res.opcount
    node = Node(tmp / "data", workers=sc.workers, env=env, wrap=NODE_WRAP or None)
    spies: list[subprocess.Popen[bytes]] = []
    try:
        node.start()
        if sc.feature == "dlq":
            r = node.post("/v1/topics", {"name": DLQ_TOPIC, "partitions": PARTITIONS})
            if r.status != 201:
                raise BenchFailure(f"POST /v1/topics ({DLQ_TOPIC}) -> {r.status} {r.body[:300]!r}")
        r = node.post("/v1/topics", topic_body(sc.feature))
        if r.status != 201:
            raise BenchFailure(f"POST /v1/topics -> {r.status} {r.body[:300]!r}")
        procs = _node_procs(node)
        ctx = mp.get_context("fork")
        barrier = ctx.Barrier(sc.procs + 1)
        pipes, children = [], []
        for i in range(sc.procs):
            rd, wr = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_client_main, args=(sc, node.port, node.auth, i, barrier, wr), daemon=True)
            p.start()
            wr.close()
            pipes.append(rd)
            children.append(p)
        try:
            barrier.wait(timeout=120)
        except Exception:  # a client failed its setup; its Stats says why
            pass
        cpu0, busy0, th0 = _cpu(procs), _machine_busy(), _thread_cpu(procs)
        hops0 = _hops(node) if sc.workers > 1 else {}
        rounds0 = _rounds(node)
        if profile_dir is not None:
            spies, res.profiles = _start_spies(node, sc, profile_dir, profile_which, profile_rate)
        stats: list[Stats] = []
        for rd in pipes:
            if not rd.poll(sc.seconds + 300):
                raise BenchFailure("a client process gave no result within the run time + 300 s")
            stats.append(rd.recv())
        cpu1, busy1, th1 = _cpu(procs), _machine_busy(), _thread_cpu(procs)
        if sc.workers > 1:
            res.hops = {k: v - hops0.get(k, 0.0) for k, v in _hops(node).items() if v - hops0.get(k, 0.0) > 0}
        rounds1 = _rounds(node)
        res.rounds = (rounds1[0] - rounds0[0], rounds1[1] - rounds0[1])
        for p in children:
            p.join(10)
        for spy in spies:
            spy.wait(60)
        failures = [s.failure for s in stats if s.failure]
        if failures:
            raise BenchFailure(failures[0])
        res.wall = max(s.t1 for s in stats) - min(s.t0 for s in stats)
        names = {pid: f"worker{i}" for i, pid in worker_pids(node).items()}
        names[procs[0].pid] = "supervisor"
        res.pids = dict(names)
        split: Counter[str] = Counter()
        for pid, (u, sy) in cpu1.items():
            u0, s0 = cpu0.get(pid, (0.0, 0.0))
            split[names.get(pid, "other")] += u - u0 + sy - s0
            res.server_sys += sy - s0
        res.cpu_split = dict(split)
        for (pid, kind), v in th1.items():
            name = names.get(pid)
            if name is not None and name.startswith("worker"):
                res.thread_split[f"{name} {kind}"] = v - th0.get((pid, kind), 0.0)
        res.server_cpu = sum(split.values())
        res.client_cpu = sum(s.cpu for s in stats)
        res.other_cpu = max(0.0, busy1 - busy0 - res.server_cpu - res.client_cpu)
        res.requests = sum(s.requests for s in stats)
        res.produced = sum(s.produced for s in stats)
        lat = [x for s in stats for x in s.lat]
        res.p50, res.p99 = _pct(lat, 0.5), _pct(lat, 0.99)
        if sc.mode.startswith("flow"):
            res.msgs = sum(s.acked for s in stats)
            produced = {x for s in stats for x in s.produced_ids}
            consumed: Counter[int] = Counter()
            for s in stats:
                consumed.update(s.consumed_ids)
            res.check = uvloop.run(_drain(node.port, node.auth, produced, consumed))
            bad = sum((s.ack_bad for s in stats), Counter())
            if bad:
                ex = next(s.ack_bad_example for s in stats if s.ack_bad_example)
                res.check.text += f"; acks not 204 in the window: {dict(bad)} e.g. {ex}"
                res.check.failed = True
            clat = [x for s in stats for x in s.clat]
            res.check.text += (f"; consume p50 {_pct(clat, 0.5) * 1e3:.1f} p99 {_pct(clat, 0.99) * 1e3:.1f} "
                               f"max {max(clat, default=math.nan) * 1e3:.0f} ms")
            nc = sum(s.consumes for s in stats)
            if nc and sc.mode == "flow_batch":
                res.check.text += f"; {sum(s.consumed for s in stats) / nc:.0f} msgs a consume"
            empty = sum(s.empty for s in stats)
            if empty:
                res.check.text += f"; {empty} consumes found nothing in {CONSUME_WAIT}"
        else:
            res.msgs = res.produced
            if sc.mode != "latency":
                res.check = _hwm_check(node, res.produced)
        if res.check.failed:
            res.check.text += "\nnode log tail:\n" + _tail(node)
    except (BenchFailure, AssertionError, OSError) as e:
        res.failure = f"{e}\nnode log tail:\n{_tail(node)}"
    finally:
        for spy in spies:
            if spy.poll() is None:
                spy.kill()
        node.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return res


_HOP_LINE = re.compile(r'^narad_worker_hops_total\{op="([A-Za-z]+)"\} ([0-9.e+]+)$', re.M)


def _hops(node: Node) -> dict[str, float]:
    """narad_worker_hops_total by message type, summed over the node's workers."""
    r = node.get("/metrics")
    out: Counter[str] = Counter()
    if r.status == 200:
        for op, v in _HOP_LINE.findall(r.body.decode()):
            out[op] += float(v)
    return dict(out)


_ROUND_LINE = re.compile(r'^(narad_storage_commit_round(?:s|_logs)_total) ([0-9.e+]+)$', re.M)


def _rounds(node: Node) -> tuple[float, float]:
    """narad_storage_commit_rounds_total and _round_logs_total (the workers count them each second)."""
    r = node.get("/metrics")
    got = dict(_ROUND_LINE.findall(r.body.decode())) if r.status == 200 else {}
    return (float(got.get("narad_storage_commit_rounds_total", 0)),
            float(got.get("narad_storage_commit_round_logs_total", 0)))


def _tail(node: Node, lines: int = 40) -> str:
    return "\n".join("    " + ln for ln in node.log().splitlines()[-lines:])


# ---- py-spy ------------------------------------------------------------------------------------------


def _py_spy() -> str:
    exe = Path(sys.executable).with_name("py-spy")
    if exe.exists():
        return str(exe)
    found = shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy not found: .venv/bin/pip install py-spy")
    return found


_BOILERPLATE = ("_run_module_as_main (", "_run_code (", "<module> (narad/supervisor/main.py", "main (narad/supervisor/",
                "Supervisor.boot_process", "ForkServer.start (", "_serve (narad/supervisor/forkserver.py",
                "run (narad/worker/main.py", "run (uvloop/", "Runner.run (asyncio/", "Thread._bootstrap",
                "Thread.run (threading.py", "_worker (concurrent/futures/thread.py", "_WorkItem.run (concurrent/")


def cprofile_diff(plain: Result, feat: Result, top: int = 25) -> str:
    """Where run `feat`'s extra CPU goes, by function, per message: the workers' cProfile
    self times (``tottime``, all workers together) of `feat` minus those of `plain`. cProfile
    charges every Python call (about twice the CPU in all), so read the ranking and the
    call counts, not the microseconds as such."""
    import pstats

    def load(r: Result) -> dict[tuple[str, int, str], tuple[int, float]]:
        files = sorted(str(f) for f in Path(r.cprofile).parent.glob(Path(r.cprofile).name + ".*"))
        if not files:
            return {}
        st = pstats.Stats(*files).stats  # type: ignore[attr-defined]
        return {k: (v[1], v[2]) for k, v in st.items()}

    a, b = load(plain), load(feat)
    if not a or not b or not plain.msgs or not feat.msgs:
        return f"#   {feat.sc.name} w{feat.sc.workers}: no cProfile files (a worker did not stop cleanly?)"
    na, nb = plain.msgs, feat.msgs
    rows = []
    for k in set(a) | set(b):
        ca, ta = a.get(k, (0, 0.0))
        cb, tb = b.get(k, (0, 0.0))
        rows.append((tb / nb - ta / na, ta / na, tb / nb, ca / na, cb / nb, k))
    rows.sort(key=lambda r: -r[0])
    tot_a = sum(t for _, t in a.values()) / na * 1e6
    tot_b = sum(t for _, t in b.values()) / nb * 1e6
    out = [f"#   {feat.sc.name} w{feat.sc.workers} against {plain.sc.name}: cProfile self time {tot_a:.1f} -> "
           f"{tot_b:.1f} µs/msg ({tot_b - tot_a:+.1f}); by function, µs/msg (calls/msg):"]
    for d, ta, tb, ca, cb, (fn, line, name) in rows[:top]:
        where = f"{fn.replace(str(ROOT) + '/', '')}:{line}({name})" if line else name
        out.append(f"#     {d * 1e6:+6.2f}  {ta * 1e6:6.2f} -> {tb * 1e6:6.2f}  ({ca:.2f} -> {cb:.2f})  {where[-80:]}")
    return "\n".join(out)


def opcount_diff(plain: Result, feat: Result, top: int = 30) -> str:
    """Where run `feat`'s extra Python goes, by function, per message: the opcodes the
    workers executed (``NARAD_WORKER_OPCOUNT``, all workers together) in `feat` minus those
    in `plain`, each over its run's messages. Exact at the Python level (no sampling, no
    clock); work in C does not show (count instructions for it: bench_instructions.py)."""
    def load(r: Result) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in Path(r.opcount).parent.glob(Path(r.opcount).name + ".*"):
            for k, v in json.loads(f.read_text()).items():
                out[k] = out.get(k, 0) + v
        return out

    a, b = load(plain), load(feat)
    if not a or not b or not plain.msgs or not feat.msgs:
        return f"#   {feat.sc.name} w{feat.sc.workers}: no opcode files (a worker did not stop cleanly?)"
    na, nb = plain.msgs, feat.msgs
    rows = sorted(((b.get(k, 0) / nb - a.get(k, 0) / na, k) for k in a.keys() | b.keys()), key=lambda r: -abs(r[0]))
    ta, tb = sum(a.values()) / na, sum(b.values()) / nb
    out = [f"#   {feat.sc.name} w{feat.sc.workers} against {plain.sc.name}: {ta:,.0f} -> {tb:,.0f} opcodes/msg "
           f"({tb - ta:+,.0f}); by function:"]
    for d, k in rows[:top]:
        out.append(f"#     {d:+8.1f}  {a.get(k, 0) / na:8.1f} -> {b.get(k, 0) / nb:8.1f}  "
                   f"{k.replace(str(ROOT) + '/', '')[-90:]}")
    return "\n".join(out)


def profile_diff(a: Path, b: Path, top: int = 30) -> str:
    """Sample counts by Python function, inclusive and self, of raw py-spy file `b`
    minus file `a`: where a variant's extra CPU goes, when both runs carried the same
    messages (paced with --rate, same --seconds) and were sampled at the same rate
    (best with --profile-light)."""
    def load(p: Path) -> tuple[int, Counter[str], Counter[str]]:
        incl: Counter[str] = Counter()
        own: Counter[str] = Counter()
        total = 0
        for line in p.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not stack or not n.isdigit():
                continue
            k = int(n)
            total += k
            names = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
            for nm in set(names):
                incl[nm] += k
            own[names[-1]] += k
        return total, incl, own

    t0, i0, s0 = load(a)
    t1, i1, s1 = load(b)
    out = [f"samples {t0} -> {t1} ({t1 - t0:+d}); {b.name} minus {a.name}", "  inclusive:"]
    for k, d in sorted(((k, i1[k] - i0[k]) for k in set(i0) | set(i1)), key=lambda x: -x[1])[:top]:
        if not k.startswith(_BOILERPLATE):
            out.append(f"    {d:+6d}  {i0[k]:6d} -> {i1[k]:6d}  {k}")
    out.append("  self:")
    for k, d in sorted(((k, s1[k] - s0[k]) for k in set(s0) | set(s1)), key=lambda x: -x[1])[:top]:
        out.append(f"    {d:+6d}  {s0[k]:6d} -> {s1[k]:6d}  {k}")
    return "\n".join(out)


def _start_spies(node: Node, sc: Scenario, out: Path, which: str,
                 rate: int) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    """py-spy every worker of the node for the timed window: raw collapsed stacks of every thread, idle ones
    included, with native frames (so epoll waits, GIL waits and fdatasync can be told apart from CPU work)."""
    if not re.search(which, f"{sc.name} w{sc.workers}"):
        return [], []
    out.mkdir(parents=True, exist_ok=True)
    spies, files = [], []
    duration = max(1, int(sc.seconds))
    for idx, pid in sorted(worker_pids(node).items()):
        f = out / f"{sc.name.replace(' ', '_')}-w{sc.workers}-worker{idx}.txt"
        f.with_suffix(".json").write_text(json.dumps({"scenario": sc.name, "node_workers": sc.workers, "worker": idx,
                                                      "pid": pid, "rate": rate, "duration": duration}))
        mode = ["--nonblocking"] if SPY_LIGHT else ["--threads", "--idle", "--native"]
        cmd = [_py_spy(), "record", "--format", "raw", *mode, "--rate", str(rate),
               "--duration", str(duration), "--pid", str(pid), "--output", str(f)]
        spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        files.append(f)
    return spies, files


def _is_py(frame: str) -> bool:
    m = re.search(r"\(([^()]*)\)$", frame)
    loc = m.group(1) if m else ""
    return ".py:" in loc or loc.endswith(".py") or loc.startswith("<frozen")


def _fn(frame: str) -> str:
    """'func (path/file.py:123)' -> 'func (path/file.py)'."""
    return re.sub(r":\d+\)$", ")", frame)


def _file(frame: str) -> str:
    m = re.search(r"\(([^():]+)(?::\d+)?\)$", frame)
    return m.group(1) if m else frame


def _state(frames: list[str]) -> str:
    """What a sampled thread was doing: idle, waiting for the GIL, in fdatasync/fsync/syncfs, or running (CPU)."""
    names = [f.split(" (", 1)[0] for f in frames[-4:]]
    leaf = names[-1]
    if "epoll_wait" in names or ("uv__io_poll" in names and leaf.startswith(("0x", "epoll"))):
        return "idle"
    if "PyThread_acquire_lock_timed" in names and any(n.startswith("_queue_SimpleQueue_get") for n in names):
        return "idle"  # an executor thread waiting for work
    if "pthread_cond_timedwait" in names or "take_gil" in names:
        # CPython 3.11 waits for the GIL in take_gil -> pthread_cond_timedwait; a thread with no Python
        # frame at all (a C library's own thread) waiting on a condition variable is just idle
        return "gil wait" if any(_is_py(f) for f in frames) else "idle"
    if leaf in ("fdatasync", "fsync", "syncfs") or "os_fdatasync" in names[-2:] or "os_fsync" in names[-2:]:
        return "fsync"  # syncfs: a commit round of several logs (narad.storage.commit_rounds)
    if "PyThread_acquire_lock_timed" in names or "sem_clockwait" in names or "sem_timedwait" in names:
        return "lock wait"
    return "cpu"


def summarise(path: Path, top: int = 20) -> str:
    """Where a py-spy raw file (--threads --idle --native) spends its samples: per thread kind the share of
    idle / GIL wait / fsync / lock wait / CPU; then, over the CPU samples only, self time by file, by Python
    function (native frames folded into their Python caller) and by line, and inclusive time by function."""
    meta_path = path.with_suffix(".json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    states: dict[str, Counter[str]] = {}
    threads: dict[str, set[str]] = {}
    by_file: Counter[str] = Counter()
    by_fn: Counter[str] = Counter()
    by_line: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    cpu = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        k = int(n)
        frames = stack.split(";")
        tid = ""
        if frames[0].startswith(("thread (", "process ")):
            tid, frames = frames[0], frames[1:]
        if not frames:
            continue
        kind = ("event loop" if "MainThread" in tid or any(f.startswith("Runner.run (asyncio/") for f in frames)
                else "executor" if any(f.startswith("_worker (concurrent/") for f in frames) else "other threads")
        st = _state(frames)
        states.setdefault(kind, Counter())[st] += k
        threads.setdefault(kind, set()).add(tid)
        if st != "cpu":
            continue
        cpu += k
        py_at = [i for i, f in enumerate(frames) if _is_py(f)]
        below = frames[py_at[-1] + 1:] if py_at else frames
        named = [f.split(" (", 1)[0] for f in below if not f.startswith("0x")]
        tag = f" -> [{' > '.join(named[-2:])}]" if named else (" -> [libc]" if below else "")
        owner = frames[py_at[-1]] if py_at else "[no Python frame]"
        if owner.startswith("Runner.run (asyncio/"):
            owner = "uvloop C code (under Runner.run)"
        by_line[owner + tag] += k
        by_fn[_fn(owner)] += k
        by_file["uvloop (C)" if owner.startswith("uvloop C") else _file(owner)] += k
        for f in {_fn(frames[i]) for i in py_at}:
            if not f.startswith(_BOILERPLATE):
                incl[f] += k
    head = f"{path.name}"
    if meta:
        head += f" (pid {meta['pid']}, {meta['duration']} s at {meta['rate']} Hz per thread)"
    out = [head, "  thread states (% of that kind's samples):"]
    for kind, c in sorted(states.items(), key=lambda kv: -sum(kv[1].values())):
        tot = sum(c.values())
        shares = ", ".join(f"{s_} {v * 100 / tot:.0f}%" for s_, v in c.most_common())
        out.append(f"    {kind} ({len(threads[kind])} thread(s)): {shares}")
    if not cpu:
        return "\n".join([*out, "  no CPU samples"])
    out.append(f"  CPU samples: {cpu}; self time by file (% of CPU samples):")
    out += [f"    {n * 100 / cpu:5.1f}%  {f}" for f, n in by_file.most_common(12)]
    out.append("  self time by Python function (native callees folded in):")
    out += [f"    {n * 100 / cpu:5.1f}%  {f}" for f, n in by_fn.most_common(top)]
    out.append("  self time by line (-> [native leaf]):")
    out += [f"    {n * 100 / cpu:5.1f}%  {f}" for f, n in by_line.most_common(15)]
    out.append("  inclusive by Python function (start-up frames left out):")
    out += [f"    {n * 100 / cpu:5.1f}%  {f}" for f, n in incl.most_common(top + 5)]
    return "\n".join(out)


# ---- main ------------------------------------------------------------------------------------------------


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    s, out = args.seconds, []
    workers = sorted({1, args.workers})
    for w in workers:
        out.append(Scenario("latency single", "latency", w, 1, 1, s, count=args.latency_count))
    for w in workers:
        out.append(Scenario("produce single", "produce", w, args.procs, args.conns, s, rate=args.rate))
        out.append(Scenario(f"produce batch{args.batch}", "produce_batch", w, args.procs, args.batch_conns, s,
                            batch=args.batch, rate=args.rate))
    for w in workers:
        out.append(Scenario("flow single", "flow", w, args.procs, args.conns, s, rate=args.rate))
        out.append(Scenario(f"flow batch{args.batch}", "flow_batch", w, args.procs, args.batch_conns, s,
                            batch=args.batch, rate=args.rate))
    if args.only:
        out = [x for x in out if re.search(args.only, f"{x.name} w{x.workers}")]
    if args.features:
        feats = [f for f in args.features.split(",") if f]
        bad = [f for f in feats if f not in FEATURES]
        if bad:
            raise SystemExit(f"--features: unknown {bad}; choose from {', '.join(FEATURES)}")
        # A plain run on either side of each feature run (plain, f1, plain, f2, plain): each
        # feature is compared with the mean of its two neighbours, so a drift of the host (or
        # of the node: its page cache, its logs growing) over the sequence cancels out.
        out = [v for x in out if x.mode != "latency"
               for v in [x, *(y for f in feats if f not in RETRY_FEATURES or x.mode == "flow_batch"
                              for y in (dataclasses.replace(x, name=f"{x.name} +{f}", feature=f), x))]]
    in_flight = args.procs * args.batch_conns * CONSUME_MAX
    if any(x.mode == "flow_batch" for x in out) and in_flight > CONSUME_CAP:
        raise SystemExit(f"--procs x --batch-conns x max={CONSUME_MAX} = {in_flight} concurrent batch-consume slots: "
                         f"over the node's per-identity consume cap ({CONSUME_CAP}, "
                         f"http.max_consume_in_flight_per_identity; a batch consume counts as its max), so the "
                         f"flow batch runs would get 429s. Use at most {CONSUME_CAP // CONSUME_MAX} connections.")
    return out


HEADER = (f"{'scenario':<18}{'wk':>3}{'conns':>7}{'msgs':>10}{'secs':>6}{'msgs/s':>10}{'req/s':>9}"
          f"{'p50 ms':>8}{'p99 ms':>8}{'cli CPU':>8}{'srv CPU':>8}{'oth CPU':>8}{'srv µs/msg':>11}  check")


def row(r: Result) -> str:
    sc = r.sc
    conns = f"{sc.procs}x{sc.conns}"
    if r.failure:
        return f"{sc.name:<18}{sc.workers:>3}{conns:>7}  FAILED (see below)"
    rate = r.msgs / r.wall if r.wall else 0.0
    rps = r.requests / r.wall if r.wall else 0.0
    us = r.server_cpu / r.msgs * 1e6 if r.msgs else math.nan
    check = r.check.text.split("\n", 1)[0]
    return (f"{sc.name:<18}{sc.workers:>3}{conns:>7}{r.msgs:>10,}{r.wall:>6.1f}{rate:>10,.0f}{rps:>9,.0f}"
            f"{r.p50 * 1e3:>8.2f}{r.p99 * 1e3:>8.2f}{r.client_cpu / r.wall * 100:>7.0f}%"
            f"{r.server_cpu / r.wall * 100:>7.0f}%{r.other_cpu / r.wall * 100:>7.0f}%{us:>11.0f}  {check}")


def code_version() -> str:
    """The commit the node runs from, and whether narad/ has uncommitted changes (the node runs the work tree)."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "narad"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" + uncommitted changes in narad/" if dirty else "")


def main() -> None:
    global PARTITIONS
    cpus = len(os.sched_getaffinity(0))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--seconds", type=float, default=5.0, help="timed window per throughput run")
    ap.add_argument("--workers", type=int, default=cpus, help="N: node workers for the multi-worker runs")
    ap.add_argument("--quick", action="store_true", help="2 s runs, 500 latency samples")
    ap.add_argument("--procs", type=int, default=1, help="client processes")
    ap.add_argument("--conns", type=int, default=64, help="connections per client process, single-API runs")
    ap.add_argument("--batch-conns", type=int, default=8, help="connections per client process, batch runs")
    ap.add_argument("--batch", type=int, default=100, help="messages per batch produce")
    ap.add_argument("--partitions", type=int, default=PARTITIONS, metavar="N",
                    help=f"the bench topic's partitions (default {PARTITIONS}): fewer narrows "
                         f"the spread of a keyed or idempotent batch over partitions")
    ap.add_argument("--latency-count", type=int, default=2000)
    ap.add_argument("--only", help="regex on '<scenario> w<workers>', e.g. 'flow' or 'batch.*w2'")
    ap.add_argument("--features", metavar="LIST",
                    help=f"comma list of {', '.join(FEATURES)}: every selected run again with the feature on, a "
                         f"plain run between each two, and the server CPU per message each adds against the plain "
                         f"runs either side (issue 14)")
    ap.add_argument("--rate", type=float, default=0.0, metavar="MSGS",
                    help="offer MSGS messages/s in all (each connection paced open-loop: a batch, or in the single "
                         "produce and single flow runs a message, at a time) instead of "
                         "sending as fast as answers come; with --features, the plain and feature runs then carry "
                         "the same load and batching, so the server CPU per message compares like with like")
    ap.add_argument("--quiet-other", type=float, default=15.0, metavar="PCT",
                    help="with --repeat: also the feature costs over the feature runs that had, with their plain "
                         "neighbours, at most PCT %% of other load on the machine (default 15)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run the whole selection N times in turn (plain and feature runs interleaved); "
                         "feature costs are then printed as the median [range] of the N differences")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="py-spy (raw format) every node worker during the runs --profile-runs picks, write "
                         "DIR/*.txt, summarise")
    ap.add_argument("--profile-rate", type=int, default=SPY_RATE,
                    help="py-spy samples/s; native unwinding of every thread costs CPU on the same cores")
    ap.add_argument("--profile-runs", default="flow", metavar="REGEX",
                    help="which runs --profile records: regex on '<scenario> w<workers>' (default: flow)")
    ap.add_argument("--node-env", action="append", default=[], metavar="NAME=VALUE",
                    help="a setting for the node (its environment variable, e.g. NARAD_STORAGE_GROUP_SYNC=false); "
                         "repeatable")
    ap.add_argument("--cprofile", type=Path, metavar="DIR",
                    help="run every worker under cProfile (deterministic; about twice the CPU, so pace with "
                         "--rate well below the plain run's); with --features, print where each feature run's "
                         "extra CPU goes, by function, per message")
    ap.add_argument("--opcount", type=Path, metavar="DIR",
                    help="every worker counts the Python opcodes it executes, by function (sys.settrace: exact, "
                         "about fifty times the CPU, so pace with a low --rate, e.g. 30); with --features, print "
                         "each feature run's extra opcodes per message by function")
    ap.add_argument("--profile-light", action="store_true",
                    help="py-spy --nonblocking without native frames or idle threads: Python-level only, and far "
                         "less distortion of the node (use with --profile-diff)")
    ap.add_argument("--summarise", type=Path, nargs="+", metavar="FILE", help="summarise py-spy raw files and exit")
    ap.add_argument("--profile-diff", type=Path, nargs=2, metavar=("A", "B"),
                    help="print B's samples by function minus A's (two raw py-spy files of paced runs) and exit")
    args = ap.parse_args()
    if args.rate < 0:
        ap.error("--rate must be 0 (unpaced) or a positive messages/s")
    if not 3 <= args.partitions <= 108:
        ap.error("--partitions must be 3 to 108 (a topic's bounds)")
    PARTITIONS = args.partitions
    for kv in args.node_env:
        name, eq, value = kv.partition("=")
        if not eq or not name.startswith("NARAD_"):
            ap.error(f"--node-env wants NARAD_NAME=VALUE, got {kv!r}")
        NODE_ENV[name] = value
    if args.profile_diff:
        print(profile_diff(*args.profile_diff))
        return
    if args.opcount is not None:
        global OPCOUNT_DIR
        args.opcount.mkdir(parents=True, exist_ok=True)
        OPCOUNT_DIR = args.opcount.resolve()
    if args.cprofile is not None:
        global CPROFILE_DIR
        args.cprofile.mkdir(parents=True, exist_ok=True)
        CPROFILE_DIR = args.cprofile.resolve()
    global SPY_LIGHT
    SPY_LIGHT = args.profile_light
    if args.summarise:
        for f in args.summarise:
            print(summarise(f))
        return
    if args.quick:
        args.seconds = min(args.seconds, 2.0)
        args.latency_count = min(args.latency_count, 500)
    todo = scenarios(args) * max(1, args.repeat)
    print(f"# narad message benchmark: {cpus} CPUs, {MSG_SIZE} B messages, topic with {PARTITIONS} partitions, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, code {code_version()}"
          + (f", node env {' '.join(args.node_env)}" if args.node_env else ""))
    print(f"# client: uvloop + httptools, keep-alive HTTP/1.1, {args.procs} process(es); conns = procs x conns; "
          f"batch = {args.batch} msgs/request, consume max={CONSUME_MAX} wait={CONSUME_WAIT}")
    print("# msgs = produced (produce runs) or produced+consumed+acked (flow runs); p50/p99 = produce request "
          "latency;\n# CPU in % of one core: cli = load generator, srv = the node's processes, oth = the rest of the "
          "machine (noise)")
    print(HEADER)
    results = []
    for sc in todo:
        r = run(sc, args.profile, args.profile_runs, args.profile_rate)
        results.append(r)
        print(row(r), flush=True)
    print("\n# server CPU by process (% of one core; other = fork server) and the kernel's share of it:")
    for r in results:
        if r.wall and r.cpu_split:
            split = ", ".join(f"{k} {v / r.wall * 100:.0f}%" for k, v in sorted(r.cpu_split.items()) if v >= 0.005)
            sys_share = r.server_sys / r.server_cpu * 100 if r.server_cpu else 0.0
            print(f"#   {r.sc.name:<18} w{r.sc.workers}: {split}; system time {sys_share:.0f}% of it")
            if r.thread_split and r.msgs:
                per = ", ".join(f"{k} {v / r.msgs * 1e6:.0f}" for k, v in sorted(r.thread_split.items()))
                print(f"#   {'':<18}     µs/msg by thread: {per}")
            if r.hops and r.msgs:
                per = ", ".join(f"{k} {v / r.msgs * 100:.1f}" for k, v in sorted(r.hops.items(), key=lambda x: -x[1]))
                print(f"#   {'':<18}     worker hops per 100 messages: {per}")
            if r.rounds[0] > 0 and r.msgs:
                print(f"#   {'':<18}     commit rounds: {r.rounds[0] / r.msgs * 100:.1f} per 100 messages, "
                      f"{r.rounds[1] / r.rounds[0]:.2f} partition commits each (counted each second)")
    if args.features:
        print("\n# feature cost: server µs/msg with the feature on minus the mean of the plain runs just before "
              "and after it (and in % of that mean); msgs/s the same")
        deltas: dict[tuple[str, int], list[tuple[float, float]]] = {}
        quiet: dict[tuple[str, int], list[tuple[float, float]]] = {}  # pairs with little other load
        for i, r in enumerate(results):
            if not r.sc.feature:
                continue
            sides = [x for x in (results[i - 1] if i else None, results[i + 1] if i + 1 < len(results) else None)
                     if x is not None and not x.sc.feature and x.sc.mode == r.sc.mode and x.sc.workers == r.sc.workers]
            if not sides or not r.msgs or r.failure or any(not x.msgs or x.failure for x in sides):
                print(f"#   {r.sc.name:<28} w{r.sc.workers}: no figure (a run failed)")
                continue
            us = r.server_cpu / r.msgs * 1e6
            us0 = statistics.fmean(x.server_cpu / x.msgs * 1e6 for x in sides)
            rate, rate0 = r.msgs / r.wall, statistics.fmean(x.msgs / x.wall for x in sides)
            deltas.setdefault((r.sc.name, r.sc.workers), []).append((us - us0, (us - us0) / us0 * 100))
            other = max([r.other_cpu / r.wall, *(x.other_cpu / x.wall for x in sides)]) * 100
            if other <= args.quiet_other:
                quiet.setdefault((r.sc.name, r.sc.workers), []).append((us - us0, (us - us0) / us0 * 100))
            print(f"#   {r.sc.name:<28} w{r.sc.workers}: {us - us0:+.1f} µs/msg ({(us - us0) / us0 * 100:+.0f}%), "
                  f"{rate:,.0f} vs {rate0:,.0f} msgs/s ({(rate - rate0) / rate0 * 100:+.0f}%); "
                  f"other load up to {other:.0f}%")
        if CPROFILE_DIR is not None:
            print("\n# --cprofile: where each feature run's extra CPU goes (against the plain run just before it)")
            plain: Result | None = None
            for r in results:
                if not r.sc.feature:
                    plain = r
                elif plain is not None and not r.failure and not plain.failure:
                    print(cprofile_diff(plain, r))
        if OPCOUNT_DIR is not None:
            print("\n# --opcount: where each feature run's extra Python goes (against the plain run just before it)")
            plain = None
            for r in results:
                if not r.sc.feature:
                    plain = r
                elif plain is not None and not r.failure and not plain.failure:
                    print(opcount_diff(plain, r))
        if args.repeat > 1:
            print(f"# feature cost over the {args.repeat} repetitions, median [min, max]:")
            for (name, wk), ds in deltas.items():
                us_d = sorted(d for d, _ in ds)
                pct = sorted(p for _, p in ds)
                print(f"#   {name:<28} w{wk}: {statistics.median(us_d):+.1f} µs/msg [{us_d[0]:+.1f}, {us_d[-1]:+.1f}], "
                      f"{statistics.median(pct):+.0f}% [{pct[0]:+.0f}, {pct[-1]:+.0f}] of the plain run (n={len(ds)})")
            print(f"# the same over the quiet pairs only (other load at most {args.quiet_other:.0f}% in both runs: "
                  f"contention on 2 cores inflates both, unevenly):")
            for (name, wk), ds in deltas.items():
                qs = quiet.get((name, wk), [])
                if not qs:
                    print(f"#   {name:<28} w{wk}: no quiet pair")
                    continue
                us_d, pct = sorted(d for d, _ in qs), sorted(p for _, p in qs)
                print(f"#   {name:<28} w{wk}: {statistics.median(us_d):+.1f} µs/msg [{us_d[0]:+.1f}, {us_d[-1]:+.1f}], "
                      f"{statistics.median(pct):+.0f}% [{pct[0]:+.0f}, {pct[-1]:+.0f}] of the plain run "
                      f"(n={len(qs)} of {len(ds)})")
        against_key: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for i, r in enumerate(results):  # the deduplication alone: idem against the nearest keyed run
            if r.sc.feature != "idem" or r.failure or not r.msgs:
                continue
            near = sorted((x for x in results if x.sc.feature == "key" and x.sc.workers == r.sc.workers
                           and x.sc.mode == r.sc.mode and x.msgs and not x.failure),
                          key=lambda x: abs(results.index(x) - i))
            if near:
                k = near[0]
                us, usk = r.server_cpu / r.msgs * 1e6, k.server_cpu / k.msgs * 1e6
                against_key.setdefault((r.sc.name, r.sc.workers), []).append((us - usk, (us - usk) / usk * 100))
                print(f"#   {r.sc.name:<28} w{r.sc.workers}: {us - usk:+.1f} µs/msg ({(us - usk) / usk * 100:+.0f}%) "
                      f"against +key (the same placement, nothing deduplicated)")
        if args.repeat > 1:
            for (name, wk), ds in against_key.items():
                us_d, pct = sorted(d for d, _ in ds), sorted(p for _, p in ds)
                print(f"#   {name:<28} w{wk}: median {statistics.median(us_d):+.1f} µs/msg "
                      f"({statistics.median(pct):+.0f}% [{pct[0]:+.0f}, {pct[-1]:+.0f}]) against +key (n={len(ds)})")
    problems = [r for r in results if r.failure or r.check.failed]
    for r in problems:
        print(f"\n## {r.sc.name}, {r.sc.workers} worker(s): {'FAILED' if r.failure else 'check failed'}")
        print(r.failure or r.check.text)
    for r in results:
        for f in r.profiles:
            print()
            print(summarise(f) if f.exists() else f"{f}: py-spy wrote nothing")
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
