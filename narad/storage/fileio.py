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

# Filesystems whose syncfs reports data writeback errors through the superblock's error
# counter (Linux >= 5.8). Not overlayfs: its syncfs checks the overlay's own counter,
# and errors writing the upper files land on the upper filesystem's.
SYNCFS_FILESYSTEMS = frozenset({"ext4", "xfs", "btrfs"})


def syncfs_reports_errors(path: str | os.PathLike[str]) -> tuple[bool, str]:
    """Whether a syncfs through a descriptor of `path` reports every writeback error
    of its filesystem (Linux >= 5.8, and a filesystem in SYNCFS_FILESYSTEMS found for
    the path's device in /proc/self/mountinfo); and why not."""
    if not HAVE_SYNCFS:
        return False, "no syncfs(2) in this C library"
    rel = os.uname().release
    try:
        major, minor = (int(x) for x in rel.split("-", 1)[0].split(".")[:2])
    except ValueError:
        return False, f"kernel release {rel!r} not understood"
    if (major, minor) < (5, 8):
        return False, f"kernel {rel} is older than 5.8 (syncfs does not report data write errors)"
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    fstype = None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == dev and " - " in line:
                    fstype = line.split(" - ", 1)[1].split()[0]
    except OSError as e:
        return False, f"/proc/self/mountinfo unreadable: {e}"
    if fstype is None:
        return False, f"no mount found for device {dev}"
    if fstype not in SYNCFS_FILESYSTEMS:
        return False, f"filesystem {fstype} (group sync is used on {', '.join(sorted(SYNCFS_FILESYSTEMS))})"
    return True, f"{fstype} on kernel {rel}"


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
