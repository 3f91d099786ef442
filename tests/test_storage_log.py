"""Partition log on real files: commit/publish/read, the high watermark and the
hwm file, recovery (torn tail vs mid-segment corruption), failed and poisoned
commits through the fileio seam, segment rolls and retention."""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from narad.storage import fileio
from narad.storage import frames as FR
from narad.storage import partition_log as PL
from narad.storage.partition_log import CorruptRecord, LogPoisoned, NotVisible, OffsetGone, PartitionLog, Segment

Commit = tuple[int, Segment, int, int, Segment | None]


@pytest.fixture(autouse=True)
def _reset_seam() -> Iterator[None]:
    yield
    fileio.reset()


def payload(off: int) -> bytes:
    return f"message-{off}".encode() * (1 + off % 3)


def key_for(off: int) -> bytes | None:
    return None if off % 4 == 0 else f"k{off % 7}".encode()


def envelopes(plog: PartitionLog, offsets: range) -> tuple[list[bytes], list[PL.Record]]:
    ts = plog.committed_at()
    envs = [FR.encode_record(key_for(o), ts, FR.F_UTF8, payload(o)) for o in offsets]
    decoded: list[PL.Record] = [(key_for(o), ts, FR.F_UTF8, payload(o)) for o in offsets]
    return envs, decoded


def commit(plog: PartitionLog, n: int) -> Commit:
    """Commit records for offsets [next_offset, next_offset + n) and publish them."""
    envs, decoded = envelopes(plog, range(plog.next_offset, plog.next_offset + n))
    res = plog.write_commit(envs)
    plog.publish(*res, decoded)
    return res


def fill(plog: PartitionLog, batches: list[int]) -> list[Commit]:
    return [commit(plog, n) for n in batches]


def check(plog: PartitionLog, offsets: range) -> None:
    for off in offsets:
        key, _ts, flags, data = plog.read(off)
        assert (key, data) == (key_for(off), payload(off)), off
        assert flags & FR.F_UTF8


def opened(d: Path, **kw: int) -> PartitionLog:
    plog = PartitionLog(d, **kw)
    plog.open()
    return plog


def active_path(d: Path) -> Path:
    return sorted(d.glob("*.log"))[-1]


def flip(path: Path, pos: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ 0x5A]))


def fail_once(name: str, err: int = errno.EIO, after: int = 0) -> list[int]:
    """Make fileio.<name> raise OSError(err) on its (after+1)-th call, then behave."""
    real: Callable[..., object] = getattr(fileio, name)
    calls = [0]

    def fake(*args: object) -> object:
        calls[0] += 1
        if calls[0] == after + 1:
            raise OSError(err, os.strerror(err))
        return real(*args)

    setattr(fileio, name, fake)
    return calls


# ---- round trip and visibility ---------------------------------------------------------


def test_round_trip_many_frames(tmp_path: Path) -> None:
    plog = opened(tmp_path)
    batches = [1 + i % 5 for i in range(150)]
    res = fill(plog, batches)
    total = sum(batches)
    assert plog.hwm == plog.next_offset == total
    assert [r[0] for r in res] == [sum(batches[:i]) for i in range(len(batches))]
    check(plog, range(total))
    # Past the cache: a fresh log object reads everything from disk.
    plog.close()
    again = opened(tmp_path)
    assert again.hwm == total
    check(again, range(total))
    again.close()


def test_a_laid_out_frame_is_the_frame_of_its_encoded_records(tmp_path: Path) -> None:
    """``FR.lay`` (the commit's layout: heads built once a batch, payloads not copied)
    writes the bytes ``encode_record`` + ``encode_frame`` write, for keyless and keyed
    records, mixed flags (F_KEY given or not), an empty key (keyless), lengths that
    repeat and that do not, a payload past one byte of varint; and a log commit of it
    reads back as committed."""
    import random

    rnd = random.Random(14)
    for trial in range(300):
        recs: list[tuple[bytes | None, int, bytes]] = []
        for _ in range(rnd.randint(1, 40)):
            klen = rnd.choice([1, 127, 128, 300])
            key = rnd.choice([None, b"", b"k", bytes(rnd.randrange(256) for _ in range(klen))])
            flags = rnd.choice([0, FR.F_JSON | FR.F_UTF8, FR.F_EXT | FR.F_JSON, FR.F_KEY, FR.F_KEY | FR.F_UTF8])
            payload = bytes(rnd.randrange(256) for _ in range(rnd.choice([1, 3, 3, 200, 1024])))
            recs.append((key, flags, payload))
        ts = rnd.randrange(1 << 41)
        laid, decoded = FR.Laid(), []
        half = len(recs) // 2  # two calls, as a frame of two combined batches
        FR.lay(laid, recs[:half], ts, decoded)
        FR.lay(laid, recs[half:], ts, decoded)
        base = rnd.randrange(1 << 40)
        assert len(laid) == len(recs)
        want = FR.encode_frame(base, [FR.encode_record(k, ts, f, p) for k, f, p in recs])
        assert FR.encode_frame(base, laid) == want, trial
        assert decoded == [(k, ts, f, p) for k, f, p in recs]
    plog = opened(tmp_path)
    laid, decoded = FR.Laid(), []
    FR.lay(laid, [(b"key", FR.F_JSON, b"{}"), (None, FR.F_UTF8, b"x" * 300)], 1234, decoded)
    res = plog.write_commit(laid)
    assert res[0] == 0 and plog.hwm == 0  # (visible at publish)
    plog.publish(*res, decoded)
    assert plog.hwm == 2
    plog.close()
    again = opened(tmp_path)
    assert [again.read(i) for i in range(2)] == [(b"key", 1234, FR.F_JSON | FR.F_KEY, b"{}"),
                                                 (None, 1234, FR.F_UTF8, b"x" * 300)]
    again.close()


def test_committed_at_never_goes_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plog = opened(tmp_path)
    clock = iter([1000.0, 999.0, 1001.0])
    monkeypatch.setattr(PL.time, "time", lambda: next(clock))
    assert [plog.committed_at() for _ in range(3)] == [1_000_000, 1_000_000, 1_001_000]
    plog.close()


def test_nothing_is_read_at_or_above_hwm(tmp_path: Path) -> None:
    plog = opened(tmp_path)
    fill(plog, [3, 2])
    assert plog.hwm == 5
    envs, decoded = envelopes(plog, range(5, 8))
    res = plog.write_commit(envs)  # durable, not yet published
    assert plog.hwm == 5
    for off in (5, 6, 7, 8, 100):
        with pytest.raises(NotVisible):
            plog.read(off)
    plog.publish(*res, decoded)
    check(plog, range(8))
    with pytest.raises(NotVisible):
        plog.read(8)
    plog.close()


def test_hidden_tail_after_clean_close_stays_hidden(tmp_path: Path) -> None:
    plog = opened(tmp_path)
    fill(plog, [4])
    envs, _ = envelopes(plog, range(4, 6))
    plog.write_commit(envs)  # written and synced, never published
    plog.close()
    assert (tmp_path / "hwm").read_bytes() == struct.pack(">Q", 4)
    again = opened(tmp_path)
    assert again.hwm == 4
    assert again.next_offset == 6
    check(again, range(4))
    with pytest.raises(NotVisible):
        again.read(4)
    again.close()


# ---- reopen: clean close vs crash ------------------------------------------------------------------


def test_reopen_after_clean_close_uses_hwm_file(tmp_path: Path) -> None:
    plog = opened(tmp_path)
    fill(plog, [5, 1, 7])
    plog.close()
    assert (tmp_path / "hwm").read_bytes() == struct.pack(">Q", 13)
    again = opened(tmp_path)
    assert (again.hwm, again.next_offset) == (13, 13)
    check(again, range(13))
    # The file is emptied before the first advance after an open, and stays empty.
    assert (tmp_path / "hwm").read_bytes() == struct.pack(">Q", 13)
    fill(again, [2])
    assert (tmp_path / "hwm").read_bytes() == b""
    fill(again, [2])
    assert (tmp_path / "hwm").read_bytes() == b""
    again.close()
    assert (tmp_path / "hwm").read_bytes() == struct.pack(">Q", 17)


def test_hwm_file_caps_a_longer_tail(tmp_path: Path) -> None:
    plog = opened(tmp_path)
    fill(plog, [3, 3])
    plog.close()
    (tmp_path / "hwm").write_bytes(struct.pack(">Q", 3))
    again = opened(tmp_path)
    assert again.hwm == 3
    with pytest.raises(NotVisible):
        again.read(3)
    again.close()
    (tmp_path / "hwm").write_bytes(struct.pack(">Q", 1000))  # beyond the tail: the tail wins
    again = opened(tmp_path)
    assert again.hwm == 6
    again.close()


def test_reopen_after_crash_takes_the_verified_tail(tmp_path: Path) -> None:
    plog = opened(tmp_path)
    fill(plog, [2, 9, 1])
    plog.close(clean=False)  # a crash: nothing written at close
    assert (tmp_path / "hwm").read_bytes() == b""
    again = opened(tmp_path)
    assert (again.hwm, again.next_offset) == (12, 12)
    check(again, range(12))
    fill(again, [3])
    check(again, range(15))
    again.close()


def test_open_fails_if_the_active_segment_cannot_be_synced(tmp_path: Path) -> None:
    plog = opened(tmp_path)
    fill(plog, [2])
    plog.close(clean=False)
    fail_once("fdatasync")
    with pytest.raises(OSError):
        opened(tmp_path)
    fileio.reset()
    again = opened(tmp_path)
    assert again.hwm == 2
    again.close()


# ---- recovery: torn tails vs corruption -------------------------------------------------------------


@pytest.mark.parametrize("damage", ["mid_frame", "mid_header", "zeroes", "garbage", "magic_garbage"])
def test_torn_tail_is_cut_and_appends_continue(tmp_path: Path, damage: str) -> None:
    plog = opened(tmp_path)
    res = fill(plog, [3, 4, 2])
    plog.close(clean=False)
    seg = active_path(tmp_path)
    _, _, pos, size, _ = res[-1]
    good = pos + size
    if damage == "mid_frame":
        os.truncate(seg, pos + size - 5)
        good, want = pos, 7
    elif damage == "mid_header":
        os.truncate(seg, pos + 10)
        good, want = pos, 7
    else:
        extra = {"zeroes": b"\0" * 300, "garbage": os.urandom(200).replace(FR.MAGIC, b"xx"),
                 "magic_garbage": FR.MAGIC + b"\x00" * 40 + FR.MAGIC + os.urandom(30)}[damage]
        with open(seg, "ab") as fh:
            fh.write(extra)
        want = 9
    again = opened(tmp_path)
    assert seg.stat().st_size == good
    assert (again.hwm, again.next_offset) == (want, want)
    check(again, range(want))
    with pytest.raises(NotVisible):
        again.read(want)
    fill(again, [5])
    check(again, range(want + 5))
    again.close(clean=False)
    third = opened(tmp_path)
    assert third.hwm == want + 5
    check(third, range(want + 5))
    third.close()


@pytest.mark.parametrize("where", ["payload", "header", "crc"])
def test_last_frame_with_bad_crc_is_cut(tmp_path: Path, where: str) -> None:
    plog = opened(tmp_path)
    res = fill(plog, [2, 3, 4])
    plog.close(clean=False)
    seg = active_path(tmp_path)
    _, _, pos, size, _ = res[-1]
    flip(seg, pos + {"payload": size - 1, "header": 8, "crc": 24}[where])
    again = opened(tmp_path)
    assert seg.stat().st_size == pos
    assert (again.hwm, again.next_offset) == (5, 5)
    check(again, range(5))
    fill(again, [4])  # the same offsets, new frame
    check(again, range(9))
    again.close()


def test_mid_segment_corruption_is_skipped_not_truncated(tmp_path: Path) -> None:
    plog = opened(tmp_path)
    res = fill(plog, [2, 3, 4, 1, 2])
    plog.close(clean=False)
    seg = active_path(tmp_path)
    size_before = seg.stat().st_size
    bad_base, _, pos, size, _ = res[1]  # offsets 2..4
    flip(seg, pos + size - 3)
    again = opened(tmp_path)
    assert seg.stat().st_size == size_before  # never truncated
    assert (again.hwm, again.next_offset) == (12, 12)
    check(again, range(0, 2))
    for off in range(bad_base, bad_base + 3):
        with pytest.raises(CorruptRecord):
            again.read(off)
    check(again, range(5, 12))
    fill(again, [2])
    check(again, range(12, 14))
    again.close(clean=False)
    third = opened(tmp_path)
    assert third.hwm == 14
    with pytest.raises(CorruptRecord):
        third.read(3)
    check(third, range(5, 14))
    third.close()


def test_a_gap_survives_sealing(tmp_path: Path) -> None:
    plog = opened(tmp_path, segment_bytes=4096)
    res = fill(plog, [3] * 5)
    plog.close(clean=False)
    bad_base, _, pos, size, _ = res[2]
    flip(active_path(tmp_path), pos + size // 2)
    again = opened(tmp_path, segment_bytes=4096)
    first = again.segments[0].path
    while len(again.segments) < 3:  # the damaged segment is sealed now
        commit(again, 3)
    total = again.hwm
    again.close()
    third = opened(tmp_path, segment_bytes=4096)
    assert third.segments[0].path == first and third.segments[0].fd == -1
    for off in range(total):
        if bad_base <= off < bad_base + 3:
            with pytest.raises(CorruptRecord):
                third.read(off)
        else:
            check(third, range(off, off + 1))
    third.close()


def test_corrupt_first_frame_of_active_segment(tmp_path: Path) -> None:
    plog = opened(tmp_path)
    fill(plog, [2, 2])
    plog.close(clean=False)
    flip(active_path(tmp_path), 3)  # record count of the frame at offset 0
    again = opened(tmp_path)
    assert again.hwm == 4
    for off in (0, 1):
        with pytest.raises(CorruptRecord):
            again.read(off)
    check(again, range(2, 4))
    again.close()


def sealed_log(d: Path) -> tuple[list[Commit], int]:
    plog = opened(d, segment_bytes=4096)
    res = fill(plog, [3] * 80)
    total = plog.hwm
    assert len(list(d.glob("*.log"))) >= 3
    plog.close()
    return res, total


@pytest.mark.parametrize("where", ["payload", "size", "base", "base_high", "count", "magic"])
def test_damage_in_sealed_segment_never_serves_wrong_data(tmp_path: Path, where: str) -> None:
    res, total = sealed_log(tmp_path)
    first_seg = sorted(tmp_path.glob("*.log"))[0]
    victims = [r for r in res if r[1].path == first_seg]
    base, _, pos, size, _ = victims[len(victims) // 2]
    at = {"payload": size - 2, "size": 17, "base": 14, "base_high": 8, "count": 6, "magic": 0}[where]
    flip(first_seg, pos + at)
    plog = opened(tmp_path, segment_bytes=4096)
    assert plog.hwm == total
    corrupt = []
    for off in range(total):
        try:
            key, _, _, data = plog.read(off)
        except CorruptRecord:
            corrupt.append(off)
            continue
        assert (key, data) == (key_for(off), payload(off)), off
    # Exactly the damaged frame's offsets: the rest of the segment stays readable.
    assert corrupt == list(range(base, base + 3))
    plog.close()


# ---- failed commits -------------------------------------------------------------------------------------


def test_failed_write_leaves_nothing_and_retry_lands_at_same_offsets(tmp_path: Path) -> None:
    plog = opened(tmp_path)
    fill(plog, [3])
    seg = active_path(tmp_path)
    size = seg.stat().st_size
    real = fileio.pwrite

    def half_then_enospc(fd: int, data: bytes, off: int) -> int:
        if len(data) > 20:
            return real(fd, bytes(data[: len(data) // 2]), off)  # a short write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    fileio.pwrite = half_then_enospc
    envs, decoded = envelopes(plog, range(3, 7))
    with pytest.raises(OSError) as ei:
        plog.write_commit(envs)
    assert ei.value.errno == errno.ENOSPC
    assert not isinstance(ei.value, LogPoisoned)
    assert seg.stat().st_size == size
    assert (plog.hwm, plog.next_offset) == (3, 3)
    fileio.reset()
    res = plog.write_commit(envs)
    assert res[0] == 3
    plog.publish(*res, decoded)
    check(plog, range(7))
    plog.close(clean=False)
    again = opened(tmp_path)
    assert again.hwm == 7  # no duplicate frame, nothing torn
    assert len(again.segments[-1].frame_bases) == 2
    check(again, range(7))
    again.close()


def test_failed_fsync_poisons_until_reopen(tmp_path: Path) -> None:
    plog = opened(tmp_path)
    fill(plog, [4])
    seg = active_path(tmp_path)
    size = seg.stat().st_size
    fail_once("fdatasync")
    envs, decoded = envelopes(plog, range(4, 6))
    with pytest.raises(OSError):
        plog.write_commit(envs)
    assert plog.poisoned is not None
    assert seg.stat().st_size == size  # cut anyway
    fileio.reset()
    with pytest.raises(LogPoisoned):
        plog.write_commit(envs)
    assert plog.hwm == 4
    check(plog, range(4))  # committed data stays readable
    assert not plog.roll_idle_active(1, 10**15)
    plog.close()
    assert (tmp_path / "hwm").read_bytes() in (b"", struct.pack(">Q", 4))
    again = opened(tmp_path)
    assert again.poisoned is None and again.hwm == 4
    res = again.write_commit(envs)
    assert res[0] == 4
    again.publish(*res, decoded)
    check(again, range(6))
    again.close()


def test_bad_read_back_fails_the_commit_and_cuts_the_frame(tmp_path: Path) -> None:
    plog = opened(tmp_path)
    fill(plog, [2])
    seg = active_path(tmp_path)
    size = seg.stat().st_size
    real = fileio.pread

    def corrupting(fd: int, n: int, off: int) -> bytes:
        data = bytearray(real(fd, n, off))
        data[-1] ^= 1
        return bytes(data)

    fileio.pread = corrupting
    envs, decoded = envelopes(plog, range(2, 5))
    with pytest.raises(OSError):
        plog.write_commit(envs)
    assert seg.stat().st_size == size
    assert plog.poisoned is None and plog.hwm == 2
    fileio.reset()
    res = plog.write_commit(envs)
    assert res[0] == 2
    plog.publish(*res, decoded)
    check(plog, range(5))
    plog.close()


def test_failed_hwm_release_fails_the_commit(tmp_path: Path) -> None:
    plog = opened(tmp_path)
    fill(plog, [2])
    plog.close()
    again = opened(tmp_path)
    seg = active_path(tmp_path)
    size = seg.stat().st_size
    fail_once("ftruncate")  # emptying the hwm file is the first truncate of this commit
    envs, decoded = envelopes(again, range(2, 4))
    with pytest.raises(OSError):
        again.write_commit(envs)
    assert again.hwm == 2 and seg.stat().st_size == size
    fileio.reset()
    res = again.write_commit(envs)
    again.publish(*res, decoded)
    assert (tmp_path / "hwm").read_bytes() == b""
    check(again, range(4))
    again.close()


# ---- segments ----------------------------------------------------------------------------------------------


def test_segment_roll_keeps_offsets_contiguous(tmp_path: Path) -> None:
    plog = opened(tmp_path, segment_bytes=4096)
    batches = [1 + i % 6 for i in range(120)]
    fill(plog, batches)
    total = sum(batches)
    segs = sorted(tmp_path.glob("*.log"))
    assert len(segs) >= 4
    assert [s.base for s in plog.segments] == [int(p.name[:-4]) for p in segs]
    for a, b in zip(plog.segments, plog.segments[1:], strict=False):
        assert a.end == b.base and a.fd == -1
        assert a.size <= 4096 and os.path.getsize(a.path) == a.size
    check(plog, range(total))
    big = plog.next_offset
    envs = [FR.encode_record(None, 1, 0, b"x" * 6000)]  # a frame larger than a segment still fits alone
    res = plog.write_commit(envs)
    plog.publish(*res, [(None, 1, 0, b"x" * 6000)])
    assert plog.read(big)[3] == b"x" * 6000
    plog.close()
    again = opened(tmp_path, segment_bytes=4096)
    assert again.hwm == total + 1
    check(again, range(total))
    assert again.read(total)[3] == b"x" * 6000
    fill(again, [3])
    check(again, range(total + 1, total + 4))
    assert again.hwm == total + 4
    again.close()


def test_failed_commit_that_rolled_can_be_retried(tmp_path: Path) -> None:
    plog = opened(tmp_path, segment_bytes=4096)
    while os.path.getsize(active_path(tmp_path)) < 3900:
        commit(plog, 2)
    before = [s.base for s in plog.segments]
    fail_once("pwrite", errno.ENOSPC)
    base = plog.next_offset
    envs, decoded = envelopes(plog, range(base, base + 10))
    with pytest.raises(OSError):
        plog.write_commit(envs)
    assert [s.base for s in plog.segments] == before
    fileio.reset()
    res = plog.write_commit(envs)
    assert res[0] == base and res[4] is not None
    plog.publish(*res, decoded)
    check(plog, range(base + 10))
    plog.close(clean=False)
    again = opened(tmp_path, segment_bytes=4096)
    assert again.hwm == base + 10
    check(again, range(base + 10))
    again.close()


def test_failed_dir_sync_of_a_roll_leaves_no_segment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plog = opened(tmp_path, segment_bytes=4096)
    while os.path.getsize(active_path(tmp_path)) < 3900:
        commit(plog, 2)
    names = sorted(p.name for p in tmp_path.glob("*.log"))
    real = fileio.fsync_dir
    calls = [0]

    def flaky(path: str | os.PathLike[str]) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise OSError(errno.EIO, "Input/output error")
        real(path)

    monkeypatch.setattr(fileio, "fsync_dir", flaky)
    base = plog.next_offset
    envs, decoded = envelopes(plog, range(base, base + 10))
    with pytest.raises(OSError):
        plog.write_commit(envs)
    assert sorted(p.name for p in tmp_path.glob("*.log")) == names
    res = plog.write_commit(envs)
    plog.publish(*res, decoded)
    check(plog, range(base + 10))
    plog.close()


def test_failed_fsync_of_a_roll_poisons(tmp_path: Path) -> None:
    plog = opened(tmp_path, segment_bytes=4096)
    while os.path.getsize(active_path(tmp_path)) < 3900:
        commit(plog, 2)
    fail_once("fdatasync")  # the roll syncs the full segment first
    envs, _ = envelopes(plog, range(plog.next_offset, plog.next_offset + 10))
    with pytest.raises(OSError):
        plog.write_commit(envs)
    fileio.reset()
    with pytest.raises(LogPoisoned):
        plog.write_commit(envs)
    plog.close()


# ---- retention ------------------------------------------------------------------------------------------------


def test_retention_deletes_whole_sealed_segments_by_age(tmp_path: Path) -> None:
    plog = opened(tmp_path, segment_bytes=4096)
    fill(plog, [4] * 100)
    total = plog.hwm
    segs = list(plog.segments)
    assert len(segs) >= 4
    now = 10_000_000
    for s in segs:
        s.last_write_ms = now  # fresh
    assert plog.expired_segments(1000, now) == []
    segs[0].last_write_ms = segs[1].last_write_ms = now - 5000
    segs[3].last_write_ms = now - 5000  # not contiguous with the old ones: kept
    segs[-1].last_write_ms = now - 5000  # the active segment is never deleted
    assert plog.expired_segments(0, now) == []  # 0 = keep forever
    expired = plog.expired_segments(1000, now)
    assert expired == segs[:2]
    # the loop's part leaves the files (their unlink is the I/O thread's: remove_files)
    n, size, paths = plog.detach_segments(expired)
    assert n == segs[2].base and size == segs[0].size + segs[1].size
    assert paths == [segs[0].path, segs[1].path] and all(p.exists() for p in paths)
    assert plog.oldest == segs[2].base
    PL.remove_files(paths, tmp_path)
    assert not segs[0].path.exists() and not segs[1].path.exists()
    with pytest.raises(OffsetGone) as ei:
        plog.read(segs[2].base - 1)
    assert ei.value.oldest == segs[2].base
    check(plog, range(segs[2].base, total))
    plog.close()
    again = opened(tmp_path, segment_bytes=4096)
    assert again.oldest == segs[2].base and again.hwm == total
    with pytest.raises(OffsetGone):
        again.read(0)
    again.close()


def test_retention_keeps_segments_above_hwm(tmp_path: Path) -> None:
    plog = opened(tmp_path, segment_bytes=4096)
    fill(plog, [4] * 40)
    plog.hwm = plog.segments[1].base + 1  # records above the hwm sit in segment 1
    for s in plog.segments:
        s.last_write_ms = 0
    assert plog.expired_segments(1000, 10**9) == plog.segments[:1]
    plog.close(clean=False)


def test_roll_idle_active_seals_an_old_active_segment(tmp_path: Path) -> None:
    plog = opened(tmp_path)
    now = 50_000_000
    assert not plog.roll_idle_active(1000, now)  # empty
    fill(plog, [3, 2])
    act = plog.segments[-1]
    assert not plog.roll_idle_active(1000, act.last_write_ms + 10)  # recent
    envs, decoded = envelopes(plog, range(5, 7))
    res = plog.write_commit(envs)  # above hwm: not fully committed yet
    assert not plog.roll_idle_active(1000, act.last_write_ms + 10_000)
    plog.publish(*res, decoded)
    act.last_write_ms = now - 5000
    assert plog.roll_idle_active(1000, now)
    assert len(plog.segments) == 2 and plog.segments[-1].base == 7
    assert (tmp_path / f"{7:020d}.log").exists()
    assert plog.expired_segments(1000, now) == [act]
    assert plog.delete_segments([act]) == (7, act.size)
    assert plog.oldest == 7 and plog.hwm == 7
    with pytest.raises(OffsetGone):
        plog.read(6)
    fill(plog, [2])
    check(plog, range(7, 9))
    plog.close()
    again = opened(tmp_path)
    assert (again.oldest, again.hwm) == (7, 9)
    check(again, range(7, 9))
    again.close()


def test_closed_log_refuses_commits(tmp_path: Path) -> None:
    plog = opened(tmp_path)
    fill(plog, [1])
    plog.close()
    envs, _ = envelopes(plog, range(1, 2))
    with pytest.raises(OSError):
        plog.write_commit(envs)


def test_first_record_ms_refuses_a_key_length_no_frame_could_hold(tmp_path: Path) -> None:
    """A frame whose record claims a ~2^70-byte key: -1 (unreadable), never an OverflowError
    out of the read (it runs at partition open and for the stats)."""
    from narad.storage import frames as FR
    from narad.storage.partition_log import first_record_ms

    good = tmp_path / "good.log"
    good.write_bytes(FR.encode_frame(0, [FR.encode_record(b"k", 1234, 0, b"x")]))
    assert first_record_ms(good) == 1234
    bad = tmp_path / "bad.log"
    bad.write_bytes(FR.encode_frame(0, [bytes([FR.RECORD_VERSION, FR.F_KEY]) + b"\xff" * 9 + b"\x7f" + bytes(8)]))
    assert first_record_ms(bad) == -1
    assert first_record_ms(tmp_path / "missing.log") is None
