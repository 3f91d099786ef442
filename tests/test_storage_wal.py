"""Ingress WAL on real files: group commit under asyncio, replay from the
checkpoint after reopen, torn tails, the failure latch (write and fsync
faults through the fileio seam), checkpoint persistence, reclaim/rotation,
segment recycling (spares, stale frames, seeded CRCs, earlier builds' frames)
and the record encoding."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from narad.storage import fileio
from narad.storage import wal as W
from narad.storage.wal import Entry, IngressWAL, WALFailed

INC = bytes.fromhex("0123456789abcdef")


@pytest.fixture(autouse=True)
def _reset_seam() -> Iterator[None]:
    yield
    fileio.reset()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    ex = ThreadPoolExecutor(max_workers=4)
    yield ex
    ex.shutdown(wait=True)


def entry(i: int) -> Entry:
    return Entry(f"topic-{i % 3}", INC, i % 5, 1_700_000_000_000 + i, i % 16,
                 None if i % 4 == 0 else f"key-{i}".encode(), f"payload {i}".encode() * (1 + i % 4),
                 placed=i % 3 == 1)


def same(a: Entry, b: Entry) -> bool:
    return (a.topic, a.incarnation, a.partition, a.ts_ms, a.flags, a.key, a.payload, a.placed) == (
        b.topic, b.incarnation, b.partition, b.ts_ms, b.flags, b.key, b.payload, b.placed)


def opened(d: Path, pool: ThreadPoolExecutor, **kw: int) -> IngressWAL:
    w = IngressWAL(d, pool, **kw)
    w.open()
    return w


def count_syncs() -> list[int]:
    real = fileio.fdatasync
    n = [0]

    def counting(fd: int) -> None:
        n[0] += 1
        time.sleep(0.002)  # a disk that takes a moment: appends pile up meanwhile
        real(fd)

    fileio.fdatasync = counting
    return n


async def append_one_by_one(w: IngressWAL, ids: range) -> None:
    for i in ids:
        await w.append([entry(i)])


def segments(d: Path) -> list[str]:
    """Segment names, fresh (.wal) and recycled (.rwal), in seq order."""
    return [p.name for _, p in W._segment_files(d)]


# ---- group commit -------------------------------------------------------------------------------


def test_concurrent_appends_share_syncs(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    w = opened(tmp_path, pool)
    syncs = count_syncs()
    seen: list[int] = []
    w.on_durable = lambda es: seen.extend(e.seq for e in es)

    async def producer(p: int) -> list[int]:
        out = []
        for j in range(5):
            e = entry(p * 5 + j)
            await w.append([e])
            assert w.durable_seq >= e.seq
            out.append(e.seq)
        return out

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(producer(p) for p in range(40)))

    per_producer = asyncio.run(main())
    assert sorted(s for seqs in per_producer for s in seqs) == list(range(1, 201))
    for seqs in per_producer:
        assert seqs == sorted(seqs)
    assert seen == list(range(1, 201))  # announced once each, in order
    assert w.durable_seq == 200 and w.next_seq == 201
    assert 0 < syncs[0] < 100, syncs[0]
    w.close()
    again = opened(tmp_path, pool)
    assert [e.seq for e in again.replay()] == list(range(1, 201))
    again.close()


def test_one_batch_of_many_entries(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    w = opened(tmp_path, pool)
    syncs = count_syncs()
    batch = [entry(i) for i in range(50)]

    async def main() -> None:
        await w.append(batch)

    asyncio.run(main())
    assert [e.seq for e in batch] == list(range(1, 51))
    assert syncs[0] == 1
    w.close()
    again = opened(tmp_path, pool)
    got = list(again.replay())
    assert len(got) == 50 and all(same(a, b) for a, b in zip(got, batch, strict=True))
    again.close()


def test_empty_append_resolves(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    w = opened(tmp_path, pool)

    async def main() -> None:
        await asyncio.wait_for(w.append([]), 2)
        f1 = w.append([entry(1)])
        f2 = w.append([])
        await asyncio.wait_for(asyncio.gather(f1, f2), 2)

    asyncio.run(main())
    assert w.next_seq == 2
    w.close()


def test_oversized_record_stages_nothing(tmp_path: Path, pool: ThreadPoolExecutor,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(W, "MAX_RECORD", 200)
    w = opened(tmp_path, pool)
    big = Entry("t", INC, 0, 1, 0, None, b"x" * 300)

    async def main() -> None:
        await w.append([entry(1)])
        with pytest.raises(ValueError):
            w.append([entry(2), big])
        await w.append([entry(3)])

    asyncio.run(main())
    assert w.next_seq == 3
    w.close()
    again = opened(tmp_path, pool)
    got = list(again.replay())
    assert [e.seq for e in got] == [1, 2]
    assert same(got[1], entry(3))
    assert again.next_seq == 3
    again.close()


def test_failing_on_durable_callback_does_not_strand_waiters(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    w = opened(tmp_path, pool)

    def boom(_: list[Entry]) -> None:
        raise RuntimeError("listener bug")

    w.on_durable = boom

    async def main() -> None:
        f1 = w.append([entry(1)])
        await asyncio.sleep(0)
        f2 = w.append([entry(2)])  # staged while the first sync runs
        await asyncio.wait_for(asyncio.gather(f1, f2), 2)

    asyncio.run(main())
    assert w.durable_seq == 2
    w.close()


# ---- reopen and replay ---------------------------------------------------------------------------------


def test_replay_from_checkpoint_after_reopen(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    w = opened(tmp_path, pool)
    asyncio.run(append_one_by_one(w, range(1, 31)))

    async def ckpt() -> None:
        w.set_checkpoint(11)
        w.set_checkpoint(5)  # never moves back

    asyncio.run(ckpt())
    assert w.checkpoint_seq == 11 and w.backlog == 20
    w.close()
    again = opened(tmp_path, pool)
    assert again.checkpoint_seq == 11 and again.next_seq == 31
    got = list(again.replay())
    assert [e.seq for e in got] == list(range(11, 31))
    assert all(same(e, entry(e.seq)) for e in got)
    # Appends after a reopen continue the same segment at the right place.
    asyncio.run(append_one_by_one(again, range(31, 41)))
    again.close()
    third = opened(tmp_path, pool)
    got = list(third.replay())
    assert [e.seq for e in got] == list(range(11, 41))
    assert all(same(e, entry(e.seq)) for e in got)
    assert len(segments(tmp_path)) == 1
    third.close()


def test_checkpoint_is_synced_and_survives_reopen(tmp_path: Path, pool: ThreadPoolExecutor,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(W, "CHECKPOINT_SYNC_DELAY", 0.01)
    w = opened(tmp_path, pool)
    syncs = count_syncs()

    async def main() -> None:
        await append_one_by_one(w, range(1, 6))
        before = syncs[0]
        w.set_checkpoint(4)
        await asyncio.sleep(0.2)
        assert syncs[0] == before + 1  # the delayed checkpoint fsync ran

    asyncio.run(main())
    assert (tmp_path / "checkpoint").read_bytes() == (4).to_bytes(8, "big")
    w.close()
    again = opened(tmp_path, pool)
    assert again.checkpoint_seq == 4
    assert [e.seq for e in again.replay()] == [4, 5]
    again.close()


def test_checkpoint_ahead_of_the_log_keeps_appends_replayable(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    w = opened(tmp_path, pool)
    asyncio.run(append_one_by_one(w, range(1, 6)))
    w.close()
    (tmp_path / "checkpoint").write_bytes((9).to_bytes(8, "big"))  # e.g. the log's tail was lost
    again = opened(tmp_path, pool)
    assert again.next_seq == 9
    asyncio.run(append_one_by_one(again, range(9, 12)))
    again.close()
    third = opened(tmp_path, pool)
    assert [e.seq for e in third.replay()] == [9, 10, 11]
    assert third.next_seq == 12
    third.close()


@pytest.mark.parametrize("damage", ["truncate", "zeroes", "garbage", "bad_crc"])
def test_torn_tail_is_cut_on_open(tmp_path: Path, pool: ThreadPoolExecutor, damage: str) -> None:
    w = opened(tmp_path, pool)
    asyncio.run(append_one_by_one(w, range(1, 11)))
    w.close()
    seg = tmp_path / segments(tmp_path)[-1]
    size = seg.stat().st_size
    last = len(entry(10).encode()) + W.FRAME_HEADER
    if damage == "truncate":
        os.truncate(seg, size - 7)
        keep, good = 9, size - last
    elif damage == "bad_crc":
        with open(seg, "r+b") as fh:
            fh.seek(size - 1)
            b = fh.read(1)
            fh.seek(size - 1)
            fh.write(bytes([b[0] ^ 1]))
        keep, good = 9, size - last
    else:
        with open(seg, "ab") as fh:
            fh.write(b"\0" * 100 if damage == "zeroes" else W.MAGIC + os.urandom(60))
        keep, good = 10, size
    again = opened(tmp_path, pool)
    assert seg.stat().st_size == good
    assert again.next_seq == keep + 1 and again.durable_seq == keep
    assert [e.seq for e in again.replay()] == list(range(1, keep + 1))
    asyncio.run(append_one_by_one(again, range(keep + 1, keep + 4)))
    again.close()
    third = opened(tmp_path, pool)
    got = list(third.replay())
    assert [e.seq for e in got] == list(range(1, keep + 4))
    assert all(same(e, entry(e.seq)) for e in got)
    third.close()


# ---- the failure latch ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["write", "partial_write", "fdatasync"])
def test_failure_fails_the_batch_and_latches(tmp_path: Path, pool: ThreadPoolExecutor, fault: str) -> None:
    w = opened(tmp_path, pool)
    asyncio.run(append_one_by_one(w, range(1, 6)))  # durable before the failure
    gate = threading.Event()
    real_write, real_sync = fileio.write, fileio.fdatasync

    def bad_write(fd: int, data: bytes) -> int:
        gate.wait(2)
        if fault == "partial_write":
            return real_write(fd, bytes(data[: len(data) // 2]))  # then the retry of the rest fails
        raise OSError(errno.ENOSPC, "No space left on device")

    def failing_write(fd: int, data: bytes) -> int:
        fileio.write = lambda fd, data: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error"))
        return bad_write(fd, data)

    def bad_sync(fd: int) -> None:
        gate.wait(2)
        raise OSError(errno.EIO, "Input/output error")

    if fault == "fdatasync":
        fileio.fdatasync = bad_sync
    else:
        fileio.write = failing_write

    async def main() -> list[BaseException | None]:
        first = [w.append([entry(i)]) for i in range(6, 9)]  # one group
        await asyncio.sleep(0.05)
        second = [w.append([entry(i)]) for i in range(9, 11)]  # staged behind it
        gate.set()
        res = await asyncio.gather(*first, *second, return_exceptions=True)
        with pytest.raises(WALFailed):
            w.append([entry(11)])
        return res  # type: ignore[return-value]

    results = asyncio.run(main())
    assert all(isinstance(r, WALFailed) for r in results), results
    assert w.failed is not None
    assert w.durable_seq == 5
    fileio.write, fileio.fdatasync = real_write, real_sync
    w.close()
    fileio.reset()
    again = opened(tmp_path, pool)
    got = [e.seq for e in again.replay()]
    # Everything acked before the failure is back; of the failed batch at most a
    # prefix (a 500 may still be delivered), never a gap.
    assert got[:5] == [1, 2, 3, 4, 5]
    assert got == list(range(1, len(got) + 1)) and len(got) <= 8
    if fault == "write":  # nothing of the batch reached the file
        assert got == [1, 2, 3, 4, 5]
    assert again.failed is None
    n = again.next_seq
    asyncio.run(append_one_by_one(again, range(n, n + 2)))
    again.close()
    third = opened(tmp_path, pool)
    assert [e.seq for e in third.replay()] == list(range(1, n + 2))
    third.close()


# ---- checkpoint, reclaim, rotation ----------------------------------------------------------------------------


def test_reclaim_deletes_segments_below_the_checkpoint(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    w = opened(tmp_path, pool, segment_bytes=300)
    asyncio.run(append_one_by_one(w, range(1, 41)))
    firsts = [int(n.split('.')[0]) for n in segments(tmp_path)]
    assert len(firsts) >= 5 and firsts[0] == 1
    cut = firsts[3] + 1  # inside the fourth segment

    async def ckpt() -> None:
        w.set_checkpoint(cut)

    asyncio.run(ckpt())
    assert w.reclaim() == 3
    assert [int(n.split('.')[0]) for n in segments(tmp_path)] == firsts[3:]
    assert w.reclaim() == 0
    w.close()
    again = opened(tmp_path, pool, segment_bytes=300)
    got = list(again.replay())
    assert [e.seq for e in got] == list(range(cut, 41))
    assert all(same(e, entry(e.seq)) for e in got)
    again.close()


def test_reclaim_after_checkpoint_sync(tmp_path: Path, pool: ThreadPoolExecutor,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(W, "CHECKPOINT_SYNC_DELAY", 0.01)
    w = opened(tmp_path, pool, segment_bytes=300)

    async def main() -> None:
        await append_one_by_one(w, range(1, 31))
        w.set_checkpoint(31)
        await asyncio.sleep(0.2)

    asyncio.run(main())
    assert len(segments(tmp_path)) == 1
    w.close()


def test_rotates_a_dispatched_active_segment(tmp_path: Path, pool: ThreadPoolExecutor,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(W, "ROTATE_DISPATCHED_BYTES", 500)
    w = opened(tmp_path, pool)
    asyncio.run(append_one_by_one(w, range(1, 21)))
    assert segments(tmp_path) == [f"{1:020d}.wal"]

    async def ckpt(seq: int) -> None:
        w.set_checkpoint(seq)

    asyncio.run(ckpt(20))  # one record still owed: nothing rotates
    assert w.reclaim() == 0
    asyncio.run(ckpt(21))
    assert w.reclaim() == 1
    assert segments(tmp_path) == [f"{21:020d}.wal"]
    assert w.reclaim() == 0  # the new active segment is small
    asyncio.run(append_one_by_one(w, range(21, 24)))
    w.close()
    again = opened(tmp_path, pool)
    assert again.checkpoint_seq == 21 and again.next_seq == 24
    assert [e.seq for e in again.replay()] == [21, 22, 23]
    again.close()


def test_failed_rotation_latches_and_keeps_the_records(tmp_path: Path, pool: ThreadPoolExecutor,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(W, "ROTATE_DISPATCHED_BYTES", 100)
    w = opened(tmp_path, pool)
    asyncio.run(append_one_by_one(w, range(1, 11)))

    def no_dir_sync(path: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fileio, "fsync_dir", no_dir_sync)

    async def main() -> None:
        w.set_checkpoint(11)
        assert w.reclaim() == 0
        with pytest.raises(WALFailed):
            w.append([entry(11)])

    asyncio.run(main())
    monkeypatch.undo()
    assert w.failed is not None and segments(tmp_path) == [f"{1:020d}.wal"]
    w.close()
    again = opened(tmp_path, pool)
    assert again.checkpoint_seq == 11 and again.next_seq == 11
    asyncio.run(append_one_by_one(again, range(11, 14)))
    again.close()
    third = opened(tmp_path, pool)
    assert [e.seq for e in third.replay()] == [11, 12, 13]
    third.close()


def test_rotated_and_empty_segment_reopens_at_next_seq(tmp_path: Path, pool: ThreadPoolExecutor,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(W, "ROTATE_DISPATCHED_BYTES", 100)
    w = opened(tmp_path, pool)
    asyncio.run(append_one_by_one(w, range(1, 11)))

    async def ckpt() -> None:
        w.set_checkpoint(11)

    asyncio.run(ckpt())
    assert w.reclaim() == 1
    w.close()
    (tmp_path / "checkpoint").write_bytes((3).to_bytes(8, "big"))  # the checkpoint sync was lost
    again = opened(tmp_path, pool)
    assert again.next_seq == 11 and list(again.replay()) == []
    asyncio.run(append_one_by_one(again, range(11, 13)))
    again.close()
    third = opened(tmp_path, pool)
    assert [e.seq for e in third.replay()] == [11, 12]
    third.close()


# ---- record encoding ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [None, b"", b"k", b"\x00\xff\x80binary\n", "ключ".encode()])
def test_entry_round_trip(key: bytes | None) -> None:
    e = Entry("tópico/ü", INC, 7, 1_712_345_678_901, 6, key, b"\x00payload\xff")
    data = e.encode()
    d = Entry.decode(data, 42)
    assert d.seq == 42 and same(d, e)
    assert (d.key is None) == (key is None)
    assert Entry.decode(memoryview(data), 1).key == key
    empty = Entry("t", INC, 0, 0, 0, key, b"")
    assert Entry.decode(empty.encode(), 1).payload == b""
    # A record the node placed (``Entry.placed``) keeps the mark through the WAL, outside its flags.
    placed = Entry("t", INC, 3, 5, 15, key, b"x", placed=True)
    back = Entry.decode(placed.encode(), 2)
    assert back.placed and back.flags == 15 and not Entry.decode(empty.encode(), 1).placed


def test_entry_rejects_unknown_format() -> None:
    data = bytearray(entry(1).encode())
    data[0] = 9
    with pytest.raises(ValueError):
        Entry.decode(bytes(data), 1)


def test_keys_survive_the_wal(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    keys: list[bytes | None] = [None, b"", b"\x00\x01", b"plain"]
    w = opened(tmp_path, pool)

    async def main() -> None:
        await w.append([Entry("t", INC, 0, 1, 0, k, b"p") for k in keys])

    asyncio.run(main())
    w.close()
    again = opened(tmp_path, pool)
    assert [e.key for e in again.replay()] == keys
    again.close()


# ---- a client's payload may hold a frame: never replay it ----------------------------------------

def _with_forged_payload(tmp_path: Path, pool: ThreadPoolExecutor) -> tuple[Path, int]:
    """Two records; the second's payload holds a whole WAL frame (seq 3, another topic)
    that a client forged, CRC and all. Returns the segment and where the second ends."""
    from crc32c import crc32c

    async def main() -> None:
        w = IngressWAL(tmp_path, pool)
        w.open()
        await w.append([Entry("t", INC, 0, 1, 0, None, b"honest")])
        forged = Entry("victim", b"\1" * 16, 0, 1, 0, None, b"FORGED").encode()
        # the strongest forger: it knows the segment's salt (segment 1)
        frame = W.FRAME.pack(W.MAGIC, len(forged), 3, crc32c(forged, W.salt(1))) + forged
        await w.append([Entry("t", INC, 0, 1, 0, None, b"x" * 4000 + frame + b"y" * 4000)])
        w.close()

    asyncio.run(main())
    seg = sorted(tmp_path.glob("*.wal"))[-1]
    return seg, seg.stat().st_size


def test_a_torn_record_holding_a_forged_frame_is_cut_not_replayed(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    seg, size = _with_forged_payload(tmp_path, pool)
    os.truncate(seg, size - 2000)  # kill -9 mid-write: the tear falls after the embedded frame
    w = IngressWAL(tmp_path, pool)
    w.open()
    got = [(e.seq, e.topic, e.payload) for e in w.replay()]
    w.close()
    assert got == [(1, "t", b"honest")]


def test_a_damaged_record_holding_a_forged_frame_is_skipped_whole(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    _with_forged_payload(tmp_path, pool)

    async def third() -> None:
        w = IngressWAL(tmp_path, pool)
        w.open()
        await w.append([Entry("t", INC, 0, 1, 0, None, b"after")])
        w.close()

    asyncio.run(third())
    segs = sorted(tmp_path.glob("*.wal"))
    data = bytearray(segs[0].read_bytes())
    data[100] ^= 0xFF  # a bit flip in the second record's payload, before the embedded frame
    segs[0].write_bytes(bytes(data))
    w = IngressWAL(tmp_path, pool)
    w.open()
    got = [(e.topic, e.payload) for e in w.replay()]
    w.close()
    assert ("victim", b"FORGED") not in got
    assert got[0] == ("t", b"honest") and got[-1] == ("t", b"after"), got


def test_the_syncer_thread_runs_sched_batch_so_its_wakeups_do_not_preempt_the_loop(
        tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    """An fdatasync returning on the syncer must not throw the event loop off its
    core (SCHED_BATCH threads do not preempt on wake-up); the loop itself stays
    SCHED_OTHER."""

    async def go() -> None:
        w = opened(tmp_path / "w", pool)
        try:
            await w.append([entry(1)])
            syncers = [t for t in threading.enumerate() if t.name == w._syncer.name]
            assert len(syncers) == 1 and syncers[0].native_id is not None
            assert os.sched_getscheduler(syncers[0].native_id) == os.SCHED_BATCH
            assert os.sched_getscheduler(0) == os.SCHED_OTHER
        finally:
            w.close()

    asyncio.run(go())


def test_dispatched_segments_are_unlinked_off_the_event_loop(tmp_path: Path, pool: ThreadPoolExecutor,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The reclaim after a checkpoint sync removes segment files on an I/O thread:
    unlinking a 64 MiB segment took 20 ms on this VM, a stall of every connection."""
    monkeypatch.setattr(W, "CHECKPOINT_SYNC_DELAY", 0.01)
    unlinked: list[tuple[str, str]] = []
    real = Path.unlink

    def recording(self: Path, missing_ok: bool = False) -> None:
        if self.suffix == ".wal":
            unlinked.append((self.name, threading.current_thread().name))
        real(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", recording)
    w = opened(tmp_path, pool, segment_bytes=300)

    async def main() -> str:
        await append_one_by_one(w, range(1, 31))
        w.set_checkpoint(31)
        deadline = time.monotonic() + 10
        while len(segments(tmp_path)) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return threading.current_thread().name

    loop_thread = asyncio.run(main())
    assert len(segments(tmp_path)) == 1
    assert unlinked and all(t != loop_thread for _, t in unlinked), unlinked
    w.close()


# ---- segment recycling ------------------------------------------------------------------------------------


def spares(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("*.spare"))


async def _ckpt(w: IngressWAL, seq: int) -> None:
    w.set_checkpoint(seq)


def replays(d: Path, pool: ThreadPoolExecutor, seqs: range, **kw: int) -> None:
    """A reopen of `d` replays exactly `seqs`, each the record appended as ``entry(seq)``."""
    w = opened(d, pool, **kw)
    try:
        got = list(w.replay())
        assert [e.seq for e in got] == list(seqs) and all(same(e, entry(e.seq)) for e in got)
    finally:
        w.close()


def test_dispatched_segments_are_recycled_and_their_stale_frames_never_replay(
        tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    """Dispatched segments become spares (at most SPARE_SEGMENTS), later segments are
    renamed from them and overwrite their frames; a reopen cuts the stale frames after
    the tail and replays exactly the records from the checkpoint, nothing stale."""
    w = opened(tmp_path, pool, segment_bytes=2000)
    asyncio.run(append_one_by_one(w, range(1, 121)))
    assert len(segments(tmp_path)) >= 4
    asyncio.run(_ckpt(w, 121))
    assert w.reclaim() >= 3
    assert len(spares(tmp_path)) == W.SPARE_SEGMENTS
    assert all((tmp_path / n).stat().st_size >= 2000 for n in spares(tmp_path))
    # Appends fill the active segment, then the next ones reuse the spares' files,
    # which are longer than what the last one gets.
    asyncio.run(append_one_by_one(w, range(121, 151)))
    assert w.recycled >= 1
    active = tmp_path / segments(tmp_path)[-1]
    assert active.stat().st_size > w._size  # stale frames of the file's earlier life lie after the tail
    w.close()
    again = opened(tmp_path, pool, segment_bytes=2000)
    assert active.stat().st_size == again._size  # cut at open
    got = list(again.replay())
    assert [e.seq for e in got] == list(range(121, 151)) and all(same(e, entry(e.seq)) for e in got)
    asyncio.run(append_one_by_one(again, range(151, 160)))
    again.close()
    replays(tmp_path, pool, range(121, 160), segment_bytes=2000)


def test_a_segment_left_for_the_next_is_cut_to_its_tail(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    """Only the active segment may hold stale frames: a recycled segment is cut to its
    tail when the next one starts, so replay never scans an earlier life."""
    w = opened(tmp_path, pool, segment_bytes=3000)
    big = [Entry("t", INC, 0, 1, 0, None, b"b" * 1400) for _ in range(6)]

    async def main() -> None:
        for e in big:
            await w.append([e])
        w.set_checkpoint(w.next_seq)
        w.reclaim()
        assert spares(tmp_path)
        for i in range(20):  # small frames: each recycled file is longer than what it gets
            await w.append([Entry("t", INC, 0, 1, 0, None, b"s%d" % i * 40)])

    asyncio.run(main())
    assert w.recycled >= 1
    w.close()
    segs = [tmp_path / n for n in segments(tmp_path)]
    for seg in segs[:-1]:
        data = seg.read_bytes()
        pos = 0
        while pos < len(data):  # every frame of a left segment is of its own life, to the end
            magic, length, seq, _crc = W.FRAME.unpack_from(data, pos)
            assert magic == W.MAGIC and seq >= int(seg.name.split('.')[0])
            pos += W.FRAME_HEADER + length
        assert pos == len(data)


def test_spares_above_a_lost_checkpoint_are_not_reused(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    """A spare is reused only by a segment that starts at or above its bound (every seq
    in it is below the bound). With the checkpoint lost (seqs may start low again) the
    spares that do not qualify are removed at open."""
    w = opened(tmp_path, pool, segment_bytes=300)
    asyncio.run(append_one_by_one(w, range(1, 31)))
    asyncio.run(_ckpt(w, 31))
    w.reclaim()
    assert len(spares(tmp_path)) == W.SPARE_SEGMENTS
    w.close()
    for seg in segments(tmp_path):
        (tmp_path / seg).unlink()
    (tmp_path / "checkpoint").write_bytes((1).to_bytes(8, "big"))
    again = opened(tmp_path, pool, segment_bytes=300)
    assert spares(tmp_path) == [] and again.next_seq == 1
    asyncio.run(append_one_by_one(again, range(1, 12)))
    assert again.recycled == 0
    again.close()
    replays(tmp_path, pool, range(1, 12), segment_bytes=300)


def test_a_frame_sealed_for_another_segment_never_verifies(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    """After damage, the scan resumes at the next frame that verifies: a frame whose CRC
    was sealed with another segment's salt (a stale frame of a recycled file, with a seq
    that would fit) is not one, while a frame sealed for this segment is."""
    from crc32c import crc32c

    w = opened(tmp_path, pool)
    asyncio.run(append_one_by_one(w, range(1, 6)))
    w.close()
    seg = tmp_path / segments(tmp_path)[-1]

    def frame(seq: int, seed: int) -> bytes:
        body = entry(seq).encode()
        return W.FRAME.pack(W.MAGIC, len(body), seq, crc32c(body, seed)) + body

    damaged = bytearray(frame(6, W.salt(1)))
    damaged[-1] ^= 0xFF
    with open(seg, "ab") as fh:
        fh.write(bytes(damaged) + frame(7, W.salt(99)) + frame(8, W.salt(1)))
    again = opened(tmp_path, pool)
    assert [e.seq for e in again.replay()] == [1, 2, 3, 4, 5, 8]
    again.close()


def test_segments_of_an_earlier_build_are_read_continued_and_recycled_safely(
        tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    """Frames of builds before recycling ('NWAL', unseeded CRC) are replayed after an
    upgrade and the segment is continued with this build's frames; once dispatched it
    may be recycled, and its old frames are never read from the recycled file (a
    recycled segment is read strictly: this build's frames, from the start)."""
    from crc32c import crc32c

    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / W._seg_name(1), "wb") as fh:
        for seq in range(1, 6):
            body = entry(seq).encode()
            fh.write(W.FRAME.pack(W.LEGACY_MAGIC, len(body), seq, crc32c(body)) + body)
    w = opened(tmp_path, pool, segment_bytes=1000)
    assert [e.seq for e in w.replay()] == [1, 2, 3, 4, 5] and w.next_seq == 6
    asyncio.run(append_one_by_one(w, range(6, 9)))
    w.close()
    again = opened(tmp_path, pool, segment_bytes=1000)
    got = list(again.replay())
    assert [e.seq for e in got] == list(range(1, 9)) and all(same(e, entry(e.seq)) for e in got)
    asyncio.run(append_one_by_one(again, range(9, 40)))
    asyncio.run(_ckpt(again, 40))
    again.reclaim()
    assert W._seg_name(1) not in segments(tmp_path)
    asyncio.run(append_one_by_one(again, range(40, 80)))  # segments renamed from the spares
    assert again.recycled >= 1
    again.close()
    replays(tmp_path, pool, range(40, 80), segment_bytes=1000)


def test_a_torn_write_in_a_recycled_segment_is_cut_and_a_forged_frame_never_replays(
        tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    """A torn write in a recycled segment does not run past the end of the file (stale
    bytes follow it), so it is not told by the file's end: the segment is read strictly
    and cut after its valid prefix. A client's payload holding a frame sealed with the
    segment's own salt and the very next seq (the strongest forger) is never replayed."""
    from crc32c import crc32c

    w = opened(tmp_path, pool, segment_bytes=4000)

    async def fill() -> None:
        for _ in range(12):  # big records: the spares are ~4.5 KB files
            await w.append([Entry("t", INC, 0, 1, 0, None, b"B" * 1500)])
        w.set_checkpoint(w.next_seq)
        w.reclaim()
        assert spares(tmp_path)
        while not w.recycled:  # small ones until a segment is renamed from a spare
            await w.append([Entry("t", INC, 0, 1, 0, None, b"s" * 50)])

    asyncio.run(fill())
    assert segments(tmp_path)[-1].endswith(".rwal")
    first = int(segments(tmp_path)[-1].split(".")[0])
    after_ckpt = w.checkpoint_seq
    k = w.next_seq
    forged = Entry("victim", b"\1" * 8, 0, 1, 0, None, b"FORGED").encode()
    frame = W.FRAME.pack(W.MAGIC, len(forged), k, crc32c(forged, W.salt(first))) + forged

    async def victim() -> None:
        await w.append([Entry("t", INC, 0, 1, 0, None, b"x" * 300 + frame + b"y" * 300)])

    asyncio.run(victim())
    w.close()
    seg = tmp_path / segments(tmp_path)[-1]
    live_end = w._size
    data = bytearray(seg.read_bytes())
    assert len(data) > live_end  # stale bytes of the file's earlier life follow the tail
    # kill -9 mid-write: the victim record's first 500 bytes (the forged frame whole) reached the file
    start = live_end - (W.FRAME_HEADER + len(Entry("t", INC, 0, 1, 0, None, b"x" * 300 + frame + b"y" * 300).encode()))
    torn = data[: start + 500] + b"\0" * (live_end - start - 500)
    seg.write_bytes(bytes(torn) + bytes(data[live_end:]))
    again = opened(tmp_path, pool, segment_bytes=4000)
    got = list(again.replay())
    assert all(e.topic != "victim" for e in got)
    assert [e.seq for e in got] == list(range(after_ckpt, k)) and again.next_seq == k
    assert seg.stat().st_size == start
    again.close()


def test_retires_at_once_keep_at_most_the_spare_limit_newest_first(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    """Two retires running at once (I/O threads) never keep more than SPARE_SEGMENTS
    spares; a retire keeps the newest of its segments (their pages are the warmest)."""
    w = opened(tmp_path, pool)
    files = []
    for i in range(8):
        f = tmp_path / f"doomed-{i}"
        f.write_bytes(b"x" * 100)
        files.append((100 + i, f))
    barrier = threading.Barrier(2)

    def retire(part: list[tuple[int, Path]]) -> int:
        barrier.wait(5)
        return w._retire(part)

    ts = [pool.submit(retire, files[:4]), pool.submit(retire, files[4:])]
    assert sum(t.result(10) for t in ts) == 8
    assert len(spares(tmp_path)) == W.SPARE_SEGMENTS == len(w._spares)
    assert not any(f.exists() for _, f in files)
    w.close()
    w2 = opened(tmp_path / "b", pool)
    one = [(200 + i, tmp_path / "b" / f"d{i}") for i in range(4)]
    for _, f in one:
        f.write_bytes(b"y")
    w2._retire(one)
    assert spares(tmp_path / "b") == [W._spare_name(202), W._spare_name(203)]
    w2.close()
