"""Consumer progress of one partition on disk: the committed frontier and the
acks held above it, in two checksummed 4 KiB slots (``consumer.ahead``), plus
``consumer.offset`` (8 bytes, the frontier alone, levelled at most every 30 s
and at close).

The *anchor* slot holds the newest record known durable and is never written
while it is the anchor; writes go to the other slot (the *window*), first to
the page cache (every ~100 ms: survives a process crash), then synced (every
``consumer_offset_commit_interval_ms``: survives power loss), after which the
roles flip. A torn window fails its checksum and recovery falls back to the
anchor. Every record holds only acked values, so recovery never yields a
frontier past a real ack; the worst case is redelivery.

Slot: ``'NOFF' | u32 crc32c(rest) | u32 used | u64 seq | i64 frontier |
u32 count | uvarint deltas`` (acked offsets above the frontier, ascending)
``[| u32 ncounts | ncounts x (uvarint delta, uvarint deliveries)``
``[| u32 nreasons | nreasons x (uvarint delta, uvarint length, UTF-8 reason)]]``.
Too many acks to fit: the lowest are kept, the rest will be redelivered (``fits``
says whether a set fits whole: a partition whose held acks do not is never
closed as idle).

The optional tail (issue 14) holds the delivery counts of unacked offsets above
the frontier (offset deltas from the frontier, ascending; counts >= 1). A slot
written before it ends after the deltas and decodes as no counts; a decoder
without it ignores the tail (``used`` covers it, the checksum too). The counts
take the room the acks leave: when not all fit, the highest counts are kept
(ties: the lowest offsets), as those are the nearest to their dead-letter
maximum; a count left out restarts from zero after a restart (the record may be
delivered up to ``max_deliveries`` more times, never lost).

The second optional tail holds the last nack reasons of unacked offsets (deltas
chained from the frontier like the counts'; a reason is at most 256 bytes). It
follows the counts tail (a ``u32 0`` count header when there are no counts); a
decoder without it stops after the counts. Reasons take the room acks and counts
leave, in the counts' order of preference (highest count first); a reason left
out is lost at a restart (its dead-letter record then says none). A slot is never
refused for a reason's bytes: bad UTF-8 decodes with replacement characters.

The third optional tail (``u32 n | n x uvarint delta``, chained from the frontier)
marks the offsets held for the dead-letter topic (``first`` of ``write_window``):
once one is held, its dead-letter copy may be made at any moment, so after a
restart (or at a move's destination) it is held again whatever its count says
against a changed ``max_deliveries``, never delivered from its source. It follows
the reasons tail (a ``u32 0`` for each absent tail before it) but takes its room
first, right after the acks (before the counts and the reasons); a mark left out goes into
``dropped`` like a count (the dead-letter driver waits for room). A decoder
without it stops after the reasons.

An ``OffsetFile`` is used from the event loop (``write_window``) and from I/O
threads (``writeout``, ``level``, ``close``): one lock orders them, and after
``close`` every write is a no-op (a late writeout of a closed partition can
never touch a reopened one's files). ``close`` writes only what the files do
not already say. ``peek`` reads a closed partition's progress without opening
or priming anything.

Imports narad.storage.fileio and narad.storage.frames (its uvarint writer and reader).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections.abc import Collection, Container, Iterable
from pathlib import Path

from crc32c import crc32c

from narad.storage import fileio
from narad.storage.frames import read_uvarint, uvarint

log = logging.getLogger("narad.storage.offsets")

SLOT = 4096
_HDR = struct.Struct(">4sII")  # magic, crc, used bytes after the header
_BODY = struct.Struct(">QqI")  # seq, frontier, count
MAGIC = b"NOFF"
_I64 = struct.Struct(">q")


def _uvarint_len(d: int) -> int:
    n = 1
    while d >= 0x80:
        d >>= 7
        n += 1
    return n


_U32 = struct.Struct(">I")
Counts = dict[int, int]  # offset -> deliveries
Reasons = dict[int, str]  # offset -> its last nack's reason


def fits(frontier: int, ahead: list[int], counts: Counts | None = None) -> bool:
    """Whether a record of `frontier`, these held acks (ascending) and these delivery
    counts fits one slot whole."""
    room = SLOT - _HDR.size - _BODY.size
    prev, used = frontier, 0
    for off in ahead:
        d = off - prev
        if d <= 0:
            continue
        used += _uvarint_len(d)
        if used > room:
            return False
        prev = off
    live = sorted((o, c) for o, c in (counts or {}).items() if o > frontier and c > 0)
    if live:
        used += _U32.size
        prev = frontier
        for off, c in live:  # as _encode_counts writes them when all fit
            used += _uvarint_len(off - prev) + _uvarint_len(c)
            if used > room:
                return False
            prev = off
    return True


def _encode_counts(frontier: int, counts: Counts, room: int, dropped: set[int] | None = None,
                   first: Container[int] = ()) -> bytes:
    """The counts tail within `room` bytes. All of them when they fit (the usual case:
    a flat bytes() of one-byte deltas and counts when every value is below 128);
    otherwise the offsets in `first` (records held for the dead-letter topic), then
    the highest counts (ties: the lowest offsets), each charged its delta from the
    frontier, an upper bound of the delta it is written with, so what is chosen
    always fits. The offsets whose counts are left out go into `dropped`."""
    live = sorted((o, c) for o, c in counts.items() if o > frontier and c > 0)
    if not live or room <= _U32.size:
        if dropped is not None:
            dropped.update(o for o, _ in live)
        return b""
    room -= _U32.size
    flat: list[int] = []
    prev = frontier
    for o, c in live:
        flat.append(o - prev)
        flat.append(c)
        prev = o
    if max(flat) < 0x80 and len(flat) <= room:
        return _U32.pack(len(live)) + bytes(flat)
    out = bytearray()
    for v in flat:
        out += uvarint(v)
    if len(out) <= room:
        return _U32.pack(len(live)) + bytes(out)
    live.sort(key=lambda oc: (oc[0] not in first, -oc[1], oc[0]))
    chosen: list[tuple[int, int]] = []
    budget = 0
    for o, c in live:
        cost = _uvarint_len(o - frontier) + _uvarint_len(c)
        if budget + cost > room:
            break
        budget += cost
        chosen.append((o, c))
    if dropped is not None:
        dropped.update(o for o, _ in live[len(chosen):])
    chosen.sort()
    out = bytearray()
    prev = frontier
    for o, c in chosen:
        out += uvarint(o - prev)
        out += uvarint(c)
        prev = o
    return _U32.pack(len(chosen)) + bytes(out)


def _encode_reasons(frontier: int, reasons: Reasons, counts: Counts, room: int) -> bytes:
    """The reasons tail within `room` bytes (after the counts tail): the reasons of
    the offsets with the highest counts first (ties: the lowest offsets), each
    charged its delta from the frontier (an upper bound of the one it is written
    with, so what is chosen always fits); the rest are left out."""
    live = [(o, r.encode("utf-8", "replace")) for o, r in reasons.items() if o > frontier and r]
    if not live or room <= _U32.size:
        return b""
    room -= _U32.size
    live.sort(key=lambda e: (-counts.get(e[0], 0), e[0]))
    chosen: list[tuple[int, bytes]] = []
    for o, rb in live:
        cost = _uvarint_len(o - frontier) + _uvarint_len(len(rb)) + len(rb)
        if cost <= room:
            chosen.append((o, rb))
            room -= cost
    if not chosen:
        return b""
    chosen.sort()
    out = bytearray(_U32.pack(len(chosen)))
    prev = frontier
    for o, rb in chosen:
        out += uvarint(o - prev)
        out += uvarint(len(rb))
        out += rb
        prev = o
    return bytes(out)


def _encode_held(frontier: int, held: Iterable[int], ahead: Container[int], room: int,
                 dropped: set[int] | None) -> bytes:
    """The held-marks tail within `room` bytes: the lowest offsets first; the ones
    left out go into `dropped`."""
    live = sorted(o for o in held if o > frontier and o not in ahead)
    if not live:
        return b""
    out = bytearray()
    prev = frontier
    n = 0
    for o in live:
        enc = uvarint(o - prev)
        if _U32.size + len(out) + len(enc) > room:
            break
        out += enc
        prev = o
        n += 1
    if dropped is not None:
        dropped.update(live[n:])
    return _U32.pack(n) + bytes(out) if n else b""


def _encode(seq: int, frontier: int, ahead: list[int], counts: Counts | None = None,
            reasons: Reasons | None = None, dropped: set[int] | None = None, first: Collection[int] = ()) -> bytes:
    out = bytearray()
    prev = frontier
    n = 0
    room = SLOT - _HDR.size - _BODY.size
    for off in ahead:
        d = off - prev
        if d <= 0:
            continue
        enc = uvarint(d)
        if len(out) + len(enc) > room:
            break
        out += enc
        prev = off
        n += 1
    held = first
    if counts or reasons or held:
        avail = room - len(out)
        # The marks take their room first (after the acks): a mark left out can leave a
        # record live in both topics after a restart, a count left out only costs
        # deliveries. With marks, a counts and a reasons header (or ``u32 0``) precede them.
        marks = _encode_held(frontier, held, set(ahead), avail - 2 * _U32.size, dropped) if held else b""
        if marks:
            avail -= len(marks) + _U32.size
        tail = _encode_counts(frontier, counts or {}, avail, dropped, first)
        left = avail - max(len(tail), _U32.size) + (_U32.size if marks else 0)
        more = b""
        if reasons and left > _U32.size:
            more = _encode_reasons(frontier, reasons, counts or {}, left)
        if more or marks:
            out += tail or _U32.pack(0)
            tail = more or _U32.pack(0)
            if marks:
                tail += marks
        out += tail
    body = _BODY.pack(seq, frontier, n) + bytes(out)
    return (_HDR.pack(MAGIC, crc32c(body), len(body)) + body).ljust(SLOT, b"\0")


def _tail_head(body: bytes, pos: int, used: int, min_entry: int) -> tuple[int, int]:
    """(entries, the position after the count) of the optional tail at `pos`: (0, pos)
    when there is none (a slot written without it, or before it existed), (-1, pos)
    when its count cannot be right (each entry takes at least `min_entry` bytes)."""
    if pos == used:
        return 0, pos
    if pos + _U32.size > used:
        return -1, pos
    (n,) = _U32.unpack_from(body, pos)
    pos += _U32.size
    return (n, pos) if n <= (used - pos) // min_entry else (-1, pos)


def _decode_counts(body: bytes, pos: int, used: int, frontier: int) -> tuple[Counts, int] | None:
    """-> (counts, the position after them) or None (not a valid tail)."""
    n, pos = _tail_head(body, pos, used, 2)
    if n < 0:
        return None
    out: Counts = {}
    prev = frontier
    for _ in range(n):
        d, pos = read_uvarint(body, pos)  # body is the slot's `used` bytes
        if d <= 0:
            return None
        prev += d
        c, pos = read_uvarint(body, pos)
        if c <= 0:
            return None
        out[prev] = c
    return out, pos


def _decode_reasons(body: bytes, pos: int, used: int, frontier: int) -> tuple[Reasons, int] | None:
    """-> (reasons, the position after them) or None (not a valid tail)."""
    n, pos = _tail_head(body, pos, used, 3)
    if n < 0:
        return None
    out: Reasons = {}
    prev = frontier
    for _ in range(n):
        d, pos = read_uvarint(body, pos)
        if d <= 0:
            return None
        prev += d
        ln, pos = read_uvarint(body, pos)
        if ln <= 0 or pos + ln > used:
            return None
        out[prev] = body[pos:pos + ln].decode("utf-8", "replace")
        pos += ln
    return out, pos


def _decode_held(body: bytes, pos: int, used: int, frontier: int) -> set[int] | None:
    n, pos = _tail_head(body, pos, used, 1)
    if n < 0:
        return None
    out: set[int] = set()
    prev = frontier
    for _ in range(n):
        d, pos = read_uvarint(body, pos)
        if d <= 0:
            return None
        prev += d
        out.add(prev)
    return out


Slot = tuple[int, int, list[int], Counts, Reasons, set[int]]


def _decode_every(slot: bytes) -> Slot | None:
    """-> (seq, frontier, acked-ahead, delivery counts, nack reasons, held marks) or
    None (not a valid slot)."""
    r = _decode(slot, want_tail=True)
    return r  # type: ignore[return-value]


def _decode_all(slot: bytes) -> tuple[int, int, list[int], Counts, Reasons] | None:
    """-> (seq, frontier, acked-ahead, delivery counts, nack reasons) or None (not a
    valid slot)."""
    r = _decode_every(slot)
    return None if r is None else r[:5]


def _decode_full(slot: bytes) -> tuple[int, int, list[int], Counts] | None:
    """-> (seq, frontier, acked-ahead, delivery counts) or None (not a valid slot)."""
    r = _decode_all(slot)
    return None if r is None else r[:4]


def _decode(slot: bytes, want_tail: bool = False) -> tuple[int, int, list[int]] | None:
    if len(slot) < _HDR.size + _BODY.size:
        return None
    magic, crc, used = _HDR.unpack_from(slot, 0)
    if magic != MAGIC or used < _BODY.size or used > SLOT - _HDR.size:
        return None  # (a slot truncated after its magic reads as used=0, crc=0: checksum of nothing)
    body = slot[_HDR.size : _HDR.size + used]
    if len(body) != used or crc32c(body) != crc:
        return None
    seq, frontier, n = _BODY.unpack_from(body, 0)
    if frontier < -1 or n > used - _BODY.size:
        return None  # each held ack takes at least one byte
    pos, prev, out = _BODY.size, frontier, []
    for _ in range(n):
        d, pos = read_uvarint(body, pos)
        if d <= 0:
            return None  # deltas are strictly positive (-1: a varint running past the slot)
        prev += d
        out.append(prev)
    if want_tail:
        got = _decode_counts(body, pos, used, frontier)
        if got is None:
            return None
        counts, pos = got
        got_r = _decode_reasons(body, pos, used, frontier)
        if got_r is None:
            return None
        reasons, pos = got_r
        held = _decode_held(body, pos, used, frontier)
        if held is None:
            return None
        return seq, frontier, out, counts, reasons, held  # type: ignore[return-value]
    return seq, frontier, out


def _best_slot(slots: list[Slot | None]) -> int | None:
    best = None
    for i, s in enumerate(slots):
        if s is not None and (best is None or s[0] > slots[best][0]):  # type: ignore[index]
            best = i
    return best


def _read_level_at(d: Path) -> int:
    try:
        raw = (d / "consumer.offset").read_bytes()
    except FileNotFoundError:
        return -1
    return _I64.unpack(raw)[0] if len(raw) == 8 else -1


def peek(directory: Path, max_frontier: int | None = None) -> tuple[int, list[int]]:
    """(frontier, acked-ahead offsets) as ``OffsetFile.load`` would recover them,
    read-only: nothing is created, primed or synced (a closed partition's stats)."""
    frontier, ahead, _counts = peek_counts(directory, max_frontier)
    return frontier, ahead


def peek_counts(directory: Path, max_frontier: int | None = None) -> tuple[int, list[int], Counts]:
    """``peek`` with the delivery counts (offsets above the recovered frontier)."""
    frontier, ahead, counts, _reasons = peek_all(directory, max_frontier)
    return frontier, ahead, counts


def peek_all(directory: Path, max_frontier: int | None = None) -> tuple[int, list[int], Counts, Reasons]:
    """``peek`` with the delivery counts and the nack reasons (offsets above the
    recovered frontier)."""
    d = Path(directory)
    try:
        with open(d / "consumer.ahead", "rb") as fh:
            raw = fh.read(2 * SLOT)
    except FileNotFoundError:
        raw = b""
    slots = [_decode_all(raw[i * SLOT:(i + 1) * SLOT]) for i in (0, 1)]
    best = _best_slot(slots)
    frontier, ahead, counts, reasons = -1, [], {}, {}
    if best is not None:
        _seq, frontier, ahead, counts, reasons = slots[best]  # type: ignore[misc]
    level = _read_level_at(d)
    if max_frontier is not None and level > max(max_frontier, frontier):
        level = -1
    if level > frontier:
        frontier = level
        ahead = [a for a in ahead if a > frontier]
        counts = {o: c for o, c in counts.items() if o > frontier}
        reasons = {o: r for o, r in reasons.items() if o > frontier}
    return frontier, ahead, counts, reasons


def _marks(frontier: int, ahead: list[int], held: Iterable[int]) -> set[int]:
    """The held marks a slot of (frontier, ahead) says, all of them fitting."""
    if not held:
        return set()
    a = set(ahead)
    return {o for o in held if o > frontier and o not in a}


class OffsetFile:
    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self._fd = -1
        self._anchor = 0  # slot index of the anchor
        self._seq = 0
        self.dirty_since_sync = False
        self._lock = threading.Lock()
        self._anchored: tuple[int, list[int], Counts, Reasons, set[int]] | None = None  # what the anchor slot says
        self._window: tuple[int, list[int], Counts, Reasons, set[int]] | None = None  # the window, once written whole
        # The held marks of every window written (or tried) since the last sync: the kernel
        # may have written back any of them before a power loss (``marks_recoverable``).
        self._unsynced_marks: set[int] = set()
        self.counts: Counts = {}  # the delivery counts ``load`` recovered
        self.reasons: Reasons = {}  # the nack reasons ``load`` recovered
        self.held: set[int] = set()  # the offsets ``load`` found held for the dead-letter topic
        self._level_on_disk = -1  # what consumer.offset holds

    def marks_recoverable(self) -> set[int]:
        """The held marks a load could find now: those of the anchor and of every window
        written or tried since the last sync (a process crash leaves the last one whole;
        a power loss whichever of them the kernel wrote back, or the anchor)."""
        with self._lock:
            out = set(self._unsynced_marks)
            if self._anchored is not None:
                out |= self._anchored[4]
            return out

    def load(self, max_frontier: int | None = None) -> tuple[int, list[int]]:
        """Open (priming the file) and return (frontier, acked-ahead offsets).

        ``max_frontier`` (the log's high watermark - 1, when the caller knows it):
        ``consumer.offset`` carries no checksum, and a frontier past the end of the
        log cannot come from an ack (a damaged file, e.g. a flipped high bit): it is
        ignored rather than clamped, which would skip every unacked record.
        The delivery counts recovered are left in ``self.counts``, the nack reasons
        in ``self.reasons``."""
        path = self.dir / "consumer.ahead"
        created = not path.exists()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = os.fstat(self._fd).st_size
        if size < 2 * SLOT:
            # Real zeros, not a sparse hole: later in-place writes must never need
            # new blocks (acks keep persisting on a full disk).
            fileio.pwrite_all(self._fd, bytes(2 * SLOT - size), size)
        slots = [_decode_every(os.pread(self._fd, SLOT, i * SLOT)) for i in (0, 1)]
        best = _best_slot(slots)
        frontier, ahead, counts, reasons, held = -1, [], {}, {}, set()
        if best is not None:
            self._seq, frontier, ahead, counts, reasons, held = slots[best]  # type: ignore[misc]
        level = self._level_on_disk = self._read_level()
        if max_frontier is not None and level > max(max_frontier, frontier):
            log.error("consumer.offset holds a frontier past the end of the log; ignored (damaged file?)",
                      extra={"dir": str(self.dir), "level": level, "log_end": max_frontier + 1})
            level = -1
        raised = level > frontier
        if raised:
            frontier = level
            ahead = [a for a in ahead if a > frontier]
            counts = {o: c for o, c in counts.items() if o > frontier}
            reasons = {o: r for o, r in reasons.items() if o > frontier}
            held = {o for o in held if o > frontier}
        self.counts = counts
        self.reasons = reasons
        self.held = held
        if best is not None and not raised:
            # The newest valid slot becomes the anchor as it is: made durable
            # (a crashed process may have left it in the page cache only), never
            # rewritten in place (a torn rewrite would lose the only good copy).
            self._anchor = best
            fileio.fdatasync(self._fd)
            self._anchored = (frontier, list(ahead), dict(counts), dict(reasons), set(held))
        else:
            # Nothing valid yet, or consumer.offset is ahead of the slots: a new
            # record, into the slot that is not the newest valid one, then anchored.
            self._anchor = 0 if best is None else 1 - best
            self._seq += 1
            fileio.pwrite_all(self._fd, _encode(self._seq, frontier, ahead, counts, reasons, None, held),
                              self._anchor * SLOT)
            fileio.fdatasync(self._fd)
            self._anchored = (frontier, list(ahead), dict(counts), dict(reasons), set(held))
        self.dirty_since_sync = False
        if created:
            fileio.fsync_dir(self.dir)
        return frontier, ahead

    def _read_level(self) -> int:
        return _read_level_at(self.dir)

    def write_window(self, frontier: int, ahead: list[int], counts: Counts | None = None,
                     reasons: Reasons | None = None, first: Collection[int] = ()) -> set[int]:
        """Page cache only (survives a process crash, not power loss). Returns the
        offsets whose delivery counts (or held marks) did not fit in the slot (not
        written; usually none). `first`: the offsets held for the dead-letter topic,
        marked as held (the third tail) and the last whose counts are left out."""
        with self._lock:
            return self._write_window(frontier, ahead, counts or {}, reasons or {}, first)

    def _write_window(self, frontier: int, ahead: list[int], counts: Counts, reasons: Reasons,
                      first: Collection[int] = ()) -> set[int]:
        dropped: set[int] = set()
        if self._fd < 0:
            return dropped  # closed: nothing of this partition is written any more
        self._seq += 1
        # Until the whole record is in, the window holds nothing worth anchoring:
        # a failed (possibly torn) write must not be synced and made the anchor.
        self.dirty_since_sync = False
        self._window = None
        marks = _marks(frontier, ahead, first)
        self._unsynced_marks |= marks  # (before the write: a failed one may have left part of it)
        fileio.pwrite_all(self._fd, _encode(self._seq, frontier, ahead, counts, reasons, dropped, first),
                          (1 - self._anchor) * SLOT)
        self._window = (frontier, list(ahead), dict(counts), dict(reasons), marks)
        self.dirty_since_sync = True
        return dropped

    def writeout(self) -> None:
        """Sync the window; on success it becomes the anchor. (I/O thread.)"""
        with self._lock:
            self._writeout()

    def _writeout(self) -> None:
        if not self.dirty_since_sync or self._fd < 0:
            return
        fileio.fdatasync(self._fd)
        self._anchor = 1 - self._anchor
        self._anchored = self._window
        self.dirty_since_sync = False
        self._unsynced_marks = set()  # (the synced window, the newest, is what a load finds now)

    def level(self, frontier: int) -> None:
        with self._lock:
            if self._fd >= 0:
                self._level(frontier)

    def _level(self, frontier: int) -> None:
        tmp = self.dir / "consumer.offset.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            fileio.write_all(fd, _I64.pack(frontier))
            fileio.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.dir / "consumer.offset")
        fileio.fsync_dir(self.dir)
        self._level_on_disk = frontier

    def close(self, frontier: int, ahead: list[int], counts: Counts | None = None,
              reasons: Reasons | None = None, first: Collection[int] = ()) -> None:
        """Persist (frontier, ahead, delivery counts, nack reasons) durably and level
        consumer.offset; only what the files do not already say is written (an
        untouched partition closes without a sync). `first`: as for ``write_window``."""
        counts = {o: c for o, c in (counts or {}).items() if o > frontier}
        reasons = {o: r for o, r in (reasons or {}).items() if o > frontier}
        with self._lock:
            if self._fd < 0:
                return
            try:
                if self.dirty_since_sync or self._anchored != (frontier, list(ahead), counts, reasons,
                                                                _marks(frontier, ahead, first)):
                    self._write_window(frontier, ahead, counts, reasons, first)
                    self._writeout()
                if self._level_on_disk != frontier:
                    self._level(frontier)
            finally:
                os.close(self._fd)
                self._fd = -1
