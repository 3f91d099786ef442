"""Hostile schemas and payloads: registration refuses what could cost too much,
validation is RE2-based and bounded, a stalled capacity answers 503, and deep
payloads are refused (schema topics) or stored as bytes (schemaless), never 500.

Unit tests of narad.meta.schemas and narad.broker.validation without sockets,
then real nodes (tests/harness.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from narad.broker import validation as VAL
from narad.errors import BadRequest, SchemaValidationBusy
from narad.meta import schemas as S
from tests.harness import Node, Response, wait_for

HOSTILE = {"type": "string", "pattern": "(a+)+$"}
HOSTILE_PAYLOAD = json.dumps("a" * 40 + "!").encode()
LIVENESS = 30.0  # a bound on "it ends", not a speed assert: the old code never ended


def refused(doc: Any) -> str:
    with pytest.raises(BadRequest) as e:
        S.parse_registrable(json.dumps(doc).encode())
    assert e.value.status == 400
    return e.value.message


def accepted(doc: Any) -> None:
    assert S.parse_registrable(json.dumps(doc).encode()) == doc


def validator(doc: Any) -> S.PayloadValidator:
    return S.PayloadValidator("t", 1, json.dumps(doc).encode())


def ends(fn: Callable[[], Any], timeout: float = LIVENESS) -> Any:
    """Run fn on a thread with a large stack; fail if it has not returned in `timeout`."""
    ex = ThreadPoolExecutor(1)
    try:
        return ex.submit(fn).result(timeout)
    finally:
        ex.shutdown(wait=False)


def laughs(levels: int) -> dict[str, Any]:
    """Each level applies the next one twice to the same place: 2**levels paths."""
    defs: dict[str, Any] = {f"a{i}": {"allOf": [{"$ref": f"#/$defs/a{i + 1}"}, {"$ref": f"#/$defs/a{i + 1}"}]}
                            for i in range(levels)}
    defs[f"a{levels}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# ---- registration --------------------------------------------------------------------------------
def test_registration_refuses_patterns_re2_cannot_run() -> None:
    for doc in ({"type": "string", "pattern": "(?=a)b"}, {"type": "string", "pattern": "(a)\\1"},
                {"properties": {"x": {"pattern": "(?<!a)b"}}},
                {"type": "object", "patternProperties": {"(?!x)y": {}}}):
        msg = refused(doc)
        assert "RE2" in msg and "lookaround or backreferences" in msg, msg
    msg = refused({"type": "string", "pattern": "^.{0,1000}$"})
    assert "too costly" in msg and "instructions" in msg and "/pattern" in msg, msg
    accepted(HOSTILE)  # RE2 matches it in linear time
    accepted({"type": "string", "pattern": "^\\p{L}+$"})


def test_registration_refuses_schemas_too_costly_to_validate() -> None:
    msg = refused({"anyOf": [{"$ref": "#"}, {"type": "string"}]})
    assert "endless recursion" in msg, msg
    msg = refused(laughs(10))
    assert "validation paths" in msg and "limit 64" in msg, msg
    msg = refused({"anyOf": [{"items": {"$ref": "#"}}, {"items": {"$ref": "#"}}]})
    assert "exponentially" in msg, msg
    # unevaluated* evaluates its in-place subschemas again: nested 8 deep that is 2**7 paths
    msg = refused({"$defs": {**{f"u{i}": {"allOf": [{"$ref": f"#/$defs/u{i + 1}"}], "unevaluatedProperties": False}
                                for i in range(8)}, "u8": {"type": "object"}}, "$ref": "#/$defs/u0"})
    assert "validation paths" in msg, msg
    msg = refused({"$defs": {"a": {"properties": {f"q{i}": {"$ref": "#/$defs/b"} for i in range(100)}},
                             "b": {"properties": {f"r{i}": {"$ref": "#/$defs/c"} for i in range(100)}},
                             "c": {"properties": {f"s{i}": {"type": "string"} for i in range(100)}}},
                   "$ref": "#/$defs/a"})
    assert "expands to more than 50000" in msg, msg
    msg = refused({"$ref": "#/$defs/missing"})
    assert "does not resolve" in msg, msg
    msg = refused({"properties": {"a": {"$ref": "#nowhere"}}})
    assert "does not resolve" in msg, msg
    # ... while ordinary schemas stay registrable
    accepted(laughs(6))  # 64 paths: at the limit
    accepted({"type": "array", "items": {"$ref": "#"}})  # recursion that descends
    accepted({"properties": {"left": {"$ref": "#"}, "right": {"$ref": "#"}}})  # a tree
    accepted({"$defs": {"id": {"type": "integer"}},
              "properties": {f"p{i}": {"$ref": "#/$defs/id"} for i in range(200)}})  # one def, 200 places
    accepted({"$defs": {"x": {"$anchor": "name", "type": "string"}}, "properties": {"a": {"$ref": "#name"}}})
    accepted({"$defs": {"node": {"properties": {"kids": {"items": {"$ref": "#/$defs/node"}}}}},
              "properties": {"a": {"$ref": "#/$defs/node"}, "b": {"$ref": "#/$defs/node"}}})  # one recursion, 2 uses
    accepted({"$defs": {"x": {"items": {"$ref": "#/$defs/y"}, "additionalProperties": {"$ref": "#/$defs/y"}},
                        "y": {"type": "string"}},
              "properties": {f"p{i}": {"$ref": "#/$defs/x"} for i in range(2000)}})  # wildcards under 2000 names
    accepted({"$schema": "http://json-schema.org/draft-07/schema#",
              "definitions": {"x": {"$id": "#name", "type": "string"}}, "properties": {"a": {"$ref": "#name"}}})


# ---- validation ------------------------------------------------------------------------------------
def test_hostile_pattern_is_matched_by_re2() -> None:
    v = validator(HOSTILE)
    why = ends(lambda: v.check(HOSTILE_PAYLOAD, inline=True))
    assert why is not None and "does not match" in why
    assert v.check(json.dumps("a" * 40).encode(), inline=True) is None


def test_every_regex_search_of_jsonschema_runs_on_re2() -> None:
    # additionalProperties and unevaluatedProperties search patternProperties keys inside jsonschema
    doc = {"type": "object", "patternProperties": {"(a+)+$": {"type": "integer"}}, "additionalProperties": False}
    v = validator(doc)
    why = ends(lambda: v.check(json.dumps({"a" * 40 + "!": 1}).encode(), inline=False))
    assert why is not None and "jsonschema validation failed" in why
    doc2 = {"type": "object", "patternProperties": {"(a+)+$": {}}, "unevaluatedProperties": False}
    why = ends(lambda: validator(doc2).check(json.dumps({"a" * 40 + "!": 1}).encode(), inline=False))
    assert why is not None and "jsonschema validation failed" in why
    assert validator(doc2).check(b'{"aaa": 1}', inline=False) is None


def test_unique_items_is_linear_and_keeps_json_equality() -> None:
    v = validator({"type": "array", "uniqueItems": True})
    assert v.check(b"[1, 1.0]", inline=False) is not None
    assert v.check(b'[{"a":1,"b":[2]},{"b":[2],"a":1}]', inline=False) is not None
    assert v.check(b"[true, 1, false, 0, null]", inline=False) is None
    big = json.dumps([{"k": i} for i in range(60_000)]).encode()  # ~0.6 MiB; the old check was quadratic
    assert ends(lambda: v.check(big, inline=False)) is None


def nest(depth: int, items: list[bytes]) -> bytes:
    return b"[" * depth + b",".join(items) + b"]" * depth


def test_costs_that_grow_with_the_subtree_are_bounded_never_a_503_forever() -> None:
    # Two costs grew with the whole subtree at every level and were never charged: jsonschema's eager
    # error messages (repr of the instance, also the ones anyOf discards) and uniqueItems' canonical
    # forms (and their tuple hashes). These valid payloads ran past the capacity's deadline: 503 forever.
    anyof = validator({"anyOf": [{"type": "string"}, {"prefixItems": [{"$ref": "#"}]}]})
    unique = validator({"uniqueItems": True, "prefixItems": [{"$ref": "#"}]})
    zeros = nest(250, [b"0"] * 150_000)  # ~300 KB
    distinct = nest(250, [str(i).encode() for i in range(100_000)])  # ~590 KB

    async def run() -> tuple[str | None, ...]:
        cap = VAL.ValidationCapacity()
        return (await cap.check(anyof, zeros), await cap.check(unique, distinct),
                await cap.check(unique, nest(200, [b"0"] * 50_000)),
                await cap.check(validator({"type": "string"}), zeros))

    valid1, valid2, dup, wrong = ends(lambda: asyncio.run(run()), 90)
    assert valid1 is None and valid2 is None
    assert dup is not None and "non-unique elements" in dup
    assert wrong is not None and "[[[[[[" in wrong and "...' is not of type 'string'" not in wrong
    assert len(wrong) < 500 and "is not of type 'string'" in wrong  # a preview of the value, not all of it
    big = [f"v{i:06d}" for i in range(20_000)]  # schema values too: a 200 KB const was repr'd per message
    why = validator({"const": big}).check(b"1", inline=False)
    assert why is not None and "was expected" in why and len(why) < 500
    assert len(refused({"not": big})) < 1000  # the registration error quotes a preview too


COSTLY = {"type": "array", "items": {"anyOf": [{"type": "string", "minLength": k} for k in range(59, 0, -1)]}}


def test_step_budget_refuses_a_payload_too_costly_to_validate() -> None:
    v = validator(COSTLY)
    payload = json.dumps(["x"] * 2000).encode()  # valid, but every item tries all 59 branches
    why = ends(lambda: v.check(payload, inline=False))
    assert why is not None and "costs more than" in why and "per payload byte" in why
    with pytest.raises(S.NeedsCapacity):
        v.check(json.dumps(["x"] * 100).encode(), inline=True)  # over the inline allowance: to the capacity
    assert v.check(json.dumps(["x" * 60] * 2000).encode(), inline=False) is None  # first branch matches
    gone = threading.Event()
    gone.set()
    with pytest.raises(S.OutOfTime):  # a canceled request stops its validation
        v.check(payload, inline=False, cancel=gone)
    with pytest.raises(S.OutOfTime):
        v.check(payload, inline=False, deadline=0.0)


@pytest.mark.serial  # ~10 s of CPU against a wall-clock deadline: not beside another test's load
def test_a_costly_payload_is_refused_by_its_budget_before_the_deadline() -> None:
    # Entering a subschema was not charged: 59 small anyOf branches per item cost ~13 us per step, so
    # a ~1 MB payload ran past the capacity's deadline (503 retry, forever) before its budget (400).
    v = validator(COSTLY)
    payload = json.dumps(["x"] * 200_000).encode()  # ~1 MB

    async def run() -> str | None:
        return await VAL.ValidationCapacity().check(v, payload)

    why = ends(lambda: asyncio.run(run()), 90)
    assert why is not None and "costs more than" in why


def test_payload_nesting_and_strict_json() -> None:
    v = validator({"type": "array", "items": {"$ref": "#"}})
    assert v.check(nested(257), inline=False) == "payload nests deeper than 256 levels"
    assert v.check(nested(10_000), inline=True) == "payload nests deeper than 256 levels"
    with pytest.raises(S.NeedsCapacity):
        v.check(nested(100), inline=True)  # deep documents never recurse on the event loop

    async def deep() -> Any:
        return await VAL.ValidationCapacity().check(v, nested(256))

    assert ends(lambda: asyncio.run(deep())) is None  # the capacity's thread follows 256 levels
    for bad in (b"NaN", b"\xef\xbb\xbf[]", b"[] []", b'"\xff"'):
        why = v.check(bad, inline=True)
        assert why is not None and why.startswith("schema: payload is not a single JSON text"), (bad, why)


def test_capacity_busy_answers_503_and_gives_the_slot_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(VAL, "WAIT_S", 0.2)
    v = validator({"type": "array"})
    big = json.dumps(["x" * 100] * 200).encode()  # > 16 KiB: on the slot

    async def run() -> None:
        cap = VAL.ValidationCapacity()
        cap._hold = 2.0  # what NARAD_FAULT_SCHEMA_HOLD_MS sets
        first = asyncio.ensure_future(cap.check(v, big))
        while cap.in_flight == 0:
            await asyncio.sleep(0.01)
        with pytest.raises(SchemaValidationBusy) as e:
            await cap.check(v, big)
        assert e.value.status == 503 and e.value.body() == {"error": "schema: validation capacity busy, retry"}
        assert ("Retry-After", "1") in e.value.headers
        assert await cap.check(v, b'["x"]') is None  # small and cheap: inline, no slot needed
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert cap.in_flight == 1  # the slot stays taken until the thread has stopped
        while cap.in_flight:
            await asyncio.sleep(0.01)
        cap._hold = 0.0
        assert await cap.check(v, big) is None

    ends(lambda: asyncio.run(run()))


def test_validators_are_built_once_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # The cost analysis of a large schema takes seconds: PayloadValidator was built on the event loop.
    monkeypatch.setattr(VAL, "WAIT_S", 0.3)
    release = threading.Event()
    builds: list[str] = []

    def make() -> S.PayloadValidator:
        builds.append(threading.current_thread().name)
        assert release.wait(LIVENESS)  # set by the loop: on the loop this build would never end
        return validator({"type": "string"})

    async def run() -> None:
        cap = VAL.ValidationCapacity()
        first = [asyncio.ensure_future(cap.validator(("t", 1), make)) for _ in range(3)]
        for f in first:  # concurrent first produces share the build; each waits WAIT_S, then 503
            with pytest.raises(SchemaValidationBusy):
                await f
        release.set()
        v = await cap.validator(("t", 1), make)  # the build went on: the retry gets it
        assert v is await cap.validator(("t", 1), make) and cap.cached(("t", 1)) is v
        assert builds == ["narad-schema_0"]
        assert await cap.check(v, b'"x"') is None and await cap.check(v, b"1") is not None

    ends(lambda: asyncio.run(run()))


def test_analysis_of_many_properties_meeting_additional_properties_is_linear() -> None:
    # Every b<j> and a<i> can name the same document place: the old count walked all paths against the
    # whole frontier (paths x frontier), ran past MAX_ANALYSIS_OPS and refused this schema (and took
    # seconds for the live repro's 254 KB schema, on the worker's loop).
    n = 1500
    doc = {"$defs": {"T": {"type": "string"}},
           "properties": {f"b{j}": {"properties": {"c": {"$ref": "#/$defs/T"}}} for j in range(n)},
           "additionalProperties": {"properties": {f"a{i}": {"anyOf": [{"$ref": "#/$defs/T"}]} for i in range(n)}}}
    assert S.analyse(doc).max_paths == 1
    two = {"$defs": {"T": {"type": "string"}}, "properties": {"b": {"properties": {"c": {"$ref": "#/$defs/T"}}}},
           "additionalProperties": {"properties": {"c": {"$ref": "#/$defs/T"}}}}
    assert S.analyse(two).max_paths == 2  # /b/c and the additional b's /c can meet at one place


def test_schema_checks_queue_is_bounded_and_busy_before_proposing(monkeypatch: pytest.MonkeyPatch) -> None:
    from narad.errors import Unavailable
    from narad.meta import service as SVC

    monkeypatch.setattr(SVC, "SCHEMA_CHECK_WAIT_S", 0.3)
    monkeypatch.setattr(SVC, "SCHEMA_CHECKS_QUEUED", 2)
    release = threading.Event()

    def slow(raw: bytes) -> bytes:
        assert release.wait(LIVENESS)
        return raw

    async def run() -> None:
        running = asyncio.ensure_future(SVC._off_loop(slow, b"1"))
        while SVC._schema_checks_pending == 0:
            await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(SVC._off_loop(slow, b"2"))
        await asyncio.sleep(0)
        with pytest.raises(Unavailable) as e:  # the queue is full: at once
            await SVC._off_loop(slow, b"3")
        assert e.value.status == 503 and "retry" in e.value.message
        with pytest.raises(Unavailable):  # not started within SCHEMA_CHECK_WAIT_S: withdrawn
            await waiting
        release.set()
        assert await running == b"1"
        while SVC._schema_checks_pending:
            await asyncio.sleep(0.01)
        assert await SVC._off_loop(slow, b"4") == b"4"

    ends(lambda: asyncio.run(run()))


# ---- real nodes ------------------------------------------------------------------------------------
OCTET = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("hostile") / "data", workers=1).start()
    yield n
    n.close()


def produce(node: Node, topic: str, body: bytes) -> Response:
    return node.request("POST", f"/v1/topics/{topic}/produce", body, headers=OCTET)


def test_node_refuses_costly_schemas_at_registration(node: Node) -> None:
    for name, doc, words in (("look", {"type": "string", "pattern": "(?=a)a"}, "RE2"),
                             ("laughs", laughs(12), "validation paths"),
                             ("loop", {"allOf": [{"$ref": "#"}]}, "endless recursion")):
        r = node.post("/v1/topics", {"name": name, "schema": doc})
        assert r.status == 400 and words in r.json()["error"], r
    assert node.post("/v1/topics", {"name": "ok", "schema": {"type": "object"}}).status == 201
    r = node.request("PATCH", "/v1/topics/ok", {"schema": {"type": "object", "pattern": "(?!x)"}})
    assert r.status == 400 and "RE2" in r.json()["error"], r


def test_hostile_schema_does_not_freeze_the_worker(node: Node) -> None:
    assert node.post("/v1/topics", {"name": "redos", "schema": HOSTILE}).status == 201
    assert node.post("/v1/topics", {"name": "plain"}).status == 201
    assert node.post("/v1/topics", {"name": "heavy", "schema": COSTLY}).status == 201
    stop = threading.Event()
    answers: list[int] = []

    def attack() -> None:
        while not stop.is_set():
            answers.append(produce(node, "redos", HOSTILE_PAYLOAD).status)
            # a big payload that keeps the validation slot busy on its thread
            answers.append(produce(node, "heavy", json.dumps(["x"] * 40_000).encode()).status)

    with ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(attack) for _ in range(2)]
        try:
            wait_for(lambda: len(answers) >= 2, LIVENESS, 0.05, "the hostile produces to be answered")
            # the same (only) worker still serves everything else meanwhile
            for _ in range(5):
                assert node.get("/readyz", auth=None).status == 200
                assert produce(node, "plain", b'{"n": 1}').status == 202
                assert produce(node, "redos", b'"aaaa"').status == 202
        finally:
            stop.set()
            for f in futs:
                f.result(LIVENESS)
    assert set(answers) <= {400, 503}, answers
    assert 400 in answers
    r = produce(node, "redos", HOSTILE_PAYLOAD)
    assert r.status == 400 and "does not match" in r.json()["error"], r


def test_deep_payloads_are_refused_or_stored_never_500(node: Node) -> None:
    assert node.post("/v1/topics", {"name": "typed", "schema": {"type": "array"}}).status == 201
    assert node.post("/v1/topics", {"name": "raw"}).status == 201
    for depth in (257, 10_000):
        r = produce(node, "typed", nested(depth))
        assert r.status == 400 and r.json()["error"] == "invalid argument: payload nests deeper than 256 levels", r
        batch = {"messages": [{"payload": "x"}, {"payload": nested(depth).decode()}]}
        r = node.post("/v1/topics/typed/produce/batch", json.dumps(batch).encode(), headers=OCTET)
        assert r.status == 400, r
    assert produce(node, "typed", nested(256)).status == 202
    assert produce(node, "raw", nested(10_000)).status == 202  # schemaless: stored as it came
    r = node.get("/v1/topics/raw/consume?wait=5s")
    assert r.status == 200, r
    payload = r.json()["payload"]
    assert (payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))).encode() == \
        nested(10_000)


def test_busy_capacity_answers_503_while_the_worker_serves(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=1, env={"NARAD_FAULT_SCHEMA_HOLD_MS": "7000"}).start()
    try:
        assert n.post("/v1/topics", {"name": "t", "schema": {"type": "array"}}).status == 201
        big = json.dumps(["x" * 100] * 200).encode()  # > 16 KiB: validated on the slot
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(produce, n, "t", big) for _ in range(2)]
            # whichever got the slot holds it 7 s; the other waits 5 s for it
            assert produce(n, "t", b'["small"]').status == 202  # inline: needs no slot
            got = sorted((f.result(LIVENESS) for f in futs), key=lambda r: r.status)
        assert [r.status for r in got] == [202, 503], got
        assert got[1].json() == {"error": "schema: validation capacity busy, retry"}
        assert got[1].headers.get("retry-after") == "1"
        assert produce(n, "t", b'{"not": "an array"}').status == 400
        assert produce(n, "t", b"[" * 300 + b"]" * 300).status == 400
        text = n.get("/metrics").body.decode()
        series = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                  if ln.startswith("narad_schema_")}
        for reason in ("busy", "invalid", "depth"):
            assert series.get(f'narad_schema_rejections_total{{reason="{reason}"}}', 0) >= 1, series
        assert series.get("narad_schema_validation_seconds_count", 0) >= 3, series
        assert "narad_schema_validations_in_flight" in series, series
    finally:
        n.close()
