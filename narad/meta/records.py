"""The records the metastore holds, as stored in LMDB (msgpack via msgspec),
and the key layout of each named database.

Pure data: no I/O. Imported by the FSM (writer), the store (readers) and the
API layer (to render records as JSON).
"""

from __future__ import annotations

import struct

import msgspec


class Grant(msgspec.Struct, frozen=True):
    action: str  # produce | consume | create | admin
    patterns: list[str] = []


class UserRecord(msgspec.Struct):
    username: str
    password_hash: bytes
    grants: list[Grant] = []
    root: bool = False
    created_at_ms: int = 0
    updated_at_ms: int = 0


DEFAULT_IDEMPOTENCY_WINDOW_MS = 300_000  # a produce's idempotency key is remembered 5 min unless set


class TopicRecord(msgspec.Struct):
    name: str
    id: str  # incarnation: 16 hex chars, new for every create
    partitions: int
    retention_ms: int
    visibility_timeout_ms: int
    max_in_flight_per_partition: int
    max_acked_ahead_per_partition: int
    created_at: int  # unix seconds, stamped at propose time
    owner: str | None = None
    schema_version: int = 0
    revision: int = 0  # bumped by every change to the record
    # Fan-out (issue 11). On a child: the parent it copies from (name and the
    # incarnation linked), the delay, the attach epoch (16 hex chars, stamped at
    # propose time, new for every attach) and the attach point: the parent's
    # committed high watermark per parent partition when the attach was proposed
    # (a parent partition past this list, added later, is copied from offset 0).
    parent: str | None = None
    parent_id: str | None = None
    delay_ms: int = 0
    attach_epoch: str | None = None
    attach_offsets: list[int] = []
    # On a parent: its children's names, sorted (deterministic).
    children: list[str] = []
    # Delivery settings (issue 14; entry type 43). max_deliveries: a record leased
    # that many times without an ack is committed to dead_letter_topic and settled
    # here (0: unlimited, Narad's behaviour). idempotency_window_ms: how long a
    # produce's idempotency key is remembered (0: the default, 5 min).
    max_deliveries: int = 0
    dead_letter_topic: str | None = None
    idempotency_window_ms: int = 0

    @property
    def idem_window_ms(self) -> int:
        """The idempotency window in effect (the default when unset)."""
        return self.idempotency_window_ms or DEFAULT_IDEMPOTENCY_WINDOW_MS

    @property
    def role(self) -> str | None:
        """Narad's ``role``: "parent", "child", or None (standalone: absent)."""
        if self.parent is not None:
            return "child"
        if self.children:
            return "parent"
        return None


class AssignmentRecord(msgspec.Struct):
    owner: str  # node id
    topic_id: str
    target: str | None = None  # move target (rebalance / decommission)


class MemberRecord(msgspec.Struct):
    id: str
    raft_addr: str
    client_addr: str = ""
    cluster_addr: str = ""
    status: str = "alive"  # alive | dead
    heartbeat_ms: int = 0  # leader clock, stamped at propose time
    registered_ms: int = 0
    build: str = ""
    newest_entry_type: int = 0
    draining: bool = False
    entry_types: list[int] = []  # every Raft entry type it applies (empty: up to newest_entry_type)
    # Records in its ingress WALs not yet confirmed at their owner, as its last heartbeat
    # reported them (-1: unknown). The decommission driver waits for 0.
    dispatch_backlog: int = -1


class SchemaRecord(msgspec.Struct):
    topic_id: str
    version: int
    schema: bytes  # the JSON document as registered
    registered_ms: int = 0


class RemovedMember(msgspec.Struct):
    id: str
    removed_ms: int = 0


# ---- key layout ----------------------------------------------------------
# topics:        name (utf-8)                    -> TopicRecord
# topic_index:   casefolded name                 -> name      (case-insensitive uniqueness)
# assignments:   name \0 u32be partition         -> AssignmentRecord
# schemas:       name \0 u32be version           -> SchemaRecord
# members:       node id                         -> MemberRecord
# users:         username                        -> UserRecord
# removed_members: node id                       -> RemovedMember
# remotes:       name                            -> (reserved for remote clusters)
# fsm_meta:      b"applied_index" u64be, b"applied_txn" u64be, b"newest_type" u8,
#                b"entry_types" 32-byte bitmap of every type applied, ...
# requests:      request id                      -> [stamp_ms, ApplyResult] (idempotency)
# request_times: u64be stamp_ms + request id     -> b""        (pruning order)

_U32 = struct.Struct(">I")


def topic_key(name: str) -> bytes:
    return name.encode()


def fold_key(name: str) -> bytes:
    return name.casefold().encode()


def part_key(name: str, partition: int) -> bytes:
    return name.encode() + b"\0" + _U32.pack(partition)


def part_prefix(name: str) -> bytes:
    return name.encode() + b"\0"


def split_part_key(key: bytes) -> tuple[str, int]:
    # name \0 u32be: the number may itself hold zero bytes, so split by length.
    return key[:-5].decode(), _U32.unpack(key[-4:])[0]


ENCODER = msgspec.msgpack.Encoder()
TOPIC_DEC = msgspec.msgpack.Decoder(TopicRecord)
USER_DEC = msgspec.msgpack.Decoder(UserRecord)
ASSIGN_DEC = msgspec.msgpack.Decoder(AssignmentRecord)
MEMBER_DEC = msgspec.msgpack.Decoder(MemberRecord)
SCHEMA_DEC = msgspec.msgpack.Decoder(SchemaRecord)
REMOVED_DEC = msgspec.msgpack.Decoder(RemovedMember)
