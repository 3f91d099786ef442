"""Idempotent produce (issue 14), in-process figures for the documentation:

(a) memory per key of a partition owner's table (``narad.broker.idem.IdemTable``)
    at its cap (100k keys), measured with tracemalloc, for 8, 36 (a UUID) and
    128-byte keys;
(b) disk per record: the extension block an idempotency key adds to the stored
    payload (WAL and partition log alike);
(c) the rebuild at open: a partition log holding ``--records`` records of
    ``--size`` bytes committed within the window, ``--keyed`` of them with a key
    (the rest keyless), scanned by ``idem.rebuild`` as ``Broker._open_sync`` does
    on its I/O thread: wall time and records per second;
(d) the owner's commit cycle, event-loop CPU per record, keyless against 16-byte
    and UUID keys (``Partition.commit`` with a real ``CommitRounds``, 33-record
    commits over a table already holding 60k keys; the records are built before
    the clock starts, so only the owner's work is timed);
(e) the table at steady state: CPU per key added to a full table (each add drops the
    oldest key, counted as evicted) and per key committed and expired by the window
    (33-key commits, as a 100-message batch spread over 3 partitions), both at 100k keys.

Throughput and server CPU per message with and without keys on a real node:
``loadtest/bench.py --only produce --features idem`` (each run, then the same with keys).

Usage: .venv/bin/python loadtest/bench_idempotency.py [--records N] [--keyed N] [--size B]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import tempfile
import time
import tracemalloc
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from narad.broker import idem as IDEM
from narad.broker.partition import Partition
from narad.storage import frames as FR
from narad.storage.commit_rounds import CommitRounds
from narad.storage.offsets import OffsetFile
from narad.storage.partition_log import PartitionLog


def table_bytes_per_key(klen: int, n: int = IDEM.DEFAULT_CAP) -> float:
    keys = [f"{i:x}".rjust(klen, "k") for i in range(n)]  # distinct, exactly klen bytes
    now = int(time.time() * 1000)
    gc.collect()
    tracemalloc.start()
    t = IDEM.IdemTable()
    base = tracemalloc.get_traced_memory()[0]
    for i, k in enumerate(keys):
        t.add(k, now + i)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    # The key strings were built before tracing: add them (the table holds them while the keys list dies).
    import sys
    strings = sum(sys.getsizeof(k) for k in keys)
    return (used + strings) / n


def _partition(d: Path) -> Partition:
    plog = PartitionLog(d)
    plog.open()
    offs = OffsetFile(d)
    p = Partition("t", "00" * 8, 0, plog, offs)
    p.restore(*offs.load())
    return p


async def _fill(p: Partition, ex: ThreadPoolExecutor, records: int, keyed: int, size: int, tag: str) -> float:
    """Commit `records` records (the first `keyed` with a key) in 1000-record batches; CPU seconds."""
    p.loop = asyncio.get_running_loop()
    body = b"x" * size
    t0 = time.process_time()
    i = 0
    while i < records:
        batch = []
        for j in range(i, min(records, i + 1000)):
            if j < keyed:
                batch.append((None, FR.F_EXT, FR.pack_ext(FR.Ext(i=f"{tag}-{uuid.UUID(int=j)}"), body)))
            else:
                batch.append((None, 0, body))
        await p.commit(batch, ex)
        i += len(batch)
    return time.process_time() - t0


COMMIT_N = 60_000


def commit_cost(d: Path, kind: str, size: int) -> float:
    """Event-loop CPU µs per record of ``Partition.commit`` with a real ``CommitRounds``
    (the worker's executor): ``kind`` "keyless", "hex16" (a 16-byte key, as
    loadtest/bench.py sends) or "uuid" (36 bytes). The first COMMIT_N records fill
    the table; the next COMMIT_N are timed (each commit a fresh key)."""
    body = b"x" * size
    recs: list[tuple[bytes | None, int, bytes]] = []
    for i in range(2 * COMMIT_N):
        if kind == "keyless":
            recs.append((None, FR.F_JSON, b"%016x" % i + body))  # (distinct objects, as on a node)
        else:
            key = b"%016x" % i if kind == "hex16" else str(uuid.UUID(int=i)).encode()
            recs.append((None, FR.F_EXT | FR.F_JSON, FR.pack_idem(key, body)))
    frames = [recs[i : i + 33] for i in range(0, 2 * COMMIT_N, 33)]
    half = len(frames) // 2
    rounds = CommitRounds("bench-idem", d.parent)
    p = _partition(d)

    async def go(fs: list[list[tuple[bytes | None, int, bytes]]]) -> float:
        p.loop = asyncio.get_running_loop()
        t0 = time.thread_time()
        for f in fs:
            await p.commit(f, rounds)
        return time.thread_time() - t0

    try:
        asyncio.run(go(frames[:half]))
        n = sum(len(f) for f in frames[half:])
        return asyncio.run(go(frames[half:])) / n * 1e6
    finally:
        p.log.close()
        rounds.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--records", type=int, default=200_000, help="records in the log for the rebuild (c)")
    ap.add_argument("--keyed", type=int, default=100_000, help="of which with an idempotency key")
    ap.add_argument("--size", type=int, default=1024, help="payload bytes per record")
    args = ap.parse_args()
    print("# (a) idempotency table, memory per key at 100k keys (tracemalloc, key strings included)")
    for klen in (8, 36, 128):
        print(f"#   {klen:>3}-byte keys: {table_bytes_per_key(klen):6.0f} B/key")
    print("# (b) disk per record: the extension block in front of the payload (WAL and log)")
    for klen in (8, 36, 128):
        print(f"#   {klen:>3}-byte key: +{len(FR.pack_ext(FR.Ext(i='k' * klen), b''))} B")
    tmp = Path(tempfile.mkdtemp(prefix="narad-idem-bench-"))
    try:
        with ThreadPoolExecutor(1) as ex:
            d = tmp / "p0"
            p = _partition(d)
            cpu = asyncio.run(_fill(p, ex, args.records, args.keyed, args.size, "a"))
            p.log.close()
            plog = PartitionLog(d)
            plog.open()
            t0, c0 = time.monotonic(), time.process_time()
            table, read = IDEM.rebuild(plog, 300_000, int(time.time() * 1000))
            wall, c1 = time.monotonic() - t0, time.process_time() - c0
            plog.close()
            mib = args.records * args.size / 2**20
            print(f"# (c) rebuild at open: {args.records:,} records of {args.size} B ({mib:.0f} MiB, "
                  f"{args.keyed:,} keyed) within the window -> {len(table):,} keys in {wall * 1000:.0f} ms wall, "
                  f"{c1 * 1000:.0f} ms CPU ({read / wall:,.0f} records/s, {mib / wall:.0f} MiB/s; page cache warm)")
            del cpu
            print(f"# (d) commit cycle, event-loop CPU per record (33-record commits, as a 100-message batch "
                  f"spread over 3 partitions; {COMMIT_N:,} timed after {COMMIT_N:,} warming the table; "
                  f"records built beforehand, payloads distinct):")
            for rep in range(3):
                got = {kind: commit_cost(tmp / f"d{rep}-{kind}", kind, args.size)
                       for kind in ("keyless", "hex16", "uuid")}
                print(f"#     rep {rep + 1}: keyless {got['keyless']:.2f} µs, 16-byte keys {got['hex16']:.2f} µs "
                      f"({got['hex16'] - got['keyless']:+.2f}), UUID keys {got['uuid']:.2f} µs "
                      f"({got['uuid'] - got['keyless']:+.2f})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    at_cap, by_window = steady_state()
    print(f"# (e) table at steady state, 100k keys: {at_cap:.2f} µs per key added at the cap (the oldest dropped), "
          f"{by_window:.2f} µs per key committed and expired by the window (33 keys a commit)")


def steady_state(n: int = IDEM.DEFAULT_CAP) -> tuple[float, float]:
    """CPU µs per key: adds to a full table; then commits of 33 fresh keys, each followed
    by an expiry of the keys older than the last n (the window's cut)."""
    keys = [f"{i:016x}" for i in range(3 * n)]
    t = IDEM.IdemTable(n)
    for i in range(n):
        t.add(keys[i], i)
    c0 = time.process_time()
    for i in range(n, 2 * n):
        t.add(keys[i], i)
    at_cap = (time.process_time() - c0) / n * 1e6
    t = IDEM.IdemTable(10 * n)
    for i in range(n):
        t.add(keys[i], i)
    frames = [keys[i : min(i + 33, 3 * n)] for i in range(n, 3 * n, 33)]
    c0 = time.process_time()
    held = t.keys
    for i, f in enumerate(frames):  # as a commit does: each key claimed at the check, then committed
        ts = n + 33 * i
        for k in f:
            held.setdefault(k, ts)
        t.committed(f, ts)
        t.expire(ts - n)
    by_window = (time.process_time() - c0) / (2 * n) * 1e6
    return at_cap, by_window


if __name__ == "__main__":
    main()
