"""The relay's patches into mitmproxy 12.3.1, for what hooks cannot shape: every one named here.

mitmproxy is pinned ==12.3.1 (requirements.txt). Each module below says what it patches
and why; its pin test, `tests/patches/test_<module>.py`, holds the digests of the
mitmproxy code it patches or relies on and fails loudly if that code changes shape.
Everything else the relay does uses hooks.

Patches (each replaces mitmproxy functions, listed in its `ORIGINALS`, and has an
`uninstall()` that gives them back), with the addon that installs each:

- `error_replies`: upstream failures reach the client in the API's error format
  (`faults.ErrorReplies`).
- `eager_connects`: a reverse proxy's failed eager connect is answered, not a bare
  close (with `error_replies`); no eager connect before a relay key is checked
  (`guard.AccessKeys`).
- `answer_on_head`: a request refused on its head is answered without reading its body
  (`guard.AccessKeys`, `faults.Shutdown`).
- `head_limit`: an HTTP/1 request head that never ends gets a 431 (`guard.ClientLimits`).
- `upstream_copy`: the upstream key goes out in a copy of the request, never into the flow
  (`guard.AccessKeys`).
- `trailers`: HTTP/1 trailers fail their flow with an answer instead of crashing
  (`faults.ErrorReplies`).
- `listen_backlog`: listeners queue more than 100 new connections (`capacity.ListenBacklog`).
- `inherited_listeners`: a worker of `ttft-relay run --workers N` serves the listening
  sockets its supervisor bound, a few connections per turn of its event loop, from the relay's
  `running` on (installed by `workers.worker_main` before mitmproxy starts;
  `capacity.WorkerListeners`).
- `hook_plans`: events dispatched from per-hook plans (`capacity.HookPlans`).
- `interim_answers`: an upstream's 1xx interim head is dropped before its real answer
  (`stream.Streaming`).
- `ca_once`: the CA is not loaded a second time in `running` (`capacity.WarmStart`).
- `client_resets`: an HTTP/2 client's stream reset always reaches its flow, and a client
  resetting streams in a loop gets GOAWAY (`guard.ClientLimits`).
- `layer_events`: events for the HTTP layer: a deadline resets its flow's HTTP/2 upstream
  stream, not the connection its siblings share (`faults.Deadlines`); a keyed listener
  connects upstream once a request's key is accepted, while its body uploads
  (`guard.AccessKeys`).
- `message_checks`: a request's and a response's field types checked as mitmproxy checks
  them, from classes kept per field (`capacity.MessageChecks`).
- `resend`: an answer held for a look before the client gets any of it, and the
  request sent once more in its place (`trim.Trim`: a refusal as too long, trimmed to
  the provider's word).
- `web_options`: mitmweb's option dumps (`GET /options`, its `options/update` messages) show
  the secrets of `proxyauth`, `upstream_auth` and `web_password` redacted (`guard.WebOptions`).
- `upstream_pool`: a reverse listener's upstream connections outlive their client
  connection and are adopted by later ones, TLS included (`pool.UpstreamPool`).
- `splice`: a streamed HTTP/1 response body goes from the upstream's reader to the
  client's framing in one step, not through mitmproxy's per-chunk routing; with direct
  reads, a chunked one (plain TCP or TLS) is read from socket to socket
  below mitmproxy's layers (`stream.Streaming`).
- `websocket_limits`: a WebSocket message's inflated size, its fragments and the control
  frames around it bounded as wsproto reads them, from either side (`guard.WebSocketLimits`).

Private mitmproxy code read but not patched, pinned the same way:

- `connections`: live connections, their sockets and the listeners' (`observe.selfwatch`);
  closing a connection, cancelling a connect (`faults.Deadlines`, `guard.ClientLimits`).
- `error_texts`: mitmproxy's error texts the relay matches (`timing.Timing`, `faults`).
- `upstream_tls_warmup`: the upstream TLS context built at start (`capacity.WarmStart`).
- `rewrite`: not mitmproxy's; the command rewriting the layer wraps share.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from . import (
    answer_on_head,
    ca_once,
    client_resets,
    eager_connects,
    error_replies,
    head_limit,
    hook_plans,
    inherited_listeners,
    interim_answers,
    layer_events,
    listen_backlog,
    message_checks,
    resend,
    splice,
    trailers,
    upstream_copy,
    upstream_pool,
    web_options,
    websocket_limits,
)

PATCHES: tuple[ModuleType, ...] = (
    error_replies,
    eager_connects,
    answer_on_head,
    head_limit,
    upstream_copy,
    trailers,
    listen_backlog,
    inherited_listeners,
    hook_plans,
    interim_answers,
    ca_once,
    client_resets,
    layer_events,
    message_checks,
    resend,
    splice,
    web_options,
    upstream_pool,
    websocket_limits,
)


def originals() -> dict[tuple[type | ModuleType, str], Callable]:
    """Every mitmproxy function some patch replaces, by (owner, attribute name)."""
    return {key: original for patch in PATCHES for key, original in patch.ORIGINALS.items()}


def patched() -> list[str]:
    """The mitmproxy functions replaced right now, as `Owner.name`. Read from each owner's
    own namespace: `splice` sets an attribute Http1Client otherwise inherits (from a class
    another patch may wrap)."""
    return [f"{owner.__name__}.{name}" for (owner, name), original in originals().items()
            if vars(owner).get(name, original) is not original]


def uninstall_all() -> None:
    """mitmproxy's own code back everywhere, and every patch's state reset."""
    for patch in PATCHES:
        patch.uninstall()
