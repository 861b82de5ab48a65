"""Redaction: the relay's secrets kept out of every log line, flow and view.

    LogRedaction    credentials redacted, control characters escaped and lines
                    capped in every log record, mitmproxy's own included.
    SecretRedaction credentials are replaced by "REDACTED" in every flow once its
                    request has gone upstream, before mitmproxy's console dumper,
                    flow savers and mitmweb see the finished flow.
    WebOptions      mitmweb's option editor shows the secrets of proxyauth,
                    upstream_auth and web_password as REDACTED.

mitmweb's own access URL (`http://127.0.0.1:8081/?token=…`) is the one credential the log
keeps: it grants that UI only, which stays on loopback unless `web_password` is set (and
then mitmweb prints no token), and the operator opens the UI with it.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Callable
from typing import Any

from mitmproxy import exceptions, http

from ..patches import pins
from ..patches.fixes import web_options
from ..text import (
    REDACTED, SECRET_PARAM_NAME, is_secret_header, knows_secrets, redacted_text, redacted_value, safe_log_text,
    without_known_secrets,
)


def redact_flow(flow: http.HTTPFlow) -> None:
    """Replace every credential the flow holds: secret request headers, key and
    token query parameters (any case), the relay's own keys wherever they are, what
    its error message quotes of them (mitmproxy's smuggling check quotes header values,
    and the dumper prints the message), and the password proxyauth keeps in the metadata."""
    if flow.error is not None:
        flow.error.msg = redacted_text(flow.error.msg)
    headers = flow.request.headers
    if knows_secrets():
        for name in {name.lower() for name, value in headers.items(multi=True) if without_known_secrets(value) != value}:
            headers.set_all(name, [without_known_secrets(v) for v in headers.get_all(name)])
        flow.request.path = without_known_secrets(flow.request.path)
    for name in {name.lower() for name in headers if is_secret_header(name)}:
        headers.set_all(name, [redacted_value(name, v) for v in headers.get_all(name)])
    query = flow.request.query
    for name in {name for name in query if SECRET_PARAM_NAME.fullmatch(name)}:
        query.set_all(name, [REDACTED] * len(query.get_all(name)))
    if (auth := flow.metadata.get("proxyauth")) is not None:
        flow.metadata["proxyauth"] = (auth[0], REDACTED)


MITMWEB_LOGGERS = frozenset({"mitmproxy.tools.web.master", "mitmproxy.tools.web.webaddons"})
"""mitmweb's own loggers: they print its access URL, never a request."""
_WEB_ACCESS_URL = re.compile(r"(http://[^\s/?]+/\?token=)([0-9a-f]{32})(?![\w-])")
"""mitmweb's access URL with the random token it makes (`secrets.token_hex(16)`)."""


def web_log_text(text: str) -> str:
    """A line of mitmweb's own loggers as `safe_log_text` makes it, with mitmweb's access
    URL whole: its token is what the operator opens the UI with (loopback only, unless
    `web_password` is set, and then mitmweb prints no token)."""
    safe = safe_log_text(text)
    for prefix, token in _WEB_ACCESS_URL.findall(text):
        safe = safe.replace(f"{prefix}{REDACTED}", f"{prefix}{token}", 1)
    return safe


class LogRedaction:
    """Every log record of the process, mitmproxy's own included, passes
    `safe_log_text` before any handler (console, mitmweb's event log, a file) sees
    it (mitmweb's own lines `web_log_text`). mitmproxy logs some requests outside any flow, where flow redaction cannot
    reach: a bad request line, a head the client abandoned, both with the raw bytes
    (`Authorization: Bearer …`, `?key=…`). Done with the standard library's log
    record factory, so no handler is missed. A refused setting (OptionsError) is
    logged as one line with its reason instead of a traceback."""

    def __init__(self) -> None:
        self.previous: Callable[..., logging.LogRecord] | None = None

    def load(self, loader) -> None:
        if self.previous is None:
            self.previous = logging.getLogRecordFactory()
            logging.setLogRecordFactory(self._record)

    def done(self) -> None:
        if self.previous is not None and logging.getLogRecordFactory() == self._record:
            logging.setLogRecordFactory(self.previous)
        self.previous = None

    def _record(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        rec = (self.previous or logging.LogRecord)(*args, **kwargs)
        try:
            message = rec.getMessage()
        except Exception:  # a broken format string: the handler reports it as usual
            return rec
        if rec.exc_info and isinstance(rec.exc_info[1], exceptions.OptionsError):
            # A setting refused (the script loader logs it with a traceback): the
            # reason is the message, one line.
            message, rec.exc_info = f"{message}: {rec.exc_info[1]}", None
        safe = web_log_text(message) if rec.name in MITMWEB_LOGGERS else safe_log_text(message)
        if safe != rec.msg or rec.args:
            rec.msg, rec.args = safe, None
        return rec


class SecretRedaction:
    """Redacts credentials in each flow once its request has gone upstream: at
    `response` and `error`, or at shutdown for flows still in flight (the flow
    saver writes those too). Script addons come before mitmproxy's console dumper
    (flow_detail >= 2 prints headers), savers (save_stream_file, HAR) and mitmweb's
    view in the addon chain, so all of them get the redacted flow. While a request is in
    flight its flow must keep them (mitmproxy sends the request as the flow holds it):
    mitmweb's views of it get `shown_flow`'s redacted copy (`WebOptions`)."""

    def __init__(self) -> None:
        self.in_flight: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()

    def shown_flow(self, flow: Any) -> Any:
        """`flow` as mitmweb may show it: a redacted copy while it is in flight (its own
        redaction is still to come), else the flow itself."""
        if flow not in self.in_flight:
            return flow
        shown = flow.copy()
        shown.id, shown.live = flow.id, flow.live
        redact_flow(shown)
        return shown

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self.in_flight.add(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        redact_flow(flow)
        self.in_flight.discard(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self.response(flow)

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        redact_flow(flow)  # the dumper prints failed CONNECTs, Proxy-Authorization included

    def done(self) -> None:
        for flow in list(self.in_flight):
            self.response(flow)


SECRET_OPTIONS = ("proxyauth", "upstream_auth", "web_password")
"""mitmproxy options whose values hold a password."""


def shown_option_value(name: str, value: Any) -> Any:
    """An option's value as mitmweb's option editor may show it: the password in
    `proxyauth` (`user:password`, LDAP's bind password), `upstream_auth` and `web_password`
    redacted, `proxyauth`'s `any` and `@htpasswd-file` as they are, and the relay's own
    keys redacted wherever they were pasted."""
    if isinstance(value, str) and value:
        if name == "web_password":
            return REDACTED
        if name == "proxyauth" and value != "any" and not value.startswith("@"):
            if value.startswith(("ldap:", "ldaps:")):  # ldap[s]:server[:port]:bind-dn:password:subtree
                fields = value.split(":")
                return ":".join([*fields[:-2], REDACTED, fields[-1]]) if len(fields) >= 5 else REDACTED
            user, sep, _ = value.partition(":")
            return f"{user}:{REDACTED}" if sep else REDACTED
        if name == "upstream_auth":
            user, sep, _ = value.partition(":")
            return f"{user}:{REDACTED}" if sep else REDACTED
        return without_known_secrets(value)
    if isinstance(value, list | tuple):
        return [shown_option_value(name, v) for v in value]
    return value


class WebOptions:
    """mitmweb's option editor (`GET /options`, and its `options/update` messages) shows
    the passwords of `SECRET_OPTIONS` as REDACTED (ttft_relay/patches/fixes/web_options.py); the
    options keep their values. Its flow views (the list, its live updates, the dump, the
    exports) show a flow in flight redacted (`SecretRedaction.shown_flow`)."""

    def __init__(self, redaction: SecretRedaction) -> None:
        self.redaction = redaction

    def load(self, loader) -> None:
        if pins.on(web_options):
            web_options.install(shown_option_value)
            web_options.install_flows(self.redaction.shown_flow)

    def done(self) -> None:
        web_options.uninstall()
