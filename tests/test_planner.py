"""The move planner (narad.meta.planner), table-driven: floor/ceil spread with the
ceil slots kept by the members holding most, only the surplus moving, a draining
member shedding everything, dead owners' partitions never moving, in-flight moves
counted at their destination (idempotent), at most 8 in flight, convergence, a
deterministic answer; and which dead targets are cleared."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from narad.meta.commands import MoveTargetRow
from narad.meta.planner import DEAD_TARGET_AFTER_MS, MAX_IN_FLIGHT, Row, dead_target_rows, member_status, plan
from narad.meta.records import AssignmentRecord, MemberRecord

TID = "00000000000000aa"


def members(*spec: str) -> list[MemberRecord]:
    """'n1' alive, 'n2:dead', 'n3:draining', 'n4:dead:draining'."""
    out = []
    for s in spec:
        nid, *flags = s.split(":")
        out.append(MemberRecord(nid, f"127.0.0.1:{nid[1:]}", status="dead" if "dead" in flags else "alive",
                                draining="draining" in flags))
    return out


def rows(owners: list[str], topic: str = "t") -> list[Row]:
    return [(topic, p, AssignmentRecord(o, TID)) for p, o in enumerate(owners)]


def spread(n1: int, n2: int, n3: int) -> list[str]:
    return ["n1"] * n1 + ["n2"] * n2 + ["n3"] * n3


def load(rs: list[Row]) -> Counter[str]:
    """Where each partition is, or is going."""
    return Counter(a.target or a.owner for _, _, a in rs)


def apply_targets(rs: list[Row], targets: list[MoveTargetRow]) -> list[Row]:
    by_key = {(t, p): a for t, p, a in rs}
    for mv in targets:
        a = by_key[(mv.topic, mv.partition)]
        assert a.owner == mv.owner and a.target == mv.expect_target is None
        assert mv.target is not None and mv.target != a.owner
        a.target = mv.target
    return rs


def flip_all(rs: list[Row]) -> list[Row]:
    for _, _, a in rs:
        if a.target is not None:
            a.owner, a.target = a.target, None
    return rs


@pytest.mark.parametrize(("owners", "ms", "want"), [
    # 3 -> 5 members, 12 partitions: 12/5 = 2.4: two members keep 3 (the ones holding most, lower id
    # first on a tie), the rest get 2; only the surplus moves, the new members receive.
    (spread(4, 4, 4), ("n1", "n2", "n3", "n4", "n5"), {"n1": 3, "n2": 3, "n3": 2, "n4": 2, "n5": 2}),
    # Uneven start: the one holding most keeps a ceil slot, the one holding least gives nothing.
    (spread(6, 3, 1), ("n1", "n2", "n3", "n4"), {"n1": 3, "n2": 3, "n3": 2, "n4": 2}),
    # Already balanced: nothing moves.
    (spread(3, 3, 2), ("n1", "n2", "n3"), {"n1": 3, "n2": 3, "n3": 2}),
    # A draining member sheds everything, to the others.
    (spread(2, 2, 2), ("n1", "n2", "n3:draining"), {"n1": 3, "n2": 3}),
    # A dead owner's partitions stay (not counted, never moved); the rest spread over the receivers.
    (spread(4, 0, 4), ("n1", "n2", "n3:dead"), {"n1": 2, "n2": 2, "n3": 4}),
    # A dead, draining owner: its partitions cannot move either.
    (spread(0, 2, 3), ("n1", "n2", "n3:dead:draining"), {"n1": 1, "n2": 1, "n3": 3}),
])
def test_one_plan_spreads_floor_ceil_and_moves_only_the_surplus(owners: list[str], ms: tuple[str, ...],
                                                                 want: dict[str, int]) -> None:
    rs = rows(owners)
    before = Counter(owners)
    targets = plan(rs, members(*ms))
    assert len(targets) <= MAX_IN_FLIGHT
    after = load(apply_targets(rs, targets))
    assert {k: v for k, v in after.items() if v} == want
    # Only the surplus moved: each source gave exactly what it had above its final share.
    gave = Counter(mv.owner for mv in targets)
    for node, n in before.items():
        assert gave[node] == max(0, n - want.get(node, 0)), node
    # Never onto a draining or dead member, never from a dead one.
    bad = {m.id for m in members(*ms) if m.draining or m.status != "alive"}
    assert not any(mv.target in bad for mv in targets)
    dead = {m.id for m in members(*ms) if m.status != "alive"}
    assert not any(mv.owner in dead for mv in targets)


def test_in_flight_moves_count_at_their_destination_so_planning_again_adds_nothing() -> None:
    ms = members("n1", "n2", "n3", "n4", "n5")
    rs = rows(spread(4, 4, 4))
    first = plan(rs, ms)
    assert first
    apply_targets(rs, first)
    assert plan(rs, ms) == []  # idempotent while the moves are in flight
    flip_all(rs)
    assert plan(rs, ms) == []  # and after they completed


def test_at_most_eight_moves_in_flight_and_it_converges() -> None:
    ms = members(*(f"n{i}" for i in range(1, 7)))
    rs = rows(spread(20, 20, 20))  # 60 partitions on 3 of 6 members: 30 must move
    rounds = 0
    while True:
        targets = plan(rs, ms)
        in_flight = sum(1 for _, _, a in rs if a.target is not None)
        assert in_flight + len(targets) <= MAX_IN_FLIGHT
        if not targets and not in_flight:
            break
        apply_targets(rs, targets)
        # Only some moves finish before the next pass: the budget is topped up, never exceeded.
        done = [a for _, _, a in rs if a.target is not None][:3]
        for a in done:
            a.owner, a.target = a.target, None
        rounds += 1
        assert rounds < 100, "did not converge"
    assert sorted(load(rs).values()) == [10] * 6


def test_top_up_counts_moves_already_in_flight() -> None:
    ms = members("n1", "n2", "n3", "n4")
    rs = rows(["n1"] * 40)
    for _, _, a in rs[:3]:
        a.target = "n2"
    targets = plan(rs, ms)
    assert len(targets) == MAX_IN_FLIGHT - 3
    assert plan(rs, ms, max_in_flight=3) == []


def test_the_answer_does_not_depend_on_input_order() -> None:
    ms = members("n1", "n2", "n3", "n4", "n5")
    rs = rows(spread(5, 4, 3), "a") + rows(spread(2, 6, 1), "b")
    want = plan(rs, ms)
    for seed in range(5):
        shuffled = rs[:]
        random.Random(seed).shuffle(shuffled)
        assert plan(shuffled, list(reversed(ms))) == want
    assert want == sorted(want, key=lambda r: (r.topic, r.partition))


def test_no_receivers_no_moves() -> None:
    assert plan(rows(spread(2, 2, 0)), members("n1:draining", "n2:dead")) == []
    assert plan([], members("n1")) == []


def test_dead_targets_are_cleared_after_two_minutes_gone_or_out_of_raft() -> None:
    now = 10_000_000
    ms = members("n1", "n2", "n3:dead", "n4:dead", "n5:draining", "n6:draining")
    for m in ms:
        m.heartbeat_ms = now - 1000
    ms[2].heartbeat_ms = now - DEAD_TARGET_AFTER_MS - 1  # n3 dead for more than 2 min
    servers = {m.raft_addr for m in ms if m.id != "n6"}  # n6 left the Raft configuration
    rs = rows(["n1"] * 7)
    for (_, _, a), target in zip(rs, ["n2", "n3", "n4", "n5", "n6", "ghost", None], strict=True):
        a.target = target
    out = dead_target_rows(rs, ms, now_ms=now, raft_servers=servers)
    # n2 alive, n4 dead but only briefly, n5 draining but still in Raft: their moves stay.
    assert [(r.partition, r.expect_target, r.target) for r in out] == [(1, "n3", None), (4, "n6", None),
                                                                       (5, "ghost", None)]
    assert all(r.owner == "n1" for r in out)


def test_member_status_names() -> None:
    by_id = {m.id: m for m in members("n1", "n2:dead", "n3:draining", "n4:dead:draining")}
    assert [member_status(by_id, i) for i in ("n1", "n2", "n3", "n4", "x")] == [
        "alive", "dead", "draining", "dead", "not_a_member"]
