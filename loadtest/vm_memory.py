"""What this VM charges for a page of memory the first time it is touched (read before a sitting).

This machine is a Firecracker VM whose balloon device has free page reporting on: free guest memory
is handed back to the host in 2 MiB blocks, and the next write to such a page costs a host fault on
top of the guest's work. A broker's page-cache writes land on such pages whenever the page cache grows
into free memory (a partition log's appends, a new WAL segment), so part of a sitting's server CPU is
this tax, and how much depends on what was freed (and reported) just before. Touching the memory in
advance does not help: it is reported back as soon as it is free again (measured 2026-12-03:
``reported_kib`` grew by the 21 GiB a warm-up process had just freed, and the next warm-up populated
at the same ~300 MiB/s as the first).

Prints the reporting state (``/sys/module/page_reporting/parameters``) and the tax: CPU per MiB of
writing ``--mib`` into a new file (pages from the free lists) and again over the same file (pages the
page cache already holds), with no fsync, in a temp dir under the working directory.

Usage: .venv/bin/python loadtest/vm_memory.py [--mib 256]
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
from pathlib import Path

PARAMS = Path("/sys/module/page_reporting/parameters")


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def reporting() -> str:
    if not PARAMS.is_dir():
        return "no page_reporting module: free memory is not handed back to a host"
    vals = {}
    for p in sorted(PARAMS.iterdir()):
        try:
            vals[p.name] = p.read_text().strip()
        except OSError:
            continue
    shown = ", ".join(f"{k}={v}" for k, v in vals.items())
    return f"free page reporting: {shown}"


def write_pass(fd: int, chunk: bytes, mib: int) -> float:
    """CPU seconds per MiB of writing `mib` MiB from offset 0."""
    os.lseek(fd, 0, os.SEEK_SET)
    c0 = cpu_s()
    for _ in range(mib):
        os.write(fd, chunk)
    return (cpu_s() - c0) / mib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--mib", type=int, default=256, help="size of the test file (MiB)")
    args = ap.parse_args()
    print(f"# {reporting()}")
    chunk = os.urandom(1 << 20)
    with tempfile.TemporaryDirectory(prefix="narad-vm-memory-", dir=".") as d:
        fd = os.open(Path(d) / "f", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fresh = write_pass(fd, chunk, args.mib)
            reused = write_pass(fd, chunk, args.mib)
        finally:
            os.close(fd)
    print(f"# page-cache writes, {args.mib} MiB: new pages {fresh * 1e3:.2f} ms CPU a MiB "
          f"({1 / fresh:,.0f} MiB/s), the same pages again {reused * 1e3:.2f} ms a MiB ({1 / reused:,.0f} MiB/s): "
          f"the first touch costs {fresh / reused:.1f}x")


if __name__ == "__main__":
    main()
