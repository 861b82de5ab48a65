"""scripts/: each command a user types builds `.venv` on its first run and then does its job, under
`set -e`, as the README says. A stand-in Python (a shell script that answers the few calls
`scripts/_venv.sh` makes) keeps this fast; `.ci/quickstart.py` runs the real first run on a
fresh clone.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ttft_relay.testing.harness import REPO

FAKE_PYTHON = r"""#!/usr/bin/env bash
# Answers what scripts/_venv.sh asks of a Python; anything else it runs is echoed as "RAN ...".
case "$1" in
  -c) exit 0 ;;
  --version) echo "Python 3.12.99" ;;
  -m)
    case "$2" in
      venv) mkdir -p "$3/bin" && cp "$0" "$3/bin/python" ;;
      pip) echo "pip $*" >> "$(dirname "$0")/../pip.log" ;;
      compileall) exec "$REAL_PYTHON" "$@" ;;
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
    return {**os.environ, "RELAY_PYTHON": str(python), "TTFT_RELAY_NO_INSTALL": "1", "REAL_PYTHON": sys.executable}


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


def _compiled_for(source: Path) -> bool:
    """Whether `source` has bytecode a start would use: its pyc names the source's mtime and size."""
    try:
        header = Path(importlib.util.cache_from_source(str(source))).read_bytes()[:16]
    except FileNotFoundError:
        return False
    st = source.stat()
    return header[:4] == importlib.util.MAGIC_NUMBER and header[8:16] == (
        int(st.st_mtime).to_bytes(4, "little") + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little"))


def test_the_install_step_compiles_the_package_the_unit_cannot_write(tmp_path):
    # The unit's user cannot write the checkout: every start compiled the relay's modules again,
    # in the supervisor and in each worker. README step 2 and the upgrade's rebuild (both
    # `scripts/relay --version`, as root) write their bytecode, and a changed source again.
    repo = _repo_copy(tmp_path, [*SCRIPT_FILES, "scripts/relay"])
    modules = [repo / "ttft_relay" / "__init__.py", repo / "ttft_relay" / "trim" / "__init__.py",
               repo / "ttft_relay" / "trim" / "tokens.py"]
    for module in modules:
        module.parent.mkdir(parents=True, exist_ok=True)
        module.write_text("VERSION = 1\n")
    env = _fake_python(tmp_path)
    version = [str(repo / "scripts" / "relay"), "--version"]
    subprocess.run(version, env=env, check=True, capture_output=True, timeout=60)
    assert [m.name for m in modules if not _compiled_for(m)] == []
    changed = modules[2]
    changed.write_text("VERSION = 22\n")
    os.utime(changed, (changed.stat().st_atime, changed.stat().st_mtime + 5))  # a later pull
    assert not _compiled_for(changed)
    subprocess.run(version, env=env, check=True, capture_output=True, timeout=60)
    assert [m.name for m in modules if not _compiled_for(m)] == []


def test_the_dockerfiles_venv_step_succeeds(tmp_path):
    # No container engine here: the Dockerfile's COPY steps are done by hand in a scratch
    # WORKDIR (as .ci/quickstart.py does them, with a real pip there), then its .venv step runs.
    spec = importlib.util.spec_from_file_location("quickstart", REPO / ".ci" / "quickstart.py")
    assert spec and spec.loader
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    image = tmp_path / "image"
    venv_step, entrypoint = quickstart.docker_build_by_hand(REPO / "deploy" / "Dockerfile", REPO, image)
    done = subprocess.run(["sh", "-c", venv_step], cwd=image, capture_output=True, text=True,
                          env=_fake_python(tmp_path), timeout=60)
    assert done.returncode == 0, f"{venv_step}: {done.stdout}{done.stderr}"
    assert (image / ".venv" / ".installed").exists()
    assert entrypoint[0] == "/opt/ttft-relay/scripts/relay"


def _readme_upgrade_lines() -> list[str]:
    spec = importlib.util.spec_from_file_location("quickstart", REPO / ".ci" / "quickstart.py")
    assert spec and spec.loader
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    readme = (REPO / "README.md").read_text(encoding="utf8")
    (block,) = [block for block in re.findall(r"^```sh\n.*?^```\n", readme, re.S | re.M) if "git pull" in block]
    return quickstart.shell_lines(block)


def _as_the_unit(checkout: Path, command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`command` with `checkout` read-only, as ProtectSystem=strict leaves /opt/ttft-relay to the service."""
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", script, str(checkout), *command], capture_output=True,
                          text=True, env=env, timeout=60)


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True, timeout=60)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="a read-only mount needs root")
def test_the_readmes_upgrade_rebuilds_the_venv_the_unit_cannot(tmp_path):
    origin = _repo_copy(tmp_path, [*SCRIPT_FILES, "scripts/relay"])
    _git("init", "-q", cwd=origin)
    _git("add", "-A", cwd=origin)
    _git("commit", "-qm", "v1", cwd=origin)
    installed = tmp_path / "opt" / "ttft-relay"
    _git("clone", "-q", str(origin), str(installed), cwd=tmp_path)
    env = _fake_python(tmp_path)
    pip_log = installed / ".venv" / "pip.log"
    # README step 2, as root: .venv built.
    subprocess.run([str(installed / "scripts" / "relay"), "--version"], env=env, check=True, capture_output=True)
    unit = dict(line.split("=", 1) for line in (REPO / "deploy" / "ttft-relay.service").read_text().splitlines()
                if line.startswith("ExecStart="))
    start = [*unit["ExecStart"].replace("/opt/ttft-relay", str(installed)).split(), "--version"]
    assert _as_the_unit(installed, start, env).returncode == 0 and len(pip_log.read_text().splitlines()) == 1
    (origin / "requirements.txt").write_text((origin / "requirements.txt").read_text() + "# a new release\n")
    _git("commit", "-qam", "v2: requirements changed", cwd=origin)

    pull, rebuild, restart = _readme_upgrade_lines()
    assert restart == "sudo systemctl restart ttft-relay"
    here = lambda line: line.replace("/opt/ttft-relay", str(installed))  # noqa: E731
    subprocess.run(here(pull).replace("sudo ", ""), shell=True, env=env, check=True, capture_output=True, timeout=60)
    # A restart before the rebuild: the unit cannot install, says what to run, and exits 78 (not retried).
    refused = _as_the_unit(installed, start, env)
    assert refused.returncode == 78, refused.stdout + refused.stderr
    assert here(rebuild) in refused.stderr and "RAN" not in refused.stdout
    assert len(pip_log.read_text().splitlines()) == 1
    # The README's rebuild, as root; then the unit starts on the new requirements.
    subprocess.run(here(rebuild).replace("sudo ", ""), shell=True, env=env, check=True, capture_output=True,
                   timeout=60)
    assert len(pip_log.read_text().splitlines()) == 2
    started = _as_the_unit(installed, start, env)
    assert started.returncode == 0 and "RAN -m ttft_relay run --workers auto" in started.stdout, started.stderr
