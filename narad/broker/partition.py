"""An owned partition: its log plus the in-memory lease table.

Lives in the worker that owns the partition, on its event-loop thread only.

* ``committed`` is the frontier, inclusive (every offset <= it is acked;
  starts at -1). It advances over contiguous acked offsets (and records that
  are corrupt or aged out, which are counted as losses) and is persisted,
  with the acks held above it, by the offset committer.
* A lease (reservation) is ``offset -> (nonce, expiry)``; the receipt handle is
  ``partition:offset:nonce``. A lease is taken *before* the record is read, so
  two consumers never hold the same live copy. Ack, extend and nack need the
  live lease's nonce; anything else is 410.
* Caps: no new lease while ``max_in_flight`` leases are out; while
  ``max_acked_ahead`` acks are held above the frontier, only the frontier
  message (committed + 1) is deliverable. Acks are never refused.
* Expired leases are found on every touch and by the worker's 1 s sweep;
  their offsets are delivered again (lowest first).
* A nack with a delay (issue 14) parks the offset on a due-time heap
  (``_delayed``: one heap entry per offset, no timer per message); every touch
  and the 1 s sweep move what fell due to the redelivery queue. A delayed
  offset is not deliverable, not counted by ``available``/``ready``, keeps
  the partition from being evicted, and holds its slot of the in-flight cap
  until it falls due (so leases plus delays never exceed ``max_in_flight``: the
  memory they take is bounded as the leases' is). Delays live in memory only: a
  restart or a partition move forgets them (the record is delivered again at
  once, as any lease that was out).
* Delivery counts (issue 14): ``deliveries`` maps an offset above the frontier
  that is not acked yet to how many times it was leased (each ``reserve`` adds
  one, this lease included; the Item carries it). Ack, settle and retention's
  skip drop the entry. Counts mark the partition dirty, so the offsets writer
  persists them with the acks (``OffsetFile``: page cache every ~100 ms), and a
  move carries them. The entries are bounded like the leases: an offset gets one
  only when it is leased, redeliveries go out before new offsets, so they are
  about the leases plus the offsets waiting to be leased again. A nack may leave
  a ``reason`` for the dead-letter record (persisted with the counts, room
  allowing, and carried by a move). A give-back (a lease
  whose consumer never saw it: it hung up, its answer was dropped) takes its
  count back (``nack(uncount=True)``).
  With the node's ``topic.delivery_counts`` off (``counting`` False) a lease is
  not counted (its Item carries 0: no ``delivery_count`` in the answer), unless
  the topic has ``max_deliveries``.
* Dead-lettering: with ``max_deliveries`` > 0 (set by the broker from the
  topic), a lease that ends unacked (expiry, nack) with its count at the
  maximum, or an offset about to be leased whose (restored) count is already
  there, is not delivered again: it joins ``dead`` (not deliverable, holding its
  in-flight slot, keeping the partition open) and ``on_dead`` tells the broker,
  whose driver commits it to the dead-letter topic and only then settles it
  here (``settle_dead``). The driver waits until the count (and reason) that used the record
  up is in the offset file (``written_gen`` >= the hold's ``count_gen``: the
  committer's next tick), so a kill -9 after the dead-letter commit never brings
  the record back live in the source. A crash between the commit and the settle:
  the count is on disk, so it is held and dead-lettered again after the restart
  (at least once into the dead-letter topic, never lost).
* Idle partitions are closed whole (the broker's idle eviction): ``last_used``
  is stamped by every reserve, settle and commit (never by stats), and
  ``evictable`` says whether everything the object holds is on disk already
  (no lease, no commit queued or running, acks written and synced, the held
  acks fit one offset slot), so closing and reopening loses nothing.
  ``stats_from_disk`` gives a closed partition's stats from its files alone.
* A move freezes the partition on its source (``freeze``): while the freeze
  token is live, commits are refused (``partition_moving``, retried by the
  dispatchers; they land at the new owner after the flip) and no new lease is
  taken; acks, extends and nacks of existing leases still work. A frozen
  partition is never evicted. The freeze lapses by itself (its TTL) unless the
  destination re-arms it.
* Idempotent produce (issue 14): a commit claims its records' idempotency keys in
  the node's claims table (``claims``, ``narad.broker.idem_claims``), drops a record
  whose key was committed on the node within the topic's window (or earlier in the
  same combined batch), settles its claims once the frame is durable (or releases
  them when it failed), and answers which records of each batch were duplicates. A
  batch whose key another commit on the node holds waits for it (``_defer``).
* Metrics: the owner's counters for this partition (messages and payload bytes
  appended, the commit's fdatasync time) are children the broker hands over
  at open (``meter``): one add per commit, none per record.

Imports narad.storage, narad.metrics, narad.broker.idem, narad.broker.idem_claims.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import heapq
import logging
import os
import time
from collections.abc import Callable, Collection
from concurrent.futures import Executor
from dataclasses import dataclass
from datetime import UTC, datetime
from operator import itemgetter
from pathlib import Path
from typing import Any

from narad import metrics
from narad.broker.idem import key_of
from narad.broker.idem import mark as idem_mark
from narad.broker.idem_claims import (
    CLAIMED,
    COMMIT,
    DUPLICATE,
    FULL,
    PENDING,
    RELEASE,
    SEALED,
    ClaimTable,
    Keys,
    by_key,
)
from narad.errors import Unavailable
from narad.storage import frames as FR
from narad.storage import offsets as OFF
from narad.storage import partition_log as PL
from narad.storage.commit_rounds import CommitRounds
from narad.storage.offsets import OffsetFile
from narad.storage.partition_log import CorruptRecord, LogClosed, NotVisible, OffsetGone, PartitionLog, Record

MAX_REASON_CHARS = 256  # a nack reason is at most 256 bytes of UTF-8 (the API checks; peers' are cut here)
log = logging.getLogger("narad.broker.partition")

MAX_COMBINED_BYTES = 16 << 20
_BODY = itemgetter(2)  # a (key, flags, payload) record's payload
_MKEY = itemgetter(0)  # ... and its message key
# ``submit``'s `ikeys` for records that carry no idempotency key (a keyless produce's direct
# commit): laid out without looking into their blocks. Compared by identity; never mutated.
NO_KEYS: list[str | None] = []
EXPIRY_SLACK = 1024  # stale expiry-heap entries allowed beyond the leases' count before a rebuild

Committed = tuple[int, list[int]]  # first offset, indexes of the batch's duplicates (idempotent produce)
# A queued commit: its records, its future, its records' idempotency keys (``submit``).
_Queued = tuple[list[tuple[bytes | None, int, bytes]], asyncio.Future[Committed], list[str | None] | None]
DEFER_S = 0.002  # a batch whose key another claim holds is tried again after this
DEFER_FOR_S = 5.0  # ... for this long, then refused (retryable: the WAL's dispatcher tries again)


def block_keys(batch: list[tuple[bytes | None, int, bytes]]) -> list[str | None]:
    """Each record's idempotency key as its extension block holds it (None: none)."""
    ext = FR.F_EXT
    heads, heads8 = FR.IDEM_HEADS, FR.IDEM_HEADS8
    out: list[str | None] = []
    for _key, flags, payload in batch:
        k: str | None = None
        if flags & ext and payload:
            b0 = payload[0]
            if b0 < 0x80 and (len(payload) < 4 or payload[3] != 0x69):
                pass  # a block whose map's first key is not "i" (headers alone, the common case): no key
            elif 4 <= b0 < 36 and payload.startswith(heads[b0 - 4]) and len(payload) > b0:
                # ``key_of``'s common case read in place: a key alone under 32 bytes (its whole
                # head is fixed by the length byte; the key ends where the block does)
                try:
                    k = payload[5 : b0 + 1].decode()
                except UnicodeDecodeError:
                    k = None
            elif 37 <= b0 < 0x80 and payload.startswith(heads8[b0 - 37]) and len(payload) > b0:
                try:  # the same for a key of 32 to 122 bytes (a str8: a UUID)
                    k = payload[6 : b0 + 1].decode()
                except UnicodeDecodeError:
                    k = None
            else:
                k = key_of(flags, payload)
        out.append(k)
    return out


Runner = Executor | CommitRounds


def _off_loop(loop: asyncio.AbstractEventLoop, runner: Runner, fn: Callable[..., Any],
              *args: Any) -> asyncio.Future[Any]:
    """``fn(*args)`` on an I/O thread: the broker's commit rounds' thread, or an executor (tests)."""
    if isinstance(runner, CommitRounds):
        return runner.run(loop, fn, *args)
    return loop.run_in_executor(runner, fn, *args)


@dataclass
class Delivery:
    partition: int
    offset: int
    nonce: int
    record: Record
    deliveries: int = 0


class _NoncePool:
    """Unguessable 63-bit nonces, read from the kernel's CSPRNG 4 KiB at a time
    (one getrandom call per 512 leases instead of one per lease)."""

    def __init__(self) -> None:
        self._vals: list[int] = []

    def __call__(self) -> int:
        vals = self._vals
        if not vals:
            raw = memoryview(os.urandom(4096)).cast("Q")
            vals.extend(v >> 1 for v in raw)
        return vals.pop()


new_nonce = _NoncePool()
# A forked worker must never reuse its parent's unread nonces.
os.register_at_fork(after_in_child=new_nonce._vals.clear)


class Partition:
    def __init__(self, topic: str, topic_id: str, index: int, plog: PartitionLog, offsets: OffsetFile) -> None:
        self.topic = topic
        self.topic_id = topic_id
        self.index = index
        self.log = plog
        self.offsets = offsets
        self.committed = -1
        self.leases: dict[int, tuple[int, float]] = {}
        self.acked_ahead: set[int] = set()
        self._expiry: list[tuple[float, int, int]] = []
        self._redeliver: list[int] = []
        self._delayed: list[tuple[float, int]] = []  # (due, offset): nacked with a delay
        self.delayed: dict[int, float] = {}  # offset -> due (monotonic) of the live entry
        self.cursor = 0
        self.dirty = False
        self.dropped = 0  # offsets the frontier passed without an ack (retention, corruption)
        self.dropped_reported = 0  # of which counted in the metric already
        self.corrupt_skipped = 0
        self.corrupt_reported = 0  # of which counted in the metric already
        self.m_produced: Any = None  # metric children (``meter``); None: not metered
        self.m_bytes: Any = None
        self.m_fsync: Any = None
        self.m_dups: Any = None  # idempotent produce: duplicates dropped, keys evicted for room
        self.m_evicted: Any = None
        self.idem_window_ms = 300_000  # the topic's effective window (the broker sets it)
        self.idem_marked = False  # idem.marker is durable here (the broker sets it at open)
        # The node's claims table, this topic's tag in it and this worker's claimer tag (the
        # broker sets them at open); batches waiting for another claim, by future: deadline.
        self.claims: ClaimTable | None = None
        self.claims_topic = 0
        self.claims_tag = 1
        self.nparts = 1  # the topic's partitions (the broker sets it): a keyless key's home is its hash over them
        self._defer_until: dict[asyncio.Future[Committed], float] = {}
        self._executor: Runner | None = None
        self.age_at: tuple[int, int] = (-1, 0)  # (offset, committed-at ms) of the last oldest-unacked read
        self.closed = False
        self.last_used = time.monotonic()  # the last reserve, settle or commit (stats never stamp it)
        # Commit combining: batches queued while a commit runs go out together.
        # (a batch, its waiter, and its records' idempotency keys when the producer gave them: ``submit``)
        self._commit_queue: list[_Queued] = []
        self._committing = False  # a commit cycle runs (``_step`` drives it)
        self._cycle_done: asyncio.Future[None] | None = None  # made for a waiter (``_cycle_waiter``)
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by the broker
        self.on_visible: Callable[[Partition, int], None] | None = None
        self.on_released: Callable[[Partition], None] | None = None
        # A move's freeze on this (source) partition: token and monotonic deadline.
        self.freeze_token: str | None = None
        self.freeze_until = 0.0
        self.claims_sealed = False  # the freeze sealed its home in the node's claims table (``MoveSource.claims``)
        # Delivery counts and dead-lettering (issue 14).
        self.deliveries: dict[int, int] = {}  # offset above the frontier, not acked -> times leased
        self.reasons: dict[int, str] = {}  # offset -> its last nack's reason (in the offset file, room allowing)
        self.dead: dict[int, int] = {}  # held for the dead-letter driver (not deliverable) -> count_gen at the hold
        self.dead_flight: set[int] = set()  # held offsets whose dead-letter commit is on its way (the driver's)
        # Offsets the offset file said were held (a restart, a move's destination): held again
        # whatever their count says, and not released by a raised maximum (their dead-letter
        # copy may exist). Lifting dead-lettering releases them, except those its driver sent
        # to a dead-letter topic that still exists (``follow_max``'s `keep`): their move is
        # finished into it, so a copy made before a crash is never live beside them.
        self.marked: set[int] = set()
        # The dead-letter topic (name, id) this partition's driver commits to and the offsets it
        # sent there whose settle may not be on disk yet, from ``dead_letter.target``
        # (``deadletter.write_target``: durable before each commit that adds to them).
        self.dlq_target: tuple[str, str] | None = None
        self.dlq_sent: set[int] = set()
        self.count_gen = 0  # bumped by every count change
        self.written_gen = 0  # the count_gen the offset file's last window write holds (the committer sets it)
        # ... except the counts of these offsets, left out of that write (its slot was full)
        self.counts_unwritten: set[int] = set()
        self.max_deliveries = 0  # the topic's (0: unlimited); the broker keeps it current
        # Each lease counted (the node's ``topic.delivery_counts``); a topic with max_deliveries
        # counts whatever this says (its counts decide the dead-lettering).
        self.counting = True
        self.on_dead: Callable[[Partition], None] | None = None

    # ---- move freeze (source side) ----------------------------------------------------
    def frozen(self, now: float | None = None) -> bool:
        return self.freeze_token is not None and (now if now is not None else time.monotonic()) < self.freeze_until

    def moving_error(self) -> Unavailable:
        return Unavailable(f"partition {self.index} of {self.topic} is being moved to another node; retry",
                           code="partition_moving")

    def home_moving_error(self) -> Unavailable:
        return Unavailable(f"an idempotency key of this batch belongs to a partition of {self.topic} that is "
                           "being moved to another node; retry", code="partition_moving")

    async def commits_idle(self, timeout: float = 30.0) -> None:
        """Wait until no commit is running (a frozen partition refuses new ones)."""
        done = self._cycle_waiter()
        if done is not None:
            await asyncio.wait_for(asyncio.shield(done), timeout)

    def meter(self, produced: Any, nbytes: Any, fsync: Any) -> None:
        """Count commits into these metric children (event-loop thread)."""
        self.m_produced, self.m_bytes, self.m_fsync = produced, nbytes, fsync

    def meter_idem(self, dups: Any, evicted: Any) -> None:
        """Count duplicates dropped and keys the cap evicted into these children."""
        self.m_dups, self.m_evicted = dups, evicted

    def oldest_unacked_ms(self) -> int | None:
        """Committed-at of the oldest record not acked yet (frontier + 1); None when
        everything is acked or it cannot be read. Read again only when the frontier
        moved (one record read, usually from the frame cache)."""
        off = max(self.committed + 1, self.log.oldest)
        if off >= self.log.hwm:
            return None
        if self.age_at[0] == off:
            return self.age_at[1]
        try:
            ts = self.log.read(off)[1]
        except (OffsetGone, CorruptRecord, NotVisible, LogClosed, OSError):
            return None
        self.age_at = (off, ts)
        return ts

    def restore(self, frontier: int, ahead: list[int], counts: dict[int, int] | None = None,
                reasons: dict[int, str] | None = None, held: set[int] | None = None) -> None:
        hwm = self.log.hwm
        # A persisted frontier never passes what the log holds.
        self.committed = min(frontier, hwm - 1)
        self.acked_ahead = {a for a in ahead if self.committed < a < hwm}
        self._advance()
        self.cursor = self.committed + 1
        if counts:
            self.deliveries = {o: c for o, c in counts.items()
                               if self.committed < o < hwm and o not in self.acked_ahead and c > 0}
        if reasons:
            self.reasons = {o: r for o, r in reasons.items()
                            if self.committed < o < hwm and o not in self.acked_ahead and r}
        if held:
            self.marked = {o for o in held if self.committed < o < hwm and o not in self.acked_ahead}

    # ---- reserve ---------------------------------------------------------------------
    def purge(self, now: float) -> int:
        """Release expired leases and delayed nacks that fell due; returns how many."""
        n = 0
        dheap = self._delayed
        while dheap and dheap[0][0] <= now:
            due, off = heapq.heappop(dheap)
            if self.delayed.get(off) == due:
                del self.delayed[off]
                heapq.heappush(self._redeliver, off)
                n += 1
        heap = self._expiry
        while heap and heap[0][0] <= now:
            exp, off, nonce = heapq.heappop(heap)
            cur = self.leases.get(off)
            if cur is not None and cur[0] == nonce and cur[1] == exp:
                del self.leases[off]
                if not self._hold_if_spent(off):
                    heapq.heappush(self._redeliver, off)
                    n += 1
        return n

    def _spent(self, off: int) -> bool:
        m = self.max_deliveries
        return (m > 0 and self.deliveries.get(off, 0) >= m) or off in self.marked

    def _hold_if_spent(self, off: int) -> bool:
        """A record leased ``max_deliveries`` times (or marked held in the offset file)
        goes to the dead-letter driver instead of out again; True if it did. The hold
        waits for the offset file's write that marks it (``count_gen``): from then on a
        restart holds it again whatever ``max_deliveries`` has become."""
        if not self._spent(off):
            return False
        self.count_gen += 1
        self.dirty = True
        self.dead[off] = self.count_gen
        if self.on_dead is not None:
            self.on_dead(self)
        return True

    def held_marks(self) -> Collection[int]:
        """The offsets to mark held in the offset file (``OffsetFile.write_window``'s
        `first`): those held here and those a restart or a move found marked."""
        return self.dead.keys() | self.marked if self.marked else self.dead.keys()

    def settle_dead(self, off: int) -> bool:
        """The dead-letter topic holds the record now: settle it here (as an ack)."""
        if off not in self.dead:
            return False
        del self.dead[off]
        self.marked.discard(off)
        if off > self.committed:
            self._settle(off)
        if self.on_released is not None:
            self.on_released(self)  # its in-flight slot is free
        return True

    def mark_sent(self, sent: Collection[int]) -> None:
        """At an open: offsets ``dead_letter.target`` lists as sent to a dead-letter topic
        that still exists (``deadletter.finish_keep``), unsettled here, are marked held
        like those the offset file marked: their copy may be there. (After a power loss
        the offset file may come back from before their hold; the target file, synced
        before their commit, still lists them.)"""
        hwm = self.log.hwm
        self.marked.update(o for o in sent if self.committed < o < hwm and o not in self.acked_ahead)

    def follow_max(self, maxd: int, keep: Collection[int] = ()) -> bool:
        """The topic's max_deliveries (0: dead-lettering lifted) at an open or after a
        change: lifted, what was held goes out again, and so does what was marked held (a
        mark a restart found would otherwise hold a record at the first nack after a
        later re-enable); raised, what was held below the new maximum. Except the offsets
        in `keep` (``deadletter.finish_keep``: sent to a dead-letter topic that still
        exists, their settle maybe not on disk): their copy may be there already, so they
        stay held (and marked) and the driver finishes their move. True if anything was
        released."""
        old = self.max_deliveries
        self.max_deliveries = maxd
        if maxd <= 0:
            return bool(self.dead or self.marked) and self.release_dead(keep=keep)
        if 0 < old < maxd and self.dead:
            return self.release_dead(maxd, keep)
        return False  # set or lowered: the next reserve holds the records already past it

    def release_dead(self, below: int = 0, keep: Collection[int] = ()) -> bool:
        """max_deliveries was lowered to 0 (or the topic lost its dead-letter topic), or
        raised to `below`: what was held (with `below`, each record leased fewer times
        than that) goes out again, except offsets whose dead-letter commit is on its
        way (``dead_flight``): the dead-letter topic may hold them already, so they stay
        held until that commit settles them. Never live in both. A raise keeps what a
        restart or a move found marked held (``marked``: its dead-letter copy may
        exist); lifting releases that too. Offsets in `keep` (sent before: their commit
        may have landed, ``deadletter.finish_keep``) stay held and marked either way:
        the driver finishes their move. True if anything was released or unmarked."""
        flight = self.dead_flight
        counts = self.deliveries
        changed = False
        marked = self.marked
        if below <= 0 and marked:
            n = len(marked)
            if keep:
                marked.intersection_update(keep)  # (in place: a reserve's local is this set)
            else:
                marked.clear()
            changed = len(marked) != n
        for off in [o for o in self.dead if o not in flight and o not in marked and o not in keep
                    and (below <= 0 or counts.get(o, 0) < below)]:
            heapq.heappush(self._redeliver, off)
            del self.dead[off]
            changed = True
        if changed:
            self.dirty = True  # (the marks of what was released go at the next write)
        return changed

    def _deliverable(self, off: int) -> bool:
        return (off > self.committed and off not in self.leases and off not in self.acked_ahead
                and off not in self.delayed and off not in self.dead)

    def _candidate(self) -> int | None:
        red = self._redeliver
        while red and (red[0] >= self.cursor or not self._deliverable(red[0])):
            heapq.heappop(red)
        if red:
            return red[0]
        hwm = self.log.hwm
        c = max(self.cursor, self.committed + 1)
        while c < hwm and not self._deliverable(c):
            c += 1
        self.cursor = c
        return c if c < hwm else None

    def reserve(self, now: float, max_n: int, visibility_s: float, max_in_flight: int,
                max_acked_ahead: int, make: Callable[[int, int, int, Record], Any] = Delivery) -> list[Any]:
        """Lease and read up to max_n records; each is returned as make(partition,
        offset, nonce, record) (a Delivery unless the caller builds its own)."""
        if self.closed or self.frozen(now):
            return []
        self.last_used = now
        self.purge(now)
        out: list[Delivery] = []
        # Locals for the per-record loop (the containers are mutated in place, never rebound,
        # except by _skip_to_oldest, after which the loop re-reads them: see `continue` there).
        leases, delayed, dead, red = self.leases, self.delayed, self.dead, self._redeliver
        log, deliveries, expiry_heap, index = self.log, self.deliveries, self._expiry, self.index
        md, marked = self.max_deliveries, self.marked
        counting = self.counting or md > 0
        expiry = now + visibility_s
        push = heapq.heappush
        # Read once, then kept in step: the records in flight (``busy``), whether the acked-ahead
        # cap is reached, the log's oldest offset. Only the rare branches below (a skip to the
        # oldest, a spent record held, an unreadable one settled) change them otherwise: they set
        # ``busy`` to -1 and all three are read again.
        busy = -1
        ahead_full = False
        oldest = 0
        while len(out) < max_n:
            if busy < 0:
                busy = len(leases) + len(delayed) + len(dead)
                ahead_full = len(self.acked_ahead) >= max_acked_ahead
                oldest = log.oldest
            if busy >= max_in_flight:
                break  # a delayed nack (a dead-letter hold) keeps its in-flight slot until it is due (settled)
            off = self.cursor
            if (red or off <= self.committed or off >= log.hwm or off in leases or off in self.acked_ahead
                    or off in delayed or off in dead):
                off = self._candidate()  # the cursor itself is not the next record (the common case is)
                if off is None:
                    break
            if off < oldest:
                self._skip_to_oldest()
                leases, dead, marked = self.leases, self.dead, self.marked  # rebound there
                busy = -1
                continue
            if ahead_full and off != self.committed + 1:
                break  # at the acked-ahead cap only the frontier message goes out
            if (md > 0 and deliveries.get(off, 0) >= md) or (marked and off in marked):
                # its count (restored, or a lowered maximum) is used up, or it was held before a restart
                # (with dead-lettering lifted too, while its move is finished: ``follow_max``)
                if red and red[0] == off:
                    heapq.heappop(red)
                elif off == self.cursor:
                    self.cursor = off + 1
                self._hold_if_spent(off)
                busy = -1
                continue
            nonce = new_nonce()
            leases[off] = (nonce, expiry)
            if red and red[0] == off:
                heapq.heappop(red)
            elif off == self.cursor:
                self.cursor = off + 1
            try:
                rec = log.read(off)
            except OffsetGone:
                del leases[off]
                self._skip_to_oldest()
                leases, dead, marked = self.leases, self.dead, self.marked  # rebound there
                busy = -1
                continue
            except CorruptRecord:
                del leases[off]
                self._settle_unreadable(off)
                busy = -1
                continue
            except (LogClosed, NotVisible):
                # Closing (delete, recreate, shutdown): give the lease back, never
                # mistake the retired log for a gap. The offset was taken off the
                # redelivery heap (or the cursor moved past it) above: put it back.
                del leases[off]
                push(red, off)
                break
            push(expiry_heap, (expiry, off, nonce))
            if counting:
                count = deliveries[off] = deliveries.get(off, 0) + 1
                self.count_gen += 1
                self.dirty = True  # the count is persisted with the acks
            else:
                count = 0  # (not counted: the answer has no delivery_count)
            item = make(index, off, nonce, rec)
            item.deliveries = count
            out.append(item)
            busy += 1
        self._compact_expiry()
        return out

    def _compact_expiry(self) -> None:
        """After pushes to the expiry heap: rebuild it from the live leases once it
        holds more than twice their count plus ``EXPIRY_SLACK`` entries. An ack, a nack
        or an extend leaves its lease's old entry in the heap until that entry's own
        expiry, which a per-consume ``visibility`` or an extend can put 12 h away:
        without this, the heap would grow with every settle of such a lease, not with
        the leases held. A rebuild (O(leases)) follows at least as many stale pushes:
        O(1) a push."""
        if len(self._expiry) <= 2 * len(self.leases) + EXPIRY_SLACK:
            return
        heap = [(exp, off, nonce) for off, (nonce, exp) in self.leases.items()]
        heapq.heapify(heap)
        self._expiry = heap

    def _skip_to_oldest(self) -> None:
        oldest = self.log.oldest
        if self.committed < oldest - 1:
            lost = oldest - 1 - self.committed - len([a for a in self.acked_ahead if a < oldest])
            self.dropped += max(0, lost)
            log.warning("consumer frontier fell behind retention; skipped to oldest retained offset",
                        extra={"topic": self.topic, "partition": self.index, "oldest": oldest, "lost": lost})
            self.committed = oldest - 1
            self.acked_ahead = {a for a in self.acked_ahead if a >= oldest}
            for off in [o for o in self.leases if o < oldest]:
                del self.leases[off]
            for d in (self.deliveries, self.reasons):
                for off in [o for o in d if o < oldest]:
                    del d[off]
            self.dead = {o: g for o, g in self.dead.items() if o >= oldest}
            self.marked = {o for o in self.marked if o >= oldest}
            gone = [o for o in self.delayed if o < oldest]
            if gone:
                for off in gone:
                    del self.delayed[off]
                self._delayed = [(d, o) for d, o in self._delayed if self.delayed.get(o) == d]
                heapq.heapify(self._delayed)
            self._advance()
            self.cursor = max(self.cursor, self.committed + 1)
            self.dirty = True

    def _settle_unreadable(self, off: int) -> None:
        self.corrupt_skipped += 1
        self.dropped += 1
        log.error("skipped permanently-unreadable record", extra={"topic": self.topic, "partition": self.index,
                                                                   "offset": off})
        self._settle(off)

    # ---- settle ---------------------------------------------------------------------
    def _settle(self, off: int) -> None:
        if self.deliveries:
            self.deliveries.pop(off, None)
        if self.reasons:
            self.reasons.pop(off, None)
        if self.marked:
            self.marked.discard(off)
        if off == self.committed + 1:
            self.committed = off
            self._advance()
        elif off > self.committed:
            self.acked_ahead.add(off)
        self.dirty = True

    def _advance(self) -> None:
        ahead = self.acked_ahead
        while self.committed + 1 in ahead:
            ahead.discard(self.committed + 1)
            self.committed += 1

    def _lease_ok(self, off: int, nonce: int, now: float) -> bool:
        cur = self.leases.get(off)
        return cur is not None and cur[0] == nonce and cur[1] > now

    def ack(self, off: int, nonce: int, now: float, notify: bool = True) -> bool:
        """``notify`` False: the caller tells ``on_released`` itself, once for a batch."""
        self.last_used = now
        if not self._lease_ok(off, nonce, now):
            return False
        del self.leases[off]
        self._settle(off)
        if notify and self.on_released is not None:
            self.on_released(self)  # a cap slot may have freed
        return True

    def extend(self, off: int, nonce: int, now: float, visibility_s: float) -> bool:
        self.last_used = now
        if not self._lease_ok(off, nonce, now):
            return False
        expiry = now + visibility_s
        self.leases[off] = (nonce, expiry)
        heapq.heappush(self._expiry, (expiry, off, nonce))
        self._compact_expiry()
        return True

    def nack(self, off: int, nonce: int, now: float, delay_s: float = 0.0, reason: str = "",
             uncount: bool = False, notify: bool = True) -> bool:
        """Give the lease back: delivered again at once, or (``delay_s`` > 0) not
        before ``now + delay_s`` (the due-time heap; the sweep or a touch moves it).
        A record whose deliveries are used up goes to the dead-letter driver instead
        (``reason``, if any, is kept for its dead-letter record). ``uncount``: a give-back
        (the consumer never saw this delivery): its count is taken back. ``notify``
        False: the caller tells ``on_released`` itself, once for a batch."""
        self.last_used = now
        if not self._lease_ok(off, nonce, now):
            return False
        del self.leases[off]
        if uncount:
            c = self.deliveries.get(off, 0) - 1
            if c > 0:
                self.deliveries[off] = c
            else:
                self.deliveries.pop(off, None)
            self.count_gen += 1
            self.dirty = True
        if reason and self.reasons.get(off) != reason:
            self.reasons[off] = reason
            self.count_gen += 1  # a dead-letter hold waits for the write that holds it, like a count
            self.dirty = True  # the committer writes it with the counts (it survives a restart)
        if self._hold_if_spent(off):
            return True
        if delay_s > 0:
            due = now + delay_s
            self.delayed[off] = due
            heapq.heappush(self._delayed, (due, off))
            return True  # nothing deliverable yet: the wake comes when it falls due
        heapq.heappush(self._redeliver, off)
        if notify and self.on_released is not None:
            self.on_released(self)
        return True

    # ---- commit (owner side) ------------------------------------------------------------
    async def commit(self, batch: list[tuple[bytes | None, int, bytes]],
                     executor: Runner, ikeys: list[str | None] | None = None) -> Committed:
        """Append (key, flags, payload) records; returns (the first offset, the
        indexes in `batch` of the records dropped as duplicates of an idempotency
        key) once they are durable, read back intact and visible. Batches that
        arrive while a commit runs are combined into the next one (one frame, one
        fsync)."""
        return await self.submit(batch, executor, ikeys)

    def submit(self, batch: list[tuple[bytes | None, int, bytes]], executor: Runner,
               ikeys: list[str | None] | None = None) -> asyncio.Future[Committed]:
        """``commit`` without the coroutine: queues the batch and returns the future of
        its commit (raises at once when the partition is closed or frozen). A waiter
        that cancels the future does not take the batch back: it is committed anyway.
        ``ikeys`` (a producer's direct commit): each record's idempotency key, the one
        its extension block holds (None: none), so the commit reads no block, or
        ``NO_KEYS`` when no record has one (a keyless produce); without it the keys are
        read from the blocks."""
        if self.closed:
            raise OSError(9, "partition closed")
        self.last_used = time.monotonic()
        if self.frozen(self.last_used):
            raise self.moving_error()
        loop = self.loop
        self._executor = executor
        fut: asyncio.Future[Committed] = loop.create_future()
        self._commit_queue.append((batch, fut, ikeys))
        if not self._committing:
            self._committing = True
            # The cycle starts at the loop's next pass, as a task's would (the batches submitted
            # in this pass join its frame, and the other partitions' commits its round).
            loop.call_soon(self._step, self._commit_cycle(executor))
        return fut

    def _step(self, coro: Any, _awaited: Any = None) -> None:
        """Run the commit cycle's coroutine to its next await, and have the future it
        awaits resume it. The cycle runs without a Task: its awaits are plain futures
        (the round's, an I/O job's), and creating, scheduling and finishing a task cost
        about 18k instructions a cycle in this interpreter (measured), once per partition
        a produce touches; this is a callback a step. The cycle answers its own waiters
        whatever happens (its ``finally``); an exception out of it is a bug, logged."""
        try:
            fut = coro.send(None)
        except StopIteration:
            self._cycle_ended()
            return
        except asyncio.CancelledError:  # (an awaited future cancelled: the cycle answered its waiters)
            self._cycle_ended()
            return
        except Exception:
            self._committing = False
            self._cycle_ended()
            log.exception("partition commit cycle failed", extra={"topic": self.topic, "partition": self.index})
            return
        if fut is None:  # (a bare yield: resumed at the next pass)
            self.loop.call_soon(self._step, coro)
        else:
            fut.add_done_callback(functools.partial(self._step, coro))

    def _settle_claims(self, claimed: list[tuple[Keys, list[int] | None]], how: int, ts: int = 0) -> None:
        """A frame's claims settled: committed at `ts` (its frame is durable), or released
        (it failed: the keys are free again). One call a batch of the frame."""
        claims = self.claims
        if claims is None:
            return
        for ks, got in claimed:
            claims.settle(self.claims_topic, ks, self.claims_tag, ts, self.idem_window_ms,
                          how if got is None else [how if g == CLAIMED else 0 for g in got])

    def _release(self, claimed: list[tuple[Keys, list[int] | None]]) -> None:
        """This worker's claims of a failed frame are taken back."""
        if claimed:
            self._settle_claims(claimed, RELEASE)

    def _defer(self, item: _Queued) -> None:
        """A batch one of whose keys another claim holds (a commit elsewhere on this node,
        not durable yet), or a keyed batch while the node's table is not complete (a worker
        still loading its keys at start), is queued again after DEFER_S, for DEFER_FOR_S at
        most; then it is refused with a retryable error (a produce then answers it pending,
        and the WAL's dispatcher tries it again)."""
        fut = item[1]
        now = time.monotonic()
        deadline = self._defer_until.get(fut)
        if deadline is None:
            deadline = self._defer_until[fut] = now + DEFER_FOR_S
            fut.add_done_callback(self._defer_until.pop)  # type: ignore[arg-type]
        if fut.done():
            return
        if now >= deadline:
            fut.set_exception(OSError(errno.EAGAIN, "an idempotency key of this batch is being committed by "
                                                    "another produce on this node, or the node is still loading "
                                                    "its idempotency keys; try again"))
            return
        self.loop.call_later(DEFER_S, self._requeue, item)

    def _requeue(self, item: _Queued) -> None:
        fut = item[1]
        if fut.done():
            return
        if self.closed or self._executor is None:
            fut.set_exception(OSError(9, "partition closed"))
            return
        self._commit_queue.append(item)
        if not self._committing:
            self._committing = True
            self.loop.call_soon(self._step, self._commit_cycle(self._executor))

    def _cycle_ended(self) -> None:
        f, self._cycle_done = self._cycle_done, None
        if f is not None and not f.done():
            f.set_result(None)

    def _cycle_waiter(self) -> asyncio.Future[None] | None:
        """A future resolved when the running commit cycle ends (None: none runs)."""
        if not self._committing:
            return None
        if self._cycle_done is None:
            self._cycle_done = self.loop.create_future()
        return self._cycle_done

    async def _commit_cycle(self, executor: Runner) -> None:
        loop = self.loop
        try:
            while self._commit_queue and not self.closed:
                if self.frozen():
                    # Frozen meanwhile (a move): what is queued is refused, to land at the new owner.
                    err = self.moving_error()
                    for _, f, _k in self._commit_queue:
                        if not f.done():
                            f.set_exception(err)
                    self._commit_queue.clear()
                    break
                queue: list[_Queued] = []
                size = 0
                while self._commit_queue and (not queue or size < MAX_COMBINED_BYTES):
                    item = self._commit_queue.pop(0)
                    queue.append(item)
                    size += sum(map(len, map(_BODY, item[0])))  # (C loops: no Python a record)
                payload_bytes = size
                ts = self.log.committed_at()
                laid = FR.Laid()  # the frame's records, laid out (``FR.lay``), joined once at the write
                decoded: list[Record] = []
                dups: list[list[int]] = []
                # Idempotency keys: claimed in the node's table (``narad.broker.idem_claims``)
                # for this worker, settled once the frame is durable (committed) or failed
                # (released). A key repeated within the frame is a duplicate of its first; a
                # batch with a key pending under another claim (a commit elsewhere on this node
                # not durable yet) waits for it, out of this frame (``_defer``).
                claims = self.claims
                frame_keys: set[str] = set()  # the keys this frame claimed
                claimed: list[tuple[Keys, list[int] | None]] = []  # each batch's keys, and verdicts (None: all claimed)
                kept_queue: list[_Queued] = []
                try:
                    for item in queue:
                        batch, _, iks = item
                        if iks is NO_KEYS:  # (no record of it has a key: no block is looked into)
                            FR.lay(laid, batch, ts, decoded)
                            dups.append([])
                            kept_queue.append(item)
                            continue
                        keys = iks if iks is not None else block_keys(batch)
                        uniq = set(keys)
                        uniq.discard(None)
                        if not uniq:  # (no record of it has a key after all)
                            FR.lay(laid, batch, ts, decoded)
                            dups.append([])
                            kept_queue.append(item)
                            continue
                        if claims is None:  # (a partition without a broker, in tests: a table of its own)
                            claims = self.claims = ClaimTable.private(256)
                        if not claims.complete():  # (the node's start: a worker has not loaded its keys yet)
                            payload_bytes -= sum(map(len, map(_BODY, batch)))
                            self._defer(item)
                            continue
                        dl: list[int] = []
                        fresh: list[str]
                        if len(uniq) == len(keys) and frame_keys.isdisjoint(uniq):
                            fresh = keys  # type: ignore[assignment]  # (the common batch: every record keyed, once)
                            at: list[int] | None = None
                        else:  # keyless records among them, or a key given twice: record by record
                            fresh, at, seen = [], [], set(frame_keys)
                            for j, k in enumerate(keys):
                                if k is None:
                                    continue
                                if k in seen:
                                    dl.append(j)
                                    continue
                                seen.add(k)
                                fresh.append(k)
                                at.append(j)
                        if fresh:
                            # Each key's home: the partition its key hashes to for a record without a
                            # message key (a move of that partition carries it), else this one.
                            bk = by_key(self.nparts)
                            homes: list[int] | None = None
                            if any(map(_MKEY, batch)):
                                homes = [self.index if batch[j][0] is not None else bk
                                         for j in (range(len(batch)) if at is None else at)]
                            ks, got, ev = claims.prepare_claim(self.claims_topic, fresh, bk, ts,
                                                               self.idem_window_ms, self.claims_tag, homes)
                            if ev and self.m_evicted is not None:
                                self.m_evicted.value += ev
                            if got.count(CLAIMED) == len(got):
                                claimed.append((ks, None))
                            else:
                                if SEALED in got:
                                    # A key homed at a partition whose move is carrying its keys
                                    # away (``ClaimTable.seal``): it belongs at that partition's new
                                    # owner, so the batch is refused as moving; the WAL's dispatcher
                                    # sends it there (``Broker.rehome``).
                                    claims.settle(self.claims_topic, ks, self.claims_tag, 0, 0,
                                                  [RELEASE if g == CLAIMED else 0 for g in got])
                                    payload_bytes -= sum(map(len, map(_BODY, batch)))
                                    metrics.get().idem_sealed.inc()
                                    if not item[1].done():
                                        item[1].set_exception(self.home_moving_error())
                                    continue
                                if PENDING in got or FULL in got:
                                    # Another claim holds one of its keys: this batch waits for it.
                                    claims.settle(self.claims_topic, ks, self.claims_tag, 0, 0,
                                                  [RELEASE if g == CLAIMED else 0 for g in got])
                                    payload_bytes -= sum(map(len, map(_BODY, batch)))
                                    self._defer(item)
                                    continue
                                for i, g in enumerate(got):
                                    if g == DUPLICATE:
                                        dl.append(i if at is None else at[i])
                                dl.sort()
                                if CLAIMED in got:
                                    claimed.append((ks, got))
                            frame_keys.update(fresh)
                        kept_queue.append(item)
                        if dl:
                            drop = set(dl)
                            kept = [r for j, r in enumerate(batch) if j not in drop]
                            kept_iks = None if iks is None else [k for j, k in enumerate(iks) if j not in drop]
                            payload_bytes -= sum(len(batch[j][2]) for j in dl)
                        else:
                            kept, kept_iks = batch, iks
                        if kept_iks is None:
                            FR.lay(laid, kept, ts, decoded)
                        else:
                            FR.lay_keyed(laid, kept, kept_iks, ts, decoded)
                        dups.append(dl)
                except BaseException as e:  # (a bug: the keys this frame claimed are not left held,
                    self._release(claimed)  # and no waiter of the frame is left without an answer)
                    for _, f, _k in queue:
                        if not f.done():
                            f.set_exception(OSError(5, f"partition commit failed: {e!r}"))
                    raise
                queue = kept_queue
                if not queue:
                    continue  # (every batch waits for another claim: ``_defer`` wakes the cycle)
                ndup = sum(len(dl) for dl in dups)
                if not laid.count:  # every record was a duplicate: nothing to write
                    for (_, f, _k), dl in zip(queue, dups, strict=True):
                        if not f.done():
                            f.set_result((self.log.hwm, dl))
                    if self.m_dups is not None:
                        self.m_dups.value += ndup
                    continue
                try:
                    if claimed and not self.idem_marked:  # the first keyed record here: the marker first
                        await _off_loop(loop, executor, idem_mark, self.log.dir)
                        self.idem_marked = True
                    if isinstance(executor, CommitRounds):
                        res = await executor.commit(loop, self.log, laid)
                    else:
                        res = await _off_loop(loop, executor, self.log.write_commit, laid)
                except OSError as e:
                    self._release(claimed)
                    log.error("partition commit failed", extra={"topic": self.topic, "partition": self.index,
                                                                "err": str(e)})
                    metrics.get().errors.labels(
                        "storage", "fsync_poisoned" if self.log.poisoned is not None else "commit_failed").inc()
                    for _, f, _k in queue:
                        if not f.done():
                            f.set_exception(OSError(e.errno or 5, f"partition commit failed: {e}"))
                    continue
                except BaseException as e:  # a bug or a cancellation: every waiter of the batch is answered
                    self._release(claimed)
                    if not isinstance(e, asyncio.CancelledError):
                        log.exception("partition commit failed", extra={"topic": self.topic,
                                                                        "partition": self.index})
                        metrics.get().errors.labels("storage", "commit_failed").inc()
                    for _, f, _k in queue:
                        if not f.done():
                            f.set_exception(OSError(5, f"partition commit failed: {e!r}"))
                    if isinstance(e, asyncio.CancelledError):
                        raise
                    continue
                base, seg, pos, fsize, rolled = res
                if claimed:
                    self._settle_claims(claimed, COMMIT, ts)
                try:
                    self.log.publish(base, seg, pos, fsize, rolled, decoded)
                except Exception as e:  # the frame is durable; the log state is not to be trusted
                    log.exception("partition publish failed; closing the partition",
                                  extra={"topic": self.topic, "partition": self.index})
                    metrics.get().errors.labels("storage", "commit_failed").inc()
                    self.closed = True
                    # Failed, not committed: a clean close writes the high watermark below the
                    # frame, which stays hidden; the waiters' records take another way (the
                    # WAL). Only a crash before that close can show the frame too: a duplicate.
                    for _, f, _k in queue:
                        if not f.done():
                            f.set_exception(OSError(5, f"partition publish failed: {e}"))
                    break
                if self.m_produced is not None:
                    self.m_produced.value += len(decoded)
                    self.m_bytes.value += payload_bytes
                    self.m_fsync.observe(self.log.last_sync_s)
                if ndup and self.m_dups is not None:
                    self.m_dups.value += ndup
                off = base
                for (batch, f, _k), dl in zip(queue, dups, strict=True):
                    if not f.done():
                        f.set_result((off, dl))
                    off += len(batch) - len(dl)
                if self.on_visible is not None:
                    self.on_visible(self, len(decoded))
        finally:
            # Whatever is still queued (closed, frozen or a cancellation) is refused and
            # dropped: its waiters take another way, and a later cycle never commits it.
            self._committing = False
            for _, f, _k in self._commit_queue:
                if not f.done():
                    f.set_exception(OSError(9, "partition closed"))
            self._commit_queue.clear()

    async def quiesce(self) -> None:
        """Stop taking commits and wait for the one in flight (before closing)."""
        self.closed = True
        done = self._cycle_waiter()
        if done is not None:
            try:
                await asyncio.wait_for(asyncio.shield(done), 30)
            except (TimeoutError, Exception):
                log.error("partition commit still running at close", extra={"topic": self.topic,
                                                                           "partition": self.index})

    def evictable(self) -> bool:
        """Everything this object holds is on disk: closing it loses nothing (no
        lease, delayed nack or dead-letter hold, no commit queued or in flight, acks
        and counts written and synced, and the acks held above the frontier and the
        delivery counts fit one offset slot whole)."""
        if self.closed or self.leases or self.delayed or self.dead or self._committing or self._commit_queue:
            return False
        if self.frozen():
            return False
        if self.dirty or self.offsets.dirty_since_sync:
            return False
        if not self.acked_ahead and not self.deliveries:
            return True
        return OFF.fits(self.committed, sorted(self.acked_ahead), self.deliveries)

    def next_expiry(self) -> float | None:
        """The earliest lease expiry or delayed nack due time (None: neither)."""
        a = self._expiry[0][0] if self._expiry else None
        b = self._delayed[0][0] if self._delayed else None
        if a is None:
            return b
        return a if b is None else min(a, b)

    # ---- stats ------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """The owner's row (ints only: the node RPC answer's type; ``finish_stats``
        adds what the API shows beyond it)."""
        hwm = self.log.hwm
        out = {
            "high_watermark": hwm,
            "next_offset": self.log.next_offset,
            "oldest_offset": self.log.oldest,
            "committed_offset": self.committed,
            "lag": max(0, hwm - 1 - self.committed),
            "in_flight": len(self.leases),
            "acked_ahead": len(self.acked_ahead),
            "segments": len(self.log.segments),
            "size_bytes": self.log.size_bytes(),
        }
        # Extensions (issue 14), present only when there is something: a topic without
        # delays or dead-lettering answers as before.
        if self.delayed:
            out["delayed"] = len(self.delayed)
        if self.dead:
            out["dead_letter_held"] = len(self.dead)
        first = self.log.oldest_segment_ms()
        if first is not None:
            out[OLDEST_SEGMENT_MS] = first
        return out

    def available(self) -> int:
        """Records no lease covers, above the frontier (an estimate)."""
        return max(0, self.log.hwm - 1 - self.committed - len(self.leases) - len(self.acked_ahead)
                   - len(self.delayed) - len(self.dead))

    def ready(self, max_in_flight: int, max_acked_ahead: int) -> int:
        """Records a reserve with these caps would hand out now (an estimate, like
        ``available``): none while the in-flight cap is full, only the frontier
        record while the acked-ahead cap is."""
        held = len(self.leases) + len(self.delayed) + len(self.dead)
        if self.closed or held >= max_in_flight or self.frozen():
            return 0
        n = self.available()
        if n <= 0:
            return 0
        if len(self.acked_ahead) >= max_acked_ahead:
            f = self.committed + 1
            return 1 if f < self.log.hwm and self._deliverable(f) else 0
        return min(n, max_in_flight - held)

    def snapshot_offsets(self) -> tuple[int, list[int]]:
        return self.committed, sorted(self.acked_ahead)

    def snapshot_counts(self) -> dict[int, int]:
        """The delivery counts to persist (or move): offsets above the frontier only."""
        c = self.committed
        return {o: n for o, n in self.deliveries.items() if o > c}

    def snapshot_reasons(self) -> dict[int, str]:
        """The last nack reasons to persist (or move): offsets above the frontier only."""
        c = self.committed
        return {o: r for o, r in self.reasons.items() if o > c} if self.reasons else {}


def stats_from_disk(directory: Path) -> dict[str, int]:
    """``Partition.stats`` of a partition whose log is not open here, read from its
    files (nothing opened for writing, created or synced): the same recovery rules
    as an open, no lease can exist."""
    ds = PL.peek(directory)
    hwm = ds.hwm
    frontier, ahead = OFF.peek(directory, max_frontier=hwm - 1)
    committed = min(frontier, hwm - 1)
    held = {a for a in ahead if committed < a < hwm}
    while committed + 1 in held:
        held.discard(committed + 1)
        committed += 1
    out = {
        "high_watermark": hwm,
        "next_offset": ds.next_offset,
        "oldest_offset": ds.oldest,
        "committed_offset": committed,
        "lag": max(0, hwm - 1 - committed),
        "in_flight": 0,
        "acked_ahead": len(held),
        "segments": ds.segments,
        "size_bytes": ds.size_bytes,
    }
    if ds.oldest_segment_ms is not None:
        out[OLDEST_SEGMENT_MS] = ds.oldest_segment_ms
    return out


# On the node RPC wire a row holds ints only (an older node decodes dict[str, int]):
# the oldest segment's time travels as ms and becomes RFC 3339 at the answering node.
OLDEST_SEGMENT_MS = "oldest_segment_at_ms"


def rfc3339_ms(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def finish_stats(row: dict[str, Any]) -> dict[str, Any]:
    """An owner's row as the topic answer shows it: ``status: "ok"`` and
    ``oldest_segment_at`` (RFC 3339, UTC, ms: the committed-at of the first record
    of the oldest segment; absent when the partition holds no record)."""
    out = dict(row)
    ms = out.pop(OLDEST_SEGMENT_MS, None)
    if isinstance(ms, int) and ms > 0:
        out["oldest_segment_at"] = rfc3339_ms(ms)
    out["status"] = "ok"
    return out


def monotonic() -> float:
    return time.monotonic()
