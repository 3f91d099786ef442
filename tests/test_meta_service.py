"""The metadata manager (MetaService) in process, on a real one-voter Raft group
(pysyncobj on 127.0.0.1, real journal and LMDB files): a compare-and-set write
refused because the topic changed between read and apply is read again and
retried once; a second refusal answers 409 topic_changed."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from narad.config import load_config
from narad.errors import BadRequest, Conflict, NotFound, Unavailable
from narad.meta import commands as C
from narad.meta import requests as Q
from narad.meta import versions as V
from narad.meta.fsm import FSM
from narad.meta.grants import Identity
from narad.meta.raft import RaftNode
from narad.meta.records import MemberRecord, TopicRecord
from narad.meta.service import MetaService
from narad.meta.store import MetaStore
from tests.harness import free_ports

OPERATOR = Identity(operator=True)


class RacingMeta(MetaService):
    """Before each of the first ``races`` topic writes reaches Raft, another writer
    deletes the topic and creates a new incarnation of it."""

    races = 0
    raced = 0

    async def write(self, payload: msgspec.Struct, *args: Any, **kw: Any) -> C.ApplyResult:
        if self.raced < self.races and isinstance(payload, (C.UpdateTopicCas, C.DeleteTopicCas)):
            self.raced += 1
            name = payload.name
            with self.store.read() as r:
                old = r.topic(name)
            assert old is not None
            assert (await super().write(C.DeleteTopic(name))).ok
            fresh = msgspec.structs.replace(old, id=f"{self.raced:016x}", partitions=old.partitions)
            assert (await super().write(C.CreateTopic(fresh))).ok
        return await super().write(payload, *args, **kw)


async def _service(tmp: Path, fsm_type: type[FSM] = FSM) -> tuple[RacingMeta, RaftNode, Any, V.VersionTable]:
    """A MetaService (racing nothing until told) on a one-voter Raft group that leads."""
    loop = asyncio.get_running_loop()
    cfg = load_config(os.devnull, env={})
    versions = V.VersionTable.create(f"/narad-test-{os.getpid()}-{time.monotonic_ns()}")
    fsm = fsm_type(tmp / "fsm")
    store = MetaStore(tmp / "fsm", versions, fsm=fsm)
    (port,) = free_ports(1)
    raft = RaftNode(self_addr=f"127.0.0.1:{port}", peers=[], raft_dir=tmp / "raft", sm=fsm, loop=loop,
                    password=None, bind_host="127.0.0.1")
    raft.start([])
    deadline = time.monotonic() + 10
    while not raft.is_leader():
        assert time.monotonic() < deadline, "no leader"
        await asyncio.sleep(0.02)
    meta = RacingMeta(cfg, raft, store, "n1")
    return meta, raft, fsm, versions


def _topic(name: str) -> TopicRecord:
    return TopicRecord(name=name, id="00000000000000aa", partitions=2, retention_ms=0, visibility_timeout_ms=30000,
                       max_in_flight_per_partition=1024, max_acked_ahead_per_partition=1024, created_at=1)


@pytest.mark.parametrize(("races", "outcome"), [(1, "applied"), (2, "409")])
def test_a_cas_alter_raced_once_is_retried_and_twice_answers_409(tmp_path: Path, races: int, outcome: str) -> None:
    async def main() -> None:
        meta, raft, fsm, versions = await _service(tmp_path)
        try:
            assert meta.use_type(C.EntryType.UPDATE_TOPIC_CAS)  # one voter, this build: CAS types in use
            assert (await meta.write(C.CreateTopic(_topic("t")))).ok
            meta.races = races
            req = Q.AlterTopicReq(who=OPERATOR, name="t", retention_ms=7_200_000)
            if outcome == "applied":
                rec = await meta.alter_topic(req)
                assert rec.retention_ms == 7_200_000 and rec.id == f"{1:016x}"  # the incarnation read again
            else:
                with pytest.raises(Conflict) as e:
                    await meta.alter_topic(req)
                assert e.value.code == "topic_changed" and "changed since it was read" in str(e.value)
                with meta.store.read() as r:
                    t = r.topic("t")
                assert t is not None and t.retention_ms == 0  # neither attempt applied
            assert meta.raced == races
        finally:
            raft.close()
            fsm.close()
            versions.close()

    asyncio.run(main())


def test_a_cas_delete_raced_once_deletes_the_incarnation_read_again(tmp_path: Path) -> None:
    async def main() -> None:
        meta, raft, fsm, versions = await _service(tmp_path)
        try:
            assert (await meta.write(C.CreateTopic(_topic("d")))).ok
            meta.races = 1
            await meta.delete_topic(Q.DeleteTopicReq(who=OPERATOR, name="d"))
            with meta.store.read() as r:
                assert r.topic("d") is None
        finally:
            raft.close()
            fsm.close()
            versions.close()

    asyncio.run(main())


class GatedFSM(FSM):
    """An FSM whose apply waits while the gate is shut: the tick thread stalls the way
    it does replaying an old snapshot's worth of entries, the commit index runs ahead."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        import threading

        self.gate = threading.Event()
        self.gate.set()

    def apply(self, index: int, data: bytes) -> C.ApplyResult:
        self.gate.wait(30)
        return super().apply(index, data)


def test_a_self_leader_whose_replica_trails_does_not_confirm_a_live_topic_gone(tmp_path: Path) -> None:
    """Chaos bug 4: winning the election proves the log, not the state. The topic's create
    is committed but not applied yet; the leader's local read says "absent". Only after
    the barrier (everything committed applied) and a re-read may it answer, and it keeps."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        meta, raft, fsm, versions = await _service(tmp_path, GatedFSM)
        store = meta.store
        try:
            while not raft.caught_up():
                await asyncio.sleep(0.01)
            before = raft.status().commit_index
            fsm.gate.clear()
            create = asyncio.ensure_future(meta.write(C.CreateTopic(_topic("live"))))
            while raft.status().commit_index <= before:
                await asyncio.sleep(0.01)  # committed, not applied
            with store.read() as r:
                assert r.topic("live") is None  # what a naive leader would trust
            assert not raft.caught_up()
            loop.call_later(0.5, fsm.gate.set)
            gone = await meta.confirm_gone("live", "00000000000000aa")
            assert gone is False
            with store.read() as r:
                assert r.topic("live") is not None
            assert (await create).ok
            # And a topic that really is gone is confirmed gone.
            assert await meta.confirm_gone("never-was", "00000000000000bb") is True
        finally:
            fsm.gate.set()
            raft.close()
            fsm.close()
            versions.close()

    asyncio.run(main())


def test_a_request_run_again_after_a_leader_change_answers_what_it_did(tmp_path: Path) -> None:
    """The node that took a request retries it (same request id) on a new leader when
    the old one lost leadership before answering; its entries carry '<id>:<n>', so the
    run again answers the create it already made (not 409) and the delete it already
    did (not 404). Another request for the same name still gets 409."""

    async def main() -> None:
        meta, raft, fsm, versions = await _service(tmp_path)
        try:
            create = Q.CreateTopicReq(who=OPERATOR, name="once", partitions=3)
            first = await meta.dispatch_as(create, "req-1")
            again = await meta.dispatch_as(create, "req-1")
            assert isinstance(first, TopicRecord) and isinstance(again, TopicRecord) and again.id == first.id
            with pytest.raises(Conflict):
                await meta.dispatch_as(create, "req-2")
            delete = Q.DeleteTopicReq(who=OPERATOR, name="once")
            await meta.dispatch_as(delete, "req-3")
            await meta.dispatch_as(delete, "req-3")  # no 404 for the delete it already did
            with pytest.raises(NotFound):
                await meta.dispatch_as(delete, "req-4")
            users = Q.CreateUserReq(who=OPERATOR, username="u1", password_hash=b"h")
            await meta.dispatch_as(users, "req-5")
            assert (await meta.dispatch_as(users, "req-5")).username == "u1"  # type: ignore[attr-defined]
        finally:
            raft.close()
            fsm.close()
            versions.close()

    asyncio.run(main())


class SlowFirstDelivery(FSM):
    """The first SetDelivery takes 1.5 s to apply (on Raft's tick thread): its writer's
    one-second write times out ("may have landed") and the entry commits after."""

    slow = 1

    def _set_delivery(self, txn: Any, p: C.SetDelivery, stamp: int) -> Any:
        if SlowFirstDelivery.slow:
            SlowFirstDelivery.slow = 0
            time.sleep(1.5)
        return super()._set_delivery(txn, p, stamp)


def test_a_flow_write_that_timed_out_is_seen_by_the_next_cycle_check(tmp_path: Path) -> None:
    """a -> b times out on its writer and commits afterwards; b -> a, checked the next
    moment under the same lock, is refused as the cycle it closes (a barrier under the
    lock orders the check after every entry proposed before it), and the topics never
    form a cycle. Without the barrier b -> a was accepted: a -> b -> a."""

    async def main() -> None:
        SlowFirstDelivery.slow = 1
        meta, raft, fsm, versions = await _service(tmp_path, SlowFirstDelivery)
        try:
            every = sorted(C.APPLIED_TYPES)
            assert (await meta.write(C.RegisterMember(MemberRecord("n1", raft.self_addr, newest_entry_type=max(every),
                                                                   entry_types=every)))).ok
            for n in ("a", "b"):
                await meta.create_topic(Q.CreateTopicReq(who=OPERATOR, name=n))
            meta.write_timeout = 1.0
            with pytest.raises(Unavailable, match="may have landed"):
                await meta.alter_topic(Q.AlterTopicReq(OPERATOR, "a", max_deliveries=1, dead_letter_topic="b"))
            with pytest.raises(BadRequest, match="closes a cycle"):
                await meta.alter_topic(Q.AlterTopicReq(OPERATOR, "b", max_deliveries=1, dead_letter_topic="a"))
            with meta.store.read() as r:
                a, b = r.topic("a"), r.topic("b")
            assert a is not None and b is not None
            assert (a.dead_letter_topic, b.dead_letter_topic) == ("b", None)
        finally:
            raft.close()
            fsm.close()
            versions.close()

    asyncio.run(main())


def test_a_leadership_transfer_is_sent_from_the_raft_tick_thread(tmp_path: Path) -> None:
    """pysyncobj's transport is not thread-safe: ``transfer_leadership`` called on the
    supervisor's loop (a graceful stop, a leader's decommission) only asks, and the tick
    thread sends the TimeoutNow at its next tick. Sent from the loop it raced the tick
    thread's write to the same connection (``BufferError`` at a graceful stop: exit 1)."""
    import threading

    async def main() -> None:
        _meta, raft, fsm, versions = await _service(tmp_path)
        try:
            obj = raft._obj
            assert obj is not None
            seen: list[tuple[str, object]] = []
            obj.transferLeadership = lambda node=None, callback=None: seen.append(  # type: ignore[method-assign]
                (threading.current_thread().name, node))
            raft.transfer_leadership("127.0.0.1:1")
            deadline = time.monotonic() + 5
            while not seen:
                assert time.monotonic() < deadline, "the transfer was never made"
                await asyncio.sleep(0.01)
            tick = getattr(obj, "_SyncObj__thread", None)
            assert tick is not None and seen == [(tick.name, "127.0.0.1:1")], seen
            assert threading.current_thread() is not tick
            await asyncio.sleep(0.1)
            assert len(seen) == 1  # made once
        finally:
            raft.close()
            fsm.close()
            versions.close()

    asyncio.run(main())
