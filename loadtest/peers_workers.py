"""One worker against two, under bench-peers' full-flow shapes (issue 10: "N workers never slower than one").

Starts our node (``.venv/bin/narad-supervisor``, security on, 6 partitions, as ``run.sh narad`` does) with
``--workers 1``, runs one e2e shape of the shared load generator against it (``python -m loadgen`` from
``../shared/bench-peers``, the harness's own arguments for that shape), stops it, does the same with
``--workers 2``, and repeats ``--rounds`` times, alternating, so both see the same machine. Per run:
acked msgs/s, e2e latency p50, server cores and server CPU per message (the harness's psutil figures),
and the node's worker hops (``narad_worker_hops_total``) per consume. Then the median of each side and
the ratio two workers / one. Figures only.

Needs the harness's venv (``$PEERS_VENV``, default /tmp/peers-venv): run ``../shared/bench-peers/run.sh
narad`` once, or create it from ``../shared/bench-peers/requirements.txt``.

Usage: .venv/bin/python loadtest/peers_workers.py [--shape batched|unbatched] [--rounds 3] [--seconds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from base64 import b64encode
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = (ROOT / ".." / "shared" / "bench-peers").resolve()
VENV = Path(os.environ.get("PEERS_VENV", "/tmp/peers-venv"))
PASSWORD = "peers-bench-admin-pw-1234"
SHAPES = {  # the harness's arguments (run.sh, broker_matrix step 2)
    "batched": ["--procs", "1", "--conc", "4", "--batch", "50", "--cprocs", "1", "--cconc", "2", "--cmax", "100",
                "--backlog", "20000"],
    "unbatched": ["--procs", "1", "--conc", "32", "--batch", "1", "--cprocs", "1", "--cconc", "32", "--cmax", "1",
                  "--backlog", "5000"],
}
HOPS = re.compile(r'^narad_worker_hops_total\{op="(\w+)"\} ([0-9.e+]+)$', re.M)
CONSUMES = re.compile(r'^narad_http_requests_total\{[^}]*route="GET /v1/topics/\{topic\}/consume"[^}]*\} ([0-9.e+]+)$',
                      re.M)


def free_port() -> int:
    """A port with the two above it free too (the node takes port+1 and port+2 for QUIC and the cluster)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65000 and all(_free(port + k) for k in (1, 2)):
            return port
    raise RuntimeError("no free port range found")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _get(url: str, auth: bool = False, timeout: float = 2.0) -> tuple[int, str]:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + b64encode(f"admin:{PASSWORD}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def one_run(workers: int, shape: str, seconds: int, tmp: Path) -> dict[str, float]:
    port = free_port()
    data = tmp / f"w{workers}-{time.monotonic_ns()}"
    env = dict(os.environ, NARAD_ADMIN_PASSWORD=PASSWORD, NARAD_HTTP_HOST="127.0.0.1")
    with open(tmp / "node.log", "ab") as log:
        node = subprocess.Popen([str(ROOT / ".venv" / "bin" / "narad-supervisor"), "--data-dir", str(data), "--port",
                                 str(port), "--workers", str(workers)], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while _get(f"http://127.0.0.1:{port}/readyz")[0] != 200:
                if node.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"node did not become ready (see {tmp / 'node.log'})")
                time.sleep(0.1)
            out = tmp / "e2e.json"
            cmd = [str(VENV / "bin" / "python"), "-m", "loadgen", "--adapter", "http", "--server-pids", str(node.pid),
                   "--opt", f"base_url=http://127.0.0.1:{port}", "--opt", "user=admin", "--opt", f"password={PASSWORD}",
                   "--opt", "partitions=6", "--scenario", "e2e", *SHAPES[shape], "--duration", str(seconds),
                   "--warmup", "3", "--max-msgs", "5000000", "--label", shape, "--out", str(out)]
            subprocess.run(cmd, cwd=PEERS, check=True, timeout=seconds + 150, stdout=subprocess.DEVNULL)
            r = json.loads(out.read_text())
            _, metrics = _get(f"http://127.0.0.1:{port}/metrics", auth=True)
            hops = sum(float(v) for _, v in HOPS.findall(metrics))
            consumes = sum(float(v) for v in CONSUMES.findall(metrics))
            rate = r["ack_rate_msgs_s"]
            cpu = r["cpu"]
            return {
                "rate": rate,
                "e2e_p50": r["e2e_latency"].get("p50_ms", float("nan")),
                "server_cores": cpu["server_cores"],
                "us_per_msg": cpu["server_cores"] / rate * 1e6 if rate else float("nan"),
                "machine_cores": cpu["machine_busy_cores"],
                "hops_per_consume": hops / consumes if consumes else 0.0,
            }
        finally:
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(30)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
            shutil.rmtree(data, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="batched")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=15, help="measured seconds per run (after 3 s of warm-up)")
    args = ap.parse_args()
    if not (VENV / "bin" / "python").exists():
        sys.exit(f"no harness venv at {VENV}: run ../shared/bench-peers/run.sh narad once (or set PEERS_VENV)")
    tmp = Path(tempfile.mkdtemp(prefix="narad-peers-workers-"))
    runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    print(f"# bench-peers e2e {args.shape} against one node, 1 and 2 workers alternating, {args.rounds} rounds, "
          f"{args.seconds} s each, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'run':>10} {'msgs/s':>9} {'e2e p50 ms':>10} {'srv cores':>9} {'srv us/msg':>10} {'machine':>8} "
          f"{'hops/consume':>12}")
    try:
        for i in range(args.rounds):
            for w in (1, 2):
                m = one_run(w, args.shape, args.seconds, tmp)
                runs[w].append(m)
                print(f"{f'w{w} r{i + 1}':>10} {m['rate']:9,.0f} {m['e2e_p50']:10.1f} {m['server_cores']:9.2f} "
                      f"{m['us_per_msg']:10.1f} {m['machine_cores']:8.2f} {m['hops_per_consume']:12.2f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in runs.items() if rs}
    if len(med) == 2:
        print(f"# median: 1 worker {med[1]['rate']:,.0f} msgs/s at {med[1]['us_per_msg']:.1f} us/msg; "
              f"2 workers {med[2]['rate']:,.0f} at {med[2]['us_per_msg']:.1f} us/msg; "
              f"2 / 1: {med[2]['rate'] / med[1]['rate']:.2f}x msgs/s, "
              f"{med[2]['us_per_msg'] / med[1]['us_per_msg']:.2f}x CPU per message")


if __name__ == "__main__":
    main()
