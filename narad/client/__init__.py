"""narad.client: the Python SDK for Narad's HTTP API (nothing in the server imports it).

``AsyncClient`` (asyncio) and ``Client`` (blocking, a thin wrapper running the
async client on a thread of its own): produce, batch produce, consume (single,
batch, long poll), ack / extend / nack, batch ack, replay, topics and fan-out
children, users, the cluster's members, partition moves and decommission (admin);
a connection pool over HTTP/1.1 (httpx) or HTTP/3 (``http3=True``, narad.client.h3);
typed errors (narad.client.errors); retries only where Narad says they are safe,
over a list of nodes; the consumer loop
``consume_forever`` (narad.client.consumer); the Go SDK's envelope, opt-in
(narad.client.envelope). Guide: docs/sdk.md.

``narad.client.h3.H3Client`` stays the raw HTTP/3 helper the tests and load tests use.
"""

from narad.client.client import AckMode, AsyncClient, RetryPolicy
from narad.client.consumer import Consumer, Outcome
from narad.client.envelope import Envelope
from narad.client.errors import (
    ApiError,
    BadGateway,
    BadRequest,
    ClientClosed,
    Conflict,
    ConnectError,
    ConnectionLost,
    DeadlineExceeded,
    Forbidden,
    GatewayTimeout,
    Gone,
    InternalServerError,
    LeaseGone,
    Misdirected,
    NaradError,
    NotFound,
    OffsetGone,
    PayloadTooLarge,
    PoolTimeout,
    RequestTimeout,
    ServerError,
    TooManyRequests,
    TopicChanged,
    TransportError,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
)
from narad.client.models import (
    AckResult,
    BatchMessage,
    BatchResult,
    Child,
    ChildList,
    DeadLetterOrigin,
    Grant,
    Message,
    PartitionStats,
    ProduceResult,
    RawJSON,
    RedriveResult,
    Topic,
    TopicDetails,
    TopicPage,
    User,
)
from narad.client.sync import Client

__all__ = [
    "AckMode",
    "AckResult",
    "ApiError",
    "AsyncClient",
    "BadGateway",
    "BadRequest",
    "BatchMessage",
    "BatchResult",
    "Child",
    "ChildList",
    "Client",
    "ClientClosed",
    "Conflict",
    "ConnectError",
    "ConnectionLost",
    "Consumer",
    "DeadLetterOrigin",
    "DeadlineExceeded",
    "Envelope",
    "Forbidden",
    "GatewayTimeout",
    "Gone",
    "Grant",
    "InternalServerError",
    "LeaseGone",
    "Message",
    "Misdirected",
    "NaradError",
    "NotFound",
    "OffsetGone",
    "Outcome",
    "PartitionStats",
    "PayloadTooLarge",
    "PoolTimeout",
    "ProduceResult",
    "RawJSON",
    "RedriveResult",
    "RequestTimeout",
    "RetryPolicy",
    "ServerError",
    "TooManyRequests",
    "Topic",
    "TopicChanged",
    "TopicDetails",
    "TopicPage",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "UnsupportedMediaType",
    "User",
]
