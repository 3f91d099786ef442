"""Worker-to-worker messages and the links that carry them.

A request that lands on a worker which does not own the partition reaches
the owner in one local hop over a Unix socket (``<runtime>/w<i>.sock``):
commit a batch (dispatcher -> owner; a direct commit's batches for several
partitions of one worker in one hop: ``CommitManyReq``), reserve for a consumer (probe), ack /
extend / nack, replay, partition stats, fan-out lag, and the watch / unwatch / data-ready
notes that wake a long-poll parked on another worker. Links reconnect on demand (a
restarted peer comes back on the same path).

Imports narad.ipc, narad.metrics (the hop counter) and narad.meta.requests (pure data).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec

from narad import metrics
from narad.errors import Unavailable
from narad.ipc import rpc
from narad.meta.requests import MoveWorkerView, QuarantinedCopy

log = logging.getLogger("narad.broker.peers")
T = TypeVar("T")

RecordTuple = tuple[bytes | None, int, bytes]  # key, flags, payload


class CommitReq(msgspec.Struct, tag=True, array_like=True):
    topic: str
    topic_id: str
    partition: int
    records: list[RecordTuple]
    # A direct commit's hop between workers of one node (issue 14): each record's
    # idempotency key as its block holds it (None: none), so the owner reads no block
    # (``Partition.submit``'s ``ikeys``). Honoured from a worker of this node only, and
    # only one a record; the WAL's hops and other nodes leave it out (the owner then
    # reads the blocks). Trailing and defaulted: an older peer ignores it.
    ikeys: list[str | None] | None = None


class CommitResp(msgspec.Struct, array_like=True):
    base: int
    # Idempotent produce (issue 14): indexes of the records dropped as duplicates of an
    # idempotency key. Trailing and defaulted: an older peer sends and ignores it.
    dups: list[int] = []


class CommitManyReq(msgspec.Struct, tag=True, array_like=True):
    """Several ``CommitReq`` for one worker in one hop: the direct commits of a loop
    pass (``Broker._hop_commit``; an idempotent batch spans partitions, and a worker
    owns several of them). Each part is committed as its own ``CommitReq`` would be and
    answered on its own (``CommitManyResp``); the parts of one hop go to the same
    commit round at the receiver when they can. Sent between workers of one node only."""

    parts: list[CommitReq]


class CommitPart(msgspec.Struct, array_like=True):
    """One part's answer: ``status`` 0 and the commit's (base, dups), or the error the
    part's own ``CommitReq`` would have raised (status, message, code)."""

    base: int = 0
    dups: list[int] = []
    status: int = 0
    message: str = ""
    code: str | None = None


class CommitManyResp(msgspec.Struct, array_like=True):
    parts: list[CommitPart]


class Item(msgspec.Struct, array_like=True):
    """A delivered (or replayed) record."""

    partition: int
    offset: int
    nonce: int
    key: bytes | None
    ts_ms: int
    flags: int
    payload: bytes
    deliveries: int = 0  # a lease: how many times the record was leased, this one included (0: not counted)


WORKER, NODE = 0, 1  # scope of a request: the receiving worker only, or every worker of its node


class ConsumeReq(msgspec.Struct, tag=True, array_like=True):
    topic: str
    topic_id: str
    max: int
    partition: int | None = None
    scope: int = WORKER
    vis_ms: int = 0  # this consume's lease length (0: the topic's); a trailing field older peers ignore


class ConsumeResp(msgspec.Struct, array_like=True):
    items: list[Item]


class AckReq(msgspec.Struct, tag=True, array_like=True):
    topic: str
    topic_id: str
    mode: int  # 0 ack, 1 extend, 2 nack, 3 give back (a nack taking its delivery count back; older nodes: a nack)
    items: list[tuple[int, int, int]]  # partition, offset, nonce
    scope: int = WORKER
    dur_ms: int = 0  # nack: its delay; extend: the new lease length (0: none / the topic's); trailing, defaulted
    reason: str = ""  # nack: why (kept for a dead-letter record; issue 14); trailing, defaulted


class AckResp(msgspec.Struct, array_like=True):
    statuses: list[int]


class ReplayReq(msgspec.Struct, tag=True, array_like=True):
    topic: str
    topic_id: str
    partition: int
    offset: int


class ReplayResp(msgspec.Struct, array_like=True):
    status: int  # 200, 204, 410
    item: Item | None = None
    oldest: int = 0


class StatsReq(msgspec.Struct, tag=True, array_like=True):
    topic: str
    topic_id: str
    partitions: list[int]


class StatsResp(msgspec.Struct, array_like=True):
    stats: dict[int, dict[str, int]]


class FanoutLagReq(msgspec.Struct, tag=True, array_like=True):
    """Fan-out cursor positions of these parent partitions, as lag behind the parent's
    high watermark (the children listing). Scope NODE: the receiving worker asks
    this node's other owning workers too."""

    parent: str
    parent_id: str
    partitions: list[int]
    scope: int = WORKER


class FanoutLagResp(msgspec.Struct, array_like=True):
    lags: dict[str, dict[int, int]]  # child -> {parent partition: messages not yet copied}


class WatchNote(msgspec.Struct, tag=True, array_like=True):
    """Tell (`node`, `worker`) once when records of `topic` become available
    here. A delivery token: it reserves nothing; only the claim that follows
    (a ConsumeReq) does."""

    topic: str
    worker: int
    node: str = ""  # "" = the sender's node is this node
    relayed: bool = False  # already passed on to this node's other workers


class UnwatchNote(msgspec.Struct, tag=True, array_like=True):
    """Withdraw the token (`node`, `worker`) left by a WatchNote: the last consumer
    parked there for `topic` went away (its client hung up). With `pass_on`, that
    consumer had been woken as it went: tell the next watcher if records are ready."""

    topic: str
    worker: int
    node: str = ""
    pass_on: bool = False
    relayed: bool = False


class ReadyNote(msgspec.Struct, tag=True, array_like=True):
    topic: str
    count: int
    worker: int = -1  # the parked worker to wake (-1: whoever receives it)
    node: str = ""  # the node whose records are ready ("" = this node)
    src: int = -1  # the worker whose token fired (-1: not said; a trailing field older peers ignore)


# ---- partition moves (issue 13): the destination asks the source's owner worker ----
SegTuple = tuple[int, int, int]  # segment base offset, bytes to copy, mtime (unix ms) at the source


class MoveListReq(msgspec.Struct, tag=True, array_like=True):
    """The source's segments of a partition, the active one only up to its high watermark."""

    topic: str
    topic_id: str
    partition: int


class MoveListResp(msgspec.Struct, array_like=True):
    hwm: int
    segments: list[SegTuple]
    now_ms: int  # the source's clock when it listed (segment ages travel relative to it)
    frozen: bool = False
    # The positions as of this listing (read before it): what a force-promote installs
    # (clamped) when the source never answers again.
    frontier: int = -1
    ahead: list[int] = []
    cursors: list[tuple[str, str, int]] = []
    counts: list[tuple[int, int]] = []  # delivery counts (offset, deliveries) of unacked offsets; trailing
    reasons: list[tuple[int, str]] = []  # last nack reasons (offset, reason) of unacked offsets; trailing
    dead: list[int] = []  # offsets held for the dead-letter topic: installed marked held, counts first; trailing
    # ``dead_letter.target``: the dead-letter topic (name, id) and the offsets sent there; trailing
    dlq_target: tuple[str, str] | None = None
    dlq_sent: list[int] = []


class MoveVouchReq(msgspec.Struct, tag=True, array_like=True):
    """A node holding an old copy of a partition asks its owner what the owner holds."""

    topic: str
    topic_id: str
    partition: int


class MoveVouchResp(msgspec.Struct, array_like=True):
    owns: bool  # this node owns the partition (its replica says so)
    hwm: int = -1  # the owner's high watermark now
    marker: dict[str, Any] = {}  # its move.marker ({} if none)


class MoveChunkReq(msgspec.Struct, tag=True, array_like=True):
    topic: str
    topic_id: str
    partition: int
    base: int
    offset: int
    length: int


class MoveChunkResp(msgspec.Struct, array_like=True):
    data: bytes


class MoveFreezeReq(msgspec.Struct, tag=True, array_like=True):
    """Freeze the source (token ""), re-arm a live freeze (token, renew_only), or
    fence (token, not renew_only: 409 ``freeze_lapsed`` if that freeze lapsed,
    else renewed and the transfer positions read again)."""

    topic: str
    topic_id: str
    partition: int
    token: str = ""
    renew_only: bool = False
    ttl_ms: int = 30_000


class MoveFreezeResp(msgspec.Struct, array_like=True):
    token: str
    hwm: int = -1
    frontier: int = -1
    ahead: list[int] = []
    cursors: list[tuple[str, str, int]] = []  # fan-out cursors: child, attach epoch, next offset
    segments: list[SegTuple] = []
    now_ms: int = 0
    counts: list[tuple[int, int]] = []  # delivery counts (offset, deliveries) of unacked offsets; trailing
    reasons: list[tuple[int, str]] = []  # last nack reasons (offset, reason) of unacked offsets; trailing
    dead: list[int] = []  # offsets held for the dead-letter topic: installed marked held, counts first; trailing
    # ``dead_letter.target``: the dead-letter topic (name, id) and the offsets sent there; trailing
    dlq_target: tuple[str, str] | None = None
    dlq_sent: list[int] = []


class MoveClaimsReq(msgspec.Struct, tag=True, array_like=True):
    """Under a live freeze (its token): the idempotency keys committed on the source node
    whose home is the partition (``ClaimTable.collect``: records the source committed
    into other partitions of its own, topic.idempotent_local_placement), once no claim
    homed there is pending. The destination keeps them with its copy."""

    topic: str
    topic_id: str
    partition: int
    token: str


class MoveClaimsResp(msgspec.Struct, array_like=True):
    window_ms: int
    keys: list[tuple[int, int, int]] = []  # (fingerprint, CRC-32C, committed-at ms)


class MoveThawReq(msgspec.Struct, tag=True, array_like=True):
    """An abandoned move: lift its freeze now (instead of at its TTL)."""

    topic: str
    topic_id: str
    partition: int
    token: str


class MoveStatusReq(msgspec.Struct, tag=True, array_like=True):
    """One worker's move runners and quarantined copies (for NodeStatusView)."""


class MoveStatusResp(msgspec.Struct, array_like=True):
    moves: list[MoveWorkerView] = []
    quarantine: list[QuarantinedCopy] = []


class Remote(Protocol):
    """Other nodes, as the broker sees them (implemented by narad.cluster)."""

    node_id: str

    def owner_node(self, topic: Any, partition: int) -> str | None:
        """The node owning the partition (assignments), None when unassigned."""
        ...

    def moving(self, topic: Any, partition: int) -> bool:
        """Whether the partition has a move target (a move may be under way)."""
        ...

    def node_alive(self, node_id: str) -> bool: ...

    async def call(self, node_id: str, msg: Any, resp_type: type[T], timeout: float) -> T: ...

    def notify(self, node_id: str, msg: Any) -> None: ...


class SingleNode:
    """The Remote of a node without peers: every partition is ours."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id

    def owner_node(self, topic: Any, partition: int) -> str | None:
        return self.node_id

    def moving(self, topic: Any, partition: int) -> bool:
        return False

    def node_alive(self, node_id: str) -> bool:
        return node_id == self.node_id

    async def call(self, node_id: str, msg: Any, resp_type: type[T], timeout: float) -> T:
        raise Unavailable(f"node {node_id} is not part of this cluster")

    def notify(self, node_id: str, msg: Any) -> None:
        pass


class PeerLinks:
    def __init__(self, runtime_dir: Path, index: int, workers: int) -> None:
        self.runtime_dir = Path(runtime_dir)
        self.index = index
        self.workers = workers
        self.service: rpc.Service = rpc.Service()
        self._conns: dict[int, rpc.Connection] = {}
        self._connecting: dict[int, asyncio.Future[rpc.Connection]] = {}
        self._server: asyncio.AbstractServer | None = None
        self._hops: dict[type, Any] = {}  # message type -> its narad_worker_hops_total child

    def path(self, i: int) -> Path:
        return self.runtime_dir / f"w{i}.sock"

    async def serve(self) -> None:
        self._server = await rpc.serve_unix(str(self.path(self.index)), lambda: self.service)

    async def conn(self, i: int, timeout: float = 2.0) -> rpc.Connection:
        c = self._conns.get(i)
        if c is not None and not c.closed:
            return c
        pending = self._connecting.get(i)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[rpc.Connection] = asyncio.get_running_loop().create_future()
        self._connecting[i] = fut
        try:
            end = time.monotonic() + timeout
            delay = 0.01
            while True:
                try:
                    c = await rpc.connect_unix(str(self.path(i)), self.service)
                    break
                except (FileNotFoundError, ConnectionRefusedError, OSError) as e:
                    if time.monotonic() + delay > end:
                        raise Unavailable(f"worker {i} is not reachable: {e}") from None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.2)
            self._conns[i] = c
            fut.set_result(c)
            return c
        except BaseException as e:
            if not fut.done():
                fut.set_exception(e if isinstance(e, Exception) else Unavailable("cancelled"))
                fut.exception()
            raise
        finally:
            self._connecting.pop(i, None)

    def connected(self, i: int) -> bool:
        """A link to worker `i` is open now (a call would not have to dial)."""
        c = self._conns.get(i)
        return c is not None and not c.closed

    async def call(self, i: int, msg: Any, resp_type: type[T], timeout: float = 5.0) -> T:
        self._count(msg)
        c = await self.conn(i)
        return await c.call(msg, resp_type, timeout)

    def _count(self, msg: Any) -> None:
        kind = type(msg)
        m = self._hops.get(kind)
        if m is None:
            m = self._hops[kind] = metrics.get().worker_hops.labels(kind.__name__)
        m.inc()

    def notify(self, i: int, msg: Any) -> None:
        self._count(msg)
        c = self._conns.get(i)
        if c is not None and not c.closed:
            c.notify(msg)
            return

        async def later() -> None:
            with contextlib.suppress(Exception):
                (await self.conn(i)).notify(msg)

        asyncio.get_running_loop().create_task(later())

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in self._conns.values():
            c.close()
