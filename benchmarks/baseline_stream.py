"""Benchmark baseline: the least a mitmproxy script can do to stream, and nothing else.

`mitmdump -s benchmarks/baseline_stream.py` is what the relay's own overhead is
measured against: every response streamed, no scope, timing or trimming.
"""

from mitmproxy import http


def responseheaders(flow: http.HTTPFlow) -> None:
    flow.response.stream = True
