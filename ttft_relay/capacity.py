"""Capacity of one relay process: what it costs mitmproxy to take a burst of streams.

mitmproxy runs on one core, so under a burst the relay itself becomes the slow hop.
Several things about mitmproxy make that worse than it has to be, and the relay changes
them, most with a speed patch (`patches/speed/`, pinned to mitmproxy 12.3.1 and off on any
other, `relay_speed_patches`):

- `WorkerListeners`: a worker of `ttft-relay run --workers N` accepts from the
  listening sockets its supervisor bound (`patches/fixes/inherited_listeners.py`) only once
  the relay runs, never before its addons are loaded and configured.
- `ListenBacklog`: mitmproxy listens with asyncio's fixed backlog of 100. When a
  burst of clients connects while the event loop is busy (it is, during a burst),
  the kernel drops the connections beyond 100, and each dropped client retries its
  SYN after 1 s, then 3 s: a first token seconds late that no phase of the flow
  shows, because the flow starts only when the connection is accepted.
- `ConnectionLog`: mitmproxy logs four or five lines per flow at INFO (client
  connect, server connect, "Streaming response from …", both disconnects), each a
  log record through every handler and an `add_log` event; under load that was
  ~5 % of the relay's CPU (py-spy, bench-streams). Off by default: the relay's
  own line and record per request say more, failures included.
- `WarmStart`: what the first request would pay for on first use, done while the
  relay loads (before its listeners accept): the upstream TLS context with its CA
  bundle, and a first name lookup of each reverse-mode upstream, which loads the
  system's resolver libraries (~40 ms that the first request's upstream connect
  showed; waited for up to RESOLVE_WAIT_S), and the thread that asyncio's name lookups
  run in (`loop.getaddrinfo`, the dialer's, `dial.py`) started once the loop runs, not by
  the first request's connect; and mitmproxy's second loading of
  its CA after the listeners are up, skipped (`ca_once.load_ca_once`); and a CA mitmproxy
  would load only once its listeners are up, loaded before (`fixes.ca_at_start`: a request
  arriving in between stopped mitmproxy).
- `MessageChecks`: mitmproxy checks every field of each request and response it builds
  against its type annotation, as dearly as it parses the head; the relay checks the
  same from classes kept per field (`patches/speed/message_checks.py`).
- `HookPlans`: mitmproxy walks its whole addon tree for every event of every flow,
  whether or not any addon implements the hook; the relay dispatches from a plan
  per hook name instead, which cuts the CPU each streamed flow costs.
- `GcTuning`: Python's collector scans a generation's every object each time it collects
  it, and its oldest generation holds the whole start-up heap (mitmproxy, the tokenizers'
  tables, the relay's modules: hundreds of thousands of objects). A heap grown by many
  live flows triggers such a full collection now and then, a pause of the whole process
  in which every live stream stalls at once (90-175 ms seen at ~100-125 live streams).
  Once the relay runs, the start-up heap is moved to the collector's permanent
  generation (`gc.freeze`), which it never scans: a full collection scans what the
  live flows hold (`relay_gc_freeze`); `relay_gc_threshold` sets how often the youngest
  generation is collected. The pauses are in the records (`gc_pause_ms`) and the
  metrics (`selfwatch.GcPauses`).
- `upstream_pool.UpstreamPool`: mitmproxy opens upstream connections per client connection;
  the relay keeps them across client connections, so a new client connection takes an
  open one instead of a connect and a TLS handshake (first token: one or two round
  trips to the upstream sooner; CPU: no handshake per client connection).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
from typing import Any

from mitmproxy import ctx, exceptions
from mitmproxy.proxy import mode_specs

from .patches import pins
from .patches.fixes import ca_at_start, inherited_listeners
from .patches.speed import ca_once, hook_plans, listen_backlog, message_checks, upstream_tls_warmup

logger = logging.getLogger(__name__)

CONNECTION_LOGGER = "mitmproxy.proxy.server"
"""Where mitmproxy logs connections opening and closing (and the layers' own notes)."""

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
        if "relay_listen_backlog" in updated and not 0 <= ctx.options.relay_listen_backlog <= MAX_BACKLOG:
            raise exceptions.OptionsError(f"relay_listen_backlog must be between 0 and {MAX_BACKLOG}")
        if updated & {"relay_listen_backlog", pins.SPEED_OPTION}:
            self._apply()

    def running(self) -> None:
        # mitmdump may load this script while its first listeners are still starting;
        # by `running` they all listen.
        self._apply()
        if listen_backlog.installed():
            logger.debug("the running listeners queue up to %s new connections",
                         ctx.options.relay_listen_backlog or listen_backlog.ASYNCIO_DEFAULT_BACKLOG)

    def done(self) -> None:
        listen_backlog.set_listen_backlog(0)

    def _apply(self) -> None:
        if not pins.on(listen_backlog):
            listen_backlog.uninstall()  # listeners running keep what they were given
            return
        proxyserver = ctx.master.addons.get("proxyserver")
        listen_backlog.set_listen_backlog(ctx.options.relay_listen_backlog, proxyserver.servers if proxyserver else ())


class WorkerListeners:
    """In a worker (ttft_relay/workers.py), the listeners the supervisor bound accept once
    the relay runs; elsewhere nothing. The worker installed `inherited_listeners` before
    mitmproxy bound its listeners (before any addon loads); this removes it."""

    def running(self) -> None:
        inherited_listeners.serve_after_startup()

    def done(self) -> None:
        inherited_listeners.uninstall()


class ConnectionLog:
    """mitmproxy's per-connection INFO lines only with `relay_connection_log`."""

    def load(self, loader) -> None:
        loader.add_option(
            "relay_connection_log",
            bool,
            False,
            "Log mitmproxy's per-connection lines (client/server connect and disconnect, "
            "'Streaming response from ...'). Off: only their warnings and errors; the relay's "
            "own line per request remains.",
        )

    def configure(self, updated: set[str]) -> None:
        if "relay_connection_log" in updated:
            level = logging.NOTSET if ctx.options.relay_connection_log else logging.WARNING
            logging.getLogger(CONNECTION_LOGGER).setLevel(level)

    def done(self) -> None:
        logging.getLogger(CONNECTION_LOGGER).setLevel(logging.NOTSET)


WARM_TLS_OPTIONS = frozenset({
    "tls_version_server_min", "tls_version_server_max", "ciphers_server", "tls_ecdh_curve_server", "ssl_insecure",
    "ssl_verify_upstream_trusted_confdir", "ssl_verify_upstream_trusted_ca",
})


RESOLVE_WAIT_S = 0.5
"""How long the start waits for the upstreams' first name lookup."""


def _tlsconfig() -> Any:
    """mitmproxy's TlsConfig addon, or None where no master runs (the worker supervisor
    declares the options of every addon without one)."""
    master = getattr(ctx, "master", None)
    return master.addons.get("tlsconfig") if master is not None else None


class WarmStart:
    """The first request pays no first-use cost upstream (see the module docstring)."""

    def load(self, loader) -> None:
        if pins.on(ca_at_start):
            ca_at_start.load(_tlsconfig())
        ca_once.load_ca_once(_tlsconfig(), on=pins.on(ca_once))

    def running(self) -> None:
        # The default executor and its first thread, where the upstream connects' lookups run.
        asyncio.get_running_loop().run_in_executor(None, _nothing)

    def done(self) -> None:
        ca_once.load_ca_once(_tlsconfig(), on=False)

    def configure(self, updated: set[str]) -> None:
        if pins.SPEED_OPTION in updated:
            ca_once.load_ca_once(_tlsconfig(), on=pins.on(ca_once))
        if updated & {*WARM_TLS_OPTIONS, pins.SPEED_OPTION} and pins.on(upstream_tls_warmup):
            try:
                upstream_tls_warmup.warm_upstream_tls(ctx.options)
            except Exception as e:  # a bad CA option: mitmproxy reports it at the handshake
                logger.debug("upstream TLS context not prepared: %s", e)
        if "mode" in updated:
            self._resolve_upstreams()

    def _resolve_upstreams(self) -> None:
        upstreams = []
        for spec in ctx.options.mode:
            try:
                mode = mode_specs.ProxyMode.parse(spec)
            except ValueError:
                continue  # mitmproxy says what is wrong with it
            if isinstance(mode, mode_specs.ReverseMode):
                upstreams.append(mode.address)
        if not upstreams:
            return
        # Off the event loop, and waited for a bounded time: a first request right after
        # start would otherwise queue behind this lookup; a hanging resolver must not hold
        # the start.
        def resolve_all() -> None:
            for address in upstreams:
                _resolve(*address)

        lookups = threading.Thread(target=resolve_all, name="ttft-relay-warm-dns", daemon=True)
        lookups.start()
        lookups.join(RESOLVE_WAIT_S)


def _nothing() -> None:
    pass


def _resolve(host: str, port: int) -> None:
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:  # the connect will say so; this is only a warm-up
        logger.debug("resolving %s ahead of the first request: %s", host, e)


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
        if updated & {"relay_hook_plans", pins.SPEED_OPTION}:
            on = ctx.options.relay_hook_plans and pins.on(hook_plans)
            hook_plans.install_hook_plans(on)
            logger.debug("events dispatched %s", "from hook plans" if on else "by mitmproxy")
        else:
            # Any option change may change the addon tree (scripts added, reordered).
            hook_plans.forget_hook_plans()

    def done(self) -> None:
        hook_plans.install_hook_plans(False)


class MessageChecks:
    """Each request's and response's field types checked as mitmproxy does, for less (`message_checks`)."""

    def load(self, loader) -> None:
        message_checks.install_message_checks(pins.on(message_checks))

    def configure(self, updated: set[str]) -> None:
        if pins.SPEED_OPTION in updated:
            message_checks.install_message_checks(pins.on(message_checks))

    def done(self) -> None:
        message_checks.install_message_checks(False)


class GcTuning:
    """Once the relay runs, the collector no longer scans the start-up heap (`relay_gc_freeze`);
    its youngest generation is collected every `relay_gc_threshold` allocations."""

    def __init__(self) -> None:
        self.started = False
        self.python_threshold = gc.get_threshold()

    def load(self, loader) -> None:
        loader.add_option(
            "relay_gc_freeze",
            bool,
            True,
            "Once the relay runs, move the start-up heap (mitmproxy, the tokenizers, the relay) out of "
            "the garbage collector's reach (gc.freeze): its full collections, a pause of every live stream, "
            "scan only what the live flows hold.",
        )
        loader.add_option(
            "relay_gc_threshold",
            int,
            0,
            "Collect the garbage collector's youngest generation every this many allocations (the "
            "older ones follow from it): fewer collections, fewer short-lived objects kept into the older "
            "generations whose collections pause every live stream. 0 keeps Python's.",
        )

    def configure(self, updated: set[str]) -> None:
        if "relay_gc_threshold" in updated:
            if ctx.options.relay_gc_threshold < 0:
                raise exceptions.OptionsError("relay_gc_threshold must be 0 (Python's) or more")
            if self.started:
                self._apply()
        elif "relay_gc_freeze" in updated and self.started:
            self._apply()

    def running(self) -> None:
        self.started = True
        self._apply()

    def done(self) -> None:
        gc.unfreeze()
        gc.set_threshold(*self.python_threshold)

    def _apply(self) -> None:
        threshold = ctx.options.relay_gc_threshold or self.python_threshold[0]
        gc.set_threshold(threshold, *self.python_threshold[1:])
        if ctx.options.relay_gc_freeze:
            gc.freeze()
            logger.debug("the collector leaves the %d objects of the start-up heap alone", gc.get_freeze_count())
        else:
            gc.unfreeze()

