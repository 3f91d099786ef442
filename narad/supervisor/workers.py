"""Worker lifecycle: spawn N workers through the fork server, pin worker i to
core i, restart a worker that dies (backoff 100 ms doubling to 5 s, reset
after 30 s of healthy running, each death logged with its exit status), and
stop them all on shutdown (SIGTERM, then SIGKILL after the grace).

After a worker dies the supervisor calls LMDB ``reader_check()`` so a reader
slot it held cannot pin old pages, and marks its metrics files dead.
Imports narad.supervisor.forkserver, narad.metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from narad import metrics
from narad.supervisor.forkserver import ForkServer

log = logging.getLogger("narad.supervisor.workers")

BACKOFF_FIRST = 0.1
BACKOFF_MAX = 5.0
HEALTHY_AFTER = 30.0


@dataclass
class WorkerState:
    index: int
    core: int | None
    pid: int = 0
    started: float = 0.0
    restarts: int = 0
    alive: bool = False
    serving: bool = False  # accepting client connections (the worker said so)
    backoff: float = BACKOFF_FIRST
    last_status: str = ""
    exited: asyncio.Event = field(default_factory=asyncio.Event)


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"killed by {name}"
    if os.WIFEXITED(status):
        return f"exit code {os.WEXITSTATUS(status)}"
    return f"status {status}"


class WorkerManager:
    def __init__(
        self,
        forkserver: ForkServer,
        count: int,
        cores: list[int | None],
        *,
        on_exit: Callable[[int], None] | None = None,
    ) -> None:
        self.fs = forkserver
        self.workers = [WorkerState(i, cores[i % len(cores)] if cores else None) for i in range(count)]
        self._by_pid: dict[int, WorkerState] = {}
        self.stopping = False
        self.on_exit = on_exit
        self._restart_tasks: set[asyncio.Task[None]] = set()
        fs_cb = self._on_message
        forkserver.on_message = fs_cb
        self.server_lost = asyncio.Event()

    def start_all(self) -> None:
        for w in self.workers:
            self._spawn(w)

    def _spawn(self, w: WorkerState) -> None:
        if self.stopping:
            return
        self.fs.spawn(w.index, w.core)

    def _on_message(self, msg: tuple[object, ...]) -> None:
        kind = msg[0]
        if kind == "spawned":
            index, pid = int(msg[1]), int(msg[2])  # type: ignore[call-overload]
            w = self.workers[index]
            w.pid, w.started, w.alive, w.serving = pid, time.monotonic(), True, False
            w.exited = asyncio.Event()
            self._by_pid[pid] = w
            metrics.get().workers_alive.set(sum(x.alive for x in self.workers))
            log.info("worker started", extra={"index": index, "pid": pid, "core": w.core})
        elif kind == "exited":
            pid, status = int(msg[1]), int(msg[2])  # type: ignore[call-overload]
            w = self._by_pid.pop(pid, None)
            if w is None:
                return
            w.alive = w.serving = False
            w.last_status = describe_status(status)
            w.exited.set()
            metrics.get().workers_alive.set(sum(x.alive for x in self.workers))
            if self.on_exit is not None:
                self.on_exit(pid)
            if self.stopping:
                log.info("worker stopped", extra={"index": w.index, "pid": pid, "status": w.last_status})
                return
            ran = time.monotonic() - w.started
            if ran >= HEALTHY_AFTER:
                w.backoff = BACKOFF_FIRST
            delay = w.backoff
            w.backoff = min(w.backoff * 2, BACKOFF_MAX)
            w.restarts += 1
            metrics.get().worker_restarts.inc()
            log.warning("worker died; restarting", extra={
                "index": w.index, "pid": pid, "status": w.last_status, "ran_seconds": round(ran, 3),
                "restart_in": delay})
            task = asyncio.ensure_future(self._restart_later(w, delay))
            self._restart_tasks.add(task)
            task.add_done_callback(self._restart_tasks.discard)
        elif kind == "server_exited":
            self.server_lost.set()

    async def _restart_later(self, w: WorkerState, delay: float) -> None:
        await asyncio.sleep(delay)
        self._spawn(w)

    def mark_serving(self, index: int, pid: int) -> None:
        if 0 <= index < len(self.workers) and self.workers[index].pid == pid and self.workers[index].alive:
            self.workers[index].serving = True

    @property
    def all_serving(self) -> bool:
        return all(w.serving for w in self.workers)

    async def wait_serving(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.all_serving:
                return True
            await asyncio.sleep(0.01)
        return self.all_serving

    async def wait_started(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(w.alive for w in self.workers):
                return True
            await asyncio.sleep(0.01)
        return all(w.alive for w in self.workers)

    async def stop_all(self, grace: float) -> None:
        """SIGTERM every worker (they drain), then SIGKILL what is left."""
        self.stopping = True
        for t in list(self._restart_tasks):
            t.cancel()
        live = [w for w in self.workers if w.alive]
        for w in live:
            try:
                os.kill(w.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            await asyncio.wait_for(asyncio.gather(*(w.exited.wait() for w in live)), grace + 2.0)
        except TimeoutError:
            for w in self.workers:
                if w.alive:
                    log.warning("worker did not stop in time; killing", extra={"index": w.index, "pid": w.pid})
                    try:
                        os.kill(w.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            try:
                await asyncio.wait_for(asyncio.gather(*(w.exited.wait() for w in live)), 3.0)
            except TimeoutError:
                pass
