"""The index of the relay's patches into mitmproxy (`ttft_relay/patches/`): every one named in one
place, each beside its pin test (`tests/patches/test_<module>.py`), all undone by one call.

mitmproxy is pinned ==12.3.1. On an upgrade, the pin tests name the functions to re-read
(tests/patches/pins.py says how).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from mitmproxy import http, version

import ttft_relay.patches as patches
from mitmproxy.test import tflow
from ttft_relay.testing.harness import REPO

PATCH_DIR = Path(patches.__file__).parent
MODULES = sorted(p.stem for p in PATCH_DIR.glob("*.py") if p.stem != "__init__")


def test_mitmproxy_is_the_pinned_version():
    assert version.VERSION == "12.3.1"


def test_every_module_is_named_in_the_index_and_has_its_pin_test():
    for name in MODULES:
        assert f"`{name}`" in patches.__doc__, f"ttft_relay/patches/__init__.py does not name {name}"
        assert (REPO / "tests" / "patches" / f"test_{name}.py").is_file(), f"{name} has no tests/patches/test_{name}.py"
    assert {p.__name__.rsplit(".", 1)[1] for p in patches.PATCHES} <= set(MODULES)


def test_every_patched_function_is_pinned_by_its_patch_test():
    for patch in patches.PATCHES:
        name = patch.__name__.rsplit(".", 1)[1]
        pins = importlib.import_module(f"tests.patches.test_{name}").PINNED
        pinned = {id(fn) for fn, _ in pins.values()}
        unpinned = [f"{owner.__name__}.{attr}" for (owner, attr), fn in patch.ORIGINALS.items() if id(fn) not in pinned]
        assert not unpinned, f"tests/patches/test_{name}.py does not pin {unpinned}"


def test_uninstall_all_gives_mitmproxy_its_code_back():
    patches.uninstall_all()  # whatever earlier tests left installed
    assert patches.patched() == []
    patches.error_replies.install(lambda flow, message, head_sent: None)
    patches.eager_connects.defer(lambda mode: True)
    patches.answer_on_head.answer_now(tflow.tflow(), http.Response.make(503))
    patches.head_limit.limit_request_heads(100)
    patches.upstream_copy.send_upstream_with(tflow.tflow(), lambda request: None)
    patches.trailers.answer_trailers()
    patches.listen_backlog.set_listen_backlog(300)
    patches.inherited_listeners.install({})
    patches.hook_plans.install_hook_plans(True)
    patches.interim_answers.install()
    patches.ca_once.load_ca_once(None)
    patches.client_resets.install(100, 10)
    patches.layer_events.install()
    patches.splice.install()
    patches.message_checks.install_message_checks(True)
    patches.resend.install()
    patches.web_options.install(lambda name, value: value)
    patches.upstream_pool.install(object())  # type: ignore[arg-type]
    patches.websocket_limits.install(patches.websocket_limits.Bounds())
    try:
        assert sorted(patches.patched()) == sorted(f"{o.__name__}.{a}" for o, a in patches.originals())
    finally:
        patches.uninstall_all()
    assert patches.patched() == []
