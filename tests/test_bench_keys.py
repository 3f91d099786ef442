"""loadtest/bench.py's ``idem1p`` keys: a batch's idempotency keys all hash, by the
node's own rule (``narad.broker.routing.key_partition``), to one partition, and the
partition moves on from batch to batch; every key is unique. If they did not, the
``idem1p`` figure would measure the spread it is meant to leave out."""

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
