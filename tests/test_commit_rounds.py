"""Commit rounds on real files: commits queued together share one round and one
syncfs; a failed sync fails (and poisons) every log of its round and leaves none of
their frames; a commit whose write fails fails alone; one log syncs with fdatasync;
what a round committed is there after a reopen."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from narad.storage import fileio
from narad.storage import frames as FR
from narad.storage.commit_rounds import CommitRounds
from narad.storage.partition_log import LogPoisoned, PartitionLog, Record

pytestmark = pytest.mark.skipif(not fileio.HAVE_SYNCFS, reason="no syncfs(2) here")


@pytest.fixture(autouse=True)
def _reset_seam() -> Iterator[None]:
    yield
    fileio.reset()


def logs(tmp_path: Path, n: int) -> list[PartitionLog]:
    out = []
    for i in range(n):
        plog = PartitionLog(tmp_path / "topics" / f"p{i:05d}")
        plog.open()
        out.append(plog)
    return out


def batch(plog: PartitionLog, tag: str, n: int = 3) -> tuple[list[bytes], list[Record]]:
    ts = plog.committed_at()
    data = [f"{tag}-{j}".encode() for j in range(n)]
    return ([FR.encode_record(None, ts, 0, d) for d in data], [(None, ts, 0, d) for d in data])


async def one_round(rounds: CommitRounds, plogs: list[PartitionLog], tag: str = "r"
                    ) -> list[tuple[object, BaseException | None]]:
    """Every log's commit queued while the round thread is held busy, so they form
    one round; returns (result, exception) per log, each published on success."""
    loop = asyncio.get_running_loop()
    gate = threading.Event()
    started = threading.Event()

    def hold(timeout: float) -> bool:
        started.set()
        return gate.wait(timeout)

    held = rounds.run(loop, hold, 10)
    # The thread must be inside the job before the commits are queued: had it woken for the job
    # only after the first commit was queued, it would take that commit with the job (a round alone).
    assert await asyncio.to_thread(started.wait, 10), "the round thread never took the holding job"
    batches = [batch(p, tag) for p in plogs]
    futs = [rounds.commit(loop, p, envs) for p, (envs, _) in zip(plogs, batches, strict=True)]
    gate.set()
    assert await held is True
    out: list[tuple[object, BaseException | None]] = []
    for p, f, (_, decoded) in zip(plogs, futs, batches, strict=True):
        try:
            res = await f
        except OSError as e:
            out.append((None, e))
            continue
        p.publish(*res, decoded)
        out.append((res, None))
    return out


def reopened(plog: PartitionLog) -> list[bytes]:
    plog.close()
    again = PartitionLog(plog.dir)
    again.open()
    try:
        return [again.read(o)[3] for o in range(again.hwm)]
    finally:
        again.close()


def test_commits_queued_together_share_one_round_and_one_syncfs(tmp_path: Path) -> None:
    plogs = logs(tmp_path, 4)
    rounds = CommitRounds("t", tmp_path)
    fdatasyncs: list[int] = []
    syncfs_calls: list[int] = []
    real_fdatasync, real_syncfs = fileio.fdatasync, fileio.syncfs
    fileio.fdatasync = lambda fd: (fdatasyncs.append(fd), real_fdatasync(fd))[1]  # type: ignore[assignment]
    fileio.syncfs = lambda fd: (syncfs_calls.append(fd), real_syncfs(fd))[1]  # type: ignore[assignment]

    async def main() -> None:
        first = await one_round(rounds, plogs, "a")
        assert [e for _, e in first] == [None] * 4
        seg_fds = {p.segments[-1].fd for p in plogs}
        # one syncfs at the thread's start (moving its error cursor past older errors), one for the round
        assert len(syncfs_calls) == 2 and not (set(fdatasyncs) & seg_fds), "one syncfs, no log fdatasync"
        assert (rounds.rounds, rounds.commits, rounds.group_syncs) == (1, 4, 1)
        # a round of one log syncs that log alone
        alone = await one_round(rounds, plogs[:1], "b")
        assert alone[0][1] is None
        assert plogs[0].segments[-1].fd in fdatasyncs and len(syncfs_calls) == 2
    asyncio.run(main())
    rounds.stop()
    assert [p.hwm for p in plogs] == [6, 3, 3, 3]
    assert reopened(plogs[0]) == [b"a-0", b"a-1", b"a-2", b"b-0", b"b-1", b"b-2"]
    for p in plogs[1:]:
        assert reopened(p) == [b"a-0", b"a-1", b"a-2"]


def test_a_failed_syncfs_fails_and_poisons_every_log_of_its_round(tmp_path: Path) -> None:
    plogs = logs(tmp_path, 3)
    rounds = CommitRounds("t", tmp_path)

    async def main() -> None:
        assert [e for _, e in await one_round(rounds, plogs, "ok")] == [None] * 3

        def eio(fd: int) -> None:
            raise OSError(errno.EIO, "Input/output error")
        fileio.syncfs = eio  # type: ignore[assignment]
        failed = await one_round(rounds, plogs, "lost")
        assert all(res is None and isinstance(e, OSError) and e.errno == errno.EIO for res, e in failed)
        assert all(p.poisoned is not None for p in plogs)
        fileio.reset()
        # poisoned until reopened: a later commit is refused without writing
        again = await one_round(rounds, plogs, "after")
        assert all(isinstance(e, LogPoisoned) for _, e in again)
    asyncio.run(main())
    rounds.stop()
    for p in plogs:
        assert p.hwm == 3
        assert reopened(p) == [b"ok-0", b"ok-1", b"ok-2"], "the failed round's frames were cut"


def test_a_commit_whose_write_fails_fails_alone(tmp_path: Path) -> None:
    plogs = logs(tmp_path, 3)
    rounds = CommitRounds("t", tmp_path)
    victim = plogs[1]
    real_pwrite = fileio.pwrite

    def enospc_for_victim(fd: int, data: bytes, off: int) -> int:
        if fd == victim.segments[-1].fd:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, off)
    fileio.pwrite = enospc_for_victim  # type: ignore[assignment]

    async def main() -> None:
        out = await one_round(rounds, plogs, "x")
        assert out[0][1] is None and out[2][1] is None
        assert isinstance(out[1][1], OSError) and out[1][1].errno == errno.ENOSPC
        assert victim.poisoned is None, "a failed write poisons nothing: nothing of it stays"
        assert rounds.group_syncs == 1, "the two others still shared a syncfs"
    asyncio.run(main())
    rounds.stop()
    fileio.reset()
    assert [p.hwm for p in plogs] == [3, 0, 3]
    assert reopened(victim) == []
    assert reopened(plogs[2]) == [b"x-0", b"x-1", b"x-2"]


def test_group_sync_off_syncs_each_log(tmp_path: Path) -> None:
    plogs = logs(tmp_path, 3)
    rounds = CommitRounds("t", tmp_path, group_sync=False)
    synced: list[int] = []
    real = fileio.fdatasync
    fileio.fdatasync = lambda fd: (synced.append(fd), real(fd))[1]  # type: ignore[assignment]

    def no_syncfs(fd: int) -> None:
        raise AssertionError("syncfs called with group_sync off")
    fileio.syncfs = no_syncfs  # type: ignore[assignment]

    async def main() -> None:
        assert [e for _, e in await one_round(rounds, plogs, "g")] == [None] * 3
    asyncio.run(main())
    rounds.stop()
    assert {p.segments[-1].fd for p in plogs} <= set(synced)
    assert rounds.group_syncs == 0 and rounds.rounds == 1


def test_a_stopped_rounds_refuses_work(tmp_path: Path) -> None:
    rounds = CommitRounds("t", tmp_path)

    async def main() -> None:
        assert await rounds.run(asyncio.get_running_loop(), os.getpid) == os.getpid()
        rounds.stop()
        with pytest.raises(RuntimeError, match="closed"):
            rounds.run(asyncio.get_running_loop(), os.getpid)
    asyncio.run(main())


def test_plain_jobs_answer_on_the_loop_from_a_batch_thread(tmp_path: Path) -> None:
    rounds = CommitRounds("t-rounds", tmp_path)

    def where(x: int) -> tuple[int, int, int]:
        return x * 2, threading.get_native_id(), os.sched_getscheduler(0)

    def boom() -> None:
        raise OSError(5, "disk says no")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        got = await asyncio.gather(*(rounds.run(loop, where, i) for i in range(20)))
        assert [g[0] for g in got] == [i * 2 for i in range(20)]
        assert threading.get_native_id() not in {g[1] for g in got}
        assert {g[2] for g in got} == {os.SCHED_BATCH}
        with pytest.raises(OSError, match="disk says no"):
            await rounds.run(loop, boom)
        # a waiter that gave up: the job still runs, its answer is dropped without error
        ev = threading.Event()
        fut = rounds.run(loop, lambda: (ev.wait(5), 1)[1])
        fut.cancel()
        ev.set()
        assert await rounds.run(loop, lambda: "after") == "after"

    asyncio.run(main())
    assert [t.name for t in threading.enumerate() if t.name == "t-rounds"] == ["t-rounds"]
    rounds.stop()
    assert not [t for t in threading.enumerate() if t.name == "t-rounds"]


def test_an_unexpected_error_in_a_round_answers_everyone_and_the_thread_lives(tmp_path: Path) -> None:
    plogs = logs(tmp_path, 3)
    rounds = CommitRounds("t-bug", tmp_path)

    def bug(fd: int) -> None:
        raise ValueError("not an OSError")

    async def main() -> None:
        assert await rounds.run(asyncio.get_running_loop(), os.getpid) == os.getpid()  # started, cursor moved
        fileio.syncfs = bug  # type: ignore[assignment]
        out = await asyncio.wait_for(one_round(rounds, plogs[:2], "bug"), 10)
        assert all(res is None and isinstance(e, OSError) for res, e in out), out
        fileio.reset()
        for p in plogs[:2]:
            assert p.poisoned is not None
            assert os.path.getsize(p.segments[-1].path) == 0, "the failed round's frame was cut"
            assert p.io_lock.acquire(timeout=1), "a lock left held"
            p.io_lock.release()
        # the thread lives on: another log still commits
        again = await asyncio.wait_for(one_round(rounds, plogs[2:], "ok"), 10)
        assert again[0][1] is None
    asyncio.run(main())
    rounds.stop()
    assert reopened(plogs[2]) == [b"ok-0", b"ok-1", b"ok-2"]


def test_two_commits_of_one_log_never_share_a_round(tmp_path: Path) -> None:
    (plog,) = logs(tmp_path, 1)
    rounds = CommitRounds("t-twice", tmp_path)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate = threading.Event()
        held = rounds.run(loop, gate.wait, 10)
        (e1, d1), (e2, d2) = batch(plog, "one"), batch(plog, "two")
        f1, f2 = rounds.commit(loop, plog, e1), rounds.commit(loop, plog, e2)
        gate.set()
        await held
        r1 = await asyncio.wait_for(f1, 10)
        plog.publish(*r1, d1)
        r2 = await asyncio.wait_for(f2, 10)
        plog.publish(*r2, d2)
    asyncio.run(main())
    rounds.stop()
    assert rounds.rounds == 2
    assert reopened(plog) == [b"one-0", b"one-1", b"one-2", b"two-0", b"two-1", b"two-2"]


def test_a_failed_fdatasync_moves_the_syncfs_cursor(tmp_path: Path) -> None:
    plogs = logs(tmp_path, 1)
    rounds = CommitRounds("t-cursor", tmp_path)
    calls: list[int] = []
    real_syncfs = fileio.syncfs
    fileio.syncfs = lambda fd: (calls.append(fd), real_syncfs(fd))[1]  # type: ignore[assignment]

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    async def main() -> None:
        assert [e for _, e in await one_round(rounds, plogs, "ok")] == [None]
        assert len(calls) == 1  # at start
        fileio.fdatasync = eio  # type: ignore[assignment]
        out = await one_round(rounds, plogs, "x")
        assert isinstance(out[0][1], OSError)
        assert len(calls) == 2, "the failed fdatasync's error (the superblock's too) was stepped over"
    asyncio.run(main())
    rounds.stop()


def test_syncfs_is_trusted_only_where_it_reports_write_errors(tmp_path: Path) -> None:
    ok, why = fileio.syncfs_reports_errors("/proc")
    assert not ok and "proc" in why
    ok, why = fileio.syncfs_reports_errors(tmp_path)
    assert ok == any(fs in why for fs in fileio.SYNCFS_FILESYSTEMS), why


def test_the_round_thread_is_profiled_beside_the_worker_when_asked(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The diagnostic of ``loadtest/bench.py --cprofile``: with NARAD_WORKER_CPROFILE set,
    the round thread runs under cProfile and writes ``<prefix>.rounds.<pid>`` when it ends,
    holding its rounds (``_round``); without it, nothing is written."""
    import pstats

    prefix = tmp_path / "prof" / "run"
    prefix.parent.mkdir()
    for asked in (False, True):
        if asked:
            monkeypatch.setenv("NARAD_WORKER_CPROFILE", str(prefix))
        else:
            monkeypatch.delenv("NARAD_WORKER_CPROFILE", raising=False)
        plogs = logs(tmp_path / ("on" if asked else "off"), 2)
        rounds = CommitRounds("t", tmp_path)

        async def main(rounds: CommitRounds = rounds, plogs: list[PartitionLog] = plogs) -> None:
            assert [e for _, e in await one_round(rounds, plogs)] == [None, None]

        asyncio.run(main())
        rounds.stop()
        for p in plogs:
            p.close()
        files = list(prefix.parent.iterdir())
        if not asked:
            assert files == []
            continue
        assert [f.name for f in files] == [f"run.rounds.{os.getpid()}"]
        names = {name for (_file, _line, name) in pstats.Stats(str(files[0])).stats}  # type: ignore[attr-defined]
        assert "_round" in names
