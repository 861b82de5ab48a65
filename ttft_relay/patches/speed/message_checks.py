"""A request's and a response's field types checked as mitmproxy checks them, without its cost.

With Python's debug mode on (no `-O`, as mitmdump runs), every `Request` and `Response`
mitmproxy builds, two per flow, checks each of its data fields against its annotation in
`MessageData.__post_init__`: `dataclasses.fields` walked, and `check_option_type`, which
builds a `TypeError` message before it looks and recurses into each `X | None`. That
costs 25-40 us per message, as much as parsing its head. The wrap keeps, per data class,
the classes each field's annotation accepts (a plain class, `float` also taking `int`, or a
union of such), and asks `check_option_type` itself only for a value none of them is, or
a field whose annotation is anything else: so a value passes or raises exactly as
before, with mitmproxy's own error.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from mitmproxy import http
from mitmproxy.utils import typecheck

_ORIGINAL_POST_INIT = http.MessageData.__post_init__
ORIGINALS = {(http.MessageData, "__post_init__"): _ORIGINAL_POST_INIT}
PINS = {
    "MessageData.__post_init__": (_ORIGINAL_POST_INIT, "f65088e210cd9cc1"),
    "typecheck.check_option_type": (typecheck.check_option_type, "b60e47c7091fa795"),
}

_Checks = tuple[tuple[str, "tuple[type, ...] | None", Any], ...]
"""Per field: its name, the classes that pass it at once (None: always ask mitmproxy), its annotation."""
_CHECKS: dict[type, _Checks] = {}


def install_message_checks(on: bool) -> None:
    """Field types checked from kept classes; False gives mitmproxy's check back."""
    http.MessageData.__post_init__ = _post_init if on else _ORIGINAL_POST_INIT  # type: ignore[method-assign]


def uninstall() -> None:
    install_message_checks(False)


def _post_init(self: http.MessageData) -> None:
    checks = _CHECKS.get(type(self))
    if checks is None:
        checks = _CHECKS[type(self)] = tuple(
            (f.name, accepted(f.type), f.type) for f in dataclasses.fields(self))
    for name, classes, typeinfo in checks:
        value = getattr(self, name)
        if classes is None or not isinstance(value, classes):
            typecheck.check_option_type(name, value, typeinfo)


def accepted(typeinfo: Any) -> tuple[type, ...] | None:
    """The classes whose instances `check_option_type` passes for `typeinfo`, where that is
    all it asks (a plain class, or a union of plain classes); None otherwise."""
    origin = typing.get_origin(typeinfo)
    if origin is typing.Union or origin is types.UnionType:
        parts = [accepted(t) for t in typing.get_args(typeinfo)]
        return None if any(p is None for p in parts) else tuple(c for p in parts if p for c in p)
    if (origin is not None or not isinstance(typeinfo, type) or typeinfo is typing.Any
            or typeinfo in (typing.TextIO, typing.BinaryIO, typing.IO)):
        return None
    return (float, int) if typeinfo is float else (typeinfo,)
