"""``python -m pgwcli ...``: the same as ``pgw ...``."""

import sys

from pgwcli.main import main

if __name__ == "__main__":
    sys.exit(main())
