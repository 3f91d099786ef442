"""A consumer that hangs up gets nothing more (issue 9): a long poll whose client
closes, half-closes, resets its HTTP/3 stream or closes its QUIC connection is
cancelled at once, on the worker that owns the partition, on a worker that does
not, and on a node that owns no partition; the next record goes to a live
consumer well inside the 30 s visibility timeout. Also: HTTP/1.1 requests with
no Host header or two of them are refused (400)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from narad.broker.routing import owner_worker
from tests.contract import History, check, now, record_delivery, record_settles
from tests.harness import Cluster, Node, wait_for

OCTET = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}
PROMPT = 5.0  # a record must reach a live consumer this fast (the visibility timeout is 30 s)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("hangup") / "data", workers=2).start()
    yield n
    n.close()


def mk(n: Node, name: str, partitions: int = 3) -> None:
    r = n.post("/v1/topics", {"name": name, "partitions": partitions})
    assert r.status == 201, r


def long_poll(n: Node, topic: str, pin: str = "") -> bytes:
    return (f"GET /v1/topics/{topic}/consume?wait=10s{'&' + pin if pin else ''} HTTP/1.1\r\nHost: t\r\n"
            f"Authorization: {n.auth}\r\n\r\n").encode()


def parked(n: Node) -> float:
    return n.metric("narad_consume_waiters")


def no_longer_parked(n: Node) -> None:
    wait_for(lambda: parked(n) == 0, 5.0, 0.02, "the hung-up long poll to be cancelled")


def produce(n: Node, topic: str, body: bytes, query: str = "") -> None:
    assert n.request("POST", f"/v1/topics/{topic}/produce{query}", body, headers=OCTET).status == 202


def delivered_promptly(n: Node, topic: str, want: bytes, conn: Any = None, pin: str = "") -> None:
    """A new consumer's long poll answers `want` within PROMPT seconds; acked."""
    t0 = time.monotonic()
    r = n.request("GET", f"/v1/topics/{topic}/consume?wait={int(PROMPT)}s{'&' + pin if pin else ''}", conn=conn)
    took = time.monotonic() - t0
    assert r.status == 200 and took < PROMPT, (r, took)
    m = r.json()
    assert base_payload(m) == want
    a = n.request("POST", f"/v1/topics/{topic}/ack?receipt_handle={m['receipt_handle']}", conn=conn)
    assert a.status == 204, a


def base_payload(m: dict[str, Any]) -> bytes:
    p = m["payload"]
    return p.encode() if isinstance(p, str) else json.dumps(p).encode()


def park_then_produce(n: Node, topic: str, body: bytes, conn: Any = None, pin: str = "",
                      at: Node | None = None) -> None:
    """A live consumer parks first, then the record is produced (at `at`): it must get it promptly."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            delivered_promptly(n, topic, body, conn, pin)
            out["ok"] = True
        except BaseException as e:  # reported by the main thread
            out["err"] = e

    th = threading.Thread(target=run)
    th.start()
    n.wait_parked(1)
    produce(at or n, topic, body, f"?{pin}" if pin else "")
    th.join(PROMPT + 10)
    if "err" in out:
        raise out["err"]
    assert out.get("ok"), "the live consumer never answered"


def read_to_eof(s: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """Everything the server sends until it closes; (data, closed in time)."""
    s.settimeout(timeout)
    data = b""
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            chunk = s.recv(65536)
            if not chunk:
                return data, True
            data += chunk
    except TimeoutError:
        return data, False
    except ConnectionResetError:
        return data, True
    return data, False


# ---- HTTP/1.1, one node ------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["close", "shutdown"])
def test_hung_up_long_poll_releases_the_next_record_at_once(node: Node, how: str) -> None:
    topic = f"hang-{how}"
    mk(node, topic)
    s = socket.create_connection(("127.0.0.1", node.port))
    s.sendall(long_poll(node, topic))
    node.wait_parked(1)
    if how == "close":
        s.close()
    else:
        s.shutdown(socket.SHUT_WR)  # "I am done": the server treats EOF during a request as the client gone
        data, closed = read_to_eof(s, PROMPT)
        s.close()
        assert closed and data == b"", data
    no_longer_parked(node)
    park_then_produce(node, topic, b"after-hangup")


def test_hang_up_on_a_worker_that_does_not_own_the_partition(node: Node) -> None:
    topic = "hang-other-worker"
    mk(node, topic)
    pin = "partition=0"  # owned by one worker; the consumer parks on the other
    other = 1 - owner_worker(topic, 0, 2)
    c = node.worker_connection(other)
    c.sock.sendall(long_poll(node, topic, pin))  # type: ignore[union-attr]
    node.wait_parked(1)
    c.close()
    no_longer_parked(node)
    park_then_produce(node, topic, b"other-worker", node.worker_connection(other), pin)


# ---- HTTP/3 ------------------------------------------------------------------------------------

def test_http3_client_giving_up_mid_probe_or_closing_mid_poll_strands_nothing(node: Node) -> None:
    """(1) The HTTP/3 client abandons its request (STOP_SENDING + RESET_STREAM) while
    its worker waits on the partition's owning worker, which is frozen (SIGSTOP) and,
    once thawed, reserves the record for that probe: the lease is given back at once.
    (2) The client closes its QUIC connection while its poll is parked."""
    from aioquic.h3.connection import ErrorCode

    from narad.client.h3 import H3Client, _Pending

    async def main() -> None:
        c = await H3Client.connect("127.0.0.1", node.port)
        try:
            st, hdrs, _ = await c.request("GET", "/healthz")
            here = int(hdrs["x-narad-worker"])  # this QUIC connection is served by worker `here`
            topic = next(f"hang-h3-{k}" for k in range(100)
                         if {owner_worker(f"hang-h3-{k}", i, 2) for i in range(3)} == {0, 1})
            part = next(i for i in range(3) if owner_worker(topic, i, 2) != here)
            await asyncio.to_thread(mk, node, topic)
            await asyncio.to_thread(produce, node, topic, b"probed", f"?partition={part}")
            await asyncio.to_thread(
                wait_for, lambda: node.get(f"/v1/topics/{topic}?partition={part}").json()["partition_stats"][0]
                ["high_watermark"] == 1, 10.0, 0.02, "the record committed at its owner")
            owner_pid = next(w["pid"] for w in node.status()["workers"] if w["index"] == 1 - here)
            proto = c._proto
            os.kill(owner_pid, signal.SIGSTOP)
            try:
                sid = proto._quic.get_next_available_stream_id()
                proto.pending[sid] = _Pending(asyncio.get_running_loop().create_future())
                path = f"/v1/topics/{topic}/consume?wait=10s&partition={part}"
                proto.h3.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"t"),
                                            (b":path", path.encode()), (b"authorization", node.auth.encode())],
                                      end_stream=True)
                proto.transmit()
                await asyncio.sleep(0.3)  # the client gives up 0.3 s in (its worker waits up to 2 s on the owner)
                proto.pending.pop(sid, None)
                proto._quic.reset_stream(sid, ErrorCode.H3_REQUEST_CANCELLED)
                proto._quic.stop_stream(sid, ErrorCode.H3_REQUEST_CANCELLED)
                proto.transmit()
                st, _, _ = await c.request("GET", "/healthz")  # the worker saw the abandon before this answer
                assert st == 200
            finally:
                os.kill(owner_pid, signal.SIGCONT)
            await asyncio.to_thread(delivered_promptly, node, topic, b"probed", None, f"partition={part}")
            # (2) connection closed while parked
            poll = asyncio.ensure_future(c.request("GET", f"/v1/topics/{topic}/consume?wait=10s",
                                                   headers={"authorization": node.auth}, timeout=15))
            await asyncio.to_thread(node.wait_parked, 1)
        finally:
            await c.close()
        with pytest.raises(Exception):  # noqa: B017 - whatever the client raises for a closed connection
            await poll
        await asyncio.to_thread(no_longer_parked, node)
        await asyncio.to_thread(park_then_produce, node, topic, b"after-h3")

    asyncio.run(main())


# ---- churn -------------------------------------------------------------------------------------

def test_churning_consumers_delay_no_message(node: Node) -> None:
    """Consumers long-poll and hang up at random while records are produced: every
    record reaches someone within PROMPT seconds of its produce. Every produce,
    delivery and ack answer is recorded; the checker (strict: no fault) gives the verdict."""
    topic = "hang-churn"
    mk(node, topic)
    total = 60
    h = History(30.0)
    produced: dict[str, float] = {}
    delivered: dict[str, float] = {}
    kept: list[str] = []  # hang-ups the server did not end within 1 s
    lock = threading.Lock()
    stop = threading.Event()

    def settle(m: dict[str, Any], call: int, ret: int, conn_ack: Any) -> None:
        d = record_delivery(h, m, call, ret)
        t0 = now()
        st: int | None = None
        try:
            st = node.request("POST", f"/v1/topics/{topic}/ack?receipt_handle={m['receipt_handle']}",
                              conn=conn_ack).status
        finally:
            record_settles(h, [d], "ack", t0, now(), [st if st is None or st < 500 else None])

    def take(raw: bytes, conn_ack: Any, call: int, ret: int) -> None:
        head, _, body = raw.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            return
        m = json.loads(body)
        with lock:
            delivered.setdefault(m["payload"], time.monotonic())
        settle(m, call, ret, conn_ack)

    def churner(seed: int) -> None:
        rnd = random.Random(seed)
        c = node.conn()
        while not stop.is_set():
            s = socket.create_connection(("127.0.0.1", node.port))
            call = now()
            s.sendall(long_poll(node, topic))
            stop.wait(rnd.uniform(0.0, 0.3))  # the client's own whim, not a wait on the server
            s.shutdown(socket.SHUT_WR)
            data, closed = read_to_eof(s, 1.0)  # then the client gives up waiting and closes
            ret = now()
            s.close()
            if not closed:
                with lock:
                    kept.append("a hung-up long poll stayed open")
            if data:
                take(data, c, call, ret)
        c.close()

    def steady() -> None:
        c = node.conn()
        while not stop.is_set():
            call = now()
            r = node.request("GET", f"/v1/topics/{topic}/consume?wait=1s", conn=c)
            ret = now()
            if r.status == 200:
                m = r.json()
                with lock:
                    delivered.setdefault(m["payload"], time.monotonic())
                settle(m, call, ret, c)
        c.close()

    threads = [threading.Thread(target=churner, args=(i,)) for i in range(6)]
    threads.append(threading.Thread(target=steady))
    for th in threads:
        th.start()
    try:
        rnd = random.Random(7)
        for i in range(total):
            body = f"m{i}"
            produced[body] = time.monotonic()
            t0 = now()
            st = node.request("POST", f"/v1/topics/{topic}/produce", body.encode(), headers=OCTET).status
            h.produced([body], t0, now(), st)
            assert st == 202, st
            stop.wait(rnd.uniform(0.0, 0.2))  # produce pacing
        wait_for(lambda: len(delivered) >= total, PROMPT + 5, 0.05, "every record delivered")
    except AssertionError:
        pass  # reported below, with the late count
    finally:
        stop.set()
        for th in threads:
            th.join(30)
    h.finish()
    v = check(h, "strict")
    print("\n" + v.summary("churning consumers") + f"\nchurn: {len(kept)} hang-ups the server had not closed after 1 s")
    late = sorted((delivered.get(b, float("inf")) - t0, b) for b, t0 in produced.items()
                  if delivered.get(b, float("inf")) - t0 > PROMPT)
    assert not late, (f"{len(late)} of {total} records late or missing: {late[:5]} "
                      f"({len(kept)} hang-ups the server had not closed after 1 s)")
    assert v.ok, v.summary("churning consumers")


# ---- cluster -----------------------------------------------------------------------------------

def test_hang_up_on_a_node_that_owns_no_partition(tmp_path: Path) -> None:
    c = Cluster(tmp_path, 4, initial=3).start()
    try:
        leader = c.leader()
        r = c[leader].post("/v1/topics", {"name": "hang-remote", "partitions": 3})
        assert r.status == 201, r
        c.start(["n4"])  # joins after the create: owns no partition of the topic
        far = c["n4"]
        wait_for(lambda: far.get("/v1/topics/hang-remote").status == 200, 20)
        stats = far.get("/v1/topics/hang-remote").json()["partition_stats"]
        assert "n4" not in {p["owner_node"] for p in stats}
        s = socket.create_connection(("127.0.0.1", far.port))
        s.sendall(long_poll(far, "hang-remote"))
        far.wait_parked(1)
        s.close()
        no_longer_parked(far)
        park_then_produce(far, "hang-remote", b"far-away", at=c[leader])
    finally:
        c.close()


# ---- Host header (HTTP/1.1) ----------------------------------------------------------------------

@pytest.mark.parametrize("head", [b"GET /healthz HTTP/1.1\r\n\r\n",
                                  b"GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"])
def test_missing_or_repeated_host_is_400(node: Node, head: bytes) -> None:
    s = socket.create_connection(("127.0.0.1", node.port))
    s.sendall(head)
    data, closed = read_to_eof(s, PROMPT)
    s.close()
    status_line, _, rest = data.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 400"), data
    body = rest.partition(b"\r\n\r\n")[2]
    assert "Host" in json.loads(body)["error"]
    assert closed
    ok = node.get("/healthz", auth=None)  # http.client sends one Host header
    assert ok.status == 200, ok
    s = socket.create_connection(("127.0.0.1", node.port))  # HTTP/1.0 needs none
    s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
    data, _ = read_to_eof(s, PROMPT)
    s.close()
    assert data.startswith(b"HTTP/1.1 200"), data
