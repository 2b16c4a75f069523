"""``python -m flashattn_hopper.sweep``: the perf sweep without the main CLI."""

import sys

from . import main

sys.exit(main())
