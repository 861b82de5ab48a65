"""ttft-relay's addons for any mitmproxy tool, from a checkout:

    mitmdump -s addons/relay.py --listen-host 127.0.0.1 [mitmdump arguments]
    mitmweb  -s addons/relay.py --listen-host 127.0.0.1 [mitmweb arguments]

The same addons, in the same order, as `ttft-relay run` loads (ttft_relay/relay.py, which
composes them; the code lives in the package `ttft_relay/`). Loaded this way the relay
reads no mitm.conf and mitmproxy keeps its own defaults: its one listener, a regular
proxy on 8080, and, without `--listen-host 127.0.0.1`, on every interface, which the relay
refuses to serve without authentication. `scripts/relay` (= `ttft-relay run`) is the
relay with mitm.conf's listeners.
"""

import runpy
from pathlib import Path

# Run as mitmproxy runs a script, afresh at each (re)load: new addon objects every time.
addons = runpy.run_path(str(Path(__file__).resolve().parent.parent / "ttft_relay" / "relay.py"))["addons"]
