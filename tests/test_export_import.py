"""Metastore export and import (disaster recovery) on real nodes, through naradctl:
a consistent JSON export with counts per domain; an import applies it as one Raft
entry on an empty cluster (topics with their schemas and incarnations, users with
their password hashes and grants; partitions placed on this cluster's members),
refuses a cluster that holds state unless --overwrite."""

from __future__ import annotations

import json
from pathlib import Path

from tests.harness import Node, basic, wait_for
from tests.test_cluster import drain, produce

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}


def test_export_then_import_into_an_empty_node_and_overwrite(tmp_path: Path) -> None:
    src = Node(tmp_path / "src", workers=1).start()
    dst = Node(tmp_path / "dst", workers=1, node_id="dr1").start()
    try:
        assert src.post("/v1/users", {"username": "alice", "password": "alice-pw",
                                      "grants": [{"action": "create", "patterns": ["orders-*"]},
                                                 {"action": "produce", "patterns": ["orders-*"]},
                                                 {"action": "consume", "patterns": ["orders-*"]}]}).status == 201
        alice = basic("alice", "alice-pw")
        assert src.post("/v1/topics", {"name": "orders-eu", "partitions": 4}, auth=alice).status == 201
        assert src.post("/v1/topics", {"name": "typed", "schema": SCHEMA}).status == 201
        assert src.request("PATCH", "/v1/topics/typed", json.dumps({"schema": {**SCHEMA, "required": []}}).encode(),
                           headers={"Content-Type": "application/json"}).status == 200
        ids = {n: src.get(f"/v1/topics/{n}").json()["id"] for n in ("orders-eu", "typed")}
        export = tmp_path / "metastore.json"
        out = src.ctl("metastore", "export", str(export))
        assert out["counts"]["topics"] == 2 and out["counts"]["users"] == 2  # alice and the root admin
        assert out["counts"]["schemas"] == 2 and out["counts"]["assignments"] == 7
        doc = json.loads(export.read_text())
        assert doc["format"] == "narad-metastore-export" and doc["applied_index"] == out["applied_index"] > 0
        assert doc["counts"] == out["counts"] and len(doc["topics"]) == 2
        # The source holds state: an import without --overwrite is refused there.
        refused = src.ctl("metastore", "import", str(export), check=False)
        assert refused.returncode == 1 and "holds state" in refused.stderr and "HTTP 409" in refused.stderr
        # Into the empty node: one entry, then everything is there.
        res = dst.ctl("metastore", "import", str(export))
        assert res["imported"] == {"topics": 2, "schemas": 2, "assignments": 7, "users": 1} and res["index"] > 0
        for name, tid in ids.items():
            t = dst.get(f"/v1/topics/{name}").json()
            assert t["id"] == tid, t
        typed = dst.get("/v1/topics/typed").json()
        assert typed["schema_version"] == 2 and typed["schema"]["required"] == []
        assert dst.get("/v1/topics/orders-eu", auth=alice).json()["owner"] == "alice"  # same password hash
        # The source's assignments named node n1; this cluster's leader places them on its own members.
        def placed() -> bool:
            stats = dst.get("/v1/topics/orders-eu").json()["partition_stats"]
            return len(stats) == 4 and all(p.get("owner_node") == "dr1" for p in stats)
        wait_for(placed, 20, 0.1, "imported partitions placed")
        assert produce(dst, "orders-eu", b"after-restore") == 202
        assert [m["payload"] for m in drain(dst, "orders-eu", 1)] == ["after-restore"]
        # --overwrite replaces what the cluster holds (the root admin stays).
        assert dst.post("/v1/topics", {"name": "made-after"}).status == 201
        again = dst.ctl("metastore", "import", "--overwrite", str(export))
        assert again["imported"]["topics"] == 2
        assert dst.get("/v1/topics/made-after").status == 404
        assert dst.get("/v1/topics/typed").status == 200 and dst.get("/v1/users").status == 200
    finally:
        src.close()
        dst.close()


def test_a_damaged_export_is_refused_with_what_is_wrong(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=1).start()
    try:
        bad = tmp_path / "bad.json"
        bad.write_text('{"format": "something-else"}')
        p = n.ctl("metastore", "import", str(bad), check=False)
        assert p.returncode == 1 and "HTTP 400" in p.stderr
        export = tmp_path / "ok.json"
        n.ctl("metastore", "export", str(export))
        doc = json.loads(export.read_text())
        doc["counts"]["topics"] = 5
        bad.write_text(json.dumps(doc))
        p = n.ctl("metastore", "import", str(bad), check=False)
        assert p.returncode == 1 and "damaged" in p.stderr
        # Fields a live request would refuse are refused here too, before anything is proposed.
        for field, value, said in (("users", [{"username": "", "password_hash": "aA=="}], "username"),
                                   ("users", [{"username": "x" * 600, "password_hash": "aA=="}], "username")):
            broken = json.loads(export.read_text())
            broken[field] = value
            bad.write_text(json.dumps(broken))
            p = n.ctl("metastore", "import", str(bad), check=False)
            assert p.returncode == 1 and "HTTP 400" in p.stderr and said in p.stderr, p.stderr
        broken = json.loads(export.read_text())
        broken["topics"] = [{"name": "huge", "id": "00000000000000aa", "partitions": 10**9, "retention_ms": 0,
                             "visibility_timeout_ms": 30000, "max_in_flight_per_partition": 1,
                             "max_acked_ahead_per_partition": 1, "created_at": 1}]
        broken["counts"]["topics"] = 1
        bad.write_text(json.dumps(broken))
        p = n.ctl("metastore", "import", str(bad), check=False)
        assert p.returncode == 1 and "max_partitions" in p.stderr, p.stderr
        # A hand-edited export whose dead-letter topics form a cycle (no live write could make one).
        def rec(name: str, tid: str, dlt: str) -> dict[str, object]:
            return {"name": name, "id": tid, "partitions": 3, "retention_ms": 0, "visibility_timeout_ms": 30000,
                    "max_in_flight_per_partition": 1, "max_acked_ahead_per_partition": 1, "created_at": 1,
                    "max_deliveries": 2, "dead_letter_topic": dlt}
        broken = json.loads(export.read_text())
        broken["topics"] = [rec("ring-a", "00000000000000a1", "ring-b"), rec("ring-b", "00000000000000a2", "ring-a")]
        broken["counts"]["topics"] = 2
        bad.write_text(json.dumps(broken))
        p = n.ctl("metastore", "import", str(bad), check=False)
        assert p.returncode == 1 and "HTTP 400" in p.stderr and "ring-a -> ring-b -> ring-a" in p.stderr, p.stderr
        assert n.proc is not None and n.proc.poll() is None and n.get("/readyz", auth=None).status == 200
    finally:
        n.close()
