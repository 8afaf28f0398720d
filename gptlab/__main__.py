"""``python -m gptlab``: see ``gptlab.cli``."""

import sys

from .cli import main

sys.exit(main())
