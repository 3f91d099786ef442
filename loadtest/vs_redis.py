"""Narad against Redis 7 Streams on this machine, the yardstick of issue 10.

Runs the shared peer harness (``../shared/bench-peers/run.sh``) for our node and
then for Redis (``appendfsync always``), back to back, ``--sittings`` times, and
prints per shape: our msgs/s, Redis's, the ratio (median and range over the
sittings) and server CPU per message for both, plus the paced latency step
(p50/p99 at 200 msg/s). The ratio within one sitting is the figure that counts:
the machine is shared, so the absolute rates move between sittings.

Usage (from the repository root; the harness installs Redis and its venv):

    .venv/bin/python loadtest/vs_redis.py [--sittings 1] [--quick] [--tag NAME]
    .venv/bin/python loadtest/vs_redis.py --report NAME   # table of earlier sittings

Results stay in ``$PEERS_RESULTS`` (default /tmp/bench-peers/results) as
``narad-<tag><i>`` and ``redis-<tag><i>``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HARNESS = (ROOT / ".." / "shared" / "bench-peers" / "run.sh").resolve()
RESULTS = Path(os.environ.get("PEERS_RESULTS", "/tmp/bench-peers/results"))

SHAPES = [
    ("produce", "b1-p2c64", "single produce, 2 procs x 64 conns"),
    ("produce", "b1-p1c64", "single produce, 1 proc x 64 conns"),
    ("produce", "b100-p2c4", "batch produce, 100 per call, 2 x 4"),
    ("produce", "b100-p1c4", "batch produce, 100 per call, 1 x 4"),
    ("e2e", "unbatched", "full flow, one message per call"),
    ("e2e", "batched", "full flow, batches"),
]


def _load(d: Path, scenario: str, label: str) -> dict | None:
    return _load_file(d / f"{scenario}-{label}.json")


def _load_file(p: Path) -> dict | None:
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except ValueError:
        return None


def _rate(r: dict) -> float | None:
    return r.get("ack_rate_msgs_s") if r["scenario"] == "e2e" else r.get("produce_rate_msgs_s")


def _cpu_us(r: dict) -> float | None:
    n = r.get("acked_total") if r["scenario"] == "e2e" else r.get("produced_total")
    return r["cpu"]["server_cpu_s"] / n * 1e6 if n else None


def _fmt(xs: list[float], unit: str = "") -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    m = statistics.median(xs)
    if len(xs) == 1:
        return f"{m:,.0f}{unit}" if m >= 10 else f"{m:.2f}{unit}"
    return (f"{m:,.0f}{unit} [{min(xs):,.0f}-{max(xs):,.0f}]" if m >= 10
            else f"{m:.2f}{unit} [{min(xs):.2f}-{max(xs):.2f}]")


def report(tag: str) -> None:
    ours = sorted(RESULTS.glob(f"narad-{tag}*"))
    pairs = [(d, RESULTS / d.name.replace("narad-", "redis-", 1)) for d in ours]
    pairs = [(a, b) for a, b in pairs if b.exists()]
    if not pairs:
        sys.exit(f"no sittings named {tag} under {RESULTS}")
    print(f"{len(pairs)} sitting(s): " + ", ".join(a.name for a, _ in pairs))
    print("| shape | Narad msgs/s | Redis msgs/s | ratio | server CPU us/msg, Narad / Redis "
          "| other CPU s (Narad run) |")
    print("|---|---|---|---|---|---|")
    for scenario, label, what in SHAPES:
        n_rates, r_rates, ratios, n_cpu, r_cpu, other = [], [], [], [], [], []
        for a, b in pairs:
            ra, rb = _load(a, scenario, label), _load(b, scenario, label)
            if not ra or not rb:
                continue
            x, y = _rate(ra), _rate(rb)
            n_rates.append(x)
            r_rates.append(y)
            ratios.append(x / y if x and y else None)
            n_cpu.append(_cpu_us(ra))
            r_cpu.append(_cpu_us(rb))
            other.append(ra["cpu"].get("other_cpu_s"))
        if not n_rates:
            continue
        print(f"| {what} (`{label}`) | {_fmt(n_rates)} | {_fmt(r_rates)} | {_fmt(ratios, 'x')} | "
              f"{_fmt(n_cpu)} / {_fmt(r_cpu)} | {_fmt(other)} |")
    lat = [(_load_file(a / "latency.json"), _load_file(b / "latency.json")) for a, b in pairs]
    lat = [(x, y) for x, y in lat if x and y]
    if lat:
        p50n = [x["produce_call_latency"]["p50_ms"] for x, _ in lat]
        p50r = [y["produce_call_latency"]["p50_ms"] for _, y in lat]
        p99n = [x["produce_call_latency"]["p99_ms"] for x, _ in lat]
        p99r = [y["produce_call_latency"]["p99_ms"] for _, y in lat]
        print(f"| single produce latency at 200 msg/s, p50 / p99 ms | {_fmt(p50n)} / {_fmt(p99n)} | "
              f"{_fmt(p50r)} / {_fmt(p99r)} | | | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sittings", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="QUICK=1 short runs (smoke test only)")
    ap.add_argument("--tag", default="vs", help="results are named narad-<tag><i> / redis-<tag><i>")
    ap.add_argument("--report", metavar="TAG", help="only print the table of earlier sittings")
    a = ap.parse_args()
    if a.report:
        report(a.report)
        return
    if not HARNESS.exists():
        sys.exit(f"the peer harness is not at {HARNESS}")
    env = dict(os.environ, NARAD_PROJECT=str(ROOT))
    if a.quick:
        env["QUICK"] = "1"
    for i in range(1, a.sittings + 1):
        for peer in ("narad", "redis"):
            env["TAG"] = f"-{a.tag}{i}"
            print(f"sitting {i}: {peer}", flush=True)
            subprocess.run(["bash", str(HARNESS), peer], cwd=ROOT, env=env, check=True,
                           stdout=subprocess.DEVNULL, timeout=1500)
    report(a.tag)


if __name__ == "__main__":
    main()
