"""`python -m nanoinfer.bench SUITE [options]`: the same as `nanoinfer bench SUITE [options]`."""

import sys

from . import main

sys.exit(main())
