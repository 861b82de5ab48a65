"""Why is my first token slow? Probe direct and through the relay, tiny and long prompts; say why.

    ttft-relay diagnose [--upstream https://api.openai.com] [--relay http://127.0.0.1:8001
                     [--relay-mode base-url|proxy] [--relay-log logs/timing.jsonl]]
                     [--api openai.chat|openai.responses|anthropic.messages] [--model M]
                     [--repeat 5] [--long-tokens 8000 | --body-file request.json] [--prompt-tokens N]
                     [--transport http|websocket] [--timeout 30] [--ca mitmproxy-ca-cert.pem]
                     [--json] [--html findings.html]

A warm-up probe per path comes first and is dropped if it succeeds (one-time costs
would skew medians). Probes then run in rounds, one of each kind per round, so drift
over time touches every kind alike; a kind stops repeating after its first failure. The API key comes
from OPENAI_API_KEY / ANTHROPIC_API_KEY and never appears in the output. Exit
status: 0 with a verdict, 2 when the upstream or the relay cannot be reached, 1
on bad arguments. See findings.py for the findings and their thresholds.

The verdict answers for your requests, not for the probes: the long probe says what
every 8k tokens of history add to the first token, and that cost is weighed at your own
prompts' size — `--prompt-tokens N`, else the `--body-file` request's, else the median of
your requests in `--relay-log` (the probes left out; the log's newest records before the
probes, and any that come while they run). Without any of them the rate is said beside
the verdict, never as it.

`--transport websocket` probes a Responses WebSocket as Codex uses it (one new socket
per probe, one `response.create` turn on it): a refused, hung or broken handshake
is its own finding, and so is a slow one. The text report draws each probe kind's
phases as an httpstat-style waterfall; `--html` also writes them as a page of
waterfalls (ttft_relay/report/report_html.py), the relay's own record of each relayed probe
beside it.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from .. import apis
from ..apis.api import Probe
from ..report import summary
from . import findings, probe, probe_requests

logger = logging.getLogger("diagnose")

RELAY_LOG_WAIT_S = 5.0
"""How long to wait for the relay's writer thread to append the last probes' records."""
USERS_RECORDS_BYTES = 4 << 20
"""How much of the relay's log before the probes is read for the user's own requests: the
newest few thousand records (a day's log of a busy relay is far longer)."""
REDACTED = "[redacted]"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ttft-relay diagnose", description=__doc__.split("\n\n")[0], epilog=key_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--api", choices=sorted(probe_requests.API_SHAPES),
                        help="default: openai.chat, or openai.responses with --transport websocket")
    parser.add_argument("--upstream", help="upstream base URL (default: the API's public one)")
    parser.add_argument("--relay", help="the relay: its base URL (base-url mode) or proxy URL (proxy mode)")
    parser.add_argument("--relay-mode", choices=("base-url", "proxy"), default="base-url")
    parser.add_argument("--relay-log", type=Path, help="the relay's timing JSONL, joined by request id")
    parser.add_argument("--no-direct", action="store_true", help="skip the direct probes (no direct path)")
    parser.add_argument("--model", help="model to ask (default: a small one of the API)")
    parser.add_argument("--repeat", type=int, default=5, help="probes per kind (default 5)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--long-tokens", type=int, default=8000, help="long prompt size in tokens (default 8000)")
    size.add_argument("--body-file", type=Path, help="your own request body (JSON) as the long probe")
    parser.add_argument("--prompt-tokens", type=int, metavar="N",
                        help="your requests' usual prompt size in tokens, to weigh the context's cost at (default: "
                             "the --body-file request's, else the median of your requests in --relay-log)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens to ask for (default 16)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per probe, all phases (default 30)")
    parser.add_argument("--ca", action="append", default=[], help="extra CA file to trust (repeatable)")
    parser.add_argument("--transport", choices=findings.TRANSPORTS, default="http",
                        help="http: streamed requests; websocket: one turn per new Responses WebSocket, as Codex "
                             "(needs --api openai.responses, the default with it)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--html", type=Path, metavar="FILE", help="also write the probes' waterfalls as an HTML page")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    websocket = args.transport == "websocket"
    args.api = args.api or (apis.OPENAI_RESPONSES if websocket else apis.OPENAI_CHAT)
    if websocket and args.api != apis.OPENAI_RESPONSES:
        parser.error("--transport websocket speaks the Responses API: --api openai.responses")
    if args.repeat < 1 or args.timeout <= 0 or args.long_tokens < 1 or (args.prompt_tokens or 1) < 1:
        parser.error("--repeat, --timeout, --long-tokens and --prompt-tokens must be positive")
    if args.no_direct and not args.relay:
        parser.error("--no-direct needs --relay: there would be nothing to probe")
    return args


def key_help() -> str:
    """Where the probes' API key comes from, per API (the --help epilog)."""
    by_env: dict[str, list[str]] = {}
    for name, shape in sorted(probe_requests.API_SHAPES.items()):
        by_env.setdefault(shape.key_env, []).append(name)
    lines = [f"  {env:<20} --api {' / '.join(names)}" for env, names in by_env.items()]
    return ("The API key comes from the environment, never from the command line, and is never printed:\n"
            + "\n".join(lines) + "\n"
            "Through a relay that takes relay keys, that variable holds your relay key (with --no-direct).\n"
            "e.g. OPENAI_API_KEY=sk-... ttft-relay diagnose --relay http://127.0.0.1:8001 --relay-log logs/timing.jsonl")


class Redactor(logging.Filter):
    """Replaces secrets in text, and in every log line on the way out."""

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if s]

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, REDACTED)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = self(record.getMessage()), None
        return True


class RelayLog:
    """The relay's timing log, read from where it ended when probing began."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def records(self, request_ids: set[str], wait_s: float = RELAY_LOG_WAIT_S) -> dict[str, dict[str, Any]]:
        """The new records carrying one of `request_ids`, waiting a little for the last ones.
        A WebSocket probe's upgrade carries its id, so its handshake (turn 0) and its turn share
        it: the turn's record is the one wanted, the handshake's stands in if there is no other."""
        deadline = time.monotonic() + wait_s
        while True:
            found = self._read(request_ids)
            complete = {rid for rid, rec in found.items() if not summary.is_handshake(rec)}
            if complete >= request_ids or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if request_ids and not found:
            logger.warning("no record in %s carries the probes' request ids (a relay records no request "
                           "it could not read; else check it writes here and records `request_id`)", self.path)
        return found

    def users_records(self) -> list[dict[str, Any]]:
        """The user's own records: the newest before the probes began (`USERS_RECORDS_BYTES`)
        and any written since, diagnose's probes (of this run and earlier ones) left out."""
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            start = max(0, self.offset - USERS_RECORDS_BYTES) if self.path.stat().st_size >= self.offset else 0
            f.seek(start)
            if start:
                f.readline()  # the rest of a record cut by the seek
            out = []
            for line in f:
                try:
                    rec = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # a line still being written
                rid = rec.get("request_id") if isinstance(rec, dict) else None
                if isinstance(rec, dict) and not (isinstance(rid, str) and rid.startswith(probe_requests.REQUEST_ID_PREFIX)):
                    out.append(rec)
            return out

    def _read(self, request_ids: set[str]) -> dict[str, dict[str, Any]]:
        if not self.path.exists():
            return {}
        with open(self.path, "rb") as f:
            f.seek(self.offset if self.path.stat().st_size >= self.offset else 0)  # rotated: read it all
            found = {}
            for line in f:
                try:
                    rec = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # a line still being written
                if isinstance(rec, dict) and rec.get("request_id") in request_ids:
                    if not (summary.is_handshake(rec) and rec["request_id"] in found):
                        found[rec["request_id"]] = rec
            return found


class Prober:
    """Runs the probes of one diagnosis: which routes, which requests, in what order."""

    def __init__(self, args: argparse.Namespace, shape: Probe, key: str | None) -> None:
        self.args = args
        self.shape = shape
        upstream = probe.Endpoint.parse(args.upstream or shape.default_upstream)
        self.routes: dict[str, probe.Route] = {} if args.no_direct else {"direct": probe.Route(upstream)}
        if args.relay:
            relay = probe.Endpoint.parse(args.relay)
            self.routes["relayed"] = probe.Route(upstream, proxy=relay) if args.relay_mode == "proxy" else probe.Route(relay)
        self.user_body = orjson.loads(args.body_file.read_bytes()) if args.body_file else None
        model = args.model or (self.user_body or {}).get("model") or shape.default_model
        self.factory = probe_requests.PromptFactory(shape, model, args.max_tokens, key)
        self.tls = probe.tls_context(args.ca)

    def request(self, prompt: str) -> probe_requests.ProbeRequest:
        if prompt == "tiny":
            return self.factory.tiny()
        if self.user_body is not None:
            return self.factory.from_user_body(self.user_body, self.args.model)
        return self.factory.long(self.args.long_tokens)

    def probe(self, path: str, prompt: str) -> findings.ProbeResult:
        run = probe.run_websocket_probe if self.args.transport == "websocket" else probe.run_probe
        return run(
            self.routes[path], self.request(prompt), path=path, prompt=prompt,
            api=self.shape.name, timeout=self.args.timeout, tls_context=self.tls,
        )

    def warm_up(self) -> list[findings.ProbeResult]:
        """One tiny probe per path, dropped if it succeeds: one-time costs (DNS cache, the
        relay's certificate for a host, its tokenizer) would skew medians and spreads.
        A failure is kept, and its path is not probed further."""
        failures = []
        for path in self.routes:
            result = self.probe(path, "tiny")
            if not result.ok:
                logger.warning("warm-up %s failed in %s: %s", path, result.error_phase, result.error)
                failures.append(result)
        return failures

    def run(self) -> list[findings.ProbeResult]:
        results = self.warm_up()
        dead_paths = {r.path for r in results}
        kinds = [(path, prompt) for path in self.routes if path not in dead_paths for prompt in findings.PROMPTS]
        stopped: set[tuple[str, str]] = set()
        for round_ in range(1, self.args.repeat + 1):
            for path, prompt in kinds:
                if (path, prompt) in stopped:
                    continue
                result = self.probe(path, prompt)
                results.append(result)
                if result.ok:
                    logger.info("%d/%d %s: first token %.0f ms", round_, self.args.repeat, result.kind,
                                result.marks["first_token"])
                else:
                    stopped.add((path, prompt))
                    logger.warning("%d/%d %s failed in %s: %s (not repeated)", round_, self.args.repeat,
                                   result.kind, result.error_phase, result.error)
        return results


def collect(args: argparse.Namespace, shape: Probe, key: str | None) -> findings.Evidence:
    """Runs the probes, joins the relay's records to them, and finds the user's prompt size."""
    prober = Prober(args, shape, key)
    relay_log = RelayLog(args.relay_log) if args.relay_log and args.relay else None
    probes = prober.run()
    records = relay_log.records({p.request_id for p in probes if p.path == "relayed"}) if relay_log else {}
    return findings.Evidence(probes, records, users_prompt_size(args, probes, relay_log, records))


def users_prompt_size(args: argparse.Namespace, probes: list[findings.ProbeResult], relay_log: RelayLog | None,
                      probe_records: dict[str, dict[str, Any]]) -> findings.PromptSize | None:
    """The size the context's cost is weighed at: --prompt-tokens, else the --body-file request
    (the long probe), else the user's requests in the relay's log to the upstream the probes
    reached (every upstream when no probe's record says which)."""
    if args.prompt_tokens:
        return findings.PromptSize(args.prompt_tokens, "--prompt-tokens")
    if args.body_file and (sizes := [p.prompt_tokens for p in probes if p.prompt == "long"]):
        return findings.PromptSize(statistics.median(sizes), "your --body-file request")
    if relay_log is None:
        return None
    upstreams = {u for rec in probe_records.values() if isinstance(u := rec.get("upstream"), str)}
    return findings.prompt_size_of_traffic(relay_log.users_records(), upstreams)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = probe_requests.API_SHAPES[args.api]
    key = os.environ.get(shape.key_env)
    redact = Redactor([key] if key else [])
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(redact)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s",
                        handlers=[handler])
    if not key:
        logger.warning("%s is not set: probing without a key", shape.key_env)
    try:
        evidence = collect(args, shape, key)
    except (ValueError, OSError) as e:
        logger.error("%s", e)
        return 1
    result = findings.diagnose(evidence)
    if args.html:
        from ..report import report_html  # the page's code is loaded only when asked for
        from . import findings_html

        try:
            args.html.write_text(redact(report_html.page(findings_html.diagnose_data(evidence, result))),
                                 encoding="utf8")
        except OSError as e:
            logger.error("%s", e)
            return 1
        logger.info("wrote %s", args.html)
    if args.json:
        text = orjson.dumps(findings.as_json(evidence, result), option=orjson.OPT_INDENT_2).decode()
    else:
        text = findings.render(evidence, result)
    print(redact(text))
    return 2 if result.failed else 0
