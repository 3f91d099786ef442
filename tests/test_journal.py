"""The durable Raft journal (real files): reopen, torn tails, truncation,
compaction, and term/vote durability."""

from __future__ import annotations

from pathlib import Path

from narad.meta.journal import DurableJournal


def test_entries_survive_reopen_and_torn_tail_is_cut(tmp_path: Path) -> None:
    j = DurableJournal(tmp_path)
    for i in range(1, 6):
        j.add(f"cmd{i}".encode(), i, 1)
    j.sync()
    j._destroy()
    with open(tmp_path / "log", "ab") as fh:
        fh.write(b"\x00\x00\x00\x30garbage")  # a frame that never finished
    j2 = DurableJournal(tmp_path)
    assert [e[1] for e in j2] == [1, 2, 3, 4, 5]
    assert j2[4] == (b"cmd5", 5, 1)
    j2.add(b"cmd6", 6, 2)
    j2.sync()
    j2._destroy()
    assert [e[1] for e in DurableJournal(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_delete_from_and_to(tmp_path: Path) -> None:
    j = DurableJournal(tmp_path)
    for i in range(1, 11):
        j.add(b"x" * i, i, 1)
    j.deleteEntriesFrom(7)  # keeps indexes 1..7
    j.deleteEntriesTo(3)  # drops the first three
    assert [e[1] for e in j] == [4, 5, 6, 7]
    j.add(b"y", 8, 2)
    j.sync()
    j._destroy()
    assert [(e[1], e[2]) for e in DurableJournal(tmp_path)] == [(4, 1), (5, 1), (6, 1), (7, 1), (8, 2)]


def test_term_and_vote_are_durable_at_once(tmp_path: Path) -> None:
    j = DurableJournal(tmp_path)
    j.setCurrentTerm(7, "127.0.0.1:9")
    # No close, no flush: a crash right now must keep the vote.
    j2 = DurableJournal(tmp_path)
    assert j2.getCurrentTerm() == 7 and j2.getVotedForNodeId() == "127.0.0.1:9"
