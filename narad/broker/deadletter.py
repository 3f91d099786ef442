"""The dead-letter driver (issue 14): records leased ``max_deliveries`` times
without an ack, moved to the topic's ``dead_letter_topic``.

A partition holds such an offset (``Partition.dead``: not deliverable, holding its
in-flight slot) and tells this driver (``on_dead``). The driver, one task per
worker, takes the held offsets of each holding partition (up to ``BATCH`` a pass;
the partitions side by side, so one whose dead-letter owner does not answer holds
up no other), reads each
record, builds its dead-letter copy (key kept; flags | ``F_EXT``; the extension
block keeps the original headers, drops an idempotency key and adds the origin
``DeadLetter``: topic, partition, offset, key, delivery count, last nack reason,
committed-at) and commits them with ``Broker.commit_to`` (one commit per
dead-letter partition: here, another worker, another node). Only after a commit
succeeded are its source offsets settled (as acks). So a crash between the two
leaves the source unsettled with its count on disk: after the restart the record
is held and dead-lettered again (at least once into the dead-letter topic, never
lost, never live in both: the source copy is never delivered again once held,
as the hold is marked in the offset file before the commit and a restart holds a
marked record again whatever max_deliveries has become).

Before a commit, the driver makes durable in ``dead_letter.target``
(``write_target``) the dead-letter topic's name and id and the offsets it sends, with
those sent before whose settle a load could still miss. A sent record's copy may be
there (after a kill -9 before its settle was written, or a commit that failed
without an answer), so a lift or a raise never releases it while that topic exists
(``finish_keep``, ``Partition.follow_max``'s `keep`): the driver finishes its move
into that topic; with the topic deleted (or made again: another id) it goes out
again, as nothing of it can be left there. A move carries the file to the partition's
new owner (its install writes it beside the held marks).

The driver takes only holds whose count reached the offset file (the
committer's next 100 ms tick; ``Partition.written_gen``), so a kill -9 right
after the dead-letter commit never finds a lower count and delivers the record
in the source again. A commit that fails (the dead-letter topic missing, its owner down, a move) keeps
the offsets held and is retried every ``RETRY`` s; each failure is counted
(``narad_dead_letter_failures_total``) and logged at most once a minute per topic.
A frozen partition (a move's source) is left alone; its counts travel with the
move and the destination holds the records again. Lowering ``max_deliveries`` to
0 releases what is held and was never sent (delivered again); raising it releases
what is held below the new maximum and was never sent.

Test seam: NARAD_FAULT_DLQ_HOLD_SETTLE_MS (a pause between the commit and the settle).

Records of a topic with an owner are written on that owner's behalf: while the
owner may not produce to the dead-letter topic (a grant taken away, or the name
deleted and created again by someone else), they are held (counted, logged).

Imports narad.storage.{frames,dlq_target}, narad.storage.partition_log (errors), narad.metrics,
narad.meta.grants, narad.broker.{partition,routing}; the broker hands itself in (no
import of broker.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import os
import time
from typing import Any

from narad import metrics
from narad.meta import grants as G
from narad.storage import dlq_target as DT
from narad.storage import frames as FR
from narad.storage.partition_log import CorruptRecord, LogClosed, NotVisible, OffsetGone

from .partition import Partition

log = logging.getLogger("narad.broker.deadletter")

BATCH = 1000  # held offsets of one partition moved per pass
PASS_BYTES = 32 << 20  # ... and at most about this many bytes of them (the records are read into memory)
COMMIT_BYTES = 4 << 20  # one dead-letter commit at most (well under a worker hop's and a node RPC's frame)
RETRY = 1.0  # a failed commit (or a missing dead-letter topic) is tried again this often
LOG_EVERY = 60.0  # failures of one topic are logged at most this often
# Test seam (never set in production): hold this long between a dead-letter commit and the
# source settle (the kill window of the at-least-once test).
HOLD_SETTLE = float(os.environ.get("NARAD_FAULT_DLQ_HOLD_SETTLE_MS", "0")) / 1000.0
UNWRITTEN_GRACE = 10.0  # a held record whose count the slot had no room for waits this long for room
UNWRITTEN_RECHECK = 0.12  # a hold whose count is not in the offset file yet: looked at again after this


TARGET_FILE = DT.FILE  # in a partition directory: where its driver sent what (narad.storage.dlq_target)
read_target = DT.read
write_target = DT.write  # (looked up at each call: a test seam)


def finish_keep(store: Any, p: Partition) -> set[int] | frozenset[int]:
    """The offsets of `p` whose dead-letter copy may exist: sent by its driver to a
    dead-letter topic that still exists as that incarnation (``dead_letter.target``),
    their settle maybe not on disk. A lift or a raise keeps them held (and marked):
    their move is finished into that topic. Empty when the topic is gone or made again
    (nothing of them can be there). `store`: the worker's ``MetaStore``."""
    tgt = p.dlq_target
    if tgt is None or not p.dlq_sent:
        return frozenset()
    t = store.topic(tgt[0])
    return p.dlq_sent if t is not None and t.id == tgt[1] else frozenset()


def dead_letter_record(topic: str, partition: int, offset: int, deliveries: int, reason: str | None,
                       rec: tuple[bytes | None, int, int, bytes], topic_id: str | None = None,
                       into: str | None = None) -> tuple[bytes | None, int, bytes]:
    """(key, flags, payload) of the dead-letter copy of `rec` (key, committed-at, flags,
    stored payload) of topic `topic` (its id `topic_id`), committed into the dead-letter
    topic whose id is `into`. A record that was a dead letter itself keeps its own
    origin under the new one (``FR.nest_origin``): a redrive restores it."""
    key, ts, flags, stored = rec
    headers = None
    prev = None
    try:
        ext, body = FR.split_ext(flags, stored)
    except FR.FrameError:
        ext, body = None, stored  # a damaged block: the stored bytes travel as an opaque body
        flags &= ~(FR.F_JSON | FR.F_UTF8)
    if ext is not None:
        headers = ext.h or None  # kept; the idempotency key is not (the copy is a new record)
        prev = ext.d
    dl = FR.DeadLetter(t=topic, p=partition, o=offset, c=deliveries, k=key, r=reason or None, ts=ts,
                       id=topic_id, q=into)
    if prev is not None:
        dl = FR.nest_origin(dl, prev)
    payload = FR.pack_ext(FR.Ext(h=headers, d=dl), body)
    return key, flags | FR.F_EXT, payload


class DeadLetterDriver:
    def __init__(self, broker: Any) -> None:
        self.b = broker
        self.pending: dict[tuple[str, int], Partition] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._logged: dict[str, float] = {}  # topic -> when its last failure was logged
        self._held_topics: set[str] = set()  # topics whose held gauge this worker set above zero
        # (topic, partition) -> held offset -> when it was first found with its count left out
        self._unwritten: dict[tuple[str, int], dict[int, float]] = {}
        m = metrics.get()
        self.m_dead = m.dead_lettered
        self.m_fail = m.dead_letter_failures
        self.m_held = m.dead_letter_held

    def start(self) -> None:
        self._task = self.b.loop.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def on_dead(self, p: Partition) -> None:
        """Partition hook: `p` holds an offset for the dead-letter topic."""
        self.pending[(p.topic, p.index)] = p
        self._wake.set()

    async def _run(self) -> None:
        wait = RETRY
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)
            self._wake.clear()
            try:
                await self.pass_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("dead-letter pass failed")
                self.b.task_failed("dead-letter driver")
            # holds whose count is not written yet: look again just after the committer's tick
            wait = UNWRITTEN_RECHECK if any(p.written_gen < max(p.dead.values(), default=0)
                                            for p in self.pending.values()) else RETRY

    async def pass_once(self) -> None:
        """Every partition holding records, side by side (one whose dead-letter owner
        does not answer does not hold up the others), then the held gauges."""
        live: list[Partition] = []
        for key, p in list(self.pending.items()):
            if not p.dead or p.closed or self.b.partitions.get(key) is not p:
                if self.pending.get(key) is p:
                    del self.pending[key]
                    self._unwritten.pop(key, None)
                continue
            live.append(p)
        res = await asyncio.gather(*(self._drain(p) for p in live if not p.frozen()), return_exceptions=True)
        for r in res:
            if isinstance(r, Exception):
                log.error("dead-letter drain failed", extra={"err": repr(r)})
        held: dict[str, int] = {}
        for p in live:
            key = (p.topic, p.index)
            if p.dead:
                held[p.topic] = held.get(p.topic, 0) + len(p.dead)
            elif self.pending.get(key) is p:
                del self.pending[key]
                self._unwritten.pop(key, None)
        for topic in self._held_topics - held.keys():
            self.m_held.labels(topic).set(0)
        for topic, n in held.items():
            self.m_held.labels(topic).set(n)
        self._held_topics = set(held)

    def _failed(self, topic: str, n: int, why: str) -> None:
        self.m_fail.labels(topic).inc()
        now = time.monotonic()
        if now - self._logged.get(topic, -LOG_EVERY) >= LOG_EVERY:
            self._logged[topic] = now
            log.warning("records past max_deliveries are held: the dead-letter commit failed; retrying",
                        extra={"topic": topic, "records": n, "err": why})

    async def _drain(self, p: Partition) -> None:
        b = self.b
        t = b.store.topic(p.topic)
        if t is None or t.id != p.topic_id:
            return  # the topic watch retires the partition
        keep = finish_keep(b.store, p)  # sent, the settle maybe not on disk: their move is finished
        finishing = False
        if t.max_deliveries <= 0 or not t.dead_letter_topic:
            # Lifted: what is held goes out again, except what was sent to a dead-letter
            # topic that still exists (``Partition.follow_max``): finished into that one.
            p.max_deliveries = 0
            if p.release_dead(keep=keep) and p.on_released is not None:
                p.on_released(p)
            fin = b.store.topic(p.dlq_target[0]) if keep and p.dlq_target is not None else None
            if fin is None or p.dead.keys().isdisjoint(keep):
                return
            dlt = fin
            finishing = True
        else:
            maxd = t.max_deliveries
            if any(p.deliveries.get(o, 0) < maxd for o in p.dead
                   if o not in p.dead_flight and o not in p.marked and o not in keep):
                # Held below the maximum: a raise found them on their way to the dead-letter
                # topic and that commit failed; they go out again now, as the raise let go of
                # the rest (``Broker._delivery_settings``). A marked or sent one stays held.
                if p.release_dead(maxd, keep) and p.on_released is not None:
                    p.on_released(p)
                if not p.dead:
                    return
            dlt = b.store.topic(t.dead_letter_topic)
            if dlt is None:
                self._failed(t.name, len(p.dead), f'dead-letter topic "{t.dead_letter_topic}" does not exist')
                return
        if b.security and not G.may_dead_letter(b.store.user, t, dlt):
            # written on the owner's behalf: a grant taken away (or the name now another's topic) holds them
            self._failed(t.name, len(p.dead), f'the owner of "{t.name}" ("{t.owner}") may not produce to its '
                                              f'dead-letter topic "{dlt.name}" (no produce grant there)')
            return
        # only holds whose count is in the offset file already (a kill -9 after the
        # dead-letter commit must not find a lower count and deliver the record again)
        flight = p.dead_flight
        # (nor, for UNWRITTEN_GRACE, one whose count did not fit in the offset file's slot:
        # held records' counts are the last left out, so that takes more held records than
        # the slot has room for after its acks; past the grace it goes, logged, rather
        # than hold the partition for good)
        unwritten = p.counts_unwritten
        waiting = self._unwritten.setdefault((p.topic, p.index), {})
        now = time.monotonic()
        for o in [o for o in waiting if o not in unwritten or o not in p.dead]:
            del waiting[o]
        late = 0
        for o in unwritten:
            if o in p.dead:
                since = waiting.setdefault(o, now)
                late += now - since >= UNWRITTEN_GRACE
        if late and now - self._logged.get(f"{t.name}\0unwritten", -LOG_EVERY) >= LOG_EVERY:
            self._logged[f"{t.name}\0unwritten"] = now
            log.warning("dead-lettering records whose delivery count is not in the offset file (its slot is "
                        "full): a kill -9 before their settle is written can deliver them again from the source",
                        extra={"topic": t.name, "partition": p.index, "records": late})
        offs = heapq.nsmallest(BATCH, (o for o, g in p.dead.items()
                                       if g <= p.written_gen and o not in flight
                                       and (not finishing or o in keep)
                                       and (o not in unwritten or now - waiting.get(o, now) >= UNWRITTEN_GRACE)))
        groups: dict[int, list[list[tuple[int, tuple[bytes | None, int, bytes]]]]] = {}
        sizes: dict[int, int] = {}  # the bytes of each partition's last chunk
        total = 0
        for off in offs:
            if total >= PASS_BYTES:
                self._wake.set()  # the rest at once, in the next pass
                break
            try:
                rec = p.log.read(off)
            except OffsetGone:
                p.dead.pop(off, None)  # retention passed it: the next reserve moves the frontier (a counted loss)
                heapq.heappush(p._redeliver, off)
                continue
            except CorruptRecord:
                p.dead.pop(off, None)
                p._settle_unreadable(off)
                continue
            except (LogClosed, NotVisible):
                return
            out = dead_letter_record(p.topic, p.index, off, p.deliveries.get(off, 0), p.reasons.get(off), rec,
                                     p.topic_id, dlt.id)
            dp = b.choose_partition(dlt, out[0])
            n = len(out[2]) + len(out[0] or b"") + 64
            total += n
            chunks = groups.setdefault(dp, [])
            if not chunks or (chunks[-1] and sizes[dp] + n > COMMIT_BYTES):
                chunks.append([])  # (a record over the bound goes alone)
                sizes[dp] = 0
            chunks[-1].append((off, out))
            sizes[dp] += n
        if not groups:
            return
        # In flight from here to the settle (a lift or a raise meanwhile leaves them held:
        # ``Partition.release_dead``), the wait for the target file included.
        if p.closed:
            return
        sending = [off for chunks in groups.values() for recs in chunks for off, _ in recs]
        flight.update(sending)
        target = (dlt.name, dlt.id)
        if p.dlq_target != target or not p.dlq_sent.issuperset(sending):
            # Named durably before any copy can be there: a restart (or a lift) that finds
            # these records held finishes their move into this topic. Offsets sent before
            # stay listed while a load could still find them marked (their settle not on
            # disk), whatever topic they went to (now finished into this one: at least once
            # into a dead-letter topic, never live in the source); the rest are dropped.
            live = p.dead.keys() | p.marked | flight | p.offsets.marks_recoverable()
            sent = {o for o in p.dlq_sent if o in live}
            sent.update(sending)
            try:
                await b.loop.run_in_executor(b.io, write_target, p.log.dir, *target, sorted(sent))
            except OSError as e:
                flight.difference_update(sending)
                self._failed(t.name, len(sending), f"could not write {TARGET_FILE}: {e}")
                return
            except BaseException:
                flight.difference_update(sending)
                raise
            p.dlq_target, p.dlq_sent = target, sent
            if p.closed:
                flight.difference_update(sending)
                return

        async def one(dp: int, recs: list[tuple[int, tuple[bytes | None, int, bytes]]]) -> None:
            # (in flight since before the target write; dropped from it here whatever happens)
            try:
                try:
                    await b.commit_to(dlt, dp, [r for _, r in recs])
                except Exception as e:
                    self._failed(t.name, len(recs), str(e) or type(e).__name__)
                    return
                if HOLD_SETTLE:
                    log.info("dead-letter commit done; holding the source settle (test seam)",
                             extra={"topic": t.name, "partition": p.index, "records": len(recs)})
                    await asyncio.sleep(HOLD_SETTLE)
                if p.closed or b.partitions.get((p.topic, p.index)) is not p:
                    return  # closed meanwhile: its count is on disk, the next owner dead-letters it again
                n = sum(1 for off, _ in recs if p.settle_dead(off))
                self.m_dead.labels(t.name).inc(n)
            finally:
                flight.difference_update(off for off, _ in recs)

        await asyncio.gather(*(one(dp, recs) for dp, chunks in groups.items() for recs in chunks))
