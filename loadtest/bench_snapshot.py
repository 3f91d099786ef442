"""Peak memory of a metastore snapshot and of a snapshot restore, for a large FSM.

Builds a real metastore state machine (narad.meta.fsm.FSM, LMDB) in a temp dir by
applying real Raft entries (CreateTopic with a JSON schema of 2-6 KiB, CreateUser),
committing every 500 entries, until the LMDB data file holds --mib MiB of used
pages (default 25). Then, each in a FRESH child process (this script run again
with --phase), so that the build-up does not count:

* snapshot: what the Raft snapshot writer does (narad.meta.raft._serialize): write
  a small header to a new file, ``fsm.snapshot_to(fd)`` (LMDB ``env.copyfd`` under
  a read transaction), fsync;
* restore: what a follower does with that file: ``fsm.restore_from(path, offset,
  expected_index)`` on an empty FSM (stream the image into ``<fsm>.restore``,
  fsync, check the index, rename over the FSM, reopen).

In the child the FSM is opened first, then /proc/self/status is read (VmHWM,
VmRSS, RssAnon, RssFile), the high-water mark is reset (``5`` into
/proc/self/clear_refs; if the kernel refuses, the table says so and the peak
is measured from the process's own earlier peak), the phase runs while a thread
samples /proc/self/status every 5 ms (max RssAnon and RssFile), and the
figures are read again. LMDB is memory-mapped: pages of the map that the copy
touches are file-backed and count in VmRSS/VmHWM as RssFile (page cache the
kernel can drop), not as process heap; RssAnon is the heap/stack part. Both are
printed. Before each phase the script asks the kernel to drop the page cache
of its own files (posix_fadvise DONTNEED), so reads come from the disk.

Usage: .venv/bin/python loadtest/bench_snapshot.py [--mib 25]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from narad.meta import commands as C  # noqa: E402
from narad.meta.fsm import FSM  # noqa: E402
from narad.meta.records import Grant, TopicRecord, UserRecord  # noqa: E402

MIB = 1 << 20
COMMIT_EVERY = 500
HEADER = b"NARADBENCHSNAP\0\0" + bytes(48)  # stands in for the product's magic + msgpack header
STAMP0 = 1_790_000_000_000
SAMPLE_S = 0.005


# ---- /proc -----------------------------------------------------------------------
def status_kib() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile, RssShmem of this process, in KiB."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0])
    return out


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class Sampler(threading.Thread):
    """Reads /proc/self/status every 5 ms; keeps the max of RssAnon and RssFile."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        first = status_kib()
        self.max_anon = first["RssAnon"]
        self.max_file = first["RssFile"]
        self.samples = 0

    def run(self) -> None:
        while not self.stop.is_set():
            s = status_kib()
            self.max_anon = max(self.max_anon, s["RssAnon"])
            self.max_file = max(self.max_file, s["RssFile"])
            self.samples += 1
            time.sleep(SAMPLE_S)

    def finish(self) -> None:
        self.stop.set()
        self.join()
        s = status_kib()  # one last look after the phase
        self.max_anon = max(self.max_anon, s["RssAnon"])
        self.max_file = max(self.max_file, s["RssFile"])


def drop_cache(path: Path) -> None:
    """Ask the kernel to drop the page cache of one of our own files."""
    if not path.exists():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---- build ---------------------------------------------------------------------------
def used_bytes(fsm: FSM) -> int:
    """Bytes of the LMDB file in use: (last page number + 1) * page size."""
    return (int(fsm.env.info()["last_pgno"]) + 1) * int(fsm.env.stat()["psize"])


def schema_json(rng: random.Random, i: int) -> bytes:
    target = rng.randint(2048, 6144)
    props: dict[str, Any] = {}
    n = 0
    doc: dict[str, Any] = {"$id": f"urn:bench:topic:{i}", "type": "object", "properties": props}
    while len(json.dumps(doc)) < target:
        props[f"field_{n}_{rng.getrandbits(32):08x}"] = {
            "type": rng.choice(["string", "integer", "number", "boolean"]),
            "description": f"bench field {n} of topic {i} ({rng.getrandbits(64):016x})",
        }
        n += 1
    doc["required"] = sorted(props)[: n // 2]
    return json.dumps(doc, separators=(",", ":")).encode()


def build(path: Path, target: int) -> tuple[int, int, int, int]:
    """Apply entries until the FSM's used pages reach ``target`` bytes.
    Returns (applied index, topics, users, used bytes)."""
    rng = random.Random(1)
    fsm = FSM(path)
    index = topics = users = 0
    try:
        while True:
            for _ in range(COMMIT_EVERY):
                index += 1
                stamp = STAMP0 + index
                if index % 5 == 0:
                    users += 1
                    user = UserRecord(
                        username=f"bench-user-{users:07d}",
                        password_hash=f"$argon2id$v=19$m=65536,t=3,p=4${rng.getrandbits(256):064x}".encode(),
                        grants=[Grant("produce", [f"bench.topic-{topics:07d}*"]), Grant("consume", ["bench.*"])],
                    )
                    payload: Any = C.CreateUser(user)
                else:
                    topics += 1
                    rec = TopicRecord(
                        name=f"bench.topic-{topics:07d}", id=f"{rng.getrandbits(64):016x}",
                        partitions=rng.randint(1, 12), retention_ms=7 * 86_400_000, visibility_timeout_ms=30_000,
                        max_in_flight_per_partition=1024, max_acked_ahead_per_partition=1024,
                        created_at=stamp // 1000,
                    )
                    payload = C.CreateTopic(rec, schema=schema_json(rng, topics))
                res = fsm.apply(index, C.encode(payload, request_id="", stamp_ms=stamp))
                if not res.ok:
                    raise RuntimeError(f"entry {index} refused: {res.code} {res.message}")
            fsm.commit()
            size = used_bytes(fsm)
            if size >= target:
                fsm.sync()
                return index, topics, users, size
    finally:
        fsm.close()


# ---- phases (child process) --------------------------------------------------------------
def run_phase(phase: str, work: Path) -> dict[str, Any]:
    src, snap = work / "leader" / "fsm", work / "snapshot.bin"
    if phase == "snapshot":
        fsm = FSM(src)
        drop_cache(src / "data.mdb")
    else:
        fsm = FSM(work / "follower" / "fsm")  # empty: a new node that is sent the snapshot
        drop_cache(snap)
    expected = int(json.loads((work / "build.json").read_text())["index"])
    before = status_kib()
    reset = reset_hwm()
    after_reset = status_kib()
    sampler = Sampler()
    sampler.start()
    t0 = time.perf_counter()
    if phase == "snapshot":
        fd = os.open(snap, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, HEADER)
            got = fsm.snapshot_to(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        if got != expected:
            raise RuntimeError(f"snapshot holds index {got}, expected {expected}")
    else:
        fsm.restore_from(str(snap), len(HEADER), expected)
    dur = time.perf_counter() - t0
    sampler.finish()
    after = status_kib()
    # Outside the measured window: the restored FSM is the leader's.
    if phase == "restore" and fsm.applied_index != expected:
        raise RuntimeError(f"restored FSM at index {fsm.applied_index}, expected {expected}")
    size = used_bytes(fsm)
    fsm.close()
    return {
        "phase": phase, "used": size, "dur": dur, "reset": reset, "before": before, "after_reset": after_reset,
        "after": after, "max_anon": sampler.max_anon, "max_file": sampler.max_file, "samples": sampler.samples,
    }


def spawn(phase: str, work: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--phase", phase, "--work", str(work)],
        check=True, capture_output=True, text=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


# ---- report -----------------------------------------------------------------------------
def mib(kib: int) -> str:
    return f"{kib / 1024:.1f}"


def report(args: argparse.Namespace, work: Path) -> None:
    b = json.loads((work / "build.json").read_text())
    print(f"FSM built: {b['index']} entries ({b['topics']} topics with 2-6 KiB schemas, {b['users']} users) "
          f"in {b['secs']:.1f} s; LMDB used {b['used'] / MIB:.1f} MiB, data.mdb {b['file'] / MIB:.1f} MiB")
    rows = [spawn("snapshot", work), spawn("restore", work)]
    snap_size = (work / "snapshot.bin").stat().st_size
    print(f"snapshot file: {snap_size / MIB:.1f} MiB ({snap_size} bytes, {len(HEADER)}-byte header + LMDB image)")
    print()
    head = (f"{'phase':<9} {'FSM MiB':>7} {'dur s':>6} {'HWM before':>10} {'HWM after':>9} {'peak +':>6} "
            f"{'Anon before':>11} {'Anon max':>8} {'Anon after':>10} {'File before':>11} {'File max':>8} "
            f"{'samples':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        base = r["after_reset"] if r["reset"] else r["before"]
        print(f"{r['phase']:<9} {r['used'] / MIB:>7.1f} {r['dur']:>6.2f} {mib(base['VmHWM']):>10} "
              f"{mib(r['after']['VmHWM']):>9} {mib(r['after']['VmHWM'] - base['VmHWM']):>6} "
              f"{mib(r['after_reset']['RssAnon']):>11} {mib(r['max_anon']):>8} {mib(r['after']['RssAnon']):>10} "
              f"{mib(r['after_reset']['RssFile']):>11} {mib(r['max_file']):>8} {r['samples']:>7}")
    print()
    if all(r["reset"] for r in rows):
        print("VmHWM was reset (clear_refs 5) after the FSM was opened: 'HWM before' is the RSS at the start")
        print("of the phase, 'peak +' the phase's own peak RSS above it (anonymous + file-backed pages).")
    else:
        print("WARNING: /proc/self/clear_refs refused; 'HWM before' is the child's peak so far (import + open),")
        print("so 'peak +' only shows growth above that earlier peak.")
    print("Anon = RssAnon (heap, stacks), File = RssFile (mapped files: the LMDB map, libraries), at the start of")
    print("the phase ('before'), largest seen by a 5 ms sampler thread during it ('max'), and at its end ('after').")
    print("All memory figures in MiB.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--mib", type=float, default=25.0, help="LMDB data to build, MiB of used pages (default 25)")
    ap.add_argument("--phase", choices=["snapshot", "restore"], help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(run_phase(args.phase, args.work)))
        return
    work = Path(tempfile.mkdtemp(prefix="narad-bench-snapshot-"))
    try:
        t0 = time.perf_counter()
        index, topics, users, used = build(work / "leader" / "fsm", int(args.mib * MIB))
        secs = time.perf_counter() - t0
        file_size = (work / "leader" / "fsm" / "data.mdb").stat().st_size
        (work / "build.json").write_text(json.dumps(
            {"index": index, "topics": topics, "users": users, "used": used, "file": file_size, "secs": secs}))
        report(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
