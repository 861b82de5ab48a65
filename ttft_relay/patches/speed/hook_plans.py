"""mitmproxy's events dispatched from plans: the addon tree walked once per hook name, not per event.

mitmproxy dispatches every event (each flow hook, the `update` event after each, every
log record as an `add_log` event) by walking its whole addon tree: per top-level addon
(36 in mitmdump, 40 in mitmweb) a context manager, nested generators, a `getattr` (and
for `trigger_event` a coroutine), and the event's arguments rebuilt from its dataclass
fields for every function called, whether or not any addon implements the hook. That
walk was the largest single cost of a bare streaming mitmdump under py-spy. The wraps
of `AddonManager.trigger_event` and `trigger` walk the tree once per hook name and keep
the plan: per top-level addon, the hook functions of it and its children, in
mitmproxy's order. They call them as mitmproxy does: each top-level addon's functions
as under `safecall` (an exception is logged, by `safecall` itself, and skips the rest
of that addon's tree; `AddonHalt` ends the event, `OptionsError` propagates), awaiting
what returns an awaitable, with the event's arguments as `Hook.args` gives them
(read by a getter kept per event class). A `with safecall()` per top-level addon per
event, and `dataclasses.fields` per event, were most of what dispatch still cost. Plans are dropped
when the tree can change: an addon registered or removed (`AddonManager.register`, a
new chain list) and any option change (`forget_hook_plans`, e.g. scripts reordered).
An event already running when a script reloads keeps the functions it started with
(mitmproxy's lazy walk would reach the new ones). mitmproxy's own dispatch still runs
the lifecycle events (load, configure, running, done: rare, and when scripts load
during the walk), a hook some addon names with a non-callable attribute, and a
coroutine hook fired synchronously (mitmproxy reports both).
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mitmproxy import addonmanager, exceptions, hooks
from mitmproxy.addons import script

_ORIGINAL_TRIGGER_EVENT = addonmanager.AddonManager.trigger_event
_ORIGINAL_TRIGGER = addonmanager.AddonManager.trigger
_ORIGINAL_REGISTER = addonmanager.AddonManager.register
ORIGINALS = {
    (addonmanager.AddonManager, "trigger_event"): _ORIGINAL_TRIGGER_EVENT,
    (addonmanager.AddonManager, "trigger"): _ORIGINAL_TRIGGER,
    (addonmanager.AddonManager, "register"): _ORIGINAL_REGISTER,
}
PINS = {
    "AddonManager.trigger_event": (_ORIGINAL_TRIGGER_EVENT, "b763c59bc4992e33"),
    "AddonManager.register": (_ORIGINAL_REGISTER, "01ddcca314eebbd3"),
    "AddonManager.trigger": (_ORIGINAL_TRIGGER, "b19e37ceb2096421"),
    "AddonManager.invoke_addon_sync": (addonmanager.AddonManager.invoke_addon_sync, "212818268a95797b"),
    "AddonManager.invoke_addon": (addonmanager.AddonManager.invoke_addon, "13180532440359de"),
    "AddonManager._iter_hooks": (addonmanager.AddonManager._iter_hooks, "350b419ab7284091"),
    "AddonManager.remove": (addonmanager.AddonManager.remove, "2e93aab2204a39f6"),
    "AddonManager.clear": (addonmanager.AddonManager.clear, "5fd484329fa05882"),
    "AddonManager.add": (addonmanager.AddonManager.add, "6c26295c4f0f4eb9"),
    "addonmanager.traverse": (addonmanager.traverse, "bad3d9f88bdf9269"),
    # what the plans do in its place: an addon's error, the event's arguments
    "addonmanager.safecall": (addonmanager.safecall, "f2052c18340e99b0"),
    "Hook.args": (hooks.Hook.args, "5bab95f7aa358e18"),
    # how the tree changes under plans: register, then the module set
    "Script.loadscript": (script.Script.loadscript, "f2972abb206ff2fe"),
    "ScriptLoader.configure": (script.ScriptLoader.configure, "d76470344008804a"),
}


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one event calls: per top-level addon that has any, its hook functions."""

    funcs: list[list[Callable]]
    sync: bool
    """No coroutine functions among them: the synchronous `trigger` may use the plan."""


class _HookPlans:
    """The plans of one addon tree, by hook name; None where mitmproxy's own dispatch
    must run (lifecycle events, a non-callable attribute named like the hook)."""

    __slots__ = ("chain", "generation", "by_name")

    def __init__(self, chain: list[Any], generation: int) -> None:
        # The list itself, not its id: `remove` and `clear` make a new list (and `add`
        # goes through `register`).
        self.chain = chain
        self.generation = generation
        self.by_name: dict[str, _Plan | None] = {}


_PLANS_ATTRIBUTE = "_ttft_relay_hook_plans"
"""Where a manager keeps its plans: on itself, so they live and die with it."""
_generation = 0
"""Bumped whenever some addon tree may have changed; older plans are dropped."""
_LIFECYCLE = frozenset({"load", "configure", "running", "done"})
"""Rare, and when the tree changes (scripts load) while mitmproxy's lazy walk runs."""


def install_hook_plans(on: bool) -> None:
    """Dispatch events from plans; False gives mitmproxy's dispatch back."""
    forget_hook_plans()
    manager = addonmanager.AddonManager
    manager.trigger_event = _trigger_event if on else _ORIGINAL_TRIGGER_EVENT  # type: ignore[method-assign]
    manager.trigger = _trigger if on else _ORIGINAL_TRIGGER  # type: ignore[method-assign]
    manager.register = _register if on else _ORIGINAL_REGISTER  # type: ignore[method-assign]


def uninstall() -> None:
    install_hook_plans(False)


def hook_plans_installed() -> bool:
    return addonmanager.AddonManager.trigger_event is _trigger_event


def forget_hook_plans() -> None:
    global _generation
    _generation += 1


def _register(self: addonmanager.AddonManager, addon: Any) -> Any:
    # Forget after, not before: the tree changes only once this returns (`add`
    # appends the addon, a script addon sets its module), and events fired meanwhile
    # (from `load`, or `configure` of deferred options) may have planned the old one.
    try:
        return _ORIGINAL_REGISTER(self, addon)
    finally:
        forget_hook_plans()


def _plan_for(manager: addonmanager.AddonManager, name: str) -> _Plan | None:
    plans = getattr(manager, _PLANS_ATTRIBUTE, None)
    if plans is None or plans.generation != _generation or plans.chain is not manager.chain:
        plans = _HookPlans(manager.chain, _generation)
        setattr(manager, _PLANS_ATTRIBUTE, plans)
    try:
        return plans.by_name[name]
    except KeyError:
        pass
    try:
        plan = None if name in _LIFECYCLE else _plan(manager.chain, name)
    except Exception:  # an addon's attribute raised: mitmproxy's walk reports it
        plan = None
    plans.by_name[name] = plan
    return plan


def _plan(chain: list[Any], name: str) -> _Plan | None:
    funcs = []
    for top in chain:
        of_top = []
        for addon in addonmanager.traverse([top]):
            func = getattr(addon, name, None)
            if not func or isinstance(func, types.ModuleType):  # mitmproxy skips both
                continue
            if not callable(func):
                return None
            of_top.append(func)
        if of_top:
            funcs.append(of_top)
    return _Plan(funcs, sync=not any(inspect.iscoroutinefunction(f) for of_top in funcs for f in of_top))


def _planned(manager: addonmanager.AddonManager, event: hooks.Hook, sync: bool) -> tuple[list[list[Callable]], Any] | None:
    """The hook functions per top-level addon and the event's arguments; None leaves
    the event to mitmproxy (see `_plan_for`; a coroutine hook fired synchronously,
    which mitmproxy reports)."""
    plan = _plan_for(manager, event.name)
    if plan is None or (sync and not plan.sync):
        return None
    return plan.funcs, _args(event) if plan.funcs else ()


_ARGS: dict[type, Callable[[Any], Sequence[Any]]] = {}
"""Per event class, what `Hook.args` returns (its dataclass fields' values), without
`dataclasses.fields` walked again for every event."""


def _args(event: hooks.Hook) -> Any:
    try:
        return _ARGS[type(event)](event)
    except KeyError:
        pass
    cls = type(event)
    getter: Callable[[Any], Sequence[Any]] = cls.args
    if cls.args is hooks.Hook.args:
        getter = _fields_getter(tuple(f.name for f in dataclasses.fields(cls)))  # type: ignore[arg-type]  # every Hook is a dataclass
    _ARGS[cls] = getter  # an event class with its own `args` is asked every time
    return getter(event)


def _fields_getter(names: tuple[str, ...]) -> Callable[[Any], tuple]:
    if len(names) > 1:
        return operator.attrgetter(*names)
    if names:
        get = operator.attrgetter(names[0])
        return lambda event: (get(event),)
    return lambda event: ()


def _addon_failed(error: Exception) -> None:
    """An addon's hook raised: log it as mitmproxy's `safecall` does. Entered only on
    failure, where mitmproxy enters it for every top-level addon of every event."""
    with addonmanager.safecall():
        raise error


async def _trigger_event(self: addonmanager.AddonManager, event: hooks.Hook) -> None:
    planned = _planned(self, event, sync=False)
    if planned is None:
        return await _ORIGINAL_TRIGGER_EVENT(self, event)
    funcs_by_addon, args = planned
    for funcs in funcs_by_addon:
        try:
            for func in funcs:
                result = func(*args)
                if result is not None and inspect.isawaitable(result):
                    await result
        except exceptions.AddonHalt:
            return
        except exceptions.OptionsError:  # safecall lets both through
            raise
        except Exception as e:
            _addon_failed(e)


def _trigger(self: addonmanager.AddonManager, event: hooks.Hook) -> None:
    planned = _planned(self, event, sync=True)
    if planned is None:
        return _ORIGINAL_TRIGGER(self, event)
    funcs_by_addon, args = planned
    for funcs in funcs_by_addon:
        try:
            for func in funcs:
                func(*args)
        except exceptions.AddonHalt:
            return
        except exceptions.OptionsError:
            raise
        except Exception as e:
            _addon_failed(e)
