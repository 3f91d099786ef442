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
the server, so a SIGKILLed supervisor leaves no worker holding the port. Its
loop stamps the fork-server heartbeat slot (``narad.meta.versions``) every
250 ms.

A lost server (killed, crashed, or stuck past the bound) is *replaced*, never
re-forked from the supervisor (which runs threads and a loop by then):
``ForkServer.replace`` starts a fresh interpreter, ``python -m
narad.supervisor.forkserver <fd> <supervisor pid> <heartbeat segment>``, with
only its end of a new socketpair and the client and cluster sockets inherited
(``pass_fds``; everything else, the data-dir lock included, is closed by
exec). The first message it reads is ("boot", "module:function", pickled
argument): the function (``narad.worker.main.forkserver_entry``) rebuilds the
worker spec and returns the worker entry point. Then it serves as above.

Process title: ``narad: forkserver`` (a replacement says so and keeps its module name).

Imports narad._native, narad.ipc.proctitle, narad.meta.versions; the worker entry point is passed in.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable

import msgspec

from narad._native import lib
from narad.ipc.proctitle import set_title
from narad.meta import versions as V

log = logging.getLogger("narad.supervisor.forkserver")
_LEN = struct.Struct(">I")
_replacement = False  # this process is a replacement (a fresh interpreter): its title says so


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


def _serve(sock: socket.socket, spawn_worker: Callable[[int, int | None], int], supervisor_pid: int,
           hb_name: str = "") -> None:
    """The fork server's loop (runs in the forked child, blocking, single thread)."""
    set_pdeathsig(signal.SIGKILL, supervisor_pid)
    if not _replacement:
        set_title("narad: forkserver")
    hb = V.Heartbeats.attach(hb_name) if hb_name else None
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
        if hb is not None:
            hb.beat(V.HB_FORKSERVER)
        try:
            ready, _, _ = select.select([sock, wake_r], [], [], V.HB_EVERY)
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
                    if hb is not None:
                        hb.close()
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


def main(argv: list[str] | None = None) -> int:
    """A replacement fork server: ``python -m narad.supervisor.forkserver <fd> <supervisor pid> <hb>``."""
    args = sys.argv[1:] if argv is None else argv
    fd, supervisor_pid, hb_name = int(args[0]), int(args[1]), args[2]
    set_pdeathsig(signal.SIGKILL, supervisor_pid)
    global _replacement
    _replacement = True
    set_title("narad: forkserver (replacement, python -m narad.supervisor.forkserver)")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    try:
        (n,) = _LEN.unpack(_recv_exact(sock, 4))
        msg = msgspec.msgpack.decode(_recv_exact(sock, n))
    except EOFError:
        return 0
    if msg[0] != "boot":
        return 1
    module, func = str(msg[1]).split(":")
    spawn_worker = getattr(importlib.import_module(module), func)(pickle.loads(msg[2]))
    _send(sock, ("booted", os.getpid()))
    _serve(sock, spawn_worker, supervisor_pid, hb_name)
    return 0


class ForkServer:
    """The supervisor's handle on the fork server.

    ``portable``: () -> ("module:function", picklable argument, descriptors to
    pass), what a replacement server needs (see the module docstring)."""

    def __init__(self, spawn_worker: Callable[[int, int | None], int], *, hb_name: str = "",
                 portable: Callable[[], tuple[str, object, list[int]]] | None = None) -> None:
        self._spawn_worker = spawn_worker
        self._hb_name = hb_name
        self._portable = portable
        self.pid = 0
        self.generation = 0  # 0: the server forked at boot; n: the n-th replacement
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
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
                _serve(child, self._spawn_worker, me, self._hb_name)
            except BaseException:
                code = 1
            os._exit(code)
        child.close()
        self.pid = pid
        self._sock = parent

    def replace(self) -> None:
        """Start a replacement server as a fresh interpreter (this process has
        threads and a loop: never fork it). Call on the loop thread: the parent-
        death signal follows the thread that started the child. The old server
        must be gone (``reap``)."""
        assert self._portable is not None and self._loop is not None
        # Everything that can fail on the spec (portable_spec, pickling) runs
        # before a process exists; a failure after the start kills what started.
        entry, arg, fds = self._portable()
        payload = pickle.dumps(arg)
        self._close_sock()
        parent, child = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "narad.supervisor.forkserver", str(child.fileno()), str(os.getpid()),
                 self._hb_name],
                pass_fds=(child.fileno(), *fds), stdin=subprocess.DEVNULL, close_fds=True)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self._proc = proc
        self.pid = proc.pid
        self.generation += 1
        self._sock = parent
        self._buf = bytearray()
        try:
            self._send(("boot", entry, payload))
            self.attach(self._loop)
        except BaseException:
            proc.kill()
            proc.wait()
            self._close_sock()
            raise

    def reap(self) -> int | None:
        """Collect the exited server; its wait status, or None if it is not gone yet."""
        if not self.pid:
            return None
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return 0
        if pid == 0:
            return None
        if self._proc is not None:
            self._proc.returncode = os.waitstatus_to_exitcode(status)
        return status

    def _close_sock(self) -> None:
        if self._sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._sock is not None
        self._loop = loop
        self._sock.setblocking(False)
        loop.add_reader(self._sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            log.error("fork server exited", extra={"pid": self.pid})
            self._close_sock()
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
        if self._sock is None:
            raise ConnectionError("the fork server is gone")
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
            if self.pid and self.reap() is None:
                os.kill(self.pid, signal.SIGKILL)  # a server being replaced: do not leave it behind
                self.pid_wait()
            return
        try:
            self._send(("exit",))
        except OSError:
            pass
        self.pid_wait()
        self._sock.close()
        self._sock = None

    def pid_wait(self, timeout: float = 5.0) -> None:
        """Wait for the server to exit; SIGKILL it after `timeout` (a stopped one never would)."""
        end = time.monotonic() + timeout
        while self.reap() is None:
            if time.monotonic() > end:
                os.kill(self.pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.pid, 0)
                return
            time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(main())
