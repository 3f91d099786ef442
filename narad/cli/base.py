"""What every ``narad`` command shares: the global flags (accepted anywhere on the
line), where the server and credentials come from, the SDK client, output in
text or JSON, and the one-line error.

Global flags: ``-s/--server`` (``NARAD_ADDR``), ``-u/--user`` (``NARAD_USER``),
``-p/--password`` (``NARAD_PASS``), ``--password-stdin``, ``--ctx``, ``--json``.
Each is an option of every group and command (click options belong to one level
of the line); a callback records the value given in the context's shared
``meta``, so ``narad --json topic ls`` and ``narad topic ls --json`` mean the
same. For each setting a flag wins over its environment variable, which wins
over the selected context, which wins over the default; ``--ctx`` reads no
environment variable and is refused while one is set. A user with no password
from any of these is asked for one at a prompt (never required on the command
line).

Imports narad.client, narad.cli.{contexts,fmt}, click, msgspec and the standard library.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import click
import msgspec

from narad.cli.contexts import ContextStore
from narad.cli.fmt import parse_duration
from narad.client import ApiError, AsyncClient, NaradError, RetryPolicy, Unauthorized

__all__ = [
    "DEFAULT_SERVER",
    "EXIT_CODES",
    "FOREVER",
    "Duration",
    "Failure",
    "NaradCommand",
    "NaradGroup",
    "ask_secret",
    "binary",
    "call",
    "connect",
    "describe",
    "emit",
    "flags",
    "is_tty",
    "json_mode",
    "read_stdin_line",
    "show",
    "warn",
]

T = TypeVar("T")

DEFAULT_SERVER = "http://127.0.0.1:7942"
EXIT_CODES = ("Exit codes: 0 success; 1 an error (the node refused, could not be reached, or the "
              "command was declined or interrupted; one line on stderr); 2 a usage error (a bad flag or argument).")
# One retry on another node (or the same after a short pause): a person at a
# terminal wants an answer in seconds, not the SDK's 30 s service deadline.
CLI_RETRY = RetryPolicy(max_attempts=3, base=0.1, cap=1.0, deadline=15.0, node_cooldown=0.2)
FOREVER = -1  # Duration(allow_forever=True) for "forever"
_META = "narad.flags"
GLOBAL_NAMES = frozenset({"server", "user", "password", "password_stdin", "ctx_name", "json_out"})


# ---- global flags ----------------------------------------------------------------------
def _store(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if value is not None and value is not False:
        ctx.meta.setdefault(_META, {})[param.name] = value
    return value


def _global_params() -> list[click.Parameter]:
    kw: dict[str, Any] = {"expose_value": False, "callback": _store}
    return [
        click.Option(["-s", "--server"], metavar="URL", **kw,
                     help="The node to talk to, such as http://n1:7942 (any node answers; several, comma-separated, "
                          "are tried in turn). Env NARAD_ADDR; default: the selected context, else "
                          "http://127.0.0.1:7942."),
        click.Option(["-u", "--user"], metavar="NAME", **kw,
                     help="User name for HTTP Basic auth. Env NARAD_USER; default: the selected context."),
        click.Option(["-p", "--password"], metavar="PASSWORD", **kw,
                     help="The user's password. It shows in ps and shell history: prefer NARAD_PASS, "
                          "--password-stdin or the prompt you get without one."),
        click.Option(["--password-stdin"], is_flag=True, default=False, **kw,
                     help="Read the password from the first line of standard input."),
        click.Option(["--ctx", "ctx_name"], metavar="NAME", **kw,
                     help="Use this saved context for this command only (see narad ctx); refused while "
                          "NARAD_ADDR, NARAD_USER or NARAD_PASS is set."),
        click.Option(["--json", "json_out"], is_flag=True, default=False, **kw,
                     help="Print one JSON object per message or result (JSON Lines), for scripts."),
    ]


def _format_split(cmd: click.Command, ctx: click.Context, formatter: click.HelpFormatter) -> None:
    own: list[tuple[str, str]] = []
    glob: list[tuple[str, str]] = []
    for p in cmd.get_params(ctx):
        if not isinstance(p, click.Option):
            continue  # arguments are in the usage line and the text
        rec = p.get_help_record(ctx)
        if rec is not None:
            (glob if p.name in GLOBAL_NAMES else own).append(rec)
    if own:
        with formatter.section("Options"):
            formatter.write_dl(own)
    if glob:
        with formatter.section("Global options"):
            formatter.write_dl(glob)


class NaradCommand(click.Command):
    """A command with the global flags and the exit codes in its help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("epilog", EXIT_CODES)
        super().__init__(*args, **kwargs)
        self.params.extend(_global_params())

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _format_split(self, ctx, formatter)


class NaradGroup(click.Group):
    """A group whose commands and subgroups are Narad commands."""

    command_class = NaradCommand
    group_class = type  # subgroups are NaradGroups too

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("epilog", EXIT_CODES)
        super().__init__(*args, **kwargs)
        self.params.extend(_global_params())

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _format_split(self, ctx, formatter)
        self.format_commands(ctx, formatter)


def flags() -> dict[str, Any]:
    """The global flags given on this command line (those not given are absent)."""
    return click.get_current_context().meta.setdefault(_META, {})  # type: ignore[no-any-return]


def json_mode() -> bool:
    return bool(flags().get("json_out"))


# ---- output ----------------------------------------------------------------------------
class Failure(click.ClickException):
    """An error of the command (exit 1), printed as one line: ``narad: <text>``."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(re.sub(r"\s*\n\s*", " ", message).strip())

    def show(self, file: Any = None) -> None:
        click.echo(f"narad: {self.format_message()}", err=True)


def warn(text: str) -> None:
    click.echo(f"narad: warning: {text}", err=True)


def describe(e: NaradError) -> str:
    """One line naming the node's own error text, the status and the node."""
    if isinstance(e, ApiError):
        said = "" if e.message == f"HTTP {e.status}" else e.message + " "
        text = f"{said}(HTTP {e.status}" + (f" from {e.node})" if e.node else ")")
        if isinstance(e, Unauthorized):
            text += ": check the user (-u/--user, NARAD_USER) and its password (-p, NARAD_PASS, --password-stdin)"
    else:
        text = e.message or type(e).__name__
    if e.uncertain:
        text += "; the outcome is unknown: it may have taken effect, so read it back before trying again"
    return text


def _dumps(obj: Any) -> str:
    return msgspec.json.encode(obj).decode()


def emit(obj: Any) -> None:
    """One JSON object on one line."""
    click.echo(_dumps(obj))


def show(obj: Any) -> None:
    """A JSON result: one line with --json, indented otherwise."""
    if json_mode():
        emit(obj)
    else:
        click.echo(msgspec.json.format(_dumps(obj), indent=2))


# ---- input -----------------------------------------------------------------------------
def binary(name: str) -> Any:
    """sys.stdin / stdout / stderr as bytes (what click's runner replaces, too)."""
    stream = getattr(sys, name)
    return getattr(stream, "buffer", stream)


def is_tty(name: str) -> bool:
    stream = getattr(sys, name)
    return bool(getattr(stream, "isatty", lambda: False)())


def read_stdin_line(what: str) -> str:
    """The first line of standard input, without its line ending."""
    line = binary("stdin").readline()
    if not line:
        raise click.UsageError(f"{what}: standard input is empty")
    return line.decode("utf-8", "replace").rstrip("\r\n")


def ask_secret(text: str, *, confirm: bool = False) -> str:
    """Ask for a password: hidden at a terminal (click's prompt); otherwise the prompt
    goes to stderr and the answer is the next line of standard input (a second line
    repeats it when ``confirm``), so scripts and tests can answer it."""
    if is_tty("stdin"):
        return click.prompt(text, hide_input=True, confirmation_prompt=confirm, err=True)  # type: ignore[no-any-return]
    stdin = binary("stdin")

    def line(label: str) -> str:
        click.echo(f"{label}: ", err=True, nl=False)
        raw = stdin.readline()
        click.echo(err=True)
        if not raw:
            raise Failure(f"{text.lower()}: standard input ended before a password came")
        return raw.decode("utf-8", "replace").rstrip("\r\n")

    pw = line(text)
    if confirm and line("Repeat for confirmation") != pw:
        raise Failure("the two passwords differ")
    return pw


class Duration(click.ParamType):
    """A duration (``12h``, ``30s``, ``500ms``) as milliseconds; ``forever`` as FOREVER."""

    name = "duration"

    def __init__(self, allow_forever: bool = False) -> None:
        self.allow_forever = allow_forever

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip()
        if self.allow_forever and text.lower() == "forever":
            return FOREVER
        try:
            return parse_duration(text)
        except ValueError as e:
            self.fail(str(e), param, ctx)


# ---- the server and credentials -------------------------------------------------------
def _loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain") or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _resolve() -> tuple[str, tuple[str, str] | None]:
    """(servers, auth) from flags, environment, context and defaults (in that order),
    prompting for a password a user lacks. Memoized for the command line."""
    f = flags()
    if "_resolved" in f:
        return f["_resolved"]  # type: ignore[no-any-return]
    env = os.environ
    store = ContextStore.load()
    if store.warning:
        warn(store.warning)
    ctx_name = f.get("ctx_name")
    if ctx_name:
        set_vars = [v for v in ("NARAD_ADDR", "NARAD_USER", "NARAD_PASS") if env.get(v)]
        if set_vars:
            raise click.UsageError(f"--ctx is refused while {', '.join(set_vars)} is set, so a command meant for "
                                   "one cluster never picks up another's settings: unset it, or drop --ctx")
        c = store.contexts.get(ctx_name)
        if c is None:
            raise click.UsageError(f'--ctx: no context "{ctx_name}" (narad ctx ls lists them)')
        e_addr = e_user = e_pass = None
    else:
        c = store.selected()
        e_addr, e_user, e_pass = env.get("NARAD_ADDR") or None, env.get("NARAD_USER") or None, env.get("NARAD_PASS")
    server = f.get("server") or e_addr or (c.server if c else None) or DEFAULT_SERVER
    user = f.get("user") or e_user or (c.user if c is not None and c.user else None)
    password: str | None = f.get("password")
    if password is None and f.get("password_stdin"):
        password = read_stdin_line("--password-stdin")
    if password is None and e_pass:
        password = e_pass
    if password is None and c is not None and c.password and c.user == user:
        password = c.password
    auth: tuple[str, str] | None = None
    if user:
        if password is None:
            password = ask_secret(f"Password for {user}")
        auth = (user, password or "")
    elif f.get("password") is not None or f.get("password_stdin"):
        raise click.UsageError("a password was given without a user: add -u/--user (or NARAD_USER)")
    if auth is not None:
        for s in server.split(","):
            u = urlsplit(s.strip() if "://" in s else "http://" + s.strip())
            if u.scheme == "http" and u.hostname and not _loopback(u.hostname):
                warn(f"sending credentials over plain http:// to {u.hostname}: use an https:// URL for "
                     "anything remote")
    f["_resolved"] = (server, auth)
    return server, auth


def connect(*, timeout: float = 10.0, max_connections: int = 16) -> AsyncClient:
    """The SDK client for this command line (asks for a password first if one is needed)."""
    server, auth = _resolve()
    try:
        return AsyncClient(server, auth=auth, timeout=timeout, retry=CLI_RETRY, client_name="narad-cli",
                           max_connections=max_connections)
    except ValueError as e:
        raise click.UsageError(f"-s/--server: {e}") from None


def call(client: AsyncClient, fn: Callable[[AsyncClient], Awaitable[T]], *, stoppable: bool = False) -> T:
    """Run ``fn(client)`` on a fresh event loop and close the client after it.
    ``stoppable``: SIGTERM stops it as Ctrl-C does (both raise KeyboardInterrupt here,
    after ``fn``'s cleanup ran), for commands that run until stopped."""

    async def main() -> T:
        if stoppable:
            task = asyncio.current_task()
            if task is not None:
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        async with client:
            return await fn(client)

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None
