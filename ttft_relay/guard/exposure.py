"""Exposure: a relay that would serve other machines without authentication or TLS does not start.

    Exposure        refuses to start (or to take an option change) that would serve
                    other machines without authentication or TLS: a non-loopback
                    listener without proxyauth (proxies) or relay access keys (reverse
                    listeners), or without a TLS certificate (`certs`, ttft_relay/guard/tls.py)
                    unless `relay_client_tls` is optional; or mitmweb on a
                    non-loopback web_host without web_password.
                    `relay_allow_open_proxy` overrides the listener check for relays
                    firewalled elsewhere.

What a listener is, as the other guards ask it, is here too: whether it is this machine
only (`is_loopback`), whether it is a reverse HTTP listener (`is_http_reverse`).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
from collections.abc import Sequence
from typing import TypeGuard

from mitmproxy import ctx, exceptions
from mitmproxy.proxy import mode_specs

logger = logging.getLogger(__name__)

HTTP_REVERSE_SCHEMES = ("http", "https", "http3")


@functools.lru_cache(maxsize=256)
def is_loopback(host: str) -> bool:
    """Whether a listen host is this machine only. "" means every interface; names
    other than localhost are not resolved (and so count as exposed). Kept per host:
    `tls.ClientTLS` asks for every request, and parsing the address is most of what
    that hook costs."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_http_reverse(mode: mode_specs.ProxyMode) -> TypeGuard[mode_specs.ReverseMode]:
    return isinstance(mode, mode_specs.ReverseMode) and mode.scheme in HTTP_REVERSE_SCHEMES


def required_protection(mode: mode_specs.ProxyMode) -> str | None:
    """The option that protects a listener of this kind from strangers, or None
    when the relay has nothing to protect it with (transparent, DNS, raw TCP/UDP
    reverse, WireGuard: mitmproxy's own keys, not checked here)."""
    if is_http_reverse(mode):
        # proxyauth would demand Basic credentials here and reject SDKs' API keys.
        return "relay_access_keys"
    if isinstance(mode, (mode_specs.RegularMode, mode_specs.UpstreamMode, mode_specs.Socks5Mode)):
        return "proxyauth"
    return None


CLIENT_TLS_OFF_LOOPBACK, CLIENT_TLS_ALL, CLIENT_TLS_OPTIONAL = "off-loopback", "all", "optional"
"""`relay_client_tls` (ttft_relay/guard/tls.py): which listeners accept only TLS clients."""
TLS_CAPABLE = (mode_specs.ReverseMode, mode_specs.RegularMode, mode_specs.UpstreamMode)
"""Listener kinds on which mitmproxy terminates a client's TLS (socks5 cannot)."""


def requires_tls(client_tls: str, loopback: bool) -> bool:
    """Whether a listener accepts only TLS clients under the `relay_client_tls` policy."""
    return client_tls == CLIENT_TLS_ALL or (client_tls == CLIENT_TLS_OFF_LOOPBACK and not loopback)


def unprotected_listeners(
    modes: Sequence[str], listen_host: str, proxyauth: str | None, access_keys: bool,
    client_tls: str = CLIENT_TLS_OFF_LOOPBACK, certs: bool = False,
) -> list[str]:
    """One line per listener that would serve other machines without authentication,
    or without TLS: off loopback a listener needs both (or `client_tls` optional, the
    explicit opt-out for TLS that ends in front of the relay). TLS means a certificate
    from mitmproxy's `certs`, not one from mitmproxy's own CA."""
    protected = {
        "proxyauth": bool(proxyauth) and proxyauth != "any",  # "any" accepts every password
        "relay_access_keys": access_keys,
    }
    found = []
    for spec in modes:
        mode = mode_specs.ProxyMode.parse(spec)
        if mode.listen_port() is None:  # local/tun modes: no network listener
            continue
        host = mode.listen_host(listen_host)
        if is_loopback(host):
            continue
        needed = required_protection(mode)
        if needed is None:
            found.append(f"{spec} on {host or 'all interfaces'} (the relay cannot protect this kind of listener)")
            continue
        problems = [] if protected[needed] else [f"(set {needed})"]
        if requires_tls(client_tls, loopback=False):
            if not isinstance(mode, TLS_CAPABLE):
                problems.append("without TLS (this kind cannot have it: set relay_client_tls=optional)")
            elif not certs:
                problems.append("without TLS (set certs)")
        if problems:
            found.append(f"{spec} on {host or 'all interfaces'} {' '.join(problems)}")
    return found


def plain_http_listeners(modes: Sequence[str], listen_host: str, client_tls: str) -> list[str]:
    """Listeners off loopback that accept plain HTTP (relay_client_tls=optional)."""
    if client_tls != CLIENT_TLS_OPTIONAL:
        return []
    return [spec for spec in modes if (mode := mode_specs.ProxyMode.parse(spec)).listen_port() is not None
            and not is_loopback(mode.listen_host(listen_host))]


def web_ui_problem(web_host: str, web_password: str) -> str | None:
    """Why mitmweb's UI would be unsafe on `web_host`, or None.

    mitmweb always requires a password or, without one, a random token; but that
    token is printed to the console at every start, so anyone who reads the logs can
    drive a UI that shows every request and answer and can replay them.
    """
    if is_loopback(web_host) or web_password:
        return None
    return (
        f"mitmweb on web_host {web_host or 'all interfaces'} needs web_password "
        "(preferably an argon2 hash; without it the UI token is printed to the console)"
    )


class Exposure:
    """Refuses to serve other machines without authentication. Checked in
    `configure`, so it covers options from the command line, mitm.conf (applied
    before this addon loads) and later changes alike: at start an OptionsError
    makes mitmproxy exit, later it rejects the change."""

    WATCHED = {"mode", "listen_host", "proxyauth", "relay_access_keys", "relay_allow_open_proxy",
               "web_host", "web_password", "relay_client_tls", "certs"}

    def __init__(self) -> None:
        self.last_warning = ""

    def load(self, loader) -> None:
        loader.add_option(
            "relay_allow_open_proxy",
            bool,
            False,
            "Serve non-loopback listeners without proxyauth / relay_access_keys. Only "
            "for relays that a firewall protects.",
        )

    def configure(self, updated: set[str]) -> None:
        if not updated & self.WATCHED:
            return
        opts = ctx.options
        if "web_host" in opts and (problem := web_ui_problem(opts.web_host, opts.web_password)):
            raise exceptions.OptionsError(f"refusing to start: {problem}")
        client_tls = opts.relay_client_tls if "relay_client_tls" in opts else CLIENT_TLS_OFF_LOOPBACK
        exposed = unprotected_listeners(opts.mode, opts.listen_host, opts.proxyauth, bool(opts.relay_access_keys),
                                        client_tls, bool(opts.certs))
        if exposed and not opts.relay_allow_open_proxy:
            raise exceptions.OptionsError(
                "refusing to start as an open proxy: " + "; ".join(exposed) + ". Listen on 127.0.0.1, "
                "or set relay_allow_open_proxy=true if a firewall protects these listeners."
            )
        warning = ""
        if exposed:
            warning = "serving without authentication (relay_allow_open_proxy): " + "; ".join(exposed)
        elif plain := plain_http_listeners(opts.mode, opts.listen_host, client_tls):
            warning = ("accepting plain HTTP off loopback (relay_client_tls=optional), safe only where TLS ends "
                       "in front of the relay: " + "; ".join(plain))
        elif opts.proxyauth and any(is_http_reverse(mode_specs.ProxyMode.parse(m)) for m in opts.mode):
            warning = ("proxyauth applies to reverse listeners too, where it demands Basic credentials "
                       "and so rejects API keys; protect reverse listeners with relay_access_keys instead")
        if warning and warning != self.last_warning:
            logger.warning(warning)
        self.last_warning = warning
