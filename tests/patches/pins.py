"""How a pin test pins the mitmproxy code under a patch: a digest of each function's source.

On a mitmproxy upgrade, read the new versions of the functions a pin test names, check
that the reasoning in the patch's docstring still holds, then update the digests.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from types import ModuleType

Pins = dict[str, tuple[Callable, str]]
"""`Owner.name` → (the function, sha256 of its source, first 16 hex digits)."""


def digest(fn: Callable) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def changed(pins: Pins) -> dict[str, str]:
    """The pinned functions whose source changed, with their digest now."""
    return {name: digest(fn) for name, (fn, pinned) in pins.items() if digest(fn) != pinned}


def assert_unchanged(pins: Pins, module: ModuleType) -> None:
    now = changed(pins)
    assert not now, f"mitmproxy code under {module.__name__} changed, re-check {module.__file__}: {now}"


def source(fn: Callable) -> str:
    return inspect.getsource(fn)
