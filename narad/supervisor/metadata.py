"""Where a node's metadata requests go.

On the Raft leader the request runs in this node's metadata service. On any
other node it is forwarded to the leader over node RPC (QUIC, the cluster
port), and the answer waits until this node's own replica has applied the
index the leader reached (at most 3 s, as the seed says), so a read on this
node right after the answer sees the write. No leader: retry until the write
deadline (``cluster.write_timeout``, 10 s), each hop capped well below it, then
503. A forwarded request carries an id: a retry after a lost answer gets the
first answer instead of running twice.

Imports narad.meta, narad.metrics and the cluster transport (as a duck-typed client).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Union

import msgspec

from narad import metrics
from narad.errors import ATTACH_POINT, BadGateway, GatewayTimeout, Misdirected, NaradError, Unavailable
from narad.meta import requests as Q
from narad.meta.raft import RaftNode
from narad.meta.records import TopicRecord, UserRecord
from narad.meta.service import FORWARDABLE, MetaService, last_index
from narad.meta.store import MetaStore

log = logging.getLogger("narad.supervisor.metadata")

HOP_TIMEOUT = 4.0
APPLY_WAIT = 3.0
RETRY_SLEEP = 0.1
DEDUPE_SECONDS = 300.0

RESPONSE_TYPES: dict[type, type] = {
    Q.CreateTopicReq: TopicRecord,
    Q.AlterTopicReq: TopicRecord,
    Q.CreateUserReq: UserRecord,
    Q.SetGrantsReq: UserRecord,
    Q.ConfirmGoneReq: Q.ConfirmGoneResp,
    Q.ForgetServerReq: Q.ForgetServerResp,
    Q.ImportMetastoreReq: Q.ImportMetastoreResp,
    Q.AttachChildReq: TopicRecord,  # the parent after the attach
    Q.ConfirmEpochReq: Q.ConfirmEpochResp,
    Q.CompleteMoveReq: Q.CompleteMoveResp,
    Q.AssignmentReadReq: Q.AssignmentReadResp,
    Q.AbortMoveReq: Q.AbortMoveResp,
    # Q.DecommissionReq answers Empty when forwarded (a dry run is never forwarded)
}
_req_dec = msgspec.msgpack.Decoder(Union[FORWARDABLE])  # type: ignore[valid-type]  # noqa: UP007
_enc = msgspec.msgpack.Encoder()


class MetadataRouter:
    def __init__(
        self,
        *,
        node_id: str,
        meta: MetaService,
        raft: RaftNode,
        store: MetaStore,
        applied: Callable[[], int],
        client: Any,
        write_timeout: float,
    ) -> None:
        self.node_id = node_id
        self.meta = meta
        self.raft = raft
        self.store = store
        self.applied = applied
        self.client = client
        self.write_timeout = write_timeout
        self._done: OrderedDict[str, tuple[float, Q.ForwardResp]] = OrderedDict()
        self._running: dict[str, asyncio.Future[Q.ForwardResp]] = {}

    def leader_cluster_addr(self) -> tuple[str, int] | None:
        leader = self.raft.leader()
        if leader is None:
            return None
        with self.store.read() as r:
            for m in r.members():
                if m.raft_addr == leader and m.cluster_addr:
                    host, _, port = m.cluster_addr.rpartition(":")
                    return host, int(port)
        return None

    async def execute(self, req: msgspec.Struct) -> Any:
        """Run `req` on the leader; answer once this node's replica holds it
        (timed: narad_metastore_write_seconds{op}, answered or refused)."""
        t0 = time.monotonic()
        try:
            return await self._execute(req)
        finally:
            metrics.get().meta_write_seconds.labels(metrics.op_label(type(req))).observe(time.monotonic() - t0)

    async def _execute(self, req: msgspec.Struct) -> Any:
        if isinstance(req, Q.DecommissionReq) and req.dry_run:
            return await self.meta.decommission(req)  # answered from this node's replica, never forwarded
        end = time.monotonic() + self.write_timeout
        rid = uuid.uuid4().hex
        uncertain = False
        last_err = "no raft leader"
        while True:
            if self.raft.is_leader():
                return await self.meta.dispatch_as(req, rid)
            addr = self.leader_cluster_addr()
            remaining = end - time.monotonic()
            if remaining <= 0:
                msg = f"metadata write failed: {last_err}"
                if uncertain:
                    msg += "; the write may have landed, read it back before retrying"
                raise Unavailable(msg, headers=[("Retry-After", "1")])
            if addr is None:
                await asyncio.sleep(min(RETRY_SLEEP, remaining))
                continue
            fwd = Q.ForwardReq(self.node_id, rid, msgspec.Raw(_enc.encode(req)))
            leader = self.raft.leader()
            call = asyncio.ensure_future(self.client.call(addr, fwd, Q.ForwardResp,
                                                          timeout=min(HOP_TIMEOUT, remaining)))
            try:
                # A leader that died does not answer: when Raft elects another,
                # stop waiting for the old one and go to the new one.
                while not call.done():
                    await asyncio.wait((call,), timeout=0.05)
                    if not call.done() and self.raft.leader() != leader:
                        call.cancel()
                        raise Unavailable("the leader changed while the write was in flight")
                resp = call.result()
            except asyncio.CancelledError:
                if not call.done():
                    call.cancel()
                raise
            except Misdirected:
                last_err = "the leader changed"
                await asyncio.sleep(min(RETRY_SLEEP, max(0.0, end - time.monotonic())))
                continue
            except (Unavailable, BadGateway, GatewayTimeout) as e:
                if e.code == ATTACH_POINT:
                    raise  # not proposed; only the receiving worker can read the attach point again
                last_err = e.message
                uncertain = uncertain or not isinstance(e, Unavailable) or "in flight" in e.message
                await asyncio.sleep(min(RETRY_SLEEP, max(0.0, end - time.monotonic())))
                continue
            # Read-your-writes here: wait for the local replica until the write's own deadline
            # (at least APPLY_WAIT), then answer anyway (logged): the write did land.
            await self.wait_applied(resp.index, max(APPLY_WAIT, end - time.monotonic()))
            typ = RESPONSE_TYPES.get(type(req), Q.Empty)
            return msgspec.msgpack.decode(resp.value, type=typ)

    async def wait_applied(self, index: int, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while self.applied() < index:
            if time.monotonic() >= end:
                log.warning("answering before the local replica caught up with the leader",
                            extra={"index": index, "applied": self.applied()})
                return False
            await asyncio.sleep(0.002)
        return True

    # ---- leader side ---------------------------------------------------------------------
    async def serve_forward(self, m: Q.Forwarded) -> Q.ForwardResp:
        """A request forwarded from another node: run it here if this node leads."""
        if not self.raft.is_leader():
            raise Misdirected("this node is not the raft leader", extra={"leader": self.raft.leader() or ""})
        now = time.monotonic()
        while self._done and next(iter(self._done.values()))[0] < now - DEDUPE_SECONDS:
            self._done.popitem(last=False)
        hit = self._done.get(m.request_id)
        if hit is not None:
            return hit[1]
        running = self._running.get(m.request_id)
        if running is not None:
            return await asyncio.shield(running)
        fut: asyncio.Future[Q.ForwardResp] = asyncio.get_running_loop().create_future()
        self._running[m.request_id] = fut
        try:
            req = _req_dec.decode(m.request)
            last_index.set(0)
            value = await self.meta.dispatch_as(req, m.request_id)
            resp = Q.ForwardResp(msgspec.Raw(_enc.encode(value)), max(last_index.get(), 0))
            self._done[m.request_id] = (time.monotonic(), resp)
            fut.set_result(resp)
            return resp
        except NaradError as e:
            fut.set_exception(e)
            fut.exception()
            raise
        except msgspec.DecodeError as e:
            err = Unavailable(f"undecodable forwarded request: {e}")
            fut.set_exception(err)
            fut.exception()
            raise err from None
        except BaseException:  # cancelled: a duplicate waiting on it must not hang
            if not fut.done():
                fut.set_exception(Unavailable("the forwarded request was cancelled at the leader; retry"))
                fut.exception()
            raise
        finally:
            self._running.pop(m.request_id, None)
