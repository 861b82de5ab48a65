"""ttft_relay/dial.py: an upstream name's addresses raced (RFC 8305), on real loopback sockets.

A black-holed address is made for real (`BlackHole`: a listener whose accept queue is full
drops every further SYN without an answer, as a dead IPv6 route does: the connect hangs,
nothing refuses).
End to end through a real mitmdump: tests/test_dial_e2e.py.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from ttft_relay import dial
from ttft_relay.testing.fakes.black_hole import BlackHole

NEVER = 30.0
"""Longer than any test here may take: a dial that waits on the black hole fails by it."""


@pytest.fixture
def dead_v6_live_v4() -> Iterator[int]:
    """A port whose [::1] address is black-holed and whose 127.0.0.1 address accepts."""
    with BlackHole(socket.AF_INET6, "::1") as hole, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as live:
        live.bind(("127.0.0.1", hole.port))
        live.listen(16)
        yield hole.port


def candidates(port: int) -> list[tuple[int, tuple]]:
    return [(socket.AF_INET6, ("::1", port, 0, 0)), (socket.AF_INET, ("127.0.0.1", port))]


def test_the_families_interleave_first_family_first():
    infos = [(socket.AF_INET6, 1, 6, "", ("::1", 1, 0, 0)), (socket.AF_INET6, 1, 6, "", ("::2", 1, 0, 0)),
             (socket.AF_INET, 1, 6, "", ("10.0.0.1", 1)), (socket.AF_INET, 1, 6, "", ("10.0.0.2", 1)),
             (socket.AF_INET6, 1, 6, "", ("::1", 1, 0, 0))]
    assert [a[0] for _, a in dial.interleave(infos)] == ["::1", "10.0.0.1", "::2", "10.0.0.2"]
    assert [a[0] for _, a in dial.interleave(infos[2:4] + infos[:2])] == ["10.0.0.1", "::1", "10.0.0.2", "::2"]


def test_a_black_holed_first_address_costs_the_delay_not_the_connect(dead_v6_live_v4):
    async def go() -> dial.Dial:
        d = dial.Dial()
        # tried in turn, the black hole would hold the connect past NEVER (the kernel retries its SYN for minutes)
        sock = await asyncio.wait_for(dial.race(candidates(dead_v6_live_v4), d, delay=0.05), NEVER)
        sock.close()
        return d

    d = asyncio.run(go())
    assert (d.used, d.family) == (f"127.0.0.1:{dead_v6_live_v4}", "ipv4")
    assert len(d.failed) == 1 and d.failed[0].startswith(f"[::1]:{dead_v6_live_v4}: no answer in ")


def test_a_refused_address_moves_on_at_once():
    closed = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    closed.bind(("::1", 0))
    port = closed.getsockname()[1]  # bound, not listening: refused
    live = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    live.bind(("127.0.0.1", port))
    live.listen(4)
    try:
        d = dial.Dial()

        async def go() -> None:
            # a delay no test may wait out: only the refusal can start the second attempt
            sock = await asyncio.wait_for(dial.race(candidates(port), d, delay=NEVER * 2), NEVER)
            sock.close()

        asyncio.run(go())
        assert d.used == f"127.0.0.1:{port}"
        assert d.failed == [f"[::1]:{port}: refused"]
    finally:
        closed.close()
        live.close()


def test_no_address_answering_names_each():
    closed = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    try:
        d = dial.Dial()
        with pytest.raises(ConnectionRefusedError, match=r"Connect call failed"):
            asyncio.run(dial.race([(socket.AF_INET, ("127.0.0.1", port))], d))
        assert d.used is None and d.failed == [f"127.0.0.1:{port}: refused"]
        d = dial.Dial()
        with pytest.raises(OSError, match=r"^Multiple exceptions: .*Connect call failed.*; .*Connect call failed"):
            asyncio.run(dial.race([(socket.AF_INET, ("127.0.0.1", port))] * 2, d))
    finally:
        closed.close()


def test_a_cancelled_dial_closes_every_attempt_and_says_what_it_tried():
    with BlackHole(socket.AF_INET, "127.0.0.1") as hole:
        async def go() -> dial.Dial:
            d = dial.Dial()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(dial.race([(socket.AF_INET, ("127.0.0.1", hole.port))], d), 0.2)
            return d

        d = asyncio.run(go())
        assert d.failed and d.failed[0].startswith(f"127.0.0.1:{hole.port}: no answer in ")


def test_open_connection_resolves_and_keeps_its_dial_in_the_task():
    live = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    live.bind(("127.0.0.1", 0))
    live.listen(4)
    port = live.getsockname()[1]
    try:
        nodelay: list[int] = []

        async def go() -> dial.Dial | None:
            reader, writer = await dial.open_connection("127.0.0.1", port)
            nodelay.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()
            return dial.last_dial.get()

        d = asyncio.run(go())
        assert d is not None and d.as_record() == {"address": f"127.0.0.1:{port}", "family": "ipv4", "failed": []}
        assert nodelay == [1], "Nagle off, as on asyncio's own connections"
    finally:
        live.close()


def test_the_winner_over_a_dead_first_address_is_tried_first_next_time(dead_v6_live_v4):
    name = ("dual.test", dead_v6_live_v4)
    resolved = candidates(dead_v6_live_v4)
    assert dial.preferred_first(name, resolved, 0.0) == resolved

    async def go() -> tuple[dial.Dial, dial.Dial]:
        first, second = dial.Dial(), dial.Dial()
        sock = await asyncio.wait_for(dial.race(dial.preferred_first(name, resolved, 0.0), first, delay=0.05), NEVER)
        dial.remember(name, resolved, sock, 0.0)
        sock.close()
        # a delay no test may wait out: only trying the live address first answers in time
        sock = await asyncio.wait_for(dial.race(dial.preferred_first(name, resolved, 1.0), second, delay=NEVER * 2),
                                      NEVER)
        sock.close()
        return first, second

    first, second = asyncio.run(go())
    assert first.failed and not second.failed and second.used == f"127.0.0.1:{dead_v6_live_v4}"
    assert dial.preferred_first(name, resolved, dial.PREFER_S + 1) == resolved, "remembered for a while only"
