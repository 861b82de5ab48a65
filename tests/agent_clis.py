"""The real coding-agent CLIs (Codex CLI, Claude Code) for end-to-end tests: install, sandbox, run.

`installed_clis()` npm-installs the pinned versions once into a cache outside the
repository (`${TTFT_RELAY_CACHE:-~/.cache/ttft-relay}/agents`) and reuses them;
it skips the calling test with a clear message only when npm is missing or the
registry cannot be reached. Both packages ship native binaries that run on
node 20 (Claude Code warns about its `engines` field and works).

`AgentSandbox` gives each run a throwaway HOME, CODEX_HOME and Claude config dir,
obviously fake keys, telemetry and update checks off, and proxy variables that
send every outside host to a `RefusingProxy` (the CLIs call home otherwise) while
loopback goes direct. `run()` starts a CLI and stamps every stdout line with
`time.time()` as it arrives, so a test can tell when the client printed an answer.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CODEX_VERSION = "0.171.0"
CLAUDE_VERSION = "2.1.332"
PACKAGES = {"@openai/codex": CODEX_VERSION, "@anthropic-ai/claude-code": CLAUDE_VERSION}
INSTALL_TIMEOUT_S = 300
RUN_TIMEOUT_S = 90
FAKE_OPENAI_KEY = "sk-test-FAKEKEY-codex-0123456789abcdef"
FAKE_ANTHROPIC_KEY = "sk-ant-test-FAKEKEY-claude-0123456789abcdef"
CODEX_PROVIDER = "relaytest"
LOOPBACK = "127.0.0.1,localhost,::1"
_UNREACHABLE = ("ENOTFOUND", "ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "EAI_AGAIN", "ENETUNREACH", "EHOSTUNREACH",
                "network request", "proxy")
"""npm error texts that mean "cannot reach the registry", not "the install is broken"."""


def cache_dir() -> Path:
    return Path(os.environ.get("TTFT_RELAY_CACHE") or "~/.cache/ttft-relay").expanduser() / "agents"


@dataclass(frozen=True)
class Clis:
    codex: Path
    claude: Path


def installed_clis() -> Clis:
    """The pinned CLIs, installed on first use (under a file lock: other checkouts may install too)."""
    root = cache_dir()
    bin_dir = root / "node_modules" / ".bin"
    clis = Clis(bin_dir / "codex", bin_dir / "claude")
    if _installed_versions(root) == PACKAGES:
        return clis
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: cannot install the coding-agent CLIs (@openai/codex, @anthropic-ai/claude-code)")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed_versions(root) != PACKAGES:
            specs = [f"{name}@{version}" for name, version in PACKAGES.items()]
            try:
                done = subprocess.run(
                    [npm, "install", "--prefix", str(root), "--no-audit", "--no-fund", "--no-save", *specs],
                    capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, stdin=subprocess.DEVNULL,
                )
            except subprocess.TimeoutExpired:
                pytest.skip(f"npm install of the coding-agent CLIs took over {INSTALL_TIMEOUT_S} s: registry unreachable?")
            if done.returncode != 0:
                output = done.stdout + done.stderr
                if any(marker in output for marker in _UNREACHABLE):
                    pytest.skip(f"npm registry unreachable, cannot install the coding-agent CLIs:\n{output[-800:]}")
                raise RuntimeError(f"npm install {' '.join(specs)} failed:\n{output[-3000:]}")
    if _installed_versions(root) != PACKAGES:
        raise RuntimeError(f"npm installed {_installed_versions(root)} into {root}, not {PACKAGES}")
    return clis


def _installed_versions(root: Path) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = json.loads((root / "node_modules" / name / "package.json").read_text())["version"]
        except (OSError, ValueError, KeyError):
            versions[name] = None
    return versions


@dataclass
class CliRun:
    """One finished CLI run: its stdout lines stamped as they arrived, stderr, exit status."""

    args: list[str]
    started_at: float
    lines: list[tuple[float, str]]
    stderr: str
    returncode: int
    ended_at: float

    @property
    def stdout(self) -> str:
        return "\n".join(text for _, text in self.lines)

    def events(self) -> list[tuple[float, dict[str, Any]]]:
        """The stdout lines that are JSON objects (codex --json, claude stream-json), parsed."""
        out = []
        for at, text in self.lines:
            try:
                event = json.loads(text)
            except ValueError:
                continue
            if isinstance(event, dict):
                out.append((at, event))
        return out

    def describe(self) -> str:
        return f"$ {' '.join(self.args)}\nexit {self.returncode}\n--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}"


@dataclass
class AgentSandbox:
    """A throwaway home for one CLI run, with outside hosts refused through `proxy_url`."""

    root: Path
    proxy_url: str
    env_extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for sub in ("home", "codex_home", "claude_config", "work", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    @property
    def codex_home(self) -> Path:
        return self.root / "codex_home"

    @property
    def workdir(self) -> Path:
        return self.root / "work"

    def env(self, *, proxy: str | None = None, no_proxy: str = LOOPBACK, **extra: str) -> dict[str, str]:
        """The environment for a CLI: nothing of the caller's but PATH. `proxy` (default: the refusing
        proxy) is where every host outside `no_proxy` goes."""
        proxy = proxy or self.proxy_url
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.root / "home"),
            "TMPDIR": str(self.root / "tmp"),
            "XDG_CONFIG_HOME": str(self.root / "home" / ".config"),
            "XDG_CACHE_HOME": str(self.root / "home" / ".cache"),
            "CODEX_HOME": str(self.codex_home),
            "CLAUDE_CONFIG_DIR": str(self.root / "claude_config"),
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "NO_COLOR": "1",
            # keys: obviously fake
            "RELAYTEST_OPENAI_KEY": FAKE_OPENAI_KEY,
            "ANTHROPIC_API_KEY": FAKE_ANTHROPIC_KEY,
            # Claude Code: no telemetry, error reports, update checks or other calls home
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            # Codex: no OpenTelemetry export, no rust backtraces in the output
            "OTEL_SDK_DISABLED": "true",
            "RUST_BACKTRACE": "0",
        }
        for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):
            env[name] = env[name.lower()] = proxy
        env["NO_PROXY"] = env["no_proxy"] = no_proxy
        env.update(self.env_extra)
        env.update(extra)
        return env

    def write_codex_config(
        self, base_url: str, *, websockets: bool, headers: dict[str, str] | None = None, **provider: object
    ) -> Path:
        """`config.toml` with a custom Responses provider at `base_url` (the recipe in the README and docs/agents.md).
        `provider` adds keys to the provider table (e.g. `stream_max_retries=1`)."""
        lines = [
            'model = "gpt-test"',
            f'model_provider = "{CODEX_PROVIDER}"',
            "check_for_update_on_startup = false",
            "",
            "[analytics]",
            "enabled = false",
            "",
            f"[model_providers.{CODEX_PROVIDER}]",
            'name = "ttft-relay test provider"',
            f'base_url = "{base_url}"',
            'wire_api = "responses"',
            'env_key = "RELAYTEST_OPENAI_KEY"',
            f"supports_websockets = {'true' if websockets else 'false'}",
        ]
        lines += [f"{key} = {json.dumps(value)}" for key, value in provider.items()]
        if headers:
            lines.append("http_headers = { " + ", ".join(f'"{k}" = "{v}"' for k, v in headers.items()) + " }")
        path = self.codex_home / "config.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def run(self, args: list[str], env: dict[str, str], timeout: float = RUN_TIMEOUT_S) -> CliRun:
        """Run a CLI in the sandbox's work dir to its end (killed, with its process group, after `timeout`)."""
        started_at = time.time()
        proc = subprocess.Popen(
            args, cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        lines: list[tuple[float, str]] = []
        stderr: list[str] = []

        def read_stdout() -> None:
            assert proc.stdout
            for line in proc.stdout:
                lines.append((time.time(), line.rstrip("\n")))

        def read_stderr() -> None:
            assert proc.stderr
            stderr.append(proc.stderr.read())

        readers = [threading.Thread(target=read_stdout, daemon=True), threading.Thread(target=read_stderr, daemon=True)]
        for reader in readers:
            reader.start()
        try:
            returncode = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            returncode = proc.wait()
        for reader in readers:
            reader.join(10)
        return CliRun(args, started_at, lines, "".join(stderr), returncode, time.time())


def codex_exec(clis: Clis, sandbox: AgentSandbox, prompt: str, env: dict[str, str], **kwargs: Any) -> CliRun:
    """`codex exec --json` with the sandbox's config.toml."""
    return sandbox.run([str(clis.codex), "exec", "--json", "--skip-git-repo-check", prompt], env, **kwargs)


def claude_print(clis: Clis, sandbox: AgentSandbox, prompt: str, env: dict[str, str], **kwargs: Any) -> CliRun:
    """`claude -p` printing stream-json with partial messages: one line per streamed event as it arrives."""
    args = [str(clis.claude), "-p", prompt, "--output-format", "stream-json", "--verbose", "--include-partial-messages"]
    return sandbox.run(args, env, **kwargs)


def codex_answer(run: CliRun) -> tuple[float, str] | None:
    """When codex printed the agent's message, and its text."""
    for at, event in run.events():
        item = event.get("item") or {}
        if event.get("type") == "item.completed" and item.get("type") == "agent_message":
            return at, item.get("text", "")
    return None


def claude_first_text(run: CliRun) -> tuple[float, str] | None:
    """When claude printed the first streamed text (or thinking) delta, and that delta."""
    for at, event in run.events():
        inner = event.get("event") or {}
        delta = inner.get("delta") or {}
        if event.get("type") == "stream_event" and delta.get("type") in ("text_delta", "thinking_delta"):
            return at, delta.get("text") or delta.get("thinking", "")
    return None


def claude_result(run: CliRun) -> dict[str, Any] | None:
    return next((event for _, event in run.events() if event.get("type") == "result"), None)
