"""Benchmarks: what the relay costs, as ratios against a baseline measured in the same run.

Run from a checkout: `scripts/bench NAME [arguments]` (builds .venv with the test
dependencies on first use) or `ttft-relay bench NAME`; `scripts/bench --help` lists them.
They use the test support in tests/ (fake upstreams, the mitmdump harness); the product
(ttft_relay/) never imports them.
"""
