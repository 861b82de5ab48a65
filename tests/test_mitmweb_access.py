"""mitmweb with the relay, as its operator opens it (a real mitmweb; the redaction rules as
units): the access URL it prints works (the relay's log redaction once printed
`?token=REDACTED`, and the browser got a 403), and its option editor never shows a password
(proxyauth, upstream_auth, web_password), neither in `GET /options` nor in the
`options/update` messages of its WebSocket.
"""

from __future__ import annotations

import http.cookies
import re
import urllib.error
import urllib.request

import orjson
import pytest

from ttft_relay.guard import redaction
from ttft_relay.workers import free_port
from tests.conftest import reverse_to
from ttft_relay.testing.fakes.client import WebSocketClient
from ttft_relay.testing.harness import MITMWEB, MitmdumpProcess

WAIT = 20  # seconds: a bound that turns a hang into a failure, not a sync
PROXY_PASSWORD = "proxy-pass-0f3c9e"
UPSTREAM_PASSWORD = "upstream-pass-77ad21"
WEB_PASSWORD = "web-pass-5be0aa91"


TOKEN = "0123456789abcdef0123456789abcdef"


def test_mitmwebs_own_lines_keep_its_access_url_and_nothing_else():
    line = f"Web server listening at http://127.0.0.1:8081/?token={TOKEN}"
    assert redaction.web_log_text(line) == line
    assert redaction.web_log_text(f"No web browser found. Please open a browser and point it to http://[::1]:8081/?token={TOKEN}") \
        .endswith(f"/?token={TOKEN}")
    # Only its own URL: other credentials in its lines are redacted, and so is the same URL
    # in any other logger's line (a client's request with ?token= is not mitmweb's).
    assert redaction.web_log_text("x?token=abc&key=sk-1 Authorization: Bearer sk-2") == \
        "x?token=REDACTED&key=REDACTED Authorization: Bearer REDACTED"
    assert redaction.web_log_text(f"http://127.0.0.1:8081/?token={TOKEN}x") == "http://127.0.0.1:8081/?token=REDACTED"
    assert redaction.safe_log_text(line).endswith("?token=REDACTED")


def test_log_redaction_leaves_the_url_to_mitmwebs_loggers_only():
    log_redaction = redaction.LogRedaction()
    log_redaction.load(None)
    try:
        import logging

        line = f"Web server listening at http://127.0.0.1:8081/?token={TOKEN}"
        for name in redaction.MITMWEB_LOGGERS:
            assert logging.getLogger(name).makeRecord(name, 20, "f", 1, line, None, None).getMessage() == line
        other = logging.getLogger("mitmproxy.proxy.server").makeRecord("x", 20, "f", 1, line, None, None)
        assert other.getMessage().endswith("?token=REDACTED")
    finally:
        log_redaction.done()


@pytest.mark.parametrize("name, value, shown", [
    ("proxyauth", "alice:pw", "alice:REDACTED"),
    ("proxyauth", "any", "any"),
    ("proxyauth", "@/etc/ttft-relay/htpasswd", "@/etc/ttft-relay/htpasswd"),
    ("proxyauth", "ldap:localhost:cn=admin,dc=example:pw:ou=users", "ldap:localhost:cn=admin,dc=example:REDACTED:ou=users"),
    ("proxyauth", "ldaps:ldap.example:636:cn=admin:pw:ou=users?uid=x", "ldaps:ldap.example:636:cn=admin:REDACTED:ou=users?uid=x"),
    ("proxyauth", None, None),
    ("upstream_auth", "bob:pw:with:colons", "bob:REDACTED"),
    ("upstream_auth", "", ""),
    ("web_password", "$argon2id$v=19$m=65536,t=3,p=4$c2FsdA$aGFzaA", "REDACTED"),
    ("web_password", "plain", "REDACTED"),
    ("web_password", "", ""),
    ("listen_host", "127.0.0.1", "127.0.0.1"),
    ("mode", ["regular@8080"], ["regular@8080"]),
    ("listen_port", 8080, 8080),
])
def test_the_option_editor_shows_no_password(name, value, shown):
    assert redaction.shown_option_value(name, value) == shown


def _mitmweb(fake, confdir, tmp_path, **options) -> MitmdumpProcess:
    relay = MitmdumpProcess([reverse_to(fake)], confdir, options={
        "web_port": free_port(), "web_open_browser": "false", "relay_timing_log": tmp_path / "timing.jsonl",
        "relay_metrics_listen": "", **options})
    relay.args[0] = str(MITMWEB)
    return relay


def _get(url: str, headers: dict[str, str] | None = None):
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=WAIT) as resp:
        return resp.status, resp.headers, resp.read()


def test_the_printed_access_url_opens_the_ui_and_options_hide_passwords(fake, confdir, tmp_path):
    with _mitmweb(fake, confdir, tmp_path, proxyauth=f"alice:{PROXY_PASSWORD}",
                  upstream_auth=f"bob:{UPSTREAM_PASSWORD}").start() as relay:
        line = relay.wait_for_output("Web server listening at", timeout=WAIT)
        url = re.search(r"listening at (\S+)", line).group(1)
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/\?token=[0-9a-f]{32}", url), line
        token = url.rsplit("=", 1)[1]
        base = url.split("?")[0]

        status, _, page = _get(url)  # what the browser does with the printed URL
        assert status == 200 and b"<html" in page.lower()
        with pytest.raises(urllib.error.HTTPError) as refused:
            _get(base)
        assert refused.value.code == 403  # the token is still what opens it

        status, _, body = _get(f"{base}options?token={token}")
        options = orjson.loads(body)
        assert options["proxyauth"]["value"] == "alice:REDACTED"
        assert options["upstream_auth"]["value"] == "bob:REDACTED"
        assert PROXY_PASSWORD.encode() not in body and UPSTREAM_PASSWORD.encode() not in body

        # A change made in the option editor is pushed to every open UI: redacted too.
        auth = {"Authorization": f"Bearer {token}"}
        with WebSocketClient(base.replace("http:", "ws:") + "updates", auth, deflate=False) as updates:
            cookies = http.cookies.SimpleCookie()  # the UI's XSRF cookie comes with its WebSocket
            for name, value in updates.accepted.extra_headers:
                if name.lower() == b"set-cookie":
                    cookies.load(value.decode())
            xsrf = cookies["_mitmproxy_xsrf"].value
            put = urllib.request.Request(
                f"{base}options", method="PUT", data=orjson.dumps({"upstream_auth": f"carol:{UPSTREAM_PASSWORD}x"}),
                headers={**auth, "X-XSRFToken": xsrf, "Cookie": f"_mitmproxy_xsrf={xsrf}",
                         "Content-Type": "application/json"})
            with urllib.request.urlopen(put, timeout=WAIT) as resp:
                assert resp.status == 200
            while (message := updates.receive_json()[1])["type"] != "options/update":
                pass
        assert message["payload"]["upstream_auth"]["value"] == "carol:REDACTED", message
        # The options keep their values: the relay still uses them.
        assert f"carol:{UPSTREAM_PASSWORD}x" not in relay.text() and PROXY_PASSWORD not in relay.text()


def test_with_a_web_password_no_token_is_printed_and_the_password_is_not_shown(fake, confdir, tmp_path):
    with _mitmweb(fake, confdir, tmp_path, web_password=WEB_PASSWORD).start() as relay:
        line = relay.wait_for_output("Web server listening at", timeout=WAIT)
        assert re.search(r"listening at http://127\.0\.0\.1:\d+/$", line), line
        base = line.split("listening at ", 1)[1].strip()
        _, _, body = _get(f"{base}options", {"Authorization": f"Bearer {WEB_PASSWORD}"})
        assert orjson.loads(body)["web_password"]["value"] == "REDACTED"
        assert WEB_PASSWORD.encode() not in body
