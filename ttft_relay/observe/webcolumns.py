"""mitmweb's flow list shows the relay's timing without a click: a Comment column.

The relay writes each flow's timing (ttft, verdict, phases) into its comment, but
mitmweb's default columns leave comments out, so every flow looks alike except for
mitmproxy's total `Time`. This addon adds the `comment` column (mitmweb's
`web_columns`, names from `mitmproxy.tools.web.web_columns`) to mitmweb's default
list, unless the user has chosen columns (config.yaml, mitm.conf or the command line).
"""

from __future__ import annotations

import logging
import sys

from mitmproxy import ctx

from .. import config

logger = logging.getLogger(__name__)

RELAY_WEB_COLUMNS = ["tls", "icon", "path", "method", "status", "size", "time", "comment"]
"""mitmproxy 12.3's default columns, then the comment."""


class CommentColumn:
    """Sets `web_columns` to RELAY_WEB_COLUMNS where the user left mitmproxy's default.
    mitm.conf's values reach mitmproxy on its command line (ttft_relay/config.py)."""

    def __init__(self, argv: list[str] | None = None) -> None:
        self.argv = sys.argv if argv is None else argv

    def load(self, loader) -> None:
        if "web_columns" not in ctx.options:  # mitmdump: no web interface
            return
        if ctx.options.has_changed("web_columns") or "web_columns" in config.command_line_options(self.argv, ctx.options):
            return  # the user's choice
        ctx.options.update(web_columns=RELAY_WEB_COLUMNS)
        logger.debug("mitmweb flow list: %s", ", ".join(RELAY_WEB_COLUMNS))
