"""Metrics of every narad process, merged per node at scrape time.

Each process keeps plain in-memory counters, gauges and histograms (an
increment is a dict lookup and an add: a few hundred ns, cheap enough for the
per-request path; prometheus_client's multiprocess mode cost ~12 us per
request). ``/metrics`` on any worker asks the supervisor, which gathers a
``snapshot()`` from every live worker and itself, adds the counters of
workers that died since start (so node totals never go backwards because a
worker restarted), merges, and the worker renders the Prometheus text format
with prometheus_client. Counters and histograms are summed across processes;
gauges are summed too (node-level gauges are set by the supervisor only).

Bottom layer: imports no narad module.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.process_collector import ProcessCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 20, 30)
PART = ("topic", "partition")  # the labels of a partition's series
# narad_errors_total{component,kind}: every pair some process counts, present at zero
ERROR_KINDS = (("storage", "commit_failed"), ("storage", "fsync_poisoned"), ("storage", "offset_write_failed"),
               ("wal", "write_failed"), ("http", "internal"), ("metastore", "snapshot_failed"),
               ("metastore", "fail_stop"), ("metrics", "poll_failed"), ("broker", "housekeeping_failed"),
               ("broker", "direct_hop_unknown"))
SCHEMA_REJECTION_REASONS = ("depth", "malformed", "invalid", "busy", "canceled")
AUTH_FAILURE_REASONS = ("bad_password",)


class Family(msgspec.Struct, array_like=True):
    name: str
    kind: str  # counter | gauge | histogram
    help: str
    labelnames: list[str]
    buckets: list[float]
    # label values -> value (counter/gauge) or [sum, count, *bucket counts] (histogram)
    samples: list[tuple[list[str], list[float]]]


class _Child:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class _HistChild:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


class _Metric:
    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = (), buckets: Sequence[float] = ()) -> None:
        self.name = name
        self.help = help
        self.labelnames = list(labelnames)
        self.buckets = tuple(buckets)
        self.children: dict[tuple[str, ...], Any] = {}
        if not self.labelnames:
            self.children[()] = self._new()  # present at zero from the start

    def _new(self) -> Any:
        return _Child()

    def labels(self, *values: str) -> Any:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}")
            child = self.children[values] = self._new()
        return child

    # label-less metrics act as their own single child
    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self.labels().dec(amount)

    def set(self, value: float) -> None:
        self.labels().set(value)

    def observe(self, value: float) -> None:
        self.labels().observe(value)

    def family(self) -> Family:
        samples: list[tuple[list[str], list[float]]] = []
        for key, child in self.children.items():
            if isinstance(child, _HistChild):
                samples.append((list(key), [child.sum, float(child.count), *map(float, child.counts)]))
            else:
                samples.append((list(key), [child.value]))
        return Family(self.name, self.kind, self.help, self.labelnames, list(self.buckets), samples)


class Counter(_Metric):
    kind = "counter"


class Gauge(_Metric):
    kind = "gauge"


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = (),
                 buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        super().__init__(name, help, labelnames, buckets)

    def _new(self) -> Any:
        return _HistChild(self.buckets)


class Registry:
    def __init__(self) -> None:
        self.metrics: dict[str, _Metric] = {}

    def add(self, m: _Metric) -> Any:
        self.metrics[m.name] = m
        return m

    def snapshot(self) -> list[Family]:
        return [m.family() for m in self.metrics.values()]


class _Metrics:
    """Every metric of the node; each process touches the ones it owns."""

    def __init__(self, reg: Registry) -> None:
        a = reg.add
        self.http_requests = a(Counter("narad_http_requests_total", "HTTP requests", ["route", "method", "status"]))
        self.http_request_duration = a(Histogram("narad_http_request_duration_seconds", "HTTP request latency",
                                                 ["route", "method", "status"]))
        self.http_in_flight = a(Gauge("narad_http_requests_in_flight", "requests being served"))
        self.http_bytes_in = a(Counter("narad_http_request_bytes_in_total", "request body bytes received",
                                       ["route"]))
        self.http_bytes_out = a(Counter("narad_http_response_bytes_out_total", "response body bytes sent",
                                        ["route"]))
        self.raft_state = a(Gauge("narad_raft_state", "1 for the node's Raft role", ["state"]))
        self.raft_has_leader = a(Gauge("narad_raft_has_leader", "1 when a Raft leader is known"))
        self.raft_term = a(Gauge("narad_raft_term", "Raft term"))
        self.raft_commit = a(Gauge("narad_raft_commit_index", "Raft commit index"))
        self.raft_applied = a(Gauge("narad_raft_applied_index", "index applied to the metastore"))
        self.topics_total = a(Gauge("narad_topics_total", "topics in the cluster"))
        self.meta_write_seconds = a(Histogram("narad_metastore_write_seconds",
                                              "metadata writes: proposal to local commit (the leader's or a "
                                              "follower's forwarded write), by operation", ["op"]))
        self.worker_restarts = a(Counter("narad_worker_restarts_total", "worker processes restarted"))
        self.workers_alive = a(Gauge("narad_workers_alive", "worker processes running"))
        self.worker_stuck_restarts = a(Counter("narad_worker_stuck_restarts_total",
                                               "workers killed and restarted because their event loop stopped"))
        self.forkserver_restarts = a(Counter("narad_forkserver_restarts_total",
                                             "fork servers lost (killed, crashed or stuck) and replaced"))
        self.heartbeat_age = a(Gauge("narad_heartbeat_age_seconds",
                                     "seconds since a process's loop last stamped its heartbeat", ["process"]))
        self.auth_failures = a(Counter("narad_auth_failures_total", "failed authentications", ["reason"]))
        self.errors = a(Counter("narad_errors_total", "errors by area", ["component", "kind"]))
        self.snapshot_failures = a(Counter("narad_metastore_snapshot_failures_total", "failed Raft snapshots"))
        self.snapshots_taken = a(Gauge("narad_metastore_snapshots_taken", "Raft snapshots this process wrote"))
        self.fsm_bytes = a(Gauge("narad_metastore_fsm_bytes",
                                 "size of the metastore database file (a snapshot needs this much free disk)"))
        self.raft_log_entries = a(Gauge("narad_raft_log_entries", "entries in the Raft log since the last snapshot"))
        self.ready = a(Gauge("narad_ready", "1 when /readyz answers ready"))
        self.messages_produced = a(Counter("narad_messages_produced_total",
                                           "messages appended to the partition, counted at its owner",
                                           PART))
        self.bytes_produced = a(Counter("narad_bytes_produced_total", "payload bytes appended, at the owner", PART))
        self.messages_accepted = a(Counter("narad_messages_accepted_total", "messages made durable in the WAL (202)",
                                           ["topic"]))
        self.messages_consumed = a(Counter("narad_messages_consumed_total",
                                           "deliveries to queue consumers (redeliveries count again; replays "
                                           "do not), counted at the worker answering the consume", PART))
        self.bytes_consumed = a(Counter("narad_bytes_consumed_total", "payload bytes delivered to queue consumers",
                                        PART))
        self.consume_wait = a(Histogram("narad_consume_wait_seconds",
                                        "how long a consume waited (outcome hit, timeout, cancelled, no_wait)",
                                        ["topic", "outcome"], buckets=WAIT_BUCKETS))
        # Idempotent produce (issue 14), at the partition's owner.
        self.idem_duplicates = a(Counter("narad_idempotent_duplicates_total",
                                         "records dropped at commit as repeats of an idempotency key within the "
                                         "topic's window", PART))
        self.idem_evicted = a(Counter("narad_idempotency_keys_evicted_total",
                                      "idempotency keys dropped from the node's claims table before their window "
                                      "passed, to make room for a key committed at this partition", PART))
        # The node's shared-memory claims table (narad.broker.idem_claims), read by the supervisor.
        self.idem_table_keys = a(Gauge("narad_idempotency_table_keys",
                                       "idempotency keys the node's claims table holds within their window"))
        self.idem_table_pending = a(Gauge("narad_idempotency_table_pending",
                                          "claims in the node's table whose commit is not settled"))
        self.idem_table_capacity = a(Gauge("narad_idempotency_table_capacity", "keys the node's claims table holds"))
        self.idem_table_evicted = a(Gauge("narad_idempotency_table_evicted_total",
                                          "keys the node's claims table dropped before their window passed (a full "
                                          "bucket), since the node started"))
        self.produce_rejections = a(Counter("narad_produce_rejections_total", "produces refused before storage",
                                            ["topic", "reason"]))
        self.ack_extended = a(Counter("narad_ack_extended_total", "lease extensions", ["topic"]))
        self.nacks = a(Counter("narad_nack_total", "nacks", ["topic"]))
        # Dead-lettering (issue 14): labelled with the source topic (redriven: the dead-letter topic).
        self.dead_lettered = a(Counter("narad_dead_lettered_total",
                                       "records past max_deliveries committed to the dead-letter topic and "
                                       "settled in the source", ["topic"]))
        self.task_failures = a(Counter("narad_worker_task_failures_total",
                                       "exceptions a worker's background loop let out (a bug); the loop is "
                                       "started again after a pause and /readyz names it for 10 s", ["task"]))
        self.dead_letter_failures = a(Counter("narad_dead_letter_failures_total",
                                              "dead-letter commits that failed (the records stay held and are "
                                              "retried every second)", ["topic"]))
        self.dead_letter_held = a(Gauge("narad_dead_letter_held",
                                        "records past max_deliveries held for the dead-letter topic (not "
                                        "delivered, not yet committed there)", ["topic"]))
        self.redriven = a(Counter("narad_redriven_total", "records a redrive produced back to their origin topic",
                                  ["topic"]))
        self.consume_empty = a(Counter("narad_consume_empty_total", "consumes answered with nothing", ["topic"]))
        self.consume_waiters = a(Gauge("narad_consume_waiters", "long polls parked, waiting for records"))
        self.wal_failed = a(Gauge("narad_ingress_wal_failed", "1 while produce is latched off by a WAL failure"))
        self.dispatch_backlog = a(Gauge("narad_ingress_dispatch_backlog_records",
                                        "accepted records not yet confirmed at their owner"))
        self.idem_sealed = a(Counter("narad_idempotency_sealed_refusals_total",
                                     "batches refused because an idempotency key's partition is being moved off "
                                     "this node and its keys are carried away (the record goes to the new owner)"))
        self.dispatch_rehomed = a(Counter("narad_ingress_dispatch_rehomed_total",
                                          "idempotent records this node placed away from their key's partition "
                                          "and sent there instead (the node may no longer commit them where "
                                          "placed: the key's partition moved, or the placed one did)"))
        self.wal_pending = a(Gauge("narad_ingress_wal_pending_records",
                                   "produced records not yet durable (produce in flight): staged in the ingress "
                                   "WAL, or in a direct commit"))
        self.retention_deleted = a(Counter("narad_storage_retention_messages_deleted_total",
                                           "messages deleted by retention", [*PART, "reason"]))
        self.retention_bytes_deleted = a(Counter("narad_storage_retention_bytes_deleted_total",
                                                 "segment bytes deleted by retention", [*PART, "reason"]))
        self.fsync_seconds = a(Histogram("narad_storage_fsync_duration_seconds",
                                         "partition commit sync time (its round's fdatasync or syncfs)", PART))
        # Partition gauges: set by the owning worker's poller (every 5 s; closed partitions
        # from their files every 30 s).
        self.consumer_lag = a(Gauge("narad_consumer_lag_messages", "high watermark minus the committed frontier",
                                    PART))
        self.oldest_unconsumed = a(Gauge("narad_oldest_unconsumed_message_age_seconds",
                                         "age of the oldest message not acked yet (0 when none)", PART))
        self.inflight_size = a(Gauge("narad_inflight_size", "leases out", PART))
        self.acked_ahead_size = a(Gauge("narad_acked_ahead_size", "acks held above the frontier", PART))
        self.partition_bytes = a(Gauge("narad_partition_size_bytes", "bytes of the partition's segments", PART))
        self.segments = a(Gauge("narad_segments", "segment files of the partition", PART))
        self.topic_bytes = a(Gauge("narad_topic_bytes", "bytes of the topic's segments on this node", ["topic"]))
        self.partitions_total = a(Gauge("narad_partitions_total", "partitions this node owns"))
        self.corrupt_skipped = a(Counter("narad_consumer_corrupt_skipped_total",
                                         "unreadable records the frontier skipped (loss)", PART))
        self.data_dir_size = a(Gauge("narad_data_dir_size_bytes", "bytes used by the data directory"))
        self.data_dir_available = a(Gauge("narad_data_dir_available_bytes",
                                          "bytes free for this process on the data directory's filesystem"))
        self.poller_last_success = a(Gauge("narad_poller_last_success_timestamp_seconds",
                                           "when a metrics poller last finished a pass (unix seconds)", ["loop"]))
        self.boot_duration = a(Gauge("narad_boot_duration_seconds",
                                     "seconds from process start to the node being ready the first time"))
        self.build_info = a(Gauge("narad_build_info", "1, labelled with this build", ["version", "python"]))
        self.auth_verify_queued = a(Gauge("narad_auth_verify_queued", "bcrypt checks queued or running"))
        self.member_heartbeat_failures = a(Counter("narad_member_heartbeat_failures",
                                                   "member heartbeats that could not be written"))
        self.cluster_rpc = a(Counter("narad_cluster_rpc_requests_total",
                                     "node-to-node calls sent, by operation and outcome (ok, rejected, failed, "
                                     "timeout, error); notes count as ok when sent", ["op", "outcome"]))
        self.node_rpc_served = a(Counter("narad_node_rpc_served_total", "node RPC requests and notes handled",
                                         ["op"]))
        self.worker_hops = a(Counter("narad_worker_hops_total",
                                     "calls and notes a worker sent to another worker of its node (a hop), by "
                                     "message type", ["op"]))
        self.schema_seconds = a(Histogram("narad_schema_validation_seconds",
                                          "payload schema checks (bounded validations), per request"))
        self.schema_in_flight = a(Gauge("narad_schema_validations_in_flight",
                                        "validation-thread slots in use"))
        self.schema_rejections = a(Counter("narad_schema_rejections_total", "why a schema check refused",
                                           ["reason"]))
        self.consumer_dropped = a(Gauge("narad_consumer_dropped_messages",
                                        "messages the frontier passed without an ack (retention, corruption): "
                                        "data loss, counted by the owning worker since it started", PART))
        # Fan-out (set by the worker owning the parent partition; labels name topics, not "topic").
        self.fanout_lag = a(Gauge("narad_fanout_lag_messages", "parent high watermark minus the child cursor",
                                  ["parent", "child", "partition"]))
        self.fanout_due_lag = a(Gauge("narad_fanout_due_lag_seconds",
                                      "how far a child cursor is behind its due records (delay children: "
                                      "committed-at + delay)", ["parent", "child", "partition"]))
        self.fanout_committed = a(Counter("narad_fanout_committed_total", "copies committed at child partitions",
                                          ["parent", "child"]))
        self.fanout_dropped = a(Counter("narad_fanout_child_dropped_messages",
                                        "parent records never copied: aged out of parent retention before the "
                                        "cursor read them, or unreadable (loss)", ["parent", "child"]))
        # Partition moves (issue 13): destination runners, the source's freezes, the leader's view.
        self.move_copied = a(Counter("narad_move_copied_bytes_total",
                                     "bytes copied by this node's move runners (it is their destination)"))
        self.moves_finished = a(Counter("narad_moves_finished_total",
                                        "moves this node received or abandoned, by outcome (done: flipped after "
                                        "a freeze; forced: force-promoted from a dead source; abandoned: the "
                                        "target was cleared)", ["outcome"]))
        self.moves_running = a(Gauge("narad_moves_in_flight", "move runners on this node (it is their destination)"))
        self.moves_blocked = a(Gauge("narad_moves_blocked",
                                     "move runners blocked, by reason (copy_unverifiable, source_dead_copy_behind)",
                                     ["reason"]))
        self.move_freezes = a(Counter("narad_move_freezes_total",
                                      "partitions this node froze as a move's source (refreezes included)"))
        self.quarantined = a(Gauge("narad_quarantined_copies",
                                   "partition copies this node set aside (quarantine), never deleted: look at them"))
        self.decommission_blocked = a(Gauge("narad_decommission_blocked",
                                            "the leader's view: a draining member's removal waits for this reason",
                                            ["node", "reason"]))
        for outcome in ("done", "forced", "abandoned"):
            self.moves_finished.labels(outcome)
        for reason in ("copy_unverifiable", "source_dead_copy_behind"):
            self.moves_blocked.labels(reason)
        for labels in ERROR_KINDS:
            self.errors.labels(*labels)
        for reason in SCHEMA_REJECTION_REASONS:
            self.schema_rejections.labels(reason)
        for reason in AUTH_FAILURE_REASONS:
            self.auth_failures.labels(reason)


_registry = Registry()
M: Any = None


def setup() -> Any:
    """Fresh metrics for this process (a forked worker starts from zero)."""
    global M, _registry
    _registry = Registry()
    M = _Metrics(_registry)
    return M


def get() -> Any:
    if M is None:
        setup()
    return M


def registry() -> Registry:
    get()
    return _registry


def snapshot() -> list[Family]:
    return registry().snapshot()


def merge(snapshots: Iterable[list[Family]], *, only_counters: bool = False) -> list[Family]:
    """Sum families of several processes (counters, histograms; gauges unless
    ``only_counters``)."""
    out: dict[str, Family] = {}
    acc: dict[str, dict[tuple[str, ...], list[float]]] = {}
    for snap in snapshots:
        for fam in snap:
            if only_counters and fam.kind == "gauge":
                continue
            if fam.name not in out:
                out[fam.name] = Family(fam.name, fam.kind, fam.help, fam.labelnames, fam.buckets, [])
                acc[fam.name] = {}
            into = acc[fam.name]
            for labels, vals in fam.samples:
                key = tuple(labels)
                cur = into.get(key)
                if cur is None:
                    into[key] = list(vals)
                else:
                    for i, v in enumerate(vals):
                        cur[i] += v
    for name, fam in out.items():
        fam.samples = [(list(k), v) for k, v in acc[name].items()]
    return list(out.values())


class _Collector:
    def __init__(self, families: list[Family]) -> None:
        self.families = families

    def collect(self) -> Iterable[Any]:
        for fam in self.families:
            if fam.kind == "counter" and not fam.name.endswith("_total"):
                # Narad's name has no _total suffix (narad_fanout_child_dropped_messages):
                # the sample keeps Narad's name; prometheus_client's text format would add
                # _total to a counter's, so it is typed untyped (rate() works the same).
                raw = Metric(fam.name, fam.help, "unknown")
                for labels, vals in fam.samples:
                    raw.add_sample(fam.name, dict(zip(fam.labelnames, labels, strict=False)), vals[0])
                yield raw
            elif fam.kind == "counter":
                c = CounterMetricFamily(fam.name[:-6], fam.help, labels=fam.labelnames)
                for labels, vals in fam.samples:
                    c.add_metric(labels, vals[0])
                yield c
            elif fam.kind == "gauge":
                g = GaugeMetricFamily(fam.name, fam.help, labels=fam.labelnames)
                for labels, vals in fam.samples:
                    g.add_metric(labels, vals[0])
                yield g
            else:
                h = HistogramMetricFamily(fam.name, fam.help, labels=fam.labelnames)
                for labels, vals in fam.samples:
                    total, _count, counts = vals[0], vals[1], vals[2:]
                    cum, buckets = 0.0, []
                    for bound, n in zip([*fam.buckets, math.inf], counts, strict=False):
                        cum += n
                        buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cum))
                    h.add_metric(labels, buckets, total)
                yield h


def process_families(pids: dict[str, int]) -> list[Family]:
    """``process_*`` series (prometheus_client's process collector, read from
    /proc/<pid>) of each named process, labelled ``process``: the supervisor
    reads them for every process of the node at scrape time, so no process
    does any work for them between scrapes."""
    out: dict[str, Family] = {}
    for name, pid in pids.items():
        if pid <= 0:
            continue
        try:
            fams = list(ProcessCollector(pid=lambda pid=pid: pid, registry=None).collect())  # type: ignore[misc]
        except Exception:
            continue  # the process is gone (or /proc unreadable): no series for it
        for mf in fams:
            for smp in mf.samples:
                fam = out.get(smp.name)
                if fam is None:
                    kind = "counter" if mf.type == "counter" else "gauge"
                    fam = out[smp.name] = Family(smp.name, kind, mf.documentation, ["process"], [], [])
                fam.samples.append(([name], [float(smp.value)]))
    return list(out.values())


_OPS: dict[type, str] = {}


def op_label(typ: type) -> str:
    """A request type's ``op`` label: ``AckReq`` -> ``ack``, ``FanoutLagReq`` -> ``fanout_lag``,
    ``CreateTopicReq`` -> ``create_topic``."""
    name = _OPS.get(typ)
    if name is None:
        base = typ.__name__
        for suffix in ("Req", "Note", "Request"):
            if base.endswith(suffix) and len(base) > len(suffix):
                base = base[: -len(suffix)]
                break
        name = _OPS[typ] = "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(base))
    return name


def drop_children(m: _Metric, gone: Callable[[tuple[str, ...]], bool]) -> int:
    """Remove the children whose label values `gone` accepts (series of topics or
    partitions that no longer exist); returns how many."""
    dead = [k for k in m.children if gone(k)]
    for k in dead:
        del m.children[k]
    return len(dead)


class HttpObserver:
    """The request observer of a worker's app (``RoutedApp.observer``): per answered
    request one dict lookup and four adds (requests, latency by route, method and
    status, bytes in and out by route) and the in-flight gauge down by one
    (``narad.worker.http_metrics`` counts it up where a request starts; an app
    served without it, as in-process tests build one, leaves the gauge alone)."""

    def __init__(self, in_flight: bool = False) -> None:
        self.m = get()
        self.in_flight = self.m.http_in_flight.labels() if in_flight else _Unused()
        self._children: dict[tuple[str, str, int], tuple[Any, Any, Any, Any]] = {}

    def observe(self, route: str, method: str, status: int, seconds: float, bytes_in: int, bytes_out: int) -> None:
        key = (route, method, status)
        c = self._children.get(key)
        if c is None:
            if len(self._children) > 10_000:
                self._children.clear()
            m, st = self.m, str(status)
            c = self._children[key] = (m.http_requests.labels(route, method, st),
                                       m.http_request_duration.labels(route, method, st),
                                       m.http_bytes_in.labels(route), m.http_bytes_out.labels(route))
        c[0].value += 1
        c[1].observe(seconds)
        c[2].value += bytes_in
        c[3].value += bytes_out
        self.in_flight.value -= 1
        if status == 500:
            self.m.errors.labels("http", "internal").inc()


class _Unused:
    """Stands in for the in-flight gauge child where nothing counts requests up."""

    value = 0.0


TOPIC_LABELS = frozenset(("topic", "parent", "child"))  # labels whose values are topic names


def filter_topics(families: list[Family], visible: Callable[[str], bool]) -> list[Family]:
    """The families with only the per-topic samples (labels ``topic``, and the
    fan-out series' ``parent`` and ``child``) whose every topic ``visible``
    accepts: /metrics follows the topic-visibility rule, so a caller learns no
    topic name it could not list."""
    out: list[Family] = []
    for fam in families:
        idx = [i for i, n in enumerate(fam.labelnames) if n in TOPIC_LABELS]
        if not idx:
            out.append(fam)
            continue
        seen: dict[str, bool] = {}
        keep = []
        for labels, vals in fam.samples:
            ok = True
            for i in idx:
                name = labels[i]
                v = seen.get(name)
                if v is None:
                    v = seen[name] = visible(name)
                if not v:
                    ok = False
                    break
            if ok:
                keep.append((labels, vals))
        out.append(Family(fam.name, fam.kind, fam.help, fam.labelnames, fam.buckets, keep))
    return out


def render(families: list[Family]) -> bytes:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(families))  # type: ignore[arg-type]
    return generate_latest(reg)


class SnapshotReq(msgspec.Struct, tag=True):
    """Supervisor -> worker: send your metrics."""


class NodeMetricsReq(msgspec.Struct, tag=True):
    """Worker -> supervisor: the node's merged metrics."""


class Snapshot(msgspec.Struct):
    families: list[Family]
