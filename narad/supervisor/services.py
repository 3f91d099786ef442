"""What the supervisor answers over its Unix sockets.

``worker_service``: requests from workers (metadata writes, the failed-login
throttle, members and status views). ``control_service``: naradctl commands
(``status``, ``topics ...``, ``users ...``, ``members``), acting as the local
operator: the control socket is mode 0600 in the runtime directory, so
reaching it already proves root-equivalent access to the node.

Imports narad.meta, narad.ipc, narad.worker.main (the hello messages) and
narad.supervisor.{metadata,workers}; never narad.supervisor.main: what these
services need of the supervisor is the ``SupervisorView`` protocol below, which
the supervisor satisfies (checked by type checkers, not by import).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import bcrypt
import msgspec

from narad import BUILD, metrics
from narad.errors import BadRequest, NaradError, NotFound
from narad.ipc import rpc
from narad.ipc.control import CtlReply, CtlRequest
from narad.meta import export as EX
from narad.meta import requests as Q
from narad.meta import versions as V
from narad.meta.grants import OPERATOR
from narad.meta.raft import RaftNode
from narad.meta.records import Grant, TopicRecord
from narad.meta.store import MetaStore
from narad.supervisor.metadata import MetadataRouter
from narad.supervisor.workers import WorkerManager
from narad.worker.main import HelloAck, WorkerHello, WorkerServing

IMPORT_FORWARD_LIMIT = 12 << 20  # an import forwarded to the leader must fit one node-RPC frame
log = logging.getLogger("narad.supervisor")

THROTTLE_BURST = 5
THROTTLE_REFILL_SECONDS = 12.0
BUDGET_BURST = 32
BUDGET_REFILL_PER_SECOND = 4.0
THROTTLE_NAMES_LIMIT = 100_000


class LoginThrottle:
    """The failed-login throttle of the whole node, taken *before* each bcrypt
    check (so concurrent attempts cannot all pass): per username a bucket of 5
    tokens refilled one per 12 s; a check for a name with recent failures (its
    bucket not full) also needs a token of the node-wide failure budget (32,
    refilled 4 per second); a check for a name with a full bucket takes a
    budget token when one is left but never waits for one. A correct password
    gives back what its check took."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}  # user -> (tokens, last refill)
        self._budget = float(BUDGET_BURST)
        self._budget_at: float | None = None
        self._empty_logged = -1e18

    def _refill(self, user: str, now: float) -> float:
        tokens, last = self._buckets.get(user, (THROTTLE_BURST, now))
        return min(THROTTLE_BURST, tokens + max(0.0, now - last) / THROTTLE_REFILL_SECONDS)

    def _refill_budget(self, now: float) -> float:
        if self._budget_at is not None:
            self._budget = min(BUDGET_BURST, self._budget + max(0.0, now - self._budget_at) * BUDGET_REFILL_PER_SECOND)
        self._budget_at = now
        return self._budget

    def attempt(self, user: str, now: float | None = None) -> tuple[bool, float, bool]:
        """(allowed, seconds to wait when not, whether a budget token was taken)."""
        now = time.monotonic() if now is None else now
        tokens = self._refill(user, now)
        if tokens < 1:
            return False, (1 - tokens) * THROTTLE_REFILL_SECONDS, False
        budget = self._refill_budget(now)
        took = budget >= 1
        if took:
            self._budget = budget - 1
        elif tokens < THROTTLE_BURST:
            if now - self._empty_logged >= 10.0:
                self._empty_logged = now
                log.warning("auth: the node-wide failed-login budget is spent; refusing checks for names "
                            "with recent failures")
            return False, (1 - budget) / BUDGET_REFILL_PER_SECOND, False
        self._buckets[user] = (tokens - 1, now)
        if len(self._buckets) > THROTTLE_NAMES_LIMIT:
            self._prune(now)
        return True, 0.0, took

    def outcome(self, user: str, ok: bool, budget: bool = False, now: float | None = None) -> None:
        """A check's outcome: a failure keeps what its attempt took; a correct
        password gives the tokens back."""
        if not ok:
            return
        now = time.monotonic() if now is None else now
        tokens = min(THROTTLE_BURST, self._refill(user, now) + 1)
        if tokens >= THROTTLE_BURST:
            self._buckets.pop(user, None)
        else:
            self._buckets[user] = (tokens, now)
        if budget:
            self._budget = min(BUDGET_BURST, self._refill_budget(now) + 1)

    def _prune(self, now: float) -> None:
        """Forget names whose bucket is full again; if a spray of names still
        leaves too many, keep the half with the fewest tokens (the names under attack)."""
        live = {u: (t, at) for u, (t, at) in self._buckets.items()
                if t + (now - at) / THROTTLE_REFILL_SECONDS < THROTTLE_BURST}
        if len(live) > THROTTLE_NAMES_LIMIT // 2:
            keep = sorted(live.items(), key=lambda kv: kv[1][0] + (now - kv[1][1]) / THROTTLE_REFILL_SECONDS)
            live = dict(keep[:THROTTLE_NAMES_LIMIT // 2])
        self._buckets = live


class SupervisorView(Protocol):
    """What the worker and control services use of the supervisor."""

    node_id: str
    worker_conns: dict[int, rpc.Connection]
    workers: WorkerManager
    router: MetadataRouter
    raft: RaftNode
    store: MetaStore
    throttle: LoginThrottle
    metrics: Any

    async def wait_create_gate(self) -> None: ...
    async def current_replica(self) -> None: ...
    async def node_metrics(self) -> list[metrics.Family]: ...
    def node_status(self) -> Q.NodeStatus: ...
    def members_view(self) -> Q.MembersResp: ...


def worker_service(sup: SupervisorView) -> rpc.Service:
    s = rpc.Service()

    async def hello(m: WorkerHello, conn: rpc.Connection) -> HelloAck:
        conn.peer_info["worker"] = m.index
        conn.peer_info["pid"] = m.pid
        sup.worker_conns[m.index] = conn
        return HelloAck(sup.node_id)

    async def serving(m: WorkerServing, conn: rpc.Connection) -> None:
        sup.workers.mark_serving(m.index, m.pid)

    router = sup.router

    async def create_topic(m: Q.CreateTopicReq, conn: rpc.Connection) -> TopicRecord:
        await sup.wait_create_gate()
        return await router.execute(m)  # type: ignore[no-any-return]

    async def write(m: Any, conn: rpc.Connection) -> Any:
        return await router.execute(m)

    async def forward(m: Q.Forwarded, conn: rpc.Connection) -> Q.ForwardResp:
        if _is_create(m):
            await sup.wait_create_gate()
        return await router.serve_forward(m)

    async def auth_attempt(m: Q.AuthAttemptReq, conn: rpc.Connection) -> Q.AuthAttemptResp:
        ok, retry, budget = sup.throttle.attempt(m.username)
        return Q.AuthAttemptResp(ok, retry, budget)

    async def auth_outcome(m: Q.AuthOutcome, conn: rpc.Connection) -> None:
        sup.throttle.outcome(m.username, m.ok, m.budget)
        if not m.ok:
            sup.metrics.auth_failures.labels("bad_password").inc()

    async def members(m: Q.MembersReq, conn: rpc.Connection) -> Q.MembersResp:
        return sup.members_view()

    async def status(m: Q.StatusReq, conn: rpc.Connection) -> Q.NodeStatus:
        return sup.node_status()

    async def confirm_gone(m: Q.ConfirmGoneReq, conn: rpc.Connection) -> Q.ConfirmGoneResp:
        # Destroying data (a WAL discard) needs a provably current replica here
        # first, then the leader's definite "gone" (barrier and re-read there).
        if not sup.raft.caught_up():
            return Q.ConfirmGoneResp(False)
        return await router.execute(m)  # type: ignore[no-any-return]

    async def confirm_epoch(m: Q.ConfirmEpochReq, conn: rpc.Connection) -> Q.ConfirmEpochResp:
        # Anchoring a fan-out cursor or deleting its file: as for a WAL discard, a
        # provably current replica here first, then the leader's definite answer.
        # Anything but the leader's definite answer (no leader, a hop failing) is "not known".
        if not sup.raft.caught_up():
            return Q.ConfirmEpochResp(False, known=False)
        try:
            return await router.execute(m)  # type: ignore[no-any-return]
        except NaradError as e:
            log.info("fan-out epoch not confirmed", extra={"parent": m.parent, "child": m.child, "err": e.message})
            return Q.ConfirmEpochResp(False, known=False)

    async def caught_up(m: Q.CaughtUpReq, conn: rpc.Connection) -> Q.CaughtUpResp:
        return Q.CaughtUpResp(sup.raft.caught_up())

    async def node_metrics(m: metrics.NodeMetricsReq, conn: rpc.Connection) -> metrics.Snapshot:
        return metrics.Snapshot(await sup.node_metrics())

    for typ, fn in (
        (WorkerHello, hello), (WorkerServing, serving), (Q.CreateTopicReq, create_topic), (Q.AlterTopicReq, write),
        (Q.DeleteTopicReq, write), (Q.CreateUserReq, write), (Q.SetGrantsReq, write),
        (Q.SetPasswordReq, write), (Q.DeleteUserReq, write), (Q.Forwarded, forward), (Q.AuthAttemptReq, auth_attempt),
        (Q.AuthOutcome, auth_outcome), (Q.MembersReq, members), (Q.StatusReq, status),
        (metrics.NodeMetricsReq, node_metrics), (Q.ConfirmGoneReq, confirm_gone), (Q.ForgetServerReq, write),
        (Q.AttachChildReq, write), (Q.DetachChildReq, write), (Q.ConfirmEpochReq, confirm_epoch),
        (Q.CaughtUpReq, caught_up),
        # partition moves (issue 13): MetaService answers them on the leader (the router forwards)
        (Q.DecommissionReq, write), (Q.AbortMoveReq, write), (Q.CompleteMoveReq, write),
        (Q.AssignmentReadReq, write),
    ):
        s.register(typ, fn)  # type: ignore[arg-type]
    return s


def _is_create(m: Q.Forwarded) -> bool:
    try:
        return msgspec.msgpack.decode(m.request, type=dict).get("type") == "CreateTopicReq"
    except (msgspec.DecodeError, AttributeError):
        return False


def _topic_view(t: TopicRecord) -> dict[str, Any]:
    from narad.api.topics import topic_json

    return topic_json(t)


def control_service(sup: SupervisorView) -> rpc.Service:
    s = rpc.Service()
    router = sup.router

    async def handle(m: CtlRequest, conn: rpc.Connection) -> CtlReply:
        a = m.args
        if m.cmd == "status":
            return CtlReply(msgspec.to_builtins(sup.node_status()))
        if m.cmd == "members":
            return CtlReply(msgspec.to_builtins(sup.members_view()))
        if m.cmd == "metastore.export":
            await sup.current_replica()
            with sup.store.read() as r:
                return CtlReply(EX.build_export(r, build=BUILD, node=sup.node_id, now_ms=int(time.time() * 1000)))
        if m.cmd == "metastore.import":
            doc = a.get("document", "")
            if isinstance(doc, str) and len(doc) > IMPORT_FORWARD_LIMIT and not sup.raft.is_leader():
                raise BadRequest(f"the export is larger than {IMPORT_FORWARD_LIMIT >> 20} MiB, more than one "
                                 "node-RPC frame: run the import on the Raft leader (naradctl status shows it)")
            resp = await router.execute(Q.ImportMetastoreReq(
                OPERATOR, doc.encode() if isinstance(doc, str) else b"", bool(a.get("overwrite"))))
            return CtlReply(msgspec.to_builtins(resp))
        if m.cmd == "members.forget":
            resp = await router.execute(Q.ForgetServerReq(OPERATOR, str(a.get("id", ""))))
            return CtlReply(msgspec.to_builtins(resp))
        if m.cmd == "topics.ls":
            with sup.store.read() as r:
                return CtlReply([_topic_view(t) for t in r.topics()])
        if m.cmd == "topics.describe":
            name = str(a.get("name", ""))
            with sup.store.read() as r:
                t = r.topic(name)
                if t is None:
                    raise NotFound(f'topic "{name}" not found')
                rows = r.assignments(name)
                schema_version = t.schema_version
            out = _topic_view(t)
            out["schema_version"] = schema_version
            out["assignments"] = {str(p): rows[p].owner for p in sorted(rows) if rows[p].topic_id == t.id}
            return CtlReply(out)
        if m.cmd == "topics.create":
            await sup.wait_create_gate()
            schema = a.get("schema")
            rec = await router.execute(Q.CreateTopicReq(
                who=OPERATOR, name=str(a.get("name", "")), partitions=a.get("partitions"),
                retention_ms=a.get("retention_ms"), visibility_timeout_ms=a.get("visibility_timeout_ms"),
                max_in_flight_per_partition=a.get("max_in_flight_per_partition"),
                max_acked_ahead_per_partition=a.get("max_acked_ahead_per_partition"),
                schema=schema.encode() if isinstance(schema, str) else None,
            ))
            return CtlReply(_topic_view(rec))
        if m.cmd == "topics.alter":
            rec = await router.execute(Q.AlterTopicReq(
                who=OPERATOR, name=str(a.get("name", "")), retention_ms=a.get("retention_ms"),
                max_in_flight_per_partition=a.get("max_in_flight_per_partition"),
                max_acked_ahead_per_partition=a.get("max_acked_ahead_per_partition"),
                partitions=a.get("partitions"),
            ))
            return CtlReply(_topic_view(rec))
        if m.cmd == "topics.rm":
            await router.execute(Q.DeleteTopicReq(who=OPERATOR, name=str(a.get("name", ""))))
            return CtlReply({"deleted": a.get("name")})
        if m.cmd in ("topics.attach", "topics.detach", "topics.children"):
            # naradctl's fan-out commands (narad.api.topics owns the logic); the attach point
            # is asked of the parent partitions' owners over node RPC (this process has no broker)
            from narad.api.topics import ctl_fanout
            from narad.cluster.remote import ClusterRemote

            nodes = ClusterRemote(sup.node_id, sup.store, router.client)
            return CtlReply(await ctl_fanout(m.cmd, a, sup.store, nodes.call, router.execute))
        if m.cmd in ("moves", "moves.abort", "members.decommission"):
            # naradctl's partition-move commands (narad.api.ops owns the logic, as for HTTP);
            # a move's destination is asked for its runner over node RPC (this process has no broker)
            from narad.api.ops import NODE_STATUS_WAIT, ctl_cluster
            from narad.cluster.remote import ClusterRemote

            peers = ClusterRemote(sup.node_id, sup.store, router.client)

            async def node_status(node: str) -> Q.NodeStatusView:
                return await peers.call(node, Q.NodeStatusReq(), Q.NodeStatusView, NODE_STATUS_WAIT)

            return CtlReply(await ctl_cluster(m.cmd, a, sup.store, node_status, router.execute))
        if m.cmd == "users.ls":
            from narad.api.users import user_json

            with sup.store.read() as r:
                return CtlReply([user_json(u) for u in r.users()])
        if m.cmd == "users.add":
            from narad.api.users import user_json
            from narad.meta import validate as VAL

            pw = VAL.password(a.get("password"))
            grants = [Grant(g["action"], list(g.get("patterns", []))) for g in a.get("grants", [])]
            hashed = await asyncio.to_thread(bcrypt.hashpw, pw, bcrypt.gensalt(10))
            rec = await router.execute(Q.CreateUserReq(OPERATOR, str(a.get("username", "")), hashed, grants))
            return CtlReply(user_json(rec))
        if m.cmd == "users.rm":
            await router.execute(Q.DeleteUserReq(OPERATOR, str(a.get("username", ""))))
            return CtlReply({"deleted": a.get("username")})
        if m.cmd == "users.passwd":
            # the operator's recovery path: any user's password, the root admin's included
            from narad.meta import validate as VAL

            pw = VAL.password(a.get("password"))
            hashed = await asyncio.to_thread(bcrypt.hashpw, pw, bcrypt.gensalt(10))
            await router.execute(Q.SetPasswordReq(OPERATOR, str(a.get("username", "")), hashed))
            return CtlReply({"username": a.get("username"), "password": "changed"})
        if m.cmd == "users.grant":
            from narad.api.users import user_json

            grants = [Grant(g["action"], list(g.get("patterns", []))) for g in a.get("grants", [])]
            rec = await router.execute(Q.SetGrantsReq(OPERATOR, str(a.get("username", "")), grants))
            return CtlReply(user_json(rec))
        raise BadRequest(f"unknown command {m.cmd!r}")

    s.register(CtlRequest, handle)  # type: ignore[arg-type]
    return s


def ready_reason_text(code: int) -> str:
    return V.READY_REASONS.get(code, "not ready")


__all__ = ["BUILD", "CtlReply", "CtlRequest", "LoginThrottle", "control_service", "worker_service"]
