"""mitmweb's option dumps, and its views of a flow in flight, without the secrets they hold.

Options: mitmweb sends every option with its value to its UI: `GET /options` and, at each
change, an `options/update` message on its WebSocket, both made by `optmanager.dump_dicts`
(its only callers). So whoever has the UI reads `proxyauth` (`user:password`, or an LDAP bind
password), `upstream_auth` (`user:password`) and `web_password` (plain text or an argon2
hash) in the clear. No hook reaches these handlers, and the master binds its option
signal at start, before the relay loads: the wrap of `dump_dicts` passes each dumped
value through `install`'s function (`redaction.WebOptions`). The options themselves keep their
values.

Flows: the relay redacts a flow's credentials once its request has gone upstream
(`redaction.SecretRedaction`); until then the flow must hold them, as mitmproxy sends the request
as the flow has it. mitmweb shows a flow from its head on: `app.flow_to_json` makes the flow
list (`GET /flows`) and every `flows/add` / `flows/update` message of its WebSocket,
`GET /flows/dump` writes the flows with `io.FlowWriter`, and its Export menu (the `export`
commands) formats a flow with `export.formats`. Each of them is given `install_flows`'
function's view of the flow instead (a redacted copy while its credentials are still
needed). `flow_to_json` and `DumpFlows` exist only where mitmweb runs (mitmdump never imports
them): they are wrapped there, when installing finds mitmweb's app loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

from mitmproxy import flow, io, optmanager
from mitmproxy.addons import export

_ORIGINAL_DUMP_DICTS = optmanager.dump_dicts
_ORIGINAL_FORMATS = dict(export.formats)
ORIGINALS = {(optmanager, "dump_dicts"): _ORIGINAL_DUMP_DICTS}
WEB_APP = "mitmproxy.tools.web.app"
PINS = {
    "optmanager.dump_dicts": (_ORIGINAL_DUMP_DICTS, "f48bd145154e4fae"),
    # mitmweb's two dumps (checked where mitmweb runs: mitmdump never imports them)
    "Options.get": ("mitmproxy.tools.web.app:Options.get", "b73536d5fd1d84df"),
    "WebMaster._sig_options_update": ("mitmproxy.tools.web.master:WebMaster._sig_options_update", "e27cd83605ee4645"),
    # mitmweb's views of a flow: its JSON (the list, the WebSocket's messages), the dump, the exports
    "flow_to_json": ("mitmproxy.tools.web.app:flow_to_json", "4f1964c14ecd568f"),
    "Flows.get": ("mitmproxy.tools.web.app:Flows.get", "c49f00ef041e1dcd"),
    "DumpFlows.get": ("mitmproxy.tools.web.app:DumpFlows.get", "433755bce4adfa90"),
    "ClientConnection.broadcast_flow": ("mitmproxy.tools.web.app:ClientConnection.broadcast_flow", "8c6498949f36606e"),
    "Export.export_str": ("mitmproxy.addons.export:Export.export_str", "c3922ed34acf0744"),
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
    uninstall_flows()


def _dump_dicts(opts: optmanager.OptManager, keys: Iterable[str] | None = None) -> dict:
    dumped = _ORIGINAL_DUMP_DICTS(opts, keys)
    if _shown is not None:
        for name, option in dumped.items():
            option["value"] = _shown(name, option["value"])
    return dumped


_web_originals: dict[str, Any] = {}
"""mitmweb's `flow_to_json` and `io`, as its app had them, while the wrap is installed."""


def install_flows(shown_flow: Callable[[flow.Flow], flow.Flow]) -> None:
    """mitmweb's views and the exports show `shown_flow(f)` for each flow `f`."""
    for name, fmt in _ORIGINAL_FORMATS.items():
        export.formats[name] = _shown_by(fmt, shown_flow)
    app: Any = sys.modules.get(WEB_APP)  # mitmweb's, where it runs
    if app is None or _web_originals:
        return
    _web_originals.update(flow_to_json=app.flow_to_json, io=app.io)
    original_to_json = app.flow_to_json

    def flow_to_json(f: flow.Flow) -> dict:
        return original_to_json(shown_flow(f))

    class FlowWriter(io.FlowWriter):
        def add(self, f: flow.Flow) -> None:
            super().add(shown_flow(f))

    app.flow_to_json = flow_to_json
    app.io = SimpleNamespace(FlowWriter=FlowWriter, FlowReader=io.FlowReader)


def uninstall_flows() -> None:
    export.formats.update(_ORIGINAL_FORMATS)
    app: Any = sys.modules.get(WEB_APP)
    if app is not None and _web_originals:
        app.flow_to_json, app.io = _web_originals["flow_to_json"], _web_originals["io"]
    _web_originals.clear()


def _shown_by(fmt: Callable[[flow.Flow], str | bytes],
              shown_flow: Callable[[flow.Flow], flow.Flow]) -> Callable[[flow.Flow], str | bytes]:
    def shown(f: flow.Flow) -> str | bytes:
        return fmt(shown_flow(f))

    return shown
