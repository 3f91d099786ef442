"""Topic routes: create, list, describe, alter, delete, schema history, and
the fan-out children routes (attach, list, detach; create-as-child).

Reads come from the local replica (narad.meta.store, cached); writes are
checked here (early 400/403), then sent to the supervisor's metadata service,
which checks again against the replica, proposes through Raft and answers
once the local FSM applied the entry. Response bodies follow Narad's /v1
shapes (``Topic``, ``TopicDetails``, ``{topics, next_page_token}``, ``ChildList``).

An attach (and a create-as-child) needs the attach point: this worker asks the
owners of every parent partition for its committed high watermark
(``Broker.stats``) and sends the offsets, with the parent's incarnation, in the
request; any owner that does not answer is a 503 and nothing is linked. The
leader proposes them unchanged and the FSM refuses them unless the parent is
still that incarnation with that partition count.

``ctl_fanout`` serves naradctl's ``topics attach|detach|children`` in the
supervisor, which has no broker: it asks the partition owners over node RPC.

Imports narad.api.{context,router}, narad.meta.{grants,requests,records,
validate,schemas,store}, narad.broker.peers (the stats request), narad.errors.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from narad.api.context import ApiContext, decode_json, query_bool, query_int
from narad.api.router import GENERAL_BODY_LIMIT, Request, Response, Router, empty, json_response
from narad.errors import ATTACH_POINT, BadRequest, Forbidden, NotFound, NotImplementedYet, Unavailable
from narad.meta import grants as G
from narad.meta import requests as Q
from narad.meta import validate as VAL
from narad.meta.records import AssignmentRecord, TopicRecord
from narad.meta.store import MetaStore

UNSET = msgspec.UNSET
MAX_FANOUT_DELAY_MS = 31_536_000_000  # one year
REMOTE_501 = "remote children are not implemented by this node yet"
ATTACH_READ_WAIT = 3.0  # an attach point found stale by the leader is read again for this long


class CreateTopicBody(msgspec.Struct, forbid_unknown_fields=True):
    name: str | None = None
    partitions: VAL.Int64 = 0
    retention_ms: VAL.Int64 | msgspec.UnsetType = UNSET
    visibility_timeout_ms: VAL.Int64 = 0
    max_in_flight_per_partition: VAL.Int64 = 0
    max_acked_ahead_per_partition: VAL.Int64 = 0
    schema: msgspec.Raw | msgspec.UnsetType = UNSET
    parent: str | None = None
    fanout_delay_ms: VAL.Int64 = 0
    owner: str | None = None  # accepted and ignored: the owner is always the caller
    # Delivery settings (extensions, issue 14; a Narad node answers 400 to them).
    max_deliveries: VAL.Int64 = 0
    dead_letter_topic: str | None = None
    idempotency_window_ms: VAL.Int64 = 0


class AttachChildBody(msgspec.Struct, forbid_unknown_fields=True):
    """Narad's ``AttachChildRequest`` (the delay is ``delay_ms`` here, ``fanout_delay_ms``
    on create: the other name is an unknown field, 400). The remote-child fields are
    known so that they answer 501 (``remote``) or 400 (the others without ``remote``)."""

    child: str | None = None
    delay_ms: VAL.Int64 = 0
    remote: str | None = None
    remote_topic: str | None = None
    from_: str | None = msgspec.field(default=None, name="from")
    lanes: VAL.Int64 | None = None
    dry_run: bool | None = None


class AlterTopicBody(msgspec.Struct, forbid_unknown_fields=True):
    retention_ms: VAL.Int64 | None = None
    max_in_flight_per_partition: VAL.Int64 | None = None
    max_acked_ahead_per_partition: VAL.Int64 | None = None
    partitions: VAL.Int64 | None = None
    schema: msgspec.Raw | msgspec.UnsetType = UNSET
    schema_base_version: VAL.Int64 | None = None
    visibility_timeout_ms: VAL.Int64 | None = None
    max_deliveries: VAL.Int64 | None = None  # extensions (issue 14)
    dead_letter_topic: str | None = None  # "": clear it
    idempotency_window_ms: VAL.Int64 | None = None


def topic_json(t: TopicRecord) -> dict[str, Any]:
    """Narad's ``Topic``, with the fan-out fields of issue 11's contract: ``role``
    "parent" or "child" (absent when standalone); a parent carries ``children``
    (sorted); a child ``parent``, ``attach_epoch``, ``attach_offsets`` and its delay,
    as ``delay_ms`` (our contract) and, on a delay child, ``fanout_delay_ms`` (the
    name Narad's openapi gives the field)."""
    out: dict[str, Any] = {
        "name": t.name,
        "id": t.id,
        "partitions": t.partitions,
        "retention_ms": t.retention_ms,
        "visibility_timeout_ms": t.visibility_timeout_ms,
        "max_in_flight_per_partition": t.max_in_flight_per_partition,
        "max_acked_ahead_per_partition": t.max_acked_ahead_per_partition,
        "created_at": t.created_at,
    }
    if t.owner is not None:
        out["owner"] = t.owner
    # Extensions (issue 14): present only when set, so a topic without them answers as before.
    if t.max_deliveries:
        out["max_deliveries"] = t.max_deliveries
    if t.dead_letter_topic is not None:
        out["dead_letter_topic"] = t.dead_letter_topic
    if t.idempotency_window_ms:
        out["idempotency_window_ms"] = t.idempotency_window_ms
    role = t.role
    if role is None:
        return out
    out["role"] = role
    if t.children:
        out["children"] = list(t.children)
    if t.parent is not None:
        out["parent"] = t.parent
        out["delay_ms"] = t.delay_ms
        if t.attach_epoch is not None:
            out["attach_epoch"] = t.attach_epoch
        if t.delay_ms:
            out["fanout_delay_ms"] = t.delay_ms
        out["attach_offsets"] = list(t.attach_offsets)
    return out


def _schema_raw(raw: msgspec.Raw | msgspec.UnsetType) -> bytes | None:
    if raw is UNSET:
        return None
    data = bytes(raw)  # type: ignore[arg-type]
    if data.strip() == b"null":
        raise BadRequest("invalid argument: schema must be a JSON object or true, not null")
    return data


class TopicsAPI:
    def __init__(self, ctx: ApiContext) -> None:
        self.ctx = ctx

    def register(self, r: Router) -> None:
        r.add("POST", "/v1/topics", self.create)
        r.add("GET", "/v1/topics", self.list)
        r.add("GET", "/v1/topics/{topic}", self.describe)
        r.add("PATCH", "/v1/topics/{topic}", self.alter)
        r.add("DELETE", "/v1/topics/{topic}", self.delete)
        r.add("GET", "/v1/topics/{topic}/schema", self.schema)
        # Narad answers an oversized attach body 400, not 413.
        r.add("POST", "/v1/topics/{parent}/children", self.attach, body_limit=GENERAL_BODY_LIMIT,
              oversize_status=400)
        r.add("GET", "/v1/topics/{parent}/children", self.children)
        r.add("DELETE", "/v1/topics/{parent}/children/{child}", self.detach)

    # ---- helpers ------------------------------------------------------------
    def _user(self, req: Request) -> Any:
        who: G.Identity = req.identity
        if who.unrestricted or who.name is None:
            return None
        return self.ctx.store.user(who.name)

    def _visible(self, req: Request, t: TopicRecord) -> bool:
        who: G.Identity = req.identity
        return who.unrestricted or G.can_read_topic(self._user(req), t)

    def _topic_or_404(self, name: str) -> TopicRecord:
        t = self.ctx.store.topic(name)
        if t is None:
            raise NotFound(f'topic "{name}" not found')
        return t

    def _manages(self, req: Request, t: TopicRecord) -> bool:
        who: G.Identity = req.identity
        return who.unrestricted or G.can_manage_topic(self._user(req), t)

    @staticmethod
    def _not_managed(name: str) -> Forbidden:
        return Forbidden(f'only the owner of topic "{name}" or an admin may modify it')

    async def _attach_point(self, parent: TopicRecord) -> list[int]:
        """The committed high watermark of every partition of ``parent``, asked of each
        partition's owner now: an owner that does not answer (down, slow, unassigned)
        is a 503, and nothing is linked."""
        parts = list(range(parent.partitions))
        live = await self.ctx.broker.stats(parent, parts) if self.ctx.broker is not None else {}
        offsets: list[int] = []
        for p in parts:
            s = live.get(p)
            if s is None or "high_watermark" not in s:
                raise Unavailable(f'could not ask the owners of every partition of "{parent.name}" for the '
                                  "attach point; nothing was linked, retry")
            offsets.append(int(s["high_watermark"]))
        return offsets

    async def _linked(self, req: Request, parent_name: str,
                      send: Callable[[str, list[int]], Awaitable[TopicRecord]]) -> TopicRecord:
        """Read the attach point of ``parent_name`` and send the write with it. A parent
        this replica has not applied yet (created a moment ago at another node) is
        waited for, and a point the leader finds stale (code ``attach_point``: not
        proposed) is read again, both within ATTACH_READ_WAIT; a parent still missing
        here goes to the leader without a point (404 there if it does not exist)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + ATTACH_READ_WAIT
        first = True
        while True:
            parent = self.ctx.store.topic(parent_name)
            # Missing here at first: the leader decides (404 if it has none either). Once
            # the leader said it has it, wait for this replica to apply it.
            while parent is None and not first and loop.time() < end:
                await asyncio.sleep(0.02)
                parent = self.ctx.store.topic(parent_name)
            first = False
            parent_id, offsets = "", []
            if parent is not None:
                if not self._manages(req, parent):
                    raise self._not_managed(parent_name)
                parent_id = parent.id
                offsets = await self._attach_point(parent)
            try:
                return await send(parent_id, offsets)
            except Unavailable as e:
                if e.code != ATTACH_POINT or loop.time() >= end:
                    raise
            await asyncio.sleep(0.05)

    # ---- routes -------------------------------------------------------------
    async def create(self, req: Request) -> Response:
        body = decode_json(req, CreateTopicBody)
        if body.name is None:
            raise BadRequest("invalid argument: name required")
        name = VAL.topic_name(body.name)
        parent_name = None
        if body.parent is not None:
            parent_name = VAL.topic_name(body.parent)
            if parent_name == name:
                raise BadRequest("invalid argument: a topic cannot be its own parent")
        if body.fanout_delay_ms and parent_name is None:
            raise BadRequest("invalid argument: fanout_delay_ms needs parent")
        _check_delay("fanout_delay_ms", body.fanout_delay_ms)
        who: G.Identity = req.identity
        if not who.unrestricted and not G.has_grant(self._user(req), "create", name):
            raise Forbidden(f'create not allowed for topic name "{name}"')
        def send(parent_id: str | None, offsets: list[int]) -> Awaitable[TopicRecord]:
            return self.ctx.call(  # type: ignore[no-any-return]
                Q.CreateTopicReq(
                    who=who,
                    name=name,
                    partitions=body.partitions or None,
                    retention_ms=None if body.retention_ms is UNSET else body.retention_ms,  # type: ignore[arg-type]
                    visibility_timeout_ms=body.visibility_timeout_ms or None,
                    max_in_flight_per_partition=body.max_in_flight_per_partition or None,
                    max_acked_ahead_per_partition=body.max_acked_ahead_per_partition or None,
                    schema=_schema_raw(body.schema),
                    parent=parent_name,
                    fanout_delay_ms=body.fanout_delay_ms,
                    parent_id=parent_id or None,
                    attach_offsets=offsets,
                    max_deliveries=body.max_deliveries or None,
                    dead_letter_topic=body.dead_letter_topic or None,
                    idempotency_window_ms=body.idempotency_window_ms or None,
                ),
                TopicRecord,
            )

        rec = await (send(None, []) if parent_name is None else self._linked(req, parent_name, send))
        return json_response(201, topic_json(rec))

    async def list(self, req: Request) -> Response:
        limit = query_int(req, "limit", default=100)
        assert limit is not None
        if limit <= 0:
            raise BadRequest("invalid argument: limit must be positive")
        limit = min(limit, 1000)
        token = req.q1("page_token") or ""
        if token:
            # The token is the topic name to resume at: anything else (bytes that are
            # not UTF-8 arrive as surrogates) is not a token this node handed out.
            try:
                VAL.topic_name(token)
            except BadRequest:
                raise BadRequest("invalid argument: page_token is not a token from next_page_token") from None
        with self.ctx.store.read() as r:
            page = r.topics(start=token, limit=limit + 1)
        next_token = ""
        if len(page) > limit:
            next_token = page[limit].name
            page = page[:limit]
        # Filtered after the page is cut (as Narad does): pages can come back short.
        topics = [topic_json(t) for t in page if self._visible(req, t)]
        return json_response(200, {"topics": topics, "next_page_token": next_token})

    async def describe(self, req: Request) -> Response:
        name = req.params["topic"]
        t = self._topic_or_404(name)
        if not self._visible(req, t):
            raise Forbidden("no grant on this topic")
        only = query_int(req, "partition", minimum=0)
        if only is not None and only >= t.partitions:
            raise BadRequest(f"invalid argument: partition {only} is not in topic {name}")
        schema = None
        if t.schema_version:
            with self.ctx.store.read() as r:
                schema = r.schema(name, t.schema_version)
        assignments = self.ctx.store.assignments(name)
        out = topic_json(t)
        out["schema_version"] = t.schema_version
        if schema is not None:
            out["schema"] = msgspec.Raw(schema.schema)
        parts = [only] if only is not None else list(range(t.partitions))
        live = await self.ctx.broker.stats(t, parts) if self.ctx.broker is not None else {}
        out["partition_stats"] = rows = [partition_stats(t, p, assignments.get(p), live.get(p)) for p in parts]
        if any(s["status"] == "owner_unavailable" for s in rows):
            out["partial"] = True  # Narad: present only when true
        return json_response(200, out)

    async def alter(self, req: Request) -> Response:
        name = req.params["topic"]
        body = decode_json(req, AlterTopicBody)
        if body.visibility_timeout_ms is not None:
            raise BadRequest("invalid argument: visibility_timeout_ms is fixed at creation and cannot change")
        t = self._topic_or_404(name)
        who: G.Identity = req.identity
        if not who.unrestricted and not G.can_manage_topic(self._user(req), t):
            if not G.can_read_topic(self._user(req), t):
                raise Forbidden("no grant on this topic")
            raise Forbidden("only the topic owner or an admin may modify this topic")
        rec = await self.ctx.call(
            Q.AlterTopicReq(
                who=who,
                name=name,
                retention_ms=body.retention_ms,
                max_in_flight_per_partition=body.max_in_flight_per_partition,
                max_acked_ahead_per_partition=body.max_acked_ahead_per_partition,
                partitions=body.partitions,
                schema=_schema_raw(body.schema),
                schema_base_version=body.schema_base_version,
                max_deliveries=body.max_deliveries,
                dead_letter_topic=body.dead_letter_topic,
                idempotency_window_ms=body.idempotency_window_ms,
            ),
            TopicRecord,
        )
        return json_response(200, topic_json(rec))

    async def delete(self, req: Request) -> Response:
        name = req.params["topic"]
        query_bool(req, "force")
        t = self._topic_or_404(name)
        who: G.Identity = req.identity
        if not who.unrestricted and not G.can_manage_topic(self._user(req), t):
            raise Forbidden("only the topic owner or an admin may modify this topic")
        await self.ctx.call(Q.DeleteTopicReq(who=who, name=name), Q.Empty)
        return empty(204)

    async def schema(self, req: Request) -> Response:
        name = req.params["topic"]
        t = self._topic_or_404(name)
        if not self._visible(req, t):
            raise Forbidden("no grant on this topic")
        with self.ctx.store.read() as r:
            versions = [s for s in r.schemas(name) if s.topic_id == t.id]
        return json_response(
            200,
            {
                "topic": name,
                "version": t.schema_version,
                "versions": [{"version": s.version, "schema": msgspec.Raw(s.schema)} for s in versions],
            },
        )

    # ---- fan-out children (routes 7-9) ----------------------------------------------
    async def attach(self, req: Request) -> Response:
        parent_name = req.params["parent"]
        body = decode_json(req, AttachChildBody)
        if body.remote is not None:
            raise NotImplementedYet(REMOTE_501)
        extra = [f for f, v in (("remote_topic", body.remote_topic), ("from", body.from_),
                                ("lanes", body.lanes), ("dry_run", body.dry_run)) if v is not None]
        if extra:
            raise BadRequest(f"invalid argument: {', '.join(extra)} only with remote")
        if body.child is None or body.child == "":
            raise BadRequest("invalid argument: child required")
        child_name = VAL.topic_name(body.child)
        if child_name == parent_name:
            raise BadRequest("invalid argument: a topic cannot be its own child")
        _check_delay("delay_ms", body.delay_ms)
        who: G.Identity = req.identity
        parent = self.ctx.store.topic(parent_name)
        child = self.ctx.store.topic(child_name)
        # Early checks on what this replica holds; the leader checks again (and answers
        # 404 for a topic still missing once it caught up).
        if parent is not None and not self._manages(req, parent):
            raise self._not_managed(parent_name)
        if child is not None and not self._manages(req, child):
            raise self._not_managed(child_name)
        def send(parent_id: str, offsets: list[int]) -> Awaitable[TopicRecord]:
            return self.ctx.call(  # type: ignore[no-any-return]
                Q.AttachChildReq(who=who, parent=parent_name, child=child_name, delay_ms=body.delay_ms,
                                 parent_id=parent_id, attach_offsets=offsets),
                TopicRecord,
            )

        rec = await self._linked(req, parent_name, send)
        return json_response(200, topic_json(rec))

    async def children(self, req: Request) -> Response:
        name = req.params["parent"]
        query_bool(req, "partitions")  # remote children's rows: a bad value is still a 400
        t = self._topic_or_404(name)
        if not self._visible(req, t):
            raise Forbidden("no grant on this topic")
        lag: dict[str, tuple[int, bool]] = {}
        if t.children:
            gather = getattr(self.ctx.broker, "fanout_lag", None)
            if gather is not None:
                lag = await gather(t)
        return json_response(200, children_json(self.ctx.store, t, lag))

    async def detach(self, req: Request) -> Response:
        parent_name = req.params["parent"]
        child_name = req.params["child"]
        query_bool(req, "force")  # remote children only; a bad value is still a 400
        parent = self.ctx.store.topic(parent_name)
        child = self.ctx.store.topic(child_name)
        # Manage rights on either topic; refused early only when this replica holds both.
        if parent is not None and child is not None and not (self._manages(req, parent)
                                                             or self._manages(req, child)):
            raise Forbidden(f'only the owner of topic "{parent_name}" or of topic "{child_name}", '
                            "or an admin, may detach them")
        who: G.Identity = req.identity
        await self.ctx.call(Q.DetachChildReq(who=who, parent=parent_name, child=child_name), Q.Empty)
        return empty(204)


# A placeholder row's stats (an owner that did not answer): every key a live row has, zeroed
# (``oldest_segment_at``, a time, is left out), so a reader never meets a missing key.
PLACEHOLDER_STATS: dict[str, int] = {"high_watermark": 0, "next_offset": 0, "oldest_offset": 0,
                                     "committed_offset": -1, "lag": 0, "in_flight": 0, "acked_ahead": 0,
                                     "segments": 0, "size_bytes": 0}


def partition_stats(t: TopicRecord, p: int, a: AssignmentRecord | None, live: dict[str, Any] | None) -> dict[str, Any]:
    """One ``partition_stats`` row as Narad's: ``index``, ``owner_node``, then what the
    owner reported (passed through as it is, with ``status: ok`` unless it says
    otherwise), or a placeholder: the same keys zeroed, ``status: owner_unavailable``
    and ``owner_liveness``."""
    row: dict[str, Any] = {"index": p, "owner_node": a.owner if a and a.topic_id == t.id else ""}
    if live is not None and a is not None:
        row.update(PLACEHOLDER_STATS)  # a key an older owner does not report yet stays zero
        row.update(live)
        row.pop("partition", None)
        row.setdefault("status", "ok")
        return row
    row.update(PLACEHOLDER_STATS)
    row["status"] = "owner_unavailable"
    row["owner_liveness"] = "unassigned" if a is None else "unreachable"
    return row


def _check_delay(field: str, value: int) -> None:
    if not 0 <= value <= MAX_FANOUT_DELAY_MS:
        raise BadRequest(f"invalid argument: {field} must be from 0 to {MAX_FANOUT_DELAY_MS} (one year)")


# ---- naradctl (the supervisor's control socket) ----------------------------------------
NodeCall = Callable[[str, Any, type, float], Awaitable[Any]]  # (node id, request, answer type, timeout)


def _owner_groups(store: MetaStore, parent: TopicRecord) -> tuple[dict[str, list[int]], bool]:
    """Parent partitions by owner node; False when a partition has no owner of this incarnation."""
    rows = store.assignments(parent.name)
    groups: dict[str, list[int]] = {}
    every = True
    for p in range(parent.partitions):
        a = rows.get(p)
        if a is None or a.topic_id != parent.id:
            every = False
            continue
        groups.setdefault(a.owner, []).append(p)
    return groups, every


async def attach_point_over_rpc(store: MetaStore, parent: TopicRecord, call_node: NodeCall) -> list[int]:
    """The attach point as ``TopicsAPI._attach_point`` reads it, for a process without
    a broker (the supervisor, for naradctl): each partition owner's node is asked over
    node RPC (any worker of it routes to the owning one); one not answering is a 503."""
    from narad.broker import peers as P

    groups, _ = _owner_groups(store, parent)
    got: dict[int, dict[str, int]] = {}

    async def one(node: str, parts: list[int]) -> None:
        with contextlib.suppress(Exception):
            resp = await call_node(node, P.StatsReq(parent.name, parent.id, parts), P.StatsResp, 2.0)
            got.update(resp.stats)

    await asyncio.gather(*(one(n, ps) for n, ps in groups.items()))
    offsets = []
    for p in range(parent.partitions):
        s = got.get(p)
        if s is None or "high_watermark" not in s:
            raise Unavailable(f'could not ask the owners of every partition of "{parent.name}" for the '
                              "attach point; nothing was linked, retry")
        offsets.append(int(s["high_watermark"]))
    return offsets


async def fanout_lag_over_rpc(store: MetaStore, parent: TopicRecord,
                              call_node: NodeCall) -> dict[str, tuple[int, bool]]:
    """``Broker.fanout_lag`` for the supervisor: the cursors' lag asked of each parent
    partition owner's node over node RPC; an owner not answering (2 s) leaves its
    partitions out (lag_complete False)."""
    from narad.broker import peers as P

    req_type, resp_type = getattr(P, "FanoutLagReq", None), getattr(P, "FanoutLagResp", None)
    if req_type is None or resp_type is None or not parent.children:
        return {}
    groups, _ = _owner_groups(store, parent)
    got: dict[str, dict[int, int]] = {}

    async def one(node: str, parts: list[int]) -> None:
        with contextlib.suppress(Exception):
            resp = await call_node(node, req_type(parent.name, parent.id, parts, P.NODE), resp_type, 2.0)
            for child, row in resp.lags.items():
                got.setdefault(child, {}).update({i: n for i, n in row.items() if i in parts})

    await asyncio.gather(*(one(n, ps) for n, ps in groups.items()))
    return {c: (sum(got.get(c, {}).values()), len(got.get(c, {})) == parent.partitions) for c in parent.children}


def children_json(store: MetaStore, parent: TopicRecord, lag: dict[str, tuple[int, bool]]) -> dict[str, Any]:
    """Narad's ``ChildList`` for ``parent``; a child missing from ``lag`` did not report
    (0, lag_complete false: the count is a lower bound)."""
    rows = []
    for c in parent.children:
        rec = store.topic(c)
        n, complete = lag.get(c, (0, False))
        rows.append({"name": c, "delay_ms": rec.delay_ms if rec is not None else 0,
                     "lag_messages": n, "lag_complete": complete})
    return {"parent": parent.name, "parent_id": parent.id, "children": rows}


async def ctl_fanout(cmd: str, args: dict[str, Any], store: MetaStore, call_node: NodeCall,
                     execute: Callable[[Any], Awaitable[Any]]) -> Any:
    """naradctl ``topics attach|detach|children``, as the local operator (every grant
    check passes; the leader applies the same fan-out rules as for HTTP)."""
    parent_name = str(args.get("parent", ""))
    if cmd == "topics.children":
        t = store.topic(parent_name)
        if t is None:
            raise NotFound(f'topic "{parent_name}" not found')
        return children_json(store, t, await fanout_lag_over_rpc(store, t, call_node))
    child_name = str(args.get("child", ""))
    if cmd == "topics.detach":
        await execute(Q.DetachChildReq(who=G.OPERATOR, parent=parent_name, child=child_name))
        return {"detached": child_name, "parent": parent_name}
    if cmd != "topics.attach":
        raise BadRequest(f"unknown command {cmd!r}")
    delay = args.get("delay_ms") or 0
    if not isinstance(delay, int) or isinstance(delay, bool):
        raise BadRequest("invalid argument: delay_ms must be an integer")
    _check_delay("delay_ms", delay)
    if parent_name == child_name:
        raise BadRequest("invalid argument: a topic cannot be its own child")
    parent = store.topic(parent_name)
    parent_id, offsets = "", []
    if parent is not None:
        parent_id = parent.id
        offsets = await attach_point_over_rpc(store, parent, call_node)
    rec = await execute(Q.AttachChildReq(who=G.OPERATOR, parent=parent_name, child=child_name, delay_ms=delay,
                                         parent_id=parent_id, attach_offsets=offsets))
    return topic_json(rec)
