"""A deleted topic incarnation's data on a real Broker (in process, tests/fanout_world.py):
removed only once the supervisor confirms the incarnation gone, and asked again within
seconds when the confirmation did not come at the partition's retire (not only at the
cold walk, minutes later)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from narad.broker import broker as BR
from narad.broker.broker import Broker
from narad.meta import commands as C
from narad.meta.records import TopicRecord
from tests.fanout_world import World

TID = "00000000000000c1"


def _record(name: str, tid: str) -> TopicRecord:
    return TopicRecord(name=name, id=tid, partitions=2, retention_ms=0, visibility_timeout_ms=30000,
                       max_in_flight_per_partition=1024, max_acked_ahead_per_partition=1024, created_at=1)


async def _until(cond: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _deleted(tmp_path: Path, answers: Any, partitions: int, then: Any) -> list[bool]:
    """Create "doomed", commit a record into each of `partitions` of its partitions on a
    real Broker whose supervisor answers ``answers(n)`` to its n-th "gone?", delete the
    topic, run ``then(base)`` (the incarnation's directory); returns the answers given."""
    w = World(tmp_path)
    w.apply(C.CreateTopic(_record("doomed", TID)))
    base = tmp_path / "data" / "topics" / f"doomed@{TID}"
    asked: list[bool] = []

    async def main() -> None:
        b = await w.broker(Broker)
        try:
            async def confirm(topic: str, tid: str) -> bool:
                assert (topic, tid) == ("doomed", TID)
                asked.append(answers(len(asked)))
                return asked[-1]

            b.confirm_gone = confirm
            for i in range(partitions):
                await b.commit_local("doomed", TID, i, [(None, 0, b"x")])
            assert sorted(d.name for d in base.iterdir()) == [f"p{i:05d}" for i in range(partitions)]
            w.apply(C.DeleteTopic("doomed"))
            await then(base, asked)
            await _until(lambda: not b._gone_retries, 5, "the retries over")
        finally:
            await b.close()

    try:
        asyncio.run(main())
    finally:
        w.close()
    return asked


def test_a_deleted_incarnation_is_removed_when_its_confirmation_comes_late(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BR, "GONE_RETRY_S", (0.05, 0.1, 0.2, 0.4, 0.8))

    async def then(base: Path, asked: list[bool]) -> None:
        await _until(lambda: not base.exists(), 10, "the deleted incarnation's directory removed")
        await _until(lambda: True in asked, 1, "the confirming answer recorded")

    asked = _deleted(tmp_path, lambda n: n >= 2, 2, then)  # the first two answers: not confirmed
    assert asked[:2] == [False, False] and True in asked  # kept until confirmed, then removed


def test_a_deleted_incarnation_is_kept_while_never_confirmed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BR, "GONE_RETRY_S", (0.05, 0.05, 0.05))

    async def then(base: Path, asked: list[bool]) -> None:
        await _until(lambda: len(asked) >= 4, 10, "the confirmation asked again")
        await asyncio.sleep(0.3)  # (the retries are spent)
        assert (base / "p00000").is_dir()  # nothing removed without the supervisor's word

    assert len(_deleted(tmp_path, lambda n: False, 1, then)) == 4  # at the retire, then once a retry
