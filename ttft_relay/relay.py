"""ttft-relay: an LLM API relay that streams, times and trims.

`ttft-relay run` loads it into mitmdump with mitm.conf merged into the command line
(ttft_relay/config.py); `mitmdump -s ttft_relay/relay.py` loads the addons alone. This
file only composes the addons; each concern lives in its own module under `ttft_relay/`:

    patches    the installed mitmproxy checked against the pins of the relay's patches into it
               (patches/fixes/, patches/speed/): a fix that cannot hold stops the start, the
               speed patches stay off on any mitmproxy but the one they were written against
    faults.StopFirst  a clean stop ends the flows in flight before any other addon's `done`
    capacity   a burst of streams: connections queued, cheaper hook dispatch
    tls        listeners that accept only TLS (the user's certificate), plain HTTP refused
    guard      no open proxy, relay access keys, credentials redacted
    reload     SIGHUP: timing log reopened, certificates and key files re-read
    scope      which flows are LLM API calls, and which API shape
    streaming  every response chunk to the client as it arrives
    trim       oversized message histories cut to a token budget
    groups     a listener's upstream group: the member expected to give the first token soonest
               (cache-aware), failover to the next before the answer's head
    dial       upstream connects race the name's addresses (RFC 8305 Happy Eyeballs)
    faults     bounded waits, and upstream failures answered in the API's format
    selfwatch  the relay's own event-loop lag, accept queues and sockets
    timing     per-phase marks, one record per flow, judged once and frozen
    observe    what timing's observers learn across records for its verdict: the first token
               each prompt predicts (learned per upstream · model · prefill traits, shared by
               the workers; prompt cache misses), attempt groups of retried requests
    ledger     the requests in flight, so that those a dead process took are recorded by the next
    websocket  one record per turn of a Responses / Realtime WebSocket
    metrics    the records as Prometheus metrics (from timing's timing_record hook)
    traces     the records as OpenTelemetry traces over OTLP, trace context passed upstream (off by default)
    sseview    an event-stream view for mitmweb
    webcolumns the timing comment as a column of mitmweb's flow list
    config.OptionsCheck  a relay whose options do not parse does not start (last)

The order matters (tests/test_addon_order.py checks it on `addons`, and test_hooks_fuzz
runs its hooks in it): patches.Check comes first, before any addon installs a patch (each
addon installs the patches it uses in `load`, `configure` or `running`, and removes them
in its `done`); faults.StopFirst's `done` comes before every other, so the flows in flight
end while every addon still runs; tls refuses plain HTTP before guard looks at a key; scope attaches
the per-flow state the others read, and timing comes after trim so its `request` hook
marks the moment the request leaves.
faults.Shutdown and websocket come before timing too: timing's `done` closes the log,
and theirs record what is still in flight.
The faults addons that touch a failed flow's marks and state (FailedConnects,
Deadlines) come before timing, which writes the record in the same `error` hook.
selfwatch comes after streaming (it hooks the stream tap) and before timing (which
reads what it learned); its samples feed the metrics addon. The observe addons come after
timing: they read its log option, and their `done` keeps what the records timing's `done`
publishes taught them. ledger comes after timing:
it opens timing's log's ledger once timing has configured the log, and closes it
after timing's `done` has recorded what was in flight.
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

from ttft_relay import capacity, config, dial, patches, reload, scope
from ttft_relay.faults import faults
from ttft_relay.guard import guard, tls
from ttft_relay.observe import attempts, ledger, metrics, selfwatch, traces, verdicts, webcolumns
from ttft_relay.route import groups
from ttft_relay.stream import sseview, streaming, websocket
from ttft_relay.timing import timing
from ttft_relay.trim import trim

self_watch = selfwatch.SelfWatch()
prometheus = metrics.Metrics()
self_watch.subscribe(prometheus.load_sample)
otlp_traces = traces.Traces(on_dropped=prometheus.otlp_dropped)

first_tokens = verdicts.Verdicts()
attempt_groups = attempts.AttemptGroups()
# Timing shows each record to these before it judges it (`timing.Observer`).
timings = timing.Timing(observers=(first_tokens, attempt_groups))
shutdown = faults.Shutdown()
addons = [
    patches.Check(),
    faults.StopFirst(shutdown),
    *capacity.addons(),
    tls.ClientTLS(),
    guard.Guard(),
    reload.Reload(),
    scope.Scope(),
    streaming.Streaming(),
    trim.Trim(),
    groups.UpstreamGroups(first_tokens),
    shutdown,
    dial.HappyEyeballs(),
    faults.FailedConnects(),
    faults.Deadlines(),
    self_watch,
    websocket.WebSocketTurns(timings, self_watch),
    timings,
    first_tokens,
    attempt_groups,
    ledger.Ledger(timings),
    faults.ErrorReplies(),
    prometheus,
    otlp_traces,
    sseview.SSEView(),
    webcolumns.CommentColumn(),
    config.OptionsCheck(),
]
