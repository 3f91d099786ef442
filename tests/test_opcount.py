"""The opcode counter behind loadtest/bench.py --opcount (narad/worker/opcount.py): it
counts the bytecodes each function runs, on the calling thread and on threads started
after it, and nothing once stopped."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from narad.worker.opcount import OpCounter


def _loop(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def test_opcodes_are_counted_by_function_and_grow_with_the_work(tmp_path: Path) -> None:
    c = OpCounter()
    c.start()
    _loop(10)
    _loop(1000)
    t = threading.Thread(target=_loop, args=(500,))
    t.start()
    t.join()
    c.stop(tmp_path / "counts")
    _loop(100_000)  # after the stop: not counted
    rows = json.loads((tmp_path / "counts").read_text())
    mine = [v for k, v in rows.items() if k.endswith("(_loop)") and "test_opcount.py" in k]
    assert len(mine) == 1
    # About five opcodes an iteration over 1,510 iterations (three calls), none of the 100k after.
    assert 1510 * 4 < mine[0] < 1510 * 12
