"""Relay access keys: a relay shared without sharing the upstream key.

    AccessKeys      reverse listeners: clients present a relay access key where their
                    SDK puts the API key; the relay checks it and swaps in the
                    upstream key from the environment, so a relay can be shared
                    without sharing the upstream key.

Keys are never written in options: `env:NAME` and `file:PATH` point at them, so
they stay out of mitm.conf, command lines and mitmweb's option editor.
"""

from __future__ import annotations

import hmac
import os
import re
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path

from mitmproxy import ctx, exceptions, http
from mitmproxy.proxy import mode_specs

from .. import apis, flows, state
from ..patches import connections, pins
from ..route import members
from ..patches.fixes import answer_on_head, eager_connects, upstream_copy
from ..patches.speed import early_connects
from ..text import MIN_ACCESS_KEY_LENGTH, REDACTED, key_digest, know_secrets
from .exposure import is_http_reverse
from .refusals import api_shape, refusal

QUERY_SLOT = "?"
"""Leads a credential's slot that is a query parameter (`?key`); other slots are header names."""

DEFAULT_UPSTREAM_KEYS = [
    "api.openai.com=env:OPENAI_API_KEY",
    "api.anthropic.com=env:ANTHROPIC_API_KEY",
    "generativelanguage.googleapis.com=env:GEMINI_API_KEY",
]


def read_secret(source: str, option: str) -> str:
    """The text behind `env:NAME` or `file:PATH`. Error messages name the source, never a value."""
    kind, _, where = source.partition(":")
    if kind == "env" and where:
        value = os.environ.get(where)
        if value is None:
            raise exceptions.OptionsError(f"{option}: environment variable {where} is not set")
        return value
    if kind == "file" and where:
        try:
            return Path(where).expanduser().read_text(encoding="utf8")
        except OSError as e:
            raise exceptions.OptionsError(f"{option}: cannot read {where}: {e.strerror}") from e
    # Do not echo the entry: it may be a key someone pasted in.
    raise exceptions.OptionsError(f"{option}: entries must be env:NAME or file:PATH")


def parse_keys(text: str) -> list[str]:
    """Keys separated by whitespace, commas or lines; `#` starts a comment."""
    return [key for line in text.splitlines() for key in re.split(r"[\s,]+", line.split("#", 1)[0]) if key]


def load_access_keys(sources: Sequence[str]) -> list[str]:
    keys = [key for source in sources for key in parse_keys(read_secret(source, "relay_access_keys"))]
    if sources and not keys:
        raise exceptions.OptionsError("relay_access_keys: the sources hold no keys")
    if any(len(key) < MIN_ACCESS_KEY_LENGTH for key in keys):
        raise exceptions.OptionsError(f"relay_access_keys: keys must be at least {MIN_ACCESS_KEY_LENGTH} characters")
    return keys


def load_upstream_keys(hosts: Iterable[str], entries: Sequence[str]) -> dict[str, str]:
    """The upstream key for each host in `hosts`, from `HOST=env:NAME|file:PATH` entries."""
    sources: dict[str, str] = {}
    for entry in entries:
        host, sep, source = entry.partition("=")
        if not sep:
            raise exceptions.OptionsError("relay_upstream_keys: entries must be HOST=env:NAME or HOST=file:PATH")
        sources[host.strip().lower()] = source.strip()
    keys = {}
    for host in hosts:
        if host not in sources:
            raise exceptions.OptionsError(
                f"relay_upstream_keys: no key for {host}, the upstream of a reverse listener (add {host}=env:NAME)"
            )
        keys[host] = read_secret(sources[host], "relay_upstream_keys").strip()
        if not keys[host]:
            raise exceptions.OptionsError(f"relay_upstream_keys: the key for {host} ({sources[host]}) is empty")
    return keys


def load_member_keys(groups: dict[str, tuple[members.Member, ...]], keys: dict[str, str]) -> dict[tuple[str, str], str]:
    """{(group, member): its upstream key} for each member of an upstream group: its own key
    source's, else the key `keys` holds for its host (`load_upstream_keys`)."""
    found = {}
    for group, listed in groups.items():
        for member in listed:
            key = keys[member.host] if member.key_source is None else \
                read_secret(member.key_source, members.OPTION).strip()
            if not key:
                raise exceptions.OptionsError(f"{members.OPTION}: the key for {member.name} ({member.key_source}) is empty")
            found[(group, member.name)] = key
    return found


def reverse_upstream_hosts(modes: Sequence[str]) -> set[str]:
    hosts = set()
    for spec in modes:
        mode = mode_specs.ProxyMode.parse(spec)
        if is_http_reverse(mode):
            hosts.add(mode.address[0].lower())
    return hosts


def presented_credentials(request: http.Request) -> dict[str, str]:
    """{slot: credential} for each place some API's clients put their key in
    (`apis.KEY_HEADERS`, `apis.KEY_PARAMS`) and the request carries one: a header name,
    or QUERY_SLOT and a parameter's. A Bearer token counts without its scheme; other
    schemes count whole (and so never match a relay key)."""
    found = {}
    for name in apis.KEY_HEADERS:
        if (value := request.headers.get(name)) is not None:
            scheme, _, token = value.partition(" ")
            found[name] = token.strip() if name == "authorization" and scheme.lower() == "bearer" else value
    for param in apis.KEY_PARAMS:
        if param in request.query:
            found[QUERY_SLOT + param] = request.query[param]
    return found


def rejection(credentials: dict[str, str], digests: Sequence[bytes]) -> str | None:
    """Why the credentials do not admit the request, or None. Every credential
    presented must be a relay key: a request that mixes in anything else is
    ambiguous about which one the upstream should see."""
    if not credentials:
        return "missing relay access key (send it where your SDK sends its API key)"
    for credential in credentials.values():
        presented = key_digest(credential)
        # A list, not a generator: no early exit, every key is compared.
        if not any([hmac.compare_digest(presented, digest) for digest in digests]):
            return "relay access key not accepted"
    return None


def swap_credentials(request: http.Request, slots: Iterable[str], upstream_key: str) -> None:
    """Put the upstream key where the client put its relay key, in the same form:
    each SDK already presents keys the way its API expects them."""
    for slot in slots:
        if slot.startswith(QUERY_SLOT):
            request.query[slot.removeprefix(QUERY_SLOT)] = upstream_key
        elif slot == "authorization":
            request.headers[slot] = f"Bearer {upstream_key}"
        else:
            request.headers[slot] = upstream_key


class AccessKeys:
    """Relay access keys for reverse listeners. When `relay_access_keys` is set,
    every request on a reverse HTTP listener, in scope or not, must present a relay
    key; the relay swaps in the upstream key of the listener's host
    (`relay_upstream_keys`) or answers 401 in the API's error format. Proxy
    listeners are unaffected: there clients send their own keys, and proxyauth
    guards the proxy.

    No upstream connection is opened for a client before its key is accepted (no
    eager connect on these listeners); once the key on a request's head is, the
    connect starts while the body uploads (`patches.speed.early_connects`), where a
    lazy connect would wait for the body and the request hooks."""

    def __init__(self) -> None:
        self.digests: list[bytes] = []
        self.upstream_keys: dict[str, str] = {}
        self.member_keys: dict[tuple[str, str], str] = {}
        """Upstream groups' members' keys (`route.members`), by (group, member)."""
        self.refused: weakref.WeakKeyDictionary[http.HTTPFlow, str] = weakref.WeakKeyDictionary()
        """Why the relay answered a flow itself, for its timing record."""

    def load(self, loader) -> None:
        loader.add_option(
            "relay_access_keys",
            Sequence[str],
            [],
            "Relay access keys that reverse listeners require (empty: none required). "
            "Entries: env:NAME or file:PATH, each holding keys separated by whitespace, "
            f"commas or lines (# comments); keys have at least {MIN_ACCESS_KEY_LENGTH} characters.",
        )
        loader.add_option(
            "relay_upstream_keys",
            Sequence[str],
            DEFAULT_UPSTREAM_KEYS,
            "With relay_access_keys: the key sent upstream, per upstream host of a reverse "
            "listener, as HOST=env:NAME or HOST=file:PATH. Every reverse listener's host needs one.",
        )
        if pins.on(answer_on_head):
            answer_on_head.install(by="keys")

    def configure(self, updated: set[str]) -> None:
        if not updated & {"relay_access_keys", "relay_upstream_keys", members.OPTION, "mode", pins.SPEED_OPTION}:
            return
        keys = load_access_keys(ctx.options.relay_access_keys)
        upstream_keys, member_keys = {}, {}
        if keys:
            groups = members.parse_groups(getattr(ctx.options, members.OPTION, ()),
                                          members.listener_members(ctx.options.mode))
            hosts = reverse_upstream_hosts(ctx.options.mode) | {
                m.host for group in groups.values() for m in group if m.key_source is None}
            upstream_keys = load_upstream_keys(hosts, ctx.options.relay_upstream_keys)
            member_keys = load_member_keys(groups, upstream_keys)
        self.digests = [key_digest(key) for key in keys]
        self.upstream_keys = upstream_keys
        self.member_keys = member_keys
        know_secrets([*self.digests, *(key_digest(key) for key in [*upstream_keys.values(), *member_keys.values()])])
        # Keyed listeners open no upstream connection before a request's key is checked.
        if pins.on(eager_connects):
            eager_connects.defer(is_http_reverse if keys else None)
        if keys and pins.on(upstream_copy):
            upstream_copy.install(by="keys")
        else:
            upstream_copy.uninstall(by="keys")
        if keys and pins.on(early_connects):
            early_connects.install(by="keys")
        else:
            early_connects.uninstall(by="keys")

    def done(self) -> None:
        eager_connects.defer(None)
        answer_on_head.uninstall(by="keys")
        upstream_copy.uninstall(by="keys")
        early_connects.uninstall(by="keys")

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        credentials = presented_credentials(flow.request)
        flows.note_client_key(flow, credentials.values())
        mode = flow.client_conn.proxy_mode
        if not self.digests or flow.response is not None or not is_http_reverse(mode):
            return
        status, reason = 401, rejection(credentials, self.digests)
        upstream_key = self.upstream_keys.get(mode.address[0].lower())
        if reason is None and upstream_key is None:
            # A connection still open on a listener that an option change removed.
            status, reason = 502, "the relay has no upstream key for this listener"
        if reason is not None:
            self.refused[flow] = reason
            # On the head: the body is never read, however large it says it is.
            answer_on_head.answer_now(flow, refusal(api_shape(flow.request), status, reason))
            return
        assert upstream_key is not None  # without one, `reason` says so and the flow was refused above
        # The upstream key goes only into what is sent: mitmweb shows flows in flight.
        swap_credentials(flow.request, credentials, REDACTED)
        upstream_copy.send_upstream_with(flow, lambda request: swap_credentials(
            request, credentials, self.key_for(flow, mode.address[0].lower(), upstream_key)))
        if (handler := connections.handler_of(flow.client_conn)) is not None:
            early_connects.connect_early(handler, flow)

    def key_for(self, flow: http.HTTPFlow, group: str, listener_key: str) -> str:
        """The upstream key for where `flow` goes as it is sent: its upstream group's member's
        (`FlowState.route`, the member it goes to now), else its listener's."""
        st = state.get(flow)
        if st is None or st.route is None:
            return listener_key
        return self.member_keys.get((group, st.route["upstream"]), listener_key)

    def error(self, flow: http.HTTPFlow) -> None:
        # A refused flow ends here (answered, then killed). The scope addon has
        # attached its state meanwhile, so the timing record (written in the same
        # hook, later in the chain) says the relay refused it, not the upstream.
        st = state.get(flow)
        if st is not None and (reason := self.refused.get(flow)) is not None:
            st.record_error(reason, phase="relay")
