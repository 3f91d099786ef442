"""Commit rounds: a worker's partition commits, grouped so that one sync covers several logs.

One SCHED_BATCH thread per worker runs rounds one after another. A round takes every
commit queued since the previous round began (each for a different partition log: a
partition has at most one commit in flight), writes each log's frame (``stage_commit``,
under that log's ``io_lock``), makes them all durable at once, then reads each frame
back (``finish_commit``). The futures of a round are answered in one hand-off per event
loop. Commits that arrive while a round runs form the next one, as the WAL's group
commit does for the ingress log.

The sync: one ``fdatasync`` when the round holds one log (or the logs are not all on
the data directory's filesystem); ``syncfs`` on a descriptor of the data directory when
it holds several. On this VM a round of six logs takes less than half the wall time and
about two thirds of the machine's CPU with one ``syncfs`` than with six ``fdatasync``
calls (one journal commit and one device flush instead of six;
loadtest/bench_commit_rounds.py, figures in docs/architecture.md).

Why a ``syncfs`` is as strong as an ``fdatasync`` of each log here: it writes back and
waits for every dirty page of the filesystem (pages already under writeback included),
commits the journal and flushes the device; and on Linux >= 5.8, on ext4, xfs or btrfs
(``fileio.syncfs_reports_errors``; not overlayfs, whose syncfs misses the upper
filesystem's errors), it reports any writeback error recorded on the filesystem since
the last ``syncfs`` through the same open file. Anywhere else the rounds use one
``fdatasync`` per log. Rounds run one at a time on one thread with one such
descriptor, so every error after the previous round's check is reported to the next
round: a page of this round was written after that check, so its failure cannot have
been taken by an earlier round. The descriptor's cursor is moved past older errors at
start and after a round whose ``fdatasync`` failed (that error is the superblock's too),
so an error already dealt with does not fail a later round. What it costs: a new error
on any file of that filesystem fails the round, and every log in it is poisoned until
reopened, as after a failed ``fdatasync`` (put the data directory on its own
filesystem); a round waits for every dirty page of the filesystem, another program's
included.

Whatever goes wrong in a round, every lock it took is released, every commit and job
is answered, and a commit answered with an error left no frame behind (its frame is
cut; if the cut fails, the log is poisoned); the thread does not die.

Plain jobs (``run``) execute on the same thread between rounds.

Imports narad.storage.{fileio,frames,iothreads,partition_log}.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from narad.storage import fileio
from narad.storage import frames as FR
from narad.storage.iothreads import batch_class
from narad.storage.partition_log import PartitionLog, Staged

log = logging.getLogger("narad.storage.commit_rounds")
T = TypeVar("T")
Done = tuple[asyncio.Future[Any], Any, BaseException | None]
Commit = tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], PartitionLog, list[bytes] | FR.Laid]
Job = tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[..., Any], tuple[Any, ...]]
_COMMIT, _JOB = 0, 1  # what a queued item is


def _answer(done: list[Done]) -> None:
    for fut, res, exc in done:
        if fut.done():  # cancelled meanwhile: nobody waits for it
            continue
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(res)


class CommitRounds:
    """Partition commits of one worker, grouped into rounds (module docstring).
    ``sync_dir``: the data directory; ``group_sync`` False keeps one fdatasync per log."""

    def __init__(self, name: str, sync_dir: str | os.PathLike[str], *, group_sync: bool = True) -> None:
        self.name = name
        self.sync_dir = Path(sync_dir)
        self.group_sync = group_sync  # and, at start, where syncfs reports write errors (``_admit``)
        self._sync_fd = -1
        self._sync_dev = -1
        # The loop side puts each commit and job on ``_queue`` (a C queue: its put is a few
        # hundred instructions, where a Condition's notify runs Python, measured 6k a call);
        # the thread blocks on it and takes everything queued for a round. ``_lock`` makes a
        # put and ``stop`` exclusive: nothing is queued after the stop's mark (None).
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.closed = False
        # Read by metrics and benchmarks: rounds run, commits they carried, syncfs calls.
        self.rounds = 0
        self.commits = 0
        self.group_syncs = 0

    # ---- event-loop side ------------------------------------------------------------
    def commit(self, loop: asyncio.AbstractEventLoop, plog: PartitionLog, records: list[bytes] | FR.Laid
               ) -> asyncio.Future[tuple[Any, ...]]:
        """``plog.write_commit(records)`` in the next round: an asyncio future with its result."""
        fut: asyncio.Future[tuple[Any, ...]] = loop.create_future()
        with self._lock:
            if self._thread is None or self.closed:
                self._admit()
            self._queue.put((_COMMIT, (loop, fut, plog, records)))
        return fut

    def run(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """``fn(*args)`` on the round thread (between rounds): an asyncio future."""
        fut: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._thread is None or self.closed:
                self._admit()
            self._queue.put((_JOB, (loop, fut, fn, args)))
        return fut

    def _admit(self) -> None:
        if self.closed:
            raise RuntimeError(f"{self.name}: closed")
        if self._thread is None:
            if self.group_sync:
                ok, why = fileio.syncfs_reports_errors(self.sync_dir)
                if ok:
                    try:
                        self._sync_fd = os.open(self.sync_dir, os.O_RDONLY | os.O_DIRECTORY)
                        self._sync_dev = os.fstat(self._sync_fd).st_dev
                    except OSError as e:
                        self._sync_fd, self._sync_dev, ok, why = -1, -1, False, str(e)
                if not ok:
                    self.group_sync = False
                    log.info("commit rounds sync each log with fdatasync", extra={"why": why})
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """No more work; what is queued runs, then the thread ends (joined up to `timeout`)."""
        with self._lock:
            if not self.closed and self._thread is not None:
                self._queue.put(None)  # (the thread ends once what is queued before it is done)
            self.closed = True
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        if self._sync_fd >= 0 and (t is None or not t.is_alive()):
            os.close(self._sync_fd)
            self._sync_fd = -1

    # ---- the round thread -------------------------------------------------------------
    def _advance_cursor(self, why: str) -> None:
        """A syncfs whose result is set aside: moves this descriptor's error cursor past
        errors already dealt with (at start: errors nobody saw yet; after a round whose
        fdatasync failed: that error, which the superblock records too), so they do not
        fail a later round of innocent logs. Rounds are serial: no frame of a later round
        is written yet."""
        if self._sync_fd < 0:
            return
        try:
            fileio.syncfs(self._sync_fd)
        except OSError as e:
            log.warning("syncfs reported an earlier write error on the data directory's filesystem",
                        extra={"when": why, "err": str(e)})

    def _serve(self) -> None:
        # A diagnostic (loadtest/bench.py --cprofile sets it for the workers): this thread
        # under cProfile too, its stats written beside the worker's as <prefix>.rounds.<pid>.
        prefix = os.environ.get("NARAD_WORKER_CPROFILE")
        if not prefix:
            self._serve_rounds()
            return
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        try:
            self._serve_rounds()
        finally:
            prof.disable()
            with contextlib.suppress(OSError):
                prof.dump_stats(f"{prefix}.rounds.{os.getpid()}")

    def _serve_rounds(self) -> None:
        batch_class()
        self._advance_cursor("start")
        q = self._queue
        carry: list[Commit] = []  # commits put off to the next round (a second one for a log)
        stopping = False
        while True:
            if not carry:
                if stopping:
                    return  # stopped and drained
                got = [q.get()]  # (blocks until there is work, or the stop's mark)
            else:
                got = []
            for _ in range(q.qsize()):  # and everything else queued now: one round
                got.append(q.get_nowait())
            commits: list[Commit] = carry
            jobs: list[Job] = []
            for item in got:
                if item is None:
                    stopping = True
                elif item[0] == _COMMIT:
                    commits.append(item[1])
                else:
                    jobs.append(item[1])
            carry = []
            if not commits and not jobs:
                continue
            done: dict[asyncio.AbstractEventLoop, list[Done]] = {}
            try:
                for loop, fut, fn, args in jobs:
                    try:
                        done.setdefault(loop, []).append((fut, fn(*args), None))
                    except BaseException as e:  # answered on the loop
                        done.setdefault(loop, []).append((fut, None, e))
                if commits:
                    carry = self._round(commits, done)
            except BaseException as e:  # a bug: never leave a commit or a job unanswered
                log.exception("commit round failed", extra={"rounds": self.name})
                answered = {id(f) for answers in done.values() for f, _, _ in answers}
                err = OSError(5, f"commit round failed: {e!r}")
                for loop, fut, *_ in [*commits, *jobs]:
                    if id(fut) not in answered:
                        done.setdefault(loop, []).append((fut, None, err))
                carry = []
            for loop, answers in done.items():
                try:
                    loop.call_soon_threadsafe(_answer, answers)
                except RuntimeError:  # the loop is closed: nobody waits any more
                    pass
            del commits, jobs, done

    def _round(self, commits: list[Commit], done: dict[asyncio.AbstractEventLoop, list[Done]]) -> list[Commit]:
        """One round: stage, sync, finish. Returns the commits put off to the next round
        (a second commit for a log already in this one: never two in a round, since its
        lock is not reentrant). Every lock taken is released, whatever happens."""
        staged: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], PartitionLog, Staged]] = []
        later: list[Commit] = []
        held: list[PartitionLog] = []
        seen: set[int] = set()
        failed_io = False
        try:
            for c in commits:
                loop, fut, plog, records = c
                if id(plog) in seen:
                    later.append(c)
                    continue
                seen.add(id(plog))
                plog.io_lock.acquire()
                held.append(plog)
                try:
                    st = plog.stage_commit(records)
                except BaseException as e:  # nothing of it stays written
                    held.pop()
                    plog.io_lock.release()
                    failed_io = True  # (an fdatasync of its hwm file may have failed: the superblock's too)
                    done.setdefault(loop, []).append((fut, None, e if isinstance(e, OSError) else
                                                      OSError(5, f"commit failed: {e!r}")))
                    continue
                staged.append((loop, fut, plog, st))
            if not staged:
                if failed_io:
                    self._advance_cursor("after a failed commit")
                return later
            self.rounds += 1
            self.commits += len(staged)
            t0 = time.perf_counter()
            errs: list[OSError | None]
            if len(staged) > 1 and self._sync_fd >= 0 and all(p.dev == self._sync_dev for _, _, p, _ in staged):
                self.group_syncs += 1
                try:
                    fileio.syncfs(self._sync_fd)
                    errs = [None] * len(staged)
                except BaseException as e:  # whatever it was, nothing of the round is known durable
                    err = e if isinstance(e, OSError) else OSError(5, f"syncfs failed: {e!r}")
                    errs = [err] * len(staged)
            else:
                errs = []
                for _, _, _, st in staged:
                    try:
                        fileio.fdatasync(st.seg.fd)
                        errs.append(None)
                    except BaseException as e:
                        errs.append(e if isinstance(e, OSError) else OSError(5, f"fdatasync failed: {e!r}"))
                        failed_io = True
            took = time.perf_counter() - t0
            for (loop, fut, plog, st), err in zip(staged, errs, strict=True):
                try:
                    if err is not None:
                        plog.sync_failed(st, err)
                        raise OSError(err.errno or 5, err.strerror or str(err))
                    plog.last_sync_s = took
                    done.setdefault(loop, []).append((fut, plog.finish_commit(st), None))
                except BaseException as e:
                    done.setdefault(loop, []).append((fut, None, e if isinstance(e, OSError) else
                                                      OSError(5, f"commit failed: {e!r}")))
                finally:
                    held.remove(plog)
                    plog.io_lock.release()
            if failed_io:
                self._advance_cursor("after a failed commit")
            return later
        finally:
            for plog in held:  # only on an unexpected exception: the frames are cut, the logs poisoned
                with contextlib.suppress(BaseException):
                    plog.sync_failed(next(st for _, _, p, st in staged if p is plog), OSError(5, "commit round failed"))
                plog.io_lock.release()
