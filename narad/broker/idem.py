"""Idempotent produce (issue 14): a partition owner's table of recent idempotency keys.

A record produced with an ``idempotency_key`` carries it in its extension block
(``frames.Ext.i``). The partition's owner checks it where the record is
committed (``Partition._commit_cycle``): a key seen in this partition within
the topic's window (``TopicRecord.idem_window_ms``, default 5 min) makes the
record a duplicate, which is not written; the commit answers which records of
the batch were duplicates. Checking at the commit makes the verdict hold on any
node the produce landed on, across retries after a timeout, and across the WAL
replay after a crash (a keyed record committed once already is dropped then).

The table is the set of keys held and their commit order with each one's
committed-at (``IdemTable``; committed-at never decreases along a partition), so
keys whose window passed are dropped from its front, and when it holds ``cap`` keys the oldest is
dropped (counted: ``evicted``) before a new one goes in; a worker's open
partitions hold at most ``WORKER_KEYS`` in all (checked by the broker's 5 s
poller: over it, each table is cut to its share, oldest first, so the bound can
be passed by 5 s of keyed commits). Memory per key: see
``bytes_per_key`` (measured by tests/test_idempotency.py: 175 bytes for a
36-byte key on CPython 3.11, about 16.7 MiB for a full table of 100k keys).

At open the table is rebuilt from the records the log holds that were committed
within the window (``rebuild``, on the I/O thread), newest segment whose first
record is older than the window onwards, so a restart (clean or kill -9) and a
partition move (the copy is the log) keep it. Its cost is one read of the data
committed within the window (measured by loadtest/bench_idempotency.py), paid
only by partitions that may hold a keyed record (``needs_rebuild``): the first
commit of a keyed record in a partition makes ``idem.marker`` durable first
(``mark``), and a moved-in copy (``move.marker``: its history is not known
here) is scanned too. A partition that never had a keyed record opens as before.

The node's claims table (``narad.broker.idem_claims``) is filled alongside, from the
rebuilt table at open (``load_claims``) and from each keyed commit (``record_claims``),
so that it holds what the partitions hold; it does not decide anything yet.

Imports narad.storage and narad.broker.idem_claims.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from pathlib import Path

from narad.broker.idem_claims import BadKeys, ClaimTable
from narad.storage import fileio
from narad.storage import frames as FR
from narad.storage import transfer as TR
from narad.storage.partition_log import LogClosed, OffsetGone, PartitionLog, first_record_ms

DEFAULT_CAP = 100_000  # keys per partition
WORKER_KEYS = 1_000_000  # keys per worker, over its open partitions (``trim_to_budget``, every 5 s)
MAX_KEY_BYTES = 128
REBUILD_RECORDS = 4096
REBUILD_BYTES = 8 << 20
MARKER = "idem.marker"  # in a partition directory: a keyed record may have been committed here


def needs_rebuild(d: Path) -> bool:
    """Whether the partition in `d` may hold records with an idempotency key."""
    return (d / MARKER).exists() or (d / TR.MARKER_FILE).exists()


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


class IdemTable:
    """The keys held (a set), at most ``cap``, and their commit order, oldest first.

    The commit order is two deques (the keys, sharing the set's objects, and their
    committed-at), so dropping the oldest key is O(1). Every committed key in ``keys``
    has one place in the deques, its newest; a key committed again while held (``add``:
    moved to the back) leaves a stale place behind, counted in ``_again`` and skipped when
    it comes off the front (``_pop``). A set, not a dict of committed-at: the check of a
    commit's keys is one set lookup and one insert each, in C (``isdisjoint``, ``update``;
    measured: 1.0k instructions a key against 1.7k for the dict's three passes).

    A commit claims each new key in ``keys`` at its check (``add`` to the set: the repeat
    test is whether the set grew), then ``committed`` puts the frame's claims in the commit
    order, or ``unclaim`` takes them back when the frame failed. Between the two a claimed
    key is in ``keys`` but not in the deques: the window and the cap never drop it
    (``_drop_oldest`` reads the deques)."""

    __slots__ = ("_again", "_ok", "_ot", "cap", "evicted", "keys")

    def __init__(self, cap: int = DEFAULT_CAP) -> None:
        self.keys: set[str] = set()
        self._ok: deque[str] = deque()  # the keys in commit order (stale places included)
        self._ot: deque[int] = deque()  # their committed-at, in step with ``_ok``
        self._again: dict[str, int] = {}  # key -> its stale places in ``_ok`` (committed again while held)
        self.cap = cap
        self.evicted = 0  # keys dropped by the cap before their window passed

    def __len__(self) -> int:
        return len(self.keys)

    def _pop(self) -> bool:
        """Take the oldest place off the commit order: True when its key was dropped
        (that place was its newest), False when it was a stale place."""
        k = self._ok.popleft()
        self._ot.popleft()
        again = self._again
        if again:
            n = again.get(k)
            if n is not None:
                if n == 1:
                    del again[k]
                else:
                    again[k] = n - 1
                return False
        self.keys.discard(k)
        return True

    def expire(self, cutoff_ms: int) -> None:
        """Drop the keys committed before `cutoff_ms` (from the front)."""
        ot = self._ot
        if self._again:
            while ot and ot[0] < cutoff_ms:
                self._pop()
            return
        keys, ok = self.keys, self._ok  # (no stale place: each place is its key's, dropped with it)
        while ot and ot[0] < cutoff_ms:
            ot.popleft()
            keys.discard(ok.popleft())

    def _drop_oldest(self) -> bool:
        """Drop the oldest committed key; False when there is none (claims are not dropped)."""
        while self._ok:
            if self._pop():
                return True
        return False

    def seen(self, key: str) -> bool:
        return key in self.keys

    def add(self, key: str, ts_ms: int) -> None:
        """One key committed at `ts_ms` (the rebuild's, in commit order): held once, at
        the back; a key held already moves there (its earlier place goes stale)."""
        keys = self.keys
        if key in keys:
            self._again[key] = self._again.get(key, 0) + 1
        else:
            if len(keys) >= self.cap and self._drop_oldest():
                self.evicted += 1
            keys.add(key)
        self._ok.append(key)
        self._ot.append(ts_ms)

    def committed(self, claimed: list[str], ts_ms: int) -> None:
        """The commit of a frame whose new keys were claimed in ``keys`` at the check is
        durable: they join the commit order, and the cap drops the oldest keys, counted,
        as ``add`` would one by one."""
        self._ok.extend(claimed)
        self._ot.extend([ts_ms] * len(claimed))
        over = len(self.keys) - self.cap
        while over > 0 and self._drop_oldest():
            over -= 1
            self.evicted += 1

    def unclaim(self, claimed: list[str]) -> None:
        """The commit of a frame whose new keys were claimed failed: they are taken back
        (nothing of the frame is visible, so its keys were never committed here)."""
        self.keys.difference_update(claimed)

    def trim(self, n: int) -> int:
        """Drop the oldest keys until at most `n` remain (counted as evicted); how many."""
        k = 0
        for _ in range(max(0, len(self.keys) - max(0, n))):
            if not self._drop_oldest():
                break  # (the rest are a commit's claims, in flight)
            k += 1
        self.evicted += k
        return k

    def order(self) -> list[str]:
        """The committed keys held, oldest first, each at its newest place (claims in
        flight are not in it): what the window and the cap drop first."""
        again = dict(self._again)
        out: list[str] = []
        for k in self._ok:
            n = again.get(k)
            if n:
                again[k] = n - 1
                continue
            out.append(k)
        return out

    def bytes_per_key(self) -> float:
        """Measured: the set's and the deques' size plus each key's string object and
        each distinct committed-at int, per key (0 when empty)."""
        n = len(self.keys)
        if not n:
            return 0.0
        stamps = {id(v): sys.getsizeof(v) for v in self._ot}  # (a commit's keys share one int)
        total = (sys.getsizeof(self.keys) + sys.getsizeof(self._ok) + sys.getsizeof(self._ot)
                 + sys.getsizeof(self._again) + sum(sys.getsizeof(k) for k in self.keys) + sum(stamps.values()))
        return total / n


def trim_to_budget(tables: list[IdemTable], budget: int = WORKER_KEYS) -> int:
    """Over `budget` keys in all: each table keeps its share (its size times
    budget / total), oldest dropped first. Returns the keys dropped."""
    total = sum(len(t) for t in tables)
    if total <= budget:
        return 0
    return sum(t.trim(len(t) * budget // total) for t in tables)


def rebuild(plog: PartitionLog, window_ms: int, now_ms: int, cap: int = DEFAULT_CAP) -> tuple[IdemTable, int]:
    """The table from the log's records committed within the window before
    `now_ms` (I/O thread, at open). Returns it and the records read."""
    table = IdemTable(cap)
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
    read = 0
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
        for _key, ts, flags, payload in got.records:
            if ts >= cutoff and flags & FR.F_EXT:
                k = key_of(flags, payload)
                if k is not None:
                    table.add(k, ts)
        read += len(got.records)
        off = got.next_offset
    table.evicted = 0  # the cap at rebuild drops what an earlier life had dropped already
    return table, read


def record_claims(claims: ClaimTable, topic: int, index: int, keys: list[str], expires_ms: int, now_ms: int) -> None:
    """Keys a commit of partition `index` made durable, into the node's claims table."""
    try:
        ks = claims.prepare(keys)
    except BadKeys:  # (not a key the produce path lets in: nothing to record)
        return
    n = len(keys)
    claims.load(topic, ks, [index] * n, [expires_ms] * n, now_ms)


def load_claims(table: IdemTable, claims: ClaimTable, topic: int, index: int, window_ms: int, now_ms: int) -> None:
    """A rebuilt table's keys into the node's claims table, each until its commit plus
    the window (I/O thread, at open)."""
    ok, ot = table._ok, table._ot
    if not ok:
        return
    keys = list(ok)
    try:
        ks = claims.prepare(keys)
    except BadKeys:
        return
    claims.load(topic, ks, [index] * len(keys), [t + window_ms for t in ot], now_ms)
