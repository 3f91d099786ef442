"""The delivery-contract checker (tests/contract.py) must fail on a broker that breaks
each rule: synthetic histories that break one rule each (and clean ones that must
pass), then real traffic against a real node through a deliberately misbehaving
broker facade (it loses a produce, replays an acked message, leases one copy twice,
hides a redelivery, refuses a message's acks) where the checker must name the rule,
and a clean run through the same facade that must pass strict."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.contract import NS, Delivery, Fault, History, Settle, Traffic, broker_empty, check, now
from tests.harness import Node, Response


def at(t: float) -> int:
    return int(t * NS)


class Synth:
    """A hand-written history; times in seconds from 0, visibility 1 s."""

    def __init__(self, vis: float = 1.0) -> None:
        self.h = History(vis)
        self.h.start_ns = 0
        self.nonces = iter(range(1, 10**6))

    def produce(self, mid: str, t: float = 0.0, status: int | None = 202) -> None:
        self.h.produced([mid], at(t), at(t + 0.001), status)

    def deliver(self, mid: str, t: float, p: int = 0, o: int = 0, dur: float = 0.01) -> Delivery:
        d = Delivery(mid, p, o, f"n{next(self.nonces)}", at(t), at(t + dur))
        self.h.delivered(d)
        return d

    def settle(self, d: Delivery, t: float, kind: str = "ack", status: int | None = 204, dur: float = 0.01) -> None:
        self.h.settled(Settle(d.handle, kind, at(t), at(t + dur), status), d.mid)

    def end(self, t: float) -> History:
        self.h.end_ns = at(t)
        return self.h


def test_clean_history_passes_strict_with_an_expired_lease_redelivered() -> None:
    s = Synth()
    s.produce("a")
    s.produce("b")
    s.produce("c", status=None)  # ambiguous and never delivered: not a loss
    s.settle(s.deliver("a", 0.1), 0.2)
    s.deliver("b", 0.1, o=1)  # its consumer died: the lease runs out at ~1.1 s
    s.settle(s.deliver("b", 1.5, o=1), 1.6)
    s.produce("e")
    e = s.deliver("e", 0.3, o=2)
    s.settle(e, 0.5, "extend")  # the lease now runs to ~1.5 s
    s.settle(e, 1.2, "ack")
    s.produce("f")
    f = s.deliver("f", 0.3, o=3)
    s.settle(f, 0.4, "nack")
    s.settle(s.deliver("f", 0.45, o=3), 0.5)  # a nack releases at once
    v = check(s.end(3.0), "strict")
    print(v.summary("clean"))
    assert v.ok, v.summary()
    assert v.counts["accepted"] == 4 and v.counts["ambiguous"] == 1 and v.counts["duplicates"] == 2
    assert v.counts["explained_redeliveries"] == 2 and v.counts["acked_ids"] == 4


def test_lost_and_phantom() -> None:
    s = Synth()
    s.produce("a")  # 202, never delivered
    s.produce("r", status=429)  # refused, then delivered anyway
    s.settle(s.deliver("r", 0.2), 0.3)
    s.settle(s.deliver("x", 0.2, o=1), 0.3)  # never produced
    v = check(s.end(2.0), "faults")
    assert v.failed_rules() == {"lost", "phantom"}, v.summary()
    assert len(v.violations["lost"]) == 1 and len(v.violations["phantom"]) == 2
    assert "VIOLATION" in v.summary() and "lost" in v.summary()


def test_dup_after_ack_strict_and_outside_fault_windows() -> None:
    def history() -> Synth:
        s = Synth()
        s.produce("a")
        s.settle(s.deliver("a", 0.1), 0.2)  # ack returned 204 at 0.21 s
        s.settle(s.deliver("a", 5.0), 5.1)  # delivered again long after
        return s

    v = check(history().end(6), "strict")
    assert "dup_after_ack" in v.failed_rules(), v.summary()
    # faults mode: allowed only inside a declared window + grace
    s = history()
    s.h.faults.append(Fault("kill", at(4.0), at(4.5)))
    v = check(s.end(6), "faults", grace_s=1.0)
    assert v.ok and v.allowed["dup_after_ack"] == 1, v.summary()
    s = history()
    s.h.faults.append(Fault("kill", at(1.0), at(1.5)))
    v = check(s.end(6), "faults", grace_s=1.0)  # the window ended at 2.5 s: outside
    assert v.failed_rules() == {"dup_after_ack"}, v.summary()
    # by message id as well: a second stored copy delivered after the first was acked
    s = Synth()
    s.produce("a")
    s.settle(s.deliver("a", 0.1), 0.2)
    s.settle(s.deliver("a", 3.0, p=2, o=7), 3.1)
    assert "dup_after_ack" in check(s.end(4), "faults").failed_rules()


def test_a_redelivery_overlapping_the_ack_proves_nothing() -> None:
    s = Synth()
    s.produce("a")
    d1 = s.deliver("a", 0.1)
    s.settle(d1, 1.05, dur=0.2)  # the ack is sent before the lease runs out, returns late
    s.settle(s.deliver("a", 1.2), 1.3)  # started before the ack returned
    v = check(s.end(3), "faults")
    assert "dup_after_ack" not in v.failed_rules(), v.summary()


def test_double_lease() -> None:
    s = Synth()
    s.produce("a")
    s.settle(s.deliver("a", 0.0), 0.5, status=204)
    s.settle(s.deliver("a", 0.3), 0.4)  # same offset, new nonce, first lease live until >= 1.0 s
    v = check(s.end(3), "strict")
    assert "double_lease" in v.failed_rules(), v.summary()
    # an extend keeps the lease: a second lease inside the extended term is a double lease
    s = Synth()
    s.produce("a")
    d1 = s.deliver("a", 0.0)
    s.settle(d1, 0.9, "extend")
    s.settle(s.deliver("a", 1.5), 1.6)
    assert "double_lease" in check(s.end(3), "strict").failed_rules()
    # without the extend the lease ran out at ~1.0 s: fine
    s = Synth()
    s.produce("a")
    s.deliver("a", 0.0)
    s.settle(s.deliver("a", 1.5), 1.6)
    v = check(s.end(3), "strict")
    assert v.ok, v.summary()
    # a nack released it at once: fine
    s = Synth()
    s.produce("a")
    d1 = s.deliver("a", 0.0)
    s.settle(d1, 0.1, "nack")
    s.settle(s.deliver("a", 0.2), 0.3)
    assert check(s.end(3), "strict").ok
    # the first handle still honoured (204) after the second lease was handed out
    s = Synth()
    s.produce("a")
    d1 = s.deliver("a", 0.0)
    s.deliver("a", 1.5)
    s.settle(d1, 1.7)
    assert "double_lease" in check(s.end(3), "faults").failed_rules()
    # two concurrent consume calls both answered with one offset
    s = Synth()
    s.produce("a")
    s.settle(s.deliver("a", 0.0, dur=0.2), 0.3)
    s.settle(s.deliver("a", 0.1, dur=0.05), 0.3)
    assert "double_lease" in check(s.end(3), "strict").failed_rules()


def test_expired_or_nacked_lease_must_be_delivered_again() -> None:
    s = Synth()
    s.produce("a")
    s.deliver("a", 0.0)  # never acked, never seen again
    v = check(s.end(5), "faults")
    assert "not_redelivered" in v.failed_rules() and "undrained" in v.failed_rules(), v.summary()
    # still leased when the history ends: not yet due
    s = Synth()
    s.produce("a")
    s.deliver("a", 0.0)
    assert "not_redelivered" not in check(s.end(0.5), "faults").failed_rules()
    # nacked (or acked too late, 410) and never delivered again
    for kind, status in (("nack", 204), ("ack", 410)):
        s = Synth()
        s.produce("a")
        s.settle(s.deliver("a", 0.0), 1.5 if status == 410 else 0.1, kind, status)
        assert "not_redelivered" in check(s.end(5), "faults").failed_rules(), kind


def test_a_delayed_nack_delivered_again_early_is_a_violation() -> None:
    """A nack with a 5 s delay: the copy delivered again 1 s later is ``delayed_early``
    (strict and faults, outside fault windows); after the delay, or inside a declared
    fault window (an owner restart forgets delays), it is not."""
    def run(again_at: float, fault: bool = False) -> History:
        s = Synth(vis=30.0)
        s.produce("a")
        d = s.deliver("a", 0.1)
        s.h.settled(Settle(d.handle, "nack", at(0.2), at(0.21), 204, delay_ns=at(5.0)), "a")
        if fault:
            s.h.faults.append(Fault("kill -9 owner", at(0.5), at(0.8)))
        s.settle(s.deliver("a", again_at), again_at + 0.1)
        return s.end(again_at + 1)

    for mode in ("strict", "faults"):
        v = check(run(1.2), mode)
        assert v.failed_rules() == {"delayed_early"}, v.summary()
        assert "delay of its nack" in v.violations["delayed_early"][0]
        assert check(run(5.3), mode).ok, check(run(5.3), mode).summary()
    v = check(run(1.2, fault=True), "faults")
    assert v.ok and v.allowed["delayed_early"] == 1, v.summary()
    # a delayed nack never followed by a delivery is not due before its delay ran out
    s = Synth(vis=30.0)
    s.produce("a")
    d = s.deliver("a", 0.1)
    s.h.settled(Settle(d.handle, "nack", at(0.2), at(0.21), 204, delay_ns=at(5.0)), "a")
    assert "not_redelivered" not in check(s.end(3.0), "faults").failed_rules()
    assert "not_redelivered" in check(s.end(6.0), "faults").failed_rules()


def test_a_per_delivery_visibility_bounds_its_lease() -> None:
    """A consume with its own lease length (vis_ns): redelivered after 1 s though the
    history's visibility is 30 s is explained; before it, a double lease."""
    s = Synth(vis=30.0)
    s.produce("a")
    d = Delivery("a", 0, 0, "x9", at(0.1), at(0.11), vis_ns=at(1.0))
    s.h.delivered(d)
    s.settle(s.deliver("a", 1.5), 1.6)
    assert check(s.end(2), "strict").ok, check(s.end(2), "strict").summary()
    s = Synth(vis=30.0)
    s.produce("a")
    s.h.delivered(Delivery("a", 0, 0, "x9", at(0.1), at(0.11), vis_ns=at(5.0)))
    s.settle(s.deliver("a", 1.5), 1.6)
    assert "double_lease" in check(s.end(2), "strict").failed_rules()


def test_undrained_and_acks_in_doubt() -> None:
    s = Synth()
    s.produce("a")
    s.settle(s.deliver("a", 0.0), 0.1, status=None)  # the ack's answer was lost
    v = check(s.end(0.5), "faults")
    assert v.failed_rules() == {"undrained"}, v.summary()
    # ...counts as drained once the broker reported nothing left
    assert check(s.end(0.5), "faults", broker_empty=True).ok
    # every delivered copy must be acked: a second copy left unacked
    s = Synth()
    s.produce("a")
    s.settle(s.deliver("a", 0.0), 0.1)
    s.deliver("a", 0.05, p=1, o=4)
    assert "undrained" in check(s.end(0.5), "faults").failed_rules()


def test_strict_counts_a_second_copy_and_an_unexplained_redelivery() -> None:
    s = Synth()
    s.produce("a")
    s.settle(s.deliver("a", 0.0), 0.1)
    s.settle(s.deliver("a", 0.05, p=1, o=4), 0.1)
    assert "dup" in check(s.end(1), "strict").failed_rules()
    assert check(s.end(1), "faults").ok  # with faults: a duplicate, counted, no violation
    s = Synth()
    s.produce("a")
    d = s.deliver("a", 0.0)
    s.h.delivered(d)  # one lease answered twice
    s.settle(d, 0.1)
    assert "dup" in check(s.end(1), "strict").failed_rules()


# ---- a real node behind a misbehaving broker facade -----------------------------------

AFTER_ACK_NS = 20_000_000


class FaultyBroker:
    """A real node with a broker fault in front of it: the recorder talks to this as
    it would to a node, and the fault is in what it answers."""

    def __init__(self, node: Node, fault: str) -> None:
        self.node, self.fault, self.node_id = node, fault, node.node_id
        self.lock = threading.Lock()
        self.produces = 0
        # dup_after_ack: (when the ack returned, message) of messages whose ack this facade saw
        # answered 204; handed out again only to a consume that starts AFTER_ACK_NS later, so the
        # recorder (which notes the ack's return just after, the consume's call just before) sees
        # the consume begin after the 204
        self.acked: list[tuple[int, dict[str, Any]]] = []
        self.leased: dict[str, dict[str, Any]] = {}  # dup_after_ack: handle -> message, until its ack
        self.seen: set[tuple[int, int]] = set()
        self.aliases: dict[str, str] = {}  # fabricated handle -> real handle
        self.victims: set[tuple[int, int]] = set()

    def conn(self) -> Any:
        return self.node.conn()

    def get(self, path: str, **kw: Any) -> Response:
        return self.node.get(path, **kw)

    def request(self, method: str, path: str, body: Any = None, **kw: Any) -> Response:
        f = self.fault
        if "/produce" in path:
            with self.lock:
                self.produces += 1
                lose = f == "lose" and self.produces % 25 == 0
            if lose:  # answer 202 and store nothing
                return Response(202, {}, b'{"partition":0,"offset":0}')
        if "/ack" in path and body is not None:
            handles = json.loads(body)["receipt_handles"]
            with self.lock:
                real = [self.aliases.get(x, x) for x in handles]
            refused = [f == "undrained" and tuple(map(int, x.split(":")[:2])) in self.victims for x in real]
            if not any(refused):
                r = self.node.request(method, path, json.dumps({"receipt_handles": real}).encode(), **kw)
                if f == "dup_after_ack" and r.status == 200:
                    with self.lock:
                        for h, res in zip(real, r.json()["results"], strict=True):
                            m = self.leased.pop(h, None)
                            if m is not None and res.get("status") == 204 and len(self.acked) < 3:
                                self.acked.append((now(), m))
                return r
            # the victim's acks are refused (410) and never reach the node
            ok = [x for x, bad in zip(real, refused, strict=True) if not bad]
            res: list[dict[str, Any]] = []
            if ok:
                r = self.node.request(method, path, json.dumps({"receipt_handles": ok}).encode(), **kw)
                res = r.json()["results"]
            it = iter(res)
            out = [{"status": 410, "error": "gone"} if bad else next(it) for bad in refused]
            return Response(200, {}, json.dumps({"results": out}).encode())
        t_call = now()
        r = self.node.request(method, path, body, **kw)
        if "/consume" in path and r.status == 200:
            msgs = r.json()["messages"]
            with self.lock:
                out = self._mutate(msgs, t_call)
            if not out:
                return Response(204, {}, b"")
            r = Response(200, r.headers, json.dumps({"messages": out}).encode())
        return r

    def _mutate(self, msgs: list[dict[str, Any]], t_call: int) -> list[dict[str, Any]]:
        f = self.fault
        out = []
        for m in msgs:
            copy = (m["partition"], m["offset"])
            if f == "no_redelivery" and copy in self.seen:
                continue  # a redelivery after the lease ran out: hidden from every consumer
            if f == "undrained" and not self.victims and int(m["offset"]) % 2 == 0:
                self.victims.add(copy)
            self.seen.add(copy)
            out.append(m)
        if f == "dup_after_ack" and self.acked and self.acked[0][0] + AFTER_ACK_NS < t_call:
            out.append(self.acked.pop(0)[1])  # an already acked message handed out again
        if f == "double_lease" and msgs and len(self.aliases) < 5:
            m = dict(msgs[0])
            fake = m["receipt_handle"] + "7"
            self.aliases[fake] = m["receipt_handle"]
            m["receipt_handle"] = fake
            out.append(m)  # the same offset leased again under another nonce, at once
        if f == "dup_after_ack" and msgs and len(self.leased) < 100:
            self.leased[msgs[0]["receipt_handle"]] = msgs[0]
        return out


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("contract") / "data", workers=2).start()
    yield n
    n.close()


def run(node: Node, fault: str, n: int = 60, abandon: int = 0) -> Any:
    topic = f"contract-{fault}"
    assert node.post("/v1/topics", {"name": topic, "partitions": 3, "visibility_timeout_ms": 1000}).status == 201
    fb = FaultyBroker(node, fault)
    h = History(1.0)
    tr = Traffic(h, topic, lambda: [fb], producers=2, consumers=2, pace_s=0.005, abandon_every=abandon,
                 max_n=5).start()
    try:
        tr.wait_more(n, 60)
    finally:
        empty = tr.drain(broker_empty(node, topic, 3), timeout=30 if fault == "none" else 4)
    return check(h, "strict", broker_empty=empty)


@pytest.mark.parametrize(("fault", "rule"), [
    ("lose", "lost"),
    ("dup_after_ack", "dup_after_ack"),
    ("double_lease", "double_lease"),
    ("no_redelivery", "not_redelivered"),
    ("undrained", "undrained"),
])
def test_checker_fails_on_a_broker_that_breaks_the_rule(node: Node, fault: str, rule: str) -> None:
    v = run(node, fault, abandon=5 if fault == "no_redelivery" else 0)
    print("\n" + v.summary(f"faulty broker ({fault})"))
    assert rule in v.failed_rules(), v.summary()


def test_checker_passes_a_real_node_strict_with_abandoned_leases(node: Node) -> None:
    v = run(node, "none", abandon=9)
    print("\n" + v.summary("real node, no fault"))
    assert v.ok, v.summary()
    assert v.counts["explained_redeliveries"] > 0 and v.counts["accepted"] >= 60



def test_strict_accepts_a_long_poll_served_after_a_later_call_nacked() -> None:
    # A long poll parked since 0.0 s; a second consumer's call (0.1 s) is served first and
    # nacks; the parked poll then gets the same offset: ordered by call start the nack
    # belongs to the later call.
    s = Synth()
    s.produce("a")
    first = s.deliver("a", 0.0, dur=0.3)
    second = s.deliver("a", 0.1, dur=0.01)
    s.settle(second, 0.12, "nack")
    s.settle(first, 0.35, "nack")  # nacked as well, then a third delivery is acked
    s.settle(s.deliver("a", 0.4), 0.5)
    v = check(s.end(3), "strict")
    assert v.ok, v.summary()


def test_delivery_counts_must_rise_per_copy() -> None:
    """Issue 14's rule: a later lease of a copy carries a higher delivery_count; one that
    does not fails strict, and is allowed (counted) inside a fault window; deliveries
    recorded without a count are left out."""
    def hist(counts: list[int], fault: bool = False) -> History:
        s = Synth()
        s.produce("a")
        for i, c in enumerate(counts):
            d = Delivery("a", 0, 0, f"c{i}", at(0.1 + 1.2 * i), at(0.11 + 1.2 * i), count=c)
            s.h.delivered(d)
            if i == len(counts) - 1:
                s.settle(d, 0.2 + 1.2 * i)
        if fault:
            s.h.faults.append(Fault("kill -9", at(1.0), at(1.2)))
        return s.end(1.2 * len(counts) + 1)

    assert check(hist([1, 2, 3]), "strict").ok
    assert check(hist([1, 0, 3]), "strict").ok  # an unknown count is no evidence
    v = check(hist([1, 2, 2]), "strict")
    assert v.failed_rules() == {"count_not_rising"}, v.summary()
    v = check(hist([1, 1], fault=True), "faults")
    assert v.ok and v.allowed["count_not_rising"] == 1, v.summary()


def test_a_dead_lettered_copy_is_settled_and_never_live_again() -> None:
    from tests.contract import DeadCopy

    s = Synth()
    s.produce("a")
    s.produce("b")
    a1 = s.deliver("a", 0.1)
    s.settle(a1, 0.2, "nack")
    s.deliver("a", 0.3)  # its second lease runs out; max_deliveries 2: dead-lettered
    s.h.dead_lettered(DeadCopy("a", 0, 0, at(1.5), at(1.51)))
    s.settle(s.deliver("b", 0.1, o=1), 0.2)
    v = check(s.end(3.0))
    assert v.ok, v.summary()  # no undrained, no not_redelivered for "a": the broker settled it
    assert v.counts["dead_lettered"] == 1
    # The same copy delivered from the source after its dead-letter copy was consumed: a violation,
    # in faults mode too (no fault window excuses it).
    s.h.end_ns = None
    s.deliver("a", 2.0)
    s.h.faults.append(Fault("kill", at(1.0), at(2.5)))
    for mode in ("strict", "faults"):
        v = check(s.end(4.0), mode)
        assert v.failed_rules() == {"dead_then_live"} or "dead_then_live" in v.failed_rules(), v.summary()
        assert "0:0 (a) delivered from its source" in v.violations["dead_then_live"][0]
