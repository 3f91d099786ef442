"""Metastore export and import documents (Felix "Migration"): the disaster-recovery
artifact. ``build_export`` turns one read transaction of the replica into a JSON
document with counts per domain; ``parse_export`` checks such a document and
turns it into the one Raft entry (type 38, ImportMetastore) that installs it.

Members, removed members and the root admin belong to the cluster being
restored into and are exported for the record only, never imported. Pure:
reads through narad.meta.store.Reader, imports narad.meta.{commands,records,validate}.
"""

from __future__ import annotations

from typing import Any

import msgspec

from narad.meta import commands as C
from narad.meta import records as R
from narad.meta import validate as VAL
from narad.meta.store import Reader

FORMAT = "narad-metastore-export"
VERSION = 1
MAX_DOCUMENT = 32 << 20  # one Raft entry and one RPC frame; larger exports are refused at import


class ExportedSchema(msgspec.Struct):
    topic: str
    topic_id: str
    version: int
    schema: str  # the JSON document as registered
    registered_ms: int = 0


class ExportedAssignment(msgspec.Struct):
    topic: str
    partition: int
    owner: str
    topic_id: str


class ExportDocument(msgspec.Struct):
    format: str
    version: int
    build: str
    node: str
    applied_index: int
    exported_at_ms: int
    counts: dict[str, int]
    topics: list[R.TopicRecord]
    schemas: list[ExportedSchema]
    assignments: list[ExportedAssignment]
    users: list[R.UserRecord]
    members: list[R.MemberRecord] = []
    removed_members: list[str] = []


def build_export(r: Reader, *, build: str, node: str, now_ms: int) -> dict[str, Any]:
    """Everything in one read transaction: a consistent cut at ``applied_index``."""
    applied_index = r.applied_index()
    topics = r.topics()
    schemas = [ExportedSchema(t.name, s.topic_id, s.version, s.schema.decode(), s.registered_ms)
               for t in topics for s in r.schemas(t.name)]
    assignments = [ExportedAssignment(name, part, a.owner, a.topic_id) for name, part, a in r.all_assignments()]
    users = r.users()
    members = r.members()
    removed = sorted(bytes(k).decode() for k, _ in r.txn.cursor(db=r.dbs["removed_members"]))
    doc = ExportDocument(
        format=FORMAT, version=VERSION, build=build, node=node, applied_index=applied_index, exported_at_ms=now_ms,
        counts={"topics": len(topics), "schemas": len(schemas), "assignments": len(assignments),
                "users": len(users), "members": len(members), "removed_members": len(removed)},
        topics=topics, schemas=schemas, assignments=assignments, users=users, members=members,
        removed_members=removed,
    )
    return msgspec.to_builtins(doc)  # type: ignore[no-any-return]


def parse_export(raw: bytes, *, overwrite: bool) -> tuple[C.ImportMetastore, dict[str, int]]:
    """Check an export document; raises ValueError saying what is wrong."""
    if len(raw) > MAX_DOCUMENT:
        raise ValueError(f"the export is {len(raw)} bytes; at most {MAX_DOCUMENT} can be imported as one entry")
    try:
        doc = msgspec.json.decode(raw, type=ExportDocument)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a narad metastore export: {e}") from None
    if doc.format != FORMAT or doc.version != VERSION:
        raise ValueError(f"unsupported export format {doc.format!r} version {doc.version} "
                         f"(this build reads {FORMAT} version {VERSION})")
    for t in doc.topics:
        try:
            VAL.topic_name(t.name)
        except Exception as e:
            raise ValueError(f"topic {t.name!r}: {getattr(e, 'message', e)}") from None
        if len(t.id) != 16 or any(c not in "0123456789abcdef" for c in t.id):
            raise ValueError(f"topic {t.name!r}: incarnation id {t.id!r} is not 16 hex digits")
    seen_users: set[str] = set()
    for u in doc.users:
        try:
            VAL.username(u.username)
            VAL.grants(u.grants)
        except Exception as e:
            raise ValueError(f"user {u.username[:64]!r}: {getattr(e, 'message', e)}") from None
        if not u.password_hash or len(u.password_hash) > 1024 or u.username in seen_users:
            raise ValueError(f"user {u.username!r}: missing password hash, or listed twice")
        seen_users.add(u.username)
    versions: dict[str, list[int]] = {}
    for s in doc.schemas:
        versions.setdefault(s.topic, []).append(s.version)
    for t in doc.topics:
        have = sorted(versions.get(t.name, []))
        if have != list(range(1, t.schema_version + 1)):
            raise ValueError(f"topic {t.name!r}: schema_version {t.schema_version} but the export holds versions "
                             f"{have[:20]}")
    counts = {"topics": len(doc.topics), "schemas": len(doc.schemas), "assignments": len(doc.assignments),
              "users": len([u for u in doc.users if not u.root])}
    if {k: doc.counts.get(k) for k in ("topics", "schemas", "assignments")} != {
            k: counts[k] for k in ("topics", "schemas", "assignments")}:
        raise ValueError(f"the export's counts {doc.counts} do not match its contents; the file is damaged")
    entry = C.ImportMetastore(
        overwrite=overwrite,
        topics=doc.topics,
        schemas=[C.ImportedSchema(s.topic, R.SchemaRecord(s.topic_id, s.version, s.schema.encode(), s.registered_ms))
                 for s in doc.schemas],
        assignments=[C.ImportedAssignment(a.topic, a.partition, R.AssignmentRecord(a.owner, a.topic_id))
                     for a in doc.assignments],
        users=doc.users,
    )
    return entry, counts


__all__ = ["FORMAT", "MAX_DOCUMENT", "VERSION", "ExportDocument", "build_export", "parse_export"]
