"""The dispatcher on a real ingress WAL (real files), with a scripted owner side:
order per destination, the checkpoint never passing an uncommitted record,
retry of a failing owner, reroute after the grace (one probe kept) and at once
for a dead owner (none kept), and leader-confirmed discards."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from narad.broker import dispatcher as D
from narad.storage import frames as FR
from narad.storage.wal import Entry, IngressWAL

INC = bytes.fromhex("00112233445566778899aabbccddeeff")


class Owners:
    """The broker side: who is alive, who fails, what was committed where."""

    def __init__(self, partitions: int = 3) -> None:
        self.partitions = partitions
        self.dead: set[int] = set()
        self.failing: set[int] = set()
        self.gone = False
        self.trusted = True  # routes_trusted(): the node's replica caught up once
        self.committed: dict[int, list[bytes]] = defaultdict(list)
        self.attempts: dict[int, int] = defaultdict(int)
        self.homes: dict[bytes, int] = {}  # payload -> the partition rehome() sends it to

    async def deliver(self, topic: str, topic_id: str, partition: int, entries: list[Entry]) -> str | D.Rehome:
        self.attempts[partition] += 1
        await asyncio.sleep(0)
        if self.gone:
            return "gone"
        moved = [(i, self.homes[e.payload]) for i, e in enumerate(entries)
                 if e.placed and self.homes.get(e.payload, partition) != partition]
        if moved:
            return D.Rehome(moved)
        if partition in self.failing or partition in self.dead:
            raise ConnectionError(f"owner of partition {partition} does not answer")
        self.committed[partition] += [e.payload for e in entries]
        return "ok"

    def partition_count(self, topic: str, topic_id: str) -> int:
        return self.partitions


    def owner_alive(self, topic: str, topic_id: str, partition: int) -> bool:
        return partition not in self.dead

    def routes_trusted(self) -> bool:
        return self.trusted


@pytest.fixture
def io() -> Iterator[ThreadPoolExecutor]:
    ex = ThreadPoolExecutor(2)
    yield ex
    ex.shutdown(wait=True)


async def _setup(tmp_path: Path, io: ThreadPoolExecutor, owners: Owners) -> tuple[IngressWAL, D.Dispatcher]:
    wal = IngressWAL(tmp_path / "wal", io)
    wal.open()
    disp = D.Dispatcher(wal, owners)
    wal.on_durable = disp.feed
    return wal, disp


async def _produce(wal: IngressWAL, partition: int, payloads: list[bytes]) -> None:
    await wal.append([Entry("t", INC, partition, 1, 0, None, p) for p in payloads])


async def _until(cond: object, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():  # type: ignore[operator]
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def test_records_reach_their_owner_in_order_and_the_checkpoint_follows(tmp_path: Path,
                                                                        io: ThreadPoolExecutor) -> None:
    async def main() -> None:
        owners = Owners()
        wal, disp = await _setup(tmp_path, io, owners)
        for i in range(50):
            await _produce(wal, i % 2, [f"m{i}".encode()])
        await _until(lambda: disp.committed == 50)
        assert owners.committed[0] == [f"m{i}".encode() for i in range(0, 50, 2)]
        assert owners.committed[1] == [f"m{i}".encode() for i in range(1, 50, 2)]
        assert wal.checkpoint_seq > 50 - 1
        await disp.close()
        wal.close()

    asyncio.run(main())


def test_nothing_is_dispatched_before_the_replica_caught_up_once(tmp_path: Path, io: ThreadPoolExecutor) -> None:
    """Until routes_trusted() (the node was ready once), durable records wait: no delivery,
    no reroute, the checkpoint holds; then they go, in order."""
    async def main() -> None:
        owners = Owners()
        owners.trusted = False
        owners.dead.add(1)  # a reroute would be decided from the same untrusted replica
        wal, disp = await _setup(tmp_path, io, owners)
        first_ckpt = wal.checkpoint_seq
        for i in range(6):
            await _produce(wal, i % 3, [f"m{i}".encode()])
        await asyncio.sleep(0.3)
        assert sum(owners.attempts.values()) == 0 and disp.rerouted == 0 and wal.checkpoint_seq == first_ckpt
        owners.dead.clear()
        owners.trusted = True
        await _until(lambda: disp.committed == 6)
        assert owners.committed[1] == [b"m1", b"m4"] and disp.rerouted == 0
        await disp.close()
        wal.close()

    asyncio.run(main())


def test_a_failing_owner_holds_the_checkpoint_and_is_retried(tmp_path: Path, io: ThreadPoolExecutor,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "RETRY_AFTER", 0.05)
    monkeypatch.setattr(D, "REROUTE_AFTER", 60.0)

    async def main() -> None:
        owners = Owners()
        owners.failing.add(1)
        wal, disp = await _setup(tmp_path, io, owners)
        await _produce(wal, 1, [b"held"])
        first_ckpt = wal.checkpoint_seq
        await _produce(wal, 0, [b"after"])
        await _until(lambda: owners.committed[0] == [b"after"])
        await _until(lambda: owners.attempts[1] >= 3)
        assert wal.checkpoint_seq == first_ckpt  # never passes the record still held
        owners.failing.clear()
        await _until(lambda: owners.committed[1] == [b"held"])
        await _until(lambda: wal.checkpoint_seq > first_ckpt + 1)
        await disp.close()
        wal.close()

    asyncio.run(main())


def test_after_the_grace_a_failing_owner_keeps_one_probe_and_the_rest_reroutes(
        tmp_path: Path, io: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "RETRY_AFTER", 0.05)
    monkeypatch.setattr(D, "REROUTE_AFTER", 0.2)

    async def main() -> None:
        owners = Owners()
        owners.failing.add(1)
        wal, disp = await _setup(tmp_path, io, owners)
        await _produce(wal, 1, [b"a"])
        await _until(lambda: owners.attempts[1] >= 1)
        await _produce(wal, 1, [b"b", b"c"])
        await _until(lambda: len(owners.committed[2]) == 2)  # the next partition upward
        assert set(owners.committed[2]) <= {b"a", b"b", b"c"}
        assert disp.rerouted == 2
        owners.failing.clear()  # the owner recovers: the probe lands there
        await _until(lambda: len(owners.committed[1]) == 1)
        assert sorted(owners.committed[1] + owners.committed[2]) == [b"a", b"b", b"c"]
        await disp.close()
        wal.close()

    asyncio.run(main())


def test_a_dead_owner_reroutes_everything_at_once(tmp_path: Path, io: ThreadPoolExecutor,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "REROUTE_AFTER", 60.0)

    async def main() -> None:
        owners = Owners()
        owners.dead.add(0)
        wal, disp = await _setup(tmp_path, io, owners)
        await _produce(wal, 0, [b"only"])  # a single record: nothing may stay behind
        await _until(lambda: owners.committed[1] == [b"only"], 2.0)
        assert owners.attempts[0] == 0  # never sent to the dead owner
        await _produce(wal, 0, [b"x", b"y"])
        await _until(lambda: owners.committed[1] == [b"only", b"x", b"y"], 2.0)
        await _until(lambda: wal.checkpoint_seq >= 3)
        await disp.close()
        wal.close()

    asyncio.run(main())


def test_a_confirmed_gone_incarnation_is_discarded(tmp_path: Path, io: ThreadPoolExecutor) -> None:
    async def main() -> None:
        owners = Owners()
        owners.gone = True
        wal, disp = await _setup(tmp_path, io, owners)
        await _produce(wal, 2, [b"old"])
        await _until(lambda: disp.discarded == 1)
        assert not owners.committed
        await _until(lambda: wal.checkpoint_seq >= 1)
        await disp.close()
        wal.close()

    asyncio.run(main())


def test_records_the_target_rehomes_are_committed_at_their_home_and_the_rest_where_placed(
        tmp_path: Path, io: ThreadPoolExecutor) -> None:
    """A keyless idempotent record placed away from its key's partition, on a node that may
    no longer commit it there (its home moved), goes to its home; the checkpoint passes
    every record once all are committed."""
    async def main() -> None:
        owners = Owners()
        wal, disp = await _setup(tmp_path, io, owners)
        owners.homes = {b"i1": 2, b"i3": 1, b"given": 2}
        await wal.append([Entry("t", INC, 0, 1, FR.F_EXT, None, p, placed=True) for p in (b"i0", b"i1", b"i2", b"i3")]
                         + [Entry("t", INC, 0, 1, FR.F_EXT, None, b"given")])  # (a partition the client gave)
        await _until(lambda: disp.committed == 5)
        assert owners.committed == {0: [b"i0", b"i2", b"given"], 2: [b"i1"], 1: [b"i3"]}
        assert disp.rehomed == 2 and disp.rerouted == 0
        assert wal.checkpoint_seq > 4
        # A batch all of whose records belong elsewhere leaves nothing for its placed partition.
        owners.homes = {b"j0": 1, b"j1": 1}
        await wal.append([Entry("t", INC, 0, 1, FR.F_EXT, None, p, placed=True) for p in (b"j0", b"j1")])
        await _until(lambda: disp.committed == 7)
        assert owners.committed[1] == [b"i3", b"j0", b"j1"]
        assert owners.attempts[0] == 3  # (two for the first batch, one for this)
        await disp.close()
        wal.close()

    asyncio.run(main())
