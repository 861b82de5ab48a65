"""The cache of parsed tokenizers (`trim.rank_cache`): its format, its files, and that a
damaged or foreign entry never changes a count."""

import logging
import os
from pathlib import Path

import pytest
import tiktoken

from ttft_relay.trim import rank_cache, tokens
from ttft_relay.trim.rank_cache import RankCache

SAMPLE = ["hello world", "def f(x):\n    return x + 1\n", "函数返回错误配置", "  spaces\t\tand tabs  ", "émoji 🎉 " * 20]
ARGS = {"name": "tiny", "pat_str": r"\S+|\s+", "mergeable_ranks": {bytes([i]): i for i in range(256)},
        "special_tokens": {"<|end|>": 256}}


@pytest.mark.parametrize("environ, home, expected", [
    ({"CACHE_DIRECTORY": "/var/cache/ttft-relay", "XDG_CACHE_HOME": "/x"}, "/h", "/var/cache/ttft-relay"),
    ({"CACHE_DIRECTORY": "/var/cache/a:/var/cache/b"}, "/h", "/var/cache/a"),
    ({"XDG_CACHE_HOME": "/x", "HOME": "/h"}, None, "/x/ttft-relay"),
    ({"XDG_CACHE_HOME": "relative", "HOME": "/h"}, None, "/h/.cache/ttft-relay"),
    ({"HOME": "/var/lib/ttft-relay"}, None, "/var/lib/ttft-relay/.cache/ttft-relay"),
    ({}, "", None),
])
def test_cache_dir(environ, home, expected):
    assert rank_cache.cache_dir(environ, home) == (Path(expected) if expected else None)


def test_pack_unpack_round_trip_and_rejects_what_is_not_the_entry():
    key = ("tiktoken 0.14", ("/data", 10, 1, "ab"))
    data = rank_cache.pack(key, ARGS)
    assert rank_cache.unpack(data, key) == ARGS
    assert rank_cache.unpack(data, (*key[:-1], ("/data", 10, 2, "ab"))) is None  # the source changed
    assert rank_cache.unpack(data[:-1], key) is None  # truncated
    assert rank_cache.unpack(b"", key) is None
    flipped = bytearray(data)
    flipped[-5] ^= 1
    assert rank_cache.unpack(bytes(flipped), key) is None  # checksum
    assert rank_cache.unpack(b"x" + data[1:], key) is None  # another format


def test_unpack_rejects_a_well_formed_entry_of_the_wrong_shape():
    key = ("k",)
    assert rank_cache.unpack(rank_cache.pack(key, {**ARGS, "mergeable_ranks": []}), key) is None
    assert rank_cache.unpack(rank_cache.pack(key, {"name": "tiny"}), key) is None


def _source(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = tmp_path / "ranks.tiktoken"
    source.write_bytes(b"the ranks")
    return source


def test_a_miss_parses_and_stores_privately_and_a_hit_does_not_parse(tmp_path):
    source, parses = _source(tmp_path), []
    cache = RankCache(tmp_path / "cache")
    assert cache.load("tiny", (str(source),), lambda: parses.append(1) or ARGS) == ARGS
    entry = tmp_path / "cache" / "tiny.ranks"
    assert entry.stat().st_mode & 0o777 == 0o600 and (tmp_path / "cache").stat().st_mode & 0o777 == 0o700
    assert RankCache(tmp_path / "cache").load("tiny", (str(source),), lambda: pytest.fail("parsed")) == ARGS
    assert parses == [1] and cache.notes == []
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["tiny.ranks"]  # no temporary file left


def test_a_changed_source_is_parsed_again(tmp_path):
    source = _source(tmp_path)
    RankCache(tmp_path).load("tiny", (str(source),), lambda: ARGS)
    source.write_bytes(b"other ranks")
    changed = {**ARGS, "name": "changed"}
    assert RankCache(tmp_path).load("tiny", (str(source),), lambda: changed) == changed


def test_another_checkout_of_the_same_sources_reads_the_same_entry(tmp_path):
    # Keyed by path and mtime, two checkouts (worktrees, a second relay) replaced each
    # other's entry, and each start after the other's parsed again.
    first, other = _source(tmp_path / "a"), _source(tmp_path / "b")
    os.utime(other, (1, 1))
    RankCache(tmp_path / "cache").load("tiny", (str(first),), lambda: ARGS)
    assert RankCache(tmp_path / "cache").load("tiny", (str(other),), lambda: pytest.fail("parsed")) == ARGS


def test_an_entry_of_another_user_or_writable_by_others_is_ignored(tmp_path, monkeypatch):
    source = _source(tmp_path)
    RankCache(tmp_path).load("tiny", (str(source),), lambda: ARGS)
    entry = tmp_path / "tiny.ranks"
    entry.chmod(0o620)
    cache = RankCache(tmp_path)
    assert cache.load("tiny", (str(source),), lambda: {**ARGS, "name": "parsed"})["name"] == "parsed"
    assert "not a private file" in cache.notes[0] and entry.stat().st_mode & 0o777 == 0o600  # rewritten
    owner = entry.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    assert RankCache(tmp_path).load("tiny", (str(source),), lambda: {**ARGS, "name": "again"})["name"] == "again"


def test_no_place_to_write_means_no_cache_and_one_note(tmp_path):
    source = _source(tmp_path)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    cache = RankCache(not_a_dir / "cache")  # cannot be created, whoever runs the test
    assert cache.load("tiny", (str(source),), lambda: ARGS) == ARGS
    [note] = cache.notes
    assert "cannot write" in note and "no cache" in note
    missing = RankCache(tmp_path)
    assert missing.load("tiny", (str(tmp_path / "gone"),), lambda: ARGS) == ARGS and "cannot read" in missing.notes[0]


def _counts(loader: tokens.TokenizerLoader) -> dict[str, list[int]]:
    loader.load()
    return {name: [len(loader.get(name).encoding.encode_ordinary(t)) for t in SAMPLE] for name in (tokens.O200K, tokens.CL100K)}


def test_damaged_entries_never_change_a_count(tmp_path):
    """The real encodings: counts read through a fresh, a cached and a damaged cache equal
    the uncached encoder's."""
    uncached = _counts(tokens.TokenizerLoader(rank_cache=RankCache(None)))
    assert uncached[tokens.O200K] != uncached[tokens.CL100K]  # the sample tells the two apart
    assert uncached[tokens.O200K] == [len(tiktoken.Encoding(**tokens.o200k_args(tokens.bundled_o200k_file()))
                                          .encode_ordinary(t)) for t in SAMPLE]
    assert _counts(tokens.TokenizerLoader(rank_cache=RankCache(tmp_path))) == uncached  # written
    entries = sorted(tmp_path.glob("*.ranks"))
    assert [p.name for p in entries] == ["cl100k_base.ranks", "o200k_base.ranks"]
    assert _counts(tokens.TokenizerLoader(rank_cache=RankCache(tmp_path))) == uncached  # read
    o200k, cl100k = (p.read_bytes() for p in entries[::-1])
    for damaged in (o200k[: len(o200k) // 2], o200k[:-1] + bytes([o200k[-1] ^ 1]), cl100k, b"garbage"):
        entries[1].write_bytes(damaged)  # o200k_base's entry: half of it, a flipped bit, cl100k's, junk
        cache = RankCache(tmp_path)
        assert _counts(tokens.TokenizerLoader(rank_cache=cache)) == uncached
        assert any("stale or damaged" in note for note in cache.notes)
        assert entries[1].read_bytes() == o200k  # rewritten


def test_a_loader_without_a_writable_cache_loads_and_says_why_at_debug_level(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger=tokens.__name__)
    (tmp_path / "file").write_bytes(b"")
    loader = tokens.TokenizerLoader(rank_cache=RankCache(tmp_path / "file" / "cache"))
    loader.load()
    loader.say()
    assert loader.get(tokens.O200K).label == tokens.O200K and loader.ready
    notes = [(r.levelno, r.getMessage()) for r in caplog.records if "tokenizer cache" in r.getMessage()]
    assert [level for level, _ in notes] == [logging.DEBUG, logging.DEBUG]  # one per encoding
    assert all("cannot write" in line for _, line in notes)
