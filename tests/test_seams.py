"""The index of the relay's patches into mitmproxy (`ttft_relay/patches/`): every one named in one
place and of one kind (fixes/, speed/), each pinned by its own `PINS` beside its pin test
(`tests/patches/<kind>/test_<module>.py`), all undone by one call.

mitmproxy is pinned ==12.3.1. On an upgrade, the pin tests name the functions to re-read
(tests/patches/pins.py says how).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest
from mitmproxy import http, version
from mitmproxy.test import tflow

import ttft_relay.patches as patches
from ttft_relay.patches import pins
from ttft_relay.testing.harness import REPO

PATCH_DIR = Path(patches.__file__).parent
KINDS = {"fixes": patches.FIXES, "speed": patches.SPEED}
SHARED = sorted(p.stem for p in PATCH_DIR.glob("*.py") if p.stem not in ("__init__", "pins"))
SECURITY = ("answer_on_head", "client_resets", "eager_connects", "head_limit", "trailers", "upstream_copy",
            "web_options", "websocket_limits")
"""Fixes the relay never runs without (`WITHOUT` None): where their code changed it does not start."""


def name(module: ModuleType) -> str:
    return module.__name__.rsplit(".", 1)[1]


def test_mitmproxy_is_the_pinned_version():
    assert version.VERSION == pins.MITMPROXY == "12.3.1"
    assert f"mitmproxy=={pins.MITMPROXY}" in (REPO / "requirements.txt").read_text()


@pytest.mark.parametrize("kind", KINDS)
def test_every_module_of_a_kind_is_listed_named_and_has_its_pin_test(kind):
    package = __import__(f"ttft_relay.patches.{kind}", fromlist=["_"])
    files = sorted(p.stem for p in (PATCH_DIR / kind).glob("*.py") if p.stem != "__init__")
    assert files == sorted(name(m) for m in KINDS[kind]), f"patches/{kind}/ and patches.{kind.upper()} differ"
    for module in files:
        assert f"`{module}`" in package.__doc__, f"ttft_relay/patches/{kind}/__init__.py does not name {module}"
        assert (REPO / "tests" / "patches" / kind / f"test_{module}.py").is_file(), f"{module} has no pin test"
    assert not set(files) & set(SHARED)


def test_every_shared_module_is_named_in_the_index_and_has_its_test():
    for module in SHARED:
        assert f"`{module}`" in patches.__doc__, f"ttft_relay/patches/__init__.py does not name {module}"
        assert (REPO / "tests" / "patches" / f"test_{module}.py").is_file(), f"{module} has no tests/patches/test_{module}.py"


@pytest.mark.parametrize("module", patches.MODULES, ids=name)
def test_every_patched_function_is_pinned_by_its_own_module(module):
    assert module.PINS, f"{module.__name__} pins nothing"
    pinned = {id(fn) for fn, _ in module.PINS.values()}
    unpinned = [f"{owner.__name__}.{attr}" for (owner, attr), fn in getattr(module, "ORIGINALS", {}).items()
                if id(fn) not in pinned]
    assert not unpinned, f"{module.__name__}.PINS does not pin {unpinned}"
    for used in getattr(module, "USES", ()):
        assert used in patches.MODULES


def test_the_relay_does_without_only_the_fixes_that_say_what_then_happens():
    without = {name(m) for m in patches.FIXES if getattr(m, "WITHOUT", None) is not None}
    assert without == {"stream_resets", "resend", "ca_at_start", "happy_eyeballs", "websocket_text"}
    assert not without & set(SECURITY)
    assert not [name(m) for m in (*patches.SPEED, *patches.READS) if hasattr(m, "WITHOUT")]


def test_the_docs_count_the_patches_of_each_kind():
    count = f"{len(patches.FIXES)} fixes and {len(patches.SPEED)} speed patches"
    for doc in ("README.md", "docs/architecture.md"):
        assert count in re.sub(r"\s+", " ", (REPO / doc).read_text()), f"{doc} does not say: {count}"


def test_uninstall_all_gives_mitmproxy_its_code_back():
    patches.uninstall_all()  # whatever earlier tests left installed
    assert patches.patched() == []
    patches.error_replies.install(lambda flow, message, head_sent: None)
    patches.eager_connects.defer(lambda mode: True)
    patches.answer_on_head.install(by="test")
    patches.head_limit.limit_request_heads(100)
    patches.upstream_copy.install(by="test")
    patches.upstream_copy.send_upstream_with(tflow.tflow(), lambda request: None)
    patches.trailers.answer_trailers()
    patches.listen_backlog.set_listen_backlog(300)
    patches.inherited_listeners.install({})
    patches.hook_plans.install_hook_plans(True)
    patches.interim_answers.install()
    patches.happy_eyeballs.install(lambda *args, **kwargs: None)
    patches.ca_once.load_ca_once(None)
    patches.client_resets.install(100, 10)
    patches.stream_resets.install()
    patches.early_connects.install(by="test")
    patches.splice.install()
    patches.message_checks.install_message_checks(True)
    patches.resend.install(by="test")
    patches.web_options.install(lambda name, value: value)
    patches.upstream_pool.install(object())  # type: ignore[arg-type]
    patches.websocket_limits.install(patches.websocket_limits.Bounds())
    patches.websocket_frames.install()
    patches.websocket_text.install()
    patches.answer_on_head.answer_now(tflow.tflow(), http.Response.make(503))
    try:
        assert sorted(patches.patched()) == sorted(f"{o.__name__}.{a}" for o, a in patches.originals())
    finally:
        patches.uninstall_all()
    assert patches.patched() == []
    assert not patches.stream_resets.installed() and not patches.early_connects.installed()
