"""Reload of the one process (`ttft-relay run`, `--workers 1`): SIGHUP re-reads the files the
relay's options name, without dropping a connection. (Under the supervisor, `scripts/relay`
and `--workers N|auto`, SIGHUP reaches the supervisor only, which replaces its workers with
new ones that read everything, relay.conf included: ttft_relay/workers.py.)

    relay_timing_log    reopened at its path: logrotate renamed the log (its default,
                        copy-less rotation) and the records must go to a new file
    certs               re-read by mitmproxy: a renewed certificate; connections
                        already open keep the TLS session they have
    relay_access_keys   re-read from their file:/env: sources, with relay_upstream_keys

Each is mitmproxy's own mechanism: setting an option again, to the value it has, makes
the addons that own it read it anew (`systemctl reload ttft-relay`, `kill -HUP`,
`docker kill -s HUP`). One at a time, so a broken key file cannot keep the log from
being reopened; a certificate file that cannot serve is refused before mitmproxy sees
it, so the relay keeps presenting the old certificate. Whatever fails is logged and
the relay goes on as it was.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from mitmproxy import ctx, exceptions

from .guard import tls

logger = logging.getLogger(__name__)

RELOADED = (("relay_timing_log",), ("certs",), ("relay_access_keys", "relay_upstream_keys", "relay_upstream_groups"))
"""Options set again on SIGHUP, each group in one update."""


class Reload:
    """SIGHUP → reopen the timing log, re-read certificates and key files."""

    def running(self) -> None:
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload)
        except (NotImplementedError, AttributeError, RuntimeError):  # no SIGHUP here (Windows), or no loop
            pass

    def done(self) -> None:
        try:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        except (NotImplementedError, AttributeError, RuntimeError):
            pass

    def reload(self) -> None:
        opts = ctx.options
        kept: list[str] = []
        for reloaded in RELOADED:
            names = tuple(name for name in reloaded if name in opts)
            if not names:
                continue
            try:
                if "certs" in names:
                    tls.check_certs(opts.certs)  # mitmproxy would drop the old certificate first
                opts.update(**{name: getattr(opts, name) for name in names})
            except exceptions.OptionsError as e:
                logger.error("reload: kept the current %s: %s", ", ".join(names), e)
                kept += names
        if not kept:
            logger.info("reloaded on SIGHUP: timing log reopened, certificates and key files re-read")
