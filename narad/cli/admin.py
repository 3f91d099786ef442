"""``narad user add|ls|grant|rm|passwd``, ``narad cluster members [forget]|moves
[abort]|decommission`` and ``narad ctx add|select|ls|rm``: users and grants
(admin), the members, partition moves and decommission (admin), and saved
contexts (local, in narad.cli.contexts).

Imports narad.cli.{base,contexts}, narad.client, click and the standard library.
"""

from __future__ import annotations

from typing import Any

import click

from narad.cli.base import (
    DEFAULT_SERVER,
    Failure,
    NaradGroup,
    ask_secret,
    call,
    connect,
    emit,
    flags,
    json_mode,
    read_stdin_line,
    show,
)
from narad.cli.contexts import Context, ContextStore
from narad.client import AsyncClient, Conflict, Grant, User

__all__ = ["cluster", "ctx", "user"]

ACTIONS = ("produce", "consume", "create", "admin")
GRANT_HELP = ("A grant as action:pattern[,pattern...], such as produce:orders-* (repeatable). Actions: produce, "
              "consume, create, admin (admin takes no patterns). A pattern is a name or a prefix ending in *.")


def parse_grants(specs: tuple[str, ...]) -> list[Grant]:
    out: list[Grant] = []
    for spec in specs:
        action, _, pats = spec.partition(":")
        action = action.strip()
        if action not in ACTIONS:
            raise click.BadParameter(f"unknown action {action!r} in {spec!r} (produce, consume, create or admin)",
                                     param_hint="--grant")
        out.append(Grant(action, [p.strip() for p in pats.split(",") if p.strip()]))
    return out


def _user_json(u: User) -> dict[str, object]:
    d: dict[str, object] = {"username": u.username}
    if u.grants:
        d["grants"] = [g.to_json() for g in u.grants]
    if u.root:
        d["root"] = True
    d["created_at_ms"], d["updated_at_ms"] = u.created_at_ms, u.updated_at_ms
    return d


def _new_password(from_stdin: bool, what: str, flag: str) -> str:
    if from_stdin:
        if flags().get("password_stdin"):
            raise click.UsageError(f"{flag} and --password-stdin both read standard input: give the login "
                                   "password with NARAD_PASS or the prompt instead")
        pw = read_stdin_line(flag)
    else:
        pw = ask_secret(what, confirm=True)
    if not pw:
        raise click.UsageError("the password is empty (1 to 72 bytes)")
    return pw


# ---- user ----------------------------------------------------------------------------------
@click.group("user", cls=NaradGroup, help="Manage users and their grants (needs the admin grant).")
def user() -> None:
    pass


@user.command("add")
@click.argument("username")
@click.option("--grant", "grants", multiple=True, metavar="GRANT", help=GRANT_HELP)
@click.option("--user-password", metavar="PASSWORD",
              help="The new user's password. It shows in ps and shell history: prefer --user-password-stdin or "
                   "the prompt you get without either.")
@click.option("--user-password-stdin", is_flag=True, help="Read the new user's password from the first line of "
                                                           "standard input.")
def user_add(username: str, grants: tuple[str, ...], user_password: str | None, user_password_stdin: bool) -> None:
    """Create a user with the grants given (asks for its password unless given)."""
    g = parse_grants(grants)
    if user_password is not None and user_password_stdin:
        raise click.UsageError("give --user-password or --user-password-stdin, not both")
    c = connect()
    pw = user_password if user_password is not None else _new_password(
        user_password_stdin, f"Password for the new user {username}", "--user-password-stdin")
    u = call(c, lambda cl: cl.create_user(username, pw, g))
    show(_user_json(u))


@user.command("grant")
@click.argument("username")
@click.option("--grant", "grants", multiple=True, metavar="GRANT", help=GRANT_HELP)
@click.option("--none", "none_", is_flag=True, help="Remove all of the user's grants.")
def user_grant(username: str, grants: tuple[str, ...], none_: bool) -> None:
    """Replace all of the user's grants with the ones given."""
    if not grants and not none_:
        raise click.UsageError("give the new grants with --grant (or --none to remove them all)")
    if grants and none_:
        raise click.UsageError("--none removes every grant: it goes without --grant")
    g = parse_grants(grants)
    c = connect()
    u = call(c, lambda cl: cl.set_grants(username, g))
    show(_user_json(u))


@user.command("ls")
def user_ls() -> None:
    """List users as JSON (no password hashes)."""
    c = connect()
    rows = call(c, lambda cl: cl.list_users())
    if json_mode():
        for u in rows:
            emit(_user_json(u))
    else:
        show([_user_json(u) for u in rows])


@user.command("rm")
@click.argument("username")
def user_rm(username: str) -> None:
    """Delete a user (the topics it owns keep naming it as owner)."""
    c = connect()
    call(c, lambda cl: cl.delete_user(username))
    if json_mode():
        emit({"deleted": username})
    else:
        click.echo(f'deleted user "{username}"', err=True)


@user.command("passwd")
@click.argument("username")
@click.option("--new-password-stdin", is_flag=True,
              help="Read the new password from the first line of standard input (else it is asked for twice).")
def user_passwd(username: str, new_password_stdin: bool) -> None:
    """Set USERNAME's password. An admin sets anyone's (only root sets root's); any
    user sets their own, proving the current one (the password this command logs in
    with). A lost root password is reset on a node's host with naradctl users passwd."""
    c = connect()
    pw = _new_password(new_password_stdin, f"New password for {username}", "--new-password-stdin")
    auth = flags().get("_resolved", (None, None))[1]
    current = auth[1] if auth is not None and auth[0] == username else None

    async def go(cl: AsyncClient) -> None:
        await cl.set_password(username, pw, current_password=current)

    call(c, go)
    if json_mode():
        emit({"username": username, "password": "changed"})
    else:
        click.echo(f'password of "{username}" changed', err=True)


# ---- cluster -------------------------------------------------------------------------------
@click.group("cluster", cls=NaradGroup, help="Inspect the cluster, move partitions and decommission members "
                                             "(needs the admin grant).")
def cluster() -> None:
    pass


@cluster.group("members", cls=NaradGroup, invoke_without_command=True)
@click.option("--detail", is_flag=True, help="Also ask every member for its own status (within 2 s).")
@click.pass_context
def cluster_members(c: click.Context, detail: bool) -> None:
    """List the members: status, draining, voter and leader flags, heartbeat age,
    owned partitions and moves under way, as JSON. 'members forget <id>' removes
    a Raft server that has no member record."""
    if c.invoked_subcommand is not None:
        if detail:
            raise click.UsageError("--detail goes with the member list, not with a subcommand")
        return
    rows = call(connect(), lambda cl: cl.members(detail=detail))
    if json_mode():
        for m in rows:
            emit(m)
    else:
        show({"members": rows})


@cluster_members.command("forget")
@click.argument("id")
def cluster_members_forget(id: str) -> None:
    """Remove Raft server ID (its host:port or node id) that has no member record: a
    joiner that crashed or was replaced. A member is decommissioned instead."""
    show(call(connect(), lambda cl: cl.forget_member(id)))


@cluster.group("moves", cls=NaradGroup, invoke_without_command=True)
@click.option("--detail", is_flag=True, help="Also ask each destination for its move runner (phase, bytes copied).")
@click.pass_context
def cluster_moves(c: click.Context, detail: bool) -> None:
    """List the partition moves in flight, as JSON: topic, partition, from, to, both
    ends' status, and why a move is blocked. 'moves abort <topic> <partition>'
    cancels one."""
    if c.invoked_subcommand is not None:
        if detail:
            raise click.UsageError("--detail goes with the move list, not with a subcommand")
        return
    rows = call(connect(), lambda cl: cl.moves(detail=detail))
    if json_mode():
        for m in rows:
            emit(m)
    else:
        show({"moves": rows})


@cluster_moves.command("abort")
@click.argument("topic")
@click.argument("partition", type=click.IntRange(min=0))
@click.option("--target", metavar="NODE", help="Abort only if the move still goes to NODE (compare-and-set).")
def cluster_moves_abort(topic: str, partition: int, target: str | None) -> None:
    """Clear the move target of TOPIC's PARTITION: the partition stays with its owner
    (a later planner pass may move it again). Prints the move as it was aborted."""
    d = call(connect(), lambda cl: cl.abort_move(topic, partition, target=target))
    if json_mode():
        emit(d)
    else:
        click.echo(d.get("note", ""), err=True)
        show(d.get("move"))


@cluster.command("decommission")
@click.argument("id")
@click.option("--dry-run", is_flag=True, help="Only say whether the decommission would be accepted, and why not.")
@click.option("--cancel", is_flag=True, help="Stop a decommission (partitions already moved stay where they are).")
def cluster_decommission(id: str, dry_run: bool, cancel: bool) -> None:
    """Drain member ID: it takes no new produce and no partitions, its partitions
    move to the other members, then it leaves Raft (the leader hands over first)
    and its id is refused until it rejoins with an empty data directory."""
    if dry_run and cancel:
        raise click.UsageError("--dry-run and --cancel do not go together")
    c = connect()

    async def go(cl: AsyncClient) -> dict[str, Any] | None:
        if cancel:
            await cl.cancel_decommission(id)
            return None
        try:
            return await cl.decommission(id, dry_run=dry_run)
        except Conflict as e:
            codes = [str(r.get("code")) for r in e.body.get("reasons") or [] if isinstance(r, dict)]
            missing = [code for code in codes if code not in e.message]
            if missing:
                e.message = f"{e.message} (reasons: {', '.join(missing)})"
            raise

    d = call(c, go)
    if dry_run:
        show(d)
    elif json_mode():
        emit({"member": id, "draining": not cancel})
    elif cancel:
        click.echo(f"decommission of {id} cancelled (partitions already moved stay where they are)", err=True)
    else:
        click.echo(f"{id} is draining: its partitions move off, then it leaves the cluster "
                   "(narad cluster members shows what it waits for)", err=True)


# ---- ctx -----------------------------------------------------------------------------------
@click.group("ctx", cls=NaradGroup, invoke_without_command=True,
             help="Saved contexts: a named server URL with optional credentials. They live in contexts.json in "
                  "$NARAD_CONFIG_DIR or ~/.config/narad/ (mode 0600; passwords in clear text: leave them out "
                  "and use NARAD_PASS or the prompt to keep them off disk). Without a subcommand: ls.")
@click.pass_context
def ctx(c: click.Context) -> None:
    if c.invoked_subcommand is None:
        c.invoke(ctx_ls)


@ctx.command("add")
@click.argument("name")
def ctx_add(name: str) -> None:
    """Add or update context NAME from --server (required), --user and, optionally,
    the password (--password-stdin, or -p). The first context becomes the selected one."""
    f = flags()
    server = f.get("server")
    if not server:
        raise click.UsageError(f"give the context's server with --server (such as {DEFAULT_SERVER})")
    password = f.get("password")
    if password is None and f.get("password_stdin"):
        password = read_stdin_line("--password-stdin")
    if password is not None and not f.get("user"):
        raise click.UsageError("a password without a user: add --user")
    store = ContextStore.load()
    store.contexts[name] = Context(server=server, user=f.get("user") or "", password=password or "")
    if not store.current:
        store.current = name
    store.save()
    if json_mode():
        emit({"context": name, "selected": store.current == name, "file": str(store.path)})
    else:
        click.echo(f'context "{name}" saved in {store.path}' + (" (selected)" if store.current == name else ""),
                   err=True)


@ctx.command("select")
@click.argument("name")
def ctx_select(name: str) -> None:
    """Make context NAME the default for every command."""
    store = ContextStore.load()
    if name not in store.contexts:
        raise Failure(f'no context "{name}" (narad ctx ls lists them)')
    store.current = name
    store.save()
    if json_mode():
        emit({"context": name, "selected": True})
    else:
        click.echo(f'selected context "{name}"', err=True)


@ctx.command("ls")
def ctx_ls() -> None:
    """List contexts; the selected one is marked *. Passwords are never printed."""
    store = ContextStore.load()
    if store.warning:
        click.echo(f"narad: warning: {store.warning}", err=True)
    names = sorted(store.contexts)
    if json_mode():
        for n in names:
            cx = store.contexts[n]
            emit({"name": n, "selected": n == store.current, "server": cx.server, "user": cx.user,
                  "has_password": bool(cx.password)})
        return
    width = max([12, *(len(n) + 1 for n in names)])
    click.echo(f"  {'NAME':<{width}} {'SERVER':<32} USER")
    for n in names:
        cx = store.contexts[n]
        mark = "*" if n == store.current else " "
        click.echo(f"{mark} {n:<{width}} {cx.server:<32} {cx.user or '-'}" + (" (password saved)" if cx.password
                                                                                else ""))


@ctx.command("rm")
@click.argument("name")
def ctx_rm(name: str) -> None:
    """Remove context NAME (if it was selected, none is selected afterwards)."""
    store = ContextStore.load()
    if store.contexts.pop(name, None) is None:
        raise Failure(f'no context "{name}"')
    if store.current == name:
        store.current = ""
    store.save()
    if json_mode():
        emit({"removed": name})
    else:
        click.echo(f'removed context "{name}"', err=True)
