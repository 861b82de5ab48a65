"""The relay's configuration: code defaults < mitm.conf < command line, merged once.

The command that starts mitmproxy (`ttft-relay run|web`, `scripts/relay` and each of
its workers) reads mitm.conf and puts its values on mitmproxy's command line, as
`--set name=value` ahead of the user's arguments, leaving out every option those
arguments set; ahead of them, the relay's defaults for mitmproxy's own options
(`MITMPROXY_DEFAULTS`, and the listeners of the README's client settings on loopback,
`DEFAULT_MODES`), which mitm.conf and the command line override. mitmproxy then
starts with the merged options: the listeners of mitm.conf are bound from its first
moment, and the relay's own options (`relay_*`, declared later as the addons load) go
through mitmproxy's deferred mechanism like any other `--set`. mitmproxy's own confdir/config.yaml, where there is one, is applied by
mitmproxy over `--set` values (its rule), and under its flags (`-p`, `--mode`, ...).

`mitmdump -s "$(ttft-relay addon-path)"` loads the addons without mitm.conf (and without
`MITMPROXY_DEFAULTS`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mitmproxy import addons as mitmproxy_addons
from mitmproxy import ctx, exceptions, optmanager, options
from mitmproxy.tools import cmdline
from mitmproxy.tools.main import process_options

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONF = REPO_ROOT / "mitm.conf"
CONF_ENV = "TTFT_RELAY_CONF"
"""Environment variable naming another config file (empty: none)."""

MITMPROXY_DEFAULTS: dict[str, Any] = {
    # HTTP/1.1 to both sides whatever the client offers. mitmproxy carries HTTP/2 frame by
    # frame through its h2 layers: 1.5-1.8x the CPU per streamed event of HTTP/1.1, where the
    # splice and its direct reads apply (`scripts/bench streams --h2 --variant
    # h2:http2=true`). The APIs' SDKs and Claude Code speak HTTP/1.1; the Codex CLI's HTTP
    # fallback and curl offer h2 first and take HTTP/1.1. A client that insists on h2 gets
    # no ALPN match: set `http2: true` for it.
    "http2": False,
}
"""mitmproxy options the relay starts with at another default than mitmproxy's."""

DEFAULT_LISTEN_HOST = "127.0.0.1"
DEFAULT_MODES = ["regular@8080", "reverse:https://api.openai.com@8001", "reverse:https://api.anthropic.com@8002"]
"""The listeners of the README's client settings, on loopback: what the command opens where
neither the config file nor the command line names listeners (an installed relay has no
mitm.conf). The checkout's mitm.conf spells out the same (tests/test_config.py keeps them equal)."""

_PARSERS = {"mitmdump": cmdline.mitmdump, "mitmweb": cmdline.mitmweb, "mitmproxy": cmdline.mitmproxy}


def conf_path() -> Path | None:
    """The config file to read: TTFT_RELAY_CONF's (it must exist), else the checkout's
    mitm.conf where there is one (an installed package has none)."""
    value = os.environ.get(CONF_ENV)
    if value is None:
        return DEFAULT_CONF if DEFAULT_CONF.exists() else None
    return Path(value) if value else None


def read_conf(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf8")
    except OSError as e:
        raise exceptions.OptionsError(f"cannot read {path}: {e}") from e
    try:
        data = optmanager.parse(text)
    except exceptions.OptionsError as e:  # mitmproxy's words name the line, not the file
        raise exceptions.OptionsError(f"{path}: {e}") from e
    if not isinstance(data, dict):
        raise exceptions.OptionsError(f"{path}: expected a mapping of option names to values")
    if "scripts" in data:
        # Loading scripts from the config that loads us would load us twice.
        raise exceptions.OptionsError(f"{path}: 'scripts' belongs on the command line")
    return data


class _Declarer:
    """Just enough of mitmproxy's addon Loader to declare an addon's options."""

    def __init__(self, opts: optmanager.OptManager) -> None:
        self.opts = opts

    def add_option(self, name, typespec, default, help, choices=None) -> None:
        self.opts.add_option(name, typespec, default, help, choices)

    def add_command(self, path, func) -> None:
        pass

    def declare(self, addon) -> None:
        if load := getattr(addon, "load", None):
            load(self)
        for child in getattr(addon, "addons", []):
            self.declare(child)


def _tool_addons(tool: str) -> list:
    """The addons (beyond mitmproxy's defaults) whose options `tool`'s command line spells as flags."""
    from mitmproxy.addons import dumper, intercept, keepserving, readfile

    if tool == "mitmweb":
        from mitmproxy.tools.web import webaddons

        return [webaddons.WebAddon(), webaddons.WebAuth(), intercept.Intercept(), readfile.ReadFileStdin()]
    return [dumper.Dumper(), keepserving.KeepServing(), readfile.ReadFileStdin()]


def declared_options(tool: str = "mitmdump", declaring: Iterable = ()) -> options.Options:
    """mitmproxy's options as `tool` declares them before it loads any script, plus those
    of the addons `declaring` (whose `load` must only declare options)."""
    opts = options.Options()
    declarer = _Declarer(opts)
    for addon in [*mitmproxy_addons.default_addons(), *_tool_addons(tool), *declaring]:
        declarer.declare(addon)
    return opts


def command_line_options(argv: list[str], known: optmanager.OptManager) -> set[str]:
    """Names of the options the mitmproxy command line `argv` sets explicitly;
    `known` holds every option declared so far (mitmproxy's own addons').

    Parsed with mitmproxy's own parser, so `-p`, `--mode`, `--set x=y` and every
    other spelling count. Outside a mitmproxy tool (tests), nothing does.
    """
    tool = Path(argv[0]).name if argv else ""
    make_parser = _PARSERS.get(tool)
    if make_parser is None:
        return set()
    parser = make_parser(known)
    try:
        args, _ = parser.parse_known_args(argv[1:])
    except SystemExit:  # mitmproxy will say what is wrong with this command line
        return set()
    explicit = {k for k, v in vars(args).items() if v is not None and k in known}
    explicit.update(s.split("=", 1)[0].strip() for s in (args.setoptions or []))
    return explicit


def set_args(name: str, value: Any) -> list[str]:
    """`name: value` from a config file as mitmproxy's command line spells it."""
    if isinstance(value, list):
        values = [str(v) for v in value]
        return [a for v in values for a in ("--set", f"{name}={v}")] if values else ["--set", name]
    if value is None:
        return ["--set", name]  # an optional option unset
    if isinstance(value, bool):
        return ["--set", f"{name}={str(value).lower()}"]
    if isinstance(value, int | float | str):
        return ["--set", f"{name}={value}"]
    raise exceptions.OptionsError(f"{name}: expected a value or a list of values, not {value!r}")


def default_listeners(named: set[str]) -> dict[str, Any]:
    """The relay's default listeners for a command line and config file that set the options
    `named`: loopback unless `listen_host` is named, and `DEFAULT_MODES` unless `mode` or
    `listen_port` is (`-p 9000` alone is mitmproxy's regular proxy on 9000, as in mitmdump)."""
    defaults: dict[str, Any] = {"listen_host": DEFAULT_LISTEN_HOST}
    if not named & {"mode", "listen_port"}:
        defaults["mode"] = DEFAULT_MODES
    return defaults


def merged_args(args: list[str], path: Path | None, tool: str = "mitmdump") -> list[str]:
    """`tool`'s command line `args` with the values of the config file at `path` (none:
    no file) ahead, over `MITMPROXY_DEFAULTS` and the default listeners, for every option
    `args` does not set. Raises OptionsError for a file that cannot be read or holds what no
    command line could."""
    explicit = command_line_options([tool, *args], declared_options(tool))
    file_values = read_conf(path) if path is not None else {}
    values = {**MITMPROXY_DEFAULTS, **file_values}
    for name, value in default_listeners(explicit | set(file_values)).items():
        values.setdefault(name, value)
    conf = [a for name, value in values.items() if name not in explicit for a in set_args(name, value)]
    return [*conf, *args]


def started_options(args: list[str], declaring: Iterable = (), tool: str = "mitmdump") -> options.Options:
    """The options `tool` ends up with for the command line `args`, set as mitmproxy's
    start-up sets them (mitmproxy.tools.main.run), without starting anything. Options
    of the relay that `declaring` does not declare stay deferred (strings)."""
    opts = declared_options(tool, declaring)
    parser = _PARSERS[tool](opts)
    ns = parser.parse_args(args)
    opts.set(*ns.setoptions, defer=True)
    confdir = os.path.expanduser(opts.confdir)
    optmanager.load_paths(opts, os.path.join(confdir, "config.yaml"), os.path.join(confdir, "config.yml"))
    process_options(parser, opts, ns)
    return opts


RENAMED = {
    "relay_header_timeout": "relay_client_head_timeout",
    "relay_head_timeout": "relay_upstream_head_timeout",
}
"""Old option name → its name now. Each said which side's head it bounds only in one letter
(the client's request head, 30 s, beside the upstream's response head, 600 s); the old
names are still accepted, with a warning, for one release."""


class RenamedOptions:
    """Accepts the options of `RENAMED` under their old names (relay.conf, `--set`,
    mitm.conf copies from before the rename): each is declared, and a value set for it
    is set on the new name, with a warning that says the new one. Where both are set,
    the new name wins. Must come before OptionsCheck, which applies the deferred values."""

    def load(self, loader) -> None:
        for old, new in RENAMED.items():
            loader.add_option(old, int | None, None, f"Old name of {new} (accepted for one release).")

    def configure(self, updated: set[str]) -> None:
        for old, new in RENAMED.items():
            value = getattr(ctx.options, old)
            if old not in updated or value is None:
                continue
            if ctx.options.has_changed(new):
                logger.warning("%s is now %s, which is set: %s=%s ignored", old, new, old, value)
                continue
            logger.warning("%s is now %s: set that instead (the old name goes in the next release)", old, new)
            ctx.options.update(**{new: value})


class OptionsCheck:
    """Refuses to start a relay whose options cannot be applied. Must come last in
    the addon list.

    mitmproxy defers `--set relay_…=value` (and mitm.conf's values) until the addon
    that declares the option is loaded, and applies them once the whole script has
    loaded; a value that does not parse there (`relay_stream=False`: mitmproxy's
    booleans are `true`/`false`) makes it drop the script without a word and carry
    on as a bare, buffering proxy. Applying the deferred values here, while the
    script still loads, turns that into an error at start-up, which stops mitmdump.
    """

    def load(self, loader) -> None:
        try:
            ctx.options.process_deferred()
        except exceptions.OptionsError as e:
            logger.error("cannot start the relay: %s", e)

    def running(self) -> None:
        # Every script has loaded: what is still deferred, no addon declares.
        if unknown := sorted(ctx.options.deferred):
            logger.warning("unknown options (ignored): %s", ", ".join(unknown))
