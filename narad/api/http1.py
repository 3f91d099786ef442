"""The HTTP/1.1 transport: an asyncio server (run under uvloop) that parses
requests with ``httptools`` and serves a ``narad.api.router.App``.

One ``_Conn`` protocol object per TCP connection: it parses bytes into
``Request`` objects, enforces the header/body/time limits, runs one handler at
a time (pipelined requests are queued and answered strictly in order) and
serializes each ``Response`` with a single ``transport.write``. ``Http1Server``
owns the accept loop (so ``max_connections`` can pause accepting), a single
sweep timer that enforces every connection's read/idle/linger deadline, and
the graceful drain.

A client that goes away is noticed at once: the connection closing, or EOF
(FIN) while a request runs, which Go's server also treats as the client gone,
cancels a handler that opted in (``narad.api.hangup``: the long-poll consume),
so it gives back what it reserved instead of answering nobody. Other handlers
finish; a half-closed client still gets their answers.

An HTTP/1.1 request without a Host header, or with more than one, is refused
with 400 (RFC 9112 3.2), as Go does.

Imports only narad.api.router, narad.api.hangup and narad.errors (plus stdlib
and httptools); touches nothing but the listening socket it is given and the
connections it accepts on it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections import deque
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import parse_qs, unquote

import httptools

from narad.api.hangup import Hangup, enter
from narad.api.router import App, Request, Response
from narad.errors import BadRequest, InternalError, NaradError, PayloadTooLarge

log = logging.getLogger("narad.api.http1")

__all__ = ["Http1Limits", "Http1Server"]


@dataclass(frozen=True)
class Http1Limits:
    read_timeout: float = 10.0  # max seconds to receive one full request once its first byte arrived
    idle_timeout: float = 60.0  # keep-alive connection idle this long is closed
    max_header_bytes: int = 65536  # request line + headers larger than this -> 431, close
    max_connections: int = 0  # open connections held at once; 0 = unlimited (at the cap, stop accepting)
    alt_svc: str | None = None  # if set, "Alt-Svc: <value>" on every response


# After a response that ends the connection we half-close (FIN) and keep
# reading/discarding for a moment, so a client still sending (an oversized
# body, pipelined requests) gets our answer instead of a RST that could
# destroy it ("lingering close"). Bounded in time and bytes.
_LINGER_SECONDS = 2.0
_LINGER_MAX_BYTES = 4 << 20
SMALL_BODY = 64  # an answer's body up to this long is kept whole with its head (``_write``)

_STATUS_LINES: dict[int, str] = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n" for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_HEADERS_TOO_LARGE = Response(431, b"431 Request Header Fields Too Large", "text/plain; charset=utf-8")

# deadline kinds (what the sweep does when a connection's deadline passes)
_D_NONE = 0  # no deadline: a handler runs, or we wait on our own pipeline
_D_READ = 1  # receiving a request: read_timeout since its first byte
_D_IDLE = 2  # keep-alive between requests
_D_WRITE = 3  # the client stopped reading our response
_D_LINGER = 4  # half-closed, discarding input until the client closes


# raw request path -> the path as sent (absolute form and fragment removed, still
# percent-encoded: the router splits it before decoding each segment); hot paths repeat; bounded
_PATHS: dict[bytes, str] = {}
# raw header name -> its lower-case str (names repeat on every request); bounded, first come
_NAMES: dict[bytes, str] = {}


def _decode_path(rp: bytes) -> str:
    s = rp.decode("latin-1") if rp.isascii() else rp.decode("utf-8", "replace")
    if s[:1] != "/" and s != "*":
        try:  # absolute-form ("GET http://host/path HTTP/1.1")
            s = (httptools.parse_url(rp).path or b"/").decode("latin-1")
        except httptools.HttpParserInvalidURLError:
            pass
    if "#" in s:
        s = s.partition("#")[0]
    path = s
    if len(rp) <= 256:
        if len(_PATHS) >= 4096:
            _PATHS.clear()
        _PATHS[rp] = path
    return path


class _Abort(Exception):
    """Raised inside a parser callback to stop parsing (the answer is queued)."""


class _Conn(asyncio.Protocol):
    """One HTTP/1.x connection. Parser callbacks (on_*) run inside feed_data."""

    __slots__ = (
        "_app", "_body", "_body_len", "_busy", "_closing", "_deadline", "_dkind", "_eof", "_expect", "_fast", "_hang",
        "_hdr_bytes", "_hdr_done", "_hdr_raw", "_headers", "_hosts", "_in_msg", "_in_start", "_limit", "_limit_status",
        "_linger_bytes", "_loop", "_lost", "_max_hdr", "_method", "_parser", "_path", "_peer", "_query", "_queue",
        "_rpaused", "_srv", "_stop_parse", "_task", "_transport", "_url", "_wpaused",
    )

    def __init__(self, srv: Http1Server, peer: str) -> None:
        self._srv = srv
        self._app = srv._app
        # The app's synchronous entry (RoutedApp.handle_fast): a request it takes runs with
        # no task, no future and no context of its own; its answer comes by a callback.
        self._fast = getattr(srv._app, "handle_fast", None)
        self._in_start = False
        self._loop = srv._loop
        self._peer = peer
        self._max_hdr = srv._limits.max_header_bytes
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        # current message
        self._in_msg = False  # first byte seen, message not complete
        self._hdr_done = False  # headers of the current message complete
        self._url = b""
        self._headers: dict[str, str] = {}
        self._hosts = 0  # Host header lines in the current message
        self._body: list[bytes] = []
        self._body_len = 0
        self._hdr_bytes = 0  # exact: url + complete header lines
        self._hdr_raw = 0  # raw bytes received while in the header phase (bounds partial lines)
        self._limit = 0
        self._limit_status = 413
        self._method = ""
        self._path = ""
        self._query: dict[str, list[str]] = {}
        self._expect = False  # owe "100 Continue" for the message being received
        # pipeline: (request, keep-alive flag, None) or (None, 0, error response to send before closing)
        self._queue: deque[tuple[Request | None, int, Response | None]] = deque()
        self._busy = False  # a handler task runs
        self._task: asyncio.Task[None] | None = None
        self._hang: Hangup | None = None  # the running handler's client-gone signal
        self._stop_parse = False  # parse no more input (error queued, or a "close" request received)
        self._closing = False  # final response written: half-closed, lingering
        self._eof = False  # the client half-closed its side
        self._lost = False
        self._rpaused = False
        self._wpaused = False
        self._deadline = 0.0
        self._dkind = _D_NONE
        self._linger_bytes = 0

    # ---- asyncio.Protocol ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        srv = self._srv
        srv._conns.add(self)
        if srv._draining:
            transport.close()
            return
        self._deadline = self._loop.time() + srv._limits.idle_timeout
        self._dkind = _D_IDLE

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._deadline = 0.0
        self._dkind = _D_NONE
        self._queue.clear()
        self._parser = None  # type: ignore[assignment]  # break the parser <-> protocol cycle
        self._srv._conn_closed(self)
        h = self._hang
        if h is not None:
            h.client_gone()  # a parked long poll gives back what it holds, now

    def eof_received(self) -> bool:
        self._eof = True
        if self._closing:
            return False  # lingering: the client is done, close now
        h = self._hang
        if h is not None and self._busy:
            # EOF while a request runs: the client is gone (as Go's server sees it). A long
            # poll is cancelled at once; then the connection closes (see _run).
            h.client_gone()
            if h.armed:
                self._stop_parse = True
                self._queue.clear()
                return True
        if self._busy or self._queue:
            # half-closed after sending complete requests: answer them, then close
            self._stop_parse = True
            return True
        return False  # idle or mid-request: nothing more can arrive, close

    def pause_writing(self) -> None:
        self._wpaused = True
        if self._dkind != _D_LINGER:
            self._deadline = self._loop.time() + self._srv._limits.idle_timeout
            self._dkind = _D_WRITE

    def resume_writing(self) -> None:
        self._wpaused = False
        if self._lost:
            return
        if self._closing:
            if self._dkind == _D_WRITE:  # the final response is mostly out: now linger
                self._deadline = self._loop.time() + min(_LINGER_SECONDS, self._srv._limits.read_timeout)
                self._dkind = _D_LINGER
            return
        if self._dkind == _D_WRITE:
            self._deadline = 0.0
            self._dkind = _D_NONE
        if not self._busy:
            self._next()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            self._linger_bytes += len(data)
            if self._linger_bytes > _LINGER_MAX_BYTES and self._transport is not None:
                self._transport.abort()
            return
        if self._stop_parse:
            return
        if not self._hdr_done:
            self._hdr_raw += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            if not self._stop_parse:  # not our own abort: a bug in a callback
                log.error("HTTP/1 parser callback failed", exc_info=e.__context__ or e)
                self._fail(self._error(InternalError()))
        except httptools.HttpParserUpgrade:
            if not self._stop_parse:
                self._fail(self._error(BadRequest("protocol upgrade not supported")))
        except httptools.HttpParserError as e:
            if not self._stop_parse:
                log.debug("malformed HTTP/1 request from %s: %s", self._peer, e)
                self._fail(self._error(BadRequest("malformed HTTP request")))
        if not self._hdr_done and not self._stop_parse and self._hdr_raw > self._max_hdr:
            self._fail(_HEADERS_TOO_LARGE)
        if self._queue or self._expect:
            if not self._busy:
                self._next()
            if self._queue and not self._rpaused and not self._closing and not self._lost:
                # a complete request waits behind a running handler (or a slow reader): stop reading
                self._rpaused = True
                self._transport.pause_reading()  # type: ignore[union-attr]

    # ---- httptools callbacks -------------------------------------------------

    def on_message_begin(self) -> None:
        if self._stop_parse:
            raise _Abort  # nothing after a "Connection: close" request is answered
        self._in_msg = True
        self._hdr_done = False
        self._url = b""
        self._headers = {}
        self._hosts = 0
        self._body = []
        self._body_len = 0
        self._hdr_bytes = 0
        self._expect = False
        if not self._busy and not self._queue:
            self._deadline = self._loop.time() + self._srv._limits.read_timeout
            self._dkind = _D_READ
        else:
            self._deadline = 0.0
            self._dkind = _D_NONE

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._hdr_bytes += len(url)
        if self._hdr_bytes > self._max_hdr:
            self._fail(_HEADERS_TOO_LARGE)
            raise _Abort

    def on_header(self, name: bytes, value: bytes) -> None:
        self._hdr_bytes += len(name) + len(value) + 4
        if self._hdr_bytes > self._max_hdr:
            self._fail(_HEADERS_TOO_LARGE)
            raise _Abort
        n = _NAMES.get(name)
        if n is None:
            n = name.decode("latin-1").lower()
            if len(_NAMES) < 256 and len(name) <= 64:
                _NAMES[name] = n
        v = value.decode("latin-1")
        if n == "host":
            self._hosts += 1
        h = self._headers
        old = h.get(n)
        h[n] = v if old is None else f"{old}, {v}"

    def on_headers_complete(self) -> None:
        self._hdr_done = True
        self._hdr_raw = 0
        p = self._parser
        if p.should_upgrade():
            self._fail(self._error(BadRequest("protocol upgrade not supported")))
            raise _Abort
        self._method = method = p.get_method().decode("ascii")
        self._parse_target()
        h = self._headers
        cl = h.get("content-length")
        chunked = "transfer-encoding" in h  # llhttp rejects any request transfer-coding not ending in chunked
        if cl is None and not chunked:
            return  # no body
        limit, status = self._app.body_limit(method, self._path)
        self._limit = limit
        self._limit_status = status
        if cl is not None and not chunked:
            try:
                n = int(cl)
            except ValueError:
                self._fail(self._error(BadRequest("malformed HTTP request")))
                raise _Abort from None
            if n > limit:
                self._fail(self._too_large())
                raise _Abort
            if n == 0:
                return
        exp = h.get("expect")
        if exp is not None and exp.lower() == "100-continue":
            self._expect = True  # sent from data_received once nothing is ahead of this request

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self._limit:
            self._fail(self._too_large())
            raise _Abort
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_msg = False
        self._hdr_done = False
        self._hdr_raw = 0
        self._expect = False
        self._deadline = 0.0
        self._dkind = _D_NONE
        if self._hosts != 1 and (self._hosts or self._parser.get_http_version() != "1.0"):
            # RFC 9112 3.2: exactly one Host in HTTP/1.1 (none is fine in 1.0, two never)
            self._fail(self._error(BadRequest("missing required Host header" if not self._hosts
                                              else "too many Host headers")))
            return
        b = self._body
        body = b"" if not b else (b[0] if len(b) == 1 else b"".join(b))
        h = self._headers
        path = self._path
        req = Request(self._method, unquote(path) if "%" in path else path, self._query, h, body, self._peer, "h1",
                      raw_path=path)
        if self._parser.should_keep_alive():
            c = h.get("connection")
            keep = 2 if c is not None and "keep-alive" in c.lower() else 1  # 2: echo "Connection: keep-alive" (1.0)
        else:
            keep = 0
            self._stop_parse = True  # the client will send nothing more we should answer
        if self._busy or self._queue or self._wpaused:
            self._queue.append((req, keep, None))  # pipelined: runs after what is ahead of it
        else:  # fast path: start the handler now (create_task only schedules it)
            self._start(req, keep)

    # ---- request processing --------------------------------------------------

    def _parse_target(self) -> None:
        raw = self._url
        i = raw.find(b"?")
        rp = raw if i < 0 else raw[:i]
        path = _PATHS.get(rp)
        self._path = path if path is not None else _decode_path(rp)
        if i < 0 or i == len(raw) - 1:
            self._query = {}
            return
        qs = raw[i + 1:].decode("latin-1") if raw.isascii() else raw[i + 1:].decode("utf-8", "replace")
        if "#" in qs:
            qs = qs.partition("#")[0]
        if "%" not in qs and "+" not in qs:
            # Common case (nothing escaped): split by hand, ~4x faster than parse_qs.
            q: dict[str, list[str]] = {}
            for part in qs.split("&"):
                if part:
                    k, _, v = part.partition("=")
                    vals = q.get(k)
                    if vals is None:
                        q[k] = [v]
                    else:
                        vals.append(v)
            self._query = q
            return
        # surrogateescape keeps non-UTF-8 bytes (binary keys) recoverable: .encode("utf-8", "surrogateescape")
        self._query = parse_qs(qs, keep_blank_values=True, errors="surrogateescape")

    def _too_large(self) -> Response:
        if self._limit_status == 400:
            return self._error(BadRequest("request body too large"))
        return self._error(PayloadTooLarge())

    def _error(self, err: NaradError) -> Response:
        try:
            return self._app.error_response(err)
        except Exception:
            log.exception("app.error_response failed")
            return Response(err.status, err.message.encode(), "text/plain; charset=utf-8")

    def _fail(self, resp: Response) -> None:
        """Stop parsing; answer ``resp`` (after everything queued before it) and close."""
        if self._stop_parse and self._queue and self._queue[-1][2] is not None:
            return  # already failing
        self._stop_parse = True
        self._expect = False
        self._queue.append((None, 0, resp))

    def _next(self) -> None:
        """Start the next queued item, or go back to waiting on the client."""
        if self._busy or self._wpaused or self._lost or self._closing:
            return
        q = self._queue
        if q:
            req, keep, err = q.popleft()
            if req is None:
                try:
                    self._write(err, False, True, 0)  # type: ignore[arg-type]
                except Exception:
                    log.exception("cannot serialize error response")
                    self._transport.abort()  # type: ignore[union-attr]
                    return
                self._finish()
                return
            self._deadline = 0.0
            self._dkind = _D_NONE
            self._start(req, keep)
            return
        tr = self._transport
        if self._srv._draining and not self._in_msg:
            tr.close()  # type: ignore[union-attr]
            return
        if self._eof:
            tr.close()  # type: ignore[union-attr]
            return
        if self._rpaused and not self._stop_parse:
            self._rpaused = False
            tr.resume_reading()  # type: ignore[union-attr]
        if self._in_msg:
            if self._expect and self._hdr_done:
                self._expect = False
                tr.write(_CONTINUE)  # type: ignore[union-attr]
            if self._dkind != _D_READ:
                self._deadline = self._loop.time() + self._srv._limits.read_timeout
                self._dkind = _D_READ
        else:
            self._deadline = self._loop.time() + self._srv._limits.idle_timeout
            self._dkind = _D_IDLE

    def _start(self, req: Request, keep: int) -> None:
        self._busy = True
        fast = self._fast
        if fast is not None:
            self._in_start = True
            try:
                if fast(req, lambda resp: self._fast_done(req, keep, resp)):
                    return  # taken: the answer arrives through _fast_done
            except Exception:
                log.exception("app.handle_fast raised", extra={"method": req.method, "path": req.path})
                self._fast_done(req, keep, self._error(InternalError()))
                return
            finally:
                self._in_start = False
        h = self._hang = Hangup(self._eof)  # a request run after EOF meets a client already gone
        h.task = self._task = self._loop.create_task(self._run(req, keep, h))

    def _fast_done(self, req: Request, keep: int, resp: Response) -> None:
        if self._in_start:
            # answered inside the parser callback that started it: write from the loop, as a task would
            self._loop.call_soon(self._fast_done, req, keep, resp)
            return
        if not self._busy:
            return  # answered twice (a bug in a handler): the first answer stands
        self._busy = False
        self._respond(req, keep, resp)

    async def _run(self, req: Request, keep: int, h: Hangup) -> None:
        enter(h)
        try:
            resp = await self._app.handle(req)
        except Exception:
            log.exception("app.handle raised", extra={"method": req.method, "path": req.path})
            resp = self._error(InternalError())
        except BaseException:  # cancelled: the client went away, or a forced shutdown
            self._busy = False
            self._task = None
            self._hang = None
            self._srv._orphans.discard(self)
            if h.gone and not self._lost and self._transport is not None:
                self._transport.close()  # nothing more is answered to a client that hung up
            raise
        self._busy = False
        self._task = None
        self._hang = None
        if h.gone and h.armed and not self._lost:
            # the client went away as the handler finished: its answer reaches nobody
            self._srv._orphans.discard(self)
            if resp.on_dropped is not None:
                try:
                    resp.on_dropped()
                except Exception:
                    log.exception("on_dropped hook failed")
            if self._transport is not None:
                self._transport.close()
            return
        self._respond(req, keep, resp)

    def _respond(self, req: Request, keep: int, resp: Response) -> None:
        """Write the answer of the request that just finished, then go on with the connection."""
        if self._lost:
            self._srv._orphans.discard(self)  # the client went away: drop the response
            if resp.on_dropped is not None:
                try:
                    resp.on_dropped()
                except Exception:
                    log.exception("on_dropped hook failed")
            return
        close = keep == 0 or self._srv._draining or (self._eof and not self._queue)
        try:
            self._write(resp, req.method == "HEAD", close, keep)
        except Exception:
            log.exception("cannot serialize response", extra={"method": req.method, "path": req.path})
            close = True
            try:
                self._write(self._error(InternalError()), False, True, 0)
            except Exception:
                log.exception("cannot serialize error response")
                self._transport.abort()  # type: ignore[union-attr]
                return
        if close:
            self._finish()
        elif self._queue or self._in_msg or self._wpaused or self._rpaused:
            self._next()
        else:  # fast path of _next(): idle keep-alive connection
            self._deadline = self._loop.time() + self._srv._limits.idle_timeout
            self._dkind = _D_IDLE

    def _write(self, resp: Response, head: bool, close: bool, keep: int) -> None:
        status = resp.status
        hdrs = resp.headers
        body = resp.body
        if (not body or (status < 300 and len(body) <= SMALL_BODY)) and len(hdrs) <= 4:
            # a bodiless answer (202 of a produce, 204) or a short one (``{"duplicate":false}``,
            # ``{"accepted":100}``): its bytes repeat, kept whole (head and body) by their content
            k = (status, resp.content_type, 0 if close else keep, head, tuple(hdrs) if hdrs else (), body)
            heads = self._srv._heads
            try:
                hb = heads.get(k)
            except TypeError:  # a header given as a list: not a key
                self._transport.write(self._head(resp, head, close, keep, True))  # type: ignore[union-attr]
                return
            if hb is None:
                hb = self._head(resp, head, close, keep, True)
                if len(heads) < 256:
                    heads[k] = hb
            self._transport.write(hb)  # type: ignore[union-attr]
            return
        self._transport.write(self._head(resp, head, close, keep, True))  # type: ignore[union-attr]

    def _head(self, resp: Response, head: bool, close: bool, keep: int, with_body: bool = False) -> bytes:
        """The response's bytes: the head, and the body too when ``with_body``."""
        status = resp.status
        line = _STATUS_LINES.get(status)
        if line is None:
            if not 100 <= status <= 999:
                raise ValueError(f"invalid status {status!r}")
            line = f"HTTP/1.1 {status} \r\n"
        body = resp.body
        ct = resp.content_type
        hdrs = resp.headers
        lines = 1 + len(hdrs)
        if status < 200 or status == 204 or status == 304:
            body = b""  # never a body, nor a Content-Length (RFC 9110 8.6)
            s = line
        else:
            s = f"{line}Content-Length: {len(body)}\r\n"
            lines += 1
            if head:
                body = b""
        if ct is not None:
            s = f"{s}Content-Type: {ct}\r\n"
            lines += 1
        for name, value in hdrs:
            s += f"{name}: {value}\r\n"
        # every line so far ends in CRLF; any other CR or LF came from the app (header injection): refuse
        if s.count("\n") != lines or s.count("\r") != lines:
            raise ValueError("CR or LF inside a response header")
        s += self._srv._tails[0 if close else keep]
        try:
            hb = s.encode("latin-1")
        except UnicodeEncodeError:
            hb = s.encode("utf-8")
        return hb + body if body and with_body else hb

    def _finish(self) -> None:
        """The last response is written: half-close and linger until the client closes."""
        self._closing = True
        self._queue.clear()
        self._expect = False
        tr = self._transport
        if tr is None or self._lost:
            return
        if self._eof or not tr.can_write_eof():
            tr.close()
            return
        if self._rpaused:
            self._rpaused = False
            tr.resume_reading()
        try:
            tr.write_eof()
        except (OSError, RuntimeError):
            tr.close()
            return
        if not self._wpaused:  # else the write-stall deadline runs until resume_writing
            self._deadline = self._loop.time() + min(_LINGER_SECONDS, self._srv._limits.read_timeout)
            self._dkind = _D_LINGER

    # ---- server hooks --------------------------------------------------------

    def _on_deadline(self) -> None:
        tr = self._transport
        kind = self._dkind
        self._deadline = 0.0
        self._dkind = _D_NONE
        if tr is None or self._lost:
            return
        if kind == _D_READ:
            log.debug("HTTP/1 read timeout from %s", self._peer)
            tr.abort()
        elif kind in (_D_IDLE, _D_LINGER):
            tr.close()  # a lingering connection's response already left our buffer: a plain close keeps it
        elif kind == _D_WRITE:
            log.debug("HTTP/1 client %s stopped reading; closing", self._peer)
            tr.abort()

    def _drain(self) -> None:
        """Server is draining: close now if idle, else after the in-flight response."""
        if self._lost or self._closing:
            return
        if not self._busy and not self._queue and not self._in_msg and not self._wpaused:
            self._transport.close()  # type: ignore[union-attr]

    def _force_close(self) -> None:
        if self._transport is not None and not self._lost:
            self._transport.abort()


class Http1Server:
    """HTTP/1.1 server on an already bound and listening TCP socket."""

    def __init__(self, app: App, sock: socket.socket, limits: Http1Limits) -> None:
        self._app = app
        self._sock = sock
        self._limits = limits
        alt = f"Alt-Svc: {limits.alt_svc}\r\n" if limits.alt_svc else ""
        # end of every response head, by keep-alive flag: 0 close, 1 keep-alive, 2 keep-alive echoed (HTTP/1.0)
        self._tails = (f"{alt}Connection: close\r\n\r\n", f"{alt}\r\n", f"{alt}Connection: keep-alive\r\n\r\n")
        # (status, content type, keep-alive flag, HEAD, headers) -> the bytes of a bodiless response with at
        # most 4 headers of its own (a produce's 202, a 204); bounded (first come)
        self._heads: dict[tuple[int, str | None, int, bool, tuple[tuple[str, str], ...], bytes], bytes] = {}
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()
        self._conns: set[_Conn] = set()
        self._orphans: set[_Conn] = set()  # connection gone, handler still running (keeps the task alive)
        self._accept_task: asyncio.Task[None] | None = None
        self._accept_waiting = False  # the accept loop sits in an await that is safe to cancel
        self._slot: asyncio.Future[None] | None = None  # set when a connection closes below the cap
        self._all_closed: asyncio.Future[None] | None = None
        self._sweep_handle: asyncio.TimerHandle | None = None
        self._draining = False
        lim = [t for t in (limits.read_timeout, limits.idle_timeout) if t > 0]
        self._tick = max(0.01, min([1.0, *(t / 4 for t in lim)]))

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        self._accept_task = self._loop.create_task(self._accept_loop())
        self._sweep_handle = self._loop.call_later(self._tick, self._sweep)

    async def stop(self) -> None:
        """Stop at once: drain with no grace."""
        await self.drain(0.0)

    async def drain(self, grace: float) -> None:
        """Stop accepting, close idle connections now, let in-flight requests finish
        (their responses carry ``Connection: close``), force-close the rest after
        ``grace`` seconds. The listening socket stays open: its owner closes it."""
        if self._loop is None:
            self._draining = True
            return
        loop = self._loop
        self._draining = True
        t = self._accept_task
        if t is not None and not t.done():
            if self._accept_waiting:
                t.cancel()
            try:
                await t
            except asyncio.CancelledError:
                pass
        for c in list(self._conns):
            c._drain()
        if self._conns:
            fut = self._all_closed = loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(fut), timeout=max(0.0, grace))
            except TimeoutError:
                pass
        if self._conns:
            log.info("HTTP/1 drain grace over, closing %d connections", len(self._conns))
        tasks = [c._task for c in (*self._conns, *self._orphans) if c._task is not None]
        for c in list(self._conns):
            c._force_close()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        await asyncio.sleep(0)  # let connection_lost callbacks run
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
            self._sweep_handle = None

    # ---- internals -------------------------------------------------------------

    async def _accept_loop(self) -> None:
        loop = self._loop
        sock = self._sock
        cap = self._limits.max_connections
        while not self._draining:
            if cap > 0 and len(self._conns) >= cap:
                self._slot = loop.create_future()
                self._accept_waiting = True
                try:
                    await self._slot
                finally:
                    self._accept_waiting = False
                    self._slot = None
                continue
            self._accept_waiting = True
            try:
                conn, addr = await loop.sock_accept(sock)
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("accept failed (%s); pausing accepts for 100 ms", e)
                    await asyncio.sleep(0.1)
                elif e.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
                    log.info("listening socket closed; accept loop ends")
                    return
                else:
                    log.debug("accept failed: %s", e)
                continue
            except Exception:
                log.exception("accept loop failed; retrying in 100 ms")
                await asyncio.sleep(0.1)
                continue
            finally:
                self._accept_waiting = False
            if self._draining:
                conn.close()
                return
            try:
                conn.setblocking(False)
                if conn.family in (socket.AF_INET, socket.AF_INET6):
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peer = addr[0] if isinstance(addr, tuple) else str(addr)
            except OSError as e:
                log.debug("accepted socket unusable: %s", e)
                conn.close()
                continue
            try:
                await loop.connect_accepted_socket(lambda p=peer: _Conn(self, p), conn)  # type: ignore[misc]
            except Exception:
                log.exception("cannot set up accepted connection")

    def _conn_closed(self, c: _Conn) -> None:
        self._conns.discard(c)
        if c._busy:
            self._orphans.add(c)
        s = self._slot
        if s is not None and not s.done():
            s.set_result(None)
        f = self._all_closed
        if f is not None and not self._conns and not f.done():
            f.set_result(None)

    def _sweep(self) -> None:
        now = self._loop.time()
        due = [c for c in self._conns if 0.0 < c._deadline <= now]
        for c in due:
            try:
                c._on_deadline()
            except Exception:
                log.exception("timeout handling failed")
        self._sweep_handle = self._loop.call_later(self._tick, self._sweep)
