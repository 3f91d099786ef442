"""The worker's broker: produce, commit, consume, ack, replay, stats.

One per worker process, on its event loop. It owns:

* this worker's ingress WAL and dispatcher (every produce landing here is
  made durable here, then committed at its partition's owner);
* the partitions this worker owns (``routing.owner_worker``), opened lazily,
  each with its log, lease table and offset file, and served to other
  workers over ``peers`` (one local hop);
* the consume waiters parked on this worker (local data wakes them at once;
  other workers wake them through watch / ready notes, and a parked consumer
  re-checks every second regardless). A consume whose client hung up is
  cancelled (narad.api.hangup): at any await it gives back what it reserved
  (here, at another worker, at another node; a probe still in flight is nacked
  when it answers), leaves the park, passes on a wake it had just received,
  and, when it was this worker's last consume of the topic, withdraws its
  watch tokens at the owners (UnwatchNote);
* the offset committer (page cache every 100 ms, fdatasync every
  ``consumer_offset_commit_interval``), the lease-expiry sweep (1 s) and the
  housekeeping loop: idle partitions closed (``storage.idle_log_eviction_ms``;
  at most ``max_open`` logs open, least recently used idle ones closed first;
  a close waits for a commit in flight and never touches a partition holding
  leases or unsynced acks; a reopen waits for the close), retention of open
  logs (60 s) and the cold retention walk over the partition directories this
  worker owns on disk (``storage.cold_retention_walk_ms``); stats of a closed
  partition are read from its files without opening it;
* topic-change handling: when a topic is deleted or recreated, its partitions
  close, parked consumers are answered, and the data is removed once the
  supervisor confirms the incarnation is gone;
* the fan-out engine (``narad.broker.fanout``) for the parent partitions this
  worker owns: a commit wakes their cursors (``_on_visible``), copies go out
  through ``commit_to`` (here, one hop, or node RPC; no WAL: the records are
  durable in the parent's log), and ``fanout_lag`` gathers every owner's
  cursor positions for the children listing (``FanoutLagReq``);
* delivery counts and dead-lettering (issue 14): the partitions' counts are
  written with their acks by the offset committer (which records in
  ``Partition.written_gen`` what reached the file); the dead-letter driver
  (``narad.broker.deadletter``) moves records past their topic's
  ``max_deliveries`` to its dead-letter topic through ``commit_to``, then settles
  them; a topic change hands the partitions their ``max_deliveries``; leases a
  consumer never saw are given back uncounted (``GIVE_BACK``);
* the metrics of its partitions: per commit the owner adds to the partition's
  counters (messages, payload bytes, fsync time), per delivered record the
  answering worker adds to (topic, partition)'s consumed counters (a dict
  lookup and an add each); the partition gauges (lag, oldest unacked age,
  in-flight, acked-ahead, size, segments) are set by a poller every 5 s
  (sooner after a topic change) from memory for open partitions and from
  their files, at most every 30 s, for closed ones; it also creates every
  series of an owned partition at zero and drops those of deleted topics;
* idempotent produce (issue 14): a produce with idempotency keys watches its
  keyed entries (``produce(watch=)``, ``verdicts``) until their owners' commits
  answer which were repeats (``Partition.commit`` -> (first offset, duplicate
  indexes), over the hop as ``CommitResp.dups``); the owner's key table is
  rebuilt from the log at open (``narad.broker.idem``) and the 5 s poller
  expires keys and keeps the worker's bound over its tables.

Imports narad.storage, narad.meta (read side), narad.broker.*, narad.errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import operator
import os
import resource
import shutil
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from narad import metrics
from narad.broker import deadletter as DL
from narad.broker import idem as IDEM
from narad.broker import peers as P
from narad.broker.deadletter import DeadLetterDriver
from narad.broker.dispatcher import Dispatcher, Rehome, Watch
from narad.broker.fanout import FanoutEngine, FanoutSettings
from narad.broker.idem_claims import ClaimTable, topic_tag
from narad.broker.moves import MoveRunner, MoveSource
from narad.broker.partition import (
    MAX_REASON_CHARS,
    NO_KEYS,
    Committed,
    Partition,
    finish_stats,
    rfc3339_ms,
    stats_from_disk,
)
from narad.broker.routing import RoundRobin, key_partition, owner_worker
from narad.errors import (
    BadGateway,
    BadRequest,
    Conflict,
    GatewayTimeout,
    NaradError,
    NotFound,
    Unavailable,
    error_for_status,
)
from narad.ipc.rpc import Connection, ConnectionLost
from narad.meta import versions as V
from narad.meta.records import TopicRecord
from narad.meta.requests import ConfirmEpochReq, ConfirmEpochResp, QuarantinedCopy
from narad.meta.store import MetaStore
from narad.storage import frames as FR
from narad.storage import iothreads
from narad.storage import partition_log as PL
from narad.storage import transfer as TR
from narad.storage.commit_rounds import CommitRounds
from narad.storage.frames import F_EXT
from narad.storage.offsets import OffsetFile
from narad.storage.partition_log import OffsetGone, PartitionLog
from narad.storage.wal import Entry, IngressWAL

_PLACED = operator.attrgetter("placed")  # (``Entry.placed``, read in C over a batch)
CLAIMS_INDEX_MASK = 0x1FF  # the worker index + 1 in a claimer tag (``Broker.claims_tag``)
log = logging.getLogger("narad.broker")
TRUST_POLL = 0.05  # how often a starting worker looks for the node's first readiness

COMMIT_TICK = 0.1
SWEEP_EVERY = 1.0
# Test seam: every Nth direct commit fails before writing anything (its records take the WAL).
FAIL_DIRECT_EVERY = int(os.environ.get("NARAD_FAULT_DIRECT_COMMIT_FAIL_EVERY", "0") or 0)
# Test seam: the dispatcher's commits of WAL records start this many ms late (records stay on their way).
DISPATCH_DELAY_S = int(os.environ.get("NARAD_FAULT_DISPATCH_DELAY_MS", "0") or 0) / 1000
# Test seam: the idempotent placement does not see move targets (as a worker whose replica
# has not shown a move yet): a key homed at a moving partition is placed elsewhere here.
STALE_MOVES = os.environ.get("NARAD_FAULT_PLACEMENT_IGNORES_MOVES", "") == "1"
# Test seam: while this file exists, the dispatcher's commits of WAL records wait (polled every 50 ms).
DISPATCH_HOLD_FILE = os.environ.get("NARAD_FAULT_DISPATCH_HOLD_FILE", "")
# Test seam: "<task>:<n>" makes the worker's background loop <task> (``V.TASKS``) fail n times.
_FAULT_TASK = os.environ.get("NARAD_FAULT_TASK_FAIL", "")
TASK_PAUSE_MAX = 8.0  # a failing background loop starts again after 1 s, doubling up to this (< V.FAULT_HOLD)
# A direct commit at another worker of this node not answered by then is given up: the WAL takes it.
DIRECT_HOP_TIMEOUT = 5.0
# A deleted incarnation's data whose removal was not confirmed at its retire (this
# node's replica not caught up, the leader not reachable in time) is asked again
# after these pauses, not only at the next cold walk (minutes).
GONE_RETRY_S = (1.0, 2.0, 4.0, 8.0, 16.0)
# A keyed direct commit waits this long at most for its key's records still in the WAL, then joins them.
ORDER_WAIT_S = 1.0
REAP_EVERY = 60.0
EVICT_EVERY = 1.0  # idle logs are looked for this often (a quarter of a shorter idle setting)
CLOSE_BATCH = 16  # partition closes run this many at a time
DRAINED_LIMIT = 1 << 17  # closed-and-drained partitions remembered (a cache of "no need to open")
TOPIC_CHECK_EVERY = 0.05
LEVEL_EVERY = 30.0
# A parked long poll looks again this often even if nothing woke it (test seam: a test that must
# tell a wake from this re-check sets it long, NARAD_FAULT_PARK_RECHECK_MS).
PARK_RECHECK = int(os.environ.get("NARAD_FAULT_PARK_RECHECK_MS", "1000") or 1000) / 1000
PROBE_MAX = 1000  # records one coalesced consume probe asks another worker for
ACK_MAX = 1000  # receipt handles one coalesced AckReq carries
WATCH_TTL = 1.0  # a node holding our watch token is asked again after this even without a ReadyNote
# A consume that found records in this worker's own partitions asks another worker of the node
# for more at most this often per topic (the hop costs more than the records it adds; the
# other worker's own consumers take them, and this bounds how long they wait when it has none).
PEER_SHARE = 0.05
NODE_SHARE = 0.2  # the same for another node's records (a node RPC costs more than a local hop)
STATS_TOPIC_WAIT = 1.6  # a stats request for an incarnation not applied here yet waits this long (callers: 2 s)
# partition gauges refreshed this often (test seam: NARAD_METRICS_POLL_MS, never set in production)
POLL_EVERY = float(os.environ.get("NARAD_METRICS_POLL_MS", "5000")) / 1000.0
POLL_MIN_GAP = min(1.0, POLL_EVERY)  # a topic change brings the next pass forward, never closer than this to the last
COLD_POLL_EVERY = 30.0  # a closed partition's gauges are read from its files at most this often
ACK, EXTEND, NACK = 0, 1, 2
# A lease given back because its consumer never saw it (hung up, the answer was dropped, a
# late probe, a redrive's skipped record): a nack that takes back the delivery it counted.
# A node without it reads any mode but 0 and 1 as a nack: the safe failure is a count one too high.
GIVE_BACK = 3


class Gone(Exception):
    pass


def _chain(proxy: asyncio.Future[Any], f: asyncio.Future[Any]) -> None:
    """Hand `f`'s outcome to `proxy`."""
    if proxy.done():
        return
    if f.cancelled():
        proxy.cancel()
    elif f.exception() is not None:
        proxy.set_exception(f.exception())  # type: ignore[arg-type]
    else:
        proxy.set_result(f.result())


def hop_unknown(exc: BaseException) -> bool:
    """A direct commit's failure after which its records may have been committed after
    all: a hop to another worker given up or cut off (or the waiter cancelled)."""
    return isinstance(exc, (GatewayTimeout, ConnectionLost, asyncio.CancelledError))


def _direct_failed(exc: BaseException, records: int) -> bool:
    """Log a failed direct commit of `records` records (they go through the WAL); a hop
    that may have committed them is also counted in ``direct_hop_unknown``. Returns
    ``hop_unknown(exc)``."""
    log.debug("direct commit failed; through the WAL", extra={"records": records,
                                                               "err": f"{type(exc).__name__}: {exc}"})
    if not hop_unknown(exc):
        return False
    log.warning("direct commit at another worker given up; its records go through the WAL "
                "(they may be stored twice)", extra={"records": records, "err": str(exc)})
    metrics.get().errors.labels("broker", "direct_hop_unknown").inc()
    return True


DirectGroup = tuple[list[int], list[tuple[bytes | None, int, bytes]], list[str | None] | None]
"""One partition's share of a produce for ``Broker.direct``: the indexes of its entries
(batch order), their (key, flags, payload) records, and their idempotency keys as their
blocks hold them (None: none; the list None: read them from the blocks)."""


class DirectBatch:
    """A produce's direct commits (``Broker.direct``): its records grouped by partition,
    each group committed straight into its partition on this node (here, or at another
    worker one hop away) without the ingress WAL. ``done`` resolves (never fails) when
    every group is answered; then ``failed`` (batch order) are the entries whose commit
    failed, which the caller hands to the WAL, and ``unknown`` those of them a hop may
    have committed after all (given up, or its link lost: their duplicate verdict is not
    known). ``rest`` (batch order) are the entries no direct commit could take: the WAL's
    from the start. ``dup[i]``: entry i was dropped by its commit as a repeat of an
    idempotency key."""

    __slots__ = ("done", "dup", "failed", "left", "rest", "unknown")

    def __init__(self, done: asyncio.Future[None], n: int) -> None:
        self.done = done
        self.dup: list[bool] = [False] * n
        self.rest: list[int] = []
        self.failed: list[int] = []
        self.unknown: set[int] = set()
        self.left = 0


class _Placement:
    """The partitions of a topic this worker owns, and which workers of this node
    and which other nodes own any of them."""

    __slots__ = ("home_here", "locs", "mine", "mine_here", "mine_set", "nodes", "peers", "workers")

    def __init__(self, mine: list[int], workers: list[int], nodes: list[str], index: int,
                 locs: tuple[tuple[str | None, int], ...], home_here: tuple[bool, ...]) -> None:
        self.locs = locs  # partition -> ``Broker.where``'s (owner node, worker)
        # partition -> owned by this node and not moving: a key homed there may be committed
        # in any partition of this worker (topic.idempotent_local_placement), one of these:
        self.home_here = home_here
        self.mine_here = [i for i in mine if home_here[i]]
        self.mine = mine
        self.mine_set = frozenset(mine)
        self.workers = workers
        self.peers = [w for w in workers if w != index]  # the other workers of this node owning some
        self.nodes = nodes


def hop_ikeys_ok(m: P.CommitReq, conn: object) -> bool:
    """Whether a ``CommitReq``'s idempotency keys may stand in for its records' blocks:
    it came over a link from a worker of this node (the same build, whose producer packed
    those keys into those blocks; never from another node) and gives one key a record."""
    return isinstance(conn, Connection) and m.ikeys is not None and len(m.ikeys) == len(m.records)


def hop_bodies_alone(m: P.CommitReq) -> bool:
    """Whether a ``CommitReq`` holds a record sent as its body alone, its idempotency key
    in ``ikeys`` and no extension block (the one-pass idempotent batch's: the commit
    writes the block, ``FR.lay_keyed``). Such records need their keys: a hop whose keys
    may not stand in for blocks (``hop_ikeys_ok``) is refused, never committed keyless."""
    ik = m.ikeys
    return ik is not None and any(k is not None and not r[1] & F_EXT
                                  for r, k in zip(m.records, ik, strict=False))


def topic_dir(data_dir: Path, name: str, topic_id: str) -> Path:
    # One directory per incarnation: a recreated topic can never see old data.
    return data_dir / "topics" / f"{name}@{topic_id}"


class Broker:
    def __init__(
        self,
        *,
        data_dir: Path,
        store: MetaStore,
        versions: V.VersionTable,
        index: int,
        workers: int,
        links: P.PeerLinks,
        confirm_gone: Callable[[str, str], Awaitable[bool]],
        offset_sync_interval: float = 1.0,
        remote: P.Remote | None = None,
        node_id: str = "local",
        idle_eviction_ms: int = 1_800_000,
        cold_walk_ms: int = 300_000,
        caught_up: Callable[[], Awaitable[bool]] | None = None,
        confirm_epoch: Callable[[ConfirmEpochReq], Awaitable[ConfirmEpochResp]] | None = None,
        fanout: FanoutSettings | None = None,
        meta_call: Callable[[Any, Any, float], Awaitable[Any]] | None = None,
        group_sync: bool = True,
        security: bool = True,
        delivery_counts: bool = True,
        claims: ClaimTable | None = None,
        idem_local: bool = True,
    ) -> None:
        self.data_dir = Path(data_dir)
        # The node's idempotency claims table (``narad.broker.idem_claims``; the supervisor's,
        # a private one without it), where every keyed commit checks its keys.
        self.claims = claims if claims is not None else ClaimTable.private()
        # This worker's claimer tag: its pid and its index + 1 (CLAIMS_INDEX_MASK), so the claims a
        # killed predecessor at this index left pending are found and released at ``start``.
        self.claims_tag = ((os.getpid() & 0x3FFFFF) << 9) | (index + 1)
        self._windows: dict[int, int] = {}  # topic tag -> the window last applied to its keys
        # (topic id, partition) whose keys ``_load_claims`` read at start: not read again at open
        # (the table keeps them; a move's install forgets the entry: its copy is read at open).
        self._claims_loaded: set[tuple[str, int]] = set()
        # topic.idempotent_local_placement: a keyless idempotent record whose key's partition is
        # on this node is committed into one of this worker's partitions (``idem_rule``).
        self.idem_local = idem_local
        # Records leased are counted and consume answers carry delivery_count (False: only on a
        # topic with max_deliveries, which needs the counts to dead-letter; ``Partition.counting``).
        self.delivery_counts = delivery_counts
        self.security = security  # grants are enforced (the dead-letter driver's owner check)
        self.store = store
        self.versions = versions
        self._routes_trusted = False  # routes_trusted(): latched at the node's first readiness
        self._untrusted_since: float | None = None
        self.index = index
        self.workers = workers
        self.links = links
        self.remote: P.Remote = remote or P.SingleNode(node_id)
        self.node_id = self.remote.node_id
        self.confirm_gone = confirm_gone
        self.offset_sync_interval = offset_sync_interval
        self.idle_eviction_s = idle_eviction_ms / 1000.0  # 0: never
        self.cold_walk_s = cold_walk_ms / 1000.0  # 0: never
        self.max_open = max_open_logs()
        self._closing: dict[tuple[str, int], asyncio.Future[None]] = {}  # closes still writing files
        # Partitions closed with nothing deliverable (topic, index, incarnation): a
        # consume skips them without opening them. Whatever can make one
        # deliverable again (a commit, a cold-walk sweep) opens it first, and the
        # open forgets it; a restart starts with none (they open once, then close).
        self._drained: set[tuple[str, int, str]] = set()
        self._cap_warned = 0.0
        self.io = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"io-w{index}",
                                     initializer=iothreads.batch_class)
        # Partition commits (write, sync, read-back) run in rounds on a thread of their own:
        # the commits ready together share one sync and one hand-off back to the loop.
        self.commit_rounds = CommitRounds(f"commit-w{index}", self.data_dir, group_sync=group_sync)
        self.wal = IngressWAL(self.data_dir / "ingress" / f"w{index}", self.io)
        self.dispatcher = Dispatcher(self.wal, self)
        self.partitions: dict[tuple[str, int], Partition] = {}
        self._opening: dict[tuple[str, int], asyncio.Future[Partition]] = {}
        self._waiters: dict[str, deque[asyncio.Future[bool]]] = {}
        # topic -> {(node, worker): None}, oldest first: delivery tokens left by parked consumers
        self._watchers: dict[str, dict[tuple[str, int], None]] = {}
        self._rr = RoundRobin()
        self._crr = RoundRobin()  # where a consume starts among this worker's partitions
        self._sticky: dict[str, tuple[int, int]] = {}  # topic -> (WAL group epoch, keyless partition)
        self._group_epoch = 0
        self.direct_in_flight = 0  # records of direct commits not yet answered (the WAL-pending gauge adds them)
        self._direct_tries = 0
        # Per-destination order (``_order_clear``): (topic, incarnation, partition) -> the last WAL seq
        # staged for it; ``_fed_seq``: the last seq handed to the dispatcher (groups go in seq order).
        self._staged_last: dict[tuple[str, bytes, int], int] = {}
        self._fed_seq = -1
        self._order_waits: dict[tuple[str, bytes, int], deque[Callable[[bool], None]]] = {}  # _order_wait
        # Direct commits for another worker queued in this loop pass (``_hop_commit``): one hop each pass.
        self._hops: dict[int, list[tuple[P.CommitReq, asyncio.Future[Committed]]]] = {}
        self._hop_tasks: set[asyncio.Task[None]] = set()
        self._gone_retries: dict[tuple[str, str], asyncio.Task[None]] = {}  # (topic, id) -> its removal retry
        self._route_cache: dict[tuple[str, int], int] = {}
        self._owned_cache: dict[Any, _Placement] = {}
        self._name_slots: dict[str, int] = {}  # topic name -> its slot in the version array
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set in start()
        self._tasks: list[asyncio.Task[None]] = []
        self._late: set[asyncio.Task[Any]] = set()  # consume probes answered after we stopped waiting
        self._armed: dict[tuple[str, str], float] = {}  # (topic, node) -> when our watch token was left there
        self._armed_w: dict[tuple[str, int], float] = {}  # (topic, worker of this node): the same, for workers
        self._peer_asked: dict[tuple[str, int], float] = {}  # (topic, worker): when a consume here last probed it
        self._node_asked: dict[tuple[str, str], float] = {}  # (topic, node): the same, for nodes
        self._probes: dict[tuple[int, str, str, int], list[Any]] = {}  # (worker, topic, id, vis_ms) -> [want, waiters]
        # (worker, topic, id, mode, dur_ms, nack reason) -> [items, waiters]
        self._acks: dict[tuple[int, str, str, int, int, str], list[Any]] = {}
        self._polling: dict[str, int] = {}  # topic -> consumes of it running on this worker
        self._topics_ver = -1
        self._synced: dict[tuple[str, int], float] = {}
        self._leveled: dict[tuple[str, int], float] = {}
        self.closing = False
        # metrics: (topic, partition) -> consumed children; (topic, outcome) -> wait child;
        # closed partitions' gauge rows: key -> (incarnation, when read, row)
        self._m_cons: dict[tuple[str, int], tuple[Any, Any]] = {}
        self._m_wait: dict[tuple[str, str], Any] = {}
        self._cold_rows: dict[tuple[str, int], tuple[str, float, _Row]] = {}
        self._poll_soon = asyncio.Event()
        self._wal_failed_counted = False
        self.m = metrics.get()
        reg = metrics.registry()
        self.m_open_logs = _metric(reg, metrics.Gauge, "narad_open_partition_logs", "partition logs open")
        self.m_evicted = _metric(reg, metrics.Counter, "narad_idle_logs_evicted_total",
                                 "partition logs closed because they were idle (or least recently used at the cap)")
        self.m_cold_swept = _metric(reg, metrics.Counter, "narad_cold_retention_swept_total",
                                    "closed partitions the cold retention walk opened to delete expired segments")
        self.m_rounds = _metric(reg, metrics.Counter, "narad_storage_commit_rounds_total",
                                "partition commit rounds (one sync each: fdatasync for one log, syncfs for several)")
        self.m_round_logs = _metric(reg, metrics.Counter, "narad_storage_commit_round_logs_total",
                                    "partition commits those rounds carried (per round: the logs one sync covered)")
        self._rounds_seen = (0, 0)
        self._rehomed_seen = 0  # (the dispatcher's rehomed count the metric has)
        self.m_direct = _metric(reg, metrics.Counter, "narad_produced_direct_messages_total",
                                "messages committed straight into their partition on this node (owned by this worker, "
                                "or by another one a hop away), without the ingress WAL (the rest go through it)")
        # Fan-out cursors for the parent partitions this worker owns (off without the
        # supervisor's caught-up and confirm-epoch answers: nothing would start safely).
        self.fanout = FanoutEngine(self, fanout or FanoutSettings(), caught_up, confirm_epoch)
        # Partition moves: this worker as a source (freeze, lists, chunks) and as a
        # destination (the runner; off on a lone node and without a supervisor).
        self.caught_up = caught_up
        self.move_source = MoveSource(self)
        self.mover = MoveRunner(self, meta_call)
        self.deadletters = DeadLetterDriver(self)  # records past max_deliveries, to their dead-letter topic
        self._assign_ver = -1
        self._watch_pause = 0.0  # the topic watch's pause after a pass an item of which failed
        self._register_peer_handlers()

    # ---- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self._load_claims()
        await self.loop.run_in_executor(self.io, self.wal.open)
        self.wal.on_durable = self._durable
        self.dispatcher.on_drained = self._on_drained
        replayed = 0
        batch: list[Entry] = []
        for e in self.wal.replay():
            batch.append(e)
            if len(batch) >= 4096:
                self.dispatcher.feed(batch)
                replayed += len(batch)
                batch = []
        if batch:
            self.dispatcher.feed(batch)
            replayed += len(batch)
        if replayed:
            log.info("ingress WAL replayed for dispatch", extra={"records": replayed, "worker": self.index})
        self._topics_ver = self.versions.load(V.TOPICS)
        loop = self.loop
        for name, fn in (("trust watch", self._trust_watch), ("committer", self._committer),
                         ("sweeper", self._sweeper), ("reaper", self._reaper), ("topic watch", self._topic_watch),
                         ("metrics poller", self._metrics_poller)):
            self._tasks.append(loop.create_task(self._kept(name, fn)))
        self.fanout.start()
        self.mover.start()
        self.deadletters.start()

    async def _kept(self, name: str, fn: Callable[[], Awaitable[None]]) -> None:
        """Run the background loop `fn` for the worker's life. An exception it lets out
        (a bug: each loop handles the failures it expects) is logged, counted and named
        by /readyz (``task_failed``), and the loop starts again after a pause (1 s,
        doubling up to ``TASK_PAUSE_MAX`` while it keeps failing)."""
        pause = 1.0
        inject = 0
        if _FAULT_TASK.partition(":")[0] == name:
            inject = int(_FAULT_TASK.partition(":")[2] or 1)
        while True:
            started = time.monotonic()
            try:
                if inject > 0:
                    inject -= 1
                    raise RuntimeError("injected failure (test seam NARAD_FAULT_TASK_FAIL)")
                await fn()
                return
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if me is None or me.cancelling():
                    raise  # this loop was cancelled (the worker closes)
                # a future the loop awaited was cancelled by someone else: a failure like any other
                log.exception("background task failed; it starts again after a pause",
                              extra={"task": name, "worker": self.index, "pause_s": pause})
                self.task_failed(name)
            except Exception:
                log.exception("background task failed; it starts again after a pause",
                              extra={"task": name, "worker": self.index, "pause_s": pause})
                self.task_failed(name)
            if time.monotonic() - started > 60:
                pause = 1.0  # it ran a good while: a new failure, not the same loop failing again
            await asyncio.sleep(pause)
            pause = min(pause * 2, TASK_PAUSE_MAX)

    def task_failed(self, task: str) -> None:
        """A background loop of this worker failed (the caller logged why): counted
        (``narad_worker_task_failures_total``) and stamped in this worker's fault slot,
        which /readyz reads (``V.failing``)."""
        self.m.task_failures.labels(task).inc()
        with contextlib.suppress(Exception):  # (a worker without the heartbeat segment: tests)
            self.versions.hb.store(V.fault_slot(self.index), V.fault_value(task))

    async def close(self) -> None:
        """Graceful: stop dispatching, persist every partition's offsets and hwm."""
        self.closing = True
        await self.mover.stop()  # its staging copies stay and resume at the next start
        await self.fanout.stop()  # cursors first: their files stay where the last committed slab left them
        await self.deadletters.stop()  # what it holds stays unsettled: dead-lettered again after the restart
        for t in [*self._tasks, *self._late, *self._gone_retries.values()]:
            t.cancel()
        await self.dispatcher.close()
        for q in self._waiters.values():
            for f in q:
                if not f.done():
                    f.set_result(False)
        for key, p in list(self.partitions.items()):
            await self._close_partition(key, p, clean=True)
        await self.wal.drain()
        self.wal.close()
        self.commit_rounds.stop()
        self.io.shutdown(wait=True)

    # ---- routing -------------------------------------------------------------------------
    def route(self, topic: str, partition: int) -> int:
        key = (topic, partition)
        w = self._route_cache.get(key)
        if w is None:
            if len(self._route_cache) > 100_000:
                self._route_cache.clear()
            w = self._route_cache[key] = owner_worker(topic, partition, self.workers)
        return w

    def where(self, t: TopicRecord, partition: int) -> tuple[str | None, int]:
        """(owner node, owner worker on this node or -1). Node None: unassigned."""
        node = self.remote.owner_node(t, partition)
        if node == self.node_id:
            return node, self.route(t.name, partition)
        return node, -1

    def _placement(self, t: TopicRecord) -> _Placement:
        """Where the partitions of `t` live, seen from this worker (cached per topic
        record and assignments: the topic's name slot moves with both)."""
        slot = self._name_slots.get(t.name)
        if slot is None:
            if len(self._name_slots) > 100_000:
                self._name_slots.clear()
            slot = self._name_slots[t.name] = V.name_slot(t.name)
        key = (t.name, t.partitions, t.id, self.versions.load(slot))
        pl = self._owned_cache.get(key)
        if pl is None:
            if len(self._owned_cache) > 10_000:
                self._owned_cache.clear()
            mine: list[int] = []
            workers: set[int] = set()
            nodes: set[str] = set()
            locs: list[tuple[str | None, int]] = []
            for i in range(t.partitions):
                node, w = loc = self.where(t, i)
                locs.append(loc)
                if node == self.node_id:
                    workers.add(w)
                    if w == self.index:
                        mine.append(i)
                elif node is not None:
                    nodes.add(node)
            here = tuple(loc[0] == self.node_id and (STALE_MOVES or not self.remote.moving(t, i))
                         for i, loc in enumerate(locs))
            pl = self._owned_cache[key] = _Placement(mine, sorted(workers), sorted(nodes), self.index, tuple(locs),
                                                     here)
        return pl

    def owned(self, t: TopicRecord) -> list[int]:
        """The partitions of `t` this worker owns: assigned to this node and
        mapped to this worker."""
        return self._placement(t).mine

    def owners(self, t: TopicRecord, partition: int | None = None) -> tuple[list[int], list[str]]:
        """(workers of this node, other nodes) owning partitions of `t`."""
        if partition is None:
            pl = self._placement(t)
            return pl.workers, pl.nodes
        node, w = self.where(t, partition)
        if node == self.node_id:
            return [w], []
        return [], ([node] if node is not None else [])

    def idem_rule(self, t: TopicRecord) -> tuple[tuple[bool, ...], int] | None:
        """With topic.idempotent_local_placement, when this worker owns partitions of `t`:
        for every partition whether a key homed there (hashing to it) may be committed
        anywhere on this node (it is this node's and has no move target), and the
        partition of this worker such a keyless idempotent record goes to (the next of this
        worker's partitions, a call at a time); None otherwise (each such record goes to its key's partition).
        Its key is checked in the node's claims table wherever on the node it is committed.
        A key whose partition is another node's, or is moving, goes to that partition: a
        move's copy of it then carries the key, and the keys committed elsewhere here
        before the move are carried by the move (``MoveClaimsReq``)."""
        if not self.idem_local:
            return None
        pl = self._placement(t)
        if not pl.mine_here:  # (not one that is moving: its copy would miss what lands meanwhile)
            return None
        # (a batch at a time over this worker's partitions: direct commits move no WAL group on)
        return pl.home_here, self._rr.pick_among(t.name, pl.mine_here)

    def choose_partition(self, topic: TopicRecord, key: bytes | None, idem: bytes | None = None) -> int:
        """A key hashes to its partition (order per key). A keyless message may go
        to any partition: it rotates over the partitions this worker owns, so it
        is committed here without a hop; over all of them when this worker owns none.
        The rotation moves on once per WAL group commit (sticky): the keyless records
        of one group go to one partition, one commit there, instead of a commit at
        every partition each carrying a record or two. A keyless record with an
        idempotency key (its UTF-8) hashes by that key (a retry lands on the same
        partition from any node, where the key is checked)."""
        if key:
            return key_partition(key, topic.partitions)
        if idem is not None:
            h = key_partition(idem, topic.partitions)
            rule = self.idem_rule(topic)
            if rule is not None and rule[0][h]:
                return rule[1]
            return h
        pl = self._placement(topic)
        st = self._sticky.get(topic.name)
        if st is not None and st[0] == self._group_epoch and st[1] < topic.partitions and (
                not pl.mine or st[1] in pl.mine_set):
            return st[1]
        p = self._rr.pick_among(topic.name, pl.mine) if pl.mine else self._rr.pick(topic.name, topic.partitions)
        if len(self._sticky) > 100_000:
            self._sticky.clear()
        self._sticky[topic.name] = (self._group_epoch, p)
        return p

    def _durable(self, entries: list[Entry]) -> None:
        """A WAL group became durable: to the dispatcher; keyless choices move on."""
        self._group_epoch += 1
        if entries:
            self._fed_seq = fed = entries[-1].seq
            if len(self._staged_last) > 4096:  # what was fed is the dispatcher's to tell
                self._staged_last = {k: v for k, v in self._staged_last.items() if v > fed}
        self.dispatcher.feed(entries)

    def _track_staged(self, entries: list[Entry]) -> None:
        """Note the WAL seqs just staged per destination (``_order_clear``)."""
        st = self._staged_last
        last: tuple[str, bytes, int] | None = None
        for e in entries:
            if last is None or e.partition != last[2] or e.topic != last[0] or e.incarnation != last[1]:
                last = (e.topic, e.incarnation, e.partition)
            st[last] = e.seq

    def stage(self, entries: list[Entry], watch: list[Entry] | None = None,
              timeout: float = 5.0) -> tuple[asyncio.Future[None], Watch | None]:
        """``produce`` without the coroutine: stages `entries` in the WAL and returns the
        future of their sync, and the dispatcher's Watch on ``watch`` (the caller
        ``unwatch``es it, ``verdicts`` does). Raises WALFailed if latched."""
        fut = self.wal.append(entries)
        self._track_staged(entries)
        w = self.dispatcher.watch(watch, timeout) if watch else None
        return fut, w

    def append_cb(self, entries: list[Entry], done: Callable[[OSError | None], None]) -> None:
        """The WAL's ``append_cb`` (the synchronous produce path), its seqs noted."""
        self.wal.append_cb(entries, done)
        self._track_staged(entries)

    # ---- produce ------------------------------------------------------------------------------
    async def produce(self, entries: list[Entry], watch: list[Entry] | None = None,
                      timeout: float = 5.0) -> Watch | None:
        """Durable in this worker's WAL (group commit) when this returns. If the
        caller is cancelled the staged records still become durable and are
        dispatched (cancelling the future only drops the answer). ``watch``
        (entries of ``entries``, those with an idempotency key): returns the
        dispatcher's Watch on their commit, given up `timeout` after staging
        (``verdicts`` waits for it and unwatches)."""
        fut, w = self.stage(entries, watch, timeout)
        try:
            await fut
        except BaseException:
            if w is not None:
                self.dispatcher.unwatch(w)
            raise
        return w

    def watch(self, entries: list[Entry], timeout: float = 5.0) -> Watch:
        """The dispatcher's Watch on these staged entries' commits, for a caller that
        answers from a callback (``w.done``) instead of ``verdicts``; it ``unwatch``es."""
        return self.dispatcher.watch(entries, timeout)

    def unwatch(self, w: Watch) -> None:
        self.dispatcher.unwatch(w)

    async def verdicts(self, w: Watch) -> list[bool | None]:
        """The owners' duplicate verdicts for a watch, waited for until its deadline
        (None: not known by then; the record is durable and is still checked at its
        commit). Unwatches."""
        try:
            if not w.done.done():
                await w.done
        finally:
            self.dispatcher.unwatch(w)
        return w.dup

    # ---- owned partitions ---------------------------------------------------------------------
    async def partition(self, topic: TopicRecord, index: int) -> Partition:
        key = (topic.name, index)
        p = self.partitions.get(key)
        if p is not None and p.topic_id == topic.id and not p.closed:
            p.last_used = time.monotonic()
            return p
        for _ in range(3):
            pending = self._opening.get(key)
            if pending is None or pending.done():
                break
            # The open runs in its own task: a caller that gives up (its request was
            # cancelled) never cancels it under the others waiting on it.
            p = await asyncio.shield(pending)
            if p.topic_id == topic.id and not p.closed:
                return p
        p = self.partitions.get(key)
        if p is not None and p.topic_id == topic.id and not p.closed:
            return p
        task = self.loop.create_task(self._open(key, p, topic, index))
        self._opening[key] = task
        task.add_done_callback(lambda t, key=key: self._opened(key, t))
        return await asyncio.shield(task)

    def _opened(self, key: tuple[str, int], task: asyncio.Task[Partition]) -> None:
        if self._opening.get(key) is task:
            del self._opening[key]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter got it

    async def _open(self, key: tuple[str, int], old: Partition | None, topic: TopicRecord, index: int) -> Partition:
        if old is not None:
            await self._retire(key, old)
        fence = self._closing.get(key)
        if fence is not None:
            await asyncio.shield(fence)  # its files are still being written by a close: never open under it
        await self._make_room(key)
        self._drained.discard((topic.name, index, topic.id))
        d = topic_dir(self.data_dir, topic.name, topic.id) / f"p{index:05d}"
        p = await self.loop.run_in_executor(self.io, self._open_sync, topic, index, d)
        # Sent to a dead-letter topic still there: held (their copy may be there), even when
        # lifted, and their move finished; other restored marks go when lifted.
        keep = DL.finish_keep(self.store, p)
        p.mark_sent(keep)
        p.follow_max(topic.max_deliveries if topic.dead_letter_topic else 0, keep)
        lbl = (topic.name, str(index))
        m = self.m
        p.meter(m.messages_produced.labels(*lbl), m.bytes_produced.labels(*lbl), m.fsync_seconds.labels(*lbl))
        p.meter_idem(m.idem_duplicates.labels(*lbl), m.idem_evicted.labels(*lbl))
        p.on_visible = self._on_visible
        p.on_released = self._on_released
        p.on_dead = self.deadletters.on_dead
        p.loop = self.loop
        self.partitions[key] = p
        return p

    async def _load_claims(self) -> None:
        """Start: the keys of every partition on this node's disk that this worker owns
        (``owner_worker``) and that may hold keyed records go into the node's claims table
        (``IDEM.rebuild``: the records committed within the topic's window); then the
        claims a predecessor at this index left pending (killed between a claim and its
        settle) are released, since what it made durable was just found and loaded, and
        this worker counts as loaded. Keyed commits anywhere on the node wait until every
        worker has (``ClaimTable.complete``): a key may be committed in any partition of
        the node (topic.idempotent_local_placement), so each must be known first."""
        t0 = time.monotonic()
        keys, parts, read = await self.loop.run_in_executor(self.io, self._load_claims_sync)
        released = self.claims.release_owner(CLAIMS_INDEX_MASK, self.index + 1)
        complete = self.claims.set_loaded(self.index)
        log.info("idempotency keys loaded into the node's claims table", extra={
            "keys": keys, "partitions": parts, "records_read": read, "pending_released": released,
            "node_complete": complete, "ms": round((time.monotonic() - t0) * 1000, 1)})

    def _load_claims_sync(self) -> tuple[int, int, int]:
        keys = parts = read = 0
        now_ms = int(time.time() * 1000)
        for dname in _list_dirs(self.data_dir / "topics"):
            name, _, tid = dname.rpartition("@")
            t = self.store.topic(name) if name else None
            if t is None or t.id != tid:
                continue  # (a topic deleted, or recreated since: its keys are not asked for)
            base = self.data_dir / "topics" / dname
            for pname in _list_dirs(base):
                # A partition, or one a move took away (renamed aside, kept): the keys of its
                # records are still this node's to know when their home stayed here.
                head = pname.split(".moved-", 1)[0]
                if not (head.startswith("p") and head[1:].isdigit()):
                    continue
                index = int(head[1:])
                d = base / pname
                if owner_worker(name, index, self.workers) != self.index:
                    continue
                if not IDEM.needs_rebuild(d):
                    if pname == head:
                        self._claims_loaded.add((tid, index))  # (no keyed record: none to read at open)
                    continue
                plog = PartitionLog(d)
                try:
                    plog.open()
                    k, n = IDEM.rebuild(plog, t.idem_window_ms, now_ms, self.claims, topic_tag(t.id), index,
                                        t.partitions)
                except Exception as e:  # (its keys may then be stored again: said in the log)
                    log.error("idempotency keys of a partition could not be read at start", extra={
                        "topic": name, "partition": index, "err": str(e)})
                    continue
                finally:
                    plog.close()
                if pname == head:
                    self._claims_loaded.add((tid, index))
                keys, parts, read = keys + k, parts + 1, read + n
        return keys, parts, read

    def follow_window(self, p: Partition, t: TopicRecord) -> None:
        """The topic's idempotency window (and partition count), as the replica has them
        now, for `p`'s claims.
        The claims judge a repeat by the window they are given; the keys already in the
        node's table keep their slots by the window they were stored with until a change
        is applied to them (``ClaimTable.rewindow``: once per topic and change at this
        worker, a scan of the table on an I/O thread)."""
        p.nparts = t.partitions
        window_ms = t.idem_window_ms
        if p.idem_window_ms == window_ms:
            return
        p.idem_window_ms = window_ms
        if self._windows.get(p.claims_topic) != window_ms:
            self._windows[p.claims_topic] = window_ms
            self.io.submit(self.claims.rewindow, p.claims_topic, window_ms)

    def _open_sync(self, topic: TopicRecord, index: int, d: Path) -> Partition:
        plog = PartitionLog(d)
        plog.open()
        offs = OffsetFile(d)
        frontier, ahead = offs.load(max_frontier=plog.hwm - 1)  # a frontier past the log is damage
        p = Partition(topic.name, topic.id, index, plog, offs)
        p.counting = self.delivery_counts
        p.restore(frontier, ahead, offs.counts, offs.reasons, offs.held)
        frozen = TR.read_freeze(d)  # a move's freeze made before a restart holds for the rest of its TTL
        if frozen is not None:
            left_s = (frozen[1] - time.time() * 1000) / 1000
            if left_s > 0:
                p.freeze_token, p.freeze_until = frozen[0], time.monotonic() + left_s
                log.info("partition opened frozen for a move (a freeze made before a restart)", extra={
                    "topic": topic.name, "partition": index, "ttl_left_s": round(left_s, 1)})
        tgt = DL.read_target(d)  # (the settings are followed on the loop: ``_open``)
        if tgt is not None:
            p.dlq_target, p.dlq_sent = (tgt[0], tgt[1]), tgt[2]
        # Idempotent produce: the keys committed within the window, from the log itself.
        p.idem_window_ms, p.nparts = topic.idem_window_ms, topic.partitions
        p.idem_marked = (d / IDEM.MARKER).exists()
        p.claims, p.claims_topic, p.claims_tag = self.claims, topic_tag(topic.id), self.claims_tag
        if (topic.id, index) in self._claims_loaded or not IDEM.needs_rebuild(d):
            return p  # its keys were read at start, or it never had a keyed record
        t0 = time.monotonic()
        keys, n = IDEM.rebuild(plog, p.idem_window_ms, int(time.time() * 1000), self.claims, p.claims_topic, index,
                               topic.partitions)
        if keys:
            log.info("idempotency keys rebuilt from the log", extra={
                "topic": topic.name, "partition": index, "keys": keys, "records_read": n,
                "ms": round((time.monotonic() - t0) * 1000, 1)})
        return p

    async def _close_partition(self, key: tuple[str, int], p: Partition, *, clean: bool) -> None:
        await self._finish_close(key, p, self._begin_close(key, p), clean)

    def _begin_close(self, key: tuple[str, int], p: Partition) -> asyncio.Future[None]:
        """Synchronous first half of a close: the partition leaves the map and a
        fence is up until its files are written (an open of the same partition
        waits for it)."""
        if self.partitions.get(key) is p:
            del self.partitions[key]
        if not p.leases and p.available() <= 0:
            if len(self._drained) >= DRAINED_LIMIT:
                self._drained.clear()  # a cache: forgetting only costs an open
            self._drained.add((p.topic, p.index, p.topic_id))
        self._synced.pop(key, None)
        self._leveled.pop(key, None)
        self._report_dropped(p)
        # its gauges from memory until the poller reads its files (COLD_POLL_EVERY)
        self._cold_rows[key] = (p.topic_id, time.monotonic(), _open_row(p))
        fence: asyncio.Future[None] = self.loop.create_future()
        self._closing[key] = fence
        return fence

    async def _finish_close(self, key: tuple[str, int], p: Partition, fence: asyncio.Future[None],
                            clean: bool) -> None:
        def release(_f: object = None) -> None:
            if self._closing.get(key) is fence:
                del self._closing[key]
            if not fence.done():
                fence.set_result(None)

        try:
            # Every close of a live log takes the produce side first: a commit in
            # flight publishes before the hwm file is written (never a close inside one).
            await p.quiesce()
        except BaseException:
            release()
            raise
        frontier, ahead = p.snapshot_offsets()
        counts = p.snapshot_counts()
        reasons = p.snapshot_reasons()
        held = frozenset(p.held_marks())  # marked held (held again at the next open), their counts first

        def close_sync() -> None:
            try:
                p.offsets.close(frontier, ahead, counts, reasons, held)
            except OSError as e:
                log.error("could not persist consumer offsets at close", extra={"topic": p.topic, "err": str(e)})
            p.log.close(clean=clean)

        fut = self.loop.run_in_executor(self.io, close_sync)
        fut.add_done_callback(release)  # the fence falls when the files are written, even if we are cancelled
        await asyncio.shield(fut)

    def _report_dropped(self, p: Partition) -> None:
        n = p.dropped - p.dropped_reported
        if n:
            self.m.consumer_dropped.labels(p.topic, str(p.index)).inc(n)
            p.dropped_reported = p.dropped
        n = p.corrupt_skipped - p.corrupt_reported
        if n:
            self.m.corrupt_skipped.labels(p.topic, str(p.index)).inc(n)
            p.corrupt_reported = p.corrupt_skipped

    def _idle_lru(self, idle_s: float | None, exclude: tuple[str, int] | None = None) -> list[tuple[tuple[str, int],
                                                                                                   Partition]]:
        """Partitions closing would lose nothing of (``Partition.evictable``), least
        recently used first; with `idle_s`, only those unused that long."""
        now = time.monotonic()
        cands = [(p.last_used, key, p) for key, p in self.partitions.items()
                 if key != exclude and (idle_s is None or now - p.last_used >= idle_s) and p.evictable()]
        cands.sort(key=lambda c: c[0])
        return [(key, p) for _, key, p in cands]

    async def _evict(self, victims: list[tuple[tuple[str, int], Partition]], used_before: float | None = None
                     ) -> int:
        """Close these partitions, CLOSE_BATCH at a time; each is checked again right
        before its close begins (still ours, still evictable, and unused since
        `used_before` when given). Returns how many were closed."""
        done = 0
        for i in range(0, len(victims), CLOSE_BATCH):
            batch = []
            for key, p in victims[i:i + CLOSE_BATCH]:
                if self.partitions.get(key) is not p or not p.evictable():
                    continue
                if used_before is not None and p.last_used > used_before:
                    continue
                batch.append((key, p, self._begin_close(key, p)))
            if not batch:
                continue
            res = await asyncio.shield(asyncio.gather(*(self._finish_close(k, p, f, True) for k, p, f in batch),
                                                      return_exceptions=True))
            for (k, _p, _f), r in zip(batch, res, strict=True):
                if isinstance(r, BaseException):
                    log.error("closing an idle partition failed", extra={"topic": k[0], "partition": k[1],
                                                                         "err": repr(r)})
            done += len(batch)
        return done

    async def _make_room(self, key: tuple[str, int]) -> None:
        """Before an open at the cap of open logs: close the least recently used
        idle ones (a few more than needed, so a burst of opens does not pay a close
        each). Nothing closable: the cap is exceeded (logged), never an open refused."""
        excess = len(self.partitions) + len(self._opening) - self.max_open
        if excess <= 0:
            return
        victims = self._idle_lru(None, exclude=key)[:excess + max(1, self.max_open // 32)]
        if len(victims) < excess and time.monotonic() - self._cap_warned > 60:
            self._cap_warned = time.monotonic()
            log.warning("more partition logs open than the cap: the others hold leases, commits or unsynced acks",
                        extra={"open": len(self.partitions), "cap": self.max_open})
        n = await self._evict(victims)
        self.m_evicted.inc(n)

    async def _retire(self, key: tuple[str, int], p: Partition) -> None:
        """The partition's topic incarnation is gone here: close it; remove its
        data only once the supervisor confirms the incarnation is gone."""
        await self._close_partition(key, p, clean=True)
        try:
            gone = await self.confirm_gone(p.topic, p.topic_id)
        except Exception:
            gone = False
        if gone:
            d = topic_dir(self.data_dir, p.topic, p.topic_id) / f"p{p.index:05d}"
            await self.loop.run_in_executor(self.io, _remove_partition_dir, d)
            log.info("removed data of a deleted topic partition", extra={"topic": p.topic, "id": p.topic_id,
                                                                        "partition": p.index})
        elif (p.topic, p.topic_id) not in self._gone_retries:
            task = self.loop.create_task(self._remove_dead_later(p.topic, p.topic_id))
            self._gone_retries[(p.topic, p.topic_id)] = task
            task.add_done_callback(lambda _t, k=(p.topic, p.topic_id): self._gone_retries.pop(k, None))

    async def _remove_dead_later(self, name: str, tid: str) -> None:
        """A retire whose removal was not confirmed: ``_remove_dead`` again after each of
        GONE_RETRY_S (the same rule: the supervisor's confirmation first), until this
        worker holds no directory of the incarnation; the cold walk covers what is left."""
        for pause in GONE_RETRY_S:
            await asyncio.sleep(pause)
            try:
                if await self._remove_dead(name, tid):
                    return
            except Exception:
                log.exception("removing a deleted incarnation's data failed; tried again",
                              extra={"topic": name, "id": tid})

    # ---- commit (owner side) -------------------------------------------------------------------
    async def commit_local(self, topic: str, topic_id: str, partition: int,
                           records: list[tuple[bytes | None, int, bytes]],
                           ikeys: list[str | None] | None = None) -> Committed:
        """Commit `records` into this worker's partition (a hop's or the dispatcher's
        commit). ``ikeys``: each record's idempotency key as its block holds it, from a
        worker of this node (``CommitReq.ikeys``); without them the commit reads the blocks."""
        t = self._commit_target(topic, topic_id, partition)
        p = await self.partition(t, partition)
        self.follow_window(p, t)  # a PATCH may have changed it
        return await p.commit(records, self.commit_rounds, ikeys)

    def commit_local_now(self, topic: str, topic_id: str, partition: int,
                         records: list[tuple[bytes | None, int, bytes]],
                         ikeys: list[str | None] | None = None) -> asyncio.Future[Committed] | None:
        """``commit_local`` without a coroutine when the partition is open: the future of
        its commit (``Partition.submit``), or None when it is not open here (the caller
        takes ``commit_local``, which opens it). Raises as ``commit_local`` does."""
        t = self._commit_target(topic, topic_id, partition)
        p = self.partitions.get((topic, partition))
        if p is None or p.topic_id != t.id or p.closed:
            return None
        p.last_used = time.monotonic()
        self.follow_window(p, t)  # a PATCH may have changed it
        return p.submit(records, self.commit_rounds, ikeys)

    def _commit_target(self, topic: str, topic_id: str, partition: int) -> TopicRecord:
        """The topic a commit into this worker's `partition` goes to; raises when the
        records' incarnation, the partition or its owner is not this worker's now."""
        t = self.store.topic(topic)
        if t is None or t.id != topic_id:
            raise Conflict(f'topic incarnation mismatch for "{topic}": records are for {topic_id}, '
                           f"the topic is {t.id if t else 'absent'}", code="incarnation_mismatch")
        if not 0 <= partition < t.partitions:
            raise Conflict(f"partition {partition} is not in topic {topic}", code="incarnation_mismatch")
        if not self.routes_trusted():
            # Restarted with a replica that may be behind a flip made while this node was
            # down: the copy here may no longer be the partition. Retried by every sender.
            raise Unavailable(f"partition {partition} of {topic}: this node's replica has not caught up with "
                              "the leader since it started; retry", code="partition_moving")
        node, worker = self.where(t, partition)
        if node != self.node_id or worker != self.index:
            # The sender's replica and ours disagree (a move's flip, a fresh placement):
            # retryable; never committed into a copy this worker does not own.
            raise Unavailable(f"partition {partition} of {topic} is owned by {node}/{worker}, not {self.node_id}/"
                              f"{self.index}; retry", code="partition_moving")
        return t

    def commit_direct(self, t: TopicRecord, partition: int, entries: list[Entry]) -> asyncio.Future[Committed] | None:
        """Produce without the WAL: keyless records whose partition was chosen here (so it
        is one this worker owns) are committed straight into it, when it is open, this
        worker owns it by the replica it trusts, and it is not frozen for a move. Returns
        the commit's future (durable, read back, visible when it resolves: the 202 may
        follow), or None when that is not possible now. A future that fails left no
        visible frame (a failed write or sync is cut away; a frame that could not be
        published stays hidden behind the high watermark): the caller takes the WAL. Only
        a crash can bring such a frame back (a failed cut, or a kill before the close that
        hides an unpublished one): a duplicate, never a loss.
        Only keyless records whose partition was chosen here come here (no order to keep,
        no key to check); a produce with idempotency keys takes ``direct``
        (docs/architecture.md, "Direct commits")."""
        if self.wal.failed is not None or not self.routes_trusted():
            return None  # (a latched WAL failure refuses every produce until a restart, direct ones too)
        p = self._direct_target(t, partition)
        if not isinstance(p, Partition):
            return None
        failed = self._seam_failure()
        if failed is not None:
            return failed
        try:
            # (a keyless produce's records carry no idempotency key: the commit looks into no block)
            fut = p.submit([(None, e.flags, e.payload) for e in entries], self.commit_rounds, NO_KEYS)
        except (OSError, NaradError):
            return None
        n = len(entries)
        self.direct_in_flight += n
        epoch = self._group_epoch
        m_direct = self.m_direct

        def done(f: asyncio.Future[Committed]) -> None:
            self.direct_in_flight -= n
            if not f.cancelled() and f.exception() is None:
                m_direct.inc(n)
            if self._group_epoch == epoch:  # the keyless choice moves on once a commit, as after a WAL group
                self._group_epoch += 1

        fut.add_done_callback(done)
        return fut

    def direct(self, t: TopicRecord, entries: Sequence[Entry], groups: dict[int, DirectGroup] | None = None,
               keyed: bool = True, inc: bytes | None = None) -> DirectBatch | None:
        """Produce without the WAL for a produce with idempotency keys (its records may
        also carry message keys or partitions, and span partitions; its answer waits for
        their commits anyway): each partition's
        records are committed straight into it when its owner is on this node (this
        worker: the partition open, not frozen; another worker: its link up, a
        ``CommitReq`` one hop away, given up after ``DIRECT_HOP_TIMEOUT``). Everything
        else is left in ``rest`` for the WAL. Returns None when no record can go directly
        (the caller takes the WAL for all of them).

        A key's order: a group holding a message key waits until no record this worker
        took through its WAL for that partition is still on its way there
        (``_order_clear``; at most ``ORDER_WAIT_S``, then it takes the WAL, behind them),
        so it lands after every record produced here before it was answered, as through
        the WAL. The idempotency keys are checked at the commit, as through the WAL
        (whichever copy of a key is committed first is kept, and the other answered as
        its duplicate); a commit that failed left nothing visible (see ``commit_direct``),
        except a hop given up or cut off, which may have committed: its records are in
        ``unknown`` and are sent again through the WAL (an idempotent record is then
        found as a repeat of itself, and its answer says the verdict is pending; any
        other may be stored twice, as after a crash: counted in
        ``narad_errors_total{component="broker", kind="direct_hop_unknown"}`` and logged).

        What the producer knows already is not worked out again here: ``groups``
        (partition -> ``DirectGroup``: the indexes of its entries in batch order, their
        records, and each one's idempotency key as its block holds it, None for none)
        is the grouping, and the keys go to the commits, which then read no block;
        ``keyed`` False says no entry has a message key (no order to keep); ``inc``, the
        entries' incarnation (then no entry is read: the producer may build them only for
        what goes to the WAL, ``DeferredEntries``)."""
        if not entries or self.wal.failed is not None or not self.routes_trusted():
            return None
        if groups is None:
            by_part: dict[int, list[int]] = {}
            for i, e in enumerate(entries):
                g = by_part.get(e.partition)
                if g is None:
                    by_part[e.partition] = [i]
                else:
                    g.append(i)
            groups = {part: (idx, [(entries[i].key, entries[i].flags, entries[i].payload) for i in idx], None)
                      for part, idx in by_part.items()}
        plan: DirectBatch | None = None
        rest: list[int] = []
        if inc is None:
            inc = entries[0].incarnation
        for part, (idx, records, iks) in groups.items():
            fut = self._direct_group(t, part, inc, records, iks, keyed)
            if fut is None:
                rest.extend(idx)
                continue
            if plan is None:
                plan = DirectBatch(self.loop.create_future(), len(entries))
            plan.left += 1
            self.direct_in_flight += len(idx)
            fut.add_done_callback(self._direct_settled(plan, idx))
        if plan is None:
            return None
        rest.sort()
        plan.rest = rest
        return plan

    def direct_one(self, t: TopicRecord, e: Entry, ikey: str | None = None) -> asyncio.Future[Committed] | None:
        """``direct`` for one entry without a message key (a single produce with an
        idempotency key: no order to keep): its commit straight into its partition on this
        node (this worker's, or another worker's one hop away), without ``DirectBatch``.
        Returns the commit's future (its (base, dups): ``dups`` non-empty when the record
        was dropped as a repeat of its key), or None (the caller takes the WAL). A future
        that fails committed nothing (``commit_direct``), unless ``hop_unknown`` says a
        hop given up or cut off may have: the caller then sends it through the WAL, where
        it is found as a repeat of itself, and its verdict is not known. ``ikey``: its
        idempotency key, as ``direct``'s ``ikeys``."""
        if self.wal.failed is not None or not self.routes_trusted():
            return None
        part = e.partition
        if e.key or not 0 <= part < t.partitions or e.incarnation.hex() != t.id:
            return None
        fut = self._direct_submit(t, part, [(None, e.flags, e.payload)], [ikey] if ikey is not None else None)
        if fut is None:
            return None
        self.direct_in_flight += 1
        fut.add_done_callback(self._direct_one_done)
        return fut

    def _direct_one_done(self, f: asyncio.Future[Committed]) -> None:
        self.direct_in_flight -= 1
        exc: BaseException | None = asyncio.CancelledError() if f.cancelled() else f.exception()
        if exc is None:
            self.m_direct.inc(1)
            return
        _direct_failed(exc, 1)

    def _direct_target(self, t: TopicRecord, part: int) -> Partition | int | None:
        """Where a direct commit of partition `part` goes now: the open Partition (this
        worker), another worker's index (its link up), or None (the WAL's)."""
        node, worker = self.where(t, part)
        if node != self.node_id or worker is None:
            return None
        if worker == self.index:
            p = self.partitions.get((t.name, part))
            if p is None or p.topic_id != t.id or p.closed or p.frozen():
                return None
            return p
        return worker if self.links.connected(worker) else None

    def _direct_group(self, t: TopicRecord, part: int, inc: bytes, records: list[tuple[bytes | None, int, bytes]],
                      iks: list[str | None] | None = None, keyed: bool = True) -> asyncio.Future[Committed] | None:
        """One partition's records of ``direct``: the future of their commit, or None
        (the WAL takes them)."""
        if not 0 <= part < t.partitions or inc.hex() != t.id:
            return None
        target = self._direct_target(t, part)
        if target is None:
            return None
        key = (t.name, inc, part)
        if keyed and any(r[0] for r in records) and not self._order_clear(key):
            # A key's records still on their way through this worker's WAL: this group waits
            # for them (a later group of the partition waits behind it: _order_clear says no).
            proxy: asyncio.Future[Committed] = self.loop.create_future()

            def go(clear: bool) -> None:
                if proxy.done():
                    return
                try:
                    f = self._direct_submit(t, part, records, iks) if clear else None
                except Exception as e:  # never left unanswered: the WAL takes the records
                    log.exception("direct commit failed to start")
                    proxy.set_exception(OSError(5, f"direct commit failed to start: {e!r}"))
                    return
                if f is None:
                    proxy.set_exception(OSError(11, "a key's earlier records are still on their way (the WAL "
                                                    "takes this one)" if not clear else "direct commit not possible"))
                    return
                f.add_done_callback(functools.partial(_chain, proxy))

            self._order_wait(key, go)
            return proxy
        return self._direct_submit(t, part, records, iks, target)

    def _direct_submit(self, t: TopicRecord, part: int, records: list[tuple[bytes | None, int, bytes]],
                       iks: list[str | None] | None = None, target: Partition | int | None = None
                       ) -> asyncio.Future[Committed] | None:
        """``iks``: the records' idempotency keys (``Partition.submit``), carried by a hop
        to another worker too (``CommitReq.ikeys``: its commit reads no block). ``target``:
        ``_direct_target``'s answer when the caller has just asked it (in the same loop step)."""
        if target is None:
            target = self._direct_target(t, part)
        if target is None:
            return None
        failed = self._seam_failure()
        if failed is not None:
            return failed
        if isinstance(target, Partition):
            self.follow_window(target, t)  # a PATCH may have changed it (as commit_local does)
            try:
                return target.submit(records, self.commit_rounds, iks)
            except (OSError, NaradError):
                return None
        return self._hop_commit(target, P.CommitReq(t.name, t.id, part, records, iks))

    def _hop_commit(self, worker: int, req: P.CommitReq) -> asyncio.Future[Committed]:
        """A direct commit at another worker: the future of its (base, dups). The ones
        queued for a worker in one loop pass leave together at its end, in one hop (an
        idempotent batch spans partitions, several of them that worker's): one
        ``CommitReq`` alone, or one ``CommitManyReq`` whose parts are answered each on
        its own. The hop is given up after ``DIRECT_HOP_TIMEOUT``, or cut off with its
        link: every part of it fails with that error (its records may have been
        committed: ``_direct_settled``)."""
        fut: asyncio.Future[Committed] = self.loop.create_future()
        q = self._hops.get(worker)
        if q is None:
            q = self._hops[worker] = []
            self.loop.call_soon(self._send_hops, worker)
        q.append((req, fut))
        return fut

    def _send_hops(self, worker: int) -> None:
        q = self._hops.pop(worker, None)
        if q:
            task = self.loop.create_task(self._hop(worker, q))
            self._hop_tasks.add(task)  # (held until done: the loop keeps only a weak reference)
            task.add_done_callback(self._hop_tasks.discard)

    async def _hop(self, worker: int, q: list[tuple[P.CommitReq, asyncio.Future[Committed]]]) -> None:
        try:
            if len(q) == 1:
                r = await self.links.call(worker, q[0][0], P.CommitResp, timeout=DIRECT_HOP_TIMEOUT)
                answers: list[Committed | BaseException] = [(r.base, r.dups)]
            else:
                many = await self.links.call(worker, P.CommitManyReq([req for req, _f in q]), P.CommitManyResp,
                                             timeout=DIRECT_HOP_TIMEOUT)
                if len(many.parts) != len(q):
                    raise BadGateway(f"worker {worker} answered {len(many.parts)} parts of {len(q)}")
                answers = [(a.base, a.dups) if not a.status else error_for_status(a.status, a.message, a.code)
                           for a in many.parts]
        except BaseException as e:  # the hop failed as a whole (given up, cut off, cancelled): every part
            for _req, f in q:
                if not f.done():
                    if isinstance(e, asyncio.CancelledError):
                        f.cancel()
                    else:
                        f.set_exception(e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        for (_req, f), a in zip(q, answers, strict=True):
            if f.done():
                continue
            if isinstance(a, BaseException):
                f.set_exception(a)
            else:
                f.set_result(a)

    def _order_clear(self, key: tuple[str, bytes, int]) -> bool:
        """No record this worker took through its WAL for destination `key` is still on
        its way there (staged, queued at the dispatcher or in flight), and no direct
        commit of a key waits for them: a record committed there directly now lands
        after every record produced here before it was answered."""
        if key in self._order_waits:
            return False
        last = self._staged_last.get(key)
        if last is not None:
            if last > self._fed_seq:
                return False
            del self._staged_last[key]  # fed: the dispatcher says from here on
        return not self.dispatcher.busy(key)

    def _order_wait(self, key: tuple[str, bytes, int], go: Callable[[bool], None]) -> None:
        """Call ``go(True)`` once `key` is clear (``_on_drained``), in arrival order, or
        ``go(False)`` after ``ORDER_WAIT_S``."""
        waits = self._order_waits.get(key)
        if waits is None:
            waits = self._order_waits[key] = deque()
        waits.append(go)

        def expire() -> None:
            q = self._order_waits.get(key)
            if q is not None and go in q:
                q.remove(go)
                if not q:
                    del self._order_waits[key]
                go(False)
                self._on_drained(key)  # the ones behind it may be clear by now

        self.loop.call_later(ORDER_WAIT_S, expire)

    def _on_drained(self, key: tuple[str, bytes, int]) -> None:
        """The dispatcher has nothing more for `key` (or a wait expired): the direct
        commits waiting for it go, in order, when nothing else is on its way."""
        waits = self._order_waits.get(key)
        if not waits:
            return
        del self._order_waits[key]
        if not self._order_clear(key):
            self._order_waits[key] = waits  # a WAL record of it is on its way again: still waiting
            return
        for go in waits:
            try:
                go(True)
            except Exception:  # (go answers its own failures; this is a last guard for the ones behind it)
                log.exception("direct commit waiter failed")

    def _seam_failure(self) -> asyncio.Future[Committed] | None:
        """Test seam (``NARAD_FAULT_DIRECT_COMMIT_FAIL_EVERY``): every Nth direct commit
        fails as a failed write would (nothing written)."""
        if not FAIL_DIRECT_EVERY:
            return None
        self._direct_tries += 1
        if self._direct_tries % FAIL_DIRECT_EVERY:
            return None
        failed: asyncio.Future[Committed] = self.loop.create_future()
        failed.set_exception(OSError(5, "direct commit failed (NARAD_FAULT_DIRECT_COMMIT_FAIL_EVERY)"))
        return failed

    def _direct_settled(self, plan: DirectBatch, idx: list[int]) -> Callable[[asyncio.Future[Committed]], None]:
        def settled(f: asyncio.Future[Committed]) -> None:
            self.direct_in_flight -= len(idx)
            exc: BaseException | None = asyncio.CancelledError() if f.cancelled() else f.exception()
            if exc is None:
                for j in f.result()[1]:
                    plan.dup[idx[j]] = True
                self.m_direct.inc(len(idx))
            else:
                plan.failed.extend(idx)
                if _direct_failed(exc, len(idx)):
                    plan.unknown.update(idx)  # a hop given up or cut off: it may have committed them
            plan.left -= 1
            if plan.left == 0 and not plan.done.done():
                plan.failed.sort()
                plan.done.set_result(None)
        return settled

    async def deliver(self, topic: str, topic_id: str, partition: int, entries: list[Entry]
                      ) -> str | Committed | Rehome:
        """Dispatcher target: commit at the owner, here or one hop away. Returns the
        owner's (first offset, duplicate indexes), "gone", or a ``Rehome`` of the records
        this node placed that must go to their key's partition first (``rehome``)."""
        if DISPATCH_DELAY_S:
            await asyncio.sleep(DISPATCH_DELAY_S)
        while DISPATCH_HOLD_FILE and os.path.exists(DISPATCH_HOLD_FILE):
            await asyncio.sleep(0.05)
        t = self.store.topic(topic)
        if t is None or t.id != topic_id:
            # Never discard on local absence alone: the replica may be behind.
            if await self.confirm_gone(topic, topic_id):
                return "gone"
            raise Unavailable(f'topic "{topic}" incarnation {topic_id} not confirmed; holding its records')
        if any(map(_PLACED, entries)):  # (a keyless idempotent record this node placed: still to go here?)
            moved = self.rehome(t, partition, entries)
            if moved:
                return Rehome(moved)
        records = [(e.key, e.flags, e.payload) for e in entries]
        node, worker = self.where(t, partition)
        if node is None:
            raise Unavailable(f"partition {partition} of {topic} has no owner yet")
        if node != self.node_id:
            r = await self.remote.call(node, P.CommitReq(topic, topic_id, partition, records), P.CommitResp,
                                       timeout=30)
            return r.base, r.dups
        if worker == self.index:
            return await self.commit_local(topic, topic_id, partition, records)
        r = await self.links.call(worker, P.CommitReq(topic, topic_id, partition, records), P.CommitResp, timeout=30)
        return r.base, r.dups

    async def commit_to(self, t: TopicRecord, partition: int, records: list[tuple[bytes | None, int, bytes]]
                        ) -> int:
        """Commit (key, flags, payload) records at partition `partition` of `t` wherever
        its owner is: here, another worker (one hop), another node (CommitReq over node
        RPC, 30 s). The fan-out path: like ``deliver`` without the WAL (the records are
        durable in the parent's log already). Returns the first offset; raises when the
        owner refused or did not answer (nothing rerouted)."""
        node, worker = self.where(t, partition)
        if node is None:
            raise Unavailable(f"partition {partition} of {t.name} has no owner yet")
        req = P.CommitReq(t.name, t.id, partition, records)
        if node != self.node_id:
            base = (await self.remote.call(node, req, P.CommitResp, timeout=30)).base
        elif worker == self.index:
            base = (await self.commit_local(t.name, t.id, partition, records))[0]
        else:
            base = (await self.links.call(worker, req, P.CommitResp, timeout=30)).base
        return base

    def rehome(self, t: TopicRecord, partition: int, entries: Sequence[Entry]) -> list[tuple[int, int]]:
        """``deliver``'s check: the entries of a batch bound for `partition` that must go to
        their idempotency key's partition (its home) instead, as (index, home). A keyless
        record with an idempotency key whose partition the node chose (``Entry.placed``;
        never one the client gave) may be committed away from its home only on the
        node that owns the home while the home has no move target
        (topic.idempotent_local_placement: the node's claims table holds the key, and a
        move of the home carries it); a record placed so whose home moved since (its
        direct commit was refused, a move's seal among the reasons: it waited in the WAL)
        or whose partition left this node is sent to the home, where its key is checked."""
        n = t.partitions
        out: list[tuple[int, int]] = []
        pl: _Placement | None = None
        here = False
        for i, e in enumerate(entries):
            if not e.placed or e.key is not None or not e.flags & F_EXT or not FR.has_idem(e.payload):
                continue  # (a partition the client gave, or a key's: it stays)
            k = IDEM.key_of(e.flags, e.payload)
            if k is None:
                continue
            h = key_partition(k.encode(), n)
            if h == partition:
                continue
            if pl is None:
                pl = self._placement(t)
                here = partition < n and pl.locs[partition][0] == self.node_id
            if not here or not pl.home_here[h]:
                out.append((i, h))
        return out

    def partition_count(self, topic: str, topic_id: str) -> int:
        t = self.store.topic(topic)
        return t.partitions if t is not None and t.id == topic_id else 0

    async def _trust_watch(self) -> None:
        """Latch ``routes_trusted`` at the node's first readiness even when nothing is
        dispatched then: a node that lost its quorum later (not ready) keeps committing."""
        while not self.routes_trusted():
            await asyncio.sleep(TRUST_POLL)

    def routes_trusted(self) -> bool:
        """The dispatcher's gate (see ``Target.routes_trusted``), and every local commit's
        (``commit_local``: WAL records, fan-out copies, dead-letter copies, peers' commits):
        latched once the node was ready (/readyz), which needs the replica to have applied
        the commit index it heard from a live leader. Until then records wait, durable."""
        if not self._routes_trusted:
            self._routes_trusted = self.versions.load(V.READY) == 1
            if self._routes_trusted:
                if self._untrusted_since is not None:
                    log.info("dispatch starts: this node's replica caught up with the leader",
                             extra={"waited_seconds": round(time.monotonic() - self._untrusted_since, 3)})
            elif self._untrusted_since is None:
                self._untrusted_since = time.monotonic()
                log.info("dispatch waits until this node's replica has caught up with the leader "
                         "(a partition may have moved while it was down)")
        return self._routes_trusted

    def owner_alive(self, topic: str, topic_id: str, partition: int) -> bool:
        t = self.store.topic(topic)
        if t is None or t.id != topic_id:
            return True  # not ours to judge: deliver() holds it until confirmed gone
        node = self.remote.owner_node(t, partition)
        return node is not None and self.remote.node_alive(node)

    # ---- wake-ups ------------------------------------------------------------------------------
    def _on_visible(self, p: Partition, n: int) -> None:
        """`n` records became visible in `p`: consumers parked here are woken first;
        the watch tokens of other workers and nodes fire only for what they leave
        (at once for records beyond the woken count, else after the woken ones took
        their share: one loop pass later, if any are still unclaimed)."""
        if self.fanout.by_part:
            self.fanout.on_visible(p)  # cursors reading this parent partition copy at once
        woke = self._wake(p.topic, n)
        if woke < n:
            self._tell_watchers(p.topic, n - woke)
        elif p.topic in self._watchers:
            self.loop.call_soon(self._tell_left, p)

    def _tell_left(self, p: Partition) -> None:
        if not p.closed:
            left = self._ready_in(p)
            if left > 0:
                self._tell_watchers(p.topic, left)

    def _on_released(self, p: Partition, n: int = 1) -> None:
        """`n` leases ended (ack, nack, expiry, delays that fell due): worth a wake
        only when they left records deliverable (a nack or an expiry, or a cap slot
        freed above waiting records): as many consumers woken here, and as many
        watchers told, as records came back (at most what is deliverable now)."""
        if not self._waiters.get(p.topic) and not self._watchers.get(p.topic):
            return  # nobody to wake or tell (the common ack): what is deliverable is not worked out
        ready = self._ready_in(p)
        if ready <= 0:
            return
        n = min(n, ready)
        if self._waiters.get(p.topic):
            self._wake(p.topic, n)
        self._tell_watchers(p.topic, n)

    def _ready_in(self, p: Partition) -> int:
        """Records a reserve in `p` would hand out now, caps included: what a watch
        token may be fired for (records held back by a full in-flight or acked-ahead
        cap are no reason to wake a consumer, who would find nothing and park again:
        with several parked, the two workers would trade notes for as long as the cap
        stays full)."""
        t = self.store.topic(p.topic)
        if t is None or t.id != p.topic_id:
            return 0
        return p.ready(t.max_in_flight_per_partition, t.max_acked_ahead_per_partition)

    def _tell_watchers(self, topic: str, n: int) -> None:
        """`n` records became available: fire that many tokens, oldest first (one
        told consumer per record, not a herd racing for each one)."""
        watchers = self._watchers.get(topic)
        if not watchers:
            return
        told = []
        for key in watchers:
            told.append(key)
            if len(told) >= n:
                break
        for key in told:
            del watchers[key]
        if not watchers:
            del self._watchers[topic]
        for node, w in told:
            if node in ("", self.node_id):
                self.links.notify(w, P.ReadyNote(topic, n, w, "", self.index))
            else:
                self.remote.notify(node, P.ReadyNote(topic, n, w, self.node_id, self.index))

    def _wake(self, topic: str, n: int, by: tuple[str, Any] | None = None) -> int:
        """Wake up to `n` consumers parked here on `topic`; returns how many woke.
        `by`: the owner whose ReadyNote woke them (``("w", worker)`` or ``("n", node)``):
        the woken consumer asks that owner at once, whatever its watch stamp says."""
        q = self._waiters.get(topic)
        woke = 0
        while q and woke < n:
            f = q.popleft()
            if not f.done():
                f.set_result(by if by is not None else True)
                woke += 1
        if q is not None and not q:
            self._waiters.pop(topic, None)
        return woke

    # ---- consume --------------------------------------------------------------------------------
    def _reserve_in(self, p: Partition, t: TopicRecord, max_n: int, now: float, vis_ms: int = 0) -> list[P.Item]:
        vis = (vis_ms or t.visibility_timeout_ms) / 1000.0  # vis_ms: this consume's own lease length (0: the topic's)
        return p.reserve(now, max_n, vis, t.max_in_flight_per_partition,
                         t.max_acked_ahead_per_partition, _item)  # type: ignore[return-value]

    async def reserve_owned(self, t: TopicRecord, max_n: int, partition: int | None,
                            vis_ms: int = 0) -> list[P.Item]:
        """Reserve up to max_n from the partitions of `t` this worker owns."""
        if partition is not None:
            parts = [partition] if self.where(t, partition) == (self.node_id, self.index) else []
        else:
            parts = self.owned(t)
        if not parts:
            return []
        out: list[P.Item] = []
        now = time.monotonic()
        n = len(parts)
        start = self._crr.pick(t.name, n) if n > 1 else 0
        for k in range(n):
            i = parts[(start + k) % n]
            p = self.partitions.get((t.name, i))
            if p is None or p.topic_id != t.id:
                if (t.name, i, t.id) in self._drained and (t.name, i) not in self._opening:
                    continue  # closed with nothing deliverable, nothing committed since: never opened for a poll
                try:
                    p = await self.partition(t, i)
                except BaseException:  # cancelled (the client hung up) or the open failed
                    self._give_back_owned(t, out)
                    raise
                now = time.monotonic()  # (an open may take long, a key table's rebuild: a lease starts now)
            if p.available() <= 0:
                nxt = p.next_expiry()
                if nxt is None or nxt > now:  # nothing deliverable and no lease to expire: skip it
                    continue  # (not a use: a partition only polled may close when idle)
            out.extend(self._reserve_in(p, t, max_n - len(out), now, vis_ms))
            if len(out) >= max_n:
                break
        return out

    async def consume(self, t: TopicRecord, max_n: int, wait: float, partition: int | None = None,
                      vis_ms: int = 0) -> list[P.Item]:
        """This worker's partitions first, then this node's other workers (one
        hop each), then the other nodes' owners (a probe each). An owner node
        whose probe came back short gets a delivery token (a watch: it reserves
        nothing) and is not probed again until it answers with a ReadyNote or
        WATCH_TTL passes. If nothing is ready, park until a token fires or
        `wait` runs out.

        Cancelled at any await (its client hung up), it never strands a record:
        leases it holds are nacked at once, a probe in flight is nacked when it
        answers, and a wake it was handed is passed on (see _hung_up)."""
        loop = self.loop
        t0 = loop.time()
        deadline = t0 + wait
        if partition is not None:
            node, _ = self.where(t, partition)
            if node is None or (node != self.node_id and not self.remote.node_alive(node)):
                raise Unavailable("partition owner is down; retry later")
        name = t.name
        self._polling[name] = self._polling.get(name, 0) + 1
        got: list[P.Item] = []
        hung_up = absorbed = False
        woken_by: tuple[str, Any] | None = None  # the owner whose ReadyNote woke this poll
        try:
            first = True
            while True:
                got = []
                if partition is None:
                    pl = self._placement(t)
                    peers, nodes, here = pl.peers, pl.nodes, bool(pl.mine)
                else:
                    workers, nodes = self.owners(t, partition)
                    peers = [w for w in workers if w != self.index]
                    here = self.index in workers
                # Fair share: every PEER_SHARE a consume here leaves room for another worker's
                # records (half the batch, or all of a single consume) and asks that worker
                # first, so records there are not starved by local ones that fill every batch.
                share = self._share_due(name, peers, woken_by) if partition is None and here else None
                # ... and every NODE_SHARE for another node's records the same way (asked after
                # this node's workers, with the room kept for it).
                nshare = (self._node_share_due(name, nodes, woken_by)
                          if partition is None and share is None and nodes else None)
                room = max(1, max_n // 2) if share is not None or nshare is not None else 0
                if here:
                    cap = max_n - room
                    if cap > 0:
                        got = await self.reserve_owned(t, cap, partition, vis_ms)  # gives back its own if cancelled
                if len(got) < max_n and (peers or nodes):
                    if wait > 0 and not got and first and partition is not None:
                        for w in peers:
                            self.links.notify(w, P.WatchNote(name, self.index))
                        for n in nodes:
                            self.remote.notify(n, P.WatchNote(name, self.index, self.node_id))
                    hints_w = self._armed_w
                    limit_w = max_n - room if nshare is not None else max_n  # the room kept for nshare
                    for w in peers:
                        if len(got) >= limit_w:
                            break
                        key_w = (name, w)
                        if partition is None and woken_by != ("w", w):
                            # A worker whose probe came back short holds our watch token and says
                            # when records are left there (ReadyNote): until then, or WATCH_TTL,
                            # consumes here do not ask it again (no hop per consume). The worker
                            # whose note woke this poll is asked at once: the note's handler has
                            # just re-armed the token for the consumers still parked, and that
                            # fresh stamp must not hide the records the note announced.
                            armed = hints_w.get(key_w)
                            if armed is not None and loop.time() - armed < WATCH_TTL:
                                continue
                            asked = self._peer_asked.get(key_w, -PEER_SHARE)
                            if got and w != share and loop.time() - asked < PEER_SHARE:
                                continue  # records in hand: ask the other worker only now and then
                        want = limit_w - len(got)
                        if partition is None:
                            if len(self._peer_asked) > 100_000:
                                self._peer_asked.clear()
                            self._peer_asked[key_w] = loop.time()
                            call = self._probe_at(w, t, want, vis_ms)  # one ConsumeReq per worker per loop pass
                        else:
                            call = self.links.call(w, P.ConsumeReq(name, t.id, want, partition, P.WORKER, vis_ms),
                                                   P.ConsumeResp, timeout=10.0)
                        items = await self._reserve_at(t, call, 2.0, f"worker {w}")
                        got.extend(items)
                        if len(items) < want and partition is None and wait > 0:
                            armed = hints_w.get(key_w)
                            if armed is None or loop.time() - armed >= WATCH_TTL:  # not left by a sibling just now
                                hints_w[key_w] = loop.time()
                                self.links.notify(w, P.WatchNote(name, self.index))
                    if share is not None and len(got) < max_n:
                        got.extend(await self.reserve_owned(t, max_n - len(got), partition, vis_ms))  # the room left
                    hints = self._armed
                    for n in ([nshare, *(x for x in nodes if x != nshare)] if nshare is not None else nodes):
                        if len(got) >= max_n:
                            break
                        if not self.remote.node_alive(n):
                            continue
                        key = (name, n)
                        if partition is None and woken_by != ("n", n):
                            # A node that came back short holds our watch token and says when it has
                            # records (ReadyNote): until then, or WATCH_TTL, do not ask it again
                            # (the node whose note woke this poll is asked at once, as above).
                            armed = hints.get(key)
                            if armed is not None and loop.time() - armed < WATCH_TTL:
                                continue
                        want = max_n - len(got)
                        if partition is None:
                            if len(self._node_asked) > 100_000:
                                self._node_asked.clear()
                            self._node_asked[key] = loop.time()
                        req = P.ConsumeReq(name, t.id, want, partition, P.NODE, vis_ms)
                        # A pinned consume has only this owner to ask: no answer is a 502 (the
                        # forwarded request got no answer), not "nothing there".
                        items = await self._reserve_at(t, self.remote.call(n, req, P.ConsumeResp, timeout=10.0),
                                                       0.5 if partition is None else 2.0, f"node {n}",
                                                       pinned=partition is not None)
                        got.extend(items)
                        if len(items) < want and partition is None:
                            hints[key] = loop.time()
                            self.remote.notify(n, P.WatchNote(name, self.index, self.node_id))
                    if nshare is not None and here and len(got) < max_n:
                        got.extend(await self.reserve_owned(t, max_n - len(got), partition, vis_ms))  # the room left
                first = False
                woken_by = None
                remaining = deadline - loop.time()
                if got or remaining <= 0 or self.closing:
                    if got:
                        self._count_delivered(name, got)
                    self._waited(name, "no_wait" if wait <= 0 else "hit" if got else "timeout", loop.time() - t0)
                    return got
                got = []
                if partition is None and peers:
                    # Parking: every other worker owning partitions of the topic must hold our
                    # token, or its records would wake nobody here until the re-check (a token
                    # is spent by its ReadyNote; the probe that follows may not leave a new one).
                    tnow = loop.time()
                    for w in peers:
                        key_w = (name, w)
                        armed = self._armed_w.get(key_w)
                        if armed is None or tnow - armed >= WATCH_TTL:
                            self._armed_w[key_w] = tnow
                            self.links.notify(w, P.WatchNote(name, self.index))
                fut: asyncio.Future[Any] = loop.create_future()
                self._waiters.setdefault(name, deque()).append(fut)
                self.m.consume_waiters.inc()
                timer = loop.call_later(min(remaining, PARK_RECHECK), _wake_false, fut)
                try:
                    await fut
                except asyncio.CancelledError:
                    if fut.done() and not fut.cancelled() and fut.result():
                        absorbed = True  # woken in the same instant: the wake goes to the next waiter
                    else:
                        self._unpark(name, fut)
                    raise
                finally:
                    timer.cancel()
                    self.m.consume_waiters.dec()
                res = fut.result()
                woken_by = res if isinstance(res, tuple) else None
                cur = self.store.topic(name)
                if cur is None or cur.id != t.id:
                    raise NotFound(f'topic "{name}" not found')
        except BaseException as e:
            hung_up = isinstance(e, asyncio.CancelledError)
            if hung_up:
                self._waited(name, "cancelled", loop.time() - t0)
            if got:
                self._give_back(t, got, "cancelled consume" if hung_up else "failed consume")
            raise
        finally:
            left = self._polling.get(name, 1) - 1
            if left > 0:
                self._polling[name] = left
            else:
                self._polling.pop(name, None)
            if hung_up:
                self._hung_up(t, left, absorbed)

    def _count_delivered(self, name: str, got: list[P.Item]) -> None:
        """Deliveries by (topic, partition): a dict lookup and two adds per record."""
        cache = self._m_cons
        for it in got:
            c = cache.get((name, it.partition))
            if c is None:
                if len(cache) > 100_000:
                    cache.clear()
                lbl = (name, str(it.partition))
                c = cache[(name, it.partition)] = (self.m.messages_consumed.labels(*lbl),
                                                   self.m.bytes_consumed.labels(*lbl))
            c[0].value += 1
            c[1].value += len(it.payload)

    def _waited(self, name: str, outcome: str, seconds: float) -> None:
        h = self._m_wait.get((name, outcome))
        if h is None:
            if len(self._m_wait) > 100_000:
                self._m_wait.clear()
            for o in WAIT_OUTCOMES:  # the topic's four series appear together, at zero
                self._m_wait[(name, o)] = self.m.consume_wait.labels(name, o)
            h = self._m_wait[(name, outcome)]
        h.observe(seconds)

    # ---- coalesced hops to this node's other workers ------------------------------------------------
    def _share_due(self, name: str, peers: list[int], woken_by: tuple[str, Any] | None) -> int | None:
        """The first other worker owed a fair-share probe: not asked for PEER_SHARE,
        and not holding our watch token (a worker holding it has nothing and says so
        when it has), unless its note just woke this poll."""
        now = self.loop.time()
        for w in peers:
            key_w = (name, w)
            if now - self._peer_asked.get(key_w, -PEER_SHARE) < PEER_SHARE:
                continue
            armed = self._armed_w.get(key_w)
            if armed is None or now - armed >= WATCH_TTL or woken_by == ("w", w):
                return w
        return None

    def _node_share_due(self, name: str, nodes: list[str], woken_by: tuple[str, Any] | None) -> str | None:
        """The first other live node owed a fair-share probe (as ``_share_due``, every
        NODE_SHARE)."""
        now = self.loop.time()
        for n in nodes:
            key = (name, n)
            if now - self._node_asked.get(key, -NODE_SHARE) < NODE_SHARE or not self.remote.node_alive(n):
                continue
            armed = self._armed.get(key)
            if armed is None or now - armed >= WATCH_TTL or woken_by == ("n", n):
                return n
        return None

    def _probe_at(self, w: int, t: TopicRecord, want: int, vis_ms: int = 0) -> Awaitable[P.ConsumeResp]:
        """A consume probe at worker `w`: every probe of `t` with this lease length
        made in this loop pass travels in one ConsumeReq (their wants added up, capped
        at PROBE_MAX); the records it brings are shared out in request order."""
        key = (w, t.name, t.id, vis_ms)
        b = self._probes.get(key)
        if b is None or b[0] + want > PROBE_MAX:
            b = self._probes[key] = [0, []]
            self.loop.call_soon(self._send_probes, key, b)
        fut: asyncio.Future[list[P.Item]] = self.loop.create_future()
        b[1].append((fut, want))
        b[0] += want
        return _share(fut)

    def _send_probes(self, key: tuple[int, str, str, int], b: list[Any]) -> None:
        if self._probes.get(key) is b:
            del self._probes[key]
        w, name, tid, vis_ms = key
        total, waiters = b

        async def send() -> None:
            try:
                items = (await self.links.call(w, P.ConsumeReq(name, tid, total, None, P.WORKER, vis_ms),
                                               P.ConsumeResp, timeout=10.0)).items
            except Exception as e:
                for fut, _ in waiters:
                    if not fut.done():
                        fut.set_exception(e)
                        fut.exception()  # retrieved: a waiter that gave up reads nothing
                return
            pos = 0
            for fut, n in waiters:
                share = items[pos:pos + n]
                pos += len(share)
                if not fut.done():
                    fut.set_result(share)
                elif share:  # nobody will take these (cannot happen: a share future is never cancelled)
                    t = self.store.topic(name)
                    if t is not None and t.id == tid:
                        self._give_back(t, share, "probe share without a taker")
            if pos < len(items):  # more than asked (never, but never strand a lease)
                t = self.store.topic(name)
                if t is not None and t.id == tid:
                    self._give_back(t, items[pos:], "probe answered with more than asked")

        task = self.loop.create_task(send())
        self._late.add(task)
        task.add_done_callback(self._late.discard)

    async def _ack_at(self, w: int, t: TopicRecord, mode: int, sub: list[tuple[int, int, int]],
                      dur_ms: int = 0, reason: str = "") -> list[int]:
        """Settle at worker `w`: every settle of `t` with this mode (and nack delay or
        extend length, and nack reason) made in this loop pass travels in one AckReq;
        statuses come back in order (503 if it failed)."""
        key = (w, t.name, t.id, mode, dur_ms, reason)
        b = self._acks.get(key)
        if b is None or len(b[0]) + len(sub) > ACK_MAX:
            b = self._acks[key] = [[], []]
            self.loop.call_soon(self._send_acks, key, b)
        fut: asyncio.Future[list[int]] = self.loop.create_future()
        b[1].append((fut, len(b[0]), len(sub)))
        b[0].extend(sub)
        return await asyncio.shield(fut)  # a caller that goes away leaves the batch alone

    def _send_acks(self, key: tuple[int, str, str, int, int, str], b: list[Any]) -> None:
        if self._acks.get(key) is b:
            del self._acks[key]
        w, name, tid, mode, dur_ms, reason = key
        items, waiters = b

        async def send() -> None:
            try:
                req = P.AckReq(name, tid, mode, items, P.WORKER, dur_ms, reason)
                statuses = (await self.links.call(w, req, P.AckResp, timeout=2.0)).statuses
                if len(statuses) != len(items):
                    statuses = [503] * len(items)
            except Exception:
                statuses = [503] * len(items)
            for fut, start, n in waiters:
                if not fut.done():
                    fut.set_result(statuses[start:start + n])

        task = self.loop.create_task(send())
        self._late.add(task)
        task.add_done_callback(self._late.discard)

    def _unpark(self, topic: str, fut: asyncio.Future[Any]) -> None:
        q = self._waiters.get(topic)
        if q is None:
            return
        with contextlib.suppress(ValueError):
            q.remove(fut)
        if not q:
            self._waiters.pop(topic, None)

    def _hung_up(self, t: TopicRecord, left: int, absorbed: bool) -> None:
        """A consume of `t` was cancelled (its client went away). A wake it had just
        received goes to the next waiter here; if no consume of the topic is left on
        this worker, the watch tokens it left at the owners are withdrawn (and, when a
        wake was lost with it, the owners tell their next watcher)."""
        name = t.name
        if absorbed and self._waiters.get(name):
            self._wake(name, 1)
            absorbed = False
        if left > 0:
            return
        workers, nodes = self.owners(t)
        for w in workers:
            if w != self.index:
                self._armed_w.pop((name, w), None)
                self.links.notify(w, P.UnwatchNote(name, self.index, "", absorbed))
        for n in nodes:
            self._armed.pop((name, n), None)  # the next consume here asks that node at once
            if self.remote.node_alive(n):
                self.remote.notify(n, P.UnwatchNote(name, self.index, self.node_id, absorbed))

    def _bounce(self, m: P.ReadyNote) -> None:
        """A token fired for this worker, but nobody is parked here on the topic any
        more (the consumer hung up, or its poll ended, while the note was on its way):
        hand it back so the owner tells its next watcher instead of nobody."""
        t = self.store.topic(m.topic)
        if t is None:
            return
        if m.node and m.node != self.node_id:
            self.remote.notify(m.node, P.UnwatchNote(m.topic, self.index, self.node_id, True))
            return
        if m.src >= 0:
            self.links.notify(m.src, P.UnwatchNote(m.topic, self.index, "", True))
            return
        workers, _ = self.owners(t)  # a note that does not say which worker sent it
        for w in workers:
            if w != self.index:
                self.links.notify(w, P.UnwatchNote(m.topic, self.index, "", True))

    def _give_back_owned(self, t: TopicRecord, items: list[P.Item]) -> None:
        """Nack leases of this worker's partitions that nobody will see (synchronous)."""
        if items:
            self.settle_owned(t, [(i.partition, i.offset, i.nonce) for i in items], GIVE_BACK)

    def _give_back(self, t: TopicRecord, items: list[P.Item], why: str) -> None:
        """Nack leases wherever their owners are, now, in the background."""
        if not items:
            return
        log.debug("giving back leases nobody will see", extra={"why": why, "records": len(items)})
        back = self.loop.create_task(self.nack_items(t, items))
        self._late.add(back)
        back.add_done_callback(self._late.discard)

    async def _reserve_at(self, t: TopicRecord, call: Awaitable[P.ConsumeResp], wait: float,
                          where: str, pinned: bool = False) -> list[P.Item]:
        """A consume probe at another owner, waited for at most `wait` seconds. The call is
        not cancelled when we stop waiting (the owner may have reserved records already):
        whatever it returns late is given back at once (nack), so no lease is orphaned
        until its visibility timeout. A `pinned` probe (the consume names the partition)
        that fails or goes unanswered raises BadGateway (502): its owner did not answer."""
        task = self.loop.create_task(call)  # type: ignore[arg-type]
        try:
            done, _ = await asyncio.wait({task}, timeout=wait)
        except asyncio.CancelledError:
            # Our consumer went away mid-probe: the probe runs on (the owner may have
            # reserved already) and whatever it brings is given back at once.
            self._adopt_probe(t, task, where, "the consumer went away")
            raise
        if task in done:
            try:
                return task.result().items
            except Exception as e:
                log.debug("consume probe failed", extra={"at": where, "err": str(e)})
                if pinned:
                    if isinstance(e, NaradError):
                        raise  # the owner answered with an error of its own: pass it on
                    raise BadGateway(f"partition owner {where} did not answer; retry") from None
                return []
        self._adopt_probe(t, task, where, "consume probe answered late")
        if pinned:
            raise BadGateway(f"partition owner {where} did not answer in {wait:g}s; retry")
        return []

    def _adopt_probe(self, t: TopicRecord, task: asyncio.Task[P.ConsumeResp], where: str, why: str) -> None:
        """Nobody waits for this probe any more: nack what it reserved when it answers."""
        def late(tk: asyncio.Task[P.ConsumeResp]) -> None:
            if tk.cancelled() or tk.exception() is not None:
                return
            items = tk.result().items
            if items:
                log.info(f"{why}; its leases are given back", extra={"at": where, "records": len(items)})
                self._give_back(t, items, why)

        self._late.add(task)
        task.add_done_callback(self._late.discard)
        task.add_done_callback(late)

    async def nack_items(self, t: TopicRecord, items: list[P.Item]) -> None:
        """Give back leases a consumer will never see (it went away)."""
        if items:
            await self.settle(t, [(i.partition, i.offset, i.nonce) for i in items], GIVE_BACK)

    # ---- settle (ack / extend / nack) -------------------------------------------------------------
    def settle_owned(self, t: TopicRecord, items: list[tuple[int, int, int]], mode: int,
                     dur_ms: int = 0, reason: str = "") -> list[int]:
        """`dur_ms`: a nack's delay, or an extend's lease length (0: none / the topic's);
        `reason`: a nack's (kept for the dead-letter record)."""
        now = time.monotonic()
        vis = (dur_ms if mode == EXTEND and dur_ms > 0 else t.visibility_timeout_ms) / 1000.0
        delay = dur_ms / 1000.0 if mode == NACK else 0.0
        out = []
        # Acks and nacks tell the partition's waiters once a batch (``_on_released`` with the
        # count, after the loop: no consumer runs in between, so the state after the last one is
        # the one a woken consumer finds; the count only bounds the wakes, which are as many as
        # records are deliverable then), not once a record.
        acked: dict[Partition, int] = {}
        for part, off, nonce in items:
            p = self.partitions.get((t.name, part))
            if p is None or p.topic_id != t.id or p.closed:
                out.append(410)
                continue
            if mode == ACK:
                ok = p.ack(off, nonce, now, False)
                if ok:
                    acked[p] = acked.get(p, 0) + 1
            elif mode == EXTEND:
                ok = p.extend(off, nonce, now, vis)
            else:  # NACK, or GIVE_BACK (its count taken back)
                ok = p.nack(off, nonce, now, delay, reason if mode == NACK else "", uncount=mode == GIVE_BACK,
                            notify=False)
                if ok:
                    acked[p] = acked.get(p, 0) + 1
            out.append(204 if ok else 410)
        for p, k in acked.items():
            if p.on_released is not None:
                self._on_released(p, k)
        if mode == EXTEND:
            self.m.ack_extended.labels(t.name).inc(sum(1 for s in out if s == 204))
        elif mode in (NACK, GIVE_BACK):  # (Narad counts give-backs too: a batch consume's overflow, and here a
            # hang-up's leases and a redrive's skipped records; docs/operate/monitoring.md)
            self.m.nacks.labels(t.name).inc(sum(1 for s in out if s == 204))
        return out

    async def settle(self, t: TopicRecord, items: list[tuple[int, int, int]], mode: int,
                     dur_ms: int = 0, reason: str = "") -> list[int]:
        """Statuses in request order: 204 settled, 410 no live lease, 503 owner
        down or unknown, 502 a forwarded call got no answer. Items of this
        worker's own partitions are settled here at once (no task, no hop);
        the rest go to their owners, one call per owner."""
        pl = self._placement(t)
        mine = pl.mine_set
        if all(it[0] in mine for it in items):
            return self.settle_owned(t, items, mode, dur_ms, reason)
        result = [410] * len(items)
        # By owner, each item's read from the placement (``where``'s answers, cached with it)
        # instead of worked out again for every item of a batch ack spanning workers.
        groups: dict[tuple[str | None, int], list[int]] = {}
        locs = pl.locs
        for i, (part, _, _) in enumerate(items):
            if 0 <= part < t.partitions:
                groups.setdefault(locs[part], []).append(i)

        async def one(loc: tuple[str | None, int], idxs: list[int]) -> None:
            node, worker = loc
            sub = [items[i] for i in idxs]
            if node is None:
                statuses = [503] * len(sub)
            elif node == self.node_id and worker == self.index:
                statuses = self.settle_owned(t, sub, mode, dur_ms, reason)
            elif node == self.node_id:
                statuses = await self._ack_at(worker, t, mode, sub, dur_ms, reason)
            elif not self.remote.node_alive(node):
                statuses = [503] * len(sub)
            else:
                try:
                    resp = await self.remote.call(node, P.AckReq(t.name, t.id, mode, sub, P.NODE, dur_ms, reason),
                                                  P.AckResp, timeout=2.0)
                    statuses = resp.statuses
                except Unavailable:
                    statuses = [503] * len(sub)
                except Exception:
                    statuses = [502] * len(sub)
            for i, st in zip(idxs, statuses, strict=True):
                result[i] = st

        if len(groups) == 1:
            for loc, idxs in groups.items():
                await one(loc, idxs)
        else:
            await asyncio.gather(*(one(loc, idxs) for loc, idxs in groups.items()))
        return result

    # ---- replay and stats ----------------------------------------------------------------------------
    async def replay_owned(self, t: TopicRecord, partition: int, offset: int) -> P.ReplayResp:
        p = await self.partition(t, partition)
        if offset >= p.log.hwm:
            return P.ReplayResp(204)
        try:
            key, ts, flags, payload = p.log.read(offset)
        except OffsetGone as e:
            return P.ReplayResp(410, None, e.oldest)
        except Exception:
            return P.ReplayResp(410, None, -1)
        return P.ReplayResp(200, P.Item(partition, offset, 0, key, ts, flags, payload), p.log.oldest)

    async def replay(self, t: TopicRecord, partition: int, offset: int) -> P.ReplayResp:
        node, worker = self.where(t, partition)
        req = P.ReplayReq(t.name, t.id, partition, offset)
        if node is None or (node != self.node_id and not self.remote.node_alive(node)):
            raise Unavailable("partition owner is down; retry later")
        if node != self.node_id:
            return await self.remote.call(node, req, P.ReplayResp, timeout=5.0)
        if worker == self.index:
            return await self.replay_owned(t, partition, offset)
        return await self.links.call(worker, req, P.ReplayResp)

    async def stats_owned(self, t: TopicRecord, parts: list[int]) -> dict[int, dict[str, int]]:
        """Stats of partitions this worker owns. An open one answers from memory; a
        closed (or never opened) one is read from its files: describe never opens a
        log, so monitoring cannot keep idle logs open (and never stamps last use)."""
        out: dict[int, dict[str, int]] = {}
        cold: list[int] = []
        for i in parts:
            key = (t.name, i)
            p = self.partitions.get(key)
            if p is None or p.topic_id != t.id or p.closed:
                pending = self._opening.get(key)
                if pending is not None and not pending.done():
                    try:
                        p = await asyncio.shield(pending)
                    except Exception:
                        p = None
            if p is not None and p.topic_id == t.id and not p.closed:
                out[i] = p.stats()
            else:
                cold.append(i)
        if cold:
            fences = [f for i in cold if (f := self._closing.get((t.name, i))) is not None]
            if fences:
                await asyncio.gather(*(asyncio.shield(f) for f in fences))
            base = topic_dir(self.data_dir, t.name, t.id)
            out.update(await self.loop.run_in_executor(self.io, _stats_from_disk_many, base, cold))
        return out

    async def stats(self, t: TopicRecord, parts: list[int]) -> dict[int, dict[str, int] | None]:
        """Partition stats from each owner; an owner that is down or slow (2 s)
        leaves its partitions None (the caller renders a placeholder)."""
        groups: dict[tuple[str | None, int], list[int]] = {}
        for i in parts:
            groups.setdefault(self.where(t, i), []).append(i)
        out: dict[int, dict[str, int] | None] = {}

        async def one(loc: tuple[str | None, int], idxs: list[int]) -> None:
            node, worker = loc
            req = P.StatsReq(t.name, t.id, idxs)
            try:
                if node is None:
                    raise Unavailable("unassigned")
                if node != self.node_id and not self.remote.node_alive(node):
                    raise Unavailable("owner marked dead")
                if node == self.node_id and worker == self.index:
                    out.update(await self.stats_owned(t, idxs))
                elif node == self.node_id:
                    out.update((await self.links.call(worker, req, P.StatsResp, timeout=2.0)).stats)
                else:
                    out.update((await self.remote.call(node, req, P.StatsResp, timeout=2.0)).stats)
            except Exception:
                for i in idxs:
                    out[i] = None

        await asyncio.gather(*(one(loc, idxs) for loc, idxs in groups.items()))
        return {i: None if row is None else finish_stats(row) for i, row in out.items()}

    async def fanout_lag(self, parent: TopicRecord) -> dict[str, tuple[int, bool]]:
        """child name -> (parent messages not yet copied into it, whether every
        partition's owner answered), gathered from the owners of every partition of
        `parent` (their running cursors, else their cursor files; no log is opened).
        An owner that is down or slow (2 s) leaves its partitions out: the count is a
        lower bound and the flag False."""
        groups: dict[tuple[str | None, int], list[int]] = {}
        for i in range(parent.partitions):
            groups.setdefault(self.where(parent, i), []).append(i)
        got: dict[str, dict[int, int]] = {}

        async def one(loc: tuple[str | None, int], idxs: list[int]) -> None:
            node, worker = loc
            try:
                if node is None:
                    raise Unavailable("unassigned")
                if node != self.node_id and not self.remote.node_alive(node):
                    raise Unavailable("owner marked dead")
                if node == self.node_id and worker == self.index:
                    lags = await self.fanout.lag_owned(parent, idxs)
                else:
                    req = P.FanoutLagReq(parent.name, parent.id, idxs, P.NODE if node != self.node_id else P.WORKER)
                    call = (self.links.call(worker, req, P.FanoutLagResp, timeout=2.0) if node == self.node_id
                            else self.remote.call(node, req, P.FanoutLagResp, timeout=2.0))
                    lags = (await call).lags
            except Exception as e:
                log.debug("fan-out lag: an owner did not answer", extra={"topic": parent.name, "err": str(e)})
                return
            for child, row in lags.items():
                got.setdefault(child, {}).update({i: n for i, n in row.items() if i in idxs})

        await asyncio.gather(*(one(loc, idxs) for loc, idxs in groups.items()))
        out: dict[str, tuple[int, bool]] = {}
        for child in parent.children:
            row = got.get(child, {})
            out[child] = (sum(row.values()), len(row) == parent.partitions)
        return out

    # ---- peer handlers ------------------------------------------------------------------------------
    def _topic_for(self, name: str, topic_id: str) -> TopicRecord:
        t = self.store.topic(name)
        if t is None or t.id != topic_id:
            raise Conflict(f'topic "{name}" incarnation {topic_id} is not current here', code="incarnation_mismatch")
        return t

    async def _topic_soon(self, name: str, topic_id: str, wait: float) -> TopicRecord:
        """``_topic_for``, waiting up to `wait` seconds for this replica to apply it."""
        end = time.monotonic() + wait
        while True:
            t = self.store.topic(name)
            if t is not None and t.id == topic_id:
                return t
            if time.monotonic() >= end:
                return self._topic_for(name, topic_id)
            await asyncio.sleep(0.02)

    def _register_peer_handlers(self) -> None:
        """Requests from this node's other workers (scope WORKER) and from other
        nodes (scope NODE, landing on any worker of this node)."""
        s = self.links.service

        def keys_checked(m: P.CommitReq, c: Any) -> None:
            if m.ikeys is not None and not hop_ikeys_ok(m, c):
                if hop_bodies_alone(m):
                    # A body sent without its key's block (``FR.lay_keyed``) is taken only with its
                    # key, from a worker of this node: anything else would commit it keyless.
                    raise BadRequest("records without their idempotency-key blocks, from outside this node")
                m.ikeys = None  # (the owner reads the keys from the blocks)

        def commit_now(m: P.CommitReq, c: Any) -> asyncio.Future[Committed] | None:
            """The commit of `m` started at once, without a coroutine, when its partition is
            this worker's and open; None otherwise (``commit`` then)."""
            keys_checked(m, c)
            if self.route(m.topic, m.partition) != self.index:
                return None
            return self.commit_local_now(m.topic, m.topic_id, m.partition, m.records, m.ikeys)

        async def commit(m: P.CommitReq, c: Any) -> P.CommitResp:
            fut = commit_now(m, c)
            if fut is not None:
                base, dups = await fut
                return P.CommitResp(base, dups)
            w = self.route(m.topic, m.partition)
            if w != self.index:
                return await self.links.call(w, m, P.CommitResp, timeout=30)
            base, dups = await self.commit_local(m.topic, m.topic_id, m.partition, m.records, m.ikeys)
            return P.CommitResp(base, dups)

        def part_failed(e: BaseException) -> P.CommitPart:
            """A CommitManyReq part's failure, answered as the link answers a single CommitReq."""
            if isinstance(e, NaradError):
                return P.CommitPart(status=e.status, message=e.message, code=e.code)
            if isinstance(e, asyncio.CancelledError):
                return P.CommitPart(status=503, message="commit cancelled")
            log.error("commit of a CommitManyReq part failed", exc_info=e)
            return P.CommitPart(status=500, message=f"internal error: {e}")

        async def commit_part(m: P.CommitReq, c: Any) -> P.CommitPart:
            try:
                r = await commit(m, c)
            except Exception as e:
                return part_failed(e)
            return P.CommitPart(r.base, r.dups)

        async def commit_many(m: P.CommitManyReq, c: Any) -> P.CommitManyResp:
            # Every part starts in this pass (one commit round takes them together) and is answered on
            # its own. A part whose partition is open here starts at once, without a task (a task and
            # its coroutines cost more than the commit's own Python); the others as ``commit_part``.
            parts = m.parts
            out: list[P.CommitPart | None] = [None] * len(parts)
            futs: list[tuple[int, asyncio.Future[Committed]]] = []
            slow: list[int] = []
            for i, x in enumerate(parts):
                try:
                    f = commit_now(x, c)
                except Exception as e:  # answered for this part alone, as commit_part answers it
                    out[i] = part_failed(e)
                    continue
                if f is None:
                    slow.append(i)
                else:
                    futs.append((i, f))
            if slow:
                for i, r in zip(slow, await asyncio.gather(*(commit_part(parts[i], c) for i in slow)), strict=True):
                    out[i] = r
            if futs:
                left = len(futs)
                all_done: asyncio.Future[None] = self.loop.create_future()

                def one(_f: asyncio.Future[Committed]) -> None:
                    nonlocal left
                    left -= 1
                    if left == 0 and not all_done.done():
                        all_done.set_result(None)

                for _i, f in futs:
                    f.add_done_callback(one)
                await all_done  # (cancelled: the commits go on, as a waiter's cancel never takes a batch back)
                for i, f in futs:
                    if f.cancelled():
                        out[i] = part_failed(asyncio.CancelledError())
                    elif (e := f.exception()) is not None:
                        out[i] = part_failed(e)
                    else:
                        base, dups = f.result()
                        out[i] = P.CommitPart(base, dups)
            return P.CommitManyResp(out)  # type: ignore[arg-type]

        async def consume(m: P.ConsumeReq, _c: Any) -> P.ConsumeResp:
            t = self._topic_for(m.topic, m.topic_id)
            items = await self.reserve_owned(t, m.max, m.partition, m.vis_ms)  # gives back its own if cancelled
            if m.scope == P.NODE and len(items) < m.max:
                workers, _ = self.owners(t, m.partition)
                try:
                    for w in workers:
                        if w == self.index or len(items) >= m.max:
                            continue
                        sub = P.ConsumeReq(m.topic, m.topic_id, m.max - len(items), m.partition, P.WORKER, m.vis_ms)
                        items.extend(await self._reserve_at(
                            t, self.links.call(w, sub, P.ConsumeResp, timeout=10.0), 0.3, f"worker {w}"))
                except asyncio.CancelledError:  # the caller gave up (reset its stream)
                    self._give_back(t, items, "cancelled consume probe")
                    raise
            return P.ConsumeResp(items)

        async def ack(m: P.AckReq, _c: Any) -> P.AckResp:
            t = self.store.topic(m.topic)
            if t is None or t.id != m.topic_id:
                return P.AckResp([410] * len(m.items))
            reason = m.reason[:MAX_REASON_CHARS]  # a peer's string: never unbounded in memory
            if m.scope == P.WORKER:
                return P.AckResp(self.settle_owned(t, m.items, m.mode, m.dur_ms, reason))
            return P.AckResp(await self.settle(t, m.items, m.mode, m.dur_ms, reason))

        async def replay(m: P.ReplayReq, _c: Any) -> P.ReplayResp:
            t = self._topic_for(m.topic, m.topic_id)
            w = self.route(m.topic, m.partition)
            if w != self.index:
                return await self.links.call(w, m, P.ReplayResp)
            return await self.replay_owned(t, m.partition, m.offset)

        async def stats(m: P.StatsReq, _c: Any) -> P.StatsResp:
            # A topic created a moment ago may reach the asker's replica before this one
            # (an attach point read right after the create): wait a little for it.
            t = await self._topic_soon(m.topic, m.topic_id, STATS_TOPIC_WAIT)
            mine = [i for i in m.partitions if self.route(m.topic, i) == self.index]
            out = await self.stats_owned(t, mine)
            others: dict[int, list[int]] = {}
            for i in m.partitions:
                w = self.route(m.topic, i)
                if w != self.index:
                    others.setdefault(w, []).append(i)
            for w, idxs in others.items():
                out.update((await self.links.call(w, P.StatsReq(m.topic, m.topic_id, idxs), P.StatsResp,
                                                  timeout=2.0)).stats)
            return P.StatsResp(out)

        async def watch(m: P.WatchNote, _c: Any) -> None:
            t = self.store.topic(m.topic)
            if t is not None and m.node not in ("", self.node_id) and not m.relayed:
                # A token from another node: every worker of this node owning a
                # partition of the topic must know it.
                workers, _ = self.owners(t)
                for w in workers:
                    if w != self.index:
                        self.links.notify(w, P.WatchNote(m.topic, m.worker, m.node, True))
            # If records are already waiting here, say so at once.
            if t is not None:
                for i in self.owned(t):
                    p = self.partitions.get((t.name, i))
                    ready = self._ready_in(p) if p is not None else 0
                    if ready > 0:
                        self._watchers.setdefault(m.topic, {})[(m.node, m.worker)] = None
                        self._tell_watchers(m.topic, ready)
                        return
            self._watchers.setdefault(m.topic, {})[(m.node, m.worker)] = None

        async def unwatch(m: P.UnwatchNote, _c: Any) -> None:
            t = self.store.topic(m.topic)
            if t is not None and m.node not in ("", self.node_id) and not m.relayed:
                workers, _ = self.owners(t)  # the token was passed to every owning worker here
                for w in workers:
                    if w != self.index:
                        self.links.notify(w, P.UnwatchNote(m.topic, m.worker, m.node, m.pass_on, True))
            ws = self._watchers.get(m.topic)
            if ws is not None:
                ws.pop((m.node, m.worker), None)
                if not ws:
                    del self._watchers[m.topic]
            if m.pass_on and t is not None:
                # the wake we sent died with its consumer: records still ready go to the next one
                ready = 0
                for i in self.owned(t):
                    p = self.partitions.get((t.name, i))
                    if p is not None and p.topic_id == t.id:
                        ready += self._ready_in(p)
                if ready:
                    self._wake(m.topic, ready)
                    self._tell_watchers(m.topic, ready)

        async def ready(m: P.ReadyNote, _c: Any) -> None:
            if m.worker in (-1, self.index):
                if m.node and m.node != self.node_id:
                    self._armed.pop((m.topic, m.node), None)
                elif m.src >= 0:
                    self._armed_w.pop((m.topic, m.src), None)  # its token fired: ask it again
                by = (("n", m.node) if m.node and m.node != self.node_id
                      else ("w", m.src) if m.src >= 0 else None)
                if not self._wake(m.topic, m.count, by):
                    self._bounce(m)
                elif self._waiters.get(m.topic):
                    # Consumers are still parked here: the owner gets a new token at once (the
                    # one it spent told only the ones just woken).
                    if m.node and m.node != self.node_id:
                        self._armed[(m.topic, m.node)] = self.loop.time()
                        self.remote.notify(m.node, P.WatchNote(m.topic, self.index, self.node_id))
                    elif m.src >= 0:
                        self._armed_w[(m.topic, m.src)] = self.loop.time()
                        self.links.notify(m.src, P.WatchNote(m.topic, self.index))
            else:
                self.links.notify(m.worker, m)

        async def fanout_lag(m: P.FanoutLagReq, _c: Any) -> P.FanoutLagResp:
            t = self._topic_for(m.parent, m.parent_id)
            parts = [i for i in m.partitions if 0 <= i < t.partitions]
            mine = [i for i in parts if self.route(m.parent, i) == self.index]
            out = await self.fanout.lag_owned(t, mine)
            if m.scope == P.NODE:
                others: dict[int, list[int]] = {}
                for i in parts:
                    w = self.route(m.parent, i)
                    if w != self.index:
                        others.setdefault(w, []).append(i)
                for w, idxs in others.items():
                    sub = P.FanoutLagReq(m.parent, m.parent_id, idxs)
                    for child, row in (await self.links.call(w, sub, P.FanoutLagResp, timeout=2.0)).lags.items():
                        out.setdefault(child, {}).update(row)
            return P.FanoutLagResp(out)

        src = self.move_source

        def at_owner(fn: Callable[[Any], Awaitable[Any]], resp: type) -> Callable[[Any, Any], Awaitable[Any]]:
            async def handler(m: Any, _c: Any) -> Any:
                w = self.route(m.topic, m.partition)
                if w != self.index:
                    return await self.links.call(w, m, resp, timeout=30)
                return await fn(m)
            return handler

        async def move_status(m: P.MoveStatusReq, _c: Any) -> P.MoveStatusResp:
            return P.MoveStatusResp(self.mover.status())

        for typ, fn in ((P.MoveListReq, at_owner(src.list, P.MoveListResp)),
                        (P.MoveChunkReq, at_owner(src.chunk, P.MoveChunkResp)),
                        (P.MoveFreezeReq, at_owner(src.freeze, P.MoveFreezeResp)),
                        (P.MoveThawReq, at_owner(src.thaw, P.MoveFreezeResp)),
                        (P.MoveClaimsReq, at_owner(src.claims, P.MoveClaimsResp)),
                        (P.MoveVouchReq, at_owner(src.vouch, P.MoveVouchResp)),
                        (P.MoveStatusReq, move_status)):
            s.register(typ, fn)  # type: ignore[arg-type]
        for typ, fn in ((P.CommitReq, commit), (P.CommitManyReq, commit_many), (P.ConsumeReq, consume),
                        (P.AckReq, ack), (P.ReplayReq, replay),
                        (P.StatsReq, stats), (P.WatchNote, watch), (P.UnwatchNote, unwatch), (P.ReadyNote, ready),
                        (P.FanoutLagReq, fanout_lag)):
            s.register(typ, fn)  # type: ignore[arg-type]

    # ---- background work -----------------------------------------------------------------------------
    async def _committer(self) -> None:
        """Acks reach the page cache every 100 ms and the disk every sync interval."""
        loop = self.loop
        while True:
            await asyncio.sleep(COMMIT_TICK)
            now = time.monotonic()
            due: list[Partition] = []
            level: list[tuple[Partition, int]] = []
            for key, p in list(self.partitions.items()):
                if p.closed:
                    continue
                if p.dirty:
                    p.dirty = False
                    frontier, ahead = p.snapshot_offsets()
                    gen = p.count_gen
                    try:
                        p.counts_unwritten = p.offsets.write_window(frontier, ahead, p.snapshot_counts(),
                                                                    p.snapshot_reasons(), p.held_marks())
                        p.written_gen = gen  # these counts survive a process crash now (but counts_unwritten)
                    except OSError as e:
                        log.error("consumer offset write failed", extra={"topic": p.topic, "err": str(e)})
                        self.m.errors.labels("storage", "offset_write_failed").inc()
                        p.dirty = True
                        continue
                    except Exception:  # a bug: this partition stays dirty, the others are still written
                        p.dirty = True
                        self._pass_failed("committer", p)
                        continue
                if p.offsets.dirty_since_sync and now - self._synced.get(key, 0.0) >= self.offset_sync_interval:
                    self._synced[key] = now
                    due.append(p)
                if now - self._leveled.setdefault(key, now) >= LEVEL_EVERY:
                    self._leveled[key] = now
                    level.append((p, p.committed))
            if due or level:
                await loop.run_in_executor(self.io, _writeout_all, due, level)

    async def _sweeper(self) -> None:
        """Expired leases come back within a second; gauges stay current."""
        while True:
            await asyncio.sleep(SWEEP_EVERY)
            now = time.monotonic()
            for p in list(self.partitions.values()):
                if (p.leases or p.delayed) and (back := p.purge(now)):  # expiries and delayed nacks now due
                    self._on_released(p, back)
                self._report_dropped(p)
            self.m_open_logs.set(len(self.partitions))
            cr = self.commit_rounds
            rounds, logs = cr.rounds, cr.commits  # written by the round thread; read here, deltas only
            self.m_rounds.inc(rounds - self._rounds_seen[0])
            self.m_round_logs.inc(logs - self._rounds_seen[1])
            self._rounds_seen = (rounds, logs)
            self.m.dispatch_backlog.set(self.wal.backlog)
            rehomed = self.dispatcher.rehomed
            if rehomed != self._rehomed_seen:
                self.m.dispatch_rehomed.inc(rehomed - self._rehomed_seen)
                self._rehomed_seen = rehomed
            self.m.wal_pending.set(max(0, self.wal.next_seq - 1 - self.wal.durable_seq) + self.direct_in_flight)
            failed = self.wal.failed is not None
            if failed and not self._wal_failed_counted:
                self._wal_failed_counted = True  # latched until a restart: counted once
                self.m.errors.labels("wal", "write_failed").inc()
            self.m.wal_failed.set(1 if failed else 0)

    async def _reaper(self) -> None:
        """Housekeeping, one pass at a time (never two closes or sweeps of one
        partition at once): idle eviction, retention of open logs every
        REAP_EVERY, the cold retention walk every cold_walk_s."""
        loop = self.loop
        idle = self.idle_eviction_s
        evict_every = min(EVICT_EVERY, idle / 4) if idle > 0 else None
        now = loop.time()
        next_evict = now + evict_every if evict_every else float("inf")
        next_reap = now + REAP_EVERY
        next_cold = now + self.cold_walk_s if self.cold_walk_s > 0 else float("inf")
        while True:
            await asyncio.sleep(max(0.0, min(next_evict, next_reap, next_cold) - loop.time()))
            now = loop.time()
            try:
                if now >= next_evict:
                    next_evict = now + evict_every  # type: ignore[operator]
                    self.m_evicted.inc(await self._evict(self._idle_lru(idle)))
                if now >= next_reap:
                    next_reap = now + REAP_EVERY
                    now_ms = int(time.time() * 1000)
                    for p in list(self.partitions.values()):
                        await self._sweep_retention(p, now_ms)
                if now >= next_cold:
                    next_cold = now + self.cold_walk_s
                    await self._cold_walk()
            except Exception:
                self.m.errors.labels("broker", "housekeeping_failed").inc()
                log.exception("partition housekeeping pass failed; next pass as planned")

    async def _sweep_retention(self, p: Partition, now_ms: int) -> int:
        """One retention sweep of an open partition; returns records deleted."""
        t = self.store.topic(p.topic)
        if t is None or t.id != p.topic_id or not t.retention_ms or p.closed:
            return 0
        with contextlib.suppress(OSError):
            await self.loop.run_in_executor(self.io, p.log.roll_idle_active, t.retention_ms, now_ms)
        if p.closed:
            return 0
        segs = p.log.expired_segments(t.retention_ms, now_ms)
        if not segs:
            return 0
        n, size, paths = p.log.detach_segments(segs)
        if paths:  # unlinking a large segment takes milliseconds: never on the loop
            try:
                await self.loop.run_in_executor(self.io, PL.remove_files, paths, p.log.dir)
            except OSError as e:
                log.error("retention could not remove segment files", extra={"topic": p.topic, "err": str(e)})
        lbl = (p.topic, str(p.index), "age")
        self.m.retention_deleted.labels(*lbl).inc(n)
        self.m.retention_bytes_deleted.labels(*lbl).inc(size)
        log.info("retention deleted segments", extra={"topic": p.topic, "partition": p.index,
                                                      "records": n, "bytes": size})
        return n

    async def _cold_walk(self) -> None:
        """Retention for partitions not open here (untouched since the start, or
        closed as idle): list the topic directories on disk, keep the partitions this
        worker owns of live topics with a retention, stat their segments; one with
        an expired segment is opened, swept once and closed again (unless someone
        used it meanwhile). Directories of a deleted incarnation that no open
        partition covers (closed as idle before the delete) are removed once the
        supervisor confirms the incarnation gone, as a retire does."""
        names = await self.loop.run_in_executor(self.io, _list_dirs, self.data_dir / "topics")
        cands: list[tuple[TopicRecord, int, Path]] = []
        dead: list[tuple[str, str]] = []
        for dname in names:
            name, sep, tid = dname.rpartition("@")
            if not sep:
                continue
            t = self.store.topic(name)
            if t is None or t.id != tid:
                dead.append((name, tid))
                continue
            if not t.retention_ms:
                continue
            base = self.data_dir / "topics" / dname
            for i in self.owned(t):
                q = self.partitions.get((name, i))
                if (q is not None and q.topic_id == t.id and not q.closed) or (name, i) in self._opening:
                    continue
                cands.append((t, i, base / f"p{i:05d}"))
        for name, tid in dead:
            await self._remove_dead(name, tid)
        if not cands:
            return
        now_ms = int(time.time() * 1000)
        hits = await self.loop.run_in_executor(self.io, _expired_dirs, [(d, t.retention_ms) for t, _, d in cands],
                                               now_ms)
        for k in hits:
            t, i, _d = cands[k]
            cur = self.store.topic(t.name)
            key = (t.name, i)
            q = self.partitions.get(key)
            if cur is None or cur.id != t.id or (q is not None and q.topic_id == t.id and not q.closed):
                continue
            p = await self.partition(cur, i)
            opened_at = p.last_used
            n = await self._sweep_retention(p, now_ms)
            self.m_cold_swept.inc()
            log.info("cold retention walk swept a closed partition", extra={"topic": t.name, "partition": i,
                                                                           "records": n})
            await self._evict([(key, p)], used_before=opened_at)

    async def _remove_dead(self, name: str, tid: str) -> bool:
        """Partition directories of a deleted incarnation that this worker serves
        (by worker routing: the node's assignments of a deleted topic are gone) and
        holds no open partition of: removed once the supervisor confirms it gone.
        Returns whether none of this worker's is left."""
        base = self.data_dir / "topics" / f"{name}@{tid}"
        parts = await self.loop.run_in_executor(self.io, _list_dirs, base)
        mine = [d for d in parts if len(d) == 6 and d[0] == "p" and d[1:].isdigit()
                and self.route(name, int(d[1:])) == self.index]
        if not mine:
            return True
        try:
            gone = await self.confirm_gone(name, tid)
        except Exception:
            gone = False
        if not gone:
            return False
        left = False
        for d in mine:
            key = (name, int(d[1:]))
            q = self.partitions.get(key)
            if (q is not None and q.topic_id == tid) or key in self._opening or key in self._closing:
                left = True
                continue  # open (or opening / closing) here: the topic watch retires it
            await self.loop.run_in_executor(self.io, _remove_partition_dir, base / d)
            log.info("removed data of a deleted topic partition closed as idle",
                     extra={"topic": name, "id": tid, "partition": int(d[1:])})
        return not left

    async def _topic_watch(self) -> None:
        """A deleted or recreated topic: close its partitions here and answer
        the consumers parked on it."""
        while True:
            await asyncio.sleep(TOPIC_CHECK_EVERY)
            # Each version is taken as seen only once its pass is done: a partition that
            # fails (a bug) is logged and counted, the others are still handled, and the
            # pass is made again (after a pause that doubles while it keeps failing).
            if self._watch_pause:
                await asyncio.sleep(self._watch_pause)
            failed = False
            aver = self.versions.load(V.ASSIGNMENTS)
            if aver != self._assign_ver:
                try:
                    await self._moved_away()
                    self._assign_ver = aver
                except Exception:
                    failed = self._pass_failed("topic watch")
            ver = self.versions.load(V.TOPICS)
            if ver != self._topics_ver:
                self._poll_soon.set()  # new or deleted topics: their series soon, not in up to 5 s
                for key, p in list(self.partitions.items()):
                    try:
                        t = self.store.topic(p.topic)
                        if t is None or t.id != p.topic_id:
                            await self._retire(key, p)
                        else:
                            self._delivery_settings(p, t)
                    except Exception:
                        failed = self._pass_failed("topic watch", p)
                for name in list(self._waiters):
                    t = self.store.topic(name)
                    if t is None:
                        self._wake(name, len(self._waiters.get(name, ())))
                if not failed:
                    self._topics_ver = ver
            self._watch_pause = min(max(1.0, self._watch_pause * 2), TASK_PAUSE_MAX) if failed else 0.0

    def _pass_failed(self, task: str, p: Partition | None = None) -> bool:
        """One item of a background loop's pass raised (a bug): logged with its partition,
        counted and named by /readyz (``task_failed``); the loop goes on. True."""
        log.exception("background task failed on one item; the others go on, it is tried again", extra={
            "task": task, "worker": self.index, **({"topic": p.topic, "partition": p.index} if p else {})})
        self.task_failed(task)
        return True

    def _delivery_settings(self, p: Partition, t: TopicRecord) -> None:
        """A topic change may have set, raised or lifted max_deliveries (PATCH): the
        partition follows; lifted, what it held for the dead-letter topic goes out
        again, and raised, what was held below the new maximum, except what its driver
        sent to a dead-letter topic still there (``deadletter.finish_keep``). The idempotency
        window follows too (``follow_window``)."""
        self.follow_window(p, t)
        if p.follow_max(t.max_deliveries if t.dead_letter_topic else 0, DL.finish_keep(self.store, p)):
            self._on_released(p)

    # ---- partition moves --------------------------------------------------------------------------------
    async def _moved_away(self) -> None:
        """Partitions open here whose owner is now another node (a move's flip):
        close them (leases are not transferred: the new owner redelivers what was
        unacked) and set their directory aside, never deleting it."""
        for key, p in list(self.partitions.items()):
            t = self.store.topic(p.topic)
            if t is None or t.id != p.topic_id or not 0 <= p.index < t.partitions:
                continue  # the topic watch retires those
            node, _w = self.where(t, p.index)
            if node is None or node == self.node_id:
                continue  # still this node's (its worker is fixed by the hash)
            token = p.freeze_token or f"t{int(time.time() * 1000)}"
            await self._close_partition(key, p, clean=True)
            self._drained.discard((p.topic, p.index, p.topic_id))
            d = topic_dir(self.data_dir, p.topic, p.topic_id) / f"p{p.index:05d}"
            try:
                aside = await self.loop.run_in_executor(self.io, TR.moved_aside, d, token)
            except OSError as e:
                log.error("could not set a moved partition's directory aside", extra={
                    "topic": p.topic, "partition": p.index, "err": str(e)})
                continue
            log.info("partition moved to another node; its old copy set aside", extra={
                "topic": p.topic, "partition": p.index, "owner": node, "dir": str(aside)})

    def forget_partition(self, name: str, index: int, topic_id: str) -> None:
        """Before and after a move installs a partition here: nothing of an older
        copy stays in memory (an open object, the drained mark, cached gauges)."""
        p = self.partitions.get((name, index))
        if p is not None and not p.leases and not p._committing:
            del self.partitions[(name, index)]
            p.closed = True
            with contextlib.suppress(Exception):
                p.log.close(clean=False)
        self._drained.discard((name, index, topic_id))
        self._cold_rows.pop((name, index), None)
        self._claims_loaded.discard((topic_id, index))  # (the installed copy's keys are read at open)

    async def move_status(self) -> tuple[list[Any], list[Any]]:
        """Every worker's move runners and this node's quarantined copies."""
        moves = list(self.mover.status())
        for w in range(self.workers):
            if w == self.index:
                continue
            try:
                got = await self.links.call(w, P.MoveStatusReq(), P.MoveStatusResp, timeout=1.5)
            except Exception:
                continue
            moves.extend(got.moves)
        try:
            rows = await self.loop.run_in_executor(self.io, TR.quarantined, self.data_dir / "topics")
        except OSError:
            rows = []
        quarantine = [QuarantinedCopy(kind, topic, part, str(d), size, rfc3339_ms(mtime))
                      for kind, topic, part, d, size, mtime in rows]
        return moves, quarantine

    # ---- metrics poller ------------------------------------------------------------------------------
    async def _metrics_poller(self) -> None:
        """The partition gauges every POLL_EVERY (sooner after a topic change); a
        failed pass is logged and counted, the next one runs as planned."""
        loop = self.loop
        ok = self.m.poller_last_success.labels(f"partitions-worker-{self.index}")
        last = -POLL_MIN_GAP
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poll_soon.wait(), max(0.0, last + POLL_EVERY - loop.time()))
            await asyncio.sleep(max(0.0, last + POLL_MIN_GAP - loop.time()))
            self._poll_soon.clear()
            last = loop.time()
            try:
                await self.poll_metrics()
                ok.set(time.time())
            except Exception:
                self.m.errors.labels("metrics", "poll_failed").inc()
                log.exception("partition metrics pass failed; next pass as planned")

    async def poll_metrics(self) -> None:
        """One pass: every partition this worker owns gets its gauges (open ones from
        memory, closed ones from their files at most every COLD_POLL_EVERY, on an
        I/O thread) and its series at zero; series of partitions no longer owned
        (gauges) or of topics gone (everything) are dropped."""
        with self.store.read() as r:
            topics = {t.name: t for t in r.topics()}
        now = time.monotonic()
        rows: dict[tuple[str, int], _Row] = {}
        cold: list[tuple[tuple[str, int], Path, tuple[int, int]]] = []
        for t in topics.values():
            for i in self.owned(t):
                key = (t.name, i)
                p = self.partitions.get(key)
                if p is not None and p.topic_id == t.id and not p.closed:
                    rows[key] = _open_row(p)
                    continue
                c = self._cold_rows.get(key)
                if c is not None and c[0] == t.id and now - c[1] < COLD_POLL_EVERY:
                    rows[key] = c[2]
                else:
                    prev = c[2].age_at if c is not None and c[0] == t.id else (-1, 0)
                    cold.append((key, topic_dir(self.data_dir, t.name, t.id) / f"p{i:05d}", prev))
        if cold:
            got = await self.loop.run_in_executor(self.io, _cold_rows_many, [(d, prev) for _, d, prev in cold])
            for (key, _d, _prev), row in zip(cold, got, strict=True):
                t = topics[key[0]]
                self._cold_rows[key] = (t.id, now, row)
                rows[key] = row
        for key in [k for k in self._cold_rows if k not in rows]:
            del self._cold_rows[key]
        self._set_gauges(topics, rows)

    def _set_gauges(self, topics: dict[str, TopicRecord], rows: dict[tuple[str, int], _Row]) -> None:
        m = self.m
        now_ms = time.time() * 1000
        alive: set[tuple[str, str]] = set()
        sizes: dict[str, float] = {}
        per_part = (m.messages_produced, m.bytes_produced, m.messages_consumed, m.bytes_consumed,
                    m.corrupt_skipped, m.consumer_dropped)
        for (name, i), row in rows.items():
            lbl = (name, str(i))
            alive.add(lbl)
            m.consumer_lag.labels(*lbl).set(row.lag)
            m.oldest_unconsumed.labels(*lbl).set(
                round(max(0.0, (now_ms - row.age_at[1]) / 1000), 3) if row.lag > 0 and row.age_at[0] >= 0 else 0)
            m.inflight_size.labels(*lbl).set(row.in_flight)
            m.acked_ahead_size.labels(*lbl).set(row.acked_ahead)
            m.partition_bytes.labels(*lbl).set(row.size)
            m.segments.labels(*lbl).set(row.segments)
            for c in per_part:
                c.labels(*lbl)
            m.fsync_seconds.labels(*lbl)
            m.retention_deleted.labels(*lbl, "age")
            m.retention_bytes_deleted.labels(*lbl, "age")
            sizes[name] = sizes.get(name, 0) + row.size
        for name, size in sizes.items():
            m.topic_bytes.labels(name).set(size)
            for c in (m.ack_extended, m.nacks, m.consume_empty):
                c.labels(name)
            m.produce_rejections.labels(name, "schema")
            for o in WAIT_OUTCOMES:
                m.consume_wait.labels(name, o)
        m.partitions_total.set(len(rows))
        for g in (m.consumer_lag, m.oldest_unconsumed, m.inflight_size, m.acked_ahead_size, m.partition_bytes,
                  m.segments):
            metrics.drop_children(g, lambda k: k not in alive)
        metrics.drop_children(m.topic_bytes, lambda k: k[0] not in sizes)

        def part_gone(k: tuple[str, ...]) -> bool:
            t = topics.get(k[0])
            return t is None or not k[1].isdigit() or int(k[1]) >= t.partitions

        dropped = 0
        for c in (*per_part, m.fsync_seconds, m.retention_deleted, m.retention_bytes_deleted, m.idem_duplicates,
                  m.idem_evicted):
            dropped += metrics.drop_children(c, part_gone)
        for c in (m.ack_extended, m.nacks, m.consume_empty, m.produce_rejections, m.consume_wait,
                  m.messages_accepted, m.dead_lettered, m.dead_letter_failures, m.dead_letter_held, m.redriven):
            dropped += metrics.drop_children(c, lambda k: k[0] not in topics)
        if dropped:
            self._m_cons.clear()
            self._m_wait.clear()

    def health(self) -> dict[str, Any]:
        return {"wal_failed": self.wal.failed is not None, "backlog": self.wal.backlog,
                "partitions": len(self.partitions)}


WAIT_OUTCOMES = ("hit", "timeout", "cancelled", "no_wait")


class _Row:
    """One partition's gauges as the poller read them."""

    __slots__ = ("acked_ahead", "age_at", "in_flight", "lag", "segments", "size")

    def __init__(self, lag: int, in_flight: int, acked_ahead: int, segments: int, size: int,
                 age_at: tuple[int, int]) -> None:
        self.lag, self.in_flight, self.acked_ahead = lag, in_flight, acked_ahead
        self.segments, self.size = segments, size
        self.age_at = age_at  # (offset of the oldest unacked record, its committed-at ms); offset -1: none


def _open_row(p: Partition) -> _Row:
    ms = p.oldest_unacked_ms()
    lg = p.log
    return _Row(max(0, lg.hwm - 1 - p.committed), len(p.leases), len(p.acked_ahead), len(lg.segments),
                lg.size_bytes(), p.age_at if ms is not None else (-1, 0))


def _cold_rows_many(dirs: list[tuple[Path, tuple[int, int]]]) -> list[_Row]:
    """I/O thread: the gauges of closed partitions from their files; the oldest
    unacked record's time is read again only when its offset differs from `prev`."""
    out = []
    for d, prev in dirs:
        try:
            st = stats_from_disk(d)
        except OSError:
            out.append(_Row(0, 0, 0, 0, 0, (-1, 0)))
            continue
        age_at = (-1, 0)
        if st["lag"] > 0:
            off = max(st["committed_offset"] + 1, st["oldest_offset"])
            if prev[0] == off:
                age_at = prev
            else:
                with contextlib.suppress(OSError):
                    ms = PL.record_ms_on_disk(d, off)
                    if ms is not None:
                        age_at = (off, ms)
        out.append(_Row(st["lag"], 0, st["acked_ahead"], st["segments"], st["size_bytes"], age_at))
    return out


def _item(partition: int, offset: int, nonce: int, rec: Any) -> P.Item:
    return P.Item(partition, offset, nonce, rec[0], rec[1], rec[2], rec[3])


async def _share(fut: asyncio.Future[list[P.Item]]) -> P.ConsumeResp:
    return P.ConsumeResp(await asyncio.shield(fut))


def _wake_false(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(False)


def _writeout_all(parts: list[Partition], level: list[tuple[Partition, int]]) -> None:
    for p in parts:
        try:
            p.offsets.writeout()
        except OSError as e:
            log.error("consumer offset fsync failed; rewriting next tick", extra={"topic": p.topic, "err": str(e)})
            p.dirty = True
    for p, frontier in level:
        if frontier >= 0 and not p.closed:
            try:
                p.offsets.level(frontier)
            except OSError as e:
                log.error("consumer.offset levelling failed", extra={"topic": p.topic, "err": str(e)})


def max_open_logs() -> int:
    """Partition logs a worker keeps open at most (two descriptors each: the active
    segment and consumer.ahead): 512, fewer under a low descriptor limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, min(512, soft // 8))


def _metric(reg: metrics.Registry, cls: Any, name: str, help: str) -> Any:
    got = reg.metrics.get(name)
    return got if got is not None else reg.add(cls(name, help))


def _stats_from_disk_many(base: Path, parts: list[int]) -> dict[int, dict[str, int]]:
    return {i: stats_from_disk(base / f"p{i:05d}") for i in parts}


def _list_dirs(root: Path) -> list[str]:
    try:
        with os.scandir(root) as it:
            return [e.name for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _expired_dirs(dirs: list[tuple[Path, int]], now_ms: int) -> list[int]:
    out = []
    for k, (d, retention_ms) in enumerate(dirs):
        try:
            if PL.expired_on_disk(d, retention_ms, now_ms):
                out.append(k)
        except OSError as e:
            log.warning("cold retention walk could not read a partition directory", extra={"dir": str(d),
                                                                                         "err": str(e)})
    return out


def _remove_partition_dir(d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)
    parent = d.parent
    with contextlib.suppress(OSError):
        parent.rmdir()  # the topic directory, once its last partition is gone
