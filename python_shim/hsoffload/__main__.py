"""`python -m hsoffload` is the `hsoffload` command (useful where the console script is not installed)."""

import sys

from .tools.cli import main

sys.exit(main())
