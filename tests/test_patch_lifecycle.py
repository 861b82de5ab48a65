"""One lifecycle for the relay's patches into mitmproxy: each addon installs the patches it uses
in `load`, `configure` or `running`, none from a request hook, and removes them in `done`; the
pins decide what may be installed at all (ttft_relay/patches/pins.py): on another mitmproxy the
speed patches stay off with one line, a fix whose code changed stops the start or, for the
fixes the relay can do without, stays off with a warning. (The relay itself on a faked
version, a real mitmdump: tests/test_patches_e2e.py.)"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType

import pytest
from mitmproxy import hooks, http
from mitmproxy.addons import proxyauth, proxyserver
from mitmproxy.proxy import mode_specs
from mitmproxy.proxy.layers import http as http_layers
from mitmproxy.test import taddons, tflow

from ttft_relay import capacity, dial, patches, scope, upstream_pool
from ttft_relay.faults import addons as faults
from ttft_relay.guard import exposure, hygiene, keys, limits, redaction, tls
from ttft_relay.patches import pins
from ttft_relay.stream import frames, streaming
from ttft_relay.trim import addon as trim

RELAY_KEY = "relay-key-0123456789-alice"
REVERSE = "reverse:http://127.0.0.1:9@0"
SPEED_FUNCTIONS = {f"{owner.__name__}.{name}" for module in patches.SPEED
                   for owner, name in getattr(module, "ORIGINALS", {})}
WORKER_ONLY = {f"{o.__name__}.{a}" for o, a in patches.inherited_listeners.ORIGINALS}
EVERY = {f"{o.__name__}.{a}" for o, a in patches.originals()}


@pytest.fixture(autouse=True)
def _pins_found_again(monkeypatch) -> Iterator[None]:
    monkeypatch.setenv("TTFT_TEST_RELAY_KEYS", RELAY_KEY)
    monkeypatch.setenv("TTFT_TEST_UPSTREAM_KEY", "sk-upstream-FAKEKEY-9876543210")
    patches.uninstall_all()
    pins.forget()
    yield
    pins.forget()


def patch_owners() -> list[object]:
    """Every addon of relay.py's list that installs a patch, in that list's order (after the
    mitmproxy addons whose options they read)."""
    shutdown, secrets = faults.Shutdown(), redaction.SecretRedaction()
    return [proxyauth.ProxyAuth(), proxyserver.Proxyserver(), patches.Check(), faults.StopFirst(shutdown),
            capacity.ListenBacklog(), capacity.WorkerListeners(), capacity.HookPlans(), capacity.MessageChecks(),
            capacity.ConnectionLog(), capacity.WarmStart(), upstream_pool.UpstreamPool(), tls.ClientTLS(),
            redaction.LogRedaction(), exposure.Exposure(), limits.ClientLimits(), limits.WebSocketLimits(),
            hygiene.FieldSyntax(), hygiene.OriginForm(), hygiene.RequestFraming(), keys.AccessKeys(), secrets,
            redaction.WebOptions(secrets),
            scope.Scope(), streaming.Streaming(), trim.Trim(), shutdown, dial.HappyEyeballs(), faults.Deadlines(),
            frames.WebSocketFrames(), faults.ErrorReplies()]


@dataclass
class Seen:
    """What was installed when, across a relay's lifecycle."""

    running: set[str] = field(default_factory=set)
    after_requests: list[set[str]] = field(default_factory=list)
    pool_on: bool = False
    while_running: Callable[[taddons.context], None] | None = None
    after_done: set[str] = field(default_factory=set)


def lifecycle(*, while_running: Callable[[taddons.context], None] | None = None, **options: object) -> Seen:
    """The patch owners as mitmdump runs them (load; configure with every option; running),
    then requests (one refused on its head, two let through with the upstream key swapped in
    what is sent and their connect made early, answered), then done."""
    seen = Seen()

    async def run() -> None:
        with taddons.context() as tctx:
            tctx.options.update(listen_host="127.0.0.1")  # taddons' default is every interface: an open proxy
            tctx.master.addons.add(*patch_owners())
            tctx.options.update(mode=[REVERSE],
                                relay_access_keys=["env:TTFT_TEST_RELAY_KEYS"],
                                relay_upstream_keys=["127.0.0.1=env:TTFT_TEST_UPSTREAM_KEY"],
                                relay_upstream_pool=True, relay_upstream_pool_warm=0, **options)
            tctx.master.addons.trigger(hooks.ConfigureHook(set(tctx.options.keys())))
            await tctx.master.addons.trigger_event(hooks.RunningHook())
            seen.running = set(patches.patched())
            seen.pool_on = tctx.master.addons.get("upstreampool").on
            for flow in (_keyed_flow(None), _keyed_flow(RELAY_KEY), _keyed_flow(RELAY_KEY)):
                for event in (http_layers.HttpRequestHeadersHook(flow), http_layers.HttpRequestHook(flow),
                              http_layers.HttpResponseHeadersHook(flow), http_layers.HttpResponseHook(flow)):
                    await tctx.master.addons.handle_lifecycle(event)
                seen.after_requests.append(set(patches.patched()))
            if while_running is not None:
                while_running(tctx)
            await tctx.master.addons.trigger_event(hooks.DoneHook())
            seen.after_done = set(patches.patched())

    asyncio.run(run())
    return seen


def _keyed_flow(key: str | None) -> http.HTTPFlow:
    flow = tflow.tflow(resp=True)
    flow.client_conn.proxy_mode = mode_specs.ProxyMode.parse(REVERSE)
    flow.request.path = "/v1/chat/completions"
    if key:
        flow.request.headers["authorization"] = f"Bearer {key}"
    return flow


def test_patches_go_in_before_requests_none_from_a_request_hook_and_all_out_at_done():
    seen = lifecycle()
    assert seen.running == EVERY - WORKER_ONLY, "every patch (but a worker's) installed before any request"
    assert seen.pool_on
    assert all(after == seen.running for after in seen.after_requests), "a request hook installed or removed one"
    assert seen.after_done == set()
    assert not patches.stream_resets.installed() and not patches.early_connects.installed()


def test_on_another_mitmproxy_the_speed_patches_stay_off_with_one_line(monkeypatch, caplog):
    monkeypatch.setattr(pins, "installed_version", lambda: "12.4.0")
    seen = lifecycle()
    assert seen.running == EVERY - WORKER_ONLY - SPEED_FUNCTIONS  # every fix in, no speed patch
    assert not seen.pool_on and seen.after_done == set()
    said = [r for r in caplog.records if "speed patches stay off" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "mitmproxy 12.4.0 is installed, they were written against 12.3.1" in said[0].getMessage()
    assert "pip install 'mitmproxy==12.3.1'" in said[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # it starts


def test_relay_speed_patches_off_leaves_mitmproxy_its_own_code_where_only_speed_was_at_stake(caplog):
    back_on: list[set[str]] = []

    def turn_them_on(tctx: taddons.context) -> None:
        tctx.options.update(relay_speed_patches=True)
        back_on.append(set(patches.patched()))

    seen = lifecycle(relay_speed_patches=False, while_running=turn_them_on)
    assert seen.running == EVERY - WORKER_ONLY - SPEED_FUNCTIONS
    assert back_on == [EVERY - WORKER_ONLY]  # and on again while it runs
    assert "speed patches stay off" not in caplog.text  # the user's choice: nothing to say


def _changed(monkeypatch, module: ModuleType) -> str:
    """`module`'s first pin as if mitmproxy's code under it had changed; its name."""
    name, (fn, _) = next(iter(module.PINS.items()))
    monkeypatch.setitem(module.PINS, name, (fn, "0" * 16))
    return name


def test_a_fix_whose_code_changed_stops_the_start_naming_it_and_the_mitmproxy_to_install(monkeypatch, caplog):
    _changed(monkeypatch, patches.head_limit)
    seen = lifecycle()
    assert "Http1Server.read_headers" not in seen.running  # not half-patched
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors  # said once, though two addons asked; mitmproxy's errorcheck exits on it
    assert errors[0].startswith("cannot start the relay: its fix head_limit (An HTTP/1 request head that never "
                                "ends is refused with a 431")
    assert "changed Http1Server.read_headers" in errors[0] and "pip install 'mitmproxy==12.3.1'" in errors[0]


def test_a_fix_the_relay_can_do_without_stays_off_saying_what_it_then_does(monkeypatch, caplog):
    _changed(monkeypatch, patches.resend)
    seen = lifecycle()
    assert "HttpStream.send_response" not in seen.running
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    warned = [r.getMessage() for r in caplog.records if "fix resend is off" in r.getMessage()]
    assert len(warned) == 1 and patches.resend.WITHOUT in warned[0]


def test_a_speed_patch_needs_the_seam_it_uses(monkeypatch, caplog):
    _changed(monkeypatch, patches.layer_events)
    seen = lifecycle()
    # early connects (speed) off, with the line; the stream resets (a fix it can do without) off, warned
    assert not patches.early_connects.installed() and "early_connects" in caplog.text
    assert "fix stream_resets is off" in caplog.text and "HttpLayer._handle_event" not in seen.running
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_shared_read_whose_code_changed_stops_the_start(monkeypatch, caplog):
    _changed(monkeypatch, patches.connections)
    with taddons.context(patches.Check()):
        pass
    assert "cannot start the relay: its read connections" in caplog.text


def test_every_pin_holds_at_run_time_here():
    assert [m.__name__ for m in patches.MODULES if pins.problem(m) is not None] == []
