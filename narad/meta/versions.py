"""The shared-memory version counter array (posix_ipc + native atomics).

One uint64 slot per metadata domain, a region of per-topic-name slots, and a
few node-state slots (FSM epoch, readiness, shutdown). The supervisor is the
only writer: it bumps the slots an applied entry touched after the LMDB
commit that holds the entry (release stores in ``narad._native``). Workers map
the array read-only and compare a cached value with one load per request.

The hot-path load indexes the cffi ``uint64_t *`` cdata (an aligned 8-byte
load done in C, atomic on x86-64 and aarch64, acquire on x86-64's TSO; on
weaker CPUs the LMDB read transaction a miss opens orders the reads that
follow). It deliberately does not *call* ``load_i``: cffi releases the GIL
around every C function call, and with I/O threads runnable that hand-off
measured 17 us per call instead of 0.14 us.

Imports only the native module; used by narad.meta and the processes above.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import zlib
from collections.abc import Iterable

import posix_ipc

from narad._native import ffi, lib

# ---- slot layout ---------------------------------------------------------
MAGIC = 0
EPOCH = 1  # bumped when the FSM file is replaced (snapshot install): reopen LMDB
APPLIED_INDEX = 2  # last Raft index committed into the FSM
READY = 3  # 1 when /readyz may answer ready
READY_REASON = 4  # code in READY_REASONS when not ready
SHUTDOWN = 5  # 1 once a graceful shutdown began (/healthz answers 503)
FAIL_STOPPED = 6  # 1 once the metastore stopped applying (node is stopping)
WORKERS = 7  # worker count N, fixed for the supervisor's life

TOPICS = 8
ASSIGNMENTS = 9
MEMBERS = 10
USERS = 11
SCHEMAS = 12
REMOTES = 13
REMOVED_MEMBERS = 14
RAFT = 15  # role / leader changes

NAME_BASE = 64
NAME_SLOTS = 4096
SIZE = NAME_BASE + NAME_SLOTS

MAGIC_VALUE = 0x4E41524144_0001  # "NARAD" + layout version 1

DOMAIN_SLOTS = (TOPICS, ASSIGNMENTS, MEMBERS, USERS, SCHEMAS, REMOTES, REMOVED_MEMBERS, RAFT)

READY_REASONS = {
    0: "ready",
    1: "starting",
    2: "no raft leader known",
    3: "no contact with the raft leader yet",
    4: "last raft leader contact too long ago",
    5: "replica has not caught up with the leader since start",
    6: "startup reconcile has not finished",
    7: "metastore stopped applying raft entries",
    8: "shutting down",
    9: "not admitted to the cluster yet",
    10: "a worker is not serving yet",
}


def name_slot(name: str) -> int:
    """The per-name slot of a topic name (a hash: collisions only cost a re-read)."""
    return NAME_BASE + (zlib.crc32(name.encode()) % NAME_SLOTS)


def shm_name_for(data_dir: str) -> str:
    return "/narad-" + hashlib.sha1(data_dir.encode()).hexdigest()[:16]


_primary_pid = 0  # the process whose table keeps its base pointer in C (not inherited across fork)


class VersionTable:
    """A mapping of the counter array. ``create`` (supervisor, read-write) or
    ``attach`` (workers, read-only)."""

    def __init__(self, name: str, mm: mmap.mmap, writable: bool) -> None:
        global _primary_pid
        self.name = name
        self._mm = mm
        self.writable = writable
        self._buf = ffi.from_buffer(mm, require_writable=False)
        self._ptr = ffi.cast("uint64_t *", self._buf)
        if _primary_pid != os.getpid():
            # The first table of a process also registers its base pointer with
            # the native module (lib.load_i, for C callers and tests).
            lib.set_base(self._ptr, SIZE)
            _primary_pid = os.getpid()
            self._primary = True
        else:
            self._primary = False
        self.load = self._ptr.__getitem__

    @classmethod
    def create(cls, name: str) -> VersionTable:
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=SIZE * 8)
        mm = mmap.mmap(shm.fd, SIZE * 8)
        shm.close_fd()
        t = cls(name, mm, True)
        t.store(MAGIC, MAGIC_VALUE)
        return t

    @classmethod
    def attach(cls, name: str) -> VersionTable:
        shm = posix_ipc.SharedMemory(name, read_only=True)
        mm = mmap.mmap(shm.fd, SIZE * 8, prot=mmap.PROT_READ)
        shm.close_fd()
        t = cls(name, mm, False)
        if t.load(MAGIC) != MAGIC_VALUE:
            raise RuntimeError(f"shared memory {name} has an unknown layout")
        return t

    def store(self, slot: int, value: int) -> None:
        lib.atomic_store(self._ptr, slot, value)

    def bump(self, slots: Iterable[int]) -> None:
        for s in set(slots):
            lib.atomic_fetch_add(self._ptr, s, 1)

    def bump_all(self) -> None:
        """Invalidate every cache (after the FSM file was replaced)."""
        self.bump(range(TOPICS, SIZE))

    def close(self, unlink: bool = False) -> None:
        if self._primary:
            lib.set_base(ffi.NULL, 0)
        ffi.release(self._buf)
        self._mm.close()
        if unlink:
            try:
                posix_ipc.unlink_shared_memory(self.name)
            except posix_ipc.ExistentialError:
                pass
