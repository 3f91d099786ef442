"""Fan-out children in the metastore (issue 11): the state machine's rules for entry
types 23 (create-as-child), 27 (attach), 28 (detach), the unlinking delete, the schema
copies and the delay-vs-retention refusal, on real LMDB files; and the metadata
service's rules (status codes, grants, gating, attach point, CAS retry, placement,
epoch confirmation) on one real one-voter Raft group (pysyncobj on 127.0.0.1) shared
by the service tests of this module."""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from narad.config import load_config
from narad.errors import BadRequest, Conflict, Forbidden, NotFound, PreconditionFailed, Unavailable, error_for_status
from narad.meta import commands as C
from narad.meta import fsm as F
from narad.meta import requests as Q
from narad.meta import versions as V
from narad.meta.fsm import FSM
from narad.meta.grants import Identity
from narad.meta.raft import RaftNode
from narad.meta.records import Grant, MemberRecord, TopicRecord, UserRecord
from narad.meta.service import MetaService
from narad.meta.store import MetaStore, Reader
from tests.harness import free_ports

T = TypeVar("T")
OPERATOR = Identity(operator=True)
ALICE = Identity("alice", True, False)
BOB = Identity("bob", True, False)
PID, CID, KID = "00000000000000a1", "00000000000000a2", "00000000000000a3"


# ---- the state machine ------------------------------------------------------------------
def topic(name: str, tid: str, parts: int = 3, retention_ms: int = 0) -> TopicRecord:
    return TopicRecord(name=name, id=tid, partitions=parts, retention_ms=retention_ms, visibility_timeout_ms=30000,
                       max_in_flight_per_partition=1024, max_acked_ahead_per_partition=1024, created_at=100)


class Applier:
    def __init__(self, path: Path) -> None:
        self.touched: list[set[int]] = []
        self.fsm = FSM(path, on_commit=lambda t, i: self.touched.append(t))
        self.index = 0

    def apply(self, payload: msgspec.Struct) -> C.ApplyResult:
        self.index += 1
        res = self.fsm.apply(self.index, C.encode(payload, request_id="", stamp_ms=1000 + self.index))
        self.fsm.commit()
        return res

    def topic(self, name: str) -> TopicRecord:
        with self.fsm.env.begin() as txn:
            t = Reader(txn, self.fsm.dbs).topic(name)
        assert t is not None, name
        return t

    def schemas(self, name: str) -> list[tuple[int, str, bytes]]:
        with self.fsm.env.begin() as txn:
            return [(s.version, s.topic_id, s.schema) for s in Reader(txn, self.fsm.dbs).schemas(name)]

    def schema_bytes(self) -> int:
        with self.fsm.env.begin() as txn:
            raw = txn.get(F.K_SCHEMA_BYTES, db=self.fsm.dbs["fsm_meta"])
        return int.from_bytes(raw, "big") if raw else 0


def attach(parent: str, child: str, pid: str = PID, cid: str = CID, delay: int = 0, parts: int = 3,
           epoch: str = "e0e0e0e0e0e0e0e0") -> C.AttachChildCas:
    return C.AttachChildCas(parent, pid, child, cid, delay, epoch, list(range(parts)))


def refused(res: C.ApplyResult, code: C.Result, text: str) -> bool:
    return res.code == code and text in res.message


def test_attach_links_adopts_the_schema_history_and_bumps_both_names(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    assert a.apply(C.CreateTopic(topic("p", PID), schema=b'{"type": "object"}')).ok
    assert a.apply(C.PutSchema("p", 2, b'{"type": "object", "title": "t"}')).ok
    assert a.apply(C.CreateTopic(topic("c", CID))).ok
    before = a.schema_bytes()
    res = a.apply(attach("p", "c", delay=60_000, epoch="0123456789abcdef"))
    assert res.ok, res.message
    assert {V.TOPICS, V.SCHEMAS, V.name_slot("p"), V.name_slot("c")} <= a.touched[-1]
    p, c = a.topic("p"), a.topic("c")
    assert p.children == ["c"] and p.role == "parent"
    assert (c.parent, c.parent_id, c.delay_ms, c.attach_epoch, c.attach_offsets) == ("p", PID, 60_000,
                                                                                     "0123456789abcdef", [0, 1, 2])
    assert c.role == "child" and c.schema_version == 2
    assert [(v, tid, s) for v, tid, s in a.schemas("c")] == [(v, CID, s) for v, _, s in a.schemas("p")]
    assert a.schema_bytes() == 2 * before  # the adopted copy counts against the budget
    # Children are kept sorted whatever the attach order.
    for name, tid in (("b", "00000000000000b1"), ("d", "00000000000000d1")):
        assert a.apply(C.CreateTopic(topic(name, tid))).ok
        assert a.apply(attach("p", name, cid=tid)).ok
    assert a.topic("p").children == ["b", "c", "d"]


def test_attach_refusals_keep_nothing(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    assert a.apply(C.CreateTopic(topic("p", PID, retention_ms=7_200_000))).ok
    assert a.apply(C.CreateTopic(topic("c", CID))).ok
    assert a.apply(C.CreateTopic(topic("k", KID))).ok
    # Compare-and-set misses: another incarnation of either, an attach point of another shape.
    assert refused(a.apply(attach("p", "c", pid=CID)), C.Result.CHANGED, "changed since it was read")
    assert refused(a.apply(attach("p", "c", cid=PID)), C.Result.CHANGED, "changed since it was read")
    assert refused(a.apply(attach("p", "gone")), C.Result.CHANGED, "it is gone")
    assert refused(a.apply(attach("p", "c", parts=2)), C.Result.CHANGED, "the attach point names 2")
    # Delay vs the parent's retention (2 h keeps a delay of at most 1 h).
    assert refused(a.apply(attach("p", "c", delay=3_600_001)), C.Result.INVALID, "plus 1 h")
    assert a.apply(attach("p", "c", delay=3_600_000)).ok
    assert refused(a.apply(attach("p", "c")), C.Result.INVALID, "already has a parent")
    assert refused(a.apply(attach("c", "k", pid=CID, cid=KID)), C.Result.INVALID, 'topic "c" is a child of "p"')
    assert refused(a.apply(attach("k", "p", pid=KID, cid=PID)), C.Result.INVALID, 'topic "p" has children')
    assert refused(a.apply(attach("p", "p", cid=PID)), C.Result.INVALID, "its own child")
    assert refused(a.apply(attach("p", "k", cid=KID, delay=F.MAX_DELAY_MS + 1)), C.Result.INVALID, "1 year")
    assert a.topic("k").parent is None and a.topic("p").children == ["c"]
    # Schemas: a child with a schema under a schemaless parent, and differing histories.
    assert a.apply(C.PutSchema("k", 1, b'{"type": "string"}')).ok
    assert refused(a.apply(attach("p", "k", cid=KID)), C.Result.INVALID, "has a schema and its parent")
    assert a.apply(C.CreateTopic(topic("q", "00000000000000f1"), schema=b'{"type":"object","title":"a"}')).ok
    differs = a.apply(attach("q", "k", pid="00000000000000f1", cid=KID))
    assert refused(differs, C.Result.INVALID, "differs from the schema history")
    # The same history spelled differently (key order, whitespace, number spelling) links.
    assert a.apply(C.CreateTopic(topic("s", "00000000000000f2"), schema=b'{"maxLength": 1.0, "type": "string"}')).ok
    assert a.apply(C.CreateTopic(topic("z", "00000000000000f3"), schema=b'{ "type" : "string", "maxLength": 1e0}')).ok
    assert a.apply(attach("s", "z", pid="00000000000000f2", cid="00000000000000f3")).ok
    assert a.topic("z").schema_version == 1
    assert F.json_same(True, True) and not F.json_same(True, 1) and not F.json_same(0, False)
    # 108 children at most.
    assert a.apply(C.CreateTopic(topic("big", "00000000000000e1"))).ok
    for i in range(F.MAX_CHILDREN):
        assert a.apply(C.CreateTopic(topic(f"ch{i:03}", f"{i:016x}"))).ok
        assert a.apply(attach("big", f"ch{i:03}", pid="00000000000000e1", cid=f"{i:016x}")).ok
    assert a.apply(C.CreateTopic(topic("one-more", "00000000000000e2"))).ok
    over = a.apply(attach("big", "one-more", pid="00000000000000e1", cid="00000000000000e2"))
    assert refused(over, C.Result.INVALID, "already has 108 children")
    assert a.topic("one-more").parent is None and len(a.topic("big").children) == F.MAX_CHILDREN


def test_an_adopted_history_counts_against_the_cluster_budget(tmp_path: Path, monkeypatch: Any) -> None:
    a = Applier(tmp_path / "fsm")
    doc = b'{"type": "object", "title": "' + b"x" * 100 + b'"}'
    assert a.apply(C.CreateTopic(topic("p", PID), schema=doc)).ok
    assert a.apply(C.CreateTopic(topic("c", CID))).ok
    monkeypatch.setattr(F, "SCHEMA_CLUSTER_BYTES", len(doc) * 2 - 1)
    assert refused(a.apply(attach("p", "c")), C.Result.INVALID, "bytes of schema versions")
    assert a.topic("c").parent is None and a.schemas("c") == []
    monkeypatch.setattr(F, "SCHEMA_CLUSTER_BYTES", len(doc) * 2)
    assert a.apply(attach("p", "c")).ok
    # A parent's new version is copied to each child: the budget counts every copy.
    new = doc.replace(b"object", b"string")
    monkeypatch.setattr(F, "SCHEMA_CLUSTER_BYTES", len(doc) * 2 + len(new) * 2 - 1)
    assert refused(a.apply(C.PutSchemaCas("p", PID, 2, new)), C.Result.INVALID, "bytes of schema versions")
    monkeypatch.setattr(F, "SCHEMA_CLUSTER_BYTES", len(doc) * 2 + len(new) * 2)
    assert a.apply(C.PutSchemaCas("p", PID, 2, new)).ok
    assert [v for v, _, _ in a.schemas("c")] == [1, 2] and a.schema_bytes() == len(doc) * 2 + len(new) * 2


def test_a_childs_own_budgets_and_name_length_refuse_the_link(tmp_path: Path, monkeypatch: Any) -> None:
    a = Applier(tmp_path / "fsm")
    assert a.apply(C.CreateTopic(topic("p", PID), schema=b'{"type": "object"}')).ok
    long = "l" * (F.CHILD_NAME_BYTES + 1)  # a legacy name (an import) longer than a child may have
    assert a.apply(C.CreateTopic(topic(long, CID))).ok
    assert refused(a.apply(attach("p", long)), C.Result.INVALID, f"longer than {F.CHILD_NAME_BYTES} bytes")
    assert a.apply(C.CreateTopic(topic("c", KID))).ok
    assert a.apply(attach("p", "c", cid=KID)).ok
    # The child's copy of a new parent version counts against the child's own budget...
    monkeypatch.setattr(F, "SCHEMA_TOPIC_BYTES", len(b'{"type": "object"}') + 1)
    monkeypatch.setattr(F, "SCHEMA_CLUSTER_BYTES", 1 << 30)
    with a.fsm.env.begin(write=True) as txn:  # the parent's own history is smaller than the child's
        a.fsm._drop_prefix(txn, "schemas", b"p\0")
    assert refused(a.apply(C.PutSchemaCas("p", PID, 2, b"{}")), C.Result.INVALID, 'topic "c" would hold more')
    # ...and its version cap.
    monkeypatch.setattr(F, "SCHEMA_TOPIC_BYTES", 1 << 30)
    monkeypatch.setattr(F, "SCHEMA_VERSION_CAP", 2)
    with a.fsm.env.begin(write=True) as txn:
        t = Reader(txn, a.fsm.dbs).topic("c")
        assert t is not None
        t.schema_version = 2
        txn.put(b"c", msgspec.msgpack.encode(t), db=a.fsm.dbs["topics"])
    assert refused(a.apply(C.PutSchema("p", 2, b"{}")), C.Result.INVALID, 'child "c" keeps at most 2')
    assert a.topic("p").schema_version == 1


def test_schema_appends_on_a_parent_reach_every_child_and_a_child_refuses_its_own(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    assert a.apply(C.CreateTopic(topic("p", PID))).ok
    for name, tid in (("c", CID), ("k", KID)):
        assert a.apply(C.CreateTopic(topic(name, tid))).ok
        assert a.apply(attach("p", name, cid=tid)).ok
    assert a.apply(C.PutSchemaCas("p", PID, 1, b'{"type": "object"}')).ok
    assert a.apply(C.PutSchema("p", 2, b"{}")).ok  # the base type copies too
    assert {V.name_slot("c"), V.name_slot("k"), V.name_slot("p")} <= a.touched[-1]
    for name, tid in (("c", CID), ("k", KID)):
        assert a.schemas(name) == [(1, tid, b'{"type": "object"}'), (2, tid, b"{}")]
        assert a.topic(name).schema_version == 2
    own = a.apply(C.PutSchemaCas("c", CID, 3, b"true"))
    assert refused(own, C.Result.INVALID, 'the schema of "c" is managed by its parent "p"')
    assert a.topic("c").schema_version == 2


def test_detach_and_deletes_unlink_and_the_child_keeps_its_history(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    assert a.apply(C.CreateTopic(topic("p", PID), schema=b"{}")).ok
    for name, tid in (("c", CID), ("k", KID), ("m", "00000000000000a4")):
        assert a.apply(C.CreateTopic(topic(name, tid))).ok
        assert a.apply(attach("p", name, cid=tid)).ok
    assert refused(a.apply(C.DetachChildCas("p", CID, "c", CID)), C.Result.CHANGED, "changed since it was read")
    assert refused(a.apply(C.DetachChildCas("c", CID, "k", KID)), C.Result.CHANGED, "is not a child of")
    assert a.apply(C.DetachChildCas("p", PID, "c", CID)).ok
    assert {V.TOPICS, V.name_slot("p"), V.name_slot("c")} <= a.touched[-1]
    c = a.topic("c")
    assert (c.parent, c.parent_id, c.delay_ms, c.attach_epoch, c.attach_offsets, c.role) == (None, None, 0, None,
                                                                                             [], None)
    assert c.schema_version == 1 and a.schemas("c") == [(1, CID, b"{}")]
    assert a.topic("p").children == ["k", "m"]
    assert refused(a.apply(C.DetachChildCas("p", PID, "c", CID)), C.Result.CHANGED, "is not a child of")
    # Deleting a child takes it off its parent's list; deleting the parent frees the rest.
    assert a.apply(C.DeleteTopicCas("m", "00000000000000a4")).ok
    assert a.topic("p").children == ["k"]
    assert a.apply(C.DeleteTopic("p")).ok
    k = a.topic("k")
    assert k.parent is None and k.role is None and k.schema_version == 1
    assert V.name_slot("k") in a.touched[-1]


def test_create_as_child_links_in_the_same_entry(tmp_path: Path) -> None:
    a = Applier(tmp_path / "fsm")
    assert a.apply(C.RegisterMember(MemberRecord("n1", "127.0.0.1:1"))).ok
    assert a.apply(C.CreateTopic(topic("p", PID, parts=4, retention_ms=7_200_000), schema=b'{"type":"object"}')).ok

    def child(name: str, **kw: Any) -> TopicRecord:
        fields: dict[str, Any] = {"parent": "p", "parent_id": PID, "attach_epoch": "ab" * 8,
                                  "attach_offsets": [5, 6, 7, 8], **kw}
        return msgspec.structs.replace(topic(name, KID, parts=4), **fields)

    assert refused(a.apply(C.CreateTopicChecked(child("c", parent_id=CID))), C.Result.CHANGED, "changed")
    assert refused(a.apply(C.CreateTopicChecked(child("c", attach_offsets=[0]))), C.Result.CHANGED, "names 1")
    assert refused(a.apply(C.CreateTopicChecked(child("c", delay_ms=3_600_001))), C.Result.INVALID, "plus 1 h")
    assert refused(a.apply(C.CreateTopicChecked(child("c"), b'{"type":"string"}')), C.Result.INVALID, "differs")
    with a.fsm.env.begin() as txn:
        assert Reader(txn, a.fsm.dbs).topic("c") is None  # nothing of a refused create is kept
    res = a.apply(C.CreateTopicChecked(child("c", delay_ms=3_600_000, children=["x"]), b'{ "type": "object" }',
                                       [(0, "n1"), (1, "n1"), (2, "n1"), (3, "n1")]))
    assert res.ok, res.message
    assert {V.name_slot("p"), V.name_slot("c"), V.SCHEMAS} <= a.touched[-1]
    c = a.topic("c")
    assert (c.parent, c.delay_ms, c.attach_offsets, c.children, c.schema_version) == ("p", 3_600_000, [5, 6, 7, 8],
                                                                                      [], 1)
    assert a.schemas("c") == [(1, KID, b'{"type":"object"}')]  # the parent's history, not the create's copy
    assert a.topic("p").children == ["c"]
    # A schemaless parent takes no child with a schema.
    assert a.apply(C.CreateTopic(topic("bare", "00000000000000b0"))).ok
    bare = child("c2", parent="bare", parent_id="00000000000000b0", attach_offsets=[0, 0, 0])
    assert refused(a.apply(C.CreateTopicChecked(bare, b"{}")), C.Result.INVALID, "has none")
    # Type 2 never links (a release without fan-out drops those fields too).
    assert a.apply(C.CreateTopic(child("plain"))).ok
    assert a.topic("plain").parent is None and a.topic("p").children == ["c"]
    # The parent's retention may not shrink below the delay child's delay + 1 h (type 24).
    shrink = a.apply(C.UpdateTopicCas("p", PID, retention_ms=7_199_999))
    assert refused(shrink, C.Result.INVALID, 'the retention of "p"')
    assert a.topic("p").retention_ms == 7_200_000
    assert a.apply(C.UpdateTopicCas("p", PID, retention_ms=0)).ok


# ---- the metadata service, on one shared one-voter Raft group --------------------------------
class RacingMeta(MetaService):
    """Before each of the first ``races`` attach entries reaches Raft, the child is
    deleted and created again (a new incarnation)."""

    races = 0
    grow_parent = False  # instead: the parent gains a partition between the read and the apply

    async def write(self, payload: msgspec.Struct, *args: Any, **kw: Any) -> C.ApplyResult:
        if self.grow_parent and isinstance(payload, C.AttachChildCas):
            self.grow_parent = False
            with self.store.read() as r:
                par = r.topic(payload.parent)
            assert par is not None
            assert (await super().write(C.UpdateTopicCas(par.name, par.id, partitions=par.partitions + 1))).ok
        if self.races and isinstance(payload, C.AttachChildCas):
            self.races -= 1
            with self.store.read() as r:
                old = r.topic(payload.child)
            assert old is not None
            assert (await super().write(C.DeleteTopic(old.name))).ok
            fresh = msgspec.structs.replace(old, id=os.urandom(8).hex())
            assert (await super().write(C.CreateTopic(fresh))).ok
        return await super().write(payload, *args, **kw)


class Node:
    def __init__(self, tmp: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.cfg = load_config(os.devnull, env={})
        self.versions = V.VersionTable.create(f"/narad-fanout-{os.getpid()}-{time.monotonic_ns()}")
        self.fsm = FSM(tmp / "fsm")
        self.store = MetaStore(tmp / "fsm", self.versions, fsm=self.fsm)
        (port,) = free_ports(1)
        self.raft = RaftNode(self_addr=f"127.0.0.1:{port}", peers=[], raft_dir=tmp / "raft", sm=self.fsm,
                             loop=self.loop, password=None, bind_host="127.0.0.1")
        self.raft.start([])
        self.meta = RacingMeta(self.cfg, self.raft, self.store, "n1")
        self.run(self._ready())

    async def _ready(self) -> None:
        deadline = time.monotonic() + 15
        while not self.raft.is_leader():
            assert time.monotonic() < deadline, "no leader"
            await asyncio.sleep(0.02)
        every = sorted(C.APPLIED_TYPES)
        for nid, addr in (("n1", self.raft.self_addr), ("n2", "127.0.0.1:2")):
            assert (await self.meta.write(C.RegisterMember(MemberRecord(nid, addr, newest_entry_type=38,
                                                                        entry_types=every)))).ok
        for name in ("alice", "bob"):
            user = UserRecord(name, b"h", [Grant("create", ["*"])])
            assert (await self.meta.write(C.CreateUser(user))).ok

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def topic(self, name: str) -> TopicRecord | None:
        with self.store.read() as r:
            return r.topic(name)

    def create(self, name: str, who: Identity = OPERATOR, **kw: Any) -> TopicRecord:
        return self.run(self.meta.create_topic(Q.CreateTopicReq(who=who, name=name, **kw)))

    def point(self, parent: str) -> tuple[str, list[int]]:
        """What the receiving node asks the parent's partition owners for."""
        par = self.topic(parent)
        assert par is not None
        return par.id, [0] * par.partitions

    def attach(self, parent: str, child: str, delay: int = 0, who: Identity = OPERATOR, **kw: Any) -> TopicRecord:
        pid, offsets = self.point(parent) if self.topic(parent) else ("", [])
        fields: dict[str, Any] = {"parent_id": pid, "attach_offsets": offsets, **kw}
        return self.run(self.meta.attach_child(Q.AttachChildReq(who, parent, child, delay, **fields)))

    def create_child(self, name: str, parent: str, who: Identity = OPERATOR, **kw: Any) -> TopicRecord:
        pid, offsets = self.point(parent)
        fields: dict[str, Any] = {"parent_id": pid, "attach_offsets": offsets, **kw}
        return self.create(name, who, parent=parent, **fields)

    def close(self) -> None:
        self.raft.close()
        self.fsm.close()
        self.versions.close()
        self.loop.close()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("fanout-meta"))
    try:
        yield n
    finally:
        n.close()


def test_service_attach_answers_the_parent_and_refuses_with_the_documented_codes(node: Node) -> None:
    node.create("sa-p", retention_ms=7_200_000)
    node.create("sa-c")
    node.create("sa-k")
    # 400: same name, delay out of range, child missing from the request.
    for bad in ({"child": "sa-p"}, {"child": "sa-c", "delay": -1}, {"child": "sa-c", "delay": F.MAX_DELAY_MS + 1},
                {"child": ""}):
        with pytest.raises(BadRequest):
            node.attach("sa-p", bad["child"], bad.get("delay", 0))  # type: ignore[arg-type]
    # 404: either side missing.
    with pytest.raises(NotFound, match='"sa-none"'):
        node.attach("sa-p", "sa-none")
    with pytest.raises(NotFound, match='"sa-none"'):
        node.attach("sa-none", "sa-c")
    # 409: delay the parent's retention cannot hold (2 h keeps at most a 1 h delay).
    with pytest.raises(Conflict, match="plus 1 h"):
        node.attach("sa-p", "sa-c", 3_600_001)
    # 503: an attach point read from another incarnation or shape; none at all.
    for kw in ({"parent_id": "ffffffffffffffff"}, {"attach_offsets": [0]}):
        with pytest.raises(Unavailable, match="parent changed while the attach point was read; retry"):
            node.attach("sa-p", "sa-c", **kw)
    with pytest.raises(Unavailable, match="could not ask the owners of every partition"):
        node.attach("sa-p", "sa-c", parent_id="", attach_offsets=[])
    assert node.topic("sa-c").parent is None  # type: ignore[union-attr]
    parent = node.attach("sa-p", "sa-c", 3_600_000)
    assert parent.name == "sa-p" and parent.children == ["sa-c"] and parent.role == "parent"
    child = node.topic("sa-c")
    assert child is not None and child.parent == "sa-p" and child.parent_id == parent.id
    assert child.delay_ms == 3_600_000 and child.attach_offsets == [0, 0, 0]
    assert child.attach_epoch is not None and re.fullmatch(r"[0-9a-f]{16}", child.attach_epoch)
    # 409: the fan-out rules.
    with pytest.raises(Conflict, match="already has a parent"):
        node.attach("sa-k", "sa-c")
    with pytest.raises(Conflict, match='"sa-c" is a child of "sa-p"'):
        node.attach("sa-c", "sa-k")
    with pytest.raises(Conflict, match='"sa-p" has children'):
        node.attach("sa-k", "sa-p")
    # The parent's retention cannot shrink below its delay child's delay + 1 h.
    with pytest.raises(Conflict, match='the retention of "sa-p"'):
        node.run(node.meta.alter_topic(Q.AlterTopicReq(who=OPERATOR, name="sa-p", retention_ms=3_600_000)))
    assert node.topic("sa-p").retention_ms == 7_200_000  # type: ignore[union-attr]
    # The same request run again after a leader change answers what it did.
    node.create("sa-r")
    pid, offsets = node.point("sa-p")
    req = Q.AttachChildReq(OPERATOR, "sa-p", "sa-r", 0, pid, offsets)
    first = node.run(node.meta.dispatch_as(req, "attach-1"))
    again = node.run(node.meta.dispatch_as(req, "attach-1"))
    assert isinstance(again, TopicRecord) and again.children == first.children == ["sa-c", "sa-r"]  # type: ignore[attr-defined]


def test_service_schema_rules_of_children(node: Node) -> None:
    node.create("ss-p", schema=b'{"type": "object"}')
    node.create("ss-plain")
    node.create("ss-own", schema=b'{"type": "string"}')
    with pytest.raises(Conflict, match="differs from the schema history"):
        node.attach("ss-p", "ss-own")
    with pytest.raises(Conflict, match='"ss-own" has a schema and its parent "ss-plain" has none'):
        node.attach("ss-plain", "ss-own")
    node.attach("ss-p", "ss-plain")
    adopted = node.topic("ss-plain")
    assert adopted is not None and adopted.schema_version == 1
    with pytest.raises(Conflict, match='the schema of "ss-plain" is managed by its parent "ss-p"'):
        node.run(node.meta.alter_topic(Q.AlterTopicReq(who=OPERATOR, name="ss-plain", schema=b"{}")))
    # A change on the parent reaches the child.
    node.run(node.meta.alter_topic(Q.AlterTopicReq(who=OPERATOR, name="ss-p",
                                                   schema=b'{"type": "object", "properties": {}}')))
    with node.store.read() as r:
        assert [s.version for s in r.schemas("ss-plain")] == [1, 2]
    # Create-as-child: a differing schema is refused; the parent's own is accepted.
    with pytest.raises(Conflict, match="differs from the schema of its parent"):
        node.create_child("ss-new", "ss-p", schema=b'{"type": "string"}')
    assert node.topic("ss-new") is None
    made = node.create_child("ss-new", "ss-p", schema=b'{"properties": {}, "type": "object"}')
    assert made.schema_version == 2


def test_service_grants_of_attach_detach_and_create_as_child(node: Node) -> None:
    node.create("sg-alice", ALICE)
    node.create("sg-alice2", ALICE)
    node.create("sg-bob", BOB)
    with pytest.raises(Forbidden, match='only the owner of topic "sg-bob" or an admin may modify it'):
        node.attach("sg-alice", "sg-bob", who=ALICE)
    with pytest.raises(Forbidden, match='only the owner of topic "sg-bob" or an admin may modify it'):
        node.attach("sg-bob", "sg-alice", who=ALICE)
    with pytest.raises(Forbidden, match='topic "sg-bob"'):
        node.create_child("sg-new", "sg-bob", who=ALICE)
    assert node.topic("sg-new") is None
    with pytest.raises(Forbidden, match="caller unknown"):
        node.attach("sg-alice", "sg-alice2", who=Identity("mallory", True, False))
    node.attach("sg-alice", "sg-alice2", who=ALICE)
    # Detach: manage rights on either side suffice; neither -> 403; not linked -> 404.
    with pytest.raises(Forbidden, match="may detach them"):
        node.run(node.meta.detach_child(Q.DetachChildReq(BOB, "sg-alice", "sg-alice2")))
    with pytest.raises(NotFound, match='"sg-bob" is not a child of "sg-alice"'):
        node.run(node.meta.detach_child(Q.DetachChildReq(ALICE, "sg-alice", "sg-bob")))
    node.create_child("sg-bobs-child", "sg-bob", who=BOB)
    node.run(node.meta.detach_child(Q.DetachChildReq(BOB, "sg-bob", "sg-bobs-child")))
    node.run(node.meta.detach_child(Q.DetachChildReq(ALICE, "sg-alice", "sg-alice2")))
    kept = node.topic("sg-alice2")
    assert kept is not None and kept.parent is None and node.topic("sg-alice").children == []  # type: ignore[union-attr]
    with pytest.raises(NotFound, match="is not a child of"):
        node.run(node.meta.detach_child(Q.DetachChildReq(ALICE, "sg-alice", "sg-alice2")))


def test_service_create_as_child_takes_the_parent_count_and_avoids_its_owners(node: Node) -> None:
    node.create("sc-p", partitions=6)
    with pytest.raises(BadRequest, match="fanout_delay_ms needs parent"):
        node.create("sc-x", fanout_delay_ms=5)
    with pytest.raises(BadRequest, match="own parent"):
        node.create_child("sc-p", "sc-p")
    with pytest.raises(NotFound, match='"sc-none"'):
        node.create("sc-x", parent="sc-none", parent_id="0" * 16, attach_offsets=[0, 0, 0])
    with pytest.raises(BadRequest, match="fanout_delay_ms must be between"):
        node.create_child("sc-x", "sc-p", fanout_delay_ms=F.MAX_DELAY_MS + 1)
    with pytest.raises(Unavailable, match="parent changed while the attach point was read"):
        node.create("sc-x", parent="sc-p", parent_id=node.topic("sc-p").id, attach_offsets=[0])  # type: ignore[union-attr]
    # The parent's owners in blocks: a plain round-robin of the child always lands
    # at least one partition on its parent partition's owner, whatever its start.
    pid = node.topic("sc-p").id  # type: ignore[union-attr]
    blocks = [(p, "n1" if p < 3 else "n2") for p in range(6)]
    assert node.run(node.meta.write(C.AssignPartitions("sc-p", pid, blocks))).ok
    child = node.create_child("sc-c", "sc-p", fanout_delay_ms=1000)
    assert child.partitions == 6 and child.parent == "sc-p" and child.delay_ms == 1000
    assert node.topic("sc-p").children == ["sc-c"]  # type: ignore[union-attr]
    with node.store.read() as r:
        parent_owners = {p: a.owner for p, a in r.assignments("sc-p").items()}
        child_owners = {p: a.owner for p, a in r.assignments("sc-c").items()}
    assert sorted(parent_owners) == sorted(child_owners) == list(range(6))
    assert all(child_owners[p] != parent_owners[p] for p in range(6)), (parent_owners, child_owners)
    assert sorted(child_owners.values()) == ["n1"] * 3 + ["n2"] * 3  # still spread evenly
    # The controller's path (partitions with no owner on record) avoids them too.
    assert (node.run(node.meta.write(C.UpdateTopicCas("sc-p", pid, partitions=8)))).ok
    assert (node.run(node.meta.write(C.UpdateTopicCas("sc-c", child.id, partitions=8)))).ok
    assert node.run(node.meta.write(C.AssignPartitions("sc-p", pid, [(6, "n1"), (7, "n1")]))).ok
    assert node.run(node.meta.place_partitions("sc-c", child.id, [6, 7]))
    with node.store.read() as r:
        pa, ca = r.assignments("sc-p"), r.assignments("sc-c")
    assert all(ca[p].owner != pa[p].owner for p in (6, 7))
    # An explicit partition count is kept.
    assert node.create_child("sc-c3", "sc-p", partitions=3).partitions == 3


def test_service_cas_retry_once_then_409(node: Node) -> None:
    node.create("sr-p")
    node.create("sr-c")
    node.meta.races = 1  # the child is recreated once between the read and the apply
    assert node.attach("sr-p", "sr-c").children == ["sr-c"]
    node.create("sr-d")
    node.meta.races = 2
    with pytest.raises(Conflict, match="topic changed since it was read") as e:
        node.attach("sr-p", "sr-d")
    assert e.value.code == "topic_changed" and node.topic("sr-d").parent is None  # type: ignore[union-attr]
    assert node.meta.races == 0
    # The parent grew after the receiving node read the attach point: the point no
    # longer covers every partition, so nothing is linked and the caller asks again.
    node.meta.grow_parent = True
    with pytest.raises(Unavailable, match="parent changed while the attach point was read; retry"):
        node.attach("sr-p", "sr-d")
    assert node.topic("sr-p").partitions == 4 and node.topic("sr-d").parent is None  # type: ignore[union-attr]


def test_service_gating_names_the_member_holding_the_type_back(node: Node) -> None:
    node.create("sgate-p")
    node.create("sgate-c")
    node.create("sgate-l")
    node.attach("sgate-p", "sgate-l")
    old = sorted(C.APPLIED_TYPES - {23, 27, 28})
    assert node.run(node.meta.write(C.RegisterMember(MemberRecord("n-old", "127.0.0.1:3", build="v-old",
                                                                  newest_entry_type=38, entry_types=old)))).ok
    try:
        with pytest.raises(PreconditionFailed, match="raft entry type 27: member n-old") as e:
            node.attach("sgate-p", "sgate-c")
        assert e.value.status == 412
        with pytest.raises(PreconditionFailed, match="raft entry type 28: member n-old"):
            node.run(node.meta.detach_child(Q.DetachChildReq(OPERATOR, "sgate-p", "sgate-l")))
        with pytest.raises(PreconditionFailed, match="raft entry type 23: member n-old"):
            node.create_child("sgate-new", "sgate-p")
        assert node.topic("sgate-new") is None and node.topic("sgate-l").parent == "sgate-p"  # type: ignore[union-attr]
        assert isinstance(error_for_status(412, "x"), PreconditionFailed)  # the status crosses RPC as itself
        assert node.topic("sgate-c").parent is None  # type: ignore[union-attr]
    finally:
        every = sorted(C.APPLIED_TYPES)
        assert node.run(node.meta.write(C.Heartbeat("n-old", "v-new", 38, entry_types=every))).ok
    assert node.attach("sgate-p", "sgate-c").children == ["sgate-c", "sgate-l"]


def test_service_confirm_epoch_answers_only_a_definite_link(node: Node) -> None:
    node.create("se-p")
    node.create("se-c")
    node.attach("se-p", "se-c")
    c, p = node.topic("se-c"), node.topic("se-p")
    assert c is not None and p is not None and c.attach_epoch
    ask = Q.ConfirmEpochReq("se-p", p.id, "se-c", c.id, c.attach_epoch)
    assert node.run(node.meta.dispatch(ask)) == Q.ConfirmEpochResp(linked=True, known=True)
    for stale in (msgspec.structs.replace(ask, epoch="0" * 16), msgspec.structs.replace(ask, child_id="0" * 16),
                  msgspec.structs.replace(ask, parent_id="0" * 16)):
        assert node.run(node.meta.confirm_epoch(stale)) == Q.ConfirmEpochResp(linked=False, known=True)
    node.run(node.meta.detach_child(Q.DetachChildReq(OPERATOR, "se-p", "se-c")))
    assert node.run(node.meta.confirm_epoch(ask)) == Q.ConfirmEpochResp(linked=False, known=True)

    class Follower:  # what a node that does not lead (or just lost it) reports
        def is_leader(self) -> bool:
            return False

    follower = MetaService(node.cfg, Follower(), node.store, "n2")  # type: ignore[arg-type]
    assert node.run(follower.confirm_epoch(ask)) == Q.ConfirmEpochResp(linked=False, known=False)


# ---- routing through a real supervisor ------------------------------------------------------
def test_the_supervisor_routes_fanout_requests_and_answers_caught_up_itself(tmp_path: Path) -> None:
    """What a worker sends over the supervisor's worker socket: CaughtUpReq answered
    from the node's own Raft replica, attach/detach/confirm-epoch run on the leader,
    each answered with its own type; a refusal crosses with its status."""
    from narad.ipc import rpc
    from tests.harness import Node as ProcNode

    proc = ProcNode(tmp_path / "n1", workers=1, security=False).start()
    try:
        async def main() -> None:
            conn = await rpc.connect_unix(str(proc.runtime_dir / "worker.sock"))
            try:
                deadline = time.monotonic() + 20
                while not (await conn.call(Q.CaughtUpReq(), Q.CaughtUpResp)).caught_up:
                    assert time.monotonic() < deadline, "never caught up"
                    await asyncio.sleep(0.05)
                anyone = Identity(None, False, False)
                p = await conn.call(Q.CreateTopicReq(who=anyone, name="rt-p"), TopicRecord)
                c = await conn.call(Q.CreateTopicReq(who=anyone, name="rt-c"), TopicRecord)
                with pytest.raises(NotFound, match='"rt-none"'):
                    await conn.call(Q.AttachChildReq(anyone, "rt-p", "rt-none", 0, p.id, [0] * 3), TopicRecord)
                parent = await conn.call(Q.AttachChildReq(anyone, "rt-p", "rt-c", 0, p.id, [0] * 3), TopicRecord)
                assert parent.children == ["rt-c"]
                kid = await conn.call(Q.CreateTopicReq(who=anyone, name="rt-k", parent="rt-p", parent_id=p.id,
                                                       attach_offsets=[0] * 3), TopicRecord)
                assert kid.parent == "rt-p" and kid.attach_epoch
                ask = Q.ConfirmEpochReq("rt-p", p.id, "rt-k", kid.id, kid.attach_epoch)
                assert await conn.call(ask, Q.ConfirmEpochResp) == Q.ConfirmEpochResp(True, True)
                assert isinstance(await conn.call(Q.DetachChildReq(anyone, "rt-p", "rt-c"), Q.Empty), Q.Empty)
                with pytest.raises(NotFound, match="is not a child of"):
                    await conn.call(Q.DetachChildReq(anyone, "rt-p", "rt-c"), Q.Empty)
                assert proc.get("/v1/topics/rt-c").json()["id"] == c.id
            finally:
                conn.close()

        asyncio.run(main())
        # naradctl over the control socket: the attach point asked over node RPC.
        proc.ctl("topics", "create", "rt-x")
        out = proc.ctl("topics", "attach", "rt-p", "rt-x", "--delay-ms", "1000")
        assert out["name"] == "rt-p" and "rt-x" in out["children"]
        proc.ctl("topics", "detach", "rt-p", "rt-x")
        assert proc.get("/v1/topics/rt-p").json()["children"] == ["rt-k"]
    finally:
        proc.close()
