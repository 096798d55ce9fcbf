#!/bin/sh
# Install what the browser-surface tests (tests/test_surface_*.py) need:
# Debian's chromium, driven by Playwright for Python (the `playwright` package
# of the project's `test` extra; never `playwright install`, which downloads
# its own browser build), and axe-core, pinned in tests/web/package.json (its
# lock file fixes the exact tarball), which the accessibility tests inject into
# the page. Idempotent: does nothing when both are there.
#
#   sh tests/web/setup.sh          # from the Makefile `test` target, or by hand
#
# Exit 0: $PGW_CHROMIUM (default /usr/bin/chromium) and axe-core are ready.
# Exit 1: one is missing and this script cannot install it (not root or no
# apt-get for chromium; no npm for axe-core).
set -eu
HERE="$(cd "$(dirname "$0")" && pwd)"
if [ ! -f "$HERE/node_modules/axe-core/axe.min.js" ]; then
    if ! command -v npm >/dev/null 2>&1; then
        echo "tests/web/setup.sh: axe-core is missing and there is no npm to install it (apt-get install -y npm)" >&2
        exit 1
    fi
    echo "tests/web/setup.sh: installing axe-core with npm ci" >&2
    (cd "$HERE" && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error)
fi
CHROMIUM="${PGW_CHROMIUM:-/usr/bin/chromium}"
if [ -x "$CHROMIUM" ]; then
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "tests/web/setup.sh: $CHROMIUM is missing and we are not root; run: sudo apt-get install -y chromium" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "tests/web/setup.sh: $CHROMIUM is missing and there is no apt-get to install it" >&2
    exit 1
fi
echo "tests/web/setup.sh: installing chromium with apt-get" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null
test -x "$CHROMIUM"
