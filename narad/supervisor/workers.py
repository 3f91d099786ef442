"""Worker lifecycle: spawn N workers through the fork server, pin worker i to
core i, restart a worker that dies (backoff 100 ms doubling to 5 s, reset
after 30 s of healthy running, each death logged with its exit status), and
stop them all on shutdown (SIGTERM, then SIGKILL after the grace).

After a worker dies the supervisor calls LMDB ``reader_check()`` so a reader
slot it held cannot pin old pages, and marks its metrics files dead.

Stuck processes (``check_stuck``, from the supervisor's heartbeat loop): a
worker whose heartbeat slot has not moved for the bound
(``node.worker_stuck_after``; 60 s at least until it first serves, since a
large ingress-WAL replay runs on its loop) is logged at error, counted in
``narad_worker_stuck_restarts_total``, SIGKILLed and restarted like any dead
worker. A fork server silent for the bound is killed the same way; its
silence counts from its start (a replacement stamps its slot only once it
serves), with ``FS_BOOT_STUCK_AFTER`` at least until it says "booted", so a
replacement stuck in boot is killed and replaced too. A worker pid is
SIGKILLed only while it still has the start time recorded when it was
spawned (a lost server's workers are not our children: the pid may be reused).

A lost fork server (killed, crashed, or killed as stuck) takes its workers
with it (parent-death signal). It is replaced by a fresh interpreter
(``ForkServer.replace``, never a fork of this threaded process) once the old
workers are gone, and every worker is forked again from the replacement
(backoff 100 ms doubling to 5 s between replacements). A replacement that
cannot be started (any exception) is logged at error and counted as a loss.
A server lost
``SERVER_LOSSES_FATAL`` times within ``SERVER_LOSS_WINDOW`` seconds stops
the node instead (``on_fatal``: exit code 1, systemd restarts it).
Imports narad.supervisor.forkserver, narad.meta.versions, narad.metrics, psutil.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from narad import metrics
from narad.meta import versions as V
from narad.supervisor.forkserver import ForkServer

log = logging.getLogger("narad.supervisor.workers")

BACKOFF_FIRST = 0.1
BACKOFF_MAX = 5.0
HEALTHY_AFTER = 30.0
STARTUP_STUCK_AFTER = 60.0  # least bound for a worker that has not served yet (WAL replay runs on its loop)
OLD_WORKERS_GONE_WITHIN = 5.0  # a lost server's workers: waited for, then SIGKILLed
SERVER_LOSSES_FATAL = 5
SERVER_LOSS_WINDOW = 60.0
FS_BOOT_STUCK_AFTER = 10.0  # least bound for a replacement fork server that has not said "booted"


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
    killing: bool = False  # SIGKILLed as stuck; its exit is on the way
    stuck_kills: int = 0
    created: float = 0.0  # the process's start time (psutil): a recycled pid is never killed
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
        heartbeats: V.Heartbeats | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.fs = forkserver
        self.hb = heartbeats
        self.on_fatal = on_fatal
        self.server_replacements = 0
        self._replacing = False
        self._server_backoff = BACKOFF_FIRST
        self._server_losses: deque[float] = deque()
        # The fork server's silence counts from its start (a replacement stamps
        # its slot only once it serves); one still booting gets fs_boot_bound.
        self._fs_started = time.monotonic()
        self._fs_booted = True
        self.fs_boot_bound = FS_BOOT_STUCK_AFTER
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
        if self.stopping or self._replacing or w.alive:
            return
        if self.hb is not None:
            self.hb.store(V.worker_slot(w.index), 0)  # a successor's silence counts from its spawn
        try:
            self.fs.spawn(w.index, w.core)
        except OSError as e:  # the server is gone; its replacement forks every worker
            log.warning("could not ask the fork server for a worker", extra={"index": w.index, "err": str(e)})

    def _on_message(self, msg: tuple[object, ...]) -> None:
        kind = msg[0]
        if kind == "spawned":
            index, pid = int(msg[1]), int(msg[2])  # type: ignore[call-overload]
            w = self.workers[index]
            w.pid, w.started, w.alive, w.serving = pid, time.monotonic(), True, False
            w.killing = False
            w.created = _create_time(pid)
            w.exited = asyncio.Event()
            self._by_pid[pid] = w
            metrics.get().workers_alive.set(sum(x.alive for x in self.workers))
            log.info("worker started", extra={"index": index, "pid": pid, "core": w.core})
        elif kind == "exited":
            pid, status = int(msg[1]), int(msg[2])  # type: ignore[call-overload]
            w = self._by_pid.pop(pid, None)
            if w is None:
                return
            self._mark_dead(w, pid, describe_status(status))
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
        elif kind == "booted":
            self._fs_booted = True
        elif kind == "server_exited":
            self.server_lost.set()
            if not self.stopping and not self._replacing:
                self._replacing = True
                task = asyncio.ensure_future(self._replace_server())
                self._restart_tasks.add(task)
                task.add_done_callback(self._restart_tasks.discard)

    def _mark_dead(self, w: WorkerState, pid: int, status: str) -> None:
        w.alive = w.serving = w.killing = False
        w.last_status = status
        w.exited.set()
        if self.hb is not None:
            self.hb.store(V.worker_slot(w.index), 0)
        metrics.get().workers_alive.set(sum(x.alive for x in self.workers))
        if self.on_exit is not None:
            self.on_exit(pid)

    async def _restart_later(self, w: WorkerState, delay: float) -> None:
        await asyncio.sleep(delay)
        self._spawn(w)

    # ---- stuck processes ------------------------------------------------------------
    def check_stuck(self, bound: float) -> None:
        """Kill (SIGKILL) a worker or the fork server whose heartbeat is older than
        `bound` seconds; the exit path restarts or replaces it."""
        if self.stopping or self.hb is None:
            return
        now = V.now_ms()
        for w in self.workers:
            if not w.alive or w.killing:
                continue
            last = max(self.hb.load(V.worker_slot(w.index)), int(w.started * 1000))
            silent = (now - last) / 1000.0
            if silent <= (bound if w.serving else max(bound, STARTUP_STUCK_AFTER)):
                continue
            w.killing = True
            w.stuck_kills += 1
            metrics.get().worker_stuck_restarts.inc()
            log.error("worker not responding (its event loop stopped turning); killing and restarting it",
                      extra={"index": w.index, "pid": w.pid, "silent_seconds": round(silent, 1),
                             "bound_seconds": bound})
            if _same_process(w.pid, w.created):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
        if self._replacing or not self.fs.pid:
            return
        fs_age = (now - max(self.hb.load(V.HB_FORKSERVER), int(self._fs_started * 1000))) / 1000.0
        fs_bound = bound if self._fs_booted else max(bound, self.fs_boot_bound)
        if fs_age > fs_bound:
            self._replacing = True  # until the kill's EOF arrives: one kill only
            metrics.get().forkserver_restarts.inc()
            log.error("fork server not responding; killing and replacing it",
                      extra={"pid": self.fs.pid, "silent_seconds": round(fs_age, 1), "bound_seconds": fs_bound,
                             "booting": not self._fs_booted})
            self.hb.store(V.HB_FORKSERVER, 0)
            try:
                os.kill(self.fs.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            task = asyncio.ensure_future(self._replace_server(counted=True))
            self._restart_tasks.add(task)
            task.add_done_callback(self._restart_tasks.discard)

    # ---- a lost fork server -----------------------------------------------------------
    async def _replace_server(self, counted: bool = False) -> None:
        """The fork server is gone (or being killed): account for its workers, wait
        until they are gone, start a replacement and fork every worker from it."""
        self._replacing = True
        old = self.fs.pid
        end = time.monotonic() + OLD_WORKERS_GONE_WITHIN
        status = self.fs.reap()
        while status is None and time.monotonic() < end:
            await asyncio.sleep(0.02)
            status = self.fs.reap()
        if status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old, signal.SIGKILL)
            await asyncio.sleep(0.05)
            status = self.fs.reap()
        if self.hb is not None:
            self.hb.store(V.HB_FORKSERVER, 0)
        if not counted:
            metrics.get().forkserver_restarts.inc()
        now = time.monotonic()
        self._server_losses.append(now)
        while self._server_losses and now - self._server_losses[0] > SERVER_LOSS_WINDOW:
            self._server_losses.popleft()
        lost = [(w, w.pid, w.created) for w in self.workers if w.alive]
        log.error("fork server lost; its workers died with it; replacing it", extra={
            "pid": old, "status": "unknown" if status is None else describe_status(status),
            "workers_lost": [pid for _, pid, _ in lost]})
        for t in list(self._restart_tasks):
            if t is not asyncio.current_task():
                t.cancel()
        for w, pid, _ in lost:
            self._by_pid.pop(pid, None)
            self._mark_dead(w, pid, "killed with the fork server")
            w.restarts += 1
            metrics.get().worker_restarts.inc()
        if len(self._server_losses) >= SERVER_LOSSES_FATAL:
            msg = (f"the fork server was lost {len(self._server_losses)} times within "
                   f"{SERVER_LOSS_WINDOW:.0f} s; stopping the node")
            log.error(msg)
            if self.on_fatal is not None:
                self.on_fatal(msg)
            return
        # The old workers die with their server (parent-death signal); their
        # successors must not open the same WAL and partition files before.
        end = time.monotonic() + OLD_WORKERS_GONE_WITHIN
        while any(not _pid_gone(pid) for _, pid, _ in lost) and time.monotonic() < end:
            await asyncio.sleep(0.02)
        for _, pid, created in lost:
            # Not our child (the lost server's): its pid may be recycled by now.
            if not _pid_gone(pid) and _same_process(pid, created):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        delay = self._server_backoff
        self._server_backoff = min(self._server_backoff * 2, BACKOFF_MAX)
        await asyncio.sleep(delay)
        if self.stopping:
            return
        self._fs_started, self._fs_booted = time.monotonic(), False
        try:
            self.fs.replace()
        except Exception as e:  # OSError, or a spec that cannot be passed on: counted as a loss, retried
            log.error("could not start a replacement fork server", exc_info=not isinstance(e, OSError),
                      extra={"err": f"{type(e).__name__}: {e}"})
            self._replacing = False
            self._on_message(("server_exited",))
            return
        self._fs_started = time.monotonic()
        self.server_replacements += 1
        self._replacing = False
        log.warning("fork server replaced", extra={"pid": self.fs.pid, "replacements": self.server_replacements})
        for w in self.workers:
            self._spawn(w)

    def note_healthy(self) -> None:
        """Reset the replacement backoff once the node ran healthy for a while."""
        if not self._replacing and self._server_losses and time.monotonic() - self._server_losses[-1] > HEALTHY_AFTER:
            self._server_backoff = BACKOFF_FIRST

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

    def heartbeat_ages(self) -> dict[str, float]:
        """Seconds since each process last stamped its heartbeat (never-stamped slots left out)."""
        out: dict[str, float] = {}
        if self.hb is None:
            return out
        now = V.now_ms()
        for name, slot in (("fork_server", V.HB_FORKSERVER), *((f"worker_{w.index}", V.worker_slot(w.index))
                                                               for w in self.workers if w.alive)):
            age = self.hb.age(slot, now)
            if age is not None:
                out[name] = age
        return out

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


def _create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def _same_process(pid: int, created: float) -> bool:
    """`pid` is still the process that started at `created` (not a recycled pid)."""
    return bool(created) and _create_time(pid) == created


def _pid_gone(pid: int) -> bool:
    """True once `pid` exited (a zombie counts: it holds no files)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2: stat.rfind(b")") + 3] in (b"Z", b"X")
