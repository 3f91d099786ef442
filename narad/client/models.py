"""Typed values the SDK hands out and takes: messages, topics, children, users.

Each ``from_json`` reads Narad's ``/v1`` shapes and ignores fields it does not
know (responses may gain fields within ``/v1``); ``raw`` keeps the whole answer.
Imports narad.client.envelope, the standard library and msgspec.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from narad.client.envelope import Envelope, unwrap

__all__ = [
    "AckResult",
    "BatchMessage",
    "BatchResult",
    "Child",
    "ChildList",
    "DeadLetterOrigin",
    "Grant",
    "Message",
    "PartitionStats",
    "ProduceResult",
    "RawJSON",
    "RedriveResult",
    "Topic",
    "TopicDetails",
    "TopicPage",
    "User",
]

PayloadKind = Literal["json", "text", "bytes"]


class RawJSON(bytes):
    """Bytes that already are one JSON text: produced as ``application/json`` and
    embedded verbatim in a batch or an envelope."""


class _WireDead(msgspec.Struct):
    topic: str = ""
    partition: int = 0
    offset: int = 0
    delivery_count: int = 0
    key: str | None = None
    key_encoding: str | None = None
    reason: str | None = None
    timestamp: int = 0


@dataclass(frozen=True, slots=True)
class DeadLetterOrigin:
    """Where a dead-lettered message came from (``Message.dead_letter``): its topic,
    partition, offset and key there, how many times it was delivered, the last
    nack's reason, its commit time there (Unix seconds)."""

    topic: str
    partition: int
    offset: int
    delivery_count: int
    key: bytes | None
    reason: str | None
    timestamp: int


@dataclass(frozen=True, slots=True)
class RedriveResult:
    """A redrive's answer: records moved back to their origin, records left (no origin, the
    origin gone, no produce grant there, or its schema refuses them)."""

    redriven: int
    skipped: int


def _key_bytes(key: str | None, enc: str | None) -> bytes | None:
    if key is None:
        return None
    return base64.b64decode(key) if enc == "base64" else key.encode()


class _WireMessage(msgspec.Struct):
    topic: str = ""
    partition: int = 0
    offset: int = 0
    payload: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"null"))
    payload_encoding: str | None = None
    key: str | None = None
    key_encoding: str | None = None
    timestamp: int = 0
    receipt_handle: str | None = None
    headers: dict[str, str] | None = None  # extension (issue 14)
    delivery_count: int | None = None  # extension (issue 14)
    dead_letter: _WireDead | None = None  # extension (issue 14)


class _WireBatch(msgspec.Struct):
    messages: list[_WireMessage] = msgspec.field(default_factory=list)


_msg_dec = msgspec.json.Decoder(_WireMessage)
_batch_dec = msgspec.json.Decoder(_WireBatch)


@dataclass(frozen=True, slots=True)
class Message:
    """One delivered (or replayed) message.

    ``payload`` is the stored bytes as far as the wire tells them: a JSON body
    comes back verbatim; other UTF-8 text as a JSON string (``payload`` is the
    text's bytes; a body that *was* a JSON string reads the same, Narad's one
    sharp edge: ``payload_json`` holds the verbatim JSON); binary as base64
    (decoded). ``receipt_handle`` is None for a replay.
    """

    topic: str
    partition: int
    offset: int
    payload: bytes
    payload_kind: PayloadKind
    payload_json: bytes | None
    key: bytes | None
    timestamp: int  # commit time, Unix seconds
    receipt_handle: str | None
    headers: dict[str, str] = field(default_factory=dict)  # the record's headers (an extension; {} when none)
    # Extensions (issue 14; None from a Narad node): how many times this message was
    # leased, this delivery included (None for a replay); where a dead-lettered one came from.
    delivery_count: int | None = None
    dead_letter: DeadLetterOrigin | None = None

    @classmethod
    def _from_wire(cls, w: _WireMessage) -> Message:
        raw = bytes(w.payload)
        pj: bytes | None
        if w.payload_encoding == "base64":
            payload, kind, pj = base64.b64decode(msgspec.json.decode(raw, type=str)), "bytes", None
        elif raw[:1] == b'"':
            payload, kind, pj = msgspec.json.decode(raw, type=str).encode(), "text", raw
        else:
            payload, kind, pj = raw, "json", raw
        key = _key_bytes(w.key, w.key_encoding)
        d = w.dead_letter
        dead = None if d is None else DeadLetterOrigin(d.topic, d.partition, d.offset, d.delivery_count,
                                                       _key_bytes(d.key, d.key_encoding), d.reason, d.timestamp)
        return cls(topic=w.topic, partition=w.partition, offset=w.offset, payload=payload,
                   payload_kind=kind,  # type: ignore[arg-type]
                   payload_json=pj, key=key, timestamp=w.timestamp, receipt_handle=w.receipt_handle,
                   headers=w.headers or {}, delivery_count=w.delivery_count, dead_letter=dead)

    @classmethod
    def parse_one(cls, body: bytes) -> Message:
        return cls._from_wire(_msg_dec.decode(body))

    @classmethod
    def parse_batch(cls, body: bytes) -> list[Message]:
        return [cls._from_wire(w) for w in _batch_dec.decode(body).messages]

    def text(self) -> str:
        return self.payload.decode()

    def json(self) -> Any:
        """The payload decoded from JSON (the verbatim JSON when the wire had it)."""
        return msgspec.json.decode(self.payload_json if self.payload_json is not None else self.payload)

    def envelope(self) -> Envelope | None:
        """The Go SDK envelope this payload carries, or None."""
        if self.payload_kind != "json":
            return None
        return unwrap(self.payload)

    def body(self) -> Any:
        """The message as its producer meant it: an envelope's body, else ``json()``."""
        env = self.envelope()
        return env.json() if env is not None else self.json()

    @property
    def key_text(self) -> str | None:
        return None if self.key is None else self.key.decode("utf-8", "replace")

    def trace_context(self) -> Any:
        """The OpenTelemetry context its producer's SDK put in the headers
        (``traceparent``/``tracestate``), for ``tracer.start_as_current_span(...,
        context=msg.trace_context())``; None when opentelemetry is not installed."""
        try:
            from opentelemetry import propagate
        except ImportError:
            return None
        return propagate.extract(dict(self.headers))


@dataclass(frozen=True, slots=True)
class BatchMessage:
    """One message of ``produce_batch``: ``payload`` as for ``produce``."""

    payload: Any
    key: str | bytes | None = None
    partition: int | None = None
    record_headers: dict[str, str] | None = None  # stored with the record (an extension; see produce)
    idempotency_key: str | None = None  # extension (issue 14): a repeat within the topic's window is not stored


def inject_trace_context(headers: dict[str, str] | None) -> dict[str, str] | None:
    """``headers`` with the current OpenTelemetry trace context added
    (``traceparent``/``tracestate``; headers the caller set win). Unchanged when
    opentelemetry is not installed or no span is recording, and when adding it would
    take the headers past the node's bounds (32 headers, 8192 bytes of names and
    values): the trace context is best effort, the caller's headers are not refused
    for it."""
    try:
        from opentelemetry import propagate
    except ImportError:
        return headers
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return headers
    return merge_trace(carrier, headers)


def merge_trace(carrier: dict[str, str], headers: dict[str, str] | None) -> dict[str, str] | None:
    """``headers`` with the trace context in ``carrier`` added (the caller's win), or
    ``headers`` alone when adding it would pass the node's bounds."""
    out = {**carrier, **(headers or {})}
    if len(out) > MAX_RECORD_HEADERS or sum(len(k.encode()) + len(v.encode()) for k, v in out.items()) > \
            MAX_RECORD_HEADER_BYTES:
        return headers
    return out


MAX_RECORD_HEADERS = 32  # the node's bounds on a record's headers (narad.api.messages.MAX_HEADERS...)
MAX_RECORD_HEADER_BYTES = 8192


@dataclass(frozen=True, slots=True)
class ProduceResult:
    """What a single produce's 202 said. ``duplicate``: True when the message was an
    idempotency key's repeat (nothing stored), False when it was stored, None when the
    produce had no key or the owner's verdict did not come in time (``pending``: it
    is durable and still checked at its commit)."""

    duplicate: bool | None = None
    pending: bool = False

    @classmethod
    def from_json(cls, d: Any) -> ProduceResult:
        if not isinstance(d, dict):
            return cls()
        dup = d.get("duplicate")
        return cls(dup if isinstance(dup, bool) else None, d.get("pending") is True)


class BatchResult(int):
    """``produce_batch``'s answer: the count accepted (an int, as before) with
    ``accepted``, ``duplicates`` (repeats of an idempotency key among them, not
    stored; 0 without keys) and ``pending`` (keyed messages whose verdict did not
    come in time)."""

    accepted: int
    duplicates: int
    pending: int

    def __new__(cls, accepted: int, duplicates: int = 0, pending: int = 0) -> BatchResult:
        obj = super().__new__(cls, accepted)
        obj.accepted, obj.duplicates, obj.pending = accepted, duplicates, pending
        return obj

    def __repr__(self) -> str:
        return f"BatchResult(accepted={self.accepted}, duplicates={self.duplicates}, pending={self.pending})"


def _opt_int(d: dict[str, Any], k: str) -> int | None:
    v = d.get(k)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass(frozen=True, slots=True)
class Topic:
    """Narad's ``Topic``. ``role`` is None (standalone), "parent" or "child"."""

    name: str
    id: str
    partitions: int
    retention_ms: int
    visibility_timeout_ms: int
    max_in_flight_per_partition: int
    max_acked_ahead_per_partition: int
    created_at: int
    owner: str | None = None
    role: str | None = None
    parent: str | None = None
    children: list[str] = field(default_factory=list)
    delay_ms: int = 0
    attach_epoch: int | None = None
    attach_offsets: list[int] = field(default_factory=list)
    # Delivery settings (extensions, issue 14): 0 / None when not set.
    max_deliveries: int = 0
    dead_letter_topic: str | None = None
    idempotency_window_ms: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @staticmethod
    def _fields(d: dict[str, Any]) -> dict[str, Any]:
        return {
            "name": str(d.get("name", "")),
            "id": str(d.get("id", "")),
            "partitions": int(d.get("partitions", 0)),
            "retention_ms": int(d.get("retention_ms", 0)),
            "visibility_timeout_ms": int(d.get("visibility_timeout_ms", 0)),
            "max_in_flight_per_partition": int(d.get("max_in_flight_per_partition", 0)),
            "max_acked_ahead_per_partition": int(d.get("max_acked_ahead_per_partition", 0)),
            "created_at": int(d.get("created_at", 0)),
            "owner": d.get("owner"),
            "role": d.get("role"),
            "parent": d.get("parent"),
            "children": list(d.get("children") or []),
            "delay_ms": int(d.get("delay_ms") or d.get("fanout_delay_ms") or 0),
            "attach_epoch": _opt_int(d, "attach_epoch"),
            "attach_offsets": list(d.get("attach_offsets") or []),
            "max_deliveries": int(d.get("max_deliveries") or 0),
            "dead_letter_topic": d.get("dead_letter_topic"),
            "idempotency_window_ms": int(d.get("idempotency_window_ms") or 0),
            "raw": d,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Topic:
        return cls(**cls._fields(d))


@dataclass(frozen=True, slots=True)
class PartitionStats:
    """One row of ``partition_stats`` (Narad's shape: keyed ``index``); placeholders
    (``status == "owner_unavailable"``, ``owner_liveness`` says why) carry zeroed
    numbers that must not be summed. ``oldest_segment_at`` is an RFC 3339 time or None."""

    index: int
    owner_node: str
    high_watermark: int
    next_offset: int
    oldest_offset: int
    committed_offset: int
    lag: int
    in_flight: int
    acked_ahead: int
    status: str | None
    segments: int = 0
    size_bytes: int = 0
    oldest_segment_at: str | None = None
    owner_liveness: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PartitionStats:
        return cls(
            index=int(d.get("index", 0)),
            owner_node=str(d.get("owner_node", "")),
            high_watermark=int(d.get("high_watermark", 0)),
            next_offset=int(d.get("next_offset", 0)),
            oldest_offset=int(d.get("oldest_offset", 0)),
            committed_offset=int(d.get("committed_offset", -1)),
            lag=int(d.get("lag", 0)),
            in_flight=int(d.get("in_flight", 0)),
            acked_ahead=int(d.get("acked_ahead", 0)),
            status=d.get("status"),
            segments=int(d.get("segments", 0)),
            size_bytes=int(d.get("size_bytes", 0)),
            oldest_segment_at=d.get("oldest_segment_at"),
            owner_liveness=d.get("owner_liveness"),
            raw=d,
        )


@dataclass(frozen=True, slots=True)
class TopicDetails(Topic):
    """``GET /v1/topics/{topic}``: the topic, its schema and per-partition stats."""

    schema_version: int = 0
    schema: Any = None
    partition_stats: list[PartitionStats] = field(default_factory=list)
    partial: bool = False

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TopicDetails:
        return cls(
            **cls._fields(d),
            schema_version=int(d.get("schema_version", 0)),
            schema=d.get("schema"),
            partition_stats=[PartitionStats.from_json(r) for r in d.get("partition_stats") or []],
            partial=bool(d.get("partial", False)),
        )


@dataclass(frozen=True, slots=True)
class TopicPage:
    """One page of ``list_topics``; ``next_page_token`` is "" on the last page. Pages
    are filtered by visibility after they are cut, so one may be short or empty
    while a token is still set."""

    topics: list[Topic]
    next_page_token: str


@dataclass(frozen=True, slots=True)
class Child:
    name: str
    delay_ms: int
    lag_messages: int
    lag_complete: bool
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class ChildList:
    parent: str
    parent_id: str
    children: list[Child]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ChildList:
        rows = [Child(name=str(c.get("name", "")), delay_ms=int(c.get("delay_ms", 0)),
                      lag_messages=int(c.get("lag_messages", 0)), lag_complete=bool(c.get("lag_complete", False)),
                      raw=c) for c in d.get("children") or []]
        return cls(parent=str(d.get("parent", "")), parent_id=str(d.get("parent_id", "")), children=rows)


@dataclass(frozen=True, slots=True)
class Grant:
    """``action`` is produce | consume | create | admin; ``patterns`` exact names or
    ``prefix*`` (none for admin)."""

    action: str
    patterns: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "patterns": list(self.patterns)}


@dataclass(frozen=True, slots=True)
class User:
    username: str
    grants: list[Grant]
    root: bool
    created_at_ms: int
    updated_at_ms: int

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> User:
        return cls(
            username=str(d.get("username", "")),
            grants=[Grant(str(g.get("action", "")), list(g.get("patterns") or [])) for g in d.get("grants") or []],
            root=bool(d.get("root", False)),
            created_at_ms=int(d.get("created_at_ms", 0)),
            updated_at_ms=int(d.get("updated_at_ms", 0)),
        )


@dataclass(frozen=True, slots=True)
class AckResult:
    """One handle's outcome in a batch ack: ``status`` is what a single ack of it
    would have answered (204 settled, 410 lease gone, 400 bad handle, 502/503 retry)."""

    receipt_handle: str
    status: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 204
