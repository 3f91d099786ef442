"""What a feature costs per message, in instructions: a figure this shared, noisy host
cannot blur.

The CPU figures of loadtest/bench.py (server µs per message, a feature run against the
plain runs either side of it) move by ±3 µs from run to run here, when other jobs share the
two cores: more than most changes they are meant to judge. This runs the same shapes with
the node under valgrind (``cachegrind --cache-sim=no``) and counts the instructions the
worker process executes, which do not depend on the other load:

* each scenario (plain, the feature, plain again: bench.py's ``--features`` order) runs
  twice, for ``--short`` and ``--long`` seconds at ``--rate`` messages/s (paced: the same
  batches, a request every few hundred ms, committed one round each as at full speed);
* the worker's instructions per message are the difference between the two runs over the
  difference of their messages (start-up, shutdown and the drain cancel out);
* the feature's cost is its figure minus the mean of the two plain runs, also in % of it.

Instructions are a proxy: they do not see cache misses (a large idempotency table costs
more than its instruction count says) nor the kernel's work (fsync, sockets). Judge a
change by it, and quote the CPU figures of bench.py for what a node spends.

Needs valgrind (``apt-get install valgrind``). About 4 minutes per feature on this host.

Usage: .venv/bin/python loadtest/bench_instructions.py [--features idem,headers]
       [--short 10] [--long 30] [--rate 300] [--partitions 3] [--workers 1] [--mode flow_batch]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench

_SUMMARY = re.compile(rb"^summary: (\d+)$", re.M)


def worker_files(out: Path, res: bench.Result) -> list[Path]:
    """The cachegrind files of this run's node workers (worker0, worker1, ...)."""
    pids = sorted((name, p) for p, name in res.pids.items() if name.startswith("worker"))
    if not pids:
        raise SystemExit(f"{res.sc.name}: no worker pid recorded ({res.failure[:300] or 'no failure'})")
    return [out / f"cg.{p}" for _name, p in pids]


def worker_instructions(out: Path, res: bench.Result) -> int:
    """The instructions the node's workers executed, all of them summed (their cachegrind files)."""
    total = 0
    for f in worker_files(out, res):
        m = _SUMMARY.search(f.read_bytes()) if f.exists() else None
        if m is None:
            raise SystemExit(f"{res.sc.name}: {f} has no summary (did the worker exit cleanly?)")
        total += int(m.group(1))
    return total


def function_counts(path: Path) -> dict[str, int]:
    """Instructions by function (``fn=`` blocks of a cachegrind file, every file's lines summed)."""
    out: dict[str, int] = {}
    fn = ""
    with path.open("rb") as f:
        for line in f:
            if line[:3] == b"fn=":
                fn = line[3:].strip().decode(errors="replace")
            elif line[:1].isdigit() and fn:
                parts = line.split()
                if len(parts) >= 2:
                    out[fn] = out.get(fn, 0) + int(parts[1])
    return out


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--features", default="idem", help="comma-separated, from bench.py's FEATURES")
    ap.add_argument("--short", type=float, default=10.0, help="seconds of the shorter window")
    ap.add_argument("--long", type=float, default=30.0, help="seconds of the longer window")
    ap.add_argument("--rate", type=float, default=300.0, help="messages/s offered (paced)")
    ap.add_argument("--partitions", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1,
                    help="node workers (their instructions summed: with 2, a batch reaching both pays the hop)")
    ap.add_argument("--mode", default="flow_batch", choices=("flow_batch", "produce_batch"))
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--functions", type=int, default=0, metavar="N",
                    help="also print the N C functions (of the interpreter and its modules) whose "
                         "instructions per message the feature moves most, against the plain run before it")
    ap.add_argument("--keep", type=Path, metavar="DIR", help="keep the cachegrind files in DIR")
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    feats = [f for f in args.features.split(",") if f]
    bad = [f for f in feats if f not in bench.FEATURES]
    if bad:
        raise SystemExit(f"--features: unknown {bad}; choose from {', '.join(bench.FEATURES)}")
    bench.PARTITIONS = args.partitions
    name = f"{'flow' if args.mode == 'flow_batch' else 'produce'} batch{args.batch}"
    order = [""]
    for f in feats:
        order += [f, ""]
    print(f"# worker instructions per message under cachegrind: {name}, {args.workers} worker(s), "
          f"{args.partitions} partitions, "
          f"{args.rate:.0f} msgs/s paced, windows of {args.short:.0f} s and {args.long:.0f} s, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, code {bench.code_version()}")
    tmp = Path(tempfile.mkdtemp(prefix="narad-instr-")) if args.keep is None else args.keep
    tmp.mkdir(parents=True, exist_ok=True)
    per: list[tuple[str, float]] = []
    by_fn: list[dict[str, float]] = []  # per scenario: function -> instructions/msg (--functions)
    try:
        for feat in order:
            counts = []
            files: list[list[Path]] = []
            for secs in (args.short, args.long):
                out = tmp / f"{feat or 'plain'}-{secs:g}-{len(per)}"
                out.mkdir()
                bench.NODE_WRAP = ["valgrind", "--tool=cachegrind", "--cache-sim=no",
                                   f"--cachegrind-out-file={out}/cg.%p"]
                sc = bench.Scenario(f"{name}{' +' + feat if feat else ''}", args.mode, args.workers, 1, 8, secs,
                                    batch=args.batch, feature=feat, rate=args.rate)
                res = bench.run(sc, None)
                if res.failure or res.check.failed:
                    raise SystemExit(f"{sc.name} ({secs:g} s) failed:\n{res.failure or res.check.text}")
                counts.append((res.msgs, worker_instructions(out, res)))
                files.append(worker_files(out, res))
            (m1, i1), (m2, i2) = counts
            if m2 <= m1:
                raise SystemExit(f"{feat or 'plain'}: the longer window carried no more messages ({m1} -> {m2})")
            ir = (i2 - i1) / (m2 - m1)
            per.append((feat, ir))
            if args.functions:
                a, b = (_summed([function_counts(f) for f in fs]) for fs in files)
                by_fn.append({f: (b.get(f, 0) - a.get(f, 0)) / (m2 - m1) for f in a.keys() | b.keys()})
            print(f"#   {name + (' +' + feat if feat else ''):<24} {ir:>10,.0f} instructions/msg "
                  f"({m1:,} and {m2:,} msgs)", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
    print("# feature cost: its instructions/msg minus the mean of the plain runs either side of it")
    for i, (feat, ir) in enumerate(per):
        if not feat:
            continue
        base = statistics.fmean([per[i - 1][1], per[i + 1][1]])
        print(f"#   +{feat:<10} {ir - base:>+9,.0f} instructions/msg ({(ir - base) / base * 100:+.1f}% of "
              f"{base:,.0f}; the plain runs {per[i - 1][1]:,.0f} and {per[i + 1][1]:,.0f})")
        if args.functions:
            plain, with_f = by_fn[i - 1], by_fn[i]
            moved = sorted(plain.keys() | with_f.keys(), key=lambda f: -abs(with_f.get(f, 0) - plain.get(f, 0)))
            print(f"#     by C function, +{feat} against the plain run before it (instructions/msg):")
            for f in moved[: args.functions]:
                print(f"#       {with_f.get(f, 0) - plain.get(f, 0):>+9,.0f}  {plain.get(f, 0):>9,.0f} -> "
                      f"{with_f.get(f, 0):>9,.0f}  {f[:90]}")


if __name__ == "__main__":
    main()
