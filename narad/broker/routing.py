"""Deterministic placement inside a node and partition choice for keys.

``owner_worker`` is the map the supervisor publishes (its only input besides
the partition is the worker count N, fixed in shared memory for the
supervisor's life): every worker computes the same owner for a partition.
Keys hash with CRC-32C; keyless messages rotate per topic per worker from a
random start, over the partitions the worker owns itself when it owns any (a
keyless message may go to any partition: this spares it the hop to another
worker or node), else over all of them. Pure functions, no I/O.
"""

from __future__ import annotations

import random

from crc32c import crc32c


def owner_worker(topic: str, partition: int, workers: int) -> int:
    if workers <= 1:
        return 0
    return crc32c(f"{topic}\0{partition}".encode()) % workers


def key_partition(key: bytes, partitions: int) -> int:
    """A key's partition (a message key's, else an idempotency key's UTF-8). The batch
    produce applies it inline (``crc32c(key) % partitions``): one rule, kept equal
    (tests/test_idempotency.py checks where a keyed batch's records land)."""
    return crc32c(key) % partitions


class RoundRobin:
    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def pick(self, topic: str, partitions: int) -> int:
        n = self._next.get(topic)
        if n is None:
            n = random.randrange(partitions)
        self._next[topic] = n + 1
        if len(self._next) > 100_000:
            self._next.clear()
        return n % partitions

    def pick_among(self, topic: str, parts: list[int]) -> int:
        """The next of `parts` (non-empty) in this topic's rotation."""
        return parts[self.pick(topic, len(parts))]
