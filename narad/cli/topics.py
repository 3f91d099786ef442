"""``narad topic add|ls|info|edit|schema|rm|redrive|attach|detach|children`` (``narad topics``
works too): topics, their fan-out children and the redrive of a dead-letter topic, through narad.client.

Imports narad.cli.{base,fmt}, narad.client, click, msgspec and the standard library.
"""

from __future__ import annotations

from typing import Any

import click
import msgspec

from narad.cli.base import (
    FOREVER,
    Duration,
    Failure,
    NaradGroup,
    binary,
    call,
    connect,
    emit,
    json_mode,
    show,
    warn,
)
from narad.cli.fmt import format_duration
from narad.client import AsyncClient, Topic

__all__ = ["topic"]


def _schema_arg(text: str | None) -> Any:
    """A schema given inline, as ``@file`` or as ``-`` (standard input), parsed."""
    if text is None:
        return None
    if text == "-":
        data = binary("stdin").read()
        where = "standard input"
    elif text.startswith("@"):
        try:
            with open(text[1:], "rb") as fh:
                data = fh.read()
        except OSError as e:
            raise click.BadParameter(f"cannot read {text[1:]}: {e.strerror or e}", param_hint="--schema") from None
        where = text[1:]
    else:
        data, where = text.encode(), "the argument"
    try:
        doc = msgspec.json.decode(data)
    except msgspec.DecodeError as e:
        raise click.BadParameter(f"{where} is not JSON: {e}", param_hint="--schema") from None
    if not isinstance(doc, dict) and doc is not True:
        raise click.BadParameter("a schema is a JSON object (or true)", param_hint="--schema")
    return doc


def _role(t: Topic) -> str:
    if t.parent:
        return f"child of {t.parent}" + (f" (delay {format_duration(t.delay_ms)})" if t.delay_ms else "")
    if t.role == "parent":
        return "parent"
    return "-"


@click.group("topic", cls=NaradGroup, help="Manage topics and their fan-out children. 'narad topics' works too.")
def topic() -> None:
    pass


@topic.command("add")
@click.argument("name")
@click.option("--partitions", type=click.IntRange(min=0), default=0, show_default=True,
              help="Partition count; 0 uses the server's default (a child: its parent's count).")
@click.option("--retention", type=Duration(allow_forever=True), metavar="DURATION",
              help="How long messages are kept, such as 12h or 7d (at least 1h); 'forever' keeps them; "
                   "0 or omitted uses the server's default.")
@click.option("--visibility", type=Duration(), metavar="DURATION",
              help="Visibility timeout (how long a lease lasts), such as 30s; 0 or omitted uses the server's "
                   "default. Fixed once the topic exists.")
@click.option("--max-in-flight", type=click.IntRange(min=0), metavar="N",
              help="Per-partition cap on leased, unacked messages; 0 or omitted uses the server's default.")
@click.option("--max-acked-ahead", type=click.IntRange(min=0), metavar="N",
              help="Per-partition cap on messages acked past the oldest unacked one; 0 or omitted uses the "
                   "server's default.")
@click.option("--schema", metavar="SCHEMA",
              help="A JSON Schema every message must match: inline JSON, @file, or - for standard input.")
@click.option("--parent", metavar="TOPIC", help="Create the topic as a fan-out child of this topic, in one step.")
@click.option("--delay", type=Duration(), metavar="DURATION",
              help="With --parent: a delay child, which gets each message this long after the parent "
                   "committed it.")
@click.option("--max-deliveries", type=click.IntRange(min=0, max=1000), metavar="N",
              help="Deliveries a message gets before it goes to --dead-letter-topic (0: unlimited). An extension.")
@click.option("--dead-letter-topic", metavar="TOPIC",
              help="Where messages past --max-deliveries go (it must exist); in edit, '' clears it.")
@click.option("--idempotency-window", type=Duration(), metavar="DURATION",
              help="How long a produce's idempotency key is remembered (1s to 24h; 0: the default, 5m).")
def topic_add(name: str, partitions: int, retention: int | None, visibility: int | None,
              max_in_flight: int | None, max_acked_ahead: int | None, schema: str | None, parent: str | None,
              delay: int | None, max_deliveries: int | None, dead_letter_topic: str | None,
              idempotency_window: int | None) -> None:
    """Create a topic (or, with --parent, a child) and print it."""
    if delay is not None and parent is None:
        raise click.UsageError("--delay needs --parent (narad topic attach --delay makes an existing topic a "
                               "delay child)")
    c = connect()
    doc = _schema_arg(schema)
    kw: dict[str, Any] = {
        "partitions": partitions or None,
        "retention_ms": None if not retention else 0 if retention == FOREVER else retention,
        "visibility_timeout_ms": visibility or None,
        "max_in_flight_per_partition": max_in_flight or None,
        "max_acked_ahead_per_partition": max_acked_ahead or None,
        "schema": doc, "parent": parent, "fanout_delay_ms": delay,
        "max_deliveries": max_deliveries or None, "dead_letter_topic": dead_letter_topic or None,
        "idempotency_window_ms": idempotency_window or None,
    }
    t = call(c, lambda cl: cl.create_topic(name, **kw))
    show(t.raw)


@topic.command("ls")
def topic_ls() -> None:
    """List every topic you may see (all pages): NAME, PARTITIONS, RETENTION, ROLE."""
    c = connect()

    async def go(cl: AsyncClient) -> list[Topic]:
        return [t async for t in cl.iter_topics()]

    rows = call(c, go)
    if json_mode():
        for t in rows:
            emit(t.raw)
        return
    width = max([32, *(len(t.name) + 1 for t in rows)])
    click.echo(f"{'NAME':<{width}} {'PARTITIONS':>10} {'RETENTION':>12}  ROLE")
    for t in rows:
        ret = "forever" if t.retention_ms == 0 else format_duration(t.retention_ms)
        click.echo(f"{t.name:<{width}} {t.partitions:>10} {ret:>12}  {_role(t)}")


@topic.command("info")
@click.argument("name")
@click.option("--partition", type=click.IntRange(min=0), metavar="N", help="Statistics for this partition only.")
def topic_info(name: str, partition: int | None) -> None:
    """Print the topic with its schema and per-partition statistics. Rows of partitions
    whose owner did not answer say status owner_unavailable (and partial is true)."""
    c = connect()
    d = call(c, lambda cl: cl.describe_topic(name, partition=partition))
    if d.partial and not json_mode():
        down = [r.index for r in d.partition_stats if r.status == "owner_unavailable"]
        warn(f"partial answer: the owners of partitions {down} did not answer (their rows are zeroed)")
    show(d.raw)


@topic.command("edit")
@click.argument("name")
@click.option("--retention", type=Duration(allow_forever=True), metavar="DURATION",
              help="New retention, such as 48h (at least 1h); 0 or 'forever' keeps messages forever.")
@click.option("--partitions", type=click.IntRange(min=1), metavar="N",
              help="New partition count, larger than the current one (keys may map to other partitions).")
@click.option("--schema", metavar="SCHEMA",
              help="Register a new schema version (checked for compatibility): inline JSON, @file, or -.")
@click.option("--schema-base-version", type=click.IntRange(min=0), metavar="N",
              help="Apply --schema only if the current version is exactly N (the server answers 409 otherwise).")
@click.option("--max-in-flight", type=click.IntRange(min=0), metavar="N",
              help="New per-partition in-flight cap; 0 goes back to the server's default.")
@click.option("--max-acked-ahead", type=click.IntRange(min=0), metavar="N",
              help="New per-partition acked-ahead cap; 0 goes back to the server's default.")
@click.option("--visibility", metavar="DURATION",
              help="Refused: the visibility timeout is fixed when a topic is created.")
@click.option("--max-deliveries", type=click.IntRange(min=0, max=1000), metavar="N",
              help="Deliveries a message gets before it goes to --dead-letter-topic (0: unlimited). An extension.")
@click.option("--dead-letter-topic", metavar="TOPIC",
              help="Where messages past --max-deliveries go (it must exist); in edit, '' clears it.")
@click.option("--idempotency-window", type=Duration(), metavar="DURATION",
              help="How long a produce's idempotency key is remembered (1s to 24h; 0: the default, 5m).")
def topic_edit(name: str, retention: int | None, partitions: int | None, schema: str | None,
               schema_base_version: int | None, max_in_flight: int | None, max_acked_ahead: int | None,
               visibility: str | None, max_deliveries: int | None, dead_letter_topic: str | None,
               idempotency_window: int | None) -> None:
    """Change retention, caps or the partition count, or register a new schema version.
    The changes apply in the order retention, caps, partitions, schema, not atomically."""
    if visibility is not None:
        raise click.UsageError("--visibility: the visibility timeout is fixed when a topic is created "
                               "(create a new topic for another one)")
    if schema_base_version is not None and schema is None:
        raise click.UsageError("--schema-base-version goes with --schema")
    if all(v is None for v in (retention, partitions, schema, max_in_flight, max_acked_ahead, max_deliveries,
                               dead_letter_topic, idempotency_window)):
        raise click.UsageError("nothing to change: give --retention, --partitions, --schema, --max-in-flight, "
                               "--max-acked-ahead, --max-deliveries, --dead-letter-topic or --idempotency-window")
    c = connect()
    doc = _schema_arg(schema)
    kw: dict[str, Any] = {
        "retention_ms": None if retention is None else 0 if retention == FOREVER else retention,
        "partitions": partitions, "schema": doc, "schema_base_version": schema_base_version,
        "max_in_flight_per_partition": max_in_flight, "max_acked_ahead_per_partition": max_acked_ahead,
        "max_deliveries": max_deliveries, "dead_letter_topic": dead_letter_topic,
        "idempotency_window_ms": idempotency_window,
    }
    t = call(c, lambda cl: cl.alter_topic(name, **kw))
    show(t.raw)


@topic.command("schema")
@click.argument("name")
@click.option("--current", is_flag=True, help="Print only the current schema document ('no schema' when none).")
def topic_schema(name: str, current: bool) -> None:
    """Print the topic's schema history, oldest first (version 0 and an empty list
    when it has none)."""
    c = connect()
    h = call(c, lambda cl: cl.topic_schema(name))
    if not current:
        show(h)
        return
    versions = h.get("versions") or []
    doc = versions[-1].get("schema") if versions else None
    if json_mode():
        emit({"topic": h.get("topic", name), "version": h.get("version", 0), "schema": doc})
    elif doc is None:
        click.echo("no schema")
    else:
        show(doc)


@topic.command("rm")
@click.argument("name")
@click.option("-f", "--force", is_flag=True, help="Do not ask before deleting.")
def topic_rm(name: str, force: bool) -> None:
    """Delete the topic and all its messages, on every node (there is no undo).
    Asks first unless -f."""
    c = connect()
    if not force and not click.confirm(f'delete topic "{name}" and all its data?', default=False, err=True):
        raise Failure(f'topic "{name}" not deleted')
    call(c, lambda cl: cl.delete_topic(name))
    if json_mode():
        emit({"deleted": name})
    else:
        click.echo(f'deleted topic "{name}"', err=True)


@topic.command("redrive")
@click.argument("name")
@click.option("--max", "max_", type=click.IntRange(min=1, max=10_000), metavar="N",
              help="Move at most N messages (1-10000; the server's default 1000).")
def topic_redrive(name: str, max_: int | None) -> None:
    """Move the messages of the dead-letter topic NAME back to the topics they were
    dead-lettered from (at least once). Prints how many moved and how many were left
    (no origin, the origin topic gone, no produce grant there, or its schema refuses
    the message)."""
    c = connect()
    r = call(c, lambda cl: cl.redrive(name, max=max_))
    if json_mode():
        emit({"topic": name, "redriven": r.redriven, "skipped": r.skipped})
    else:
        click.echo(f'redrove {r.redriven} message(s) of "{name}"; {r.skipped} left (no origin, or not '
                   'accepted there)', err=True)


@topic.command("attach")
@click.argument("parent")
@click.argument("child")
@click.option("--delay", type=Duration(), metavar="DURATION",
              help="Attach it as a delay child: it gets each message this long after the parent committed it.")
def topic_attach(parent: str, child: str, delay: int | None) -> None:
    """Attach an existing topic as a fan-out child: it gets a copy of every message
    the parent commits from now on. Prints the parent."""
    c = connect()
    t = call(c, lambda cl: cl.attach_child(parent, child, delay_ms=delay))
    show(t.raw)


@topic.command("detach")
@click.argument("parent")
@click.argument("child")
def topic_detach(parent: str, child: str) -> None:
    """Detach a child: it becomes a standalone topic and keeps its messages."""
    c = connect()
    call(c, lambda cl: cl.detach_child(parent, child))
    if json_mode():
        emit({"parent": parent, "detached": child})
    else:
        click.echo(f'detached "{child}" from "{parent}"', err=True)


@topic.command("children")
@click.argument("parent")
def topic_children(parent: str) -> None:
    """List a parent's children and how many of its messages each has not copied yet
    (LAG; a '>=' marks a lower bound when some partitions did not report)."""
    c = connect()
    cl_ = call(c, lambda cl: cl.list_children(parent))
    if json_mode():
        for ch in cl_.children:
            emit({"parent": cl_.parent, **ch.raw})
        return
    width = max([32, *(len(ch.name) + 1 for ch in cl_.children)])
    click.echo(f"{'CHILD':<{width}} {'DELAY':>10} {'LAG':>12}")
    for ch in cl_.children:
        delay = format_duration(ch.delay_ms) if ch.delay_ms else "-"
        lag = str(ch.lag_messages) if ch.lag_complete else f">={ch.lag_messages}"
        click.echo(f"{ch.name:<{width}} {delay:>10} {lag:>12}")
