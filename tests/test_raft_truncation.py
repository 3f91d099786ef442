"""pysyncobj truncates a follower's log on any overlapping AppendEntries,
even when nothing conflicts: a delayed duplicate message can delete entries
the follower already acknowledged (and that may be committed). narad's seam
deletes only from the first entry whose term differs (Raft 5.3).

The scenario is driven message by message into a real SyncObj follower (real
journal files, real transport bound on 127.0.0.1, no tick thread), the way a
reordered network would deliver it."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from pysyncobj import SyncObj, SyncObjConf
from pysyncobj.node import TCPNode

from narad.meta.commands import ApplyResult
from narad.meta.raft import _NaradSyncObj


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Seam:
    def _apply(self, index: int, data: bytes) -> ApplyResult:
        return ApplyResult(0, "", index)

    def on_leader_contact(self, commit: int) -> None:
        pass


def _follower(cls: type, tmp: Path) -> Any:
    port = _free_port()
    conf = SyncObjConf(autoTick=False, journalFile=str(tmp), appendEntriesUseBatch=False,
                       raftMinTimeout=100, raftMaxTimeout=200, connectionTimeout=200,
                       leaderFallbackTimeout=300, dynamicMembershipChange=True)
    peer = "127.0.0.1:1"
    if cls is _NaradSyncObj:
        return _NaradSyncObj(_Seam(), f"127.0.0.1:{port}", [peer], conf), TCPNode(peer)
    return cls(f"127.0.0.1:{port}", [peer], conf=conf), TCPNode(peer)


def _ae(prev: int, prev_term: int, entries: list[tuple[bytes, int, int]], commit: int, term: int = 1) -> dict:
    return {"type": "append_entries", "term": term, "commit_index": commit, "entries": entries,
            "prevLogIdx": prev, "prevLogTerm": prev_term}


E2, E3, E4 = (b"\x01a", 2, 1), (b"\x01b", 3, 1), (b"\x01c", 4, 1)


def _log(obj: Any) -> list[tuple[int, int]]:
    return [(e[1], e[2]) for e in obj._SyncObj__raftLog]


@pytest.mark.parametrize("cls", [SyncObj, _NaradSyncObj])
def test_delayed_duplicate_append_entries(cls: type, tmp_path: Path) -> None:
    obj, leader = _follower(cls, tmp_path)
    try:
        obj._SyncObj__onMessageReceived(leader, _ae(1, 0, [E2, E3, E4], commit=4))
        assert _log(obj) == [(1, 0), (2, 1), (3, 1), (4, 1)]
        assert obj.raftCommitIndex == 4
        # The leader's earlier message (entries up to 2) arrives late.
        obj._SyncObj__onMessageReceived(leader, _ae(1, 0, [E2], commit=2))
        if cls is SyncObj:
            # The upstream behaviour this seam exists to fix: committed entries 3 and 4 are gone.
            assert _log(obj) == [(1, 0), (2, 1)]
        else:
            assert _log(obj) == [(1, 0), (2, 1), (3, 1), (4, 1)]
            assert obj.raftCommitIndex == 4
    finally:
        obj._doDestroy()


def test_real_conflict_still_truncates(tmp_path: Path) -> None:
    obj, leader = _follower(_NaradSyncObj, tmp_path)
    try:
        obj._SyncObj__onMessageReceived(leader, _ae(1, 0, [E2, E3], commit=2))
        # A new leader (term 2) holds a different entry at index 3.
        obj._SyncObj__onMessageReceived(leader, _ae(2, 1, [(b"\x01z", 3, 2)], commit=2, term=2))
        assert _log(obj) == [(1, 0), (2, 1), (3, 2)]
        assert obj._SyncObj__raftLog[2][0] == b"\x01z"
        # Only up to the last new entry may commit, never an unverified tail.
        obj._SyncObj__onMessageReceived(leader, _ae(3, 2, [], commit=9, term=2))
        assert obj.raftCommitIndex == 3
    finally:
        obj._doDestroy()
