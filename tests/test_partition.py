"""Lease table rules of one partition, driven directly (real log files, no
HTTP): reserve-before-read, nonce checks, caps, expiry, and a consumer
frontier that falls behind retention."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narad.broker.partition import Partition
from narad.storage.offsets import OffsetFile
from narad.storage.partition_log import PartitionLog


def _partition(tmp: Path, n: int, segment_bytes: int = 64 << 20) -> Partition:
    plog = PartitionLog(tmp, segment_bytes=segment_bytes)
    plog.open()
    offs = OffsetFile(tmp)
    p = Partition("t", "00" * 8, 0, plog, offs)
    p.restore(*offs.load())
    with ThreadPoolExecutor(1) as ex:
        async def fill() -> None:
            p.loop = asyncio.get_running_loop()
            for i in range(n):
                await p.commit([(None, 0, f"m{i}".encode())], ex)

        asyncio.run(fill())
    return p


def test_reserve_ack_extend_nack_and_expiry(tmp_path: Path) -> None:
    p = _partition(tmp_path, 3)
    d = p.reserve(100.0, 2, 30.0, 1024, 1024)
    assert [x.offset for x in d] == [0, 1] and d[0].nonce != d[1].nonce
    assert not p.ack(0, d[0].nonce + 1, 100.0)  # wrong nonce: 410
    assert p.extend(0, d[0].nonce, 120.0, 30.0)  # now expires at 150
    assert p.nack(1, d[1].nonce, 101.0)
    again = p.reserve(101.0, 5, 30.0, 1024, 1024)
    assert [x.offset for x in again] == [1, 2]  # the nacked one first
    assert not p.ack(1, d[1].nonce, 102.0)  # the old handle is gone
    # Expiry: offset 0 was extended to 150, offsets 1 and 2 expire at 131.
    assert p.reserve(140.0, 5, 30.0, 1024, 1024)[0].offset in (1, 2)
    assert all(x.offset != 0 for x in p.reserve(140.0, 5, 30.0, 1024, 1024))
    late = p.reserve(151.0, 5, 30.0, 1024, 1024)
    assert 0 in {x.offset for x in late}
    for x in late:
        assert p.ack(x.offset, x.nonce, 151.5)


def test_frontier_jumps_past_offsets_deleted_by_retention(tmp_path: Path) -> None:
    p = _partition(tmp_path, 40, segment_bytes=256)  # many small segments
    assert len(p.log.segments) > 3
    sealed = p.log.segments[:-1]
    for s in sealed:
        s.last_write_ms = 0  # written long ago
    gone = p.log.expired_segments(3_600_000, 10 * 3_600_000)
    assert gone and p.log.delete_segments(gone)[0] > 0
    oldest = p.log.oldest
    assert oldest > 0
    got = p.reserve(1.0, 1, 30.0, 1024, 1024)
    assert got[0].offset == oldest  # never the deleted ones
    assert p.committed == oldest - 1 and p.dropped == oldest


def test_a_read_refused_mid_reserve_keeps_the_offset_deliverable(tmp_path: Path) -> None:
    """A read that says the log is closing (or the record not yet visible) gives the
    lease back: the offset must come out of the next reserve, both when it came from
    the cursor and when it came from the redelivery heap (it used to be dropped from
    both, stranded until a restart)."""
    from narad.storage.partition_log import LogClosed

    p = _partition(tmp_path, 2)
    real = p.log.read
    fail = {"left": 1}

    def flaky(off: int):  # type: ignore[no-untyped-def]
        if fail["left"]:
            fail["left"] -= 1
            raise LogClosed(off)
        return real(off)

    p.log.read = flaky  # type: ignore[method-assign]
    assert p.reserve(100.0, 1, 30.0, 1024, 1024) == []  # from the cursor: refused
    d = p.reserve(100.0, 1, 30.0, 1024, 1024)
    assert [x.offset for x in d] == [0]
    assert p.nack(0, d[0].nonce, 100.5)
    fail["left"] = 1
    assert p.reserve(101.0, 1, 30.0, 1024, 1024) == []  # from the redelivery heap: refused
    again = p.reserve(101.0, 2, 30.0, 1024, 1024)
    assert [x.offset for x in again] == [0, 1]


def test_ready_honours_the_in_flight_and_acked_ahead_caps(tmp_path: Path) -> None:
    """What a watch token may be fired for: records a reserve would hand out now."""
    p = _partition(tmp_path, 5)
    assert p.ready(1024, 1024) == 5
    d = p.reserve(100.0, 2, 30.0, 2, 1024)
    assert p.available() == 3 and p.ready(2, 1024) == 0  # in-flight cap full: nothing to wake anyone for
    assert p.ready(3, 1024) == 1
    assert p.ack(1, d[1].nonce, 100.5)  # acked above the frontier (offset 0 still leased)
    assert p.ready(2, 1) == 0  # acked-ahead cap full and the frontier record leased
    assert p.nack(0, d[0].nonce, 101.0)
    assert p.ready(2, 1) == 1  # only the frontier record may go out
    assert [x.offset for x in p.reserve(101.0, 5, 30.0, 2, 1)] == [0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["reserve", "ack", "nack", "expire"]), st.integers(0, 7),
                          st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=40))
def test_reserve_hands_out_the_lowest_deliverable_offsets(tmp_path_factory: pytest.TempPathFactory,
                                                          ops: list[tuple[str, int, int, int]]) -> None:
    """Against a model of the lease rules (no delays, dead letters or retention): every reserve
    hands out exactly the lowest offsets that no live lease covers and that are not acked, as many
    as the in-flight cap leaves room for, only the frontier record while the acked-ahead cap is
    full; whether they come from the cursor or from the redelivery heap (nacks, expiries)."""
    n = 12
    p = _partition(tmp_path_factory.mktemp("p"), n)
    now = 100.0
    live: dict[int, tuple[int, float]] = {}  # the model: offset -> (nonce, expiry)
    acked: set[int] = set()
    for op, arg, k, caps in ops:
        if op == "expire":
            now += 31.0  # every lease taken so far runs out (an ack of it is refused)
            live.clear()
            continue
        if op in ("ack", "nack"):
            if live:
                off = sorted(live)[arg % len(live)]
                nonce = live.pop(off)[0]
                assert (p.ack if op == "ack" else p.nack)(off, nonce, now)
                if op == "ack":
                    acked.add(off)
            continue
        max_in_flight, max_ahead = caps, max(1, caps - 2)
        frontier = -1
        while frontier + 1 in acked:
            frontier += 1
        ahead = [a for a in acked if a > frontier]
        free = [o for o in range(frontier + 1, n) if o not in live and o not in acked]
        if len(ahead) >= max_ahead:
            free = [o for o in free if o == frontier + 1]
        want = free[:max(0, min(k, max_in_flight - len(live)))]
        got = p.reserve(now, k, 30.0, max_in_flight, max_ahead)
        assert [d.offset for d in got] == want
        for d in got:
            live[d.offset] = (d.nonce, now + 30.0)
        now += 0.5


def test_a_commit_that_fails_unexpectedly_answers_its_waiter_and_commits_the_rest_once(tmp_path: Path) -> None:
    """A non-OSError out of a commit (a bug) answers that batch's waiters with an error;
    the batches queued behind it commit and are answered; nothing is committed twice."""
    p = _partition(tmp_path, 0)
    real = p.log.write_commit
    gate = threading.Event()
    calls: list[int] = []

    def flaky(envs: list[bytes]) -> Any:
        calls.append(len(envs))
        if len(calls) == 1:
            gate.wait(5)
            raise ValueError("not an OSError")
        return real(envs)
    p.log.write_commit = flaky  # type: ignore[method-assign]

    async def main() -> None:
        p.loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(2) as ex:
            fa = p.submit([(None, 0, b"A")], ex)
            await asyncio.sleep(0)  # A's cycle starts; B queues behind it
            fb = p.submit([(None, 0, b"B")], ex)
            gate.set()
            with pytest.raises(OSError, match="partition commit failed"):
                await asyncio.wait_for(fa, 10)
            assert (await asyncio.wait_for(fb, 10))[0] == 0
            assert (await asyncio.wait_for(p.submit([(None, 0, b"C")], ex), 10))[0] == 1
    asyncio.run(main())
    assert [p.log.read(o)[3] for o in range(p.log.hwm)] == [b"B", b"C"]
    assert not p._commit_queue


def test_a_frame_that_cannot_be_published_fails_and_stays_hidden(tmp_path: Path) -> None:
    """The frame is synced and read back but publishing it fails: the waiter gets an
    error (a direct produce then gives its records to the WAL), the partition closes,
    and after its clean close the frame stays hidden behind the high watermark, so the
    records are not there twice. (A 202 on such a frame would lose them: the clean
    close hides it.)"""
    p = _partition(tmp_path, 0)

    def broken(*_a: Any) -> None:
        raise RuntimeError("publish broke")
    p.log.publish = broken  # type: ignore[method-assign]

    async def main() -> None:
        p.loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as ex, pytest.raises(OSError, match="publish failed"):
            await asyncio.wait_for(p.submit([(None, 0, b"hidden")], ex), 10)
    asyncio.run(main())
    assert p.closed
    p.log.close()
    again = PartitionLog(tmp_path)
    again.open()
    try:
        assert again.hwm == 0
    finally:
        again.close()


def test_settled_and_extended_leases_do_not_grow_the_expiry_heap(tmp_path: Path) -> None:
    """An extend (and an ack or nack) leaves the lease's old heap entry behind until its
    own expiry, which a 12 h visibility puts far away: the heap is rebuilt from the live
    leases once it holds more than twice their count plus EXPIRY_SLACK, and the rebuilt
    heap still expires the live leases on time (found by a review of issue 14)."""
    from narad.broker.partition import EXPIRY_SLACK

    p = _partition(tmp_path, 3)
    day = 12 * 3600.0
    d = p.reserve(100.0, 3, day, 1024, 1024)
    keep = d[0]
    for i in range(20_000):  # one lease extended over and over (one call may repeat a handle 100 times)
        assert p.extend(keep.offset, keep.nonce, 100.0 + i * 1e-3, day)
    assert len(p._expiry) <= 2 * len(p.leases) + EXPIRY_SLACK + 1
    assert p.nack(d[1].offset, d[1].nonce, 150.0) and p.nack(d[2].offset, d[2].nonce, 150.0)
    for _ in range(5_000):  # lease with 12 h and settle at once: each settle leaves an entry
        got = p.reserve(200.0, 1, day, 1024, 1024)
        assert got and p.nack(got[0].offset, got[0].nonce, 200.0)
    assert len(p._expiry) <= 2 * len(p.leases) + EXPIRY_SLACK + 1
    # The rebuilt heap still tells when each live lease expires, and expiry still works.
    assert p.next_expiry() == min(exp for _n, exp in p.leases.values())
    later = p.reserve(100.0 + 2 * day, 5, 30.0, 1024, 1024)
    assert sorted(x.offset for x in later) == [0, 1, 2]  # every 12 h lease expired and came back
