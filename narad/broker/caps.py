"""Per-identity caps on concurrent consumes and produces, per node.

A shared-memory table of counters: one row per worker, one slot per hashed
identity (user name, or client IP with security off), two regions (consume,
produce). A worker writes only its own row (no cross-process atomics needed)
and checks a cap by summing the identity's slot over every row (N loads).
The supervisor creates the table and zeroes a dead worker's row, so a crash
never leaks a count. Two identities sharing a slot only share a budget.

Imports posix_ipc; nothing from narad.
"""

from __future__ import annotations

import hashlib
import mmap
import zlib

import posix_ipc

SLOTS = 4096
REGIONS = 2  # consume, produce
CONSUME, PRODUCE = 0, 1


def shm_name_for(data_dir: str) -> str:
    return "/narad-caps-" + hashlib.sha1(data_dir.encode()).hexdigest()[:16]


def _size(workers: int) -> int:
    return workers * REGIONS * SLOTS * 8


class CapTable:
    def __init__(self, name: str, workers: int, mm: mmap.mmap) -> None:
        self.name = name
        self.workers = workers
        self._mm = mm
        self._q = memoryview(mm).cast("Q")

    @classmethod
    def create(cls, name: str, workers: int) -> CapTable:
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=_size(workers))
        mm = mmap.mmap(shm.fd, _size(workers))
        shm.close_fd()
        return cls(name, workers, mm)

    @classmethod
    def attach(cls, name: str, workers: int) -> CapTable:
        shm = posix_ipc.SharedMemory(name)
        mm = mmap.mmap(shm.fd, _size(workers))
        shm.close_fd()
        return cls(name, workers, mm)

    _slots: dict[str, int] = {}

    @classmethod
    def slot(cls, identity: str) -> int:
        s = cls._slots.get(identity)
        if s is None:
            if len(cls._slots) >= 4096:
                cls._slots.clear()
            s = cls._slots[identity] = zlib.crc32(identity.encode()) % SLOTS
        return s

    def _i(self, worker: int, region: int, slot: int) -> int:
        return (worker * REGIONS + region) * SLOTS + slot

    def total(self, region: int, slot: int) -> int:
        q = self._q
        step = REGIONS * SLOTS
        return sum(q[region * SLOTS + slot :: step])

    def try_take(self, worker: int, region: int, identity: str, n: int, cap: int) -> bool:
        """Count n more for identity on this worker unless the node total would pass cap."""
        s = self.slot(identity)
        if cap > 0 and self.total(region, s) + n > cap:
            return False
        i = self._i(worker, region, s)
        self._q[i] += n
        return True

    def give_back(self, worker: int, region: int, identity: str, n: int) -> None:
        i = self._i(worker, region, self.slot(identity))
        q = self._q
        q[i] = max(0, q[i] - n)

    def zero_row(self, worker: int) -> None:
        for region in range(REGIONS):
            start = self._i(worker, region, 0)
            self._q[start : start + SLOTS] = memoryview(bytes(SLOTS * 8)).cast("Q")

    def close(self, unlink: bool = False, unmap: bool = True) -> None:
        if unmap:
            self._q.release()
            self._mm.close()
        if unlink:
            try:
                posix_ipc.unlink_shared_memory(self.name)
            except posix_ipc.ExistentialError:
                pass
