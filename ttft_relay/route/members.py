"""The members of each upstream group, as `relay_upstream_groups` lists them (pure).

An entry adds one member to the group of the reverse listener whose upstream is HOST:

    HOST NAME=URL [env:VAR|file:PATH]

e.g. `api.openai.com second=https://openai-b.example.com env:OPENAI_B_KEY`. The listener's
own upstream is the group's first member, named by its host; the others follow in the
order listed. With `relay_access_keys` each member's credential is its own key source when
the entry names one, else the key `relay_upstream_keys` holds for the member's host; without
relay keys the client's own key goes to whichever member serves it (a group that shares it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from mitmproxy import exceptions
from mitmproxy.proxy import mode_specs

OPTION = "relay_upstream_groups"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SCHEMES = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class Member:
    """One upstream of a group."""

    name: str
    scheme: str
    host: str
    port: int
    key_source: str | None = None
    """Where its upstream key is (`env:VAR`, `file:PATH`); None: `relay_upstream_keys` by its host."""

    @property
    def authority(self) -> str:
        """Its host, with ":port" unless the scheme's default: the Host header, and the
        upstream's name in records (`flows.upstream_name`)."""
        return self.host if self.port == SCHEMES[self.scheme] else f"{self.host}:{self.port}"


def listener_member(scheme: str, host: str, port: int) -> Member:
    """A reverse listener's own upstream, as its group's first member."""
    return Member(host.lower(), scheme, host.lower(), port)


def parse_member(url: str, name: str, key_source: str | None) -> Member:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise exceptions.OptionsError(f"{OPTION}: {url!r} is not a URL: {e}") from e
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise exceptions.OptionsError(f"{OPTION}: {url!r}: a member's URL is http(s)://HOST[:PORT]")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise exceptions.OptionsError(f"{OPTION}: {url!r}: a member's URL has no path, query or user "
                                      "(requests keep the client's path)")
    return Member(name, parts.scheme, parts.hostname.lower(), port or SCHEMES[parts.scheme], key_source)


def parse_groups(entries: Sequence[str], listeners: Iterable[Member]) -> dict[str, tuple[Member, ...]]:
    """{listener's upstream host: its members, its own first} for each listener an entry
    names; `listeners`: the reverse listeners' own upstreams. A bad entry is an OptionsError."""
    own = {member.host: member for member in listeners}
    groups: dict[str, list[Member]] = {}
    for entry in entries:
        fields = entry.split()
        if len(fields) not in (2, 3) or "=" not in fields[1]:
            raise exceptions.OptionsError(
                f"{OPTION}: {entry!r}: entries are 'HOST NAME=URL [env:VAR|file:PATH]'")
        host, (name, _, url) = fields[0].lower(), fields[1].partition("=")
        key_source = fields[2] if len(fields) == 3 else None
        if host not in own:
            raise exceptions.OptionsError(
                f"{OPTION}: {entry!r}: no reverse listener's upstream is {host} (mode: reverse:https://{host}@PORT)")
        if not NAME.fullmatch(name):
            raise exceptions.OptionsError(f"{OPTION}: {entry!r}: a member's name is letters, digits, '_', '.', '-'")
        if key_source is not None and not key_source.startswith(("env:", "file:")):
            raise exceptions.OptionsError(f"{OPTION}: {entry!r}: a member's key is env:VAR or file:PATH")
        group = groups.setdefault(host, [own[host]])
        if any(m.name == name for m in group):
            raise exceptions.OptionsError(f"{OPTION}: {entry!r}: {host}'s group already has a member {name}")
        group.append(parse_member(url, name, key_source))
    return {host: tuple(members) for host, members in groups.items()}


def listener_members(modes: Sequence[str]) -> list[Member]:
    """The own upstream of each reverse HTTP(S) listener in `mode`'s specs."""
    found = []
    for spec in modes:
        mode = mode_specs.ProxyMode.parse(spec)
        if isinstance(mode, mode_specs.ReverseMode) and mode.scheme in SCHEMES:
            found.append(listener_member(mode.scheme, *mode.address))
    return found
