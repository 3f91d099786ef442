"""Wake-ups of consumers parked on one worker for records committed on another
(real node, two forked workers): the consumer a worker's ReadyNote wakes must
probe that worker at once, also while other consumers stay parked (the note's
handler re-arms the token for them, and that fresh stamp used to make the woken
consumer skip the very worker that had just told it records were there: the two
workers then traded notes with no probe, and the record waited for a poll to end)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from narad.broker.routing import owner_worker
from tests.harness import Cluster, Node, wait_for

OCTET = {"Content-Type": "application/octet-stream"}
PARTS = 4


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("wake") / "data", workers=2).start()
    yield n
    n.close()


def split_topic(prefix: str) -> str:
    for i in range(1000):
        name = f"{prefix}{i}"
        owners = {owner_worker(name, p, 2) for p in range(PARTS)}
        if owners == {0, 1}:
            return name
    raise AssertionError("no topic name splits over two workers")


@pytest.mark.parametrize("parked", [1, 3])
def test_a_record_on_the_other_worker_reaches_one_of_several_parked_consumers(node: Node, parked: int) -> None:
    name = split_topic(f"wake{parked}-")
    assert node.post("/v1/topics", {"name": name, "partitions": PARTS}).status == 201
    conns = [node.worker_connection(0) for _ in range(parked)]
    c1 = node.worker_connection(1)
    try:
        for round_ in range(3):
            out: list[Any] = [None] * parked

            def poll(i: int, out: list[Any] = out) -> None:
                out[i] = node.request("GET", f"/v1/topics/{name}/consume?wait=8s", conn=conns[i])

            threads = [threading.Thread(target=poll, args=(i,)) for i in range(parked)]
            for th in threads:
                th.start()
            node.wait_parked(parked)
            # keyless: committed at one of worker 1's own partitions
            assert node.request("POST", f"/v1/topics/{name}/produce", f"r{round_}".encode(), headers=OCTET,
                                conn=c1).status == 202
            # one consumer gets it well inside its 8 s poll (the others answer 204 when theirs ends)
            wait_for(lambda out=out: any(r is not None and r.status == 200 for r in out), 6.0, 0.02,
                     f"the record delivered to one of {parked} consumers parked on worker 0 (round {round_})")
            for th in threads:
                th.join(15)
            got = [r for r in out if r is not None and r.status == 200]
            assert len(got) == 1 and got[0].json()["payload"] == f"r{round_}", [(r.status, r.body) for r in out]
            assert all(r.status == 204 for r in out if r is not got[0])
            handle = got[0].json()["receipt_handle"]
            assert node.request("POST", f"/v1/topics/{name}/ack?receipt_handle={handle}", conn=c1).status == 204
    finally:
        for c in [*conns, c1]:
            c.close()


def test_records_on_the_other_worker_are_not_starved_by_local_ones(node: Node) -> None:
    """A consume that finds records in its own worker's partitions asks the other worker
    only now and then (PEER_SHARE): a record there still reaches a consumer that keeps
    finding local records, with nobody consuming on the other worker, long before the
    local ones run out."""
    name = split_topic("share-")
    assert node.post("/v1/topics", {"name": name, "partitions": PARTS}).status == 201
    c0, c1 = node.worker_connection(0), node.worker_connection(1)
    near = 300
    try:
        body = json.dumps({"messages": [{"payload": f"near{i}"} for i in range(near)]}).encode()
        r = node.request("POST", f"/v1/topics/{name}/produce/batch", body,
                         headers={"Content-Type": "application/json"}, conn=c0)
        assert r.status == 202, r
        assert node.request("POST", f"/v1/topics/{name}/produce", b"far", headers=OCTET, conn=c1).status == 202

        def hwm() -> int:
            return sum(s["high_watermark"] for s in node.get(f"/v1/topics/{name}").json()["partition_stats"])

        wait_for(lambda: hwm() == near + 1, 20, 0.02, "every record committed")
        seen: list[str] = []
        while "far" not in seen and len(seen) < near + 1:
            r = node.request("GET", f"/v1/topics/{name}/consume?max=10&wait=1s", conn=c0,
                             headers={"X-Narad-Client": "test"})
            assert r.status == 200, r
            msgs = r.json()["messages"]
            seen += [m["payload"] for m in msgs]
            a = node.request("POST", f"/v1/topics/{name}/ack",
                             json.dumps({"receipt_handles": [m["receipt_handle"] for m in msgs]}).encode(),
                             headers={"Content-Type": "application/json"}, conn=c0)
            assert a.status == 200, a
        assert "far" in seen
        assert len(seen) < near, f"the record on worker 1 came only after the {near} local ones ran out"
    finally:
        c0.close()
        c1.close()


def test_records_on_another_node_are_not_starved_by_local_ones(tmp_path: Path) -> None:
    """The fair share across nodes (NODE_SHARE): a consumer at n1 that keeps finding n1's
    own records still gets the record committed at n2, long before n1's run out."""
    c = Cluster(tmp_path, 2).start()
    try:
        leader = c.leader()
        assert c[leader].post("/v1/topics", {"name": "far", "partitions": 4}).status == 201
        for n in c.initial:
            wait_for(lambda n=n: c[n].get("/v1/topics/far").status == 200, 30)
        near = 300
        body = json.dumps({"messages": [{"payload": f"near{i}"} for i in range(near)]}).encode()
        assert c["n1"].request("POST", "/v1/topics/far/produce/batch", body,
                               headers={"Content-Type": "application/json"}).status == 202
        assert c["n2"].request("POST", "/v1/topics/far/produce", b"far", headers=OCTET).status == 202

        def hwms() -> dict[str, int]:
            out: dict[str, int] = {}
            for s in c["n1"].get("/v1/topics/far").json()["partition_stats"]:
                out[s["owner_node"]] = out.get(s["owner_node"], 0) + s["high_watermark"]
            return out

        # keyless records are committed at the receiving node's own partitions
        wait_for(lambda: hwms() == {"n1": near, "n2": 1}, 30, 0.05, "every record committed where it arrived")
        conn = c["n1"].conn()
        seen: list[str] = []
        while "far" not in seen and len(seen) < near + 1:
            r = c["n1"].request("GET", "/v1/topics/far/consume?max=10&wait=1s", conn=conn,
                                headers={"X-Narad-Client": "test"})
            assert r.status == 200, r
            msgs = r.json()["messages"]
            seen += [m["payload"] for m in msgs]
            a = c["n1"].request("POST", "/v1/topics/far/ack",
                                json.dumps({"receipt_handles": [m["receipt_handle"] for m in msgs]}).encode(),
                                headers={"Content-Type": "application/json"}, conn=conn)
            assert a.status == 200 and all(x["status"] == 204 for x in a.json()["results"]), a
        conn.close()
        assert "far" in seen
        assert len(seen) < near, f"the record on n2 came only after the {near} on n1 ran out"
    finally:
        c.close()
