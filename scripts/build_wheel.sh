#!/usr/bin/env bash
# Build the megatrain-nb wheel with the prebuilt JupyterLab extension inside it, and prove that
# installing it needs no Node.js:
#
#   bash scripts/build_wheel.sh          # needs Node.js >= 20 and jupyterlab (for jlpm) to build
#
# 1. builds the labextension in extension/ (jlpm install, jlpm build:prod) unless already built;
# 2. builds the wheel (MEGATRAIN_NB_REQUIRE_LABEXTENSION=1: no wheel without the extension);
# 3. checks the wheel holds share/jupyter/labextensions/megatrain-nb-lab (package.json,
#    static/remoteEntry.*.js, install.json) and the server-extension config;
# 4. installs it (with --no-deps beside jupyterlab) into a fresh venv whose PATH has no Node.js
#    and checks `jupyter labextension list` reports megatrain-nb-lab enabled and OK.
# Environment: PYTHON (default: python). The wheel lands in dist/.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python}
STAGE=$(mktemp -d /tmp/megatrain-nb-wheel.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT
cd "$ROOT"
step() { printf '\n=== %s\n' "$*"; }
. "$ROOT/extension/wheel_checks.sh"   # check_wheel, check_no_node_install

step "labextension (Node.js $(node --version 2>/dev/null || echo missing))"
if [ ! -f extension/megatrain_nb_lab/labextension/package.json ]; then
  (cd extension && jlpm install --immutable && jlpm build:prod)
fi

step "wheel"
rm -f dist/megatrain_nb-*.whl
MEGATRAIN_NB_REQUIRE_LABEXTENSION=1 "$PY" -m pip wheel --no-deps --no-build-isolation -w dist .
WHEEL=$(ls dist/megatrain_nb-*.whl)
check_wheel "$WHEEL"

step "fresh venv without Node.js: jupyter labextension list"
check_no_node_install "$STAGE" "$WHEEL" --no-deps
echo "OK: $WHEEL carries the JupyterLab extension; installing it needed no Node.js"
