"""How a pin test checks the mitmproxy code under a patch: the digests its module declares
(`PINS`, ttft_relay/patches/pins.py says how they are taken and checked at run time).

On a mitmproxy upgrade, read the new versions of the functions a pin test names, check
that the reasoning in the patch's docstring still holds, then update the digests in the
module (and `pins.MITMPROXY`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType

from ttft_relay.patches.pins import Pins, changed


def assert_unchanged(pins: Pins, module: ModuleType) -> None:
    now = changed(pins, import_it=True)  # mitmweb's handlers too, which mitmdump never imports
    assert not now, f"mitmproxy code under {module.__name__} changed, re-check {module.__file__}: {now}"


def source(fn: Callable) -> str:
    return inspect.getsource(fn)
