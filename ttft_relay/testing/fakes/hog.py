"""A mitmproxy script that keeps the relay's event loop busy: a saturated relay, on demand.

Loaded beside the relay (`-s ttft_relay/testing/fakes/hog.py`), it burns `TTFT_HOG_MS` of CPU on
the event loop every `TTFT_HOG_EVERY_MS` from `running` on, as a relay would whose
loop is taken by other streams: connections wait in the accept queue and bytes in
socket buffers until the loop comes round.
"""

import asyncio
import os
import time

BUSY_S = float(os.environ.get("TTFT_HOG_MS", "150")) / 1000
EVERY_S = float(os.environ.get("TTFT_HOG_EVERY_MS", "200")) / 1000


def _burn(loop: asyncio.AbstractEventLoop) -> None:
    until = time.perf_counter() + BUSY_S
    while time.perf_counter() < until:
        pass
    loop.call_later(max(0.0, EVERY_S - BUSY_S), _burn, loop)


def running() -> None:
    loop = asyncio.get_running_loop()
    loop.call_soon(_burn, loop)
