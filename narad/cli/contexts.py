"""Saved contexts: named server URLs with optional credentials, so they need not be
repeated on every command (``narad ctx add|select|ls|rm``).

They live in ``contexts.json`` in ``$NARAD_CONFIG_DIR`` if set, else in the user's
config directory (``~/.config/narad/`` on Linux, honouring ``$XDG_CONFIG_HOME``).
The file holds passwords in clear text, so it is written mode 0600 (whatever the
umask) in a directory made 0700, through a fresh temporary file renamed over the
old one (never a partial file, never a planted symlink followed).

Imports click (its app-dir rule), msgspec and the standard library.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import click
import msgspec

__all__ = ["Context", "ContextStore", "config_dir"]

FILE_NAME = "contexts.json"


def config_dir() -> Path:
    env = os.environ.get("NARAD_CONFIG_DIR")
    if env:
        return Path(env)
    return Path(click.get_app_dir("narad"))


class Context(msgspec.Struct, omit_defaults=True):
    server: str
    user: str = ""
    password: str = ""


class _File(msgspec.Struct, omit_defaults=True):
    current: str = ""
    contexts: dict[str, Context] = {}


@dataclass
class ContextStore:
    path: Path = field(default_factory=lambda: config_dir() / FILE_NAME)
    current: str = ""
    contexts: dict[str, Context] = field(default_factory=dict)
    warning: str = ""

    @classmethod
    def load(cls, path: Path | None = None) -> ContextStore:
        """The saved contexts (none when the file does not exist). A file others may
        read is used, with a warning in ``warning``; an unreadable one is an error."""
        p = path or config_dir() / FILE_NAME
        try:
            data = p.read_bytes()
            mode = p.stat().st_mode
        except FileNotFoundError:
            return cls(path=p)
        except OSError as e:
            raise click.ClickException(f"cannot read {p}: {e.strerror or e}") from None
        try:
            doc = msgspec.json.decode(data, type=_File) if data.strip() else _File()
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise click.ClickException(f"{p} is not a contexts file ({e}): fix or remove it") from None
        warning = ""
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            warning = f"{p} holds passwords and others may read it: chmod 600 {p}"
        return cls(path=p, current=doc.current, contexts=dict(doc.contexts), warning=warning)

    def save(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        data = msgspec.json.format(msgspec.json.encode(_File(self.current, self.contexts)), indent=2) + b"\n"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)

    def selected(self) -> Context | None:
        return self.contexts.get(self.current) if self.current else None
