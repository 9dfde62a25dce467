#!/usr/bin/env bash
# The main job: install, then train the built-in default with the disk tier and compressed states.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec megatrain-nb demo "$@"
