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

Imports narad.meta, narad.metrics and narad.config.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

import bcrypt

from narad import BUILD, metrics
from narad.errors import NaradError, NotFound
from narad.meta import commands as C
from narad.meta import requests as Q
from narad.meta import versions as V
from narad.meta.records import MemberRecord, UserRecord
from narad.meta.service import MetaService

log = logging.getLogger("narad.controller")

TICK = 0.25
HEARTBEAT_EVERY = 5.0  # defaults; the node passes cluster.heartbeat_interval / member_dead_after
DEAD_AFTER = 30.0
PLACEMENT_EVERY = 10.0
PRUNE_EVERY = 60.0  # orphan assignment rows: at takeover, then about every minute


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
        if not self.registered.is_set():
            # Retried every tick (250 ms) until it first succeeds; the leader stamps it.
            try:
                await asyncio.wait_for(self.router.execute(Q.RegisterReq(self.member)), 2.0)
            except (NaradError, TimeoutError) as e:
                log.debug("member registration not done yet", extra={"err": str(e)})
            else:
                self.registered.set()
                self._last_heartbeat = now
                log.info("member registered", extra={"node": self.member.id})
        elif now - self._last_heartbeat >= self.heartbeat_every:
            self._last_heartbeat = now
            try:
                await asyncio.wait_for(self.router.execute(Q.HeartbeatReq(
                    self.member.id, BUILD, self.member.newest_entry_type, self.member.client_addr,
                    self.member.cluster_addr, list(self.member.entry_types))), max(self.heartbeat_every, 2.0))
            except NotFound:
                self.registered.clear()
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
