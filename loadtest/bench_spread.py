"""What spreading a batch over partitions costs, in process (issue 14: a message key or an
idempotency key places each record by its hash, so a batch of 100 lands on every
partition instead of one): real ``Partition`` objects over real ``PartitionLog``s in a
directory of the data disk, one real ``CommitRounds`` (so the K commits of a step form one
round and share one ``syncfs``, as in a worker).

Prints, per repetition:
- commit: CPU of this process (event loop + round thread) and wall time per batch of
  ``--batch`` records of ``--size`` bytes, committed into one partition, then split
  evenly over ``--parts`` partitions at once; and the event loop's own CPU for each;
- reserve / ack: CPU per record leased (``Partition.reserve``) and acked, taking up to
  ``--batch`` a pass from one partition, then ``--batch / --parts`` from each of the
  partitions.

The kernel's writeback of a ``syncfs`` partly runs in flusher threads outside this
process, so the commit figures are a floor; compare within one run (the disk and the VM
are shared).

    .venv/bin/python loadtest/bench_spread.py [--parts 6] [--batch 100] [--size 1024] [--steps 300] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from narad.broker.broker import _item  # noqa: E402
from narad.broker.partition import Partition  # noqa: E402
from narad.storage.commit_rounds import CommitRounds  # noqa: E402
from narad.storage.offsets import OffsetFile  # noqa: E402
from narad.storage.partition_log import PartitionLog  # noqa: E402


def open_partition(d: Path, index: int) -> Partition:
    plog = PartitionLog(d)
    plog.open()
    offs = OffsetFile(d)
    p = Partition("bench", "00" * 8, index, plog, offs)
    p.restore(*offs.load())
    return p


async def commit_steps(parts: list[Partition], rounds: CommitRounds, steps: int, batch: int, size: int,
                       spread: bool) -> tuple[float, float, float]:
    """(process CPU us, loop CPU us, wall us) per batch."""
    loop = asyncio.get_running_loop()
    for p in parts:
        p.loop = loop
    body = b"x" * size
    per = batch // len(parts)
    c0, l0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    for _ in range(steps):
        if spread:
            await asyncio.gather(*(p.commit([(None, 0, body)] * per, rounds) for p in parts))
        else:
            await parts[0].commit([(None, 0, body)] * batch, rounds)
    c, lc, w = time.process_time() - c0, time.thread_time() - l0, time.perf_counter() - w0
    return c / steps * 1e6, lc / steps * 1e6, w / steps * 1e6


def reserve_ack(parts: list[Partition], take: int) -> tuple[float, float, int]:
    """Lease and ack every committed record, `take` a pass from each partition:
    (reserve us, ack us) per record, records."""
    for p in parts:  # fresh lease state over the same logs
        p.committed = -1
        p.cursor = 0
        p.acked_ahead.clear()
        p.leases.clear()
        p._expiry.clear()
        p.deliveries.clear()
    t_res = t_ack = 0.0
    n = 0
    while True:
        now = time.monotonic()
        c0 = time.process_time()
        got = [(p, p.reserve(now, take, 30.0, 10**6, 10**6, _item)) for p in parts]
        c1 = time.process_time()
        k = sum(len(items) for _, items in got)
        if not k:
            break
        for p, items in got:
            for it in items:
                p.ack(it.offset, it.nonce, now)
        t_res += c1 - c0
        t_ack += time.process_time() - c1
        n += k
    return t_res / n * 1e6, t_ack / n * 1e6, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", type=int, default=6)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-spread-", dir=ROOT))
    rounds = CommitRounds("bench-spread", tmp)
    try:
        parts = [open_partition(tmp / f"p{i}", i) for i in range(args.parts)]
        per = args.batch // args.parts
        print(f"# {args.batch} records of {args.size} B a batch: one partition, or {per} in each of {args.parts} "
              f"(one commit round); us per batch (process CPU / event loop CPU / wall)")
        for r in range(args.repeat):
            one = uvloop.run(commit_steps(parts, rounds, args.steps, args.batch, args.size, False))
            many = uvloop.run(commit_steps(parts, rounds, args.steps, per * args.parts, args.size, True))
            print(f"commit  rep {r + 1}: one partition {one[0]:7.1f} / {one[1]:6.1f} / {one[2]:7.1f}; "
                  f"{args.parts} partitions {many[0]:7.1f} / {many[1]:6.1f} / {many[2]:7.1f}; "
                  f"+{(many[0] - one[0]) / max(1, args.parts - 1):.1f} us CPU per extra partition commit")
        for r in range(args.repeat):
            a = reserve_ack(parts[:1], args.batch)
            b = reserve_ack(parts, max(1, per))
            print(f"consume rep {r + 1}: one partition reserve {a[0]:.2f} ack {a[1]:.2f} us/record ({a[2]} records); "
                  f"{args.parts} partitions reserve {b[0]:.2f} ack {b[1]:.2f} us/record ({b[2]} records)")
        for p in parts:
            p.log.close()
    finally:
        rounds.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
