"""Pin test of ttft_relay/patches/speed/hook_plans.py, and plans calling what mitmproxy calls, in its order
(the addon: tests/test_capacity.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from mitmproxy import ctx, exceptions, hooks
from mitmproxy.hooks import UpdateHook
from mitmproxy.proxy.layers.http import HttpRequestHook
from mitmproxy.test import taddons, tflow

from ttft_relay import capacity
from ttft_relay.patches.speed import hook_plans
from tests.patches.pins import assert_unchanged


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(hook_plans.PINS, hook_plans)


class Recorder:
    """An addon whose `request` hook notes its name, and may fail or halt."""

    def __init__(self, name: str, log: list, *, then: type[BaseException] | None = None, children=()) -> None:
        self.name, self.log, self.then = name, log, then
        if children:
            self.addons = list(children)

    def request(self, flow) -> None:
        self.log.append(self.name)
        if self.then:
            raise self.then(self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class AsyncRecorder(Recorder):
    async def request(self, flow) -> None:
        await asyncio.sleep(0)
        Recorder.request(self, flow)


class NotAHook:
    request = "not callable"

    def __repr__(self) -> str:
        return "NotAHook()"


def dispatch(addons_for_log, plans: bool, sync: bool, caplog) -> tuple[list, list[str], bool]:
    """Trigger one `request` event (with `trigger_event`, or the synchronous `trigger`)
    over the addons `addons_for_log(log)` builds: the order of the calls, the addon
    errors mitmproxy logged, and whether a plan served the event."""
    log: list = []
    left_to_mitmproxy: list[str] = []
    caplog.clear()

    def counted(original):
        def dispatch_by_mitmproxy(self, event):
            left_to_mitmproxy.append(event.name)
            return original(self, event)
        return dispatch_by_mitmproxy

    async def run() -> None:
        with taddons.context(*addons_for_log(log)) as tctx:
            try:
                if sync:
                    tctx.master.addons.trigger(HttpRequestHook(tflow.tflow()))
                else:
                    await tctx.master.addons.trigger_event(HttpRequestHook(tflow.tflow()))
            except exceptions.OptionsError as e:  # the one error that leaves the event
                log.append(f"raised {e}")
            finally:
                await tctx.master.done()  # its log handler must not outlive this loop

    hook_plans.install_hook_plans(plans)
    originals = hook_plans._ORIGINAL_TRIGGER_EVENT, hook_plans._ORIGINAL_TRIGGER
    hook_plans._ORIGINAL_TRIGGER_EVENT, hook_plans._ORIGINAL_TRIGGER = map(counted, originals)
    try:
        asyncio.run(run())
    finally:
        hook_plans._ORIGINAL_TRIGGER_EVENT, hook_plans._ORIGINAL_TRIGGER = originals
        hook_plans.install_hook_plans(False)
    errors = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Addon error")]
    return log, errors, plans and "request" not in left_to_mitmproxy


SCENARIOS = {
    "order, nesting and async": lambda log: [
        Recorder("a", log, children=[Recorder("a.1", log), AsyncRecorder("a.2", log, children=[Recorder("a.2.i", log)])]),
        AsyncRecorder("b", log), Recorder("c", log)],
    "an error skips the rest of that addon's tree only": lambda log: [
        Recorder("a", log, children=[Recorder("a.1", log, then=ValueError), Recorder("a.2", log)]), Recorder("b", log)],
    "OptionsError ends the event and propagates": lambda log: [
        Recorder("a", log), Recorder("b", log, then=exceptions.OptionsError), Recorder("c", log)],
    "AddonHalt ends the event": lambda log: [
        Recorder("a", log), Recorder("b", log, then=exceptions.AddonHalt), Recorder("c", log)],
    "a non-callable hook attribute is mitmproxy's error": lambda log: [
        Recorder("a", log), NotAHook(), Recorder("c", log)],
}


@pytest.mark.parametrize("sync", [False, True], ids=["trigger_event", "trigger"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_plans_call_what_mitmproxy_calls_in_its_order(scenario, sync, caplog):
    log, errors, _ = dispatch(SCENARIOS[scenario], False, sync, caplog)
    assert log  # the scenario ran
    planned_log, planned_errors, planned = dispatch(SCENARIOS[scenario], True, sync, caplog)
    assert (planned_log, planned_errors) == (log, errors)
    # Plans serve the event, but where mitmproxy must report an error of its own.
    assert planned == ("non-callable" not in scenario and not (sync and "async" in scenario))


def test_plans_pass_every_event_the_arguments_mitmproxy_passes():
    for cls in set(hooks.all_hooks.values()):
        event = cls(*(object() for _ in dataclasses.fields(cls)))
        assert list(hook_plans._args(event)) == event.args(), cls
        assert list(hook_plans._args(event)) == event.args(), cls  # from the kept getter


def test_plans_follow_the_addon_tree_as_it_changes():
    log: list = []

    async def run() -> list[list]:
        seen = []
        plans = capacity.HookPlans()
        parent = Recorder("parent", log, children=[Recorder("child", log)])
        with taddons.context(plans, parent) as tctx:
            try:
                tctx.configure(plans, relay_hook_plans=True)
                assert hook_plans.hook_plans_installed()

                async def event() -> None:
                    log.clear()
                    await tctx.master.addons.trigger_event(HttpRequestHook(tflow.tflow()))
                    seen.append(list(log))

                await event()
                late = Recorder("late", log)
                tctx.master.addons.add(late)  # a new top-level addon
                await event()
                tctx.master.addons.remove(late)
                await event()
                nested = Recorder("nested", log)
                parent.addons.append(nested)  # a managing addon registers what it adds
                tctx.master.addons.register(nested)
                await event()
                parent.addons.reverse()  # as the script loader reorders scripts, on an option change
                tctx.options.update(showhost=True)
                await event()
                tctx.configure(plans, relay_hook_plans=False)
                assert not hook_plans.hook_plans_installed()
            finally:
                hook_plans.install_hook_plans(False)
                await tctx.master.done()
        return seen

    assert asyncio.run(run()) == [
        ["parent", "child"],
        ["parent", "child", "late"],
        ["parent", "child"],
        ["parent", "child", "nested"],
        ["parent", "nested", "child"],
    ]


class TriggersOnLoad:
    """Fires an event while mitmproxy registers it: before it is in the tree."""

    def __init__(self, log: list) -> None:
        self.log = log

    def load(self, loader) -> None:
        ctx.master.addons.trigger(UpdateHook([]))

    def update(self, flows) -> None:
        self.log.append("update")


def test_an_event_fired_while_an_addon_registers_plans_nothing_stale():
    log: list = []

    async def run() -> None:
        with taddons.context() as tctx:
            hook_plans.install_hook_plans(True)
            try:
                tctx.master.addons.trigger(UpdateHook([]))  # a plan for `update` without the addon
                tctx.master.addons.add(TriggersOnLoad(log))
                tctx.master.addons.trigger(UpdateHook([]))
            finally:
                hook_plans.install_hook_plans(False)
                await tctx.master.done()

    asyncio.run(run())
    assert log == ["update"]
