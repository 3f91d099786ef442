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
must be confirmed by the supervisor (barrier + re-read on the leader).

Imports narad.storage.wal; talks to the broker through a small interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Protocol

from narad.storage.wal import Entry, IngressWAL

log = logging.getLogger("narad.broker.dispatcher")

MAX_IN_FLIGHT = 16
BATCH_RECORDS = 4096
BATCH_BYTES = 8 << 20
RETRY_AFTER = 1.0


class Target(Protocol):
    async def deliver(self, topic: str, topic_id: str, partition: int, entries: list[Entry]) -> str:
        """Commit at the owner. Returns "ok", "gone" (incarnation confirmed
        deleted: discard) or raises to retry later."""
        ...


class _Group:
    __slots__ = ("last", "remaining")

    def __init__(self, last: int, remaining: int) -> None:
        self.last = last
        self.remaining = remaining


class _Dest:
    __slots__ = ("entries", "groups", "inflight", "retry_at")

    def __init__(self) -> None:
        self.entries: deque[Entry] = deque()
        self.groups: deque[_Group] = deque()
        self.inflight = False
        self.retry_at = 0.0


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
        self.closed = False
        self.loop: asyncio.AbstractEventLoop | None = None

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
        for e in entries:
            key = (e.topic, e.incarnation, e.partition)
            d = dests.get(key)
            if d is None:
                d = dests[key] = _Dest()
            d.entries.append(e)
            d.groups.append(g)
        self._pump()

    @property
    def backlog(self) -> int:
        return sum(len(d.entries) for d in self._dests.values())

    def _pump(self) -> None:
        if self.closed:
            return
        now = time.monotonic()
        soonest = None
        for key, d in list(self._dests.items()):
            if self._inflight >= MAX_IN_FLIGHT:
                break
            if d.inflight:
                continue
            if not d.entries:
                del self._dests[key]
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
            batch = [d.entries.popleft() for _ in range(n)]
            groups = [d.groups.popleft() for _ in range(n)]
            d.inflight = True
            self._inflight += 1
            t = self._loop().create_task(self._commit(key, d, batch, groups))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        if soonest is not None and self._timer is None:
            loop = self._loop()
            self._timer = loop.call_later(max(0.0, soonest - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._pump()

    async def _commit(self, key: tuple[str, bytes, int], d: _Dest, batch: list[Entry], groups: list[_Group]) -> None:
        topic, inc, part = key
        outcome = "retry"
        try:
            outcome = await self.target.deliver(topic, inc.hex(), part, batch)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("dispatch to partition owner failed; retrying", extra={
                "topic": topic, "partition": part, "records": len(batch), "err": f"{type(e).__name__}: {e}"})
        finally:
            d.inflight = False
            self._inflight -= 1
        if outcome in ("ok", "gone"):
            if outcome == "gone":
                self.discarded += len(batch)
                log.warning("discarded WAL records of a deleted topic incarnation (leader-confirmed)",
                            extra={"topic": topic, "incarnation": inc.hex(), "records": len(batch)})
            else:
                self.committed += len(batch)
            for g in groups:
                g.remaining -= 1
            self._advance()
        else:
            # Keep order: the batch goes back in front of whatever queued since.
            d.entries.extendleft(reversed(batch))
            d.groups.extendleft(reversed(groups))
            d.retry_at = time.monotonic() + RETRY_AFTER
        self._pump()

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
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(t), 5.0)
