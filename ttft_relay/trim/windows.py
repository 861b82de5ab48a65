"""Whose word a request's token budget rests on (pure but for `LearnedWindows`' file).

A model's context window comes from, in this order of trust:

1. **configured** — `relay_context_windows`, the operator's own table (model prefixes): the
   operator's word wins over anything a refusal says;
2. **learned** — the provider said it: a refusal of a prompt as too long names its limit
   (`apis.api.TooLong`); the relay keeps it per upstream·model (`LearnedWindows`), once
   `judge_refusal` found the refusal to be the provider's word about that request;
3. **known** — the API module's table of exact model ids (`apis.api.Windows`);

and nothing else: a model that none of them names has no window, and its requests are
trimmed only to a budget the user set (`relay_trim_max_tokens`). A family prefix is not
knowledge: the newest model of a known family is unknown until its provider says.

What a refusal may teach is guarded, since every client of a relay shares it
(`judge_refusal`, pure): the provider's structured error says "too long" (its API module's
`too_long`: the error's code/type and the provider's own sentence, never text quoted from
the request); the limit lies within LIMIT_BOUNDS and not below the smallest window the
API's table gives the model's family; the refused request was longer than that limit by the
provider's count and by the relay's (their ratio within RATIO_BOUNDS); the model is keyed
exactly as the request named it; and an operator's `relay_context_windows` entry for the
model stands. A learned window is used for the requests of the access key whose request was
refused at once, and for other keys' once it is confirmed: by another key's refusal naming
the same limit, or by an accepted request the window before it would have cut
(`judge_accepted`); an accepted request longer than an unconfirmed window refutes it. Every
refusal that teaches nothing is logged in one line (no key) and ignored.

`LearnedWindows` keeps them in the relay's store (`ttft_relay.store`, the file beside the
timing log that every relay process on it shares): one entry per upstream·model's confirmed
window and per key's unconfirmed one (kind "window"), with when it was learned, from which
refusal (its status and error) and the access key's digest; at most MAX_ENTRIES, the least
recently used unconfirmed ones evicted first. The file is only touched off the event loop
(the trim worker thread): on the loop the relay reads the view in memory. The previous
version's `learned-windows.jsonl` is read into the store once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import orjson

from .. import store
from ..apis.api import TooLong, Windows, model_id

logger = logging.getLogger(__name__)

KIND_NAME = "window"
"""The windows' kind in the store (`ttft_relay.store`)."""
LEGACY_FILE = "learned-windows.jsonl"
"""Where the previous version kept them, beside the timing log: read once into the store."""

DEFAULT_RESERVE_TOKENS = 4096
"""Output tokens kept free when the request does not say how many it wants."""

LEARNED_MARGIN = 0.97
"""A learned limit is in the provider's tokens; the relay's count of a prompt is scaled to
them by the refusal's own ratio, and kept this far below the limit (the ratio moves a
little with the text)."""

LIMIT_BOUNDS = (4_096, 10_000_000)
"""The least and most tokens a limit learned from a refusal may name: no model in use
takes fewer, none of any API takes more."""
RATIO_BOUNDS = (0.5, 2.0)
"""The provider's count of a prompt over the relay's: tokenizers differ by some tens of
percent, not by factors."""
REFUTE_MARGIN = 1.05
"""An accepted request this much longer than an unconfirmed window (in the provider's
tokens, by the window's ratio) shows the window wrong."""

MAX_MODEL = 256
"""A model named longer is not kept (no provider's is)."""
MAX_ENTRIES = 256
"""Windows kept (upstream·model, and a key's unconfirmed one); beyond, the least recently used
unconfirmed go first, then the least recently used."""

KNOWN, CONFIGURED, LEARNED, USER = "window", "configured", "learned", "user"
"""`Budget.source`: the known window, relay_context_windows, the provider's refusal, relay_trim_max_tokens."""
ACCEPTED = "accepted"
"""`Learned.confirmed` when an accepted request confirmed the window (not another key's refusal)."""


@dataclass(frozen=True, slots=True)
class Learned:
    """A window learned from a provider's refusal of one upstream·model, with where it came from."""

    upstream: str
    model: str
    """The model exactly as the refused request named it."""
    max_input: int | None
    """Most prompt tokens, in the provider's tokens (Anthropic, Gemini)."""
    window: int | None
    """Most prompt and answer tokens together, in the provider's tokens (OpenAI)."""
    ratio: float
    """The provider's count of the refused prompt over the relay's (1.0: the provider gave none)."""
    ts: float
    """When it was learned."""
    status: int
    """The refusal's HTTP status."""
    error: str
    """The refusal's structured error: `error.code`, `.type` or `.status` (`TooLong.kind`)."""
    key: str
    """The digest of the access key whose request was refused (`flows.client_key`); "" for none."""
    confirmed: str | None = None
    """Who confirmed it: another key's digest (its refusal said the same), ACCEPTED (an accepted
    request the earlier window would have cut); None: used for `key`'s requests only."""
    confirmed_ts: float | None = None

    @property
    def limit(self) -> int:
        limit = self.max_input if self.max_input is not None else self.window
        assert limit is not None
        return limit

    def usable_by(self, key: str) -> bool:
        """Whether the requests of the access key with digest `key` are trimmed to it."""
        return self.confirmed is not None or key == self.key


def parse_context_windows(entries: Iterable[str]) -> dict[str, int]:
    """`["gpt-4o=128000", "my-model=32000"]` -> `{"gpt-4o": 128000, ...}`; ValueError if malformed."""
    table = {}
    for entry in entries:
        prefix, sep, tokens = entry.partition("=")
        prefix, tokens = prefix.strip(), tokens.strip()
        if not sep or not prefix or not tokens.isdigit():
            raise ValueError(f"expected 'model-prefix=tokens', got {entry!r}")
        table[prefix.lower()] = int(tokens)
    return table


def configured_window(table: Mapping[str, int], model: str | None) -> int | None:
    """The user's window for `model`: the longest prefix of `relay_context_windows` it starts
    with (0 there: unknown, the user's way to switch a known window off)."""
    name = model_id(model)
    best = max((p for p in table if name.startswith(p)), key=len, default=None)
    return None if best is None else table[best]


def family_floor(windows: Windows | None, model: str) -> int | None:
    """The smallest window the API's table gives a model of `model`'s family: the known ids
    that share with it its longest prefix ending before a "-" or "." that any known id has
    ("claude-opus-5-5" → the "claude-opus" ids; "gpt-5.5" → the "gpt-5" ids). None: no
    known id shares a prefix with it."""
    if windows is None or not windows.known:
        return None
    name = model_id(model)
    ends = [len(name), *(i for i in range(len(name) - 1, 0, -1) if name[i] in "-.")]
    for end in ends:
        stem = name[:end]
        family = [w for known, w in windows.known.items()
                  if known.startswith(stem) and (len(known) == end or known[end] in "-.")]
        if family:
            return min(family)
    return None


def judge_refusal(
    refusal: TooLong,
    *,
    upstream: str,
    model: str | None,
    status: int,
    counted: int | None,
    key: str,
    before: Sequence[Learned],
    windows: Windows | None,
    configured: Mapping[str, int],
    now: float,
) -> Learned | str:
    """What a refusal as too long teaches (the module docstring): the window to keep (a new
    one for `key`, or one of `before` confirmed by `key`; one of `before` itself: nothing
    new), or why it teaches nothing. `counted`: the relay's count of the refused prompt;
    `key`: the digest of the access key that sent it; `before`: what the relay holds for
    this upstream·model (`LearnedWindows.held`)."""
    if not refusal.limit_given:
        return "it names no limit"
    if not model:
        return "the request names no model"
    if len(model) > MAX_MODEL:
        return f"its model's name is longer than {MAX_MODEL} characters"
    if (operator := configured_window(configured, model)) is not None and operator > 0:
        return f"relay_context_windows sets {model}'s window ({operator}): the operator's word stands"
    limit = refusal.max_input if refusal.max_input is not None else refusal.window
    assert limit is not None
    if not LIMIT_BOUNDS[0] <= limit <= LIMIT_BOUNDS[1]:
        return f"its limit {limit} is outside {LIMIT_BOUNDS[0]}..{LIMIT_BOUNDS[1]} tokens"
    if (floor := family_floor(windows, model)) is not None and limit < floor:
        return f"its limit {limit} is below {floor}, the smallest window of {model}'s family"
    if not counted:
        return "the relay has no count of the refused request"
    output = (refusal.output_tokens or 0) if refusal.max_input is None else 0
    if refusal.prompt_tokens is not None:
        if refusal.prompt_tokens + output <= limit:
            return f"its own count ({refusal.prompt_tokens} + {output}) is not over its limit {limit}"
        ratio = refusal.prompt_tokens / counted
        if not RATIO_BOUNDS[0] <= ratio <= RATIO_BOUNDS[1]:
            return f"its count {refusal.prompt_tokens} is not the refused request's ({counted} by the relay's count)"
    else:
        ratio = 1.0
        if (counted + output) * RATIO_BOUNDS[1] <= limit:
            return f"the refused request ({counted} tokens by the relay's count) is far below its limit {limit}"
    learned = Learned(upstream, model, refusal.max_input, refusal.window, round(ratio, 4), round(now, 3),
                      status, refusal.kind, key)
    same = [held for held in before if (held.max_input, held.window) == (learned.max_input, learned.window)]
    for held in same:
        if held.confirmed is not None or held.key == key:
            return held  # nothing new: it stands confirmed, or the same key said it again
    if same:
        return replace(same[0], confirmed=key, confirmed_ts=round(now, 3))
    return learned


def judge_accepted(learned: Learned, sent: int, before: Budget | None, now: float) -> Learned | None | str:
    """What an accepted request of `sent` tokens (the relay's count) says of an unconfirmed
    window: refuted (None) when the provider took more than it allows, confirmed when the
    window the other keys go by (`before`, their budget; None: not the request of the key
    that learned it) would have cut the request; else nothing (a string saying so)."""
    if learned.confirmed is not None:
        return "already confirmed"
    if sent * learned.ratio > learned.limit * REFUTE_MARGIN:
        return None
    if before is not None and sent > before.tokens:
        return replace(learned, confirmed=ACCEPTED, confirmed_ts=round(now, 3))
    return "nothing to confirm"


@dataclass(frozen=True, slots=True)
class Budget:
    tokens: int
    """Most prompt tokens the request may carry, in the relay's count."""
    source: str
    """KNOWN, CONFIGURED, LEARNED or USER: whose word the budget rests on."""
    window: int | None = None
    """The window it was derived from (None for the user's budget)."""


def budget_for(
    model: str | None,
    max_output: int | None,
    *,
    windows: Windows | None,
    configured: Mapping[str, int] | None = None,
    learned: Learned | None = None,
    user_max: int = 0,
    default_reserve: int = DEFAULT_RESERVE_TOKENS,
    long_context: bool = False,
) -> Budget | None:
    """The smallest of the model's room (its window minus the reserved output, within its
    input limit: configured, else learned, else known) and `user_max` (0 = none). None when
    neither applies: an unknown model and no user budget is never trimmed."""
    reserve = max_output or default_reserve
    candidates = []
    configured_tokens = configured_window(configured or {}, model)
    if configured_tokens:
        candidates.append(Budget(max(configured_tokens - reserve, 0), CONFIGURED, configured_tokens))
    elif learned is not None:
        room = learned.max_input if learned.max_input is not None else learned.limit - reserve
        tokens = math.floor(max(room, 0) / learned.ratio * LEARNED_MARGIN)
        candidates.append(Budget(tokens, LEARNED, learned.limit))
    elif configured_tokens is None and windows is not None and (  # 0: the user says the window is unknown
            window := windows.window(model, long_context=long_context)) is not None:
        room = max(window - reserve, 0)
        if (max_input := windows.lookup(windows.max_input, model)) is not None:
            room = min(room, max_input)
        candidates.append(Budget(room, KNOWN, window))
    if user_max > 0:
        candidates.append(Budget(user_max, USER))
    return min(candidates, key=lambda b: b.tokens, default=None)


Slot = tuple[str, str, str | None]
"""Where the store keeps a window: (upstream, model, None) the confirmed one, which every key
uses; (upstream, model, key digest) the one a key's refusal taught, for that key alone."""


def _slot(learned: Learned) -> Slot:
    return learned.upstream, learned.model, None if learned.confirmed is not None else learned.key


def _entry(learned: Learned) -> store.Entry:
    """A window as the store keeps it: keyed by its slot, learned when and from whose refusal."""
    value = {"max_input": learned.max_input, "window": learned.window, "ratio": learned.ratio,
             "status": learned.status, "error": learned.error, "confirmed": learned.confirmed,
             "confirmed_ts": learned.confirmed_ts}
    return store.Entry(KIND_NAME, orjson.dumps(_slot(learned)).decode(), value, learned.ts, learned.key,
                       f"{learned.status} {learned.error}")


def _learned(entry: store.Entry) -> Learned | None:
    """The window an entry of the store holds, or None if it is not one the relay could have learned."""
    try:
        upstream, model, _ = orjson.loads(entry.key)
        learned = Learned(upstream=upstream, model=model, ts=entry.ts, key=entry.by, **entry.value)
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return None
    return learned if _valid(learned) and _slot(learned) == tuple(orjson.loads(entry.key)) else None


def _valid(learned: Learned) -> bool:
    return (
        isinstance(learned.upstream, str) and isinstance(learned.model, str) and len(learned.model) <= MAX_MODEL
        and all(v is None or (isinstance(v, int) and LIMIT_BOUNDS[0] <= v <= LIMIT_BOUNDS[1])
                for v in (learned.max_input, learned.window))
        and (learned.max_input is None) != (learned.window is None)
        and isinstance(learned.ratio, (int, float)) and RATIO_BOUNDS[0] <= learned.ratio <= RATIO_BOUNDS[1]
        and isinstance(learned.status, int) and isinstance(learned.error, str)
        and (learned.confirmed is None or isinstance(learned.confirmed, str))
    )  # fmt: skip


def _legacy(directory: Path) -> list[store.Entry]:
    """The windows the previous version kept in `learned-windows.jsonl` (its lines as it wrote them)."""
    path = directory / LEGACY_FILE
    if not path.exists():
        return []
    with open(path, "rb") as f:
        data = f.read(MAX_ENTRIES * 1024)
    found = []
    for line in data.split(b"\n"):
        try:
            learned = Learned(**orjson.loads(line)) if line else None
        except (orjson.JSONDecodeError, TypeError):
            continue
        if learned is not None and _valid(learned):
            found.append(_entry(learned))
    return found


KIND = store.Kind(KIND_NAME, MAX_ENTRIES, valid=lambda entry: _learned(entry) is not None,
                  rank=lambda entry: entry.value.get("confirmed") is not None, legacy=_legacy)
"""Windows in the store: the unconfirmed ones evicted first, a confirmed one only for another confirmed one."""


class LearnedWindows:
    """Windows learned from providers' refusals, kept in the store (`shared`: the trim addon's,
    or a file of its own, or None: in memory only) and shared with every process on it: per
    upstream·model the confirmed window, and each access key's unconfirmed one (a key's
    unconfirmed window never displaces the confirmed one for the others). `get` and `held`
    read memory only; `refresh`, `keep` and `forget` touch the file and block: call them off
    the event loop."""

    def __init__(self, shared: store.SharedStore | Path | None = None) -> None:
        self.shared = shared if isinstance(shared, store.SharedStore) else store.SharedStore(shared, [KIND])
        self._generation = -1
        self._by_slot: dict[Slot, Learned] = {}
        self._by_model: dict[tuple[str, str], list[Learned]] = {}

    def __len__(self) -> int:
        return len(self._view())

    def _view(self) -> dict[Slot, Learned]:
        """The store's windows by slot (read again only when the store changed)."""
        entries = self.shared.entries
        if self._generation != entries.generation(KIND_NAME):
            generation = entries.generation(KIND_NAME)
            by_slot = {}
            for entry in entries.entries(KIND_NAME):
                if (learned := _learned(entry)) is not None:
                    by_slot[_slot(learned)] = learned
            by_model: dict[tuple[str, str], list[Learned]] = {}
            for learned in by_slot.values():
                by_model.setdefault((learned.upstream, learned.model), []).append(learned)
            self._by_slot, self._by_model, self._generation = by_slot, by_model, generation
        return self._by_slot

    def entries(self) -> list[Learned]:
        return list(self._view().values())

    def held(self, upstream: str, model: str | None) -> list[Learned]:
        """What the relay holds for this upstream·model (the exact name): the confirmed window
        and each key's unconfirmed one."""
        self._view()
        return self._by_model.get((upstream, model or ""), [])

    def get(self, upstream: str, model: str | None, key: str) -> Learned | None:
        """The window the access key `key` uses for this upstream·model: its own unconfirmed
        one, else the confirmed one (counted as used)."""
        name = model or ""
        view = self._view()
        learned = view.get((upstream, name, key)) or view.get((upstream, name, None))
        if learned is not None:
            self.shared.entries.get(KIND_NAME, orjson.dumps(_slot(learned)).decode())
        return learned

    def refresh(self) -> None:
        """Read the store again if another process changed it (a stat when none did)."""
        self.shared.refresh()

    def keep(self, learned: Learned) -> None:
        """Keep `learned` in its slot, here and in the file; a window confirmed leaves its key's slot."""
        if learned.confirmed is not None:
            self.shared.entries.remove(KIND_NAME, orjson.dumps((learned.upstream, learned.model, learned.key)).decode())
        self.shared.entries.put(_entry(learned))
        self.shared.sync()

    def forget(self, learned: Learned) -> None:
        self.shared.entries.remove(KIND_NAME, orjson.dumps(_slot(learned)).decode())
        self.shared.sync()


def learned_in(path: Path) -> list[Learned]:
    """The windows the store at `path` holds, read only (the report, the metrics)."""
    learned = LearnedWindows(store.SharedStore(path, [KIND], read_only=True))
    learned.refresh()
    return learned.entries()
