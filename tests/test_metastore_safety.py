"""Metastore safety on real nodes and real files: Raft snapshots (threshold,
two kept, a failed copy counted and retried), the restart table (keep,
restore, set aside, refuse with files untouched), readiness after replay,
and refusing a database newer than the build."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import lmdb
import pytest

from narad.meta import commands as C
from narad.meta import restart as RS
from tests.harness import Node, wait_for

SNAP_ENV = {"NARAD_CLUSTER_RAFT_SNAPSHOT_THRESHOLD": "16", "NARAD_CLUSTER_RAFT_SNAPSHOT_INTERVAL": "1s"}


def fsm_dir(n: Node) -> Path:
    return n.data_dir / "metastore" / "fsm"


def raft_dir(n: Node) -> Path:
    return n.data_dir / "metastore" / "raft"


def files_digest(d: Path) -> dict[str, tuple[str, int]]:
    """Content hash and mtime of every file under ``d`` (lock.mdb excluded: LMDB's reader table)."""
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and p.name != "lock.mdb":
            out[str(p.relative_to(d))] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
    return out


def create_topics(n: Node, prefix: str, count: int) -> None:
    for i in range(count):
        r = n.post("/v1/topics", {"name": f"{prefix}-{i}"})
        assert r.status == 201, r


def topic_names(n: Node) -> set[str]:
    return n.topic_names()


def refused_start(n: Node) -> str:
    n.start(wait=False)
    assert n.proc is not None
    code = n.proc.wait(30)
    assert code == 2, n.log()[-3000:]
    return n.log()


# ---- the restart table, pure -------------------------------------------------------------
def fsm(index: int = 10, trusted: bool = True, holds: bool = True, newest: int = 13) -> RS.FsmState:
    return RS.FsmState(present=True, holds_anything=holds, index=index, trusted=trusted, newest_type=newest,
                       types=C.types_up_to(newest))


@pytest.mark.parametrize(
    ("state", "raft", "joining", "action"),
    [
        (RS.ABSENT, RS.RaftState(0, 0, None), False, RS.KEEP),
        (fsm(holds=False, index=0, trusted=False), RS.RaftState(0, 0, None), False, RS.KEEP),
        (fsm(), RS.RaftState(0, 0, None), True, RS.ASIDE),  # raft gone, joining a running cluster
        (fsm(), RS.RaftState(0, 0, None), False, RS.REFUSE),  # raft gone, would bootstrap
        (fsm(index=50), RS.RaftState(1, 20, None), True, RS.ASIDE),  # past the log (older raft backup)
        (fsm(index=50), RS.RaftState(30, 40, 29), False, RS.REFUSE),
        (fsm(index=30), RS.RaftState(21, 40, 20), False, RS.KEEP),  # within the log, past the snapshot
        # pysyncobj keeps the snapshot's last two entries in the log: it starts at snapshot - 1.
        (fsm(index=30), RS.RaftState(19, 40, 20), False, RS.KEEP),
        (fsm(index=20), RS.RaftState(19, 40, 20), False, RS.KEEP),
        (fsm(index=19), RS.RaftState(19, 40, 20), False, RS.RESTORE),
        (fsm(index=41), RS.RaftState(19, 40, 20), False, RS.REFUSE),
        (fsm(index=40), RS.RaftState(21, 40, 20), False, RS.KEEP),
        (fsm(index=10), RS.RaftState(21, 40, 20), False, RS.RESTORE),  # behind the snapshot
        (fsm(trusted=False), RS.RaftState(21, 40, 20), False, RS.RESTORE),
        (fsm(trusted=False, index=0), RS.RaftState(1, 40, None), False, RS.ASIDE),  # rebuild from log
        (fsm(trusted=False), RS.RaftState(21, 40, None), False, RS.UNTRUSTED),  # nothing to rebuild from
        (fsm(newest=23), RS.RaftState(1, 40, None), False, RS.KEEP),
    ],
)
def test_restart_table(state: RS.FsmState, raft: RS.RaftState, joining: bool, action: str) -> None:
    assert RS.decide(state, raft, joining=joining, applies=C.APPLIED_TYPES).action == action


def test_a_database_or_snapshot_newer_than_the_build_is_refused() -> None:
    older = C.types_up_to(13)
    d = RS.decide(fsm(newest=23), RS.RaftState(1, 40, None), joining=True, applies=older)
    assert d.action == RS.REFUSE and "entry types [23]" in d.reason
    snap = RS.RaftState(21, 40, 20, snapshot_newest_type=23, snapshot_types=frozenset({1, 2, 23}))
    d = RS.decide(fsm(), snap, joining=False, applies=older)
    assert d.action == RS.REFUSE and "snapshot" in d.reason
    # Sets, not a number: a build without type 33 (reserved for remotes) refuses a
    # database that applied it, though its own newest type (38) is higher.
    assert 33 not in C.APPLIED_TYPES
    gap = RS.FsmState(present=True, holds_anything=True, index=10, trusted=True, newest_type=33,
                      types=frozenset({1, 2, 33}))
    assert RS.decide(gap, RS.RaftState(1, 40, None), joining=False, applies=C.APPLIED_TYPES).action == RS.REFUSE


# ---- snapshots on a real node ------------------------------------------------------------
def test_snapshot_compacts_the_log_keeps_two_and_a_restart_reapplies_nothing(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=1, env=SNAP_ENV).start()
    try:
        create_topics(n, "a", 20)
        snaps = raft_dir(n) / "snapshots"
        # A snapshot is taken, then the log compacted into it.
        wait_for(lambda: RS.inspect_raft(raft_dir(n)).log_first > 1, 15, 0.1, "a first snapshot")
        first = RS.inspect_raft(raft_dir(n))
        assert first.snapshot_index is not None and first.snapshot_index >= first.log_first - 1
        create_topics(n, "b", 20)
        wait_for(lambda: (snaps / "previous.snap").exists()
                 and (RS.inspect_raft(raft_dir(n)).snapshot_index or 0) > (first.snapshot_index or 0),
                 15, 0.1, "a second snapshot")
        create_topics(n, "c", 20)
        wait_for(lambda: "raft snapshot taken" in n.log() and n.log().count("raft snapshot taken") >= 3, 15, 0.1)
        kept = sorted(p.name for p in snaps.iterdir())
        assert kept == ["latest.snap", "previous.snap"], kept
        # Operators see it: snapshots written, the database size a snapshot needs free, the log length.
        wait_for(lambda: n.metric("narad_metastore_snapshots_taken") >= 3, 10, 0.2)
        assert n.metric("narad_metastore_fsm_bytes") > 0
        assert 0 < n.metric("narad_raft_log_entries") < 40
        assert n.stop() == 0
        mark = len(n.log())
        n.start()
        after = n.log()[mark:]
        assert "action=keep" in after and "the replay skips" in after
        assert "restoring snapshot" not in after and "snapshot installed" not in after
        assert {f"{p}-{i}" for p in "abc" for i in range(20)} <= topic_names(n)
    finally:
        n.close()


def test_a_snapshot_that_cannot_be_copied_is_counted_and_retried(tmp_path: Path) -> None:
    """The snapshot directory is a 1 MiB tmpfs, filled up: the copy fails (logged, counted),
    metadata writes go on, and once there is room the next interval succeeds."""
    n = Node(tmp_path / "data", workers=1, env=SNAP_ENV, tmpfs_mb=1, tmpfs_sub="metastore/raft/snapshots")
    n.start()
    try:
        filler = n.in_namespace(raft_dir(n) / "snapshots" / "filler")
        with open(filler, "wb") as fh, pytest.raises(OSError):
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        create_topics(n, "full", 24)
        wait_for(lambda: n.metric("narad_metastore_snapshot_failures_total") >= 1, 15, 0.1, "a failed snapshot")
        assert "could not copy the database for a raft snapshot" in n.log()
        create_topics(n, "still", 3)  # writes carry on
        assert {f"still-{i}" for i in range(3)} <= topic_names(n)
        failures = n.metric("narad_metastore_snapshot_failures_total")
        filler.unlink()
        wait_for(lambda: "raft snapshot taken" in n.log(), 15, 0.1, "the retried snapshot")
        # The log (outside the tmpfs) is compacted into it on the next tick.
        wait_for(lambda: RS.inspect_raft(raft_dir(n)).log_first > 1, 10, 0.05, "the log compacted")
        assert n.metric("narad_metastore_snapshot_failures_total") == failures
    finally:
        n.close()


# ---- the restart table on real files ------------------------------------------------------
def test_raft_state_gone_refuses_a_node_that_would_bootstrap_and_leaves_the_files(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=1).start()
    try:
        create_topics(n, "kept", 2)
        assert n.stop() == 0
        shutil.rmtree(raft_dir(n))
        before = files_digest(fsm_dir(n))
        log = refused_start(n)
        assert "raft log and snapshots" in log and "refusing to start" in log
        assert files_digest(fsm_dir(n)) == before
    finally:
        n.close()


def test_raft_state_older_than_the_database_refuses_to_start(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=1).start()
    try:
        create_topics(n, "old", 2)
        assert n.stop() == 0
        backup = tmp_path / "raft-backup"
        shutil.copytree(raft_dir(n), backup)
        n.start()
        create_topics(n, "new", 5)
        assert n.stop() == 0
        shutil.rmtree(raft_dir(n))
        shutil.copytree(backup, raft_dir(n))
        before = files_digest(fsm_dir(n))
        log = refused_start(n)
        assert "past the end of the raft log" in log
        assert files_digest(fsm_dir(n)) == before
    finally:
        n.close()


def test_a_database_behind_the_latest_snapshot_is_restored_from_it(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=1, env=SNAP_ENV).start()
    try:
        create_topics(n, "early", 2)
        assert n.stop() == 0
        old_fsm = tmp_path / "fsm-early"
        shutil.copytree(fsm_dir(n), old_fsm)
        n.start()
        create_topics(n, "later", 24)
        wait_for(lambda: (RS.inspect_raft(raft_dir(n)).snapshot_index or 0) > 0, 15, 0.1, "a snapshot")
        assert n.stop() == 0
        shutil.rmtree(fsm_dir(n))
        shutil.copytree(old_fsm, fsm_dir(n))
        n.start()
        assert "is behind the latest snapshot" in n.log()
        assert {f"later-{i}" for i in range(24)} | {"early-0", "early-1"} <= topic_names(n)
    finally:
        n.close()


def _write_behind_the_fsms_back(n: Node) -> None:
    """Another program writes the database: its transaction id moves past the one
    the FSM stored with its index, so the index is no longer trusted."""
    env = lmdb.open(str(fsm_dir(n)), max_dbs=32)
    users = env.open_db(b"users")
    with env.begin(write=True) as txn:
        txn.put(b"intruder", b"not a narad record", db=users)
    env.close()
    assert not RS.inspect_fsm(fsm_dir(n)).trusted


def test_an_untrusted_database_is_restored_from_the_snapshot(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=1, env=SNAP_ENV).start()
    try:
        create_topics(n, "t", 24)
        wait_for(lambda: (RS.inspect_raft(raft_dir(n)).snapshot_index or 0) > 0, 15, 0.1, "a snapshot")
        assert n.stop() == 0
        _write_behind_the_fsms_back(n)
        n.start()
        assert "missing or untrusted" in n.log() and "restore the latest snapshot" in n.log()
        assert {f"t-{i}" for i in range(24)} <= topic_names(n)
        with lmdb.open(str(fsm_dir(n)), readonly=True, lock=False, max_dbs=32) as env, env.begin() as txn:
            assert txn.get(b"intruder", db=env.open_db(b"users", txn=txn, create=False)) is None
    finally:
        n.close()


def test_an_untrusted_database_with_the_whole_log_is_set_aside_and_rebuilt(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=1).start()
    try:
        create_topics(n, "t", 3)
        assert n.stop() == 0
        _write_behind_the_fsms_back(n)
        n.start()
        stale = fsm_dir(n).with_name("fsm.stale")
        assert stale.is_dir() and "set aside as fsm.stale" in n.log()
        assert {f"t-{i}" for i in range(3)} <= topic_names(n)
        assert RS.inspect_fsm(fsm_dir(n)).trusted
    finally:
        n.close()


def test_a_database_that_applied_a_newer_entry_type_is_refused_untouched(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=1).start()
    try:
        create_topics(n, "cas", 1)  # a lone node applies the checked create (type 23)
        assert RS.inspect_fsm(fsm_dir(n)).newest_type >= 23
        assert n.stop() == 0
        before = files_digest(fsm_dir(n))
        n.extra_env["NARAD_CLUSTER_NEWEST_ENTRY_TYPE"] = "13"
        log = refused_start(n)
        assert "applied raft entry types [23" in log and "which this build does not apply" in log
        assert files_digest(fsm_dir(n)) == before
    finally:
        n.close()


def test_not_ready_until_the_replay_reaches_the_commit_index_on_disk(tmp_path: Path) -> None:
    """Replay slowed to 20 ms an entry: while it runs /readyz says 503, and whenever it
    says 200 the FSM has applied the commit index persisted before the restart."""
    n = Node(tmp_path / "data", workers=1).start()
    try:
        create_topics(n, "t", 30)
        assert n.stop() == 0
        shutil.rmtree(fsm_dir(n))  # the replay rebuilds it from the whole log
        n.extra_env["NARAD_FAULT_APPLY_DELAY_MS"] = "20"
        n.start(wait=False)
        saw_not_ready = False

        def ready() -> bool:
            nonlocal saw_not_ready
            try:
                r = n.get("/readyz", auth=None)
            except OSError:
                return False
            if r.status != 200:
                saw_not_ready = True
                return False
            raft = n.status()["raft"]
            assert raft["applied_index"] >= raft["persisted_commit_index"] > 30
            return True

        wait_for(ready, 60, 0.02, "ready after the replay")
        assert saw_not_ready
        assert {f"t-{i}" for i in range(30)} <= topic_names(n)
    finally:
        n.close()


# ---- a disk that refuses metastore writes --------------------------------------------------
def test_a_refused_metastore_write_is_retried_then_stops_the_node_and_replays_on_restart(tmp_path: Path) -> None:
    """The FSM directory is a 4 MiB tmpfs. Filled up for a second, the write is retried and
    succeeds once there is room; filled for good, the node stops after 30 s (log line, exit
    non-zero, metadata writes refused meanwhile) and the restart replays the entry."""
    n = Node(tmp_path / "data", workers=1, tmpfs_mb=4, tmpfs_sub="metastore/fsm")
    n.start()
    try:
        filler = n.in_namespace(fsm_dir(n) / "filler")

        def fill() -> None:
            with open(filler, "wb") as fh, pytest.raises(OSError):
                while True:
                    fh.write(b"\0" * 16384)
                    fh.flush()

        fill()
        import threading
        answers: list[int] = []
        t = threading.Thread(target=lambda: answers.append(n.post("/v1/topics", {"name": "squeezed"}).status))
        t.start()
        wait_for(lambda: "could not write raft entry; retrying" in n.log(), 15, 0.05, "a refused write")
        filler.unlink()
        t.join(30)
        assert answers == [201]
        assert n.log().count("could not write raft entry; retrying") == 1  # logged once
        assert n.proc is not None and n.proc.poll() is None
        # Full for good: the node stops after its 30 s retry budget.
        fill()
        r = n.post("/v1/topics", {"name": "never-on-this-disk"})
        assert r.status in (503, 504), r
        assert n.proc.wait(60) != 0
        stop = [ln for ln in n.log().splitlines() if "metastore: stopped applying raft entries" in ln]
        assert len(stop) == 1 and "disk refused" in stop[0] and "index=" in stop[0], stop
        # The restart (a fresh tmpfs: the FSM is rebuilt from the Raft log) replays both entries.
        n.start()
        assert {"squeezed", "never-on-this-disk"} <= topic_names(n)
    finally:
        n.close()


def test_topic_creates_wait_for_the_startup_reconcile_on_every_transport(tmp_path: Path) -> None:
    """While the replay (slowed to 40 ms an entry) runs, the worker already accepts
    connections but /readyz says 503; a create over HTTP/1.1 and one through naradctl
    wait at the create gate and succeed once the startup reconcile finished."""
    import threading

    n = Node(tmp_path / "data", workers=1, security=False).start()
    try:
        create_topics(n, "t", 40)
        assert n.stop() == 0
        shutil.rmtree(fsm_dir(n))
        n.extra_env["NARAD_FAULT_APPLY_DELAY_MS"] = "40"
        mark = len(n.log())
        n.start(wait=False)

        def reconciled() -> bool:
            return "startup reconcile finished" in n.log()[mark:]

        def serving_not_ready() -> bool:
            try:
                return n.get("/readyz", auth=None).status == 503
            except OSError:
                return False

        wait_for(serving_not_ready, 30, 0.01, "a worker serving while the node is not ready")
        outcomes: dict[str, tuple[object, bool]] = {}

        def http_create() -> None:
            r = n.post("/v1/topics", {"name": "gated-http"})
            outcomes["http"] = (r.status, reconciled())

        def ctl_create() -> None:
            out = n.ctl("topics", "create", "gated-ctl", check=False)
            name = out.get("name") if isinstance(out, dict) else out
            outcomes["ctl"] = (name, reconciled())

        threads = [threading.Thread(target=http_create), threading.Thread(target=ctl_create)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert reconciled()
        assert outcomes == {"http": (201, True), "ctl": ("gated-ctl", True)}, outcomes
        assert n.get("/readyz", auth=None).status == 200
    finally:
        n.close()


def test_a_compaction_interrupted_after_the_snapshot_loses_no_entry(tmp_path: Path) -> None:
    """A crash between the snapshot's rename and the log's compaction leaves the whole log
    beside a newer snapshot. pysyncobj alone would clear the journal to the snapshot's
    two entries at start, dropping what followed and answering new writes 'already
    applied'. The start finishes the compaction first: nothing is lost, writes apply."""
    from narad.meta.journal import _read_entries, _write_log

    env = {"NARAD_CLUSTER_RAFT_SNAPSHOT_THRESHOLD": "16", "NARAD_CLUSTER_RAFT_SNAPSHOT_INTERVAL": "5s"}
    n = Node(tmp_path / "data", workers=1, env=env).start()
    try:
        create_topics(n, "a", 20)
        whole = _read_entries(raft_dir(n) / "log")  # before the first snapshot (5 s)
        assert whole[0][1] == 1 and RS.inspect_raft(raft_dir(n)).snapshot_index is None
        wait_for(lambda: RS.inspect_raft(raft_dir(n)).log_first > 1, 20, 0.1, "a snapshot and compaction")
        create_topics(n, "b", 5)
        assert n.stop() == 0
        tail = _read_entries(raft_dir(n) / "log")
        _write_log(raft_dir(n), [e for e in whole if e[1] < tail[0][1]] + tail)  # as if never compacted
        assert RS.inspect_raft(raft_dir(n)).log_first == 1
        n.start()
        assert "finished a compaction interrupted" in n.log()
        assert {f"a-{i}" for i in range(20)} | {f"b-{i}" for i in range(5)} <= topic_names(n)
        create_topics(n, "after", 3)
        assert n.stop() == 0
        n.start()
        assert {f"after-{i}" for i in range(3)} <= topic_names(n)
    finally:
        n.close()


def test_kill9_while_snapshots_are_taken_loses_no_acknowledged_write(tmp_path: Path) -> None:
    """Snapshots every second at a 16-entry threshold while topics are created without
    pause; the whole node is killed -9 at varying moments (mid-snapshot, mid-compaction,
    mid-batch) five times. Every create answered 201 survives every restart, the restart
    table never refuses, and no half-written snapshot file is left behind."""
    import random
    import threading

    rng = random.Random(7)
    n = Node(tmp_path / "data", workers=1, env=SNAP_ENV).start()
    acknowledged: list[str] = []
    try:
        for round_ in range(5):
            stop = threading.Event()

            def writer(r: int = round_, stop: threading.Event = stop) -> None:
                i = 0
                while not stop.is_set():
                    name = f"r{r}-{i}"
                    try:
                        if n.post("/v1/topics", {"name": name}).status == 201:
                            acknowledged.append(name)
                    except OSError:
                        return  # the node is gone
                    i += 1

            t = threading.Thread(target=writer)
            t.start()
            wait_for(lambda r=round_: n.log().count("raft snapshot taken") > r, 20, 0.05, "a snapshot this round")
            # Then kill at a random moment: after a random number of further acknowledged creates.
            more = len(acknowledged) + rng.randint(0, 60)
            wait_for(lambda m=more: len(acknowledged) >= m, 30, 0.005, "creates before the kill")
            n.kill9()
            stop.set()
            t.join(30)
            n.start()
            names = topic_names(n)
            missing = [a for a in acknowledged if a not in names]
            assert not missing, missing[:10]
        assert len(acknowledged) > 100
        assert n.stop() == 0  # a snapshot being written finishes first
        snaps = raft_dir(n) / "snapshots"
        assert not [p.name for p in snaps.iterdir() if p.name.endswith((".part", ".tmp"))]
        assert "refusing to start" not in n.log()
    finally:
        n.close()
