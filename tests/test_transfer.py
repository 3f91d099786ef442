"""Partition copy primitives on real files: listings of open and closed logs stop at
the high watermark (never the hidden tail), a chunked copy into Staging verifies
and installs with positions clamped, cut-back and retention at the source, resume
after a restart (and after a reboot), quarantine of an existing copy, a failed
install retried."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from narad.storage import cursor_file as CF
from narad.storage import fileio
from narad.storage import frames as FR
from narad.storage import offsets as OFF
from narad.storage import partition_log as PL
from narad.storage import transfer as TR
from narad.storage.offsets import OffsetFile
from narad.storage.partition_log import PartitionLog


@pytest.fixture(autouse=True)
def _reset_seam() -> Iterator[None]:
    yield
    fileio.reset()


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TR, "CHUNK_MAX", 200)


def payload(off: int) -> bytes:
    return f"record-{off}-".encode() * (1 + off % 5)


def commit(plog: PartitionLog, n: int, *, publish: bool = True) -> None:
    ts = plog.committed_at()
    offs = range(plog.next_offset, plog.next_offset + n)
    envs = [FR.encode_record(None, ts, FR.F_UTF8, payload(o)) for o in offs]
    res = plog.write_commit(envs)
    if publish:
        plog.publish(*res, [(None, ts, FR.F_UTF8, payload(o)) for o in offs])


def source_log(d: Path, batches: list[int], *, hidden: int = 0) -> PartitionLog:
    """Sealed segments (512 bytes each) and an active one; `hidden` records written
    and synced but never published (the hidden tail)."""
    plog = PartitionLog(d, segment_bytes=512)
    plog.open()
    for n in batches:
        commit(plog, n)
    if hidden:
        commit(plog, hidden, publish=False)
    return plog


def verified_copy(tmp_path: Path, batches: list[int]) -> tuple[TR.Staging, Path, int]:
    """A source log of `batches` under tmp_path/s, copied whole into a staging of
    tmp_path/d and verified: (the staging, the final partition directory, the hwm)."""
    src = tmp_path / "s" / "p00000"
    plog = source_log(src, batches)
    hwm, segs = TR.list_open(plog)
    plog.close()
    final = tmp_path / "d" / "p00000"
    st = TR.Staging(final)
    copy_all(src, st, segs)
    assert st.verify(hwm) is None
    return st, final, hwm


def copy_all(src: Path, st: TR.Staging, segs: list[TR.SegInfo]) -> int:
    """Fetch every range the plan asks for; returns how many chunks."""
    ranges = st.plan(segs)
    for base, off, n in ranges:
        data = TR.read_chunk(src, base, off, n)
        assert len(data) == n
        st.write(base, off, data)
    st.durable()
    return len(ranges)


def records(d: Path) -> tuple[int, list[bytes]]:
    plog = PartitionLog(d)
    plog.open()
    try:
        return plog.hwm, [plog.read(o)[3] for o in range(plog.oldest, plog.hwm)]
    finally:
        plog.close(clean=False)


def sealed_log(d: Path, groups: list[list[int]], *, hidden: int = 0) -> PartitionLog:
    """64 MiB segments, each group of commits sealed by an idle roll (the last group
    stays active); `hidden` records never published, in the active segment."""
    plog = PartitionLog(d)
    plog.open()
    for i, group in enumerate(groups):
        for n in group:
            commit(plog, n)
        if i + 1 < len(groups):
            assert plog.roll_idle_active(1, 10**15)
    if hidden:
        commit(plog, hidden, publish=False)
    return plog


def test_listing_stops_at_the_hwm_never_the_hidden_tail(tmp_path: Path) -> None:
    src = tmp_path / "src" / "p00000"
    plog = sealed_log(src, [[3, 3], [4], [2, 2, 2]], hidden=2)
    try:
        assert len(plog.segments) == 3 and plog.hwm == 16 and plog.next_offset == 18
        hwm, segs = TR.list_open(plog)
        assert hwm == 16
        assert [s.base for s in segs] == [0, 6, 10]
        for s, seg in zip(segs, plog.segments, strict=True):
            assert s.mtime_ms == seg.path.stat().st_mtime_ns // 1_000_000
        for s, seg in zip(segs[:-1], plog.segments[:-1], strict=True):
            assert s.size == seg.path.stat().st_size == seg.size
        active = plog.segments[-1]
        assert segs[-1].size < active.path.stat().st_size  # the hidden frame is in the file
        head = TR.read_chunk(src, active.base, segs[-1].size, FR.HEADER_SIZE)
        assert FR.parse_header(head)[:2] == (2, hwm)  # and it is what follows the listing
    finally:
        plog.close()
    # closed after a clean close (hwm file below the tail): the same listing
    assert TR.list_closed(src) == (hwm, segs)
    # and a real open of that directory agrees; reopened, the hidden frame is indexed
    again = PartitionLog(src)
    again.open()
    try:
        assert again.hwm == hwm and again.next_offset == hwm + 2
        assert TR.list_open(again) == (hwm, segs)
    finally:
        again.close(clean=False)


def test_a_hidden_commit_that_rolled_is_not_listed(tmp_path: Path) -> None:
    src = tmp_path / "src" / "p00000"
    plog = source_log(src, [3, 3, 3], hidden=30)  # 30 records never fit the 512-byte segment: a roll
    try:
        hwm, segs = TR.list_open(plog)
        assert hwm == 9
        on_disk = sorted(int(p.name[:-4]) for p in src.glob("*.log"))
        assert on_disk[-1] == hwm and hwm not in [s.base for s in segs]
        assert segs[-1].size == (src / TR._seg_name(segs[-1].base)).stat().st_size
    finally:
        plog.close()
    st = TR.Staging(tmp_path / "d" / "p00000")
    copy_all(src, st, segs)
    assert st.verify(hwm) is None


def test_list_closed_follows_open_recovery(tmp_path: Path) -> None:
    d = tmp_path / "p00001"
    plog = source_log(d, [4, 4, 4], hidden=3)
    plog.close(clean=False)  # a crash: the hwm file was emptied at the first advance
    assert (d / "hwm").read_bytes() == b""
    with open(PL._seg_path(d, plog.segments[-1].base), "ab") as fh:
        fh.write(b"\xca\xfe torn tail")
    hwm, segs = TR.list_closed(d)
    before = {p.name: p.stat().st_size for p in d.iterdir()}
    real = PartitionLog(d)
    real.open()  # cuts the torn tail; the hidden records become visible (tail)
    try:
        assert hwm == real.hwm == real.next_offset == 15
        assert segs[-1].size == real.segments[-1].size
    finally:
        real.close(clean=False)
    assert before[PL._seg_path(d, segs[-1].base).name] > segs[-1].size  # list_closed cut nothing
    # a damaged hwm file (no frame boundary) is ignored as open ignores it
    (d / "hwm").write_bytes(PL._U64.pack(13))
    assert TR.list_closed(d)[0] == 15
    (d / "hwm").write_bytes(PL._U64.pack(12))  # a frame boundary: believed, tail hidden
    hwm3, segs3 = TR.list_closed(d)
    assert hwm3 == 12 and segs3[-1].size < segs[-1].size
    assert TR.list_closed(tmp_path / "missing") == (0, [])


def test_chunked_copy_verifies_and_installs_with_positions_clamped(tmp_path: Path, small_chunks: None) -> None:
    src = tmp_path / "a" / "topics" / "t@1" / "p00002"
    plog = source_log(src, [5] * 20, hidden=4)
    hwm, segs = TR.list_open(plog)
    final = tmp_path / "b" / "topics" / "t@1" / "p00002"
    st = TR.Staging(final)
    assert st.dir == TR.staging_dir(final) == final.with_name("p00002.staging")
    n = copy_all(src, st, segs)
    assert n > len(segs)  # segments bigger than a chunk went in several
    assert st.staged() == {s.base: s.size for s in segs}
    assert st.plan(segs) == []  # nothing left to fetch
    assert st.verify(hwm) is None
    assert st.verify(hwm - 5) is not None and st.verify(hwm + 4) is not None
    assert st.recovers_to() == hwm
    with pytest.raises(ValueError):  # the last verify failed: no install
        st.install(hwm=hwm, frontier=0, ahead=[], cursors={}, marker={}, seg_mtimes={})
    assert st.verify(hwm) is None
    # the source clock: one segment an hour old, one stamped 2 h in the future (not believed)
    old = segs[0].mtime_ms - 3_600_000
    future = segs[1].mtime_ms + 7_200_000
    got = st.install(hwm=hwm, frontier=hwm + 10, ahead=[3, hwm - 1, hwm, hwm + 5],
                     cursors={"child-a": ("e1", hwm + 7), "child-b": ("e2", 17)},
                     marker={"source": "n1", "target": "n2", "token": "tok", "forced": False},
                     seg_mtimes={segs[0].base: old, segs[1].base: future})
    plog.close()
    assert got is None and final.is_dir() and not st.dir.exists()
    assert sorted(p.name for p in final.iterdir()) == sorted(
        [TR._seg_name(s.base) for s in segs] + ["consumer.ahead", "consumer.offset", "fanout-child-a.offset",
                                                 "fanout-child-b.offset", "hwm", "move.marker"])
    # the copy is the source below its hwm, the hidden tail left behind
    assert records(final) == (hwm, [payload(o) for o in range(hwm)])
    # clamped: frontier <= hwm-1, nothing held, cursors <= hwm
    assert OFF.peek(final, max_frontier=hwm - 1) == (hwm - 1, [])
    assert OffsetFile(final).load(max_frontier=hwm - 1) == (hwm - 1, [])
    assert CF.CursorFile(final, "child-a").read() == CF.CursorState("e1", hwm)
    assert CF.CursorFile(final, "child-b").read() == CF.CursorState("e2", 17)
    assert PL._U64.unpack((final / "hwm").read_bytes())[0] == hwm
    mk = TR.read_marker(final)
    assert mk is not None and mk["hwm"] == hwm and mk["source"] == "n1" and mk["token"] == "tok"
    assert isinstance(mk["durable_at_ms"], int) and mk["durable_at_ms"] > 0
    seg0 = final / TR._seg_name(segs[0].base)
    assert seg0.stat().st_mtime_ns // 1_000_000 == old
    assert (final / TR._seg_name(segs[1].base)).stat().st_mtime_ns // 1_000_000 != future


def test_install_keeps_held_acks_below_the_hwm(tmp_path: Path) -> None:
    st, final, hwm = verified_copy(tmp_path, [10, 10])
    st.install(hwm=hwm, frontier=4, ahead=[2, 6, 9, 19, 20, 30], cursors={}, marker={}, seg_mtimes={})
    assert OffsetFile(final).load(max_frontier=hwm - 1) == (4, [6, 9, 19])


def test_cut_back_and_retention_at_the_source(tmp_path: Path, small_chunks: None) -> None:
    src = tmp_path / "s" / "p00000"
    plog = source_log(src, [5] * 12)
    hwm, segs = TR.list_open(plog)
    plog.close()
    st = TR.Staging(tmp_path / "d" / "p00000")
    copy_all(src, st, segs)
    assert st.verify(hwm) is None
    # the source lists again: its oldest segment gone (retention) and the active one
    # shorter (a lower hwm): the staged copy follows, nothing left to fetch
    (src / "hwm").write_bytes(PL._U64.pack(hwm - 5))
    hwm2, segs2 = TR.list_closed(src)
    assert hwm2 == hwm - 5 and segs2[-1].size < segs[-1].size
    segs2 = segs2[1:]
    assert st.plan(segs2) == []
    assert st.staged() == {s.base: s.size for s in segs2}
    assert not (st.dir / TR._seg_name(segs[0].base)).exists()
    assert st.verify(hwm2) is None
    assert st.verify(hwm) is not None
    # a chunk that does not continue the staged file, or runs past the listing, is refused
    last = segs2[-1]
    with pytest.raises(ValueError):
        st.write(last.base, last.size + 1, b"x")
    with pytest.raises(ValueError):
        st.write(last.base, last.size, b"x")
    # a listing no source can produce is refused, the staged copy untouched
    for bad in ([TR.SegInfo(5, 10, 0), TR.SegInfo(5, 10, 0)], [TR.SegInfo(0, TR.MAX_SEGMENT_BYTES + 1, 0)],
                [TR.SegInfo(-1, 0, 0)], [TR.SegInfo(0, -1, 0)]):
        with pytest.raises(ValueError):
            st.plan(bad)
    assert st.staged() == {s.base: s.size for s in segs2} and st.verify(hwm2) is None


def test_verify_refuses_a_short_or_damaged_copy(tmp_path: Path) -> None:
    src = tmp_path / "s" / "p00000"
    plog = source_log(src, [6] * 8)
    hwm, segs = TR.list_open(plog)
    plog.close()
    st = TR.Staging(tmp_path / "d" / "p00000")
    ranges = st.plan(segs)
    for base, off, n in ranges[:-1]:
        st.write(base, off, TR.read_chunk(src, base, off, n))
    assert st.verify(hwm) is not None  # the last range missing
    base, off, n = ranges[-1]
    data = bytearray(TR.read_chunk(src, base, off, n))
    data[-3] ^= 0x55  # the last frame's payload damaged
    st.write(base, off, bytes(data))
    st.durable()
    reason = st.verify(hwm)
    assert reason is not None and "recovers to" in reason
    # open cut the torn frame: planning again fetches it, and the copy verifies
    again = st.plan(segs)
    assert again and again[0][0] == segs[-1].base
    for b, o, k in again:
        st.write(b, o, TR.read_chunk(src, b, o, k))
    assert st.verify(hwm) is None


def test_resume_after_restart_and_after_reboot(tmp_path: Path, small_chunks: None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "s" / "p00000"
    plog = source_log(src, [5] * 10)
    hwm, segs = TR.list_open(plog)
    plog.close()
    final = tmp_path / "d" / "p00000"
    st = TR.Staging(final)
    ranges = st.plan(segs)
    half = len(ranges) // 2
    for base, off, n in ranges[:half]:
        st.write(base, off, TR.read_chunk(src, base, off, n))
    st.durable()
    synced = st.staged()
    base, off, n = ranges[half]
    st.write(base, off, TR.read_chunk(src, base, off, n))  # written, never synced
    written = st.staged()
    # a process restart (same boot): everything written is still there
    st2 = TR.Staging(final)
    assert st2.staged() == written
    assert st2.plan(segs) == ranges[half + 1:]
    # a reboot: bytes past what was synced are not trusted
    monkeypatch.setattr(TR, "_boot_id", lambda: "another-boot")
    st3 = TR.Staging(final)
    assert st3.staged() == synced
    rest = st3.plan(segs)
    assert rest == ranges[half:]
    for b, o, k in rest:
        st3.write(b, o, TR.read_chunk(src, b, o, k))
    st3.durable()
    assert st3.verify(hwm) is None
    assert st3.install(hwm=hwm, frontier=-1, ahead=[], cursors={}, marker={"token": "x"}, seg_mtimes={}) is None
    assert records(final) == (hwm, [payload(o) for o in range(hwm)])
    assert not (final / TR.STATE_FILE).exists()


def test_unreadable_state_trusts_nothing(tmp_path: Path) -> None:
    src = tmp_path / "s" / "p00000"
    plog = source_log(src, [5, 5])
    _hwm, segs = TR.list_open(plog)
    plog.close()
    final = tmp_path / "d" / "p00000"
    copy_all(src, TR.Staging(final), segs)
    (TR.staging_dir(final) / TR.STATE_FILE).write_bytes(b"{not json")
    assert set(TR.Staging(final).staged().values()) == {0}


def test_existing_copy_with_records_is_quarantined_never_deleted(tmp_path: Path) -> None:
    topics = tmp_path / "d" / "topics"
    src = tmp_path / "s" / "p00003"
    plog = source_log(src, [4, 4])
    hwm, segs = TR.list_open(plog)
    plog.close()
    final = topics / "orders@abc" / "p00003"
    old = source_log(final, [2])
    old.close()
    old_bytes = sum(p.stat().st_size for p in final.iterdir())
    st = TR.Staging(final)
    copy_all(src, st, segs)
    assert st.verify(hwm) is None
    aside = st.install(hwm=hwm, frontier=1, ahead=[], cursors={}, marker={}, seg_mtimes={})
    assert aside is not None and aside.name == "p00003.quarantine-install_conflict-1"
    assert records(aside) == (2, [payload(0), payload(1)])
    assert records(final) == (hwm, [payload(o) for o in range(hwm)])
    for other_topic in ("a@1", "zz@2", "orders@old"):  # other topics, one with a plain partition dir
        (topics / other_topic / "p00000").mkdir(parents=True)
    (topics / "stray-file").write_bytes(b"")
    q = TR.quarantined(topics)
    assert [(k, t, p, d) for k, t, p, d, _b, _m in q] == [("install_conflict", "orders", 3, aside)]
    assert q[0][4] == old_bytes and q[0][5] > 0
    # a second quarantine of the same kind takes the next number
    other = TR.quarantine(final, "install_conflict")
    assert other.name == "p00003.quarantine-install_conflict-2" and not final.exists()
    assert len(TR.quarantined(topics)) == 2
    with pytest.raises(ValueError):
        TR.quarantine(other, "../x")
    # a staged copy set aside (unverifiable) is listed too
    st2 = TR.Staging(final)
    st2.plan(segs)
    unver = TR.quarantine(st2.dir, "unverifiable")
    assert unver.name == "p00003.staging.quarantine-unverifiable-1"
    assert ("unverifiable", "orders", 3, unver) in [r[:4] for r in TR.quarantined(topics)]


def test_existing_copy_without_records_is_replaced(tmp_path: Path) -> None:
    src = tmp_path / "s" / "p00000"
    plog = source_log(src, [3])
    hwm, segs = TR.list_open(plog)
    plog.close()
    final = tmp_path / "d" / "p00000"
    empty = PartitionLog(final)
    empty.open()
    empty.close()
    OffsetFile(final).load()
    st = TR.Staging(final)
    copy_all(src, st, segs)
    assert st.verify(hwm) is None
    assert st.install(hwm=hwm, frontier=-1, ahead=[], cursors={}, marker={}, seg_mtimes={}) is None
    assert records(final) == (hwm, [payload(o) for o in range(hwm)])
    assert TR.quarantined(tmp_path / "d") == []


def test_failed_install_is_retried_from_staging(tmp_path: Path) -> None:
    src = tmp_path / "s" / "p00000"
    plog = source_log(src, [4] * 6)
    hwm, segs = TR.list_open(plog)
    plog.close()
    final = tmp_path / "d" / "p00000"
    st = TR.Staging(final)
    copy_all(src, st, segs)
    assert st.verify(hwm) is None
    real = fileio.fdatasync

    def failing(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".move.marker.tmp"):
            raise OSError(5, "injected EIO")
        real(fd)

    fileio.fdatasync = failing
    with pytest.raises(OSError):
        st.install(hwm=hwm, frontier=5, ahead=[7], cursors={"c": ("e", 3)}, marker={}, seg_mtimes={})
    fileio.reset()
    assert not final.exists() and (st.dir / "consumer.ahead").exists()
    st2 = TR.Staging(final)
    assert st2.plan(segs) == []
    assert st2.verify(hwm) is None
    st2.install(hwm=hwm, frontier=2, ahead=[], cursors={}, marker={"token": "t2"}, seg_mtimes={})
    assert OffsetFile(final).load(max_frontier=hwm - 1) == (2, [])
    assert not list(final.glob("fanout-*")) and not list(final.glob(".*"))
    assert TR.read_marker(final)["token"] == "t2"  # type: ignore[index]


def test_an_idle_rolled_log_and_an_empty_one_copy(tmp_path: Path) -> None:
    src = tmp_path / "s" / "p00000"
    plog = source_log(src, [3, 3])
    assert plog.roll_idle_active(1, 10**15)  # sealed; a new empty active at the hwm
    hwm, segs = TR.list_open(plog)
    plog.close()
    assert segs[-1] .base == hwm and segs[-1].size == 0
    final = tmp_path / "d" / "p00000"
    st = TR.Staging(final)
    copy_all(src, st, segs)
    assert st.verify(hwm) is None
    st.install(hwm=hwm, frontier=-1, ahead=[], cursors={}, marker={}, seg_mtimes={})
    assert records(final) == (hwm, [payload(o) for o in range(hwm)])
    # a partition with no files at the source: an empty copy
    st0 = TR.Staging(tmp_path / "d" / "p00001")
    assert st0.plan(TR.list_closed(tmp_path / "s" / "p00001")[1]) == []
    assert st0.verify(0) is None and st0.verify(1) is not None
    st0.discard()
    assert not st0.dir.exists()


def test_marker_moved_aside_and_chunk_reads(tmp_path: Path) -> None:
    d = tmp_path / "t@1" / "p00000"
    plog = source_log(d, [3])
    plog.close()
    with pytest.raises(PL.LogClosed):
        TR.list_open(plog)
    assert TR.read_marker(d) is None
    (d / "move.marker").write_text("[1]")
    assert TR.read_marker(d) is None
    (d / "move.marker").write_text(json.dumps({"hwm": 3}))
    assert TR.read_marker(d) == {"hwm": 3}
    size = (d / TR._seg_name(0)).stat().st_size
    assert TR.read_chunk(d, 0, size - 4, 100) == (d / TR._seg_name(0)).read_bytes()[-4:]
    assert TR.read_chunk(d, 0, size + 10, 100) == b""
    assert len(TR.read_chunk(d, 0, 0, 10 << 20)) == size  # capped at CHUNK_MAX, short at EOF
    with pytest.raises(FileNotFoundError):
        TR.read_chunk(d, 99, 0, 10)
    with pytest.raises(ValueError):
        TR.read_chunk(d, 0, -1, 10)
    moved = TR.moved_aside(d, "tok-1")
    assert moved.name == "p00000.moved-tok-1" and not d.exists()
    assert TR.moved_aside(d, "tok-1") == moved  # a retry after the rename
    with pytest.raises(ValueError):
        TR.moved_aside(d, "../evil")
    assert TR.quarantined(tmp_path) == []  # moved aside is no quarantine


def test_listings_taken_under_live_commits_each_verify(tmp_path: Path) -> None:
    """A committer thread writes and publishes (with rolls) while listings are taken:
    every listing, copied, recovers to exactly its own hwm."""
    src = tmp_path / "s" / "p00000"
    plog = PartitionLog(src, segment_bytes=2048)
    plog.open()
    stop = threading.Event()

    def committer() -> None:
        while not stop.is_set():
            commit(plog, 1 + plog.next_offset % 4)

    t = threading.Thread(target=committer)
    t.start()
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 30
        k = 0
        while (len(seen) < 8 or k < 8) and time.monotonic() < deadline:
            hwm, segs = TR.list_open(plog)
            st = TR.Staging(tmp_path / "d" / f"p{k:05d}")
            copy_all(src, st, segs)
            assert st.verify(hwm) is None, (hwm, segs)
            st.discard()
            seen.add(hwm)
            k += 1
    finally:
        stop.set()
        t.join()
        plog.close()
    assert len(seen) >= 8 and len(plog.segments) > 2


def test_a_failed_sync_fetches_the_unsynced_bytes_again(tmp_path: Path) -> None:
    src = tmp_path / "s" / "p00000"
    plog = source_log(src, [5] * 6)
    hwm, segs = TR.list_open(plog)
    plog.close()
    st = TR.Staging(tmp_path / "d" / "p00000")
    ranges = st.plan(segs)
    half = len(ranges) // 2
    for base, off, n in ranges[:half]:
        st.write(base, off, TR.read_chunk(src, base, off, n))
    st.durable()
    synced = st.staged()
    for base, off, n in ranges[half:]:
        st.write(base, off, TR.read_chunk(src, base, off, n))

    def eio(fd: int) -> None:
        raise OSError(5, "injected EIO")

    fileio.fdatasync = eio
    with pytest.raises(OSError):
        st.durable()
    fileio.reset()
    # the file whose sync failed is back at what was synced before; the rest still counts
    # as unsynced, and everything not proven is fetched again
    failed = ranges[half][0]
    assert st.staged()[failed] == synced.get(failed, 0)
    rest = st.plan(segs)
    assert rest and rest[0][0] == failed
    for base, off, n in rest:
        st.write(base, off, TR.read_chunk(src, base, off, n))
    st.durable()
    assert st.verify(hwm) is None


def test_install_refuses_bad_input_before_writing_anything(tmp_path: Path) -> None:
    src = tmp_path / "s" / "p00000"
    plog = source_log(src, [3])
    hwm, segs = TR.list_open(plog)
    plog.close()
    final = tmp_path / "d" / "p00000"
    st = TR.Staging(final)
    with pytest.raises(ValueError):
        st.write(0, 0, b"x")  # no plan yet
    copy_all(src, st, segs)
    assert st.verify(hwm) is None
    before = sorted(p.name for p in st.dir.iterdir())
    bad: list[dict[str, object]] = [{"hwm": hwm - 1}, {"cursors": {"../x": ("e", 1)}},
                                    {"cursors": {"c": ("e" * 300, 1)}}, {"marker": {"x": object()}}]
    for kw in bad:
        args: dict[str, object] = {"hwm": hwm, "frontier": 0, "ahead": [], "cursors": {}, "marker": {},
                                   "seg_mtimes": {}}
        args.update(kw)
        with pytest.raises((ValueError, TypeError)):
            st.install(**args)  # type: ignore[arg-type]
    assert sorted(p.name for p in st.dir.iterdir()) == before and not final.exists()
    # still verified: the good install goes through; a chunk written after a verify needs another
    assert st.install(hwm=hwm, frontier=0, ahead=[], cursors={}, marker={}, seg_mtimes={}) is None
    st2 = TR.Staging(tmp_path / "d" / "p00001")
    ranges = st2.plan(segs)
    base, off, n = ranges[0]
    st2.write(base, off, TR.read_chunk(src, base, off, n - 1))
    assert st2.verify(hwm) is not None
    st2.write(base, off + n - 1, TR.read_chunk(src, base, off + n - 1, 1))
    for b, o, k in ranges[1:]:
        st2.write(b, o, TR.read_chunk(src, b, o, k))
    assert st2.verify(hwm) is None
    assert st2.recovers_to() == hwm


def test_an_install_renamed_back_to_staging_resumes_without_fetching_again(tmp_path: Path) -> None:
    """The move runner undoes an install whose flip did not commit by renaming the
    partition directory back to staging: the copy is trusted as synced (it was,
    before its hwm file was written) and installs again as it is."""
    src = tmp_path / "s" / "p00000"
    plog = source_log(src, [5] * 6)
    hwm, segs = TR.list_open(plog)
    plog.close()
    final = tmp_path / "d" / "p00000"
    st = TR.Staging(final)
    assert not st.dir.exists()  # constructing it touched nothing
    copy_all(src, st, segs)
    assert st.verify(hwm) is None
    st.install(hwm=hwm, frontier=3, ahead=[], cursors={}, marker={"token": "a"}, seg_mtimes={})
    os.rename(final, TR.staging_dir(final))
    os.unlink(TR.staging_dir(final) / "move.marker")
    st2 = TR.Staging(final)
    assert st2.staged() == {s.base: s.size for s in segs}
    assert st2.plan(segs) == []
    assert st2.verify(hwm) is None
    st2.install(hwm=hwm, frontier=4, ahead=[], cursors={}, marker={"token": "b"}, seg_mtimes={})
    assert records(final) == (hwm, [payload(o) for o in range(hwm)])
    assert OffsetFile(final).load(max_frontier=hwm - 1) == (4, [])


def test_install_keeps_the_delivery_counts_of_unacked_offsets(tmp_path: Path) -> None:
    """Issue 14: a move carries the source's delivery counts; the install keeps those of
    offsets above the frontier, below the hwm and not acked."""
    st, final, hwm = verified_copy(tmp_path, [10])
    st.install(hwm=hwm, frontier=2, ahead=[5], cursors={}, marker={}, seg_mtimes={},
               counts={1: 4, 3: 2, 5: 7, 9: 3, 10: 8, 40: 1})
    assert OFF.peek_counts(final, max_frontier=hwm - 1) == (2, [5], {3: 2, 9: 3})
    of = OffsetFile(final)
    assert of.load(max_frontier=hwm - 1) == (2, [5]) and of.counts == {3: 2, 9: 3}


def test_stale_copy_sweep_skips_quarantined_moved_aside_copies(tmp_path: Path) -> None:
    """A moved-aside copy the sweep quarantined (``p.moved-<token>.quarantine-...``) is not a
    candidate again: it was once re-quarantined every sweep until its name grew too long."""
    from narad.broker.moves import _stale_candidates

    top = tmp_path / "orders@t1"
    for name in ("p00000", "p00001.moved-tok", "p00002.moved-tok.quarantine-stale_copy-0",
                 "p00003.staging", "p00004.quarantine-stale_copy-0", "junk"):
        (top / name).mkdir(parents=True)
    got = [(t, tid, p, d.name, moved) for t, tid, p, d, moved in _stale_candidates(tmp_path)]
    assert got == [("orders", "t1", 0, "p00000", False), ("orders", "t1", 1, "p00001.moved-tok", True)]
    q = TR.quarantine(top / "p00001.moved-tok", "stale_copy")
    assert [d.name for *_, d, _m in _stale_candidates(tmp_path)] == ["p00000"]
    assert [x[3] for x in TR.quarantined(tmp_path)] == sorted([top / "p00002.moved-tok.quarantine-stale_copy-0", q,
                                                               top / "p00004.quarantine-stale_copy-0"])


def test_install_writes_the_held_records_counts_first_when_the_slot_is_short(tmp_path: Path) -> None:
    """More counts than an offset slot holds: the install keeps what fits, and the
    counts of the records the source held for the dead-letter topic (``dead``) first, so
    the new owner holds them again instead of delivering them (they were dropped like
    any other when other counts were higher). Found by a review of issue 14."""
    st, final, hwm = verified_copy(tmp_path, [1000, 1000, 1000])
    counts = {o: 3 for o in range(hwm)}
    dead = [hwm - 2, hwm - 1]
    for o in dead:
        counts[o] = 2  # (a lowered maximum: the held records are not the highest counts)
    st.install(hwm=hwm, frontier=-1, ahead=[], cursors={}, marker={}, seg_mtimes={}, counts=counts, dead=dead)
    _f, _a, kept = OFF.peek_counts(final, max_frontier=hwm - 1)
    assert len(kept) < len(counts)  # the slot was short
    assert all(kept.get(o) == 2 for o in dead), {o: kept.get(o) for o in dead}


def test_install_carries_the_dead_letter_target_and_clears_a_leftover_one(tmp_path: Path) -> None:
    """A move's install writes the source's ``dead_letter.target`` (the dead-letter
    topic and the offsets sent there) beside the held marks: at the new owner a lift
    then keeps a sent record held, whose copy may exist, instead of delivering it. An
    install without one leaves none behind from an interrupted earlier try."""
    from narad.storage import dlq_target as DT

    st, final, hwm = verified_copy(tmp_path, [1000, 1000])
    DT.write(st.dir, "stale", "00" * 8, [0])  # (an interrupted earlier install's)
    st.install(hwm=hwm, frontier=-1, ahead=[], cursors={}, marker={}, seg_mtimes={}, dead=[hwm - 1],
               dlq=("t-dlq", "11" * 8, [hwm - 1]))
    assert DT.read(final) == ("t-dlq", "11" * 8, {hwm - 1})
    st2, final2, hwm2 = verified_copy(tmp_path / "b", [1000])
    DT.write(st2.dir, "stale", "00" * 8, [0])
    st2.install(hwm=hwm2, frontier=-1, ahead=[], cursors={}, marker={}, seg_mtimes={})
    assert DT.read(final2) is None
