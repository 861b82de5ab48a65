"""Shared fixtures: fake upstreams and real mitmdump relays, all on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.fakes.certs import TestCerts
from tests.fakes.upstream import FakeUpstream
from tests.harness import MitmdumpProcess

FAKE_OPENAI_KEY = "sk-test-FAKEKEY-0123456789abcdefghij"
FAKE_ANTHROPIC_KEY = "sk-ant-test-FAKEKEY-0123456789abcdef"


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> TestCerts:
    return TestCerts.create(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def fake() -> Iterator[FakeUpstream]:
    with FakeUpstream() as upstream:
        yield upstream


@pytest.fixture
def fake_tls(certs) -> Iterator[FakeUpstream]:
    with FakeUpstream(tls=True, certs=certs) as upstream:
        yield upstream


@pytest.fixture(scope="session")
def confdir(tmp_path_factory) -> Path:
    """One mitmproxy confdir (and CA) for the session: CA generation costs a second per relay."""
    return tmp_path_factory.mktemp("confdir")


RelayFactory = Callable[..., MitmdumpProcess]


@pytest.fixture
def start_relay(tmp_path, confdir, certs) -> Iterator[RelayFactory]:
    """Starts real `mitmdump -s addons/relay.py` processes; stops them after the test.

    `start_relay("reverse:http://127.0.0.1:PORT@0", relay_trim=False, ...)`: modes as
    positional arguments, options as keywords. The timing log goes to the test's
    tmp_path, and upstream TLS is verified against the test CA.
    """
    started: list[MitmdumpProcess] = []

    def start(*modes: str, script: Path | None | str = "relay", relay_conf: Path | None = None,
              **options: object) -> MitmdumpProcess:
        opts: dict[str, object] = {"ssl_verify_upstream_trusted_ca": certs.ca_pem}
        kwargs = {}
        if script == "relay":
            opts["relay_timing_log"] = tmp_path / "timing.jsonl"
        else:
            kwargs["script"] = script
        opts.update(options)
        proc = MitmdumpProcess(list(modes), confdir, options=opts, relay_conf=relay_conf, **kwargs)
        started.append(proc)
        return proc.start()

    yield start
    for proc in started:
        proc.stop()


def reverse_to(upstream: FakeUpstream) -> str:
    return f"reverse:{upstream.base_url}@0"
