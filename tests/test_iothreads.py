"""The storage I/O threads' hand-off (``narad.storage.iothreads.IOLanes``): results
and exceptions come back on the loop, jobs run on SCHED_BATCH threads (never the
loop's), several run at once, a cancelled waiter is no error, and stop ends the
threads."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from narad.storage.iothreads import IOLanes


def test_lanes_answer_on_the_loop_from_batch_threads() -> None:
    lanes = IOLanes(3, "t-lanes")

    def where(x: int) -> tuple[int, int, int]:
        return x * 2, threading.get_native_id(), os.sched_getscheduler(0)

    def boom() -> None:
        raise OSError(5, "disk says no")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        got = await asyncio.gather(*(lanes.run(loop, where, i) for i in range(20)))
        assert [g[0] for g in got] == [i * 2 for i in range(20)]
        assert threading.get_native_id() not in {g[1] for g in got}
        assert {g[2] for g in got} == {os.SCHED_BATCH}
        with pytest.raises(OSError, match="disk says no"):
            await lanes.run(loop, boom)
        # three jobs that each wait for the other two: only lanes running at once finish
        barrier = threading.Barrier(3, timeout=5)
        assert await asyncio.gather(*(lanes.run(loop, barrier.wait) for _ in range(3))) is not None
        # a waiter that gave up: the job still runs, its answer is dropped without error
        ev = threading.Event()
        fut = lanes.run(loop, lambda: (ev.wait(5), 1)[1])
        fut.cancel()
        ev.set()
        assert await lanes.run(loop, lambda: "after") == "after"

    asyncio.run(main())
    names = [t.name for t in threading.enumerate() if t.name.startswith("t-lanes")]
    assert len(names) == 3
    lanes.stop()
    assert not [t for t in threading.enumerate() if t.name.startswith("t-lanes")]
    with pytest.raises(RuntimeError):
        lanes.run(asyncio.new_event_loop(), print)
