from pathlib import Path

import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons

from ttft_relay import config


def test_command_line_options_sees_every_spelling():
    argv = ["/x/mitmdump", "-p", "9000", "--mode", "reverse:http://a", "--set", "relay_trim=false",
            "--set", "listen_host=0.0.0.0", "-s", "ttft_relay/relay.py"]
    with taddons.context() as tctx:
        got = config.command_line_options(argv, tctx.master.options)
    assert {"listen_port", "mode", "relay_trim", "listen_host"} <= got
    assert "web_port" not in got and "stream_large_bodies" not in got


def test_command_line_options_outside_mitmproxy_is_empty():
    with taddons.context() as tctx:
        assert config.command_line_options(["pytest", "-p", "9000"], tctx.master.options) == set()


def test_shipped_mitm_conf_parses_and_is_loopback():
    conf = config.read_conf(config.DEFAULT_CONF)
    assert conf["listen_host"] == "127.0.0.1"
    assert any(m.startswith("regular") for m in conf["mode"])
    assert all(k.startswith("relay_") or k in {"listen_host", "mode"} for k in conf)


def _conf(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "mitm.conf"
    p.write_text(text)
    return p


def test_conf_applies_below_command_line(tmp_path):
    path = _conf(tmp_path, "listen_port: 7001\nlisten_host: 0.0.0.0\nrelay_future_option: 5\n")
    rc = config.RelayConfig(path, argv=["mitmdump", "--set", "listen_host=127.0.0.2"])
    with taddons.context() as tctx:
        tctx.options.listen_host = "127.0.0.2"
        tctx.master.addons.add(rc)
        assert tctx.options.listen_port == 7001  # from the file
        assert tctx.options.listen_host == "127.0.0.2"  # command line wins
        assert tctx.options.deferred["relay_future_option"] == 5  # set when declared


def test_conf_must_not_load_scripts(tmp_path, caplog):
    path = _conf(tmp_path, "scripts: [ttft_relay/relay.py]\n")
    with taddons.context() as tctx:
        addon = config.RelayConfig(path, argv=["x"])
        tctx.master.addons.add(addon)
        assert addon.applied == {}
    # An error logged at start-up, which stops mitmdump (the end-to-end test below).
    assert any(r.levelname == "ERROR" and "'scripts' belongs on the command line" in r.getMessage()
               for r in caplog.records)


def test_conf_errors_are_clear(tmp_path):
    with pytest.raises(exceptions.OptionsError, match="cannot read"):
        config.read_conf(tmp_path / "missing.conf")
    with pytest.raises(exceptions.OptionsError):
        config.read_conf(_conf(tmp_path, "mode: [unclosed\n"))


@pytest.mark.parametrize(
    "conf, args, reason",
    [
        ("", ["--set", "relay_stream=False"], "Failed to parse option relay_stream"),
        ("/nonexistent/mitm.conf", [], "cannot read /nonexistent/mitm.conf"),
    ],
)
def test_a_relay_that_cannot_be_configured_does_not_start(conf, args, reason, confdir):
    # mitmproxy would drop the relay script without a word and go on as a bare, buffering proxy.
    import os
    import subprocess

    from tests.harness import MITMDUMP, RELAY_SCRIPT

    proc = subprocess.run(
        [str(MITMDUMP), "--set", f"confdir={confdir}", "--listen-host", "127.0.0.1", "-p", "0",
         "-s", str(RELAY_SCRIPT), "--set", "relay_metrics_listen=", *args],
        env={**os.environ, "TTFT_RELAY_CONF": conf}, capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 1
    assert f"cannot start the relay: {reason}" in proc.stdout + proc.stderr


def test_mitm_conf_documents_every_relay_option_with_the_codes_default(tmp_path):
    # mitm.conf sets only what differs from the code (the listeners) and lists every relay
    # option, commented out, with its default: a default changed in code must change there.
    import os
    import re
    import subprocess

    from mitmproxy import optmanager

    from tests.harness import MITMDUMP, RELAY_SCRIPT

    out = subprocess.run([str(MITMDUMP), "--set", f"confdir={tmp_path}", "--listen-host", "127.0.0.1",
                          "-s", str(RELAY_SCRIPT), "--options"],
                         env={**os.environ, "TTFT_RELAY_CONF": ""}, capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL, check=True).stdout
    code = {k: v for k, v in optmanager.parse(out).items() if k.startswith("relay_")}
    conf = config.DEFAULT_CONF.read_text()
    documented = {m.group(1): optmanager.parse(f"v: {m.group(2)}")["v"]
                  for m in re.finditer(r"^# (relay_\w+):(.*)$", conf, re.M)}
    assert not [k for k in config.read_conf(config.DEFAULT_CONF) if k.startswith("relay_")], \
        "mitm.conf sets relay options: ship the code's defaults, and document them commented out"
    assert sorted(set(code) - set(documented)) == [], "relay options missing from mitm.conf"
    assert sorted(set(documented) - set(code)) == [], "mitm.conf documents options the relay does not have"
    machine_specific = {"relay_timing_log"}  # a path in the checkout
    assert {k: v for k, v in documented.items() if k not in machine_specific and code[k] != v} == {}
    assert code["relay_timing_log"].endswith(documented["relay_timing_log"])
