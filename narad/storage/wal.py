"""The ingress write-ahead log: what a 202 stands on.

Each worker owns one WAL directory (``<data>/ingress/w<i>/``): 64 MiB
segments named by their first sequence number, frames
``'NWA2' | u32 length | u64 seq | u32 CRC-32C | payload`` with dense,
strictly increasing sequence numbers, and a ``checkpoint`` file (8 bytes: the
first sequence not yet committed at its partition's owner). A frame's CRC is
seeded with its segment's salt (a CRC of the segment's first seq), so a frame
verifies only in the segment it was written for. Frames of earlier builds
(``'NWAL'``, unseeded) are read in fresh segments, never written.

Segment recycling: a dispatched segment is not unlinked but kept as a spare
(``<bound>.spare``, every seq in it below ``bound``; at most ``SPARE_SEGMENTS``)
and renamed into place as the next segment, ``<first seq>.rwal``, whose frames
overwrite the stale ones. Overwriting blocks a file already has costs less than
appending (no block allocation, no fresh page-cache pages, no journal commit in
the fdatasync: the file's size does not change; ``loadtest/bench_wal.py``). A
recycled segment is read strictly: its frames from the start while each verifies
with the next seq, nothing after the first that does not. Its stale bytes (old
client payloads among them) are thus never searched for frames, and a torn write
in it (which does not run past the end of the file) is cut like any torn tail;
the price is that damage in the middle of a recycled segment (a bad sector, not
a crash) loses the records after it. A fresh ``.wal`` segment keeps the rules
below. The stale tail is cut when a segment is left (rotation) and at open.

Group commit: every append staged while a write+fdatasync is running joins the
next one, so concurrent produces share one write and one sync (run on the
WAL's own I/O thread, the event loop keeps accepting; the loop is woken once
per group and answers every waiter of the group from that one callback). An append's future resolves with the
true outcome of the sync that covers it; a staged record is never withdrawn.
A write or sync failure fails every waiter of that batch and latches the WAL:
every later append fails until restart (the region after the failure has
unknown content). At the next start, recovery cuts the torn tail and
everything before it is dispatched again. Damage with valid frames after it
(a flipped bit, a lost sector) is not a torn tail: nothing is cut, the damaged
frames are skipped at replay (logged, their records lost) and appends go to a
new segment; a frame's seq (outside its CRC) must fit where it sits.

The checkpoint moves only when the dispatcher says so; it is overwritten in
place at once (survives a process crash) and fdatasync'd within 250 ms.
Segments wholly below it are deleted; a fully dispatched active segment over
1 MiB is rotated so it can go too.

Imports narad.storage.fileio and narad.storage.iothreads (its syncer thread runs SCHED_BATCH).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import msgspec
from crc32c import crc32c

from narad.storage import fileio, iothreads

log = logging.getLogger("narad.storage.wal")

MAGIC = b"NWA2"  # frames whose CRC is seeded with their segment's salt
LEGACY_MAGIC = b"NWAL"  # frames of builds before recycling (unseeded CRC): read, never written
_ANY_MAGIC = re.compile(b"NWA[2L]")
SPARE_SEGMENTS = 2  # dispatched segments kept for reuse
FRAME = struct.Struct(">4sIQI")
FRAME_HEADER = FRAME.size  # 20
SEGMENT_BYTES = 64 << 20
ROTATE_DISPATCHED_BYTES = 1 << 20
MAX_RECORD = 16 << 20
CHECKPOINT_SYNC_DELAY = 0.25
_U64 = struct.Struct(">Q")

# Record payload: u8 format | u16 topic len | topic | 8 bytes incarnation | u32 partition |
#                 u64 accepted ms | u8 flags | u32 key len (0xFFFFFFFF: no key) | key | message
_REC = struct.Struct(">BH")
_REC2 = struct.Struct(">8sIQBI")
REC_FORMAT = 2
NO_KEY = 0xFFFFFFFF
PLACED_FLAG = 0x80  # a WAL record's flags byte: ``Entry.placed`` (record flags use the low bits)
_TOPIC_HEADS: dict[str, bytes] = {}  # topic -> the record's format byte, topic length and topic


class WALFailed(OSError):
    pass


class Entry(msgspec.Struct, gc=False, eq=False):
    """One accepted message as the WAL and the dispatcher see it.

    A msgspec Struct: built in C (about 80 ns against 340 for a class with ``__slots__``
    and an ``__init__``, on this host; one is built for every message produced),
    compared and hashed by identity (``eq=False``), and not tracked by the garbage
    collector (``gc=False``: its fields are strings, bytes and ints, never a cycle)."""

    topic: str
    incarnation: bytes
    partition: int
    ts_ms: int
    flags: int
    key: bytes | None
    payload: bytes
    seq: int = 0
    # A keyless record with an idempotency key whose partition the node chose (no partition
    # from the client): the dispatcher may send it to its key's partition instead
    # (``Dispatcher._rehome``). Stored in the WAL as PLACED_FLAG of the flags byte, never
    # in a partition's log.
    placed: bool = False

    def head(self) -> bytes:
        """The record's bytes before the message."""
        th = _TOPIC_HEADS.get(self.topic)
        if th is None:
            t = self.topic.encode()
            th = _REC.pack(REC_FORMAT, len(t)) + t
            if len(_TOPIC_HEADS) >= 4096:
                _TOPIC_HEADS.clear()
            _TOPIC_HEADS[self.topic] = th
        k = self.key
        fl = self.flags | PLACED_FLAG if self.placed else self.flags
        if k is None:
            return th + _REC2.pack(self.incarnation, self.partition, self.ts_ms, fl, NO_KEY)
        return th + _REC2.pack(self.incarnation, self.partition, self.ts_ms, fl, len(k)) + k

    def encode(self) -> bytes:
        return self.head() + self.payload

    @classmethod
    def decode(cls, data: bytes | memoryview, seq: int) -> Entry:
        fmt, tlen = _REC.unpack_from(data, 0)
        if fmt != REC_FORMAT:
            raise ValueError(f"unknown WAL record format {fmt}")
        pos = _REC.size
        topic = bytes(data[pos : pos + tlen]).decode()
        pos += tlen
        inc, part, ts, flags, klen = _REC2.unpack_from(data, pos)
        pos += _REC2.size
        key = None
        if klen != NO_KEY:
            key = bytes(data[pos : pos + klen])
            pos += klen
        if flags & PLACED_FLAG:
            return cls(topic, inc, part, ts, flags & ~PLACED_FLAG, key, bytes(data[pos:]), seq, True)
        return cls(topic, inc, part, ts, flags, key, bytes(data[pos:]), seq)


class _Syncer:
    """The WAL's own I/O thread. A group's write + fdatasync runs here and the loop is
    woken once per group (``call_soon_threadsafe``): a pool's ``run_in_executor`` costs
    ~80 us of CPU per round trip on this VM (concurrent and asyncio futures, the pool's
    bookkeeping), a queue and a thread of our own ~27 us."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., None], buf: bytes | bytearray,
               first_seq: int, done: Callable[[BaseException | None], None]) -> None:
        t = self._thread
        if t is None or not t.is_alive():
            t = self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            t.start()
        self._q.put((loop, fn, buf, first_seq, done))

    def _run(self) -> None:
        iothreads.batch_class()
        q = self._q
        while True:
            job = q.get()
            if job is None:
                return
            loop, fn, buf, first_seq, done = job
            exc: BaseException | None = None
            try:
                fn(buf, first_seq)
            except BaseException as e:  # reported to the loop, which latches the WAL
                exc = e
            job = buf = None
            try:
                loop.call_soon_threadsafe(done, exc)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def stop(self) -> None:
        t = self._thread
        if t is not None and t.is_alive():
            self._q.put(None)
            if t is not threading.current_thread():
                t.join(5)
        self._thread = None


def _remove_segments(paths: list[Path], directory: Path) -> int:
    """Unlink segments no record needs any more, then sync the directory (any
    thread: nothing else refers to them). A segment left by a crash before this is
    below the checkpoint at the next start and goes then."""
    removed = 0
    for p in paths:
        try:
            p.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    if removed:
        fileio.fsync_dir(directory)
    return removed


def _log_remove_failure(fut: Any) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("ingress WAL: could not remove dispatched segments", extra={"err": str(fut.exception())})


def _seg_name(first_seq: int, recycled: bool = False) -> str:
    return f"{first_seq:020d}.{'rwal' if recycled else 'wal'}"


def _is_recycled(path: Path) -> bool:
    return path.suffix == ".rwal"


def _segment_files(d: Path) -> list[tuple[int, Path]]:
    """(first seq, path) of every segment in `d`, fresh (.wal) and recycled (.rwal), ascending."""
    out = []
    for p in d.iterdir():
        stem, dot, ext = p.name.partition(".")
        if dot and ext in ("wal", "rwal") and stem.isdigit():
            out.append((int(stem), p))
    return sorted(out)


def _spare_name(bound: int) -> str:
    return f"{bound:020d}.spare"


def salt(first_seq: int) -> int:
    """The CRC seed of the frames of the segment that starts at `first_seq`."""
    return crc32c(_U64.pack(first_seq))


def _crc_ok(data: bytes, magic: bytes, start: int, end: int, crc: int, seed: int, legacy_ok: bool) -> bool:
    if magic == MAGIC:
        return crc32c(data[start:end], seed) == crc
    return legacy_ok and crc32c(data[start:end]) == crc


def _magic_ok(magic: bytes, legacy_ok: bool) -> bool:
    return magic == MAGIC or (legacy_ok and magic == LEGACY_MAGIC)


def _prefix(data: bytes, first: int, legacy_ok: bool) -> Iterator[tuple[int, int, int]]:
    """(position, end, seq) of a segment's valid prefix: frames from the start while
    each verifies and carries the next seq; nothing after the first that does not."""
    seed = salt(first)
    size = len(data)
    pos, want = 0, first
    while pos + FRAME_HEADER <= size:
        magic, length, seq, crc = FRAME.unpack_from(data, pos)
        end = pos + FRAME_HEADER + length
        if (not _magic_ok(magic, legacy_ok) or length == 0 or length > MAX_RECORD or end > size
                or seq != want or not _crc_ok(data, magic, pos + FRAME_HEADER, end, crc, seed, legacy_ok)):
            return
        yield pos, end, seq
        pos, want = end, seq + 1


class IngressWAL:
    def __init__(self, directory: Path, executor: Executor, *, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.dir = Path(directory)
        self.executor = executor
        self.segment_bytes = segment_bytes
        self.failed: OSError | None = None
        self.next_seq = 1
        self.checkpoint_seq = 1  # first seq not yet done
        self._segments: list[tuple[int, Path]] = []  # (first seq, path), ascending
        self._fd = -1
        self._size = 0
        # The loop's view of the segment the next group goes to (frames are sealed with
        # its salt when staged): its first seq and the bytes handed to it so far.
        self._seg_first = 1
        self._seg_fill = 0
        self._seg_salt = salt(1)
        self._rotate_next = False  # the staged group starts a new segment
        self._spares: list[tuple[int, Path]] = []  # (bound, path), kept for reuse; any thread, under the lock
        self._spare_lock = threading.Lock()
        self._spares_pending = 0  # room taken by retires still renaming (under the lock)
        self.recycled = 0  # segments that reused a spare (tests, diagnostics)
        self._staging = bytearray()
        self._staged: list[Entry] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._callbacks: list[Callable[[OSError | None], None]] = []
        self._flushing = False
        self._drained: asyncio.Future[None] | None = None
        self._syncer = _Syncer(f"wal-{self.dir.name}")
        self._ckpt_fd = -1
        self._ckpt_dirty = False
        self._ckpt_timer: asyncio.TimerHandle | None = None
        self.on_durable: Callable[[list[Entry]], None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.durable_seq = 0  # highest seq known on disk

    # ---- open / recovery ---------------------------------------------------------------
    def open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._ckpt_fd = os.open(self.dir / "checkpoint", os.O_RDWR | os.O_CREAT, 0o600)
        raw = os.pread(self._ckpt_fd, 8, 0)
        self.checkpoint_seq = max(1, _U64.unpack(raw)[0]) if len(raw) == 8 else 1
        self._adopt_spares()
        segs = _segment_files(self.dir)
        self._segments = segs
        last = self.checkpoint_seq - 1
        if segs:
            first, path = segs[-1]
            fd = os.open(path, os.O_RDWR)
            fileio.fdatasync(fd)  # trust only what is on disk
            strict = _is_recycled(path)
            good_end, last_in_seg = self._scan(fd, first, strict)
            size = os.fstat(fd).st_size
            # A frame whose header is whole but whose body runs past the end of the file is
            # a torn tail (the last write, cut by a crash): it is cut, never scanned for
            # frames inside it (its payload is a client's bytes and may hold a forged frame).
            # A recycled segment is never scanned past its valid prefix at all.
            later = (self._last_after(fd, good_end, first, last_in_seg)
                     if good_end < size and not strict
                     and not self._torn_at(fd, good_end, last_in_seg + 1, size) else None)
            if later is not None:
                # Valid frames follow the damage: not a torn tail. Those records may be
                # accepted (202) and not yet committed: never cut them. The damaged
                # frames become a gap at replay; appends go to a new segment.
                log.error("ingress WAL: corrupt frames inside the active segment; skipped, never truncated",
                          extra={"segment": path.name, "at": good_end, "after_seq": last_in_seg,
                                 "resumes_at_seq": later[0]})
                os.close(fd)
                last = max(last, later[1])
                self._new_segment(last + 1)
                self._set_active(last + 1, 0)
                self.next_seq = last + 1
                self.durable_seq = last
                return
            if good_end < size:
                if strict and self._stale_at(fd, good_end, first):
                    log.info("ingress WAL: cutting a recycled segment's stale frames after its tail",
                             extra={"segment": path.name, "bytes": size - good_end})
                else:
                    log.warning("ingress WAL: cutting a torn tail",
                                extra={"segment": path.name, "bytes": size - good_end})
                fileio.ftruncate(fd, good_end)
                fileio.fdatasync(fd)
            # Appends use the file position: start them at the end of what is kept
            # (a fresh fd is at 0, which would overwrite the segment's first frames).
            os.lseek(fd, good_end, os.SEEK_SET)
            self._fd, self._size = fd, good_end
            self._set_active(first, good_end)
            last = max(last, last_in_seg)
            if last != last_in_seg:
                # The checkpoint is ahead of this segment's last record (its tail
                # was lost): sequence numbers must stay dense within a segment,
                # so later appends go to a new one named by the next seq.
                log.warning("ingress WAL: checkpoint ahead of the log; starting a new segment",
                            extra={"segment": path.name, "last": last_in_seg, "checkpoint": self.checkpoint_seq})
                os.close(fd)
                self._new_segment(last + 1)
                self._set_active(last + 1, 0)
        else:
            self._new_segment(self.checkpoint_seq)
            self._set_active(self.checkpoint_seq, 0)
        self.next_seq = last + 1
        self.durable_seq = last

    def _set_active(self, first: int, fill: int) -> None:
        self._seg_first, self._seg_fill, self._seg_salt = first, fill, salt(first)

    def _adopt_spares(self) -> None:
        """At open: keep the newest spares that are safe to reuse (every seq in them
        below the checkpoint, so below any segment still to start); remove the rest."""
        found = sorted((int(p.name[:-6]), p) for p in self.dir.glob("*.spare") if p.name[:-6].isdigit())
        keep = [sp for sp in found if sp[0] <= self.checkpoint_seq][-SPARE_SEGMENTS:]
        for sp in found:
            if sp not in keep:
                sp[1].unlink(missing_ok=True)
        self._spares = keep

    def _scan(self, fd: int, first: int, strict: bool) -> tuple[int, int]:
        """(end of the last valid frame, its seq) in a segment (`strict`: a recycled one,
        this build's frames only)."""
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0) if size else b""
        pos, last = 0, first - 1
        for _pos, end, seq in _prefix(data, first, not strict):
            pos, last = end, seq
        return pos, last

    @staticmethod
    def _torn_at(fd: int, pos: int, want: int, size: int) -> bool:
        """Whether the frame at ``pos`` has a whole header (magic, a possible length, the
        next seq) and a body that runs past the end of the file."""
        head = os.pread(fd, FRAME_HEADER, pos)
        if len(head) < FRAME_HEADER:
            return True  # not even a whole header: torn
        magic, length, seq, _crc = FRAME.unpack_from(head, 0)
        return (magic in (MAGIC, LEGACY_MAGIC) and 0 < length <= MAX_RECORD and seq == want
                and pos + FRAME_HEADER + length > size)

    @staticmethod
    def _stale_at(fd: int, pos: int, first: int) -> bool:
        """Whether the frame at ``pos`` is a whole frame of this file's earlier life (a
        recycled segment): a seq below the segment's first (for the log only)."""
        head = os.pread(fd, FRAME_HEADER, pos)
        if len(head) < FRAME_HEADER:
            return False
        magic, length, seq, _crc = FRAME.unpack_from(head, 0)
        return magic == MAGIC and 0 < length <= MAX_RECORD and seq < first

    @staticmethod
    def _frames_from(data: bytes, pos: int, after_seq: int, seed: int) -> Iterator[tuple[int, int, int]]:
        """(position, end, seq) of every frame that verifies from ``pos`` on, skipping
        damage: after a bad frame the scan resumes at the next magic whose frame
        passes its checksum (seeded with the segment's salt: a recycled segment's stale
        frames never pass). The checksum does not cover the seq, so a frame's seq
        must also fit where it sits: seqs are dense within a segment, so it is the
        previous seq + 1, plus at most one per 21 bytes (the smallest frame) skipped
        since the previous good frame (a flipped seq bit is a bad frame, never a jump)."""
        size = len(data)
        last, last_end = after_seq, pos

        def verifies(at: int) -> tuple[int, int] | None:
            magic, length, seq, crc = FRAME.unpack_from(data, at)
            end = at + FRAME_HEADER + length
            if (_magic_ok(magic, True) and 0 < length <= MAX_RECORD and end <= size
                    and last < seq <= last + 1 + (at - last_end) // (FRAME_HEADER + 1)
                    and _crc_ok(data, magic, at + FRAME_HEADER, end, crc, seed, True)):
                return end, seq
            return None

        while pos + FRAME_HEADER <= size:
            ok = verifies(pos)
            if ok is not None:
                yield pos, ok[0], ok[1]
                last, pos = ok[1], ok[0]
                last_end = pos
                continue
            # A damaged frame whose header still says where it ends: when a good frame
            # starts there, resume there, so nothing inside its body (a client's payload,
            # which may hold a forged frame) is ever taken for a frame. Otherwise the
            # header is damaged too: resume at the next magic.
            magic, length, _seq, _crc = FRAME.unpack_from(data, pos)
            claimed = pos + FRAME_HEADER + length
            if (_magic_ok(magic, True) and 0 < length <= MAX_RECORD and claimed + FRAME_HEADER <= size
                    and verifies(claimed) is not None):
                pos = claimed
                continue
            m = _ANY_MAGIC.search(data, pos + 1)
            if m is None:
                return
            pos = m.start()

    def _last_after(self, fd: int, pos: int, first: int, after_seq: int) -> tuple[int, int] | None:
        """(first, last) seq of the valid frames after ``pos`` (damage in the middle of a
        fresh segment), or None."""
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0)
        lo = hi = None
        for _p, _e, seq in self._frames_from(data, pos, after_seq, salt(first)):
            if lo is None:
                lo = seq
            hi = seq
        return None if lo is None or hi is None else (lo, hi)

    def _take_spare(self, first_seq: int) -> Path | None:
        with self._spare_lock:
            for i, (bound, path) in enumerate(self._spares):
                if bound <= first_seq:
                    del self._spares[i]
                    return path
        return None

    def _new_segment(self, first_seq: int) -> None:
        """Make the segment that starts at `first_seq` the active one (any thread):
        a spare renamed into place when there is one, else a new file."""
        spare = self._take_spare(first_seq)
        fd = -1
        path = self.dir / _seg_name(first_seq, recycled=True)
        if spare is not None:
            try:
                os.rename(spare, path)
                fd = os.open(path, os.O_RDWR)
                self.recycled += 1
            except OSError as e:
                log.warning("ingress WAL: could not reuse a spare segment", extra={"err": str(e)})
                spare.unlink(missing_ok=True)
                fd = -1
        if fd < 0:
            path = self.dir / _seg_name(first_seq)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        # A file of the other kind with this name (left by a crash, or one a lost tail
        # left behind) would stand for the same seqs: it goes, as O_TRUNC did before.
        (self.dir / _seg_name(first_seq, recycled=not _is_recycled(path))).unlink(missing_ok=True)
        try:
            fileio.fsync_dir(self.dir)
        except OSError:
            # A stale empty segment named past records still appended to the old
            # one would hide them at the next start: take it away again.
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._segments.append((first_seq, path))
        self._fd, self._size = fd, 0

    def replay(self) -> Iterator[Entry]:
        """Every record from the checkpoint on, in order (dispatch after a restart)."""
        for i, (first, path) in enumerate(self._segments):
            nxt = self._segments[i + 1][0] if i + 1 < len(self._segments) else self.next_seq
            if nxt <= self.checkpoint_seq:
                continue
            with open(path, "rb") as fh:
                data = fh.read()
            want = first
            frames = (_prefix(data, first, False) if _is_recycled(path)
                      else self._frames_from(data, 0, first - 1, salt(first)))
            for pos, end, seq in frames:
                if seq >= nxt or seq >= self.next_seq:
                    break
                if seq != want:
                    log.error("ingress WAL: unreadable frames skipped; their records are lost",
                              extra={"segment": path.name, "first_seq": want, "last_seq": seq - 1})
                if seq >= self.checkpoint_seq:
                    try:
                        yield Entry.decode(memoryview(data)[pos + FRAME_HEADER : end], seq)
                    except (ValueError, struct.error, UnicodeDecodeError) as e:
                        log.error("ingress WAL: undecodable record skipped", extra={"seq": seq, "err": str(e)})
                want = seq + 1

    # ---- append (group commit) ------------------------------------------------------------
    def append(self, entries: list[Entry]) -> asyncio.Future[None]:
        """Stage entries (seqs assigned now) and return a future that resolves
        when the sync covering them returned. Raises WALFailed if latched."""
        if self.failed is not None:
            raise WALFailed(self.failed.errno or 5, f"ingress WAL failed earlier: {self.failed}")
        loop = self._get_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if not entries:
            if self._staging:
                self._waiters.append(fut)  # resolves with what is staged before it
            else:
                fut.set_result(None)
            return fut
        self._stage(entries)
        self._waiters.append(fut)
        if not self._flushing:
            self._start_group()
        return fut

    def append_cb(self, entries: list[Entry], done: Callable[[OSError | None], None]) -> None:
        """``append`` without a future: ``done(None)`` is called on the loop once the
        sync covering ``entries`` returned, ``done(WALFailed)`` if it failed (the hot
        produce path answers from there: no future, no task wake-up). Raises WALFailed
        if latched, ValueError if a record is too large (nothing staged then)."""
        if self.failed is not None:
            raise WALFailed(self.failed.errno or 5, f"ingress WAL failed earlier: {self.failed}")
        self._get_loop()
        self._stage(entries)
        self._callbacks.append(done)
        if not self._flushing:
            self._start_group()

    def _stage(self, entries: list[Entry]) -> None:
        # Check everything before staging anything: a refused batch must leave no
        # frame behind (its seqs would be handed out again). A record is its head
        # (everything before the message) and the message, appended apart: the CRC
        # runs over both without joining them first.
        heads = [e.head() for e in entries]
        for e, h in zip(entries, heads, strict=True):
            if len(h) + len(e.payload) > MAX_RECORD:
                raise ValueError("record too large for the WAL")
        buf = self._staging
        seq = self.next_seq
        if not buf and self._seg_fill >= self.segment_bytes:
            # A new group and a full segment: this group starts the next one (the frames
            # are sealed with that segment's salt, so the choice is made here, not at write).
            self._set_active(seq, 0)
            self._rotate_next = True
        seed = self._seg_salt
        pack = FRAME.pack
        n0 = len(buf)
        for e, h in zip(entries, heads, strict=True):
            e.seq = seq
            p = e.payload
            buf += pack(MAGIC, len(h) + len(p), seq, crc32c(p, crc32c(h, seed)))
            buf += h
            buf += p
            seq += 1
        self._seg_fill += len(buf) - n0
        self.next_seq = seq
        self._staged.extend(entries)

    def _start_group(self) -> None:
        """Hand everything staged to the I/O thread: one write and one fdatasync; the
        loop is woken once when it returns (``_group_done``)."""
        self._flushing = True
        buf, self._staging = self._staging, bytearray()
        staged, self._staged = self._staged, []
        waiters, self._waiters = self._waiters, []
        callbacks, self._callbacks = self._callbacks, []
        rotate, self._rotate_next = self._rotate_next, False
        loop = self._get_loop()
        self._syncer.submit(loop, self._write_rotating if rotate else self._write_sync, buf, staged[0].seq,
                            lambda exc: self._group_done(staged, waiters, callbacks, exc))

    def _group_done(self, staged: list[Entry], waiters: list[asyncio.Future[None]],
                    callbacks: list[Callable[[OSError | None], None]], exc: BaseException | None) -> None:
        """On the loop: the group's sync returned; answer every waiter of the group."""
        if exc is not None:
            if not isinstance(exc, OSError):
                exc = OSError(5, f"{type(exc).__name__}: {exc}")
            self._latch(exc, waiters, callbacks)
            self._flush_ended()
            return
        self.durable_seq = staged[-1].seq
        for w in waiters:
            if not w.done():
                w.set_result(None)
        for cb in callbacks:
            try:
                cb(None)
            except Exception:
                log.exception("ingress WAL: a durable callback failed")
        if self.on_durable is not None:
            try:
                self.on_durable(staged)
            except Exception:
                # A listener's bug must not stop the group commit (waiters
                # staged meanwhile would never resolve).
                log.exception("ingress WAL: on_durable callback failed")
        if self._staging and self.failed is None:
            self._start_group()
        else:
            self._flush_ended()

    def _flush_ended(self) -> None:
        self._flushing = False
        d = self._drained
        if d is not None and not d.done():
            d.set_result(None)

    def _write_sync(self, buf: bytes | bytearray, first_seq: int) -> None:
        """I/O thread: one write and one fdatasync for the whole group."""
        fileio.write_all(self._fd, buf)
        self._size += len(buf)
        fileio.fdatasync(self._fd)

    def _write_rotating(self, buf: bytes | bytearray, first_seq: int) -> None:
        """I/O thread: the group starts the next segment (chosen when it was staged)."""
        self._leave_segment()
        old = self._fd
        self._new_segment(first_seq)  # replaces self._fd only once it exists
        os.close(old)
        self._write_sync(buf, first_seq)

    def _leave_segment(self) -> None:
        """The active segment is done: a recycled file's stale frames after the tail are
        cut (only the active segment may have any), and it is synced."""
        if os.fstat(self._fd).st_size > self._size:
            fileio.ftruncate(self._fd, self._size)
        fileio.fdatasync(self._fd)

    def _latch(self, e: OSError, waiters: list[asyncio.Future[None]],
               callbacks: list[Callable[[OSError | None], None]] | None = None) -> None:
        self.failed = e
        log.error("ingress WAL write or fsync failed; produce is refused until restart",
                  extra={"err": str(e), "errno": e.errno})
        err = WALFailed(e.errno or 5, f"ingress WAL failed: {e}")
        for w in waiters + self._waiters:
            if not w.done():
                w.set_exception(err)
                w.exception()  # retrieved: the producer may have gone
        for cb in [*(callbacks or ()), *self._callbacks]:
            try:
                cb(err)
            except Exception:
                log.exception("ingress WAL: a failure callback failed")
        self._waiters, self._callbacks, self._staged, self._staging = [], [], [], bytearray()

    # ---- checkpoint and reclaim ----------------------------------------------------------------
    def set_checkpoint(self, seq: int) -> None:
        if seq <= self.checkpoint_seq:
            return
        self.checkpoint_seq = seq
        try:
            fileio.pwrite_all(self._ckpt_fd, _U64.pack(seq), 0)
        except OSError as e:
            log.error("ingress WAL: could not store the checkpoint", extra={"err": str(e)})
            return
        self._ckpt_dirty = True
        if self._ckpt_timer is None:
            loop = self._get_loop()
            self._ckpt_timer = loop.call_later(CHECKPOINT_SYNC_DELAY, self._sync_checkpoint)

    def _sync_checkpoint(self) -> None:
        self._ckpt_timer = None
        if not self._ckpt_dirty:
            return
        self._ckpt_dirty = False
        loop = self._get_loop()
        fut = loop.run_in_executor(self.executor, fileio.fdatasync, self._ckpt_fd)
        fut.add_done_callback(self._after_checkpoint_sync)

    def _after_checkpoint_sync(self, fut: Any) -> None:
        if fut.exception() is not None:
            log.error("ingress WAL: checkpoint fsync failed", extra={"err": str(fut.exception())})
            return
        doomed = self._reclaim_plan()
        if doomed:
            # Unlinking a 64 MiB segment took 20 ms on this VM: never on the event loop.
            gone = self._get_loop().run_in_executor(self.executor, self._retire, doomed)
            gone.add_done_callback(_log_remove_failure)

    def reclaim(self) -> int:
        """Retire segments wholly below the checkpoint; rotate a dispatched active one.
        Returns how many segments went (synchronous: tests and tools; the WAL's own
        reclaim after each checkpoint sync retires them on an I/O thread)."""
        return self._retire(self._reclaim_plan())

    def _retire(self, doomed: list[tuple[int, Path]]) -> int:
        """Any thread: the newest dispatched segments (bound: every seq in one is below
        it) become spares while there is room (reserved under the lock, so retires
        running at once never keep more than ``SPARE_SEGMENTS``), the rest are unlinked;
        then the directory is synced. A segment left by a crash before this is below
        the checkpoint at the next start and goes then."""
        with self._spare_lock:
            room = max(0, min(len(doomed), SPARE_SEGMENTS - len(self._spares) - self._spares_pending))
            self._spares_pending += room
        kept: list[tuple[int, Path]] = []
        gone = [path for _, path in doomed[: len(doomed) - room]]
        try:
            for bound, path in doomed[len(doomed) - room:]:
                spare = self.dir / _spare_name(bound)
                try:
                    os.rename(path, spare)
                except OSError:
                    gone.append(path)
                    continue
                kept.append((bound, spare))
        finally:
            with self._spare_lock:
                self._spares_pending -= room
                self._spares.extend(kept)
                self._spares.sort()
        removed = _remove_segments(gone, self.dir) if gone else 0  # syncs the directory if it removed one
        if kept and not removed:
            fileio.fsync_dir(self.dir)
        return removed + len(kept)

    def _reclaim_plan(self) -> list[tuple[int, Path]]:
        """The bookkeeping of a reclaim (event loop): the segments that go leave the
        list, a dispatched active one is rotated; -> (bound, path) of the segments
        that go (the caller retires them and syncs the directory)."""
        doomed: list[tuple[int, Path]] = []
        while len(self._segments) > 1 and self._segments[1][0] <= self.checkpoint_seq:
            doomed.append((self._segments[1][0], self._segments.pop(0)[1]))
        if (self.failed is None and not self._flushing and self.checkpoint_seq == self.next_seq
                and self._size > ROTATE_DISPATCHED_BYTES):
            old_fd, old = self._fd, self._segments.pop()
            try:
                self._new_segment(self.next_seq)
            except OSError as e:
                # self._fd must never be left pointing at a closed (and maybe
                # reused) descriptor: the old segment stays. But a new file named
                # next_seq may be left (or come back after a crash: the directory
                # was not synced), and its name would hide whatever is appended to
                # the old one: a disk failure like any other, latch.
                self._segments.append(old)
                self._latch(e, [])
            else:
                os.close(old_fd)
                self._set_active(self.next_seq, 0)
                doomed.append((self.next_seq, old[1]))
        return doomed

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        # Cached: get_running_loop() costs a getpid() syscall per call on 3.11.
        loop = self.loop
        if loop is None or loop.is_closed():
            loop = self.loop = asyncio.get_running_loop()
        return loop

    @property
    def backlog(self) -> int:
        """Accepted records not yet confirmed at their owner (what a restart replays)."""
        return self.durable_seq + 1 - self.checkpoint_seq

    async def drain(self) -> None:
        """Wait for the group commit in flight (call before close)."""
        if not self._flushing:
            return
        d = self._drained
        if d is None or d.done():
            d = self._drained = self._get_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(d), 30)
        except (TimeoutError, Exception):
            log.error("ingress WAL: flush still running at close")

    def close(self) -> None:
        if self._ckpt_timer is not None:
            self._ckpt_timer.cancel()
            self._ckpt_timer = None
        try:
            fileio.fdatasync(self._ckpt_fd)
        except OSError:
            pass
        self._syncer.stop()
        for fd in (self._fd, self._ckpt_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._ckpt_fd = -1


def now_ms() -> int:
    return int(time.time() * 1000)
