#!/usr/bin/env bash
# Install everything the tests need (Python packages, the JupyterLab extension, headless
# Chromium where apt is available), then run the whole test suite. Exits non-zero on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. .venv/bin/activate
if [ -f extension/ci.sh ]; then
  bash extension/ci.sh
fi
python -m pytest -q "$@"
