"""Direct commits: a keyless produce whose partition the receiving worker chose (one it
owns, open) is committed straight into that partition, without the ingress WAL, and
answered 202 after that commit's sync and read-back. On a real node with forked
workers: ordinary keyless produce takes it (single, the synchronous entry, and batch);
a direct commit that fails (``NARAD_FAULT_DIRECT_COMMIT_FAIL_EVERY``) hands its records
to the WAL, and every message answered 202 is delivered exactly once; keyed and
idempotent produce never take it. Kill -9 under direct produce is in tests/test_crash.py."""

from __future__ import annotations

import json
from typing import Any

from tests.harness import Node, wait_for

OCTET = {"Content-Type": "application/octet-stream"}
CLIENT = {"X-Narad-Client": "tests"}
DIRECT = "narad_produced_direct_messages_total"


def drain(node: Node, topic: str, want: int, timeout: float = 30.0) -> list[str]:
    """Consume and ack until `want` messages came (and a little longer: duplicates would show)."""
    got: list[str] = []

    def more() -> bool:
        r = node.request("GET", f"/v1/topics/{topic}/consume?max=100&wait=200ms", headers=CLIENT)
        if r.status == 200:
            msgs: list[dict[str, Any]] = r.json()["messages"]
            got.extend(m["payload"] for m in msgs)
            handles = [m["receipt_handle"] for m in msgs]
            a = node.request("POST", f"/v1/topics/{topic}/ack", json.dumps({"receipt_handles": handles}).encode(),
                             headers={**CLIENT, "Content-Type": "application/json"})
            assert a.status == 200, a
        return len(got) >= want

    wait_for(more, timeout, 0.01, f"{want} messages of {topic}")
    assert node.request("GET", f"/v1/topics/{topic}/consume?max=100&wait=300ms", headers=CLIENT).status == 204
    return got


def produce_all(node: Node, topic: str, singles: int, batches: int) -> list[str]:
    sent: list[str] = []
    for i in range(singles):
        body = f"single-{i}"
        assert node.request("POST", f"/v1/topics/{topic}/produce", body.encode(), headers=OCTET).status == 202
        sent.append(body)
    for b in range(batches):
        msgs = [f"batch-{b}-{j}" for j in range(10)]
        r = node.post(f"/v1/topics/{topic}/produce/batch", {"messages": [{"payload": m} for m in msgs]})
        assert r.status == 202 and r.json() == {"accepted": 10}, r
        sent.extend(msgs)
    return sent


def test_keyless_produce_commits_directly_and_keyed_produce_does_not(tmp_path: Any) -> None:
    n = Node(tmp_path / "data", workers=2).start()
    try:
        assert n.post("/v1/topics", {"name": "direct", "partitions": 4}).status == 201
        sent = produce_all(n, "direct", 40, 6)
        direct = n.metric(DIRECT)  # counted before each 202
        assert 0 < direct <= len(sent)
        assert sorted(drain(n, "direct", len(sent))) == sorted(sent)

        # Keyed and idempotent messages keep the WAL (a key's order, an idempotency key's check).
        assert n.post("/v1/topics", {"name": "keyed", "partitions": 4}).status == 201
        before = n.metric(DIRECT)  # counted before each 202, so exact here
        for i in range(30):
            r = n.request("POST", f"/v1/topics/keyed/produce?key=k{i}", f"k-{i}".encode(), headers=OCTET)
            assert r.status == 202, r
            r = n.request("POST", f"/v1/topics/keyed/produce?idempotency_key=i{i}", f"i-{i}".encode(),
                          headers=OCTET)
            assert r.status == 202, r
        got = drain(n, "keyed", 60)
        assert sorted(got) == sorted([f"k-{i}" for i in range(30)] + [f"i-{i}" for i in range(30)])
        assert n.metric(DIRECT) == before, "keyed or idempotent records took a direct commit"
    finally:
        n.close()


def test_a_failed_direct_commit_hands_its_records_to_the_wal(tmp_path: Any) -> None:
    n = Node(tmp_path / "data", workers=1, env={"NARAD_FAULT_DIRECT_COMMIT_FAIL_EVERY": "3"}).start()
    try:
        assert n.post("/v1/topics", {"name": "fallback", "partitions": 3}).status == 201
        sent = produce_all(n, "fallback", 60, 10)
        got = drain(n, "fallback", len(sent))
        assert sorted(got) == sorted(sent), "a message answered 202 was lost or duplicated"
        direct = n.metric(DIRECT)  # counted before each 202
        # every third direct attempt failed and went through the WAL: at most two thirds committed directly
        assert 0 < direct <= len(sent) * 2 / 3 + 10
    finally:
        n.close()
