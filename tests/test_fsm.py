"""The metastore state machine on real LMDB files: apply rules, refusals,
idempotency, skip-on-replay, fail-stop, version slots, determinism."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from narad.errors import FailStop
from narad.meta import commands as C
from narad.meta import versions as V
from narad.meta.fsm import FSM
from narad.meta.records import AssignmentRecord, Grant, MemberRecord, SchemaRecord, TopicRecord, UserRecord
from narad.meta.store import Reader
from tests.harness import database_digest


def topic(name: str, tid: str = "00000000000000aa", parts: int = 3) -> TopicRecord:
    return TopicRecord(name=name, id=tid, partitions=parts, retention_ms=0, visibility_timeout_ms=30000,
                       max_in_flight_per_partition=1024, max_acked_ahead_per_partition=1024, created_at=100)


def enc(payload: object, rid: str = "", stamp: int = 1000) -> bytes:
    return C.encode(payload, request_id=rid, stamp_ms=stamp)  # type: ignore[arg-type]


class Applier:
    def __init__(self, path: Path) -> None:
        self.touched: list[set[int]] = []
        self.fsm = FSM(path, on_commit=lambda t, i: self.touched.append(t))
        self.index = self.fsm.applied_index

    def apply(self, payload: object, rid: str = "", stamp: int = 1000, commit: bool = True) -> C.ApplyResult:
        self.index += 1
        res = self.fsm.apply(self.index, enc(payload, rid, stamp))
        if commit:
            self.fsm.commit()
        return res

    def read(self) -> Reader:
        txn = self.fsm.env.begin()
        return Reader(txn, self.fsm.dbs)


def test_create_refusals_and_case_insensitive_names(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    assert a.apply(C.CreateTopic(topic("orders"))).ok
    dup = a.apply(C.CreateTopic(topic("orders", "00000000000000bb")))
    assert dup.code == C.Result.EXISTS
    clash = a.apply(C.CreateTopic(topic("Orders", "00000000000000cc")))
    assert clash.code == C.Result.EXISTS and '"orders"' in clash.message
    r = a.read()
    assert r.topic("orders").id == "00000000000000aa"  # type: ignore[union-attr]
    assert r.topic("Orders") is None
    # Refused entries still count as applied: the index moved past them.
    assert a.fsm.applied_index == 3


def test_delete_drops_assignments_and_schemas_and_recreate_is_clean(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    assert a.apply(C.CreateTopic(topic("t1"), schema=b'{"type":"object"}')).ok
    assert a.apply(C.AssignPartitions("t1", "00000000000000aa", [(0, "n1"), (1, "n1"), (2, "n1")])).ok
    assert a.apply(C.DeleteTopic("t1")).ok
    r = a.read()
    assert r.topic("t1") is None and r.assignments("t1") == {} and r.schemas("t1") == []
    assert a.apply(C.CreateTopic(topic("t1", "00000000000000ff"))).ok
    r = a.read()
    assert r.topic("t1").id == "00000000000000ff" and r.topic("t1").schema_version == 0  # type: ignore[union-attr]
    # An assignment computed for the deleted incarnation is refused.
    stale = a.apply(C.AssignPartitions("t1", "00000000000000aa", [(0, "n1")]))
    assert stale.code == C.Result.CHANGED
    assert a.read().assignments("t1") == {}


def test_update_grows_only_and_schema_versions_are_sequential(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    a.apply(C.CreateTopic(topic("t")))
    assert a.apply(C.UpdateTopic("t", partitions=2)).code == C.Result.INVALID
    assert a.apply(C.UpdateTopic("t", partitions=5, retention_ms=7_200_000)).ok
    assert a.apply(C.PutSchema("t", 2, b"true")).code == C.Result.CHANGED
    assert a.apply(C.PutSchema("t", 1, b"true")).ok
    t = a.read().topic("t")
    assert t is not None and (t.partitions, t.retention_ms, t.schema_version) == (5, 7_200_000, 1)


def test_request_id_applies_once_and_answers_the_first_result(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    first = a.apply(C.CreateTopic(topic("t")), rid="req-1")
    again = a.apply(C.CreateTopic(topic("t", "00000000000000bb")), rid="req-1")
    assert first.ok and again.ok and again.index == first.index
    assert a.read().topic("t").id == "00000000000000aa"  # type: ignore[union-attr]


def test_replay_skips_what_the_database_holds(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    a.apply(C.CreateUser(UserRecord("u", b"h")))
    a.apply(C.UpdateGrants("u", [Grant("produce", ["x*"])]))
    a.fsm.close()
    b = FSM(tmp_path / "fsm")
    assert b.applied_index == 2 and b.index_trusted
    # Raft hands the log again from index 1: nothing is applied twice.
    res = b.apply(1, enc(C.CreateUser(UserRecord("u", b"other"))))
    assert res.message == "already applied"
    b.commit()
    with b.env.begin() as txn:
        u = Reader(txn, b.dbs).user("u")
    assert u is not None and u.password_hash == b"h" and u.grants == [Grant("produce", ["x*"])]


def test_unknown_entry_type_fail_stops_and_keeps_nothing_of_the_batch(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    a.apply(C.CreateTopic(topic("t")), commit=False)  # in the open batch
    with pytest.raises(FailStop) as e:
        a.fsm.apply(a.index + 1, bytes([200]) + b"\x93\xa0\x00\x90")
    assert e.value.index == a.index + 1 and e.value.entry_type == 200
    a.fsm.env.close()
    b = FSM(tmp_path / "fsm")
    assert b.applied_index == 0  # the batch was not committed: a restart replays it
    with b.env.begin() as txn:
        assert Reader(txn, b.dbs).topic("t") is None


def test_undecodable_entry_is_a_refusal_not_a_stop(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    a.index += 1
    res = a.fsm.apply(a.index, bytes([C.EntryType.CREATE_TOPIC]) + b"\xff\xff")
    a.fsm.commit()
    assert res.code == C.Result.UNDECODABLE and a.fsm.applied_index == 1


def test_commit_reports_touched_version_slots(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    a.apply(C.CreateTopic(topic("t")))
    assert {V.TOPICS, V.name_slot("t")} <= a.touched[-1]
    a.apply(C.CreateUser(UserRecord("u", b"h")))
    assert a.touched[-1] == {V.USERS}
    a.apply(C.CreateTopic(topic("t")))  # refused: touches nothing
    assert a.touched[-1] == set()


def test_root_admin_is_unique_and_undeletable(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    assert a.apply(C.CreateUser(UserRecord("admin", b"h", root=True))).ok
    assert a.apply(C.CreateUser(UserRecord("admin2", b"h", root=True))).code == C.Result.EXISTS
    assert a.apply(C.DeleteUser("admin")).code == C.Result.REFUSED
    assert a.apply(C.UpdateGrants("admin", [])).code == C.Result.REFUSED


def _digest(fsm: FSM) -> str:
    return database_digest(fsm.env, fsm.dbs)


def test_same_script_gives_identical_databases(tmp_path: Path) -> None:
    """The determinism harness: one script covering every entry type this build applies
    (refusals included), applied to two FSMs with different batching, gives
    byte-identical databases (every table and the index/stamp/budget counters)."""
    owned = topic("c", "00000000000000cc")
    owned.owner = "u"
    script: list[object] = [
        C.RegisterMember(MemberRecord("n1", "127.0.0.1:1")), C.RegisterMember(MemberRecord("n2", "127.0.0.1:2")),
        C.CreateTopic(topic("a")), C.CreateTopic(topic("b", "00000000000000bb"), schema=b"true"),
        C.AssignPartitions("a", "00000000000000aa", [(0, "n1"), (1, "n2"), (2, "n1")]),
        C.Heartbeat("n1", "b", 13), C.MarkDead("n1"), C.Heartbeat("n1", "b", 32),
        C.CreateUser(UserRecord("u", b"h", [Grant("consume", ["a"])])),
        C.UpdateGrants("u", [Grant("produce", ["a*"])]), C.UpdatePassword("u", b"h2"),
        C.UpdateTopic("a", partitions=4), C.PutSchema("b", 2, b"{}"), C.DeleteTopic("b"),
        C.CreateTopicChecked(owned, b"{}", [(0, "n1"), (1, "n2"), (2, "n2")]),
        C.CreateTopicChecked(topic("d", "00000000000000dd"), None, [(0, "ghost")]),  # refused
        C.UpdateTopicCas("c", "00000000000000cc", retention_ms=60000, partitions=5),
        C.UpdateTopicCas("c", "00000000000000aa", partitions=9),  # refused: other incarnation
        C.PutSchemaCas("c", "00000000000000cc", 2, b'{"type": "object"}'),
        C.PlacePartitions("c", "00000000000000cc", [(3, "n1"), (4, "n2")]),
        C.PlacePartitions("c", "00000000000000cc", [(3, "n2")]),  # refused: insert only
        C.PlacePartitions("a", "00000000000000aa", [(3, "n2")]),
        C.PruneAssignments([("gone", 0)]), C.MarkDeadObserved("n2", 0),  # refused: newer heartbeat
        C.MarkDeadObserved("n2", 10_000), C.DeleteUserReleasing("u"), C.DeleteTopicCas("c", "00000000000000cc"),
        C.DeleteUser("nobody"), C.Noop(),
        # Fan-out: attach (adopting the parent's schema), create-as-child, schema copies, the
        # delay-vs-retention refusal, detach, and a parent's delete unlinking its children.
        C.CreateTopic(topic("p", "00000000000000a1"), schema=b'{"type": "object"}'),
        C.CreateTopic(topic("k1", "00000000000000a2")),
        C.AttachChildCas("p", "00000000000000a1", "k1", "00000000000000a2", 0, "e1e1e1e1e1e1e1e1", [0, 0, 0]),
        C.AttachChildCas("p", "00000000000000a1", "a", "00000000000000aa", 0, "e2e2e2e2e2e2e2e2", [0]),  # refused
        C.CreateTopicChecked(msgspec.structs.replace(
            topic("k2", "00000000000000a3"), parent="p", parent_id="00000000000000a1", delay_ms=60_000,
            attach_epoch="e3e3e3e3e3e3e3e3", attach_offsets=[1, 2, 3]), None, [(0, "n1"), (1, "n2"), (2, "n1")]),
        C.PutSchemaCas("p", "00000000000000a1", 2, b'{"type": "object", "title": "x"}'),
        C.PutSchema("p", 3, b'{"title": "y"}'),
        C.UpdateTopicCas("p", "00000000000000a1", retention_ms=3_600_000),  # refused: delay child
        C.DetachChildCas("p", "00000000000000a1", "k1", "00000000000000a2"),
        C.DetachChildCas("p", "00000000000000a1", "k1", "00000000000000a2"),  # refused: not linked
        C.DeleteTopic("p"),
        C.ImportMetastore(False, [topic("x", "00000000000000ee")], [], [], []),  # refused: the cluster holds state
        C.ImportMetastore(True, [msgspec.structs.replace(topic("x", "00000000000000ee", parts=2), schema_version=1)],
                          [C.ImportedSchema("x", SchemaRecord("00000000000000ee", 1, b"{}", 5))],
                          [C.ImportedAssignment("x", 0, AssignmentRecord("n2", "00000000000000ee")),
                           C.ImportedAssignment("x", 1, AssignmentRecord("gone-node", "00000000000000ee"))],
                          [UserRecord("imported", b"h", [Grant("consume", ["x"])])]),
        # Moves and decommission (39-42): a target set, the same set again refused (the target is
        # no longer the one read), the flip, its retry ("done"), a flip of a row that is not there,
        # draining, a removal refused while the member owns partitions, a removal with its
        # tombstone refusing heartbeat and registration, and the tombstone cleared.
        C.SetMoveTargets([C.MoveTargetRow("x", "00000000000000ee", 0, "n2", None, "n1")]),
        C.SetMoveTargets([C.MoveTargetRow("x", "00000000000000ee", 0, "n2", None, "n1")]),  # refused
        C.CompleteMove("x", "00000000000000ee", 0, "n2", "n1"), C.CompleteMove("x", "00000000000000ee", 0, "n2", "n1"),
        C.CompleteMove("x", "00000000000000ee", 1, "n2", "n1"),  # refused: no row
        C.SetDraining("n2", True), C.SetDraining("ghost", True),  # refused: not a member
        C.RemoveMember("n1"),  # refused: owns partitions
        C.RegisterMember(MemberRecord("n3", "127.0.0.1:3")), C.Heartbeat("n3", "b", 42, dispatch_backlog=0),
        C.RemoveMember("n3"), C.Heartbeat("n3", "b", 42),  # refused: removed
        C.RegisterMember(MemberRecord("n3", "127.0.0.1:3")),  # refused: removed
        C.RemoveMember("n3", clear_tombstone=True), C.RegisterMember(MemberRecord("n3", "127.0.0.1:3")),
        # Delivery settings (43): set on x with p as its dead-letter topic, refused without one,
        # refused for a missing one and for the topic itself, refused for a stale incarnation.
        C.SetDelivery("x", "00000000000000ee", 3, "p", 60000), C.SetDelivery("x", "00000000000000ee", None, ""),
        C.SetDelivery("x", "00000000000000ee", None, "nope"), C.SetDelivery("x", "00000000000000ee", None, "x"),
        C.SetDelivery("x", "00000000000000ff", 0, ""),
    ]
    assert {C.TYPE_OF[type(p)] for p in script} == set(C.PAYLOAD_TYPES), "the script misses an entry type"
    one, two = Applier(tmp_path / "one"), Applier(tmp_path / "two")
    results = []
    for i, p in enumerate(script):
        results.append(one.apply(p, rid=f"r{i}", stamp=1000 + i))
        two.apply(p, rid=f"r{i}", stamp=1000 + i, commit=(i % 4 == 3))  # different batching
    two.fsm.commit()
    assert sum(not r.ok for r in results) == 19, [r.message for r in results if not r.ok]
    assert _digest(one.fsm) == _digest(two.fsm)
    one.fsm.close()
    two.fsm.close()
    # And again after reopening the files (what a restart sees).
    assert _digest(FSM(tmp_path / "one")) == _digest(FSM(tmp_path / "two"))


# ---- compare-and-set entry types (23-32) ------------------------------------------------
def _members(a: Applier, *ids: str) -> None:
    for i, nid in enumerate(ids):
        assert a.apply(C.RegisterMember(MemberRecord(nid, f"127.0.0.1:{9000 + i}"))).ok


def test_checked_create_refuses_an_owner_that_is_not_a_member(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    _members(a, "n1")
    res = a.apply(C.CreateTopicChecked(topic("t"), None, [(0, "n1"), (1, "ghost"), (2, "n1")]))
    assert res.code == C.Result.CHANGED and "ghost" in res.message
    assert a.read().topic("t") is None  # nothing of the entry was kept
    assert a.apply(C.CreateTopicChecked(topic("t"), b"true", [(0, "n1"), (1, "n1"), (2, "n1")])).ok
    r = a.read()
    assert r.topic("t") is not None and sorted(r.assignments("t")) == [0, 1, 2]
    assert [s.version for s in r.schemas("t")] == [1]


def test_cas_update_and_delete_apply_only_to_the_incarnation_read(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    a.apply(C.CreateTopic(topic("t", "00000000000000aa")))
    a.apply(C.DeleteTopic("t"))
    a.apply(C.CreateTopic(topic("t", "00000000000000bb")))
    # An alter and a delete checked against the old incarnation are refused...
    stale_alter = a.apply(C.UpdateTopicCas("t", "00000000000000aa", partitions=5))
    assert stale_alter.code == C.Result.CHANGED and "changed since it was read" in stale_alter.message
    assert a.apply(C.DeleteTopicCas("t", "00000000000000aa")).code == C.Result.CHANGED
    assert a.apply(C.PutSchemaCas("t", "00000000000000aa", 1, b"{}")).code == C.Result.CHANGED
    t = a.read().topic("t")
    assert t is not None and t.id == "00000000000000bb" and t.partitions == 3
    # ...the ones checked against the live incarnation apply.
    assert a.apply(C.UpdateTopicCas("t", "00000000000000bb", partitions=5)).ok
    assert a.apply(C.PutSchemaCas("t", "00000000000000bb", 1, b"{}")).ok
    assert a.read().topic("t").partitions == 5  # type: ignore[union-attr]
    assert a.apply(C.DeleteTopicCas("t", "00000000000000bb")).ok
    assert a.read().topic("t") is None
    assert a.apply(C.DeleteTopicCas("t", "00000000000000bb")).code == C.Result.CHANGED


def test_schema_cas_keeps_the_per_topic_byte_budget(tmp_path: Path) -> None:
    from narad.meta.fsm import SCHEMA_TOPIC_BYTES
    a = Applier(tmp_path / "fsm")
    a.apply(C.CreateTopic(topic("t")))
    big = b" " * (SCHEMA_TOPIC_BYTES // 2)
    assert a.apply(C.PutSchemaCas("t", "00000000000000aa", 1, big)).ok
    assert a.apply(C.PutSchemaCas("t", "00000000000000aa", 2, big)).ok
    over = a.apply(C.PutSchemaCas("t", "00000000000000aa", 3, b"{}"))
    assert over.code == C.Result.INVALID and "bytes of schema versions" in over.message
    # Deleting the topic frees its bytes from the cluster budget.
    a.apply(C.DeleteTopic("t"))
    from narad.meta.fsm import K_SCHEMA_BYTES
    with a.fsm.env.begin() as txn:
        raw = txn.get(K_SCHEMA_BYTES, db=a.fsm.dbs["fsm_meta"])
    assert raw is not None and int.from_bytes(raw, "big") == 0


def test_placement_is_insert_only(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    _members(a, "n1", "n2")
    a.apply(C.CreateTopic(topic("t")))
    assert a.apply(C.PlacePartitions("t", "00000000000000aa", [(0, "n1"), (1, "n2")])).ok
    # A second placement racing the first never replaces an owner: the whole entry is refused.
    res = a.apply(C.PlacePartitions("t", "00000000000000aa", [(2, "n2"), (0, "n2")]))
    assert res.code == C.Result.CHANGED and "already has an owner" in res.message
    owners = {p: rec.owner for p, rec in a.read().assignments("t").items()}
    assert owners == {0: "n1", 1: "n2"}
    assert a.apply(C.PlacePartitions("t", "00000000000000aa", [(2, "n2")])).ok
    assert a.apply(C.PlacePartitions("t", "00000000000000aa", [(3, "n2")])).code == C.Result.INVALID
    assert a.apply(C.PlacePartitions("t", "00000000000000ff", [(2, "n1")])).code == C.Result.CHANGED


def test_prune_deletes_only_orphan_assignment_rows(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    a.apply(C.CreateTopic(topic("t")))
    a.apply(C.AssignPartitions("t", "00000000000000aa", [(0, "n1")]))
    # A row past the topic's partition count, as an older release could leave behind.
    from narad.meta import records as R
    with a.fsm.env.begin(write=True) as txn:
        txn.put(R.part_key("t", 7), R.ENCODER.encode(R.AssignmentRecord("n1", "00000000000000aa")),
                db=a.fsm.dbs["assignments"])
    assert sorted(a.read().assignments("t")) == [0, 7]
    live = a.apply(C.PruneAssignments([("t", 7), ("t", 0)]))
    assert live.code == C.Result.CHANGED and "live partition" in live.message
    assert sorted(a.read().assignments("t")) == [0, 7]
    assert a.apply(C.PruneAssignments([("t", 7)])).ok
    assert sorted(a.read().assignments("t")) == [0]


def test_dead_mark_from_an_observed_heartbeat_loses_to_a_newer_heartbeat(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    _members(a, "n1")
    a.apply(C.Heartbeat("n1", "b", 13), stamp=5000)
    hb = a.read().member("n1").heartbeat_ms  # type: ignore[union-attr]
    a.apply(C.Heartbeat("n1", "b", 13), stamp=9000)  # arrives after the leader judged it silent
    res = a.apply(C.MarkDeadObserved("n1", hb), stamp=9500)
    assert res.code == C.Result.CHANGED
    assert a.read().member("n1").status == "alive"  # type: ignore[union-attr]
    newest = a.read().member("n1").heartbeat_ms  # type: ignore[union-attr]
    assert a.apply(C.MarkDeadObserved("n1", newest), stamp=40000).ok
    assert a.read().member("n1").status == "dead"  # type: ignore[union-attr]


def test_user_delete_releasing_clears_the_owner_of_its_topics(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    a.apply(C.CreateUser(UserRecord("u", b"h")))
    owned = topic("mine")
    owned.owner = "u"
    a.apply(C.CreateTopic(owned))
    a.apply(C.CreateTopic(topic("other", "00000000000000bb")))
    res = a.apply(C.DeleteUserReleasing("u"))
    assert res.ok and "1 topics released" in res.message
    r = a.read()
    assert r.user("u") is None
    mine = r.topic("mine")
    assert mine is not None and mine.owner is None and mine.revision == owned.revision + 1


def test_a_refused_entry_stays_refused_on_replay(tmp_path: Path) -> None:
    """A create refused because the name was taken stores its index like any applied
    entry (here it is the last one before the restart), so a replay skips it; and
    after the topic is deleted, replaying it still cannot make it succeed."""
    a = Applier(tmp_path / "fsm")
    a.apply(C.CreateTopic(topic("t", "00000000000000aa")))
    refused = a.apply(C.CreateTopic(topic("t", "00000000000000bb")))
    assert refused.code == C.Result.EXISTS
    a.fsm.close()
    b = FSM(tmp_path / "fsm")
    assert b.applied_index == 2 and b.index_trusted  # the refusal's own index is on disk
    b.apply(3, enc(C.DeleteTopic("t")))
    b.commit()
    b.close()
    c = FSM(tmp_path / "fsm")
    assert c.apply(2, enc(C.CreateTopic(topic("t", "00000000000000bb")))).message == "already applied"
    c.commit()
    with c.env.begin() as txn:
        assert Reader(txn, c.dbs).topic("t") is None


def test_leftovers_of_an_interrupted_snapshot_or_restore_are_removed(tmp_path: Path) -> None:
    from narad.meta.fsm import remove_leftovers

    meta = tmp_path / "metastore"
    fsm = meta / "fsm"
    FSM(fsm).close()
    snaps = meta / "raft" / "snapshots"
    snaps.mkdir(parents=True)
    (snaps / "latest.snap").write_bytes(b"kept")
    left = [meta / "fsm.restore", meta / "fsm.old", meta / "fsm.snapshot-1a2b", snaps / "latest.snap.tmp",
            snaps / "latest.snap.1.tmp", snaps / "previous.tmp"]
    for p in left:
        if p.suffix == ".tmp":
            p.write_bytes(b"half")
        else:
            p.mkdir()
    remove_leftovers(fsm)
    assert [p for p in left if p.exists()] == []
    assert (snaps / "latest.snap").read_bytes() == b"kept" and (fsm / "data.mdb").exists()


def test_a_key_lmdb_cannot_hold_is_a_refusal_not_a_disk_failure(tmp_path: Path) -> None:
    """An entry whose key LMDB refuses (empty, or past 511 bytes) is refused identically
    on every node; mistaken for a disk error it would stop every node for good."""
    a = Applier(tmp_path / "fsm")
    for bad in ("", "u" * 600):
        res = a.apply(C.ImportMetastore(False, [], [], [], [UserRecord(bad, b"h")]))
        assert res.code == C.Result.INVALID and "refused by the database" in res.message
    assert a.fsm.failed is None
    assert a.apply(C.CreateUser(UserRecord("fine", b"h"))).ok


def test_a_node_applies_a_set_of_entry_types_not_every_number_below_its_newest(tmp_path: Path) -> None:
    """Type numbers are not assigned in release order (27-28 and 33-37 are reserved):
    an FSM stops on a type outside its set even when a higher type is in it, and the
    database records the set of types it applied."""
    from narad.meta.fsm import read_types

    applies = C.APPLIED_TYPES - {C.EntryType.CREATE_TOPIC_CHECKED}
    a = Applier(tmp_path / "fsm")
    a.fsm.applies = applies
    assert a.apply(C.ImportMetastore(False, [], [], [], [])).ok  # 38: in the set
    with pytest.raises(FailStop) as e:
        a.apply(C.CreateTopicChecked(topic("t"), None, []))  # 23: below 38, not in the set
    assert e.value.entry_type == 23 and "not one this node applies" in str(e.value)
    a.fsm.env.close()
    b = FSM(tmp_path / "fsm")
    with b.env.begin() as txn:
        newest, types = read_types(lambda k: txn.get(k, db=b.dbs["fsm_meta"]))
    assert newest == 38 and types == {38}


def test_a_snapshot_copies_the_database_as_of_its_start_while_entries_go_on(tmp_path: Path) -> None:
    """The copy is pinned at the index where it began: entries applied and committed
    while it is written are not in it, so its label stays true; restored, it holds
    that index and is trusted as this file's own."""
    import os
    import threading

    a = Applier(tmp_path / "fsm")
    for i in range(5):
        a.apply(C.CreateTopic(topic(f"before-{i}", f"{i:016x}")))
    txn, index = a.fsm.snapshot_begin()
    for i in range(5):
        a.apply(C.CreateTopic(topic(f"during-{i}", f"{i + 100:016x}")))  # commits while the copy is pending
    image = tmp_path / "image"
    fd = os.open(image, os.O_WRONLY | os.O_CREAT, 0o600)
    t = threading.Thread(target=a.fsm.snapshot_write, args=(fd, txn))
    t.start()
    t.join(10)
    os.close(fd)
    assert index == 5 and a.fsm.applied_index == 10
    b = FSM(tmp_path / "other")
    b.restore_from(str(image), 0, index)
    assert b.applied_index == 5 and b.index_trusted
    with b.env.begin() as txn2:
        r = Reader(txn2, b.dbs)
        assert r.topic("before-4") is not None and r.topic("during-0") is None
