"""plans.KeptPlans: conversations' cuts kept in a file, so that after a restart and on
another worker the same conversation is cut at the same place (its prompt-cache prefix
kept), and the file bounded."""

from __future__ import annotations

import dataclasses

import orjson

from ttft_relay import apis, store
from ttft_relay.testing import shaped
from ttft_relay.trim import plans, policy
from ttft_relay.trim.windows import Budget

from tests.test_trimming import FakeCounter

BUDGET = Budget(40_000, "user")


def trim(body: dict, api: str, kept: policy.PlanCache) -> policy.TrimResult:
    """As the addon's worker does: the others' plans read, the trim, this one's plan kept."""
    if isinstance(kept, plans.KeptPlans):
        kept.refresh()
    result = policy.trim(body, apis.get(api), BUDGET, FakeCounter(), plans=kept)
    if isinstance(kept, plans.KeptPlans):
        kept.save()
    return result


def first_after_restart(api: str, restarted: policy.PlanCache, kept: policy.PlanCache) -> tuple[dict, float]:
    """A session trimmed with `kept` until some of its requests kept their cut, then (the
    relay restarted) its next request with `restarted`: that one's stats and prefix share."""
    requests = list(shaped.Session(api, turns=30).requests())
    previous, kept_plans = None, 0
    while kept_plans < 3:
        body = requests.pop(0)
        result = trim(body, api, kept)
        kept_plans += result.stats["plan"] == "kept"
        previous = result.body if result.body is not None else body
    after = trim(requests[0], api, restarted)
    return after.stats, shaped.prefix_share(api, previous, after.body if after.body is not None else requests[0])


def test_a_restarted_relay_cuts_the_conversation_where_it_was_cut(tmp_path):
    path = tmp_path / store.FILE_NAME
    for api in (shaped.ANTHROPIC, shaped.RESPONSES, shaped.CHAT):
        path.unlink(missing_ok=True)
        stats, share = first_after_restart(api, plans.KeptPlans(path), plans.KeptPlans(path))
        assert stats["plan"] == "kept" and share >= 0.9, (api, stats, share)
        # In memory only (as before): the restarted relay makes a cut of its own.
        stats, share = first_after_restart(api, policy.PlanCache(), policy.PlanCache())
        assert stats["plan"] == "new" and share < 0.5, (api, stats, share)


def test_workers_on_one_file_share_their_plans(tmp_path):
    path = tmp_path / store.FILE_NAME
    one, two = plans.KeptPlans(path), plans.KeptPlans(path)
    requests = [b for b in shaped.Session(shaped.CHAT, turns=30).requests()]
    results = [trim(body, shaped.CHAT, one if i % 2 else two) for i, body in enumerate(requests)]
    trimmed = [r for r in results if r.stats["trimmed"]]
    # A new cut on one worker is the cut of the next request on the other.
    assert sum(r.stats["plan"] == "new" for r in trimmed) < 0.2 * len(trimmed)


def test_the_store_stays_bounded_and_keeps_the_plans_used_last(tmp_path):
    path = tmp_path / store.FILE_NAME
    kept = plans.KeptPlans(path, maxsize=50)
    for n in range(2_000):
        kept.put(n.to_bytes(16, "big"), policy.Plan(((0, n),) if n else (), n + 1, b"\x01" * 16))
        if n % 10 == 9:
            kept.get((0).to_bytes(16, "big"))  # a conversation still going on
            kept.save()
    assert len(path.read_bytes().splitlines()) == 50
    fresh = plans.KeptPlans(path, maxsize=50)
    fresh.refresh()
    assert fresh.get((1999).to_bytes(16, "big")) == policy.Plan(((0, 1999),), 2000, b"\x01" * 16)
    assert fresh.get((0).to_bytes(16, "big")) == policy.Plan((), 1, b"\x01" * 16)
    assert len(fresh) == 50


def test_entries_it_did_not_write_are_skipped(tmp_path):
    path = tmp_path / store.FILE_NAME
    good = store.Entry("plan", "00" * 16, [1, 2, "ab" * 16, 0], 1.0)
    bad = [dataclasses.replace(good, value=value) for value in ([1, -2, "ab", 0], [True, 2, "ab", 0], [1, 2, "zz", 0],
                                                                   [1, 2, "ab"], {"cut": 1})]
    # Shrunk ranges that are not ascending and apart, or too many of them.
    bad += [dataclasses.replace(good, value=[spans, 2, "ab" * 16, 0]) for spans in (
        [[3, 3]], [[4, 2]], [[0, 4], [3, 6]], [[0, True]], [[0, 1, 2]], [[i, i + 1] for i in range(0, 66, 2)])]
    # Dropped ranges likewise (none: not stored), and no sixth field.
    bad += [dataclasses.replace(good, value=[[[0, 1]], 2, "ab" * 16, 0, dropped]) for dropped in (
        [], [[4, 2]], [[0, 4], [3, 6]], 3, [[i, i + 1] for i in range(0, 66, 2)])]
    bad.append(dataclasses.replace(good, value=[[[0, 1]], 2, "ab" * 16, 0, [[3, 4]], 0]))
    bad.append(dataclasses.replace(good, key="zz"))
    path.write_bytes(b"".join(e.encode() + b"\n" for e in [*bad, good]) + b"not json\n" + b"x" * 10_000 + b"\n")
    kept = plans.KeptPlans(path)
    kept.refresh()
    assert len(kept) == 1 and kept.get(bytes(16)) == policy.Plan(((0, 1),), 2, bytes.fromhex("ab" * 16), 0)


def test_the_previous_versions_file_is_read_once(tmp_path):
    old = {"key": "00" * 16, "shrunk": 1, "cut": 2, "anchor": "ab" * 16, "rounds_to": 0}
    lines = [old, {**old, "cut": 3}, {**old, "cut": -1}, {**old, "key": "11" * 16}]
    (tmp_path / plans.LEGACY_FILE).write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines) + b"torn")
    kept = plans.KeptPlans(tmp_path / store.FILE_NAME)
    kept.refresh()
    assert len(kept) == 2 and kept.get(bytes(16)) == policy.Plan(((0, 1),), 3, bytes.fromhex("ab" * 16), 0)


def test_a_plan_of_shrunk_ranges_is_kept_as_it_was_made(tmp_path):
    # Newest first (relay_trim_shrink_order=newest) a plan shrinks ranges of items, not all
    # before one, and drops ranges from the middle; a plan that drops none is stored as before.
    shrunk_only = policy.Plan(((3, 9), (14, 20)), 2, b"\x02" * 16)
    middle = policy.Plan(((3, 20),), 2, b"\x03" * 16, 0, ((5, 9), (12, 20)))
    kept = plans.KeptPlans(tmp_path / store.FILE_NAME)
    kept.put(bytes(16), shrunk_only)
    kept.put(b"\x01" * 16, middle)
    kept.save()
    assert len(plans._value(shrunk_only)) == 4
    fresh = plans.KeptPlans(tmp_path / store.FILE_NAME)
    fresh.refresh()
    assert fresh.get(bytes(16)) == shrunk_only and fresh.get(b"\x01" * 16) == middle
