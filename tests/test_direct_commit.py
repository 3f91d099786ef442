"""Direct commits: a keyless produce whose partition the receiving worker chose (one it
owns, open) is committed straight into that partition, without the ingress WAL, and
answered 202 after that commit's sync and read-back. On a real node with forked
workers: ordinary keyless produce takes it (single, the synchronous entry, and batch),
and so does idempotent produce, at this worker or one hop away, with the same duplicate
verdicts (keyed produce without idempotency keys keeps the WAL); a direct commit that
fails (``NARAD_FAULT_DIRECT_COMMIT_FAIL_EVERY``) hands its records to the WAL, and every
message answered 202 is delivered exactly once; a key keeps its order when its records
change paths (the WAL's commits held back by ``NARAD_FAULT_DISPATCH_DELAY_MS``). Kill -9
under direct produce is in tests/test_crash.py."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.harness import Node, wait_for

OCTET = {"Content-Type": "application/octet-stream"}
CLIENT = {"X-Narad-Client": "tests"}
DIRECT = "narad_produced_direct_messages_total"


def drain(node: Node, topic: str, want: int, timeout: float = 30.0) -> list[str]:
    """Consume and ack until `want` messages came (and a little longer: duplicates would show)."""
    got: list[str] = []

    def more() -> bool:
        r = node.request("GET", f"/v1/topics/{topic}/consume?max=100&wait=200ms", headers=CLIENT)
        if r.status == 200:
            msgs: list[dict[str, Any]] = r.json()["messages"]
            got.extend(m["payload"] for m in msgs)
            handles = [m["receipt_handle"] for m in msgs]
            a = node.request("POST", f"/v1/topics/{topic}/ack", json.dumps({"receipt_handles": handles}).encode(),
                             headers={**CLIENT, "Content-Type": "application/json"})
            assert a.status == 200, a
        return len(got) >= want

    wait_for(more, timeout, 0.01, f"{want} messages of {topic}")
    assert node.request("GET", f"/v1/topics/{topic}/consume?max=100&wait=300ms", headers=CLIENT).status == 204
    return got


def produce_all(node: Node, topic: str, singles: int, batches: int) -> list[str]:
    sent: list[str] = []
    for i in range(singles):
        body = f"single-{i}"
        assert node.request("POST", f"/v1/topics/{topic}/produce", body.encode(), headers=OCTET).status == 202
        sent.append(body)
    for b in range(batches):
        msgs = [f"batch-{b}-{j}" for j in range(10)]
        r = node.post(f"/v1/topics/{topic}/produce/batch", {"messages": [{"payload": m} for m in msgs]})
        assert r.status == 202 and r.json() == {"accepted": 10}, r
        sent.extend(msgs)
    return sent


def test_keyless_keyed_and_idempotent_produce_commit_directly(tmp_path: Any) -> None:
    n = Node(tmp_path / "data", workers=2).start()
    try:
        assert n.post("/v1/topics", {"name": "direct", "partitions": 4}).status == 201
        sent = produce_all(n, "direct", 40, 6)
        direct = n.metric(DIRECT)  # counted before each 202
        assert 0 < direct <= len(sent)
        assert sorted(drain(n, "direct", len(sent))) == sorted(sent)

        # Idempotent messages go straight to their partition too, at this worker or one hop away (the
        # other worker owns some of the 4 partitions), once it is open and the link is up; keyed ones
        # without an idempotency key keep the WAL (one fsync answers them sooner than rounds syncing
        # every partition their keys hash to).
        assert n.post("/v1/topics", {"name": "keyed", "partitions": 4}).status == 201
        for p in range(4):  # opens every partition (a first record takes the WAL) and dials the links
            assert n.request("POST", f"/v1/topics/keyed/produce?partition={p}", f"w-{p}".encode(),
                             headers=OCTET).status == 202
        drain(n, "keyed", 4)
        before = n.metric(DIRECT)
        for i in range(30):
            r = n.request("POST", f"/v1/topics/keyed/produce?key=k{i}", f"k-{i}".encode(), headers=OCTET)
            assert r.status == 202, r
        assert n.metric(DIRECT) == before, "a keyed record without an idempotency key committed directly"
        for i in range(30):
            r = n.request("POST", f"/v1/topics/keyed/produce?idempotency_key=i{i}", f"i-{i}".encode(),
                          headers=OCTET)
            assert r.status == 202 and r.json() == {"duplicate": False}, r
        for i in range(0, 30, 3):  # repeats: answered as such, stored nothing
            r = n.request("POST", f"/v1/topics/keyed/produce?idempotency_key=i{i}", b"again", headers=OCTET)
            assert r.status == 202 and r.json() == {"duplicate": True}, r
        msgs = [{"payload": f"b-{j}", "idempotency_key": f"b{j}"} for j in range(20)]
        msgs += [{"payload": "again", "idempotency_key": f"b{j}"} for j in range(5)]  # repeats within the batch
        msgs += [{"payload": "again", "idempotency_key": f"i{j}"} for j in range(5)]  # repeats of earlier ones
        r = n.post("/v1/topics/keyed/produce/batch", {"messages": msgs})
        assert r.status == 202 and r.json() == {"accepted": 30, "duplicates": 10}, r
        # counted before each 202: every idempotent record above (repeats included) was committed directly
        assert n.metric(DIRECT) - before >= 30 + 10 + 30 - 10, "idempotent produce took the WAL"
        mid = n.metric(DIRECT)
        r = n.post("/v1/topics/keyed/produce/batch",
                   {"messages": [{"payload": f"ko-{j}", "key": "same"} for j in range(10)]})
        assert r.status == 202 and r.json() == {"accepted": 10}, r
        r = n.post("/v1/topics/keyed/produce/batch",
                   {"messages": [{"payload": f"kb-{j}", "key": f"q{j % 7}"} for j in range(20)]})
        assert r.status == 202 and r.json() == {"accepted": 20}, r
        assert n.metric(DIRECT) == mid, "a keyed batch without idempotency keys committed directly"
        got = drain(n, "keyed", 110)
        assert sorted(got) == sorted([f"k-{i}" for i in range(30)] + [f"i-{i}" for i in range(30)]
                                     + [f"b-{j}" for j in range(20)] + [f"kb-{j}" for j in range(20)]
                                     + [f"ko-{j}" for j in range(10)])
    finally:
        n.close()


def replay_all(node: Node, topic: str, partition: int) -> list[str]:
    """Partition `partition` of `topic` in offset order."""
    hwm = node.get(f"/v1/topics/{topic}?partition={partition}").json()["partition_stats"][0]["high_watermark"]
    out = []
    for off in range(hwm):
        r = node.get(f"/v1/topics/{topic}/consume?partition={partition}&offset={off}")
        assert r.status == 200, r
        out.append(r.json()["payload"])
    return out


def test_a_key_keeps_its_order_when_its_records_change_paths(tmp_path: Any) -> None:
    """Keyed records with idempotency keys (which take direct commits): every third direct
    commit fails and takes the WAL, whose commits start 400 ms late, so its answer comes
    with its verdict pending (after 100 ms, a test seam): a record of the same key
    produced through the same worker after that answer must not overtake it by committing
    directly, here or one hop away (it waits behind the WAL's records for its partition).
    One keep-alive connection: one worker."""
    env = {"NARAD_FAULT_DIRECT_COMMIT_FAIL_EVERY": "3", "NARAD_FAULT_DISPATCH_DELAY_MS": "400",
           "NARAD_FAULT_IDEM_WAIT_MS": "100"}
    n = Node(tmp_path / "data", workers=2, env=env).start()
    try:
        assert n.post("/v1/topics", {"name": "ordered", "partitions": 3}).status == 201
        for p in range(3):
            assert n.request("POST", f"/v1/topics/ordered/produce?partition={p}", b"open",
                             headers=OCTET).status == 202
        wait_for(lambda: all(n.get(f"/v1/topics/ordered?partition={p}").json()["partition_stats"][0]
                             ["high_watermark"] == 1 for p in range(3)), 10, 0.02, "every partition open")
        before = n.metric(DIRECT)
        keys = ["a", "b", "c", "d", "e", "f"]
        rounds = 14
        pending = 0
        c = n.worker_connection(0)
        for i in range(rounds):
            for k in keys:
                r = n.request("POST", f"/v1/topics/ordered/produce?key={k}&idempotency_key={k}{i}",
                              f"{k}-{i}".encode(), headers=OCTET, conn=c)
                assert r.status == 202 and r.json().get("duplicate") in (False, None), r
                pending += r.json().get("pending", False)
        r = n.post("/v1/topics/ordered/produce/batch",
                   {"messages": [{"payload": f"{k}-{rounds}", "key": k, "idempotency_key": f"{k}{rounds}"}
                                 for k in keys]}, conn=c)
        assert r.status == 202, r
        c.close()
        assert n.metric(DIRECT) > before, "no record took a direct commit"
        assert pending > 0, "no answer came before its WAL commit (the case this test is about)"

        def all_in() -> bool:
            return sum(n.get(f"/v1/topics/ordered?partition={p}").json()["partition_stats"][0]
                       ["high_watermark"] for p in range(3)) == 3 + (rounds + 1) * len(keys)

        wait_for(all_in, 30, 0.05, "every record committed")
        for p in range(3):
            seen: dict[str, list[int]] = {}
            for m in replay_all(n, "ordered", p):
                if m != "open":
                    k, i = m.split("-")
                    seen.setdefault(k, []).append(int(i))
            for k, order in seen.items():
                assert order == list(range(rounds + 1)), f"key {k} out of order in partition {p}: {order}"
    finally:
        n.close()


def test_a_failed_direct_commit_hands_its_records_to_the_wal(tmp_path: Any) -> None:
    n = Node(tmp_path / "data", workers=1, env={"NARAD_FAULT_DIRECT_COMMIT_FAIL_EVERY": "3"}).start()
    try:
        assert n.post("/v1/topics", {"name": "fallback", "partitions": 3}).status == 201
        sent = produce_all(n, "fallback", 60, 10)
        got = drain(n, "fallback", len(sent))
        assert sorted(got) == sorted(sent), "a message answered 202 was lost or duplicated"
        direct = n.metric(DIRECT)  # counted before each 202
        # every third direct attempt failed and went through the WAL: at most two thirds committed directly
        assert 0 < direct <= len(sent) * 2 / 3 + 10
    finally:
        n.close()


def test_a_failed_direct_commit_of_one_idempotent_record_takes_the_wal_with_its_verdict(tmp_path: Any) -> None:
    """A single produce with an idempotency key is committed directly without a plan
    (``Broker.direct_one``); when that commit fails (every second one here), the WAL takes
    the record and the answer still carries the owner's verdict: stored once, repeats
    answered as repeats whichever path the first copy took."""
    n = Node(tmp_path / "data", workers=1, env={"NARAD_FAULT_DIRECT_COMMIT_FAIL_EVERY": "2"}).start()
    try:
        assert n.post("/v1/topics", {"name": "onefail", "partitions": 3}).status == 201
        for i in range(20):
            r = n.request("POST", f"/v1/topics/onefail/produce?idempotency_key=k{i}", f"v-{i}".encode(),
                          headers=OCTET)
            assert r.status == 202 and r.json() == {"duplicate": False}, (i, r)
        direct = n.metric(DIRECT)
        assert 0 < direct < 20, f"{direct} of 20 committed directly: the fault seam did not split them"
        for i in range(20):
            r = n.request("POST", f"/v1/topics/onefail/produce?idempotency_key=k{i}", b"again", headers=OCTET)
            assert r.status == 202 and r.json() == {"duplicate": True}, (i, r)
        assert sorted(drain(n, "onefail", 20)) == sorted(f"v-{i}" for i in range(20))
    finally:
        n.close()


@pytest.mark.parametrize("local", ["false", "true"])
def test_a_one_pass_keyed_batch_whose_direct_commits_fail_takes_the_wal_whole(tmp_path: Any, local: str) -> None:
    """The one-pass keyed batch builds its WAL entries only when something needs them
    (``DeferredEntries``): here every second direct commit fails, so some partitions'
    records go to the WAL after the others committed. Every record is stored once (in
    its key's partition, without topic.idempotent_local_placement), each answer counts no
    duplicates, and the same batches again are all duplicates, whichever path each first
    copy took."""
    from narad.broker.routing import key_partition

    n = Node(tmp_path / "data", workers=1, env={"NARAD_FAULT_DIRECT_COMMIT_FAIL_EVERY": "2",
                                                "NARAD_TOPIC_IDEMPOTENT_LOCAL_PLACEMENT": local}).start()
    try:
        assert n.post("/v1/topics", {"name": "keyedfail", "partitions": 3}).status == 201
        batches = [[{"payload": f"b{b}-{j}", "idempotency_key": f"k-{b}-{j}"} for j in range(12)] for b in range(8)]
        for msgs in batches:
            r = n.post("/v1/topics/keyedfail/produce/batch", {"messages": msgs})
            assert r.status == 202 and r.json() == {"accepted": 12, "duplicates": 0}, r
        direct = n.metric(DIRECT)
        assert 0 < direct < 96, f"{direct} of 96 committed directly: the fault seam did not split them"
        for msgs in batches:
            r = n.post("/v1/topics/keyedfail/produce/batch", {"messages": msgs})
            assert r.status == 202 and r.json() == {"accepted": 12, "duplicates": 12}, r
        got: dict[str, int] = {}

        def more() -> bool:
            r = n.request("GET", "/v1/topics/keyedfail/consume?max=100&wait=200ms", headers=CLIENT)
            if r.status == 200:
                ms = r.json()["messages"]
                for m in ms:
                    assert m["payload"] not in got, f"{m['payload']} delivered twice"
                    got[m["payload"]] = m["partition"]
                a = n.request("POST", "/v1/topics/keyedfail/ack",
                              json.dumps({"receipt_handles": [m["receipt_handle"] for m in ms]}).encode(),
                              headers={**CLIENT, "Content-Type": "application/json"})
                assert a.status == 200, a
            return len(got) >= 96

        wait_for(more, 30, 0.01, "96 messages")
        want = {m["payload"]: key_partition(m["idempotency_key"].encode(), 3) for msgs in batches for m in msgs}
        if local == "false":
            assert got == want
        else:
            assert set(got) == set(want)
    finally:
        n.close()


def test_an_idempotent_produce_frees_its_in_flight_share_once_durable(tmp_path: Any) -> None:
    """The per-identity produce cap counts a produce until it is durable, not while it
    waits for its WAL records' verdicts: a batch with one record committed directly and
    one through the WAL (its partition not open yet; the WAL's commits start 1.5 s late)
    is durable at once, so a second produce that fits the cap only without it is taken."""
    from narad.broker.routing import key_partition

    env = {"NARAD_FAULT_DISPATCH_DELAY_MS": "1500", "NARAD_HTTP_MAX_PRODUCE_IN_FLIGHT_PER_IDENTITY": "20",
           "NARAD_TOPIC_IDEMPOTENT_LOCAL_PLACEMENT": "false"}  # (its records placed by their keys)
    n = Node(tmp_path / "data", workers=1, env=env).start()
    try:
        assert n.post("/v1/topics", {"name": "capped", "partitions": 3}).status == 201
        assert n.request("POST", "/v1/topics/capped/produce?partition=0", b"open", headers=OCTET).status == 202
        wait_for(lambda: n.get("/v1/topics/capped?partition=0").json()["partition_stats"][0]["high_watermark"] == 1,
                 10, 0.02, "partition 0 open")
        k0 = next(f"a{i}" for i in range(1000) if key_partition(f"a{i}".encode(), 3) == 0)
        k1 = next(f"b{i}" for i in range(1000) if key_partition(f"b{i}".encode(), 3) == 1)
        first: list[Any] = []

        def produce_first() -> None:
            first.append(n.post("/v1/topics/capped/produce/batch",
                                {"messages": [{"payload": "x0", "idempotency_key": k0},
                                              {"payload": "x1", "idempotency_key": k1}]}))

        import threading
        th = threading.Thread(target=produce_first)
        t0 = time.monotonic()
        th.start()
        time.sleep(0.4)  # the first is durable by now and waits for partition 1's verdict (1.5 s)
        assert not first, "the first produce was answered before its WAL record's verdict"
        r = n.post("/v1/topics/capped/produce/batch", {"messages": [{"payload": f"y{i}"} for i in range(19)]})
        assert r.status == 202, f"a durable produce waiting for its verdicts still held its share: {r}"
        th.join(10)
        assert first and first[0].status == 202 and first[0].json() == {"accepted": 2, "duplicates": 0}, first
        assert time.monotonic() - t0 >= 1.0, "the verdict came without waiting for the delayed commit"
    finally:
        n.close()


def test_direct_commits_for_another_worker_share_one_hop(tmp_path: Any) -> None:
    """An idempotent batch whose keys hash to several partitions of the other worker sends
    them in one hop (``CommitManyReq``), not one ``CommitReq`` per partition, with the same
    verdicts; and the receiving worker answers each part of such a hop on its own: a part
    for a stale incarnation is refused (409) while the others commit, and a part for a
    partition the receiver does not own is passed on to its owner."""
    import asyncio

    from narad.broker import peers as P
    from narad.broker.routing import key_partition, owner_worker
    from narad.ipc import rpc
    from narad.storage.frames import F_UTF8

    hops = "narad_worker_hops_total"
    n = Node(tmp_path / "data", workers=2, env={"NARAD_TOPIC_IDEMPOTENT_LOCAL_PLACEMENT": "false"}).start()
    try:
        assert n.post("/v1/topics", {"name": "spread", "partitions": 8}).status == 201
        theirs = [p for p in range(8) if owner_worker("spread", p, 2) == 1]
        mine = [p for p in range(8) if owner_worker("spread", p, 2) == 0]
        assert len(theirs) >= 2 and mine, (theirs, mine)
        for p in range(8):  # opens every partition and dials the links
            assert n.request("POST", f"/v1/topics/spread/produce?partition={p}", f"w-{p}".encode(),
                             headers=OCTET).status == 202
        assert len(drain(n, "spread", 8)) == 8
        keys = [f"id-{i}" for i in range(200)]
        spanned = {key_partition(k.encode(), 8) for k in keys}
        assert set(theirs) <= spanned
        c = n.worker_connection(0)  # the batch lands on worker 0: worker 1's partitions are one hop away

        def batch(payload: str) -> dict[str, Any]:
            body = json.dumps({"messages": [{"payload": f"{payload}-{k}", "idempotency_key": k} for k in keys]})
            c.request("POST", "/v1/topics/spread/produce/batch", body,
                      {"Content-Type": "application/json", "Authorization": n.auth})
            r = c.getresponse()
            out = json.loads(r.read())
            assert r.status == 202, out
            return out  # type: ignore[no-any-return]

        def hop_count(op: str) -> float:
            for line in n.get("/metrics").body.decode().splitlines():
                if line.startswith(f'{hops}{{op="{op}"}} '):
                    return float(line.rsplit(" ", 1)[1])
            return 0.0

        many0, one0 = hop_count("CommitManyReq"), hop_count("CommitReq")
        assert batch("first") == {"accepted": 200, "duplicates": 0}
        assert batch("again") == {"accepted": 200, "duplicates": 200}
        assert hop_count("CommitManyReq") - many0 == 2  # one hop per batch for worker 1's partitions
        assert hop_count("CommitReq") == one0
        got = drain(n, "spread", 200)
        assert sorted(got) == sorted(f"first-{k}" for k in keys)

        topic_id = n.get("/v1/topics/spread").json()["id"]

        async def parts() -> P.CommitManyResp:
            conn = await rpc.connect_unix(str(n.runtime_dir / "w1.sock"))
            try:
                req = P.CommitManyReq([
                    P.CommitReq("spread", topic_id, theirs[0], [(None, F_UTF8, b"part-ok")]),
                    P.CommitReq("spread", "00" * 16, theirs[1], [(None, F_UTF8, b"part-stale")]),
                    P.CommitReq("spread", topic_id, mine[0], [(None, F_UTF8, b"part-passed-on")]),
                ])
                return await conn.call(req, P.CommitManyResp, timeout=15.0)
            finally:
                conn.close()

        resp = asyncio.run(parts())
        ok, stale, passed = resp.parts
        assert ok.status == 0 and ok.base >= 1, ok
        assert stale.status == 409 and stale.code == "incarnation_mismatch", stale
        assert passed.status == 0 and passed.base >= 1, passed
        assert sorted(drain(n, "spread", 2)) == ["part-ok", "part-passed-on"]
    finally:
        n.close()
