"""Partition copy primitives on disk (partition moves): list, read, stage, verify, install.

Source side: ``list_open`` / ``list_closed`` give a partition's high watermark
and its segments, the active one only up to its committed boundary (the first
frame at or above the high watermark: never the hidden tail); ``read_chunk``
reads a piece of one segment file. The listing reads the high watermark
first, then the segments, so it never carries a position past what it copies.

Destination side: ``Staging`` is ``<topic dir>/p00003.staging/``. ``plan``
brings the staged files in line with a listing (drops files the source no
longer lists, cuts files longer than listed, creates empty ones) and returns
the byte ranges still to fetch; ``write`` appends a fetched chunk;
``durable`` syncs; ``verify`` opens the staged copy with the very recovery a
real open runs and requires it to end exactly at the source's high
watermark; ``install`` writes the positions (clamped below the high
watermark), the ``hwm`` file, segment ages and ``move.marker``, makes all of
it durable, then renames the staging directory over the partition directory
(an existing directory holding records is quarantined first, never deleted).

A staging directory survives restarts: ``staging.state`` records the boot
and the sizes the last ``durable`` synced; after a reboot (power loss may
have left unsynced bytes as garbage) each file is cut back to its synced
size and fetched again from there.

Freeze: ``freeze.marker`` in a source partition directory holds its move freeze
(token, until wall-clock ms), written durably before the freeze is answered and
read at the partition's open (``write_freeze`` / ``read_freeze``).

Quarantine: ``<partition dir>.quarantine-<kind>-<n>`` (kinds: stale_copy,
install_conflict, unverifiable), never deleted here; ``moved_aside`` renames
a source's directory after the flip to ``<partition dir>.moved-<token>``.

Everything is synchronous (callers run it on I/O threads). Writes and syncs
go through narad.storage.fileio (the fault-injection seam).
Imports msgspec and narad.storage.{fileio,frames,partition_log,offsets,cursor_file,dlq_target}.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path

import msgspec

from narad.storage import cursor_file as CF
from narad.storage import dlq_target as DT
from narad.storage import fileio
from narad.storage import frames as FR
from narad.storage import partition_log as PL
from narad.storage.offsets import OffsetFile

log = logging.getLogger("narad.storage.transfer")

CHUNK_MAX = 1 << 20
# No segment file grows past this: a commit that would overflow a non-empty segment rolls.
MAX_SEGMENT_BYTES = max(PL.SEGMENT_BYTES, FR.HEADER_SIZE + FR.MAX_FRAME_BYTES)
FUTURE_SLACK_MS = 3600 * 1000  # a source segment time further ahead than this is not believed
STATE_FILE = "staging.state"
MARKER_FILE = "move.marker"
CARRIED_FILE = "idem.carried"  # idempotency keys a move carried (``write_carried``)
FREEZE_FILE = "freeze.marker"  # a source's move freeze: {"token", "until_ms"} (wall clock), durable
_SEG_RE = re.compile(r"^(\d{20})\.log$")
_KIND_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# p00003.quarantine-<kind>-<n>, also of a staging or moved-aside copy (p00003.staging.quarantine-...)
_QUAR_RE = re.compile(r"^p(\d{5})(?:\.[A-Za-z0-9_-]+)*?\.quarantine-([a-z][a-z0-9_]*)-(\d+)$")


class SegInfo(msgspec.Struct, array_like=True):
    base: int  # first offset (the file's name)
    size: int  # bytes to copy (the active segment: up to its committed boundary)
    mtime_ms: int  # last write, source clock


def staging_dir(final_dir: Path) -> Path:
    final_dir = Path(final_dir)
    return final_dir.with_name(final_dir.name + ".staging")


def _seg_name(base: int) -> str:
    return f"{base:020d}.log"


def _mtime_ms(st: os.stat_result) -> int:
    return st.st_mtime_ns // 1_000_000


# ---- source side -----------------------------------------------------------------------------

def _frame_end(path: Path, pos: int) -> int:
    """Where the frame starting at `pos` of a segment file ends (its header read back)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        hdr = fileio.pread(fd, FR.HEADER_SIZE, pos)
    finally:
        os.close(fd)
    _count, _base, psize, _crc = FR.parse_header(hdr, 0)
    return pos + FR.HEADER_SIZE + psize


def list_open(plog: PL.PartitionLog) -> tuple[int, list[SegInfo]]:
    """(hwm, segments) of an open log (I/O thread). Under the log's I/O lock no
    commit runs; one whose frame is written but not yet published sits above the
    high watermark and is not listed. Raises LogClosed once the log is closed."""
    with plog._io_lock:
        if plog.closed:
            raise PL.LogClosed(0)
        hwm = plog.hwm  # first: a publish racing this listing only adds frames at or above it
        segs = list(plog.segments)
        out: list[SegInfo] = []
        for i, seg in enumerate(segs):
            if seg.base > hwm:
                break  # (never: a segment starts where the previous commit ended)
            try:
                st = seg.path.stat()
            except FileNotFoundError:
                if out:
                    raise
                continue  # retention deleted it under this listing
            mtime = _mtime_ms(st)
            if i + 1 < len(segs) and segs[i + 1].base <= hwm:
                out.append(SegInfo(seg.base, seg.size, mtime))
                continue
            # The last segment holding offsets below hwm: up to the first frame at or
            # above hwm. Published frames are appended base first, then position.
            bases, positions = seg.frame_bases, seg.frame_pos
            n = min(len(bases), len(positions))
            k = bisect.bisect_left(bases, hwm, 0, n)
            if k < n:
                size = positions[k]
            elif k > 0:
                size = _frame_end(seg.path, positions[k - 1])
            else:
                size = 0
            out.append(SegInfo(seg.base, size, mtime))
            break
        return hwm, out


def _closed_hwm(d: Path, active_base: int, tail: int, ends: set[int]) -> int:
    """The high watermark ``PartitionLog.open`` would recover (its rules, read-only)."""
    raw = PL._read_small(d / "hwm")
    if len(raw) != 8:
        return tail
    written = PL._U64.unpack(raw)[0]
    if written >= tail:
        return tail
    if written in ends or written == active_base:
        return written
    return tail  # no frame boundary: a damaged file, ignored as open ignores it


def list_closed(d: Path) -> tuple[int, list[SegInfo]]:
    """(hwm, segments) of a partition whose log is not open (read-only: nothing
    is cut, synced or created). The active segment's frames are walked and CRC
    checked as an open walks them; a torn tail is left out of the listing."""
    d = Path(d)
    files = PL._segment_files(d)
    if not files:
        return 0, []
    active_base, ast = files[-1]
    try:
        data = (d / _seg_name(active_base)).read_bytes()
    except FileNotFoundError:
        data = b""
    bases: list[int] = []
    positions: list[int] = []
    ends: set[int] = set()
    tail, good_end = PL._walk_frames(data, active_base, bases, positions, ends, str(d))
    hwm = _closed_hwm(d, active_base, tail, ends)
    k = bisect.bisect_left(bases, hwm)
    boundary = positions[k] if k < len(bases) else good_end
    out = [SegInfo(b, st.st_size, _mtime_ms(st)) for b, st in files[:-1]]
    out.append(SegInfo(active_base, boundary, _mtime_ms(ast)))
    return hwm, out


def read_chunk(d: Path, base: int, offset: int, length: int) -> bytes:
    """Up to min(length, CHUNK_MAX) bytes of segment `base` from `offset` (short at
    its end). FileNotFoundError when the segment is gone (retention)."""
    if base < 0 or offset < 0 or length < 0:
        raise ValueError("base, offset and length must be >= 0")
    length = min(length, CHUNK_MAX)
    fd = os.open(Path(d) / _seg_name(base), os.O_RDONLY)
    try:
        out = bytearray()
        while len(out) < length:
            b = fileio.pread(fd, length - len(out), offset + len(out))
            if not b:
                break
            out += b
        return bytes(out)
    finally:
        os.close(fd)


# ---- destination side ------------------------------------------------------------------------

def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _write_file_durable(d: Path, name: str, data: bytes) -> None:
    """`data` as `d/name` through a temp file, fdatasync and a rename (the caller
    syncs the directory)."""
    fileio.replace_durable(d / name, data)


def _mkdirs_durable(d: Path) -> None:
    """Create `d` and any missing parent (0700), each new entry synced into its parent."""
    missing: list[Path] = []
    p = d
    while not p.is_dir():
        missing.append(p)
        p = p.parent
    for q in reversed(missing):
        with contextlib.suppress(FileExistsError):
            q.mkdir(mode=0o700)
        fileio.fsync_dir(q.parent)


def _holds_records(d: Path) -> bool:
    return any(st.st_size > 0 for _b, st in PL._segment_files(d))


class Staging:
    """One partition's copy in progress. Constructing one does no I/O (the event
    loop may); the directory is created, or found and recovered, at the first call.
    One caller at a time (a lock orders calls anyway)."""

    def __init__(self, final_dir: Path) -> None:
        self.final = Path(final_dir)
        self.dir = staging_dir(self.final)
        self._lock = threading.Lock()
        self._listed: dict[int, int] | None = None  # the last plan's listing
        self._verified: int | None = None  # the hwm the last verify() passed at (None: changed since)
        self._dirty: set[int] = set()  # segment files written or cut since the last durable()
        self._fd_base = -1
        self._fd = -1
        self._sizes: dict[int, int] = {}
        self._synced: dict[int, int] = {}  # bytes of each file known durable
        self._ready = False  # the directory is created or recovered at the first call, not here

    def _ensure(self) -> None:
        if self._ready:
            return
        existed = self.dir.is_dir()
        if not existed:
            _mkdirs_durable(self.dir)
        self._sizes = self._scan()
        self._synced = {}
        self._dirty = set()
        if existed:
            self._recover()
        self._write_state()
        self._ready = True

    # staging.state: the boot and the sizes last made durable
    def _write_state(self) -> None:
        doc = {"boot": _boot_id(), "synced": {str(b): s for b, s in sorted(self._synced.items())}}
        _write_file_durable(self.dir, STATE_FILE, json.dumps(doc).encode())
        fileio.fsync_dir(self.dir)

    def _read_state(self) -> tuple[str, dict[int, int]] | None:
        try:
            doc = json.loads((self.dir / STATE_FILE).read_bytes())
            boot = doc["boot"]
            synced = {int(k): int(v) for k, v in doc["synced"].items()}
            if not isinstance(boot, str):
                return None
            return boot, synced
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def _recover(self) -> None:
        """After a restart every file counts as unsynced; after a reboot (or with no
        readable state) bytes past what was synced are not trusted: cut away."""
        st = self._read_state()
        if st is None and (self.dir / "hwm").exists():
            # An install that was undone (renamed back), or interrupted after its hwm
            # file: every segment was synced before that file was written.
            st = ("", dict(self._sizes))
        old = st[1] if st is not None else {}
        self._synced = {b: min(s, self._sizes[b]) for b, s in old.items() if b in self._sizes}
        self._dirty = set(self._sizes)
        if st is not None and st[0] and st[0] == _boot_id():
            return  # the page cache survived: what was written is there
        for base, size in list(self._sizes.items()):
            keep = self._synced.get(base, 0)
            if keep < size:
                self._truncate(base, keep)

    def _lower_synced(self) -> bool:
        """Synced sizes never above the files (after a cut); True when one was lowered."""
        new = {b: min(s, self._sizes[b]) for b, s in self._synced.items() if b in self._sizes}
        changed = new != self._synced
        self._synced = new
        return changed

    def _scan(self) -> dict[int, int]:
        out: dict[int, int] = {}
        with os.scandir(self.dir) as it:
            for e in it:
                m = _SEG_RE.match(e.name)
                if m:
                    out[int(m.group(1))] = e.stat().st_size
        return out

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._fd_base = -1, -1

    def _fd_for(self, base: int) -> int:
        if self._fd_base != base:
            self._close_fd()
            path = self.dir / _seg_name(base)
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            self._fd_base = base
        return self._fd

    def _truncate(self, base: int, size: int) -> None:
        fd = os.open(self.dir / _seg_name(base), os.O_WRONLY)
        try:
            fileio.ftruncate(fd, size)
        finally:
            os.close(fd)
        self._sizes[base] = size
        self._dirty.add(base)

    def staged(self) -> dict[int, int]:
        with self._lock:
            self._ensure()
            return dict(self._sizes)

    def plan(self, segs: list[SegInfo]) -> list[tuple[int, int, int]]:
        """Bring the staged files in line with a listing; the (base, offset, length)
        ranges still to fetch, in order, <= CHUNK_MAX each."""
        listed: dict[int, int] = {}
        prev = -1
        for s in segs:
            if s.base <= prev or not 0 <= s.size <= MAX_SEGMENT_BYTES:
                raise ValueError("segment listing not in ascending base order, or a size out of range")
            listed[s.base] = s.size
            prev = s.base
        with self._lock:
            self._ensure()
            self._close_fd()
            for base in sorted(self._sizes):
                if base not in listed:
                    (self.dir / _seg_name(base)).unlink()
                    del self._sizes[base]
                    self._dirty.discard(base)
                elif self._sizes[base] > listed[base]:
                    self._truncate(base, listed[base])
            out: list[tuple[int, int, int]] = []
            for base, size in listed.items():
                have = self._sizes.get(base)
                if have is None:
                    fd = os.open(self.dir / _seg_name(base), os.O_WRONLY | os.O_CREAT, 0o600)
                    os.close(fd)
                    self._sizes[base] = have = 0
                    self._dirty.add(base)
                pos = have
                while pos < size:
                    n = min(CHUNK_MAX, size - pos)
                    out.append((base, pos, n))
                    pos += n
            if self._lower_synced():
                self._write_state()  # before any byte lands past a cut
            if listed != self._listed or out:
                self._verified = None
            self._listed = listed
            return out

    def write(self, base: int, offset: int, data: bytes) -> None:
        """Append a fetched chunk (pwrite at `offset`, which must be the staged size)."""
        with self._lock:
            self._ensure()
            have = self._sizes.get(base, 0)
            if offset != have:
                raise ValueError(f"chunk of segment {base} at {offset}, staged size is {have}")
            if self._listed is None:
                raise ValueError("no listing planned yet: call plan() first")
            lim = self._listed.get(base)
            if lim is None or offset + len(data) > lim:
                raise ValueError(f"chunk of segment {base} runs past the listing")
            if not data:
                return
            self._verified = None
            fd = self._fd_for(base)
            try:
                fileio.pwrite_all(fd, data, offset)
            except OSError:
                # A partial write leaves an unknown size: find it again.
                self._close_fd()
                self._sizes[base] = (self.dir / _seg_name(base)).stat().st_size
                self._dirty.add(base)
                raise
            self._sizes[base] = offset + len(data)
            self._dirty.add(base)

    def durable(self) -> None:
        """fdatasync every segment file written since the last call, then the directory."""
        with self._lock:
            self._ensure()
            self._durable()

    def _durable(self) -> None:
        self._close_fd()
        for base in sorted(self._dirty):
            fd = os.open(self.dir / _seg_name(base), os.O_RDWR)
            try:
                fileio.fdatasync(fd)
            except OSError:
                # A failed sync proves nothing about what it covered, nor will a later one
                # (the pages may be gone): what was not synced before is fetched again.
                keep = self._synced.get(base, 0)
                self._verified = None
                with contextlib.suppress(OSError):
                    fileio.ftruncate(fd, keep)
                    self._sizes[base] = keep
                raise
            finally:
                os.close(fd)
            self._dirty.discard(base)
        fileio.fsync_dir(self.dir)
        self._synced = dict(self._sizes)
        self._write_state()

    def verify(self, hwm: int) -> str | None:
        """None when the staged copy, made durable and then opened as a real open
        opens a log, ends exactly at `hwm` (no hidden tail) and holds exactly the
        last listing; else what is wrong. OSError: the copy could not be synced (a
        file whose sync failed is cut back to what was synced before)."""
        with self._lock:
            self._ensure()
            self._verified = None
            if self._listed is not None and self._listed != self._sizes:
                return "staged segments differ from the listing"
            if self._dirty:
                self._durable()
            end, why = self._recovered_end()
            if why is not None:
                return why
            if end != hwm:
                return f"staged copy recovers to {end}, source hwm is {hwm}"
            self._verified = hwm
            return None

    def recovers_to(self) -> int | None:
        """Where the staged copy ends when opened as a real open opens it (a force
        promotion checks it against the source's last known hwm); None: it cannot
        be opened, or it would open with a hidden tail."""
        with self._lock:
            self._ensure()
            end, why = self._recovered_end()
            return None if why is not None else end

    def _recovered_end(self) -> tuple[int, str | None]:
        self._close_fd()
        if not self._sizes:
            return 0, None  # an open would create an empty segment 0
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "hwm").unlink()  # left by an interrupted install: open must use the tail
        plog = PL.PartitionLog(self.dir)
        before = dict(self._sizes)
        try:
            plog.open()
        except (OSError, ValueError) as e:
            return 0, f"staged copy cannot be opened: {e}"
        try:
            if plog.hwm != plog.next_offset:
                return plog.hwm, f"staged copy opens with a hidden tail ({plog.hwm} < {plog.next_offset})"
            return plog.hwm, None
        finally:
            plog.close(clean=False)
            # open cuts a torn tail (and syncs the cut): those bytes are fetched again
            self._sizes = self._scan()
            if self._sizes != before:
                self._verified = None
            self._dirty.update(b for b, n in self._sizes.items() if before.get(b) != n)
            if self._lower_synced():
                self._write_state()

    def install(self, *, hwm: int, frontier: int, ahead: list[int], cursors: dict[str, tuple[str, int]],
                marker: dict[str, object], seg_mtimes: dict[int, int],
                counts: dict[int, int] | None = None, reasons: dict[int, str] | None = None,
                dead: list[int] | None = None, dlq: tuple[str, str, list[int]] | None = None,
                carried: bytes | None = None) -> Path | None:
        """Write positions (clamped below `hwm`), the hwm file, segment ages and
        move.marker, make everything durable, then rename the staging directory to
        the partition directory. Returns where an existing directory holding records
        was quarantined (None: there was none, or it held no record and was removed).
        `counts`, `reasons`: the source's delivery counts and last nack reasons
        (issue 14), kept for unacked offsets between the frontier and `hwm`; `dead`:
        the offsets the source held for the dead-letter topic (or found marked held),
        marked held here too (held again whatever ``max_deliveries`` is here: their
        dead-letter copy may exist), their counts written first when the offset slot
        has no room for all (a held record whose count were dropped would be
        delivered again here); `dlq`: the source's ``dead_letter.target`` (the
        dead-letter topic's name and id, the offsets sent there), written here too, so
        a lift here does not release a record whose copy may be there; `carried`: the
        idempotency keys homed at this partition that the source node committed in other
        partitions (``encode_carried``), written as ``idem.carried``."""
        # Everything that can be refused is refused before anything is written.
        if self._verified is None or self._verified != hwm:
            raise ValueError(f"the staged copy was not verified at hwm {hwm} (call verify(hwm) first)")
        clamped: dict[str, tuple[str, int]] = {}
        for child, (epoch, nxt) in cursors.items():
            if not child or "/" in child or "\0" in child or child.startswith("."):
                raise ValueError(f"bad fan-out child name {child!r}")
            clamped[child] = (epoch, max(0, min(nxt, hwm)))
            CF.encode(*clamped[child])  # ValueError: an epoch too long for the file
        json.dumps(marker)  # TypeError: not JSON
        frontier = max(-1, min(frontier, hwm - 1))
        held = sorted({a for a in ahead if frontier < a < hwm})
        kept = {o: c for o, c in (counts or {}).items() if frontier < o < hwm and c > 0 and o not in held}
        why = {o: r for o, r in (reasons or {}).items() if frontier < o < hwm and r and o not in held}
        with self._lock:
            self._ensure()
            d = self.dir
            # Leftovers of an interrupted install: every one is written again below.
            for e in list(os.scandir(d)):
                n = e.name
                if n in ("hwm", "consumer.ahead", "consumer.offset", MARKER_FILE, DT.FILE, CARRIED_FILE) or \
                        n.endswith(".tmp") or (
                        n.startswith("fanout-") and n.endswith(".offset")):
                    os.unlink(e.path)
            self._durable()
            now_ms = int(time.time() * 1000)
            for base, ms in seg_mtimes.items():
                if base in self._sizes and 0 < ms <= now_ms + FUTURE_SLACK_MS:
                    p = d / _seg_name(base)
                    os.utime(p, ns=(p.stat().st_atime_ns, ms * 1_000_000))
            off = OffsetFile(d)
            off.load(max_frontier=hwm - 1)
            off.close(frontier, held, kept, why, first=frozenset(dead or ()))
            for child, (epoch, nxt) in sorted(clamped.items()):
                CF.CursorFile(d, child).anchor(epoch, nxt)
            _write_file_durable(d, "hwm", PL._U64.pack(hwm))
            if dlq is not None:
                DT.write(d, *dlq)
            if carried is not None:
                _write_file_durable(d, CARRIED_FILE, carried)
            fileio.fsync_dir(d)
            doc = dict(marker)
            doc["hwm"] = hwm
            doc.setdefault("durable_at_ms", int(time.time() * 1000))
            _write_file_durable(d, MARKER_FILE, json.dumps(doc, sort_keys=True).encode())
            fileio.fsync_dir(d)
            aside: Path | None = None
            if self.final.exists():
                if _holds_records(self.final):
                    aside = quarantine(self.final, "install_conflict")
                else:
                    shutil.rmtree(self.final)
                    fileio.fsync_dir(self.final.parent)
            os.rename(d, self.final)
            fileio.fsync_dir(self.final.parent)
            with contextlib.suppress(FileNotFoundError):
                (self.final / STATE_FILE).unlink()
                fileio.fsync_dir(self.final)
            self._sizes, self._dirty, self._listed, self._verified = {}, set(), None, None
            self._ready = False
            return aside

    def discard(self) -> None:
        """Remove the staging directory and everything in it."""
        with self._lock:
            self._close_fd()
            if self.dir.exists():
                shutil.rmtree(self.dir)
                fileio.fsync_dir(self.dir.parent)
            self._sizes, self._dirty, self._listed, self._verified = {}, set(), None, None
            self._ready = False


# ---- quarantine and the source's directory after a flip -----------------------------------------

def quarantine(d: Path, kind: str) -> Path:
    """Rename `d` to ``<d>.quarantine-<kind>-<n>`` (the first n free) and sync the parent.
    Its modification time becomes the moment it was set aside."""
    if not _KIND_RE.match(kind):
        raise ValueError(f"bad quarantine kind {kind!r}")
    d = Path(d)
    n = 1
    while True:
        target = d.with_name(f"{d.name}.quarantine-{kind}-{n}")
        if not target.exists() and not target.is_symlink():
            break
        n += 1
    os.rename(d, target)
    with contextlib.suppress(OSError):
        os.utime(target)
    fileio.fsync_dir(d.parent)
    return target


def _tree_bytes(d: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(d):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def quarantined(topics_root: Path) -> list[tuple[str, str, int, Path, int, int]]:
    """Every quarantined partition copy under ``<data>/topics``:
    (kind, topic, partition, dir, bytes, mtime_ms), by topic, partition, name."""
    out: list[tuple[str, str, int, Path, int, int]] = []
    root = Path(topics_root)
    try:
        tops = sorted((e for e in os.scandir(root) if e.is_dir(follow_symlinks=False)), key=lambda e: e.name)
    except FileNotFoundError:
        return out
    for t in tops:
        topic = t.name.rsplit("@", 1)[0]
        try:
            entries = sorted((e.name, e.path) for e in os.scandir(t.path) if e.is_dir(follow_symlinks=False))
        except OSError:
            continue
        for name, path in entries:
            m = _QUAR_RE.match(name)
            if not m:
                continue
            try:
                mtime = _mtime_ms(os.stat(path))
            except OSError:
                continue
            out.append((m.group(2), topic, int(m.group(1)), Path(path), _tree_bytes(Path(path)), mtime))
    out.sort(key=lambda r: (r[1], r[2], r[3].name))
    return out


def encode_carried(window_ms: int, keys: list[tuple[int, int, int]]) -> bytes:
    """``idem.carried``'s bytes: the topic's window and each key's (fingerprint, CRC-32C,
    committed-at ms), MessagePack."""
    return msgspec.msgpack.encode([window_ms, keys])


def read_carried(d: Path) -> tuple[int, list[tuple[int, int, int]]] | None:
    """``idem.carried`` of `d` (None: none, or unreadable: logged)."""
    try:
        raw = (Path(d) / CARRIED_FILE).read_bytes()
    except FileNotFoundError:
        return None
    try:
        window_ms, keys = msgspec.msgpack.decode(raw, type=tuple[int, list[tuple[int, int, int]]])
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        log.error("idem.carried does not decode; its keys are not loaded", extra={"dir": str(d), "err": str(e)})
        return None
    return window_ms, keys


def remove_carried(d: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (Path(d) / CARRIED_FILE).unlink()


def read_marker(d: Path) -> dict[str, object] | None:
    """The move.marker of a partition directory; None when absent or unreadable."""
    try:
        doc = json.loads((Path(d) / MARKER_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def write_freeze(d: Path, token: str, until_ms: int) -> None:
    """Make a source partition's move freeze durable in `d` (before it is answered): a
    restart within its TTL keeps the partition frozen, so nothing lands behind a copy
    whose flip may still commit (``read_freeze`` at open)."""
    fileio.replace_durable(Path(d) / FREEZE_FILE, json.dumps({"token": token, "until_ms": until_ms}).encode())
    fileio.fsync_dir(os.fspath(d))


def read_freeze(d: Path) -> tuple[str, int] | None:
    """The freeze ``write_freeze`` left in `d`: (token, until wall-clock ms), or None."""
    try:
        doc = json.loads((Path(d) / FREEZE_FILE).read_bytes())
        token, until = doc["token"], doc["until_ms"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(token, str) or not isinstance(until, int) or not _TOKEN_RE.match(token):
        return None
    return token, until


def clear_freeze(d: Path) -> None:
    """The freeze was lifted: its marker goes (a leftover only delays commits until its TTL)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(Path(d) / FREEZE_FILE)
        fileio.fsync_dir(os.fspath(d))


def moved_aside(d: Path, token: str) -> Path:
    """The source after the flip: rename `d` to ``<d>.moved-<token>`` and sync the
    parent (idempotent: already there, the same path is returned)."""
    if not _TOKEN_RE.match(token):
        raise ValueError(f"bad move token {token!r}")
    d = Path(d)
    target = d.with_name(f"{d.name}.moved-{token}")
    if not d.exists() and target.exists():
        return target
    if target.exists():
        raise FileExistsError(f"{target} exists")
    os.rename(d, target)
    fileio.fsync_dir(d.parent)
    return target
