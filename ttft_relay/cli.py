"""`ttft-relay`: the relay's one command.

    ttft-relay run [mitmdump arguments]   the relay (mitmdump with the relay's addons);
                   [--workers N|auto]     N of them sharing its listeners (auto: one per core)
    ttft-relay web [mitmweb arguments]    the same in mitmweb, to watch flows in a browser
    ttft-relay report LOG ... [--html F]  the timing logs summarised (--help: the options)
    ttft-relay diagnose [--relay URL]     why is my first token slow? probes it, names the cause
    ttft-relay bench NAME [arguments]     a benchmark, from a checkout (bench --help: their names)
    ttft-relay addon-path                 the addon file for any mitmproxy tool:
                                          mitmproxy -s "$(ttft-relay addon-path)" (no mitm.conf)

`run` and `web` read mitm.conf (TTFT_RELAY_CONF names another file, empty: none) under
their arguments and start mitmproxy with both (see ttft_relay/config.py). From a
checkout, `scripts/relay` is `ttft-relay run --workers auto` (ttft_relay/workers.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import launch

CHECKOUT = Path(__file__).resolve().parent.parent
BENCHMARKS = CHECKOUT / "benchmarks"
"""Beside the package in a checkout; an installed package has none."""


def benchmark_names() -> list[str]:
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_") and p.stem != "baseline_stream")


def bench(args: list[str]) -> int:
    """Runs benchmarks/NAME.py as a module of the checkout (they use its tests/ support code)."""
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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(__doc__.strip())
        return 0
    command, rest = args[0], args[1:]
    if command == "addon-path":
        print(launch.ADDON)
        return 0
    if command == "run":
        from . import workers

        return workers.main(rest)
    if command == "web":
        launch.start("mitmweb", rest)
    if command == "report":
        from .report import report

        return report.main(rest)
    if command == "diagnose":
        from .diagnose import diagnose

        return diagnose.main(rest)
    if command == "bench":
        return bench(rest)
    print(f"ttft-relay: unknown command {command!r}\n\n{__doc__.strip()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
