"""Whose word a request's token budget rests on (pure but for `LearnedWindows`' file).

A model's context window comes from, in this order of trust:

1. **learned** — the provider said it: a refusal of a prompt as too long names its
   limit (`apis.api.TooLong`); the relay keeps it per upstream·model (`LearnedWindows`);
2. **configured** — `relay_context_windows`, the user's own table (model prefixes);
3. **known** — the API module's table of exact model ids (`apis.api.Windows`);

and nothing else: a model that none of them names has no window, and its requests are
trimmed only to a budget the user set (`relay_trim_max_tokens`). A family prefix is not
knowledge: the newest model of a known family is unknown until its provider says.

`LearnedWindows` is shared by every relay process on one timing log: an append-only file
of JSON lines beside it (`learned-windows.jsonl`), each process appending what it learns
in one write (O_APPEND) and reading what the others appended before it trims.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from ..apis.api import TooLong, Windows, model_id

logger = logging.getLogger(__name__)

FILE_NAME = "learned-windows.jsonl"
"""Beside the timing log: what the relay processes on that log learned."""

DEFAULT_RESERVE_TOKENS = 4096
"""Output tokens kept free when the request does not say how many it wants."""

LEARNED_MARGIN = 0.97
"""A learned limit is in the provider's tokens; the relay's count of a prompt is scaled to
them by the refusal's own ratio, and kept this far below the limit (the ratio moves a
little with the text)."""

MAX_LINE = 4096
"""A longer line in the file is not one the relay wrote: skipped."""

KNOWN, CONFIGURED, LEARNED, USER = "window", "configured", "learned", "user"
"""`Budget.source`: the known window, relay_context_windows, the provider's refusal, relay_trim_max_tokens."""


@dataclass(frozen=True, slots=True)
class Learned:
    """A window learned from a provider's refusal of one upstream·model."""

    upstream: str
    model: str
    max_input: int | None
    """Most prompt tokens, in the provider's tokens (Anthropic, Gemini)."""
    window: int | None
    """Most prompt and answer tokens together, in the provider's tokens (OpenAI)."""
    ratio: float
    """The provider's count of the refused prompt over the relay's (1.0: the provider gave none)."""
    ts: float


def learned_from(upstream: str, model: str | None, refusal: TooLong, counted: int | None) -> Learned | None:
    """What a refusal teaches (None if it names no limit). `counted`: the relay's count of the
    refused prompt, for the ratio between the provider's tokens and the relay's."""
    if not refusal.limit_given:
        return None
    ratio = 1.0
    if refusal.prompt_tokens and counted:
        ratio = refusal.prompt_tokens / counted
    return Learned(upstream, model_id(model), refusal.max_input, refusal.window, round(ratio, 4), round(time.time(), 3))


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
    input limit: learned, else configured, else known) and `user_max` (0 = none). None when
    neither applies: an unknown model and no user budget is never trimmed."""
    reserve = max_output or default_reserve
    candidates = []
    if learned is not None:
        if learned.max_input is not None:
            room = learned.max_input
        else:
            assert learned.window is not None
            room = learned.window - reserve
        tokens = math.floor(max(room, 0) / learned.ratio * LEARNED_MARGIN)
        candidates.append(Budget(tokens, LEARNED, learned.max_input or learned.window))
    elif (window := configured_window(configured or {}, model)) is not None:
        if window > 0:  # 0: the user says the model's window is unknown
            candidates.append(Budget(max(window - reserve, 0), CONFIGURED, window))
    elif windows is not None and (window := windows.window(model, long_context=long_context)) is not None:
        room = max(window - reserve, 0)
        if (max_input := windows.lookup(windows.max_input, model)) is not None:
            room = min(room, max_input)
        candidates.append(Budget(room, KNOWN, window))
    if user_max > 0:
        candidates.append(Budget(user_max, USER))
    return min(candidates, key=lambda b: b.tokens, default=None)


class LearnedWindows:
    """Windows learned from providers' refusals, by (upstream, model id), kept in `path`
    (None: in memory only) and shared with every process appending to it."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._by_key: dict[tuple[str, str], Learned] = {}
        self._read_to = 0
        self._inode: int | None = None

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, upstream: str, model: str | None) -> Learned | None:
        """The newest window learned for this upstream·model, by any process on the file."""
        self.refresh()
        return self._by_key.get((upstream, model_id(model)))

    def learn(self, learned: Learned) -> None:
        """Keep `learned`, and append it to the file for the other processes (one write)."""
        self._by_key[(learned.upstream, learned.model)] = learned
        if self.path is None:
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, orjson.dumps(asdict(learned)) + b"\n")
            finally:
                os.close(fd)
        except OSError as e:
            logger.warning("cannot keep the learned window in %s (%s): this process alone knows it", self.path, e)

    def refresh(self) -> None:
        """Read what was appended since the last read (a stat when nothing was)."""
        if self.path is None:
            return
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        except OSError as e:
            logger.debug("cannot stat %s: %s", self.path, e)
            return
        if st.st_ino != self._inode or st.st_size < self._read_to:  # replaced or truncated: read it anew
            self._inode, self._read_to = st.st_ino, 0
        if st.st_size == self._read_to:
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self._read_to)
                data = f.read(st.st_size - self._read_to)
        except OSError as e:
            logger.warning("cannot read the learned windows in %s: %s", self.path, e)
            return
        complete = data.rfind(b"\n") + 1  # a line being appended right now is read next time
        self._read_to += complete
        for line in data[:complete].splitlines():
            if learned := _parse(line):
                self._by_key[(learned.upstream, learned.model)] = learned


def _parse(line: bytes) -> Learned | None:
    if not line or len(line) > MAX_LINE:
        return None
    try:
        obj = orjson.loads(line)
        learned = Learned(**obj)
    except (orjson.JSONDecodeError, TypeError):
        return None
    ok = (
        isinstance(learned.upstream, str) and isinstance(learned.model, str)
        and all(v is None or (isinstance(v, int) and v > 0) for v in (learned.max_input, learned.window))
        and (learned.max_input is not None or learned.window is not None)
        and isinstance(learned.ratio, (int, float)) and 0.1 <= learned.ratio <= 10
    )  # fmt: skip
    return learned if ok else None
