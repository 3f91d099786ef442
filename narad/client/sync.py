"""``Client``: the blocking face of ``AsyncClient`` for code without an event loop.

It owns one event loop on a daemon thread and runs each AsyncClient call there
(one connection pool, the same retry rules, the same consumer loop): a thin
wrapper, so the two can never disagree. Callable from any thread.

Imports narad.client.{client,consumer,models}, the standard library.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, Literal, TypeVar

from narad.client.client import AckMode, AsyncClient
from narad.client.consumer import Consumer, Handler
from narad.client.models import (
    AckResult,
    BatchResult,
    ChildList,
    Grant,
    Message,
    ProduceResult,
    RedriveResult,
    Topic,
    TopicDetails,
    TopicPage,
    User,
)

__all__ = ["Client"]

T = TypeVar("T")


class Client:
    """Same arguments as ``AsyncClient``; every method blocks until done."""

    def __init__(self, nodes: str | Sequence[str] = "127.0.0.1:7942", **kw: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="narad-client", daemon=True)
        self._thread.start()
        self._consumers: list[Consumer] = []

        async def make() -> AsyncClient:
            return AsyncClient(nodes, **kw)

        self.aio: AsyncClient = self._run(make())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._loop.is_running():
            coro.close()
            raise RuntimeError("client closed")
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except KeyboardInterrupt:
            fut.cancel()
            raise

    def close(self) -> None:
        if not self._loop.is_running():
            return
        for c in self._consumers:
            c.request_stop()
        self._run(self.aio.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def current_node(self) -> str:
        return self.aio.current_node

    # ---- messages -----------------------------------------------------------------------
    def produce(self, topic: str, payload: Any, **kw: Any) -> ProduceResult:
        return self._run(self.aio.produce(topic, payload, **kw))

    def produce_batch(self, topic: str, messages: Sequence[Any], **kw: Any) -> BatchResult:
        return self._run(self.aio.produce_batch(topic, messages, **kw))

    def consume(self, topic: str, **kw: Any) -> Message | None:
        return self._run(self.aio.consume(topic, **kw))

    def consume_batch(self, topic: str, max: int, **kw: Any) -> list[Message]:
        return self._run(self.aio.consume_batch(topic, max, **kw))

    def replay(self, topic: str, partition: int, offset: int, *, deadline: float | None = None) -> Message | None:
        return self._run(self.aio.replay(topic, partition, offset, deadline=deadline))

    def ack(self, topic: str, handle: str | Message) -> None:
        self._run(self.aio.ack(topic, handle))

    def extend(self, topic: str, handle: str | Message, *, visibility: float | None = None) -> None:
        self._run(self.aio.extend(topic, handle, visibility=visibility))

    def nack(self, topic: str, handle: str | Message, *, delay: float | None = None,
             reason: str | None = None) -> None:
        self._run(self.aio.nack(topic, handle, delay=delay, reason=reason))

    def ack_batch(self, topic: str, handles: Sequence[str | Message], *, mode: AckMode = "ack",
                  deadline: float | None = None, delay: float | None = None, visibility: float | None = None,
                  reason: str | None = None) -> list[AckResult]:
        return self._run(self.aio.ack_batch(topic, handles, mode=mode, deadline=deadline, delay=delay,
                                            visibility=visibility, reason=reason))

    def redrive(self, topic: str, *, max: int | None = None) -> RedriveResult:
        return self._run(self.aio.redrive(topic, max=max))

    def retry_later(self, msg: Message, error: BaseException | str | None, topic: str | None = None) -> None:
        self._run(self.aio.retry_later(msg, error, topic))

    # ---- topics ---------------------------------------------------------------------------
    def create_topic(self, name: str, **kw: Any) -> Topic:
        return self._run(self.aio.create_topic(name, **kw))

    def describe_topic(self, name: str, *, partition: int | None = None) -> TopicDetails:
        return self._run(self.aio.describe_topic(name, partition=partition))

    def list_topics(self, *, limit: int | None = None, page_token: str | None = None) -> TopicPage:
        return self._run(self.aio.list_topics(limit=limit, page_token=page_token))

    def iter_topics(self, *, page_size: int = 1000) -> Iterator[Topic]:
        token: str | None = None
        while True:
            page = self.list_topics(limit=page_size, page_token=token)
            yield from page.topics
            if not page.next_page_token:
                return
            token = page.next_page_token

    def alter_topic(self, name: str, **kw: Any) -> Topic:
        return self._run(self.aio.alter_topic(name, **kw))

    def delete_topic(self, name: str) -> None:
        self._run(self.aio.delete_topic(name))

    def topic_schema(self, name: str) -> dict[str, Any]:
        return self._run(self.aio.topic_schema(name))

    def attach_child(self, parent: str, child: str, *, delay_ms: int | None = None) -> Topic:
        return self._run(self.aio.attach_child(parent, child, delay_ms=delay_ms))

    def list_children(self, parent: str) -> ChildList:
        return self._run(self.aio.list_children(parent))

    def detach_child(self, parent: str, child: str) -> None:
        self._run(self.aio.detach_child(parent, child))

    # ---- users ------------------------------------------------------------------------------
    def create_user(self, username: str, password: str, grants: Sequence[Grant] = ()) -> User:
        return self._run(self.aio.create_user(username, password, grants))

    def list_users(self) -> list[User]:
        return self._run(self.aio.list_users())

    def get_user(self, username: str) -> User:
        return self._run(self.aio.get_user(username))

    def delete_user(self, username: str) -> None:
        self._run(self.aio.delete_user(username))

    def set_grants(self, username: str, grants: Sequence[Grant]) -> User:
        return self._run(self.aio.set_grants(username, grants))

    def set_password(self, username: str, new_password: str, *, current_password: str | None = None) -> None:
        self._run(self.aio.set_password(username, new_password, current_password=current_password))

    # ---- cluster (admin) ---------------------------------------------------------------------
    def ready(self, node: str | None = None) -> bool:
        return self._run(self.aio.ready(node))

    def visibility_timeout(self, topic: str) -> float:
        return self._run(self.aio.visibility_timeout(topic))

    def members(self, *, detail: bool = False) -> list[dict[str, Any]]:
        return self._run(self.aio.members(detail=detail))

    def forget_member(self, id: str) -> dict[str, Any]:
        return self._run(self.aio.forget_member(id))

    def moves(self, *, detail: bool = False) -> list[dict[str, Any]]:
        return self._run(self.aio.moves(detail=detail))

    def decommission(self, node_id: str, *, dry_run: bool = False) -> dict[str, Any] | None:
        return self._run(self.aio.decommission(node_id, dry_run=dry_run))

    def cancel_decommission(self, node_id: str) -> None:
        self._run(self.aio.cancel_decommission(node_id))

    def abort_move(self, topic: str, partition: int, *, target: str | None = None) -> dict[str, Any]:
        return self._run(self.aio.abort_move(topic, partition, target=target))

    # ---- consumer loop -----------------------------------------------------------------------
    def consume_forever(self, topic: str, handler: Handler, *, concurrency: int = 1,
                        on_failure: Literal["nack", "lapse"] = "nack", **kw: Any) -> None:
        """Run the worker pool until ``stop_consumers()`` (from another thread) or
        Ctrl-C. A plain function handler runs on a thread: it cannot be interrupted
        when its lease is lost, only its result discarded (no ack)."""

        async def make() -> Consumer:
            return self.aio.consume_forever(topic, handler, concurrency=concurrency, on_failure=on_failure, **kw)

        c = self._run(make())
        self._consumers.append(c)
        try:
            self._run(c._start())
        except KeyboardInterrupt:
            self._run(c.stop())
        finally:
            self._consumers.remove(c)

    def stop_consumers(self, drain_timeout: float | None = None) -> None:
        """Stop every running ``consume_forever`` (they drain, then return)."""
        for c in list(self._consumers):
            self._loop.call_soon_threadsafe(c.request_stop)
            if drain_timeout is not None:
                c.drain_timeout = drain_timeout
