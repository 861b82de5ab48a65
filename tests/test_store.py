"""store: one store for what the relay learns — entries keyed by kind and key, one current
entry per key, each kind bounded (least recently used out first), a compact file rewritten
whole and shared by every process on it, the previous version's files read once."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import orjson

from ttft_relay import store
from ttft_relay.store import Entries, Entry, Kind, SharedStore

WINDOW = Kind("window", 4)
PLAN = Kind("plan", 3)


def entry(kind: Kind, key: str, value: object = 1, ts: float = 1.0, by: str = "", reply: str = "") -> Entry:
    return Entry(kind.name, key, value, ts, by, reply)


def test_one_current_entry_per_key_and_the_newest_wins():
    held = Entries([WINDOW])
    held.put(entry(WINDOW, "a", 1))
    held.put(entry(WINDOW, "a", 2, ts=2.0, by="k1", reply="400 invalid_request_error"))
    assert [e.value for e in held.entries("window")] == [2]
    assert held.get("window", "a") == Entry("window", "a", 2, 2.0, "k1", "400 invalid_request_error")
    assert len(held) == 1


def test_each_kind_is_bounded_least_recently_used_out_first():
    held = Entries([WINDOW, PLAN])
    for key in "abc":
        held.put(entry(PLAN, key))
    held.get("plan", "a")  # used: b is now the least recently used
    held.put(entry(PLAN, "d"))
    assert [e.key for e in held.entries("plan")] == ["c", "a", "d"]
    held.put(entry(WINDOW, "w"))  # another kind's bound is its own
    assert len(held.entries("plan")) == 3 and len(held.entries("window")) == 1


def test_a_lower_rank_goes_first_however_recently_used():
    proven = Kind("window", 2, rank=lambda e: 1 if e.value == "confirmed" else 0)
    held = Entries([proven])
    held.put(entry(proven, "old", "confirmed"))
    held.put(entry(proven, "a", "unconfirmed"))
    held.put(entry(proven, "b", "unconfirmed"))
    assert [e.key for e in held.entries("window")] == ["old", "b"]


def test_the_file_round_trips_compactly_and_keeps_other_owners_lines():
    mine = Entries([WINDOW])
    mine.put(entry(WINDOW, "a", {"limit": 4096}, ts=5.5, by="ab12", reply="400 x"))
    other = Entries([PLAN])
    other.put(entry(PLAN, "p", [1, 2, "ff", 0]))
    data = other.dump()
    mine.load(data)
    both = mine.dump()
    assert both.count(b"\n") == 2
    assert orjson.loads(both.splitlines()[1]) == ["window", "a", 5.5, "ab12", "400 x", {"limit": 4096}]
    again = Entries([PLAN])
    assert again.load(both) == {("plan", "p")}
    assert again.get("plan", "p") == entry(PLAN, "p", [1, 2, "ff", 0])


def test_lines_it_did_not_write_are_dropped():
    checked = Kind("window", 8, valid=lambda e: isinstance(e.value, int))
    held = Entries([checked])
    data = b"\n".join([
        b"not json", b'["window"', b'["window","a",1,"","",1]', b'["window","b",1,"","","x"]',
        b'["window","c","ts","","",1]', b'["window","d",1,"",""]', b'["window","e",true,"","",1]',
        b'["window","f",1,"","",' + b"1" * store.MAX_LINE + b"]", b'{"window": 1}',
    ])
    held.load(data)
    assert [e.key for e in held.entries("window")] == ["a"]


def test_a_load_keeps_the_changes_not_yet_written_and_says_what_changed():
    held = Entries([WINDOW])
    held.load(entry(WINDOW, "a", 1).encode() + b"\n" + entry(WINDOW, "b", 1).encode() + b"\n")
    held.put(entry(WINDOW, "c", 3))
    held.remove("window", "a")
    changed = held.load(entry(WINDOW, "a", 1).encode() + b"\n" + entry(WINDOW, "b", 2).encode() + b"\n")
    assert changed == {("window", "b")}
    assert {e.key: e.value for e in held.entries("window")} == {"b": 2, "c": 3}
    assert held.dump().count(b"\n") == 2
    held.written()
    assert not held.pending
    held.load(entry(WINDOW, "b", 2).encode() + b"\n")  # what the file says now: c went
    assert [e.key for e in held.entries("window")] == ["b"]


def test_a_merging_kind_counts_both_words():
    def union(theirs: Entry, mine: Entry) -> Entry:
        return Entry(mine.kind, mine.key, sorted(set(theirs.value) | set(mine.value)), max(theirs.ts, mine.ts))

    line = Kind("line", 4, merge=union)
    held = Entries([line])
    held.put(entry(line, "l", [1, 2], ts=2.0))
    held.load(entry(line, "l", [1, 3], ts=3.0).encode() + b"\n")
    assert held.get("line", "l") == entry(line, "l", [1, 2, 3], ts=3.0)


def test_a_change_made_while_the_file_was_written_stays_pending():
    held = Entries([WINDOW])
    held.put(entry(WINDOW, "a"))
    held.dump()
    held.put(entry(WINDOW, "b"))  # another thread, meanwhile
    held.written()
    assert held.pending
    assert {e.key for e in held.entries("window")} == {"a", "b"}


def test_workers_share_one_file_and_none_loses_anothers_word(tmp_path):
    path = tmp_path / store.FILE_NAME
    one, two = SharedStore(path, [WINDOW]), SharedStore(path, [WINDOW, PLAN])
    one.entries.put(entry(WINDOW, "a", 1))
    two.entries.put(entry(WINDOW, "b", 2))
    two.entries.put(entry(PLAN, "p", 3))
    assert one.sync() == set()
    assert two.sync() == {("window", "a")}
    assert one.refresh() == {("window", "b")}
    assert {e.key for e in one.entries.entries("window")} == {"a", "b"}
    restarted = SharedStore(path, [WINDOW, PLAN])
    restarted.refresh()
    assert restarted.entries.get("plan", "p") == entry(PLAN, "p", 3)
    assert len(restarted.entries) == 3
    lines = path.read_bytes().splitlines()
    assert len(lines) == 3 and not any(f.name.endswith(".tmp") for f in tmp_path.iterdir())
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_a_refresh_reads_only_a_changed_file(tmp_path, monkeypatch):
    path = tmp_path / store.FILE_NAME
    writer, reader = SharedStore(path, [WINDOW]), SharedStore(path, [WINDOW])
    writer.entries.put(entry(WINDOW, "a"))
    writer.sync()
    reader.refresh()
    decoded = []
    monkeypatch.setattr(store, "decode", lambda line: decoded.append(line))
    assert reader.refresh() == set()
    assert decoded == []


def test_concurrent_writers_keep_every_entry(tmp_path):
    path = tmp_path / store.FILE_NAME
    kind = Kind("window", 1000)
    stores = [SharedStore(path, [kind]) for _ in range(4)]

    def learn(i: int) -> None:
        for n in range(25):
            stores[i].entries.put(Entry("window", f"{i}-{n}", n, 1.0))
            stores[i].sync()

    threads = [threading.Thread(target=learn, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = SharedStore(path, [kind])
    final.refresh()
    assert len(final.entries.entries("window")) == 100


def test_the_previous_versions_file_is_read_once(tmp_path, caplog):
    old = tmp_path / "old.jsonl"
    old.write_text("1\n2\n")
    reads = []

    def legacy(directory):
        reads.append(directory)
        if (directory / "old.jsonl").exists():
            yield from (Entry("window", line, int(line), 1.0) for line in (directory / "old.jsonl").read_text().split())

    kind = Kind("window", 8, legacy=legacy)
    path = tmp_path / store.FILE_NAME
    with caplog.at_level(logging.INFO, logger="ttft_relay.store"):
        first = SharedStore(path, [kind])
        assert first.refresh() == {("window", "1"), ("window", "2")}
    assert "2 window entries read once from the previous version's file" in caplog.text
    assert path.exists()
    second = SharedStore(path, [kind])  # another worker, or a restart
    second.refresh()
    assert {e.key for e in second.entries.entries("window")} == {"1", "2"}
    assert reads == [tmp_path]
    second.entries.remove("window", "1")
    second.sync()
    third = SharedStore(path, [kind])
    third.refresh()
    assert {e.key for e in third.entries.entries("window")} == {"2"}  # not read again
    assert reads == [tmp_path]


def test_a_file_it_cannot_write_is_said_once_and_memory_keeps_it(tmp_path, caplog):
    blocked = tmp_path / "dir"
    blocked.write_text("a file where the directory should be")
    shared = SharedStore(blocked / store.FILE_NAME, [WINDOW])
    with caplog.at_level(logging.WARNING, logger="ttft_relay.store"):
        for n in range(3):
            shared.entries.put(entry(WINDOW, "a", n))
            shared.sync()
    assert caplog.text.count("this process alone knows it") == 1
    assert shared.entries.get("window", "a") == entry(WINDOW, "a", 2)


def test_of_a_huge_file_only_the_bound_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "MAX_FILE", 1000)
    path = tmp_path / store.FILE_NAME
    path.write_bytes(b"".join(entry(Kind("window", 1), f"k{i:04}").encode() + b"\n" for i in range(200)))
    shared = SharedStore(path, [Kind("window", 1000)])
    shared.refresh()
    assert 0 < len(shared.entries.entries("window")) < 50


def test_a_file_of_many_entries_is_bounded_as_fast_as_it_is_read():
    # Not quadratic: evicting as it reads (20,000 entries into a bound of 10) took seconds when
    # each eviction scanned what was held. Best of three each, so one pause of a loaded machine
    # does not decide it.
    data = b"".join(Entry("plan", f"{i:06}", i, 1.0).encode() + b"\n" for i in range(20_000))

    def best_of_three(make: Callable[[], Entries]) -> float:
        took = []
        for _ in range(3):
            held = make()
            started = time.perf_counter()
            held.load(data)
            took.append(time.perf_counter() - started)
        return min(took)

    baseline = best_of_three(lambda: Entries([Kind("plan", 20_000)]))  # read, nothing evicted
    assert best_of_three(lambda: Entries([Kind("plan", 10, rank=lambda e: e.value % 2)])) < 5 * baseline + 0.25
    bounded = Entries([Kind("plan", 10, rank=lambda e: e.value % 2)])
    bounded.load(data)
    assert [e.value for e in bounded.entries("plan")] == list(range(19_981, 20_000, 2))  # the odd ones ranked higher


def test_a_change_of_one_kind_leaves_the_others_views_current():
    held = Entries([WINDOW, PLAN])
    windows_seen = held.generation("window")
    held.put(entry(PLAN, "p"))
    held.load(entry(PLAN, "q").encode() + b"\n")
    assert held.generation("window") == windows_seen and held.generation("plan") > 0


def test_lines_of_a_kind_the_relay_does_not_keep_are_not_carried_along():
    held = Entries([WINDOW])
    held.load(b'["plan","p",1.0,"","",1]\n["junk","j",1.0,"","",1]\n')
    assert held.dump() == b'["plan","p",1.0,"","",1]\n'


def test_every_kind_the_relay_keeps_is_one_the_store_carries():
    from ttft_relay.observe import attempts, verdicts
    from ttft_relay.trim import plans, windows

    kinds = {windows.KIND.name, plans.KIND.name, verdicts.KIND.name, attempts.KIND.name, store.IMPORTED.name}
    assert {kind.encode() for kind in kinds} == store.RELAY_KINDS


def test_another_owners_change_leaves_what_is_held_as_it_is(tmp_path, monkeypatch):
    path = tmp_path / store.FILE_NAME
    plans_owner, lines_owner = SharedStore(path, [PLAN]), SharedStore(path, [Kind("first-token", 4)])
    plans_owner.entries.put(entry(PLAN, "p", [1]))
    plans_owner.sync()
    held = plans_owner.entries.get("plan", "p")
    decoded = []
    monkeypatch.setattr(store, "decode", lambda line: decoded.append(line))
    for n in range(3):
        lines_owner.entries.put(Entry("first-token", "l", n, 1.0))
        lines_owner.sync()
        assert plans_owner.refresh() == set()
    assert decoded == [] and plans_owner.entries.get("plan", "p") is held
    assert path.read_bytes().count(b"\n") == 2
