"""Events the relay hands mitmproxy's HTTP layer, for what no hook can ask of it: the seam
`fixes.stream_resets` and `speed.early_connects` share.

mitmproxy has no event for "cancel this flow's upstream request" or "open this flow's
upstream connection now". The wrap of `HttpLayer._handle_event` gives an event of a class
registered here (`handle`) to its handler, with the HTTP layer it reached; any other event
goes to mitmproxy's own. The connection handler passes them down its layers like any event
(`handler.server_event`), and each reports whether the HTTP layer holding the flow did it
(`done`). Any other layer's HTTP layer (a tunnel's, in regular mode) leaves them undone. The
wrap is installed while some event class is registered: an event of a class nobody handles
(its patch is off) is not handed at all, and its sender hears that it was not done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mitmproxy import http
from mitmproxy.proxy import events, layer
from mitmproxy.proxy.layers.http import HttpLayer, HttpStream

_ORIGINAL_HANDLE_EVENT = HttpLayer._handle_event
ORIGINALS = {(HttpLayer, "_handle_event"): _ORIGINAL_HANDLE_EVENT}
PINS = {
    "HttpLayer._handle_event": (_ORIGINAL_HANDLE_EVENT, "6ba31883cc7a06b3"),
    # how the layer reaches a stream and a connection
    "HttpLayer.event_to_child": (HttpLayer.event_to_child, "1095f6e1581d1780"),
}


@dataclass
class FlowEvent(events.Event):
    flow: http.HTTPFlow
    done: bool = False
    """Set by the HTTP layer that did what the event asks."""


Handler = Callable[[HttpLayer, Any], layer.CommandGenerator[None]]
_handlers: dict[type[FlowEvent], Handler] = {}
_handing: set[asyncio.Future[None]] = set()
"""Events on their way (a task holds each until the HTTP layer had it)."""


def handle(event_class: type[FlowEvent], handler: Handler) -> None:
    """HTTP layers give events of `event_class` to `handler(http_layer, event)`."""
    _handlers[event_class] = handler
    HttpLayer._handle_event = _handle_event  # type: ignore[method-assign]


def unhandle(event_class: type[FlowEvent]) -> None:
    _handlers.pop(event_class, None)
    if not _handlers:
        HttpLayer._handle_event = _ORIGINAL_HANDLE_EVENT  # type: ignore[method-assign]


def handled(event_class: type[FlowEvent]) -> bool:
    return event_class in _handlers


def uninstall() -> None:
    _handlers.clear()
    HttpLayer._handle_event = _ORIGINAL_HANDLE_EVENT  # type: ignore[method-assign]


def hand(handler: Any, event: FlowEvent, then: Callable[[bool], object] | None = None) -> None:
    """Hand `event` to the HTTP layer of `handler` (the flow's client connection
    handler) as soon as it takes events; `then(event.done)` once it had it (at once,
    with False, where no HTTP layer handles such events)."""
    if type(event) not in _handlers:
        if then is not None:
            then(False)
        return
    task = asyncio.ensure_future(_hand(handler, event, then))
    _handing.add(task)
    task.add_done_callback(_handing.discard)


async def _hand(handler: Any, event: FlowEvent, then: Callable[[bool], object] | None) -> None:
    await handler.server_event(event)
    if then is not None:
        then(event.done)


def _handle_event(self: HttpLayer, event: events.Event) -> layer.CommandGenerator[None]:
    handler = _handlers.get(type(event))  # type: ignore[arg-type]
    if handler is None:
        return (yield from _ORIGINAL_HANDLE_EVENT(self, event))
    yield from handler(self, event)
    return None


def stream_of(http_layer: HttpLayer, flow: http.HTTPFlow) -> HttpStream | None:
    """The stream of `http_layer` that carries `flow`, if it is there."""
    return next((s for s in http_layer.streams.values() if getattr(s, "flow", None) is flow), None)
