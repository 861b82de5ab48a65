"""Test support: what ttft-relay's tests/ and benchmarks/ share, shipped with the package.

    fakes/             upstreams that speak the APIs as the real services do (OpenAI, Anthropic,
                       Gemini; HTTP/1.1, HTTP/2, the Responses WebSocket) with knobs for a slow
                       first token, gaps, stalls and failures; clients that never buffer; hostile
                       peers; a proxy that refuses every host; test certificates; far and lossy links
    harness.py         the relay in a real mitmdump (or `ttft-relay run --workers N`) on port 0, its
                       timing log and metrics as a test reads them
    sse_samples.py     the APIs' wire bodies, byte for byte as the services send them
    shaped.py          request bodies shaped as Claude Code and Codex CLI send them, for trimming
    report_samples.py  timing records shaped like a day of traffic
    browser.py         headless Chromium over the DevTools protocol

Why it ships in the wheel (pyproject.toml finds it with the rest of `ttft_relay`): someone who
puts the relay in front of their own clients wants to test that setup the way this project tests
itself, with no API key and no network — `python -m ttft_relay.testing.fakes.upstream --port 0`
is an upstream that streams like the real ones; `FakeUpstream` is the same in a test's own
process. It costs an installation nothing at import time: this module imports nothing, none of
the relay's modules imports this package, and these modules import only the standard library and
the relay's own dependencies (orjson, prometheus-client, and mitmproxy's h2, wsproto and
cryptography) — never pytest or another test-only package. tests/test_package.py proves all
three, the last from an installed copy with no checkout beside it.

What only the suite needs stays in tests/ (pytest fixtures, the coding-agent CLIs' sandbox, the
trace store); what only benchmarks need stays in benchmarks/ (the setups they compare, their
measures). Code here never imports either.
"""
