"""The file-I/O seam of the storage layer.

Every write, sync, read and truncate the partition logs, the WAL and the
offset files make goes through this module, so tests can make one of them
fail (ENOSPC, EIO, a lying fsync) without mocking anything else. Production
code never changes these functions. Imports nothing from narad.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from collections.abc import Callable

write: Callable[[int, bytes], int] = os.write
pwrite: Callable[[int, bytes, int], int] = os.pwrite
pread: Callable[[int, int, int], bytes] = os.pread
fdatasync: Callable[[int], None] = os.fdatasync
ftruncate: Callable[[int, int], None] = os.ftruncate


def _os_syncfs(fd: int) -> None:
    """syncfs(2) (Python 3.11's os has no binding): write back and wait for every dirty
    page of the filesystem holding `fd`, commit its journal, flush the device. Since
    Linux 5.8 it reports a writeback error anywhere on that filesystem that happened
    since the last syncfs through this open file (its own cursor)."""
    if _libc_syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


try:
    _libc_syncfs = ctypes.CDLL(None, use_errno=True).syncfs
    _libc_syncfs.argtypes = [ctypes.c_int]
    _libc_syncfs.restype = ctypes.c_int
    HAVE_SYNCFS = True
except (OSError, AttributeError):  # not glibc/Linux: callers fall back to fdatasync per file
    HAVE_SYNCFS = False

syncfs: Callable[[int], None] = _os_syncfs


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = write(fd, view)  # type: ignore[arg-type]
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[n:]


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = pwrite(fd, view, offset)  # type: ignore[arg-type]
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[n:]
        offset += n


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durable(path: str | os.PathLike[str], data: bytes) -> None:
    """`data` as `path` through a temp file beside it (``.<name>.tmp``), fdatasync and
    a rename over the name; the caller syncs the directory."""
    path = os.fspath(path)
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        pwrite_all(fd, data, 0)
        fdatasync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)


def reset() -> None:
    """Undo any test fault injection."""
    global write, pwrite, pread, fdatasync, ftruncate, syncfs
    write, pwrite, pread, fdatasync, ftruncate = os.write, os.pwrite, os.pread, os.fdatasync, os.ftruncate
    syncfs = _os_syncfs
