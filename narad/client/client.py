"""``AsyncClient``: every Narad ``/v1`` call a service needs, over a pool of
keep-alive connections to any node of a list, with Narad's retry rules.

Retry rules (the only ones; everything else raises at once):

=============  =====================================================================
call kind      retried (on another node when there is one) when
=============  =====================================================================
produce        nothing was sent (connect failed), or 503 with ``Retry-After``
               (Narad stored nothing). A timeout or any other 5xx is *uncertain*:
               raised with ``uncertain=True``, never retried (a retry after a 202
               stores the message twice). With an ``idempotency_key`` (every
               message of a batch keyed) a produce is retried as a consume is:
               the owner drops a repeat within the topic's window.
metadata write connect failed, or 503 with ``Retry-After`` unless the node says the
               write may have landed (then raised, ``uncertain=True``: read back).
ack / extend   connect failed, 502, 503, 421. Batch ack: only the handles whose
/ nack         result is 502 or 503 are sent again.
consume        connect failed, 421, 502, 503, 504, a timeout or a lost connection
               (a lost consume only delays a message: its lease lapses).
read           as consume (a read changes nothing).
=============  =====================================================================

Retries use full-jitter exponential backoff, honour ``Retry-After`` per node, stop
at ``max_attempts`` or the call's deadline, and then raise the last error.
A node that refused a connection is skipped for ``node_cooldown`` seconds.

Imports narad.client.{consumer,errors,envelope,models,transport}, msgspec, stdlib.
"""

from __future__ import annotations

import asyncio
import base64
import math
import random
import ssl
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote, quote_from_bytes

import msgspec

import narad.client.errors as E
from narad.client.consumer import Consumer, Handler
from narad.client.envelope import wrap
from narad.client.models import (
    AckResult,
    BatchMessage,
    BatchResult,
    ChildList,
    Grant,
    Message,
    ProduceResult,
    RawJSON,
    RedriveResult,
    Topic,
    TopicDetails,
    TopicPage,
    User,
    inject_trace_context,
    merge_trace,
)
from narad.client.transport import H1Transport, H3Transport, NodeAddr, Transport, parse_node

__all__ = ["AckMode", "AsyncClient", "RetryPolicy"]

VERSION = "0.1.0"
AckMode = Literal["ack", "extend", "nack"]
Kind = Literal["produce", "write", "ack", "consume", "read", "produce_idem"]
_EXTEND = {"ack": None, "extend": "true", "nack": "0"}
_enc = msgspec.json.Encoder()
MAX_BATCH_ACK = 100
# The node's limits (narad.api.messages), checked here before anything is sent: a body far over
# them is cut off by the node mid-upload (it reads a few MiB at most after its 413), which the
# client could only report as a lost connection whose outcome is unknown.
MAX_MESSAGE = 1 << 20
MAX_BATCH_MESSAGES = 1000
MAX_BATCH_BODY = 16 << 20


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``max_attempts`` per call (1 = never retry), backoff ``base`` doubling to
    ``cap`` seconds with full jitter, ``deadline`` seconds for the whole call."""

    max_attempts: int = 5
    base: float = 0.05
    cap: float = 2.0
    deadline: float = 30.0
    node_cooldown: float = 1.0


def _q(value: str | bytes) -> str:
    return quote_from_bytes(value, safe="") if isinstance(value, bytes) else quote(value, safe="")


def _seg(name: str) -> str:
    return quote(name, safe="")


def encode_payload(payload: Any) -> tuple[bytes, str]:
    """(body, content type): bytes as they are, str as UTF-8 text, RawJSON verbatim,
    anything else encoded as JSON."""
    if isinstance(payload, RawJSON):
        return bytes(payload), "application/json"
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload), "application/octet-stream"
    if isinstance(payload, str):
        return payload.encode(), "application/octet-stream"
    return _enc.encode(payload), "application/json"


def go_duration(seconds: float) -> str:
    """`seconds` as whole milliseconds, rounded up (as the node reads a duration: a
    delay or lease is never shorter than asked; 0.4 ms is 1 ms, not 0). A negative or
    non-finite value is a ValueError (the caller's mistake, not a zero)."""
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a duration must be a finite number of seconds >= 0, got {seconds!r}")
    ns = round(seconds * 1_000_000_000)
    return f"{-(-ns // 1_000_000)}ms"


class AsyncClient:
    """An asyncio client for one Narad cluster (any node answers any call).

    ``nodes``: "host:port" strings (or one comma-separated string); calls go to the
    first that works and move on when one fails. ``auth``: (user, password) for
    HTTP Basic. ``http3=True`` sends over QUIC (``verify=False`` accepts the node's
    self-signed certificate). ``envelope=True`` wraps every produce in the Go SDK's
    envelope unless a call says otherwise.
    """

    def __init__(
        self,
        nodes: str | Sequence[str] = "127.0.0.1:7942",
        *,
        auth: tuple[str, str] | None = None,
        timeout: float = 10.0,
        connect_timeout: float = 3.0,
        retry: RetryPolicy | None = None,
        http3: bool = False,
        verify: bool | str | ssl.SSLContext = True,
        max_connections: int = 100,
        envelope: bool = False,
        client_name: str = "narad-python",
        transport: Transport | None = None,
    ) -> None:
        items = nodes.split(",") if isinstance(nodes, str) else list(nodes)
        self.nodes: list[NodeAddr] = [parse_node(n) for n in items if n.strip()]
        if not self.nodes:
            raise ValueError("no nodes given")
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.envelope = envelope
        self._headers = {"X-Narad-Client": f"{client_name}/{VERSION}", "User-Agent": f"narad-python/{VERSION}"}
        if auth is not None:
            user, pw = auth
            self._headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()
        if transport is not None:
            self._transport: Transport = transport
        elif http3:
            if isinstance(verify, ssl.SSLContext):  # aioquic takes no SSLContext: a silent fallback would hide it
                raise ValueError("http3=True takes verify as True, False or the path of a CA file, not an SSLContext")
            self._transport = H3Transport(verify=verify, connect_timeout=connect_timeout)
        else:
            self._transport = H1Transport(max_connections=max_connections, max_keepalive=max_connections,
                                          connect_timeout=connect_timeout, verify=verify)
        self._preferred = 0
        self._not_before = [0.0] * len(self.nodes)
        self._closed = False
        self._vt_cache: dict[str, float] = {}
        self._settled: dict[str, AckMode] = {}  # handles acked / nacked here, oldest first (bounded)

    # ---- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._transport.aclose()

    @property
    def current_node(self) -> str:
        """The node calls go to first (the last one that answered)."""
        return str(self.nodes[self._preferred])

    # ---- the request loop ----------------------------------------------------------------
    def _pick(self, now: float) -> tuple[int, float]:
        """(node index, seconds to wait first): the preferred node if it may be asked
        now, else the next one in order that may, else the one free soonest."""
        n = len(self.nodes)
        for k in range(n):
            i = (self._preferred + k) % n
            if self._not_before[i] <= now:
                return i, 0.0
        i = min(range(n), key=lambda j: self._not_before[j])
        return i, self._not_before[i] - now

    def _may_retry(self, kind: Kind, err: E.NaradError) -> bool:
        if isinstance(err, E.ConnectError):
            return True
        if kind in ("produce", "write"):
            return isinstance(err, E.Unavailable) and err.retryable
        if kind == "produce_idem":  # a repeat is dropped at its owner: asking again stores nothing twice
            return isinstance(err, E.TransportError) or (isinstance(err, E.ApiError) and err.status in
                                                         (421, 500, 502, 503, 504))
        status = err.status if isinstance(err, E.ApiError) else None
        if kind == "ack":
            return status in (421, 502, 503)
        # consume / read: nothing is changed by asking again
        return isinstance(err, E.TransportError) or status in (421, 502, 503, 504)

    async def _call(
        self,
        kind: Kind,
        method: str,
        path: str,
        *,
        query: Iterable[tuple[str, str | bytes]] = (),
        body: bytes = b"",
        content_type: str | None = None,
        timeout: float | None = None,
        deadline: float | None = None,
        op: str = "",
        extra_headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """Send with retries; returns the first non-error answer (status < 400)."""
        if self._closed:
            raise E.ClientClosed("client closed")
        qs = "&".join(f"{k}={_q(v)}" for k, v in query)
        target = path + ("?" + qs if qs else "")
        headers = dict(self._headers)
        if content_type is not None:
            headers["Content-Type"] = content_type
        if extra_headers:
            headers.update(extra_headers)
        pol = self.retry
        end = time.monotonic() + (deadline if deadline is not None else pol.deadline)
        per = timeout if timeout is not None else self.timeout
        last: E.NaradError | None = None
        uncertain = False
        loop_op = op or kind
        held = 0.0  # a 429's Retry-After: this call's own (a cap of one identity and kind, not the node's)
        for attempt in range(max(1, pol.max_attempts)):
            now = time.monotonic()
            i, wait = self._pick(now)
            wait = max(wait, held - now)
            if attempt > 0:
                # full jitter, never before the node said (Retry-After / cooldown)
                wait = max(wait, random.uniform(0, min(pol.cap, pol.base * (2 ** (attempt - 1)))))
            if now + wait >= end:
                break
            if wait > 0:
                await asyncio.sleep(wait)
            if self._closed:  # closed while this call waited to try again
                raise E.ClientClosed("client closed")
            remaining = end - time.monotonic()
            node = self.nodes[i]
            try:
                # An attempt never runs past the call's deadline (at most 50 ms, its floor).
                status, hdrs, data = await self._transport.request(node, method, target, headers, body,
                                                                   max(0.05, min(per, remaining)))
            except E.TransportError as err:
                if isinstance(err, E.ConnectError) and not isinstance(err, E.PoolTimeout):  # full pool: not the node
                    self._not_before[i] = time.monotonic() + pol.node_cooldown
                if kind in ("consume", "read"):
                    err.uncertain = False  # asking again changed nothing
                last = err
            else:
                if status < 400:
                    self._preferred = i
                    return status, hdrs, data
                err2 = E.error_from_response(status, hdrs, data, node=str(node), op=loop_op)
                if kind == "ack" and status in (502, 503):
                    err2.retryable = True
                if err2.retry_after is not None:
                    if status == 429:  # this identity's in-flight cap for this kind of call: not the node's
                        held = time.monotonic() + err2.retry_after
                    else:  # the node (draining, busy): every call waits
                        self._not_before[i] = time.monotonic() + err2.retry_after
                last = err2
            uncertain = uncertain or last.uncertain
            if not self._may_retry(kind, last):
                break
            if len(self.nodes) > 1:  # the next attempt goes to the next node
                self._preferred = (i + 1) % len(self.nodes)
        if last is None:
            raise E.DeadlineExceeded("the call's deadline passed before any attempt", last=None, attempts=0,
                                     uncertain=False)
        last.uncertain = last.uncertain or uncertain
        raise last

    async def _json(self, kind: Kind, method: str, path: str, payload: Any = None, **kw: Any) -> Any:
        body = b"" if payload is None else _enc.encode(payload)
        ct = "application/json" if payload is not None else None
        status, _h, data = await self._call(kind, method, path, body=body, content_type=ct, **kw)
        if status == 204 or not data:
            return None
        try:
            return msgspec.json.decode(data)
        except msgspec.DecodeError:  # not a node's answer (a proxy's page?)
            raise E.ServerError(f"HTTP {status} answer is not JSON: {data[:80]!r}", status=status) from None

    # ---- health ------------------------------------------------------------------------
    async def ready(self, node: str | None = None) -> bool:
        """True when ``node`` (default: the current one) answers /readyz 200."""
        addr = parse_node(node) if node else self.nodes[self._preferred]
        try:
            status, _h, _b = await self._transport.request(addr, "GET", "/readyz", dict(self._headers), b"",
                                                           self.timeout)
        except E.TransportError:
            return False
        return status == 200

    # ---- produce ---------------------------------------------------------------------------
    def _payload(self, payload: Any, envelope: bool | None, *, id: str | None, headers: dict[str, str] | None,
                 attempts: int = 1, last_error: str = "") -> tuple[bytes, str]:
        use = self.envelope if envelope is None else envelope
        if id is not None or headers:
            use = True
        body, ct = encode_payload(payload)
        if use:
            if ct != "application/json":
                raise ValueError("an envelope needs a JSON message (a dict, list, number, ... or RawJSON), "
                                 "not bytes or str")
            body, ct = wrap(body, id=id, headers=headers, attempts=attempts, last_error=last_error), ct
        if not body:
            raise ValueError("a message needs at least one byte")
        return body, ct

    async def produce(
        self,
        topic: str,
        payload: Any,
        *,
        key: str | bytes | None = None,
        partition: int | None = None,
        envelope: bool | None = None,
        id: str | None = None,
        headers: dict[str, str] | None = None,
        record_headers: dict[str, str] | None = None,
        trace_context: bool = True,
        deadline: float | None = None,
        idempotency_key: str | None = None,
    ) -> ProduceResult:
        """Store one message (returns after the node's fsync: its 202).

        ``record_headers``: headers stored with the record and returned on consume
        (``Message.headers``; an extension a Narad node refuses with 400). With
        ``trace_context`` (the default) and opentelemetry installed, the current
        span's context is added to them (``traceparent``), so a consumer can
        continue the trace (``Message.trace_context()``).

        ``payload``: bytes as they are, str as UTF-8, anything else as JSON.
        ``key`` chooses the partition by hash; ``partition`` pins it (wins over key).
        ``envelope``/``id``/``headers`` wrap it in the Go SDK envelope.
        Raises ``ServerError``/``RequestTimeout`` with ``uncertain=True`` when it may
        have been stored anyway (never retried then).
        ``idempotency_key`` (extension, 1 to 128 bytes of UTF-8): a repeat within the
        topic's window is not stored, on any node; the result's ``duplicate`` says
        which it was (None without a key, or ``pending``: the owner did not answer in
        time). With a key, the produce is retried like a consume."""
        body, ct = self._payload(payload, envelope, id=id, headers=headers)
        rh = inject_trace_context(record_headers) if trace_context else record_headers
        return await self._produce_raw(topic, body, ct, key=key, partition=partition, deadline=deadline,
                                       idempotency_key=idempotency_key, record_headers=rh)

    async def _produce_raw(self, topic: str, body: bytes, ct: str, *, key: str | bytes | None,
                           partition: int | None, deadline: float | None = None,
                           idempotency_key: str | None = None,
                           record_headers: dict[str, str] | None = None) -> ProduceResult:
        if len(body) > MAX_MESSAGE:
            raise E.PayloadTooLarge(f"message too large: {len(body)} bytes, over 1 MiB (nothing was sent)")
        query: list[tuple[str, str | bytes]] = []
        if key:
            query.append(("key", key))
        if partition is not None:
            query.append(("partition", str(partition)))
        for name, value in (record_headers or {}).items():
            if not name or ":" in name:  # the query form splits at the first ":": it would store another header
                raise E.BadRequest(f"invalid argument: header name {name[:40]!r} must be 1 to 128 characters of "
                                   f"A-Z a-z 0-9 . _ - (nothing was sent)")
            query.append(("header", f"{name}:{value}"))
        if idempotency_key is not None:
            query.append(("idempotency_key", idempotency_key))
        _s, _h, data = await self._call("produce_idem" if idempotency_key is not None else "produce", "POST",
                                        f"/v1/topics/{_seg(topic)}/produce", query=query, body=body,
                                        content_type=ct, deadline=deadline, op="produce")
        if not data:
            return ProduceResult()
        try:
            return ProduceResult.from_json(msgspec.json.decode(data))
        except (msgspec.DecodeError, TypeError, ValueError):  # a 2xx whose body is not ours: the message is stored
            return ProduceResult()

    async def produce_batch(
        self,
        topic: str,
        messages: Iterable[BatchMessage | Any],
        *,
        envelope: bool | None = None,
        trace_context: bool = True,
        deadline: float | None = None,
    ) -> BatchResult:
        """Store up to 1000 messages all or nothing (one WAL commit); returns the count
        accepted (a ``BatchResult``: an int with ``duplicates`` and ``pending`` for
        messages with an ``idempotency_key``; when every message has one, the batch is
        retried like a consume). Items are ``BatchMessage`` or bare payloads. A refused
        message names its index (``message 3: ...``) and nothing is stored.
        ``trace_context``: as for ``produce`` (added to every message's ``record_headers``)."""
        keyed = 0
        out: list[dict[str, Any]] = []
        trace = inject_trace_context(None) if trace_context else None
        for m in messages:
            bm = m if isinstance(m, BatchMessage) else BatchMessage(m)
            body, ct = self._payload(bm.payload, envelope, id=None, headers=None)
            row: dict[str, Any]
            if ct == "application/json":
                row = {"payload": msgspec.Raw(body)}
            else:
                row = {"payload": base64.b64encode(body).decode(), "payload_encoding": "base64"}
            if bm.key:
                if isinstance(bm.key, bytes):
                    row["key"] = base64.b64encode(bm.key).decode()
                    row["key_encoding"] = "base64"
                else:
                    row["key"] = bm.key
            if bm.partition is not None:
                row["partition"] = bm.partition
            rh = merge_trace(trace, bm.record_headers) if trace else bm.record_headers
            if rh:
                row["headers"] = rh
            if bm.idempotency_key is not None:
                row["idempotency_key"] = bm.idempotency_key
                keyed += 1
            out.append(row)
        if not out:
            raise ValueError("a batch needs at least one message")
        if len(out) > MAX_BATCH_MESSAGES:
            raise E.BadRequest(f"too many messages: {len(out)}, more than {MAX_BATCH_MESSAGES} (nothing was sent)")
        body = _enc.encode({"messages": out})
        if len(body) > MAX_BATCH_BODY:
            raise E.PayloadTooLarge(f"batch body too large: {len(body)} bytes, over 16 MiB (nothing was sent)")
        status, _h, data = await self._call("produce_idem" if keyed == len(out) else "produce", "POST",
                                            f"/v1/topics/{_seg(topic)}/produce/batch", body=body,
                                            content_type="application/json", deadline=deadline, op="produce")
        try:
            ans = msgspec.json.decode(data) if status != 204 and data else None
        except msgspec.DecodeError:  # accepted (2xx) with an answer that is not a node's: the count is ours
            ans = None
        ans = ans if isinstance(ans, dict) else {}
        dups = ans.get("duplicates")
        return BatchResult(int(ans.get("accepted", len(out))), dups if isinstance(dups, int) else 0,
                           int(ans.get("pending", 0) or 0))

    async def retry_later(self, msg: Message, error: BaseException | str | None, topic: str | None = None) -> None:
        """The Go SDK's ``Retry``: publish a fresh copy of an enveloped message with
        ``attempts`` raised and the error recorded (to ``topic``, e.g. the parent of a
        delay child; default its own topic), then ack the original. Publish first:
        a failure in between duplicates, it never loses the message."""
        env = msg.envelope()
        if env is None:
            raise ValueError("retry_later needs an enveloped message (produce with envelope=True)")
        reason = "" if error is None else str(error)
        body = wrap(env.body, id=env.id, attempts=env.attempts + 1, last_error=reason, headers=env.headers)
        await self._produce_raw(topic or msg.topic, body, "application/json", key=msg.key, partition=None,
                                record_headers=msg.headers or None)
        if msg.receipt_handle:
            await self.ack(msg.topic, msg.receipt_handle)

    # ---- consume -------------------------------------------------------------------------
    async def consume(self, topic: str, *, wait: float = 0.0, partition: int | None = None,
                      deadline: float | None = None, visibility: float | None = None) -> Message | None:
        """Lease the next message (None when nothing came within ``wait`` seconds, at
        most 10). Ack, extend or nack it with its ``receipt_handle``. ``visibility``
        (seconds, 1 to 43200; an extension a Narad node refuses with 400): this
        delivery's lease length instead of the topic's visibility timeout."""
        query: list[tuple[str, str | bytes]] = []
        if wait > 0:
            query.append(("wait", go_duration(wait)))
        if partition is not None:
            query.append(("partition", str(partition)))
        if visibility is not None:
            query.append(("visibility", go_duration(visibility)))
        status, _h, data = await self._call("consume", "GET", f"/v1/topics/{_seg(topic)}/consume", query=query,
                                            timeout=self.timeout + wait, deadline=_dl(deadline, wait, self))
        if status == 204 or not data:
            return None
        return Message.parse_one(data)

    async def consume_batch(self, topic: str, max: int, *, wait: float = 0.0, partition: int | None = None,
                            deadline: float | None = None, visibility: float | None = None) -> list[Message]:
        """Lease up to ``max`` (1-100) messages: whatever is ready; it waits (``wait``)
        only while nothing at all is. ``visibility``: as for ``consume``."""
        query: list[tuple[str, str | bytes]] = [("max", str(max))]
        if wait > 0:
            query.append(("wait", go_duration(wait)))
        if partition is not None:
            query.append(("partition", str(partition)))
        if visibility is not None:
            query.append(("visibility", go_duration(visibility)))
        status, _h, data = await self._call("consume", "GET", f"/v1/topics/{_seg(topic)}/consume", query=query,
                                            timeout=self.timeout + wait, deadline=_dl(deadline, wait, self))
        if status == 204 or not data:
            return []
        return Message.parse_batch(data)

    async def replay(self, topic: str, partition: int, offset: int, *, deadline: float | None = None) -> Message | None:
        """Read one stored record, no lease (None past the end; OffsetGone once aged out)."""
        query: list[tuple[str, str | bytes]] = [("partition", str(partition)), ("offset", str(offset))]
        status, _h, data = await self._call("read", "GET", f"/v1/topics/{_seg(topic)}/consume", query=query,
                                            op="replay", deadline=deadline)
        if status == 204 or not data:
            return None
        return Message.parse_one(data)

    # ---- ack / extend / nack ---------------------------------------------------------------
    async def _settle(self, topic: str, handle: str | Message, mode: AckMode,
                      extra: list[tuple[str, str | bytes]] | None = None) -> None:
        h = handle.receipt_handle if isinstance(handle, Message) else handle
        if not h:
            raise ValueError("no receipt handle (a replayed message has none)")
        query: list[tuple[str, str | bytes]] = [("receipt_handle", h)]
        ext = _EXTEND[mode]
        if ext is not None:
            query.append(("extend", ext))
        query += extra or []
        await self._call("ack", "POST", f"/v1/topics/{_seg(topic)}/ack", query=query, op="ack")
        if mode != "extend":
            self._note_settled(h, mode)

    def _note_settled(self, handle: str, mode: AckMode) -> None:
        """Handles this client acked or nacked (the last 10,000): a consumer loop asks
        (``settled_here``) so that a handler that settled its own message (``retry_later``,
        an explicit ack) is not acked again (a 410, reported as a lost lease)."""
        done = self._settled
        done[handle] = mode
        if len(done) > 10_000:
            del done[next(iter(done))]

    def settled_here(self, handle: str) -> AckMode | None:
        """"ack" / "nack" when this client settled `handle` (see ``_note_settled``)."""
        return self._settled.get(handle)

    async def ack(self, topic: str, handle: str | Message) -> None:
        """Settle: the message is never delivered again. LeaseGone (410) if the lease
        had already run out (it will be, or was, delivered again)."""
        await self._settle(topic, handle, "ack")

    async def extend(self, topic: str, handle: str | Message, *, visibility: float | None = None) -> None:
        """Restart the lease for a full visibility timeout from now, or (``visibility``,
        seconds, 1 to 43200; an extension a Narad node refuses with 400) for that long
        from now (shorter than what is left shortens it)."""
        extra = [("visibility", go_duration(visibility))] if visibility is not None else None
        await self._settle(topic, handle, "extend", extra)

    async def nack(self, topic: str, handle: str | Message, *, delay: float | None = None,
                   reason: str | None = None) -> None:
        """End the lease now: the message may be delivered again at once, or (``delay``,
        seconds, 0 to 43200; an extension a Narad node refuses with 400) not before that
        long. The delay lives in the owner's memory: after an owner restart or a
        partition move the message may come back at once. ``reason`` (at most 256
        bytes of UTF-8; an extension) is kept for the message's dead-letter copy, should
        this have been its last delivery (``max_deliveries``)."""
        extra: list[tuple[str, str | bytes]] = []
        if delay is not None:
            extra.append(("delay", go_duration(delay)))
        if reason is not None:
            extra.append(("reason", reason))
        await self._settle(topic, handle, "nack", extra)

    async def ack_batch(self, topic: str, handles: Sequence[str | Message], *, mode: AckMode = "ack",
                        deadline: float | None = None, delay: float | None = None,
                        visibility: float | None = None, reason: str | None = None) -> list[AckResult]:
        """Ack (extend, nack) many handles, 100 per request; one result per handle in
        order. Handles answered 502/503 are sent again (with backoff, within the
        deadline); what is still 502/503 at the end is returned as such. ``delay``
        (mode "nack") and ``visibility`` (mode "extend"): as for ``nack`` / ``extend``,
        for every handle."""
        hs = [h.receipt_handle if isinstance(h, Message) else h for h in handles]
        if any(not h for h in hs):
            raise ValueError("no receipt handle (a replayed message has none)")
        if delay is not None and mode != "nack":
            raise ValueError('delay applies to mode="nack" only')
        if visibility is not None and mode != "extend":
            raise ValueError('visibility applies to mode="extend" only')
        if reason is not None and mode != "nack":
            raise ValueError('reason applies to mode="nack" only')
        extra: dict[str, str] = {}
        if reason is not None:
            extra["reason"] = reason
        if delay is not None:
            extra["delay"] = go_duration(delay)
        if visibility is not None:
            extra["visibility"] = go_duration(visibility)
        results: dict[int, AckResult] = {}
        pol = self.retry
        end = time.monotonic() + (deadline if deadline is not None else pol.deadline)
        pending = list(range(len(hs)))
        attempt = 0
        while pending:
            for start in range(0, len(pending), MAX_BATCH_ACK):
                chunk = pending[start:start + MAX_BATCH_ACK]
                query: list[tuple[str, str | bytes]] = []
                ext = _EXTEND[mode]
                if ext is not None:
                    query.append(("extend", ext))
                ans = await self._json("ack", "POST", f"/v1/topics/{_seg(topic)}/ack",
                                       {"receipt_handles": [hs[i] for i in chunk], **extra}, query=query, op="ack",
                                       deadline=max(0.1, end - time.monotonic()))
                rows = (ans or {}).get("results", [])
                for i, row in zip(chunk, rows, strict=False):
                    results[i] = AckResult(hs[i], int(row.get("status", 0)), row.get("error"))
                for i in chunk[len(rows):]:  # a short answer (not a node's): those are unknown, sent again
                    results[i] = AckResult(hs[i], 503, "no result for this handle in the answer")
            pending = [i for i in pending if results[i].status in (502, 503)]
            attempt += 1
            if not pending or attempt >= pol.max_attempts:
                break
            pause = random.uniform(0, min(pol.cap, pol.base * (2 ** (attempt - 1))))
            if time.monotonic() + pause >= end:
                break
            await asyncio.sleep(pause)
        if mode != "extend":
            for i, r in results.items():
                if r.status == 204:
                    self._note_settled(hs[i], mode)
        return [results[i] for i in range(len(hs))]

    async def redrive(self, topic: str, *, max: int | None = None) -> RedriveResult:
        """Move up to ``max`` (1 to 10000; the server's default 1000) messages of the
        dead-letter topic ``topic`` back to their origin topics (an extension: a Narad
        node answers 404). At least once: a failure midway may leave a message both
        back in its origin and still in ``topic``, never in neither."""
        query: list[tuple[str, str | bytes]] = [("max", str(max))] if max is not None else []
        ans = await self._json("write", "POST", f"/v1/topics/{_seg(topic)}/redrive", query=query, op="redrive")
        return RedriveResult(int((ans or {}).get("redriven", 0)), int((ans or {}).get("skipped", 0)))

    # ---- topics ----------------------------------------------------------------------------
    async def create_topic(
        self,
        name: str,
        *,
        partitions: int | None = None,
        retention_ms: int | None = None,
        visibility_timeout_ms: int | None = None,
        max_in_flight_per_partition: int | None = None,
        max_acked_ahead_per_partition: int | None = None,
        schema: Any = None,
        parent: str | None = None,
        fanout_delay_ms: int | None = None,
        max_deliveries: int | None = None,
        dead_letter_topic: str | None = None,
        idempotency_window_ms: int | None = None,
    ) -> Topic:
        """Create a topic; with ``parent`` it is created and attached as a child in one
        step (``fanout_delay_ms`` makes it a delay child). ``retention_ms=0`` keeps
        forever; leave it out for the server's default. ``max_deliveries`` /
        ``dead_letter_topic`` / ``idempotency_window_ms`` are extensions (a Narad
        node refuses them with 400)."""
        body: dict[str, Any] = {"name": name}
        for k, v in (("partitions", partitions), ("retention_ms", retention_ms),
                     ("visibility_timeout_ms", visibility_timeout_ms),
                     ("max_in_flight_per_partition", max_in_flight_per_partition),
                     ("max_acked_ahead_per_partition", max_acked_ahead_per_partition), ("schema", schema),
                     ("parent", parent), ("fanout_delay_ms", fanout_delay_ms), ("max_deliveries", max_deliveries),
                     ("dead_letter_topic", dead_letter_topic), ("idempotency_window_ms", idempotency_window_ms)):
            if v is not None:
                body[k] = v
        return Topic.from_json(await self._json("write", "POST", "/v1/topics", body))

    async def describe_topic(self, name: str, *, partition: int | None = None) -> TopicDetails:
        query: list[tuple[str, str | bytes]] = [] if partition is None else [("partition", str(partition))]
        d = await self._json("read", "GET", f"/v1/topics/{_seg(name)}", query=query)
        return TopicDetails.from_json(d)

    async def list_topics(self, *, limit: int | None = None, page_token: str | None = None) -> TopicPage:
        """One page (name order). Pages may be short while ``next_page_token`` is set."""
        query: list[tuple[str, str | bytes]] = []
        if limit is not None:
            query.append(("limit", str(limit)))
        if page_token:
            query.append(("page_token", page_token))
        d = await self._json("read", "GET", "/v1/topics", query=query)
        return TopicPage([Topic.from_json(t) for t in d.get("topics") or []], str(d.get("next_page_token") or ""))

    async def iter_topics(self, *, page_size: int = 1000) -> AsyncIterator[Topic]:
        """Every topic the caller may see, page after page."""
        token: str | None = None
        while True:
            page = await self.list_topics(limit=page_size, page_token=token)
            for t in page.topics:
                yield t
            if not page.next_page_token:
                return
            token = page.next_page_token

    async def alter_topic(
        self,
        name: str,
        *,
        retention_ms: int | None = None,
        max_in_flight_per_partition: int | None = None,
        max_acked_ahead_per_partition: int | None = None,
        partitions: int | None = None,
        schema: Any = None,
        schema_base_version: int | None = None,
        max_deliveries: int | None = None,
        dead_letter_topic: str | None = None,
        idempotency_window_ms: int | None = None,
    ) -> Topic:
        """Change the named fields (applied in the order retention, caps, partitions,
        schema, delivery settings; not atomically). The visibility timeout is fixed
        at creation. ``dead_letter_topic=""`` clears it (``max_deliveries`` must be 0 then)."""
        body: dict[str, Any] = {}
        for k, v in (("retention_ms", retention_ms), ("max_in_flight_per_partition", max_in_flight_per_partition),
                     ("max_acked_ahead_per_partition", max_acked_ahead_per_partition),
                     ("partitions", partitions), ("schema", schema), ("schema_base_version", schema_base_version),
                     ("max_deliveries", max_deliveries), ("dead_letter_topic", dead_letter_topic),
                     ("idempotency_window_ms", idempotency_window_ms)):
            if v is not None:
                body[k] = v
        if not body:
            raise ValueError("alter_topic needs at least one field")
        self._vt_cache.pop(name, None)
        return Topic.from_json(await self._json("write", "PATCH", f"/v1/topics/{_seg(name)}", body))

    async def delete_topic(self, name: str) -> None:
        self._vt_cache.pop(name, None)
        await self._call("write", "DELETE", f"/v1/topics/{_seg(name)}")

    async def topic_schema(self, name: str) -> dict[str, Any]:
        """``{topic, version, versions: [{version, schema}]}``, oldest first."""
        return await self._json("read", "GET", f"/v1/topics/{_seg(name)}/schema")  # type: ignore[no-any-return]

    async def attach_child(self, parent: str, child: str, *, delay_ms: int | None = None) -> Topic:
        """Copy every message ``parent`` commits from now on into ``child`` (after
        ``delay_ms`` for a delay child). Returns the parent."""
        body: dict[str, Any] = {"child": child}
        if delay_ms is not None:
            body["delay_ms"] = delay_ms
        return Topic.from_json(await self._json("write", "POST", f"/v1/topics/{_seg(parent)}/children", body))

    async def list_children(self, parent: str) -> ChildList:
        return ChildList.from_json(await self._json("read", "GET", f"/v1/topics/{_seg(parent)}/children"))

    async def detach_child(self, parent: str, child: str) -> None:
        """The child becomes a standalone topic and keeps its messages."""
        await self._call("write", "DELETE", f"/v1/topics/{_seg(parent)}/children/{_seg(child)}")

    async def visibility_timeout(self, topic: str) -> float:
        """The topic's lease length in seconds (read once, then cached: it never changes)."""
        vt = self._vt_cache.get(topic)
        if vt is None:
            vt = (await self.describe_topic(topic, partition=0)).visibility_timeout_ms / 1000.0
            self._vt_cache[topic] = vt
        return vt

    # ---- users (admin) ---------------------------------------------------------------------
    async def create_user(self, username: str, password: str, grants: Sequence[Grant] = ()) -> User:
        body: dict[str, Any] = {"username": username, "password": password}
        if grants:
            body["grants"] = [g.to_json() for g in grants]
        return User.from_json(await self._json("write", "POST", "/v1/users", body))

    async def list_users(self) -> list[User]:
        return [User.from_json(u) for u in await self._json("read", "GET", "/v1/users") or []]

    async def get_user(self, username: str) -> User:
        return User.from_json(await self._json("read", "GET", f"/v1/users/{_seg(username)}"))

    async def delete_user(self, username: str) -> None:
        await self._call("write", "DELETE", f"/v1/users/{_seg(username)}")

    async def set_grants(self, username: str, grants: Sequence[Grant]) -> User:
        """Replace the user's grants (``[]`` removes all)."""
        body = {"grants": [g.to_json() for g in grants]}
        return User.from_json(await self._json("write", "PUT", f"/v1/users/{_seg(username)}/grants", body))

    async def set_password(self, username: str, new_password: str, *, current_password: str | None = None) -> None:
        """An admin sets anyone's; a user sets their own with ``current_password``."""
        body: dict[str, Any] = {"new_password": new_password}
        if current_password is not None:
            body["current_password"] = current_password
        await self._json("write", "PUT", f"/v1/users/{_seg(username)}/password", body)

    # ---- cluster (admin) -------------------------------------------------------------------
    async def members(self, *, detail: bool = False) -> list[dict[str, Any]]:
        """The members in id order (Narad's Member rows, as JSON). ``detail``: every
        member is asked for its own ``node_status`` (2 s in all; ``status_error`` when
        one does not answer)."""
        query: list[tuple[str, str | bytes]] = [("detail", "true")] if detail else []
        d = await self._json("read", "GET", "/v1/cluster/members", query=query)
        return list(d.get("members") or [])

    async def forget_member(self, id: str) -> dict[str, Any]:
        """Remove a Raft server that has no member record (``{id, voter}``)."""
        return await self._json("write", "POST", f"/v1/cluster/members/{_seg(id)}/forget")  # type: ignore[no-any-return]

    async def moves(self, *, detail: bool = False) -> list[dict[str, Any]]:
        """The partition moves in flight (Narad's Move rows: ``topic, partition, from,
        to, from_status, to_status``, ``blocked`` when it cannot go on). ``detail``:
        each destination is asked for its move runner (``worker``, or ``worker_error``)."""
        query: list[tuple[str, str | bytes]] = [("detail", "true")] if detail else []
        d = await self._json("read", "GET", "/v1/cluster/moves", query=query)
        return list(d.get("moves") or [])

    async def decommission(self, node_id: str, *, dry_run: bool = False) -> dict[str, Any] | None:
        """Mark a member draining: its partitions move off, then it leaves Raft (None).
        ``dry_run``: only say whether it would be accepted (``{member,
        would_decommission, reasons: [{code, message}], voter, owned_partitions,
        inbound_moves}``). A refusal raises Conflict with ``err.body["reasons"]``."""
        query: list[tuple[str, str | bytes]] = [("dry_run", "true")] if dry_run else []
        return await self._json("read" if dry_run else "write", "POST",  # type: ignore[no-any-return]
                                f"/v1/cluster/members/{_seg(node_id)}/decommission", query=query)

    async def cancel_decommission(self, node_id: str) -> None:
        """Stop a decommission (partitions already moved stay where they are)."""
        await self._call("write", "DELETE", f"/v1/cluster/members/{_seg(node_id)}/decommission")

    async def abort_move(self, topic: str, partition: int, *, target: str | None = None) -> dict[str, Any]:
        """Clear a partition's move target: it stays with its owner. ``target``: only
        if the move still goes there (compare-and-set). Returns ``{move, note}``."""
        query: list[tuple[str, str | bytes]] = [("target", target)] if target is not None else []
        return await self._json("write", "POST",  # type: ignore[no-any-return]
                                f"/v1/cluster/moves/{_seg(topic)}/{int(partition)}/abort", query=query)

    # ---- consumer loop ---------------------------------------------------------------------
    def consume_forever(
        self,
        topic: str,
        handler: Handler,
        *,
        concurrency: int = 1,
        batch: int | None = None,
        wait: float = 10.0,
        on_failure: Literal["nack", "lapse"] = "nack",
        renew_fraction: float = 0.5,
        visibility_timeout: float | None = None,
        drain_timeout: float = 30.0,
        retry_delay: float | None = None,
    ) -> Consumer:
        """A worker pool of ``concurrency`` handlers: ``await`` it to run until ``stop()``,
        or ``async for`` it to see each message's outcome. ``batch`` (default: the
        concurrency, at most 100) caps the messages leased per request. ``retry_delay``
        (seconds): a message whose handler raised is nacked with that delay, so it comes
        back not before it (an extension a Narad node refuses with 400). See
        narad.client.consumer.Consumer."""
        return Consumer(self, topic, handler, concurrency=concurrency, batch=batch, wait=wait,
                        on_failure=on_failure, renew_fraction=renew_fraction,
                        visibility_timeout=visibility_timeout, drain_timeout=drain_timeout,
                        retry_delay=retry_delay)


def _dl(deadline: float | None, wait: float, c: AsyncClient) -> float:
    return deadline if deadline is not None else c.retry.deadline + wait

