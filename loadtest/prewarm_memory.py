"""Touch this VM's free memory once before a benchmark sitting (and say whether it was needed).

On this machine (a VM), the first write to a guest page the VM has never touched costs about ten
times the CPU of a write to a page used before: the hypervisor backs the page at that moment, and the
fault is charged to whatever instruction touched it. A broker's page-cache writes (the WAL, the
partition logs) and page zeroing land on fresh pages for the first tens of GiB after a boot, so a
sitting run on a freshly booted VM measures the hypervisor as much as the code under test, and which
side of a comparison pays more depends on the order of the runs. Measured 2026-12-03 on a VM up 43
minutes: writing 1 GiB into a new file cost 2.76 ms of CPU per MiB (362 MiB/s) the first time and
0.22 ms per MiB (4,629 MiB/s) when the same pages were reused; ``perf`` showed the node's
``copy_folio_from_iter_atomic`` (page-cache copy) at 9.8 % of its CPU, at the same ~400 MiB/s.

This maps anonymous memory with MAP_POPULATE (the kernel allocates and zeroes every page: the
first touch) in 256 MiB steps up to MemAvailable less ``--keep`` MiB, holding every step until the
end so that each one gets pages not used by an earlier step, then frees it all. Each step's rate is
printed: a warmed VM populates at several GiB/s, a fresh one at a few hundred MiB/s. Nothing is
written to disk; the page cache may be reclaimed (clean pages) while the memory is held.

Usage: .venv/bin/python loadtest/prewarm_memory.py [--keep MIB] [--max-gib N]
"""

from __future__ import annotations

import argparse
import mmap
import resource
import time

STEP = 256 << 20


def available_mib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--keep", type=int, default=2048, metavar="MIB", help="leave this much of MemAvailable free")
    ap.add_argument("--max-gib", type=float, default=64.0, metavar="N", help="touch at most this much")
    args = ap.parse_args()
    target = min(available_mib() - args.keep, int(args.max_gib * 1024))
    if target < STEP >> 20:
        print(f"# nothing to do: MemAvailable less --keep is {target} MiB")
        return
    held: list[mmap.mmap] = []
    rates: list[float] = []
    t_all, c_all = time.monotonic(), cpu_s()
    try:
        while (len(held) + 1) * (STEP >> 20) <= target:
            if available_mib() < args.keep + (STEP >> 20):
                break  # something else took memory meanwhile
            c0 = cpu_s()
            held.append(mmap.mmap(-1, STEP, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE))
            rates.append((STEP >> 20) / max(cpu_s() - c0, 1e-6))
    finally:
        for m in held:
            m.close()
    wall, cpu = time.monotonic() - t_all, cpu_s() - c_all
    gib = len(held) * STEP / 2**30
    if not rates:
        print("# nothing touched")
        return
    srt = sorted(rates)
    print(f"# touched {gib:.2f} GiB in {wall:.1f} s ({cpu:.1f} s CPU); populate rate per 256 MiB step: "
          f"median {srt[len(srt) // 2]:,.0f} MiB/s, slowest {srt[0]:,.0f}, fastest {srt[-1]:,.0f}")
    print("# a warmed VM populates at several GiB/s; steps at a few hundred MiB/s were first touches")


if __name__ == "__main__":
    main()
