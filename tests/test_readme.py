"""The READMEs stay true: the commands the quick-start check runs (`.ci/quickstart.py`) are the
README's own, the Chinese quick start shows only commands the English README shows (and so
the check's), and every script, subcommand, flag, option name and link either README names
exists. `.ci/run` runs that check before the suite.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from ttft_relay.testing.harness import REPO

READMES = [REPO / "README.md", REPO / "README.zh-CN.md"]
EXTERNAL_FLAGS = {
    # Other programs' flags the READMEs show (curl, git, systemctl, certbot, useradd, ssh, tail, docker, pipx).
    "--proxy", "--cacert", "--standalone", "--deploy-hook", "--system", "--home-dir", "--shell", "--now", "--build",
    "--fail-with-body",
}


@cache
def quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", REPO / ".ci" / "quickstart.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shell_lines(path: Path) -> list[str]:
    return quickstart().shell_lines(path.read_text(encoding="utf8"))


def code_texts(path: Path) -> list[str]:
    """Every command the page shows: its shell lines and its inline code spans."""
    text = path.read_text(encoding="utf8")
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return shell_lines(path) + re.findall(r"`([^`\n]+)`", prose)


def test_the_readme_shows_every_command_the_quickstart_check_runs():
    assert quickstart().missing_from_readme() == []
    assert quickstart().RUN in shell_lines(REPO / "README.md")


def test_the_shell_block_reader_joins_continuations_and_drops_comments():
    md = "```sh\nfoo --a 'x # y' \\\n  --b   # a comment\n# only a comment\nbar\n```\n```toml\nbaz\n```\n"
    assert quickstart().shell_lines(md) == ["foo --a 'x # y' --b", "bar"]


def test_ci_runs_the_quickstart_check_and_then_the_readmes_test_command():
    lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[-2:] == ["python3 .ci/quickstart.py", "exec scripts/test"]
    assert "scripts/test" in (REPO / "README.md").read_text()


def sudo_spans(path: Path) -> set[str]:
    """The commands a page gives in running text (the VPS steps): inline code that starts with sudo."""
    return {code for code in code_texts(path) if code.startswith("sudo ")}


def test_the_chinese_readme_shows_the_english_readmes_commands():
    english = set(shell_lines(REPO / "README.md"))
    chinese = shell_lines(REPO / "README.zh-CN.md")
    assert len(chinese) > 30  # the VPS steps' blocks, indented in their list, count too
    assert "sudo certbot certonly --standalone -d relay.example.com --deploy-hook " \
           "/opt/ttft-relay/deploy/certbot-deploy-hook" in english
    assert sorted(set(chinese) ^ english) == []
    assert sorted(sudo_spans(REPO / "README.zh-CN.md") ^ sudo_spans(REPO / "README.md")) == []
    for command in (quickstart().RUN, quickstart().DIAGNOSE, quickstart().REPORT, quickstart().PIP_INSTALL):
        assert command in chinese
    text = (REPO / "README.zh-CN.md").read_text()
    for setting in ("http://127.0.0.1:8001/v1", "http://127.0.0.1:8002", "HTTPS_PROXY=http://127.0.0.1:8080"):
        assert setting in text


def test_run_help_opens_with_the_options_the_readme_says_to_change_first():
    from ttft_relay import cli

    text = (REPO / "README.md").read_text(encoding="utf8")
    table = text.split("The ones people change first:", 1)[1].lstrip().split("\n\n", 1)[0]
    named = [name for row in re.findall(r"^\| (`.*?) \|", table, re.M) for name in re.findall(r"`([a-z_]+)`", row)]
    assert named == list(cli.FIRST_OPTIONS)


@cache
def known_options() -> set[str]:
    from ttft_relay import cli, config

    mitmproxy = set(config.declared_options("mitmweb").keys()) | set(config.declared_options("mitmdump").keys())
    return mitmproxy | {name for name, _, _ in cli.relay_options()}


@cache
def known_flags() -> set[str]:
    import argparse

    from ttft_relay import config
    from ttft_relay.diagnose import cli as diagnose_cli
    from ttft_relay.report import summary

    flags = {"--workers", "--version", "--help"}
    for tool in ("mitmdump", "mitmweb"):
        flags |= {f for action in config._PARSERS[tool](config.declared_options(tool))._actions
                  for f in action.option_strings}
    seen: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        seen.append(self)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    try:
        for main in (diagnose_cli.parse_args, summary.main):
            with pytest.raises(SystemExit):
                main([])
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    return flags | {f for parser in seen for action in parser._actions for f in action.option_strings}


@pytest.mark.parametrize("readme", READMES, ids=lambda p: p.name)
def test_every_option_the_readme_names_exists(readme):
    text = readme.read_text(encoding="utf8")
    named = set(re.findall(r"\brelay_[a-z0-9_]+[a-z0-9]", text))
    named |= set(re.findall(r"--set ([a-z_]+)=", text))
    for block in re.findall(r"^```yaml\n(.*?)^```", text, re.S | re.M):
        named |= set(re.findall(r"^([a-z_]+):", block, re.M))
    named.discard("name")  # the placeholder of `--set name=value`
    assert sorted(named - known_options()) == []


@pytest.mark.parametrize("readme", READMES, ids=lambda p: p.name)
def test_every_command_and_flag_the_readme_shows_exists(readme):
    from ttft_relay import cli

    subcommands = set(re.findall(r"^    ttft-relay ([a-z-]+)", cli.__doc__, re.M))
    flags: set[str] = set()
    for code in code_texts(readme):
        try:
            words = shlex.split(code)
        except ValueError:
            words = code.split()
        for i, word in enumerate(words):
            if re.fullmatch(r"(/opt/ttft-relay/)?scripts/[a-z_]+", word):
                script = REPO / "scripts" / Path(word).name
                assert script.is_file() and script.stat().st_mode & 0o111, f"{readme.name}: {code}"
            command = i == 0 or words[i - 1] in ("&&", "sudo", "$(")
            if word == "ttft-relay" and command and i + 1 < len(words) and not words[i + 1].startswith("-"):
                assert words[i + 1] in subcommands, f"{readme.name}: {code}"
            if word == "ttft_relay" and i > 0 and words[i - 1] == "-m" and i + 1 < len(words):
                assert words[i + 1] in subcommands, f"{readme.name}: {code}"
            if re.fullmatch(r"--[a-z][a-z0-9-]*", flag := word.split("=", 1)[0]):
                flags.add(flag)
    assert sorted(flags - known_flags() - EXTERNAL_FLAGS) == []
    assert {"--relay", "--relay-log"} <= flags


@pytest.mark.parametrize("page", [*READMES, REPO / "CONTRIBUTING.md", REPO / "docs" / "agents.md"], ids=lambda p: p.name)
def test_every_link_and_file_the_page_names_exists(page):
    text = page.read_text(encoding="utf8")
    links = [link for link in re.findall(r"\]\(([^)#\s]+)\)", text) if "://" not in link]
    named = re.findall(r"`((?:deploy|docs|scripts|addons|tests|ttft_relay)/[\w./-]+\.\w+)`", text)
    missing = [p for p in links + named if not (page.parent / p).exists() and not (REPO / p).exists()]
    assert missing == []
