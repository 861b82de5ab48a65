"""relay.py's addon order: each rule its docstring states, read from there and checked on the real
list the relay loads (`relay.addons`), so that the rules and the list cannot drift apart."""

from __future__ import annotations

import re

import pytest

from ttft_relay import relay

ORDER = [type(addon) for addon in relay.addons]

RULE = re.compile(r"(?P<left>.+?) (?P<relation>first|last|right after|before)(?: (?P<right>.+?))?: (?P<why>.+)")


def rules(doc: str) -> list[tuple[str, str, str, str]]:
    """(addons, relation, other addons, why) for each rule of the docstring: a line indented by four
    spaces starts one, lines indented further go on with it."""
    found: list[str] = []
    for line in doc.splitlines():
        if line.startswith("        ") and found:
            found[-1] += " " + line.strip()
        elif line.startswith("    ") and line.strip():
            found.append(line.strip())
    parsed = []
    for text in found:
        match = RULE.fullmatch(text)
        assert match, f"relay.py states a rule this test cannot read: {text}"
        parsed.append((match["left"], match["relation"], match["right"] or "", match["why"]))
    return parsed


def addon_types(names: str) -> list[type]:
    """`module.Class` names as relay.py imports them (`a, b and c`), each an addon of its list."""
    found = []
    for name in re.split(r", | and ", names):
        module, _, cls = name.partition(".")
        addon_type = getattr(getattr(relay, module), cls)
        assert addon_type in ORDER, f"relay.py's rules name {name}, which its list does not hold"
        found.append(addon_type)
    return found


RULES = rules(relay.__doc__ or "")


def test_the_rules_are_read():
    assert len(RULES) >= 15  # relay.py states them; fewer read means this test lost some
    assert {relation for _, relation, _, _ in RULES} == {"first", "last", "right after", "before"}


@pytest.mark.parametrize("left, relation, right, why", RULES, ids=[f"{a} {r} {b}".strip() for a, r, b, _ in RULES])
def test_each_rule_holds_on_the_real_list(left, relation, right, why):
    for addon in addon_types(left):
        at = ORDER.index(addon)
        if relation == "first":
            assert at == 0, why
        elif relation == "last":
            assert at == len(ORDER) - 1, why
        elif relation == "right after":
            (previous,) = addon_types(right)
            assert at == ORDER.index(previous) + 1, why
        else:
            for later in addon_types(right):
                assert at < ORDER.index(later), why


def test_each_addon_comes_once():
    assert len(set(ORDER)) == len(ORDER)


def test_the_list_is_the_whole_list():
    # No addon brings addons of its own: each is on relay.py's list (guard.Guard hid ten).
    assert [type(addon).__name__ for addon in relay.addons if getattr(addon, "addons", None)] == []
