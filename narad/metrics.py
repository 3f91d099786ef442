"""Prometheus metrics of every narad process, merged across processes.

prometheus_client runs in multiprocess mode: each process writes its samples
into files under ``<runtime>/metrics`` (memory-mapped), and ``/metrics`` on
any worker reads every file, so the scrape shows the whole node. ``setup()``
must run in each process before metrics are used (the supervisor calls it
before forking; forked workers inherit it). Bottom layer: imports no narad
module.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import prometheus_client
import prometheus_client.values
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess

_dir: str | None = None


class _Metrics:
    def __init__(self) -> None:
        self.http_requests = Counter("narad_http_requests_total", "HTTP requests", ["route", "method", "status"])
        self.http_duration = Histogram(
            "narad_http_request_duration_seconds", "HTTP request latency", ["route", "method"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.http_bytes_in = Counter("narad_http_request_bytes_in_total", "request body bytes", ["route"])
        self.http_bytes_out = Counter("narad_http_response_bytes_out_total", "response body bytes", ["route"])
        self.raft_state = Gauge("narad_raft_state", "1 for the node's Raft role", ["state"],
                                multiprocess_mode="mostrecent")
        self.raft_has_leader = Gauge("narad_raft_has_leader", "1 when a Raft leader is known",
                                     multiprocess_mode="mostrecent")
        self.raft_term = Gauge("narad_raft_term", "Raft term", multiprocess_mode="mostrecent")
        self.raft_commit = Gauge("narad_raft_commit_index", "Raft commit index", multiprocess_mode="mostrecent")
        self.raft_applied = Gauge("narad_raft_applied_index", "index applied to the metastore",
                                  multiprocess_mode="mostrecent")
        self.topics_total = Gauge("narad_topics_total", "topics in the cluster", multiprocess_mode="mostrecent")
        self.meta_write_seconds = Histogram("narad_metastore_write_seconds", "metadata write latency", ["op"])
        self.meta_writes = Counter("narad_metastore_writes_total", "metadata writes", ["op", "outcome"])
        self.worker_restarts = Counter("narad_worker_restarts_total", "worker processes restarted")
        self.workers_alive = Gauge("narad_workers_alive", "worker processes running", multiprocess_mode="mostrecent")
        self.auth_failures = Counter("narad_auth_failures_total", "failed authentications", ["reason"])
        self.errors = Counter("narad_errors_total", "errors by area", ["component", "kind"])
        self.snapshot_failures = Counter("narad_metastore_snapshot_failures_total", "failed Raft snapshots")
        self.ready = Gauge("narad_ready", "1 when /readyz answers ready", multiprocess_mode="mostrecent")


M: Any = None


def setup(metrics_dir: Path | None, *, wipe: bool = False) -> Any:
    """Point prometheus_client at the node's shared metrics directory and
    create the metric objects of this process."""
    global M, _dir
    if metrics_dir is not None:
        if wipe and metrics_dir.exists():
            shutil.rmtree(metrics_dir)
        metrics_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        _dir = str(metrics_dir)
    # The value class is chosen from the environment; re-read it now.
    prometheus_client.values.ValueClass = prometheus_client.values.get_value_class()
    prometheus_client.REGISTRY.__init__(auto_describe=True)  # forget metrics inherited through fork
    M = _Metrics()
    return M


def get() -> Any:
    global M
    if M is None:
        M = setup(None)
    return M


def mark_process_dead(pid: int) -> None:
    if _dir is not None:
        multiprocess.mark_process_dead(pid, _dir)


def exposition() -> bytes:
    if _dir is None:
        return prometheus_client.generate_latest()
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=_dir)
    return prometheus_client.generate_latest(registry)


CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
