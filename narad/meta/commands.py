"""Raft entry types, their payloads, and the command envelope.

Every metadata write is one Raft entry: ``op byte`` (the entry type) followed
by msgpack ``[request_id, stamp_ms, payload]``. ``stamp_ms`` is the proposing
leader's clock and ``request_id`` the idempotency key: apply never reads a
clock or generates anything, and a retried proposal of the same request id
returns the first result instead of applying twice.

Numbering: 1-22 are the base entry types every release of this product
applies; 23-32 are the compare-and-set types the seed (metastore "The entry
types v3.1.0 adds") numbers, proposed only once every member applies them
(27-28, fan-out attach / detach, arrive with fan-out topics and a newer
release number); 33-37 are reserved for remote replication; 38 imports a
metastore export (disaster recovery), gated like 23-32; 39-42 are partition
moves and decommission; 43 sets a topic's delivery settings (issue 14). Pure
data, no I/O.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import msgspec

from narad.meta.records import AssignmentRecord, Grant, MemberRecord, SchemaRecord, TopicRecord, UserRecord


class EntryType(IntEnum):
    NOOP = 1  # barrier: applies nothing
    CREATE_TOPIC = 2
    DELETE_TOPIC = 3
    UPDATE_TOPIC = 4
    PUT_SCHEMA = 5
    ASSIGN_PARTITIONS = 6
    REGISTER_MEMBER = 7
    HEARTBEAT = 8
    MARK_DEAD = 9
    CREATE_USER = 10
    UPDATE_GRANTS = 11
    UPDATE_PASSWORD = 12
    DELETE_USER = 13
    # Compare-and-set types (the seed's 23-32): each carries what its write was checked
    # against and is refused identically on every node when the metadata moved. The
    # leader proposes one only once every Raft server and member record applies it.
    CREATE_TOPIC_CHECKED = 23  # create with schema and placement on known, not removed members
    UPDATE_TOPIC_CAS = 24  # alter only the incarnation read; never shrinks partitions
    DELETE_TOPIC_CAS = 25  # delete only the incarnation checked
    PUT_SCHEMA_CAS = 26  # append a schema version to the incarnation checked, within the byte budgets
    ATTACH_CHILD_CAS = 27  # link a child only if parent and child are the incarnations checked
    DETACH_CHILD_CAS = 28  # unlink a child only if parent and child are the incarnations checked
    PLACE_PARTITIONS = 29  # insert-only placement: never replaces an owner
    PRUNE_ASSIGNMENTS = 30  # delete assignment rows that belong to no partition
    MARK_DEAD_OBSERVED = 31  # dead mark refused when a newer heartbeat is on record
    DELETE_USER_RELEASING = 32  # delete a user and clear the owner of its topics
    # 33-37 are reserved for remote replication.
    IMPORT_METASTORE = 38  # a metastore export applied as one entry (empty cluster, or overwrite)
    # Partition moves and decommission (issue 13).
    SET_MOVE_TARGETS = 39  # set or clear move targets, all rows or none: each only if owner and target are as read
    COMPLETE_MOVE = 40  # the flip: owner := target only if the owner is still the source and the target still it
    SET_DRAINING = 41  # mark a member draining (decommission) or clear the mark (cancel)
    REMOVE_MEMBER = 42  # delete a member record that owns and receives nothing, leaving a tombstone
    # Delivery settings (issue 14).
    SET_DELIVERY = 43  # max_deliveries / dead_letter_topic / idempotency_window_ms of the incarnation checked


# The newest entry type this build applies. A later release raises it, but numbers
# are not assigned in release order (the seed reserves 27-28 and 33-37), so what a
# node applies is a *set*: members report it and the leader gates on membership.
NEWEST_ENTRY_TYPE = max(EntryType)
# The types every release of this product applies (proposed without asking anyone).
BASE_TYPES = frozenset(int(t) for t in EntryType if t <= 13)
# Every type this build applies.
APPLIED_TYPES = frozenset(int(t) for t in EntryType)


def types_up_to(cap: int) -> frozenset[int]:
    """The types this build applies that are numbered ``cap`` or below (a node
    standing in for an older release)."""
    return frozenset(t for t in APPLIED_TYPES if t <= cap)


def types_reported(entry_types: list[int], newest: int) -> frozenset[int]:
    """What a member reported: its list, or (a record without one) every type
    this build knows up to its newest."""
    return frozenset(entry_types) if entry_types else types_up_to(newest)


def types_to_bits(types: frozenset[int] | set[int]) -> bytes:
    bits = bytearray(32)
    for t in types:
        if 0 <= t < 256:
            bits[t >> 3] |= 1 << (t & 7)
    return bytes(bits)


def bits_to_types(raw: bytes) -> frozenset[int]:
    return frozenset(i * 8 + b for i, byte in enumerate(raw[:32]) for b in range(8) if byte >> b & 1)


class Result(IntEnum):
    OK = 0
    EXISTS = 1
    NOT_FOUND = 2
    CHANGED = 3  # compare-and-set missed: the metadata moved since it was read
    INVALID = 4
    UNDECODABLE = 5
    REFUSED = 6


class ApplyResult(msgspec.Struct, array_like=True):
    code: int
    message: str = ""
    index: int = 0  # the Raft index the entry applied at (filled by the FSM)

    @property
    def ok(self) -> bool:
        return self.code == Result.OK


# ---- payloads -------------------------------------------------------------


class Noop(msgspec.Struct, array_like=True):
    pass


class CreateTopic(msgspec.Struct, array_like=True):
    topic: TopicRecord
    schema: bytes | None = None  # registered as version 1 in the same entry
    owners: list[tuple[int, str]] = []  # initial placement, in the same entry


class DeleteTopic(msgspec.Struct, array_like=True):
    name: str


class UpdateTopic(msgspec.Struct, array_like=True):
    name: str
    retention_ms: int | None = None
    max_in_flight_per_partition: int | None = None
    max_acked_ahead_per_partition: int | None = None
    partitions: int | None = None  # grow only


class PutSchema(msgspec.Struct, array_like=True):
    name: str
    version: int  # must be exactly latest + 1
    schema: bytes


class AssignPartitions(msgspec.Struct, array_like=True):
    name: str
    topic_id: str
    owners: list[tuple[int, str]]  # (partition, node id)


class RegisterMember(msgspec.Struct, array_like=True):
    member: MemberRecord


class Heartbeat(msgspec.Struct, array_like=True):
    node_id: str
    build: str = ""
    newest_entry_type: int = 0
    client_addr: str = ""
    cluster_addr: str = ""
    entry_types: list[int] = []  # every type the node applies
    dispatch_backlog: int = -1  # records in its ingress WALs not yet at their owner (-1: unknown)


class MarkDead(msgspec.Struct, array_like=True):
    node_id: str


class CreateUser(msgspec.Struct, array_like=True):
    user: UserRecord


class UpdateGrants(msgspec.Struct, array_like=True):
    username: str
    grants: list[Grant]


class UpdatePassword(msgspec.Struct, array_like=True):
    username: str
    password_hash: bytes


class DeleteUser(msgspec.Struct, array_like=True):
    username: str


class CreateTopicChecked(msgspec.Struct, array_like=True):
    topic: TopicRecord
    schema: bytes | None = None
    owners: list[tuple[int, str]] = []  # each a registered member that was not removed


class UpdateTopicCas(msgspec.Struct, array_like=True):
    name: str
    topic_id: str  # the incarnation the alter was checked against
    retention_ms: int | None = None
    max_in_flight_per_partition: int | None = None
    max_acked_ahead_per_partition: int | None = None
    partitions: int | None = None  # grow only


class DeleteTopicCas(msgspec.Struct, array_like=True):
    name: str
    topic_id: str


class PutSchemaCas(msgspec.Struct, array_like=True):
    name: str
    topic_id: str
    version: int  # exactly latest + 1
    schema: bytes


class AttachChildCas(msgspec.Struct, array_like=True):
    """Type 27. Refused (CHANGED) unless parent and child are the incarnations
    checked and ``len(attach_offsets)`` is the parent's partition count; refused
    (INVALID, 409) when a fan-out rule breaks at apply: the child has a parent or
    children, the parent is a child or has 108 children, the schema histories
    differ (compared as JSON values), delay vs. the parent's retention."""

    parent: str
    parent_id: str
    child: str
    child_id: str
    delay_ms: int
    epoch: str  # fresh, 16 hex chars, stamped at propose time
    attach_offsets: list[int]  # the parent's committed high watermark per partition


class DetachChildCas(msgspec.Struct, array_like=True):
    """Type 28. Unlinks only if parent and child are the incarnations checked."""

    parent: str
    parent_id: str
    child: str
    child_id: str


class PlacePartitions(msgspec.Struct, array_like=True):
    name: str
    topic_id: str
    owners: list[tuple[int, str]]  # only partitions with no owner of this incarnation on record


class PruneAssignments(msgspec.Struct, array_like=True):
    rows: list[tuple[str, int]]  # (topic name, partition) rows that belong to no partition


class MarkDeadObserved(msgspec.Struct, array_like=True):
    node_id: str
    heartbeat_ms: int  # the heartbeat stamp the decision was made from


class DeleteUserReleasing(msgspec.Struct, array_like=True):
    username: str


class MoveTargetRow(msgspec.Struct, array_like=True):
    topic: str
    topic_id: str
    partition: int
    owner: str  # the owner the decision was made from
    expect_target: str | None  # the target it was made from (None: no move in flight)
    target: str | None  # the new target (None: clear the move)


class SetMoveTargets(msgspec.Struct, array_like=True):
    """Set or clear move targets. Every row is checked first (the row exists for
    that incarnation, its owner and target are the ones read, a new target is a
    registered member other than the owner); one mismatch refuses the whole entry
    (CHANGED), so a planner pass or an abort applies whole or not at all."""

    rows: list[MoveTargetRow]


class CompleteMove(msgspec.Struct, array_like=True):
    """The flip: owner := target, target := None, only if the owner is still
    `source` and the target still `target`. A flip that already happened (owner
    == target, no target) answers OK with message "done"; anything else CHANGED;
    no row of that incarnation NOT_FOUND.

    ``source_heartbeat_ms`` (a force-promote; -1: not one): also CHANGED unless
    the source's member record is dead with no heartbeat newer than this stamp
    (the one the leader judged the source's silence from)."""

    topic: str
    topic_id: str
    partition: int
    source: str
    target: str
    source_heartbeat_ms: int = -1


class SetDraining(msgspec.Struct, array_like=True):
    node_id: str
    draining: bool


class SetDelivery(msgspec.Struct, array_like=True):
    """Set a topic's delivery settings (each None: unchanged; ``dead_letter_topic``
    "" clears it). Refused (CHANGED) when the incarnation moved; INVALID when the
    dead-letter topic is the topic itself or does not exist, or max_deliveries > 0
    would be left without a dead-letter topic."""

    name: str
    topic_id: str
    max_deliveries: int | None = None
    dead_letter_topic: str | None = None
    idempotency_window_ms: int | None = None


class RemoveMember(msgspec.Struct, array_like=True):
    """Delete a member record and leave a tombstone (removed_members, stamped
    with the entry's stamp) that refuses its id. Refused (CHANGED) while it owns
    a partition or is the target of a move; NOT_FOUND without a record.

    ``clear_tombstone``: instead, delete the tombstone of ``node_id`` (the node
    rejoins with an empty data dir, as a new node); OK whether or not one exists."""

    node_id: str
    clear_tombstone: bool = False


class ImportedSchema(msgspec.Struct, array_like=True):
    topic: str
    schema: SchemaRecord


class ImportedAssignment(msgspec.Struct, array_like=True):
    topic: str
    partition: int
    assignment: AssignmentRecord


class ImportMetastore(msgspec.Struct, array_like=True):
    """Topics, schema histories, assignments and users of an export. Refused when
    the cluster holds topics or users besides the root admin, unless overwrite."""

    overwrite: bool
    topics: list[TopicRecord]
    schemas: list[ImportedSchema]
    assignments: list[ImportedAssignment]
    users: list[UserRecord]


PAYLOAD_TYPES: dict[int, type[msgspec.Struct]] = {
    EntryType.NOOP: Noop,
    EntryType.CREATE_TOPIC: CreateTopic,
    EntryType.DELETE_TOPIC: DeleteTopic,
    EntryType.UPDATE_TOPIC: UpdateTopic,
    EntryType.PUT_SCHEMA: PutSchema,
    EntryType.ASSIGN_PARTITIONS: AssignPartitions,
    EntryType.REGISTER_MEMBER: RegisterMember,
    EntryType.HEARTBEAT: Heartbeat,
    EntryType.MARK_DEAD: MarkDead,
    EntryType.CREATE_USER: CreateUser,
    EntryType.UPDATE_GRANTS: UpdateGrants,
    EntryType.UPDATE_PASSWORD: UpdatePassword,
    EntryType.DELETE_USER: DeleteUser,
    EntryType.CREATE_TOPIC_CHECKED: CreateTopicChecked,
    EntryType.UPDATE_TOPIC_CAS: UpdateTopicCas,
    EntryType.DELETE_TOPIC_CAS: DeleteTopicCas,
    EntryType.PUT_SCHEMA_CAS: PutSchemaCas,
    EntryType.ATTACH_CHILD_CAS: AttachChildCas,
    EntryType.DETACH_CHILD_CAS: DetachChildCas,
    EntryType.PLACE_PARTITIONS: PlacePartitions,
    EntryType.PRUNE_ASSIGNMENTS: PruneAssignments,
    EntryType.MARK_DEAD_OBSERVED: MarkDeadObserved,
    EntryType.DELETE_USER_RELEASING: DeleteUserReleasing,
    EntryType.IMPORT_METASTORE: ImportMetastore,
    EntryType.SET_MOVE_TARGETS: SetMoveTargets,
    EntryType.COMPLETE_MOVE: CompleteMove,
    EntryType.SET_DRAINING: SetDraining,
    EntryType.REMOVE_MEMBER: RemoveMember,
    EntryType.SET_DELIVERY: SetDelivery,
}
# The base type a compare-and-set type stands in for while some member cannot apply it.
FALLBACK: dict[int, int | None] = {
    EntryType.CREATE_TOPIC_CHECKED: EntryType.CREATE_TOPIC,
    EntryType.UPDATE_TOPIC_CAS: EntryType.UPDATE_TOPIC,
    EntryType.DELETE_TOPIC_CAS: EntryType.DELETE_TOPIC,
    EntryType.PUT_SCHEMA_CAS: EntryType.PUT_SCHEMA,
    EntryType.ATTACH_CHILD_CAS: None,  # no base equivalent: refused (412) until every member applies it
    EntryType.DETACH_CHILD_CAS: None,
    EntryType.PLACE_PARTITIONS: EntryType.ASSIGN_PARTITIONS,
    EntryType.PRUNE_ASSIGNMENTS: None,  # no base equivalent: orphan rows are only logged
    EntryType.MARK_DEAD_OBSERVED: EntryType.MARK_DEAD,
    EntryType.DELETE_USER_RELEASING: EntryType.DELETE_USER,
    EntryType.IMPORT_METASTORE: None,  # no base equivalent: the import waits for every member
    EntryType.SET_MOVE_TARGETS: None,  # moves wait until every member applies them
    EntryType.COMPLETE_MOVE: None,
    EntryType.SET_DRAINING: None,
    EntryType.REMOVE_MEMBER: None,
    EntryType.SET_DELIVERY: None,  # delivery settings wait until every member applies them
}
TYPE_OF: dict[type, int] = {v: k for k, v in PAYLOAD_TYPES.items()}


class Envelope(msgspec.Struct, array_like=True):
    request_id: str
    stamp_ms: int
    payload: msgspec.Raw


_enc = msgspec.msgpack.Encoder()
_env_dec = msgspec.msgpack.Decoder(Envelope)
_payload_decs = {t: msgspec.msgpack.Decoder(cls) for t, cls in PAYLOAD_TYPES.items()}


def encode(payload: msgspec.Struct, *, request_id: str, stamp_ms: int) -> bytes:
    op = TYPE_OF[type(payload)]
    return bytes([op]) + _enc.encode(Envelope(request_id, stamp_ms, msgspec.Raw(_enc.encode(payload))))


class Decoded(msgspec.Struct):
    op: int
    request_id: str
    stamp_ms: int
    payload: Any


def decode(data: bytes) -> Decoded:
    """Decode an entry. Raises KeyError for an unknown type (the caller
    fail-stops) and msgspec.DecodeError / ValueError for undecodable bytes."""
    if not data:
        raise ValueError("empty entry")
    op = data[0]
    if op not in _payload_decs:
        raise KeyError(op)
    env = _env_dec.decode(data[1:])
    return Decoded(op, env.request_id, env.stamp_ms, _payload_decs[op].decode(env.payload))


__all__ = [
    "APPLIED_TYPES",
    "BASE_TYPES",
    "FALLBACK",
    "NEWEST_ENTRY_TYPE",
    "ApplyResult",
    "AssignPartitions",
    "CreateTopic",
    "CreateUser",
    "DeleteTopic",
    "DeleteUser",
    "EntryType",
    "Grant",
    "Heartbeat",
    "ImportMetastore",
    "ImportedAssignment",
    "ImportedSchema",
    "MarkDead",
    "MemberRecord",
    "Noop",
    "PutSchema",
    "RegisterMember",
    "Result",
    "TopicRecord",
    "UpdateGrants",
    "UpdatePassword",
    "UpdateTopic",
    "UserRecord",
]
