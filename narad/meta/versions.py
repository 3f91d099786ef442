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

Beside it lives a second, small segment every process writes: the
*heartbeats* (``<name>-hb``). Each process stamps its slot from its own loop
(monotonic milliseconds, CLOCK_MONOTONIC: one clock for the whole machine,
so stamps compare across processes): the supervisor's event loop, Raft's
tick thread, the fork server's loop and each worker's event loop. /readyz,
/healthz, the supervisor's stuck-worker check and the systemd watchdog are
computed from how old those stamps are, never from a flag written once.
A worker writes only its own slot; the version array stays read-only to it.

Imports only the native module; used by narad.meta and the processes above.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import time
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


READY_REASONS.update({
    11: "a worker is not responding",
    12: "the raft tick thread is not responding",
    13: "the fork server is not responding",
    15: "a worker's background task is failing",
    14: "this node was removed from the cluster (decommissioned): start it with an empty data directory "
        "to rejoin as a new node",
})

# ---- heartbeat segment layout -------------------------------------------------
HB_MAGIC = 0
HB_SUPERVISOR = 1  # the supervisor's event loop
HB_RAFT = 2  # Raft's tick thread (0 while Raft does not run: join-only, not admitted yet)
HB_FORKSERVER = 3  # the fork server's loop
HB_WORKER_BASE = 8  # + worker index: that worker's event loop (0: not started yet)
HB_MAX_WORKERS = 1024
# + worker index: that worker's last background-task failure, (monotonic ms << 8) | task code
# (``TASKS``), 0 if none: a loop whose process is alive but which keeps failing inside
HB_FAULT_BASE = HB_WORKER_BASE + HB_MAX_WORKERS
HB_SIZE = HB_FAULT_BASE + HB_MAX_WORKERS
HB_MAGIC_VALUE = 0x4E41524144_4842  # "NARAD" + "HB"
HB_EVERY = 0.25  # seconds between stamps of a healthy loop
STALE_AFTER = 3.0  # a loop silent this long is "not responding" (readiness, liveness)


# A worker's background loops, by the code its fault slot carries (``fault_value``).
TASKS = ("unknown", "committer", "sweeper", "reaper", "topic watch", "trust watch", "metrics poller",
         "fan-out", "move runner", "dead-letter driver")
FAULT_HOLD = 10.0  # /readyz names a failed background task for this long after its last failure


def fault_slot(index: int) -> int:
    return HB_FAULT_BASE + index


def fault_value(task: str, at_ms: int | None = None) -> int:
    """The fault slot's value for a failure of `task` now (or at `at_ms`)."""
    code = TASKS.index(task) if task in TASKS else 0
    return ((now_ms() if at_ms is None else at_ms) << 8) | code


def failing(hb: Heartbeats, workers: int, hold: float = FAULT_HOLD) -> list[str]:
    """A sentence for each worker whose background task failed within the last `hold`
    seconds (readiness: the process is alive, a loop inside it is not doing its work)."""
    now = now_ms()
    out = []
    for i in range(min(workers, HB_MAX_WORKERS)):
        v = hb.load(fault_slot(i))
        if not v:
            continue
        ago = max(0, now - (v >> 8)) / 1000.0
        if ago <= hold:
            task = TASKS[v & 0xFF] if (v & 0xFF) < len(TASKS) else "unknown"
            out.append(f"worker {i}: background task {task!r} failed {ago:.1f}s ago (see the worker's log)")
    return out


def now_ms() -> int:
    """CLOCK_MONOTONIC in milliseconds (never 0 on a running machine)."""
    return max(1, time.monotonic_ns() // 1_000_000)


def worker_slot(index: int) -> int:
    return HB_WORKER_BASE + index


def hb_name_for(shm_name: str) -> str:
    return shm_name + "-hb"


def _unlink_segment(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def _create_segment(name: str, nbytes: int) -> mmap.mmap:
    """A new shared-memory segment (any old one of that name unlinked first), mapped."""
    _unlink_segment(name)
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=nbytes)
    mm = mmap.mmap(shm.fd, nbytes)
    shm.close_fd()
    return mm


class Heartbeats:
    """The heartbeat segment: every process maps it read-write and stamps its own slot."""

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self._mm = mm
        self._buf = ffi.from_buffer(mm)
        self._ptr = ffi.cast("uint64_t *", self._buf)
        self.load = self._ptr.__getitem__

    @classmethod
    def create(cls, name: str) -> Heartbeats:
        t = cls(name, _create_segment(name, HB_SIZE * 8))
        t.store(HB_MAGIC, HB_MAGIC_VALUE)
        return t

    @classmethod
    def attach(cls, name: str) -> Heartbeats:
        shm = posix_ipc.SharedMemory(name)
        mm = mmap.mmap(shm.fd, HB_SIZE * 8)
        shm.close_fd()
        t = cls(name, mm)
        if t.load(HB_MAGIC) != HB_MAGIC_VALUE:
            raise RuntimeError(f"shared memory {name} has an unknown layout")
        return t

    def store(self, slot: int, value: int) -> None:
        lib.atomic_store(self._ptr, slot, value)

    def beat(self, slot: int) -> None:
        """Stamp `slot` with the current monotonic time (called from the owner's loop)."""
        self._ptr[slot] = now_ms()  # one aligned 8-byte store (see the module docstring)

    def age(self, slot: int, now: int | None = None) -> float | None:
        """Seconds since `slot` was stamped; None if it never was."""
        v = self.load(slot)
        if not v:
            return None
        return max(0, (now_ms() if now is None else now) - v) / 1000.0

    def close(self, unlink: bool = False, unmap: bool = True) -> None:
        """Unmap the segment (not when ``unmap`` is False: a thread may still stamp it, and
        the process exit unmaps it anyway) and, with ``unlink``, remove its name."""
        if unmap:
            ffi.release(self._buf)
            self._mm.close()
        if unlink:
            _unlink_segment(self.name)


def not_responding(hb: Heartbeats, workers: int, stale_after: float = STALE_AFTER) -> list[tuple[str, float]]:
    """Every loop silent for longer than `stale_after` seconds, as (name, seconds):
    the supervisor first, then Raft's tick thread, the fork server, the workers.
    A slot never stamped (a process not started yet, or restarting) is left out."""
    now = now_ms()
    slots = [("supervisor", HB_SUPERVISOR), ("raft tick thread", HB_RAFT), ("fork server", HB_FORKSERVER)]
    slots += [(f"worker {i}", worker_slot(i)) for i in range(min(workers, HB_MAX_WORKERS))]
    out = []
    for name, slot in slots:
        age = hb.age(slot, now)
        if age is not None and age > stale_after:
            out.append((name, age))
    return out


def name_slot(name: str) -> int:
    """The per-name slot of a topic name (a hash: collisions only cost a re-read)."""
    return NAME_BASE + (zlib.crc32(name.encode()) % NAME_SLOTS)


def shm_name_for(data_dir: str) -> str:
    return "/narad-" + hashlib.sha1(data_dir.encode()).hexdigest()[:16]


_primary_pid = 0  # the process whose table keeps its base pointer in C (not inherited across fork)


class VersionTable:
    """A mapping of the counter array. ``create`` (supervisor, read-write) or
    ``attach`` (workers, read-only)."""

    def __init__(self, name: str, mm: mmap.mmap, writable: bool, hb: Heartbeats) -> None:
        global _primary_pid
        self.name = name
        self.hb = hb
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
        t = cls(name, _create_segment(name, SIZE * 8), True, Heartbeats.create(hb_name_for(name)))
        t.store(MAGIC, MAGIC_VALUE)
        return t

    @classmethod
    def attach(cls, name: str) -> VersionTable:
        shm = posix_ipc.SharedMemory(name, read_only=True)
        mm = mmap.mmap(shm.fd, SIZE * 8, prot=mmap.PROT_READ)
        shm.close_fd()
        t = cls(name, mm, False, Heartbeats.attach(hb_name_for(name)))
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
        self.bump(range(TOPICS, SIZE))  # the heartbeats are a segment of their own

    def close(self, unlink: bool = False, unmap: bool = True) -> None:
        """As Heartbeats.close, for both segments."""
        self.hb.close(unlink=unlink, unmap=unmap)
        if unmap:
            if self._primary:
                lib.set_base(ffi.NULL, 0)
            ffi.release(self._buf)
            self._mm.close()
        if unlink:
            _unlink_segment(self.name)
