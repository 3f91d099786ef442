"""The fan-out engine: copies every committed parent record into every child.

Runs in every worker, for the parent partitions that worker owns
(``Broker.owned``): one cursor task per (parent partition, child).

* **Reconciler** (every 1 s; only a look at the topics, assignments and FSM
  epoch version slots while none moved, a full pass at least every 30 s and
  after any cursor exits): desired cursors = links x owned parent partitions,
  against the running ones. A cursor whose link, epoch or ownership changed is
  stopped; when its link is gone (detach, child deleted or re-linked) it asks
  the leader and deletes its own file only on a definite "not linked". Before
  it starts any cursor it asks the supervisor whether this node's replica is
  provably current (``CaughtUpReq``; and, once per worker life, that the node
  reported ready, i.e. its FSM reached the commit index saved on its disk) and
  reads the desired set again after the answer: nothing starts from a stale view
  (lifecycle seed, chaos bug 2).
* **Position**: the cursor file (``narad.storage.cursor_file``) of the cursor's
  own attach epoch is resumed. Anything else (no file, another epoch's, a
  corrupt one) means anchoring, the one destructive step: only after the
  leader confirms the epoch (``ConfirmEpochReq``: barrier and re-read there),
  at the attach point (``attach_offsets[p]``, 0 for a partition added later).
  A file of another epoch is never resumed; files are deleted only by the
  cursor of their own epoch.
* **Slab**: committed records (below the high watermark) from the parent log,
  up to ``max_batch_records`` / ``max_batch_bytes``, read in steps of at most
  512 records / 512 KiB with the event loop served between them, topped up for
  ``linger_ms``; a caught-up cursor long-polls up to 1 s, woken at once by the
  owner's commit (``Broker._on_visible``) and touching nothing while it waits
  (an idle parent log may close; a commit reopens it and wakes the cursor).
* **Re-key**: keyed records go to ``key_partition(key, child.partitions)``;
  keyless ones keep the parent partition index when the counts match, else
  go round-robin per child. (Until 2026-12-07 a keyless record with an
  idempotency key went by that key; copies carry no key, so nothing in the
  child ever dropped a second copy, and a record read from the owner's memory
  right after a one-pass idempotent batch's commit is its body alone, without
  the block that held the key.) Buckets are committed concurrently (at most 16 in
  flight) with ``Broker.commit_to`` (local, another worker, or node RPC), key
  and flags kept. Only when every bucket was acknowledged does the cursor
  file advance (in place). A failed bucket is kept (only its records), retried
  after 1 s under the current child record (same epoch, else the cursor stops);
  a dead child owner stalls its bucket, never rerouted.
* **Delay child**: only records with committed-at < now - delay, both in
  whole ms (this owner's wall clock, never stepping back within the process;
  strict, so a commit stamp rounded down never opens early); the read stops
  at the first record not due and the cursor sleeps until it is due (at most
  30 s): an idle delay cursor costs O(1) whatever its backlog.
* **Drop-behind**: a cursor below the parent's oldest retained offset skips to
  it and counts the loss (``narad_fanout_child_dropped_messages``), as are
  parent records that cannot be read back intact.

Imports narad.storage, narad.meta (read side and request types), narad.broker
(routing, partition), narad.metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from narad import metrics
from narad.broker.routing import RoundRobin, key_partition
from narad.meta import versions as V
from narad.meta.records import TopicRecord
from narad.meta.requests import ConfirmEpochReq, ConfirmEpochResp
from narad.storage import cursor_file as CF
from narad.storage.frames import F_EXT, without_idem
from narad.storage.partition_log import BatchRead, LogClosed, OffsetGone

if TYPE_CHECKING:
    from concurrent.futures import Executor
    from pathlib import Path

    from narad.broker.partition import Partition
    from narad.meta.store import MetaStore


class Broker(Protocol):
    """What the engine uses of its worker's broker (narad.broker.broker.Broker
    satisfies it; a Protocol keeps the import one-way: broker -> fanout)."""

    data_dir: Path
    io: Executor
    loop: asyncio.AbstractEventLoop
    store: MetaStore
    versions: V.VersionTable
    partitions: dict[tuple[str, int], Partition]

    def owned(self, t: TopicRecord) -> list[int]: ...

    async def partition(self, topic: TopicRecord, index: int) -> Partition: ...

    def partition_count(self, topic: str, topic_id: str) -> int: ...

    async def stats_owned(self, t: TopicRecord, parts: list[int]) -> dict[int, dict[str, int]]: ...

    async def commit_to(self, t: TopicRecord, partition: int,
                        records: list[tuple[bytes | None, int, bytes]]) -> int: ...

log = logging.getLogger("narad.broker.fanout")

RECONCILE_EVERY = 1.0
FULL_PASS_EVERY = 30.0
LONG_POLL = 1.0
RETRY_BACKOFF = 1.0
COMMITS_IN_FLIGHT = 16
DUE_WAKE_CAP = 30.0
WARN_EVERY = 30.0
STOP_WAIT = 5.0
# A slab (up to max_batch_records / max_batch_bytes) is read in steps of at most
# this much, the event loop served between them.
READ_STEP_RECORDS = 512
READ_STEP_BYTES = 512 << 10

RecordTuple = tuple[bytes | None, int, bytes]  # key, flags, payload


def _without_idem(recs: list[RecordTuple]) -> list[RecordTuple]:
    """The copies of `recs` as a child commits them: without their idempotency keys
    (``without_idem``); the list itself when no record has an extension block."""
    if not any(r[1] & F_EXT for r in recs):
        return recs
    return [(k, *without_idem(f, pl)) if f & F_EXT else (k, f, pl) for k, f, pl in recs]


@dataclass(frozen=True)
class FanoutSettings:
    max_batch_records: int = 4096
    max_batch_bytes: int = 4 << 20
    linger_ms: int = 25


@dataclass(frozen=True)
class LinkSpec:
    """One cursor's identity: which parent partition, which child incarnation,
    under which attach epoch; `start` is the attach point of this partition."""

    parent: str
    parent_id: str
    partition: int
    child: str
    child_id: str
    epoch: str
    delay_ms: int
    start: int


class _Unlinked(Exception):
    """The link this cursor copies for is no longer current here."""


def linked(child: TopicRecord | None, spec: LinkSpec) -> bool:
    return (child is not None and child.id == spec.child_id and child.parent == spec.parent
            and child.parent_id == spec.parent_id and child.attach_epoch == spec.epoch)


class FanoutEngine:
    def __init__(self, broker: Broker, settings: FanoutSettings,
                 caught_up: Callable[[], Awaitable[bool]] | None,
                 confirm_epoch: Callable[[ConfirmEpochReq], Awaitable[ConfirmEpochResp]] | None) -> None:
        self.b = broker
        self.settings = settings
        self._caught_up = caught_up
        self._confirm_epoch = confirm_epoch
        self.cursors: dict[tuple[str, int, str], Cursor] = {}
        # (parent, partition) -> cursors reading it: a commit there wakes them
        self.by_part: dict[tuple[str, int], dict[str, Cursor]] = {}
        self._retiring: dict[tuple[str, int, str], asyncio.Task[None]] = {}
        self._seen: tuple[int, int, int] | None = None
        self._last_full = float("-inf")
        self._force = True
        self._task: asyncio.Task[None] | None = None
        self._stale_logged = 0.0
        # Defence in depth beside CaughtUpReq: no cursor starts before this node was ready
        # once (its FSM applied the commit index saved on its disk). Right after a restart a
        # leader's in-memory commit index may still trail what it had committed before.
        self._ready_seen = False
        self._failed: dict[tuple[str, int, str], float] = {}  # when each key's cursor last failed (logged)
        self._noted: dict[tuple[tuple[str, int, str], str], float] = {}  # (key, what) -> last logged
        self.rr = RoundRobin()
        self.m = metrics.get()

    @property
    def enabled(self) -> bool:
        return self._caught_up is not None and self._confirm_epoch is not None

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        if self.enabled and self._task is None:
            self._task = self.b.loop.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        tasks = [c.task for c in self.cursors.values() if c.task is not None]
        tasks += list(self._retiring.values())
        for c in list(self.cursors.values()):
            c.cancel()
        if tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait(tasks, timeout=STOP_WAIT)
        self.cursors.clear()
        self.by_part.clear()

    def on_visible(self, p: Partition) -> None:
        """Records became visible in a parent partition: wake its cursors."""
        cs = self.by_part.get((p.topic, p.index))
        if cs:
            for c in cs.values():
                c.wake()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(RECONCILE_EVERY)
            try:
                await self.reconcile()
            except Exception:
                self._force = True
                log.exception("fan-out reconcile pass failed; next pass in a second")
                self.b.task_failed("fan-out")

    def worth_logging(self, key: tuple[str, int, str], what: str) -> bool:
        """Whether a cursor of `key` should log `what` now: twice a minute at most per
        key, across restarts (a cursor failing at every start meets the same thing each
        second)."""
        now = time.monotonic()
        if now - self._noted.get((key, what), float("-inf")) < WARN_EVERY:
            return False
        if len(self._noted) > 10_000:
            self._noted.clear()
        self._noted[(key, what)] = now
        return True

    # ---- the leader and the replica -----------------------------------------------------
    async def caught_up(self) -> bool:
        if self._caught_up is None:
            return False
        try:
            return bool(await self._caught_up())
        except Exception as e:
            log.debug("could not ask the supervisor whether the replica is current", extra={"err": str(e)})
            return False

    async def confirm(self, spec: LinkSpec) -> ConfirmEpochResp:
        """The leader's word on the link (anything short of an answer: unknown)."""
        if self._confirm_epoch is None:
            return ConfirmEpochResp(False, False)
        try:
            return await self._confirm_epoch(ConfirmEpochReq(spec.parent, spec.parent_id, spec.child,
                                                             spec.child_id, spec.epoch))
        except Exception as e:
            log.debug("could not confirm a fan-out epoch with the leader", extra={"err": str(e)})
            return ConfirmEpochResp(False, False)

    # ---- reconcile ----------------------------------------------------------------------
    def desired(self) -> dict[tuple[str, int, str], LinkSpec]:
        """Every (parent partition this worker owns, child) linked in the local replica."""
        store = self.b.store
        with store.read() as r:
            topics = r.topics()
        by_name = {t.name: t for t in topics}
        out: dict[tuple[str, int, str], LinkSpec] = {}
        for c in topics:
            if c.parent is None or not c.attach_epoch:
                continue
            par = by_name.get(c.parent)
            if par is None or par.id != c.parent_id or c.name not in par.children:
                continue
            for i in self.b.owned(par):
                start = c.attach_offsets[i] if i < len(c.attach_offsets) else 0
                out[(par.name, i, c.name)] = LinkSpec(par.name, par.id, i, c.name, c.id, c.attach_epoch,
                                                      c.delay_ms, start)
        return out

    async def reconcile(self) -> None:
        vs = self.b.versions
        sig = (vs.load(V.TOPICS), vs.load(V.ASSIGNMENTS), vs.load(V.EPOCH))
        now = time.monotonic()
        if not self._force and sig == self._seen and now - self._last_full < FULL_PASS_EVERY:
            return
        self._force = False
        want = self.desired()
        for key, c in list(self.cursors.items()):
            if want.get(key) != c.spec:
                self._stop(key, c)
        if any(k not in self.cursors for k in want):
            if not self._ready_seen and vs.load(V.READY) == 1:
                self._ready_seen = True  # the node's startup rule passed: its FSM reached its own commit index
            if not self._ready_seen or not await self.caught_up():
                # Never start a cursor from a view that may be stale: ask again next second.
                self._force = True
                if now - self._stale_logged > WARN_EVERY:
                    self._stale_logged = now
                    log.info("fan-out cursors wait for a provably current metastore replica")
                return
            want = self.desired()  # what the replica says now that it is current
            for key, spec in want.items():
                if key not in self.cursors:
                    self._start(key, spec)
        self._seen = sig
        self._last_full = now

    def _start(self, key: tuple[str, int, str], spec: LinkSpec) -> None:
        d = partition_dir(self.b.data_dir, spec.parent, spec.parent_id, spec.partition)
        c = Cursor(self, spec, CF.CursorFile(d, spec.child), self._retiring.get(key))
        self.cursors[key] = c
        self.by_part.setdefault((spec.parent, spec.partition), {})[spec.child] = c
        c.task = self.b.loop.create_task(c.run())
        c.task.add_done_callback(lambda _t, key=key, c=c: self._exited(key, c))
        # A restart of a cursor that failed lately is not news (its failure is logged twice a
        # minute): one line a second per failing cursor would bury the log.
        failed = time.monotonic() - self._failed.get(key, float("-inf")) < WARN_EVERY
        log.log(logging.DEBUG if failed else logging.INFO, "fan-out cursor started",
                extra={"parent": spec.parent, "partition": spec.partition, "child": spec.child,
                       "epoch": spec.epoch})

    def _forget(self, key: tuple[str, int, str], c: Cursor) -> None:
        if self.cursors.get(key) is c:
            del self.cursors[key]
        pk = (c.spec.parent, c.spec.partition)
        cs = self.by_part.get(pk)
        if cs is not None and cs.get(c.spec.child) is c:
            del cs[c.spec.child]
            if not cs:
                del self.by_part[pk]
        if key not in self.cursors:  # a successor of the same key keeps the series
            c.clear_gauges()

    def _exited(self, key: tuple[str, int, str], c: Cursor) -> None:
        mine = self.cursors.get(key) is c  # False: stopped by the reconciler (which saw to its file)
        self._forget(key, c)
        self._force = True  # a full pass after any cursor exit
        if c.task.cancelled():
            return
        e = c.task.exception()
        if isinstance(e, _Unlinked):
            if mine:  # it noticed the link change before the reconciler did
                self._maybe_retire(key, c)
        elif e is not None:
            now = time.monotonic()
            if now - self._failed.get(key, float("-inf")) >= WARN_EVERY:  # a failure loop logs twice a minute
                if len(self._failed) > 10_000:
                    self._failed.clear()
                self._failed[key] = now
                log.error("fan-out cursor failed; the reconciler restarts it", extra={
                    "parent": c.spec.parent, "partition": c.spec.partition, "child": c.spec.child,
                    "err": repr(e)})

    def _stop(self, key: tuple[str, int, str], c: Cursor) -> None:
        """Stop a cursor whose link, epoch or ownership changed. When its link is gone
        (not just moved away), its own file is deleted once the leader says so."""
        self._forget(key, c)
        c.cancel()
        self._maybe_retire(key, c)

    def _maybe_retire(self, key: tuple[str, int, str], c: Cursor) -> None:
        spec = c.spec
        par = self.b.store.topic(spec.parent)
        gone = not linked(self.b.store.topic(spec.child), spec)
        log.info("fan-out cursor stopped", extra={"parent": spec.parent, "partition": spec.partition,
                                                  "child": spec.child, "epoch": spec.epoch,
                                                  "link_gone": gone})
        if gone and par is not None and par.id == spec.parent_id and key not in self._retiring:
            t = self.b.loop.create_task(c.retire())
            self._retiring[key] = t
            t.add_done_callback(lambda _t, key=key: self._retired(key, _t))

    def _retired(self, key: tuple[str, int, str], t: asyncio.Task[None]) -> None:
        if self._retiring.get(key) is t:
            del self._retiring[key]
        if not t.cancelled() and t.exception() is not None:
            log.warning("fan-out cursor file not removed", extra={"key": list(key), "err": repr(t.exception())})

    # ---- lag ------------------------------------------------------------------------------
    async def lag_owned(self, parent: TopicRecord, parts: list[int]) -> dict[str, dict[int, int]]:
        """child -> {parent partition: parent hwm - cursor} for partitions this worker
        owns. Never opens a log (stats of a closed partition come from its files); a
        cursor not running here is read from its file, else the attach point."""
        store = self.b.store
        children = [c for n in parent.children if (c := store.topic(n)) is not None
                    and c.parent == parent.name and c.parent_id == parent.id and c.attach_epoch]
        if not children or not parts:
            return {}
        stats = await self.b.stats_owned(parent, parts)
        pos: dict[tuple[str, int], int] = {}
        cold: list[tuple[str, int, str, int]] = []
        for c in children:
            for i in parts:
                cur = self.cursors.get((parent.name, i, c.name))
                if cur is not None and cur.spec.epoch == c.attach_epoch and cur.next >= 0:
                    pos[(c.name, i)] = cur.next
                else:
                    start = c.attach_offsets[i] if i < len(c.attach_offsets) else 0
                    cold.append((c.name, i, c.attach_epoch or "", start))
        if cold:
            pos.update(await self.b.loop.run_in_executor(self.b.io, self._read_positions, parent, cold))
        out: dict[str, dict[int, int]] = {}
        for c in children:
            row = out[c.name] = {}
            for i in parts:
                st = stats.get(i)
                if st is None:
                    continue
                row[i] = max(0, st["high_watermark"] - pos[(c.name, i)])
        return out

    def _read_positions(self, parent: TopicRecord, cold: list[tuple[str, int, str, int]]
                        ) -> dict[tuple[str, int], int]:
        out = {}
        for child, i, epoch, start in cold:
            at = start
            try:
                st = CF.CursorFile(partition_dir(self.b.data_dir, parent.name, parent.id, i), child).read()
                if st is not None and st.epoch == epoch:
                    at = st.next_offset
            except (OSError, CF.CursorCorrupt):
                pass
            out[(child, i)] = at
        return out


def delay_bound(now_ms: int, delay_ms: int) -> int:
    """The latest committed-at (ms) a delay child may copy at `now_ms`.

    Commit stamps are whole milliseconds rounded down, so a record stamped C was
    committed somewhere in [C, C+1) ms: it is due only once `now_ms` reaches
    C + delay + 1, never up to a millisecond before its commit + delay."""
    return now_ms - delay_ms - 1


def due_in_ms(committed_ms: int, delay_ms: int, now_ms: int) -> int:
    """Milliseconds until a record stamped `committed_ms` passes ``delay_bound``."""
    return committed_ms + delay_ms + 1 - now_ms


class Cursor:
    """Copies one parent partition into one child, under one attach epoch."""

    def __init__(self, engine: FanoutEngine, spec: LinkSpec, file: CF.CursorFile,
                 after: asyncio.Task[None] | None) -> None:
        self.e = engine
        self.b = engine.b
        self.spec = spec
        self.file = file
        self._after = after  # the retirement of this key's previous cursor: its file goes first
        self.task: asyncio.Task[None] = None  # type: ignore[assignment]
        self.next = -1  # next parent offset to copy (-1: not positioned yet)
        self.durable = -1  # what the file says
        self._woken = False
        self._waiter: asyncio.Future[bool] | None = None
        self._last_ms = 0
        self._warned = 0.0
        s = engine.settings
        self.max_records = s.max_batch_records
        self.max_bytes = s.max_batch_bytes
        self.linger = s.linger_ms / 1000.0
        self._labels = (spec.parent, spec.child, str(spec.partition))
        self.key = (spec.parent, spec.partition, spec.child)
        self._io_fut: asyncio.Future[Any] | None = None  # the file operation in flight (one at a time)
        self._committed = engine.m.fanout_committed.labels(spec.parent, spec.child)
        self._dropped = engine.m.fanout_dropped.labels(spec.parent, spec.child)

    def wake(self) -> None:
        self._woken = True
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(True)

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def _set_lag(self, value: float) -> None:
        self.e.m.fanout_lag.labels(*self._labels).set(value)

    def _set_due(self, value: float) -> None:
        self.e.m.fanout_due_lag.labels(*self._labels).set(value)

    def clear_gauges(self) -> None:
        self.e.m.fanout_lag.children.pop(self._labels, None)
        self.e.m.fanout_due_lag.children.pop(self._labels, None)

    def _now_ms(self) -> int:
        now = int(time.time() * 1000)
        if now < self._last_ms:
            now = self._last_ms  # the delay gate never steps back with the wall clock
        self._last_ms = now
        return now

    def _warn(self, msg: str, **extra: Any) -> None:
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY:
            self._warned = now
            s = self.spec
            log.warning(msg, extra={"parent": s.parent, "partition": s.partition, "child": s.child, **extra})

    async def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A file operation on an I/O thread. A cancelled caller does not stop the
        thread: the descriptor is closed only once it finished (see run)."""
        fut = self.b.loop.run_in_executor(self.b.io, fn, *args)
        self._io_fut = fut
        return await fut

    async def _io_done(self) -> None:
        f = self._io_fut
        if f is not None and not f.done():
            with contextlib.suppress(BaseException):
                await asyncio.shield(f)

    # ---- records of the link --------------------------------------------------------------
    def _parent_rec(self) -> TopicRecord:
        t = self.b.store.topic(self.spec.parent)
        if t is None or t.id != self.spec.parent_id:
            raise _Unlinked("parent gone")
        return t

    def _child_rec(self) -> TopicRecord:
        c = self.b.store.topic(self.spec.child)
        if not linked(c, self.spec):
            raise _Unlinked("link gone")
        assert c is not None
        return c

    def _open_parent(self) -> Partition | None:
        """The parent partition if it is open here (nothing opened, nothing stamped)."""
        p = self.b.partitions.get((self.spec.parent, self.spec.partition))
        if p is not None and p.topic_id == self.spec.parent_id and not p.closed:
            return p
        return None

    # ---- the cursor loop --------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._position()
            await self._copy()
        finally:
            f = self._io_fut
            if f is not None and not f.done():
                # Never close a descriptor under a write still running on its thread (a
                # reused number would take the bytes): close once it finished.
                f.add_done_callback(lambda _f: self.file.close())
            else:
                self.file.close()

    async def _position(self) -> None:
        if self._after is not None and not self._after.done():
            with contextlib.suppress(BaseException):
                await asyncio.shield(self._after)
        spec = self.spec
        # The parent partition is opened first: its directory (where the file lives)
        # exists from then on, made by the log's own open (never by the cursor).
        par = await self.b.partition(self._parent_rec(), spec.partition)
        try:
            st = await self._io(self.file.read)
        except CF.CursorCorrupt as e:
            if self.e.worth_logging(self.key, "corrupt"):
                log.error("fan-out cursor file is corrupt; re-anchoring at the attach point once the leader "
                          "confirms the epoch (duplicates, never a gap)",
                          extra={"parent": spec.parent, "partition": spec.partition, "child": spec.child,
                                 "err": str(e)})
            st = None
        if st is not None and st.epoch == spec.epoch:
            self.next = self.durable = st.next_offset
            # The log as opened above, even if it closed while the file was read (idle
            # eviction: its end is the one at the close); a reopened one is looked at too.
            end = par.log.next_offset
            p = self._open_parent()
            if p is not None:
                end = max(end, p.log.next_offset)
            if self.next > end:
                # Past anything the log holds (damage): re-copy from its end rather than skip
                # whatever is committed at those offsets later (duplicates, never a gap).
                if self.e.worth_logging(self.key, "past-end"):
                    log.error("fan-out cursor file is past the end of the parent log; resuming at its end",
                              extra={"parent": spec.parent, "partition": spec.partition, "child": spec.child,
                                     "file": self.next, "log_end": end})
                self.next = end
            return
        # Anchoring: the only destructive step (it overwrites whatever file is there).
        # Only on the leader's word that this epoch is the live link.
        while True:
            self._child_rec()
            resp = await self.e.confirm(spec)
            if resp.known and resp.linked:
                break
            if resp.known:
                raise _Unlinked("the leader says this epoch is not linked")
            self._warn("fan-out cursor waits for the leader to confirm its attach epoch before anchoring",
                       epoch=spec.epoch)
            await asyncio.sleep(RETRY_BACKOFF)
        await self._io(self.file.anchor, spec.epoch, spec.start)
        self.next = self.durable = spec.start
        log.info("fan-out cursor anchored", extra={"parent": spec.parent, "partition": spec.partition,
                                                   "child": spec.child, "epoch": spec.epoch,
                                                   "next_offset": spec.start,
                                                   "replaced": None if st is None else st.epoch})

    async def _copy(self) -> None:
        read_now = True
        while True:
            if not read_now:
                woken = await self._wait(LONG_POLL)
                if not woken:
                    p = self._open_parent()
                    # Closed: nothing can have been committed (a commit opens it and wakes us).
                    if p is None or p.log.hwm <= self.next:
                        if p is not None:
                            self._gauges(p.log.hwm, None)
                        continue
            self._woken = False
            self._child_rec()
            p = await self.b.partition(self._parent_rec(), self.spec.partition)
            batch = await self._read(p)
            if batch is None:
                read_now = True  # skipped ahead (drop-behind) or the log was closed: read again
                continue
            if not batch.records:
                if batch.next_offset != self.next:  # only unreadable records: skipped and counted
                    self.next = batch.next_offset
                    await self._persist()
                if batch.not_due_ms is not None:
                    await self._sleep_until_due(batch.not_due_ms)
                    read_now = True
                else:
                    read_now = p.log.hwm > self.next  # skipped unreadable ones: read on at once
                continue
            await self._commit(batch)
            self.next = batch.next_offset
            await self._persist()
            self._committed.inc(len(batch.records))
            self._gauges(p.log.hwm, None)
            # More left (a cap hit, or due records behind a gate just passed): at once.
            read_now = batch.not_due_ms is not None or p.log.hwm > self.next

    async def _wait(self, timeout: float) -> bool:
        """Until woken (a commit to the parent partition) or `timeout`; True if woken."""
        if self._woken:
            return True
        loop = self.b.loop
        fut: asyncio.Future[bool] = loop.create_future()
        self._waiter = fut
        timer = loop.call_later(timeout, _resolve, fut, False)
        try:
            return await fut
        finally:
            timer.cancel()
            self._waiter = None

    async def _sleep_until_due(self, committed_ms: int) -> None:
        due_in = due_in_ms(committed_ms, self.spec.delay_ms, self._now_ms()) / 1000.0
        self._set_due(0.0)
        await asyncio.sleep(min(DUE_WAKE_CAP, max(0.001, due_in)))

    def _bound(self) -> int | None:
        return delay_bound(self._now_ms(), self.spec.delay_ms) if self.spec.delay_ms > 0 else None

    async def _read(self, p: Partition) -> BatchRead | None:
        """One slab from `next`: what is committed (and due), topped up for linger_ms.
        None: nothing to copy this time (skipped ahead, or the log closed under us)."""
        if p.closed:
            return None  # closing: its log is closed on an I/O thread from now on (never read it)
        try:
            batch = p.log.read_batch(self.next, min(self.max_records, READ_STEP_RECORDS),
                                     min(self.max_bytes, READ_STEP_BYTES), self._bound())
        except OffsetGone as e:
            lost = e.oldest - self.next
            if lost > 0:
                self._dropped.inc(lost)
                log.warning("fan-out cursor fell behind parent retention; skipped to the oldest retained "
                            "offset (records lost to the child)",
                            extra={"parent": self.spec.parent, "partition": self.spec.partition,
                                   "child": self.spec.child, "lost": lost, "oldest": e.oldest})
                self.next = e.oldest
                await self._persist()
            return None
        except LogClosed:
            return None
        if batch.corrupt:
            self._dropped.inc(batch.corrupt)
        if batch.records:
            first = batch.records[0][1]
            self._set_due(max(0, self._now_ms() - first - self.spec.delay_ms) / 1000.0)
        if not batch.records or batch.not_due_ms is not None:
            return batch
        loop = self.b.loop
        deadline = loop.time() + self.linger
        while len(batch.records) < self.max_records and batch.nbytes < self.max_bytes:
            if p.closed:
                break
            if p.log.hwm <= batch.next_offset:
                left = deadline - loop.time()
                if left <= 0:
                    break
                self._woken = False
                await self._wait(left)
                continue
            # Committed records wait: the next step, once the loop served the others (a
            # whole slab decoded in one go holds the worker's loop for tens of ms).
            await asyncio.sleep(0)
            if p.closed:
                break
            try:
                more = p.log.read_batch(batch.next_offset,
                                        min(READ_STEP_RECORDS, self.max_records - len(batch.records)),
                                        min(READ_STEP_BYTES, self.max_bytes - batch.nbytes), self._bound())
            except (OffsetGone, LogClosed):
                break
            if more.records and batch.nbytes + more.nbytes > self.max_bytes:
                break  # read again with the next slab (its unreadable records counted then, once)
            if more.corrupt:
                self._dropped.inc(more.corrupt)
            batch.records.extend(more.records)
            batch.nbytes += more.nbytes
            batch.next_offset = more.next_offset
            if more.not_due_ms is not None:
                batch.not_due_ms = more.not_due_ms
                break
        return batch

    def _bucket(self, recs: list[RecordTuple], child: TopicRecord) -> dict[int, list[RecordTuple]]:
        n = child.partitions
        same = n == self.b.partition_count(self.spec.parent, self.spec.parent_id)
        out: dict[int, list[RecordTuple]] = {}
        for r in recs:
            key = r[0]
            if key:
                cp = key_partition(key, n)
            elif same:
                cp = self.spec.partition
            else:
                cp = self.e.rr.pick(child.name, n)
            b = out.get(cp)
            if b is None:
                out[cp] = [r]
            else:
                b.append(r)
        return out

    async def _commit(self, batch: BatchRead) -> None:
        """Commit the slab at the child partitions; returns once every bucket was
        acknowledged. Failed buckets alone are retried (1 s backoff, the link checked
        again each time); a dead owner stalls its bucket here."""
        pending: list[RecordTuple] = [(k, f, pl) for k, _ts, f, pl in batch.records]
        sem = asyncio.Semaphore(COMMITS_IN_FLIGHT)
        while True:
            child = self._child_rec()
            buckets = self._bucket(pending, child)

            async def one(cp: int, recs: list[RecordTuple], child: TopicRecord = child) -> tuple[int, str] | None:
                async with sem:
                    try:
                        # A copy carries no idempotency key: the parent decided what it holds, and
                        # the child's own table (another window) must not drop any of it.
                        await self.b.commit_to(child, cp, _without_idem(recs))
                        return None
                    except Exception as e:
                        return cp, str(e) or type(e).__name__

            res = await asyncio.gather(*(one(cp, recs) for cp, recs in buckets.items()))
            failed = [r for r in res if r is not None]
            if not failed:
                return
            self._warn("fan-out copies not committed at a child partition; retrying those only",
                       failed=[cp for cp, _ in failed], err=failed[0][1])
            pending = [r for cp, _ in failed for r in buckets[cp]]
            # Stalled: keep the gauges moving (how far behind, and behind due, it falls).
            self._set_due(max(0, self._now_ms() - batch.records[0][1] - self.spec.delay_ms) / 1000.0)
            if (p := self._open_parent()) is not None:
                self._set_lag(max(0, p.log.hwm - self.next))
            await asyncio.sleep(RETRY_BACKOFF)

    async def _persist(self) -> None:
        if self.next == self.durable:
            return
        try:
            await self._io(self.file.advance, self.spec.epoch, self.next)
            self.durable = self.next
        except OSError as e:
            # Copies stay committed; the file lags (a crash re-copies: duplicates, never a gap).
            self._warn("could not advance a fan-out cursor file; retrying with the next slab", err=str(e))

    def _gauges(self, hwm: int, due_lag: float | None) -> None:
        self._set_lag(max(0, hwm - self.next))
        if hwm <= self.next:
            self._set_due(0.0)
        elif due_lag is not None:
            self._set_due(due_lag)

    # ---- retirement -------------------------------------------------------------------------
    async def retire(self) -> None:
        """After a stop because the link is gone: delete this epoch's file once the
        leader says definitely not linked (and only if the file is still ours)."""
        if self.task is not None and not self.task.done():
            with contextlib.suppress(BaseException):
                await asyncio.wait({self.task}, timeout=STOP_WAIT)
        await self._io_done()
        for _ in range(3):
            resp = await self.e.confirm(self.spec)
            if resp.known and resp.linked:
                return
            if resp.known:
                break
            await asyncio.sleep(RETRY_BACKOFF)
        else:
            return  # no definite answer: the file stays (a later anchor replaces it)
        await self._io(self._delete_if_ours)

    def _delete_if_ours(self) -> None:
        try:
            st = self.file.read()
        except CF.CursorCorrupt:
            return
        if st is None or st.epoch != self.spec.epoch:
            return
        self.file.delete()
        log.info("fan-out cursor file removed (link gone, confirmed by the leader)",
                 extra={"parent": self.spec.parent, "partition": self.spec.partition, "child": self.spec.child,
                        "epoch": self.spec.epoch})


def partition_dir(data_dir: Path, topic: str, topic_id: str, partition: int) -> Path:
    return data_dir / "topics" / f"{topic}@{topic_id}" / f"p{partition:05d}"


def _resolve(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():
        fut.set_result(value)
