"""``narad pub``, ``narad sub``, ``narad replay`` and ``narad ack`` / ``nack`` / ``extend``:
produce, consume (or watch), read back and settle messages, through narad.client.

``sub`` has two modes. Queue mode (the default) is a real consumer: it long-polls,
prints each message and acks it, so what it takes is settled and it competes with
the topic's other consumers (``--no-ack`` lets the leases run out instead).
``--peek`` tails every partition with replay reads from its current end: it takes
no lease and acks nothing, so consumers never notice it.

Imports narad.cli.{base,fmt}, narad.client, click and the standard library.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import click

from narad.cli.base import (
    Duration,
    Failure,
    NaradCommand,
    binary,
    call,
    connect,
    describe,
    emit,
    json_mode,
    warn,
)
from narad.cli.fmt import message_json, message_line
from narad.client import (
    AckResult,
    ApiError,
    AsyncClient,
    Message,
    NaradError,
    OffsetGone,
    TooManyRequests,
    TransportError,
)

__all__ = ["ack", "extend", "nack", "pub", "replay", "sub"]

BATCH = 10  # leases one queue-mode poll takes at most without --max (each is printed, then acked)


def _out(m: Message, raw: bool) -> None:
    if json_mode():
        click.echo(message_json(m).decode())
    elif raw:
        out = binary("stdout")
        out.write(m.payload + b"\n")
        out.flush()
    else:
        click.echo(message_line(m))


def _transient(e: NaradError) -> bool:
    """Worth polling again: no answer, a 5xx, or a throttle."""
    return isinstance(e, (TransportError, TooManyRequests)) or (isinstance(e, ApiError) and e.status >= 500)


def _utf8(arg: str) -> bool:
    """A command-line argument that is UTF-8 (not bytes kept as surrogates)."""
    try:
        arg.encode()
    except UnicodeEncodeError:
        return False
    return True


# ---- pub -----------------------------------------------------------------------------------
@click.command("pub", cls=NaradCommand)
@click.argument("topic")
@click.argument("message", required=False)
@click.option("-k", "--key", help="The message key: messages with one key go to one partition, in order.")
@click.option("--partition", type=click.IntRange(min=0), metavar="N",
              help="Pin the message to this partition (wins over --key).")
@click.option("-f", "--file", "file_", metavar="PATH", help="Read the body from this file.")
@click.option("--count", type=click.IntRange(min=1), default=1, show_default=True,
              help="Send the message this many times.")
@click.option("--rate", type=click.FloatRange(min=0), default=0, show_default=True,
              help="Messages per second when --count is above 1; 0 sends as fast as possible.")
@click.option("-H", "--header", "header", multiple=True, metavar="NAME:VALUE",
              help="A header stored with the message (repeat for more; an extension a Narad node refuses).")
@click.option("--idempotency-key", metavar="KEY",
              help="Extension: a repeat of KEY on this topic within its window is accepted and not stored "
                   "(safe to send again after a timeout).")
def pub(topic: str, message: str | None, key: str | None, partition: int | None, file_: str | None, count: int,
        rate: float, header: tuple[str, ...], idempotency_key: str | None) -> None:
    """Produce a message to TOPIC. The body is MESSAGE, the --file, or standard input
    (also for MESSAGE '-'), stored byte for byte. Prints 'accepted (<n> bytes)' on
    stderr, or for several messages the count, the time and the rate; with
    --idempotency-key, how many were repeats (not stored) and, if the owner did not
    answer in time, pending."""
    if file_ is not None and message is not None:
        raise click.UsageError("give the message as an argument or with --file, not both")
    c = connect()  # a --password-stdin line comes before a body on standard input
    if file_ is not None:
        try:
            with open(file_, "rb") as fh:
                body = fh.read()
        except OSError as e:
            raise click.BadParameter(f"cannot read {file_}: {e.strerror or e}", param_hint="--file") from None
    elif message is not None and message != "-":
        body = os.fsencode(message)  # the argument's bytes as given (not UTF-8 is fine: stored byte for byte)
    else:
        body = binary("stdin").read()
    if not body:
        raise click.UsageError("the message is empty (a message is 1 byte to 1 MiB)")
    send_key: str | bytes | None = key
    if key is not None and not _utf8(key):
        send_key = os.fsencode(key)  # a binary key from the command line: sent as its bytes (base64 on the wire)
    if idempotency_key is not None and not _utf8(idempotency_key):
        raise click.BadParameter("must be UTF-8", param_hint="--idempotency-key")
    headers: dict[str, str] = {}
    for h in header:
        if not _utf8(h):
            raise click.BadParameter(f"{os.fsencode(h)!r} is not UTF-8 (headers are text)", param_hint="--header")
        name, sep, value = h.partition(":")
        if not sep or not name:
            raise click.BadParameter(f"{h!r} is not NAME:VALUE", param_hint="--header")
        if name in headers:
            raise click.BadParameter(f"header {name!r} given twice (which value was meant?)", param_hint="--header")
        headers[name] = value

    dups = pending = 0

    async def go(cl: AsyncClient) -> float:
        nonlocal dups, pending
        start = time.perf_counter()
        for i in range(count):
            if rate > 0 and i:
                pause = start + i / rate - time.perf_counter()
                if pause > 0:
                    await asyncio.sleep(pause)
            try:
                res = await cl.produce(topic, body, key=send_key, partition=partition, idempotency_key=idempotency_key,
                                       record_headers=headers or None)
                dups += res.duplicate is True
                pending += res.pending
            except NaradError as e:
                where = f"message {i + 1} of {count}: " if count > 1 else ""
                done = f" ({i} accepted before it)" if i else ""
                raise Failure(where + describe(e) + done) from None
        return time.perf_counter() - start

    elapsed = call(c, go)
    if json_mode():
        out = {"topic": topic, "accepted": count, "bytes": len(body), "seconds": round(elapsed, 6),
               "rate": round(count / elapsed, 1) if elapsed > 0 else None}
        if idempotency_key is not None:
            out["duplicates"] = dups
            if pending:
                out["pending"] = pending
        emit(out)
        return
    note = ""
    if idempotency_key is not None:
        note = f", {dups} duplicate(s) not stored" + (f", {pending} pending" if pending else "")
    if count == 1:
        click.echo(f"accepted ({len(body)} bytes{note})", err=True)
    else:
        click.echo(f"accepted {count} messages in {elapsed:.3f}s ({count / elapsed:.0f} msg/s{note})", err=True)


# ---- sub -----------------------------------------------------------------------------------
@click.command("sub", cls=NaradCommand)
@click.argument("topic")
@click.option("--peek", is_flag=True,
              help="Watch without consuming: replay reads from the current end of every partition; takes no "
                   "lease and acks nothing.")
@click.option("--partition", type=click.IntRange(min=0), metavar="N", help="Read one partition only.")
@click.option("--from", "from_", type=click.IntRange(min=0), metavar="OFFSET",
              help="With --peek and --partition: start at this offset instead of the end.")
@click.option("--no-ack", is_flag=True,
              help="Queue mode without acks: the leases run out and the messages are delivered again after the "
                   "topic's visibility timeout.")
@click.option("--raw", is_flag=True, help="Print payloads only, one per line, for pipes.")
@click.option("--max", "max_", type=click.IntRange(min=1), metavar="N", help="Stop after N messages.")
@click.option("--timeout", type=Duration(), metavar="DURATION",
              help="Stop after this long, such as 30s (with --max, exit 1 if fewer than N came).")
@click.option("--visibility", type=Duration(), metavar="DURATION",
              help="Queue mode: lease each delivery this long (1s to 12h) instead of the topic's visibility "
                   "timeout (an extension: a Narad node refuses it).")
def sub(topic: str, peek: bool, partition: int | None, from_: int | None, no_ack: bool, raw: bool,
        max_: int | None, timeout: int | None, visibility: int | None) -> None:
    """Stream messages from TOPIC until Ctrl-C (or --max, or --timeout).

    Queue mode (the default) consumes: it prints each message and acks it, competing
    with the topic's consumers. --peek only watches. Each message prints as
    '[p<partition> @<offset>] key=<key> <time> <payload>': JSON as it is, text as
    text, binary as hex with its size. On exit the count goes to stderr."""
    if from_ is not None and not peek:
        raise click.UsageError("--from is a --peek flag (queue mode has no position)")
    if from_ is not None and partition is None:
        raise click.UsageError("--from needs --partition")
    if no_ack and peek:
        raise click.UsageError("--no-ack is a queue-mode flag (--peek never acks)")
    if visibility is not None and peek:
        raise click.UsageError("--visibility is a queue-mode flag (--peek takes no lease)")
    if raw and json_mode():
        raise click.UsageError("--raw and --json are two output forms: choose one")
    c = connect(timeout=15.0)
    state = {"n": 0}
    end = None if timeout is None else time.monotonic() + timeout / 1000

    def left() -> float | None:
        return None if end is None else end - time.monotonic()

    def more() -> bool:
        rem = left()
        return (max_ is None or state["n"] < max_) and (rem is None or rem > 0)

    async def queue(cl: AsyncClient) -> None:
        if not raw and not json_mode():
            mode = ("queue mode, --no-ack: leases will lapse and the messages will be delivered again" if no_ack
                    else "queue mode: the messages below are consumed and acked")
            click.echo(f"subscribed to {topic} ({mode}); Ctrl-C to stop", err=True)
        while more():
            want = BATCH if max_ is None else min(100, max_ - state["n"])
            rem = left()
            wait = 10.0 if rem is None else max(0.0, min(10.0, rem))
            try:
                msgs = await cl.consume_batch(topic, want, wait=wait, partition=partition,
                                              visibility=None if visibility is None else visibility / 1000)
            except NaradError as e:
                if not _transient(e):
                    raise
                warn(f"consume failed, polling again: {describe(e)}")
                await asyncio.sleep(min(1.0, max(0.0, left() or 1.0)))
                continue
            for m in msgs:
                _out(m, raw)
                state["n"] += 1
            if msgs and not no_ack:
                try:
                    results = await cl.ack_batch(topic, msgs)
                except NaradError as e:
                    warn(f"ack failed ({describe(e)}): these messages will be delivered again")
                    continue
                for m, r in zip(msgs, results, strict=True):
                    if r.status == 410:
                        warn(f"p{m.partition} @{m.offset}: the lease lapsed before the ack (410); "
                             "it will be delivered again")
                    elif not r.ok:
                        warn(f"p{m.partition} @{m.offset}: ack answered {r.status} {r.error or ''}".rstrip())

    async def peek_mode(cl: AsyncClient) -> None:
        d = await cl.describe_topic(topic, partition=partition)
        cursors: dict[int, int] = {}
        for row in d.partition_stats:
            if partition is not None and row.index != partition:
                continue
            if row.status == "owner_unavailable" and from_ is None:
                why = row.raw.get("owner_liveness") or "not answering"
                raise Failure(f"partition {row.index} of {topic}: its owner {row.owner_node or '(none)'} is "
                              f"{why}, so its end is unknown; peek a live partition with --partition, or give "
                              "--partition and --from")
            cursors[row.index] = from_ if from_ is not None else row.high_watermark
        if not cursors:
            raise Failure(f"no partition {partition} in {topic}" if partition is not None
                          else f"no partition statistics for {topic}")
        if not raw and not json_mode():
            click.echo(f"peeking {topic} across {len(cursors)} partition(s): read-only, no leases; Ctrl-C to stop",
                       err=True)
        while more():
            progressed = False
            for p in sorted(cursors):
                for _ in range(100):  # a bounded burst per partition: one hot partition cannot starve the rest
                    if not more():
                        return
                    try:
                        m = await cl.replay(topic, p, cursors[p])
                    except OffsetGone:
                        oldest = (await cl.describe_topic(topic, partition=p)).partition_stats
                        nxt = max(cursors[p] + 1, oldest[0].oldest_offset if oldest else 0)
                        warn(f"p{p}: offset {cursors[p]} is gone (retention); going on at {nxt}")
                        cursors[p] = nxt
                        continue
                    except NaradError as e:
                        if not _transient(e):
                            raise
                        warn(f"p{p}: replay failed, trying again: {describe(e)}")
                        break
                    if m is None:
                        break
                    _out(m, raw)
                    state["n"] += 1
                    cursors[p] = m.offset + 1
                    progressed = True
            if not progressed:
                rem = left()
                await asyncio.sleep(0.4 if rem is None else max(0.0, min(0.4, rem)))

    interrupted = False
    try:
        call(c, peek_mode if peek else queue, stoppable=True)
    except KeyboardInterrupt:
        interrupted = True  # Ctrl-C is how a stream ends
    finally:
        click.echo(f"{state['n']} message(s)", err=True)
    if max_ is not None and state["n"] < max_ and not interrupted:
        raise Failure(f"{state['n']} of {max_} message(s) came before the timeout")


# ---- replay --------------------------------------------------------------------------------
@click.command("replay", cls=NaradCommand)
@click.argument("topic")
@click.option("--partition", type=click.IntRange(min=0), required=True, metavar="N", help="The partition to read.")
@click.option("--from", "from_", type=click.IntRange(min=0), metavar="OFFSET",
              help="First offset to read; default the oldest retained one.")
@click.option("--to", type=click.IntRange(min=0), metavar="OFFSET",
              help="Offset to stop before; default the current high watermark.")
@click.option("--raw", is_flag=True, help="Print payloads only, one per line.")
def replay(topic: str, partition: int, from_: int | None, to: int | None, raw: bool) -> None:
    """Print a range of one partition's retained messages. Takes no lease and acks
    nothing. Ends with 'N message(s) replayed from pP [a, b)' on stderr."""
    if raw and json_mode():
        raise click.UsageError("--raw and --json are two output forms: choose one")
    c = connect()

    async def go(cl: AsyncClient) -> tuple[int, int, int]:
        start, stop = from_, to
        if start is None or stop is None:
            d = await cl.describe_topic(topic, partition=partition)
            rows = [r for r in d.partition_stats if r.index == partition]
            if not rows:
                raise Failure(f"no partition {partition} in {topic}")
            row = rows[0]
            if row.status == "owner_unavailable":
                why = row.raw.get("owner_liveness") or "not answering"
                raise Failure(f"partition {partition} of {topic}: its owner {row.owner_node or '(none)'} is {why}")
            start = row.oldest_offset if start is None else start
            stop = row.high_watermark if stop is None else stop
        n = 0
        off = start
        while off < stop:
            try:
                m = await cl.replay(topic, partition, off)
            except OffsetGone:
                warn(f"offset {off} is gone (retention or unreadable); skipping it")
                off += 1
                continue
            if m is None:
                break  # the end came sooner
            _out(m, raw)
            n += 1
            off = m.offset + 1
        return n, start, stop

    n, start, stop = call(c, go)
    if json_mode():
        emit({"topic": topic, "partition": partition, "replayed": n, "from": start, "to": stop})
    else:
        click.echo(f"{n} message(s) replayed from p{partition} [{start}, {stop})", err=True)


# ---- ack / nack / extend -------------------------------------------------------------------------
def _handles(given: tuple[str, ...]) -> list[str]:
    """The handles named, those on standard input in place of ``-``; a JSON line (``sub
    --json``'s) gives its ``receipt_handle``. Blank lines are skipped."""
    out: list[str] = []
    for h in given:
        if h != "-":
            out.append(h.strip())
            continue
        for n, raw_line in enumerate(binary("stdin"), 1):
            line = raw_line.decode("utf-8", "replace").strip()
            if not line:
                continue
            if line.startswith("{"):
                try:
                    got = json.loads(line).get("receipt_handle")
                except (ValueError, AttributeError, RecursionError):  # (not JSON, not an object, too deep)
                    got = None
                if not isinstance(got, str) or not got:
                    raise click.BadParameter(f"stdin line {n} is JSON without a receipt_handle (a replayed "
                                             "message has none)", param_hint="HANDLE")
                line = got
            out.append(line)
    if not out:
        raise click.UsageError("no receipt handle given (name them, or - for standard input)")
    bad = [h for h in out if h.count(":") != 2]
    if bad:
        raise click.BadParameter(f"{bad[0]!r} is not a receipt handle (partition:offset:nonce)", param_hint="HANDLE")
    return out


def _settle(topic: str, handles: list[str], mode: str, past: str, **kw: float | str | None) -> None:
    """Settle every handle (100 a request, ``AsyncClient.ack_batch``) and report each
    one: ``--json`` a line per handle (its handle, status and error), otherwise the
    failures and a count on stderr. Exit 1 when any handle was not settled (410: its
    lease had lapsed already, so it will be, or was, delivered again)."""
    c = connect()

    async def go(cl: AsyncClient) -> list[AckResult]:
        return await cl.ack_batch(topic, handles, mode=mode, **kw)  # type: ignore[arg-type]

    results = call(c, go)
    bad = [r for r in results if not r.ok]
    for r in results:
        if json_mode():
            row: dict[str, object] = {"receipt_handle": r.receipt_handle, "status": r.status}
            if r.error:
                row["error"] = r.error
            emit(row)
        elif not r.ok:
            why = "the lease had lapsed (it will be delivered again)" if r.status == 410 else (r.error or "")
            warn(f"{r.receipt_handle}: {r.status} {why}".rstrip())
    if not json_mode():
        click.echo(f"{past} {len(results) - len(bad)} of {len(results)} message(s)", err=True)
    if bad:
        raise Failure(f"{len(bad)} of {len(results)} handle(s) not settled")


@click.command("ack", cls=NaradCommand)
@click.argument("topic")
@click.argument("handle", nargs=-1, required=True)
def ack(topic: str, handle: tuple[str, ...]) -> None:
    """Ack messages by receipt handle (partition:offset:nonce, as 'sub --no-ack
    --json' prints them; - reads them from standard input, one a line, as is or as
    those JSON lines): they are never delivered again. A handle whose lease had
    lapsed is reported (410) and the command exits 1."""
    _settle(topic, _handles(handle), "ack", "acked")


@click.command("nack", cls=NaradCommand)
@click.argument("topic")
@click.argument("handle", nargs=-1, required=True)
@click.option("--delay", type=Duration(), metavar="DURATION",
              help="Deliver again no sooner than this (0 to 12h; an extension a Narad node refuses). "
                   "Default: at once.")
@click.option("--reason", metavar="TEXT",
              help="Why (at most 256 bytes): kept for the dead-letter copy if this was the last delivery "
                   "the topic's max_deliveries allows.")
def nack(topic: str, handle: tuple[str, ...], delay: int | None, reason: str | None) -> None:
    """Give messages back by receipt handle (as for 'ack'; - reads standard input):
    delivered again at once, or after --delay. Each delivery counts toward the
    topic's max_deliveries."""
    _settle(topic, _handles(handle), "nack", "nacked", delay=None if delay is None else delay / 1000, reason=reason)


@click.command("extend", cls=NaradCommand)
@click.argument("topic")
@click.argument("handle", nargs=-1, required=True)
@click.option("--visibility", type=Duration(), metavar="DURATION",
              help="The lease runs this long from now (1s to 12h; an extension a Narad node refuses). "
                   "Default: the topic's visibility timeout.")
def extend(topic: str, handle: tuple[str, ...], visibility: int | None) -> None:
    """Restart messages' leases by receipt handle (as for 'ack'; - reads standard
    input), for the topic's visibility timeout or --visibility."""
    _settle(topic, _handles(handle), "extend", "extended",
            visibility=None if visibility is None else visibility / 1000)

