"""Prompt cache misses: a request that repeats its conversation's previous prefix, read uncached (pure).

Providers cache a prompt's prefix (OpenAI from 1024 tokens on, by itself; Anthropic where
the request marks it) and bill and prefill the cached part for a fraction. A coding agent's
next turn repeats the whole previous conversation and adds to it, so once the provider
has cached a conversation (its usage reported cached or cache-written tokens), the next
request of it should read that prefix from the cache. When the provider then reports no
cached tokens, the prefix was read again in full: a *prompt cache miss* (an expired
cache, a prefix the client changed, another region or deployment behind the same name).

A conversation is known by what a request repeats unchanged: the client, the model, the
request-level parts a provider caches before the messages (system, instructions, tools),
its first item and the ids some clients send (`prompt_cache_key`, `metadata.user_id`). A
request continues it when it has more items and the item at the previous request's last
position is that last item. Only digests are kept, never content (of each part, its
length and its ends: `EDGE`). A request that was
trimmed is left alone: the provider read the trimmed body, whose prefix is the relay's.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from ..apis.api import Api

CACHE_MIN_TOKENS = 1024
"""Prompts shorter than this are not cached by the providers (OpenAI, Anthropic's smallest)."""
CACHE_TTL_S = 300.0
"""A cache left idle this long may be gone by design (both providers' default lifetime): a
miss after it is not one to report."""
CONVERSATIONS = 4096
"""Conversations remembered at once, the least recently continued forgotten first."""


@dataclass(frozen=True, slots=True)
class Turn:
    """What a conversation's latest request left to compare the next one with."""

    items: int
    last: bytes
    """The digest of its last item."""
    cached: int
    """The tokens the provider reported read from its cache (or written to it)."""
    ts: float


EDGE = 2048
"""Of each part's JSON only its length and this many bytes at each end are hashed: a system
prompt and tools of tens of KB cost the hash more than the rest of the record (27 µs)."""


def _digest(*parts: Any) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = orjson.dumps(part, option=orjson.OPT_SORT_KEYS)
        h.update(b"%d\0" % len(data))
        h.update(data[:EDGE])
        h.update(data[-EDGE:])
    return h.digest()


def _items_and_key(api: Api, body: Any, client: str, model: str | None) -> tuple[list, bytes] | None:
    shape = api.trim_shape
    if shape is None or not isinstance(body, dict):
        return None
    items = shape.items(body)
    if not isinstance(items, list) or not items:
        return None
    metadata = body.get("metadata")
    ids = (body.get("prompt_cache_key"), metadata.get("user_id") if isinstance(metadata, dict) else None)
    try:
        key = _digest(client, model, [body.get(k) for k in shape.fixed_keys], items[0], ids)
    except TypeError:  # orjson: a value it cannot encode (an integer beyond 64 bits)
        return None
    return items, key


def conversation_key(api: Api, body: Any, client: str, model: str | None) -> bytes | None:
    """The digest a conversation is known by (every request of it has the same), or None for a
    body that is not one (no items in the API's trim shape)."""
    found = _items_and_key(api, body, client, model)
    return found[1] if found is not None else None


class Conversations:
    """The latest request of each conversation seen; says when a continuation missed the cache."""

    def __init__(self, limit: int = CONVERSATIONS) -> None:
        self.limit = limit
        self.known: OrderedDict[bytes, Turn] = OrderedDict()

    def step(self, api: Api, body: Any, *, client: str, model: str | None, usage: Mapping[str, Any] | None,
             ts: float) -> str | None:
        """Remember this request; if it continues a conversation the provider had cached and
        reports nothing cached itself, say so (a clause for the verdict's detail)."""
        found = _items_and_key(api, body, client, model)
        usage = usage or {}
        if found is None or not isinstance(usage.get("input_tokens"), int):
            return None
        items, key = found
        try:
            last = _digest(items[-1])
        except TypeError:
            return None
        before = self.known.pop(key, None)
        cached = sum(n for n in (usage.get("cached_tokens"), usage.get("cache_creation_tokens"))
                     if isinstance(n, int) and n > 0)
        self.known[key] = Turn(len(items), last, cached, ts)
        if len(self.known) > self.limit:
            self.known.popitem(last=False)
        if (before is None or not before.cached or len(items) <= before.items or usage.get("cached_tokens") != 0
                or usage["input_tokens"] < CACHE_MIN_TOKENS or ts - before.ts > CACHE_TTL_S):
            return None
        try:
            continues = _digest(items[before.items - 1]) == before.last
        except TypeError:
            return None
        if not continues:
            return None
        return f"this conversation's previous request, {ts - before.ts:.0f} s earlier, had {before.cached:,} tokens cached"
