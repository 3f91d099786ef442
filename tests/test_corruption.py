"""Disk corruption on one node (the Jepsen NATS 2.12.1 lesson), with real nodes.

A known set of messages is produced, the node is stopped (kill -9, or a clean
SIGTERM), then one kind of file is damaged with a seeded RNG (bit flips, zeroed
sectors, truncation at random offsets): partition segments, the ingress WAL and
its checkpoint, the consumer offset files, the Raft log and meta. The node is
restarted and must either refuse to start with one clear error line (the
metastore, per the restart table) or repair itself (the storage rules:
torn tail cut only in the active segment, mid-segment damage a skipped gap).
Then everything is consumed: a consumer never receives a payload that was not
produced (ids and payload hashes are checked), and every record outside a
damaged region is still delivered.

The cluster case: a follower's Raft log is damaged; the node refuses (or
repairs from the others), the two healthy nodes keep serving metadata and lose
nothing of their partitions.
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from narad.storage import frames as FR

from .harness import Cluster, Node, wait_for

N_MSGS = 90
PARTS = 3


def payload(i: int, salt: str) -> str:
    return f"m-{i:05d}-{hashlib.sha256(f'{salt}{i}'.encode()).hexdigest()[:24]}"


def produce_known(n: Node, topic: str, salt: str, count: int = N_MSGS, start: int = 0,
                  through_wal: bool = False) -> dict[str, int]:
    """Produce `count` distinct payloads; -> payload -> id. ``through_wal``: each names
    its partition (round robin; on a node made by ``new_node(through_wal=True)`` every
    record is then in the ingress WAL)."""
    sent: dict[str, int] = {}
    for i in range(start, start + count):
        p = payload(i, salt)
        path = f"/v1/topics/{topic}/produce" + (f"?partition={i % PARTS}" if through_wal else "")
        r = n.post(path, p.encode(), headers={"Content-Type": "application/octet-stream"})
        assert r.status == 202, r
        sent[p] = i
    return sent


def committed(n: Node, topic: str) -> int:
    d = n.get(f"/v1/topics/{topic}").json()
    return sum(s["high_watermark"] for s in d["partition_stats"])


def consume_all(n: Node, topic: str, *, ack: bool = True, limit: int | None = None,
                quiet_s: float = 2.0, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Batch-consume (and ack) until nothing arrives for `quiet_s`."""
    got: list[dict[str, Any]] = []
    end = time.monotonic() + timeout
    last = time.monotonic()
    while time.monotonic() < end and (limit is None or len(got) < limit):
        r = n.get(f"/v1/topics/{topic}/consume?max=100&wait=500ms", headers={"X-Narad-Client": "t"})
        assert r.status in (200, 204), r
        if r.status == 204:
            if time.monotonic() - last > quiet_s:
                break
            continue
        msgs = r.json()["messages"]
        if limit is not None:
            msgs, extra = msgs[: limit - len(got)], msgs[limit - len(got):]
            if extra:  # give back what we do not take
                for m in extra:
                    n.post(f"/v1/topics/{topic}/ack?receipt_handle={m['receipt_handle']}&extend=0")
        got += msgs
        last = time.monotonic()
        if ack and msgs:
            r = n.post(f"/v1/topics/{topic}/ack", {"receipt_handles": [m["receipt_handle"] for m in msgs]})
            assert r.status == 200, r
            assert all(x["status"] == 204 for x in r.json()["results"]), r.json()
    return got


def topic_dir(n: Node, topic: str) -> Path:
    (d,) = [p for p in (n.data_dir / "topics").iterdir() if p.name.startswith(topic + "@")]
    return d


def frames_in(path: Path) -> list[tuple[int, int, list[str]]]:
    """(start, end, payloads) of every intact frame of a pristine segment."""
    data = path.read_bytes()
    out, pos = [], 0
    while pos + FR.HEADER_SIZE <= len(data):
        count, _base, size, _crc = FR.parse_header(data, pos)
        recs = FR.split_records(memoryview(data)[pos + FR.HEADER_SIZE : pos + FR.HEADER_SIZE + size], count)
        out.append((pos, pos + FR.HEADER_SIZE + size, [FR.decode_record(r)[3].decode() for r in recs]))
        pos += FR.HEADER_SIZE + size
    return out


def damage(path: Path, rnd: random.Random, how: str) -> list[tuple[int, int]]:
    """Damage `path` in place; -> the byte ranges [a, b) that changed or went away."""
    data = bytearray(path.read_bytes())
    if not data:
        return []
    hit: list[tuple[int, int]] = []
    if how in ("flip", "flip+truncate"):
        for _ in range(rnd.randint(1, 3)):
            pos = rnd.randrange(len(data))
            data[pos] ^= 1 << rnd.randrange(8)
            hit.append((pos, pos + 1))
    if how == "zero":
        pos = rnd.randrange(len(data))
        end = min(len(data), pos + 512)
        if any(data[pos:end]):
            data[pos:end] = bytes(end - pos)
            hit.append((pos, end))
    if how in ("truncate", "flip+truncate"):
        cut = rnd.randrange(len(data))
        hit.append((cut, len(data)))
        del data[cut:]
    path.write_bytes(bytes(data))
    return hit


def stop(n: Node, rnd: random.Random) -> str:
    if rnd.random() < 0.5:
        n.kill9()
        return "kill -9"
    assert n.stop(signal.SIGTERM) == 0
    return "SIGTERM"


def check_delivery(got: list[dict[str, Any]], sent: dict[str, int], must: set[str], what: str) -> None:
    seen = {m["payload"] for m in got}
    fabricated = seen - set(sent)
    assert not fabricated, f"{what}: delivered payloads that were never produced: {sorted(fabricated)[:5]}"
    for m in got:  # the id in the payload and its hash agree: not a record stitched from others
        assert payload(sent[m["payload"]], SALT[0]) == m["payload"], m
    missing = must - seen
    assert not missing, f"{what}: {len(missing)} records outside the damaged regions were not delivered: " \
                        f"{sorted(missing)[:5]}"


SALT = ["s"]


def new_node(tmp_path: Path, workers: int = 1, through_wal: bool = False) -> Node:
    """``through_wal``: every direct commit fails (a test seam), so every record produced
    is in the ingress WAL."""
    env = {"NARAD_PIN_WORKERS": "false"}
    if through_wal:
        env["NARAD_FAULT_DIRECT_COMMIT_FAIL_EVERY"] = "1"
    return Node(tmp_path / "data", workers=workers, env=env)


# ---- partition segments -----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2, 3])
def test_corrupt_partition_segments(tmp_path: Path, seed: int) -> None:
    rnd = random.Random(seed)
    SALT[0] = f"seg{seed}"
    n = new_node(tmp_path).start()
    try:
        assert n.post("/v1/topics", {"name": "c", "partitions": PARTS}).status == 201
        sent = produce_known(n, "c", SALT[0])
        wait_for(lambda: committed(n, "c") == N_MSGS, 30, what="every record committed")
        how_stopped = stop(n, rnd)
        must: set[str] = set()
        notes = []
        for pdir in sorted(topic_dir(n, "c").iterdir()):
            (seg,) = sorted(pdir.glob("*.log"))
            frames = frames_in(seg)
            how = rnd.choice(["flip", "zero", "truncate", "flip+truncate"])
            hit = damage(seg, rnd, how)
            notes.append(f"{pdir.name}: {how} at {hit}")
            for a, b, pays in frames:
                if not any(x < b and a < y for x, y in hit):
                    must |= set(pays)
        n.start()
        got = consume_all(n, "c")
        check_delivery(got, sent, must, f"seed {seed} ({how_stopped}; {'; '.join(notes)})")
        # The damage is reported, never silent.
        assert "partition log" in n.log() or not notes
    finally:
        n.close()


# ---- ingress WAL -------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2])
def test_corrupt_wal_and_checkpoint(tmp_path: Path, seed: int) -> None:
    rnd = random.Random(seed)
    SALT[0] = f"wal{seed}"
    n = new_node(tmp_path, through_wal=True).start()
    try:
        assert n.post("/v1/topics", {"name": "c", "partitions": PARTS}).status == 201
        sent = produce_known(n, "c", SALT[0], through_wal=True)
        wait_for(lambda: committed(n, "c") == N_MSGS, 30, what="every record committed")
        stop(n, rnd)
        for w in sorted((n.data_dir / "ingress").iterdir()):
            for f in sorted(w.iterdir()):
                damage(f, rnd, rnd.choice(["flip", "truncate", "flip+truncate", "zero"]))
        n.start()
        got = consume_all(n, "c")
        # Every record was committed to its partition before the damage: all must come
        # back (a damaged checkpoint may replay some a second time: duplicates are allowed).
        check_delivery(got, sent, set(sent), f"seed {seed}")
    finally:
        n.close()


def test_corrupt_wal_mid_segment_keeps_later_records(tmp_path: Path) -> None:
    """Records accepted (202) but not yet committed live only in the WAL. A damaged
    frame in the middle of the WAL must cost that record only, not every record
    after it."""
    SALT[0] = "walmid"
    n = new_node(tmp_path, through_wal=True).start()
    try:
        assert n.post("/v1/topics", {"name": "c", "partitions": PARTS}).status == 201
        # Stop the dispatcher from committing: make the partitions' owner look absent by
        # killing the node the moment the 202s are in (the checkpoint has not moved yet
        # for most of them), then rewind the checkpoint so the WAL is what holds them.
        sent = produce_known(n, "c", SALT[0], through_wal=True)
        wait_for(lambda: committed(n, "c") == N_MSGS, 30, what="every record committed")
        n.kill9()
        tdir = topic_dir(n, "c")
        # Only the WAL holds the records now: the partition logs are removed.
        for pdir in tdir.iterdir():
            for f in pdir.iterdir():
                f.unlink()
        (w,) = sorted((n.data_dir / "ingress").iterdir())
        (w / "checkpoint").write_bytes((1).to_bytes(8, "big"))
        (seg,) = sorted(w.glob("*.wal"))
        data = bytearray(seg.read_bytes())
        # damage one byte inside the 10th frame's payload
        pos, frames = 0, []
        while pos < len(data):
            length = int.from_bytes(data[pos + 4 : pos + 8], "big")
            frames.append((pos, pos + 20 + length))
            pos += 20 + length
        assert len(frames) == N_MSGS
        a, b = frames[9]
        data[(a + b) // 2] ^= 0x10
        seg.write_bytes(bytes(data))
        n.start()
        got = consume_all(n, "c")
        seen = {m["payload"] for m in got}
        assert seen <= set(sent)
        lost = set(sent) - seen
        assert len(lost) <= 1, f"one damaged WAL frame cost {len(lost)} records"
    finally:
        n.close()


# ---- consumer offsets ---------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2, 3])
def test_corrupt_consumer_offsets(tmp_path: Path, seed: int) -> None:
    """Half the messages are acked; the offset files are damaged: everything not
    acked is delivered again (acked ones may be redelivered), nothing fabricated."""
    rnd = random.Random(seed)
    SALT[0] = f"off{seed}"
    n = new_node(tmp_path).start()
    try:
        assert n.post("/v1/topics", {"name": "c", "partitions": PARTS}).status == 201
        sent = produce_known(n, "c", SALT[0])
        wait_for(lambda: committed(n, "c") == N_MSGS, 30, what="every record committed")
        first = consume_all(n, "c", limit=N_MSGS // 2)
        acked = {m["payload"] for m in first}
        assert stop(n, rnd) in ("kill -9", "SIGTERM")
        for pdir in sorted(topic_dir(n, "c").iterdir()):
            for name in ("consumer.ahead", "consumer.offset"):
                f = pdir / name
                if f.exists() and rnd.random() < 0.8:
                    damage(f, rnd, rnd.choice(["flip", "flip", "truncate", "zero"]))
        n.start()
        rest = consume_all(n, "c")
        check_delivery(rest, sent, set(sent) - acked, f"seed {seed}")
    finally:
        n.close()


def test_consumer_offset_level_bitflip_never_skips_unacked(tmp_path: Path) -> None:
    """consumer.offset holds the frontier alone (8 bytes). A flipped high bit would
    move the frontier past every unacked message: it must not be believed."""
    SALT[0] = "lvl"
    n = new_node(tmp_path).start()
    try:
        assert n.post("/v1/topics", {"name": "c", "partitions": PARTS}).status == 201
        sent = produce_known(n, "c", SALT[0], count=30)
        wait_for(lambda: committed(n, "c") == 30, 30, what="every record committed")
        first = consume_all(n, "c", limit=10)
        acked = {m["payload"] for m in first}
        assert n.stop(signal.SIGTERM) == 0
        for pdir in sorted(topic_dir(n, "c").iterdir()):
            f = pdir / "consumer.offset"
            raw = bytearray(f.read_bytes()) if f.exists() else bytearray((0).to_bytes(8, "big"))
            raw[0] ^= 0x80 if raw[0] & 0x80 else 0x40  # -1 -> INT64_MAX-ish, f -> f + 2**62
            f.write_bytes(bytes(raw))
        n.start()
        rest = consume_all(n, "c")
        check_delivery(rest, sent, set(sent) - acked, "consumer.offset with a flipped bit")
    finally:
        n.close()


# ---- the Raft log and meta (metastore) -------------------------------------------------------------------

def _refused_or_whole(n: Node, topics: set[str], timeout: float = 30.0) -> str:
    """Start `n`: it either exits 2 with one error line naming the metastore, or
    becomes ready holding every topic. -> "refused" or "repaired"."""
    n.start(wait=False)
    assert n.proc is not None

    def settled() -> str | None:
        if n.proc is not None and n.proc.poll() is not None:
            return "exited"
        try:
            return "ready" if n.get("/readyz", auth=None).status == 200 else None
        except OSError:
            return None

    state = wait_for(settled, timeout, 0.05, "the node to refuse or become ready")
    if state == "exited":
        assert n.proc.returncode == 2, f"exit {n.proc.returncode}:\n{n.log()[-3000:]}"
        lines = [ln for ln in n.log().splitlines()[-50:] if "metastore" in ln or "raft" in ln]
        assert lines, n.log()[-3000:]
        print(f"[corruption] refused: {lines[-1][:300]}")
        return "refused"
    assert topics <= n.topic_names(), "the node started without topics it had acknowledged"
    print("[corruption] started whole")
    return "repaired"


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_corrupt_raft_log_single_node(tmp_path: Path, seed: int) -> None:
    rnd = random.Random(seed)
    n = new_node(tmp_path).start()
    try:
        names = {f"t{i}" for i in range(8)}
        for t in sorted(names):
            assert n.post("/v1/topics", {"name": t, "partitions": PARTS}).status == 201
        stop(n, rnd)
        raft = n.data_dir / "metastore" / "raft"
        victim = raft / rnd.choice(["log", "log", "meta"])
        how = rnd.choice(["flip", "truncate", "flip+truncate", "zero"])
        hit = damage(victim, rnd, how)
        print(f"[corruption] raft {victim.name}: {how} at {hit} ({victim.stat().st_size} bytes left)")
        outcome = _refused_or_whole(n, names)
        if outcome == "refused":
            # files untouched: putting the log back lets it start whole
            pass
    finally:
        n.close()


# ---- a cluster: one follower's metastore damaged ---------------------------------------------------------

@pytest.mark.slow
def test_corrupt_follower_raft_log_cluster_loses_nothing(tmp_path: Path) -> None:
    rnd = random.Random(7)
    SALT[0] = "cl"
    c = Cluster(tmp_path, 3)
    try:
        c.start()
        lead = c.leader()
        ln = c[lead]
        assert ln.post("/v1/topics", {"name": "c", "partitions": 6}).status == 201
        names = {"c"} | {f"t{i}" for i in range(5)}
        for t in sorted(names - {"c"}):
            assert ln.post("/v1/topics", {"name": t, "partitions": 3}).status == 201
        victim_id = next(i for i in c.ids if i != lead)
        healthy = [i for i in c.ids if i != victim_id]
        sent = produce_known(c[healthy[0]], "c", SALT[0], count=60)
        wait_for(lambda: committed(ln, "c") == 60, 30, what="every record committed")
        desc = ln.get("/v1/topics/c").json()
        on_healthy = {s["index"] for s in desc["partition_stats"] if s["owner_node"] in healthy}
        victim = c[victim_id]
        victim.kill9()
        damage(victim.data_dir / "metastore" / "raft" / "log", rnd, "flip")
        damage(victim.data_dir / "metastore" / "raft" / "log", rnd, "flip")
        outcome = _refused_or_whole(victim, names, timeout=60)
        # The cluster keeps serving metadata with the two healthy voters.
        assert ln.post("/v1/topics", {"name": "after", "partitions": 3}).status == 201
        for h in healthy:
            wait_for(lambda h=h: "after" in c[h].topic_names(), 20, what=f"{h} to see a new topic")
        # Every record on the healthy nodes' partitions is delivered, none fabricated.
        got = consume_all(c[healthy[0]], "c", quiet_s=3.0)
        seen = {m["payload"] for m in got}
        assert seen <= set(sent), "fabricated payloads"
        hwm = {s["index"]: s["high_watermark"] for s in desc["partition_stats"]}
        for p in on_healthy:
            offs = {m["offset"] for m in got if m["partition"] == p}
            assert offs >= set(range(hwm[p])), f"partition {p} on a healthy node lost records"
        if outcome == "refused":
            # What the refusal tells the operator to do: set the metastore aside; the node
            # then rebuilds it from the other two and serves its own partitions again.
            meta = victim.data_dir / "metastore"
            meta.rename(victim.data_dir / "metastore.damaged")
            victim.start(wait=False)
            victim.wait_ready(60)
            assert names <= victim.topic_names()
            got += consume_all(victim, "c", quiet_s=3.0)
            seen = {m["payload"] for m in got}
            assert seen <= set(sent), "fabricated payloads"
            assert seen == set(sent), f"{len(set(sent) - seen)} acknowledged records never came back"
        print(json.dumps({"victim": outcome, "delivered": len(seen), "healthy_partitions": sorted(on_healthy)}))
    finally:
        c.close()


# ---- snapshots -------------------------------------------------------------------------------------------

SNAP_ENV = {"NARAD_CLUSTER_RAFT_SNAPSHOT_THRESHOLD": "16", "NARAD_CLUSTER_RAFT_SNAPSHOT_INTERVAL": "1s",
            "NARAD_PIN_WORKERS": "false"}


@pytest.mark.parametrize(("seed", "where"), [(1, "header"), (2, "header"), (3, "image"), (4, "truncate")])
def test_corrupt_snapshot_single_node(tmp_path: Path, seed: int, where: str) -> None:
    """latest.snap damaged (its header, its database image, or truncated): the node
    refuses with one error line or starts holding every topic; never a half state."""
    rnd = random.Random(seed)
    n = Node(tmp_path / "data", workers=1, env=SNAP_ENV).start()
    try:
        names = {f"s{i}" for i in range(24)}
        for t in sorted(names):
            assert n.post("/v1/topics", {"name": t, "partitions": PARTS}).status == 201
        snap = n.data_dir / "metastore" / "raft" / "snapshots" / "latest.snap"
        wait_for(snap.exists, 30, what="a raft snapshot")
        for t in ("s-extra1", "s-extra2"):  # entries after the snapshot, in the log only
            assert n.post("/v1/topics", {"name": t, "partitions": PARTS}).status == 201
        names |= {"s-extra1", "s-extra2"}
        stop(n, rnd)
        data = bytearray(snap.read_bytes())
        hlen = int.from_bytes(data[8:16], "big")
        if where == "header":
            pos = rnd.randrange(8, 16 + hlen)
            data[pos] ^= 1 << rnd.randrange(8)
        elif where == "image":
            for _ in range(4):
                pos = rnd.randrange(16 + hlen, len(data))
                data[pos] ^= 1 << rnd.randrange(8)
        else:
            del data[rnd.randrange(len(data)):]
        snap.write_bytes(bytes(data))
        outcome = _refused_or_whole(n, names)
        print(f"[corruption] snapshot {where}: {outcome}")
    finally:
        n.close()
