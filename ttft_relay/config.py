"""Reads `mitm.conf` (mitmproxy options, core and `relay_*`) at start.

Precedence: built-in defaults < mitm.conf < command line. mitmproxy has applied
the command line (and its own confdir/config.yaml) before it loads our script,
so a value from mitm.conf is applied only where the command line did not name
the option. Options of addons not loaded yet (`relay_*`) are handed to
mitmproxy's deferred mechanism, which sets them as each addon declares them.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from mitmproxy import ctx, exceptions, optmanager
from mitmproxy.tools import cmdline

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONF = REPO_ROOT / "mitm.conf"
CONF_ENV = "TTFT_RELAY_CONF"
"""Environment variable naming another config file (empty: none)."""

LISTENER_OPTIONS = {"mode", "listen_host", "listen_port"}

_PARSERS = {"mitmdump": cmdline.mitmdump, "mitmweb": cmdline.mitmweb, "mitmproxy": cmdline.mitmproxy}


def conf_path() -> Path | None:
    """The config file to read: TTFT_RELAY_CONF's (it must exist), else the checkout's
    mitm.conf where there is one (an installed package has none)."""
    value = os.environ.get(CONF_ENV)
    if value is None:
        return DEFAULT_CONF if DEFAULT_CONF.exists() else None
    return Path(value) if value else None


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
    except SystemExit:  # mitmproxy itself has already accepted this command line
        return set()
    explicit = {k for k, v in vars(args).items() if v is not None and k in known}
    explicit.update(s.split("=", 1)[0].strip() for s in (args.setoptions or []))
    return explicit


def read_conf(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf8")
    except OSError as e:
        raise exceptions.OptionsError(f"cannot read {path}: {e}") from e
    data = optmanager.parse(text)
    if not isinstance(data, dict):
        raise exceptions.OptionsError(f"{path}: expected a mapping of option names to values")
    return data


def conf_values(path: Path, argv: list[str], opts: optmanager.OptManager) -> dict[str, Any]:
    """What the config file at `path` contributes: its values for the options that
    the command line `argv` does not set (`opts` has the command line applied).
    Also used by scripts/workers.py to see the options its workers will see."""
    explicit = command_line_options(argv, opts)
    applied = {
        name: value
        for name, value in read_conf(path).items()
        if name not in explicit and name not in opts.deferred  # the command line wins
    }
    if "scripts" in applied:
        # Loading scripts from the config that loads us would load us twice.
        raise exceptions.OptionsError(f"{path}: 'scripts' belongs on the command line")
    return applied


class RelayConfig:
    """Applies mitm.conf under the command line. Must come first in the addon list,
    so that the values are in place before the other addons declare their options."""

    def __init__(self, path: Path | None = None, argv: list[str] | None = None) -> None:
        self.path = path if path is not None else conf_path()
        self.argv = sys.argv if argv is None else argv
        self.applied: dict[str, Any] = {}

    def load(self, loader) -> None:
        if self.path is None:
            return
        try:
            self.applied = conf_values(self.path, self.argv, ctx.options)
        except exceptions.OptionsError as e:
            # Raised from `load`, mitmproxy would drop the script without a word (see
            # OptionsCheck); an error logged at start-up stops mitmdump with the reason.
            logger.error("cannot start the relay: %s", e)
            return
        ctx.options.update_defer(**self.applied)
        logger.debug("applied %s from %s", ", ".join(self.applied) or "nothing", self.path)

    def running(self) -> None:
        # mitmproxy binds its listeners before it loads scripts (mitmdump defers the
        # load), so listener options from mitm.conf reach a proxy server that has
        # already started. Setting them again now that it runs makes it rebind.
        rebind = {k: getattr(ctx.options, k) for k in LISTENER_OPTIONS & set(self.applied)}
        if rebind:
            ctx.options.update(**rebind)
        unknown = sorted(set(self.applied) & set(ctx.options.deferred))
        if unknown:
            logger.warning("%s names unknown options (ignored): %s", self.path, ", ".join(unknown))


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
