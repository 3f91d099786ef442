"""The consumer loop: ``AsyncClient.consume_forever(topic, handler, concurrency=N)``.

Up to N handlers run at once. One fetch loop long-polls for as many messages as
there are free slots (``batch`` at most per request); one renewer extends every
held lease before it can run out (every ``renew_fraction`` of the visibility
timeout, one batch-extend request for all that are due: per-handle results),
so a slow handler keeps its message. A lease the node reports gone (410 on
extend), or one that could not be renewed before its estimated end, cancels its
handler: someone else may hold the message now. A handler that returns acks;
one that raises nacks (the message comes back at once; with ``retry_delay``,
not before that many seconds: a Narad-compatible extension) or, with
``on_failure="lapse"``, stops renewing and lets the lease run out.

``stop()`` (or ``request_stop()``) ends fetching at once (a parked long poll is
cancelled; the node gives its reservations back), lets in-flight handlers
finish within ``drain_timeout`` while their leases are still renewed, then
cancels the rest and nacks them.

Await the Consumer to run it (returns after stop; raises a fatal error such as
NotFound / Forbidden / Unauthorized), or ``async for outcome in consumer`` to run
it and see each message's Outcome.

Imports narad.client.{errors,models}, the standard library (AsyncClient imports this).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import narad.client.errors as E
from narad.client.models import AckResult, Message


class _Retry(Protocol):
    base: float
    cap: float


class ClientLike(Protocol):
    """What the loop uses of narad.client.client.AsyncClient (which imports this module)."""

    timeout: float

    @property
    def retry(self) -> _Retry: ...

    async def visibility_timeout(self, topic: str) -> float: ...

    async def consume(self, topic: str, *, wait: float = ..., visibility: float | None = ...) -> Message | None: ...

    async def consume_batch(self, topic: str, max: int, *, wait: float = ...,
                            visibility: float | None = ...) -> list[Message]: ...

    async def ack(self, topic: str, handle: str | Message) -> None: ...

    async def nack(self, topic: str, handle: str | Message, *, delay: float | None = ...) -> None: ...

    def settled_here(self, handle: str) -> Any: ...

    async def ack_batch(self, topic: str, handles: Sequence[str | Message], *, mode: Any = ...,
                        deadline: float | None = ..., visibility: float | None = ...) -> list[AckResult]: ...

__all__ = ["Consumer", "Handler", "Outcome"]

log = logging.getLogger("narad.client")

Handler = Callable[[Message], Awaitable[Any]] | Callable[[Message], Any]
Result = Literal["acked", "nacked", "lapsed", "lease_lost", "ack_failed", "abandoned"]
FATAL = (E.Unauthorized, E.Forbidden, E.NotFound, E.BadRequest, E.ClientClosed)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one message: ``acked``; ``nacked`` / ``lapsed`` (the handler
    raised ``error``); ``lease_lost`` (the handler was cancelled, or finished too
    late); ``ack_failed`` (handled, but the ack got no answer: it may come back);
    ``abandoned`` (still running at the drain deadline: cancelled and nacked)."""

    message: Message
    result: Result
    error: BaseException | None = None
    extends: int = 0


class _Lease:
    __slots__ = ("expires", "extends", "lost", "msg", "next_renew", "settling", "task")

    def __init__(self, msg: Message, now: float, vt: float, every: float) -> None:
        self.msg = msg
        self.expires = now + vt
        self.next_renew = now + every
        self.extends = 0
        self.lost = False
        self.settling = False  # the handler finished: never cancel it now
        self.task: asyncio.Task[None] | None = None


class Consumer:
    def __init__(self, client: ClientLike, topic: str, handler: Handler, *, concurrency: int = 1,
                 batch: int | None = None, wait: float = 10.0, on_failure: Literal["nack", "lapse"] = "nack",
                 renew_fraction: float = 0.5, visibility_timeout: float | None = None,
                 drain_timeout: float = 30.0, retry_delay: float | None = None) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if batch is None:
            batch = min(concurrency, 100)
        if not 1 <= batch <= 100:
            raise ValueError("batch must be from 1 to 100")
        if not 0 < renew_fraction < 1:
            raise ValueError("renew_fraction must be between 0 and 1")
        if on_failure not in ("nack", "lapse"):
            raise ValueError('on_failure is "nack" or "lapse"')
        if retry_delay is not None and not (0 <= retry_delay <= 43200 and on_failure == "nack"):
            raise ValueError('retry_delay is 0 to 43200 seconds, with on_failure="nack"')
        if visibility_timeout is not None and not 1 <= visibility_timeout <= 43200:
            raise ValueError("visibility_timeout is 1 to 43200 seconds")
        self.client = client
        self.topic = topic
        self.handler = handler
        self.concurrency = concurrency
        self.batch = batch
        self.wait = wait
        self.on_failure = on_failure
        self.retry_delay = retry_delay  # a failed message's nack holds it back this long (an extension)
        self.renew_fraction = renew_fraction
        self.drain_timeout = drain_timeout
        self._vt = visibility_timeout
        self._leases: dict[str, _Lease] = {}
        self._free = concurrency
        self._slot = asyncio.Event()  # a handler finished, or stop: the fetch loop looks again
        self._new = asyncio.Event()  # new leases, or a lease settled: the renewer looks again
        self._stop = asyncio.Event()
        self._abandoning = False
        self._closing = False
        self._outcomes: asyncio.Queue[Outcome | None] | None = None
        self._run_task: asyncio.Task[None] | None = None
        self.counts: dict[str, int] = {}

    # ---- public ---------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._leases)

    def request_stop(self) -> None:
        """Stop fetching; in-flight handlers drain (see ``drain_timeout``)."""
        self._stop.set()
        self._slot.set()

    async def stop(self, drain_timeout: float | None = None) -> None:
        """Stop and wait until drained (or the drain deadline passed)."""
        if drain_timeout is not None:
            self.drain_timeout = drain_timeout
        self.request_stop()
        t = self._run_task
        if t is not None:
            # the loop's own errors are its runner's to see, and a loop whose task was
            # cancelled has drained: either way stop() returns (a cancel of stop() itself
            # still propagates)
            try:
                await asyncio.shield(t)
            except asyncio.CancelledError:
                if not t.cancelled():
                    raise
            except Exception:
                pass

    def __await__(self) -> Generator[Any, None, None]:
        return self._start().__await__()

    async def _start(self) -> None:
        if self._run_task is None:
            self._run_task = asyncio.ensure_future(self._run())
        await self._run_task

    async def __aiter__(self) -> AsyncIterator[Outcome]:
        self._outcomes = asyncio.Queue()
        if self._run_task is None:
            self._run_task = asyncio.ensure_future(self._run())
        task = self._run_task
        task.add_done_callback(lambda _t: self._outcomes.put_nowait(None) if self._outcomes else None)
        try:
            while True:
                o = await self._outcomes.get()
                if o is None:
                    break
                yield o
            await task  # a fatal error surfaces here
        finally:
            if not task.done():  # the loop body broke out: stop and drain
                await self.stop()

    # ---- the loop -------------------------------------------------------------------
    async def _run(self) -> None:
        vt = self._vt if self._vt is not None else await self.client.visibility_timeout(self.topic)
        every = max(0.05, vt * self.renew_fraction)
        renewer = asyncio.ensure_future(self._renewer(vt, every))
        fatal: BaseException | None = None
        try:
            fatal = await self._fetch_loop(vt, every)
        finally:
            await self._drain()
            self._closing = True  # a flag, not cancel(): 3.11's wait_for can swallow a cancel
            self._new.set()
            await renewer
        if fatal is not None:
            raise fatal

    async def _sleep_or_stop(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop.wait()

    async def _fetch_loop(self, vt: float, every: float) -> BaseException | None:
        failures = 0
        while not self._stop.is_set():
            if self._free == 0:
                self._slot.clear()
                await self._slot.wait()
                continue
            k = min(self._free, self.batch)
            # visibility_timeout given: each lease is that long (the per-consume extension), not the topic's
            if self.batch == 1:
                fetch: asyncio.Future[Any] = asyncio.ensure_future(
                    self.client.consume(self.topic, wait=self.wait, visibility=self._vt))
            else:
                fetch = asyncio.ensure_future(
                    self.client.consume_batch(self.topic, k, wait=self.wait, visibility=self._vt))
            stopper = asyncio.ensure_future(self._stop.wait())
            try:
                await asyncio.wait([fetch, stopper], return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the loop's own task was cancelled: give the poll up too
                fetch.cancel()
                stopper.cancel()
                raise
            stopper.cancel()
            if not fetch.done():
                fetch.cancel()  # the node gives back what the cancelled poll reserved
                with contextlib.suppress(BaseException):
                    await fetch
                break
            try:
                got = fetch.result()
            except FATAL as e:
                return e
            except E.NaradError as e:
                failures += 1
                pol = self.client.retry
                pause = random.uniform(0, min(pol.cap * 2, pol.base * 2 ** min(failures, 10)))
                if isinstance(e, E.ApiError) and e.retry_after is not None:
                    pause = max(pause, e.retry_after)
                log.warning("consume from %s failed (%s); again in %.2fs", self.topic, e, pause)
                await self._sleep_or_stop(pause)
                continue
            failures = 0
            msgs: list[Message] = [] if got is None else got if isinstance(got, list) else [got]
            now = time.monotonic()
            for m in msgs:
                if m.receipt_handle is None:
                    continue
                lease = _Lease(m, now, vt, every)
                self._leases[m.receipt_handle] = lease
                self._free -= 1
                lease.task = asyncio.ensure_future(self._work(lease))
            if msgs:
                self._new.set()  # wake the renewer
        return None

    async def _drain(self) -> None:
        tasks = [lease.task for lease in self._leases.values() if lease.task is not None]
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=self.drain_timeout)
            if pending:
                self._abandoning = True
                for t in pending:
                    t.cancel()
                await asyncio.wait(pending, timeout=max(5.0, self.client.timeout))

    async def _renewer(self, vt: float, every: float) -> None:
        while not self._closing:
            now = time.monotonic()
            live = [le for le in self._leases.values() if not le.settling and not le.lost]
            due = [le for le in live if le.next_renew <= now]
            if due:
                await self._renew(due, vt, every)
                continue
            self._new.clear()
            nxt = min((le.next_renew for le in live), default=now + 3600.0)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, nxt - now)):
                    await self._new.wait()

    async def _renew(self, due: list[_Lease], vt: float, every: float) -> None:
        sent = time.monotonic()
        soonest = min(le.expires for le in due)
        try:
            results = await self.client.ack_batch(self.topic, [le.msg for le in due], mode="extend",
                                                  deadline=max(0.1, soonest - sent), visibility=self._vt)
        except E.NaradError as e:
            log.warning("extending %d leases on %s failed: %s", len(due), self.topic, e)
            results = None
        now = time.monotonic()
        for i, le in enumerate(due):
            status = results[i].status if results is not None else 0
            if status == 204:
                le.expires = sent + vt
                le.next_renew = sent + every
                le.extends += 1
            elif status == 410 or status == 400 or now >= le.expires:
                self._lose(le)
            else:  # 502/503 or no answer: again soon, while the lease may still hold
                le.next_renew = now + min(0.2, max(0.02, (le.expires - now) / 4))

    def _lose(self, le: _Lease) -> None:
        if le.settling or le.lost:
            return
        le.lost = True
        log.warning("lease of %s %s lost; cancelling its handler", self.topic, le.msg.receipt_handle)
        if le.task is not None:
            le.task.cancel()

    def _emit(self, o: Outcome) -> None:
        self.counts[o.result] = self.counts.get(o.result, 0) + 1
        if self._outcomes is not None:
            self._outcomes.put_nowait(o)

    async def _call_handler(self, msg: Message) -> None:
        if inspect.iscoroutinefunction(self.handler):
            await self.handler(msg)
            return
        r = await asyncio.to_thread(self.handler, msg)  # a sync handler: runs on a thread
        if inspect.isawaitable(r):
            await r

    async def _work(self, le: _Lease) -> None:
        msg = le.msg
        handle = msg.receipt_handle
        assert handle is not None
        outcome: Outcome
        try:
            try:
                await self._call_handler(msg)
            except asyncio.CancelledError:
                if le.lost:
                    outcome = Outcome(msg, "lease_lost", None, le.extends)
                elif self._abandoning:
                    le.settling = True
                    with contextlib.suppress(E.NaradError):
                        await self.client.nack(self.topic, handle)
                    outcome = Outcome(msg, "abandoned", None, le.extends)
                else:
                    raise
            except Exception as err:
                le.settling = True
                if le.lost:
                    outcome = Outcome(msg, "lease_lost", err, le.extends)
                elif self.on_failure == "lapse":
                    outcome = Outcome(msg, "lapsed", err, le.extends)
                else:
                    try:
                        if self.retry_delay is None:
                            await self.client.nack(self.topic, handle)
                        else:
                            await self.client.nack(self.topic, handle, delay=self.retry_delay)
                        outcome = Outcome(msg, "nacked", err, le.extends)
                    except E.NaradError as e2:
                        log.warning("nack of %s %s failed: %s", self.topic, handle, e2)
                        outcome = Outcome(msg, "lapsed", err, le.extends)
            else:
                le.settling = True
                own = self.client.settled_here(handle)  # the handler settled it itself (retry_later, ack, nack)
                if own is not None:
                    outcome = Outcome(msg, "acked" if own == "ack" else "nacked", None, le.extends)
                elif le.lost:
                    outcome = Outcome(msg, "lease_lost", None, le.extends)
                else:
                    try:
                        await self.client.ack(self.topic, handle)
                        outcome = Outcome(msg, "acked", None, le.extends)
                    except E.LeaseGone as e:
                        outcome = Outcome(msg, "lease_lost", e, le.extends)
                    except E.NaradError as e:
                        outcome = Outcome(msg, "ack_failed", e, le.extends)
            self._emit(outcome)
        finally:
            self._leases.pop(handle, None)
            self._free += 1
            self._slot.set()
            self._new.set()
