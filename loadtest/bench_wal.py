"""The ingress WAL alone, with and without segment recycling: a real ``IngressWAL``
on a directory of the data disk (default: under the project, not tmpfs), groups of
B records of S bytes appended back to back, the checkpoint following the appends
(as the dispatcher moves it) so dispatched segments are retired (spares, or unlinked
with ``SPARE_SEGMENTS = 0``) and later segments reuse them. Segments are small
(``--segment-mib``, default 8) so a run rotates many times.

Prints per mode: records/s, the process's CPU per record (every thread: the loop,
the WAL's syncer, the I/O pool) and the syncer thread's alone (the write and the
fdatasync: what recycling changes), the mean and p99 fdatasync time of a group, and how
many segments were recycled. Modes alternate (``--rounds``) because the disk and
the VM are shared; compare within one run.

    .venv/bin/python loadtest/bench_wal.py [--records 60000] [--batch 50] [--size 1024] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from narad.storage import fileio  # noqa: E402
from narad.storage import wal as W  # noqa: E402
from narad.storage.wal import Entry, IngressWAL  # noqa: E402

INC = bytes(8)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


_TICK = os.sysconf("SC_CLK_TCK")


def _thread_cpu(name: str) -> float:
    """CPU seconds of the live thread called `name` (utime + stime from /proc)."""
    for t in threading.enumerate():
        if t.name == name and t.native_id is not None:
            try:
                fields = Path(f"/proc/self/task/{t.native_id}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                return 0.0
            return (int(fields[11]) + int(fields[12])) / _TICK
    return 0.0


async def _drive(w: IngressWAL, records: int, batch: int, size: int) -> float:
    """-> the WAL syncer thread's CPU seconds (read before the thread stops)."""
    body = b"x" * size
    sent = 0
    while sent < records:
        n = min(batch, records - sent)
        await w.append([Entry("bench", INC, sent % 6, 1, 0, None, body) for _ in range(n)])
        sent += n
        w.set_checkpoint(w.next_seq)  # dispatched at once: the segments behind can go
    return _thread_cpu(w._syncer.name)


def run_one(base: Path, spares: int, args: argparse.Namespace) -> dict[str, float]:
    d = Path(tempfile.mkdtemp(prefix="wal-", dir=base))
    syncs: list[float] = []
    real = fileio.fdatasync

    def timed(fd: int) -> None:
        t = time.perf_counter()
        real(fd)
        syncs.append(time.perf_counter() - t)

    W.SPARE_SEGMENTS = spares
    W.CHECKPOINT_SYNC_DELAY = 0.05
    fileio.fdatasync = timed
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        w = IngressWAL(d, pool, segment_bytes=args.segment_mib << 20)
        w.open()
        c0, t0 = _cpu(), time.perf_counter()
        syncer = asyncio.run(_drive(w, args.records, args.batch, args.size))
        c1, t1 = _cpu(), time.perf_counter()
        recycled = w.recycled
        w.close()
    finally:
        fileio.fdatasync = real
        pool.shutdown(wait=True)
        shutil.rmtree(d, ignore_errors=True)
    syncs.sort()
    return {"rate": args.records / (t1 - t0), "cpu_us": (c1 - c0) / args.records * 1e6,
            "syncer_us": syncer / args.records * 1e6,
            "sync_ms": statistics.fmean(syncs) * 1e3 if syncs else 0.0,
            "sync_p99_ms": syncs[int(len(syncs) * 0.99)] * 1e3 if syncs else 0.0, "recycled": recycled}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--records", type=int, default=60_000)
    ap.add_argument("--batch", type=int, default=50, help="records per append (one group each)")
    ap.add_argument("--size", type=int, default=1024, help="message bytes")
    ap.add_argument("--segment-mib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="times each mode runs, alternating")
    ap.add_argument("--dir", type=Path, default=ROOT / ".bench-wal", help="where the WAL directories go")
    args = ap.parse_args()
    args.dir.mkdir(exist_ok=True)
    default = W.SPARE_SEGMENTS
    print(f"# ingress WAL: {args.records:,} records of {args.size} B in groups of {args.batch}, "
          f"{args.segment_mib} MiB segments, {time.strftime('%Y-%m-%d %H:%M')}, dir {args.dir}")
    print(f"{'mode':<22} {'records/s':>10} {'cpu us/rec':>11} {'syncer us':>10} {'sync ms':>8} {'sync p99':>9} "
          f"{'recycled':>9}")
    try:
        for _ in range(args.rounds):
            for label, spares in (("unlink (no spares)", 0), (f"recycle ({default} spares)", default)):
                r = run_one(args.dir, spares, args)
                print(f"{label:<22} {r['rate']:>10,.0f} {r['cpu_us']:>11.2f} {r['syncer_us']:>10.2f} "
                      f"{r['sync_ms']:>8.3f} {r['sync_p99_ms']:>9.3f} {r['recycled']:>9.0f}", flush=True)
    finally:
        W.SPARE_SEGMENTS = default
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
