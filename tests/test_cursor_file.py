"""Fan-out storage units on real files: the 256-byte checksummed cursor file
(narad.storage.cursor_file) and the partition log's batch read of committed
records for cursors (PartitionLog.read_batch)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from narad.storage import cursor_file as CF
from narad.storage import fileio
from narad.storage import frames as FR
from narad.storage.partition_log import LogClosed, OffsetGone, PartitionLog


def test_encode_is_256_bytes_with_a_crc_over_everything_after_it() -> None:
    data = CF.encode("67953471cc57a32a", 98332)
    assert len(data) == CF.SIZE and data.endswith(b"\n")
    assert data.startswith(b'{"crc":"') and b'"epoch":"67953471cc57a32a","next_offset":98332}' in data
    assert CF.decode(data) == CF.CursorState("67953471cc57a32a", 98332)
    # Any flipped byte after the crc field (padding included) is refused.
    for pos in (20, 60, 200, 254):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises(CF.CursorCorrupt):
            CF.decode(bytes(bad))
    with pytest.raises(CF.CursorCorrupt):
        CF.decode(data[:-1])
    with pytest.raises(ValueError):
        CF.encode("e" * 300, 1)


def test_anchor_advance_read_and_delete(tmp_path: Path) -> None:
    f = CF.CursorFile(tmp_path, "orders-audit")
    assert f.read() is None
    f.anchor("aaaaaaaaaaaaaaaa", 7)
    assert f.path.name == "fanout-orders-audit.offset" and f.path.stat().st_size == CF.SIZE
    assert not list(tmp_path.glob(".*.tmp"))
    ino = f.path.stat().st_ino
    f.advance("aaaaaaaaaaaaaaaa", 4096)
    assert f.path.stat().st_ino == ino, "an advance is in place, not a new file"
    assert CF.CursorFile(tmp_path, "orders-audit").read() == CF.CursorState("aaaaaaaaaaaaaaaa", 4096)
    # A re-anchor for another epoch replaces the file (rename).
    f.anchor("bbbbbbbbbbbbbbbb", 10)
    assert f.read() == CF.CursorState("bbbbbbbbbbbbbbbb", 10)
    f.delete()
    assert f.read() is None and not f.path.exists()
    f.delete()  # absent: nothing to do


def test_advance_is_one_write_at_zero_and_one_fdatasync(tmp_path: Path) -> None:
    f = CF.CursorFile(tmp_path, "c")
    f.anchor("e1", 0)
    f.advance("e1", 1)  # the descriptor is open from here on
    calls: list[tuple[str, int]] = []
    real_pwrite, real_sync = fileio.pwrite, fileio.fdatasync

    def pwrite(fd: int, data: bytes, off: int) -> int:
        calls.append(("pwrite", off))
        return real_pwrite(fd, data, off)

    def sync(fd: int) -> None:
        calls.append(("fdatasync", fd))
        real_sync(fd)

    fileio.pwrite, fileio.fdatasync = pwrite, sync  # type: ignore[assignment]
    try:
        f.advance("e1", 12345)
    finally:
        fileio.reset()
    assert [c[0] for c in calls] == ["pwrite", "fdatasync"] and calls[0][1] == 0
    assert f.read() == CF.CursorState("e1", 12345)


def test_failed_anchor_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    f = CF.CursorFile(tmp_path, "c")
    f.anchor("old", 5)

    def fail(fd: int) -> None:
        raise OSError(5, "injected EIO")

    fileio.fdatasync = fail  # type: ignore[assignment]
    try:
        with pytest.raises(OSError):
            f.anchor("new", 99)
    finally:
        fileio.reset()
    assert f.read() == CF.CursorState("old", 5)
    assert not list(tmp_path.glob(".*.tmp"))


def test_read_retries_a_torn_read_then_declares_corrupt(tmp_path: Path) -> None:
    f = CF.CursorFile(tmp_path, "c")
    f.anchor("e", 3)
    good = f.path.read_bytes()
    torn = good[:100] + b"X" * 156
    f.path.write_bytes(torn)

    # A writer finishing its in-place write while the reader retries: the read succeeds.
    def finish() -> None:
        time.sleep(CF.RETRY_PAUSE / 2)
        fd = os.open(f.path, os.O_WRONLY)
        os.pwrite(fd, good, 0)
        os.close(fd)

    t = threading.Thread(target=finish)
    t.start()
    st = f.read(retries=200)
    t.join()
    assert st == CF.CursorState("e", 3)
    # Damage that stays is corrupt after the retries.
    f.path.write_bytes(torn)
    with pytest.raises(CF.CursorCorrupt):
        f.read()
    # A file of another length (an old format) is replaced by the next advance.
    f.path.write_bytes(b'{"epoch":"e","next_offset":3}\n')
    f.advance("e", 4)
    assert f.path.stat().st_size == CF.SIZE and f.read() == CF.CursorState("e", 4)


# ---- PartitionLog.read_batch -----------------------------------------------------------------

def _commit(plog: PartitionLog, recs: list[tuple[bytes | None, int, bytes]]) -> None:
    envs = [FR.encode_record(k, ts, 0, p) for k, ts, p in recs]
    res = plog.write_commit(envs)
    plog.publish(*res, [(k, ts, 0, p) for k, ts, p in recs])


def test_read_batch_caps_delay_gate_and_hwm(tmp_path: Path) -> None:
    plog = PartitionLog(tmp_path / "p00000")
    plog.open()
    try:
        _commit(plog, [(None, 1000, b"a" * 10), (b"k", 1000, b"b" * 10), (None, 1000, b"c" * 10)])
        _commit(plog, [(None, 2000, b"d" * 10), (None, 3000, b"e" * 10)])
        b = plog.read_batch(0, 100, 1 << 20)
        assert [r[3][:1] for r in b.records] == [b"a", b"b", b"c", b"d", b"e"] and b.next_offset == 5
        assert b.records[1][0] == b"k" and b.nbytes == 51 and b.not_due_ms is None
        # Record cap, then byte cap (at least one record always).
        assert plog.read_batch(1, 2, 1 << 20).next_offset == 3
        b = plog.read_batch(0, 100, 25)
        assert len(b.records) == 2 and b.next_offset == 2
        assert len(plog.read_batch(0, 100, 1).records) == 1
        # The delay gate stops at the first record committed after the bound.
        b = plog.read_batch(0, 100, 1 << 20, max_committed_ms=1999)
        assert b.next_offset == 3 and b.not_due_ms == 2000
        b = plog.read_batch(3, 100, 1 << 20, max_committed_ms=500)
        assert b.records == [] and b.next_offset == 3 and b.not_due_ms == 2000
        # At the high watermark: nothing, no gate.
        b = plog.read_batch(5, 100, 1 << 20)
        assert b.records == [] and b.next_offset == 5 and b.not_due_ms is None
    finally:
        plog.close()
    with pytest.raises(LogClosed):
        plog.read_batch(0, 10, 1 << 20)


def test_read_batch_reports_aged_out_offsets_and_skips_corrupt_frames(tmp_path: Path) -> None:
    d = tmp_path / "p00000"
    plog = PartitionLog(d, segment_bytes=130)
    plog.open()
    for i in range(6):
        _commit(plog, [(None, 1000 + i, f"rec-{i}".encode() * 4)])
    assert len(plog.segments) > 2
    first = plog.segments[0]
    n, _ = plog.delete_segments([first])
    assert n > 0
    with pytest.raises(OffsetGone) as e:
        plog.read_batch(0, 10, 1 << 20)
    assert e.value.oldest == plog.oldest == n
    plog.close()
    # Corrupt a sealed segment's frame on disk: re-verified at read, skipped and counted.
    seg = sorted(d.glob("*.log"))[0]
    raw = bytearray(seg.read_bytes())
    raw[FR.HEADER_SIZE + 3] ^= 0xFF
    seg.write_bytes(bytes(raw))
    plog = PartitionLog(d, segment_bytes=130)
    plog.open()
    try:
        b = plog.read_batch(plog.oldest, 100, 1 << 20)
        assert b.corrupt >= 1 and b.next_offset == plog.hwm
        assert all(r[3].startswith(b"rec-") for r in b.records) and len(b.records) + b.corrupt == plog.hwm - n
    finally:
        plog.close()


def test_the_delay_gate_never_opens_inside_the_commit_stamps_millisecond(tmp_path: Path) -> None:
    """A commit stamped C ms happened somewhere in [C, C+1): with delay D it may be
    copied at now = C+D+1 ms, never at C+D (up to 1 ms before its commit + D, which a
    fan-out chaos run caught as a delivery 0 ms before due)."""
    from narad.broker.fanout import delay_bound, due_in_ms

    plog = PartitionLog(tmp_path / "p00000")
    plog.open()
    try:
        _commit(plog, [(None, 2000, b"a")])
        delay = 500
        b = plog.read_batch(0, 10, 1 << 20, max_committed_ms=delay_bound(2500, delay))
        assert b.records == [] and b.not_due_ms == 2000
        assert due_in_ms(2000, delay, 2500) == 1  # the cursor sleeps one more ms, not zero
        b = plog.read_batch(0, 10, 1 << 20, max_committed_ms=delay_bound(2501, delay))
        assert [r[3] for r in b.records] == [b"a"] and b.not_due_ms is None
        assert due_in_ms(2000, delay, 2501) == 0
    finally:
        plog.close()
