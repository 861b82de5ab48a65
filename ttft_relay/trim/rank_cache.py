"""A cache of parsed tiktoken encodings, so a start reads them instead of parsing them.

Parsing o200k_base's rank file (200k base64 lines) takes ~0.18 s of a start; reading the
same ranks back with `marshal` ~0.03 s (pickle was no faster, rebuilding from one blob
slower). What is cached is the whole set of arguments of `tiktoken.Encoding` (name, split
pattern, ranks, special tokens); tiktoken's own build of its encoder from them (~0.2 s)
cannot be cached.

An entry is used only when it is certainly what a parse would give: it is keyed by the
contents of every file its arguments come from (size and SHA-256 of the data file and of
the code that defines the pattern) and the versions of tiktoken and marshal, and it
carries a SHA-256 of its own bytes. Not by their paths: two checkouts of the same code
(worktrees, a second relay) share the entry instead of replacing each other's at every
start, each start of one then parsing again. A corrupt, truncated, foreign-owned, group- or
world-writable or unreadable entry is ignored and rewritten (a temporary file renamed over
it, mode 0600). The cache never fails a load: a read-only or missing place means no cache.

`pack` and `unpack` are the format (bytes in, values out); `RankCache` the files.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import tiktoken

MAGIC = b"ttft-relay tiktoken ranks 1\n"
"""The first bytes of an entry (its format's version in the last digit)."""
_DIGEST = hashlib.sha256().digest_size
EncodingArgs = dict[str, Any]
"""The keyword arguments of `tiktoken.Encoding`: name, pat_str, mergeable_ranks, special_tokens."""
Key = tuple[Any, ...]
"""What an entry is stored under (`cache_key`): values `marshal` writes."""
_ARG_TYPES = {"name": str, "pat_str": str, "mergeable_ranks": dict, "special_tokens": dict}


def cache_dir(environ: Mapping[str, str], home: str | None = None) -> Path | None:
    """Where the relay keeps its cache: the systemd unit's CacheDirectory= ($CACHE_DIRECTORY),
    else $XDG_CACHE_HOME/ttft-relay, else ~/.cache/ttft-relay; None without any of them."""
    if systemd := environ.get("CACHE_DIRECTORY", "").split(":")[0]:
        return Path(systemd)
    xdg = environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):  # the XDG spec: a relative path is invalid and ignored
        return Path(xdg) / "ttft-relay"
    home = home if home is not None else environ.get("HOME", "")
    return Path(home) / ".cache" / "ttft-relay" if os.path.isabs(home) else None


def file_identity(path: str) -> tuple[int, str]:
    """(size, SHA-256 of the bytes) of `path`; OSError if unreadable."""
    with open(path, "rb") as f:
        data = f.read()
    return len(data), hashlib.sha256(data).hexdigest()


def cache_key(sources: tuple[str, ...]) -> Key:
    """What an entry built from the files `sources` must be stored under."""
    return (tiktoken.__version__, marshal.version, sys.version_info[:2], *(file_identity(p) for p in sources))


def pack(key: Key, args: EncodingArgs) -> bytes:
    """An entry: MAGIC, the SHA-256 of the body, the body (`key` and `args`, marshalled)."""
    body = marshal.dumps((key, args))
    return MAGIC + hashlib.sha256(body).digest() + body


def unpack(data: bytes, key: Key) -> EncodingArgs | None:
    """The arguments stored in `data` under `key`, or None if `data` is not such an entry
    (another format, a checksum that differs, another key, arguments of the wrong shape)."""
    if not data.startswith(MAGIC):
        return None
    digest, body = data[len(MAGIC):len(MAGIC) + _DIGEST], data[len(MAGIC) + _DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        return None
    try:
        stored = marshal.loads(body)
    except (EOFError, ValueError, TypeError):
        return None
    if not (isinstance(stored, tuple) and len(stored) == 2 and stored[0] == key and isinstance(stored[1], dict)):
        return None
    args = stored[1]
    if args.keys() != _ARG_TYPES.keys() or not all(isinstance(args[k], t) for k, t in _ARG_TYPES.items()):
        return None
    return args


class RankCache:
    """Entries of parsed encodings in `directory` (None: no cache), one file per encoding.

    `notes` collects why an entry was not read or written, for the loader to log at debug
    level once the relay's logging is set up."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.notes: list[str] = []

    def load(self, label: str, sources: tuple[str, ...], parse: Callable[[], EncodingArgs]) -> EncodingArgs:
        """The arguments `parse` gives, read from the entry for `sources` if it holds them,
        else parsed and stored. Exceptions of `parse` pass through; the cache's never do."""
        if self.directory is None:
            return parse()
        try:
            key = cache_key(sources)
        except OSError as e:
            self.notes.append(f"tokenizer cache: cannot read {e.filename}: {e.strerror}")
            return parse()
        path = self.directory / f"{label}.ranks"
        if (args := self._read(path, key)) is not None:
            return args
        args = parse()
        self._write(path, pack(key, args))
        return args

    def _read(self, path: Path, key: Key) -> EncodingArgs | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):  # no entry yet: `_write` says if it cannot make one
            return None
        except OSError as e:
            self.notes.append(f"tokenizer cache: cannot open {path}: {e.strerror}")
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                self.notes.append(f"tokenizer cache: ignoring {path} (not a private file of this user)")
                return None
            try:
                data = f.read()
            except OSError as e:
                self.notes.append(f"tokenizer cache: cannot read {path}: {e.strerror}")
                return None
        args = unpack(data, key)
        if args is None:
            self.notes.append(f"tokenizer cache: {path} is stale or damaged; parsing and rewriting it")
        return args

    def _write(self, path: Path, data: bytes) -> None:
        """Writes `data` to a temporary file beside `path`, renamed over it: a reader sees the
        old entry or the new one. No fsync: an entry torn by a crash fails its checksum."""
        tmp = None
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            self.notes.append(f"tokenizer cache: cannot write {path} ({e.strerror}); no cache")
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
