"""The code passes the linter (rules in pyproject.toml: pyflakes, pycodestyle, bugbear, pyupgrade)."""

import subprocess
import sys

from ttft_relay.testing.harness import REPO


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "ttft_relay", "scripts", "benchmarks", "tests", "addons",
                             "deploy"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-1000:]
