"""The Python SDK (narad.client) against real nodes: every call's round trip over
HTTP/1.1 and HTTP/3, the typed errors a real node answers, the consumer loop
(lease renewal past the visibility timeout, cancellation on lease loss, nack and
redelivery, graceful stop), the Go envelope, and failover inside a 3-node cluster.

The retry rules for answers a real node gives only under faults (a produce 5xx,
503 with Retry-After, per-handle 503 in a batch ack, a dropped connection) are
checked against a scripted HTTP/1.1 server in this process: it records every
request, so a test sees exactly what the SDK sent again and what it did not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from narad.client import (
    AsyncClient,
    BadGateway,
    BadRequest,
    BatchMessage,
    Client,
    ClientClosed,
    Conflict,
    ConnectError,
    ConnectionLost,
    Forbidden,
    Grant,
    InternalServerError,
    LeaseGone,
    Misdirected,
    NotFound,
    OffsetGone,
    Outcome,
    PayloadTooLarge,
    PoolTimeout,
    RawJSON,
    RequestTimeout,
    RetryPolicy,
    TooManyRequests,
    Unauthorized,
    Unavailable,
)
from narad.client.envelope import unwrap, wrap
from tests.harness import ADMIN_PASSWORD, Cluster, Node, free_ports, wait_for

ADMIN = ("admin", ADMIN_PASSWORD)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("sdk") / "data", workers=2).start()
    try:
        yield n
    finally:
        n.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def client(node: Node, **kw: Any) -> AsyncClient:
    kw.setdefault("auth", ADMIN)
    return AsyncClient(f"127.0.0.1:{node.port}", **kw)


async def drain(c: AsyncClient, topic: str, n: int, wait: float = 5.0) -> list[Any]:
    """Consume and ack until n messages came (or the deadline)."""
    got: list[Any] = []
    end = time.monotonic() + wait
    while len(got) < n and time.monotonic() < end:
        ms = await c.consume_batch(topic, 100, wait=0.5)
        if ms:
            got += ms
            await c.ack_batch(topic, ms)
    return got


# ---- round trips ------------------------------------------------------------------------------
def test_every_call_round_trips(node: Node) -> None:
    async def go() -> None:
        async with client(node) as c:
            t = await c.create_topic("sdk-rt", partitions=3, visibility_timeout_ms=5000, retention_ms=7_200_000,
                                     max_in_flight_per_partition=64, max_acked_ahead_per_partition=64)
            assert (t.name, t.partitions, t.visibility_timeout_ms, t.retention_ms) == ("sdk-rt", 3, 5000, 7_200_000)
            assert t.owner == "admin" and t.role is None and len(t.id) == 16

            # produce: JSON, text, bytes, key (binary too), pinned partition
            await c.produce("sdk-rt", {"n": 1}, key="k1")
            await c.produce("sdk-rt", "plain text", partition=1)
            await c.produce("sdk-rt", b"\xff\x00raw", key=b"\xfe\xff", partition=2)
            assert await c.produce_batch("sdk-rt", [{"n": 2}, BatchMessage("t2", key="k2"),
                                                    BatchMessage(b"\x01\x02", key=b"\x80", partition=0),
                                                    RawJSON(b'[1, 2]')]) == 4
            got = await drain(c, "sdk-rt", 7)
            by = {m.payload: m for m in got}
            assert set(by) == {b'{"n":1}', b"plain text", b"\xff\x00raw", b'{"n":2}', b"t2", b"\x01\x02", b"[1, 2]"}
            assert by[b'{"n":1}'].key == b"k1" and by[b'{"n":1}'].json() == {"n": 1}
            assert by[b"plain text"].partition == 1 and by[b"plain text"].payload_kind == "text"
            raw = by[b"\xff\x00raw"]
            assert (raw.key, raw.partition, raw.payload_kind) == (b"\xfe\xff", 2, "bytes")
            assert by[b"\x01\x02"].key == b"\x80" and by[b"\x01\x02"].partition == 0
            assert all(m.receipt_handle and m.timestamp > 1_600_000_000 for m in got)

            # replay: a stored record without a lease; past the end: None
            m = by[b"\xff\x00raw"]
            r = await c.replay("sdk-rt", m.partition, m.offset)
            assert r is not None and r.payload == b"\xff\x00raw" and r.receipt_handle is None
            assert await c.replay("sdk-rt", 2, 10_000) is None

            # consume single, extend, nack (back at once, new handle), ack; long poll
            assert await c.consume("sdk-rt") is None
            await c.produce("sdk-rt", {"n": 3})
            m1 = await c.consume("sdk-rt", wait=5)
            assert m1 is not None and m1.json() == {"n": 3}
            await c.extend("sdk-rt", m1)
            await c.nack("sdk-rt", m1.receipt_handle or "")
            m2 = await c.consume("sdk-rt", wait=5)
            assert m2 is not None and m2.json() == {"n": 3} and m2.receipt_handle != m1.receipt_handle
            await c.ack("sdk-rt", m2)
            with pytest.raises(LeaseGone):
                await c.ack("sdk-rt", m2)
            t0 = time.monotonic()
            assert await c.consume("sdk-rt", wait=0.3) is None
            assert time.monotonic() - t0 >= 0.25  # it waited (parked), then 204
            poll = asyncio.ensure_future(c.consume("sdk-rt", wait=8))
            await asyncio.to_thread(node.wait_parked, 1)  # the poll is parked on the node
            await c.produce("sdk-rt", {"n": 4})
            m3 = await poll
            assert m3 is not None and m3.json() == {"n": 4}

            # batch ack: one result per handle, in order
            res = await c.ack_batch("sdk-rt", [m3, m3.receipt_handle or "", "0:0:1"])
            assert [r.status for r in res] == [204, 410, 410] and res[0].ok and res[1].error

            # describe (stats), list (paging), alter, schema
            d = await c.describe_topic("sdk-rt")
            assert d.name == "sdk-rt" and len(d.partition_stats) == 3 and not d.partial
            assert sum(s.high_watermark for s in d.partition_stats) == 9
            assert (await c.describe_topic("sdk-rt", partition=1)).partition_stats[0].index == 1
            for name in ("sdk-page-a", "sdk-page-b", "sdk-page-c"):
                await c.create_topic(name)
            page = await c.list_topics(limit=1, page_token="sdk-page-a")
            assert [x.name for x in page.topics] == ["sdk-page-a"] and page.next_page_token == "sdk-page-b"
            names = [x.name async for x in c.iter_topics(page_size=2)]
            assert {"sdk-rt", "sdk-page-a", "sdk-page-b", "sdk-page-c"} <= set(names) and names == sorted(names)
            a = await c.alter_topic("sdk-rt", retention_ms=10_800_000, partitions=4)
            assert (a.retention_ms, a.partitions) == (10_800_000, 4)
            s = await c.topic_schema("sdk-rt")
            assert s["version"] == 0 and s["versions"] == []

            # children: attach / list / detach; create as a (delay) child
            p = await c.attach_child("sdk-page-a", "sdk-page-b")
            assert p.role == "parent" and p.children == ["sdk-page-b"]
            kids = await c.list_children("sdk-page-a")
            assert kids.parent == "sdk-page-a" and [k.name for k in kids.children] == ["sdk-page-b"]
            await c.detach_child("sdk-page-a", "sdk-page-b")
            assert (await c.list_children("sdk-page-a")).children == []
            dc = await c.create_topic("sdk-page-delayed", parent="sdk-page-a", fanout_delay_ms=60_000)
            assert dc.role == "child" and dc.parent == "sdk-page-a" and dc.delay_ms == 60_000
            for name in ("sdk-page-delayed", "sdk-page-a", "sdk-page-b", "sdk-page-c"):
                await c.delete_topic(name)
            with pytest.raises(NotFound):
                await c.describe_topic("sdk-page-c")

            # users
            u = await c.create_user("sdk-u1", "pw-one", [Grant("consume", ["sdk-*"])])
            assert u.username == "sdk-u1" and u.grants == [Grant("consume", ["sdk-*"])] and not u.root
            assert (await c.get_user("sdk-u1")).created_at_ms > 0
            assert {"admin", "sdk-u1"} <= {x.username for x in await c.list_users()}
            u = await c.set_grants("sdk-u1", [Grant("produce", ["sdk-rt"]), Grant("consume", ["sdk-rt"])])
            assert [g.action for g in u.grants] == ["produce", "consume"]
            async with client(node, auth=("sdk-u1", "pw-one")) as cu:
                await cu.set_password("sdk-u1", "pw-two", current_password="pw-one")
            async with client(node, auth=("sdk-u1", "pw-two")) as cu:
                await cu.produce("sdk-rt", {"from": "u1"})  # its produce grant works with the new password
            await c.set_password("sdk-u1", "pw-three")
            await c.delete_user("sdk-u1")
            with pytest.raises(NotFound):
                await c.get_user("sdk-u1")
            await drain(c, "sdk-rt", 1)

    run(go())


def test_http3_and_the_sync_client(node: Node) -> None:
    async def go() -> None:
        async with client(node, http3=True, verify=False) as c:
            await c.create_topic("sdk-h3")
            await c.produce("sdk-h3", {"over": "quic"}, key="q")
            assert await c.produce_batch("sdk-h3", ["a", "b"]) == 2
            got = await drain(c, "sdk-h3", 3)
            assert sorted(m.payload for m in got) == [b"a", b"b", b'{"over":"quic"}']
            with pytest.raises(NotFound):
                await c.consume("sdk-nope")

    run(go())
    with Client(f"127.0.0.1:{node.port}", auth=ADMIN) as sc:
        sc.produce("sdk-h3", [1, 2, 3])
        m = sc.consume("sdk-h3", wait=5)
        assert m is not None and m.json() == [1, 2, 3]
        sc.ack("sdk-h3", m)
        assert "sdk-h3" in {t.name for t in sc.iter_topics()}
        sc.delete_topic("sdk-h3")
        with pytest.raises(NotFound):
            sc.describe_topic("sdk-h3")


def test_http3_client_recovers_soon_after_a_node_is_killed_and_restarted(tmp_path: Path) -> None:
    """A node killed (-9) and restarted on the same port: QUIC on the client's side
    only notices after its idle timeout (60 s); the SDK drops a connection whose
    request timed out, so a new one is opened and produces succeed again within
    seconds (the produce carries an idempotency key: sending it again after a timeout
    is safe)."""
    n = Node(tmp_path / "data", workers=1).start()
    try:
        async def go() -> float:
            async with client(n, http3=True, verify=False, timeout=1.0,
                              retry=RetryPolicy(max_attempts=1, deadline=2)) as c:
                await c.create_topic("sdk-h3r")
                await c.produce("sdk-h3r", {"before": 1})
                await asyncio.to_thread(n.kill9)
                await asyncio.to_thread(n.start)
                t0 = time.monotonic()
                while True:
                    try:
                        await c.produce("sdk-h3r", {"after": 1}, idempotency_key="after-1")
                        return time.monotonic() - t0
                    except (ConnectionLost, ConnectError) as e:
                        assert time.monotonic() - t0 < 20, f"still failing after 20 s: {e!r}"
                    except Exception as e:  # a timeout (uncertain): keyed, so sending again is safe
                        assert time.monotonic() - t0 < 20, f"still failing after 20 s: {e!r}"
                    await asyncio.sleep(0.2)

        took = run(go())
        assert took < 20
    finally:
        n.close()


def test_go_envelope_interop(node: Node) -> None:
    # Exactly what narad-go's WithEnvelope writes (field order, omitted empties, UUIDv7 id).
    go_bytes = (b'{"_narad":1,"id":"0190f1a2-7b3c-7def-8123-456789abcdef","body":{"order":7},'
                b'"produced_at":1722000000000,"attempts":2,"last_error":"boom","headers":{"trace":"t1"}}')

    async def go() -> None:
        async with client(node) as c:
            await c.create_topic("sdk-env")
            await c.produce("sdk-env", RawJSON(go_bytes), partition=0)  # a Go producer's message
            await c.produce("sdk-env", {"order": 8}, envelope=True, headers={"trace": "t2"}, partition=0)
            await c.produce("sdk-env", {"_narad_not": 1, "id": "x"}, partition=0)  # not an envelope
            got = sorted(await drain(c, "sdk-env", 3), key=lambda m: m.offset)
            e0, e1 = got[0].envelope(), got[1].envelope()
            assert e0 is not None and e0.id == "0190f1a2-7b3c-7def-8123-456789abcdef" and e0.attempts == 2
            assert e0.last_error == "boom" and e0.headers == {"trace": "t1"} and got[0].body() == {"order": 7}
            assert e1 is not None and e1.attempts == 1 and e1.headers == {"trace": "t2"}
            assert got[1].body() == {"order": 8}
            assert e1.id[14] == "7" and abs(e1.produced_at - time.time() * 1000) < 60_000
            doc = json.loads(got[1].payload)
            assert list(doc) == ["_narad", "id", "body", "produced_at", "attempts", "headers"]  # Go's order
            assert got[2].envelope() is None and got[2].body() == {"_narad_not": 1, "id": "x"}
            with pytest.raises(ValueError):
                await c.produce("sdk-env", b"raw bytes", envelope=True)

            # retry_later: republish with attempts + 1 and the error, ack the original
            await c.produce("sdk-env", {"order": 9}, envelope=True)
            m = await c.consume("sdk-env", wait=5)
            assert m is not None
            await c.retry_later(m, RuntimeError("db down"))
            again = await c.consume("sdk-env", wait=5)
            assert again is not None
            env = again.envelope()
            assert env is not None and env.attempts == 2 and env.last_error == "db down"
            assert again.body() == {"order": 9}
            assert env.id == unwrap(m.payload).id  # type: ignore[union-attr]
            with pytest.raises(LeaseGone):
                await c.ack("sdk-env", m)  # retry_later settled the original
            await c.ack("sdk-env", again)

    run(go())
    assert unwrap(wrap(b'"s"')) is not None and unwrap(b'{"id": 1}') is None and unwrap(b"[") is None


# ---- typed errors ---------------------------------------------------------------------------------
def test_typed_errors_from_a_real_node(node: Node) -> None:
    async def go() -> None:
        async with client(node) as c:
            await c.create_topic("sdk-err")
            await c.create_topic("sdk-err-delayed", parent="sdk-err", fanout_delay_ms=60_000)
            await c.create_user("sdk-nogrant", "pw", [Grant("consume", ["other-*"])])
            await c.create_user("sdk-throttle", "right-pw", [])
            with pytest.raises(BadRequest) as bad:
                await c.produce("sdk-err", "x", partition=99)
            assert bad.value.status == 400 and "partition out of range" in bad.value.message
            with pytest.raises(NotFound):
                await c.produce("sdk-missing", "x")
            with pytest.raises(Conflict):
                await c.create_topic("sdk-err")
            with pytest.raises(Conflict) as delayed:
                await c.produce("sdk-err-delayed", "x")
            assert "delay child" in delayed.value.message
            with pytest.raises(PayloadTooLarge):
                await c.produce("sdk-err", b"x" * ((1 << 20) + 1))
            with pytest.raises(LeaseGone):
                await c.nack("sdk-err", "1:0:12345")
            with pytest.raises(BadRequest):
                await c.ack("sdk-err", "not-a-handle")
            async with client(node, auth=("admin", "wrong")) as bad_c:
                with pytest.raises(Unauthorized):
                    await bad_c.list_topics()
            async with client(node, auth=("sdk-nogrant", "pw")) as ng:
                with pytest.raises(Forbidden):
                    await ng.produce("sdk-err", "x")
                with pytest.raises(Forbidden):
                    await ng.create_user("x", "y")
            async with client(node, auth=("sdk-throttle", "wrong-pw")) as th:
                for _ in range(5):
                    with pytest.raises(Unauthorized):
                        await th.list_topics()
                with pytest.raises(TooManyRequests) as many:
                    await th.list_topics()
                assert many.value.retry_after is not None and many.value.retry_after >= 1
            await c.delete_topic("sdk-err-delayed")
            await c.delete_topic("sdk-err")

    run(go())


# ---- the consumer loop -------------------------------------------------------------------------------
def _collect(consumer: Any, n: int, timeout: float) -> Callable[[], Any]:
    async def take() -> list[Outcome]:
        out: list[Outcome] = []

        async def loop() -> None:
            async with contextlib.aclosing(aiter(consumer)) as outcomes:  # closed at the break: drained
                async for o in outcomes:
                    out.append(o)
                    if len(out) >= n:
                        break

        await asyncio.wait_for(loop(), timeout)
        return out

    return take


def test_consumer_renews_the_lease_past_the_visibility_timeout(node: Node) -> None:
    calls: list[bytes] = []

    async def handler(m: Any) -> None:
        calls.append(m.payload)
        await asyncio.sleep(2.5)  # 2.5 x the 1 s visibility timeout

    async def go() -> None:
        async with client(node) as c:
            await c.create_topic("sdk-renew", visibility_timeout_ms=1000)
            await c.produce("sdk-renew", {"slow": 1})
            # a second slot: a lapsed lease would be redelivered into it (handler called twice)
            cons = c.consume_forever("sdk-renew", handler, concurrency=2, wait=1)
            outs = await _collect(cons, 1, 20)()
            assert [o.result for o in outs] == ["acked"] and outs[0].extends >= 2
            assert calls == [b'{"slow":1}']
            assert await c.consume("sdk-renew", wait=1.2) is None  # acked: never comes back
            d = await c.describe_topic("sdk-renew")
            assert sum(s.high_watermark for s in d.partition_stats) == 1
            assert sum(s.in_flight for s in d.partition_stats) == 0
            assert sum(s.lag for s in d.partition_stats) == 0

    run(go())


def test_consumer_visibility_timeout_is_each_leases_length(node: Node) -> None:
    """``visibility_timeout`` is sent as each consume's and extend's lease length: with
    the topic's 1 s and the pool's 6 s, a 3 s handler keeps its message (another
    consumer polling meanwhile never gets it), renewed at 3 s, then acked."""
    calls: list[bytes] = []

    async def handler(m: Any) -> None:
        calls.append(m.payload)
        await asyncio.sleep(3)

    async def go() -> None:
        async with client(node) as c:
            await c.create_topic("sdk-vis", visibility_timeout_ms=1000)
            await c.produce("sdk-vis", {"v": 1})
            cons = c.consume_forever("sdk-vis", handler, concurrency=1, wait=1, visibility_timeout=6)
            task = asyncio.ensure_future(_collect(cons, 1, 20)())
            deadline = time.monotonic() + 10
            while not calls:  # the pool has it: from here on another consumer must not get it
                assert time.monotonic() < deadline, "the pool never got the message"
                await asyncio.sleep(0.02)
            stolen: list[Any] = []
            end = time.monotonic() + 3.2
            while time.monotonic() < end:
                m = await c.consume("sdk-vis", wait=0.5)
                if m is not None:
                    stolen.append(m)
            outs = await task
            assert stolen == [] and [o.result for o in outs] == ["acked"] and calls == [b'{"v":1}']

    run(go())


def test_a_handler_that_settles_its_own_message_is_not_acked_again(node: Node) -> None:
    """retry_later (or an explicit ack) in the handler settles the message: the loop
    does not ack it again (that would get 410 and report a lost lease)."""
    async def go() -> None:
        async with client(node) as c:
            await c.create_topic("sdk-own")
            await c.create_topic("sdk-own-parked")
            await c.produce("sdk-own", {"n": 1}, envelope=True)
            await c.produce("sdk-own", {"n": 2})

            async def handler(m: Any) -> None:
                if m.envelope() is not None:
                    await c.retry_later(m, "parked", "sdk-own-parked")
                else:
                    await c.ack("sdk-own", m)

            outs = await _collect(c.consume_forever("sdk-own", handler, wait=1), 2, 20)()
            assert [o.result for o in outs] == ["acked", "acked"], outs
            parked = await c.consume("sdk-own-parked", wait=2)
            assert parked is not None and parked.envelope() is not None

    run(go())


def test_consumer_ends_when_its_client_closes_and_stop_returns_after_a_cancel(node: Node) -> None:
    async def handler(m: Any) -> None:
        await asyncio.sleep(0.3)

    async def go() -> None:
        c = client(node)
        await c.create_topic("sdk-close")
        cons = c.consume_forever("sdk-close", handler, wait=1)
        task = asyncio.ensure_future(cons)
        await c.produce("sdk-close", {"x": 1})
        await asyncio.sleep(0.5)
        await c.close()
        with pytest.raises(ClientClosed):  # fatal: not retried for ever
            await asyncio.wait_for(task, 15)
        async with client(node) as c2:
            cons2 = c2.consume_forever("sdk-close", handler, wait=1)
            task2 = asyncio.ensure_future(cons2)
            await asyncio.sleep(0.3)
            task2.cancel()
            await asyncio.wait_for(cons2.stop(), 15)  # returns: the cancelled pool has drained

    run(go())


def test_consumer_cancels_the_handler_when_the_lease_is_lost(node: Node) -> None:
    held: asyncio.Queue[Any] = asyncio.Queue()
    cancelled: list[bool] = []

    async def handler(m: Any) -> None:
        held.put_nowait(m)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def go() -> None:
        async with client(node) as c:
            await c.create_topic("sdk-lost", visibility_timeout_ms=1000)
            await c.produce("sdk-lost", "work")
            cons = c.consume_forever("sdk-lost", handler, concurrency=1, wait=1)
            take = asyncio.ensure_future(_collect(cons, 1, 20)())
            m = await asyncio.wait_for(held.get(), 10)
            # someone else ends the lease (a nack): the next extend answers 410
            await c.nack("sdk-lost", m)
            outs = await take
            assert [o.result for o in outs] == ["lease_lost"] and cancelled == [True]
            # the message is not lost: it is delivered again (the loop stopped after one outcome)
            again = await c.consume("sdk-lost", wait=5)
            assert again is not None and again.payload == b"work"
            await c.ack("sdk-lost", again)

    run(go())


def test_consumer_nacks_a_failure_and_gets_it_again_then_lapse_mode(node: Node) -> None:
    seen: list[str] = []

    async def flaky(m: Any) -> None:
        seen.append(m.receipt_handle)
        if len(seen) == 1:
            raise RuntimeError("first try fails")

    async def go() -> None:
        async with client(node) as c:
            await c.create_topic("sdk-nack", visibility_timeout_ms=30_000)
            await c.produce("sdk-nack", "job")
            outs = await _collect(c.consume_forever("sdk-nack", flaky, wait=1), 2, 15)()
            # redelivered at once (a 30 s lease would otherwise hold it): nack, then ack
            assert [o.result for o in outs] == ["nacked", "acked"]
            assert isinstance(outs[0].error, RuntimeError) and len(set(seen)) == 2

            await c.create_topic("sdk-lapse", visibility_timeout_ms=1000)
            await c.produce("sdk-lapse", "job")
            seen.clear()
            outs = await _collect(c.consume_forever("sdk-lapse", flaky, wait=1, on_failure="lapse"), 2, 15)()
            assert [o.result for o in outs] == ["lapsed", "acked"]  # came back when the lease ran out

    run(go())


def test_consumer_graceful_stop_drains_then_abandons(node: Node) -> None:
    started: list[bytes] = []

    async def handler(m: Any) -> None:
        started.append(m.payload)
        await asyncio.sleep(0.8 if m.payload != b"stuck" else 60)

    async def go() -> None:
        async with client(node) as c:
            await c.create_topic("sdk-stop", visibility_timeout_ms=2000)
            await c.produce_batch("sdk-stop", ["a", "b"])
            cons = c.consume_forever("sdk-stop", handler, concurrency=2, wait=1)
            runner = asyncio.ensure_future(cons._start())
            await asyncio.wait_for(_until(lambda: len(started) == 2), 10)
            cons.request_stop()
            await c.produce("sdk-stop", "late")  # arrives after the stop: never fetched
            await asyncio.wait_for(runner, 10)
            assert cons.counts == {"acked": 2} and sorted(started) == [b"a", b"b"] and cons.in_flight == 0
            late = await c.consume("sdk-stop", wait=5)
            assert late is not None and late.payload == b"late"
            await c.ack("sdk-stop", late)

            # a handler still running at the drain deadline is cancelled and nacked: back at once
            await c.produce("sdk-stop", "stuck")
            cons2 = c.consume_forever("sdk-stop", handler, wait=1)
            runner = asyncio.ensure_future(cons2._start())
            await asyncio.wait_for(_until(lambda: b"stuck" in started), 10)
            await asyncio.wait_for(cons2.stop(drain_timeout=0.3), 10)
            assert cons2.counts == {"abandoned": 1}
            back = await c.consume("sdk-stop", wait=1)  # well within the 2 s lease: it was nacked
            assert back is not None and back.payload == b"stuck"
            await c.ack("sdk-stop", back)

    run(go())


async def _until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.02)


# ---- failover inside a cluster -----------------------------------------------------------------------
def test_failover_to_another_node_of_the_cluster(tmp_path: Path) -> None:
    """Three nodes; the client lists n1 first. With n1 stopped, reads move to the next
    node, and a produce whose connection n1 refused (nothing sent: safe) is sent to
    the next node and stored there: consumed and acked through it."""
    cl = Cluster(tmp_path, 3)
    try:
        cl.start()
        nodes = [f"127.0.0.1:{cl[n].port}" for n in ("n1", "n2", "n3")]

        async def go() -> None:
            async with AsyncClient(nodes, auth=ADMIN, retry=RetryPolicy(deadline=20)) as c:
                await c.create_topic("sdk-fo")
                await c.produce("sdk-fo", "before")
                assert c.current_node == nodes[0]
                d = await c.describe_topic("sdk-fo")
                live = [s.index for s in d.partition_stats if s.owner_node in ("n2", "n3")]
                assert live, d.partition_stats
                cl["n1"].stop()
                d2 = await c.describe_topic("sdk-fo")  # read: n1 refuses, n2 answers
                assert d2.id == d.id and c.current_node == nodes[1]
                assert "sdk-fo" in {t.name async for t in c.iter_topics()}
            # a fresh client, n1 first: its first call is the produce
            async with AsyncClient(nodes, auth=ADMIN, retry=RetryPolicy(deadline=20)) as c2:
                await c2.produce("sdk-fo", "after", partition=live[0])
                assert c2.current_node == nodes[1]
                m = await c2.consume("sdk-fo", wait=8, partition=live[0])
                assert m is not None and m.payload == b"after"
                await c2.ack("sdk-fo", m)

        run(go())
    finally:
        cl.close()


# ---- retry rules, against a scripted server ---------------------------------------------------------
class Scripted:
    """An HTTP/1.1 server that answers each request with the next scripted reply
    (status, headers, body) or None (close the connection without answering); with a
    ``gate``, only once the gate is set (never, if it is not)."""

    def __init__(self, replies: list[tuple[int, dict[str, str], bytes] | None],
                 gate: asyncio.Event | None = None) -> None:
        self.replies = replies
        self.gate = gate
        self.seen: list[tuple[str, str, bytes]] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Scripted:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                hdrs = {k.lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
                body = await r.readexactly(int(hdrs.get("content-length", "0")))
                self.seen.append((method, target, body))
                if self.gate is not None:
                    await self.gate.wait()
                reply = self.replies.pop(0) if self.replies else (500, {}, b'{"error":"script ran out"}')
                if reply is None:
                    w.close()
                    return
                status, h, b = reply
                extra = "".join(f"{k}: {v}\r\n" for k, v in h.items())
                w.write(f"HTTP/1.1 {status} X\r\nContent-Length: {len(b)}\r\n{extra}\r\n".encode() + b)
                await w.drain()
        w.close()


ERR = {"Content-Type": "application/json"}
FAST = RetryPolicy(max_attempts=4, base=0.01, cap=0.05, deadline=5, node_cooldown=0.2)


def test_produce_retries_only_when_narad_says_nothing_was_stored() -> None:
    async def go() -> None:
        # 503 + Retry-After (draining / validation busy: nothing stored): sent again, then 202
        async with Scripted([(503, {"Retry-After": "0", **ERR}, b'{"error":"draining"}'), (202, {}, b"")]) as s:
            async with AsyncClient(f"127.0.0.1:{s.port}", retry=FAST) as c:
                await c.produce("t", "x")
            assert len(s.seen) == 2 and s.seen[0] == s.seen[1]
        # 500, 502, 503 without Retry-After, a dropped connection: uncertain, one attempt only
        for reply, cls in (((500, ERR, b'{"error":"produce failed"}'), InternalServerError),
                           ((502, ERR, b'{"error":"bad gateway"}'), BadGateway),
                           ((503, ERR, b'{"error":"x"}'), Unavailable), (None, ConnectionLost)):
            async with Scripted([reply, (202, {}, b"")]) as s:
                async with AsyncClient(f"127.0.0.1:{s.port}", retry=FAST) as c:
                    with pytest.raises(cls) as ei:
                        await c.produce("t", "x")
                    assert ei.value.uncertain and not ei.value.retryable
                assert len(s.seen) == 1, (reply, s.seen)
        # a metadata write whose 503 says it may have landed is not sent again
        async with Scripted([(503, {"Retry-After": "1", **ERR},
                              b'{"error":"metadata write failed; the write may have landed, read it back"}')]) as s:
            async with AsyncClient(f"127.0.0.1:{s.port}", retry=FAST) as c:
                with pytest.raises(Unavailable) as ei:
                    await c.create_topic("t")
                assert ei.value.uncertain and ei.value.retry_after == 1
            assert len(s.seen) == 1
        # connection refused on the first node (nothing sent): the produce goes to the next
        dead = free_ports(1)[0]
        async with Scripted([(202, {}, b"")]) as s:
            async with AsyncClient([f"127.0.0.1:{dead}", f"127.0.0.1:{s.port}"], retry=FAST) as c:
                await c.produce("t", "x", key="k")
                assert c.current_node == f"127.0.0.1:{s.port}"
            assert [(m, t) for m, t, _ in s.seen] == [("POST", "/v1/topics/t/produce?key=k")]
        async with AsyncClient(f"127.0.0.1:{dead}", retry=FAST) as c:
            with pytest.raises(ConnectError) as ce:
                await c.produce("t", "x")
            assert ce.value.retryable and not ce.value.uncertain

    run(go())


def test_reads_and_batch_acks_retry_what_is_safe() -> None:
    ok_list = (200, ERR, b'{"topics":[],"next_page_token":""}')

    async def go() -> None:
        async with Scripted([(503, ERR, b'{"error":"no leader"}'), (421, ERR, b'{"error":"moved"}'),
                             None, ok_list]) as s:
            async with AsyncClient(f"127.0.0.1:{s.port}", retry=FAST) as c:
                assert (await c.list_topics()).topics == []
            assert len(s.seen) == 4
        # batch ack: only the handles answered 502/503 are sent again
        first = json.dumps({"results": [{"status": 204}, {"status": 503, "error": "owner down"},
                                        {"status": 410, "error": "gone"}, {"status": 502, "error": "x"}]})
        second = json.dumps({"results": [{"status": 204}, {"status": 204}]})
        async with Scripted([(200, ERR, first.encode()), (200, ERR, second.encode())]) as s:
            async with AsyncClient(f"127.0.0.1:{s.port}", retry=FAST) as c:
                res = await c.ack_batch("t", ["0:1:1", "0:2:2", "0:3:3", "0:4:4"])
            assert [r.status for r in res] == [204, 204, 410, 204]
            assert [json.loads(b)["receipt_handles"] for _m, _t, b in s.seen] == [
                ["0:1:1", "0:2:2", "0:3:3", "0:4:4"], ["0:2:2", "0:4:4"]]
        # single ack: 503 retried; 410 never
        async with Scripted([(503, ERR, b'{"error":"owner down"}'), (204, {}, b""),
                             (410, ERR, b'{"error":"gone"}'), (204, {}, b"")]) as s:
            async with AsyncClient(f"127.0.0.1:{s.port}", retry=FAST) as c:
                await c.ack("t", "0:1:1")
                with pytest.raises(LeaseGone):
                    await c.ack("t", "0:1:1")
            assert len(s.seen) == 3
        # the typed error of each status; replay's 410 is OffsetGone
        script = [(410, ERR, b'{"error":"aged out of retention (oldest retained: 9)"}'),
                  (421, ERR, b'{"error":"moved"}')]
        async with Scripted(script) as s, AsyncClient(f"127.0.0.1:{s.port}", retry=RetryPolicy(max_attempts=1)) as c:
            with pytest.raises(OffsetGone):
                await c.replay("t", 0, 1)
            with pytest.raises(Misdirected):
                await c.consume("t")

    run(go())


def test_limits_retry_after_scope_redrive_and_short_answers() -> None:
    """Against the scripted server: a produce over the node's limits is refused before
    anything is sent; a 429's Retry-After holds only its own call (a 503's the node);
    a redrive's 5xx is never sent again (it may have moved some records); a batch ack
    answer short of rows sends the missing handles again."""
    async def go() -> None:
        async with Scripted([(202, {}, b"")] * 3) as s, AsyncClient(f"127.0.0.1:{s.port}", retry=FAST) as c:
            with pytest.raises(PayloadTooLarge) as e1:
                await c.produce("t", b"x" * (9 << 20))
            with pytest.raises(PayloadTooLarge):
                await c.produce_batch("t", [b"x" * 1_000_000] * 20)
            with pytest.raises(BadRequest):
                await c.produce_batch("t", [1] * 1001)
            assert "nothing was sent" in str(e1.value) and s.seen == []
        async with Scripted([(429, {"Retry-After": "30", **ERR}, b'{"error":"too many consumes"}'),
                             (204, {}, b"")]) as s, AsyncClient(f"127.0.0.1:{s.port}", retry=FAST) as c:
            with pytest.raises(TooManyRequests):
                await c.list_topics()
            await c.ack("t", "0:1:1")  # not held by the other call's 429
            assert [m for m, _t, _b in s.seen] == ["GET", "POST"]
        async with Scripted([(503, ERR, b'{"error":"origin topic went away during the redrive; retry"}'),
                             (200, ERR, b'{"redriven":1,"skipped":0}')]) as s, \
                AsyncClient(f"127.0.0.1:{s.port}", retry=FAST) as c:
            with pytest.raises(Unavailable) as e2:
                await c.redrive("dlq")
            assert e2.value.uncertain and len(s.seen) == 1
        async with Scripted([(200, ERR, b'{"results":[{"status":204}]}'),
                             (200, ERR, b'{"results":[{"status":204}]}')]) as s, \
                AsyncClient(f"127.0.0.1:{s.port}", retry=FAST) as c:
            res = await c.ack_batch("t", ["0:1:1", "0:2:2"])
            assert [r.status for r in res] == [204, 204]
            assert [json.loads(b)["receipt_handles"] for _m, _t, b in s.seen] == [["0:1:1", "0:2:2"], ["0:2:2"]]

    run(go())


def test_retry_tier_through_a_delay_child_with_the_sync_loop(node: Node) -> None:
    """docs/sdk.md's retry tier: a failure is republished (attempts + 1) to the tier's
    input, its delay child hands it back after the delay; the blocking Client runs
    the loop with a plain-function handler and is stopped from the handler's thread."""
    with Client(f"127.0.0.1:{node.port}", auth=ADMIN) as sc:
        sc.create_topic("sdk-tier-main")
        sc.create_topic("sdk-tier-in", retention_ms=2 * 3_600_000)
        sc.create_topic("sdk-tier", parent="sdk-tier-in", fanout_delay_ms=300)
        sc.produce("sdk-tier-main", {"job": 1}, envelope=True)
        m = sc.consume("sdk-tier-main", wait=5)
        assert m is not None
        t0 = time.monotonic()
        sc.retry_later(m, ValueError("flaky"), "sdk-tier-in")
        seen: list[Any] = []

        def handler(msg: Any) -> None:  # a plain function: runs on a thread
            seen.append((msg.envelope(), msg.body(), time.monotonic() - t0))
            sc.stop_consumers()

        sc.consume_forever("sdk-tier", handler, concurrency=2, batch=2, wait=1)
        ((env, body, after),) = seen
        assert env.attempts == 2 and env.last_error == "flaky" and body == {"job": 1} and after >= 0.3
        assert sc.consume("sdk-tier", wait=0.5) is None  # the loop acked it before it returned
        for t in ("sdk-tier", "sdk-tier-in", "sdk-tier-main"):
            sc.delete_topic(t)


def test_an_attempt_never_runs_past_the_calls_deadline_and_a_full_pool_is_not_the_nodes_fault() -> None:
    """The request timeout of an attempt is cut to what is left of the call's deadline
    (it could run a second past it). A call that finds every connection of the client's
    own pool busy fails with PoolTimeout (nothing sent: a ConnectError, not uncertain)
    and does not put the node in cooldown: the next call goes to it at once."""
    async def go() -> None:
        ok = (200, ERR, b'{"topics":[],"next_page_token":""}')
        pol = RetryPolicy(max_attempts=1, deadline=0.5)
        async with Scripted([ok], gate=asyncio.Event()) as s, \
                AsyncClient(f"127.0.0.1:{s.port}", timeout=10, retry=pol) as c:
            t0 = time.monotonic()
            with pytest.raises(RequestTimeout):
                await c.list_topics()
            assert time.monotonic() - t0 < 0.5 + 0.45  # (it was 1.5 s: the timeout ran 1 s past)
        gate = asyncio.Event()
        async with Scripted([ok, ok], gate=gate) as s:
            pol = RetryPolicy(max_attempts=1, deadline=5, node_cooldown=60)
            async with AsyncClient(f"127.0.0.1:{s.port}", retry=pol, max_connections=1) as c:
                first = asyncio.ensure_future(c.list_topics())
                end = time.monotonic() + 10
                while not s.seen:  # the first call holds the pool's one connection
                    assert time.monotonic() < end, "the first request never arrived"
                    await asyncio.sleep(0.01)
                with pytest.raises(PoolTimeout) as ei:
                    await c.produce("t", "x", deadline=0.3)
                assert isinstance(ei.value, ConnectError) and not ei.value.uncertain
                gate.set()
                assert (await first).topics == []
                assert (await c.list_topics()).topics == []  # no cooldown (60 s) in the way
            assert [m for m, _t, _b in s.seen] == ["GET", "GET"]

    run(go())


@pytest.mark.parametrize("seconds", [0.0, 0.0004, 0.001, 0.0014, 1.0004, 29.9999996, 43200.0])
def test_sdk_durations_round_up_as_the_node_reads_them(seconds: float) -> None:
    """A delay or lease length the SDK sends is never shorter than asked: it rounds up
    to whole ms, as the node does (it rounded to the nearest: nack(delay=0.0004) sent
    "0ms", no delay at all). Found by a review of issue 14."""
    from narad.api.messages import MAX_DELAY_S, duration_ms
    from narad.client.client import go_duration

    ms = duration_ms(go_duration(seconds), "delay", 0.0, MAX_DELAY_S)
    assert seconds <= ms / 1000 < seconds + 0.001


@pytest.mark.parametrize("seconds", [-0.001, -5.0, float("nan"), float("inf")])
def test_sdk_refuses_a_negative_or_non_finite_duration(seconds: float) -> None:
    from narad.client.client import go_duration

    with pytest.raises(ValueError, match="duration"):
        go_duration(seconds)


def test_the_sync_client_has_every_method_and_parameter_of_the_async_one(node: Node) -> None:
    """docs/sdk.md: ``Client`` has the same methods, blocking. Checked against the async
    client's signatures (``ack_batch(deadline=)``, ``replay(deadline=)``, ``ready`` and
    ``visibility_timeout`` were missing; found by a review of issue 14), then used."""
    import inspect

    from narad.client import Client

    missing = []
    for name, fn in inspect.getmembers(AsyncClient, inspect.iscoroutinefunction):
        if name.startswith("_"):
            continue
        sync = getattr(Client, name, None)
        if sync is None:
            missing.append(name)
            continue
        params = inspect.signature(sync).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue  # (passes every keyword on)
        missing += [f"{name}({p})" for p in inspect.signature(fn).parameters if p not in params]
    assert not missing, missing
    with Client(f"127.0.0.1:{node.port}", auth=ADMIN) as sc:
        assert sc.ready() is True
        sc.create_topic("sync-parity", partitions=3, visibility_timeout_ms=45_000)
        assert sc.visibility_timeout("sync-parity") == 45.0
        sc.produce("sync-parity", {"x": 1}, partition=0)
        m = wait_for(lambda: sc.consume("sync-parity"), 10, 0.05, "the message")
        assert [r.status for r in sc.ack_batch("sync-parity", [m], deadline=10)] == [204]
        assert sc.replay("sync-parity", 0, 0, deadline=10) is not None


def test_a_produce_whose_202_body_is_not_json_returns_normally() -> None:
    """A 2xx whose body is not JSON (a proxy's, say): the message is stored, so produce
    returns a plain result, as produce_batch does (it raised msgspec's DecodeError, not
    a NaradError). Found by a review of issue 14."""
    async def go() -> None:
        async with Scripted([(202, {}, b"accepted"), (202, {}, b"[1]")]) as s:
            async with AsyncClient(f"127.0.0.1:{s.port}", retry=FAST) as c:
                for _ in range(2):
                    res = await c.produce("t", "x")
                    assert (res.duplicate, res.pending) == (None, False)
            assert len(s.seen) == 2

    run(go())
