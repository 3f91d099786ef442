"""A diagnostic for loadtest/bench.py --opcount: the Python bytecodes a worker executes, by
function (``sys.settrace`` with opcode events on the loop thread and every thread started
after it: exact counts, no sampling, at about fifty times the CPU, so pace the load low).
``NARAD_WORKER_OPCOUNT=<prefix>`` turns it on (narad.worker.main) and the counts are written
as JSON ``{"file:line(function)": opcodes}`` to ``<prefix>.<index>.<pid>`` at a clean stop.
Unset (always, in production): nothing is installed. What it does not see: work done in C
(msgspec, dict and set operations, allocation): count instructions for that
(loadtest/bench_instructions.py).

Imports nothing of narad.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from types import CodeType, FrameType
from typing import Any


class OpCounter:
    """Counts opcodes by code object (keyed by its id; the objects are kept alive here)."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.codes: dict[int, CodeType] = {}

    def start(self) -> None:
        counts, codes = self.counts, self.codes

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "opcode":
                k = id(frame.f_code)
                counts[k] = counts.get(k, 0) + 1
            return local

        def tracer(frame: FrameType, event: str, arg: Any) -> Any:
            code = frame.f_code
            codes.setdefault(id(code), code)
            frame.f_trace_opcodes = True
            return local

        threading.settrace(tracer)
        sys.settrace(tracer)

    def stop(self, path: str | Path) -> None:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
        rows: dict[str, int] = {}
        for k, n in list(self.counts.items()):
            c = self.codes.get(k)
            name = f"{c.co_filename}:{c.co_firstlineno}({c.co_name})" if c is not None else "?"
            rows[name] = rows.get(name, 0) + n
        Path(path).write_text(json.dumps(rows))
