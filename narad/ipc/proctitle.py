"""Process titles naming each narad process's role (``narad: supervisor``,
``narad: forkserver``, ``narad: worker 1 (core 1)``), as ps, top and
/proc/<pid>/cmdline show them; the kernel's short name (/proc/<pid>/comm,
what pkill and systemd's journal use) gets the first 15 bytes.

setproctitle (PyPI) rewrites argv in place: a process whose title cannot be
set (no setproctitle installed, an unusual libc) keeps its command line and
logs nothing; titles are a convenience, never a dependency of anything.

Bottom layer: imports no narad module.
"""

from __future__ import annotations

import contextlib


def set_title(title: str) -> None:
    try:
        import setproctitle
    except ImportError:
        return
    with contextlib.suppress(Exception):
        setproctitle.setproctitle(title)
        setproctitle.setthreadtitle(title[:15])
