"""`ttft-relay`: the relay's one command.

    ttft-relay run [mitmdump arguments]   the relay (mitmdump with the relay's addons)
    ttft-relay web [mitmweb arguments]    the same in mitmweb, to watch flows in a browser
    ttft-relay addon-path                 the addon file for any mitmproxy tool:
                                          mitmproxy -s "$(ttft-relay addon-path)" (no mitm.conf)

`run` and `web` read mitm.conf (TTFT_RELAY_CONF names another file, empty: none) under
their arguments and start mitmproxy with both (see ttft_relay/config.py).

From a checkout, `scripts/relay` also runs N workers behind HAProxy, and `scripts/report`,
`scripts/diagnose` and the `scripts/bench*` benchmarks read and measure the relay.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ADDON = Path(__file__).resolve().parent / "relay.py"
TOOLS = {"run": "mitmdump", "web": "mitmweb"}


def tool_path(name: str) -> str:
    """The mitmproxy tool installed beside this interpreter (the same environment), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"ttft-relay: {name} not found (is mitmproxy installed in this environment?)")
    return found


def relay_args(args: list[str], tool: str = "mitmdump") -> list[str]:
    """`args` with mitm.conf merged in; a config that cannot be applied stops here, in one line."""
    from mitmproxy import exceptions

    from . import config

    try:
        return config.merged_args(args, config.conf_path(), tool)
    except exceptions.OptionsError as e:
        raise SystemExit(f"ttft-relay: cannot start the relay: {e}") from None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(__doc__.strip())
        return 0
    command, rest = args[0], args[1:]
    if command == "addon-path":
        print(ADDON)
        return 0
    if command in TOOLS:
        tool = tool_path(TOOLS[command])
        os.execv(tool, [tool, "-s", str(ADDON), *relay_args(rest, TOOLS[command])])
    print(f"ttft-relay: unknown command {command!r}\n\n{__doc__.strip()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
