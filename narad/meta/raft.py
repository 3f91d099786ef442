"""The Raft seam: the only module that imports pysyncobj.

Everything above sees a narrow interface: ``propose(bytes) -> ApplyResult``,
``barrier()``, ``status()``, ``transfer_leadership()``, ``add_server()`` /
``remove_server()`` and ``close()``, plus a ``StateMachine`` it drives with
``apply(index, bytes)``, ``commit()``, ``snapshot_begin()`` /
``snapshot_write(fd, txn)`` and ``restore_from(path)``. No pysyncobj type or
pickle crosses it.

What this module fixes or wraps in pysyncobj 0.3.17 (pinned in pyproject):
* Durability: the journal is narad.meta.journal.DurableJournal (fsync), synced
  before a follower acknowledges AppendEntries and at the start and end of
  every tick, so nothing is counted toward a commit before it is on disk.
* Safety: a follower truncates its log only on a term conflict (Raft 5.3);
  pysyncobj truncated on any overlapping AppendEntries, dropping entries it had
  already acknowledged.
* Commit-then-answer: entries applied in a tick are committed to LMDB once, at
  the end of the tick, and only then are waiting proposals resolved (on the
  asyncio loop), so an answered write is visible to every local reader.
* Never-raising apply: the state machine returns refusals as results; only
  FailStop escapes, which stops the node instead of wedging the tick loop.
* Deadlines: every proposal has one; pysyncobj can otherwise wait forever.
* The Raft port (pysyncobj's TCP transport; it unpickles what it receives):
  frames are length-checked before they are buffered (64 KiB until the peer
  proved the cluster secret on this connection, 16 MiB after), at most 64
  inbound connections, a connection must authenticate within 5 s and name
  itself within 30 s; refusals are logged at most once per 10 s per peer
  address and reason. A Raft port that cannot be bound stops the node.
* Snapshots are the state machine's own file copy plus a msgpack header,
  taken when ``maybe_snapshot()`` finds the log past its threshold, written by
  a thread of their own (pysyncobj's serializeChecker hook) so Raft keeps
  ticking during the copy; the newest two are kept (``latest.snap`` and
  ``previous.snap``). A copy that fails (no disk) is logged, counted through
  ``on_snapshot_failure`` and leaves the log uncompacted until the next
  attempt. A compaction interrupted by a crash is finished at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import pickle
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import pysyncobj.pickle as _pickle
import pysyncobj.syncobj as _so
import pysyncobj.tcp_connection as _tcp_connection
import pysyncobj.tcp_server as _tcp_server
import pysyncobj.transport as _transport
import pysyncobj.utility as _utility
from pysyncobj import FAIL_REASON, SERIALIZER_STATE, SyncObj, SyncObjConf, replicated
from pysyncobj.journal import MemoryJournal
from pysyncobj.tcp_connection import TcpConnection
from pysyncobj.transport import TCPTransport, TransportNotReadyError
from pysyncobj.version import VERSION as _PYSYNCOBJ_VERSION

from narad.errors import FailStop, Unavailable
from narad.meta.commands import ApplyResult
from narad.meta.journal import DurableJournal, finish_compaction

log = logging.getLogger("narad.meta.raft")

if _PYSYNCOBJ_VERSION != "0.3.17":  # pragma: no cover
    raise ImportError("narad.meta.raft patches pysyncobj 0.3.17 internals; install exactly that release")

_FOLLOWER, _CANDIDATE, _LEADER = 0, 1, 2
ROLE_NAMES = {_FOLLOWER: "follower", _CANDIDATE: "candidate", _LEADER: "leader"}
SNAP_MAGIC = b"NRDSNAP1"
# Test seam, never set in production: NARAD_FAULT_APPLY_DELAY_MS slows every entry
# the FSM does not hold yet, so tests can watch a node whose replay trails the log.
_FAULT_APPLY_DELAY = int(os.environ.get("NARAD_FAULT_APPLY_DELAY_MS", "0") or 0) / 1000
_U64 = struct.Struct(">Q")


class StateMachine(Protocol):
    applied_index: int
    newest_type: int
    applied_types: frozenset[int]

    def apply(self, index: int, data: bytes) -> ApplyResult: ...
    def commit(self) -> None: ...
    def snapshot_begin(self) -> tuple[Any, int]: ...
    def snapshot_write(self, fd: int, txn: Any) -> None: ...
    def restore_from(self, path: str, offset: int, expected_index: int) -> None: ...


class RaftUnavailable(Unavailable):
    pass


_REASONS = {
    FAIL_REASON.QUEUE_FULL: "raft command queue is full",
    FAIL_REASON.MISSING_LEADER: "no raft leader",
    FAIL_REASON.DISCARDED: "the entry was discarded by a leader change",
    FAIL_REASON.NOT_LEADER: "this node is not the raft leader",
    FAIL_REASON.LEADER_CHANGED: "the raft leader changed",
    FAIL_REASON.REQUEST_DENIED: "the raft leader refused the request",
    FAIL_REASON.UNKNOWN_OUTCOME: "the outcome of the write is unknown",
}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


_MAX_SNAP_HEADER = 64 << 20  # the header lists voters and two entries: far below this


def read_snapshot_header(path: Path | str) -> tuple[dict[str, Any], int]:
    """A snapshot file's msgpack header and the offset where the database image
    starts. Raises ValueError if the file is not a narad snapshot."""
    with open(path, "rb") as fh:
        if fh.read(len(SNAP_MAGIC)) != SNAP_MAGIC:
            raise ValueError(f"{path} is not a narad snapshot")
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is truncated")
        (n,) = _U64.unpack(raw)
        if n > _MAX_SNAP_HEADER or n > os.fstat(fh.fileno()).st_size - len(SNAP_MAGIC) - 8:
            # a damaged length must not make us allocate it
            raise ValueError(f"{path} is truncated or its header length is damaged ({n} bytes)")
        body = fh.read(n)
        if len(body) != n:
            raise ValueError(f"{path} is truncated")
        try:
            header = msgspec.msgpack.decode(body)
        except (msgspec.DecodeError, RecursionError) as e:
            raise ValueError(f"{path} has an unreadable header: {e}") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path} has an unreadable header: not a map")
        return header, fh.tell()


def raft_password(secret: bytes) -> str:
    """The pysyncobj password (Fernet key material) derived from the cluster secret."""
    return hashlib.blake2b(secret, key=b"narad-raft-v1", digest_size=32).hexdigest()


@dataclass
class RaftStatus:
    self_addr: str
    role: str
    term: int
    leader: str | None
    commit_index: int
    applied_index: int  # what the state machine holds (committed to LMDB)
    last_log_index: int
    first_log_index: int
    has_quorum: bool
    leader_commit_index: int  # highest commit index a leader announced to us
    last_leader_contact: float | None  # monotonic seconds; None if never
    persisted_commit_index: int
    peers: dict[str, bool]  # other voters -> connected
    log_len: int


# ---- the Raft port ---------------------------------------------------------------
# pysyncobj reads a 4-byte length and then buffers that many bytes (growing a
# bytes object, quadratic) before it checks anything: a header claiming 2 GiB
# from anyone who reaches the port held the tick thread for seconds. The
# guarded connection below checks the length before buffering the frame.
#
# Before a peer proved the cluster secret on a connection, only the key exchange
# and a node name or join request (well under 1 KiB) are legitimate: the
# defence is FIRST_FRAME_MAX. After, the peer is trusted (it could send any
# pickle) and FRAME_MAX bounds memory, above the largest legitimate frame:
# AppendEntries carries at most BATCH_BYTES of entries (``_SyncObj__getEntries``
# below never lets a later entry push a batch past it; a larger entry goes
# alone, cut into BATCH_BYTES pieces of its pickle), snapshot chunks are 64 KiB
# (logCompactionBatchSize), and a command a follower forwards to the leader is
# at most FORWARD_MAX (``propose``; an import entry can reach ~32 MiB and is
# proposed on the leader). pysyncobj's pickle protocol 2 writes bytes as latin-1
# text (up to 2x; measured 3.4x for a batch of 20-byte random entries), zlib adds
# ~0.1% on incompressible data and Fernet's base64 4/3: at most ~4.6 MiB for a
# batch and ~2.7 MiB for a piece or a forward, a quarter of FRAME_MAX.
# (With 4 MiB batches a 3 MiB incompressible entry never replicated: encoding
# one frame that size stalled the tick thread past the election timeout.)
FRAME_MAX = 16 << 20
FIRST_FRAME_MAX = 64 << 10
BATCH_BYTES = 1 << 20
FORWARD_MAX = 1 << 20
MAX_INBOUND = 64  # inbound connections on the Raft port (voters + read-only replicas + join requests)
HANDSHAKE_TIMEOUT = 5.0  # an inbound connection proves the cluster secret within this
IDENTIFY_TIMEOUT = 30.0  # ... and names its node (or finishes its utility request) within this
REFUSAL_LOG_EVERY = 10.0  # one log line per peer address and reason
_LEN = struct.Struct("i")  # pysyncobj's length prefix: native signed int


class _RefusalLog:
    """Refusals on the Raft port, logged at most once per REFUSAL_LOG_EVERY per
    (reason, peer address), with the count of the ones left out since."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], float] = {}
        self._quiet: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def __call__(self, reason: str, peer: str, msg: str, **extra: Any) -> None:
        key = (reason, peer)
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < REFUSAL_LOG_EVERY:
                self._quiet[key] = self._quiet.get(key, 0) + 1
                return
            if len(self._last) > 4096:
                for k in [k for k, t in self._last.items() if now - t >= REFUSAL_LOG_EVERY]:
                    self._last.pop(k, None)
                    self._quiet.pop(k, None)
            self._last[key] = now
            quiet = self._quiet.pop(key, 0)
        log.warning(msg, extra={"peer": peer, "reason": reason, "refused_since_last_line": quiet, **extra})


refusals = _RefusalLog()


def _peer_ip(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return "?"


class _GuardedConnection(TcpConnection):  # type: ignore[misc]
    """pysyncobj's TcpConnection with a bounded read path: the length prefix is
    checked as soon as it arrives, the buffer is a bytearray (linear growth)
    holding at most one frame over the limit, and nothing is decrypted, let
    alone unpickled, beyond it. Replaces TcpConnection in pysyncobj's server,
    transport and utility modules (below)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._narad_buf = bytearray()
        self._narad_authed = False
        self._narad_born = time.monotonic()
        sock = kwargs.get("socket")
        self._narad_peer = _peer_ip(sock) if sock is not None else "?"
        super().__init__(*args, **kwargs)
        self._TcpConnection__writeBuffer = bytearray()

    def connect(self, host: str, port: int) -> bool:
        self._narad_buf = bytearray()
        self._narad_authed = False
        self._narad_born = time.monotonic()
        self._narad_peer = str(host)
        ok = bool(super().connect(host, port))
        self._TcpConnection__writeBuffer = bytearray()
        return ok

    def disconnect(self) -> None:
        super().disconnect()
        self._narad_buf = bytearray()
        self._TcpConnection__writeBuffer = bytearray()

    def _TcpConnection__processSend(self) -> bool:
        """pysyncobj's, with the write buffer a bytearray consumed in place (it
        re-sliced a bytes object per send: quadratic for a large entry)."""
        wbuf = self._TcpConnection__writeBuffer
        if not wbuf:
            return False
        try:
            sent = self._TcpConnection__socket.send(wbuf)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                self.disconnect()
            return False
        if sent <= 0:
            if sent < 0:
                self.disconnect()
            return False
        del wbuf[:sent]
        return True

    def _narad_limit(self) -> int:
        return FRAME_MAX if self._narad_authed else FIRST_FRAME_MAX

    def _narad_header_ok(self) -> bool:
        buf = self._narad_buf
        if len(buf) < 4:
            return True
        (n,) = _LEN.unpack_from(buf, 0)
        limit = self._narad_limit()
        if 0 <= n <= limit:
            return True
        refusals("frame_too_large", self._narad_peer,
                 "raft port: dropped a connection announcing a frame over the limit",
                 frame_bytes=n, limit_bytes=limit, authenticated=self._narad_authed)
        self.disconnect()
        return False

    def _TcpConnection__tryReadBuffer(self) -> None:
        while self._narad_read():
            pass
        self._TcpConnection__lastReadTime = _tcp_connection.monotonicTime()

    def _narad_read(self) -> bool:
        buf = self._narad_buf
        if len(buf) > self._narad_limit() + 4:
            return False  # a whole frame is in: parse it first, read the rest on the next poll
        sock = self._TcpConnection__socket
        try:
            incoming = sock.recv(self._TcpConnection__recvBufferSize)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                self.disconnect()
            return False
        if not incoming or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.disconnect()
            return False
        buf += incoming
        return self._narad_header_ok()

    def _TcpConnection__processParseMessage(self) -> Any:
        buf = self._narad_buf
        if len(buf) < 4 or not self._narad_header_ok():
            return None
        (n,) = _LEN.unpack_from(buf, 0)
        if len(buf) - 4 < n:
            return None
        data = bytes(buf[4:4 + n])
        del buf[:4 + n]
        try:
            if self.encryptor:
                stamp = self.encryptor.extract_timestamp(data)
                if stamp < self.recvLastTimestamp:
                    raise ValueError("frame older than the previous one")
                self.recvLastTimestamp = stamp
                data = self.encryptor.decrypt(data)
            message = _pickle.loads(zlib.decompress(data))
            if self.recvRandKey:
                rand_key, message = message
                if rand_key != self.recvRandKey:
                    raise ValueError("frame of another session")
                self._narad_authed = True  # decrypted, and bound to this connection's key exchange
            elif not self.encryptor:
                self._narad_authed = True
        except Exception:
            refusals("unauthenticated", self._narad_peer,
                     "raft port: dropped a connection whose frame does not decrypt with the cluster secret "
                     "(another cluster, a wrong NARAD_CLUSTER_SECRET, or not a narad node)")
            self.disconnect()
            return None
        return message


class _GuardedTransport(TCPTransport):  # type: ignore[misc]
    """TCPTransport with a cap on inbound connections, deadlines for the
    handshake, and a bind failure that is reported instead of retried forever."""

    def __init__(self, syncObj: Any, selfNode: Any, otherNodes: Any) -> None:
        self._narad_inbound: set[_GuardedConnection] = set()
        self._narad_next_sweep = 0.0
        self.narad_bind_error: OSError | None = None
        super().__init__(syncObj, selfNode, otherNodes)

    def _maybeBind(self) -> None:
        if self._ready or self._selfIsReadonlyNode:
            return
        if self.narad_bind_error is not None:
            raise TransportNotReadyError
        try:
            self._server.bind()
        except OSError as e:
            self.narad_bind_error = e
            with contextlib.suppress(Exception):
                self._server.unbind()
            self._bindOverEvent.set()
            raise TransportNotReadyError from e
        with contextlib.suppress(OSError):  # pysyncobj listens with a backlog of 5
            self._server._TcpServer__socket.listen(128)
        self._ready = True
        self._bindOverEvent.set()

    def _onNewIncomingConnection(self, conn: _GuardedConnection) -> None:
        if len(self._narad_inbound) >= MAX_INBOUND:
            # Connections that have not proved the secret never keep a peer out: at the cap
            # the oldest unauthenticated one makes room (anyone can open sockets; a voter
            # reconnecting proves itself in its first frame). Only a port full of
            # authenticated connections refuses the newcomer.
            waiting = [c for c in self._narad_inbound if not c._narad_authed]
            if waiting:
                oldest = min(waiting, key=lambda c: c._narad_born)
                refusals("connection_limit", oldest._narad_peer,
                         "raft port: closed the oldest unauthenticated connection to make room (too many open)",
                         limit=MAX_INBOUND)
                self._narad_inbound.discard(oldest)
                oldest.disconnect()
            else:
                refusals("connection_limit", conn._narad_peer,
                         "raft port: refused an inbound connection (too many open)", limit=MAX_INBOUND)
                conn.disconnect()
                return
        self._narad_inbound.add(conn)
        super()._onNewIncomingConnection(conn)

    def _onDisconnected(self, conn: Any) -> None:
        self._narad_inbound.discard(conn)
        super()._onDisconnected(conn)

    def _onTick(self) -> None:
        super()._onTick()
        now = time.monotonic()
        if now >= self._narad_next_sweep:
            self._narad_next_sweep = now + 0.25
            self._narad_sweep(now)

    def _narad_sweep(self, now: float) -> None:
        live = set(self._connections.values())
        for conn in list(self._narad_inbound):
            age = now - conn._narad_born
            if conn in self._unknownConnections:
                if not conn._narad_authed and age > HANDSHAKE_TIMEOUT:
                    refusals("handshake_timeout", conn._narad_peer,
                             f"raft port: closed a connection that did not authenticate within "
                             f"{HANDSHAKE_TIMEOUT:g}s")
                    conn.disconnect()
                elif age > IDENTIFY_TIMEOUT:
                    refusals("identify_timeout", conn._narad_peer,
                             f"raft port: closed a connection that named no node within {IDENTIFY_TIMEOUT:g}s")
                    conn.disconnect()
            elif conn not in live:
                conn.disconnect()  # superseded by a newer connection from the same node
            if conn.state == _tcp_connection.CONNECTION_STATE.DISCONNECTED:
                self._narad_inbound.discard(conn)


# Every TcpConnection pysyncobj makes (accepted, dialled, utility) is guarded.
_tcp_server.TcpConnection = _GuardedConnection
_transport.TcpConnection = _GuardedConnection
_utility.TcpConnection = _GuardedConnection


class _QuietBindFailure(logging.Filter):
    """pysyncobj logs a traceback when the tick thread cannot bind; RaftNode.start
    logs one line naming the port instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, TransportNotReadyError)


logging.getLogger("pysyncobj.syncobj").addFilter(_QuietBindFailure())


class RaftBindError(RuntimeError):
    pass


def _create_journal(journal_file: Any = None) -> Any:
    if journal_file is None:
        return MemoryJournal()
    return DurableJournal(journal_file)


# SyncObj calls the module-level name ``createJournal``: hand it ours.
_so.createJournal = _create_journal


class _NaradSyncObj(SyncObj):
    """SyncObj with narad's fixes. Private pysyncobj attributes are reached
    through their mangled names; this is the reason for the exact pin."""

    def __init__(self, seam: RaftNode, self_addr: str | None, peers: list[str], conf: SyncObjConf) -> None:
        self._narad = seam
        super().__init__(self_addr, peers, conf=conf, transportClass=_GuardedTransport)
        # JoinCluster arrives on the Raft port as a pysyncobj utility message
        # (authenticated by the Raft password), before the joiner runs Raft.
        self._SyncObj__transport.setOnUtilityMessageCallback("narad_join", self._narad_join)

    def _narad_join(self, args: list[Any], callback: Any) -> None:
        """Tick thread: answer a joiner (see RaftNode.join_policy)."""
        try:
            req = msgspec.msgpack.decode(args[0]) if args and isinstance(args[0], bytes) else {}
        except msgspec.DecodeError:
            callback(msgspec.msgpack.encode({"status": 400, "error": "undecodable join request"}), None)
            return
        self._narad._handle_join(req, callback)

    def _SyncObj__getEntries(self, fromIDx: int | None, count: int | None = None,
                             maxSizeBytes: int | None = None) -> Any:
        """pysyncobj's, except that with a size bound a batch never grows past it
        (pysyncobj added the entry that crossed it, of any size): a batch is at
        most ``maxSizeBytes`` of entries, or one entry sent alone (in pieces if
        larger). Keeps every AppendEntries frame under FRAME_MAX."""
        entries = SyncObj._SyncObj__getEntries(self, fromIDx, count, None)
        if maxSizeBytes is None:
            return entries
        total = 0
        for i, entry in enumerate(entries):
            total += len(entry[0])
            if total > maxSizeBytes:
                return entries[:max(i, 1)]
        return entries

    @replicated
    def _narad_apply(self, data: bytes) -> ApplyResult:
        index = self.raftLastApplied + 1
        return self._narad._apply(index, data)

    def _onTick(self, timeToWait: float = 0.0) -> None:
        # Entries appended during the previous poll (e.g. the no-op of a new
        # term) must be on disk before this tick counts them toward a commit.
        self._SyncObj__raftLog.sync()
        super()._onTick(timeToWait)

    def _SyncObj__onMessageReceived(self, node: Any, message: dict[str, Any]) -> None:
        mtype = message.get("type")
        if mtype == "append_entries" and message["term"] >= self._SyncObj__raftCurrentTerm:
            self._narad.on_leader_contact(message["commit_index"])
            if "prevLogIdx" in message:
                self._narad_append_entries(node, message)
                return
        SyncObj._SyncObj__onMessageReceived(self, node, message)

    def _narad_append_entries(self, node: Any, message: dict[str, Any]) -> None:
        """pysyncobj's AppendEntries handling with Raft's conflict rule (5.3):
        delete existing entries only from the first one whose term differs."""
        term = message["term"]
        if term > self._SyncObj__raftCurrentTerm:
            self._SyncObj__transferInProgress = False
        if not self._SyncObj__transferInProgress:
            self._SyncObj__raftElectionDeadline = _so.monotonicTime() + self._SyncObj__generateRaftTimeout()
        if self._SyncObj__raftLeader != node:
            self._SyncObj__onLeaderChanged()
        self._SyncObj__raftLeader = node
        if term > self._SyncObj__raftCurrentTerm:
            self._SyncObj__setCurrentTerm(term, None)
        self._SyncObj__setState(_FOLLOWER)
        new_entries = message.get("entries", [])
        leader_commit = message["commit_index"]
        self._SyncObj__leaderCommitIndex = leader_commit

        transmission = message.get("transmission")
        if transmission is not None:
            if transmission == "start":
                self._SyncObj__recvTransmission = message["data"]
                self._SyncObj__sendNextNodeIdx(node, success=False, reset=False)
                return
            if transmission == "process":
                self._SyncObj__recvTransmission += message["data"]
                self._SyncObj__sendNextNodeIdx(node, success=False, reset=False)
                return
            if transmission == "finish":
                self._SyncObj__recvTransmission += message["data"]
                try:
                    new_entries = [pickle.loads(self._SyncObj__recvTransmission)]
                except Exception:
                    # pysyncobj labels a piece "finish" once the piece end passes the
                    # entry's length, not its pickle's (longer): more pieces follow.
                    # (stdlib pickle: pysyncobj's retries a failure in pure Python, slowly.)
                    self._SyncObj__sendNextNodeIdx(node, success=False, reset=False)
                    return
                self._SyncObj__recvTransmission = ""
            else:
                log.error("raft: unknown transmission type %r", transmission)
                return

        prev_idx = message["prevLogIdx"]
        prev_term = message["prevLogTerm"]
        prev_entries = self._SyncObj__getEntries(prev_idx)
        if not prev_entries:
            self._SyncObj__sendNextNodeIdx(node, success=False, reset=True)
            return
        if prev_entries[0][2] != prev_term:
            self._SyncObj__sendNextNodeIdx(node, nextNodeIdx=prev_idx, success=False, reset=True)
            return
        existing = prev_entries[1:]
        i = 0
        while (
            i < len(new_entries)
            and i < len(existing)
            and existing[i][1] == new_entries[i][1]
            and existing[i][2] == new_entries[i][2]
        ):
            i += 1
        log_obj = self._SyncObj__raftLog
        conf = self._SyncObj__conf
        if i < len(new_entries):
            if i < len(existing):
                conflict_idx = new_entries[i][1]
                if conf.dynamicMembershipChange:
                    for entry in reversed(existing[i:]):
                        req = self._SyncObj__parseChangeClusterRequest(entry[0])
                        if req is not None:
                            self._SyncObj__doChangeCluster(req, reverse=True)
                if conflict_idx <= self.raftLastApplied:
                    log.critical("raft: a conflicting entry replaces an applied one",
                                 extra={"index": conflict_idx, "applied": self.raftLastApplied})
                self._SyncObj__deleteEntriesFrom(conflict_idx)
            for entry in new_entries[i:]:
                log_obj.add(*entry)
            if conf.dynamicMembershipChange:
                for entry in new_entries[i:]:
                    req = self._SyncObj__parseChangeClusterRequest(entry[0])
                    if req is not None:
                        self._SyncObj__doChangeCluster(req)
        last_new = new_entries[-1][1] if new_entries else prev_idx
        # Raft: persist before answering.
        log_obj.sync()
        self._SyncObj__sendNextNodeIdx(node, nextNodeIdx=last_new + 1, success=True)
        commit = self._SyncObj__raftCommitIndex
        last_log = self._SyncObj__getCurrentLogIndex()
        if commit > last_log:
            commit = last_log
        if leader_commit > commit:
            commit = max(commit, min(leader_commit, last_new))
        self._SyncObj__raftCommitIndex = commit
        log_obj.setRaftCommitIndex(commit)


class RaftNode:
    def __init__(
        self,
        *,
        self_addr: str,
        peers: list[str],
        raft_dir: Path,
        sm: StateMachine,
        loop: asyncio.AbstractEventLoop,
        password: str | None,
        bind_host: str,
        election_timeout: tuple[float, float] = (0.3, 0.7),
        snapshot_threshold: int = 8192,
        on_state_change: Callable[[str], None] | None = None,
        on_fail_stop: Callable[[FailStop], None] | None = None,
        on_commit: Callable[[], None] | None = None,
        on_snapshot_failure: Callable[[], None] | None = None,
    ) -> None:
        self.self_addr = self_addr
        self.peers = [p for p in peers if p != self_addr]
        self.raft_dir = Path(raft_dir)
        self.raft_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.raft_dir / "snapshots").mkdir(exist_ok=True, mode=0o700)
        self.sm = sm
        self.loop = loop
        self.password = password
        self.bind_host = bind_host
        self.election_timeout = election_timeout
        self.snapshot_threshold = snapshot_threshold
        self.on_state_change = on_state_change
        self.on_fail_stop = on_fail_stop
        self.on_commit = on_commit
        self.on_snapshot_failure = on_snapshot_failure
        self.snapshots_taken = 0
        self._snap_state: str | None = None  # None | running | ok | failed (read by _snapshot_state)
        self._snap_thread: threading.Thread | None = None
        self.readonly = False
        # Leader side of JoinCluster: (request dict) -> (status, extra) or None to add the joiner.
        self.join_policy: Callable[[dict[str, Any]], tuple[int, dict[str, Any]] | None] | None = None
        self.max_voters = 5
        self._known_config: tuple[str, ...] = ()
        self._obj: _NaradSyncObj | None = None
        self._completions: list[tuple[asyncio.Future[ApplyResult], ApplyResult]] = []
        self._transfer_to: tuple[str | None] | None = None  # a hand-over asked for, made on the tick thread
        self._last_contact: float | None = None
        self._leader_commit_seen = 0
        self._applied_through = 0
        self._fail: FailStop | None = None
        self._closed = False
        self._close_lock = threading.Lock()  # a second close() waits for the first to finish
        self._lock = threading.Lock()
        self._role = "follower"
        self.leader_since: float | None = None  # monotonic time this node became leader

    @property
    def snapshot_file(self) -> Path:
        return self.raft_dir / "snapshots" / "latest.snap"

    @property
    def previous_snapshot_file(self) -> Path:
        return self.raft_dir / "snapshots" / "previous.snap"

    def start(self, peers: list[str] | None = None, *, readonly: bool = False) -> None:
        """Start Raft with these other voters (default: the constructor's). A
        read-only node replicates and applies but never votes or leads."""
        if peers is not None:
            self.peers = [p for p in peers if p != self.self_addr]
        self.readonly = readonly
        lo, hi = self.election_timeout
        ae_period = min(0.05, lo / 4)
        conf = SyncObjConf(
            journalFile=str(self.raft_dir),
            fullDumpFile=str(self.snapshot_file),
            serializer=self._serialize,
            deserializer=self._deserialize,
            serializeChecker=self._snapshot_state,
            bindAddress=f"{self.bind_host}:{self.self_addr.rsplit(':', 1)[1]}",
            password=self.password,
            autoTick=True,
            autoTickPeriod=0.05,
            appendEntriesUseBatch=False,
            appendEntriesPeriod=ae_period,
            appendEntriesBatchSizeBytes=BATCH_BYTES,
            raftMinTimeout=lo,
            raftMaxTimeout=hi,
            leaderFallbackTimeout=max(3 * hi, 1.0),
            connectionTimeout=max(hi, 1.0),
            connectionRetryTime=0.25,
            commandsWaitLeader=False,
            dynamicMembershipChange=True,
            logCompactionMinEntries=1 << 62,  # compaction is forced by maybe_snapshot()
            logCompactionMinTime=1 << 40,
            onStateChanged=self._on_state_changed,
        )
        if readonly:
            conf.bindAddress = None
        self._finish_interrupted_compaction()
        obj = _NaradSyncObj(self, None if readonly else self.self_addr, self.peers, conf)
        err = obj._SyncObj__transport.narad_bind_error
        if err is not None:
            # The tick thread has exited; pysyncobj would otherwise retry the bind
            # silently forever. The supervisor stops (exit 1) through the fail-stop path.
            with contextlib.suppress(Exception):
                obj._doDestroy()
            why = (f"cannot bind the Raft port {conf.bindAddress}: {err.strerror or err} "
                   "(another process holds it?); stopping")
            log.error(f"raft: {why}")
            self._raise_fail_stop(FailStop(why, index=0, entry_type=0))
            return
        self._obj = obj
        self.save_cluster_file()
        self._obj.addOnTickCallback(self._on_tick_end)

    def _finish_interrupted_compaction(self) -> None:
        """Before pysyncobj loads the snapshot: cut log entries that precede it
        (see journal.finish_compaction), or pysyncobj would drop the entries after it."""
        if not self.snapshot_file.exists():
            return
        try:
            header, _ = read_snapshot_header(self.snapshot_file)
            cmd, idx, term = header["before"]
            finish_compaction(self.raft_dir, (bytes(cmd), int(idx), int(term)))
        except (ValueError, KeyError, TypeError, OSError) as e:
            log.error("raft log: could not check the log against the latest snapshot", extra={"err": str(e)})

    # ---- called on the tick thread -------------------------------------------
    def _apply(self, index: int, data: bytes) -> ApplyResult:
        if _FAULT_APPLY_DELAY and index > self.sm.applied_index:
            time.sleep(_FAULT_APPLY_DELAY)  # test seam: a slow replay (see _FAULT_APPLY_DELAY)
        try:
            return self.sm.apply(index, data)
        except FailStop as e:
            self._raise_fail_stop(e)
            raise

    def _raise_fail_stop(self, e: FailStop) -> None:
        with self._lock:
            first = self._fail is None
            self._fail = e
        if first and self.on_fail_stop is not None:
            self.loop.call_soon_threadsafe(self.on_fail_stop, e)

    def _on_tick_end(self) -> None:
        obj = self._obj
        if obj is None or self._fail is not None:
            return
        journal = obj._SyncObj__raftLog
        journal.sync()
        try:
            self.sm.commit()
        except FailStop as e:
            self._raise_fail_stop(e)
            return
        # Everything Raft applied up to here is in the database now, including
        # entries pysyncobj applies itself (election no-ops, membership changes)
        # that never reach the FSM and so never move its index.
        self._applied_through = obj._SyncObj__raftLastApplied
        if self._completions:
            done, self._completions = self._completions, []
            self.loop.call_soon_threadsafe(_resolve_all, done)
        if self.on_commit is not None:
            self.on_commit()
        if len(obj.otherNodes) + (0 if self.readonly else 1) != len(self._known_config):
            try:
                self.save_cluster_file()
            except OSError as e:
                log.error("could not store the Raft configuration", extra={"err": str(e)})
        if journal.appended:
            journal.appended = False
            # New entries: run the next tick now instead of after the poll
            # timeout (a single voter commits them on its next tick).
            notifier = getattr(obj, "_SyncObj__pipeNotifier", None)
            if notifier is not None:
                notifier.notify()
        if self._transfer_to is not None:
            self._transfer_now(obj)

    # ---- membership (tick thread for the handlers) -----------------------------------
    @property
    def cluster_file(self) -> Path:
        return self.raft_dir / "cluster.json"

    def voters(self) -> list[str]:
        """Every Raft voter (this node included unless it is read-only)."""
        obj = self._obj
        if obj is None:
            return sorted(self.peers + ([] if self.readonly else [self.self_addr]))
        others = [str(n.id) for n in obj.otherNodes]
        return sorted(others + ([] if self.readonly else [self.self_addr]))

    def servers(self) -> list[str]:
        """Every Raft server: the voters and the non-voting (read-only) nodes."""
        obj = self._obj
        extra = [] if obj is None else [str(n.id) for n in getattr(obj, "_SyncObj__readonlyNodes", ())]
        return sorted(set(self.voters()) | set(extra))

    def save_cluster_file(self) -> None:
        """Remember the voter set and our role: a restart rejoins with it."""
        cfg = tuple(self.voters())
        if cfg == self._known_config:
            return
        self._known_config = cfg
        data = msgspec.json.encode({"voters": list(cfg), "readonly": self.readonly, "self": self.self_addr})
        tmp = self.cluster_file.with_suffix(".tmp")
        tmp.write_bytes(data)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.cluster_file)

    def load_cluster_file(self) -> dict[str, Any] | None:
        try:
            return msgspec.json.decode(self.cluster_file.read_bytes())  # type: ignore[no-any-return]
        except (FileNotFoundError, msgspec.DecodeError):
            return None

    def _handle_join(self, req: dict[str, Any], callback: Any) -> None:
        obj = self._obj

        def answer(status: int, **extra: Any) -> None:
            callback(msgspec.msgpack.encode({"status": status, **extra}), None)

        if obj is None:
            answer(503, error="raft is not running")
            return
        if not obj._isLeader():
            leader = obj._getLeader()
            answer(421, leader=None if leader is None else str(leader.id), error="not the leader")
            return
        addr = str(req.get("raft_addr", ""))
        if self.join_policy is not None:
            verdict = self.join_policy(req)
            if verdict is not None:
                status, extra = verdict
                answer(status, **extra)
                return
        voters = self.voters()
        if addr in voters:
            answer(200, voters=voters, voter=True)
            return
        if req.get("probe"):
            # A member that lost its leader asks whether it is still a server: never add it here.
            answer(409, code="not_a_server", error=f"{addr} is not a Raft server of this cluster")
            return
        if req.get("readonly") or len(voters) >= self.max_voters or not addr:
            answer(200, voters=voters, voter=False)
            return

        def added(res: Any, err: int) -> None:
            if err == FAIL_REASON.SUCCESS:
                answer(200, voters=sorted({*voters, addr}), voter=True)
            else:
                answer(503, error=f"adding the voter failed: {_REASONS.get(err, err)} (retry)")

        obj.addNodeToCluster(addr, callback=added)

    def request_join(self, peer: str, req: dict[str, Any], timeout: float = 2.0) -> dict[str, Any]:
        """Joiner side (blocking; run in a thread): ask the node at `peer` (a
        Raft address) to admit us. Returns the decoded answer."""
        from pysyncobj.utility import TcpUtility, UtilityException

        util = TcpUtility(self.password, timeout=timeout)
        try:
            res = util.executeCommand(peer, ["narad_join", msgspec.msgpack.encode(req)])
        except UtilityException as e:
            return {"status": 0, "error": f"cannot reach {peer}: {e}"}
        if not isinstance(res, bytes):
            return {"status": 0, "error": f"unexpected answer from {peer}: {res!r:.100}"}
        return msgspec.msgpack.decode(res)  # type: ignore[no-any-return]

    def remove_server(self, addr: str, done: Callable[[bool, str], None]) -> None:
        obj = self._obj
        if obj is None:
            done(False, "raft is not running")
            return

        def cb(res: Any, err: int) -> None:
            self.loop.call_soon_threadsafe(done, err == FAIL_REASON.SUCCESS, _REASONS.get(err, str(err)))

        obj.removeNodeFromCluster(addr, callback=cb)

    def _on_state_changed(self, old: int, new: int) -> None:
        self._role = ROLE_NAMES.get(new, "follower")
        self.leader_since = time.monotonic() if self._role == "leader" else None
        if self.on_state_change is not None:
            self.loop.call_soon_threadsafe(self.on_state_change, self._role)

    def on_leader_contact(self, leader_commit: int) -> None:
        self._last_contact = time.monotonic()
        if leader_commit > self._leader_commit_seen:
            self._leader_commit_seen = leader_commit

    # ---- snapshots (tick thread) ---------------------------------------------
    def _serialize(self, file_name: str, data: tuple[Any, Any, Any]) -> None:
        """Raft's tick thread: start a snapshot. The FSM's batch is committed and a
        read transaction pinned at ``last`` here (milliseconds); the copy is
        written by its own thread while Raft goes on ticking (heartbeats, applies),
        and ``_snapshot_state`` (pysyncobj's serializeChecker) reports when it is
        done. It writes ``latest.snap.part`` and renames it over ``latest.snap``
        itself: pysyncobj's own rename of ``file_name`` right after this returns
        finds no file and does nothing."""
        last, before, cluster = data
        with contextlib.suppress(FileNotFoundError):
            os.unlink(file_name)
        if self.sm.applied_index != last[1]:
            # The FSM holds more than the log handed it since start (replay is
            # still skipping): an image labelled `last` would run past its label.
            log.info("metastore: raft snapshot postponed until the replay reaches the database",
                     extra={"fsm_index": self.sm.applied_index, "raft_applied": last[1]})
            self._snap_state = "failed"
            return
        header = msgspec.msgpack.encode(
            {
                "last": [bytes(last[0]), last[1], last[2]],
                "before": [bytes(before[0]), before[1], before[2]],
                "cluster": sorted(str(n.id if hasattr(n, "id") else n) for n in cluster),
                "fsm_index": self.sm.applied_index,
                "newest_type": self.sm.newest_type,
                "entry_types": sorted(self.sm.applied_types),
            }
        )
        try:
            txn, _ = self.sm.snapshot_begin()
        except FailStop as e:  # committing the batch found a disk that refuses writes for good
            self._snap_state = "failed"
            self._raise_fail_stop(e)
            return
        except Exception as e:
            self._snapshot_failed(e, last[1])
            self._snap_state = "failed"
            return
        self._snap_state = "running"
        self._snap_thread = threading.Thread(target=self._write_snapshot, args=(header, txn, last[1]),
                                             name="narad-snapshot", daemon=True)
        self._snap_thread.start()

    def _write_snapshot(self, header: bytes, txn: Any, index: int) -> None:
        part = self.snapshot_file.with_name(self.snapshot_file.name + ".part")
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _write_all(fd, SNAP_MAGIC + _U64.pack(len(header)) + header)
                self.sm.snapshot_write(fd, txn)
                os.fsync(fd)
            finally:
                os.close(fd)
            # Keep two: the snapshot about to be replaced becomes previous.snap.
            if self.snapshot_file.exists():
                link = self.previous_snapshot_file.with_suffix(".tmp")
                link.unlink(missing_ok=True)
                os.link(self.snapshot_file, link)
                os.replace(link, self.previous_snapshot_file)
            os.replace(part, self.snapshot_file)
            _fsync_dir(self.snapshot_file.parent)
        except Exception as e:
            with contextlib.suppress(OSError):
                os.unlink(part)
            self._snapshot_failed(e, index)
            self._snap_state = "failed"
            return
        self.snapshots_taken += 1
        log.info("metastore: raft snapshot taken", extra={"index": index})
        self._snap_state = "ok"

    def _snapshot_failed(self, e: BaseException, index: int) -> None:
        log.error("metastore: could not copy the database for a raft snapshot; retrying at the next interval",
                  extra={"err": str(e), "index": index, "log_entries": self._log_len()})
        if self.on_snapshot_failure is not None:
            self.on_snapshot_failure()

    def _snapshot_state(self) -> int:
        """pysyncobj's serializeChecker (tick thread)."""
        state = self._snap_state
        if state == "running":
            return SERIALIZER_STATE.SERIALIZING
        if state in ("ok", "failed"):
            self._snap_state = None
            self._snap_thread = None
            return SERIALIZER_STATE.SUCCESS if state == "ok" else SERIALIZER_STATE.FAILED
        return SERIALIZER_STATE.NOT_SERIALIZING

    def _log_len(self) -> int:
        obj = self._obj
        return len(obj._SyncObj__raftLog) if obj is not None else 0

    def _deserialize(self, file_name: str) -> tuple[Any, Any, Any]:
        header, offset = read_snapshot_header(file_name)
        snap_index = int(header["fsm_index"])
        if self.sm.applied_index < snap_index:
            log.info("metastore: restoring snapshot", extra={"snapshot_index": snap_index,
                                                             "fsm_index": self.sm.applied_index})
            try:
                self.sm.restore_from(file_name, offset, snap_index)
            except FailStop as e:
                # pysyncobj swallows loader errors: stop the node here instead.
                self._raise_fail_stop(e)
                raise
        last = tuple(header["last"])
        before = tuple(header["before"])
        # pysyncobj compares this list with its own Node object, never equal to a
        # string: leave this node out, or it would count itself as another voter.
        return last, before, [c for c in header["cluster"] if c != self.self_addr]

    # ---- the seam's API (asyncio loop thread) --------------------------------
    async def propose(self, data: bytes, timeout: float) -> ApplyResult:
        """Propose an entry and wait until this node's state machine applied and
        committed it. Raises RaftUnavailable on no leader / timeout / step-down:
        the entry may still commit later, so callers retry with the same
        request id (the state machine answers the first result again)."""
        if self._fail is not None:
            raise RaftUnavailable("metastore stopped applying raft entries")
        if self._obj is None or self._closed:
            raise RaftUnavailable("raft is not running")
        if len(data) > FORWARD_MAX and not self._obj._isLeader():
            # pysyncobj would forward it to the leader in one Raft-port frame,
            # past what the port accepts (FRAME_MAX): it is proposed on the leader.
            raise RaftUnavailable("this node is not the raft leader (a large entry is proposed on the leader)")
        fut: asyncio.Future[ApplyResult] = self.loop.create_future()
        loop = self.loop

        def cb(res: Any, err: int) -> None:  # tick thread
            if err == FAIL_REASON.SUCCESS:
                self._completions.append((fut, res))
            else:
                loop.call_soon_threadsafe(_fail_fut, fut, RaftUnavailable(_REASONS.get(err, f"raft error {err}")))

        self._obj._narad_apply(data, callback=cb)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise RaftUnavailable(f"metadata write timed out after {timeout:g}s (no quorum?)") from None

    def is_leader(self) -> bool:
        return self._obj is not None and self._obj._isLeader()

    def leader(self) -> str | None:
        if self._obj is None:
            return None
        node = self._obj._getLeader()
        return None if node is None else str(node.id)

    def status(self) -> RaftStatus:
        obj = self._obj
        if obj is None:
            return RaftStatus(self.self_addr, "stopped", 0, None, 0, self.sm.applied_index, 0, 0, False,
                              0, None, 0, {}, 0)
        st = obj.getStatus()
        journal: DurableJournal = obj._SyncObj__raftLog
        peers = {str(n.id): obj.isNodeConnected(n) for n in obj.otherNodes}
        leader = st.get("leader")
        return RaftStatus(
            self_addr=self.self_addr,
            role=ROLE_NAMES.get(st["state"], "follower"),
            term=st["raft_term"],
            leader=None if leader is None else str(getattr(leader, "id", leader)),
            commit_index=st["commit_idx"],
            applied_index=max(self.sm.applied_index, self._applied_through),
            last_log_index=journal.last_index(),
            first_log_index=journal.first_index(),
            has_quorum=st["has_quorum"],
            leader_commit_index=max(self._leader_commit_seen, st.get("leader_commit_idx") or 0),
            last_leader_contact=self._last_contact,
            persisted_commit_index=journal.persisted_commit_index(),
            peers=peers,
            log_len=st["log_len"],
        )

    def caught_up(self, freshness: float = 5.0) -> bool:
        """AppliedCaughtUp: a leader is known, heard from within `freshness`
        seconds (or this node leads), and everything committed is applied."""
        st = self.status()
        if st.leader is None:
            return False
        if st.role != "leader":
            if st.last_leader_contact is None or time.monotonic() - st.last_leader_contact > freshness:
                return False
            return st.applied_index >= max(st.commit_index, st.leader_commit_index)
        return st.applied_index >= st.commit_index

    def maybe_snapshot(self) -> bool:
        """Force a log compaction if the log holds at least the threshold."""
        obj = self._obj
        if obj is None or len(obj._SyncObj__raftLog) < self.snapshot_threshold:
            return False
        obj.forceLogCompaction()
        return True

    def force_snapshot(self) -> None:
        if self._obj is not None:
            self._obj.forceLogCompaction()

    def threads_alive(self) -> list[str]:
        """Raft's threads still running (the tick thread, a snapshot writer): while one is,
        the FSM environment and the shared segments it touches must stay open."""
        out = []
        obj = self._obj
        thread = getattr(obj, "_SyncObj__thread", None) if obj is not None else None
        for t in (thread, self._snap_thread):
            if t is not None and t.is_alive() and t is not threading.current_thread():
                out.append(t.name)
        return out

    def transfer_leadership(self, target: str | None = None) -> None:
        """Ask for a hand-over of leadership (Raft TimeoutNow to `target`, or to the most
        caught-up follower), made on the tick thread at its next tick: pysyncobj's
        transport is not thread-safe, and a send from this thread raced the tick
        thread's own write to the same connection (``BufferError: Existing exports of
        data`` at a graceful shutdown: the supervisor exited 1)."""
        obj = self._obj
        if obj is not None and obj._isLeader():
            self._transfer_to = (target,)
            notifier = getattr(obj, "_SyncObj__pipeNotifier", None)
            if notifier is not None:
                notifier.notify()

    def _transfer_now(self, obj: Any) -> None:
        """Tick thread: the hand-over ``transfer_leadership`` asked for, if still leader."""
        req, self._transfer_to = self._transfer_to, None
        if req is None or not obj._isLeader():
            return
        try:
            obj.transferLeadership(req[0])
        except Exception as e:  # best effort: the stop goes on, an election follows
            log.warning("raft: leadership transfer failed", extra={"err": repr(e)})

    def close(self) -> None:
        """Stop Raft: the tick thread closes the transport and the journal, then exits; a
        snapshot being written finishes first. A second call (the fail-stop path closes
        from a thread, the shutdown again) returns once the first has finished."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._close()

    def _close(self) -> None:
        obj = self._obj
        if obj is not None:
            obj.destroy()
            thread = getattr(obj, "_SyncObj__thread", None)
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=5)
        snap = self._snap_thread
        if snap is not None and snap is not threading.current_thread():
            snap.join(timeout=60)  # a snapshot being written finishes (or fails) first
        alive = self.threads_alive()
        if alive:
            log.warning("raft: threads still running after close; the metastore files and "
                        "shared memory stay open until the process exits", extra={"threads": alive})
        err = RaftUnavailable("raft stopped")
        for fut, _ in self._completions:
            self.loop.call_soon_threadsafe(_fail_fut, fut, err)
        self._completions = []


def _resolve_all(done: list[tuple[asyncio.Future[ApplyResult], ApplyResult]]) -> None:
    for fut, res in done:
        if not fut.done():
            fut.set_result(res)


def _fail_fut(fut: asyncio.Future[Any], err: Exception) -> None:
    if not fut.done():
        fut.set_exception(err)
