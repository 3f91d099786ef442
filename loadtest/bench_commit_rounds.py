"""Commit rounds alone, one syncfs against one fdatasync per log: real ``PartitionLog``s
on a directory of the data disk (default: under the project, not tmpfs) and a real
``CommitRounds``; each step commits one frame of R records of S bytes to each of K logs
at once (they form one round, as a keyed WAL group's commits do) and publishes them.

Prints per mode: the wall time of a step, the CPU of this process per commit (the loop
and the round thread), and the machine's busy CPU per commit without steal (the flusher
and journal threads do a syncfs's writeback outside this process, so the process's own
CPU flatters it). Modes alternate (``--rounds``) because the disk and the VM are shared;
compare within one run, and look at the machine's figure.

    .venv/bin/python loadtest/bench_commit_rounds.py [--logs 6] [--records 17] [--size 1024] [--steps 400] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from narad.storage import frames as FR  # noqa: E402
from narad.storage.commit_rounds import CommitRounds  # noqa: E402
from narad.storage.partition_log import PartitionLog  # noqa: E402


def machine_busy() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "steal", 0.0) - getattr(t, "guest", 0.0)


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def one(args: argparse.Namespace, group_sync: bool, base: Path) -> tuple[float, float, float, float]:
    d = Path(tempfile.mkdtemp(prefix="rounds-", dir=base))
    try:
        logs = []
        for i in range(args.logs):
            plog = PartitionLog(d / f"p{i:05d}")
            plog.open()
            logs.append(plog)
        rounds = CommitRounds("bench-rounds", d, group_sync=group_sync)
        loop = asyncio.get_running_loop()
        payload = b"x" * args.size
        envs = [FR.encode_record(None, 1, 0, payload) for _ in range(args.records)]
        decoded = [(None, 1, 0, payload)] * args.records

        async def step() -> None:
            futs = [rounds.commit(loop, p, envs) for p in logs]
            for p, f in zip(logs, futs, strict=True):
                p.publish(*(await f), decoded)

        for _ in range(20):  # warm-up: segments and page cache in use
            await step()
        r0 = rounds.rounds
        m0, c0, t0 = machine_busy(), own_cpu(), time.perf_counter()
        for _ in range(args.steps):
            await step()
        m1, c1, t1 = machine_busy(), own_cpu(), time.perf_counter()
        per_round = (rounds.commits - 20 * args.logs) / max(1, rounds.rounds - r0)
        rounds.stop()
        for p in logs:
            p.close()
        n = args.steps * args.logs
        return (t1 - t0) / args.steps * 1e6, (c1 - c0) / n * 1e6, (m1 - m0) / n * 1e6, per_round
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--logs", type=int, default=6, help="logs committed together (a round)")
    ap.add_argument("--records", type=int, default=17, help="records per commit")
    ap.add_argument("--size", type=int, default=1024, help="bytes per record")
    ap.add_argument("--steps", type=int, default=400, help="rounds per mode and turn")
    ap.add_argument("--rounds", type=int, default=3, help="turns, the modes alternating")
    ap.add_argument("--dir", type=Path, default=ROOT / ".bench-rounds", help="where the logs go (the data disk)")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"# commit rounds: {args.logs} logs a round, {args.records} x {args.size} B a commit, {args.steps} steps, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print("# mode             wall us/step  own CPU us/commit  machine CPU us/commit  commits/round")
    got: dict[str, list[tuple[float, float, float, float]]] = {"syncfs": [], "fdatasync": []}
    for _ in range(args.rounds):
        for mode in ("syncfs", "fdatasync"):
            r = await one(args, mode == "syncfs", args.dir)
            got[mode].append(r)
            print(f"  {mode:<14} {r[0]:13.0f} {r[1]:18.0f} {r[2]:22.0f} {r[3]:14.2f}", flush=True)
    print("# medians")
    for mode, rows in got.items():
        print(f"  {mode:<14} " + " ".join(f"{statistics.median(x[i] for x in rows):{w}.0f}"
                                          for i, w in ((0, 13), (1, 18), (2, 22))))


if __name__ == "__main__":
    asyncio.run(main())
