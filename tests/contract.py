"""The delivery contract, checked from the client side: a history recorder, a checker
and a traffic driver for tests that drive produce / consume / ack against real nodes.

The recorder (``History``) is thread safe and stamps every call with monotonic ns at
call and at return (one host, one clock: the brokers' lease clocks are the same
CLOCK_MONOTONIC). It records produce answers (202, refused, or ambiguous: no answer /
500), deliveries (message id from the payload, partition:offset, nonce) and the answer
to every ack / extend / nack of a receipt handle, plus declared fault windows.

The checker (``check``) gives a verdict over a history (rules, see ``RULES``):
- lost: a message answered 202 was never delivered (an ambiguous produce may be missing);
- phantom: a delivered message was never produced, or its produce was refused;
- dup_after_ack: a delivery whose call started after an ack (204) of the same message
  had returned; strict mode: a violation; faults mode: allowed (counted) only when the
  delivery starts inside a declared fault window + grace;
- double_lease: two deliveries of one partition:offset whose leases overlapped for
  certain (the second was reserved before the first's lease could have run out and
  before any ack / nack of the first was even sent; or the first's handle was still
  honoured after the second was reserved); faults mode: allowed inside a window + grace
  (an owner crash loses its leases);
- not_redelivered: a delivery never acked (no ack, a 410, or a nack) whose lease ran out
  before the end of the history was never followed by another delivery of that copy;
- undrained: a message answered 202 (or a delivered copy) never acked with 204 by the
  end (an ack whose answer was lost or 5xx counts only if the caller saw the broker
  empty at the end: ``broker_empty=True``);
- dup (strict mode only): a redelivery no lease expiry, nack or 410 explains;
- delayed_early: a copy nacked with a delay (issue 14) delivered again (another
  nonce) for certain before that delay ran out, counted from the nack's call (the
  owner applied it no earlier), minus the slack; allowed (counted) inside a declared
  fault window + grace in either mode (a restart or a move forgets delays);
- count_not_rising: two deliveries of one copy, the second reserved for certain after
  the first (its call began after the first returned), whose ``delivery_count``s
  (issue 14; deliveries recorded without one are left out) do not rise; allowed
  (counted) inside a declared fault window + grace in either mode (after a kill -9 a
  count may be lower than the truth by the leases of the owner's last ~100 ms).
- dead_then_live: a copy seen in its dead-letter topic (``History.dead_lettered``,
  from the dead-letter record's origin: source partition and offset) delivered again
  from its source by a consume that began after that dead-letter delivery returned;
  a violation in either mode (the dead-letter commit waits until the count that used
  the record up is on disk, so not even a kill -9 brings it back live). A copy seen
  in the dead-letter topic counts as settled for not_redelivered and undrained.

A delivery may carry its own lease length (``vis_ns``: a consume with
``visibility``) and an extend its new one; 0 means the history's visibility.

Only tests import this module; it touches nothing in narad/.
"""

from __future__ import annotations

import bisect
import contextlib
import http.client
import itertools
import json
import os
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

RULES = ("lost", "phantom", "dup_after_ack", "double_lease", "not_redelivered", "undrained", "dup", "delayed_early",
         "count_not_rising", "dead_then_live")
OCTET = {"Content-Type": "application/octet-stream"}
JSON_CT = {"Content-Type": "application/json"}
NS = 1_000_000_000


def now() -> int:
    return time.monotonic_ns()


# The wall clock against the monotonic one, sampled as histories record (``sample_clock``):
# (monotonic ns, wall minus monotonic ns). Nodes stamp commits and gate a delay child by the
# wall clock, which on this VM runs ahead of the monotonic clock by up to ~1 ms a second, in
# steps; ``wall_at`` puts a monotonic instant on the wall clock to judge such a gate.
_CLOCK: list[tuple[int, int]] = []
_CLOCK_LOCK = threading.Lock()


def sample_clock() -> None:
    t = time.monotonic_ns()
    w = time.time_ns()
    with _CLOCK_LOCK:
        _CLOCK.append((t, w - t))
        if len(_CLOCK) > 1_000_000:
            del _CLOCK[: len(_CLOCK) // 2]


def clock_samples() -> list[tuple[int, int]]:
    """Every sample so far (and one now), in time order: ``wall_at``'s table."""
    sample_clock()
    with _CLOCK_LOCK:
        return sorted(_CLOCK)


def wall_at(t: int, samples: list[tuple[int, int]]) -> int:
    """The wall clock (ns) at monotonic instant `t`, by the sample nearest to it."""
    i = bisect.bisect_left(samples, (t, -(1 << 62)))
    near = min((samples[j] for j in (i - 1, i) if 0 <= j < len(samples)), key=lambda s: abs(s[0] - t))
    return t + near[1]


@dataclass(frozen=True)
class Produce:
    ids: tuple[str, ...]
    call: int
    ret: int
    status: int | None  # None: no answer (connection error / timeout)
    node: str = ""


@dataclass(frozen=True)
class Delivery:
    mid: str
    partition: int
    offset: int
    nonce: str
    call: int
    ret: int
    node: str = ""
    vis_ns: int = 0  # this delivery's lease length (consume ?visibility=); 0: the history's
    count: int = 0  # its delivery_count (issue 14); 0: not known

    @property
    def handle(self) -> str:
        return f"{self.partition}:{self.offset}:{self.nonce}"

    @property
    def copy(self) -> tuple[int, int]:
        return (self.partition, self.offset)


@dataclass(frozen=True)
class Settle:
    handle: str
    kind: str  # "ack" | "extend" | "nack"
    call: int
    ret: int
    status: int | None  # None: no answer
    delay_ns: int = 0  # a nack's delay (?delay= / "delay"); 0: immediate
    vis_ns: int = 0  # an extend's lease length (?visibility=); 0: the history's

    @property
    def ok(self) -> bool:
        return self.status == 204

    @property
    def ambiguous(self) -> bool:
        return self.status is None or self.status >= 500


@dataclass(frozen=True)
class DeadCopy:
    """A source copy seen in its dead-letter topic: the dead-letter delivery's origin."""

    mid: str
    partition: int  # in the source
    offset: int
    call: int  # the dead-letter consume's call and return
    ret: int

    @property
    def copy(self) -> tuple[int, int]:
        return (self.partition, self.offset)


@dataclass
class Fault:
    name: str
    start: int
    end: int | None = None


def produce_outcome(status: int | None) -> str:
    """202 = accepted; no answer / 500 (and any other 5xx but 503) = ambiguous;
    4xx and 503 (nothing stored) = refused."""
    if status == 202:
        return "accepted"
    if status is None or (status >= 500 and status != 503):
        return "ambiguous"
    return "refused"


class History:
    """A thread-safe record of one run's client-side operations."""

    def __init__(self, visibility_s: float) -> None:
        self.visibility_ns = int(visibility_s * NS)
        self.lock = threading.Lock()
        self.produces: list[Produce] = []
        self.deliveries: list[Delivery] = []
        self.settles: list[Settle] = []
        self.faults: list[Fault] = []
        self.dead: list[DeadCopy] = []
        self.start_ns = now()
        self.end_ns: int | None = None
        self.accepted: set[str] = set()
        self.acked: set[str] = set()

    # ---- recording ----------------------------------------------------------
    def produced(self, ids: Sequence[str], call: int, ret: int, status: int | None, node: str = "") -> None:
        sample_clock()
        with self.lock:
            self.produces.append(Produce(tuple(ids), call, ret, status, node))
            if status == 202:
                self.accepted.update(ids)

    def delivered(self, d: Delivery) -> None:
        sample_clock()
        with self.lock:
            self.deliveries.append(d)

    def dead_lettered(self, d: DeadCopy) -> None:
        """A consume of the dead-letter topic returned this source copy (its origin)."""
        with self.lock:
            self.dead.append(d)

    def settled(self, s: Settle, mid: str | None = None) -> None:
        with self.lock:
            self.settles.append(s)
            if s.kind == "ack" and s.ok and mid is not None:
                self.acked.add(mid)

    def begin_fault(self, name: str) -> Fault:
        f = Fault(name, now())
        with self.lock:
            self.faults.append(f)
        return f

    def end_fault(self, f: Fault) -> None:
        f.end = now()

    @contextlib.contextmanager
    def fault(self, name: str) -> Iterator[Fault]:
        """Declare a fault window for the duration of the block."""
        f = self.begin_fault(name)
        try:
            yield f
        finally:
            self.end_fault(f)

    def finish(self) -> None:
        self.end_ns = now()

    # ---- quick views for wait conditions ---------------------------------------
    def accepted_count(self) -> int:
        with self.lock:
            return len(self.accepted)

    def unacked(self) -> set[str]:
        """Messages answered 202 not yet acked (204) through any delivery."""
        with self.lock:
            return self.accepted - self.acked

    def snapshot(self) -> tuple[list[Produce], list[Delivery], list[Settle], list[Fault]]:
        with self.lock:
            return list(self.produces), list(self.deliveries), list(self.settles), list(self.faults)

    def trail(self, mid: str) -> list[str]:
        """What happened to one message, in time order (ms since the run began): for
        the failure message of a test, so a lost message says where it went."""
        ps, ds, ss, _ = self.snapshot()
        ms = lambda t: f"{(t - self.start_ns) / 1e6:9.1f}"  # noqa: E731
        out = [(p.call, f"{ms(p.call)} produce -> {p.status} via {p.node}") for p in ps if mid in p.ids]
        handles = {}
        for d in ds:
            if d.mid == mid:
                handles[d.handle] = d
                out.append((d.ret, f"{ms(d.ret)} delivered p{d.partition} o{d.offset} nonce {d.nonce} via {d.node}"))
        for s in ss:
            if s.handle in handles:
                out.append((s.call, f"{ms(s.call)} {s.kind} {s.handle} -> {s.status} (answered {ms(s.ret)})"))
        return [line for _, line in sorted(out)]


@dataclass
class Verdict:
    mode: str
    counts: dict[str, int] = field(default_factory=dict)
    violations: dict[str, list[str]] = field(default_factory=lambda: {r: [] for r in RULES})
    allowed: dict[str, int] = field(default_factory=lambda: {"dup_after_ack": 0, "double_lease": 0,
                                                             "delayed_early": 0, "count_not_rising": 0})
    fault_coverage: float = 0.0
    lost_ack_ages_ns: list[int] = field(default_factory=list)  # fault start - ack return, per allowed dup
    allowed_details: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())

    def failed_rules(self) -> set[str]:
        return {r for r, v in self.violations.items() if v}

    def summary(self, name: str = "contract") -> str:
        c = self.counts
        viol = {r: len(v) for r, v in self.violations.items() if v}
        lines = [
            f"{name} [{self.mode}]: {'OK' if self.ok else 'VIOLATION'}; produced {c.get('produce_calls', 0)} calls "
            f"({c.get('accepted', 0)} ids 202, {c.get('ambiguous', 0)} ambiguous, {c.get('refused', 0)} refused); "
            f"delivered {c.get('deliveries', 0)} ({c.get('delivered_ids', 0)} ids); acked {c.get('acked_ids', 0)} "
            f"ids; duplicates {c.get('duplicates', 0)} (redelivered after lease expiry/nack/410 "
            f"{c.get('explained_redeliveries', 0)}; dup_after_ack allowed in fault windows "
            f"{self.allowed['dup_after_ack']}; double leases allowed in fault windows {self.allowed['double_lease']}; "
            f"delivery counts not rising allowed in fault windows {self.allowed['count_not_rising']}); "
            f"acks 204 {c.get('acks_204', 0)} / 410 {c.get('acks_410', 0)} / ambiguous {c.get('acks_ambiguous', 0)}; "
            f"extends {c.get('extends', 0)}, nacks {c.get('nacks', 0)} (with a delay {c.get('delayed_nacks', 0)}, "
            f"back after it {c.get('delayed_back', 0)}; delivered early allowed in fault windows "
            f"{self.allowed['delayed_early']}); faults {c.get('faults', 0)} "
            f"(run inside fault windows + grace: {self.fault_coverage:.0%}); violations {viol or 0}"
        ]
        for f in self.faults:
            lines.append(f"  fault window: {f}")
        if self.lost_ack_ages_ns:
            ages = sorted(self.lost_ack_ages_ns)
            lines.append(f"  acks redelivered after a fault had returned up to {ages[-1] / NS * 1000:.0f} ms before it "
                         f"(median {ages[len(ages) // 2] / NS * 1000:.0f} ms; negative: returned after it began)")
        for x in self.allowed_details[:3]:
            lines.append(f"  allowed in a fault window: {x}")
        for r, v in self.violations.items():
            for x in v[:5]:
                lines.append(f"  {r}: {x}")
            if len(v) > 5:
                lines.append(f"  {r}: ... {len(v) - 5} more")
        return "\n".join(lines)


def check(h: History, mode: str = "strict", *, grace_s: float | None = None, slack_s: float = 0.1,
          broker_empty: bool = False) -> Verdict:
    """The verdict over a history. ``mode``: "strict" (no faults were injected: any
    post-ack redelivery, double lease or unexplained duplicate is a violation) or
    "faults" (those are allowed only inside a declared fault window + grace).
    ``grace_s`` defaults to the visibility timeout + 20 s. ``slack_s``: clock / timer
    margin on lease deadlines. ``broker_empty``: the broker reported no message left
    (then a message whose only ack got no answer counts as drained)."""
    assert mode in ("strict", "faults"), mode
    produces, deliveries, settles, faults = h.snapshot()
    with h.lock:
        dead = list(h.dead)
    dead_at: dict[tuple[int, int], int] = {}  # source copy -> when it was first seen dead-lettered (ret)
    for dc in dead:
        dead_at[dc.copy] = min(dc.ret, dead_at.get(dc.copy, dc.ret))
    end = h.end_ns if h.end_ns is not None else now()
    vis = h.visibility_ns
    grace = int((grace_s if grace_s is not None else h.visibility_ns / NS + 20) * NS)
    slack = int(slack_s * NS)
    v = Verdict(mode)

    def in_window(t: int) -> bool:
        return any(f.start <= t <= (f.end if f.end is not None else end) + grace for f in faults)

    outcome: dict[str, str] = {}
    for p in produces:
        o = produce_outcome(p.status)
        for mid in p.ids:
            prev = outcome.get(mid)
            # accepted beats ambiguous beats refused (a retried id: the best answer counts)
            if prev is None or ("accepted", "ambiguous", "refused").index(o) < ("accepted", "ambiguous",
                                                                              "refused").index(prev):
                outcome[mid] = o
    accepted = {m for m, o in outcome.items() if o == "accepted"}
    by_handle: dict[str, list[Settle]] = defaultdict(list)
    for s in settles:
        by_handle[s.handle].append(s)
    by_mid: dict[str, list[Delivery]] = defaultdict(list)
    by_copy: dict[tuple[int, int], list[Delivery]] = defaultdict(list)
    for d in sorted(deliveries, key=lambda d: (d.call, d.ret)):
        by_mid[d.mid].append(d)
        by_copy[d.copy].append(d)

    def acks_ok(d: Delivery) -> list[Settle]:
        return [s for s in by_handle.get(d.handle, []) if s.kind == "ack" and s.ok]

    def releases(d: Delivery) -> list[Settle]:
        """Settles that may have ended d's lease: acks / nacks answered 204 or ambiguous."""
        return [s for s in by_handle.get(d.handle, []) if s.kind in ("ack", "nack") and (s.ok or s.ambiguous)]

    def lease_bounds(d: Delivery) -> tuple[int, int]:
        """(earliest, latest) instant d's lease can have run out, extends included."""
        dv = d.vis_ns or vis
        lo, hi = d.call + dv, d.ret + dv
        for s in by_handle.get(d.handle, []):
            if s.kind == "extend" and s.ok:
                sv = s.vis_ns or vis
                # an extend sets the lease to now + its length: it may shorten it too
                lo, hi = (s.call + sv, s.ret + sv) if s.vis_ns else (max(lo, s.call + sv), max(hi, s.ret + sv))
        return lo, hi

    # (a) lost and phantom
    for mid in sorted(accepted - by_mid.keys()):
        v.violations["lost"].append(f"{mid} answered 202 and never delivered")
    for mid in sorted(by_mid.keys() - outcome.keys()):
        v.violations["phantom"].append(f"{mid} delivered but never produced")
    for mid in sorted(m for m in by_mid if outcome.get(m) == "refused"):
        v.violations["phantom"].append(f"{mid} delivered though its produce was refused")

    # (b) dup_after_ack (by message id: covers the same stored copy and a second copy)
    for mid, ds in by_mid.items():
        ack_rets = sorted(s.ret for d in ds for s in acks_ok(d))
        if not ack_rets:
            continue
        for d in ds:
            if d.call > ack_rets[0]:  # an ack of an earlier delivery had returned 204
                first = ack_rets[0]
                acker = next(x for x in ds for s in acks_ok(x) if s.ret == first)
                detail = (f"{mid} delivered at {d.partition}:{d.offset} by {d.node or '?'} (call "
                          f"+{(d.call - h.start_ns) / NS:.3f} s) after an ack of it (delivered at {acker.partition}:"
                          f"{acker.offset} by {acker.node or '?'}) returned 204 (+{(first - h.start_ns) / NS:.3f} s)")
                if mode == "faults" and in_window(d.call):
                    v.allowed["dup_after_ack"] += 1
                    v.allowed_details.append(detail)
                    # how long before the fault (that window's start) the lost ack had returned
                    starts = [f.start for f in faults if f.start <= d.call]
                    if starts:
                        v.lost_ack_ages_ns.append(max(starts) - first)
                else:
                    v.violations["dup_after_ack"].append(detail)

    # (c) double lease on one partition:offset
    for copy, ds in by_copy.items():
        for i, d1 in enumerate(ds):
            lo1, _ = lease_bounds(d1)
            for d2 in ds[i + 1:]:
                if d2.call < d1.call:
                    continue
                if d1.ret <= d2.call:  # d1 was reserved first for certain
                    released = any(s.call < d2.ret for s in releases(d1))
                    overlap = not released and d2.ret + slack < lo1
                    # d1's handle honoured after d2 was reserved: both live at once.
                    honoured_late = any(s.ok and s.call > d2.ret + slack for s in by_handle.get(d1.handle, []))
                else:  # the calls overlap: either may have been reserved first
                    released = (any(s.call < d2.ret for s in releases(d1))
                                or any(s.call < d1.ret for s in releases(d2)))
                    overlap = not released and max(d2.ret - d1.call, d1.ret - d2.call) + slack < vis
                    honoured_late = False
                if d1.nonce == d2.nonce:
                    overlap = honoured_late = False  # one lease reported twice (a replayed answer): dup rules
                if overlap or honoured_late:
                    detail = (f"{copy[0]}:{copy[1]} ({d1.mid}) leased to nonce {d1.nonce} at "
                              f"+{(d1.call - h.start_ns) / NS:.3f} s and to nonce {d2.nonce} at "
                              f"+{(d2.call - h.start_ns) / NS:.3f} s while the first lease was live"
                              + (" (the first handle was still honoured later)" if honoured_late else ""))
                    if mode == "faults" and in_window(d2.call):
                        v.allowed["double_lease"] += 1
                        v.allowed_details.append(detail)
                    else:
                        v.violations["double_lease"].append(detail)

    # (d) every lease that ran out unacked is followed by another delivery of that copy
    explained = 0
    for copy, ds in by_copy.items():
        if copy in dead_at:
            continue  # settled by the broker into its dead-letter topic
        for d in ds:
            ss = by_handle.get(d.handle, [])
            if any(s.kind == "ack" and (s.ok or s.ambiguous) for s in ss):
                continue
            nacks = [s for s in ss if s.kind == "nack" and s.ok]
            _, hi = lease_bounds(d)
            due = min([hi] + [s.ret + s.delay_ns for s in nacks])
            if any(d2.nonce != d.nonce and d2.ret > d.ret for d2 in ds if d2 is not d):  # answered after d
                explained += 1
            elif any(acks_ok(x) for x in ds if x is not d):
                pass  # the copy was acked through another lease (a double lease, if any, is flagged)
            elif due + slack < end:
                v.violations["not_redelivered"].append(
                    f"{copy[0]}:{copy[1]} ({d.mid}) delivered at +{(d.call - h.start_ns) / NS:.3f} s, never acked "
                    f"({'nacked' if nacks else 'lease ran out'} by +{(due - h.start_ns) / NS:.3f} s), "
                    f"never delivered again (history ends +{(end - h.start_ns) / NS:.3f} s)")

    # (e) drained: every accepted message and every delivered copy acked with 204
    acked_ids = {d.mid for ds in by_mid.values() for d in ds if acks_ok(d)} | {dc.mid for dc in dead}
    in_doubt = {d.mid for ds in by_mid.values() for d in ds
                if any(s.kind == "ack" and s.ambiguous for s in by_handle.get(d.handle, []))}
    for mid in sorted((accepted & by_mid.keys()) - acked_ids):
        if broker_empty and mid in in_doubt:
            continue
        v.violations["undrained"].append(f"{mid} answered 202, delivered, never acked with 204")
    for copy, ds in sorted(by_copy.items()):
        if any(acks_ok(d) for d in ds) or copy in dead_at:
            continue
        if broker_empty and any(s.kind == "ack" and s.ambiguous for d in ds for s in by_handle.get(d.handle, [])):
            continue
        if ds[0].mid in accepted - acked_ids:
            continue  # already reported above
        v.violations["undrained"].append(f"{copy[0]}:{copy[1]} ({ds[0].mid}) delivered, never acked with 204")

    # duplicates; strict: each redelivery must be explained by an expired lease, a nack or a 410
    duplicates = sum(len(ds) - 1 for ds in by_mid.values())
    if mode == "strict":
        for mid, ds in by_mid.items():
            copies = {d.copy for d in ds}
            if len(copies) > 1:
                v.violations["dup"].append(f"{mid} stored more than once: {sorted(copies)}")
        for copy, ds in by_copy.items():
            for i, d2 in enumerate(ds[1:], 1):
                prev = ds[i - 1]
                if prev.nonce == d2.nonce:
                    v.violations["dup"].append(f"{copy[0]}:{copy[1]} ({d2.mid}) answered twice with one nonce")
                    continue
                ss = by_handle.get(prev.handle, [])
                ss2 = by_handle.get(d2.handle, [])

                def explains(first: Delivery, fss: list[Settle], second: Delivery) -> bool:
                    # `first` was reserved before `second`: a nack, a 410 or a possible lapse
                    lo, _ = lease_bounds(first)
                    return (any(s.kind == "nack" and s.ok and s.call < second.ret for s in fss)
                            or any(s.status == 410 for s in fss) or second.ret + slack >= lo)

                why = explains(prev, ss, d2)
                if prev.ret > d2.call:  # the calls overlap: d2 may have been reserved first
                    why = why or explains(d2, ss2, prev)
                if not why and not any(s.kind == "ack" and s.ok for s in ss + ss2):
                    v.violations["dup"].append(
                        f"{copy[0]}:{copy[1]} ({d2.mid}) redelivered at +{(d2.call - h.start_ns) / NS:.3f} s with "
                        f"no lease expiry, nack or 410 to explain it")

    # (f) a nack with a delay: that copy is not delivered again before the delay ran out
    delayed_back = 0  # delayed nacks whose copy was delivered again (each such redelivery judged)
    for copy, ds in by_copy.items():
        for d in ds:
            for s in by_handle.get(d.handle, []):
                if s.kind != "nack" or not s.ok or s.delay_ns <= 0:
                    continue
                not_before = s.call + s.delay_ns  # the owner applied the nack after its call
                if any(d2.nonce != d.nonce and d2.ret > s.call for d2 in ds):
                    delayed_back += 1
                for d2 in ds:
                    if d2.nonce == d.nonce or d2.ret <= s.call or d2.ret + slack >= not_before:
                        continue
                    rel = lambda t: f"+{(t - h.start_ns) / NS:.3f} s"  # noqa: E731
                    detail = (f"{copy[0]}:{copy[1]} ({d2.mid}) delivered again at {rel(d2.ret)} by {d2.node or '?'}, "
                              f"before the {s.delay_ns / NS:g} s delay of its nack (called {rel(s.call)}) ran out "
                              f"at {rel(not_before)}")
                    if in_window(d2.call):
                        v.allowed["delayed_early"] += 1
                        v.allowed_details.append(detail)
                    else:
                        v.violations["delayed_early"].append(detail)

    # (g) delivery counts rise from one lease of a copy to the next
    for copy, ds in by_copy.items():
        counted = [d for d in ds if d.count > 0]
        for i, d in enumerate(counted):
            for d2 in counted[i + 1:]:
                if d2.call <= d.ret or d2.count > d.count or d2.nonce == d.nonce:
                    continue  # (one lease answered twice is the dup rule's business, not a new lease)
                detail = (f"{copy[0]}:{copy[1]} ({d2.mid}) delivered with delivery_count {d2.count} at "
                          f"+{(d2.call - h.start_ns) / NS:.3f} s after a delivery with {d.count} "
                          f"(returned +{(d.ret - h.start_ns) / NS:.3f} s)")
                if in_window(d2.call):
                    v.allowed["count_not_rising"] += 1
                    v.allowed_details.append(detail)
                else:
                    v.violations["count_not_rising"].append(detail)

    # (h) a copy seen in its dead-letter topic is never delivered again from its source
    for copy, t_dead in sorted(dead_at.items()):
        for d in by_copy.get(copy, []):
            if d.call > t_dead:
                v.violations["dead_then_live"].append(
                    f"{copy[0]}:{copy[1]} ({d.mid}) delivered from its source at +{(d.call - h.start_ns) / NS:.3f} s "
                    f"after its dead-letter copy was consumed (+{(t_dead - h.start_ns) / NS:.3f} s)")

    # fault coverage of the run
    covered = 0
    last = h.start_ns
    for f in sorted(faults, key=lambda f: f.start):
        a = max(f.start, last)
        b = min((f.end if f.end is not None else end) + grace, end)
        if b > a:
            covered += b - a
            last = b
    v.fault_coverage = covered / max(1, end - h.start_ns)
    v.faults = [f"{f.name}: +{(f.start - h.start_ns) / NS:.3f} s .. "
                + (f"+{(f.end - h.start_ns) / NS:.3f} s" if f.end is not None else "open") for f in faults]
    v.counts = {
        "produce_calls": len(produces),
        "accepted": len(accepted),
        "ambiguous": sum(1 for o in outcome.values() if o == "ambiguous"),
        "refused": sum(1 for o in outcome.values() if o == "refused"),
        "deliveries": len(deliveries),
        "delivered_ids": len(by_mid),
        "acked_ids": len(acked_ids),
        "duplicates": duplicates,
        "explained_redeliveries": explained,
        "acks_204": sum(1 for s in settles if s.kind == "ack" and s.ok),
        "acks_410": sum(1 for s in settles if s.kind == "ack" and s.status == 410),
        "acks_ambiguous": sum(1 for s in settles if s.kind == "ack" and s.ambiguous),
        "extends": sum(1 for s in settles if s.kind == "extend"),
        "nacks": sum(1 for s in settles if s.kind == "nack"),
        "delayed_nacks": sum(1 for s in settles if s.kind == "nack" and s.ok and s.delay_ns > 0),
        "delayed_back": delayed_back,
        "faults": len(faults),
        "dead_lettered": len(dead_at),
        "lost": len(v.violations["lost"]),
    }
    return v


# ---- client: recorded produce / consume / settle ---------------------------------

def message_id(payload: Any) -> str:
    """The message id a driver put in a payload: its text up to the first ':'."""
    return str(payload).split(":", 1)[0]


def record_delivery(h: History, m: dict[str, Any], call: int, ret: int, node: str = "", mid: str | None = None
                    ) -> Delivery:
    """Record one consumed message (an object of a single or batch consume answer, with
    its receipt handle) as a delivery; ``mid`` defaults to ``message_id(payload)``."""
    p, o, nonce = m["receipt_handle"].split(":", 2)
    d = Delivery(mid if mid is not None else message_id(m["payload"]), int(p), int(o), nonce, call, ret, node,
                 count=int(m.get("delivery_count") or 0))
    h.delivered(d)
    return d


def record_settles(h: History, ds: Sequence[Delivery], kind: str, call: int, ret: int,
                   statuses: Sequence[int | None]) -> None:
    """Record the per-handle answers of one ack / extend / nack call made by the test itself."""
    for d, st in zip(ds, statuses, strict=True):
        h.settled(Settle(d.handle, kind, call, ret, st), d.mid)


class Recorder:
    """Produce / consume / settle through a node's HTTP API, recording every answer."""

    def __init__(self, history: History, topic: str) -> None:
        self.h, self.topic = history, topic

    def produce(self, node: Any, mid: str, conn: http.client.HTTPConnection | None = None, pad: int = 0
                ) -> int | None:
        body = (mid + ":").encode().ljust(pad, b"x")
        t0 = now()
        status: int | None
        try:
            status = node.request("POST", f"/v1/topics/{self.topic}/produce", body, headers=OCTET, conn=conn).status
        except (OSError, http.client.HTTPException):
            status = None
        self.h.produced([mid], t0, now(), status, getattr(node, "node_id", ""))
        return status

    def consume(self, node: Any, conn: http.client.HTTPConnection | None = None, wait: str = "1s", max_n: int = 20
                ) -> list[Delivery] | None:
        """A batch consume; None when the call failed (nothing recorded), [] on 204."""
        t0 = now()
        r = node.request("GET", f"/v1/topics/{self.topic}/consume?wait={wait}&max={max_n}", conn=conn,
                         headers={"X-Narad-Client": "contract"})
        t1 = now()
        if r.status == 204:
            return []
        if r.status != 200:
            return None
        out = []
        for m in r.json()["messages"]:
            p, o, nonce = m["receipt_handle"].split(":", 2)
            d = Delivery(message_id(m["payload"]), int(p), int(o), nonce, t0, t1, getattr(node, "node_id", ""),
                         count=int(m.get("delivery_count") or 0))
            self.h.delivered(d)
            out.append(d)
        return out

    def consume_dead(self, node: Any, dead_letter_topic: str, wait: str = "0s", max_n: int = 100) -> int | None:
        """Consume the dead-letter topic once and ack what came: every record whose
        origin is this recorder's topic is recorded as a dead copy (``DeadCopy``);
        returns how many, None when the call failed."""
        t0 = now()
        r = node.request("GET", f"/v1/topics/{dead_letter_topic}/consume?wait={wait}&max={max_n}",
                         headers={"X-Narad-Client": "contract"})
        t1 = now()
        if r.status == 204:
            return 0
        if r.status != 200:
            return None
        msgs = r.json()["messages"]
        n = 0
        for m in msgs:
            o = m.get("dead_letter")
            if o and o.get("topic") == self.topic:
                self.h.dead_lettered(DeadCopy(message_id(m["payload"]), int(o["partition"]), int(o["offset"]),
                                              t0, t1))
                n += 1
        body = json.dumps({"receipt_handles": [m["receipt_handle"] for m in msgs]}).encode()
        node.request("POST", f"/v1/topics/{dead_letter_topic}/ack", body, headers=JSON_CT)
        return n

    def settle(self, node: Any, ds: Sequence[Delivery], kind: str = "ack",
               conn: http.client.HTTPConnection | None = None, *, delay_s: float = 0.0,
               visibility_s: float = 0.0) -> list[int | None]:
        """Batch ack / extend / nack; per-handle statuses (None for all when no answer).
        ``delay_s``: a nack's delay; ``visibility_s``: an extend's lease length."""
        q = {"ack": "", "extend": "?extend=true", "nack": "?extend=0"}[kind]
        doc: dict[str, Any] = {"receipt_handles": [d.handle for d in ds]}
        if delay_s:
            doc["delay"] = f"{round(delay_s * 1000)}ms"
        if visibility_s:
            doc["visibility"] = f"{round(visibility_s * 1000)}ms"
        body = json.dumps(doc).encode()
        t0 = now()
        statuses: list[int | None]
        try:
            a = node.request("POST", f"/v1/topics/{self.topic}/ack{q}", body, headers=JSON_CT, conn=conn)
            statuses = ([x["status"] for x in a.json()["results"]] if a.status == 200
                        else [a.status if a.status < 500 else None] * len(ds))
            err: BaseException | None = None
        except (OSError, http.client.HTTPException, ValueError) as e:
            statuses, err = [None] * len(ds), e
        t1 = now()
        for d, st in zip(ds, statuses, strict=True):
            self.h.settled(Settle(d.handle, kind, t0, t1, st, round(delay_s * 1000) * 1_000_000,
                                  round(visibility_s * 1000) * 1_000_000), d.mid)
        if err is not None:
            raise err
        return statuses


_running: weakref.WeakSet[Traffic] = weakref.WeakSet()


def stop_all() -> None:
    """Stop every started driver (call it in a test's finally: a test that failed midway
    leaves no thread hammering dead nodes)."""
    for t in list(_running):
        t.stop()


class Traffic:
    """Producer and consumer threads against a set of nodes, every answer recorded.
    ``nodes()`` gives the nodes to use now (a thread moves to the next one after an
    error). Consumers ack in batches; every ``extend_every``-th delivery is extended
    first, every ``nack_every``-th nacked instead (with a delay of ``nack_delay_s`` when
    set: the ``delayed_early`` rule then judges every one of them), every
    ``abandon_every``-th never settled (its lease must run out and bring it back).
    ``rotate_every``: a thread moves to the next node after that many calls (so
    restarted nodes get traffic again)."""

    def __init__(self, history: History, topic: str, nodes: Callable[[], Sequence[Any]], *, producers: int = 3,
                 consumers: int = 3, pace_s: float = 0.002, extend_every: int = 0, nack_every: int = 0,
                 abandon_every: int = 0, max_n: int = 20, rotate_every: int = 0, nack_delay_s: float = 0.0) -> None:
        self.h, self.topic, self.nodes = history, topic, nodes
        self.nack_delay_s = nack_delay_s
        self.rec = Recorder(history, topic)
        self.pace_s, self.max_n, self.rotate_every = pace_s, max_n, rotate_every
        self.extend_every, self.nack_every, self.abandon_every = extend_every, nack_every, abandon_every
        self.stop_producing = threading.Event()
        self.stop_consuming = threading.Event()
        self.errors = 0
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self.producers = [threading.Thread(target=self._produce, args=(i,), daemon=True) for i in range(producers)]
        self.consumers = [threading.Thread(target=self._consume, args=(i,), daemon=True) for i in range(consumers)]

    def _pick(self, k: int) -> Any:
        ns = list(self.nodes())
        return ns[k % len(ns)]

    def _error(self) -> None:
        with self._lock:
            self.errors += 1

    def _produce(self, tid: int) -> None:
        k = tid
        conn: http.client.HTTPConnection | None = None
        node = None
        for i in itertools.count():
            if self.stop_producing.is_set():
                break
            if node is None:
                node = self._pick(k)
            try:
                if conn is None:
                    conn = node.conn()
                    conn.timeout = 5
            except OSError:
                conn = None
            st = self.rec.produce(node, f"p{tid}-{i}", conn)
            if st == 202:
                self.stop_producing.wait(self.pace_s)
                if self.rotate_every and i % self.rotate_every == self.rotate_every - 1:
                    if conn is not None:
                        conn.close()
                    conn, node, k = None, None, k + 1  # spread the load over every node in turn
                continue
            self._error()
            if conn is not None:
                conn.close()
            conn, node = None, None
            k += 1  # that node is down (or refusing): use the next one
            self.stop_producing.wait(0.05)
        if conn is not None:
            conn.close()

    def _consume(self, tid: int) -> None:
        k = tid
        conn: http.client.HTTPConnection | None = None
        node = None
        for i in itertools.count():
            if self.stop_consuming.is_set():
                break
            if self.rotate_every and i % self.rotate_every == self.rotate_every - 1:
                if conn is not None:
                    conn.close()
                conn, node, k = None, None, k + 1
            if node is None:
                node = self._pick(k)
            try:
                if conn is None:
                    conn = node.conn()
                    conn.timeout = 15
                ds = self.rec.consume(node, conn, max_n=self.max_n)
                if ds is None:
                    raise OSError("consume refused")
                if not ds:
                    continue
                keep = []
                ext, nack = [], []
                for d in ds:
                    n = next(self._seq)
                    if self.abandon_every and n % self.abandon_every == self.abandon_every - 1:
                        continue
                    if self.nack_every and n % self.nack_every == self.nack_every - 1:
                        nack.append(d)
                        continue
                    if self.extend_every and n % self.extend_every == self.extend_every - 1:
                        ext.append(d)
                    keep.append(d)
                if ext:
                    self.rec.settle(node, ext, "extend", conn)
                if nack:
                    self.rec.settle(node, nack, "nack", conn, delay_s=self.nack_delay_s)
                if keep:
                    self.rec.settle(node, keep, "ack", conn)
            except (OSError, http.client.HTTPException, ValueError, KeyError):
                self._error()
                if conn is not None:
                    conn.close()
                conn, node = None, None
                k += 1
                self.stop_consuming.wait(0.05)
        if conn is not None:
            conn.close()

    def start(self) -> Traffic:
        _running.add(self)
        for t in self.producers + self.consumers:
            t.start()
        return self

    def stop(self) -> None:
        """Tell every thread to end (a test that failed midway: no thread keeps hammering)."""
        self.stop_producing.set()
        self.stop_consuming.set()

    def __enter__(self) -> Traffic:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_more(self, n: int, timeout: float = 60.0, what: str = "traffic") -> None:
        """Wait until n more messages are answered 202."""
        from tests.harness import wait_for

        base = self.h.accepted_count()
        wait_for(lambda: self.h.accepted_count() >= base + n, timeout, 0.05, f"{n} more produces answered 202 "
                 f"({what})")

    def finish_producing(self) -> None:
        self.stop_producing.set()
        for t in self.producers:
            t.join(30)

    def finish_consuming(self) -> None:
        self.stop_consuming.set()
        for t in self.consumers:
            t.join(30)

    def drain(self, broker: Callable[[], bool] | None = None, timeout: float = 120.0) -> bool:
        """Stop producing, consume until every message answered 202 is acked (or, for
        those whose ack got no answer, until ``broker()`` says nothing is left), then stop.
        Returns whether ``broker()`` reported the broker empty (False without one)."""
        self.finish_producing()
        end = time.monotonic() + timeout
        empty = False
        debug = bool(os.environ.get("NARAD_TEST_DRAIN_DEBUG"))
        next_debug = time.monotonic() + 5
        try:
            while time.monotonic() < end:
                left = self.h.unacked()
                if debug and time.monotonic() >= next_debug:
                    next_debug += 5
                    state = broker() if broker is not None else None
                    print(f"drain {time.strftime('%H:%M:%S')}: unacked {sorted(left)[:5]} broker empty {state}",
                          flush=True)
                    for mid in sorted(left)[:2]:
                        print("  " + "\n  ".join(self.h.trail(mid)), flush=True)
                if not left:
                    empty = broker() if broker is not None else False
                    if broker is None or empty:
                        break
                elif broker is not None and broker():
                    # every ack's answer may be lost for the rest: the broker holds nothing
                    _, ds, ss, _ = self.h.snapshot()
                    unclear = {s.handle for s in ss if s.kind == "ack" and s.ambiguous}
                    doubt = {d.mid for d in ds if d.handle in unclear}
                    if left <= doubt:
                        empty = True
                        break
                time.sleep(0.2)
        finally:
            self.finish_consuming()
            self.h.finish()
        return empty


def broker_empty(node: Any, topic: str, partitions: int) -> Callable[[], bool]:
    """A probe: every partition of the topic reported by a live owner with no lag and
    nothing in flight."""
    def probe() -> bool:
        try:
            r = node.get(f"/v1/topics/{topic}")
        except OSError:
            return False
        if r.status != 200:
            return False
        stats = r.json()["partition_stats"]
        return len(stats) == partitions and all(
            s.get("status") != "owner_unavailable" and s.get("lag") == 0 and s.get("in_flight") == 0 for s in stats)
    return probe


def consume_until(rec: Recorder, node: Any, done: Callable[[], bool], timeout: float = 60.0) -> None:
    """One consumer, recorded: consume and ack batches until ``done()`` (or the deadline)."""
    conn = node.conn()
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end and not done():
            ds = rec.consume(node, conn, max_n=100)
            assert ds is not None, "consume refused"
            if ds:
                statuses = rec.settle(node, ds, "ack", conn)
                assert all(s == 204 for s in statuses), statuses
    finally:
        conn.close()
