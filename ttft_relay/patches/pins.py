"""Which mitmproxy code each patch was written against, checked when the relay loads.

Every module of `fixes/` and `speed/`, and the private mitmproxy code the relay reads
(`connections`, `error_texts`, the `layer_events` seam), declares its `PINS`: for each
mitmproxy function it patches or relies on, the function as mitmproxy `MITMPROXY` defines it
and a digest of its source. Its pin test (`tests/patches/…/test_<module>.py`) fails on an
upgrade as soon as one changed; at run time `on(module)` decides whether the relay may use
the module at all:

- a **speed** patch only on mitmproxy `MITMPROXY` itself, with every pinned source unchanged,
  and while `relay_speed_patches` is on. Otherwise it stays off, and `say_speed_off` (from
  `patches.Check`, as the relay loads) says so in one line for all of them: the relay works the
  same, with more CPU per request;
- a **fix** wherever the sources it pins are unchanged (a later mitmproxy that left them as
  they were included). Where one changed, a fix the relay cannot do without (`WITHOUT` None:
  every fix security needs) stops the start: an error names the fix, the code that changed
  and the mitmproxy to install, and mitmproxy exits on an error logged while it starts. A fix
  with a `WITHOUT` is left off instead, with a warning saying what the relay does without it;
- the private **reads** (`connections`, `error_texts`) as a fix without a `WITHOUT`.

A module's `USES` names the pinned modules whose code it builds on (`layer_events`,
`connections`): their pins are its pins too. Pins are taken when the module is imported,
before any patch is installed (`patches/__init__.py` imports them all at once); a pin may
instead name its function as "module:qualname", looked up when it is checked and checked
only where mitmproxy has imported that module (mitmweb's handlers: in mitmdump they never run).

On an upgrade: read the new versions of the functions a pin test names, check that the
reasoning in the module's docstring still holds, then update its digests and `MITMPROXY`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

from mitmproxy import version as mitmproxy_version

logger = logging.getLogger(__name__)

MITMPROXY = "12.3.1"
"""The mitmproxy every pin was taken from (requirements.txt pins the same)."""
INSTALL = f"pip install 'mitmproxy=={MITMPROXY}'"

Pins = Mapping[str, tuple["Callable[..., Any] | type | str", str]]
"""`Owner.name` → (the function or class, or "module:qualname"; sha256 of its source, first 16 hex digits)."""
SPEED_OPTION = "relay_speed_patches"


@functools.cache
def digest(fn: Callable[..., Any] | type) -> str:
    """The first 16 hex digits of the sha256 of `fn`'s source (once per function: pins repeat)."""
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def resolve(target: Callable[..., Any] | type | str, *, import_it: bool = False) -> Any:
    """The pinned function itself; for a "module:qualname" pin, None where mitmproxy has not
    imported that module (unless `import_it`: the pin tests check every pin)."""
    if not isinstance(target, str):
        return target
    module_name, qualname = target.split(":")
    module = sys.modules.get(module_name)
    if module is None:
        if not import_it:
            return None
        module = importlib.import_module(module_name)
    return functools.reduce(getattr, qualname.split("."), module)


def changed(pins: Pins, *, import_it: bool = False) -> dict[str, str]:
    """The pinned functions whose source changed (or went), with their digest now."""
    now = {}
    for name, (target, pinned) in pins.items():
        try:
            fn = resolve(target, import_it=import_it)
            if fn is None:
                continue  # its module is not in use here
            found = digest(fn)
        except (AttributeError, ImportError, OSError, TypeError) as e:
            found = f"gone ({type(e).__name__})"
        if found != pinned:
            now[name] = found
    return now


def all_pins(module: ModuleType) -> dict[str, tuple[Any, str]]:
    """`module`'s pins and those of the modules it `USES`."""
    pins: dict[str, tuple[Any, str]] = {}
    for used in getattr(module, "USES", ()):
        pins.update(all_pins(used))
    pins.update(getattr(module, "PINS", {}))
    return pins


def kind(module: ModuleType) -> str:
    """"fix", "speed" or "read" (the shared private reads), by where the module lives."""
    package = module.__name__.rsplit(".", 2)[-2]
    return package if package == "speed" else "fix" if package == "fixes" else "read"


def installed_version() -> str:
    return mitmproxy_version.VERSION


def name_of(module: ModuleType) -> str:
    return module.__name__.rsplit(".", 1)[-1]


def what(module: ModuleType) -> str:
    """The first line of `module`'s docstring: what it does."""
    return (module.__doc__ or name_of(module)).strip().splitlines()[0].rstrip(".")


_problems: dict[str, str | None] = {}
"""Per module name: why it may not be used (None: it may), found once per process."""


def problem(module: ModuleType) -> str | None:
    """Why `module` may not be used with the mitmproxy installed (None: it may), whatever the options say."""
    if module.__name__ not in _problems:
        _problems[module.__name__] = _find_problem(module)
    return _problems[module.__name__]


def _find_problem(module: ModuleType) -> str | None:
    if kind(module) == "speed" and installed_version() != MITMPROXY:
        return f"mitmproxy {installed_version()} is not {MITMPROXY}"
    if now := changed(all_pins(module)):
        return f"mitmproxy {installed_version()} changed {', '.join(sorted(now))}"
    return None


_said: set[str] = set()
"""What has been logged once: module names, and "speed" for the speed line."""


def on(module: ModuleType) -> bool:
    """Whether the relay may install (or use) `module` now; for a fix, says why not, once, as
    the module docstring's policy has it (for the speed patches `say_speed_off` does)."""
    why = problem(module)
    if kind(module) == "speed":
        return why is None and speed_wanted()  # `say_speed_off` says why not, for all of them
    if why is None:
        return True
    if module.__name__ not in _said:
        _said.add(module.__name__)
        without = getattr(module, "WITHOUT", None)
        if without is not None:
            logger.warning("the relay's fix %s is off: %s, which it was written against (mitmproxy %s has "
                           "it as pinned); without it %s.", name_of(module), why, MITMPROXY, without)
        else:
            logger.error("cannot start the relay: its %s %s (%s) stands on mitmproxy code that changed: %s. "
                         "Install the mitmproxy it was written against: %s", kind(module), name_of(module),
                         what(module), why, INSTALL)
    return False


def speed_wanted() -> bool:
    """`relay_speed_patches` (on where no relay declared it: a test of one addon)."""
    from mitmproxy import ctx

    options = getattr(ctx, "options", None)
    return bool(getattr(options, SPEED_OPTION, True)) if options is not None else True


def say_speed_off(speed: Iterable[ModuleType]) -> None:
    """One line, once, if any of the `speed` patches may not be used with the mitmproxy installed."""
    off = [m for m in speed if problem(m) is not None]
    if not off or "speed" in _said:
        return
    _said.add("speed")
    if installed_version() != MITMPROXY:
        why = f"mitmproxy {installed_version()} is installed, they were written against {MITMPROXY} ({INSTALL} for them)"
    else:
        why = "; ".join(f"{name_of(m)}: {problem(m)}" for m in off)
    logger.warning("the relay's speed patches stay off (%s): %s. It works the same, with more CPU per request.",
                   ", ".join(name_of(m) for m in off), why)


def forget() -> None:
    """Find the problems again, and say them again (tests that fake a version or a change)."""
    _problems.clear()
    _said.clear()
