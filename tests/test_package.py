"""The package as a user installs it: `pip install .` gives the `ttft-relay` command, whose
addon runs in mitmdump with no checkout beside it."""

from __future__ import annotations

import ast
import os
import re
import runpy
import subprocess
import sys
import tomllib
from pathlib import Path

import orjson
import pytest

from ttft_relay.testing import report_samples
from ttft_relay.testing.fakes import answer_pieces
from ttft_relay.testing.fakes.client import stream_post
from ttft_relay.testing.harness import REPO

from ttft_relay import cli, config, launch


def test_addon_path_names_the_addon_file():
    assert launch.ADDON.name == "relay.py" and launch.ADDON.parent.name == "ttft_relay" and launch.ADDON.exists()
    assert cli.main(["no-such-command"]) == 2


def test_version_names_the_relay_mitmproxy_and_python(capsys):
    from mitmproxy.version import VERSION

    import ttft_relay

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"ttft-relay {ttft_relay.__version__} (mitmproxy {VERSION}, Python 3.")


@pytest.mark.parametrize("command, tool", [("run", "mitmdump"), ("web", "mitmweb")])
def test_help_leads_with_the_relays_own_options(command, tool, capsys):
    # It was mitmproxy's 400 lines of help, with no word of --workers or any relay_* option.
    assert cli.main([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: ttft-relay {command} ")
    relay_part, _, tool_part = text.partition(f"{tool}'s own options")
    assert "--listen-host" in tool_part and "--listen-host" not in relay_part
    assert ("--workers N|auto" in relay_part) == (command == "run")
    assert "listeners:   regular@8080, reverse:https://api.openai.com@8001" in relay_part
    documented = re.findall(r"^# (relay_\w+): ", config.DEFAULT_CONF.read_text(), re.M)
    assert len(documented) > 30 and [n for n in documented if f"\n  {n} = " not in relay_part] == []
    # The README's "change first" options open it (it was speed patches, backlog and hook plans first).
    shown = re.findall(r"^  (\w+) = ", relay_part, re.M)
    assert shown[:len(cli.FIRST_OPTIONS)] == list(cli.FIRST_OPTIONS) and len(shown) == len(set(shown))


def test_diagnose_help_says_where_the_key_comes_from():
    done = subprocess.run([sys.executable, "-m", "ttft_relay", "diagnose", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0
    assert re.search(r"OPENAI_API_KEY +--api openai.chat / openai.responses", done.stdout), done.stdout
    assert re.search(r"ANTHROPIC_API_KEY +--api anthropic.messages", done.stdout), done.stdout


def test_bench_runs_the_checkouts_benchmarks(capsys):
    assert cli.main(["bench", "--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in ("ttft", "websocket", "overhead", "streams", "burst", "trim"))
    assert cli.main(["bench", "no-such-benchmark"]) == 2
    # A benchmark runs as a module of the checkout, its benchmarks/ importable beside the package.
    done = subprocess.run([sys.executable, "-m", "ttft_relay", "bench", "burst", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--bursts" in done.stdout, done.stderr[-2000:]


CHECKOUT_ONLY = {"tests", "benchmarks", "scripts"}
TEST_SUPPORT = "ttft_relay.testing"


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in one of the package's files, relative ones made absolute;
    `from a import b` names both `a` and `a.b` (b may be a module)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def is_under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_relay_never_imports_test_support_benchmarks_or_scripts():
    # What `pip install .` ships must run without the checkout around it, and the relay's own
    # modules (all the addons and the command load) never load the test support shipped beside them.
    found = []
    for path in sorted((REPO / "ttft_relay").rglob("*.py")):
        in_support = is_under(".".join(path.relative_to(REPO).parts), TEST_SUPPORT)
        for line, name in imports_of(path):
            if name.split(".")[0] in CHECKOUT_ONLY or (not in_support and is_under(name, TEST_SUPPORT)):
                found.append(f"{path.relative_to(REPO)}:{line} {name}")
    assert found == []


def test_the_relay_loads_without_the_test_support():
    # Every module of the relay imported as the tools import them: none pulls the test support
    # in, however it imports (importlib and strings included).
    names = sorted(".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
                   for p in (REPO / "ttft_relay").rglob("*.py"))
    names = [n for n in names if not is_under(n, TEST_SUPPORT) and n != "ttft_relay.__main__"]
    assert "ttft_relay.relay" in names and "ttft_relay.cli" in names
    script = ("import importlib, json, sys\n"
              f"for name in {names!r}: importlib.import_module(name)\n"
              "print(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TTFT_RELAY_CONF": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = orjson.loads(done.stdout.splitlines()[-1])
    assert [n for n in loaded if is_under(n, TEST_SUPPORT) or n.split(".")[0] in CHECKOUT_ONLY] == []


def test_pip_install_gives_a_working_command(tmp_path):
    # Installed into a folder of its own; the test environment's packages stand in for the
    # pinned dependencies (no download).
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(REPO)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-2000:]
    env = {**{k: v for k, v in os.environ.items() if k != "TTFT_RELAY_CONF"}, "PYTHONPATH": str(target)}
    command = target / "bin" / "ttft-relay"
    addon = subprocess.run([str(command), "addon-path"], capture_output=True, text=True, check=True, env=env,
                           cwd=tmp_path).stdout.strip()
    assert Path(addon) == target / "ttft_relay" / "relay.py"  # the installed copy, not the checkout's
    # The tools users run on their VPS, from the installed copy.
    for tool, usage in (("diagnose", "usage: ttft-relay diagnose"), ("report", "usage: ttft-relay report")):
        done = subprocess.run([str(command), tool, "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert done.returncode == 0 and done.stdout.startswith(usage), done.stdout + done.stderr
    log = tmp_path / "timing.jsonl"
    log.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in report_samples.day(30)))
    page = tmp_path / "report.html"
    report = subprocess.run([str(command), "report", str(log), "--html", str(page)], capture_output=True, text=True,
                            env=env, cwd=tmp_path)
    assert report.returncode == 0 and " requests, " in report.stdout, report.stdout + report.stderr
    assert "<script" in page.read_text()  # the page's script and style are in the package
    version = subprocess.run([str(command), "--version"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("ttft-relay 0."), version.stdout + version.stderr
    helped = subprocess.run([str(command), "run", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert helped.returncode == 0 and "config file: none" in helped.stdout, helped.stdout + helped.stderr
    assert "reverse:https://api.anthropic.com@8002 on 127.0.0.1" in helped.stdout  # no mitm.conf: the same listeners
    bench = subprocess.run([str(command), "bench", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert bench.returncode == 2 and "from a checkout" in bench.stderr
    # The test support ships (ttft_relay/testing/__init__.py says why) and stands alone: all of it
    # imports from the installed copy with no test-only dependency, and its fake upstream streams.
    test_only = {re.split(r"[=<>~!;\[ ]", line)[0].lower().replace("_", "-")
                 for line in (REPO / "requirements-dev.txt").read_text().splitlines()
                 if line.strip() and not line.startswith(("#", "-"))}
    assert {"pytest", "hypothesis", "openai"} <= test_only
    script = ("import importlib, json, pkgutil, sys\n"
              "from importlib.metadata import packages_distributions\n"
              "before = set(sys.modules)\n"
              "import ttft_relay.testing as support\n"
              "for m in pkgutil.walk_packages(support.__path__, 'ttft_relay.testing.'): importlib.import_module(m.name)\n"
              "owners = packages_distributions()\n"
              "print(json.dumps([support.__file__, sorted({d.lower().replace('_', '-') for n in set(sys.modules) - before\n"
              "                                             for d in owners.get(n.partition('.')[0], ())})]))")
    support = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert support.returncode == 0, support.stderr[-2000:]
    where, distributions = orjson.loads(support.stdout)
    assert Path(where).is_relative_to(target) and "mitmproxy" in distributions, (where, distributions)
    assert sorted(test_only.intersection(distributions)) == []
    fake = subprocess.Popen([sys.executable, "-m", "ttft_relay.testing.fakes.upstream", "--port", "0"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert fake.stdout is not None
        listening = fake.stdout.readline().split()
        assert listening[:1] == ["listening"], listening
        streamed = b"".join(c.data for c in stream_post(listening[1] + "/v1/chat/completions", {
            "model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}))
        assert answer_pieces(1)[0].encode() in streamed and b"data: [DONE]" in streamed, streamed[-500:]
    finally:
        fake.terminate()
        fake.wait(10)
    # The installed relay starts (no mitm.conf beside it: the code's defaults) with its addons loaded.
    run = subprocess.Popen(
        [str(command), "run", "--listen-host", "127.0.0.1", "-p", "0", "--set", "relay_metrics_listen=",
         "--set", f"confdir={tmp_path / 'conf'}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    try:
        lines = []
        for line in run.stdout:
            lines.append(line)
            if "listening at" in line:
                break
        text = "".join(lines)
        assert "tokenizer ready" in text and str(target / "ttft_relay" / "relay.py") in text, text
    finally:
        run.terminate()
        run.wait(30)


def test_pip_install_on_a_python_older_than_the_relays_says_which_to_use(monkeypatch):
    # Debian 12's python3 is 3.11: pip alone ended on "No matching distribution found for
    # mitmproxy==12.3.1". pip imports the build backend in the Python it installs for.
    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]
    backend = REPO / build["backend-path"][0] / f"{build['build-backend']}.py"
    monkeypatch.setattr(sys, "version_info", (3, 11, 7, "final", 0))
    with pytest.raises(SystemExit, match=r"needs Python 3\.12 or newer .* python3\.12 -m pip install \."):
        runpy.run_path(str(backend))
    monkeypatch.undo()
    hooks = runpy.run_path(str(backend))  # on this Python: setuptools' hooks, as they are
    assert {"build_wheel", "build_sdist", "prepare_metadata_for_build_wheel"} <= set(hooks)
