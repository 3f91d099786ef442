"""Topic routes: create, list, describe, alter, delete, schema history.

Reads come from the local replica (narad.meta.store, cached); writes are
checked here (early 400/403), then sent to the supervisor's metadata service,
which checks again against the replica, proposes through Raft and answers
once the local FSM applied the entry. Response bodies follow Narad's /v1
shapes (``Topic``, ``TopicDetails``, ``{topics, next_page_token}``).

Imports narad.api.{context,router}, narad.meta.{grants,requests,records,
validate,schemas}, narad.errors.
"""

from __future__ import annotations

from typing import Any

import msgspec

from narad.api.context import ApiContext, decode_json, query_bool, query_int
from narad.api.router import Request, Response, Router, empty, json_response
from narad.errors import BadRequest, Forbidden, NotFound, NotImplementedYet
from narad.meta import grants as G
from narad.meta import requests as Q
from narad.meta import validate as VAL
from narad.meta.records import AssignmentRecord, TopicRecord

UNSET = msgspec.UNSET


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


class AlterTopicBody(msgspec.Struct, forbid_unknown_fields=True):
    retention_ms: VAL.Int64 | None = None
    max_in_flight_per_partition: VAL.Int64 | None = None
    max_acked_ahead_per_partition: VAL.Int64 | None = None
    partitions: VAL.Int64 | None = None
    schema: msgspec.Raw | msgspec.UnsetType = UNSET
    schema_base_version: VAL.Int64 | None = None
    visibility_timeout_ms: VAL.Int64 | None = None


def topic_json(t: TopicRecord) -> dict[str, Any]:
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

    # ---- routes -------------------------------------------------------------
    async def create(self, req: Request) -> Response:
        body = decode_json(req, CreateTopicBody)
        if body.name is None:
            raise BadRequest("invalid argument: name required")
        name = VAL.topic_name(body.name)
        if body.parent is not None or body.fanout_delay_ms:
            raise NotImplementedYet("fan-out children (parent, fanout_delay_ms) are not implemented by this node yet")
        who: G.Identity = req.identity
        if not who.unrestricted and not G.has_grant(self._user(req), "create", name):
            raise Forbidden(f'create not allowed for topic name "{name}"')
        rec = await self.ctx.call(
            Q.CreateTopicReq(
                who=who,
                name=name,
                partitions=body.partitions or None,
                retention_ms=None if body.retention_ms is UNSET else body.retention_ms,  # type: ignore[arg-type]
                visibility_timeout_ms=body.visibility_timeout_ms or None,
                max_in_flight_per_partition=body.max_in_flight_per_partition or None,
                max_acked_ahead_per_partition=body.max_acked_ahead_per_partition or None,
                schema=_schema_raw(body.schema),
            ),
            TopicRecord,
        )
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
        out["partition_stats"] = [self._partition_stats(t, p, assignments.get(p), live.get(p)) for p in parts]
        out["partial"] = any(s.get("status") == "owner_unavailable" for s in out["partition_stats"])
        return json_response(200, out)

    def _partition_stats(self, t: TopicRecord, p: int, a: AssignmentRecord | None,
                         live: dict[str, int] | None) -> dict[str, Any]:
        stats: dict[str, Any] = {"partition": p, "owner_node": a.owner if a and a.topic_id == t.id else ""}
        if live is not None and a is not None:
            stats.update(live)
            return stats
        stats.update({"high_watermark": 0, "next_offset": 0, "oldest_offset": 0, "committed_offset": -1,
                      "lag": 0, "in_flight": 0, "acked_ahead": 0, "status": "owner_unavailable",
                      "owner_liveness": "unassigned" if a is None else "unreachable"})
        return stats

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
