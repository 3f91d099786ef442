"""How the SDK sends one request to one node: HTTP/1.1 over an httpx keep-alive
pool (the default), or HTTP/3 over narad.client.h3 (one QUIC connection per node).

A transport returns ``(status, headers, body)`` or raises a TransportError that
says whether anything was sent: ``ConnectError`` (nothing sent: always safe to
retry), ``RequestTimeout`` / ``ConnectionLost`` (sent; the outcome is unknown).

Imports narad.client.{errors,h3}, httpx, the standard library.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httpx

from narad.client.errors import ClientClosed, ConnectError, ConnectionLost, PoolTimeout, RequestTimeout
from narad.client.h3 import H3Client, H3StreamError

__all__ = ["H1Transport", "H3Transport", "NodeAddr", "Transport", "parse_node"]

DEFAULT_PORT = 7942


@dataclass(frozen=True, slots=True)
class NodeAddr:
    scheme: str  # http | https
    host: str
    port: int

    @property
    def base(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_node(text: str) -> NodeAddr:
    """``host``, ``host:port``, ``[v6]:port`` or ``http(s)://host:port``."""
    s = text.strip()
    if not s:
        raise ValueError("empty node address")
    if "://" not in s:
        s = "http://" + s
    u = urlsplit(s)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"bad node address {text!r} (host:port or http://host:port)")
    return NodeAddr(u.scheme, u.hostname, u.port or DEFAULT_PORT)


Answer = tuple[int, dict[str, str], bytes]


class Transport(Protocol):
    async def request(self, node: NodeAddr, method: str, target: str, headers: dict[str, str], body: bytes,
                      timeout: float) -> Answer: ...

    async def aclose(self) -> None: ...


class H1Transport:
    """HTTP/1.1 keep-alive pool (httpx.AsyncClient): connections are reused per node,
    at most ``max_connections`` open in all (a long poll holds one for its wait)."""

    def __init__(self, *, max_connections: int = 100, max_keepalive: int = 20, keepalive_expiry: float = 5.0,
                 connect_timeout: float = 3.0, verify: bool | str | ssl.SSLContext = True) -> None:
        self._connect_timeout = connect_timeout
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_keepalive,
                                keepalive_expiry=keepalive_expiry),
            verify=verify,
            trust_env=False,
            follow_redirects=False,
        )

    async def request(self, node: NodeAddr, method: str, target: str, headers: dict[str, str], body: bytes,
                      timeout: float) -> Answer:
        where = str(node)
        to = httpx.Timeout(timeout, connect=min(self._connect_timeout, timeout), pool=timeout)
        try:
            r = await self._client.request(method, node.base + target, headers=headers,
                                           content=body if body else None, timeout=to)
        except httpx.PoolTimeout as e:
            raise PoolTimeout(f"no free connection in this client's pool for {where} within {timeout:g}s "
                              f"(raise max_connections)", node=where) from e
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise ConnectError(f"could not connect to {where}: {e or type(e).__name__}", node=where) from e
        except httpx.TimeoutException as e:
            raise RequestTimeout(f"no answer from {where} within {timeout:g}s", node=where) from e
        except (httpx.TransportError, OSError) as e:
            raise ConnectionLost(f"connection to {where} lost: {e or type(e).__name__}", node=where) from e
        except RuntimeError as e:  # httpx: "the client has been closed" (the SDK's client closed meanwhile)
            if self._client.is_closed:
                raise ClientClosed("client closed") from e
            raise
        return r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content

    async def aclose(self) -> None:
        await self._client.aclose()


class H3Transport:
    """HTTP/3: one narad.client.h3.H3Client per node, opened at first use and opened
    again after it fails. ``verify`` False accepts the node's self-signed certificate."""

    H3_REQUEST_REJECTED = 0x10B  # the server did not process the stream: safe to retry

    def __init__(self, *, verify: bool | str = True, connect_timeout: float = 3.0) -> None:
        self._verify = verify  # a str: a PEM file of CA certificates
        self._connect_timeout = connect_timeout
        self._conns: dict[NodeAddr, H3Client] = {}
        self._locks: dict[NodeAddr, asyncio.Lock] = {}
        self._closing: set[asyncio.Future[None]] = set()  # connections dropped after a timeout, closing

    async def _conn(self, node: NodeAddr) -> H3Client:
        c = self._conns.get(node)
        if c is not None and not c.closed:
            return c
        lock = self._locks.setdefault(node, asyncio.Lock())
        async with lock:
            c = self._conns.get(node)
            if c is not None and not c.closed:
                return c
            if c is not None:
                self._conns.pop(node, None)
                await c.close()
            try:
                c = await H3Client.connect(node.host, node.port, verify=self._verify, timeout=self._connect_timeout)
            except (TimeoutError, OSError, ConnectionError) as e:
                raise ConnectError(f"could not open HTTP/3 to {node}: {e or type(e).__name__}", node=str(node)) from e
            self._conns[node] = c
            return c

    async def request(self, node: NodeAddr, method: str, target: str, headers: dict[str, str], body: bytes,
                      timeout: float) -> Answer:
        c = await self._conn(node)
        where = str(node)
        try:
            return await c.request(method, target, headers=headers, body=body, timeout=timeout)
        except TimeoutError as e:
            # The connection may be dead (a node killed and restarted on the same port: QUIC only
            # notices after its idle timeout): it is not reused; the next request opens a new one,
            # as an HTTP/1.1 client drops a connection whose read timed out.
            if self._conns.get(node) is c:
                del self._conns[node]
                task = asyncio.ensure_future(c.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            raise RequestTimeout(f"no answer from {where} within {timeout:g}s", node=where) from e
        except H3StreamError as e:
            if e.error_code == self.H3_REQUEST_REJECTED:
                raise ConnectError(f"{where} rejected the request unprocessed (draining)", node=where) from e
            raise ConnectionLost(f"stream to {where} reset: {e}", node=where) from e
        except (ConnectionError, OSError) as e:
            raise ConnectionLost(f"HTTP/3 connection to {where} lost: {e}", node=where) from e

    async def aclose(self) -> None:
        conns, self._conns = self._conns, {}
        for c in conns.values():
            await c.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
