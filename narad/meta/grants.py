"""Authorization rules over metastore records: grant patterns, topic
visibility and management rights, and the user-management anti-escalation
rules. Pure functions; callers raise the errors.

An ``Identity`` is who a request acts as: a user name (security on), nobody
(security off: every check passes) or the local operator (naradctl over the
control socket, which has root's rights).
"""

from __future__ import annotations

from collections.abc import Callable

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


def may_dead_letter(user_of: Callable[[str], UserRecord | None], source: TopicRecord, dlt: TopicRecord) -> bool:
    """Whether records of `source` may be dead-lettered into `dlt` now: they are written
    on the source owner's behalf, so a topic with an owner needs that owner (looked up
    with `user_of`; a deleted user may not) to be able to write to `dlt`, at every pass
    of the driver and when the setting is made (a grant taken away, or a dead-letter
    topic deleted and created again by someone else, holds the records). A topic
    without an owner (made by the operator, or with security off) is unchecked."""
    if source.owner is None:
        return True
    return may_write_to(user_of(source.owner), dlt)
