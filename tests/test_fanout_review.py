"""Hostile review of the fan-out engine (issue 11), in one process: a real broker,
real partition logs and cursor files, a real FSM applied directly. The seams are
named in each test: a partition closed at a chosen moment (as idle eviction or
the open-log cap would), a descriptor taken by a concurrent close (what a pread
of a reused number returns: bytes failing the CRC), a parent whose log cannot be
opened, a cursor file that cannot be replaced (a full disk).

* A log being closed under a read is an error, never a corrupt record skipped
  and counted as lost (the record is intact on disk); the same for a consumer's read.
* A cursor file past the end of the parent log is caught even when the log was
  closed while the file was read.
* A slab is read in steps that give the event loop back between them (one 4 MiB
  slab decoded in one go held a worker's loop for tens of milliseconds).
* A cursor failing on every start does not log its start, or its corrupt file,
  every second.
* An idle delay cursor with a large backlog costs no CPU (psutil over 2 s).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from narad import metrics
from narad.broker import fanout as FO
from narad.broker.broker import Broker
from narad.broker.partition import Partition
from narad.meta import commands as C
from narad.meta.records import TopicRecord
from narad.storage import cursor_file as CF
from narad.storage import partition_log as PL
from tests.fanout_world import World

PAR, PAR_ID = "par", "00000000000000b1"
KID, KID_ID = "kid", "00000000000000b2"
EPOCH = "e2e2e2e2e2e2e2e2"


class _Broker(Broker):
    """A real broker; `close_on_open` closes the parent partition right after handing
    it out once (idle eviction landing between the open and the caller's next step);
    `broken_parent` makes opening the parent fail."""

    close_on_open = False
    broken_parent = False
    opens = 0

    async def partition(self, topic: TopicRecord, index: int) -> Partition:
        if topic.name == PAR:
            self.opens += 1
            if self.broken_parent:
                raise OSError(5, "injected: the parent partition cannot be opened")
        p = await super().partition(topic, index)
        if topic.name == PAR and self.close_on_open:
            self.close_on_open = False
            await self._close_partition((topic.name, index), p, clean=True)
        return p


def _record(name: str, tid: str, partitions: int = 1) -> TopicRecord:
    return TopicRecord(name=name, id=tid, partitions=partitions, retention_ms=0, visibility_timeout_ms=30000,
                       max_in_flight_per_partition=1024, max_acked_ahead_per_partition=1024, created_at=1)


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    monkeypatch.setattr(FO, "RECONCILE_EVERY", 0.05)
    monkeypatch.setattr(FO, "RETRY_BACKOFF", 0.05)
    w = World(tmp_path)
    w.apply(C.CreateTopic(_record(PAR, PAR_ID)))
    w.apply(C.CreateTopic(_record(KID, KID_ID)))
    try:
        yield w
    finally:
        w.close()


def _attach(w: World, offsets: list[int] | None = None) -> None:
    w.apply(C.AttachChildCas(PAR, PAR_ID, KID, KID_ID, 0, EPOCH, offsets or [0]))


def _spec(start: int = 0) -> FO.LinkSpec:
    return FO.LinkSpec(PAR, PAR_ID, 0, KID, KID_ID, EPOCH, 0, start)


def _cursor_file(w: World) -> CF.CursorFile:
    return CF.CursorFile(FO.partition_dir(w.tmp / "data", PAR, PAR_ID, 0), KID)


async def _until(cond: Any, timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _dropped() -> float:
    return float(metrics.get().fanout_dropped.labels(PAR, KID).value)


def test_a_log_closed_under_a_read_is_an_error_not_a_record_lost(world: World, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """The eviction's I/O thread closes the log's descriptors while the loop reads
    it: the pread of a reused number gives bytes that fail the CRC. The record is
    intact on disk; counting it lost and moving the cursor past it loses a copy."""
    async def main() -> None:
        b = await world.broker(_Broker, linger_ms=0)
        try:
            await b.commit_local(PAR, PAR_ID, 0, [(None, 0, f"r{i}".encode()) for i in range(10)])
            p = await b.partition(world.topic(PAR), 0)

            def raced(self: PL.PartitionLog, seg: Any, pos: int, base: int) -> Any:
                self._close(True)  # the close running on its thread right now
                raise PL.CorruptRecord(base)  # what a read of the reused descriptor yields

            # The log level: the read that raced a close says so.
            p.log._cache.clear()
            p.log._last_frame = None
            monkeypatch.setattr(PL.PartitionLog, "_read_frame", raced)
            with pytest.raises(PL.LogClosed):
                p.log.read_batch(9, 100, 1 << 20)
            monkeypatch.undo()
            await b._close_partition((PAR, 0), p, clean=True)
            # The same for a consumer's read (a CorruptRecord there settles the message as unreadable).
            p = await b.partition(world.topic(PAR), 0)
            p.log._cache.clear()
            p.log._last_frame = None
            monkeypatch.setattr(PL.PartitionLog, "_read_frame", raced)
            with pytest.raises(PL.LogClosed):
                p.log.read(3)
            monkeypatch.undo()
            monkeypatch.setattr(FO, "RECONCILE_EVERY", 0.05)
            await b._close_partition((PAR, 0), p, clean=True)

            # The cursor level: a partition that began closing is not read at all (its
            # log is closed on an I/O thread from then on).
            p = await b.partition(world.topic(PAR), 0)
            p.log._cache.clear()
            p.log._last_frame = None
            await p.quiesce()  # the synchronous first step of every close
            monkeypatch.setattr(PL.PartitionLog, "_read_frame", raced)
            c = FO.Cursor(b.fanout, _spec(), _cursor_file(world), None)
            c.next = 9
            before = _dropped()
            assert await c._read(p) is None
            assert _dropped() == before, "an intact record was counted as lost"
            monkeypatch.undo()
        finally:
            await b.close()

    asyncio.run(main())


def test_a_file_past_the_log_end_is_caught_when_the_log_closed_meanwhile(world: World) -> None:
    """A cursor file ahead of the parent log (damage, a restored disk) resumes at the
    log's end, never past records committed later at those offsets; the check held
    only while the log stayed open across the file read."""
    async def main() -> None:
        b = await world.broker(_Broker, linger_ms=0)
        try:
            await b.commit_local(PAR, PAR_ID, 0, [(None, 0, f"r{i}".encode()) for i in range(10)])
            d = FO.partition_dir(world.tmp / "data", PAR, PAR_ID, 0)
            CF.CursorFile(d, KID).anchor(EPOCH, 50)  # ahead of the 10 records the log holds
            b.close_on_open = True  # the log closes right after the cursor opened it
            c = FO.Cursor(b.fanout, _spec(), CF.CursorFile(d, KID), None)
            try:
                await c._position()
            finally:
                c.file.close()
            assert c.next == 10, f"resumed at {c.next}, past the end of the parent log (10)"
        finally:
            await b.close()

    asyncio.run(main())


def test_a_slab_is_read_in_steps_that_yield_the_loop(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A catching-up cursor reads its slab (up to 4,096 records / 4 MiB) in steps,
    giving the event loop back between them; every record still arrives once."""
    calls: list[int] = []
    real = PL.PartitionLog.read_batch

    def counting(self: PL.PartitionLog, offset: int, max_records: int, max_bytes: int,
                 max_committed_ms: int | None = None) -> PL.BatchRead:
        out = real(self, offset, max_records, max_bytes, max_committed_ms)
        if self.dir.parent.name == f"{PAR}@{PAR_ID}":
            calls.append(len(out.records))
        return out

    monkeypatch.setattr(PL.PartitionLog, "read_batch", counting)

    async def main() -> None:
        b = await world.broker(_Broker, linger_ms=0)
        try:
            for _ in range(8):
                await b.commit_local(PAR, PAR_ID, 0, [(None, 0, b"x" * 64) for _ in range(500)])
            ticks = 0
            stop = False

            async def ticker() -> None:
                nonlocal ticks
                while not stop:
                    ticks += 1
                    await asyncio.sleep(0)

            t = asyncio.ensure_future(ticker())
            _attach(world, [0])
            kid = world.topic(KID)
            await _until(lambda: _cursor_file(world).read() == CF.CursorState(EPOCH, 4000), 20,
                         "every record copied")
            stop = True
            await t
            assert (await b.partition(kid, 0)).log.hwm == 4000
            step = getattr(FO, "READ_STEP_RECORDS", 512)
            assert max(calls) <= step, f"one read took {max(calls)} records off the loop at once"
            assert ticks > len(calls), "the loop ran nothing else while the slabs were read"
        finally:
            await b.close()

    asyncio.run(main())


def test_a_cursor_failing_at_every_start_does_not_log_each_start(world: World,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        b = await world.broker(_Broker, linger_ms=0)
        try:
            b.broken_parent = True
            caplog.set_level(logging.INFO, logger="narad.broker.fanout")
            _attach(world, [0])
            await _until(lambda: b.opens >= 12, 20, "a dozen restarts of the failing cursor")
            starts = [r for r in caplog.records if r.getMessage() == "fan-out cursor started"
                      and r.levelno >= logging.INFO]
            fails = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert len(starts) <= 2, f"{len(starts)} start lines for one failing cursor"
            assert 1 <= len(fails) <= 2
        finally:
            await b.close()

    asyncio.run(main())


def test_an_idle_delay_cursor_with_a_large_backlog_costs_no_cpu(world: World) -> None:
    """The delay gate stops at the first record not due and sleeps until it is: an idle
    delay cursor costs O(1) whatever its backlog (measured: the whole process over 2 s;
    a cursor re-reading its backlog would keep a core busy, a 1 ms re-read loop ~7%)."""
    import psutil

    async def main() -> None:
        b = await world.broker(_Broker, linger_ms=0)
        try:
            for _ in range(10):
                await b.commit_local(PAR, PAR_ID, 0, [(None, 0, b"x" * 100) for _ in range(1000)])
            world.apply(C.AttachChildCas(PAR, PAR_ID, KID, KID_ID, 3_600_000, EPOCH, [0]))
            await _until(lambda: _cursor_file(world).read() is not None, 10, "the delay cursor anchored")
            c = b.fanout.cursors[(PAR, 0, KID)]
            await _until(lambda: c.next == 0 and c._waiter is None, 10, "the delay cursor parked")
            proc = psutil.Process()
            t0, m0 = proc.cpu_times(), time.monotonic()
            await asyncio.sleep(2.0)  # the measuring window (nothing is awaited through it)
            t1, m1 = proc.cpu_times(), time.monotonic()
            busy = (t1.user + t1.system - t0.user - t0.system) / (m1 - m0)
            assert busy < 0.05, f"an idle delay cursor kept the process {busy:.0%} busy"
            assert (await b.partition(world.topic(KID), 0)).log.hwm == 0, "a record copied before it was due"
        finally:
            await b.close()

    asyncio.run(main())


def test_a_corrupt_cursor_file_that_cannot_be_replaced_is_logged_twice_a_minute(
        world: World, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A corrupt file whose re-anchor fails (a full disk) fails the cursor at every
    start: the error naming the corrupt file came once a second, per cursor."""
    anchors = 0

    def full(self: CF.CursorFile, epoch: str, next_offset: int) -> None:
        nonlocal anchors
        anchors += 1
        raise OSError(28, "injected: no space left on device")

    async def main() -> None:
        b = await world.broker(_Broker, linger_ms=0)
        try:
            p = await b.partition(world.topic(PAR), 0)  # its directory exists from the open on
            (p.log.dir / CF.file_name(KID)).write_bytes(b"x" * CF.SIZE)  # fails its checks
            monkeypatch.setattr(CF.CursorFile, "anchor", full)
            caplog.set_level(logging.INFO, logger="narad.broker.fanout")
            _attach(world, [0])
            await _until(lambda: anchors >= 10, 20, "ten failed re-anchors")
            corrupt = [r for r in caplog.records if "cursor file is corrupt" in r.getMessage()]
            assert len(corrupt) <= 2, f"{len(corrupt)} lines for one corrupt file"
        finally:
            await b.close()

    asyncio.run(main())


def test_a_run_of_unreadable_records_is_skipped_without_waiting_for_a_commit(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged frame is skipped whole (counted lost), read from disk once: each of its
    offsets re-read and re-checked the whole frame, on the event loop, and a whole
    damaged run went in one call. A step that met only unreadable records reads on
    at once while committed records follow (it waited for a commit or the 1 s long poll)."""
    monkeypatch.setattr(FO, "LONG_POLL", 120.0)  # no commit comes: only the long poll would end a wait
    frame_reads = 0
    real = PL.PartitionLog._read_frame

    def counting(self: PL.PartitionLog, seg: Any, pos: int, base: int) -> Any:
        nonlocal frame_reads
        if self.dir.parent.name == f"{PAR}@{PAR_ID}":
            frame_reads += 1
        return real(self, seg, pos, base)

    monkeypatch.setattr(PL.PartitionLog, "_read_frame", counting)

    async def main() -> None:
        nonlocal frame_reads
        b = await world.broker(_Broker, linger_ms=0)
        try:
            await b.commit_local(PAR, PAR_ID, 0, [(None, 0, b"d" * 32) for _ in range(600)])
            await b.commit_local(PAR, PAR_ID, 0, [(None, 0, f"ok{i}".encode()) for i in range(5)])
            p = await b.partition(world.topic(PAR), 0)
            # Sealed (as retention's roll does): its frames are indexed from their headers at
            # the first read, the damaged one included; its records fail the frame's CRC.
            assert p.log.roll_idle_active(1, int(time.time() * 1000) + 10**9)
            seg = p.log.segments[0].path
            await b._close_partition((PAR, 0), p, clean=True)
            data = bytearray(seg.read_bytes())
            data[100] ^= 0xFF  # inside the first frame's records: its CRC fails
            seg.write_bytes(bytes(data))
            before = _dropped()
            frame_reads = 0
            _attach(world, [0])
            await _until(lambda: (_cursor_file(world).read() or CF.CursorState("", 0)).next_offset == 605, 20,
                         "the cursor past the damaged frame and the records after it")
            assert _dropped() - before == 600
            assert frame_reads <= 4, f"{frame_reads} frame reads from disk to skip one damaged frame"
            kid = await b.partition(world.topic(KID), 0)
            assert [kid.log.read(i)[3] for i in range(kid.log.hwm)] == [f"ok{i}".encode() for i in range(5)]
        finally:
            await b.close()

    asyncio.run(main())
