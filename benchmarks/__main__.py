"""`python -m benchmarks SUITE [options]`: run a suite from a checkout (see `benchmarks/__init__.py`)."""

import sys

from . import main

sys.exit(main())
