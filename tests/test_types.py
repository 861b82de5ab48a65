"""The package passes the type checker (mypy; its settings: pyproject.toml's [tool.mypy])."""

import subprocess
import sys

from ttft_relay.testing.harness import REPO


def test_mypy_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-1000:]
