"""The partition-move routes, SDK calls and CLI commands on one real node (security
on), plus the move listing rendered from a real metastore file.

A lone node can hold no move (a target must be another member) and cannot be
decommissioned (its removal leaves no voter and nobody to take its partitions), so
here: the empty move list, the dry run's reasons, every refusal (400/403/404/409)
with the node's state unchanged after it, members?detail's move fields, and the
``narad`` and ``naradctl`` commands for each. The listing of real move rows (statuses
and ``blocked``) is checked on an LMDB metastore the FSM wrote, read by the same
function the route calls. One small 4-node cluster (the least that lets a voter be
decommissioned) checks a real decommission: the draining node's produce 503, the
move it sheds in every view, a real abort, and the cancel.
Moves between nodes are tests/test_moves_cluster.py's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner, Result

from narad.api import messages, ops
from narad.cli.main import cli
from narad.client import Client, Conflict
from narad.ctl import main as naradctl
from narad.meta import commands as C
from narad.meta import requests as Q
from narad.meta.records import MemberRecord
from tests.harness import ADMIN_PASSWORD, Cluster, Node, basic, wait_for
from tests.test_fsm import Applier, topic
from tests.test_openapi import DOC, undocumented

PLAIN = basic("mv-plain", "mv-plain-pw-1")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("moves-api") / "data", workers=1).start()
    try:
        assert n.post("/v1/topics", {"name": "mv-t", "partitions": 3}).status == 201
        assert n.post("/v1/users", {"username": "mv-plain", "password": "mv-plain-pw-1"}).status == 201
        yield n
    finally:
        n.close()


def narad(node: Node, *args: str, code: int = 0) -> Result:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("NARAD_")}
    env.update({"NARAD_ADDR": f"127.0.0.1:{node.port}", "NARAD_USER": "admin", "NARAD_PASS": ADMIN_PASSWORD,
                "NARAD_CONFIG_DIR": str(node.data_dir.parent / "cli-config")})
    r = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    assert r.exit_code == code, f"narad {' '.join(args)} exited {r.exit_code}:\n{r.stdout}\n{r.stderr}"
    return r


def conforms(body: Any, schema_name: str) -> None:
    """``body`` is what narad/api/openapi.json says (schema ``schema_name``), every
    field of it documented."""
    schema = {"$ref": f"#/components/schemas/{schema_name}"}
    jsonschema.Draft202012Validator({**schema, "components": DOC["components"]}).validate(body)
    assert not undocumented(body, schema, ""), undocumented(body, schema, "")


def member(node: Node) -> dict[str, Any]:
    rows = node.get("/v1/cluster/members").json()["members"]
    assert [m["id"] for m in rows] == [node.node_id]
    return rows[0]  # type: ignore[no-any-return]


def test_moves_list_empty_and_bad_input(node: Node) -> None:
    for q in ("", "?detail=true", "?detail=false"):
        r = node.get(f"/v1/cluster/moves{q}")
        assert r.status == 200 and r.json() == {"moves": []}, r
    r = node.get("/v1/cluster/moves?detail=maybe")
    assert r.status == 400 and "detail" in r.json()["error"]
    assert node.get("/v1/cluster/moves", auth=PLAIN).status == 403
    assert node.get("/v1/cluster/moves", auth=None).status == 401


def test_decommission_dry_run_says_why_not(node: Node) -> None:
    r = node.post(f"/v1/cluster/members/{node.node_id}/decommission?dry_run=true")
    assert r.status == 200, r
    d = r.json()
    assert d["member"] == node.node_id and d["would_decommission"] is False
    assert d["voter"] is True and d["owned_partitions"] == 3 and d["inbound_moves"] == 0
    codes = {x["code"] for x in d["reasons"]}
    assert {"below_min_voters", "no_receivers"} <= codes, d
    assert all(x["message"] for x in d["reasons"])
    assert member(node)["draining"] is False


def test_decommission_refusals_leave_the_member_as_it_was(node: Node) -> None:
    path = f"/v1/cluster/members/{node.node_id}/decommission"
    r = node.post(path)
    assert r.status == 409, r
    body = r.json()
    assert {x["code"] for x in body["reasons"]} >= {"below_min_voters", "no_receivers"}
    assert "refused" in body["error"]
    for method, p, want in (("POST", f"{path}?dry_run=maybe", 400), ("POST", f"{path}?dry_run=1&dry_run=0", 400),
                            ("DELETE", f"{path}?dry_run=true", 400), ("DELETE", f"{path}?dry_run=false", 400),
                            ("POST", "/v1/cluster/members/n9/decommission", 404),
                            ("POST", "/v1/cluster/members/n9/decommission?dry_run=true", 404),
                            ("DELETE", "/v1/cluster/members/n9/decommission", 404)):
        got = node.request(method, p)
        assert got.status == want, (method, p, got)
        assert got.json()["error"], got
    assert node.post(path, auth=PLAIN).status == 403
    assert node.request("DELETE", path, auth=PLAIN).status == 403
    assert node.post(path, headers={"X-Narad-Client": ""}).status == 415
    # cancelling a decommission that is not under way changes nothing
    assert node.request("DELETE", path).status == 204
    m = member(node)
    assert m["draining"] is False and "decommission_blocked" not in m
    assert node.post("/v1/topics/mv-t/produce", b"still-accepted",
                     headers={"Content-Type": "application/octet-stream"}).status == 202


def test_abort_refusals(node: Node) -> None:
    for p, want in (("mv-t/x/abort", 400), ("mv-t/-1/abort", 400), ("mv-t/0/abort?target=", 400),
                    ("mv-t/0/abort?target=a&target=b", 400), ("mv-t/0/abort?target=%FF", 400),
                    ("mv-t/99999999999999999999/abort", 400), ("mv-none/0/abort", 404), ("mv-t/3/abort", 404),
                    ("mv-t/0/abort", 409), (f"mv-t/0/abort?target={node.node_id}", 409)):
        r = node.post(f"/v1/cluster/moves/{p}")
        assert r.status == want, (p, r)
        assert r.json()["error"], r
    assert "no move" in node.post("/v1/cluster/moves/mv-t/1/abort").json()["error"]
    assert node.post("/v1/cluster/moves/mv-t/0/abort", auth=PLAIN).status == 403
    assert node.post("/v1/cluster/moves/mv-t/0/abort", headers={"X-Narad-Client": ""}).status == 415
    assert node.get("/v1/cluster/moves").json() == {"moves": []}


def test_members_detail_move_fields(node: Node) -> None:
    m = node.get("/v1/cluster/members?detail=true").json()["members"][0]
    assert m["outbound_moves"] == 0 and "decommission_blocked" not in m
    st = m["node_status"]
    assert st["node"] == node.node_id and st["draining"] is False
    assert st["moves"] == [] and st["quarantine"] == {"copies": 0, "bytes": 0, "list": []}


def test_sdk_calls(node: Node) -> None:
    with Client(f"127.0.0.1:{node.port}", auth=("admin", ADMIN_PASSWORD)) as c:
        assert c.moves() == [] and c.moves(detail=True) == []
        assert [m["id"] for m in c.members(detail=True)] == [node.node_id]
        d = c.decommission(node.node_id, dry_run=True)
        assert d is not None and d["would_decommission"] is False
        with pytest.raises(Conflict) as e:
            c.decommission(node.node_id)
        assert "below_min_voters" in {x["code"] for x in e.value.body["reasons"]}
        c.cancel_decommission(node.node_id)
        with pytest.raises(Conflict):
            c.abort_move("mv-t", 0)


def test_narad_cli_commands(node: Node) -> None:
    assert narad(node, "cluster", "moves").stdout.strip().startswith("{")
    assert json.loads(narad(node, "cluster", "moves", "--detail").stdout) == {"moves": []}
    assert narad(node, "--json", "cluster", "moves").stdout == ""  # JSON Lines: one per move, none here
    d = json.loads(narad(node, "--json", "cluster", "decommission", node.node_id, "--dry-run").stdout)
    assert d["would_decommission"] is False and d["reasons"]
    r = narad(node, "cluster", "decommission", node.node_id, code=1)
    assert "HTTP 409" in r.stderr and "below_min_voters" in r.stderr
    r = narad(node, "cluster", "decommission", node.node_id, "--cancel")
    assert "cancelled" in r.stderr
    r = narad(node, "cluster", "moves", "abort", "mv-t", "0", code=1)
    assert "HTTP 409" in r.stderr and "no move" in r.stderr
    narad(node, "cluster", "moves", "abort", "mv-t", "x", code=2)
    narad(node, "cluster", "decommission", node.node_id, "--dry-run", "--cancel", code=2)
    r = narad(node, "cluster", "members", "forget", "n9", code=1)
    assert "HTTP 404" in r.stderr
    narad(node, "cluster", "members", "--detail", "forget", "n9", code=2)
    rows = [json.loads(x) for x in narad(node, "--json", "cluster", "members", "--detail").stdout.splitlines()]
    assert [m["id"] for m in rows] == [node.node_id] and rows[0]["node_status"]["moves"] == []
    assert member(node)["draining"] is False


def test_naradctl_commands(node: Node) -> None:
    assert node.ctl("moves", "--detail") == {"moves": []}
    assert naradctl._fmt_moves({"moves": []}) == "no partition moves in flight"
    d = node.ctl("members", "decommission", node.node_id, "--dry-run")
    assert "would NOT be decommissioned" in naradctl._fmt_decommission(d) and "below_min_voters" in \
        naradctl._fmt_decommission(d)
    assert d["would_decommission"] is False and {"below_min_voters", "no_receivers"} <= {
        x["code"] for x in d["reasons"]}
    p = node.ctl("members", "decommission", node.node_id, check=False)
    assert p.returncode == 1 and "HTTP 409" in p.stderr
    assert node.ctl("members", "decommission", node.node_id, "--cancel") == {"member": node.node_id,
                                                                              "draining": False}
    p = node.ctl("moves", "abort", "mv-t", "0", check=False)
    assert p.returncode == 1 and "HTTP 409" in p.stderr
    p = node.ctl("moves", "abort", "mv-t", "zero", check=False)
    assert p.returncode == 1 and "HTTP 400" in p.stderr and "partition" in p.stderr


def test_move_rows_from_a_real_metastore(tmp_path: Path) -> None:
    """The listing GET /v1/cluster/moves renders, from an FSM-written LMDB file: both
    ends' status (alive, draining, dead), ``blocked``, only rows of the live
    incarnation, (topic, partition) order; and detail's runner or its absence."""
    a = Applier(tmp_path / "fsm")
    for nid in ("n1", "n2", "n3", "n4"):
        assert a.apply(C.RegisterMember(MemberRecord(nid, f"127.0.0.1:{nid[1]}"))).ok
    assert a.apply(C.CreateTopic(topic("b", "00000000000000bb", parts=2))).ok
    assert a.apply(C.CreateTopic(topic("a", "00000000000000aa", parts=3))).ok
    assert a.apply(C.AssignPartitions("b", "00000000000000bb", [(0, "n1"), (1, "n2")])).ok
    assert a.apply(C.AssignPartitions("a", "00000000000000aa", [(0, "n1"), (1, "n1"), (2, "n3")])).ok
    rows = [("b", "00000000000000bb", 1, "n2", "n3"), ("a", "00000000000000aa", 2, "n3", "n4"),
            ("a", "00000000000000aa", 0, "n1", "n2")]
    assert a.apply(C.SetMoveTargets([C.MoveTargetRow(t, tid, p, o, None, to) for t, tid, p, o, to in rows])).ok
    assert a.apply(C.SetDraining("n2", True)).ok
    assert a.apply(C.MarkDead("n4")).ok
    r = a.read()
    got = ops.moves_in(r)
    assert [(m.topic, m.partition, m.from_, m.to, m.from_status, m.to_status, m.blocked) for m in got] == [
        ("a", 0, "n1", "n2", "alive", "draining", None),
        ("a", 2, "n3", "n4", "alive", "dead", "target_dead"),
        ("b", 1, "n2", "n3", "draining", "alive", None)]
    assert ops.move_json(got[1]) == {"topic": "a", "partition": 2, "from": "n3", "to": "n4", "from_status": "alive",
                                     "to_status": "dead", "blocked": "target_dead"}
    r.txn.abort()
    # the owner dies: its move is blocked on the source
    assert a.apply(C.MarkDead("n3")).ok
    r = a.read()
    got = ops.moves_in(r)
    assert [(m.partition, m.from_status, m.blocked) for m in got if m.topic == "a"] == [
        (0, "alive", None), (2, "dead", "target_dead")]
    assert [(m.from_status, m.to_status, m.blocked) for m in got if m.topic == "b"] == [
        ("draining", "dead", "target_dead")]
    r.txn.abort()
    # detail: the destination's runner, or why there is none
    runner = Q.MoveWorkerView("a", 0, "n1", "n2", "2026-01-01T00:00:00Z", "copying", copied_bytes=42)
    ops.attach_workers(got, {"n2": Q.NodeStatusView("n2", True, 0, 0, [runner]), "n3": "member is marked dead"})
    assert [ops.move_json(m).get("worker", {}).get("copied_bytes") for m in got] == [42, None, None]
    assert ops.move_json(got[0])["worker"]["phase"] == "copying" and "blocked" not in ops.move_json(got[0])["worker"]
    assert got[1].worker_error == "node n4 is marked dead: not asked" and got[2].worker_error == "member is marked dead"
    assert ops.destinations(got) == ["n2"]
    # a deleted topic's rows are not moves any more
    assert a.apply(C.DeleteTopic("a")).ok
    r = a.read()
    assert [(m.topic, m.partition) for m in ops.moves_in(r)] == [("b", 1)]
    r.txn.abort()


def test_decommission_a_voter_of_four(tmp_path: Path) -> None:
    """Four voters: n4's removal keeps three, so its decommission is accepted (204).
    Once n4's replica holds the mark it answers every produce 503 with Retry-After
    (nothing stored: the SDK goes on to the next node) while the others accept. The
    planner gives n4's partition a target, which every view shows (the copy is held
    by a test seam so it stays in flight): the move list, its runner on the
    destination (detail, over HTTP and naradctl), the member's outbound move. A
    compare-and-set abort on the wrong target is refused, on the right one answers
    202; the cancel makes n4 take produce again; exactly the accepted records are
    stored."""
    env = {"NARAD_MOVE_PLAN_MS": "300", "NARAD_FAULT_MOVE_CHUNK_DELAY_MS": "60000"}
    c = Cluster(tmp_path, 4, env=env).start()
    try:
        n1, n4 = c["n1"], c["n4"]
        octet = {"Content-Type": "application/octet-stream"}
        assert n1.post("/v1/topics", {"name": "dr", "partitions": 4}).status == 201
        own = {s["index"]: s["owner_node"] for s in n1.get("/v1/topics/dr").json()["partition_stats"]}
        [p4] = [p for p, o in own.items() if o == "n4"]
        assert n4.post(f"/v1/topics/dr/produce?partition={p4}", b"before", headers=octet).status == 202
        dry = n1.post("/v1/cluster/members/n4/decommission?dry_run=true").json()
        conforms(dry, "DecommissionDryRun")
        assert dry["would_decommission"] is True and dry["reasons"] == [] and dry["voter"] is True, dry
        assert dry["owned_partitions"] == 1 and dry["inbound_moves"] == 0
        assert n1.post("/v1/cluster/members/n4/decommission").status == 204
        early = []  # produces n4 took before its replica applied the mark (stored)

        def refused() -> Any:
            r = n4.post("/v1/topics/dr/produce", b"early", headers=octet)
            if r.status == 202:
                early.append(r)
            return r if r.status == 503 else None

        r = wait_for(refused, 15, what="n4's replica to see it draining")
        assert r.json() == {"error": messages.DRAINING} and r.headers.get("retry-after") == "1"
        r = n4.post("/v1/topics/dr/produce/batch", {"messages": [{"payload": 1}, {"payload": 2}]})
        assert r.status == 503 and r.json() == {"error": messages.DRAINING}, r
        assert n1.post("/v1/topics/dr/produce", b"elsewhere", headers=octet).status == 202
        with Client([f"127.0.0.1:{n4.port}", f"127.0.0.1:{n1.port}"], auth=("admin", ADMIN_PASSWORD)) as sdk:
            sdk.produce("dr", b"via-sdk")  # n4 refuses, n1 stores it

        # the planner's move of n4's partition, as every view shows it
        def planned() -> Any:
            got = n1.get("/v1/cluster/moves?detail=true").json()["moves"]
            return got if got and "worker" in got[0] else None

        [mv] = wait_for(planned, 30, what="a move of n4's partition with its runner")
        conforms({"moves": [mv]}, "Moves")
        to = mv["to"]
        assert (mv["topic"], mv["partition"], mv["from"], mv["from_status"], mv["to_status"]) == (
            "dr", p4, "n4", "draining", "alive") and to in ("n1", "n2", "n3") and "blocked" not in mv, mv
        w = mv["worker"]
        assert (w["topic"], w["partition"], w["source"], w["target"], w["phase"]) == ("dr", p4, "n4", to, "copying")
        assert [(m["from"], m["to"]) for m in n4.get("/v1/cluster/moves").json()["moves"]] == [("n4", to)]
        ctl = n1.ctl("moves", "--detail")
        assert [(m["to"], m["worker"]["phase"]) for m in ctl["moves"]] == [(to, "copying")]
        assert "n4 draining" in naradctl._fmt_moves(ctl) and "copying" in naradctl._fmt_moves(ctl)
        members = n1.get("/v1/cluster/members?detail=true").json()
        conforms(members, "Members")
        assert [ln.split()[2] for ln in naradctl._fmt_members(members).splitlines() if ln.startswith("n4 ")] == [
            "draining"]
        rows = {m["id"]: m for m in members["members"]}
        assert rows["n4"]["draining"] is True and rows["n4"]["outbound_moves"] == 1
        assert rows["n4"]["node_status"]["draining"] is True
        assert [(x["topic"], x["phase"]) for x in rows[to]["node_status"]["moves"]] == [("dr", "copying")]
        wrong = next(x for x in ("n1", "n2", "n3") if x != to)
        r = n1.post(f"/v1/cluster/moves/dr/{p4}/abort?target={wrong}")
        assert r.status == 409 and to in r.json()["error"], r
        r = n1.post(f"/v1/cluster/moves/dr/{p4}/abort?target={to}")
        assert r.status == 202, r
        d = r.json()
        conforms(d, "AbortResult")
        assert {k: d["move"][k] for k in ("topic", "partition", "from", "to")} == {
            "topic": "dr", "partition": p4, "from": "n4", "to": to} and d["note"], d

        assert n1.request("DELETE", "/v1/cluster/members/n4/decommission").status == 204
        wait_for(lambda: n4.post("/v1/topics/dr/produce", b"after", headers=octet).status == 202, 15,
                 what="n4 to take produce again after the cancel")
        assert n1.request("DELETE", "/v1/cluster/members/n4/decommission").status == 204  # not draining: no-op
        assert own == {s["index"]: s["owner_node"] for s in n1.get("/v1/topics/dr").json()["partition_stats"]}

        # what was accepted is stored, nothing refused is: before, early, elsewhere, via-sdk, after
        def stored() -> int:
            return sum(p["high_watermark"] for p in n1.get("/v1/topics/dr").json()["partition_stats"])

        want = 4 + len(early)
        wait_for(lambda: stored() >= want, 15, what="the accepted records to commit")
        assert stored() == want
    finally:
        c.close()
