"""``python -m flashattn_hopper``: see cli.py."""

import sys

from .cli import main

sys.exit(main())
