"""systemd notification (Type=notify): a datagram to $NOTIFY_SOCKET.

The protocol is one line of ``KEY=value`` pairs on a Unix datagram socket;
without NOTIFY_SOCKET (not under systemd) every call is a no-op. The
supervisor sends ``READY=1`` once, ``STATUS=`` whenever its summary changes,
``STOPPING=1`` at shutdown, and ``WATCHDOG=1`` from its heartbeat loop every
half of ``$WATCHDOG_USEC`` (``WatchdogSec=`` in the unit) while that loop and
Raft's tick thread both turn: a wedged supervisor stops feeding the watchdog
and systemd kills and restarts the node.
Imports no narad module.
"""

from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError:
        return False


def watchdog_interval() -> float | None:
    """How often to send WATCHDOG=1 (half the timeout systemd set), or None when no
    watchdog is armed for this process (``$WATCHDOG_PID`` names another one)."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or not os.environ.get("NOTIFY_SOCKET"):
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 2e6
