"""Shared fixtures: fake upstreams and real mitmdump relays, all on loopback."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.fakes.certs import TestCerts
from tests.fakes.upstream import FakeUpstream
from tests.harness import MitmdumpProcess, descendants

FAKE_OPENAI_KEY = "sk-test-FAKEKEY-0123456789abcdefghij"
FAKE_ANTHROPIC_KEY = "sk-ant-test-FAKEKEY-0123456789abcdef"
LEFTOVER_GRACE_S = 10
"""How long processes a test stopped may take to exit before the session calls them left behind."""


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No test leaves a process behind: a relay, a fake, an agent CLI or a browser still
    running when the suite ends fails the run, with its command line."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := descendants(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling for exits that were asked for, bounded: not a sync on timing
    if left:
        listing = "\n".join(f"  {pid} {cmd[:200]}" for pid, cmd in left)
        session.config.get_terminal_writer().line(f"processes left behind by the tests:\n{listing}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
    """Starts real `mitmdump -s ttft_relay/relay.py` processes; stops them after the test.

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
    # An exception escaping an addon's hook is logged by mitmproxy and the flow goes on:
    # it is a bug all the same, whatever the test was looking at.
    errors = [line for proc in started for line in proc.output if "Addon error" in line]
    assert not errors, "an addon raised:\n" + "\n".join(errors[:5])


def reverse_to(upstream: FakeUpstream) -> str:
    return f"reverse:{upstream.base_url}@0"
