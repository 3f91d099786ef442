"""The dispatcher: moves durable WAL records to their partition's owner.

Records arrive in WAL order (from the group commit, or from the WAL replay
after a restart). They queue per destination (topic, incarnation, partition);
each destination has at most one commit in flight, and whatever queued
meanwhile becomes its next batch. A record is *done* once its owner confirmed
the commit (durable, read back, visible), or once its topic incarnation is
confirmed gone (a leader-confirmed discard, logged). The checkpoint is the
first sequence number that is not done, so it never passes an uncommitted
record; the WAL stores it and reclaims segments below it.

A failing destination keeps its records (in order) and is retried every
second; nothing is discarded because the local replica lacks a topic: absence
must be confirmed by the supervisor (barrier + re-read on the leader). After
3 s of continuous failure, or at once when the owner is marked dead, queued
records reroute to the next partition upward (wrapping) whose owner is alive
and which is not failing itself; a failing owner keeps one record as its probe,
a dead one keeps none. A commit in flight is never rerouted. A record with an
idempotency key is never rerouted either: its key is checked at the partition it
was routed to (a retry lands there), so it waits for that owner. A keyless one placed
away from its key's partition (topic.idempotent_local_placement) is sent to that
partition when the node it was placed on may no longer commit it elsewhere (the
target answers ``Rehome`` instead of committing).

Idempotent produce: a produce with idempotency keys ``watch``es its entries
(seqs) after staging them; when their commit returns, the owner's duplicate
verdicts resolve the watch's future. Only watched entries cost anything: an
unwatched commit checks one empty dict.

Imports narad.storage.{wal,frames}; talks to the broker through a small interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from narad.storage import frames as FR
from narad.storage.wal import Entry, IngressWAL

log = logging.getLogger("narad.broker.dispatcher")

MAX_IN_FLIGHT = 16
REROUTE_AFTER = 3.0
BATCH_RECORDS = 4096
BATCH_BYTES = 8 << 20
RETRY_AFTER = 1.0
MOVING_RETRY_AFTER = 0.05  # a partition frozen for a move (its flip is a Raft round trip away)
TRUST_RECHECK = 0.05  # before the replica caught up once: looked at again after this
WATCH_SLACK = 0.05  # watch deadlines expire in 50 ms steps (one timer wake per step at most)


Committed = tuple[int, list[int]]  # the owner's first offset, indexes of the batch's duplicates


class Rehome:
    """``Target.deliver``'s answer when some entries of the batch must go to another
    partition first (nothing of the batch was committed): (index, partition) each. A
    keyless idempotent record the node placed away from its key's partition, on a node
    that may no longer commit it there (``Broker.rehome``)."""

    __slots__ = ("moved",)

    def __init__(self, moved: list[tuple[int, int]]) -> None:
        self.moved = moved


class Target(Protocol):
    async def deliver(self, topic: str, topic_id: str, partition: int, entries: list[Entry]
                      ) -> str | Committed | Rehome:
        """Commit at the owner. Returns "ok" or the owner's ``Committed`` (which
        records were duplicates of an idempotency key), "gone" (incarnation
        confirmed deleted: discard), a ``Rehome`` (nothing committed: these entries go
        elsewhere first) or raises to retry later."""
        ...

    def partition_count(self, topic: str, topic_id: str) -> int:
        """Partitions of this incarnation (0 if unknown here)."""
        ...

    def owner_alive(self, topic: str, topic_id: str, partition: int) -> bool:
        """False when the partition's owner is marked dead (or unassigned)."""
        ...

    def routes_trusted(self) -> bool:
        """False until this node's replica has caught up with the leader once since it
        started: a restart can find its replica behind a move's flip made while it was
        down, and nothing is dispatched by a route read from that replica."""
        ...


class _Group:
    __slots__ = ("last", "remaining")

    def __init__(self, last: int, remaining: int) -> None:
        self.last = last
        self.remaining = remaining


class Watch:
    """Verdicts for watched entries: ``dup[i]`` is True (dropped as a duplicate),
    False (committed) or None (not known yet; also for a discarded incarnation).
    ``done`` resolves once every entry has its verdict."""

    __slots__ = ("deadline", "done", "dup", "left", "seqs")

    def __init__(self, seqs: list[int], done: asyncio.Future[None], deadline: float) -> None:
        self.seqs = seqs
        self.dup: list[bool | None] = [None] * len(seqs)
        self.left = len(seqs)
        self.done = done
        self.deadline = deadline


def _pinned(e: Entry) -> bool:
    """A record with an idempotency key stays at its partition (never rerouted)."""
    return bool(e.flags & FR.F_EXT) and FR.has_idem(e.payload)


class _Dest:
    __slots__ = ("entries", "failing_since", "groups", "inflight", "kept", "probe_kept", "retry_at")

    def __init__(self) -> None:
        self.entries: deque[Entry] = deque()
        self.groups: deque[_Group] = deque()
        self.inflight = False
        self.retry_at = 0.0
        self.failing_since = 0.0
        self.kept = 0  # entries at the front the last reroute kept here (probe, pinned): not scanned again
        self.probe_kept = False  # the first of them is a failing owner's probe, not a pinned record


class Dispatcher:
    def __init__(self, wal: IngressWAL, target: Target) -> None:
        self.wal = wal
        self.target = target
        self._front: deque[_Group] = deque()
        self._dests: dict[tuple[str, bytes, int], _Dest] = {}
        self._inflight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self.discarded = 0
        self.committed = 0
        self.rerouted = 0
        self.rehomed = 0  # idempotent records sent to their key's partition (``_rehome``)
        self.closed = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._watched: dict[int, tuple[Watch, int]] = {}  # seq -> (watch, index in it)
        # Watch deadlines, in order (one timeout for all): one timer for them all, not one each.
        self._deadlines: deque[Watch] = deque()
        self._watch_timer: asyncio.TimerHandle | None = None
        # Called with a destination once nothing is queued or in flight for it (after a commit).
        self.on_drained: Callable[[tuple[str, bytes, int]], None] | None = None

    def watch(self, entries: list[Entry], timeout: float) -> Watch:
        """Follow these staged entries (their seqs are assigned) to their commit;
        ``done`` resolves when every verdict is in or `timeout` passed (the verdicts
        missing then stay None). The caller ``unwatch``es it."""
        loop = self._loop()
        w = Watch([e.seq for e in entries], loop.create_future(), time.monotonic() + timeout)
        for i, seq in enumerate(w.seqs):
            self._watched[seq] = (w, i)
        if not w.seqs:
            w.done.set_result(None)
            return w
        self._deadlines.append(w)
        if self._watch_timer is None:
            self._watch_timer = loop.call_at(loop.time() + timeout + WATCH_SLACK, self._expire_watches)
        return w

    def _expire_watches(self) -> None:
        self._watch_timer = None
        now = time.monotonic()
        dl = self._deadlines
        while dl and (dl[0].done.done() or dl[0].deadline <= now + WATCH_SLACK):
            w = dl.popleft()
            if not w.done.done():
                w.done.set_result(None)  # what is not in by now stays None (pending)
        if dl:
            loop = self._loop()
            self._watch_timer = loop.call_at(loop.time() + max(0.0, dl[0].deadline - now) + WATCH_SLACK,
                                             self._expire_watches)

    def unwatch(self, w: Watch) -> None:
        for seq in w.seqs:
            got = self._watched.get(seq)
            if got is not None and got[0] is w:
                del self._watched[seq]

    def _resolve(self, batch: list[Entry], dups: list[int] | None) -> None:
        """A watched entry's commit returned (dups None: discarded, no verdict)."""
        watched = self._watched
        dset = set(dups) if dups else ()
        for j, e in enumerate(batch):
            got = watched.pop(e.seq, None)
            if got is None:
                continue
            w, i = got
            w.dup[i] = (j in dset) if dups is not None else None
            w.left -= 1
            if w.left == 0 and not w.done.done():
                w.done.set_result(None)

    def _loop(self) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        return self.loop

    def feed(self, entries: list[Entry]) -> None:
        if not entries:
            return
        g = _Group(entries[-1].seq, len(entries))
        self._front.append(g)
        dests = self._dests
        # Runs of records bound for one destination (a batch, or a WAL group of keyless
        # records, is usually one run) are queued with one lookup and two C-level extends.
        n = len(entries)
        i = 0
        while i < n:
            e = entries[i]
            topic, inc, part = e.topic, e.incarnation, e.partition
            j = i + 1
            while j < n:
                f = entries[j]
                if f.partition != part or f.topic != topic or f.incarnation != inc:
                    break
                j += 1
            key = (topic, inc, part)
            d = dests.get(key)
            if d is None:
                d = dests[key] = _Dest()
            if j - i == 1:
                d.entries.append(e)
                d.groups.append(g)
            else:
                d.entries.extend(entries[i:j])
                d.groups.extend(itertools.repeat(g, j - i))
            i = j
        self._pump()

    def busy(self, key: tuple[str, bytes, int]) -> bool:
        """Records for this destination are queued here or in flight to it."""
        d = self._dests.get(key)
        return d is not None and (d.inflight or bool(d.entries))

    @property
    def backlog(self) -> int:
        return sum(len(d.entries) for d in self._dests.values())

    def _pump(self) -> None:
        if self.closed:
            return
        if not self.target.routes_trusted():
            if self._timer is None:
                self._timer = self._loop().call_later(TRUST_RECHECK, self._on_timer)
            return
        now = time.monotonic()
        soonest = None
        rerouted = False
        for key, d in list(self._dests.items()):
            if self._inflight >= MAX_IN_FLIGHT:
                break
            if d.inflight:
                continue
            if not d.entries:
                del self._dests[key]
                continue
            dead = not self.target.owner_alive(key[0], key[1].hex(), key[2])
            failing = d.failing_since and now - d.failing_since >= REROUTE_AFTER
            if (dead or failing) and self._reroute(key, d, probe=not dead):
                rerouted = True  # a dead or failing owner: its records go to a live sibling
                continue
            if d.retry_at > now:
                soonest = d.retry_at if soonest is None else min(soonest, d.retry_at)
                continue
            n, size = 0, 0
            for e in d.entries:
                if n >= BATCH_RECORDS or (n and size + len(e.payload) > BATCH_BYTES):
                    break
                n += 1
                size += len(e.payload)
            d.kept, d.probe_kept = 0, False
            batch = [d.entries.popleft() for _ in range(n)]
            groups = [d.groups.popleft() for _ in range(n)]
            d.inflight = True
            self._inflight += 1
            t = self._loop().create_task(self._commit(key, d, batch, groups))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        if rerouted:
            # The siblings that just received records may not have been visited in this pass.
            self._loop().call_soon(self._pump)
        if soonest is not None and self._timer is None:
            loop = self._loop()
            self._timer = loop.call_later(max(0.0, soonest - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._pump()

    async def _commit(self, key: tuple[str, bytes, int], d: _Dest, batch: list[Entry], groups: list[_Group]) -> None:
        topic, inc, part = key
        outcome: str | Committed | Rehome = "retry"
        moving = False
        try:
            outcome = await self.target.deliver(topic, inc.hex(), part, batch)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            moving = getattr(e, "code", None) == "partition_moving"
            if moving:  # frozen for a move, or the replicas disagree on a fresh flip: retried soon
                log.debug("partition is moving; dispatch retried", extra={"topic": topic, "partition": part})
            else:
                log.warning("dispatch to partition owner failed; retrying", extra={
                    "topic": topic, "partition": part, "records": len(batch), "err": f"{type(e).__name__}: {e}"})
        finally:
            d.inflight = False
            self._inflight -= 1
        if isinstance(outcome, Rehome):
            self._rehome(key, d, batch, groups, outcome.moved)
        elif outcome != "retry":
            d.failing_since = 0.0
            if outcome == "gone":
                self.discarded += len(batch)
                log.warning("discarded WAL records of a deleted topic incarnation (leader-confirmed)",
                            extra={"topic": topic, "incarnation": inc.hex(), "records": len(batch)})
                if self._watched:
                    self._resolve(batch, None)
            else:
                self.committed += len(batch)
                if self._watched:
                    self._resolve(batch, outcome[1] if isinstance(outcome, tuple) else [])
            for g in groups:
                g.remaining -= 1
            self._advance()
            if not d.entries and self.on_drained is not None:
                try:
                    self.on_drained(key)
                except Exception:
                    log.exception("dispatcher drain callback failed")
        else:
            # Keep order: the batch goes back in front of whatever queued since.
            d.kept, d.probe_kept = 0, False
            d.entries.extendleft(reversed(batch))
            d.groups.extendleft(reversed(groups))
            now = time.monotonic()
            d.failing_since = d.failing_since or now
            d.retry_at = now + (MOVING_RETRY_AFTER if moving else RETRY_AFTER)
        self._pump()

    def _rehome(self, key: tuple[str, bytes, int], d: _Dest, batch: list[Entry], groups: list[_Group],
                moved: list[tuple[int, int]]) -> None:
        """A ``Rehome`` answer: its entries go to the destinations it names, the rest of
        the batch back to the front of its own (in order), tried again at once."""
        topic, inc, part = key
        to = dict(moved)
        kept_e: list[Entry] = []
        kept_g: list[_Group] = []
        for i, (e, g) in enumerate(zip(batch, groups, strict=True)):
            q = to.get(i)
            if q is None or q == part:
                kept_e.append(e)
                kept_g.append(g)
                continue
            e.partition = q
            qkey = (topic, inc, q)
            other = self._dests.get(qkey)
            if other is None:
                other = self._dests[qkey] = _Dest()
            other.entries.append(e)
            other.groups.append(g)
        d.entries.extendleft(reversed(kept_e))
        d.groups.extendleft(reversed(kept_g))
        n = len(batch) - len(kept_e)
        if not n:  # (nothing named elsewhere: a retry, not a loop)
            d.retry_at = time.monotonic() + RETRY_AFTER
            return
        self.rehomed += n
        log.info("idempotent records sent to their key's partition (the partition this node placed them in "
                 "may no longer commit them)", extra={"topic": topic, "from_partition": part, "records": n})
        if not d.entries and self.on_drained is not None:
            try:
                self.on_drained(key)
            except Exception:
                log.exception("dispatcher drain callback failed")

    def _reroute(self, key: tuple[str, bytes, int], d: _Dest, probe: bool = True) -> bool:
        """Move what is queued for a failing or dead destination to the next
        live sibling partition. For a failing (not dead) owner one record stays
        behind as the probe that brings traffic back when it recovers; a dead
        owner keeps none (membership says when it is back, and a record must not
        wait on a node that may never return). False when there is no sibling."""
        topic, inc, part = key
        skip = max(d.kept, 1) if probe else (0 if d.probe_kept else d.kept)
        if len(d.entries) <= skip:
            return False
        n = self.target.partition_count(topic, inc.hex())
        for k in range(1, n):
            q = (part + k) % n
            qkey = (topic, inc, q)
            other = self._dests.get(qkey)
            if other is not None and other.failing_since:
                continue
            if not self.target.owner_alive(topic, inc.hex(), q):
                continue
            if other is None:
                other = self._dests[qkey] = _Dest()
            kept_e: list[Entry] = []
            kept_g: list[_Group] = []
            if probe and not d.kept:
                d.probe_kept = not _pinned(d.entries[0])
            elif not probe:
                d.probe_kept = False
            for _ in range(skip):
                kept_e.append(d.entries.popleft())
                kept_g.append(d.groups.popleft())
            moved = 0
            while d.entries:
                e = d.entries.popleft()
                g = d.groups.popleft()
                if _pinned(e):  # its idempotency key is checked at this partition: it waits here
                    kept_e.append(e)
                    kept_g.append(g)
                    continue
                e.partition = q
                other.entries.append(e)
                other.groups.append(g)
                moved += 1
            d.entries.extend(kept_e)
            d.groups.extend(kept_g)
            d.kept = len(kept_e)
            if moved:
                self.rerouted += moved
                log.warning("rerouted records from a failing partition owner", extra={
                    "topic": topic, "from_partition": part, "to_partition": q, "records": moved})
            return moved > 0
        return False

    def _advance(self) -> None:
        front = self._front
        last = None
        while front and front[0].remaining == 0:
            last = front.popleft().last
        if last is not None:
            self.wal.set_checkpoint(last + 1)

    async def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._watch_timer is not None:
            self._watch_timer.cancel()
            self._watch_timer = None
        for w in self._deadlines:
            if not w.done.done():
                w.done.set_result(None)
        self._deadlines.clear()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(t), 5.0)
