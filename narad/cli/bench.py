"""``narad bench``: produce load (and, with ``--consume``, the full flow: produce,
consume and ack side by side) against a running node or cluster, from this
machine. Reports messages per second and latency percentiles on stdout, with a
progress line on stderr while it runs.

One message per produce request (what a plain producer does), ``--workers``
concurrent requests over a keep-alive pool. With ``--consume`` as many consumers
lease batches of up to 100 and ack them in one request; each payload carries its
send time, so the consumer side measures end-to-end latency (produce request
sent to message delivered). Use a topic of its own: the consumers take, and ack,
whatever the topic holds.

Imports narad.cli.{base,fmt}, narad.client, click, msgspec and the standard library.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import click
import msgspec

from narad.cli.base import (
    Duration,
    Failure,
    NaradCommand,
    call,
    connect,
    describe,
    emit,
    is_tty,
    json_mode,
    warn,
)
from narad.cli.fmt import format_ms, percentile
from narad.client import ApiError, AsyncClient, NaradError, RawJSON, TooManyRequests

__all__ = ["bench"]


@dataclass
class Side:
    ok: int = 0
    failed: int = 0
    latencies: list[float] = field(default_factory=list)
    first_error: str = ""
    started: float = 0.0
    finished: float = 0.0

    def seconds(self) -> float:
        return max(1e-9, (self.finished or time.perf_counter()) - self.started)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        secs = self.seconds()
        return {
            "ok": self.ok, "failed": self.failed, "seconds": round(secs, 6),
            "msgs_per_s": round(self.ok / secs, 1),
            "latency_ms": {k: round(percentile(lat, q) * 1000, 3) for k, q in
                           (("p50", 0.50), ("p95", 0.95), ("p99", 0.99))} | {"max": round(lat[-1] * 1000, 3)
                                                                              if lat else 0.0},
        }


def _fatal(e: NaradError) -> bool:
    """A refusal that every further request would get too (no topic, no grant, bad request)."""
    return isinstance(e, ApiError) and 400 <= e.status < 500 and not isinstance(e, TooManyRequests)


@click.command("bench", cls=NaradCommand)
@click.argument("topic")
@click.option("--count", type=click.IntRange(min=1), default=10_000, show_default=True, help="Messages to produce.")
@click.option("--size", type=click.IntRange(min=1, max=1 << 20), default=256, show_default=True,
              help="Payload size in bytes (a JSON object carrying the send time, padded).")
@click.option("--workers", type=click.IntRange(min=1, max=256), default=8, show_default=True,
              help="Concurrent producers (and, with --consume, concurrent consumers).")
@click.option("--consume", is_flag=True,
              help="Full flow: consume and ack while producing, and report the consume rate and end-to-end "
                   "latency.")
@click.option("--duration", type=Duration(), metavar="DURATION",
              help="Stop producing after this long (such as 10s) even if --count is not reached.")
def bench(topic: str, count: int, size: int, workers: int, consume: bool, duration: int | None) -> None:
    """Measure produce throughput and latency against TOPIC (which must exist), and
    with --consume the full flow. Figures go to stdout, progress to stderr."""
    c = connect(timeout=30.0, max_connections=2 * workers + 4)
    run_id = secrets.token_hex(4)
    marker = f'{{"run":"{run_id}","t":'.encode()
    prod, cons = Side(), Side()
    stop = {"produce": False, "fatal": None}
    state = {"next": 0, "producers_done": False, "other": 0}

    def payload() -> bytes:
        head = marker + str(time.time_ns()).encode() + b',"pad":"'
        return head + b"x" * max(0, size - len(head) - 2) + b'"}'

    async def producer(cl: AsyncClient, end: float | None) -> None:
        while state["next"] < count and not stop["produce"]:
            if end is not None and time.monotonic() >= end:
                return
            state["next"] += 1
            t0 = time.perf_counter()
            try:
                await cl.produce(topic, RawJSON(payload()))
            except NaradError as e:
                prod.failed += 1
                prod.first_error = prod.first_error or describe(e)
                if _fatal(e):
                    stop["produce"], stop["fatal"] = True, e
                continue
            prod.latencies.append(time.perf_counter() - t0)
            prod.ok += 1

    async def consumer(cl: AsyncClient) -> None:
        idle = 0
        while True:
            if state["producers_done"] and cons.ok >= prod.ok:
                return
            try:
                msgs = await cl.consume_batch(topic, 100, wait=0.5 if state["producers_done"] else 1.0)
            except NaradError as e:
                cons.failed += 1
                cons.first_error = cons.first_error or describe(e)
                if _fatal(e):
                    stop["produce"], stop["fatal"] = True, e
                    return
                continue
            if not msgs:
                if state["producers_done"]:
                    idle += 1
                    if idle >= 2:  # about a second with nothing more to take
                        return
                continue
            idle = 0
            now = time.time_ns()
            for m in msgs:
                if m.payload.startswith(marker):
                    try:
                        sent = msgspec.json.decode(m.payload)["t"]
                    except (msgspec.DecodeError, KeyError, TypeError):
                        state["other"] += 1
                        continue
                    cons.latencies.append(max(0, now - sent) / 1e9)
                    cons.ok += 1
                    cons.finished = time.perf_counter()
                else:
                    state["other"] += 1
            try:
                await cl.ack_batch(topic, msgs)
            except NaradError as e:
                cons.first_error = cons.first_error or f"ack: {describe(e)}"

    def progress_line() -> str:
        line = f"produced {prod.ok}/{count} ({prod.ok / prod.seconds():.0f} msg/s"
        line += f", {prod.failed} failed)" if prod.failed else ")"
        if consume:
            line += f", consumed {cons.ok}"
        return line

    async def progress() -> None:
        tty = is_tty("stderr")
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.25)
            if tty:
                click.echo("\r" + progress_line() + "\x1b[K", err=True, nl=False)
            elif time.monotonic() - last >= 1.0:
                last = time.monotonic()
                click.echo(progress_line(), err=True)

    async def go(cl: AsyncClient) -> None:
        click.echo(f"bench {topic}: {count} x {size} B with {workers} workers"
                   + (", consuming alongside" if consume else ""), err=True)
        end = None if duration is None else time.monotonic() + duration / 1000
        ticker = asyncio.ensure_future(progress())
        try:
            prod.started = cons.started = time.perf_counter()
            consumers = [asyncio.ensure_future(consumer(cl)) for _ in range(workers if consume else 0)]
            await asyncio.gather(*(producer(cl, end) for _ in range(workers)))
            prod.finished = time.perf_counter()
            state["producers_done"] = True
            await asyncio.gather(*consumers)
        finally:
            ticker.cancel()
            click.echo(("\r" if is_tty("stderr") else "") + progress_line(), err=True)

    interrupted = False
    try:
        call(c, go, stoppable=True)
    except KeyboardInterrupt:
        interrupted = True
    if stop["fatal"] is not None and prod.ok == 0 and cons.ok == 0:
        raise Failure(describe(stop["fatal"]))  # type: ignore[arg-type]
    _report(topic, size, workers, consume, prod, cons, state["other"])
    if prod.first_error:
        warn(f"{prod.failed} produce(s) failed; the first: {prod.first_error}")
    if cons.first_error:
        warn(f"consume side error; the first: {cons.first_error}")
    if interrupted:
        raise Failure("interrupted")
    if stop["fatal"] is not None or prod.ok == 0:
        raise Failure("the bench did not complete: " + (prod.first_error or cons.first_error or "nothing produced"))


def _report(topic: str, size: int, workers: int, consume: bool, prod: Side, cons: Side, other: int) -> None:
    p = prod.summary()
    out: dict[str, Any] = {"topic": topic, "size": size, "workers": workers, "produce": p}
    if consume:
        out["consume"] = cons.summary()
        out["consume"]["other_messages"] = other
    if json_mode():
        emit(out)
        return
    lat = p["latency_ms"]
    click.echo(f"produce: {p['ok']} ok, {p['failed']} failed in {p['seconds']:.3f}s; {p['msgs_per_s']:.0f} msg/s; "
               f"latency p50={format_ms(lat['p50'] / 1000)} p95={format_ms(lat['p95'] / 1000)} "
               f"p99={format_ms(lat['p99'] / 1000)}")
    if consume:
        q = out["consume"]
        e2e = q["latency_ms"]
        click.echo(f"consume: {q['ok']} msgs in {q['seconds']:.3f}s; {q['msgs_per_s']:.0f} msg/s; "
                   f"end-to-end p50={format_ms(e2e['p50'] / 1000)} p95={format_ms(e2e['p95'] / 1000)} "
                   f"p99={format_ms(e2e['p99'] / 1000)}"
                   + (f" ({other} other message(s) taken too)" if other else ""))
