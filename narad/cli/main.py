"""The ``narad`` console script: the root command group, ``version``, ``completion``
and ``help``, and every other command registered from its module. Entry point:
``main()`` (pyproject ``[project.scripts] narad``).

Why click: a maintained, dependency-free library that gives nested command groups,
typed options with help text, prompts that hide input (and read standard input
when it is not a terminal), confirmation, the usage-error exit code 2, shell
completion for bash, zsh and fish, and CliRunner to test it all in-process.

Imports narad (the version), narad.cli.*, narad.client and click.
"""

from __future__ import annotations

from typing import Any

import click
from click.shell_completion import get_completion_class

from narad import BUILD, __version__
from narad.cli.admin import cluster, ctx, user
from narad.cli.base import EXIT_CODES, Failure, NaradCommand, NaradGroup, describe, emit, json_mode
from narad.cli.bench import bench
from narad.cli.messages import ack, extend, nack, pub, replay, sub
from narad.cli.topics import topic
from narad.client import NaradError

__all__ = ["cli", "main"]

ALIASES = {"topics": "topic"}


class RootGroup(NaradGroup):
    """The root: ``topics`` as an alias of ``topic``; SDK errors become one line on
    stderr and exit 1."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return super().get_command(ctx, ALIASES.get(cmd_name, cmd_name))

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None,
                                                                            list[str]]:
        name, cmd, rest = super().resolve_command(ctx, args)
        return (cmd.name if cmd is not None else name), cmd, rest

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except NaradError as e:
            raise Failure(describe(e)) from None


@click.group("narad", cls=RootGroup, epilog=EXIT_CODES + " Every command takes --help.",
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, "--version", prog_name="narad", message="%(prog)s %(version)s (" + BUILD + ")",
                      help="Print the version and exit.")
def cli() -> None:
    """narad: produce, consume and administer a Narad cluster over HTTP (any node).

    Credentials: -u/--user (NARAD_USER) with -p (NARAD_PASS), --password-stdin, a
    saved context, or a prompt. A flag wins over its environment variable, which
    wins over the selected context."""


for _cmd in (topic, pub, sub, ack, nack, extend, replay, bench, user, cluster, ctx):
    cli.add_command(_cmd)


@cli.command("version", cls=NaradCommand)
def version() -> None:
    """Print this build's version."""
    if json_mode():
        emit({"version": __version__, "build": BUILD})
    else:
        click.echo(f"narad {__version__} ({BUILD})")


SHELLS = ("bash", "zsh", "fish")


@cli.command("completion", cls=NaradCommand)
@click.argument("shell", type=click.Choice(SHELLS))
def completion(shell: str) -> None:
    """Print a shell completion script (click's): for bash, add
    'eval "$(narad completion bash)"' to ~/.bashrc; zsh and fish alike."""
    comp_cls = get_completion_class(shell)
    if comp_cls is None:  # pragma: no cover - click ships all three
        raise Failure(f"no completion for {shell}")
    comp = comp_cls(cli, {}, "narad", "_NARAD_COMPLETE")
    click.echo(comp.source())


@cli.command("help", cls=NaradCommand)
@click.argument("command", nargs=-1)
@click.pass_context
def help_(c: click.Context, command: tuple[str, ...]) -> None:
    """Print help: of narad, or of COMMAND (such as 'narad help topic add')."""
    root = c.find_root()
    cmd: click.Command = root.command
    parent = root
    for name in command:
        if not isinstance(cmd, click.Group):
            raise click.UsageError(f"{cmd.name} has no subcommand {name!r}")
        sub = cmd.get_command(parent, name)
        if sub is None:
            raise click.UsageError(f"no such command {name!r}")
        parent = click.Context(sub, info_name=sub.name, parent=parent)
        cmd = sub
    click.echo(cmd.get_help(parent))


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv, prog_name="narad")


if __name__ == "__main__":
    main()
