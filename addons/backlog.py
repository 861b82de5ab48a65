"""Listen backlog: a burst of new connections waits in the kernel's queue, not for SYN retransmits.

mitmproxy accepts on one event loop with asyncio's fixed backlog of 100. When a
burst of clients connects while that loop is busy (it is, during a burst), the
kernel drops the connections beyond 100 and each dropped client retries its SYN
after 1 s, then 3 s: a first token seconds late that no phase of the flow shows,
because the flow starts only when the connection is accepted. This addon gives
every listener a deeper queue (`relay_listen_backlog`), so a burst is served in
arrival order instead.
"""

from __future__ import annotations

import logging

from mitmproxy import ctx, exceptions

from . import seams

logger = logging.getLogger(__name__)


class ListenBacklog:
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
            if ctx.options.relay_listen_backlog < 0:
                raise exceptions.OptionsError("relay_listen_backlog must be 0 or more")
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
