"""scripts/: each command a user types builds `.venv` on its first run and then does its job, under
`set -e`, as the README says. A stand-in Python (a shell script that answers the few calls
`scripts/_venv.sh` makes) keeps this fast; `.ci/quickstart.py` runs the real first run on a
fresh clone.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.harness import REPO

FAKE_PYTHON = r"""#!/usr/bin/env bash
# Answers what scripts/_venv.sh asks of a Python; anything else it runs is echoed as "RAN ...".
case "$1" in
  -c) exit 0 ;;
  --version) echo "Python 3.12.99" ;;
  -m)
    case "$2" in
      venv) mkdir -p "$3/bin" && cp "$0" "$3/bin/python" ;;
      pip) echo "pip $*" >> "$(dirname "$0")/../pip.log" ;;
      *) echo "RAN $*" ;;
    esac ;;
  *) echo "RAN $*" ;;
esac
"""


def _repo_copy(tmp_path: Path, files: list[str]) -> Path:
    repo = tmp_path / "repo"
    for name in files:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, repo / name)
    return repo


def _fake_python(tmp_path: Path) -> dict[str, str]:
    python = tmp_path / "python3.12"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return {**os.environ, "RELAY_PYTHON": str(python), "TTFT_RELAY_NO_INSTALL": "1"}


SCRIPT_FILES = ["requirements.txt", "requirements-dev.txt", "constraints.txt", "scripts/_venv.sh",
                "scripts/_system.sh"]


@pytest.mark.parametrize("script", ["relay", "report", "diagnose", "bench", "test"])
def test_each_script_works_on_its_first_run(tmp_path, script):
    # The last line of ensure_venv once returned 1 under `set -e` (`[ ... ] && echo`): the first
    # run of scripts/relay printed "installing requirements.txt into .venv" and exited 1.
    repo = _repo_copy(tmp_path, [*SCRIPT_FILES, f"scripts/{script}"])
    env = _fake_python(tmp_path)
    for run in ("first", "second"):
        done = subprocess.run([str(repo / "scripts" / script), "--help"], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=60)
        assert done.returncode == 0, f"{run} run: {done.stdout}{done.stderr}"
        assert "RAN -m" in done.stdout and "--help" in done.stdout, f"{run} run: {done.stdout}{done.stderr}"
    installs = (repo / ".venv" / "pip.log").read_text().splitlines()
    assert len(installs) == 1, installs  # the second run found the stamp


def test_a_dev_install_serves_the_runtime_scripts_without_a_second_install(tmp_path):
    repo = _repo_copy(tmp_path, [*SCRIPT_FILES, "scripts/test", "scripts/relay"])
    env = _fake_python(tmp_path)
    for script in ("test", "relay"):
        done = subprocess.run([str(repo / "scripts" / script), "--help"], capture_output=True, text=True, env=env,
                              timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    assert len((repo / ".venv" / "pip.log").read_text().splitlines()) == 1


def test_the_dockerfiles_venv_step_succeeds(tmp_path):
    # No container engine here: the Dockerfile's COPY steps up to its .venv step are done by
    # hand in a scratch WORKDIR, then that RUN line runs as the image build would run it.
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    workdir = tmp_path / "image"
    workdir.mkdir()
    env = _fake_python(tmp_path)
    for line in dockerfile.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["COPY"]:
            *sources, dest = words[1:]
            for source in sources:  # a directory's contents go into dest, a file into dest/ or to dest
                if (REPO / source).is_dir():
                    shutil.copytree(REPO / source, workdir / dest, dirs_exist_ok=True)
                elif dest.endswith("/"):
                    (workdir / dest).mkdir(parents=True, exist_ok=True)
                    shutil.copy2(REPO / source, workdir / dest / Path(source).name)
                else:
                    shutil.copy2(REPO / source, workdir / dest)
        elif words[:1] == ["RUN"] and "ensure_venv" in line:
            command = re.sub(r"^\s*RUN\s+", "", line)
            done = subprocess.run(["sh", "-c", command], cwd=workdir, capture_output=True, text=True, env=env,
                                  timeout=60)
            assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"
            assert (workdir / ".venv" / ".installed").exists()
            return
    pytest.fail("the Dockerfile has no RUN line that builds .venv (ensure_venv)")
