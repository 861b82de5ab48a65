"""How a mitmproxy tool starts as the relay: its addons loaded, mitm.conf merged under the
command line before mitmproxy binds. Used by the command (`ttft-relay run|web`, cli.py)
and by the supervisor for its workers (workers.py).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import NoReturn

ADDON = Path(__file__).resolve().parent / "relay.py"
EXIT_CONFIG = 78
"""sysexits' EX_CONFIG: a configuration no restart can fix (a bad option, a YAML error, a
port taken); the systemd unit's RestartPreventExitStatus, so it is not retried."""


class CannotStart(SystemExit):
    """The relay's configuration cannot be applied: exits EXIT_CONFIG once `say` has
    printed it (cli.main, a worker's main)."""

    def __init__(self, reason: str) -> None:
        super().__init__(EXIT_CONFIG)
        self.reason = reason

    def __str__(self) -> str:
        return f"ttft-relay: cannot start the relay: {self.reason}"

    def say(self) -> int:
        print(self, file=sys.stderr, flush=True)
        return EXIT_CONFIG


def tool_path(name: str) -> str:
    """The mitmproxy tool installed beside this interpreter (the same environment), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"ttft-relay: {name} not found (is mitmproxy installed in this environment?)")
    return found


def start(tool: str, args: list[str]) -> NoReturn:
    """Runs mitmproxy's `tool` (mitmdump, mitmweb) with the relay's addons and mitm.conf merged
    into `args`, in this process as the tool's own console script would: the modules the merge
    needed are the tool's, loaded once."""
    from mitmproxy.tools import main as mitmproxy_main

    merged = relay_args(args, tool)
    load_tokenizers_early(merged, tool)
    tool_args = ["-s", str(ADDON), *merged]
    sys.argv = [tool, *tool_args]  # what the tool and the addons read as its command line
    getattr(mitmproxy_main, tool)(tool_args)
    sys.exit(0)


def relay_args(args: list[str], tool: str = "mitmdump") -> list[str]:
    """`args` with mitm.conf merged in; a config that cannot be applied stops here, in one line."""
    from mitmproxy import exceptions

    from . import config

    try:
        return config.merged_args(args, config.conf_path(), tool)
    except exceptions.OptionsError as e:
        raise CannotStart(str(e)) from None


def load_tokenizers_early(args: list[str], tool: str) -> None:
    """Loads the tokenizers (`tokens.TokenizerLoader`) before mitmproxy starts, if `args`
    trim: mitmproxy listens before it loads the relay's script, so a client that connected
    at once waited for them (0.6-0.8 s); now the Trim addon finds them loaded
    (`tokens.loader_for`). Options that do not parse leave the load to the Trim addon,
    whose start says why they do not."""
    from mitmproxy import exceptions

    from . import config
    from .trim import addon as trim
    from .trim import tokens

    try:
        opts = config.started_options(args, [trim.Trim()], tool=tool)
    except (exceptions.OptionsError, SystemExit):
        return
    if opts.relay_trim:
        tokens.loader_for(opts.relay_tiktoken_file).load()  # said once the relay logs (Trim)
