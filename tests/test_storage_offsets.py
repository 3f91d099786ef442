"""Consumer offset files on real files: the two-slot ``consumer.ahead``
(anchor never overwritten, torn window falls back to the anchor, priming),
``consumer.offset`` levelling, and the acked-ahead size limit."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from narad.storage import fileio
from narad.storage.offsets import SLOT, OffsetFile, _decode, _encode


@pytest.fixture(autouse=True)
def _reset_seam() -> Iterator[None]:
    yield
    fileio.reset()


def slots(d: Path) -> list[bytes]:
    raw = (d / "consumer.ahead").read_bytes()
    assert len(raw) == 2 * SLOT
    return [raw[:SLOT], raw[SLOT:]]


def newest(d: Path) -> int:
    """Index of the valid slot with the highest sequence number."""
    dec = [_decode(s) for s in slots(d)]
    valid = [(s[0], i) for i, s in enumerate(dec) if s is not None]
    return max(valid)[1]


def loaded(d: Path) -> tuple[OffsetFile, tuple[int, list[int]]]:
    of = OffsetFile(d)
    return of, of.load()


def crash(of: OffsetFile) -> None:
    """The process dies: the fd goes, the page cache stays."""
    os.close(of._fd)
    of._fd = -1


def put_slot(d: Path, i: int, data: bytes) -> None:
    with open(d / "consumer.ahead", "r+b") as fh:
        fh.seek(i * SLOT)
        fh.write(data)


def test_fresh_directory_loads_nothing(tmp_path: Path) -> None:
    of, got = loaded(tmp_path)
    assert got == (-1, [])
    assert (tmp_path / "consumer.ahead").stat().st_size == 2 * SLOT
    of.close(-1, [])
    assert loaded(tmp_path)[1] == (-1, [])


def test_window_writeout_and_reopen(tmp_path: Path) -> None:
    of, _ = loaded(tmp_path)
    of.write_window(9, [11, 12, 20])
    of.writeout()
    crash(of)
    of2, got = loaded(tmp_path)
    assert got == (9, [11, 12, 20])
    of2.write_window(15, [20])  # page cache only: survives a process crash
    crash(of2)
    of3, got = loaded(tmp_path)
    assert got == (15, [20])
    of3.close(30, [33])
    assert (tmp_path / "consumer.offset").read_bytes() == (30).to_bytes(8, "big")
    assert loaded(tmp_path)[1] == (30, [33])


@pytest.mark.parametrize("damage", ["garbage", "zeroes", "torn"])
def test_torn_window_falls_back_to_the_anchor(tmp_path: Path, damage: str) -> None:
    of, _ = loaded(tmp_path)
    of.write_window(10, [12])
    of.writeout()  # anchor: frontier 10
    anchor = newest(tmp_path)
    of.write_window(20, [22, 25])
    window = 1 - anchor
    assert _decode(slots(tmp_path)[window]) is not None
    crash(of)
    if damage == "garbage":
        put_slot(tmp_path, window, os.urandom(SLOT))
    elif damage == "zeroes":
        put_slot(tmp_path, window, bytes(SLOT))
    else:  # the first sector made it, the rest did not
        put_slot(tmp_path, window, slots(tmp_path)[window][:20] + bytes(SLOT - 20))
    _, got = loaded(tmp_path)
    assert got == (10, [12])


def test_anchor_slot_is_never_written_by_the_window(tmp_path: Path) -> None:
    of, _ = loaded(tmp_path)
    for round_ in range(4):
        anchor = newest(tmp_path)
        before = slots(tmp_path)[anchor]
        for j in range(3):
            f = round_ * 10 + j
            of.write_window(f, [f + 2, f + 5])
            assert slots(tmp_path)[anchor] == before
            assert _decode(slots(tmp_path)[1 - anchor])[1:] == (f, [f + 2, f + 5])  # type: ignore[index]
        of.writeout()
        assert newest(tmp_path) == 1 - anchor  # roles flipped
    of.close(100, [])


@pytest.mark.parametrize("best", [0, 1])
def test_priming_does_not_rewrite_the_newest_slot(tmp_path: Path, best: int) -> None:
    (tmp_path / "consumer.ahead").write_bytes(bytes(2 * SLOT))
    put_slot(tmp_path, best, _encode(7, 40, [42, 45]))
    put_slot(tmp_path, 1 - best, _encode(6, 30, []) if best else os.urandom(SLOT))
    anchor_bytes = slots(tmp_path)[best]
    of, got = loaded(tmp_path)
    assert got == (40, [42, 45])
    assert slots(tmp_path)[best] == anchor_bytes
    of.write_window(41, [45])
    assert slots(tmp_path)[best] == anchor_bytes
    assert _decode(slots(tmp_path)[1 - best])[1:] == (41, [45])  # type: ignore[index]
    crash(of)
    assert loaded(tmp_path)[1] == (41, [45])


def test_short_file_is_extended_and_read(tmp_path: Path) -> None:
    (tmp_path / "consumer.ahead").write_bytes(_encode(3, 5, [7]))  # one slot, trailing zeroes cut off
    assert (tmp_path / "consumer.ahead").stat().st_size == SLOT
    _of, got = loaded(tmp_path)
    assert got == (5, [7])
    assert (tmp_path / "consumer.ahead").stat().st_size == 2 * SLOT


def test_too_many_acked_ahead_keeps_the_lowest(tmp_path: Path) -> None:
    ahead = [1000 * i for i in range(1, 3001)]  # two bytes per delta: not all fit in 4 KiB
    of, _ = loaded(tmp_path)
    of.write_window(0, ahead)
    of.writeout()
    crash(of)
    _, (frontier, kept) = loaded(tmp_path)
    assert frontier == 0
    assert 1900 < len(kept) < len(ahead)
    assert kept == ahead[: len(kept)]
    assert len(_encode(1, 0, ahead)) == SLOT


def test_offsets_at_or_below_the_frontier_are_not_stored(tmp_path: Path) -> None:
    of, _ = loaded(tmp_path)
    of.write_window(10, [3, 10, 11, 11, 15])
    crash(of)
    assert loaded(tmp_path)[1] == (10, [11, 15])


def test_consumer_offset_levelling_takes_the_max(tmp_path: Path) -> None:
    of, _ = loaded(tmp_path)
    of.write_window(50, [60, 101, 150])
    of.writeout()
    of.level(100)  # e.g. written by a later process life
    crash(of)
    of2, got = loaded(tmp_path)
    assert got == (100, [101, 150])
    crash(of2)
    assert loaded(tmp_path)[1] == (100, [101, 150])  # the raise was persisted
    of3, _ = loaded(tmp_path)
    of3.level(30)  # behind the slots: the slots win
    crash(of3)
    assert loaded(tmp_path)[1] == (100, [101, 150])
    (tmp_path / "consumer.offset").write_bytes(b"")  # empty = no offset
    assert loaded(tmp_path)[1] == (100, [101, 150])


def test_level_without_slots(tmp_path: Path) -> None:
    (tmp_path / "consumer.offset").write_bytes((7).to_bytes(8, "big"))
    _, got = loaded(tmp_path)
    assert got == (7, [])


def test_failed_writeout_keeps_the_anchor(tmp_path: Path) -> None:
    of, _ = loaded(tmp_path)
    of.write_window(5, [7])
    of.writeout()
    anchor = newest(tmp_path)
    anchor_bytes = slots(tmp_path)[anchor]
    of.write_window(8, [])

    def bad_sync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    fileio.fdatasync = bad_sync
    with pytest.raises(OSError):
        of.writeout()
    fileio.reset()
    of.write_window(9, [12])  # rewritten fully into the same window slot
    assert slots(tmp_path)[anchor] == anchor_bytes
    assert _decode(slots(tmp_path)[1 - anchor])[1:] == (9, [12])  # type: ignore[index]
    of.writeout()
    assert newest(tmp_path) == 1 - anchor
    of.write_window(10, [])
    assert _decode(slots(tmp_path)[anchor])[1:] == (10, [])  # type: ignore[index]
    of.close(10, [])


def test_torn_window_write_is_never_anchored(tmp_path: Path) -> None:
    of, _ = loaded(tmp_path)
    of.write_window(5, [7])
    of.writeout()
    anchor = newest(tmp_path)
    anchor_bytes = slots(tmp_path)[anchor]
    of.write_window(6, [7])  # fine, not yet synced
    real = fileio.pwrite

    def torn(fd: int, data: bytes, off: int) -> int:
        fileio.pwrite = lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
        return real(fd, bytes(data[:100]), off)

    fileio.pwrite = torn
    with pytest.raises(OSError):
        of.write_window(8, [9, 10])
    fileio.reset()
    of.writeout()  # must not make the torn slot the anchor
    of.write_window(11, [])
    assert slots(tmp_path)[anchor] == anchor_bytes
    crash(of)
    assert loaded(tmp_path)[1] == (11, [])


def test_close_persists_and_levels(tmp_path: Path) -> None:
    of, _ = loaded(tmp_path)
    of.close(41, [43, 50])
    of.close(99, [])  # closed: no-op
    assert (tmp_path / "consumer.offset").read_bytes() == (41).to_bytes(8, "big")
    assert not (tmp_path / "consumer.offset.tmp").exists()
    assert loaded(tmp_path)[1] == (41, [43, 50])


def test_marks_recoverable_holds_every_window_written_since_the_last_sync(tmp_path: Path) -> None:
    """Held marks a load could bring back: a power loss may leave any window written
    since the last sync (the kernel writes the page back when it likes), not only the
    last one. A mark written then cleared before a sync stays recoverable until the
    sync that makes a window without it the anchor. (The dead-letter driver keeps an
    offset listed as sent while a load could still find it marked.)"""
    f = OffsetFile(tmp_path)
    f.load()
    assert f.marks_recoverable() == set()
    f.write_window(-1, [], {5: 1, 6: 1}, {}, [5, 6])  # W1: 5 and 6 held
    f.write_window(-1, [5], {6: 1}, {}, [6])  # W2: 5 settled, 6 still held
    assert f.marks_recoverable() == {5, 6}  # W1 may be what a power loss leaves
    f.writeout()  # W2 is the anchor now
    assert f.marks_recoverable() == {6}
    f.write_window(6, [], {}, {}, [])  # 6 settled, not synced yet
    assert f.marks_recoverable() == {6}
    f.writeout()
    assert f.marks_recoverable() == set()
