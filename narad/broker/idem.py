"""Idempotent produce (issue 14): what a partition's log says about idempotency keys.

A record produced with an ``idempotency_key`` carries it in its extension block
(``frames.Ext.i``). The key is checked where the record is committed
(``Partition._commit_cycle``), against the node's claims table
(``narad.broker.idem_claims``, shared memory every worker maps): a key committed on
this node within the topic's window (``TopicRecord.idem_window_ms``, default 5 min)
makes the record a duplicate, which is not written; the commit answers which records
of the batch were duplicates. Checking at the commit makes the verdict hold on any
node the produce landed on, across retries after a timeout, and across the WAL
replay after a crash (a keyed record committed once already is dropped then).

The table is in memory only: at open a partition's keys committed within the window
are loaded into it from the log (``rebuild``, on the I/O thread), newest segment
whose first record is older than the window onwards, so a restart (clean or kill -9)
and a partition move (the copy is the log) keep them. A key is only ever committed in
one partition (its message key's, its own hash's or the one given), which its owner
opens (and so loads) before it commits there. The cost is one read of the data
committed within the window (measured by loadtest/bench_idempotency.py), paid only by
partitions that may hold a keyed record (``needs_rebuild``): the first commit of a
keyed record in a partition makes ``idem.marker`` durable first (``mark``), and a
moved-in copy (``move.marker``: its history is not known here) is scanned too. A
partition that never had a keyed record opens as before.

Imports narad.storage and narad.broker.idem_claims.
"""

from __future__ import annotations

import os
from pathlib import Path

from narad.broker.idem_claims import ClaimTable, by_key
from narad.storage import fileio
from narad.storage import frames as FR
from narad.storage import transfer as TR
from narad.storage.partition_log import LogClosed, OffsetGone, PartitionLog, first_record_ms

MAX_KEY_BYTES = 128
REBUILD_RECORDS = 4096
REBUILD_BYTES = 8 << 20
MARKER = "idem.marker"  # in a partition directory: a keyed record may have been committed here


def needs_rebuild(d: Path) -> bool:
    """Whether the partition in `d` may hold records with an idempotency key (or keys a
    move carried)."""
    return (d / MARKER).exists() or (d / TR.MARKER_FILE).exists() or (d / TR.CARRIED_FILE).exists()


def load_carried(d: Path, claims: ClaimTable, topic: int, index: int, now_ms: int) -> int:
    """The keys a move carried into `d` (``idem.carried``: committed on the source node in
    other partitions, homed at this one) into the node's claims table; the file is
    removed once none of them is within its window. Returns the keys loaded."""
    got = TR.read_carried(d)
    if got is None:
        return 0
    window_ms, keys = got
    live = [k for k in keys if k[2] + window_ms > now_ms]
    if not live:
        TR.remove_carried(d)
        return 0
    claims.load_raw(topic, index, live, window_ms, now_ms)
    return len(live)


def mark(d: Path) -> None:
    """Make ``idem.marker`` durable in `d` (I/O thread; before the first keyed commit)."""
    if not (d / MARKER).exists():
        fileio.replace_durable(d / MARKER, b"")
        fileio.fsync_dir(os.fspath(d))


def key_of(flags: int, payload: bytes) -> str | None:
    """The record's idempotency key (None: none, or an unreadable block)."""
    if not flags & FR.F_EXT:
        return None
    ks, ke = FR.idem_span(payload)
    if ks >= 0:  # a key alone, read in place (the common block)
        try:
            return payload[ks:ke].decode()
        except UnicodeDecodeError:
            return None  # (the decoder refuses it too: not a key)
    if not FR.has_idem(payload):
        return None  # (a block whose first key is not "i": headers alone, the common case, or malformed)
    try:
        return FR.read_ext(payload).i
    except FR.FrameError:
        return None


def rebuild(plog: PartitionLog, window_ms: int, now_ms: int, claims: ClaimTable, topic: int,
            index: int, partitions: int = 0) -> tuple[int, int]:
    """The keys of the log's records committed within the window before `now_ms`, into
    the node's claims table, each until its commit plus the window (I/O thread, at open).
    Each key's home: this partition for a record with a message key, else the partition
    its key hashes to over `partitions`. Returns the keys loaded and the records read.
    The keys a move carried here (``load_carried``) are loaded too."""
    bk = by_key(partitions)
    carried = load_carried(plog.dir, claims, topic, index, now_ms)
    cutoff = now_ms - window_ms
    start = plog.oldest
    for seg in reversed(plog.segments):
        if seg.size == 0:
            continue
        if seg.first_ms is None:
            seg.first_ms = first_record_ms(seg.path)
        if seg.first_ms is not None and 0 <= seg.first_ms < cutoff:
            start = seg.base  # this segment begins before the window: nothing older counts
            break
    off = max(start, plog.oldest)
    hwm = plog.hwm
    read = loaded = 0
    while off < hwm:
        try:
            got = plog.read_batch(off, REBUILD_RECORDS, REBUILD_BYTES)
        except OffsetGone as e:
            off = e.oldest
            continue
        except LogClosed:
            break
        if got.next_offset <= off:
            break
        keys: list[str] = []
        stamps: list[int] = []
        homes: list[int] = []
        for mkey, ts, flags, payload in got.records:
            if ts >= cutoff and flags & FR.F_EXT:
                k = key_of(flags, payload)
                if k is not None:
                    keys.append(k)
                    stamps.append(ts)
                    homes.append(bk if mkey is None else index)
        if keys:
            claims.load(topic, claims.prepare(keys), homes, stamps, window_ms, now_ms)
            loaded += len(keys)
        read += len(got.records)
        off = got.next_offset
    return loaded + carried, read
