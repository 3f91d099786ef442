"""Raft entry types across releases, on real 3-node clusters: an older member
(simulated with cluster.newest_entry_type = 13) holds the compare-and-set types
back until it upgrades; a node that meets an entry type it cannot apply stops
(log line, non-zero exit, the entry not applied) and applies it on the restart
with the cluster's release."""

from __future__ import annotations

from pathlib import Path

from narad.meta import commands as C
from narad.meta import restart as RS
from tests.harness import Cluster, wait_for

NEWEST = int(C.NEWEST_ENTRY_TYPE)
ALL_NEW = {"n1": NEWEST, "n2": NEWEST, "n3": NEWEST}

CAP = "NARAD_CLUSTER_NEWEST_ENTRY_TYPE"


def reported(c: Cluster, at: str) -> dict[str, int]:
    rows = c[at].get("/v1/cluster/members").json()["members"]
    return {m["id"]: m["newest_entry_type"] for m in rows}


def test_an_older_member_holds_new_entry_types_back_until_it_upgrades(tmp_path: Path) -> None:
    c = Cluster(tmp_path, 3)
    c["n3"].extra_env[CAP] = "13"
    try:
        c.start()
        leader = c.leader()
        wait_for(lambda: reported(c, leader) == {"n1": NEWEST, "n2": NEWEST, "n3": 13}, 20, 0.1, "member reports")
        assert c[leader].post("/v1/topics", {"name": "made-old", "partitions": 3}).status == 201
        wait_for(lambda: all(c[n].get("/v1/topics/made-old").status == 200 for n in c.ids), 10)
        log = c[leader].log()
        held = [ln for ln in log.splitlines() if "not using a new raft entry type yet" in ln]
        assert held and "n3" in held[0] and "entry=create_topic_checked" in held[0], held
        assert "every member applies raft entry type 23" not in log
        assert c["n3"].proc is not None and c["n3"].proc.poll() is None  # nothing it cannot apply
        assert RS.inspect_fsm(c["n3"].data_dir / "metastore" / "fsm").newest_type <= 22
        # n3 upgrades: its heartbeat reports the newest type, and the leader starts using it.
        assert c["n3"].stop() == 0
        del c["n3"].extra_env[CAP]
        c["n3"].start()
        leader = c.leader()
        wait_for(lambda: reported(c, leader) == ALL_NEW, 20, 0.1, "n3 reports the newest type")
        assert c[leader].post("/v1/topics", {"name": "made-new", "partitions": 3}).status == 201
        assert "every member applies raft entry type 23; using create_topic_checked" in c[leader].log()
        wait_for(lambda: all(c[n].get("/v1/topics/made-new").status == 200 for n in c.ids), 10)
    finally:
        c.close()


def test_a_node_that_cannot_apply_an_entry_stops_and_replays_it_on_restart(tmp_path: Path) -> None:
    c = Cluster(tmp_path, 3)
    try:
        c.start()
        wait_for(lambda: reported(c, c.leader()) == ALL_NEW, 20, 0.1, "member reports")
        assert c["n3"].stop() == 0
        leader = c.leader(["n1", "n2"])
        # n3's record says it applies type 23, so the leader proposes the checked create.
        assert c[leader].post("/v1/topics", {"name": "while-away", "partitions": 3}).status == 201
        # n3 comes back running an older release: it stops on the entry it cannot apply.
        c["n3"].extra_env[CAP] = "13"
        mark = len(c["n3"].log())
        c["n3"].start(wait=False)
        assert c["n3"].proc is not None
        assert c["n3"].proc.wait(60) != 0
        log = c["n3"].log()[mark:]
        stop_lines = [ln for ln in log.splitlines() if "metastore: stopped applying raft entries" in ln]
        assert len(stop_lines) == 1 and "type=23" in stop_lines[0] and "build=" in stop_lines[0], stop_lines
        assert " ERRO " in stop_lines[0]  # error level
        fsm = RS.inspect_fsm(c["n3"].data_dir / "metastore" / "fsm")
        assert fsm.newest_type <= 22 and fsm.trusted  # the entry was not applied, nothing half-written
        # The rest of the cluster carries on.
        assert c[leader].post("/v1/topics", {"name": "meanwhile"}).status == 201
        # With the cluster's release, the restart replays the entry and applies it.
        del c["n3"].extra_env[CAP]
        c["n3"].start()
        wait_for(lambda: c["n3"].get("/v1/topics/while-away").status == 200
                 and c["n3"].get("/v1/topics/meanwhile").status == 200, 20)
    finally:
        c.close()


def test_a_raft_server_without_a_member_record_holds_types_back_until_forgotten(tmp_path: Path) -> None:
    """n4 is admitted as a Raft voter and dies before it registers (a fault seam crashes it
    at that point): it holds every compare-and-set type back. `members forget` refuses the
    leader, a server with a member record and an unknown id, then removes n4."""
    c = Cluster(tmp_path, 4, initial=3)
    try:
        c.start()
        leader = c.leader()
        c["n4"].extra_env["NARAD_FAULT_CRASH_AFTER_ADMIT"] = "1"
        c["n4"].start(wait=False)
        assert c["n4"].proc is not None and c["n4"].proc.wait(30) != 0
        n4_addr = f"127.0.0.1:{c.ports['n4'][1]}"
        wait_for(lambda: n4_addr in c[leader].status()["raft"]["voters"], 10, 0.05, "n4 admitted as a voter")
        assert c[leader].post("/v1/topics", {"name": "held", "partitions": 3}).status == 201
        held = [ln for ln in c[leader].log().splitlines() if "not using a new raft entry type yet" in ln]
        assert held and f"Raft server {n4_addr} has no member record yet" in held[-1], held
        # Refusals: the leader itself, a server with a member record, no such server.
        leader_addr = f"127.0.0.1:{c.ports[leader][1]}"
        assert c[leader].post(f"/v1/cluster/members/{leader_addr}/forget").status == 400
        other = next(n for n in c.initial if n != leader)
        r = c[other].post(f"/v1/cluster/members/{other}/forget")
        assert r.status == 409 and "member record" in r.json()["error"], r
        assert c[leader].post("/v1/cluster/members/127.0.0.1:1/forget").status == 404
        # naradctl on a follower (forwarded to the leader); 409 while the leader is new.
        def forget() -> bool:
            out = c[other].ctl("members", "forget", n4_addr, check=False)
            return isinstance(out, dict) and out.get("voter") is True and out.get("id") == n4_addr
        wait_for(forget, 30, 0.5, "n4 forgotten")
        wait_for(lambda: n4_addr not in c[leader].status()["raft"]["voters"], 10, 0.05, "n4 removed")
        assert c[leader].post("/v1/topics", {"name": "unheld", "partitions": 3}).status == 201
        # Logged by the leader that proposed it (on a loaded machine leadership may have moved).
        wait_for(lambda: any("every member applies raft entry type 23" in c[n].log() for n in c.initial), 10, 0.05,
                 "raft entry type 23 in use")
        assert c[leader].post(f"/v1/cluster/members/{n4_addr}/forget").status == 404
    finally:
        c.close()
