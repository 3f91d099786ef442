"""The node's ports: a port another process holds stops the start (error line,
non-zero exit) instead of being shared through SO_REUSEPORT; the Raft port
(pysyncobj, which unpickles what it receives) checks frame lengths before it
buffers anything, caps inbound connections and times out connections that never
authenticate, logging refusals; legitimate traffic, large entries included,
still replicates under those limits.

Real nodes as subprocesses, real pysyncobj groups on 127.0.0.1, raw TCP clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from narad.meta import commands as C
from narad.meta import raft as RAFT
from narad.meta.fsm import FSM
from narad.meta.raft import RaftNode, raft_password
from tests.harness import Node, free_ports, wait_for


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("raftport") / "data", workers=1).start()
    yield n
    n.close()


def _closed(s: socket.socket) -> bool:
    """True once the server closed this connection (FIN or RST)."""
    try:
        return s.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _create_topic(n: Node, name: str) -> int:
    return n.post("/v1/topics", {"name": name}).status


# ---- a port another process holds ------------------------------------------------
@pytest.mark.parametrize("which", ["client", "Raft", "cluster"])
def test_a_second_node_on_a_port_in_use_is_refused_and_the_first_keeps_its_clients(
        node: Node, tmp_path: Path, which: str) -> None:
    spare = free_ports(3)
    ports = {"client": [node.port, spare[1], spare[2]], "Raft": [spare[0], node.raft_port, spare[2]],
             "cluster": [spare[0], spare[1], node.cluster_port]}[which]
    other = Node(tmp_path / "other", workers=1, node_id="n2", ports=ports)
    other.start(wait=False)
    try:
        assert other.proc is not None
        code = other.proc.wait(30)
    finally:
        other.close()  # a node that did not refuse must not outlive the test
    held = {"client": node.port, "Raft": node.raft_port, "cluster": node.cluster_port}[which]
    assert code != 0, other.log()
    lines = [ln for ln in other.log().splitlines() if f"{which} port 127.0.0.1:{held}" in ln and "in use" in ln]
    assert lines, other.log()
    # The first node still gets every new client connection.
    for _ in range(20):
        r = node.get("/healthz", auth=None)
        assert r.status == 200 and r.headers["x-narad-node"] == "n1"
    assert _create_topic(node, f"after-clash-{which.lower()}") == 201


def test_a_process_holding_the_raft_port_stops_the_start(tmp_path: Path) -> None:
    ports = free_ports(3)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports[1]))
        holder.listen(1)
        n = Node(tmp_path / "data", workers=1, ports=ports)
        n.start(wait=False)
        try:
            assert n.proc is not None
            assert n.proc.wait(30) != 0
        finally:
            n.close()
    assert f"Raft port 127.0.0.1:{ports[1]} (TCP) is in use" in n.log(), n.log()


def test_the_raft_seam_stops_the_node_when_its_port_cannot_be_bound(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The late path (the port taken between the start probe and Raft, or a join-only
    node admitted later): pysyncobj retried the bind silently forever."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        (port,) = free_ports(1)
        stopped: list[Exception] = []
        fsm = FSM(tmp_path / "fsm")
        raft = RaftNode(self_addr=f"127.0.0.1:{port}", peers=[], raft_dir=tmp_path / "raft", sm=fsm, loop=loop,
                        password=raft_password(os.urandom(32)), bind_host="127.0.0.1",
                        on_fail_stop=stopped.append)
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", port))
            holder.listen(1)
            with caplog.at_level(logging.ERROR, logger="narad.meta.raft"):
                raft.start([])
            end = time.monotonic() + 5
            while not stopped:
                assert time.monotonic() < end, "the seam did not report the bind failure"
                await asyncio.sleep(0.01)
        assert f"cannot bind the Raft port 127.0.0.1:{port}" in str(stopped[0])
        assert any(f"127.0.0.1:{port}" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
        assert raft.status().role == "stopped"
        raft.close()
        fsm.close()

    asyncio.run(main())


# ---- the Raft port before authentication ------------------------------------------
@pytest.mark.parametrize("claimed", [(2 << 30) - 1, 1 << 20, -5])
def test_a_huge_frame_header_is_dropped_before_buffering_and_writes_go_on(node: Node, claimed: int) -> None:
    stop = threading.Event()
    sent = [0]
    attacker = socket.create_connection(("127.0.0.1", node.raft_port), timeout=10)

    def flood() -> None:
        chunk = b"\0" * 65536
        try:
            attacker.sendall(struct.pack("i", claimed))
            while not stop.is_set() and sent[0] < (64 << 20):
                attacker.sendall(chunk)
                sent[0] += len(chunk)
        except OSError:
            pass

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        # A metadata write while the frame is being sent.
        assert _create_topic(node, f"during-flood-{claimed & 0xffff}") == 201
        wait_for(lambda: _closed(attacker), 10, 0.02, "the node to drop the connection")
        assert sent[0] < (64 << 20), "the node read the whole flood before dropping it"
    finally:
        stop.set()
        attacker.close()
        t.join(10)
    wait_for(lambda: "dropped a connection announcing a frame over the limit" in node.log(), 10, 0.05,
             "the refusal in the log")
    assert node.get("/readyz", auth=None).status == 200


def test_inbound_connections_are_capped_and_unauthenticated_ones_time_out(node: Node) -> None:
    socks: list[socket.socket] = []
    try:
        for _ in range(200):
            socks.append(socket.create_connection(("127.0.0.1", node.raft_port), timeout=10))
        over = 200 - RAFT.MAX_INBOUND
        wait_for(lambda: sum(_closed(s) for s in socks) >= over, 20, 0.05,
                 f"at least {over} connections refused at accept")
        assert "closed the oldest unauthenticated connection to make room (too many open)" in node.log()
        # The node still serves, metadata writes included, while the rest sit idle.
        assert _create_topic(node, "while-idle-conns") == 201
        assert node.get("/readyz", auth=None).status == 200
        # Connections that never authenticate are closed after the handshake deadline.
        wait_for(lambda: all(_closed(s) for s in socks), RAFT.HANDSHAKE_TIMEOUT + 15, 0.1,
                 "the idle connections to be closed")
        assert "did not authenticate within" in node.log()
        # One line per reason and peer address per 10 s, not one per connection.
        assert node.log().count("to make room (too many open)") <= 3
    finally:
        for s in socks:
            s.close()


def test_idle_unauthenticated_connections_never_keep_a_peer_out(tmp_path: Path) -> None:
    """A host without the secret holding the port full of idle sockets (reopening each
    one closed) must not refuse a peer that proves the secret: at the cap the oldest
    unauthenticated connection makes room."""
    from pysyncobj.utility import TcpUtility, UtilityException

    secret = "s" * 40
    n = Node(tmp_path / "data", workers=1, env={"NARAD_CLUSTER_SECRET": secret}).start()
    util = TcpUtility(raft_password(secret.encode()), timeout=3)
    addr = f"127.0.0.1:{n.raft_port}"

    def status() -> str:
        try:
            return "ok" if util.executeCommand(addr, ["status"]) else "empty"
        except UtilityException as e:
            return f"refused: {e}"

    stop = threading.Event()
    held: list[socket.socket] = []

    def attacker() -> None:
        while not stop.is_set():
            for s in list(held):
                try:
                    if s.recv(1, socket.MSG_DONTWAIT) == b"":
                        s.close()
                        held.remove(s)
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    held.remove(s)
            while len(held) < RAFT.MAX_INBOUND + 6:
                try:
                    held.append(socket.create_connection(("127.0.0.1", n.raft_port), timeout=1))
                except OSError:
                    break
            stop.wait(0.05)

    t = threading.Thread(target=attacker, daemon=True)
    try:
        assert status() == "ok"
        t.start()
        wait_for(lambda: "to make room (too many open)" in n.log(), 20, 0.05, "the port to fill up")
        got = [status() for _ in range(10)]
        assert got == ["ok"] * 10, got
    finally:
        stop.set()
        t.join(10)
        for s in held:
            s.close()
        n.close()


# ---- legitimate traffic under the limits -------------------------------------------
@pytest.mark.serial  # two Raft nodes on one GIL encrypting 3 MiB entries, against a 60 s deadline: run alone
def test_large_entries_and_long_batches_replicate_under_the_frame_cap(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A follower that lags receives batches of small entries and entries bigger than
    a batch (sent in pieces); none trips the Raft port's limits."""
    secret = raft_password(os.urandom(32))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ports = free_ports(2)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        fsms = [FSM(tmp_path / f"fsm{i}") for i in range(2)]
        nodes = [RaftNode(self_addr=addrs[i], peers=addrs, raft_dir=tmp_path / f"raft{i}", sm=fsms[i], loop=loop,
                          password=secret, bind_host="127.0.0.1") for i in range(2)]
        try:
            nodes[0].start()
            nodes[1].start()
            end = time.monotonic() + 20
            while not any(n.is_leader() for n in nodes):
                assert time.monotonic() < end, "no leader"
                await asyncio.sleep(0.02)
            deadline = time.monotonic() + 60

            async def propose(data: bytes) -> None:
                # Both nodes share this process's GIL and two cores with the test run:
                # a proposal lost to a leader change is proposed again on the new one.
                while True:
                    leader = next((n for n in nodes if n.is_leader()), None)
                    try:
                        if leader is not None:
                            await leader.propose(data, 30)
                            return
                    except RAFT.RaftUnavailable:
                        pass
                    assert time.monotonic() < deadline, "entries not committed"
                    await asyncio.sleep(0.05)

            # Incompressible bodies: the worst case for pickle + zlib + Fernet. 0xc1 is never
            # valid msgpack, so the state machine refuses each one the same way everywhere.
            big = [bytes([C.EntryType.NOOP, 0xC1]) + os.urandom(n) for n in (3 << 20, RAFT.BATCH_BYTES - 100)]
            small = [C.encode(C.Noop(), request_id=f"r{i}", stamp_ms=1) for i in range(1000)]
            await asyncio.gather(*[propose(b) for b in big], *[propose(s) for s in small])
            target = max(n.status().commit_index for n in nodes)
            end = time.monotonic() + 30
            while min(n.status().applied_index for n in nodes) < target:
                assert time.monotonic() < end, [n.status() for n in nodes]
                await asyncio.sleep(0.05)
        finally:
            for n in nodes:
                n.close()
            for f in fsms:
                f.close()

    with caplog.at_level(logging.WARNING, logger="narad.meta.raft"):
        asyncio.run(main())
    assert not [r for r in caplog.records if "raft port:" in r.getMessage()], caplog.text


def test_the_batch_bound_never_lets_a_later_entry_grow_a_batch(tmp_path: Path) -> None:
    """The sender side of the frame cap: pysyncobj added the entry that crossed the
    batch size whatever its size; the seam stops before it."""
    (port,) = free_ports(1)
    from pysyncobj import SyncObjConf

    conf = SyncObjConf(autoTick=False, journalFile=str(tmp_path), appendEntriesUseBatch=False,
                       dynamicMembershipChange=True)

    class _Seam:
        def _apply(self, index: int, data: bytes) -> C.ApplyResult:
            return C.ApplyResult(0, "", index)

    obj = RAFT._NaradSyncObj(_Seam(), f"127.0.0.1:{port}", [], conf)  # type: ignore[arg-type]
    try:
        log_obj = obj._SyncObj__raftLog
        first = log_obj[0][1]
        for i, size in enumerate((10, 600_000, 40 << 20, 10)):
            log_obj.add(b"x" * size, first + 1 + i, 1)
        get = obj._SyncObj__getEntries
        assert [len(e[0]) for e in get(first + 1, None, 1 << 20)] == [10, 600_000]
        assert [len(e[0]) for e in get(first + 3, None, 1 << 20)] == [40 << 20]
        assert [len(e[0]) for e in get(first + 4, None, 1 << 20)] == [10]
        assert len(get(first + 1)) == 4
    finally:
        with contextlib.suppress(Exception):
            obj._doDestroy()
