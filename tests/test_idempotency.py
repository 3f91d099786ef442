"""Idempotent produce (issue 14): ``?idempotency_key=`` on a single produce and an
``idempotency_key`` field per batch message. The key is checked where the record is
committed (the partition's owner), so a repeat within the topic's window stores
nothing new on any worker or node, across a restart (SIGTERM and kill -9) of the
owner, and the answer says so. Produces without keys answer byte for byte as before.

Real nodes (a 2-worker node, a 3-node cluster), plus the owner's table and the
partition commit in-process. Waits are conditions with deadlines, never sleeps."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgspec
import pytest

from narad.broker import idem as IDEM
from narad.broker import peers as P
from narad.broker.routing import key_partition, owner_worker
from narad.storage import frames as FR
from tests.harness import Cluster, Node, Response, wait_for

OCTET = {"Content-Type": "application/octet-stream"}
PARTS = 3
HASHED = {"NARAD_TOPIC_IDEMPOTENT_LOCAL_PLACEMENT": "false"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    # Placement by key hash (the rule for a key homed on another node or at a moving
    # partition, and with topic.idempotent_local_placement off), which several tests here
    # check; tests/test_idem_local.py runs the default.
    n = Node(tmp_path_factory.mktemp("idem") / "data", workers=2, env=HASHED).start()
    yield n
    n.close()


def mk(node: Node, name: str, **fields: Any) -> str:
    r = node.post("/v1/topics", {"name": name, "partitions": PARTS, **fields})
    assert r.status == 201, r
    return name


def single(node: Node, name: str, body: bytes, key: str | None, query: str = "", conn: Any = None) -> Response:
    q = f"idempotency_key={quote(key, safe='')}" if key is not None else ""
    if query:
        q = f"{q}&{query}" if q else query
    return node.post(f"/v1/topics/{name}/produce{'?' + q if q else ''}", body, headers=OCTET, conn=conn)


def stored(node: Node, name: str) -> int:
    """Records the topic's partitions hold (their high watermarks)."""
    r = node.get(f"/v1/topics/{name}")
    assert r.status == 200, r
    return sum(int(s["high_watermark"]) for s in r.json()["partition_stats"])


def drain(node: Node, name: str) -> list[dict[str, Any]]:
    """Every record of the topic, acked (consume until two empty answers in a row)."""
    got: list[dict[str, Any]] = []
    empty = 0
    while empty < 2:
        r = node.get(f"/v1/topics/{name}/consume?max=100&wait=200ms", headers={"X-Narad-Client": "tests"})
        if r.status == 204:
            empty += 1
            continue
        assert r.status == 200, r
        msgs = r.json()["messages"]
        got += msgs
        a = node.post(f"/v1/topics/{name}/ack", {"receipt_handles": [m["receipt_handle"] for m in msgs]})
        assert a.status == 200, a
    return got


def error(r: Response, status: int = 400) -> str:
    assert r.status == status, r
    return str(r.json()["error"])


# ---- a single node with two workers --------------------------------------------------------------
def test_the_same_key_twice_stores_one_record_and_the_second_answer_says_duplicate(node: Node) -> None:
    name = mk(node, "idem-twice")
    r1 = single(node, name, b"first", "order-1")
    assert r1.status == 202 and r1.json() == {"duplicate": False}, r1
    r2 = single(node, name, b"second", "order-1")
    assert r2.status == 202 and r2.json() == {"duplicate": True}, r2
    assert single(node, name, b"other", "order-2").json() == {"duplicate": False}
    assert stored(node, name) == 2  # both verdicts came from the owner's commit: nothing else is on its way
    got = drain(node, name)
    assert sorted(m["payload"] for m in got) == ["first", "other"]
    # A keyless message with an idempotency key goes to the partition its key hashes to.
    part = {m["payload"]: m["partition"] for m in got}
    assert part["first"] == key_partition(b"order-1", PARTS) and part["other"] == key_partition(b"order-2", PARTS)
    assert all("idempotency_key" not in m for m in got)  # the key is not part of the rendered message
    assert node.metric("narad_idempotent_duplicates_total") >= 1


def test_a_request_on_the_worker_not_owning_the_partition(node: Node) -> None:
    """The key's partition is worker 1's and the produce lands on worker 0: the verdict
    comes back over the worker hop (CommitResp.dups)."""
    name = mk(node, "idem-hop")
    key = next(f"k{i}" for i in range(1000) if owner_worker(name, key_partition(f"k{i}".encode(), PARTS), 2) == 1)
    w0 = node.worker_connection(0)
    assert single(node, name, b"a", key, conn=w0).json() == {"duplicate": False}
    w1 = node.worker_connection(1)
    assert single(node, name, b"b", key, conn=w1).json() == {"duplicate": True}
    assert single(node, name, b"c", key, conn=w0).json() == {"duplicate": True}
    batch = {"messages": [{"payload": "d", "idempotency_key": key}, {"payload": "e", "idempotency_key": key + "x"}]}
    r = node.post(f"/v1/topics/{name}/produce/batch", batch, conn=w0)
    assert r.status == 202 and r.json() == {"accepted": 2, "duplicates": 1}, r
    assert stored(node, name) == 2
    # An explicit partition and a message key route as before; the key is checked there.
    assert single(node, name, b"f", "pinned", "partition=2").json() == {"duplicate": False}
    assert single(node, name, b"g", "pinned", "partition=2", conn=w0).json() == {"duplicate": True}
    assert single(node, name, b"h", "keyed", "key=user-7").json() == {"duplicate": False}
    assert single(node, name, b"i", "keyed", "key=user-7", conn=w0).json() == {"duplicate": True}
    assert stored(node, name) == 4


def test_batches_count_duplicates_inside_and_across_calls(node: Node) -> None:
    name = mk(node, "idem-batch")
    msgs = [{"payload": {"n": 1}, "idempotency_key": "a"}, {"payload": {"n": 2}, "idempotency_key": "a"},
            {"payload": {"n": 3}, "idempotency_key": "b"}, {"payload": {"n": 4}}]
    r = node.post(f"/v1/topics/{name}/produce/batch", {"messages": msgs})
    assert r.status == 202 and r.json() == {"accepted": 4, "duplicates": 1}, r
    r = node.post(f"/v1/topics/{name}/produce/batch", {"messages": msgs})
    assert r.status == 202 and r.json() == {"accepted": 4, "duplicates": 3}, r  # a, a, b; the keyless one is new
    assert single(node, name, b"x", "b").json() == {"duplicate": True}  # a batch's key holds for a single produce
    # The answer waited for the keyed records' verdicts only: the keyless one may still be on its way.
    wait_for(lambda: stored(node, name) == 4, 10, 0.02, "four records committed")
    assert stored(node, name) == 4
    assert sorted(m["payload"]["n"] for m in drain(node, name)) == [1, 3, 4, 4]
    # The node's claims table is measured: the keys it holds (read by the supervisor at a scrape).
    assert node.metric("narad_idempotency_table_keys") >= 2
    assert node.metric("narad_idempotency_keys_evicted_total") == 0  # far below its capacity


def test_a_keyed_batch_on_a_topic_with_a_schema_and_headers(node: Node) -> None:
    """A keyed message's body is read from the request's buffer (no copy of its own): the
    schema still checks it, headers beside the key still come back, and the bodies stored
    are the ones sent, at every key length (fixstr, str8 such as a UUID, longer)."""
    name = mk(node, "idem-schema", schema={"type": "object", "required": ["n"]})
    bad = [{"payload": {"n": 1}, "idempotency_key": "s1"}, {"payload": {"m": 2}, "idempotency_key": "s2"}]
    r = node.post(f"/v1/topics/{name}/produce/batch", {"messages": bad})
    assert r.status == 400 and r.json()["error"].startswith("message 1: invalid argument"), r
    keys = ["k", "u" * 31, "0f8fad5b-d9cb-469f-a165-70867728950e", "v" * 122, "w" * 128]
    msgs = [{"payload": {"n": i, "pad": "x" * 300}, "idempotency_key": k} for i, k in enumerate(keys)]
    msgs.append({"payload": {"n": 9}, "idempotency_key": "h", "headers": {"tenant": "acme"}})
    msgs.append({"payload": {"n": 10}})
    r = node.post(f"/v1/topics/{name}/produce/batch", {"messages": msgs})
    assert r.status == 202 and r.json() == {"accepted": 7, "duplicates": 0}, r
    r = node.post(f"/v1/topics/{name}/produce/batch", {"messages": msgs[:6]})
    assert r.status == 202 and r.json() == {"accepted": 6, "duplicates": 6}, r
    wait_for(lambda: stored(node, name) == 7, 10, 0.02, "seven records committed")
    got = {m["payload"]["n"]: m for m in drain(node, name)}
    assert sorted(got) == [0, 1, 2, 3, 4, 9, 10]
    assert all(got[i]["payload"] == {"n": i, "pad": "x" * 300} for i in range(5))
    assert got[9]["headers"] == {"tenant": "acme"} and "headers" not in got[10]
    # Placed by the key's hash (the batch applies ``key_partition`` inline): where a retry lands.
    from narad.broker.routing import key_partition

    assert [got[i]["partition"] for i in range(5)] == [key_partition(k.encode(), PARTS) for k in keys]
    assert got[9]["partition"] == key_partition(b"h", PARTS)


def test_the_one_pass_keyed_batch_stores_what_the_general_passes_store(node: Node) -> None:
    """A batch whose every message has an idempotency key and nothing unusual is built in
    one pass (``MessagesAPI._keyed_entries``); any other batch takes the general passes.
    The same keyed messages through each (the second batch ends with a keyless message,
    which sends it the general way) are stored alike: payloads, message keys, partitions
    (by the key's hash, the message key's, or the one given), repeats inside the batch
    and across calls. A bad message anywhere is the general passes' 400, naming it, and
    nothing of the batch is stored."""
    fast, slow = mk(node, "idem-onepass-a"), mk(node, "idem-onepass-b")
    keys = ["k1", "u" * 31, "0f8fad5b-d9cb-469f-a165-70867728950e", "v" * 122, "w" * 128, "é" * 20, "k1"]
    msgs: list[dict[str, Any]] = [{"payload": {"n": i, "s": "x" * 50}, "idempotency_key": k}
                                  for i, k in enumerate(keys)]
    msgs[1]["key"] = "order-7"  # a message key places it (and keeps its order)
    msgs[2]["partition"] = 2
    msgs[3]["payload"] = "a string body"
    msgs[4]["payload"] = [4, "w"]  # (a list body; any headers field, even {}, sends a batch the general way)
    r = node.post(f"/v1/topics/{fast}/produce/batch", {"messages": msgs})
    assert r.status == 202 and r.json() == {"accepted": 7, "duplicates": 1}, r
    r = node.post(f"/v1/topics/{slow}/produce/batch", {"messages": [*msgs, {"payload": {"n": 99}}]})
    assert r.status == 202 and r.json() == {"accepted": 8, "duplicates": 1}, r
    for name in (fast, slow):  # a retry of the keyed messages stores nothing, either way
        r = node.post(f"/v1/topics/{name}/produce/batch", {"messages": msgs})
        assert r.status == 202 and r.json() == {"accepted": 7, "duplicates": 7}, r
    wait_for(lambda: stored(node, fast) == 6 and stored(node, slow) == 7, 10, 0.02, "both batches committed")

    def view(name: str) -> dict[int, tuple[Any, ...]]:
        return {m["payload"]["n"] if isinstance(m["payload"], dict) else 3 if isinstance(m["payload"], str) else 4:
                (m["payload"], m.get("key"), m["partition"], m.get("headers")) for m in drain(node, name)}

    a, b = view(fast), view(slow)
    assert b.pop(99)[1] is None  # (the keyless message that sent the second batch the general way)
    assert a == b, (a, b)
    assert sorted(a) == [0, 1, 2, 3, 4, 5]
    assert a[0][2] == key_partition(b"k1", PARTS) and a[1][2] == key_partition(b"order-7", PARTS)
    assert a[2][2] == 2 and a[5][2] == key_partition(("é" * 20).encode(), PARTS)
    assert a[1][1] == "order-7" and a[3][0] == "a string body" and a[4][3] is None
    # A bad message after good ones: the general passes' answer, and nothing stored.
    bad = [{"payload": 1, "idempotency_key": "z1"}, {"payload": 2, "idempotency_key": "z2", "partition": PARTS}]
    assert error(node.post(f"/v1/topics/{fast}/produce/batch", {"messages": bad})).startswith(
        "message 1: invalid argument: partition out of range")
    bad[1] = {"payload": 2, "idempotency_key": "z2", "payload_encoding": "base64"}
    assert error(node.post(f"/v1/topics/{fast}/produce/batch", {"messages": bad})).startswith("message 1: ")
    assert stored(node, fast) == 6


def test_a_keyed_batchs_partitions_are_each_keys_hash_also_for_keys_holding_a_nul(node: Node) -> None:
    """The one-pass batch places every key in one native call over the keys joined by
    NUL bytes (``crc32c_parts``); a key holding a NUL itself makes that call refuse and
    each key is placed in Python. Either way each record lands where ``key_partition``
    of its key says, and the native CRC-32C is the crc32c package's, with the CPU's
    instruction and with the table."""
    from crc32c import crc32c
    from narad._native import ffi, lib

    rng = random.Random(7)
    with open("/proc/cpuinfo") as f:  # the instruction is used where the CPU has it
        assert lib.crc32c_hardware() == int(" sse4_2" in f.read())
    for n in [*range(0, 40), 1000, 4097]:
        data = rng.randbytes(n)
        assert lib.crc32c_of(data, n, 0) == crc32c(data) == lib.crc32c_of(data, n, 1), n
    keys = [b"", b"a", b"0000000000000001", b"x" * 300]
    joined, out = b"\0".join(keys), ffi.new("uint32_t[]", 4)
    assert lib.crc32c_parts(joined, len(joined), 4, 7, out) == 0 and list(out) == [crc32c(k) % 7 for k in keys]
    assert lib.crc32c_parts(joined, len(joined), 3, 7, out) == -1 == lib.crc32c_parts(joined, len(joined), 5, 7, out)
    # The length-checked form the one-pass batch uses: an empty key or one over the bound is -2
    # (the general passes then answer the 400), a miscount still -1.
    assert lib.crc32c_parts_max(joined, len(joined), 4, 7, 300, out) == -2  # (the empty key)
    ok = b"\0".join(keys[1:])
    assert lib.crc32c_parts_max(ok, len(ok), 3, 7, 300, out) == 0 and list(out)[:3] == [crc32c(k) % 7 for k in keys[1:]]
    assert lib.crc32c_parts_max(ok, len(ok), 3, 7, 299, out) == -2  # (the 300-byte key)
    assert lib.crc32c_parts_max(ok, len(ok), 2, 7, 300, out) == -1
    for n, nparts in ((1, 3), (100, 3), (257, 108)):  # the grouping: a stable counting sort by partition
        parts = [rng.randrange(nparts) for _ in range(n)]
        perm, starts, nonempty = ffi.new("uint32_t[]", n), ffi.new("uint32_t[]", nparts + 1), ffi.new("uint32_t[]", n)
        k = lib.group_by_part(ffi.new("uint32_t[]", parts), n, nparts, perm, starts, nonempty)
        want = {p: [i for i in range(n) if parts[i] == p] for p in sorted(set(parts))}
        assert list(nonempty)[:k] == list(want)
        assert {p: list(perm)[starts[p]:starts[p + 1]] for p in want} == want
    assert lib.group_by_part(ffi.new("uint32_t[]", [0, 3]), 2, 3, perm, starts, nonempty) == -1
    for name, batch in (("idem-nul-a", [f"key-{i}" for i in range(40)]),
                        ("idem-nul-b", [f"key-{i}" for i in range(39)] + ["nul\u0000inside"])):
        mk(node, name)
        r = node.post(f"/v1/topics/{name}/produce/batch",
                      {"messages": [{"payload": {"i": i}, "idempotency_key": k} for i, k in enumerate(batch)]})
        assert r.status == 202 and r.json() == {"accepted": 40, "duplicates": 0}, r
        got = {m["payload"]["i"]: m["partition"] for m in drain(node, name)}
        assert got == {i: key_partition(k.encode(), PARTS) for i, k in enumerate(batch)}, name
    # A second batch repeating two of the first's keys among new ones: exactly the records
    # with those keys are dropped (each record's key goes with it to its partition's commit),
    # and every partition holds the rest in batch order.
    again = [f"new-{i}" for i in range(40)]
    again[7], again[30] = "key-5", "key-21"
    r = node.post("/v1/topics/idem-nul-a/produce/batch",
                  {"messages": [{"payload": {"i": 100 + i}, "idempotency_key": k} for i, k in enumerate(again)]})
    assert r.status == 202 and r.json() == {"accepted": 40, "duplicates": 2}, r
    rows = drain(node, "idem-nul-a")
    assert sorted(m["payload"]["i"] for m in rows) == [100 + i for i in range(40) if i not in (7, 30)]
    for part in range(PARTS):
        mine = sorted((m["offset"], m["payload"]["i"]) for m in rows if m["partition"] == part)
        assert [i for _o, i in mine] == sorted(i for _o, i in mine), part


def test_produces_without_keys_answer_byte_for_byte_as_before(node: Node) -> None:
    name = mk(node, "idem-plain")
    c = node.conn()
    c.request("POST", f"/v1/topics/{name}/produce", b"plain", headers={**OCTET, "Authorization": node.auth})
    r = c.getresponse()
    assert (r.status, r.read(), r.getheader("Content-Length")) == (202, b"", "0")
    c.request("POST", f"/v1/topics/{name}/produce/batch", b'{"messages":[{"payload":1},{"payload":2}]}',
              headers={"Content-Type": "application/json", "Authorization": node.auth})
    r = c.getresponse()
    assert (r.status, r.read()) == (202, b'{"accepted":2}')
    c.close()


def test_bad_idempotency_keys_are_400s(node: Node) -> None:
    name = mk(node, "idem-bad")
    base = f"/v1/topics/{name}/produce"
    assert "1 to 128 bytes" in error(node.post(base + "?idempotency_key=", b"x", headers=OCTET))
    assert "1 to 128 bytes" in error(node.post(base + "?idempotency_key=" + "k" * 129, b"x", headers=OCTET))
    assert "1 to 128 bytes" in error(node.post(base + "?idempotency_key=" + quote("é" * 65), b"x", headers=OCTET))
    assert "UTF-8" in error(node.post(base + "?idempotency_key=%FF%FE", b"x", headers=OCTET))
    assert "more than once" in error(node.post(base + "?idempotency_key=a&idempotency_key=b", b"x",
                                               headers=OCTET))
    assert single(node, name, b"x", "k" * 128).json() == {"duplicate": False}  # 128 bytes is allowed
    b = base + "/batch"
    assert "message 1: " in error(node.post(b, {"messages": [{"payload": 1}, {"payload": 2, "idempotency_key": ""}]}))
    assert "1 to 128 bytes" in error(node.post(b, {"messages": [{"payload": 2, "idempotency_key": "k" * 129}]}))
    two = [{"payload": 1, "idempotency_key": "a"}, {"payload": 2, "idempotency_key": "é" * 65}]
    r = node.post(b, {"messages": two})
    assert error(r).startswith("message 1: ") and "1 to 128 bytes, got 130" in error(r)  # bytes, not characters
    error(node.post(b, b'{"messages":[{"payload":2,"idempotency_key":"\\ud800"}]}',  # msgspec refuses it
                    headers={"Content-Type": "application/json"}))
    assert error(node.post(b, {"messages": [{"payload": 2, "idempotency_key": 7}]})).startswith("message 0: ")
    assert stored(node, name) == 1  # nothing of the refused ones was stored
    # A delay child takes no produce at all (409), with or without a key.
    mk(node, "idem-bad-parent")
    mk(node, "idem-bad-later", parent="idem-bad-parent", fanout_delay_ms=60_000)
    assert "delay child" in error(single(node, "idem-bad-later", b"x", "k"), 409)
    r = node.post("/v1/topics/idem-bad-later/produce/batch", {"messages": [{"payload": 1, "idempotency_key": "k"}]})
    assert "delay child" in error(r, 409)


def test_the_window_passes_and_the_key_is_accepted_again(node: Node) -> None:
    name = mk(node, "idem-window", idempotency_window_ms=1000)
    assert single(node, name, b"1", "w").json() == {"duplicate": False}
    t0 = time.monotonic()
    assert single(node, name, b"2", "w").json() == {"duplicate": True}
    wait_for(lambda: single(node, name, b"3", "w").json() == {"duplicate": False}, 15, 0.1,
             "the key accepted again after the 1 s window")
    assert time.monotonic() - t0 >= 0.8  # not before the window (the first commit was before t0)
    assert stored(node, name) == 2


def test_a_raised_window_holds_at_once_for_the_keys_already_kept(node: Node) -> None:
    """A PATCH raising the window holds at once for keys committed under the old one: a
    claim judges a repeat by the window the topic has now (the table keeps each key's
    commit time), at both workers' partitions."""
    name = mk(node, "idem-raise", idempotency_window_ms=1000)
    ks = [f"k{i}" for i in range(12)]
    assert {owner_worker(name, key_partition(k.encode(), PARTS), 2) for k in ks} == {0, 1}
    msgs = [{"payload": {"k": k}, "idempotency_key": k} for k in ks]
    t0 = time.monotonic()
    r = node.post(f"/v1/topics/{name}/produce/batch", {"messages": msgs})
    assert r.status == 202 and r.json() == {"accepted": 12, "duplicates": 0}, r
    r = node.request("PATCH", f"/v1/topics/{name}", body={"idempotency_window_ms": 3_600_000})
    assert r.status == 200, r
    time.sleep(max(0.0, 1.5 - (time.monotonic() - t0)))  # (past the old window: a fixed wait is the point)
    r = node.post(f"/v1/topics/{name}/produce/batch", {"messages": msgs})
    assert r.status == 202 and r.json() == {"accepted": 12, "duplicates": 12}, r
    assert stored(node, name) == 12


def test_a_fanout_child_gets_every_record_its_parent_accepted(node: Node) -> None:
    """The child's own idempotency window (longer than the parent's) must not drop a
    copy: a key the parent accepted again after its window is in the child twice.
    Copies carry no idempotency key (headers are kept)."""
    parent = mk(node, "idem-fo-parent", idempotency_window_ms=1000)
    child = mk(node, "idem-fo-child", idempotency_window_ms=3_600_000)
    r = node.post(f"/v1/topics/{parent}/children", {"child": child})
    assert r.status in (200, 201), r
    assert single(node, parent, b"first", "K", "header=trace:t1").json() == {"duplicate": False}
    wait_for(lambda: single(node, parent, b"second", "K").json() == {"duplicate": False}, 15, 0.1,
             "the key accepted again by the parent after its 1 s window")
    assert stored(node, parent) == 2
    wait_for(lambda: stored(node, child) == 2, 15, 0.05, "both copies in the child")
    got = drain(node, child)
    assert sorted(m["payload"] for m in got) == ["first", "second"], got  # (UTF-8 bodies come back as text)
    assert [m.get("headers") for m in got if m["payload"] == "first"] == [{"trace": "t1"}]


def test_sdk_produce_idempotency_key_and_batch_field(node: Node) -> None:
    from narad.client import BatchMessage, Client
    from tests.harness import ADMIN_PASSWORD

    name = mk(node, "idem-sdk")
    with Client(f"127.0.0.1:{node.port}", auth=("admin", ADMIN_PASSWORD)) as c:
        r1 = c.produce(name, b"a", idempotency_key="s1")
        r2 = c.produce(name, b"b", idempotency_key="s1")
        assert (r1.duplicate, r2.duplicate) == (False, True)
        assert c.produce(name, b"c").duplicate is None  # no key: Narad's answer, nothing to say
        res = c.produce_batch(name, [BatchMessage("d", idempotency_key="s1"), BatchMessage("e")])
        assert res == 2 and (res.accepted, res.duplicates, res.pending) == (2, 1, 0)
        assert c.produce_batch(name, [{"n": 1}]) == 1  # no keys: the count, as before
    # Keyless records answer at their WAL fsync and are committed after it.
    wait_for(lambda: stored(node, name) == 4, 10, 0.02, "four records committed")
    assert stored(node, name) == 4


# ---- restarts of the owner ---------------------------------------------------------------------
@pytest.mark.parametrize("how", ["sigterm", "kill9"])
def test_the_key_survives_a_restart_of_the_owner(tmp_path: Path, how: str) -> None:
    """The table is rebuilt from the log at open: a clean stop and a kill -9 both keep it."""
    n = Node(tmp_path / "data", workers=1).start()
    try:
        name = mk(n, "idem-restart")
        for i in range(20):
            assert single(n, name, f"m{i}".encode(), f"r{i}").json() == {"duplicate": False}
        assert single(n, name, b"plain", None).status == 202
        if how == "kill9":
            n.kill9()
        else:
            assert n.stop() == 0
        n.start()
        wait_for(lambda: n.get(f"/v1/topics/{name}").status == 200, 20, 0.05, "the topic after the restart")
        for i in range(20):
            assert single(n, name, b"again", f"r{i}").json() == {"duplicate": True}, i
        assert single(n, name, b"new", "r-new").json() == {"duplicate": False}
        # After a kill -9 the WAL is replayed from its checkpoint (records committed since
        # may be committed again): the keyed ones are dropped as duplicates then, a keyless
        # one may be stored twice (at least once, as before).
        got = sorted(m["payload"] for m in drain(n, name))
        plain = got.count("plain")
        assert [g for g in got if g != "plain"] == sorted([f"m{i}" for i in range(20)] + ["new"]), got
        assert plain == 1 or (how == "kill9" and plain == 2), got
        print(f"{how}: keyless record stored {plain}x; replayed keyed duplicates dropped: "
              f"{n.metric('narad_idempotent_duplicates_total') - 20:.0f}")
    finally:
        n.close()


def test_the_nodes_claims_table_holds_the_keys_of_both_workers_partitions_across_a_kill9(tmp_path: Path) -> None:
    """The node's shared-memory claims table (``narad.broker.idem_claims``) is filled by
    both workers as they commit keyed records, and again from the logs by each worker at
    its start after a kill -9 (the supervisor recreates it empty)."""
    n = Node(tmp_path / "data", workers=2).start()
    try:
        name = mk(n, "idem-table")
        keys = [f"t{i}" for i in range(40)]
        assert {owner_worker(name, key_partition(k.encode(), PARTS), 2) for k in keys} == {0, 1}
        msgs = [{"payload": {"k": k}, "idempotency_key": k} for k in keys]
        r = n.post(f"/v1/topics/{name}/produce/batch", {"messages": msgs + msgs[:5]})
        assert r.status == 202 and r.json() == {"accepted": 45, "duplicates": 5}, r
        assert n.metric("narad_idempotency_table_keys") == 40
        assert n.metric("narad_idempotency_table_pending") == 0
        assert n.metric("narad_idempotency_table_capacity") == 786432
        n.kill9()
        n.start()
        wait_for(lambda: n.get(f"/v1/topics/{name}").status == 200, 20, 0.05, "the topic after the restart")
        # Recreated empty, and loaded again by each worker from its partitions at its start.
        wait_for(lambda: n.metric("narad_idempotency_table_keys") == 40, 20, 0.1, "40 keys loaded at start")
        r = n.post(f"/v1/topics/{name}/produce/batch", {"messages": msgs})
        assert r.status == 202 and r.json() == {"accepted": 40, "duplicates": 40}, r
        assert n.metric("narad_idempotency_table_keys") == 40
        r = n.post(f"/v1/topics/{name}/produce/batch", {"messages": [{"payload": 1, "idempotency_key": "t-new"}]})
        assert r.status == 202 and r.json() == {"accepted": 1, "duplicates": 0}, r
        assert n.metric("narad_idempotency_table_keys") == 41
    finally:
        n.close()


# ---- a 3-node cluster ---------------------------------------------------------------------------
def test_cluster_the_same_key_at_three_nodes_and_an_owner_down(tmp_path: Path) -> None:
    """One key sent to each node stores one record (the owner decides). Then the key's
    owner is killed: a produce at another node answers 202 ``pending`` after the wait
    (durable, not rerouted: its key is checked at its own partition); once the owner is
    back the record is committed there, and the same key again is a duplicate."""
    c = Cluster(tmp_path, 3, initial=3).start()
    try:
        c.leader()
        name = "idemc"
        assert c["n1"].post("/v1/topics", {"name": name, "partitions": PARTS}).status == 201
        wait_for(lambda: all(c[x].get(f"/v1/topics/{name}").status == 200 for x in c.ids), 20, 0.05, "the topic")
        answers = [single(c[x], name, f"from-{x}".encode(), "one").json() for x in c.ids]
        assert answers == [{"duplicate": False}, {"duplicate": True}, {"duplicate": True}], answers
        assert stored(c["n1"], name) == 1
        # A one-pass keyed batch at one node: the partitions owned elsewhere take its WAL
        # (their entries built then, ``DeferredEntries``), the rest commit here; the same
        # batch at the other nodes is all duplicates.
        batch = {"messages": [{"payload": {"b": j}, "idempotency_key": f"batch-{j}"} for j in range(30)]}
        r = c["n1"].post(f"/v1/topics/{name}/produce/batch", batch)
        assert r.status == 202 and r.json() == {"accepted": 30, "duplicates": 0}, r
        for x in ("n2", "n3"):
            r = c[x].post(f"/v1/topics/{name}/produce/batch", batch)
            assert r.status == 202 and r.json() == {"accepted": 30, "duplicates": 30}, (x, r)
        wait_for(lambda: stored(c["n1"], name) == 31, 20, 0.1, "the batch committed at its owners")
        # ---- the owner of a key's partition is down ----
        stats = c["n1"].get(f"/v1/topics/{name}").json()["partition_stats"]
        owner = {s["index"]: s["owner_node"] for s in stats}
        key = next(f"d{i}" for i in range(1000) if owner[key_partition(f"d{i}".encode(), PARTS)] != "n1")
        x = owner[key_partition(key.encode(), PARTS)]
        y = next(i for i in c.ids if i != x)
        c[x].kill9()
        t0 = time.monotonic()
        r = single(c[y], name, b"while-down", key)
        assert r.status == 202 and r.json() == {"duplicate": None, "pending": True}, r
        assert time.monotonic() - t0 >= 4.5
        c[x].start()
        # Committed at the returning owner (never rerouted to a sibling), then a duplicate anywhere.
        wait_for(lambda: single(c[y], name, b"retry", key).json() == {"duplicate": True}, 60, 0.5,
                 "the pending record committed at its owner")
        for z in c.ids:
            assert single(c[z], name, b"retry", key).json() == {"duplicate": True}
        # The keys committed before the kill -9 are still held by the returning owner (its
        # table rebuilt from its log): the batch again, anywhere, stores nothing.
        for z in c.ids:
            r = c[z].post(f"/v1/topics/{name}/produce/batch", batch)
            assert r.status == 202 and r.json() == {"accepted": 30, "duplicates": 30}, (z, r)
        wait_for(lambda: stored(c[y], name) == 32, 20, 0.1, "two records and the batch in all")
    finally:
        c.close()


# ---- in-process: the table, the commit, the rebuild, the wire ------------------------------------
def _rec(key: str | None, body: bytes) -> tuple[bytes | None, int, bytes]:
    if key is None:
        return None, 0, body
    return None, FR.F_EXT, FR.pack_ext(FR.Ext(i=key), body)


def held(p: Any, keys: list[str], now_ms: int | None = None) -> set[str]:
    """Which of `keys` the partition's claims table holds as committed within its window."""
    from narad.broker import idem_claims as IC

    if p.claims is None:
        return set()
    ks = p.claims.prepare(keys)
    now = int(time.time() * 1000) if now_ms is None else now_ms
    got, _ = p.claims.claim(p.claims_topic, ks, 0, now, p.idem_window_ms, 99)
    p.claims.settle(p.claims_topic, ks, 99, 0, 0, [IC.RELEASE if g == IC.CLAIMED else 0 for g in got])
    return {k for k, g in zip(keys, got, strict=True) if g == IC.DUPLICATE}


def rebuilt(p: Any, window_ms: int, now_ms: int, keys: list[str]) -> tuple[set[str], int]:
    """The keys a rebuild of `p`'s log into a fresh claims table finds, of `keys`; and the records read."""
    from narad.broker.idem_claims import ClaimTable

    t = ClaimTable.private(256)
    _, read = IDEM.rebuild(p.log, window_ms, now_ms, t, 5, p.index)
    probe = type("P", (), {"claims": t, "claims_topic": 5, "idem_window_ms": window_ms})()
    return held(probe, keys, now_ms), read


def test_partition_commit_drops_repeats_and_answers_their_indexes(tmp_path: Path) -> None:
    from tests.test_partition import _partition

    p = _partition(tmp_path, 2)  # two keyless records: no marker, an open would not scan
    assert not IDEM.needs_rebuild(tmp_path)

    async def go() -> list[Any]:
        p.loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as ex:
            a = await p.commit([_rec("a", b"1"), _rec("a", b"2"), _rec(None, b"3"), _rec("b", b"4")], ex)
            # Two batches combined into one frame: the second's repeat of the first's key is dropped.
            b, c = await asyncio.gather(p.commit([_rec("c", b"5")], ex), p.commit([_rec("c", b"6")], ex))
            d = await p.commit([_rec("a", b"7"), _rec("b", b"8")], ex)  # all duplicates: nothing written
            return [a, b, c, d]

    a, b, c, d = asyncio.run(go())
    assert a == (2, [1]) and b == (5, []) and c == (6, [0]) and d == (6, [0, 1])
    assert p.log.hwm == 6
    assert [p.log.read(i)[3] for i in range(2, 6)] == [FR.pack_ext(FR.Ext(i="a"), b"1"), b"3",
                                                       FR.pack_ext(FR.Ext(i="b"), b"4"),
                                                       FR.pack_ext(FR.Ext(i="c"), b"5")]
    assert IDEM.needs_rebuild(tmp_path)  # made durable before the first keyed commit
    keys, read = rebuilt(p, 300_000, int(time.time() * 1000), ["a", "b", "c", "d"])
    assert keys == {"a", "b", "c"} and read == 6
    empty, _ = rebuilt(p, 1, int(time.time() * 1000) + 10_000, ["a", "b", "c"])  # all older than the window
    assert not empty


def test_a_failed_commit_takes_its_claimed_keys_back(tmp_path: Path) -> None:
    """The commit claims each new key in the table at the check; a frame whose write fails
    must leave none of them held, or the producer's retry would be answered as a repeat of a
    record that was never stored (lost). Keys held before stay held."""
    from tests.test_partition import _partition

    p = _partition(tmp_path, 0)
    real = p.log.write_commit
    fail = [True]

    def write_commit(envs: list[bytes]) -> Any:
        if fail[0]:
            raise OSError(5, "injected write failure")
        return real(envs)

    p.log.write_commit = write_commit  # type: ignore[method-assign]

    async def go() -> list[Any]:
        p.loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as ex:
            fail[0] = False
            a = await p.commit([_rec("a", b"1")], ex)
            fail[0] = True
            with pytest.raises(OSError, match="injected"):
                await p.commit([_rec("b", b"2"), _rec("a", b"3"), _rec("c", b"4")], ex)
            after_fail = held(p, ["a", "b", "c"])
            fail[0] = False
            b = await p.commit([_rec("b", b"5"), _rec("c", b"6"), _rec("a", b"7"), _rec("b", b"8")], ex)
            c = await p.commit([_rec("d", b"9"), _rec("e", b"10")], ex)
            snap = (p.log.hwm, held(p, ["a", "b", "c", "d", "e"]))
            # Keys of every length the commit reads in place (a fixstr, a str8 such as a UUID) or
            # not (over 122 bytes): each held once, its repeat dropped.
            long_keys = ["u" * 31, str(uuid.UUID(int=7)), "v" * 122, "w" * 123, "é" * 64]
            e = await p.commit([_rec(k, b"x") for k in long_keys] + [_rec(k, b"y") for k in long_keys], ex)
            assert held(p, long_keys) == set(long_keys)
            return [a, after_fail, b, c, e, snap]

    a, after_fail, b, c, e, snap = asyncio.run(go())
    assert e == (5, [5, 6, 7, 8, 9])
    assert a == (0, [])
    assert after_fail == {"a"}  # b and c were claimed by the failed frame and taken back
    assert b == (1, [2, 3])  # stored this time; a (held) and the frame's own repeat of b dropped
    assert c == (3, [])
    assert snap == (5, {"a", "b", "c", "d", "e"})
    assert [FR.read_ext(p.log.read(i)[3]).i for i in range(5)] == ["a", "b", "c", "d", "e"]


def test_keys_given_by_the_producer_and_keys_read_from_blocks_are_one_table(tmp_path: Path) -> None:
    """A producer's direct commit hands its records' keys over (``ikeys``: no block is read);
    a commit from the WAL or a hop reads them from the blocks. Either finds the other's keys
    as repeats, a repeat within one frame is dropped, a keyless record among them is stored,
    and a failed frame takes the keys it was given back, as it does those it read."""
    from tests.test_partition import _partition

    p = _partition(tmp_path, 0)
    real = p.log.write_commit
    fail = [False]

    def write_commit(envs: list[bytes]) -> Any:
        if fail[0]:
            raise OSError(5, "injected write failure")
        return real(envs)

    p.log.write_commit = write_commit  # type: ignore[method-assign]
    u = str(uuid.UUID(int=9))

    async def go() -> list[Any]:
        p.loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as ex:
            a = await p.commit([_rec("a", b"1"), _rec(None, b"2"), _rec(u, b"3"), _rec("a", b"4")], ex,
                               ["a", None, u, "a"])
            b = await p.commit([_rec(u, b"5"), _rec("b", b"6"), _rec("a", b"7")], ex)  # read from the blocks
            c = await p.commit([_rec("b", b"8"), _rec("c", b"9")], ex, ["b", "c"])
            fail[0] = True
            with pytest.raises(OSError, match="injected"):
                await p.commit([_rec("d", b"10")], ex, ["d"])
            fail[0] = False
            d = await p.commit([_rec("d", b"11")], ex)
            # Every key new and none twice: claimed at once (then found from the blocks).
            e = await p.commit([_rec("e", b"12"), _rec(None, b"13"), _rec("f", b"14")], ex, ["e", None, "f"])
            f = await p.commit([_rec("f", b"15"), _rec("e", b"16"), _rec("g", b"17")], ex)
            fail[0] = True
            with pytest.raises(OSError, match="injected"):
                await p.commit([_rec("h", b"18"), _rec("i", b"19")], ex, ["h", "i"])
            fail[0] = False
            g = await p.commit([_rec("i", b"20")], ex)
            every = ["a", u, "b", "c", "d", "e", "f", "g", "h", "i"]
            return [a, b, c, d, e, f, g, sorted(held(p, every)), p.log.hwm]

    a, b, c, d, e, f, g, keys, hwm = asyncio.run(go())
    assert (e, f, g) == ((6, []), (9, [0, 1]), (10, []))  # h and i went with their failed frame
    assert keys == sorted(["a", u, "b", "c", "d", "e", "f", "g", "i"]) and hwm == 11
    assert a == (0, [3])  # the frame's own repeat of "a" dropped; the keyless record stored
    assert b == (3, [0, 2])  # u and "a" were given by the producer: found here from the blocks
    assert c == (4, [0])  # "b" was read from a block: found here from the keys given
    assert d == (5, [])  # "d" went with its failed frame: stored now
    stored = [p.log.read(i) for i in range(6)]
    assert [(IDEM.key_of(r[2], r[3]), r[3].endswith(want)) for r, want in
            zip(stored, (b"1", b"2", b"3", b"6", b"9", b"11"), strict=True)] == [
        ("a", True), (None, True), (u, True), ("b", True), ("c", True), ("d", True)]


def test_commit_resp_dups_is_a_trailing_field_both_ways() -> None:
    class OldCommitResp(msgspec.Struct, array_like=True):
        base: int

    enc = msgspec.msgpack.encode
    assert msgspec.msgpack.decode(enc(OldCommitResp(7)), type=P.CommitResp) == P.CommitResp(7, [])
    assert msgspec.msgpack.decode(enc(P.CommitResp(7, [0, 2])), type=OldCommitResp) == OldCommitResp(7)


def test_a_moved_in_copy_is_scanned_at_open_without_its_own_marker(tmp_path: Path) -> None:
    """A move copies segments only: the copy's ``move.marker`` makes the open scan it (its
    history is not known here), and the keys committed at the source are found."""
    from narad.storage import transfer as TR
    from tests.test_partition import _partition

    p = _partition(tmp_path, 0)

    async def go() -> None:
        p.loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as ex:
            await p.commit([_rec("moved-1", b"1"), _rec(None, b"2")], ex)

    asyncio.run(go())
    (tmp_path / IDEM.MARKER).unlink()  # as a staged copy has it: segments, no idem.marker
    assert not IDEM.needs_rebuild(tmp_path)
    (tmp_path / TR.MARKER_FILE).write_text("{}")
    assert IDEM.needs_rebuild(tmp_path)
    keys, _ = rebuilt(p, 300_000, int(time.time() * 1000), ["moved-1", "other"])
    assert keys == {"moved-1"}


def test_cluster_wal_replay_after_a_kill9_drops_the_keyed_records_committed_already(tmp_path: Path) -> None:
    """The ingress WAL replays from its checkpoint after a crash, and records committed
    since are committed again (at least once). Here the checkpoint is held back by a keyed
    record whose owner is down (keyed records are never rerouted), so the producing node's
    kill -9 replays five keyed records its owner committed already: the owner drops them
    (its duplicates counter says the replay happened) and stores each once."""
    c = Cluster(tmp_path, 3, initial=3).start()
    try:
        c.leader()
        name = "idemr"
        assert c["n1"].post("/v1/topics", {"name": name, "partitions": PARTS}).status == 201
        wait_for(lambda: all(c[x].get(f"/v1/topics/{name}").status == 200 for x in c.ids), 20, 0.05, "the topic")
        stats = c["n1"].get(f"/v1/topics/{name}").json()["partition_stats"]
        owner = {s["index"]: s["owner_node"] for s in stats}
        pairs = [(px, pz) for px in owner for pz in owner if owner[px] != owner[pz]]
        assert pairs, owner  # two partitions on two different nodes
        px, pz = pairs[0]
        x, z = owner[px], owner[pz]
        y = next(i for i in c.ids if i not in (x, z))
        c[z].kill9()
        r = single(c[y], name, b"blocker", "blocker", f"partition={pz}")  # held in y's WAL: z is down
        assert r.json() == {"duplicate": None, "pending": True}, r
        for i in range(5):
            assert single(c[y], name, f"k{i}".encode(), f"k{i}", f"partition={px}").json() == {"duplicate": False}
        before = c[x].metric("narad_idempotent_duplicates_total")
        assert before == 0, before  # the series exists (px is open at x) and nothing was a repeat yet
        c[y].kill9()
        c[y].start()
        wait_for(lambda: c[x].metric("narad_idempotent_duplicates_total") >= 5, 30, 0.2,
                 "the replayed keyed records dropped at their owner")
        c[z].start()
        wait_for(lambda: stored(c[y], name) == 6, 60, 0.2, "the blocker committed once z is back")
        hw = {s["index"]: s["high_watermark"] for s in c[y].get(f"/v1/topics/{name}").json()["partition_stats"]}
        assert hw[px] == 5 and hw[pz] == 1, hw
    finally:
        c.close()


def test_the_hand_packed_key_block_is_msgspecs_at_every_length() -> None:
    """``pack_idem`` (the produce path) writes what ``pack_ext(Ext(i=...))`` writes for
    every key length the API admits (fixstr, str8, a one- and a two-byte block length),
    and ``key_of`` reads each back in place; other blocks go through the decoder."""
    for n in range(0, 200):
        for ch in ("k", "é"):
            key = (ch * n)[:n] if ch == "k" else "é" * (n // 2) + "k" * (n % 2)
            stored = FR.pack_idem(key.encode(), b'{"v":1}')
            assert stored == FR.pack_ext(FR.Ext(i=key), b'{"v":1}'), (n, ch)
            assert IDEM.key_of(FR.F_EXT, stored) == key
            ks, ke = FR.idem_span(stored)  # read in place at every admitted length
            assert stored[ks:ke] == key.encode() and ks > 0 and stored[ke:] == b'{"v":1}'
    both = FR.pack_ext(FR.Ext(i="k1", h=b'{"a":"1"}'), b"x")
    assert FR.idem_span(both) == (-1, -1) and IDEM.key_of(FR.F_EXT, both) == "k1"
    assert IDEM.key_of(FR.F_EXT, FR.pack_headers(b'{"a":"1"}', b"x")) is None
    assert IDEM.key_of(FR.F_JSON, FR.pack_idem(b"k", b"x")) is None  # no F_EXT: a plain payload
    bad_utf8 = b"\x06\x81\xa1i\xa2\xff\xfe" + b"x"
    assert FR.idem_span(bad_utf8) == (5, 7) and IDEM.key_of(FR.F_EXT, bad_utf8) is None


def test_without_idem_takes_the_key_out_and_keeps_the_rest() -> None:
    """What a fan-out copy carries: the record without its idempotency key."""
    body = b'{"a":1}'
    flags = FR.F_EXT | FR.F_JSON
    assert FR.without_idem(flags, FR.pack_idem(b"k1", body)) == (FR.F_JSON, body)  # the key alone: no block left
    both = FR.pack_ext(FR.Ext(i="k1", h=b'{"x":"y"}'), body)
    f2, s2 = FR.without_idem(flags, both)
    assert f2 == flags and FR.split_ext(f2, s2) == (FR.Ext(h=b'{"x":"y"}'), body) and IDEM.key_of(f2, s2) is None
    hdr = FR.pack_headers(b'{"x":"y"}', body)
    assert FR.without_idem(flags, hdr) == (flags, hdr)  # nothing to take out: the same bytes
    assert FR.without_idem(FR.F_JSON, body) == (FR.F_JSON, body)
    bad = b"\x05\x81\xa1i\xc1\x00" + body  # a malformed block that starts like a key: left as it is
    assert FR.without_idem(flags, bad) == (flags, bad)


def test_a_batch_spanning_both_workers_is_checked_at_each_owner_and_its_ack_settles_each(node: Node) -> None:
    """A batch received by worker 0 whose keys hash to both workers' partitions: worker
    1's share crosses the hop with its keys (``CommitReq.ikeys``), repeats inside the
    batch and across calls are found at both owners, and one ack of records from both
    workers' partitions (grouped by owner from the cached placement) settles each, in request
    order, and only once."""
    name = mk(node, "idem-span")
    by_worker: dict[int, list[str]] = {0: [], 1: []}
    for i in range(400):
        k = f"s{i}"
        w = owner_worker(name, key_partition(k.encode(), PARTS), 2)
        if len(by_worker[w]) < 6:
            by_worker[w].append(k)
    keys = [k for pair in zip(by_worker[0], by_worker[1], strict=True) for k in pair]  # alternating owners
    msgs = [{"payload": {"k": k}, "idempotency_key": k} for k in keys]
    msgs += [{"payload": {"k": "again"}, "idempotency_key": by_worker[1][0]},  # a repeat in the batch, at worker 1
             {"payload": {"k": "again"}, "idempotency_key": by_worker[0][0]}]  # and at worker 0
    w0 = node.worker_connection(0)
    r = node.post(f"/v1/topics/{name}/produce/batch", {"messages": msgs}, conn=w0)
    assert r.status == 202 and r.json() == {"accepted": 14, "duplicates": 2}, r
    r = node.post(f"/v1/topics/{name}/produce/batch", {"messages": msgs[:12]}, conn=w0)
    assert r.status == 202 and r.json() == {"accepted": 12, "duplicates": 12}, r
    fresh = {"payload": {"k": "new"}, "idempotency_key": "fresh-key"}
    r = node.post(f"/v1/topics/{name}/produce/batch", {"messages": [msgs[1], fresh]}, conn=w0)
    assert r.status == 202 and r.json() == {"accepted": 2, "duplicates": 1}, r
    assert stored(node, name) == 13
    # One ack of records from both workers' partitions, with a stale handle in between
    got: list[dict[str, Any]] = []

    def take() -> bool:
        c = node.get(f"/v1/topics/{name}/consume?max=100&wait=200ms", headers={"X-Narad-Client": "tests"}, conn=w0)
        assert c.status in (200, 204), c
        if c.status == 200:
            got.extend(c.json()["messages"])
        return len(got) >= 13

    wait_for(take, 20, 0.05, "every record consumed")
    assert sorted(m["payload"]["k"] for m in got) == sorted([*keys, "new"])
    assert {owner_worker(name, m["partition"], 2) for m in got} == {0, 1}
    handles = [m["receipt_handle"] for m in got]
    p0 = got[0]["partition"]
    stale = f"{p0}:{got[0]['offset']}:12345"
    mixed = [*handles[:5], stale, *handles[5:]]
    a = node.post(f"/v1/topics/{name}/ack", {"receipt_handles": mixed}, conn=w0)
    assert a.status == 200 and [x["status"] for x in a.json()["results"]] == [204] * 5 + [410] + [204] * 8, a
    a = node.post(f"/v1/topics/{name}/ack", {"receipt_handles": handles}, conn=w0)
    assert a.status == 200 and [x["status"] for x in a.json()["results"]] == [410] * 13, a


def test_a_hops_idempotency_keys_stand_in_for_its_blocks_only_from_a_worker_of_this_node() -> None:
    """``hop_ikeys_ok``: a ``CommitReq``'s keys are used only when it came over a local
    worker link (``narad.ipc.rpc.Connection``) with one key a record; from another node
    (its peer object) or with a count that does not match, the owner reads the blocks."""
    from narad.broker.broker import hop_ikeys_ok
    from narad.cluster.rpc_server import NodePeer
    from narad.ipc.rpc import Connection

    recs = [_rec("a", b"x"), _rec(None, b"y")]
    local = object.__new__(Connection)  # (no loop needed: only its type is read)
    assert hop_ikeys_ok(P.CommitReq("t", "id", 0, recs, ["a", None]), local)
    assert not hop_ikeys_ok(P.CommitReq("t", "id", 0, recs, ["a"]), local)
    assert not hop_ikeys_ok(P.CommitReq("t", "id", 0, recs, None), local)
    assert not hop_ikeys_ok(P.CommitReq("t", "id", 0, recs, ["a", None]), object.__new__(NodePeer))
    assert not hop_ikeys_ok(P.CommitReq("t", "id", 0, recs, ["a", None]), None)
    # On the wire: trailing and defaulted, so an older worker's request decodes without it and
    # an older worker decodes a newer one, ignoring it.
    enc = msgspec.msgpack.Encoder()

    class OldCommitReq(msgspec.Struct, tag="CommitReq", array_like=True):
        topic: str
        topic_id: str
        partition: int
        records: list[P.RecordTuple]

    new = P.CommitReq("t", "id", 2, recs, ["a", None])
    assert msgspec.msgpack.decode(enc.encode(new), type=OldCommitReq).records == recs
    assert msgspec.msgpack.decode(enc.encode(OldCommitReq("t", "id", 2, recs)), type=P.CommitReq).ikeys is None
    assert msgspec.msgpack.decode(enc.encode(new), type=P.CommitReq).ikeys == ["a", None]
    # A body sent alone (the one-pass batch's: no block, its key in ikeys) is never taken
    # keyless: such a hop is refused where its keys may not stand in for blocks.
    from narad.broker.broker import hop_bodies_alone

    body_alone = (None, FR.F_JSON | FR.F_UTF8, b'{"n":1}')
    assert hop_bodies_alone(P.CommitReq("t", "id", 0, [body_alone, _rec(None, b"y")], ["a", None]))
    assert not hop_bodies_alone(P.CommitReq("t", "id", 0, recs, ["a", None]))
    assert not hop_bodies_alone(P.CommitReq("t", "id", 0, [body_alone], [None]))
    assert not hop_bodies_alone(P.CommitReq("t", "id", 0, [body_alone], None))


def test_a_body_laid_with_its_key_is_the_packed_record_on_disk_and_the_body_in_memory() -> None:
    """``FR.lay_keyed``: a record sent as its body alone with its idempotency key is
    written byte for byte as the same record packed with its key's block (``pack_idem``)
    and laid by ``lay`` (so the disk, a restart's rebuild and a move see what they saw),
    while the records kept in memory, what a consume reads, are the bodies alone. A
    record that has its block already, or no key, is laid as ``lay`` lays it."""
    keys: list[str | None] = ["k", "u" * 31, "0f8fad5b-d9cb-469f-a165-70867728950e", "v" * 122, "w" * 128,
                              "é" * 20, None, "z"]
    plain = [(None if i % 3 else b"mk%d" % i, FR.F_JSON | FR.F_UTF8, b'{"n":%d}' % i) for i in range(len(keys))]
    packed = [(k, f | FR.F_EXT, FR.pack_idem(ik.encode(), body)) if ik is not None else (k, f, body)
              for (k, f, body), ik in zip(plain, keys, strict=True)]
    a, b, c = FR.Laid(), FR.Laid(), FR.Laid()
    da: list[Any] = []
    db: list[Any] = []
    dc: list[Any] = []
    FR.lay(a, packed, 1234, da)
    FR.lay_keyed(b, plain, keys, 1234, db)
    FR.lay_keyed(c, packed, keys, 1234, dc)
    frame = FR.encode_frame(7, a)
    assert FR.encode_frame(7, b) == frame == FR.encode_frame(7, c)
    assert db == [(k, 1234, f, body) for k, f, body in plain]
    assert dc == da == [(k, 1234, f, body) for k, f, body in packed]
    back = [FR.decode_record(r) for r in FR.split_records(frame[FR.HEADER_SIZE:], len(keys))]
    assert [(k, ts, f & ~FR.F_KEY, bytes(p)) for k, ts, f, p in back] == da


@pytest.mark.parametrize("keys", [
    ["k", "u" * 31, "0f8fad5b-d9cb-469f-a165-70867728950e", "v" * 122, "é" * 20, "x" * 32, "z"],  # native: one part
    ["a", "b" * 123],  # a key of 123 bytes: laid record by record
    ["a", None, "c"],  # a record without a key: the same
    ["a", "b\0c"],  # a key holding a NUL (the joined keys do not split into two): the same
])
def test_the_native_lay_of_a_keyed_batch_is_the_packed_records_byte_for_byte(keys: list[str | None]) -> None:
    """``lay_keyed``'s common case is laid in one native call (``lay_idem``): the frame is
    byte for byte the records packed with their blocks (``pack_idem``) and laid by ``lay``,
    and memory keeps the bodies alone; the batches it declines are laid by the Python path
    with the same bytes."""
    fl = FR.F_JSON | FR.F_UTF8
    plain = [(None, fl, b'{"n":%d,"pad":"%s"}' % (i, b"p" * (i * 37 % 300))) for i in range(len(keys))]
    packed = [(None, f | FR.F_EXT, FR.pack_idem(ik.encode(), body)) if ik is not None else (None, f, body)
              for (_k, f, body), ik in zip(plain, keys, strict=True)]
    a, b = FR.Laid(), FR.Laid()
    da: list[Any] = []
    db: list[Any] = []
    FR.lay(a, packed, 1_765_432_100_123, da)
    FR.lay_keyed(b, plain, keys, 1_765_432_100_123, db)
    assert FR.encode_frame(9, b) == FR.encode_frame(9, a)
    assert len(b) == len(keys) and db == [(None, 1_765_432_100_123, f, body) for _k, f, body in plain]
    native = all(k is not None and 0 < len(k.encode()) < 123 and "\0" not in k for k in keys)
    assert (len(b.parts) == 1) == native, b.parts  # the native call lays the whole batch as one part


def test_a_commit_told_its_records_carry_no_keys_looks_into_no_block(tmp_path: Path) -> None:
    """``Partition.submit(..., NO_KEYS)`` (a keyless produce's direct commit, whose records
    can hold headers but never an idempotency key) lays the records out as they are: the
    same records committed without it are checked against the key table from their blocks
    (here, blocks that do hold keys: the repeats are dropped), with it nothing is dropped
    and no key is claimed, and combined with other batches each keeps its own rule."""
    from narad.broker.partition import NO_KEYS
    from tests.test_partition import _partition

    p = _partition(tmp_path, 2)
    recs = [_rec("a", b"1"), _rec("a", b"2"), (None, FR.F_EXT, FR.pack_headers(b'{"h":"v"}', b"3"))]

    async def go() -> list[Any]:
        p.loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as ex:
            told = await p.submit(list(recs), ex, NO_KEYS)
            held_now = held(p, ["a"])
            read = await p.commit(list(recs), ex)  # the blocks read: "a" is claimed, its repeat dropped
            both = await asyncio.gather(p.submit(list(recs), ex, NO_KEYS), p.commit([_rec("a", b"9")], ex))
            return [told, held_now, read, *both]

    told, held_now, read, mixed_told, mixed_read = asyncio.run(go())
    assert told == (2, []) and held_now == set()
    assert read == (5, [1])
    assert mixed_told == (7, []) and mixed_read == (10, [0])
    assert p.log.hwm == 10
    assert [p.log.read(i)[3] for i in range(2, 5)] == [r[2] for r in recs]
    assert NO_KEYS == []  # (never appended to)


def test_each_key_is_homed_where_a_move_must_carry_it(tmp_path: Path) -> None:
    """The node's table keeps each committed key's home partition: the one its key hashes
    to for a record without a message key (wherever it was committed), this partition for
    one with a message key; the commit and the rebuild from the log agree."""
    from narad.broker.idem_claims import ClaimTable
    from tests.test_partition import _partition

    p = _partition(tmp_path, 0)
    p.claims, p.claims_topic, p.nparts = ClaimTable.private(256), 7, 6
    keyless = [f"h{i}" for i in range(12)]
    keyed = [(b"m1", "hk1"), (b"m2", "hk2")]
    recs = [_rec(k, b"x") for k in keyless] + [(m, FR.F_EXT, FR.pack_ext(FR.Ext(i=k), b"y")) for m, k in keyed]

    async def go() -> Any:
        p.loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as ex:
            return await p.commit(recs, ex)

    assert asyncio.run(go()) == (0, [])
    now = int(time.time() * 1000)

    def homed(t: ClaimTable, topic: int) -> dict[int, set[int]]:
        fps = {t.prepare([k]).fp[0]: k for k in keyless + [k for _m, k in keyed]}
        return {h: {fps[e[0]] for e in t.collect(topic, h, now)} for h in range(6)}

    want: dict[int, set[str]] = {h: set() for h in range(6)}
    for k in keyless:
        want[key_partition(k.encode(), 6)].add(k)
    want[0] |= {"hk1", "hk2"}  # (this partition's index: 0)
    assert homed(p.claims, 7) == want
    fresh = ClaimTable.private(256)
    IDEM.rebuild(p.log, 300_000, now, fresh, 7, 0, 6)
    assert homed(fresh, 7) == want
