"""ttft-relay: an LLM API relay that streams, times and trims.

`ttft-relay run` loads it into mitmdump with mitm.conf merged into the command line
(ttft_relay/config.py); `mitmdump -s ttft_relay/relay.py` loads the addons alone. This
file only composes them: `addons` below is every addon of the relay, one a line, in the
order mitmproxy runs their hooks, each with what it is for (as mitmproxy's own
`default_addons()`); each concern lives in its own module under `ttft_relay/`.

The order matters. tests/test_addon_order.py reads each rule below from here and checks it
on `addons`; test_hooks_fuzz runs the hooks in this order.

    patches.Check first: it checks the installed mitmproxy against the pins before any
        addon installs a patch (each installs those it uses in `load`, `configure` or
        `running`, and removes them in its `done`), and declares `relay_speed_patches`,
        which the others read
    faults.StopFirst right after patches.Check: its `done` comes before every other
        addon's, so the flows in flight end while every addon still runs
    tls.ClientTLS before keys.AccessKeys: plain HTTP is refused before a key is looked at
    hygiene.FieldSyntax before keys.AccessKeys: a head refused for its fields is answered
        before its key is checked (AccessKeys leaves an answered flow alone)
    hygiene.FieldSyntax and keys.AccessKeys before timing.Timing: a refused head is the
        flow's error when timing writes the record
    redaction.SecretRedaction before timing.Timing: in the `error` hook they share, the
        flow's error message is redacted before the record takes it
    scope.Scope before streaming.Streaming, trim.Trim, groups.UpstreamGroups, faults.Shutdown,
        faults.FailedConnects, faults.Deadlines, selfwatch.SelfWatch,
        websocket.WebSocketTurns, timing.Timing, faults.ErrorReplies and traces.Traces:
        scope attaches the per-flow state the others read
    trim.Trim before timing.Timing: timing's `request` hook marks the moment the request
        leaves
    trim.Trim before groups.UpstreamGroups: the member is chosen for the prompt trim sends
        (its tokens counted then)
    trim.Trim before frames.WebSocketFrames: trim may change a WebSocket message or drop it
        before it is framed for its way on
    frames.WebSocketFrames before websocket.WebSocketTurns: the turns' addon may drop the
        messages kept (the newest too, with relay_websocket_messages=0), and changes none
    faults.Shutdown and websocket.WebSocketTurns before timing.Timing: timing's `done`
        closes the log, theirs record what is still in flight
    faults.FailedConnects and faults.Deadlines before timing.Timing: they touch a failed
        flow's marks and state, and timing writes the record in the same `error` hook
    streaming.Streaming before selfwatch.SelfWatch: selfwatch hooks the stream tap
    selfwatch.SelfWatch before timing.Timing: timing reads what it learned (its samples
        feed the metrics addon)
    timing.Timing before verdicts.Verdicts and attempts.AttemptGroups: they read its log
        option, and their `done` keeps what the records timing's `done` publishes taught
        them
    timing.Timing before ledger.Ledger: the ledger opens beside timing's log once timing
        has configured it, and closes after timing's `done` has recorded what was in flight
    config.RenamedOptions before config.OptionsCheck: the old names must be declared
        when OptionsCheck applies the deferred values
    config.OptionsCheck last: a relay whose options do not parse does not start
"""

import sys
from pathlib import Path

# mitmproxy's script loader imports this file as a top-level module named "relay";
# the addons themselves are imported from the package `ttft_relay` (the directory above
# this file, installed or a checkout), the same names the tests use, so there is one
# copy of each module (and of its state) per process.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from ttft_relay import capacity, config, dial, patches, reload, scope, tls_resumption, upstream_pool
# faults/, timing/ and trim/ keep their addons in addons.py / addon.py, imported here under the
# package's name: the list and the rules above read `faults.Shutdown`, `timing.Timing`, `trim.Trim`.
from ttft_relay.faults import addons as faults
from ttft_relay.guard import exposure, hygiene, keys, limits, redaction, tls
from ttft_relay.observe import attempts, ledger, metrics, selfwatch, traces, verdicts, webcolumns
from ttft_relay.route import groups
from ttft_relay.stream import frames, sseview, streaming, websocket
from ttft_relay.timing import addon as timing
from ttft_relay.trim import addon as trim

self_watch = selfwatch.SelfWatch()
prometheus = metrics.Metrics()
self_watch.subscribe(prometheus.load_sample)
otlp_traces = traces.Traces(on_dropped=prometheus.otlp_dropped)

first_tokens = verdicts.Verdicts()
attempt_groups = attempts.AttemptGroups()
# Timing shows each record to these before it judges it (`timing.Observer`).
timings = timing.Timing(observers=(first_tokens, attempt_groups))
shutdown = faults.Shutdown()
secret_redaction = redaction.SecretRedaction()
addons = [
    patches.Check(),  # mitmproxy checked against the patches' pins: a fix that cannot hold stops the start
    faults.StopFirst(shutdown),  # a clean stop ends the flows in flight before any other addon's `done`
    # capacity: what a burst of streams costs mitmproxy
    capacity.ListenBacklog(),  # each listener queues relay_listen_backlog new connections (mitmproxy's: 100)
    capacity.WorkerListeners(),  # a worker accepts on its supervisor's sockets once the relay runs
    capacity.HookPlans(),  # events dispatched from a plan per hook name, not a walk of every addon
    capacity.MessageChecks(),  # each message's field types checked as mitmproxy checks them, for less
    capacity.ConnectionLog(),  # mitmproxy's per-connection INFO lines only with relay_connection_log
    capacity.WarmStart(),  # the upstream TLS context, name lookups and the CA ready before the first request
    capacity.GcTuning(),  # the start-up heap out of the collector's reach once the relay runs (gc.freeze)
    upstream_pool.UpstreamPool(),  # upstream connections kept across client connections (relay_upstream_pool)
    # guard: who may use the relay, and where its secrets may go
    tls.ClientTLS(),  # listeners that accept only TLS (the user's certificate), plain HTTP refused
    redaction.LogRedaction(),  # every log line redacted, escaped and capped, mitmproxy's own included
    exposure.Exposure(),  # no start as an open proxy: authentication and TLS off loopback
    limits.ClientLimits(),  # before authentication: a head deadline, bounded connections and HTTP/2 resets
    limits.WebSocketLimits(),  # WebSocket messages of bounded size, fragments and control frames
    hygiene.FieldSyntax(),  # no CR, LF or NUL in a header value, no unknown HTTP version
    hygiene.OriginForm(),  # reverse listeners send the upstream's origin-form target
    hygiene.RequestFraming(),  # an HTTP/2 request body goes to an HTTP/1 upstream with its length
    keys.AccessKeys(),  # relay access keys checked on the head, the upstream key swapped into what is sent
    secret_redaction,  # credentials redacted in each flow once its request has gone upstream
    redaction.WebOptions(secret_redaction),  # mitmweb shows the options' secrets and flows in flight redacted
    reload.Reload(),  # SIGHUP: timing log reopened, certificates and key files re-read
    # each flow: what it is, passed on as it arrives, trimmed, bounded
    scope.Scope(),  # which flows are LLM API calls: their API, model and stream flag, on the flow's state
    streaming.Streaming(),  # every response chunk to the client as it arrives
    trim.Trim(),  # oversized message histories cut to a token budget
    groups.UpstreamGroups(first_tokens),  # a listener's upstream group: the member expected soonest, failover before the head
    shutdown,  # a clean stop: the flows in flight finished, or answered and recorded
    dial.HappyEyeballs(),  # upstream connects race the name's addresses (RFC 8305)
    tls_resumption.TlsResumption(),  # upstream TLS handshakes resume the upstream's last session
    faults.FailedConnects(),  # a failed upstream connect's marks on the flow that waited for it
    faults.Deadlines(),  # bounded waits: connect, response head, first token, idle
    # what the relay saw: marks, records and what they teach
    self_watch,  # the relay's own event-loop lag, accept queues and sockets
    frames.WebSocketFrames(),  # a big WebSocket message framed in a thread of its own for its way on
    websocket.WebSocketTurns(timings, self_watch),  # one record per turn of a Responses / Realtime WebSocket
    timings,  # per-phase marks, one record per flow, judged once and frozen
    first_tokens,  # timing's observer: the first token each prompt predicts, prompt cache misses
    attempt_groups,  # timing's observer: a retried request grouped with its first attempt
    ledger.Ledger(timings),  # the requests in flight: those a dead process took are recorded by the next
    faults.ErrorReplies(),  # upstream failures answered in the API's error format
    prometheus,  # the records as Prometheus metrics (timing's timing_record hook)
    otlp_traces,  # the records as OpenTelemetry traces over OTLP, trace context passed upstream (off by default)
    sseview.SSEView(),  # an event-stream view for mitmweb
    webcolumns.CommentColumn(),  # the timing comment as a column of mitmweb's flow list
    config.RenamedOptions(),  # options renamed since the last release accepted under their old names
    config.OptionsCheck(),  # a relay whose options do not parse does not start
]
