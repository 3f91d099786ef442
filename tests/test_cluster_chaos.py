"""Chaos with a ledger: sustained produce / consume / ack against every node
of a 3-node cluster while a follower and then the leader are killed with
SIGKILL and restarted. At the end every message answered 202 must have been
delivered and acked (losses printed and zero; duplicates printed)."""

from __future__ import annotations

import http.client
import itertools
import json
import threading
from pathlib import Path

import pytest

from tests.harness import Cluster, Node, wait_for

pytestmark = pytest.mark.slow
OCTET = {"Content-Type": "application/octet-stream"}


class Traffic:
    def __init__(self, cluster: Cluster, topic: str, producers: int = 3, consumers: int = 3) -> None:
        self.c, self.topic = cluster, topic
        self.ledger: set[str] = set()
        self.delivered: list[str] = []
        self.acked: set[str] = set()
        self.in_doubt: set[str] = set()  # delivered; the ack's answer was lost (the node died meanwhile)
        self.ack_statuses: dict[int, int] = {}  # per-handle ack results seen
        self.lock = threading.Lock()
        self.stop_producing = threading.Event()
        self.stop_consuming = threading.Event()
        self.errors = 0
        ids = cluster.initial
        self.producers = [threading.Thread(target=self._produce, args=(i, ids), daemon=True)
                          for i in range(producers)]
        self.threads = self.producers + [threading.Thread(target=self._consume, args=(i, ids), daemon=True)
                                         for i in range(consumers)]

    def _node(self, ids: list[str], k: int) -> Node:
        return self.c[ids[k % len(ids)]]

    def _produce(self, tid: int, ids: list[str]) -> None:
        k = tid
        conn: http.client.HTTPConnection | None = None
        for i in itertools.count():
            if self.stop_producing.is_set():
                return
            node = self._node(ids, k)
            mid = f"p{tid}-{i}"
            try:
                conn = conn or node.conn()
                conn.timeout = 5
                r = node.request("POST", f"/v1/topics/{self.topic}/produce", mid.encode(), headers=OCTET, conn=conn)
            except (OSError, http.client.HTTPException):
                r = None
            if r is not None and r.status == 202:
                with self.lock:
                    self.ledger.add(mid)
                self.stop_producing.wait(0.002)  # pace the load (and end at once when told)
                continue
            with self.lock:
                self.errors += 1
            if conn is not None:
                conn.close()
            conn = None
            k += 1  # that node is down (or refusing): use the next one
            self.stop_producing.wait(0.05)

    def _consume(self, tid: int, ids: list[str]) -> None:
        k = tid
        conn: http.client.HTTPConnection | None = None
        while not self.stop_consuming.is_set():
            node = self._node(ids, k)
            try:
                conn = conn or node.conn()
                conn.timeout = 10
                r = node.request("GET", f"/v1/topics/{self.topic}/consume?wait=1s&max=20", conn=conn,
                                 headers={"X-Narad-Client": "chaos"})
                if r.status == 204:
                    continue
                if r.status != 200:
                    raise OSError(f"consume {r.status}")
                msgs = r.json()["messages"]
                with self.lock:
                    self.delivered += [m["payload"] for m in msgs]
                body = json.dumps({"receipt_handles": [m["receipt_handle"] for m in msgs]}).encode()
                try:
                    a = node.request("POST", f"/v1/topics/{self.topic}/ack", body,
                                     headers={"Content-Type": "application/json"}, conn=conn)
                except (OSError, http.client.HTTPException):
                    with self.lock:
                        self.in_doubt.update(m["payload"] for m in msgs)
                    raise
                if a.status == 200:
                    with self.lock:
                        for m, res in zip(msgs, a.json()["results"], strict=True):
                            self.ack_statuses[res["status"]] = self.ack_statuses.get(res["status"], 0) + 1
                            if res["status"] == 204:
                                self.acked.add(m["payload"])
                            elif res["status"] >= 500:
                                # The owner did not answer for this handle (it died with the ack
                                # maybe applied): in doubt, like a lost answer to the whole request.
                                self.in_doubt.add(m["payload"])
            except (OSError, http.client.HTTPException, ValueError):
                if conn is not None:
                    conn.close()
                conn = None
                k += 1
                self.stop_consuming.wait(0.05)

    def start(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def produced(self) -> int:
        with self.lock:
            return len(self.ledger)


def test_kill_follower_then_leader_under_traffic_loses_nothing(tmp_path: Path) -> None:
    c = Cluster(tmp_path, 3).start()
    try:
        leader = c.leader()
        assert c[leader].post("/v1/topics", {"name": "chaos", "partitions": 6,
                                             "visibility_timeout_ms": 3000}).status == 201
        for n in c.initial:
            wait_for(lambda n=n: c[n].get("/v1/topics/chaos").status == 200)
        tr = Traffic(c, "chaos").start()
        wait_for(lambda: tr.produced() >= 200, 60, what="traffic")
        follower = next(n for n in c.initial if n != leader)
        c[follower].kill9()
        base = tr.produced()
        wait_for(lambda: tr.produced() >= base + 150, 60, what="traffic with a follower down")
        c[follower].start()
        base = tr.produced()
        wait_for(lambda: tr.produced() >= base + 150, 60, what="traffic after the follower returned")
        leader = c.leader()
        c[leader].kill9()
        base = tr.produced()
        wait_for(lambda: tr.produced() >= base + 150, 60, what="traffic with the leader down")
        c[leader].start()
        base = tr.produced()
        wait_for(lambda: tr.produced() >= base + 150, 60, what="traffic after the leader returned")
        tr.stop_producing.set()
        for t in tr.producers:
            t.join(30)  # in-flight produces land in the ledger (or not) before it is read
        ledger = set(tr.ledger)

        def settled() -> bool:
            # Every acknowledged message delivered, and acked unless its ack's answer was lost
            # with a node (then the node may have applied it: at-least-once allows either).
            with tr.lock:
                return ledger <= tr.acked | (tr.in_doubt & set(tr.delivered))

        def nothing_left() -> bool:
            # ...and no partition anywhere holds a message not yet acked (an ack that was in
            # doubt and did not apply would show here until its redelivery is acked).
            r = c[c.initial[0]].get("/v1/topics/chaos")
            stats = r.json()["partition_stats"]
            return all(s.get("lag") == 0 and s.get("in_flight") == 0 for s in stats) and len(stats) == 6

        try:
            wait_for(settled, 120, 0.2, "every acknowledged message delivered and acked")
            wait_for(nothing_left, 60, 0.2, "no unacked message left in any partition")
        finally:
            tr.stop_consuming.set()
            missing = sorted(ledger - tr.acked - tr.in_doubt)
            stats = c[c.initial[0]].get("/v1/topics/chaos").json()["partition_stats"]
            delivered = set(tr.delivered)
            print(f"\nchaos: {len(missing)} acknowledged messages not acked: {missing[:20]} "
                  f"(of them delivered: {[x for x in missing[:20] if x in delivered]}); "
                  f"per-handle ack results {tr.ack_statuses}; "
                  f"ack in doubt {len(tr.in_doubt)}; (lag, in flight) per partition "
                  f"{[(s.get('lag'), s.get('in_flight')) for s in stats]}")
        dups = len(tr.delivered) - len(set(tr.delivered))
        lost = ledger - set(tr.delivered)
        print(f"\nchaos: acknowledged {len(ledger)}, delivered {len(set(tr.delivered))}, acked {len(tr.acked)}, "
              f"ack answers lost {len(tr.in_doubt)}, lost {len(lost)}, duplicate deliveries {dups}, "
              f"client-side errors {tr.errors}")
        assert not lost
    finally:
        c.close()
