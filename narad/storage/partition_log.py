"""One partition's log: segmented append-only files of checksummed frames.

Layout: ``<partition dir>/<20-digit base offset>.log`` segments (64 MiB),
plus ``hwm`` (8 bytes, meaningful only while the log is closed). Exactly one
worker opens a partition's log (its owner).

Commit (``write_commit``, run on an I/O thread; one commit at a time per
log): write the batch as one frame at the end of the active segment,
fdatasync, read the frame back and check its CRC. Only then does the owner
``publish`` it (event-loop thread): the high watermark advances and readers
may see the records. The three phases are public too (``stage_commit``,
``sync_failed``, ``finish_commit``, under ``io_lock``) for
narad.storage.commit_rounds, which syncs several logs at once. A failed write, sync or read-back truncates the frame
away (the WAL will commit the same records again, so a leftover would be a
permanent duplicate); a failed fdatasync poisons the log until it is reopened
(a later successful fsync proves nothing about the lost pages).

Recovery (``open``) walks only the active segment: a torn tail is cut (and
the cut synced); corruption followed by valid frames is skipped over, never
truncated, and its offsets become a gap; sealed segments are only stat'ed,
their damage surfaces at read time. The active segment is synced before its
tail is trusted. The high watermark is min(hwm file, verified tail), or the
verified tail when the file is empty (the file is emptied before the first
advance after an open and written exactly at clean close) or holds a value
that is no frame boundary of the active segment (a damaged file).

Retention deletes whole sealed segments by the age of their last write.

``read_batch`` serves fan-out cursors: committed records from an offset, up to
a record and byte cap, stopping at the first record committed after a bound
(the delay gate); aged-out offsets raise OffsetGone, unreadable records are
skipped and counted, every frame read from disk is CRC checked as ``read`` does.

An open log holds one descriptor (its active segment; a sealed segment only
while a roll-off is pending or for one read); the ``hwm`` file is opened only
to empty it before the first advance and to write it at close. A clean close
of a log nothing was committed to writes nothing. ``peek`` and
``expired_on_disk`` read a *closed* partition directory without opening the
log (stats of an idle partition, the cold retention walk): read-only, no
descriptor kept.
Imports narad.storage.{fileio,frames}.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from narad.storage import fileio
from narad.storage import frames as FR

log = logging.getLogger("narad.storage.log")

SEGMENT_BYTES = 64 << 20
_U64 = struct.Struct(">Q")
FRAME_CACHE_BYTES = 4 << 20
Record = tuple[bytes | None, int, int, bytes]  # key, committed-at ms, flags, payload


class LogPoisoned(OSError):
    pass


class OffsetGone(Exception):
    """The offset was deleted by retention."""

    def __init__(self, oldest: int) -> None:
        super().__init__(oldest)
        self.oldest = oldest


class NotVisible(LookupError):
    """The offset is at or above the high watermark: not readable (yet)."""


class LogClosed(Exception):
    """The log was closed (topic deleted or recreated, shutdown): retry elsewhere."""


class CorruptRecord(Exception):
    """The record at this offset cannot be read back intact (never served)."""


@dataclass
class Segment:
    base: int
    path: Path
    size: int = 0
    fd: int = -1
    last_write_ms: int = 0
    frame_bases: list[int] = field(default_factory=list)
    frame_pos: list[int] = field(default_factory=list)
    indexed: bool = False
    end: int = 0  # next offset after this segment's last record (exclusive); for sealed: successor base
    first_ms: int | None = None  # committed-at of its first record, once read (``first_record_ms``)

    def name(self) -> str:
        return f"{self.base:020d}.log"


@dataclass
class BatchRead:
    """What ``read_batch`` found: the records (in offset order), the offset to
    read next (after every record returned or skipped as corrupt), the key and
    payload bytes returned, records skipped as unreadable, and the committed-at
    of the first record that was not due yet (None: the read did not stop at one)."""

    records: list[Record]
    next_offset: int
    nbytes: int = 0
    corrupt: int = 0
    not_due_ms: int | None = None


def _seg_path(d: Path, base: int) -> Path:
    return d / f"{base:020d}.log"


def remove_files(paths: list[Path], directory: Path) -> None:
    """Unlink detached segment files, then sync their directory (any thread)."""
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    if paths:
        fileio.fsync_dir(directory)


class Staged:
    """A frame written by ``stage_commit`` and not yet synced."""

    __slots__ = ("base", "count", "frame", "pos", "rolled", "seg")

    def __init__(self, base: int, count: int, frame: bytes, seg: Segment, pos: int, rolled: Segment | None) -> None:
        self.base, self.count, self.frame, self.seg, self.pos, self.rolled = base, count, frame, seg, pos, rolled


class PartitionLog:
    def __init__(self, directory: Path, *, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.dir = Path(directory)
        self.segment_bytes = segment_bytes
        self.segments: list[Segment] = []
        self.hwm = 0  # exclusive: consumers read below it
        self.next_offset = 0  # where the next commit goes (>= hwm: a hidden tail may sit between)
        self.poisoned: OSError | None = None
        self._hwm_file: int | None = None  # what the hwm file held at open (None: empty or missing)
        self._hwm_emptied = False
        self._frame_ends: set[int] = set()  # where the active segment's frames end (open only)
        self._cache: OrderedDict[tuple[int, int], list[Record]] = OrderedDict()
        self._last_frame: tuple[int, int, list[Record]] | None = None
        self._sizes: dict[tuple[int, int], int] = {}
        self._cache_bytes = 0
        self._last_committed_ms = 0
        self.last_sync_s = 0.0  # how long the last commit's fdatasync took (read by the owner after it)
        self.dev = -1  # the filesystem the log lives on (st_dev; set at open), for commit rounds
        self.closed = False
        # write_commit, roll_idle_active and close run on I/O threads (several):
        # one at a time, so a roll or a close never lands inside a commit.
        self._io_lock = threading.Lock()

    # ---- open / recovery ---------------------------------------------------------
    def open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        bases = sorted(int(p.name[:-4]) for p in self.dir.glob("*.log") if p.name[:-4].isdigit())
        if not bases:
            bases = [0]
            fd = os.open(_seg_path(self.dir, 0), os.O_RDWR | os.O_CREAT, 0o600)
            os.close(fd)
            fileio.fsync_dir(self.dir)
        for i, b in enumerate(bases):
            p = _seg_path(self.dir, b)
            st = p.stat()
            seg = Segment(b, p, st.st_size, last_write_ms=int(st.st_mtime * 1000))
            seg.end = bases[i + 1] if i + 1 < len(bases) else b
            self.segments.append(seg)
        active = self.segments[-1]
        active.fd = os.open(active.path, os.O_RDWR)
        self.dev = os.fstat(active.fd).st_dev
        try:
            # The tail may hold frames a crashed process wrote but never synced:
            # sync before trusting it.
            fileio.fdatasync(active.fd)
            tail = self._scan_active(active)
            raw = _read_small(self.dir / "hwm")
        except BaseException:
            os.close(active.fd)
            active.fd = -1
            self.segments = []
            raise
        self.next_offset = tail
        self.hwm = tail
        if len(raw) == 8:
            written = _U64.unpack(raw)[0]
            self._hwm_file = written
            if written >= tail:
                self.hwm = tail
            elif written in self._frame_ends or written == active.base:
                self.hwm = written
            else:
                # A high watermark is always where a published frame ends. Any other
                # value below the tail is a damaged file (a flipped bit): believing it
                # would hide committed records for good. The tail costs duplicates at
                # worst (a never-published frame becomes visible), never a loss.
                log.error("partition log: the hwm file holds no frame boundary; ignored (damaged file?)",
                          extra={"dir": str(self.dir), "hwm_file": written, "tail": tail})
        self._frame_ends = set()
        if self.hwm < tail:
            log.warning("partition log has a hidden tail beyond its high watermark",
                        extra={"dir": str(self.dir), "hwm": self.hwm, "tail": tail})

    def _scan_active(self, seg: Segment) -> int:
        """Index the active segment's frames; cut a torn tail. Returns the next offset."""
        size = seg.size
        data = os.pread(seg.fd, size, 0) if size else b""
        next_off, good_end = _walk_frames(data, seg.base, seg.frame_bases, seg.frame_pos, self._frame_ends,
                                          str(self.dir))
        seg.indexed = True
        if good_end < size:
            # A torn tail: a frame that never finished, or a last frame whose bytes
            # are all there but fail their checksum with nothing valid after it.
            log.warning("partition log: cutting a torn tail", extra={"dir": str(self.dir), "bytes": size - good_end})
            fileio.ftruncate(seg.fd, good_end)
            fileio.fdatasync(seg.fd)
            seg.size = good_end
        seg.end = next_off
        return next_off

    # ---- commit ---------------------------------------------------------------------
    def committed_at(self) -> int:
        """A commit time for the next batch: never below the previous one."""
        now = int(time.time() * 1000)
        if now < self._last_committed_ms:
            now = self._last_committed_ms
        self._last_committed_ms = now
        return now

    def write_commit(self, records: list[bytes] | FR.Laid) -> tuple[int, Segment, int, int, Segment | None]:
        """I/O thread: write one frame with `records` at next_offset, sync, read
        back. Returns (base offset, segment, position, frame size, the new
        segment if this commit rolled). Raises OSError (the frame is gone)."""
        with self._io_lock:
            return self._write_commit(records)

    def _write_commit(self, records: list[bytes] | FR.Laid) -> tuple[int, Segment, int, int, Segment | None]:
        st = self.stage_commit(records)
        t_sync = time.perf_counter()
        try:
            fileio.fdatasync(st.seg.fd)
        except OSError as e:
            self.sync_failed(st, e)
            raise
        self.last_sync_s = time.perf_counter() - t_sync
        return self.finish_commit(st)

    # The three phases of a commit, for a caller that syncs several logs at once
    # (narad.storage.commit_rounds): it holds ``io_lock`` from the stage to the finish.
    @property
    def io_lock(self) -> threading.Lock:
        return self._io_lock

    def stage_commit(self, records: list[bytes] | FR.Laid) -> Staged:
        """I/O thread, under ``io_lock``: write one frame with `records` at
        next_offset (not yet synced). Raises OSError (nothing is left written)."""
        if self.poisoned is not None:
            raise LogPoisoned(self.poisoned.errno or 5, f"log poisoned by an earlier failed fsync: {self.poisoned}")
        if self.closed:
            raise OSError(9, "partition log closed")
        if not self._hwm_emptied:
            # Before the first advance after an open, the hwm file is emptied
            # (a crash or an older binary must not trust a stale value). Part of
            # the commit: if it fails, nothing is written.
            hfd = os.open(self.dir / "hwm", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fileio.ftruncate(hfd, 0)
                try:
                    fileio.fdatasync(hfd)
                except OSError as e:
                    self.poisoned = e
                    raise
            finally:
                os.close(hfd)
            self._hwm_emptied = True
        base = self.next_offset
        frame = FR.encode_frame(base, records)
        seg = self.segments[-1]
        rolled: Segment | None = None
        if seg.size > 0 and seg.size + len(frame) > self.segment_bytes:
            rolled = self._roll(base)
            seg = rolled
        pos = seg.size
        try:
            fileio.pwrite_all(seg.fd, frame, pos)
        except OSError:
            self._cut(seg, pos)
            if rolled is not None:
                self._drop_rolled(rolled)
            raise
        return Staged(base, len(records), frame, seg, pos, rolled)

    def sync_failed(self, st: Staged, e: OSError) -> None:
        """The sync covering `st` failed: the log is poisoned and the frame cut away."""
        self.poisoned = e
        self._cut(st.seg, st.pos)
        if st.rolled is not None:
            self._drop_rolled(st.rolled)

    def finish_commit(self, st: Staged) -> tuple[int, Segment, int, int, Segment | None]:
        """After the sync covering `st`: read the frame back and check it. Returns
        (base offset, segment, position, frame size, the new segment if this commit
        rolled). Raises OSError (the frame is cut away)."""
        seg, pos, frame, base = st.seg, st.pos, st.frame, st.base
        try:
            back = fileio.pread(seg.fd, len(frame), pos)
            count, fbase, psize, crc = FR.parse_header(back, 0)
            if len(back) != len(frame) or fbase != base or not FR.frame_crc_ok(back, 0, count, fbase, psize, crc):
                raise OSError(5, "frame read back with a bad checksum")
        except (OSError, FR.FrameError, struct.error) as e:
            self._cut(seg, pos)
            if st.rolled is not None:
                self._drop_rolled(st.rolled)
            raise OSError(5, f"commit read-back failed: {e}") from None
        seg.size = pos + len(frame)
        # The next commit goes after this frame even before publish() ran (a
        # hidden tail until then; an idle-segment roll must not land in it).
        self.next_offset = base + st.count
        return base, seg, pos, len(frame), st.rolled

    def _cut(self, seg: Segment, pos: int) -> None:
        try:
            fileio.ftruncate(seg.fd, pos)
            fileio.fdatasync(seg.fd)
        except OSError as e:
            if self.poisoned is None:
                self.poisoned = e
            log.error("partition log: could not cut a failed commit; log poisoned until reopened",
                      extra={"dir": str(self.dir), "err": str(e)})

    def _roll(self, base: int) -> Segment:
        old = self.segments[-1]
        try:
            fileio.fdatasync(old.fd)
        except OSError as e:
            self.poisoned = e
            raise
        path = _seg_path(self.dir, base)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            # Left by a failed commit whose cleanup failed: empty and unknown
            # to the log, so it can be taken over.
            fd = os.open(path, os.O_RDWR)
            if os.fstat(fd).st_size != 0 or any(s.path == path for s in self.segments):
                os.close(fd)
                raise
        seg = Segment(base, path, 0, fd, last_write_ms=int(time.time() * 1000), indexed=True, end=base)
        try:
            fileio.fsync_dir(self.dir)
        except OSError:
            self._drop_rolled(seg)
            raise
        return seg

    def _drop_rolled(self, seg: Segment) -> None:
        """A commit that rolled failed: the new segment never becomes part of the log."""
        os.close(seg.fd)
        seg.fd = -1
        try:
            seg.path.unlink()
            fileio.fsync_dir(self.dir)
        except OSError as e:
            # Left behind (or back after a crash), its name would cut off whatever
            # the old segment takes next: no more commits until a reopen.
            if self.poisoned is None:
                self.poisoned = e
            log.error("partition log: could not remove the segment of a failed commit",
                      extra={"dir": str(self.dir), "err": str(e)})

    def publish(self, base: int, seg: Segment, pos: int, size: int, rolled: Segment | None,
                decoded: list[Record]) -> None:
        """Event-loop thread, after write_commit succeeded: make the records visible."""
        if rolled is not None:
            old = self.segments[-1]
            old.end = base
            if old.fd >= 0:
                os.close(old.fd)
                old.fd = -1
            if self.closed:  # closed in the meantime: its fds are gone
                os.close(rolled.fd)
                rolled.fd = -1
            self.segments.append(rolled)
        seg.frame_bases.append(base)
        seg.frame_pos.append(pos)
        n = len(decoded)
        seg.end = base + n
        seg.last_write_ms = int(time.time() * 1000)
        self.next_offset = base + n
        self.hwm = base + n
        self._cache_put((seg.base, pos), decoded, size)

    # ---- reads ------------------------------------------------------------------------
    @property
    def oldest(self) -> int:
        return self.segments[0].base if self.segments else 0

    def _segment_for(self, offset: int) -> Segment:
        last = self.segments[-1]
        if offset >= last.base:
            return last  # the tail: where nearly every read lands
        i = bisect.bisect_right([s.base for s in self.segments], offset) - 1
        if i < 0:
            raise OffsetGone(self.oldest)
        return self.segments[i]

    def _index(self, seg: Segment) -> None:
        """Build a sealed segment's frame index from its headers. A header is
        trusted as is only when it continues the offsets densely and the next
        header agrees with it; anything else (a gap, a jump, a damaged header)
        is checked against the frame's CRC first, so one flipped bit in a header
        costs that frame, never the rest of the segment."""
        if seg.indexed:
            return
        fd = os.open(seg.path, os.O_RDONLY)
        try:
            size = seg.size
            pos, expect = 0, seg.base
            peeked: tuple[int, tuple[int, int, int, int] | None] = (-1, None)
            while pos + FR.HEADER_SIZE <= size:
                hdr = peeked[1] if peeked[0] == pos else self._header_at(fd, pos)
                good = False
                if hdr is not None:
                    count, base, psize, _crc = hdr
                    end = pos + FR.HEADER_SIZE + psize
                    if end <= size and base >= expect:
                        nxt = self._header_at(fd, end) if end + FR.HEADER_SIZE <= size else None
                        peeked = (end, nxt)
                        consistent = end == size or (nxt is not None and nxt[1] == base + count)
                        good = (base == expect and consistent) or self._frame_at_ok(fd, pos, hdr)
                if not good:
                    nxt_pos = self._resync(fd, pos + 1, size)
                    if nxt_pos < 0:
                        break
                    pos = nxt_pos
                    continue
                seg.frame_bases.append(base)
                seg.frame_pos.append(pos)
                expect = base + count
                pos = end
        finally:
            os.close(fd)
        seg.indexed = True

    @staticmethod
    def _header_at(fd: int, pos: int) -> tuple[int, int, int, int] | None:
        try:
            return FR.parse_header(os.pread(fd, FR.HEADER_SIZE, pos), 0)
        except (FR.FrameError, struct.error):
            return None

    @staticmethod
    def _frame_at_ok(fd: int, pos: int, hdr: tuple[int, int, int, int]) -> bool:
        count, base, psize, crc = hdr
        buf = os.pread(fd, FR.HEADER_SIZE + psize, pos)
        return len(buf) == FR.HEADER_SIZE + psize and FR.frame_crc_ok(buf, 0, count, base, psize, crc)

    @staticmethod
    def _resync(fd: int, start: int, size: int) -> int:
        pos = start
        while pos < size:
            chunk = os.pread(fd, 1 << 16, pos)
            i = chunk.find(FR.MAGIC)
            if i >= 0:
                return pos + i
            if len(chunk) < 2:
                return -1
            pos += len(chunk) - 1
        return -1

    def read(self, offset: int) -> Record:
        """The record at `offset` (< hwm). Raises OffsetGone, CorruptRecord or NotVisible
        (and LogClosed once closed, also when the close ran under this read: a retired
        log never looks like a gap or a damaged record)."""
        if self.closed:
            raise LogClosed(offset)
        if offset >= self.hwm:
            raise NotVisible(offset)
        if offset < self.oldest:
            raise OffsetGone(self.oldest)
        lf = self._last_frame
        if lf is not None and lf[0] <= offset < lf[1]:
            return lf[2][offset - lf[0]]  # consecutive reads of one frame
        seg = self._segment_for(offset)
        self._index(seg)
        i = bisect.bisect_right(seg.frame_bases, offset) - 1
        if i < 0:
            raise CorruptRecord(offset)
        key = (seg.base, seg.frame_pos[i])
        recs = self._cache.get(key)
        if recs is None:
            try:
                recs = self._read_frame(seg, seg.frame_pos[i], seg.frame_bases[i])
            except (CorruptRecord, OSError):
                if self.closed:
                    # A close on an I/O thread took the descriptor under this read (a reused
                    # number reads another file's bytes): the record is intact, not damage.
                    raise LogClosed(offset) from None
                raise
        fbase = seg.frame_bases[i]
        idx = offset - fbase
        if idx >= len(recs):
            raise CorruptRecord(offset)  # a gap left by corruption
        self._cache.move_to_end(key)
        self._last_frame = (fbase, fbase + len(recs), recs)
        return recs[idx]

    def read_batch(self, offset: int, max_records: int, max_bytes: int,
                   max_committed_ms: int | None = None) -> BatchRead:
        """Committed records from `offset` on (below hwm): up to `max_records`
        offsets (records and unreadable ones) or `max_bytes` of keys and payloads
        (at least one record), stopping
        before the first record committed after `max_committed_ms` (the delay
        gate: committed-at never decreases along a partition, so nothing after it
        is due either). Every record is read as ``read`` reads it (CRC checked when
        its frame comes from disk); a record that cannot be read back intact is
        skipped and counted (``corrupt``), never served, with the rest of its frame
        (or gap) at once. Raises OffsetGone when
        `offset` was deleted by retention (the caller skips to ``oldest`` and
        counts the loss) and LogClosed once the log is closed, also when a close
        ran under the read (a failed read of a closing log is never counted)."""
        if self.closed:
            raise LogClosed(offset)
        if offset < self.oldest:
            raise OffsetGone(self.oldest)
        out = BatchRead([], offset)
        hwm = self.hwm
        off = offset
        size = 0
        while off < hwm and len(out.records) + out.corrupt < max_records:
            try:
                rec = self.read(off)
            except CorruptRecord:
                if self.closed:  # closed under the read (see read): an error, never a record lost
                    raise LogClosed(off) from None
                # The whole frame (or gap) is unreadable: skip to where the next frame starts
                # (each of its offsets read again would re-read and re-check the same frame).
                nxt = self._unreadable_until(off, hwm)
                out.corrupt += nxt - off
                off = nxt
                continue
            if max_committed_ms is not None and rec[1] > max_committed_ms:
                out.not_due_ms = rec[1]
                break
            n = len(rec[3]) + (len(rec[0]) if rec[0] else 0)
            if out.records and size + n > max_bytes:
                break
            out.records.append(rec)
            size += n
            off += 1
        out.next_offset = off
        out.nbytes = size
        return out

    def _unreadable_until(self, offset: int, hwm: int) -> int:
        """After `offset` could not be read: the first offset that may be readable again
        (the next frame of its segment, else the next segment; at most `hwm`)."""
        seg = self._segment_for(offset)
        self._index(seg)
        i = bisect.bisect_right(seg.frame_bases, offset)
        if i < len(seg.frame_bases):
            nxt = seg.frame_bases[i]
        else:
            k = self.segments.index(seg)
            nxt = self.segments[k + 1].base if k + 1 < len(self.segments) else hwm
        return max(offset + 1, min(nxt, hwm))

    def _read_frame(self, seg: Segment, pos: int, base: int) -> list[Record]:
        fd = seg.fd if seg.fd >= 0 else os.open(seg.path, os.O_RDONLY)
        try:
            hdr = os.pread(fd, FR.HEADER_SIZE, pos)
            count, fbase, psize, crc = FR.parse_header(hdr, 0)
            buf = hdr + os.pread(fd, psize, pos + FR.HEADER_SIZE)
            if fbase != base or len(buf) != FR.HEADER_SIZE + psize or not FR.frame_crc_ok(
                    buf, 0, count, fbase, psize, crc):
                raise CorruptRecord(base)
            recs = [FR.decode_record(r) for r in FR.split_records(memoryview(buf)[FR.HEADER_SIZE:], count)]
        except (FR.FrameError, struct.error, ValueError, IndexError):
            raise CorruptRecord(base) from None
        finally:
            if fd != seg.fd:
                os.close(fd)
        self._cache_put((seg.base, pos), recs, FR.HEADER_SIZE + psize)
        return recs

    def _cache_put(self, key: tuple[int, int], recs: list[Record], size: int) -> None:
        """Decoded frames, most recent last: tail consumers read from memory."""
        old = self._cache.pop(key, None)
        if old is not None:
            self._cache_bytes -= self._sizes.pop(key, 0)
        self._cache[key] = recs
        self._sizes[key] = size
        self._cache_bytes += size
        while self._cache_bytes > FRAME_CACHE_BYTES and len(self._cache) > 1:
            k, _ = self._cache.popitem(last=False)
            self._cache_bytes -= self._sizes.pop(k, 0)

    # ---- sizes and times (stats, metrics) -----------------------------------------------------
    def size_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    def oldest_segment_ms(self) -> int | None:
        """Committed-at of the first record of the oldest segment (None: no record, or
        its header unreadable); read once per segment, a few hundred bytes."""
        for seg in self.segments:
            if seg.size == 0:
                continue
            if seg.first_ms is None:
                seg.first_ms = first_record_ms(seg.path)
            return seg.first_ms if seg.first_ms is not None and seg.first_ms >= 0 else None
        return None

    # ---- retention / close ------------------------------------------------------------------
    def expired_segments(self, retention_ms: int, now_ms: int) -> list[Segment]:
        if retention_ms <= 0:
            return []
        cutoff = now_ms - retention_ms
        out = []
        for seg in self.segments[:-1]:
            if seg.last_write_ms < cutoff and seg.end <= self.hwm:
                out.append(seg)
            else:
                break
        return out

    def roll_idle_active(self, retention_ms: int, now_ms: int) -> bool:
        """An active segment that is old, fully committed and non-empty is sealed
        (a new empty one takes over) so retention can delete it."""
        with self._io_lock:
            seg = self.segments[-1]
            if retention_ms <= 0 or seg.size == 0 or seg.last_write_ms >= now_ms - retention_ms:
                return False
            if self.next_offset != self.hwm or self.poisoned is not None or self.closed:
                return False
            new = self._roll(self.next_offset)
            seg.end = self.next_offset
            # seg.fd stays open: readers on the event loop may be using it right
            # now; it is closed when the segment is deleted or the log closed.
            self.segments.append(new)
            return True

    def delete_segments(self, segs: list[Segment]) -> tuple[int, int]:
        """Unlink sealed segments (oldest first). Returns (records, bytes) removed."""
        n_recs, n_bytes, paths = self.detach_segments(segs)
        remove_files(paths, self.dir)
        return n_recs, n_bytes

    def detach_segments(self, segs: list[Segment]) -> tuple[int, int, list[Path]]:
        """The log's part of deleting sealed segments (oldest first; the event loop,
        where readers use the list): they leave the log, their descriptors and cached
        frames go. Returns (records, bytes, the files to remove): the caller unlinks
        them with ``remove_files``, off the loop (unlinking a 64 MiB file took 20 ms on
        this VM). A file a crash leaves before that is found again at the next open,
        as the log's oldest segment, and retention deletes it again."""
        self._last_frame = None
        n_recs = n_bytes = 0
        paths: list[Path] = []
        for seg in segs:
            if seg is self.segments[-1] or seg is not self.segments[0]:
                break
            self.segments.pop(0)
            if seg.fd >= 0:
                os.close(seg.fd)
                seg.fd = -1
            for k in [k for k in self._cache if k[0] == seg.base]:
                self._cache.pop(k)
                self._cache_bytes -= self._sizes.pop(k, 0)
            paths.append(seg.path)
            n_recs += seg.end - seg.base
            n_bytes += seg.size
        return n_recs, n_bytes, paths

    def close(self, *, clean: bool = True) -> None:
        with self._io_lock:  # never under a commit in flight
            self._close(clean)

    def _close(self, clean: bool) -> None:
        if self.closed:
            return
        self.closed = True
        # Nothing committed since the open and the file already says this hwm:
        # nothing to write (an idle log closes without a sync).
        if clean and self.poisoned is None and self.segments and (self._hwm_emptied or self._hwm_file != self.hwm):
            try:
                act = self.segments[-1]
                if act.fd >= 0:
                    fileio.fdatasync(act.fd)
                hfd = os.open(self.dir / "hwm", os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fileio.pwrite_all(hfd, _U64.pack(self.hwm), 0)
                    fileio.ftruncate(hfd, 8)
                    fileio.fdatasync(hfd)
                finally:
                    os.close(hfd)
            except OSError as e:
                log.error("partition log: could not write the hwm file at close", extra={"err": str(e)})
        for seg in self.segments:
            if seg.fd >= 0:
                os.close(seg.fd)
                seg.fd = -1
        self._cache.clear()
        self._sizes.clear()
        self._cache_bytes = 0
        self._last_frame = None


# ---- a closed partition directory, read without opening the log -------------------------------

def _read_small(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return b""
    try:
        return os.pread(fd, 16, 0)
    finally:
        os.close(fd)


def _walk_frames(data: bytes, first: int, bases: list[int], positions: list[int], ends: set[int],
                 where: str) -> tuple[int, int]:
    """Walk the frames of an active segment's bytes (CRC checked; corruption followed
    by valid frames is skipped). Appends each good frame's base and position and
    where it ends; returns (next offset, end of the last good frame)."""
    size = len(data)
    pos = 0
    next_off = first
    good_end = 0
    bad_at = -1
    while pos + FR.HEADER_SIZE <= size:
        try:
            count, base, psize, crc = FR.parse_header(data, pos)
            end = pos + FR.HEADER_SIZE + psize
            if end > size or not FR.frame_crc_ok(data, pos, count, base, psize, crc) or base < next_off:
                raise FR.FrameError("bad frame")
        except (FR.FrameError, struct.error):
            if bad_at < 0:
                bad_at = pos
            nxt = data.find(FR.MAGIC, pos + 1)
            if nxt < 0:
                break
            pos = nxt
            continue
        if bad_at >= 0:
            log.error("partition log: corrupt bytes inside the active segment; skipped, never truncated",
                      extra={"dir": where, "at": bad_at, "resumed_at": pos})
            bad_at = -1
        bases.append(base)
        positions.append(pos)
        next_off = base + count
        ends.add(next_off)
        pos = end
        good_end = end
    return next_off, good_end


def _segment_files(d: Path) -> list[tuple[int, os.stat_result]]:
    out = []
    try:
        with os.scandir(d) as it:
            for e in it:
                n = e.name
                if n.endswith(".log") and n[:-4].isdigit():
                    try:
                        out.append((int(n[:-4]), e.stat()))
                    except FileNotFoundError:
                        continue
    except FileNotFoundError:
        return []
    out.sort(key=lambda x: x[0])
    return out


@dataclass
class DiskStats:
    oldest: int
    hwm: int
    next_offset: int
    segments: int = 0
    size_bytes: int = 0
    oldest_segment_ms: int | None = None


def first_record_ms(path: Path, pos: int = 0) -> int | None:
    """Committed-at of the first record of the frame at `pos` of a segment file,
    from its header and the record's envelope only (a few hundred bytes; no CRC:
    stats and metrics, never data). -1: unreadable; None: no frame there."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        head = os.pread(fd, FR.HEADER_SIZE + 4 + 512, pos)
        if len(head) < FR.HEADER_SIZE:
            return None
        try:
            FR.parse_header(head, 0)
            rec = head[FR.HEADER_SIZE + 4:]
            if len(rec) < 3 or rec[0] != FR.RECORD_VERSION:
                return -1
            klen, i = FR.read_uvarint(rec, 2)
            if klen < 0 or klen > FR.MAX_FRAME_BYTES:
                return -1  # a key length no frame could hold (and too large for a pread offset)
            at = pos + FR.HEADER_SIZE + 4 + i + klen
            raw = os.pread(fd, 8, at)
            if len(raw) != 8:
                return -1
            return int(_U64.unpack(raw)[0])
        except (FR.FrameError, struct.error):
            return -1
    finally:
        os.close(fd)


def record_ms_on_disk(directory: Path, offset: int) -> int | None:
    """Committed-at of the record at `offset` of a closed partition (every record of
    a frame shares its commit's time): the frame holding it is found by walking
    the frame headers of its segment (read-only, no CRC: metrics only). None when
    not found (retention, damage)."""
    segs = _segment_files(Path(directory))
    base = None
    for b, _st in segs:
        if b <= offset:
            base = b
        else:
            break
    if base is None:
        return None
    path = Path(directory) / f"{base:020d}.log"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        pos = 0
        while pos + FR.HEADER_SIZE <= size:
            try:
                count, fbase, psize, _crc = FR.parse_header(os.pread(fd, FR.HEADER_SIZE, pos), 0)
            except (FR.FrameError, struct.error):
                return None
            if fbase <= offset < fbase + count:
                ms = first_record_ms(path, pos)
                return ms if ms is not None and ms >= 0 else None
            if fbase > offset:
                return None
            pos += FR.HEADER_SIZE + psize
        return None
    finally:
        os.close(fd)


def peek(directory: Path) -> DiskStats:
    """Offsets of a partition whose log is not open here, from its files alone
    (read-only). The hwm file is what a clean close left; when it is empty (a
    crash, or a log opened elsewhere meanwhile) the active segment's frames are
    walked, CRC checked, without cutting or syncing anything."""
    d = Path(directory)
    segs = _segment_files(d)
    if not segs:
        return DiskStats(0, 0, 0)
    oldest = segs[0][0]
    size = sum(st.st_size for _, st in segs)
    first = next(((b, st) for b, st in segs if st.st_size > 0), None)
    first_ms = first_record_ms(d / f"{first[0]:020d}.log") if first is not None else None
    first_ms = first_ms if first_ms is not None and first_ms >= 0 else None
    raw = _read_small(d / "hwm")
    if len(raw) == 8:
        hwm = max(_U64.unpack(raw)[0], oldest)
        return DiskStats(oldest, hwm, hwm, len(segs), size, first_ms)
    base = segs[-1][0]
    try:
        data = (d / f"{base:020d}.log").read_bytes()
    except FileNotFoundError:
        return DiskStats(oldest, base, base, len(segs), size, first_ms)
    tail, _ = _walk_frames(data, base, [], [], set(), str(d))
    return DiskStats(oldest, tail, tail, len(segs), size, first_ms)


def expired_on_disk(directory: Path, retention_ms: int, now_ms: int) -> bool:
    """Would a retention sweep of this (closed) partition delete anything? A sealed
    segment last written before the cutoff, or a non-empty active one (it would be
    sealed and deleted). Stats only; a hint, the sweep applies the real rules."""
    if retention_ms <= 0:
        return False
    cutoff = now_ms - retention_ms
    segs = _segment_files(Path(directory))
    for i, (_base, st) in enumerate(segs):
        if int(st.st_mtime * 1000) >= cutoff:
            return False  # segments age from the oldest on
        if i + 1 < len(segs) or st.st_size > 0:
            return True
    return False
