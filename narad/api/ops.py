"""Operational routes: /healthz, /readyz, /metrics, /v1/cluster/members,
POST /v1/cluster/members/{id}/forget and GET /v1/openapi.json (the API
description, narad/api/openapi.json, served as stored, without credentials).

/healthz and /readyz need no credentials and answer from shared memory at
request time. First the heartbeats (``narad.meta.versions``): a process
whose loop has been silent for more than 3 s makes /readyz 503 naming it
(``supervisor not responding for 4.2s``, ``worker 1 ...``, ``raft tick
thread ...``, ``fork server ...``); a silent supervisor or Raft tick thread
makes /healthz (liveness) 503 too, since the node cannot heal itself then,
while a silent worker or fork server is restarted by the supervisor. Then
the readiness the supervisor publishes (Raft leader known and heard from,
replica caught up, startup reconcile done). /metrics merges every process; when
``http.metrics_addr`` is set the series are served there and this port's
/metrics answers 404 (after the credential check, as Narad's).

Imports narad.api.{context,router}, narad.meta, narad.metrics, narad.errors.
"""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Any

import msgspec

from narad import metrics
from narad.api.context import ApiContext, query_bool
from narad.api.router import Request, Response, Router, json_response
from narad.errors import Forbidden, NotFound
from narad.meta import grants as G
from narad.meta import requests as Q
from narad.meta import versions as V

_OPENAPI: bytes | None = None


def openapi_document() -> bytes:
    """narad/api/openapi.json (package data), read once."""
    global _OPENAPI
    if _OPENAPI is None:
        _OPENAPI = resources.files("narad.api").joinpath("openapi.json").read_bytes()
    return _OPENAPI


NODE_STATUS_WAIT = 2.0  # members?detail=true asks every member, within this long in total
_STATUS_GAUGES = ("narad_ingress_wal_pending_records", "narad_ingress_dispatch_backlog_records")


async def local_node_status(ctx: ApiContext) -> Q.NodeStatusView:
    """This node's status, from the supervisor's merged metrics (every worker's
    ingress WAL: records staged but not yet durable, and records accepted but not
    yet confirmed at their owner, each as of the worker's last second) and the
    replica's member record (draining)."""
    snap = await ctx.call(metrics.NodeMetricsReq(), metrics.Snapshot, timeout=NODE_STATUS_WAIT)
    sums = dict.fromkeys(_STATUS_GAUGES, 0.0)
    for fam in snap.families:
        if fam.name in sums:
            sums[fam.name] = sum(v[0] for _, v in fam.samples)
    with ctx.store.read() as r:
        rec = r.member(ctx.node_id)
    return Q.NodeStatusView(ctx.node_id, bool(rec is not None and rec.draining),
                            int(sums["narad_ingress_wal_pending_records"]),
                            int(sums["narad_ingress_dispatch_backlog_records"]))


def member_json(m: Q.MemberView, status: Q.NodeStatusView | str | None = None) -> dict[str, Any]:
    """Narad's member row: ``heartbeat_age_seconds`` in whole seconds; with detail
    the member's ``node_status`` as the member itself reported it, or
    ``status_error`` saying why it is missing. This build moves no partitions and
    quarantines no copies: ``moves`` and ``quarantine`` are empty because there are
    none."""
    out: dict[str, Any] = msgspec.structs.asdict(m)
    out["heartbeat_age_seconds"] = int(m.heartbeat_age_seconds)
    if isinstance(status, Q.NodeStatusView):
        out["node_status"] = {"node": status.node, "draining": status.draining,
                              "produce_in_flight": status.produce_in_flight,
                              "dispatch_backlog": status.dispatch_backlog,
                              "quarantine": {"copies": 0, "bytes": 0, "list": []}, "moves": []}
    elif isinstance(status, str):
        out["status_error"] = status
    return out


class OpsAPI:
    def __init__(self, ctx: ApiContext) -> None:
        self.ctx = ctx

    def register(self, r: Router) -> None:
        r.add("GET", "/healthz", self.healthz)
        r.add("GET", "/readyz", self.readyz)
        r.add("GET", "/metrics", self.metrics)
        r.add("GET", "/v1/cluster/members", self.members)
        r.add("POST", "/v1/cluster/members/{id}/forget", self.forget)
        r.add("GET", "/v1/openapi.json", self.openapi)

    async def openapi(self, req: Request) -> Response:
        return Response(200, openapi_document(), "application/json")

    def _silent(self) -> list[tuple[str, float]]:
        return V.not_responding(self.ctx.versions.hb, self.ctx.versions.load(V.WORKERS))

    async def healthz(self, req: Request) -> Response:
        if self.ctx.versions.load(V.SHUTDOWN):
            return json_response(503, {"error": "shutting down"})
        vital = [f"{name} not responding for {age:.1f}s" for name, age in self._silent()
                 if name in ("supervisor", "raft tick thread")]
        if vital:
            return json_response(503, {"error": "node is not healthy: " + "; ".join(vital)})
        return json_response(200, {"status": "ok"})

    async def readyz(self, req: Request) -> Response:
        silent = self._silent()
        if silent and not self.ctx.versions.load(V.SHUTDOWN):
            why = "; ".join(f"{name} not responding for {age:.1f}s" for name, age in silent)
            return json_response(503, {"error": f"node is not ready: {why}"})
        if self.ctx.versions.load(V.READY) == 1:
            return json_response(200, {"status": "ready"})
        reason = V.READY_REASONS.get(self.ctx.versions.load(V.READY_REASON), "not ready")
        return json_response(503, {"error": f"metastore: node is not ready: {reason}"})

    async def metrics(self, req: Request) -> Response:
        """Every process's metrics; per-topic series only for topics the caller may
        read (the listing rule: a grant pattern matching the name, ownership or
        admin). Security off, naradctl and http.metrics_unauthenticated see all."""
        if self.ctx.cfg.http.metrics_addr:
            raise NotFound("404 page not found")  # served on the metrics listener instead
        snap = await self.ctx.call(metrics.NodeMetricsReq(), metrics.Snapshot, timeout=5.0)
        families = snap.families
        who: G.Identity = req.identity
        user = None if who.unrestricted else self.ctx.store.user(who.name or "")
        if not who.unrestricted and not G.is_admin(user):
            store = self.ctx.store

            def visible(name: str) -> bool:
                t = store.topic(name)
                return t is not None and G.can_read_topic(user, t)

            families = metrics.filter_topics(families, visible)
        return Response(200, metrics.render(families), metrics.CONTENT_TYPE)

    async def forget(self, req: Request) -> Response:
        """Remove a Raft server that has no member record (runs on the leader)."""
        who: G.Identity = req.identity
        if not who.unrestricted and not G.is_admin(self.ctx.store.user(who.name or "")):
            raise Forbidden("admin privileges required")
        resp = await self.ctx.call(Q.ForgetServerReq(who, req.params["id"]), Q.ForgetServerResp, timeout=20.0)
        return json_response(200, resp)

    async def members(self, req: Request) -> Response:
        who: G.Identity = req.identity
        if not who.unrestricted and not G.is_admin(self.ctx.store.user(who.name or "")):
            raise Forbidden("admin privileges required")
        detail = query_bool(req, "detail")
        resp = await self.ctx.call(Q.MembersReq(), Q.MembersResp, timeout=5.0)
        if not detail:
            return json_response(200, {"members": [member_json(m) for m in resp.members]})
        got = await self._node_statuses([m.id for m in resp.members])
        return json_response(200, {"members": [member_json(m, got[m.id]) for m in resp.members]})

    async def _node_statuses(self, ids: list[str]) -> dict[str, Q.NodeStatusView | str]:
        """Every member asked for its own status at once (this node locally, the
        others over node RPC), NODE_STATUS_WAIT in total; one that does not answer
        gets the reason instead."""
        ctx = self.ctx
        remote = getattr(ctx.broker, "remote", None) if ctx.broker is not None else None
        out: dict[str, Q.NodeStatusView | str] = {}

        async def one(node: str) -> None:
            try:
                if node == ctx.node_id:
                    out[node] = await local_node_status(ctx)
                elif remote is None:
                    out[node] = "not reachable from this node"
                elif not remote.node_alive(node):
                    out[node] = "member is marked dead"
                else:
                    out[node] = await remote.call(node, Q.NodeStatusReq(), Q.NodeStatusView, NODE_STATUS_WAIT)
            except Exception as e:
                out[node] = f"no answer: {type(e).__name__}: {e}"[:200]

        tasks = {n: asyncio.ensure_future(one(n)) for n in ids}
        _done, pending = await asyncio.wait(tasks.values(), timeout=NODE_STATUS_WAIT + 0.5)
        for n, t in tasks.items():
            if t in pending:
                t.cancel()
                out[n] = f"no answer within {NODE_STATUS_WAIT:g}s"
        return out
