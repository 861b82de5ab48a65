"""The relay's patches into mitmproxy, for what hooks cannot shape: every one named here, in two kinds.

- `fixes/`: what correctness or security needs (mitmproxy would crash, hang, lose a reset,
  read a refused body, show a secret, or answer in its own words). Listed in `FIXES`.
- `speed/`: what only makes the relay faster; with all of them off the relay sends the same
  bytes and writes the same records, with more CPU per request. Listed in `SPEED`.

Each is one module that says what it patches and why, and declares `PINS` (pins.py): the
mitmproxy code it was written against, pinned by source digests that its pin test
(`tests/patches/fixes/test_<module>.py`, `tests/patches/speed/test_<module>.py`) checks and
that `pins.on` checks again when the relay loads, where mitmproxy may be any version: speed
patches run only on mitmproxy 12.3.1 (one line says they are off otherwise), a fix whose
pinned code changed stops the start (or, for the five the relay can do without, is left off
with a warning). `Check`, the relay's first addon, runs that check for all of them at load.
What mitmproxy would have to change for the relay to drop each one: docs/architecture.md,
"What mitmproxy could take".

A patch replaces mitmproxy functions, listed in its `ORIGINALS`, and gives them back in its
`uninstall()`. The addon that uses it installs it in `load`, `configure` or `running` and
removes it in `done`, never from a request hook; `uninstall_all()` gives mitmproxy all its
code back. The one exception is `fixes.inherited_listeners`, which a worker installs before
mitmproxy binds its listeners (workers.worker_main), and `capacity.WorkerListeners` removes.

Shared by both kinds, in this package:

- `layer_events`: the seam for events the relay hands mitmproxy's HTTP layer (a patch:
  installed while `fixes.stream_resets` or `speed.early_connects` hands one);
- `connections`: live connections, their sockets and the listeners' (private, read without
  a patch: `observe.selfwatch`, faults, guard, the splice, the pool);
- `error_texts`: mitmproxy's error texts the relay matches (private, read without a patch;
  `timing.Timing`, `faults`);
- `chunk_reader`: where h11's reader is in a chunked body (h11's private state, read and set
  without a patch: `fixes.trailers`, the splice's direct reads), the one module that touches it;
- `rewrite`: not mitmproxy's; the command rewriting the layer wraps share.
- `users`: not mitmproxy's; who asked for a patch that several addons share.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType

from . import chunk_reader, connections, error_texts, layer_events, pins
from .fixes import (
    answer_on_head,
    ca_at_start,
    client_resets,
    eager_connects,
    error_replies,
    happy_eyeballs,
    head_limit,
    inherited_listeners,
    interim_answers,
    resend,
    stream_resets,
    trailers,
    upstream_copy,
    web_options,
    websocket_limits,
    websocket_text,
)
from .speed import (
    ca_once,
    early_connects,
    hedge,
    hook_plans,
    listen_backlog,
    message_checks,
    splice,
    upstream_pool,
    upstream_tls_warmup,
    websocket_frames,
)

logger = logging.getLogger(__name__)

FIXES: tuple[ModuleType, ...] = (
    error_replies,
    eager_connects,
    answer_on_head,
    head_limit,
    upstream_copy,
    trailers,
    interim_answers,
    client_resets,
    stream_resets,
    resend,
    web_options,
    websocket_limits,
    websocket_text,
    inherited_listeners,
    ca_at_start,
    happy_eyeballs,
)
SPEED: tuple[ModuleType, ...] = (
    splice,
    hook_plans,
    message_checks,
    listen_backlog,
    ca_once,
    upstream_tls_warmup,
    upstream_pool,
    early_connects,
    websocket_frames,
    hedge,
)
READS: tuple[ModuleType, ...] = (connections, error_texts, chunk_reader)
"""mitmproxy's private code the relay reads without a patch: pinned, required as a fix is."""
MODULES: tuple[ModuleType, ...] = (*FIXES, *SPEED, layer_events, *READS)
"""Every pinned module; those with `ORIGINALS` replace mitmproxy functions."""


def originals() -> dict[tuple[type | ModuleType, str], Callable]:
    """Every mitmproxy function some patch replaces, by (owner, attribute name)."""
    return {key: original for module in MODULES for key, original in getattr(module, "ORIGINALS", {}).items()}


def patched() -> list[str]:
    """The mitmproxy functions replaced right now, as `Owner.name`. Read from each owner's
    own namespace: `splice` sets an attribute Http1Client otherwise inherits (from a class
    another patch may wrap)."""
    return [f"{owner.__name__}.{name}" for (owner, name), original in originals().items()
            if vars(owner).get(name, original) is not original]


def uninstall_all() -> None:
    """mitmproxy's own code back everywhere, and every patch's state reset."""
    for module in MODULES:
        if (uninstall := getattr(module, "uninstall", None)) is not None:
            uninstall()


class Check:
    """The installed mitmproxy checked against every patch's pins as the relay loads (pins.py):
    a fix or read whose pinned code changed stops the start, with the mitmproxy to install; the
    speed patches off, in one line, on any mitmproxy but the one they were written against.
    First in relay.py's list: before any addon installs a patch, and before it declares
    `relay_speed_patches`, which the others read."""

    def load(self, loader) -> None:
        loader.add_option(
            pins.SPEED_OPTION, bool, True,
            "Use the relay's speed patches into mitmproxy (ttft_relay/patches/speed/: the splice and its "
            "direct reads, hook plans, message checks, the listen backlog, the warm start, early upstream "
            "connects, the upstream pool): the same bytes and records with less CPU per request. Whatever "
            f"this says they stay off on any mitmproxy but {pins.MITMPROXY}.",
        )
        for module in (*FIXES, *READS):
            pins.on(module)
        pins.say_speed_off(SPEED)
        if pins.installed_version() == pins.MITMPROXY and all(pins.problem(m) is None for m in MODULES):
            logger.debug("mitmproxy %s: every pin of the relay's %d fixes and %d speed patches holds",
                         pins.MITMPROXY, len(FIXES), len(SPEED))
