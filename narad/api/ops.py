"""Operational routes: /healthz, /readyz, /metrics, /v1/cluster/members,
POST /v1/cluster/members/{id}/forget, the partition-move routes (GET
/v1/cluster/moves, POST|DELETE /v1/cluster/members/{id}/decommission, POST
/v1/cluster/moves/{topic}/{partition}/abort) and GET /v1/openapi.json (the API
description, narad/api/openapi.json, served as stored, without credentials).
naradctl's ``moves`` and ``members decommission`` run the same code from the
supervisor (``ctl_cluster``).

/healthz and /readyz need no credentials and answer from shared memory at
request time. First the heartbeats (``narad.meta.versions``): a process
whose loop has been silent for more than 3 s makes /readyz 503 naming it
(``supervisor not responding for 4.2s``, ``worker 1 ...``, ``raft tick
thread ...``, ``fork server ...``), and so does a worker's background loop
that failed within the last 10 s (``worker 0: background task 'sweeper'
failed 1.2s ago``; ``V.failing``); a silent supervisor or Raft tick thread
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
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

import msgspec

from narad import metrics
from narad.api.context import ApiContext, parse_int, query_bool, single_query
from narad.api.router import Request, Response, Router, empty, json_response
from narad.errors import BadRequest, Forbidden, NotFound
from narad.meta import grants as G
from narad.meta import requests as Q
from narad.meta import versions as V
from narad.meta.store import MetaStore, Reader

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
    yet confirmed at their owner, each as of the worker's last second), the
    replica's member record (draining), and the broker's move runners and
    quarantined copies (``Broker.move_status()``: ``(moves, quarantine)``, when the
    broker has it)."""
    snap = await ctx.call(metrics.NodeMetricsReq(), metrics.Snapshot, timeout=NODE_STATUS_WAIT)
    sums = dict.fromkeys(_STATUS_GAUGES, 0.0)
    for fam in snap.families:
        if fam.name in sums:
            sums[fam.name] = sum(v[0] for _, v in fam.samples)
    with ctx.store.read() as r:
        rec = r.member(ctx.node_id)
    moves: list[Q.MoveWorkerView] = []
    quarantine: list[Q.QuarantinedCopy] = []
    status_of = getattr(ctx.broker, "move_status", None)
    if status_of is not None:
        got = status_of()
        if asyncio.iscoroutine(got):
            got = await got
        moves, quarantine = got
    return Q.NodeStatusView(ctx.node_id, bool(rec is not None and rec.draining),
                            int(sums["narad_ingress_wal_pending_records"]),
                            int(sums["narad_ingress_dispatch_backlog_records"]), list(moves), list(quarantine))


QUARANTINE_LIST_MAX = 100  # node_status.quarantine.list holds at most this many copies (the largest first)


def move_worker_json(w: Q.MoveWorkerView) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(w)
    if out.get("blocked") is None:
        out.pop("blocked", None)
    return out


def node_status_json(st: Q.NodeStatusView) -> dict[str, Any]:
    """Narad's NodeStatus: ``quarantine`` as {copies, bytes, list (at most 100)}."""
    copies = sorted(st.quarantine, key=lambda q: (-q.bytes, q.topic, q.partition, q.dir))
    return {"node": st.node, "draining": st.draining, "produce_in_flight": st.produce_in_flight,
            "dispatch_backlog": st.dispatch_backlog,
            "quarantine": {"copies": len(copies), "bytes": sum(q.bytes for q in copies),
                           "list": [msgspec.to_builtins(q) for q in copies[:QUARANTINE_LIST_MAX]]},
            "moves": [move_worker_json(w) for w in st.moves]}


def member_json(m: Q.MemberView, status: Q.NodeStatusView | str | None = None) -> dict[str, Any]:
    """Narad's member row: ``heartbeat_age_seconds`` in whole seconds;
    ``decommission_blocked`` only for a draining member whose removal waits; with
    detail the member's ``node_status`` as the member itself reported it, or
    ``status_error`` saying why it is missing."""
    out: dict[str, Any] = msgspec.to_builtins(m)
    out["heartbeat_age_seconds"] = int(m.heartbeat_age_seconds)
    if out.get("decommission_blocked") is None:
        out.pop("decommission_blocked", None)
    if isinstance(status, Q.NodeStatusView):
        out["node_status"] = node_status_json(status)
    elif isinstance(status, str):
        out["status_error"] = status
    return out


# ---- partition moves ------------------------------------------------------------------------


def _node_state(members: dict[str, Any], node: str) -> str:
    rec = members.get(node)
    if rec is None:
        return "not_a_member"
    if rec.status == "dead":
        return "dead"
    return "draining" if rec.draining else "alive"


def moves_in(r: Reader) -> list[Q.MoveView]:
    """Every assignment row of a live topic incarnation with a move target, in
    (topic, partition) order, with both ends' status and why the move cannot go
    on (``blocked``), when it cannot."""
    out: list[Q.MoveView] = []
    members = {m.id: m for m in r.members()}
    incarnation: dict[str, str | None] = {}
    for name, part, a in r.all_assignments():
        if a.target is None:
            continue
        if name not in incarnation:
            t = r.topic(name)
            incarnation[name] = t.id if t is not None else None
        if incarnation[name] != a.topic_id:
            continue  # a row of a deleted incarnation, waiting to be pruned
        src, dst = _node_state(members, a.owner), _node_state(members, a.target)
        blocked = ("target_not_member" if dst == "not_a_member" else "target_dead" if dst == "dead"
                   else "source_dead" if src in ("dead", "not_a_member") else None)
        out.append(Q.MoveView(name, part, a.owner, a.target, src, dst, blocked))
    out.sort(key=lambda m: (m.topic, m.partition))
    return out


def moves_from_replica(store: MetaStore) -> list[Q.MoveView]:
    """``moves_in`` this node's replica."""
    with store.read() as r:
        return moves_in(r)


def move_json(m: Q.MoveView) -> dict[str, Any]:
    """Narad's Move (``from``, ``to``; ``blocked``, ``worker``, ``worker_error`` only when set)."""
    out: dict[str, Any] = {"topic": m.topic, "partition": m.partition, "from": m.from_, "to": m.to,
                           "from_status": m.from_status, "to_status": m.to_status}
    if m.blocked is not None:
        out["blocked"] = m.blocked
    if m.worker is not None:
        out["worker"] = move_worker_json(m.worker)
    if m.worker_error is not None:
        out["worker_error"] = m.worker_error
    return out


def attach_workers(moves: list[Q.MoveView], statuses: dict[str, Q.NodeStatusView | str]) -> None:
    """Each move's runner as its destination reported it (``worker``), or why there
    is none (``worker_error``)."""
    for m in moves:
        st = statuses.get(m.to)
        if isinstance(st, Q.NodeStatusView):
            w = next((w for w in st.moves if w.topic == m.topic and w.partition == m.partition), None)
            if w is not None:
                m.worker = w
            else:
                m.worker_error = f"node {m.to} runs no move of this partition (yet)"
        elif st is not None:
            m.worker_error = st
        elif m.to_status == "dead":
            m.worker_error = f"node {m.to} is marked dead: not asked"
        elif m.to_status == "not_a_member":
            m.worker_error = f"node {m.to} is not a member: not asked"
        else:
            m.worker_error = f"node {m.to} was not asked"


def destinations(moves: list[Q.MoveView]) -> list[str]:
    """The destinations worth asking for their runners: members alive (or draining)."""
    return list(dict.fromkeys(m.to for m in moves if m.to_status in ("alive", "draining")))


NodeStatusCall = Callable[[str], Awaitable[Q.NodeStatusView]]


async def gather_node_statuses(ids: list[str], one: NodeStatusCall,
                               skip: Callable[[str], str | None] | None = None) -> dict[str, Q.NodeStatusView | str]:
    """Ask every node in ``ids`` for its status at once, NODE_STATUS_WAIT in total; a
    node that does not answer (or that ``skip`` names a reason for) gets the reason."""
    out: dict[str, Q.NodeStatusView | str] = {}

    async def ask(node: str) -> None:
        why = skip(node) if skip is not None else None
        if why is not None:
            out[node] = why
            return
        try:
            out[node] = await one(node)
        except Exception as e:
            out[node] = f"no answer: {type(e).__name__}: {e}"[:200]

    tasks = {n: asyncio.ensure_future(ask(n)) for n in dict.fromkeys(ids)}
    if not tasks:
        return out
    _done, pending = await asyncio.wait(tasks.values(), timeout=NODE_STATUS_WAIT + 0.5)
    for n, t in tasks.items():
        if t in pending:
            t.cancel()
            out[n] = f"no answer within {NODE_STATUS_WAIT:g}s"
    return out


def decommission_dry_run(value: str | None, *, cancel: bool) -> bool:
    """The ``dry_run`` query parameter: true|false (as ``detail``); given at all on a
    cancel (DELETE) it is a 400."""
    if value is None:
        return False
    if cancel:
        raise BadRequest("invalid argument: dry_run applies to POST (a decommission), not to cancelling one")
    v = value.lower()
    if v in ("1", "true", "t", "yes"):
        return True
    if v in ("0", "false", "f", "no"):
        return False
    raise BadRequest("invalid argument: dry_run must be true or false")


NODE_ID_MAX = 256


def node_arg(value: str | None, name: str) -> str | None:
    """A node id given as a query parameter: non-empty UTF-8 (a query's undecodable
    bytes arrive as surrogates, which no node id holds), at most NODE_ID_MAX bytes."""
    if value is None:
        return None
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        size = -1
    if not 0 < size <= NODE_ID_MAX:
        raise BadRequest(f"invalid argument: {name} must name a node (1 to {NODE_ID_MAX} bytes of UTF-8); leave "
                         "it out to abort whatever move is in flight")
    return value


def abort_note(m: Q.MoveView) -> str:
    return (f"the move of {m.topic}/{m.partition} to {m.to} is aborted: the partition stays with {m.from_}; "
            "a later planner pass may move it again")


def abort_json(resp: Q.AbortMoveResp) -> dict[str, Any]:
    return {"move": move_json(resp.move), "note": resp.note or abort_note(resp.move)}


async def ctl_cluster(cmd: str, args: dict[str, Any], store: MetaStore, node_status: NodeStatusCall,
                      execute: Callable[[Any], Awaitable[Any]]) -> Any:
    """naradctl ``moves [--detail]``, ``moves abort <topic> <partition> [--target]`` and
    ``members decommission <id> [--dry-run|--cancel]``, as the local operator (the
    same answers as the HTTP routes). ``node_status`` asks one node (this one
    included) for its NodeStatusView; ``execute`` runs a request as the worker's link
    does (the supervisor's metadata router)."""
    if cmd == "moves":
        moves = moves_from_replica(store)
        if args.get("detail"):
            attach_workers(moves, await gather_node_statuses(destinations(moves), node_status))
        return {"moves": [move_json(m) for m in moves]}
    if cmd == "moves.abort":
        topic, target = str(args.get("topic", "")), args.get("target")
        partition = parse_int(str(args.get("partition", "")), "partition")
        target = node_arg(None if target is None else str(target), "target")
        resp = await execute(Q.AbortMoveReq(G.OPERATOR, topic, partition, target))
        return abort_json(resp)
    if cmd == "members.decommission":
        node_id = str(args.get("id", ""))
        dry_run, cancel = bool(args.get("dry_run")), bool(args.get("cancel"))
        if dry_run and cancel:
            raise BadRequest("invalid argument: dry_run applies to a decommission, not to cancelling one")
        resp = await execute(Q.DecommissionReq(G.OPERATOR, node_id, dry_run=dry_run, cancel=cancel))
        if dry_run:
            return msgspec.to_builtins(resp)
        return {"member": node_id, "draining": not cancel}
    raise BadRequest(f"unknown command {cmd!r}")


class OpsAPI:
    def __init__(self, ctx: ApiContext) -> None:
        self.ctx = ctx

    def register(self, r: Router) -> None:
        r.add("GET", "/healthz", self.healthz)
        r.add("GET", "/readyz", self.readyz)
        r.add("GET", "/metrics", self.metrics)
        r.add("GET", "/v1/cluster/members", self.members)
        r.add("POST", "/v1/cluster/members/{id}/forget", self.forget)
        r.add("POST", "/v1/cluster/members/{id}/decommission", self.decommission)
        r.add("DELETE", "/v1/cluster/members/{id}/decommission", self.cancel_decommission)
        r.add("GET", "/v1/cluster/moves", self.moves)
        r.add("POST", "/v1/cluster/moves/{topic}/{partition}/abort", self.abort_move)
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
        failing = V.failing(self.ctx.versions.hb, self.ctx.versions.load(V.WORKERS))
        if failing and not self.ctx.versions.load(V.SHUTDOWN):
            return json_response(503, {"error": "node is not ready: " + "; ".join(failing)})
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

    def _admin(self, req: Request) -> G.Identity:
        who: G.Identity = req.identity
        if not who.unrestricted and not G.is_admin(self.ctx.store.user(who.name or "")):
            raise Forbidden("admin privileges required")
        return who

    async def forget(self, req: Request) -> Response:
        """Remove a Raft server that has no member record (runs on the leader)."""
        who = self._admin(req)
        resp = await self.ctx.call(Q.ForgetServerReq(who, req.params["id"]), Q.ForgetServerResp, timeout=20.0)
        return json_response(200, resp)

    async def members(self, req: Request) -> Response:
        self._admin(req)
        detail = query_bool(req, "detail")
        resp = await self.ctx.call(Q.MembersReq(), Q.MembersResp, timeout=5.0)
        if not detail:
            return json_response(200, {"members": [member_json(m) for m in resp.members]})
        got = await self._node_statuses([m.id for m in resp.members])
        return json_response(200, {"members": [member_json(m, got[m.id]) for m in resp.members]})

    async def moves(self, req: Request) -> Response:
        """The moves in flight, from this node's replica; with detail each
        destination is asked for its move runner (NODE_STATUS_WAIT in total)."""
        self._admin(req)
        detail = query_bool(req, "detail")
        moves = moves_from_replica(self.ctx.store)
        if detail and moves:
            attach_workers(moves, await self._node_statuses(destinations(moves)))
        return json_response(200, {"moves": [move_json(m) for m in moves]})

    async def decommission(self, req: Request) -> Response:
        """Mark a member draining (204), or with dry_run say whether it would be
        accepted (200, answered from this node's replica, never forwarded)."""
        who = self._admin(req)
        dry_run = decommission_dry_run(single_query(req, "dry_run"), cancel=False)
        node_id = req.params["id"]
        if dry_run:
            resp = await self.ctx.call(Q.DecommissionReq(who, node_id, dry_run=True), Q.DecommissionResp,
                                       timeout=10.0)
            return json_response(200, resp)
        await self.ctx.call(Q.DecommissionReq(who, node_id), Q.Empty)
        return empty(204)

    async def cancel_decommission(self, req: Request) -> Response:
        """Stop a decommission: the member takes partitions again; the ones already
        moved off stay where they are."""
        who = self._admin(req)
        decommission_dry_run(single_query(req, "dry_run"), cancel=True)
        await self.ctx.call(Q.DecommissionReq(who, req.params["id"], cancel=True), Q.Empty)
        return empty(204)

    async def abort_move(self, req: Request) -> Response:
        """Clear a partition's move target (compare-and-set on the target read, or
        on ``target`` when given): 202 with the move as it was aborted."""
        who = self._admin(req)
        partition = parse_int(req.params["partition"], "partition")
        target = node_arg(single_query(req, "target"), "target")
        resp = await self.ctx.call(Q.AbortMoveReq(who, req.params["topic"], partition, target), Q.AbortMoveResp)
        return json_response(202, abort_json(resp))

    async def _node_statuses(self, ids: list[str]) -> dict[str, Q.NodeStatusView | str]:
        """Every node of ``ids`` asked for its own status at once (this node locally,
        the others over node RPC), NODE_STATUS_WAIT in total; one that does not
        answer gets the reason instead."""
        ctx = self.ctx
        remote = getattr(ctx.broker, "remote", None) if ctx.broker is not None else None

        def skip(node: str) -> str | None:
            if node == ctx.node_id:
                return None
            if remote is None:
                return "not reachable from this node"
            if not remote.node_alive(node):
                return "member is marked dead"
            return None

        async def one(node: str) -> Q.NodeStatusView:
            if node == ctx.node_id:
                return await local_node_status(ctx)
            return await remote.call(node, Q.NodeStatusReq(), Q.NodeStatusView, NODE_STATUS_WAIT)  # type: ignore[no-any-return,union-attr]

        return await gather_node_statuses(ids, one, skip)
