"""The separate metrics listener (``http.metrics_addr``): ``/metrics``,
``/healthz`` and ``/readyz`` over plain HTTP/1.1, no credentials, served by
the supervisor.

Why the supervisor: it gathers every process's metrics anyway (a worker's
/metrics asks it), and it answers even while a worker is stuck or being
restarted, which is when an operator's scrape matters most. /metrics here
shows every topic's series (no caller to filter for); the API port's
/metrics answers 404 while this listener is configured (narad.api).
/healthz and /readyz follow the API port's rules (narad.api.ops): the
heartbeats of ``narad.meta.versions`` first, then the readiness the
supervisor publishes.

The parser is deliberately small: a request head of at most 16 KiB, GET or
HEAD, no body, keep-alive for HTTP/1.1, at most 64 connections, 30 s idle.
Anything else gets 400 and the connection is closed.

Imports narad.metrics, narad.meta.versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable

from narad import metrics
from narad.errors import ConfigError
from narad.meta import versions as V

log = logging.getLogger("narad.supervisor.metrics")

HEAD_LIMIT = 16 << 10
IDLE_TIMEOUT = 30.0
MAX_CONNECTIONS = 64
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            503: "Service Unavailable"}
TEXT = "text/plain; charset=utf-8"
JSON = "application/json"


def parse_addr(addr: str) -> tuple[str, int]:
    """``host:port``, ``:port`` (every interface) or ``[v6]:port`` -> (host, port);
    host "" means every interface."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"http.metrics_addr must be host:port (or :port), got {addr!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"http.metrics_addr: write an IPv6 host in brackets ([::1]:9100), got {addr!r}")
    return host, int(port)


class MetricsListener:
    def __init__(self, versions: V.VersionTable, workers: int,
                 gather: Callable[[], Awaitable[list[metrics.Family]]]) -> None:
        self.versions = versions
        self.workers = workers
        self.gather = gather
        self.server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._serve, host or None, port, limit=HEAD_LIMIT,
                                                 reuse_address=True)
        log.info("metrics listener serving", extra={"addr": f"{host}:{port}"})

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in list(self._conns):
            t.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)

    # ---- the three routes ----------------------------------------------------------------
    def healthz(self) -> tuple[int, str, bytes]:
        if self.versions.load(V.SHUTDOWN):
            return _json(503, {"error": "shutting down"})
        silent = V.not_responding(self.versions.hb, self.workers)
        vital = [f"{n} not responding for {a:.1f}s" for n, a in silent if n in ("supervisor", "raft tick thread")]
        if vital:
            return _json(503, {"error": "node is not healthy: " + "; ".join(vital)})
        return _json(200, {"status": "ok"})

    def readyz(self) -> tuple[int, str, bytes]:
        silent = V.not_responding(self.versions.hb, self.workers)
        if silent and not self.versions.load(V.SHUTDOWN):
            why = "; ".join(f"{n} not responding for {a:.1f}s" for n, a in silent)
            return _json(503, {"error": f"node is not ready: {why}"})
        failing = V.failing(self.versions.hb, self.workers)
        if failing and not self.versions.load(V.SHUTDOWN):
            return _json(503, {"error": "node is not ready: " + "; ".join(failing)})
        if self.versions.load(V.READY) == 1:
            return _json(200, {"status": "ready"})
        reason = V.READY_REASONS.get(self.versions.load(V.READY_REASON), "not ready")
        return _json(503, {"error": f"metastore: node is not ready: {reason}"})

    async def metrics(self) -> tuple[int, str, bytes]:
        families = await self.gather()
        body = await asyncio.to_thread(metrics.render, families)  # off the loop: the heartbeats go on
        return 200, metrics.CONTENT_TYPE, body

    async def route(self, method: str, target: str) -> tuple[int, str, bytes, list[tuple[str, str]]]:
        path = target.split("?", 1)[0]
        if path not in ("/metrics", "/healthz", "/readyz"):
            return 404, TEXT, b"404 page not found\n", []
        if method not in ("GET", "HEAD"):
            return 405, TEXT, b"405 method not allowed\n", [("Allow", "GET, HEAD")]
        if path == "/metrics":
            return (*await self.metrics(), [])
        return (*(self.healthz() if path == "/healthz" else self.readyz()), [])

    # ---- HTTP/1.1 --------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if len(self._conns) >= MAX_CONNECTIONS or task is None:
            writer.close()
            return
        self._conns.add(task)
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE_TIMEOUT)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                    break
                lines = head.decode("latin-1").split("\r\n")
                parts = lines[0].split(" ")
                headers: dict[str, str] = {}
                for line in lines[1:]:
                    if line:
                        k, _, v = line.partition(":")
                        headers[k.strip().lower()] = v.strip()
                if (len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0")
                        or headers.get("content-length", "0") != "0" or "transfer-encoding" in headers):
                    await _write(writer, 400, TEXT, b"400 bad request\n", [], False, True)
                    break
                method, target, version = parts
                keep = (version == "HTTP/1.1" and headers.get("connection", "").lower() != "close")
                try:
                    status, ctype, body, extra = await self.route(method, target)
                except Exception:
                    log.exception("metrics listener: a request failed")
                    status, ctype, body, extra = 503, JSON, b'{"error":"metrics unavailable; retry"}', []
                await _write(writer, status, ctype, body, extra, method == "HEAD", not keep)
                if not keep:
                    break
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(task)
            with contextlib.suppress(Exception):
                writer.close()


def _json(status: int, obj: object) -> tuple[int, str, bytes]:
    return status, JSON, json.dumps(obj, separators=(",", ":")).encode()


async def _write(writer: asyncio.StreamWriter, status: int, ctype: str, body: bytes,
                 extra: list[tuple[str, str]], head_only: bool, close: bool) -> None:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}", f"Content-Type: {ctype}",
             f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in extra]
    if close:
        lines.append("Connection: close")
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    if not head_only:
        writer.write(body)
    await writer.drain()
