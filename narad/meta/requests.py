"""Requests a worker (or naradctl) sends to the supervisor's metadata
service over local RPC (narad.ipc), and the replies. Tagged msgspec structs;
pure data.
"""

from __future__ import annotations

import msgspec

from narad.meta.grants import Identity
from narad.meta.records import Grant, MemberRecord


class CreateTopicReq(msgspec.Struct, tag=True):
    who: Identity
    name: str
    partitions: int | None = None
    retention_ms: int | None = None
    visibility_timeout_ms: int | None = None
    max_in_flight_per_partition: int | None = None
    max_acked_ahead_per_partition: int | None = None
    schema: bytes | None = None
    # Create-as-child (type 23 with a link): the parent, the delay, and the attach
    # point the receiving node asked the parent's partition owners for (one
    # committed high watermark per parent partition of parent incarnation parent_id).
    parent: str | None = None
    fanout_delay_ms: int = 0
    parent_id: str | None = None
    attach_offsets: list[int] = []
    # Delivery settings (issue 14): None leaves the default.
    max_deliveries: int | None = None
    dead_letter_topic: str | None = None
    idempotency_window_ms: int | None = None


class AlterTopicReq(msgspec.Struct, tag=True):
    who: Identity
    name: str
    retention_ms: int | None = None
    max_in_flight_per_partition: int | None = None
    max_acked_ahead_per_partition: int | None = None
    partitions: int | None = None
    schema: bytes | None = None
    schema_base_version: int | None = None
    max_deliveries: int | None = None
    dead_letter_topic: str | None = None  # "": clear it
    idempotency_window_ms: int | None = None


class DeleteTopicReq(msgspec.Struct, tag=True):
    who: Identity
    name: str


class CreateUserReq(msgspec.Struct, tag=True):
    who: Identity
    username: str
    password_hash: bytes
    grants: list[Grant] = []


class SetGrantsReq(msgspec.Struct, tag=True):
    who: Identity
    username: str
    grants: list[Grant]


class SetPasswordReq(msgspec.Struct, tag=True):
    who: Identity
    username: str
    password_hash: bytes
    current_password_verified: bool = False


class DeleteUserReq(msgspec.Struct, tag=True):
    who: Identity
    username: str


class AuthAttemptReq(msgspec.Struct, tag=True):
    """Before a bcrypt check for ``username``: take a throttle token (refused: 429)."""

    username: str


class AuthAttemptResp(msgspec.Struct):
    allowed: bool
    retry_after: float = 0.0
    budget: bool = False  # a token of the node-wide failure budget was taken too


class AuthOutcome(msgspec.Struct, tag=True):
    """Report a bcrypt check's outcome (a note: no reply); a correct password gives
    back the tokens its attempt took (``budget``: as the attempt's answer said)."""

    username: str
    ok: bool
    budget: bool = False


class StatusReq(msgspec.Struct, tag=True):
    pass


class Empty(msgspec.Struct):
    pass


class MembersReq(msgspec.Struct, tag=True):
    pass


class ForgetServerReq(msgspec.Struct, tag=True):
    """Remove a Raft server that has no member record (a joiner that crashed or was replaced)."""

    who: Identity
    id: str  # the server's Raft address (host:port), or a node id


class ImportMetastoreReq(msgspec.Struct, tag=True):
    """Install a metastore export (naradctl metastore import) as one Raft entry."""

    who: Identity
    document: bytes  # the export, JSON
    overwrite: bool = False


class ImportMetastoreResp(msgspec.Struct):
    imported: dict[str, int]
    index: int


class ForgetServerResp(msgspec.Struct):
    id: str
    voter: bool


class Reason(msgspec.Struct):
    """Why a decommission is refused or blocked (Narad's DecommissionReason)."""

    code: str  # below_min_voters | no_healthy_majority | no_receivers | owner_dead | move_target |
    #            dispatch_backlog | node_status_unavailable | move_budget_full | leader_transfer
    message: str


class MemberView(msgspec.Struct):
    id: str
    addr: str
    status: str
    draining: bool
    owned_partitions: int
    outbound_moves: int
    voter: bool
    leader: bool
    heartbeat_age_seconds: float
    build: str = ""  # the release the member last reported
    newest_entry_type: int = 0  # the newest Raft entry type it last reported applying
    entry_types: list[int] = []  # every Raft entry type it last reported applying
    decommission_blocked: list[Reason] | None = None  # a draining member: what its removal waits for


# ---- partition moves and decommission (issue 13) -------------------------------------


class MoveWorkerView(msgspec.Struct):
    """A destination's move runner for one partition (Narad's MoveWorker)."""

    topic: str
    partition: int
    source: str
    target: str
    started_at: str  # RFC 3339, UTC
    phase: str  # copying | frozen | flip_pending | waiting_for_source | blocked
    attempts: int = 0
    last_error: str = ""
    copied_bytes: int = 0
    blocked: str | None = None  # copy_unverifiable | source_dead_copy_behind


class MoveView(msgspec.Struct, rename={"from_": "from"}):
    """An assignment row with a move target (Narad's Move)."""

    topic: str
    partition: int
    from_: str
    to: str
    from_status: str  # alive | dead | draining | not_a_member
    to_status: str
    blocked: str | None = None  # source_dead | target_dead | target_not_member
    worker: MoveWorkerView | None = None
    worker_error: str | None = None


class DecommissionReq(msgspec.Struct, tag=True):
    """POST (mark draining; dry_run: only say whether it would) or DELETE
    (cancel) /v1/cluster/members/{id}/decommission. Leader; a dry run is
    answered by the node it reaches from its replica and never forwarded."""

    who: Identity
    node_id: str
    dry_run: bool = False
    cancel: bool = False


class DecommissionResp(msgspec.Struct):
    """The dry run's answer (a real decommission answers 204, a refusal 409 with
    ``reasons`` in the error body)."""

    member: str
    would_decommission: bool
    reasons: list[Reason]
    voter: bool
    owned_partitions: int
    inbound_moves: int


class AbortMoveReq(msgspec.Struct, tag=True):
    """POST /v1/cluster/moves/{topic}/{partition}/abort[?target=]: clear the target
    (compare-and-set on the target read, or the one given). Leader."""

    who: Identity
    topic: str
    partition: int
    target: str | None = None


class AbortMoveResp(msgspec.Struct):
    move: MoveView  # the move as it was aborted
    note: str


class CompleteMoveReq(msgspec.Struct, tag=True):
    """A destination flips ownership of a partition it installed (type 40). Leader."""

    topic: str
    topic_id: str
    partition: int
    source: str
    target: str
    # A force-promote (the source dead): the leader also requires the source's member
    # record dead with its last heartbeat at least the force-promote time old.
    force: bool = False


class CompleteMoveResp(msgspec.Struct):
    outcome: str  # done (this node owns it now) | refused (the row moved on) | not_found


class AssignmentReadReq(msgspec.Struct, tag=True):
    """A leader read of one assignment row: answered only by the leader, after a
    barrier and a re-read (a follower answers 421), to resolve an ambiguous flip."""

    topic: str
    partition: int


class AssignmentReadResp(msgspec.Struct):
    found: bool
    topic_id: str = ""
    owner: str = ""
    target: str | None = None


class QuarantinedCopy(msgspec.Struct):
    kind: str  # stale_copy | install_conflict | unverifiable
    topic: str
    partition: int
    dir: str
    bytes: int
    mod_time: str  # RFC 3339, UTC


class NodeStatusReq(msgspec.Struct, tag=True, array_like=True):
    """Any worker of a node (node RPC) or the API: this node's status for
    ``GET /v1/cluster/members?detail=true``."""


class NodeStatusView(msgspec.Struct, array_like=True):
    node: str
    draining: bool
    produce_in_flight: int  # records not yet durable: staged in the ingress WALs or in a direct commit
    dispatch_backlog: int  # accepted records not yet confirmed at their owner
    moves: list[MoveWorkerView] = []  # this node's move runners (it is their destination)
    quarantine: list[QuarantinedCopy] = []  # partition copies set aside, never deleted


class MembersResp(msgspec.Struct):
    members: list[MemberView]


class RaftView(msgspec.Struct):
    role: str
    term: int
    leader: str | None
    leader_id: str | None
    commit_index: int
    applied_index: int
    last_log_index: int
    first_log_index: int
    persisted_commit_index: int
    has_quorum: bool
    leader_contact_age_seconds: float | None
    voters: list[str] = []  # every Raft voter's address, this node included


class WorkerView(msgspec.Struct):
    index: int
    pid: int
    core: int | None
    uptime_seconds: float
    restarts: int
    alive: bool
    heartbeat_age_seconds: float | None = None  # since its loop last stamped its heartbeat


class NodeStatus(msgspec.Struct):
    node_id: str
    build: str
    ready: bool
    reason: str
    raft: RaftView
    workers: list[WorkerView]
    data_dir: str
    client_port: int
    raft_port: int
    cluster_port: int
    join_rounds: int = 0  # join-only: rounds of join requests sent while not admitted yet
    # seconds since each loop stamped its heartbeat: supervisor, raft tick thread, fork server
    heartbeats: dict[str, float] = msgspec.field(default_factory=dict)


class ConfirmGoneReq(msgspec.Struct, tag=True):
    """Before destroying data: is this topic incarnation definitely gone?"""

    topic: str
    topic_id: str


class ConfirmGoneResp(msgspec.Struct):
    gone: bool


class AttachChildReq(msgspec.Struct, tag=True):
    """Link an existing topic as a fan-out child (entry type 27). ``attach_offsets``
    is the attach point the receiving node asked the owners of parent incarnation
    ``parent_id`` for: one committed high watermark per parent partition."""

    who: Identity
    parent: str
    child: str
    delay_ms: int = 0
    parent_id: str = ""
    attach_offsets: list[int] = []


class DetachChildReq(msgspec.Struct, tag=True):
    """Unlink a child (entry type 28); it becomes a standalone topic."""

    who: Identity
    parent: str
    child: str


class ConfirmEpochReq(msgspec.Struct, tag=True):
    """Before anchoring a fan-out cursor or deleting a cursor file: is ``child``
    (incarnation ``child_id``) still linked to ``parent`` (``parent_id``) under
    ``epoch``? Answered by the leader only, after a barrier and a re-read."""

    parent: str
    parent_id: str
    child: str
    child_id: str
    epoch: str


class ConfirmEpochResp(msgspec.Struct):
    linked: bool  # True: definitely linked under that epoch
    known: bool = True  # False: no definite answer (not the leader, no barrier): do nothing destructive


class CaughtUpReq(msgspec.Struct, tag=True):
    """Is this node's replica provably current (RaftNode.caught_up())?"""


class CaughtUpResp(msgspec.Struct):
    caught_up: bool


class RegisterReq(msgspec.Struct, tag=True):
    """A node registers (or refreshes) its member record; the leader stamps it."""

    member: MemberRecord


class HeartbeatReq(msgspec.Struct, tag=True):
    node_id: str
    build: str
    newest_entry_type: int
    client_addr: str = ""
    cluster_addr: str = ""
    entry_types: list[int] = []
    dispatch_backlog: int = -1  # records in this node's ingress WALs not yet at their owner (-1: unknown)


class ForwardReq(msgspec.Struct, tag=True, array_like=True):
    """A metadata request forwarded to the Raft leader (node RPC)."""

    origin: str
    request_id: str  # a retry after a lost answer gets the first answer, not a second run
    request: msgspec.Raw  # one of the tagged requests above, msgpack


class Forwarded(msgspec.Struct, tag=True):
    """The same, handed by the worker that received it to its supervisor."""

    origin: str
    request_id: str
    request: msgspec.Raw


class ForwardResp(msgspec.Struct):
    value: msgspec.Raw  # the leader's answer, msgpack
    index: int  # the Raft index the caller's replica must reach before answering
