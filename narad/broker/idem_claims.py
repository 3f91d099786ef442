"""The node's idempotency claims: one shared-memory table every worker of a node maps.

Issue 14's idempotent produce checks a key where its record is committed, against this
table: the keys committed anywhere on the node, so the worker that received a keyless
idempotent record can claim its key for the whole node and commit it into a partition
of its own, with no hop to another worker (topic.idempotent_local_placement;
docs/architecture.md, "Idempotent produce"). The commit cycle claims and settles
(``narad.broker.partition``); each worker loads its partitions' keys at start and a
partition's at open (``narad.broker.idem``); a move carries the keys homed at the moved
partition (``collect``, ``load_raw``; ``narad.broker.moves``).

The table (native/narad_native.c, ``idem_*``) holds, per key: a 64-bit fingerprint
(FNV-1a from a fixed seed, mixed; computed in C from the key's UTF-8, so every process
and every node computes the same one whatever its interpreter),
the key's CRC-32C, the topic's 32-bit tag, the key's home partition (which a
partition move carries), and either a pending claim (a claimer's tag) or a commit
that counts until its expiry. A key is the same key when fingerprint, CRC and topic
tag all agree: two different keys are taken for one with a chance of about 2^-96.
The fingerprint is not a keyed PRF: someone who knows a producer's key can take it
with a produce of their own anyway, so nothing is lost by that.

Buckets of six slots, 256 bytes each (42.7 bytes a key); a full bucket evicts its
committed key that expires first (counted), never a pending claim. A key may live in
either of two buckets; an operation on a key takes both their locks (in ascending order),
for a few hundred instructions; a lock whose holder died is taken over. A move's source
seals the home it gives away (``seal``): from then on no key homed there is claimed on
the node (``SEALED``), so none can be committed behind the keys the move carries.

Imports the native module and posix_ipc; nothing else from narad.
"""

from __future__ import annotations

import hashlib
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import posix_ipc

from narad._native import ffi, lib

DEFAULT_BUCKETS = 1 << 17  # 786,432 keys in 32 MiB
WAYS = 6
BUCKET_BYTES = 256
MAX_KEY_BYTES = 1 << 30  # (the API takes 1 to 128 bytes; a record's block may hold any: all are keys here)

CLAIMED, DUPLICATE, PENDING, FULL, SEALED = 0, 1, 2, 3, 4
SEALS = 16  # seals a table holds at once (a move's source holds one while it is frozen)
HOME_BY_KEY = 0x80000000  # a home of ``HOME_BY_KEY | partitions``: the key's CRC-32C modulo the partitions


def by_key(partitions: int) -> int:
    """The home of a key placed by its own hash over `partitions` (a keyless idempotent record)."""
    return HOME_BY_KEY | partitions
COMMIT, RELEASE = 1, 2


CHECK = 0x6E61726164_49444D  # the head's layout check ("narad" "IDM")
# The fingerprints' seed: one constant, so a key's fingerprint is the same on every node
# and across restarts (a move's carried keys are fingerprints). A secret seed would only
# hide which keys share a bucket; someone who could use that can produce the key itself.
SEED = 0x9E3779B97F4A7C15
HEAD_BYTES = 384


def buckets_for(keys: int) -> int:
    """The buckets (a power of two) of a table holding at least `keys` keys."""
    b = 1
    while b * WAYS < keys:
        b <<= 1
    return b


def shm_name_for(data_dir: str) -> str:
    return "/narad-idem-" + hashlib.sha1(data_dir.encode()).hexdigest()[:16]


def topic_tag(topic_id: str) -> int:
    """A topic's 32-bit tag in the table (its id's CRC-32C)."""
    return lib.crc32c_of(topic_id.encode(), len(topic_id), 0)


class BadKeys(ValueError):
    """A key longer than MAX_KEY_BYTES (none the produce path can carry)."""


@dataclass(slots=True)
class Keys:
    """Keys ready for the table: each one's fingerprint and CRC-32C (native arrays)."""

    count: int
    fp: object  # uint64_t[count]
    crc: object  # uint32_t[count]


def _joined(keys: Sequence[str]) -> tuple[bytes, list[int]]:
    """The keys' UTF-8 back to back, and each one's length."""
    text = "".join(keys)
    if text.isascii():  # (the common key: its length is its bytes')
        return text.encode(), list(map(len, keys))
    parts = [k.encode() for k in keys]
    return b"".join(parts), list(map(len, parts))


class ClaimTable:
    """One mapping of the node's table (the supervisor creates it; workers attach)."""

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self._mm = mm
        self._base = ffi.from_buffer(mm)
        self._complete = False

    @classmethod
    def create(cls, name: str, buckets: int = DEFAULT_BUCKETS) -> ClaimTable:
        if buckets <= 0 or buckets & (buckets - 1):
            raise ValueError("buckets must be a power of two")
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
        size = lib.idem_size(buckets)
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            mm = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        t = cls(name, mm)
        lib.idem_init(t._base, buckets, CHECK, SEED)
        return t

    @classmethod
    def attach(cls, name: str) -> ClaimTable:
        shm = posix_ipc.SharedMemory(name)
        try:
            mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        t = cls(name, mm)
        if lib.idem_check(t._base, CHECK) != 0:
            t.close()
            raise RuntimeError(f"{name}: not a claims table of this layout")
        return t

    def prepare(self, keys: Sequence[str]) -> Keys:
        """The table's view of `keys` (raises BadKeys for a key it cannot hold)."""
        n = len(keys)
        fp, crc = ffi.new("uint64_t[]", n), ffi.new("uint32_t[]", n)
        if n:
            joined, lens = _joined(keys)
            if lib.idem_prepare(self._base, joined, len(joined), n, lens, MAX_KEY_BYTES, fp, crc) != 0:
                raise BadKeys("an idempotency key longer than 1 GiB")
        return Keys(n, fp, crc)

    def prepare_claim(self, topic: int, keys: Sequence[str], home: int, now_ms: int, window_ms: int,
                      tag: int, homes: Sequence[int] | None = None) -> tuple[Keys, list[int], int]:
        """``prepare`` then ``claim``, in one call: (the keys, each one's verdict, evicted).
        `home`: every key's home partition, or ``by_key(partitions)``; `homes`: each key's."""
        n = len(keys)
        fp, crc, out = ffi.new("uint64_t[]", n), ffi.new("uint32_t[]", n), ffi.new("uint8_t[]", n)
        joined, lens = _joined(keys)
        hs = ffi.NULL if homes is None else ffi.new("uint32_t[]", list(homes))
        ev = lib.idem_prepare_claim(self._base, joined, len(joined), n, lens, MAX_KEY_BYTES, topic, home, hs, now_ms,
                                    window_ms, tag, fp, crc, out)
        if ev < 0:
            raise BadKeys("an idempotency key longer than 1 GiB") if ev < -10 else ValueError(f"bad tag {tag}")
        return Keys(n, fp, crc), list(ffi.unpack(out, n)), ev

    @classmethod
    def private(cls, buckets: int = 4096) -> ClaimTable:
        """A table in this process's memory alone (a broker run without a supervisor: tests)."""
        mm = mmap.mmap(-1, lib.idem_size(buckets))
        t = cls("", mm)
        lib.idem_init(t._base, buckets, CHECK, SEED)
        return t

    def claim(self, topic: int, keys: Keys, home: int, now_ms: int, window_ms: int,
              tag: int) -> tuple[list[int], int]:
        """Claims each key (homed at partition `home`) for `tag`, judged by the topic's window
        now: (each key's verdict, CLAIMED DUPLICATE PENDING or FULL; the committed keys
        evicted to make room)."""
        out = ffi.new("uint8_t[]", keys.count)
        ev = lib.idem_claim(self._base, keys.count, keys.fp, keys.crc, topic, home, ffi.NULL, now_ms, window_ms, tag,
                            out)
        if ev < 0:
            raise ValueError(f"bad claimer tag {tag}")
        return list(ffi.unpack(out, keys.count)), ev

    def settle(self, topic: int, keys: Keys, tag: int, committed_ms: int, window_ms: int,
               how: Sequence[int] | int) -> int:
        """Settles `tag`'s claims: how[i] (or `how` for every key) COMMIT (committed at
        committed_ms), RELEASE (free again) or 0 (left). Returns how many were settled."""
        if isinstance(how, int):
            return lib.idem_settle(self._base, keys.count, keys.fp, keys.crc, topic, tag, committed_ms, window_ms,
                                   ffi.NULL, how)
        mask = ffi.new("uint8_t[]", list(how))
        return lib.idem_settle(self._base, keys.count, keys.fp, keys.crc, topic, tag, committed_ms, window_ms, mask, 0)

    def load(self, topic: int, keys: Keys, homes: Sequence[int], committed_ms: Sequence[int], window_ms: int,
             now_ms: int) -> int:
        """Records keys found committed (at committed_ms[i]), homed at homes[i] (a partition or
        ``by_key(partitions)``); returns the keys evicted."""
        home = ffi.new("uint32_t[]", list(homes))
        at = ffi.new("uint64_t[]", list(committed_ms))
        return lib.idem_load(self._base, keys.count, keys.fp, keys.crc, topic, home, at, window_ms, now_ms)

    def rewindow(self, topic: int, window_ms: int) -> int:
        """The topic's window is now `window_ms`: its keys hold their slots by it."""
        return lib.idem_rewindow(self._base, topic, window_ms)

    def release_owner(self, mask: int, value: int) -> int:
        """Empties the pending claims whose tag & mask == value; returns how many."""
        return lib.idem_release_owner(self._base, mask, value)

    def collect(self, topic: int, home: int, now_ms: int, chunk: int = 4096) -> list[tuple[int, int, int]]:
        """The committed keys of `topic` homed at `home`: (fingerprint, CRC, committed-at) each."""
        cap = max(chunk, WAYS)
        fp, crc, at = ffi.new("uint64_t[]", cap), ffi.new("uint32_t[]", cap), ffi.new("uint64_t[]", cap)
        cursor = ffi.new("uint64_t *", 0)
        out: list[tuple[int, int, int]] = []
        total = self.buckets
        while cursor[0] < total:
            got = lib.idem_collect(self._base, topic, home, now_ms, fp, crc, at, cap, cursor)
            out.extend(zip(ffi.unpack(fp, got), ffi.unpack(crc, got), ffi.unpack(at, got), strict=True))
        return out

    def seal(self, topic: int, home: int, until_ms: int, now_ms: int) -> bool:
        """No key of `topic` homed at `home` is claimed on this node (``SEALED``) until
        `until_ms` or ``unseal``: a move's source, before it collects the keys homed at the
        partition it gives away. Once this returns, a claim that was not refused is
        pending already (``pending_homed`` sees it) or settled. False: ``SEALS`` seals
        are held already (a scan of every bucket's lock: about a millisecond)."""
        return lib.idem_seal(self._base, topic, home, until_ms, now_ms) == 0

    def unseal(self, topic: int, home: int, now_ms: int) -> None:
        """Lifts `home`'s seal (the move was given up, or the partition came back here)."""
        lib.idem_unseal(self._base, topic, home, now_ms)

    def sealed(self, now_ms: int) -> int:
        """Seals live at `now_ms`."""
        return lib.idem_sealed_count(self._base, now_ms)

    def pending_homed(self, topic: int, home: int) -> int:
        """Claims of `topic` homed at `home` whose commit is not settled (a scan)."""
        return lib.idem_pending_home(self._base, topic, home)

    def load_raw(self, topic: int, home: int, entries: Sequence[tuple[int, int, int]], window_ms: int,
                 now_ms: int) -> int:
        """``load`` for entries ``collect`` gave (a move's carried keys)."""
        n = len(entries)
        keys = Keys(n, ffi.new("uint64_t[]", [e[0] for e in entries]), ffi.new("uint32_t[]", [e[1] for e in entries]))
        return self.load(topic, keys, [home] * n, [e[2] for e in entries], window_ms, now_ms)

    @property
    def buckets(self) -> int:
        return int.from_bytes(self._mm[8:16], "little")

    def set_workers(self, n: int) -> None:
        """The node's worker count: each must ``set_loaded`` before the table is complete."""
        lib.idem_set_workers(self._base, n)

    def set_loaded(self, index: int) -> bool:
        """Worker `index` loaded the keys of its partitions; True when every worker has."""
        return bool(lib.idem_set_loaded(self._base, index))

    def all_loaded(self) -> bool:
        """Whether every worker has loaded its partitions' keys since the table was made
        (once true, it stays true for the table's life)."""
        return bool(lib.idem_all_loaded(self._base))

    def complete(self) -> bool:
        """``all_loaded``, remembered once true (no call after that)."""
        if self._complete:
            return True
        self._complete = self.all_loaded()
        return self._complete

    def lock_word(self, bucket: int) -> memoryview:
        """A bucket's lock word (tests: a lock left by a dead holder)."""
        off = HEAD_BYTES + bucket * BUCKET_BYTES
        return memoryview(self._mm)[off : off + 8].cast("Q")

    def stats(self, now_ms: int) -> dict[str, int]:
        out = ffi.new("uint64_t[5]")
        lib.idem_stats(self._base, now_ms, out)
        return {"keys": out[0], "pending": out[1], "evicted": out[2], "locks_taken_over": out[3],
                "refused_full": out[4], "capacity": self.buckets * WAYS}

    def close(self, unlink: bool = False, unmap: bool = True) -> None:
        if unmap:
            self._base = None  # type: ignore[assignment]
            try:
                self._mm.close()
            except BufferError:  # (a cdata view still alive: the mapping goes with the process)
                pass
        if unlink:
            try:
                posix_ipc.unlink_shared_memory(self.name)
            except posix_ipc.ExistentialError:
                pass
