"""Delivery counts and dead-letter holds of one partition (issue 14), driven
directly on real files: the count a lease carries, what ack / nack / expiry do
to it, the counts tail of the offset slot (old slots decode as no counts, the
4 KiB bound keeps the highest counts), the nack-reasons tail after it, the
held-marks tail after that, restore after a crash (page cache) and a close, and
the hold of a record whose deliveries are used up (held again after a crash
whatever the maximum has become)."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from narad.broker import deadletter as DL
from narad.broker.partition import Partition
from narad.meta.records import TopicRecord
from narad.storage import frames as FR
from narad.storage import offsets as OFF
from narad.storage.offsets import SLOT, OffsetFile, _decode, _decode_all, _decode_every, _decode_full, _encode
from narad.storage.partition_log import PartitionLog


def _partition(tmp: Path, n: int) -> Partition:
    plog = PartitionLog(tmp)
    plog.open()
    offs = OffsetFile(tmp)
    p = Partition("t", "00" * 8, 0, plog, offs)
    p.restore(*offs.load(), offs.counts, offs.reasons, offs.held)
    if n:
        with ThreadPoolExecutor(1) as ex:
            async def fill() -> None:
                p.loop = asyncio.get_running_loop()
                for i in range(n):
                    await p.commit([(None, 0, f"m{i}".encode())], ex)

            asyncio.run(fill())
    return p


def _reopen(tmp: Path) -> Partition:
    return _partition(tmp, 0)


def test_counts_rise_per_lease_and_go_at_ack(tmp_path: Path) -> None:
    p = _partition(tmp_path, 3)
    d = p.reserve(100.0, 3, 30.0, 1024, 1024)
    assert [x.deliveries for x in d] == [1, 1, 1]
    assert p.nack(0, d[0].nonce, 101.0, reason="bad")
    again = p.reserve(101.0, 1, 30.0, 1024, 1024)
    assert (again[0].offset, again[0].deliveries) == (0, 2)
    assert p.reasons == {0: "bad"}
    late = p.reserve(140.0, 5, 30.0, 1024, 1024)  # every lease expired: all out again
    assert sorted((x.offset, x.deliveries) for x in late) == [(0, 3), (1, 2), (2, 2)]
    for x in late:
        assert p.ack(x.offset, x.nonce, 141.0)
    assert p.deliveries == {} and p.reasons == {}
    assert p.committed == 2


def test_with_counting_off_leases_are_not_counted_unless_the_topic_dead_letters(tmp_path: Path) -> None:
    """The node's ``topic.delivery_counts`` off: a lease carries 0 (no delivery_count in
    the answer), nothing is kept or persisted for it; a topic with max_deliveries counts
    anyway (its counts decide the dead-lettering)."""
    p = _partition(tmp_path, 3)
    p.counting = False
    gen = p.count_gen
    d = p.reserve(100.0, 3, 30.0, 1024, 1024)
    assert [x.deliveries for x in d] == [0, 0, 0]
    assert p.deliveries == {} and p.count_gen == gen
    assert p.nack(0, d[0].nonce, 101.0)
    assert [x.deliveries for x in p.reserve(101.0, 1, 30.0, 1024, 1024)] == [0]
    p.max_deliveries = 2
    again = p.reserve(140.0, 5, 30.0, 1024, 1024)  # every lease expired: all out again, counted now
    assert sorted((x.offset, x.deliveries) for x in again) == [(0, 1), (1, 1), (2, 1)]
    assert p.deliveries == {0: 1, 1: 1, 2: 1} and p.count_gen > gen


def test_a_give_back_takes_its_count_back(tmp_path: Path) -> None:
    """A lease whose consumer never saw it (hung up, answer dropped) is given back
    uncounted: the next delivery carries the same count, and max_deliveries=1 does not
    dead-letter a record nobody saw."""
    p = _partition(tmp_path, 1)
    p.max_deliveries = 1
    d = p.reserve(100.0, 1, 30.0, 1024, 1024)
    assert d[0].deliveries == 1
    assert p.nack(0, d[0].nonce, 100.1, uncount=True)
    assert not p.dead and 0 not in p.deliveries
    d = p.reserve(100.2, 1, 30.0, 1024, 1024)
    assert d[0].deliveries == 1
    assert p.nack(0, d[0].nonce, 100.3)  # a real nack: spent
    assert set(p.dead) == {0}


def test_slot_tail_round_trip_and_old_slots(tmp_path: Path) -> None:
    raw = _encode(5, 10, [12, 15], {11: 3, 13: 1, 20: 7})
    assert _decode_full(raw) == (5, 10, [12, 15], {11: 3, 13: 1, 20: 7})
    assert _decode(raw) == (5, 10, [12, 15])  # a reader without the tail ignores it
    old = _encode(5, 10, [12, 15])  # written before the tail existed
    assert _decode_full(old) == (5, 10, [12, 15], {})
    assert len(_encode(1, 0, [], {i: 2 for i in range(1, 5000)})) == SLOT


def test_a_full_slot_keeps_held_records_counts_first_and_says_what_it_left_out() -> None:
    """More counts than the slot has room for: the held records' (``first``) go in before
    any higher count, and the ones left out are reported (the dead-letter driver does not
    move a record whose count a kill -9 would lose)."""
    counts = {i: 2 for i in range(1, 5000)}
    counts[10] = 9  # a higher count, not held
    held = {4990, 4995}
    dropped: set[int] = set()
    got = _decode_full(_encode(1, 0, [], counts, None, dropped, held))[3]
    assert held <= got.keys() and 10 in got and got[4990] == 2
    assert dropped and dropped.isdisjoint(got) and dropped | got.keys() == counts.keys()
    plain: set[int] = set()
    got = _decode_full(_encode(1, 0, [], counts, None, plain))[3]
    assert held <= plain and held.isdisjoint(got)  # without them first: left out (the highest offsets)
    none: set[int] = set()
    _encode(1, 0, [3], {1: 2, 2: 5}, None, none, held)
    assert none == set()  # everything fits: nothing left out


def test_a_close_with_a_full_slot_keeps_held_records_counts(tmp_path: Path) -> None:
    """The clean close writes the held records' counts first too: the next open (or the
    next owner) holds them again instead of delivering them from the source."""
    counts = {i: 2 for i in range(1, 5000)}
    held = {4990, 4995}
    offs = OffsetFile(tmp_path)
    offs.load()
    offs.close(0, [], counts, None, held)
    again = OffsetFile(tmp_path)
    again.load()
    assert held <= again.counts.keys() and len(again.counts) < len(counts)


def test_reasons_tail_round_trip_old_readers_and_bounds() -> None:
    raw = _encode(5, 10, [12, 15], {11: 3, 13: 1}, {11: "bad json", 13: "é timeout", 20: "no count"})
    assert _decode_all(raw) == (5, 10, [12, 15], {11: 3, 13: 1}, {11: "bad json", 13: "é timeout", 20: "no count"})
    assert _decode_full(raw) == (5, 10, [12, 15], {11: 3, 13: 1})  # a reader without reasons stops after the counts
    assert _decode(raw) == (5, 10, [12, 15])
    only = _encode(1, -1, [], None, {4: "why"})  # reasons with no counts: an empty counts tail first
    assert _decode_all(only) == (1, -1, [], {}, {4: "why"})
    assert _decode_all(_encode(1, 10, [], {11: 1}, {3: "below the frontier", 12: ""})) == (1, 10, [], {11: 1}, {})
    assert _decode_all(_encode(1, 0, [1, 2])) == (1, 0, [1, 2], {}, {})
    # room: the reasons of the highest counts are kept, the rest left out, the slot stays whole
    counts = {i: 1 for i in range(1, 40)}
    counts[30] = 9
    reasons = {i: f"{i:03d}" + "r" * 250 for i in range(1, 40)}
    got = _decode_all(_encode(2, 0, [], counts, reasons))
    assert got is not None and got[3] == counts
    kept = got[4]
    assert 30 in kept and 0 < len(kept) < len(reasons) and all(reasons[o] == r for o, r in kept.items())
    rest = sorted(o for o in kept if o != 30)
    assert rest == list(range(1, len(rest) + 1))  # then the lowest offsets
    assert len(_encode(2, 0, [], counts, reasons)) == SLOT
    # a reason's bytes never invalidate a slot: bad UTF-8 decodes with replacement characters
    bad = _encode(1, 0, [], {}, {1: "\udcff"})
    assert _decode_all(bad) == (1, 0, [], {}, {1: "?"})


def test_held_marks_tail_round_trip_old_readers_and_room() -> None:
    raw = _encode(5, 10, [12, 15], {11: 3, 13: 1}, {11: "why"}, None, {11, 13, 15, 9})
    assert _decode_every(raw) == (5, 10, [12, 15], {11: 3, 13: 1}, {11: "why"}, {11, 13})  # acked or below: none
    assert _decode_all(raw) == (5, 10, [12, 15], {11: 3, 13: 1}, {11: "why"})  # a reader without marks stops before
    assert _decode_full(raw) == (5, 10, [12, 15], {11: 3, 13: 1}) and _decode(raw) == (5, 10, [12, 15])
    # marks alone: an empty counts tail and an empty reasons tail before them
    assert _decode_every(_encode(1, -1, [], None, None, None, {4, 7})) == (1, -1, [], {}, {}, {4, 7})
    assert _decode_every(_encode(1, 0, [1, 2])) == (1, 0, [1, 2], {}, {}, set())  # none: no tail at all
    assert len(_encode(1, 0, [1, 2])) == len(_encode(1, 0, [1, 2], None, None, None, ()))
    # marks take their room before the reasons do: long reasons give way, the marks stay
    counts = {i: 1 for i in range(1, 40)}
    reasons = {i: "r" * 250 for i in range(1, 40)}
    held = set(range(1, 40))
    got = _decode_every(_encode(2, 0, [], counts, reasons, None, held))
    assert got is not None and got[3] == counts and got[5] == held and 0 < len(got[4]) < len(reasons)
    # no room for every mark: the lowest go in, the rest are reported like counts left out
    far = {i * 100_000 for i in range(1, 3000)}
    dropped: set[int] = set()
    got = _decode_every(_encode(3, 0, [], None, None, dropped, far))
    assert got is not None and got[5] and dropped and got[5] | dropped == far and not got[5] & dropped
    assert max(got[5]) < min(dropped)
    # marks take their room before counts: many leased records' counts never crowd a mark out
    room = SLOT - OFF._HDR.size - OFF._BODY.size
    n = (room - 4) // 2 - 1  # leased counts whose whole tail (2 bytes each) just fits the slot
    crowd = {i: 1 + i % 7 for i in range(1, 3 * n, 3)}
    marks = {i * 50 for i in range(1, 21)}
    dropped = set()
    got = _decode_every(_encode(4, 0, [], crowd, None, dropped, marks))
    assert got is not None and got[5] == marks and not dropped & marks
    assert dropped and 0 < len(got[3]) < len(crowd)  # the counts gave way instead


def _written(p: Partition) -> None:
    """The committer's tick (page cache only), with the held marks it passes."""
    f, a = p.snapshot_offsets()
    p.offsets.write_window(f, a, p.snapshot_counts(), p.snapshot_reasons(), p.held_marks())


def _kill9(p: Partition) -> None:
    os.close(p.offsets._fd)  # the descriptor goes, the page cache stays
    p.offsets._fd = -1


def test_a_hold_is_held_again_after_a_crash_whatever_the_maximum_became(tmp_path: Path) -> None:
    """A record held for the dead-letter topic may have its copy there at any moment:
    after a kill -9 it is held again even though max_deliveries was raised meanwhile
    (its count is below the new maximum), a raise does not release it, and only
    lifting dead-lettering does. A hold a raise released before the crash is not."""
    p = _partition(tmp_path, 3)
    p.max_deliveries = 1
    d = p.reserve(100.0, 2, 30.0, 1024, 1024)
    for x in d:
        assert p.nack(x.offset, x.nonce, 100.1)
    assert sorted(p.dead) == [0, 1] and set(p.held_marks()) == {0, 1}
    _written(p)
    p.dead_flight.add(0)  # the driver's commit of offset 0 is on its way
    p.max_deliveries = 5
    p.release_dead(below=5)  # the raise: 1 goes out again, 0 stays (in flight)
    assert sorted(p.dead) == [0]
    _written(p)  # the raise reached the file: offset 1 is no longer marked
    _kill9(p)
    q = _reopen(tmp_path)
    assert q.marked == {0} and q.deliveries == {0: 1, 1: 1}
    q.max_deliveries = 5  # the topic's raised maximum
    got = q.reserve(200.0, 3, 30.0, 1024, 1024)
    assert sorted(x.offset for x in got) == [1, 2]  # 0 is held again, not delivered
    assert sorted(q.dead) == [0]
    q.release_dead(below=5)
    assert sorted(q.dead) == [0]  # a raise does not release it
    _written(q)
    _kill9(q)
    r = _reopen(tmp_path)
    r.max_deliveries = 5
    assert r.marked == {0} and [x.offset for x in r.reserve(300.0, 1, 30.0, 1024, 1024)] == [1]
    assert sorted(r.dead) == [0]
    assert r.settle_dead(0) and not r.marked  # the dead-letter copy landed: settled, the mark gone
    _written(r)
    _kill9(r)
    s = _reopen(tmp_path)
    assert s.marked == set() and s.committed == 0
    # lifting dead-lettering releases a marked hold
    s.max_deliveries = 1
    assert [x.offset for x in s.reserve(400.0, 1, 30.0, 1024, 1024)] == []  # 1 (leased before) is spent: held
    s.marked.add(2)
    s.max_deliveries = 0
    s.release_dead()
    assert not s.dead and not s.marked
    assert sorted(x.offset for x in s.reserve(401.0, 3, 30.0, 1024, 1024)) == [1, 2]


def test_a_lift_clears_restored_marks_and_a_raise_keeps_them_without_churn(tmp_path: Path) -> None:
    """Marks a restart found go when dead-lettering is lifted (at the open, as
    ``Broker._open_sync`` does, or by a change): a later re-enable does not hold a
    record at its first nack. A raise keeps them, and releasing below the raise again
    and again (the dead-letter driver's pass) changes nothing and writes nothing."""
    p = _partition(tmp_path, 3)
    p.follow_max(1)
    for x in p.reserve(100.0, 2, 30.0, 1024, 1024):
        assert p.nack(x.offset, x.nonce, 100.1)
    assert sorted(p.dead) == [0, 1]
    _written(p)
    _kill9(p)
    q = _reopen(tmp_path)
    assert q.marked == {0, 1}
    assert not q.follow_max(5)  # opened with a raised maximum: the marks stay
    assert [x.offset for x in q.reserve(200.0, 3, 30.0, 1024, 1024)] == [2]
    assert sorted(q.dead) == [0, 1]
    q.dirty = False
    for _ in range(3):
        assert not q.release_dead(5)
    assert not q.dirty and sorted(q.dead) == [0, 1]
    _kill9(q)
    r = _reopen(tmp_path)  # opened with dead-lettering lifted: the marks go
    assert r.marked == {0, 1}
    assert r.follow_max(0) and not r.marked and r.dirty
    _written(r)
    _kill9(r)
    s = _reopen(tmp_path)
    assert s.marked == set()
    s.follow_max(50)  # re-enabled: one nack holds nothing
    got = s.reserve(300.0, 3, 30.0, 1024, 1024)
    assert sorted(x.offset for x in got) == [0, 1, 2]
    for x in got:
        assert s.nack(x.offset, x.nonce, 300.1)
    assert not s.dead


def test_a_lift_keeps_held_only_the_marked_records_sent_to_a_dead_letter_topic_still_there(
        tmp_path: Path) -> None:
    """A mark a restart found means the record was held; if its driver had also sent it
    (``dead_letter.target`` lists it, and that topic still exists: the broker's
    ``deadletter.finish_keep``), its copy may be there already. Lifted with those
    offsets as `keep`, they stay held and marked, even at max_deliveries 0, so the
    driver can finish their move; a marked record never sent goes out again, as does
    one held but not marked. Once the move settles them, nothing is held back."""
    p = _partition(tmp_path, 5)
    p.follow_max(1)
    for x in p.reserve(100.0, 3, 30.0, 1024, 1024):
        assert p.nack(x.offset, x.nonce, 100.1)
    assert sorted(p.dead) == [0, 1, 2]
    _written(p)
    _kill9(p)
    q = _reopen(tmp_path)
    assert q.marked == {0, 1, 2}
    assert q.follow_max(0, {0, 1})  # 2 was never sent: its mark goes
    assert q.marked == {0, 1} and q.max_deliveries == 0
    got = q.reserve(200.0, 5, 30.0, 1024, 1024)
    assert sorted(x.offset for x in got) == [2, 3, 4]  # 0 and 1 are held again, not delivered
    assert sorted(q.dead) == [0, 1]
    for x in got:  # max_deliveries 0: a nack of an unmarked record holds nothing
        assert q.nack(x.offset, x.nonce, 200.1)
    assert sorted(q.dead) == [0, 1]
    assert not q.release_dead(keep={0, 1})  # the driver's pass while lifted: still held
    assert q.settle_dead(0) and q.settle_dead(1) and not q.marked and not q.dead
    assert sorted(x.offset for x in q.reserve(201.0, 5, 30.0, 1024, 1024)) == [2, 3, 4]
    # Nothing kept (no target, or it is gone): the same lift releases every mark, as before.
    r = _partition(tmp_path / "other", 2)
    r.follow_max(1)
    for x in r.reserve(100.0, 2, 30.0, 1024, 1024):
        assert r.nack(x.offset, x.nonce, 100.1)
    _written(r)
    _kill9(r)
    s = _reopen(tmp_path / "other")
    assert s.marked == {0, 1} and s.follow_max(0) and not s.marked
    assert sorted(x.offset for x in s.reserve(300.0, 2, 30.0, 1024, 1024)) == [0, 1]


def test_reasons_survive_a_crash_and_a_close(tmp_path: Path) -> None:
    p = _partition(tmp_path, 3)
    d = p.reserve(100.0, 3, 30.0, 1024, 1024)
    p.dirty = False
    assert p.nack(0, d[0].nonce, 100.1, reason="upstream 503")
    assert p.dirty  # a reason alone is something to write
    f, a = p.snapshot_offsets()
    p.offsets.write_window(f, a, p.snapshot_counts(), p.snapshot_reasons())  # the committer's tick
    os.close(p.offsets._fd)  # kill -9: the page cache stays
    p.offsets._fd = -1
    q = _reopen(tmp_path)
    assert q.reasons == {0: "upstream 503"} and q.deliveries == {0: 1, 1: 1, 2: 1}
    d = q.reserve(200.0, 3, 30.0, 1024, 1024)
    assert q.nack(1, next(x.nonce for x in d if x.offset == 1), 200.1, reason="second")
    assert q.ack(0, next(x.nonce for x in d if x.offset == 0), 200.2)  # its reason goes with it
    f, a = q.snapshot_offsets()
    q.offsets.close(f, a, q.snapshot_counts(), q.snapshot_reasons())
    r = _reopen(tmp_path)
    assert r.committed == 0 and r.reasons == {1: "second"}
    assert OFF.peek_all(tmp_path)[3] == {1: "second"}


def test_counts_past_the_slot_keep_the_highest(tmp_path: Path) -> None:
    counts = {i: 1 for i in range(1, 4000)}
    counts[3500] = 9
    counts[3999] = 5
    assert not OFF.fits(0, [], counts)
    got = _decode_full(_encode(1, 0, [], counts))
    assert got is not None
    kept = got[3]
    assert kept[3500] == 9 and kept[3999] == 5  # the highest counts first
    assert 0 < len(kept) < len(counts)
    ones = sorted(o for o, c in kept.items() if c == 1)
    assert ones == list(range(1, len(ones) + 1))  # then the lowest offsets
    assert OFF.fits(0, [], {1: 2, 2: 3})


def test_counts_survive_a_crash_and_a_close(tmp_path: Path) -> None:
    p = _partition(tmp_path, 4)
    d = p.reserve(100.0, 4, 30.0, 1024, 1024)
    assert p.ack(1, d[1].nonce, 100.5)
    assert p.dirty
    f, a = p.snapshot_offsets()
    p.offsets.write_window(f, a, p.snapshot_counts())  # the committer's tick: page cache only
    os.close(p.offsets._fd)  # kill -9: the descriptor goes, the page cache stays
    p.offsets._fd = -1
    q = _reopen(tmp_path)
    assert q.committed == -1 and q.deliveries == {0: 1, 2: 1, 3: 1}
    d = q.reserve(200.0, 4, 30.0, 1024, 1024)
    assert sorted((x.offset, x.deliveries) for x in d) == [(0, 2), (2, 2), (3, 2)]
    assert q.ack(0, next(x.nonce for x in d if x.offset == 0), 200.5)
    f, a = q.snapshot_offsets()
    q.offsets.close(f, a, q.snapshot_counts())
    r = _reopen(tmp_path)
    assert r.committed == 1 and r.deliveries == {2: 2, 3: 2}


def test_used_up_deliveries_are_held_then_settled(tmp_path: Path) -> None:
    p = _partition(tmp_path, 3)
    held: list[int] = []
    p.on_dead = lambda part: held.append(len(part.dead))
    p.max_deliveries = 2
    d = p.reserve(100.0, 3, 30.0, 1024, 1024)
    assert p.nack(0, d[0].nonce, 100.1, reason="nope")
    d2 = p.reserve(100.2, 1, 30.0, 1024, 1024)
    assert (d2[0].offset, d2[0].deliveries) == (0, 2)
    assert p.nack(0, d2[0].nonce, 100.3, delay_s=60.0)  # spent: held, not delayed
    assert set(p.dead) == {0} and 0 not in p.delayed and held == [1]
    assert p.available() == 0  # 1 and 2 are leased, 0 is held
    assert p.ready(3, 1024) == 0  # the hold keeps its in-flight slot
    # offsets 1 and 2 expire twice: held too
    p.reserve(131.0, 5, 30.0, 1024, 1024)
    assert p.reserve(162.0, 5, 30.0, 1024, 1024) == []
    assert set(p.dead) == {0, 1, 2}
    assert not p.evictable()
    assert p.reasons.get(0) == "nope"
    for off in (0, 1, 2):
        assert p.settle_dead(off)
    assert p.committed == 2 and not p.dead and not p.deliveries and not p.reasons
    assert not p.settle_dead(0)


def test_a_restored_spent_count_is_held_not_leased(tmp_path: Path) -> None:
    p = _partition(tmp_path, 2)
    p.max_deliveries = 2
    for t in (100.0, 131.0):
        p.reserve(t, 1, 30.0, 1024, 1024)
    f, a = p.snapshot_offsets()
    p.offsets.close(f, a, p.snapshot_counts())  # the crash came after the count reached the disk
    q = _reopen(tmp_path)
    assert q.deliveries == {0: 2}
    q.max_deliveries = 2
    d = q.reserve(300.0, 5, 30.0, 1024, 1024)
    assert [x.offset for x in d] == [1] and set(q.dead) == {0}
    q.release_dead()  # the maximum was lifted: out again
    q.max_deliveries = 0
    d = q.reserve(300.0, 5, 30.0, 1024, 1024)
    assert [(x.offset, x.deliveries) for x in d] == [(0, 3)]


def test_the_trailing_wire_fields_decode_both_ways() -> None:
    """AckReq.reason, Item.deliveries, MoveListResp.counts and MoveFreezeResp.counts are
    trailing defaulted fields: a frame from a node without them decodes (no reason, no
    count, no counts moved), and one with them decodes at such a node (dropped)."""
    import msgspec

    from narad.broker import peers as P

    class OldAckReq(msgspec.Struct, tag="AckReq", array_like=True):
        topic: str
        topic_id: str
        mode: int
        items: list[tuple[int, int, int]]
        scope: int = P.WORKER
        dur_ms: int = 0

    class OldItem(msgspec.Struct, array_like=True):
        partition: int
        offset: int
        nonce: int
        key: bytes | None
        ts_ms: int
        flags: int
        payload: bytes

    class OldFreezeResp(msgspec.Struct, array_like=True):
        token: str
        hwm: int = -1
        frontier: int = -1
        ahead: list[int] = []
        cursors: list[tuple[str, str, int]] = []
        segments: list[tuple[int, int, int]] = []
        now_ms: int = 0

    class OldListResp(msgspec.Struct, array_like=True):
        hwm: int
        segments: list[tuple[int, int, int]]
        now_ms: int
        frozen: bool = False
        frontier: int = -1
        ahead: list[int] = []
        cursors: list[tuple[str, str, int]] = []

    enc, dec = msgspec.msgpack.encode, msgspec.msgpack.decode
    assert dec(enc(OldAckReq("t", "id", 2, [(0, 1, 2)], P.NODE, 5)), type=P.AckReq).reason == ""
    assert dec(enc(P.AckReq("t", "id", 2, [(0, 1, 2)], P.NODE, 5, "why")), type=OldAckReq) == \
        OldAckReq("t", "id", 2, [(0, 1, 2)], P.NODE, 5)
    assert dec(enc(OldItem(0, 1, 2, None, 3, 0, b"x")), type=P.Item).deliveries == 0
    assert dec(enc(P.Item(0, 1, 2, None, 3, 0, b"x", 4)), type=OldItem) == OldItem(0, 1, 2, None, 3, 0, b"x")
    assert dec(enc(OldFreezeResp("tok", 5, 1, [3])), type=P.MoveFreezeResp).counts == []
    new = P.MoveFreezeResp("tok", 5, 1, [3], [], [], 9, [(2, 4)])
    assert dec(enc(new), type=P.MoveFreezeResp).counts == [(2, 4)]
    assert dec(enc(new), type=OldFreezeResp) == OldFreezeResp("tok", 5, 1, [3], [], [], 9)
    lst = P.MoveListResp(5, [], 9, False, 1, [3], [], [(2, 4)])
    assert dec(enc(lst), type=OldListResp) == OldListResp(5, [], 9, False, 1, [3], [])
    assert dec(enc(OldListResp(5, [], 9)), type=P.MoveListResp).counts == []


def test_fits_says_exactly_whether_every_count_is_written() -> None:
    """``fits`` (a partition whose counts do not all fit is never closed as idle) agrees
    with what the slot keeps, over random sets of held acks and counts."""
    import random

    rnd = random.Random(14)
    seen = set()
    for _ in range(300):
        frontier = rnd.randrange(-1, 1000)
        ahead = sorted(rnd.sample(range(frontier + 1, frontier + 5000), rnd.randrange(0, 600)))
        held = set(ahead)
        pool = [o for o in range(frontier + 1, frontier + 40000, rnd.choice((1, 3, 200))) if o not in held]
        counts = {o: rnd.choice((1, 2, 3, 200)) for o in rnd.sample(pool, min(len(pool), rnd.randrange(0, 3000)))}
        got = _decode_full(_encode(1, frontier, ahead, counts))
        assert got is not None
        whole = got[2] == ahead and got[3] == counts
        assert OFF.fits(frontier, ahead, counts) == whole, (frontier, len(ahead), len(counts))
        seen.add(whole)
    assert seen == {True, False}  # both cases drawn


def test_the_dead_letter_copy_and_the_redrive_produce() -> None:
    """The dead-letter copy keeps key, body, body flags and headers, drops an
    idempotency key, adds this origin with a previous one under it (a chain); the
    redrive's produce gives back the original key, partition, headers and body with
    the previous origin only; a damaged block travels as an opaque body."""
    from types import SimpleNamespace

    from narad.api.messages import _redrive_entry
    from narad.broker.deadletter import dead_letter_record
    from narad.broker.peers import Item
    from narad.storage import frames as FR

    body = b'{"a": 1}'
    stored = FR.pack_ext(FR.Ext(h=FR.headers_json({"trace": "t1"}), i="idem-1",
                                d=FR.DeadLetter("older", 9, 9, 9)), body)
    key, flags, payload = dead_letter_record("src", 2, 40, 3, "bad", (b"k", 1234, FR.F_JSON | FR.F_EXT, stored))
    assert key == b"k" and flags == FR.F_JSON | FR.F_EXT
    ext, b2 = FR.split_ext(flags, payload)
    assert b2 == body and ext is not None and ext.h == b'{"trace":"t1"}' and ext.i is None
    assert ext.d == FR.DeadLetter("src", 2, 40, 3, b"k", "bad", 1234, prev=FR.DeadLetter("older", 9, 9, 9))
    # a plain record: only the origin block is added
    _, flags, payload = dead_letter_record("src", 0, 1, 2, None, (None, 5, FR.F_UTF8, b"text"))
    ext, b2 = FR.split_ext(flags, payload)
    assert flags == FR.F_UTF8 | FR.F_EXT and b2 == b"text" and ext is not None and ext.h is None
    assert ext.d is not None and ext.d.r is None and ext.d.k is None
    # a damaged block: the stored bytes become an opaque (base64-rendered) body
    _, flags, payload = dead_letter_record("src", 0, 1, 2, None, (None, 5, FR.F_JSON | FR.F_EXT, b"\xff\xff"))
    ext, b2 = FR.split_ext(flags, payload)
    assert b2 == b"\xff\xff" and not flags & (FR.F_JSON | FR.F_UTF8)

    topics = {"src": SimpleNamespace(name="src", id="00" * 8, partitions=3, delay_ms=0, parent=None)}
    store = SimpleNamespace(topic=topics.get)
    inc = lambda t: bytes.fromhex(t.id)  # noqa: E731
    choose = lambda t, k: 0  # noqa: E731
    key, flags, payload = dead_letter_record("src", 2, 40, 3, "bad", (b"k", 1234, FR.F_JSON | FR.F_EXT, stored))
    here = SimpleNamespace(name="dlq", id="11" * 8)
    got = _redrive_entry(Item(1, 7, 1, key, 99, flags, payload), here, store, inc, choose, set)  # type: ignore[arg-type]
    assert got is not None
    e, b1 = got
    assert (e.topic, e.partition, e.key) == ("src", 2, b"k") and b1 == body
    ext, b2 = FR.split_ext(e.flags, e.payload)
    assert b2 == body and ext == FR.Ext(h=b'{"trace":"t1"}', d=FR.DeadLetter("older", 9, 9, 9))
    assert e.flags == FR.F_JSON | FR.F_EXT
    _, flags, payload = dead_letter_record("src", 5, 1, 2, None, (None, 5, FR.F_UTF8, b"text"))
    got = _redrive_entry(Item(1, 8, 1, None, 99, flags, payload), here, store, inc, choose, set)  # type: ignore[arg-type]
    assert got is not None
    e = got[0]
    assert e.partition == 0 and e.flags == FR.F_UTF8 and e.payload == b"text"  # 5 >= 3: chosen
    assert _redrive_entry(Item(1, 9, 1, None, 99, FR.F_UTF8, b"x"), here, store, inc, choose,  # type: ignore[arg-type]
                          set) is None  # no origin
    _, flags, payload = dead_letter_record("gone", 0, 1, 2, None, (None, 5, 0, b"x"))
    assert _redrive_entry(Item(1, 9, 1, None, 99, flags, payload), here, store, inc, choose,  # type: ignore[arg-type]
                          set) is None  # origin gone


class _DriverBroker:
    """What ``DeadLetterDriver`` uses of a worker's broker, over one real partition; its
    dead-letter commits are recorded (the commit path has its own tests with real nodes)."""

    def __init__(self, p: Partition, loop: asyncio.AbstractEventLoop) -> None:
        src = TopicRecord(p.topic, p.topic_id, 1, 0, 30_000, 1024, 1024, 0, max_deliveries=1,
                          dead_letter_topic="t-dlq")
        dlq = TopicRecord("t-dlq", "11" * 8, 1, 0, 30_000, 1024, 1024, 0)
        self.store = SimpleNamespace(topic={src.name: src, dlq.name: dlq}.get)
        self.security = False
        self.partitions = {(p.topic, p.index): p}
        self.loop = loop
        self.io = None  # (the loop's default executor)
        self.committed: list[int] = []  # the source offsets dead-lettered, in commit order

    def choose_partition(self, _t: TopicRecord, _key: bytes | None) -> int:
        return 0

    async def commit_to(self, _t: TopicRecord, _part: int, recs: list[tuple[bytes | None, int, bytes]]) -> int:
        for _, flags, payload in recs:
            self.committed.append(FR.split_ext(flags, payload)[0].d.o)  # type: ignore[union-attr]
        return 0


def test_the_driver_waits_for_room_for_a_held_records_count(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A held record whose count the offset slot left out is not dead-lettered (a kill -9
    after its settle would find no count and deliver it again from the source) until its
    count is written, or the grace passes (then it goes rather than hold the partition)."""
    monkeypatch.setattr(DL, "UNWRITTEN_GRACE", 0.6)
    p = _partition(tmp_path, 3)
    p.max_deliveries = 1
    for x in p.reserve(100.0, 3, 30.0, 1024, 1024):
        assert p.nack(x.offset, x.nonce, 100.1)
    assert set(p.dead) == {0, 1, 2}

    async def main() -> None:
        b = _DriverBroker(p, asyncio.get_running_loop())
        drv = DL.DeadLetterDriver(b)
        p.written_gen = max(p.dead.values())  # the committer wrote the window ...
        p.counts_unwritten = {1, 2}  # ... without these two counts
        await drv._drain(p)
        assert b.committed == [0] and set(p.dead) == {1, 2}
        p.counts_unwritten = {2}  # the next write had room for offset 1's count
        await drv._drain(p)
        assert b.committed == [0, 1] and set(p.dead) == {2}
        await asyncio.sleep(0.7)  # offset 2's count never fitted: past the grace it goes
        await drv._drain(p)
        assert b.committed == [0, 1, 2] and not p.dead

    asyncio.run(main())


@pytest.mark.parametrize("target", ["there", "gone", "made-again", "none"])
def test_the_driver_finishes_a_marked_move_after_a_lift_only_into_the_topic_it_began_with(
        tmp_path: Path, target: str) -> None:
    """Before a commit into a dead-letter topic the driver names it durably, with the
    offsets it sends (``dead_letter.target``). After a restart with dead-lettering
    lifted (here the dead-letter topic taken off the source), a record the offset file
    marked held and the file lists as sent (its copy may be there already) is moved
    into that topic if it still exists as the same incarnation, never delivered from
    the source. A marked record never sent (offset 1: its commit was elsewhere) goes out
    again, and with the topic gone, made again, or never named, so do all of them
    (nothing of them can be left there)."""
    p = _partition(tmp_path, 3)
    p.max_deliveries = 1
    got = p.reserve(100.0, 3, 30.0, 1024, 1024)
    for x in got[:2]:
        assert p.nack(x.offset, x.nonce, 100.1)
    assert set(p.dead) == {0, 1}
    _written(p)  # the holds are marked in the offset file

    async def first() -> None:  # the driver names the target and commits; the settle is never written
        b = _DriverBroker(p, asyncio.get_running_loop())
        p.written_gen = max(p.dead.values())
        p.dead_flight.add(1)  # (offset 1's commit is on its way elsewhere: this pass takes 0 alone)
        await DL.DeadLetterDriver(b)._drain(p)
        assert b.committed == [0]

    asyncio.run(first())
    assert DL.read_target(tmp_path) == ("t-dlq", "11" * 8, {0})  # named, with what was sent, before the commit
    if target == "none":
        (tmp_path / DL.TARGET_FILE).unlink()
    _kill9(p)  # before the committer's next tick: offset 0's settle is lost, its mark stays
    q = _reopen(tmp_path)
    tgt = DL.read_target(tmp_path)  # (what the broker's open does)
    if tgt is not None:
        q.dlq_target, q.dlq_sent = (tgt[0], tgt[1]), tgt[2]
    assert q.marked == {0, 1}

    async def after() -> None:
        b = _DriverBroker(q, asyncio.get_running_loop())
        src = b.store.topic(q.topic)
        lifted = msgspec.structs.replace(src, max_deliveries=0, dead_letter_topic=None)
        dlq = b.store.topic("t-dlq")
        topics = {q.topic: lifted, "t-dlq": dlq}
        if target == "gone":
            del topics["t-dlq"]
        elif target == "made-again":
            topics["t-dlq"] = msgspec.structs.replace(dlq, id="22" * 8)
        b.store = SimpleNamespace(topic=topics.get)
        keep = DL.finish_keep(b.store, q)
        assert keep == ({0} if target == "there" else set())
        q.follow_max(0, keep)  # the open's
        out = sorted(x.offset for x in q.reserve(200.0, 3, 30.0, 1024, 1024))
        if not keep:
            assert out == [0, 1, 2] and not q.marked
            return
        assert out == [1, 2] and set(q.dead) == {0}  # sent: held, not delivered; 1 was never sent
        q.written_gen = max(q.dead.values())
        await DL.DeadLetterDriver(b)._drain(q)
        assert b.committed == [0] and not q.dead and not q.marked  # moved, settled in the source

    asyncio.run(after())


def test_a_lift_while_the_driver_writes_its_target_file_never_leaves_a_record_live_in_both(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver waits for ``dead_letter.target`` to be durable before its commit. A
    lift that lands during that wait must not release the records it is about to commit
    (they would be delivered from the source while their copy lands in the dead-letter
    topic): they are in flight from before the wait, so the commit settles them. (Found
    by a review: they joined ``dead_flight`` only after the wait.)"""
    import threading

    p = _partition(tmp_path, 2)
    p.max_deliveries = 1
    for x in p.reserve(100.0, 2, 30.0, 1024, 1024):
        assert p.nack(x.offset, x.nonce, 100.1)
    assert sorted(p.dead) == [0, 1]
    writing = threading.Event()
    real = DL.write_target

    def slow(*a: Any) -> None:
        writing.set()
        time.sleep(0.3)
        real(*a)

    monkeypatch.setattr(DL, "write_target", slow)

    async def main() -> None:
        b = _DriverBroker(p, asyncio.get_running_loop())
        p.written_gen = max(p.dead.values())
        task = asyncio.create_task(DL.DeadLetterDriver(b)._drain(p))
        while not writing.is_set():
            await asyncio.sleep(0.005)
        assert not p.follow_max(0)  # the lift lands during the write: nothing released
        assert sorted(p.dead) == [0, 1]
        await task
        assert b.committed == [0, 1] and not p.dead
        assert p.reserve(200.0, 2, 30.0, 1024, 1024) == []  # settled, never delivered from the source

    asyncio.run(main())


def test_a_sent_record_is_held_at_an_open_even_when_the_offset_file_lost_its_mark(tmp_path: Path) -> None:
    """After a power loss the offset file may come back from before a record's hold (no
    mark, a lower count), while ``dead_letter.target``, synced before the dead-letter
    commit, lists it as sent: the open marks it held (``Partition.mark_sent``), so it is
    moved again, never delivered from its source. Offsets the file settled are not."""
    p = _partition(tmp_path, 3)
    p.max_deliveries = 1
    got = p.reserve(100.0, 3, 30.0, 1024, 1024)
    assert p.nack(got[0].offset, got[0].nonce, 100.1) and p.ack(got[2].offset, got[2].nonce, 100.1)
    assert sorted(p.dead) == [0]
    f, a = p.snapshot_offsets()
    p.offsets.write_window(f, a)  # (a window of the acks alone: what the disk kept)
    _kill9(p)
    q = _reopen(tmp_path)
    assert q.marked == set() and q.acked_ahead == {2}
    q.mark_sent({0, 2})  # the target file lists 0 (and 2, whose settle is on disk)
    assert q.marked == {0}
    q.max_deliveries = 0
    assert sorted(x.offset for x in q.reserve(200.0, 3, 30.0, 1024, 1024)) == [1]  # 0 held, 2 acked
    assert sorted(q.dead) == [0]


def test_records_sent_to_one_dead_letter_topic_stay_tracked_when_it_is_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records whose commit into D1 failed without an answer (it may have landed) are
    listed as sent. The dead-letter topic is changed to D2 and a pass sends one of them
    there: the file still lists all three (now finished into D2), so a lift then keeps
    every one held instead of delivering two from the source. (Found by a review: the
    list was started afresh for the new topic.)"""
    p = _partition(tmp_path, 3)
    p.max_deliveries = 1
    for x in p.reserve(100.0, 3, 30.0, 1024, 1024):
        assert p.nack(x.offset, x.nonce, 100.1)
    _written(p)

    async def main() -> None:
        b = _DriverBroker(p, asyncio.get_running_loop())

        async def lost(*_a: Any) -> int:
            raise ConnectionError("the link was cut: the commit may have landed")

        b.commit_to = lost  # type: ignore[method-assign]
        p.written_gen = max(p.dead.values())
        await DL.DeadLetterDriver(b)._drain(p)  # all three sent to t-dlq, no answer
        assert p.dlq_sent == {0, 1, 2} and sorted(p.dead) == [0, 1, 2]
        d2 = TopicRecord("t-dlq2", "33" * 8, 1, 0, 30_000, 1024, 1024, 0)
        src = msgspec.structs.replace(b.store.topic(p.topic), dead_letter_topic="t-dlq2")
        topics = {p.topic: src, "t-dlq": b.store.topic("t-dlq"), "t-dlq2": d2}
        b.store = SimpleNamespace(topic=topics.get)
        monkeypatch.setattr(DL, "BATCH", 1)
        await DL.DeadLetterDriver(b)._drain(p)  # 0 sent to t-dlq2
        assert DL.read_target(tmp_path) == ("t-dlq2", "33" * 8, {0, 1, 2})
        topics[p.topic] = msgspec.structs.replace(src, max_deliveries=0, dead_letter_topic=None)
        assert not p.follow_max(0, DL.finish_keep(b.store, p))  # the lift: nothing released
        assert sorted(p.dead) == [0, 1, 2]

    asyncio.run(main())


def test_a_move_listing_carries_the_dead_letter_target_with_the_offsets_in_flight(tmp_path: Path) -> None:
    """A move's freeze (and listing) answer carries the source's ``dead_letter.target``:
    the offsets sent and those whose commit may be starting now (in flight), which the
    destination's install writes (``moves._dlq`` checks a peer's values)."""
    from narad.broker import moves as MV
    from narad.broker import peers as P

    p = _partition(tmp_path, 0)
    assert MV._sent(p) == (None, [])
    p.dlq_target, p.dlq_sent = ("t-dlq", "11" * 8), {3, 1}
    p.dead_flight.add(7)
    target, sent = MV._sent(p)
    assert (target, sent) == (("t-dlq", "11" * 8), [1, 3, 7])
    resp = P.MoveFreezeResp("tok", 10, -1, [], [], [], 0, [], [], [1, 3, 7], target, sent)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(resp), type=P.MoveFreezeResp)
    assert MV._dlq(back) == ("t-dlq", "11" * 8, [1, 3, 7])
    assert MV._dlq(P.MoveFreezeResp("tok")) is None  # (an older source: none)
