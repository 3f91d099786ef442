"""The node's idempotency claims table (narad.broker.idem_claims) on real shared memory,
claimed from real forked processes."""

from __future__ import annotations

import multiprocessing
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from narad.broker import idem_claims as IC

NOW = 1_700_000_000_000
WINDOW = 300_000
T1, T2 = IC.topic_tag("0123456789abcdef0123456789abcdef"), IC.topic_tag("fedcba9876543210fedcba9876543210")


@pytest.fixture
def table() -> Iterator[IC.ClaimTable]:
    name = f"/narad-test-idem-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    t = IC.ClaimTable.create(name, buckets=1024)
    yield t
    t.close(unlink=True)


def _keys(n: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(n)]


def test_a_claim_is_pending_until_settled_then_a_duplicate_until_its_window_passes(table: IC.ClaimTable) -> None:
    ks = table.prepare(_keys(3))
    got, ev = table.claim(T1, ks, 0, NOW, WINDOW, tag=5)
    assert got == [IC.CLAIMED] * 3 and ev == 0
    # Another claimer (or the same one) while it is pending: PENDING, never a second claim.
    assert table.claim(T1, ks, 0, NOW, WINDOW, tag=6)[0] == [IC.PENDING] * 3
    assert table.claim(T1, ks, 0, NOW, WINDOW, tag=5)[0] == [IC.PENDING] * 3
    # Another claimer's tag does not settle it.
    assert table.settle(T1, ks, 6, NOW, WINDOW, [IC.COMMIT] * 3) == 0
    assert table.settle(T1, ks, 5, NOW, WINDOW, [IC.COMMIT, IC.RELEASE, 0]) == 2
    got, _ = table.claim(T1, ks, 0, NOW + 1, WINDOW, tag=6)
    assert got == [IC.DUPLICATE, IC.CLAIMED, IC.PENDING]  # committed; released and claimed again; still 5's
    # The committed key is a duplicate until its window passes, then free.
    one = IC.Keys(1, ks.fp[0:1], ks.crc[0:1])
    assert table.claim(T1, one, 0, NOW + WINDOW - 1, WINDOW, tag=7)[0] == [IC.DUPLICATE]
    assert table.stats(NOW + WINDOW - 1)["keys"] == 1
    assert table.claim(T1, one, 0, NOW + WINDOW, WINDOW, tag=7)[0] == [IC.CLAIMED]
    s = table.stats(NOW + WINDOW)
    assert (s["keys"], s["pending"], s["capacity"]) == (0, 3, 1024 * IC.WAYS)


def test_keys_are_per_topic(table: IC.ClaimTable) -> None:
    ks = table.prepare(["order-1"])
    assert table.claim(T1, ks, 0, NOW, WINDOW, 1)[0] == [IC.CLAIMED]
    table.settle(T1, ks, 1, NOW, WINDOW, [IC.COMMIT])
    assert table.claim(T2, ks, 0, NOW, WINDOW, 1)[0] == [IC.CLAIMED]
    assert table.claim(T1, ks, 0, NOW, WINDOW, 1)[0] == [IC.DUPLICATE]


def test_a_full_bucket_evicts_the_committed_key_that_expires_first_never_a_pending_one() -> None:
    t = IC.ClaimTable.create(f"/narad-test-idem-{os.getpid()}-one", buckets=1)
    try:
        ks = [t.prepare([k]) for k in _keys(IC.WAYS + 1)]
        for k in ks[: IC.WAYS]:
            assert t.claim(T1, k, 0, NOW, WINDOW, 1)[0] == [IC.CLAIMED]
        assert t.claim(T1, ks[-1], 0, NOW, WINDOW, 1) == ([IC.FULL], 0)  # every slot pending
        for i, k in enumerate(ks[: IC.WAYS]):
            t.settle(T1, k, 1, NOW + (100 if i else 0), WINDOW, [IC.COMMIT])  # ks[0] expires first
        assert t.claim(T1, ks[-1], 0, NOW, WINDOW, 2) == ([IC.CLAIMED], 1)
        assert t.claim(T1, ks[1], 0, NOW, WINDOW, 2) == ([IC.DUPLICATE], 0)  # kept: ks[0] went
        assert t.claim(T1, ks[0], 0, NOW, WINDOW, 2) == ([IC.CLAIMED], 1)  # new again, in a slot evicted for it
        s = t.stats(NOW)
        assert s["evicted"] == 2 and s["refused_full"] == 1
    finally:
        t.close(unlink=True)


def test_load_marks_keys_committed_keeping_the_later_commit_and_ending_a_pending_claim(table: IC.ClaimTable) -> None:
    ks = table.prepare(_keys(3))
    table.claim(T1, IC.Keys(1, ks.fp[0:1], ks.crc[0:1]), 0, NOW, 100, 9)  # pending under a dead claimer
    assert table.load(T1, ks, [4, 4, 4], [NOW, NOW, NOW - 200], 100, NOW) == 0  # (the third's window passed)
    assert table.claim(T1, ks, 4, NOW + 5, 100, 3)[0] == [IC.DUPLICATE, IC.DUPLICATE, IC.CLAIMED]
    table.load(T1, ks, [4, 4, 4], [NOW + 50, NOW - 50, NOW + 50], 100, NOW)
    # The first keeps the later commit (NOW + 50), the second its own (NOW: passed at NOW + 100),
    # the third, pending under claimer 3, became committed: its record was found durable.
    assert table.claim(T1, ks, 4, NOW + 120, 100, 3)[0] == [IC.DUPLICATE, IC.CLAIMED, IC.DUPLICATE]


def test_a_claim_judges_by_the_window_it_is_given_and_rewindow_keeps_the_slots_by_the_new_one() -> None:
    t = IC.ClaimTable.create(f"/narad-test-idem-{os.getpid()}-win", buckets=1)
    try:
        a, c, b = t.prepare(["a"]), t.prepare(["c"]), t.prepare(["b"])
        t.claim(T1, a, 0, NOW, 100, 1)
        t.settle(T1, a, 1, NOW, 100, [IC.COMMIT])  # stored with a 100 ms window
        t.claim(T2, c, 0, NOW, 1000, 1)
        t.settle(T2, c, 1, NOW - 50, 1000, [IC.COMMIT])  # another topic's key, until NOW + 950
        for k in t.prepare(_keys(4)).fp:  # the bucket's other four slots: pending claims
            t.claim(T1, IC.Keys(1, ffi_u64(k), t.prepare(["x"]).crc), 0, NOW, 100, 2)
        # The window raised to 1 s: the key is a repeat by it at once.
        assert t.claim(T1, a, 0, NOW + 150, 1000, 1)[0] == [IC.DUPLICATE]
        # Its slot is still kept by the old window until the change is applied to the table.
        assert t.rewindow(T1, 1000) == 1
        assert t.claim(T2, b, 0, NOW + 150, 1000, 1) == ([IC.CLAIMED], 1)  # c evicted, not a
        assert t.claim(T1, a, 0, NOW + 150, 1000, 1)[0] == [IC.DUPLICATE]
    finally:
        t.close(unlink=True)


def ffi_u64(v: int) -> object:
    from narad._native import ffi
    return ffi.new("uint64_t[]", [v])


def test_release_owner_empties_a_claimers_pending_claims_only(table: IC.ClaimTable) -> None:
    a, b = table.prepare(_keys(20)), table.prepare(_keys(20))
    table.claim(T1, a, 0, NOW, WINDOW, tag=(7 << 8) | 2)  # worker 1, incarnation 7
    table.claim(T1, b, 0, NOW, WINDOW, tag=(7 << 8) | 3)  # worker 2
    table.settle(T1, a, (7 << 8) | 2, NOW, WINDOW, [IC.COMMIT] * 10 + [0] * 10)
    assert table.release_owner(0xFF, 2) == 10
    assert table.claim(T1, a, 0, NOW, WINDOW, 1)[0] == [IC.DUPLICATE] * 10 + [IC.CLAIMED] * 10
    assert table.claim(T1, b, 0, NOW, WINDOW, 1)[0] == [IC.PENDING] * 20


def test_collect_gives_a_homes_committed_keys_which_another_table_loads(table: IC.ClaimTable) -> None:
    keys = _keys(200)
    homes = [i % 4 for i in range(200)]
    for h in range(4):
        mine = [k for k, hh in zip(keys, homes, strict=True) if hh == h]
        ks = table.prepare(mine)
        table.claim(T1, ks, h, NOW, WINDOW, 1)
        table.settle(T1, ks, 1, NOW, WINDOW, [IC.COMMIT if keys.index(k) < 150 else 0 for k in mine])
    got = table.collect(T1, 2, NOW, chunk=16)
    want = {i for i in range(150) if homes[i] == 2}
    ks = table.prepare(keys)
    assert sorted(e[0] for e in got) == sorted(ks.fp[i] for i in want)
    assert table.collect(T2, 2, NOW) == [] and table.collect(T1, 2, NOW + WINDOW) == []
    other = IC.ClaimTable.create(table.name + "-b", buckets=1024)
    try:
        other.load_raw(T1, 2, got, WINDOW, NOW)
        verdicts = other.claim(T1, ks, 0, NOW, WINDOW, 1)[0]
        assert [i for i, v in enumerate(verdicts) if v == IC.DUPLICATE] == sorted(want)
    finally:
        other.close(unlink=True)


def test_a_sealed_home_claims_no_new_key_until_unsealed_or_lapsed(table: IC.ClaimTable) -> None:
    done = table.prepare(["committed-before"])
    table.claim(T1, done, 3, NOW, WINDOW, 1)
    table.settle(T1, done, 1, NOW, WINDOW, [IC.COMMIT])
    assert table.seal(T1, 3, NOW + 1000, NOW) and table.sealed(NOW) == 1
    ks = table.prepare(["a", "b"])
    assert table.claim(T1, ks, 3, NOW, WINDOW, 1)[0] == [IC.SEALED] * 2
    assert table.claim(T1, done, 3, NOW, WINDOW, 1)[0] == [IC.DUPLICATE]  # a repeat is still answered
    assert table.claim(T2, ks, 3, NOW, WINDOW, 1)[0] == [IC.CLAIMED] * 2  # another topic's home 3
    other = table.prepare(["c"])
    assert table.claim(T1, other, 4, NOW, WINDOW, 1)[0] == [IC.CLAIMED]
    # Homed by key (a keyless record's key hashes to its home): sealed when it hashes to 3.
    many = table.prepare([f"k{i}" for i in range(40)])
    got = table.claim(T1, many, IC.by_key(8), NOW, WINDOW, 2)[0]
    assert [g for i, g in enumerate(got) if many.crc[i] % 8 == 3] == [IC.SEALED] * sum(
        1 for i in range(40) if many.crc[i] % 8 == 3)
    assert all(g == IC.CLAIMED for i, g in enumerate(got) if many.crc[i] % 8 != 3)
    assert table.claim(T1, ks, 3, NOW + 1000, WINDOW, 1)[0] == [IC.CLAIMED] * 2  # lapsed
    table.settle(T1, ks, 1, 0, 0, [IC.RELEASE] * 2)
    assert table.seal(T1, 3, NOW + 5000, NOW) and table.seal(T1, 3, NOW + 9000, NOW)  # extended, one seal
    assert table.sealed(NOW + 6000) == 1
    table.unseal(T1, 3, NOW)
    assert table.sealed(NOW) == 0 and table.claim(T1, ks, 3, NOW, WINDOW, 1)[0] == [IC.CLAIMED] * 2


def test_a_table_holds_sixteen_live_seals_and_reuses_lapsed_ones(table: IC.ClaimTable) -> None:
    assert all(table.seal(T1, h, NOW + 100 + h, NOW) for h in range(IC.SEALS))
    assert not table.seal(T1, 99, NOW + 100, NOW)
    assert table.seal(T1, 99, NOW + 500, NOW + 100)  # home 0's seal lapsed at NOW + 100: its entry is reused
    assert table.sealed(NOW + 100) == IC.SEALS
    for h in range(IC.SEALS):
        table.unseal(T1, h, NOW)
    table.unseal(T1, 99, NOW)
    assert table.sealed(NOW) == 0


def _homed_claimer(name: str, keys: list[str], tag: int, q: multiprocessing.Queue, go: object) -> None:
    """Claims and commits keys homed at partition 1, a few at a time, until they run out."""
    t = IC.ClaimTable.attach(name)
    committed: list[str] = []
    go.wait()  # type: ignore[attr-defined]
    for i in range(0, len(keys), 4):
        part = keys[i : i + 4]
        ks = t.prepare(part)
        got, _ = t.claim(T1, ks, 1, NOW, WINDOW, tag)
        t.settle(T1, ks, tag, NOW, WINDOW, [IC.COMMIT if g == IC.CLAIMED else 0 for g in got])
        committed.extend(k for k, g in zip(part, got, strict=True) if g == IC.CLAIMED)
        time.sleep(0.0005)  # (a pace, so the seal lands halfway)
    q.put(committed)


def test_a_seal_then_the_pending_wait_then_collect_misses_no_key_claimed_around_it() -> None:
    """A move's source: keys homed at the moving partition are claimed and committed by
    other processes while it seals; every key they commit is in what it collects, and
    none is committed after (the carry misses nothing)."""
    table = IC.ClaimTable.create(f"/narad-test-idem-{os.getpid()}-seal", buckets=1 << 14)
    ctx = multiprocessing.get_context("fork")
    q: multiprocessing.Queue = ctx.Queue()
    go = ctx.Barrier(3)
    keys = [_keys(4000) for _ in range(2)]
    procs = [ctx.Process(target=_homed_claimer, args=(table.name, keys[s], s + 1, q, go)) for s in range(2)]
    for p in procs:
        p.start()
    go.wait()
    deadline = time.monotonic() + 60
    while table.stats(NOW)["keys"] < 200 and time.monotonic() < deadline:  # (they are under way)
        time.sleep(0.001)
    assert table.seal(T1, 1, NOW + WINDOW, NOW)
    while table.pending_homed(T1, 1) and time.monotonic() < deadline:
        time.sleep(0.0001)
    collected = {e[0] for e in table.collect(T1, 1, NOW)}
    done = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    committed = [k for d in done for k in d]
    assert 200 <= len(committed) < 8000  # some before the seal, and the seal stopped the rest
    assert {table.prepare([k]).fp[0] for k in committed} == collected
    table.close(unlink=True)


def test_every_key_is_a_key(table: IC.ClaimTable) -> None:
    # Empty, long, NUL bytes and other UTF-8 are keys like any other (the API bounds what a
    # producer gives; a record's block may hold any); "ab" then "c" is not "a" then "bc".
    ks = table.prepare(["é" * 64, "a\0b", "ab", "c", "a", "bc", "", "x" * 5000])
    got, _ = table.claim(T1, ks, 0, NOW, WINDOW, 1)
    assert got == [IC.CLAIMED] * 8


def _racer(name: str, keys: list[str], seed: int, tag: int, q: multiprocessing.Queue, go: object) -> None:
    t = IC.ClaimTable.attach(name)
    go.wait(timeout=30)  # type: ignore[attr-defined]  # (all start together)
    order = list(range(len(keys)))
    random.Random(seed).shuffle(order)
    won = []
    for lo in range(0, len(order), 10):
        idx = order[lo : lo + 10]
        got, _ = t.claim(T1, t.prepare([keys[i] for i in idx]), 0, NOW, WINDOW, tag)
        won.extend(i for i, g in zip(idx, got, strict=True) if g == IC.CLAIMED)
    q.put(won)


def test_forked_workers_racing_for_the_same_keys_claim_each_exactly_once() -> None:
    # (6,000 keys over 65,536 buckets of six: a bucket with seven, whose last key no racer
    # could claim, has a chance of about 1e-6 a run; 20,000 made it 1 in 400, seen once)
    table = IC.ClaimTable.create(f"/narad-test-idem-{os.getpid()}-race", buckets=1 << 16)
    keys = _keys(6000)
    ctx = multiprocessing.get_context("fork")
    q: multiprocessing.Queue = ctx.Queue()
    go = ctx.Barrier(3)
    procs = [ctx.Process(target=_racer, args=(table.name, keys, s, s + 1, q, go)) for s in range(3)]
    for p in procs:
        p.start()
    wins = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert table.stats(NOW)["refused_full"] == 0
    table.close(unlink=True)
    claimed = [i for w in wins for i in w]
    assert sorted(claimed) == list(range(6000))  # every key once, by exactly one of them
    assert all(wins)  # (each won some: they did race)


def test_a_lock_left_by_a_dead_holder_is_taken_over(table: IC.ClaimTable) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    ks = table.prepare(["k1"])
    word = table.lock_word(ks.fp[0] & (table.buckets - 1))
    word[0] = dead.pid  # a holder killed inside the lock
    assert table.claim(T1, ks, 0, NOW, WINDOW, 1)[0] == [IC.CLAIMED]
    assert word[0] == 0 and table.stats(NOW)["locks_taken_over"] == 1
    word.release()


def test_a_lock_holders_mark_is_its_own_thread_id_also_after_a_fork() -> None:
    """The lock word holds the holder's thread id (so a dead holder can be found); it is
    read once a thread, and a forked child must not keep its parent's."""
    from narad._native import lib

    assert lib.idem_holder_mark() == threading.get_native_id()
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(lib.idem_holder_mark() - threading.get_native_id()))
    t.start()
    t.join(timeout=30)
    assert seen == [0]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its mark must be its own pid (its only thread)
        ok = lib.idem_holder_mark() == os.getpid()
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"1"
    assert lib.idem_holder_mark() == threading.get_native_id()


def test_a_fresh_interpreter_with_another_hash_seed_agrees_on_every_key(table: IC.ClaimTable) -> None:
    """A replacement fork server is a fresh interpreter: its workers' fingerprints must be
    the ones the older workers compute (they come from the table's seed, not ``hash``)."""
    keys = _keys(50)
    code = ("import sys; from narad.broker import idem_claims as IC\n"
            "t = IC.ClaimTable.attach(sys.argv[1])\n"
            "ks = t.prepare(sys.argv[2].split(','))\n"
            "got, _ = t.claim(int(sys.argv[3]), ks, 0, int(sys.argv[4]), 1000, 77)\n"
            "sys.exit(0 if got == [IC.CLAIMED] * ks.count else 3)\n")
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    r = subprocess.run([sys.executable, "-c", code, table.name, ",".join(keys), str(T1), str(NOW)],
                       env={**os.environ, "PYTHONHASHSEED": seed}, timeout=60)
    assert r.returncode == 0
    assert table.claim(T1, table.prepare(keys), 0, NOW, WINDOW, 5)[0] == [IC.PENDING] * 50
    with pytest.raises(RuntimeError):  # (a region that is not a table of this layout)
        bogus = IC.ClaimTable.create(table.name + "-x", buckets=1)
        try:
            bogus._mm[0:8] = b"\0" * 8
            IC.ClaimTable.attach(bogus.name)
        finally:
            bogus.close(unlink=True)


def test_the_table_is_complete_once_every_worker_loaded_and_stays_so(table: IC.ClaimTable) -> None:
    assert table.all_loaded()  # (no workers set: a private table is complete at once)
    table.set_workers(3)
    assert not table.all_loaded() and not table.complete()
    assert table.set_loaded(0) is False and table.set_loaded(2) is False
    assert table.set_loaded(2) is False  # (twice is once)
    assert table.set_loaded(1) is True and table.all_loaded() and table.complete()
    other = IC.ClaimTable.attach(table.name)  # another process's view: the same head
    try:
        assert other.all_loaded()
    finally:
        other.close()


def test_prepare_claim_is_prepare_then_claim_and_settle_takes_one_mode_for_all(table: IC.ClaimTable) -> None:
    keys = _keys(5)
    ks, got, ev = table.prepare_claim(T1, keys, 3, NOW, WINDOW, 4)
    assert got == [IC.CLAIMED] * 5 and ev == 0
    same = table.prepare(keys)
    assert list(ks.fp) == list(same.fp) and list(ks.crc) == list(same.crc)
    assert table.settle(T1, ks, 4, NOW, WINDOW, IC.COMMIT) == 5
    assert table.prepare_claim(T1, keys, 3, NOW, WINDOW, 4)[1] == [IC.DUPLICATE] * 5
    assert [e[2] for e in table.collect(T1, 3, NOW)] == [NOW] * 5


def test_memory_per_key_is_measured() -> None:
    """The table's size is fixed at creation: 42.7 bytes a key (a 256-byte bucket of six
    slots), whatever the keys' lengths; the default (786,432 keys) is 32 MiB."""
    from narad._native import lib

    buckets = IC.buckets_for(786_432)
    size = lib.idem_size(buckets)
    assert buckets == 1 << 17 and size == IC.HEAD_BYTES + buckets * IC.BUCKET_BYTES
    per_key = size / (buckets * IC.WAYS)
    print(f"claims table: {size / 2**20:.1f} MiB for {buckets * IC.WAYS} keys, {per_key:.1f} bytes a key")
    assert 42.6 < per_key < 42.8
    t = IC.ClaimTable.private(buckets)
    try:
        assert t.stats(NOW)["capacity"] == 786_432 and len(t._mm) == size
    finally:
        t.close()


def test_two_buckets_a_key_fill_the_table_evenly() -> None:
    """Each key may live in either of two buckets (the one with fewer live slots takes a
    new key): the table holds half its capacity without dropping a key, where one bucket
    a key (Poisson-filled buckets of six) drops about 2 % of them at that load."""
    t = IC.ClaimTable.private(1 << 14)
    n = (1 << 14) * IC.WAYS // 2
    keys = _keys(n)
    ev = 0
    for lo in range(0, n, 1000):
        ks = t.prepare(keys[lo : lo + 1000])
        ev += t.load(T1, ks, [0] * ks.count, [NOW] * ks.count, WINDOW, NOW)
    assert ev == 0
    assert t.stats(NOW)["keys"] == n
    got, _ = t.claim(T1, t.prepare(keys), 0, NOW, WINDOW, 1)
    assert got == [IC.DUPLICATE] * n  # every key found, in whichever of its buckets
