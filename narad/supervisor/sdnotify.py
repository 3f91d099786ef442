"""systemd readiness notification (Type=notify): a datagram to $NOTIFY_SOCKET.

The protocol is one line of ``KEY=value`` pairs on a Unix datagram socket;
without NOTIFY_SOCKET (not under systemd) every call is a no-op.
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
