"""Client TLS: listeners that accept only TLS, with the user's own certificate.

On a VPS the relay is reached over the internet, where a plain-HTTP listener would
carry relay keys and prompts in clear. mitmproxy already terminates TLS on a
listener whenever the client opens with a TLS handshake (reverse listeners and HTTP
proxies alike), and presents the certificate that its `certs` option names for the
name the client asked for (SNI) instead of one from its own CA:

    certs: [relay.example.com=/etc/ttft-relay/tls/relay.pem]

(a Let's Encrypt `fullchain.pem` followed by its `privkey.pem`, in one file: mitmproxy
reads the key from the certificate's file). Naming the domain keeps mitmproxy's CA
for everything else, e.g. what an HTTPS-proxy listener intercepts. A renewed
certificate is read on SIGHUP (ttft_relay/reload.py) without dropping a connection.

This addon decides which listeners accept *only* TLS and answers a plain-HTTP
request there with a 400 that says what to do, before its body is read or any key
is looked at:

    relay_client_tls   off-loopback (default)  listeners off loopback accept only TLS
                       all                     every listener does
                       optional                plain HTTP is accepted everywhere: TLS
                                               ends in front of the relay (a load
                                               balancer), the explicit opt-out

The open-proxy guard (`exposure.unprotected_listeners`) counts a listener off loopback
as protected only with its authentication *and* TLS with a certificate from
`certs`, unless `relay_client_tls` is optional.
"""

from __future__ import annotations

import datetime
import logging
import weakref
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from mitmproxy import ctx, exceptions, http

from .. import state
from .exposure import CLIENT_TLS_ALL, CLIENT_TLS_OFF_LOOPBACK, CLIENT_TLS_OPTIONAL, TLS_CAPABLE, is_loopback, requires_tls
from .refusals import api_shape, refusal

logger = logging.getLogger(__name__)

POLICIES = (CLIENT_TLS_OFF_LOOPBACK, CLIENT_TLS_ALL, CLIENT_TLS_OPTIONAL)
EXPIRY_WARNING = datetime.timedelta(days=14)
PLAIN_HTTP_REFUSED = "plain HTTP refused: this listener accepts only TLS (use an https:// URL)"


def cert_file(spec: str) -> Path:
    """The file of a `certs` entry, `[domain=]path`."""
    return Path(spec.split("=", 1)[-1]).expanduser()


def check_cert_file(path: Path, now: datetime.datetime | None = None) -> tuple[str | None, str | None]:
    """(why `path` cannot serve as a TLS certificate, a warning) — each None when there
    is nothing to say. The file must hold the certificate (chain, leaf first) and its
    private key, as mitmproxy's `certs` option reads it."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        return f"cannot read {path}: {e.strerror}", None
    try:
        leaf = x509.load_pem_x509_certificates(raw)[0]
    except ValueError:
        return f"{path} holds no PEM certificate", None
    try:
        key = serialization.load_pem_private_key(raw, password=None)
    except (ValueError, TypeError):
        return (f"{path} holds no unencrypted private key: put the key after the certificate chain "
                "(cat fullchain.pem privkey.pem)"), None
    if key.public_key() != leaf.public_key():
        return f"the private key in {path} does not belong to its first certificate", None
    left = leaf.not_valid_after_utc - (now or datetime.datetime.now(datetime.UTC))
    if left <= datetime.timedelta(0):
        return None, f"the certificate in {path} has expired"
    if left < EXPIRY_WARNING:
        return None, f"the certificate in {path} expires in {left.days} days"
    return None, None


def check_certs(specs: Sequence[str]) -> list[str]:
    """Warnings about the `certs` entries; raises OptionsError for an unusable one."""
    warnings = []
    for spec in specs:
        problem, warning = check_cert_file(cert_file(spec))
        if problem:
            raise exceptions.OptionsError(f"certs: {problem}")
        if warning:
            warnings.append(warning)
    return warnings


class ClientTLS:
    """Refuses plain HTTP on listeners that accept only TLS (`relay_client_tls`)."""

    def __init__(self) -> None:
        self.policy = CLIENT_TLS_OFF_LOOPBACK
        self.refused: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()

    def load(self, loader) -> None:
        loader.add_option(
            "relay_client_tls",
            str,
            CLIENT_TLS_OFF_LOOPBACK,
            "Which listeners accept only TLS clients (plain HTTP gets a 400): off-loopback, all, or "
            "optional (none: only when TLS ends in front of the relay). The certificate comes from "
            "mitmproxy's certs option.",
            choices=POLICIES,
        )

    def configure(self, updated: set[str]) -> None:
        if "relay_client_tls" in updated:
            self.policy = ctx.options.relay_client_tls
        if "certs" in updated:
            for warning in check_certs(ctx.options.certs):
                logger.warning(warning)

    def _plain_on_tls_listener(self, flow: http.HTTPFlow) -> bool:
        mode = flow.client_conn.proxy_mode
        if flow.response is not None or flow.client_conn.tls_established or not isinstance(mode, TLS_CAPABLE):
            return False
        return requires_tls(self.policy, is_loopback(mode.listen_host(ctx.options.listen_host)))

    def http_connect(self, flow: http.HTTPFlow) -> None:
        # An HTTPS-proxy client sends CONNECT in clear: an https:// proxy URL wraps it in TLS.
        if self._plain_on_tls_listener(flow):
            flow.response = http.Response.make(
                400, f"ttft-relay: {PLAIN_HTTP_REFUSED.replace('an https:// URL', 'an https:// proxy URL')}\n",
                {"content-type": "text/plain; charset=utf-8", "connection": "close"})

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if self._plain_on_tls_listener(flow):
            self.refused.add(flow)
            flow.response = refusal(api_shape(flow.request), 400, PLAIN_HTTP_REFUSED)
            flow.response.headers["connection"] = "close"

    def request(self, flow: http.HTTPFlow) -> None:
        # After scope attached the flow's state: the record says the relay refused it.
        if flow in self.refused and (st := state.get(flow)) is not None:
            st.record_error(PLAIN_HTTP_REFUSED, phase="relay")
