"""The storage I/O threads' scheduling class: SCHED_BATCH, for the WAL's syncer, the
broker's I/O pool and the partition commit rounds' thread.

A thread of that class does not preempt the running thread when it wakes, so an
fdatasync returning on a worker's I/O thread no longer throws the worker's event
loop off its core (it did about 2,400-4,900 times a second per worker under
single-message produce); the I/O thread runs as soon as the loop waits, or at the
next scheduler tick while the loop is busy, and keeps its fair share of the core.
Measured in docs/architecture.md ("I/O threads run SCHED_BATCH").

Imports nothing from narad.
"""

from __future__ import annotations

import os


def batch_class() -> bool:
    """Put the calling thread in SCHED_BATCH (Linux; elsewhere a no-op). Returns
    whether it took."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        return False
    return True
