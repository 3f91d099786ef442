"""Logging setup shared by every narad process: one JSON object per line on
stderr (or plain text), tagged with the process role and pid.

Call ``setup(role, level, fmt)`` once per process (the supervisor, the fork
server and each worker after fork). Extra fields go in ``extra={...}``.
It also turns on faulthandler: a fatal signal prints every thread's stack.
Bottom layer: imports nothing from narad.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import time
from collections.abc import Callable

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
            "logger": record.name,
            "role": self.role,
            "pid": os.getpid(),
        }
        for k, v in record.__dict__.items():
            if k not in _STD_ATTRS and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(
            f"{k}={v}" for k, v in record.__dict__.items() if k not in _STD_ATTRS and not k.startswith("_")
        )
        line = (
            f"{time.strftime('%H:%M:%S', time.localtime(record.created))}.{int(record.msecs):03d} "
            f"{record.levelname[:4]} {self.role}[{os.getpid()}] {record.name}: {record.getMessage()}"
        )
        if extras:
            line += f" {extras}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(role: str, level: str = "info", fmt: str = "json") -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(role) if fmt == "json" else TextFormatter(role))
    root.addHandler(handler)
    root.setLevel(level.upper())
    # pysyncobj logs every reconnect attempt at warning; keep its errors only.
    logging.getLogger("pysyncobj").setLevel(logging.ERROR)
    # aioquic logs every handshake and stream reset at info: keep its warnings
    # (NARAD_QUIC_LOG=info brings them back when debugging HTTP/3).
    logging.getLogger("quic").setLevel(os.environ.get("NARAD_QUIC_LOG", "warning").upper())
    # A crash in C (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) prints every thread's Python stack on
    # stderr before the process dies, so the log says where, not only that it died.
    faulthandler.enable(file=sys.stderr, all_threads=True)


_dumpers: list[Callable[[], str]] = []


def add_dumper(fn: Callable[[], str]) -> None:
    """Register a state summary that the SIGUSR1 dump includes."""
    _dumpers.append(fn)


def dump_tasks(loop: object) -> None:
    """SIGUSR1 diagnostics: log the stack of every asyncio task of ``loop``
    (what each pending request is waiting on)."""
    import asyncio
    import io

    tasks = asyncio.all_tasks(loop)  # type: ignore[arg-type]
    out = io.StringIO()
    for t in tasks:
        out.write(f"--- {t.get_name()} {t.get_coro()!r}\n")
        t.print_stack(limit=12, file=out)
    for fn in _dumpers:
        try:
            out.write(fn() + "\n")
        except Exception as e:  # diagnostics never take the process down
            out.write(f"(dumper {fn!r} failed: {e})\n")
    logging.getLogger("narad.diagnostics").warning("%d asyncio tasks\n%s", len(tasks), out.getvalue())
