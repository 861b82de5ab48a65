"""Text the relay may show: its own secrets and credentials redacted wherever they turn
up, control characters escaped, long texts cut (pure).

A leaf: it imports nothing of the relay's. The guard redacts flows and log lines with it
(and keeps its set of known secrets current), timing writes records and console lines
with it, the ledger redacts a client's request id, the report prints with it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from typing import Any

# --- secrets ---------------------------------------------------------------------------

REDACTED = "REDACTED"
SECRET_HEADER_NAME = re.compile(r"authorization|cookie|(^|[-_])(api[-_]?key|key|token|secret|password)$", re.I)
"""Request headers whose values never outlive the request: `authorization`,
`proxy-authorization`, `cookie`, and any whose name says it holds a credential
(`x-api-key`, `api-key`, `x-goog-api-key`, `openai-api-key`, `x-auth-token`, ...)."""
SECRET_PARAM_NAME = re.compile(r"(api[-_]?)?key|(access[-_])?token", re.I)
"""Query parameters redacted in any case: `?key=`, `?KEY=`, `?api_key=`, `?access_token=`."""
MIN_ACCESS_KEY_LENGTH = 16
"""A relay access key's least length; a shorter token is never taken for one of the relay's keys."""


def key_digest(key: str) -> bytes:
    # Comparing fixed-size digests keeps the comparison constant-time whatever the
    # lengths, and works for any characters a client sends.
    return hashlib.sha256(key.encode("utf8", "surrogatepass")).digest()


def redacted_value(name: str, value: str) -> str:
    """A header value with its secret replaced; an auth scheme (`Bearer`, `Basic`, a word of
    letters) stays readable, anything else before a space may be the secret itself."""
    scheme, sep, _ = value.partition(" ")
    readable = sep and name.endswith("authorization") and _AUTH_SCHEME.fullmatch(scheme)
    return f"{scheme} {REDACTED}" if readable else REDACTED


_AUTH_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9]{0,19}")


def is_secret_header(name: str) -> bool:
    return SECRET_HEADER_NAME.search(name) is not None


_KNOWN_SECRETS: set[bytes] = set()
"""Digests of the relay's own secrets (relay access keys, upstream keys): redacted
wherever they turn up, in any header or parameter (the guard's `AccessKeys` keeps it
current, through `know_secrets`)."""
_TOKEN = re.compile(rf"[^\s'\"\\,;&=:]{{{MIN_ACCESS_KEY_LENGTH},}}")
_TOKEN_EDGES = "()[]{}<>.!?|`*"
"""Punctuation that may stand at a token's ends in prose ("(KEY)", "KEY."): a key is
looked for without it too. Not split on: a key may hold any of these inside."""


def without_known_secrets(text: str) -> str:
    """`text` with every token that is one of the relay's own keys replaced, also where
    punctuation of prose stands around it."""
    if not _KNOWN_SECRETS:
        return text
    return _TOKEN.sub(_known_secret_redacted, text)


def _known_secret_redacted(match: re.Match[str]) -> str:
    token = match.group(0)
    if key_digest(token) in _KNOWN_SECRETS:
        return REDACTED
    core = token.strip(_TOKEN_EDGES)
    if core != token and len(core) >= MIN_ACCESS_KEY_LENGTH and key_digest(core) in _KNOWN_SECRETS:
        start = token.index(core)
        return token[:start] + REDACTED + token[start + len(core):]
    return token


def know_secrets(digests: Iterable[bytes]) -> None:
    """The relay's own secrets from now on (their `key_digest`s), replacing those known before."""
    _KNOWN_SECRETS.clear()
    _KNOWN_SECRETS.update(digests)


def knows_secrets() -> bool:
    """Whether the relay has secrets of its own to redact (relay access keys, upstream keys)."""
    return bool(_KNOWN_SECRETS)


# --- text for lines of output ---------------------------------------------------------

ERROR_MAX = 300
"""Error texts are cut to this many characters (`cut_text`): an upstream error event may be
long, and mitmproxy's error texts quote what it could not parse (an 8 MB chunk header)."""

MAX_LOG_LINE = 2000
"""Characters one log line keeps; the rest is counted, not shown (a head that never
ended once made one 303 MB console line)."""
_HEADER_IN_TEXT = re.compile(
    r"((?:(?<=\\n)|(?<![\w-]))"
    r"(?:(?:[\w-]*[-_])?(?:authorization|cookie|api[-_]?key)|[\w-]*[-_](?:key|token|secret|password))"
    r"|(?:(?<=\\n)|^)(?:key|token|secret|password))"
    r"([ \t]*:[ \t]*)([^\r\n'\"\\]*)",
    re.I | re.M,
)
"""A credential header written out: its value runs to the end of the line (or of
the header in a bytes repr, where `\\r\\n` separates them). A bare `key`, `token`,
`secret` or `password` counts only where a header starts (a line's start): in prose
("… to the first token: learning this upstream · model …") it is a word."""
_PARAM_IN_TEXT = re.compile(r"([?&;])([A-Za-z0-9_-]+)=([^&\s'\"\\#]*)")


def _redact_header(m: re.Match) -> str:
    name, sep, value = m.groups()
    return m.group(0) if not value else name + sep + redacted_value(name.lower(), value)


def _redact_param(m: re.Match) -> str:
    lead, name, value = m.groups()
    return m.group(0) if not value or not SECRET_PARAM_NAME.fullmatch(name) else f"{lead}{name}={REDACTED}"


def redacted_text(text: str) -> str:
    """`text` with the credentials in it redacted: header lines and query parameters (as
    mitmproxy prints raw request bytes), and the relay's own keys anywhere."""
    return _PARAM_IN_TEXT.sub(_redact_param, _HEADER_IN_TEXT.sub(_redact_header, without_known_secrets(text)))


def safe_log_text(text: str) -> str:
    """A log message with credentials in it redacted (`redacted_text`), control characters
    escaped, and each line cut to MAX_LOG_LINE characters."""
    lines = printable(redacted_text(text), keep="\n\t").split("\n")
    return "\n".join(
        line if len(line) <= MAX_LOG_LINE else f"{line[:MAX_LOG_LINE]}… ({len(line) - MAX_LOG_LINE} more characters)"
        for line in lines
    )


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def cut_text(text: str, limit: int = ERROR_MAX) -> str:
    """`text` in at most `limit` characters, saying how long it was if it is cut; a text cut
    once stays as it is (the reply, the console and the record cut it alike)."""
    if len(text) <= limit:
        return text
    note = f"… ({len(text)} characters)"
    return text[:max(limit - len(note), 0)] + note


def printable(text: Any, keep: str = "") -> str:
    """`text` for a line of text output: control characters (newlines too, unless
    in `keep`) written as `\\n`, `\\x1b`, ..., so a value (a model name, an error
    text) cannot start a line of its own or repaint the terminal."""
    return _CONTROL.sub(lambda m: m.group(0) if m.group(0) in keep else repr(m.group(0))[1:-1], str(text))
