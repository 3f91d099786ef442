"""One node in the designed shape, end to end with real processes: the
supervisor, forked workers pinned to cores, the Raft/LMDB metastore, the
topics and users API over HTTP/1.1 and HTTP/3, naradctl, restarts and kills."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.harness import ADMIN_PASSWORD, Node, basic, wait_for


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("node") / "data", workers=2).start()
    yield n
    n.close()


def test_workers_are_separate_processes_pinned_to_distinct_cores(node: Node) -> None:
    st = node.status()
    assert st["ready"] and st["raft"]["role"] == "leader"
    workers = st["workers"]
    assert len(workers) == 2 and all(w["alive"] for w in workers)
    sup = psutil.Process(node.proc.pid)  # type: ignore[union-attr]
    pids = [w["pid"] for w in workers]
    assert len(set(pids)) == 2 and sup.pid not in pids
    cores = [psutil.Process(p).cpu_affinity() for p in pids]
    assert all(len(c) == 1 for c in cores) and cores[0] != cores[1]
    # Workers are descendants of the supervisor (forked through the fork server).
    descendants = {p.pid for p in sup.children(recursive=True)}
    assert set(pids) <= descendants


def test_a_workers_io_threads_run_sched_batch_and_its_loop_does_not(node: Node) -> None:
    """The fdatasync threads must not preempt the worker's event loop on wake-up."""
    topic = "sched-batch"
    assert node.post("/v1/topics", {"name": topic, "partitions": 4}).status == 201
    for w in (0, 1):  # a produce through each worker starts its WAL syncer and I/O pool
        r = node.post(f"/v1/topics/{topic}/produce", b"x", conn=node.worker_connection(w),
                      headers={"Content-Type": "application/octet-stream"})
        assert r.status == 202, r.body
    for pid in (w["pid"] for w in node.status()["workers"]):
        policies = {t.id: os.sched_getscheduler(t.id) for t in psutil.Process(pid).threads()}
        assert policies.pop(pid) == os.SCHED_OTHER  # the event loop's thread
        assert os.SCHED_BATCH in policies.values(), policies


def test_a_topic_created_through_one_worker_is_visible_on_every_worker(node: Node) -> None:
    w0, w1 = node.worker_connection(0), node.worker_connection(1)
    r = node.post("/v1/topics", {"name": "visible-everywhere", "partitions": 4}, conn=w0)
    assert r.status == 201, r
    assert r.headers["x-narad-worker"] == "0"
    got = node.get("/v1/topics/visible-everywhere", conn=w1)
    assert got.status == 200 and got.headers["x-narad-worker"] == "1"
    body = got.json()
    assert body["id"] == r.json()["id"] and body["partitions"] == 4 and body["owner"] == "admin"
    assert [p["owner_node"] for p in body["partition_stats"]] == ["n1"] * 4


def test_cache_invalidates_when_naradctl_alters_a_topic(node: Node) -> None:
    conns = [node.worker_connection(i) for i in (0, 1)]
    assert node.post("/v1/topics", {"name": "cached"}).status == 201
    for c in conns:  # warm every worker's topic cache
        assert node.get("/v1/topics/cached", conn=c).json()["partitions"] == 3
    node.ctl("topics", "alter", "cached", "--partitions", "6")
    for c in conns:  # the very next request on each worker sees the change
        assert node.get("/v1/topics/cached", conn=c).json()["partitions"] == 6


def test_topic_rules_and_status_codes(node: Node) -> None:
    assert node.post("/v1/topics", {"name": "rules", "partitions": 3}).status == 201
    dup = node.post("/v1/topics", {"name": "rules"})
    assert dup.status == 409 and "already exists" in dup.json()["error"]
    clash = node.post("/v1/topics", {"name": "RULES"})
    assert clash.status == 409 and '"rules"' in clash.json()["error"]
    for body, why in [
        ({"name": "bad name"}, "topic name"),
        ({"name": "x", "partitions": 2}, "partitions"),
        ({"name": "x", "retention_ms": 5}, "retention_ms"),
        ({"name": "x", "fanout_delay_msx": 1}, 'unknown field "fanout_delay_msx"'),
        ({"name": "x", "partitions": "3"}, "invalid json"),
        ({"partitions": 3}, "name required"),
    ]:
        r = node.post("/v1/topics", body)
        assert r.status == 400 and why in r.json()["error"], (body, r)
    trailing = node.post("/v1/topics", b'{"name":"x"} {}', headers={"Content-Type": "application/json"})
    assert trailing.status == 400
    assert node.get("/v1/topics/nope").status == 404
    r = node.request("PATCH", "/v1/topics/rules", {"visibility_timeout_ms": 5})
    assert r.status == 400 and "visibility_timeout_ms" in r.json()["error"]
    r = node.request("PATCH", "/v1/topics/rules", {"partitions": 2})
    assert r.status == 400
    r = node.request("PATCH", "/v1/topics/rules", {"partitions": 5, "retention_ms": 0})
    assert r.status == 200 and r.json()["partitions"] == 5 and r.json()["retention_ms"] == 0
    assert node.get("/v1/topics/rules?partition=9").status == 400
    assert len(node.get("/v1/topics/rules?partition=4").json()["partition_stats"]) == 1
    # retention_ms 0 on create means forever (not the default).
    assert node.post("/v1/topics", {"name": "forever", "retention_ms": 0}).json()["retention_ms"] == 0
    assert node.post("/v1/topics", {"name": "dflt"}).json()["retention_ms"] == 604800000


def test_delete_and_recreate_gives_a_new_incarnation(node: Node) -> None:
    first = node.post("/v1/topics", {"name": "reborn"}).json()["id"]
    assert node.request("DELETE", "/v1/topics/reborn").status == 204
    assert node.get("/v1/topics/reborn").status == 404
    assert node.request("DELETE", "/v1/topics/reborn").status == 404
    second = node.post("/v1/topics", {"name": "reborn"}).json()["id"]
    assert second != first and len(second) == 16


def test_schema_registration_history_and_compatibility(node: Node) -> None:
    schema = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    r = node.post("/v1/topics", {"name": "typed", "schema": schema})
    assert r.status == 201
    h = node.get("/v1/topics/typed/schema").json()
    assert h == {"topic": "typed", "version": 1, "versions": [{"version": 1, "schema": schema}]}
    assert node.get("/v1/topics/typed").json()["schema"] == schema
    same = node.request("PATCH", "/v1/topics/typed", {"schema": dict(schema, title="annotated")})
    assert same.status == 200 and node.get("/v1/topics/typed/schema").json()["version"] == 1
    wider = {"type": "object", "properties": {"id": {"type": "number"}}}
    assert node.request("PATCH", "/v1/topics/typed", {"schema": wider}).status == 200
    assert node.get("/v1/topics/typed/schema").json()["version"] == 2
    narrower = {"type": "object", "properties": {"id": {"type": "string"}}}
    r = node.request("PATCH", "/v1/topics/typed", {"schema": narrower})
    assert r.status == 400 and "incompatible" in r.json()["error"]
    r = node.request("PATCH", "/v1/topics/typed", {"schema": wider, "schema_base_version": 1})
    assert r.status == 409 and "schema_base_version 1" in r.json()["error"]
    assert node.post("/v1/topics", {"name": "badschema", "schema": {"type": "nope"}}).status == 400
    assert node.post("/v1/topics", {"name": "extref", "schema": {"$ref": "http://x/y"}}).status == 400


def test_list_topics_pagination(node: Node) -> None:
    for i in range(5):
        assert node.post("/v1/topics", {"name": f"zzzz-page-{i}"}).status == 201
    r = node.get("/v1/topics?limit=2&page_token=zzzz-page-").json()
    assert [t["name"] for t in r["topics"]] == ["zzzz-page-0", "zzzz-page-1"] and r["next_page_token"] == "zzzz-page-2"
    r = node.get("/v1/topics?limit=2&page_token=zzzz-page-4").json()
    assert [t["name"] for t in r["topics"]] == ["zzzz-page-4"] and r["next_page_token"] == ""
    assert node.get("/v1/topics?limit=0").status == 400
    assert node.get("/v1/topics?limit=x").status == 400


def test_auth_grants_and_the_415_guard(node: Node) -> None:
    assert node.get("/v1/topics", auth=None).status == 401
    r = node.get("/v1/topics", auth=basic("admin", "wrong"))
    assert r.status == 401 and r.headers["www-authenticate"] == 'Basic realm="narad"'
    assert node.get("/v1/topics", auth=basic("ghost", "x")).status == 401
    assert node.get("/healthz", auth=None).status == 200
    # A user who may create orders-* topics, and nothing else.
    r = node.post("/v1/users", {"username": "alice", "password": "alice-pw",
                                "grants": [{"action": "create", "patterns": ["orders-*"]}]})
    assert r.status == 201 and r.json()["grants"] == [{"action": "create", "patterns": ["orders-*"]}]
    alice = basic("alice", "alice-pw")
    assert node.post("/v1/topics", {"name": "orders-eu"}, auth=alice).status == 201
    denied = node.post("/v1/topics", {"name": "payments"}, auth=alice)
    assert denied.status == 403
    assert node.get("/v1/topics/orders-eu", auth=alice).json()["owner"] == "alice"
    assert node.post("/v1/topics", {"name": "admins-only"}).status == 201
    assert node.get("/v1/topics/admins-only", auth=alice).status == 403
    listed = {t["name"] for t in node.get("/v1/topics?limit=1000", auth=alice).json()["topics"]}
    assert "orders-eu" in listed and "admins-only" not in listed
    assert node.request("DELETE", "/v1/topics/admins-only", auth=alice).status == 403
    assert node.get("/v1/users", auth=alice).status == 403
    assert node.get("/v1/cluster/members", auth=alice).status == 403
    # The cross-site guard: no content type and no X-Narad-Client -> 415 (after auth, before 405).
    r = node.request("POST", "/v1/topics", b'{"name":"t415"}', headers={"X-Narad-Client": ""})
    assert r.status == 415
    r = node.request("POST", "/v1/topics", b'{"name":"t415"}', headers={"X-Narad-Client": ""}, auth=None)
    assert r.status == 401
    r = node.request("POST", "/v1/topics/t415", b"{}", headers={"Content-Type": "text/plain", "X-Narad-Client": ""})
    assert r.status == 415
    assert node.request("PUT", "/v1/topics", b"{}").status == 405


def test_a_password_change_for_another_user_is_403_whether_or_not_the_user_exists(node: Node) -> None:
    """No user-name oracle: the self-or-admin check comes before the lookup."""
    assert node.post("/v1/users", {"username": "uma", "password": "uma-pw"}).status == 201
    assert node.post("/v1/users", {"username": "vic", "password": "vic-pw"}).status == 201
    uma = basic("uma", "uma-pw")
    a = node.request("PUT", "/v1/users/vic/password", {"new_password": "x1"}, auth=uma)
    b = node.request("PUT", "/v1/users/no-such-user/password", {"new_password": "x1"}, auth=uma)
    assert (a.status, a.json()) == (b.status, b.json()) == (403, {"error": "only admins may change another user's "
                                                                           "password"}), (a, b)
    assert node.request("PUT", "/v1/users/no-such-user/password", {"new_password": "x1"}).status == 404  # admin


def test_user_rules_and_anti_escalation(node: Node) -> None:
    assert node.post("/v1/users", {"username": "bob", "password": "bob-pw",
                                   "grants": [{"action": "admin"}]}).status == 201
    bob = basic("bob", "bob-pw")
    # bob is an admin but not root: he cannot grant admin.
    r = node.post("/v1/users", {"username": "carol", "password": "c", "grants": [{"action": "admin"}]}, auth=bob)
    assert r.status == 403 and "root" in r.json()["error"]
    assert node.post("/v1/users", {"username": "carol", "password": "c"}, auth=bob).status == 201
    assert node.request("PUT", "/v1/users/bob/grants", {"grants": []}, auth=bob).status == 403
    assert node.request("PUT", "/v1/users/admin/grants", {"grants": []}).status == 403
    assert node.request("DELETE", "/v1/users/admin", auth=bob).status == 403
    assert node.request("DELETE", "/v1/users/bob", auth=bob).status == 403
    assert node.request("PUT", "/v1/users/admin/password", {"new_password": "x"}, auth=bob).status == 403
    carol = basic("carol", "c")
    assert node.request("PUT", "/v1/users/carol/password", {"new_password": "c2"}, auth=carol).status == 403
    assert node.request("PUT", "/v1/users/carol/password", {"new_password": "c2", "current_password": "c"},
                        auth=carol).status == 204
    assert node.get("/v1/topics", auth=carol).status == 401  # old password stops working at once
    assert node.get("/v1/topics", auth=basic("carol", "c2")).status == 200
    assert node.post("/v1/users", {"username": "carol", "password": "x"}).status == 409
    assert node.post("/v1/users", {"username": "bad/name", "password": "x"}).status == 400
    assert node.post("/v1/users", {"username": "dave", "password": "x" * 73}).status == 400
    r = node.post("/v1/users", {"username": "dave", "password": "x", "grants": [{"action": "produce"}]})
    assert r.status == 400
    assert node.post("/v1/users", b"x" * (1 << 20 + 1), headers={"Content-Type": "application/json"}).status == 400
    users = {u["username"]: u for u in node.get("/v1/users").json()}
    assert users["admin"]["root"] is True and "grants" not in users["admin"]
    assert node.request("DELETE", "/v1/users/carol").status == 204
    assert node.get("/v1/users/carol").status == 404


def test_failed_logins_are_throttled(node: Node) -> None:
    assert node.post("/v1/users", {"username": "eve", "password": "right"}).status == 201
    statuses = [node.get("/v1/topics", auth=basic("eve", "wrong")).status for _ in range(6)]
    assert statuses[:5] == [401] * 5 and statuses[5] == 429
    # Even the right password waits for the bucket to refill.
    assert node.get("/v1/topics", auth=basic("eve", "right")).status == 429


def test_http3_write_and_http1_read_agree(node: Node) -> None:
    from narad.client.h3 import H3Client

    async def via_h3() -> tuple[int, bytes]:
        c = await H3Client.connect("127.0.0.1", node.port)
        try:
            st, _, body = await c.request(
                "POST", "/v1/topics", body=b'{"name":"over-h3","partitions":5}',
                headers={"authorization": node.auth, "content-type": "application/json"})
            st2, _, got = await c.request("GET", "/v1/topics/over-h3", headers={"authorization": node.auth})
            assert st2 == 200 and b'"partitions":5' in got
            return st, body
        finally:
            await c.close()

    status, body = asyncio.run(via_h3())
    assert status == 201 and b'"over-h3"' in body
    r = node.get("/v1/topics/over-h3")
    assert r.status == 200 and r.json()["partitions"] == 5
    assert r.headers["alt-svc"] == f'h3=":{node.port}"; ma=86400'


def test_health_ready_metrics_members(node: Node) -> None:
    assert node.get("/healthz", auth=None).json() == {"status": "ok"}
    assert node.get("/readyz", auth=None).json() == {"status": "ready"}
    assert node.get("/metrics", auth=None).status == 401
    # the role gauge follows the first election (a node booted just now may not have seen it yet)
    def scrape() -> str | None:
        t = node.get("/metrics").body.decode()
        return t if 'narad_raft_state{state="leader"} 1.0' in t else None

    text = wait_for(scrape, 10, 0.1, "the leader gauge")
    assert "narad_http_requests_total" in text
    members = node.get("/v1/cluster/members").json()["members"]
    assert len(members) == 1
    m = members[0]
    assert m["id"] == "n1" and m["status"] == "alive" and m["voter"] and m["leader"]
    assert m["heartbeat_age_seconds"] < 10
    ctl_members = node.ctl("members")["members"]
    assert ctl_members[0]["id"] == "n1"


def test_admin_password_file_when_no_env(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=1, env={"NARAD_ADMIN_PASSWORD": ""})
    env = n.env()
    del env["NARAD_ADMIN_PASSWORD"]
    n.env = lambda: env  # type: ignore[method-assign]
    n.start()
    try:
        pw_file = tmp_path / "data" / "admin-password"
        assert stat.S_IMODE(pw_file.stat().st_mode) == 0o600
        pw = pw_file.read_text().strip()
        assert n.get("/v1/topics", auth=basic("admin", pw)).status == 200
        assert pw not in n.log()  # the path is logged, never the password
        assert str(pw_file) in n.log()
    finally:
        n.close()


def test_killed_worker_is_replaced_and_node_keeps_serving(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=2).start()
    try:
        before = n.worker_pids()
        os.kill(before[1], signal.SIGKILL)
        after = wait_for(lambda: (p := n.worker_pids()) and len(p) == 2 and p[1] != before[1] and p,
                         what="worker 1 to be replaced")
        assert after[0] == before[0]
        st = n.status()
        assert st["workers"][1]["restarts"] == 1
        assert "worker died; restarting" in n.log() and "killed by SIGKILL" in n.log()
        c = n.worker_connection(1)
        assert n.post("/v1/topics", {"name": "after-restart"}, conn=c).status == 201
    finally:
        n.close()


def test_restart_keeps_metadata_and_sigkill_loses_no_acknowledged_write(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=2).start()
    try:
        names = [f"durable-{i}" for i in range(20)]
        ids = {}
        for name in names:
            r = n.post("/v1/topics", {"name": name})
            assert r.status == 201
            ids[name] = r.json()["id"]
        assert n.stop() == 0  # graceful
        n.start()
        for name in names[:5]:
            assert n.get(f"/v1/topics/{name}").json()["id"] == ids[name]
        more = [f"killed-{i}" for i in range(20)]
        for name in more:
            r = n.post("/v1/topics", {"name": name})
            assert r.status == 201
            ids[name] = r.json()["id"]
        n.kill9()  # every process of the node, no warning
        n.start()
        for name in names + more:
            r = n.get(f"/v1/topics/{name}")
            assert r.status == 200 and r.json()["id"] == ids[name], name
        assert n.status()["raft"]["applied_index"] >= n.status()["raft"]["persisted_commit_index"]
    finally:
        n.close()


def test_sigterm_drains_an_in_flight_request(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=1).start()
    try:
        c = n.conn()
        c.request("GET", "/healthz")
        c.getresponse().read()
        n.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        assert n.proc.wait(30) == 0  # type: ignore[union-attr]
        assert "shutting down" in n.log() and "worker drained" in n.log()
    finally:
        n.close()


def test_unknown_config_key_stops_the_start(tmp_path: Path) -> None:
    cfg = tmp_path / "narad.toml"
    cfg.write_text("[http]\nportt = 1\n")
    p = subprocess.run([sys.executable, "-m", "narad.supervisor.main", "--config", str(cfg),
                        "--data-dir", str(tmp_path / "data")], capture_output=True, text=True, timeout=30,
                       env={k: v for k, v in os.environ.items() if not k.startswith("NARAD_")})
    assert p.returncode == 2
    assert "unknown config key http.portt" in p.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was opened


def test_second_supervisor_on_the_same_data_dir_is_refused(node: Node) -> None:
    other = Node(node.data_dir, workers=1)
    other.start(wait=False)
    assert other.proc.wait(30) == 2  # type: ignore[union-attr]
    assert "in use by another narad-supervisor" in other.log()
    assert node.get("/readyz", auth=None).status == 200


def test_naradctl_topics_and_users(node: Node) -> None:
    t = node.ctl("topics", "create", "from-ctl", "--partitions", "7")
    assert t["partitions"] == 7 and "owner" not in t
    d = node.ctl("topics", "describe", "from-ctl")
    assert sorted(d["assignments"]) == [str(i) for i in range(7)]
    assert "from-ctl" in {x["name"] for x in node.ctl("topics", "ls")}
    assert node.get("/v1/topics/from-ctl").status == 200
    u = node.ctl("users", "add", "frank", "--password", "f-pw", "--grant", "consume:from-*")
    assert u["grants"] == [{"action": "consume", "patterns": ["from-*"]}]
    assert node.get("/v1/topics/from-ctl", auth=basic("frank", "f-pw")).status == 200
    node.ctl("users", "rm", "frank")
    assert node.get("/v1/topics/from-ctl", auth=basic("frank", "f-pw")).status == 401
    node.ctl("topics", "rm", "from-ctl")
    assert node.get("/v1/topics/from-ctl").status == 404
    bad = node.ctl("topics", "rm", "from-ctl", check=False)
    assert bad.returncode == 1 and "not found" in bad.stderr
    human = subprocess.run([sys.executable, "-m", "narad.ctl.main", "--data-dir", str(node.data_dir), "status"],
                           capture_output=True, text=True, timeout=30)
    assert human.returncode == 0 and "leader" in human.stdout and "RESTARTS" in human.stdout
    assert "HEARTBEAT" in human.stdout and "supervisor" in human.stdout, human.stdout
    st = node.ctl("status")
    assert 0 <= st["heartbeats"]["supervisor"] < 3 and 0 <= st["heartbeats"]["raft tick thread"] < 3, st
    assert all(w["heartbeat_age_seconds"] is not None and w["heartbeat_age_seconds"] < 3 for w in st["workers"]), st


def test_dev_mode_has_no_auth(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=1, security=False).start()
    try:
        r = n.post("/v1/topics", {"name": "open"}, auth=None)
        assert r.status == 201 and "owner" not in r.json()
        assert n.get("/v1/topics/open", auth=None).status == 200
    finally:
        n.close()


__all__ = ["ADMIN_PASSWORD"]


def test_the_worker_profile_hook_writes_a_cprofile_file_at_a_clean_stop(tmp_path: Path) -> None:
    """NARAD_WORKER_CPROFILE (loadtest/bench.py --cprofile) runs each worker under
    cProfile and writes <prefix>.<index>.<pid> when it stops cleanly; the file loads in
    pstats and holds the request handling it saw."""
    import pstats

    prefix = tmp_path / "prof" / "w"
    prefix.parent.mkdir()
    n = Node(tmp_path / "data", workers=1, env={"NARAD_WORKER_CPROFILE": str(prefix)})
    n.start()
    try:
        assert n.post("/v1/topics", {"name": "cp", "partitions": 3}).status == 201
        assert n.post("/v1/topics/cp/produce", b'{"a":1}').status == 202
        assert n.stop() == 0
    finally:
        n.close()
    files = sorted(prefix.parent.glob("w.0.*"))
    assert len(files) == 1, files
    names = {k[2] for k in pstats.Stats(str(files[0])).stats}  # type: ignore[attr-defined]
    assert {"produce", "produce_fast"} & names, sorted(n for n in names if "produce" in n)
