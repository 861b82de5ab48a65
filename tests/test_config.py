from pathlib import Path

import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons

from ttft_relay import config
from ttft_relay.faults import addons as faults
from ttft_relay.guard import limits


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


def test_conf_goes_on_the_command_line_under_the_users_arguments(tmp_path):
    path = _conf(tmp_path, "listen_port: 7001\nlisten_host: 0.0.0.0\nmode: [regular@1, 'reverse:http://a@2']\n"
                           "relay_future_option: 5\nrelay_stream: false\nrelay_access_keys: []\ncerts: null\n")
    args = config.merged_args(["--set", "listen_host=127.0.0.2", "-q"], path)
    assert args == ["--set", "http2=false", "--set", "listen_port=7001", "--set", "mode=regular@1", "--set", "mode=reverse:http://a@2",
                    "--set", "relay_future_option=5", "--set", "relay_stream=false", "--set", "relay_access_keys",
                    "--set", "certs", "--set", "listen_host=127.0.0.2", "-q"]
    # As mitmdump starts with them: the file's values, the command line's where it names one.
    opts = config.started_options([*args, "--set", f"confdir={tmp_path}"])
    assert (opts.listen_port, opts.listen_host, opts.mode) == (7001, "127.0.0.2", ["regular@1", "reverse:http://a@2"])
    assert opts.certs == [] and opts.deferred["relay_stream"].val == ["false"]  # set when the relay declares it
    # Every spelling of an option counts as the command line's.
    assert config.merged_args(["-p", "9", "--mode", "socks5"], path)[2:8] == [
        "--set", "listen_host=0.0.0.0", "--set", "relay_future_option=5", "--set", "relay_stream=false"]


LISTENERS = ["--set", "listen_host=127.0.0.1", "--set", "mode=regular@8080", "--set",
             "mode=reverse:https://api.openai.com@8001", "--set", "mode=reverse:https://api.anthropic.com@8002"]


def test_the_relays_defaults_for_mitmproxy_options_yield_to_the_file_and_the_command_line(tmp_path):
    # HTTP/1.1 both sides (config.MITMPROXY_DEFAULTS), without a file too.
    assert config.merged_args(["-q"], None) == ["--set", "http2=false", *LISTENERS, "-q"]
    assert config.started_options(config.merged_args([], None) + ["--set", f"confdir={tmp_path}"]).http2 is False
    assert config.merged_args([], _conf(tmp_path, "http2: true\n")) == ["--set", "http2=true", *LISTENERS]
    assert config.merged_args(["--set", "http2=true"], None) == [*LISTENERS, "--set", "http2=true"]
    assert config.merged_args(["--no-http2"], None) == [*LISTENERS, "--no-http2"]  # every spelling counts


def test_without_a_config_file_the_command_opens_the_readmes_listeners(tmp_path):
    # An installed relay has no mitm.conf: it serves the client settings all the same, on loopback
    # (it once refused to start as an open proxy on all interfaces, then opened only 8080).
    opts = config.started_options(config.merged_args([], None) + ["--set", f"confdir={tmp_path}"])
    assert (opts.listen_host, opts.mode) == ("127.0.0.1", config.DEFAULT_MODES)
    shipped = config.read_conf(config.DEFAULT_CONF)  # the checkout's file spells out the same
    assert (shipped["listen_host"], shipped["mode"]) == (config.DEFAULT_LISTEN_HOST, config.DEFAULT_MODES)
    # Listeners named anywhere replace them; -p alone is mitmproxy's regular proxy on that port.
    assert config.merged_args(["-p", "0"], None) == ["--set", "http2=false", *LISTENERS[:2], "-p", "0"]
    assert config.merged_args(["--mode", "socks5"], None) == ["--set", "http2=false", *LISTENERS[:2], "--mode", "socks5"]
    assert config.merged_args(["--listen-host", "::1"], None) == ["--set", "http2=false", *LISTENERS[2:],
                                                                  "--listen-host", "::1"]
    assert "mode" not in " ".join(config.merged_args([], _conf(tmp_path, "mode: [socks5]\n"))).replace("mode=socks5", "")


def test_mitmweb_flags_count_as_its_command_line(tmp_path):
    path = _conf(tmp_path, "web_port: 9000\nweb_host: 0.0.0.0\n")
    assert config.merged_args(["--web-port", "9100"], path, "mitmweb") == ["--set", "http2=false", "--set",
                                                                          "web_host=0.0.0.0", *LISTENERS,
                                                                          "--web-port", "9100"]


def test_conf_must_not_load_scripts(tmp_path):
    with pytest.raises(exceptions.OptionsError, match="'scripts' belongs on the command line"):
        config.merged_args([], _conf(tmp_path, "scripts: [ttft_relay/relay.py]\n"))
    with pytest.raises(exceptions.OptionsError, match="expected a value or a list of values"):
        config.merged_args([], _conf(tmp_path, "relay_scope: {a: 1}\n"))


def test_conf_errors_are_clear(tmp_path):
    with pytest.raises(exceptions.OptionsError, match="cannot read"):
        config.read_conf(tmp_path / "missing.conf")
    with pytest.raises(exceptions.OptionsError):
        config.read_conf(_conf(tmp_path, "mode: [unclosed\n"))


BAD_YAML = "mode:\n  - reverse:https://api.openai.com@8443\n listen_host: 0.0.0.0\n"


@pytest.mark.parametrize(
    "conf, args, reason, code",
    [
        ("", ["--set", "relay_stream=False"], "Failed to parse option relay_stream", 1),
        # A file that cannot be read, or read as YAML, stops it before mitmdump starts, with
        # sysexits' EX_CONFIG, which the systemd unit does not retry (it retried a YAML error 5x).
        ("/nonexistent/mitm.conf", [], "cannot read /nonexistent/mitm.conf", 78),
        ("bad.conf", [], "{conf}: Config error at line 3", 78),
    ],
)
def test_a_relay_that_cannot_be_configured_does_not_start(conf, args, reason, code, confdir, tmp_path):
    # mitmproxy would drop the relay script without a word and go on as a bare, buffering proxy.
    # Through the command, which reads mitm.conf.
    import os
    import subprocess
    import sys

    if conf == "bad.conf":
        conf = str(tmp_path / conf)
        Path(conf).write_text(BAD_YAML)
        reason = reason.format(conf=conf)

    proc = subprocess.run(
        [sys.executable, "-m", "ttft_relay", "run", "--set", f"confdir={confdir}", "--listen-host", "127.0.0.1",
         "-p", "0", "--set", "relay_metrics_listen=", *args],
        env={**os.environ, "TTFT_RELAY_CONF": conf}, capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert f"cannot start the relay: {reason}" in proc.stdout + proc.stderr


def test_mitm_conf_documents_every_relay_option_with_the_codes_default(tmp_path):
    # mitm.conf sets only the listeners (the command's defaults, spelled out) and lists every relay
    # option, commented out, with its default: a default changed in code must change there.
    import os
    import re
    import subprocess

    from mitmproxy import optmanager

    from ttft_relay.testing.harness import MITMDUMP, RELAY_SCRIPT

    out = subprocess.run([str(MITMDUMP), "--set", f"confdir={tmp_path}", "--listen-host", "127.0.0.1",
                          "-s", str(RELAY_SCRIPT), "--options"],
                         env={**os.environ, "TTFT_RELAY_CONF": ""}, capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL, check=True).stdout
    code = {k: v for k, v in optmanager.parse(out).items() if k.startswith("relay_") and k not in config.RENAMED}
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


def test_the_listeners_of_mitm_conf_are_the_first_ones_bound(tmp_path, confdir):
    # mitmproxy binds before it loads the relay: mitm.conf applied by the relay itself would
    # leave mitmproxy's default listener (all interfaces, 8080) open until it rebinds.
    import os
    import subprocess
    import sys

    conf = _conf(tmp_path, "listen_host: 127.0.0.1\nmode: ['reverse:http://127.0.0.1:9@0']\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ttft_relay", "run", "--set", f"confdir={confdir}", "--set", "relay_metrics_listen=",
         "--set", f"relay_timing_log={tmp_path / 'timing.jsonl'}"],
        env={**os.environ, "TTFT_RELAY_CONF": str(conf)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, text=True)
    try:
        first = next((line for line in proc.stdout if "listening at" in line), "")
    finally:
        proc.terminate()
        proc.wait(30)
    assert "reverse proxy to http://127.0.0.1:9 listening at 127.0.0.1:" in first, first


@pytest.mark.parametrize("old, new", sorted(config.RENAMED.items()))
def test_an_old_option_name_still_sets_the_new_one_with_a_warning(old, new, caplog):
    # relay_header_timeout / relay_head_timeout said which side's head only in one letter.
    limits_and_deadlines = [limits.ClientLimits(), faults.Deadlines(), config.RenamedOptions()]
    with taddons.context(*limits_and_deadlines) as tctx:
        tctx.configure(limits_and_deadlines[-1], **{old: 7})
        assert getattr(tctx.options, new) == 7
        assert f"{old} is now {new}" in caplog.text
        tctx.configure(limits_and_deadlines[-1], **{new: 9, old: 8})  # both set: the new name wins
        assert getattr(tctx.options, new) == 9
