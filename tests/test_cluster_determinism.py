"""The determinism harness on a real 3-node group: the same topic names created
at the same moment through all three nodes are settled by Raft log order
(exactly one create wins each name, everywhere the same incarnation), and once
every node applied the same index the three LMDB replicas hold identical
contents in every table."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from narad.meta import fsm as F
from tests.harness import Cluster, wait_for

QUIET = {"NARAD_CLUSTER_HEARTBEAT_INTERVAL": "60s", "NARAD_CLUSTER_MEMBER_DEAD_AFTER": "180s"}


def replica_digest(fsm_path: Path) -> tuple[int, str]:
    env = F.open_env(fsm_path, readonly=True)
    try:
        dbs = F.open_dbs(env, create=False)
        h = hashlib.sha256()
        with env.begin() as txn:
            applied = F._U64.unpack(txn.get(F.K_APPLIED, db=dbs["fsm_meta"]))[0]
            for name in F.DB_NAMES:
                for k, v in txn.cursor(db=dbs[name]):
                    if name == "fsm_meta" and k == F.K_TXN:
                        continue  # the LMDB transaction id depends on each node's batching
                    h.update(name.encode() + b"\0" + bytes(k) + b"\0" + bytes(v) + b"\n")
        return applied, h.hexdigest()
    finally:
        env.close()


def test_racing_creates_settle_by_log_order_with_identical_replicas(tmp_path: Path) -> None:
    c = Cluster(tmp_path, 3, env=QUIET)
    try:
        c.start()
        c.leader()
        names = [f"race-{i}" for i in range(8)]
        results: dict[str, list[tuple[str, int, str]]] = {n: [] for n in names}
        lock = threading.Lock()
        gate = threading.Barrier(len(c.ids))

        def racer(nid: str) -> None:
            gate.wait()
            for name in names:
                r = c[nid].post("/v1/topics", {"name": name, "partitions": 3})
                with lock:
                    results[name].append((nid, r.status, r.json().get("id", "") if r.status == 201 else ""))

        threads = [threading.Thread(target=racer, args=(nid,)) for nid in c.ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for name, outcomes in results.items():
            statuses = sorted(s for _, s, _ in outcomes)
            assert statuses == [201, 409, 409], (name, outcomes)
            winner = next(tid for _, s, tid in outcomes if s == 201)
            for nid in c.ids:
                assert c[nid].get(f"/v1/topics/{name}").json()["id"] == winner
        # Every node at the same applied index: the replicas are byte-for-byte the same data.
        wait_for(lambda: len({c[n].status()["raft"]["applied_index"] for n in c.ids}) == 1, 20, 0.1,
                 "every replica at the same index")
        digests = {nid: replica_digest(c[nid].data_dir / "metastore" / "fsm") for nid in c.ids}
        assert len(set(digests.values())) == 1, digests
    finally:
        c.close()
