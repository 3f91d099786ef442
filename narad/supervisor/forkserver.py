"""The fork server: the process that forks workers.

Forking a process that already runs threads (pysyncobj's tick thread) or an
event loop copies locks and loop state mid-use. So the supervisor forks this
small server first, while it is still single-threaded and holds no LMDB
environment or loop; every worker is then forked from this clean process
(with the worker code already imported, so a worker starts in milliseconds).

Protocol on a socketpair, length-prefixed msgpack tuples:
supervisor -> server: ("spawn", index, core) | ("kill", pid, signal) | ("exit",)
server -> supervisor: ("spawned", index, pid) | ("exited", pid, wait_status) | ("error", index, message)

The server dies with the supervisor (PR_SET_PDEATHSIG) and workers die with
the server, so a SIGKILLed supervisor leaves no worker holding the port.
Imports narad._native; the worker entry point is passed in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import struct
import sys
from collections.abc import Callable

import msgspec

from narad._native import lib

log = logging.getLogger("narad.supervisor.forkserver")
_LEN = struct.Struct(">I")


def set_pdeathsig(sig: int, expected_parent: int) -> None:
    """Die with `sig` when the parent dies; exit at once if it already has."""
    rc = lib.set_pdeathsig(sig, expected_parent)
    if rc != 0:
        os._exit(1)


def _send(sock: socket.socket, msg: tuple[object, ...]) -> None:
    data = msgspec.msgpack.encode(msg)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _serve(sock: socket.socket, spawn_worker: Callable[[int, int | None], int], supervisor_pid: int) -> None:
    """The fork server's loop (runs in the forked child, blocking, single thread)."""
    set_pdeathsig(signal.SIGKILL, supervisor_pid)
    # A SIGTERM sent to the whole process group (systemd's control-group kill,
    # pkill) must not take this server down: its death would SIGKILL every
    # worker mid-drain. It leaves on "exit" or with the supervisor.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    me = os.getpid()
    while True:
        try:
            ready, _, _ = select.select([sock, wake_r], [], [], 1.0)
        except InterruptedError:
            ready = []
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        while True:  # reap every exited worker
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _send(sock, ("exited", pid, status))
        if sock not in ready:
            continue
        try:
            (n,) = _LEN.unpack(_recv_exact(sock, 4))
            msg = msgspec.msgpack.decode(_recv_exact(sock, n))
        except EOFError:
            os._exit(0)
        if msg[0] == "spawn":
            index, core = msg[1], msg[2]
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    sock.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    set_pdeathsig(signal.SIGKILL, me)
                    code = spawn_worker(index, core)
                except BaseException:
                    logging.getLogger("narad.worker").exception("worker crashed")
                    code = 70
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            _send(sock, ("spawned", index, pid))
        elif msg[0] == "kill":
            try:
                os.kill(msg[1], msg[2])
            except ProcessLookupError:
                pass
        elif msg[0] == "exit":
            os._exit(0)


class ForkServer:
    """The supervisor's handle on the fork server."""

    def __init__(self, spawn_worker: Callable[[int, int | None], int]) -> None:
        self._spawn_worker = spawn_worker
        self.pid = 0
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self.on_message: Callable[[tuple[object, ...]], None] | None = None

    def start(self, close_fds: tuple[int, ...] = ()) -> None:
        """Fork the server. Call while the process has no threads and no loop.
        ``close_fds``: descriptors the server must not keep (the data-dir lock)."""
        parent, child = socket.socketpair()
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                parent.close()
                for fd in close_fds:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                _serve(child, self._spawn_worker, me)
            except BaseException:
                code = 1
            os._exit(code)
        child.close()
        self.pid = pid
        self._sock = parent

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._sock is not None
        self._sock.setblocking(False)
        loop.add_reader(self._sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(65536)
        except BlockingIOError:
            return
        if not data:
            log.error("fork server exited")
            asyncio.get_event_loop().remove_reader(self._sock.fileno())
            if self.on_message:
                self.on_message(("server_exited",))
            return
        self._buf += data
        while len(self._buf) >= 4:
            (n,) = _LEN.unpack_from(self._buf, 0)
            if len(self._buf) < 4 + n:
                break
            msg = msgspec.msgpack.decode(bytes(self._buf[4 : 4 + n]))
            del self._buf[: 4 + n]
            if self.on_message:
                self.on_message(tuple(msg))

    def _send(self, msg: tuple[object, ...]) -> None:
        assert self._sock is not None
        data = msgspec.msgpack.encode(msg)
        self._sock.setblocking(True)
        try:
            self._sock.sendall(_LEN.pack(len(data)) + data)
        finally:
            self._sock.setblocking(False)

    def spawn(self, index: int, core: int | None) -> None:
        self._send(("spawn", index, core))

    def kill(self, pid: int, sig: int) -> None:
        self._send(("kill", pid, sig))

    def stop(self) -> None:
        if self._sock is None:
            return
        try:
            self._send(("exit",))
        except OSError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self._sock.close()
        self._sock = None
