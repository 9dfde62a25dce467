#!/usr/bin/env bash
# Install everything the tests need, then run the whole test suite. Exits non-zero on failure.
#
#   bash scripts/test.sh [pytest args]
#
# Needs: Python 3.10+ and network access to the package indexes; for the JupyterLab part,
# Node.js >= 20 (to build the extension; SKIP_LAB=1 leaves that out) and root for
# `apt-get install chromium` (without chromium the browser tests are skipped, with one line
# saying so).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[test] $*"; }
bash scripts/setup.sh test
. .venv/bin/activate
if [ "${SKIP_LAB:-0}" = 1 ]; then
  say "SKIP_LAB=1: not building the JupyterLab extension"
elif [ -f extension/ci.sh ]; then
  major=$(node --version 2>/dev/null | sed -E 's/^v([0-9]+).*/\1/' || true)
  if [ -z "$major" ] || [ "$major" -lt 20 ]; then
    echo "[test] error: building the JupyterLab extension needs Node.js >= 20 (found: ${major:-none})." \
         "Install it, or run SKIP_LAB=1 bash scripts/test.sh" >&2
    exit 2
  fi
  if ! [ -x /usr/bin/chromium ] && [ "$(id -u)" != 0 ]; then
    say "chromium is missing and installing it needs root: the browser tests will be skipped"
    export SKIP_BROWSER=1
  fi
  say "building and checking the JupyterLab extension (extension/ci.sh; a few minutes)"
  bash extension/ci.sh
fi
say "running the test suite: python -m pytest -q $* (about 12 minutes on 2 cores)"
python -m pytest -q "$@"
