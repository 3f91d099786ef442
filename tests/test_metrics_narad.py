"""Narad's metric series on one real node (two workers, security on, the
separate metrics listener on http.metrics_addr): present at zero from the
start, moving with traffic (lag, in-flight, bytes, oldest unacked age, fsync,
sizes), the listener answering without credentials, process_* for every
process and the process titles naming each role.

One module-scoped node; the partition poller runs every 300 ms here
(NARAD_METRICS_POLL_MS, a test seam) so gauges are waited for, never slept on.
"""

from __future__ import annotations

import http.client
import re
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.harness import Node, free_ports, wait_for

OCTET = {"Content-Type": "application/octet-stream"}
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    mport = free_ports(1)[0]
    n = Node(tmp_path_factory.mktemp("metrics") / "data", workers=2,
             env={"NARAD_HTTP_METRICS_ADDR": f"127.0.0.1:{mport}", "NARAD_METRICS_POLL_MS": "300"})
    n.metrics_port = mport  # type: ignore[attr-defined]
    n.start()
    yield n
    n.close()


def listener(node: Node, method: str, path: str, headers: dict[str, str] | None = None
             ) -> tuple[int, dict[str, str], bytes]:
    c = http.client.HTTPConnection("127.0.0.1", node.metrics_port, timeout=10)  # type: ignore[attr-defined]
    try:
        c.request(method, path, headers=headers or {})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


def scrape(node: Node) -> dict[str, dict[str, float]]:
    """name -> {label string: value}, from the listener (no credentials)."""
    status, _h, body = listener(node, "GET", "/metrics")
    assert status == 200, body[:500]
    out: dict[str, dict[str, float]] = {}
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, line
        out.setdefault(m.group(1), {})[m.group(2) or ""] = float(m.group(3))
    return out


def val(s: dict[str, dict[str, float]], name: str, **labels: str) -> float | None:
    """The sample of `name` whose labels include `labels` (summed when several match)."""
    rows = s.get(name)
    if rows is None:
        return None
    want = [f'{k}="{v}"' for k, v in labels.items()]
    hits = [v for lbl, v in rows.items() if all(w in lbl for w in want)]
    return sum(hits) if hits else None


def mk(node: Node, name: str, **kw: Any) -> None:
    r = node.post("/v1/topics", {"name": name, **kw})
    assert r.status == 201, r


LABELLESS = [
    "narad_http_requests_in_flight", "narad_raft_has_leader", "narad_raft_term", "narad_topics_total",
    "narad_partitions_total", "narad_consume_waiters", "narad_ingress_wal_failed",
    "narad_ingress_dispatch_backlog_records", "narad_data_dir_size_bytes", "narad_data_dir_available_bytes",
    "narad_open_partition_logs", "narad_idle_logs_evicted_total", "narad_auth_verify_queued",
    "narad_schema_validations_in_flight", "narad_boot_duration_seconds", "narad_worker_restarts_total",
    "narad_member_heartbeat_failures", "narad_schema_validation_seconds_count",
    "narad_storage_commit_rounds_total", "narad_storage_commit_round_logs_total",
]
PER_PARTITION = [
    "narad_messages_produced_total", "narad_bytes_produced_total", "narad_messages_consumed_total",
    "narad_bytes_consumed_total", "narad_consumer_lag_messages", "narad_oldest_unconsumed_message_age_seconds",
    "narad_inflight_size", "narad_acked_ahead_size", "narad_consumer_dropped_messages",
    "narad_consumer_corrupt_skipped_total", "narad_partition_size_bytes", "narad_segments",
    "narad_storage_retention_messages_deleted_total", "narad_storage_retention_bytes_deleted_total",
]


def test_series_are_present_at_zero_from_the_start(node: Node) -> None:
    s = scrape(node)
    for name in LABELLESS:
        assert name in s, name
    assert val(s, "narad_errors_total", component="storage", kind="fsync_poisoned") == 0
    assert val(s, "narad_errors_total") == 0
    assert val(s, "narad_schema_rejections_total", reason="busy") == 0
    assert val(s, "narad_build_info", version="0.1.0") == 1
    assert (val(s, "narad_boot_duration_seconds") or 0) > 0
    assert (val(s, "narad_data_dir_available_bytes") or 0) > 0
    for loop in ("vitals", "partitions-worker-0", "partitions-worker-1"):
        assert (val(s, "narad_poller_last_success_timestamp_seconds", loop=loop) or 0) > time.time() - 60
    # A new topic's series appear at its owners, at zero, before any traffic.
    mk(node, "zero", partitions=3)

    def every_partition() -> dict[str, dict[str, float]] | None:
        s = scrape(node)
        ok = all(val(s, n, topic="zero", partition=str(p)) == 0 for n in PER_PARTITION for p in range(3))
        return s if ok else None

    s = wait_for(every_partition, 15, 0.1, "the new topic's series at zero")
    assert val(s, "narad_topic_bytes", topic="zero") == 0
    assert val(s, "narad_storage_fsync_duration_seconds_count", topic="zero", partition="2") == 0
    for outcome in ("hit", "timeout", "cancelled", "no_wait"):
        assert val(s, "narad_consume_wait_seconds_count", topic="zero", outcome=outcome) == 0, outcome
    for name in ("narad_ack_extended_total", "narad_nack_total", "narad_consume_empty_total"):
        assert val(s, name, topic="zero") == 0, name
    assert val(s, "narad_partitions_total") == 3
    # ... and go when it is deleted.
    assert node.request("DELETE", "/v1/topics/zero").status == 204
    wait_for(lambda: 'topic="zero"' not in listener(node, "GET", "/metrics")[2].decode(), 15, 0.1,
             "the deleted topic's series to go")


def test_listener_needs_no_credentials_and_answers_like_the_api_port(node: Node) -> None:
    # Readiness follows the heartbeats: on a loaded machine a loop stalled over 3 s makes the
    # node honestly not ready for a moment, so the ready answers are waited for.
    wait_for(lambda: listener(node, "GET", "/readyz")[:3:2] == (200, b'{"status":"ready"}'), 20, 0.1,
             "the listener's /readyz to answer ready")
    status, h, body = wait_for(lambda: (r := listener(node, "GET", "/metrics"))[0] == 200
                               and b"narad_ready 1.0" in r[2] and r, 20, 0.1, "narad_ready 1 on the listener")
    assert h["content-type"].startswith("text/plain")
    assert listener(node, "GET", "/healthz")[:3:2] == (200, b'{"status":"ok"}')
    status, _h, body = listener(node, "GET", "/v1/topics")
    assert (status, body) == (404, b"404 page not found\n")
    status, h, _b = listener(node, "POST", "/metrics")
    assert status == 405 and h["allow"] == "GET, HEAD"
    status, h, body = listener(node, "HEAD", "/metrics")
    assert status == 200 and body == b"" and int(h["content-length"]) > 0
    # Keep-alive: two requests on one connection.
    c = http.client.HTTPConnection("127.0.0.1", node.metrics_port, timeout=10)  # type: ignore[attr-defined]
    try:
        for _ in range(2):
            c.request("GET", "/healthz")
            r = c.getresponse()
            assert r.status == 200 and r.read() == b'{"status":"ok"}'
    finally:
        c.close()
    # Garbage is a 400 and a closed connection, never a crash.
    import socket

    with socket.create_connection(("127.0.0.1", node.metrics_port), timeout=10) as sk:  # type: ignore[attr-defined]
        sk.sendall(b"NONSENSE\r\n\r\n")
        assert sk.recv(100).startswith(b"HTTP/1.1 400")
    assert listener(node, "GET", "/healthz")[0] == 200


def test_traffic_moves_the_series(node: Node) -> None:
    mk(node, "flow", partitions=3)
    body = b"x" * 100
    for _ in range(10):
        assert node.request("POST", "/v1/topics/flow/produce?partition=1", body, headers=OCTET).status == 202
    # Five leased (not acked): in flight, lag 10, the oldest unacked ages.
    leased = []
    for _ in range(5):
        r = node.get("/v1/topics/flow/consume?wait=5s&partition=1")
        assert r.status == 200, r
        leased.append(r.json())
    t_leased = time.monotonic()

    def moved() -> dict[str, dict[str, float]] | None:
        s = scrape(node)
        p1 = {"topic": "flow", "partition": "1"}
        ok = (val(s, "narad_messages_produced_total", **p1) == 10
              and val(s, "narad_bytes_produced_total", **p1) == 1000
              and val(s, "narad_messages_consumed_total", **p1) == 5
              and val(s, "narad_bytes_consumed_total", **p1) == 500
              and val(s, "narad_consumer_lag_messages", **p1) == 10
              and val(s, "narad_inflight_size", **p1) == 5
              and (val(s, "narad_oldest_unconsumed_message_age_seconds", **p1) or 0) > 0
              and (val(s, "narad_partition_size_bytes", **p1) or 0) > 1000
              and val(s, "narad_segments", **p1) == 1
              # the untouched partitions at zero (one may live on the other worker, whose
              # snapshot a scrape under load can miss: waited for, like the rest)
              and val(s, "narad_consumer_lag_messages", topic="flow", partition="0") == 0
              and val(s, "narad_consumer_lag_messages", topic="flow", partition="2") == 0)
        return s if ok else None

    s = wait_for(moved, 15, 0.1, "the partition's series to follow the traffic")
    assert (val(s, "narad_topic_bytes", topic="flow") or 0) > 1000
    assert (val(s, "narad_storage_fsync_duration_seconds_count", topic="flow", partition="1") or 0) >= 1
    # the ten commits ran in commit rounds (counted by the sweeper, every second)
    s = wait_for(lambda: s2 if (val(s2 := scrape(node), "narad_storage_commit_rounds_total") or 0) >= 1 else None,
                 10, 0.1, "commit rounds counted")
    rounds = val(s, "narad_storage_commit_rounds_total") or 0
    assert rounds <= (val(s, "narad_storage_commit_round_logs_total") or 0) <= 10 * rounds
    assert (val(s, "narad_consume_wait_seconds_count", topic="flow", outcome="hit") or 0) >= 5
    assert (val(s, "narad_metastore_write_seconds_count", op="create_topic") or 0) >= 1
    assert (val(s, "narad_http_request_bytes_in_total", route="POST /v1/topics/{topic}/produce") or 0) >= 1000
    assert (val(s, "narad_http_requests_total", route="POST /v1/topics/{topic}/produce", status="202") or 0) >= 10
    assert (val(s, "narad_http_request_duration_seconds_count", route="POST /v1/topics/{topic}/produce",
                status="202") or 0) >= 10
    age = val(s, "narad_oldest_unconsumed_message_age_seconds", topic="flow", partition="1") or 0
    assert age < time.monotonic() - t_leased + 60
    # The describe rows carry Narad's extra fields.
    rows = node.get("/v1/topics/flow").json()["partition_stats"]
    row = next(r for r in rows if r.get("index", r.get("partition")) == 1)
    assert row["status"] == "ok" and row["segments"] == 1 and row["size_bytes"] > 1000
    at = datetime.fromisoformat(row["oldest_segment_at"].replace("Z", "+00:00"))
    assert abs(at.timestamp() - time.time()) < 300
    empty = next(r for r in rows if r.get("index", r.get("partition")) == 0)
    assert "oldest_segment_at" not in empty and empty["size_bytes"] == 0
    # Acked: lag, in-flight and the age fall back to zero.
    for m in leased:
        assert node.request("POST", f"/v1/topics/flow/ack?receipt_handle={m['receipt_handle']}").status == 204
    for _ in range(5):
        m = node.get("/v1/topics/flow/consume?wait=5s&partition=1").json()
        assert node.request("POST", f"/v1/topics/flow/ack?receipt_handle={m['receipt_handle']}").status == 204
    assert node.get("/v1/topics/flow/consume?partition=1").status == 204

    def drained() -> bool:
        s = scrape(node)
        p1 = {"topic": "flow", "partition": "1"}
        return (val(s, "narad_consumer_lag_messages", **p1) == 0 and val(s, "narad_inflight_size", **p1) == 0
                and val(s, "narad_oldest_unconsumed_message_age_seconds", **p1) == 0
                and val(s, "narad_messages_consumed_total", **p1) == 10
                and (val(s, "narad_consume_wait_seconds_count", topic="flow", outcome="no_wait") or 0) >= 1)

    wait_for(drained, 15, 0.1, "lag, in-flight and age back to zero")


def test_in_flight_counts_a_parked_long_poll(node: Node) -> None:
    import threading

    mk(node, "park", partitions=3)
    out: dict[str, Any] = {}

    def poll() -> None:
        out["r"] = node.get("/v1/topics/park/consume?wait=20s")

    th = threading.Thread(target=poll)
    th.start()
    try:
        wait_for(lambda: val(scrape(node), "narad_http_requests_in_flight") == 1, 15, 0.05,
                 "the parked consume to count in flight")
        assert node.request("POST", "/v1/topics/park/produce", b"wake", headers=OCTET).status == 202
        th.join(20)
        assert out["r"].status == 200, out["r"]
    finally:
        th.join(25)
    wait_for(lambda: val(scrape(node), "narad_http_requests_in_flight") == 0, 10, 0.05, "in-flight back to 0")
    # A client that hangs up on a parked consume: counted as 499 (as Narad does), no longer in flight.
    import socket

    route = "GET /v1/topics/{topic}/consume"
    before = val(scrape(node), "narad_http_requests_total", route=route, status="499") or 0
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as sk:
        sk.sendall(f"GET /v1/topics/park/consume?wait=20s HTTP/1.1\r\nHost: x\r\n"
                   f"Authorization: {node.auth}\r\n\r\n".encode())
        wait_for(lambda: val(scrape(node), "narad_http_requests_in_flight") == 1, 15, 0.05, "the raw poll parked")
    wait_for(lambda: (val(scrape(node), "narad_http_requests_total", route=route, status="499") or 0) == before + 1,
             15, 0.05, "the hang-up counted as 499")
    assert val(scrape(node), "narad_http_requests_in_flight") == 0


def test_process_series_and_titles_name_every_process(node: Node) -> None:
    assert node.proc is not None
    sup = psutil.Process(node.proc.pid)
    fs = sup.children()[0]
    workers = fs.children()
    assert len(workers) == 2

    def cmdline(p: psutil.Process) -> str:
        return Path(f"/proc/{p.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()

    assert cmdline(sup).startswith("narad: supervisor")
    assert cmdline(fs).startswith("narad: forkserver")
    titles = sorted(cmdline(w) for w in workers)
    assert [t.split(" (")[0] for t in titles] == ["narad: worker 0", "narad: worker 1"], titles
    assert Path(f"/proc/{sup.pid}/comm").read_text().strip() == "narad: supervis"  # 15 bytes
    s = scrape(node)
    for proc in ("supervisor", "forkserver", "worker-0", "worker-1"):
        assert (val(s, "process_resident_memory_bytes", process=proc) or 0) > 0, proc
        assert val(s, "process_cpu_seconds_total", process=proc) is not None, proc
        assert (val(s, "process_open_fds", process=proc) or 0) > 0, proc


def test_closed_partition_gauges_and_times_come_from_its_files(tmp_path: Path) -> None:
    """The poller's cold path (no node): a closed partition's lag, size, segments and
    its oldest unacked record's time read from the files; the oldest segment's time
    for the describe row."""
    from narad.broker.broker import _cold_rows_many
    from narad.broker.partition import finish_stats, stats_from_disk
    from narad.storage import frames as FR
    from narad.storage import partition_log as PL

    plog = PL.PartitionLog(tmp_path)
    plog.open()
    times = [1_700_000_000_000, 1_700_000_005_000, 1_700_000_009_000]
    for ts, n in zip(times, (2, 3, 1), strict=True):  # three frames: offsets 0-1, 2-4, 5
        res = plog.write_commit([FR.encode_record(b"k" if n == 3 else None, ts, 0, b"p" * 10)] * n)
        plog.publish(*res, [(None, ts, 0, b"p" * 10)] * n)
    assert plog.oldest_segment_ms() == times[0]
    size = plog.size_bytes()
    plog.close()
    assert [PL.record_ms_on_disk(tmp_path, off) for off in (0, 1, 2, 4, 5)] == [
        times[0], times[0], times[1], times[1], times[2]]
    assert PL.record_ms_on_disk(tmp_path, 6) is None
    st = stats_from_disk(tmp_path)
    assert (st["segments"], st["size_bytes"], st["lag"]) == (1, size, 6)
    row = finish_stats(st)
    assert row["status"] == "ok" and row["oldest_segment_at"] == "2023-11-14T22:13:20.000Z"
    assert "oldest_segment_at_ms" not in row
    (cold,) = _cold_rows_many([(tmp_path, (-1, 0))])
    assert (cold.lag, cold.segments, cold.size, cold.age_at) == (6, 1, size, (0, times[0]))
    # The same offset again is not read again (its time is carried over).
    (again,) = _cold_rows_many([(tmp_path, (0, 42))])
    assert again.age_at == (0, 42)
    empty = stats_from_disk(tmp_path / "never")
    assert "oldest_segment_at" not in finish_stats(empty) and empty["segments"] == 0


def test_the_issue14_series_go_with_their_topic(node: Node) -> None:
    """The per-topic series of issue 14's features (duplicates, evicted keys, dead-lettered,
    held, failures, redriven) and messages accepted go when their topic is deleted, as the
    older ones do: they stayed for ever (found by a review of issue 14)."""
    assert node.post("/v1/topics", {"name": "mz-dlt", "partitions": 3}).status == 201
    assert node.post("/v1/topics", {"name": "mz-src", "partitions": 3, "max_deliveries": 1,
                                    "dead_letter_topic": "mz-dlt"}).status == 201
    for _ in range(2):  # one stored, one duplicate
        r = node.post("/v1/topics/mz-src/produce?idempotency_key=k1", b"x",
                      headers={"Content-Type": "application/octet-stream"})
        assert r.status == 202, r
    m = wait_for(lambda: (lambda r: r.json() if r.status == 200 else None)(node.get("/v1/topics/mz-src/consume")),
                 10, 0.05, "the record")
    assert node.post(f"/v1/topics/mz-src/ack?receipt_handle={m['receipt_handle']}&extend=0").status == 204
    names = ("narad_idempotent_duplicates_total", "narad_dead_lettered_total", "narad_redriven_total",
             "narad_messages_accepted_total")

    def present() -> bool:
        node.post("/v1/topics/mz-dlt/redrive?max=1")  # (redriven once the copy is there)
        s = scrape(node)
        return all(any(v for k, v in s.get(n, {}).items() if "mz-" in k) for n in names)

    wait_for(present, 20, 0.2, "the series with traffic")
    for t in ("mz-src", "mz-dlt"):
        assert node.request("DELETE", f"/v1/topics/{t}").status == 204
    wait_for(lambda: 'topic="mz-' not in listener(node, "GET", "/metrics")[2].decode(), 15, 0.1,
             "the deleted topics' series to go")
