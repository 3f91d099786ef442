"""The node's client sockets and the data-directory lock.

The supervisor creates N SO_REUSEPORT TCP listeners and N SO_REUSEPORT UDP
sockets on the client port once, keeps them open for its whole life, and
hands socket i to worker i (re-forked onto the same pair after a crash), so
the kernel's reuseport group never changes and a restarted worker costs only
its own QUIC connections (deps-study, aioquic). Imports no narad module.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

SocketPair = tuple[socket.socket, socket.socket | None]


def make_client_sockets(host: str, port: int, count: int, *, quic: bool) -> list[SocketPair]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    out: list[tuple[socket.socket, socket.socket | None]] = []
    try:
        for _ in range(count):
            tcp = socket.socket(family, socket.SOCK_STREAM)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tcp.bind((host, port))
            tcp.listen(1024)
            tcp.set_inheritable(True)
            udp = None
            if quic:
                udp = socket.socket(family, socket.SOCK_DGRAM)
                udp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                udp.bind((host, port))
                udp.set_inheritable(True)
            out.append((tcp, udp))
    except OSError:
        for t, u in out:
            t.close()
            if u is not None:
                u.close()
        raise
    return out


def make_udp_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """N SO_REUSEPORT UDP sockets on one port (the node RPC port), kept for life."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    out: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((host, port))
            s.set_inheritable(True)
            out.append(s)
    except OSError:
        for s in out:
            s.close()
        raise
    return out


class DataDirLock:
    """An exclusive flock on <data_dir>/LOCK: one supervisor per data directory."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "LOCK"
        self.fd = -1

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RuntimeError(
                    f"data directory {self.path.parent} is in use by another narad-supervisor"
                    + (f" (pid {other})" if other else "")
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        os.set_inheritable(fd, False)
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
