"""A durable Raft log for pysyncobj (its own FileJournal never fsyncs).

Same duck-typed interface as ``pysyncobj.journal.Journal`` (add, clear,
deleteEntriesFrom/To, indexing, term/vote/commit-index storage), so the seam
in narad.meta.raft can hand it to SyncObj. Entries are appended with plain
writes and made durable by ``sync()`` (one fdatasync for everything appended
since the last one): the seam calls it before a follower acknowledges
AppendEntries and before the leader counts its own copy toward a commit.
Term and vote are written durably (write, fsync, rename, fsync dir) before
they are returned to Raft, as Raft requires.

File ``log``: 8-byte magic, then frames ``u32 len | u32 crc32 | u64 idx |
u64 term | command``. A torn tail (crash mid-append) is cut at open. File
``meta``: msgpack {term, voted_for, commit_index}.

Imports no narad module; only narad.meta.raft uses it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger("narad.meta.journal")

MAGIC = b"NRDLOG01"
_HDR = struct.Struct(">IIQQ")  # len(idx+term+cmd), crc32(idx+term+cmd), idx, term
_meta_enc = msgspec.msgpack.Encoder()
_meta_dec = msgspec.msgpack.Decoder(dict[str, Any])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _write_log(directory: Path, entries: list[tuple[bytes, int, int]]) -> list[int]:
    """Write ``entries`` as the whole log (temp file, fsync, rename, fsync dir);
    returns each frame's offset."""
    tmp = directory / "log.compact"
    offsets = []
    buf = bytearray(MAGIC)
    for command, idx, term in entries:
        body = struct.pack(">QQ", idx, term) + command
        offsets.append(len(buf))
        buf += struct.pack(">II", len(body), zlib.crc32(body)) + body
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(bytes(buf))
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, directory / "log")
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
    return offsets


class LogDamaged(RuntimeError):
    """The Raft log is damaged below the commit index this node persisted: entries it
    synced (and acknowledged) are unreadable. Never cut: the node refuses to start."""


def _frames(data: bytes) -> tuple[list[tuple[bytes, int, int]], list[int], int]:
    """(entries, their frame offsets, where reading stopped) of a log file's bytes.
    Reading stops at the first frame that is short, fails its checksum or does not
    continue the indexes (each entry's index is the previous one + 1)."""
    out: list[tuple[bytes, int, int]] = []
    offsets: list[int] = []
    pos, n = len(MAGIC), len(data)
    while pos + _HDR.size <= n:
        length, crc, idx, term = _HDR.unpack_from(data, pos)
        end = pos + 8 + length
        if length < 16 or end > n or zlib.crc32(data[pos + 8 : end]) != crc or (out and idx != out[-1][1] + 1):
            break
        out.append((bytes(data[pos + 24 : end]), idx, term))
        offsets.append(pos)
        pos = end
    return out, offsets, pos


def _persisted_commit(directory: Path) -> int:
    """The commit index in ``meta`` (0 when unreadable: nothing is known to be committed)."""
    try:
        return int(_meta_dec.decode((directory / "meta").read_bytes()).get("commit_index", 0))
    except (OSError, msgspec.DecodeError, ValueError, TypeError):
        return 0


def check_tail(path: Path, entries: list[tuple[bytes, int, int]], stop: int, size: int, commit: int) -> None:
    """Raise LogDamaged when reading stopped before the end of the file at an entry the
    node had persisted as committed: that is damage (a bit flip, a lost sector), not a
    torn tail of unsynced appends, and cutting there would drop committed entries."""
    if stop >= size:
        return
    # No readable entry at all while a commit index was persisted: the log always
    # keeps entries up to it (a compaction keeps the snapshot's entries), so the
    # first frame itself is damaged.
    nxt = entries[-1][1] + 1 if entries else None
    if commit > 0 and (nxt is None or nxt <= commit):
        what = f"entry {nxt}" if nxt is not None else "its first entry"
        raise LogDamaged(
            f"the raft log {path} is damaged at byte {stop}: {what} (at or below the commit index {commit} "
            f"this node persisted) fails its checksum. Refusing to start rather than cut committed entries; "
            "restore the raft directory from a backup, or move <data-dir>/metastore aside to rejoin the "
            "cluster as a new replica (the files were left untouched)")


def _read_entries(path: Path) -> list[tuple[bytes, int, int]]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    if not data.startswith(MAGIC):
        return []
    return _frames(data)[0]


def finish_compaction(directory: Path, before: tuple[bytes, int, int]) -> int:
    """A crash (or a full disk) between pysyncobj renaming a new snapshot into
    place and compacting the log leaves entries before the snapshot's ``before``
    entry in the log. pysyncobj then clears the whole journal down to the two
    snapshot entries at start, dropping every entry after them. Cut the log to
    start at ``before`` first. Returns how many entries were cut."""
    entries = _read_entries(directory / "log")
    for pos, entry in enumerate(entries):
        if entry[1] == before[1]:
            if pos == 0 or entry[2] != before[2] or entry[0] != bytes(before[0]):
                return 0
            _write_log(directory, entries[pos:])
            log.warning("raft log: finished a compaction interrupted after the snapshot was written",
                        extra={"cut_entries": pos, "first_index": before[1]})
            return pos
    return 0


def scan_log(path: Path) -> tuple[int, int]:
    """The first and last index of a log file, read without writing (a torn
    tail is ignored, as the journal would cut it). (0, 0): no entries. Raises
    LogDamaged when the damage lies at or below the persisted commit index."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0, 0
    if not data.startswith(MAGIC):
        return 0, 0
    entries, _offsets, stop = _frames(data)
    check_tail(path, entries, stop, len(data), _persisted_commit(path.parent))
    return (entries[0][1], entries[-1][1]) if entries else (0, 0)


class DurableJournal:
    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.dir / "log"
        self.meta_path = self.dir / "meta"
        self._entries: list[tuple[bytes, int, int]] = []
        self._offsets: list[int] = []  # file offset of each entry's frame
        self._dirty = False
        self.appended = False  # set on add(); the seam clears it
        self._meta: dict[str, Any] = {}
        if self.meta_path.exists():
            try:
                self._meta = _meta_dec.decode(self.meta_path.read_bytes())
            except msgspec.DecodeError:
                log.error("raft meta file %s is unreadable; starting from term 0", self.meta_path)
        self._meta_saved_commit = self._meta.get("commit_index", 1)
        self._fd = self._open_and_recover()

    # ---- file handling ------------------------------------------------------
    def _open_and_recover(self) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        data = b""
        size = os.fstat(fd).st_size
        if size:
            data = os.pread(fd, size, 0)
        if not data.startswith(MAGIC):
            if data:
                raise RuntimeError(f"{self.path} is not a narad raft log (bad magic); refusing to touch it")
            os.write(fd, MAGIC)
            os.fsync(fd)
            _fsync_dir(self.dir)
            return fd
        n = len(data)
        self._entries, self._offsets, pos = _frames(data)
        try:
            check_tail(self.path, self._entries, pos, n, int(self._meta.get("commit_index", 0)))
        except LogDamaged:
            os.close(fd)
            raise
        if pos != n:
            log.warning("raft log: cut a torn tail", extra={"path": str(self.path), "bytes": n - pos})
            os.ftruncate(fd, pos)
            os.fsync(fd)
        os.lseek(fd, 0, os.SEEK_END)
        return fd

    def _end(self) -> int:
        return os.lseek(self._fd, 0, os.SEEK_END)

    # ---- pysyncobj Journal interface ---------------------------------------
    def add(self, command: bytes, idx: int, term: int) -> None:
        command = bytes(command)
        body = struct.pack(">QQ", idx, term) + command
        frame = struct.pack(">II", len(body), zlib.crc32(body)) + body
        off = self._end()
        os.write(self._fd, frame)
        self._entries.append((command, idx, term))
        self._offsets.append(off)
        self._dirty = True
        self.appended = True

    def sync(self) -> None:
        if self._dirty:
            os.fdatasync(self._fd)
            self._dirty = False

    @property
    def dirty(self) -> bool:
        return self._dirty

    def clear(self) -> None:
        os.ftruncate(self._fd, len(MAGIC))
        os.fsync(self._fd)
        self._entries.clear()
        self._offsets.clear()
        self._dirty = False

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        if entryFrom >= len(self._entries):
            return
        os.ftruncate(self._fd, self._offsets[entryFrom])
        os.fsync(self._fd)
        del self._entries[entryFrom:]
        del self._offsets[entryFrom:]

    def deleteEntriesTo(self, entryTo: int) -> None:
        """Compaction after a snapshot: keep entries from position ``entryTo``.
        If the new file cannot be written (no disk), the log stays whole, in
        memory and on disk; the next start or compaction finishes the job."""
        keep = self._entries[entryTo:]
        try:
            offsets = _write_log(self.dir, keep)
        except OSError as e:
            log.error("raft log: compaction after a snapshot failed; the log stays uncompacted",
                      extra={"err": str(e)})
            return
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR)
        os.lseek(self._fd, 0, os.SEEK_END)
        self._entries = list(keep)
        self._offsets = offsets
        self._dirty = False

    def __getitem__(self, item: Any) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def _destroy(self) -> None:
        self.sync()
        self._store_meta()
        os.close(self._fd)

    def flush(self) -> None:
        self.sync()

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:
        self._meta["commit_index"] = raftCommitIndex

    def getRaftCommitIndex(self) -> int:
        return int(self._meta.get("commit_index", 1))

    def setCurrentTerm(self, term: int, votedForNodeId: Any) -> None:
        self._meta["term"] = term
        self._meta["voted_for"] = None if votedForNodeId is None else str(votedForNodeId)
        self._store_meta()

    def getCurrentTerm(self) -> int:
        return int(self._meta.get("term", 0))

    def getVotedForNodeId(self) -> Any:
        return self._meta.get("voted_for")

    def onOneSecondTimer(self) -> None:
        if self._meta.get("commit_index", 1) != self._meta_saved_commit:
            self._store_meta()

    def _store_meta(self) -> None:
        write_durably(self.meta_path, _meta_enc.encode(self._meta))
        self._meta_saved_commit = self._meta.get("commit_index", 1)

    # ---- helpers for the seam ------------------------------------------------
    def persisted_commit_index(self) -> int:
        return int(self._meta_saved_commit)

    def last_index(self) -> int:
        return self._entries[-1][1] if self._entries else 0

    def first_index(self) -> int:
        return self._entries[0][1] if self._entries else 0
