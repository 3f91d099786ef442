"""The partition move planner: which move targets the controller sets or clears.

Pure functions over a snapshot of the metastore (the assignment rows of live
partitions and the member records): no I/O, no clock (the caller passes
``now_ms``), no randomness, and every choice is made in sorted order, so the
same input always gives the same rows. The controller (Raft leader) proposes
what they return as one ``SetMoveTargets`` entry; the entry's compare-and-set
refuses it whole when the metadata moved since the snapshot was read.

Rules (narad-internals 5.5):
- receivers are the alive members that are not draining;
- T counts the partitions owned by alive members (draining ones included), an
  in-flight move counted at its destination; each receiver's quota is
  floor(T/R) or ceil(T/R), the ceil slots going to the receivers that already
  hold most (ties: the lower id);
- only the surplus over a quota moves, and every partition of a draining
  member; a partition whose owner is dead never moves (its data is only on
  that disk); a partition with a move in flight is not planned again;
- at most ``max_in_flight`` moves are in flight at once.

Imports narad.meta.commands and narad.meta.records only.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from narad.meta.commands import MoveTargetRow
from narad.meta.records import AssignmentRecord, MemberRecord

MAX_IN_FLIGHT = 8  # MaxInFlightMoves
DEAD_TARGET_AFTER_MS = 120_000  # DeadTargetAbortAfter: a dead destination's move is cleared after this

Row = tuple[str, int, AssignmentRecord]  # (topic, partition, assignment) of a live partition


def member_status(members: dict[str, MemberRecord], node_id: str) -> str:
    """alive | dead | draining | not_a_member (a move's ``from_status`` / ``to_status``)."""
    m = members.get(node_id)
    if m is None:
        return "not_a_member"
    if m.status != "alive":
        return "dead"
    return "draining" if m.draining else "alive"


def plan(assignments: Iterable[Row], members: Iterable[MemberRecord], *,
         max_in_flight: int = MAX_IN_FLIGHT) -> list[MoveTargetRow]:
    """The move targets to set now (each row: expect no target, set one)."""
    by_id = {m.id: m for m in members}
    receivers = sorted(i for i, m in by_id.items() if m.status == "alive" and not m.draining)
    rows = sorted(assignments, key=lambda r: (r[0], r[1]))
    in_flight = sum(1 for _, _, a in rows if a.target is not None)
    budget = max_in_flight - in_flight
    if not receivers or budget <= 0:
        return []
    recv = set(receivers)
    load = dict.fromkeys(receivers, 0)
    movable: dict[str, list[Row]] = {i: [] for i in receivers}  # owned by a receiver, no move in flight
    shed: list[Row] = []  # owned by an alive draining member, no move in flight: all of them go
    total = 0
    for row in rows:
        _, _, a = row
        owner = by_id.get(a.owner)
        owner_alive = owner is not None and owner.status == "alive"
        if a.target is not None:
            if a.target in recv:
                load[a.target] += 1  # counted where it is going
                total += 1
            elif owner_alive:
                total += 1  # its target is dead or draining: cleared elsewhere, then it is movable again
                if a.owner in recv:
                    load[a.owner] += 1
            continue
        if not owner_alive:
            continue  # a dead (or unknown) owner's partitions never move and are not counted
        total += 1
        if a.owner in recv:
            load[a.owner] += 1
            movable[a.owner].append(row)
        else:
            shed.append(row)
    base, extra = divmod(total, len(receivers))
    ranked = sorted(receivers, key=lambda i: (-load[i], i))  # the ones holding most keep the ceil slots
    quota = {i: base + (1 if n < extra else 0) for n, i in enumerate(ranked)}
    pool = list(shed)  # a draining member's partitions first
    for i in receivers:
        surplus = load[i] - quota[i]
        if surplus > 0:
            pool.extend(movable[i][-surplus:])  # the highest (topic, partition) of its own
    need = {i: quota[i] - load[i] for i in receivers if quota[i] > load[i]}
    out: list[MoveTargetRow] = []
    for topic, part, a in pool:
        if len(out) >= budget or not need:
            break
        dest = min((i for i in need if i != a.owner), key=lambda i: (-need[i], i), default=None)
        if dest is None:
            continue
        need[dest] -= 1
        if not need[dest]:
            del need[dest]
        out.append(MoveTargetRow(topic, a.topic_id, part, a.owner, None, dest))
    return sorted(out, key=lambda r: (r.topic, r.partition))


def dead_target_rows(assignments: Iterable[Row], members: Iterable[MemberRecord], *, now_ms: int,
                     raft_servers: Collection[str], dead_after_ms: int = DEAD_TARGET_AFTER_MS) -> list[MoveTargetRow]:
    """Rows clearing the targets of in-flight moves whose destination is gone (no
    member record), dead for more than ``dead_after_ms`` (judged from its last
    heartbeat stamp, the leader's clock), or out of the Raft configuration while
    dead or draining. Safe at any time: the partition never left its owner."""
    by_id = {m.id: m for m in members}
    out = []
    for topic, part, a in sorted(assignments, key=lambda r: (r[0], r[1])):
        if a.target is None:
            continue
        m = by_id.get(a.target)
        gone = (m is None
                or (m.status != "alive" and now_ms - m.heartbeat_ms > dead_after_ms)
                or ((m.status != "alive" or m.draining) and m.raft_addr not in raft_servers))
        if gone:
            out.append(MoveTargetRow(topic, a.topic_id, part, a.owner, a.target, None))
    return out
