"""What a starting node does with the FSM it finds: the seed's restart table.

Before Raft starts, the supervisor reads (never writes) three things: the FSM
under ``<data-dir>/metastore/fsm/`` (its applied index, whether that index is
trusted, whether it holds anything, the newest entry type it applied), the
Raft state under ``<data-dir>/metastore/raft/`` (the log's first and last
index, the latest snapshot's index) and how the node enters Raft (only a
join-only node enters a cluster that is already running). ``decide`` turns
those into one action:

* keep     - the replay skips what the FSM holds (the normal restart);
* restore  - install the latest snapshot over the FSM, then replay the tail;
* aside    - rename the FSM to ``fsm.stale`` and rebuild it from the cluster;
* untrusted - keep it and replay onto it, logged at error (nothing to rebuild from);
* refuse   - exit non-zero with one error line, leaving every file untouched.

``inspect_fsm`` and ``inspect_raft`` read the files; ``decide`` is pure. May
import narad.meta.fsm (read-only opens), narad.meta.journal and
narad.meta.raft (file formats); nothing above meta.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import lmdb

from narad.meta import commands as C
from narad.meta import fsm as F
from narad.meta.journal import scan_log
from narad.meta.raft import read_snapshot_header

KEEP = "keep"
RESTORE = "restore"
ASIDE = "aside"
UNTRUSTED = "untrusted"
REFUSE = "refuse"


@dataclass(frozen=True)
class FsmState:
    present: bool  # a database file exists
    holds_anything: bool  # any record, or an applied index
    index: int  # 0: missing
    trusted: bool  # the index was written by the last commit to the file
    newest_type: int  # the newest entry type it applied
    types: frozenset[int] = frozenset()  # every entry type it applied


class SnapshotDamaged(RuntimeError):
    """latest.snap exists but cannot be read back (the node refuses to start)."""


@dataclass(frozen=True)
class RaftState:
    log_first: int  # 0: no entries
    log_last: int
    snapshot_index: int | None  # the FSM index of the latest snapshot, None: no snapshot
    snapshot_newest_type: int = 0
    snapshot_types: frozenset[int] = frozenset()

    @property
    def none(self) -> bool:
        return self.log_last == 0 and self.snapshot_index is None


@dataclass(frozen=True)
class Decision:
    action: str
    reason: str


ABSENT = FsmState(present=False, holds_anything=False, index=0, trusted=False, newest_type=0, types=frozenset())


def inspect_fsm(path: Path) -> FsmState:
    """Read the FSM's bookkeeping without writing anything (no lock file, no
    transaction that commits)."""
    if not (path / "data.mdb").exists():
        return ABSENT
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=len(F.DB_NAMES) + 4, map_size=F.MAP_SIZE)
    try:
        last_txnid = int(env.info()["last_txnid"])
        holds = False
        index = applied_txn = newest = 0
        types: frozenset[int] = frozenset()
        with env.begin() as txn:
            for name in F.DB_NAMES:
                try:
                    db = env.open_db(name.encode(), txn=txn, create=False)
                except lmdb.NotFoundError:
                    continue
                if name == "fsm_meta":
                    raw = txn.get(F.K_APPLIED, db=db)
                    index = F._U64.unpack(raw)[0] if raw else 0
                    raw = txn.get(F.K_TXN, db=db)
                    applied_txn = F._U64.unpack(raw)[0] if raw else 0
                    meta_db = db
                    newest, types = F.read_types(lambda k: txn.get(k, db=meta_db))  # noqa: B023 - used at once
                elif name not in ("requests", "request_times") and txn.stat(db)["entries"]:
                    holds = True
            if not holds:
                # Records in the unnamed database (not ours) count as contents too.
                holds = any(True for k, _ in txn.cursor() if k.decode(errors="replace") not in F.DB_NAMES)
    finally:
        env.close()
    return FsmState(present=True, holds_anything=holds or index > 0, index=index,
                    trusted=index > 0 and applied_txn == last_txnid, newest_type=newest, types=types)


def inspect_raft(raft_dir: Path) -> RaftState:
    first, last = scan_log(raft_dir / "log")
    snap_index: int | None = None
    snap_newest = 0
    snap_types: frozenset[int] = frozenset()
    latest = raft_dir / "snapshots" / "latest.snap"
    if latest.exists():
        try:
            header, _ = read_snapshot_header(latest)
            snap_index = int(header["fsm_index"])
            snap_newest = int(header.get("newest_type", 0))
            listed = header.get("entry_types")
            snap_types = (frozenset(int(t) for t in listed) if isinstance(listed, list)
                          else C.types_up_to(snap_newest))
            for key in ("last", "before"):  # what Raft reads back when it loads the snapshot
                _cmd, idx, term = header[key]
                int(idx), int(term)
            if not isinstance(header["cluster"], list):
                raise TypeError("cluster is not a list")
        except (ValueError, KeyError, TypeError, OSError) as e:
            # A snapshot is renamed into place only once complete and synced: an
            # unreadable one is damage. Raft would fail to load it and, its log
            # compacted past it, never become ready: refuse instead, untouched.
            raise SnapshotDamaged(
                f"metastore: the raft snapshot {latest} is damaged ({type(e).__name__}: {str(e)[:200]}); "
                "refusing to start (the files were left untouched). Restore the raft directory from a backup, "
                "or move <data-dir>/metastore aside so this node rebuilds it from the cluster") from None
    return RaftState(log_first=first, log_last=last, snapshot_index=snap_index, snapshot_newest_type=snap_newest,
                     snapshot_types=snap_types)


def decide(fsm: FsmState, raft: RaftState, *, joining: bool, applies: frozenset[int]) -> Decision:
    """The seed's table ("Restarts"), plus the refusal of entry types this build does not apply."""
    unknown = fsm.types - applies if fsm.present else frozenset()
    if unknown:
        return Decision(REFUSE, f"the metastore database applied raft entry types {sorted(unknown)}, which this "
                                "build does not apply; run the cluster's release on this node "
                                "(the database was left untouched)")
    unknown = raft.snapshot_types - applies if raft.snapshot_index is not None else frozenset()
    if unknown:
        return Decision(REFUSE, f"the latest raft snapshot applied entry types {sorted(unknown)}, which this "
                                "build does not apply; run the cluster's release on this node")
    if not fsm.holds_anything:
        return Decision(KEEP, "empty metastore database: Raft rebuilds it")
    if raft.none:
        if joining:
            return Decision(ASIDE, "the metastore database holds state but the raft log and snapshots are gone; "
                                   "set aside as fsm.stale, the cluster rebuilds it")
        return Decision(REFUSE, "the metastore database holds state but the raft log and snapshots "
                                "(<data-dir>/metastore/raft) are gone; starting would bootstrap a cluster that "
                                "holds none of its topics. Restore the raft directory, or move "
                                "<data-dir>/metastore/fsm aside deliberately to start empty (the files were left "
                                "untouched)")
    snap = raft.snapshot_index
    end = max(raft.log_last, snap or 0)
    if fsm.trusted:
        if fsm.index > end:
            if joining:
                return Decision(ASIDE, f"the metastore database (index {fsm.index}) is past the raft log and "
                                       f"snapshot (up to {end}); set aside as fsm.stale, the cluster brings the rest")
            return Decision(REFUSE, f"the metastore database (index {fsm.index}) is past the end of the raft log and "
                                    f"the latest snapshot (up to {end}): the raft directory was restored from an "
                                    "older backup than the database. Rebuilding from it would drop everything "
                                    "written since that backup; restore both from the same backup, or start this "
                                    "node as a joiner of the running cluster (the files were left untouched)")
        if snap is not None and fsm.index < snap:
            return Decision(RESTORE, f"the metastore database (index {fsm.index}) is behind the latest snapshot "
                                     f"({snap}): restore it, then apply the log after it")
        if snap is None and raft.log_first > fsm.index + 1:
            return Decision(REFUSE, f"the metastore database (index {fsm.index}) is behind the raft log, which "
                                    f"starts at {raft.log_first} with no snapshot to fill the gap (files untouched)")
        return Decision(KEEP, f"the replay skips the {fsm.index} entries the database holds")
    if snap is not None:
        return Decision(RESTORE, "the metastore database's index is missing or untrusted (another program wrote "
                                 f"it): restore the latest snapshot ({snap}) over it")
    if raft.log_first <= 1:
        return Decision(ASIDE, "the metastore database's index is missing or untrusted and the raft log starts at "
                               "1: set aside as fsm.stale and rebuilt from the log")
    return Decision(UNTRUSTED, "the metastore database's index is missing or untrusted and the raft log is "
                               "compacted with no snapshot: kept and replayed onto as it is (nothing to rebuild from)")


def set_aside(fsm_path: Path) -> Path:
    """Rename the FSM directory to ``fsm.stale`` (``fsm.stale.1``, ... when one
    exists already): kept for an operator, never read again."""
    target = fsm_path.with_name(fsm_path.name + ".stale")
    n = 0
    while target.exists():
        n += 1
        target = fsm_path.with_name(f"{fsm_path.name}.stale.{n}")
    os.replace(fsm_path, target)
    with contextlib.suppress(OSError):
        fd = os.open(fsm_path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return target


__all__ = ["ASIDE", "KEEP", "REFUSE", "RESTORE", "UNTRUSTED", "Decision", "FsmState", "RaftState", "SnapshotDamaged",
           "decide",
           "inspect_fsm", "inspect_raft", "set_aside"]
