"""`python -m ttft_relay …`: the `ttft-relay` command."""

import sys

from .cli import main

sys.exit(main())
