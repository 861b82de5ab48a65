"""The package as a user installs it: `pip install .` gives the `ttft-relay` command, whose
addon runs in mitmdump with no checkout beside it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO

from ttft_relay import cli


def test_addon_path_names_the_addon_file():
    assert cli.ADDON.name == "relay.py" and cli.ADDON.parent.name == "ttft_relay" and cli.ADDON.exists()
    assert cli.main(["no-such-command"]) == 2


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
