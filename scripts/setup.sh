#!/usr/bin/env bash
# Create .venv and install megatrain_nb with what it needs. Idempotent.
# PyTorch is pinned to the 2.13.0 CPU build first so that no multi-GB CUDA build is pulled in;
# on a GPU machine install your CUDA build of torch>=2.4 before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
