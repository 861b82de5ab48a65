"""Shared fixtures: fake upstreams and real mitmdump relays on loopback, and real far links
(`far_link`: network namespaces joined by a delaying, lossy packet forwarder)."""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.agent_clis import Clis, installed_clis
from ttft_relay.testing.fakes import RefusingProxy, link
from ttft_relay.testing.fakes.certs import TestCerts
from ttft_relay.testing.fakes.upstream import FakeUpstream
from ttft_relay.testing.harness import MitmdumpProcess, descendants, start_fake_upstream

FAKE_OPENAI_KEY = "sk-test-FAKEKEY-0123456789abcdefghij"
FAKE_ANTHROPIC_KEY = "sk-ant-test-FAKEKEY-0123456789abcdef"
LEFTOVER_GRACE_S = float(os.environ.get("TTFT_TEST_LEFTOVER_GRACE_S", 10))
"""How long processes a test stopped may take to exit before the session calls them left behind
(tests/test_conftest_checks.py shortens it for the runs it makes leak on purpose)."""
LEFT_BY_WORKERS = pytest.StashKey[list[str]]()


def left_behind() -> list[str]:
    """This process's live descendants, once those the tests stopped had `LEFTOVER_GRACE_S` to exit."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := descendants(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling for exits that were asked for, bounded: not a sync on timing
    return [f"  {pid} {cmd[:200]}" for pid, cmd in left]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No test leaves a process behind: a relay, a fake, an agent CLI or a browser still
    running when the suite ends fails the run, with its command line.

    Under pytest-xdist each worker looks below itself (the tests ran there) and hands
    what it found to the controller (`pytest_testnodedown`), which reports and fails."""
    config = session.config
    if hasattr(config, "workeroutput"):  # an xdist worker
        config.workeroutput["left_behind"] = left_behind()
        return
    if config.pluginmanager.hasplugin("dsession"):  # the controller: its children are the workers
        left = config.stash.get(LEFT_BY_WORKERS, [])
    else:
        left = left_behind()
    if left:
        config.get_terminal_writer().line("processes left behind by the tests:\n" + "\n".join(left), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """An xdist worker finished: keep what it found left behind for the controller's report."""
    found = (getattr(node, "workeroutput", None) or {}).get("left_behind", [])
    node.config.stash.setdefault(LEFT_BY_WORKERS, []).extend(f"{line} (worker {node.gateway.id})" for line in found)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules holding tests marked `slow` run first, those with the most of them first. Under
    pytest-xdist (scripts/test: `--dist loadfile --no-loadscope-reorder`) a module's tests stay
    on one worker and modules are handed out in this order, so a long module handed out last
    would run on alone after the others finished; first, the short ones fill in around it.
    `-m "not slow"` leaves the slow tests out of a quick run; CI runs them all."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable: each module keeps its own order


@pytest.fixture(scope="session", autouse=True)
def relay_cache_dir(tmp_path_factory) -> Iterator[Path]:
    """The relay's cache (its parsed tokenizers, `trim.rank_cache`) in a temporary directory
    for the session, for the tests and every relay they start, not in the user's ~/.cache."""
    path = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CACHE_DIRECTORY", raising=False)
        mp.setenv("XDG_CACHE_HOME", str(path))
        yield path / "ttft-relay"


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> TestCerts:
    return TestCerts.create(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def fake(request) -> Iterator[FakeUpstream]:
    """A fake upstream of the test's own, or in a module marked `shared_fake` the module's."""
    if request.node.get_closest_marker("shared_fake"):
        yield request.getfixturevalue("module_fake").forget()
        return
    with FakeUpstream() as upstream:
        yield upstream


@pytest.fixture
def fake_tls(request, certs) -> Iterator[FakeUpstream]:
    """`fake` over TLS (certificates from the test CA)."""
    if request.node.get_closest_marker("shared_fake"):
        yield request.getfixturevalue("module_fake_tls").forget()
        return
    with FakeUpstream(tls=True, certs=certs) as upstream:
        yield upstream


@pytest.fixture(scope="module")
def module_fake() -> Iterator[FakeUpstream]:
    """One fake upstream for a module's shared relays (a reverse relay names its port): in a
    module marked `shared_fake`, `fake` is this one, forgetting between tests (`forget()`)."""
    with FakeUpstream() as upstream:
        yield upstream


@pytest.fixture(scope="module")
def module_fake_tls(certs) -> Iterator[FakeUpstream]:
    """`module_fake` over TLS: `fake_tls` in a module marked `shared_fake`."""
    with FakeUpstream(tls=True, certs=certs) as upstream:
        yield upstream


@pytest.fixture(scope="module")
def clis() -> Clis:
    """The real Codex CLI and Claude Code, installed from npm on first use (tests/agent_clis.py)."""
    return installed_clis()


@pytest.fixture(scope="module")
def refusing() -> Iterator[RefusingProxy]:
    """The agents' HTTPS_PROXY: it refuses every host, so the CLIs cannot call home."""
    with RefusingProxy() as proxy:
        yield proxy


@pytest.fixture
def rid(request) -> str:
    """An `x-request-id` for this test's requests: how it finds its records in a shared relay's log."""
    return request.node.name


@pytest.fixture(scope="session")
def confdir(tmp_path_factory) -> Path:
    """One mitmproxy confdir (and CA) for the session: CA generation costs a second per relay."""
    return tmp_path_factory.mktemp("confdir")


RelayFactory = Callable[..., MitmdumpProcess]


class Relays:
    """Starts real `mitmdump -s ttft_relay/relay.py` processes; `close()` stops them and fails on
    an addon error in their output or a wrong count of records (`TimingLog.check_counts`).

    `start("reverse:http://127.0.0.1:PORT@0", relay_trim=False, ...)`: modes as positional
    arguments, options as keywords. Upstream TLS is verified against the test CA. The
    timing log goes to `log_for()`. The relay starts as its command starts it, with the
    relay's defaults for mitmproxy's options (`config.MITMPROXY_DEFAULTS`: HTTP/1.1 only;
    an HTTP/2 test sets `http2=True`).
    """

    def __init__(self, confdir: Path, certs: TestCerts, log_for: Callable[[int], Path]) -> None:
        self.confdir, self.certs, self.log_for = confdir, certs, log_for
        self.started: list[MitmdumpProcess] = []

    def start(self, *modes: str, script: Path | None | str = "relay", relay_conf: Path | None = None,
              **options: object) -> MitmdumpProcess:
        from ttft_relay import config  # here: it loads mitmproxy's addons, which the fakes need not

        opts: dict[str, object] = {"ssl_verify_upstream_trusted_ca": self.certs.ca_pem}
        kwargs = {}
        if script == "relay":
            if relay_conf is None:  # as its command starts it (which does this itself)
                opts.update(config.MITMPROXY_DEFAULTS)
            opts["relay_timing_log"] = self.log_for(len(self.started))
            # A port of its own: the default 9464 is the README's, which a relay run by hand
            # (or .ci/quickstart.py) on the same machine holds.
            opts["relay_metrics_listen"] = "127.0.0.1:0"
        else:
            kwargs["script"] = script
        opts.update(options)
        proc = MitmdumpProcess(list(modes), self.confdir, options=opts, relay_conf=relay_conf, **kwargs)
        self.started.append(proc)
        return proc.start()

    def close(self) -> None:
        for proc in self.started:
            proc.interrupt()  # all at once: they shut down side by side
        for proc in self.started:
            proc.stop()
        # An exception escaping an addon's hook is logged by mitmproxy and the flow goes on:
        # it is a bug all the same, whatever the test was looking at.
        errors = [line for proc in self.started for line in proc.output if "Addon error" in line]
        assert not errors, "an addon raised:\n" + "\n".join(errors[:5])
        for proc in self.started:
            if proc.log is not None:
                proc.log.check_counts()


@pytest.fixture
def start_relay(tmp_path, confdir, certs) -> Iterator[RelayFactory]:
    """Relays for one test (`Relays.start`), stopped after it; their timing log is the test's
    tmp_path/timing.jsonl."""
    relays = Relays(confdir, certs, lambda _: tmp_path / "timing.jsonl")
    yield relays.start
    relays.close()


@pytest.fixture(scope="module")
def shared_relay(tmp_path_factory, confdir, certs) -> Iterator[RelayFactory]:
    """`start_relay` for cases that differ only by request (the fakes take per-request
    `x-fake-*` knobs): the module's tests asking for the same modes and options get the same
    relay, started on first use and stopped after the module's last test. Each relay has its
    own timing log (`relay.log`), in which a test finds its records by `rid`."""
    logs = tmp_path_factory.mktemp("relays")
    relays = Relays(confdir, certs, lambda n: logs / f"timing-{n}.jsonl")
    by_options: dict[str, MitmdumpProcess] = {}

    def shared(*modes: str, **options: object) -> MitmdumpProcess:
        key = repr((modes, sorted(options.items())))
        if key not in by_options:
            by_options[key] = relays.start(*modes, **options)
        return by_options[key]

    yield shared
    relays.close()


def reverse_to(upstream: FakeUpstream) -> str:
    return f"reverse:{upstream.base_url}@0"


@pytest.fixture
def fake_in() -> Iterator[Callable[..., str]]:
    """`fake_in(side, **knobs)`: a fake upstream as its own process in a far link's namespace
    (`start_fake_upstream`), stopped after the test; returns its base URL there."""
    started: list[subprocess.Popen[str]] = []

    def make(side: link.Side, **knobs: object) -> str:
        proc, url = start_fake_upstream(wrap=side.adopt, **knobs)
        started.append(proc)
        return url

    yield make
    for proc in started:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def far_link() -> Iterator[Callable[..., link.FarLink]]:
    """`FarLink(**shape)` for this test (ttft_relay/testing/fakes/link.py), closed after it with everything
    still running in its namespaces; skipped where this machine cannot build one."""
    if (reason := link.unavailable()) is not None:
        pytest.skip(f"no far link here: {reason}")
    made: list[link.FarLink] = []

    def make(**shape: object) -> link.FarLink:
        made.append(link.FarLink(**shape))  # type: ignore[arg-type]
        return made[-1].start()

    yield make
    for built in made:
        built.close()



@pytest.fixture(autouse=True)
def _mitmproxy_unpatched() -> Iterator[None]:
    """Each test starts with mitmproxy's own code: `taddons.context` runs an addon's `load`
    and `configure` (where the relay's addons install their patches) but never its `done`
    (where they are removed), so a test of an addon would otherwise leave its patches to
    whichever test its xdist worker runs next (a pin test then reads the patch, not
    mitmproxy's function)."""
    from ttft_relay import patches
    yield
    patches.uninstall_all()
