"""`ttft-relay`: the relay's one command.

    ttft-relay run [mitmdump arguments]   the relay (mitmdump with the relay's addons);
                   [--workers N|auto]     N of them sharing its listeners (auto: one per core)
                                          (run --help: the relay's options, then mitmdump's)
    ttft-relay reload [run's arguments]   relay.conf read again by new workers, turns in flight
                                          finished by the old (the relay run with --workers N|auto)
    ttft-relay web [mitmweb arguments]    the same in mitmweb, to watch flows in a browser
    ttft-relay report LOG ... [--html F]  the timing logs summarised (--help: the options)
    ttft-relay diagnose [--relay URL]     why is my first token slow? probes it, names the cause
    ttft-relay bench NAME [arguments]     a benchmark, from a checkout (bench --help: their names)
    ttft-relay addon-path                 the addon file for any mitmproxy tool:
                                          mitmproxy -s "$(ttft-relay addon-path)" (no mitm.conf)
    ttft-relay --version                  its version, mitmproxy's and Python's

`run` and `web` read mitm.conf (TTFT_RELAY_CONF names another file, empty: none) under
their arguments and start mitmproxy with both (see ttft_relay/config.py); without a file
they open the README's listeners on 127.0.0.1 (OpenAI 8001, Anthropic 8002, proxy 8080).
From a checkout, `scripts/relay` is `ttft-relay run --workers auto` (ttft_relay/workers.py).
"""

from __future__ import annotations

import os
import platform
import sys
import textwrap
from pathlib import Path
from typing import Any

from . import __version__, launch

CHECKOUT = Path(__file__).resolve().parent.parent
BENCHMARKS = CHECKOUT / "benchmarks"
"""Beside the package in a checkout; an installed package has none."""


def benchmark_names() -> list[str]:
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_") and p.stem != "baseline_stream")


def bench(args: list[str]) -> int:
    """Runs benchmarks/NAME.py as a module of the checkout (they import one another, and benchmarks/_setups.py)."""
    if not (CHECKOUT / "pyproject.toml").exists() or not BENCHMARKS.is_dir():  # site-packages may hold another
        print("ttft-relay bench: the benchmarks run from a checkout (git clone, then scripts/bench NAME)",
              file=sys.stderr)
        return 2
    names = benchmark_names()
    if not args or args[0] not in names:
        lines = [f"  {name:<10} {first_line(BENCHMARKS / f'{name}.py')}" for name in names]
        asked = bool(args) and args[0] in ("-h", "--help")
        print("ttft-relay bench NAME [arguments]   (NAME --help: its arguments)\n\n" + "\n".join(lines),
              file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    repo = str(CHECKOUT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    os.execve(sys.executable, [sys.executable, "-m", f"benchmarks.{args[0]}", *args[1:]], env)


def first_line(path: Path) -> str:
    """The first sentence of a module's docstring."""
    import ast

    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf8"))) or ""
    return doc.split("\n\n", 1)[0].replace("\n", " ").split(". ", 1)[0]


def version() -> str:
    from mitmproxy.version import VERSION

    return f"ttft-relay {__version__} (mitmproxy {VERSION}, Python {platform.python_version()})"


FIRST_OPTIONS = ("mode", "listen_host", "relay_first_token_timeout", "relay_trim_max_tokens", "relay_timing_log",
                 "relay_slow_ms", "relay_access_keys", "certs", "relay_metrics_listen", "relay_otlp_endpoint")
"""The options people change first: `run --help` shows them before the rest, in the order of the
README's "Configuration" table (tests/test_readme.py keeps the two the same)."""

WORKERS_HELP = """\
  --workers N|auto      N relay processes sharing the listeners (auto: one per core);
                        default 1, scripts/relay: auto (docs/scaling.md)"""


def tool_help(command: str, tool: str, args: list[str]) -> str:
    """`ttft-relay run|web --help`: what the relay starts with and its own options, then the
    mitmproxy tool's help."""
    from . import config

    lines = [f"usage: ttft-relay {command} {'[--workers N|auto] ' if command == 'run' else ''}[{tool} options]",
             "",
             f"The relay: {tool} with the relay's addons. Options: built-in defaults < config file < this",
             "command line (--set NAME=VALUE, or the flags below).",
             ""]
    conf = config.conf_path()
    lines.append(f"  config file: {conf if conf else 'none'} (TTFT_RELAY_CONF=PATH names another, empty: none)")
    try:
        opts = config.started_options(launch.relay_args([a for a in args if a not in ("-h", "--help")], tool),
                                      tool=tool)
        lines.append(f"  listeners:   {', '.join(opts.mode)} on {opts.listen_host or 'all interfaces'}")
    except (SystemExit, Exception) as e:  # a config that cannot be read: says why
        lines.append(f"  listeners:   cannot tell ({e})")
    if command == "run":
        lines += ["", WORKERS_HELP]
    relay = {name: (default, text) for name, default, text in relay_options()}
    mitmproxy = config.declared_options(tool)
    first = {name: relay.get(name) or (_shown_default(mitmproxy.default(name)), mitmproxy._options[name].help)
             for name in FIRST_OPTIONS}
    lines += ["", "The options to change first (--set NAME=VALUE; the README's \"Configuration\"):"]
    lines += _described(first)
    lines += ["", "The relay's other options, with their defaults (mitm.conf documents each):"]
    lines += _described({name: described for name, described in relay.items() if name not in first})
    lines += ["", f"{tool}'s own options ({tool} --options lists every option):", ""]
    lines.append(config._PARSERS[tool](config.declared_options(tool)).format_help())
    return "\n".join(lines)


def _described(options: dict[str, tuple[str, str]]) -> list[str]:
    lines = []
    for name, (default, text) in options.items():
        lines.append(f"  {name} = {default}")
        lines += textwrap.wrap(" ".join(text.split()), 92, initial_indent=" " * 8, subsequent_indent=" " * 8)
    return lines


def relay_options() -> list[tuple[str, str, str]]:
    """(name, default as mitm.conf writes it, help) of every relay option, in the addons' order."""
    from mitmproxy import ctx, options

    from . import config, relay

    opts = options.Options()
    declarer = config._Declarer(opts)
    ctx.options = opts  # some addons' `load` reads options (in a running tool, ctx's)

    def declare(addon: Any) -> None:
        try:
            if load := getattr(addon, "load", None):
                load(declarer)
        except Exception:  # a load that needs a running tool: its options were declared first
            pass
        for child in getattr(addon, "addons", []):
            declare(child)

    for addon in relay.addons:
        declare(addon)
    return [(name, _shown_default(opts.default(name)), opts._options[name].help)
            for name in opts._options if name.startswith("relay_")]  # declared: grouped by concern


def _shown_default(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if value is None or value == "":
        return "''"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except launch.CannotStart as e:
        return e.say()


def _main(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help", "help"):
        print(__doc__.strip())
        return 0
    if args[0] in ("--version", "-V", "version"):
        print(version())
        return 0
    command, rest = args[0], args[1:]
    if command in ("run", "web") and ("--version" in rest or "-V" in rest):
        # Before any config is read: an image or a unit asks this with its config not (yet) there.
        print(version())
        return 0
    if command in ("run", "web") and ("-h" in rest or "--help" in rest):
        print(tool_help(command, "mitmdump" if command == "run" else "mitmweb", rest))
        return 0
    if command == "addon-path":
        print(launch.ADDON)
        return 0
    if command == "run":
        from . import prefork

        _, args, supervised = prefork.split_workers(rest)
        # On systemd's sockets (a restart) worker 0 starts now, beside the supervisor's own imports.
        first = prefork.first_worker(args) if supervised else None
        from . import workers

        return workers.main(rest, first)
    if command == "reload":
        from . import workers

        return workers.reload_main(rest)
    if command == "web":
        launch.start("mitmweb", rest)
    if command == "report":
        from .report import summary

        return summary.main(rest)
    if command == "diagnose":
        from .diagnose import cli as diagnose_cli

        return diagnose_cli.main(rest)
    if command == "bench":
        return bench(rest)
    print(f"ttft-relay: unknown command {command!r}\n\n{__doc__.strip()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
