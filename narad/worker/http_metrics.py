"""Request metrics of a worker's app: ``narad_http_requests_in_flight`` and the
per-request series of ``narad.metrics.HttpObserver``.

``MeteredApp`` wraps the ``RoutedApp`` the transports serve: the in-flight
gauge goes up by one where a request enters the app (``handle`` or a taken
``handle_fast``) and down by one when it is answered (the observer, which
the app calls once per answer) or when its handler is cancelled before an
answer (the client went away, a forced shutdown). One add each: no task,
closure or syscall per request.

Imports narad.api.router (types) and narad.metrics.
"""

from __future__ import annotations

from collections.abc import Callable

from narad import metrics
from narad.api.router import Request, Response, RoutedApp
from narad.errors import NaradError


class MeteredApp:
    def __init__(self, app: RoutedApp) -> None:
        self.app = app
        self.observer = metrics.HttpObserver()
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
        try:
            return await self._handle(req)  # answered: the observer took it off again
        except BaseException:
            g.value -= 1  # no answer (cancelled): it never reached the observer
            raise

    def handle_fast(self, req: Request, reply: Callable[[Response], None]) -> bool:
        g = self._g
        g.value += 1
        if self._fast(req, reply):
            return True  # the observer takes it off when the answer is made
        g.value -= 1
        return False
