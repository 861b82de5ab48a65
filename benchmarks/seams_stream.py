"""Benchmark floor on mitmproxy: a bare streaming mitmdump with the relay's seams, nothing watched.

`mitmdump -s benchmarks/seams_stream.py` streams every response as the relay streams
it, through the splice and its direct reads (`ttft_relay/patches/speed/splice.py`), with the
relay's capacity patches (hook plans, message checks, listen backlog, warm start,
connection lines off: `ttft_relay/capacity.py`), but scopes, watches, times, trims and
records nothing. Whatever the relay costs above it is the relay's own work; what it
costs is the least a relay on mitmproxy 12.3 with these seams costs per flow and event.
"""

import sys
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)  # as ttft_relay/relay.py: the checkout's package
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from ttft_relay import capacity, patches, upstream_pool
from ttft_relay.stream import streaming

# Without the relay's scope no flow has its state: Streaming streams every stream and
# watches none (a plain `stream = True`), exactly as for an API the relay does not know.
addons = [
    patches.Check(),
    # relay.py's capacity addons, in its order
    capacity.ListenBacklog(),
    capacity.WorkerListeners(),
    capacity.HookPlans(),
    capacity.MessageChecks(),
    capacity.ConnectionLog(),
    capacity.WarmStart(),
    capacity.GcTuning(),
    upstream_pool.UpstreamPool(),
    streaming.Streaming(),
]
