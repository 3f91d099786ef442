"""The metastore's read side: what workers (and the supervisor's checks) read.

``Reader`` answers questions inside one short LMDB read transaction.
``MetaStore`` owns an environment (a worker opens the FSM read-only after
fork; the supervisor shares its writer's) and keeps caches of hot lookups
(topic records, assignments, users) that are validated against the shared
version counters with one atomic load per lookup: a per-topic-name slot for
topics and their assignments, the users domain slot for users. When the FSM
file is replaced (snapshot install) the epoch slot moves and the store
reopens its environment.

Never writes. Imports narad.meta.{fsm,records,versions}.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb

from narad.meta import commands as C
from narad.meta import fsm as F
from narad.meta import records as R
from narad.meta import versions as V

_CACHE_LIMIT = 100_000


class Reader:
    def __init__(self, txn: lmdb.Transaction, dbs: dict[str, Any]) -> None:
        self.txn = txn
        self.dbs = dbs

    def topic(self, name: str) -> R.TopicRecord | None:
        raw = self.txn.get(R.topic_key(name), db=self.dbs["topics"])
        return R.TOPIC_DEC.decode(raw) if raw else None

    def topic_clash(self, name: str) -> str | None:
        """The existing topic whose name equals ``name`` ignoring letter case."""
        raw = self.txn.get(R.fold_key(name), db=self.dbs["topic_index"])
        return raw.decode() if raw else None

    def topics(self, start: str = "", limit: int | None = None) -> list[R.TopicRecord]:
        out: list[R.TopicRecord] = []
        cur = self.txn.cursor(db=self.dbs["topics"])
        if not cur.set_range(start.encode()):
            return out
        for _, raw in cur:
            out.append(R.TOPIC_DEC.decode(raw))
            if limit is not None and len(out) >= limit:
                break
        return out

    def topic_count(self) -> int:
        return int(self.txn.stat(self.dbs["topics"])["entries"])

    def assignments(self, name: str) -> dict[int, R.AssignmentRecord]:
        out: dict[int, R.AssignmentRecord] = {}
        prefix = R.part_prefix(name)
        cur = self.txn.cursor(db=self.dbs["assignments"])
        if cur.set_range(prefix):
            for key, raw in cur:
                if not key.startswith(prefix):
                    break
                _, part = R.split_part_key(key)
                out[part] = R.ASSIGN_DEC.decode(raw)
        return out

    def all_assignments(self) -> Iterator[tuple[str, int, R.AssignmentRecord]]:
        cur = self.txn.cursor(db=self.dbs["assignments"])
        for key, raw in cur:
            name, part = R.split_part_key(key)
            yield name, part, R.ASSIGN_DEC.decode(raw)

    def schemas(self, name: str) -> list[R.SchemaRecord]:
        out: list[R.SchemaRecord] = []
        prefix = R.part_prefix(name)
        cur = self.txn.cursor(db=self.dbs["schemas"])
        if cur.set_range(prefix):
            for key, raw in cur:
                if not key.startswith(prefix):
                    break
                out.append(R.SCHEMA_DEC.decode(raw))
        return out

    def schema(self, name: str, version: int) -> R.SchemaRecord | None:
        raw = self.txn.get(R.part_key(name, version), db=self.dbs["schemas"])
        return R.SCHEMA_DEC.decode(raw) if raw else None

    def user(self, name: str) -> R.UserRecord | None:
        raw = self.txn.get(name.encode(), db=self.dbs["users"])
        return R.USER_DEC.decode(raw) if raw else None

    def users(self) -> list[R.UserRecord]:
        return [R.USER_DEC.decode(raw) for _, raw in self.txn.cursor(db=self.dbs["users"])]

    def root_user(self) -> R.UserRecord | None:
        for u in self.users():
            if u.root:
                return u
        return None

    def member(self, node_id: str) -> R.MemberRecord | None:
        raw = self.txn.get(node_id.encode(), db=self.dbs["members"])
        return R.MEMBER_DEC.decode(raw) if raw else None

    def members(self) -> list[R.MemberRecord]:
        return [R.MEMBER_DEC.decode(raw) for _, raw in self.txn.cursor(db=self.dbs["members"])]

    def applied_index(self) -> int:
        raw = self.txn.get(F.K_APPLIED, db=self.dbs["fsm_meta"])
        return F._U64.unpack(raw)[0] if raw else 0

    def request_result(self, request_id: str) -> C.ApplyResult | None:
        """The first result of the entry proposed with this request id, if it applied
        (remembered about 10 minutes of stamp time)."""
        raw = self.txn.get(request_id.encode(), db=self.dbs["requests"])
        return F.request_result(raw) if raw is not None else None

    def counts(self) -> dict[str, int]:
        return {n: int(self.txn.stat(self.dbs[n])["entries"])
                for n in ("topics", "schemas", "assignments", "members", "users", "removed_members", "remotes")}


class MetaStore:
    def __init__(self, path: Path, versions: V.VersionTable, *, fsm: F.FSM | None = None) -> None:
        """Workers pass the FSM path (opened read-only here); the supervisor
        passes its FSM, whose environment it shares (and follows across a
        snapshot install)."""
        self.path = Path(path)
        self.versions = versions
        self._fsm = fsm
        self._shared_env = fsm is not None
        if fsm is not None:
            self.env, self.dbs = fsm.env, fsm.dbs
        else:
            self.env = F.open_env(self.path, readonly=True)
            self.dbs = F.open_dbs(self.env, create=False)
        self._epoch = versions.load(V.EPOCH)
        self._topics: dict[str, tuple[int, int, R.TopicRecord | None]] = {}
        self._assign: dict[str, tuple[int, int, dict[int, R.AssignmentRecord]]] = {}
        self._users: dict[str, R.UserRecord | None] = {}
        self._users_ver = -1

    def _check_epoch(self) -> None:
        epoch = self.versions.load(V.EPOCH)
        if epoch != self._epoch and not self._shared_env:
            self.env.close()
            self.env = F.open_env(self.path, readonly=True)
            self.dbs = F.open_dbs(self.env, create=False)
            self._topics.clear()
            self._assign.clear()
            self._users.clear()
        self._epoch = epoch

    @contextlib.contextmanager
    def read(self) -> Iterator[Reader]:
        if self._fsm is not None:
            with self._fsm.swap_lock:
                if self.env is not self._fsm.env:
                    self.env, self.dbs = self._fsm.env, self._fsm.dbs
                    self._topics.clear()
                    self._assign.clear()
                    self._users.clear()
                with self.env.begin(buffers=False) as txn:
                    yield Reader(txn, self.dbs)
            return
        self._check_epoch()
        with self.env.begin(buffers=False) as txn:
            yield Reader(txn, self.dbs)

    # ---- cached lookups (one atomic load when warm) -----------------------
    def topic(self, name: str) -> R.TopicRecord | None:
        hit = self._topics.get(name)
        if hit is not None and self.versions.load(hit[0]) == hit[1]:
            return hit[2]
        slot = V.name_slot(name)
        ver = self.versions.load(slot)
        with self.read() as r:
            rec = r.topic(name)
        if len(self._topics) > _CACHE_LIMIT:
            self._topics.clear()
        self._topics[name] = (slot, ver, rec)
        return rec

    def assignments(self, name: str) -> dict[int, R.AssignmentRecord]:
        hit = self._assign.get(name)
        if hit is not None and self.versions.load(hit[0]) == hit[1]:
            return hit[2]
        slot = V.name_slot(name)
        ver = self.versions.load(slot)
        with self.read() as r:
            rows = r.assignments(name)
        if len(self._assign) > _CACHE_LIMIT:
            self._assign.clear()
        self._assign[name] = (slot, ver, rows)
        return rows

    def user(self, name: str) -> R.UserRecord | None:
        ver = self.versions.load(V.USERS)
        if ver != self._users_ver:
            self._users.clear()
            self._users_ver = ver
        if name in self._users:
            return self._users[name]
        with self.read() as r:
            rec = r.user(name)
        if len(self._users) > _CACHE_LIMIT:
            self._users.clear()
        self._users[name] = rec
        return rec

    def close(self) -> None:
        if not self._shared_env:
            self.env.close()
