"""deploy/: the systemd unit checked by systemd's own analyzer, the VPS config read by the
relay's own option machinery, the certbot hook run for real, and the container files
checked as far as this machine allows (no container engine here: the compose file must
parse and every path it and the Dockerfile name must exist).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from mitmproxy.proxy import mode_specs
from ruamel.yaml import YAML

from ttft_relay.faults import addons as faults
from ttft_relay.guard import exposure, keys, tls
from deploy.grafana import dashboard
from ttft_relay import config, launch, workers
from ttft_relay.testing.harness import REPO

DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "ttft-relay.service"
SOCKET_UNIT = DEPLOY / "ttft-relay.socket"
INSTALL_DIR = "/opt/ttft-relay"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
EXPOSURE_THRESHOLD = 25
"""`systemd-analyze security` exposure, in tenths, the unit must stay under (1.7 today; 10.0 = no hardening)."""


def _installed_unit(tmp_path):
    """The unit as if the repo were installed where it is: systemd checks that ExecStart exists."""
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(INSTALL_DIR, str(REPO)))
    (tmp_path / SOCKET_UNIT.name).write_text(SOCKET_UNIT.read_text())  # the service requires it
    return unit


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is missing (Debian/Ubuntu: apt-get install systemd)")
def test_systemd_unit_verifies_and_stays_hardened(tmp_path):
    unit = _installed_unit(tmp_path)
    verify = subprocess.run([SYSTEMD_ANALYZE, "verify", str(unit), str(unit.parent / SOCKET_UNIT.name)],
                            capture_output=True, text=True, timeout=60)
    # Unknown or misspelt directives are only warned about: any output fails the test.
    assert verify.returncode == 0 and verify.stdout + verify.stderr == "", verify.stdout + verify.stderr
    security = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=yes", f"--threshold={EXPOSURE_THRESHOLD}",
                               str(unit)], capture_output=True, text=True, timeout=60)
    assert security.returncode == 0, security.stdout[-3000:] + security.stderr


def test_systemd_unit_runs_the_relay_as_its_own_user_with_graceful_stop():
    lines = dict(line.split("=", 1) for line in UNIT.read_text().splitlines() if "=" in line and line[0] != "#")
    assert lines["User"] == "ttft-relay" and lines["ProtectSystem"] == "strict"
    assert lines["ExecStart"].startswith(f"{INSTALL_DIR}/scripts/relay ")
    assert "/var/log/ttft-relay/" in lines["ExecStart"] and lines["LogsDirectory"] == "ttft-relay"
    assert "/var/lib/ttft-relay/" in lines["ExecStart"] and lines["StateDirectory"] == "ttft-relay"
    # where the parsed tokenizers are kept (trim/rank_cache.py reads $CACHE_DIRECTORY): writable under ProtectSystem
    assert lines["CacheDirectory"] == "ttft-relay" and lines["CacheDirectoryMode"] == "0700"
    # SIGTERM to the supervisor only: it stops the workers itself, each finishing its flows in flight
    # within the default grace, within the unit's stop timeout.
    assert lines["KillMode"] == "mixed"
    assert int(lines["TimeoutStopSec"]) > workers.stop_timeout(faults.SHUTDOWN_GRACE_S)
    assert lines["ExecReload"] == "/bin/kill -HUP $MAINPID"
    # Restarted when it dies, not when it cannot start: then the unit fails, with the relay's message.
    assert lines["Restart"] == "on-failure" and lines["RestartPreventExitStatus"] == str(workers.EXIT_START_FAILED)
    assert int(lines["StartLimitBurst"]) <= 5


def test_the_vps_config_is_valid_and_passes_the_open_proxy_guard(monkeypatch):
    monkeypatch.setenv("TTFT_RELAY_CONF", str(DEPLOY / "relay.conf"))
    # every option name and value as mitmdump would read them
    opts = config.started_options(launch.relay_args([]), [exposure.Exposure(), keys.AccessKeys(), tls.ClientTLS(),
                                                          *(addon() for addon in workers.SUPERVISOR_READS)])
    assert opts.deferred == {}  # every name an option these addons (or mitmproxy) declare, every value parsed
    assert opts.listen_host == "0.0.0.0" and opts.certs and opts.relay_access_keys
    assert exposure.unprotected_listeners(opts.mode, opts.listen_host, opts.proxyauth, bool(opts.relay_access_keys),
                                       opts.relay_client_tls, bool(opts.certs)) == []
    # The same file without its certificate would be refused: TLS is what makes it safe.
    assert exposure.unprotected_listeners(opts.mode, opts.listen_host, opts.proxyauth, True, opts.relay_client_tls,
                                       False)


def test_the_socket_unit_holds_every_listener_of_the_vps_config(monkeypatch):
    # A restart keeps the ports open only if systemd holds each one the relay listens on: the relay
    # takes systemd's socket on a listener's port, and binds (and closes on a stop) any other.
    monkeypatch.setenv("TTFT_RELAY_CONF", str(DEPLOY / "relay.conf"))
    opts = config.started_options(launch.relay_args([]), [addon() for addon in workers.SUPERVISOR_READS])
    listeners = [mode_specs.ProxyMode.parse(spec) for spec in opts.mode]
    wanted = [f"{mode.listen_host(opts.listen_host)}:{mode.listen_port(opts.listen_port)}" for mode in listeners]
    socket_unit = [line.split("=", 1) for line in SOCKET_UNIT.read_text().splitlines() if "=" in line and line[0] != "#"]
    assert [value for key, value in socket_unit if key == "ListenStream"] == wanted
    assert dict(socket_unit)["Backlog"] == str(opts.relay_listen_backlog)
    service = dict(line.split("=", 1) for line in UNIT.read_text().splitlines() if "=" in line and line[0] != "#")
    assert service["Requires"] == SOCKET_UNIT.name and SOCKET_UNIT.name in service["After"]


def test_certbot_hook_writes_what_the_certs_option_reads_and_reloads(tmp_path, certs):
    lineage = tmp_path / "live" / "relay.example.com"
    lineage.mkdir(parents=True)
    (lineage / "fullchain.pem").write_bytes(certs.cert_pem.read_bytes() + certs.ca_pem.read_bytes())
    (lineage / "privkey.pem").write_bytes(certs.key_pem.read_bytes())
    dest = tmp_path / "etc" / "tls" / "relay.pem"
    reloaded = tmp_path / "reloaded"
    env = {**os.environ, "RENEWED_LINEAGE": str(lineage), "TTFT_RELAY_PEM": str(dest),
           "TTFT_RELAY_RELOAD": f"touch {reloaded}"}
    subprocess.run([str(DEPLOY / "certbot-deploy-hook")], env=env, check=True, timeout=30)
    assert tls.check_cert_file(dest) == (None, None) and reloaded.exists()
    assert dest.stat().st_mode & 0o007 == 0  # the key is not world-readable
    assert dest.parent.stat().st_mode & 0o777 == 0o750  # and its directory is the relay group's to enter


# --- containers (no engine here) -------------------------------------------------------------


def _compose() -> dict:
    return YAML(typ="safe").load((DEPLOY / "compose.yaml").read_text())


def _local(source: str) -> bool:
    return source.startswith(".")


def test_compose_file_parses_and_names_existing_files():
    compose = _compose()
    assert set(compose["services"]) == {"relay", "prometheus", "grafana"}
    build = compose["services"]["relay"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert context == REPO and (context / build["dockerfile"]).is_file()
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if _local(source):
                assert (DEPLOY / source).exists(), f"{name}: {source}"
            else:
                assert source.startswith("/etc/ttft-relay") or source in compose["volumes"], f"{name}: {source}"
        for port in service.get("ports", []):
            # Only the relay's TLS listeners face the internet; the dashboards stay on loopback.
            assert port.startswith("127.0.0.1:") or name == "relay", f"{name} publishes {port}"


def test_a_container_stop_lets_the_turns_in_flight_finish_before_docker_kills_it():
    # docker sends SIGKILL stop_grace_period after SIGTERM (10 s by default): it must come after the
    # relay's grace for the turns in flight, the answers to what is left and its exit, as the unit's
    # TimeoutStopSec does.
    grace = _compose()["services"]["relay"]["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) > workers.stop_timeout(faults.SHUTDOWN_GRACE_S)


def test_dockerfile_copies_files_that_exist_and_runs_the_relay_alone():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    sources = []
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            sources += line.split()[1:-1]
    assert sources and all((REPO / s).exists() for s in sources), sources
    # The workers share the relay's own listening sockets: the image needs no other program.
    assert "apt-get" not in dockerfile
    assert '["/opt/ttft-relay/scripts/relay"' in dockerfile


def test_prometheus_scrapes_the_relays_metrics_and_grafana_finds_the_dashboard():
    compose = _compose()
    config = YAML(typ="safe").load((DEPLOY / "prometheus.yml").read_text())
    (target,) = config["scrape_configs"][0]["static_configs"][0]["targets"]
    assert target == "relay:" + compose["services"]["relay"]["command"][-1].rsplit(":", 1)[1]
    if promtool := shutil.which("promtool"):
        subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus.yml")], check=True,
                       capture_output=True, timeout=60)
    provider = YAML(typ="safe").load((DEPLOY / "grafana/provisioning/dashboards/ttft-relay.yaml").read_text())
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"] if _local(v))
    dashboards = next(src for src, dst in mounts.items() if dst == provider["providers"][0]["options"]["path"])
    assert (DEPLOY / dashboards / "ttft-relay.json").is_file()
    datasource = YAML(typ="safe").load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert datasource["datasources"][0]["uid"] == dashboard.DATASOURCE["uid"]


def _dockerfile_env() -> dict[str, str]:
    (line,) = [line for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("ENV ")]
    return dict(word.split("=", 1) for word in line.split()[1:])


def test_the_container_reads_the_files_the_readmes_vps_steps_make():
    """README "In a container": steps 1-5, then compose. The relay.conf the user edited in step 5 (their
    domain: the certificate served for it) is the one the container reads, and so is every other file
    of /etc/ttft-relay the compose file names: the README's steps make each one."""
    readme = (REPO / "README.md").read_text(encoding="utf8")
    (copied_to,) = re.findall(rf"sudo cp {INSTALL_DIR}/deploy/relay\.conf ([^\s`]+)", readme)
    edited = copied_to.rstrip("/") + "/relay.conf"
    relay = _compose()["services"]["relay"]
    mounts = dict(volume.split(":")[:2] for volume in relay["volumes"])
    conf_in_image = _dockerfile_env()["TTFT_RELAY_CONF"]
    assert {target: source for source, target in mounts.items()}[conf_in_image] == edited
    host_files = [source for source in mounts if source.startswith("/")] + [relay["env_file"]]
    host_files += [secret["file"] for secret in _compose()["secrets"].values()]
    assert [path for path in host_files if path not in readme] == []
    # What the config names (certificate, relay keys) is mounted where it looks.
    conf = (DEPLOY / "relay.conf").read_text()
    named = re.findall(r"=(/etc/ttft-relay/\S+)", conf) + re.findall(r"file:(/etc/ttft-relay/\S+)", conf)
    assert named and [path for path in named if not any(path.startswith(target) for target in mounts.values())] == []


def test_the_images_entry_point_answers_version_without_a_config(tmp_path):
    entrypoint = json.loads(next(line.split(None, 1)[1] for line in (DEPLOY / "Dockerfile").read_text()
                                 .replace("\\\n", " ").splitlines() if line.startswith("ENTRYPOINT")))
    assert entrypoint[0] == f"{INSTALL_DIR}/scripts/relay"  # = ttft-relay run --workers auto
    env = {**os.environ, "TTFT_RELAY_CONF": str(tmp_path / "not-mounted" / "relay.conf")}
    done = subprocess.run([sys.executable, "-m", "ttft_relay", "run", "--workers", "auto", *entrypoint[1:], "--version"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("ttft-relay "), done.stdout + done.stderr
