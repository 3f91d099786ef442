"""The client-gone signal between the transports and long-poll handlers.

A transport runs each request's handler in a task of its own and hands it a
``Hangup`` through a context variable. A handler that may wait a long time for
something on the client's behalf (a long-poll consume) calls
``cancel_on_hangup()``: from then on the client going away cancels the
handler's task at once (HTTP/1.1: the connection closed, or EOF while the
request runs, as Go's server treats it; HTTP/3: the request stream reset or the
connection closed). The handler must give back whatever it reserved when it is
cancelled. A handler that does not opt in runs to the end and its answer is
written (a half-closed client still reads) or dropped (``Response.on_dropped``).

Imports the stdlib only; touches nothing but the task it is given.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar

__all__ = ["Hangup", "cancel_on_hangup", "enter"]


class Hangup:
    """One request's view of its client: gone yet, and may the handler be cancelled."""

    __slots__ = ("armed", "gone", "task")

    def __init__(self, gone: bool = False) -> None:
        self.task: asyncio.Task[None] | None = None  # set by the transport once the task exists
        self.armed = False  # the handler asked to be cancelled when the client goes
        self.gone = gone

    def client_gone(self) -> None:
        """The transport saw the client go away."""
        if self.gone:
            return
        self.gone = True
        t = self.task
        if self.armed and t is not None and not t.done():
            t.cancel()


_current: ContextVar[Hangup | None] = ContextVar("narad_hangup", default=None)


def enter(h: Hangup) -> None:
    """Called by the transport at the start of the request's task (its own context)."""
    _current.set(h)


def cancel_on_hangup() -> None:
    """Opt in: cancel this request's task as soon as its client goes away. If the
    client is gone already, raise CancelledError here, before anything is reserved."""
    h = _current.get()
    if h is None:
        return
    h.armed = True
    if h.gone:
        t = asyncio.current_task()
        if t is not None:
            t.cancel()  # so the task counts as cancelled (task.cancelling()), not as failed
        raise asyncio.CancelledError("the client went away")
