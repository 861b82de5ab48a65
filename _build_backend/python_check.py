"""`pip install .`'s build backend: setuptools', after a check that this Python can run the relay.

pip on an older Python (Debian 12's 3.11) would otherwise end on "No matching distribution
found for mitmproxy==12.3.1" (mitmproxy 12 needs Python 3.12 too), naming neither the
Python it ran nor the one to use. pip imports this module in the Python it installs for,
so that is the one checked.
"""

import sys

from setuptools.build_meta import *  # noqa: F403 (the hooks pip calls: setuptools' own)

REQUIRED = (3, 12)

if sys.version_info < REQUIRED:
    sys.exit(
        f"ttft-relay needs Python {REQUIRED[0]}.{REQUIRED[1]} or newer (mitmproxy 12 does); this pip runs "
        f"Python {sys.version.split()[0]} ({sys.executable}). Install with a newer one: "
        f"python3.12 -m pip install . (in a venv made by it: python3.12 -m venv .venv). On Debian 12, "
        f"whose python3 is 3.11: README, 'Relay on a VPS'."
    )
