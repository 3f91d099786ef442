"""The ingress hot path: the WAL's callback waiters (``IngressWAL.append_cb``, answered
from the group's one loop wake-up, only after the sync that covers them) and the
synchronous produce entry of the HTTP/1.1 transport (``RoutedApp.handle_fast``): the
same answers, in the same order, as the async path, pipelined requests included."""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from narad.storage import fileio
from narad.storage.wal import Entry, IngressWAL, WALFailed
from tests.harness import Node, basic, wait_for

INC = b"\x00\x11\x22\x33\x44\x55\x66\x77"


@pytest.fixture(autouse=True)
def _reset_io() -> Iterator[None]:
    yield
    fileio.reset()


def entry(i: int) -> Entry:
    return Entry("t", INC, i % 3, 1_700_000_000_000 + i, 0, None, f"payload {i}".encode())


def test_append_cb_answers_after_the_covering_sync_in_order(tmp_path: Path) -> None:
    pool = ThreadPoolExecutor(2)
    w = IngressWAL(tmp_path, pool)
    w.open()
    real = fileio.fdatasync
    synced: list[int] = []  # durable_seq the disk had reached when each sync returned

    def slow_sync(fd: int) -> None:
        time.sleep(0.003)  # appends pile up meanwhile: groups of many
        real(fd)
        synced.append(w.next_seq - 1)

    fileio.fdatasync = slow_sync
    answered: list[tuple[int, int]] = []  # (seq, syncs done when answered)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        futs = []
        for i in range(60):
            e = entry(i)
            if i % 3 == 0:
                futs.append(w.append([e]))  # futures and callbacks share groups
            else:
                w.append_cb([e], lambda err, e=e: answered.append((e.seq, len(synced))) if err is None else None)
            if i % 10 == 9:
                await asyncio.sleep(0.002)
        await asyncio.gather(*futs)
        end = loop.time() + 10
        while len(answered) < 40 and loop.time() < end:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert [s for s, _ in answered] == sorted(s for s, _ in answered)
    assert len(answered) == 40
    for seq, syncs_before in answered:
        assert syncs_before >= 1
        # some sync that had returned by then covered the record
        assert any(done >= seq for done in synced[:syncs_before]), (seq, synced[:syncs_before])
    assert len(synced) < 60  # grouped
    w.close()
    again = IngressWAL(tmp_path, pool)
    again.open()
    assert [e.seq for e in again.replay()] == list(range(1, 61))
    again.close()
    pool.shutdown()


def test_append_cb_sync_failure_fails_the_group_and_latches(tmp_path: Path) -> None:
    pool = ThreadPoolExecutor(2)
    w = IngressWAL(tmp_path, pool)
    w.open()

    def bad_sync(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    fileio.fdatasync = bad_sync
    got: list[BaseException | None] = []

    async def main() -> None:
        for i in range(5):
            w.append_cb([entry(i)], got.append)
        fut = w.append([entry(9)])
        with pytest.raises(WALFailed):
            await fut
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while len(got) < 5 and loop.time() < end:
            await asyncio.sleep(0.01)
        with pytest.raises(WALFailed):
            w.append_cb([entry(10)], got.append)

    asyncio.run(main())
    assert len(got) == 5 and all(isinstance(e, WALFailed) for e in got), got
    assert w.failed is not None and w.durable_seq == 0
    fileio.reset()
    w.close()
    pool.shutdown()


# ---- the synchronous produce entry over HTTP/1.1, on a real node ------------------------------------


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("fast") / "data", workers=2).start()
    r = n.post("/v1/topics", {"name": "fast", "partitions": 3})
    assert r.status == 201, r
    yield n
    n.close()


def _read_answers(s: socket.socket, n: int) -> list[tuple[int, dict[str, str], bytes]]:
    """n HTTP/1.1 answers read off the socket, in order: (status, headers, body)."""
    buf = b""
    out = []
    s.settimeout(20)
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            assert chunk, f"connection closed after {len(out)} answers"
            buf += chunk
        head, _, buf = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        hdrs = {k.lower(): v for k, _, v in (ln.partition(": ") for ln in lines[1:])}
        length = int(hdrs.get("content-length", "0"))
        while len(buf) < length:
            chunk = s.recv(65536)
            assert chunk
            buf += chunk
        out.append((status, hdrs, buf[:length]))
        buf = buf[length:]
    return out


def _post(node: Node, path: str, body: bytes, auth: str | None = None) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {auth or node.auth}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def test_pipelined_produces_are_answered_in_order_with_the_same_answers(node: Node) -> None:
    with socket.create_connection(("127.0.0.1", node.port)) as s:
        # a first request puts the credentials in this worker's cache: what follows takes the fast entry
        s.sendall(f"GET /v1/topics/fast HTTP/1.1\r\nHost: x\r\nAuthorization: {node.auth}\r\n\r\n".encode())
        assert _read_answers(s, 1)[0][0] == 200
        reqs = [
            _post(node, "/v1/topics/fast/produce", b"one"),
            _post(node, "/v1/topics/fast/produce?key=k1", b"two"),
            _post(node, "/v1/topics/fast/produce", b""),  # 400, answered synchronously
            _post(node, "/v1/topics/nope/produce", b"x"),  # 404, answered synchronously
            _post(node, "/v1/topics/fast/produce?partition=7", b"x"),  # 400 out of range
            _post(node, "/v1/topics/fast/produce?partition=2", b"three"),
            f"GET /v1/topics/fast HTTP/1.1\r\nHost: x\r\nAuthorization: {node.auth}\r\n\r\n".encode(),
        ]
        s.sendall(b"".join(reqs))  # one write: pipelined
        got = _read_answers(s, len(reqs))
    assert [g[0] for g in got] == [202, 202, 400, 404, 400, 202, 200]
    for _status, hdrs, body in (got[0], got[1], got[5]):
        assert body == b"" and hdrs.get("content-length") == "0" and "content-type" not in hdrs
    assert json.loads(got[2][2]) == {"error": "message required"}
    assert json.loads(got[3][2]) == {"error": "topic not found"}
    assert json.loads(got[4][2]) == {"error": "invalid argument: partition out of range"}
    assert got[2][1]["content-type"] == "application/json"
    wait_for(lambda: sum(p["high_watermark"] for p in node.get("/v1/topics/fast").json()["partition_stats"]) == 3,
             what="the three accepted messages committed")


def test_fast_produce_refuses_what_the_async_path_refuses(node: Node) -> None:
    # a wrong password (never cached) and a missing Content-Type go the async way: 401, then 415
    bad = basic("admin", "wrong-password")
    with socket.create_connection(("127.0.0.1", node.port)) as s:
        s.sendall(_post(node, "/v1/topics/fast/produce", b"x", auth=bad))
        (status, _, body), = _read_answers(s, 1)
        assert status in (401, 429) and b"error" in body
    with socket.create_connection(("127.0.0.1", node.port)) as s:
        s.sendall(f"GET /v1/topics/fast HTTP/1.1\r\nHost: x\r\nAuthorization: {node.auth}\r\n\r\n".encode())
        assert _read_answers(s, 1)[0][0] == 200
        s.sendall((f"POST /v1/topics/fast/produce HTTP/1.1\r\nHost: x\r\nAuthorization: {node.auth}\r\n"
                   f"Content-Type: text/plain\r\nContent-Length: 1\r\n\r\nx").encode())
        (status, _, body), = _read_answers(s, 1)
    assert status == 415, body
