"""The node's client sockets and the data-directory lock.

The supervisor creates N SO_REUSEPORT TCP listeners and N SO_REUSEPORT UDP
sockets on the client port once, keeps them open for its whole life, and
hands socket i to worker i (re-forked onto the same pair after a crash), so
the kernel's reuseport group never changes and a restarted worker costs only
its own QUIC connections (deps-study, aioquic). The cluster (node RPC) port
gets N SO_REUSEPORT TCP listeners made the same way (``make_cluster_sockets``).

SO_REUSEPORT would let a second process bind a port this node uses (or this
node bind one another process uses) and silently share its clients, so every
port is first probed with a plain bind (no SO_REUSEPORT): a port another
process holds stops the start with an error naming the port and, where /proc
tells, the holder (``PortInUse``). Imports no narad module.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

SocketPair = tuple[socket.socket, socket.socket | None]

# A predecessor killed a moment ago (kill -9 of the whole group) may still be
# closing its sockets: a held port is probed again for this long before refusing.
PROBE_WAIT = 3.0


class PortInUse(RuntimeError):
    """Another process holds a port this node must bind: the node refuses to start."""


def _holders(port: int, kind: int) -> list[str]:
    """Best effort: "pid N (name)" of the processes with a socket on ``port``
    (from /proc; processes of other users are not visible)."""
    names = ("tcp", "tcp6") if kind == socket.SOCK_STREAM else ("udp", "udp6")
    inodes: set[str] = set()
    for name in names:
        try:
            with open(f"/proc/net/{name}") as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or not cols[1].endswith(f":{port:04X}"):
                continue
            if kind == socket.SOCK_STREAM and cols[3] != "0A":  # LISTEN only
                continue
            inodes.add(cols[9])
    out: list[str] = []
    if not inodes:
        return out
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if not any(os.readlink(f"/proc/{pid}/fd/{fd}") in wanted for fd in fds):
                continue
            with open(f"/proc/{pid}/comm") as fh:
                out.append(f"pid {pid} ({fh.read().strip()})")
        except OSError:
            continue
        if len(out) >= 5:
            break
    return out


def check_port_free(host: str, port: int, what: str, *, tcp: bool = True, udp: bool = False) -> None:
    """Refuse (PortInUse) if another process holds ``host:port``: a plain bind
    without SO_REUSEPORT (TCP with SO_REUSEADDR, so this node's own TIME_WAIT
    connections from a previous run do not count) must succeed. Retried for
    PROBE_WAIT seconds, for a predecessor that is still exiting."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    kinds = ([socket.SOCK_STREAM] if tcp else []) + ([socket.SOCK_DGRAM] if udp else [])
    end = time.monotonic() + PROBE_WAIT
    for kind in kinds:
        while True:
            with socket.socket(family, kind) as s:
                if kind == socket.SOCK_STREAM:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((host, port))
                    break
                except OSError as e:
                    if e.errno != errno.EADDRINUSE or time.monotonic() >= end:
                        proto = "TCP" if kind == socket.SOCK_STREAM else "UDP"
                        held = _holders(port, kind) if e.errno == errno.EADDRINUSE else []
                        by = f" by {', '.join(held)}" if held else " by another process"
                        reason = f"is in use{by}" if e.errno == errno.EADDRINUSE else f"cannot be bound: {e.strerror}"
                        raise PortInUse(f"the {what} port {host}:{port} ({proto}) {reason}; stop that process "
                                        f"or choose another port") from None
            time.sleep(0.05)


def make_client_sockets(host: str, port: int, count: int, *, quic: bool) -> list[SocketPair]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    out: list[tuple[socket.socket, socket.socket | None]] = []
    check_port_free(host, port, "client", tcp=True, udp=quic)
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
    except OSError as e:
        for t, u in out:
            t.close()
            if u is not None:
                u.close()
        raise PortInUse(f"the client port {host}:{port} cannot be bound: {e.strerror or e}") from None
    return out


def make_cluster_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """N listening SO_REUSEPORT TCP sockets on one port (the node RPC port, TLS over TCP),
    kept for life: worker i accepts on socket i, and a restarted worker gets the same one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    out: list[socket.socket] = []
    check_port_free(host, port, "cluster", tcp=True, udp=False)
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.bind((host, port))
            s.listen(1024)
            s.set_inheritable(True)
            out.append(s)
    except OSError as e:
        for s in out:
            s.close()
        raise PortInUse(f"the cluster port {host}:{port} (TCP) cannot be bound: {e.strerror or e}") from None
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
