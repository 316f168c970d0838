"""`python -m tinykv ...`: see tinykv/cli."""

import sys

from .cli import main

sys.exit(main())
