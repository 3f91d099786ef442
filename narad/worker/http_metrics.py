"""Request metrics of a worker's app: ``narad_http_requests_in_flight`` and the
per-request series of ``narad.metrics.HttpObserver``.

``MeteredApp`` wraps the ``RoutedApp`` the transports serve: the in-flight
gauge goes up by one where a request enters the app (``handle`` or a taken
``handle_fast``) and down by one when it is answered (the observer, which
the app calls once per answer) or when its handler is cancelled before an
answer (the client went away, a forced shutdown: counted as status 499,
as Narad does). One add each: no task, closure or syscall per request.

Imports narad.api.router (types) and narad.metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from narad import metrics
from narad.api.router import Request, Response, RoutedApp
from narad.errors import NaradError


class MeteredApp:
    def __init__(self, app: RoutedApp) -> None:
        self.app = app
        self.observer = metrics.HttpObserver(in_flight=True)
        app.observer = self.observer
        self._g = self.observer.in_flight
        self._handle = app.handle
        self._fast = app.handle_fast

    def body_limit(self, method: str, path: str) -> tuple[int, int]:
        return self.app.body_limit(method, path)

    def error_response(self, err: NaradError) -> Response:
        return self.app.error_response(err)

    async def handle(self, req: Request) -> Response:
        g = self._g
        g.value += 1
        t0 = time.perf_counter()
        try:
            return await self._handle(req)  # answered: the observer took it off again
        except asyncio.CancelledError:
            # No answer: the client went away (or a forced shutdown). Counted as Narad
            # does, status 499 (no client ever receives it); the observer takes it off.
            self.observer.observe(req.route or "unmatched", req.method, 499, time.perf_counter() - t0,
                                  len(req.body), 0)
            raise
        except BaseException:
            g.value -= 1  # never reached the observer
            raise

    def handle_fast(self, req: Request, reply: Callable[[Response], None]) -> bool:
        g = self._g
        g.value += 1
        if self._fast(req, reply):
            return True  # the observer takes it off when the answer is made
        g.value -= 1
        return False
