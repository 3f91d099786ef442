"""Partition moves with real nodes on 127.0.0.1 (issue 13): scale a loaded cluster
out and watch partitions spread (floor/ceil) while produce, consume and ack run;
kill -9 the destination mid-copy, the source while frozen and the leader just
before a flip; abort a move. Every test records a history (tests/contract.py) and
ends with the delivery-contract checker's verdict in faults mode (a move
redelivers what was unacked at its flip: that is at-least-once, within the
declared window), plus a check that every partition is where its assignment says
and holds every acknowledged message.

Test seams: NARAD_MOVE_PLAN_MS (the controller plans moves this often),
NARAD_FAULT_MOVE_CHUNK_DELAY_MS (slow copies), NARAD_FAULT_MOVE_HOLD_FROZEN_MS,
NARAD_FAULT_MOVE_HOLD_FLIP_MS (hold a move at a phase: a kill window).
"""

from __future__ import annotations

import base64
import collections
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.contract import History, Traffic, broker_empty, check, stop_all
from tests.harness import Cluster, Node, wait_for

pytestmark = pytest.mark.slow

FAST = {"NARAD_MOVE_PLAN_MS": "300", "NARAD_METRICS_POLL_MS": "1000"}
# Every topic here has a 3 s visibility timeout, the History's: a lease a killed node took for its
# consumer comes back within the checker's grace (visibility + 20 s) after the fault window.


def owners(n: Node, topic: str) -> dict[int, str]:
    r = n.get(f"/v1/topics/{topic}")
    assert r.status == 200, r
    return {int(s["index"]): s["owner_node"] for s in r.json()["partition_stats"]}


def moves(n: Node) -> list[dict[str, Any]]:
    r = n.get("/v1/cluster/moves")
    assert r.status == 200, r
    return list(r.json()["moves"])


def spread(n: Node, topic: str, nodes: list[str], parts: int) -> bool:
    """Every node of `nodes` owns floor or ceil of parts/len(nodes), and no move is in flight."""
    try:
        own = owners(n, topic)
        if moves(n):
            return False
    except (OSError, AssertionError):
        return False
    count = collections.Counter(own.values())
    lo, hi = parts // len(nodes), -(-parts // len(nodes))
    return set(count) <= set(nodes) and all(lo <= count.get(x, 0) <= hi for x in nodes)


def finish(c: Cluster, h: History, tr: Traffic, topic: str, parts: int, via: Node, name: str) -> None:
    empty = tr.drain(broker_empty(via, topic, parts), timeout=120)
    v = check(h, "faults", broker_empty=empty)
    print("\n" + v.summary(name) + f"\n{name}: client-side errors {tr.errors}")
    if not empty or not v.ok:  # what happened to the messages named, for the failure's reader
        named = set(re.findall(r"\b(p\d+-\d+|fill-\d+-\d+)\b", v.summary(name))) | set(sorted(h.unacked())[:5])
        for mid in sorted(named)[:8]:
            print(f"{mid}:\n  " + "\n  ".join(h.trail(mid)))
    assert empty, "some partition still holds an unacked message (or an owner is unavailable)"
    assert v.ok, v.summary(name)


def loaded(c: Cluster, parts: int, before: int) -> tuple[History, Traffic, list[str]]:
    """Topic "mv" (`parts` partitions, 3 s visibility) created at n1 and seen by every
    initial member, then traffic over the nodes in the returned `live` list (append a
    node to send it traffic, remove one to spare it) until `before` more messages
    were accepted."""
    assert c["n1"].post("/v1/topics", {"name": "mv", "partitions": parts,
                                       "visibility_timeout_ms": 3000}).status == 201
    for nid in c.initial:
        wait_for(lambda nid=nid: c[nid].get("/v1/topics/mv").status == 200)
    h = History(3.0)
    live = list(c.initial)
    tr = Traffic(h, "mv", lambda: [c[x] for x in live], producers=2, consumers=2, rotate_every=50).start()
    tr.wait_more(before, what="before the scale-out")
    return h, tr, live


def test_scale_three_to_five_spreads_partitions_under_traffic(tmp_path: Path) -> None:
    c = Cluster(tmp_path, 5, initial=3, env=FAST)
    try:
        c.start()
        n1 = c["n1"]
        h, tr, live = loaded(c, 10, 300)
        t0 = time.monotonic()
        with h.fault("scale 3 to 5 (moves redeliver what was unacked at each flip)"):
            c.start(["n4", "n5"])
            live.extend(["n4", "n5"])
            wait_for(lambda: spread(n1, "mv", c.ids, 10), 120, 0.2, "partitions spread over 5 nodes")
            took = time.monotonic() - t0
            tr.wait_more(200, what="after the moves")
        print(f"\nscale 3 to 5: partitions spread in {took:.1f}s; owners {sorted(owners(n1, 'mv').items())}")
        own = owners(n1, "mv")
        assert collections.Counter(own.values()) == {x: 2 for x in c.ids}
        # The metrics say so: each new node received its two moves; the sources froze four partitions.
        wait_for(lambda: all(c[x].metric('narad_moves_finished_total{outcome="done"}') >= 2 for x in ("n4", "n5")),
                 20, 0.5, "the receivers' finished-move counters (5 s metrics poll)")
        assert all(c[x].metric("narad_move_copied_bytes_total") > 0 for x in ("n4", "n5"))
        assert sum(c[x].metric("narad_move_freezes_total") for x in c.initial) >= 4
        assert all(c[x].metric("narad_moves_in_flight") == 0 for x in c.ids)
        for nid in c.ids:  # every node sees the same owners
            wait_for(lambda nid=nid: owners(c[nid], "mv") == own, 20, 0.1, f"{nid} sees the new owners")
        finish(c, h, tr, "mv", 10, n1, "scale 3 to 5")
    finally:
        stop_all()
        c.close()


def fill(n: Node, topic: str, parts: int, bytes_each: int, h: History) -> int:
    """Produce about `bytes_each` bytes into every partition (10 KiB messages, batched),
    recorded in the history. Returns the number of messages."""
    import json as _json

    from tests.contract import now

    k = 0
    per = 10 * 1024
    for p in range(parts):
        sent = 0
        while sent < bytes_each:
            ids = [f"fill-{p}-{k + i}" for i in range(50)]
            body = _json.dumps({"messages": [
                {"payload": base64.b64encode((mid + ":").encode().ljust(per, b"x")).decode(),
                 "payload_encoding": "base64", "partition": p} for mid in ids]}).encode()
            t0 = now()
            r = n.request("POST", f"/v1/topics/{topic}/produce/batch", body,
                          headers={"Content-Type": "application/json"})
            h.produced(ids, t0, now(), r.status, n.node_id)
            assert r.status == 202, r
            k += len(ids)
            sent += len(ids) * per
    return k


def move_detail(n: Node) -> list[dict[str, Any]]:
    r = n.get("/v1/cluster/moves?detail=true")
    return list(r.json()["moves"]) if r.status == 200 else []


def scale_with_fault(tmp_path: Path, seam: dict[str, str], fault: Any, name: str, *, fill_bytes: int = 0,
                     initial_env: dict[str, str] | None = None) -> None:
    """3 nodes, a loaded 6-partition topic, then n4 joins with `seam` in its
    environment; `fault(c, h)` runs once a move is under way (and declares its own
    fault window); afterwards every partition must be spread (2/2/1/1... floor/ceil)
    and every message answered 202 delivered and acked."""
    c = Cluster(tmp_path, 4, initial=3, env=FAST)
    for nid in c.initial:
        c[nid].extra_env.update(initial_env or {})
    try:
        c.start()
        n1 = c["n1"]
        assert n1.post("/v1/topics", {"name": "mv", "partitions": 6, "visibility_timeout_ms": 3000}).status == 201
        for nid in c.initial:
            wait_for(lambda nid=nid: c[nid].get("/v1/topics/mv").status == 200)
        h = History(3.0)
        if fill_bytes:
            fill(n1, "mv", 6, fill_bytes, h)
        live = list(c.initial)
        tr = Traffic(h, "mv", lambda: [c[x] for x in live], producers=2, consumers=2, rotate_every=50).start()
        tr.wait_more(200, what="before the scale-out")
        c["n4"].extra_env.update(seam)
        with h.fault(f"n4 joins; moves to it ({name})"):
            c.start(["n4"])
            live.append("n4")
            fault(c, h)
            wait_for(lambda: spread(n1, "mv", c.ids, 6), 180, 0.2, "partitions spread over 4 nodes")
            tr.wait_more(200, what="after the moves")
        own = owners(n1, "mv")
        print(f"\n{name}: owners {sorted(own.items())}")
        finish(c, h, tr, "mv", 6, n1, name)
    finally:
        stop_all()
        c.close()


def _log_has(n: Node, text: str) -> bool:
    try:
        return text in n.log()
    except OSError:
        return False


def _held_frozen(n: Node) -> set[int]:
    """Partitions `n` logged as held frozen by the test seam."""
    return {int(m) for m in re.findall(r"move held frozen \(test seam\) topic=\S+ partition=(\d+)", n.log())}


def _all_held_from_one_source(leader: Node, dest: Node) -> dict[str, Any] | None:
    """A move to `dest` held frozen whose source has no other move to `dest` that is not."""
    try:
        ms = [x for x in moves(leader) if x["to"] == dest.node_id]
    except (OSError, AssertionError):
        return None
    held = _held_frozen(dest)
    for x in ms:
        if x["partition"] in held and all(y["partition"] in held for y in ms if y["from"] == x["from"]):
            return x
    return None


def test_kill9_destination_mid_copy(tmp_path: Path) -> None:
    def fault(c: Cluster, h: History) -> None:
        n4 = c["n4"]
        wait_for(lambda: any(m.get("worker", {}) and m["worker"].get("copied_bytes", 0) > 0
                             for m in move_detail(c["n1"])), 60, 0.05, "a move copying")
        n4.kill9()
        n4.extra_env.pop("NARAD_FAULT_MOVE_CHUNK_DELAY_MS", None)
        n4.start()

    scale_with_fault(tmp_path, {"NARAD_FAULT_MOVE_CHUNK_DELAY_MS": "300"}, fault, "kill -9 destination mid-copy",
                     fill_bytes=3 << 20)


def test_kill9_source_while_frozen(tmp_path: Path) -> None:
    def fault(c: Cluster, h: History) -> None:
        n4 = c["n4"]
        wait_for(lambda: _log_has(n4, "move held frozen (test seam)"), 60, 0.05, "a move held frozen")
        frozen = [m for m in move_detail(c["n1"]) if (m.get("worker") or {}).get("phase") == "frozen"]
        src = frozen[0]["from"] if frozen else next(
            m["from"] for m in moves(c["n1"]))
        victim = c[src]
        victim.kill9()
        victim.start()

    scale_with_fault(tmp_path, {"NARAD_FAULT_MOVE_HOLD_FROZEN_MS": "3000"}, fault, "kill -9 source while frozen")


def test_kill9_leader_just_before_a_flip(tmp_path: Path) -> None:
    def fault(c: Cluster, h: History) -> None:
        n4 = c["n4"]
        wait_for(lambda: _log_has(n4, "move held before its flip (test seam)"), 60, 0.05, "a move before its flip")
        leader = c.leader(c.initial)
        c[leader].kill9()
        c[leader].start()

    scale_with_fault(tmp_path, {"NARAD_FAULT_MOVE_HOLD_FLIP_MS": "3000"}, fault, "kill -9 leader before a flip")


def test_kill9_source_just_before_a_flip(tmp_path: Path) -> None:
    """The source dies after the fence, while the destination holds its flip for 4 s, and
    restarts at once: it must open the partition still frozen (its freeze is durable),
    so nothing it takes meanwhile lands in the copy the flip leaves behind (the traffic's
    keyless records at the source would: every one answered 202 must be delivered)."""
    def fault(c: Cluster, h: History) -> None:
        n4 = c["n4"]
        wait_for(lambda: _log_has(n4, "move held before its flip (test seam)"), 60, 0.05, "a move before its flip")
        src = next(m["from"] for m in moves(n4) if m["to"] == "n4")
        victim = c[src]
        victim.kill9()
        victim.start()

    scale_with_fault(tmp_path, {"NARAD_FAULT_MOVE_HOLD_FLIP_MS": "4000"}, fault, "kill -9 source before a flip")


def test_abort_a_frozen_move_lifts_the_freeze_and_keeps_the_owner(tmp_path: Path) -> None:
    """A move held in its frozen phase is aborted: 202 with the move, the target is
    cleared at once, the runner abandons it and thaws the source; the planner may
    plan it again later (as Narad's does), and nothing is lost either way."""
    def fault(c: Cluster, h: History) -> None:
        n1, n4 = c["n1"], c["n4"]
        wait_for(lambda: _log_has(n4, "move held frozen (test seam)"), 60, 0.05, "a move held frozen")
        m = next(x for x in moves(n1) if x["to"] == "n4")
        r = n1.post(f"/v1/cluster/moves/{m['topic']}/{m['partition']}/abort?target=n4")
        assert r.status == 202, r
        body = r.json()
        assert body["move"]["topic"] == m["topic"] and body["move"]["partition"] == m["partition"], body
        assert body["move"]["from"] == m["from"] and body["move"]["to"] == "n4", body
        again = n1.post(f"/v1/cluster/moves/{m['topic']}/{m['partition']}/abort?target=n4")
        assert again.status in (409, 202), again  # 409 unless the planner already set the target again
        wait_for(lambda: _log_has(n4, "partition move abandoned"), 30, 0.05, "the runner abandons the move")
        src = c[m["from"]]
        wait_for(lambda: _log_has(src, "move freeze lifted"), 30, 0.05, "the source's freeze lifted")
        n4.extra_env.pop("NARAD_FAULT_MOVE_HOLD_FROZEN_MS", None)

    scale_with_fault(tmp_path, {"NARAD_FAULT_MOVE_HOLD_FROZEN_MS": "4000"}, fault, "abort a frozen move")


@pytest.mark.parametrize("which", ["joiner", "leader"])
def test_decommission_a_node_under_traffic_until_it_leaves(tmp_path: Path, which: str) -> None:
    """Decommission a node (the joiner n4, or the Raft leader: leadership is handed
    over first) under traffic: it sheds its partitions, leaves the Raft voters and
    the members, learns it was removed, and its id is refused after a restart."""
    c = Cluster(tmp_path, 4, initial=3, env=FAST)
    try:
        c.start()
        assert c["n1"].post("/v1/topics", {"name": "mv", "partitions": 8, "visibility_timeout_ms": 3000}).status == 201
        c.start(["n4"])
        wait_for(lambda: spread(c["n1"], "mv", c.ids, 8), 120, 0.2, "partitions spread over 4 nodes")
        vid = "n4" if which == "joiner" else c.leader()
        victim = c[vid]
        via = c[next(x for x in c.ids if x != vid)]
        h = History(3.0)
        live = list(c.ids)
        tr = Traffic(h, "mv", lambda: [c[x] for x in live], producers=2, consumers=2, rotate_every=50).start()
        tr.wait_more(200, what="before the decommission")
        dry = via.post(f"/v1/cluster/members/{vid}/decommission?dry_run=true")
        assert dry.status == 200 and dry.json()["would_decommission"] is True, dry
        with h.fault(f"decommission {vid} (its partitions move off; moves redeliver what was unacked)"):
            r = via.post(f"/v1/cluster/members/{vid}/decommission")
            assert r.status == 204, r
            live.remove(vid)
            wait_for(lambda: vid not in owners(via, "mv").values() and not moves(via), 120, 0.2,
                     f"{vid} owns nothing")
            tr.wait_more(200, what="after the drain")

            def gone() -> bool:
                ms = via.get("/v1/cluster/members").json()["members"]
                return all(m["id"] != vid for m in ms)
            wait_for(gone, 120, 0.2, f"{vid} removed from the members")
            voters = via.status()["raft"]["voters"]
            assert f"127.0.0.1:{victim.raft_port}" not in voters, voters
            assert len(voters) == 3, voters
        assert sorted(collections.Counter(owners(via, "mv").values()).values()) == [2, 3, 3]
        finish(c, h, tr, "mv", 8, via, f"decommission {vid}")
        # The removed node hears no leader any more: it asks, is told its id was removed, says
        # so and reports not ready; a restart with its old disk is refused the same way.
        said = "this node was removed from the cluster"
        wait_for(lambda: said in victim.log(), 60, 0.2, f"{vid} learns it was removed")

        def says_removed() -> bool:
            r = victim.get("/readyz")
            return r.status == 503 and "removed from the cluster" in r.json()["error"]
        wait_for(says_removed, 10, 0.1, f"{vid}'s /readyz naming the removal")
        victim.kill9()
        victim.start(wait=False)
        wait_for(lambda: victim.log().count(said) >= 2, 60, 0.2, "the restarted removed node refused")
        ms = via.get("/v1/cluster/members").json()["members"]
        assert all(m["id"] != vid for m in ms), ms
    finally:
        stop_all()
        c.close()


def test_chaos_scale_three_to_five_then_kill_leader_and_new_node_together(tmp_path: Path) -> None:
    """The lifecycle seed's chaos row: zero loss."""
    c = Cluster(tmp_path, 5, initial=3, env=FAST)
    try:
        c.start()
        n1 = c["n1"]
        h, tr, live = loaded(c, 10, 200)
        with h.fault("scale 3 to 5, then kill -9 the leader and n5 together"):
            c.start(["n4", "n5"])
            live.extend(["n4", "n5"])
            wait_for(lambda: any(m["to"] == "n5" for m in moves(n1)) or "n5" in owners(n1, "mv").values(),
                     60, 0.05, "a move to n5 under way")
            leader = c.leader(c.initial)
            for nid in (leader, "n5"):
                live.remove(nid)
            c[leader].kill9()
            c["n5"].kill9()
            tr.wait_more(100, what="with the leader and n5 down")
            c[leader].start(wait=False)
            c["n5"].start(wait=False)
            c[leader].wait_ready(60)
            c["n5"].wait_ready(60)
            live.extend([leader, "n5"])
            via = c["n2"] if leader == "n1" else n1
            wait_for(lambda: spread(via, "mv", c.ids, 10), 180, 0.2, "partitions spread over 5 nodes")
            tr.wait_more(200, what="after the restarts")
        finish(c, h, tr, "mv", 10, via, "chaos: scale 3 to 5, kill leader and new node")
    finally:
        stop_all()
        c.close()


def test_dead_source_is_force_promoted_and_its_returning_copy_reclaimed(tmp_path: Path) -> None:
    """The source dies while its partition is frozen and stays down: after the
    force-promote time (seam: 4 s) seen by the destination and the leader (the
    member marked dead), the destination flips from its copy; when the source
    returns, the stale-copy sweep finds the owner vouching for everything its copy
    holds and removes it. Nothing acknowledged is lost."""
    env = {**FAST, "NARAD_MOVE_FORCE_AFTER_MS": "4000", "NARAD_CLUSTER_HEARTBEAT_INTERVAL": "1s",
           "NARAD_CLUSTER_MEMBER_DEAD_AFTER": "3s", "NARAD_MOVE_SWEEP_MS": "2000"}
    c = Cluster(tmp_path, 4, initial=3, env=env)
    try:
        c.start()
        n1 = c["n1"]
        h, tr, live = loaded(c, 6, 200)
        n4 = c["n4"]
        # Long enough that every move n4 takes from one source is held frozen at once: the
        # source dies only when none of its moves is still pre-copying (a tail committed after
        # a pre-copy listing would be only on the dead source, its copy then quarantined).
        n4.extra_env["NARAD_FAULT_MOVE_HOLD_FROZEN_MS"] = "15000"
        with h.fault("n4 joins; the source of its move dies while frozen and stays down"):
            c.start(["n4"])
            live.append("n4")
            m = wait_for(lambda: _all_held_from_one_source(n1, n4), 60, 0.05, "every move from one source held frozen")
            src = c[m["from"]]
            live.remove(src.node_id)
            src.kill9()
            via = c["n2"] if src.node_id == "n1" else n1
            wait_for(lambda: _log_has(n4, "partition force-promoted from a copy of its dead source"), 90, 0.2,
                     "the force-promote")
            assert owners(via, "mv")[m["partition"]] == "n4"
            tr.wait_more(150, what="with the source down")
            src.start()
            live.append(src.node_id)
            wait_for(lambda: _log_has(src, "old copy of a moved partition removed"), 60, 0.2,
                     "the returning source's copy reclaimed")
            assert "quarantined" not in src.log()
            tr.wait_more(150, what="after the source returned")
        finish(c, h, tr, "mv", 6, via, "force-promote a dead source")
    finally:
        stop_all()
        c.close()


def test_kill9_leader_mid_flip_after_commit_the_destination_resolves_by_a_leader_read(tmp_path: Path) -> None:
    """The flip entry commits but the leader dies before answering: the destination
    (its call failed) keeps its install and asks the new leader, which says it owns
    the partition."""
    def fault(c: Cluster, h: History) -> None:
        def holding() -> str | None:
            return next((x for x in c.initial if c[x].proc is not None and
                         _log_has(c[x], "flip committed; answer held (test seam)")), None)
        leader = wait_for(holding, 60, 0.05, "a leader holding a flip's answer")
        c[leader].kill9()
        c[leader].extra_env.pop("NARAD_FAULT_FLIP_ANSWER_HOLD_MS", None)
        c[leader].start()
        # The destination's runner itself ends (its call failed; the new leader says it owns it).
        wait_for(lambda: _log_has(c["n4"], "partition move finished"), 60, 0.1, "the runner resolves the flip")

    c_env = {"NARAD_FAULT_FLIP_ANSWER_HOLD_MS": "30000"}
    scale_with_fault(tmp_path, {}, fault, "kill -9 leader mid-flip", initial_env=c_env)


def test_parent_and_child_partitions_move_and_every_copy_arrives(tmp_path: Path) -> None:
    """A fan-out parent and its replica child spread over a joining node while the
    parent takes traffic: the parent partitions' cursor files travel with them, the
    child partitions move too, and every message accepted by the parent reaches the
    child (at least once). The child's name sorts first, so the planner moves parent
    partitions (it moves each donor's highest rows)."""
    import http.client
    import json as _json

    from tests.contract import message_id

    c = Cluster(tmp_path, 4, initial=3, env=FAST)
    try:
        c.start()
        n1 = c["n1"]
        assert n1.post("/v1/topics", {"name": "mv", "partitions": 6, "visibility_timeout_ms": 3000}).status == 201
        r = n1.post("/v1/topics", {"name": "ma-c", "parent": "mv"})
        assert r.status == 201 and r.json()["role"] == "child", r
        for nid in c.initial:
            wait_for(lambda nid=nid: c[nid].get("/v1/topics/ma-c").status == 200)
        h = History(3.0)
        live = list(c.initial)
        tr = Traffic(h, "mv", lambda: [c[x] for x in live], producers=2, consumers=2, rotate_every=50).start()
        tr.wait_more(300, what="before the scale-out")
        with h.fault("n4 joins: parent and child partitions move"):
            c.start(["n4"])
            live.append("n4")
            def both_spread() -> bool:  # the planner balances partitions of all topics together
                try:
                    if moves(n1):
                        return False
                    count = collections.Counter([*owners(n1, "mv").values(), *owners(n1, "ma-c").values()])
                except (OSError, AssertionError):
                    return False
                return sorted(count.values()) == [3, 3, 3, 3] and set(count) == set(c.ids)
            wait_for(both_spread, 120, 0.2, "parent and child partitions spread over 4 nodes")
            tr.wait_more(300, what="after the moves")
        finish(c, h, tr, "mv", 6, n1, "parent and child move")
        accepted = {mid for p in h.snapshot()[0] if p.status == 202 for mid in p.ids}
        got: set[str] = set()
        copies = 0
        conn: http.client.HTTPConnection = n1.conn()
        end = time.monotonic() + 90
        while not accepted <= got and time.monotonic() < end:
            r = n1.request("GET", "/v1/topics/ma-c/consume?wait=1s&max=100", conn=conn,
                           headers={"X-Narad-Client": "t"})
            if r.status == 204:
                continue
            assert r.status == 200, r
            msgs = r.json()["messages"]
            got |= {message_id(m["payload"]) for m in msgs}
            copies += len(msgs)
            a = n1.request("POST", "/v1/topics/ma-c/ack", _json.dumps(
                {"receipt_handles": [m["receipt_handle"] for m in msgs]}).encode(),
                headers={"Content-Type": "application/json"}, conn=conn)
            assert a.status == 200, a
        conn.close()
        missing = accepted - got
        print(f"\nparent and child move: {len(accepted)} accepted by the parent, {len(got)} distinct in the "
              f"child, {copies} copies")
        assert not missing, f"{len(missing)} parent messages never reached the child: {sorted(missing)[:10]}"
        # The cursors travelled with the parent partitions: a cursor started again from its attach
        # point would copy every record of a moved partition twice (about half of them here).
        assert copies - len(got) < len(accepted) // 10, (copies, len(got))
    finally:
        stop_all()
        c.close()


def _hwm(n: Node, topic: str, part: int) -> int:
    r = n.get(f"/v1/topics/{topic}")
    for s in r.json()["partition_stats"]:
        if int(s["index"]) == part:
            return int(s.get("high_watermark", -1))
    return -1


def test_dead_destination_freeze_lapses_and_the_source_takes_commits_again(tmp_path: Path) -> None:
    """The destination dies while the source is frozen and stays down: the freeze
    lapses by itself (its TTL; seam: 3 s) and the source commits that partition's
    records again; when the destination returns, the move finishes."""
    def fault(c: Cluster, h: History) -> None:
        n4 = c["n4"]
        wait_for(lambda: _log_has(n4, "move held frozen (test seam)"), 60, 0.05, "a move held frozen")
        m = next(x for x in moves(c["n1"]) if x["to"] == "n4")
        src, part = c[m["from"]], int(m["partition"])
        n4.kill9()
        before = _hwm(src, "mv", part)
        for i in range(5):
            assert src.request("POST", f"/v1/topics/mv/produce?partition={part}", f"lapse-{i}:".encode(),
                               headers={"Content-Type": "application/octet-stream"}).status == 202
        h.produced([f"lapse-{i}" for i in range(5)], 0, 1, 202, src.node_id)
        wait_for(lambda: _hwm(src, "mv", part) >= before + 5, 20, 0.1, "the source commits again")
        n4.extra_env.pop("NARAD_FAULT_MOVE_HOLD_FROZEN_MS", None)
        n4.start()

    scale_with_fault(tmp_path, {"NARAD_FAULT_MOVE_HOLD_FROZEN_MS": "60000", "NARAD_MOVE_FREEZE_TTL_MS": "3000"},
                     fault, "the destination dies frozen")


def test_returning_source_ahead_of_the_promoted_copy_is_quarantined(tmp_path: Path) -> None:
    """The documented loss case, and its safety net: the source commits records after
    the destination's last listing, then dies; the destination is force-promoted from
    its copy (as far as that listing); when the source returns its copy holds more
    than the promoted one, so the sweep quarantines it (never deletes it): the records
    are still on its disk for an operator, and the node says so."""
    from narad.storage import transfer as TR

    env = {**FAST, "NARAD_MOVE_FORCE_AFTER_MS": "4000", "NARAD_CLUSTER_HEARTBEAT_INTERVAL": "1s",
           "NARAD_CLUSTER_MEMBER_DEAD_AFTER": "3s", "NARAD_MOVE_SWEEP_MS": "2000"}
    c = Cluster(tmp_path, 4, initial=3, env=env)
    try:
        c.start()
        n1 = c["n1"]
        assert n1.post("/v1/topics", {"name": "mv", "partitions": 6, "visibility_timeout_ms": 3000}).status == 201
        for nid in c.initial:
            wait_for(lambda nid=nid: c[nid].get("/v1/topics/mv").status == 200)
        for p in range(6):
            for i in range(10):
                assert n1.request("POST", f"/v1/topics/mv/produce?partition={p}", f"m{p}-{i}:".encode(),
                                  headers={"Content-Type": "application/octet-stream"}).status == 202
        n4 = c["n4"]
        n4.extra_env["NARAD_FAULT_MOVE_HOLD_PRECOPY_MS"] = "8000"
        c.start(["n4"])
        wait_for(lambda: _log_has(n4, "move held after its pre-copy (test seam)"), 60, 0.05, "a pre-copied move")
        m = next(x for x in moves(n1) if x["to"] == "n4")
        src, part = c[m["from"]], int(m["partition"])
        via = c[next(x for x in c.initial if x != src.node_id)]
        listed = _hwm(src, "mv", part)
        for i in range(7):  # committed at the source after the destination's last listing
            assert src.request("POST", f"/v1/topics/mv/produce?partition={part}", f"late-{i}:".encode(),
                               headers={"Content-Type": "application/octet-stream"}).status == 202
        wait_for(lambda: _hwm(src, "mv", part) == listed + 7, 20, 0.05, "the late records committed at the source")
        src.kill9()
        wait_for(lambda: _log_has(n4, "partition force-promoted from a copy of its dead source"), 90, 0.2,
                 "the force-promote")
        assert owners(via, "mv")[part] == "n4"
        assert _hwm(via, "mv", part) == listed, "promoted from the last listing"
        src.start()
        wait_for(lambda: _log_has(src, "old copy of a partition quarantined"), 60, 0.2, "the sweep quarantines")
        rows = TR.quarantined(src.data_dir / "topics")
        assert [(r[0], r[1], r[2]) for r in rows] == [("stale_copy", "mv", part)], rows
        hwm, _segs = TR.list_closed(rows[0][3])
        assert hwm == listed + 7, "the late records are still in the quarantined copy"
        wait_for(lambda: src.metric("narad_quarantined_copies") == 1, 20, 0.5, "the quarantine gauge")
        detail = via.get("/v1/cluster/members?detail=true").json()["members"]
        q = next(x for x in detail if x["id"] == src.node_id)["node_status"]["quarantine"]
        assert q["copies"] == 1 and q["list"][0]["partition"] == part, q
    finally:
        stop_all()
        c.close()
