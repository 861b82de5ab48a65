"""Capacity of one relay process: what it costs mitmproxy to take a burst of streams.

mitmproxy runs on one core, so under a burst the relay itself becomes the slow hop.
Two things about mitmproxy make that worse than it has to be, and the relay changes
both (the patches live in `seams.py`, pinned to mitmproxy 12.3.1):

- `ListenBacklog`: mitmproxy listens with asyncio's fixed backlog of 100. When a
  burst of clients connects while the event loop is busy (it is, during a burst),
  the kernel drops the connections beyond 100, and each dropped client retries its
  SYN after 1 s, then 3 s: a first token seconds late that no phase of the flow
  shows, because the flow starts only when the connection is accepted.
- `HookPlans`: mitmproxy walks its whole addon tree for every event of every flow,
  whether or not any addon implements the hook; the relay dispatches from a plan
  per hook name instead, which cuts the CPU each streamed flow costs.
"""

from __future__ import annotations

import logging

from mitmproxy import ctx, exceptions

from . import seams

logger = logging.getLogger(__name__)

MAX_BACKLOG = 65535
"""Beyond any net.core.somaxconn in use; the kernel caps the backlog there anyway."""


class ListenBacklog:
    """Every TCP listener queues `relay_listen_backlog` new connections."""

    def load(self, loader) -> None:
        loader.add_option(
            "relay_listen_backlog",
            int,
            4096,
            "How many new connections each listener lets the kernel queue while the relay is busy "
            "(capped by net.core.somaxconn). mitmproxy's own is 100; beyond it, clients of a burst "
            "wait 1-3 s for a SYN retransmit. 0 keeps mitmproxy's.",
        )

    def configure(self, updated: set[str]) -> None:
        if "relay_listen_backlog" in updated:
            if not 0 <= ctx.options.relay_listen_backlog <= MAX_BACKLOG:
                raise exceptions.OptionsError(f"relay_listen_backlog must be between 0 and {MAX_BACKLOG}")
            self._apply()

    def running(self) -> None:
        # mitmdump may load this script while its first listeners are still starting;
        # by `running` they all listen.
        self._apply()
        logger.debug("the running listeners queue up to %s new connections",
                     ctx.options.relay_listen_backlog or seams.ASYNCIO_DEFAULT_BACKLOG)

    def done(self) -> None:
        seams.set_listen_backlog(0)

    def _apply(self) -> None:
        proxyserver = ctx.master.addons.get("proxyserver")
        seams.set_listen_backlog(ctx.options.relay_listen_backlog, proxyserver.servers if proxyserver else ())


class HookPlans:
    """mitmproxy's events dispatched from a plan per hook name (`relay_hook_plans`)."""

    def load(self, loader) -> None:
        loader.add_option(
            "relay_hook_plans",
            bool,
            True,
            "Dispatch mitmproxy's events from a plan per hook name instead of walking every addon "
            "for every event (same order and error handling; less CPU per flow). Off: mitmproxy's "
            "own dispatch.",
        )

    def configure(self, updated: set[str]) -> None:
        if "relay_hook_plans" in updated:
            seams.install_hook_plans(ctx.options.relay_hook_plans)
            logger.debug("events dispatched %s", "from hook plans" if ctx.options.relay_hook_plans else "by mitmproxy")
        else:
            # Any option change may change the addon tree (scripts added, reordered).
            seams.forget_hook_plans()

    def done(self) -> None:
        seams.install_hook_plans(False)
