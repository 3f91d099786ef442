"""Authorization rules over metastore records: grant patterns, topic
visibility and management rights, and the user-management anti-escalation
rules. Pure functions; callers raise the errors.

An ``Identity`` is who a request acts as: a user name (security on), nobody
(security off: every check passes) or the local operator (naradctl over the
control socket, which has root's rights).
"""

from __future__ import annotations

import msgspec

from narad.meta.records import TopicRecord, UserRecord


class Identity(msgspec.Struct, frozen=True, array_like=True):
    name: str | None = None  # the authenticated user
    security: bool = True  # False: security is off, every check passes
    operator: bool = False  # naradctl on the control socket

    @property
    def unrestricted(self) -> bool:
        return not self.security or self.operator


OPERATOR = Identity(None, True, True)
ANONYMOUS = Identity(None, False, False)


def pattern_matches(pattern: str, name: str) -> bool:
    if pattern.endswith("*"):
        return name.startswith(pattern[:-1])
    return pattern == name


def is_admin(user: UserRecord | None) -> bool:
    if user is None:
        return False
    return user.root or any(g.action == "admin" for g in user.grants)


def has_grant(user: UserRecord | None, action: str, topic: str) -> bool:
    if user is None:
        return False
    if is_admin(user):
        return True
    return any(g.action == action and any(pattern_matches(p, topic) for p in g.patterns) for g in user.grants)


def can_read_topic(user: UserRecord | None, topic: TopicRecord) -> bool:
    """Any grant whose pattern matches the name, ownership, or admin."""
    if user is None:
        return False
    if is_admin(user) or (topic.owner is not None and topic.owner == user.username):
        return True
    return any(pattern_matches(p, topic.name) for g in user.grants for p in g.patterns)


def can_manage_topic(user: UserRecord | None, topic: TopicRecord) -> bool:
    if user is None:
        return False
    return is_admin(user) or (topic.owner is not None and topic.owner == user.username)


def may_write_to(user: UserRecord | None, topic: TopicRecord) -> bool:
    """A produce grant on `topic`, its ownership, or admin."""
    return has_grant(user, "produce", topic.name) or can_manage_topic(user, topic)


def may_dead_letter(owner: UserRecord | None, owner_name: str | None, dlt: TopicRecord) -> bool:
    """Whether records of a topic owned by `owner_name` (its user record `owner`, None
    when that user is gone) may be dead-lettered into `dlt` now: the dead-letter driver
    writes on the owner's behalf, so a topic with an owner needs that owner's right to
    write there at every pass (a grant taken away, or a dead-letter topic deleted and
    created again by someone else, stops it: the records are held). A topic without
    an owner (made by an admin, the operator, or with security off) is unchecked."""
    if owner_name is None:
        return True
    return may_write_to(owner, dlt)
