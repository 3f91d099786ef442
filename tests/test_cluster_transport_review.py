"""Review tests for node RPC over TLS on TCP (issue 10 follow-up): holes an authenticated or
unauthenticated peer, a slow link or a stalled process could open in narad.cluster.rpc_*.

Real servers and clients on 127.0.0.1 under uvloop (the helpers of tests/test_cluster_transport.py),
real TCP relays for a slow link. Waits are on states with deadlines.
"""

from __future__ import annotations

import asyncio

from tests.test_cluster_transport import (
    Echo,
    EchoReply,
    Huge,
    client,
    conn_of,
    node,
    run,
)


class SlowRelay:
    """A TCP relay that forwards client -> server at ``rate`` bytes per second (a slow link)
    and server -> client at full speed. Small socket buffers on the relay's side, so the
    kernel does not absorb what the link has not carried yet."""

    def __init__(self, target: tuple[str, int], rate: int) -> None:
        self.target = target
        self.rate = rate
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> tuple[str, int]:
        import socket

        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
        ls.bind(("127.0.0.1", 0))
        self._server = await asyncio.start_server(self._serve, sock=ls)
        return ls.getsockname()

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(*self.target)
        self._writers += [w, uw]

        async def slow(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            chunk = max(1, self.rate // 50)
            while data := await src.read(chunk):
                dst.write(data)
                await asyncio.sleep(len(data) / self.rate)
            dst.close()

        async def fast(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
            dst.close()

        for t in (slow(r, uw), fast(ur, w)):
            task = asyncio.ensure_future(t)
            self._tasks.add(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in self._tasks:
            t.cancel()
        for w in self._writers:
            w.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def test_a_peer_that_stops_reading_does_not_grow_our_write_buffer() -> None:
    """Backpressure: a client that keeps asking for large replies but reads none of them must
    not make the server queue reply after reply in memory (it stops reading requests while its
    output is over the transport's high-water mark)."""

    async def main() -> None:
        async with node() as n, client() as c:
            conn = await conn_of(c, n.addr)
            conn.transport.pause_reading()  # we read nothing from now on
            if conn._ticker is not None:  # (and our own liveness check, which would drop it, is off)
                conn._ticker.cancel()
            (sconn,) = n.server._conns
            calls = []
            peak = 0
            for _ in range(48):  # one request at a time, each asking for 1 MiB, while watching
                calls.append(asyncio.ensure_future(c.call(n.addr, Huge(size=1 << 20), EchoReply, timeout=30.0)))
                for _ in range(3):
                    await asyncio.sleep(0.01)
                    peak = max(peak, sconn.write_buffered)
            assert n.state.calls < 48, "every request was read and answered into the write buffer"
            assert peak < 12 << 20, f"server buffered {peak} bytes of replies for a peer that reads none"
            conn.transport.resume_reading()  # and everything is still answered once it reads again
            replies = await asyncio.gather(*calls)
            assert all(len(r.blob) == 1 << 20 for r in replies) and n.state.calls == 48

    run(main(), timeout=40.0)


def test_a_large_request_on_a_slow_link_is_not_mistaken_for_a_dead_peer() -> None:
    """Head of line: while a large request is still leaving (the link carries it slower than
    the liveness window), the PING waits behind it and no PONG can come back; the bytes the peer
    keeps taking prove it alive, so the connection must not be dropped."""

    async def main() -> None:
        async with node() as n:
            relay = SlowRelay(n.addr, rate=2 << 20)
            via = await relay.start()
            try:
                async with client() as c:
                    assert (await c.call(via, Echo(text="warm"), EchoReply)).text == "warm"
                    blob = b"y" * (10 << 20)
                    r = await c.call(via, Echo(text="big", blob=blob), EchoReply, timeout=30.0)
                    assert len(r.blob) == len(blob)
                    assert c.dials == 1
            finally:
                await relay.close()

    run(main(), timeout=40.0)
