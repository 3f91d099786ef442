"""The chaos matrix under recorded data traffic, each row ending with the delivery-
contract checker's verdict (tests/contract.py): steady no-fault runs on one node and
on three (strict: no duplicate the leases do not explain, no double lease, nothing
lost, drained), then the rows of the cluster-lifecycle matrix that lacked data traffic
(faults mode: duplicates counted and printed, allowed only inside the declared fault
windows + grace; no loss, no violation): quorum loss three times, a kill -9 during a
rolling restart, SIGSTOP of the Raft leader, and a bounded network partition of the
leader (iptables rules in a network namespace the test creates, on that node's
sockets only)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.contract import History, Traffic, Verdict, broker_empty, check, stop_all
from tests.harness import Cluster, Node, wait_for

VIS = 2.0


def mk_topic(c: Cluster, name: str, partitions: int = 6) -> None:
    leader = c.leader()
    assert c[leader].post("/v1/topics", {"name": name, "partitions": partitions,
                                         "visibility_timeout_ms": int(VIS * 1000)}).status == 201
    for n in c.initial:
        wait_for(lambda n=n: c[n].get(f"/v1/topics/{name}").status == 200, 30)


def verdict(name: str, h: History, tr: Traffic, probe: Node, topic: str, partitions: int, mode: str) -> Verdict:
    empty = tr.drain(broker_empty(probe, topic, partitions), timeout=150)
    v = check(h, mode, broker_empty=empty)
    print("\n" + v.summary(name) + f"\n{name}: client-side errors {tr.errors}")
    if not empty or not v.ok:
        for mid in sorted(h.unacked())[:5]:
            print(f"{mid}:\n  " + "\n  ".join(h.trail(mid)))
        try:
            r = probe.get(f"/v1/topics/{topic}")
            print(f"{topic} partition_stats: {r.json().get('partition_stats') if r.status == 200 else r.status}")
        except OSError as e:
            print(f"{topic}: stats unavailable ({e})")
    assert empty, f"{name}: some partition still holds an unacked message (or its owner is unavailable)"
    assert v.ok, v.summary(name)
    return v


# ---- steady, no faults: strict ------------------------------------------------------

def test_steady_single_node_strict(tmp_path: Path) -> None:
    n = Node(tmp_path / "data", workers=2).start()
    try:
        assert n.post("/v1/topics", {"name": "steady", "partitions": 4,
                                     "visibility_timeout_ms": int(VIS * 1000)}).status == 201
        h = History(VIS)
        tr = Traffic(h, "steady", lambda: [n], producers=2, consumers=3, pace_s=0.003, extend_every=11,
                     nack_every=13, abandon_every=29, max_n=10).start()
        tr.wait_more(600, what="steady traffic")
        v = verdict("steady, one node", h, tr, n, "steady", 4, "strict")
        assert v.counts["explained_redeliveries"] > 0 and v.counts["extends"] > 0 and v.counts["nacks"] > 0
    finally:
        stop_all()
        n.close()


def test_steady_three_nodes_strict(tmp_path: Path) -> None:
    c = Cluster(tmp_path, 3).start()
    try:
        mk_topic(c, "steady3")
        h = History(VIS)
        # every 13th delivery nacked with a 300 ms delay: the delayed_early rule judges each
        # one's redelivery, at whichever node serves it (the owner keeps the delay)
        tr = Traffic(h, "steady3", lambda: [c[x] for x in c.initial], producers=3, consumers=3, pace_s=0.003,
                     extend_every=11, nack_every=13, abandon_every=29, max_n=10, rotate_every=40,
                     nack_delay_s=0.3).start()
        tr.wait_more(600, what="steady traffic on three nodes")
        v = verdict("steady, three nodes", h, tr, c["n1"], "steady3", 6, "strict")
        assert v.counts["explained_redeliveries"] > 0
        assert v.counts["delayed_nacks"] >= 20 and v.counts["delayed_back"] >= 20, v.counts
    finally:
        stop_all()
        c.close()


# ---- chaos rows: faults mode ----------------------------------------------------------

class Live:
    """The members a traffic thread may pick now."""

    def __init__(self, c: Cluster) -> None:
        self.c, self.down = c, set[str]()

    def __call__(self) -> list[Node]:
        up = [self.c[n] for n in self.c.initial if n not in self.down]
        return up or [self.c[self.c.initial[0]]]


@pytest.mark.slow
def test_quorum_loss_three_times_under_traffic(tmp_path: Path) -> None:
    c = Cluster(tmp_path, 3).start()
    try:
        mk_topic(c, "quorum")
        h = History(VIS)
        live = Live(c)
        tr = Traffic(h, "quorum", live, producers=3, consumers=3, rotate_every=40).start()
        tr.wait_more(150, what="before the faults")
        ids = c.initial
        for rnd in range(3):
            survivor = ids[rnd]
            victims = [n for n in ids if n != survivor]
            with h.fault(f"kill -9 {victims} (quorum lost), round {rnd + 1}"):
                live.down |= set(victims)
                for nid in victims:
                    c[nid].kill9()
                tr.wait_more(60, what=f"produce on the survivor {survivor} without quorum")
                for nid in victims:
                    c[nid].start(wait=False)
                for nid in victims:
                    c[nid].wait_ready(60)
                live.down -= set(victims)
            tr.wait_more(150, what=f"traffic after round {rnd + 1}")
        verdict("quorum loss x3", h, tr, c[ids[0]], "quorum", 6, "faults")
    finally:
        stop_all()
        c.close()


@pytest.mark.slow
def test_kill9_during_a_rolling_restart_under_traffic(tmp_path: Path) -> None:
    c = Cluster(tmp_path, 3).start()
    try:
        mk_topic(c, "rolling")
        h = History(VIS)
        live = Live(c)
        # delayed nacks through the restarts and the kill: a delay is kept in the owner's memory
        # (a restart forgets it: the record comes back at once, allowed in a fault window only)
        tr = Traffic(h, "rolling", live, producers=3, consumers=3, rotate_every=40, nack_every=17,
                     nack_delay_s=0.25).start()
        tr.wait_more(150, what="before the rolling restart")
        leader = c.leader()
        first, second = [n for n in c.initial if n != leader]
        with h.fault(f"rolling restart of {first}"):
            live.down.add(first)
            assert c[first].stop() == 0
            c[first].start()
            live.down.discard(first)
        tr.wait_more(100, what=f"after {first} restarted")
        with h.fault(f"rolling restart of {second} with kill -9 of {leader} meanwhile"):
            live.down |= {second, leader}
            assert c[second].stop() == 0  # graceful, as a rolling restart does
            c[leader].kill9()  # the next member to roll dies hard while the previous one is down
            c[second].start(wait=False)
            c[leader].start(wait=False)
            c[second].wait_ready(60)
            c[leader].wait_ready(60)
            live.down -= {second, leader}
        tr.wait_more(100, what="after the kill and the restarts")
        leader2 = c.leader()
        with h.fault(f"rolling restart of the leader {leader2}"):
            live.down.add(leader2)
            assert c[leader2].stop() == 0
            c[leader2].start()
            live.down.discard(leader2)
        tr.wait_more(100, what="after the rolling restart")
        v = verdict("kill -9 during a rolling restart", h, tr, c[first], "rolling", 6, "faults")
        assert v.counts["delayed_nacks"] >= 10 and v.counts["delayed_back"] >= 10, v.counts
    finally:
        stop_all()
        c.close()


@pytest.mark.slow
def test_sigstop_of_the_raft_leader_under_traffic(tmp_path: Path) -> None:
    c = Cluster(tmp_path, 3).start()
    try:
        mk_topic(c, "frozen")
        h = History(VIS)
        live = Live(c)
        tr = Traffic(h, "frozen", live, producers=3, consumers=3, rotate_every=40).start()
        tr.wait_more(150, what="before the freeze")
        old = c.leader()
        others = [n for n in c.initial if n != old]
        assert c[old].proc is not None
        pgid = os.getpgid(c[old].proc.pid)
        with h.fault(f"SIGSTOP of the leader {old}"):
            live.down.add(old)
            os.killpg(pgid, signal.SIGSTOP)
            try:
                new = c.leader(others)
                tr.wait_more(100, what="with the old leader frozen")
            finally:
                os.killpg(pgid, signal.SIGCONT)
            live.down.discard(old)
            wait_for(lambda: c[old].status()["raft"]["role"] == "follower", 30, 0.1, "the thawed leader follows")
        assert new != old
        tr.wait_more(150, what="after the thaw")
        verdict("SIGSTOP of the leader", h, tr, c[others[0]], "frozen", 6, "faults")
    finally:
        stop_all()
        c.close()


# ---- network partition: iptables in a private network namespace ----------------------

CLONE_NEWNET = 0x40000000
CGROUP2 = Path("/sys/fs/cgroup/unified") if Path("/sys/fs/cgroup/unified/cgroup.procs").exists() \
    else Path("/sys/fs/cgroup")


@contextlib.contextmanager
def private_netns() -> Iterator[None]:
    """Move this thread (and every thread and process it starts) into a new network
    namespace with only a loopback; back to the original one afterwards. The nodes,
    the clients and the iptables rules all live in it, so nothing outside is touched."""
    libc = ctypes.CDLL(None, use_errno=True)
    orig = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        if libc.unshare(CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
        try:
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
            yield
        finally:
            if libc.setns(orig, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the original network namespace")
    finally:
        os.close(orig)


def ipt(*args: str) -> None:
    subprocess.run(["iptables", "-w", *args], check=True, capture_output=True)


class Partitioner:
    """Every node runs in its own cgroup (v2) so iptables can tell its packets apart:
    ``cut(nid)`` drops everything the node sends and receives on its node-to-node
    sockets (Raft, cluster RPC: listening ports and the connections it opened), leaving
    its HTTP port reachable by clients; ``heal()`` removes the rules."""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.tag = f"narad-part-{uuid.uuid4().hex[:8]}"
        self.groups = {nid: CGROUP2 / f"{self.tag}-{nid}" for nid in c.ids}
        self.marks = {nid: str(0x4E00 + i + 1) for i, nid in enumerate(c.ids)}
        for nid, g in self.groups.items():
            g.mkdir()
            node = c[nid]
            base = node.command

            def command(base=base, g=g) -> list[str]:  # the node starts inside its cgroup
                return ["sh", "-c", f'echo $$ > "{g}/cgroup.procs" && exec "$@"', "sh", *base()]

            node.command = command  # type: ignore[method-assign]
        for nid, g in self.groups.items():
            ipt("-A", "OUTPUT", "-m", "cgroup", "--path", g.name, "-j", "CONNMARK", "--set-mark", self.marks[nid])
        ipt("-N", "PART_IN")
        ipt("-N", "PART_OUT")
        ipt("-A", "INPUT", "-j", "PART_IN")
        ipt("-A", "OUTPUT", "-j", "PART_OUT")  # after the marks: a dropped packet still marks its flow

    def cut(self, nid: str) -> None:
        http, raft, cluster = self.c.ports[nid]
        for proto in ("tcp", "udp"):
            for d in ("--dport", "--sport"):
                ipt("-A", "PART_IN", "-p", proto, d, str(http), "-j", "ACCEPT")
            ipt("-A", "PART_OUT", "-p", proto, "--sport", str(http), "-j", "ACCEPT")
        ipt("-A", "PART_IN", "-m", "connmark", "--mark", self.marks[nid], "-j", "DROP")
        ipt("-A", "PART_IN", "-p", "tcp", "--dport", str(raft), "-j", "DROP")
        for proto in ("tcp", "udp"):
            ipt("-A", "PART_IN", "-p", proto, "--dport", str(cluster), "-j", "DROP")
        ipt("-A", "PART_OUT", "-m", "cgroup", "--path", self.groups[nid].name, "-j", "DROP")

    def heal(self) -> None:
        ipt("-F", "PART_IN")
        ipt("-F", "PART_OUT")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.heal()
        for g in self.groups.values():
            with contextlib.suppress(OSError):
                g.rmdir()


def partition_supported() -> str:
    if os.geteuid() != 0:
        return "needs root (iptables, cgroups, network namespaces)"
    if shutil.which("iptables") is None:
        return "needs the iptables package (apt-get install -y iptables)"
    if not (CGROUP2 / "cgroup.procs").exists():
        return "needs a writable cgroup v2 hierarchy"
    return ""


@pytest.mark.slow
def test_network_partition_of_the_leader_bounded_in_time(tmp_path: Path) -> None:
    why = partition_supported()
    if why:
        pytest.skip(why)
    with private_netns():
        c = Cluster(tmp_path, 3)
        part = Partitioner(c)
        try:
            c.start()
            mk_topic(c, "cut")
            h = History(VIS)
            live = Live(c)
            tr = Traffic(h, "cut", live, producers=3, consumers=3, rotate_every=40).start()
            tr.wait_more(150, what="before the partition")
            old = c.leader()
            others = [n for n in c.initial if n != old]
            with h.fault(f"network partition of the leader {old}"):
                part.cut(old)
                try:
                    # The majority side elects a leader of its own; clients keep using every
                    # node (the cut one answers produce from its WAL and its own partitions).
                    wait_for(lambda: any(c[n].status()["raft"]["role"] == "leader" for n in others), 30, 0.1,
                             "a leader on the majority side")
                    tr.wait_more(150, 45, what="during the partition")
                    # ...and the node RPC plane is cut too: the majority cannot reach the
                    # isolated node's partitions.
                    def unreachable() -> bool:
                        stats = c[others[0]].get("/v1/topics/cut").json()["partition_stats"]
                        return any(s["owner_node"] == old and s.get("status") == "owner_unavailable" for s in stats)

                    wait_for(unreachable, 30, 0.1, "the isolated node's partitions unreachable from the majority")
                finally:
                    part.heal()
                # The cluster is whole again: every node names one leader, and exactly one
                # node is it. Usually the isolated node follows; it may also win the election
                # its higher term forces (pysyncobj has no pre-vote), so either is fine.
                def whole() -> bool:
                    sts = [c[n].status()["raft"] for n in c.initial]
                    leaders = {st["leader"] for st in sts}
                    return (len(leaders) == 1 and None not in leaders
                            and sum(st["role"] == "leader" for st in sts) == 1)

                wait_for(whole, 30, 0.1, "one leader named by every node after the heal")
            tr.wait_more(150, what="after the heal")
            verdict("network partition of the leader", h, tr, c[others[0]], "cut", 6, "faults")
        finally:
            stop_all()
            c.close()
            part.close()


def test_a_pinned_consume_at_an_owner_that_does_not_answer_is_502(tmp_path: Path) -> None:
    c = Cluster(tmp_path, 2).start()
    try:
        mk_topic(c, "pinned", 4)
        stats = c["n1"].get("/v1/topics/pinned").json()["partition_stats"]
        remote = next(s["index"] for s in stats if s["owner_node"] == "n2")
        assert c["n1"].get(f"/v1/topics/pinned/consume?partition={remote}&wait=0s").status == 204
        assert c["n2"].proc is not None
        pgid = os.getpgid(c["n2"].proc.pid)
        os.killpg(pgid, signal.SIGSTOP)  # alive by membership (dead only after 30 s), answers nothing
        try:
            r = c["n1"].get(f"/v1/topics/pinned/consume?partition={remote}&wait=0s")
        finally:
            os.killpg(pgid, signal.SIGCONT)
        assert r.status == 502, r
    finally:
        stop_all()
        c.close()
