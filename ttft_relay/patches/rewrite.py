"""Rewriting the commands a mitmproxy layer yields: what the wraps of layer methods share."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from mitmproxy.proxy import layer


def replacing(
    commands: layer.CommandGenerator[Any], replace: Callable[[Any], Iterable[Any] | None]
) -> layer.CommandGenerator[Any]:
    """Run a layer's command generator, with some commands replaced by others.

    `replace(command)` gives the commands to yield instead, or None to keep it. Values
    the layer sends back (hook results) go to the original generator; its return value
    is returned.
    """
    reply = None
    while True:
        try:
            command = commands.send(reply)
        except StopIteration as end:
            return end.value
        replacement = replace(command)
        if replacement is None:
            reply = yield command
        else:
            yield from replacement
            reply = None
