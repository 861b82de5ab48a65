"""relay.py's addon order, as its docstring states it, checked on the real list the relay loads."""

from __future__ import annotations

import pytest

from ttft_relay import config, relay, scope
from ttft_relay.faults import faults
from ttft_relay.guard import guard, tls
from ttft_relay.observe import attempts, traces, verdicts
from ttft_relay.stream import frames, streaming, websocket
from ttft_relay.observe import ledger, selfwatch
from ttft_relay.timing import timing
from ttft_relay.trim import trim

ORDER = [type(addon) for addon in relay.addons]

BEFORE = [
    (tls.ClientTLS, guard.Guard, "tls refuses plain HTTP before guard looks at a key"),
    *((scope.Scope, later, "scope attaches the per-flow state the others read")
      for later in (streaming.Streaming, trim.Trim, faults.Shutdown, faults.FailedConnects, faults.Deadlines,
                    selfwatch.SelfWatch, websocket.WebSocketTurns, timing.Timing, faults.ErrorReplies,
                    traces.Traces)),
    (trim.Trim, timing.Timing, "timing's request hook marks the moment the request leaves"),
    (faults.Shutdown, timing.Timing, "timing's done closes the log; Shutdown records what is in flight"),
    (websocket.WebSocketTurns, timing.Timing, "timing's done closes the log; the turns in flight are recorded"),
    (faults.FailedConnects, timing.Timing, "a failed connect's marks are on the flow when timing writes its record"),
    (faults.Deadlines, timing.Timing, "a deadline's status is recorded when timing writes the record"),
    (guard.Guard, timing.Timing, "a refused key is the flow's error when timing writes the record"),
    (streaming.Streaming, selfwatch.SelfWatch, "selfwatch hooks the stream tap"),
    (selfwatch.SelfWatch, timing.Timing, "timing reads what selfwatch learned"),
    (timing.Timing, ledger.Ledger, "the ledger opens beside the log timing configured, and closes after timing's done"),
    *((timing.Timing, observer, "it reads timing's log option; its done comes after timing's last records")
      for observer in (verdicts.Verdicts, attempts.AttemptGroups)),
]


@pytest.mark.parametrize("first, then, why", BEFORE, ids=[f"{a.__name__}<{b.__name__}" for a, b, _ in BEFORE])
def test_each_addon_comes_before_those_that_need_it(first, then, why):
    assert ORDER.index(first) < ORDER.index(then), why


def test_big_websocket_messages_are_framed_as_they_go_on():
    # After trim, which may change a message or drop it; before the turns' addon, which may drop the
    # messages kept (the newest too, with relay_websocket_messages=0), and changes none.
    hooked = [type(addon) for addon in relay.addons if hasattr(addon, "websocket_message")]
    assert hooked == [trim.Trim, frames.WebSocketFrames, websocket.WebSocketTurns]


def test_the_options_check_comes_last_and_each_addon_once():
    assert ORDER[-1] is config.OptionsCheck  # a relay whose options do not parse does not start
    assert len(set(ORDER)) == len(ORDER)
