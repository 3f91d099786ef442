"""The OpenAPI document (narad/api/openapi.json) kept true against the code and a real node.

- It is a valid OpenAPI 3.1 document, and GET /v1/openapi.json serves it byte for byte
  without credentials.
- Every route the router serves has an operation, and every operation a route (the table
  is read from the API classes' own ``register``), with the same path parameters.
- Every status an operation lists is produced by a real request against one real node
  (security on): a table of (operationId, status) -> request recipe, plus generic recipes
  for 401 (no credentials), 429 (a user locked by wrong passwords) and 415 (no content
  type, no X-Narad-Client). A listed status without a recipe fails the test, and so does a
  recipe whose status the document does not list. The few statuses one node cannot produce
  are in ALLOWED_UNPRODUCED, each with the reason. Each JSON answer is validated against the
  schema the document gives for that status.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import narad.api
from narad.api import messages, ops, topics, users
from narad.api.router import Router

from .harness import Node, Response, basic, wait_for

DOC_PATH = Path(narad.api.__file__).parent / "openapi.json"
DOC: dict[str, Any] = json.loads(DOC_PATH.read_text())
METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")


def route_table() -> list[tuple[str, str]]:
    """(method, pattern) of every route the worker's app registers."""
    r = Router()
    for cls in (topics.TopicsAPI, users.UsersAPI, messages.MessagesAPI, ops.OpsAPI):
        cls.register(cls.__new__(cls), r)  # register only names bound methods
    return [(x.method, x.pattern) for x in r._routes]


def operations() -> dict[str, tuple[str, str, dict[str, Any]]]:
    """operationId -> (METHOD, path, operation)."""
    out = {}
    for path, item in DOC["paths"].items():
        for m, op in item.items():
            if m in METHODS:
                out[op["operationId"]] = (m.upper(), path, op)
    return out


OPS = operations()

# Statuses an operation lists that one node cannot be made to answer in this test. Each says why
# and, where one exists, which test produces it instead.
NO_LEADER = "no Raft leader: needs a cluster that lost its quorum (tests/test_cluster.py)"
ALLOWED_UNPRODUCED: dict[tuple[str, int], str] = {
    ("healthz", 503): "only while shutting down or with the supervisor/Raft thread stalled (tests/test_liveness.py)",
    ("readyz", 503): "only before the node is ready or with a process stalled (tests/test_liveness.py)",
    ("metrics", 404): "needs http.metrics_addr set: tests/test_wire_compat.py::test_metrics_404_on_api_port",
    ("forgetServer", 200): "needs a second Raft server without a member record (a cluster)",
    ("forgetServer", 409): "needs another member (a cluster)",
    ("forgetServer", 503): NO_LEADER,
    ("decommissionMember", 204): "a lone node is refused (below_min_voters, no_receivers): needs a member whose "
                                 "removal keeps 3 voters and leaves a receiver "
                                 "(tests/test_moves_api.py::test_decommission_a_voter_of_four)",
    ("decommissionMember", 503): NO_LEADER,
    ("cancelDecommission", 503): NO_LEADER,
    ("abortMove", 202): "needs a move in flight, so a second member to move to "
                        "(tests/test_moves_api.py::test_decommission_a_voter_of_four, tests/test_moves_cluster.py)",
    ("abortMove", 503): NO_LEADER + "; or the abort's outcome unknown",
    ("createTopic", 503): NO_LEADER,
    ("alterTopic", 503): NO_LEADER,
    ("deleteTopic", 503): NO_LEADER,
    ("attachChild", 503): NO_LEADER + "; or a partition owner not answering",
    ("detachChild", 503): NO_LEADER,
    ("createUser", 503): NO_LEADER,
    ("deleteUser", 503): NO_LEADER,
    ("setGrants", 503): NO_LEADER,
    ("setPassword", 503): NO_LEADER,
    ("produce", 500): "the ingress WAL failed (a disk error): the disk-full tests of tests/test_crash.py",
    ("produceBatch", 500): "the ingress WAL failed (a disk error)",
    ("produce", 503): "a draining node, or schema validation busy for 5 s",
    ("produceBatch", 503): "a draining node, or schema validation busy for 5 s",
    ("consume", 410): "a replayed record aged out of retention (>= 1 h) or unreadable (tests/test_corruption.py)",
    ("consume", 421): "the partition moved mid-request (a cluster)",
    ("consume", 500): "a disk read failure",
    ("consume", 502): "a forwarded request to another node's owner got no answer (a cluster)",
    ("consume", 503): "the owner of a pinned partition is down (a cluster: tests/test_chaos_matrix.py)",
    ("ack", 502): "a forwarded ack got no answer (a cluster)",
    ("ack", 503): "the partition owner is down (a cluster)",
    ("redriveTopic", 500): "the ingress WAL failed (a disk error)",
    ("redriveTopic", 503): "a partition owner or an origin topic went away midway (a cluster)",
}
OLDER = ("a member on an older release (a Raft entry type not applied yet): tests/test_delivery_settings.py::"
         "test_a_member_on_an_older_release_is_a_412_the_document_lists")
for _op in ("createTopic", "alterTopic", "attachChild", "detachChild", "abortMove", "decommissionMember",
            "cancelDecommission"):
    ALLOWED_UNPRODUCED[(_op, 412)] = OLDER
# Operations that read no body answer 413 to one over 1 MiB (the generic recipe below).
BODYLESS = ("redriveTopic", "decommissionMember", "forgetServer", "abortMove", "detachChild", "cancelDecommission",
            "deleteUser", "deleteTopic")

PLAIN_PW = "plain-password-1"
LOCKED_PW = "locked-password-1"
SAMPLE = {"topic": "oa-t", "parent": "oa-par", "child": "oa-kid", "username": "oa-u", "id": "n9", "partition": "0"}
JSON = {"Content-Type": "application/json"}
MIB = 1 << 20


class Env:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.plain = basic("oa-plain", PLAIN_PW)
        self.seen: dict[tuple[str, int], Response] = {}

    def req(self, method: str, path: str, body: Any = None, *, auth: str | bool | None = True,
            headers: dict[str, str] | None = None) -> Response:
        return self.node.request(method, path, body, auth=auth, headers=headers)

    def locked(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Response:
        """The auth throttle: wrong passwords for oa-locked until the node answers 429 (5 failures
        lock it; a test running past 12 s may see one more attempt allowed, a 401)."""
        auth = basic("oa-locked", "wrong-password")
        r = self.req(method, path, body, auth=auth, headers=headers)
        for _ in range(8):
            if r.status == 429:
                break
            r = self.req(method, path, body, auth=auth, headers=headers)
        return r


def sample_path(path: str) -> str:
    for k, v in SAMPLE.items():
        path = path.replace("{" + k + "}", v)
    return path


def _consume_one(e: Env) -> dict[str, Any]:
    r = e.req("GET", "/v1/topics/oa-c/consume?wait=2s")
    assert r.status == 200, r
    return r.json()  # type: ignore[no-any-return]


def _fresh_child(e: Env, name: str) -> None:
    assert e.req("POST", "/v1/topics", {"name": name, "parent": "oa-par"}).status == 201


Recipe = Callable[[Env], Response]
R: dict[tuple[str, int], Recipe] = {
    ("healthz", 200): lambda e: e.req("GET", "/healthz", auth=None),
    ("readyz", 200): lambda e: e.req("GET", "/readyz", auth=None),
    ("openapi", 200): lambda e: e.req("GET", "/v1/openapi.json", auth=None),
    ("metrics", 200): lambda e: e.req("GET", "/metrics"),
    ("listMembers", 200): lambda e: e.req("GET", "/v1/cluster/members?detail=true"),
    ("listMembers", 400): lambda e: e.req("GET", "/v1/cluster/members?detail=maybe"),
    ("listMembers", 403): lambda e: e.req("GET", "/v1/cluster/members", auth=e.plain),
    ("forgetServer", 400): lambda e: e.req("POST", f"/v1/cluster/members/{e.node.node_id}/forget"),
    ("forgetServer", 403): lambda e: e.req("POST", "/v1/cluster/members/n9/forget", auth=e.plain),
    ("forgetServer", 404): lambda e: e.req("POST", "/v1/cluster/members/n9/forget"),
    ("listMoves", 200): lambda e: e.req("GET", "/v1/cluster/moves?detail=true"),
    ("listMoves", 400): lambda e: e.req("GET", "/v1/cluster/moves?detail=maybe"),
    ("listMoves", 403): lambda e: e.req("GET", "/v1/cluster/moves", auth=e.plain),
    ("decommissionMember", 200): lambda e: e.req("POST", f"/v1/cluster/members/{e.node.node_id}/decommission"
                                                         "?dry_run=true"),
    ("decommissionMember", 400): lambda e: e.req("POST", f"/v1/cluster/members/{e.node.node_id}/decommission"
                                                         "?dry_run=maybe"),
    ("decommissionMember", 403): lambda e: e.req("POST", "/v1/cluster/members/n9/decommission", auth=e.plain),
    ("decommissionMember", 404): lambda e: e.req("POST", "/v1/cluster/members/n9/decommission"),
    # a lone node: its removal would leave no voter and nobody to take its partitions
    ("decommissionMember", 409): lambda e: e.req("POST", f"/v1/cluster/members/{e.node.node_id}/decommission"),
    ("cancelDecommission", 204): lambda e: e.req("DELETE", f"/v1/cluster/members/{e.node.node_id}/decommission"),
    ("cancelDecommission", 400): lambda e: e.req("DELETE", f"/v1/cluster/members/{e.node.node_id}/decommission"
                                                           "?dry_run=true"),
    ("cancelDecommission", 403): lambda e: e.req("DELETE", "/v1/cluster/members/n9/decommission", auth=e.plain),
    ("cancelDecommission", 404): lambda e: e.req("DELETE", "/v1/cluster/members/n9/decommission"),
    ("abortMove", 400): lambda e: e.req("POST", "/v1/cluster/moves/oa-t/x/abort"),
    ("abortMove", 403): lambda e: e.req("POST", "/v1/cluster/moves/oa-t/0/abort", auth=e.plain),
    ("abortMove", 404): lambda e: e.req("POST", "/v1/cluster/moves/oa-none/0/abort"),
    ("abortMove", 409): lambda e: e.req("POST", "/v1/cluster/moves/oa-t/0/abort"),  # no move in flight
    ("createTopic", 201): lambda e: e.req("POST", "/v1/topics", {"name": "oa-new", "partitions": 3}),
    ("createTopic", 400): lambda e: e.req("POST", "/v1/topics", {"partitions": 3}),
    ("createTopic", 403): lambda e: e.req("POST", "/v1/topics", {"name": "oa-denied"}, auth=e.plain),
    ("createTopic", 404): lambda e: e.req("POST", "/v1/topics", {"name": "oa-orphan", "parent": "oa-none"}),
    ("createTopic", 409): lambda e: e.req("POST", "/v1/topics", {"name": "OA-T"}),
    ("createTopic", 413): lambda e: e.req("POST", "/v1/topics", {"name": "oa-big", "owner": "x" * MIB}),
    ("listTopics", 200): lambda e: e.req("GET", "/v1/topics?limit=2"),
    ("listTopics", 400): lambda e: e.req("GET", "/v1/topics?limit=0"),
    ("describeTopic", 200): lambda e: e.req("GET", "/v1/topics/oa-t"),
    ("describeTopic", 400): lambda e: e.req("GET", "/v1/topics/oa-t?partition=7"),
    ("describeTopic", 403): lambda e: e.req("GET", "/v1/topics/oa-t", auth=e.plain),
    ("describeTopic", 404): lambda e: e.req("GET", "/v1/topics/oa-none"),
    ("alterTopic", 200): lambda e: e.req("PATCH", "/v1/topics/oa-t", {"max_in_flight_per_partition": 64}),
    ("alterTopic", 400): lambda e: e.req("PATCH", "/v1/topics/oa-t", {"visibility_timeout_ms": 1000}),
    ("alterTopic", 403): lambda e: e.req("PATCH", "/v1/topics/oa-t", {"retention_ms": 0}, auth=e.plain),
    ("alterTopic", 404): lambda e: e.req("PATCH", "/v1/topics/oa-none", {"retention_ms": 0}),
    ("alterTopic", 409): lambda e: e.req("PATCH", "/v1/topics/oa-t", {"schema": {"type": "object"},
                                                                      "schema_base_version": 5}),
    ("alterTopic", 413): lambda e: e.req("PATCH", "/v1/topics/oa-t", b'{"retention_ms":0' + b" " * MIB + b"}",
                                         headers=JSON),
    ("deleteTopic", 204): lambda e: (e.req("POST", "/v1/topics", {"name": "oa-del"}),
                                     e.req("DELETE", "/v1/topics/oa-del"))[1],
    ("deleteTopic", 400): lambda e: e.req("DELETE", "/v1/topics/oa-t?force=maybe"),
    ("deleteTopic", 403): lambda e: e.req("DELETE", "/v1/topics/oa-t", auth=e.plain),
    ("deleteTopic", 404): lambda e: e.req("DELETE", "/v1/topics/oa-none"),
    ("topicSchema", 200): lambda e: e.req("GET", "/v1/topics/oa-t/schema"),
    ("topicSchema", 403): lambda e: e.req("GET", "/v1/topics/oa-t/schema", auth=e.plain),
    ("topicSchema", 404): lambda e: e.req("GET", "/v1/topics/oa-none/schema"),
    ("attachChild", 200): lambda e: (e.req("POST", "/v1/topics", {"name": "oa-kid2"}),
                                     e.req("POST", "/v1/topics/oa-par/children", {"child": "oa-kid2"}))[1],
    ("attachChild", 400): lambda e: e.req("POST", "/v1/topics/oa-par/children", {"delay_ms": 5}),
    ("attachChild", 403): lambda e: e.req("POST", "/v1/topics/oa-par/children", {"child": "oa-t"}, auth=e.plain),
    ("attachChild", 404): lambda e: e.req("POST", "/v1/topics/oa-par/children", {"child": "oa-none"}),
    ("attachChild", 409): lambda e: e.req("POST", "/v1/topics/oa-t/children", {"child": "oa-kid"}),
    ("attachChild", 501): lambda e: e.req("POST", "/v1/topics/oa-par/children", {"child": "oa-r", "remote": "b"}),
    ("listChildren", 200): lambda e: e.req("GET", "/v1/topics/oa-par/children"),
    ("listChildren", 400): lambda e: e.req("GET", "/v1/topics/oa-par/children?partitions=maybe"),
    ("listChildren", 403): lambda e: e.req("GET", "/v1/topics/oa-par/children", auth=e.plain),
    ("listChildren", 404): lambda e: e.req("GET", "/v1/topics/oa-none/children"),
    ("detachChild", 204): lambda e: (_fresh_child(e, "oa-kid3"),
                                     e.req("DELETE", "/v1/topics/oa-par/children/oa-kid3"))[1],
    ("detachChild", 400): lambda e: e.req("DELETE", "/v1/topics/oa-par/children/oa-kid?force=maybe"),
    ("detachChild", 403): lambda e: e.req("DELETE", "/v1/topics/oa-par/children/oa-kid", auth=e.plain),
    ("detachChild", 404): lambda e: e.req("DELETE", "/v1/topics/oa-par/children/oa-t"),
    ("produce", 202): lambda e: e.req("POST", "/v1/topics/oa-t/produce?key=k", b'{"a":1}', headers=JSON),
    ("produce", 400): lambda e: e.req("POST", "/v1/topics/oa-t/produce", b"", headers=JSON),
    ("produce", 403): lambda e: e.req("POST", "/v1/topics/oa-t/produce", b"x", headers=JSON, auth=e.plain),
    ("produce", 404): lambda e: e.req("POST", "/v1/topics/oa-none/produce", b"x", headers=JSON),
    ("produce", 409): lambda e: e.req("POST", "/v1/topics/oa-delay/produce", b"x", headers=JSON),
    ("produce", 413): lambda e: e.req("POST", "/v1/topics/oa-t/produce", b"x" * (MIB + 1), headers=JSON),
    ("produceBatch", 202): lambda e: e.req("POST", "/v1/topics/oa-t/produce/batch",
                                           {"messages": [{"payload": {"n": 1}}, {"payload": "aGk=",
                                                          "payload_encoding": "base64", "partition": 1}]}),
    ("produceBatch", 400): lambda e: e.req("POST", "/v1/topics/oa-t/produce/batch", {"messages": []}),
    ("produceBatch", 403): lambda e: e.req("POST", "/v1/topics/oa-t/produce/batch", {"messages": [{"payload": 1}]},
                                           auth=e.plain),
    ("produceBatch", 404): lambda e: e.req("POST", "/v1/topics/oa-none/produce/batch", {"messages": [{"payload": 1}]}),
    ("produceBatch", 409): lambda e: e.req("POST", "/v1/topics/oa-delay/produce/batch",
                                           {"messages": [{"payload": 1}]}),
    ("produceBatch", 413): lambda e: e.req("POST", "/v1/topics/oa-t/produce/batch",
                                           {"messages": [{"payload": "x" * (MIB + 1)}]}),
    ("produceBatch", 415): lambda e: e.req("POST", "/v1/topics/oa-t/produce/batch", b'{"messages":[{"payload":1}]}',
                                           headers={**JSON, "Content-Encoding": "br"}),
    ("consume", 200): lambda e: e.req("GET", "/v1/topics/oa-c/consume?max=2&wait=2s",
                                      headers={"X-Narad-Client": "tests"}),
    ("consume", 204): lambda e: e.req("GET", "/v1/topics/oa-c/consume?partition=0&offset=1000"),
    ("consume", 400): lambda e: e.req("GET", "/v1/topics/oa-c/consume?max=2"),  # no X-Narad-Client
    ("consume", 403): lambda e: e.req("GET", "/v1/topics/oa-c/consume", auth=e.plain),
    ("consume", 404): lambda e: e.req("GET", "/v1/topics/oa-none/consume"),
    ("ack", 204): lambda e: e.req("POST", f"/v1/topics/oa-c/ack?receipt_handle={_consume_one(e)['receipt_handle']}"),
    ("ack", 200): lambda e: e.req("POST", "/v1/topics/oa-c/ack", {"receipt_handles": ["0:0:1", "nonsense"]}),
    ("ack", 400): lambda e: e.req("POST", "/v1/topics/oa-c/ack?receipt_handle=0:0:1&extend=maybe"),
    ("ack", 403): lambda e: e.req("POST", "/v1/topics/oa-c/ack?receipt_handle=0:0:1", auth=e.plain),
    ("ack", 404): lambda e: e.req("POST", "/v1/topics/oa-none/ack?receipt_handle=0:0:1"),
    ("ack", 410): lambda e: e.req("POST", "/v1/topics/oa-c/ack?receipt_handle=0:0:1"),
    ("redriveTopic", 200): lambda e: e.req("POST", "/v1/topics/oa-t/redrive?max=10"),
    ("redriveTopic", 400): lambda e: e.req("POST", "/v1/topics/oa-t/redrive?max=0"),
    ("redriveTopic", 403): lambda e: e.req("POST", "/v1/topics/oa-t/redrive", auth=e.plain),
    ("redriveTopic", 404): lambda e: e.req("POST", "/v1/topics/oa-none/redrive"),
    ("redriveTopic", 409): lambda e: e.req("POST", "/v1/topics/oa-kid/redrive"),  # a fan-out child
    ("ack", 413): lambda e: e.req("POST", "/v1/topics/oa-c/ack", {"receipt_handles": ["0:0:1" + " " * 70000]}),
    ("createUser", 201): lambda e: e.req("POST", "/v1/users", {"username": "oa-new", "password": "pw-new-1",
                                                               "grants": [{"action": "consume", "patterns": ["a*"]}]}),
    ("createUser", 400): lambda e: e.req("POST", "/v1/users", {"username": "oa-x"}),
    ("createUser", 403): lambda e: e.req("POST", "/v1/users", {"username": "oa-x", "password": "p"}, auth=e.plain),
    ("createUser", 409): lambda e: e.req("POST", "/v1/users", {"username": "oa-u", "password": "p"}),
    ("listUsers", 200): lambda e: e.req("GET", "/v1/users"),
    ("listUsers", 403): lambda e: e.req("GET", "/v1/users", auth=e.plain),
    ("getUser", 200): lambda e: e.req("GET", "/v1/users/oa-plain"),
    ("getUser", 403): lambda e: e.req("GET", "/v1/users/oa-u", auth=e.plain),
    ("getUser", 404): lambda e: e.req("GET", "/v1/users/oa-none"),
    ("deleteUser", 204): lambda e: (e.req("POST", "/v1/users", {"username": "oa-gone", "password": "p"}),
                                    e.req("DELETE", "/v1/users/oa-gone"))[1],
    ("deleteUser", 403): lambda e: e.req("DELETE", "/v1/users/admin"),  # root cannot be deleted
    ("deleteUser", 404): lambda e: e.req("DELETE", "/v1/users/oa-none"),
    ("setGrants", 200): lambda e: e.req("PUT", "/v1/users/oa-u/grants", {"grants": [{"action": "admin"}]}),
    ("setGrants", 400): lambda e: e.req("PUT", "/v1/users/oa-u/grants", {"grants": [{"action": "fly"}]}),
    ("setGrants", 403): lambda e: e.req("PUT", "/v1/users/oa-u/grants", {"grants": []}, auth=e.plain),
    ("setGrants", 404): lambda e: e.req("PUT", "/v1/users/oa-none/grants", {"grants": []}),
    ("setPassword", 204): lambda e: e.req("PUT", "/v1/users/oa-u/password", {"new_password": "pw-2"}),
    ("setPassword", 400): lambda e: e.req("PUT", "/v1/users/oa-u/password", {"new_password": ""}),
    ("setPassword", 403): lambda e: e.req("PUT", "/v1/users/oa-u/password", {"new_password": "x"}, auth=e.plain),
    ("setPassword", 404): lambda e: e.req("PUT", "/v1/users/oa-none/password", {"new_password": "x"}),
}


def recipe(op_id: str, status: int) -> Recipe | None:
    """The specific recipe, else the generic one for 401, 429 and 415."""
    if (op_id, status) in R:
        return R[(op_id, status)]
    method, path, _ = OPS[op_id]
    target = sample_path(path)
    body = b"{}" if method in ("POST", "PUT", "PATCH") else None
    if status == 401:
        return lambda e: e.req(method, target, body, auth=None, headers=JSON if body else None)
    if status == 429:
        return lambda e: e.locked(method, target, body, headers=JSON if body else None)
    if status == 415 and body is not None:
        return lambda e: e.req(method, target, body, headers={"X-Narad-Client": ""})
    if status == 413 and op_id in BODYLESS:
        big = b'{"x":"' + b"a" * (MIB + 10) + b'"}'
        return lambda e: e.req(method, target, big, headers={**JSON, "X-Narad-Client": "t"})
    return None


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    n = Node(tmp_path_factory.mktemp("openapi") / "data", workers=1)
    n.start()
    e = Env(n)
    try:
        for body in ({"name": "oa-t", "partitions": 3}, {"name": "oa-c", "partitions": 3}, {"name": "oa-par"},
                     {"name": "oa-kid", "parent": "oa-par"}, {"name": "oa-delay", "parent": "oa-par",
                                                              "fanout_delay_ms": 1000}):
            r = n.post("/v1/topics", body)
            assert r.status == 201, (body, r)
        for i in range(6):
            assert n.post(f"/v1/topics/oa-c/produce?partition={i % 2}", f"m{i}".encode(),
                          headers={"Content-Type": "application/octet-stream"}).status == 202
        for name, pw, grants in (("oa-plain", PLAIN_PW, [{"action": "produce", "patterns": ["plain-*"]}]),
                                 ("oa-locked", LOCKED_PW, []), ("oa-u", "pw-1", [])):
            assert n.post("/v1/users", {"username": name, "password": pw, "grants": grants}).status == 201
        wait_for(lambda: n.get("/v1/topics/oa-c").json().get("partition_stats", [{}])[0].get("high_watermark") == 3,
                 20, what="oa-c's records to be committed")
        yield e
    finally:
        n.close()


def test_document_is_valid_openapi_31() -> None:
    from openapi_spec_validator import validate

    assert DOC["openapi"].startswith("3.1")
    validate(DOC)  # raises on any violation of the OpenAPI 3.1 schema
    ids = [op["operationId"] for _, _, op in OPS.values()]
    assert len(ids) == len(set(ids))


def test_every_route_has_an_operation_and_back() -> None:
    routes = set(route_table())
    documented = {(m, p) for m, p, _ in OPS.values()}
    assert routes - documented == set(), "routes without an operation in narad/api/openapi.json"
    assert documented - routes == set(), "operations in narad/api/openapi.json that no route serves"
    for m, path, op in OPS.values():
        want = {seg[1:-1] for seg in path.split("/") if seg.startswith("{")}
        got = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
        assert want == got, f"{m} {path}: path parameters {got} != {want}"


def test_allow_list_names_listed_statuses() -> None:
    """A stale allow-list entry (the status or operation is gone from the document) fails."""
    for op_id, status in ALLOWED_UNPRODUCED:
        assert op_id in OPS and str(status) in OPS[op_id][2]["responses"], (op_id, status)
        assert recipe(op_id, status) is None, f"{op_id} {status} has a recipe: drop it from the allow-list"
    for op_id, status in R:
        assert op_id in OPS and str(status) in OPS[op_id][2]["responses"], \
            f"the node answers {op_id} with {status}, which the document does not list"


def _validate(op_id: str, status: int, r: Response) -> None:
    spec = OPS[op_id][2]["responses"][str(status)]
    content = spec.get("content")
    if not content:
        assert r.body == b"", f"{op_id} {status}: documented without a body, got {r.body[:200]!r}"
        return
    if r.body == b"" and "(empty body)" in spec.get("description", ""):
        return  # a body only with an extension (the produce 202 with idempotency_key)
    ctype = r.headers.get("content-type", "").split(";")[0].strip()
    assert ctype in content, f"{op_id} {status}: content type {ctype!r} not in {list(content)}"
    schema = content[ctype].get("schema")
    if ctype != "application/json" or not schema:
        return
    full = {**schema, "components": DOC["components"]}
    body = json.loads(r.body)
    jsonschema.Draft202012Validator(full).validate(body)
    extra = undocumented(body, schema, "")
    assert not extra, f"{op_id} {status}: fields the document does not describe: {extra}"


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = DOC["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _properties(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The properties an object schema names, through allOf/oneOf/anyOf; None: free-form."""
    schema = _resolve(schema)
    props: dict[str, Any] | None = dict(schema["properties"]) if "properties" in schema else None
    for key in ("allOf", "oneOf", "anyOf"):
        for part in schema.get(key, []):
            sub = _properties(part)
            if sub is not None:
                props = {**(props or {}), **sub}
    return props


def undocumented(value: Any, schema: dict[str, Any], where: str) -> list[str]:
    """Keys of an answer that its schema does not name (the document must describe every
    field a node sends; responses may gain fields, but only documented ones)."""
    schema = _resolve(schema)
    out: list[str] = []
    if isinstance(value, dict):
        props = _properties(schema)
        if props is None:
            return out
        for k, v in value.items():
            if k not in props:
                out.append(f"{where}.{k}")
            else:
                out += undocumented(v, props[k], f"{where}.{k}")
    elif isinstance(value, list):
        items = schema.get("items")
        for choice in (schema.get("oneOf") or schema.get("anyOf") or []):
            items = items or _resolve(choice).get("items")
        if items:
            for i, v in enumerate(value[:5]):
                out += undocumented(v, items, f"{where}[{i}]")
    return out


def test_every_listed_status_is_produced(env: Env) -> None:
    missing, wrong = [], []
    for op_id, (method, path, op) in sorted(OPS.items()):
        for code in op["responses"]:
            status = int(code)
            if (op_id, status) in ALLOWED_UNPRODUCED:
                continue
            make = recipe(op_id, status)
            if make is None:
                missing.append(f"{op_id} ({method} {path}) {status}")
                continue
            r = make(env)
            if r.status != status:
                wrong.append(f"{op_id} {status}: the recipe got {r.status} {r.body[:200]!r}")
                continue
            try:
                _validate(op_id, status, r)
            except (AssertionError, jsonschema.ValidationError) as e:
                wrong.append(f"{op_id} {status}: the answer does not match the document: {str(e)[:600]}")
    assert not missing, "listed statuses without a recipe (or an ALLOWED_UNPRODUCED entry):\n" + "\n".join(missing)
    assert not wrong, "\n".join(wrong)


def test_served_document_is_the_file(env: Env) -> None:
    r = env.req("GET", "/v1/openapi.json", auth=None)
    assert r.status == 200 and r.headers["content-type"].startswith("application/json")
    assert r.body == DOC_PATH.read_bytes()


def _param(op_id: str, name: str) -> dict[str, Any]:
    return next(p for p in OPS[op_id][2]["parameters"] if p["name"] == name)


def test_the_retry_delay_extensions_are_described_and_answer_as_documented(env: Env) -> None:
    """Issue 14's optional parameters: consume ``visibility``, ack ``delay`` and
    ``visibility`` (query and batch body): named in the document, the bodies sent
    valid against its request schema, the answers valid against its responses."""
    for op_id, name in (("consume", "visibility"), ("ack", "delay"), ("ack", "visibility")):
        p = _param(op_id, name)
        assert p["in"] == "query" and not p["required"] and p["schema"] == {"type": "string"}, (op_id, p)
    body_schema = {**DOC["components"]["schemas"]["AckBatchRequest"], "components": DOC["components"]}
    assert env.req("POST", "/v1/topics", {"name": "oa-rd", "partitions": 3}).status == 201
    for i in range(3):
        assert env.req("POST", "/v1/topics/oa-rd/produce?partition=0", f"r{i}".encode(),
                       headers={"Content-Type": "application/octet-stream"}).status == 202
    got: list[dict[str, Any]] = []

    def take() -> bool:
        r = env.req("GET", "/v1/topics/oa-rd/consume?visibility=30s&max=3&wait=1s", headers={"X-Narad-Client": "t"})
        if r.status == 200:
            _validate("consume", 200, r)
            got.extend(r.json()["messages"])
        return len(got) >= 3

    wait_for(take, 20, 0.0, "three records of oa-rd")
    h = [m["receipt_handle"] for m in got]
    r = env.req("POST", f"/v1/topics/oa-rd/ack?receipt_handle={h[0]}&extend=true&visibility=2m")
    assert r.status == 204, r
    _validate("ack", 204, r)
    for body, q in (({"receipt_handles": h[:2], "visibility": "1m"}, "?extend=true"),
                    ({"receipt_handles": h[1:], "delay": "10s"}, "?extend=0")):
        jsonschema.Draft202012Validator(body_schema).validate(body)
        r = env.req("POST", f"/v1/topics/oa-rd/ack{q}", body)
        assert r.status == 200, r
        _validate("ack", 200, r)
    for path in ("/v1/topics/oa-rd/ack?receipt_handle=0:0:1&extend=0&delay=1d",
                 "/v1/topics/oa-rd/ack?receipt_handle=0:0:1&delay=1s",
                 "/v1/topics/oa-rd/consume?visibility=100ms"):
        r = env.req("POST" if "/ack" in path else "GET", path)
        assert r.status == 400, r
        _validate("ack" if "/ack" in path else "consume", 400, r)
    assert env.req("POST", f"/v1/topics/oa-rd/ack?receipt_handle={h[0]}").status == 204


def test_the_idempotency_extension_is_described_and_answers_as_documented(env: Env) -> None:
    """Issue 14's ``idempotency_key`` (single produce query, batch message field): named
    in the document; the verdict answers valid against the 202 schemas; the 400s too."""
    p = _param("produce", "idempotency_key")
    assert p["in"] == "query" and not p["required"] and p["schema"] == {"type": "string"}, p
    assert "idempotency_key" in DOC["components"]["schemas"]["BatchMessage"]["properties"]
    assert env.req("POST", "/v1/topics", {"name": "oa-idem", "partitions": 3}).status == 201
    octet = {"Content-Type": "application/octet-stream"}
    for dup in (False, True):
        r = env.req("POST", "/v1/topics/oa-idem/produce?idempotency_key=k1", b"x", headers=octet)
        assert r.status == 202 and r.json() == {"duplicate": dup}, r
        _validate("produce", 202, r)
    body = {"messages": [{"payload": 1, "idempotency_key": "k1"}, {"payload": 2, "idempotency_key": "k2"}]}
    req_schema = {**DOC["components"]["schemas"]["ProduceBatchRequest"], "components": DOC["components"]}
    jsonschema.Draft202012Validator(req_schema).validate(body)
    r = env.req("POST", "/v1/topics/oa-idem/produce/batch", body)
    assert r.status == 202 and r.json() == {"accepted": 2, "duplicates": 1}, r
    _validate("produceBatch", 202, r)
    r = env.req("POST", "/v1/topics/oa-idem/produce?idempotency_key=", b"x", headers=octet)
    assert r.status == 400, r
    _validate("produce", 400, r)


def test_the_dead_letter_extensions_are_described_and_answer_as_documented(env: Env) -> None:
    """Issue 14's nack ``reason`` (query and batch body), ``delivery_count`` and
    ``dead_letter`` in consume answers, and the redrive answer: valid against the document."""
    p = _param("ack", "reason")
    assert p["in"] == "query" and not p["required"] and p["schema"] == {"type": "string"}
    assert _param("redriveTopic", "max")["in"] == "query"
    body_schema = {**DOC["components"]["schemas"]["AckBatchRequest"], "components": DOC["components"]}
    assert env.req("POST", "/v1/topics", {"name": "oa-dlt", "partitions": 3}).status == 201
    assert env.req("POST", "/v1/topics", {"name": "oa-dl", "partitions": 3, "max_deliveries": 1,
                                          "dead_letter_topic": "oa-dlt"}).status == 201
    assert env.req("POST", "/v1/topics/oa-dl/produce?key=k", b"x",
                   headers={"Content-Type": "application/octet-stream"}).status == 202

    def first(topic: str) -> dict[str, Any] | None:
        r = env.req("GET", f"/v1/topics/{topic}/consume?max=1&wait=1s", headers={"X-Narad-Client": "t"})
        if r.status != 200:
            return None
        _validate("consume", 200, r)
        return r.json()["messages"][0]  # type: ignore[no-any-return]

    m = wait_for(lambda: first("oa-dl"), 20, 0.0, "the record of oa-dl")
    assert m["delivery_count"] == 1
    body = {"receipt_handles": [m["receipt_handle"]], "reason": "bad input"}
    jsonschema.Draft202012Validator(body_schema).validate(body)
    r = env.req("POST", "/v1/topics/oa-dl/ack?extend=0", body)
    assert r.status == 200, r
    _validate("ack", 200, r)
    d = wait_for(lambda: first("oa-dlt"), 20, 0.0, "its dead-letter copy")
    assert d["dead_letter"]["reason"] == "bad input" and d["dead_letter"]["topic"] == "oa-dl"
    assert env.req("POST", f"/v1/topics/oa-dlt/ack?receipt_handle={d['receipt_handle']}&extend=0").status == 204
    r = env.req("POST", "/v1/topics/oa-dlt/redrive")
    assert r.status == 200 and r.json() == {"redriven": 1, "skipped": 0}, r
    _validate("redriveTopic", 200, r)
    r = env.req("POST", "/v1/topics/oa-dl/ack?receipt_handle=0:0:1&extend=0&reason=" + "x" * 300)
    assert r.status == 400, r
    _validate("ack", 400, r)
