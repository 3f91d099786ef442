"""Member duties of every node and controller duties of the Raft leader.

Every node registers its member record (retried every 250 ms until it first
succeeds) and then heartbeats (cluster.heartbeat_interval, 5 s) with its build
and the newest entry type it applies. The leader additionally seeds the root
admin (security on, no root yet), places partitions that have no owner on
record, and marks a member dead after cluster.member_dead_after (30 s) without
a heartbeat: never before it has led that long itself (a new leader does not
mistake its own arrival for silence), never a voter whose mark would leave
fewer than a quorum of voters alive (the breaker), and always naming the
heartbeat it judged, so a heartbeat that lands first wins.

Partition moves (issue 13), on the leader under the metadata service's moves
lock: when a member turns alive and every PLAN_EVERY (10 s) the planner's
targets are proposed as one compare-and-set entry (type 39), after the targets
of moves whose destination is gone are cleared. The decommission driver takes a
draining member that owns nothing and receives nothing, waits for a heartbeat
stamped after that moment reporting an empty dispatch backlog, hands the
leadership over if it is this node, removes it from the Raft voters (never
below 3) and then removes its member record, leaving a tombstone (type 42).
What holds each draining member back is kept in ``decommission_blocked``.

Imports narad.meta, narad.metrics and narad.config.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import bcrypt

from narad import BUILD, metrics
from narad.errors import Conflict, NaradError, NotFound
from narad.meta import commands as C
from narad.meta import planner as P
from narad.meta import requests as Q
from narad.meta import versions as V
from narad.meta.records import MemberRecord, UserRecord
from narad.meta.service import MIN_VOTERS, MOVE_TYPES, MetaService

log = logging.getLogger("narad.controller")

TICK = 0.25
HEARTBEAT_EVERY = 5.0  # defaults; the node passes cluster.heartbeat_interval / member_dead_after
DEAD_AFTER = 30.0
PLACEMENT_EVERY = 10.0
PRUNE_EVERY = 60.0  # orphan assignment rows: at takeover, then about every minute
PLAN_EVERY = float(os.environ.get("NARAD_MOVE_PLAN_MS", "10000")) / 1000  # the move planner's tick
REMOVED_RETRY = 30.0  # a removed node asks again this often (its registration and heartbeats are refused)
BACKLOG_MARGIN_MS = 2000  # gauges up to 1 s old, the value sent up to 1 s more: a heartbeat counts after this
MOVES_SOON = 1.0  # the move duties run this soon after a change, or while a member drains
REMOVE_WAIT = 10.0  # a Raft server removal that did not commit within this is retried next tick


def admin_password(data_dir: Path) -> tuple[str, Path | None]:
    """The root admin's password: $NARAD_ADMIN_PASSWORD, else the one kept in
    <data_dir>/admin-password (generated once, mode 0600, never overwritten)."""
    env = os.environ.get("NARAD_ADMIN_PASSWORD")
    if env:
        return env, None
    path = data_dir / "admin-password"
    if path.exists():
        return path.read_text().strip(), path
    pw = secrets.token_urlsafe(18)
    tmp = path.with_name(".admin-password.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(pw + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.link(tmp, path)  # fails if someone created it meanwhile: never overwrite
    os.unlink(tmp)
    return pw, path


class Controller:
    def __init__(
        self,
        meta: MetaService,
        router: Any,
        *,
        member: MemberRecord,
        data_dir: Path,
        security: bool,
        versions: V.VersionTable,
        heartbeat_every: float = HEARTBEAT_EVERY,
        dead_after: float = DEAD_AFTER,
        backlog: Callable[[], Awaitable[int]] | None = None,
        plan_every: float | None = None,
    ) -> None:
        self.meta = meta
        self.router = router
        self.raft = meta.raft
        self.store = meta.store
        self.member = member
        self.data_dir = data_dir
        self.security = security
        self.versions = versions
        self.heartbeat_every = heartbeat_every
        self.dead_after = dead_after
        self.refused_marks = 0  # dead marks the quorum breaker refused (metric)
        self.registered = asyncio.Event()
        self._last_heartbeat = 0.0
        self._leader_since: float | None = None
        self._seeded = False
        self._placement_key: tuple[int, int, int] | None = None
        self._last_placement = 0.0
        self._last_prune = -PRUNE_EVERY
        self._stop = asyncio.Event()
        # This node's dispatch backlog for its heartbeat (-1: unknown).
        self.backlog = backlog
        self.removed = False  # the cluster removed this node (its heartbeats are refused)
        self._removed_at = 0.0
        # Moves and decommission (leader).
        self.plan_every = PLAN_EVERY if plan_every is None else plan_every
        self._last_plan = -1e9
        self._alive: set[str] = set()
        self._moves_key: tuple[int, int] | None = None
        self.decommission_blocked: dict[str, list[Q.Reason]] = {}
        self._blocked_logged: dict[str, set[str]] = {}
        self._empty_since: dict[str, int] = {}  # draining member -> leader ms it was first seen owning nothing
        self._move_types_logged = False

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                await self.tick()
            except Exception as e:  # keep the loop alive; the next tick retries
                log.warning("controller tick failed", extra={"err": f"{type(e).__name__}: {e}"})
            try:
                await asyncio.wait_for(self._stop.wait(), TICK)
            except TimeoutError:
                pass

    def stop(self) -> None:
        self._stop.set()

    async def tick(self) -> None:
        now = time.monotonic()
        if self.raft.status().role == "stopped":
            return  # not admitted yet (join-only node)
        if self.removed and now - self._removed_at < REMOVED_RETRY:
            pass  # removed from the cluster: asked again only every 30 s
        elif not self.registered.is_set():
            # Retried every tick (250 ms) until it first succeeds; the leader stamps it.
            try:
                await asyncio.wait_for(self.router.execute(Q.RegisterReq(self.member)), 2.0)
            except Conflict as e:
                self._refused(e, now)
            except (NaradError, TimeoutError) as e:
                log.debug("member registration not done yet", extra={"err": str(e)})
            else:
                self.registered.set()
                self.removed = False
                self._last_heartbeat = now
                log.info("member registered", extra={"node": self.member.id})
        elif now - self._last_heartbeat >= self.heartbeat_every:
            self._last_heartbeat = now
            try:
                backlog = await self._backlog()
                await asyncio.wait_for(self.router.execute(Q.HeartbeatReq(
                    self.member.id, BUILD, self.member.newest_entry_type, self.member.client_addr,
                    self.member.cluster_addr, list(self.member.entry_types), backlog)),
                    max(self.heartbeat_every, 2.0))
            except NotFound:
                self.registered.clear()
            except Conflict as e:
                self._refused(e, now)
            except (NaradError, TimeoutError) as e:
                metrics.get().member_heartbeat_failures.inc()
                log.warning("heartbeat failed", extra={"err": str(e)})
        if self.raft.is_leader():
            if self._leader_since is None:
                self._leader_since = now
            await self._leader_duties(now)
        else:
            self._leader_since = None
            self._seeded = False
            self._last_prune = -PRUNE_EVERY  # a future takeover prunes at once
            # A future takeover plans at once and sees every drain afresh (a new heartbeat after its own look).
            self._alive, self._moves_key, self._last_plan = set(), None, -1e9
            self.decommission_blocked, self._blocked_logged, self._empty_since = {}, {}, {}

    def _refused(self, e: Conflict, now: float) -> None:
        if e.code != "removed":
            log.warning("member registration or heartbeat refused", extra={"err": e.message})
            return
        if not self.removed:
            log.error("this node was removed from the cluster (decommissioned); it rejoins only with an empty "
                      "data dir", extra={"node": self.member.id, "err": e.message})
        self.removed = True
        self._removed_at = now
        self.registered.clear()

    async def _backlog(self) -> int:
        if self.backlog is None:
            return -1
        try:
            return int(await asyncio.wait_for(self.backlog(), 3.0))
        except Exception as e:  # unknown: the decommission driver waits for a known 0
            log.debug("dispatch backlog unknown", extra={"err": f"{type(e).__name__}: {e}"})
            return -1

    async def _leader_duties(self, now: float) -> None:
        await self.meta._leader_view()
        if self.security and not self._seeded:
            await self.seed_root_admin()
        key = (self.versions.load(V.TOPICS), self.versions.load(V.ASSIGNMENTS), self.versions.load(V.MEMBERS))
        if key != self._placement_key or now - self._last_placement >= PLACEMENT_EVERY:
            self._placement_key = key
            self._last_placement = now
            await self.place_unassigned()
        if now - self._last_prune >= PRUNE_EVERY:
            self._last_prune = now
            await self.meta.prune_orphan_assignments()
        if self._leader_since is not None and now - self._leader_since >= self.dead_after:
            await self.mark_silent_members_dead()
        await self.move_duties(now)

    async def seed_root_admin(self) -> None:
        with self.store.read() as r:
            if r.root_user() is not None:
                self._seeded = True
                return
        pw, path = admin_password(self.data_dir)
        hashed = await asyncio.to_thread(bcrypt.hashpw, pw.encode(), bcrypt.gensalt(10))
        res = await self.meta.write(C.CreateUser(UserRecord(username="admin", password_hash=hashed, root=True)))
        if res.ok:
            if path is not None:
                log.warning("root admin created; its password is in the file named here (never logged)",
                            extra={"user": "admin", "password_file": str(path)})
            else:
                log.info("root admin created from NARAD_ADMIN_PASSWORD", extra={"user": "admin"})
        self._seeded = True

    async def place_unassigned(self) -> None:
        with self.store.read() as r:
            topics = r.topics()
            pending = []
            for t in topics:
                rows = r.assignments(t.name)
                missing = [p for p in range(t.partitions) if p not in rows or rows[p].topic_id != t.id]
                if missing:
                    pending.append((t.name, t.id, missing))
        for name, topic_id, missing in pending:
            if await self.meta.place_partitions(name, topic_id, missing):
                log.info("placed unassigned partitions", extra={"topic": name, "partitions": len(missing)})

    async def mark_silent_members_dead(self) -> None:
        now_ms = self.meta.now_ms()
        with self.store.read() as r:
            members = r.members()
        voters = set(self.raft.voters())
        quorum = len(voters) // 2 + 1
        alive_voters = {m.raft_addr for m in members if m.status == "alive" and m.raft_addr in voters}
        for m in members:
            if m.id == self.member.id or m.status != "alive":
                continue
            if now_ms - m.heartbeat_ms <= self.dead_after * 1000:
                continue
            if m.raft_addr in voters and len(alive_voters) - 1 < quorum:
                # We lead, so a quorum of voters answers us: marking one more dead would record
                # less than a quorum alive, which cannot be true. Its silence is ours to doubt.
                self.refused_marks += 1
                log.warning("not marking a silent voter dead: that would leave fewer than a quorum alive",
                            extra={"node": m.id, "alive_voters": len(alive_voters), "quorum": quorum})
                continue
            if self.meta.use_type(C.EntryType.MARK_DEAD_OBSERVED):
                res = await self.meta.write(C.MarkDeadObserved(m.id, m.heartbeat_ms))
            else:
                res = await self.meta.write(C.MarkDead(m.id))
            if res.ok:
                alive_voters.discard(m.raft_addr)
                log.warning("member marked dead", extra={"node": m.id,
                                                         "silent_seconds": (now_ms - m.heartbeat_ms) / 1000})

    # ---- partition moves and decommission (issue 13) ----------------------------------------
    def _moves_enabled(self) -> bool:
        held = [t for t in MOVE_TYPES if self.meta.holds_back(t) is not None]
        if held:
            if not self._move_types_logged:
                self._move_types_logged = True
                log.info("partition moves wait until every member applies raft entry types 39-42",
                         extra={"held_back_by": self.meta.holds_back(held[0])})
            return False
        return True

    async def move_duties(self, now: float) -> None:
        """Leader: clear dead targets, plan (when a member turned alive, and every
        plan_every), drive decommissions. Everything under the moves lock."""
        if not self._moves_enabled():
            self.decommission_blocked = {}
            metrics.drop_children(metrics.get().decommission_blocked, lambda labels: True)
            return
        with self.store.read() as r:
            members = r.members()
        alive = {m.id for m in members if m.status == "alive"}
        turned_alive = bool(alive - self._alive)
        self._alive = alive
        # Also soon (at most once a second) after the assignments or members changed (a flip frees a
        # slot, a drain starts), and every second while a member drains (its heartbeats are awaited).
        key = (self.versions.load(V.ASSIGNMENTS), self.versions.load(V.MEMBERS))
        soon = key != self._moves_key or any(m.draining for m in members)
        since = now - self._last_plan
        if not (turned_alive or since >= self.plan_every or (soon and since >= MOVES_SOON)):
            return
        self._last_plan = now
        self._moves_key = key
        async with self.meta.moves_lock:
            await self.meta._leader_view()
            await self.clear_dead_targets()
            await self.plan_moves()
            await self.drive_decommissions()

    def _snapshot(self) -> tuple[list[P.Row], list[MemberRecord]]:
        rows = self.meta.live_assignments()
        with self.store.read() as r:
            members = r.members()
        return rows, members

    async def clear_dead_targets(self) -> int:
        rows, members = self._snapshot()
        clear = P.dead_target_rows(rows, members, now_ms=self.meta.now_ms(), raft_servers=set(self.raft.servers()))
        if not clear:
            return 0
        res = await self.meta.write(C.SetMoveTargets(clear))
        if not res.ok:
            log.info("clearing dead move targets refused; the next pass reads again", extra={"err": res.message})
            return 0
        for mv in clear:
            log.warning("move target cleared: its destination is gone, dead for 2 min, or out of the Raft "
                        "configuration", extra={"topic": mv.topic, "partition": mv.partition, "owner": mv.owner,
                                                "target": mv.expect_target})
        return len(clear)

    async def plan_moves(self) -> int:
        rows, members = self._snapshot()
        targets = P.plan(rows, members)
        if not targets:
            return 0
        res = await self.meta.write(C.SetMoveTargets(targets))
        if not res.ok:
            log.info("move plan refused; the next pass plans again", extra={"err": res.message})
            return 0
        log.info("partition moves planned", extra={"moves": len(targets), "rows": [
            f"{mv.topic}/{mv.partition}:{mv.owner}->{mv.target}" for mv in targets]})
        return len(targets)

    def _block(self, node: str, reasons: list[Q.Reason]) -> None:
        self.decommission_blocked[node] = reasons
        gauge = metrics.get().decommission_blocked
        metrics.drop_children(gauge, lambda labels: labels[0] == node)
        for x in reasons:
            gauge.labels(node, x.code).set(1)
        logged = self._blocked_logged.setdefault(node, set())
        codes = {x.code for x in reasons}
        for x in reasons:
            if x.code not in logged:
                log.warning("decommission blocked", extra={"node": node, "reason": x.code, "detail": x.message})
        logged.intersection_update(codes)
        logged.update(codes)

    async def drive_decommissions(self) -> None:
        rows, members = self._snapshot()
        draining = sorted((m for m in members if m.draining), key=lambda m: m.id)
        ids = {m.id for m in draining}
        for gone in set(self.decommission_blocked) - ids:
            self.decommission_blocked.pop(gone, None)
            self._blocked_logged.pop(gone, None)
            metrics.drop_children(metrics.get().decommission_blocked, lambda labels, g=gone: labels[0] == g)
        for gone in set(self._empty_since) - ids:
            self._empty_since.pop(gone, None)
        receivers = [m for m in members if m.status == "alive" and not m.draining]
        in_flight = sum(1 for _, _, a in rows if a.target is not None)
        for m in draining:
            await self._drive_one(m, rows, receivers, in_flight)

    async def _drive_one(self, m: MemberRecord, rows: list[P.Row], receivers: list[MemberRecord],
                         in_flight: int) -> None:
        now_ms = self.meta.now_ms()
        owned = [(t, p, a) for t, p, a in rows if a.owner == m.id]
        inbound = [(t, p, a) for t, p, a in rows if a.target == m.id]
        reasons: list[Q.Reason] = []
        if owned:
            self._empty_since.pop(m.id, None)
            waiting = [r for r in owned if r[2].target is None]
            if m.status != "alive":
                reasons.append(Q.Reason("owner_dead", f"{m.id} is dead and owns {len(owned)} partitions: they "
                                                      "move only once it is back"))
            elif not receivers:
                reasons.append(Q.Reason("no_receivers", "no member is alive and not draining to receive its "
                                                        f"{len(owned)} partitions"))
            elif waiting and in_flight >= P.MAX_IN_FLIGHT:
                reasons.append(Q.Reason("move_budget_full", f"{len(waiting)} of its partitions wait for one of "
                                                            f"the {P.MAX_IN_FLIGHT} move slots"))
        if inbound:
            self._empty_since.pop(m.id, None)
            reasons.append(Q.Reason("move_target", f"{len(inbound)} moves still target {m.id}: they finish "
                                                   "(or are aborted) first"))
        if owned or inbound:
            self._block(m.id, reasons)
            return
        since = self._empty_since.setdefault(m.id, now_ms)
        if m.status != "alive":
            self._block(m.id, [Q.Reason("node_status_unavailable", f"{m.id} is dead: its dispatch backlog cannot "
                                                                   "be read")])
            return
        if m.heartbeat_ms < since + BACKLOG_MARGIN_MS:
            self._block(m.id, [])  # its next heartbeat says whether its backlog drained
            return
        if m.dispatch_backlog < 0:
            self._block(m.id, [Q.Reason("node_status_unavailable", f"{m.id} did not report its dispatch backlog")])
            return
        if m.dispatch_backlog > 0:
            self._block(m.id, [Q.Reason("dispatch_backlog", f"{m.id} still holds {m.dispatch_backlog} records "
                                                            "not yet at their owner")])
            return
        voters = set(self.raft.voters())
        if m.raft_addr in voters:
            if len(voters) - 1 < MIN_VOTERS:
                self._block(m.id, [Q.Reason("below_min_voters", f"removing {m.id} leaves {len(voters) - 1} Raft "
                                                                f"voters, fewer than {MIN_VOTERS}")])
                return
            if m.raft_addr == self.raft.self_addr:
                self._block(m.id, [Q.Reason("leader_transfer", f"{m.id} leads the cluster: handing the "
                                                               "leadership over first")])
                self.raft.transfer_leadership()
                return
            st = self.raft.status()
            rest = voters - {m.raft_addr}
            healthy = {a for a in rest if a == self.raft.self_addr or st.peers.get(a)}
            if len(healthy) < len(rest) // 2 + 1:
                self._block(m.id, [Q.Reason("no_healthy_majority", f"only {len(healthy)} of the {len(rest)} "
                                                                   "remaining voters are connected")])
                return
            if not await self._remove_server(m):
                return
        res = await self.meta.write(C.RemoveMember(m.id))
        if res.ok:
            self.decommission_blocked.pop(m.id, None)
            self._blocked_logged.pop(m.id, None)
            metrics.drop_children(metrics.get().decommission_blocked, lambda labels: labels[0] == m.id)
            self._empty_since.pop(m.id, None)
            log.warning("member decommissioned: removed from the cluster, its id is refused until it rejoins "
                        "with an empty data dir", extra={"node": m.id})
        else:
            log.info("member removal refused; the next pass looks again", extra={"node": m.id, "err": res.message})

    async def _remove_server(self, m: MemberRecord) -> bool:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[bool, str]] = loop.create_future()

        def finished(ok: bool, why: str) -> None:
            if not done.done():
                done.set_result((ok, why))

        self.raft.remove_server(m.raft_addr, finished)
        try:
            ok, why = await asyncio.wait_for(done, REMOVE_WAIT)
        except TimeoutError:
            ok, why = False, f"not committed within {REMOVE_WAIT:g} s"
        if not ok:
            log.warning("removing a decommissioned voter from Raft failed; retried next pass",
                        extra={"node": m.id, "server": m.raft_addr, "err": why})
            return False
        log.info("decommissioned voter removed from Raft", extra={"node": m.id, "server": m.raft_addr})
        return True
