"""``dead_letter.target`` in a partition directory: the dead-letter topic (name, id) the
partition's dead-letter driver sends held records to, and the offsets it sent there
whose settle may not be on disk yet (issue 14). Written durably before each commit that
adds to them (``narad.broker.deadletter``), copied by a move's install
(``narad.storage.transfer``), read at a partition's open. Their copy may exist in that
topic, so they are never released to be delivered from their source while it exists.

Imports narad.storage.fileio.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from narad.storage import fileio

FILE = "dead_letter.target"


def read(d: Path) -> tuple[str, str, set[int]] | None:
    """What the file in partition directory `d` says: the dead-letter topic's name and
    id, and the offsets sent there. None: no file, or an unreadable one (a lift then
    releases every mark, as before the file existed)."""
    try:
        doc = json.loads((Path(d) / FILE).read_bytes())
        name, tid, offs = doc["topic"], doc["id"], doc["offsets"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if (not isinstance(name, str) or not isinstance(tid, str) or not name or not tid
            or not isinstance(offs, list) or not all(type(o) is int and o >= 0 for o in offs)):
        return None
    return name, tid, set(offs)


def write(d: Path, name: str, tid: str, offsets: list[int]) -> None:
    """Make the file say (`name`, `tid`, `offsets`) durably (I/O thread)."""
    doc = {"topic": name, "id": tid, "offsets": offsets}
    fileio.replace_durable(Path(d) / FILE, json.dumps(doc, sort_keys=True).encode())
    fileio.fsync_dir(os.fspath(d))
