"""Addon: trims oversized conversation histories before they go upstream.

The model reads the whole prompt before its first token, so a long history means a slow
first token, a high bill, or a "context length exceeded" error. This addon keeps each
OpenAI chat / Responses and Anthropic Messages request within the model's context window
(minus the output it reserves) where the relay knows that window for certain (`windows`:
learned from the provider, configured by the user, or the API module's table of exact
model ids), or within a smaller budget the user sets: old tool results and arguments
shrunk, then old turns dropped, in cuts that stay put from turn to turn so the
provider's prompt cache keeps hitting (see `policy`). A model whose window it does not
know is not trimmed unless the user set a budget. It fails open: when nothing is
trimmed, or anything goes wrong, the client's exact bytes go upstream. The cuts are
kept beside the timing log (`plans`), so a restarted relay and the other workers cut a
conversation where it was cut. Codex's WebSocket turns (`response.create`) are trimmed
the same way, each put together whole from the socket's conversation (`turns`).

When the upstream refuses a request as too long and its error names the limit (before
any byte of the answer went to the client), the addon asks `windows.judge_refusal` whether
that is the provider's word about this request; if so it learns that window for the
upstream·model (kept beside the timing log, shared by every worker, used by other access
keys once confirmed), trims the request to it and sends it once more
(`patches.fixes.resend`); the client gets only the second answer, streamed, and the record
both attempts (`trim.refused`). An accepted request may confirm or refute a window not yet
confirmed (`windows.judge_accepted`). A WebSocket turn refused so is
sent once more on its socket, the refusal kept from the client.

Counting and trimming run in one worker thread, never on the event loop: a request of
many megabytes is counted while every other flow keeps streaming (the hook awaits the
worker). The store of what trimming learns (`ttft_relay.store`: windows, plans) is read
and written there too. The tokenizers are
loaded when the script is configured, before mitmproxy's listeners accept the first
connection.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
from mitmproxy import addonmanager, ctx, exceptions, http
from mitmproxy.websocket import WebSocketMessage

from .. import state, store
from ..patches import pins
from ..patches.fixes import resend, websocket_text
from ..apis.api import Api, TooLong, Windows
from ..flows import client_key, upstream_name
from . import plans, policy, tokens, turns, windows

logger = logging.getLogger(__name__)

HEADER = "X-Relay-Trim"
"""Response header telling the client what was trimmed; value: `policy.summary`."""


INLINE_MAX_BYTES = 1024
"""A request body up to this size (not compressed) is counted and trimmed on the event
loop when the worker thread is idle: that takes 20-120 us, less than handing it to the
thread and back costs the relay (80-100 us of CPU, two thread wake-ups and one more
pass of the event loop, measured on 2 cores)."""


REFUSAL_MAX_BYTES = 64 * 1024
"""An error answer up to this size (by its Content-Length) is read whole, for a look at it
before the client gets it; longer or unframed ones pass as they come."""
REFUSAL_STATUSES = frozenset({400, 413})


def _small(request: http.Request) -> bool:
    raw = request.raw_content
    return raw is not None and len(raw) <= INLINE_MAX_BYTES and "content-encoding" not in request.headers


def _readable(response: http.Response) -> bool:
    """An answer small enough to read whole before the client gets it: a Content-Length
    within REFUSAL_MAX_BYTES (a refusal is a small JSON object)."""
    length = response.headers.get("content-length", "")
    return length.isdigit() and int(length) <= REFUSAL_MAX_BYTES and "transfer-encoding" not in response.headers


class Trim:
    """Brings oversized chat requests within their token budget before they go upstream.

    Options: relay_trim, relay_trim_max_tokens, relay_trim_reserve_tokens, relay_trim_notice,
    relay_trim_shrink_order, relay_tiktoken_file, relay_context_windows. Per flow it fills `FlowState.trim` (the stats
    of `policy.trim`) and `FlowState.prompt_tokens` (for every request of a shape it
    trims, trimmed or not), and answers with an X-Relay-Trim header when it trimmed or
    found the request over budget.
    """

    def __init__(self) -> None:
        self.tokenizers = tokens.loader_for(None)
        self.counts = tokens.CountCache()
        self.store = store.SharedStore(None, [windows.KIND, plans.KIND])
        """What trimming learns, shared through a file beside the timing log."""
        self.plans = plans.KeptPlans(self.store)
        """Conversations' cuts, kept for the next relay and the other workers."""
        self.configured: dict[str, int] = {}
        """relay_context_windows: the user's windows by model prefix."""
        self.learned = windows.LearnedWindows(self.store)
        """Windows the providers' refusals named."""
        self._refusable: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()
        """Flows whose refusal as too long the relay can act on (trimmed shape, known error format)."""
        # One thread: the caches are only touched there (or, for a small request, on the
        # event loop while that thread has nothing to do), and one huge request at a time
        # bounds the memory counting can take.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-trim")
        self._handed: Future | None = None
        """The last request handed to the worker: until it is done (the worker runs them in
        order), the caches are the worker's and every request goes there."""
        self._failures_logged: set[str] = set()
        self._sockets: weakref.WeakKeyDictionary[http.HTTPFlow, turns.SocketConversation] = weakref.WeakKeyDictionary()
        """Each Responses WebSocket's conversation, for trimming its turns."""

    def load(self, loader: addonmanager.Loader) -> None:
        loader.add_option("relay_trim", bool, True, "Trim oversized conversation histories before they go upstream.")
        loader.add_option(
            "relay_trim_max_tokens",
            int,
            0,
            """
            Prompt token budget per request, on top of the model's context window (the smaller
            one wins). 0: the context window only.
            """,
        )
        loader.add_option(
            "relay_trim_reserve_tokens",
            int,
            windows.DEFAULT_RESERVE_TOKENS,
            """
            Output tokens to keep free in the context window when a request sets none of
            max_tokens, max_completion_tokens, max_output_tokens.
            """,
        )
        loader.add_option(
            "relay_trim_notice",
            bool,
            False,
            "Tell the model, in front of the first kept user message, that earlier turns were left out.",
        )
        loader.add_option(
            "relay_trim_shrink_order",
            str,
            policy.OLDEST,
            """
            Where a new cut changes the conversation first. "oldest": old tool results shrunk
            and old turns dropped oldest first; the model keeps what it read last, but the
            prompt changes early and the provider's prompt cache misses most of it at each
            new cut. "newest": old tool results shrunk from the newest old ones back (the
            newest round and prompt stay whole), then whole rounds dropped from the middle
            (the current turn's earlier rounds before older turns); the cached prompt stays a
            prefix and a new cut costs little cache, but the model loses what it read last
            and the middle of the conversation (docs/trimming.md, "Shrinking newest first").
            """,
            choices=policy.SHRINK_ORDERS,
        )
        loader.add_option(
            "relay_tiktoken_file",
            # mitmproxy's Loader says `type`; its OptManager takes `type | object`, as optional ones are.
            str | None,  # type: ignore[arg-type]
            None,
            """
            Local o200k_base.tiktoken file, for counting gpt-4o/4.1/5 and o-series tokens.
            Without it the relay looks in tiktoken's download cache, then counts with the
            bundled cl100k_base; it never downloads.
            """,
        )
        loader.add_option(
            "relay_context_windows",
            Sequence[str],
            [],
            """
            Context windows as "model-prefix=tokens", e.g. "my-model=32000": the longest
            matching prefix wins over the windows the relay knows (exact model ids) and over
            any a provider's refusal named; 0 makes a prefix unknown (user budget only, or
            what a refusal teaches).
            """,
        )

    def configure(self, updated: set[str]) -> None:
        if "relay_trim_shrink_order" in updated and ctx.options.relay_trim_shrink_order not in policy.SHRINK_ORDERS:
            raise exceptions.OptionsError(
                f"relay_trim_shrink_order: {ctx.options.relay_trim_shrink_order!r} is not one of "
                f"{', '.join(policy.SHRINK_ORDERS)}")
        if "relay_context_windows" in updated:
            try:
                self.configured = windows.parse_context_windows(ctx.options.relay_context_windows)
            except ValueError as e:
                raise exceptions.OptionsError(f"relay_context_windows: {e}") from e
        if "relay_timing_log" in updated:
            log = getattr(ctx.options, "relay_timing_log", "")
            self.store = store.SharedStore(Path(log).with_name(store.FILE_NAME) if log else None,
                                           [windows.KIND, plans.KIND])
            self.learned = windows.LearnedWindows(self.store)
            self.plans = plans.KeptPlans(self.store)
            # Read in the worker thread, not on the event loop, before the first trim.
            self._handed = self.worker.submit(self.store.refresh)
        if "relay_tiktoken_file" in updated and ctx.options.relay_tiktoken_file != self.tokenizers.o200k_file:
            self.tokenizers = tokens.loader_for(ctx.options.relay_tiktoken_file)
        if ctx.options.relay_trim:
            # Loaded before mitmproxy started (`ttft-relay run`, launch.py) or now, while the
            # script loads, before any listener accepts: no request waits for it or shares the
            # GIL with it. Later (trimming switched on, a new file) it costs the event loop that long once.
            self.tokenizers.load()
            self.tokenizers.say()
            if pins.on(resend):
                resend.install(by="trim")
            if pins.on(websocket_text):
                websocket_text.install()
        else:
            resend.uninstall(by="trim")
            websocket_text.uninstall()

    def done(self) -> None:
        resend.uninstall(by="trim")
        websocket_text.uninstall()
        self.worker.shutdown(wait=False, cancel_futures=True)

    async def request(self, flow: http.HTTPFlow) -> None:
        st = state.get(flow)
        if not ctx.options.relay_trim or st is None or st.api.trim_shape is None or st.request_json is None:
            return
        try:
            await self._trim(flow, st)
        except Exception as e:  # trimming must never fail a request: the original bytes go on
            self._log_failure_once(e)
            st.trim = policy.untouched_stats(f"error: {type(e).__name__}: {e}")

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        st = state.get(flow)
        response = flow.response
        if st is None or response is None:
            return
        if (flow in self._refusable and response.status_code in REFUSAL_STATUSES and _readable(response)
                and resend.installed()):
            # Maybe a refusal as too long: read it whole, and look at it before the client gets it.
            self._refusable.discard(flow)
            response.stream = False
            st.watcher = None
            resend.hold(flow)
            return
        line = policy.summary(st.trim) if st.trim else None
        if line is not None:
            response.headers[HEADER] = line

    async def relay_held_answer(self, flow: http.HTTPFlow) -> None:
        """An error answer held before the client got any of it: if it refuses the prompt as
        too long and names the limit, learn the window, trim to it, and send once more."""
        st = state.get(flow)
        response = flow.response
        if st is None or response is None or st.trim is None:
            return
        try:
            await self._refused(flow, st, response)
        except Exception as e:  # the refusal goes to the client as it came
            self._log_failure_once(e)
        line = policy.summary(st.trim)
        if line is not None and flow.response is not None:
            flow.response.headers[HEADER] = line

    async def _refused(self, flow: http.HTTPFlow, st: state.FlowState, response: http.Response) -> None:
        api_windows = st.api.windows
        assert api_windows is not None and st.trim is not None
        refusal = api_windows.too_long(response.status_code, response.get_content(strict=False) or b"")
        if refusal is None:
            return
        sent_tokens = st.trim.get("tokens_after")
        forwarded = st.marks.get("forwarded")
        refused = {
            "status": response.status_code,
            "max_input": refusal.max_input,
            "window": refusal.window,
            "provider_tokens": refusal.prompt_tokens,
            "relay_tokens": sent_tokens,
            "after_ms": round((response.timestamp_start - forwarded) * 1000, 1) if forwarded else None,
            "resent": False,
        }
        st.trim = {**st.trim, "refused": refused}
        upstream = upstream_name(flow)
        learned = await self.learn_from_refusal(api_windows, refusal, upstream=upstream, model=st.model,
                                                status=response.status_code, counted=sent_tokens,
                                                key=client_key(flow))
        if isinstance(learned, str):
            st.trim = {**st.trim, "refused": {**refused, "ignored": learned}}
            return
        counter = tokens.counter_for(st.model, self.tokenizers, self.counts)
        budget = self._budget(st.model, st.api, st.request_json, flow.request.headers.get("anthropic-beta"))(
            learned=learned)
        if counter is None or budget is None:
            return
        # At the limit the refusal named, no deeper: no room left for the next requests.
        result, content = await self._in_worker(functools.partial(self._work, by=client_key(flow)), st.request_json,
                                                st.api, budget, counter, ctx.options.relay_trim_notice, False)
        logger.info(
            "%s: %s takes at most %s tokens (its refusal, %s): learned%s; %s", upstream, st.model, learned.limit,
            learned.error, "" if learned.confirmed else " for this access key until confirmed",
            "trimmed to it and sent once more" if content is not None else f"not resent ({result.stats['reason']})",
        )  # fmt: skip
        if content is None:
            st.trim = {**result.stats, "refused": refused}
            return
        flow.request.content = content
        st.trim = {**result.stats, "refused": {**refused, "resent": True}}
        st.prompt_tokens = result.stats["tokens_after"]
        st.marks.pop("head_arrived", None)  # the refused answer's head
        resend.again(flow)

    async def learn_from_refusal(self, api_windows: Windows, refusal: TooLong, *, upstream: str, model: str | None,
                                 status: int, counted: int | None, key: str) -> windows.Learned | str:
        """What an upstream's refusal of a prompt as too long teaches (`windows.judge_refusal`),
        kept for the next requests: the window to resend within, or why there is none (logged
        in one line, without the key). For any transport's resend: an HTTP request's
        (`relay_held_answer`), a WebSocket turn's. `counted`: the relay's count of the refused
        prompt; `key`: `flows.client_key` of the flow that sent it."""
        judge = functools.partial(windows.judge_refusal, refusal, upstream=upstream, model=model, status=status,
                                  counted=counted, key=key, windows=api_windows, configured=self.configured)
        self._handed = self.worker.submit(self._learn, judge, upstream, model)
        learned = await asyncio.wrap_future(self._handed)
        if isinstance(learned, str):
            logger.info("%s refused %s as too long; nothing learned: %s", upstream, model, learned)
        return learned

    def _learn(self, judge: Callable[..., windows.Learned | str], upstream: str,
               model: str | None) -> windows.Learned | str:
        """In the worker thread: judge a refusal against what the relay holds, and keep what it teaches."""
        self.learned.refresh()
        before = self.learned.held(upstream, model)
        learned = judge(before=before, now=time.time())
        if isinstance(learned, windows.Learned) and learned not in before:
            self.learned.keep(learned)
        return learned

    def response(self, flow: http.HTTPFlow) -> None:
        """An accepted request may refute the windows keys learned and not yet confirmed, and
        confirm its own key's."""
        st = state.get(flow)
        if (st is None or st.trim is None or st.prompt_tokens is None or flow.response is None
                or not 200 <= flow.response.status_code < 300):
            return
        held = self.learned.held(upstream_name(flow), st.model)
        unconfirmed = [learned for learned in held if learned.confirmed is None]
        if not unconfirmed:
            return
        shared = next((learned for learned in held if learned.confirmed is not None), None)
        before = self._budget(st.model, st.api, st.request_json, flow.request.headers.get("anthropic-beta"),
                              user_max=0)(learned=shared)  # what the other keys go by
        key = client_key(flow)
        for learned in unconfirmed:  # another key's window is refuted by this request, never confirmed
            self._handed = self.worker.submit(self._accepted, learned, st.prompt_tokens,
                                              before if learned.key == key else None)

    def _accepted(self, held: windows.Learned, sent: int, before: windows.Budget | None) -> None:
        """In the worker thread: what an accepted request says of an unconfirmed window."""
        judged = windows.judge_accepted(held, sent, before, time.time())
        # Said once done (the store written): the line is when other workers see it too.
        if judged is None:
            self.learned.forget(held)
            logger.info("%s accepted %s tokens of %s, more than the %s tokens learned from one key's refusal: "
                        "forgotten", held.upstream, sent, held.model, held.limit)
        elif isinstance(judged, windows.Learned):
            self.learned.keep(judged)
            logger.info("%s accepted %s tokens of %s, more than the window before allowed: the %s tokens learned "
                        "confirmed", held.upstream, sent, held.model, held.limit)

    def _budget(self, model: str | None, api: Api, body: Any, anthropic_beta: str | None,
                user_max: int | None = None) -> Callable[..., windows.Budget | None]:
        """`windows.budget_for` for this request (a model, its API, its body), but for its `learned=` window."""
        return functools.partial(
            windows.budget_for,
            model,
            policy.max_output(api, body),
            windows=api.windows,
            configured=self.configured,
            user_max=ctx.options.relay_trim_max_tokens if user_max is None else user_max,
            default_reserve=ctx.options.relay_trim_reserve_tokens,
            long_context=policy.long_context(api, anthropic_beta),
        )

    async def _trim(self, flow: http.HTTPFlow, st: state.FlowState) -> None:
        counter = tokens.counter_for(st.model, self.tokenizers, self.counts)
        if counter is None:
            st.trim = policy.untouched_stats("no tokenizer")
            return
        budget = self._budget(st.model, st.api, st.request_json, flow.request.headers.get("anthropic-beta"))
        upstream, key = upstream_name(flow), client_key(flow)
        if (self._handed is None or self._handed.done()) and _small(flow.request):
            # The worker has nothing left to do, so its caches are free; this little is
            # counted faster than handing it over costs (with the learned windows as last read;
            # the plans' file waits for the worker).
            work = (st.request_json, st.api, budget(learned=self.learned.get(upstream, st.model, key)), counter,
                    ctx.options.relay_trim_notice)
            result, content = self._work(*work, files=False, by=key)
            if self.plans.unsaved:
                self._handed = self.worker.submit(self.plans.save)
        else:
            result, content = await self._in_worker(self._work_fresh, st.request_json, st.api, budget, upstream,
                                                    st.model, key, counter, ctx.options.relay_trim_notice)
        if content is not None:
            # Re-encoded to the request's Content-Encoding; Content-Length follows.
            flow.request.content = content
        st.trim = result.stats
        st.prompt_tokens = result.stats["tokens_after"]
        if st.api.windows is not None and not flow.request.stream:
            self._refusable.add(flow)

    def _work(self, body, api, budget, counter, notice, headroom=True, encode: Callable[[dict], bytes] = orjson.dumps,
              files: bool = True, by: str = "") -> tuple[policy.TrimResult, bytes | None]:
        """In the worker thread: the trim, and the new body's bytes (`encode`d) if there is one;
        the other processes' plans read before, this one's new plan kept after (`files`); `by`:
        the digest of the access key whose request it is (who made a new plan)."""
        if files:
            self.plans.refresh()
        self.plans.by = by
        result = policy.trim(body, api, budget, counter, plans=self.plans, notice=notice, headroom=headroom,
                             order=ctx.options.relay_trim_shrink_order)
        if files:
            self.plans.save()
        return result, None if result.body is None else encode(result.body)

    def _work_fresh(self, body, api, budget, upstream, model, key, counter, notice, headroom=True,
                    encode: Callable[[dict], bytes] = orjson.dumps) -> tuple[policy.TrimResult, bytes | None]:
        """In the worker thread: the learned windows read again if another process changed
        them, then the trim (`_work`) within the budget they give (`budget(learned=...)`)."""
        self.learned.refresh()
        return self._work(body, api, budget(learned=self.learned.get(upstream, model, key)), counter, notice,
                          headroom, encode, by=key)

    async def _in_worker(self, work: Callable[..., tuple[policy.TrimResult, bytes | None]],
                         *args: Any) -> tuple[policy.TrimResult, bytes | None]:
        """`work(*args)` (`_work`, `_work_fresh`) in the worker thread, awaited."""
        self._handed = self.worker.submit(work, *args)
        return await asyncio.wrap_future(self._handed)

    # --- WebSocket turns (the Responses API's, Codex's default transport) ---------------

    def websocket_start(self, flow: http.HTTPFlow) -> None:
        st = state.get(flow)
        if st is None or st.api.trim_shape is None or st.api.websocket_turns is None:
            return
        self._sockets[flow] = turns.SocketConversation(st.api.websocket_turns, st.api.trim_shape)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        self._sockets.pop(flow, None)

    async def websocket_message(self, flow: http.HTTPFlow) -> None:
        """A turn's `response.create` is trimmed like an HTTP request (the message is
        re-encoded only then; otherwise it passes byte for byte); a refusal of it as too
        long that names the limit is learned from, and the turn sent once more, trimmed to
        it, on the same socket, the refusal kept from the client."""
        conversation = self._sockets.get(flow)
        st = state.get(flow)
        if conversation is None or st is None or flow.websocket is None or not ctx.options.relay_trim:
            return
        message = flow.websocket.messages[-1]
        if message.injected or not message.is_text:
            return
        try:
            if message.from_client:
                await self._turn(flow, st, conversation, message)
            elif (done := conversation.protocol.completed(message.content)) is not None:
                conversation.completed(*done)
            elif conversation.turn is not None and not conversation.turn.resent:
                await self._turn_refused(flow, st, conversation, conversation.turn, message)
        except Exception as e:  # the message goes on as it came
            self._log_failure_once(e)

    async def _turn(self, flow: http.HTTPFlow, st: state.FlowState, conversation: turns.SocketConversation,
                    message: WebSocketMessage) -> None:
        protocol = conversation.protocol
        body = protocol.request(message.content)
        if body is None:
            return
        model = protocol.model(body)
        whole = conversation.whole(body)
        counter = tokens.counter_for(model, self.tokenizers, self.counts)
        if whole is None or counter is None:
            conversation.started(None)
            st.turn_trim = policy.untouched_stats(
                "continues a response this socket did not carry: its conversation is the upstream's"
                if whole is None else "no tokenizer")
            return
        request, items = whole
        budget = self._budget(model, st.api, request, None)
        result, content = await self._in_worker(self._work_fresh, request, st.api, budget, upstream_name(flow), model,
                                                client_key(flow), counter, ctx.options.relay_trim_notice, True,
                                                protocol.start)
        if content is not None:
            message.content = content
        st.turn_trim = result.stats
        conversation.started(turns.Turn(request, items, model, result.stats))

    async def _turn_refused(self, flow: http.HTTPFlow, st: state.FlowState, conversation: turns.SocketConversation,
                            turn: turns.Turn, message: WebSocketMessage) -> None:
        api_windows = st.api.windows
        failed = conversation.protocol.refusal(message.content)
        if failed is None or api_windows is None:
            return
        refusal = api_windows.too_long(*failed)
        if refusal is None:
            return
        sent_tokens = turn.stats.get("tokens_after")
        refused = {"status": failed[0], "max_input": refusal.max_input, "window": refusal.window,
                   "provider_tokens": refusal.prompt_tokens, "relay_tokens": sent_tokens, "resent": False}
        turn.stats["refused"] = refused
        upstream = upstream_name(flow)
        learned = await self.learn_from_refusal(api_windows, refusal, upstream=upstream, model=turn.model,
                                                status=failed[0], counted=sent_tokens, key=client_key(flow))
        if isinstance(learned, str):
            turn.stats["refused"] = {**refused, "ignored": learned}
            return
        counter = tokens.counter_for(turn.model, self.tokenizers, self.counts)
        budget = self._budget(turn.model, st.api, turn.request, None)(learned=learned)
        if counter is None or budget is None or not flow.live:
            return
        # At the limit the refusal named, no deeper, as for HTTP.
        result, content = await self._in_worker(functools.partial(self._work, by=client_key(flow)), turn.request,
                                                st.api, budget, counter, ctx.options.relay_trim_notice, False,
                                                conversation.protocol.start)
        logger.info(
            "%s: %s takes at most %s tokens (its refusal of a WebSocket turn, %s): learned%s; %s", upstream,
            turn.model, learned.limit, learned.error, "" if learned.confirmed else " for this access key until confirmed",
            "trimmed to it and sent once more" if content is not None else f"not resent ({result.stats['reason']})",
        )  # fmt: skip
        turn.resent = True
        resent = content is not None
        turn.stats.clear()
        turn.stats.update(result.stats, refused={**refused, "resent": resent})
        if resent:
            message.drop()  # the client gets the second answer only
            ctx.master.commands.call("inject.websocket", flow, False, content, True)

    def _log_failure_once(self, e: Exception) -> None:
        # One line per place of failure, not per message text: that set stays small.
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb else "?"
        key = f"{type(e).__name__} at {where}"
        if key not in self._failures_logged:
            self._failures_logged.add(key)
            logger.warning(
                "Trimming failed, forwarding the request unchanged (%s: %s, at %s); "
                "further failures of this kind are not logged.",
                type(e).__name__, e, where,
                exc_info=e,
            )  # fmt: skip
