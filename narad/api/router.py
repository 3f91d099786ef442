"""The one request router both transports (HTTP/1.1 and HTTP/3) serve: sans-IO.

A transport parses bytes into a ``Request``, asks ``App.body_limit`` before
reading a body, awaits ``App.handle(request)`` and writes the ``Response``.
Nothing here touches a socket, so the whole API is testable with plain
``Request`` objects. Routing is a table of path patterns (``{name}`` matches
one segment); errors raised by handlers become ``{"error": ...}`` responses
with the status and headers narad.errors carries. The router matches the raw
(percent-encoded) path: split on "/" first, then each segment decoded, so
``/v1/topics/x%2Fconsume`` names the topic "x/consume" (which name validation
refuses) and never the consume route of "x".

Imports narad.errors only; handlers register themselves from narad.api.app.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import unquote

import msgspec

from narad.errors import InternalError, MethodNotAllowed, NaradError, NotFound, Unavailable

log = logging.getLogger("narad.api")

GENERAL_BODY_LIMIT = 1 << 20  # 1 MiB


@dataclass(slots=True)
class Request:
    method: str  # upper case, as sent ("HEAD" is routed to the GET handler)
    path: str  # percent-decoded path, without the query string (for logs and exact checks)
    query: dict[str, list[str]]  # parsed query string, values in order; non-UTF-8 bytes as surrogateescape
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes = b""
    client: str = ""  # peer IP address
    transport: str = "h1"  # "h1" or "h3"
    params: dict[str, str] = field(default_factory=dict)  # filled by the router from {name} segments
    route: str = ""  # the matched pattern, e.g. "GET /v1/topics/{topic}" (metrics label)
    identity: Any = None  # set by the auth step
    # The path as sent, still percent-encoded: the router splits it on "/" first and
    # decodes each segment after, so an encoded "/" (%2F) stays inside its segment.
    # Empty: ``path`` is routed as it is (a Request built by hand, without escapes).
    raw_path: str = ""

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name, default)

    def q1(self, name: str) -> str | None:
        vals = self.query.get(name)
        return vals[0] if vals else None


@dataclass(slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str | None = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)
    # Called by a transport that drops the response because the client went away
    # (a consume gives its leases back at once instead of after the visibility timeout).
    on_dropped: Callable[[], None] | None = None


class App(Protocol):
    """What a transport needs from the application."""

    def body_limit(self, method: str, path: str) -> tuple[int, int]:
        """(largest body accepted, status to answer when exceeded: 413 or 400)."""
        ...

    async def handle(self, req: Request) -> Response: ...

    def error_response(self, err: NaradError) -> Response: ...


Handler = Callable[[Request], Awaitable[Response]]
# The answer of a synchronous handler: a Response, or a NaradError to answer as error_response does.
Reply = Callable[[Response | NaradError], None]
# A route's synchronous entry: returns False (having done nothing) when the request needs the async
# handler, True when it took the request: it then calls the reply exactly once, maybe later.
FastHandler = Callable[[Request, Reply], bool]
_json = msgspec.json.Encoder()


def json_response(status: int, obj: Any, headers: list[tuple[str, str]] | None = None) -> Response:
    return Response(status, _json.encode(obj), "application/json", headers or [])


def empty(status: int = 204, headers: list[tuple[str, str]] | None = None) -> Response:
    return Response(status, b"", None, headers or [])


def error_response(err: NaradError) -> Response:
    return Response(err.status, _json.encode(err.body()), "application/json", list(err.headers))


@dataclass(slots=True)
class _Route:
    method: str
    pattern: str
    parts: list[str]
    handler: Handler
    body_limit: int
    oversize_status: int
    fast: FastHandler | None = None
    label: str = ""  # "METHOD /pattern": the metrics label


_CACHE_ENTRIES = 10_000
_CACHE_PATH_MAX = 512  # bytes of raw path; every real route with a valid name fits

class Router:
    """Pattern table: exact segments and ``{name}`` captures, one method each."""

    def __init__(self) -> None:
        self._routes: list[_Route] = []
        self._exact: dict[tuple[str, str], _Route] = {}
        # (method, path) -> matched route: a transport asks for the body limit and
        # the router for the handler, and paths repeat (one per topic and action).
        self._cache: dict[tuple[str, str], tuple[_Route, dict[str, str]]] = {}

    def add(
        self, method: str, pattern: str, handler: Handler, *, body_limit: int = GENERAL_BODY_LIMIT,
        oversize_status: int = 413, fast: FastHandler | None = None,
    ) -> None:
        parts = pattern.strip("/").split("/")
        r = _Route(method, pattern, parts, handler, body_limit, oversize_status, fast, f"{method} {pattern}")
        self._routes.append(r)
        if "{" not in pattern:
            self._exact[(method, pattern)] = r

    def match(self, method: str, path: str) -> tuple[_Route, dict[str, str]]:
        """Find the route for a raw (percent-encoded) path; raises NotFound
        (unknown path) or MethodNotAllowed."""
        if method == "HEAD":
            method = "GET"
        cached = self._cache.get((method, path))
        if cached is not None:
            return cached
        found = self._match(method, path)
        # Matching runs before authentication (the body limit is the route's): only short
        # paths are remembered, so unknown clients cannot grow the cache past ~10k x 512 B.
        if len(path) <= _CACHE_PATH_MAX:
            if len(self._cache) >= _CACHE_ENTRIES:
                self._cache.clear()
            self._cache[(method, path)] = found
        return found

    def _match(self, method: str, path: str) -> tuple[_Route, dict[str, str]]:
        hit = self._exact.get((method, path))
        if hit is not None:
            return hit, {}
        # Split first, decode each segment after: "%2F" never makes a new segment.
        segs = [unquote(s) if "%" in s else s for s in path.strip("/").split("/")]
        allowed: list[str] = []
        for r in self._routes:
            if len(r.parts) != len(segs):
                continue
            params: dict[str, str] = {}
            for want, got in zip(r.parts, segs, strict=True):
                if want.startswith("{"):
                    if not got:
                        break
                    params[want[1:-1]] = got
                elif want != got:
                    break
            else:
                if r.method == method:
                    return r, params
                allowed.append(r.method)
        if allowed:
            if "GET" in allowed:
                allowed.append("HEAD")
            raise MethodNotAllowed(allowed)
        raise NotFound("404 page not found")

    def body_limit(self, method: str, path: str) -> tuple[int, int]:
        try:
            r, _ = self.match(method, path)
        except NaradError:
            return GENERAL_BODY_LIMIT, 413
        return r.body_limit, r.oversize_status


class Observer(Protocol):
    def observe(self, route: str, method: str, status: int, seconds: float, bytes_in: int, bytes_out: int) -> None:
        ...


class RoutedApp:
    """An App over a Router, with a hook run before every handler (auth, the
    415 guard) and an observer for request metrics."""

    def __init__(
        self,
        router: Router,
        *,
        before: Callable[[Request], Awaitable[None]] | None = None,
        before_fast: Callable[[Request], bool] | None = None,
        observer: Observer | None = None,
        extra_headers: list[tuple[str, str]] | None = None,
    ) -> None:
        self.router = router
        self.before = before
        # ``before`` without awaiting (the credential cache hit, the 415 guard passed): True
        # when the request may take its route's synchronous entry, False for the async path
        self.before_fast = before_fast
        self.observer = observer
        self.extra_headers = extra_headers or []

    def body_limit(self, method: str, path: str) -> tuple[int, int]:
        return self.router.body_limit(method, path)

    def error_response(self, err: NaradError) -> Response:
        return error_response(err)

    async def handle(self, req: Request) -> Response:
        t0 = time.perf_counter()
        try:
            # The route is looked up first, but a 404 or 405 is answered after ``before``
            # (authentication, the 415 guard) as Narad does for /v1 (401, then 415, then
            # 404/405); ``before`` sees ``req.route`` ("" when unmatched) and lets the
            # requests no credentials can apply to (/healthz, a path outside /v1) through.
            miss: NaradError | None = None
            route = None
            try:
                route, params = self.router.match(req.method, req.raw_path or req.path)
                req.params = dict(params)
                req.route = route.label
            except NaradError as e:
                miss = e
            if self.before is not None:
                await self.before(req)
            if miss is not None or route is None:
                raise miss or NotFound("404 page not found")
            resp = await route.handler(req)
        except NaradError as e:
            if not req.route:
                req.route = "unmatched"
            resp = _error(e)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # this request was cancelled (shutdown, client gone)
            # An operation the handler awaited was cancelled under it: answer, do not hang.
            log.error("handler: an operation it waited on was cancelled", extra={"route": req.route})
            resp = error_response(Unavailable("the operation was cancelled on this node; retry"))
        except Exception as e:  # a bug: answer 500, keep serving
            log.exception("handler failed", extra={"route": req.route, "method": req.method})
            resp = error_response(InternalError(f"internal error: {type(e).__name__}"))
        return self._finish(req, resp, t0)

    def _finish(self, req: Request, resp: Response, t0: float) -> Response:
        if self.extra_headers:
            resp.headers.extend(self.extra_headers)
        if self.observer is not None:
            self.observer.observe(req.route or "unmatched", req.method, resp.status, time.perf_counter() - t0,
                                  len(req.body), len(resp.body))
        return resp

    def handle_fast(self, req: Request, reply: Callable[[Response], None]) -> bool:
        """``handle`` without a task, for routes with a synchronous entry: False (nothing
        done) when the request needs ``handle``; True when taken, and ``reply`` is called
        once with the very Response ``handle`` would have returned."""
        bf = self.before_fast
        if bf is None:
            return False
        t0 = time.perf_counter()
        try:
            if not bf(req):
                return False
            route, params = self.router.match(req.method, req.raw_path or req.path)
        except NaradError:
            return False  # 404 / 405: handle answers them
        fast = route.fast
        if fast is None:
            return False

        def done(res: Response | NaradError) -> None:
            if isinstance(res, NaradError):
                res = _error(res)
            reply(self._finish(req, res, t0))

        req.params = dict(params)
        req.route = route.label
        try:
            return fast(req, done)
        except NaradError as e:
            done(e)
        except Exception as e:  # a bug: answer 500, keep serving
            log.exception("handler failed", extra={"route": req.route, "method": req.method})
            done(InternalError(f"internal error: {type(e).__name__}"))
        return True


def _error(e: NaradError) -> Response:
    """An unknown path and a wrong method answer Narad's (Go's) plain-text bodies;
    every other error is JSON."""
    if e.status == 404 and e.message == "404 page not found":
        return Response(404, b"404 page not found\n", "text/plain; charset=utf-8")
    if isinstance(e, MethodNotAllowed):
        return Response(405, b"Method Not Allowed\n", "text/plain; charset=utf-8", list(e.headers))
    return error_response(e)


def first_segment(req: Request) -> str:
    """The first path segment as the router reads it (percent-decoded after the split)."""
    seg = (req.raw_path or req.path).strip("/").split("/", 1)[0]
    return unquote(seg) if "%" in seg else seg
