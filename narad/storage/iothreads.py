"""The storage I/O threads: their scheduling class (SCHED_BATCH, the WAL's syncer,
the broker's I/O pool and its commit lanes) and ``IOLanes``, the partition
commit's hand-off off the event loop.

A thread of that class does not preempt the running thread when it wakes, so an
fdatasync returning on a worker's I/O thread no longer throws the worker's event
loop off its core (it did about 2,400-4,900 times a second per worker under
single-message produce); the I/O thread runs as soon as the loop waits, or at the
next scheduler tick while the loop is busy, and keeps its fair share of the core.
Measured in docs/architecture.md ("I/O threads run SCHED_BATCH").

``IOLanes``: a few threads over one queue; a job is answered by an asyncio future
resolved with ``call_soon_threadsafe``. A ``run_in_executor`` round trip builds a
concurrent future, wraps it in an asyncio one and goes through the pool's
bookkeeping (measured in docs/architecture.md); the lanes skip all that, as the
WAL's syncer does.

Imports nothing from narad.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def batch_class() -> bool:
    """Put the calling thread in SCHED_BATCH (Linux; elsewhere a no-op). Returns
    whether it took."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        return False
    return True


def _resolve(fut: asyncio.Future[Any], res: Any, exc: BaseException | None) -> None:
    if fut.done():  # cancelled meanwhile: nobody waits for it
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(res)


class IOLanes:
    """``threads`` SCHED_BATCH threads sharing one queue (started at first use, daemons):
    ``run(loop, fn, *args)`` calls ``fn(*args)`` on one of them and returns an asyncio
    future resolved on the loop with its result or exception."""

    def __init__(self, threads: int, name: str) -> None:
        self.name = name
        self.threads = threads
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._running: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.closed = False

    def run(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        if self.closed:
            raise RuntimeError(f"{self.name}: closed")
        if len(self._running) < self.threads:
            self._start()
        fut: asyncio.Future[T] = loop.create_future()
        self._q.put((loop, fut, fn, args))
        return fut

    def _start(self) -> None:
        with self._lock:
            while len(self._running) < self.threads:
                t = threading.Thread(target=self._serve, name=f"{self.name}-{len(self._running)}", daemon=True)
                t.start()
                self._running.append(t)

    def _serve(self) -> None:
        batch_class()
        q = self._q
        while True:
            job = q.get()
            if job is None:
                return
            loop, fut, fn, args = job
            res: Any = None
            exc: BaseException | None = None
            try:
                res = fn(*args)
            except BaseException as e:  # answered on the loop
                exc = e
            job = args = None
            try:
                loop.call_soon_threadsafe(_resolve, fut, res, exc)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass
            fut = res = exc = None

    def stop(self, timeout: float = 5.0) -> None:
        """No more jobs; the threads finish what is queued, then end (joined up to `timeout`)."""
        self.closed = True
        with self._lock:
            running, self._running = self._running, []
        for _ in running:
            self._q.put(None)
        for t in running:
            if t is not threading.current_thread():
                t.join(timeout)
