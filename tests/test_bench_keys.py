"""loadtest/bench.py's ``idem1p`` keys: a batch's idempotency keys all hash, by the
node's own rule (``narad.broker.routing.key_partition``), to one partition, and the
partition moves on from batch to batch; every key is unique. If they did not, the
``idem1p`` figure would measure the spread it is meant to leave out. And the ``retry``,
``retrydelay`` and ``vis`` shapes, driven against a real node."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from narad.broker.routing import key_partition

ROOT = Path(__file__).resolve().parent.parent


def _bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_for_keys", ROOT / "loadtest" / "bench.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_for_keys"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_each_batchs_keys_land_on_one_partition_which_moves_on_and_no_key_repeats() -> None:
    bench = _bench()
    for parts in (3, 7):
        bench.PARTITIONS = parts
        seen: set[bytes] = set()
        targets = []
        for gid in (0, 1):
            for seq in range(0, 1000, 100):
                keys = bench.one_partition_keys((gid << 32) | seq, 100)
                assert len(keys) == 100
                where = {key_partition(k, parts) for k in keys}
                assert len(where) == 1, where
                targets.append(where.pop())
                assert seen.isdisjoint(keys)
                seen.update(keys)
                assert all(len(k) <= 31 for k in keys)  # (the short-key block, as "idem"'s)
        assert len(set(targets)) == parts  # every partition gets batches, in turn


def test_the_retry_shapes_nack_each_first_delivery_and_consume_each_message_once(tmp_path: Path) -> None:
    """loadtest/bench.py's ``retry`` and ``retrydelay`` consume loop against a real node:
    every message is nacked at its first delivery (with the 20 ms delay for
    ``retrydelay``) and acked at its second, and each one counts as consumed once; the
    ``vis`` consume carries its lease length. Otherwise the features' figures would
    measure some other shape."""
    import asyncio

    from tests.harness import Node

    bench = _bench()
    n = Node(tmp_path / "data", workers=1).start()
    try:
        for feature in ("retry", "retrydelay", "vis"):
            topic = f"b-{feature}"
            assert n.post("/v1/topics", {"name": topic, "partitions": 3}).status == 201
            r = bench.Requests(n.port, n.auth, topic=topic, feature=feature)
            assert (b"&visibility=30s" in r.consume_many) == (feature == "vis")
            st = bench.Stats()
            asyncio.run(_drive(bench, n.port, r, st))
            assert sorted(st.consumed_ids) == list(range(50)) and st.acked == 50, feature
            assert st.nacked == (50 if feature != "vis" else 0), feature
    finally:
        n.close()


async def _drive(bench, port: int, r, st) -> None:  # type: ignore[no-untyped-def]
    """50 messages produced in a batch, then consumed (and nacked or acked) by the bench's
    own loop until all 50 are acked; nothing left after."""
    c = await bench.HttpConn.open(port)
    try:
        s, b = await c.request(r.produce_batch(0, 50))
        assert s == 202, b
        for _ in range(200):
            await bench.consume_and_ack(c, r, st, r.consume_many)
            if st.consumed >= 50:
                break
        assert await bench.consume_and_ack(c, r, st, r.consume_now) == 0
    finally:
        c.close()
