"""Wire details a Narad client depends on, checked on one real node (security on, with
``http.metrics_addr`` set): ``partition_stats`` rows keyed ``index`` with Narad's row
fields (placeholders carry the live keys zeroed), ``partial`` only when true, ``role``
absent on a standalone topic, integer ``heartbeat_age_seconds``, ``members?detail=true``
with ``node_status``, an unknown path or method answered in Narad's order with Go's
plain-text bodies (and no credential check skipped for a /v1 route however its path is
spelled), and /metrics on the API port answering 404 once the separate listener is set.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

import narad.api
from narad.api.topics import PLACEHOLDER_STATS, partition_stats
from narad.meta.records import AssignmentRecord, TopicRecord

from .harness import Node, free_ports, wait_for

DOC: dict[str, Any] = json.loads((Path(narad.api.__file__).parent / "openapi.json").read_text())
PLAIN = "text/plain; charset=utf-8"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    (mport,) = free_ports(1)
    n = Node(tmp_path_factory.mktemp("wire") / "data", workers=1,
             env={"NARAD_HTTP_METRICS_ADDR": f"127.0.0.1:{mport}"})
    n.start()
    try:
        yield n
    finally:
        n.close()


def test_partition_stats_rows_as_narad(node: Node) -> None:
    assert node.post("/v1/topics", {"name": "wc-t", "partitions": 3}).status == 201
    for i in range(4):
        assert node.post(f"/v1/topics/wc-t/produce?partition={i % 2}", b"x" * 100,
                         headers={"Content-Type": "application/octet-stream"}).status == 202
    wait_for(lambda: sum(r["high_watermark"] for r in node.get("/v1/topics/wc-t").json()["partition_stats"]) == 4,
             20, what="the records to be committed")
    d = node.get("/v1/topics/wc-t").json()
    assert "partial" not in d, "partial is present only when true (Narad)"
    assert "role" not in d and "children" not in d  # standalone
    rows = d["partition_stats"]
    assert [r["index"] for r in rows] == [0, 1, 2]
    required = DOC["components"]["schemas"]["PartitionStats"]["required"]
    documented = set(DOC["components"]["schemas"]["PartitionStats"]["properties"])
    for r in rows:
        assert "partition" not in r
        assert set(r) <= documented, f"row keys the document does not describe: {set(r) - documented}"
        assert r["status"] == "ok" and r["owner_node"] == node.node_id
        assert set(required) <= set(r), f"missing {set(required) - set(r)}"
        assert all(isinstance(r[k], int) for k in PLACEHOLDER_STATS)
    assert [r["high_watermark"] for r in rows] == [2, 2, 0]
    # The owner's storage figures pass through: the two partitions with records have a
    # segment, bytes on disk and the time of their oldest record; the empty one no time.
    for r in rows[:2]:
        assert r["segments"] >= 1 and r["size_bytes"] >= 200, r
        at = datetime.fromisoformat(r["oldest_segment_at"].replace("Z", "+00:00"))
        assert abs(at.timestamp() - time.time()) < 600, r
    assert "oldest_segment_at" not in rows[2]
    only = node.get("/v1/topics/wc-t?partition=1").json()["partition_stats"]
    assert [r["index"] for r in only] == [1]

    # A placeholder (the owner did not answer, or the partition is unassigned) has every
    # numeric key of a live row, zeroed, and says why.
    t = TopicRecord("wc-t", d["id"], 3, 0, 30000, 1024, 1024, 0)
    live = {k: v for k, v in rows[0].items() if k not in ("index", "owner_node", "status")}
    for a, why in ((None, "unassigned"), (AssignmentRecord("n2", d["id"]), "unreachable")):
        ph = partition_stats(t, 0, a, None)
        assert ph["status"] == "owner_unavailable" and ph["owner_liveness"] == why and ph["index"] == 0
        numeric = {k for k, v in live.items() if isinstance(v, int) and not isinstance(v, bool)}
        assert numeric <= set(ph), f"placeholder lacks {numeric - set(ph)}"
        assert all(ph[k] in (0, -1) for k in numeric)
    # Whatever the owner reports passes through, with status ok unless it says otherwise.
    row = partition_stats(t, 2, AssignmentRecord("n1", d["id"]), {**PLACEHOLDER_STATS, "segments": 3,
                                                                   "oldest_segment_at": "2026-12-01T00:00:00Z",
                                                                   "new_key": 7})
    assert row["segments"] == 3 and row["oldest_segment_at"] == "2026-12-01T00:00:00Z" and row["new_key"] == 7
    assert row["status"] == "ok" and row["index"] == 2


def test_role_and_children_on_topic_answers(node: Node) -> None:
    assert node.post("/v1/topics", {"name": "wc-par"}).status == 201
    kid = node.post("/v1/topics", {"name": "wc-kid", "parent": "wc-par"})
    assert kid.status == 201 and kid.json()["role"] == "child" and kid.json()["parent"] == "wc-par"
    par = node.get("/v1/topics/wc-par").json()
    assert par["role"] == "parent" and par["children"] == ["wc-kid"]


def test_members_heartbeat_integer_and_node_status(node: Node) -> None:
    plain = node.get("/v1/cluster/members").json()["members"]
    assert len(plain) == 1 and "node_status" not in plain[0]
    assert type(plain[0]["heartbeat_age_seconds"]) is int
    m = node.get("/v1/cluster/members?detail=true").json()["members"][0]
    assert type(m["heartbeat_age_seconds"]) is int
    st = m["node_status"]
    assert type(st.pop("produce_in_flight")) is int and type(st.pop("dispatch_backlog")) is int, st
    assert st == {"node": node.node_id, "draining": False, "quarantine": {"copies": 0, "bytes": 0, "list": []},
                  "moves": []}


def test_unknown_route_and_method_in_narads_order(node: Node) -> None:
    # Outside /v1 no credentials apply: 404 / 405 at once, Go's plain-text bodies.
    for method in ("GET", "POST", "HEAD"):
        r = node.request(method, "/nope", auth=None, headers={"X-Narad-Client": ""})
        assert r.status == 404 and r.headers["content-type"] == PLAIN, r
        if method != "HEAD":
            assert r.body == b"404 page not found\n"
    r = node.request("POST", "/healthz", b"", auth=None)
    assert (r.status, r.body, r.headers["content-type"]) == (405, b"Method Not Allowed\n", PLAIN)
    assert r.headers["allow"] == "GET, HEAD"
    # Under /v1 credentials come first (401), then the 415 guard, then 404 / 405.
    assert node.get("/v1/nope", auth=None).status == 401
    r = node.get("/v1/nope")
    assert (r.status, r.body, r.headers["content-type"]) == (404, b"404 page not found\n", PLAIN)
    assert node.request("PUT", "/v1/topics", b"{}", headers={"X-Narad-Client": ""}).status == 415
    r = node.request("PUT", "/v1/topics", b"{}", headers={"Content-Type": "application/json"})
    assert (r.status, r.body, r.headers["content-type"]) == (405, b"Method Not Allowed\n", PLAIN)
    assert r.headers["allow"] == "GET, HEAD, POST"
    # However a /v1 route's path is spelled, the credential check applies (no bypass).
    for path in ("//v1/topics", "/v1//topics/", "/%76%31/topics", "/v1/topics/wc-t/../wc-t"):
        assert node.get(path, auth=None).status in (401, 404), path
        assert node.get(path, auth=None).status != 200, path
    assert node.get("//v1/topics", auth=None).status == 401
    assert node.get("/%76%31/topics", auth=None).status == 401


def test_metrics_404_on_api_port(node: Node) -> None:
    """http.metrics_addr is set: the series are served there; the API port's /metrics
    answers 404 after the credential check (Narad: 404, or 401 without credentials)."""
    assert node.get("/metrics", auth=None).status == 401
    r = node.get("/metrics")
    assert (r.status, r.body) == (404, b"404 page not found\n")
    assert "404" in DOC["paths"]["/metrics"]["get"]["responses"]
