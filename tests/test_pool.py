"""The upstream pool's pure parts: which connections it keeps warm, what a request sends upstream."""

from __future__ import annotations

import socket

import pytest
from mitmproxy import optmanager
from mitmproxy.test import tutils

from ttft_relay import upstream_pool
from ttft_relay.patches.speed.upstream_pool import PoolKey


def test_warm_connections_for_each_reverse_listeners_http_upstream():
    modes = ["reverse:https://api.openai.com@8001", "reverse:http://127.0.0.1:9000@8002",
             "reverse:https://api.openai.com@8003", "regular@8080", "reverse:tcp://10.0.0.1:22@2222"]
    assert upstream_pool.warm_keys(modes, keep_host_header=False) == [
        PoolKey("api.openai.com", 443, True, "api.openai.com"), PoolKey("127.0.0.1", 9000, False, None)]
    # With the client's Host kept, the SNI is each client's: nothing to open ahead for HTTPS.
    assert upstream_pool.warm_keys(modes, keep_host_header=True) == [PoolKey("127.0.0.1", 9000, False, None)]


def test_a_clients_close_is_its_own_hop():
    request = tutils.treq()
    for sent, upstream in [("close", None), ("Close", None), ("keep-alive", None), ("close, Upgrade", "Upgrade"),
                           ("Upgrade", "Upgrade")]:
        request.headers["connection"] = sent
        upstream_pool.drop_close(request)
        assert request.headers.get("connection") == upstream, sent


def test_every_option_can_be_set_on_the_command_line():
    # mitmproxy's --set parses bool, int, str and sequences of str only (a float option failed
    # the relay's start: "unsupported option type").
    options = optmanager.OptManager()
    upstream_pool.UpstreamPool().load(options)
    options.set("relay_upstream_pool=true", "relay_upstream_pool_warm=1", "relay_upstream_pool_idle=5",
                "relay_upstream_pool_max=4", "relay_upstream_pool_silence=12", "relay_upstream_pool_congestion=reno")
    assert (options.relay_upstream_pool, options.relay_upstream_pool_warm, options.relay_upstream_pool_idle,
            options.relay_upstream_pool_max, options.relay_upstream_pool_silence,
            options.relay_upstream_pool_congestion) == (True, 1, 5, 4, 12, "reno")


def test_a_pooled_socket_is_given_up_after_its_silence_bound():
    with socket.socket() as sock:
        upstream_pool.watch_for_silence(sock, 15)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        tcp = socket.IPPROTO_TCP
        # Probes after 5 s of quiet, every 5 s; unanswered data or probes end it at 15 s.
        set_to = [sock.getsockopt(tcp, option) for option in (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL,
                                                              socket.TCP_KEEPCNT, socket.TCP_USER_TIMEOUT)]
        assert set_to == [5, 5, 3, 15000]
    with socket.socket() as sock:
        upstream_pool.watch_for_silence(sock, 0)  # the system's own limits
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 0


@pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="no TCP_CONGESTION on this system")
def test_a_pooled_socket_takes_the_congestion_control_asked_for_where_the_kernel_has_it():
    def congestion(sock: socket.socket) -> bytes:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0")

    with socket.socket() as sock:
        system = congestion(sock)
        assert not upstream_pool.set_congestion_control(sock, "")  # the system's
        assert not upstream_pool.set_congestion_control(sock, "no-such-control")  # refused: the system's kept
        assert congestion(sock) == system
        assert upstream_pool.set_congestion_control(sock, "reno")  # every Linux has it, and allows it to anyone
        assert congestion(sock) == b"reno"


def test_an_upstream_whose_kept_connections_die_gets_less_reuse_then_none_and_again_later():
    life = upstream_pool.KeptConnectionLife()
    key, other = PoolKey("api.example.com", 443, True, "api.example.com"), PoolKey("127.0.0.1", 9000, False, None)
    assert life.limit(key, 0.0) is None and life.offers(key, 25.0, answered=True, now=0.0)
    # An idle timeout of 5 s: connections idle up to 0.8 of it are still reused (said once).
    assert life.died(key, 5.0, now=10.0) == 4.0
    assert life.offers(key, 3.9, answered=True, now=11.0) and not life.offers(key, 4.1, answered=True, now=11.0)
    assert life.died(key, 6.0, now=12.0) is None  # a longer life teaches nothing new
    assert life.limit(key, 12.0) == 4.0 and life.limit(other, 12.0) is None
    # Kept connections that die shortly after their answer: none that carried a request is reused,
    # a fresh one (opened ahead, never answered) still is.
    assert life.died(key, 0.05, now=13.0) == 0.0
    assert life.died(key, 0.01, now=13.5) is None  # cut back already: not said again
    assert not life.offers(key, 0.0, answered=True, now=14.0)
    assert life.offers(key, 0.5, answered=False, now=14.0)
    # A minute with no connection dying: reuse again.
    assert not life.offers(key, 0.0, answered=True, now=13.5 + upstream_pool.FORGET_AFTER_S)
    assert life.offers(key, 0.0, answered=True, now=14.0 + upstream_pool.FORGET_AFTER_S)
    assert life.limit(key, 14.0 + upstream_pool.FORGET_AFTER_S) is None
