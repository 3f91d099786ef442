"""The metadata service: every metastore write of the node goes through here.

Runs in the supervisor. It re-checks each request against the local replica
(authorization, existence, rules), stamps what apply must not compute (clock,
incarnation ids), proposes one Raft entry per change with a request id and a
deadline, and answers once the local FSM committed the entry, so a read on
this node right after the answer sees the write. Leader-side checks run
under a per-name lock and, once per Raft term, after a barrier (an election
proves the log; only a barrier proves the state).

Imports narad.meta.* and narad.errors; used by the supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import secrets
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from narad.config import Config
from narad.errors import (
    ATTACH_POINT,
    BadRequest,
    Conflict,
    Forbidden,
    Misdirected,
    NotFound,
    PreconditionFailed,
    Unavailable,
)
from narad.meta import commands as C
from narad.meta import export as EX
from narad.meta import fsm as F
from narad.meta import grants as G
from narad.meta import planner as P
from narad.meta import requests as Q
from narad.meta import schemas as S
from narad.meta import validate as VAL
from narad.meta.raft import RaftNode, RaftUnavailable
from narad.meta.records import AssignmentRecord, Grant, MemberRecord, TopicRecord, UserRecord
from narad.meta.store import MetaStore

log = logging.getLogger("narad.meta.service")
FORGET_MIN_LEADERSHIP = 12.0  # a leader forgets a Raft server only after leading this long
MIN_VOTERS = 3  # a decommission never leaves fewer Raft voters
FLIP_ANSWER_HOLD = float(os.environ.get("NARAD_FAULT_FLIP_ANSWER_HOLD_MS", "0")) / 1000.0  # tests only
FORCE_PROMOTE_AFTER_MS = int(os.environ.get("NARAD_MOVE_FORCE_AFTER_MS", "120000"))  # dead source: flip anyway
MOVE_TYPES = (C.EntryType.SET_MOVE_TARGETS, C.EntryType.COMPLETE_MOVE, C.EntryType.SET_DRAINING,
              C.EntryType.REMOVE_MEMBER)
audit = logging.getLogger("narad.audit")

# The Raft index of the last entry this task proposed: a node that forwarded the
# request waits until its own replica reaches it before answering.
last_index: contextvars.ContextVar[int] = contextvars.ContextVar("narad_last_index", default=0)
# The request being served (its id from the node that took it, and how many entries
# it proposed so far): each entry's request id is "<id>:<n>", so the same request run
# again on a new leader after a leader change proposes the same ids, and the state
# machine answers every entry that already applied with its first result.
request_scope: contextvars.ContextVar[tuple[str, list[int]] | None] = contextvars.ContextVar(
    "narad_request_scope", default=None)

RETRY_SLEEP = 0.05
FORMING_WAIT = 2.0  # a create waits this long (once) for voters without a member record

# Checking a schema for registration (meta-schema, RE2 compiles, cost analysis) can take
# seconds of CPU for a 256 KiB document: it runs on one thread of its own so the
# supervisor's loop (heartbeats, Raft completions, worker RPC) keeps turning.
# The queue is bounded: at most SCHEMA_CHECKS_QUEUED checks wait or run, and a check
# the thread has not started within SCHEMA_CHECK_WAIT_S is withdrawn; both answer 503
# "retry" before anything is proposed (never a 504 while the write applies later).
_SCHEMA_CHECKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="schema-check")
SCHEMA_CHECKS_QUEUED = 4
SCHEMA_CHECK_WAIT_S = 5.0
_schema_checks_pending = 0


def _schema_checks_busy() -> Unavailable:
    return Unavailable("schema checks busy: other schema registrations are being checked; nothing was "
                       "changed, retry", headers=[("Retry-After", "1")])


async def _off_loop(fn: Callable[[bytes], Any], raw: bytes) -> Any:
    global _schema_checks_pending
    if _schema_checks_pending >= SCHEMA_CHECKS_QUEUED:
        raise _schema_checks_busy()
    loop = asyncio.get_running_loop()

    def finished() -> None:
        global _schema_checks_pending
        _schema_checks_pending -= 1

    cf = _SCHEMA_CHECKS.submit(fn, raw)
    _schema_checks_pending += 1
    def on_done(_: object) -> None:
        try:
            loop.call_soon_threadsafe(finished)
        except RuntimeError:  # the loop closed (stopping)
            pass

    cf.add_done_callback(on_done)
    fut = asyncio.wrap_future(cf)
    done, _ = await asyncio.wait({fut}, timeout=SCHEMA_CHECK_WAIT_S)
    if not done and cf.cancel():  # not started yet: withdrawn, nothing proposed
        raise _schema_checks_busy()
    return await fut


class MetaService:
    def __init__(
        self,
        cfg: Config,
        raft: RaftNode,
        store: MetaStore,
        node_id: str,
        *,
        clock: Callable[[], float] = time.time,
        applies: frozenset[int] = C.APPLIED_TYPES,
    ) -> None:
        self.cfg = cfg
        self.raft = raft
        self.store = store
        self.node_id = node_id
        self.clock = clock
        self.write_timeout = cfg.seconds("cluster", "write_timeout")
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._barrier_term = -1
        self._forming_since: float | None = None
        self.applies = applies  # the entry types this node applies (a setting can stand in for an older release)
        self._announced: set[int] = set()
        self._held_logged: dict[int, float] = {}
        self._orphans_logged: set[tuple[str, int]] = set()
        # Held by the controller's planning pass, an abort and a decommission: each reads
        # the assignments and proposes targets from what it read.
        self.moves_lock = asyncio.Lock()
        self.stopped = False

    # ---- proposing -------------------------------------------------------------
    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    async def write(
        self, payload: msgspec.Struct, *, request_id: str | None = None, deadline: float | None = None
    ) -> C.ApplyResult:
        """Propose one entry; retry (same request id) until it applies or the
        deadline passes. Raises Unavailable on no leader / no quorum."""
        if self.stopped:
            raise Unavailable("metastore stopped applying raft entries; the node is stopping")
        rid = request_id or self._next_request_id() or uuid.uuid4().hex
        end = deadline if deadline is not None else time.monotonic() + self.write_timeout
        data = C.encode(payload, request_id=rid, stamp_ms=self.now_ms())
        uncertain = False
        last_err = "no raft leader"
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                msg = f"metadata write failed: {last_err}"
                if uncertain:
                    msg += "; the write may have landed, read it back before retrying"
                raise Unavailable(msg, headers=[("Retry-After", "1")])
            try:
                res = await self.raft.propose(data, min(remaining, max(1.0, self.write_timeout / 3)))
                if res.index > last_index.get():
                    last_index.set(res.index)
                return res
            except RaftUnavailable as e:
                last_err = e.message
                if "timed out" in e.message or "unknown" in e.message or "changed" in e.message:
                    uncertain = True
                if self.stopped:
                    raise Unavailable("metastore stopped applying raft entries; the node is stopping") from None
                await asyncio.sleep(min(RETRY_SLEEP, max(0.0, end - time.monotonic())))

    async def barrier(self, timeout: float = 5.0) -> int:
        """Wait until this node's FSM applied everything committed so far."""
        res = await self.write(C.Noop(), request_id=uuid.uuid4().hex, deadline=time.monotonic() + timeout)
        return res.index

    # ---- requests run again after a leader change ------------------------------------------
    @staticmethod
    def _next_request_id() -> str | None:
        scope = request_scope.get()
        if scope is None:
            return None
        base, counter = scope
        counter[0] += 1
        return f"{base}:{counter[0] - 1}"

    def request_applied(self, writes: int = 4) -> bool:
        """Whether one of the first ``writes`` entries of the request being served
        already applied (it ran on a leader that lost its leadership before it could
        answer): the caller answers from the state instead of refusing what it did."""
        scope = request_scope.get()
        if scope is None:
            return False
        with self.store.read() as r:
            return any((res := r.request_result(f"{scope[0]}:{n}")) is not None and res.code == C.Result.OK
                       for n in range(writes))

    async def dispatch_as(self, req: msgspec.Struct, request_id: str) -> msgspec.Struct:
        """``dispatch`` with the entries it proposes named after ``request_id``."""
        token = request_scope.set((request_id, [0]))
        try:
            return await self.dispatch(req)
        finally:
            request_scope.reset(token)

    # ---- entry-type gating --------------------------------------------------------
    def holds_back(self, t: int) -> str | None:
        """Why raft entry type `t` may not be proposed yet (None: every Raft server and
        every member record reports a release applying it). Reads this node's replica
        and each member's last report, however old: a member that is down counts with
        the release it last reported."""
        if t in C.BASE_TYPES:
            return None
        if t not in self.applies:
            return f"this node ({self.node_id}) does not apply it"
        with self.store.read() as r:
            members = r.members()
        addrs = {m.raft_addr for m in members}
        for addr in self.raft.servers():  # voters and non-voters
            if addr != self.raft.self_addr and addr not in addrs:
                return f"Raft server {addr} has no member record yet"
        for m in members:
            if m.id != self.node_id and t not in C.types_reported(m.entry_types, m.newest_entry_type):
                return (f"member {m.id} (build {m.build or 'unknown'}) does not apply it (its newest is "
                        f"{m.newest_entry_type})")
        return None

    def use_type(self, t: int) -> bool:
        """Whether to propose compare-and-set type `t` now; logs the first use, and
        what holds it back at most once a minute."""
        why = self.holds_back(t)
        name = C.EntryType(t).name.lower()
        if why is None:
            if t not in self._announced:
                self._announced.add(t)
                log.info(f"metastore: every member applies raft entry type {t}; using {name}")
            return True
        now = time.monotonic()
        if now - self._held_logged.get(t, -1e9) >= 60.0:
            self._held_logged[t] = now
            log.info("metastore: not using a new raft entry type yet; proposing the entries every member applies",
                     extra={"type": t, "entry": name, "held_back_by": why})
        return False

    async def _leader_view(self) -> None:
        """Before trusting the local replica for a decision, a leader passes a
        barrier once per term."""
        st = self.raft.status()
        if st.role == "leader" and st.term != self._barrier_term:
            await self.barrier()
            self._barrier_term = st.term

    def _require_type(self, t: int, what: str) -> None:
        """412 naming what holds entry type ``t`` back, for writes that have no older
        entry to fall back to."""
        if not self.use_type(t):
            raise PreconditionFailed(f"{what} needs every member to apply raft entry type {int(t)}: "
                                     f"{self.holds_back(t) or 'a member does not apply it yet'}")

    @contextlib.asynccontextmanager
    async def _name_locks(self, *names: str) -> AsyncIterator[None]:
        """The per-name locks of several topics, taken in casefolded-name order (two
        requests locking the same pair can never each hold one and wait for the other)."""
        async with contextlib.AsyncExitStack() as stack:
            for key in sorted({n.casefold() for n in names}):
                await stack.enter_async_context(self._locks[key])
            if FLOW_LOCK in names:
                # A flow write whose Raft write timed out ("may have landed") let go of the
                # lock with its entry still able to commit: a barrier orders this check after
                # every entry proposed before it (Raft keeps their order, and an entry a later
                # leader's barrier does not find never commits), so it reads them applied.
                try:
                    await self.barrier(self.write_timeout)
                except Unavailable as e:
                    raise Unavailable("metadata write not started (nothing was written): this node could not "
                                      f"confirm its metastore replica is current: {e}",
                                      headers=[("Retry-After", "1")]) from None
            yield

    # ---- helpers ----------------------------------------------------------------
    def _user(self, who: G.Identity) -> UserRecord | None:
        if who.name is None:
            return None
        with self.store.read() as r:
            return r.user(who.name)

    def _require_known(self, who: G.Identity) -> UserRecord | None:
        if who.unrestricted:
            return None
        user = self._user(who)
        if user is None:
            raise Forbidden("caller unknown to the leader")
        return user

    @staticmethod
    def _check(res: C.ApplyResult, what: str) -> None:
        if res.code == C.Result.OK:
            return
        if res.code == C.Result.EXISTS:
            raise Conflict(res.message)
        if res.code == C.Result.NOT_FOUND:
            raise NotFound(res.message)
        if res.code == C.Result.CHANGED:
            raise Conflict(f"{what} changed since it was read")
        if res.code == C.Result.INVALID:
            raise BadRequest(f"invalid argument: {res.message}")
        raise Conflict(res.message or f"{what} refused")

    def _topic_defaults(self) -> tuple[int, int, int, int, int]:
        t = self.cfg.topic
        return (t.default_partitions, t.default_retention_age_ms, t.default_visibility_timeout_ms,
                t.default_max_in_flight_per_partition, t.default_max_acked_ahead_per_partition)

    def alive_members(self) -> list[MemberRecord]:
        with self.store.read() as r:
            return sorted((m for m in r.members() if m.status == "alive" and not m.draining), key=lambda m: m.id)

    # ---- topics -------------------------------------------------------------------
    async def create_topic(self, req: Q.CreateTopicReq) -> TopicRecord:
        name = VAL.topic_name(req.name)
        d_parts, d_ret, d_vis, d_inflight, d_ahead = self._topic_defaults()
        if req.parent is None:
            if req.fanout_delay_ms:
                raise BadRequest("invalid argument: fanout_delay_ms needs parent")
            parts = VAL.partitions(req.partitions or d_parts, self.cfg.topic.max_partitions)
        else:
            if not req.parent:
                raise BadRequest("invalid argument: parent must name a topic")
            if req.parent == name:
                raise BadRequest(f'invalid argument: a topic cannot be its own parent ("{name}")')
            _check_delay("fanout_delay_ms", req.fanout_delay_ms)
            # 0: the parent's partition count, read under the lock.
            parts = VAL.partitions(req.partitions, self.cfg.topic.max_partitions) if req.partitions else 0
        retention = d_ret if req.retention_ms is None else VAL.retention_ms(req.retention_ms)
        vis = VAL.positive_or_default("visibility_timeout_ms", req.visibility_timeout_ms, d_vis)
        inflight = VAL.positive_or_default("max_in_flight_per_partition", req.max_in_flight_per_partition, d_inflight)
        ahead = VAL.positive_or_default("max_acked_ahead_per_partition", req.max_acked_ahead_per_partition, d_ahead)
        if retention and vis > retention:
            raise BadRequest("invalid argument: visibility_timeout_ms must not exceed retention_ms")
        schema = None
        if req.schema is not None:
            await _off_loop(S.parse_registrable, req.schema)
            schema = req.schema
        maxd = VAL.max_deliveries(req.max_deliveries or 0)
        window = VAL.idempotency_window_ms(req.idempotency_window_ms or 0)
        dlt = VAL.topic_name(req.dead_letter_topic) if req.dead_letter_topic else None
        delivery = bool(maxd or window or dlt)
        if maxd and dlt is None:
            raise BadRequest("invalid argument: max_deliveries needs a dead_letter_topic (a record past its last "
                             "delivery goes there, it is never dropped)")
        if dlt is not None and dlt == name:
            raise BadRequest(f'invalid argument: topic "{name}" cannot be its own dead-letter topic')
        user = self._require_known(req.who)
        if not req.who.unrestricted and not G.has_grant(user, "create", name):
            raise Forbidden(f'create not allowed for topic name "{name}"')
        if req.parent is not None:
            if delivery:
                raise BadRequest("invalid argument: create the child first, then set max_deliveries, "
                                 "dead_letter_topic or idempotency_window_ms with PATCH")
            return await self._create_child(req, name, parts, retention, vis, inflight, ahead, schema, user)
        if delivery:
            self._require_type(C.EntryType.SET_DELIVERY, "a topic with delivery settings")
        # The dead-letter topic's lock too: an attach of it as a child (which checks, under
        # its lock, that no topic names it) and this check cannot interleave.
        async with self._name_locks(name, *([dlt, FLOW_LOCK] if dlt else [])):
            await self._leader_view()
            if self.request_applied():
                return self._read_topic(name)  # this very request created it before a leader change
            self._name_free(name)
            if dlt is not None:
                _check_dead_letter_topic(self.store.topic(dlt), dlt, req.who, user)
                _no_dead_letter_cycle(self.store.topic, name, dlt)
            rec = TopicRecord(
                name=name, id=secrets.token_hex(8), partitions=parts, retention_ms=retention,
                visibility_timeout_ms=vis, max_in_flight_per_partition=inflight,
                max_acked_ahead_per_partition=ahead, created_at=int(self.clock()),
                owner=req.who.name if req.who.security and not req.who.operator else None,
                max_deliveries=maxd, dead_letter_topic=dlt, idempotency_window_ms=window,
            )
            for attempt in (1, 2):
                await self.wait_forming()
                owners = self.placement(name, range(parts))
                if self.use_type(C.EntryType.CREATE_TOPIC_CHECKED):
                    res = await self.write(C.CreateTopicChecked(rec, schema, owners))
                else:
                    res = await self.write(C.CreateTopic(rec, schema, owners))
                if res.code != C.Result.CHANGED or attempt == 2:
                    break  # CHANGED: a member left between placement and apply; place again once
            self._check(res, "topic")
            audit.info("topic created", extra={"topic": name, "id": rec.id, "by": req.who.name, "outcome": "ok"})
            return self._read_topic(name)

    def _name_free(self, name: str) -> None:
        """409 unless no topic holds `name`, in any letter case."""
        with self.store.read() as r:
            if r.topic(name) is not None:
                raise Conflict(f'topic "{name}" already exists')
            clash = r.topic_clash(name)
        if clash is not None:
            raise Conflict(f'topic "{name}" clashes with existing topic "{clash}" '
                           "(names are unique regardless of letter case)")

    def _read_topic(self, name: str) -> TopicRecord:
        with self.store.read() as r:
            t = r.topic(name)
        if t is None:
            raise NotFound(f'topic "{name}" not found')
        return t

    # ---- fan-out children ------------------------------------------------------------
    def _may_manage(self, who: G.Identity, user: UserRecord | None, t: TopicRecord) -> None:
        if not who.unrestricted and not G.can_manage_topic(user, t):
            raise Forbidden(f'only the owner of topic "{t.name}" or an admin may modify it')

    def _linked_children(self, t: TopicRecord) -> list[TopicRecord]:
        with self.store.read() as r:
            kids = [r.topic(n) for n in t.children]
        return [c for c in kids if c is not None and c.parent == t.name and c.parent_id == t.id]

    @staticmethod
    def _attach_point(par: TopicRecord, parent_id: str | None, offsets: list[int]) -> None:
        """The attach point the receiving node read must belong to the parent as it is now."""
        if not parent_id:
            raise Unavailable(f'could not ask the owners of every partition of "{par.name}" for the attach point; '
                              "nothing was linked, retry", code=ATTACH_POINT, headers=[("Retry-After", "1")])
        if parent_id != par.id or len(offsets) != par.partitions or any(o < 0 for o in offsets):
            raise Unavailable("parent changed while the attach point was read; retry", code=ATTACH_POINT,
                              headers=[("Retry-After", "1")])

    def _schema_fit(self, par: TopicRecord, child: TopicRecord | None, schema: bytes | None, name: str) -> None:
        """409 when the child's schema (an existing child's history, or the schema a
        create-as-child sent) differs from the parent's: a child adopts its parent's."""
        with self.store.read() as r:
            parent_history = r.schemas(par.name)
            mine = r.schemas(child.name) if child is not None and child.schema_version else []
        if child is not None and child.schema_version:
            if not parent_history:
                raise Conflict(f'topic "{name}" has a schema and its parent "{par.name}" has none')
            if len(mine) != len(parent_history) or not all(
                    F.schema_docs_same(a.schema, b.schema) for a, b in zip(mine, parent_history, strict=True)):
                raise Conflict(f'the schema history of "{name}" differs from the schema history of its parent '
                               f'"{par.name}"')
        if schema is not None:
            if not parent_history:
                raise Conflict(f'topic "{name}" would have a schema and its parent "{par.name}" has none')
            if not F.schema_docs_same(parent_history[-1].schema, schema):
                raise Conflict(f'the schema of "{name}" differs from the schema of its parent "{par.name}"; '
                               "leave it out to adopt the parent's")

    @staticmethod
    def _link_rules(par: TopicRecord, child: TopicRecord, delay_ms: int, *, new: bool = False) -> None:
        """409 naming the fan-out rule the link breaks (``new``: a create-as-child's record)."""
        if len(child.name.encode()) > F.CHILD_NAME_BYTES:
            raise Conflict(f'topic "{child.name}" has a name longer than {F.CHILD_NAME_BYTES} bytes and cannot '
                           "become a child")
        if not new and child.parent is not None:
            raise Conflict(f'topic "{child.name}" already has a parent ("{child.parent}"); a child has exactly '
                           "one parent")
        why = F.link_refusal(par, child, delay_ms)
        if why is not None:
            raise Conflict(why)

    def _not_a_dead_letter_topic(self, name: str) -> None:
        """409 when a topic names `name` as its dead-letter topic: a child is fed by its
        parent only (its records come from there), so it cannot take dead letters."""
        with self.store.read() as r:
            users = [t.name for t in r.topics() if t.dead_letter_topic == name]
        if users:
            raise Conflict(f'topic "{name}" is the dead-letter topic of "{users[0]}" and cannot become a child; '
                           f"point {users[0]}'s dead_letter_topic elsewhere first")

    async def _create_child(self, req: Q.CreateTopicReq, name: str, parts: int, retention: int, vis: int,
                            inflight: int, ahead: int, schema: bytes | None,
                            user: UserRecord | None) -> TopicRecord:
        """Create-as-child: the record, the parent's schema history and the link in one
        type-23 entry (nothing to undo when the link is refused: nothing was created)."""
        parent = req.parent
        assert parent is not None
        delay = req.fanout_delay_ms
        async with self._name_locks(name, parent):
            await self._leader_view()
            if self.request_applied():
                return self._read_topic(name)  # this very request created it before a leader change
            res = C.ApplyResult(C.Result.REFUSED)
            for attempt in (1, 2):
                par = self._read_topic(parent)
                self._may_manage(req.who, user, par)
                self._name_free(name)
                self._require_type(C.EntryType.CREATE_TOPIC_CHECKED, "creating a topic as a child")
                rec = TopicRecord(
                    name=name, id=secrets.token_hex(8), partitions=parts or par.partitions, retention_ms=retention,
                    visibility_timeout_ms=vis, max_in_flight_per_partition=inflight,
                    max_acked_ahead_per_partition=ahead, created_at=int(self.clock()),
                    owner=req.who.name if req.who.security and not req.who.operator else None,
                    parent=par.name, parent_id=par.id, delay_ms=delay, attach_epoch=secrets.token_hex(8),
                    attach_offsets=list(req.attach_offsets),
                )
                self._link_rules(par, rec, delay, new=True)
                self._not_a_dead_letter_topic(name)  # a deleted dead-letter topic created again as a child
                self._schema_fit(par, None, schema, name)
                self._attach_point(par, req.parent_id, req.attach_offsets)
                await self.wait_forming()
                owners = self.placement(name, range(rec.partitions), parent=par)
                res = await self.write(C.CreateTopicChecked(rec, schema, owners))
                if res.code != C.Result.CHANGED:
                    break
                if attempt == 2:
                    raise Conflict("topic changed since it was read", code="topic_changed")
                log.info("parent changed since it was read; checking the create again", extra={"topic": name})
            if res.code == C.Result.INVALID:
                raise Conflict(res.message)
            self._check(res, "topic")
            audit.info("topic created", extra={"topic": name, "id": rec.id, "parent": parent, "by": req.who.name,
                                               "outcome": "ok"})
            return self._read_topic(name)

    async def attach_child(self, req: Q.AttachChildReq) -> TopicRecord:
        """Link an existing topic as a child (type 27); answers the parent after it."""
        if not req.child:
            raise BadRequest("invalid argument: child required")
        if not req.parent:
            raise BadRequest("invalid argument: parent required")
        if req.parent == req.child:
            raise BadRequest(f'invalid argument: a topic cannot be its own child ("{req.child}")')
        _check_delay("delay_ms", req.delay_ms)
        user = self._require_known(req.who)
        async with self._name_locks(req.parent, req.child, FLOW_LOCK):
            await self._leader_view()
            if self.request_applied():
                return self._read_topic(req.parent)  # this very request attached it before a leader change
            for attempt in (1, 2):
                par = self._read_topic(req.parent)
                child = self._read_topic(req.child)
                self._may_manage(req.who, user, par)
                self._may_manage(req.who, user, child)
                self._require_type(C.EntryType.ATTACH_CHILD_CAS, "attaching a child")
                self._link_rules(par, child, req.delay_ms)
                self._not_a_dead_letter_topic(child.name)
                if child.dead_letter_topic == par.name:
                    raise Conflict(f'topic "{child.name}" names "{par.name}" as its dead-letter topic: as its '
                                   f"child, its dead letters would be copied straight back into it; point its "
                                   f"dead_letter_topic elsewhere first")
                back = _flow_path(self.store.topic, child.name, par.name)
                if back is not None:  # (through dead-letter topics: the attach would close a cycle)
                    raise Conflict(f"attaching {child.name!r} under {par.name!r} closes a cycle of dead-letter "
                                   f"topics ({' -> '.join([par.name, *back])}): a record failing in each would "
                                   f"go round for ever; change a dead_letter_topic on the way first")
                self._schema_fit(par, child, None, child.name)
                self._attach_point(par, req.parent_id, req.attach_offsets)
                res = await self.write(C.AttachChildCas(par.name, par.id, child.name, child.id, req.delay_ms,
                                                        secrets.token_hex(8), list(req.attach_offsets)))
                if res.code == C.Result.OK:
                    audit.info("child attached", extra={"topic": par.name, "child": child.name,
                                                        "delay_ms": req.delay_ms, "by": req.who.name,
                                                        "outcome": "ok"})
                    return self._read_topic(req.parent)
                if res.code == C.Result.INVALID:
                    raise Conflict(res.message)
                if res.code != C.Result.CHANGED:
                    self._check(res, "topic")
                if attempt == 2:
                    raise Conflict("topic changed since it was read", code="topic_changed")
                log.info("topic changed since it was read; checking the attach again", extra={"topic": par.name})
        raise AssertionError("unreachable")

    async def detach_child(self, req: Q.DetachChildReq) -> None:
        """Unlink a child (type 28): it becomes standalone and keeps its data and schemas."""
        if not req.child or not req.parent:
            raise BadRequest("invalid argument: parent and child required")
        user = self._require_known(req.who)
        async with self._name_locks(req.parent, req.child):
            await self._leader_view()
            if self.request_applied():
                return  # this very request detached it before a leader change
            for attempt in (1, 2):
                par = self._read_topic(req.parent)
                child = self._read_topic(req.child)
                if not req.who.unrestricted and not (G.can_manage_topic(user, par)
                                                     or G.can_manage_topic(user, child)):
                    raise Forbidden(f'only the owner of topic "{par.name}" or of topic "{child.name}", or an admin, '
                                    "may detach them")
                if child.parent != par.name or child.parent_id != par.id or child.name not in par.children:
                    raise NotFound(f'topic "{child.name}" is not a child of "{par.name}"')
                self._require_type(C.EntryType.DETACH_CHILD_CAS, "detaching a child")
                res = await self.write(C.DetachChildCas(par.name, par.id, child.name, child.id))
                if res.code == C.Result.OK:
                    audit.info("child detached", extra={"topic": par.name, "child": child.name,
                                                        "by": req.who.name, "outcome": "ok"})
                    return
                if res.code != C.Result.CHANGED:
                    self._check(res, "topic")
                if attempt == 2:
                    raise Conflict("topic changed since it was read", code="topic_changed")
                log.info("topic changed since it was read; checking the detach again", extra={"topic": par.name})

    async def confirm_epoch(self, req: Q.ConfirmEpochReq) -> Q.ConfirmEpochResp:
        """Whether ``req.child`` is definitely linked to ``req.parent`` under ``req.epoch``:
        only the leader answers (known), after a barrier (everything committed applied)
        and a re-read. Not the leader, or no barrier: known=False (do nothing destructive)."""
        if not self.raft.is_leader():
            return Q.ConfirmEpochResp(False, known=False)
        try:
            await self.barrier()
        except Unavailable:
            return Q.ConfirmEpochResp(False, known=False)
        if not self.raft.is_leader():
            return Q.ConfirmEpochResp(False, known=False)
        with self.store.read() as r:
            c = r.topic(req.child)
        linked = (c is not None and c.id == req.child_id and c.parent == req.parent
                  and c.parent_id == req.parent_id and c.attach_epoch == req.epoch)
        return Q.ConfirmEpochResp(linked, known=True)

    def _unregistered_voters(self) -> list[str]:
        with self.store.read() as r:
            registered = {m.raft_addr for m in r.members()}
        return [v for v in self.raft.voters() if v not in registered]

    async def wait_forming(self) -> None:
        """A cluster still forming (some Raft voters have no member record yet): wait up
        to FORMING_WAIT for them to register, so new partitions are spread rather than
        piled on the first members. The wait counts from when a forming cluster was first
        seen, so a voter that never registers costs one wait, not one per create."""
        if not self._unregistered_voters():
            self._forming_since = None
            return
        now = time.monotonic()
        if self._forming_since is None:
            self._forming_since = now
        deadline = self._forming_since + FORMING_WAIT
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            if not self._unregistered_voters():
                return
        log.info("cluster still forming; placing partitions over the members registered so far",
                 extra={"unregistered_voters": self._unregistered_voters()})

    def placement(self, name: str, parts: range | list[int],
                  parent: TopicRecord | None = None) -> list[tuple[int, str]]:
        """Owners for partitions, round-robin over alive members from a random
        start. Empty when no member is alive yet (the controller places them
        within about a second of the first member turning alive).

        ChildAwareOwner: a fan-out child's partition p skips the owner of its parent's
        partition p when another alive member exists, so a replica child's copy sits
        on another disk. ``parent`` is read from the record of ``name`` when not given."""
        members = self.alive_members()
        if not members:
            log.warning("topic created without immediate partition assignment",
                        extra={"topic": name, "error": "no alive member to own new partitions"})
            return []
        n = len(members)
        start = secrets.randbelow(n)
        owners = [(p, members[(start + i) % n].id) for i, p in enumerate(parts)]
        if n < 2:
            return owners
        parent_rows: dict[int, AssignmentRecord] = {}
        with self.store.read() as r:
            if parent is None:
                me = r.topic(name)
                if me is not None and me.parent is not None:
                    parent = r.topic(me.parent)
                    if parent is not None and parent.id != me.parent_id:
                        parent = None
            if parent is not None:
                parent_rows = r.assignments(parent.name)
        if parent is None:
            return owners
        out = []
        for i, (p, owner) in enumerate(owners):
            row = parent_rows.get(p)
            if row is not None and row.topic_id == parent.id and row.owner == owner:
                owner = members[(start + i + 1) % n].id  # the next member: still spread evenly
            out.append((p, owner))
        return out

    async def place_partitions(self, name: str, topic_id: str, parts: range | list[int]) -> bool:
        """Propose owners for partitions that have none on record."""
        owners = self.placement(name, parts)
        if not owners:
            return False
        if self.use_type(C.EntryType.PLACE_PARTITIONS):
            res = await self.write(C.PlacePartitions(name, topic_id, owners))
        else:
            res = await self.write(C.AssignPartitions(name, topic_id, owners))
        if res.code == C.Result.CHANGED:
            return False  # the topic was deleted or recreated meanwhile, or an owner was placed
        self._check(res, "topic")
        return True

    async def alter_topic(self, req: Q.AlterTopicReq) -> TopicRecord:
        name = req.name
        fields = (req.retention_ms, req.max_in_flight_per_partition, req.max_acked_ahead_per_partition,
                  req.partitions, req.schema, req.max_deliveries, req.dead_letter_topic, req.idempotency_window_ms)
        if all(f is None for f in fields):
            raise BadRequest("invalid argument: nothing to change (send at least one field)")
        if req.retention_ms is not None:
            VAL.retention_ms(req.retention_ms)
        for field, val in (("max_in_flight_per_partition", req.max_in_flight_per_partition),
                           ("max_acked_ahead_per_partition", req.max_acked_ahead_per_partition)):
            if val is not None and val < 0:
                raise BadRequest(f"invalid argument: {field} must not be negative")
        if req.schema_base_version is not None and req.schema is None:
            raise BadRequest("invalid argument: schema_base_version needs schema")
        if req.max_deliveries is not None:
            VAL.max_deliveries(req.max_deliveries)
        if req.idempotency_window_ms is not None:
            VAL.idempotency_window_ms(req.idempotency_window_ms)
        if req.dead_letter_topic:
            VAL.topic_name(req.dead_letter_topic)
            if req.dead_letter_topic == name:
                raise BadRequest(f'invalid argument: topic "{name}" cannot be its own dead-letter topic')
        user = self._require_known(req.who)
        # The new dead-letter topic's lock too (see create_topic): naming it and attaching it
        # as a child are serialised, so one of them sees the other and is refused.
        async with self._name_locks(name, *([req.dead_letter_topic, FLOW_LOCK] if req.dead_letter_topic else [])):
            await self._leader_view()

            def may_manage(t: TopicRecord) -> None:
                if not req.who.unrestricted and not G.can_manage_topic(user, t):
                    raise Forbidden(f'only the owner of topic "{name}" or an admin may modify it')

            current = self._read_topic(name)
            may_manage(current)
            if req.schema is not None and current.parent is not None:
                raise Conflict(_managed_schema(current))
            _, _, _, d_inflight, d_ahead = self._topic_defaults()
            delivery = (req.max_deliveries, req.dead_letter_topic, req.idempotency_window_ms) != (None, None, None)
            if delivery:  # checked before any field group is written: a refusal changes nothing
                self._require_type(C.EntryType.SET_DELIVERY, "changing delivery settings")
                if req.dead_letter_topic:
                    if req.dead_letter_topic == current.parent:
                        raise BadRequest(f'invalid argument: "{req.dead_letter_topic}" is the parent of "{name}": '
                                         f"its dead letters would be copied straight back into {name}; name "
                                         f"another topic")
                    _check_dead_letter_topic(self.store.topic(req.dead_letter_topic), req.dead_letter_topic,
                                             req.who, user, current, self.store.user)
                    _no_dead_letter_cycle(self.store.topic, name, req.dead_letter_topic)
                _delivery_after(current, req)
            # Field groups apply in Narad's order, each its own entry, each checked
            # against the incarnation it was read from.
            if req.retention_ms is not None:
                retention = req.retention_ms

                def set_retention(t: TopicRecord) -> msgspec.Struct:
                    may_manage(t)
                    if retention and t.visibility_timeout_ms > retention:
                        raise BadRequest("invalid argument: retention_ms must not be below visibility_timeout_ms")
                    for c in self._linked_children(t):
                        why = F.delay_retention_refusal(t.name, retention, c.name, c.delay_ms)
                        if why is not None:
                            raise Conflict(why)
                    return self._update(t, retention_ms=retention)

                await self._topic_write(name, set_retention)
            if req.max_in_flight_per_partition is not None or req.max_acked_ahead_per_partition is not None:
                inflight = (None if req.max_in_flight_per_partition is None
                            else req.max_in_flight_per_partition or d_inflight)
                ahead = (None if req.max_acked_ahead_per_partition is None
                         else req.max_acked_ahead_per_partition or d_ahead)

                def set_caps(t: TopicRecord) -> msgspec.Struct:
                    may_manage(t)
                    return self._update(t, max_in_flight_per_partition=inflight,
                                        max_acked_ahead_per_partition=ahead)

                await self._topic_write(name, set_caps)
            if req.partitions is not None:
                grow_to = req.partitions
                before: list[TopicRecord] = []

                def grow(t: TopicRecord) -> msgspec.Struct:
                    may_manage(t)
                    if grow_to <= t.partitions:
                        raise BadRequest(f"invalid argument: partitions must be larger than the current "
                                         f"{t.partitions}")
                    VAL.partitions(grow_to, self.cfg.topic.max_partitions)
                    before[:] = [t]
                    return self._update(t, partitions=grow_to)

                await self._topic_write(name, grow)
                await self.wait_forming()
                await self.place_partitions(name, before[0].id, range(before[0].partitions, grow_to))
            if req.schema is not None:
                await self._put_schema(name, req.schema, req.schema_base_version, may_manage)
            if delivery:

                def set_delivery(t: TopicRecord) -> msgspec.Struct:
                    may_manage(t)
                    _delivery_after(t, req)  # (again, against the record the entry is built from)
                    return C.SetDelivery(t.name, t.id, req.max_deliveries, req.dead_letter_topic,
                                         req.idempotency_window_ms)

                await self._topic_write(name, set_delivery)
            audit.info("topic altered", extra={"topic": name, "by": req.who.name, "outcome": "ok"})
            return self._read_topic(name)

    def _update(self, t: TopicRecord, **fields: int | None) -> msgspec.Struct:
        if self.use_type(C.EntryType.UPDATE_TOPIC_CAS):
            return C.UpdateTopicCas(t.name, t.id, **fields)
        return C.UpdateTopic(t.name, **fields)

    async def _topic_write(self, name: str, make: Callable[[TopicRecord], msgspec.Struct | None]) -> None:
        """Read the topic, build the entry from it (``make`` checks the request against
        what it read and may raise), propose it. When the state machine refuses it
        because the topic changed in between, read again, check again and retry once;
        a second refusal answers 409."""
        for attempt in (1, 2):
            t = self._read_topic(name)
            payload = make(t)
            if payload is None:
                return  # nothing to write (idempotent)
            res = await self.write(payload)
            if res.code != C.Result.CHANGED:
                if res.code == C.Result.INVALID and isinstance(payload, (C.PutSchema, C.PutSchemaCas,
                                                                         C.UpdateTopicCas, C.SetDelivery)):
                    raise Conflict(res.message)
                self._check(res, "topic")
                return
            if attempt == 2:
                raise Conflict("topic changed since it was read", code="topic_changed")
            log.info("topic changed since it was read; checking the request again", extra={"topic": name})

    async def _put_schema(self, name: str, raw: bytes, base_version: int | None,
                          may_manage: Callable[[TopicRecord], None] | None = None) -> None:
        new_doc = await _off_loop(S.parse_registrable, raw)

        def register(t: TopicRecord) -> msgspec.Struct | None:
            if may_manage is not None:
                may_manage(t)
            if t.parent is not None:
                raise Conflict(_managed_schema(t))
            if base_version is not None and base_version != t.schema_version:
                raise Conflict(f"schema version conflict: schema_base_version {base_version} does not match "
                               f'the current version {t.schema_version} of "{name}"')
            if t.schema_version:
                with self.store.read() as r:
                    cur = r.schema(name, t.schema_version)
                old_doc = json.loads(cur.schema) if cur else True
                if S.same_schema(old_doc, new_doc):
                    return None  # identical (or annotations only): idempotent
                S.check_compatible(old_doc, new_doc)
            if self.use_type(C.EntryType.PUT_SCHEMA_CAS):
                return C.PutSchemaCas(name, t.id, t.schema_version + 1, raw)
            return C.PutSchema(name, t.schema_version + 1, raw)

        await self._topic_write(name, register)

    async def delete_topic(self, req: Q.DeleteTopicReq) -> None:
        name = req.name
        user = self._require_known(req.who)
        async with self._locks[name.casefold()]:
            await self._leader_view()
            if self.request_applied():
                return  # this very request deleted it before a leader change
            deleted: list[TopicRecord] = []

            def delete(t: TopicRecord) -> msgspec.Struct:
                if not req.who.unrestricted and not G.can_manage_topic(user, t):
                    raise Forbidden(f'only the owner of topic "{name}" or an admin may modify it')
                deleted[:] = [t]
                if self.use_type(C.EntryType.DELETE_TOPIC_CAS):
                    return C.DeleteTopicCas(name, t.id)
                return C.DeleteTopic(name)

            await self._topic_write(name, delete)
            audit.info("topic deleted", extra={"topic": name, "id": deleted[0].id, "by": req.who.name,
                                               "outcome": "ok"})

    async def confirm_gone(self, name: str, topic_id: str) -> bool:
        """Only a definite "gone" allows destroying data: on the leader, after a
        barrier (everything committed applied) and a re-read. Anything else,
        including not being the leader, answers False (keep the data)."""
        if not self.raft.is_leader():
            return False
        try:
            await self.barrier()
        except Unavailable:
            return False
        with self.store.read() as r:
            t = r.topic(name)
        return t is None or t.id != topic_id

    # ---- users ---------------------------------------------------------------------
    def _require_admin(self, who: G.Identity) -> UserRecord | None:
        user = self._require_known(who)
        if not who.unrestricted and not G.is_admin(user):
            raise Forbidden("admin privileges required")
        return user

    async def create_user(self, req: Q.CreateUserReq) -> UserRecord:
        name = VAL.username(req.username)
        grants = VAL.grants(req.grants)
        caller = self._require_admin(req.who)
        if any(g.action == "admin" for g in grants) and not req.who.operator and not (caller and caller.root) \
                and req.who.security:
            raise Forbidden("only the root admin may grant admin")
        async with self._locks["user:" + name]:
            rec = UserRecord(username=name, password_hash=req.password_hash, grants=grants)
            self._check(await self.write(C.CreateUser(rec)), "user")
            audit.info("user created", extra={"user": name, "by": req.who.name, "outcome": "ok"})
            return self._read_user(name)

    def _read_user(self, name: str) -> UserRecord:
        with self.store.read() as r:
            u = r.user(name)
        if u is None:
            raise NotFound(f'user "{name}" not found')
        return u

    async def set_grants(self, req: Q.SetGrantsReq) -> UserRecord:
        grants = VAL.grants(req.grants)
        caller = self._require_admin(req.who)
        target = self._read_user(req.username)
        if caller is not None and caller.username == target.username:
            raise Forbidden("nobody can change their own grants")
        if target.root:
            raise Forbidden("the root admin's grants cannot change")
        if any(g.action == "admin" for g in grants) and caller is not None and not caller.root:
            raise Forbidden("only the root admin may grant admin")
        async with self._locks["user:" + req.username]:
            self._check(await self.write(C.UpdateGrants(req.username, grants)), "user")
            audit.info("user grants set", extra={"user": req.username, "by": req.who.name, "outcome": "ok"})
            return self._read_user(req.username)

    async def set_password(self, req: Q.SetPasswordReq) -> None:
        caller = self._require_known(req.who)
        if caller is not None and not G.is_admin(caller) and caller.username != req.username:
            raise Forbidden("only admins may change another user's password")  # before the lookup (no 404 oracle)
        target = self._read_user(req.username)
        if caller is not None:
            self_change = caller.username == target.username
            if not G.is_admin(caller) and not self_change:
                raise Forbidden("only admins may change another user's password")
            if self_change and not G.is_admin(caller) and not req.current_password_verified:
                raise Forbidden("current_password is wrong or missing")
            if target.root and not caller.root:
                raise Forbidden("only the root admin may change the root admin's password")
        async with self._locks["user:" + req.username]:
            self._check(await self.write(C.UpdatePassword(req.username, req.password_hash)), "user")
            audit.info("user password set", extra={"user": req.username, "by": req.who.name, "outcome": "ok"})

    async def delete_user(self, req: Q.DeleteUserReq) -> None:
        caller = self._require_admin(req.who)
        target = self._read_user(req.username)
        if target.root:
            raise Forbidden("the root admin cannot be deleted")
        if caller is not None and caller.username == target.username:
            raise Forbidden("nobody can delete their own account")
        async with self._locks["user:" + req.username]:
            if self.use_type(C.EntryType.DELETE_USER_RELEASING):
                self._check(await self.write(C.DeleteUserReleasing(req.username)), "user")
                audit.info("user deleted", extra={"user": req.username, "by": req.who.name, "outcome": "ok"})
                return
            self._check(await self.write(C.DeleteUser(req.username)), "user")
            with self.store.read() as r:
                owned = sorted(t.name for t in r.topics() if t.owner == req.username)
            if owned:
                audit.warning("user deleted, but its topics still name it as owner",
                              extra={"user": req.username, "by": req.who.name, "topics": owned[:100],
                                     "count": len(owned),
                                     "held_back_by": self.holds_back(C.EntryType.DELETE_USER_RELEASING)})
            else:
                audit.info("user deleted", extra={"user": req.username, "by": req.who.name, "outcome": "ok"})


    # ---- assignments ------------------------------------------------------------------
    def orphan_assignments(self) -> list[tuple[str, int]]:
        """Assignment rows that belong to no partition: their topic is gone, is another
        incarnation, or the index is past the partition count."""
        out = []
        with self.store.read() as r:
            for name, part, a in r.all_assignments():
                t = r.topic(name)
                if t is None or t.id != a.topic_id or not 0 <= part < t.partitions:
                    out.append((name, part))
        return out

    async def prune_orphan_assignments(self) -> int:
        """Leader: prune orphan assignment rows (type 30) once every member applies it;
        until then log each row once at error."""
        rows = self.orphan_assignments()
        if not rows:
            return 0
        if not self.use_type(C.EntryType.PRUNE_ASSIGNMENTS):
            for name, part in rows:
                if (name, part) not in self._orphans_logged:
                    self._orphans_logged.add((name, part))
                    log.error(f"orphan assignment row for {name}/{part}; it is pruned once every member applies "
                              "raft entry type 30")
            return 0
        res = await self.write(C.PruneAssignments(rows[:1000]))
        if res.code == C.Result.CHANGED:
            return 0  # a row turned live meanwhile: the next pass looks again
        self._check(res, "assignment")
        log.info("pruned orphan assignment rows", extra={"rows": min(len(rows), 1000)})
        return min(len(rows), 1000)

    # ---- members -------------------------------------------------------------------
    async def register_member(self, req: Q.RegisterReq) -> Q.Empty:
        res = await self.write(C.RegisterMember(req.member))
        if not res.ok:
            code = "removed" if res.code == C.Result.REFUSED and "removed" in res.message else None
            raise Conflict(f"member registration refused: {res.message}", code=code)
        return Q.Empty()

    async def heartbeat(self, req: Q.HeartbeatReq) -> Q.Empty:
        res = await self.write(C.Heartbeat(req.node_id, req.build, req.newest_entry_type, req.client_addr,
                                           req.cluster_addr, req.entry_types, req.dispatch_backlog))
        if res.code == C.Result.NOT_FOUND:
            raise NotFound(f"member {req.node_id} is not registered")
        if res.code == C.Result.REFUSED:
            raise Conflict(f"heartbeat refused: {res.message}; it rejoins only with an empty data dir",
                           code="removed")
        return Q.Empty()

    # ---- partition moves and decommission (issue 13) -----------------------------------------
    def live_assignments(self) -> list[P.Row]:
        """The assignment rows of live partitions (their topic's incarnation, in range), sorted."""
        out: list[P.Row] = []
        with self.store.read() as r:
            for t in r.topics():
                rows = r.assignments(t.name)
                out.extend((t.name, p, rows[p]) for p in sorted(rows)
                           if p < t.partitions and rows[p].topic_id == t.id)
        return out

    def _move_view(self, topic: str, partition: int, owner: str, target: str) -> Q.MoveView:
        with self.store.read() as r:
            members = {m.id: m for m in r.members()}
        src, dst = P.member_status(members, owner), P.member_status(members, target)
        blocked = ("target_not_member" if dst == "not_a_member" else "target_dead" if dst == "dead"
                   else "source_dead" if src in ("dead", "not_a_member") else None)
        return Q.MoveView(topic, partition, owner, target, src, dst, blocked)

    async def complete_move(self, req: Q.CompleteMoveReq) -> Q.CompleteMoveResp:
        """Leader: the flip of a move (type 40), proposed by its destination.
        done: the target owns it (now, or a retried flip that already happened);
        refused: the row moved on (another owner or target); not_found: no row of
        that incarnation."""
        self._require_type(C.EntryType.COMPLETE_MOVE, "completing a partition move")
        await self._leader_view()
        if req.force:
            # A force-promote: the leader's own view must agree the source is dead, with its
            # last heartbeat (stamped by a leader's clock) at least FORCE_PROMOTE_AFTER old.
            with self.store.read() as r:
                src = r.member(req.source)
            age_ms = self.now_ms() - src.heartbeat_ms if src is not None else None
            if src is not None and (src.status != "dead" or (age_ms or 0) < FORCE_PROMOTE_AFTER_MS):
                raise Conflict(f"node {req.source} is not dead long enough to force-promote its partition "
                               f"(status {src.status}, last heartbeat {(age_ms or 0) / 1000:.0f}s ago; "
                               f"needs {FORCE_PROMOTE_AFTER_MS / 1000:.0f}s)", code="source_alive")
        # A force-promote names the heartbeat it judged: one landing before the entry applies refuses it.
        judged = src.heartbeat_ms if req.force and src is not None else -1
        res = await self.write(C.CompleteMove(req.topic, req.topic_id, req.partition, req.source, req.target,
                                              judged))
        if res.ok:
            if res.message != "done":
                log.info("partition move completed", extra={"topic": req.topic, "partition": req.partition,
                                                            "from": req.source, "to": req.target})
                if FLIP_ANSWER_HOLD:  # test seam: the flip committed, its answer not sent (kill the leader now)
                    log.info("flip committed; answer held (test seam)", extra={"topic": req.topic,
                                                                              "partition": req.partition})
                    await asyncio.sleep(FLIP_ANSWER_HOLD)
            return Q.CompleteMoveResp("done")
        if res.code == C.Result.CHANGED:
            return Q.CompleteMoveResp("refused")
        if res.code == C.Result.NOT_FOUND:
            return Q.CompleteMoveResp("not_found")
        self._check(res, "assignment")
        raise AssertionError("unreachable")

    async def read_assignment(self, req: Q.AssignmentReadReq) -> Q.AssignmentReadResp:
        """A leader read of one row (resolves an ambiguous flip): only the leader
        answers, after a barrier (everything committed is applied here) and a
        re-read; any other node answers 421 naming the leader it knows."""
        if not self.raft.is_leader():
            raise Misdirected("this node is not the raft leader", extra={"leader": self.raft.leader() or ""})
        await self.barrier()
        if not self.raft.is_leader():
            raise Misdirected("this node lost the raft leadership", extra={"leader": self.raft.leader() or ""})
        with self.store.read() as r:
            t = r.topic(req.topic)
            row = r.assignments(req.topic).get(req.partition) if t is not None else None
        if t is None or row is None or row.topic_id != t.id or not 0 <= req.partition < t.partitions:
            return Q.AssignmentReadResp(False)
        return Q.AssignmentReadResp(True, row.topic_id, row.owner, row.target)

    async def abort_move(self, req: Q.AbortMoveReq) -> Q.AbortMoveResp:
        """Leader: clear a move's target (type 39, compare-and-set on the target read,
        or the one given); the partition stays with its owner. 400 bad partition,
        404 no assignment, 409 no move / another target / it finished meanwhile,
        503 outcome unknown."""
        self._require_admin(req.who)
        if req.partition < 0:
            raise BadRequest(f"invalid argument: partition must not be negative, got {req.partition}")
        if req.target is not None and not req.target:
            raise BadRequest("invalid argument: target must name a node")
        async with self.moves_lock:
            await self._leader_view()
            with self.store.read() as r:
                t = r.topic(req.topic)
                row = r.assignments(req.topic).get(req.partition) if t is not None else None
            if t is None or row is None or row.topic_id != t.id or req.partition >= t.partitions:
                raise NotFound(f"no assignment for {req.topic}/{req.partition}")
            if row.target is None:
                raise Conflict(f"no move in flight for {req.topic}/{req.partition} (owner {row.owner})",
                               code="no_move")
            if req.target is not None and req.target != row.target:
                raise Conflict(f"the move of {req.topic}/{req.partition} targets {row.target}, not {req.target}",
                               code="target_mismatch")
            self._require_type(C.EntryType.SET_MOVE_TARGETS, "aborting a partition move")
            view = self._move_view(req.topic, req.partition, row.owner, row.target)
            try:
                res = await self.write(C.SetMoveTargets([C.MoveTargetRow(
                    req.topic, t.id, req.partition, row.owner, row.target, None)]))
            except Unavailable as e:
                raise Unavailable(f"{e.message}; the outcome is unknown: list the moves (GET /v1/cluster/moves) "
                                  "to check", headers=e.headers) from None
            if res.code == C.Result.CHANGED:
                with self.store.read() as r:
                    now = r.assignments(req.topic).get(req.partition)
                if now is not None and now.owner == row.target:
                    raise Conflict(f"the move of {req.topic}/{req.partition} already finished: {now.owner} owns it",
                                   code="move_finished")
                raise Conflict(f"the move of {req.topic}/{req.partition} changed while it was read back (owner "
                               f"{now.owner if now else None}, target {now.target if now else None})",
                               code="move_changed")
            self._check(res, "assignment")
        audit.info("partition move aborted", extra={"topic": req.topic, "partition": req.partition,
                                                    "from": row.owner, "to": row.target, "by": req.who.name,
                                                    "outcome": "ok"})
        return Q.AbortMoveResp(view, f"the target {row.target} is cleared; {req.topic}/{req.partition} stays with "
                                     f"{row.owner} (the destination sets its copy aside)")

    def decommission_refusals(self, node_id: str) -> tuple[list[Q.Reason], bool, int, int]:
        """Why marking ``node_id`` draining is refused now (from this node's replica and
        Raft view), whether it is a voter, the partitions it owns and the moves to it."""
        with self.store.read() as r:
            members = {m.id: m for m in r.members()}
        m = members.get(node_id)
        if m is None:
            raise NotFound(f"member {node_id} not found")
        rows = self.live_assignments()
        owned = sum(1 for _, _, a in rows if a.owner == node_id)
        inbound = sum(1 for _, _, a in rows if a.target == node_id)
        voters = set(self.raft.voters())
        voter = m.raft_addr in voters
        reasons: list[Q.Reason] = []
        # Voters already draining (decommissions under way) are leaving too: they do not count.
        leaving = {x.raft_addr for x in members.values() if x.draining and x.id != node_id} & voters
        staying = len(voters) - 1 - len(leaving)
        if voter and staying < MIN_VOTERS:
            also = f" (besides {len(leaving)} already draining)" if leaving else ""
            reasons.append(Q.Reason("below_min_voters", f"{node_id} is a Raft voter: removing it{also} leaves "
                                                        f"{staying} voters, fewer than {MIN_VOTERS}"))
        if voter:
            rest = voters - {m.raft_addr}
            alive = {x.raft_addr for x in members.values() if x.status == "alive"} & rest
            if rest and len(alive) < len(rest) // 2 + 1:
                reasons.append(Q.Reason("no_healthy_majority", f"only {len(alive)} of the {len(rest)} other voters "
                                                               "are alive: not a majority"))
        if not any(x.id != node_id and x.status == "alive" and not x.draining for x in members.values()):
            reasons.append(Q.Reason("no_receivers", "no other member is alive and not draining to receive its "
                                                    "partitions"))
        if m.status != "alive" and owned:
            reasons.append(Q.Reason("owner_dead", f"{node_id} is dead and owns {owned} partitions: their data is "
                                                  "only on its disk, so they cannot move"))
        return reasons, voter, owned, inbound

    async def decommission(self, req: Q.DecommissionReq) -> Q.DecommissionResp | Q.Empty:
        """Mark a member draining (type 41; 409 with ``reasons`` when refused), clear the
        mark (``cancel``), or only say whether it would be marked (``dry_run``: answered
        from this node's replica, on any node). The controller sheds its partitions and
        removes it once it owns nothing."""
        self._require_admin(req.who)
        if req.dry_run and req.cancel:
            raise BadRequest("invalid argument: dry_run cannot be combined with a cancel")
        if req.dry_run:
            reasons, voter, owned, inbound = self.decommission_refusals(req.node_id)
            return Q.DecommissionResp(req.node_id, not reasons, reasons, voter, owned, inbound)
        async with self.moves_lock:
            await self._leader_view()
            with self.store.read() as r:
                m = r.member(req.node_id)
            if m is None:
                raise NotFound(f"member {req.node_id} not found")
            if req.cancel:
                if m.draining:
                    self._require_type(C.EntryType.SET_DRAINING, "cancelling a decommission")
                    self._check(await self.write(C.SetDraining(req.node_id, False)), "member")
                    audit.info("decommission cancelled", extra={"node": req.node_id, "by": req.who.name,
                                                                "outcome": "ok"})
                return Q.Empty()
            if m.draining:
                return Q.Empty()  # already draining
            for t in MOVE_TYPES:
                self._require_type(t, "a decommission")
            reasons, _, _, _ = self.decommission_refusals(req.node_id)
            if reasons:
                raise Conflict(f"decommission of {req.node_id} refused: " + "; ".join(x.message for x in reasons),
                               extra={"reasons": [msgspec.structs.asdict(x) for x in reasons]})
            self._check(await self.write(C.SetDraining(req.node_id, True)), "member")
        audit.info("decommission started", extra={"node": req.node_id, "by": req.who.name, "outcome": "ok"})
        return Q.Empty()

    # ---- one entry point for every request (local or forwarded) ---------------------------
    async def forget_server(self, req: Q.ForgetServerReq) -> Q.ForgetServerResp:
        """Leader: remove a Raft voter that has no member record. Refused for the
        leader itself (400), an id that is no Raft server (404), a server with a
        member record or named by an assignment, or while quorum is at risk (409)."""
        self._require_admin(req.who)
        await self._leader_view()
        with self.store.read() as r:
            members = r.members()
            owners = {a.owner for _, _, a in r.all_assignments()}
        by_id = {m.id: m for m in members}
        addr = by_id[req.id].raft_addr if req.id in by_id else req.id
        if addr == self.raft.self_addr:
            raise BadRequest(f"{req.id} is the Raft leader; stop it gracefully (leadership moves) and forget it "
                             "from the new leader")
        voters = self.raft.voters()
        if addr not in voters:
            raise NotFound(f"{req.id} is not a Raft server of this cluster (voters: {', '.join(voters)})")
        holder = next((m for m in members if m.raft_addr == addr), None)
        if holder is not None:
            raise Conflict(f"{req.id} has a member record (node {holder.id}); decommission it instead of "
                           "forgetting it", code="has_member_record")
        if req.id in owners:
            raise Conflict(f"{req.id} is named by a partition assignment", code="assigned")
        since = self.raft.leader_since
        if since is None or time.monotonic() - since < FORGET_MIN_LEADERSHIP:
            raise Conflict("quorum is at risk: this leader was elected less than 12 s ago; retry shortly",
                           code="quorum_at_risk")
        st = self.raft.status()
        down = [peer for peer, ok in st.peers.items() if not ok and peer != addr]
        if down:
            raise Conflict(f"quorum is at risk: Raft servers {', '.join(sorted(down))} are not connected; "
                           "forget a server only while the others are healthy", code="quorum_at_risk")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[bool, str]] = loop.create_future()

        def finished(ok: bool, why: str) -> None:
            if not done.done():
                done.set_result((ok, why))

        self.raft.remove_server(addr, finished)
        try:
            ok, why = await asyncio.wait_for(done, 10.0)
        except TimeoutError:
            raise Unavailable("removing the Raft server did not commit within 10 s; check "
                              "GET /v1/cluster/members before retrying") from None
        if not ok:
            raise Unavailable(f"removing the Raft server failed: {why}")
        audit.info("raft server forgotten", extra={"server": addr, "by": req.who.name, "outcome": "ok"})
        return Q.ForgetServerResp(id=req.id, voter=True)

    async def import_metastore(self, req: Q.ImportMetastoreReq) -> Q.ImportMetastoreResp:
        """Leader: apply an export as one entry (type 38). Refused (409) while a
        member cannot apply that type, or when the cluster holds topics or users
        besides the root admin and ``overwrite`` is not set."""
        self._require_admin(req.who)
        try:
            entry, counts = EX.parse_export(req.document, overwrite=req.overwrite)
            maximum = self.cfg.topic.max_partitions
            for t in entry.topics:
                if not 1 <= t.partitions <= maximum or t.retention_ms < 0 or t.visibility_timeout_ms <= 0:
                    raise ValueError(f"topic {t.name!r}: partitions must be between 1 and {maximum} "
                                     "(topic.max_partitions), retention and visibility timeout not negative")
            cycle = _flow_cycle({t.name: t for t in entry.topics})
            if cycle is not None:
                raise ValueError(f"the topics' dead-letter topics and children form a cycle "
                                 f"({' -> '.join(cycle)}): a record failing in each would go round for ever")
        except ValueError as e:
            raise BadRequest(f"invalid argument: {e}") from None
        await self._leader_view()
        why = self.holds_back(C.EntryType.IMPORT_METASTORE)
        if why is not None:
            kind = int(C.EntryType.IMPORT_METASTORE)
            raise Conflict(f"an import needs every member to apply raft entry type {kind}: {why}",
                           code="older_release")
        async with self._name_locks(FLOW_LOCK):  # ordered with the writes that add flow edges
            res = await self.write(entry, deadline=time.monotonic() + 30.0)
        if res.code == C.Result.EXISTS:
            raise Conflict(res.message, code="cluster_not_empty")
        self._check(res, "metastore")
        audit.info("metastore imported", extra={"by": req.who.name, "overwrite": req.overwrite, "outcome": "ok",
                                                "index": res.index, **counts})
        return Q.ImportMetastoreResp(counts, res.index)

    async def dispatch(self, req: msgspec.Struct) -> msgspec.Struct:
        """Run a metadata request on this node (the leader). The Raft index it
        reached is left in ``last_index``."""
        if isinstance(req, Q.CreateTopicReq):
            return await self.create_topic(req)
        if isinstance(req, Q.AlterTopicReq):
            return await self.alter_topic(req)
        if isinstance(req, Q.DeleteTopicReq):
            await self.delete_topic(req)
            return Q.Empty()
        if isinstance(req, Q.CreateUserReq):
            return public_user(await self.create_user(req))
        if isinstance(req, Q.SetGrantsReq):
            return public_user(await self.set_grants(req))
        if isinstance(req, Q.SetPasswordReq):
            await self.set_password(req)
            return Q.Empty()
        if isinstance(req, Q.DeleteUserReq):
            await self.delete_user(req)
            return Q.Empty()
        if isinstance(req, Q.RegisterReq):
            return await self.register_member(req)
        if isinstance(req, Q.HeartbeatReq):
            return await self.heartbeat(req)
        if isinstance(req, Q.ConfirmGoneReq):
            return Q.ConfirmGoneResp(await self.confirm_gone(req.topic, req.topic_id))
        if isinstance(req, Q.AttachChildReq):
            return await self.attach_child(req)
        if isinstance(req, Q.DetachChildReq):
            await self.detach_child(req)
            return Q.Empty()
        if isinstance(req, Q.ConfirmEpochReq):
            return await self.confirm_epoch(req)
        if isinstance(req, Q.ForgetServerReq):
            return await self.forget_server(req)
        if isinstance(req, Q.ImportMetastoreReq):
            return await self.import_metastore(req)
        if isinstance(req, Q.CompleteMoveReq):
            return await self.complete_move(req)
        if isinstance(req, Q.AssignmentReadReq):
            return await self.read_assignment(req)
        if isinstance(req, Q.AbortMoveReq):
            return await self.abort_move(req)
        if isinstance(req, Q.DecommissionReq):
            return await self.decommission(req)
        raise BadRequest(f"unsupported metadata request {type(req).__name__}")


FORWARDABLE = (Q.CreateTopicReq, Q.AlterTopicReq, Q.DeleteTopicReq, Q.CreateUserReq, Q.SetGrantsReq,
               Q.SetPasswordReq, Q.DeleteUserReq, Q.RegisterReq, Q.HeartbeatReq, Q.ConfirmGoneReq,
               Q.ForgetServerReq, Q.ImportMetastoreReq, Q.AttachChildReq, Q.DetachChildReq, Q.ConfirmEpochReq,
               # partition moves (issue 13); a decommission dry run is answered where it arrives
               Q.CompleteMoveReq, Q.AssignmentReadReq, Q.AbortMoveReq, Q.DecommissionReq)


def _check_delay(field: str, value: int) -> None:
    if not 0 <= value <= F.MAX_DELAY_MS:
        raise BadRequest(f"invalid argument: {field} must be between 0 and {F.MAX_DELAY_MS} (1 year), got {value}")


def _managed_schema(t: TopicRecord) -> str:
    return f'the schema of "{t.name}" is managed by its parent "{t.parent}"'


def public_user(u: UserRecord) -> UserRecord:
    """A user record safe to send to a worker or client (no password hash)."""
    return UserRecord(u.username, b"", list(u.grants), u.root, u.created_at_ms, u.updated_at_ms)


__all__ = ["Grant", "MetaService", "public_user"]


def _delivery_after(t: TopicRecord, req: Q.AlterTopicReq) -> None:
    """400 when the PATCH would leave `t` with max_deliveries and no dead-letter topic."""
    dlt = t.dead_letter_topic if req.dead_letter_topic is None else (req.dead_letter_topic or None)
    maxd = t.max_deliveries if req.max_deliveries is None else req.max_deliveries
    if maxd and dlt is None:
        raise BadRequest("invalid argument: max_deliveries needs a dead_letter_topic (a record "
                         "past its last delivery goes there, it is never dropped)")


MAX_FLOW_TOPICS = 4096  # topics followed from a new dead-letter setting or attach, looking for a cycle
# Taken, besides the names' own locks, by every write that adds a way for records to flow on
# (a dead-letter topic named, a child attached): their cycle checks and writes run one at a
# time on the leader, so settings on different topics cannot close a cycle together (A -> B,
# B -> C, C -> D and D -> A at once each saw none). It sorts before every topic name.
FLOW_LOCK = "\x00flow"


def _flow_path(topic: Callable[[str], TopicRecord | None], start: str, target: str) -> list[str] | None:
    """The topics a record can reach from `start` up to `target` (a path, `start`
    first), following where records go on: to a topic's dead-letter topic and to its
    fan-out children; None when `target` cannot be reached. Names are compared as the
    store looks them up (exactly). A larger graph than ``MAX_FLOW_TOPICS`` is a 400."""
    came: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        cur = todo.pop()
        if cur == target:
            path: list[str] = []
            at: str | None = cur
            while at is not None:
                path.append(at)
                at = came[at]
            return path[::-1]
        rec = topic(cur)
        if rec is None:
            continue
        for nxt in ([rec.dead_letter_topic] if rec.dead_letter_topic else []) + list(rec.children):
            if nxt not in came:
                if len(came) >= MAX_FLOW_TOPICS:
                    raise BadRequest(f"invalid argument: more than {MAX_FLOW_TOPICS} topics are reached from "
                                     f"{start!r} through dead-letter topics and children: too many to check for "
                                     f"a cycle")
                came[nxt] = cur
                todo.append(nxt)
    return None


def _flow_cycle(topics: dict[str, TopicRecord]) -> list[str] | None:
    """A cycle of the ways records flow on (dead-letter topics, fan-out children) among
    `topics` (an import's whole set), as the names around it, first repeated at the
    end; None when there is none. Iterative, linear in topics and edges, no cap."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(topics):
        if root in state:
            continue
        path = [root]
        state[root] = 1
        todo: list[Iterator[str]] = [iter(_flow_edges(topics.get(root)))]
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                todo.pop()
                state[path.pop()] = 2
                continue
            if nxt not in topics:
                continue
            st = state.get(nxt)
            if st == 1:
                return [*path[path.index(nxt):], nxt]
            if st is None:
                state[nxt] = 1
                path.append(nxt)
                todo.append(iter(_flow_edges(topics[nxt])))
    return None


def _flow_edges(rec: TopicRecord | None) -> list[str]:
    if rec is None:
        return []
    return ([rec.dead_letter_topic] if rec.dead_letter_topic else []) + list(rec.children)


def _no_dead_letter_cycle(topic: Callable[[str], TopicRecord | None], name: str, dlt: str) -> None:
    """400 when naming `dlt` as the dead-letter topic of `name` closes a cycle (from
    `dlt`, through dead-letter topics and fan-out children, records come back to
    `name`): a record that fails everywhere would go round for ever and never stop
    anywhere, which is what a dead-letter topic is for. (Checked and written under
    ``FLOW_LOCK`` as well as the names' locks.)"""
    path = _flow_path(topic, dlt, name)
    if path is not None:
        raise BadRequest(f"invalid argument: dead_letter_topic {dlt!r} closes a cycle ("
                         f"{' -> '.join([name, *path])}): a record failing in each would go round for ever; "
                         f"end the chain at a topic without a dead_letter_topic")


def _check_dead_letter_topic(rec: TopicRecord | None, name: str, who: G.Identity, user: UserRecord | None,
                             source: TopicRecord | None = None,
                             user_of: Callable[[str], UserRecord | None] | None = None) -> None:
    """A dead-letter topic exists, is no fan-out child (only its parent feeds a child),
    and the caller may write there: records dead-lettered from its topic are committed
    into it with no further check, so naming it needs a produce grant on it (or its
    ownership, or admin) as producing there directly would. ``source`` (with its
    owner looked up by ``user_of``): the topic being changed, whose owner must be able
    to write there too, by the rule the dead-letter driver applies at every pass
    (``G.may_dead_letter``)."""
    if rec is None:
        raise BadRequest(f'invalid argument: dead-letter topic "{name}" not found (create it first)')
    if rec.parent is not None:
        raise BadRequest(f'invalid argument: dead-letter topic "{name}" is a fan-out child of "{rec.parent}"; '
                         f"name a topic that takes produce")
    if not who.unrestricted and not G.may_write_to(user, rec):
        raise Forbidden(f'produce not allowed on topic "{name}": naming it as dead_letter_topic needs a produce '
                        f"grant on it (dead-lettered records are written there)")
    if source is not None and user_of is not None and not G.may_dead_letter(user_of, source, rec):
        raise Forbidden(f'the owner of this topic ("{source.owner}") has no produce grant on "{name}": dead-'
                        f"lettered records are written there on the owner's behalf; grant it first")
