"""Property-based fuzzing (hypothesis) of every decoder that reads untrusted
bytes: partition-log frames and record envelopes, the ingress WAL, consumer
offset slots, the Raft journal, snapshot headers, local and node RPC frames,
batch produce / ack bodies and receipt handles.

Each property feeds random bytes and mutations of valid encodings (bit flips,
truncation, splices). Only the decoder's documented refusal may come out (a
specific exception type, or a None / skip result); never IndexError,
struct.error, UnicodeDecodeError, RecursionError, MemoryError and the like.
And nothing is fabricated: a decoder fed a mutated valid encoding gives back
the original value or refuses.

Where a decoder is only reachable through a class (the partition log, the WAL,
the offset file, the journal), the class is driven on a temporary directory
holding the mutated file. Bounded for CI: a fixed example budget per property,
derandomized (reproducible), no example database.
"""

from __future__ import annotations

import asyncio
import os
import random
import struct
import tempfile
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narad.api import messages as M
from narad.cluster import transport as T
from narad.ipc import rpc
from narad.meta import journal as J
from narad.meta import raft as R
from narad.storage import fileio
from narad.storage import frames as FR
from narad.storage import offsets as O
from narad.storage import wal as WAL
from narad.storage.partition_log import CorruptRecord, OffsetGone, PartitionLog
from narad.storage.wal import Entry, IngressWAL
from tests.test_partition import _partition

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FAST = settings(FUZZ, max_examples=300)

# Exceptions that are a decoder bug when they escape (everything but the documented refusal).
_BUGS = (IndexError, struct.error, UnicodeDecodeError, RecursionError, MemoryError, OverflowError, KeyError,
         TypeError, AttributeError, ZeroDivisionError)


@pytest.fixture(autouse=True)
def _reset_seam() -> Iterator[None]:
    yield
    fileio.reset()


# ---- mutations ------------------------------------------------------------------------------------

@st.composite
def mutation(draw: Any, size_hint: int = 1 << 16) -> list[tuple[str, float, int]]:
    """A list of edits, positions as fractions of the file size (applied by `mutate`)."""
    kinds = st.sampled_from(["flip", "flip", "byte", "truncate", "zero", "dup"])
    return draw(st.lists(st.tuples(kinds, st.floats(0, 1, allow_nan=False), st.integers(0, 255)),
                         min_size=1, max_size=4))


def mutate(data: bytes, edits: list[tuple[str, float, int]]) -> bytes:
    b = bytearray(data)
    for kind, where, val in edits:
        if not b:
            break
        pos = min(len(b) - 1, int(where * len(b)))
        if kind == "flip":
            b[pos] ^= 1 << (val % 8)
        elif kind == "byte":
            b[pos] = val if b[pos] != val else val ^ 0xFF
        elif kind == "truncate":
            del b[pos:]
        elif kind == "zero":
            b[pos : pos + 1 + val] = bytes(len(b[pos : pos + 1 + val]))
        elif kind == "dup":  # a splice: a run of the file copied over another place
            src = int((val / 255) * len(b))
            run = bytes(b[src : src + 32])
            b[pos : pos + len(run)] = run
    return bytes(b)


def untouched(orig: bytes, bad: bytes, start: int, end: int) -> bool:
    """The bytes [start, end) of `orig` are all still there, unchanged, in `bad`."""
    return end <= len(bad) and orig[start:end] == bad[start:end]


def first_diff(a: bytes, b: bytes) -> int:
    """Index of the first byte where the files differ (len(a) when b extends or equals a)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n if len(a) != len(b) else len(a)


# ---- partition log frames and record envelopes -----------------------------------------------------

def _valid_frame(seed: int) -> tuple[bytes, list[tuple[bytes | None, int, int, bytes]]]:
    rnd = random.Random(seed)
    recs = []
    for _ in range(rnd.randint(1, 5)):
        key = None if rnd.random() < 0.3 else rnd.randbytes(rnd.randint(1, 20))
        recs.append((key, rnd.randint(0, 1 << 50), rnd.choice([0, FR.F_UTF8, FR.F_UTF8 | FR.F_JSON]),
                     rnd.randbytes(rnd.randint(0, 64))))
    env = [FR.encode_record(k, ts, f, p) for k, ts, f, p in recs]
    expect = [(k, ts, f if k is None else f | FR.F_KEY, p) for k, ts, f, p in recs]
    return FR.encode_frame(rnd.randint(0, 1 << 40), env), expect


def decode_frame(buf: bytes) -> list[tuple[bytes | None, int, int, bytes]]:
    """The read path of one frame: header, CRC, records. Raises FrameError only."""
    count, base, size, crc = FR.parse_header(buf, 0)
    if len(buf) < FR.HEADER_SIZE + size or not FR.frame_crc_ok(buf, 0, count, base, size, crc):
        raise FR.FrameError("bad checksum")
    return [FR.decode_record(r) for r in FR.split_records(memoryview(buf)[FR.HEADER_SIZE : FR.HEADER_SIZE + size],
                                                          count)]


@FAST
@given(st.binary(max_size=300))
def test_frame_random_bytes(data: bytes) -> None:
    for fn in (lambda: FR.parse_header(data, 0), lambda: decode_frame(data)):
        try:
            fn()
        except FR.FrameError:
            pass


@FAST
@given(st.binary(max_size=120))
def test_record_envelope_random_bytes(data: bytes) -> None:
    """decode_record refuses with FrameError (a ValueError) only."""
    try:
        key, ts, _flags, payload = FR.decode_record(data)
    except FR.FrameError:
        return
    assert key is None or len(key) + 11 <= len(data)
    assert 0 <= ts < 1 << 64 and len(payload) <= len(data) - 11


@FAST
@given(st.binary(max_size=200), st.sampled_from([FR.F_EXT, FR.F_EXT | FR.F_JSON | FR.F_UTF8, FR.F_EXT | FR.F_UTF8]))
def test_extension_block_random_bytes(stored: bytes, flags: int) -> None:
    """The block readers never raise but FrameError, agree with each other, and a consume
    renders any stored payload (a damaged block as the stored bytes)."""
    import msgspec

    from narad.api.messages import render
    from narad.broker.peers import Item

    hs, he, pos = FR.plain_block(stored)
    assert pos == -1 or 0 < pos <= len(stored)
    if pos >= 0 and hs > 0:  # headers alone: the full decoder says the same, with the same body start
        ext, at = FR.ext_at(stored)
        assert (at, ext.h, ext.i, ext.d) == (pos, stored[hs:he], None, None)
    elif pos >= 0:  # a key alone: the full decoder accepts it too, with the same body start ...
        assert FR.has_idem(stored) and he == hs == 0
        try:
            ext, at = FR.ext_at(stored)
            assert at == pos and ext.h is None and ext.d is None and isinstance(ext.i, str)
        except FR.FrameError:
            pass  # ... but for a key whose bytes are not UTF-8 (never shown by a consume)
    try:
        _ext, at = FR.ext_at(stored)
        assert 0 < at <= len(stored)
    except FR.FrameError:
        pass
    try:
        out = render("t", Item(0, 1, 2, None, 3, flags, stored), True)
    except UnicodeDecodeError:
        return  # F_UTF8 set on bytes that are not: a record the produce path never writes
    enc = msgspec.json.encode(out)
    if out.headers is None and not flags & FR.F_JSON:
        msgspec.json.decode(enc)  # nothing taken on trust (Raw) in it: always a valid answer
    if out.headers is not None:
        assert bytes(out.headers)[:1] == b"{" and bytes(out.headers)[-1:] == b"}"


@FAST
@given(st.binary(max_size=200), st.integers(-5, 1 << 31))
def test_split_records_random(payload: bytes, count: int) -> None:
    try:
        FR.split_records(payload, count)
    except FR.FrameError:
        pass


@FAST
@given(st.integers(0, 1 << 30), mutation())
def test_frame_mutated_is_original_or_refused(seed: int, edits: list[tuple[str, float, int]]) -> None:
    frame, expect = _valid_frame(seed)
    bad = mutate(frame, edits)
    try:
        got = decode_frame(bad)
    except FR.FrameError:
        return
    assert got == expect, "a damaged frame decoded to records that were never written"


# ---- partition log on disk (active and sealed segments) ----------------------------------------------

def _payload(off: int) -> bytes:
    return f"message-{off}-".encode() * (1 + off % 5)


def _write_log(d: Path, n_commits: int, seg_bytes: int, rnd: random.Random) -> dict[int, bytes]:
    plog = PartitionLog(d, segment_bytes=seg_bytes)
    plog.open()
    written: dict[int, bytes] = {}
    for _ in range(n_commits):
        base = plog.next_offset
        k = rnd.randint(1, 4)
        ts = plog.committed_at()
        envs = [FR.encode_record(None, ts, FR.F_UTF8, _payload(base + i)) for i in range(k)]
        res = plog.write_commit(envs)
        plog.publish(*res, [(None, ts, FR.F_UTF8, _payload(base + i)) for i in range(k)])
        written.update({base + i: _payload(base + i) for i in range(k)})
    if rnd.random() < 0.5:
        plog.close()
    else:  # a crash: nothing written at close (the hwm file, emptied at the first advance, stays empty)
        for s in plog.segments:
            if s.fd >= 0:
                os.close(s.fd)
    return written


def _frames_of(data: bytes) -> list[tuple[int, int, int, int]]:
    """(file position, end position, base offset, count) of each intact frame of a pristine segment."""
    out, pos = [], 0
    while pos + FR.HEADER_SIZE <= len(data):
        count, base, size, _ = FR.parse_header(data, pos)
        out.append((pos, pos + FR.HEADER_SIZE + size, base, count))
        pos += FR.HEADER_SIZE + size
    return out


@FUZZ
@given(st.integers(0, 1 << 30), mutation(), st.booleans())
def test_partition_log_corrupt_segment_never_fabricates(seed: int, edits: list[tuple[str, float, int]],
                                                        sealed: bool) -> None:
    """Damage one segment (the active one, or a sealed one), reopen: every read
    answers the record written at that offset or refuses (CorruptRecord); every
    frame no damaged byte touches is still served (a damaged frame in the middle
    is a gap, never a truncation); nothing past what was written becomes visible."""
    rnd = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "p"
        written = _write_log(d, rnd.randint(3, 25), 600, rnd)
        segs = sorted(d.glob("*.log"))
        if sealed and len(segs) < 2:
            sealed = False
        victim = segs[0] if sealed else segs[-1]
        orig = victim.read_bytes()
        frames = _frames_of(orig)
        bad = mutate(orig, edits)
        victim.write_bytes(bad)
        intact = {base + i for pos, end, base, count in frames if untouched(orig, bad, pos, end) for i in range(count)}
        plog = PartitionLog(d, segment_bytes=600)
        plog.open()
        try:
            assert plog.hwm <= max(written) + 1
            served = set()
            for off in range(plog.hwm):
                try:
                    _k, _ts, _f, payload = plog.read(off)
                except (CorruptRecord, OffsetGone):
                    continue
                assert off in written and payload == written[off], f"fabricated record at offset {off}"
                served.add(off)
            lost = intact - served
            assert not lost, f"records outside the damaged region were not served: {sorted(lost)[:10]}"
        finally:
            plog.close()


@FUZZ
@given(st.integers(0, 1 << 30), st.integers(0, 63))
def test_partition_log_hwm_bitflip_never_hides_committed(seed: int, bit: int) -> None:
    """The hwm file (8 bytes, no checksum) with one flipped bit: a value that is no
    frame boundary is ignored (the verified tail wins), so no committed record
    becomes hidden for good; a value on a boundary below the tail is indistinguishable
    from a real hidden tail and is believed (the damaged bit happened to land there)."""
    rnd = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "p"
        plog = PartitionLog(d)
        plog.open()
        ends = []
        for _ in range(rnd.randint(1, 12)):
            base = plog.next_offset
            k = rnd.randint(2, 6)
            ts = plog.committed_at()
            res = plog.write_commit([FR.encode_record(None, ts, 0, _payload(base + i)) for i in range(k)])
            plog.publish(*res, [(None, ts, 0, _payload(base + i)) for i in range(k)])
            ends.append(base + k)
        plog.close()
        tail = ends[-1]
        raw = (d / "hwm").read_bytes()
        flipped = int.from_bytes(raw, "big") ^ (1 << bit)
        (d / "hwm").write_bytes(flipped.to_bytes(8, "big"))
        again = PartitionLog(d)
        again.open()
        try:
            assert again.hwm == (flipped if flipped in ends or flipped == 0 else tail)
        finally:
            again.close()


# ---- ingress WAL ---------------------------------------------------------------------------------------

def _entry(i: int) -> Entry:
    return Entry(f"topic-{i % 3}", bytes(8), i % 5, 1_700_000_000_000 + i, i % 8,
                 None if i % 4 == 0 else f"key-{i}".encode(), f"payload {i}".encode() * (1 + i % 4))


def _fields(e: Entry) -> tuple[Any, ...]:
    return (e.topic, e.incarnation, e.partition, e.ts_ms, e.flags, e.key, e.payload)


@FAST
@given(st.binary(max_size=200), st.integers(0, 1 << 40))
def test_wal_record_random_bytes(data: bytes, seq: int) -> None:
    try:
        Entry.decode(data, seq)
    except (ValueError, struct.error):  # the refusals replay() catches (UnicodeDecodeError is a ValueError)
        pass


@FUZZ
@given(st.integers(0, 1 << 30), mutation())
def test_wal_corrupt_segment_replays_only_what_was_written(seed: int, edits: list[tuple[str, float, int]]) -> None:
    """Damage the active WAL segment, reopen and replay from the start: every
    replayed entry is the one appended with that seq, and every frame no damaged
    byte touches is replayed (a damaged frame in the middle costs that record only)."""
    rnd = random.Random(seed)
    n = rnd.randint(2, 30)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as pool:
        d = Path(tmp) / "w0"

        async def write() -> None:
            w = IngressWAL(d, pool)
            w.open()
            i = 0
            while i < n:
                k = rnd.randint(1, 4)
                await w.append([_entry(j) for j in range(i, min(n, i + k))])
                i += k
            w.close()

        asyncio.run(write())
        seg = sorted(d.glob("*.wal"))[-1]
        orig = seg.read_bytes()
        bad = mutate(orig, edits)
        seg.write_bytes(bad)
        intact, pos, seq = set(), 0, 1
        while pos < len(orig):
            (length,) = struct.unpack_from(">I", orig, pos + 4)
            end = pos + 20 + length
            if untouched(orig, bad, pos, end):
                intact.add(seq)
            elif pos + 20 <= len(bad):
                # A header left whole but whose (damaged) length runs past the end of the file
                # reads as a torn tail, the crash-cut last write: it is cut with what follows,
                # never scanned for frames (a torn payload may hold a forged one). Frames
                # after it may be lost; none may be fabricated (checked below).
                magic, blen, bseq, _crc = WAL.FRAME.unpack_from(bad, pos)
                if magic == WAL.MAGIC and 0 < blen <= WAL.MAX_RECORD and bseq == seq and pos + 20 + blen > len(bad):
                    break
            pos, seq = end, seq + 1
        w = IngressWAL(d, pool)
        w.open()
        try:
            got = {}
            for e in w.replay():
                assert 1 <= e.seq <= n and _fields(e) == _fields(_entry(e.seq - 1)), f"fabricated WAL entry {e.seq}"
                got[e.seq] = e
            missing = intact - set(got)
            assert not missing, f"undamaged WAL entries were not replayed: {sorted(missing)[:10]}"
        finally:
            w.close()


@FUZZ
@given(st.binary(max_size=16))
def test_wal_checkpoint_random_bytes(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(1) as pool:
        d = Path(tmp)
        (d / "checkpoint").write_bytes(raw)
        w = IngressWAL(d, pool)
        w.open()
        w.close()


# ---- consumer offsets ---------------------------------------------------------------------------------

@FAST
@given(st.binary(max_size=O.SLOT))
def test_offset_slot_random_bytes(slot: bytes) -> None:
    got = O._decode(slot)
    assert got is None or (isinstance(got, tuple) and len(got) == 3)


@FAST
@given(st.binary(max_size=300))
def test_offset_slot_with_valid_checksum_but_garbage_body(body: bytes) -> None:
    """A body whose checksum holds (a bug, a fuzzer) but whose content is malformed is refused, never raises."""
    slot = (O._HDR.pack(O.MAGIC, __import__("crc32c").crc32c(body), len(body)) + body).ljust(O.SLOT, b"\0")
    got = O._decode(slot)
    if got is not None:
        _seq, frontier, ahead = got
        assert all(a > frontier for a in ahead) and ahead == sorted(ahead)


@FAST
@given(st.binary(max_size=300))
def test_offset_slot_counts_tail_garbage_is_refused_or_sane(tail: bytes) -> None:
    """Issue 14's delivery-counts tail after the acked deltas: a checksummed body with
    garbage there decodes to sane counts (offsets above the frontier, counts >= 1) or is
    refused; never raises; the reader without the tail still reads the rest."""
    import struct

    body = struct.pack(">QqI", 1, 5, 0) + tail
    slot = (O._HDR.pack(O.MAGIC, __import__("crc32c").crc32c(body), len(body)) + body).ljust(O.SLOT, b"\0")
    got = O._decode_full(slot)
    if got is not None:
        _seq, frontier, _ahead, counts = got
        assert all(o > frontier and c >= 1 for o, c in counts.items())
    assert O._decode(slot) is not None  # no held acks: the old reader ignores the tail


@FAST
@given(st.integers(-1, 1 << 40), st.dictionaries(st.integers(1, 1 << 20), st.integers(1, 1 << 20), max_size=3000))
def test_offset_slot_counts_round_trip_or_trim(frontier: int, rel: dict[int, int]) -> None:
    """Counts written are read back whole when ``fits`` says so, else a subset with the
    same values (the highest counts kept)."""
    counts = {frontier + d: c for d, c in rel.items()}
    got = O._decode_full(O._encode(3, frontier, [], counts))
    assert got is not None
    kept = got[3]
    assert all(counts[o] == c for o, c in kept.items())
    assert (kept == counts) == O.fits(frontier, [], counts)
    if kept != counts and kept:
        assert min(kept.values()) >= max(c for o, c in counts.items() if o not in kept)


@FUZZ
@given(st.integers(0, 1 << 30), mutation(), st.booleans())
def test_offset_file_corrupt_never_passes_a_real_ack(seed: int, edits: list[tuple[str, float, int]],
                                                    hit_level: bool) -> None:
    """Damage consumer.ahead (or consumer.offset): load never returns a frontier
    past the newest one written, nor an acked-ahead offset never acked."""
    rnd = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        f = O.OffsetFile(d)
        f.load()
        frontier, acked = -1, set()
        for _ in range(rnd.randint(1, 8)):
            frontier += rnd.randint(0, 50)
            ahead = sorted({frontier + rnd.randint(2, 400) for _ in range(rnd.randint(0, 20))})
            acked |= set(ahead)
            f.write_window(frontier, ahead)
            if rnd.random() < 0.5:
                f.writeout()
        if rnd.random() < 0.5:
            f.level(frontier)
        os.close(f._fd)
        victim = d / ("consumer.offset" if hit_level and (d / "consumer.offset").exists() else "consumer.ahead")
        victim.write_bytes(mutate(victim.read_bytes(), edits))
        g = O.OffsetFile(d)
        got_frontier, got_ahead = g.load()
        os.close(g._fd)
        if victim.name == "consumer.ahead":
            assert got_frontier <= frontier, "a damaged offset file raised the frontier past every ack"
            assert all(a in acked or a <= frontier for a in got_ahead), "an ack that never happened"


def test_offset_level_past_the_log_is_ignored(tmp_path: Path) -> None:
    """consumer.offset has no checksum: a frontier past the log's end (a flipped high
    bit) must be ignored, not clamped to the end (which would skip every unacked record)."""
    f = O.OffsetFile(tmp_path)
    f.load()
    f.write_window(9, [12])
    f.writeout()
    f.level(9)
    os.close(f._fd)
    raw = bytearray((tmp_path / "consumer.offset").read_bytes())
    raw[0] ^= 0x40
    (tmp_path / "consumer.offset").write_bytes(bytes(raw))
    g = O.OffsetFile(tmp_path)
    assert g.load(max_frontier=29) == (9, [12])
    os.close(g._fd)
    # a level within the log is believed (levelling takes the max)
    (tmp_path / "consumer.offset").write_bytes((20).to_bytes(8, "big"))
    h = O.OffsetFile(tmp_path)
    assert h.load(max_frontier=29)[0] == 20
    os.close(h._fd)


# ---- raft journal ---------------------------------------------------------------------------------------

def _journal_entries(rnd: random.Random) -> list[tuple[bytes, int, int]]:
    return [(rnd.randbytes(rnd.randint(0, 40)), i, 1 + i // 5) for i in range(1, rnd.randint(2, 30))]


@FUZZ
@given(st.integers(0, 1 << 30), mutation())
def test_journal_corrupt_log_is_prefix_or_refused(seed: int, edits: list[tuple[str, float, int]]) -> None:
    """A damaged Raft log opens to a prefix of what was written (a torn tail cut
    above the persisted commit index) or is refused (LogDamaged: damage at or below
    the commit index; RuntimeError: a bad magic), by the journal and by the restart
    decision's scan alike: never an entry that was not written, never a cut
    committed entry."""
    rnd = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        jn = J.DurableJournal(d)
        entries = _journal_entries(rnd)
        for e in entries:
            jn.add(*e)
        jn.sync()
        commit = rnd.choice([0, 1, entries[-1][1] // 2, entries[-1][1]])
        if commit:
            jn.setRaftCommitIndex(commit)
            jn._store_meta()
        os.close(jn._fd)
        path = d / "log"
        orig = path.read_bytes()
        bad = mutate(orig, edits)
        path.write_bytes(bad)
        try:
            first, last = J.scan_log(path)
        except J.LogDamaged:
            first = last = -1
        except Exception as e:
            raise AssertionError(f"scan_log raised {e!r}") from e
        try:
            jn2 = J.DurableJournal(d)
        except J.LogDamaged:
            assert first == -1, "scan_log and the journal disagree about the damage"
            return
        except RuntimeError:  # bad magic: refused, untouched
            assert path.read_bytes() == bad
            return
        got = list(jn2._entries)
        os.close(jn2._fd)
        assert got == entries[: len(got)], "the journal opened to entries that were never written"
        assert (first, last) == ((got[0][1], got[-1][1]) if got else (0, 0))
        if bad.startswith(J.MAGIC):
            assert len(got) >= commit, "the journal cut entries at or below the persisted commit index"


@FAST
@given(st.binary(max_size=200))
def test_journal_meta_random_bytes(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "meta").write_bytes(raw)
        jn = J.DurableJournal(d)
        jn.getCurrentTerm(), jn.getVotedForNodeId(), jn.getRaftCommitIndex()
        os.close(jn._fd)


# ---- snapshot headers --------------------------------------------------------------------------------------

def _snapshot_bytes(rnd: random.Random) -> bytes:
    header = msgspec.msgpack.encode({"last": [b"x", 9, 2], "before": [b"y", 8, 2], "cluster": ["127.0.0.1:1"],
                                     "fsm_index": rnd.randint(1, 1000), "newest_type": 13})
    return R.SNAP_MAGIC + struct.pack(">Q", len(header)) + header + rnd.randbytes(rnd.randint(0, 64))


@FUZZ
@given(st.integers(0, 1 << 30), mutation())
def test_snapshot_header_mutated(seed: int, edits: list[tuple[str, float, int]]) -> None:
    """read_snapshot_header refuses with ValueError only; restart's inspect_raft
    refuses an unreadable snapshot with SnapshotDamaged (the node exits 2 with that
    line), never with anything else, and accepts an intact one."""
    from narad.meta import restart

    rnd = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        raft = Path(tmp)
        (raft / "snapshots").mkdir()
        p = raft / "snapshots" / "latest.snap"
        good = _snapshot_bytes(rnd)
        bad = mutate(good, edits)
        p.write_bytes(bad)
        try:
            header, _off = R.read_snapshot_header(p)
            assert isinstance(header, dict)
        except ValueError:
            pass
        try:
            restart.inspect_raft(raft)
        except restart.SnapshotDamaged:
            pass
        hlen = struct.unpack_from(">Q", good, 8)[0]
        if bad[: 16 + hlen] == good[: 16 + hlen]:  # header intact (image damage is not read here)
            assert restart.inspect_raft(raft).snapshot_index is not None


@FAST
@given(st.binary(max_size=64))
def test_snapshot_header_random(raw: bytes) -> None:
    with tempfile.NamedTemporaryFile() as fh:
        fh.write(R.SNAP_MAGIC + raw)
        fh.flush()
        try:
            R.read_snapshot_header(fh.name)
        except ValueError:
            pass


# ---- local RPC and node RPC frames ------------------------------------------------------------------------

class _Sink:
    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


class _Ping(msgspec.Struct, tag=True):
    n: int


@FAST
@given(st.lists(st.binary(max_size=64), max_size=6), st.booleans())
def test_ipc_connection_random_stream(chunks: list[bytes], framed: bool) -> None:
    """Random bytes (or random msgpack bodies in valid length prefixes) on a local
    RPC connection: answered with a 400 error frame or the connection closed;
    nothing escapes data_received."""

    async def run() -> None:
        svc = rpc.Service()

        async def ping(msg: _Ping, conn: rpc.Connection) -> _Ping:
            return msg

        svc.register(_Ping, ping)
        conn = rpc.Connection(svc)
        sink = _Sink()
        conn.connection_made(sink)  # type: ignore[arg-type]
        for c in chunks:
            conn.data_received(struct.pack(">I", len(c)) + c if framed else c)
            if sink.closed:
                break
        await asyncio.sleep(0)
        for t in list(conn._tasks):
            t.cancel()

    asyncio.run(run())


@FAST
@given(st.binary(max_size=200))
def test_frame_envelope_decoders(data: bytes) -> None:
    """The [kind, id, body] envelope and the error body both transports decode."""
    for dec in (rpc._frame_dec, rpc._err_dec):
        try:
            dec.decode(data)
        except msgspec.DecodeError:
            pass
    try:
        status, message, code, extra = rpc._err_dec.decode(data)
    except msgspec.DecodeError:
        return
    err = rpc.error_for_status(status, message, code, extra or None)
    assert isinstance(err, Exception)


@FAST
@given(st.binary(max_size=200))
def test_node_rpc_undecodable_message(body: bytes) -> None:
    try:
        T._undecodable(msgspec.Raw(body), msgspec.DecodeError("Object missing required field `type` - at `$.type`"))
    except Exception as e:
        raise AssertionError(f"_undecodable raised {e!r}") from e


# ---- HTTP bodies and receipt handles --------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 200), max_value=1 << 200)
    | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@FAST
@given(st.one_of(st.binary(max_size=200), json_values.map(lambda v: msgspec.json.encode(v)),
                 st.integers(1, 200).map(lambda n: b'{"messages":' + b"[" * n + b"]" * n + b"}")))
def test_batch_and_ack_bodies(body: bytes) -> None:
    """The body decoders of batch produce and ack refuse with DecodeError. (Nesting
    deeper than msgspec's recursion limit raises RecursionError from the decoder
    itself; the handlers must turn that into a 400: tests/test_fuzz_http.py sends
    such bodies to a real node.)"""
    for dec in (M._batch_dec, M._ack_dec, M._count_dec, M._raw_json):
        try:
            dec.decode(body)
        except msgspec.DecodeError:
            pass


@FAST
@given(st.one_of(st.text(max_size=40),
                 st.tuples(st.integers(-5, 1 << 70), st.integers(-5, 1 << 70), st.integers(-5, 1 << 70)).map(
                     lambda t: f"{t[0]}:{t[1]}:{t[2]}"),
                 st.text(alphabet="0123456789:٠١٢٣+-_ \t", max_size=30)))
def test_receipt_handle(h: str) -> None:
    """A handle parses to non-negative ints or is refused (None); never raises."""
    got = M._parse_handle(h)
    if got is not None:
        assert all(isinstance(x, int) and x >= 0 for x in got)


def test_fuzz_mutation_helper_changes_bytes() -> None:
    """The mutation helper must actually damage: a fuzzer that never mutates proves nothing."""
    data = bytes(range(256)) * 4
    assert mutate(data, [("flip", 0.5, 3)]) != data
    assert len(mutate(data, [("truncate", 0.25, 0)])) == 256
    assert zlib.crc32(mutate(data, [("zero", 0.1, 40)])) != zlib.crc32(data)


def _tagged_structs() -> list[type]:
    """Every tagged message struct the node RPC and the local RPC decode (read from the modules)."""
    import inspect

    from narad.broker import peers
    from narad.meta import requests

    out = []
    for mod in (peers, requests):
        for _name, obj in inspect.getmembers(mod, inspect.isclass):
            if issubclass(obj, msgspec.Struct) and obj.__module__ == mod.__name__ and obj.__struct_config__.tag:
                out.append(obj)
    return out


_MSG_TYPES = _tagged_structs()
# one union per struct layout (a union cannot mix array-like and map structs; each service has one layout)
_MSG_DECS = [msgspec.msgpack.Decoder(__import__("typing").Union[tuple(g)])  # type: ignore[valid-type]
             for g in ([t for t in _MSG_TYPES if t.__struct_config__.array_like],
                       [t for t in _MSG_TYPES if not t.__struct_config__.array_like]) if g]
_msgpack_any = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=10)
    | st.binary(max_size=10) | st.sampled_from([t.__struct_config__.tag for t in _MSG_TYPES]),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20)


@FAST
@given(st.one_of(
    st.binary(max_size=120),
    _msgpack_any.map(msgspec.msgpack.encode),
    st.tuples(st.sampled_from(_MSG_TYPES), st.lists(_msgpack_any, max_size=8)).map(
        lambda t: msgspec.msgpack.encode([t[0].__struct_config__.tag, *t[1]]))))
def test_node_rpc_message_bodies(body: bytes) -> None:
    """The message union a node-RPC or local-RPC service decodes (every tagged request
    and note struct): random bodies and tag-plus-random-fields arrays give a struct or
    DecodeError, nothing else; the refusal text is built without raising."""
    assert len(_MSG_TYPES) >= 8
    for dec in _MSG_DECS:
        try:
            dec.decode(body)
        except msgspec.DecodeError as e:
            T._undecodable(msgspec.Raw(body), e)


@FAST
@given(st.sampled_from(["headers", "key"]), st.binary(max_size=300), st.binary(max_size=40), st.integers(0, 400),
       st.integers(0, 255))
def test_plain_block_fast_path_agrees_with_the_decoder_under_mutation(kind: str, x: bytes, body: bytes, at: int,
                                                                      byte: int) -> None:
    """A headers-only or key-only block read in place by a consume (``plain_block``;
    a key is skipped) says what the full decoder says, for the block as written
    (headers as bin8 or bin16, keys as fixstr or str8) and with one byte changed."""
    if kind == "headers":
        stored = FR.pack_headers(x, body)
        assert stored == FR.pack_ext(FR.Ext(h=x), body)
    else:
        x = x[:128] or b"k"  # a key: 1 to 128 bytes
        stored = FR.pack_idem(x, body)
    from narad.broker import idem as IDEM

    hs, he, pos = FR.plain_block(stored)
    assert (stored[hs:he], stored[pos:]) == ((x if kind == "headers" else b""), body)
    if kind == "key":
        assert hs == he == 0
    mutated = bytearray(stored)
    mutated[at % len(stored)] = byte
    m = bytes(mutated)
    for s in (stored, m):  # the commit answers None without key_of for these (its first map key is not "i")
        if s[0] < 0x80 and (len(s) < 4 or s[3] != 0x69):
            assert IDEM.key_of(FR.F_EXT, s) is None
    hs, he, pos = FR.plain_block(m)
    if pos < 0:
        return
    if hs > 0:
        ext, end = FR.ext_at(m)
        assert (end, ext.h, ext.i, ext.d) == (pos, m[hs:he], None, None)
        return
    try:  # a key alone: its bytes may not be UTF-8 (never shown)
        ext, end = FR.ext_at(m)
    except FR.FrameError:
        return
    assert end == pos and ext.h is None and ext.d is None


@FAST
@given(st.text(min_size=0, max_size=140), st.binary(max_size=40), st.integers(0, 400), st.integers(0, 255))
def test_idempotency_key_fast_paths_agree_with_msgspec_under_mutation(key: str, body: bytes, at: int,
                                                                      byte: int) -> None:
    """An idempotency-key-only block packed by hand (``pack_idem``) is msgspec's byte for
    byte, and the commit's in-place read of the key (``idem.key_of`` over ``idem_span``)
    says what the full decoder says, for the block as written and with one byte changed."""
    from narad.broker import idem as IDEM

    try:
        kb = key.encode()
    except UnicodeEncodeError:  # a lone surrogate: never a key (the API refuses it)
        return
    stored = FR.pack_idem(kb, body)
    assert stored == FR.pack_ext(FR.Ext(i=key), body)
    assert IDEM.key_of(FR.F_EXT, stored) == key and FR.has_idem(stored)
    mutated = bytearray(stored)
    mutated[at % len(stored)] = byte
    m = bytes(mutated)
    try:
        want = FR.read_ext(m).i
    except FR.FrameError:
        want = None
    assert IDEM.key_of(FR.F_EXT, m) == want


def _commit_keyed(batch: list[tuple[bytes | None, int, bytes]]) -> tuple[list[int], set[str], set[str]]:
    """One real commit of `batch` into a fresh partition: (the indexes dropped as
    repeats, the keys its table holds, the keys a rebuild at open reads back)."""
    from narad.broker import idem as IDEM
    from tests.test_idempotency import held, rebuilt

    with tempfile.TemporaryDirectory() as d:
        p = _partition(Path(d), 0)

        async def go() -> Any:
            p.loop = asyncio.get_running_loop()
            with ThreadPoolExecutor(1) as ex:
                return await p.commit(batch, ex)

        try:
            _off, dups = asyncio.run(go())
            keys = sorted({k for _k, f, pl in batch if (k := IDEM.key_of(f, pl)) is not None})
            now = int(time.time() * 1000)
            return dups, held(p, keys, now), rebuilt(p, 300_000, now, keys)[0]
        finally:
            p.log.close()


def test_the_commits_in_place_key_read_agrees_with_key_of_at_every_key_length() -> None:
    """Every key length the API takes (0 to 128 bytes), and for each a key one byte
    longer that starts with the str8 length byte: a real commit drops exactly the
    repeats ``key_of`` names. (A 56-byte key's str8 head, 0xD9, equals the fixstr test
    for its block length 61: the in-place read took "8" + key for it, so the key
    "8" + K was a false repeat of K and K itself was never found again after a
    restart: found by a review.)"""
    from narad.broker import idem as IDEM

    keys = [("k" * n).encode() for n in range(129)]
    keys += [v for k in keys if 32 <= len(k) < 128  # what a str8 head read as the key gives
             if (v := bytes([len(k)]) + k) not in keys]
    batch = [(None, FR.F_EXT, FR.pack_idem(k, b"body")) for k in keys + keys[:3]]
    want = [i for i, (_k, f, st_) in enumerate(batch) if IDEM.key_of(f, st_) in
            {IDEM.key_of(f2, s2) for _k2, f2, s2 in batch[:i]}]
    assert want == [len(keys), len(keys) + 1, len(keys) + 2] and len(keys) > 200
    dups, table, rebuilt = _commit_keyed(batch)
    assert dups == want and table == rebuilt == {k.decode() for k in keys}


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "é", "k" * 31, "k" * 32, "x" * 40, "", None]),
                          st.integers(0, 60), st.integers(-1, 255)), min_size=1, max_size=12))
def test_the_commits_in_place_key_read_agrees_with_key_of(recs: list[tuple[str | None, int, int]]) -> None:
    """A partition commit reads a short idempotency key in place (not through ``key_of``):
    over real commits of key-only blocks (fixstr and str8 keys, non-ASCII, empty) with a
    byte changed or not, the records it drops as repeats and the keys its table then
    holds are those ``key_of`` names, as the rebuild at open reads them."""
    from narad.broker import idem as IDEM

    batch: list[tuple[bytes | None, int, bytes]] = []
    for key, at, byte in recs:
        stored = b"body" if key is None else FR.pack_idem(key.encode(), b"body")
        if key is not None and byte >= 0:
            m = bytearray(stored)
            m[at % len(m)] = byte
            stored = bytes(m)
        batch.append((None, FR.F_EXT if key is not None else 0, stored))
    want_dups, seen = [], set()
    for j, (_k, flags, stored) in enumerate(batch):
        k = IDEM.key_of(flags, stored)
        if k is not None:
            if k in seen:
                want_dups.append(j)
            seen.add(k)
    dups, table, rebuilt = _commit_keyed(batch)
    assert dups == want_dups and table == rebuilt == seen


@FAST
@given(st.sampled_from([0, FR.F_JSON | FR.F_UTF8, FR.F_UTF8, FR.F_JSON]), st.booleans(),
       st.sampled_from(["none", "headers", "idem", "uuid", "both", "dead"]),
       st.one_of(st.none(), st.binary(max_size=12)),
       st.binary(max_size=60), st.integers(0, 7), st.integers(0, 2**63 - 1), st.integers(0, 400), st.integers(-1, 255))
def test_the_consume_paths_template_renders_what_render_does(flags: int, ext: bool, block: str, key: bytes | None,
                                                             body: bytes, deliveries: int, nonce: int, at: int,
                                                             byte: int) -> None:
    """``render_leased`` (a consume's common records, built positionally) encodes to
    exactly the bytes of ``render(..., True)`` for any record, a damaged extension block
    (one byte changed) and bodies that are not UTF-8 included: both raise or neither."""
    from narad.broker.peers import Item

    stored = body
    if ext:
        flags |= FR.F_EXT
        stored = {"none": lambda: FR.pack_ext(FR.Ext(), body),
                  "headers": lambda: FR.pack_headers(b'{"a":"1"}', body),
                  "idem": lambda: FR.pack_idem(b"k1", body),
                  "uuid": lambda: FR.pack_idem(b"0f8fad5b-d9cb-469f-a165-70867728950e", body),
                  "both": lambda: FR.pack_ext(FR.Ext(i="k", h=b'{"t":"x"}'), body),
                  "dead": lambda: FR.pack_ext(FR.Ext(d=FR.DeadLetter("src", 1, 2, 3)), body)}[block]()
        if byte >= 0:
            m = bytearray(stored)
            m[at % len(m)] = byte
            stored = bytes(m)
    it = Item(2, 41, nonce, key, 1_796_229_551_123, flags, stored, deliveries)

    def enc(f: Any) -> tuple[str, bytes]:
        try:
            return "ok", msgspec.json.encode(f())
        except UnicodeDecodeError:
            return "raised", b""

    assert enc(lambda: M.render_leased("topic-1", it)) == enc(lambda: M.render("topic-1", it, True))


def test_the_consume_paths_inline_blocks_agree_with_render_at_their_edges() -> None:
    """``render_leased`` reads the two commonest blocks inline: a first byte of 0x80 or
    more is a longer length (not a one-byte block), an empty or unbraced headers text is
    not the fast case, and a block that runs past the record is not read; each renders as
    ``render`` does (or both raise)."""
    from narad.broker.peers import Item

    body = b'{"v":1}' + b" " * 300
    hb = b"\x81\xa1h\xc4"
    cases = [
        FR.pack_headers(b'{"a":"1"}', body),
        FR.pack_headers(b"{" + b"x" * 130 + b"}", body),  # a two-byte length
        bytes([0x8E]) + hb + bytes([0x89]) + b'{"a":"1"}' + body,  # looks one-byte, is not
        bytes([0x85]) + hb + b"\x80" + b"{" + b"y" * 126 + b"}" + body,
        bytes([0x05]) + hb + b"\x00" + body,  # empty headers text
        bytes([0x0E]) + hb + b"\x09" + b'["a","1"]' + body,  # not an object
        bytes([0x7F]) + hb + b"\x7a" + b"{}",  # runs past the record
        FR.pack_idem(b"k" * 31, body), FR.pack_idem(b"k" * 32, body), FR.pack_idem(b"", body),
        FR.pack_idem(b"k" * 36, body), FR.pack_idem(b"k" * 122, body), FR.pack_idem(b"k" * 123, body),
        bytes([0x29]) + b"\x81\xa1i\xd9\x25" + b"k" * 36 + body,  # a str8 whose length says one more
        bytes([0x29]) + b"\x81\xa1i\xd9\x24" + b"k" * 35,  # runs past the record
        bytes([0x8A]) + b"\x81\xa1i\xa6" + b"kkkkkk" + body,
        # Records too short for the blocks they start as (read byte by byte: never past the end).
        b"", b"\x05", b"\x05\x81\xa1", b"\x05\x81\xa1i", b"\x05\x81\xa1i\xa1", b"\x05\x81\xa1i\xa1k",
        b"\x04\x81\xa1i\xa0", b"\x06\x81\xa1h\xc4", b"\x06\x81\xa1h\xc4\x01", b"\x07\x81\xa1h\xc4\x02{}",
        b"\x07\x81\xa1h\xc4\x02{}x", b"\x05\x81\xa1x\xa1kx",
    ]

    def enc(f: Any) -> tuple[str, bytes]:
        try:
            return "ok", msgspec.json.encode(f())
        except (UnicodeDecodeError, FR.FrameError):
            return "raised", b""

    for stored in cases:
        it = Item(1, 5, 9, None, 1_796_229_551_123, FR.F_EXT | FR.F_JSON | FR.F_UTF8, stored, 1)
        assert enc(lambda it=it: M.render_leased("t", it)) == enc(lambda it=it: M.render("t", it, True)), stored[:8]


def test_a_block_that_starts_as_headers_alone_never_carries_an_idempotency_key() -> None:
    """The commit answers "no key" without ``key_of`` when the block's length is one byte
    (under 0x80) and ``stored[3]``, the map's first key, is not "i" (headers alone): that is
    only sound if ``key_of`` answers None for every such payload (as written, a key-only
    block whose "i" became "h", a two-entry map with "i" second, a block with a runaway
    length, which the commit hands to ``key_of``)."""
    from narad.broker import idem as IDEM

    body = b'{"a":1}'
    keyed = FR.pack_idem(b"order-1", body)
    cases = [
        FR.pack_headers(b'{"t":"x"}', body),
        keyed[:3] + b"h" + keyed[4:],
        FR.pack_ext(FR.Ext(i="k", h=b'{"t":"x"}'), body)[:1] + b"\x81\xa1h" + b"\xc4\x00\xa1i\xa1k" + body,
        b"\xff\x81\xa1h\x00\x00\xa1i\xa1k" + body,
    ]
    for s in cases:
        assert s[1:4] == FR.HEADERS_ALONE and (s[0] >= 0x80 or s[3] != 0x69)
        assert IDEM.key_of(FR.F_EXT, s) is None, s
    assert IDEM.key_of(FR.F_EXT, keyed) == "order-1" and keyed[1:4] != FR.HEADERS_ALONE


def _headers_the_dict_way(text: bytes) -> bytes | str | None:
    """What a batch message's ``headers`` became before ``batch_headers``: decoded as a
    string-to-string dict (null: none) and checked and encoded by ``headers_text``;
    a refusal as "400"."""
    try:
        h = msgspec.json.decode(text, type=dict[str, str] | None)
        return M.headers_text(h) if h else None
    except (msgspec.DecodeError, M.BadRequest):
        return "400"


def _headers_the_raw_way(text: bytes) -> bytes | str | None:
    try:
        return M.batch_headers(msgspec.Raw(text))
    except M.BadRequest:
        return "400"


_NAME_CHARS = st.sampled_from([*"abcXYZ09._-", " ", "é", ":", ",", '"', "\\", "{", "\x7f"])
_VALUE_CHARS = st.sampled_from([*"ab1 .:,{}[]/", '"', "\\", "é", "\x01", "\x7f", "\u2028", "\U0001f600"])


@FAST
@given(st.lists(st.tuples(st.text(_NAME_CHARS, max_size=6), st.text(_VALUE_CHARS, max_size=8)), max_size=5),
       st.sampled_from(["compact", "spaced", "escaped", "nested", "array"]), st.integers(0, 40))
def test_batch_headers_fast_path_stores_what_the_dict_path_stores(pairs: list[tuple[str, str]], shape: str,
                                                                   cut: int) -> None:
    """A batch message's headers text taken as it is (``batch_headers``' fast path)
    stores the bytes, or gives the 400, that decoding it into a dict and encoding that
    gives: for compact texts (msgspec's own), texts with spaces, escapes, repeated
    names (the pairs may repeat one), values that are objects or arrays, and texts
    cut short."""
    body = b"{" + b",".join(msgspec.json.encode(n) + b":" + msgspec.json.encode(v) for n, v in pairs) + b"}"
    if shape == "spaced":
        body = body.replace(b":", b" : ", 1)
    elif shape == "escaped" and pairs:
        body = body.replace(b'"', b'"\\u0061', 1)  # the first name gains an escaped "a"
    elif shape == "nested" and pairs:
        body = body[:-1] + b',"n":{"a":"b"}}'
    elif shape == "array":
        body = b'[' + body + b']'
    try:  # only texts the body's decoder would take as a value reach ``batch_headers``
        msgspec.json.decode(body)
    except msgspec.DecodeError:
        body = body[: max(1, len(body) - cut)]
        try:
            msgspec.json.decode(body)
        except msgspec.DecodeError:
            return
    assert _headers_the_raw_way(body) == _headers_the_dict_way(body), body


def test_batch_headers_fast_path_cases() -> None:
    """The fast path's edges, each against the dict path: a repeated name (the last
    value kept), an empty object, null, the count and byte bounds, a bad name, a
    name seen before, a non-string value, and invalid UTF-8 (which the body's
    decoder does not read inside a value it skips)."""
    cases = [b'{"a":"1","a":"2"}', b"{}", b"null", b'{"a":""}', b'{"":"x"}', b'{"a b":"x"}', b'{"a":1}',
             b'{"a":"\xff"}', b'{"a":"\xc3\xa9"}', b'{"a":"b" ,"c":"d"}', b'{"a":"b", "c":"d"}',
             b'{"a":":","b":","}', b'{"a":"\\"","b":"c"}',
             b"{" + b",".join(b'"h%d":"v"' % i for i in range(32)) + b"}",
             b"{" + b",".join(b'"h%d":"v"' % i for i in range(33)) + b"}",
             b'{"a":"' + b"x" * 8188 + b'"}', b'{"a":"' + b"x" * 8200 + b'"}',
             b'{"' + b"n" * 128 + b'":"v"}', b'{"' + b"n" * 129 + b'":"v"}', b'[{"a":"b"}]', b'"s"', b"12"]
    for body in cases:
        for _ in range(2):  # the second time, its names are ones seen before
            assert _headers_the_raw_way(body) == _headers_the_dict_way(body), body
    assert M.batch_headers(msgspec.Raw(b'{"a":"1","a":"2"}')) == b'{"a":"2"}'
    with pytest.raises(M.BadRequest, match=r"at `\$\.headers"):
        M.batch_headers(msgspec.Raw(b'{"a":1}'))
