"""ttft-relay: mitmproxy addons that stream, time and trim LLM API traffic.

`ttft_relay/relay.py` is the entry point for `mitmdump -s`; every other module is
imported as `addons.<name>` so tests and mitmproxy's script loader share one copy.
"""

__version__ = "0.2.0"
