"""The client-facing side of fan-out children (issue 11) on one real node: create
with ``parent`` (route 1), attach / list / detach (routes 7-9), the topic JSON
fields of every topic answer, the 409 on a produce to a delay child (single, the
synchronous fast path, batch) and naradctl's ``topics attach|detach|children``.

One module-scoped node (security on, two workers, users for the grant cases) is
shared by every test; each test uses its own topic names. Copying itself is the
engine's (tests/test_fanout_cluster.py); one smoke test here checks a message
produced to a parent reaches an attached child.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from narad.api.topics import topic_json
from narad.broker.routing import owner_worker
from narad.meta.records import TopicRecord
from tests.harness import Node, basic, wait_for

OCTET = {"Content-Type": "application/octet-stream"}
ALICE = basic("alice", "alice-pw")  # create on fo-*: owns what she creates
BOB = basic("bob", "bob-pw")  # consume on fo-*: reads every fo- topic, manages none
CAROL = basic("carol", "carol-pw")  # no grant at all
YEAR_MS = 31_536_000_000


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("fanout-api") / "data", workers=2).start()
    try:
        for user, grants in (("alice", [{"action": "create", "patterns": ["fo-*"]}]),
                             ("bob", [{"action": "consume", "patterns": ["fo-*"]}]), ("carol", [])):
            r = n.post("/v1/users", {"username": user, "password": f"{user}-pw", "grants": grants})
            assert r.status == 201, r
        yield n
    finally:
        n.close()


def create(n: Node, body: dict[str, Any], auth: str | bool = True) -> dict[str, Any]:
    r = n.post("/v1/topics", body, auth=auth)
    assert r.status == 201, r
    return r.json()  # type: ignore[no-any-return]


def describe(n: Node, name: str) -> dict[str, Any]:
    r = n.get(f"/v1/topics/{name}")
    assert r.status == 200, r
    return r.json()  # type: ignore[no-any-return]


def attach(n: Node, parent: str, child: str, auth: str | bool = True, **extra: Any) -> dict[str, Any]:
    r = n.post(f"/v1/topics/{parent}/children", {"child": child, **extra}, auth=auth)
    assert r.status == 200, r
    return r.json()  # type: ignore[no-any-return]


def error(r: Any, status: int) -> str:
    assert r.status == status, r
    return r.json()["error"]  # type: ignore[no-any-return]


def committed(n: Node, name: str) -> list[int]:
    return [s["high_watermark"] for s in describe(n, name)["partition_stats"]]


TOPIC_KEYS = {"name", "id", "partitions", "retention_ms", "visibility_timeout_ms", "max_in_flight_per_partition",
              "max_acked_ahead_per_partition", "created_at", "owner"}


# ---- the JSON shapes, without a node ------------------------------------------------------------
def test_topic_json_carries_the_fanout_fields_of_each_role() -> None:
    base = dict(id="00112233aabbccdd", partitions=3, retention_ms=0, visibility_timeout_ms=30000,
                max_in_flight_per_partition=1024, max_acked_ahead_per_partition=1024, created_at=1)
    alone = topic_json(TopicRecord(name="s", **base))  # type: ignore[arg-type]
    assert "role" not in alone and "children" not in alone and "parent" not in alone
    par = topic_json(TopicRecord(name="p", children=["a", "b"], **base))  # type: ignore[arg-type]
    assert par["role"] == "parent" and par["children"] == ["a", "b"] and "parent" not in par
    child = topic_json(TopicRecord(name="a", parent="p", parent_id="ffeeddccbbaa9988", attach_epoch="0123456789abcdef",
                                   attach_offsets=[4, 0, 7], **base))  # type: ignore[arg-type]
    assert child["role"] == "child" and child["parent"] == "p" and child["attach_epoch"] == "0123456789abcdef"
    assert child["attach_offsets"] == [4, 0, 7] and child["delay_ms"] == 0
    assert "fanout_delay_ms" not in child and "children" not in child and "parent_id" not in child
    slow = topic_json(TopicRecord(name="d", parent="p", parent_id="ffeeddccbbaa9988", delay_ms=60_000,
                                  attach_epoch="0123456789abcdef", attach_offsets=[0, 0, 0], **base))  # type: ignore[arg-type]
    assert slow["delay_ms"] == 60_000 and slow["fanout_delay_ms"] == 60_000  # ours and Narad's name
    assert json.loads(json.dumps(slow)) == slow


# ---- routes 7-9 ------------------------------------------------------------------------------------
def test_attach_list_detach_and_the_topic_answers(node: Node) -> None:
    create(node, {"name": "fo-par", "partitions": 4})
    create(node, {"name": "fo-kid", "partitions": 3})
    for i in range(6):
        assert node.request("POST", f"/v1/topics/fo-par/produce?partition={i % 4}", b"m%d" % i,
                            headers=OCTET).status == 202
    wait_for(lambda: sum(committed(node, "fo-par")) == 6, 20, 0.05, "six committed parent messages")
    point = committed(node, "fo-par")
    par = attach(node, "fo-par", "fo-kid")
    assert set(par) == TOPIC_KEYS | {"role", "children"}, par  # the parent Topic
    assert par["name"] == "fo-par" and par["role"] == "parent" and par["children"] == ["fo-kid"]
    kid = describe(node, "fo-kid")
    assert kid["role"] == "child" and kid["parent"] == "fo-par" and kid["delay_ms"] == 0
    assert re.fullmatch(r"[0-9a-f]{16}", kid["attach_epoch"]), kid
    assert kid["attach_offsets"] == point, (kid, point)  # the committed high watermark per partition
    assert "fanout_delay_ms" not in kid and "children" not in kid and "partition_stats" in kid
    listed = {t["name"]: t for t in node.get("/v1/topics").json()["topics"]}
    assert listed["fo-par"]["children"] == ["fo-kid"] and listed["fo-kid"]["parent"] == "fo-par"
    altered = node.request("PATCH", "/v1/topics/fo-par", {"retention_ms": 0})
    assert altered.status == 200 and altered.json()["children"] == ["fo-kid"], altered
    r = node.get("/v1/topics/fo-par/children")
    assert r.status == 200, r
    body = r.json()
    assert set(body) == {"parent", "parent_id", "children"} and body["parent"] == "fo-par"
    assert body["parent_id"] == par["id"] and [c["name"] for c in body["children"]] == ["fo-kid"]
    row = body["children"][0]
    assert set(row) == {"name", "delay_ms", "lag_messages", "lag_complete"} and row["delay_ms"] == 0
    assert isinstance(row["lag_messages"], int) and isinstance(row["lag_complete"], bool)
    lone = node.get("/v1/topics/fo-kid/children")  # not a parent: an empty list
    assert lone.status == 200 and lone.json()["children"] == [], lone
    # Detach: 204; both become standalone, the child keeps its messages.
    assert node.request("DELETE", "/v1/topics/fo-par/children/fo-kid").status == 204
    for name in ("fo-par", "fo-kid"):
        d = describe(node, name)
        assert not {"role", "children", "parent", "attach_epoch", "attach_offsets", "delay_ms"} & set(d), d
    assert node.get("/v1/topics/fo-par/children").json()["children"] == []
    assert "not" in error(node.request("DELETE", "/v1/topics/fo-par/children/fo-kid"), 404)
    # Detach and re-attach starts a fresh copy: a new epoch at the new attach point.
    again = attach(node, "fo-par", "fo-kid")
    assert again["children"] == ["fo-kid"]
    assert describe(node, "fo-kid")["attach_epoch"] != kid["attach_epoch"]


def test_attach_status_codes(node: Node) -> None:
    for name in ("fo-a", "fo-a-c", "fo-a-x"):
        create(node, {"name": name}, auth=ALICE)
    create(node, {"name": "fo-admins"})  # owned by admin: alice does not manage it
    create(node, {"name": "fo-short", "retention_ms": 3_600_000})

    def post(path: str, body: Any, auth: str | bool = True) -> Any:
        return node.post(path, body, auth=auth)

    p = "/v1/topics/fo-a/children"
    assert "child required" in error(post(p, {}), 400)
    assert "child required" in error(post(p, {"child": ""}), 400)
    assert "own child" in error(post(p, {"child": "fo-a"}), 400)
    assert "must be from 0 to" in error(post(p, {"child": "fo-a-c", "delay_ms": -1}), 400)
    assert "must be from 0 to" in error(post(p, {"child": "fo-a-c", "delay_ms": YEAR_MS + 1}), 400)
    e = error(post(p, {"child": "fo-a-c", "fanout_delay_ms": 5}), 400)
    assert e == 'invalid json: unknown field "fanout_delay_ms"', e  # the create's name for the delay
    assert "unknown field" in error(post(p, {"child": "fo-a-c", "colour": 1}), 400)
    assert "topic name" in error(post(p, {"child": "bad/name"}), 400)
    assert "only with remote" in error(post(p, {"child": "fo-a-c", "lanes": 2}), 400)
    assert "only with remote" in error(post(p, {"child": "fo-a-c", "from": "earliest"}), 400)
    e = error(post(p, {"child": "fo-a-c", "remote": "b"}), 501)
    assert e == "remote children are not implemented by this node yet", e
    assert post(p, {"child": "fo-a-c", "remote": "b", "dry_run": True}).status == 501
    big = node.post(p, b'{"child": "' + b"x" * (1 << 20) + b'"}', headers={"Content-Type": "application/json"})
    assert big.status == 400, big  # Narad answers an oversized attach body 400, not 413
    assert error(post(p, b"["), 400).startswith("invalid json")
    # 404: a topic missing (on the leader too)
    assert error(post(p, {"child": "fo-nope"}), 404)
    assert error(post("/v1/topics/fo-nope/children", {"child": "fo-a-c"}), 404)
    # 403: manage rights on both
    e = error(post(p, {"child": "fo-a-c"}, auth=BOB), 403)
    assert e == 'only the owner of topic "fo-a" or an admin may modify it', e
    e = error(post(p, {"child": "fo-admins"}, auth=ALICE), 403)
    assert e == 'only the owner of topic "fo-admins" or an admin may modify it', e
    e = error(post("/v1/topics/fo-admins/children", {"child": "fo-a-c"}, auth=ALICE), 403)
    assert '"fo-admins"' in e, e
    # 409: the fan-out rules (checked by the leader)
    assert "fo-short" in error(post("/v1/topics/fo-short/children", {"child": "fo-a-x", "delay_ms": 1}), 409)
    par = attach(node, "fo-a", "fo-a-c", auth=ALICE)  # the owner of both
    assert par["owner"] == "alice" and par["children"] == ["fo-a-c"]
    assert post("/v1/topics/fo-a-x/children", {"child": "fo-a-c"}).status == 409  # already has a parent
    assert post("/v1/topics/fo-a-c/children", {"child": "fo-a-x"}).status == 409  # a child has no children
    assert post("/v1/topics/fo-a-x/children", {"child": "fo-a"}).status == 409  # a parent cannot be a child
    assert describe(node, "fo-a")["children"] == ["fo-a-c"] and "role" not in describe(node, "fo-a-x")


def test_attach_and_create_as_child_answer_503_when_an_owner_does_not_answer(node: Node) -> None:
    create(node, {"name": "fo-stall", "partitions": 12})
    create(node, {"name": "fo-stall-c"})
    owners = {s["owner_node"] for s in describe(node, "fo-stall")["partition_stats"]}
    assert owners == {node.node_id}
    workers = node.status()["workers"]
    assert len(workers) == 2 and 1 in {owner_worker("fo-stall", p, 2) for p in range(12)}
    # Ask through worker 0 while worker 1 (which owns some of the 12 partitions) is stopped.
    conn = node.worker_connection(0)
    victim = next(w["pid"] for w in workers if w["index"] == 1)
    os.kill(victim, signal.SIGSTOP)
    try:
        r = node.post("/v1/topics/fo-stall/children", {"child": "fo-stall-c"}, conn=conn)
        e = error(r, 503)
        assert e == ('could not ask the owners of every partition of "fo-stall" for the attach point; '
                     "nothing was linked, retry"), e
        r = node.post("/v1/topics", {"name": "fo-stall-r", "parent": "fo-stall"}, conn=conn)
        assert "fo-stall" in error(r, 503)
    finally:
        os.kill(victim, signal.SIGCONT)
        conn.close()
    assert node.get("/v1/topics/fo-stall-r").status == 404  # nothing was created
    assert "role" not in describe(node, "fo-stall") and "role" not in describe(node, "fo-stall-c")
    # With the owner answering again the same requests succeed.
    assert attach(node, "fo-stall", "fo-stall-c")["children"] == ["fo-stall-c"]


def test_children_listing_needs_a_grant_on_the_parent(node: Node) -> None:
    create(node, {"name": "fo-l"})
    create(node, {"name": "fo-l-d"})
    create(node, {"name": "other-l"})
    attach(node, "fo-l", "fo-l-d", delay_ms=90_000)
    r = node.get("/v1/topics/fo-l/children", auth=BOB)  # any grant matching the parent
    assert r.status == 200 and r.json()["children"][0]["delay_ms"] == 90_000, r
    assert error(node.get("/v1/topics/fo-l/children", auth=CAROL), 403) == "no grant on this topic"
    assert error(node.get("/v1/topics/other-l/children", auth=BOB), 403) == "no grant on this topic"
    assert node.get("/v1/topics/fo-nothing/children", auth=CAROL).status == 404
    assert node.get("/v1/topics/fo-l/children?partitions=maybe").status == 400
    assert node.get("/v1/topics/fo-l/children?partitions=true").status == 200
    assert node.get("/v1/topics/fo-l/children", auth=False).status == 401
    d = describe(node, "fo-l-d")
    assert d["delay_ms"] == 90_000 and d["fanout_delay_ms"] == 90_000 and d["role"] == "child"


def test_detach_status_codes_and_the_child_keeps_its_schema_history(node: Node) -> None:
    schema = {"type": "object", "required": ["id"]}
    create(node, {"name": "fo-s", "schema": schema}, auth=ALICE)
    create(node, {"name": "fo-s-c"})  # admin's, no schema: adopts the parent's history
    create(node, {"name": "fo-s-k"}, auth=ALICE)
    attach(node, "fo-s", "fo-s-c")
    attach(node, "fo-s", "fo-s-k", auth=ALICE)
    hist = node.get("/v1/topics/fo-s-c/schema").json()
    assert hist["version"] == 1 and hist["versions"][0]["schema"] == schema, hist
    assert node.request("DELETE", "/v1/topics/fo-s/children/fo-nope").status == 404
    assert node.request("DELETE", "/v1/topics/fo-nope/children/fo-s-c").status == 404
    assert node.request("DELETE", "/v1/topics/fo-s-c/children/fo-s").status == 404  # not linked that way
    e = error(node.request("DELETE", "/v1/topics/fo-s/children/fo-s-c", auth=BOB), 403)
    assert "fo-s" in e, e
    assert node.request("DELETE", "/v1/topics/fo-s/children/fo-s-c?force=perhaps").status == 400
    # Manage rights on either topic: alice owns the parent only.
    assert node.request("DELETE", "/v1/topics/fo-s/children/fo-s-c", auth=ALICE).status == 204
    d = describe(node, "fo-s-c")
    assert "role" not in d and d["schema_version"] == 1 and d["schema"] == schema
    assert node.get("/v1/topics/fo-s-c/schema").json() == hist  # the history stays with the child
    assert describe(node, "fo-s")["children"] == ["fo-s-k"]


# ---- route 1 with parent --------------------------------------------------------------------------
def test_create_as_child(node: Node) -> None:
    create(node, {"name": "fo-c", "partitions": 5}, auth=ALICE)
    create(node, {"name": "fo-c-admins", "partitions": 4})
    rep = create(node, {"name": "fo-c-rep", "parent": "fo-c"}, auth=ALICE)
    assert rep["partitions"] == 5, rep  # the parent's count when partitions is left out
    assert rep["role"] == "child" and rep["parent"] == "fo-c" and rep["owner"] == "alice"
    assert len(rep["attach_offsets"]) == 5 and re.fullmatch(r"[0-9a-f]{16}", rep["attach_epoch"])
    assert set(rep) == TOPIC_KEYS | {"role", "parent", "delay_ms", "attach_epoch", "attach_offsets"}, rep
    d = create(node, {"name": "fo-c-d", "parent": "fo-c", "fanout_delay_ms": 7_200_000, "partitions": 3})
    assert d["partitions"] == 3 and d["delay_ms"] == 7_200_000 and d["fanout_delay_ms"] == 7_200_000
    assert describe(node, "fo-c")["children"] == ["fo-c-d", "fo-c-rep"]
    plain = create(node, {"name": "fo-c-plain"})
    assert "role" not in plain and "parent" not in plain  # as Narad: absent on a plain create

    def post(body: dict[str, Any], auth: str | bool = True) -> Any:
        return node.post("/v1/topics", body, auth=auth)

    assert "needs parent" in error(post({"name": "fo-c-x", "fanout_delay_ms": 5}), 400)
    e = error(post({"name": "fo-c-x", "parent": "fo-c", "delay_ms": 5}), 400)
    assert e == 'invalid json: unknown field "delay_ms"', e  # the attach's name for the delay
    assert "own parent" in error(post({"name": "fo-c-x", "parent": "fo-c-x"}), 400)
    assert "topic name" in error(post({"name": "fo-c-x", "parent": "no/pe"}), 400)
    assert "must be from 0 to" in error(post({"name": "fo-c-x", "parent": "fo-c", "fanout_delay_ms": YEAR_MS + 1}), 400)
    assert post({"name": "fo-c-x", "parent": "fo-c-nope"}).status == 404
    e = error(post({"name": "fo-c-x", "parent": "fo-c-admins"}, auth=ALICE), 403)
    assert e == 'only the owner of topic "fo-c-admins" or an admin may modify it', e
    assert error(post({"name": "fo-c-x", "parent": "fo-c"}, auth=CAROL), 403).startswith("create not allowed")
    assert post({"name": "fo-c-x", "parent": "fo-c-rep"}).status == 409  # no grandchildren
    assert post({"name": "fo-c-x", "parent": "fo-c", "schema": {"type": "string"}}).status == 409  # differs
    assert post({"name": "fo-c-rep", "parent": "fo-c"}).status == 409  # exists
    assert node.get("/v1/topics/fo-c-x").status == 404  # every refused create left nothing behind


# ---- produce to a delay child --------------------------------------------------------------------
def _rejections(node: Node, topic: str) -> float:
    needle = f'narad_produce_rejections_total{{reason="delayed_child",topic="{topic}"}}'
    alt = f'narad_produce_rejections_total{{topic="{topic}",reason="delayed_child"}}'
    for line in node.get("/metrics").body.decode().splitlines():
        if line.startswith(needle + " ") or line.startswith(alt + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_produce_to_a_delay_child_is_409_single_fast_path_and_batch(node: Node) -> None:
    create(node, {"name": "fo-p"})
    create(node, {"name": "fo-p-d", "parent": "fo-p", "fanout_delay_ms": 60_000})
    create(node, {"name": "fo-p-now", "parent": "fo-p"})
    want = 'topic "fo-p-d" is a delay child of "fo-p"; produce to the parent'
    conn = node.conn()  # one connection: after the first request the credential is cached and
    try:                # the next produces take the synchronous entry (RoutedApp.handle_fast)
        for _ in range(3):
            r = node.request("POST", "/v1/topics/fo-p-d/produce?key=k", b"x", headers=OCTET, conn=conn)
            assert error(r, 409) == want
        r = node.post("/v1/topics/fo-p-d/produce/batch", {"messages": [{"payload": 1}]}, conn=conn)
        assert error(r, 409) == want
    finally:
        conn.close()
    assert node.request("POST", "/v1/topics/fo-p-d/produce", b"x", headers=OCTET, auth=CAROL).status == 403
    assert node.request("POST", "/v1/topics/fo-p-now/produce", b"x", headers=OCTET).status == 202  # plain child
    wait_for(lambda: _rejections(node, "fo-p-d") == 4, 10, 0.1, "four delayed_child rejections counted")
    # Detached, it is an ordinary topic again.
    assert node.request("DELETE", "/v1/topics/fo-p/children/fo-p-d").status == 204
    assert node.request("POST", "/v1/topics/fo-p-d/produce", b"x", headers=OCTET).status == 202


# ---- naradctl --------------------------------------------------------------------------------------
def test_naradctl_attach_children_describe_detach(node: Node) -> None:
    create(node, {"name": "fo-ctl", "partitions": 3})
    create(node, {"name": "fo-ctl-d"})
    par = node.ctl("topics", "attach", "fo-ctl", "fo-ctl-d", "--delay-ms", "120000")
    assert par["role"] == "parent" and par["children"] == ["fo-ctl-d"], par
    d = node.ctl("topics", "describe", "fo-ctl-d")
    assert d["role"] == "child" and d["parent"] == "fo-ctl" and d["delay_ms"] == 120_000
    assert len(d["attach_offsets"]) == 3 and d["lag_complete"] is True and d["lag_messages"] == 0, d
    assert describe(node, "fo-ctl-d")["attach_epoch"] == d["attach_epoch"]  # what HTTP sees
    kids = node.ctl("topics", "children", "fo-ctl")
    assert kids["parent"] == "fo-ctl" and kids["parent_id"] == par["id"], kids
    assert kids["children"] == [{"name": "fo-ctl-d", "delay_ms": 120_000, "lag_messages": 0, "lag_complete": True}]
    bad = node.ctl("topics", "attach", "fo-ctl", "fo-ctl-nope", check=False)
    assert bad.returncode == 1 and "404" in bad.stderr, bad.stderr
    assert node.ctl("topics", "detach", "fo-ctl", "fo-ctl-d")["detached"] == "fo-ctl-d"
    assert "role" not in describe(node, "fo-ctl-d") and "role" not in describe(node, "fo-ctl")


# ---- one smoke check of the copy (the engine's) ---------------------------------------------------
def test_a_message_produced_to_a_parent_is_consumed_from_an_attached_child(node: Node) -> None:
    create(node, {"name": "fo-e"})
    create(node, {"name": "fo-e-c", "parent": "fo-e"})
    assert node.request("POST", "/v1/topics/fo-e/produce?key=k1", b"copied", headers=OCTET).status == 202

    def got() -> Any:
        r = node.get("/v1/topics/fo-e-c/consume?wait=1s")
        return r.json() if r.status == 200 else None

    m = wait_for(got, 20, 0.0, "the copy in the child")
    assert m["payload"] == "copied" and m["key"] == "k1" and m["topic"] == "fo-e-c"

    def caught_up() -> bool:
        (row,) = node.get("/v1/topics/fo-e/children").json()["children"]
        return row["lag_complete"] is True and row["lag_messages"] == 0

    wait_for(caught_up, 20, 0.05, "the listing to report the child caught up, every partition answering")
