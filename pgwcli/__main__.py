"""``python -m cli ...``: the same as ``pgw ...``."""

import sys

from cli.main import main

if __name__ == "__main__":
    sys.exit(main())
