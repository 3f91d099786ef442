"""Partition moves and decommission in the metastore (issue 13): the state machine's
rules for entry types 39-42 on real LMDB files (compare-and-set refusals, the flip
and its retry, draining surviving re-registration, removal with a tombstone that
refuses heartbeats, registration and placement, the tombstone cleared for a rejoin
with an empty disk); and the metadata service and the controller's decommission
driver on one real one-voter Raft group (pysyncobj on 127.0.0.1, real journal and
LMDB files) shared by the service tests of this module."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from narad.config import load_config
from narad.errors import BadRequest, Conflict, Forbidden, Misdirected, NotFound, Unavailable
from narad.meta import commands as C
from narad.meta import records as R
from narad.meta import requests as Q
from narad.meta import versions as V
from narad.meta.fsm import FSM
from narad.meta.grants import Identity
from narad.meta.raft import RaftNode
from narad.meta.records import AssignmentRecord, MemberRecord, TopicRecord, UserRecord
from narad.meta.service import MetaService
from narad.meta.store import MetaStore, Reader
from narad.supervisor.controller import Controller
from narad.supervisor.metadata import MetadataRouter
from tests.harness import free_ports

T = TypeVar("T")
OPERATOR = Identity(operator=True)
EVERY = sorted(C.APPLIED_TYPES)
TID, OTHER = "00000000000000aa", "00000000000000bb"


def topic(name: str, tid: str = TID, parts: int = 3) -> TopicRecord:
    return TopicRecord(name=name, id=tid, partitions=parts, retention_ms=0, visibility_timeout_ms=30000,
                       max_in_flight_per_partition=1024, max_acked_ahead_per_partition=1024, created_at=100)


def row(part: int, owner: str, expect: str | None, target: str | None, name: str = "t",
        tid: str = TID) -> C.MoveTargetRow:
    return C.MoveTargetRow(name, tid, part, owner, expect, target)


# ---- the state machine ------------------------------------------------------------------
class Applier:
    def __init__(self, path: Path) -> None:
        self.touched: list[set[int]] = []
        self.fsm = FSM(path, on_commit=lambda t, i: self.touched.append(t))
        self.index = 0

    def apply(self, payload: msgspec.Struct, stamp: int | None = None) -> C.ApplyResult:
        self.index += 1
        res = self.fsm.apply(self.index, C.encode(payload, request_id="", stamp_ms=stamp or 1000 + self.index))
        self.fsm.commit()
        return res

    def rows(self, name: str = "t") -> dict[int, AssignmentRecord]:
        with self.fsm.env.begin() as txn:
            return Reader(txn, self.fsm.dbs).assignments(name)

    def member(self, nid: str) -> MemberRecord | None:
        with self.fsm.env.begin() as txn:
            return Reader(txn, self.fsm.dbs).member(nid)

    def tombstone(self, nid: str) -> int | None:
        with self.fsm.env.begin() as txn:
            raw = txn.get(nid.encode(), db=self.fsm.dbs["removed_members"])
        return None if raw is None else R.REMOVED_DEC.decode(raw).removed_ms


@pytest.fixture
def fsm(tmp_path: Path) -> Iterator[Applier]:
    a = Applier(tmp_path / "fsm")
    for i, nid in enumerate(("n1", "n2", "n3")):
        assert a.apply(C.RegisterMember(MemberRecord(nid, f"127.0.0.1:{9000 + i}"))).ok
    assert a.apply(C.CreateTopic(topic("t"), owners=[(0, "n1"), (1, "n1"), (2, "n2")])).ok
    yield a
    a.fsm.close()


def test_move_targets_apply_whole_or_not_at_all(fsm: Applier) -> None:
    # One stale row refuses the entry: the good row before it is not written either.
    for bad, code in [
        (row(1, "n2", None, "n3"), C.Result.CHANGED),  # owner is n1, not n2
        (row(1, "n1", "n3", "n2"), C.Result.CHANGED),  # no target in flight, not n3
        (row(1, "n1", None, "n3", tid=OTHER), C.Result.CHANGED),  # another incarnation
        (row(1, "n1", None, "n1"), C.Result.CHANGED),  # onto its own owner
        (row(1, "n1", None, "ghost"), C.Result.CHANGED),  # not a member
        (row(7, "n1", None, "n3"), C.Result.CHANGED),  # no such partition
        (row(0, "n1", None, "n2"), C.Result.INVALID),  # the same row twice
    ]:
        res = fsm.apply(C.SetMoveTargets([row(0, "n1", None, "n3"), bad]))
        assert res.code == code, (bad, res)
        assert all(a.target is None for a in fsm.rows().values())
    fsm.touched.clear()
    assert fsm.apply(C.SetMoveTargets([row(0, "n1", None, "n3"), row(2, "n2", None, "n1")])).ok
    rows = fsm.rows()
    assert (rows[0].owner, rows[0].target, rows[2].owner, rows[2].target) == ("n1", "n3", "n2", "n1")
    # The broker's placement cache keys on the topic's name slot: the entry moves it.
    assert fsm.touched == [{V.ASSIGNMENTS, V.name_slot("t")}]
    # Clearing (an abort) is a compare-and-set on the target read, too.
    assert fsm.apply(C.SetMoveTargets([row(0, "n1", "n2", None)])).code == C.Result.CHANGED
    assert fsm.apply(C.SetMoveTargets([row(0, "n1", "n3", None)])).ok
    assert fsm.rows()[0].target is None


def test_the_flip_commits_only_from_the_source_to_the_target_and_a_retry_answers_done(fsm: Applier) -> None:
    assert fsm.apply(C.SetMoveTargets([row(0, "n1", None, "n3")])).ok
    assert fsm.apply(C.CompleteMove("t", TID, 0, "n2", "n3")).code == C.Result.CHANGED  # not the source
    assert fsm.apply(C.CompleteMove("t", TID, 0, "n1", "n2")).code == C.Result.CHANGED  # not the target
    assert fsm.apply(C.CompleteMove("t", TID, 1, "n1", "n3")).code == C.Result.CHANGED  # no move in flight
    assert fsm.apply(C.CompleteMove("t", OTHER, 0, "n1", "n3")).code == C.Result.NOT_FOUND
    assert fsm.apply(C.CompleteMove("t", TID, 5, "n1", "n3")).code == C.Result.NOT_FOUND
    assert fsm.rows()[0] == AssignmentRecord("n1", TID, "n3")
    fsm.touched.clear()
    res = fsm.apply(C.CompleteMove("t", TID, 0, "n1", "n3"))
    assert res.ok and res.message == ""
    assert fsm.rows()[0] == AssignmentRecord("n3", TID, None)
    assert fsm.touched == [{V.ASSIGNMENTS, V.name_slot("t")}]
    res = fsm.apply(C.CompleteMove("t", TID, 0, "n1", "n3"))  # the retry of a flip that happened
    assert res.ok and res.message == "done"
    # An abort that lost the race to the flip is refused: the owner moved on.
    assert fsm.apply(C.SetMoveTargets([row(0, "n1", "n3", None)])).code == C.Result.CHANGED


def test_a_force_promote_flips_only_while_the_source_stays_silent(fsm: Applier) -> None:
    assert fsm.apply(C.SetMoveTargets([row(0, "n1", None, "n3")])).ok
    assert fsm.apply(C.MarkDead("n1")).ok
    judged = fsm.member("n1").heartbeat_ms  # type: ignore[union-attr]
    # The source heartbeat after the leader judged it silent: the force-promote is refused.
    assert fsm.apply(C.Heartbeat("n1", "b", 42)).ok
    assert fsm.apply(C.MarkDead("n1")).ok  # dead again, but with a newer heartbeat on record
    assert fsm.apply(C.CompleteMove("t", TID, 0, "n1", "n3", judged)).code == C.Result.CHANGED
    assert fsm.rows()[0] == AssignmentRecord("n1", TID, "n3")
    # Judged from the heartbeat on record, while it is dead: the flip commits.
    judged = fsm.member("n1").heartbeat_ms  # type: ignore[union-attr]
    assert fsm.apply(C.CompleteMove("t", TID, 0, "n1", "n3", judged)).ok
    assert fsm.rows()[0] == AssignmentRecord("n3", TID, None)
    # Alive (registered again) refuses it too.
    assert fsm.apply(C.SetMoveTargets([row(1, "n1", None, "n2")])).ok
    assert fsm.apply(C.RegisterMember(MemberRecord("n1", "127.0.0.1:9000"))).ok
    judged = fsm.member("n1").heartbeat_ms  # type: ignore[union-attr]
    assert fsm.apply(C.CompleteMove("t", TID, 1, "n1", "n2", judged)).code == C.Result.CHANGED


def test_draining_survives_registration_and_heartbeats_store_the_backlog(fsm: Applier) -> None:
    assert fsm.apply(C.SetDraining("ghost", True)).code == C.Result.NOT_FOUND
    assert fsm.apply(C.SetDraining("n2", True)).ok
    assert fsm.apply(C.Heartbeat("n2", "b", 42, dispatch_backlog=17)).ok
    m = fsm.member("n2")
    assert m is not None and m.draining and m.dispatch_backlog == 17
    # The node registers again after a restart (its record says draining=False): the mark stays.
    assert fsm.apply(C.RegisterMember(MemberRecord("n2", "127.0.0.1:9001"))).ok
    m = fsm.member("n2")
    assert m is not None and m.draining and m.dispatch_backlog == 17
    assert fsm.apply(C.Heartbeat("n2", "b", 42)).ok  # an older node's heartbeat: unknown
    m = fsm.member("n2")
    assert m is not None and m.dispatch_backlog == -1
    assert fsm.apply(C.SetDraining("n2", False)).ok
    m = fsm.member("n2")
    assert m is not None and not m.draining


def test_removal_waits_until_nothing_is_owned_or_received_and_leaves_a_tombstone(fsm: Applier) -> None:
    assert fsm.apply(C.RemoveMember("ghost")).code == C.Result.NOT_FOUND
    assert fsm.apply(C.RemoveMember("n2")).code == C.Result.CHANGED  # owns t/2
    assert fsm.apply(C.SetMoveTargets([row(2, "n2", None, "n3")])).ok
    assert fsm.apply(C.CompleteMove("t", TID, 2, "n2", "n3")).ok
    assert fsm.apply(C.SetMoveTargets([row(2, "n3", None, "n2")])).ok
    assert fsm.apply(C.RemoveMember("n2")).code == C.Result.CHANGED  # a move targets it
    assert fsm.apply(C.SetMoveTargets([row(2, "n3", "n2", None)])).ok
    # Rows that belong to no partition (orphans an older release could leave behind: another
    # incarnation, past the partition count) do not hold the removal back.
    assert fsm.apply(C.CreateTopic(topic("old", "00000000000000cc", parts=1), owners=[(0, "n1")])).ok
    with fsm.fsm.env.begin(write=True) as txn:
        for part, tid in ((5, "00000000000000cc"), (1, OTHER)):
            txn.put(R.part_key("old", part), R.ENCODER.encode(AssignmentRecord("n2", tid)),
                    db=fsm.fsm.dbs["assignments"])
    fsm.touched.clear()
    res = fsm.apply(C.RemoveMember("n2"), stamp=4242)
    assert res.ok, res
    assert fsm.touched == [{V.MEMBERS, V.REMOVED_MEMBERS}]
    assert fsm.member("n2") is None and fsm.tombstone("n2") == 4242  # stamped with the entry's stamp
    # The tombstone refuses the id: heartbeat, registration, placement, a move target.
    hb = fsm.apply(C.Heartbeat("n2", "b", 42))
    assert hb.code == C.Result.REFUSED and "removed" in hb.message
    assert fsm.apply(C.RegisterMember(MemberRecord("n2", "127.0.0.1:9001"))).code == C.Result.REFUSED
    assert fsm.apply(C.CreateTopicChecked(topic("u", "00000000000000dd", 1), None, [(0, "n2")])).code == \
        C.Result.CHANGED
    assert fsm.apply(C.SetMoveTargets([row(0, "n3", None, "n2")])).code == C.Result.CHANGED
    assert fsm.member("n2") is None
    # A rejoin with an empty data dir clears it (twice is fine); the node registers as new.
    assert fsm.apply(C.RemoveMember("n2", clear_tombstone=True)).ok
    assert fsm.apply(C.RemoveMember("n2", clear_tombstone=True)).message == "no tombstone"
    assert fsm.tombstone("n2") is None
    assert fsm.apply(C.RegisterMember(MemberRecord("n2", "127.0.0.1:9001"))).ok
    m = fsm.member("n2")
    assert m is not None and not m.draining


# ---- the metadata service and the decommission driver (one real Raft group) -----------------
class Node:
    def __init__(self, tmp: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.cfg = load_config(os.devnull, env={})
        self.versions = V.VersionTable.create(f"/narad-moves-{os.getpid()}-{time.monotonic_ns()}")
        self.fsm = FSM(tmp / "fsm")
        self.store = MetaStore(tmp / "fsm", self.versions, fsm=self.fsm)
        (port,) = free_ports(1)
        self.raft = RaftNode(self_addr=f"127.0.0.1:{port}", peers=[], raft_dir=tmp / "raft", sm=self.fsm,
                             loop=self.loop, password=None, bind_host="127.0.0.1")
        self.raft.start([])
        self.meta = MetaService(self.cfg, self.raft, self.store, "n1")
        self.router = MetadataRouter(node_id="n1", meta=self.meta, raft=self.raft, store=self.store,
                                     applied=lambda: self.fsm.applied_index, client=None, write_timeout=5.0)
        self.run(self._ready())

    async def _ready(self) -> None:
        deadline = time.monotonic() + 15
        while not self.raft.is_leader():
            assert time.monotonic() < deadline, "no leader"
            await asyncio.sleep(0.02)
        # n1 is this node (the only voter); n2..n4 are members that are not Raft voters.
        for nid, addr in (("n1", self.raft.self_addr), ("n2", "127.0.0.1:2"), ("n3", "127.0.0.1:3"),
                          ("n4", "127.0.0.1:4")):
            assert (await self.meta.write(C.RegisterMember(MemberRecord(nid, addr, newest_entry_type=42,
                                                                        entry_types=EVERY)))).ok
        assert (await self.meta.write(C.CreateUser(UserRecord("alice", b"h", [])))).ok

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def write(self, payload: msgspec.Struct) -> C.ApplyResult:
        return self.run(self.meta.write(payload))

    def rows(self, name: str) -> dict[int, AssignmentRecord]:
        with self.store.read() as r:
            return r.assignments(name)

    def member(self, nid: str) -> MemberRecord | None:
        with self.store.read() as r:
            return r.member(nid)

    def close(self) -> None:
        self.raft.close()
        self.fsm.close()
        self.versions.close()
        self.loop.close()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("moves-meta"))
    try:
        yield n
    finally:
        n.close()


def test_service_complete_move_answers_done_refused_not_found(node: Node) -> None:
    assert node.write(C.CreateTopic(topic("cm"), owners=[(0, "n2"), (1, "n2"), (2, "n3")])).ok
    assert node.write(C.SetMoveTargets([row(0, "n2", None, "n3", "cm")])).ok
    flip = Q.CompleteMoveReq("cm", TID, 0, "n2", "n3")
    # Through the router, as the destination's move runner calls it.
    assert node.run(node.router.execute(flip)) == Q.CompleteMoveResp("done")
    assert node.rows("cm")[0] == AssignmentRecord("n3", TID, None)
    assert node.run(node.router.execute(flip)) == Q.CompleteMoveResp("done")  # a retry
    assert node.run(node.meta.complete_move(Q.CompleteMoveReq("cm", TID, 1, "n2", "n3"))).outcome == "refused"
    assert node.run(node.meta.complete_move(Q.CompleteMoveReq("cm", OTHER, 1, "n2", "n3"))).outcome == "not_found"
    assert node.run(node.meta.complete_move(Q.CompleteMoveReq("nope", TID, 0, "n2", "n3"))).outcome == "not_found"


def test_service_leader_read_of_an_assignment(node: Node, tmp_path: Path) -> None:
    assert node.write(C.CreateTopic(topic("ra", parts=2), owners=[(0, "n2")])).ok
    assert node.write(C.SetMoveTargets([row(0, "n2", None, "n4", "ra")])).ok
    before = node.fsm.applied_index
    got = node.run(node.router.execute(Q.AssignmentReadReq("ra", 0)))
    assert got == Q.AssignmentReadResp(True, TID, "n2", "n4")
    assert node.fsm.applied_index > before  # a barrier ran before the re-read
    assert node.run(node.meta.read_assignment(Q.AssignmentReadReq("ra", 1))) == Q.AssignmentReadResp(False)
    assert node.run(node.meta.read_assignment(Q.AssignmentReadReq("ra", 9))).found is False
    assert node.run(node.meta.read_assignment(Q.AssignmentReadReq("nope", 0))).found is False
    # A node that is not the leader answers 421 (here: a replica whose Raft is not running yet).
    idle = RaftNode(self_addr="127.0.0.1:1", peers=[], raft_dir=tmp_path / "raft", sm=node.fsm, loop=node.loop,
                    password=None, bind_host="127.0.0.1")
    follower = MetaService(node.cfg, idle, node.store, "n2")
    with pytest.raises(Misdirected):
        node.run(follower.read_assignment(Q.AssignmentReadReq("ra", 0)))


def test_service_abort_move_codes(node: Node) -> None:
    assert node.write(C.CreateTopic(topic("ab"), owners=[(0, "n2"), (1, "n2"), (2, "n2")])).ok
    assert node.write(C.SetMoveTargets([row(0, "n2", None, "n3", "ab"), row(2, "n2", None, "n3", "ab")])).ok

    def abort(part: int, target: str | None = None, who: Identity = OPERATOR, name: str = "ab") -> Q.AbortMoveResp:
        return node.run(node.meta.abort_move(Q.AbortMoveReq(who, name, part, target)))

    with pytest.raises(BadRequest):
        abort(-1)
    with pytest.raises(Forbidden):
        abort(0, who=Identity("alice", True, False))
    with pytest.raises(NotFound):
        abort(0, name="nope")
    with pytest.raises(NotFound):
        abort(7)
    with pytest.raises(Conflict) as e:
        abort(1)
    assert e.value.code == "no_move"
    with pytest.raises(Conflict) as e:
        abort(0, target="n4")
    assert e.value.code == "target_mismatch"
    assert node.rows("ab")[0].target == "n3"  # nothing changed
    resp = abort(0, target="n3")
    assert resp.move == Q.MoveView("ab", 0, "n2", "n3", "alive", "alive")
    assert "stays with n2" in resp.note
    assert node.rows("ab")[0] == AssignmentRecord("n2", TID, None)
    # Forwarded answers decode as the response type; the JSON key is "from".
    resp = node.run(node.router.execute(Q.AbortMoveReq(OPERATOR, "ab", 2)))
    assert isinstance(resp, Q.AbortMoveResp) and msgspec.to_builtins(resp.move)["from"] == "n2"
    with pytest.raises(Conflict):
        abort(2)


def test_service_decommission_refusals_dry_run_and_cancel(node: Node, tmp_path: Path) -> None:
    def decom(nid: str, **kw: Any) -> Q.DecommissionResp | Q.Empty:
        return node.run(node.meta.decommission(Q.DecommissionReq(OPERATOR, nid, **kw)))

    with pytest.raises(NotFound):
        decom("ghost")
    with pytest.raises(NotFound):
        decom("ghost", dry_run=True)
    with pytest.raises(BadRequest):
        decom("n2", dry_run=True, cancel=True)
    with pytest.raises(Forbidden):
        node.run(node.meta.decommission(Q.DecommissionReq(Identity("alice", True, False), "n2")))
    # The only voter: removing it leaves fewer than 3 voters (dry run: 200 with reasons; real: 409).
    dry = decom("n1", dry_run=True)
    assert isinstance(dry, Q.DecommissionResp)
    assert not dry.would_decommission and dry.voter and [r.code for r in dry.reasons] == ["below_min_voters"]
    with pytest.raises(Conflict) as e:
        decom("n1")
    assert [r["code"] for r in e.value.extra["reasons"]] == ["below_min_voters"]  # type: ignore[union-attr]
    assert e.value.body()["reasons"]
    # A dead member that owns partitions: owner_dead.
    assert node.write(C.CreateTopic(topic("dd", parts=1), owners=[(0, "n4")])).ok
    assert node.write(C.MarkDead("n4")).ok
    dry = decom("n4", dry_run=True)
    assert isinstance(dry, Q.DecommissionResp) and [r.code for r in dry.reasons] == ["owner_dead"]
    assert dry.owned_partitions == 1 and not dry.voter
    with pytest.raises(Conflict):
        decom("n4")
    assert node.write(C.RegisterMember(MemberRecord("n4", "127.0.0.1:4", newest_entry_type=42,
                                                    entry_types=EVERY))).ok  # alive again
    # A dry run is answered by the node it reaches, from its replica, never forwarded: here a
    # router whose Raft is not running (no leader to forward to) answers it at once.
    idle = RaftNode(self_addr="127.0.0.1:1", peers=[], raft_dir=tmp_path / "raft", sm=node.fsm, loop=node.loop,
                    password=None, bind_host="127.0.0.1")
    router = MetadataRouter(node_id="n2", meta=MetaService(node.cfg, idle, node.store, "n2"), raft=idle,
                            store=node.store, applied=lambda: node.fsm.applied_index, client=None,
                            write_timeout=0.3)
    dry = node.run(router.execute(Q.DecommissionReq(OPERATOR, "n3", dry_run=True)))
    assert isinstance(dry, Q.DecommissionResp) and dry.would_decommission and dry.reasons == []
    with pytest.raises(Unavailable):  # the real thing needs the leader
        node.run(router.execute(Q.DecommissionReq(OPERATOR, "n3")))
    # Mark, mark again (idempotent), cancel, cancel again.
    assert decom("n3") == Q.Empty()
    m3 = node.member("n3")
    assert m3 is not None and m3.draining
    assert decom("n3") == Q.Empty()
    assert decom("n3", cancel=True) == Q.Empty()
    m3 = node.member("n3")
    assert m3 is not None and not m3.draining
    assert decom("n3", cancel=True) == Q.Empty()


def test_a_removed_id_is_refused_at_join_until_it_comes_with_an_empty_disk(node: Node) -> None:
    """The leader's join policy (the supervisor's, on this real replica and Raft group):
    a tombstoned id is refused 409 ``removed``; a join declaring an empty data dir gets
    503 while the leader clears the tombstone (type 42), then it is admitted."""
    from types import SimpleNamespace

    from narad.supervisor.main import Supervisor

    sup: Any = SimpleNamespace(fsm=node.fsm, raft=node.raft, meta=node.meta, _tasks=[], _older_joiner_logged={},
                               _tombstones_clearing=set())
    sup._clear_tombstone = lambda nid: Supervisor._clear_tombstone(sup, nid)
    join = {"node_id": "j1", "raft_addr": "127.0.0.1:77", "newest_entry_type": 42, "entry_types": EVERY}
    j1 = MemberRecord("j1", "127.0.0.1:77", newest_entry_type=42, entry_types=EVERY)

    async def main() -> None:
        assert (await node.meta.write(C.RegisterMember(j1))).ok
        assert (await node.meta.write(C.RemoveMember("j1"))).ok
        for extra in ({}, {"empty_disk": False}, {"probe": True}):
            verdict = Supervisor._join_policy(sup, {**join, **extra})
            assert verdict is not None and verdict[0] == 409 and verdict[1]["code"] == "removed", verdict
        verdict = Supervisor._join_policy(sup, {**join, "empty_disk": True})
        assert verdict is not None and verdict[0] == 503 and verdict[1]["code"] == "removed"
        deadline = time.monotonic() + 10
        while True:
            with node.store.read() as r:
                if r.txn.get(b"j1", db=r.dbs["removed_members"]) is None:
                    break
            assert time.monotonic() < deadline, "tombstone not cleared"
            await asyncio.sleep(0.02)
        assert Supervisor._join_policy(sup, {**join, "empty_disk": True}) is None  # admitted
        assert (await node.meta.write(C.RegisterMember(j1))).ok
        assert (await node.meta.write(C.RemoveMember("j1"))).ok  # leave the other tests their members

    node.run(main())


def test_controller_drains_a_member_then_removes_it_once_its_backlog_is_empty(node: Node) -> None:
    """The whole decommission on the leader: planned moves off the draining member
    (never onto it), flips by the destination, the wait for a heartbeat reporting an
    empty backlog, the removal with its tombstone, and the id refused afterwards."""
    async def main() -> None:
        meta = node.meta
        ctl = Controller(meta, node.router, member=MemberRecord("n1", node.raft.self_addr), data_dir=Path("."),
                         security=False, versions=node.versions, plan_every=0.0)
        for name in ("cm", "ra", "ab", "dd"):
            with node.store.read() as r:
                t = r.topic(name)
            if t is not None:
                await meta.write(C.DeleteTopic(name))
        assert (await meta.write(C.CreateTopic(topic("dr", parts=6), owners=[
            (p, "n2" if p < 4 else "n3") for p in range(6)]))).ok
        await meta.decommission(Q.DecommissionReq(OPERATOR, "n2"))

        async def heartbeat(nid: str, backlog: int) -> None:
            await node.router.execute(Q.HeartbeatReq(nid, "b", 42, entry_types=EVERY, dispatch_backlog=backlog))

        def blocked() -> list[str]:
            return [r.code for r in ctl.decommission_blocked.get("n2", [])]

        # The planner moves everything off n2 (to the receivers n1, n3, n4), and n2 waits for them.
        await ctl.move_duties(time.monotonic())
        rows = node.rows("dr")
        moving = {p: a for p, a in rows.items() if a.target is not None}
        assert sorted(moving) == [0, 1, 2, 3] and all(a.owner == "n2" for a in moving.values())
        assert all(a.target in ("n1", "n3", "n4") for a in moving.values())
        assert blocked() == []  # moves in flight: nothing blocks
        # The destinations flip two of them; the rest are still owned by n2.
        for p in (0, 1):
            resp = await meta.complete_move(Q.CompleteMoveReq("dr", TID, p, "n2", moving[p].target or ""))
            assert resp.outcome == "done"
        await ctl.move_duties(time.monotonic())
        assert node.member("n2") is not None
        for p in (2, 3):
            await meta.complete_move(Q.CompleteMoveReq("dr", TID, p, "n2", moving[p].target or ""))
        # It owns nothing now: a heartbeat stamped after that moment must report an empty backlog.
        await heartbeat("n2", 3)
        await ctl.move_duties(time.monotonic())
        assert node.member("n2") is not None  # the heartbeat came before the driver saw it empty
        deadline = time.monotonic() + 20
        while "dispatch_backlog" not in blocked():
            assert time.monotonic() < deadline, blocked()
            await asyncio.sleep(0.2)
            await heartbeat("n2", 3)
            await ctl.move_duties(time.monotonic())
        assert node.member("n2") is not None
        await heartbeat("n2", -1)
        await ctl.move_duties(time.monotonic())
        assert blocked() == ["node_status_unavailable"]
        await heartbeat("n2", 0)
        await ctl.move_duties(time.monotonic())
        assert node.member("n2") is None  # removed (not a voter: no Raft removal needed)
        assert "n2" not in ctl.decommission_blocked
        with node.store.read() as r:
            assert r.txn.get(b"n2", db=r.dbs["removed_members"]) is not None
        # Its id is refused from now on: heartbeat and registration answer 409 "removed".
        with pytest.raises(Conflict) as e:
            await heartbeat("n2", 0)
        assert e.value.code == "removed"
        with pytest.raises(Conflict) as e:
            await node.router.execute(Q.RegisterReq(MemberRecord("n2", "127.0.0.1:2")))
        assert e.value.code == "removed"
        with pytest.raises(NotFound):
            await meta.decommission(Q.DecommissionReq(OPERATOR, "n2", dry_run=True))
        # The partitions were never planned onto a draining member, and the rest stayed balanced.
        owners = sorted(a.owner for a in node.rows("dr").values())
        assert "n2" not in owners and len(owners) == 6

    node.run(main())


def test_a_draining_leader_hands_over_and_leaves_the_raft_voters(tmp_path: Path) -> None:
    """Four voters in process (real pysyncobj on 127.0.0.1, one LMDB file each): the
    leader is decommissioned; owning nothing, with an empty backlog reported, it hands
    the leadership over (leader_transfer), the new leader removes it from the voters
    (4 -> 3, never below 3) and then removes its member record."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        cfg = load_config(os.devnull, env={})
        addrs = [f"127.0.0.1:{p}" for p in free_ports(4)]
        ids = [f"v{i + 1}" for i in range(4)]
        versions = [V.VersionTable.create(f"/narad-moves4-{os.getpid()}-{i}-{time.monotonic_ns()}")
                    for i in range(4)]
        fsms = [FSM(tmp_path / f"fsm{i}") for i in range(4)]
        stores = [MetaStore(tmp_path / f"fsm{i}", versions[i], fsm=fsms[i]) for i in range(4)]
        rafts = [RaftNode(self_addr=addrs[i], peers=addrs, raft_dir=tmp_path / f"raft{i}", sm=fsms[i], loop=loop,
                          password=None, bind_host="127.0.0.1") for i in range(4)]
        metas = [MetaService(cfg, rafts[i], stores[i], ids[i]) for i in range(4)]
        routers = [MetadataRouter(node_id=ids[i], meta=metas[i], raft=rafts[i], store=stores[i],
                                  applied=lambda i=i: fsms[i].applied_index, client=None,
                                  write_timeout=5.0) for i in range(4)]
        ctls = [Controller(metas[i], routers[i], member=MemberRecord(ids[i], addrs[i]), data_dir=tmp_path,
                           security=False, versions=versions[i], plan_every=0.0) for i in range(4)]

        def leader() -> int | None:
            return next((i for i in range(4) if rafts[i].is_leader()), None)

        try:
            for r in rafts:
                r.start()
            deadline = time.monotonic() + 30
            while leader() is None:
                assert time.monotonic() < deadline, "no leader"
                await asyncio.sleep(0.02)
            first = leader()
            assert first is not None
            for i in range(4):
                assert (await metas[first].write(C.RegisterMember(MemberRecord(
                    ids[i], addrs[i], newest_entry_type=42, entry_types=EVERY)))).ok
            await metas[first].decommission(Q.DecommissionReq(OPERATOR, ids[first]))
            # A second voter while the first drains: both would leave 2 voters, so it is refused.
            second = (first + 1) % 4
            with pytest.raises(Conflict) as e2:
                await metas[first].decommission(Q.DecommissionReq(OPERATOR, ids[second]))
            assert [r["code"] for r in e2.value.extra["reasons"]] == ["below_min_voters"]  # type: ignore[union-attr]
            assert "already draining" in e2.value.extra["reasons"][0]["message"]  # type: ignore[index]
            seen: set[str] = set()
            deadline = time.monotonic() + 60
            while True:
                assert time.monotonic() < deadline, (seen, [r.status() for r in rafts])
                now = leader()
                if now is not None:
                    try:
                        with stores[now].read() as rd:
                            if rd.member(ids[first]) is None:
                                break
                        await metas[now].heartbeat(Q.HeartbeatReq(ids[first], "b", 42, entry_types=EVERY,
                                                                  dispatch_backlog=0))
                        await ctls[now].move_duties(time.monotonic())
                        seen |= {x.code for x in ctls[now].decommission_blocked.get(ids[first], [])}
                    except (Unavailable, Conflict) as e:  # an election in between
                        seen.add(f"err:{type(e).__name__}")
                await asyncio.sleep(0.1)
            now = leader()
            assert now is not None and now != first
            assert "leader_transfer" in seen
            assert sorted(rafts[now].voters()) == sorted(a for i, a in enumerate(addrs) if i != first)
            with stores[now].read() as rd:
                assert rd.txn.get(ids[first].encode(), db=rd.dbs["removed_members"]) is not None
                assert sorted(m.id for m in rd.members()) == sorted(x for i, x in enumerate(ids) if i != first)
            with pytest.raises(Conflict) as e:
                await metas[now].heartbeat(Q.HeartbeatReq(ids[first], "b", 42, dispatch_backlog=0))
            assert e.value.code == "removed"
            # Three voters left: a further decommission of a voter is refused.
            other = next(i for i in range(4) if i not in (first, now))
            with pytest.raises(Conflict) as e:
                await metas[now].decommission(Q.DecommissionReq(OPERATOR, ids[other]))
            assert [r["code"] for r in e.value.extra["reasons"]] == ["below_min_voters"]  # type: ignore[union-attr]
        finally:
            for r in rafts:
                r.close()
            for f in fsms:
                f.close()
            for v in versions:
                v.close()

    asyncio.run(main())


def test_a_node_heartbeat_carries_its_dispatch_backlog(tmp_path: Path) -> None:
    """A real node (one worker): its heartbeats report the dispatch backlog its
    workers' ingress WALs hold (0 when idle), read from the member record in its
    metastore file; a record the decommission driver could never act on says -1."""
    from narad.meta import fsm as F
    from tests.harness import Node, wait_for

    n = Node(tmp_path / "data", workers=1, env={"NARAD_CLUSTER_HEARTBEAT_INTERVAL": "250ms"}).start()
    try:
        env = F.open_env(F.fsm_dir(n.data_dir), readonly=True)
        try:
            dbs = F.open_dbs(env, create=False)

            def backlog() -> int | None:
                with env.begin() as txn:
                    m = Reader(txn, dbs).member(n.node_id)
                return None if m is None else m.dispatch_backlog

            wait_for(lambda: backlog() == 0, timeout=30, what=f"a heartbeat reporting backlog 0 (got {backlog()})")
        finally:
            env.close()
    finally:
        n.close()
