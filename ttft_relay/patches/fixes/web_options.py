"""mitmweb's option dumps without the secrets some options hold.

mitmweb sends every option with its value to its UI: `GET /options` and, at each change,
an `options/update` message on its WebSocket, both made by `optmanager.dump_dicts` (its
only callers). So whoever has the UI reads `proxyauth` (`user:password`, or an LDAP bind
password), `upstream_auth` (`user:password`) and `web_password` (plain text or an argon2
hash) in the clear. No hook reaches these handlers, and the master binds its option
signal at start, before the relay loads: the wrap of `dump_dicts` passes each dumped
value through `install`'s function (`guard.WebOptions`). The options themselves keep their
values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from mitmproxy import optmanager

_ORIGINAL_DUMP_DICTS = optmanager.dump_dicts
ORIGINALS = {(optmanager, "dump_dicts"): _ORIGINAL_DUMP_DICTS}
PINS = {
    "optmanager.dump_dicts": (_ORIGINAL_DUMP_DICTS, "f48bd145154e4fae"),
    # mitmweb's two dumps (checked where mitmweb runs: mitmdump never imports them)
    "Options.get": ("mitmproxy.tools.web.app:Options.get", "b73536d5fd1d84df"),
    "WebMaster._sig_options_update": ("mitmproxy.tools.web.master:WebMaster._sig_options_update", "e27cd83605ee4645"),
}
_shown: Callable[[str, Any], Any] | None = None


def install(shown: Callable[[str, Any], Any]) -> None:
    """Dumps show `shown(name, value)` as each option's value."""
    global _shown
    _shown = shown
    optmanager.dump_dicts = _dump_dicts


def uninstall() -> None:
    global _shown
    _shown = None
    optmanager.dump_dicts = _ORIGINAL_DUMP_DICTS


def _dump_dicts(opts: optmanager.OptManager, keys: Iterable[str] | None = None) -> dict:
    dumped = _ORIGINAL_DUMP_DICTS(opts, keys)
    if _shown is not None:
        for name, option in dumped.items():
            option["value"] = _shown(name, option["value"])
    return dumped
