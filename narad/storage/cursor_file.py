"""A fan-out cursor's durable position: ``<parent partition dir>/fanout-<child>.offset``.

Exactly 256 bytes: JSON ``{"crc":"<8 hex>","epoch":"<attach epoch>","next_offset":<n>}``
padded with spaces and ending in a newline. ``crc`` is the CRC-32C (crc32c
package) of every byte after the crc field, the padding included, so a torn
or damaged file is never believed.

* ``read``: absent -> None; a CRC failure is read again a few times (the owner
  may be writing it in place right now) before the file counts as corrupt.
* ``advance``: in place, one pwrite of the whole 256 bytes at offset 0 and one
  fdatasync (the caller runs it on an I/O thread, only after every copy below
  the new offset was committed at its child partition).
* ``anchor``: the first write for an epoch (or replacing a file of another
  epoch, a corrupt one or one of another length): a temp file, fdatasync,
  rename over the name, fsync of the directory.
* ``delete``: unlink and fsync of the directory.

Writes and syncs go through narad.storage.fileio (the fault-injection seam).
Imports crc32c and narad.storage.fileio.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from crc32c import crc32c

from narad.storage import fileio

SIZE = 256
_HEAD = b'{"crc":"'
_CRC_END = len(_HEAD) + 8 + 1  # the crc's 8 hex digits and its closing quote
READ_RETRIES = 3
RETRY_PAUSE = 0.002


class CursorCorrupt(ValueError):
    """The file exists but does not hold a valid cursor (after retries)."""


@dataclass(frozen=True)
class CursorState:
    epoch: str
    next_offset: int


def file_name(child: str) -> str:
    return f"fanout-{child}.offset"


def encode(epoch: str, next_offset: int) -> bytes:
    """The 256 bytes of a cursor. ValueError when the epoch is too long to fit."""
    if next_offset < 0:
        raise ValueError("next_offset must be >= 0")
    rest = b',"epoch":' + json.dumps(epoch).encode() + b',"next_offset":' + str(int(next_offset)).encode() + b"}"
    pad = SIZE - _CRC_END - len(rest) - 1
    if pad < 0:
        raise ValueError("attach epoch too long for a 256-byte cursor file")
    body = rest + b" " * pad + b"\n"
    return _HEAD + f"{crc32c(body):08x}".encode() + b'"' + body


def decode(data: bytes) -> CursorState:
    """Parse and check a cursor file's bytes; CursorCorrupt if anything is off."""
    if len(data) != SIZE or not data.startswith(_HEAD) or data[_CRC_END - 1:_CRC_END] != b'"' \
            or not data.endswith(b"\n"):
        raise CursorCorrupt("not a 256-byte cursor file")
    try:
        want = int(data[len(_HEAD):_CRC_END - 1], 16)
    except ValueError:
        raise CursorCorrupt("bad crc field") from None
    if crc32c(data[_CRC_END:]) != want:
        raise CursorCorrupt("cursor file checksum mismatch")
    try:
        doc = json.loads(data)
    except ValueError:
        raise CursorCorrupt("cursor file is not JSON") from None
    if not isinstance(doc, dict):
        raise CursorCorrupt("cursor file is not a JSON object")
    epoch, nxt = doc.get("epoch"), doc.get("next_offset")
    if not isinstance(epoch, str) or not isinstance(nxt, int) or isinstance(nxt, bool) or nxt < 0:
        raise CursorCorrupt("cursor file lacks epoch or next_offset")
    return CursorState(epoch, nxt)


class CursorFile:
    """One cursor file. Not thread-safe: one cursor (its own epoch's) uses it,
    one call at a time, on an I/O thread."""

    def __init__(self, directory: Path, child: str) -> None:
        self.dir = Path(directory)
        self.path = self.dir / file_name(child)
        self._fd = -1

    def read(self, retries: int = READ_RETRIES) -> CursorState | None:
        """The cursor on disk, None when there is no file. CursorCorrupt when it
        fails its checks on every one of `retries` + 1 reads."""
        err: CursorCorrupt | None = None
        for attempt in range(retries + 1):
            try:
                fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            try:
                data = os.pread(fd, SIZE + 1, 0)
            finally:
                os.close(fd)
            try:
                return decode(data)
            except CursorCorrupt as e:
                err = e
                if attempt < retries:
                    time.sleep(RETRY_PAUSE)
        assert err is not None
        raise err

    def _open(self) -> int:
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_RDWR)
        return self._fd

    def anchor(self, epoch: str, next_offset: int) -> None:
        """Write the cursor through a temp file and a rename (first write of an
        epoch, or replacing anything else). Durable when this returns."""
        data = encode(epoch, next_offset)
        self.close()
        fileio.replace_durable(self.path, data)
        fileio.fsync_dir(self.dir)

    def advance(self, epoch: str, next_offset: int) -> None:
        """In place: one write of the whole file at offset 0 and one fdatasync. A
        file of another size (written by something else) is replaced by anchor."""
        data = encode(epoch, next_offset)
        try:
            fd = self._open()
            if os.fstat(fd).st_size != SIZE:
                self.anchor(epoch, next_offset)
                return
        except FileNotFoundError:
            self.anchor(epoch, next_offset)
            return
        fileio.pwrite_all(fd, data, 0)
        fileio.fdatasync(fd)

    def delete(self) -> None:
        self.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            return
        fileio.fsync_dir(self.dir)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
