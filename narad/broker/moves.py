"""Partition moves (rebalance, decommission): copy-then-flip, destination-driven.

The controller only sets an assignment row's *target*; this module does the work,
in the worker of the destination node that will own the partition (the same
``owner_worker`` hash as everywhere), and answers the source's side in the
worker that owns it there.

Destination (``MoveRunner``, one task per partition whose target is this node):
1. pre-copy: list the source's segments (the active one only up to its high
   watermark) and fetch what the staging copy lacks, in chunks, while produce and
   consume go on; a few passes, until a pass copies little;
2. freeze the source (``MoveFreezeReq``): it refuses new commits (the dispatchers
   retry; the records land here after the flip) and new leases; acks of existing
   leases still work. The freeze token is re-armed every TTL/4 on its own timer;
   the source makes each freeze and renewal durable (``freeze.marker``) before it
   answers, so a source restarted within the TTL opens the partition frozen (the
   flip may commit while it is down or starting: nothing may land behind the copy);
3. finalize: copy until two passes in a row copy nothing at the same high
   watermark; make the copy durable and verify that it recovers to exactly that
   high watermark (else discard it and copy again; twice: blocked);
4. fence: present the token again; a lapsed freeze (409 ``freeze_lapsed``) means
   commits may have landed behind the copy: freeze afresh and finalize again;
5. install (``transfer.Staging.install``): positions clamped (frontier, held acks,
   delivery counts: the listing and the freeze answer carry them), fan-out cursors,
   ``move.marker``; any old in-memory state of the partition here dropped;
6. flip: one compare-and-set Raft entry (type 40) through the supervisor. An
   error is not a failure: the install is kept and the outcome read from the
   leader; only a leader read started at least 15 s after the last proposal that
   says the flip cannot commit undoes the install (renamed back to staging).

Source (``MoveSource``): the list, chunk, freeze/fence and thaw requests, on the
owner worker, refused (409 ``not_owner``) where this node does not own the
partition. After the flip the broker's topic watch closes the partition here and
renames its directory aside (``<dir>.moved-<token>``, never deleted here).

Imports narad.storage.transfer, narad.meta (read side and request structs), the
broker's peers messages; the broker hands itself in (no import of broker.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from narad import metrics
from narad.errors import BadRequest, Conflict, NaradError, NotFound, Unavailable
from narad.meta import requests as Q
from narad.meta import versions as V
from narad.meta.records import TopicRecord
from narad.storage import cursor_file as CF
from narad.storage import fileio
from narad.storage import transfer as TR

from . import peers as P
from .fanout import partition_dir
from .idem_claims import SEALS, topic_tag
from .partition import MAX_REASON_CHARS, Partition, rfc3339_ms

log = logging.getLogger("narad.broker.moves")
T = TypeVar("T")

TICK = 1.0  # the runner looks at the assignments this often (sooner after a change)
FULL_PASS_EVERY = 30.0
PRECOPY_PASSES = 8
LAG_BYTES = 1 << 20  # a pre-copy pass that copied less than this is close enough to freeze
FREEZE_TTL_MS = int(os.environ.get("NARAD_MOVE_FREEZE_TTL_MS", "30000"))  # the env: tests only
LEASE_DRAIN = 0.5  # the source waits this long (at most) for outstanding leases before reading positions
FLIP_WINDOW = 120.0  # a flip is re-proposed (under a re-armed freeze) for this long
AMBIGUITY_WAIT = 15.0  # an install is undone only by a leader read this long after the last proposal
RPC_TIMEOUT = 10.0
MAX_FINALIZE_PASSES = 200
COPY_WINDOW = 4  # chunk requests in flight per move (1 MiB each)
CLAIMS_SETTLE_S = 5.0  # the source waits this long (at most) for pending claims homed at the partition
FORCE_AFTER = float(os.environ.get("NARAD_MOVE_FORCE_AFTER_MS", "120000")) / 1000.0  # a dead source's partition
SWEEP_EVERY = float(os.environ.get("NARAD_MOVE_SWEEP_MS", "30000")) / 1000.0  # the stale-copy sweep
_SOURCE_DOWN = (OSError, TimeoutError, Unavailable)
# Test seams (environment, tests only): slow a copy down per chunk, hold a move in its
# frozen phase before the fence, or just before it proposes the flip (kill windows).
COPY_DELAY = float(os.environ.get("NARAD_FAULT_MOVE_CHUNK_DELAY_MS", "0")) / 1000.0
HOLD_FROZEN = float(os.environ.get("NARAD_FAULT_MOVE_HOLD_FROZEN_MS", "0")) / 1000.0
HOLD_FLIP = float(os.environ.get("NARAD_FAULT_MOVE_HOLD_FLIP_MS", "0")) / 1000.0
HOLD_PRECOPY = float(os.environ.get("NARAD_FAULT_MOVE_HOLD_PRECOPY_MS", "0")) / 1000.0


def _reasons(pairs: list[tuple[int, str]]) -> dict[int, str]:
    """A source's last nack reasons, each cut to the API's bound (a peer's strings)."""
    return {o: r[:MAX_REASON_CHARS] for o, r in pairs}


def _sent(p: Partition) -> tuple[tuple[str, str] | None, list[int]]:
    """The source's ``dead_letter.target`` for a listing: the dead-letter topic and the
    offsets sent there, with those whose commit may be starting now (in flight)."""
    if p.dlq_target is None:
        return None, []
    return p.dlq_target, sorted(p.dlq_sent | p.dead_flight)


def _dlq(r: P.MoveListResp | P.MoveFreezeResp) -> tuple[str, str, list[int]] | None:
    """A listing's ``dead_letter.target`` for the install (a peer's values, checked)."""
    t = r.dlq_target
    if t is None or not t[0] or not t[1] or len(t[0]) > 1024 or len(t[1]) > 64:
        return None
    return t[0], t[1], sorted({o for o in r.dlq_sent if o >= 0})


class _Aborted(Exception):
    """The move's target was cleared (abort, re-plan, dead destination)."""


class _Lapsed(Exception):
    """The source's freeze lapsed (or it restarted): commits may be behind the copy."""


def read_cursors(d: Path) -> list[tuple[str, str, int]]:
    """The fan-out cursor files of a partition directory: (child, epoch, next offset).
    A damaged or unreadable one is left out (the new owner's cursor then starts
    from its attach point again: duplicates in the child, never a loss)."""
    out: list[tuple[str, str, int]] = []
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return out
    for name in names:
        if not (name.startswith("fanout-") and name.endswith(".offset")):
            continue
        child = name[len("fanout-"):-len(".offset")]
        try:
            with open(d / name, "rb") as fh:
                st = CF.decode(fh.read())
        except (OSError, ValueError):
            continue
        out.append((child, st.epoch, st.next_offset))
    return out


def _stale_candidates(root: Path) -> list[tuple[str, str, int, Path, bool]]:
    """(topic, incarnation, partition, dir, moved aside?) of every plain partition
    directory and every ``<p>.moved-<token>`` one under the topics root."""
    out: list[tuple[str, str, int, Path, bool]] = []
    try:
        tops = sorted(os.listdir(root))
    except FileNotFoundError:
        return out
    for tname in tops:
        name, sep, tid = tname.rpartition("@")
        if not sep:
            continue
        try:
            subs = sorted(os.listdir(root / tname))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for sub in subs:
            head, dot, rest = sub.partition(".")
            if len(head) != 6 or head[0] != "p" or not head[1:].isdigit():
                continue
            if dot and (not rest.startswith("moved-") or ".quarantine-" in rest):
                continue  # staging and quarantine directories (of a moved-aside copy too) are not stale copies
            out.append((name, tid, int(head[1:]), root / tname / sub, bool(dot)))
    return out


def _keys_in_window(d: Path, window_ms: int) -> bool:
    """Whether a moved-aside copy may hold idempotency keys still within their window: it
    had keyed records, and a segment was written to less than a window ago. Such a copy is
    kept (the node's start reads its keys back: their home may be here)."""
    if not (d / "idem.marker").exists():
        return False
    newest = max((e.stat().st_mtime for e in os.scandir(d) if e.name.endswith(".log")), default=0.0)
    return (newest * 1000 + window_ms) > time.time() * 1000


def _remove_tree(d: Path) -> None:
    shutil.rmtree(d)
    fileio.fsync_dir(d.parent)


class MoveSource:
    """The source side of a move, in the worker that owns the partition."""

    def __init__(self, broker: Any) -> None:
        self.b = broker

    def _owned_here(self, topic: str, topic_id: str, partition: int) -> TopicRecord:
        b = self.b
        t = b.store.topic(topic)
        if t is None or t.id != topic_id or not 0 <= partition < t.partitions:
            raise NotFound(f'partition {partition} of topic "{topic}" incarnation {topic_id} is not here',
                           code="topic_gone")
        node, _w = b.where(t, partition)
        if node != b.node_id:
            raise Conflict(f"partition {partition} of {topic} is owned by {node}, not by {b.node_id}",
                           code="not_owner")
        return t

    async def list(self, m: P.MoveListReq) -> P.MoveListResp:
        t = self._owned_here(m.topic, m.topic_id, m.partition)
        p = await self.b.partition(t, m.partition)
        frontier, ahead = p.snapshot_offsets()  # positions first: never past what the listing copies
        counts = sorted(p.snapshot_counts().items())
        reasons = sorted(p.snapshot_reasons().items())
        d = partition_dir(self.b.data_dir, t.name, t.id, m.partition)
        cursors = await self.b.loop.run_in_executor(self.b.io, read_cursors, d)
        hwm, segs = await self.b.loop.run_in_executor(self.b.io, TR.list_open, p.log)
        return P.MoveListResp(hwm, [(s.base, s.size, s.mtime_ms) for s in segs], int(time.time() * 1000),
                              p.frozen(), frontier, ahead, cursors, counts, reasons, sorted(p.held_marks()),
                              *_sent(p))

    async def vouch(self, m: P.MoveVouchReq) -> P.MoveVouchResp:
        """What this node (the owner, its replica says) holds of a partition another
        node keeps an old copy of: its move marker and its high watermark now."""
        b = self.b
        t = b.store.topic(m.topic)
        if t is None or t.id != m.topic_id or not 0 <= m.partition < t.partitions:
            return P.MoveVouchResp(False)
        node, _w = b.where(t, m.partition)
        if node != b.node_id:
            return P.MoveVouchResp(False)
        d = partition_dir(b.data_dir, t.name, t.id, m.partition)
        marker = await b.loop.run_in_executor(b.io, TR.read_marker, d) or {}
        p = await b.partition(t, m.partition)
        return P.MoveVouchResp(True, p.log.hwm, marker)

    async def chunk(self, m: P.MoveChunkReq) -> P.MoveChunkResp:
        t = self._owned_here(m.topic, m.topic_id, m.partition)
        d = partition_dir(self.b.data_dir, t.name, t.id, m.partition)
        length = max(0, min(m.length, TR.CHUNK_MAX))
        try:
            data = await self.b.loop.run_in_executor(self.b.io, TR.read_chunk, d, m.base, m.offset, length)
        except FileNotFoundError:
            raise NotFound(f"segment {m.base} of partition {m.partition} of {t.name} is gone (retention)",
                           code="segment_gone") from None
        return P.MoveChunkResp(data)

    async def freeze(self, m: P.MoveFreezeReq) -> P.MoveFreezeResp:
        t = self._owned_here(m.topic, m.topic_id, m.partition)
        p = await self.b.partition(t, m.partition)
        ttl = max(1.0, min(m.ttl_ms, 120_000) / 1000.0)
        now = time.monotonic()
        d = partition_dir(self.b.data_dir, t.name, t.id, m.partition)
        loop = self.b.loop
        if m.token:
            if p.freeze_token != m.token or now >= p.freeze_until:
                raise Conflict(f"the freeze of partition {m.partition} of {t.name} lapsed (or the source "
                               "restarted): commits may have landed behind the copy", code="freeze_lapsed")
            p.freeze_until = now + ttl
            # Durable before it is answered: a restart of this node keeps the partition frozen
            # for the rest of the TTL (the flip this renewal covers may commit meanwhile).
            await loop.run_in_executor(self.b.io, TR.write_freeze, d, m.token, int(time.time() * 1000 + ttl * 1000))
            if p.claims_sealed:  # the seal of its keys' home lasts as long as the freeze
                await loop.run_in_executor(self.b.io, self._seal, t, m.partition, p)
            if m.renew_only:
                return P.MoveFreezeResp(m.token)
        else:
            if p.freeze_token is not None and now < p.freeze_until:
                log.info("partition refrozen for another move attempt", extra={"topic": t.name,
                                                                              "partition": m.partition})
            p.freeze_token = secrets.token_hex(8)
            p.freeze_until = now + ttl
            await loop.run_in_executor(self.b.io, TR.write_freeze, d, p.freeze_token,
                                       int(time.time() * 1000 + ttl * 1000))
            metrics.get().move_freezes.inc()
            log.info("partition frozen for a move", extra={"topic": t.name, "partition": m.partition,
                                                          "ttl_s": ttl})
            end = now + min(LEASE_DRAIN, ttl / 4)
            while p.leases and time.monotonic() < end:  # outstanding leases get a moment to be acked
                await asyncio.sleep(0.02)
        await p.commits_idle()  # an in-flight commit is either in the copy or refused
        # Positions first, then the high watermark and the segments: a listing never
        # carries a position past what it copies.
        frontier, ahead = p.snapshot_offsets()
        counts = sorted(p.snapshot_counts().items())  # delivery counts move with the positions
        reasons = sorted(p.snapshot_reasons().items())  # and the last nack reasons
        cursors = await loop.run_in_executor(self.b.io, read_cursors, d)
        hwm, segs = await loop.run_in_executor(self.b.io, TR.list_open, p.log)
        return P.MoveFreezeResp(p.freeze_token or "", hwm, frontier, ahead, cursors,
                                [(s.base, s.size, s.mtime_ms) for s in segs], int(time.time() * 1000), counts,
                                reasons, sorted(p.held_marks()), *_sent(p))

    async def claims(self, m: P.MoveClaimsReq) -> P.MoveClaimsResp:
        """The idempotency keys homed at the partition that this node committed anywhere
        (its records in other partitions: topic.idempotent_local_placement), under the
        move's live freeze: no new key homed there is claimed here meanwhile (the
        partition is frozen, and its home is sealed in the node's table for as long as the
        freeze holds: a worker whose replica has not shown the move yet and placed such a
        key elsewhere has that commit refused, and the WAL's dispatcher sends the record to
        the partition's new owner, ``Broker.rehome``); the claims still pending are waited
        for first (at most CLAIMS_SETTLE_S, then 503: the destination asks again)."""
        t = self._owned_here(m.topic, m.topic_id, m.partition)
        p = await self.b.partition(t, m.partition)
        if not m.token or p.freeze_token != m.token or not p.frozen():
            raise Conflict(f"the freeze of partition {m.partition} of {t.name} lapsed (or the source "
                           "restarted): commits may have landed behind the copy", code="freeze_lapsed")
        claims, tag = self.b.claims, topic_tag(t.id)
        loop = self.b.loop
        if not await loop.run_in_executor(self.b.io, self._seal, t, m.partition, p):
            raise Unavailable(f"this node holds {SEALS} move seals already; ask again")
        end = time.monotonic() + CLAIMS_SETTLE_S
        while await loop.run_in_executor(self.b.io, claims.pending_homed, tag, m.partition):
            if time.monotonic() >= end:
                raise Unavailable(f"idempotency claims homed at partition {m.partition} of {t.name} are still "
                                  "pending; ask again")
            await asyncio.sleep(0.01)
        keys = await loop.run_in_executor(self.b.io, claims.collect, tag, m.partition, int(time.time() * 1000))
        return P.MoveClaimsResp(t.idem_window_ms, keys)

    def _seal(self, t: TopicRecord, partition: int, p: Any) -> bool:
        """Seals the partition's home in the node's claims table until its freeze ends (I/O thread)."""
        now_ms = int(time.time() * 1000)
        until = now_ms + int(max(0.0, p.freeze_until - time.monotonic()) * 1000)
        ok = self.b.claims.seal(topic_tag(t.id), partition, until, now_ms)
        p.claims_sealed = p.claims_sealed or ok
        return ok

    async def thaw(self, m: P.MoveThawReq) -> P.MoveFreezeResp:
        p = self.b.partitions.get((m.topic, m.partition))
        d = partition_dir(self.b.data_dir, m.topic, m.topic_id, m.partition)
        if p is not None and p.topic_id == m.topic_id and p.freeze_token == m.token:
            p.freeze_token = None
            p.freeze_until = 0.0
            if p.claims_sealed:  # the move was given up: keys homed here are claimed again
                p.claims_sealed = False
                self.b.claims.unseal(topic_tag(m.topic_id), m.partition, int(time.time() * 1000))
            await self.b.loop.run_in_executor(self.b.io, TR.clear_freeze, d)
            log.info("move freeze lifted", extra={"topic": m.topic, "partition": m.partition})
        elif p is None and m.token:  # not open (restarted since): its marker alone holds the freeze
            held = await self.b.loop.run_in_executor(self.b.io, TR.read_freeze, d)
            if held is not None and held[0] == m.token:
                await self.b.loop.run_in_executor(self.b.io, TR.clear_freeze, d)
        return P.MoveFreezeResp("")


class _Move:
    __slots__ = ("aborted", "attempts", "blocked", "copied", "down_since", "key", "last", "last_error", "phase",
                 "source", "started_ms", "task", "token", "topic_id", "unverifiable", "warned")

    def __init__(self, key: tuple[str, int], topic_id: str, source: str) -> None:
        self.key = key
        self.topic_id = topic_id
        self.source = source
        self.started_ms = int(time.time() * 1000)
        self.phase = "copying"
        self.attempts = 0
        self.last_error = ""
        self.copied = 0
        self.blocked: str | None = None
        self.token = ""
        self.aborted = False
        self.unverifiable = 0
        self.task: asyncio.Task[None] | None = None
        self.last: P.MoveListResp | None = None  # the newest listing (a force-promote installs its positions)
        self.down_since: float | None = None  # monotonic: since when the source does not answer
        self.warned = False

    def view(self, target: str) -> Q.MoveWorkerView:
        return Q.MoveWorkerView(self.key[0], self.key[1], self.source, target, rfc3339_ms(self.started_ms),
                                self.phase, self.attempts, self.last_error, self.copied, self.blocked)


class MoveRunner:
    """The destination side: one task per partition this worker is to receive."""

    def __init__(self, broker: Any, meta_call: Callable[[Any, type[T], float], Awaitable[T]] | None) -> None:
        self.b = broker
        self.meta_call = meta_call
        self.moves: dict[tuple[str, int], _Move] = {}
        self._seen = -1
        self._last_full = 0.0
        self._task: asyncio.Task[None] | None = None
        m = metrics.get()
        self.m_bytes = m.move_copied
        self.m_finished = m.moves_finished
        self.m_running = m.moves_running
        self.m_blocked = m.moves_blocked

    @property
    def enabled(self) -> bool:
        return self.meta_call is not None and not isinstance(self.b.remote, P.SingleNode)

    def start(self) -> None:
        if self.enabled:
            self._task = self.b.loop.create_task(self._loop())

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *(mv.task for mv in self.moves.values())] if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t

    def status(self) -> list[Q.MoveWorkerView]:
        return [mv.view(self.b.node_id) for mv in self.moves.values()]

    async def _loop(self) -> None:
        next_sweep = time.monotonic() + SWEEP_EVERY / 3
        while True:
            try:
                self.reconcile()
            except Exception:
                log.exception("move runner pass failed")
                self.b.task_failed("move runner")
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + SWEEP_EVERY
                try:
                    await self.sweep()
                except Exception as e:
                    log.warning("stale-copy sweep failed", extra={"err": f"{type(e).__name__}: {e}"})
            await asyncio.sleep(TICK)

    # ---- the stale-copy sweep ----------------------------------------------------------------
    async def sweep(self) -> int:
        """Old copies of partitions this node no longer owns (``<p>.moved-<token>``
        after a flip, or a plain directory a crash or a force-promote left): removed
        only when this replica is provably current, the leader confirms another owner,
        and that owner vouches for everything the copy holds (its move marker names this
        node as the source, at a high watermark at least the copy's); otherwise
        quarantined, never deleted. Returns how many copies were removed."""
        b = self.b
        if b.index == 0:  # one worker counts the node's quarantined copies
            with contextlib.suppress(OSError):
                metrics.get().quarantined.set(len(await self._io(TR.quarantined, b.data_dir / "topics")))
        if b.caught_up is None or self.meta_call is None or not await b.caught_up():
            return 0
        cands = await self._io(_stale_candidates, b.data_dir / "topics")
        removed = 0
        for topic, tid, part, d, moved in cands:
            if b.route(topic, part) != b.index:
                continue
            t = b.store.topic(topic)
            a = b.store.assignments(topic).get(part)
            if t is None or t.id != tid or a is None or a.topic_id != tid:
                continue  # a deleted incarnation: the retire path and the orphan sweep own those
            if not moved and (a.owner == b.node_id or a.target == b.node_id or (topic, part) in b.partitions):
                continue  # ours, or an install waiting for its flip
            lr = await self._leader_read(topic, part)
            if not lr.found or lr.topic_id != tid or lr.owner == b.node_id or not lr.owner:
                continue
            try:
                v = await b.remote.call(lr.owner, P.MoveVouchReq(topic, tid, part), P.MoveVouchResp, RPC_TIMEOUT)
            except Exception:
                continue  # the owner does not answer: ask again next sweep
            if not v.owns:
                continue
            if moved and await self._io(_keys_in_window, d, t.idem_window_ms):
                continue  # its idempotency keys are still within their window (read at this node's start)
            local_hwm, _segs = await self._io(TR.list_closed, d)
            mk = v.marker
            mk_hwm = mk.get("hwm")
            ours = mk.get("source") == b.node_id and mk.get("topic_id", tid) == tid and isinstance(mk_hwm, int)
            if ours and local_hwm <= mk_hwm:
                await self._io(_remove_tree, d)
                removed += 1
                log.info("old copy of a moved partition removed (its new owner vouched for it)", extra={
                    "topic": topic, "partition": part, "owner": lr.owner, "dir": str(d), "hwm": local_hwm})
                continue
            q = await self._io(TR.quarantine, d, "stale_copy")
            log.error("old copy of a partition quarantined: its owner cannot vouch for all it holds "
                      "(recover its records by hand if needed; it is never deleted)", extra={
                          "topic": topic, "partition": part, "owner": lr.owner, "dir": str(q),
                          "copy_hwm": local_hwm, "owner_marker": mk, "owner_hwm": v.hwm})
        return removed

    def reconcile(self) -> None:
        b = self.b
        ver = b.versions.load(V.ASSIGNMENTS) + (b.versions.load(V.EPOCH) << 40)
        now = time.monotonic()
        if ver == self._seen and now - self._last_full < FULL_PASS_EVERY:
            return
        self._seen = ver
        self._last_full = now
        want: dict[tuple[str, int], tuple[str, str]] = {}
        with b.store.read() as r:
            for name, part, a in r.all_assignments():
                if a.target == b.node_id and a.owner != b.node_id and b.route(name, part) == b.index:
                    want[(name, part)] = (a.topic_id, a.owner)
        for key, mv in list(self.moves.items()):
            if want.get(key) != (mv.topic_id, mv.source):
                mv.aborted = True  # the task notices at its next step (never in the middle of a flip)
        self._gauges()
        for key, (tid, src) in want.items():
            if key not in self.moves:
                mv = _Move(key, tid, src)
                self.moves[key] = mv
                mv.task = b.loop.create_task(self._run(mv))
                log.info("partition move started", extra={"topic": key[0], "partition": key[1], "from": src,
                                                         "to": b.node_id})

    def _gauges(self) -> None:
        self.m_running.set(len(self.moves))
        for reason in ("copy_unverifiable", "source_dead_copy_behind"):
            self.m_blocked.labels(reason).set(sum(1 for mv in self.moves.values() if mv.blocked == reason))

    # ---- one move ------------------------------------------------------------------------
    def _check(self, mv: _Move) -> None:
        """Raise _Aborted once the replica no longer names this move (abort, re-plan,
        a dead destination cleared): checked before every step, so an abort is seen
        within a chunk even if the planner sets the same target again soon after."""
        if not mv.aborted:
            a = self.b.store.assignments(mv.key[0]).get(mv.key[1])
            if a is None or a.topic_id != mv.topic_id or a.owner != mv.source or a.target != self.b.node_id:
                mv.aborted = True
        if mv.aborted:
            raise _Aborted()

    async def _call(self, mv: _Move, msg: Any, typ: type[T], timeout: float = RPC_TIMEOUT) -> T:
        try:
            out = await self.b.remote.call(mv.source, msg, typ, timeout)
        except _SOURCE_DOWN as e:
            down = not isinstance(e, NaradError) or e.code in (None, "", "unavailable", "node_unreachable")
            if down and mv.down_since is None:
                mv.down_since = time.monotonic()
            raise
        mv.down_since = None
        if isinstance(out, P.MoveListResp) and (mv.last is None or out.hwm >= mv.last.hwm):
            mv.last = out
        return out

    async def _io(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        if kw:
            return await self.b.loop.run_in_executor(self.b.io, lambda: fn(*args, **kw))
        return await self.b.loop.run_in_executor(self.b.io, fn, *args)

    async def _run(self, mv: _Move) -> None:
        name, part = mv.key
        final = partition_dir(self.b.data_dir, name, mv.topic_id, part)
        try:
            while True:
                try:
                    if await self._attempt(mv, final):
                        self.m_finished.labels("done").inc()
                        log.info("partition move finished", extra={"topic": name, "partition": part,
                                                                  "from": mv.source, "to": self.b.node_id,
                                                                  "copied_bytes": mv.copied})
                        return
                except _Aborted:
                    self.m_finished.labels("abandoned").inc()
                    await self._abandon(mv, final)
                    log.info("partition move abandoned (its target was cleared)",
                             extra={"topic": name, "partition": part, "from": mv.source})
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    mv.attempts += 1
                    mv.last_error = f"{type(e).__name__}: {e}"[:300]
                    # Logged at the first few failures, then every 10th (a dead source fails every 5 s).
                    if mv.attempts <= 3 or mv.attempts % 10 == 0:
                        lvl = logging.INFO if mv.attempts < 3 else logging.WARNING
                        log.log(lvl, "partition move attempt failed; retrying",
                                extra={"topic": name, "partition": part, "from": mv.source, "err": mv.last_error,
                                       "attempts": mv.attempts})
                    if mv.aborted:
                        await self._abandon(mv, final)
                        return
                    if mv.down_since is not None and not self.b.remote.node_alive(mv.source):
                        mv.phase = "waiting_for_source"
                        if time.monotonic() - mv.down_since >= FORCE_AFTER and await self._force_promote(mv, final):
                            self.m_finished.labels("forced").inc()
                            log.warning("partition force-promoted from a copy of its dead source", extra={
                                "topic": name, "partition": part, "from": mv.source, "to": self.b.node_id})
                            return
                    await asyncio.sleep(min(5.0, 0.25 * (2 ** min(mv.attempts, 5))))
        finally:
            if self.moves.get(mv.key) is mv:
                del self.moves[mv.key]
            self._gauges()
            self._seen = -1  # look again at once: a new target may be waiting

    async def _abandon(self, mv: _Move, final: Path) -> None:
        if mv.token:
            with contextlib.suppress(Exception):
                await self._call(mv, P.MoveThawReq(mv.key[0], mv.topic_id, mv.key[1], mv.token), P.MoveFreezeResp, 5.0)
        with contextlib.suppress(Exception):
            await self._io(TR.Staging(final).discard)

    async def _copy(self, mv: _Move, st: TR.Staging, segs: list[tuple[int, int, int]]) -> int:
        """Fetch what the staging copy lacks of this listing; returns bytes copied.
        Up to COPY_WINDOW chunk requests are in flight; chunks are written in order."""
        infos = [TR.SegInfo(b, s, t) for b, s, t in segs]
        ranges = await self._io(st.plan, infos)
        name, part = mv.key
        pieces: list[tuple[int, int, int]] = []
        for base, off, length in ranges:
            while length > 0:
                k = min(length, TR.CHUNK_MAX)
                pieces.append((base, off, k))
                off += k
                length -= k
        n = 0
        window: collections.deque[tuple[int, int, int, asyncio.Task[P.MoveChunkResp]]] = collections.deque()
        it = iter(pieces)
        try:
            while True:
                while len(window) < COPY_WINDOW:
                    nxt = next(it, None)
                    if nxt is None:
                        break
                    self._check(mv)
                    b, o, k = nxt
                    req = P.MoveChunkReq(name, mv.topic_id, part, b, o, k)
                    window.append((b, o, k, self.b.loop.create_task(self._call(mv, req, P.MoveChunkResp))))
                if not window:
                    return n
                b, o, k, task = window.popleft()
                got = await task
                if len(got.data) != k:
                    raise Unavailable(f"the source returned {len(got.data)} bytes for segment {b} at {o}, "
                                      f"not {k}")
                await self._io(st.write, b, o, got.data)
                if COPY_DELAY:
                    await asyncio.sleep(COPY_DELAY)
                n += k
                mv.copied += k
                if self.m_bytes is not None:
                    self.m_bytes.inc(k)
        finally:
            for _b, _o, _k, t in window:
                t.cancel()

    async def _rearm(self, mv: _Move) -> None:
        name, part = mv.key
        while True:
            await asyncio.sleep(FREEZE_TTL_MS / 4000.0)
            if not mv.token:
                continue
            try:
                await self._call(mv, P.MoveFreezeReq(name, mv.topic_id, part, mv.token, True, FREEZE_TTL_MS),
                                 P.MoveFreezeResp, 5.0)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the fence finds out whether it lapsed
                log.info("move freeze re-arm failed", extra={"topic": name, "partition": part, "err": str(e)})

    async def _attempt(self, mv: _Move, final: Path) -> bool:
        name, part = mv.key
        st = TR.Staging(final)
        installed = await self._io(TR.read_marker, final)
        if installed is not None and installed.get("source") == mv.source and \
                installed.get("target") == self.b.node_id and installed.get("topic_id", mv.topic_id) == mv.topic_id:
            # A restart after the install, before the flip was seen: resolve the flip first.
            mv.phase = "flip_pending"
            return await self._flip(mv, final, int(installed.get("hwm", -1)), time.monotonic())
        mv.phase = "copying"
        mv.token = ""
        for _ in range(PRECOPY_PASSES):
            self._check(mv)
            lst = await self._call(mv, P.MoveListReq(name, mv.topic_id, part), P.MoveListResp)
            if await self._copy(mv, st, lst.segments) < LAG_BYTES:
                break
        await self._io(st.durable)  # what the pre-copy wrote is synced before the freeze, not during it
        await self._hold(mv, HOLD_PRECOPY, "move held after its pre-copy (test seam)")
        self._check(mv)
        fr = await self._call(mv, P.MoveFreezeReq(name, mv.topic_id, part, "", False, FREEZE_TTL_MS),
                              P.MoveFreezeResp)
        mv.token = fr.token
        mv.phase = "frozen"
        rearm = self.b.loop.create_task(self._rearm(mv))
        try:
            while True:
                hwm = await self._finalize(mv, st, fr)
                await self._hold(mv, HOLD_FROZEN, "move held frozen (test seam)")
                await self._io(st.durable)
                why = await self._io(st.verify, hwm)
                if why is not None:
                    mv.unverifiable += 1
                    await self._io(st.discard)
                    if mv.unverifiable >= 2:
                        mv.blocked = "copy_unverifiable"
                        mv.phase = "blocked"
                        log.error("partition move blocked: the copy does not verify",
                                  extra={"topic": name, "partition": part, "err": why})
                        with contextlib.suppress(Exception):
                            await self._call(mv, P.MoveThawReq(name, mv.topic_id, part, mv.token), P.MoveFreezeResp, 5)
                        mv.token = ""
                        while not mv.aborted:  # holds its slot until aborted or re-planned
                            await asyncio.sleep(TICK)
                        raise _Aborted()
                    raise Unavailable(f"the staged copy does not verify ({why}); copying again from scratch")
                self._check(mv)
                try:
                    fz = await self._call(mv, P.MoveFreezeReq(name, mv.topic_id, part, mv.token, False,
                                                              FREEZE_TTL_MS), P.MoveFreezeResp)
                except Conflict as e:
                    if e.code == "freeze_lapsed":
                        raise _Lapsed() from None
                    raise
                if fz.hwm != hwm:
                    fr = fz
                    continue  # commits landed before the freeze took: copy them too
                break
            self._check(mv)
            # The idempotency keys homed here that the source committed elsewhere: kept with
            # the copy (``idem.carried``) and in this node's table before the flip.
            try:
                cl = await self._call(mv, P.MoveClaimsReq(name, mv.topic_id, part, mv.token), P.MoveClaimsResp)
            except BadRequest as e:
                if "unsupported rpc operation MoveClaimsReq" not in str(e):
                    raise
                cl = P.MoveClaimsResp(0, [])  # an older source: it commits no key away from its partition
            carried = TR.encode_carried(cl.window_ms, cl.keys) if cl.keys else None
            self.b.forget_partition(name, part, mv.topic_id)
            src_now = fz.now_ms or int(time.time() * 1000)
            skew = int(time.time() * 1000) - src_now
            mtimes = {b: t + skew for b, _s, t in fz.segments}
            marker = {"source": mv.source, "target": self.b.node_id, "topic_id": mv.topic_id, "hwm": hwm,
                      "token": mv.token, "forced": False}
            qdir = await self._io(st.install, hwm=hwm, frontier=fz.frontier, ahead=list(fz.ahead),
                                  cursors={c: (e, n) for c, e, n in fz.cursors}, marker=marker, seg_mtimes=mtimes,
                                  counts=dict(fz.counts), reasons=_reasons(fz.reasons), dead=fz.dead,
                                  dlq=_dlq(fz), carried=carried)
            # A seal this node may hold from the partition's last stay here (it moved away
            # within its freeze's end) is lifted: the partition's keys are claimable here again.
            await self._io(self.b.claims.unseal, topic_tag(mv.topic_id), part, int(time.time() * 1000))
            if cl.keys:
                await self._io(self.b.claims.load_raw, topic_tag(mv.topic_id), part, cl.keys, cl.window_ms,
                               int(time.time() * 1000))
                log.info("idempotency keys carried by the move", extra={"topic": name, "partition": part,
                                                                       "keys": len(cl.keys)})
            if qdir is not None:
                log.error("an older copy of the partition was in the way of the install; quarantined",
                          extra={"topic": name, "partition": part, "dir": str(qdir)})
            self.b.forget_partition(name, part, mv.topic_id)
            mv.phase = "flip_pending"
            return await self._flip(mv, final, hwm, time.monotonic())
        except _Lapsed:
            log.info("move freeze lapsed before the flip; freezing again", extra={"topic": name, "partition": part})
            mv.token = ""
            return False
        finally:
            rearm.cancel()

    async def _hold(self, mv: _Move, seconds: float, what: str) -> None:
        """A test seam's kill window: wait `seconds` at this phase, still seeing an abort."""
        if not seconds:
            return
        log.info(what, extra={"topic": mv.key[0], "partition": mv.key[1]})
        held = time.monotonic() + seconds
        while time.monotonic() < held:
            self._check(mv)
            await asyncio.sleep(0.02)

    async def _finalize(self, mv: _Move, st: TR.Staging, fr: P.MoveFreezeResp) -> int:
        """Copy under the freeze until two passes in a row copy nothing at the same hwm."""
        name, part = mv.key
        await self._copy(mv, st, fr.segments)
        last = fr.hwm
        quiet = 0
        for _ in range(MAX_FINALIZE_PASSES):
            self._check(mv)
            lst = await self._call(mv, P.MoveListReq(name, mv.topic_id, part), P.MoveListResp)
            if not lst.frozen:
                raise _Lapsed()
            n = await self._copy(mv, st, lst.segments)
            if n == 0 and lst.hwm == last:
                quiet += 1
                if quiet >= 2:
                    return last
            else:
                quiet = 0
            last = lst.hwm
        raise Unavailable("the source kept changing under its freeze")

    async def _force_promote(self, mv: _Move, final: Path) -> bool:
        """The source has been dead (its member record, and unreachable from here) for
        FORCE_AFTER: flip from the staged copy, without a freeze, if the copy reaches
        at least the high watermark the source last reported (what it committed after
        that is lost unless it returns; its copy is then quarantined, never deleted)."""
        name, part = mv.key
        last = mv.last
        st = TR.Staging(final)
        reached = await self._io(st.recovers_to) if last is not None else None
        if last is None or reached is None or reached < last.hwm:
            mv.blocked = "source_dead_copy_behind"
            mv.phase = "blocked"
            if not mv.warned:
                mv.warned = True
                log.error("partition move cannot force-promote: the copy is behind the dead source's last "
                          "known high watermark (waiting for the source)", extra={
                              "topic": name, "partition": part, "from": mv.source,
                              "copy_hwm": reached, "source_hwm": None if last is None else last.hwm})
            return False
        why = await self._io(st.verify, reached)
        if why is not None:
            mv.last_error = f"force-promote: the copy does not verify: {why}"
            return False
        marker = {"source": mv.source, "target": self.b.node_id, "topic_id": mv.topic_id, "hwm": reached,
                  "token": "", "forced": True}
        self.b.forget_partition(name, part, mv.topic_id)
        await self._io(st.install, hwm=reached, frontier=last.frontier, ahead=list(last.ahead),
                       cursors={c: (e, n) for c, e, n in last.cursors}, marker=marker, seg_mtimes={},
                       counts=dict(last.counts), reasons=_reasons(last.reasons), dead=last.dead,
                       dlq=_dlq(last))
        self.b.forget_partition(name, part, mv.topic_id)
        mv.phase = "flip_pending"
        mv.blocked = None
        return await self._flip(mv, final, reached, time.monotonic(), force=True)

    async def _leader_read(self, name: str, part: int) -> Q.AssignmentReadResp:
        assert self.meta_call is not None
        return await self.meta_call(Q.AssignmentReadReq(name, part), Q.AssignmentReadResp, 15.0)

    async def _flip(self, mv: _Move, final: Path, hwm: int, since: float, force: bool = False) -> bool:
        """Propose the flip; resolve an unknown outcome by leader reads. True: this
        node owns the partition. False: go round again (the install was undone)."""
        assert self.meta_call is not None
        name, part = mv.key
        req = Q.CompleteMoveReq(name, mv.topic_id, part, mv.source, self.b.node_id, force)
        last_proposal = since
        end = time.monotonic() + FLIP_WINDOW
        propose = True
        if HOLD_FLIP:
            log.info("move held before its flip (test seam)", extra={"topic": name, "partition": part})
            await asyncio.sleep(HOLD_FLIP)
        while True:
            if propose:
                propose = False
                last_proposal = time.monotonic()
                try:
                    r = await self.meta_call(req, Q.CompleteMoveResp, 20.0)
                    if r.outcome == "done":
                        return True
                except NaradError as e:
                    log.info("move flip outcome unknown; asking the leader",
                             extra={"topic": name, "partition": part, "err": e.message})
                except (TimeoutError, OSError) as e:
                    log.info("move flip outcome unknown; asking the leader",
                             extra={"topic": name, "partition": part, "err": repr(e)})
            try:
                started = time.monotonic()
                a = await self._leader_read(name, part)
            except Exception as e:  # an unknown answer never undoes an install
                mv.last_error = f"leader read: {type(e).__name__}: {e}"[:300]
                await asyncio.sleep(1.0)
                continue
            if a.found and a.topic_id == mv.topic_id and a.owner == self.b.node_id:
                return True
            pending = a.found and a.topic_id == mv.topic_id and a.owner == mv.source and a.target == self.b.node_id
            if pending and force and time.monotonic() < end:
                await asyncio.sleep(1.0)  # no freeze to renew: the leader decides whether the source is dead
                propose = True
                continue
            if pending and time.monotonic() < end:
                # Not committed (yet): re-propose while the source still has exactly what we installed.
                try:
                    fz = await self._call(mv, P.MoveFreezeReq(name, mv.topic_id, part, mv.token, False,
                                                              FREEZE_TTL_MS), P.MoveFreezeResp) if mv.token else None
                except Conflict as e:
                    fz = None
                    if e.code not in ("freeze_lapsed",):
                        raise
                except Exception as e:
                    mv.last_error = f"fence: {type(e).__name__}: {e}"[:300]
                    await asyncio.sleep(1.0)
                    continue
                if fz is not None and fz.hwm == hwm:
                    propose = True
                    await asyncio.sleep(0.2)
                    continue
                if fz is None and mv.token == "":
                    # After a restart: freeze afresh and check the high watermark is still the one installed.
                    try:
                        fz = await self._call(mv, P.MoveFreezeReq(name, mv.topic_id, part, "", False,
                                                                  FREEZE_TTL_MS), P.MoveFreezeResp)
                        mv.token = fz.token
                    except Exception as e:
                        mv.last_error = f"refreeze: {type(e).__name__}: {e}"[:300]
                        await asyncio.sleep(1.0)
                        continue
                    if fz.hwm == hwm:
                        propose = True
                        continue
            # The flip cannot commit as installed (refused, or the source moved on). Undo the
            # install only from a leader read started AMBIGUITY_WAIT after the last proposal.
            if started - last_proposal < AMBIGUITY_WAIT:
                await asyncio.sleep(min(1.0, AMBIGUITY_WAIT - (started - last_proposal)))
                continue
            await self._uninstall(final)
            log.info("move install undone (the flip did not commit)", extra={"topic": name, "partition": part})
            if not pending:
                raise _Aborted()
            return False

    async def _uninstall(self, final: Path) -> None:
        def undo() -> None:
            sd = TR.staging_dir(final)
            if sd.exists():
                shutil.rmtree(sd)
            if final.exists():
                os.rename(final, sd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(sd / "move.marker")
        await self._io(undo)
