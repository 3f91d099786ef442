"""The metastore state machine: applies committed Raft entries into LMDB.

Only the supervisor's Raft tick thread writes here. Entries of one tick share
one write transaction (``apply`` many times, then ``commit``); each entry's
effects go into a child transaction so a refused entry leaves nothing behind,
and the entry's index, the newest entry type applied and the LMDB transaction
id that wrote them go into ``fsm_meta`` in the same transaction as the effects.
After the commit the caller is told which version slots moved.

Apply is deterministic: it reads only the entry and the database (times and
ids were stamped at propose time), and it never raises, except ``FailStop`` for
an entry this build cannot apply (unknown type) or a write the disk refuses
for 30 s. A refused entry (exists, not found, compare-and-set missed) is a
result, counted as applied like any other.

Imports narad.meta.{commands,records,versions} and lmdb; nothing above.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import msgspec

from narad.errors import FailStop
from narad.meta import commands as C
from narad.meta import records as R
from narad.meta import versions as V

log = logging.getLogger("narad.meta.fsm")

DB_NAMES = (
    "topics",
    "topic_index",
    "schemas",
    "assignments",
    "members",
    "users",
    "removed_members",
    "remotes",
    "fsm_meta",
    "requests",
    "request_times",
)
MAP_SIZE = 32 << 30  # address space only; never resized
MAX_READERS = 512
SCHEMA_VERSION_CAP = 1000
SCHEMA_TOPIC_BYTES = 4 << 20  # stored schema versions per topic (checked by type 26)
SCHEMA_CLUSTER_BYTES = 256 << 20  # every schema version in the cluster (checked by type 26)
MAX_CHILDREN = 108  # fan-out children per parent
MAX_DELAY_MS = 31_536_000_000  # a delay child's delay: at most one year
DELAY_RETENTION_MARGIN_MS = 3_600_000  # a parent keeps messages at least delay + 1 h
CHILD_NAME_BYTES = 230  # a longer name cannot become a child
REQUEST_MEMORY_MS = 10 * 60 * 1000  # idempotency keys are remembered this long (stamp time)
PRUNE_PER_ENTRY = 64
DISK_RETRY_FIRST = 0.1
DISK_RETRY_MAX_SLEEP = 5.0
DISK_RETRY_BUDGET = 30.0

_U64 = struct.Struct(">Q")
K_APPLIED = b"applied_index"
K_TXN = b"applied_txn"
K_NEWEST = b"newest_type"
K_TYPES = b"entry_types"  # 32-byte bitmap: every entry type this database applied


def read_types(get: Callable[[bytes], bytes | None]) -> tuple[int, frozenset[int]]:
    """The newest entry type and the set of types a database applied (``get``
    reads an fsm_meta key). A database without the set knows its newest only."""
    raw = get(K_NEWEST)
    newest = raw[0] if raw else 0
    bits = get(K_TYPES)
    types = C.bits_to_types(bits) if bits else frozenset(range(1, newest + 1)) & C.APPLIED_TYPES
    return newest, types
K_MAX_STAMP = b"max_stamp_ms"
K_SCHEMA_BYTES = b"schema_bytes"  # bytes of every stored schema version

_req_enc = msgspec.msgpack.Encoder()
_req_dec = msgspec.msgpack.Decoder(tuple[int, C.ApplyResult])


def request_result(raw: bytes) -> C.ApplyResult:
    """Decode a ``requests`` row: the first result of a request id."""
    return _req_dec.decode(raw)[1]

Handler = Callable[[Any, Any, int], "tuple[C.ApplyResult, set[int]]"]


def open_env(path: Path, *, readonly: bool = False) -> lmdb.Environment:
    if readonly:
        return lmdb.open(
            str(path), readonly=True, lock=True, map_size=MAP_SIZE, max_dbs=len(DB_NAMES) + 4,
            max_readers=MAX_READERS, max_spare_txns=2,
        )
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return lmdb.open(
        str(path), map_size=MAP_SIZE, max_dbs=len(DB_NAMES) + 4, max_readers=MAX_READERS,
        sync=True, metasync=False, writemap=False, mode=0o600,
    )


def open_dbs(env: lmdb.Environment, *, create: bool) -> dict[str, Any]:
    if create:
        return {n: env.open_db(n.encode(), create=True) for n in DB_NAMES}
    return {n: env.open_db(n.encode(), create=False) for n in DB_NAMES}


def _ranges(types: frozenset[int] | set[int]) -> str:
    """1-13, 23-26 style."""
    out: list[str] = []
    for t in sorted(types):
        if out and "-" not in out[-1].split(",")[-1] and int(out[-1]) == t - 1:
            out[-1] = f"{out[-1]}-{t}"
        elif out and "-" in out[-1] and int(out[-1].split("-")[1]) == t - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{t}"
        else:
            out.append(str(t))
    return ", ".join(out)


def json_same(a: Any, b: Any) -> bool:
    """Two decoded JSON values are the same value: key order, whitespace and number
    spelling do not matter (1, 1.0 and 1e0 are one number), but true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def schema_docs_same(a: bytes, b: bytes) -> bool:
    """Two stored schema versions are the same JSON value (undecodable: compared as bytes)."""
    try:
        return json_same(json.loads(a), json.loads(b))
    except (ValueError, RecursionError):
        return a == b


def delay_retention_refusal(parent: str, retention_ms: int, child: str, delay_ms: int) -> str | None:
    """Why a parent keeping messages ``retention_ms`` (0: forever) cannot feed a delay
    child of ``delay_ms`` (None: it can)."""
    if delay_ms <= 0 or retention_ms == 0 or retention_ms >= delay_ms + DELAY_RETENTION_MARGIN_MS:
        return None
    return (f'the retention of "{parent}" ({retention_ms} ms) must be at least the delay of its child "{child}" '
            f"plus 1 h ({delay_ms + DELAY_RETENTION_MARGIN_MS} ms)")


def link_refusal(par: R.TopicRecord, child: R.TopicRecord, delay_ms: int) -> str | None:
    """Which fan-out rule linking ``child`` under ``par`` breaks (None: none). The
    child's own parent and the schema histories are checked by the caller."""
    if par.name == child.name:
        return "a topic cannot be its own child"
    if len(child.name.encode()) > CHILD_NAME_BYTES:
        return f'topic "{child.name}" has a name longer than {CHILD_NAME_BYTES} bytes and cannot become a child'
    if not 0 <= delay_ms <= MAX_DELAY_MS:
        return f"delay_ms must be between 0 and {MAX_DELAY_MS} (1 year)"
    if child.children:
        return f'topic "{child.name}" has children; a child cannot have children'
    if par.parent is not None:
        return f'topic "{par.name}" is a child of "{par.parent}"; a child cannot have children'
    if child.name not in par.children and len(par.children) >= MAX_CHILDREN:
        return f'topic "{par.name}" already has {MAX_CHILDREN} children, the most a parent may have'
    return delay_retention_refusal(par.name, par.retention_ms, child.name, delay_ms)


def _ok(msg: str = "") -> C.ApplyResult:
    return C.ApplyResult(C.Result.OK, msg)


def _refuse(code: C.Result, msg: str) -> C.ApplyResult:
    return C.ApplyResult(code, msg)


class FSM:
    def __init__(
        self,
        path: Path,
        *,
        on_commit: Callable[[set[int], int], None] | None = None,
        applies: frozenset[int] = C.APPLIED_TYPES,
    ) -> None:
        self.path = Path(path)
        self.env = open_env(self.path)
        self.dbs = open_dbs(self.env, create=True)
        self.on_commit = on_commit
        self.applies = applies  # the entry types this node applies
        self._txn: lmdb.Transaction | None = None
        self._batch: list[tuple[int, bytes]] = []
        self._batch_start_applied = 0
        self._touched: set[int] = set()
        self.failed: FailStop | None = None
        self.on_replace: Callable[[], None] | None = None
        # Held while the environment object is replaced (snapshot install) and
        # by readers sharing this environment from other threads.
        self.swap_lock = threading.RLock()
        self._copying = threading.Lock()  # held while a snapshot copy reads this environment
        with self.env.begin() as txn:
            self.applied_index = self._meta_u64(txn, K_APPLIED)
            self.applied_txn = self._meta_u64(txn, K_TXN)
            self.newest_type, self.applied_types = read_types(lambda k: txn.get(k, db=self.dbs["fsm_meta"]))
        self._batch_start_types = (self.newest_type, self.applied_types)
        self._handlers: dict[int, Handler] = {
            C.EntryType.NOOP: self._noop,
            C.EntryType.CREATE_TOPIC: self._create_topic,
            C.EntryType.DELETE_TOPIC: self._delete_topic,
            C.EntryType.UPDATE_TOPIC: self._update_topic,
            C.EntryType.PUT_SCHEMA: self._put_schema,
            C.EntryType.ASSIGN_PARTITIONS: self._assign,
            C.EntryType.REGISTER_MEMBER: self._register_member,
            C.EntryType.HEARTBEAT: self._heartbeat,
            C.EntryType.MARK_DEAD: self._mark_dead,
            C.EntryType.CREATE_USER: self._create_user,
            C.EntryType.UPDATE_GRANTS: self._update_grants,
            C.EntryType.UPDATE_PASSWORD: self._update_password,
            C.EntryType.DELETE_USER: self._delete_user,
            C.EntryType.CREATE_TOPIC_CHECKED: self._create_topic_checked,
            C.EntryType.UPDATE_TOPIC_CAS: self._update_topic_cas,
            C.EntryType.DELETE_TOPIC_CAS: self._delete_topic_cas,
            C.EntryType.PUT_SCHEMA_CAS: self._put_schema_cas,
            C.EntryType.ATTACH_CHILD_CAS: self._attach_child_cas,
            C.EntryType.DETACH_CHILD_CAS: self._detach_child_cas,
            C.EntryType.PLACE_PARTITIONS: self._place_partitions,
            C.EntryType.PRUNE_ASSIGNMENTS: self._prune_assignments,
            C.EntryType.MARK_DEAD_OBSERVED: self._mark_dead_observed,
            C.EntryType.DELETE_USER_RELEASING: self._delete_user_releasing,
            C.EntryType.IMPORT_METASTORE: self._import_metastore,
            C.EntryType.SET_MOVE_TARGETS: self._set_move_targets,
            C.EntryType.COMPLETE_MOVE: self._complete_move,
            C.EntryType.SET_DRAINING: self._set_draining,
            C.EntryType.REMOVE_MEMBER: self._remove_member,
            C.EntryType.SET_DELIVERY: self._set_delivery,
        }

    # ---- bookkeeping ------------------------------------------------------
    def _meta_u64(self, txn: lmdb.Transaction, key: bytes) -> int:
        raw = txn.get(key, db=self.dbs["fsm_meta"])
        return _U64.unpack(raw)[0] if raw else 0

    def last_txnid(self) -> int:
        return int(self.env.info()["last_txnid"])

    @property
    def index_trusted(self) -> bool:
        """True when nothing but this FSM wrote the file since it stored its index."""
        return self.applied_index > 0 and self.applied_txn == self.last_txnid()

    def is_empty(self) -> bool:
        with self.env.begin() as txn:
            for name in ("topics", "users", "members", "assignments", "schemas", "remotes"):
                if txn.stat(self.dbs[name])["entries"]:
                    return False
        return True

    # ---- apply ------------------------------------------------------------
    def apply(self, index: int, data: bytes) -> C.ApplyResult:
        """Apply one committed entry into the open batch. Never raises except FailStop."""
        if self.failed is not None:
            raise self.failed
        if index <= self.applied_index:
            # Already in the database (a restart replays the log): skip, never apply twice.
            return C.ApplyResult(C.Result.OK, "already applied", index)
        if self._txn is None:
            self._txn = self.env.begin(write=True)
            self._batch = []
            self._batch_start_applied = self.applied_index
            self._batch_start_types = (self.newest_type, self.applied_types)
        self._batch.append((index, data))
        result = self._apply_with_disk_retry(index, data)
        return result

    def _apply_with_disk_retry(self, index: int, data: bytes) -> C.ApplyResult:
        try:
            return self._apply_one(index, data)
        except lmdb.Error as e:
            log.error("metastore: could not write raft entry; retrying", extra={"index": index, "err": str(e)})
            self._retry_batch(e)
            # The retry re-applied the whole batch, this entry included.
            return self._last_result

    def _apply_one(self, index: int, data: bytes) -> C.ApplyResult:
        txn = self._txn
        assert txn is not None
        op = data[0] if data else 0
        try:
            dec = C.decode(data)
        except KeyError:
            self._fail_stop(index, op, f"unknown raft entry type {op}")
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
            log.error("metastore: undecodable raft entry; refused on every node",
                      extra={"index": index, "type": op, "err": str(e)})
            result = C.ApplyResult(C.Result.UNDECODABLE, f"undecodable entry: {e}")
            self._finish(txn, index, op, "", 0, result)
            return result
        if op not in self.applies:
            self._fail_stop(index, op, f"raft entry type {op} is not one this node applies "
                                       f"(it applies {_ranges(self.applies)})")
        if dec.request_id:
            prior = txn.get(dec.request_id.encode(), db=self.dbs["requests"])
            if prior is not None:
                _, earlier = _req_dec.decode(prior)
                result = C.ApplyResult(earlier.code, earlier.message, earlier.index)
                self._finish(txn, index, op, "", dec.stamp_ms, result, record=False)
                return result
        child = self.env.begin(write=True, parent=txn)
        try:
            result, slots = self._handlers[op](child, dec.payload, dec.stamp_ms)
        except (lmdb.BadValsizeError, lmdb.BadDbiError) as e:
            # A key or value LMDB cannot hold is the entry's fault, the same on every
            # node: refused, never mistaken for a disk that refuses writes.
            child.abort()
            log.error("metastore: raft entry holds a key or value LMDB refuses; refused on every node",
                      extra={"index": index, "type": op, "err": str(e)})
            result, slots = C.ApplyResult(C.Result.INVALID, f"entry refused by the database: {e}"), set()
        except lmdb.Error:
            child.abort()
            raise
        except Exception as e:  # a bug: refuse deterministically rather than wedge Raft
            child.abort()
            log.exception("metastore: apply of entry failed; refused", extra={"index": index, "type": op})
            result, slots = C.ApplyResult(C.Result.REFUSED, f"internal error applying entry: {e}"), set()
        else:
            if result.code == C.Result.OK:
                child.commit()
                self._touched |= slots
            else:
                child.abort()
        result.index = index
        self._finish(txn, index, op, dec.request_id, dec.stamp_ms, result)
        return result

    def _finish(
        self, txn: lmdb.Transaction, index: int, op: int, request_id: str, stamp_ms: int,
        result: C.ApplyResult, record: bool = True,
    ) -> None:
        meta = self.dbs["fsm_meta"]
        txn.put(K_APPLIED, _U64.pack(index), db=meta)
        if op not in self.applied_types:
            self.applied_types = self.applied_types | {op}
            txn.put(K_TYPES, C.types_to_bits(self.applied_types), db=meta)
        if op > self.newest_type:
            self.newest_type = op
            txn.put(K_NEWEST, bytes([op]), db=meta)
        if request_id and record:
            self._remember_request(txn, request_id, stamp_ms, result)
        self.applied_index = index
        self._last_result = result

    def _remember_request(self, txn: lmdb.Transaction, rid: str, stamp_ms: int, result: C.ApplyResult) -> None:
        meta, reqs, times = self.dbs["fsm_meta"], self.dbs["requests"], self.dbs["request_times"]
        rkey = rid.encode()
        txn.put(rkey, _req_enc.encode((stamp_ms, result)), db=reqs)
        txn.put(_U64.pack(max(stamp_ms, 0)) + rkey, b"", db=times)
        max_stamp = max(self._meta_u64(txn, K_MAX_STAMP), stamp_ms)
        txn.put(K_MAX_STAMP, _U64.pack(max(max_stamp, 0)), db=meta)
        bound = _U64.pack(max(max_stamp - REQUEST_MEMORY_MS, 0))
        cur = txn.cursor(db=times)
        n = 0
        if cur.first():
            while n < PRUNE_PER_ENTRY and cur.key() < bound:
                txn.delete(cur.key()[8:], db=reqs)
                if not cur.delete():
                    break
                n += 1

    def _fail_stop(self, index: int, op: int, why: str) -> None:
        from narad import BUILD

        self.failed = FailStop(why, index=index, entry_type=op)
        log.error("metastore: stopped applying raft entries",
                  extra={"index": index, "type": op, "build": BUILD, "reason": why})
        if self._txn is not None:
            # Nothing of this batch is kept: a restart replays every entry of it.
            self._txn.abort()
            self._txn = None
            self.applied_index = self._batch_start_applied
            self.newest_type, self.applied_types = self._batch_start_types
        raise self.failed

    def _rebuild(self) -> lmdb.Error | None:
        """Abort the open batch and re-apply every entry of it into a fresh
        transaction. Returns the disk error if that failed too."""
        if self._txn is not None:
            try:
                self._txn.abort()
            except lmdb.Error:
                pass
        self._txn = None
        self.applied_index = self._batch_start_applied
        self.newest_type, self.applied_types = self._batch_start_types
        self._touched = set()
        try:
            self._txn = self.env.begin(write=True)
            for idx, data in list(self._batch):
                self._apply_one(idx, data)
        except lmdb.Error as e:
            return e
        return None

    def _retry_batch(self, first_error: Exception) -> None:
        """The disk refused a write: retry the whole batch (100 ms doubling to
        5 s, for up to 30 s), then fail-stop."""
        delay = DISK_RETRY_FIRST
        deadline = time.monotonic() + DISK_RETRY_BUDGET
        err: Exception = first_error
        while time.monotonic() < deadline:
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, DISK_RETRY_MAX_SLEEP)
            e = self._rebuild()
            if e is None:
                return
            err = e
        self._give_up(err)

    def _give_up(self, err: Exception) -> None:
        idx, data = self._batch[-1]
        self._fail_stop(idx, data[0] if data else 0, f"the disk refused a metastore write for 30 s: {err}")

    def commit(self) -> None:
        """Commit the open batch (one fsync), then report the slots it moved."""
        if self._txn is None:
            return
        delay = DISK_RETRY_FIRST
        deadline = time.monotonic() + DISK_RETRY_BUDGET
        whole = True  # False while a rebuild of the batch failed part way: never commit that
        while True:
            txn = self._txn
            try:
                if txn is None or not whole:
                    raise lmdb.Error("the batch could not be rebuilt yet")
                txn_id = txn.id()
                txn.put(K_TXN, _U64.pack(txn_id), db=self.dbs["fsm_meta"])
                txn.commit()
                self.applied_txn = txn_id
                break
            except lmdb.Error as e:
                if delay == DISK_RETRY_FIRST:  # logged once per episode
                    log.error("metastore: could not write raft entry; retrying", extra={"err": str(e)})
                if time.monotonic() >= deadline:
                    self._give_up(e)
                time.sleep(delay)
                delay = min(delay * 2, DISK_RETRY_MAX_SLEEP)
                whole = self._rebuild() is None
        self._txn = None
        self._batch = []
        touched, self._touched = self._touched, set()
        if self.on_commit is not None:
            self.on_commit(touched, self.applied_index)

    def abort(self) -> None:
        if self._txn is not None:
            self._txn.abort()
            self._txn = None
            self.applied_index = self._batch_start_applied
            self.newest_type, self.applied_types = self._batch_start_types
            self._touched = set()

    def snapshot_begin(self) -> tuple[lmdb.Transaction, int]:
        """Raft's thread: commit the open batch and pin a read transaction at the
        applied index; ``snapshot_write`` copies the database as of it while
        entries go on applying (LMDB keeps the pinned pages)."""
        self.commit()
        return self.env.begin(), self.applied_index

    def snapshot_write(self, fd: int, txn: lmdb.Transaction) -> None:
        """Any thread: append a copy of the database as of ``txn`` to ``fd`` (LMDB's
        own copy, compacting, no image in memory), then end ``txn``. An install or
        close waits for it."""
        with self._copying:
            try:
                self.env.copyfd(fd, compact=True, txn=txn)
            finally:
                txn.abort()

    def snapshot_to(self, fd: int) -> int:
        """Both steps on this thread; returns the index the copy holds."""
        txn, index = self.snapshot_begin()
        self.snapshot_write(fd, txn)
        return index

    def restore_from(self, path: str, offset: int, expected_index: int) -> None:
        """Install a snapshot image: stream it into ``<fsm>.restore``, sync it,
        check it holds ``expected_index``, then rename it over the FSM."""
        restore = self.path.with_name(self.path.name + ".restore")
        old = self.path.with_name(self.path.name + ".old")
        for d in (restore, old):
            _rmtree(d)
        restore.mkdir(mode=0o700)
        with open(path, "rb") as src, open(restore / "data.mdb", "wb") as dst:
            src.seek(offset)
            while True:
                chunk = src.read(1 << 20)
                if not chunk:
                    break
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        check = lmdb.open(str(restore), readonly=True, lock=False, max_dbs=len(DB_NAMES) + 4)
        try:
            meta = check.open_db(b"fsm_meta", create=False)
            with check.begin() as txn:
                raw = txn.get(K_APPLIED, db=meta)
                _, image_types = read_types(lambda k: txn.get(k, db=meta))
            got = _U64.unpack(raw)[0] if raw else 0
        finally:
            check.close()
        if got != expected_index:
            _rmtree(restore)
            raise RuntimeError(f"snapshot image holds index {got}, its header says {expected_index}")
        unknown = image_types - self.applies
        if unknown:
            _rmtree(restore)
            from narad import BUILD

            why = (f"a raft snapshot applied entry types {_ranges(unknown)}, which this node does not apply; "
                   "run the cluster's release on this node")
            self.failed = FailStop(why, index=expected_index, entry_type=max(unknown))
            log.error("metastore: stopped applying raft entries",
                      extra={"index": expected_index, "type": max(unknown), "build": BUILD, "reason": why})
            raise self.failed
        with self.swap_lock, self._copying:
            self.abort()
            self.env.close()
            os.replace(self.path, old)
            os.replace(restore, self.path)
            _fsync_dir(self.path.parent)
            _rmtree(old)
            self.env = open_env(self.path)
            self.dbs = open_dbs(self.env, create=True)
            with self.env.begin(write=True) as txn:
                # A compacting copy renumbers LMDB's transactions: the index in it is
                # this file's own again (the restore is this FSM writing its file).
                txn.put(K_TXN, _U64.pack(txn.id()), db=self.dbs["fsm_meta"])
            with self.env.begin() as txn:
                self.applied_index = self._meta_u64(txn, K_APPLIED)
                self.applied_txn = self._meta_u64(txn, K_TXN)
                self.newest_type, self.applied_types = read_types(lambda k: txn.get(k, db=self.dbs["fsm_meta"]))
        log.info("metastore: snapshot installed", extra={"index": self.applied_index})
        if self.on_replace is not None:
            self.on_replace()

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        self.abort()
        with self._copying:  # a snapshot copy still reading ends first
            self.env.close()

    # ---- handlers: (txn, payload, stamp_ms) -> (result, touched slots) ----
    def _noop(self, txn: Any, p: C.Noop, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        return _ok(), set()

    def _get_topic(self, txn: Any, name: str) -> R.TopicRecord | None:
        raw = txn.get(R.topic_key(name), db=self.dbs["topics"])
        return R.TOPIC_DEC.decode(raw) if raw else None

    def _put_topic(self, txn: Any, t: R.TopicRecord) -> None:
        txn.put(R.topic_key(t.name), R.ENCODER.encode(t), db=self.dbs["topics"])

    def _drop_prefix(self, txn: Any, db: str, prefix: bytes) -> None:
        cur = txn.cursor(db=self.dbs[db])
        freed = 0
        if cur.set_range(prefix):
            while cur.key().startswith(prefix):
                if db == "schemas":
                    freed += len(R.SCHEMA_DEC.decode(cur.value()).schema)
                if not cur.delete():
                    break
        if freed:
            self._schema_bytes_add(txn, -freed)

    def _schema_bytes(self, txn: Any) -> int:
        return self._meta_u64(txn, K_SCHEMA_BYTES)

    def _schema_bytes_add(self, txn: Any, delta: int) -> None:
        total = max(0, self._schema_bytes(txn) + delta)
        txn.put(K_SCHEMA_BYTES, _U64.pack(total), db=self.dbs["fsm_meta"])

    def _topic_schema_bytes(self, txn: Any, name: str) -> int:
        prefix = R.part_prefix(name)
        cur = txn.cursor(db=self.dbs["schemas"])
        total = 0
        if cur.set_range(prefix):
            for key, raw in cur:
                if not key.startswith(prefix):
                    break
                total += len(R.SCHEMA_DEC.decode(raw).schema)
        return total

    def _live_owner(self, txn: Any, node_id: str) -> bool:
        """A registered member that was not removed from the cluster."""
        return (txn.get(node_id.encode(), db=self.dbs["members"]) is not None
                and txn.get(node_id.encode(), db=self.dbs["removed_members"]) is None)

    def _create_topic(self, txn: Any, p: C.CreateTopic, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        t = p.topic
        # A new topic has no children, and only type 23 links one to a parent (a release
        # without fan-out drops those fields of a type-2 entry: so does this one).
        t.children = []
        t.parent, t.parent_id, t.delay_ms, t.attach_epoch, t.attach_offsets = None, None, 0, None, []
        return self._create_record(txn, p, stamp)

    def _create_record(self, txn: Any, p: C.CreateTopic, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        t = p.topic
        if t.partitions < 1:
            return _refuse(C.Result.INVALID, "partitions must be positive"), set()
        for part, owner in p.owners:
            if not 0 <= part < t.partitions or not owner:
                return _refuse(C.Result.INVALID, f"bad initial placement of partition {part}"), set()
        if self._get_topic(txn, t.name) is not None:
            return _refuse(C.Result.EXISTS, f'topic "{t.name}" already exists'), set()
        clash = txn.get(R.fold_key(t.name), db=self.dbs["topic_index"])
        if clash is not None:
            other = clash.decode()
            return _refuse(C.Result.EXISTS,
                           f'topic "{t.name}" clashes with existing topic "{other}" '
                           "(names are unique regardless of letter case)"), set()
        # Rows an earlier topic of this name may have left behind belong to no one.
        self._drop_prefix(txn, "assignments", R.part_prefix(t.name))
        self._drop_prefix(txn, "schemas", R.part_prefix(t.name))
        t.schema_version = 0
        if p.schema is not None:
            t.schema_version = 1
            rec = R.SchemaRecord(topic_id=t.id, version=1, schema=p.schema, registered_ms=stamp)
            txn.put(R.part_key(t.name, 1), R.ENCODER.encode(rec), db=self.dbs["schemas"])
            self._schema_bytes_add(txn, len(p.schema))
        self._put_topic(txn, t)
        txn.put(R.fold_key(t.name), t.name.encode(), db=self.dbs["topic_index"])
        adb = self.dbs["assignments"]
        for part, owner in p.owners:
            txn.put(R.part_key(t.name, part), R.ENCODER.encode(R.AssignmentRecord(owner, t.id)), db=adb)
        return _ok(), {V.TOPICS, V.SCHEMAS, V.ASSIGNMENTS, V.name_slot(t.name)}

    def _delete_topic(self, txn: Any, p: C.DeleteTopic, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        t = self._get_topic(txn, p.name)
        if t is None:
            return _refuse(C.Result.NOT_FOUND, f'topic "{p.name}" not found'), set()
        txn.delete(R.topic_key(p.name), db=self.dbs["topics"])
        txn.delete(R.fold_key(p.name), db=self.dbs["topic_index"])
        self._drop_prefix(txn, "assignments", R.part_prefix(p.name))
        self._drop_prefix(txn, "schemas", R.part_prefix(p.name))
        slots = {V.TOPICS, V.SCHEMAS, V.ASSIGNMENTS, V.name_slot(p.name)}
        # Fan-out links: every child of a deleted parent becomes standalone; a deleted
        # child leaves its parent's list (children are sorted: a deterministic order).
        for name in t.children:
            c = self._get_topic(txn, name)
            if c is not None and c.parent == t.name and c.parent_id == t.id:
                self._unlink(c)
                self._put_topic(txn, c)
                slots.add(V.name_slot(c.name))
        if t.parent is not None:
            par = self._get_topic(txn, t.parent)
            if par is not None and par.id == t.parent_id and t.name in par.children:
                par.children = [n for n in par.children if n != t.name]
                par.revision += 1
                self._put_topic(txn, par)
                slots.add(V.name_slot(par.name))
        return _ok(), slots

    def _update_topic(self, txn: Any, p: C.UpdateTopic, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        t = self._get_topic(txn, p.name)
        if t is None:
            return _refuse(C.Result.NOT_FOUND, f'topic "{p.name}" not found'), set()
        if p.partitions is not None:
            if p.partitions < t.partitions:
                return _refuse(C.Result.INVALID, "the partition count can only grow"), set()
            t.partitions = p.partitions
        if p.retention_ms is not None:
            t.retention_ms = p.retention_ms
        if p.max_in_flight_per_partition is not None:
            t.max_in_flight_per_partition = p.max_in_flight_per_partition
        if p.max_acked_ahead_per_partition is not None:
            t.max_acked_ahead_per_partition = p.max_acked_ahead_per_partition
        t.revision += 1
        self._put_topic(txn, t)
        return _ok(), {V.TOPICS, V.name_slot(t.name)}

    def _put_schema(self, txn: Any, p: C.PutSchema, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        t = self._get_topic(txn, p.name)
        if t is None:
            return _refuse(C.Result.NOT_FOUND, f'topic "{p.name}" not found'), set()
        if p.version != t.schema_version + 1:
            return _refuse(C.Result.CHANGED, f"schema version {p.version} is not {t.schema_version} + 1"), set()
        if p.version > SCHEMA_VERSION_CAP:
            return _refuse(C.Result.INVALID, f"a topic keeps at most {SCHEMA_VERSION_CAP} schema versions"), set()
        children = self._linked_children(txn, t)
        for c in children:
            if c.schema_version + 1 > SCHEMA_VERSION_CAP:
                return _refuse(C.Result.INVALID, f'child "{c.name}" keeps at most {SCHEMA_VERSION_CAP} schema '
                                                 "versions"), set()
        slots = {V.TOPICS, V.SCHEMAS, V.name_slot(t.name)}
        # A parent manages its children's schemas: the same version goes to each of them.
        for topic_rec in [t, *children]:
            version = topic_rec.schema_version + 1
            rec = R.SchemaRecord(topic_id=topic_rec.id, version=version, schema=p.schema, registered_ms=stamp)
            txn.put(R.part_key(topic_rec.name, version), R.ENCODER.encode(rec), db=self.dbs["schemas"])
            self._schema_bytes_add(txn, len(p.schema))
            topic_rec.schema_version = version
            topic_rec.revision += 1
            self._put_topic(txn, topic_rec)
            slots.add(V.name_slot(topic_rec.name))
        return _ok(), slots

    def _linked_children(self, txn: Any, t: R.TopicRecord) -> list[R.TopicRecord]:
        """The children of ``t`` that are linked to this incarnation, in name order."""
        out = []
        for name in t.children:
            c = self._get_topic(txn, name)
            if c is not None and c.parent == t.name and c.parent_id == t.id:
                out.append(c)
        return out

    @staticmethod
    def _unlink(c: R.TopicRecord) -> None:
        c.parent, c.parent_id, c.delay_ms, c.attach_epoch, c.attach_offsets = None, None, 0, None, []
        c.revision += 1

    def _assign(self, txn: Any, p: C.AssignPartitions, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        t = self._get_topic(txn, p.name)
        if t is None or t.id != p.topic_id:
            return _refuse(C.Result.CHANGED, f'topic "{p.name}" changed since the placement was computed'), set()
        for part, owner in p.owners:
            if not 0 <= part < t.partitions:
                return _refuse(C.Result.INVALID, f"partition {part} is not in topic {p.name}"), set()
            if not owner:
                return _refuse(C.Result.INVALID, "empty owner"), set()
        db = self.dbs["assignments"]
        for part, owner in p.owners:
            txn.put(R.part_key(t.name, part), R.ENCODER.encode(R.AssignmentRecord(owner, t.id)), db=db)
        return _ok(), {V.ASSIGNMENTS, V.name_slot(t.name)}

    def _get_member(self, txn: Any, node_id: str) -> R.MemberRecord | None:
        raw = txn.get(node_id.encode(), db=self.dbs["members"])
        return R.MEMBER_DEC.decode(raw) if raw else None

    def _register_member(self, txn: Any, p: C.RegisterMember, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        m = p.member
        if txn.get(m.id.encode(), db=self.dbs["removed_members"]) is not None:
            return _refuse(C.Result.REFUSED, f"member {m.id} was removed from the cluster"), set()
        old = self._get_member(txn, m.id)
        m.registered_ms = old.registered_ms if old else stamp
        m.heartbeat_ms = stamp
        m.status = "alive"
        # A decommission's mark survives re-registration (only type 41 sets or clears it);
        # the backlog is what the member's heartbeats report.
        m.draining = old.draining if old else False
        m.dispatch_backlog = old.dispatch_backlog if old else -1
        txn.put(m.id.encode(), R.ENCODER.encode(m), db=self.dbs["members"])
        return _ok(), {V.MEMBERS}

    def _heartbeat(self, txn: Any, p: C.Heartbeat, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        if txn.get(p.node_id.encode(), db=self.dbs["removed_members"]) is not None:
            return _refuse(C.Result.REFUSED, f"member {p.node_id} was removed from the cluster"), set()
        m = self._get_member(txn, p.node_id)
        if m is None:
            return _refuse(C.Result.NOT_FOUND, f"member {p.node_id} is not registered"), set()
        m.heartbeat_ms = stamp
        m.dispatch_backlog = p.dispatch_backlog
        m.build = p.build
        m.newest_entry_type = p.newest_entry_type
        m.entry_types = sorted(set(p.entry_types))
        if p.client_addr:
            m.client_addr = p.client_addr
        if p.cluster_addr:
            m.cluster_addr = p.cluster_addr
        slots = {V.MEMBERS} if m.status != "alive" else set()
        m.status = "alive"
        txn.put(m.id.encode(), R.ENCODER.encode(m), db=self.dbs["members"])
        # Heartbeats change no cached view unless a member came back to life.
        return _ok(), slots

    def _mark_dead(self, txn: Any, p: C.MarkDead, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        m = self._get_member(txn, p.node_id)
        if m is None:
            return _refuse(C.Result.NOT_FOUND, f"member {p.node_id} is not registered"), set()
        m.status = "dead"
        txn.put(m.id.encode(), R.ENCODER.encode(m), db=self.dbs["members"])
        return _ok(), {V.MEMBERS}

    def _get_user(self, txn: Any, name: str) -> R.UserRecord | None:
        raw = txn.get(name.encode(), db=self.dbs["users"])
        return R.USER_DEC.decode(raw) if raw else None

    def _create_user(self, txn: Any, p: C.CreateUser, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        u = p.user
        if self._get_user(txn, u.username) is not None:
            return _refuse(C.Result.EXISTS, f'user "{u.username}" already exists'), set()
        if u.root:
            cur = txn.cursor(db=self.dbs["users"])
            for _, raw in cur:
                if R.USER_DEC.decode(raw).root:
                    return _refuse(C.Result.EXISTS, "the root admin already exists"), set()
        u.created_at_ms = u.updated_at_ms = stamp
        txn.put(u.username.encode(), R.ENCODER.encode(u), db=self.dbs["users"])
        return _ok(), {V.USERS}

    def _update_grants(self, txn: Any, p: C.UpdateGrants, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        u = self._get_user(txn, p.username)
        if u is None:
            return _refuse(C.Result.NOT_FOUND, f'user "{p.username}" not found'), set()
        if u.root:
            return _refuse(C.Result.REFUSED, "the root admin's grants cannot change"), set()
        u.grants = list(p.grants)
        u.updated_at_ms = stamp
        txn.put(u.username.encode(), R.ENCODER.encode(u), db=self.dbs["users"])
        return _ok(), {V.USERS}

    def _update_password(self, txn: Any, p: C.UpdatePassword, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        u = self._get_user(txn, p.username)
        if u is None:
            return _refuse(C.Result.NOT_FOUND, f'user "{p.username}" not found'), set()
        u.password_hash = p.password_hash
        u.updated_at_ms = stamp
        txn.put(u.username.encode(), R.ENCODER.encode(u), db=self.dbs["users"])
        return _ok(), {V.USERS}

    def _delete_user(self, txn: Any, p: C.DeleteUser, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        u = self._get_user(txn, p.username)
        if u is None:
            return _refuse(C.Result.NOT_FOUND, f'user "{p.username}" not found'), set()
        if u.root:
            return _refuse(C.Result.REFUSED, "the root admin cannot be deleted"), set()
        txn.delete(p.username.encode(), db=self.dbs["users"])
        return _ok(), {V.USERS}

    # ---- compare-and-set types (23-32) ---------------------------------------------------
    def _create_topic_checked(self, txn: Any, p: C.CreateTopicChecked,
                              stamp: int) -> tuple[C.ApplyResult, set[int]]:
        for part, owner in p.owners:
            if not self._live_owner(txn, owner):
                return _refuse(C.Result.CHANGED, f"partition {part}'s owner {owner} is not a member "
                                                 "(removed, or never registered)"), set()
        t = p.topic
        t.children = []
        if t.parent is None:
            t.parent_id, t.delay_ms, t.attach_epoch, t.attach_offsets = None, 0, None, []
            if p.schema is not None and len(p.schema) > SCHEMA_TOPIC_BYTES:
                return _refuse(C.Result.INVALID,
                               f"a topic's schemas may hold at most {SCHEMA_TOPIC_BYTES} bytes"), set()
            if p.schema is not None and self._schema_bytes(txn) + len(p.schema) > SCHEMA_CLUSTER_BYTES:
                return _refuse(C.Result.INVALID,
                               f"the cluster's schemas may hold at most {SCHEMA_CLUSTER_BYTES} bytes"), set()
            return self._create_record(txn, C.CreateTopic(t, p.schema, p.owners), stamp)
        # Create-as-child: the record, the parent's schema history and the link in one
        # transaction, only while the parent is the incarnation the create was checked against.
        par, res = self._checked_topic(txn, t.parent, t.parent_id or "")
        if par is None:
            return res, set()
        if len(t.attach_offsets) != par.partitions:
            return _refuse(C.Result.CHANGED, f'topic "{par.name}" changed since it was read (it has '
                                             f"{par.partitions} partitions, the attach point names "
                                             f"{len(t.attach_offsets)})"), set()
        why = link_refusal(par, t, t.delay_ms)
        if why is not None:
            return _refuse(C.Result.INVALID, why), set()
        history = self._schema_history(txn, par.name)
        if p.schema is not None:
            if not history:
                return _refuse(C.Result.INVALID, f'topic "{t.name}" would have a schema and its parent '
                                                 f'"{par.name}" has none'), set()
            if not schema_docs_same(history[-1].schema, p.schema):
                return _refuse(C.Result.INVALID, f'the schema of "{t.name}" differs from the schema of its parent '
                                                 f'"{par.name}"; leave it out to adopt the parent\'s'), set()
        why = self._adopt_budget(txn, t.name, history)
        if why is not None:
            return _refuse(C.Result.INVALID, why), set()
        res, slots = self._create_record(txn, C.CreateTopic(t, None, p.owners), stamp)
        if not res.ok:
            return res, slots
        created = self._get_topic(txn, t.name)
        assert created is not None
        self._adopt(txn, created, history)
        self._put_topic(txn, created)
        self._add_child(txn, par, created.name)
        return _ok(), slots | {V.SCHEMAS, V.name_slot(par.name)}

    # ---- fan-out links (23, 27, 28) ---------------------------------------------------------
    def _schema_history(self, txn: Any, name: str) -> list[R.SchemaRecord]:
        prefix = R.part_prefix(name)
        cur = txn.cursor(db=self.dbs["schemas"])
        out: list[R.SchemaRecord] = []
        if cur.set_range(prefix):
            for key, raw in cur:
                if not key.startswith(prefix):
                    break
                out.append(R.SCHEMA_DEC.decode(raw))
        return out

    def _adopt_budget(self, txn: Any, child: str, history: list[R.SchemaRecord]) -> str | None:
        """Why the child cannot hold a copy of ``history`` (None: it can)."""
        size = sum(len(s.schema) for s in history)
        if not size:
            return None
        if self._topic_schema_bytes(txn, child) + size > SCHEMA_TOPIC_BYTES:
            return f'topic "{child}" would hold more than {SCHEMA_TOPIC_BYTES} bytes of schema versions'
        if self._schema_bytes(txn) + size > SCHEMA_CLUSTER_BYTES:
            return f"the cluster would hold more than {SCHEMA_CLUSTER_BYTES} bytes of schema versions"
        return None

    def _adopt(self, txn: Any, child: R.TopicRecord, history: list[R.SchemaRecord]) -> None:
        """Copy the parent's schema history into a child without one."""
        db = self.dbs["schemas"]
        self._drop_prefix(txn, "schemas", R.part_prefix(child.name))
        for s in history:
            rec = R.SchemaRecord(topic_id=child.id, version=s.version, schema=s.schema, registered_ms=s.registered_ms)
            txn.put(R.part_key(child.name, s.version), R.ENCODER.encode(rec), db=db)
        self._schema_bytes_add(txn, sum(len(s.schema) for s in history))
        child.schema_version = history[-1].version if history else 0

    def _add_child(self, txn: Any, par: R.TopicRecord, child: str) -> None:
        par.children = sorted({*par.children, child})
        par.revision += 1
        self._put_topic(txn, par)

    def _attach_child_cas(self, txn: Any, p: C.AttachChildCas, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        par, res = self._checked_topic(txn, p.parent, p.parent_id)
        if par is None:
            return res, set()
        child, res = self._checked_topic(txn, p.child, p.child_id)
        if child is None:
            return res, set()
        if len(p.attach_offsets) != par.partitions:
            return _refuse(C.Result.CHANGED, f'topic "{par.name}" changed since it was read (it has '
                                             f"{par.partitions} partitions, the attach point names "
                                             f"{len(p.attach_offsets)})"), set()
        if child.parent is not None:
            return _refuse(C.Result.INVALID, f'topic "{child.name}" already has a parent ("{child.parent}"); '
                                             "a child has exactly one parent"), set()
        why = link_refusal(par, child, p.delay_ms)
        if why is not None:
            return _refuse(C.Result.INVALID, why), set()
        slots = {V.TOPICS, V.name_slot(par.name), V.name_slot(child.name)}
        parent_history = self._schema_history(txn, par.name)
        if child.schema_version:
            if not parent_history:
                return _refuse(C.Result.INVALID, f'topic "{child.name}" has a schema and its parent "{par.name}" '
                                                 "has none"), set()
            mine = self._schema_history(txn, child.name)
            if len(mine) != len(parent_history) or not all(
                    schema_docs_same(a.schema, b.schema) for a, b in zip(mine, parent_history, strict=True)):
                return _refuse(C.Result.INVALID, f'the schema history of "{child.name}" differs from the schema '
                                                 f'history of its parent "{par.name}"'), set()
        elif parent_history:
            why = self._adopt_budget(txn, child.name, parent_history)
            if why is not None:
                return _refuse(C.Result.INVALID, why), set()
            self._adopt(txn, child, parent_history)
            slots.add(V.SCHEMAS)
        child.parent, child.parent_id, child.delay_ms = par.name, par.id, p.delay_ms
        child.attach_epoch, child.attach_offsets = p.epoch, list(p.attach_offsets)
        child.revision += 1
        self._put_topic(txn, child)
        self._add_child(txn, par, child.name)
        return _ok(), slots

    def _detach_child_cas(self, txn: Any, p: C.DetachChildCas, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        par, res = self._checked_topic(txn, p.parent, p.parent_id)
        if par is None:
            return res, set()
        child, res = self._checked_topic(txn, p.child, p.child_id)
        if child is None:
            return res, set()
        if child.parent != par.name or child.parent_id != par.id or child.name not in par.children:
            return _refuse(C.Result.CHANGED, f'topic "{child.name}" is not a child of "{par.name}"'), set()
        # The child keeps its data and schema history; only the link goes.
        self._unlink(child)
        self._put_topic(txn, child)
        par.children = [n for n in par.children if n != child.name]
        par.revision += 1
        self._put_topic(txn, par)
        return _ok(), {V.TOPICS, V.name_slot(par.name), V.name_slot(child.name)}

    def _checked_topic(self, txn: Any, name: str, topic_id: str) -> tuple[R.TopicRecord | None, C.ApplyResult]:
        t = self._get_topic(txn, name)
        if t is None:
            return None, _refuse(C.Result.CHANGED, f'topic "{name}" changed since it was read (it is gone)')
        if t.id != topic_id:
            return None, _refuse(C.Result.CHANGED, f'topic "{name}" changed since it was read '
                                                   f"(incarnation {t.id}, the write was checked against {topic_id})")
        return t, _ok()

    def _update_topic_cas(self, txn: Any, p: C.UpdateTopicCas, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        t, res = self._checked_topic(txn, p.name, p.topic_id)
        if t is None:
            return res, set()
        if p.retention_ms is not None:
            for c in self._linked_children(txn, t):
                why = delay_retention_refusal(t.name, p.retention_ms, c.name, c.delay_ms)
                if why is not None:
                    return _refuse(C.Result.INVALID, why), set()
        return self._update_topic(txn, C.UpdateTopic(p.name, p.retention_ms, p.max_in_flight_per_partition,
                                                     p.max_acked_ahead_per_partition, p.partitions), stamp)

    def _delete_topic_cas(self, txn: Any, p: C.DeleteTopicCas, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        t, res = self._checked_topic(txn, p.name, p.topic_id)
        if t is None:
            return res, set()
        return self._delete_topic(txn, C.DeleteTopic(p.name), stamp)

    def _put_schema_cas(self, txn: Any, p: C.PutSchemaCas, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        t, res = self._checked_topic(txn, p.name, p.topic_id)
        if t is None:
            return res, set()
        if t.parent is not None:
            return _refuse(C.Result.INVALID, f'the schema of "{t.name}" is managed by its parent "{t.parent}"'), set()
        children = self._linked_children(txn, t)
        # Each child's copy counts against the child's budget and the cluster's.
        for name in [t.name, *(c.name for c in children)]:
            if self._topic_schema_bytes(txn, name) + len(p.schema) > SCHEMA_TOPIC_BYTES:
                return _refuse(C.Result.INVALID, f'topic "{name}" would hold more than {SCHEMA_TOPIC_BYTES} '
                                                 "bytes of schema versions"), set()
        if self._schema_bytes(txn) + len(p.schema) * (1 + len(children)) > SCHEMA_CLUSTER_BYTES:
            return _refuse(C.Result.INVALID, f"the cluster would hold more than {SCHEMA_CLUSTER_BYTES} bytes "
                                             "of schema versions"), set()
        return self._put_schema(txn, C.PutSchema(p.name, p.version, p.schema), stamp)

    def _place_partitions(self, txn: Any, p: C.PlacePartitions, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        t, res = self._checked_topic(txn, p.name, p.topic_id)
        if t is None:
            return res, set()
        db = self.dbs["assignments"]
        for part, owner in p.owners:
            if not 0 <= part < t.partitions:
                return _refuse(C.Result.INVALID, f"partition {part} is not in topic {p.name}"), set()
            if not self._live_owner(txn, owner):
                return _refuse(C.Result.CHANGED, f"{owner} is not a member (removed, or never registered)"), set()
            raw = txn.get(R.part_key(t.name, part), db=db)
            if raw is not None and R.ASSIGN_DEC.decode(raw).topic_id == t.id:
                return _refuse(C.Result.CHANGED, f"partition {part} of {p.name} already has an owner"), set()
        for part, owner in p.owners:
            txn.put(R.part_key(t.name, part), R.ENCODER.encode(R.AssignmentRecord(owner, t.id)), db=db)
        return _ok(), {V.ASSIGNMENTS, V.name_slot(t.name)}

    def _prune_assignments(self, txn: Any, p: C.PruneAssignments, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        db = self.dbs["assignments"]
        keys = []
        for name, part in p.rows:
            key = R.part_key(name, part)
            raw = txn.get(key, db=db)
            if raw is None:
                continue
            t = self._get_topic(txn, name)
            if t is not None and t.id == R.ASSIGN_DEC.decode(raw).topic_id and 0 <= part < t.partitions:
                return _refuse(C.Result.CHANGED, f"assignment {name}/{part} belongs to a live partition"), set()
            keys.append(key)
        for key in keys:
            txn.delete(key, db=db)
        return _ok(), {V.ASSIGNMENTS} | {V.name_slot(name) for name, _ in p.rows}

    def _mark_dead_observed(self, txn: Any, p: C.MarkDeadObserved, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        m = self._get_member(txn, p.node_id)
        if m is None:
            return _refuse(C.Result.NOT_FOUND, f"member {p.node_id} is not registered"), set()
        if m.heartbeat_ms > p.heartbeat_ms:
            return _refuse(C.Result.CHANGED, f"member {p.node_id} heartbeat after it was judged silent"), set()
        return self._mark_dead(txn, C.MarkDead(p.node_id), stamp)

    def _delete_user_releasing(self, txn: Any, p: C.DeleteUserReleasing,
                               stamp: int) -> tuple[C.ApplyResult, set[int]]:
        res, slots = self._delete_user(txn, C.DeleteUser(p.username), stamp)
        if not res.ok:
            return res, slots
        cur = txn.cursor(db=self.dbs["topics"])
        owned = []
        for _, raw in cur:
            t = R.TOPIC_DEC.decode(raw)
            if t.owner == p.username:
                owned.append(t)
        for t in owned:  # in key order: deterministic
            t.owner = None
            t.revision += 1
            self._put_topic(txn, t)
            slots |= {V.TOPICS, V.name_slot(t.name)}
        return _ok(f"{len(owned)} topics released"), slots


    # ---- partition moves and decommission (39-42) ------------------------------------------
    def _live_row(self, txn: Any, topic: str, topic_id: str,
                  partition: int) -> tuple[R.AssignmentRecord | None, str]:
        """The assignment row of a live partition of incarnation ``topic_id`` (None and why not)."""
        t = self._get_topic(txn, topic)
        if t is None or t.id != topic_id:
            return None, f'topic "{topic}" incarnation {topic_id} is gone'
        if not 0 <= partition < t.partitions:
            return None, f'partition {partition} is not in topic "{topic}"'
        raw = txn.get(R.part_key(topic, partition), db=self.dbs["assignments"])
        row = R.ASSIGN_DEC.decode(raw) if raw is not None else None
        if row is None or row.topic_id != topic_id:
            return None, f"{topic}/{partition} has no owner on record"
        return row, ""

    def _set_move_targets(self, txn: Any, p: C.SetMoveTargets, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        seen: set[tuple[str, int]] = set()
        rows: list[tuple[C.MoveTargetRow, R.AssignmentRecord]] = []
        for mv in p.rows:  # every row is checked before any is written
            if (mv.topic, mv.partition) in seen:
                return _refuse(C.Result.INVALID, f"{mv.topic}/{mv.partition} is listed twice"), set()
            seen.add((mv.topic, mv.partition))
            row, why = self._live_row(txn, mv.topic, mv.topic_id, mv.partition)
            if row is None:
                return _refuse(C.Result.CHANGED, f"{why} (move target of {mv.topic}/{mv.partition})"), set()
            if row.owner != mv.owner or row.target != mv.expect_target:
                return _refuse(C.Result.CHANGED, f"{mv.topic}/{mv.partition} changed since it was read (owner "
                                                 f"{row.owner}, target {row.target})"), set()
            if mv.target is not None and (mv.target == row.owner or not self._live_owner(txn, mv.target)):
                return _refuse(C.Result.CHANGED, f"{mv.target} cannot receive {mv.topic}/{mv.partition} (the "
                                                 "owner itself, removed, or never registered)"), set()
            rows.append((mv, row))
        slots = {V.ASSIGNMENTS} if rows else set()
        for mv, row in rows:
            row.target = mv.target
            txn.put(R.part_key(mv.topic, mv.partition), R.ENCODER.encode(row), db=self.dbs["assignments"])
            slots.add(V.name_slot(mv.topic))
        return _ok(), slots

    def _complete_move(self, txn: Any, p: C.CompleteMove, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        row, why = self._live_row(txn, p.topic, p.topic_id, p.partition)
        if row is None:
            return _refuse(C.Result.NOT_FOUND, why), set()
        if row.owner == p.target and row.target is None:
            return _ok("done"), set()  # a retried flip that already happened
        if row.owner != p.source or row.target != p.target:
            return _refuse(C.Result.CHANGED, f"{p.topic}/{p.partition} is owned by {row.owner} with target "
                                             f"{row.target}, not {p.source} -> {p.target}"), set()
        if p.source_heartbeat_ms >= 0:  # a force-promote: only while the source stays silent
            src = self._get_member(txn, p.source)
            if src is not None and (src.status == "alive" or src.heartbeat_ms > p.source_heartbeat_ms):
                return _refuse(C.Result.CHANGED, f"the source {p.source} is alive again (heartbeat after it was "
                                                 "judged dead): no force-promote"), set()
        row.owner, row.target = p.target, None
        txn.put(R.part_key(p.topic, p.partition), R.ENCODER.encode(row), db=self.dbs["assignments"])
        return _ok(), {V.ASSIGNMENTS, V.name_slot(p.topic)}

    def _set_draining(self, txn: Any, p: C.SetDraining, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        m = self._get_member(txn, p.node_id)
        if m is None:
            return _refuse(C.Result.NOT_FOUND, f"member {p.node_id} is not registered"), set()
        if m.draining == p.draining:
            return _ok("unchanged"), set()
        m.draining = p.draining
        txn.put(m.id.encode(), R.ENCODER.encode(m), db=self.dbs["members"])
        return _ok(), {V.MEMBERS}

    # ---- delivery settings (43) ----------------------------------------------------------------
    def _set_delivery(self, txn: Any, p: C.SetDelivery, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        t, res = self._checked_topic(txn, p.name, p.topic_id)
        if t is None:
            return res, set()
        dlt = t.dead_letter_topic if p.dead_letter_topic is None else (p.dead_letter_topic or None)
        maxd = t.max_deliveries if p.max_deliveries is None else p.max_deliveries
        if dlt is not None and p.dead_letter_topic:
            if dlt == t.name:
                return _refuse(C.Result.INVALID, f'topic "{t.name}" cannot be its own dead-letter topic'), set()
            d = self._get_topic(txn, dlt)
            if d is None:
                return _refuse(C.Result.INVALID, f'dead-letter topic "{dlt}" not found'), set()
            if d.parent is not None:
                return _refuse(C.Result.INVALID, f'dead-letter topic "{dlt}" is a fan-out child of "{d.parent}": '
                                                 f"only its parent feeds it"), set()
        if maxd > 0 and dlt is None:
            return _refuse(C.Result.INVALID, "max_deliveries needs a dead_letter_topic (a record past its last "
                                             "delivery goes there, it is never dropped)"), set()
        t.max_deliveries = maxd
        t.dead_letter_topic = dlt
        if p.idempotency_window_ms is not None:
            t.idempotency_window_ms = p.idempotency_window_ms
        t.revision += 1
        self._put_topic(txn, t)
        return _ok(), {V.TOPICS, V.name_slot(t.name)}

    def _remove_member(self, txn: Any, p: C.RemoveMember, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        key = p.node_id.encode()
        removed = self.dbs["removed_members"]
        if p.clear_tombstone:
            if txn.get(key, db=removed) is None:
                return _ok("no tombstone"), set()
            txn.delete(key, db=removed)
            return _ok(), {V.REMOVED_MEMBERS}
        if self._get_member(txn, p.node_id) is None:
            return _refuse(C.Result.NOT_FOUND, f"member {p.node_id} is not registered"), set()
        topics: dict[str, R.TopicRecord | None] = {}
        for k, raw in txn.cursor(db=self.dbs["assignments"]):  # key order: deterministic
            row = R.ASSIGN_DEC.decode(raw)
            if row.owner != p.node_id and row.target != p.node_id:
                continue
            name, part = R.split_part_key(bytes(k))
            if name not in topics:
                topics[name] = self._get_topic(txn, name)
            t = topics[name]
            if t is not None and t.id == row.topic_id and 0 <= part < t.partitions:  # orphan rows do not count
                return _refuse(C.Result.CHANGED, f"member {p.node_id} still owns or receives {name}/{part}"), set()
        txn.delete(key, db=self.dbs["members"])
        txn.put(key, R.ENCODER.encode(R.RemovedMember(p.node_id, stamp)), db=removed)
        return _ok(), {V.MEMBERS, V.REMOVED_MEMBERS}

    # ---- disaster recovery (38) ------------------------------------------------------------
    def _clear_db(self, txn: Any, name: str) -> None:
        cur = txn.cursor(db=self.dbs[name])
        if cur.first():
            while cur.delete():
                pass

    def _import_metastore(self, txn: Any, p: C.ImportMetastore, stamp: int) -> tuple[C.ApplyResult, set[int]]:
        users_db, topics_db = self.dbs["users"], self.dbs["topics"]
        topics_held = int(txn.stat(topics_db)["entries"])
        users_held = [R.USER_DEC.decode(raw) for _, raw in txn.cursor(db=users_db)]
        others = [u for u in users_held if not u.root]
        if not p.overwrite and (topics_held or others):
            return _refuse(C.Result.EXISTS, f"the cluster holds state ({topics_held} topics, {len(others)} users "
                                            "besides the root admin); import into an empty cluster, or overwrite "
                                            "it"), set()
        # Check everything before writing anything (the child transaction is
        # dropped on a refusal anyway).
        folded: set[bytes] = set()
        by_name: dict[str, R.TopicRecord] = {}
        for t in p.topics:
            if t.partitions < 1 or not t.name or t.name in by_name or R.fold_key(t.name) in folded:
                return _refuse(C.Result.INVALID, f'topic "{t.name}" is invalid or listed twice'), set()
            folded.add(R.fold_key(t.name))
            by_name[t.name] = t
        for sc in p.schemas:
            owner = by_name.get(sc.topic)
            if owner is None or sc.schema.topic_id != owner.id or not 1 <= sc.schema.version <= owner.schema_version:
                return _refuse(C.Result.INVALID, f'schema version {sc.schema.version} of "{sc.topic}" belongs to '
                                                 "no imported topic"), set()
        roots = {u.username for u in users_held if u.root}
        if p.overwrite:
            for name in ("topics", "topic_index", "schemas", "assignments"):
                self._clear_db(txn, name)
            for u in others:
                txn.delete(u.username.encode(), db=users_db)
            txn.put(K_SCHEMA_BYTES, _U64.pack(0), db=self.dbs["fsm_meta"])
        schema_bytes = 0
        for t in p.topics:
            self._put_topic(txn, t)
            txn.put(R.fold_key(t.name), t.name.encode(), db=self.dbs["topic_index"])
        for sc in p.schemas:
            txn.put(R.part_key(sc.topic, sc.schema.version), R.ENCODER.encode(sc.schema), db=self.dbs["schemas"])
            schema_bytes += len(sc.schema.schema)
        self._schema_bytes_add(txn, schema_bytes)
        placed = 0
        for a in p.assignments:
            target = by_name.get(a.topic)
            # Rows for another incarnation, a partition out of range, or a node that is not
            # a member of this cluster are left out: the leader places those partitions.
            if (target is None or a.assignment.topic_id != target.id or not 0 <= a.partition < target.partitions
                    or not self._live_owner(txn, a.assignment.owner)):
                continue
            txn.put(R.part_key(a.topic, a.partition), R.ENCODER.encode(a.assignment), db=self.dbs["assignments"])
            placed += 1
        imported_users = 0
        for u in p.users:
            if u.root or u.username in roots:
                continue  # this cluster's root admin stays
            u.root = False
            txn.put(u.username.encode(), R.ENCODER.encode(u), db=users_db)
            imported_users += 1
        slots = {V.TOPICS, V.SCHEMAS, V.ASSIGNMENTS, V.USERS} | set(range(V.NAME_BASE, V.NAME_BASE + V.NAME_SLOTS))
        return _ok(f"imported {len(p.topics)} topics, {len(p.schemas)} schema versions, {placed} assignments, "
                   f"{imported_users} users"), slots

def fsm_dir(data_dir: Path) -> Path:
    return Path(data_dir) / "metastore" / "fsm"


def _rmtree(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_leftovers(path: Path) -> None:
    """Delete snapshot copies and half-written restores a crash left beside the
    FSM, and half-written snapshot files in ``raft/snapshots/`` (``*.tmp``: a
    snapshot being written, a received one, a previous.snap link)."""
    parent = path.parent
    if not parent.exists():
        return
    transient = (path.name + ".restore", path.name + ".old")
    leftovers = [p for p in parent.iterdir() if p.name.startswith(path.name + ".snapshot-") or p.name in transient]
    snaps = parent / "raft" / "snapshots"
    if snaps.is_dir():
        leftovers += [p for p in snaps.iterdir() if p.name.endswith((".tmp", ".part"))]
    for p in leftovers:
        _rmtree(p)
        log.info("metastore: removed leftover %s", p)
