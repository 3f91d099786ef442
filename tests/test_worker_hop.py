"""The hop between workers of one node, where the contract lets it be avoided:
a keyless produce is committed at a partition its own worker owns (a keyed one
still goes to its key's partition, wherever that lives), and the keyless
records of one WAL group go to one partition (one commit there); a consume reaches
records left on another worker (a probe, or that worker's ReadyNote once its
token fires); local RPC frames written together in one loop pass arrive whole
and in order, and a close sends what was written before it. Real nodes with
two forked workers, real Unix sockets."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import uvloop

from narad.api.messages import _handle_fields, _parse_handle
from narad.broker.routing import key_partition, owner_worker
from narad.errors import InternalError, PayloadTooLarge
from narad.ipc import rpc
from tests.harness import Node, wait_for

OCTET = {"Content-Type": "application/octet-stream"}
PARTS = 6


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("hop") / "data", workers=2).start()
    yield n
    n.close()


def split_topic(prefix: str) -> tuple[str, dict[int, list[int]]]:
    """A topic name whose partitions both workers own some of."""
    for i in range(1000):
        name = f"{prefix}{i}"
        owned: dict[int, list[int]] = {0: [], 1: []}
        for p in range(PARTS):
            owned[owner_worker(name, p, 2)].append(p)
        if owned[0] and owned[1]:
            return name, owned
    raise AssertionError("no topic name splits over two workers")


def mk(node: Node, name: str) -> None:
    r = node.post("/v1/topics", {"name": name, "partitions": PARTS})
    assert r.status == 201, r


def hwms(node: Node, name: str) -> dict[int, int]:
    stats = node.get(f"/v1/topics/{name}").json()["partition_stats"]
    return {s["index"]: s["high_watermark"] for s in stats}


def test_keyless_produce_is_committed_at_its_own_workers_partitions(node: Node) -> None:
    name, owned = split_topic("keyless")
    mk(node, name)
    want = dict.fromkeys(range(PARTS), 0)
    for w, per in ((0, 3), (1, 2)):
        c = node.worker_connection(w)
        for i in range(per * len(owned[w])):
            r = node.request("POST", f"/v1/topics/{name}/produce", f"w{w}-{i}".encode(), headers=OCTET, conn=c)
            assert r.status == 202, r
        c.close()
        # every keyless record of worker w sits in w's own partitions, spread evenly over them
        want.update(dict.fromkeys(owned[w], per))
        wait_for(lambda: hwms(node, name) == want, 20.0, what=f"worker {w}'s records at its own partitions")


def test_keyless_records_of_one_wal_group_go_to_one_partition_and_groups_rotate(node: Node) -> None:
    name, owned = split_topic("sticky")
    mk(node, name)
    c = node.worker_connection(0)
    seen: list[int] = []
    before = hwms(node, name)
    for b in range(2 * len(owned[0])):
        body = json.dumps({"messages": [{"payload": {"b": b, "i": i}} for i in range(20)]}).encode()
        r = node.request("POST", f"/v1/topics/{name}/produce/batch", body,
                         headers={"Content-Type": "application/json"}, conn=c)
        assert r.status == 202, r
        total = sum(before.values()) + 20
        wait_for(lambda total=total: sum(hwms(node, name).values()) == total, 20.0, what="the batch committed")
        after = hwms(node, name)
        grown = [p for p in after if after[p] != before[p]]
        # one batch is one WAL group: all of its keyless records in one partition of worker 0
        assert len(grown) == 1 and after[grown[0]] - before[grown[0]] == 20, (before, after)
        assert grown[0] in owned[0]
        seen.append(grown[0])
        before = after
    assert set(seen) == set(owned[0])  # later groups rotate over every partition worker 0 owns
    c.close()


def test_keyed_produce_still_goes_to_its_keys_partition_on_the_other_worker(node: Node) -> None:
    name, owned = split_topic("keyed")
    mk(node, name)
    key = next(f"k{i}" for i in range(10_000) if key_partition(f"k{i}".encode(), PARTS) in owned[1])
    target = key_partition(key.encode(), PARTS)
    c = node.worker_connection(0)
    for i in range(5):
        r = node.request("POST", f"/v1/topics/{name}/produce?key={key}", f"m{i}".encode(), headers=OCTET, conn=c)
        assert r.status == 202, r
    wait_for(lambda: hwms(node, name)[target] == 5, 20.0, what="keyed records at their partition")
    assert sum(hwms(node, name).values()) == 5
    # in produce order (one key, one partition), read back with replay
    got = [node.request("GET", f"/v1/topics/{name}/consume?partition={target}&offset={o}", conn=c).json()["payload"]
           for o in range(5)]
    assert got == [f"m{i}" for i in range(5)]
    c.close()


def test_consume_reaches_records_left_on_the_other_worker(node: Node) -> None:
    name, _owned = split_topic("reach")
    mk(node, name)
    c0, c1 = node.worker_connection(0), node.worker_connection(1)
    # a record already there: the first consume on worker 0 probes worker 1 and gets it
    assert node.request("POST", f"/v1/topics/{name}/produce", b"first", headers=OCTET, conn=c1).status == 202
    wait_for(lambda: sum(hwms(node, name).values()) == 1, 20.0, what="first record committed")
    r = node.request("GET", f"/v1/topics/{name}/consume?wait=5s", conn=c0)
    assert r.status == 200 and r.json()["payload"] == "first", r
    assert node.request("POST", f"/v1/topics/{name}/ack?receipt_handle={r.json()['receipt_handle']}",
                        conn=c0).status == 204
    # nothing left: a consume on worker 0 comes back short from worker 1 (which now holds its
    # token), parks, and is answered by the next record committed on worker 1
    for i in range(3):
        out: dict[str, Any] = {}

        def poll(i: int = i, out: dict[str, Any] = out) -> None:
            out["r"] = node.request("GET", f"/v1/topics/{name}/consume?wait=10s", conn=c0)

        th = threading.Thread(target=poll)
        th.start()
        node.wait_parked(1)
        assert node.request("POST", f"/v1/topics/{name}/produce", f"later{i}".encode(), headers=OCTET,
                            conn=c1).status == 202
        th.join(15)
        r = out["r"]
        assert r.status == 200 and r.json()["payload"] == f"later{i}", r
        assert node.request("POST", f"/v1/topics/{name}/ack?receipt_handle={r.json()['receipt_handle']}",
                            conn=c0).status == 204
    c0.close()
    c1.close()


def test_batch_ack_across_both_workers_settles_each_at_its_owner(node: Node) -> None:
    name, owned = split_topic("ackmix")
    mk(node, name)
    c0, c1 = node.worker_connection(0), node.worker_connection(1)
    for c, tag in ((c0, "a"), (c1, "b")):
        for i in range(3):
            assert node.request("POST", f"/v1/topics/{name}/produce", f"{tag}{i}".encode(), headers=OCTET,
                                conn=c).status == 202
    wait_for(lambda: sum(hwms(node, name).values()) == 6, 20.0, what="records committed")
    hdr = {"X-Narad-Client": "t"}
    msgs: list[dict[str, Any]] = []
    while len(msgs) < 6:
        r = node.request("GET", f"/v1/topics/{name}/consume?max=10&wait=2s", conn=c0, headers=hdr)
        assert r.status == 200, r
        msgs += r.json()["messages"]
    assert {m["payload"] for m in msgs} == {"a0", "a1", "a2", "b0", "b1", "b2"}
    assert {m["partition"] in owned[1] for m in msgs} == {True, False}  # both workers' partitions
    handles = [m["receipt_handle"] for m in msgs] + ["0:0:1"]  # and one no lease matches
    r = node.request("POST", f"/v1/topics/{name}/ack", json.dumps({"receipt_handles": handles}).encode(),
                     headers={"Content-Type": "application/json"}, conn=c1)
    assert r.status == 200, r
    assert [x["status"] for x in r.json()["results"]] == [204] * 6 + [410]
    c0.close()
    c1.close()


# ---- receipt handles --------------------------------------------------------------------------------


def test_handle_parser_reads_exactly_what_the_strict_parser_reads() -> None:
    import random

    rng = random.Random(7)
    cases = ["1:2:3", "0:0:0", "-0:1:2", "1:2", "1:2:3:4", " 1:2:3", "1:2:3\n", "\u0663:1:2",
             "9223372036854775807:1:1", "9223372036854775808:1:1", "00000000000000000001:1:1",
             "000000000000000000001:1:1", "+1:2:3", "1_0:2:3", "", ":1:2", "1::2", "1:2:3 "]
    cases += ["".join(rng.choice("0123456789:-+ a\u0663") for _ in range(rng.randint(0, 14))) for _ in range(5000)]
    for c in cases:
        assert _handle_fields(c) == _parse_handle(c), c


# ---- local RPC framing ------------------------------------------------------------------------------


class Note(msgspec.Struct, tag=True, array_like=True):
    n: int
    pad: bytes = b""


class Echo(msgspec.Struct, tag=True, array_like=True):
    n: int


def test_frames_written_in_one_pass_arrive_whole_in_order_and_close_sends_them() -> None:
    async def main() -> None:
        got: list[int] = []
        done = asyncio.get_running_loop().create_future()
        svc = rpc.Service()

        async def note(m: Note, _c: rpc.Connection) -> None:
            got.append(m.n)
            if m.n == -1 and not done.done():
                done.set_result(None)

        async def echo(m: Echo, _c: rpc.Connection) -> Echo:
            return Echo(m.n * 2)

        svc.register(Note, note)  # type: ignore[arg-type]
        svc.register(Echo, echo)  # type: ignore[arg-type]
        path = os.path.join(tempfile.mkdtemp(), "t.sock")
        server = await rpc.serve_unix(path, lambda: svc)
        c = await rpc.connect_unix(path)
        # many calls in flight: replies written together still match their callers
        res = await asyncio.gather(*(c.call(Echo(i), Echo, timeout=10) for i in range(500)))
        assert [r.n for r in res] == [2 * i for i in range(500)]
        # notes of one pass, small and large (a frame split over reads), then close at once
        for i in range(2000):
            c.notify(Note(i, b"x" * (70_000 if i % 500 == 7 else 10)))
        c.notify(Note(-1))
        c.close()
        await asyncio.wait_for(done, 10)
        assert got == [*range(2000), -1]
        server.close()
        Path(path).unlink(missing_ok=True)

    uvloop.run(main())


def test_a_call_over_the_frame_limit_fails_alone_and_the_link_stays_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver closes a link on a frame over ``MAX_FRAME`` (every call in flight on it
    fails): the sender refuses such a call itself (413, not sent), and an answer over it
    goes back as an error, so the link and the other calls live on."""
    monkeypatch.setattr(rpc, "MAX_FRAME", 4096)

    async def main() -> None:
        svc = rpc.Service()

        async def echo(m: Echo, _c: rpc.Connection) -> Echo | Note:
            return Note(m.n, b"y" * 8000) if m.n < 0 else Echo(m.n * 2)

        async def note(m: Note, _c: rpc.Connection) -> Echo:
            return Echo(len(m.pad))

        svc.register(Echo, echo)  # type: ignore[arg-type]
        svc.register(Note, note)  # type: ignore[arg-type]
        path = os.path.join(tempfile.mkdtemp(), "t.sock")
        server = await rpc.serve_unix(path, lambda: svc)
        c = await rpc.connect_unix(path)
        with pytest.raises(PayloadTooLarge, match="frame limit"):
            await c.call(Note(1, b"x" * 8000), Echo, timeout=5)
        assert (await c.call(Note(1, b"x" * 100), Echo, timeout=5)).n == 100
        with pytest.raises(InternalError, match="frame limit"):
            await c.call(Echo(-1), Note, timeout=5)
        assert (await c.call(Echo(21), Echo, timeout=5)).n == 42 and not c.closed
        c.close()
        server.close()
        Path(path).unlink(missing_ok=True)

    uvloop.run(main())
