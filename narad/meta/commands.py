"""Raft entry types, their payloads, and the command envelope.

Every metadata write is one Raft entry: ``op byte`` (the entry type) followed
by msgpack ``[request_id, stamp_ms, payload]``. ``stamp_ms`` is the proposing
leader's clock and ``request_id`` the idempotency key: apply never reads a
clock or generates anything, and a retried proposal of the same request id
returns the first result instead of applying twice.

Numbering: 1-22 are the base entry types every release of this product
applies; 23-32 are the compare-and-set types the seed (metastore "The entry
types v3.1.0 adds") numbers, proposed only once every member applies them;
33-37 are reserved for remote replication. Pure data, no I/O.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import msgspec

from narad.meta.records import Grant, MemberRecord, TopicRecord, UserRecord


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


# The newest entry type this build applies. A later release raises it.
NEWEST_ENTRY_TYPE = max(EntryType)


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


class MarkDead(msgspec.Struct, array_like=True):
    node_id: str
    # The heartbeat stamp the leader judged silent: a heartbeat applied after that
    # judgement wins (the mark is refused). -1: unconditional (older entries).
    heartbeat_ms: int = -1


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
