"""The bounded schema-validation capacity of one worker.

A worker is pinned to one core, so it gets one validation slot (Narad: one
concurrent validation per CPU core): one thread, fed by a semaphore. A payload
that is small, for a schema that is cheap, is validated inline on the event
loop with a small step allowance (narad.meta.schemas.INLINE_STEPS; a batch
yields to the loop between messages); anything else, or anything that runs out
of that allowance, waits up to WAIT_S for the slot, else 503 ``schema:
validation capacity busy, retry``. On the thread a validation runs under its
step budget and a wall-clock deadline of DEADLINE_PER_MIB_S per MiB validated
(at least DEADLINE_S; past it: the same 503). The budget is calibrated to end a
too-costly validation (400) well before that: at most ~5-8 us of CPU per step
on a loaded 2-core machine, one step per payload byte, so the deadline only
answers for an overloaded machine or a canceled request.

The thread holds the GIL while it runs pure-Python jsonschema; the event loop
still gets the interpreter every switch interval (5 ms), so it keeps turning
(slower) and the step budget bounds how long. Measured on a real node with one
worker: GET /readyz answered in 0.3 ms median idle, 6 ms median (p95 10 ms)
while a validation ran on the thread. A canceled request sets the
budget's cancel flag; the slot is given back only when the thread has stopped.

Compiled validators (``validator``) are built on the same thread: the static
cost analysis of a large schema takes seconds, so it never runs on the event
loop (the node would report not-ready). Concurrent first produces of one
schema version share one build; each waits for it at most WAIT_S, else the
same 503 (the build goes on; a retry finds it done).

Test seam: NARAD_FAULT_SCHEMA_HOLD_MS keeps the slot that much longer after
each validation on the thread (to make the capacity busy on purpose).

Imports narad.meta.schemas and narad.errors only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from narad import metrics
from narad.errors import SchemaValidationBusy
from narad.meta.schemas import NeedsCapacity, OutOfTime, PayloadValidator

WAIT_S = 5.0
DEADLINE_S = 10.0  # at least this ...
DEADLINE_PER_MIB_S = 20.0  # ... and this per MiB of payload in the job
# jsonschema needs ~5 Python frames per document level and a schema's own
# in-place nesting on top: 256 levels need more than the default 1000.
RECURSION_LIMIT = 6000
THREAD_STACK = 64 << 20
MAX_VALIDATORS = 1000  # compiled validators kept per worker (then the cache starts afresh)


def _hold_s() -> float:
    try:
        return max(0.0, int(os.environ.get("NARAD_FAULT_SCHEMA_HOLD_MS", "0") or 0) / 1000)
    except ValueError:
        return 0.0


def _reason(why: str) -> str:
    """The `reason` label of narad_schema_rejections_total for a 400 from a check."""
    if "nests" in why:
        return "depth"
    if "not a single JSON text" in why:
        return "malformed"
    return "invalid"


class ValidationCapacity:
    def __init__(self, slots: int = 1) -> None:
        self.slots = slots
        self._sem: asyncio.Semaphore | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._hold = _hold_s()
        self.in_flight = 0
        self._built: dict[Hashable, PayloadValidator] = {}
        self._builds: dict[Hashable, asyncio.Future[PayloadValidator]] = {}

    def _start(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            if sys.getrecursionlimit() < RECURSION_LIMIT:
                sys.setrecursionlimit(RECURSION_LIMIT)
            old = threading.stack_size(THREAD_STACK)
            try:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.slots, thread_name_prefix="narad-schema")
                # threads start on demand: start them now, while the stack size is set
                list(self._pool.map(lambda _: None, range(self.slots)))
            finally:
                threading.stack_size(old)
        return self._pool

    def cached(self, key: Hashable) -> PayloadValidator | None:
        return self._built.get(key)

    async def validator(self, key: Hashable, make: Callable[[], PayloadValidator]) -> PayloadValidator:
        """The compiled validator for ``key``, built once by ``make`` on the slot's
        thread; raises SchemaValidationBusy if it is not ready within WAIT_S."""
        v = self._built.get(key)
        if v is not None:
            return v
        fut = self._builds.get(key)
        if fut is None:
            fut = self._builds[key] = asyncio.ensure_future(self._build(key, make))
            fut.add_done_callback(_retrieve)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), WAIT_S)
        except TimeoutError:
            raise SchemaValidationBusy() from None

    async def _build(self, key: Hashable, make: Callable[[], PayloadValidator]) -> PayloadValidator:
        try:
            cf = await self._submit(make)
            v: PayloadValidator = await asyncio.wrap_future(cf)
            if len(self._built) >= MAX_VALIDATORS:
                self._built.clear()
            self._built[key] = v
            return v
        finally:
            self._builds.pop(key, None)

    async def _submit(self, job: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``job`` on the slot (waiting at most WAIT_S for it, else busy); the
        slot is given back when the thread has finished the job."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.slots)
        sem = self._sem
        try:
            await asyncio.wait_for(sem.acquire(), WAIT_S)
        except TimeoutError:
            raise SchemaValidationBusy() from None
        loop = asyncio.get_running_loop()
        try:
            cf = self._start().submit(job)
        except BaseException:
            sem.release()
            raise
        self.in_flight += 1
        metrics.get().schema_in_flight.set(self.in_flight)

        def give_back() -> None:
            self.in_flight -= 1
            metrics.get().schema_in_flight.set(self.in_flight)
            sem.release()

        def done(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed (worker stopping)
                loop.call_soon_threadsafe(give_back)

        cf.add_done_callback(done)
        return cf

    async def check(self, v: PayloadValidator, payload: bytes) -> str | None:
        """None if the payload is valid, else the 400 reason; raises SchemaValidationBusy."""
        res = await self.check_many(v, [payload])
        return None if res is None else res[1]

    async def check_many(self, v: PayloadValidator, payloads: list[bytes]) -> tuple[int, str] | None:
        """The first invalid payload (index, reason), or None; counted in the
        narad_schema_* metrics (seconds per check, rejections by reason)."""
        m = metrics.get()
        t0 = time.monotonic()
        try:
            res = await self._check_many(v, payloads)
        except SchemaValidationBusy:
            m.schema_rejections.labels("busy").inc()
            raise
        except asyncio.CancelledError:
            m.schema_rejections.labels("canceled").inc()
            raise
        m.schema_seconds.observe(time.monotonic() - t0)
        if res is not None:
            m.schema_rejections.labels(_reason(res[1])).inc()
        return res

    async def _check_many(self, v: PayloadValidator, payloads: list[bytes]) -> tuple[int, str] | None:
        """Inline while the request's allowance lasts, then the rest in one job on the slot."""
        start = len(payloads)
        for i, p in enumerate(payloads):
            if not v.inline_ok(p):
                start = i
                break
            try:
                why = v.check(p, inline=True)
            except NeedsCapacity:
                start = i
                break
            if why is not None:
                return i, why
            if i + 1 < len(payloads):
                await asyncio.sleep(0)  # let the loop turn between messages of a batch
        if start == len(payloads):
            return None
        return await self._on_slot(v, payloads, start)

    async def _on_slot(self, v: PayloadValidator, payloads: list[bytes], start: int) -> tuple[int, str] | None:
        cancel = threading.Event()
        total = sum(len(p) for p in payloads[start:])

        def job() -> tuple[int, str] | OutOfTime | None:
            try:
                deadline = time.monotonic() + max(DEADLINE_S, DEADLINE_PER_MIB_S * total / (1 << 20))
                for i in range(start, len(payloads)):
                    why = v.check(payloads[i], inline=False, deadline=deadline, cancel=cancel)
                    if why is not None:
                        return i, why
                return None
            except OutOfTime as e:
                return e
            finally:
                if self._hold:
                    time.sleep(self._hold)

        cf = await self._submit(job)
        try:
            res = await asyncio.wrap_future(cf)
        except asyncio.CancelledError:
            cancel.set()  # the thread stops at its next budget check
            raise
        if isinstance(res, OutOfTime):
            raise SchemaValidationBusy()
        return res


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """A build whose waiters all gave up: its outcome is not an unretrieved error."""
    if not fut.cancelled():
        fut.exception()
