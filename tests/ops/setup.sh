#!/bin/sh
# Install what tests/test_ops_observability.py runs: Debian's prometheus package (the real
# `prometheus` server and `promtool`, which check the alert rules and answer the dashboard's
# queries). Idempotent: does nothing when promtool is there.
#
#   sh tests/ops/setup.sh          # from the Makefile `test` target, or by hand
set -eu
if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "tests/ops/setup.sh: promtool is missing; run: sudo apt-get install -y prometheus" >&2
    exit 1
fi
echo "tests/ops/setup.sh: installing prometheus (promtool) with apt-get" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package may start a system service where an init system runs; the tests start their own.
command -v promtool >/dev/null
