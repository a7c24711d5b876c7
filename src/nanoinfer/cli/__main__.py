"""`python -m nanoinfer.cli ...` (what torchrun runs for `nanoinfer batch` on several ranks)."""

import sys

from .main import main

if __name__ == "__main__":        # importing the package's modules (as tests do) runs nothing
    sys.exit(main())
